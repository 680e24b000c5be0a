//! The normal path in batches: one claim statement hands out up to `pairs_per_cycle` pairs of
//! this worker's perspectives with their states and events ([`lockstep_core::WorkQueue::claim_batch`]);
//! `apply` folds them on tokio's blocking pool; one statement commits every pair that
//! progressed and stores every failure ([`lockstep_core::WorkQueue::commit_batch`]); then the pairs the
//! claim marked for a rewind go down the rewind path. A pair's first snapshot is written by the
//! batch commit itself (the bootstrap, fenced by the row lock the claim holds rather
//! than by a lease of its own: no extra round trips per new pair; ADR 0012).
//!
//! - **A failure is the pair's**: `apply` failing or panicking at an event, a state that does
//!   not serialize or cannot be stored — the events before the failing one are committed, the
//!   failure is stored on the cursor with its backoff (`retry_at`, so every instance waits it
//!   out) and, after `park_after_failures` in a row, parks the pair. The other pairs of the
//!   batch commit.
//! - **A batch that fails as a whole** (its commit fails after the claim: the server's
//!   `idle_in_transaction_session_timeout`, a lost connection) rolls back, and the next batches
//!   are half the size, down to one pair with one event; successes grow them back. Only a
//!   batch of that smallest size stores the failure on its pair: a batch too large for the
//!   server's timeout is the batch's fault, not its pairs'.
//! - **Rotation**: each perspective's walk continues where the last claim stopped, and the
//!   perspectives take turns leading the batch, so every pair with work is reached and no
//!   backlog of one perspective holds the others back.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use lockstep_core::{
    ApplyError, BatchClaim, BatchCommitted, BatchEntry, BatchLimits, ClaimedPair, ClaimedWork,
    Cursor, DynPerspective, DynTablePerspective, ErrorKind, Pair, PairFailure, PerspectiveStore,
    RecordedEvent, Result, StateCommit, Transaction, TransactionSource,
};
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;

use super::{CycleReport, FailedPair, Kind, PerspectiveWorker, Probe, apply_guarded, probe};
use crate::coordinator::PairGuard;
use crate::error::{CycleError, PairError};
use crate::telemetry::{self, StoreClock, count, observe};

/// The deepest the batch shrinks: every limit halved this many times is 1.
const MAX_SHRINK: u32 = 20;

/// How long a pair of a batch that failed as a whole keeps the limits from growing back without
/// being seen again (in a batch that commits or fails): long enough for a walk of the queue to
/// come back to it, so that other pairs' successes cannot undo the shrink its own batch needs.
pub(super) const SUSPECT_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// How folding one pair's events ended.
enum Folded {
    /// Every event applied: the new state.
    All(serde_json::Value),
    /// Applying failed at the error's event (or outside any one event); `prefix` is the fold
    /// of the events before it, when there were some.
    Failed {
        prefix: Option<(serde_json::Value, usize)>,
        error: PairError,
    },
    /// Stopped before the end: the batch was abandoned (shutdown past its grace).
    Stopped,
}

/// A claimed pair of a table perspective: applied in the batch's transaction ([`super::table`]).
struct TableWork<Tx> {
    cursor: Cursor,
    events: Vec<RecordedEvent>,
    perspective: Arc<dyn DynTablePerspective<Tx>>,
    /// The pair's in-process apply lock, held until the batch's transaction has ended.
    guard: PairGuard,
    /// As [`Work::unreadable`].
    unreadable: Option<PairError>,
}

/// A claimed pair on its way through the batch.
struct Work {
    cursor: Cursor,
    events: Vec<RecordedEvent>,
    perspective: Arc<dyn DynPerspective>,
    state: Option<serde_json::Value>,
    /// The pair's in-process apply lock, held until the batch's transaction has ended.
    guard: Option<PairGuard>,
    /// The event after `events` that could not be read ([`ClaimedWork::Unreadable`],
    /// [`PairErrorKind::UnreadableEvent`](crate::PairErrorKind::UnreadableEvent)): the pair
    /// fails at it once `events` are folded.
    unreadable: Option<PairError>,
}

