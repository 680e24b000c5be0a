//! The perspective-store conformance suite: the work queue (fan-out on append, catch-up on
//! registration), claiming (order, limit, exclusivity, leases), the commit (state, cursor,
//! work, compare-and-set, fence), late arrivals and rewind requests (earliest trigger,
//! debounce), snapshots, failures, purge and cursor rows; batches: the claim (requested
//! perspectives only, the `pairs` / `events_per_pair` / `events` / `bytes` bounds, disjoint
//! batches without waiting, leased, backing-off and parked pairs left out, rotating positions,
//! the `scan` bound, late arrivals and rewind requests as rewinds), the batch commit (per-entry
//! refusals, a commit with a failure, all-or-nothing on bad input), parking (`parked_pairs`,
//! `unpark`, a rewind request as a retry), a successful commit clearing the failure, and
//! skipped events, paging through states and what is not applied up to an event (`states`,
//! `pending_through`), a perspective's life (retire keeping or dropping its states, register
//! again, rebuild), rewinds' progress and catch-up rates — each case a behaviour a user of the perspective worker would notice.
//!
//! Every case uses fresh stream ids and perspective names, so the suite can run against a
//! shared database (perspectives registered by earlier cases only add work the cases never look
//! at). A fresh perspective still gets work on every stream already there (catch-up): the batch
//! cases first park those pairs of their perspectives, so that a batch hands out only the
//! case's own pairs, and give their batches a `scan` no database reaches. Transactions that end in an error are **committed** afterwards where the case checks
//! that "nothing was written": a refused call leaves its transaction usable. Expiry is waited
//! out with `tokio::time::sleep` past the locker's lock timeout (instant on the fakes with
//! paused time; give a database fixture a lock timeout of a second or two). The debounce
//! window is exercised with zero against an hour, never with a sleep.
//!
//! Run it with [`perspective_store_conformance!`](crate::perspective_store_conformance) (one
//! test per case), or call the cases or [`run_all`] yourself.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::CursorRows;
use lockstep_core::json::MAX_DEPTH;
use lockstep_core::perspective_store::DEFAULT_KEEP_SNAPSHOTS;
use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    AcquireOutcome, BatchClaim, BatchCommitted, BatchEntry, BatchLimits, Claim, ClaimedBatch,
    ClaimedWork, Cursor, ErrorKind, EventStore, ExpectedVersion, InstanceId, LeaseEpoch, LeaseId,
    LockReason, NewEvent, PageLimits, Pair, PairFailure, PerspectiveName, PerspectiveStore,
    ProgressReport, Rebuild, RecordedEvent, Registration, Release, RetireStates, Retired,
    RewindDebounce, RewindProgress, SkippedEvent, StateCommit, StreamId, StreamLease,
    StreamLockAdmin, StreamLocker, TransactionSource, ValidationError,
};
use uuid::Uuid;

use super::{begin, commit, rollback};

/// What the suite needs from a backend: the store under test, an event store over the same
/// storage to append with, owned transactions of the type both run on, and a stream locker
/// (with its admin view) over the same cursor rows for the lease cases.
pub trait PerspectiveStoreFixture: Send + Sync + 'static {
    /// An owned, open transaction.
    type Tx: lockstep_core::Transaction;
    /// The transaction source.
    type Source: TransactionSource<Tx = Self::Tx>;
    /// The store under test. It keeps [`DEFAULT_KEEP_SNAPSHOTS`] snapshots per pair.
    type Store: PerspectiveStore<Self::Tx> + CursorRows<Self::Tx> + 'static;
    /// The event store whose appends feed the store's work queue.
    type Events: EventStore<Self::Tx> + 'static;
    /// A locker over the same cursor rows (a concrete type, or `dyn StreamLocker`).
    type Locker: StreamLocker + ?Sized;
    /// The admin view over the same cursor rows (normally the locker itself).
    type Admin: StreamLockAdmin + ?Sized;

    /// Where the suite's transactions come from (each on its own connection, for a database).
    fn source(&self) -> &Self::Source;

    /// The store under test.
    fn store(&self) -> &Self::Store;

    /// The event store to append with.
    fn events(&self) -> &Self::Events;

    /// The locker. Its `options().lock_timeout()` is how long the suite waits for a lease to
    /// expire, and a lease must stay live for a few statements: on a database, a second or two.
    fn locker(&self) -> &Self::Locker;

    /// The admin view (force-release).
    fn admin(&self) -> &Self::Admin;
}

/// A fixture made of its parts: a source, a store, an event store and a locker (which is also
/// the admin view) that share storage — the in-memory store on a
/// [`FakeDatabase`](crate::FakeDatabase), or a Postgres store on a pool's source.
#[derive(Debug, Clone)]
pub struct Fixture<S, St, E, L> {
    /// Where transactions come from.
    pub source: S,
    /// The store under test.
    pub store: St,
    /// The event store to append with.
    pub events: E,
    /// The locker over the same cursor rows, and its admin view.
    pub locker: L,
}

impl<S, St, E, L> Fixture<S, St, E, L> {
    /// A fixture of `store` fed by `events`, on transactions of `source`, with `locker` over
    /// the same cursor rows.
    pub fn new(source: S, store: St, events: E, locker: L) -> Self {
        Fixture {
            source,
            store,
            events,
            locker,
        }
    }
}

impl<S, St, E, L> PerspectiveStoreFixture for Fixture<S, St, E, L>
where
    S: TransactionSource + 'static,
    St: PerspectiveStore<S::Tx> + CursorRows<S::Tx> + 'static,
    E: EventStore<S::Tx> + 'static,
    L: StreamLocker + StreamLockAdmin + 'static,
{
    type Tx = S::Tx;
    type Source = S;
    type Store = St;
    type Events = E;
    type Locker = L;
    type Admin = L;

    fn source(&self) -> &S {
        &self.source
    }

    fn store(&self) -> &St {
        &self.store
    }

    fn events(&self) -> &E {
        &self.events
    }

    fn locker(&self) -> &L {
        &self.locker
    }

    fn admin(&self) -> &L {
        &self.locker
    }
}

/// A debounce window (and cap) no case waits out.
const HOUR: RewindDebounce = RewindDebounce {
    window: Duration::from_secs(3600),
    max_delay: Duration::from_secs(3600),
};
/// More pairs than any case's database holds.
const ALL_PAIRS: usize = 1_000_000;
/// More events than any case appends to one stream.
const ALL_EVENTS: usize = 10_000;

/// A perspective name of this case's own.
fn name(label: &str) -> PerspectiveName {
    PerspectiveName::new(format!("{label}-{}", Uuid::new_v4().simple())).expect("valid name")
}

/// `n` fresh event ids, in event-id order.
fn ids(n: usize) -> Vec<Uuid> {
    let mut ids: Vec<Uuid> = (0..n).map(|_| Uuid::now_v7()).collect();
    ids.sort();
    ids
}

/// An event with the caller-chosen `id` that adds `n`.
fn event(id: Uuid, n: i64) -> NewEvent {
    NewEvent::new("Added", serde_json::json!({ "n": n }))
        .expect("event")
        .with_id(id)
        .expect("a chosen id")
}

/// What a state folding `events` onto `state` holds (`{"sum": …}`).
fn folded(state: Option<&serde_json::Value>, events: &[RecordedEvent]) -> serde_json::Value {
    let mut sum = state.and_then(|s| s["sum"].as_i64()).unwrap_or(0);
    for e in events {
        sum += e.payload["n"].as_i64().unwrap_or(0);
    }
    serde_json::json!({ "sum": sum })
}

async fn register<F: PerspectiveStoreFixture>(fixture: &F, names: &[PerspectiveName]) {
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .register(&tx, names)
        .await
        .expect("register");
    commit(tx).await.expect("commit");
}

/// Appends `events` to `stream` in a transaction of its own.
async fn append<F: PerspectiveStoreFixture>(fixture: &F, stream: StreamId, events: &[NewEvent]) {
    let tx = begin(fixture.source()).await;
    fixture
        .events()
        .append(&tx, stream, ExpectedVersion::Any, events)
        .await
        .expect("append");
    commit(tx).await.expect("commit");
}

/// A fresh stream with one event per id (`n` = its position), appended in that order.
async fn stream_with<F: PerspectiveStoreFixture>(fixture: &F, ids: &[Uuid]) -> StreamId {
    let stream = StreamId::new_v7();
    let events: Vec<NewEvent> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| event(*id, i as i64 + 1))
        .collect();
    append(fixture, stream, &events).await;
    stream
}

async fn claim<F: PerspectiveStoreFixture>(
    fixture: &F,
    tx: &F::Tx,
    stream: StreamId,
    name: &PerspectiveName,
    max_events: usize,
    debounce: RewindDebounce,
) -> Claim {
    fixture
        .store()
        .claim(
            tx,
            &lockstep_core::Pair::new(stream, name.clone()),
            max_events,
            debounce,
        )
        .await
        .expect("claim")
}

/// Claims up to `max` events, commits their fold (with a snapshot if asked) and returns the new
/// revision. Panics unless the claim is `Apply`.
async fn apply<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    name: &PerspectiveName,
    max: usize,
    snapshot: bool,
) -> i64 {
    let tx = begin(fixture.source()).await;
    let Claim::Apply {
        cursor,
        state,
        events,
        ..
    } = claim(fixture, &tx, stream, name, max, RewindDebounce::NONE).await
    else {
        panic!("expected events to apply");
    };
    let mut change = StateCommit::new(
        Pair::new(stream, name.clone()),
        cursor.revision,
        folded(state.as_ref(), &events),
    );
    change.last_event_id = events.last().map(|e| e.event_id);
    change.applied_count = cursor.applied_count + events.len() as u64;
    change.applied_events = events.iter().map(|e| e.event_id).collect();
    change.snapshot = snapshot;
    fixture
        .store()
        .commit(tx, &change, Release::Keep)
        .await
        .expect("commit")
        .revision
}

/// What `perspective` (one stream of it) has not applied of the events up to `up_to`.
async fn pending_through<F: PerspectiveStoreFixture>(
    fixture: &F,
    name: &PerspectiveName,
    stream: Option<StreamId>,
    up_to: Uuid,
) -> lockstep_core::PendingThrough {
    let tx = begin(fixture.source()).await;
    let pending = fixture
        .store()
        .pending_through(&tx, name, stream, up_to)
        .await
        .expect("pending_through");
    rollback(tx).await;
    pending
}

/// A rewind's commit: the state of every event of the stream, from the start.
async fn rewind<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    name: &PerspectiveName,
    from: Uuid,
    fence: Option<LeaseId>,
) -> lockstep_core::Result<i64> {
    let tx = begin(fixture.source()).await;
    let cursor = fixture
        .store()
        .cursor(&tx, &lockstep_core::Pair::new(stream, name.clone()))
        .await
        .expect("cursor")
        .expect("cursor row");
    let all = fixture
        .store()
        .stream_events(&tx, stream, None)
        .await
        .expect("stream_events");
    let pending = fixture
        .store()
        .pending_events(&tx, &lockstep_core::Pair::new(stream, name.clone()))
        .await
        .expect("pending_events");
    let mut change = StateCommit::new(
        Pair::new(stream, name.clone()),
        cursor.revision,
        folded(None, &all),
    );
    change.last_event_id = all.last().map(|e| e.event_id);
    change.applied_count = all.len() as u64;
    change.applied_events = pending;
    change.rewound_from = Some(from);
    change.fence = fence;
    fixture
        .store()
        .commit(tx, &change, Release::Keep)
        .await
        .map(|c| c.revision)
}

/// The committed cursor of a pair.
async fn cursor<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    name: &PerspectiveName,
) -> Option<Cursor> {
    let tx = begin(fixture.source()).await;
    let cursor = fixture
        .store()
        .cursor(&tx, &lockstep_core::Pair::new(stream, name.clone()))
        .await
        .expect("cursor");
    rollback(tx).await;
    cursor
}

/// The committed cursor and state of a pair.
async fn state<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    name: &PerspectiveName,
) -> Option<(Cursor, Option<serde_json::Value>)> {
    let tx = begin(fixture.source()).await;
    let found = fixture
        .store()
        .state(&tx, &lockstep_core::Pair::new(stream, name.clone()))
        .await
        .expect("state");
    rollback(tx).await;
    found
}

/// The committed pending work of a pair.
async fn pending<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    name: &PerspectiveName,
) -> Vec<Uuid> {
    let tx = begin(fixture.source()).await;
    let ids = fixture
        .store()
        .pending_events(&tx, &lockstep_core::Pair::new(stream, name.clone()))
        .await
        .expect("pending_events");
    rollback(tx).await;
    ids
}

/// Whether `pending_pairs` for `instance` lists the pair, and with which `rewind` flag.
async fn listed<F: PerspectiveStoreFixture>(
    fixture: &F,
    instance: InstanceId,
    debounce: RewindDebounce,
    stream: StreamId,
    name: &PerspectiveName,
) -> Option<(u64, bool)> {
    let tx = begin(fixture.source()).await;
    let pairs = fixture
        .store()
        .pending_pairs(
            &tx,
            instance,
            std::slice::from_ref(name),
            debounce,
            ALL_PAIRS,
        )
        .await
        .expect("pending_pairs");
    rollback(tx).await;
    pairs
        .into_iter()
        .find(|p| p.pair.stream_id == stream && &p.pair.perspective == name)
        .map(|p| (p.pending, p.rewind))
}

/// The trigger of the pair's committed rewind request.
async fn trigger<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    name: &PerspectiveName,
) -> Option<Uuid> {
    cursor(fixture, stream, name)
        .await
        .expect("cursor row")
        .rewind
        .map(|r| r.trigger)
}

/// Every snapshot of the pair, newest first (walking `snapshot_before` down).
async fn snapshots<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    name: &PerspectiveName,
) -> Vec<lockstep_core::Snapshot> {
    let tx = begin(fixture.source()).await;
    let mut found = Vec::new();
    let mut before = Uuid::max();
    while let Some(s) = fixture
        .store()
        .snapshot_before(&tx, &lockstep_core::Pair::new(stream, name.clone()), before)
        .await
        .expect("snapshot_before")
    {
        before = s.event_id;
        found.push(s);
    }
    rollback(tx).await;
    found
}

/// Makes sure the pair has a cursor row (so a lease can be taken on it).
async fn ensure_cursor<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    name: &PerspectiveName,
) {
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .ensure_cursor(&tx, &lockstep_core::Pair::new(stream, name.clone()))
        .await
        .expect("ensure_cursor");
    commit(tx).await.expect("commit");
}

async fn lease<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    name: &PerspectiveName,
    reason: &LockReason,
) -> StreamLease {
    ensure_cursor(fixture, stream, name).await;
    match fixture
        .locker()
        .try_acquire(stream, name, InstanceId::random(), reason)
        .await
        .expect("try_acquire")
    {
        AcquireOutcome::Acquired(lease) => lease,
        other => panic!("expected to acquire the lease, got {other:?}"),
    }
}

/// Keeps a lease live through the next few statements on a slow machine.
async fn renew<F: PerspectiveStoreFixture>(fixture: &F, lease: &StreamLease) {
    let renewed = fixture.locker().renew(&lease.id).await.expect("renew");
    assert!(renewed.is_renewed(), "the lease is still held");
}

async fn wait_past_expiry<F: PerspectiveStoreFixture>(fixture: &F) {
    let timeout = fixture.locker().options().lock_timeout();
    tokio::time::sleep(timeout + timeout / 2 + Duration::from_millis(50)).await;
}

fn event_ids(events: &[RecordedEvent]) -> Vec<Uuid> {
    events.iter().map(|e| e.event_id).collect()
}

/// Appended events become work for every registered perspective, visible to others only when
/// the appender commits.
pub async fn appended_events_become_work_for_every_registered_perspective_on_commit<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let (a, b) = (name("Alpha"), name("Beta"));
    register(&*fixture, &[a.clone(), b.clone()]).await;
    let (stream, ids) = (StreamId::new_v7(), ids(2));
    let writer = begin(fixture.source()).await;
    fixture
        .events()
        .append(
            &writer,
            stream,
            ExpectedVersion::NoStream,
            &[event(ids[0], 1), event(ids[1], 2)],
        )
        .await
        .expect("append");
    let reader = begin(fixture.source()).await;
    for name in [&a, &b] {
        let seen = fixture
            .store()
            .pending_events(&reader, &lockstep_core::Pair::new(stream, name.clone()))
            .await
            .expect("pending_events");
        assert!(seen.is_empty(), "no work before the appender commits");
    }
    commit(writer).await.expect("commit");
    for name in [&a, &b] {
        let seen = fixture
            .store()
            .pending_events(&reader, &lockstep_core::Pair::new(stream, name.clone()))
            .await
            .expect("pending_events");
        assert_eq!(seen, ids, "work for {name} once the appender committed");
    }
    rollback(reader).await;
    assert_eq!(
        listed(
            &*fixture,
            InstanceId::random(),
            RewindDebounce::NONE,
            stream,
            &a
        )
        .await,
        Some((2, false))
    );
}

/// A rolled-back append leaves no work behind.
pub async fn a_rolled_back_append_leaves_no_work<F: PerspectiveStoreFixture>(fixture: Arc<F>) {
    let a = name("Alpha");
    register(&*fixture, std::slice::from_ref(&a)).await;
    let stream = StreamId::new_v7();
    let tx = begin(fixture.source()).await;
    fixture
        .events()
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[event(ids(1)[0], 1)],
        )
        .await
        .expect("append");
    rollback(tx).await;
    assert!(pending(&*fixture, stream, &a).await.is_empty());
    assert_eq!(
        listed(
            &*fixture,
            InstanceId::random(),
            RewindDebounce::NONE,
            stream,
            &a
        )
        .await,
        None
    );
}

/// A perspective registered after events were appended gets work for them (catch-up);
/// registering it again enqueues nothing twice.
pub async fn a_perspective_registered_later_catches_up_on_existing_events<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids).await;
    let late = name("Latecomer");
    assert!(pending(&*fixture, stream, &late).await.is_empty());
    register(&*fixture, std::slice::from_ref(&late)).await;
    assert_eq!(pending(&*fixture, stream, &late).await, ids, "caught up");
    apply(&*fixture, stream, &late, ALL_EVENTS, false).await;
    register(&*fixture, std::slice::from_ref(&late)).await;
    assert!(
        pending(&*fixture, stream, &late).await.is_empty(),
        "registering again enqueues nothing"
    );
    let (_, state) = state(&*fixture, stream, &late).await.expect("cursor");
    assert_eq!(state, Some(serde_json::json!({ "sum": 6 })));
}

/// A claim hands out the pending events after the cursor in event-id order (not append order),
/// at most the limit asked for, with the cursor and the state; the next claim continues after
/// the committed cursor.
pub async fn claim_returns_pending_events_after_the_cursor_in_event_id_order_up_to_the_limit<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Ordered");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(5);
    // Appended out of event-id order (caller-chosen ids), n = position in event-id order.
    let order = [3, 0, 4, 1, 2];
    let stream = StreamId::new_v7();
    let events: Vec<NewEvent> = order.iter().map(|&i| event(ids[i], i as i64 + 1)).collect();
    append(&*fixture, stream, &events).await;

    let tx = begin(fixture.source()).await;
    let Claim::Apply {
        cursor,
        state,
        events,
        ..
    } = claim(&*fixture, &tx, stream, &p, 3, RewindDebounce::NONE).await
    else {
        panic!("expected events to apply");
    };
    assert_eq!(event_ids(&events), ids[..3], "event-id order, at most 3");
    for e in &events {
        let i = ids
            .iter()
            .position(|id| *id == e.event_id)
            .expect("known id");
        assert_eq!(e.stream_id, stream);
        assert_eq!(e.payload["n"], serde_json::json!(i + 1));
        let appended_as = order.iter().position(|&o| o == i).expect("appended");
        assert_eq!(
            e.version,
            appended_as as u64 + 1,
            "versions keep append order"
        );
        assert_eq!(e.event_type, "Added");
    }
    assert_eq!(
        (cursor.last_event_id, cursor.applied_count, state),
        (None, 0, None)
    );
    let mut change = StateCommit::new(
        Pair::new(stream, p.clone()),
        cursor.revision,
        folded(None, &events),
    );
    change.last_event_id = Some(ids[2]);
    change.applied_count = 3;
    change.applied_events = event_ids(&events);
    fixture
        .store()
        .commit(tx, &change, Release::Keep)
        .await
        .map(|c| c.revision)
        .expect("commit");

    let tx = begin(fixture.source()).await;
    let Claim::Apply {
        cursor,
        state,
        events,
        ..
    } = claim(&*fixture, &tx, stream, &p, ALL_EVENTS, RewindDebounce::NONE).await
    else {
        panic!("expected the rest to apply");
    };
    assert_eq!(event_ids(&events), ids[3..], "only events after the cursor");
    assert_eq!(cursor.last_event_id, Some(ids[2]));
    assert_eq!(cursor.applied_count, 3);
    assert_eq!(state, Some(serde_json::json!({ "sum": 6 })));
    rollback(tx).await;
}

