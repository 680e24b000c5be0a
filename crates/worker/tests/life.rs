//! A perspective's life through the worker, on the testkit fakes: a rebuild requested with
//! [`lockstep_worker::life::rebuild`] rewinds every pair, the old states are served until each
//! pair's rewind commits, the running rewind's progress is visible while it replays, and a
//! retired perspective leaves a running worker idle and unharmed. Every library entry point is
//! called from inside `tokio::spawn` with concrete types, as a request handler would.

use lockstep_core::perspective_store::prelude::*;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use lockstep_core::Transaction as _;
use lockstep_core::{
    EventStore, ExpectedVersion, InstanceId, NewEvent, Perspective, PerspectiveName,
    PerspectiveRegistry, Rebuild, RecordedEvent, RetireStates, Retired, StreamId,
    StreamLockOptions, StreamLocker,
};
use lockstep_testkit::{
    FakeDatabase, InMemoryEventStore, InMemoryPerspectiveStore, InMemoryStreamLocker,
};
use lockstep_worker::{PerspectiveWorker, WorkerOptions, life};

/// A gate the perspective's `apply` waits at (for event 2) while it is closed.
#[derive(Default)]
struct Gate {
    closed: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn set(&self, closed: bool) {
        *self.closed.lock().expect("gate") = closed;
        self.opened.notify_all();
    }

    fn pass(&self) {
        let closed = self.closed.lock().expect("gate");
        // Bounded: a test that forgets to open the gate fails instead of hanging.
        let _ = self
            .opened
            .wait_timeout_while(closed, Duration::from_secs(30), |c| *c)
            .expect("gate");
    }
}

/// Scales every event's number by `factor` ("the code changed" when it does) into a list.
struct Scaled {
    factor: Arc<AtomicI64>,
    gate: Arc<Gate>,
}

impl Perspective for Scaled {
    type State = Vec<i64>;
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        "Scaled"
    }

    fn apply(&self, state: &mut Vec<i64>, event: &RecordedEvent) -> Result<(), Self::Error> {
        let n = event.payload.as_i64().unwrap_or(0);
        if n == 2 {
            self.gate.pass();
        }
        state.push(n * self.factor.load(Ordering::SeqCst));
        Ok(())
    }
}

fn scaled() -> PerspectiveName {
    PerspectiveName::new("Scaled").expect("valid")
}

type Worker = PerspectiveWorker<FakeDatabase, InMemoryPerspectiveStore>;

struct World {
    db: FakeDatabase,
    events: InMemoryEventStore,
    store: InMemoryPerspectiveStore,
    worker: Arc<Worker>,
    factor: Arc<AtomicI64>,
    gate: Arc<Gate>,
}

impl World {
    fn new() -> World {
        let db = FakeDatabase::new();
        let events = InMemoryEventStore::new();
        let locker = InMemoryStreamLocker::with_database(StreamLockOptions::default(), &db);
        let store = InMemoryPerspectiveStore::new(&db, &events, &locker);
        let factor = Arc::new(AtomicI64::new(1));
        let gate = Arc::new(Gate::default());
        let mut registry = PerspectiveRegistry::new();
        registry
            .register(Scaled {
                factor: Arc::clone(&factor),
                gate: Arc::clone(&gate),
            })
            .expect("register");
        let locker: Arc<dyn StreamLocker> = Arc::new(locker);
        let worker = PerspectiveWorker::new(
            db.clone(),
            store.clone(),
            registry,
            WorkerOptions::default(),
            InstanceId::random(),
            Some(locker),
        )
        .expect("worker");
        World {
            db,
            events,
            store,
            worker: Arc::new(worker),
            factor,
            gate,
        }
    }

    async fn append(&self, stream: StreamId, numbers: &[i64]) {
        let new: Vec<NewEvent> = numbers
            .iter()
            .map(|n| NewEvent::new("Happened", serde_json::json!(n)).expect("event"))
            .collect();
        let tx = self.db.begin_now();
        self.events
            .append(&tx, stream, ExpectedVersion::Any, &new)
            .await
            .expect("append");
        tx.commit().await.expect("commit");
    }

    fn state(&self, stream: StreamId) -> Vec<i64> {
        self.store
            .committed_state(stream, &scaled())
            .map(|s| serde_json::from_value(s).expect("a list"))
            .unwrap_or_default()
    }

