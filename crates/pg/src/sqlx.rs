//! lockstep on an application's own sqlx pool (feature `sqlx`).
//!
//! [`SqlxDatabase`] wraps the `sqlx::PgPool` an application already has; it is the unit-of-work
//! source ([`TransactionSource`], `Tx` = [`SqlxTransaction`]) and the backends built from it run
//! the same SQL, decoding and error mapping as on tokio-postgres (the [`driver`](crate::driver)
//! seam). A handler begins a [`SqlxTransaction`], takes the aggregate lock and appends through
//! the backends, writes its own tables with sqlx on [`SqlxTransaction::connection`], and commits
//! once:
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> lockstep_core::Result<()> {
//! use lockstep_core::{Transaction as _, TransactionSource as _};
//! use lockstep_pg::sqlx::SqlxDatabase;
//!
//! let db = SqlxDatabase::new(pool);
//! let tx = db.begin().await?;
//! // … lock, load, decide and append through the backends on &tx …
//! {
//!     let mut conn = tx.connection().await?;
//!     sqlx::query("INSERT INTO audit (note) VALUES ($1)")
//!         .bind("reserved")
//!         .execute(&mut *conn)
//!         .await
//!         .map_err(lockstep_pg::sqlx::map_sqlx_error)?;
//! }
//! tx.commit().await?; // the events and the audit row, or neither
//! # Ok(()) }
//! ```
//!
//! What differs from tokio-postgres, and why:
//!
//! - **No pipelining.** sqlx runs one statement at a time on a connection, so statements that
//!   tokio-postgres sends together (a lock and the load after it; the last write and the
//!   `COMMIT`) are sent in turn: one round trip each. `EventStore::append_at_commit` appends at
//!   once.
//! - **Prepared statements.** sqlx prepares each statement once per connection and caches it
//!   (the first use costs a round trip more); tokio-postgres sends each with its types
//!   (`query_typed`), unprepared.
//! - **Cancelling an abandoned lock wait.** sqlx does not hand out a connection's cancel key,
//!   so the wait is ended with `pg_cancel_backend` of the backend (its pid is read in the same
//!   round trip as `BEGIN`), sent on a new connection made with the pool's options, on the same
//!   schedule as a cancel request; the transaction's connection is then closed, never pooled.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ::sqlx::pool::PoolConnection;
use ::sqlx::postgres::{PgArguments, PgConnection, PgPool, Postgres};
use ::sqlx::{Connection as _, Row as _};
use futures_util::future::BoxFuture;
use lockstep_core::{Error, ErrorKind, Result, Transaction, TransactionSource, advisory_key};
use tokio::sync::{MappedMutexGuard, MutexGuard};

use crate::advisory::{LockQueue, LockingTransaction};
use crate::cancel::CancelOnDrop;
use crate::driver::{CommitReturning, DbError, Executor, Param, Row, query_one};
use crate::error::{describe_db, kind_of_db, map_db_error};
use crate::migrate::{
    InstalledSchema, MIGRATE_CHECKOUT_WAIT, MIGRATION_LOCK_KEY, MigrationReport, check_schema_with,
    migrate_locked,
};

/// The handle of a process whose application is on sqlx: its `PgPool`, the in-process lock
/// queue every lock built from it shares, and how long a checkout may wait. Cheap to clone.
#[derive(Clone)]
pub struct SqlxDatabase {
    pool: PgPool,
    queue: LockQueue,
    checkout_wait: Duration,
}

impl std::fmt::Debug for SqlxDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxDatabase")
            .field("pool_size", &self.pool.size())
            .field("idle", &self.pool.num_idle())
            .field("queue", &self.queue)
            .field("checkout_wait", &self.checkout_wait)
            .finish()
    }
}

