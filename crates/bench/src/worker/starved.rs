//! Healthy pairs next to pairs that cannot be served (ADR 0012): the time one worker
//! takes to catch up `--starved-streams` healthy streams (200 × 20 events) **with** pairs that
//! fail and get parked on the way and work of a perspective no worker runs, ÷ the same catch-up
//! **without** them.
//!
//! - *with*: plus `--starved-poisoned` streams (100) of the same perspective whose event at
//!   `--starved-poison-at` (0: the first) has no `n` — the perspective fails on it (the events
//!   before it are applied and committed), the pair backs off 1 ms, 2 ms and is parked at its
//!   third failure (`park_after_failures = Some(3)`) — and a second registered perspective
//!   that no worker runs, with work on `--starved-unserved` streams (100; the appends fan out
//!   to every registered perspective, so its work rows on the other streams are deleted in
//!   set-up);
//! - *without*: the healthy streams alone.
//!
//! Each side runs on emptied tables (`TRUNCATE` of the event and perspective tables, then fresh
//! perspectives and streams), with one worker (default options but a 10 ms poll, a 1 ms
//! backoff, parking after 3 failures) on a pool of its own. Before the clock, a second worker
//! on that pool folds a warm-up perspective's streams (some poisoned, so parked), so that every
//! connection has compiled the store's functions and planned their statements, as a running
//! worker's have ([`WARM_BATCHES`]). Timed: the measured worker's cycles, from its first to
//! the one after which no healthy pair has work left (counted after every cycle, on both
//! sides, outside the timed part). Then, not timed, the worker runs until every poisoned pair
//! is parked, and everything is verified: every healthy state equals its stream's fold and has
//! no work left; every poisoned pair is parked at its poison event with the fold of the events
//! before it and its work from the poison on still queued; the unserved perspective's work is
//! untouched. A failure of any pair but a poisoned one is an error. The sides alternate per
//! round; the headline is the median of the per-round ratios. A last line says what the ratio
//! is made of: the time the failing pairs add per failure stored while timed, as a share of a
//! healthy pair's time alone, and the largest share that keeps the ratio at 1.2 (the goal in
//! docs/benchmarks.md).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use lockstep_core::{
    DynPerspective, NewEvent, Perspective, PerspectiveName, RecordedEvent, StreamId,
    StreamLockOptions,
};
use uuid::Uuid;

use super::{
    Args, POLL, PgWorker, STALLED_AFTER, append_with, create, fmt_all, median, number_event,
    open_pool, options, register, vacuum, worker_on,
};
use crate::bench_db::BenchDatabase;

/// The event a poisoned stream carries: no `n`.
const POISON: &str = "Poison";

/// Warm-up, before the clock, on the measured worker's pool: a second worker folds this many
/// batches' worth (`--pairs-per-cycle` each) of streams of a perspective of its own, more
/// batches than the pool has connections, so that every connection has compiled the store's
/// PL/pgSQL functions and planned their statements (claim, commit, failure, retry, parking)
/// as in a worker that has been running for a while. A backend's first claim and first commit
/// take several times a warm one's; without the warm-up each side's new pool made that most of
/// the figure.
const WARM_BATCHES: usize = 6;
/// Events per warm-up stream.
const WARM_EVENTS: usize = 2;
/// One warm-up stream in this many is poisoned (at its first event), and parked.
const WARM_POISON_EVERY: usize = 32;

/// The list of numbers, failing on an event without one.
struct Strict(String);

/// An event without the number the perspective reads.
#[derive(Debug)]
struct NoNumber;

impl std::fmt::Display for NoNumber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the event has no number")
    }
}

impl std::error::Error for NoNumber {}

impl Perspective for Strict {
    type State = Vec<i64>;
    type Error = NoNumber;

    fn name(&self) -> &str {
        &self.0
    }

    fn apply(&self, state: &mut Vec<i64>, event: &RecordedEvent) -> Result<(), NoNumber> {
        state.push(
            event
                .payload
                .get("n")
                .and_then(|n| n.as_i64())
                .ok_or(NoNumber)?,
        );
        Ok(())
    }
}

/// One side's streams.
struct Setup {
    perspective: PerspectiveName,
    /// The warm-up's perspective, and its poisoned streams.
    warm_perspective: PerspectiveName,
    warm_poisoned: Vec<Uuid>,
    unserved: Option<PerspectiveName>,
    healthy: Vec<Uuid>,
    poisoned: Vec<Uuid>,
    unserved_streams: Vec<Uuid>,
}

