//! Table perspectives on the testkit fakes (issue 20): `apply` writes an application table
//! ([`FakeTable`]) in the worker's fake transaction, so each event's row lands exactly once with
//! the cursor; a failing event fails its pair alone with the rows before it kept; a late event
//! rewinds the pair by resetting its rows and replaying; a purge resets the rows; a registry
//! built for another transaction type is refused. Each entry point is called from inside
//! `tokio::spawn`, with the concrete fake types, as an application's test would.

use lockstep_core::Pair;
use lockstep_core::perspective_store::prelude::*;
use std::sync::Arc;

use lockstep_core::Transaction as _;
use lockstep_core::{
    EventStore, ExpectedVersion, InstanceId, NewEvent, PerspectiveName, PerspectiveRegistry,
    RecordedEvent, StreamId, StreamLockOptions, StreamLocker, TablePerspective, Upcasters,
};
use lockstep_testkit::{
    FakeDatabase, FakeTable, FakeTransaction, InMemoryEventStore, InMemoryPerspectiveStore,
    InMemoryStreamLocker,
};
use lockstep_worker::{PairErrorKind, PairOutcome, PerspectiveWorker, PurgeOutcome, WorkerOptions};
use uuid::Uuid;

/// One row per event, keyed by (stream, event): an event applied twice would show as a count
/// above one. Refuses the number 13.
#[derive(Clone, Default)]
struct Seen {
    rows: FakeTable<(StreamId, Uuid), (i64, u32)>,
}

#[derive(Debug, thiserror::Error)]
enum SeenError {
    #[error("13 is refused")]
    Thirteen,
    #[error(transparent)]
    Store(#[from] lockstep_core::Error),
}

impl TablePerspective<FakeTransaction> for Seen {
    type Error = SeenError;

    fn name(&self) -> &str {
        "Seen"
    }

    async fn apply(&self, tx: &FakeTransaction, event: &RecordedEvent) -> Result<(), SeenError> {
        let n = event.payload.as_i64().unwrap_or(-1);
        if n == 13 {
            return Err(SeenError::Thirteen);
        }
        self.rows
            .update(tx, (event.stream_id, event.event_id), |row| {
                Some(row.map_or((n, 1), |(n, times)| (n, times + 1)))
            })?;
        Ok(())
    }

    async fn reset(&self, tx: &FakeTransaction, stream_id: StreamId) -> Result<(), SeenError> {
        self.rows.delete_where(tx, |(s, _), _| *s == stream_id)?;
        Ok(())
    }
}

impl Seen {
    /// The stream's numbers in event-id order, each with how many times it was applied.
    fn of(&self, stream: StreamId) -> Vec<(i64, u32)> {
        self.rows
            .rows()
            .into_iter()
            .filter(|((s, _), _)| *s == stream)
            .map(|(_, row)| row)
            .collect()
    }
}

fn seen() -> PerspectiveName {
    PerspectiveName::new("Seen").expect("valid")
}

type Worker = PerspectiveWorker<FakeDatabase, InMemoryPerspectiveStore>;

struct World {
    db: FakeDatabase,
    events: InMemoryEventStore,
    store: InMemoryPerspectiveStore,
    worker: Arc<Worker>,
    seen: Seen,
}

impl World {
    async fn new() -> World {
        World::with_options(WorkerOptions::default()).await
    }

    async fn with_options(options: WorkerOptions) -> World {
        World::with_store(options, Upcasters::new()).await
    }

    /// A world whose perspective store reads through `upcasters`.
    async fn with_store(options: WorkerOptions, upcasters: Upcasters) -> World {
        let db = FakeDatabase::new();
        let events = InMemoryEventStore::new();
        let locker = InMemoryStreamLocker::with_database(StreamLockOptions::default(), &db);
        let store = InMemoryPerspectiveStore::new(&db, &events, &locker).with_upcasters(upcasters);
        let seen = Seen::default();
        let mut registry = PerspectiveRegistry::new();
        registry
            .register_table::<FakeTransaction, _>(seen.clone())
            .expect("register");
        let worker = PerspectiveWorker::new(
            db.clone(),
            store.clone(),
            registry,
            options,
            InstanceId::random(),
            Some(Arc::new(locker) as Arc<dyn StreamLocker>),
        )
        .expect("worker");
        worker.register().await.expect("register");
        World {
            db,
            events,
            store,
            worker: Arc::new(worker),
            seen,
        }
    }

