//! Worker defects of issue 19 on PostgreSQL, each the test that would have caught it (the same
//! cases run on the fakes in `crates/worker/tests/fakes.rs`): a debounced late event is rewound
//! once its window has passed, a purge is followed by a rebuild from the start, and a release
//! dropped while it waits for the cursor row still releases the lease.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;
use lockstep_core::{
    ExpectedVersion, InstanceId, LeaseStatus, LockReason, NewEvent, PerspectiveName,
    PerspectiveRegistry, StreamId, StreamLockAdmin, StreamLockOptions, StreamLocker,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};
use lockstep_tests::{NUMBERS, Numbers, early_id, number_event};
use lockstep_worker::{CycleReport, Leased, PerspectiveWorker, PurgeOutcome, WorkerOptions};

type Worker = PerspectiveWorker<PgDatabase, PgPerspectiveStore>;

struct Setup {
    db: TestDatabase,
    pool: deadpool_postgres::Pool,
    locker: PgStreamLocker,
    worker: Worker,
}

async fn setup(options: WorkerOptions) -> Setup {
    let db = test_database().await;
    let pool = db.pool(4);
    lockstep_pg::migrate(&pool).await.expect("migrate");
    let locker = PgStreamLocker::from_pool(
        pool.clone(),
        StreamLockOptions::new(Duration::from_secs(5), Duration::from_secs(1)).expect("5 s / 1 s"),
    );
    let mut registry = PerspectiveRegistry::new();
    registry.register(Numbers::new()).expect("register");
    let worker = PerspectiveWorker::new(
        PgDatabase::from_pool(pool.clone()),
        PgPerspectiveStore::new(),
        registry,
        options,
        InstanceId::random(),
        Some(Arc::new(locker.clone()) as Arc<dyn StreamLocker>),
    )
    .expect("worker");
    worker.register().await.expect("register");
    Setup {
        db,
        pool,
        locker,
        worker,
    }
}

impl Setup {
    async fn append(&self, stream: StreamId, events: Vec<NewEvent>) {
        let tx = PgTransaction::begin(&self.pool).await.expect("begin");
        PgEventStore::with_queue(lockstep_pg::LockQueue::new())
            .append(&tx, stream, ExpectedVersion::Any, &events)
            .await
            .expect("append");
        tx.commit().await.expect("commit");
    }

    async fn numbers(&self, stream: StreamId, numbers: impl IntoIterator<Item = i64>) {
        self.append(stream, numbers.into_iter().map(number_event).collect())
            .await;
    }

    /// Runs cycles until one does nothing (at most 50).
    async fn drain(&self) -> CycleReport {
        let mut total = CycleReport::default();
        for _ in 0..50 {
            let report = self.worker.run_once().await;
            assert!(report.errors.is_empty(), "{:?}", report.errors);
            assert_eq!(report.failed, 0, "{:?}", report.failures);
            total.rewinds += report.rewinds;
            if !report.did_work() {
                return total;
            }
        }
        panic!("the worker did not go idle");
    }

    async fn state(&self, stream: StreamId) -> Option<Vec<i64>> {
        let client = self.db.connect().await;
        let row = client
            .query_opt(
                "SELECT state FROM wh_perspective_states WHERE stream_id = $1 AND perspective_name = $2",
                &[&stream.as_uuid(), &NUMBERS],
            )
            .await
            .expect("state");
        row.map(|r| serde_json::from_value(r.get(0)).expect("a list"))
    }

    async fn live_leases(&self) -> usize {
        self.locker
            .list_leases()
            .await
            .expect("list")
            .iter()
            .filter(|l| l.status == LeaseStatus::Held)
            .count()
    }
}

fn late(n: i64) -> NewEvent {
    number_event(n)
        .with_id(early_id(Duration::from_secs(3600)))
        .expect("id")
}

/// Issue 18: work of a registered perspective this worker does not run never takes the places
/// of the work it can serve (measured before: 63 of 100 pairs served, later events never
/// applied). "Absent" sorts before "Numbers" and its pairs are as old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_perspective_the_worker_does_not_run_never_starves_its_own() {
    use lockstep_core::PerspectiveStore as _;
    let s = setup(WorkerOptions::default().with_pairs_per_cycle(4)).await;
    let absent = PerspectiveName::new("Absent").expect("valid");
    let tx = PgTransaction::begin(&s.pool).await.expect("begin");
    PgPerspectiveStore::new()
        .register(&tx, std::slice::from_ref(&absent))
        .await
        .expect("register");
    tx.commit().await.expect("commit");
    let streams: Vec<StreamId> = (0..20).map(|_| StreamId::new_v7()).collect();
    for (i, stream) in streams.iter().enumerate() {
        s.numbers(*stream, [i as i64]).await;
    }
    s.drain().await;
    for (i, stream) in streams.iter().enumerate() {
        assert_eq!(s.state(*stream).await, Some(vec![i as i64]), "{stream}");
    }
    let client = s.db.connect().await;
    let waiting: i64 = client
        .query_one(
            "SELECT count(*) FROM wh_perspective_events WHERE perspective_name = 'Absent'",
            &[],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(
        waiting, 20,
        "the other perspective's work waits for whoever runs it"
    );
}

