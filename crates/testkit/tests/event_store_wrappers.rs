//! The recording and fault-injecting event-store wrappers on the in-memory store: injected
//! faults never reach the store, recorded calls come back in order with their outcomes, and an
//! application's optimistic retry loop can be driven through injected conflicts.

use lockstep_core::Transaction as _;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use lockstep_core::{
    ErrorKind, EventStore, ExpectedVersion, NewEvent, ResourceKey, Result, RetryPolicy, StreamId,
    version_conflict,
};
use lockstep_testkit::conformance::event_store::Fixture;
use lockstep_testkit::{
    EventStoreCall, FakeDatabase, FakeTransaction, FaultyEventStore, InMemoryEventStore,
    RecordingEventStore,
};

fn event(event_type: &str, quantity: i64) -> NewEvent {
    NewEvent::new(event_type, serde_json::json!({ "quantity": quantity })).expect("event")
}

fn key(name: &str) -> ResourceKey {
    ResourceKey::new(format!("test:{name}")).expect("key")
}

/// Commits `events` to a new stream straight on the store (no wrapper involved).
async fn seeded(db: &FakeDatabase, store: &InMemoryEventStore, events: &[NewEvent]) -> StreamId {
    let stream = StreamId::new_v7();
    let tx = db.begin_now();
    store
        .append(&tx, stream, ExpectedVersion::NoStream, events)
        .await
        .expect("seed");
    tx.commit().await.expect("commit seed");
    stream
}

#[tokio::test(start_paused = true)]
async fn an_injected_conflict_is_retryable_is_not_applied_and_the_next_append_goes_through() {
    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let stream = seeded(&db, &store, &[event("StockAdded", 10)]).await;
    let (faulty, faults) = FaultyEventStore::new(store.clone());

    faults.fail_next_appends(1, ErrorKind::Conflict);
    let tx = db.begin_now();
    let err = faulty
        .append(
            &tx,
            stream,
            ExpectedVersion::Exact(1),
            &[event("StockReserved", 2)],
        )
        .await
        .expect_err("injected");
    assert_eq!(err.kind(), ErrorKind::Conflict);
    assert!(err.is_retryable());
    let conflict = version_conflict(&err).expect("conflict details, as a real conflict has");
    assert_eq!(conflict.stream_id(), stream);
    assert_eq!(conflict.expected(), ExpectedVersion::Exact(1));
    assert_eq!(conflict.actual(), None);

    // Nothing reached the store: nothing was staged, even in the failed append's own
    // transaction (which the store never saw, so it is not aborted either — see the wrapper's
    // docs), and the stream is still at version 1.
    assert!(tx.is_usable());
    assert_eq!(faulty.load(&tx, stream).await.expect("load").len(), 1);
    tx.rollback().await.expect("rollback");
    assert_eq!(store.committed(stream).len(), 1);

    // One fault per call: the retry, in a new transaction, goes through.
    let tx = db.begin_now();
    let version = faulty
        .append(
            &tx,
            stream,
            ExpectedVersion::Exact(1),
            &[event("StockReserved", 2)],
        )
        .await
        .expect("append after the fault");
    assert_eq!(version, 2);
    tx.commit().await.expect("commit");
    let types: Vec<_> = store
        .committed(stream)
        .into_iter()
        .map(|e| e.event_type)
        .collect();
    assert_eq!(types, ["StockAdded", "StockReserved"]);
}

#[tokio::test(start_paused = true)]
async fn injected_load_faults_and_denials_take_no_lock_and_then_delegate() {
    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let stream = seeded(&db, &store, &[event("StockAdded", 10)]).await;
    let (faulty, faults) = FaultyEventStore::new(store);
    let tx = db.begin_now();

    faults.fail_next_loads(2, ErrorKind::ConnectionLost);
    let err = faulty.load(&tx, stream).await.expect_err("injected");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost);
    let err = faulty
        .load_locked(&tx, stream, &key("a"), None)
        .await
        .expect_err("injected");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost);
    assert!(
        db.held_keys().is_empty(),
        "a failed load_locked locks nothing"
    );

    faults.deny_next_acquires(1);
    let err = faulty
        .load_locked(&tx, stream, &key("a"), Some(Duration::from_secs(1)))
        .await
        .expect_err("denied");
    assert_eq!(err.kind(), ErrorKind::LockTimeout);
    assert!(
        db.held_keys().is_empty(),
        "a denied load_locked locks nothing"
    );

    let events = faulty
        .load_locked(&tx, stream, &key("a"), None)
        .await
        .expect("load_locked");
    assert_eq!(events.len(), 1);
    assert_eq!(db.held_keys().len(), 1);
    tx.rollback().await.expect("rollback");
}

