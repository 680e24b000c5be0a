//! [`PerspectiveWorker`]: builds read models from events, on as many instances as you run.
//!
//! Each cycle claims a **batch** of this worker's share of the work in one statement
//! ([`PerspectiveStore::claim_batch`]: only its own perspectives; never a pair another batch
//! holds, under a live lease, backing off or parked), folds it, and commits it in one statement
//! ([`PerspectiveStore::commit_batch`]) — see the [`batch`] module for the normal path. Up to
//! [`WorkerOptions::concurrency`] batches are in flight at once; instances split the work the
//! same way (the claims skip each other's rows). Every apply path of a pair runs under the
//! in-process [`ApplyCoordinator`]:
//!
//! - **Normal path** ([`batch`]): apply the pending events in event-id order, commit state +
//!   cursor + completed work (a compare-and-set on the cursor's revision per pair), with a
//!   snapshot each time the applied count crosses a multiple of `snapshot_every`. Then
//!   **bootstrap**: a pair that has applied events but no snapshot gets one, under a
//!   `bootstrap` lease when it can be had and without one when not (the seed's graceful
//!   degradation: the operation is idempotent and fenced by the cursor's revision); only a lease
//!   it acquired is released.
//! - **Rewind path** (a late arrival, or an operator's request), the seed's lifecycle: try the
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
//! - **Failures** are the pair's, never the worker's: the error is stored on the cursor with
//!   the event it happened at, the rewind request and the work stay, a metric is counted, and
//!   the pair backs off (`retry_at` on the cursor, doubling per failure: every instance waits
//!   it out) while every other pair is served; after
//!   [`WorkerOptions::park_after_failures`] failures in a row it is **parked** until an
//!   operator retries it, skips its failing event or requests a rewind. A commit that loses the
//!   cursor's compare-and-set (another applier moved it first) is no failure, on either path:
//!   the pair is skipped and looked at again, nothing stored, nothing backed off.
//! - The locker is optional (`Option<Arc<dyn StreamLocker>>`, the seed's nullable dependency):
//!   without one, rewind, bootstrap and purge run unlocked; the coordinator still serializes
//!   every apply path of a pair within the instance, and the store's compare-and-set still
//!   refuses a commit computed from a state another instance has moved on from.

pub mod batch;

use std::panic::AssertUnwindSafe;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};

use lockstep_core::{
    ApplyError, Claim, DynPerspective, Error, ErrorKind, InstanceId, LeaseHolder, LeaseId,
    LockReason, Pair, PairFailure, PerspectiveName, PerspectiveRegistry, PerspectiveStore,
    RecordedEvent, Result, StateCommit, StreamId, StreamLocker, Transaction, TransactionSource,
};
use time::OffsetDateTime;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::coordinator::ApplyCoordinator;
use crate::lease::{HeldLease, LeaseKeeper, Leased};
use crate::options::WorkerOptions;
use crate::telemetry::{self, count, observe};

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
    /// The pair failed; the error is stored on its cursor and it is retried after a backoff.
    Failed {
        /// What went wrong.
        error: String,
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
    /// Why they failed: `stream/perspective: error`, one per failed pair.
    pub failures: Vec<String>,
    /// Errors of the cycle itself (the store unreachable, …), as text.
    pub errors: Vec<String>,
}

impl CycleReport {
    /// Whether the cycle did any work (applied, rewound).
    pub fn did_work(&self) -> bool {
        self.applied > 0 || self.rewinds > 0
    }