impl<S, P> PerspectiveWorker<S, P>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    /// The limits of the next batch: the configured ones, halved per failed batch since the
    /// last success.
    pub(super) fn current_limits(&self) -> BatchLimits {
        let configured = self.options.batch_limits();
        let shift = self.shrink.load(Ordering::Relaxed).min(MAX_SHRINK);
        if shift == 0 {
            return configured;
        }
        let mut limits = configured;
        limits.pairs = (configured.pairs >> shift).max(1);
        limits.events_per_pair = (configured.events_per_pair >> shift).max(1);
        limits.events = (configured.events >> shift).max(1);
        limits.bytes = (configured.bytes >> shift).max(1);
        limits
    }

    /// The next claim's request: the perspectives in turn, each from where its walk stopped,
    /// of those `wanted` says.
    fn next_request(&self, wanted: &dyn Fn(&lockstep_core::PerspectiveName) -> bool) -> BatchClaim {
        let mut positions = self
            .positions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let request_positions = positions
            .iter()
            .filter(|(name, _)| wanted(name))
            .cloned()
            .collect();
        // The next claim is led by the next perspective.
        let lead = 1.min(positions.len());
        positions.rotate_left(lead);
        let mut request = BatchClaim::new(&[]);
        request.positions = request_positions;
        request.debounce = self.options.debounce();
        request.limits = self.current_limits();
        request
    }

    /// The claims of the next batch, in turn: the versions that serve (or stopped) and the
    /// versions being built beside them, alternately first, so that a serving version's pairs
    /// are never held in a batch behind a build's backlog (another instance serves them
    /// meanwhile) and a build is never starved by a steady trickle of new events. Without a
    /// build: one claim of every perspective.
    fn next_requests(&self) -> (BatchClaim, Option<BatchClaim>) {
        let building = self
            .building
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let all = self.registry.names();
        if building.is_empty() || all.iter().all(|n| building.contains(n)) {
            return (self.next_request(&|_| true), None);
        }
        let serving = self.next_request(&|n| !building.contains(n));
        let built = self.next_request(&|n| building.contains(n));
        if self.build_first.fetch_xor(true, Ordering::Relaxed) {
            (built, Some(serving))
        } else {
            (serving, Some(built))
        }
    }

    fn remember_positions(
        &self,
        reached: Vec<(
            lockstep_core::PerspectiveName,
            Option<lockstep_core::StreamId>,
        )>,
    ) {
        let mut positions = self
            .positions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (name, at) in reached {
            if let Some(slot) = positions.iter_mut().find(|(n, _)| *n == name) {
                slot.1 = at;
            }
        }
    }

    /// Claims, applies and commits one batch, then runs its rewinds; adds what
    /// it did to `report`. `Err`: the claim itself failed (nothing was claimed).
    pub(super) async fn run_batch(&self, report: &mut CycleReport) -> Result<()> {
        let (mut request, then) = self.next_requests();
        let limits = request.limits;
        // A `?` drops the guard, which rolls back: nothing claimed stays claimed.
        let tx = self.source.begin().await?;
        let mut batch = self.store.claim_batch(&tx, &request).await?;
        if batch.pairs.is_empty()
            && let Some(then) = then
        {
            self.remember_positions(std::mem::take(&mut batch.positions));
            request = then;
            batch = self.store.claim_batch(&tx, &request).await?;
        }
        let clock = StoreClock::new(batch.claimed_at);
        self.remember_positions(batch.positions);
        if batch.pairs.is_empty() {
            // Committed, not rolled back: a late arrival inside the debounce window was
            // written by the claim, and the window only runs once it is stored.
            tx.commit().await?;
            return Ok(());
        }
        if let Some((first, _)) = request.positions.first() {
            observe(
                telemetry::BATCH_PAIRS,
                first.as_str(),
                batch.pairs.len() as f64,
            );
        }
        let (work, tables, rewinds) = self.sort_claimed(batch.pairs, report);
        let claimed: Vec<Pair> = work
            .iter()
            .map(|w| w.cursor.pair.clone())
            .chain(tables.iter().map(|t| t.cursor.pair.clone()))
            .collect();
        let mut folded = fold_off_runtime(work).await;
        // Kept until the commit has ended, so that no other path of this instance starts on a
        // pair of the batch before its state is stored.
        let mut guards: Vec<PairGuard> = folded
            .iter_mut()
            .filter_map(|(w, _)| w.guard.take())
            .collect();
        let (mut entries, mut applied) = self.entries(folded, report);
        // Table pairs write the application's rows in this very transaction.
        for table in tables {
            guards.push(table.guard);
            let outcome =
                super::table::apply_in(&*table.perspective, &tx, &table.events, &|| true).await;
            if let Some(error) = outcome.error {
                // Its statement may have aborted the transaction: nothing of the batch is
                // committed (the other pairs' work stays queued and is claimed again from
                // where this claim started), and the failing pair is processed alone, which
                // commits the events before the failure and stores it. A rollback that fails
                // ends the transaction all the same.
                super::rollback(tx, "a batch a table perspective failed in").await;
                drop(guards);
                self.remember_positions(request.positions.clone());
                let pair = table.cursor.pair.clone();
                count(telemetry::PAIRS_RETRIED, pair.perspective.as_str(), 1);
                tracing::warn!(pair = %pair, error = %error, "a table perspective failed in a batch; the batch rolled back and the pair is processed alone");
                let others = claimed.iter().filter(|p| **p != pair).count();
                report.pairs += others;
                report.skipped += others;
                let outcome = self.process_pair(pair.stream_id, &pair.perspective).await;
                report.add(&pair, outcome);
                return Ok(());
            }
            // An unreadable event after the applied ones fails the pair at it, with them.
            let committed = !table.events.is_empty();
            let failure = table
                .unreadable
                .as_ref()
                .map(|error| self.pair_failure(&table.cursor, committed, error));
            applied.push(Applied {
                failure: table.unreadable,
                from_apply: failure.is_none(),
                events: table.events.len(),
                oldest: table.events.iter().map(|e| e.recorded_at).min(),
                first_snapshot: false,
            });
            entries.push(BatchEntry::new(
                table.cursor.pair.clone(),
                committed.then(|| super::table::table_commit(&table.cursor, &table.events)),
                failure,
            ));
        }
        let committed = async {
            let outcomes = self.store.commit_batch(&tx, &entries).await?;
            tx.commit().await?;
            Ok::<_, lockstep_core::Error>(outcomes)
        }
        .await;
        drop(guards);
        let outcomes = match committed {
            Ok(outcomes) => outcomes,
            Err(err) => {
                self.batch_failed(&claimed, limits, &err, report).await;
                return Ok(());
            }
        };
        self.batch_committed(&claimed);
        for ((entry, outcome), applied) in entries.iter().zip(outcomes).zip(applied) {
            self.report_entry(entry, outcome, applied, &clock, report)
                .await;
        }
        for cursor in rewinds {
            match self
                .rewind(cursor.pair.stream_id, &cursor.pair.perspective)
                .await
            {
                Ok(outcome) => report.add(&cursor.pair.clone(), Ok(outcome)),
                Err(err) => report.add(&cursor.pair.clone(), Err(err)),
            }
        }
        Ok(())
    }

    /// Splits a claimed batch into the pairs to fold (with their in-process apply locks) and the
    /// pairs that need a rewind. A pair another task of this instance is working on is left to
    /// it (skipped, untouched).
    #[allow(clippy::type_complexity)]
    fn sort_claimed(
        &self,
        pairs: Vec<ClaimedPair>,
        report: &mut CycleReport,
    ) -> (Vec<Work>, Vec<TableWork<S::Tx>>, Vec<Cursor>) {
        let mut work = Vec::with_capacity(pairs.len());
        let mut tables = Vec::new();
        let mut rewinds = Vec::new();
        for claimed in pairs {
            let cursor = claimed.cursor;
            let (state, events, unreadable) = match claimed.work {
                ClaimedWork::Apply { state, events } => (state, events, None),
                ClaimedWork::Unreadable {
                    state,
                    events,
                    event_id,
                    error,
                } => (state, events, Some(PairError::unreadable(event_id, error))),
                ClaimedWork::Rewind => {
                    rewinds.push(cursor);
                    continue;
                }
                _ => {
                    report.skipped += 1;
                    continue;
                }
            };
            // Only this worker's perspectives are asked for.
            let Some(kind) = self.kind(&cursor.pair.perspective) else {
                report.pairs += 1;
                report.skipped += 1;
                continue;
            };
            let Some(guard) = self
                .coordinator
                .try_lock(cursor.pair.stream_id, &cursor.pair.perspective)
            else {
                report.pairs += 1;
                report.skipped += 1;
                continue;
            };
            match kind {
                Kind::Json(perspective) => work.push(Work {
                    cursor,
                    events,
                    perspective,
                    state,
                    guard: Some(guard),
                    unreadable,
                }),
                Kind::Table(perspective) => tables.push(TableWork {
                    cursor,
                    events,
                    perspective,
                    guard,
                    unreadable,
                }),
            }
        }
        (work, tables, rewinds)
    }

    /// The commit entries of a folded batch, and per entry the events it commits (for the
    /// report and the metrics, in the same order).
    fn entries(
        &self,
        folded: Vec<(Work, Folded)>,
        report: &mut CycleReport,
    ) -> (Vec<BatchEntry>, Vec<Applied>) {
        let mut entries = Vec::with_capacity(folded.len());
        let mut applied = Vec::with_capacity(folded.len());
        for (work, folded) in folded {
            let cursor = &work.cursor;
            let (commit_of, failure) = match folded {
                Folded::All(state) => (Some((state, work.events.len())), None),
                Folded::Failed { prefix, error } => {
                    (prefix, Some((error, work.unreadable.is_none())))
                }
                Folded::Stopped => {
                    report.pairs += 1;
                    report.skipped += 1;
                    continue;
                }
            };
            // A state the store would refuse fails the pair here, so that it cannot fail the
            // whole batch's commit.
            let (commit_of, failure) = match commit_of {
                Some((state, n)) => {
                    match lockstep_core::json::check_storable(&state, "perspective state") {
                        Ok(()) => (Some((state, n)), failure),
                        Err(err) => (
                            None,
                            Some((
                                PairError::unstorable_state(&err)
                                    .at(work.events.get(n.saturating_sub(1)).map(|e| e.event_id)),
                                false,
                            )),
                        ),
                    }
                }
                None => (None, failure),
            };
            let n = commit_of.as_ref().map_or(0, |(_, n)| *n);
            let commit =
                commit_of.map(|(state, n)| self.state_commit(cursor, state, &work.events[..n]));
            let from_apply = failure.as_ref().is_some_and(|f| f.1);
            let error = failure.map(|(error, _)| error);
            let failure = error
                .as_ref()
                .map(|error| self.pair_failure(cursor, commit.is_some(), error));
            applied.push(Applied {
                failure: error,
                from_apply,
                events: n,
                oldest: work.events[..n].iter().map(|e| e.recorded_at).min(),
                first_snapshot: cursor.latest_snapshot.is_none() && commit.is_some(),
            });
            entries.push(BatchEntry::new(cursor.pair.clone(), commit, failure));
        }
        (entries, applied)
    }

    /// A pair's failure as stored (its text, at its event), backed off and parked by its
    /// count: a commit in the same entry (`committed`) clears the count — the pair made
    /// progress, and this is its first failure at the new position.
    pub(super) fn pair_failure(
        &self,
        cursor: &Cursor,
        committed: bool,
        error: &PairError,
    ) -> PairFailure {
        let failures = if committed {
            1
        } else {
            cursor.failures.saturating_add(1)
        };
        PairFailure::new(error.to_string())
            .at_event(error.event_id())
            .retry_after(self.options.backoff(failures))
            .park(self.options.parks_after(failures))
    }

    fn state_commit(
        &self,
        cursor: &Cursor,
        state: serde_json::Value,
        events: &[RecordedEvent],
    ) -> StateCommit {
        let applied_count = cursor.applied_count + events.len() as u64;
        let every = self.options.snapshot_every;
        let mut commit = StateCommit::new(cursor.pair.clone(), cursor.revision, state);
        commit.last_event_id = events.last().map(|e| e.event_id).or(cursor.last_event_id);
        commit.applied_count = applied_count;
        commit.applied_events = events.iter().map(|e| e.event_id).collect();
        // Each time the count crosses a multiple of `snapshot_every`, and the pair's first
        // (the bootstrap: under the claim's row lock, which fences it like the lease would).
        commit.snapshot = applied_count / every > cursor.applied_count / every
            || cursor.latest_snapshot.is_none();
        commit
    }

    /// Reports one committed entry and counts it (its lag on `clock`, the store's).
    async fn report_entry(
        &self,
        entry: &BatchEntry,
        outcome: BatchCommitted,
        applied: Applied,
        clock: &StoreClock,
        report: &mut CycleReport,
    ) {
        let pair = &entry.pair;
        let name = pair.perspective.as_str();
        report.pairs += 1;
        let parked = match outcome {
            BatchCommitted::Committed { parked, .. } => {
                report.add_applied(&pair.perspective, applied.events);
                count(telemetry::EVENTS_APPLIED, name, applied.events as u64);
                if applied.first_snapshot {
                    count(telemetry::BOOTSTRAPS, name, 1);
                }
                if let Some(oldest) = applied.oldest {
                    observe(telemetry::LAG_SECONDS, name, clock.age_seconds(oldest));
                }
                parked
            }
            BatchCommitted::FailureRecorded { parked } => parked,
            // Another applier moved the cursor first: nothing lost, looked at again later.
            _ => {
                report.skipped += 1;
                return;
            }
        };
        if let Some(error) = applied.failure {
            report.failed += 1;
            let metric = if applied.from_apply {
                telemetry::APPLY_FAILURES
            } else {
                telemetry::PAIR_FAILURES
            };
            count(metric, name, 1);
            tracing::warn!(pair = %pair, error = %error, kind = %error.kind(), parked, "a pair failed; stored on its cursor");
            report.failures.push(FailedPair::new(pair.clone(), error));
            if parked {
                count(telemetry::PAIRS_PARKED, name, 1);
            }
        }
    }

    /// A batch committed: its pairs are no longer suspects, and the limits grow back one step
    /// once no suspect is left. While a pair of a failed batch has not committed again, other
    /// pairs' successes do not undo the shrink: otherwise, under steady traffic, a pair whose
    /// batch fails once per walk of the queue would never reach the smallest batch, where its
    /// failure is its own — never charged, its neighbours' work rolled back with it each time.
    fn batch_committed(&self, claimed: &[Pair]) {
        let none_left = {
            let mut suspects = self
                .suspects
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for pair in claimed {
                suspects.remove(pair);
            }
            suspects.retain(|_, since| since.elapsed() < SUSPECT_FOR);
            suspects.is_empty()
        };
        if none_left {
            let _ = self
                .shrink
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| s.checked_sub(1));
        }
    }

    /// A batch whose commit failed after its claim: the next ones are smaller, and its pairs
    /// are suspects until they commit again; at the smallest size the failure is its pair's
    /// (stored, backed off, parked in the end).
    async fn batch_failed(
        &self,
        claimed: &[Pair],
        limits: BatchLimits,
        err: &lockstep_core::Error,
        report: &mut CycleReport,
    ) {
        let first = claimed.first().map_or("", |p| p.perspective.as_str());
        count(telemetry::BATCH_FAILURES, first, 1);
        let smallest = limits.pairs == 1 && limits.events_per_pair == 1;
        let _ = self
            .shrink
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                Some((s + 1).min(MAX_SHRINK))
            });
        tracing::warn!(error = %err, pairs = claimed.len(), smallest, "a batch failed after its claim; the next batches are smaller");
        {
            let mut suspects = self
                .suspects
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let now = std::time::Instant::now();
            for pair in claimed {
                if smallest || err.kind() == ErrorKind::Conflict {
                    // Charged below, or nobody's fault (another applier got there first).
                    suspects.remove(pair);
                } else {
                    suspects.insert(pair.clone(), now);
                }
            }
        }
        if !smallest || err.kind() == ErrorKind::Conflict {
            report
                .errors
                .push(CycleError::batch_failed(claimed.len(), err));
            return;
        }
        for pair in claimed {
            let failures = self
                .cursor_failures(pair)
                .await
                .unwrap_or(0)
                .saturating_add(1);
            count(telemetry::PAIR_FAILURES, pair.perspective.as_str(), 1);
            match self
                .fail(
                    pair.stream_id,
                    &pair.perspective,
                    failures - 1,
                    PairError::store(err),
                )
                .await
            {
                Ok(outcome) => report.add(pair, Ok(outcome)),
                Err(store_err) => report.add(pair, Err(store_err)),
            }
        }
    }

    pub(super) async fn cursor_failures(&self, pair: &Pair) -> Result<u32> {
        let tx = self.source.begin().await?;
        let cursor = self.store.cursor(&tx, pair).await;
        // Read only: a rollback that fails still ends it.
        super::rollback(tx, "reading a cursor's failures").await;
        Ok(cursor?.map_or(0, |c| c.failures))
    }
}

