//! How many transactions a rewind uses (on the testkit fakes, real time): a short replay reads
//! and commits in one, a long or slow one ends its read transaction before it replays or
//! commits (`lockstep_worker::worker::SHORT_REPLAY_EVENTS`, `SHORT_REPLAY_TIME`), and a long
//! one reads each later page of its events in a transaction of its own (`rewind_page`: events
//! and bytes). Either way the rewound state is the fold of the stream
//! in event-id order and the lease is released.

use lockstep_core::perspective_store::prelude::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lockstep_core::{
    EventStore, ExpectedVersion, InstanceId, NewEvent, PageLimits, Pair, Perspective,
    PerspectiveName, PerspectiveRegistry, RecordedEvent, Result, StreamId, StreamLocker,
    Transaction as _, TransactionSource,
};
use lockstep_testkit::{
    FakeDatabase, FakeTransaction, InMemoryEventStore, InMemoryPerspectiveStore,
    InMemoryStreamLocker,
};
use lockstep_worker::worker::{SHORT_REPLAY_EVENTS, SHORT_REPLAY_TIME};
use lockstep_worker::{PairOutcome, PerspectiveWorker, WorkerOptions};
use uuid::Uuid;

/// The fake database, counting the transactions begun through it.
#[derive(Clone)]
struct Counting {
    db: FakeDatabase,
    begun: Arc<AtomicUsize>,
}

impl TransactionSource for Counting {
    type Tx = FakeTransaction;

    async fn begin(&self) -> Result<FakeTransaction> {
        self.begun.fetch_add(1, Ordering::SeqCst);
        self.db.begin().await
    }
}

/// Folds the events' numbers into a list; sleeps `delay` per event (a slow read model).
struct Fold {
    delay: Duration,
}

impl Perspective for Fold {
    type State = Vec<i64>;
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        "Fold"
    }

    fn apply(
        &self,
        state: &mut Vec<i64>,
        event: &RecordedEvent,
    ) -> std::result::Result<(), Self::Error> {
        std::thread::sleep(self.delay);
        state.push(event.payload.as_i64().unwrap_or(-1));
        Ok(())
    }
}

struct World {
    source: Counting,
    events: InMemoryEventStore,
    store: InMemoryPerspectiveStore,
    worker: PerspectiveWorker<Counting, InMemoryPerspectiveStore>,
    stream: StreamId,
}

fn fold() -> PerspectiveName {
    PerspectiveName::new("Fold").expect("valid")
}

/// A worker whose pair has applied `events` numbered events (100 per batch, a snapshot every
/// 100), then a
/// late event: at the start of the stream (`late_first`: no snapshot before it, the whole
/// stream replays) or just before the last event (one snapshot before it, a short replay).
async fn world(events: i64, late_first: bool, delay: Duration) -> World {
    world_with(events, late_first, delay, options()).await
}

/// The worker's options in [`world`]: a snapshot every 100 events, batches and rewind pages
/// of 100 events.
fn options() -> WorkerOptions {
    WorkerOptions::default()
        .with_snapshot_every(100)
        .with_max_events_per_claim(100)
        .with_rewind_page(page(1 << 24))
}

/// Rewind pages of 100 events and `bytes`.
fn page(bytes: u64) -> PageLimits {
    PageLimits::new(100, bytes).expect("page limits")
}

/// [`world`] with other options (the pair is caught up with them too).
async fn world_with(
    events: i64,
    late_first: bool,
    delay: Duration,
    options: WorkerOptions,
) -> World {
    let db = FakeDatabase::new();
    let source = Counting {
        db: db.clone(),
        begun: Arc::new(AtomicUsize::new(0)),
    };
    let events_store = InMemoryEventStore::new();
    let locker = InMemoryStreamLocker::with_database(Default::default(), &db);
    let store = InMemoryPerspectiveStore::new(&db, &events_store, &locker);
    let mut registry = PerspectiveRegistry::new();
    registry.register(Fold { delay }).expect("register");
    let worker = PerspectiveWorker::new(
        source.clone(),
        store.clone(),
        registry,
        options,
        InstanceId::random(),
        Some(Arc::new(locker) as Arc<dyn StreamLocker>),
    )
    .expect("worker");
    worker.register().await.expect("register");
    let stream = StreamId::new_v7();
    let ids = append(
        &db,
        &events_store,
        stream,
        (1..=events).map(|n| (Uuid::now_v7(), n)),
    )
    .await;
    for _ in 0..1_000 {
        if !worker.run_once().await.did_work() {
            break;
        }
    }
    let late = if late_first {
        Uuid::from_u128(0x0100_0000_0000_7000_8000_0000_0000_0001)
    } else {
        Uuid::from_u128(ids[ids.len() - 2].as_u128() + 1)
    };
    append(&db, &events_store, stream, [(late, -7)]).await;
    let tx = db.begin_now();
    store
        .request_rewind(&tx, &Pair::new(stream, fold()), Some(late))
        .await
        .expect("request");
    tx.commit().await.expect("commit");
    World {
        source,
        events: events_store,
        store,
        worker,
        stream,
    }
}