    /// Adds one pair's outcome.
    fn add(&mut self, pair: &Pair, outcome: Result<PairOutcome>) {
        self.pairs += 1;
        match outcome {
            Ok(PairOutcome::Applied { events }) => self.applied += events,
            Ok(PairOutcome::Rewound { replayed, .. }) => {
                self.rewinds += 1;
                self.replayed += replayed;
            }
            Ok(PairOutcome::Skipped(_)) => self.skipped += 1,
            Ok(PairOutcome::Failed { error }) => {
                self.failed += 1;
                self.failures.push(format!("{pair}: {error}"));
            }
            Err(err) => self.errors.push(err.to_string()),
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
    }
}

/// Builds perspectives from events; see the [module docs](self).
pub struct PerspectiveWorker<S, P> {
    source: S,
    store: P,
    registry: PerspectiveRegistry,
    options: WorkerOptions,
    instance: InstanceId,
    keeper: Option<LeaseKeeper>,
    coordinator: ApplyCoordinator,
    /// Per perspective, where its walk of pairs with work continues; the first leads the next
    /// batch (rotated per claim).
    positions: Mutex<Vec<(PerspectiveName, Option<StreamId>)>>,
    /// How many times the batch limits are halved (after batches that failed as a whole).
    shrink: AtomicU32,
}

impl<S, P> std::fmt::Debug for PerspectiveWorker<S, P> {
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
    /// leases kept alive by a [`LeaseKeeper`] (started here: call within a tokio runtime).
    /// Invalid options are [`ErrorKind::InvalidInput`].
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
        let positions = Mutex::new(registry.names().into_iter().map(|n| (n, None)).collect());
        Ok(PerspectiveWorker {
            positions,
            source,
            store,
            registry,
            options,
            instance,
            keeper: locker.map(|l| LeaseKeeper::start(l, instance)),
            coordinator: ApplyCoordinator::new(options.coordinator_warn_after),
            shrink: AtomicU32::new(0),
        })
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

    /// Registers the worker's perspectives in the store (idempotent; a new one catches up on
    /// existing events).
    pub async fn register(&self) -> Result<()> {
        let names = self.registry.names();
        let tx = self.source.begin().await?;
        self.store.register(&tx, &names).await?;
        tx.commit().await
    }

    /// Runs until `shutdown` fires: registers, then cycles, sleeping `poll_interval` after a
    /// cycle that found nothing. On shutdown it stops claiming, lets the pair in flight finish
    /// within `shutdown_grace` (abandoning it after that: its transaction rolls back), and
    /// releases every lease the instance holds.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        self.register().await?;
        while !shutdown.is_cancelled() {
            let report = self.cycle(Some(&shutdown)).await;
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
        if let Some(keeper) = &self.keeper {
            let released = keeper.shutdown().await?;
            tracing::info!(released, "perspective worker stopped; leases released");
        }
        Ok(())
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
                    report.errors.push(err.to_string());
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
        report
    }

