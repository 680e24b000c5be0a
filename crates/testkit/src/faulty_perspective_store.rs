//! A fault-injecting wrapper for a perspective store: [`FaultyPerspectiveStore`] forwards every
//! call of each capability trait the wrapped store implements ([`WorkQueue`], [`PairWork`],
//! [`PerspectiveReads`], [`RewindReads`], [`PerspectiveAdmin`], [`PerspectiveLifecycle`],
//! [`CursorRows`]) unless the test, through its [`PerspectiveStoreFaults`] handle, has asked
//! for a fault: fail the next calls of a method with a chosen [`ErrorKind`], lose the reply of
//! the next commits that end their transaction (committed, reported
//! [`ErrorKind::CommitUnknown`]), add latency to every call. With no fault armed it only
//! forwards.
//!
//! It implements a capability exactly when the wrapped store does, like
//! [`RecordingPerspectiveStore`](crate::RecordingPerspectiveStore).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> lockstep_core::Result<()> {
//! use lockstep_core::perspective_store::prelude::*;
//! use lockstep_core::{BatchClaim, ErrorKind, PerspectiveName};
//! use lockstep_testkit::{
//!     FakeDatabase, FaultyPerspectiveStore, InMemoryEventStore, InMemoryPerspectiveStore,
//!     InMemoryStreamLocker,
//! };
//!
//! let db = FakeDatabase::new();
//! let events = InMemoryEventStore::new();
//! let locker = InMemoryStreamLocker::with_database(Default::default(), &db);
//! let (store, faults) =
//!     FaultyPerspectiveStore::new(InMemoryPerspectiveStore::new(&db, &events, &locker));
//! let claim = BatchClaim::new(&[PerspectiveName::new("P")?]);
//!
//! faults.fail_next_claim_batches(1, ErrorKind::ConnectionLost);
//! let tx = db.begin_now();
//! let err = store.claim_batch(&tx, &claim).await.expect_err("injected");
//! assert_eq!(err.kind(), ErrorKind::ConnectionLost);
//! assert!(store.claim_batch(&tx, &claim).await?.pairs.is_empty(), "once, then forwarded");
//! # Ok(()) }
//! ```
//!
//! An injected failure never reaches the wrapped store, so unlike a real failed statement it
//! does **not** abort the caller's transaction (see [`crate::faults`]); code under test must
//! still retry in a new transaction, as the contracts require.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lockstep_core::{
    BatchClaim, BatchCommitted, BatchEntry, Claim, ClaimedBatch, Committed, Cursor, CursorRows,
    Error, ErrorKind, EventPage, InstanceId, LeaseId, PageLimits, Pair, PairFailure, PairWork,
    PendingPair, PendingThrough, PerspectiveAdmin, PerspectiveLifecycle, PerspectiveName,
    PerspectiveReads, PerspectiveStatus, PerspectiveVersion, PerspectiveVersions, ProgressReport,
    Rebuild, RecordedEvent, Release, Result, RetireStates, Retired, RewindDebounce, RewindLoad,
    RewindProgress, RewindReads, SkippedEvent, Snapshot, StateCommit, StoredState, StreamId,
    Throughput, Transaction, VersionDeclaration, VersionStatus, WorkQueue,
};
use uuid::Uuid;

use crate::recording_perspective_store::PerspectiveMethod;

/// The reads of a pair's cursor and state, which
/// [`PerspectiveStoreFaults::fail_next_state_reads`] counts together.
const STATE_READS: [PerspectiveMethod; 3] = [
    PerspectiveMethod::Cursor,
    PerspectiveMethod::State,
    PerspectiveMethod::States,
];

/// A countdown of calls that fail with an error of one kind.
type Failures = Option<(u32, ErrorKind)>;

/// Takes one from a countdown: the kind, if a fault fires.
fn take(slot: &mut Failures) -> Option<ErrorKind> {
    let (count, kind) = slot.as_mut()?;
    if *count == 0 {
        return None;
    }
    *count -= 1;
    Some(*kind)
}

#[derive(Debug, Default)]
struct State {
    /// Per method.
    methods: HashMap<PerspectiveMethod, Failures>,
    /// Any of [`STATE_READS`].
    state_reads: Failures,
    /// `commit` calls that commit and then report `CommitUnknown`.
    lost_commit_replies: u32,
    latency: Duration,
}

