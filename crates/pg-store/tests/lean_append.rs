//! The lean append (`lockstep_append_events`, ADR 0019) against a real PostgreSQL: the fan-out runs
//! only with a registered perspective, and ids stored in another stream while an append waited
//! for them are refused. (Replays, refusals, expected versions and races in one stream are the
//! event-store conformance suite's, in `postgres.rs`.)

use deadpool_postgres::Pool;
use lockstep_core::Transaction as _;
use lockstep_core::{ErrorKind, EventStore, ExpectedVersion, NewEvent, StreamId};
use lockstep_pg::{LockQueue, PgTransaction, migrate};
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::pg_harness::{TestDatabase, test_database, until_lock_waiters};

async fn migrated() -> (TestDatabase, Pool) {
    let db = test_database().await;
    let pool = db.pool(4);
    migrate(&pool).await.expect("migrate");
    (db, pool)
}

fn event(n: u64) -> NewEvent {
    NewEvent::new("Numbered", serde_json::json!({ "n": n })).expect("event")
}

async fn count(pool: &Pool, sql: &str, stream: StreamId) -> i64 {
    let client = pool.get().await.expect("connection");
    client
        .query_one(sql, &[&stream.as_uuid()])
        .await
        .expect("count")
        .get(0)
}

async fn work_rows(pool: &Pool, stream: StreamId) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM wh_perspective_events WHERE stream_id = $1",
        stream,
    )
    .await
}

async fn cursors(pool: &Pool, stream: StreamId) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM wh_perspective_cursors WHERE stream_id = $1",
        stream,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_enqueue_work_only_for_registered_perspectives() {
    let (_db, pool) = migrated().await;
    let store = PgEventStore::with_queue(LockQueue::new());
    let stream = StreamId::new_v7();

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let v = store
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[event(1), event(2)],
        )
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    assert_eq!(v, 2);
    assert_eq!(work_rows(&pool, stream).await, 0, "nothing registered");
    assert_eq!(cursors(&pool, stream).await, 0, "nothing registered");

    let client = pool.get().await.expect("connection");
    let added: i32 = client
        .query_one(
            "SELECT lockstep_register_perspectives(ARRAY['totals', 'audit'])",
            &[],
        )
        .await
        .expect("register")
        .get(0);
    assert_eq!(added, 2);
    // The registration's catch-up: the two events, for each perspective.
    assert_eq!(work_rows(&pool, stream).await, 4);

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let v = store
        .append(&tx, stream, ExpectedVersion::Exact(2), &[event(3)])
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    assert_eq!(v, 3);
    assert_eq!(work_rows(&pool, stream).await, 6, "one row per perspective");
    assert_eq!(cursors(&pool, stream).await, 2, "one cursor per pair");

    // A replay enqueues nothing more.
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let last = NewEvent::new("Numbered", serde_json::json!({ "n": 4 })).expect("event");
    store
        .append(
            &tx,
            stream,
            ExpectedVersion::Exact(3),
            std::slice::from_ref(&last),
        )
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let v = store
        .append(&tx, stream, ExpectedVersion::Exact(3), &[last])
        .await
        .expect("a replay");
    tx.commit().await.expect("commit");
    assert_eq!(v, 4);
    assert_eq!(work_rows(&pool, stream).await, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_another_transaction_stores_in_another_stream_meanwhile_are_refused() {
    let (_db, pool) = migrated().await;
    let store = PgEventStore::with_queue(LockQueue::new());
    for first_commits in [true, false] {
        let (one, other) = (StreamId::new_v7(), StreamId::new_v7());
        let shared = event(1);
        let first = PgTransaction::begin(&pool).await.expect("begin");
        store
            .append(
                &first,
                one,
                ExpectedVersion::NoStream,
                std::slice::from_ref(&shared),
            )
            .await
            .expect("first append");
        let second = {
            let (pool, store, shared) = (pool.clone(), store.clone(), shared.clone());
            tokio::spawn(async move {
                let tx = PgTransaction::begin(&pool).await.expect("begin");
                let result = store
                    .append(&tx, other, ExpectedVersion::NoStream, &[shared])
                    .await;
                (tx, result)
            })
        };
        // The second writer must wait for the first, whichever way the first ends.
        let observer = pool.get().await.expect("a connection");
        until_lock_waiters(&observer, 1, "the second writer's append").await;
        drop(observer);
        if first_commits {
            first.commit().await.expect("commit");
        } else {
            first.rollback().await.expect("rollback");
        }
        let (tx, result) = second.await.expect("second writer");
        if first_commits {
            let err = result.expect_err("stored in another stream");
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
            assert!(!err.is_retryable());
            tx.rollback().await.expect("rollback");
            assert_eq!(
                count(
                    &pool,
                    "SELECT count(*) FROM wh_events WHERE stream_id = $1",
                    other
                )
                .await,
                0
            );
        } else {
            assert_eq!(result.expect("the second append goes through"), 1);
            tx.commit().await.expect("commit");
            assert_eq!(
                count(
                    &pool,
                    "SELECT count(*) FROM wh_events WHERE stream_id = $1",
                    other
                )
                .await,
                1
            );
        }
    }
}
