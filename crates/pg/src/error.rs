//! SQLSTATE → [`ErrorKind`]. Every Postgres backend maps driver errors through here, so the
//! same failure has the same kind everywhere; message text is never inspected.

use lockstep_core::{Error, ErrorKind};
use tokio_postgres::error::SqlState;

use crate::driver::DbError;

/// The kind of a driver error: by SQLSTATE when the server sent one, else connection loss for
/// closed connections and I/O failures. (Sibling crates reach it through
/// `lockstep_pg::internal`; applications use [`map_error`].)
pub(crate) fn kind_of(err: &tokio_postgres::Error) -> ErrorKind {
    if let Some(code) = err.code() {
        return kind_of_sqlstate(code);
    }
    if err.is_closed() || std::error::Error::source(err).is_some_and(|s| s.is::<std::io::Error>()) {
        return ErrorKind::ConnectionLost;
    }
    ErrorKind::Backend
}

/// The kind of one SQLSTATE.
pub(crate) fn kind_of_sqlstate(code: &SqlState) -> ErrorKind {
    kind_of_code(code.code())
}

/// The kind of one SQLSTATE, as text (what both drivers report).
pub(crate) fn kind_of_code(code: &str) -> ErrorKind {
    match code {
        "55P03" => ErrorKind::LockTimeout,        // lock_not_available
        "57014" => ErrorKind::Cancelled,          // query_canceled
        "40P01" => ErrorKind::Deadlock,           // deadlock_detected
        "40001" => ErrorKind::Conflict,           // serialization_failure
        "25P02" => ErrorKind::TransactionAborted, // in_failed_sql_transaction
        "23505" => ErrorKind::Conflict,           // unique_violation
        "22001" | "22P02" | "23514" => ErrorKind::InvalidInput, // too long, bad text, check
        // admin_shutdown, crash_shutdown, cannot_connect_now, idle-session/idle-in-transaction
        // timeouts end the connection
        "57P01" | "57P02" | "57P03" | "57P05" | "25P03" => ErrorKind::ConnectionLost,
        // read_only_sql_transaction: the connection reached a server that cannot write — a
        // standby, or a primary demoted by a failover. The connection is discarded like a lost
        // one, and the next (through `target_session_attrs=read-write`) finds the primary.
        "25006" => ErrorKind::ConnectionLost,
        c if c.starts_with("08") => ErrorKind::ConnectionLost, // connection_exception class
        _ => ErrorKind::Backend,
    }
}

