//! [`PerspectiveWorker`]: builds read models from events, on as many instances as you run.
//!
//! Each cycle claims a **batch** of this worker's share of the work in one statement
//! ([`lockstep_core::WorkQueue::claim_batch`]: only its own perspectives; never a pair another batch
//! holds, under a live lease, backing off or parked), folds it, and commits it in one statement
//! ([`lockstep_core::WorkQueue::commit_batch`]) — see the [`batch`] module for the normal path. Up to
//! [`WorkerOptions::concurrency`] batches are in flight at once; instances split the work the
//! same way (the claims skip each other's rows). Every apply path of a pair runs under the
//! in-process [`ApplyCoordinator`]:
//!
//! - **Normal path** ([`batch`]): apply the pending events in event-id order, commit state +
//!   cursor + completed work (a compare-and-set on the cursor's revision per pair), with a
//!   snapshot each time the applied count crosses a multiple of `snapshot_every`. Then
//!   **bootstrap**: a pair that has applied events but no snapshot gets one, under a
//!   `bootstrap` lease when it can be had and without one when not (graceful
//!   degradation: the operation is idempotent and fenced by the cursor's revision); only a lease
//!   it acquired is released.
//! - **Rewind path** (a late arrival, or an operator's request), the lease lifecycle: try the
//!   `rewind` lease (denied → skip the pair until a later cycle, its work untouched); keep it
//!   alive ([`LeaseKeeper`]); restore the latest snapshot strictly before the trigger (or start
//!   empty) and replay every event in order but the ones an operator skipped; commit fenced on
//!   the lease, clearing the request and the snapshots it invalidates; stop the keepalive and
//!   release — on every path, including an `apply` that errors or panics, a store error, and a
//!   lost lease (the replay is abandoned the moment the keeper signals it; nothing is
//!   committed).
//! - **`apply` runs off the runtime's threads** (tokio's blocking pool, one task per batch or
//!   replay), so a slow, synchronous `apply` never holds up the keepalive, the lost signal or
//!   shutdown's grace timer; a replay checks the lost signal before every event, and a batch or
//!   replay whose pair was abandoned (lease lost, shutdown past its grace) stops within one
//!   event.
//! - **Failures** are the pair's, never the worker's: the error (a [`PairError`], by kind) is
//!   stored on the cursor as text with the event it happened at, the rewind request and the
//!   work stay, a metric is counted, and the pair backs off (`retry_at` on the cursor, doubling
//!   per failure: every instance waits it out) while every other pair is served; after
//!   [`WorkerOptions::park_after_failures`] failures in a row it is **parked** until an
//!   operator retries it, skips its failing event or requests a rewind. A commit that loses the
//!   cursor's compare-and-set (another applier moved it first) is no failure, on either path:
//!   the pair is skipped and looked at again, nothing stored, nothing backed off.
//! - **Versions**: [`PerspectiveWorker::register`] declares the worker's perspective versions
//!   and registers the ones that still apply events; after a cycle, at most once a second, the
//!   worker promotes the versions it runs that are due (automatic and caught up, or requested),
//!   and [`PerspectiveWorker::promote`] promotes one now (see [`crate::versions`]).
//! - Where each path lives: [`batch`] (the cycles' normal path), `pair` (one pair now,
//!   [`PerspectiveWorker::process_pair`]), `rewind`, `bootstrap`, `purge` and `promote`
//!   (versions); this file holds
//!   the worker, its cycle, the failure bookkeeping and the blocking-pool helpers they share.
//! - The locker is optional (`Option<Arc<dyn StreamLocker>>`, a nullable dependency):
//!   without one, rewind, bootstrap and purge run unlocked; the coordinator still serializes
//!   every apply path of a pair within the instance, and the store's compare-and-set still
//!   refuses a commit computed from a state another instance has moved on from. The fleet is
//!   optional too ([`PerspectiveWorker::with_fleet`]): a locker that keeps one, through which
//!   the worker then takes its leases and announces itself; without it, the worker runs
//!   unannounced.

pub mod batch;
mod bootstrap;
mod pair;
mod promote;
mod purge;
mod rate;
mod rewind;
mod table;

