//! A recording wrapper for a perspective store: [`RecordingPerspectiveStore`] forwards every
//! call of each capability trait the wrapped store implements ([`WorkQueue`], [`PairWork`],
//! [`PerspectiveReads`], [`RewindReads`], [`PerspectiveAdmin`], [`PerspectiveLifecycle`],
//! [`CursorRows`]) and remembers, in order, which method was called, on which pairs or
//! perspectives, and what came back — a short summary of the value ([`Returned`]), or the
//! [`ErrorKind`](lockstep_core::ErrorKind) of the error — so a test can assert on what a
//! worker or an operator's tool asked of the store.
//!
//! It implements a capability exactly when the wrapped store does, so it wraps the in-memory
//! store, a Postgres store, or any store that has only some of the capabilities. Wrapping a
//! store that implements all six of the union's traits gives a
//! [`PerspectiveStore`](lockstep_core::PerspectiveStore).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> lockstep_core::Result<()> {
//! use lockstep_core::perspective_store::prelude::*;
//! use lockstep_core::{Pair, PerspectiveName, StreamId, Transaction as _};
//! use lockstep_testkit::{
//!     FakeDatabase, InMemoryEventStore, InMemoryPerspectiveStore, InMemoryStreamLocker,
//!     PerspectiveMethod, RecordingPerspectiveStore, Returned,
//! };
//!
//! let db = FakeDatabase::new();
//! let events = InMemoryEventStore::new();
//! let locker = InMemoryStreamLocker::with_database(Default::default(), &db);
//! let inner = InMemoryPerspectiveStore::new(&db, &events, &locker);
//! let store = RecordingPerspectiveStore::new(inner);
//! let pair = Pair::new(StreamId::new_v7(), PerspectiveName::new("P")?);
//!
//! let tx = db.begin_now();
//! store.register(&tx, std::slice::from_ref(&pair.perspective)).await?;
//! store.cursor(&tx, &pair).await?;
//! tx.commit().await?;
//!
//! let calls = store.calls();
//! assert_eq!(store.methods(), [PerspectiveMethod::Register, PerspectiveMethod::Cursor]);
//! assert_eq!(calls[1].pairs, [pair]);
//! assert_eq!(calls[1].outcome, Ok(Returned::Found(false)));
//! # Ok(()) }
//! ```
//!
//! A call is recorded when it returns, so concurrent calls appear in the order they finished.
//! It records calls, not transactions: a commit whose transaction is later rolled back stays in
//! the record as a success.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use lockstep_core::{
    BatchClaim, BatchCommitted, BatchEntry, Claim, ClaimedBatch, Committed, Cursor, CursorRows,
    EventPage, InstanceId, LeaseId, PageLimits, Pair, PairFailure, PairWork, PendingPair,
    PendingThrough, PerspectiveAdmin, PerspectiveLifecycle, PerspectiveName, PerspectiveReads,
    PerspectiveStatus, PerspectiveVersion, PerspectiveVersions, ProgressReport, Rebuild,
    RecordedEvent, Release, Result, RetireStates, Retired, RewindDebounce, RewindLoad,
    RewindProgress, RewindReads, SkippedEvent, Snapshot, StateCommit, StoredState, StreamId,
    Throughput, Transaction, VersionDeclaration, VersionStatus, WorkQueue,
};
use uuid::Uuid;

use crate::recording::Outcome;