/// Claiming a pair that has no cursor row creates it (empty, unlocked) and finds nothing to do.
pub async fn claim_creates_the_cursor_of_a_pair_that_has_none<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let (stream, p) = (StreamId::new_v7(), name("Fresh"));
    assert!(cursor(&*fixture, stream, &p).await.is_none());
    let tx = begin(fixture.source()).await;
    assert_eq!(
        claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await,
        Claim::Idle
    );
    commit(tx).await.expect("commit");
    let created = cursor(&*fixture, stream, &p).await.expect("created");
    assert_eq!(created.last_event_id, None);
    assert_eq!(created.applied_count, 0);
    assert_eq!(created.rewind, None);
    assert_eq!(created.error, None);
    assert_eq!(created.failures, 0);
    assert_eq!(created.latest_snapshot, None);
    assert!(created.lease.is_unlocked());
}

/// While one transaction holds a claim, another transaction's claim of the same pair is `Busy`
/// at once (it never waits); once the first ends, the pair can be claimed again.
pub async fn a_second_claim_of_a_claimed_pair_is_busy_until_the_first_transaction_ends<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Exclusive");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    let first = begin(fixture.source()).await;
    assert!(matches!(
        claim(&*fixture, &first, stream, &p, 10, RewindDebounce::NONE).await,
        Claim::Apply { .. }
    ));
    let second = begin(fixture.source()).await;
    let busy = tokio::time::timeout(
        Duration::from_secs(10),
        claim(&*fixture, &second, stream, &p, 10, RewindDebounce::NONE),
    )
    .await
    .expect("a claim never waits for another transaction's claim");
    assert_eq!(busy, Claim::Busy);
    rollback(second).await;
    rollback(first).await;
    let third = begin(fixture.source()).await;
    match claim(&*fixture, &third, stream, &p, 10, RewindDebounce::NONE).await {
        Claim::Apply { events, .. } => assert_eq!(event_ids(&events), ids),
        other => panic!("expected the pair to be claimable again, got {other:?}"),
    }
    rollback(third).await;
}

/// A pair under a live lease is `Busy` for every claim and absent from other instances'
/// `pending_pairs` (listed for the holder); its events keep queueing and are claimed after the
/// release.
pub async fn a_leased_pair_is_held_back_while_its_events_keep_queueing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Leased");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids[..1]).await;
    let lease = lease(&*fixture, stream, &p, &LockReason::Rewind).await;

    let tx = begin(fixture.source()).await;
    assert_eq!(
        claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await,
        Claim::Busy,
        "a live lease holds normal application back"
    );
    rollback(tx).await;
    renew(&*fixture, &lease).await;
    assert_eq!(
        listed(
            &*fixture,
            InstanceId::random(),
            RewindDebounce::NONE,
            stream,
            &p
        )
        .await,
        None,
        "not listed for another instance"
    );
    assert_eq!(
        listed(&*fixture, lease.id.holder, RewindDebounce::NONE, stream, &p).await,
        Some((1, false)),
        "listed for the holder"
    );
    append(&*fixture, stream, &[event(ids[1], 2)]).await;
    assert_eq!(pending(&*fixture, stream, &p).await, ids, "still queueing");

    let released = fixture.locker().release(&lease.id).await.expect("release");
    assert!(released.is_released());
    let tx = begin(fixture.source()).await;
    match claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await {
        Claim::Apply { events, .. } => assert_eq!(event_ids(&events), ids),
        other => panic!("expected the queued events after the release, got {other:?}"),
    }
    rollback(tx).await;
}

/// A commit saves the state, advances the cursor, increments the revision and deletes exactly
/// the work items it names: a claimed event it does not name stays pending.
pub async fn a_commit_saves_the_state_advances_the_cursor_and_deletes_exactly_the_applied_work<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Committed");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids).await;
    let tx = begin(fixture.source()).await;
    let Claim::Apply { cursor, events, .. } =
        claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await
    else {
        panic!("expected events to apply");
    };
    assert_eq!(events.len(), 3);
    let mut change = StateCommit::new(
        Pair::new(stream, p.clone()),
        cursor.revision,
        folded(None, &events[..2]),
    );
    change.last_event_id = Some(ids[1]);
    change.applied_count = 2;
    change.applied_events = ids[..2].to_vec();
    let revision = fixture
        .store()
        .commit(tx, &change, Release::Keep)
        .await
        .map(|c| c.revision)
        .expect("commit");
    assert_eq!(revision, cursor.revision + 1);

    let (after, state) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(after.last_event_id, Some(ids[1]));
    assert_eq!(after.applied_count, 2);
    assert_eq!(after.revision, revision);
    assert_eq!(state, Some(serde_json::json!({ "sum": 3 })));
    assert_eq!(
        pending(&*fixture, stream, &p).await,
        ids[2..],
        "the unnamed item stays"
    );
}

/// A commit computed from a revision the cursor is no longer at is a retryable `Conflict`; it
/// writes nothing and its transaction can still commit.
pub async fn a_stale_expected_revision_is_a_conflict_that_writes_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Stale");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    let revision = apply(&*fixture, stream, &p, 1, false).await;

    let tx = begin(fixture.source()).await;
    let mut change = StateCommit::new(
        Pair::new(stream, p.clone()),
        revision - 1,
        serde_json::json!({ "sum": 999 }),
    );
    change.last_event_id = Some(ids[1]);
    change.applied_count = 2;
    change.applied_events = vec![ids[1]];
    change.snapshot = true;
    let err = fixture
        .store()
        .commit(tx, &change, Release::Keep)
        .await
        .map(|c| c.revision)
        .expect_err("stale revision");
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(err.is_retryable());

    let (after, state) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (after.revision, after.last_event_id, after.applied_count),
        (revision, Some(ids[0]), 1)
    );
    assert_eq!(state, Some(serde_json::json!({ "sum": 1 })));
    assert_eq!(pending(&*fixture, stream, &p).await, ids[1..]);
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());
}

/// A commit fenced by the live lease it names is written.
pub async fn a_fenced_commit_by_the_lease_holder_is_written<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("Fenced");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(1);
    let stream = stream_with(&*fixture, &ids).await;
    let lease = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    let revision = rewind(&*fixture, stream, &p, Uuid::nil(), Some(lease.id.clone()))
        .await
        .expect("the holder's fenced commit");
    let (after, state) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(after.revision, revision);
    assert_eq!(state, Some(serde_json::json!({ "sum": 1 })));
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    let _ = fixture.locker().release(&lease.id).await.expect("release");
}

async fn assert_fenced_out<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    p: &PerspectiveName,
    ids: &[Uuid],
    old: &LeaseId,
) {
    let before = cursor(fixture, stream, p).await.expect("cursor");
    let err = rewind(fixture, stream, p, Uuid::nil(), Some(old.clone()))
        .await
        .expect_err("fenced out");
    assert_eq!(err.kind(), ErrorKind::LeaseLost, "{err}");
    let tx = begin(fixture.source()).await;
    let err = fixture
        .store()
        .save_snapshot(
            &tx,
            &lockstep_core::Pair::new(stream, p.clone()),
            before.revision,
            Some(old),
        )
        .await
        .expect_err("a fenced snapshot too");
    assert_eq!(err.kind(), ErrorKind::LeaseLost, "{err}");
    let err = fixture
        .store()
        .purge(&tx, &lockstep_core::Pair::new(stream, p.clone()), Some(old))
        .await
        .expect_err("a fenced purge too");
    assert_eq!(err.kind(), ErrorKind::LeaseLost, "{err}");
    commit(tx).await.expect("still usable");
    let (after, state) = state(fixture, stream, p).await.expect("cursor");
    assert_eq!(after.revision, before.revision, "nothing written");
    assert_eq!(state, None);
    assert_eq!(pending(fixture, stream, p).await, ids);
}

/// After the lease expired and another instance took it over, the old holder's fenced commit
/// (and fenced snapshot and purge) is `LeaseLost` and writes nothing.
pub async fn a_fenced_commit_after_a_takeover_is_lease_lost_and_writes_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("TakenOver");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(1);
    let stream = stream_with(&*fixture, &ids).await;
    let old = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    wait_past_expiry(&*fixture).await;
    let taken = fixture
        .locker()
        .try_acquire(stream, &p, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("try_acquire");
    assert!(taken.is_acquired(), "expired lease taken over: {taken:?}");
    assert_fenced_out(&*fixture, stream, &p, &ids, &old.id).await;
}

/// After a force-release, the old holder's fenced writes are `LeaseLost` and write nothing.
pub async fn a_fenced_commit_after_a_force_release_is_lease_lost_and_writes_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("ForceReleased");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(1);
    let stream = stream_with(&*fixture, &ids).await;
    let old = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    let released = fixture
        .admin()
        .force_release(stream, &p)
        .await
        .expect("force_release");
    assert!(released.is_released());
    assert_fenced_out(&*fixture, stream, &p, &ids, &old.id).await;
}

/// An event whose caller-chosen id sorts before the last applied one turns the claim into a
/// `Rewind` with that event as trigger; the request is kept, and so is the work.
pub async fn a_late_arrival_turns_the_claim_into_a_rewind_from_that_event<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Late");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids[1..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    append(&*fixture, stream, &[event(ids[0], 5)]).await;

    let tx = begin(fixture.source()).await;
    let Claim::Rewind { cursor: flagged } =
        claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await
    else {
        panic!("expected a rewind");
    };
    let request = flagged.rewind.expect("a rewind request");
    assert_eq!(request.trigger, ids[0]);
    assert!(request.first_flagged_at <= request.flagged_at);
    assert_eq!(flagged.last_event_id, Some(ids[1]));
    commit(tx).await.expect("commit");
    assert_eq!(trigger(&*fixture, stream, &p).await, Some(ids[0]), "kept");
    assert_eq!(pending(&*fixture, stream, &p).await, ids[..1], "work kept");
}

/// Of two late arrivals, the earlier one is the trigger.
pub async fn of_two_late_arrivals_the_earliest_is_the_trigger<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("TwoLate");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids[2..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    append(&*fixture, stream, &[event(ids[1], 2)]).await;
    append(&*fixture, stream, &[event(ids[0], 1)]).await;
    let tx = begin(fixture.source()).await;
    match claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await {
        Claim::Rewind { cursor } => {
            assert_eq!(cursor.rewind.map(|r| r.trigger), Some(ids[0]));
        }
        other => panic!("expected a rewind, got {other:?}"),
    }
    commit(tx).await.expect("commit");
}

/// A rewind request's trigger only ever moves earlier — by a later late arrival or by
/// `request_rewind` — and a request "from the start" beats every event; a pair without a
/// cursor cannot be asked to rewind.
pub async fn an_existing_trigger_only_ever_moves_earlier<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("Earlier");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(4); // a1 < a2 < a3 < b
    let stream = stream_with(&*fixture, &ids[3..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;

    append(&*fixture, stream, &[event(ids[1], 2)]).await;
    assert!(matches!(
        claim_and_commit(&*fixture, stream, &p).await,
        Claim::Rewind { .. }
    ));
    assert_eq!(trigger(&*fixture, stream, &p).await, Some(ids[1]));
    request(&*fixture, stream, &p, Some(ids[2])).await;
    assert_eq!(
        trigger(&*fixture, stream, &p).await,
        Some(ids[1]),
        "not later"
    );
    append(&*fixture, stream, &[event(ids[2], 3)]).await;
    assert!(matches!(
        claim_and_commit(&*fixture, stream, &p).await,
        Claim::Rewind { .. }
    ));
    assert_eq!(
        trigger(&*fixture, stream, &p).await,
        Some(ids[1]),
        "not later"
    );
    append(&*fixture, stream, &[event(ids[0], 1)]).await;
    assert!(matches!(
        claim_and_commit(&*fixture, stream, &p).await,
        Claim::Rewind { .. }
    ));
    assert_eq!(
        trigger(&*fixture, stream, &p).await,
        Some(ids[0]),
        "earlier"
    );
    request(&*fixture, stream, &p, None).await;
    assert_eq!(
        trigger(&*fixture, stream, &p).await,
        Some(Uuid::nil()),
        "from the start"
    );
    request(&*fixture, stream, &p, Some(ids[0])).await;
    assert_eq!(trigger(&*fixture, stream, &p).await, Some(Uuid::nil()));

    let tx = begin(fixture.source()).await;
    let found = fixture
        .store()
        .request_rewind(
            &tx,
            &lockstep_core::Pair::new(StreamId::new_v7(), p.clone()),
            None,
        )
        .await
        .expect("request_rewind");
    assert!(!found, "no cursor, no request");
    rollback(tx).await;
}

/// Requests a rewind of a pair that has a cursor, in a transaction of its own.
async fn request<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    p: &PerspectiveName,
    from: Option<Uuid>,
) {
    let tx = begin(fixture.source()).await;
    let found = fixture
        .store()
        .request_rewind(&tx, &lockstep_core::Pair::new(stream, p.clone()), from)
        .await
        .expect("request_rewind");
    commit(tx).await.expect("commit");
    assert!(found, "the pair has a cursor");
}

/// Issue 18: `pending_pairs` lists only pairs of the perspectives the caller runs — work or a
/// rewind request of another registered perspective, however old, never takes their places.
pub async fn pending_pairs_lists_only_the_perspectives_asked_for<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    // "Absent-…" sorts before "Served-…": unfiltered, its pair would come first.
    let (served, absent) = (name("Served"), name("Absent"));
    register(&*fixture, &[served.clone(), absent.clone()]).await;
    let old = stream_with(&*fixture, &ids(2)).await;
    let new = stream_with(&*fixture, &ids(1)).await;
    ensure_cursor(&*fixture, new, &absent).await;
    request(&*fixture, new, &absent, None).await;
    let instance = InstanceId::random();
    let tx = begin(fixture.source()).await;
    let listed = |names: Vec<PerspectiveName>, limit: usize| {
        let (store, tx) = (fixture.store(), &tx);
        async move {
            store
                .pending_pairs(tx, instance, &names, RewindDebounce::NONE, limit)
                .await
                .expect("pending_pairs")
                .into_iter()
                .map(|p| {
                    (
                        p.pair.stream_id,
                        p.pair.perspective.as_str().to_owned(),
                        p.rewind,
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        listed(vec![served.clone()], 1).await,
        [(old, served.as_str().to_owned(), false)],
        "the oldest work of the perspective asked for, not the oldest overall"
    );
    let mut mine = listed(vec![served.clone()], ALL_PAIRS).await;
    mine.sort();
    let mut expected = vec![
        (old, served.as_str().to_owned(), false),
        (new, served.as_str().to_owned(), false),
    ];
    expected.sort();
    assert_eq!(
        mine, expected,
        "no pair of another perspective, not even a rewind"
    );
    assert_eq!(
        listed(vec![served.clone(), absent.clone()], ALL_PAIRS)
            .await
            .len(),
        4,
        "both perspectives when asked for both"
    );
    assert!(
        listed(Vec::new(), ALL_PAIRS).await.is_empty(),
        "none asked for, none listed"
    );
    rollback(tx).await;
}

/// Inside the debounce window a flagged pair is held back: its claim is `Idle` and
/// `pending_pairs` leaves it out, work and all; once the window has passed it is listed as a
/// rewind and claimed as one.
pub async fn the_debounce_window_holds_a_flagged_pair_back<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("Debounced");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids[1..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    append(&*fixture, stream, &[event(ids[0], 1)]).await;

    let tx = begin(fixture.source()).await;
    assert_eq!(
        claim(&*fixture, &tx, stream, &p, 10, HOUR).await,
        Claim::Idle,
        "found late, inside the window"
    );
    commit(tx).await.expect("commit");
    assert_eq!(
        trigger(&*fixture, stream, &p).await,
        Some(ids[0]),
        "flagged"
    );

    let instance = InstanceId::random();
    assert_eq!(listed(&*fixture, instance, HOUR, stream, &p).await, None);
    let tx = begin(fixture.source()).await;
    assert_eq!(
        claim(&*fixture, &tx, stream, &p, 10, HOUR).await,
        Claim::Idle
    );
    rollback(tx).await;

    assert_eq!(
        listed(&*fixture, instance, RewindDebounce::NONE, stream, &p).await,
        Some((1, true))
    );
    let tx = begin(fixture.source()).await;
    match claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await {
        Claim::Rewind { cursor } => assert_eq!(cursor.rewind.map(|r| r.trigger), Some(ids[0])),
        other => panic!("expected a rewind, got {other:?}"),
    }
    rollback(tx).await;
}

/// The debounce window slides with every late event, but only up to `max_delay` from the first
/// flag: a pair re-flagged just now is still served once the cap has passed, by `claim` and by
/// `pending_pairs` alike (a steady trickle of late events cannot postpone its rewind forever).
/// Real time passes here (about 2.6 s on a database; nothing with paused time).
pub async fn the_debounce_window_is_capped_from_the_first_flag<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    // The cap leaves the steps before it seconds of slack on a busy machine; the wait past it
    // is counted from an instant taken after the first flag committed, so it is always past.
    const CAPPED: RewindDebounce = RewindDebounce {
        window: Duration::from_secs(3600),
        max_delay: Duration::from_millis(2500),
    };
    let p = name("Capped");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids[2..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    let instance = InstanceId::random();

    append(&*fixture, stream, &[event(ids[1], 1)]).await;
    let tx = begin(fixture.source()).await;
    assert_eq!(
        claim(&*fixture, &tx, stream, &p, 10, CAPPED).await,
        Claim::Idle
    );
    commit(tx).await.expect("commit");
    let flagged = tokio::time::Instant::now();
    let first = cursor(&*fixture, stream, &p).await.expect("cursor");
    let first = first.rewind.expect("flagged");

    tokio::time::sleep(Duration::from_millis(600)).await;
    // An earlier late event moves the trigger and restarts the window, not the cap.
    append(&*fixture, stream, &[event(ids[0], 0)]).await;
    let tx = begin(fixture.source()).await;
    assert_eq!(
        claim(&*fixture, &tx, stream, &p, 10, CAPPED).await,
        Claim::Idle
    );
    commit(tx).await.expect("commit");
    let moved = cursor(&*fixture, stream, &p).await.expect("cursor");
    let moved = moved.rewind.expect("still flagged");
    assert_eq!(moved.trigger, ids[0], "the trigger moved earlier");
    assert!(moved.flagged_at > first.flagged_at, "the window restarted");
    assert_eq!(
        moved.first_flagged_at, first.first_flagged_at,
        "the cap did not"
    );
    assert_eq!(listed(&*fixture, instance, CAPPED, stream, &p).await, None);

    tokio::time::sleep_until(flagged + CAPPED.max_delay + Duration::from_millis(100)).await;
    // Past the cap from the first flag, well inside the window from the last: the cap serves it.
    assert_eq!(
        listed(&*fixture, instance, CAPPED, stream, &p).await,
        Some((2, true)),
        "listed once the cap has passed"
    );
    assert_eq!(
        listed(&*fixture, instance, HOUR, stream, &p).await,
        None,
        "a longer cap still holds it back"
    );
    let tx = begin(fixture.source()).await;
    match claim(&*fixture, &tx, stream, &p, 10, CAPPED).await {
        Claim::Rewind { cursor } => assert_eq!(cursor.rewind.map(|r| r.trigger), Some(ids[0])),
        other => panic!("expected a rewind, got {other:?}"),
    }
    rollback(tx).await;
}

/// A rewind's commit clears the request only if its trigger is still the one it rewound from:
/// an earlier trigger that arrived meanwhile stays requested, and is cleared by its own rewind.
pub async fn a_rewind_commit_clears_the_request_only_if_its_trigger_is_unchanged<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Rewound");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3); // a1 < a2 < b
    let stream = stream_with(&*fixture, &ids[2..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    append(&*fixture, stream, &[event(ids[1], 2)]).await;
    let tx = begin(fixture.source()).await;
    assert!(matches!(
        claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await,
        Claim::Rewind { .. }
    ));
    commit(tx).await.expect("commit");

    let lease = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    // Meanwhile an operator asks for an earlier rewind.
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .request_rewind(
                &tx,
                &lockstep_core::Pair::new(stream, p.clone()),
                Some(ids[0])
            )
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");
    renew(&*fixture, &lease).await;
    rewind(&*fixture, stream, &p, ids[1], Some(lease.id.clone()))
        .await
        .expect("rewind from a2");
    let after = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        after.rewind.map(|r| r.trigger),
        Some(ids[0]),
        "still requested"
    );
    assert!(
        pending(&*fixture, stream, &p).await.is_empty(),
        "a2 applied"
    );

    renew(&*fixture, &lease).await;
    rewind(&*fixture, stream, &p, ids[0], Some(lease.id.clone()))
        .await
        .expect("rewind from a1");
    let (after, state) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(after.rewind, None, "cleared");
    assert_eq!(after.last_event_id, Some(ids[2]));
    assert_eq!(after.applied_count, 2);
    assert_eq!(state, Some(serde_json::json!({ "sum": 3 })));
    let _ = fixture.locker().release(&lease.id).await.expect("release");
}

/// A rewind's commit deletes the snapshots at or after its trigger (they may miss the late
/// event) and keeps the ones before it.
pub async fn a_rewind_commit_deletes_the_snapshots_at_or_after_its_trigger<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("SnapshotsRewound");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(4); // e1 < late < e2 < e3
    let (e1, late, e2, e3) = (ids[0], ids[1], ids[2], ids[3]);
    let stream = stream_with(&*fixture, &[e1, e2, e3]).await;
    for _ in 0..3 {
        apply(&*fixture, stream, &p, 1, true).await;
    }
    let kept: Vec<Uuid> = snapshots(&*fixture, stream, &p)
        .await
        .iter()
        .map(|s| s.event_id)
        .collect();
    assert_eq!(kept, [e3, e2, e1]);
    append(&*fixture, stream, &[event(late, 10)]).await;
    assert_eq!(trigger_after_claim(&*fixture, stream, &p).await, late);
    rewind(&*fixture, stream, &p, late, None)
        .await
        .expect("rewind");
    let kept: Vec<Uuid> = snapshots(&*fixture, stream, &p)
        .await
        .iter()
        .map(|s| s.event_id)
        .collect();
    assert_eq!(kept, [e1], "the snapshots after the trigger are gone");
    let after = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(after.latest_snapshot, Some(e1));

    // "At" the trigger counts too.
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .request_rewind(&tx, &lockstep_core::Pair::new(stream, p.clone()), Some(e1))
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");
    rewind(&*fixture, stream, &p, e1, None)
        .await
        .expect("rewind");
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());
    assert_eq!(
        cursor(&*fixture, stream, &p)
            .await
            .expect("cursor")
            .latest_snapshot,
        None
    );
}

/// Claims (debounce zero) and commits whatever the claim wrote.
async fn claim_and_commit<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    p: &PerspectiveName,
) -> Claim {
    let tx = begin(fixture.source()).await;
    let outcome = claim(fixture, &tx, stream, p, 10, RewindDebounce::NONE).await;
    commit(tx).await.expect("commit");
    outcome
}

