//! [`Postgres`]: the Postgres stack on a database of the test's own, and [`fresh_database`].

use std::future::Future;
use std::ops::Deref;
use std::sync::Arc;

use lockstep_core::StreamLockOptions;
use lockstep_pg::{PgDatabase, PgDatabaseBuilder, PgTransaction};
use lockstep_pg_advisory::{PgAggregateWriteLock, PgDistributedLock};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::{self, TestDatabase};

use super::{Backend, spawned};

/// A migrated [`PgDatabase`] on a database created for one test, which is dropped (its
/// leftover connections terminated) when this value is. Derefs to the [`PgDatabase`]: pass
/// `&fresh` where a `&PgDatabase` is wanted, `fresh.clone()` is a `PgDatabase` (whose calls
/// fail once the database is dropped).
#[derive(Debug)]
pub struct FreshDatabase {
    db: PgDatabase,
    // Dropped after `db` (fields drop in order): the handle's pool goes first.
    test: TestDatabase,
}

impl FreshDatabase {
    /// The handle.
    pub fn database(&self) -> &PgDatabase {
        &self.db
    }

    /// The test database under it: its name, its connection settings, a direct connection,
    /// `pg_dump`, a relay's address (`lockstep_testkit::pg_harness::TestDatabase`).
    pub fn test_database(&self) -> &TestDatabase {
        &self.test
    }
}

impl Deref for FreshDatabase {
    type Target = PgDatabase;

    fn deref(&self) -> &PgDatabase {
        &self.db
    }
}

impl AsRef<PgDatabase> for FreshDatabase {
    fn as_ref(&self) -> &PgDatabase {
        &self.db
    }
}

/// A database of the test's own on the server `lockstep_testkit::pg_harness` finds
/// (`DATABASE_URL`, else the local server at `127.0.0.1:5432`), migrated, with a
/// [`PgDatabase`] on it of [`PgDatabase::DEFAULT_MAX_CONNECTIONS`] connections.
///
/// # Panics
///
/// When no server can be reached (saying how to provide one), or the database cannot be
/// created or migrated: the test fails there.
///
/// ```no_run
/// use lockstep::postgres::PgEventStore;
/// use lockstep::testing::fresh_database;
///
/// # async fn demo() {
/// let db = fresh_database().await;
/// let store = PgEventStore::new(&db); // `&FreshDatabase` derefs to `&PgDatabase`
/// # }
/// ```
pub async fn fresh_database() -> FreshDatabase {
    fresh_database_with(|builder| builder).await
}

/// [`fresh_database`], with the handle's settings changed by `configure`, which gets a
/// [`PgDatabaseBuilder`] already pointed at the new database: `|b| b.max_connections(1)` for a
/// pool of one. The schema is migrated through the handle it builds.
///
/// # Panics
///
/// As [`fresh_database`]; also when `configure` leaves settings `build()` refuses.
pub async fn fresh_database_with(
    configure: impl FnOnce(PgDatabaseBuilder) -> PgDatabaseBuilder,
) -> FreshDatabase {
    let test = pg_harness::test_database().await;
    let name = test.name().to_owned();
    let db = configure(PgDatabase::builder().config(test.config().clone()))
        .build()
        .unwrap_or_else(|e| panic!("a handle on the test database {name}: {e}"));
    if let Err(e) = db.migrate().await {
        panic!("migrating the test database {name} failed: {e}");
    }
    FreshDatabase { db, test }
}

/// The Postgres stack: a [`FreshDatabase`] and every Postgres backend built from its one
/// [`PgDatabase`] — [`PgDistributedLock`], [`PgAggregateWriteLock`], [`PgEventStore`],
/// [`PgPerspectiveStore`], [`PgStreamLocker`] — so they share its pool and lock queue. Clones
/// share everything; the database is dropped with the last clone.
#[derive(Debug, Clone)]
pub struct Postgres {
    fresh: Arc<FreshDatabase>,
    lock: PgDistributedLock,
    events: PgEventStore,
    perspectives: PgPerspectiveStore,
    locker: PgStreamLocker,
}

