//! Table perspectives on PostgreSQL (issue 20): a read model in the application's own tables,
//! written with SQL in the worker's transaction. Two workers on one database write every
//! event's row exactly once (a primary key on the event id would refuse a second write); a
//! statement that fails (a `CHECK` constraint) aborts the batch's transaction, and its pair
//! fails alone with its earlier rows kept while the other pairs are served; a late event resets
//! the stream's rows and replays them, and the cross-stream view over the rows (daily totals)
//! is right again after it. Everything runs from spawned tasks with the concrete Postgres
//! types, as a service runs its worker and its handlers.

use lockstep_core::Pair;
use lockstep_core::perspective_store::prelude::*;
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;
use lockstep_core::{
    ExpectedVersion, InstanceId, NewEvent, PerspectiveName, PerspectiveRegistry, RecordedEvent,
    StreamId, StreamLockOptions, StreamLocker, TablePerspective, TransactionSource as _,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::test_database;
use lockstep_tests::{early_id, number_event};
use lockstep_worker::{
    CancellationToken, PairErrorKind, PerspectiveWorker, ReadModels, WorkerOptions,
};
use uuid::Uuid;

/// The application's schema: one row per event (its primary key refuses a second write; its
/// check refuses 13), per-stream daily totals, and a view summing them over all streams.
const SCHEMA: &str = "
CREATE TABLE seen_events (
    event_id uuid PRIMARY KEY,
    stream_id uuid NOT NULL,
    n bigint NOT NULL CHECK (n <> 13)
);
CREATE TABLE stream_daily_totals (
    stream_id uuid NOT NULL,
    day date NOT NULL,
    total bigint NOT NULL,
    events int NOT NULL,
    PRIMARY KEY (stream_id, day)
);
CREATE VIEW daily_totals AS
    SELECT day, sum(total)::bigint AS total, sum(events)::bigint AS events
    FROM stream_daily_totals GROUP BY day;
";

/// The read model: writes both tables in the worker's transaction.
struct DailyTotals;

impl TablePerspective<PgTransaction> for DailyTotals {
    type Error = tokio_postgres::Error;

    fn name(&self) -> &str {
        "DailyTotals"
    }

    async fn apply(
        &self,
        tx: &PgTransaction,
        event: &RecordedEvent,
    ) -> Result<(), tokio_postgres::Error> {
        let n = event.payload["n"].as_i64().unwrap_or(0);
        let stream = event.stream_id.as_uuid();
        tx.client()
            .execute(
                "INSERT INTO seen_events (event_id, stream_id, n) VALUES ($1, $2, $3)",
                &[&event.event_id, &stream, &n],
            )
            .await?;
        tx.client()
            .execute(
                "INSERT INTO stream_daily_totals (stream_id, day, total, events)
                 VALUES ($1, ($2::timestamptz AT TIME ZONE 'UTC')::date, $3, 1)
                 ON CONFLICT (stream_id, day) DO UPDATE
                 SET total = stream_daily_totals.total + EXCLUDED.total,
                     events = stream_daily_totals.events + 1",
                &[&stream, &event.recorded_at, &n],
            )
            .await?;
        Ok(())
    }

    async fn reset(
        &self,
        tx: &PgTransaction,
        stream_id: StreamId,
    ) -> Result<(), tokio_postgres::Error> {
        let stream = stream_id.as_uuid();
        tx.client()
            .execute("DELETE FROM seen_events WHERE stream_id = $1", &[&stream])
            .await?;
        tx.client()
            .execute(
                "DELETE FROM stream_daily_totals WHERE stream_id = $1",
                &[&stream],
            )
            .await?;
        Ok(())
    }
}

fn daily() -> PerspectiveName {
    PerspectiveName::new("DailyTotals").expect("valid")
}

type Worker = PerspectiveWorker<PgDatabase, PgPerspectiveStore>;

fn worker(pool: &deadpool_postgres::Pool) -> Worker {
    worker_with(pool, WorkerOptions::default())
}

fn worker_with(pool: &deadpool_postgres::Pool, options: WorkerOptions) -> Worker {
    let locker = PgStreamLocker::from_pool(
        pool.clone(),
        StreamLockOptions::new(Duration::from_secs(5), Duration::from_secs(1)).expect("options"),
    );
    let mut registry = PerspectiveRegistry::new();
    registry
        .register_table::<PgTransaction, _>(DailyTotals)
        .expect("register");
    PerspectiveWorker::new(
        PgDatabase::from_pool(pool.clone()),
        PgPerspectiveStore::new(),
        registry,
        options,
        InstanceId::random(),
        Some(Arc::new(locker) as Arc<dyn StreamLocker>),
    )
    .expect("worker")
}

async fn setup(pool: &deadpool_postgres::Pool) {
    lockstep_pg::migrate(pool).await.expect("migrate");
    let client = pool.get().await.expect("connection");
    client.batch_execute(SCHEMA).await.expect("schema");
}

async fn append(pool: &deadpool_postgres::Pool, stream: StreamId, events: Vec<NewEvent>) -> Uuid {
    let last = events.last().expect("events").event_id();
    let tx = PgTransaction::begin(pool).await.expect("begin");
    PgEventStore::with_queue(lockstep_pg::LockQueue::new())
        .append(&tx, stream, ExpectedVersion::Any, &events)
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    last
}

fn numbers(ns: &[i64]) -> Vec<NewEvent> {
    ns.iter().copied().map(number_event).collect()
}

/// Rows of `seen_events` per stream: `(n, how many rows)` in event-id order.
async fn seen(pool: &deadpool_postgres::Pool, stream: StreamId) -> Vec<i64> {
    let client = pool.get().await.expect("connection");
    client
        .query(
            "SELECT n FROM seen_events WHERE stream_id = $1 ORDER BY event_id",
            &[&stream.as_uuid()],
        )
        .await
        .expect("query")
        .iter()
        .map(|r| r.get::<_, i64>(0))
        .collect()
}

async fn view_total(pool: &deadpool_postgres::Pool) -> (i64, i64) {
    let client = pool.get().await.expect("connection");
    let row = client
        .query_one(
            "SELECT coalesce(sum(total), 0)::bigint, coalesce(sum(events), 0)::bigint FROM daily_totals",
            &[],
        )
        .await
        .expect("query");
    (row.get(0), row.get(1))
}

/// Runs `worker` in a task of its own until the returned token is cancelled.
fn spawn_run(worker: Worker) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await.expect("worker run") }
    });
    (shutdown, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_write_every_events_rows_exactly_once_and_a_late_event_is_replayed() {
    let db = test_database().await;
    let pool = db.pool(10);
    setup(&pool).await;
    let first = worker(&pool);
    first.register().await.expect("register");
    let (stop_a, run_a) = spawn_run(first);
    let (stop_b, run_b) = spawn_run(worker(&pool));

    // 20 streams of 10 events, appended while both workers run.
    let mut streams = Vec::new();
    let mut last = Uuid::nil();
    for s in 0..20i64 {
        let stream = StreamId::new_v7();
        let ns: Vec<i64> = (0..10).map(|i| s * 100 + i).collect();
        last = append(&pool, stream, numbers(&ns)).await;
        streams.push((stream, ns));
    }
    let reads = ReadModels::new(
        PgDatabase::from_pool(pool.clone()),
        PgPerspectiveStore::new(),
    );
    let waiting = reads.clone();
    tokio::spawn(async move {
        waiting
            .wait_for_perspective(&daily(), last, Duration::from_secs(60))
            .await
    })
    .await
    .expect("task")
    .expect("caught up");
    let mut expected_total = 0;
    for (stream, ns) in &streams {
        assert_eq!(
            &seen(&pool, *stream).await,
            ns,
            "every event once, in order"
        );
        expected_total += ns.iter().sum::<i64>();
    }
    assert_eq!(view_total(&pool).await, (expected_total, 200));

    // A late event in one stream (an id from the past): the pair rewinds, resetting its rows
    // and replaying every event, so the view is right again.
    let (stream, ns) = &streams[3];
    let late = number_event(5000)
        .with_id(early_id(Duration::from_secs(3600)))
        .expect("id");
    let late_id = late.event_id();
    append(&pool, *stream, vec![late]).await;
    let waiting = reads.clone();
    let stream_id = *stream;
    tokio::spawn(async move {
        waiting
            .wait_for_stream(&daily(), stream_id, late_id, Duration::from_secs(60))
            .await
    })
    .await
    .expect("task")
    .expect("rewound");
    let mut with_late = vec![5000];
    with_late.extend(ns);
    assert_eq!(
        seen(&pool, *stream).await,
        with_late,
        "reset and replayed, once"
    );
    assert_eq!(view_total(&pool).await, (expected_total + 5000, 201));

    stop_a.cancel();
    stop_b.cancel();
    run_a.await.expect("worker a");
    run_b.await.expect("worker b");
}

/// A table perspective's rewind reads its events in pages (ADR 0031) inside its one
/// transaction: with pages of 7 events, a late event in a stream of 50 resets the rows and
/// replays all 51, each once, in order — from a spawned task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_rewind_replays_page_by_page() {
    let db = test_database().await;
    let pool = db.pool(4);
    setup(&pool).await;
    let page = lockstep_core::PageLimits::new(7, 1 << 20).expect("page limits");
    let worker = Arc::new(worker_with(
        &pool,
        WorkerOptions::default().with_rewind_page(page),
    ));
    worker.register().await.expect("register");
    let stream = StreamId::new_v7();
    // (13 is the schema's poison.)
    let ns: Vec<i64> = (100..150).collect();
    append(&pool, stream, numbers(&ns)).await;
    let late = number_event(5000)
        .with_id(early_id(Duration::from_secs(3600)))
        .expect("id");
    let drain = |worker: Arc<Worker>| async move {
        tokio::spawn(async move {
            for _ in 0..20 {
                let report = worker.run_once().await;
                assert!(report.errors.is_empty(), "{:?}", report.errors);
                if !report.did_work() {
                    return;
                }
            }
            panic!("the worker did not go idle");
        })
        .await
        .expect("task");
    };
    drain(Arc::clone(&worker)).await;
    assert_eq!(seen(&pool, stream).await, ns);
    append(&pool, stream, vec![late]).await;
    drain(Arc::clone(&worker)).await;
    let mut with_late = vec![5000];
    with_late.extend(&ns);
    assert_eq!(
        seen(&pool, stream).await,
        with_late,
        "reset and replayed, once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_statement_fails_its_pair_alone_and_keeps_its_earlier_rows() {
    let db = test_database().await;
    let pool = db.pool(6);
    setup(&pool).await;
    let worker = Arc::new(worker(&pool));
    worker.register().await.expect("register");
    let healthy: Vec<StreamId> = (0..5).map(|_| StreamId::new_v7()).collect();
    for (i, stream) in healthy.iter().enumerate() {
        append(&pool, *stream, numbers(&[i as i64, 1, 2])).await;
    }
    let poisoned = StreamId::new_v7();
    append(&pool, poisoned, numbers(&[7, 8, 13, 9])).await;

    let cycles = Arc::clone(&worker);
    let failures = tokio::spawn(async move {
        let mut failures = Vec::new();
        for _ in 0..10 {
            let report = cycles.run_once().await;
            assert!(report.errors.is_empty(), "{:?}", report.errors);
            assert_eq!(report.failed, report.failures.len(), "{report:?}");
            failures.extend(report.failures);
        }
        failures
    })
    .await
    .expect("task");
    assert_eq!(failures.len(), 1, "one failure, then the pair backs off");
    assert_eq!(failures[0].pair, Pair::new(poisoned, daily()));
    assert_eq!(failures[0].error.kind(), PairErrorKind::Apply);
    for (i, stream) in healthy.iter().enumerate() {
        assert_eq!(seen(&pool, *stream).await, vec![i as i64, 1, 2]);
    }
    assert_eq!(
        seen(&pool, poisoned).await,
        vec![7, 8],
        "the rows before the failure"
    );
    let source = PgDatabase::from_pool(pool.clone());
    let tx = source.begin().await.expect("begin");
    let cursor = PgPerspectiveStore::new()
        .cursor(&tx, &Pair::new(poisoned, daily()))
        .await
        .expect("read")
        .expect("cursor");
    tx.rollback().await.expect("rollback");
    assert_eq!(cursor.applied_count, 2);
    let error = cursor.error.expect("stored");
    assert!(error.contains("check constraint"), "{error}");
    assert_eq!(error, failures[0].error.to_string());
    assert_eq!(cursor.failed_event_id, failures[0].error.event_id());
    assert!(cursor.retry_at.is_some(), "backed off");
}

/// An event whose stored payload does not decode (appended through the SQL function: `jsonb`
/// keeps a number out of range that `serde_json` cannot read) fails its table pair at that
/// event. The rows of the events before it are written and committed, the failure is stored
/// on the cursor at that event and backed off, and the other pairs of the batch are written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_that_cannot_be_read_fails_its_table_pair_at_it() {
    let db = test_database().await;
    let pool = db.pool(6);
    setup(&pool).await;
    let worker = Arc::new(worker(&pool));
    worker.register().await.expect("register");
    let (bad, good) = (StreamId::new_v7(), StreamId::new_v7());
    append(&pool, bad, numbers(&[7, 8])).await;
    let client = pool.get().await.expect("connection");
    let unreadable = lockstep_tests::append_unreadable(&**client, bad)
        .await
        .expect("an append through SQL");
    drop(client);
    append(&pool, bad, numbers(&[9])).await;
    append(&pool, good, numbers(&[1, 2])).await;
    let cycles = Arc::clone(&worker);
    let report = tokio::spawn(async move { cycles.run_once().await })
        .await
        .expect("task");
    assert!(
        report.errors.is_empty(),
        "not a cycle error: {:?}",
        report.errors
    );
    assert_eq!(report.failed, 1, "{report:?}");
    assert_eq!(seen(&pool, good).await, vec![1, 2], "the other pair");
    assert_eq!(seen(&pool, bad).await, vec![7, 8], "the rows before it");
    let source = PgDatabase::from_pool(pool.clone());
    let tx = source.begin().await.expect("begin");
    let cursor = PgPerspectiveStore::new()
        .cursor(&tx, &Pair::new(bad, daily()))
        .await
        .expect("read")
        .expect("cursor");
    tx.rollback().await.expect("rollback");
    assert_eq!(
        (cursor.applied_count, cursor.failed_event_id),
        (2, Some(unreadable))
    );
    let error = cursor.error.expect("stored");
    assert!(error.contains("could not be read"), "{error}");
    let failure = &report.failures[0];
    assert_eq!(
        (failure.error.kind(), failure.error.event_id()),
        (PairErrorKind::UnreadableEvent, Some(unreadable))
    );
    assert_eq!(error, failure.error.to_string());
    assert!(cursor.retry_at.is_some(), "backed off");
}