impl State {
    /// The next fault of a call of `method`, if any: its own countdown first, then its group's.
    fn next(&mut self, method: PerspectiveMethod) -> Option<ErrorKind> {
        if let Some(kind) = self.methods.get_mut(&method).and_then(take) {
            return Some(kind);
        }
        if STATE_READS.contains(&method) {
            return take(&mut self.state_reads);
        }
        None
    }
}

/// Controls the faults of a [`FaultyPerspectiveStore`]. Clones control the same wrapper.
///
/// Each `fail_next_*` arms one countdown and replaces what that countdown had left; a call
/// takes at most one fault (its method's own countdown before a group's).
#[derive(Debug, Clone, Default)]
pub struct PerspectiveStoreFaults {
    state: Arc<Mutex<State>>,
}

impl PerspectiveStoreFaults {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update is a single assignment, so a poisoned state is consistent.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The next `n` calls of `method` fail with an error of `kind` without reaching the store.
    /// A failed [`PairWork::commit`] rolls its transaction back (the transaction ends either
    /// way).
    pub fn fail_next_calls(&self, method: PerspectiveMethod, n: u32, kind: ErrorKind) {
        self.lock().methods.insert(method, Some((n, kind)));
    }

    /// The next `n` batch claims ([`WorkQueue::claim_batch`]) fail with an error of `kind`.
    pub fn fail_next_claim_batches(&self, n: u32, kind: ErrorKind) {
        self.fail_next_calls(PerspectiveMethod::ClaimBatch, n, kind);
    }

    /// The next `n` batch commits ([`WorkQueue::commit_batch`]) fail with an error of `kind`
    /// and write nothing of any entry.
    pub fn fail_next_batch_commits(&self, n: u32, kind: ErrorKind) {
        self.fail_next_calls(PerspectiveMethod::CommitBatch, n, kind);
    }

    /// The next `n` [`WorkQueue::record_failure`] calls fail with an error of `kind`.
    pub fn fail_next_failure_records(&self, n: u32, kind: ErrorKind) {
        self.fail_next_calls(PerspectiveMethod::RecordFailure, n, kind);
    }

    /// The next `n` one-pair claims ([`PairWork::claim`]) fail with an error of `kind`.
    pub fn fail_next_claims(&self, n: u32, kind: ErrorKind) {
        self.fail_next_calls(PerspectiveMethod::Claim, n, kind);
    }

    /// The next `n` single-pair commits ([`PairWork::commit`]) fail with an error of `kind`
    /// and commit nothing (their transaction is rolled back). [`ErrorKind::Conflict`] and
    /// [`ErrorKind::LeaseLost`] drive the paths of a refused commit.
    pub fn fail_next_commits(&self, n: u32, kind: ErrorKind) {
        self.fail_next_calls(PerspectiveMethod::Commit, n, kind);
    }

    /// The next `n` [`RewindReads::load_rewind`] calls fail with an error of `kind`.
    pub fn fail_next_rewind_loads(&self, n: u32, kind: ErrorKind) {
        self.fail_next_calls(PerspectiveMethod::LoadRewind, n, kind);
    }

    /// The next `n` reads of a cursor or a state — [`PerspectiveReads::cursor`],
    /// [`PerspectiveReads::state`] and [`PerspectiveReads::states`], counted together — fail
    /// with an error of `kind`.
    pub fn fail_next_state_reads(&self, n: u32, kind: ErrorKind) {
        self.lock().state_reads = Some((n, kind));
    }

    /// The next `n` registrations ([`PerspectiveLifecycle::register`]) fail with an error of
    /// `kind` and register nothing.
    pub fn fail_next_registers(&self, n: u32, kind: ErrorKind) {
        self.fail_next_calls(PerspectiveMethod::Register, n, kind);
    }

    /// The next `n` [`PairWork::commit`] calls commit as usual and
    /// then report [`ErrorKind::CommitUnknown`], as when the connection is lost while the
    /// commit's reply is on its way: the code under test cannot know whether its state
    /// change is stored, and must find out (the commit did happen). A refused commit is
    /// reported as it is. An armed failure of the same call comes first.
    pub fn lose_next_commit_replies(&self, n: u32) {
        self.lock().lost_commit_replies = n;
    }

    /// Every call sleeps `latency` (on tokio's clock) before doing anything.
    pub fn set_latency(&self, latency: Duration) {
        self.lock().latency = latency;
    }

