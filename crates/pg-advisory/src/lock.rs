//! [`PostgresDistributedLock`]: transaction-scoped advisory locks on the caller's transaction,
//! with an in-process queue in front, pipelining, timeouts, cancellation and an isolation check.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use lockstep_core::{
    DistributedAggregateWriteLock, DistributedLock, Error, ErrorKind, ResourceKey, Result,
    ValidationError,
};
use lockstep_pg::PgTransactionRef;
use lockstep_pg::error::kind_of;
use tokio::time::Instant;
use tokio_postgres::GenericClient;
use tokio_postgres::types::Type;

use crate::cancel::CancelOnDrop;
use crate::queue::LocalQueue;
use crate::sql;

/// The Postgres aggregate write lock: the pure [`DistributedAggregateWriteLock`] of
/// `lockstep-core` over [`PostgresDistributedLock`] (no second implementation).
pub type PostgresAggregateWriteLock = DistributedAggregateWriteLock<PostgresDistributedLock>;

/// Exclusive locks on [`ResourceKey`]s, as PostgreSQL advisory locks on
/// [`ResourceKey::advisory_key`].
///
/// - [`DistributedLock`] for every [`PgTransactionRef`] (the owned
///   [`lockstep_pg::PgTransaction`], `tokio_postgres::Transaction`, and through deref
///   `deadpool_postgres::Transaction`): `pg_advisory_xact_lock` / `pg_try_advisory_xact_lock`
///   on the caller's transaction, released by the server at commit, rollback or disconnect.
/// - [`lockstep_core::SessionLocks`] (needs a pool, see [`PostgresDistributedLock::new`]): a
///   guard that owns a pooled connection holding `pg_advisory_lock`.
///
/// Clones share the in-process queue; use one instance (or its clones) per process.
#[derive(Clone)]
pub struct PostgresDistributedLock {
    pub(crate) pool: Option<Pool>,
    pub(crate) queue: Arc<LocalQueue>,
    pub(crate) local_queue: bool,
    pub(crate) local_patience: Duration,
}

impl std::fmt::Debug for PostgresDistributedLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresDistributedLock")
            .field("session_locks", &self.pool.is_some())
            .field("local_queue", &self.local_queue)
            .field("local_patience", &self.local_patience)
            .finish()
    }
}

impl PostgresDistributedLock {
    /// How long a waiter queues in process before it waits at the server regardless
    /// (default 1 s); see [`PostgresDistributedLock::with_local_patience`].
    pub const DEFAULT_LOCAL_PATIENCE: Duration = Duration::from_secs(1);

    /// Transaction-scoped locks, plus session-scoped locks on connections from `pool`.
    pub fn new(pool: Pool) -> PostgresDistributedLock {
        PostgresDistributedLock {
            pool: Some(pool),
            ..PostgresDistributedLock::transaction_scoped()
        }
    }

    /// Transaction-scoped locks only (session acquires fail with
    /// [`ErrorKind::Unsupported`]).
    pub fn transaction_scoped() -> PostgresDistributedLock {
        PostgresDistributedLock {
            pool: None,
            queue: Arc::new(LocalQueue::default()),
            local_queue: true,
            local_patience: Self::DEFAULT_LOCAL_PATIENCE,
        }
    }

    /// Turns the in-process queue on (default) or off. Off, every waiter waits at the server
    /// (one waiting backend per waiter).
    #[must_use]
    pub fn with_local_queue(mut self, enabled: bool) -> Self {
        self.local_queue = enabled;
        self
    }

    /// How long a waiter queues in process before it goes to wait at the server anyway
    /// (default [`Self::DEFAULT_LOCAL_PATIENCE`]). The bound exists because the server's
    /// deadlock detector cannot see the in-process queue: with locks taken in inconsistent
    /// orders, a cycle through the queue is found only once its waiters reach the server.
    #[must_use]
    pub fn with_local_patience(mut self, patience: Duration) -> Self {
        self.local_patience = patience;
        self
    }

    /// The per-aggregate write lock over this lock (shares its queue).
    pub fn aggregate_write_lock(&self) -> PostgresAggregateWriteLock {
        DistributedAggregateWriteLock::new(self.clone())
    }

    /// How many keys have local waiters right now (0 when idle: entries are removed when their
    /// last waiter leaves).
    pub fn locally_queued_keys(&self) -> usize {
        self.queue.len()
    }

