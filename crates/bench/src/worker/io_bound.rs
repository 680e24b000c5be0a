//! The catch-up of an **I/O-bound** perspective by 1, 2 and 4 instances: what `SKIP LOCKED`
//! batch claims (ADR 0012) are for — instances split the work by skipping each other's rows, so
//! time spent outside the database (a perspective that calls a service, writes a file) runs in
//! parallel across instances.
//!
//! `--io-streams` streams × `--io-events-per-stream` events (1 024 × 20) are appended to a
//! database of their own; each side registers a fresh perspective (its registration enqueues
//! the work: set-up, not timed) and 1, 2 or 4 instances — each with a pool, a locker and an
//! `InstanceId` of its own, its connections opened before the clock (as a running instance has
//! them), default options but a 10 ms poll — drain it. The perspective (the
//! list of numbers of the catch-up) implements `DynPerspective` directly and waits
//! `--io-wait-ms` (5 ms, `std::thread::sleep`) once per `apply_while` call: the worker calls it
//! once per pair per batch, so that is 5 ms per pair-batch outside the database (a batch of 64
//! pairs waits 64 × 5 ms in its fold, on tokio's blocking pool). Every side is verified (every
//! state equals its stream's fold, no work left). The order of the sides rotates per round;
//! ratios are medians of per-round ratios. `share_max_vs_min` is the most ÷ the fewest events
//! one instance applied in a 4-instance run (median over rounds).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use lockstep_core::{ApplyError, DynPerspective, PerspectiveName, RecordedEvent, StreamId};

use super::{
    Args, POLL, WorkLeft, append, check, create, drain, fmt_all, median, options, register, vacuum,
    verify, worker,
};
use crate::bench_db::BenchDatabase;

/// The catch-up's list of numbers, waiting `wait` once per `apply_while` call (a perspective
/// whose work is mostly outside the database).
struct IoNumbers {
    name: String,
    wait: Duration,
}

impl DynPerspective for IoNumbers {
    fn name(&self) -> &str {
        &self.name
    }

    fn initial_state(&self) -> lockstep_core::Result<serde_json::Value> {
        Ok(serde_json::Value::Array(Vec::new()))
    }

    fn apply_all(
        &self,
        state: &mut serde_json::Value,
        events: &[RecordedEvent],
    ) -> std::result::Result<(), ApplyError> {
        self.apply_while(state, events, &|| true).map(|_| ())
    }

    fn apply_while(
        &self,
        state: &mut serde_json::Value,
        events: &[RecordedEvent],
        go_on: &dyn Fn() -> bool,
    ) -> std::result::Result<usize, ApplyError> {
        // The I/O: once per call, before any event (a failure leaves the state untouched).
        std::thread::sleep(self.wait);
        let Some(list) = state.as_array_mut() else {
            return Err(ApplyError::State {
                detail: "the state is not a list".to_owned(),
            });
        };
        let mut applied = 0;
        for event in events {
            if !go_on() {
                break;
            }
            list.push(
                event
                    .payload
                    .get("n")
                    .cloned()
                    .unwrap_or(serde_json::Value::from(-1)),
            );
            applied += 1;
        }
        Ok(applied)
    }
}

/// What the I/O-bound catch-up measured.
pub(super) struct IoBound {
    pub(super) lines: Vec<String>,
    pub(super) four_vs_one: f64,
    pub(super) two_vs_one: f64,
    pub(super) share_max_vs_min: f64,
}

const INSTANCES: [usize; 3] = [1, 2, 4];

pub(super) async fn run(url: &str, args: &Args) -> Result<IoBound> {
    let db = create(url, args).await?;
    let measured = measure(&db, args).await;
    db.drop_database().await?;
    measured
}

/// The best ratio `k` instances can reach over 1 when the time is all in the folds: batches of
/// `pairs` pairs (the last one partial) taken by whichever instance is free first, each
/// costing its number of pairs.
fn batch_bound(streams: usize, pairs: usize, k: usize) -> f64 {
    let pairs = pairs.max(1);
    let mut load = vec![0usize; k.max(1)];
    let mut left = streams;
    while left > 0 {
        let batch = left.min(pairs);
        left -= batch;
        if let Some(least) = load.iter_mut().min() {
            *least += batch;
        }
    }
    let makespan = load.iter().copied().max().unwrap_or(0).max(1);
    streams as f64 / makespan as f64
}

