//! The rewind from a snapshot, step by step: the calls `PerspectiveWorker::rewind` makes
//! (`rewind_locked` → `rewind_under` → `restore_and_replay`, `commit_rewind` in
//! `crates/worker/src/worker/rewind.rs`), made here one after another on the same store, locker
//! and pool shape, each timed:
//!
//! 1. acquire the `rewind` lease (`StreamLocker::try_acquire`, one statement);
//! 2. `BEGIN`, `load_rewind` (the cursor, the snapshot before the trigger, the stream's events
//!    after it less the skipped ones: one statement) — the worker runs it while it acquires the
//!    lease (ADR 0035), on another connection; here the two are timed one after the other;
//! 3. the replay on tokio's blocking pool (`apply_while`);
//! 4. on the same transaction (a short replay keeps it: ADR 0023), the fenced commit with a
//!    new snapshot that also releases the lease, sent with the `COMMIT`
//!    (`PairWork::commit` with `Release::Lease`, `lockstep_perspective_commit_release_or_refuse`:
//!    ADR 0034).
//!
//! Three round trips in all: `BEGIN` travels with the load (ADR 0024), so its step is the pool
//! checkout only, and the `COMMIT` with the fenced commit (ADR 0034). Each round also times the
//! worker's own rewind of the same pair, back to back with the step-by-step one (the order swapped every
//! round), so that the two are compared under the same conditions (the headline's snapshot
//! rewinds each follow a full one). A bare round trip (`SELECT 1` on a pooled connection) is
//! timed too, to say how much of the rewind is the round trips themselves. The request is
//! written before each rewind, outside the clock; every rewound state is checked against its
//! stream's fold.

use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{Pair, Release};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use lockstep_core::{
    AcquireOutcome, DynPerspective, InstanceId, LockReason, PerspectiveName, StateCommit, StreamId,
    StreamLockOptions, StreamLocker, Transaction as _,
};
use lockstep_pg::PgTransaction;
use lockstep_pg_store::PgPerspectiveStore;
use lockstep_pg_stream::PgStreamLocker;
use lockstep_worker::{PairOutcome, WorkerOptions};
use tokio_postgres::types::Type;
use uuid::Uuid;

use super::{PgWorker, fmt_all, median, verify_rewound};
use crate::bench_db::BenchDatabase;

/// The benchmark's own copy of the cursor read `PgPerspectiveStore::cursor` sends (the store's
/// statements are private to `lockstep-pg-store`): one cursor row by its key, with the latest
/// snapshot's id as a subquery. The planning-cost line times this text sent with `query_typed`
/// against the same text prepared once; it measures what planning costs a statement of this
/// shape, so it is not checked against the store's text (copy the store's again when the
/// cursor's columns change).
const CURSOR_READ: &str = "SELECT k.last_event_id, k.revision, k.applied_count, \
     k.rewind_trigger_event_id, k.rewind_flagged_at, k.rewind_first_flagged_at, k.error, \
     k.failures, \
     (SELECT s.event_id FROM wh_perspective_snapshots s \
       WHERE s.stream_id = k.stream_id AND s.perspective_name = k.perspective_name \
       ORDER BY s.event_id DESC LIMIT 1), \
     k.stream_lock_instance_id, k.stream_lock_reason::text, k.stream_lock_expiry, \
     k.stream_lock_epoch, k.failed_event_id, k.retry_at, k.parked_at \
     FROM wh_perspective_cursors k WHERE k.stream_id = $1 AND k.perspective_name = $2";

/// The steps, in order: label and round trips.
const STEPS: [(&str, usize); 5] = [
    ("acquire the rewind lease", 1),
    ("BEGIN (checkout; sent with the load)", 0),
    ("load_rewind (cursor, snapshot, events, skipped)", 1),
    ("replay (blocking pool)", 0),
    ("fenced commit + snapshot + release, with the COMMIT", 1),
];

/// Records the time since `at` in `t` and restarts `at`.
fn mark(t: &mut Vec<f64>, at: &mut Instant) {
    let now = Instant::now();
    t.push((now - *at).as_secs_f64() * 1000.0);
    *at = now;
}

