//! The transaction-scoped advisory locks on sqlx transactions (feature `sqlx`):
//! [`SqlxDistributedLock`] runs the same lock statements, queue, deadline and cancel-on-drop as
//! [`PgDistributedLock`](crate::PgDistributedLock), on [`SqlxTransaction`]s. Session locks are
//! not offered on sqlx.

use std::future::Future;
use std::time::Duration;

use lockstep_core::{DistributedAggregateWriteLock, DistributedLock, ResourceKey, Result};
use lockstep_pg::LockQueue;
use lockstep_pg::internal;
use lockstep_pg::sqlx::{SqlxDatabase, SqlxTransaction};

/// The aggregate write lock (`relay:aggregate:{type}:{id}`) on sqlx transactions.
pub type SqlxAggregateWriteLock = DistributedAggregateWriteLock<SqlxDistributedLock>;

/// Transaction-scoped advisory locks on [`SqlxTransaction`]s, queued in the handle's
/// [`LockQueue`] (shared with the event store's `load_locked` built from the same handle).
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct SqlxDistributedLock {
    queue: LockQueue,
}

impl SqlxDistributedLock {
    /// The lock of `db`, in its lock queue.
    pub fn new(db: &SqlxDatabase) -> SqlxDistributedLock {
        SqlxDistributedLock {
            queue: db.lock_queue().clone(),
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