#[tokio::test(start_paused = true)]
async fn latency_delays_the_call_before_it_reaches_the_store() {
    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let (faulty, faults) = FaultyEventStore::new(store.clone());
    let stream = StreamId::new_v7();
    faults.set_latency(Duration::from_secs(5));
    let tx = db.begin_now();
    let one = [event("StockAdded", 1)];

    // On the paused clock: abandoned halfway through the delay, the append never started.
    let abandoned = tokio::time::timeout(
        Duration::from_secs(1),
        faulty.append(&tx, stream, ExpectedVersion::NoStream, &one),
    )
    .await;
    assert!(abandoned.is_err(), "still in the injected delay");
    assert!(tx.is_usable(), "the store never saw the abandoned append");

    let version = faulty
        .append(&tx, stream, ExpectedVersion::NoStream, &one)
        .await
        .expect("append after the delay");
    assert_eq!(version, 1);
    tx.commit().await.expect("commit");
    assert_eq!(store.committed(stream).len(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_recording_store_lists_calls_in_order_with_their_outcomes() {
    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let recording = RecordingEventStore::new(store);
    let stream = StreamId::new_v7();

    let tx = db.begin_now();
    recording.load(&tx, stream).await.expect("load");
    recording
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[event("StockAdded", 10), event("StockReserved", 2)],
        )
        .await
        .expect("append");
    tx.commit().await.expect("commit");

    let tx = db.begin_now();
    let err = recording
        .append(
            &tx,
            stream,
            ExpectedVersion::Exact(1),
            &[event("StockReleased", 2)],
        )
        .await
        .expect_err("stale expected version");
    assert_eq!(err.kind(), ErrorKind::Conflict);
    tx.rollback().await.expect("rollback");

    let tx = db.begin_now();
    let timeout = Some(Duration::from_secs(2));
    recording
        .load_locked(&tx, stream, &key("stock"), timeout)
        .await
        .expect("load_locked");
    tx.rollback().await.expect("rollback");

    assert_eq!(
        recording.calls(),
        vec![
            EventStoreCall::Load {
                stream_id: stream,
                outcome: Ok(0),
            },
            EventStoreCall::Append {
                stream_id: stream,
                expected: ExpectedVersion::NoStream,
                event_types: vec!["StockAdded".to_owned(), "StockReserved".to_owned()],
                outcome: Ok(2),
            },
            EventStoreCall::Append {
                stream_id: stream,
                expected: ExpectedVersion::Exact(1),
                event_types: vec!["StockReleased".to_owned()],
                outcome: Err(err.kind()),
            },
            EventStoreCall::LoadLocked {
                stream_id: stream,
                key: key("stock"),
                timeout,
                outcome: Ok(2),
            },
        ]
    );
    assert_eq!(
        recording.appended_event_types(),
        ["StockAdded", "StockReserved"]
    );
    assert_eq!(recording.appends().len(), 2);
    assert!(recording.calls().iter().all(|c| c.stream_id() == stream));
}

/// An application command handler: reserve `quantity` if the stream's stock allows it, as one
/// unit of work per attempt (begin, load, decide, append, commit), retried on conflicts.
async fn reserve<S: EventStore<FakeTransaction>>(
    db: &FakeDatabase,
    store: &S,
    stream: StreamId,
    quantity: i64,
    attempts: &AtomicU32,
) -> Result<u64> {
    RetryPolicy::default()
        .run(tokio::time::sleep, |_attempt| {
            Box::pin(async move {
                attempts.fetch_add(1, Ordering::SeqCst);
                let tx = db.begin_now();
                let events = store.load(&tx, stream).await?;
                let available: i64 = events
                    .iter()
                    .map(|e| {
                        let q = e.payload["quantity"].as_i64().unwrap_or(0);
                        if e.event_type == "StockAdded" { q } else { -q }
                    })
                    .sum();
                assert!(available >= quantity, "enough stock in this test");
                let version = store
                    .append(
                        &tx,
                        stream,
                        ExpectedVersion::Exact(events.len() as u64),
                        &[event("StockReserved", quantity)],
                    )
                    .await?;
                tx.commit().await?;
                Ok(version)
            })
        })
        .await
}

#[tokio::test(start_paused = true)]
async fn an_application_retry_loop_succeeds_after_two_injected_conflicts_appending_once() {
    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let stream = seeded(&db, &store, &[event("StockAdded", 10)]).await;
    let (faulty, faults) = FaultyEventStore::new(store.clone());
    let recording = RecordingEventStore::new(faulty);
    let attempts = AtomicU32::new(0);

    faults.fail_next_appends(2, ErrorKind::Conflict);
    let version = reserve(&db, &recording, stream, 3, &attempts)
        .await
        .expect("succeeds on the third attempt");

    assert_eq!(version, 2);
    assert_eq!(attempts.load(Ordering::SeqCst), 3);
    let outcomes: Vec<_> = recording
        .appends()
        .iter()
        .map(EventStoreCall::outcome)
        .collect();
    assert_eq!(
        outcomes,
        [Err(ErrorKind::Conflict), Err(ErrorKind::Conflict), Ok(2)]
    );
    assert_eq!(recording.appended_event_types(), ["StockReserved"]);
    let types: Vec<_> = store
        .committed(stream)
        .into_iter()
        .map(|e| e.event_type)
        .collect();
    assert_eq!(
        types,
        ["StockAdded", "StockReserved"],
        "appended exactly once"
    );
}

type Wrapped = Fixture<FakeDatabase, RecordingEventStore<FaultyEventStore<InMemoryEventStore>>>;

fn wrapped() -> Wrapped {
    let (faulty, _faults) = FaultyEventStore::new(InMemoryEventStore::new());
    Fixture::new(FakeDatabase::new(), RecordingEventStore::new(faulty))
}

/// The wrappers without faults pass the event-store suite.
mod the_wrappers_without_faults_pass_the_event_store_suite {
    use super::*;

    lockstep_testkit::event_store_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: wrapped(),
        after_each: |fixture: &Wrapped| {
            assert!(!fixture.store.appends().is_empty());
            assert!(fixture.source.held_keys().is_empty());
        },
    }
}

/// The wrappers without faults pass the snapshot-store suite, and record its snapshot calls.
mod the_wrappers_without_faults_pass_the_snapshot_store_suite {
    use super::*;

    lockstep_testkit::snapshot_store_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: wrapped(),
        after_each: |fixture: &Wrapped| {
            assert!(
                fixture.store.calls().iter().any(|c| matches!(
                    c,
                    lockstep_testkit::EventStoreCall::LoadFromSnapshot { .. }
                        | lockstep_testkit::EventStoreCall::SaveSnapshot { .. }
                )),
                "snapshot calls are recorded"
            );
            assert!(fixture.source.held_keys().is_empty());
        },
    }
}
