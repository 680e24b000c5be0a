//! The rewind path, the lease lifecycle: try the `rewind` lease (denied → skip the pair until a
//! later cycle, its work untouched); keep it alive ([`crate::LeaseKeeper`]); restore the latest
//! snapshot strictly before the trigger (or start empty) and replay every event in order but
//! the ones an operator skipped; commit fenced on the lease, clearing the request and the
//! snapshots it invalidates; stop the keepalive and release — on every path, including an
//! `apply` that errors or panics, a store error, and a lost lease (the replay is abandoned the
//! moment the keeper signals it; nothing is committed).
//!
//! **One transaction when the replay is short.** The reads and the fenced commit run in one
//! READ COMMITTED transaction when the replay is at most [`SHORT_REPLAY_EVENTS`] events and
//! ends within [`SHORT_REPLAY_TIME`] of the read (a rewind from a recent snapshot): no
//! `ROLLBACK` of the read, no second `BEGIN` — 3 round trips: the lease, the read (its `BEGIN`
//! travels with it, ADR 0024), the fenced commit (the `COMMIT` travels with it:
//! `lockstep_core::PairWork::commit` with `Release::Lease`, ADR 0034). The commit's statement
//! takes its own snapshot either way (READ COMMITTED), so what it checks and writes is the
//! same. A longer replay ends the read transaction first, so that no connection sits idle in a
//! transaction while user code runs (an `idle_in_transaction_session_timeout` would fail it on
//! every retry).
//!
//! **The first read does not wait for the lease** (a JSON perspective's, ADR 0035): it runs
//! while the lease is acquired, on another connection, so the two round trips overlap. It takes
//! no lock and writes nothing; when the lease is not acquired (denied, busy, re-entered, an
//! error) it is dropped and its transaction rolled back. What it read may be older than the
//! lease: another instance's rewind may have committed between the read and the acquire. The
//! fenced commit's compare-and-set on the cursor's revision refuses such a commit (a lost race:
//! the pair is looked at again on a later cycle), so nothing read before the lease is ever
//! committed over a newer state. A table perspective's rewind reads after the lease, as
//! before (its reads and writes share the application's transaction).
//!
//! **Pages.** The events to replay are read in pages ([`crate::WorkerOptions::rewind_page`]:
//! events and bytes, the first event always): the first with the cursor and the snapshot, each
//! next one ([`lockstep_core::RewindReads::rewind_events`]) in a read transaction of its own while the one
//! before it is applied. A rewind holds at most two pages, whatever the stream's length (ADR
//! 0031).
//!
//! **Progress.** While a replay runs, its progress (events replayed of events to replay, and
//! since when) is recorded at most once per [`PROGRESS_EVERY`]
//! ([`lockstep_core::RewindReads::record_progress`], a transaction of its own, never on the replay's
//! path: the replay only bumps an atomic counter per event), and the gauges
//! [`telemetry::REWINDS_RUNNING`] and [`telemetry::REWIND_EVENTS_REMAINING`] follow it. A
//! replay shorter than that interval reports nothing. A report that fails is logged and
//! skipped: progress never fails a rewind.
use lockstep_core::{Pair, Release};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lockstep_core::{
    DynPerspective, Error, ErrorKind, LockReason, PageLimits, PerspectiveName, PerspectiveStore,
    ProgressReport, RecordedEvent, Result, StateCommit, StreamId, Transaction, TransactionSource,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{
    Kind, PairOutcome, PerspectiveWorker, SkipReason, apply_off_runtime_counting, failed_at,
    release,
};
use crate::error::PairError;
use crate::lease::{HeldLease, Leased};
use crate::telemetry::{self, count, observe};

impl<S, P> PerspectiveWorker<S, P>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    /// Rewinds a pair now if it has a rewind request (the rewind path of the module docs).
    pub async fn rewind(&self, stream_id: StreamId, name: &PerspectiveName) -> Result<PairOutcome> {
        let Some(p) = self.kind(name) else {
            return Ok(PairOutcome::Skipped(SkipReason::UnknownPerspective));
        };
        let _pair = self.coordinator.lock(stream_id, name).await;
        self.rewind_locked(stream_id, name, &p).await
    }

    pub(super) async fn rewind_locked(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Kind<S::Tx>,
    ) -> Result<PairOutcome> {
        let span = tracing::info_span!("rewind", reason = "rewind", epoch = tracing::field::Empty);
        async move {
            let started = Instant::now();
            // 1. Acquire the lease (denied: skip this pair, retry on a later cycle). A JSON
            // perspective's first read runs meanwhile, on another connection (module docs); it
            // is dropped, its transaction rolled back, unless the lease is acquired.
            let pair = Pair::new(stream_id, name.clone());
            let (leased, read) = match (&self.keeper, p) {
                (Some(keeper), Kind::Json(_)) => {
                    // Boxed: held next to the acquire, the read would make every future
                    // that awaits a rewind (a cycle, a service's task) that much larger.
                    let (leased, read) = tokio::join!(
                        keeper.try_acquire(stream_id, name, &LockReason::Rewind),
                        Box::pin(self.read_rewind(&pair))
                    );
                    (Some(leased), Some(read))
                }
                (Some(keeper), Kind::Table(_)) => (
                    Some(
                        keeper
                            .try_acquire(stream_id, name, &LockReason::Rewind)
                            .await,
                    ),
                    None,
                ),
                (None, _) => (None, None),
            };
            let lease = match leased {
                Some(leased) => match leased {
                    Err(err) => return Err(err),
                    // Another task of this instance holds the lease (a worker sharing the
                    // instance id, an application's rebuild): busy, and not ours to release.
                    Ok(Leased::Acquired(lease)) if lease.lease().reentered => {
                        lease.leave();
                        count(telemetry::SKIPPED_BUSY, name.as_str(), 1);
                        tracing::debug!("the rewind lease is held by another task of this instance; rewind retried on a later cycle");
                        return Ok(PairOutcome::Skipped(SkipReason::Busy));
                    }
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
                if lease.lease().took_over {
                    tracing::info!(stream_id = %stream_id, perspective = %name, "took over an expired rewind lease (its holder crashed or stalled)");
                }
            }
            tracing::info!(stream_id = %stream_id, perspective = %name, "rewind started");
            // 2–3. The keeper keeps it alive while we restore and replay; a lost lease abandons
            // the work at once.
            let (outcome, released) = match p {
                Kind::Json(p) => {
                    self.rewind_under(stream_id, name, p, lease.as_ref(), read)
                        .await
                }
                Kind::Table(p) => {
                    self.table_rewind_under(stream_id, name, p, lease.as_ref())
                        .await
                }
            };
            // 4–5. Stop the keepalive and release, on every path (a commit that released the
            // lease with it has done both).
            if let Some(lease) = lease {
                if released {
                    lease.released_by_commit();
                } else {
                    release(lease).await;
                }
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
                    tracing::info!(stream_id = %stream_id, perspective = %name, replayed, from_snapshot, "rewind committed");
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
                Err(RewindFailure {
                    failures_before,
                    error,
                }) => {
                    count(telemetry::REWIND_FAILURES, name.as_str(), 1);
                    tracing::warn!(error = %error, kind = %error.kind(), "rewind failed; the request stays and is retried");
                    // At the event it failed at, when it was one event's: what `perspectives
                    // parked` shows and `skip` skips (the rebuild then goes on without it).
                    self.fail(stream_id, name, failures_before, error).await
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Restore, replay and commit, and whether the commit released the lease with it (then
    /// committed). `Err`: what went wrong, with the pair's failure count before this one.
    async fn rewind_under(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Arc<dyn DynPerspective>,
        lease: Option<&HeldLease>,
        read: Option<ReadOutcome<S::Tx>>,
    ) -> (std::result::Result<Rewind, RewindFailure>, bool) {
        match self
            .restore_and_replay(stream_id, name, p, lease, read)
            .await
        {
            Ok(Replayed::Commit(commit, from_snapshot, failures, read)) => {
                self.commit_rewind(&commit, from_snapshot, failures, lease, read)
                    .await
            }
            Ok(Replayed::Done(rewind)) => (Ok(rewind), false),
            Err(err) => (Err(err), false),
        }
    }

    /// The first read of a rewind (`load_rewind`: the cursor, the snapshot and the first page
    /// of events, in one statement), and its transaction when a short replay is to keep it for
    /// the commit (module docs).
    async fn read_rewind(&self, pair: &Pair) -> ReadOutcome<S::Tx> {
        let tx = self
            .source
            .begin()
            .await
            .map_err(|e| RewindFailure::store(0, &e))?;
        let loaded = self
            .store
            .load_rewind(&tx, pair, self.options.rewind_page)
            .await;
        // A short replay keeps the transaction for its commit (module docs); otherwise it
        // ends here. Read only: a failed rollback still ends it, and changes nothing.
        let short = matches!(
            &loaded,
            Ok(Some(l)) if !l.more
                && l.events.len() <= SHORT_REPLAY_EVENTS
                && l.cursor.rewind.is_some()
        );
        let kept = if short {
            Some((tx, Instant::now()))
        } else {
            super::rollback(tx, "a rewind's read").await;
            None
        };
        match loaded {
            Ok(loaded) => Ok((loaded, kept)),
            Err(err) => {
                // The pair's failures count towards its backoff and parking, as when the
                // reads were separate and the cursor came first.
                let failures = self.cursor_failures(pair).await.unwrap_or(0);
                Err(RewindFailure::store(failures, &err))
            }
        }
    }

    /// Restore and replay: the commit to make, or how the rewind ended before it. `read`: the
    /// first read, when it ran while the lease was acquired; `None` reads now.
    async fn restore_and_replay(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        p: &Arc<dyn DynPerspective>,
        lease: Option<&HeldLease>,
        read: Option<ReadOutcome<S::Tx>>,
    ) -> std::result::Result<Replayed<S::Tx>, RewindFailure> {
        let never = CancellationToken::new();
        let lost = lease.map_or(&never, HeldLease::lost);
        let fence = lease.map(|l| l.id().clone());
        let pair = Pair::new(stream_id, name.clone());
        let page = self.options.rewind_page;
        // The cursor, the snapshot and the first page of events, in one statement
        // (`load_rewind`): read already, or now.
        let (loaded, kept) = match read {
            Some(_) if lost.is_cancelled() => return Err(RewindFailure::lease_lost(0)),
            Some(read) => read?,
            None => tokio::select! {
                biased;
                () = lost.cancelled() => return Err(RewindFailure::lease_lost(0)),
                read = self.read_rewind(&pair) => read?,
            },
        };
        let Some(loaded) = loaded else {
            return Ok(Replayed::Done(Rewind::NothingToDo));
        };
        let failures = loaded.cursor.failures;
        let Some(rewind) = loaded.cursor.rewind else {
            return Ok(Replayed::Done(Rewind::NothingToDo)); // someone else finished it
        };
        let revision = loaded.cursor.revision;
        let (base, base_count, state) = match loaded.snapshot {
            Some(s) => (Some(s.event_id), s.applied_count, Some(s.state)),
            None => (None, 0, None),
        };
        let state = match state {
            Some(state) => state,
            None => p
                .initial_state()
                .map_err(|e| RewindFailure::new(failures, PairError::state(&e)))?,
        };
        // Until the last page is read, the events to replay are estimated from the cursor:
        // what it applied after the snapshot (at least what was read).
        let estimate = loaded.cursor.applied_count.saturating_sub(base_count);
        let counts = Arc::new(ReplayCounts::new(
            loaded.events.len() as u64,
            loaded.more,
            estimate,
        ));
        let first = Page {
            events: loaded.events,
            more: loaded.more,
            unreadable: loaded
                .unreadable
                .map(|(event_id, reason)| PairError::unreadable(event_id, reason)),
        };
        let replay = self.replay_pages(&pair, p, state, first, page, lost, &counts, failures);
        let progress = self.report_progress(stream_id, name, lease, &counts);
        let replayed = tokio::select! {
            biased;
            () = lost.cancelled() => return Err(RewindFailure::lease_lost(failures)),
            replayed = replay => replayed?,
            () = progress => unreachable!("the progress report never ends by itself"),
        };
        // The read transaction serves the commit only if the replay was quick; otherwise it
        // ends now (no pooled connection idles in a transaction while user code runs).
        let read = match kept {
            Some((tx, read_at)) if read_at.elapsed() <= SHORT_REPLAY_TIME => Some(tx),
            Some((tx, _)) => {
                // Read only: a rollback that fails still ends it, and changes nothing.
                super::rollback(tx, "a rewind's read").await;
                None
            }
            None => None,
        };
        let count = replayed.applied.len();
        let mut commit =
            StateCommit::new(Pair::new(stream_id, name.clone()), revision, replayed.state);
        commit.last_event_id = replayed.applied.last().copied().or(base);
        commit.applied_count = base_count + count as u64;
        commit.applied_events = replayed.applied;
        commit.rewound_from = Some(rewind.trigger);
        commit.snapshot = true;
        commit.fence = fence;
        Ok(Replayed::Commit(
            Box::new(commit),
            base.is_some(),
            failures,
            read,
        ))
    }

    /// Replays `first` and the pages after it onto `state`, on the blocking pool, reading each
    /// next page while the one before it is applied (so a rewind holds at most two pages,
    /// whatever the stream's length). A page cut by its bytes makes the next one ask for one
    /// event more than it held (the rows read past a page are read for nothing), growing back
    /// by doubling. The replayed state and the ids of the events applied, in order; `Err`:
    /// what stopped it (the lost signal, a failed `apply`, a failed read, an event that could
    /// not be read), as stored on the cursor with `failures` before it, at the event it
    /// failed at when it was one event's.
    #[allow(
        clippy::too_many_arguments,
        reason = "the replay's inputs, each used once; a struct for them would be built once"
    )]
    async fn replay_pages(
        &self,
        pair: &Pair,
        p: &Arc<dyn DynPerspective>,
        mut state: serde_json::Value,
        first: Page,
        page: PageLimits,
        lost: &CancellationToken,
        counts: &Arc<ReplayCounts>,
        failures: u32,
    ) -> std::result::Result<ReplayedPages, RewindFailure> {
        let failed = |error: PairError| RewindFailure::new(failures, error);
        let store = |e: &Error| RewindFailure::store(failures, e);
        let mut applied_ids = Vec::with_capacity(first.events.len());
        // The first page (read with the configured limits) may have been cut by its bytes too.
        let mut limits = page;
        limits.events = next_page_events(page.events, page.events, first.events.len(), first.more);
        let mut current = first;
        loop {
            let after = current.events.last().map(|e| e.event_id);
            let more = current.more;
            if more && after.is_none() {
                return Err(store(&empty_page()));
            }
            let unreadable = current.unreadable.take();
            let events = std::mem::take(&mut current.events);
            let expected = events.len();
            let apply = apply_off_runtime_counting(
                p,
                state,
                events,
                lost,
                Some(Arc::clone(&counts.started)),
            );
            let next = async {
                if more {
                    Some(self.read_page(pair, after, limits).await)
                } else {
                    None
                }
            };
            let (applied, next) = tokio::join!(apply, next);
            let applied = applied.map_err(|e| store(&e))?;
            match applied.outcome {
                Ok(n) if n == expected => {}
                // Stopped before the end: only the lost signal stops a replay.
                Ok(_) => return Err(RewindFailure::lease_lost(failures)),
                Err(e) => {
                    let at = failed_at(p, applied.state, applied.events, &e, lost).await;
                    return Err(failed(PairError::perspective(e).in_replay().at(at)));
                }
            }
            state = applied.state;
            applied_ids.extend(applied.events.iter().map(|e| e.event_id));
            drop(applied.events);
            // The page ended at an event that could not be read (its stored payload does not
            // decode): the replay fails at it, as the normal path does.
            if let Some(error) = unreadable {
                return Err(failed(error));
            }
            match next {
                None => break,
                Some(next) => {
                    let next = next.map_err(|e| store(&e))?;
                    limits.events =
                        next_page_events(limits.events, page.events, next.events.len(), next.more);
                    counts.read(next.events.len() as u64, next.more);
                    current = next;
                }
            }
        }
        Ok(ReplayedPages {
            state,
            applied: applied_ids,
        })
    }

    /// The page of the pair's rewind after `after`, in a read transaction of its own.
    async fn read_page(
        &self,
        pair: &Pair,
        after: Option<uuid::Uuid>,
        limits: PageLimits,
    ) -> Result<Page> {
        let tx = self.source.begin().await?;
        let page = self.store.rewind_events(&tx, pair, after, limits).await;
        // Read only: a rollback that fails still ends it, and changes nothing.
        super::rollback(tx, "a rewind's page").await;
        let page = page?;
        Ok(Page {
            events: page.events,
            more: page.more,
            unreadable: page
                .unreadable
                .map(|(event_id, reason)| PairError::unreadable(event_id, reason)),
        })
    }

    /// Reports the replay's progress every [`PROGRESS_EVERY`] until dropped (never returns):
    /// the store's row and the gauges, which its guard takes back when dropped.
    async fn report_progress(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        lease: Option<&HeldLease>,
        counts: &ReplayCounts,
    ) {
        let began = Instant::now();
        let mut gauges = ProgressGauges::new(name);
        let mut report = ProgressReport::new(
            Pair::new(stream_id, name.clone()),
            uuid::Uuid::new_v4(),
            0,
            0,
        );
        report.lease = lease.map(|l| l.id().clone());
        loop {
            tokio::time::sleep(PROGRESS_EVERY).await;
            let (replayed, to_replay) = counts.now();
            gauges.set(to_replay - replayed);
            report.replayed = replayed;
            report.to_replay = to_replay;
            report.elapsed = began.elapsed();
            let recorded = async {
                let tx = self.source.begin().await?;
                self.store.record_progress(&tx, &report).await?;
                tx.commit().await
            }
            .await;
            if let Err(err) = recorded {
                tracing::debug!(error = %err, "recording a rewind's progress failed; skipped");
            }
        }
    }

    /// The commit, fenced on the lease, which it releases in the same change
    /// ([`Release::Lease`]): `true` when it did and the transaction committed. It
    /// runs on `read`, the read's transaction, when the replay kept it (module docs), else on
    /// a new one.
    async fn commit_rewind(
        &self,
        commit: &StateCommit,
        from_snapshot: bool,
        failures: u32,
        lease: Option<&HeldLease>,
        read: Option<S::Tx>,
    ) -> (std::result::Result<Rewind, RewindFailure>, bool) {
        if let Some(lease) = lease {
            // The lease is released right after this commit on every path: no renew from now
            // on, so none races the commit's own release.
            lease.stop_renewing();
        }
        // Not raced against the lost signal, so that a commit the server accepted is never
        // reported as failed.
        let committed = async {
            let tx = match read {
                Some(tx) => tx,
                None => self.source.begin().await?,
            };
            // The state change and the COMMIT together (one round trip on Postgres).
            let committed = self.store.commit(tx, commit, Release::Lease).await?;
            Ok::<_, lockstep_core::Error>(committed.released)
        }
        .await;
        match committed {
            Ok(released) => (
                Ok(Rewind::Committed {
                    replayed: commit.applied_events.len(),
                    from_snapshot,
                }),
                released,
            ),
            // Another applier moved the cursor first: nothing is lost, the pair is looked at
            // again later — the normal path's rule for the same conflict.
            Err(err) if err.kind() == ErrorKind::Conflict => (Ok(Rewind::LostRace), false),
            Err(err) => (Err(RewindFailure::store(failures, &err)), false),
        }
    }
}

/// A rewind's first read: what it loaded (`None`: no cursor) and the transaction kept for the
/// commit with the time of the read; `Err` with the pair's failure count.
type ReadOutcome<Tx> =
    std::result::Result<(Option<lockstep_core::RewindLoad>, Option<(Tx, Instant)>), RewindFailure>;

/// What [`PerspectiveWorker::restore_and_replay`] ends with.
enum Replayed<Tx> {
    /// The replayed state to commit, whether it was restored from a snapshot, the pair's
    /// failure count, and the read's transaction when the commit is to run on it.
    Commit(Box<StateCommit>, bool, u32, Option<Tx>),
    /// Nothing to commit.
    Done(Rewind),
}

/// How a rewind ended (its failures aside).
pub(super) enum Rewind {
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

/// A page of a rewind's events, as the replay takes it.
struct Page {
    events: Vec<RecordedEvent>,
    more: bool,
    /// The event after `events` that could not be read (then `more` is false).
    unreadable: Option<PairError>,
}

/// What [`PerspectiveWorker::replay_pages`] ends with.
struct ReplayedPages {
    state: serde_json::Value,
    /// The ids of the events applied, in order.
    applied: Vec<uuid::Uuid>,
}

/// The events a page asks for after a page that was asked for `requested` events and held
/// `got`, with `more` after them (`max`: the configured page): one more than it held when its
/// bytes cut it, else double, up to `max`. Both replays (JSON and table) use it for every page
/// after the first, the first page's cut included.
pub(super) fn next_page_events(requested: usize, max: usize, got: usize, more: bool) -> usize {
    if more && got < requested {
        got.saturating_add(1).min(max)
    } else {
        requested.saturating_mul(2).min(max)
    }
}

/// A replay's counts, shared with its progress report: events started (bumped by the blocking
/// thread as each event's application starts), events read, and the estimate of the total
/// while pages remain.
struct ReplayCounts {
    started: Arc<AtomicU64>,
    read: AtomicU64,
    /// The total, estimated from the cursor, while more pages follow; `u64::MAX` once the last
    /// page is read.
    estimate: AtomicU64,
}

impl ReplayCounts {
    fn new(read: u64, more: bool, estimate: u64) -> ReplayCounts {
        ReplayCounts {
            started: Arc::new(AtomicU64::new(0)),
            read: AtomicU64::new(read),
            estimate: AtomicU64::new(if more { estimate } else { u64::MAX }),
        }
    }

    /// A page of `events` was read; `more` after it or not.
    fn read(&self, events: u64, more: bool) {
        self.read.fetch_add(events, Ordering::Relaxed);
        if !more {
            self.estimate.store(u64::MAX, Ordering::Relaxed);
        }
    }

    /// Events replayed and events to replay, now: the event being applied is counted when it
    /// starts, so the ones before it are done; the total is what was read once the last page
    /// is, else the estimate (at least one more than what was read).
    fn now(&self) -> (u64, u64) {
        let read = self.read.load(Ordering::Relaxed);
        let to_replay = match self.estimate.load(Ordering::Relaxed) {
            u64::MAX => read,
            estimate => estimate.max(read.saturating_add(1)),
        };
        let replayed = self
            .started
            .load(Ordering::Relaxed)
            .saturating_sub(1)
            .min(to_replay);
        (replayed, to_replay)
    }
}

/// The store handed out an empty page with more events after it (a store's defect).
pub(super) fn empty_page() -> Error {
    Error::new(
        ErrorKind::Backend,
        "a rewind page was empty with more events after it",
    )
}

/// Why a rewind failed, with the pair's failure count before this failure (what its backoff
/// and parking are computed from).
#[derive(Debug)]
pub(super) struct RewindFailure {
    pub(super) failures_before: u32,
    pub(super) error: PairError,
}

impl RewindFailure {
    pub(super) fn new(failures_before: u32, error: PairError) -> RewindFailure {
        RewindFailure {
            failures_before,
            error,
        }
    }

    /// An error of the store ([`PairError::store`]).
    pub(super) fn store(failures_before: u32, error: &Error) -> RewindFailure {
        RewindFailure::new(failures_before, PairError::store(error))
    }

    /// The rewind's lease was lost ([`PairError::lease_lost`]).
    pub(super) fn lease_lost(failures_before: u32) -> RewindFailure {
        RewindFailure::new(failures_before, PairError::lease_lost())
    }
}

/// How often a running replay records its progress (and the first report's delay: a shorter
/// replay reports nothing).
pub const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// The most events a rewind replays with its read transaction kept open for the commit (module
/// docs): a rewind from a recent snapshot.
pub const SHORT_REPLAY_EVENTS: usize = 1_000;

/// How long after its read a replay may end and still commit on the read's transaction
/// (module docs); far below any sensible `idle_in_transaction_session_timeout`.
pub const SHORT_REPLAY_TIME: Duration = Duration::from_millis(50);

/// The running-rewind gauges of one replay, taken back when dropped (the replay ended, was
/// abandoned or its future dropped).
struct ProgressGauges {
    perspective: String,
    running: bool,
    remaining: u64,
}

impl ProgressGauges {
    fn new(name: &PerspectiveName) -> ProgressGauges {
        ProgressGauges {
            perspective: name.as_str().to_owned(),
            running: false,
            remaining: 0,
        }
    }

    fn set(&mut self, remaining: u64) {
        if !self.running {
            self.running = true;
            telemetry::gauge_add(telemetry::REWINDS_RUNNING, &self.perspective, 1.0);
        }
        let delta = remaining as f64 - self.remaining as f64;
        telemetry::gauge_add(telemetry::REWIND_EVENTS_REMAINING, &self.perspective, delta);
        self.remaining = remaining;
    }
}

impl Drop for ProgressGauges {
    fn drop(&mut self) {
        if self.running {
            telemetry::gauge_add(telemetry::REWINDS_RUNNING, &self.perspective, -1.0);
            telemetry::gauge_add(
                telemetry::REWIND_EVENTS_REMAINING,
                &self.perspective,
                -(self.remaining as f64),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_cut_by_its_bytes_makes_the_next_ask_for_one_more_and_full_pages_double_back() {
        // Asked for 100, got 3 with more after them: the bytes cut it.
        assert_eq!(next_page_events(100, 100, 3, true), 4);
        // Full by its count: double, up to the configured page.
        assert_eq!(next_page_events(4, 100, 4, true), 8);
        assert_eq!(next_page_events(64, 100, 64, true), 100);
        assert_eq!(next_page_events(100, 100, 100, true), 100);
        // The last page: nothing follows, whatever is asked next is never used.
        assert_eq!(next_page_events(100, 100, 7, false), 100);
    }

    #[test]
    fn progress_estimates_the_total_until_the_last_page_is_read() {
        let counts = ReplayCounts::new(1_000, true, 5_000);
        assert_eq!(counts.now(), (0, 5_000), "nothing started yet");
        counts.started.store(1_001, Ordering::Relaxed);
        assert_eq!(counts.now(), (1_000, 5_000), "the first page applied");
        // An estimate below what was read: at least one more than read.
        let low = ReplayCounts::new(2_000, true, 10);
        assert_eq!(low.now().1, 2_001);
        // The last page read: the total is exact.
        counts.read(500, false);
        assert_eq!(counts.now(), (1_000, 1_500));
        counts.started.store(1_500, Ordering::Relaxed);
        assert_eq!(counts.now(), (1_499, 1_500));
    }
}