async fn trigger_after_claim<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    p: &PerspectiveName,
) -> Uuid {
    match claim_and_commit(fixture, stream, p).await {
        Claim::Rewind { cursor } => cursor.rewind.expect("request").trigger,
        other => panic!("expected a rewind, got {other:?}"),
    }
}

/// A commit with `snapshot: true` saves the new state at its last event, and
/// `snapshot_before` returns the latest snapshot strictly before the id asked for.
pub async fn a_commit_can_save_a_snapshot_and_snapshot_before_finds_the_latest_strictly_before<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Snapshotted");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids).await;
    apply(&*fixture, stream, &p, 1, true).await;
    apply(&*fixture, stream, &p, 1, true).await;
    apply(&*fixture, stream, &p, 1, false).await;

    let tx = begin(fixture.source()).await;
    let key = lockstep_core::Pair::new(stream, p.clone());
    let before = |id: Uuid| fixture.store().snapshot_before(&tx, &key, id);
    let s = before(ids[2]).await.expect("snapshot_before").expect("one");
    assert_eq!(s.event_id, ids[1]);
    assert_eq!(s.applied_count, 2);
    assert_eq!(s.state, serde_json::json!({ "sum": 3 }));
    let s = before(ids[1]).await.expect("snapshot_before").expect("one");
    assert_eq!(s.event_id, ids[0], "strictly before");
    assert_eq!(s.applied_count, 1);
    assert_eq!(s.state, serde_json::json!({ "sum": 1 }));
    assert_eq!(before(ids[0]).await.expect("snapshot_before"), None);
    rollback(tx).await;
    let after = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(after.latest_snapshot, Some(ids[1]));
}

/// Only the last [`DEFAULT_KEEP_SNAPSHOTS`] snapshots of a pair are kept.
pub async fn only_the_newest_snapshots_are_kept<F: PerspectiveStoreFixture>(fixture: Arc<F>) {
    let p = name("Pruned");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(DEFAULT_KEEP_SNAPSHOTS + 2);
    let stream = stream_with(&*fixture, &ids).await;
    for _ in 0..ids.len() {
        apply(&*fixture, stream, &p, 1, true).await;
    }
    let kept: Vec<Uuid> = snapshots(&*fixture, stream, &p)
        .await
        .iter()
        .map(|s| s.event_id)
        .collect();
    let newest: Vec<Uuid> = ids
        .iter()
        .rev()
        .take(DEFAULT_KEEP_SNAPSHOTS)
        .copied()
        .collect();
    assert_eq!(kept, newest);
}

/// The bootstrap snapshot saves the current state once (a second call does nothing), does not
/// change the revision, and does nothing for a pair that moved on or applied nothing.
pub async fn save_snapshot_is_idempotent_and_refuses_a_moved_revision<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Bootstrapped");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    ensure_cursor(&*fixture, stream, &p).await;
    let fresh = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert!(
        !save(&*fixture, stream, &p, fresh.revision).await,
        "nothing applied yet"
    );

    let revision = apply(&*fixture, stream, &p, 1, false).await;
    assert!(save(&*fixture, stream, &p, revision).await, "saved");
    assert!(
        !save(&*fixture, stream, &p, revision).await,
        "already there"
    );
    let after = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(after.revision, revision, "a snapshot is not a state change");
    assert_eq!(after.latest_snapshot, Some(ids[0]));
    let kept = snapshots(&*fixture, stream, &p).await;
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0].state, serde_json::json!({ "sum": 1 }));
    assert_eq!(kept[0].applied_count, 1);

    apply(&*fixture, stream, &p, 1, false).await;
    assert!(
        !save(&*fixture, stream, &p, revision).await,
        "the cursor moved on"
    );
    assert_eq!(snapshots(&*fixture, stream, &p).await.len(), 1);
}

/// The bootstrap snapshot in a transaction of its own.
async fn save<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    p: &PerspectiveName,
    revision: i64,
) -> bool {
    let tx = begin(fixture.source()).await;
    let saved = fixture
        .store()
        .save_snapshot(
            &tx,
            &lockstep_core::Pair::new(stream, p.clone()),
            revision,
            None,
        )
        .await
        .expect("save_snapshot");
    commit(tx).await.expect("commit");
    saved
}

/// `stream_events` returns a stream's events in event-id order (not append order), after the
/// given id when one is given.
pub async fn stream_events_come_in_event_id_order_after_the_given_id<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let ids = ids(4);
    let stream = stream_with(&*fixture, &[ids[2], ids[0], ids[3], ids[1]]).await;
    let tx = begin(fixture.source()).await;
    let all = fixture
        .store()
        .stream_events(&tx, stream, None)
        .await
        .expect("stream_events");
    assert_eq!(event_ids(&all), ids);
    assert_eq!(
        all.iter().map(|e| e.version).collect::<Vec<_>>(),
        [2, 4, 1, 3],
        "versions keep append order"
    );
    assert!(all.iter().all(|e| e.stream_id == stream));
    let after = fixture
        .store()
        .stream_events(&tx, stream, Some(ids[1]))
        .await
        .expect("stream_events");
    assert_eq!(event_ids(&after), ids[2..]);
    let none = fixture
        .store()
        .stream_events(&tx, StreamId::new_v7(), None)
        .await
        .expect("stream_events");
    assert!(none.is_empty());
    rollback(tx).await;
}

/// A recorded failure keeps the rewind request and the work, and counts; the next successful
/// commit clears the error and the count.
pub async fn a_recorded_failure_keeps_the_request_and_the_work_until_a_commit_succeeds<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Failing");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids[1..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    append(&*fixture, stream, &[event(ids[0], 1)]).await;
    assert_eq!(trigger_after_claim(&*fixture, stream, &p).await, ids[0]);
    for message in ["apply failed: boom", "apply failed: boom again"] {
        let tx = begin(fixture.source()).await;
        fixture
            .store()
            .record_failure(
                &tx,
                &lockstep_core::Pair::new(stream, p.clone()),
                &PairFailure::new(message),
            )
            .await
            .expect("record_failure");
        commit(tx).await.expect("commit");
    }
    let failed = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(failed.error.as_deref(), Some("apply failed: boom again"));
    assert_eq!(failed.failures, 2);
    assert_eq!(
        failed.rewind.map(|r| r.trigger),
        Some(ids[0]),
        "still requested"
    );
    assert_eq!(pending(&*fixture, stream, &p).await, ids[..1], "work kept");

    rewind(&*fixture, stream, &p, ids[0], None)
        .await
        .expect("rewind");
    let healed = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (healed.error, healed.failures, healed.rewind),
        (None, 0, None)
    );
}

/// A purge deletes the pair's state, snapshots and pending work and resets its cursor (no
/// event applied, no rewind, a higher revision) under the lease, which stays. The pair stays
/// empty until its next event, whose claim is a rewind from the start of the stream (so the
/// state is again the fold of the whole stream, never of the events after the purge alone).
pub async fn purge_empties_the_pair_and_keeps_its_lease<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("Purged");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids[..2]).await;
    let revision = apply(&*fixture, stream, &p, 1, true).await;
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .request_rewind(&tx, &lockstep_core::Pair::new(stream, p.clone()), None)
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");

    let lease = lease(&*fixture, stream, &p, &LockReason::Purge).await;
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .purge(
            &tx,
            &lockstep_core::Pair::new(stream, p.clone()),
            Some(&lease.id),
        )
        .await
        .expect("purge");
    commit(tx).await.expect("commit");

    let (after, state) = state(&*fixture, stream, &p).await.expect("cursor kept");
    assert_eq!(state, None);
    assert_eq!((after.last_event_id, after.applied_count), (None, 0));
    assert!(after.revision > revision, "the revision increases");
    assert_eq!((after.rewind, after.latest_snapshot), (None, None));
    assert_eq!(after.lease.holder, Some(lease.id.holder), "the lease stays");
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());
    let _ = fixture.locker().release(&lease.id).await.expect("release");

    // The next event rebuilds the pair from the start of the stream (applying just
    // the new event gave a state that is the fold of no prefix of the stream).
    append(&*fixture, stream, &[event(ids[2], 7)]).await;
    let tx = begin(fixture.source()).await;
    match claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await {
        Claim::Rewind { cursor } => {
            assert_eq!(
                cursor.rewind.map(|r| r.trigger),
                Some(Uuid::nil()),
                "a rewind from the start"
            );
        }
        other => panic!("expected a rewind from the start, got {other:?}"),
    }
    commit(tx).await.expect("commit");
    let tx = begin(fixture.source()).await;
    assert!(
        matches!(
            claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await,
            Claim::Rewind { .. }
        ),
        "the request stays until a rewind commits"
    );
    rollback(tx).await;
}

/// `ensure_cursor` creates a cursor row once; `delete_cursor` deletes it with its state,
/// snapshots and work, once.
pub async fn ensure_cursor_is_idempotent_and_delete_cursor_removes_the_pair<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let (stream, p) = (StreamId::new_v7(), name("Rows"));
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .ensure_cursor(&tx, &lockstep_core::Pair::new(stream, p.clone()))
            .await
            .expect("ensure")
    );
    assert!(
        !fixture
            .store()
            .ensure_cursor(&tx, &lockstep_core::Pair::new(stream, p.clone()))
            .await
            .expect("ensure"),
        "already there"
    );
    commit(tx).await.expect("commit");
    let created = cursor(&*fixture, stream, &p).await.expect("created");
    assert_eq!((created.last_event_id, created.applied_count), (None, 0));
    assert!(created.lease.is_unlocked());

    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    append(&*fixture, stream, &[event(ids[0], 1), event(ids[1], 2)]).await;
    apply(&*fixture, stream, &p, 1, true).await;
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .delete_cursor(&tx, &lockstep_core::Pair::new(stream, p.clone()))
            .await
            .expect("delete")
    );
    assert!(
        !fixture
            .store()
            .delete_cursor(&tx, &lockstep_core::Pair::new(stream, p.clone()))
            .await
            .expect("delete"),
        "already gone"
    );
    commit(tx).await.expect("commit");
    assert!(state(&*fixture, stream, &p).await.is_none());
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());
}

/// A state `jsonb` cannot store (U+0000 in a string) is `InvalidInput`; nothing is written and
/// the transaction can still commit.
pub async fn a_state_jsonb_cannot_store_is_invalid_input_and_writes_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("BadState");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(1);
    let stream = stream_with(&*fixture, &ids).await;
    let tx = begin(fixture.source()).await;
    let Claim::Apply { cursor, .. } =
        claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await
    else {
        panic!("expected events to apply");
    };
    let mut change = StateCommit::new(
        Pair::new(stream, p.clone()),
        cursor.revision,
        serde_json::json!({ "note": "a\u{0}b" }),
    );
    change.last_event_id = Some(ids[0]);
    change.applied_count = 1;
    change.applied_events = ids.clone();
    change.snapshot = true;
    let err = fixture
        .store()
        .commit(tx, &change, Release::Keep)
        .await
        .map(|c| c.revision)
        .expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    let (after, state) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (after.revision, after.last_event_id),
        (cursor.revision, None)
    );
    assert_eq!(state, None);
    assert_eq!(pending(&*fixture, stream, &p).await, ids);
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());
}

/// `depth` arrays and objects, alternating, around a string (a scalar has depth 0).
fn nested(depth: usize) -> serde_json::Value {
    (0..depth).fold(serde_json::json!("leaf"), |value, level| {
        if level % 2 == 0 {
            serde_json::json!([1, value])
        } else {
            serde_json::json!({ "a": 1, "k": value })
        }
    })
}

/// A state nested deeper than a claim can read back (128 levels of arrays and objects) is
/// `InvalidInput` and writes nothing, instead of being stored and failing every later claim of
/// the pair; the deepest readable state (127 levels) is committed and read
/// back unchanged.
pub async fn a_state_nested_deeper_than_a_claim_can_read_is_invalid_input_and_writes_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("DeepState");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    let commit_of = |cursor: &Cursor, state: serde_json::Value, applied: &[Uuid]| {
        let mut change = StateCommit::new(Pair::new(stream, p.clone()), cursor.revision, state);
        change.last_event_id = applied.last().copied();
        change.applied_count = cursor.applied_count + applied.len() as u64;
        change.applied_events = applied.to_vec();
        change.snapshot = true;
        change
    };

    let tx = begin(fixture.source()).await;
    let Claim::Apply { cursor, .. } =
        claim(&*fixture, &tx, stream, &p, 1, RewindDebounce::NONE).await
    else {
        panic!("expected events to apply");
    };
    let err = fixture
        .store()
        .commit(
            tx,
            &commit_of(&cursor, nested(MAX_DEPTH + 1), &ids[..1]),
            Release::Keep,
        )
        .await
        .map(|c| c.revision)
        .expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert_eq!(
        err.validation(),
        Some(&ValidationError::JsonTooDeep {
            field: "perspective state",
            max: 127
        })
    );
    let (after, stored) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (after.revision, after.last_event_id),
        (cursor.revision, None)
    );
    assert_eq!(stored, None);
    assert_eq!(pending(&*fixture, stream, &p).await, ids);
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());

    let deepest = nested(MAX_DEPTH);
    let tx = begin(fixture.source()).await;
    let Claim::Apply { cursor, .. } =
        claim(&*fixture, &tx, stream, &p, 1, RewindDebounce::NONE).await
    else {
        panic!("expected events to apply");
    };
    fixture
        .store()
        .commit(
            tx,
            &commit_of(&cursor, deepest.clone(), &ids[..1]),
            Release::Keep,
        )
        .await
        .map(|c| c.revision)
        .expect("the deepest readable state");
    let (_, stored) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(stored, Some(deepest.clone()));
    // The pair goes on: the next claim reads the state back.
    let tx = begin(fixture.source()).await;
    let Claim::Apply {
        state: claimed,
        events,
        ..
    } = claim(&*fixture, &tx, stream, &p, 1, RewindDebounce::NONE).await
    else {
        panic!("expected the second event to apply");
    };
    rollback(tx).await;
    assert_eq!(claimed, Some(deepest));
    assert_eq!(
        events.iter().map(|e| e.event_id).collect::<Vec<_>>(),
        ids[1..]
    );
}

// ---- Batches ---------------------------------------------------------------------------------

/// Limits with these bounds, the default bytes, and a scan no case's database reaches (parked
/// pairs of [`isolate`] count towards it).
fn limits(pairs: usize, events_per_pair: usize, events: usize) -> BatchLimits {
    let mut limits = BatchLimits::default();
    limits.pairs = pairs;
    limits.events_per_pair = events_per_pair;
    limits.events = events;
    limits.scan = ALL_PAIRS;
    limits
}

/// Every perspective of `names`, from its first stream.
fn from_start(names: &[PerspectiveName]) -> Vec<(PerspectiveName, Option<StreamId>)> {
    names.iter().map(|p| (p.clone(), None)).collect()
}

async fn claim_batch<F: PerspectiveStoreFixture>(
    fixture: &F,
    tx: &F::Tx,
    positions: Vec<(PerspectiveName, Option<StreamId>)>,
    limits: BatchLimits,
) -> ClaimedBatch {
    let mut request = BatchClaim::new(&[]);
    request.positions = positions;
    request.limits = limits;
    fixture
        .store()
        .claim_batch(tx, &request)
        .await
        .expect("claim_batch")
}

/// A batch as `(stream, perspective, events)`, in claim order; `None` for a rewind.
fn work_of(batch: &ClaimedBatch) -> Vec<(StreamId, PerspectiveName, Option<Vec<Uuid>>)> {
    batch
        .pairs
        .iter()
        .map(|p| {
            let events = match &p.work {
                ClaimedWork::Apply { events, .. } => Some(event_ids(events)),
                ClaimedWork::Rewind => None,
                other => panic!("unexpected work {other:?}"),
            };
            (
                p.cursor.pair.stream_id,
                p.cursor.pair.perspective.clone(),
                events,
            )
        })
        .collect()
}