impl SqlxDatabase {
    /// The handle of `pool`, with a new lock queue and a checkout wait of
    /// [`DEFAULT_CHECKOUT_WAIT`](crate::DEFAULT_CHECKOUT_WAIT).
    pub fn new(pool: PgPool) -> SqlxDatabase {
        SqlxDatabase {
            pool,
            queue: LockQueue::new(),
            checkout_wait: crate::DEFAULT_CHECKOUT_WAIT,
        }
    }

    /// This handle with `queue` in front of its advisory locks (to share one queue with
    /// other handles of the process, or to change its settings).
    #[must_use]
    pub fn with_lock_queue(mut self, queue: LockQueue) -> Self {
        self.queue = queue;
        self
    }

    /// This handle, waiting at most `wait` for a pooled connection (an exhausted pool is then a
    /// retryable [`ErrorKind::ConnectionLost`]).
    #[must_use]
    pub fn with_checkout_wait(mut self, wait: Duration) -> Self {
        self.checkout_wait = wait;
        self
    }

    /// The application's pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The queue in front of the advisory locks built from this handle.
    pub fn lock_queue(&self) -> &LockQueue {
        &self.queue
    }

    /// How long a checkout waits for a pooled connection.
    pub fn checkout_wait(&self) -> Duration {
        self.checkout_wait
    }

    /// Applies lockstep's schema on this pool: what [`crate::migrate()`] does on a deadpool
    /// pool — one transaction under the migration lock (a concurrent run waits, then finds
    /// nothing to do), refinery's runner inside it, the function files, the schema version;
    /// a failure rolls everything back. Explicit and idempotent.
    pub async fn migrate(&self) -> Result<MigrationReport> {
        let tx = SqlxTransaction::begin_within(&self.pool, MIGRATE_CHECKOUT_WAIT).await?;
        query_one(
            &tx,
            "SELECT pg_advisory_xact_lock($1)",
            &[&advisory_key(MIGRATION_LOCK_KEY)],
        )
        .await
        .map_err(|e| map_db_error(e, "locking the migration run"))?;
        let report = migrate_locked(&tx).await?;
        tx.commit().await?;
        Ok(report)
    }

    /// Whether this build can run on the database behind this pool, read only
    /// ([`crate::migrate::check_schema`]).
    pub async fn check_schema(&self) -> Result<InstalledSchema> {
        let tx = SqlxTransaction::begin_within(&self.pool, MIGRATE_CHECKOUT_WAIT).await?;
        let checked = check_schema_with(&tx).await;
        tx.rollback().await?;
        checked
    }
}

impl TransactionSource for SqlxDatabase {
    type Tx = SqlxTransaction;

    async fn begin(&self) -> Result<SqlxTransaction> {
        SqlxTransaction::begin_within(&self.pool, self.checkout_wait).await
    }
}

/// An owned READ COMMITTED transaction on a connection of an sqlx pool: `'static`, so a
/// handler holding it can be spawned. A guard ([`Transaction`]): `commit(self)`,
/// `rollback(self)`, and dropped open it is rolled back in the background, its connection
/// pooled again only once the server confirmed the `ROLLBACK` (else closed). It is never
/// returned to the pool inside a transaction, and a connection to a server that cannot write
/// is closed rather than pooled.
pub struct SqlxTransaction {
    // `None` once committed or rolled back.
    conn: tokio::sync::Mutex<Option<PoolConnection<Postgres>>>,
    pool: PgPool,
    // The backend's process id, for `pg_cancel_backend`.
    pid: i32,
    // Set when a cancel may still arrive for this connection: close it at the end.
    discard: AtomicBool,
    held_keys: Mutex<Vec<i64>>,
}

impl std::fmt::Debug for SqlxTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxTransaction")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

/// `BEGIN` and the backend's pid, in one round trip (a simple query of two statements).
const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_backend_pid()";

/// Commits, after a probe in the same round trip: in a failed transaction `SELECT 1` errors
/// with `25P02` and the `COMMIT` is skipped (a `COMMIT` there would "succeed" as a rollback).
const COMMIT: &str = "SELECT 1; COMMIT";

