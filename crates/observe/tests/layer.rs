//! The layer reports the same metrics whatever it wraps, and changes no behaviour: outcomes and
//! errors pass through unchanged.

use std::sync::Arc;

use lockstep_core::Transaction as _;
use lockstep_core::{
    AcquireOutcome, DistributedLock, ErrorKind, EventStore, ExpectedVersion, InstanceId,
    LockReason, NewEvent, PerspectiveName, ResourceKey, StreamId, StreamLockOptions, StreamLocker,
};
use lockstep_observe::{CALLS, Observed};
use lockstep_testkit::{
    FakeDatabase, FakeDistributedLock, FaultyStreamLocker, InMemoryEventStore, InMemoryStreamLocker,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

type Entries = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

/// Everything recorded so far (a snapshot drains the counters, so take it once).
fn recorded(snapshotter: &Snapshotter) -> Entries {
    snapshotter.snapshot().into_vec()
}

/// The value of `lockstep_calls_total` for these labels (0 when never reported).
fn calls(entries: &Entries, contract: &str, op: &str, outcome: &str) -> u64 {
    entries
        .iter()
        .find_map(|(key, _, _, value)| {
            let key = key.key();
            let labels: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            let wanted = [("contract", contract), ("op", op), ("outcome", outcome)];
            let matches = key.name() == CALLS
                && wanted
                    .iter()
                    .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v));
            match (matches, value) {
                (true, DebugValue::Counter(n)) => Some(*n),
                _ => None,
            }
        })
        .unwrap_or(0)
}

fn run<F: std::future::Future>(fut: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime")
        .block_on(fut)
}

#[test]
fn stream_locker_calls_are_counted_by_outcome_and_pass_through_unchanged() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        run(async {
            let inner = InMemoryStreamLocker::new(StreamLockOptions::default());
            let (faulty, faults) = FaultyStreamLocker::new(inner.clone());
            let locker: Arc<dyn StreamLocker> = Arc::new(Observed::new(faulty));
            let (stream, name) = (
                StreamId::new_v7(),
                PerspectiveName::new("P").expect("valid"),
            );
            let none = locker
                .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
                .await
                .expect("try");
            assert!(!none.is_acquired(), "no cursor row: not acquired");
            inner.create_cursor(stream, &name);
            let lease = locker
                .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
                .await
                .expect("try")
                .into_lease()
                .expect("acquired");
            let denied = locker
                .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
                .await
                .expect("try");
            assert!(!denied.is_acquired());
            faults.busy_next_acquires(1);
            let busy = locker
                .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
                .await
                .expect("try");
            assert_eq!(busy, AcquireOutcome::Busy);
            assert!(locker.renew(&lease.id).await.expect("renew").is_renewed());
            assert!(
                locker
                    .release(&lease.id)
                    .await
                    .expect("release")
                    .is_released()
            );
            assert!(
                !locker
                    .release(&lease.id)
                    .await
                    .expect("release")
                    .is_released()
            );
        });
    });
    let entries = recorded(&snapshotter);
    for (op, outcome) in [
        ("try_acquire", "no_cursor"),
        ("try_acquire", "acquired"),
        ("try_acquire", "denied"),
        ("try_acquire", "busy"),
        ("renew", "renewed"),
        ("release", "released"),
        ("release", "not_held"),
    ] {
        assert_eq!(
            calls(&entries, "stream_locker", op, outcome),
            1,
            "{op} {outcome}"
        );
    }
}

#[test]
fn failures_are_counted_by_kind_and_returned_unchanged() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        run(async {
            let db = FakeDatabase::new();
            let store = Observed::new(InMemoryEventStore::new());
            let stream = StreamId::new_v7();
            let event = || NewEvent::new("Happened", serde_json::json!(1)).expect("event");
            let tx = db.begin_now();
            store
                .append(&tx, stream, ExpectedVersion::NoStream, &[event()])
                .await
                .expect("append");
            tx.commit().await.expect("commit");
            let tx = db.begin_now();
            let err = store
                .append(&tx, stream, ExpectedVersion::NoStream, &[event()])
                .await
                .expect_err("stale");
            assert_eq!(err.kind(), ErrorKind::Conflict);
            tx.rollback().await.expect("rollback");

            let lock = Observed::new(FakeDistributedLock::new(&db));
            let key = ResourceKey::new("observe:test").expect("key");
            let (a, b) = (db.begin_now(), db.begin_now());
            assert!(
                lock.try_acquire_for_transaction(&a, &key)
                    .await
                    .expect("try")
            );
            assert!(
                !lock
                    .try_acquire_for_transaction(&b, &key)
                    .await
                    .expect("try")
            );
        });
    });
    let entries = recorded(&snapshotter);
    assert_eq!(calls(&entries, "event_store", "append", "ok"), 1);
    assert_eq!(calls(&entries, "event_store", "append", "conflict"), 1);
    assert_eq!(
        calls(
            &entries,
            "distributed_lock",
            "try_acquire_for_transaction",
            "acquired"
        ),
        1
    );
    assert_eq!(
        calls(
            &entries,
            "distributed_lock",
            "try_acquire_for_transaction",
            "busy"
        ),
        1
    );
}
