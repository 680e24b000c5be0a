//! One statement on a pooled connection — the block every locker and admin operation runs:
//! check a connection out of the pool, run the statement with bound parameters, return the
//! connection, and map driver errors to [`ErrorKind`](lockstep_core::ErrorKind)s by SQLSTATE.
//! Rows are read with [`column`], which reports a typed error instead of panicking.
//!
//! Connected directly, the statement is prepared once per connection (`prepare_cached`) and
//! then runs in one round trip. Behind a transaction pooler (PgBouncer `pool_mode =
//! transaction`) a prepared statement lives in one server session while the client's next
//! statement may run in another: there the statement is sent unnamed with its parameters'
//! types (`query_typed`: parse, bind and execute in one round trip, parsed every time). A
//! prepared statement that vanished (`26000`) or a name another client's session already took
//! (`42P05`) proves such a pooler: the statement, which did not run, runs again unnamed, and the
//! handle takes the unnamed path from then on.

use std::fmt::Display;
use std::future::Future;

use lockstep_core::{Error, ErrorKind, Result, StreamId};
use lockstep_pg::internal::{CancelOnDrop, cancel_on_drop};
use tokio_postgres::error::SqlState;
use tokio_postgres::row::RowIndex;
use tokio_postgres::types::{FromSql, ToSql, Type};
use tokio_postgres::{Client, Row, Statement};

use crate::locker::PgStreamLocker;

/// A statement's parameters with their types (every parameter of [`crate::sql`] is cast, so
/// its type is fixed by the text).
pub(crate) type Params<'a> = [(&'a (dyn ToSql + Sync), Type)];

/// What a statement's result is read as: `Option<Row>` (at most one row), `Vec<Row>` (every
/// row), or `u64` (the number of rows affected).
pub(crate) trait Outcome: Sized {
    /// Runs the prepared `statement` on `client` and reads its result.
    fn run<'a>(
        client: &'a Client,
        statement: &'a Statement,
        params: &'a [&'a (dyn ToSql + Sync)],
    ) -> impl Future<Output = Result<Self, tokio_postgres::Error>> + Send + 'a;

    /// Runs `sql` unnamed (one round trip, nothing left in the server session) and reads its
    /// result.
    fn run_unnamed<'a>(
        client: &'a Client,
        sql: &'a str,
        params: &'a Params<'a>,
    ) -> impl Future<Output = Result<Self, tokio_postgres::Error>> + Send + 'a;
}

impl Outcome for Option<Row> {
    fn run<'a>(
        client: &'a Client,
        statement: &'a Statement,
        params: &'a [&'a (dyn ToSql + Sync)],
    ) -> impl Future<Output = Result<Self, tokio_postgres::Error>> + Send + 'a {
        client.query_opt(statement, params)
    }

    fn run_unnamed<'a>(
        client: &'a Client,
        sql: &'a str,
        params: &'a Params<'a>,
    ) -> impl Future<Output = Result<Self, tokio_postgres::Error>> + Send + 'a {
        client.query_typed_opt(sql, params)
    }
}

impl Outcome for Vec<Row> {
    fn run<'a>(
        client: &'a Client,
        statement: &'a Statement,
        params: &'a [&'a (dyn ToSql + Sync)],
    ) -> impl Future<Output = Result<Self, tokio_postgres::Error>> + Send + 'a {
        client.query(statement, params)
    }

    fn run_unnamed<'a>(
        client: &'a Client,
        sql: &'a str,
        params: &'a Params<'a>,
    ) -> impl Future<Output = Result<Self, tokio_postgres::Error>> + Send + 'a {
        client.query_typed(sql, params)
    }
}