/// A state that refuses to serialize (a bug in an application's perspective).
#[derive(Debug, Default)]
struct Unserializable;

impl serde::Serialize for Unserializable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("this state cannot be serialized"))
    }
}

impl<'de> serde::Deserialize<'de> for Unserializable {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Ok(Unserializable)
    }
}

struct Broken;

impl lockstep_core::Perspective for Broken {
    type State = Unserializable;
    type Error = std::io::Error;

    fn name(&self) -> &str {
        "Broken"
    }

    fn apply(
        &self,
        _: &mut Unserializable,
        _: &lockstep_core::RecordedEvent,
    ) -> Result<(), std::io::Error> {
        Ok(())
    }
}

/// Issue 18: a failure outside `apply` (a state that does not serialize) is the pair's: stored
/// on its cursor and counted as failed, not a cycle error invisible in `perspectives status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_outside_apply_is_stored_on_the_pair() {
    let s = setup(WorkerOptions::default()).await;
    let mut registry = PerspectiveRegistry::new();
    registry.register(Broken).expect("register");
    let worker = PerspectiveWorker::new(
        PgDatabase::from_pool(s.pool.clone()),
        PgPerspectiveStore::new(),
        registry,
        WorkerOptions::default(),
        InstanceId::random(),
        None,
    )
    .expect("worker");
    worker.register().await.expect("register");
    let stream = StreamId::new_v7();
    s.numbers(stream, [1, 2]).await;
    let report = worker.run_once().await;
    assert!(
        report.errors.is_empty(),
        "not a cycle error: {:?}",
        report.errors
    );
    assert_eq!(report.failed, 1, "{report:?}");
    let client = s.db.connect().await;
    let row = client
        .query_one(
            "SELECT error, failures FROM wh_perspective_cursors \
              WHERE stream_id = $1 AND perspective_name = 'Broken'",
            &[&stream.as_uuid()],
        )
        .await
        .expect("cursor");
    let (error, failures): (Option<String>, i32) = (row.get(0), row.get(1));
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.contains("does not serialize")),
        "{error:?}"
    );
    assert_eq!(failures, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debounced_late_event_is_rewound_once_the_window_has_passed() {
    let s = setup(WorkerOptions::default().with_rewind_debounce(Duration::from_millis(200))).await;
    let stream = StreamId::new_v7();
    s.numbers(stream, [1, 2]).await;
    s.drain().await;
    s.append(stream, vec![late(0)]).await;
    let mut rewinds = 0;
    for _ in 0..40 {
        let report = s.worker.run_once().await;
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        rewinds += report.rewinds;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(rewinds, 1, "one rewind, after the window");
    assert_eq!(s.state(stream).await, Some(vec![0, 1, 2]));
    s.numbers(stream, [3]).await;
    s.drain().await;
    assert_eq!(s.state(stream).await, Some(vec![0, 1, 2, 3]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_purge_the_next_event_rebuilds_the_pair_from_the_start() {
    let s = setup(WorkerOptions::default()).await;
    let stream = StreamId::new_v7();
    s.numbers(stream, [1, 2, 3]).await;
    s.drain().await;
    let name = PerspectiveName::new(NUMBERS).expect("name");
    assert_eq!(
        s.worker.purge(stream, &name).await.expect("purge"),
        PurgeOutcome::Purged
    );
    s.drain().await;
    assert_eq!(
        s.state(stream).await,
        None,
        "stays empty until its next event"
    );
    s.numbers(stream, [4]).await;
    let report = s.drain().await;
    assert_eq!(report.rewinds, 1, "rebuilt by a rewind from the start");
    assert_eq!(s.state(stream).await, Some(vec![1, 2, 3, 4]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_dropped_while_it_waits_for_the_row_still_releases_and_shutdown_counts_it() {
    let s = setup(WorkerOptions::default()).await;
    let stream = StreamId::new_v7();
    s.numbers(stream, [1]).await;
    s.drain().await;
    let name = PerspectiveName::new(NUMBERS).expect("name");
    let keeper = s.worker.keeper().expect("keeper").clone();
    let Leased::Acquired(lease) = keeper
        .try_acquire(stream, &name, &LockReason::Rewind)
        .await
        .expect("acquire")
    else {
        panic!("the lease is free");
    };
    // Another transaction holds the cursor row.
    let mut other = s.db.connect().await;
    let row = other.transaction().await.expect("begin");
    row.execute(
        "SELECT 1 FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2 FOR UPDATE",
        &[&stream.as_uuid(), &NUMBERS],
    )
    .await
    .expect("lock the row");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), lease.release())
            .await
            .is_err(),
        "the release waits for the row"
    );
    let shutdown = tokio::spawn(async move { keeper.shutdown().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!shutdown.is_finished(), "shutdown waits for the row too");
    row.rollback().await.expect("free the row");
    let released = shutdown.await.expect("task").expect("shutdown");
    assert_eq!(
        released, 1,
        "shutdown counts the lease it released or waited for"
    );
    assert_eq!(s.live_leases().await, 0, "no lease left set");
}
