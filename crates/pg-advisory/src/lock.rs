//! [`PgDistributedLock`]: transaction-scoped advisory locks on the caller's transaction,
//! with an in-process queue in front, pipelining, timeouts, cancellation and an isolation check.
//! The queue, the deadline and cancel-on-drop are `lockstep-pg`'s [`LockQueue`], shared with the
//! event store's `load_locked`.

use std::future::Future;
use std::time::Duration;

use deadpool_postgres::Pool;
use lockstep_core::{DistributedAggregateWriteLock, DistributedLock, ResourceKey, Result};
use lockstep_pg::internal::{self, PoolerState};
use lockstep_pg::{LockQueue, PgDatabase, PgTransaction};
use tokio_postgres::Socket;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};

/// The Postgres aggregate write lock: the pure [`DistributedAggregateWriteLock`] of
/// `lockstep-core` over [`PgDistributedLock`] (no second implementation).
pub type PgAggregateWriteLock = DistributedAggregateWriteLock<PgDistributedLock>;

/// Exclusive locks on [`ResourceKey`]s, as PostgreSQL advisory locks on
/// [`ResourceKey::advisory_key`].
///
/// - [`DistributedLock`] for the owned [`PgTransaction`]: `pg_advisory_xact_lock` /
///   `pg_try_advisory_xact_lock` on the caller's transaction, released by the server at commit,
///   rollback or disconnect. Only for [`PgTransaction`]: a wait that is abandoned is ended by a
///   cancel request that may arrive late, so the transaction's connection must be closed
///   afterwards, and only a transaction that owns its connection can do that. A borrowed
///   `tokio_postgres::Transaction` (or `deadpool_postgres::Transaction`) therefore does not
///   compile here (`docs/adr/0003-advisory-lock-design.md`, addendum).
/// - [`lockstep_core::SessionLocks`]: a guard that owns a connection from the lock's pool
///   holding `pg_advisory_lock`. Every constructor takes the pool, so a lock that cannot take
///   session locks cannot be built (there is no run-time "no pool" error).
///
/// Clones share the in-process queue ([`LockQueue`]). Build it from the process's one
/// [`PgDatabase`] ([`PgDistributedLock::new`]), as the event store is
/// (`PgEventStore::new(&db)`), so that `load_locked` queues with the aggregate lock.
///
/// ```compile_fail
/// # async fn demo(lock: lockstep_pg_advisory::PgDistributedLock,
/// #               tx: tokio_postgres::Transaction<'_>, key: lockstep_core::ResourceKey) {
/// use lockstep_core::DistributedLock;
/// // A borrowed transaction cannot wait for a lock: it could not close its connection after
/// // an abandoned wait.
/// lock.acquire_for_transaction(&tx, &key, None).await;
/// # }
/// ```
///
/// ```no_run
/// # async fn demo(lock: lockstep_pg_advisory::PgDistributedLock,
/// #               tx: lockstep_pg::PgTransaction, key: lockstep_core::ResourceKey)
/// #               -> lockstep_core::Result<()> {
/// use lockstep_core::DistributedLock;
/// lock.acquire_for_transaction(&tx, &key, None).await?; // the owned transaction can
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgDistributedLock {
    pub(crate) pool: Pool,
    pub(crate) queue: LockQueue,
    pub(crate) checkout_wait: Duration,
    // What is known about a transaction pooler in front of the server (session locks refuse
    // behind one): the handle's, shared.
    pub(crate) pooler: PoolerState,
}

impl std::fmt::Debug for PgDistributedLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The pool's configuration holds the connection string: only its status is shown.
        f.debug_struct("PgDistributedLock")
            .field("pool_status", &self.pool.status())
            .field("queue", &self.queue)
            .field("checkout_wait", &self.checkout_wait)
            .finish()
    }
}

impl PgDistributedLock {
    /// How long a waiter queues in process before it waits at the server regardless
    /// (default 1 s); see [`PgDistributedLock::with_local_patience`].
    pub const DEFAULT_LOCAL_PATIENCE: Duration = LockQueue::DEFAULT_LOCAL_PATIENCE;

    /// The locks of `db`: transaction-scoped locks, plus session-scoped locks on connections
    /// from its pool (checkouts waiting its checkout wait), queueing in its lock queue — shared
    /// with every other backend built from `db` — and cancelling abandoned waits with its TLS.
    pub fn new(db: &PgDatabase) -> PgDistributedLock {
        let mut lock = PgDistributedLock::with_queue(db.pool().clone(), db.lock_queue().clone())
            .with_checkout_wait(db.checkout_wait());
        lock.pooler = lockstep_pg::internal::pooler_state(db).clone();
        lock
    }

    /// For wiring by hand (prefer [`PgDistributedLock::new`]): locks on connections from
    /// `pool`, with an in-process queue of their own and cancel requests without TLS (for a
    /// pool built with a TLS connector, pass the same connector to
    /// [`PgDistributedLock::with_cancel_tls`]).
    pub fn from_pool(pool: Pool) -> PgDistributedLock {
        PgDistributedLock::with_queue(pool, LockQueue::new())
    }