pub use promote::PromoteOptions;
pub use rewind::{PROGRESS_EVERY, SHORT_REPLAY_EVENTS, SHORT_REPLAY_TIME};

use std::panic::AssertUnwindSafe;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};

use lockstep_core::{
    ApplyError, DynPerspective, DynTablePerspective, Error, ErrorKind, Fleet, InstanceId,
    LeaseHolder, Pair, PairFailure, PerspectiveName, PerspectiveRegistry, PerspectiveStore,
    RecordedEvent, Result, StreamId, StreamLocker, Transaction, TransactionSource,
};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::coordinator::ApplyCoordinator;
use crate::error::{CycleError, PairError};
use crate::fleet::InstanceIdentity;
use crate::lease::{HeldLease, LeaseKeeper};
use crate::options::WorkerOptions;
use crate::telemetry::{self, count};

/// What processing one pair did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PairOutcome {
    /// The normal path applied this many events.
    Applied {
        /// Events applied.
        events: usize,
    },
    /// A rewind replayed this many events and committed.
    Rewound {
        /// Events replayed.
        replayed: usize,
        /// Whether it started from a snapshot (else from the start).
        from_snapshot: bool,
    },
    /// Nothing was done now; the pair is looked at again in a later cycle.
    Skipped(SkipReason),
    /// The pair failed; the error is stored on its cursor (its text, at its event) and the
    /// pair is retried after a backoff.
    Failed {
        /// What went wrong.
        error: PairError,
    },
}

/// Why a pair was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SkipReason {
    /// Nothing to do.
    Idle,
    /// Another transaction holds the pair's cursor row, or a lease pauses it.
    Busy,
    /// Another instance holds the pair's lease.
    Leased(LeaseHolder),
    /// The pair's perspective is not registered with this worker.
    UnknownPerspective,
    /// The worker is shutting down.
    ShuttingDown,
}

/// What a purge did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PurgeOutcome {
    /// The pair's state, snapshots and pending work are gone; its cursor is reset.
    Purged,
    /// Another instance holds the pair's lease: nothing was purged.
    Denied(LeaseHolder),
    /// Another transaction was using the pair's cursor row, so its lease could not be taken:
    /// nothing was purged; try again.
    Busy,
    /// The pair has no cursor row.
    NoCursor,
}

/// What one cycle did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CycleReport {
    /// Pairs looked at.
    pub pairs: usize,
    /// Events applied by the normal path.
    pub applied: usize,
    /// Rewinds committed.
    pub rewinds: usize,
    /// Events replayed by those rewinds.
    pub replayed: usize,
    /// Pairs skipped (busy, leased elsewhere, backing off, …).
    pub skipped: usize,
    /// Pairs that failed.
    pub failed: usize,
    /// Why they failed, one per failed pair (`Display`: `stream/perspective: error`).
    pub failures: Vec<FailedPair>,
    /// Errors of the cycle itself (the store unreachable, a batch whose commit failed, …).
    pub errors: Vec<CycleError>,
    /// Events applied by the normal path, per perspective (what the catch-up rate adds up).
    pub applied_by_perspective: std::collections::BTreeMap<PerspectiveName, usize>,
}

impl CycleReport {
    /// Whether the cycle did any work (applied, rewound).
    pub fn did_work(&self) -> bool {
        self.applied > 0 || self.rewinds > 0
    }

    /// Counts `events` applied by the normal path to a pair of `perspective`.
    pub(crate) fn add_applied(&mut self, perspective: &PerspectiveName, events: usize) {
        self.applied += events;
        if events > 0 {
            *self
                .applied_by_perspective
                .entry(perspective.clone())
                .or_default() += events;
        }
    }

    /// Adds one pair's outcome.
    fn add(&mut self, pair: &Pair, outcome: Result<PairOutcome>) {
        self.pairs += 1;
        match outcome {
            Ok(PairOutcome::Applied { events }) => self.add_applied(&pair.perspective, events),
            Ok(PairOutcome::Rewound { replayed, .. }) => {
                self.rewinds += 1;
                self.replayed += replayed;
            }
            Ok(PairOutcome::Skipped(_)) => self.skipped += 1,
            Ok(PairOutcome::Failed { error }) => {
                self.failed += 1;
                self.failures.push(FailedPair::new(pair.clone(), error));
            }
            Err(err) => self.errors.push(CycleError::new(&err)),
        }
    }

