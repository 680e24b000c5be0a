//! `WorkerOptions::concurrency` on the fakes: several pairs of a cycle in flight at once, every
//! stream still the exact fold of its events, late arrivals included.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::Transaction as _;
use lockstep_core::{
    EventStore, ExpectedVersion, InstanceId, NewEvent, Perspective, PerspectiveName,
    PerspectiveRegistry, RecordedEvent, StreamId, StreamLockOptions, StreamLocker,
};
use lockstep_testkit::{
    FakeDatabase, InMemoryEventStore, InMemoryPerspectiveStore, InMemoryStreamLocker,
};
use lockstep_worker::{PerspectiveWorker, WorkerOptions};
use uuid::Uuid;

/// The list of the events' numbers, in the order applied.
struct Fold;

impl Perspective for Fold {
    type State = Vec<i64>;
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        "Fold"
    }

    fn apply(&self, state: &mut Vec<i64>, event: &RecordedEvent) -> Result<(), Self::Error> {
        state.push(event.payload.as_i64().unwrap_or(-1));
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_worker_with_several_pairs_in_flight_folds_every_stream_exactly_once() {
    let db = FakeDatabase::new();
    let events = InMemoryEventStore::new();
    let locker = InMemoryStreamLocker::with_database(StreamLockOptions::default(), &db);
    let store = InMemoryPerspectiveStore::new(&db, &events, &locker);
    let mut registry = PerspectiveRegistry::new();
    registry.register(Fold).expect("register");
    let locker: Arc<dyn StreamLocker> = Arc::new(locker);
    let worker = PerspectiveWorker::new(
        db.clone(),
        store.clone(),
        registry,
        WorkerOptions::default()
            .with_concurrency(4)
            .with_pairs_per_cycle(8),
        InstanceId::random(),
        Some(locker),
    )
    .expect("worker");
    worker.register().await.expect("register");

    let streams: Vec<StreamId> = (0..10).map(|_| StreamId::new_v7()).collect();
    let append = |stream: StreamId, n: i64, id: Option<Uuid>| {
        let (db, events) = (db.clone(), events.clone());
        async move {
            let mut event = NewEvent::new("Numbered", serde_json::json!(n)).expect("event");
            if let Some(id) = id {
                event = event.with_id(id).expect("id");
            }
            let tx = db.begin_now();
            events
                .append(&tx, stream, ExpectedVersion::Any, &[event])
                .await
                .expect("append");
            tx.commit().await.expect("commit");
        }
    };
    for (i, stream) in streams.iter().enumerate() {
        for n in 0..5 {
            append(*stream, (i * 100 + n) as i64, None).await;
        }
    }
    let drain = || async {
        let mut rewinds = 0;
        for _ in 0..100 {
            let report = worker.run_once().await;
            assert!(report.errors.is_empty(), "{:?}", report.errors);
            assert_eq!(report.failed, 0);
            rewinds += report.rewinds;
            if !report.did_work() {
                return rewinds;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("the worker did not go idle");
    };
    assert_eq!(drain().await, 0);
    // A late arrival on every other stream: a rewind each, several in flight at once.
    for (i, stream) in streams.iter().enumerate().step_by(2) {
        append(
            *stream,
            -(i as i64),
            Some(Uuid::from_u128(
                0x0100_0000_0000_7000_8000_0000_0000_0000 | i as u128,
            )),
        )
        .await;
    }
    assert_eq!(drain().await, 5, "one rewind per late arrival");

    for stream in &streams {
        let mut committed = events.committed(*stream);
        committed.sort_by_key(|e| e.event_id);
        let expected: Vec<i64> = committed
            .iter()
            .filter_map(|e| e.payload.as_i64())
            .collect();
        let state: Vec<i64> = store
            .committed_state(*stream, &PerspectiveName::new("Fold").expect("name"))
            .map(|s| serde_json::from_value(s).expect("a list"))
            .unwrap_or_default();
        assert_eq!(
            state, expected,
            "stream {stream}: the exact fold in event-id order"
        );
    }
}