/// A method of the perspective store's capability traits (the traits' method names, in
/// `UpperCamelCase`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum PerspectiveMethod {
    /// [`WorkQueue::claim_batch`].
    ClaimBatch,
    /// [`WorkQueue::commit_batch`].
    CommitBatch,
    /// [`WorkQueue::record_failure`].
    RecordFailure,
    /// [`PairWork::claim`].
    Claim,
    /// [`PairWork::commit`].
    Commit,
    /// [`PairWork::save_snapshot`].
    SaveSnapshot,
    /// [`PairWork::purge`].
    Purge,
    /// [`PerspectiveReads::cursor`].
    Cursor,
    /// [`PerspectiveReads::state`].
    State,
    /// [`PerspectiveReads::states`].
    States,
    /// [`PerspectiveReads::pending_events`].
    PendingEvents,
    /// [`PerspectiveReads::stream_events`].
    StreamEvents,
    /// [`PerspectiveReads::skipped_events`].
    SkippedEvents,
    /// [`PerspectiveReads::pending_through`].
    PendingThrough,
    /// [`RewindReads::load_rewind`].
    LoadRewind,
    /// [`RewindReads::rewind_events`].
    RewindEvents,
    /// [`RewindReads::snapshot_before`].
    SnapshotBefore,
    /// [`RewindReads::record_progress`].
    RecordProgress,
    /// [`PerspectiveAdmin::failing_pairs`].
    FailingPairs,
    /// [`PerspectiveAdmin::parked_pairs`].
    ParkedPairs,
    /// [`PerspectiveAdmin::unpark`].
    Unpark,
    /// [`PerspectiveAdmin::skip_event`].
    SkipEvent,
    /// [`PerspectiveAdmin::request_rewind`].
    RequestRewind,
    /// [`PerspectiveAdmin::perspective_status`].
    PerspectiveStatus,
    /// [`PerspectiveAdmin::rewind_progress`].
    RewindProgress,
    /// [`PerspectiveLifecycle::register`].
    Register,
    /// [`PerspectiveLifecycle::retire`].
    Retire,
    /// [`PerspectiveLifecycle::retired`].
    Retired,
    /// [`PerspectiveLifecycle::rebuild`].
    Rebuild,
    /// [`PerspectiveLifecycle::record_applied`].
    RecordApplied,
    /// [`PerspectiveLifecycle::throughput`].
    Throughput,
    /// [`PerspectiveVersions::declare`].
    Declare,
    /// [`PerspectiveVersions::versions`].
    Versions,
    /// [`PerspectiveVersions::set_version_status`].
    SetVersionStatus,
    /// [`PerspectiveVersions::request_promotion`].
    RequestPromotion,
    /// [`CursorRows::pending_pairs`].
    PendingPairs,
    /// [`CursorRows::ensure_cursor`].
    EnsureCursor,
    /// [`CursorRows::delete_cursor`].
    DeleteCursor,
}

impl PerspectiveMethod {
    /// The method's name as the trait spells it (`claim_batch`).
    pub const fn name(self) -> &'static str {
        use PerspectiveMethod as M;
        match self {
            M::ClaimBatch => "claim_batch",
            M::CommitBatch => "commit_batch",
            M::RecordFailure => "record_failure",
            M::Claim => "claim",
            M::Commit => "commit",
            M::SaveSnapshot => "save_snapshot",
            M::Purge => "purge",
            M::Cursor => "cursor",
            M::State => "state",
            M::States => "states",
            M::PendingEvents => "pending_events",
            M::StreamEvents => "stream_events",
            M::SkippedEvents => "skipped_events",
            M::PendingThrough => "pending_through",
            M::LoadRewind => "load_rewind",
            M::RewindEvents => "rewind_events",
            M::SnapshotBefore => "snapshot_before",
            M::RecordProgress => "record_progress",
            M::FailingPairs => "failing_pairs",
            M::ParkedPairs => "parked_pairs",
            M::Unpark => "unpark",
            M::SkipEvent => "skip_event",
            M::RequestRewind => "request_rewind",
            M::PerspectiveStatus => "perspective_status",
            M::RewindProgress => "rewind_progress",
            M::Register => "register",
            M::Retire => "retire",
            M::Retired => "retired",
            M::Rebuild => "rebuild",
            M::RecordApplied => "record_applied",
            M::Throughput => "throughput",
            M::Declare => "declare",
            M::Versions => "versions",
            M::SetVersionStatus => "set_version_status",
            M::RequestPromotion => "request_promotion",
            M::PendingPairs => "pending_pairs",
            M::EnsureCursor => "ensure_cursor",
            M::DeleteCursor => "delete_cursor",
        }
    }
}

impl fmt::Display for PerspectiveMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a one-pair claim ([`PairWork::claim`]) came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimKind {
    /// [`Claim::Apply`], with how many events.
    Apply {
        /// Events handed out.
        events: usize,
    },
    /// [`Claim::Rewind`].
    Rewind,
    /// [`Claim::Idle`].
    Idle,
    /// [`Claim::Busy`].
    Busy,
    /// [`Claim::Unreadable`], with how many events before the unreadable one.
    Unreadable {
        /// Events handed out before it.
        events: usize,
    },
    /// A kind of claim this version of the testkit does not know.
    Other,
}

