//! One pair now ([`PerspectiveWorker::process_pair`]): the one-pair claim of the normal path,
//! handing over to the rewind path when the pair needs one. The cycles use the batch path
//! ([`super::batch`]); this is the explicit "process this pair now" of an operator or a test,
//! which does not wait for the pair's backoff nor for its parking.
use lockstep_core::{Pair, Release};
use std::sync::Arc;

use lockstep_core::{
    BatchCommitted, BatchEntry, Claim, DynPerspective, ErrorKind, PerspectiveName,
    PerspectiveStore, RecordedEvent, Result, StateCommit, StreamId, Transaction, TransactionSource,
};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{Kind, PairOutcome, PerspectiveWorker, SkipReason, apply_off_runtime};
use crate::error::PairError;
use crate::telemetry::{self, StoreClock, count, observe};

impl<S, P> PerspectiveWorker<S, P>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
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
            let Some(p) = self.kind(perspective) else {
                return Ok(PairOutcome::Skipped(SkipReason::UnknownPerspective));
            };
            let _pair = self.coordinator.lock(stream_id, perspective).await;
            let normal = match &p {
                Kind::Json(json) => self.apply_pending(stream_id, perspective, json).await?,
                Kind::Table(table) => self.table_pending(stream_id, perspective, table).await?,
            };
            match normal {
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
        let claimed = match self.claim_one(tx, stream_id, name).await? {
            Ok(claimed) => claimed,
            Err(normal) => return Ok(normal),
        };
        let cursor = claimed.cursor;
        // From here on whatever fails is the pair's: a state that does not serialize, a commit
        // the server refuses, a lost commit — stored on its cursor and backed off like a failing
        // `apply`, not a cycle error retried at full size every cycle. Only when even storing
        // the failure fails is it the cycle's (the database itself is unavailable): that error
        // is returned.
        let failures = cursor.failures;
        let fold = Fold {
            state: claimed.state,
            events: claimed.events,
            unreadable: claimed.unreadable,
        };
        match self
            .apply_claimed(claimed.tx, stream_id, name, p, cursor, fold, &claimed.clock)
            .await
        {
            Ok(normal) => Ok(normal),
            Err(err) => {
                count(telemetry::PAIR_FAILURES, name.as_str(), 1);
                tracing::warn!(error = %err, kind = %err.kind(), "processing the pair failed; stored on its cursor");
                self.fail(stream_id, name, failures, err)
                    .await
                    .map(Normal::Done)
            }
        }
    }

    /// The normal path after a claim returned events: fold them and commit (with the failure
    /// at an unreadable event after them, if the claim stopped at one). An `Err` is a failure
    /// of the pair outside `apply` (the caller stores it); the transaction is ended on every
    /// path.
    #[allow(clippy::too_many_arguments)]
    async fn apply_claimed(
        &self,
        tx: S::Tx,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Arc<dyn DynPerspective>,
        cursor: lockstep_core::Cursor,
        fold: Fold,
        clock: &StoreClock,
    ) -> std::result::Result<Normal, PairError> {
        let Fold {
            state,
            events,
            unreadable,
        } = fold;
        // Every early return below drops the open guard, which rolls the transaction back.
        let state = match state {
            Some(state) => state,
            None => p.initial_state().map_err(|e| PairError::state(&e))?,
        };
        // Off the runtime's threads; a dropped pair (shutdown past its grace) stops it.
        let applied = apply_off_runtime(p, state, events, &CancellationToken::new())
            .await
            .map_err(|e| PairError::store(&e))?;
        let (state, events) = (applied.state, applied.events);
        if let Err(err) = applied.outcome {
            // Ended before the failure is stored on the same cursor row (by `fail`, in a
            // transaction of its own), so that one does not wait for this one's row lock.
            // Nothing was written in it: a rollback that fails still ends it.
            super::rollback(tx, "a pair whose apply failed").await;
            count(telemetry::APPLY_FAILURES, name.as_str(), 1);
            // The event it failed at: named by the error, or for a panic found by applying
            // the events again one at a time (a failed apply left `state` as it was before
            // them).
            let at = super::failed_at(p, state, events, &err, &CancellationToken::new()).await;
            return self
                .fail(
                    stream_id,
                    name,
                    cursor.failures,
                    PairError::perspective(err).at(at),
                )
                .await
                .map(Normal::Done)
                .map_err(|e| PairError::store(&e));
        }
        let applied_count = cursor.applied_count + events.len() as u64;
        let every = self.options.snapshot_every;
        let snapshot = applied_count / every > cursor.applied_count / every;
        let oldest = events.iter().map(|e| e.recorded_at).min();
        let mut commit =
            StateCommit::new(Pair::new(stream_id, name.clone()), cursor.revision, state);
        commit.last_event_id = events.last().map(|e| e.event_id).or(cursor.last_event_id);
        commit.applied_count = applied_count;
        commit.applied_events = events.iter().map(|e| e.event_id).collect();
        commit.snapshot = snapshot;
        if let Some(error) = unreadable {
            // The events before it with the failure at it, as a batch does (the pair's first
            // snapshot with them, fenced by the claim's row lock).
            commit.snapshot |= cursor.latest_snapshot.is_none();
            let commit = (!events.is_empty()).then_some(commit);
            return self
                .commit_failing(tx, &cursor, commit, error, oldest, clock)
                .await
                .map(Normal::Done);
        }
        // The state change and the transaction's commit as one (a refusal commits nothing).
        let revision = match self.store.commit(tx, &commit, Release::Keep).await {
            Ok(committed) => committed.revision,
            // Another applier moved the cursor first: nothing lost, look again later.
            Err(err) if err.kind() == ErrorKind::Conflict => {
                return Ok(Normal::Done(PairOutcome::Skipped(SkipReason::Busy)));
            }
            Err(err) => return Err(PairError::store(&err)),
        };
        count(
            telemetry::EVENTS_APPLIED,
            name.as_str(),
            events.len() as u64,
        );
        if let Some(oldest) = oldest {
            observe(
                telemetry::LAG_SECONDS,
                name.as_str(),
                clock.age_seconds(oldest),
            );
        }
        let needs_bootstrap = cursor.latest_snapshot.is_none() && !snapshot && applied_count > 0;
        if needs_bootstrap && let Err(err) = self.bootstrap(stream_id, name, revision).await {
            tracing::warn!(error = %err, "bootstrap failed; retried after the next apply");
        }
        Ok(Normal::Done(PairOutcome::Applied {
            events: events.len(),
        }))
    }
}