/// Rolls back and asks, in the same round trip, whether the server still accepts writes.
const ROLLBACK: &str = "ROLLBACK; SELECT current_setting('transaction_read_only')";

/// How long a transaction dropped open waits in the background for its `ROLLBACK` before it
/// closes the connection instead of pooling it.
pub const DROPPED_ROLLBACK_WAIT: Duration = Duration::from_secs(5);

impl SqlxTransaction {
    /// Checks a connection out of `pool`, waiting at most `wait`, and begins a READ COMMITTED
    /// transaction on it. Cancel-safe: dropped while `BEGIN` is in flight, the connection is
    /// closed, never pooled.
    pub async fn begin_within(pool: &PgPool, wait: Duration) -> Result<SqlxTransaction> {
        let mut conn = CloseOnDrop(Some(checkout(pool, wait).await?));
        let rows = ::sqlx::Executor::fetch_all(&mut **conn.get(), ::sqlx::raw_sql(BEGIN))
            .await
            .map_err(|e| map_sqlx_error_doing(e, "beginning a transaction"))?;
        let pid = rows
            .first()
            .and_then(|row| row.try_get::<i32, _>(0).ok())
            .ok_or_else(|| Error::new(ErrorKind::Backend, "BEGIN returned no backend pid"))?;
        Ok(SqlxTransaction {
            conn: tokio::sync::Mutex::new(Some(conn.disarm())),
            pool: pool.clone(),
            pid,
            discard: AtomicBool::new(false),
            held_keys: Mutex::new(Vec::new()),
        })
    }

    /// The transaction's connection, for the application's own statements with sqlx
    /// (`.execute(&mut *conn)`): they run in this transaction and commit with it. Hold it for
    /// the statements only — lockstep's own statements on this transaction wait for it.
    pub async fn connection(&self) -> Result<MappedMutexGuard<'_, PgConnection>> {
        let guard = self.conn.lock().await;
        MutexGuard::try_map(guard, |conn| conn.as_deref_mut()).map_err(|_| ended())
    }

    /// The backend's process id.
    pub fn backend_pid(&self) -> i32 {
        self.pid
    }

    async fn commit_now(self) -> Result<()> {
        let Some(conn) = self.conn.lock().await.take() else {
            return Ok(());
        };
        let mut conn = CloseOnDrop(Some(conn));
        match ::sqlx::Executor::execute(&mut **conn.get(), ::sqlx::raw_sql(COMMIT)).await {
            Ok(_) => {
                self.release(conn);
                Ok(())
            }
            Err(e) => {
                let e = DbError::from(e);
                let kind = kind_of_db(&e);
                if kind == ErrorKind::ConnectionLost && !e.is_server_error() {
                    return Err(Error::new(
                        ErrorKind::CommitUnknown,
                        "the connection was lost while COMMIT was in flight: the transaction \
                         may or may not have committed",
                    )
                    .with_source(e));
                }
                self.roll_back_and_release(conn).await;
                if kind == ErrorKind::TransactionAborted {
                    return Err(Error::new(
                        ErrorKind::TransactionAborted,
                        "the transaction had failed and was rolled back instead of committed",
                    )
                    .with_source(e));
                }
                Err(Error::new(kind, format!("committing: {}", describe_db(&e))).with_source(e))
            }
        }
    }

    async fn rollback_now(self) -> Result<()> {
        let Some(conn) = self.conn.lock().await.take() else {
            return Ok(());
        };
        let mut conn = CloseOnDrop(Some(conn));
        if self.discard.load(Ordering::Acquire) {
            // A cancel for an abandoned lock wait may still arrive and would cancel the
            // ROLLBACK: close the connection; the server rolls back when it goes.
            return Ok(());
        }
        match roll_back(conn.get()).await {
            Ok(Writable::Yes) => {
                self.release(conn);
                Ok(())
            }
            Ok(Writable::No) => Ok(()),
            Err(e) => Err(
                Error::new(kind_of_db(&e), format!("rolling back: {}", describe_db(&e)))
                    .with_source(e),
            ),
        }
    }

    async fn roll_back_and_release(&self, mut conn: CloseOnDrop) {
        if matches!(roll_back(conn.get()).await, Ok(Writable::Yes)) {
            self.release(conn);
        }
    }

    fn release(&self, mut conn: CloseOnDrop) {
        if !self.discard.load(Ordering::Acquire) {
            drop(conn.disarm()); // back to the pool, outside any transaction
        }
    }
}

