//! Pooled connections of either driver, for statements that run on a connection of their own
//! rather than in a caller's transaction (the stream-lease operations):
//!
//! - [`Connections`]: a `deadpool_postgres` pool, or (feature `sqlx`) an `sqlx::PgPool`.
//! - [`Connections::checkout`]: a connection, waiting at most a bounded time (an exhausted
//!   pool is a retryable [`ErrorKind::ConnectionLost`](lockstep_core::ErrorKind::ConnectionLost), never a hang).
//! - [`PooledConnection`]: an [`Executor`] of the seam; [`PooledConnection::query`] and
//!   [`PooledConnection::execute`] run one statement cancel-safely and hand the connection
//!   back — to the pool, or closed when the connection was lost or the caller gave up.
//!
//! On tokio-postgres a statement is sent [`Sending::Prepared`] (prepared once per connection,
//! `prepare_cached`, then run by name: one round trip) or [`Sending::Unnamed`] (with its
//! parameters' types, `query_typed`: one round trip, nothing left in the server session — the
//! way behind a transaction pooler). A statement abandoned mid-flight (its future dropped) is
//! ended with a cancel request (the [`LockQueue`]'s TLS connector) and its connection closed.
//!
//! On sqlx both ways run the statement as the application's pool runs any query: sqlx prepares
//! each statement once per connection and caches it, which a transaction pooler cannot keep
//! (behind PgBouncer, configure the pool with `statement_cache_capacity(0)`, or use PgBouncer
//! ≥ 1.21 with `max_prepared_statements`). An abandoned statement's connection is closed, never
//! pooled, and **no cancel is sent**: sqlx hands out no cancel key, and `pg_cancel_backend`
//! needs the backend's pid, one more round trip per checkout (sqlx does not expose the pid it
//! received). Measured against a local server, that round trip is 0.1–0.3 ms on a 0.65–1.3 ms
//! renew (checkout and statement); over a network, where the round trip is the cost, it
//! doubles every call — to end sooner a statement whose caller is gone. Such a statement runs
//! to its end at the server (try-acquire is `NOWAIT`; the others wait only while another
//! transaction holds the cursor row, such as a fenced commit), keeping its backend until then; it
//! is a statement a later call of the same caller would run, and the lease statements act only
//! on the caller's own lease at its epoch, so what it may leave behind is what that later call
//! would have left: a renewed expiry, a released lease, or a lease taken for the caller, which
//! its next try-acquire re-enters and which otherwise expires on its own.

use std::fmt;
use std::time::Duration;

use futures_util::future::BoxFuture;
use lockstep_core::Result;
use tokio_postgres::types::{ToSql, Type};

use super::{DbError, Executor, Param, Row};
use crate::advisory::{LockQueue, cancel_on_drop};
use crate::cancel::CancelOnDrop;

/// The pool lockstep's pooled statements check their connections out of.
#[derive(Clone)]
pub enum Connections {
    /// A `deadpool_postgres` pool (tokio-postgres).
    TokioPostgres(deadpool_postgres::Pool),
    /// An application's sqlx pool.
    #[cfg(feature = "sqlx")]
    Sqlx(sqlx::PgPool),
}

impl fmt::Debug for Connections {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Connections::TokioPostgres(pool) => f
                .debug_tuple("Connections::TokioPostgres")
                .field(&pool.status())
                .finish(),
            #[cfg(feature = "sqlx")]
            Connections::Sqlx(pool) => f
                .debug_struct("Connections::Sqlx")
                .field("size", &pool.size())
                .field("idle", &pool.num_idle())
                .finish(),
        }
    }
}

/// How a statement is sent on a pooled connection (tokio-postgres; sqlx prepares and caches
/// every statement itself, whichever is asked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sending {
    /// Prepared once per connection, then run by name.
    Prepared,
    /// Unnamed, with its parameters' types: parsed every time, nothing left in the session.
    Unnamed,
}