/// A summary of what a successful call returned: enough to assert on what the store said,
/// without keeping states and events.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Returned {
    /// `()`: `purge`, `record_progress`, `register`, `record_applied`.
    Done,
    /// The `bool` of `record_failure` (parked), `save_snapshot` (saved), `unpark`,
    /// `skip_event`, `request_rewind` (the pair was there), `ensure_cursor` (created),
    /// `delete_cursor` (deleted), `set_version_status` and `request_promotion` (the version
    /// was there).
    Flag(bool),
    /// The new revision of `commit`, and whether the lease was released with it.
    Committed {
        /// The new revision.
        revision: i64,
        /// Whether the lease was released.
        released: bool,
    },
    /// What a one-pair claim came to.
    Claim(ClaimKind),
    /// The pairs a batch claim handed out, in order.
    Pairs(Vec<Pair>),
    /// What each entry of a batch commit came to, in the entries' order.
    Entries(Vec<BatchCommitted>),
    /// Whether an `Option` read found something: `cursor`, `state`, `load_rewind`,
    /// `snapshot_before`.
    Found(bool),
    /// How many items a read returned: `states`, `pending_events`, `stream_events`,
    /// `skipped_events`, `rewind_events` (the page's events), `failing_pairs`, `parked_pairs`,
    /// `perspective_status`, `rewind_progress`, `retired`, `throughput`, `pending_pairs`,
    /// `declare`, `versions`.
    Count(usize),
    /// Whether `pending_through` found everything applied
    /// ([`PendingThrough::is_caught_up`]).
    CaughtUp(bool),
    /// What `retire` did.
    Retired(Retired),
    /// What `rebuild` did.
    Rebuild(Rebuild),
}

/// One call to a perspective store's capability, with its result.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PerspectiveCall {
    /// The method called.
    pub method: PerspectiveMethod,
    /// The pairs it was about: the pair of a one-pair call (a commit's, a progress report's),
    /// each entry's of a batch commit, the pair of a `pending_through` given a stream; empty
    /// otherwise.
    pub pairs: Vec<Pair>,
    /// The perspectives it named: a batch claim's, `register`'s, `retire`'s, `rebuild`'s,
    /// `states`'s, `pending_through`'s, the admin lists' and `pending_pairs`' filters,
    /// `record_applied`'s; empty otherwise.
    pub perspectives: Vec<PerspectiveName>,
    /// What came back.
    pub outcome: Outcome<Returned>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update is one push or clear, so a poisoned record is consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Records every call to the wrapped perspective store's capabilities (for any transaction
/// type), see the [module docs](self). Clones share the record.
#[derive(Debug, Clone)]
pub struct RecordingPerspectiveStore<S> {
    inner: S,
    calls: Arc<Mutex<Vec<PerspectiveCall>>>,
}

impl<S> RecordingPerspectiveStore<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        RecordingPerspectiveStore {
            inner,
            calls: Arc::default(),
        }
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<PerspectiveCall> {
        lock(&self.calls).clone()
    }

    /// The method of every call so far, in order.
    pub fn methods(&self) -> Vec<PerspectiveMethod> {
        lock(&self.calls).iter().map(|c| c.method).collect()
    }

    /// The calls of `method`, in order.
    pub fn calls_of(&self, method: PerspectiveMethod) -> Vec<PerspectiveCall> {
        lock(&self.calls)
            .iter()
            .filter(|c| c.method == method)
            .cloned()
            .collect()
    }

    /// Forgets every call so far (to assert on what a later step does).
    pub fn clear(&self) {
        lock(&self.calls).clear();
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn record<T>(
        &self,
        method: PerspectiveMethod,
        pairs: Vec<Pair>,
        perspectives: Vec<PerspectiveName>,
        result: &Result<T>,
        summary: impl FnOnce(&T) -> Returned,
    ) {
        let outcome = match result {
            Ok(value) => Ok(summary(value)),
            Err(e) => Err(e.kind()),
        };
        lock(&self.calls).push(PerspectiveCall {
            method,
            pairs,
            perspectives,
            outcome,
        });
    }
}

fn one(pair: &Pair) -> Vec<Pair> {
    vec![pair.clone()]
}

fn commit_pair(commit: &StateCommit) -> Vec<Pair> {
    vec![commit.pair.clone()]
}