    /// Adds another report (of a batch of the same cycle).
    fn merge(&mut self, other: CycleReport) {
        self.pairs += other.pairs;
        self.applied += other.applied;
        self.rewinds += other.rewinds;
        self.replayed += other.replayed;
        self.skipped += other.skipped;
        self.failed += other.failed;
        self.failures.extend(other.failures);
        self.errors.extend(other.errors);
        for (name, n) in other.applied_by_perspective {
            *self.applied_by_perspective.entry(name).or_default() += n;
        }
    }
}

/// A pair that failed in a cycle, and why: one of [`CycleReport::failures`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FailedPair {
    /// The pair.
    pub pair: Pair,
    /// Why it failed (stored on its cursor).
    pub error: PairError,
}

impl FailedPair {
    /// `pair` failed with `error`.
    pub(crate) fn new(pair: Pair, error: PairError) -> FailedPair {
        FailedPair { pair, error }
    }
}

impl std::fmt::Display for FailedPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.pair, self.error)
    }
}

/// Builds perspectives from events; see the [module docs](self).
pub struct PerspectiveWorker<S: TransactionSource, P> {
    source: S,
    store: P,
    registry: PerspectiveRegistry,
    /// The registry's table perspectives, for this worker's transaction type.
    tables: Vec<lockstep_core::perspective::NamedTable<S::Tx>>,
    options: WorkerOptions,
    instance: InstanceId,
    keeper: Option<LeaseKeeper>,
    coordinator: ApplyCoordinator,
    /// Per perspective, where its walk of pairs with work continues; the first leads the next
    /// batch (rotated per claim).
    positions: Mutex<Vec<(PerspectiveName, Option<StreamId>)>>,
    /// How many times the batch limits are halved (after batches that failed as a whole).
    shrink: AtomicU32,
    /// The pairs of batches that failed as a whole, and when, until each is in a batch that
    /// commits, is charged with the failure, or has not been seen for [`batch::SUSPECT_FOR`]:
    /// the limits grow back only once none is left ([`batch`]).
    suspects: Mutex<std::collections::HashMap<Pair, std::time::Instant>>,
    /// How the instance names itself in the fleet.
    identity: InstanceIdentity,
    /// Events applied since the last catch-up report, and when that was ([`rate`]).
    applied: rate::Unreported,
    /// When the worker last looked for versions to promote ([`promote`]).
    version_checks: promote::VersionChecks,
    /// The stored names of the versions this worker runs that are being built (as the store
    /// said at registration and at the last version check): claimed apart from the others.
    building: Mutex<std::collections::BTreeSet<PerspectiveName>>,
    /// Whether the next batch claims the versions being built first ([`batch`]).
    build_first: std::sync::atomic::AtomicBool,
}

impl<S: TransactionSource, P> std::fmt::Debug for PerspectiveWorker<S, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerspectiveWorker")
            .field("instance", &self.instance)
            .field("perspectives", &self.registry)
            .field("locker", &self.keeper.is_some())
            .field("options", &self.options)
            .finish()
    }
}

