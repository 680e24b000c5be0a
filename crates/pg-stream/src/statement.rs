//! One statement on a pooled connection — the block every locker and admin operation runs:
//! check a connection out of the locker's pool (tokio-postgres or sqlx:
//! [`Connections`](lockstep_pg::driver::Connections)), run the statement with bound parameters,
//! return the connection, and map driver errors to [`ErrorKind`](lockstep_core::ErrorKind)s by
//! SQLSTATE. Rows are read with [`column`], which reports a typed error instead of panicking.
//!
//! On tokio-postgres, connected directly, the statement is prepared once per connection
//! (`prepare_cached`) and then runs in one round trip. Behind a transaction pooler (PgBouncer
//! `pool_mode = transaction`) a prepared statement lives in one server session while the
//! client's next statement may run in another: there the statement is sent unnamed with its
//! parameters' types (`query_typed`: parse, bind and execute in one round trip, parsed every
//! time). A prepared statement that vanished (`26000`) or a name another client's session
//! already took (`42P05`) proves such a pooler: the statement, which did not run, runs again
//! unnamed, and the handle takes the unnamed path from then on.
//!
//! On sqlx the statement runs as the application's pool runs any query (sqlx prepares and
//! caches it per connection; behind a transaction pooler the pool is configured for it), and an
//! abandoned statement's connection is closed without a cancel request: see
//! `lockstep_pg::driver::pool`.

use lockstep_core::{Error, ErrorKind, Result, StreamId};
use lockstep_pg::driver::{Column, DbError, Param, PooledConnection, Row, Sending, Timestamp};
use time::OffsetDateTime;

use crate::locker::PgStreamLocker;

/// What a statement's result is read as: `Option<Row>` (at most one row), `Vec<Row>` (every
/// row), or `u64` (the number of rows affected).
pub(crate) trait Outcome: Sized + Send {
    /// Runs `sql` on `conn`, sent as `sending` says, and reads its result.
    fn run<'a>(
        conn: PooledConnection,
        sql: &'a str,
        params: &'a [&'a dyn Param],
        sending: Sending,
        locker: &'a PgStreamLocker,
    ) -> impl std::future::Future<Output = std::result::Result<Self, DbError>> + Send + 'a;
}

impl Outcome for Option<Row> {
    async fn run<'a>(
        conn: PooledConnection,
        sql: &'a str,
        params: &'a [&'a dyn Param],
        sending: Sending,
        locker: &'a PgStreamLocker,
    ) -> std::result::Result<Self, DbError> {
        let mut rows = conn.query(sql, params, sending, &locker.cancel).await?;
        match rows.len() {
            0 => Ok(None),
            1 => Ok(rows.pop()),
            n => Err(DbError::client(format!(
                "expected at most one row, the statement returned {n}"
            ))),
        }
    }
}

impl Outcome for Vec<Row> {
    fn run<'a>(
        conn: PooledConnection,
        sql: &'a str,
        params: &'a [&'a dyn Param],
        sending: Sending,
        locker: &'a PgStreamLocker,
    ) -> impl std::future::Future<Output = std::result::Result<Self, DbError>> + Send + 'a {
        conn.query(sql, params, sending, &locker.cancel)
    }
}

impl Outcome for u64 {
    fn run<'a>(
        conn: PooledConnection,
        sql: &'a str,
        params: &'a [&'a dyn Param],
        sending: Sending,
        locker: &'a PgStreamLocker,
    ) -> impl std::future::Future<Output = std::result::Result<Self, DbError>> + Send + 'a {
        conn.execute(sql, params, sending, &locker.cancel)
    }
}

/// Whether a failure says the server session changed under a prepared statement: it vanished
/// (`26000 invalid_sql_statement_name`) or its name was taken by another client's session
/// (`42P05 duplicate_prepared_statement`). Neither happens on a connection of its own.
fn session_changed(e: &DbError) -> bool {
    matches!(e.code(), Some("26000" | "42P05"))
}

