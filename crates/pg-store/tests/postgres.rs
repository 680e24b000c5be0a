//! lockstep-pg-store against a real PostgreSQL (a database per test): the shared event-store
//! conformance suite (one test per case), and load and append on borrowed `tokio_postgres::Transaction`s and
//! `deadpool_postgres::Transaction`s.

use deadpool_postgres::Pool;
use lockstep_core::Transaction as _;
use lockstep_core::{ErrorKind, EventStore, ExpectedVersion, NewEvent, StreamId};
use lockstep_pg::{LockQueue, PgDatabase, PgTransaction, migrate};
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::conformance::event_store::EventStoreFixture;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};

struct Fixture {
    _db: TestDatabase,
    source: PgDatabase,
    store: PgEventStore,
}

impl EventStoreFixture for Fixture {
    type Tx = PgTransaction;
    type Source = PgDatabase;
    type Store = PgEventStore;

    fn store(&self) -> &PgEventStore {
        &self.store
    }

    fn store_with_upcasters(&self, upcasters: lockstep_core::Upcasters) -> PgEventStore {
        self.store.clone().with_upcasters(upcasters)
    }

    fn source(&self) -> &PgDatabase {
        &self.source
    }

    async fn waiting(&self) -> usize {
        // The test's own database: only this case's statements run there.
        let client = self.source.pool().get().await.expect("a connection");
        lockstep_testkit::pg_harness::lock_waiters(&client).await
    }
}

async fn migrated(pool_size: usize) -> (TestDatabase, Pool) {
    let db = test_database().await;
    let pool = db.pool(pool_size);
    migrate(&pool).await.expect("migrate");
    (db, pool)
}

/// `store` on a migrated database of the test's own (8 connections).
async fn fixture(store: PgEventStore) -> Fixture {
    let (db, pool) = migrated(8).await;
    Fixture {
        _db: db,
        source: PgDatabase::from_pool(pool),
        store,
    }
}

/// The event-store conformance suite, one test per case, with the lock on a queue the
/// process's lock would share (lockstep-pg-advisory hands its own over).
mod event_store_suite {
    use super::*;

    lockstep_testkit::event_store_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(PgEventStore::with_queue(LockQueue::new())).await,
    }
}

/// The suite with the in-process queue off.
mod event_store_suite_without_the_local_queue {
    use super::*;

    lockstep_testkit::event_store_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(PgEventStore::with_queue(LockQueue::new().with_local_queue(false))).await,
    }
}

/// The snapshot-store conformance suite, one test per case.
mod snapshot_store_suite {
    use super::*;

    lockstep_testkit::snapshot_store_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(PgEventStore::with_queue(LockQueue::new())).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_runs_on_a_borrowed_tokio_postgres_transaction() {
    let (db, _pool) = migrated(1).await;
    let mut client = db.connect().await;
    let store = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let stream = StreamId::new_v7();
    let event = NewEvent::new("Opened", serde_json::json!({"by": "test"})).expect("event");
    let tx = client.transaction().await.expect("begin");
    let v = store
        .append_on(
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
    let replayed = store
        .append_on(&tx, stream, ExpectedVersion::NoStream, &[event])
        .await
        .expect("the same event again is a replay");
    assert_eq!(replayed, 1);
    let another = NewEvent::new("Opened", serde_json::json!({"by": "another"})).expect("event");
    let err = store
        .append_on(&tx, stream, ExpectedVersion::NoStream, &[another])
        .await
        .expect_err("stream exists");
    assert_eq!(err.kind(), ErrorKind::Conflict);
    tx.rollback().await.expect("rollback");
    let tx = client.transaction().await.expect("begin");
    let events = store.load_on(&tx, stream).await.expect("load");
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].payload["by"], "test");
    tx.commit().await.expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_runs_on_a_borrowed_deadpool_transaction_passed_as_a_reference() {
    let (_db, pool) = migrated(1).await;
    let store = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let stream = StreamId::new_v7();
    let event = NewEvent::new("Opened", serde_json::json!({"by": "deadpool"})).expect("event");
    let mut conn = pool.get().await.expect("connection");
    let tx = conn.transaction().await.expect("begin");
    let v = store
        .append_on(&tx, stream, ExpectedVersion::NoStream, &[event])
        .await
        .expect("append");
    assert_eq!(v, 1);
    let events = store.load_on(&tx, stream).await.expect("load");
    assert_eq!(events.len(), 1);
    tx.commit().await.expect("commit");
}

fn fresh_key() -> lockstep_core::ResourceKey {
    lockstep_core::ResourceKey::new(format!("test:{}", uuid::Uuid::new_v4())).expect("key")
}

async fn waiting_for(client: &tokio_postgres::Client, key: &lockstep_core::ResourceKey) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = $1",
            &[&key.advisory_key()],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_locked_refuses_a_repeatable_read_transaction_before_locking() {
    let (db, pool) = migrated(1).await;
    let admin = db.connect().await;
    let store = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let key = fresh_key();
    // load_locked waits for a lock, so it takes an owned PgTransaction (READ COMMITTED by
    // default); switch it to REPEATABLE READ before its first query.
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.client()
        .batch_execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .await
        .expect("repeatable read");
    let err = store
        .load_locked(&tx, StreamId::new_v7(), &key, None)
        .await
        .expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    let held: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
             AND ((classid::bigint << 32) | objid::bigint) = $1",
            &[&key.advisory_key()],
        )
        .await
        .expect("pg_locks")
        .get(0);
    assert_eq!(held, 0, "nothing locked");
    tx.client()
        .query_one("SELECT 1", &[])
        .await
        .expect("still usable");
    tx.rollback().await.expect("rollback");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_waiting_load_locked_ends_its_server_side_wait() {
    let (db, pool) = migrated(3).await;
    let admin = db.connect().await;
    let store = PgEventStore::with_queue(LockQueue::new());
    let (key, stream) = (fresh_key(), StreamId::new_v7());
    let holder = PgTransaction::begin(&pool).await.expect("begin");
    store
        .load_locked(&holder, stream, &key, None)
        .await
        .expect("free");
    let waiter = PgTransaction::begin(&pool).await.expect("begin");
    // Dropped once the server shows it waiting behind the holder.
    let mut abandoned = Box::pin(store.load_locked(&waiter, stream, &key, None));
    tokio::select! {
        outcome = &mut abandoned => panic!("the load must wait for the holder: {outcome:?}"),
        () = lockstep_testkit::pg_harness::until_lock_waiters(&admin, 1, "the load") => {}
    }
    drop(abandoned);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while waiting_for(&admin, &key).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the wait still runs 10 s after the drop"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    waiter.rollback().await.expect("rollback");
    holder.commit().await.expect("commit");
    let err = {
        let (a, b) = (
            PgTransaction::begin(&pool).await.expect("begin"),
            PgTransaction::begin(&pool).await.expect("begin"),
        );
        store
            .load_locked(&a, stream, &key, None)
            .await
            .expect("free");
        let err = store
            .load_locked(&b, stream, &key, Some(std::time::Duration::from_millis(50)))
            .await
            .expect_err("times out");
        a.rollback().await.expect("rollback");
        b.rollback().await.expect("rollback");
        err
    };
    assert_eq!(err.kind(), ErrorKind::LockTimeout);
}
