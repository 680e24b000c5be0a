//! The advisory locks on sqlx (feature `sqlx`): [`SqlxDistributedLock`] runs the same lock
//! statements, queue, deadline and cancel-on-drop as [`PgDistributedLock`](crate::PgDistributedLock),
//! transaction-scoped on [`SqlxTransaction`]s and session-scoped on a connection of the
//! application's pool held by an [`SqlxSessionGuard`].
//!
//! On sqlx a session lock costs one round trip more than on tokio-postgres: the backend's pid is
//! read before the wait, because an abandoned wait is ended with `pg_cancel_backend` (sqlx does not
//! hand out a connection's cancel key). A transaction pooler in front of the server is not
//! detected on sqlx: do not take session locks through one (a session lock needs its session).

use std::future::Future;
use std::time::Duration;

use lockstep_core::{
    DistributedAggregateWriteLock, DistributedLock, Error, ErrorKind, ResourceKey, Result,
    SessionLockGuard, SessionLocks,
};
use lockstep_pg::LockQueue;
use lockstep_pg::driver::DbError;
use lockstep_pg::internal::{self, db_kind_of, lock_db_error, lock_timeout_setting};
use lockstep_pg::sqlx::{SqlxDatabase, SqlxTransaction, cancel_backend_on_drop, checkout};
use sqlx::Row as _;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgPool, Postgres};
use tokio::time::Instant;

use crate::session::unlocked;
use crate::sql;

/// The aggregate write lock (`relay:aggregate:{type}:{id}`) on sqlx transactions.
pub type SqlxAggregateWriteLock = DistributedAggregateWriteLock<SqlxDistributedLock>;

/// Transaction-scoped advisory locks on [`SqlxTransaction`]s, queued in the handle's
/// [`LockQueue`] (shared with the event store's `load_locked` built from the same handle).
/// Cheap to clone.
#[derive(Clone)]
pub struct SqlxDistributedLock {
    queue: LockQueue,
    // Where session locks take their connection.
    pool: PgPool,
    checkout_wait: Duration,
}

impl std::fmt::Debug for SqlxDistributedLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxDistributedLock")
            .field("queue", &self.queue)
            .field("pool_size", &self.pool.size())
            .field("checkout_wait", &self.checkout_wait)
            .finish()
    }
}

impl SqlxDistributedLock {
    /// The lock of `db`, in its lock queue.
    pub fn new(db: &SqlxDatabase) -> SqlxDistributedLock {
        SqlxDistributedLock {
            queue: db.lock_queue().clone(),
            pool: db.pool().clone(),
            checkout_wait: db.checkout_wait(),
        }
    }

    /// The aggregate write lock on this lock.
    pub fn aggregate_write_lock(&self) -> SqlxAggregateWriteLock {
        DistributedAggregateWriteLock::new(self.clone())
    }

    /// The queue its waits go through.
    pub fn queue(&self) -> &LockQueue {
        &self.queue
    }
}

impl DistributedLock<SqlxTransaction> for SqlxDistributedLock {
    fn acquire_for_transaction<'a>(
        &'a self,
        tx: &'a SqlxTransaction,
        key: &'a ResourceKey,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        internal::acquire_with(&self.queue, tx, key, timeout, move |call| {
            internal::lock_statement(tx, key, call)
        })
    }

    fn try_acquire_for_transaction<'a>(
        &'a self,
        tx: &'a SqlxTransaction,
        key: &'a ResourceKey,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        internal::try_lock_statement(tx, key)
    }
}

/// A session-scoped advisory lock held on a connection of the application's sqlx pool
/// ([`SessionLocks`] of [`SqlxDistributedLock`]): `release` unlocks and pools the connection
/// again; dropped, the connection is closed (the server releases the lock when it notices),
/// never pooled while it holds the lock.
pub struct SqlxSessionGuard {
    // `None` only once released.
    conn: Option<PoolConnection<Postgres>>,
    key: ResourceKey,
}

impl std::fmt::Debug for SqlxSessionGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxSessionGuard")
            .field("key", &self.key)
            .field("held", &self.conn.is_some())
            .finish()
    }
}

impl SqlxSessionGuard {
    /// Whether the lock is still held: the connection's own row of `pg_locks` (`false` once the
    /// connection is gone).
    pub async fn is_held(&mut self) -> Result<bool> {
        let Some(conn) = self.conn.as_deref_mut() else {
            return Ok(false);
        };
        let held = sqlx::Executor::fetch_one(
            &mut *conn,
            sqlx::query(sql::IS_HELD_SESSION).bind(self.key.advisory_key()),
        )
        .await
        .and_then(|row| row.try_get::<bool, _>(0));
        match held {
            Ok(held) => Ok(held),
            Err(e) => {
                let e = DbError::from(e);
                if e.is_connection_lost() {
                    Ok(false)
                } else {
                    Err(lock_db_error(e, &self.key, "checking session"))
                }
            }
        }
    }
}