impl Connections {
    /// A connection of the pool, waiting at most `wait` for one ([`crate::checkout`] on
    /// tokio-postgres; on sqlx the same bound, the same error).
    pub async fn checkout(&self, wait: Duration) -> Result<PooledConnection> {
        match self {
            Connections::TokioPostgres(pool) => crate::pool::checkout(pool, wait)
                .await
                .map(|conn| PooledConnection(Conn::TokioPostgres(conn))),
            #[cfg(feature = "sqlx")]
            Connections::Sqlx(pool) => sqlx_checkout(pool, wait).await,
        }
    }

    /// Whether this is an sqlx pool (which prepares statements itself: [`Sending`] makes no
    /// difference there).
    pub fn is_sqlx(&self) -> bool {
        match self {
            Connections::TokioPostgres(_) => false,
            #[cfg(feature = "sqlx")]
            Connections::Sqlx(_) => true,
        }
    }
}

#[cfg(feature = "sqlx")]
async fn sqlx_checkout(pool: &sqlx::PgPool, wait: Duration) -> Result<PooledConnection> {
    use lockstep_core::{Error, ErrorKind};
    match tokio::time::timeout(wait, pool.acquire()).await {
        Ok(Ok(conn)) => Ok(PooledConnection(Conn::Sqlx(tokio::sync::Mutex::new(conn)))),
        Ok(Err(e)) => {
            let e = DbError::from(e);
            Err(Error::new(
                crate::error::kind_of_db(&e),
                format!(
                    "getting a pooled connection: {}",
                    crate::error::describe_db(&e)
                ),
            )
            .with_source(e))
        }
        Err(_) => Err(Error::new(
            ErrorKind::ConnectionLost,
            format!(
                "no pooled connection within {wait:?}: pool exhausted ({} open, {} idle) or \
                 the server is slow to accept connections",
                pool.size(),
                pool.num_idle()
            ),
        )),
    }
}

/// A connection checked out of [`Connections`]: back to the pool when dropped.
pub struct PooledConnection(Conn);

enum Conn {
    TokioPostgres(deadpool_postgres::Object),
    // Locked for `&self` statements ([`Executor`]); `query`/`execute` own it.
    #[cfg(feature = "sqlx")]
    Sqlx(tokio::sync::Mutex<sqlx::pool::PoolConnection<sqlx::Postgres>>),
}

impl fmt::Debug for PooledConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            Conn::TokioPostgres(_) => "PooledConnection(tokio-postgres)",
            #[cfg(feature = "sqlx")]
            Conn::Sqlx(_) => "PooledConnection(sqlx)",
        })
    }
}

/// What a statement's result is read as.
enum Want {
    Rows,
    Affected,
}

enum Ran {
    Rows(Vec<Row>),
    Affected(u64),
}

impl PooledConnection {
    /// Runs `sql` with `params`, sent as `sending` says: its rows. Then the connection goes back
    /// to the pool, or is closed if the connection was lost.
    ///
    /// Cancel-safe: dropped while the statement runs, the statement is cancelled (tokio-postgres:
    /// a cancel request with `cancel`'s TLS connector; sqlx: none, see the module) and the
    /// connection closed, never pooled mid-statement.
    pub async fn query(
        self,
        sql: &str,
        params: &[&dyn Param],
        sending: Sending,
        cancel: &LockQueue,
    ) -> std::result::Result<Vec<Row>, DbError> {
        match self.run(sql, params, sending, cancel, Want::Rows).await? {
            Ran::Rows(rows) => Ok(rows),
            Ran::Affected(_) => unreachable!("rows were asked for"),
        }
    }

    /// [`query`](Self::query), for the number of rows the statement affected.
    pub async fn execute(
        self,
        sql: &str,
        params: &[&dyn Param],
        sending: Sending,
        cancel: &LockQueue,
    ) -> std::result::Result<u64, DbError> {
        match self
            .run(sql, params, sending, cancel, Want::Affected)
            .await?
        {
            Ran::Affected(n) => Ok(n),
            Ran::Rows(_) => unreachable!("the count was asked for"),
        }
    }