    /// Removes every pending fault and the latency.
    pub fn clear(&self) {
        *self.lock() = State::default();
    }

    /// Waits the latency, then takes the next fault of a call of `method`, if any.
    async fn before(&self, method: PerspectiveMethod) -> Result<()> {
        let latency = self.lock().latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        match self.lock().next(method) {
            Some(kind) => Err(injected(kind, method)),
            None => Ok(()),
        }
    }

    /// Takes one lost commit reply, if any is armed.
    fn lose_commit_reply(&self) -> bool {
        let mut state = self.lock();
        if state.lost_commit_replies == 0 {
            return false;
        }
        state.lost_commit_replies -= 1;
        true
    }
}

fn injected(kind: ErrorKind, method: PerspectiveMethod) -> Error {
    Error::new(kind, format!("fault injected into {method}"))
}

/// A perspective store that injects the faults its [`PerspectiveStoreFaults`] handle asks for,
/// see the [module docs](self).
#[derive(Debug, Clone)]
pub struct FaultyPerspectiveStore<S> {
    inner: S,
    faults: PerspectiveStoreFaults,
}

impl<S> FaultyPerspectiveStore<S> {
    /// Wraps `inner`; returns the wrapper and its handle.
    pub fn new(inner: S) -> (Self, PerspectiveStoreFaults) {
        let faults = PerspectiveStoreFaults::default();
        (
            FaultyPerspectiveStore {
                inner,
                faults: faults.clone(),
            },
            faults,
        )
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl<Tx, S> WorkQueue<Tx> for FaultyPerspectiveStore<S>
where
    Tx: ?Sized + Sync,
    S: WorkQueue<Tx>,
{
    async fn claim_batch(&self, tx: &Tx, request: &BatchClaim) -> Result<ClaimedBatch> {
        self.faults.before(PerspectiveMethod::ClaimBatch).await?;
        self.inner.claim_batch(tx, request).await
    }

    async fn commit_batch(&self, tx: &Tx, entries: &[BatchEntry]) -> Result<Vec<BatchCommitted>> {
        self.faults.before(PerspectiveMethod::CommitBatch).await?;
        self.inner.commit_batch(tx, entries).await
    }

    async fn record_failure(&self, tx: &Tx, pair: &Pair, failure: &PairFailure) -> Result<bool> {
        self.faults.before(PerspectiveMethod::RecordFailure).await?;
        self.inner.record_failure(tx, pair, failure).await
    }
}

impl<Tx, S> PairWork<Tx> for FaultyPerspectiveStore<S>
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
        self.faults.before(PerspectiveMethod::Claim).await?;
        self.inner.claim(tx, pair, max_events, debounce).await
    }

    async fn commit(&self, tx: Tx, commit: &StateCommit, release: Release) -> Result<Committed>
    where
        Tx: Transaction,
    {
        let method = PerspectiveMethod::Commit;
        if let Err(err) = self.faults.before(method).await {
            // The transaction ends either way: dropping it rolls it back.
            drop(tx);
            return Err(err);
        }
        let done = self.inner.commit(tx, commit, release).await?;
        if self.faults.lose_commit_reply() {
            return Err(Error::new(
                ErrorKind::CommitUnknown,
                format!("fault injected into {method}: committed, reply lost"),
            ));
        }
        Ok(done)
    }

    async fn save_snapshot(
        &self,
        tx: &Tx,
        pair: &Pair,
        expected_revision: i64,
        fence: Option<&LeaseId>,
    ) -> Result<bool> {
        self.faults.before(PerspectiveMethod::SaveSnapshot).await?;
        self.inner
            .save_snapshot(tx, pair, expected_revision, fence)
            .await
    }

    async fn purge(&self, tx: &Tx, pair: &Pair, fence: Option<&LeaseId>) -> Result<()> {
        self.faults.before(PerspectiveMethod::Purge).await?;
        self.inner.purge(tx, pair, fence).await
    }
}