pub(super) async fn run(url: &str, args: &Args) -> Result<(Vec<String>, f64)> {
    let db = create(url, args).await?;
    let measured = measure(&db, args).await;
    db.drop_database().await?;
    measured
}

async fn measure(db: &BenchDatabase, args: &Args) -> Result<(Vec<String>, f64)> {
    let lock = StreamLockOptions::new(Duration::from_secs(30), Duration::from_secs(10))?;
    // [without, with]
    let mut seconds: [Vec<f64>; 2] = Default::default();
    let mut failures: [Vec<usize>; 2] = Default::default();
    let mut ratios = Vec::new();
    let progress = crate::report::Progress::new((args.starved_rounds * 2) as u64);
    for round in 0..args.starved_rounds {
        let order: [usize; 2] = if round.is_multiple_of(2) {
            [0, 1]
        } else {
            [1, 0]
        };
        let mut this = [0.0_f64; 2];
        for side in order {
            let with = side == 1;
            progress.step(format!(
                "starved round {}/{}: {}",
                round + 1,
                args.starved_rounds,
                if with {
                    "with failing and unserved pairs"
                } else {
                    "healthy pairs alone"
                }
            ));
            let setup = set_up(db, args, round, with).await?;
            let strict: Arc<dyn DynPerspective> =
                Arc::new(Strict(setup.perspective.as_str().to_owned()));
            let opts = options(args, 1)
                .with_park_after_failures(Some(3))
                .with_failure_backoff(Duration::from_millis(1));
            let pool = open_pool(db, opts.concurrency + 2).await?;
            let warm: Arc<dyn DynPerspective> =
                Arc::new(Strict(setup.warm_perspective.as_str().to_owned()));
            let warming = worker_on(pool.clone(), opts, std::slice::from_ref(&warm), lock)?;
            warm_up(db, &warming, &setup).await?;
            let w = worker_on(pool, opts, std::slice::from_ref(&strict), lock)?;
            let (elapsed, failed) = catch_up(db, &w, &setup).await?;
            park_the_rest(db, &w, &setup).await?;
            check(db, &setup, args).await?;
            seconds[side].push(elapsed.as_secs_f64());
            failures[side].push(failed);
            this[side] = elapsed.as_secs_f64();
        }
        ratios.push(this[1] / this[0]);
    }
    progress.finish();
    let headline = median(&ratios);
    let mut lines = vec![
        format!(
            "### starved: {} healthy streams × {} events caught up by one worker, with and \
             without {} streams failing until parked and {} streams of work of a perspective no \
             worker runs, {} rounds",
            args.starved_streams,
            args.starved_events_per_stream,
            args.starved_poisoned,
            args.starved_unserved,
            args.starved_rounds
        ),
        String::new(),
        "| side | healthy pairs | median s | failures stored while timed (median) | rounds (s) |"
            .to_owned(),
        "|---|---:|---:|---:|---|".to_owned(),
    ];
    for (side, label) in ["healthy pairs alone", "with failing + unserved pairs"]
        .into_iter()
        .enumerate()
    {
        let f: Vec<f64> = failures[side].iter().map(|&n| n as f64).collect();
        lines.push(format!(
            "| {label} | {} | {:.3} | {:.0} | {} |",
            args.starved_streams,
            median(&seconds[side]),
            median(&f),
            fmt_all(&seconds[side])
        ));
    }
    lines.push(String::new());
    lines.push(format!(
        "with ÷ without = {headline:.3} (median of per-round ratios; rounds: {})",
        fmt_all(&ratios)
    ));
    // What the ratio is made of: the time the failing pairs add, per failure stored while
    // timed (the extra batches they cause included), against the time a healthy pair takes
    // alone — and the most that per-failure share may be for the ratio to stay at 1.2.
    let (clean, with) = (median(&seconds[0]), median(&seconds[1]));
    let fails = median(&failures[1].iter().map(|&n| n as f64).collect::<Vec<_>>());
    if fails > 0.0 && clean > 0.0 && args.starved_streams > 0 {
        let per_fail = (with - clean) / fails;
        let per_healthy = clean / args.starved_streams as f64;
        lines.push(format!(
            "A failure stored while timed adds {:.0} µs (the extra batches included) against \
             {:.0} µs per healthy pair alone: {:.2} of a healthy pair's turn; a ratio of 1.2 \
             with {fails:.0} failures needs at most {:.2}.",
            per_fail * 1e6,
            per_healthy * 1e6,
            per_fail / per_healthy,
            0.2 * args.starved_streams as f64 / fails
        ));
    }
    lines.push(format!(
        "Timed: the worker's cycles, from its first to the one after which no healthy pair has \
         work left (a count after every cycle, both sides, not timed). Worker: default options but \
         a 10 ms poll, park_after_failures = Some(3), a 1 ms failure backoff; its connections \
         warmed up first by a second worker on the same pool ({} batches of a perspective of \
         its own, some pairs poisoned and parked), as a running worker's are. The poison event is \
         event {} of its stream (the events before it are committed; the pair backs off 1 ms, 2 \
         ms and is parked at its third failure); the unserved perspective is registered, so the \
         appends fan out to it (its rows beyond {} streams deleted in set-up). Each side on \
         emptied tables with fresh perspectives and streams; sides alternating per round. \
         Verified after each side (not timed): every healthy state is its stream's fold with no \
         work left; every poisoned pair parked at its poison event, its state the fold before \
         it, its work from the poison on still queued; the unserved work untouched.",
        WARM_BATCHES, args.starved_poison_at, args.starved_unserved
    ));
    Ok((lines, headline))
}