impl Outcome for u64 {
    fn run<'a>(
        client: &'a Client,
        statement: &'a Statement,
        params: &'a [&'a (dyn ToSql + Sync)],
    ) -> impl Future<Output = Result<Self, tokio_postgres::Error>> + Send + 'a {
        client.execute(statement, params)
    }

    fn run_unnamed<'a>(
        client: &'a Client,
        sql: &'a str,
        params: &'a Params<'a>,
    ) -> impl Future<Output = Result<Self, tokio_postgres::Error>> + Send + 'a {
        client.execute_typed(sql, params)
    }
}

/// Whether a failure says the server session changed under a prepared statement: it vanished
/// (`26000 invalid_sql_statement_name`) or its name was taken by another client's session
/// (`42P05 duplicate_prepared_statement`). Neither happens on a connection of its own.
fn session_changed(e: &tokio_postgres::Error) -> bool {
    matches!(
        e.code(),
        Some(c) if *c == SqlState::INVALID_SQL_STATEMENT_NAME || *c == SqlState::DUPLICATE_PSTATEMENT
    )
}

impl PgStreamLocker {
    /// Runs `sql` (one of [`crate::sql`]) with `params` on a pooled connection, one round trip
    /// (once the statement is prepared on that connection, when it is prepared). `doing` names
    /// the operation in errors.
    ///
    /// Cancel-safe: if the returned future is dropped while the statement runs, a cancel
    /// request ends it at the server (no lease is written for a caller that is gone) and the
    /// connection is closed instead of going back to the pool mid-statement.
    pub(crate) async fn run<O: Outcome>(
        &self,
        sql: &'static str,
        params: &Params<'_>,
        doing: &'static str,
    ) -> Result<O> {
        self.run_statement(sql, params, doing)
            .await?
            .map_err(|e| statement_error(e, doing))
    }

    /// [`run`](Self::run), with a failure *of the statement itself* handed back as the driver's
    /// error (`Ok(Err(_))`) for the caller to read its SQLSTATE (try-acquire answers `55P03`
    /// from its `NOWAIT` as an outcome). Checking a connection out and preparing the statement
    /// fail as typed errors, as in `run`. The connection is handled exactly as by `run`.
    pub(crate) async fn run_statement<O: Outcome>(
        &self,
        sql: &'static str,
        params: &Params<'_>,
        doing: &'static str,
    ) -> Result<Result<O, tokio_postgres::Error>> {
        if !self.pooler.is_transaction_pooler() {
            match self.run_prepared(sql, params, doing).await? {
                Err(e) if session_changed(&e) => {
                    self.pooler.seen(doing);
                }
                ran => return Ok(ran),
            }
        }
        self.run_unnamed(sql, params).await
    }

    /// The statement prepared once per connection and run by name. A failure to prepare
    /// because the name is taken is handed back as the statement's failure (the caller
    /// recognises a transaction pooler by it).
    async fn run_prepared<O: Outcome>(
        &self,
        sql: &'static str,
        params: &Params<'_>,
        doing: &'static str,
    ) -> Result<Result<O, tokio_postgres::Error>> {
        let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(value, _)| *value).collect();
        let conn = self.checkout().await?;
        let statement = match conn.prepare_cached(sql).await {
            Ok(statement) => statement,
            Err(e) if session_changed(&e) => return Ok(Err(e)),
            Err(e) => return Err(statement_error(e, doing)),
        };
        let guard = Abandon {
            cancel: Some(cancel_on_drop(&self.cancel, conn.cancel_token())),
            conn: Some(conn),
        };
        let outcome = O::run(guard.client(), &statement, &values).await;
        // Finished (either way): nothing to cancel, and the connection goes back to the pool
        // before the caller reads the result — unless it was lost, then it is closed.
        guard.disarm(outcome.as_ref().err());
        Ok(outcome)
    }

    /// The statement sent unnamed with its parameters' types: one round trip, nothing left
    /// in the server session.
    async fn run_unnamed<O: Outcome>(
        &self,
        sql: &'static str,
        params: &Params<'_>,
    ) -> Result<Result<O, tokio_postgres::Error>> {
        let conn = self.checkout().await?;
        let guard = Abandon {
            cancel: Some(cancel_on_drop(&self.cancel, conn.cancel_token())),
            conn: Some(conn),
        };
        let outcome = O::run_unnamed(guard.client(), sql, params).await;
        guard.disarm(outcome.as_ref().err());
        Ok(outcome)
    }

    async fn checkout(&self) -> Result<deadpool_postgres::Object> {
        // Bounded: never longer than the keepalive interval, so a renew waiting for a
        // connection cannot outlive the lease it is meant to keep (an exhausted pool is then a
        // typed, retryable error instead of a hang).
        let wait = lockstep_core::StreamLocker::options(self)
            .keepalive_interval()
            .min(lockstep_pg::DEFAULT_CHECKOUT_WAIT);
        lockstep_pg::checkout(&self.pool, wait).await
    }
}