    /// Like [`PgDistributedLock::from_pool`], queueing in `queue` (shared with whoever else
    /// holds a clone of it).
    pub fn with_queue(pool: Pool, queue: LockQueue) -> PgDistributedLock {
        PgDistributedLock {
            pool,
            queue,
            checkout_wait: lockstep_pg::DEFAULT_CHECKOUT_WAIT,
            pooler: PoolerState::default(),
        }
    }

    /// How long a session acquire waits for a free pooled connection (default
    /// [`lockstep_pg::DEFAULT_CHECKOUT_WAIT`]; never longer than the acquire's own timeout)
    /// before failing with a retryable
    /// [`ErrorKind::ConnectionLost`](lockstep_core::ErrorKind::ConnectionLost). Transaction-scoped
    /// locks use the caller's transaction and check nothing out. See [`lockstep_pg::pool`].
    #[must_use]
    pub fn with_checkout_wait(mut self, wait: Duration) -> Self {
        self.checkout_wait = wait;
        self
    }

    /// The pool session locks take their connections from.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Turns the in-process queue on (default) or off. Off, every waiter waits at the server
    /// (one waiting backend per waiter). See [`LockQueue::with_local_queue`].
    #[must_use]
    pub fn with_local_queue(mut self, enabled: bool) -> Self {
        self.queue = self.queue.with_local_queue(enabled);
        self
    }

    /// How long a waiter queues in process before it goes to wait at the server anyway
    /// (default [`Self::DEFAULT_LOCAL_PATIENCE`]). See [`LockQueue::with_local_patience`].
    #[must_use]
    pub fn with_local_patience(mut self, patience: Duration) -> Self {
        self.queue = self.queue.with_local_patience(patience);
        self
    }

    /// Sends the cancel requests that end abandoned waits with `tls`, **the connector the pool
    /// was built with** (default: no TLS). See [`LockQueue::with_cancel_tls`].
    #[must_use]
    pub fn with_cancel_tls<T>(mut self, tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
        T::Stream: Sync + Send,
        T::TlsConnect: Sync + Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        self.queue = self.queue.with_cancel_tls(tls);
        self
    }

    /// The in-process queue (with its settings), e.g. for `PgEventStore::with_lock`.
    pub fn queue(&self) -> &LockQueue {
        &self.queue
    }

    /// The per-aggregate write lock over this lock (shares its queue).
    pub fn aggregate_write_lock(&self) -> PgAggregateWriteLock {
        DistributedAggregateWriteLock::new(self.clone())
    }

    /// How many keys have local waiters right now (0 when idle: entries are removed when their
    /// last waiter leaves).
    pub fn locally_queued_keys(&self) -> usize {
        self.queue.locally_queued_keys()
    }

    /// Takes `key` for `tx` (like [`DistributedLock::acquire_for_transaction`]) and runs the
    /// statements of `then` **pipelined behind the lock statement**: both go to the server in
    /// one round trip, and the server runs `then`'s statements only once the lock is held, so
    /// they see what the previous holder committed.
    ///
    /// `then` must issue its statements on `tx` on its first poll (any tokio-postgres query
    /// future does). If the lock fails, `then`'s result is discarded (its statements then fail
    /// too: the transaction is aborted).
    pub async fn acquire_then<R, F, Fut>(
        &self,
        tx: &PgTransaction,
        key: &ResourceKey,
        timeout: Option<Duration>,
        mut then: F,
    ) -> Result<R>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<R>>,
    {
        internal::acquire_with(&self.queue, tx, key, timeout, |call| {
            let lock = internal::lock_statement(tx, key, call);
            let then = then();
            // `join!`, not `try_join!`: a `then` that fails without waiting for the server must
            // not drop the lock statement while it still waits there (the cancel guard is
            // disarmed once this future returns, so nothing would end that wait).
            async move {
                let (locked, value) = futures_util::join!(lock, then);
                locked.and(value)
            }
        })
        .await
    }
}

/// The lock's queue, so an event store wired by hand queues its `load_locked` with the lock:
/// `PgEventStore::with_queue(lock.clone())` (built from one `PgDatabase`, both share its queue).
impl From<PgDistributedLock> for LockQueue {
    fn from(lock: PgDistributedLock) -> LockQueue {
        lock.queue
    }
}

/// The lock's queue (shared, not copied).
impl From<&PgDistributedLock> for LockQueue {
    fn from(lock: &PgDistributedLock) -> LockQueue {
        lock.queue.clone()
    }
}

impl DistributedLock<PgTransaction> for PgDistributedLock {
    fn acquire_for_transaction<'a>(
        &'a self,
        tx: &'a PgTransaction,
        key: &'a ResourceKey,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        internal::acquire_with(&self.queue, tx, key, timeout, move |call| {
            internal::lock_statement(tx, key, call)
        })
    }

    fn try_acquire_for_transaction<'a>(
        &'a self,
        tx: &'a PgTransaction,
        key: &'a ResourceKey,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        internal::try_lock_statement(tx, key)
    }
}
