//! The perspective worker over events that changed shape, on the fakes and on PostgreSQL, each
//! run from inside `tokio::spawn` with concrete types as an application's task would: the
//! stores read through upcasters, so [`Numbers`] (which folds `{"n": …}` and fails on anything
//! else) sees the current shape of every event, whichever version was stored; an event an
//! upcaster fails on parks its pair at that event, after the events before it are applied —
//! through the batch path (`run_once`) and the one-pair path (`process_pair`).

use lockstep_core::{
    EventStore, ExpectedVersion, InstanceId, NewEvent, Pair, PerspectiveName, PerspectiveRegistry,
    PerspectiveStore, StreamId, StreamLockOptions, Transaction, TransactionSource, Upcasters,
};
use lockstep_pg::PgDatabase;
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_testkit::pg_harness::test_database;
use lockstep_testkit::{
    FakeDatabase, InMemoryEventStore, InMemoryPerspectiveStore, InMemoryStreamLocker,
};
use lockstep_tests::{NUMBERS, Numbers};
use lockstep_worker::{PairErrorKind, PairOutcome, PerspectiveWorker, WorkerOptions};
use uuid::Uuid;

/// Version 1 of `Numbered` was `{"number": n}`; version 2 is `{"n": n}`. The upcaster fails on
/// a version 1 payload without a whole number.
fn upcasters() -> Upcasters {
    Upcasters::new()
        .with("Numbered", 1, |payload| {
            let n = payload["number"].as_i64().ok_or("no whole number")?;
            Ok(serde_json::json!({ "n": n }))
        })
        .expect("one upcaster")
}

/// A `Numbered` event of version 1.
fn old(n: i64) -> NewEvent {
    NewEvent::new("Numbered", serde_json::json!({ "number": n })).expect("event")
}

/// A `Numbered` event of version 2, the current shape.
fn current(n: i64) -> NewEvent {
    NewEvent::new("Numbered", serde_json::json!({ "n": n }))
        .expect("event")
        .with_schema_version(2)
        .expect("version 2")
}

/// A `Numbered` event of version 1 the upcaster fails on.
fn unreadable() -> NewEvent {
    NewEvent::new("Numbered", serde_json::json!({ "number": "many" })).expect("event")
}

/// More cycles than any step takes on a quiet or a loaded machine: each cycle either does
/// work or finds none, so a step that needs more has stopped making progress.
const CYCLES: usize = 200;

async fn append<S, E>(source: &S, events: &E, stream: StreamId, batch: &[NewEvent])
where
    S: TransactionSource,
    E: EventStore<S::Tx>,
{
    let tx = source.begin().await.expect("begin");
    events
        .append(&tx, stream, ExpectedVersion::Any, batch)
        .await
        .expect("append");
    tx.commit().await.expect("commit");
}

/// The pair's committed cursor and state.
async fn stored<S, P>(
    source: &S,
    store: &P,
    pair: &Pair,
) -> Option<(lockstep_core::Cursor, Option<serde_json::Value>)>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let tx = source.begin().await.expect("begin");
    let found = store.state(&tx, pair).await.expect("state");
    tx.rollback().await.expect("rollback");
    found
}

