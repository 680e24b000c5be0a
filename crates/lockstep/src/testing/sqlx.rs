//! [`Sqlx`]: the Postgres stack on sqlx, on a database of the test's own, and
//! [`fresh_sqlx_database`].

use std::future::Future;
use std::ops::Deref;
use std::sync::Arc;

use lockstep_core::StreamLockOptions;
use lockstep_pg::sqlx::{SqlxDatabase, SqlxTransaction};
use lockstep_pg_advisory::{SqlxAggregateWriteLock, SqlxDistributedLock};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::{self, TestDatabase};

use super::{Backend, spawned};

/// How many connections the test's sqlx pool has (as many as a `PgDatabase`'s default).
const POOL_SIZE: u32 = 16;

/// A migrated database created for one test, with an [`SqlxDatabase`] on an `sqlx::PgPool` of
/// its own; the database is dropped (its leftover connections terminated) when this value is.
/// Derefs to the [`SqlxDatabase`]; its [`pool`](SqlxDatabase::pool) is the application's pool,
/// for the application's own tables and statements.
#[derive(Debug)]
pub struct FreshSqlxDatabase {
    db: SqlxDatabase,
    // Dropped after `db` (fields drop in order).
    test: TestDatabase,
}

impl FreshSqlxDatabase {
    /// The handle.
    pub fn database(&self) -> &SqlxDatabase {
        &self.db
    }

    /// The test database under it (a direct tokio-postgres connection, `pg_dump`, a relay's
    /// address).
    pub fn test_database(&self) -> &TestDatabase {
        &self.test
    }
}

impl Deref for FreshSqlxDatabase {
    type Target = SqlxDatabase;

    fn deref(&self) -> &SqlxDatabase {
        &self.db
    }
}

/// A database of the test's own (on the server `lockstep_testkit::pg_harness` finds), migrated,
/// with an [`SqlxDatabase`] on a new `sqlx::PgPool` to it.
///
/// # Panics
///
/// When no server can be reached (saying how to provide one), or the database cannot be
/// created or migrated: the test fails there.
pub async fn fresh_sqlx_database() -> FreshSqlxDatabase {
    let test = pg_harness::test_database().await;
    let name = test.name().to_owned();
    if let Err(e) = lockstep_pg::migrate(&test.pool(1)).await {
        panic!("migrating the test database {name} failed: {e}");
    }
    let db = SqlxDatabase::new(test.sqlx_pool(POOL_SIZE));
    FreshSqlxDatabase { db, test }
}

/// The Postgres stack on sqlx: a [`FreshSqlxDatabase`] and every Postgres backend built from
/// its one [`SqlxDatabase`] — [`SqlxDistributedLock`], [`SqlxAggregateWriteLock`],
/// [`PgEventStore`], [`PgPerspectiveStore`], [`PgStreamLocker`] — on [`SqlxTransaction`]s, so
/// they share its pool and lock queue. Clones share everything; the database is dropped with
/// the last clone.
#[derive(Debug, Clone)]
pub struct Sqlx {
    fresh: Arc<FreshSqlxDatabase>,
    lock: SqlxDistributedLock,
    events: PgEventStore,
    perspectives: PgPerspectiveStore,
    locker: PgStreamLocker,
}

impl Sqlx {
    /// The stack on a new [`fresh_sqlx_database`].
    ///
    /// # Panics
    ///
    /// As [`fresh_sqlx_database`].
    pub async fn fresh() -> Sqlx {
        Sqlx::on(fresh_sqlx_database().await)
    }

    /// The stack on `fresh`.
    pub fn on(fresh: FreshSqlxDatabase) -> Sqlx {
        let db = fresh.database();
        Sqlx {
            lock: SqlxDistributedLock::new(db),
            events: PgEventStore::for_sqlx(db),
            perspectives: PgPerspectiveStore::new(),
            locker: PgStreamLocker::for_sqlx(db, StreamLockOptions::default()),
            fresh: Arc::new(fresh),
        }
    }

    /// The handle every backend of the stack is built from.
    pub fn database(&self) -> &SqlxDatabase {
        self.fresh.database()
    }

    /// The test database under it.
    pub fn test_database(&self) -> &TestDatabase {
        self.fresh.test_database()
    }
}

impl Backend for Sqlx {
    const NAME: &'static str = "sqlx";

    type Tx = SqlxTransaction;
    type Source = SqlxDatabase;
    type DistributedLock = SqlxDistributedLock;
    type AggregateLock = SqlxAggregateWriteLock;
    type EventStore = PgEventStore;
    type PerspectiveStore = PgPerspectiveStore;
    type StreamLocker = PgStreamLocker;

    fn source(&self) -> &SqlxDatabase {
        self.fresh.database()
    }

    fn distributed_lock(&self) -> SqlxDistributedLock {
        self.lock.clone()
    }

    fn aggregate_lock(&self) -> SqlxAggregateWriteLock {
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

/// Runs `body` on a new [`Sqlx`] stack, in a task of its own, and returns what it returned —
/// [`on_postgres`](super::on_postgres) on sqlx: the same body, on the application's driver. A
/// table perspective written with sqlx is tested here, on a real database, with no in-memory
/// twin.
///
/// # Panics
///
/// As [`fresh_sqlx_database`].
pub async fn on_sqlx<F, Fut>(body: F) -> Fut::Output
where
    F: FnOnce(Sqlx) -> Fut,
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    let stack = Sqlx::fresh().await;
    let keep = stack.clone();
    let output = spawned(body(stack)).await;
    drop(keep);
    output
}