impl PgStreamLocker {
    /// Runs `sql` (one of [`crate::sql`]) with `params` on a pooled connection, one round trip
    /// (once the statement is prepared on that connection, when it is prepared). `doing` names
    /// the operation in errors.
    ///
    /// Cancel-safe: if the returned future is dropped while the statement runs, the connection
    /// is closed instead of going back to the pool mid-statement, and on tokio-postgres a cancel
    /// request ends the statement at the server (no lease is written for a caller that is gone).
    pub(crate) async fn run<O: Outcome>(
        &self,
        sql: &'static str,
        params: &[&dyn Param],
        doing: &'static str,
    ) -> Result<O> {
        self.run_statement(sql, params, doing)
            .await?
            .map_err(|e| statement_error(e, doing))
    }

    /// [`run`](Self::run), with a failure *of the statement itself* handed back as the driver's
    /// error (`Ok(Err(_))`) for the caller to read its SQLSTATE (try-acquire answers `55P03`
    /// from its `NOWAIT` as an outcome). Checking a connection out fails as a typed error, as in
    /// `run`. The connection is handled exactly as by `run`.
    pub(crate) async fn run_statement<O: Outcome>(
        &self,
        sql: &'static str,
        params: &[&dyn Param],
        doing: &'static str,
    ) -> Result<std::result::Result<O, DbError>> {
        if !self.connections.is_sqlx() && !self.pooler.is_transaction_pooler() {
            // Prepared once per connection and run by name. A failure to prepare because the
            // name is taken is the statement's failure: it proves a transaction pooler.
            match self.run_sent(sql, params, Sending::Prepared).await? {
                Err(e) if session_changed(&e) => {
                    self.pooler.seen(doing);
                }
                ran => return Ok(ran),
            }
        }
        self.run_sent(sql, params, Sending::Unnamed).await
    }

    async fn run_sent<O: Outcome>(
        &self,
        sql: &'static str,
        params: &[&dyn Param],
        sending: Sending,
    ) -> Result<std::result::Result<O, DbError>> {
        let conn = self.checkout().await?;
        Ok(O::run(conn, sql, params, sending, self).await)
    }

    async fn checkout(&self) -> Result<PooledConnection> {
        // Bounded: never longer than the keepalive interval, so a renew waiting for a
        // connection cannot outlive the lease it is meant to keep (an exhausted pool is then a
        // typed, retryable error instead of a hang).
        let wait = lockstep_core::StreamLocker::options(self)
            .keepalive_interval()
            .min(lockstep_pg::DEFAULT_CHECKOUT_WAIT);
        self.connections.checkout(wait).await
    }
}

/// [`lockstep_pg::map_error`], and a database without lockstep's schema (`42P01
/// undefined_table`, `42703 undefined_column`, `42883 undefined_function` on lockstep's own
/// statements) says so: the migrations were not run, or not all of them (the helper every
/// lockstep Postgres backend shares), for either driver.
pub(crate) fn statement_error(err: DbError, doing: &'static str) -> Error {
    lockstep_pg::internal::db_statement_error(err, doing)
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

/// A `timestamptz` column: [`column`], read on either driver without a panic on a time lockstep
/// cannot hold (`'infinity'`, past year 9999).
pub(crate) fn time_column(
    row: &Row,
    idx: usize,
    name: &str,
    at: RowName<'_>,
) -> Result<OffsetDateTime> {
    column::<Timestamp>(row, idx, name, at).map(|t| t.0)
}

/// A nullable `timestamptz` column, as [`time_column`].
pub(crate) fn opt_time_column(
    row: &Row,
    idx: usize,
    name: &str,
    at: RowName<'_>,
) -> Result<Option<OffsetDateTime>> {
    column::<Option<Timestamp>>(row, idx, name, at).map(|t| t.map(|t| t.0))
}

/// Column `idx` (named `name`) of `row` (the cursor row `at`), or a typed
/// [`ErrorKind::Backend`] error naming the row and the column, with the driver's error as its
/// source (never a panic).
pub(crate) fn column<T: Column>(row: &Row, idx: usize, name: &str, at: RowName<'_>) -> Result<T> {
    row.get(idx).map_err(|e| {
        Error::new(
            ErrorKind::Backend,
            format!(
                "cannot read column {name} of {at} (a value out of the range lockstep reads, \
                 e.g. a timestamp past year 9999 or 'infinity'?)"
            ),
        )
        .with_source(e)
    })
}