fn done(_: &()) -> Returned {
    Returned::Done
}

fn flag(value: &bool) -> Returned {
    Returned::Flag(*value)
}

fn found<T>(value: &Option<T>) -> Returned {
    Returned::Found(value.is_some())
}

#[expect(
    clippy::ptr_arg,
    reason = "a summary of a `Vec` result: it is called as `FnOnce(&Vec<T>)`"
)]
fn count<T>(items: &Vec<T>) -> Returned {
    Returned::Count(items.len())
}

fn committed(done: &Committed) -> Returned {
    Returned::Committed {
        revision: done.revision,
        released: done.released,
    }
}

fn claim_kind(claim: &Claim) -> Returned {
    Returned::Claim(match claim {
        Claim::Apply { events, .. } => ClaimKind::Apply {
            events: events.len(),
        },
        Claim::Rewind { .. } => ClaimKind::Rewind,
        Claim::Idle => ClaimKind::Idle,
        Claim::Busy => ClaimKind::Busy,
        Claim::Unreadable { events, .. } => ClaimKind::Unreadable {
            events: events.len(),
        },
        _ => ClaimKind::Other,
    })
}

impl<Tx, S> WorkQueue<Tx> for RecordingPerspectiveStore<S>
where
    Tx: ?Sized + Sync,
    S: WorkQueue<Tx>,
{
    async fn claim_batch(&self, tx: &Tx, request: &BatchClaim) -> Result<ClaimedBatch> {
        let result = self.inner.claim_batch(tx, request).await;
        let perspectives = request.positions.iter().map(|(p, _)| p.clone()).collect();
        self.record(
            PerspectiveMethod::ClaimBatch,
            Vec::new(),
            perspectives,
            &result,
            |batch| Returned::Pairs(batch.pairs.iter().map(|p| p.cursor.pair.clone()).collect()),
        );
        result
    }

    async fn commit_batch(&self, tx: &Tx, entries: &[BatchEntry]) -> Result<Vec<BatchCommitted>> {
        let result = self.inner.commit_batch(tx, entries).await;
        let pairs = entries.iter().map(|e| e.pair.clone()).collect();
        self.record(
            PerspectiveMethod::CommitBatch,
            pairs,
            Vec::new(),
            &result,
            |done| Returned::Entries(done.clone()),
        );
        result
    }

    async fn record_failure(&self, tx: &Tx, pair: &Pair, failure: &PairFailure) -> Result<bool> {
        let result = self.inner.record_failure(tx, pair, failure).await;
        let method = PerspectiveMethod::RecordFailure;
        self.record(method, one(pair), Vec::new(), &result, flag);
        result
    }
}

impl<Tx, S> PairWork<Tx> for RecordingPerspectiveStore<S>
where
    Tx: ?Sized + Sync,
    S: PairWork<Tx>,
{
    async fn claim(
        &self,
        tx: &Tx,
        pair: &Pair,
        max_events: usize,
        debounce: RewindDebounce,
    ) -> Result<Claim> {
        let result = self.inner.claim(tx, pair, max_events, debounce).await;
        let method = PerspectiveMethod::Claim;
        self.record(method, one(pair), Vec::new(), &result, claim_kind);
        result
    }

    async fn commit(&self, tx: Tx, commit: &StateCommit, release: Release) -> Result<Committed>
    where
        Tx: Transaction,
    {
        let result = self.inner.commit(tx, commit, release).await;
        let method = PerspectiveMethod::Commit;
        self.record(method, commit_pair(commit), Vec::new(), &result, committed);
        result
    }

    async fn save_snapshot(
        &self,
        tx: &Tx,
        pair: &Pair,
        expected_revision: i64,
        fence: Option<&LeaseId>,
    ) -> Result<bool> {
        let result = self
            .inner
            .save_snapshot(tx, pair, expected_revision, fence)
            .await;
        let method = PerspectiveMethod::SaveSnapshot;
        self.record(method, one(pair), Vec::new(), &result, flag);
        result
    }

    async fn purge(&self, tx: &Tx, pair: &Pair, fence: Option<&LeaseId>) -> Result<()> {
        let result = self.inner.purge(tx, pair, fence).await;
        let method = PerspectiveMethod::Purge;
        self.record(method, one(pair), Vec::new(), &result, done);
        result
    }
}

