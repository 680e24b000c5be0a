//! The perspective store and the snapshot store on sqlx (`SqlxDatabase`, `SqlxTransaction`)
//! against a real PostgreSQL, a database per test: the same perspective-store and
//! snapshot-store conformance suites as on tokio-postgres, one test per case, and a worker's
//! claim and commit from a spawned task with the concrete types.
//!
//! The suites' stream locker is the tokio-postgres `PgStreamLocker` on a pool of the same
//! database: it runs statements of its own, on connections of its own, over the same cursor
//! rows.

use std::time::Duration;

use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    Claim, EventStore as _, ExpectedVersion, NewEvent, Pair, PerspectiveName, Release,
    RewindDebounce, StateCommit, StreamId, StreamLockOptions, Transaction as _,
    TransactionSource as _,
};
use lockstep_pg::LockQueue;
use lockstep_pg::sqlx::{SqlxDatabase, SqlxTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::conformance::event_store::EventStoreFixture;
use lockstep_testkit::conformance::perspective_store::PerspectiveStoreFixture;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};

/// The perspective store on sqlx, the event store on the same handle, and a stream locker
/// (2 s leases, as on tokio-postgres) on a tokio-postgres pool of the same database.
struct PerspectiveFixture {
    _db: TestDatabase,
    source: SqlxDatabase,
    store: PgPerspectiveStore,
    events: PgEventStore,
    locker: PgStreamLocker,
}

impl PerspectiveStoreFixture for PerspectiveFixture {
    type Tx = SqlxTransaction;
    type Source = SqlxDatabase;
    type Store = PgPerspectiveStore;
    type Events = PgEventStore;
    type Locker = PgStreamLocker;
    type Admin = PgStreamLocker;

    fn source(&self) -> &SqlxDatabase {
        &self.source
    }

    fn store(&self) -> &PgPerspectiveStore {
        &self.store
    }

    fn store_with_upcasters(&self, upcasters: lockstep_core::Upcasters) -> PgPerspectiveStore {
        self.store.clone().with_upcasters(upcasters)
    }

    fn events(&self) -> &PgEventStore {
        &self.events
    }

    fn locker(&self) -> &PgStreamLocker {
        &self.locker
    }

    fn admin(&self) -> &PgStreamLocker {
        &self.locker
    }
}

async fn perspective_fixture() -> PerspectiveFixture {
    let db = test_database().await;
    // Lease semantics, not durability, are under test.
    db.skip_wal_flush().await.expect("synchronous_commit");
    let pool = db.pool(2);
    lockstep_pg::migrate(&pool).await.expect("migrate");
    let options = StreamLockOptions::new(Duration::from_secs(2), Duration::from_millis(500))
        .expect("2 s / 500 ms is a valid pair");
    let source = SqlxDatabase::new(db.sqlx_pool(6));
    PerspectiveFixture {
        events: PgEventStore::for_sqlx(&source),
        source,
        store: PgPerspectiveStore::new(),
        locker: PgStreamLocker::from_pool(pool, options),
        _db: db,
    }
}

/// The perspective-store conformance suite on sqlx, one test per case.
mod perspective_store_suite {
    use super::perspective_fixture;

    lockstep_testkit::perspective_store_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: perspective_fixture().await,
    }
}

/// The event store (which is also the snapshot store) on sqlx.
struct SnapshotFixture {
    db: TestDatabase,
    source: SqlxDatabase,
    store: PgEventStore,
}

impl EventStoreFixture for SnapshotFixture {
    type Tx = SqlxTransaction;
    type Source = SqlxDatabase;
    type Store = PgEventStore;

    fn store(&self) -> &PgEventStore {
        &self.store
    }

    fn store_with_upcasters(&self, upcasters: lockstep_core::Upcasters) -> PgEventStore {
        self.store.clone().with_upcasters(upcasters)
    }

    fn source(&self) -> &SqlxDatabase {
        &self.source
    }

    async fn waiting(&self) -> usize {
        // The test's own database: only this case's statements run there.
        let client = self.db.connect().await;
        lockstep_testkit::pg_harness::lock_waiters(&client).await
    }
}

async fn snapshot_fixture() -> SnapshotFixture {
    let db = test_database().await;
    lockstep_pg::migrate(&db.pool(1)).await.expect("migrate");
    let queue = LockQueue::new();
    let source = SqlxDatabase::new(db.sqlx_pool(8)).with_lock_queue(queue.clone());
    SnapshotFixture {
        db,
        source,
        store: PgEventStore::with_queue(queue),
    }
}

/// The snapshot-store conformance suite on sqlx, one test per case.
mod snapshot_store_suite {
    use super::snapshot_fixture;

    lockstep_testkit::snapshot_store_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: snapshot_fixture().await,
    }
}

/// A worker's turn on sqlx, from a spawned task with the concrete types: register, claim the
/// pair an append gave work, and commit its state with the transaction (the state change,
/// then the `COMMIT`). The cursor then reads the new revision and nothing is pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_claims_and_commits_a_pair_from_a_spawned_task_on_sqlx() {
    let f = perspective_fixture().await;
    let name =
        PerspectiveName::new(format!("Orders-{}", uuid::Uuid::new_v4().simple())).expect("name");
    let stream = StreamId::new_v7();

    let turn = tokio::spawn({
        let (source, store, events) = (f.source.clone(), f.store.clone(), f.events.clone());
        let name = name.clone();
        async move {
            let tx: SqlxTransaction = source.begin().await?;
            store.register(&tx, std::slice::from_ref(&name)).await?;
            tx.commit().await?;

            let tx: SqlxTransaction = source.begin().await?;
            let added = NewEvent::new("Added", serde_json::json!({ "n": 1 }))?;
            events
                .append(&tx, stream, ExpectedVersion::NoStream, &[added])
                .await?;
            tx.commit().await?;

            let tx: SqlxTransaction = source.begin().await?;
            let pair = Pair::new(stream, name.clone());
            let Claim::Apply {
                cursor,
                events: applied,
                ..
            } = store.claim(&tx, &pair, 10, RewindDebounce::NONE).await?
            else {
                panic!("the appended event is work to apply");
            };
            let mut commit =
                StateCommit::new(pair, cursor.revision, serde_json::json!({ "seen": 1 }));
            commit.last_event_id = applied.last().map(|e| e.event_id);
            commit.applied_count = applied.len() as u64;
            commit.applied_events = applied.iter().map(|e| e.event_id).collect();
            let committed = store.commit(tx, &commit, Release::Keep).await?;
            Ok::<_, lockstep_core::Error>((cursor.revision, committed))
        }
    });
    let (before, committed) = turn.await.expect("task").expect("the worker's turn");
    assert!(committed.revision > before);

    let tx = f.source.begin().await.expect("begin");
    let pair = Pair::new(stream, name);
    let (cursor, state) = f
        .store
        .state(&tx, &pair)
        .await
        .expect("state")
        .expect("a cursor");
    assert_eq!(cursor.revision, committed.revision);
    assert_eq!(cursor.applied_count, 1);
    assert_eq!(state, Some(serde_json::json!({ "seen": 1 })));
    assert!(
        f.store
            .pending_events(&tx, &pair)
            .await
            .expect("pending")
            .is_empty()
    );
    tx.rollback().await.expect("rollback");
}