    async fn append(&self, stream: StreamId, events: &[(Uuid, i64)]) {
        let new: Vec<NewEvent> = events
            .iter()
            .map(|(id, n)| {
                NewEvent::new("Numbered", serde_json::json!(n))
                    .and_then(|e| e.with_id(*id))
                    .expect("event")
            })
            .collect();
        let tx = self.db.begin_now();
        self.events
            .append(&tx, stream, ExpectedVersion::Any, &new)
            .await
            .expect("append");
        tx.commit().await.expect("commit");
    }

    async fn append_numbers(&self, stream: StreamId, numbers: &[i64]) -> Vec<Uuid> {
        let events: Vec<(Uuid, i64)> = numbers.iter().map(|n| (Uuid::now_v7(), *n)).collect();
        self.append(stream, &events).await;
        events.into_iter().map(|(id, _)| id).collect()
    }

    /// Cycles in a spawned task (as a service runs its worker) until nothing is left to do.
    async fn drain(&self) {
        let worker = Arc::clone(&self.worker);
        tokio::spawn(async move {
            for _ in 0..50 {
                let report = worker.run_once().await;
                assert!(report.errors.is_empty(), "{:?}", report.errors);
                if !report.did_work() && report.failed == 0 {
                    return;
                }
            }
            panic!("the worker did not go idle");
        })
        .await
        .expect("the worker task");
    }

    /// The stream's rows, in event-id order.
    fn rows_in_event_order(&self, stream: StreamId) -> Vec<(i64, u32)> {
        self.seen
            .rows
            .rows()
            .into_iter()
            .filter(|((s, _), _)| *s == stream)
            .map(|((_, id), row)| (id, row))
            .collect::<std::collections::BTreeMap<_, _>>()
            .into_values()
            .collect()
    }