/// The streams a batch claimed, in claim order.
fn streams_of(batch: &ClaimedBatch) -> Vec<StreamId> {
    batch
        .pairs
        .iter()
        .map(|p| p.cursor.pair.stream_id)
        .collect()
}

/// A claim of the batch in a transaction of its own, rolled back.
async fn peek_batch<F: PerspectiveStoreFixture>(
    fixture: &F,
    positions: Vec<(PerspectiveName, Option<StreamId>)>,
    limits: BatchLimits,
) -> ClaimedBatch {
    let tx = begin(fixture.source()).await;
    let batch = claim_batch(fixture, &tx, positions, limits).await;
    rollback(tx).await;
    batch
}

/// Parks every pair of `perspectives` that has work now — on a shared database, the catch-up
/// of earlier cases' streams — so that their batches hand out only the case's own pairs.
async fn isolate<F: PerspectiveStoreFixture>(fixture: &F, perspectives: &[PerspectiveName]) {
    let tx = begin(fixture.source()).await;
    let foreign = fixture
        .store()
        .pending_pairs(
            &tx,
            InstanceId::random(),
            perspectives,
            RewindDebounce::NONE,
            ALL_PAIRS,
        )
        .await
        .expect("pending_pairs");
    let park = PairFailure::new("another case's stream").park(true);
    for pair in foreign {
        fixture
            .store()
            .record_failure(&tx, &pair.pair, &park)
            .await
            .expect("record_failure");
    }
    commit(tx).await.expect("commit");
}

/// `n` fresh streams of `events` events each, in stream order, with their event ids.
async fn streams_with<F: PerspectiveStoreFixture>(
    fixture: &F,
    n: usize,
    events: usize,
) -> Vec<(StreamId, Vec<Uuid>)> {
    let mut streams = Vec::new();
    for _ in 0..n {
        let ids = ids(events);
        streams.push((stream_with(fixture, &ids).await, ids));
    }
    streams.sort();
    streams
}

/// Records `failure` on the pair in a transaction of its own; whether it is parked.
async fn fail<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    p: &PerspectiveName,
    failure: PairFailure,
) -> bool {
    let tx = begin(fixture.source()).await;
    let parked = fixture
        .store()
        .record_failure(&tx, &lockstep_core::Pair::new(stream, p.clone()), &failure)
        .await
        .expect("record_failure");
    commit(tx).await.expect("commit");
    parked
}

/// The fold of `events` on the claimed state, as a commit from the claimed cursor.
fn commit_of(
    cursor: &Cursor,
    state: Option<&serde_json::Value>,
    events: &[RecordedEvent],
) -> StateCommit {
    let mut change = StateCommit::new(cursor.pair.clone(), cursor.revision, folded(state, events));
    change.last_event_id = events.last().map(|e| e.event_id);
    change.applied_count = cursor.applied_count + events.len() as u64;
    change.applied_events = event_ids(events);
    change
}

/// A batch claims pairs of the requested perspectives only, and stops at its bounds: `pairs`,
/// `events_per_pair`, `events`; with `bytes = 1` it holds exactly one event. Bad limits are
/// `InvalidInput`.
pub async fn a_batch_claims_only_the_requested_perspectives_within_its_limits<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let (a, b, c) = (name("BatchA"), name("BatchB"), name("NotAsked"));
    register(&*fixture, &[a.clone(), b.clone(), c.clone()]).await;
    isolate(&*fixture, &[a.clone(), b.clone(), c.clone()]).await;
    let streams = streams_with(&*fixture, 3, 3).await;
    let asked = from_start(&[a.clone(), b.clone()]);

    let batch = peek_batch(&*fixture, asked.clone(), limits(4, 2, 7)).await;
    let expected = vec![
        (streams[0].0, a.clone(), Some(streams[0].1[..2].to_vec())),
        (streams[1].0, a.clone(), Some(streams[1].1[..2].to_vec())),
        (streams[2].0, a.clone(), Some(streams[2].1[..2].to_vec())),
        // Seven events in all: one left for the fourth pair.
        (streams[0].0, b.clone(), Some(streams[0].1[..1].to_vec())),
    ];
    assert_eq!(
        work_of(&batch),
        expected,
        "a's pairs in stream order, then b's"
    );
    assert!(batch.pairs.iter().all(|p| p.cursor.pair.perspective != c));
    let first = &batch.pairs[0];
    assert_eq!(first.cursor.revision, 0);
    assert!(
        matches!(&first.work, ClaimedWork::Apply { state: None, events } if events[0].payload["n"] == 1)
    );

    let batch = peek_batch(&*fixture, asked.clone(), limits(2, ALL_EVENTS, ALL_EVENTS)).await;
    assert_eq!(
        work_of(&batch),
        vec![
            (streams[0].0, a.clone(), Some(streams[0].1.clone())),
            (streams[1].0, a.clone(), Some(streams[1].1.clone())),
        ],
        "two pairs, every event of each"
    );

    let mut tiny = limits(ALL_PAIRS, ALL_EVENTS, ALL_EVENTS);
    tiny.bytes = 1;
    let batch = peek_batch(&*fixture, asked.clone(), tiny).await;
    assert_eq!(
        work_of(&batch),
        vec![(streams[0].0, a.clone(), Some(streams[0].1[..1].to_vec()))],
        "one event, larger than the bound, alone"
    );

    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&c)),
        limits(1, 1, 1),
    )
    .await;
    assert_eq!(batch.pairs.len(), 1, "c's own batch does claim c");
    assert_eq!(batch.pairs[0].cursor.pair.perspective, c);

    let tx = begin(fixture.source()).await;
    for bad in [limits(0, 1, 1), limits(1, 0, 1), limits(1, 1, 0)] {
        let mut request = BatchClaim::new(std::slice::from_ref(&a));
        request.limits = bad;
        let err = fixture
            .store()
            .claim_batch(&tx, &request)
            .await
            .expect_err("bad limits");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    }
    rollback(tx).await;
}

/// Two open transactions' batches claim disjoint pairs: the second skips the rows the first
/// holds, without waiting for it.
pub async fn concurrent_batches_claim_disjoint_pairs_without_waiting<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("Disjoint");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 4, 2).await;
    let all: Vec<StreamId> = streams.iter().map(|(s, _)| *s).collect();
    let first = begin(fixture.source()).await;
    let one = claim_batch(
        &*fixture,
        &first,
        from_start(std::slice::from_ref(&p)),
        limits(2, 10, 100),
    )
    .await;
    assert_eq!(streams_of(&one), all[..2]);
    let second = begin(fixture.source()).await;
    let two = tokio::time::timeout(
        Duration::from_secs(10),
        claim_batch(
            &*fixture,
            &second,
            from_start(std::slice::from_ref(&p)),
            limits(10, 10, 100),
        ),
    )
    .await
    .expect("a batch never waits for another transaction's rows");
    assert_eq!(
        streams_of(&two),
        all[2..],
        "only the pairs the first does not hold"
    );
    rollback(second).await;
    rollback(first).await;
    let again = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(streams_of(&again), all, "every pair once both ended");
}

/// A pair under a live lease is left out of every batch, and claimed again after the release.
pub async fn a_batch_skips_a_pair_under_a_live_lease<F: PerspectiveStoreFixture>(fixture: Arc<F>) {
    let p = name("BatchLeased");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 2, 1).await;
    let (leased, free) = (streams[0].0, streams[1].0);
    let lease = lease(&*fixture, leased, &p, &LockReason::Rewind).await;
    renew(&*fixture, &lease).await;
    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(streams_of(&batch), [free], "the leased pair is not claimed");
    let released = fixture.locker().release(&lease.id).await.expect("release");
    assert!(released.is_released());
    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(streams_of(&batch), [leased, free]);
}

/// A pair whose failure backs it off (an hour) is left out of batches — an explicit claim still
/// gets it; a failure retried at once does not hold its pair back.
pub async fn a_batch_skips_a_pair_that_backs_off<F: PerspectiveStoreFixture>(fixture: Arc<F>) {
    let p = name("BackingOff");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 2, 1).await;
    let (waiting, retried) = (streams[0].0, streams[1].0);
    let hour = Duration::from_secs(3600);
    assert!(
        !fail(
            &*fixture,
            waiting,
            &p,
            PairFailure::new("boom").retry_after(hour)
        )
        .await
    );
    assert!(
        !fail(
            &*fixture,
            retried,
            &p,
            PairFailure::new("boom").retry_after(Duration::ZERO)
        )
        .await
    );
    let backing_off = cursor(&*fixture, waiting, &p).await.expect("cursor");
    let at_once = cursor(&*fixture, retried, &p).await.expect("cursor");
    let (later, now) = (
        backing_off.retry_at.expect("backing off"),
        at_once.retry_at.expect("retry_at"),
    );
    assert!(
        later >= now + time::Duration::minutes(59),
        "{later} vs {now}"
    );

    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        streams_of(&batch),
        [retried],
        "only the pair retried at once"
    );
    let tx = begin(fixture.source()).await;
    assert!(
        matches!(
            claim(&*fixture, &tx, waiting, &p, 10, RewindDebounce::NONE).await,
            Claim::Apply { .. }
        ),
        "an explicit claim does not wait for the backoff"
    );
    rollback(tx).await;
}

/// A parked pair is left out of batches while its work keeps queueing; `parked_pairs` lists it
/// with its error, failure count and failed event; after `unpark` (which keeps the error text)
/// a batch claims it with all its work.
pub async fn a_parked_pair_is_listed_and_only_claimed_again_after_unpark<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Parked");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids[..1]).await;
    assert!(
        !fail(
            &*fixture,
            stream,
            &p,
            PairFailure::new("first").at_event(Some(ids[0]))
        )
        .await
    );
    let failure = PairFailure::new("apply failed")
        .at_event(Some(ids[0]))
        .retry_after(Duration::ZERO)
        .park(true);
    assert!(fail(&*fixture, stream, &p, failure).await, "parked");

    let asked = from_start(std::slice::from_ref(&p));
    assert!(
        peek_batch(&*fixture, asked.clone(), limits(10, 10, 100))
            .await
            .pairs
            .is_empty()
    );
    append(&*fixture, stream, &[event(ids[1], 2)]).await;
    assert_eq!(
        pending(&*fixture, stream, &p).await,
        ids,
        "work keeps queueing"
    );

    let tx = begin(fixture.source()).await;
    let parked = fixture
        .store()
        .parked_pairs(&tx, std::slice::from_ref(&p), ALL_PAIRS)
        .await
        .expect("parked_pairs");
    let all = fixture
        .store()
        .parked_pairs(&tx, &[], ALL_PAIRS)
        .await
        .expect("parked_pairs");
    let other = fixture
        .store()
        .parked_pairs(&tx, &[name("NoneParked")], ALL_PAIRS)
        .await
        .expect("parked_pairs");
    rollback(tx).await;
    let listed = parked
        .iter()
        .find(|c| c.pair.stream_id == stream)
        .expect("listed");
    assert_eq!(listed.pair.perspective, p);
    assert_eq!(listed.error.as_deref(), Some("apply failed"));
    assert_eq!(listed.failures, 2);
    assert_eq!(listed.failed_event_id, Some(ids[0]));
    assert!(listed.parked_at.is_some() && listed.retry_at.is_some());
    assert!(
        all.iter()
            .any(|c| c.pair.stream_id == stream && c.pair.perspective == p),
        "all perspectives"
    );
    assert!(other.is_empty());
    assert!(
        parked
            .iter()
            .all(|c| c.pair.perspective == p && c.parked_at.is_some())
    );
    assert!(
        parked.windows(2).all(|w| w[0].parked_at <= w[1].parked_at),
        "longest parked first"
    );

    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .unpark(&tx, &lockstep_core::Pair::new(stream, p.clone()))
            .await
            .expect("unpark")
    );
    assert!(
        !fixture
            .store()
            .unpark(
                &tx,
                &lockstep_core::Pair::new(StreamId::new_v7(), p.clone())
            )
            .await
            .expect("unpark"),
        "no cursor"
    );
    commit(tx).await.expect("commit");
    let retried = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (retried.parked_at, retried.retry_at, retried.failures),
        (None, None, 0)
    );
    assert_eq!(
        retried.error.as_deref(),
        Some("apply failed"),
        "the text stays"
    );
    // ... but a retried pair is not failing (an operator's `--check` must not fail on the
    // pair it just retried) until it fails again.
    let failing_and_in_error = || async {
        let tx = begin(fixture.source()).await;
        let failing = fixture
            .store()
            .failing_pairs(&tx, std::slice::from_ref(&p), ALL_PAIRS)
            .await
            .expect("failing_pairs");
        let status = fixture
            .store()
            .perspective_status(&tx)
            .await
            .expect("perspective_status");
        rollback(tx).await;
        let in_error = status
            .iter()
            .find(|s| s.perspective == p)
            .map(|s| s.in_error);
        (
            failing
                .iter()
                .filter(|c| c.pair.stream_id == stream)
                .count(),
            in_error,
        )
    };
    assert_eq!(failing_and_in_error().await, (0, Some(0)), "retried");
    let batch = peek_batch(&*fixture, asked, limits(10, 10, 100)).await;
    assert_eq!(work_of(&batch), [(stream, p.clone(), Some(ids.clone()))]);
    assert!(
        !fail(
            &*fixture,
            stream,
            &p,
            PairFailure::new("again").at_event(Some(ids[0]))
        )
        .await
    );
    assert_eq!(failing_and_in_error().await, (1, Some(1)), "failed again");
}

/// An operator's rewind request retries a parked pair: the next batch hands it out as a rewind.
pub async fn a_rewind_request_retries_a_parked_pair<F: PerspectiveStoreFixture>(fixture: Arc<F>) {
    let p = name("ParkedRewound");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(1);
    let stream = stream_with(&*fixture, &ids).await;
    let hour = Duration::from_secs(3600);
    assert!(
        fail(
            &*fixture,
            stream,
            &p,
            PairFailure::new("boom").retry_after(hour).park(true)
        )
        .await
    );
    let asked = from_start(std::slice::from_ref(&p));
    assert!(
        peek_batch(&*fixture, asked.clone(), limits(10, 10, 100))
            .await
            .pairs
            .is_empty()
    );
    request(&*fixture, stream, &p, None).await;
    let after = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (after.parked_at, after.retry_at, after.failures),
        (None, None, 0)
    );
    let batch = peek_batch(&*fixture, asked, limits(10, 10, 100)).await;
    assert_eq!(work_of(&batch), [(stream, p.clone(), None)]);
}

/// With `pairs = 1` and the returned positions passed back, successive batches hand out the
/// pairs in stream order and wrap round to the first.
pub async fn batch_positions_go_round_the_pairs_in_stream_order<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("Rotating");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams: Vec<StreamId> = streams_with(&*fixture, 3, 1)
        .await
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let mut positions = from_start(std::slice::from_ref(&p));
    for expected in [streams[0], streams[1], streams[2], streams[0], streams[1]] {
        let batch = peek_batch(&*fixture, positions, limits(1, 10, 100)).await;
        assert_eq!(streams_of(&batch), [expected]);
        assert_eq!(
            batch.positions,
            [(p.clone(), Some(expected))],
            "stopped at the claimed pair"
        );
        positions = batch.positions;
    }
}

/// A batch looks at no more than `scan` pairs: when the first pairs in stream order are all
/// parked, it comes back empty with its position moved past the ones it looked at, and the next
/// claim from there reaches the healthy pair.
pub async fn the_scan_bound_moves_the_position_past_pairs_it_cannot_serve<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Scanned");
    register(&*fixture, std::slice::from_ref(&p)).await;
    // Streams of one random 64-bit prefix: no other stream sorts between them.
    let prefix = Uuid::new_v4().as_u64_pair().0;
    let stream = |i: u64| StreamId::from_uuid(Uuid::from_u64_pair(prefix, i));
    for i in 1..=4 {
        append(&*fixture, stream(i), &[event(Uuid::now_v7(), 1)]).await;
    }
    for i in 1..=3 {
        assert!(
            fail(
                &*fixture,
                stream(i),
                &p,
                PairFailure::new("boom").park(true)
            )
            .await
        );
    }
    let mut bounded = limits(1, 10, 100);
    bounded.scan = 2;
    let batch = peek_batch(&*fixture, vec![(p.clone(), Some(stream(0)))], bounded).await;
    assert!(
        batch.pairs.is_empty(),
        "two parked pairs looked at: {batch:?}"
    );
    assert_eq!(
        batch.positions,
        [(p.clone(), Some(stream(2)))],
        "moved past them"
    );
    let batch = peek_batch(&*fixture, batch.positions, bounded).await;
    assert_eq!(streams_of(&batch), [stream(4)], "the healthy pair");
    assert_eq!(batch.positions, [(p.clone(), Some(stream(4)))]);
}

/// `commit_batch` commits every entry in one call and reports each: a commit; a commit with a
/// stale expected revision, refused alone (`Conflict`, nothing of it written); one under a lost
/// lease (`LeaseLost`); the events before a failing one committed with the failure stored;
/// a failure alone, parking its pair.
pub async fn commit_batch_commits_each_entry_and_refuses_a_stale_one_alone<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("BatchCommit");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 5, 3).await;
    let (ok, stale, fenced, partial, failed) = (
        &streams[0],
        &streams[1],
        &streams[2],
        &streams[3],
        &streams[4],
    );
    let lost = lease(&*fixture, fenced.0, &p, &LockReason::Rewind).await;
    let released = fixture.locker().release(&lost.id).await.expect("release");
    assert!(released.is_released());

    let tx = begin(fixture.source()).await;
    let batch = claim_batch(
        &*fixture,
        &tx,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        streams_of(&batch),
        streams.iter().map(|(s, _)| *s).collect::<Vec<_>>()
    );
    let mut entries = Vec::new();
    for claimed in &batch.pairs {
        let ClaimedWork::Apply { state, events } = &claimed.work else {
            panic!("expected events to apply");
        };
        let cursor = &claimed.cursor;
        let pair = cursor.pair.clone();
        let stream = cursor.pair.stream_id;
        let entry = if stream == ok.0 {
            BatchEntry::new(pair, Some(commit_of(cursor, state.as_ref(), events)), None)
        } else if stream == stale.0 {
            let mut change = commit_of(cursor, state.as_ref(), events);
            change.expected_revision = cursor.revision + 1;
            BatchEntry::new(pair, Some(change), None)
        } else if stream == fenced.0 {
            let mut change = commit_of(cursor, state.as_ref(), events);
            change.fence = Some(lost.id.clone());
            BatchEntry::new(pair, Some(change), None)
        } else if stream == partial.0 {
            let failure = PairFailure::new("apply failed at the second event")
                .at_event(Some(events[1].event_id))
                .retry_after(Duration::from_secs(3600));
            BatchEntry::new(
                pair,
                Some(commit_of(cursor, state.as_ref(), &events[..1])),
                Some(failure),
            )
        } else {
            let failure = PairFailure::new("apply failed at once")
                .at_event(Some(events[0].event_id))
                .park(true);
            BatchEntry::new(pair, None, Some(failure))
        };
        entries.push(entry);
    }
    let done = fixture
        .store()
        .commit_batch(&tx, &entries)
        .await
        .expect("commit_batch");
    let revision = batch.pairs[0].cursor.revision + 1;
    assert_eq!(
        done,
        [
            BatchCommitted::Committed {
                revision,
                parked: false
            },
            BatchCommitted::Refused(ErrorKind::Conflict),
            BatchCommitted::Refused(ErrorKind::LeaseLost),
            BatchCommitted::Committed {
                revision: batch.pairs[3].cursor.revision + 1,
                parked: false
            },
            BatchCommitted::FailureRecorded { parked: true },
        ]
    );
    commit(tx).await.expect("commit");

    let (after, stored) = state(&*fixture, ok.0, &p).await.expect("cursor");
    assert_eq!(
        (after.revision, after.last_event_id),
        (revision, Some(ok.1[2]))
    );
    assert_eq!(stored, Some(serde_json::json!({ "sum": 6 })));
    assert!(pending(&*fixture, ok.0, &p).await.is_empty());
    for untouched in [stale, fenced] {
        let (after, stored) = state(&*fixture, untouched.0, &p).await.expect("cursor");
        assert_eq!(
            (after.last_event_id, after.applied_count, stored),
            (None, 0, None)
        );
        assert_eq!((after.error, after.failures), (None, 0));
        assert_eq!(
            pending(&*fixture, untouched.0, &p).await,
            untouched.1,
            "nothing written"
        );
    }
    let (after, stored) = state(&*fixture, partial.0, &p).await.expect("cursor");
    assert_eq!(
        (after.last_event_id, after.applied_count),
        (Some(partial.1[0]), 1)
    );
    assert_eq!(stored, Some(serde_json::json!({ "sum": 1 })));
    assert_eq!(
        after.error.as_deref(),
        Some("apply failed at the second event")
    );
    assert_eq!(
        (after.failures, after.failed_event_id),
        (1, Some(partial.1[1]))
    );
    assert!(after.retry_at.is_some() && after.parked_at.is_none());
    assert_eq!(pending(&*fixture, partial.0, &p).await, partial.1[1..]);
    let after = cursor(&*fixture, failed.0, &p).await.expect("cursor");
    assert_eq!(
        (after.failures, after.failed_event_id),
        (1, Some(failed.1[0]))
    );
    assert!(after.parked_at.is_some());
    assert_eq!(pending(&*fixture, failed.0, &p).await, failed.1);

    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        streams_of(&batch),
        [stale.0, fenced.0],
        "not the backing-off and the parked pair, nor the one without work"
    );
}

