//! `lockstep::testing`: each case is written once over a `Backend` and run on the fakes and on
//! a fresh PostgreSQL database — an append read back, a worker applying what was appended, a
//! second writer queueing on the aggregate lock — and the helpers themselves: called from a
//! spawned task, a panic in the body failing the test with its message, a fresh database
//! migrated and dropped afterwards.

use std::sync::Arc;

use lockstep::prelude::*;
use lockstep::testing::{
    Backend, Fakes, Postgres, fresh_database, fresh_sqlx_database, on_fakes, on_postgres, on_sqlx,
};
use lockstep::worker::{PerspectiveWorker, ReadModels, WorkerOptions};
use lockstep::{Uuid, serde_json::json};

fn stocked(units: u64) -> NewEvent {
    NewEvent::new("Stocked", json!({ "units": units })).expect("event")
}

/// Appends under the aggregate's write lock in one transaction, then reads it back in another.
async fn an_append_is_read_back<B: Backend>(b: B) -> u64 {
    let (lock, store) = (b.aggregate_lock(), b.event_store());
    let sku = Uuid::now_v7();
    let stream = StreamId::from_uuid(sku);
    let tx = b.source().begin().await.expect("begin");
    lock.acquire(&tx, "StockItem", sku).await.expect("lock");
    let version = store
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[stocked(3), stocked(4)],
        )
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    assert_eq!(version, 2, "on {}", B::NAME);

    let tx = b.source().begin().await.expect("begin");
    let history = store.load(&tx, stream).await.expect("load");
    tx.rollback().await.expect("rollback");
    history
        .iter()
        .map(|e| e.payload["units"].as_u64().unwrap_or(0))
        .sum()
}

#[tokio::test]
async fn an_append_is_read_back_on_the_fakes() {
    assert_eq!(on_fakes(an_append_is_read_back).await, 7);
}

#[tokio::test]
async fn an_append_is_read_back_on_postgres() {
    assert_eq!(on_postgres(an_append_is_read_back).await, 7);
}

#[tokio::test]
async fn an_append_is_read_back_on_sqlx() {
    assert_eq!(on_sqlx(an_append_is_read_back).await, 7);
}

/// Units stocked per stream.
struct Units;

impl Perspective for Units {
    type State = u64;
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        "Units"
    }

    fn apply(&self, units: &mut u64, event: &RecordedEvent) -> Result<(), Self::Error> {
        *units += event.payload["units"].as_u64().unwrap_or(0);
        Ok(())
    }
}

/// A worker on the stack's perspective store and stream locker applies what was appended; the
/// read model reads it back.
async fn a_worker_applies_what_was_appended<B: Backend>(b: B) {
    let mut registry = PerspectiveRegistry::new();
    registry.register(Units).expect("register");
    let locker: Arc<dyn StreamLocker> = Arc::new(b.stream_locker());
    let worker = PerspectiveWorker::new(
        b.source().clone(),
        b.perspective_store(),
        registry,
        WorkerOptions::default(),
        InstanceId::random(),
        Some(locker),
    )
    .expect("worker");
    worker
        .register()
        .await
        .expect("registered before the appends");

    let stream = StreamId::new_v7();
    let tx = b.source().begin().await.expect("begin");
    b.event_store()
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[stocked(5), stocked(6)],
        )
        .await
        .expect("append");
    tx.commit().await.expect("commit");

    let report = worker.run_once().await;
    assert!(report.errors.is_empty(), "on {}: {report:?}", B::NAME);
    assert_eq!(report.applied, 2, "on {}: {report:?}", B::NAME);
    let reads = ReadModels::new(b.source().clone(), b.perspective_store());
    let units = reads.state(&Units, stream).await.expect("read");
    assert_eq!(units, Some(11), "on {}", B::NAME);
}

#[tokio::test]
async fn a_worker_applies_what_was_appended_on_the_fakes() {
    on_fakes(a_worker_applies_what_was_appended).await;
}

#[tokio::test]
async fn a_worker_applies_what_was_appended_on_postgres() {
    on_postgres(a_worker_applies_what_was_appended).await;
}

#[tokio::test]
async fn a_worker_applies_what_was_appended_on_sqlx() {
    on_sqlx(a_worker_applies_what_was_appended).await;
}