    async fn drain(&self) {
        for _ in 0..50 {
            let report = self.worker.run_once().await;
            assert!(report.errors.is_empty(), "{:?}", report.errors);
            if !report.did_work() && report.failed == 0 {
                return;
            }
        }
        panic!("the worker did not go idle");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_rewinds_every_pair_serving_old_states_and_reporting_progress_meanwhile() {
    let w = World::new();
    w.worker.register().await.expect("register");
    let (first, second) = (StreamId::new_v7(), StreamId::new_v7());
    w.append(first, &[1, 2, 3]).await;
    w.append(second, &[4, 5]).await;
    w.drain().await;
    assert_eq!(
        (w.state(first), w.state(second)),
        (vec![1, 2, 3], vec![4, 5])
    );

    // The code changed: rebuild, with the replay held at the first stream's event 2.
    w.factor.store(10, Ordering::SeqCst);
    w.gate.set(true);
    let rebuilt = {
        let (db, store) = (w.db.clone(), w.store.clone());
        tokio::spawn(async move { life::rebuild(&db, &store, &scaled()).await })
    };
    let outcome = rebuilt.await.expect("task").expect("rebuild");
    assert_eq!(outcome, Rebuild::Requested { pairs: 2 });

    let running = {
        let worker = Arc::clone(&w.worker);
        tokio::spawn(async move {
            for _ in 0..10 {
                worker.run_once().await;
            }
        })
    };
    // Bounded wait for the replay's progress report (after about a second).
    let mut seen = None;
    for _ in 0..200 {
        let (db, store) = (w.db.clone(), w.store.clone());
        let rows = tokio::spawn(async move { life::rewind_progress(&db, &store, &[]).await })
            .await
            .expect("task")
            .expect("progress");
        if let Some(row) = rows.into_iter().find(|r| r.pair.stream_id == first) {
            seen = Some(row);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let row = seen.expect("the running rewind reported its progress");
    assert_eq!(
        (row.replayed, row.to_replay),
        (1, 3),
        "one of three replayed"
    );
    assert_eq!(row.holder, Some(w.worker.instance()));
    assert!(row.started_at <= row.updated_at);
    assert_eq!(
        w.state(first),
        vec![1, 2, 3],
        "the old state is served meanwhile"
    );

    w.gate.set(false);
    tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the rewinds finish once the gate opens")
        .expect("task");
    w.drain().await;
    assert_eq!(w.state(first), vec![10, 20, 30]);
    assert_eq!(w.state(second), vec![40, 50]);
    let (db, store) = (w.db.clone(), w.store.clone());
    let rows = tokio::spawn(async move { life::rewind_progress(&db, &store, &[]).await })
        .await
        .expect("task")
        .expect("progress");
    assert!(
        rows.is_empty(),
        "nothing in progress once committed: {rows:?}"
    );
}

#[tokio::test]
async fn a_retired_perspective_leaves_a_running_worker_idle_and_comes_back_from_its_cursors() {
    let w = World::new();
    w.worker.register().await.expect("register");
    let stream = StreamId::new_v7();
    w.append(stream, &[1]).await;
    w.drain().await;

    let (db, store) = (w.db.clone(), w.store.clone());
    let retired =
        tokio::spawn(async move { life::retire(&db, &store, &scaled(), RetireStates::Keep).await })
            .await
            .expect("task")
            .expect("retire");
    assert!(
        matches!(retired, Retired::Retired { pairs: 1, .. }),
        "{retired:?}"
    );
    w.append(stream, &[3]).await;
    let report = w.worker.run_once().await;
    assert!(report.errors.is_empty() && !report.did_work(), "{report:?}");
    assert_eq!(w.state(stream), vec![1], "the kept state");

    // A worker (re)starting with the perspective registers it again: it continues.
    w.worker.register().await.expect("register");
    w.drain().await;
    assert_eq!(w.state(stream), vec![1, 3]);

    let tx = w.db.begin_now();
    assert_eq!(
        w.store
            .retire(
                &tx,
                &PerspectiveName::new("Unknown").expect("name"),
                RetireStates::Drop
            )
            .await
            .expect("retire"),
        Retired::NotRegistered
    );
    tx.rollback().await.expect("rollback");
}

#[tokio::test(start_paused = true)]
async fn the_worker_reports_its_catch_up_rate_and_the_time_to_empty_follows() {
    let w = World::new();
    w.worker.register().await.expect("register");
    let stream = StreamId::new_v7();
    w.append(stream, &[1, 3, 4, 5, 6]).await;
    w.drain().await;
    tokio::time::sleep(Duration::from_secs(11)).await;
    w.append(stream, &[7, 8, 9]).await;
    w.drain().await;

    let (db, store) = (w.db.clone(), w.store.clone());
    let rates = tokio::spawn(async move {
        let tx = db.begin_now();
        let rates = store.throughput(&tx).await;
        tx.rollback().await.expect("rollback");
        rates
    })
    .await
    .expect("task")
    .expect("throughput");
    let rate = rates
        .iter()
        .find(|t| t.perspective == scaled())
        .expect("the perspective's rate");
    let per_second = rate.events_per_second.expect("a closed window");
    assert!(
        (per_second - 8.0 / 11.0).abs() < 0.05,
        "8 events over the 11 s window: {per_second}"
    );
    let eta = rate.time_to_empty(8).expect("a time to empty");
    assert!((eta.as_secs_f64() - 11.0).abs() < 1.0, "{eta:?}");
}