    /// Takes `key` for `tx` (like [`DistributedLock::acquire_for_transaction`]) and runs the
    /// statements of `then` **pipelined behind the lock statement**: both go to the server in
    /// one round trip, and the server runs `then`'s statements only once the lock is held, so
    /// they see what the previous holder committed.
    ///
    /// `then` must issue its statements on `tx` on its first poll (any tokio-postgres query
    /// future does). If the lock fails, `then`'s result is discarded (its statements then fail
    /// too: the transaction is aborted).
    pub async fn acquire_then<T, R, F, Fut>(
        &self,
        tx: &T,
        key: &ResourceKey,
        timeout: Option<Duration>,
        mut then: F,
    ) -> Result<R>
    where
        T: PgTransactionRef + ?Sized,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<R>>,
    {
        self.acquire_with(tx, key, timeout, |call| {
            let lock = lock_statement(tx, key, call);
            let then = then();
            async move { futures_util::try_join!(lock, then).map(|((), value)| value) }
        })
        .await
    }

    /// Like [`PostgresDistributedLock::acquire_then`], for a statement that **takes the lock
    /// itself** (e.g. a server-side function that locks and then loads, in one statement):
    /// `locking` gets the advisory key and the `lock_timeout` to apply while waiting, and runs
    /// under the same in-process queue, deadline and cancellation as every acquire (dropped
    /// mid-wait, a cancel request ends the server-side wait). The statement must check the
    /// isolation level first (see [`check_isolation`]), take `pg_advisory_xact_lock` with
    /// `lock_timeout` set for the wait (and restored), and only then read, in a fresh snapshot.
    /// It may be called with the lock already held by `tx` (re-entrant).
    pub async fn acquire_with<T, R, F, Fut>(
        &self,
        tx: &T,
        key: &ResourceKey,
        timeout: Option<Duration>,
        mut locking: F,
    ) -> Result<R>
    where
        T: PgTransactionRef + ?Sized,
        F: FnMut(LockCall) -> Fut,
        Fut: Future<Output = Result<R>>,
    {
        let advisory = key.advisory_key();
        if let Some(limit) = timeout {
            lock_timeout_setting(limit)?; // refuse a bad timeout before anything is sent
        }
        let deadline = timeout.map(|limit| Instant::now() + limit);
        let slot = self.local_queue.then(|| self.queue.slot(advisory));
        let mut permit = None;
        if let Some(slot) = &slot {
            match slot.mutex().try_lock() {
                Ok(free) => permit = Some(free),
                Err(_) => {
                    // Another transaction of this process waits at the server for this key.
                    // If ours already holds it (re-entrant) or it just came free, it is ours
                    // now — and queueing behind that waiter would deadlock unseen.
                    if self.try_statement(tx, key, advisory).await? {
                        return locking(LockCall {
                            advisory_key: advisory,
                            lock_timeout: None,
                        })
                        .await;
                    }
                    let patience_end = Instant::now() + self.local_patience;
                    let until = deadline.map_or(patience_end, |d| d.min(patience_end));
                    permit = tokio::time::timeout_at(until, slot.mutex().lock())
                        .await
                        .ok();
                }
            }
        }
        // Past the deadline this is a last 1 ms chance, so a timeout always comes from the
        // server and leaves the transaction aborted, like any other failed lock wait.
        let lock_timeout = deadline
            .map(|d| lock_timeout_setting(d.saturating_duration_since(Instant::now())))
            .transpose()?;
        // Dropped before the statement returns: a cancel request ends the server-side wait, and
        // the connection is closed rather than pooled when the transaction ends (the request
        // may arrive late and would cancel the next borrower's statement).
        let cancel = CancelOnDrop::arm(tx.cancel_token());
        let discard = DiscardOnDrop(Some(tx));
        let outcome = locking(LockCall {
            advisory_key: advisory,
            lock_timeout,
        })
        .await;
        cancel.disarm();
        discard.disarm();
        drop(permit);
        outcome
    }

    /// One `pg_try_advisory_xact_lock` statement, with the isolation check.
    async fn try_statement<T: PgTransactionRef + ?Sized>(
        &self,
        tx: &T,
        key: &ResourceKey,
        advisory: i64,
    ) -> Result<bool> {
        let row = tx
            .executor()
            .query_typed_one(sql::TRY_XACT, &[(&advisory, Type::INT8)])
            .await
            .map_err(|e| lock_error(e, key, "trying"))?;
        check_isolation(row.try_get(0).map_err(decode_error)?, key)?;
        row.try_get(1).map_err(decode_error)
    }
}