    async fn run(
        self,
        sql: &str,
        params: &[&dyn Param],
        sending: Sending,
        cancel: &LockQueue,
        want: Want,
    ) -> std::result::Result<Ran, DbError> {
        match self.0 {
            Conn::TokioPostgres(conn) => {
                tokio_postgres_run(conn, sql, params, sending, cancel, want).await
            }
            #[cfg(feature = "sqlx")]
            Conn::Sqlx(conn) => sqlx_run(conn.into_inner(), sql, params, want).await,
        }
    }
}

async fn tokio_postgres_run(
    conn: deadpool_postgres::Object,
    sql: &str,
    params: &[&dyn Param],
    sending: Sending,
    cancel: &LockQueue,
    want: Want,
) -> std::result::Result<Ran, DbError> {
    let typed: Vec<(&(dyn ToSql + Sync), Type)> =
        params.iter().map(|p| p.tokio_postgres()).collect();
    match sending {
        Sending::Prepared => {
            // Prepared before the guard is armed; a failure returns the connection as it is.
            let statement = conn.prepare_cached(sql).await?;
            let values: Vec<&(dyn ToSql + Sync)> = typed.iter().map(|(v, _)| *v).collect();
            let guard = Abandon::arm(conn, cancel);
            let outcome = match want {
                Want::Rows => guard
                    .client()
                    .query(&statement, &values)
                    .await
                    .map(TpRan::Rows),
                Want::Affected => guard
                    .client()
                    .execute(&statement, &values)
                    .await
                    .map(TpRan::Affected),
            };
            guard.disarm(outcome.as_ref().err());
            Ok(wrap(outcome?))
        }
        Sending::Unnamed => {
            let guard = Abandon::arm(conn, cancel);
            let outcome = match want {
                Want::Rows => guard
                    .client()
                    .query_typed(sql, &typed)
                    .await
                    .map(TpRan::Rows),
                Want::Affected => guard
                    .client()
                    .execute_typed(sql, &typed)
                    .await
                    .map(TpRan::Affected),
            };
            guard.disarm(outcome.as_ref().err());
            Ok(wrap(outcome?))
        }
    }
}

/// tokio-postgres rows as rows of the seam.
fn wrap(ran: TpRan) -> Ran {
    match ran {
        TpRan::Rows(rows) => Ran::Rows(rows.into_iter().map(Row::TokioPostgres).collect()),
        TpRan::Affected(n) => Ran::Affected(n),
    }
}

enum TpRan {
    Rows(Vec<tokio_postgres::Row>),
    Affected(u64),
}

/// Armed while a tokio-postgres statement runs: dropped armed (the caller's future was
/// dropped), it sends a cancel request for the statement and closes the connection.
struct Abandon {
    cancel: Option<CancelOnDrop>,
    conn: Option<deadpool_postgres::Object>,
}

impl Abandon {
    fn arm(conn: deadpool_postgres::Object, queue: &LockQueue) -> Abandon {
        Abandon {
            cancel: Some(cancel_on_drop(queue, conn.cancel_token())),
            conn: Some(conn),
        }
    }

    fn client(&self) -> &tokio_postgres::Client {
        match &self.conn {
            Some(conn) => conn,
            None => unreachable!("the connection is only taken on disarm or drop"),
        }
    }

    /// Finished (either way): nothing to cancel, and the connection goes back to the pool —
    /// unless it was lost, then it is closed.
    fn disarm(mut self, error: Option<&tokio_postgres::Error>) {
        if let Some(cancel) = self.cancel.take() {
            cancel.disarm();
        }
        if let Some(conn) = self.conn.take() {
            crate::pool::return_or_discard(conn, error);
        }
    }
}

