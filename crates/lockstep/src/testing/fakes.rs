//! [`Fakes`]: the testkit's in-memory stack on one fake database.

use std::future::Future;
use std::time::{Duration, Instant};

use lockstep_core::{DistributedAggregateWriteLock, StreamLockOptions};
use lockstep_testkit::{
    FakeDatabase, FakeDistributedLock, FakeTransaction, InMemoryEventStore,
    InMemoryPerspectiveStore, InMemoryStreamLocker,
};

use super::{Backend, spawned};

/// The in-memory stack: a [`FakeDatabase`] and every fake built on it — the distributed lock
/// and the aggregate write lock over it, one [`InMemoryEventStore`], an
/// [`InMemoryStreamLocker`] and an [`InMemoryPerspectiveStore`] reading those events. Every
/// wait goes through the one database's wait graph, so a deadlock across them is reported.
/// Clones share everything.
#[derive(Debug, Clone)]
pub struct Fakes {
    db: FakeDatabase,
    lock: FakeDistributedLock,
    events: InMemoryEventStore,
    locker: InMemoryStreamLocker,
    perspectives: InMemoryPerspectiveStore,
}

impl Default for Fakes {
    fn default() -> Self {
        Fakes::new()
    }
}

impl Fakes {
    /// A new, empty stack.
    pub fn new() -> Fakes {
        let db = FakeDatabase::new();
        let events = InMemoryEventStore::new();
        let locker = InMemoryStreamLocker::with_database(StreamLockOptions::default(), &db);
        let perspectives = InMemoryPerspectiveStore::new(&db, &events, &locker);
        Fakes {
            lock: FakeDistributedLock::new(&db),
            db,
            events,
            locker,
            perspectives,
        }
    }

    /// The fake database: its lock table and wait graph (`held_keys`, `holder_of`, `waiters`,
    /// `is_idle`), for what a test checks on the fakes only.
    pub fn database(&self) -> &FakeDatabase {
        &self.db
    }
}

impl Backend for Fakes {
    const NAME: &'static str = "fakes";

    type Tx = FakeTransaction;
    type Source = FakeDatabase;
    type DistributedLock = FakeDistributedLock;
    type AggregateLock = DistributedAggregateWriteLock<FakeDistributedLock>;
    type EventStore = InMemoryEventStore;
    type PerspectiveStore = InMemoryPerspectiveStore;
    type StreamLocker = InMemoryStreamLocker;

    fn source(&self) -> &FakeDatabase {
        &self.db
    }

    fn distributed_lock(&self) -> FakeDistributedLock {
        self.lock.clone()
    }

    fn aggregate_lock(&self) -> DistributedAggregateWriteLock<FakeDistributedLock> {
        DistributedAggregateWriteLock::new(self.lock.clone())
    }

    fn event_store(&self) -> InMemoryEventStore {
        self.events.clone()
    }

    fn perspective_store(&self) -> InMemoryPerspectiveStore {
        self.perspectives.clone()
    }

    fn stream_locker(&self) -> InMemoryStreamLocker {
        self.locker.clone()
    }

    fn lock_waiters(&self) -> impl Future<Output = usize> + Send {
        std::future::ready(self.db.waiting())
    }

    fn until_lock_waiters(&self, n: usize, what: &str) -> impl Future<Output = ()> + Send {
        let db = self.db.clone();
        let what = what.to_owned();
        async move {
            // The wall clock bounds the wait: a test may pause tokio's, which does not move
            // while this task keeps yielding.
            let deadline = Instant::now() + Duration::from_secs(60);
            while db.waiting() < n {
                assert!(
                    Instant::now() < deadline,
                    "{what}: not waiting for a lock after 60 s"
                );
                tokio::task::yield_now().await;
            }
        }
    }
}

/// Runs `body` on a new [`Fakes`] stack, in a task of its own (`tokio::spawn`), and returns
/// what it returned; a panic in `body` fails the caller with its message. Call from a tokio
/// runtime (a `#[tokio::test]`).
///
/// ```
/// use lockstep::testing::{Backend, Fakes, on_fakes};
///
/// async fn named<B: Backend>(_b: B) -> &'static str {
///     B::NAME
/// }
/// # tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(async {
/// assert_eq!(on_fakes(named).await, "fakes");
/// assert_eq!(on_fakes(|b: Fakes| async move { b.database().is_idle() }).await, true);
/// # });
/// ```
pub async fn on_fakes<F, Fut>(body: F) -> Fut::Output
where
    F: FnOnce(Fakes) -> Fut,
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    spawned(body(Fakes::new())).await
}
