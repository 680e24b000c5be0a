//! The perspective-store conformance suite, one module of cases per capability trait — each
//! case a behaviour a user of the perspective worker would notice:
//!
//! | module | capability | what its cases show |
//! |---|---|---|
//! | [`work_queue`] | [`WorkQueue`](lockstep_core::WorkQueue) | fan-out on append, batch claims (bounds, disjoint batches, leased, backing-off and parked pairs left out, positions, the `scan` bound, rewinds), batch commits, recorded failures |
//! | [`pair_work`] | [`PairWork`](lockstep_core::PairWork) | one pair's claim (order, limit, exclusivity, leases, late arrivals, debounce), its commits (compare-and-set, fence, releasing, ending the transaction), snapshots, purge |
//! | [`reads`] | [`PerspectiveReads`](lockstep_core::PerspectiveReads) | stream events, paging through states, `pending_through` |
//! | [`rewind_reads`] | [`RewindReads`](lockstep_core::RewindReads) | `load_rewind`, rewind pages, a rewind's progress |
//! | [`admin`] | [`PerspectiveAdmin`](lockstep_core::PerspectiveAdmin) | parking and `unpark`, skipped events, `perspective_status` |
//! | [`lifecycle`] | [`PerspectiveLifecycle`](lockstep_core::PerspectiveLifecycle) | catch-up on registration, retire (keeping or dropping states), register again, rebuild, catch-up rates |
//! | [`versions`] | [`PerspectiveVersions`](lockstep_core::PerspectiveVersions) | the first version serves, later ones build, a plain name serves as version 1, one serving version at a time, promotion requests, the versions lock |
//! | [`cursor_rows`] | [`CursorRows`] | `pending_pairs`, `ensure_cursor`, `delete_cursor` |
//!
//! Every case is also reachable here (`perspective_store::CASE`), which is the path the macro
//! and [`run_all`] use. The cases need the whole store ([`PerspectiveStoreFixture::Store`]):
//! most set up their pairs through other capabilities than the one they test.
//!
//! Every case uses fresh stream ids and perspective names, so the suite can run against a
//! shared database (perspectives registered by earlier cases only add work the cases never look
//! at). A fresh perspective still gets work on every stream already there (catch-up): the batch
//! cases first park those pairs of their perspectives, so that a batch hands out only the
//! case's own pairs, and give their batches a `scan` no database reaches. Transactions that end
//! in an error are **committed** afterwards where the case checks that "nothing was written": a
//! refused call leaves its transaction usable. Expiry is waited out with `tokio::time::sleep`
//! past the locker's lock timeout (instant on the fakes with paused time; give a database
//! fixture a lock timeout of a second or two). The debounce window is exercised with zero
//! against an hour, never with a sleep.
//!
//! Run it with [`perspective_store_conformance!`](crate::perspective_store_conformance) (one
//! test per case), or call the cases or [`run_all`] yourself.

pub mod admin;
pub mod cursor_rows;
pub mod lifecycle;
pub mod pair_work;
pub mod reads;
pub mod rewind_reads;
pub mod versions;
pub mod work_queue;