/// Runs `rounds` step-by-step rewinds of `stream` from `trigger` and returns the lines: a table
/// of the steps (median ms each) and the analysis against `(snapshot, full)`, the medians of the
/// timed `PerspectiveWorker::rewind`s in ms.
#[allow(clippy::too_many_arguments)]
pub(super) async fn run(
    db: &BenchDatabase,
    w: &PgWorker,
    perspective: &Arc<dyn DynPerspective>,
    stream: StreamId,
    trigger: Uuid,
    lock: StreamLockOptions,
    rounds: usize,
    (snapshot_ms, full_ms): (f64, f64),
) -> Result<Vec<String>> {
    // The worker's pool shape: concurrency 1 + 2, shared by the transactions and the locker.
    let pool = db.pool(3)?;
    let locker = PgStreamLocker::from_pool(pool.clone(), lock);
    let store = PgPerspectiveStore::new();
    let name = PerspectiveName::new(perspective.name())?;
    let instance = InstanceId::random();
    let mut ms: Vec<Vec<f64>> = vec![Vec::new(); STEPS.len()];
    let mut totals = Vec::with_capacity(rounds);
    let mut by_worker = Vec::with_capacity(rounds);
    let mut replayed = 0;
    for round in 0..rounds {
        // The worker's rewind and the step-by-step one back to back, the order swapped every
        // round.
        for replica in if round.is_multiple_of(2) {
            [false, true]
        } else {
            [true, false]
        } {
            {
                let tx = PgTransaction::begin(&pool).await?;
                if !store
                    .request_rewind(&tx, &Pair::new(stream, name.clone()), Some(trigger))
                    .await?
                {
                    bail!("no cursor to rewind");
                }
                tx.commit().await?;
            }
            if !replica {
                let started = Instant::now();
                let outcome = w.rewind(stream, &name).await?;
                by_worker.push(started.elapsed().as_secs_f64() * 1000.0);
                if !matches!(
                    outcome,
                    PairOutcome::Rewound {
                        from_snapshot: true,
                        ..
                    }
                ) {
                    bail!("rewind: unexpected outcome {outcome:?}");
                }
                continue;
            }
            let mut t = Vec::with_capacity(STEPS.len());
            let started = Instant::now();
            let mut at = started;
            // 1.
            let lease = match locker
                .try_acquire(stream, &name, instance, &LockReason::Rewind)
                .await?
            {
                AcquireOutcome::Acquired(lease) => lease,
                other => bail!("the rewind lease was not acquired: {other:?}"),
            };
            mark(&mut t, &mut at);
            // 2.
            let tx = PgTransaction::begin(&pool).await?;
            mark(&mut t, &mut at);
            let loaded = store
                .load_rewind(
                    &tx,
                    &Pair::new(stream, name.clone()),
                    WorkerOptions::default().rewind_page,
                )
                .await?
                .context("no cursor")?;
            mark(&mut t, &mut at);
            let request = loaded.cursor.rewind.context("no rewind request")?;
            let snapshot = loaded.snapshot.context("no snapshot before the trigger")?;
            let (revision, events) = (loaded.cursor.revision, loaded.events);
            // 3.
            let p = Arc::clone(perspective);
            let (snapshot_id, snapshot_count) = (snapshot.event_id, snapshot.applied_count);
            let (state, events, applied) = tokio::task::spawn_blocking(move || {
                let mut state = snapshot.state;
                let applied = p.apply_while(&mut state, &events, &|| true);
                (state, events, applied)
            })
            .await?;
            match applied {
                Ok(n) if n == events.len() => {}
                other => bail!("the replay did not apply every event: {other:?}"),
            }
            mark(&mut t, &mut at);
            // 4.
            let mut commit = StateCommit::new(Pair::new(stream, name.clone()), revision, state);
            commit.last_event_id = events.last().map(|e| e.event_id).or(Some(snapshot_id));
            commit.applied_count = snapshot_count + events.len() as u64;
            commit.applied_events = events.iter().map(|e| e.event_id).collect();
            commit.rewound_from = Some(request.trigger);
            commit.snapshot = true;
            commit.fence = Some(lease.id.clone());
            let committed = store.commit(tx, &commit, Release::Lease).await?;
            mark(&mut t, &mut at);
            if !committed.released {
                bail!("the rewind lease was not released by the commit");
            }
            totals.push(started.elapsed().as_secs_f64() * 1000.0);
            replayed = events.len();
            for (i, v) in t.into_iter().enumerate() {
                ms[i].push(v);
            }
        }
    }
    verify_rewound(db, &name, &[stream]).await?;
    // A bare round trip on a pooled connection; and a cursor read sent as the store sends its
    // statements (query_typed: parsed and planned on every call) against the same statement
    // prepared once, alternating — what planning costs a statement here.
    let (mut rtt, mut typed, mut prepared) = (Vec::new(), Vec::new(), Vec::new());
    {
        let client = pool.get().await?;
        let cursor_sql = CURSOR_READ;
        let statement = client
            .prepare_typed(cursor_sql, &[Type::UUID, Type::TEXT])
            .await?;
        let (id, text) = (stream.as_uuid(), name.as_str());
        for _ in 0..(4 * rounds).max(20) {
            let started = Instant::now();
            client.query_typed("SELECT 1", &[]).await?;
            rtt.push(started.elapsed().as_secs_f64() * 1000.0);
            let started = Instant::now();
            client
                .query_typed(cursor_sql, &[(&id, Type::UUID), (&text, Type::TEXT)])
                .await?;
            typed.push(started.elapsed().as_secs_f64() * 1000.0);
            let started = Instant::now();
            client.query(&statement, &[&id, &text]).await?;
            prepared.push(started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    pool.close();
    let rtt = median(&rtt);
    let medians: Vec<f64> = ms.iter().map(|v| median(v)).collect();
    let sum: f64 = medians.iter().sum();
    let total = median(&totals);
    let worker_ms = median(&by_worker);
    let round_trips: usize = STEPS.iter().map(|s| s.1).sum();
    let mut lines = vec![
        format!(
            "#### rewind from the snapshot, step by step ({name}, {replayed} events replayed, \
             {rounds} rounds)"
        ),
        String::new(),
        "| step | round trips | median ms | share | rounds (ms) |".to_owned(),
        "|---|---:|---:|---:|---|".to_owned(),
    ];
    for (i, (label, trips)) in STEPS.iter().enumerate() {
        lines.push(format!(
            "| {label} | {trips} | {:.3} | {:.0} % | {} |",
            medians[i],
            100.0 * medians[i] / sum,
            fmt_all(&ms[i])
        ));
    }
    lines.push(format!(
        "| *all steps (sum of medians)* | {round_trips} | {sum:.3} | 100 % |  |"
    ));
    lines.push(format!(
        "| *all steps (median of the totals)* | {round_trips} | {total:.3} |  | {} |",
        fmt_all(&totals)
    ));
    lines.push(format!(
        "| *PerspectiveWorker::rewind, back to back with these* | {round_trips} | \
         {worker_ms:.3} |  | {} |",
        fmt_all(&by_worker)
    ));
    lines.push(String::new());
    let budget = 0.05 * full_ms;
    let ratio = |ms: f64| ms / full_ms;
    let in_trips = round_trips as f64 * rtt;
    let (typed, prepared) = (median(&typed), median(&prepared));
    lines.push(format!(
        "The same calls as PerspectiveWorker::rewind (rewind_locked → rewind_under → \
         restore_and_replay, commit_rewind), each timed, one after the other (the worker \
         overlaps the lease and the read), on a pool of the worker's size; the \
         worker's own rewind of the same pair alternates with them (order swapped every round), \
         both back to back, while the headline table's snapshot rewinds each follow a full one. \
         Bare round trip (SELECT 1, pooled connection): {rtt:.3} ms median, so {round_trips} \
         round trips are {in_trips:.2} ms; the rest is each statement's own work, server and \
         client (what planning costs a statement here: the cursor read sent with query_typed, \
         parsed and planned per call, {typed:.3} ms; prepared once, {prepared:.3} ms). The \
         replay of \
         {replayed} events: {:.3} ms.",
        medians[3]
    ));
    lines.push(format!(
        "snapshot / full = {snapshot_ms:.2} / {full_ms:.2} ms = {:.4} (the headline); under \
         0.05 needs <= {budget:.2} ms. Back to back: the worker's rewind {worker_ms:.2} ms = \
         {:.4}, its calls alone {total:.2} ms = {:.4}.",
        ratio(snapshot_ms),
        ratio(worker_ms),
        ratio(total),
    ));
    Ok(lines)
}