/// [`lockstep_pg::map_error`], and a database without lockstep's schema (`42P01
/// undefined_table`, `42703 undefined_column`, `42883 undefined_function` on lockstep's own
/// statements) says so: the migrations were not run, or not all of them (the helper every
/// lockstep Postgres backend shares).
pub(crate) fn statement_error(err: tokio_postgres::Error, doing: &'static str) -> Error {
    lockstep_pg::internal::statement_error(err, doing)
}

/// Armed while a statement runs: dropped armed (the caller's future was dropped), it sends a
/// cancel request for the statement and closes the connection (never pooled mid-statement).
struct Abandon {
    cancel: Option<CancelOnDrop>,
    conn: Option<deadpool_postgres::Object>,
}

impl Abandon {
    fn client(&self) -> &Client {
        match &self.conn {
            Some(conn) => conn,
            None => unreachable!("the connection is only taken on disarm or drop"),
        }
    }

    fn disarm(mut self, error: Option<&tokio_postgres::Error>) {
        if let Some(cancel) = self.cancel.take() {
            cancel.disarm();
        }
        if let Some(conn) = self.conn.take() {
            lockstep_pg::pool::return_or_discard(conn, error);
        }
    }
}

impl Drop for Abandon {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Still armed: cancel the statement (the guard's own drop) and close the connection.
            drop(self.cancel.take());
            drop(deadpool_postgres::Object::take(conn));
            tracing::debug!("lease statement abandoned: cancelled, connection discarded");
        }
    }
}

/// Which cursor row a statement read, for errors: a value lockstep cannot read (a timestamp out
/// of range, `'infinity'` written by hand) is a typed error naming the row, never a panic.
#[derive(Clone, Copy)]
pub(crate) enum RowName<'a> {
    /// The row of one pair.
    Pair(StreamId, &'a str),
    /// A row of a listing (read before its key is known).
    Listed,
    /// The fleet row of one worker instance (by its id as stored).
    Instance(uuid::Uuid),
}

impl std::fmt::Display for RowName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RowName::Pair(stream, perspective) => {
                write!(
                    f,
                    "cursor row (stream {stream}, perspective {perspective:?})"
                )
            }
            RowName::Listed => f.write_str("a listed cursor row"),
            RowName::Instance(id) => write!(f, "the fleet row of worker instance {id}"),
        }
    }
}

/// Column `idx` of `row` (the cursor row `at`), or a typed [`ErrorKind::Backend`] error naming
/// the row and the column, with the driver's error as its source (never `Row::get`'s panic).
pub(crate) fn column<'r, T, I>(row: &'r Row, idx: I, at: RowName<'_>) -> Result<T>
where
    T: FromSql<'r>,
    I: RowIndex + Display,
{
    row.try_get(&idx).map_err(|e| {
        Error::new(
            ErrorKind::Backend,
            format!(
                "cannot read column {idx} of {at} (a value out of the range lockstep reads, \
                 e.g. a timestamp past year 9999 or 'infinity'?)"
            ),
        )
        .with_source(e)
    })
}