async fn measure(db: &BenchDatabase, args: &Args) -> Result<IoBound> {
    let streams: Vec<StreamId> = (0..args.io_streams).map(|_| StreamId::new_v7()).collect();
    let total = args.io_streams * args.io_events_per_stream;
    eprintln!(
        "io-bound: appending {total} events over {} streams",
        args.io_streams
    );
    append(db, &streams, args.io_events_per_stream).await?;
    let lock =
        lockstep_core::StreamLockOptions::new(Duration::from_secs(30), Duration::from_secs(10))?;
    let wait = Duration::from_millis(args.io_wait_ms);
    let mut seconds: Vec<Vec<f64>> = vec![Vec::new(); INSTANCES.len()];
    let mut per_round: Vec<Vec<f64>> = Vec::new();
    // Seconds the busiest instance of each run spent in the perspective's waits.
    let mut waiting: Vec<Vec<f64>> = vec![Vec::new(); INSTANCES.len()];
    // Events applied by each instance of the 4-instance runs, per round.
    let mut shares: Vec<Vec<usize>> = Vec::new();
    let progress = crate::report::Progress::new((args.io_rounds * INSTANCES.len()) as u64);
    for round in 0..args.io_rounds {
        let mut order: Vec<usize> = (0..INSTANCES.len()).collect();
        order.rotate_left(round % INSTANCES.len());
        let mut this = vec![0.0_f64; INSTANCES.len()];
        for i in order {
            let instances = INSTANCES[i];
            let name = format!("Io{round}x{instances}");
            let perspective = PerspectiveName::new(name.clone())?;
            register(db, std::slice::from_ref(&perspective)).await?;
            vacuum(db).await?;
            progress.step(format!(
                "io-bound round {}/{}: {instances} instance(s)",
                round + 1,
                args.io_rounds
            ));
            let io: Arc<dyn DynPerspective> = Arc::new(IoNumbers { name, wait });
            let mut workers = Vec::with_capacity(instances);
            for _ in 0..instances {
                let w = worker(db, options(args, 1), std::slice::from_ref(&io), lock).await?;
                let left = WorkLeft::new(db, std::slice::from_ref(&perspective)).await?;
                workers.push((w, left));
            }
            let started = Instant::now();
            let tasks: Vec<_> = workers
                .into_iter()
                .map(|(w, left)| tokio::spawn(async move { drain(&w, &left, POLL).await }))
                .collect();
            let mut applied = Vec::with_capacity(instances);
            let mut failed = None;
            for task in tasks {
                match task.await? {
                    Ok(n) => applied.push(n),
                    Err(e) => failed = failed.or(Some(e)),
                }
            }
            let elapsed = started.elapsed();
            if let Some(e) = failed {
                return Err(e);
            }
            check(applied.iter().sum(), total)?;
            verify(db, &perspective, args.io_streams).await?;
            // The waits of the instance that applied the most (one per pair-batch: every pair
            // here fits one batch, so one per pair).
            let busiest = applied.iter().copied().max().unwrap_or(0);
            waiting[i].push((busiest / args.io_events_per_stream) as f64 * wait.as_secs_f64());
            if instances == 4 {
                shares.push(applied);
            }
            seconds[i].push(elapsed.as_secs_f64());
            this[i] = total as f64 / elapsed.as_secs_f64();
        }
        per_round.push(this);
    }
    progress.finish();
    let pairs = options(args, 1).pairs_per_cycle;
    let ratio = |a: usize| -> Vec<f64> { per_round.iter().map(|r| r[a] / r[0]).collect() };
    let mut lines = vec![
        format!(
            "### I/O-bound catch-up: {total} events over {} streams, the perspective waiting {} \
             ms per pair-batch outside the database, {} rounds",
            args.io_streams, args.io_wait_ms, args.io_rounds
        ),
        String::new(),
        "| instances | events | median s | events/s | vs 1 instance | batch-granularity bound | waiting, busiest instance (s) | rounds (s) |".to_owned(),
        "|---:|---:|---:|---:|---:|---:|---:|---|".to_owned(),
    ];
    let mut vs_one = Vec::new();
    for (i, &instances) in INSTANCES.iter().enumerate() {
        let m = median(&seconds[i]);
        let r = ratio(i);
        vs_one.push(median(&r));
        lines.push(format!(
            "| {instances} | {total} | {m:.3} | {:.0} | {:.3} | {:.3} | {:.3} | {} |",
            total as f64 / m,
            median(&r),
            batch_bound(args.io_streams, pairs, instances),
            median(&waiting[i]),
            fmt_all(&seconds[i])
        ));
    }
    lines.push(String::new());
    let share_ratios: Vec<f64> = shares
        .iter()
        .map(|applied| {
            let max = applied.iter().copied().max().unwrap_or(0);
            let min = applied.iter().copied().min().unwrap_or(0);
            max as f64 / min as f64
        })
        .collect();
    let share_max_vs_min = median(&share_ratios);
    lines.push(format!(
        "2 instances / 1 = {:.3} (rounds: {}); 4 instances / 1 = {:.3} (rounds: {})",
        vs_one[1],
        fmt_all(&ratio(1)),
        vs_one[2],
        fmt_all(&ratio(2))
    ));
    lines.push(format!(
        "events applied per instance, 4 instances: {}; most / fewest = {share_max_vs_min:.3} \
         (median over rounds; rounds: {})",
        shares
            .iter()
            .map(|a| format!(
                "[{}]",
                a.iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
            .collect::<Vec<_>>()
            .join(", "),
        fmt_all(&share_ratios)
    ));
    lines.push(format!(
        "The perspective implements DynPerspective and sleeps {} ms (std::thread::sleep) once per \
         apply_while call; the worker calls apply_while once per pair per batch, so this is {} \
         ms per pair-batch outside the database, folded one pair after another on one blocking \
         task per batch (a batch of {pairs} pairs waits {} ms). Each instance: its own pool, \
         locker and InstanceId, default options but a 10 ms poll (concurrency 1, {pairs} pairs \
         per batch). Batch-granularity bound: the ratio k instances reach if all the time is in \
         the folds and whole batches are split among them (`--io-streams` {} = {} batches of \
         {pairs}). Ratios: medians of per-round events/s ratios, sides rotating per round; every \
         side verified (every state its stream's fold, no work left). Waiting, busiest \
         instance: its pairs × the wait (every pair fits one batch here) — the least the side \
         could take; the rest of its time is claims, commits and what follows them.",
        args.io_wait_ms,
        args.io_wait_ms,
        args.io_wait_ms as usize * pairs,
        args.io_streams,
        args.io_streams.div_ceil(pairs)
    ));
    lines.push(
        "A pair's first snapshot is written by its batch commit (no bootstrap round trips per \
         new pair, ADR 0012 §6)."
            .to_owned(),
    );
    Ok(IoBound {
        lines,
        four_vs_one: vs_one[2],
        two_vs_one: vs_one[1],
        share_max_vs_min,
    })
}