    /// Processes one pair now: the normal path, or the rewind path when the pair needs one.
    /// Errors of the store are returned; errors of the pair are stored on it
    /// ([`PairOutcome::Failed`]). An explicit call does not wait for the pair's backoff nor
    /// for its parking (it is the operator's "process this pair now"); the cycles do.
    pub async fn process_pair(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<PairOutcome> {
        let span = tracing::info_span!(
            "process_pair",
            stream_id = %stream_id,
            perspective = %perspective,
        );
        async move {
            let Some(p) = self.registry.get(perspective).cloned() else {
                return Ok(PairOutcome::Skipped(SkipReason::UnknownPerspective));
            };
            let _pair = self.coordinator.lock(stream_id, perspective).await;
            match self.apply_pending(stream_id, perspective, &p).await? {
                Normal::Done(outcome) => Ok(outcome),
                Normal::NeedsRewind => self.rewind_locked(stream_id, perspective, &p).await,
            }
        }
        .instrument(span)
        .await
    }

    /// The normal path, under the pair's coordinator lock.
    async fn apply_pending(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Arc<dyn DynPerspective>,
    ) -> Result<Normal> {
        // Every `?` below drops the open guard, which rolls the transaction back.
        let tx = self.source.begin().await?;
        let claim = self
            .store
            .claim(
                &tx,
                stream_id,
                name,
                self.options.max_events_per_claim,
                self.options.debounce(),
            )
            .await?;
        let (cursor, state, events) = match claim {
            Claim::Apply {
                cursor,
                state,
                events,
            } => (cursor, state, events),
            Claim::Rewind { .. } => {
                // Keep a rewind request the claim may have just written.
                tx.commit().await?;
                return Ok(Normal::NeedsRewind);
            }
            Claim::Busy => {
                tx.rollback().await?;
                return Ok(Normal::Done(PairOutcome::Skipped(SkipReason::Busy)));
            }
            _ => {
                // Committed, not rolled back: a late arrival inside the debounce window is
                // written by this claim, and the window only runs once it is stored (rolled
                // back, every cycle found it anew and the pair never moved: issue 19).
                tx.commit().await?;
                return Ok(Normal::Done(PairOutcome::Skipped(SkipReason::Idle)));
            }
        };
        // From here on whatever fails is the pair's (issue 18): a state that does not serialize,
        // a commit the server refuses, a lost commit — stored on its cursor and backed off like a
        // failing `apply`, not a cycle error retried at full size every cycle. Only when even
        // storing the failure fails is it the cycle's (the database itself is unavailable).
        let failures = cursor.failures;
        match self
            .apply_claimed(tx, stream_id, name, p, cursor, state, events)
            .await
        {
            Ok(normal) => Ok(normal),
            Err(err) => {
                count(telemetry::PAIR_FAILURES, name.as_str(), 1);
                tracing::warn!(error = %err, "processing the pair failed; stored on its cursor");
                match self.fail(stream_id, name, failures, &err.to_string()).await {
                    Ok(outcome) => Ok(Normal::Done(outcome)),
                    Err(_) => Err(err),
                }
            }
        }
    }

    /// The normal path after a claim returned events: fold them and commit. An `Err` is a
    /// failure of the pair (the caller stores it); the transaction is ended on every path.
    #[allow(clippy::too_many_arguments)]
    async fn apply_claimed(
        &self,
        tx: S::Tx,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Arc<dyn DynPerspective>,
        cursor: lockstep_core::Cursor,
        state: Option<serde_json::Value>,
        events: Vec<RecordedEvent>,
    ) -> Result<Normal> {
        let state = match state {
            Some(state) => state,
            None => p.initial_state()?,
        };
        // Off the runtime's threads; a dropped pair (shutdown past its grace) stops it.
        let applied = apply_off_runtime(p, state, events, &CancellationToken::new()).await?;
        let (state, events) = (applied.state, applied.events);
        if let Err(err) = applied.outcome {
            // Ended before the failure is stored on the same cursor row (by `fail`, in a
            // transaction of its own), so that one does not wait for this one's row lock.
            let _ = tx.rollback().await;
            count(telemetry::APPLY_FAILURES, name.as_str(), 1);
            return self
                .fail(stream_id, name, cursor.failures, &err.to_string())
                .await
                .map(Normal::Done);
        }
        let applied_count = cursor.applied_count + events.len() as u64;
        let every = self.options.snapshot_every;
        let snapshot = applied_count / every > cursor.applied_count / every;
        let oldest = events.iter().map(|e| e.recorded_at).min();
        let mut commit = StateCommit::new(stream_id, name.clone(), cursor.revision, state);
        commit.last_event_id = events.last().map(|e| e.event_id).or(cursor.last_event_id);
        commit.applied_count = applied_count;
        commit.applied_events = events.iter().map(|e| e.event_id).collect();
        commit.snapshot = snapshot;
        if let Err(err) = self.store.commit_state(&tx, &commit).await {
            drop(tx); // rolls back
            return match err.kind() {
                // Another applier moved the cursor first: nothing lost, look again later.
                ErrorKind::Conflict => Ok(Normal::Done(PairOutcome::Skipped(SkipReason::Busy))),
                _ => Err(err),
            };
        }
        let revision = cursor.revision + 1;
        tx.commit().await?;
        count(
            telemetry::EVENTS_APPLIED,
            name.as_str(),
            events.len() as u64,
        );
        if let Some(oldest) = oldest {
            let lag = (OffsetDateTime::now_utc() - oldest)
                .as_seconds_f64()
                .max(0.0);
            observe(telemetry::LAG_SECONDS, name.as_str(), lag);
        }
        let needs_bootstrap = cursor.latest_snapshot.is_none() && !snapshot && applied_count > 0;
        if needs_bootstrap && let Err(err) = self.bootstrap(stream_id, name, revision).await {
            tracing::warn!(error = %err, "bootstrap failed; retried after the next apply");
        }
        Ok(Normal::Done(PairOutcome::Applied {
            events: events.len(),
        }))
    }

    /// Bootstrap: snapshot a pair that has applied events but no snapshot (see the module
    /// docs). Returns whether a snapshot was written.
    async fn bootstrap(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        revision: i64,
    ) -> Result<bool> {
        let lease = match &self.keeper {
            Some(keeper) => match keeper
                .try_acquire(stream_id, name, &LockReason::Bootstrap)
                .await
            {
                Ok(Leased::Acquired(lease)) => Some(lease),
                // Graceful degradation (the seed): proceed without the lease; the save is
                // idempotent and refused if the cursor moved on.
                Ok(Leased::Denied(_) | Leased::Busy | Leased::NoCursor) => None,
                Err(err) => {
                    tracing::debug!(error = %err, "bootstrap lease unavailable; proceeding without");
                    None
                }
            },
            None => None,
        };
        let fence = lease.as_ref().map(|l| l.id().clone());
        let saved = async {
            let tx = self.source.begin().await?;
            let saved = self
                .store
                .save_snapshot(&tx, stream_id, name, revision, fence.as_ref())
                .await?;
            tx.commit().await?;
            Ok::<_, Error>(saved)
        }
        .await;
        if let Some(lease) = lease {
            release(lease).await;
        }
        let saved = saved?;
        if saved {
            count(telemetry::BOOTSTRAPS, name.as_str(), 1);
        }
        Ok(saved)
    }

    /// Rewinds a pair now if it has a rewind request (the rewind path of the module docs).
    pub async fn rewind(&self, stream_id: StreamId, name: &PerspectiveName) -> Result<PairOutcome> {
        let Some(p) = self.registry.get(name).cloned() else {
            return Ok(PairOutcome::Skipped(SkipReason::UnknownPerspective));
        };
        let _pair = self.coordinator.lock(stream_id, name).await;
        self.rewind_locked(stream_id, name, &p).await
    }

    async fn rewind_locked(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Arc<dyn DynPerspective>,
    ) -> Result<PairOutcome> {
        let span = tracing::info_span!("rewind", reason = "rewind", epoch = tracing::field::Empty);
        async move {
            let started = Instant::now();
            // 1. Acquire the lease (denied: skip this pair, retry on a later cycle).
            let lease = match &self.keeper {
                Some(keeper) => match keeper
                    .try_acquire(stream_id, name, &LockReason::Rewind)
                    .await
                {
                    Err(err) => return Err(err),
                    Ok(Leased::Acquired(lease)) => Some(lease),
                    Ok(Leased::Denied(holder)) => {
                        count(telemetry::SKIPPED_LEASED, name.as_str(), 1);
                        return Ok(PairOutcome::Skipped(SkipReason::Leased(holder)));
                    }
                    // The cursor row is busy (another transaction holds it: a claim, a fenced
                    // commit): like a denial, try again on a later cycle.
                    Ok(Leased::Busy) => {
                        count(telemetry::SKIPPED_BUSY, name.as_str(), 1);
                        tracing::debug!("cursor row busy; rewind retried on a later cycle");
                        return Ok(PairOutcome::Skipped(SkipReason::Busy));
                    }
                    Ok(Leased::NoCursor) => return Ok(PairOutcome::Skipped(SkipReason::Idle)),
                },
                None => None,
            };
            if let Some(lease) = &lease {
                tracing::Span::current().record("epoch", lease.id().epoch.get());
            }
            // 2–3. The keeper keeps it alive while we restore and replay; a lost lease abandons
            // the work at once.
            let outcome = self.rewind_under(stream_id, name, p, lease.as_ref()).await;
            // 4–5. Stop the keepalive and release, on every path.
            if let Some(lease) = lease {
                release(lease).await;
            }
            observe(
                telemetry::REWIND_SECONDS,
                name.as_str(),
                started.elapsed().as_secs_f64(),
            );
            match outcome {
                Ok(Rewind::Committed {
                    replayed,
                    from_snapshot,
                }) => {
                    count(telemetry::REWINDS, name.as_str(), 1);
                    count(telemetry::EVENTS_REPLAYED, name.as_str(), replayed as u64);
                    count(
                        if from_snapshot {
                            telemetry::REPLAYS_FROM_SNAPSHOT
                        } else {
                            telemetry::REPLAYS_FULL
                        },
                        name.as_str(),
                        1,
                    );
                    Ok(PairOutcome::Rewound {
                        replayed,
                        from_snapshot,
                    })
                }
                Ok(Rewind::NothingToDo) => Ok(PairOutcome::Skipped(SkipReason::Idle)),
                Ok(Rewind::LostRace) => Ok(PairOutcome::Skipped(SkipReason::Busy)),
                Err((failures, err)) => {
                    count(telemetry::REWIND_FAILURES, name.as_str(), 1);
                    tracing::warn!(error = %err, "rewind failed; the request stays and is retried");
                    self.fail(stream_id, name, failures, &err).await
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Restore, replay and commit. `Err((failures, error))`: the pair's failure count before
    /// this one, and what went wrong.
    async fn rewind_under(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Arc<dyn DynPerspective>,
        lease: Option<&HeldLease>,
    ) -> std::result::Result<Rewind, (u32, String)> {
        let never = CancellationToken::new();
        let lost = lease.map_or(&never, HeldLease::lost);
        let fence = lease.map(|l| l.id().clone());
        let read = async {
            let tx = self.source.begin().await.map_err(|e| (0, e.to_string()))?;
            let loaded = self.load_for_rewind(&tx, stream_id, name).await;
            // Read only: a failed rollback still ends it, and changes nothing.
            let _ = tx.rollback().await;
            loaded
        };
        let loaded = tokio::select! {
            biased;
            () = lost.cancelled() => return Err((0, lease_lost())),
            loaded = read => loaded?,
        };
        let Some(loaded) = loaded else {
            return Ok(Rewind::NothingToDo);
        };
        let mut loaded = loaded;
        let failures = loaded.cursor_failures;
        let state = match loaded.state.take() {
            Some(state) => state,
            None => p.initial_state().map_err(|e| (failures, e.to_string()))?,
        };
        // On a blocking thread, checking the lost signal before every event; dropped (the lost
        // signal wins the race below, or shutdown abandons the pair) it stops within one event.
        let replay = apply_off_runtime(p, state, std::mem::take(&mut loaded.events), lost);
        let applied = tokio::select! {
            biased;
            () = lost.cancelled() => return Err((failures, lease_lost())),
            applied = replay => applied.map_err(|e| (failures, e.to_string()))?,
        };
        loaded.events = applied.events;
        let state = match applied.outcome {
            Ok(n) if n == loaded.events.len() => applied.state,
            // Stopped before the end: only the lost signal stops a replay.
            Ok(_) => return Err((failures, lease_lost())),
            Err(e) => {
                return Err((
                    failures,
                    format!("the perspective failed during replay: {e}"),
                ));
            }
        };
        // The commit is fenced on the lease: not raced against the lost signal, so that a commit
        // the server accepted is never reported as failed.
        let replayed = loaded.events.len();
        let mut commit = StateCommit::new(stream_id, name.clone(), loaded.revision, state);
        commit.last_event_id = loaded.events.last().map(|e| e.event_id).or(loaded.base);
        commit.applied_count = loaded.base_count + replayed as u64;
        commit.applied_events = loaded.events.iter().map(|e| e.event_id).collect();
        commit.rewound_from = Some(loaded.trigger);
        commit.snapshot = true;
        commit.fence = fence;
        let committed = async {
            let tx = self.source.begin().await?;
            self.store.commit_state(&tx, &commit).await?;
            tx.commit().await
        }
        .await;
        match committed {
            Ok(_) => Ok(Rewind::Committed {
                replayed,
                from_snapshot: loaded.base.is_some(),
            }),
            // Another applier moved the cursor first: nothing is lost, the pair is looked at
            // again later — the normal path's rule for the same conflict.
            Err(err) if err.kind() == ErrorKind::Conflict => Ok(Rewind::LostRace),
            Err(err) => Err((failures, err.to_string())),
        }
    }

    async fn load_for_rewind(
        &self,
        tx: &S::Tx,
        stream_id: StreamId,
        name: &PerspectiveName,
    ) -> std::result::Result<Option<Loaded>, (u32, String)> {
        let cursor = self
            .store
            .cursor(tx, stream_id, name)
            .await
            .map_err(|e| (0, e.to_string()))?;
        let Some(cursor) = cursor else {
            return Ok(None);
        };
        let Some(rewind) = cursor.rewind else {
            return Ok(None); // someone else finished it
        };
        let failures = cursor.failures;
        let snapshot = self
            .store
            .snapshot_before(tx, stream_id, name, rewind.trigger)
            .await
            .map_err(|e| (failures, e.to_string()))?;
        let base = snapshot.as_ref().map(|s| s.event_id);
        let mut events = self
            .store
            .stream_events(tx, stream_id, base)
            .await
            .map_err(|e| (failures, e.to_string()))?;
        // Events an operator skipped for this pair stay skipped in a replay too.
        let skipped = self
            .store
            .skipped_events(tx, stream_id, name)
            .await
            .map_err(|e| (failures, e.to_string()))?;
        if !skipped.is_empty() {
            events.retain(|e| !skipped.iter().any(|s| s.event_id == e.event_id));
        }
        let (state, base_count) = match snapshot {
            Some(s) => (Some(s.state), s.applied_count),
            None => (None, 0),
        };
        Ok(Some(Loaded {
            cursor_failures: failures,
            revision: cursor.revision,
            trigger: rewind.trigger,
            base,
            base_count,
            state,
            events,
        }))
    }

    /// Stores a pair's failure on its cursor, with its backoff (`retry_at`: every instance
    /// waits it out) and, after `park_after_failures` in a row, parked.
    async fn fail(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        failures_before: u32,
        error: &str,
    ) -> Result<PairOutcome> {
        let failures = failures_before.saturating_add(1);
        let failure = PairFailure::new(error)
            .retry_after(self.options.backoff(failures))
            .park(self.options.parks_after(failures));
        let tx = self.source.begin().await?;
        let parked = self
            .store
            .record_failure(&tx, stream_id, name, &failure)
            .await?;
        tx.commit().await?;
        if parked {
            count(telemetry::PAIRS_PARKED, name.as_str(), 1);
        }
        Ok(PairOutcome::Failed {
            error: error.to_owned(),
        })
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
            .request_rewind(&tx, stream_id, name, from)
            .await?;
        tx.commit().await?;
        Ok(requested)
    }

    /// Purges a pair under a `purge` lease (the seed's reserved reason): its state, snapshots
    /// and pending work are deleted and its cursor reset (see
    /// [`PerspectiveStore::purge`]). Without a locker it runs unlocked.
    pub async fn purge(&self, stream_id: StreamId, name: &PerspectiveName) -> Result<PurgeOutcome> {
        let span = tracing::info_span!("purge", stream_id = %stream_id, perspective = %name, reason = "purge");
        async move {
            let _pair = self.coordinator.lock(stream_id, name).await;
            let lease = match &self.keeper {
                Some(keeper) => match keeper
                    .try_acquire(stream_id, name, &LockReason::Purge)
                    .await?
                {
                    Leased::Acquired(lease) => Some(lease),
                    Leased::Denied(holder) => return Ok(PurgeOutcome::Denied(holder)),
                    Leased::Busy => return Ok(PurgeOutcome::Busy),
                    Leased::NoCursor => return Ok(PurgeOutcome::NoCursor),
                },
                None => None,
            };
            let fence: Option<LeaseId> = lease.as_ref().map(|l| l.id().clone());
            let purged: Result<bool> = async {
                let tx = self.source.begin().await?;
                let exists = self.store.cursor(&tx, stream_id, name).await?.is_some();
                if exists {
                    self.store
                        .purge(&tx, stream_id, name, fence.as_ref())
                        .await?;
                }
                tx.commit().await?;
                Ok(exists)
            }
            .await;
            if let Some(lease) = lease {
                release(lease).await;
            }
            Ok(if purged? {
                PurgeOutcome::Purged
            } else {
                PurgeOutcome::NoCursor
            })
        }
        .instrument(span)
        .await
    }
}

/// What the normal path found.
enum Normal {
    Done(PairOutcome),
    NeedsRewind,
}

/// How a rewind ended (its failures aside).
enum Rewind {
    /// Replayed and committed.
    Committed {
        replayed: usize,
        from_snapshot: bool,
    },
    /// No request any more (someone else finished it) or no cursor.
    NothingToDo,
    /// The commit lost the compare-and-set: another applier moved the cursor first.
    LostRace,
}

/// What a rewind restores and replays.
struct Loaded {
    cursor_failures: u32,
    revision: i64,
    trigger: Uuid,
    /// The snapshot's event id, when restoring one.
    base: Option<Uuid>,
    base_count: u64,
    state: Option<serde_json::Value>,
    events: Vec<RecordedEvent>,
}

fn lease_lost() -> String {
    Error::new(
        ErrorKind::LeaseLost,
        "the rewind lease was lost; the rewind was abandoned and nothing was committed",
    )
    .to_string()
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
    mut state: serde_json::Value,
    events: Vec<RecordedEvent>,
    stop: &CancellationToken,
) -> Result<Applied> {
    let p = Arc::clone(p);
    let abandon = stop.child_token();
    let _abandon_when_dropped = abandon.clone().drop_guard();
    let task = tokio::task::spawn_blocking(move || {
        let outcome = apply_guarded(&*p, &mut state, &events, &|| !abandon.is_cancelled());
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
        Err(panic) => {
            let detail = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            Err(ApplyError::Panicked {
                event_id: None,
                detail,
            })
        }
    }
}