/// A batch commit with one bad entry — a commit of another pair, a state that cannot be
/// stored, neither commit nor failure — is `InvalidInput` and writes none of its entries.
pub async fn an_invalid_batch_entry_writes_nothing_of_any_entry<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("BatchInvalid");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 2, 1).await;
    let tx = begin(fixture.source()).await;
    let batch = claim_batch(
        &*fixture,
        &tx,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    let commits: Vec<(Pair, StateCommit)> = batch
        .pairs
        .iter()
        .map(|c| {
            let ClaimedWork::Apply { state, events } = &c.work else {
                panic!("expected events to apply");
            };
            (
                c.cursor.pair.clone(),
                commit_of(&c.cursor, state.as_ref(), events),
            )
        })
        .collect();
    assert_eq!(commits.len(), 2);
    let good = BatchEntry::new(commits[0].0.clone(), Some(commits[0].1.clone()), None);
    let mut unstorable = commits[1].1.clone();
    unstorable.state = serde_json::json!({ "note": "a\u{0}b" });
    let bad = [
        BatchEntry::new(commits[1].0.clone(), Some(commits[0].1.clone()), None),
        BatchEntry::new(commits[1].0.clone(), Some(unstorable), None),
        BatchEntry::new(commits[1].0.clone(), None, None),
    ];
    for bad in bad {
        let err = fixture
            .store()
            .commit_batch(&tx, &[good.clone(), bad.clone()])
            .await
            .expect_err("a bad entry");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{bad:?}: {err}");
    }
    commit(tx).await.expect("still usable");
    for (stream, ids) in &streams {
        let (after, stored) = state(&*fixture, *stream, &p).await.expect("cursor");
        assert_eq!(
            (after.revision, after.last_event_id, stored),
            (0, None, None)
        );
        assert_eq!(
            &pending(&*fixture, *stream, &p).await,
            ids,
            "nothing written"
        );
    }
}

/// A successful commit — by `commit` or in a batch — clears the pair's error, failure
/// count, failed event, backoff and parking.
pub async fn a_successful_commit_clears_the_error_the_backoff_and_the_parking<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Healed");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 2, 1).await;
    let hour = Duration::from_secs(3600);
    for (i, (stream, ids)) in streams.iter().enumerate() {
        let failure = PairFailure::new("boom")
            .at_event(Some(ids[0]))
            .retry_after(hour)
            .park(true);
        assert!(fail(&*fixture, *stream, &p, failure).await);
        let failed = cursor(&*fixture, *stream, &p).await.expect("cursor");
        assert!(failed.parked_at.is_some() && failed.retry_at.is_some());
        assert_eq!((failed.failures, failed.failed_event_id), (1, Some(ids[0])));

        // An explicit claim does not wait for the parking.
        let tx = begin(fixture.source()).await;
        let Claim::Apply {
            cursor: claimed,
            state,
            events,
            ..
        } = claim(&*fixture, &tx, *stream, &p, 10, RewindDebounce::NONE).await
        else {
            panic!("expected events to apply");
        };
        let change = commit_of(&claimed, state.as_ref(), &events);
        if i == 0 {
            fixture
                .store()
                .commit(tx, &change, Release::Keep)
                .await
                .expect("commit");
        } else {
            let done = fixture
                .store()
                .commit_batch(
                    &tx,
                    &[BatchEntry::new(claimed.pair.clone(), Some(change), None)],
                )
                .await
                .expect("commit_batch");
            assert_eq!(
                done,
                [BatchCommitted::Committed {
                    revision: claimed.revision + 1,
                    parked: false
                }]
            );
            commit(tx).await.expect("commit");
        }
        let healed = cursor(&*fixture, *stream, &p).await.expect("cursor");
        assert_eq!(
            (healed.error, healed.failures, healed.failed_event_id),
            (None, 0, None)
        );
        assert_eq!((healed.retry_at, healed.parked_at), (None, None));
    }
}

/// A pair that failed at an event after its cursor is handed out by a batch up to that event
/// only, so that a poisoned pair's retry costs what its failing event costs; once a commit has
/// cleared the failure, the rest comes at full size. A failed event with no work left up to it
/// (skipped or purged meanwhile) does not hold the pair back: its work comes as before.
pub async fn a_failed_pair_is_retried_up_to_its_failed_event<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("RetriedAtItsEvent");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 2, 5).await;
    let ((poisoned, poisoned_ids), (gone, gone_ids)) = (&streams[0], &streams[1]);
    let at = |event: Uuid| {
        PairFailure::new("boom")
            .at_event(Some(event))
            .retry_after(Duration::ZERO)
    };
    assert!(!fail(&*fixture, *poisoned, &p, at(poisoned_ids[2])).await);
    // An id below every event of the stream: nothing is pending up to it.
    assert!(!fail(&*fixture, *gone, &p, at(Uuid::from_u128(1))).await);

    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        work_of(&batch),
        [
            (*poisoned, p.clone(), Some(poisoned_ids[..3].to_vec())),
            (*gone, p.clone(), Some(gone_ids.clone())),
        ],
        "the failed pair up to its failed event; the other with all its work"
    );

    // The retry succeeds: its commit clears the failure, and the rest comes at full size.
    let tx = begin(fixture.source()).await;
    let batch = claim_batch(
        &*fixture,
        &tx,
        from_start(std::slice::from_ref(&p)),
        limits(1, 10, 100),
    )
    .await;
    let [claimed] = &batch.pairs[..] else {
        panic!("one pair claimed, not {:?}", work_of(&batch));
    };
    let ClaimedWork::Apply { state, events } = &claimed.work else {
        panic!("expected events to apply");
    };
    assert_eq!(event_ids(events), poisoned_ids[..3]);
    let change = commit_of(&claimed.cursor, state.as_ref(), events);
    let done = fixture
        .store()
        .commit_batch(
            &tx,
            &[BatchEntry::new(
                claimed.cursor.pair.clone(),
                Some(change),
                None,
            )],
        )
        .await
        .expect("commit_batch");
    assert!(matches!(done[..], [BatchCommitted::Committed { .. }]));
    commit(tx).await.expect("commit");
    let healed = cursor(&*fixture, *poisoned, &p).await.expect("cursor");
    assert_eq!((healed.failures, healed.failed_event_id), (0, None));
    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        work_of(&batch)[0],
        (*poisoned, p.clone(), Some(poisoned_ids[3..].to_vec())),
    );
}

/// Claims the one pair of `p` with work in a batch, commits its first event with `failure` in
/// one entry (the events before a failing one, as the worker commits them) and ends the
/// transaction; the claimed revision and the commit's answer.
async fn commit_first_event_with<F: PerspectiveStoreFixture>(
    fixture: &F,
    p: &PerspectiveName,
    failure: PairFailure,
) -> (i64, Vec<BatchCommitted>) {
    let tx = begin(fixture.source()).await;
    let batch = claim_batch(
        fixture,
        &tx,
        from_start(std::slice::from_ref(p)),
        limits(10, 10, 100),
    )
    .await;
    let [claimed] = &batch.pairs[..] else {
        panic!("one pair claimed, not {:?}", work_of(&batch));
    };
    let ClaimedWork::Apply { state, events } = &claimed.work else {
        panic!("expected events to apply");
    };
    let prefix = commit_of(&claimed.cursor, state.as_ref(), &events[..1]);
    let done = fixture
        .store()
        .commit_batch(
            &tx,
            &[BatchEntry::new(
                claimed.cursor.pair.clone(),
                Some(prefix),
                Some(failure),
            )],
        )
        .await
        .expect("commit_batch");
    commit(tx).await.expect("commit");
    (claimed.cursor.revision, done)
}

/// A pair whose batch committed the events before its failing one is retried at the failing
/// event alone; a failure recorded at an event its cursor has passed does not bound it.
pub async fn a_pair_failed_after_its_prefix_is_retried_at_the_failing_event<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("RetriedAfterPrefix");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 1, 4).await;
    let (stream, ids) = &streams[0];
    let failure = PairFailure::new("apply failed at the second event")
        .at_event(Some(ids[1]))
        .retry_after(Duration::ZERO);
    let (_, done) = commit_first_event_with(&*fixture, &p, failure).await;
    assert!(matches!(
        done[..],
        [BatchCommitted::Committed { parked: false, .. }]
    ));

    let retry = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        work_of(&retry),
        [(*stream, p.clone(), Some(vec![ids[1]]))],
        "the failing event alone"
    );

    // A failure recorded at an event the cursor has passed: no bound.
    let passed = PairFailure::new("boom")
        .at_event(Some(ids[0]))
        .retry_after(Duration::ZERO);
    assert!(!fail(&*fixture, *stream, &p, passed).await);
    let retry = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        work_of(&retry),
        [(*stream, p.clone(), Some(ids[1..].to_vec()))]
    );
}

/// A batch entry that commits the events before its failing one and parks the pair (a
/// perspective that parks at its first failure) is answered `Committed { parked: true }`: the
/// prefix is stored, the failure and the parking too, and the work from the failing event on
/// stays queued.
pub async fn a_batch_entry_can_commit_its_prefix_and_park_its_pair<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("PrefixThenParked");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 1, 3).await;
    let (stream, ids) = &streams[0];
    let failure = PairFailure::new("apply failed at the second event")
        .at_event(Some(ids[1]))
        .park(true);
    let (revision, done) = commit_first_event_with(&*fixture, &p, failure).await;
    assert_eq!(
        done,
        [BatchCommitted::Committed {
            revision: revision + 1,
            parked: true
        }]
    );
    let (after, stored) = state(&*fixture, *stream, &p).await.expect("cursor");
    assert_eq!(
        (after.last_event_id, after.applied_count),
        (Some(ids[0]), 1)
    );
    assert_eq!(stored, Some(serde_json::json!({ "sum": 1 })));
    assert_eq!((after.failures, after.failed_event_id), (1, Some(ids[1])));
    assert!(after.parked_at.is_some() && after.error.is_some());
    assert_eq!(pending(&*fixture, *stream, &p).await, ids[1..]);
}

/// In a batch, a late arrival is handed out as a rewind (the request is kept by committing),
/// held back inside the debounce window (request kept too), and a rewind request on a pair
/// with no pending work is handed out as a rewind.
pub async fn a_batch_hands_out_late_arrivals_and_rewind_requests_as_rewinds<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("BatchRewind");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let (late_ids, idle_ids) = (ids(2), ids(1));
    let late = stream_with(&*fixture, &late_ids[1..]).await;
    let idle = stream_with(&*fixture, &idle_ids).await;
    apply(&*fixture, late, &p, ALL_EVENTS, false).await;
    apply(&*fixture, idle, &p, ALL_EVENTS, false).await;
    append(&*fixture, late, &[event(late_ids[0], 5)]).await;
    let asked = from_start(std::slice::from_ref(&p));

    let mut debounced = BatchClaim::new(std::slice::from_ref(&p));
    debounced.debounce = HOUR;
    debounced.limits = limits(10, 10, 100);
    let tx = begin(fixture.source()).await;
    let batch = fixture
        .store()
        .claim_batch(&tx, &debounced)
        .await
        .expect("claim_batch");
    assert!(
        batch.pairs.is_empty(),
        "held back inside the window: {batch:?}"
    );
    commit(tx).await.expect("commit");
    assert_eq!(
        trigger(&*fixture, late, &p).await,
        Some(late_ids[0]),
        "flagged"
    );

    let tx = begin(fixture.source()).await;
    let batch = claim_batch(&*fixture, &tx, asked.clone(), limits(10, 10, 100)).await;
    assert_eq!(work_of(&batch), [(late, p.clone(), None)]);
    let flagged = batch.pairs[0].cursor.rewind.expect("a rewind request");
    assert_eq!(flagged.trigger, late_ids[0]);
    commit(tx).await.expect("commit");
    assert_eq!(
        pending(&*fixture, late, &p).await,
        late_ids[..1],
        "work kept"
    );

    request(&*fixture, idle, &p, None).await;
    assert!(pending(&*fixture, idle, &p).await.is_empty());
    let mut streams = vec![late, idle];
    streams.sort();
    let batch = peek_batch(&*fixture, asked, limits(10, 10, 100)).await;
    let mut rewinds: Vec<StreamId> = work_of(&batch)
        .into_iter()
        .map(|(s, _, events)| {
            assert_eq!(events, None, "a rewind");
            s
        })
        .collect();
    rewinds.sort();
    assert_eq!(rewinds, streams, "both requests, the one without work too");
}

/// Rewind requests are looked at oldest first, and no more of them than the batch has room for
/// pairs (the claim's cost does not grow with requests it cannot serve): with room for one
/// pair, a claim whose oldest request is held by another open claim claims no request — it
/// does not go on to the next one, which a later claim gets.
pub async fn a_claim_looks_at_no_more_rewind_requests_than_it_has_room_for<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("RequestRoom");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let older = stream_with(&*fixture, &ids(1)).await;
    let younger = stream_with(&*fixture, &ids(1)).await;
    apply(&*fixture, older, &p, ALL_EVENTS, false).await;
    apply(&*fixture, younger, &p, ALL_EVENTS, false).await;
    request(&*fixture, older, &p, None).await;
    request(&*fixture, younger, &p, None).await;
    let asked = from_start(std::slice::from_ref(&p));
    let holder = begin(fixture.source()).await;
    let held = claim_batch(&*fixture, &holder, asked.clone(), limits(1, 10, 100)).await;
    assert_eq!(
        work_of(&held),
        [(older, p.clone(), None)],
        "the older request first"
    );
    let other = begin(fixture.source()).await;
    let batch = claim_batch(&*fixture, &other, asked.clone(), limits(1, 10, 100)).await;
    assert!(
        batch.pairs.is_empty(),
        "one request looked at, and another claim holds it: {batch:?}"
    );
    rollback(other).await;
    let batch = peek_batch(&*fixture, asked, limits(2, 10, 100)).await;
    assert_eq!(
        work_of(&batch),
        [(younger, p.clone(), None)],
        "with room for two, the younger one too"
    );
    rollback(holder).await;
}

/// `skip_event` skips a pending event for good: recorded with its reason, its work item gone,
/// the pair retried (unparked, no backoff); it changes nothing for an event that is not
/// pending. A purge keeps the skipped events, deleting the cursor deletes them.
pub async fn skip_event_skips_a_pending_event_for_good_and_retries_the_pair<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Skipping");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    let failure = PairFailure::new("poison")
        .at_event(Some(ids[0]))
        .retry_after(Duration::from_secs(3600))
        .park(true);
    assert!(fail(&*fixture, stream, &p, failure).await);

    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .skip_event(
                &tx,
                &lockstep_core::Pair::new(stream, p.clone()),
                ids[0],
                "poison payload"
            )
            .await
            .expect("skip_event")
    );
    commit(tx).await.expect("commit");
    assert_eq!(
        pending(&*fixture, stream, &p).await,
        ids[1..],
        "its work item is gone"
    );
    let retried = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (retried.parked_at, retried.retry_at, retried.failures),
        (None, None, 0)
    );
    let recorded = skipped(&*fixture, stream, &p).await;
    assert_eq!(recorded.len(), 1);
    assert_eq!(
        (recorded[0].event_id, recorded[0].reason.as_str()),
        (ids[0], "poison payload")
    );
    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        work_of(&batch),
        [(stream, p.clone(), Some(ids[1..].to_vec()))]
    );

    assert!(fail(&*fixture, stream, &p, PairFailure::new("again").park(true)).await);
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");
    let tx = begin(fixture.source()).await;
    for not_pending in [ids[0], Uuid::now_v7()] {
        assert!(
            !fixture
                .store()
                .skip_event(
                    &tx,
                    &lockstep_core::Pair::new(stream, p.clone()),
                    not_pending,
                    "nothing"
                )
                .await
                .expect("skip_event"),
            "not pending"
        );
    }
    commit(tx).await.expect("commit");
    assert_eq!(
        cursor(&*fixture, stream, &p).await,
        Some(before),
        "nothing changed"
    );
    assert_eq!(skipped(&*fixture, stream, &p).await.len(), 1);
    assert_eq!(pending(&*fixture, stream, &p).await, ids[1..]);

    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .purge(&tx, &lockstep_core::Pair::new(stream, p.clone()), None)
        .await
        .expect("purge");
    commit(tx).await.expect("commit");
    let purged = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (purged.error, purged.failures, purged.failed_event_id),
        (None, 0, None)
    );
    assert_eq!((purged.retry_at, purged.parked_at), (None, None));
    assert_eq!(
        skipped(&*fixture, stream, &p).await.len(),
        1,
        "a purge keeps them"
    );
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .delete_cursor(&tx, &lockstep_core::Pair::new(stream, p.clone()))
            .await
            .expect("delete")
    );
    commit(tx).await.expect("commit");
    assert!(
        skipped(&*fixture, stream, &p).await.is_empty(),
        "deleted with the cursor"
    );
}

/// A skip reason longer than [`SkippedEvent::MAX_REASON_CHARS`] (an operator pasting a payload,
/// 10 MB) is [`ErrorKind::InvalidInput`] before anything is written: the event stays pending,
/// the pair parked, nothing is recorded. A reason of exactly the limit is stored whole.
pub async fn a_skip_reason_longer_than_the_limit_is_invalid_input_and_changes_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("SkipReason");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    let failure = PairFailure::new("poison")
        .at_event(Some(ids[0]))
        .retry_after(Duration::from_secs(3600))
        .park(true);
    assert!(fail(&*fixture, stream, &p, failure).await);
    let pair = lockstep_core::Pair::new(stream, p.clone());
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");

    for reason in [
        "é".repeat(SkippedEvent::MAX_REASON_CHARS + 1),
        "x".repeat(10 << 20),
    ] {
        let tx = begin(fixture.source()).await;
        let err = fixture
            .store()
            .skip_event(&tx, &pair, ids[0], &reason)
            .await
            .expect_err("a reason over the limit is refused");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert_eq!(
            err.validation(),
            Some(&ValidationError::TextTooLong {
                field: "skip reason",
                chars: reason.chars().count(),
                max: SkippedEvent::MAX_REASON_CHARS,
            })
        );
        // The transaction is still usable: nothing was sent.
        commit(tx).await.expect("commit");
    }
    assert_eq!(
        cursor(&*fixture, stream, &p).await,
        Some(before),
        "nothing changed"
    );
    assert!(skipped(&*fixture, stream, &p).await.is_empty());
    assert_eq!(pending(&*fixture, stream, &p).await, ids);

    let at_limit = "é".repeat(SkippedEvent::MAX_REASON_CHARS);
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .skip_event(&tx, &pair, ids[0], &at_limit)
            .await
            .expect("a reason of the limit is accepted")
    );
    commit(tx).await.expect("commit");
    let recorded = skipped(&*fixture, stream, &p).await;
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0].reason, at_limit, "stored whole");
}