pub use admin::*;
pub use cursor_rows::*;
pub use lifecycle::*;
pub use pair_work::*;
pub use reads::*;
pub use rewind_reads::*;
pub use versions::*;
pub use work_queue::*;

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::CursorRows;
use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    AcquireOutcome, BatchClaim, BatchLimits, Claim, ClaimedBatch, ClaimedWork, Cursor, EventStore,
    ExpectedVersion, InstanceId, LeaseId, LockReason, NewEvent, Pair, PairFailure, PerspectiveName,
    PerspectiveStore, RecordedEvent, Release, RetireStates, Retired, RewindDebounce, StateCommit,
    StreamId, StreamLease, StreamLockAdmin, StreamLocker, TransactionSource, Upcasters,
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
    /// The store under test. It keeps
    /// [`DEFAULT_KEEP_SNAPSHOTS`](lockstep_core::perspective_store::DEFAULT_KEEP_SNAPSHOTS)
    /// snapshots per pair.
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

    /// The store under test over the same storage, reading every event it hands out through
    /// `upcasters` (the upcasting cases set up with [`store`](Self::store) and read with this
    /// one).
    fn store_with_upcasters(&self, upcasters: Upcasters) -> Self::Store;

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
    St: PerspectiveStore<S::Tx> + CursorRows<S::Tx> + super::Upcasting + 'static,
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

    fn store_with_upcasters(&self, upcasters: Upcasters) -> St {
        self.store.upcasting(upcasters)
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

/// The upcasters of the upcasting cases: version 1 of `Counted` is `{"count": n}`, version 2
/// `{"n": n}` (what [`folded`] reads). The upcaster renames the field, and fails on a payload
/// without a whole count.
fn counted_upcasters() -> Upcasters {
    Upcasters::new()
        .with("Counted", 1, |payload| {
            let n = payload["count"].as_i64().ok_or("no whole count")?;
            Ok(serde_json::json!({ "n": n }))
        })
        .expect("one upcaster")
}

/// A `Counted` event with the caller-chosen `id`: of version 1 (`{"count": n}`) or 2
/// (`{"n": n}`), read as `{"n": n}` through [`counted_upcasters`].
fn counted(id: Uuid, n: i64, schema_version: u32) -> NewEvent {
    let payload = match schema_version {
        1 => serde_json::json!({ "count": n }),
        _ => serde_json::json!({ "n": n }),
    };
    NewEvent::new("Counted", payload)
        .expect("event")
        .with_id(id)
        .expect("a chosen id")
        .with_schema_version(schema_version)
        .expect("a schema version")
}

/// A `Counted` event of version 1 that [`counted_upcasters`] fails on.
fn uncountable(id: Uuid) -> NewEvent {
    NewEvent::new("Counted", serde_json::json!({ "count": "many" }))
        .expect("event")
        .with_id(id)
        .expect("a chosen id")
}

/// A fresh stream of `Counted` events: for each id its version (1 or 2; 0 for one the
/// upcaster fails on), `n` its position from 1.
async fn counted_stream<F: PerspectiveStoreFixture>(
    fixture: &F,
    ids: &[Uuid],
    versions: &[u32],
) -> StreamId {
    let stream = StreamId::new_v7();
    let events: Vec<NewEvent> = ids
        .iter()
        .zip(versions)
        .enumerate()
        .map(|(i, (id, v))| match v {
            0 => uncountable(*id),
            v => counted(*id, i as i64 + 1, *v),
        })
        .collect();
    append(fixture, stream, &events).await;
    stream
}

/// Asserts that `events` are the `Counted` events `ids` read through [`counted_upcasters`]:
/// `{"n": position}` at version 2, `position` counted from `first`.
fn assert_counted(events: &[RecordedEvent], ids: &[Uuid], first: i64) {
    assert_eq!(event_ids(events), ids);
    for (i, e) in events.iter().enumerate() {
        assert_eq!(
            e.payload,
            serde_json::json!({ "n": first + i as i64 }),
            "{e:?}"
        );
        assert_eq!(e.schema_version, 2, "{e:?}");
    }
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

fn event_ids(events: &[RecordedEvent]) -> Vec<Uuid> {
    events.iter().map(|e| e.event_id).collect()
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
            a_claim_hands_out_upcast_events_and_stops_at_one_an_upcaster_fails_on,
            a_batch_hands_out_upcast_events_and_a_pair_unreadable_at_the_failing_event,
            rewind_reads_hand_out_upcast_events_up_to_one_an_upcaster_fails_on,
            the_first_version_declared_serves_and_a_later_one_builds,
            a_perspective_registered_before_versions_serves_as_version_one,
            two_versions_never_serve_at_once,
            a_promotion_request_is_recorded_until_the_status_changes,
            a_locking_read_of_versions_waits_for_the_transaction_holding_them,
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