impl<Tx, S> PerspectiveReads<Tx> for FaultyPerspectiveStore<S>
where
    Tx: ?Sized + Sync,
    S: PerspectiveReads<Tx>,
{
    async fn cursor(&self, tx: &Tx, pair: &Pair) -> Result<Option<Cursor>> {
        self.faults.before(PerspectiveMethod::Cursor).await?;
        self.inner.cursor(tx, pair).await
    }

    async fn state(
        &self,
        tx: &Tx,
        pair: &Pair,
    ) -> Result<Option<(Cursor, Option<serde_json::Value>)>> {
        self.faults.before(PerspectiveMethod::State).await?;
        self.inner.state(tx, pair).await
    }

    async fn states(
        &self,
        tx: &Tx,
        perspective: &PerspectiveName,
        after: Option<StreamId>,
        limit: usize,
    ) -> Result<Vec<StoredState>> {
        self.faults.before(PerspectiveMethod::States).await?;
        self.inner.states(tx, perspective, after, limit).await
    }

    async fn pending_events(&self, tx: &Tx, pair: &Pair) -> Result<Vec<Uuid>> {
        self.faults.before(PerspectiveMethod::PendingEvents).await?;
        self.inner.pending_events(tx, pair).await
    }

    async fn stream_events(
        &self,
        tx: &Tx,
        stream_id: StreamId,
        after: Option<Uuid>,
    ) -> Result<Vec<RecordedEvent>> {
        self.faults.before(PerspectiveMethod::StreamEvents).await?;
        self.inner.stream_events(tx, stream_id, after).await
    }

    async fn skipped_events(&self, tx: &Tx, pair: &Pair) -> Result<Vec<SkippedEvent>> {
        self.faults.before(PerspectiveMethod::SkippedEvents).await?;
        self.inner.skipped_events(tx, pair).await
    }

    async fn pending_through(
        &self,
        tx: &Tx,
        perspective: &PerspectiveName,
        stream_id: Option<StreamId>,
        up_to: Uuid,
    ) -> Result<PendingThrough> {
        self.faults
            .before(PerspectiveMethod::PendingThrough)
            .await?;
        self.inner
            .pending_through(tx, perspective, stream_id, up_to)
            .await
    }
}

impl<Tx, S> RewindReads<Tx> for FaultyPerspectiveStore<S>
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
        self.faults.before(PerspectiveMethod::LoadRewind).await?;
        self.inner.load_rewind(tx, pair, page).await
    }

    async fn rewind_events(
        &self,
        tx: &Tx,
        pair: &Pair,
        after: Option<Uuid>,
        page: PageLimits,
    ) -> Result<EventPage> {
        self.faults.before(PerspectiveMethod::RewindEvents).await?;
        self.inner.rewind_events(tx, pair, after, page).await
    }

    async fn snapshot_before(
        &self,
        tx: &Tx,
        pair: &Pair,
        before: Uuid,
    ) -> Result<Option<Snapshot>> {
        self.faults
            .before(PerspectiveMethod::SnapshotBefore)
            .await?;
        self.inner.snapshot_before(tx, pair, before).await
    }

    async fn record_progress(&self, tx: &Tx, report: &ProgressReport) -> Result<()> {
        self.faults
            .before(PerspectiveMethod::RecordProgress)
            .await?;
        self.inner.record_progress(tx, report).await
    }
}

impl<Tx, S> PerspectiveAdmin<Tx> for FaultyPerspectiveStore<S>
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
        self.faults.before(PerspectiveMethod::FailingPairs).await?;
        self.inner.failing_pairs(tx, perspectives, limit).await
    }

    async fn parked_pairs(
        &self,
        tx: &Tx,
        perspectives: &[PerspectiveName],
        limit: usize,
    ) -> Result<Vec<Cursor>> {
        self.faults.before(PerspectiveMethod::ParkedPairs).await?;
        self.inner.parked_pairs(tx, perspectives, limit).await
    }

    async fn unpark(&self, tx: &Tx, pair: &Pair) -> Result<bool> {
        self.faults.before(PerspectiveMethod::Unpark).await?;
        self.inner.unpark(tx, pair).await
    }

    async fn skip_event(&self, tx: &Tx, pair: &Pair, event_id: Uuid, reason: &str) -> Result<bool> {
        self.faults.before(PerspectiveMethod::SkipEvent).await?;
        self.inner.skip_event(tx, pair, event_id, reason).await
    }

    async fn request_rewind(&self, tx: &Tx, pair: &Pair, from: Option<Uuid>) -> Result<bool> {
        self.faults.before(PerspectiveMethod::RequestRewind).await?;
        self.inner.request_rewind(tx, pair, from).await
    }

    async fn perspective_status(&self, tx: &Tx) -> Result<Vec<PerspectiveStatus>> {
        self.faults
            .before(PerspectiveMethod::PerspectiveStatus)
            .await?;
        self.inner.perspective_status(tx).await
    }

    async fn rewind_progress(
        &self,
        tx: &Tx,
        perspectives: &[PerspectiveName],
        limit: usize,
    ) -> Result<Vec<RewindProgress>> {
        self.faults
            .before(PerspectiveMethod::RewindProgress)
            .await?;
        self.inner.rewind_progress(tx, perspectives, limit).await
    }
}

