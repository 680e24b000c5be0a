//! A worker running a perspective's serving version and a version being built beside it, on the
//! fakes, its store recorded: no batch ever holds pairs of both (the serving version's pairs are
//! never held behind a build's backlog), both apply every event, and once the new version is
//! promoted the worker claims every perspective together again.

use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    EventStore, ExpectedVersion, InstanceId, NewEvent, Perspective, PerspectiveName,
    PerspectiveRegistry, RecordedEvent, StreamId, Transaction as _, TransactionSource as _,
    VersionPolicy,
};
use lockstep_testkit::recording_perspective_store::{PerspectiveMethod, Returned};
use lockstep_testkit::{
    FakeDatabase, InMemoryEventStore, InMemoryPerspectiveStore, InMemoryStreamLocker,
    RecordingPerspectiveStore,
};
use lockstep_worker::{PerspectiveWorker, PromoteOptions, Promoted, WorkerOptions};

/// Events applied per stream, by version.
struct Count {
    version: u32,
}

impl Perspective for Count {
    type State = u64;
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        "Count"
    }

    fn version(&self) -> u32 {
        self.version
    }

    fn apply(&self, state: &mut u64, _event: &RecordedEvent) -> Result<(), Self::Error> {
        *state += 1;
        Ok(())
    }
}

async fn append(db: &FakeDatabase, events: &InMemoryEventStore, stream: StreamId, n: usize) {
    let tx = db.begin().await.expect("begin");
    let batch: Vec<NewEvent> = (0..n)
        .map(|i| NewEvent::new("Counted", serde_json::json!(i)).expect("event"))
        .collect();
    events
        .append(&tx, stream, ExpectedVersion::Any, &batch)
        .await
        .expect("append");
    tx.commit().await.expect("commit");
}

#[tokio::test]
async fn a_serving_version_and_a_build_are_never_claimed_in_one_batch() {
    let db = FakeDatabase::new();
    let events = InMemoryEventStore::new();
    let locker = InMemoryStreamLocker::with_database(Default::default(), &db);
    let store =
        RecordingPerspectiveStore::new(InMemoryPerspectiveStore::new(&db, &events, &locker));
    let streams: Vec<StreamId> = (0..6).map(|_| StreamId::new_v7()).collect();
    for stream in &streams {
        append(&db, &events, *stream, 4).await;
    }
    let mut registry = PerspectiveRegistry::new();
    registry
        .register_with(Count { version: 1 }, VersionPolicy::new().manual())
        .expect("v1");
    registry
        .register_with(Count { version: 2 }, VersionPolicy::new().manual())
        .expect("v2");
    let worker = PerspectiveWorker::new(
        db.clone(),
        store.clone(),
        registry,
        WorkerOptions::default(),
        InstanceId::random(),
        None,
    )
    .expect("worker");
    worker.register().await.expect("register");
    // Cycles with new events for the serving version arriving between them.
    for round in 0..20 {
        append(&db, &events, streams[round % streams.len()], 1).await;
        worker.run_once().await;
    }
    for _ in 0..20 {
        if !worker.run_once().await.did_work() {
            break;
        }
    }
    let v1 = PerspectiveName::new("Count").expect("valid");
    let v2 = v1.versioned(2).expect("versioned");
    let mut both = 0;
    let mut claims = 0;
    for call in store.calls_of(PerspectiveMethod::ClaimBatch) {
        if let Ok(Returned::Pairs(pairs)) = &call.outcome {
            let named: std::collections::BTreeSet<&PerspectiveName> =
                pairs.iter().map(|p| &p.perspective).collect();
            claims += usize::from(!named.is_empty());
            if named.contains(&v1) && named.contains(&v2) {
                both += 1;
            }
        }
    }
    assert!(claims >= 2, "batches were claimed ({claims})");
    assert_eq!(both, 0, "no batch held pairs of both versions");
    let tx = db.begin().await.expect("begin");
    for stream in &streams {
        let total = events.load(&tx, *stream).await.expect("load").len() as u64;
        for name in [&v1, &v2] {
            let state = store
                .state(&tx, &lockstep_core::Pair::new(*stream, name.clone()))
                .await
                .expect("state")
                .and_then(|(_, s)| s);
            assert_eq!(state, Some(serde_json::json!(total)), "{name} of {stream}");
        }
    }
    tx.rollback().await.expect("rollback");

    // Promoted, version 2 serves and version 1 is retired: one claim of everything again.
    let promoted = worker
        .promote(&v1, 2, PromoteOptions::forced())
        .await
        .expect("promote");
    assert_eq!(promoted, Promoted::Promoted { previous: Some(1) });
    let before = store.calls_of(PerspectiveMethod::ClaimBatch).len();
    append(&db, &events, streams[0], 1).await;
    worker.run_once().await;
    let after = store.calls_of(PerspectiveMethod::ClaimBatch);
    assert_eq!(
        after.len() - before,
        1,
        "one claim per batch once nothing builds"
    );
}
