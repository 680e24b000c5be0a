//! The apply paths of **table perspectives** ([`lockstep_core::TablePerspective`]): `apply`
//! writes the application's rows in the very transaction that commits the pair's cursor, so an
//! event's rows land exactly once, whatever crashes.
//!
//! - **In a batch** ([`super::batch`]): after the JSON pairs are folded, each table pair's
//!   events are applied, one after another, in the batch's transaction, and the pair's entry
//!   commits its cursor with the batch (its state row holds JSON `null`; no snapshots: a table
//!   perspective's rewind starts from the start). If one fails, its statement may have aborted
//!   the transaction (Postgres), so the whole batch rolls back — the other pairs' work stays
//!   queued for the next claim — and the failing pair is then processed alone.
//! - **Alone** ([`PerspectiveWorker::process_pair`], and after a batch as above): claim, apply,
//!   commit in one transaction. When `apply` fails at an event, that transaction is rolled
//!   back; a second one applies and commits the events before it (a poison event costs only
//!   itself), and the failure is stored with its backoff, as for JSON perspectives.
//! - **Rewind**, under the rewind lease: one transaction runs `reset(stream)`, applies every
//!   event of the stream but the skipped ones (checking the lost signal before each), and
//!   commits fenced on the lease, releasing it; a lost lease drops the transaction (nothing
//!   written).
use lockstep_core::{Committed, Pair, Release};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use lockstep_core::{
    ApplyError, Claim, Cursor, DynTablePerspective, ErrorKind, PerspectiveName, PerspectiveStore,
    RecordedEvent, Result, StateCommit, StreamId, TransactionSource,
};
use tokio_util::sync::CancellationToken;

use super::pair::Normal;
use super::rewind::{Rewind, RewindFailure, empty_page, next_page_events};
use super::{PairOutcome, PerspectiveWorker, SkipReason};
use crate::error::PairError;
use crate::lease::HeldLease;
use crate::telemetry::{self, count};

/// How applying a table pair's events ended: how many were applied, and the error that stopped
/// the rest (none: all applied, or `go_on` said stop).
pub(super) struct TableApplied {
    pub(super) applied: usize,
    pub(super) error: Option<ApplyError>,
}

/// Applies `events` in order in `tx` while `go_on()`, turning a panic in the perspective's code
/// into an error at that event.
pub(super) async fn apply_in<Tx: Sync>(
    p: &dyn DynTablePerspective<Tx>,
    tx: &Tx,
    events: &[RecordedEvent],
    go_on: &(dyn Fn() -> bool + Sync),
) -> TableApplied {
    for (applied, event) in events.iter().enumerate() {
        if !go_on() {
            return TableApplied {
                applied,
                error: None,
            };
        }
        let outcome = AssertUnwindSafe(p.apply_one(tx, event))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| {
                Err(ApplyError::Panicked {
                    event_id: Some(event.event_id),
                    detail: super::panic_message(&*panic),
                })
            });
        if let Err(error) = outcome {
            return TableApplied {
                applied,
                error: Some(error),
            };
        }
    }
    TableApplied {
        applied: events.len(),
        error: None,
    }
}

/// `reset(stream)`, with a panic turned into an error.
async fn reset_in<Tx: Sync>(
    p: &dyn DynTablePerspective<Tx>,
    tx: &Tx,
    stream_id: StreamId,
) -> std::result::Result<(), ApplyError> {
    AssertUnwindSafe(p.reset_stream(tx, stream_id))
        .catch_unwind()
        .await
        .unwrap_or_else(|panic| {
            Err(ApplyError::Reset {
                detail: format!("panicked: {}", super::panic_message(&*panic)),
            })
        })
}

/// The cursor commit of a table pair that applied `events` after `cursor`: its state row holds
/// `null`, and no snapshot is taken (a rewind resets the rows and starts from the start).
pub(super) fn table_commit(cursor: &Cursor, events: &[RecordedEvent]) -> StateCommit {
    let mut commit = StateCommit::new(
        cursor.pair.clone(),
        cursor.revision,
        serde_json::Value::Null,
    );
    commit.last_event_id = events.last().map(|e| e.event_id).or(cursor.last_event_id);
    commit.applied_count = cursor.applied_count + events.len() as u64;
    commit.applied_events = events.iter().map(|e| e.event_id).collect();
    commit.snapshot = false;
    commit
}