impl Drop for SqlxSessionGuard {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Cannot unlock synchronously: never pool a connection that still holds the lock.
            drop(conn.detach());
        }
    }
}

impl SessionLockGuard for SqlxSessionGuard {
    fn key(&self) -> &ResourceKey {
        &self.key
    }

    async fn release(mut self) -> Result<()> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(());
        };
        // A simple query (one message): see `sql::unlock_session`.
        let unlock = sqlx::Executor::fetch_all(
            &mut *conn,
            sqlx::raw_sql(&sql::unlock_session(self.key.advisory_key())),
        )
        .await;
        let flags = match unlock {
            Ok(rows) => rows
                .first()
                .and_then(|row| {
                    Some((
                        row.try_get::<bool, _>(0).ok()?,
                        row.try_get::<bool, _>(1).ok()?,
                    ))
                })
                .ok_or_else(|| {
                    Error::new(ErrorKind::Backend, "decoding the session unlock's result")
                }),
            Err(e) => Err(lock_db_error(DbError::from(e), &self.key, "releasing")),
        };
        let pooled = matches!(flags, Ok((true, false)));
        let outcome = unlocked(&self.key, flags);
        if pooled {
            drop(conn); // back to the pool, unlocked and outside any transaction block
        } else {
            drop(conn.detach());
        }
        outcome
    }
}

impl SessionLocks for SqlxDistributedLock {
    type Guard = SqlxSessionGuard;

    async fn acquire_session(
        &self,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<SqlxSessionGuard> {
        if let Some(limit) = timeout {
            lock_timeout_setting(limit)?;
        }
        let advisory = key.advisory_key();
        let deadline = timeout.map(internal::deadline_after);
        // Queue in process before taking a connection: local waiters hold no connection.
        let (conn, outcome) = internal::in_turn(&self.queue, advisory, deadline, || async {
            let wait = deadline.map_or(self.checkout_wait, |d| {
                self.checkout_wait
                    .min(d.saturating_duration_since(Instant::now()))
            });
            let conn = checkout(&self.pool, wait).await?;
            let mut waiting = Waiting(Some(conn));
            let pid: i32 = sqlx::Executor::fetch_one(
                &mut **waiting.conn(),
                sqlx::query("SELECT pg_backend_pid()"),
            )
            .await
            .and_then(|row| row.try_get(0))
            .map_err(|e| lock_db_error(DbError::from(e), key, "waiting for session"))?;
            let cancel = cancel_backend_on_drop(&self.pool, pid);
            let lock_timeout = deadline
                .map(|d| lock_timeout_setting(d.saturating_duration_since(Instant::now())))
                .transpose()?;
            let outcome = sqlx::Executor::fetch_one(
                &mut **waiting.conn(),
                sqlx::query(sql::LOCK_SESSION)
                    .bind(advisory)
                    .bind(lock_timeout),
            )
            .await
            .map(drop);
            cancel.disarm();
            Ok::<_, Error>((waiting.finish(), outcome))
        })
        .await?;
        match outcome {
            Ok(()) => Ok(SqlxSessionGuard {
                conn: Some(conn),
                key: key.clone(),
            }),
            Err(e) => {
                let e = DbError::from(e);
                // A lock timeout leaves a clean, idle connection; anything else is not worth
                // trusting.
                if db_kind_of(&e) != ErrorKind::LockTimeout {
                    drop(conn.detach());
                }
                Err(lock_db_error(e, key, "waiting for session"))
            }
        }
    }

    async fn try_acquire_session(&self, key: &ResourceKey) -> Result<Option<SqlxSessionGuard>> {
        let mut conn = checkout(&self.pool, self.checkout_wait).await?;
        let acquired = sqlx::Executor::fetch_one(
            &mut *conn,
            sqlx::query(sql::TRY_SESSION).bind(key.advisory_key()),
        )
        .await
        .and_then(|row| row.try_get::<bool, _>(0));
        match acquired {
            Ok(true) => Ok(Some(SqlxSessionGuard {
                conn: Some(conn),
                key: key.clone(),
            })),
            Ok(false) => Ok(None),
            Err(e) => {
                // Possibly holding the lock: never pool it.
                drop(conn.detach());
                Err(lock_db_error(DbError::from(e), key, "trying session"))
            }
        }
    }
}

/// A connection waiting for a session lock: closed, not pooled, if the wait is abandoned (the
/// cancel guard, dropped with it, ends the wait at the server).
struct Waiting(Option<PoolConnection<Postgres>>);

impl Waiting {
    fn conn(&mut self) -> &mut PoolConnection<Postgres> {
        match &mut self.0 {
            Some(conn) => conn,
            None => unreachable!("taken only by finish"),
        }
    }

    fn finish(mut self) -> PoolConnection<Postgres> {
        match self.0.take() {
            Some(conn) => conn,
            None => unreachable!("taken only here"),
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            drop(conn.detach());
        }
    }
}