/// What one entry commits, for the report and the metrics.
struct Applied {
    /// The entry's failure (its [`BatchEntry::failure`] is what is stored of it).
    failure: Option<PairError>,
    /// The entry's failure came from `apply` (else: from storing its state).
    from_apply: bool,
    events: usize,
    oldest: Option<OffsetDateTime>,
    /// The commit writes the pair's first snapshot (counted as a bootstrap).
    first_snapshot: bool,
}

/// Folds every pair of a batch on one blocking task of tokio's pool, so that the user's
/// synchronous `apply` never holds up the runtime's threads. Dropped (shutdown past its grace)
/// it stops within one event.
async fn fold_off_runtime(work: Vec<Work>) -> Vec<(Work, Folded)> {
    let abandon = CancellationToken::new();
    let _abandon_when_dropped = abandon.clone().drop_guard();
    let task = tokio::task::spawn_blocking(move || {
        let go_on = || !abandon.is_cancelled();
        work.into_iter()
            .map(|mut w| {
                let folded = fold(&*w.perspective, w.state.take(), &w.events, &go_on);
                // The events before an unreadable one folded: the pair fails at it with them.
                let folded = match (folded, &w.unreadable) {
                    (Folded::All(state), Some(error)) => Folded::Failed {
                        prefix: (!w.events.is_empty()).then_some((state, w.events.len())),
                        error: error.clone(),
                    },
                    (folded, _) => folded,
                };
                (w, folded)
            })
            .collect::<Vec<_>>()
    });
    match task.await {
        Ok(folded) => folded,
        // The runtime is shutting down (or the task panicked outside the guarded `apply`):
        // nothing of the batch is committed; the pairs are looked at again later.
        Err(err) => {
            tracing::warn!(error = %err, "the task folding a batch ended without an answer");
            Vec::new()
        }
    }
}