impl Postgres {
    /// The stack on a new [`fresh_database`].
    ///
    /// # Panics
    ///
    /// As [`fresh_database`].
    pub async fn fresh() -> Postgres {
        Postgres::on(fresh_database().await)
    }

    /// The stack on `fresh` (from [`fresh_database_with`], say, for other pool settings).
    pub fn on(fresh: FreshDatabase) -> Postgres {
        let db = fresh.database();
        Postgres {
            lock: PgDistributedLock::new(db),
            events: PgEventStore::new(db),
            perspectives: PgPerspectiveStore::new(),
            locker: PgStreamLocker::new(db, StreamLockOptions::default()),
            fresh: Arc::new(fresh),
        }
    }

    /// The handle every backend of the stack is built from.
    pub fn database(&self) -> &PgDatabase {
        self.fresh.database()
    }

    /// The test database under it (a direct connection, `pg_dump`, a relay's address).
    pub fn test_database(&self) -> &TestDatabase {
        self.fresh.test_database()
    }
}

impl Backend for Postgres {
    const NAME: &'static str = "postgres";

    type Tx = PgTransaction;
    type Source = PgDatabase;
    type DistributedLock = PgDistributedLock;
    type AggregateLock = PgAggregateWriteLock;
    type EventStore = PgEventStore;
    type PerspectiveStore = PgPerspectiveStore;
    type StreamLocker = PgStreamLocker;

    fn source(&self) -> &PgDatabase {
        self.fresh.database()
    }

    fn distributed_lock(&self) -> PgDistributedLock {
        self.lock.clone()
    }

    fn aggregate_lock(&self) -> PgAggregateWriteLock {
        self.lock.aggregate_write_lock()
    }

    fn event_store(&self) -> PgEventStore {
        self.events.clone()
    }

    fn perspective_store(&self) -> PgPerspectiveStore {
        self.perspectives.clone()
    }

    fn stream_locker(&self) -> PgStreamLocker {
        self.locker.clone()
    }

    fn lock_waiters(&self) -> impl Future<Output = usize> + Send {
        let fresh = Arc::clone(&self.fresh);
        async move {
            // A connection of its own, outside the pool the test may have used up.
            let client = fresh.test_database().connect().await;
            pg_harness::lock_waiters(&client).await
        }
    }

    fn until_lock_waiters(&self, n: usize, what: &str) -> impl Future<Output = ()> + Send {
        let fresh = Arc::clone(&self.fresh);
        let what = what.to_owned();
        async move {
            let client = fresh.test_database().connect().await;
            pg_harness::until_lock_waiters(&client, n, &what).await;
        }
    }
}

/// Runs `body` on a new [`Postgres`] stack, in a task of its own (`tokio::spawn`), and returns
/// what it returned; the test's database lives until the body has finished (whatever the body
/// does with the stack it was given) and is dropped then — a transaction returned out of
/// `body` has lost its connection. A panic in `body` fails the caller with its message. Call
/// from a tokio runtime (a `#[tokio::test]`).
///
/// # Panics
///
/// As [`fresh_database`]: without a reachable server the test fails, saying how to provide one.
///
/// ```no_run
/// use lockstep::testing::{Backend, on_postgres};
///
/// async fn named<B: Backend>(_b: B) -> &'static str {
///     B::NAME
/// }
/// # async fn demo() {
/// assert_eq!(on_postgres(named).await, "postgres");
/// # }
/// ```
pub async fn on_postgres<F, Fut>(body: F) -> Fut::Output
where
    F: FnOnce(Postgres) -> Fut,
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    let stack = Postgres::fresh().await;
    // The body may hand the stack to a function that drops it while a transaction of the
    // stack is still open; the database must outlive the whole body.
    let keep = stack.clone();
    let output = spawned(body(stack)).await;
    drop(keep);
    output
}
