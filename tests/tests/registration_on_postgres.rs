//! A worker whose registration gives up waiting for an append transaction left open (it does
//! not hold every append of the database back behind it) is not ended by that: it tries again
//! every `poll_interval`, and registers once the append has ended.

use std::time::Duration;

use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;
use lockstep_core::TransactionSource as _;
use lockstep_core::{
    ExpectedVersion, InstanceId, NewEvent, Perspective, PerspectiveName, PerspectiveRegistry,
    RecordedEvent, StreamId,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_testkit::pg_harness::test_database;
use lockstep_worker::{CancellationToken, PerspectiveWorker, WorkerOptions};

struct Count;

impl Perspective for Count {
    type State = i64;
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        "RegisteredLater"
    }

    fn apply(&self, n: &mut i64, _: &RecordedEvent) -> Result<(), Self::Error> {
        *n += 1;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_retries_a_registration_that_gave_up_on_an_open_append() {
    let test_db = test_database().await;
    let setup = test_db.pool(4);
    lockstep_pg::migrate(&setup).await.expect("migrate");
    let client = setup.get().await.expect("client");
    // The transactions of the database that rolled back, as the server counts them: from the
    // worker's start on, its registrations that gave up (nothing else of it runs before).
    let rollbacks = || async {
        client
            .query_one(
                "SELECT xact_rollback FROM pg_stat_database WHERE datname = current_database()",
                &[],
            )
            .await
            .expect("pg_stat_database")
            .get::<_, i64>(0)
    };

    let events = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let open = PgTransaction::begin(&setup).await.expect("begin");
    events
        .append(
            &open,
            StreamId::new_v7(),
            ExpectedVersion::NoStream,
            &[NewEvent::new("Opened", serde_json::json!(1)).expect("event")],
        )
        .await
        .expect("append");

    let mut registry = PerspectiveRegistry::new();
    registry.register(Count).expect("register");
    let store = PgPerspectiveStore::new()
        .with_registration_wait(Duration::from_millis(10), Duration::ZERO)
        .expect("wait bounds");
    let worker = PerspectiveWorker::new(
        PgDatabase::from_pool(test_db.pool(3)),
        store,
        registry,
        WorkerOptions::default().with_poll_interval(Duration::from_millis(20)),
        InstanceId::random(),
        None,
    )
    .expect("worker");
    let before = rollbacks().await;
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { worker.run(shutdown).await })
    };

    // At least two registrations given up (the server's count of rolled back transactions):
    // the worker went on after the first.
    let mut calls = 0_i64;
    for _ in 0..600 {
        assert!(
            !running.is_finished(),
            "the worker stopped: {:?}",
            running.await
        );
        calls = rollbacks().await - before;
        if calls >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(calls >= 2, "the registration gave up {calls} times");
    let name = PerspectiveName::new("RegisteredLater").expect("name");
    let db = PgDatabase::from_pool(setup.clone());
    let registered = || async {
        let tx = db.begin().await.expect("begin");
        let registered = PgPerspectiveStore::new()
            .is_registered(&tx, &name)
            .await
            .expect("is_registered");
        tx.rollback().await.expect("rollback");
        registered
    };
    assert!(!registered().await, "not while the append is open");

    open.commit().await.expect("commit");
    let mut done = false;
    for _ in 0..600 {
        if registered().await {
            done = true;
            break;
        }
        assert!(
            !running.is_finished(),
            "the worker stopped: {:?}",
            running.await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(done, "registered once the append ended");
    shutdown.cancel();
    running.await.expect("task").expect("the worker ran");
}