impl Transaction for SqlxTransaction {
    fn commit(self) -> impl std::future::Future<Output = Result<()>> + Send {
        self.commit_now()
    }

    fn rollback(self) -> impl std::future::Future<Output = Result<()>> + Send {
        self.rollback_now()
    }
}

impl Drop for SqlxTransaction {
    fn drop(&mut self) {
        let Some(conn) = self.conn.get_mut().take() else {
            return;
        };
        let mut conn = CloseOnDrop(Some(conn));
        if self.discard.load(Ordering::Acquire) {
            return; // closed by the guard
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let rolled_back =
                    tokio::time::timeout(DROPPED_ROLLBACK_WAIT, roll_back(conn.get())).await;
                if matches!(rolled_back, Ok(Ok(Writable::Yes))) {
                    drop(conn.disarm());
                }
            });
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writable {
    Yes,
    No,
}

async fn roll_back(conn: &mut PoolConnection<Postgres>) -> Result<Writable, DbError> {
    let rows = ::sqlx::Executor::fetch_all(&mut **conn, ::sqlx::raw_sql(ROLLBACK)).await?;
    let read_only = rows
        .iter()
        .any(|row| row.try_get::<String, _>(0).is_ok_and(|v| v == "on"));
    Ok(if read_only {
        Writable::No
    } else {
        Writable::Yes
    })
}

/// A connection that is closed, not pooled, unless disarmed: for every path where it may still
/// be inside a transaction.
struct CloseOnDrop(Option<PoolConnection<Postgres>>);

impl CloseOnDrop {
    fn get(&mut self) -> &mut PoolConnection<Postgres> {
        match &mut self.0 {
            Some(conn) => conn,
            None => unreachable!("CloseOnDrop used after disarm"),
        }
    }

    fn disarm(&mut self) -> PoolConnection<Postgres> {
        match self.0.take() {
            Some(conn) => conn,
            None => unreachable!("CloseOnDrop disarmed twice"),
        }
    }
}

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            // Detached from the pool (which opens another when it needs one) and dropped: the
            // socket closes and the server rolls back. Needs no runtime.
            drop(conn.detach());
        }
    }
}

fn ended() -> Error {
    Error::new(ErrorKind::Backend, "the transaction has ended")
}

impl Executor for SqlxTransaction {
    fn query<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
    ) -> BoxFuture<'a, std::result::Result<Vec<Row>, DbError>> {
        Box::pin(async move {
            let mut args = PgArguments::default();
            for param in params {
                param.bind_sqlx(&mut args)?;
            }
            let mut guard = self.conn.lock().await;
            let conn = guard
                .as_deref_mut()
                .ok_or_else(|| DbError::client("the transaction has ended"))?;
            let rows = ::sqlx::Executor::fetch_all(conn, ::sqlx::query_with(sql, args)).await?;
            Ok(rows.into_iter().map(Row::Sqlx).collect())
        })
    }

    fn batch<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, std::result::Result<(), DbError>> {
        Box::pin(async move {
            let mut guard = self.conn.lock().await;
            let conn = guard
                .as_deref_mut()
                .ok_or_else(|| DbError::client("the transaction has ended"))?;
            ::sqlx::Executor::execute(conn, ::sqlx::raw_sql(sql)).await?;
            Ok(())
        })
    }
}