/// A table perspective's rebuild that fails at an event stores that event with the failure, as
/// its normal path does, so that an operator can skip it: an event that cannot be read (its
/// stored payload does not decode) on a later page of the replay, and one the table refuses
/// (its check constraint). Nothing of the failed replay is written; after the skips the
/// rebuild writes every other row once. Before, the rewind stored the failure without its
/// event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_that_fails_at_an_event_stores_that_event() {
    let db = test_database().await;
    let pool = db.pool(6);
    setup(&pool).await;
    let worker = Arc::new(worker_with(
        &pool,
        WorkerOptions::default()
            .with_rewind_page(lockstep_core::PageLimits::new(2, 1 << 20).expect("page")),
    ));
    worker.register().await.expect("register");
    let (unreadable, refused) = (StreamId::new_v7(), StreamId::new_v7());
    append(&pool, unreadable, numbers(&[1, 2, 3])).await;
    append(&pool, refused, numbers(&[1])).await;
    let cycles = Arc::clone(&worker);
    tokio::spawn(async move { cycles.run_once().await })
        .await
        .expect("task");
    // The worker is stopped: the events are appended, then the perspective is rebuilt.
    let client = pool.get().await.expect("connection");
    let bad_payload = lockstep_tests::append_unreadable(&**client, unreadable)
        .await
        .expect("an append through SQL");
    drop(client);
    let thirteen = append(&pool, refused, numbers(&[13])).await;
    append(&pool, unreadable, numbers(&[4])).await;
    append(&pool, refused, numbers(&[2])).await;
    let source = PgDatabase::from_pool(pool.clone());
    lockstep_worker::life::rebuild(&source, &PgPerspectiveStore::new(), &daily())
        .await
        .expect("rebuild");
    let cycles = Arc::clone(&worker);
    let report = tokio::spawn(async move { cycles.run_once().await })
        .await
        .expect("task");
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.failed, 2, "{report:?}");
    for (stream, at, why, kind) in [
        (
            unreadable,
            bad_payload,
            "could not be read",
            PairErrorKind::UnreadableEvent,
        ),
        (refused, thirteen, "check constraint", PairErrorKind::Apply),
    ] {
        let failure = report
            .failures
            .iter()
            .find(|f| f.pair.stream_id == stream)
            .expect("reported");
        assert_eq!(
            (failure.error.kind(), failure.error.event_id()),
            (kind, Some(at))
        );
        let tx = source.begin().await.expect("begin");
        let cursor = PgPerspectiveStore::new()
            .cursor(&tx, &Pair::new(stream, daily()))
            .await
            .expect("read")
            .expect("cursor");
        tx.rollback().await.expect("rollback");
        assert_eq!(cursor.failed_event_id, Some(at), "{cursor:?}");
        assert!(cursor.rewind.is_some(), "the request stays");
        let error = cursor.error.expect("stored");
        assert!(error.contains(why), "{error}");
        assert_eq!(error, failure.error.to_string());
        let tx = source.begin().await.expect("begin");
        assert!(
            PgPerspectiveStore::new()
                .skip_event(&tx, &Pair::new(stream, daily()), at, "test")
                .await
                .expect("skip_event")
        );
        tx.commit().await.expect("commit");
    }
    let cycles = Arc::clone(&worker);
    tokio::spawn(async move {
        for _ in 0..50 {
            let report = cycles.run_once().await;
            assert!(report.errors.is_empty(), "{:?}", report.errors);
            assert_eq!(report.failed, 0, "{report:?}");
            if !report.did_work() {
                return;
            }
        }
        panic!("the worker did not go idle");
    })
    .await
    .expect("task");
    assert_eq!(seen(&pool, unreadable).await, vec![1, 2, 3, 4]);
    assert_eq!(seen(&pool, refused).await, vec![1, 2]);
}
