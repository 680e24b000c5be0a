//! Three perspective workers on one PostgreSQL database, while events are appended concurrently
//! — some with caller-chosen ids that sort before events already applied (late arrivals, so
//! rewinds under stream leases). When the queue is empty, every stream's state is the fold of
//! its events in event-id order: nothing lost, nothing applied twice.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;
use lockstep_core::{
    ExpectedVersion, InstanceId, NewEvent, PerspectiveRegistry, StreamId, StreamLockOptions,
    StreamLocker,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::test_database;
use lockstep_tests::{Numbers, early_id, expected_folds, number_event, perspective_states};
use lockstep_worker::{CancellationToken, PerspectiveWorker, WorkerOptions};
use rand::{Rng, SeedableRng};

/// Streams in the run.
const STREAMS: usize = 200;
/// Events appended. The figure; it runs in ~10–20 s in a debug build on a 2-core
/// machine, so CI runs it as is (the benchmark moves 100 000).
const EVENTS: usize = 20_000;
/// One event in this many carries a caller-chosen id that sorts early (5 %).
const EARLY_EVERY: usize = 20;
/// Concurrent appenders.
const APPENDERS: usize = 4;
/// Workers (instances).
const WORKERS: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_fold_every_stream_exactly_once_with_late_arrivals() {
    let db = test_database().await;
    let admin = db.connect().await;
    // Exactly-once under concurrency is under test, not durability.
    db.skip_wal_flush().await.expect("synchronous_commit");
    let setup = db.pool(2);
    lockstep_pg::migrate(&setup).await.expect("migrate");

    let options = WorkerOptions::default()
        .with_poll_interval(Duration::from_millis(20))
        .with_pairs_per_cycle(32)
        .with_max_events_per_claim(200)
        .with_snapshot_every(20);
    let lock_options =
        StreamLockOptions::new(Duration::from_secs(5), Duration::from_secs(1)).expect("5 s / 1 s");
    let shutdown = CancellationToken::new();
    let numbers = Numbers::new(); // clones share the count of applies
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        // Each instance has a pool of its own, as separate processes would, and processes 1, 2
        // and 3 pairs at a time (a connection per pair in flight, one for the keepalive).
        let options = options.with_concurrency(w + 1);
        let pool = db.pool(w + 2);
        let mut registry = PerspectiveRegistry::new();
        registry.register(numbers.clone()).expect("register");
        let locker: Arc<dyn StreamLocker> =
            Arc::new(PgStreamLocker::from_pool(pool.clone(), lock_options));
        let instance = InstanceId::random();
        let worker = PerspectiveWorker::new(
            PgDatabase::from_pool(pool),
            PgPerspectiveStore::new(),
            registry,
            options,
            instance,
            Some(locker),
        )
        .expect("worker");
        // Registered before the first append, so every append fans out work.
        worker.register().await.expect("register");
        let shutdown = shutdown.clone();
        workers.push(tokio::spawn(async move { worker.run(shutdown).await }));
    }

    let streams: Arc<Vec<StreamId>> = Arc::new((0..STREAMS).map(|_| StreamId::new_v7()).collect());
    let mut appenders = Vec::new();
    for a in 0..APPENDERS {
        let (pool, streams) = (db.pool(1), Arc::clone(&streams));
        appenders.push(tokio::spawn(async move {
            let events = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
            let mut rng = rand::rngs::StdRng::from_os_rng();
            let mut n = a;
            let mut early = 0usize;
            while n < EVENTS {
                // 1–8 events per transaction on a random stream.
                let batch = rng.random_range(1..=8usize);
                let stream = streams[rng.random_range(0..streams.len())];
                let mut new: Vec<NewEvent> = Vec::new();
                for _ in 0..batch {
                    if n >= EVENTS {
                        break;
                    }
                    let mut event = number_event(n as i64);
                    if n % EARLY_EVERY == 0 {
                        // Sorts before most of what the stream already holds: a late arrival.
                        let ago = Duration::from_millis(rng.random_range(1..60_000));
                        event = event.with_id(early_id(ago)).expect("id");
                        early += 1;
                    }
                    new.push(event);
                    n += APPENDERS;
                }
                loop {
                    let tx = PgTransaction::begin(&pool).await.expect("begin");
                    match events.append(&tx, stream, ExpectedVersion::Any, &new).await {
                        Ok(_) => {
                            tx.commit().await.expect("commit");
                            break;
                        }
                        // Two `Any` appends to one stream can pick the same version: again.
                        Err(err) if err.is_retryable() => {
                            let _ = tx.rollback().await;
                        }
                        Err(err) => panic!("append failed: {err}"),
                    }
                }
                if rng.random_range(0..50) == 0 {
                    // Let the workers overtake now and then, so late arrivals find cursors
                    // that already moved past them.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            early
        }));
    }
    let started = std::time::Instant::now();
    let mut early = 0;
    for appender in appenders {
        early += appender.await.expect("appender");
    }
    assert_eq!(early, EVENTS / EARLY_EVERY, "5 % of the events sort early");
    eprintln!("appended in {:?}", started.elapsed());

    // Wait until the workers drained the queue (work rows and rewind requests), then stop them.
    let drained = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            if lockstep_tests::queue_is_empty(&admin).await.expect("queue") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    eprintln!("drained after {:?}", started.elapsed());
    shutdown.cancel();
    for worker in workers {
        worker.await.expect("worker task").expect("worker");
    }
    assert!(drained.is_ok(), "the workers drained the queue");

    let client = db.connect().await;
    let expected = expected_folds(&client).await.expect("events");
    let stored = perspective_states(&client, lockstep_tests::NUMBERS)
        .await
        .expect("states");
    assert_eq!(expected.len(), STREAMS, "every stream got events");
    let total: usize = stored.values().map(Vec::len).sum();
    assert_eq!(total, EVENTS, "every event applied exactly once overall");
    for (stream, fold) in &expected {
        assert_eq!(
            stored.get(stream),
            Some(fold),
            "stream {stream}: the state is the fold of its events in event-id order"
        );
    }

    assert!(
        numbers.applied() > EVENTS as u64,
        "late arrivals made the workers rewind and replay ({} applies for {EVENTS} events)",
        numbers.applied()
    );
    let leased: i64 = client
        .query_one(
            "SELECT count(*) FROM wh_perspective_cursors WHERE stream_lock_epoch > 0",
            &[],
        )
        .await
        .expect("epochs")
        .get(0);
    assert!(leased > 0, "the rewinds ran under stream leases");
    let held: i64 = client
        .query_one(
            "SELECT count(*) FROM wh_perspective_cursors WHERE stream_lock_instance_id IS NOT NULL",
            &[],
        )
        .await
        .expect("leases")
        .get(0);
    assert_eq!(held, 0, "every lease was released at shutdown");
}