/// What a locking statement run by [`PostgresDistributedLock::acquire_with`] must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockCall {
    /// The key to pass to `pg_advisory_xact_lock`.
    pub advisory_key: i64,
    /// The `lock_timeout` to set (transaction-locally) for the wait, e.g. `"250ms"`, and to
    /// restore afterwards; `None`: wait without limit (leave `lock_timeout` alone).
    pub lock_timeout: Option<String>,
}

/// One blocking lock statement (with the isolation check, and `lock_timeout` for its duration
/// when set).
async fn lock_statement<T: PgTransactionRef + ?Sized>(
    tx: &T,
    key: &ResourceKey,
    call: LockCall,
) -> Result<()> {
    let row = tx
        .executor()
        .query_typed_one(
            sql::LOCK_XACT,
            &[
                (&call.advisory_key, Type::INT8),
                (&call.lock_timeout, Type::TEXT),
            ],
        )
        .await
        .map_err(|e| lock_error(e, key, "waiting for"))?;
    check_isolation(row.try_get(0).map_err(decode_error)?, key)
}

impl<T: PgTransactionRef> DistributedLock<T> for PostgresDistributedLock {
    fn acquire_for_transaction<'a>(
        &'a self,
        tx: &'a T,
        key: &'a ResourceKey,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        self.acquire_then(tx, key, timeout, || std::future::ready(Ok(())))
    }

    fn try_acquire_for_transaction<'a>(
        &'a self,
        tx: &'a T,
        key: &'a ResourceKey,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        self.try_statement(tx, key, key.advisory_key())
    }
}

/// `lock_timeout` for a wait of `limit`: whole milliseconds, rounded up, at least 1 ms
/// (`0` would mean "no timeout").
pub(crate) fn lock_timeout_setting(limit: Duration) -> Result<String> {
    let millis = limit.as_micros().div_ceil(1000).max(1);
    if millis > i32::MAX as u128 {
        return Err(ValidationError::DurationTooLarge {
            field: "lock timeout",
        }
        .into());
    }
    Ok(format!("{millis}ms"))
}

/// Turns the `refused_isolation` a lock statement returned into the caller's error: `None`
/// (the statement checked READ COMMITTED and went on to lock) is fine; `Some(level)` means the
/// transaction is REPEATABLE READ or SERIALIZABLE, where lock-then-load would read a snapshot
/// that may predate the previous holder's commit. The statement took no lock in that case.
pub fn check_isolation(refused: Option<&str>, key: &ResourceKey) -> Result<()> {
    match refused {
        None => Ok(()),
        Some(level) => Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "refusing to lock {key} in a {level} transaction: lock-then-load needs READ \
                 COMMITTED (a REPEATABLE READ or SERIALIZABLE snapshot can predate the previous \
                 holder's commit)"
            ),
        )),
    }
}

/// A lock statement's row did not decode as expected.
pub(crate) fn decode_error(err: tokio_postgres::Error) -> Error {
    Error::new(ErrorKind::Backend, "decoding a lock statement's result").with_source(err)
}

pub(crate) fn lock_error(err: tokio_postgres::Error, key: &ResourceKey, doing: &str) -> Error {
    Error::new(kind_of(&err), format!("{doing} advisory lock {key}")).with_source(err)
}

/// Marks the transaction's connection for discarding if the lock statement is abandoned.
struct DiscardOnDrop<'a, T: PgTransactionRef + ?Sized>(Option<&'a T>);

impl<T: PgTransactionRef + ?Sized> DiscardOnDrop<'_, T> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl<T: PgTransactionRef + ?Sized> Drop for DiscardOnDrop<'_, T> {
    fn drop(&mut self) {
        if let Some(tx) = self.0 {
            tx.discard_connection_after_end();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_timeouts_round_up_to_whole_milliseconds() {
        let s = |d| lock_timeout_setting(d).expect("valid");
        assert_eq!(s(Duration::ZERO), "1ms");
        assert_eq!(s(Duration::from_micros(1)), "1ms");
        assert_eq!(s(Duration::from_micros(1500)), "2ms");
        assert_eq!(s(Duration::from_secs(2)), "2000ms");
        let err = lock_timeout_setting(Duration::from_secs(60 * 60 * 24 * 30)).expect_err("big");
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
    }

    #[test]
    fn a_refused_isolation_level_is_an_unsupported_error() {
        let key = ResourceKey::new("k").expect("key");
        assert!(check_isolation(None, &key).is_ok());
        for level in ["repeatable read", "serializable"] {
            let err = check_isolation(Some(level), &key).expect_err("refused");
            assert_eq!(err.kind(), ErrorKind::Unsupported);
            assert!(err.message().contains(level), "{err}");
        }
    }
}