/// What the driver says went wrong, once: the server's message and SQLSTATE for an error the
/// server sent (`relation "t" does not exist (SQLSTATE 42P01)`), else the innermost cause of a
/// connection failure (`Connection refused (os error 111)`, `failed to lookup address
/// information: …`, `timeout waiting for server`), else the driver's own words.
pub fn describe(err: &tokio_postgres::Error) -> String {
    if let Some(db) = err.as_db_error() {
        let mut text = format!("{} (SQLSTATE {})", db.message(), db.code().code());
        if let Some(detail) = db.detail() {
            text.push_str("; ");
            text.push_str(detail);
        }
        return text;
    }
    // The driver's own text ("error connecting to server") says where; the innermost source
    // says why. Both, once each.
    let mut innermost: Option<&(dyn std::error::Error + 'static)> = None;
    let mut next = std::error::Error::source(err);
    while let Some(cause) = next {
        innermost = Some(cause);
        next = cause.source();
    }
    match innermost {
        Some(cause) => format!("{err}: {cause}"),
        None => err.to_string(),
    }
}

/// Wraps a driver error with its kind and what was being done: `{doing}: {what the driver
/// says}` ([`describe`]), so `Display` tells the server's message and SQLSTATE (or the I/O
/// cause) exactly once. The driver error is kept as [`Error::underlying`] (for downcasting),
/// not as the `source()`, whose text would repeat the message in a printed chain.
pub fn map_error(err: tokio_postgres::Error, doing: &str) -> Error {
    let kind = kind_of(&err);
    Error::new(kind, format!("{doing}: {}", describe(&err))).with_cause_in_message(err)
}

/// [`map_error`] for lockstep's own statements (sibling crates reach it through
/// `lockstep_pg::internal`): a database without lockstep's schema (`42P01 undefined_table`,
/// `42703 undefined_column`, `42883 undefined_function`) also says so — the migrations were not
/// run, or not all of them — and what to do about it. Not for an application's own SQL, where
/// a missing table is the application's.
pub(crate) fn map_statement_error(err: tokio_postgres::Error, doing: &str) -> Error {
    map_db_statement_error(DbError::from(err), doing)
}

/// The kind of a driver error of either driver ([`DbError`]): by SQLSTATE when the server sent
/// one, else connection loss when the connection is gone.
pub(crate) fn kind_of_db(err: &DbError) -> ErrorKind {
    match err.code() {
        Some(code) => kind_of_code(code),
        None if err.is_connection_lost() => ErrorKind::ConnectionLost,
        None => ErrorKind::Backend,
    }
}

/// A driver error of either driver as text: the server's message with its SQLSTATE and
/// detail, or the driver's error and its innermost cause.
pub(crate) fn describe_db(err: &DbError) -> String {
    if let (Some(code), Some(message)) = (err.code(), err.message()) {
        let mut text = format!("{message} (SQLSTATE {code})");
        if let Some(detail) = err.detail() {
            text.push_str("; ");
            text.push_str(detail);
        }
        return text;
    }
    let source = std::error::Error::source(err);
    let mut innermost: Option<&(dyn std::error::Error + 'static)> = None;
    let mut next = source.and_then(std::error::Error::source);
    while let Some(cause) = next {
        innermost = Some(cause);
        next = cause.source();
    }
    match (source, innermost) {
        (Some(top), Some(cause)) => format!("{top}: {cause}"),
        (Some(top), None) => top.to_string(),
        (None, _) => "driver error".to_owned(),
    }
}

/// [`map_error`] of either driver.
pub(crate) fn map_db_error(err: DbError, doing: &str) -> Error {
    let kind = kind_of_db(&err);
    Error::new(kind, format!("{doing}: {}", describe_db(&err)))
        .with_cause_in_message(err.into_source())
}

/// [`map_statement_error`] of either driver.
pub(crate) fn map_db_statement_error(err: DbError, doing: &str) -> Error {
    let missing_schema = matches!(err.code(), Some("42P01" | "42703" | "42883"));
    let kind = kind_of_db(&err);
    let message = if missing_schema {
        format!(
            "{doing}: {}; the database lacks lockstep's schema: run the migrations first \
             (lockstep_pg::migrate)",
            describe_db(&err)
        )
    } else {
        format!("{doing}: {}", describe_db(&err))
    };
    Error::new(kind, message).with_cause_in_message(err.into_source())
}

/// Wraps a pool error: a failed checkout is a lost connection (retryable), a bad pool setup is
/// a backend error. The message says why, once: the server's refusal (`database "x" does not
/// exist (SQLSTATE 3D000)`), the I/O cause (`Connection refused`), or which timeout ran out.
pub fn map_pool_error(err: deadpool_postgres::PoolError) -> Error {
    map_pool_error_for(err, None)
}

/// Why a checkout failed, once: the server's refusal (`database "x" does not exist (SQLSTATE
/// 3D000)`), the I/O cause (`error connecting to server: Connection refused (os error 111)`), or
/// which timeout ran out.
pub fn describe_pool_error(err: &deadpool_postgres::PoolError) -> String {
    use deadpool_postgres::{PoolError, TimeoutType};
    match err {
        PoolError::Backend(e) => describe(e),
        PoolError::Timeout(TimeoutType::Wait) => "no connection came free in time".to_owned(),
        PoolError::Timeout(TimeoutType::Create) => "the server did not answer in time".to_owned(),
        PoolError::Timeout(TimeoutType::Recycle) => {
            "checking an idle connection timed out".to_owned()
        }
        PoolError::Closed => "the pool is closed".to_owned(),
        other => other.to_string(),
    }
}

/// [`map_pool_error`], naming where the pool connects (`database "app" on 127.0.0.1:5432 as
/// user "app"` — never a password) when it is known.
pub(crate) fn map_pool_error_for(err: deadpool_postgres::PoolError, target: Option<&str>) -> Error {
    use deadpool_postgres::{PoolError, TimeoutType};
    let kind = match &err {
        PoolError::Backend(e) => kind_of(e),
        PoolError::Timeout(_) | PoolError::Closed => ErrorKind::ConnectionLost,
        _ => ErrorKind::Backend,
    };
    let to = target.map(|t| format!(" to {t}")).unwrap_or_default();
    let doing = match &err {
        PoolError::Backend(_) | PoolError::Timeout(TimeoutType::Create) => "connecting",
        _ => "getting a pooled connection",
    };
    let message = format!("{doing}{to}: {}", describe_pool_error(&err));
    Error::new(kind, message).with_cause_in_message(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_related_sqlstates_have_their_kinds() {
        assert_eq!(
            kind_of_sqlstate(&SqlState::LOCK_NOT_AVAILABLE),
            ErrorKind::LockTimeout
        );
        assert_eq!(
            kind_of_sqlstate(&SqlState::QUERY_CANCELED),
            ErrorKind::Cancelled
        );
        assert_eq!(
            kind_of_sqlstate(&SqlState::T_R_DEADLOCK_DETECTED),
            ErrorKind::Deadlock
        );
        assert_eq!(
            kind_of_sqlstate(&SqlState::IN_FAILED_SQL_TRANSACTION),
            ErrorKind::TransactionAborted
        );
        assert_eq!(
            kind_of_sqlstate(&SqlState::UNIQUE_VIOLATION),
            ErrorKind::Conflict
        );
        assert_eq!(
            kind_of_sqlstate(&SqlState::ADMIN_SHUTDOWN),
            ErrorKind::ConnectionLost
        );
        assert_eq!(
            kind_of_sqlstate(&SqlState::CONNECTION_FAILURE),
            ErrorKind::ConnectionLost
        );
        assert_eq!(
            kind_of_sqlstate(&SqlState::READ_ONLY_SQL_TRANSACTION),
            ErrorKind::ConnectionLost,
            "a write on a standby or a demoted primary: reconnect to the primary"
        );
        assert_eq!(
            kind_of_sqlstate(&SqlState::SYNTAX_ERROR),
            ErrorKind::Backend
        );
    }
}
