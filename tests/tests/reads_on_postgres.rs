//! Reads of read models on PostgreSQL, the way a web handler makes them (issue 20): a request
//! appends, waits until the perspective has caught up with its own append, and reads the typed
//! state — each from inside `tokio::spawn`, with the concrete Postgres types, while a worker
//! runs in a task of its own. Also: a wait with no worker running ends at its timeout saying
//! what is pending, a wait on a parked pair ends at once, and pages of states.

use lockstep_core::Pair;
use lockstep_core::perspective_store::prelude::*;
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;
use lockstep_core::{
    ExpectedVersion, Fleet as _, InstanceId, PairFailure, PerspectiveName, PerspectiveRegistry,
    StreamId, StreamLockOptions, TransactionSource as _,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::test_database;
use lockstep_tests::{NUMBERS, Numbers, number_event};
use lockstep_worker::{CancellationToken, PerspectiveWorker, ReadModels, WaitError, WorkerOptions};

type Reads = ReadModels<PgDatabase, PgPerspectiveStore>;

async fn append(pool: &deadpool_postgres::Pool, stream: StreamId, numbers: &[i64]) -> uuid::Uuid {
    let events: Vec<_> = numbers.iter().copied().map(number_event).collect();
    let last = events.last().expect("events").event_id();
    let tx = PgTransaction::begin(pool).await.expect("begin");
    PgEventStore::with_queue(lockstep_pg::LockQueue::new())
        .append(&tx, stream, ExpectedVersion::Any, &events)
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    last
}

fn numbers() -> PerspectiveName {
    PerspectiveName::new(NUMBERS).expect("valid")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_reads_its_own_write_after_waiting_for_the_worker() {
    let db = test_database().await;
    let pool = db.pool(6);
    lockstep_pg::migrate(&pool).await.expect("migrate");
    let locker = PgStreamLocker::from_pool(
        pool.clone(),
        StreamLockOptions::new(Duration::from_secs(5), Duration::from_secs(1)).expect("options"),
    );
    let mut registry = PerspectiveRegistry::new();
    registry.register(Numbers::new()).expect("register");
    let worker = PerspectiveWorker::new(
        PgDatabase::from_pool(pool.clone()),
        PgPerspectiveStore::new(),
        registry,
        WorkerOptions::default(),
        InstanceId::random(),
        None,
    )
    .expect("worker")
    .with_fleet(Arc::new(locker));
    worker.register().await.expect("register");
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await }
    });

    let reads: Reads = ReadModels::new(
        PgDatabase::from_pool(pool.clone()),
        PgPerspectiveStore::new(),
    );
    // Three "requests", each appending and then reading its own write.
    let mut handlers = Vec::new();
    for n in 0..3i64 {
        let (pool, reads) = (pool.clone(), reads.clone());
        handlers.push(tokio::spawn(async move {
            let stream = StreamId::new_v7();
            let last = append(&pool, stream, &[n, n + 1, n + 2]).await;
            reads
                .wait_for_stream(&numbers(), stream, last, Duration::from_secs(30))
                .await
                .expect("caught up within the timeout");
            let state = reads.state(&Numbers::new(), stream).await.expect("read");
            (stream, state)
        }));
    }
    let mut streams = Vec::new();
    for (n, handler) in handlers.into_iter().enumerate() {
        let n = n as i64;
        let (stream, state) = handler.await.expect("the handler task");
        assert_eq!(state, Some(vec![n, n + 1, n + 2]), "its own write, applied");
        streams.push(stream);
    }

    // A perspective-wide wait, then every state page by page.
    let last = append(&pool, StreamId::new_v7(), &[7]).await;
    let reads2 = reads.clone();
    tokio::spawn(async move {
        reads2
            .wait_for_perspective(&numbers(), last, Duration::from_secs(30))
            .await
    })
    .await
    .expect("task")
    .expect("the whole perspective caught up");
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = reads.states(&Numbers::new(), after, 2).await.expect("page");
        let Some((last, _)) = page.last() else { break };
        after = Some(*last);
        seen.extend(page);
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
    assert!(seen.windows(2).all(|w| w[0].0 < w[1].0), "stream order");
    for (n, stream) in streams.iter().enumerate() {
        let n = n as i64;
        let state = seen
            .iter()
            .find(|(s, _)| s == stream)
            .map(|(_, s)| s.clone());
        assert_eq!(state, Some(vec![n, n + 1, n + 2]));
    }

    shutdown.cancel();
    running.await.expect("worker task").expect("worker run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_ends_at_its_timeout_without_a_worker_and_at_once_on_a_parked_pair() {
    let db = test_database().await;
    let pool = db.pool(4);
    lockstep_pg::migrate(&pool).await.expect("migrate");
    let source = PgDatabase::from_pool(pool.clone());
    let store = PgPerspectiveStore::new();
    let tx = source.begin().await.expect("begin");
    store.register(&tx, &[numbers()]).await.expect("register");
    tx.commit().await.expect("commit");
    let reads: Reads = ReadModels::new(source.clone(), store.clone());

    let stream = StreamId::new_v7();
    let last = append(&pool, stream, &[1, 2]).await;
    let waiting = reads.clone();
    let err = tokio::spawn(async move {
        waiting
            .wait_for_stream(&numbers(), stream, last, Duration::from_millis(200))
            .await
    })
    .await
    .expect("task")
    .expect_err("nobody applies it");
    match &err {
        WaitError::TimedOut {
            pending, waited, ..
        } => {
            assert_eq!(pending.events, 2);
            assert!(*waited >= Duration::from_millis(200), "{waited:?}");
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(err.to_string().contains("2 events"), "{err}");

    let tx = source.begin().await.expect("begin");
    store
        .record_failure(
            &tx,
            &Pair::new(stream, numbers()),
            &PairFailure::new("poison").park(true),
        )
        .await
        .expect("park");
    tx.commit().await.expect("commit");
    let err = reads
        .wait_for_stream(&numbers(), stream, last, Duration::from_secs(3600))
        .await
        .expect_err("a parked pair does not catch up by itself");
    assert!(matches!(err, WaitError::Parked { .. }), "{err}");
    assert!(err.to_string().contains("poison"), "{err}");
}

/// Waits from inside `tokio::spawn`, as a handler does.
async fn spawned_wait(
    reads: &Reads,
    perspective: PerspectiveName,
    stream: StreamId,
    up_to: uuid::Uuid,
    timeout: Duration,
) -> Result<(), WaitError> {
    let reads = reads.clone();
    tokio::spawn(async move {
        reads
            .wait_for_stream(&perspective, stream, up_to, timeout)
            .await
    })
    .await
    .expect("the waiting task")
}

/// A wait for a perspective nothing applies says why instead of "caught up": a name that is
/// not registered (misspelt) or was retired with its states dropped is `NotRegistered`, one
/// retired with its states kept is `Retired`, both at once; a wait that times out while no
/// live worker instance runs the perspective says so, and does not once one is announced.
/// Before, the first three answered `Ok` at once and read nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_a_perspective_nothing_applies_says_why() {
    use lockstep_core::{InstanceAnnouncement, RetireStates};
    let db = test_database().await;
    let pool = db.pool(4);
    lockstep_pg::migrate(&pool).await.expect("migrate");
    let source = PgDatabase::from_pool(pool.clone());
    let store = PgPerspectiveStore::new();
    let tx = source.begin().await.expect("begin");
    store.register(&tx, &[numbers()]).await.expect("register");
    tx.commit().await.expect("commit");
    let reads: Reads = ReadModels::new(source.clone(), store.clone());
    let stream = StreamId::new_v7();
    let last = append(&pool, stream, &[1]).await;
    let hour = Duration::from_secs(3600);

    let typo = PerspectiveName::new("Numbrs").expect("valid");
    let err = spawned_wait(&reads, typo, stream, last, hour)
        .await
        .expect_err("a misspelt name is not caught up");
    assert!(matches!(err, WaitError::NotRegistered { .. }), "{err}");
    assert!(err.to_string().contains("Numbrs"), "{err}");

    let err = spawned_wait(&reads, numbers(), stream, last, Duration::from_millis(100))
        .await
        .expect_err("nobody applies it");
    assert!(matches!(err, WaitError::TimedOut { .. }), "{err}");
    assert!(err.no_live_worker(), "{err:?}");
    assert!(err.to_string().contains("no live worker"), "{err}");

    // A live instance announces that it runs the perspective (it is just slow).
    let locker = PgStreamLocker::from_pool(pool.clone(), StreamLockOptions::default());
    let announcement = InstanceAnnouncement::new(
        InstanceId::random(),
        "worker-0",
        "host",
        1,
        "test",
        vec![numbers()],
    )
    .expect("announcement");
    locker.announce(&announcement).await.expect("announce");
    let err = spawned_wait(&reads, numbers(), stream, last, Duration::from_millis(100))
        .await
        .expect_err("still nobody applies it");
    assert!(matches!(err, WaitError::TimedOut { .. }), "{err}");
    assert!(!err.no_live_worker(), "{err:?}");
    assert!(!err.to_string().contains("no live worker"), "{err}");

    lockstep_worker::life::retire(&source, &store, &numbers(), RetireStates::Keep)
        .await
        .expect("retire");
    let err = spawned_wait(&reads, numbers(), stream, last, hour)
        .await
        .expect_err("a retired perspective is not caught up");
    assert!(matches!(err, WaitError::Retired { .. }), "{err}");

    let tx = source.begin().await.expect("begin");
    store.register(&tx, &[numbers()]).await.expect("register");
    tx.commit().await.expect("commit");
    lockstep_worker::life::retire(&source, &store, &numbers(), RetireStates::Drop)
        .await
        .expect("retire");
    let err = spawned_wait(&reads, numbers(), stream, last, hour)
        .await
        .expect_err("a perspective retired with its states dropped is not caught up");
    assert!(matches!(err, WaitError::NotRegistered { .. }), "{err}");
}