/// Empties the tables, registers the side's perspectives and appends its streams.
async fn set_up(db: &BenchDatabase, args: &Args, round: usize, with: bool) -> Result<Setup> {
    db.client()
        .await?
        .batch_execute(
            "TRUNCATE wh_events, wh_perspectives, wh_perspective_events, \
             wh_perspective_cursors, wh_perspective_states, wh_perspective_snapshots, \
             wh_perspective_skipped_events",
        )
        .await?;
    let perspective = PerspectiveName::new(format!("Starved{round}{}", u8::from(with)))?;
    let unserved = if with {
        Some(PerspectiveName::new(format!("Unserved{round}"))?)
    } else {
        None
    };
    let warm_perspective = PerspectiveName::new(format!("Warm{round}{}", u8::from(with)))?;
    let mut names = vec![perspective.clone(), warm_perspective.clone()];
    names.extend(unserved.clone());
    register(db, &names).await?;
    let warm_streams: Vec<StreamId> = (0..args.pairs_per_cycle * WARM_BATCHES)
        .map(|_| StreamId::new_v7())
        .collect();
    let warm_make = |s: usize, i: usize, n: i64| -> Result<NewEvent> {
        if s.is_multiple_of(WARM_POISON_EVERY) && i == 0 {
            Ok(NewEvent::new(POISON, serde_json::json!({ "x": n }))?)
        } else {
            number_event(n)
        }
    };
    append_with(db, &warm_streams, WARM_EVENTS, &warm_make, None).await?;
    let warm: Vec<Uuid> = warm_streams.iter().map(StreamId::as_uuid).collect();
    let warm_poisoned: Vec<Uuid> = warm.iter().step_by(WARM_POISON_EVERY).copied().collect();
    // Healthy and poisoned streams interleaved (one in every `step` is poisoned), so that they
    // share batches.
    let poisoned_n = if with { args.starved_poisoned } else { 0 };
    let all = args.starved_streams + poisoned_n;
    let streams: Vec<StreamId> = (0..all).map(|_| StreamId::new_v7()).collect();
    let mut is_poisoned = vec![false; all];
    if poisoned_n > 0 {
        for k in 0..poisoned_n {
            // Spread evenly over the streams.
            is_poisoned[k * all / poisoned_n] = true;
        }
    }
    let poison_at = args.starved_poison_at;
    let make = |s: usize, i: usize, n: i64| -> Result<NewEvent> {
        if is_poisoned[s] && i == poison_at {
            Ok(NewEvent::new(POISON, serde_json::json!({ "x": n }))?)
        } else {
            number_event(n)
        }
    };
    append_with(db, &streams, args.starved_events_per_stream, &make, None).await?;
    let (mut healthy, mut poisoned) = (Vec::new(), Vec::new());
    for (s, p) in streams.iter().zip(&is_poisoned) {
        if *p {
            poisoned.push(s.as_uuid());
        } else {
            healthy.push(s.as_uuid());
        }
    }
    // The unserved perspective keeps its work on the first `--starved-unserved` streams.
    let unserved_streams: Vec<Uuid> = if unserved.is_some() {
        streams
            .iter()
            .take(args.starved_unserved)
            .map(StreamId::as_uuid)
            .collect()
    } else {
        Vec::new()
    };
    if let Some(u) = &unserved {
        db.client()
            .await?
            .execute(
                "DELETE FROM wh_perspective_events \
                  WHERE perspective_name = $1 AND stream_id <> ALL($2)",
                &[&u.as_str(), &unserved_streams],
            )
            .await?;
    }
    // Appends fan out to every registered perspective: the warm-up's work is on its own
    // streams only, and the measured perspective has none on them.
    db.client()
        .await?
        .execute(
            "DELETE FROM wh_perspective_events \
              WHERE (perspective_name = $1 AND stream_id <> ALL($3)) \
                 OR (perspective_name = $2 AND stream_id = ANY($3))",
            &[&warm_perspective.as_str(), &perspective.as_str(), &warm],
        )
        .await?;
    vacuum(db).await?;
    Ok(Setup {
        perspective,
        warm_perspective,
        warm_poisoned,
        unserved,
        healthy,
        poisoned,
        unserved_streams,
    })
}