async fn append(
    db: &FakeDatabase,
    store: &InMemoryEventStore,
    stream: StreamId,
    events: impl IntoIterator<Item = (Uuid, i64)>,
) -> Vec<Uuid> {
    let (ids, new): (Vec<Uuid>, Vec<NewEvent>) = events
        .into_iter()
        .map(|(id, n)| {
            let event = NewEvent::new("Numbered", serde_json::json!(n))
                .and_then(|e| e.with_id(id))
                .expect("event");
            (id, event)
        })
        .unzip();
    let tx = db.begin_now();
    store
        .append(&tx, stream, ExpectedVersion::Any, &new)
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    ids
}

impl World {
    /// Rewinds the pair (from a spawned task, as a service would) and returns the outcome and
    /// the transactions it began.
    async fn rewind(self: &Arc<Self>) -> (PairOutcome, usize) {
        let before = self.source.begun.load(Ordering::SeqCst);
        let world = Arc::clone(self);
        let outcome = tokio::spawn(async move { world.worker.rewind(world.stream, &fold()).await })
            .await
            .expect("no panic")
            .expect("rewind");
        (outcome, self.source.begun.load(Ordering::SeqCst) - before)
    }

    /// The committed state against the fold of the stream in event-id order, and the lease.
    async fn check(&self) {
        let mut events = self.events.committed(self.stream);
        events.sort_by_key(|e| e.event_id);
        let expected: Vec<i64> = events.iter().filter_map(|e| e.payload.as_i64()).collect();
        let state: Vec<i64> = self
            .store
            .committed_state(self.stream, &fold())
            .map(|s| serde_json::from_value(s).expect("a list"))
            .expect("a state");
        assert_eq!(state, expected);
        let tx = self.source.db.begin_now();
        let cursor = self
            .store
            .cursor(&tx, &Pair::new(self.stream, fold()))
            .await
            .expect("cursor")
            .expect("a cursor");
        assert!(cursor.rewind.is_none(), "the request is cleared");
        assert!(cursor.lease.is_unlocked(), "the lease is released");
    }
}

#[tokio::test]
async fn a_rewind_from_a_recent_snapshot_reads_and_commits_in_one_transaction() {
    let world = Arc::new(world(250, false, Duration::ZERO).await);
    let (outcome, begun) = world.rewind().await;
    assert!(
        matches!(outcome, PairOutcome::Rewound { from_snapshot: true, replayed } if replayed < 100),
        "{outcome:?}"
    );
    assert_eq!(begun, 1, "the read's transaction serves the commit");
    world.check().await;
}

#[tokio::test]
async fn a_rewind_that_replays_more_than_the_short_bound_commits_in_a_transaction_of_its_own() {
    let events = SHORT_REPLAY_EVENTS as i64 + 50;
    let world = Arc::new(world(events, true, Duration::ZERO).await);
    let (outcome, begun) = world.rewind().await;
    let PairOutcome::Rewound {
        from_snapshot: false,
        replayed,
    } = outcome
    else {
        panic!("{outcome:?}");
    };
    assert!(replayed > SHORT_REPLAY_EVENTS, "{replayed}");
    // The first page's read, one read per later page of 100, and the commit: each a
    // transaction of its own.
    assert_eq!(
        begun,
        replayed.div_ceil(100) + 1,
        "the read ends before the replay"
    );
    world.check().await;
}