/// The committed skipped events of a pair.
async fn skipped<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    p: &PerspectiveName,
) -> Vec<SkippedEvent> {
    let tx = begin(fixture.source()).await;
    let skipped = fixture
        .store()
        .skipped_events(&tx, &lockstep_core::Pair::new(stream, p.clone()))
        .await
        .expect("skipped_events");
    rollback(tx).await;
    skipped
}

/// `perspective_status` counts a perspective's pairs, pending work (with the oldest's age),
/// rewind requests, failing, backing-off and parked pairs; `failing_pairs` lists the failing
/// ones of the perspectives asked for. Counted as changes from before this case's streams
/// existed, so that other streams on a shared database do not matter.
pub async fn perspective_status_counts_work_failures_backoff_and_parking<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let (p, other) = (name("Status"), name("StatusOther"));
    register(&*fixture, &[p.clone(), other.clone()]).await;
    let status_of = |name: PerspectiveName| {
        let fixture = Arc::clone(&fixture);
        async move {
            let tx = begin(fixture.source()).await;
            let all = fixture
                .store()
                .perspective_status(&tx)
                .await
                .expect("perspective_status");
            rollback(tx).await;
            all.into_iter()
                .find(|s| s.perspective == name)
                .expect("every registered perspective is listed")
        }
    };
    let before = status_of(p.clone()).await;
    let streams = [
        stream_with(&*fixture, &ids(2)).await,
        stream_with(&*fixture, &ids(1)).await,
        stream_with(&*fixture, &ids(2)).await,
    ];
    let tx = begin(fixture.source()).await;
    let store = fixture.store();
    let parked = PairFailure::new("parked here").park(true);
    assert!(
        store
            .record_failure(
                &tx,
                &lockstep_core::Pair::new(streams[0], p.clone()),
                &parked
            )
            .await
            .expect("record")
    );
    let waiting = PairFailure::new("backing off").retry_after(Duration::from_secs(3600));
    assert!(
        !store
            .record_failure(
                &tx,
                &lockstep_core::Pair::new(streams[1], p.clone()),
                &waiting
            )
            .await
            .expect("record")
    );
    store
        .ensure_cursor(&tx, &lockstep_core::Pair::new(streams[2], p.clone()))
        .await
        .expect("cursor");
    assert!(
        store
            .request_rewind(&tx, &lockstep_core::Pair::new(streams[2], p.clone()), None)
            .await
            .expect("rewind")
    );
    commit(tx).await.expect("commit");

    let after = status_of(p.clone()).await;
    assert_eq!(after.pairs - before.pairs, 3, "{after:?}");
    assert_eq!(after.pending_events - before.pending_events, 5, "{after:?}");
    assert!(after.oldest_pending_age.is_some(), "{after:?}");
    assert_eq!(
        after.rewinds_pending - before.rewinds_pending,
        1,
        "{after:?}"
    );
    assert_eq!(after.in_error - before.in_error, 2, "{after:?}");
    assert_eq!(after.backing_off - before.backing_off, 1, "{after:?}");
    assert_eq!(after.parked - before.parked, 1, "{after:?}");
    let untouched = status_of(other.clone()).await;
    assert_eq!(
        (
            untouched.in_error,
            untouched.parked,
            untouched.rewinds_pending
        ),
        (0, 0, 0),
        "another perspective's pairs are its own"
    );

    let tx = begin(fixture.source()).await;
    let failing = store
        .failing_pairs(&tx, std::slice::from_ref(&p), 100)
        .await
        .expect("failing_pairs");
    let none = store
        .failing_pairs(&tx, std::slice::from_ref(&other), 100)
        .await
        .expect("failing_pairs");
    rollback(tx).await;
    let mut listed: Vec<StreamId> = failing.iter().map(|c| c.pair.stream_id).collect();
    listed.sort();
    let mut expected = vec![streams[0], streams[1]];
    expected.sort();
    assert_eq!(listed, expected);
    assert!(
        failing
            .iter()
            .all(|c| c.pair.perspective == p && c.error.is_some())
    );
    assert!(none.is_empty());
}

// ---- Set-based batch commits and rewinds in fewer round trips -------------------------------

/// An event skipped between two pending ones is not handed out, however a store reads a
/// pair's events (e.g. as one range of the stream from the first pending event to the last):
/// the batch holds the events before and after it, and committing them leaves no work.
pub async fn an_event_skipped_between_pending_ones_is_not_handed_out<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("SkipMiddle");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(4);
    let stream = stream_with(&*fixture, &ids).await;
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .skip_event(
                &tx,
                &lockstep_core::Pair::new(stream, p.clone()),
                ids[1],
                "poison in the middle"
            )
            .await
            .expect("skip_event")
    );
    commit(tx).await.expect("commit");

    let tx = begin(fixture.source()).await;
    let batch = claim_batch(
        &*fixture,
        &tx,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    let kept = vec![ids[0], ids[2], ids[3]];
    assert_eq!(work_of(&batch), [(stream, p.clone(), Some(kept.clone()))]);
    let ClaimedWork::Apply {
        state: claimed,
        events,
    } = &batch.pairs[0].work
    else {
        panic!("expected events");
    };
    let change = commit_of(&batch.pairs[0].cursor, claimed.as_ref(), events);
    let done = fixture
        .store()
        .commit_batch(
            &tx,
            &[BatchEntry::new(
                batch.pairs[0].cursor.pair.clone(),
                Some(change),
                None,
            )],
        )
        .await
        .expect("commit_batch");
    assert!(
        matches!(done[..], [BatchCommitted::Committed { .. }]),
        "{done:?}"
    );
    commit(tx).await.expect("commit");
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    let (cursor, _) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (cursor.last_event_id, cursor.applied_count),
        (Some(ids[3]), 3)
    );
}

/// A late arrival enqueued (and committed) inside a claimed pair's range of events while its
/// batch is in flight is not deleted by the batch's commit — whatever way the store deletes
/// the applied work, e.g. by range of event ids — and the next claim rewinds the pair from it.
/// The other pair of the batch commits as usual.
pub async fn a_late_arrival_inside_a_claimed_range_survives_the_batch_commit<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("RangeLate");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let (late_ids, plain_ids) = (ids(3), ids(2));
    let late = stream_with(&*fixture, &[late_ids[0], late_ids[2]]).await;
    let plain = stream_with(&*fixture, &plain_ids).await;

    let tx = begin(fixture.source()).await;
    let batch = claim_batch(
        &*fixture,
        &tx,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    let mut claimed = work_of(&batch);
    claimed.sort();
    let mut expected = vec![
        (late, p.clone(), Some(vec![late_ids[0], late_ids[2]])),
        (plain, p.clone(), Some(plain_ids.clone())),
    ];
    expected.sort();
    assert_eq!(claimed, expected);
    // Between the first and the last claimed event of `late`, committed by another writer.
    append(&*fixture, late, &[event(late_ids[1], 7)]).await;
    let entries: Vec<BatchEntry> = batch
        .pairs
        .iter()
        .map(|pair| {
            let ClaimedWork::Apply { state, events } = &pair.work else {
                panic!("expected events: {pair:?}");
            };
            let change = commit_of(&pair.cursor, state.as_ref(), events);
            BatchEntry::new(pair.cursor.pair.clone(), Some(change), None)
        })
        .collect();
    let done = fixture
        .store()
        .commit_batch(&tx, &entries)
        .await
        .expect("commit_batch");
    assert!(
        done.iter()
            .all(|d| matches!(d, BatchCommitted::Committed { .. })),
        "{done:?}"
    );
    commit(tx).await.expect("commit");

    assert_eq!(
        pending(&*fixture, late, &p).await,
        late_ids[1..2],
        "the late arrival's work stays"
    );
    assert!(pending(&*fixture, plain, &p).await.is_empty());
    let (cursor, _) = state(&*fixture, late, &p).await.expect("cursor");
    assert_eq!(cursor.last_event_id, Some(late_ids[2]));
    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(work_of(&batch), [(late, p.clone(), None)], "a rewind");
    assert_eq!(
        batch.pairs[0].cursor.rewind.map(|r| r.trigger),
        Some(late_ids[1])
    );
}

/// A batch of plain entries commits each as `commit` would: exactly the applied work is
/// deleted (a work row inside the applied range that the entry did not apply stays), a fenced
/// entry under its live lease commits, an entry's snapshot is saved and only the newest
/// [`DEFAULT_KEEP_SNAPSHOTS`] are kept, and of two entries for one pair the second, computed
/// from the same revision, is refused alone.
pub async fn a_batch_of_plain_entries_commits_each_as_a_single_commit_would<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("BatchPlain");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 4, 3).await;
    let (gap, fenced, twice, pruned) = (&streams[0], &streams[1], &streams[2], &streams[3]);
    for (stream, _) in &streams {
        ensure_cursor(&*fixture, *stream, &p).await;
    }
    // `pruned` has the most snapshots kept already, one per event applied.
    for _ in 0..2 {
        apply(&*fixture, pruned.0, &p, 1, true).await;
    }
    let extra = ids(1)[0];
    append(&*fixture, pruned.0, &[event(extra, 100)]).await;
    apply(&*fixture, pruned.0, &p, 1, true).await;
    let held = lease(&*fixture, fenced.0, &p, &LockReason::Rewind).await;

    let tx = begin(fixture.source()).await;
    let mut entries = Vec::new();
    for (stream, _) in [gap, fenced, twice, pruned] {
        let (cursor, stored) = fixture
            .store()
            .state(&tx, &lockstep_core::Pair::new(*stream, p.clone()))
            .await
            .expect("state")
            .expect("cursor row");
        let all = fixture
            .store()
            .stream_events(&tx, *stream, cursor.last_event_id)
            .await
            .expect("stream_events");
        let mut change = commit_of(&cursor, stored.as_ref(), &all);
        if *stream == gap.0 {
            // The middle event is not applied: its work row must stay.
            let (first, last) = (&all[0], &all[2]);
            change = commit_of(&cursor, stored.as_ref(), &[first.clone(), last.clone()]);
        } else if *stream == fenced.0 {
            change.fence = Some(held.id.clone());
        } else if *stream == pruned.0 {
            change.snapshot = true;
        }
        entries.push(BatchEntry::new(
            cursor.pair.clone(),
            Some(change.clone()),
            None,
        ));
        if *stream == twice.0 {
            entries.push(BatchEntry::new(cursor.pair.clone(), Some(change), None));
        }
    }
    renew(&*fixture, &held).await;
    let done = fixture
        .store()
        .commit_batch(&tx, &entries)
        .await
        .expect("commit_batch");
    let revisions: Vec<i64> = entries
        .iter()
        .map(|e| e.commit.as_ref().map_or(0, |c| c.expected_revision + 1))
        .collect();
    assert_eq!(
        done,
        [
            BatchCommitted::Committed {
                revision: revisions[0],
                parked: false
            },
            BatchCommitted::Committed {
                revision: revisions[1],
                parked: false
            },
            BatchCommitted::Committed {
                revision: revisions[2],
                parked: false
            },
            BatchCommitted::Refused(ErrorKind::Conflict),
            BatchCommitted::Committed {
                revision: revisions[4],
                parked: false
            },
        ]
    );
    commit(tx).await.expect("commit");

    let (after, stored) = state(&*fixture, gap.0, &p).await.expect("cursor");
    assert_eq!(
        (after.revision, after.last_event_id, after.applied_count),
        (revisions[0], Some(gap.1[2]), 2)
    );
    assert_eq!(stored, Some(serde_json::json!({ "sum": 1 + 3 })));
    assert_eq!(pending(&*fixture, gap.0, &p).await, [gap.1[1]]);
    for (stream, ids) in [fenced, twice] {
        let (after, stored) = state(&*fixture, *stream, &p).await.expect("cursor");
        assert_eq!(
            (after.last_event_id, after.applied_count, after.error),
            (Some(ids[2]), 3, None)
        );
        assert_eq!(stored, Some(serde_json::json!({ "sum": 6 })));
        assert!(pending(&*fixture, *stream, &p).await.is_empty());
    }
    assert_eq!(
        cursor(&*fixture, twice.0, &p)
            .await
            .expect("cursor")
            .revision,
        revisions[2],
        "the refused duplicate wrote nothing"
    );
    let (after, stored) = state(&*fixture, pruned.0, &p).await.expect("cursor");
    assert_eq!((after.last_event_id, after.applied_count), (Some(extra), 4));
    assert_eq!(stored, Some(serde_json::json!({ "sum": 106 })));
    assert_eq!(after.latest_snapshot, Some(extra));
    let kept = snapshots(&*fixture, pruned.0, &p).await;
    assert_eq!(kept.len(), DEFAULT_KEEP_SNAPSHOTS.min(4));
    assert_eq!(
        (kept[0].event_id, kept[0].applied_count, &kept[0].state),
        (extra, 4, &serde_json::json!({ "sum": 106 }))
    );
    let released = fixture.locker().release(&held.id).await.expect("release");
    assert!(released.is_released(), "the fenced commit kept the lease");
}

/// `load_rewind` reads what a rewind restores and replays, as the separate reads would: no
/// cursor → `None`; no request → the cursor alone; a request → the latest snapshot strictly
/// before its trigger and the stream's events after it, less the pair's skipped events (all
/// of them, from the start, without a snapshot).
pub async fn load_rewind_reads_the_snapshot_before_the_trigger_and_the_events_after_it<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("LoadRewind");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(5);
    let stream = stream_with(&*fixture, &ids[..4]).await;
    apply(&*fixture, stream, &p, 1, true).await; // snapshot at ids[0]
    apply(&*fixture, stream, &p, 1, true).await; // snapshot at ids[1]
    apply(&*fixture, stream, &p, 2, false).await;
    // A fifth event, skipped by an operator.
    append(&*fixture, stream, &[event(ids[4], 5)]).await;
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .skip_event(
                &tx,
                &lockstep_core::Pair::new(stream, p.clone()),
                ids[4],
                "conformance"
            )
            .await
            .expect("skip_event")
    );
    commit(tx).await.expect("commit");

    let load = |stream: StreamId| {
        let fixture = Arc::clone(&fixture);
        let p = p.clone();
        async move {
            let tx = begin(fixture.source()).await;
            let loaded = fixture
                .store()
                .load_rewind(
                    &tx,
                    &lockstep_core::Pair::new(stream, p.clone()),
                    PageLimits::default(),
                )
                .await
                .expect("load_rewind");
            rollback(tx).await;
            loaded
        }
    };
    assert_eq!(load(StreamId::new_v7()).await, None, "no cursor");
    let loaded = load(stream).await.expect("a cursor");
    assert_eq!(
        loaded.cursor,
        cursor(&*fixture, stream, &p).await.expect("cursor")
    );
    assert_eq!(loaded.cursor.rewind, None);
    assert_eq!((loaded.snapshot, loaded.events), (None, Vec::new()));

    for (from, snapshot_at, replayed) in [
        (Some(ids[2]), Some(ids[1]), &ids[2..4]),
        (Some(ids[1]), Some(ids[0]), &ids[1..4]),
        (None, None, &ids[..4]),
    ] {
        let tx = begin(fixture.source()).await;
        fixture
            .store()
            .request_rewind(&tx, &lockstep_core::Pair::new(stream, p.clone()), from)
            .await
            .expect("request_rewind");
        commit(tx).await.expect("commit");
        let loaded = load(stream).await.expect("a cursor");
        let before = cursor(&*fixture, stream, &p).await.expect("cursor");
        assert_eq!(loaded.cursor, before);
        let trigger = before.rewind.expect("a request").trigger;
        let tx = begin(fixture.source()).await;
        let snapshot = fixture
            .store()
            .snapshot_before(&tx, &lockstep_core::Pair::new(stream, p.clone()), trigger)
            .await
            .expect("snapshot_before");
        rollback(tx).await;
        assert_eq!(loaded.snapshot, snapshot);
        assert_eq!(loaded.snapshot.as_ref().map(|s| s.event_id), snapshot_at);
        if let Some(s) = &loaded.snapshot {
            let n = ids
                .iter()
                .position(|id| *id == s.event_id)
                .expect("an event") as u64;
            assert_eq!(s.applied_count, n + 1);
        }
        assert_eq!(
            event_ids(&loaded.events),
            replayed,
            "skipped ids[4] left out"
        );
        assert!(!loaded.more, "every event fits one page");
        assert!(loaded.events.iter().all(|e| e.stream_id == stream));
    }
}

/// The byte bounds count what a worker holds: each payload's size decoded, not as stored (a
/// database stores a large value compressed). Four events of a megabyte of one repeated
/// character each, which compress to a few kilobytes: a batch bounded at two and a half
/// megabytes holds two of them, and so does each rewind page; a bound below one event still
/// hands out one, so that the pair makes progress.
pub async fn the_byte_bounds_count_payloads_decoded_not_as_stored<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    const MB: usize = 1 << 20;
    let p = name("Compressible");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(4);
    let stream = StreamId::new_v7();
    let events: Vec<NewEvent> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| {
            NewEvent::new(
                "Padded",
                serde_json::json!({ "n": n, "body": "x".repeat(MB) }),
            )
            .expect("event")
            .with_id(*id)
            .expect("a chosen id")
        })
        .collect();
    append(&*fixture, stream, &events).await;

    let mut bounded = limits(ALL_PAIRS, ALL_EVENTS, ALL_EVENTS);
    bounded.bytes = (5 * MB / 2) as u64;
    let batch = peek_batch(&*fixture, from_start(std::slice::from_ref(&p)), bounded).await;
    assert_eq!(
        work_of(&batch),
        vec![(stream, p.clone(), Some(ids[..2].to_vec()))],
        "two megabytes of payloads fit two and a half, three do not"
    );
    bounded.bytes = (MB / 2) as u64;
    let batch = peek_batch(&*fixture, from_start(std::slice::from_ref(&p)), bounded).await;
    assert_eq!(
        work_of(&batch),
        vec![(stream, p.clone(), Some(ids[..1].to_vec()))],
        "one event larger than the bound, alone"
    );

    let pair = lockstep_core::Pair::new(stream, p.clone());
    let store = fixture.store();
    let tx = begin(fixture.source()).await;
    assert!(
        store
            .request_rewind(&tx, &pair, None)
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");
    let tx = begin(fixture.source()).await;
    let page = PageLimits::new(1000, (5 * MB / 2) as u64).expect("page limits");
    let first = store
        .load_rewind(&tx, &pair, page)
        .await
        .expect("load_rewind")
        .expect("a cursor");
    assert_eq!(
        (event_ids(&first.events), first.more),
        (ids[..2].to_vec(), true)
    );
    let next = store
        .rewind_events(&tx, &pair, Some(ids[1]), page)
        .await
        .expect("rewind_events");
    assert_eq!(
        (event_ids(&next.events), next.more),
        (ids[2..].to_vec(), false)
    );
    let small = PageLimits::new(1000, (MB / 2) as u64).expect("page limits");
    let page = store
        .rewind_events(&tx, &pair, None, small)
        .await
        .expect("rewind_events");
    assert_eq!(
        (event_ids(&page.events), page.more),
        (ids[..1].to_vec(), true)
    );
    rollback(tx).await;
}