/// The body both stacks run: `store` reads through [`upcasters`], `events` appends.
async fn folds_current_shapes_and_parks_at_an_event_an_upcaster_fails_on<S, P, E>(
    source: S,
    store: P,
    events: E,
) where
    S: TransactionSource + Clone + 'static,
    P: PerspectiveStore<S::Tx> + Clone + 'static,
    E: EventStore<S::Tx>,
{
    let mut registry = PerspectiveRegistry::new();
    registry.register(Numbers::new()).expect("register");
    let options = WorkerOptions::default().with_park_after_failures(Some(1));
    let worker = PerspectiveWorker::new(
        source.clone(),
        store.clone(),
        registry,
        options,
        InstanceId::random(),
        None,
    )
    .expect("worker");
    worker.register().await.expect("register");
    let name = PerspectiveName::new(NUMBERS).expect("name");

    // Versions 1 and 2 in one stream: folded in their current shape.
    let folded = StreamId::new_v7();
    append(&source, &events, folded, &[old(1), current(2), old(3)]).await;
    let pair = Pair::new(folded, name.clone());
    let mut cycles = 0;
    loop {
        let state = stored(&source, &store, &pair).await.and_then(|(_, s)| s);
        if state == Some(serde_json::json!([1, 2, 3])) {
            break;
        }
        assert!(
            cycles < CYCLES,
            "not folded after {CYCLES} cycles: {state:?}"
        );
        let report = worker.run_once().await;
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        cycles += 1;
    }

    // One pair now (the one-pair claim): the event before the unreadable one is applied, and
    // the pair parks at the unreadable one.
    // Made in order: perspectives apply in event-id order.
    let alone = StreamId::new_v7();
    let batch = [old(20), unreadable(), current(22)];
    let bad_alone = batch[1].event_id();
    append(&source, &events, alone, &batch).await;
    let outcome = worker
        .process_pair(alone, &name)
        .await
        .expect("process_pair");
    let PairOutcome::Failed { error } = outcome else {
        panic!("expected the pair to fail at the unreadable event, got {outcome:?}");
    };
    assert_eq!(error.kind(), PairErrorKind::UnreadableEvent);
    assert_eq!(error.event_id(), Some(bad_alone));
    assert_parked_at(
        &source,
        &store,
        &Pair::new(alone, name.clone()),
        bad_alone,
        20,
    )
    .await;

    // Through the batches: the same.
    let batched = StreamId::new_v7();
    let batch = [old(10), unreadable(), current(12)];
    let bad_batched = batch[1].event_id();
    append(&source, &events, batched, &batch).await;
    let pair = Pair::new(batched, name.clone());
    let mut failed = None;
    for _ in 0..CYCLES {
        let report = worker.run_once().await;
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        if let Some(f) = report.failures.into_iter().find(|f| f.pair == pair) {
            failed = Some(f.error);
        }
        let parked = stored(&source, &store, &pair)
            .await
            .is_some_and(|(cursor, _)| cursor.parked_at.is_some());
        if parked {
            break;
        }
    }
    let error = failed.expect("the batch reported the pair's failure");
    assert_eq!(error.kind(), PairErrorKind::UnreadableEvent);
    assert_eq!(error.event_id(), Some(bad_batched));
    assert_parked_at(&source, &store, &pair, bad_batched, 10).await;

    // The status shows both pairs parked, the event each is parked at, and why.
    let tx = source.begin().await.expect("begin");
    let status = store.perspective_status(&tx).await.expect("status");
    let parked = store
        .parked_pairs(&tx, std::slice::from_ref(&name), 10)
        .await
        .expect("parked_pairs");
    tx.rollback().await.expect("rollback");
    let numbers = status
        .iter()
        .find(|s| s.perspective == name)
        .expect("status");
    assert_eq!(numbers.parked, 2);
    let mut at: Vec<(StreamId, Option<Uuid>)> = parked
        .iter()
        .map(|c| (c.pair.stream_id, c.failed_event_id))
        .collect();
    at.sort();
    let mut expected = vec![(alone, Some(bad_alone)), (batched, Some(bad_batched))];
    expected.sort();
    assert_eq!(at, expected);
    for cursor in &parked {
        let error = cursor.error.as_deref().unwrap_or_default();
        assert!(error.contains("could not be upcast"), "{error}");
    }
}

/// The pair is parked at `bad`, with the one event before it (`n`) applied.
async fn assert_parked_at<S, P>(source: &S, store: &P, pair: &Pair, bad: Uuid, n: i64)
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let (cursor, state) = stored(source, store, pair).await.expect("a cursor");
    assert_eq!(state, Some(serde_json::json!([n])), "the event before it");
    assert_eq!(cursor.applied_count, 1);
    assert_eq!(cursor.failed_event_id, Some(bad));
    assert!(cursor.parked_at.is_some(), "parked: {cursor:?}");
    let tx = source.begin().await.expect("begin");
    let pending = store.pending_events(&tx, pair).await.expect("pending");
    tx.rollback().await.expect("rollback");
    assert_eq!(
        pending.first(),
        Some(&bad),
        "the work from the event on stays"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_fakes() {
    tokio::spawn(async {
        let db = FakeDatabase::new();
        let events = InMemoryEventStore::new();
        let locker = InMemoryStreamLocker::with_database(StreamLockOptions::default(), &db);
        let store =
            InMemoryPerspectiveStore::new(&db, &events, &locker).with_upcasters(upcasters());
        folds_current_shapes_and_parks_at_an_event_an_upcaster_fails_on(db, store, events).await;
    })
    .await
    .expect("the spawned test body");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres() {
    tokio::spawn(async {
        let test_db = test_database().await;
        let pool = test_db.pool(4);
        lockstep_pg::migrate(&pool).await.expect("migrate");
        let db = PgDatabase::from_pool(pool);
        let store = PgPerspectiveStore::new().with_upcasters(upcasters());
        let events = PgEventStore::new(&db);
        folds_current_shapes_and_parks_at_an_event_an_upcaster_fails_on(db, store, events).await;
        drop(test_db);
    })
    .await
    .expect("the spawned test body");
}
