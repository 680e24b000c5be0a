//! A perspective's life on PostgreSQL with two worker instances (issue 20, items 3 and 4): a
//! rebuild requested from a spawned task is carried out pair by pair by both instances under
//! their rewind leases, every pair serves its old state until its own rewind commits, the
//! running rewinds' progress is visible (one per instance, each with its holder) while they
//! replay, and the catch-up rate is reported.

use lockstep_core::perspective_store::prelude::*;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;
use lockstep_core::TransactionSource as _;
use lockstep_core::{
    ExpectedVersion, InstanceId, NewEvent, Perspective, PerspectiveName, PerspectiveRegistry,
    Rebuild, RecordedEvent, StreamId, StreamLockOptions, StreamLocker,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::test_database;
use lockstep_worker::{CancellationToken, PerspectiveWorker, WorkerOptions, life};

/// A gate `apply` waits at (for events numbered 2) while it is closed; bounded, so a test that
/// fails before opening it does not hang.
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
        let _ = self
            .opened
            .wait_timeout_while(closed, Duration::from_secs(60), |c| *c)
            .expect("gate");
    }
}

/// Sums each event's number times `factor` (the perspective's "code", changed by the test).
#[derive(Clone)]
struct Scaled {
    factor: Arc<AtomicI64>,
    gate: Arc<Gate>,
}

impl Perspective for Scaled {
    type State = i64;
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        "LifeScaled"
    }

    fn apply(&self, sum: &mut i64, event: &RecordedEvent) -> Result<(), Self::Error> {
        let n = event.payload.as_i64().unwrap_or(0);
        if n == 2 {
            self.gate.pass();
        }
        *sum += n * self.factor.load(Ordering::SeqCst);
        Ok(())
    }
}

const STREAMS: usize = 12;

async fn states(db: &PgDatabase, name: &PerspectiveName) -> Vec<i64> {
    let tx = db.begin().await.expect("begin");
    let states = PgPerspectiveStore::new()
        .states(&tx, name, None, 1000)
        .await
        .expect("states");
    tx.rollback().await.expect("rollback");
    states
        .iter()
        .map(|s| s.state.as_i64().unwrap_or(-1))
        .collect()
}

async fn status(db: &PgDatabase, name: &PerspectiveName) -> lockstep_core::PerspectiveStatus {
    let tx = db.begin().await.expect("begin");
    let all = PgPerspectiveStore::new()
        .perspective_status(&tx)
        .await
        .expect("status");
    tx.rollback().await.expect("rollback");
    all.into_iter()
        .find(|s| &s.perspective == name)
        .expect("registered")
}

/// Waits (bounded) until `done` holds.
async fn wait_until<F, Fut>(what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..600 {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting until {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_rebuild_a_perspective_pair_by_pair_serving_old_states_with_progress() {
    let test_db = test_database().await;
    test_db.skip_wal_flush().await.expect("synchronous_commit");
    let setup = test_db.pool(2);
    lockstep_pg::migrate(&setup).await.expect("migrate");
    let db = PgDatabase::from_pool(setup.clone());
    let name = PerspectiveName::new("LifeScaled").expect("name");
    let perspective = Scaled {
        factor: Arc::new(AtomicI64::new(1)),
        gate: Arc::new(Gate::default()),
    };

    let lock_options =
        StreamLockOptions::new(Duration::from_secs(5), Duration::from_secs(1)).expect("5 s / 1 s");
    let options = WorkerOptions::default().with_poll_interval(Duration::from_millis(20));
    let shutdown = CancellationToken::new();
    let mut instances = Vec::new();
    let mut running = Vec::new();
    for _ in 0..2 {
        let pool = test_db.pool(3);
        let mut registry = PerspectiveRegistry::new();
        registry.register(perspective.clone()).expect("register");
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
        worker.register().await.expect("register");
        instances.push(instance);
        let shutdown = shutdown.clone();
        running.push(tokio::spawn(async move { worker.run(shutdown).await }));
    }

    let events = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    for _ in 0..STREAMS {
        let tx = PgTransaction::begin(&setup).await.expect("begin");
        let batch: Vec<NewEvent> = (1..=4)
            .map(|n| NewEvent::new("Numbered", serde_json::json!(n)).expect("event"))
            .collect();
        events
            .append(&tx, StreamId::new_v7(), ExpectedVersion::NoStream, &batch)
            .await
            .expect("append");
        tx.commit().await.expect("commit");
    }
    wait_until("every stream is applied", || async {
        status(&db, &name).await.pending_events == 0
    })
    .await;
    assert_eq!(states(&db, &name).await, vec![10; STREAMS]);

    // The code changed; the replays are held at event 2 while we look.
    perspective.factor.store(100, Ordering::SeqCst);
    perspective.gate.set(true);
    let rebuilt = {
        let (db, name) = (db.clone(), name.clone());
        tokio::spawn(async move { life::rebuild(&db, &PgPerspectiveStore::new(), &name).await })
    };
    let outcome = rebuilt.await.expect("task").expect("rebuild");
    assert_eq!(
        outcome,
        Rebuild::Requested {
            pairs: STREAMS as u64
        }
    );

    let mut progress = Vec::new();
    for _ in 0..600 {
        let (db, name) = (db.clone(), name.clone());
        progress = tokio::spawn(async move {
            life::rewind_progress(&db, &PgPerspectiveStore::new(), &[name]).await
        })
        .await
        .expect("task")
        .expect("progress");
        if progress.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        progress.len(),
        2,
        "both instances report a running rewind: {progress:?}"
    );
    let mut holders: Vec<InstanceId> = progress.iter().filter_map(|p| p.holder).collect();
    holders.sort_by_key(|h| h.as_uuid());
    let mut expected = instances.clone();
    expected.sort_by_key(|h| h.as_uuid());
    assert_eq!(
        holders, expected,
        "one rewind per instance, under its lease"
    );
    for p in &progress {
        assert_eq!((p.replayed, p.to_replay), (1, 4), "{p:?}");
    }
    assert_eq!(
        states(&db, &name).await,
        vec![10; STREAMS],
        "every pair serves its old state while the rebuild runs"
    );

    perspective.gate.set(false);
    wait_until("every pair is rebuilt", || async {
        status(&db, &name).await.rewinds_pending == 0
    })
    .await;
    assert_eq!(states(&db, &name).await, vec![1000; STREAMS]);
    let left = life::rewind_progress(&db, &PgPerspectiveStore::new(), &[])
        .await
        .expect("progress");
    assert!(left.is_empty(), "{left:?}");

    let tx = db.begin().await.expect("begin");
    let rates = PgPerspectiveStore::new()
        .throughput(&tx)
        .await
        .expect("throughput");
    tx.rollback().await.expect("rollback");
    let rate = rates
        .iter()
        .find(|t| t.perspective == name)
        .expect("the workers reported what they applied");
    assert!(
        rate.window_applied > 0 || rate.events_per_second.is_some(),
        "{rate:?}"
    );

    shutdown.cancel();
    for worker in running {
        tokio::time::timeout(Duration::from_secs(30), worker)
            .await
            .expect("the workers stop")
            .expect("task")
            .expect("run");
    }
}