impl<S, P> PerspectiveWorker<S, P>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    /// A worker for `registry`'s perspectives, on transactions from `source` and the store
    /// `store`, as `instance`. With a `locker`, rewind, bootstrap and purge run under stream
    /// leases kept alive by a [`LeaseKeeper`] (started here: call within a tokio runtime). The
    /// worker runs unannounced unless given a fleet ([`PerspectiveWorker::with_fleet`]).
    /// Invalid options are [`ErrorKind::InvalidInput`], and so is a registry with a table
    /// perspective registered for another transaction type than `S::Tx`.
    pub fn new(
        source: S,
        store: P,
        registry: PerspectiveRegistry,
        options: WorkerOptions,
        instance: InstanceId,
        locker: Option<Arc<dyn StreamLocker>>,
    ) -> Result<Self> {
        options.validate()?;
        if registry.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "a worker needs at least one perspective",
            ));
        }
        let tables = registry.tables::<S::Tx>()?;
        let positions = Mutex::new(registry.names().into_iter().map(|n| (n, None)).collect());
        Ok(PerspectiveWorker {
            positions,
            tables,
            source,
            store,
            registry,
            options,
            instance,
            keeper: locker.map(|l| LeaseKeeper::start(l, instance)),
            coordinator: ApplyCoordinator::new(options.coordinator_warn_after),
            shrink: AtomicU32::new(0),
            suspects: Mutex::default(),
            identity: InstanceIdentity::detect(),
            applied: rate::Unreported::default(),
            version_checks: promote::VersionChecks::default(),
            building: Mutex::default(),
            build_first: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The perspective called `name`, of either kind (`None`: this worker does not run it).
    fn kind(&self, name: &PerspectiveName) -> Option<Kind<S::Tx>> {
        if let Some(p) = self.registry.get(name) {
            return Some(Kind::Json(Arc::clone(p)));
        }
        self.tables
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| Kind::Table(Arc::clone(p)))
    }

    /// The same worker, naming itself `identity` in the fleet (default:
    /// [`InstanceIdentity::detect`]). A name, host or version the announcement refuses is
    /// [`ErrorKind::InvalidInput`], here rather than when the worker runs.
    pub fn with_identity(mut self, identity: InstanceIdentity) -> Result<Self> {
        identity.announcement(self.instance, self.registry.names())?;
        self.identity = identity;
        Ok(self)
    }

    /// How the instance names itself in the fleet.
    pub fn identity(&self) -> &InstanceIdentity {
        &self.identity
    }

    /// The same worker, in `fleet`: it takes its stream leases through `fleet` (in place of
    /// the locker given to [`PerspectiveWorker::new`], if any: a fleet is a stream locker whose
    /// keepalive also marks the instance seen, in one call), announces itself when
    /// [`run`](Self::run) starts, says it is alive with every keepalive and departs when `run`
    /// ends (see [`crate::fleet`]). Starts a new [`LeaseKeeper`]: call within a tokio runtime,
    /// before the worker takes any lease.
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use lockstep_core::{Fleet, InstanceId, PerspectiveRegistry, PerspectiveStore, TransactionSource};
    /// # use lockstep_worker::{PerspectiveWorker, WorkerOptions};
    /// # fn demo<S: TransactionSource, P: PerspectiveStore<S::Tx>>(
    /// #     source: S, store: P, registry: PerspectiveRegistry, fleet: Arc<dyn Fleet>,
    /// # ) -> lockstep_core::Result<()> {
    /// let worker = PerspectiveWorker::new(
    ///     source, store, registry, WorkerOptions::default(), InstanceId::process(), None,
    /// )?
    /// .with_fleet(fleet);
    /// # let _ = worker; Ok(()) }
    /// ```
    #[must_use]
    pub fn with_fleet(mut self, fleet: Arc<dyn Fleet>) -> Self {
        self.keeper = Some(LeaseKeeper::start_in_fleet(fleet, self.instance));
        self
    }

    /// Announces the instance to the fleet through its keeper (see [`crate::fleet`]): what
    /// [`PerspectiveWorker::run`] does first. `Ok(false)` without a fleet
    /// ([`PerspectiveWorker::with_fleet`]); a failure is the error.
    pub async fn announce(&self) -> Result<bool> {
        let Some(keeper) = self.keeper.as_ref().filter(|k| k.fleet().is_some()) else {
            return Ok(false);
        };
        let announcement = self
            .identity
            .announcement(self.instance, self.registry.names())?;
        keeper.announce(announcement).await?;
        Ok(true)
    }

    /// The instance this worker runs as.
    pub fn instance(&self) -> InstanceId {
        self.instance
    }

    /// The lease keeper, when the worker has a locker.
    pub fn keeper(&self) -> Option<&LeaseKeeper> {
        self.keeper.as_ref()
    }

    /// The in-process apply coordinator (every apply path of a pair takes it).
    pub fn coordinator(&self) -> &ApplyCoordinator {
        &self.coordinator
    }

    /// The store.
    pub fn store(&self) -> &P {
        &self.store
    }

    /// The transaction source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// Runs until `shutdown` fires: announces the instance to the fleet (with a fleet), then
    /// registers (a retryable failure is tried again every `poll_interval`: a registration may
    /// give up waiting for an append left open) and cycles,
    /// sleeping `poll_interval` after a cycle that found nothing. On shutdown it stops
    /// claiming, lets the pair in flight finish within `shutdown_grace` (abandoning it after
    /// that: its transaction rolls back), releases every lease the instance holds and departs
    /// from the fleet. Dropped instead (a cancelled task), it leaves its announcement to go
    /// stale.
    ///
    /// It refuses to start when its instance id is announced, live, by another process
    /// ([`lockstep_core::InstanceInUse`], [`ErrorKind::Conflict`]: two processes with one id
    /// would each hold every lease of the other): `run` returns that error before registering
    /// or claiming anything. Any other failure to announce is logged, and the worker runs
    /// unannounced.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        match self.announce().await {
            Ok(true) => {
                tracing::info!(instance = %self.instance, name = self.identity.name(), "worker instance announced")
            }
            Ok(false) => tracing::debug!("worker instance not announced (no fleet)"),
            Err(err) if lockstep_core::instance_in_use(&err).is_some() => {
                tracing::error!(error = %err, "the worker's instance id is in use by another process; not starting");
                return Err(err);
            }
            Err(err) => {
                tracing::warn!(error = %err, "announcing the worker instance failed; it runs unannounced")
            }
        }
        // A registration that cannot be made now (a retryable error: on Postgres, an append
        // transaction left open holds the registered perspectives' table and the registration
        // gave up waiting for it rather than hold every append back) is tried again after
        // `poll_interval`, until it is made or shutdown fires; another error ends the run, after
        // departing from the fleet like a shutdown.
        let registered = loop {
            match self.register().await {
                Ok(()) => break true,
                Err(err) if err.kind().is_retryable() => {
                    tracing::warn!(error = %err, "registering the perspectives failed; retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => break false,
                        () = tokio::time::sleep(self.options.poll_interval) => {}
                    }
                }
                Err(err) => {
                    if let Some(keeper) = &self.keeper
                        && let Err(depart) = keeper.shutdown().await
                    {
                        tracing::warn!(error = %depart, "departing after a failed registration failed");
                    }
                    return Err(err);
                }
            }
        };
        if registered {
            self.serve(&shutdown).await;
        }
        if let Some(keeper) = &self.keeper {
            let released = keeper.shutdown().await?;
            tracing::info!(released, "perspective worker stopped; leases released");
        }
        Ok(())
    }

    /// The cycles of [`run`](Self::run), once registered, until `shutdown` fires.
    async fn serve(&self, shutdown: &CancellationToken) {
        telemetry::describe();
        for name in self.registry.names() {
            telemetry::zero(name.as_str());
        }
        tracing::info!(
            instance = %self.instance,
            perspectives = ?self.registry,
            "perspective worker running"
        );
        while !shutdown.is_cancelled() {
            let report = self.cycle(Some(shutdown)).await;
            for error in &report.errors {
                tracing::warn!(error = %error, "perspective worker cycle failed");
            }
            if !report.did_work() {
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = tokio::time::sleep(self.options.poll_interval) => {}
                }
            }
        }
    }

    /// Runs one cycle (see the [module docs](self)).
    pub async fn run_once(&self) -> CycleReport {
        self.cycle(None).await
    }

    async fn cycle(&self, shutdown: Option<&CancellationToken>) -> CycleReport {
        // Up to `concurrency` batches at once: the claims skip each other's rows, so they never
        // share a pair.
        let batches = (0..self.options.concurrency).map(|_| async move {
            let mut report = CycleReport::default();
            let work = async {
                if let Err(err) = self.run_batch(&mut report).await {
                    report.errors.push(CycleError::new(&err));
                }
            };
            match shutdown {
                None => work.await,
                Some(shutdown) => {
                    // Drain with a bound: once shutdown fires, the batch in flight gets
                    // `shutdown_grace` more, then is abandoned (dropping it rolls back).
                    let grace = async {
                        shutdown.cancelled().await;
                        tokio::time::sleep(self.options.shutdown_grace).await;
                    };
                    tokio::select! {
                        () = work => {}
                        () = grace => {}
                    }
                }
            }
            report
        });
        let mut report = CycleReport::default();
        for one in futures_util::future::join_all(batches).await {
            report.merge(one);
        }
        self.report_applied(&report).await;
        self.check_versions().await;
        report
    }

    /// Stores a pair's failure on its cursor: its text, at its event when the failing event is
    /// known (what `perspectives parked` shows and `skip` skips; `None` clears it), with its
    /// backoff (`retry_at`: every instance waits it out) and, after `park_after_failures` in a
    /// row, parked.
    async fn fail(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        failures_before: u32,
        error: PairError,
    ) -> Result<PairOutcome> {
        let failures = failures_before.saturating_add(1);
        let failure = PairFailure::new(error.to_string())
            .at_event(error.event_id())
            .retry_after(self.options.backoff(failures))
            .park(self.options.parks_after(failures));
        let tx = self.source.begin().await?;
        let parked = self
            .store
            .record_failure(&tx, &Pair::new(stream_id, name.clone()), &failure)
            .await?;
        tx.commit().await?;
        if parked {
            count(telemetry::PAIRS_PARKED, name.as_str(), 1);
        }
        Ok(PairOutcome::Failed { error })
    }

    /// Requests a rewind of a pair from `from` (from the start when `None`), e.g. after the
    /// perspective's code changed. `Ok(false)` when the pair has no cursor.
    pub async fn request_rewind(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        from: Option<Uuid>,
    ) -> Result<bool> {
        let tx = self.source.begin().await?;
        let requested = self
            .store
            .request_rewind(&tx, &Pair::new(stream_id, name.clone()), from)
            .await?;
        tx.commit().await?;
        Ok(requested)
    }
}

