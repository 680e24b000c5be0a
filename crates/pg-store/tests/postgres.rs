//! lockstep-pg-store against a real PostgreSQL (a database per test): the shared event-store
//! conformance suite, and the store on a borrowed `tokio_postgres::Transaction`.

use std::sync::Arc;

use deadpool_postgres::Pool;
use lockstep_core::{ErrorKind, EventStore, ExpectedVersion, NewEvent, Result, StreamId};
use lockstep_pg::{PgTransaction, migrate};
use lockstep_pg_advisory::PostgresDistributedLock;
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::conformance::event_store::{self, EventStoreFixture};
use lockstep_testkit::pg_harness::{TestDatabase, test_database};

struct Fixture {
    _db: TestDatabase,
    pool: Pool,
    store: PgEventStore,
}

impl EventStoreFixture for Fixture {
    type Tx = PgTransaction;
    type Store = PgEventStore;

    fn store(&self) -> &PgEventStore {
        &self.store
    }

    async fn begin(&self) -> PgTransaction {
        PgTransaction::begin(&self.pool).await.expect("begin")
    }

    async fn commit(&self, tx: PgTransaction) -> Result<()> {
        tx.commit().await
    }

    async fn rollback(&self, tx: PgTransaction) {
        tx.rollback().await.expect("rollback");
    }
}

async fn migrated(pool_size: usize) -> (TestDatabase, Pool) {
    let db = test_database().await;
    let pool = db.pool(pool_size);
    migrate(&pool).await.expect("migrate");
    (db, pool)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_event_store_passes_the_event_store_suite() {
    let (db, pool) = migrated(8).await;
    let store = PgEventStore::with_lock(PostgresDistributedLock::new(pool.clone()));
    event_store::run_all(Arc::new(Fixture {
        _db: db,
        pool,
        store,
    }))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_event_store_passes_the_event_store_suite_with_its_own_lock() {
    let (db, pool) = migrated(8).await;
    event_store::run_all(Arc::new(Fixture {
        _db: db,
        pool,
        store: PgEventStore::new(),
    }))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_runs_on_a_borrowed_tokio_postgres_transaction() {
    let (db, _pool) = migrated(1).await;
    let mut client = db.connect().await;
    let store = PgEventStore::new();
    let stream = StreamId::new_v7();
    let event = NewEvent::new("Opened", serde_json::json!({"by": "test"})).expect("event");
    let tx = client.transaction().await.expect("begin");
    let v = store
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            std::slice::from_ref(&event),
        )
        .await
        .expect("append");
    assert_eq!(v, 1);
    tx.commit().await.expect("commit");

    let tx = client.transaction().await.expect("begin");
    let err = store
        .append(&tx, stream, ExpectedVersion::NoStream, &[event])
        .await
        .expect_err("stream exists");
    assert_eq!(err.kind(), ErrorKind::Conflict);
    tx.rollback().await.expect("rollback");
    let tx = client.transaction().await.expect("begin");
    let events = store.load(&tx, stream).await.expect("load");
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].payload["by"], "test");
    tx.commit().await.expect("commit");
}