/// A rewind reads its events in pages: `load_rewind` returns the first page and whether more
/// follow, `rewind_events` the page after a given event — at most the page's events, within its
/// bytes but the first event always, never the pair's skipped events, and `more` false on the
/// last page even when it is exactly full. Pages read one after another give the stream's
/// events, in order, each once — also after a snapshot, whose first page starts after it. The
/// page after a skipped event, or after an id that is not in the stream, starts at the next
/// event. A page limit of 0 is refused before anything is read.
pub async fn a_rewind_reads_its_events_in_pages_bounded_by_events_and_bytes<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("RewindPages");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(8);
    let stream = stream_with(&*fixture, &ids).await;
    let pair = lockstep_core::Pair::new(stream, p.clone());
    apply(&*fixture, stream, &p, 3, false).await;
    let store = fixture.store();
    let tx = begin(fixture.source()).await;
    assert!(
        store
            .skip_event(&tx, &pair, ids[3], "conformance")
            .await
            .expect("skip_event")
    );
    commit(tx).await.expect("commit");
    apply(&*fixture, stream, &p, 8, false).await;
    let tx = begin(fixture.source()).await;
    assert!(
        store
            .request_rewind(&tx, &pair, None)
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");
    let expected: Vec<Uuid> = ids.iter().copied().filter(|id| *id != ids[3]).collect();

    // Reads every page of the rewind with `page`: the pages' sizes and their events.
    let read_all = |page: PageLimits| {
        let fixture = Arc::clone(&fixture);
        let pair = pair.clone();
        async move {
            let store = fixture.store();
            let tx = begin(fixture.source()).await;
            let first = store
                .load_rewind(&tx, &pair, page)
                .await
                .expect("load_rewind")
                .expect("a cursor");
            let mut sizes = vec![first.events.len()];
            let mut events = event_ids(&first.events);
            let mut more = first.more;
            while more {
                let next = store
                    .rewind_events(&tx, &pair, events.last().copied(), page)
                    .await
                    .expect("rewind_events");
                assert!(!next.events.is_empty(), "a page holds at least one event");
                sizes.push(next.events.len());
                events.extend(event_ids(&next.events));
                more = next.more;
                assert!(sizes.len() <= 10, "the pages do not end");
            }
            rollback(tx).await;
            (sizes, events)
        }
    };
    let roomy = 1 << 30;
    // 7 events (one skipped): pages of 3, 3, 1; pages of 7 — one, exactly full, `more` false.
    for (events, sizes) in [(3, vec![3, 3, 1]), (7, vec![7]), (1000, vec![7])] {
        let page = PageLimits::new(events, roomy).expect("page limits");
        assert_eq!(
            read_all(page).await,
            (sizes, expected.clone()),
            "{events} per page"
        );
    }
    // One byte: the first event of each page always, no second one.
    let page = PageLimits::new(1000, 1).expect("page limits");
    assert_eq!(read_all(page).await, (vec![1; 7], expected.clone()));

    // From the start, and after an event: the skipped one is never handed out.
    let tx = begin(fixture.source()).await;
    let page = PageLimits::new(2, roomy).expect("page limits");
    let from_start = store
        .rewind_events(&tx, &pair, None, page)
        .await
        .expect("page");
    assert_eq!(
        (event_ids(&from_start.events), from_start.more),
        (ids[..2].to_vec(), true)
    );
    let after = store
        .rewind_events(&tx, &pair, Some(ids[2]), page)
        .await
        .expect("page");
    assert_eq!(
        (event_ids(&after.events), after.more),
        (ids[4..6].to_vec(), true)
    );
    let last = store
        .rewind_events(&tx, &pair, Some(ids[7]), page)
        .await
        .expect("page");
    assert_eq!(
        (last.events.len(), last.more),
        (0, false),
        "nothing after the last event"
    );
    // After the skipped event itself, and after an id between two events of the stream.
    let after_skipped = store
        .rewind_events(&tx, &pair, Some(ids[3]), page)
        .await
        .expect("page");
    assert_eq!(
        (event_ids(&after_skipped.events), after_skipped.more),
        (ids[4..6].to_vec(), true),
        "after the skipped event"
    );
    let between = Uuid::from_u128(ids[4].as_u128() + 1);
    assert!(between < ids[5], "ids are far apart");
    let after_unknown = store
        .rewind_events(&tx, &pair, Some(between), page)
        .await
        .expect("page");
    assert_eq!(
        (event_ids(&after_unknown.events), after_unknown.more),
        (ids[5..7].to_vec(), true),
        "after an id that is not in the stream"
    );

    // A page of no events is refused.
    let mut bad = PageLimits::default();
    bad.events = 0;
    let err = store
        .load_rewind(&tx, &pair, bad)
        .await
        .expect_err("0 events per page");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    let err = store
        .rewind_events(&tx, &pair, None, bad)
        .await
        .expect_err("0 events per page");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert_eq!(
        PageLimits::new(1, 0).expect_err("0 bytes").kind(),
        ErrorKind::InvalidInput
    );
    rollback(tx).await;

    // After a snapshot: a second stream, a snapshot at its third event, a rewind from its
    // fifth. The first page starts after the snapshot; the next after the first's last event.
    let ids = self::ids(8);
    let stream = stream_with(&*fixture, &ids).await;
    let pair = lockstep_core::Pair::new(stream, p.clone());
    apply(&*fixture, stream, &p, 3, true).await;
    apply(&*fixture, stream, &p, 8, false).await;
    let tx = begin(fixture.source()).await;
    assert!(
        store
            .request_rewind(&tx, &pair, Some(ids[4]))
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");
    let tx = begin(fixture.source()).await;
    let page = PageLimits::new(3, roomy).expect("page limits");
    let first = store
        .load_rewind(&tx, &pair, page)
        .await
        .expect("load_rewind")
        .expect("a cursor");
    assert_eq!(
        first.snapshot.as_ref().map(|s| s.event_id),
        Some(ids[2]),
        "the snapshot before the trigger"
    );
    assert_eq!(
        (event_ids(&first.events), first.more),
        (ids[3..6].to_vec(), true)
    );
    let next = store
        .rewind_events(&tx, &pair, Some(ids[5]), page)
        .await
        .expect("page");
    assert_eq!(
        (event_ids(&next.events), next.more),
        (ids[6..8].to_vec(), false)
    );
    rollback(tx).await;
}

/// Two fences on `live`'s pair that are not the live lease: an earlier epoch of its holder, and
/// its epoch with another holder.
fn not_live(live: &LeaseId) -> [LeaseId; 2] {
    [
        LeaseId::new(
            live.stream_id,
            live.perspective.clone(),
            live.holder,
            LeaseEpoch::new(live.epoch.get() - 1),
        ),
        LeaseId::new(
            live.stream_id,
            live.perspective.clone(),
            InstanceId::random(),
            live.epoch,
        ),
    ]
}

/// A state change from `cursor` up to the `n`th of `ids` (`{"sum": n}`), fenced on `fence`.
fn sum_commit_up_to(
    stream: StreamId,
    name: &PerspectiveName,
    ids: &[Uuid],
    cursor: &Cursor,
    n: usize,
    fence: Option<LeaseId>,
) -> StateCommit {
    let mut change = StateCommit::new(
        Pair::new(stream, name.clone()),
        cursor.revision,
        serde_json::json!({ "sum": n }),
    );
    change.last_event_id = Some(ids[n - 1]);
    change.applied_count = n as u64;
    change.applied_events = ids[cursor.applied_count as usize..n].to_vec();
    change.fence = fence;
    change
}

/// `commit` with `Release::Lease` releases the fence's lease exactly when the change commits:
/// afterwards a renew is refused and another instance acquires it at once, at a later epoch. A
/// refused change (a stale revision, a fence that is not the live lease) leaves the lease held.
/// Without a fence nothing is released; with `Release::Keep` the lease stays held.
pub async fn a_commit_releasing_its_fence_releases_the_lease_only_when_it_commits<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("CommitRelease");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(4);
    let stream = stream_with(&*fixture, &ids).await;
    let held = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    let commit_for = |cursor: &Cursor, n: usize, fence: Option<LeaseId>| {
        sum_commit_up_to(stream, &p, &ids, cursor, n, fence)
    };

    // Refused (a stale revision): nothing written, the lease held.
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");
    let mut stale = commit_for(&before, 1, Some(held.id.clone()));
    stale.expected_revision += 1;
    let tx = begin(fixture.source()).await;
    let refused = fixture.store().commit(tx, &stale, Release::Lease).await;
    assert_eq!(
        refused.map_err(|e| e.kind()).err(),
        Some(ErrorKind::Conflict)
    );
    renew(&*fixture, &held).await;

    // Fenced on a lease that is not the live one (an earlier epoch, another holder): refused
    // as lost, nothing written, the live lease held.
    for fence in not_live(&held.id) {
        let tx = begin(fixture.source()).await;
        let refused = fixture
            .store()
            .commit(tx, &commit_for(&before, 1, Some(fence)), Release::Lease)
            .await;
        assert_eq!(
            refused.map_err(|e| e.kind()).err(),
            Some(ErrorKind::LeaseLost)
        );
        renew(&*fixture, &held).await;
    }
    let now = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(now.revision, before.revision, "nothing written");
    assert_eq!(pending(&*fixture, stream, &p).await, ids);

    // No fence: committed, nothing released.
    let tx = begin(fixture.source()).await;
    let committed = fixture
        .store()
        .commit(tx, &commit_for(&before, 1, None), Release::Lease)
        .await
        .expect("commit");
    assert_eq!(
        (committed.revision, committed.released),
        (before.revision + 1, false)
    );
    renew(&*fixture, &held).await;

    // Fenced on the live lease, keeping it: committed, the lease still held.
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");
    let tx = begin(fixture.source()).await;
    let committed = fixture
        .store()
        .commit(
            tx,
            &commit_for(&before, 2, Some(held.id.clone())),
            Release::Keep,
        )
        .await
        .expect("commit");
    assert_eq!(
        (committed.revision, committed.released),
        (before.revision + 1, false)
    );
    renew(&*fixture, &held).await;

    // Fenced on the live lease, releasing it: committed and released.
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");
    let tx = begin(fixture.source()).await;
    let committed = fixture
        .store()
        .commit(
            tx,
            &commit_for(&before, 4, Some(held.id.clone())),
            Release::Lease,
        )
        .await
        .expect("commit");
    assert_eq!(
        (committed.revision, committed.released),
        (before.revision + 1, true)
    );
    let (after, stored) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (after.last_event_id, after.applied_count, stored),
        (Some(ids[3]), 4, Some(serde_json::json!({ "sum": 4 })))
    );
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    let renewed = fixture.locker().renew(&held.id).await.expect("renew");
    assert!(
        !renewed.is_renewed(),
        "the lease was released by the commit"
    );
    match fixture
        .locker()
        .try_acquire(stream, &p, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("try_acquire")
    {
        AcquireOutcome::Acquired(next) => {
            assert!(next.id.epoch > held.id.epoch, "a later epoch");
            let _ = fixture.locker().release(&next.id).await.expect("release");
        }
        other => panic!("expected the released lease to be free, got {other:?}"),
    }
}

/// `commit` commits the state change and its transaction as one, or nothing: a refused change
/// (a stale revision, a fence that is not the live lease) commits nothing of the transaction —
/// not even another write made on it before — and keeps the lease held; an accepted one commits
/// the state, the other write and, with `Release::Lease`, the lease's release. Without a fence
/// nothing is released.
pub async fn a_fenced_commit_that_ends_its_transaction_commits_all_of_it_or_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("CommitAndEnd");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids).await;
    // The other write: a rewind request on another pair, made on the same transaction first
    // (one pair for the cases without a fence, one for the fenced commit that goes through;
    // applied, so that they have a cursor on every store).
    let (witness, fenced_witness) = (
        stream_with(&*fixture, &[Uuid::now_v7()]).await,
        stream_with(&*fixture, &[Uuid::now_v7()]).await,
    );
    for w in [witness, fenced_witness] {
        apply(&*fixture, w, &p, ALL_EVENTS, false).await;
    }
    let held = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    let commit_for = |cursor: &Cursor, n: usize, fence: Option<LeaseId>| {
        sum_commit_up_to(stream, &p, &ids, cursor, n, fence)
    };
    let requested = |fixture: Arc<F>, witness: StreamId| {
        let name = p.clone();
        async move {
            cursor(&*fixture, witness, &name)
                .await
                .and_then(|c| c.rewind)
                .is_some()
        }
    };
    let with_witness = |fixture: Arc<F>, witness: StreamId| {
        let pair = lockstep_core::Pair::new(witness, p.clone());
        async move {
            let tx = begin(fixture.source()).await;
            assert!(
                fixture
                    .store()
                    .request_rewind(&tx, &pair, None)
                    .await
                    .expect("request_rewind")
            );
            tx
        }
    };

    // Refused: a stale revision, then fences that are not the live lease.
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");
    let mut stale = commit_for(&before, 1, Some(held.id.clone()));
    stale.expected_revision += 1;
    let refusals = std::iter::once((stale, ErrorKind::Conflict)).chain(
        not_live(&held.id)
            .into_iter()
            .map(|fence| (commit_for(&before, 1, Some(fence)), ErrorKind::LeaseLost)),
    );
    for (change, kind) in refusals {
        let tx = with_witness(fixture.clone(), witness).await;
        let refused = fixture.store().commit(tx, &change, Release::Lease).await;
        assert_eq!(refused.map_err(|e| e.kind()).err(), Some(kind));
        assert!(
            !requested(fixture.clone(), witness).await,
            "a refused commit ({kind:?}) committed the transaction's other write"
        );
        renew(&*fixture, &held).await;
    }
    let now = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(now.revision, before.revision, "nothing written");
    assert_eq!(pending(&*fixture, stream, &p).await, ids);

    // No fence: committed with the other write, nothing released.
    let tx = with_witness(fixture.clone(), witness).await;
    let committed = fixture
        .store()
        .commit(tx, &commit_for(&before, 1, None), Release::Lease)
        .await
        .expect("commit");
    assert_eq!(
        (committed.revision, committed.released),
        (before.revision + 1, false)
    );
    assert!(
        requested(fixture.clone(), witness).await,
        "the other write committed"
    );
    renew(&*fixture, &held).await;

    // Fenced on the live lease: committed with the other write, and released if the store
    // says so.
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");
    let tx = with_witness(fixture.clone(), fenced_witness).await;
    let committed = fixture
        .store()
        .commit(
            tx,
            &commit_for(&before, 3, Some(held.id.clone())),
            Release::Lease,
        )
        .await
        .expect("commit");
    assert_eq!(
        (committed.revision, committed.released),
        (before.revision + 1, true)
    );
    assert!(
        requested(fixture.clone(), fenced_witness).await,
        "the other write committed with the fenced commit"
    );
    let (after, stored) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (after.last_event_id, after.applied_count, stored),
        (Some(ids[2]), 3, Some(serde_json::json!({ "sum": 3 })))
    );
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    let renewed = fixture.locker().renew(&held.id).await.expect("renew");
    assert!(
        !renewed.is_renewed(),
        "the lease was released with the commit"
    );
}

/// `states` pages through one perspective's stored states in stream-id order: only pairs that
/// have a state, only of that perspective, each page after the last stream of the one before;
/// a page of 0 or more than `MAX_STATES_PAGE` is invalid input.
pub async fn states_page_through_one_perspectives_states_in_stream_order<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Paged");
    let other = name("PagedOther");
    register(&*fixture, &[p.clone(), other.clone()]).await;
    let mut streams = Vec::new();
    for n in 1..=3 {
        let stream = stream_with(&*fixture, &ids(n)).await;
        apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
        streams.push(stream);
    }
    // A stream with work but no state yet, and a state of another perspective: not listed.
    let _unapplied = stream_with(&*fixture, &ids(1)).await;
    apply(&*fixture, streams[0], &other, ALL_EVENTS, false).await;
    streams.sort();

    let tx = begin(fixture.source()).await;
    let store = fixture.store();
    let first = store.states(&tx, &p, None, 2).await.expect("first page");
    let mine = |page: &[lockstep_core::StoredState]| -> Vec<StreamId> {
        page.iter()
            .map(|s| s.cursor.pair.stream_id)
            .filter(|s| streams.contains(s))
            .collect()
    };
    // Other cases' streams (a shared database) may sort among ours; walk every page.
    let mut seen = mine(&first);
    let mut after = first.last().map(|s| s.cursor.pair.stream_id);
    assert!(first.len() <= 2, "a page holds at most its limit");
    for stored in &first {
        assert_eq!(stored.cursor.pair.perspective, p);
    }
    while let Some(last) = after {
        let page = store
            .states(&tx, &p, Some(last), 2)
            .await
            .expect("next page");
        assert!(page.len() <= 2);
        assert!(
            page.iter().all(|s| s.cursor.pair.stream_id > last),
            "a page starts after the stream it was asked to"
        );
        for stored in &page {
            if let Some(i) = streams
                .iter()
                .position(|s| *s == stored.cursor.pair.stream_id)
            {
                let events = store
                    .stream_events(&tx, stored.cursor.pair.stream_id, None)
                    .await
                    .expect("events");
                assert_eq!(stored.state, folded(None, &events), "stream {i}'s state");
                assert_eq!(stored.cursor.applied_count, events.len() as u64);
            }
        }
        seen.extend(mine(&page));
        after = page.last().map(|s| s.cursor.pair.stream_id);
    }
    assert_eq!(
        seen, streams,
        "every state of the perspective, in stream order"
    );
    for limit in [0, lockstep_core::MAX_STATES_PAGE + 1] {
        let err = store
            .states(&tx, &p, None, limit)
            .await
            .expect_err("a page size out of range");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "limit {limit}");
    }
    rollback(tx).await;
}

/// `pending_through` says what a pair, and a whole perspective, has not applied of the events
/// up to a given one: the work up to it (not after it), a rewind requested from such an event,
/// and whether the pairs holding it are parked (with their error).
pub async fn pending_through_counts_what_is_not_applied_up_to_an_event<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Through");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids).await;
    let whole_before = pending_through(&*fixture, &p, None, ids[2]).await;
    assert!(whole_before.events >= 3, "{whole_before:?}");

    let pair = pending_through(&*fixture, &p, Some(stream), ids[2]).await;
    assert_eq!((pair.events, pair.rewinds, pair.parked), (3, 0, 0));
    assert!(!pair.is_caught_up());
    assert_eq!(
        pending_through(&*fixture, &p, Some(stream), ids[0])
            .await
            .events,
        1,
        "only the events up to the one asked for"
    );

    apply(&*fixture, stream, &p, 2, false).await;
    assert!(
        pending_through(&*fixture, &p, Some(stream), ids[1])
            .await
            .is_caught_up(),
        "applied up to the second event"
    );
    assert_eq!(
        pending_through(&*fixture, &p, Some(stream), ids[2])
            .await
            .events,
        1
    );
    assert_eq!(
        pending_through(&*fixture, &p, None, ids[2]).await.events,
        whole_before.events - 2,
        "the perspective's count goes down with the pair's"
    );

    // A failing, parked pair: counted with its error.
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .record_failure(
            &tx,
            &lockstep_core::Pair::new(stream, p.clone()),
            &PairFailure::new("boom").park(true),
        )
        .await
        .expect("record_failure");
    commit(tx).await.expect("commit");
    let parked = pending_through(&*fixture, &p, Some(stream), ids[2]).await;
    assert_eq!((parked.events, parked.parked), (1, 1));
    assert_eq!(parked.error.as_deref(), Some("boom"));
    let before = pending_through(&*fixture, &p, Some(stream), ids[1]).await;
    assert_eq!(
        (before.events, before.rewinds, before.parked, before.error),
        (0, 0, 0, None),
        "a pair parked after the event asked for does not hold it up"
    );

    // A rewind requested from an event up to the one asked for holds it up until committed.
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .request_rewind(
                &tx,
                &lockstep_core::Pair::new(stream, p.clone()),
                Some(ids[1])
            )
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");
    let rewinding = pending_through(&*fixture, &p, Some(stream), ids[2]).await;
    assert_eq!((rewinding.events, rewinding.rewinds), (0, 1));
    assert!(
        pending_through(&*fixture, &p, Some(stream), ids[0])
            .await
            .is_caught_up(),
        "a rewind from a later event does not hold up an earlier one"
    );
}

