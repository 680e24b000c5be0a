//! Session-scoped advisory locks: a [`PgSessionGuard`] owns the pooled connection that holds
//! `pg_advisory_lock` until [`SessionLockGuard::release`] (unlock, then back to the pool) or
//! drop (the connection is detached from the pool and closed; the server releases the lock).
//!
//! Session locks need a session that stays the same: they do **not** work behind a
//! transaction-pooling proxy (PgBouncer `pool_mode = transaction`), which may run the unlock on
//! another server connection. Transaction-scoped locks work there.

use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use lockstep_core::{Error, ErrorKind, ResourceKey, Result, SessionLockGuard, SessionLocks};
use lockstep_pg::internal::{
    self, CancelOnDrop, column, kind_of, lock_error, lock_timeout_setting,
};
use lockstep_pg::map_pool_error;
use tokio::time::Instant;
use tokio_postgres::types::Type;

use crate::lock::PostgresDistributedLock;
use crate::sql;

/// Holds one session advisory lock on its own pooled connection.
pub struct PgSessionGuard {
    // `None` only once released.
    conn: Option<Object>,
    key: ResourceKey,
}

impl std::fmt::Debug for PgSessionGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSessionGuard")
            .field("key", &self.key)
            .field("held", &self.conn.is_some())
            .finish()
    }
}

impl PgSessionGuard {
    /// The connection that holds the lock, e.g. to do the protected work on it. Do not end
    /// its session state (no `DISCARD ALL`, no `pg_advisory_unlock_all`).
    pub fn client(&self) -> &tokio_postgres::Client {
        match &self.conn {
            Some(conn) => conn,
            None => unreachable!("a guard is only without its connection inside release"),
        }
    }
}

impl Drop for PgSessionGuard {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Cannot unlock synchronously: never pool a connection that still holds the lock.
            let _ = Object::take(conn);
        }
    }
}

impl SessionLockGuard for PgSessionGuard {
    fn key(&self) -> &ResourceKey {
        &self.key
    }

    async fn release(mut self) -> Result<()> {
        let Some(conn) = self.conn.take() else {
            return Ok(());
        };
        let advisory = self.key.advisory_key();
        let held = match conn
            .query_typed_one(sql::UNLOCK_SESSION, &[(&advisory, Type::INT8)])
            .await
        {
            Ok(row) => acquired(&row),
            Err(e) => Err(lock_error(e, &self.key, "releasing")),
        };
        match held {
            Ok(true) => Ok(()), // pooled again
            Ok(false) => {
                let _ = Object::take(conn);
                Err(Error::new(
                    ErrorKind::Backend,
                    format!("session lock {} was no longer held at release", self.key),
                ))
            }
            Err(e) => {
                // Not known to be unlocked: never pool it.
                let _ = Object::take(conn);
                Err(e)
            }
        }
    }
}

/// The boolean a session statement returns (held, acquired).
fn acquired(row: &tokio_postgres::Row) -> Result<bool> {
    column(row, 0)
}

/// A connection waiting for a session lock: if dropped mid-wait, cancels the wait and closes
/// the connection instead of pooling it.
struct Waiting {
    conn: Option<Object>,
    cancel: Option<CancelOnDrop>,
}

impl Waiting {
    fn finish(mut self) -> Object {
        if let Some(cancel) = self.cancel.take() {
            cancel.disarm();
        }
        match self.conn.take() {
            Some(conn) => conn,
            None => unreachable!("taken only here"),
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        // Cancel first (the request goes out from a spawned task), then detach the connection.
        drop(self.cancel.take());
        if let Some(conn) = self.conn.take() {
            let _ = Object::take(conn);
        }
    }
}

impl PostgresDistributedLock {
    fn session_pool(&self) -> Result<&Pool> {
        self.pool.as_ref().ok_or_else(|| {
            Error::new(
                ErrorKind::Unsupported,
                "session locks need a pool: build the lock with PostgresDistributedLock::new(pool)",
            )
        })
    }
}

impl SessionLocks for PostgresDistributedLock {
    type Guard = PgSessionGuard;

    async fn acquire_session(
        &self,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<PgSessionGuard> {
        let pool = self.session_pool()?;
        if let Some(limit) = timeout {
            lock_timeout_setting(limit)?;
        }
        let advisory = key.advisory_key();
        let deadline = timeout.map(internal::deadline_after);
        // Queue in process before taking a connection: local waiters hold no connection.
        let (conn, outcome) = internal::in_turn(&self.queue, advisory, deadline, || async {
            let conn = pool.get().await.map_err(map_pool_error)?;
            let cancel = internal::cancel_on_drop(&self.queue, conn.cancel_token());
            let waiting = Waiting {
                conn: Some(conn),
                cancel: Some(cancel),
            };
            let lock_timeout = deadline
                .map(|d| lock_timeout_setting(d.saturating_duration_since(Instant::now())))
                .transpose()?;
            let outcome = match waiting.conn.as_deref() {
                Some(client) => {
                    client
                        .query_typed_one(
                            sql::LOCK_SESSION,
                            &[(&advisory, Type::INT8), (&lock_timeout, Type::TEXT)],
                        )
                        .await
                }
                None => unreachable!("set above"),
            };
            Ok::<_, Error>((waiting.finish(), outcome))
        })
        .await?;
        match outcome {
            Ok(_) => Ok(PgSessionGuard {
                conn: Some(conn),
                key: key.clone(),
            }),
            Err(e) => {
                // A lock timeout leaves a clean, idle connection; anything else is not
                // worth trusting.
                if kind_of(&e) != ErrorKind::LockTimeout {
                    let _ = Object::take(conn);
                }
                Err(lock_error(e, key, "waiting for session"))
            }
        }
    }

    async fn try_acquire_session(&self, key: &ResourceKey) -> Result<Option<PgSessionGuard>> {
        let conn = self.session_pool()?.get().await.map_err(map_pool_error)?;
        let advisory = key.advisory_key();
        let outcome = match conn
            .query_typed_one(sql::TRY_SESSION, &[(&advisory, Type::INT8)])
            .await
        {
            Ok(row) => acquired(&row),
            Err(e) => Err(lock_error(e, key, "trying session")),
        };
        match outcome {
            Ok(true) => Ok(Some(PgSessionGuard {
                conn: Some(conn),
                key: key.clone(),
            })),
            Ok(false) => Ok(None),
            Err(e) => {
                // Possibly holding the lock: never pool it.
                let _ = Object::take(conn);
                Err(e)
            }
        }
    }
}