#[tokio::test]
async fn a_long_rewind_reads_and_replays_its_events_page_by_page() {
    // 2 345 events and the late one at the start: a full replay, in pages of 100.
    let world = Arc::new(world(2_345, true, Duration::ZERO).await);
    let (outcome, begun) = world.rewind().await;
    assert!(
        matches!(
            outcome,
            PairOutcome::Rewound {
                from_snapshot: false,
                replayed: 2_346
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(
        begun,
        24 + 1,
        "24 pages read one after another, then the commit"
    );
    world.check().await;
}

#[tokio::test]
async fn a_paged_rewind_dropped_between_pages_commits_nothing_and_the_next_one_completes() {
    // 600 events at 1 ms each, pages of 100: dropped 150 ms in, the replay is a page or two
    // along, with the next page's read in flight.
    let world = Arc::new(world(600, true, Duration::from_millis(1)).await);
    let cursor = |world: Arc<World>| async move {
        let tx = world.source.db.begin_now();
        world
            .store
            .cursor(&tx, &Pair::new(world.stream, fold()))
            .await
            .expect("cursor")
            .expect("a cursor")
    };
    let before = cursor(Arc::clone(&world)).await;
    let dropped = Arc::clone(&world);
    let rewind = tokio::spawn(async move {
        tokio::time::timeout(
            Duration::from_millis(150),
            dropped.worker.rewind(dropped.stream, &fold()),
        )
        .await
    })
    .await
    .expect("no panic");
    assert!(rewind.is_err(), "still replaying when dropped: {rewind:?}");
    let after = cursor(Arc::clone(&world)).await;
    assert_eq!(after.revision, before.revision, "nothing committed");
    assert_eq!(after.rewind, before.rewind, "still requested");
    // The next rewind (the same instance) replays every page and commits the fold.
    let (outcome, _) = world.rewind().await;
    assert!(
        matches!(
            outcome,
            PairOutcome::Rewound {
                from_snapshot: false,
                replayed: 601
            }
        ),
        "{outcome:?}"
    );
    world.check().await;
}

#[tokio::test]
async fn a_rewind_page_holds_its_first_event_whatever_its_bytes() {
    // One byte per page: every page holds one event, and the replay still gets through.
    let world = Arc::new(
        world_with(
            30,
            true,
            Duration::ZERO,
            options().with_rewind_page(page(1)),
        )
        .await,
    );
    let (outcome, begun) = world.rewind().await;
    assert!(
        matches!(
            outcome,
            PairOutcome::Rewound {
                from_snapshot: false,
                replayed: 31
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(begun, 31 + 1, "a page per event, then the commit");
    world.check().await;
}

#[tokio::test]
async fn a_page_cut_by_its_bytes_makes_the_next_ask_for_one_event_more_the_first_page_too() {
    // Pages of 100 events but 5 bytes (the payloads are numbers of one or two digits): a few
    // events a page. The first page is read with the configured limits; the page after a cut
    // one asks for one event more than it held — the first page's cut counts too.
    let world = Arc::new(
        world_with(
            30,
            true,
            Duration::ZERO,
            options().with_rewind_page(page(5)),
        )
        .await,
    );
    let (outcome, _) = world.rewind().await;
    assert!(
        matches!(
            outcome,
            PairOutcome::Rewound {
                from_snapshot: false,
                replayed: 31
            }
        ),
        "{outcome:?}"
    );
    let asked: Vec<usize> = world
        .store
        .rewind_page_requests(&Pair::new(world.stream, fold()))
        .iter()
        .map(|p| p.events)
        .collect();
    assert!(asked.len() > 5, "read in pages: {asked:?}");
    assert_eq!(asked[0], 100, "the first page with the configured limits");
    // At most five one-digit numbers fit: the second read asks for one more than the first
    // page held, and no read asks for more than twice what fits (a full page doubles).
    assert!(asked[1] <= 6, "the first page's cut is used: {asked:?}");
    assert!(
        asked[1..].iter().all(|&n| n <= 10),
        "after a cut page, one event more than it held: {asked:?}"
    );
    world.check().await;
}

#[tokio::test]
async fn a_short_rewind_whose_replay_outlasts_the_short_time_commits_in_a_transaction_of_its_own() {
    // A few events replayed, each slower than the whole bound.
    let world = Arc::new(world(5, false, SHORT_REPLAY_TIME + Duration::from_millis(10)).await);
    let (outcome, begun) = world.rewind().await;
    assert!(
        matches!(outcome, PairOutcome::Rewound { replayed, .. } if replayed <= SHORT_REPLAY_EVENTS),
        "{outcome:?}"
    );
    assert_eq!(
        begun, 2,
        "the read's transaction ended after the slow replay"
    );
    world.check().await;
}

/// ADR 0035: a JSON perspective's first read runs while the lease is acquired, so what it read
/// may be older than the lease. Here the lease's acquire takes 300 ms; meanwhile a late event
/// arrives inside the replayed range and another instance rewinds the pair with it, commits
/// and releases. The first worker then gets the lease with a read that lacks the event: its
/// fenced commit is refused (the cursor moved on), the rewind ends as a lost race, and the
/// committed state is the other instance's — the fold of every event — with the request
/// cleared and the lease released. From spawned tasks, with the concrete types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_read_older_than_its_lease_never_commits_over_a_newer_state() {
    let db = FakeDatabase::new();
    let source = Counting {
        db: db.clone(),
        begun: Arc::new(AtomicUsize::new(0)),
    };
    let events = InMemoryEventStore::new();
    let locker = InMemoryStreamLocker::with_database(Default::default(), &db);
    let store = InMemoryPerspectiveStore::new(&db, &events, &locker);
    let (slow_locker, faults) = lockstep_testkit::FaultyStreamLocker::new(locker.clone());
    let worker_with = |locker: Arc<dyn StreamLocker>| {
        let mut registry = PerspectiveRegistry::new();
        registry
            .register(Fold {
                delay: Duration::ZERO,
            })
            .expect("register");
        PerspectiveWorker::new(
            source.clone(),
            store.clone(),
            registry,
            options(),
            InstanceId::random(),
            Some(locker),
        )
        .expect("worker")
    };
    let slow = Arc::new(worker_with(Arc::new(slow_locker)));
    let other = Arc::new(worker_with(Arc::new(locker.clone())));
    slow.register().await.expect("register");
    let stream = StreamId::new_v7();
    let ids = append(&db, &events, stream, (1..=300).map(|n| (Uuid::now_v7(), n))).await;
    for _ in 0..100 {
        if !other.run_once().await.did_work() {
            break;
        }
    }
    let pair = Pair::new(stream, fold());
    let request = |from: Uuid| {
        let (db, store, pair) = (db.clone(), store.clone(), pair.clone());
        async move {
            let tx = db.begin_now();
            assert!(
                store
                    .request_rewind(&tx, &pair, Some(from))
                    .await
                    .expect("request")
            );
            tx.commit().await.expect("commit");
        }
    };
    // A late event before the last one: a short rewind from the last snapshot.
    let late = Uuid::from_u128(ids[ids.len() - 2].as_u128() + 1);
    append(&db, &events, stream, [(late, -7)]).await;
    request(late).await;

    faults.set_latency(Duration::from_millis(300));
    let rewinding = {
        let slow = Arc::clone(&slow);
        tokio::spawn(async move { slow.rewind(stream, &fold()).await })
    };
    // While the slow worker waits for its lease (its read done): another late event inside
    // the range it read, and the other instance's rewind with it.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let later = Uuid::from_u128(ids[ids.len() - 3].as_u128() + 1);
    append(&db, &events, stream, [(later, -8)]).await;
    request(later).await;
    let done = {
        let other = Arc::clone(&other);
        tokio::spawn(async move { other.rewind(stream, &fold()).await })
            .await
            .expect("no panic")
            .expect("rewind")
    };
    assert!(
        matches!(done, PairOutcome::Rewound { .. }),
        "the other instance rewinds first: {done:?}"
    );
    let outcome = rewinding.await.expect("no panic").expect("rewind");
    faults.clear();
    // A lost race (the commit refused), not "nothing to do": the read was made before the
    // other instance's commit, while the lease was being acquired.
    assert!(
        matches!(
            outcome,
            PairOutcome::Skipped(lockstep_worker::SkipReason::Busy)
        ),
        "the stale read's commit is refused: {outcome:?}"
    );

    let mut all = events.committed(stream);
    all.sort_by_key(|e| e.event_id);
    let expected: Vec<i64> = all.iter().filter_map(|e| e.payload.as_i64()).collect();
    let state: Vec<i64> = store
        .committed_state(stream, &fold())
        .map(|s| serde_json::from_value(s).expect("a list"))
        .expect("a state");
    assert_eq!(
        state, expected,
        "the fold of every event, the late ones in place"
    );
    let tx = db.begin_now();
    let cursor = store
        .cursor(&tx, &pair)
        .await
        .expect("cursor")
        .expect("a cursor");
    assert!(cursor.rewind.is_none(), "the request is cleared");
    assert!(cursor.lease.is_unlocked(), "the lease is released");
}