impl<Tx, S> PerspectiveVersions<Tx> for FaultyPerspectiveStore<S>
where
    Tx: ?Sized + Sync,
    S: PerspectiveVersions<Tx>,
{
    async fn declare(
        &self,
        tx: &Tx,
        versions: &[VersionDeclaration],
    ) -> Result<Vec<PerspectiveVersion>> {
        self.faults.before(PerspectiveMethod::Declare).await?;
        self.inner.declare(tx, versions).await
    }

    async fn versions(
        &self,
        tx: &Tx,
        perspective: Option<&PerspectiveName>,
        lock: bool,
    ) -> Result<Vec<PerspectiveVersion>> {
        self.faults.before(PerspectiveMethod::Versions).await?;
        self.inner.versions(tx, perspective, lock).await
    }

    async fn set_version_status(
        &self,
        tx: &Tx,
        perspective: &PerspectiveName,
        version: u32,
        status: VersionStatus,
    ) -> Result<bool> {
        self.faults
            .before(PerspectiveMethod::SetVersionStatus)
            .await?;
        self.inner
            .set_version_status(tx, perspective, version, status)
            .await
    }

    async fn request_promotion(
        &self,
        tx: &Tx,
        perspective: &PerspectiveName,
        version: u32,
        force: bool,
    ) -> Result<bool> {
        self.faults
            .before(PerspectiveMethod::RequestPromotion)
            .await?;
        self.inner
            .request_promotion(tx, perspective, version, force)
            .await
    }
}

impl<Tx, S> PerspectiveLifecycle<Tx> for FaultyPerspectiveStore<S>
where
    Tx: ?Sized + Sync,
    S: PerspectiveLifecycle<Tx>,
{
    async fn register(&self, tx: &Tx, perspectives: &[PerspectiveName]) -> Result<()> {
        self.faults.before(PerspectiveMethod::Register).await?;
        self.inner.register(tx, perspectives).await
    }

    async fn retire(
        &self,
        tx: &Tx,
        perspective: &PerspectiveName,
        states: RetireStates,
    ) -> Result<Retired> {
        self.faults.before(PerspectiveMethod::Retire).await?;
        self.inner.retire(tx, perspective, states).await
    }

    async fn retired(&self, tx: &Tx) -> Result<Vec<PerspectiveName>> {
        self.faults.before(PerspectiveMethod::Retired).await?;
        self.inner.retired(tx).await
    }

    async fn rebuild(&self, tx: &Tx, perspective: &PerspectiveName) -> Result<Rebuild> {
        self.faults.before(PerspectiveMethod::Rebuild).await?;
        self.inner.rebuild(tx, perspective).await
    }

    async fn record_applied(&self, tx: &Tx, counts: &[(PerspectiveName, u64)]) -> Result<()> {
        self.faults.before(PerspectiveMethod::RecordApplied).await?;
        self.inner.record_applied(tx, counts).await
    }

    async fn throughput(&self, tx: &Tx) -> Result<Vec<Throughput>> {
        self.faults.before(PerspectiveMethod::Throughput).await?;
        self.inner.throughput(tx).await
    }
}

impl<Tx, S> CursorRows<Tx> for FaultyPerspectiveStore<S>
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
        self.faults.before(PerspectiveMethod::PendingPairs).await?;
        self.inner
            .pending_pairs(tx, instance, perspectives, debounce, limit)
            .await
    }

    async fn ensure_cursor(&self, tx: &Tx, pair: &Pair) -> Result<bool> {
        self.faults.before(PerspectiveMethod::EnsureCursor).await?;
        self.inner.ensure_cursor(tx, pair).await
    }

    async fn delete_cursor(&self, tx: &Tx, pair: &Pair) -> Result<bool> {
        self.faults.before(PerspectiveMethod::DeleteCursor).await?;
        self.inner.delete_cursor(tx, pair).await
    }
}