/// What a one-pair claim handed out: the still open transaction with the cursor, state and
/// events to apply, or how the normal path ends without applying (the claim's transaction
/// then already ended).
pub(super) type Claimed<Tx> = std::result::Result<ClaimedOne<Tx>, Normal>;

/// A pair claimed alone, its transaction still open.
pub(super) struct ClaimedOne<Tx> {
    pub(super) tx: Tx,
    pub(super) cursor: lockstep_core::Cursor,
    pub(super) state: Option<serde_json::Value>,
    /// The events to apply, in event-id order.
    pub(super) events: Vec<RecordedEvent>,
    /// The event after `events` that could not be read ([`Claim::Unreadable`]): the pair fails
    /// at it once `events` are applied.
    pub(super) unreadable: Option<PairError>,
    pub(super) clock: StoreClock,
}

/// What the normal path folds: the state, the events, and the unreadable event after them.
struct Fold {
    state: Option<serde_json::Value>,
    events: Vec<RecordedEvent>,
    unreadable: Option<PairError>,
}

impl<S, P> PerspectiveWorker<S, P>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    /// Claims the pair in `tx` (at most `max_events_per_claim` events). With events, `tx` stays
    /// open for the caller; otherwise it is ended here as the outcome needs (committed to keep
    /// a rewind request or a debounced late arrival the claim wrote, rolled back when busy).
    pub(super) async fn claim_one(
        &self,
        tx: S::Tx,
        stream_id: StreamId,
        name: &PerspectiveName,
    ) -> Result<Claimed<S::Tx>> {
        let claim = self
            .store
            .claim(
                &tx,
                &Pair::new(stream_id, name.clone()),
                self.options.max_events_per_claim,
                self.options.debounce(),
            )
            .await?;
        let normal = match claim {
            Claim::Apply {
                cursor,
                state,
                events,
                claimed_at,
            } => {
                return Ok(Ok(ClaimedOne {
                    tx,
                    cursor,
                    state,
                    events,
                    unreadable: None,
                    clock: StoreClock::new(claimed_at),
                }));
            }
            Claim::Unreadable {
                cursor,
                state,
                events,
                event_id,
                error,
            } => {
                return Ok(Ok(ClaimedOne {
                    tx,
                    cursor,
                    state,
                    events,
                    unreadable: Some(PairError::unreadable(event_id, error)),
                    clock: StoreClock::new(None),
                }));
            }
            Claim::Rewind { .. } => {
                // Keep a rewind request the claim may have just written.
                tx.commit().await?;
                Normal::NeedsRewind
            }
            Claim::Busy => {
                tx.rollback().await?;
                Normal::Done(PairOutcome::Skipped(SkipReason::Busy))
            }
            _ => {
                // Committed, not rolled back: a late arrival inside the debounce window is
                // written by this claim, and the window only runs once it is stored (rolled
                // back, every cycle found it anew and the pair never moved).
                tx.commit().await?;
                Normal::Done(PairOutcome::Skipped(SkipReason::Idle))
            }
        };
        Ok(Err(normal))
    }

    /// Commits, in the claim's transaction `tx`, the state change of the events before an
    /// unreadable one (`None`: there were none) with the pair's failure at it: one entry of a
    /// batch commit, as the batch path stores it. The failure is the pair's outcome. `Err`:
    /// the store failed (nothing was committed).
    pub(super) async fn commit_failing(
        &self,
        tx: S::Tx,
        cursor: &lockstep_core::Cursor,
        commit: Option<StateCommit>,
        error: PairError,
        oldest: Option<time::OffsetDateTime>,
        clock: &StoreClock,
    ) -> std::result::Result<PairOutcome, PairError> {
        let name = cursor.pair.perspective.as_str();
        let events = commit.as_ref().map_or(0, |c| c.applied_events.len());
        let failure = self.pair_failure(cursor, commit.is_some(), &error);
        let entry = BatchEntry::new(cursor.pair.clone(), commit, Some(failure));
        // An error drops the open guard, which rolls the transaction back.
        let outcomes = async {
            let outcomes = self
                .store
                .commit_batch(&tx, std::slice::from_ref(&entry))
                .await?;
            tx.commit().await?;
            Ok::<_, lockstep_core::Error>(outcomes)
        }
        .await
        .map_err(|e| PairError::store(&e))?;
        let parked = match outcomes.first() {
            Some(BatchCommitted::Committed { parked, .. }) => {
                count(telemetry::EVENTS_APPLIED, name, events as u64);
                if let Some(oldest) = oldest {
                    observe(telemetry::LAG_SECONDS, name, clock.age_seconds(oldest));
                }
                *parked
            }
            Some(BatchCommitted::FailureRecorded { parked }) => *parked,
            // Another applier moved the cursor first: nothing lost, look again later.
            _ => return Ok(PairOutcome::Skipped(SkipReason::Busy)),
        };
        count(telemetry::PAIR_FAILURES, name, 1);
        if parked {
            count(telemetry::PAIRS_PARKED, name, 1);
        }
        tracing::warn!(pair = %cursor.pair, error = %error, parked, "a pair failed at an event it cannot read; stored on its cursor");
        Ok(PairOutcome::Failed { error })
    }
}

/// What the normal path found.
pub(super) enum Normal {
    Done(PairOutcome),
    NeedsRewind,
}