/// A second writer of the same aggregate queues (the stack shows it waiting) until the first
/// commits, then gets the lock.
async fn a_second_writer_queues_until_the_first_commits<B: Backend>(b: B) {
    let sku = Uuid::now_v7();
    let first = b.source().begin().await.expect("begin");
    b.aggregate_lock()
        .acquire(&first, "StockItem", sku)
        .await
        .expect("first");
    assert_eq!(b.lock_waiters().await, 0, "on {}", B::NAME);

    let (source, lock) = (b.source().clone(), b.aggregate_lock());
    let second = tokio::spawn(async move {
        let tx = source.begin().await.expect("begin");
        lock.acquire(&tx, "StockItem", sku).await.expect("second");
        tx.commit().await.expect("commit");
    });
    b.until_lock_waiters(1, "the second writer").await;
    assert!(!second.is_finished(), "on {}: it waits", B::NAME);
    first.commit().await.expect("commit");
    second.await.expect("the second writer got the lock");
    assert_eq!(b.lock_waiters().await, 0, "on {}", B::NAME);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_queues_until_the_first_commits_on_the_fakes() {
    on_fakes(a_second_writer_queues_until_the_first_commits).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_queues_until_the_first_commits_on_postgres() {
    on_postgres(a_second_writer_queues_until_the_first_commits).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_queues_until_the_first_commits_on_sqlx() {
    on_sqlx(a_second_writer_queues_until_the_first_commits).await;
}

/// The helpers are called from a spawned task, with the concrete stacks, as a test harness of
/// an application's own would call them; a closure passes arguments to the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_helpers_run_from_a_spawned_task() {
    let on_the_fakes = tokio::spawn(on_fakes(|b: Fakes| async move {
        let units = an_append_is_read_back(b.clone()).await;
        assert!(
            b.database().is_idle(),
            "every lock went with its transaction"
        );
        units
    }));
    let on_the_server = tokio::spawn(on_postgres(|b: Postgres| async move {
        let name = b.test_database().name().to_owned();
        (an_append_is_read_back(b).await, name)
    }));
    assert_eq!(on_the_fakes.await.expect("no panic"), 7);
    let (units, name) = on_the_server.await.expect("no panic");
    assert_eq!(units, 7);

    // The stack's database was dropped with it.
    let admin = fresh_database().await;
    let client = admin.test_database().connect().await;
    let left = client
        .query_one(
            "SELECT count(*) FROM pg_database WHERE datname = $1",
            &[&name],
        )
        .await
        .expect("pg_database");
    assert_eq!(left.get::<_, i64>(0), 0, "{name} is gone");
}

#[tokio::test]
#[should_panic(expected = "the body's own message")]
async fn a_panic_in_the_body_fails_the_test_with_its_message() {
    on_fakes(|_| async { panic!("the body's own message") }).await
}

/// `fresh_sqlx_database` hands over a migrated `SqlxDatabase` whose pool serves the
/// application's own tables too, usable from a spawned task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_sqlx_database_is_migrated_and_serves_the_applications_tables() {
    let fresh = tokio::spawn(fresh_sqlx_database()).await.expect("no panic");
    let db = fresh.database().clone();
    tokio::spawn(async move {
        db.check_schema().await?;
        let mut conn = db
            .pool()
            .acquire()
            .await
            .map_err(lockstep::postgres::sqlx::map_sqlx_error)?;
        sqlx::query("CREATE TABLE mine (x int)")
            .execute(&mut *conn)
            .await
            .map_err(lockstep::postgres::sqlx::map_sqlx_error)?;
        Ok::<_, lockstep::Error>(())
    })
    .await
    .expect("no panic")
    .expect("migrated, and the pool is the application's");
}

/// `fresh_database` hands over a migrated `PgDatabase`, usable from a spawned task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_database_is_migrated() {
    let fresh = tokio::spawn(fresh_database()).await.expect("no panic");
    let db: PgDatabase = fresh.clone();
    tokio::spawn(async move { db.check_schema().await })
        .await
        .expect("no panic")
        .expect("this build runs on the installed schema");
    let store = PgEventStore::new(&fresh);
    let tx = fresh.begin().await.expect("begin");
    assert!(
        store
            .load(&tx, StreamId::new_v7())
            .await
            .expect("the events table exists")
            .is_empty()
    );
    tx.rollback().await.expect("rollback");
}

/// Begins a transaction and drops the stack it was given.
async fn begins_and_drops_the_stack<B: Backend>(b: B) -> B::Tx {
    b.source().begin().await.expect("begin")
}

/// The database lives until the body has finished, even when the body drops the stack it was
/// given while one of its transactions is still open.
#[tokio::test]
async fn the_database_outlives_the_body_whatever_it_does_with_the_stack() {
    on_postgres(|b| async move {
        let tx = begins_and_drops_the_stack(b).await;
        tx.rollback().await.expect("the database is still there");
    })
    .await;
}