/// `pending_through` says whether the perspective is registered: a registered one is, a name
/// never registered (misspelt) is not, one retired with its states kept is retired, and one
/// retired with its states dropped is not registered — so that a wait can refuse to call
/// "caught up" a perspective that nothing applies.
pub async fn pending_through_says_whether_the_perspective_is_registered<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Registration");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(1);
    let stream = stream_with(&*fixture, &ids).await;
    let registration = async |name: &PerspectiveName| {
        pending_through(&*fixture, name, Some(stream), ids[0])
            .await
            .registration
    };
    assert_eq!(registration(&p).await, Some(Registration::Registered));
    assert_eq!(
        registration(&name("Registratoin")).await,
        Some(Registration::NotRegistered)
    );
    retire(&*fixture, &p, RetireStates::Keep).await;
    assert_eq!(registration(&p).await, Some(Registration::Retired));
    register(&*fixture, std::slice::from_ref(&p)).await;
    assert_eq!(registration(&p).await, Some(Registration::Registered));
    retire(&*fixture, &p, RetireStates::Drop).await;
    assert_eq!(registration(&p).await, Some(Registration::NotRegistered));
}

/// Runs every case, in order, in one test. Prefer
/// [`perspective_store_conformance!`](crate::perspective_store_conformance): a test per case.
pub async fn run_all<F: PerspectiveStoreFixture>(fixture: Arc<F>) {
    crate::__lockstep_perspective_store_cases!(__lockstep_conformance_run_all! { by_arc fixture });
}

#[doc(hidden)]
#[macro_export]
macro_rules! __lockstep_perspective_store_cases {
    ($then:ident ! { $($args:tt)* }) => {
        $crate::$then! { $($args)* cases: [
            appended_events_become_work_for_every_registered_perspective_on_commit,
            a_rolled_back_append_leaves_no_work,
            a_perspective_registered_later_catches_up_on_existing_events,
            claim_returns_pending_events_after_the_cursor_in_event_id_order_up_to_the_limit,
            claim_creates_the_cursor_of_a_pair_that_has_none,
            a_second_claim_of_a_claimed_pair_is_busy_until_the_first_transaction_ends,
            a_leased_pair_is_held_back_while_its_events_keep_queueing,
            a_commit_saves_the_state_advances_the_cursor_and_deletes_exactly_the_applied_work,
            a_stale_expected_revision_is_a_conflict_that_writes_nothing,
            a_fenced_commit_by_the_lease_holder_is_written,
            a_fenced_commit_after_a_takeover_is_lease_lost_and_writes_nothing,
            a_fenced_commit_after_a_force_release_is_lease_lost_and_writes_nothing,
            a_late_arrival_turns_the_claim_into_a_rewind_from_that_event,
            of_two_late_arrivals_the_earliest_is_the_trigger,
            an_existing_trigger_only_ever_moves_earlier,
            the_debounce_window_holds_a_flagged_pair_back,
            the_debounce_window_is_capped_from_the_first_flag,
            pending_pairs_lists_only_the_perspectives_asked_for,
            a_rewind_commit_clears_the_request_only_if_its_trigger_is_unchanged,
            a_rewind_commit_deletes_the_snapshots_at_or_after_its_trigger,
            a_commit_can_save_a_snapshot_and_snapshot_before_finds_the_latest_strictly_before,
            only_the_newest_snapshots_are_kept,
            save_snapshot_is_idempotent_and_refuses_a_moved_revision,
            stream_events_come_in_event_id_order_after_the_given_id,
            a_recorded_failure_keeps_the_request_and_the_work_until_a_commit_succeeds,
            purge_empties_the_pair_and_keeps_its_lease,
            ensure_cursor_is_idempotent_and_delete_cursor_removes_the_pair,
            a_state_jsonb_cannot_store_is_invalid_input_and_writes_nothing,
            a_state_nested_deeper_than_a_claim_can_read_is_invalid_input_and_writes_nothing,
            a_batch_claims_only_the_requested_perspectives_within_its_limits,
            concurrent_batches_claim_disjoint_pairs_without_waiting,
            a_batch_skips_a_pair_under_a_live_lease,
            a_batch_skips_a_pair_that_backs_off,
            a_parked_pair_is_listed_and_only_claimed_again_after_unpark,
            a_rewind_request_retries_a_parked_pair,
            batch_positions_go_round_the_pairs_in_stream_order,
            the_scan_bound_moves_the_position_past_pairs_it_cannot_serve,
            commit_batch_commits_each_entry_and_refuses_a_stale_one_alone,
            an_invalid_batch_entry_writes_nothing_of_any_entry,
            a_successful_commit_clears_the_error_the_backoff_and_the_parking,
            a_failed_pair_is_retried_up_to_its_failed_event,
            a_pair_failed_after_its_prefix_is_retried_at_the_failing_event,
            a_batch_entry_can_commit_its_prefix_and_park_its_pair,
            a_batch_hands_out_late_arrivals_and_rewind_requests_as_rewinds,
            a_claim_looks_at_no_more_rewind_requests_than_it_has_room_for,
            skip_event_skips_a_pending_event_for_good_and_retries_the_pair,
            a_skip_reason_longer_than_the_limit_is_invalid_input_and_changes_nothing,
            perspective_status_counts_work_failures_backoff_and_parking,
            a_batch_of_plain_entries_commits_each_as_a_single_commit_would,
            a_late_arrival_inside_a_claimed_range_survives_the_batch_commit,
            an_event_skipped_between_pending_ones_is_not_handed_out,
            load_rewind_reads_the_snapshot_before_the_trigger_and_the_events_after_it,
            a_rewind_reads_its_events_in_pages_bounded_by_events_and_bytes,
            the_byte_bounds_count_payloads_decoded_not_as_stored,
            a_commit_releasing_its_fence_releases_the_lease_only_when_it_commits,
            a_fenced_commit_that_ends_its_transaction_commits_all_of_it_or_nothing,
            states_page_through_one_perspectives_states_in_stream_order,
            pending_through_counts_what_is_not_applied_up_to_an_event,
            pending_through_says_whether_the_perspective_is_registered,
            a_retired_perspective_gets_no_work_keeps_its_states_and_continues_when_registered_again,
            a_perspective_retired_with_dropped_states_starts_again_from_the_first_event,
            an_event_appended_while_retired_before_the_cursor_is_a_late_arrival,
            a_rebuild_requests_a_rewind_from_the_start_on_every_pair_and_keeps_the_old_states,
            rewind_progress_is_listed_while_the_rewind_runs_and_not_after_it_commits,
            applied_events_add_up_in_the_perspectives_catch_up_window,
        ] }
    };
}

/// Expands to one test per case of the [perspective-store conformance
/// suite](crate::conformance::perspective_store), each on a fixture of its own.
///
/// `fixture:` is an expression evaluated inside each test (it may `.await`) that yields a
/// [`PerspectiveStoreFixture`](crate::conformance::perspective_store::PerspectiveStoreFixture);
/// the test wraps it in an `Arc`. Attributes written first replace the default
/// `#[tokio::test]`: `#[tokio::test(start_paused = true)]` for the fakes,
/// `#[tokio::test(flavor = "multi_thread")]` for a database. `after_each:` (optional) is a
/// closure called with `&fixture` after the case passed. See
/// [`stream_locker_conformance!`](crate::stream_locker_conformance) for what the calling crate
/// needs. Not covered by semver (see [`conformance`](crate::conformance)).
#[macro_export]
macro_rules! perspective_store_conformance {
    ($(#[$attr:meta])+ fixture: $fixture:expr $(, after_each: $after:expr)? $(,)?) => {
        $crate::__lockstep_perspective_store_cases!(__lockstep_conformance_tests! {
            suite: perspective_store,
            pass: by_arc,
            attrs: [$(#[$attr])+],
            fixture: $fixture,
            after_each: [$($after)?],
        });
    };
    (fixture: $($rest:tt)*) => {
        $crate::perspective_store_conformance! { #[::tokio::test] fixture: $($rest)* }
    };
}

async fn retire<F: PerspectiveStoreFixture>(
    fixture: &F,
    name: &PerspectiveName,
    states: RetireStates,
) -> Retired {
    let tx = begin(fixture.source()).await;
    let retired = fixture
        .store()
        .retire(&tx, name, states)
        .await
        .expect("retire");
    commit(tx).await.expect("commit");
    retired
}

async fn retired_names<F: PerspectiveStoreFixture>(fixture: &F) -> Vec<PerspectiveName> {
    let tx = begin(fixture.source()).await;
    let names = fixture.store().retired(&tx).await.expect("retired");
    rollback(tx).await;
    names
}

async fn rebuild<F: PerspectiveStoreFixture>(fixture: &F, name: &PerspectiveName) -> Rebuild {
    let tx = begin(fixture.source()).await;
    let rebuilt = fixture.store().rebuild(&tx, name).await.expect("rebuild");
    commit(tx).await.expect("commit");
    rebuilt
}

async fn progress_of<F: PerspectiveStoreFixture>(
    fixture: &F,
    name: &PerspectiveName,
) -> Vec<RewindProgress> {
    let tx = begin(fixture.source()).await;
    let rows = fixture
        .store()
        .rewind_progress(&tx, std::slice::from_ref(name), 100)
        .await
        .expect("rewind_progress");
    rollback(tx).await;
    rows
}

async fn listed_in_status<F: PerspectiveStoreFixture>(fixture: &F, name: &PerspectiveName) -> bool {
    let tx = begin(fixture.source()).await;
    let status = fixture
        .store()
        .perspective_status(&tx)
        .await
        .expect("perspective_status");
    rollback(tx).await;
    status.iter().any(|s| &s.perspective == name)
}

/// Retiring a perspective with its states kept: its queued work is gone, appends enqueue none
/// for it, its states stay readable; registered again, each pair continues from its cursor with
/// the events appended meanwhile as its work. Retiring an unknown perspective does nothing.
pub async fn a_retired_perspective_gets_no_work_keeps_its_states_and_continues_when_registered_again<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Retired");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(4);
    let stream = stream_with(&*fixture, &ids[..3]).await;
    apply(&*fixture, stream, &p, 2, false).await;
    assert_eq!(pending(&*fixture, stream, &p).await, vec![ids[2]]);

    let Retired::Retired {
        work_removed,
        pairs,
    } = retire(&*fixture, &p, RetireStates::Keep).await
    else {
        panic!("a registered perspective is retired");
    };
    assert!(work_removed >= 1, "its queued work is removed");
    assert!(pairs >= 1, "its pairs are kept");
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    assert!(retired_names(&*fixture).await.contains(&p));
    assert!(
        !listed_in_status(&*fixture, &p).await,
        "no longer registered"
    );
    let (cursor, kept) = state(&*fixture, stream, &p).await.expect("cursor kept");
    assert_eq!(cursor.applied_count, 2);
    assert_eq!(
        kept,
        Some(serde_json::json!({ "sum": 3 })),
        "the state is kept"
    );

    // Appends while retired enqueue nothing for it, on its streams and on new ones.
    append(&*fixture, stream, &[event(ids[3], 4)]).await;
    let newer = stream_with(&*fixture, &self::ids(1)).await;
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    assert!(pending(&*fixture, newer, &p).await.is_empty());
    assert_eq!(
        rebuild(&*fixture, &p).await,
        Rebuild::NotRegistered,
        "a retired perspective is not rebuilt"
    );

    // Registered again: from the cursor, with what was queued and what was appended meanwhile.
    register(&*fixture, std::slice::from_ref(&p)).await;
    assert!(!retired_names(&*fixture).await.contains(&p));
    assert_eq!(pending(&*fixture, stream, &p).await, vec![ids[2], ids[3]]);
    assert_eq!(pending(&*fixture, newer, &p).await.len(), 1);
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    let (cursor, rebuilt) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(cursor.applied_count, 4);
    assert_eq!(rebuilt, Some(serde_json::json!({ "sum": 10 })));

    assert_eq!(
        retire(&*fixture, &name("NeverRegistered"), RetireStates::Keep).await,
        Retired::NotRegistered
    );
    assert_eq!(
        retire(&*fixture, &name("NeverRegistered"), RetireStates::Drop).await,
        Retired::NotRegistered
    );
}

/// Retiring with the states dropped deletes the perspective's pairs; registered again, it
/// starts from the first event like a new perspective. A perspective retired with kept states
/// can be retired again to drop them.
pub async fn a_perspective_retired_with_dropped_states_starts_again_from_the_first_event<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Dropped");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, true).await;

    assert!(matches!(
        retire(&*fixture, &p, RetireStates::Keep).await,
        Retired::Retired { .. }
    ));
    let Retired::Retired {
        work_removed,
        pairs,
    } = retire(&*fixture, &p, RetireStates::Drop).await
    else {
        panic!("a perspective retired with kept states can be dropped");
    };
    assert_eq!(work_removed, 0, "its work was already removed");
    assert!(pairs >= 1);
    assert_eq!(
        cursor(&*fixture, stream, &p).await,
        None,
        "the pair is gone"
    );
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());
    assert!(!retired_names(&*fixture).await.contains(&p));
    assert_eq!(
        retire(&*fixture, &p, RetireStates::Drop).await,
        Retired::NotRegistered,
        "nothing is left to retire"
    );

    register(&*fixture, std::slice::from_ref(&p)).await;
    assert_eq!(pending(&*fixture, stream, &p).await, ids);
    // A new cursor (Postgres creates it at registration, the fake at the first claim).
    if let Some((cursor, none)) = state(&*fixture, stream, &p).await {
        assert_eq!(
            (cursor.last_event_id, cursor.applied_count, none),
            (None, 0, None)
        );
    }
}

/// An event appended while a perspective was retired that sorts before a kept cursor is a late
/// arrival once the perspective is registered again: the claim turns it into a rewind.
pub async fn an_event_appended_while_retired_before_the_cursor_is_a_late_arrival<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("RetiredLate");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &[ids[0], ids[2]]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    retire(&*fixture, &p, RetireStates::Keep).await;
    append(&*fixture, stream, &[event(ids[1], 3)]).await;
    register(&*fixture, std::slice::from_ref(&p)).await;
    assert_eq!(pending(&*fixture, stream, &p).await, vec![ids[1]]);
    assert_eq!(trigger_after_claim(&*fixture, stream, &p).await, ids[1]);
}

/// A rebuild requests a rewind from the start on every pair of the perspective (a parked pair
/// included, which it also retries); each pair keeps its old state until its own rewind
/// commits. An unknown perspective is not rebuilt.
pub async fn a_rebuild_requests_a_rewind_from_the_start_on_every_pair_and_keeps_the_old_states<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Rebuilt");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let first = stream_with(&*fixture, &ids(2)).await;
    let second = stream_with(&*fixture, &ids(3)).await;
    apply(&*fixture, first, &p, ALL_EVENTS, false).await;
    apply(&*fixture, second, &p, ALL_EVENTS, false).await;
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .record_failure(
            &tx,
            &lockstep_core::Pair::new(second, p.clone()),
            &PairFailure::new("boom").park(true),
        )
        .await
        .expect("record_failure");
    commit(tx).await.expect("commit");

    let Rebuild::Requested { pairs } = rebuild(&*fixture, &p).await else {
        panic!("a registered perspective is rebuilt");
    };
    assert!(pairs >= 2, "every pair, {pairs}");
    for stream in [first, second] {
        let c = cursor(&*fixture, stream, &p).await.expect("cursor");
        assert_eq!(
            c.rewind.map(|r| r.trigger),
            Some(Uuid::nil()),
            "from the start"
        );
        assert_eq!((c.parked_at, c.failures), (None, 0), "retried");
    }
    let old = state(&*fixture, second, &p).await.expect("cursor").1;
    assert_eq!(old, Some(serde_json::json!({ "sum": 6 })));

    rewind(&*fixture, first, &p, Uuid::nil(), None)
        .await
        .expect("the first pair's rewind commits");
    assert_eq!(trigger(&*fixture, first, &p).await, None);
    assert_eq!(
        trigger(&*fixture, second, &p).await,
        Some(Uuid::nil()),
        "the other pair waits for its own rewind"
    );
    assert_eq!(
        state(&*fixture, second, &p).await.expect("cursor").1,
        old,
        "and serves its old state meanwhile"
    );
    assert_eq!(
        rebuild(&*fixture, &name("NeverRegistered")).await,
        Rebuild::NotRegistered
    );
}

/// A rewind's progress is listed while its pair has a rewind request and its lease is live;
/// a report of the same run keeps its start, a bad report or limit is invalid input, and once
/// the rewind commits it is no longer listed.
pub async fn rewind_progress_is_listed_while_the_rewind_runs_and_not_after_it_commits<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Progress");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let stream = stream_with(&*fixture, &ids(3)).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    request(&*fixture, stream, &p, None).await;
    let lease = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    let run = Uuid::new_v4();
    let mut report = ProgressReport::new(Pair::new(stream, p.clone()), run, 1, 3);
    report.lease = Some(lease.id.clone());
    report.elapsed = Duration::from_secs(5);
    let store = fixture.store();

    let tx = begin(fixture.source()).await;
    store.record_progress(&tx, &report).await.expect("record");
    commit(tx).await.expect("commit");
    let rows = progress_of(&*fixture, &p).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        (rows[0].pair.stream_id, rows[0].replayed, rows[0].to_replay),
        (stream, 1, 3)
    );
    assert_eq!(rows[0].holder, Some(lease.id.holder));
    assert!(
        rows[0].started_at + Duration::from_secs(5) <= rows[0].updated_at,
        "started when the run began, {:?} before its first report",
        report.elapsed
    );
    let started = rows[0].started_at;

    report.replayed = 2;
    renew(&*fixture, &lease).await;
    let tx = begin(fixture.source()).await;
    store.record_progress(&tx, &report).await.expect("record");
    commit(tx).await.expect("commit");
    let rows = progress_of(&*fixture, &p).await;
    assert_eq!(
        (rows.len(), rows[0].replayed, rows[0].started_at),
        (1, 2, started)
    );

    let tx = begin(fixture.source()).await;
    report.replayed = 4;
    let err = store
        .record_progress(&tx, &report)
        .await
        .expect_err("4 of 3");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    for limit in [0, lockstep_core::MAX_PROGRESS_ROWS + 1] {
        let err = store
            .rewind_progress(&tx, &[], limit)
            .await
            .expect_err("a limit out of range");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "limit {limit}");
    }
    rollback(tx).await;

    renew(&*fixture, &lease).await;
    rewind(&*fixture, stream, &p, Uuid::nil(), Some(lease.id.clone()))
        .await
        .expect("the rewind commits");
    assert!(
        progress_of(&*fixture, &p).await.is_empty(),
        "a committed rewind is no longer in progress"
    );
}

/// Applied events reported with `record_applied` add up in the perspective's open window
/// (every instance's together); a count a database cannot store is invalid input.
pub async fn applied_events_add_up_in_the_perspectives_catch_up_window<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let (p, other) = (name("Rate"), name("RateOther"));
    let store = fixture.store();
    let tx = begin(fixture.source()).await;
    store
        .record_applied(&tx, &[(p.clone(), 5), (other.clone(), 1)])
        .await
        .expect("record_applied");
    store
        .record_applied(&tx, &[(p.clone(), 1), (p.clone(), 2)])
        .await
        .expect("a name given twice counts twice");
    let err = store
        .record_applied(&tx, &[(p.clone(), u64::MAX)])
        .await
        .expect_err("out of range");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    commit(tx).await.expect("commit");

    let tx = begin(fixture.source()).await;
    let rates = store.throughput(&tx).await.expect("throughput");
    rollback(tx).await;
    let mine = rates
        .iter()
        .find(|t| t.perspective == p)
        .expect("the perspective's rate");
    assert_eq!(mine.window_applied, 8, "{mine:?}");
    assert!(
        mine.events_per_second
            .is_none_or(|r| (0.0..=8.0).contains(&r)),
        "no rate before a second, at most 8 events over it: {mine:?}"
    );
    let theirs = rates
        .iter()
        .find(|t| t.perspective == other)
        .expect("other");
    assert_eq!(theirs.window_applied, 1);
}