impl<Tx, S> PerspectiveReads<Tx> for RecordingPerspectiveStore<S>
where
    Tx: ?Sized + Sync,
    S: PerspectiveReads<Tx>,
{
    async fn cursor(&self, tx: &Tx, pair: &Pair) -> Result<Option<Cursor>> {
        let result = self.inner.cursor(tx, pair).await;
        let method = PerspectiveMethod::Cursor;
        self.record(method, one(pair), Vec::new(), &result, found);
        result
    }

    async fn state(
        &self,
        tx: &Tx,
        pair: &Pair,
    ) -> Result<Option<(Cursor, Option<serde_json::Value>)>> {
        let result = self.inner.state(tx, pair).await;
        let method = PerspectiveMethod::State;
        self.record(method, one(pair), Vec::new(), &result, found);
        result
    }

    async fn states(
        &self,
        tx: &Tx,
        perspective: &PerspectiveName,
        after: Option<StreamId>,
        limit: usize,
    ) -> Result<Vec<StoredState>> {
        let result = self.inner.states(tx, perspective, after, limit).await;
        let perspectives = vec![perspective.clone()];
        let method = PerspectiveMethod::States;
        self.record(method, Vec::new(), perspectives, &result, count);
        result
    }

    async fn pending_events(&self, tx: &Tx, pair: &Pair) -> Result<Vec<Uuid>> {
        let result = self.inner.pending_events(tx, pair).await;
        let method = PerspectiveMethod::PendingEvents;
        self.record(method, one(pair), Vec::new(), &result, count);
        result
    }

    async fn stream_events(
        &self,
        tx: &Tx,
        stream_id: StreamId,
        after: Option<Uuid>,
    ) -> Result<Vec<RecordedEvent>> {
        let result = self.inner.stream_events(tx, stream_id, after).await;
        let method = PerspectiveMethod::StreamEvents;
        self.record(method, Vec::new(), Vec::new(), &result, count);
        result
    }

    async fn skipped_events(&self, tx: &Tx, pair: &Pair) -> Result<Vec<SkippedEvent>> {
        let result = self.inner.skipped_events(tx, pair).await;
        let method = PerspectiveMethod::SkippedEvents;
        self.record(method, one(pair), Vec::new(), &result, count);
        result
    }

    async fn pending_through(
        &self,
        tx: &Tx,
        perspective: &PerspectiveName,
        stream_id: Option<StreamId>,
        up_to: Uuid,
    ) -> Result<PendingThrough> {
        let result = self
            .inner
            .pending_through(tx, perspective, stream_id, up_to)
            .await;
        let pairs = stream_id
            .map(|s| Pair::new(s, perspective.clone()))
            .into_iter()
            .collect();
        self.record(
            PerspectiveMethod::PendingThrough,
            pairs,
            vec![perspective.clone()],
            &result,
            |p| Returned::CaughtUp(p.is_caught_up()),
        );
        result
    }
}

impl<Tx, S> RewindReads<Tx> for RecordingPerspectiveStore<S>
where
    Tx: ?Sized + Sync,
    S: RewindReads<Tx>,
{
    async fn load_rewind(
        &self,
        tx: &Tx,
        pair: &Pair,
        page: PageLimits,
    ) -> Result<Option<RewindLoad>> {
        let result = self.inner.load_rewind(tx, pair, page).await;
        let method = PerspectiveMethod::LoadRewind;
        self.record(method, one(pair), Vec::new(), &result, found);
        result
    }

    async fn rewind_events(
        &self,
        tx: &Tx,
        pair: &Pair,
        after: Option<Uuid>,
        page: PageLimits,
    ) -> Result<EventPage> {
        let result = self.inner.rewind_events(tx, pair, after, page).await;
        self.record(
            PerspectiveMethod::RewindEvents,
            one(pair),
            Vec::new(),
            &result,
            |p| Returned::Count(p.events.len()),
        );
        result
    }

    async fn snapshot_before(
        &self,
        tx: &Tx,
        pair: &Pair,
        before: Uuid,
    ) -> Result<Option<Snapshot>> {
        let result = self.inner.snapshot_before(tx, pair, before).await;
        let method = PerspectiveMethod::SnapshotBefore;
        self.record(method, one(pair), Vec::new(), &result, found);
        result
    }

    async fn record_progress(&self, tx: &Tx, report: &ProgressReport) -> Result<()> {
        let result = self.inner.record_progress(tx, report).await;
        let pairs = vec![Pair::new(
            report.pair.stream_id,
            report.pair.perspective.clone(),
        )];
        let method = PerspectiveMethod::RecordProgress;
        self.record(method, pairs, Vec::new(), &result, done);
        result
    }
}