/// Folds one pair's events into its state; on a failure, also the fold of the events before
/// the failing one (committed, so that a poison event costs only itself).
fn fold(
    p: &dyn DynPerspective,
    state: Option<serde_json::Value>,
    events: &[RecordedEvent],
    go_on: &dyn Fn() -> bool,
) -> Folded {
    let mut state = match state {
        Some(state) => state,
        None => match p.initial_state() {
            Ok(state) => state,
            Err(err) => {
                return Folded::Failed {
                    prefix: None,
                    error: PairError::state(&err).at(events.first().map(|e| e.event_id)),
                };
            }
        },
    };
    // On failure `state` is left as it was (the `apply_while` contract).
    let err = match apply_guarded(p, &mut state, events, go_on) {
        Ok(n) if n == events.len() => return Folded::All(state),
        Ok(_) => return Folded::Stopped,
        Err(err) => err,
    };
    let at = match &err {
        ApplyError::Apply { event_id, .. }
        | ApplyError::Panicked {
            event_id: Some(event_id),
            ..
        } => events.iter().position(|e| e.event_id == *event_id),
        // Where a panic happened is not known: find it one event at a time.
        ApplyError::Panicked { event_id: None, .. } => {
            return match probe(p, state.clone(), events, go_on) {
                Probe::Failed(i, before) => Folded::Failed {
                    prefix: (i > 0).then_some((before, i)),
                    error: PairError::perspective(err).at(Some(events[i].event_id)),
                },
                // It did not happen again: the one-at-a-time fold is the whole fold.
                Probe::Clean(all) => Folded::All(all),
                Probe::Stopped => Folded::Stopped,
            };
        }
        // The stored state does not decode: no event is to blame.
        _ => None,
    };
    let Some(at) = at else {
        return Folded::Failed {
            prefix: None,
            error: PairError::perspective(err).at(None),
        };
    };
    let prefix = if at == 0 {
        None
    } else {
        match apply_guarded(p, &mut state, &events[..at], go_on) {
            Ok(n) if n == at => Some((state, at)),
            // Not deterministic, or abandoned: commit nothing, store the failure.
            _ => None,
        }
    };
    Folded::Failed {
        prefix,
        error: PairError::perspective(err).at(Some(events[at].event_id)),
    }
}
