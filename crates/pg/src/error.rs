//! SQLSTATE → [`ErrorKind`]. Every Postgres backend maps driver errors through here, so the
//! same failure has the same kind everywhere; message text is never inspected.

use lockstep_core::{Error, ErrorKind};
use tokio_postgres::error::SqlState;

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
    match code.code() {
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
        c if c.starts_with("08") => ErrorKind::ConnectionLost, // connection_exception class
        _ => ErrorKind::Backend,
    }
}

/// Wraps a driver error with its kind and what was being done. When the server reported the
/// error, the message carries its own text and SQLSTATE (`preparing try-acquire: relation
/// "wh_perspective_cursors" does not exist (SQLSTATE 42P01)`), so `Display` says what happened
/// without walking the source chain; the driver error stays the source.
pub fn map_error(err: tokio_postgres::Error, doing: &'static str) -> Error {
    let kind = kind_of(&err);
    let message = match err.as_db_error() {
        Some(db) => format!("{doing}: {} (SQLSTATE {})", db.message(), db.code().code()),
        None => doing.to_owned(),
    };
    Error::new(kind, message).with_source(err)
}

/// [`map_error`] for lockstep's own statements (sibling crates reach it through
/// `lockstep_pg::internal`): a database without lockstep's schema (`42P01 undefined_table`,
/// `42703 undefined_column`, `42883 undefined_function`) also says so — the migrations were not
/// run, or not all of them — and what to do about it. Not for an application's own SQL, where
/// a missing table is the application's.
pub(crate) fn map_statement_error(err: tokio_postgres::Error, doing: &str) -> Error {
    let missing_schema = err.code().is_some_and(|code| {
        *code == SqlState::UNDEFINED_TABLE
            || *code == SqlState::UNDEFINED_COLUMN
            || *code == SqlState::UNDEFINED_FUNCTION
    });
    let kind = kind_of(&err);
    let message = match err.as_db_error() {
        Some(db) if missing_schema => format!(
            "{doing}: {} (SQLSTATE {}); the database lacks lockstep's schema: run the \
             migrations first (lockstep_pg::migrate)",
            db.message(),
            db.code().code()
        ),
        Some(db) => format!("{doing}: {} (SQLSTATE {})", db.message(), db.code().code()),
        None => doing.to_owned(),
    };
    Error::new(kind, message).with_source(err)
}

/// Wraps a pool error: a failed checkout is a lost connection (retryable), a bad pool setup is
/// a backend error.
pub fn map_pool_error(err: deadpool_postgres::PoolError) -> Error {
    use deadpool_postgres::PoolError;
    let kind = match &err {
        PoolError::Backend(e) => kind_of(e),
        PoolError::Timeout(_) => ErrorKind::ConnectionLost,
        PoolError::Closed => ErrorKind::ConnectionLost,
        _ => ErrorKind::Backend,
    };
    let message = match &err {
        PoolError::Backend(e) => match e.as_db_error() {
            Some(db) => format!(
                "getting a connection from the pool: {} (SQLSTATE {})",
                db.message(),
                db.code().code()
            ),
            None => "getting a connection from the pool".to_owned(),
        },
        _ => "getting a connection from the pool".to_owned(),
    };
    Error::new(kind, message).with_source(err)
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
            kind_of_sqlstate(&SqlState::SYNTAX_ERROR),
            ErrorKind::Backend
        );
    }
}
