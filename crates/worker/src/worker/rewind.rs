//! The rewind path, the seed's lifecycle: try the `rewind` lease (denied → skip the pair until a
//! later cycle, its work untouched); keep it alive ([`crate::LeaseKeeper`]); restore the latest
//! snapshot strictly before the trigger (or start empty) and replay every event in order but
//! the ones an operator skipped; commit fenced on the lease, clearing the request and the
//! snapshots it invalidates; stop the keepalive and release — on every path, including an
//! `apply` that errors or panics, a store error, and a lost lease (the replay is abandoned the
//! moment the keeper signals it; nothing is committed).
use std::sync::Arc;

use lockstep_core::{
    DynPerspective, Error, ErrorKind, LockReason, PerspectiveName, PerspectiveStore, RecordedEvent,
    Result, StateCommit, StreamId, Transaction, TransactionSource,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use super::{PairOutcome, PerspectiveWorker, SkipReason, apply_off_runtime, release};
use crate::lease::{HeldLease, Leased};
use crate::telemetry::{self, count, observe};

impl<S, P> PerspectiveWorker<S, P>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    /// Rewinds a pair now if it has a rewind request (the rewind path of the module docs).
    pub async fn rewind(&self, stream_id: StreamId, name: &PerspectiveName) -> Result<PairOutcome> {
        let Some(p) = self.registry.get(name).cloned() else {
            return Ok(PairOutcome::Skipped(SkipReason::UnknownPerspective));
        };
        let _pair = self.coordinator.lock(stream_id, name).await;
        self.rewind_locked(stream_id, name, &p).await
    }

    pub(super) async fn rewind_locked(
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
                Err(PairError {
                    failures_before: failures,
                    message: err,
                }) => {
                    count(telemetry::REWIND_FAILURES, name.as_str(), 1);
                    tracing::warn!(error = %err, "rewind failed; the request stays and is retried");
                    self.fail(stream_id, name, failures, &err).await
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Restore, replay and commit. `Err`: what went wrong, with the pair's failure count before
    /// this one, and what went wrong.
    async fn rewind_under(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Arc<dyn DynPerspective>,
        lease: Option<&HeldLease>,
    ) -> std::result::Result<Rewind, PairError> {
        let never = CancellationToken::new();
        let lost = lease.map_or(&never, HeldLease::lost);
        let fence = lease.map(|l| l.id().clone());
        let read = async {
            let tx = self
                .source
                .begin()
                .await
                .map_err(|e| PairError::new(0, e))?;
            let loaded = self.load_for_rewind(&tx, stream_id, name).await;
            // Read only: a failed rollback still ends it, and changes nothing.
            let _ = tx.rollback().await;
            loaded
        };
        let loaded = tokio::select! {
            biased;
            () = lost.cancelled() => return Err(PairError::new(0, lease_lost())),
            loaded = read => loaded?,
        };
        let Some(loaded) = loaded else {
            return Ok(Rewind::NothingToDo);
        };
        let mut loaded = loaded;
        let failures = loaded.cursor_failures;
        let state = match loaded.state.take() {
            Some(state) => state,
            None => p.initial_state().map_err(|e| PairError::new(failures, e))?,
        };
        // On a blocking thread, checking the lost signal before every event; dropped (the lost
        // signal wins the race below, or shutdown abandons the pair) it stops within one event.
        let replay = apply_off_runtime(p, state, std::mem::take(&mut loaded.events), lost);
        let applied = tokio::select! {
            biased;
            () = lost.cancelled() => return Err(PairError::new(failures, lease_lost())),
            applied = replay => applied.map_err(|e| PairError::new(failures, e))?,
        };
        loaded.events = applied.events;
        let state = match applied.outcome {
            Ok(n) if n == loaded.events.len() => applied.state,
            // Stopped before the end: only the lost signal stops a replay.
            Ok(_) => return Err(PairError::new(failures, lease_lost())),
            Err(e) => {
                return Err(PairError::new(
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
            Err(err) => Err(PairError::new(failures, err)),
        }
    }

    async fn load_for_rewind(
        &self,
        tx: &S::Tx,
        stream_id: StreamId,
        name: &PerspectiveName,
    ) -> std::result::Result<Option<Loaded>, PairError> {
        let cursor = self
            .store
            .cursor(tx, stream_id, name)
            .await
            .map_err(|e| PairError::new(0, e))?;
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
            .map_err(|e| PairError::new(failures, e))?;
        let base = snapshot.as_ref().map(|s| s.event_id);
        let mut events = self
            .store
            .stream_events(tx, stream_id, base)
            .await
            .map_err(|e| PairError::new(failures, e))?;
        // Events an operator skipped for this pair stay skipped in a replay too.
        let skipped = self
            .store
            .skipped_events(tx, stream_id, name)
            .await
            .map_err(|e| PairError::new(failures, e))?;
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

/// Why processing a pair failed: what to store on its cursor, and the pair's failure count
/// before this failure (what its backoff and parking are computed from).
#[derive(Debug)]
pub(super) struct PairError {
    pub(super) failures_before: u32,
    pub(super) message: String,
}

impl PairError {
    fn new(failures_before: u32, error: impl std::fmt::Display) -> PairError {
        PairError {
            failures_before,
            message: error.to_string(),
        }
    }
}