impl<S, P> PerspectiveWorker<S, P>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    /// The normal path of one table pair, under its coordinator lock: claim, apply and commit
    /// in one transaction; on a failure at an event, the events before it in a second one and
    /// the failure stored.
    pub(super) async fn table_pending(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Arc<dyn DynTablePerspective<S::Tx>>,
    ) -> Result<Normal> {
        // Every `?` drops the open guard, which rolls the transaction back.
        let tx = self.source.begin().await?;
        let claimed = match self.claim_one(tx, stream_id, name).await? {
            Ok(claimed) => claimed,
            Err(normal) => return Ok(normal),
        };
        let (tx, cursor, events) = (claimed.tx, claimed.cursor, claimed.events);
        let applied = apply_in(&**p, &tx, &events, &|| true).await;
        if let Some(error) = applied.error {
            // The transaction may be aborted by the failed statement: end it (a rollback that
            // fails ends it all the same), then commit the events before the failing one on
            // their own.
            super::rollback(tx, "a table pair whose apply failed").await;
            count(telemetry::APPLY_FAILURES, name.as_str(), 1);
            tracing::warn!(error = %error, "a table perspective failed; stored on its cursor");
            let failures_before = match self
                .table_prefix(stream_id, name, p, &events[..applied.applied])
                .await
            {
                // Progress clears the count: this is the first failure at the new position.
                Ok(true) => 0,
                Ok(false) => cursor.failures,
                Err(err) => {
                    tracing::warn!(error = %err, "committing the events before a failure failed");
                    cursor.failures
                }
            };
            let at = events.get(applied.applied).map(|e| e.event_id);
            return self
                .fail(
                    stream_id,
                    name,
                    failures_before,
                    PairError::perspective(error).at(at),
                )
                .await
                .map(Normal::Done);
        }
        let commit = table_commit(&cursor, &events);
        if let Some(error) = claimed.unreadable {
            // The events before it, with the failure at it, in this transaction.
            let commit = (!events.is_empty()).then_some(commit);
            let oldest = events.iter().map(|e| e.recorded_at).min();
            return match self
                .commit_failing(tx, &cursor, commit, error, oldest, &claimed.clock)
                .await
            {
                Ok(outcome) => Ok(Normal::Done(outcome)),
                Err(err) => {
                    count(telemetry::PAIR_FAILURES, name.as_str(), 1);
                    self.fail(stream_id, name, cursor.failures, err)
                        .await
                        .map(Normal::Done)
                }
            };
        }
        let committed = self.store.commit(tx, &commit, Release::Keep).await;
        match committed {
            Ok(_) => {}
            // Another applier moved the cursor first: nothing lost, look again later.
            Err(err) if err.kind() == ErrorKind::Conflict => {
                return Ok(Normal::Done(PairOutcome::Skipped(SkipReason::Busy)));
            }
            Err(err) => {
                count(telemetry::PAIR_FAILURES, name.as_str(), 1);
                return match self
                    .fail(stream_id, name, cursor.failures, PairError::store(&err))
                    .await
                {
                    Ok(outcome) => Ok(Normal::Done(outcome)),
                    Err(_) => Err(err),
                };
            }
        }
        count(
            telemetry::EVENTS_APPLIED,
            name.as_str(),
            events.len() as u64,
        );
        Ok(Normal::Done(PairOutcome::Applied {
            events: events.len(),
        }))
    }

    /// Applies and commits `prefix` (the events before a failing one), in a transaction of its
    /// own: `Ok(true)` when it committed, `Ok(false)` when there was nothing to commit or the
    /// pair moved on meanwhile (nothing written).
    async fn table_prefix(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Arc<dyn DynTablePerspective<S::Tx>>,
        prefix: &[RecordedEvent],
    ) -> Result<bool> {
        if prefix.is_empty() {
            return Ok(false);
        }
        let tx = self.source.begin().await?;
        let claim = self
            .store
            .claim(
                &tx,
                &Pair::new(stream_id, name.clone()),
                prefix.len(),
                self.options.debounce(),
            )
            .await?;
        // Where nothing is committed, a rollback that fails still ends the transaction: the
        // claim's writes are gone either way.
        let Claim::Apply { cursor, events, .. } = claim else {
            super::rollback(tx, "the claim of a table pair's events before a failure").await;
            return Ok(false);
        };
        // Only the very events that applied before: anything else (work changed meanwhile) is
        // left for the next claim.
        let same = events.len() == prefix.len()
            && events
                .iter()
                .zip(prefix)
                .all(|(a, b)| a.event_id == b.event_id);
        if !same {
            super::rollback(tx, "the claim of a table pair's events before a failure").await;
            return Ok(false);
        }
        let applied = apply_in(&**p, &tx, &events, &|| true).await;
        if applied.error.is_some() {
            // Not deterministic: commit nothing; the failure is stored by the caller.
            super::rollback(tx, "a table pair's events before a failure").await;
            return Ok(false);
        }
        let commit = table_commit(&cursor, &events);
        self.store.commit(tx, &commit, Release::Keep).await?;
        count(
            telemetry::EVENTS_APPLIED,
            name.as_str(),
            events.len() as u64,
        );
        Ok(true)
    }

    /// The rewind of a table pair under its lease (or unlocked without a locker): reset, replay
    /// and commit in one transaction; whether the commit released the lease with it.
    pub(super) async fn table_rewind_under(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Arc<dyn DynTablePerspective<S::Tx>>,
        lease: Option<&HeldLease>,
    ) -> (std::result::Result<Rewind, RewindFailure>, bool) {
        let never = CancellationToken::new();
        let lost = lease.map_or(&never, HeldLease::lost);
        let tx = match self.source.begin().await {
            Ok(tx) => tx,
            Err(err) => return (Err(RewindFailure::store(0, &err)), false),
        };
        // Reset and replay, raced against the lost signal: lost, the transaction is dropped
        // (rolled back) and nothing is written.
        let replay = self.table_replay(&tx, stream_id, name, p, lease, lost);
        let prepared = tokio::select! {
            biased;
            () = lost.cancelled() => Err(RewindFailure::lease_lost(0)),
            prepared = replay => prepared,
        };
        let (commit, failures) = match prepared {
            Ok(Some(prepared)) => prepared,
            Ok(None) => {
                // Nothing was written (no rewind to do): a rollback that fails still ends it.
                super::rollback(tx, "a table rewind with nothing to do").await;
                return (Ok(Rewind::NothingToDo), false);
            }
            Err(err) => {
                drop(tx);
                return (Err(err), false);
            }
        };
        if let Some(lease) = lease {
            // Released right after this commit on every path: no renew from now on.
            lease.stop_renewing();
        }
        // Not raced against the lost signal, so that a commit the server accepted is never
        // reported as failed.
        let committed = self.store.commit(tx, &commit, Release::Lease).await;
        match committed {
            Ok(Committed { released, .. }) => (
                Ok(Rewind::Committed {
                    replayed: commit.applied_events.len(),
                    from_snapshot: false,
                }),
                released,
            ),
            Err(err) if err.kind() == ErrorKind::Conflict => (Ok(Rewind::LostRace), false),
            Err(err) => (Err(RewindFailure::store(failures, &err)), false),
        }
    }

    /// Reads what the rewind needs, resets the stream's rows and applies every event but the
    /// skipped ones, in `tx`: the commit to make and the pair's failure count, or `None` when
    /// there is no rewind to do.
    async fn table_replay(
        &self,
        tx: &S::Tx,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Arc<dyn DynTablePerspective<S::Tx>>,
        lease: Option<&HeldLease>,
        lost: &CancellationToken,
    ) -> std::result::Result<Option<(StateCommit, u32)>, RewindFailure> {
        let pair = Pair::new(stream_id, name.clone());
        let page = self.options.rewind_page;
        let loaded = match self.store.load_rewind(tx, &pair, page).await {
            Ok(loaded) => loaded,
            Err(err) => {
                let failures = self.cursor_failures(&pair).await.unwrap_or(0);
                return Err(RewindFailure::store(failures, &err));
            }
        };
        let Some(loaded) = loaded else {
            return Ok(None);
        };
        let failures = loaded.cursor.failures;
        let Some(rewind) = loaded.cursor.rewind else {
            return Ok(None); // someone else finished it
        };
        // A snapshot of the pair from when it was a JSON perspective: a table perspective
        // replays from the start whatever snapshots exist, so its first page is read again.
        // After a page cut by its bytes, the next asks for one event more than it held
        // (`next_page_events`, as the JSON replay does).
        let mut limits = page;
        let (mut events, mut more, mut unreadable) = if loaded.snapshot.is_some() {
            (Vec::new(), true, None)
        } else {
            limits.events =
                next_page_events(page.events, page.events, loaded.events.len(), loaded.more);
            (loaded.events, loaded.more, loaded.unreadable)
        };
        let failed = |error: PairError| RewindFailure::new(failures, error);
        reset_in(&**p, tx, stream_id)
            .await
            .map_err(|e| failed(PairError::perspective(e)))?;
        // Page by page, in the rewind's transaction (the table rows it writes and the cursor
        // commit together): one page of events held at a time.
        let mut applied_ids: Vec<uuid::Uuid> = Vec::new();
        let mut after = None;
        loop {
            let applied = apply_in(&**p, tx, &events, &|| !lost.is_cancelled()).await;
            if let Some(error) = applied.error {
                // At the event it failed at: what `perspectives parked` shows and `skip` skips.
                let at = events.get(applied.applied).map(|e| e.event_id);
                return Err(failed(PairError::perspective(error).in_replay().at(at)));
            }
            if applied.applied < events.len() {
                // Only the lost signal stops a replay.
                return Err(RewindFailure::lease_lost(failures));
            }
            // The page ended at an event that could not be read: the replay fails at it.
            if let Some((event_id, reason)) = unreadable.take() {
                return Err(failed(PairError::unreadable(event_id, reason)));
            }
            applied_ids.extend(events.iter().map(|e| e.event_id));
            after = events.last().map(|e| e.event_id).or(after);
            if !more {
                break;
            }
            let next = self
                .store
                .rewind_events(tx, &pair, after, limits)
                .await
                .map_err(|e| RewindFailure::store(failures, &e))?;
            limits.events =
                next_page_events(limits.events, page.events, next.events.len(), next.more);
            if next.events.is_empty() && next.more {
                return Err(RewindFailure::store(failures, &empty_page()));
            }
            (events, more, unreadable) = (next.events, next.more, next.unreadable);
        }
        let mut commit = StateCommit::new(
            Pair::new(stream_id, name.clone()),
            loaded.cursor.revision,
            serde_json::Value::Null,
        );
        commit.last_event_id = applied_ids.last().copied();
        commit.applied_count = applied_ids.len() as u64;
        commit.applied_events = applied_ids;
        commit.rewound_from = Some(rewind.trigger);
        commit.snapshot = false;
        commit.fence = lease.map(|l| l.id().clone());
        Ok(Some((commit, failures)))
    }

    /// A purge's part for a table pair: its rows, reset in the purge's transaction.
    pub(super) async fn table_reset_for_purge(
        &self,
        tx: &S::Tx,
        stream_id: StreamId,
        p: &Arc<dyn DynTablePerspective<S::Tx>>,
    ) -> Result<()> {
        reset_in(&**p, tx, stream_id).await.map_err(|e| {
            lockstep_core::Error::new(
                ErrorKind::Backend,
                format!("the table perspective's reset failed, nothing was purged: {e}"),
            )
        })
    }
}