    async fn cursor(&self, stream: StreamId) -> lockstep_core::Cursor {
        let tx = self.db.begin_now();
        let cursor = self
            .store
            .cursor(&tx, &Pair::new(stream, seen()))
            .await
            .expect("read");
        tx.rollback().await.expect("rollback");
        cursor.expect("a cursor")
    }
}

fn once(numbers: &[i64]) -> Vec<(i64, u32)> {
    numbers.iter().map(|n| (*n, 1)).collect()
}

#[tokio::test]
async fn every_event_writes_its_row_once_with_the_cursor_in_batches() {
    let world = World::new().await;
    let streams: Vec<StreamId> = (0..12).map(|_| StreamId::new_v7()).collect();
    for (i, stream) in streams.iter().enumerate() {
        let i = i as i64;
        world.append_numbers(*stream, &[i, i + 100, i + 200]).await;
    }
    world.drain().await;
    for (i, stream) in streams.iter().enumerate() {
        let i = i as i64;
        assert_eq!(world.seen.of(*stream), once(&[i, i + 100, i + 200]));
        let cursor = world.cursor(*stream).await;
        assert_eq!(cursor.applied_count, 3);
        assert!(cursor.latest_snapshot.is_none(), "no snapshots of tables");
    }
    // More events later: only they are applied.
    world.append_numbers(streams[0], &[7]).await;
    world.drain().await;
    assert_eq!(world.seen.of(streams[0]), once(&[0, 100, 200, 7]));
}

#[tokio::test]
async fn a_failing_event_fails_its_pair_alone_keeping_the_rows_before_it() {
    let world = World::new().await;
    let healthy = StreamId::new_v7();
    let poisoned = StreamId::new_v7();
    world.append_numbers(healthy, &[1, 2, 3]).await;
    let ids = world.append_numbers(poisoned, &[4, 5, 13, 6]).await;
    let worker = Arc::clone(&world.worker);
    let report = tokio::spawn(async move { worker.run_once().await })
        .await
        .expect("task");
    assert_eq!(report.failed, 1, "{report:?}");
    let failure = &report.failures[0];
    assert_eq!(failure.pair, Pair::new(poisoned, seen()));
    assert_eq!(
        (
            failure.error.kind(),
            failure.error.event_id(),
            failure.error.message()
        ),
        (PairErrorKind::Apply, Some(ids[2]), "13 is refused")
    );
    // The batch rolled back when the poisoned pair failed; the healthy pair is served by the
    // next cycle at the latest.
    world.drain().await;
    assert_eq!(world.seen.of(healthy), once(&[1, 2, 3]));
    assert_eq!(
        world.seen.of(poisoned),
        once(&[4, 5]),
        "the rows before the failure"
    );
    let cursor = world.cursor(poisoned).await;
    assert_eq!(cursor.applied_count, 2);
    assert_eq!(cursor.error, Some(failure.error.to_string()));
    assert!(cursor.retry_at.is_some(), "backed off");
    assert_eq!(
        cursor.failed_event_id,
        Some(ids[2]),
        "the failing event is on record (what `perspectives parked` shows)"
    );

    // The operator skips the poison: the rest is applied, once.
    let tx = world.db.begin_now();
    assert!(
        world
            .store
            .skip_event(
                &tx,
                &Pair::new(poisoned, seen()),
                ids[2],
                "refused by design"
            )
            .await
            .expect("skip")
    );
    tx.commit().await.expect("commit");
    world.drain().await;
    assert_eq!(world.seen.of(poisoned), once(&[4, 5, 6]));
}

#[tokio::test]
async fn a_late_event_resets_the_streams_rows_and_replays_them_in_order() {
    let world = World::new().await;
    let stream = StreamId::new_v7();
    let ids = world.append_numbers(stream, &[10, 20, 30]).await;
    world.drain().await;
    // An event whose id sorts between the first two (an import, a replica).
    let late = Uuid::from_u128(ids[0].as_u128() + 1);
    assert!(late < ids[1]);
    world.append(stream, &[(late, 15)]).await;
    world.drain().await;
    assert_eq!(world.seen.of(stream).len(), 4);
    let rows = world.rows_in_event_order(stream);
    assert_eq!(
        rows,
        once(&[10, 15, 20, 30]),
        "in event-id order, each once"
    );
    let cursor = world.cursor(stream).await;
    assert!(cursor.rewind.is_none(), "the request is cleared");
    assert_eq!(cursor.applied_count, 4);

    // process_pair and an explicit rewind from a spawned task, as an operator's endpoint would.
    let worker = Arc::clone(&world.worker);
    let tx = world.db.begin_now();
    world
        .store
        .request_rewind(&tx, &Pair::new(stream, seen()), None)
        .await
        .expect("request");
    tx.commit().await.expect("commit");
    let outcome = tokio::spawn(async move { worker.process_pair(stream, &seen()).await })
        .await
        .expect("task")
        .expect("processed");
    assert!(
        matches!(
            outcome,
            PairOutcome::Rewound {
                replayed: 4,
                from_snapshot: false
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(world.seen.of(stream), once(&[10, 15, 20, 30]));
}

#[tokio::test]
async fn a_table_rewind_replays_page_by_page_in_its_one_transaction() {
    // Pages of two events: the late event's rewind reads four pages in the rewind's
    // transaction, and every row is written once, in event-id order.
    let page = lockstep_core::PageLimits::new(2, 1 << 20).expect("page limits");
    let world = World::with_options(WorkerOptions::default().with_rewind_page(page)).await;
    let stream = StreamId::new_v7();
    let ids = world
        .append_numbers(stream, &[10, 20, 30, 40, 50, 60, 70])
        .await;
    world.drain().await;
    world
        .append(stream, &[(Uuid::from_u128(ids[0].as_u128() + 1), 15)])
        .await;
    world.drain().await;
    let rows = world.rows_in_event_order(stream);
    assert_eq!(rows, once(&[10, 15, 20, 30, 40, 50, 60, 70]));
    let cursor = world.cursor(stream).await;
    assert!(cursor.rewind.is_none(), "the request is cleared");
    assert_eq!(cursor.applied_count, 8);
}

#[tokio::test]
async fn a_table_rewind_page_cut_by_its_bytes_makes_the_next_ask_for_one_event_more() {
    // Pages of 100 events but 5 bytes (payloads of two digits): two events a page. After each
    // cut page the next read asks for one event more than it got, not for 100 again (rows read
    // past a cut are read for nothing).
    let page = lockstep_core::PageLimits::new(100, 5).expect("page limits");
    let world = World::with_options(WorkerOptions::default().with_rewind_page(page)).await;
    let stream = StreamId::new_v7();
    let numbers: Vec<i64> = (20..50).collect(); // no 13: `Seen` refuses it
    let ids = world.append_numbers(stream, &numbers).await;
    world.drain().await;
    world
        .append(stream, &[(Uuid::from_u128(ids[0].as_u128() + 1), 5)])
        .await;
    world.drain().await;
    let cursor = world.cursor(stream).await;
    assert!(cursor.rewind.is_none(), "the request is cleared");
    assert_eq!(cursor.applied_count, 31);
    let asked: Vec<usize> = world
        .store
        .rewind_page_requests(&Pair::new(stream, seen()))
        .iter()
        .map(|p| p.events)
        .collect();
    assert!(asked.len() > 5, "read in pages: {asked:?}");
    assert_eq!(asked[0], 100, "the first page with the configured limits");
    assert!(
        asked[1..].iter().all(|&n| n <= 4),
        "after a cut page, one event more than it held: {asked:?}"
    );
}

#[tokio::test]
async fn a_purge_resets_the_rows_with_the_cursor() {
    let world = World::new().await;
    let stream = StreamId::new_v7();
    world.append_numbers(stream, &[1, 2]).await;
    world.drain().await;
    let worker = Arc::clone(&world.worker);
    let outcome = tokio::spawn(async move { worker.purge(stream, &seen()).await })
        .await
        .expect("task")
        .expect("purged");
    assert_eq!(outcome, PurgeOutcome::Purged);
    assert!(
        world.seen.of(stream).is_empty(),
        "the rows went with the cursor"
    );
}

#[tokio::test]
async fn a_registry_for_another_transaction_type_is_refused() {
    struct Other;
    impl TablePerspective<()> for Other {
        type Error = std::convert::Infallible;
        fn name(&self) -> &str {
            "Other"
        }
        async fn apply(&self, _: &(), _: &RecordedEvent) -> Result<(), Self::Error> {
            Ok(())
        }
        async fn reset(&self, _: &(), _: StreamId) -> Result<(), Self::Error> {
            Ok(())
        }
    }
    let db = FakeDatabase::new();
    let events = InMemoryEventStore::new();
    let locker = InMemoryStreamLocker::with_database(StreamLockOptions::default(), &db);
    let store = InMemoryPerspectiveStore::new(&db, &events, &locker);
    let mut registry = PerspectiveRegistry::new();
    registry.register_table::<(), _>(Other).expect("register");
    assert!(
        registry.register_table::<(), _>(Other).is_err(),
        "names are unique"
    );
    let err = PerspectiveWorker::new(
        db,
        store,
        registry,
        WorkerOptions::default(),
        InstanceId::random(),
        None,
    )
    .expect_err("refused");
    assert_eq!(err.kind(), lockstep_core::ErrorKind::InvalidInput);
    assert!(err.to_string().contains("Other"), "{err}");
}

/// A table perspective's rebuild that fails at an event stores that event with the failure,
/// as its normal path does, so that an operator can skip it; the skip lets the rebuild go on,
/// each row written once. Before, the rewind path stored the failure without its event.
#[tokio::test]
async fn a_rebuild_that_fails_at_an_event_stores_that_event() {
    let world = World::new().await;
    let stream = StreamId::new_v7();
    world.append_numbers(stream, &[1, 2]).await;
    world.drain().await;
    // The worker is stopped: an event the perspective refuses is appended, then a rebuild.
    let ids = world.append_numbers(stream, &[13, 3]).await;
    lockstep_worker::life::rebuild(&world.db, &world.store, &seen())
        .await
        .expect("rebuild");
    let worker = Arc::clone(&world.worker);
    let report = tokio::spawn(async move { worker.run_once().await })
        .await
        .expect("task");
    assert_eq!(report.failed, 1, "{report:?}");
    let error = &report.failures[0].error;
    assert_eq!(
        (error.kind(), error.event_id()),
        (PairErrorKind::Apply, Some(ids[0]))
    );
    assert!(
        error
            .to_string()
            .starts_with("the perspective failed during replay: apply failed on event"),
        "{error}"
    );
    let cursor = world.cursor(stream).await;
    assert_eq!(cursor.error, Some(error.to_string()));
    assert!(cursor.rewind.is_some(), "the request stays: {cursor:?}");
    assert_eq!(
        cursor.failed_event_id,
        Some(ids[0]),
        "the failing event is on record: {cursor:?}"
    );
    assert_eq!(world.seen.of(stream), once(&[1, 2]), "nothing written");

    let tx = world.db.begin_now();
    assert!(
        world
            .store
            .skip_event(&tx, &Pair::new(stream, seen()), ids[0], "refused by design")
            .await
            .expect("skip")
    );
    tx.commit().await.expect("commit");
    world.drain().await;
    assert_eq!(world.rows_in_event_order(stream), once(&[1, 2, 3]));
    assert!(world.cursor(stream).await.rewind.is_none());
}

/// Version 1 of `Numbered` was `{"n": n}`; version 2 is the bare number that `Seen` reads. The
/// upcaster fails on a version 1 payload without a whole number.
fn unwrapping_upcasters() -> Upcasters {
    Upcasters::new()
        .with("Numbered", 1, |payload| {
            let n = payload["n"].as_i64().ok_or("no whole number")?;
            Ok(serde_json::json!(n))
        })
        .expect("one upcaster")
}

/// A stream of a version 1 event (`n`), one the upcaster fails on, and a version 2 event;
/// returns their ids.
async fn old_bad_new(world: &World, stream: StreamId, n: i64) -> Vec<Uuid> {
    let events = vec![
        NewEvent::new("Numbered", serde_json::json!({ "n": n })).expect("version 1"),
        NewEvent::new("Numbered", serde_json::json!({ "n": "many" })).expect("version 1"),
        NewEvent::new("Numbered", serde_json::json!(n + 1))
            .and_then(|e| e.with_schema_version(2))
            .expect("version 2"),
    ];
    let ids = events.iter().map(NewEvent::event_id).collect();
    let tx = world.db.begin_now();
    world
        .events
        .append(&tx, stream, ExpectedVersion::Any, &events)
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    ids
}

#[tokio::test]
async fn an_event_an_upcaster_fails_on_parks_its_table_pair_after_the_rows_before_it() {
    let options = WorkerOptions::default().with_park_after_failures(Some(1));
    let world = World::with_store(options, unwrapping_upcasters()).await;
    // One pair now (the one-pair claim).
    let alone = StreamId::new_v7();
    let ids = old_bad_new(&world, alone, 4).await;
    let worker = Arc::clone(&world.worker);
    let outcome = tokio::spawn(async move { worker.process_pair(alone, &seen()).await })
        .await
        .expect("task")
        .expect("process_pair");
    let PairOutcome::Failed { error } = outcome else {
        panic!("expected a failure at the unreadable event, got {outcome:?}");
    };
    assert_eq!(
        (error.kind(), error.event_id()),
        (PairErrorKind::UnreadableEvent, Some(ids[1]))
    );
    assert_eq!(world.seen.of(alone), once(&[4]), "the row before it");
    let cursor = world.cursor(alone).await;
    assert_eq!(cursor.applied_count, 1);
    assert_eq!(cursor.failed_event_id, Some(ids[1]));
    assert!(cursor.parked_at.is_some(), "parked");

    // Through a batch: the same.
    let batched = StreamId::new_v7();
    let ids = old_bad_new(&world, batched, 7).await;
    world.drain().await;
    assert_eq!(world.seen.of(batched), once(&[7]), "the row before it");
    let cursor = world.cursor(batched).await;
    assert_eq!(cursor.applied_count, 1);
    assert_eq!(cursor.failed_event_id, Some(ids[1]));
    assert!(cursor.parked_at.is_some(), "parked");
    let error = cursor.error.unwrap_or_default();
    assert!(error.contains("could not be upcast"), "{error}");
}