/// Healthy work rows left.
async fn healthy_left(client: &tokio_postgres::Client, setup: &Setup) -> Result<i64> {
    Ok(client
        .query_one(
            "SELECT count(*) FROM wh_perspective_events \
              WHERE perspective_name = $1 AND stream_id = ANY($2)",
            &[&setup.perspective.as_str(), &setup.healthy],
        )
        .await?
        .get(0))
}

/// Cycles until no healthy pair has work left; returns the time the worker took and the
/// failures the cycles stored. A failure of a pair that is not poisoned, or a cycle error, is
/// an error. Timed: the worker's cycles (and a poll interval after a cycle that found
/// nothing), not the benchmark's count of the healthy work left after each cycle (about 1 ms
/// each, and the side with failing pairs runs more cycles).
async fn catch_up(db: &BenchDatabase, w: &PgWorker, setup: &Setup) -> Result<(Duration, usize)> {
    let client = db.client().await?;
    let poisoned: HashSet<Uuid> = setup.poisoned.iter().copied().collect();
    let mut failed = 0;
    let mut last: Option<(i64, Instant)> = None;
    let mut elapsed = Duration::ZERO;
    loop {
        let cycle = Instant::now();
        let report = w.run_once().await;
        elapsed += cycle.elapsed();
        if let Some(error) = report.errors.first() {
            bail!("worker cycle failed: {error}");
        }
        for failure in &report.failures {
            if !poisoned.contains(&failure.pair.stream_id.as_uuid()) {
                bail!("a pair that is not poisoned failed: {failure}");
            }
        }
        failed += report.failed;
        let left = healthy_left(&client, setup).await?;
        if left == 0 {
            return Ok((elapsed, failed));
        }
        if report.pairs == 0 {
            match last {
                Some((m, since)) if m == left => {
                    if since.elapsed() > STALLED_AFTER {
                        bail!("{left} healthy work rows left and none claimable");
                    }
                }
                _ => last = Some((left, Instant::now())),
            }
            tokio::time::sleep(POLL).await;
            elapsed += POLL;
        }
    }
}