impl Drop for Abandon {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Still armed: cancel the statement (the guard's own drop) and close the connection.
            drop(self.cancel.take());
            drop(deadpool_postgres::Object::take(conn));
            tracing::debug!("pooled statement abandoned: cancelled, connection discarded");
        }
    }
}

#[cfg(feature = "sqlx")]
async fn sqlx_run(
    conn: sqlx::pool::PoolConnection<sqlx::Postgres>,
    sql: &str,
    params: &[&dyn Param],
    want: Want,
) -> std::result::Result<Ran, DbError> {
    let mut args = sqlx::postgres::PgArguments::default();
    for param in params {
        param.bind_sqlx(&mut args)?;
    }
    let mut guard = SqlxAbandon(Some(conn));
    let conn = guard.conn();
    let query = sqlx::query_with(sql, args);
    let outcome = match want {
        Want::Rows => sqlx::Executor::fetch_all(&mut **conn, query)
            .await
            .map(|rows| Ran::Rows(rows.into_iter().map(Row::Sqlx).collect())),
        Want::Affected => sqlx::Executor::execute(&mut **conn, query)
            .await
            .map(|done| Ran::Affected(done.rows_affected())),
    }
    .map_err(DbError::from);
    match &outcome {
        // Dropped armed: closed.
        Err(e) if e.is_connection_lost() => {}
        _ => guard.disarm(),
    }
    outcome
}

/// An sqlx connection that is closed, not pooled, unless disarmed (the statement finished).
#[cfg(feature = "sqlx")]
struct SqlxAbandon(Option<sqlx::pool::PoolConnection<sqlx::Postgres>>);

#[cfg(feature = "sqlx")]
impl SqlxAbandon {
    fn conn(&mut self) -> &mut sqlx::pool::PoolConnection<sqlx::Postgres> {
        match &mut self.0 {
            Some(conn) => conn,
            None => unreachable!("the connection is only taken on disarm or drop"),
        }
    }

    fn disarm(&mut self) {
        drop(self.0.take()); // back to the pool
    }
}

#[cfg(feature = "sqlx")]
impl Drop for SqlxAbandon {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            // Detached from the pool and dropped: the socket closes. Needs no runtime.
            drop(conn.detach());
            tracing::debug!("pooled statement abandoned or its connection lost: closed");
        }
    }
}

/// Runs a statement unnamed (tokio-postgres: `query_typed`; sqlx: as the pool runs any query).
/// The connection stays checked out until the [`PooledConnection`] is dropped.
impl Executor for PooledConnection {
    fn query<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
    ) -> BoxFuture<'a, std::result::Result<Vec<Row>, DbError>> {
        match &self.0 {
            Conn::TokioPostgres(conn) => {
                let client: &tokio_postgres::Client = conn;
                super::tokio_postgres_query(client, sql, params)
            }
            #[cfg(feature = "sqlx")]
            Conn::Sqlx(conn) => Box::pin(async move {
                let mut args = sqlx::postgres::PgArguments::default();
                for param in params {
                    param.bind_sqlx(&mut args)?;
                }
                let mut conn = conn.lock().await;
                let rows =
                    sqlx::Executor::fetch_all(&mut **conn, sqlx::query_with(sql, args)).await?;
                Ok(rows.into_iter().map(Row::Sqlx).collect())
            }),
        }
    }

    fn batch<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, std::result::Result<(), DbError>> {
        match &self.0 {
            Conn::TokioPostgres(conn) => Box::pin(async move {
                let client: &tokio_postgres::Client = conn;
                Ok(client.batch_execute(sql).await?)
            }),
            #[cfg(feature = "sqlx")]
            Conn::Sqlx(conn) => Box::pin(async move {
                let mut conn = conn.lock().await;
                sqlx::Executor::execute(&mut **conn, sqlx::raw_sql(sql)).await?;
                Ok(())
            }),
        }
    }
}