impl<Tx, S> PerspectiveAdmin<Tx> for RecordingPerspectiveStore<S>
where
    Tx: ?Sized + Sync,
    S: PerspectiveAdmin<Tx>,
{
    async fn failing_pairs(
        &self,
        tx: &Tx,
        perspectives: &[PerspectiveName],
        limit: usize,
    ) -> Result<Vec<Cursor>> {
        let result = self.inner.failing_pairs(tx, perspectives, limit).await;
        let method = PerspectiveMethod::FailingPairs;
        self.record(method, Vec::new(), perspectives.to_vec(), &result, count);
        result
    }

    async fn parked_pairs(
        &self,
        tx: &Tx,
        perspectives: &[PerspectiveName],
        limit: usize,
    ) -> Result<Vec<Cursor>> {
        let result = self.inner.parked_pairs(tx, perspectives, limit).await;
        let method = PerspectiveMethod::ParkedPairs;
        self.record(method, Vec::new(), perspectives.to_vec(), &result, count);
        result
    }

    async fn unpark(&self, tx: &Tx, pair: &Pair) -> Result<bool> {
        let result = self.inner.unpark(tx, pair).await;
        let method = PerspectiveMethod::Unpark;
        self.record(method, one(pair), Vec::new(), &result, flag);
        result
    }

    async fn skip_event(&self, tx: &Tx, pair: &Pair, event_id: Uuid, reason: &str) -> Result<bool> {
        let result = self.inner.skip_event(tx, pair, event_id, reason).await;
        let method = PerspectiveMethod::SkipEvent;
        self.record(method, one(pair), Vec::new(), &result, flag);
        result
    }

    async fn request_rewind(&self, tx: &Tx, pair: &Pair, from: Option<Uuid>) -> Result<bool> {
        let result = self.inner.request_rewind(tx, pair, from).await;
        let method = PerspectiveMethod::RequestRewind;
        self.record(method, one(pair), Vec::new(), &result, flag);
        result
    }

    async fn perspective_status(&self, tx: &Tx) -> Result<Vec<PerspectiveStatus>> {
        let result = self.inner.perspective_status(tx).await;
        let method = PerspectiveMethod::PerspectiveStatus;
        self.record(method, Vec::new(), Vec::new(), &result, count);
        result
    }

    async fn rewind_progress(
        &self,
        tx: &Tx,
        perspectives: &[PerspectiveName],
        limit: usize,
    ) -> Result<Vec<RewindProgress>> {
        let result = self.inner.rewind_progress(tx, perspectives, limit).await;
        let method = PerspectiveMethod::RewindProgress;
        self.record(method, Vec::new(), perspectives.to_vec(), &result, count);
        result
    }
}

impl<Tx, S> PerspectiveLifecycle<Tx> for RecordingPerspectiveStore<S>
where
    Tx: ?Sized + Sync,
    S: PerspectiveLifecycle<Tx>,
{
    async fn register(&self, tx: &Tx, perspectives: &[PerspectiveName]) -> Result<()> {
        let result = self.inner.register(tx, perspectives).await;
        let method = PerspectiveMethod::Register;
        self.record(method, Vec::new(), perspectives.to_vec(), &result, done);
        result
    }

    async fn retire(
        &self,
        tx: &Tx,
        perspective: &PerspectiveName,
        states: RetireStates,
    ) -> Result<Retired> {
        let result = self.inner.retire(tx, perspective, states).await;
        self.record(
            PerspectiveMethod::Retire,
            Vec::new(),
            vec![perspective.clone()],
            &result,
            |r| Returned::Retired(*r),
        );
        result
    }

    async fn retired(&self, tx: &Tx) -> Result<Vec<PerspectiveName>> {
        let result = self.inner.retired(tx).await;
        let method = PerspectiveMethod::Retired;
        self.record(method, Vec::new(), Vec::new(), &result, count);
        result
    }

    async fn rebuild(&self, tx: &Tx, perspective: &PerspectiveName) -> Result<Rebuild> {
        let result = self.inner.rebuild(tx, perspective).await;
        self.record(
            PerspectiveMethod::Rebuild,
            Vec::new(),
            vec![perspective.clone()],
            &result,
            |r| Returned::Rebuild(*r),
        );
        result
    }

    async fn record_applied(&self, tx: &Tx, counts: &[(PerspectiveName, u64)]) -> Result<()> {
        let result = self.inner.record_applied(tx, counts).await;
        let perspectives = counts.iter().map(|(p, _)| p.clone()).collect();
        let method = PerspectiveMethod::RecordApplied;
        self.record(method, Vec::new(), perspectives, &result, done);
        result
    }

    async fn throughput(&self, tx: &Tx) -> Result<Vec<Throughput>> {
        let result = self.inner.throughput(tx).await;
        let method = PerspectiveMethod::Throughput;
        self.record(method, Vec::new(), Vec::new(), &result, count);
        result
    }
}