/// Before the clock: the warm-up worker (on the measured worker's pool) cycles until the
/// warm-up's healthy pairs are caught up and its poisoned ones parked ([`WARM_BATCHES`]).
async fn warm_up(db: &BenchDatabase, w: &PgWorker, setup: &Setup) -> Result<()> {
    let client = db.client().await?;
    let name = setup.warm_perspective.as_str();
    let started = Instant::now();
    loop {
        let report = w.run_once().await;
        if let Some(error) = report.errors.first() {
            bail!("worker cycle failed while warming up: {error}");
        }
        let row = client
            .query_one(
                "SELECT (SELECT count(*) FROM wh_perspective_events
                          WHERE perspective_name = $1 AND stream_id <> ALL($2)),
                        (SELECT count(*) FROM wh_perspective_cursors
                          WHERE perspective_name = $1 AND stream_id = ANY($2)
                            AND parked_at IS NOT NULL)",
                &[&name, &setup.warm_poisoned],
            )
            .await?;
        let (left, parked): (i64, i64) = (row.get(0), row.get(1));
        if left == 0 && parked as usize == setup.warm_poisoned.len() {
            return Ok(());
        }
        if started.elapsed() > STALLED_AFTER {
            bail!(
                "warm-up: {left} healthy work rows left, {parked} of {} poisoned pairs parked \
                 after {STALLED_AFTER:?}",
                setup.warm_poisoned.len()
            );
        }
        if report.pairs == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// Runs the worker (not timed) until every poisoned pair is parked.
async fn park_the_rest(db: &BenchDatabase, w: &PgWorker, setup: &Setup) -> Result<()> {
    if setup.poisoned.is_empty() {
        return Ok(());
    }
    let client = db.client().await?;
    let started = Instant::now();
    loop {
        let parked: i64 = client
            .query_one(
                "SELECT count(*) FROM wh_perspective_cursors \
                  WHERE perspective_name = $1 AND stream_id = ANY($2) AND parked_at IS NOT NULL",
                &[&setup.perspective.as_str(), &setup.poisoned],
            )
            .await?
            .get(0);
        if parked as usize == setup.poisoned.len() {
            return Ok(());
        }
        if started.elapsed() > STALLED_AFTER {
            bail!(
                "{parked} of {} poisoned pairs parked after {STALLED_AFTER:?}",
                setup.poisoned.len()
            );
        }
        let report = w.run_once().await;
        if let Some(error) = report.errors.first() {
            bail!("worker cycle failed: {error}");
        }
        if report.pairs == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// Verifies the side (see the module docs).
async fn check(db: &BenchDatabase, setup: &Setup, args: &Args) -> Result<()> {
    let client = db.client().await?;
    let name = setup.perspective.as_str();
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM wh_perspective_events
                      WHERE perspective_name = $1 AND stream_id = ANY($2)),
                    (SELECT count(*) FROM wh_perspective_states s
                      WHERE s.perspective_name = $1 AND s.stream_id = ANY($2)
                        AND s.state = (SELECT jsonb_agg(e.payload->'n' ORDER BY e.event_id)
                                         FROM wh_events e WHERE e.stream_id = s.stream_id))",
            &[&name, &setup.healthy],
        )
        .await?;
    let (left, exact): (i64, i64) = (row.get(0), row.get(1));
    if left != 0 || exact as usize != setup.healthy.len() {
        bail!(
            "healthy pairs: {left} work rows left, {exact} exact states of {}",
            setup.healthy.len()
        );
    }
    if !setup.poisoned.is_empty() {
        let row = client
            .query_one(
                "WITH p AS (
                     SELECT k.stream_id, k.parked_at, k.failed_event_id,
                            (SELECT e.event_id FROM wh_events e
                              WHERE e.stream_id = k.stream_id AND e.event_type = $3) AS poison
                       FROM wh_perspective_cursors k
                      WHERE k.perspective_name = $1 AND k.stream_id = ANY($2))
                 SELECT (SELECT count(*) FROM p
                          WHERE p.parked_at IS NOT NULL AND p.failed_event_id = p.poison
                            AND (SELECT s.state FROM wh_perspective_states s
                                  WHERE s.stream_id = p.stream_id AND s.perspective_name = $1)
                                IS NOT DISTINCT FROM
                                (SELECT jsonb_agg(e.payload->'n' ORDER BY e.event_id)
                                   FROM wh_events e
                                  WHERE e.stream_id = p.stream_id AND e.event_id < p.poison)),
                        (SELECT count(*) FROM wh_perspective_events
                          WHERE perspective_name = $1 AND stream_id = ANY($2))",
                &[&name, &setup.poisoned, &POISON],
            )
            .await?;
        let (right, left): (i64, i64) = (row.get(0), row.get(1));
        let want_left =
            setup.poisoned.len() * (args.starved_events_per_stream - args.starved_poison_at);
        if right as usize != setup.poisoned.len() || left as usize != want_left {
            bail!(
                "poisoned pairs: {right} of {} parked at their poison event with the fold before \
                 it; {left} work rows left, not {want_left}",
                setup.poisoned.len()
            );
        }
    }
    if let Some(u) = &setup.unserved {
        let row = client
            .query_one(
                "SELECT (SELECT count(*) FROM wh_perspective_events WHERE perspective_name = $1),
                        (SELECT count(*) FROM wh_perspective_states WHERE perspective_name = $1)",
                &[&u.as_str()],
            )
            .await?;
        let (work, states): (i64, i64) = (row.get(0), row.get(1));
        let want = setup.unserved_streams.len() * args.starved_events_per_stream;
        if work as usize != want || states != 0 {
            bail!("unserved perspective: {work} work rows (not {want}), {states} states");
        }
    }
    Ok(())
}