/// A perspective of either kind, as the apply paths branch on it.
enum Kind<Tx> {
    /// Folds a JSON state (applied off the runtime's threads).
    Json(Arc<dyn DynPerspective>),
    /// Writes the application's tables in the worker's transaction ([`table`]).
    Table(Arc<dyn DynTablePerspective<Tx>>),
}

/// Rolls `tx` back where nothing depends on how the rollback went (`what` names the
/// transaction in the log). A rollback that fails still ends the transaction (on Postgres the
/// connection is closed, and the server rolls back), so its error is logged at `debug`, not
/// returned — except a `BEGIN` the server refused ([`ErrorKind::CommitUnknown`]: the
/// transaction's statements ran outside it), logged at `warn`. Awaited here rather than left to
/// the guard's drop, which rolls back in the background and may close the connection instead of
/// pooling it.
pub(crate) async fn rollback<T: Transaction>(tx: T, what: &'static str) {
    match tx.rollback().await {
        Ok(()) => {}
        Err(err) if err.kind() == ErrorKind::CommitUnknown => {
            tracing::warn!(error = %err, transaction = what, "rolling back failed: its statements may have run outside a transaction");
        }
        Err(err) => {
            tracing::debug!(error = %err, transaction = what, "rolling back failed; the transaction ended all the same");
        }
    }
}