impl<Tx, S> PerspectiveVersions<Tx> for RecordingPerspectiveStore<S>
where
    Tx: ?Sized + Sync,
    S: PerspectiveVersions<Tx>,
{
    async fn declare(
        &self,
        tx: &Tx,
        versions: &[VersionDeclaration],
    ) -> Result<Vec<PerspectiveVersion>> {
        let result = self.inner.declare(tx, versions).await;
        let perspectives = versions.iter().map(|v| v.perspective.clone()).collect();
        self.record(
            PerspectiveMethod::Declare,
            Vec::new(),
            perspectives,
            &result,
            count,
        );
        result
    }

    async fn versions(
        &self,
        tx: &Tx,
        perspective: Option<&PerspectiveName>,
        lock: bool,
    ) -> Result<Vec<PerspectiveVersion>> {
        let result = self.inner.versions(tx, perspective, lock).await;
        let perspectives = perspective.into_iter().cloned().collect();
        self.record(
            PerspectiveMethod::Versions,
            Vec::new(),
            perspectives,
            &result,
            count,
        );
        result
    }

    async fn set_version_status(
        &self,
        tx: &Tx,
        perspective: &PerspectiveName,
        version: u32,
        status: VersionStatus,
    ) -> Result<bool> {
        let result = self
            .inner
            .set_version_status(tx, perspective, version, status)
            .await;
        let method = PerspectiveMethod::SetVersionStatus;
        self.record(method, Vec::new(), vec![perspective.clone()], &result, flag);
        result
    }

    async fn request_promotion(
        &self,
        tx: &Tx,
        perspective: &PerspectiveName,
        version: u32,
        force: bool,
    ) -> Result<bool> {
        let result = self
            .inner
            .request_promotion(tx, perspective, version, force)
            .await;
        let method = PerspectiveMethod::RequestPromotion;
        self.record(method, Vec::new(), vec![perspective.clone()], &result, flag);
        result
    }
}

impl<Tx, S> CursorRows<Tx> for RecordingPerspectiveStore<S>
where
    Tx: ?Sized + Sync,
    S: CursorRows<Tx>,
{
    async fn pending_pairs(
        &self,
        tx: &Tx,
        instance: InstanceId,
        perspectives: &[PerspectiveName],
        debounce: RewindDebounce,
        limit: usize,
    ) -> Result<Vec<PendingPair>> {
        let result = self
            .inner
            .pending_pairs(tx, instance, perspectives, debounce, limit)
            .await;
        let method = PerspectiveMethod::PendingPairs;
        self.record(method, Vec::new(), perspectives.to_vec(), &result, count);
        result
    }

    async fn ensure_cursor(&self, tx: &Tx, pair: &Pair) -> Result<bool> {
        let result = self.inner.ensure_cursor(tx, pair).await;
        let method = PerspectiveMethod::EnsureCursor;
        self.record(method, one(pair), Vec::new(), &result, flag);
        result
    }

    async fn delete_cursor(&self, tx: &Tx, pair: &Pair) -> Result<bool> {
        let result = self.inner.delete_cursor(tx, pair).await;
        let method = PerspectiveMethod::DeleteCursor;
        self.record(method, one(pair), Vec::new(), &result, flag);
        result
    }
}