/// The last statement, then the commit: two round trips (sqlx does not pipeline).
impl CommitReturning for SqlxTransaction {
    async fn commit_returning_rows<'a>(
        self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
        map_error: impl FnOnce(DbError) -> Error + Send + 'a,
    ) -> Result<Vec<Row>> {
        let rows = match self.query(sql, params).await {
            Ok(rows) => rows,
            Err(e) => {
                let err = if e.is_connection_lost() {
                    Error::new(
                        ErrorKind::ConnectionLost,
                        format!(
                            "running a transaction's last statement: {}",
                            describe_db(&e)
                        ),
                    )
                    .with_source(e)
                } else {
                    map_error(e)
                };
                // The transaction ends either way (dropping it rolls it back).
                drop(self);
                return Err(err);
            }
        };
        self.commit_now().await?;
        Ok(rows)
    }
}

impl LockingTransaction for SqlxTransaction {
    fn holds_lock(&self, key: i64) -> bool {
        self.held_keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&key)
    }

    fn note_lock_held(&self, key: i64) {
        let mut held = self
            .held_keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !held.contains(&key) {
            held.push(key);
        }
    }

    fn cancel_on_drop(&self, _queue: &LockQueue) -> CancelOnDrop {
        cancel_backend_on_drop(&self.pool, self.pid)
    }

    fn discard_connection_after_end(&self) {
        self.discard.store(true, Ordering::Release);
    }

    fn await_abort(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let mut guard = self.conn.lock().await;
            if let Some(conn) = guard.as_deref_mut() {
                let _ = ::sqlx::Executor::execute(conn, ::sqlx::raw_sql("")).await;
            }
        })
    }
}

/// A connection of `pool`, waiting at most `wait` (an exhausted pool is then a retryable
/// [`ErrorKind::ConnectionLost`]). For lockstep's own crates.
#[doc(hidden)]
pub async fn checkout(pool: &PgPool, wait: Duration) -> Result<PoolConnection<Postgres>> {
    match tokio::time::timeout(wait, pool.acquire()).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(map_sqlx_error_doing(e, "getting a pooled connection")),
        Err(_) => Err(Error::new(
            ErrorKind::ConnectionLost,
            format!(
                "no pooled connection within {wait:?}: pool exhausted ({} open, {} idle) or the \
                 server is slow to accept connections",
                pool.size(),
                pool.num_idle()
            ),
        )),
    }
}

/// A guard that, dropped armed, ends what backend `pid` runs with `pg_cancel_backend`, sent on a
/// new connection made with `pool`'s options (sqlx does not hand out a connection's cancel key),
/// on the schedule of a cancel request. For lockstep's own crates (the session locks on sqlx).
#[doc(hidden)]
pub fn cancel_backend_on_drop(pool: &PgPool, pid: i32) -> CancelOnDrop {
    let options = pool.connect_options();
    CancelOnDrop::new(
        "pg_cancel_backend on a new connection",
        Arc::new(move || {
            let options = Arc::clone(&options);
            Box::pin(async move {
                let mut conn = PgConnection::connect_with(&options)
                    .await
                    .map_err(|e| e.to_string())?;
                let sent = ::sqlx::Executor::execute(
                    &mut conn,
                    ::sqlx::query("SELECT pg_cancel_backend($1)").bind(pid),
                )
                .await
                .map(drop)
                .map_err(|e| e.to_string());
                let _ = conn.close().await;
                sent
            })
        }),
    )
}

/// An sqlx error as a lockstep [`Error`], with its [`ErrorKind`] by SQLSTATE (the mapping every
/// lockstep backend uses): for an application's own statements in a lockstep unit of work.
pub fn map_sqlx_error(err: ::sqlx::Error) -> Error {
    map_sqlx_error_doing(err, "running a statement")
}

fn map_sqlx_error_doing(err: ::sqlx::Error, doing: &str) -> Error {
    let err = DbError::from(err);
    Error::new(kind_of_db(&err), format!("{doing}: {}", describe_db(&err)))
        .with_cause_in_message(err.into_source())
}