/// Releases a lease, logging (not failing) when that does not work: it then expires.
async fn release(lease: HeldLease) {
    let id = lease.id().clone();
    if let Err(err) = lease.release().await {
        tracing::warn!(error = %err, stream_id = %id.stream_id, "releasing a lease failed; it will expire");
    }
}

/// What [`apply_off_runtime`] gives back: the state (the fold of the events applied), the
/// events, and how many were applied or why applying failed.
struct Applied {
    state: serde_json::Value,
    events: Vec<RecordedEvent>,
    outcome: std::result::Result<usize, ApplyError>,
}

/// Applies `events` to `state` on tokio's blocking pool, so that a slow `apply` (the user's
/// code, synchronous) never holds up the runtime's threads — the keepalive, the lost signal and
/// shutdown's grace timer keep running. Before each event it checks `stop` and whether this
/// future is still wanted: dropped, or once `stop` fires, it stops within one event.
async fn apply_off_runtime(
    p: &Arc<dyn DynPerspective>,
    state: serde_json::Value,
    events: Vec<RecordedEvent>,
    stop: &CancellationToken,
) -> Result<Applied> {
    apply_off_runtime_counting(p, state, events, stop, None).await
}

/// [`apply_off_runtime`], adding 1 to `started` as each event's application starts (one
/// relaxed atomic add per event: what the rewind's progress report reads).
async fn apply_off_runtime_counting(
    p: &Arc<dyn DynPerspective>,
    mut state: serde_json::Value,
    events: Vec<RecordedEvent>,
    stop: &CancellationToken,
    started: Option<Arc<std::sync::atomic::AtomicU64>>,
) -> Result<Applied> {
    let p = Arc::clone(p);
    let abandon = stop.child_token();
    let _abandon_when_dropped = abandon.clone().drop_guard();
    let task = tokio::task::spawn_blocking(move || {
        let go_on = || {
            if let Some(started) = &started {
                started.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            !abandon.is_cancelled()
        };
        let outcome = apply_guarded(&*p, &mut state, &events, &go_on);
        Applied {
            state,
            events,
            outcome,
        }
    });
    task.await.map_err(|e| {
        Error::new(
            ErrorKind::Backend,
            "the task applying events ended without an answer (the runtime is shutting down)",
        )
        .with_source(e)
    })
}

/// Applies `events` to `state` while `go_on()`, turning a panic in the perspective's code into
/// an error.
fn apply_guarded(
    p: &dyn DynPerspective,
    state: &mut serde_json::Value,
    events: &[RecordedEvent],
    go_on: &dyn Fn() -> bool,
) -> std::result::Result<usize, ApplyError> {
    match std::panic::catch_unwind(AssertUnwindSafe(|| p.apply_while(state, events, go_on))) {
        Ok(outcome) => outcome,
        Err(panic) => Err(ApplyError::Panicked {
            event_id: None,
            detail: panic_message(&*panic),
        }),
    }
}

/// What applying events one at a time found ([`probe`]).
enum Probe {
    /// The event at this index failed; the fold of the events before it.
    Failed(usize, serde_json::Value),
    /// None failed this time: the fold of them all.
    Clean(serde_json::Value),
    /// `go_on` said stop first.
    Stopped,
}

/// Applies `events` to `state` one at a time until one fails: how a panic's event is found
/// (a panic unwinds out of `apply_while` without saying which event it was applying).
fn probe(
    p: &dyn DynPerspective,
    mut state: serde_json::Value,
    events: &[RecordedEvent],
    go_on: &dyn Fn() -> bool,
) -> Probe {
    for (i, event) in events.iter().enumerate() {
        if !go_on() {
            return Probe::Stopped;
        }
        if apply_guarded(p, &mut state, std::slice::from_ref(event), go_on).is_err() {
            return Probe::Failed(i, state);
        }
    }
    Probe::Clean(state)
}

/// The event of `events` that `err` failed at, when applying them to `state` (the state
/// before them: a failed `apply_while` leaves it as it was): the one the error names, else,
/// for a panic, the first that fails when they are applied again one at a time (on tokio's
/// blocking pool, stopping once `stop` fires or this future is dropped). `None`: the error
/// is not an event's (a state that does not decode), or no event failed again.
async fn failed_at(
    p: &Arc<dyn DynPerspective>,
    state: serde_json::Value,
    events: Vec<RecordedEvent>,
    err: &ApplyError,
    stop: &CancellationToken,
) -> Option<Uuid> {
    match err {
        ApplyError::Apply { event_id, .. }
        | ApplyError::Panicked {
            event_id: Some(event_id),
            ..
        } => Some(*event_id),
        ApplyError::Panicked { event_id: None, .. } => {
            let p = Arc::clone(p);
            let abandon = stop.child_token();
            let _abandon_when_dropped = abandon.clone().drop_guard();
            tokio::task::spawn_blocking(move || {
                match probe(&*p, state, &events, &|| !abandon.is_cancelled()) {
                    Probe::Failed(i, _) => events.get(i).map(|e| e.event_id),
                    Probe::Clean(_) | Probe::Stopped => None,
                }
            })
            .await
            .ok()
            .flatten()
        }
        _ => None,
    }
}

/// A caught panic's message, when it was a string.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}
