//! The command runner against the hand-written paths, and aggregate snapshots: two sections of
//! `aggregate`, after the main table.
//!
//! **Runner vs hand-written** (`--runner-rounds`, 0 skips it): hot 32 and cold 16, each mode
//! run both ways in every round — the benchmark's own unit of work (optimistic and
//! pessimistic) and the combiner (combined), then `lockstep_command::CommandRunner` in the
//! matching mode with the same decision, the same hold and the same retry policy — the side
//! that goes first alternating by round. Per scenario and mode the median of the per-round
//! ratios (runner commits/s ÷ hand-written commits/s) is printed as
//! `runner_vs_handwritten_<hot32|cold16>_<mode>=`, and the lowest of the six as
//! `runner_vs_handwritten_min=`.
//!
//! **Snapshots** (`--snapshot-rounds`, 0 skips it): one writer, the runner in the locked mode,
//! no hold, so a command costs what the load and fold cost. Each round runs a block of
//! commands on a stream of 10 000 events whose decider saves a snapshot every 100 events (a
//! first command, not timed, folds the stream and saves it), and a block of commands each on a
//! fresh 50-event stream of a decider without snapshots; the side that goes first alternates.
//! `command_10k_snapshot_vs_50=` is the median over rounds of the mean command time on the
//! long stream over that on the 50-event ones; `command_10k_plain_vs_50=` the same for a few
//! commands on a 10 000-event stream without snapshots (what the snapshots save).
//! `snapshot_saving_command_vs_other=` compares the commands that saved a snapshot (one in a
//! hundred, in their own transaction, before the append) with the others of the long stream.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use deadpool_postgres::Pool;
use lockstep_command::{CommandRunner, Mode as RunnerMode, RunnerOptions};
use lockstep_core::{AggregateType, ExpectedVersion, NewEvent, StreamId, Transaction as _};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_advisory::PgDistributedLock;
use lockstep_pg_store::PgEventStore;
use uuid::Uuid;

use super::{BenchDecider, Heat, Holds, Mode, Setup, Via, scenario, warm_up};
use crate::bench_db::BenchDatabase;
use crate::report::median_if_any;

/// `runner_vs_handwritten_*`: per scenario and mode, the median of the rounds' ratios.
pub(super) async fn runner_vs_handwritten(
    db: &BenchDatabase,
    base: &Setup,
    seed_events: usize,
    commits: usize,
    rounds: usize,
) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let mut medians = Vec::new();
    for (heat, writers) in [(Heat::Hot, 32), (Heat::Cold, 16)] {
        for mode in [Mode::Optimistic, Mode::Pessimistic, Mode::Combined] {
            let mut ratios = Vec::new();
            for round in 0..rounds {
                let order = if round % 2 == 0 {
                    [Via::Handwritten, Via::Runner]
                } else {
                    [Via::Runner, Via::Handwritten]
                };
                let mut per_s = [0.0f64; 2];
                for via in order {
                    let pool = db.pool(writers)?;
                    let setup = Setup {
                        store: PgEventStore::with_queue(PgDistributedLock::from_pool(pool.clone())),
                        via,
                        ..base.clone()
                    };
                    warm_up(&pool, writers).await?;
                    let outcome =
                        scenario(&pool, &setup, writers, heat, mode, seed_events, commits).await?;
                    pool.close();
                    per_s[usize::from(via == Via::Runner)] = outcome.commits_per_sec();
                }
                if per_s[0] > 0.0 {
                    ratios.push(per_s[1] / per_s[0]);
                }
            }
            let median = median_if_any(&ratios);
            lines.push(format!(
                "runner_vs_handwritten_{}{writers}_{}={}",
                heat.label(),
                mode.key(),
                median.map_or("n/a".to_owned(), |r| format!("{r:.2}"))
            ));
            medians.extend(median);
        }
    }
    let min = medians.iter().copied().reduce(f64::min);
    lines.push(format!(
        "runner_vs_handwritten_min={}",
        min.map_or("n/a".to_owned(), |r| format!("{r:.2}"))
    ));
    Ok(lines)
}

type Runner = CommandRunner<PgDatabase, PgEventStore, BenchDecider>;

fn locked_runner(pool: &Pool, every: Option<u32>) -> Runner {
    let db = PgDatabase::from_pool(pool.clone());
    let store = PgEventStore::new(&db);
    let decider = BenchDecider {
        ty: AggregateType::new("SnapshotItem").unwrap_or_else(|e| unreachable!("{e}")),
        hold: Duration::ZERO,
        holds: Arc::new(Holds::default()),
        snapshot_every: every,
    };
    CommandRunner::with_options(db, store, decider, RunnerOptions::new(RunnerMode::Locked))
}

/// Appends `n` events to a new stream `id`, a thousand per transaction.
async fn seed_stream(pool: &Pool, id: Uuid, n: usize) -> Result<()> {
    let store = PgEventStore::new(&PgDatabase::from_pool(pool.clone()));
    let mut at = 0usize;
    while at < n {
        let batch = (n - at).min(1000);
        let events: Vec<NewEvent> = (0..batch)
            .map(|_| NewEvent::new("Reserved", serde_json::json!({ "quantity": 1 })))
            .collect::<lockstep_core::Result<_>>()?;
        let tx = PgTransaction::begin(pool).await?;
        lockstep_core::EventStore::append(
            &store,
            &tx,
            StreamId::from_uuid(id),
            ExpectedVersion::Exact(at as u64),
            &events,
        )
        .await?;
        tx.commit().await?;
        at += batch;
    }
    Ok(())
}

/// Runs one command, returning its time and the stream's version after it.
async fn timed(runner: &Runner, id: Uuid) -> Result<(Duration, u64)> {
    let started = Instant::now();
    let done = runner
        .handle(id, ())
        .await
        .map_err(|e| anyhow::anyhow!("a snapshot benchmark command failed: {e:?}"))?;
    Ok((started.elapsed(), done.version()))
}

fn mean_us(times: &[Duration]) -> f64 {
    times.iter().map(|t| t.as_secs_f64() * 1e6).sum::<f64>() / times.len().max(1) as f64
}

/// `command_10k_snapshot_vs_50`, `command_10k_plain_vs_50`, `snapshot_saving_command_vs_other`.
pub(super) async fn snapshots(
    db: &BenchDatabase,
    rounds: usize,
    block: usize,
) -> Result<Vec<String>> {
    const LONG: usize = 10_000;
    const SHORT: usize = 50;
    const EVERY: u32 = 100;
    let pool = db.pool(2)?;
    warm_up(&pool, 2).await?;
    let with_snapshots = locked_runner(&pool, Some(EVERY));
    let plain = locked_runner(&pool, None);
    let long = Uuid::now_v7();
    seed_stream(&pool, long, LONG)
        .await
        .context("seeding the 10 000-event stream")?;
    // Folds the whole stream once and saves the first snapshot: not timed.
    timed(&with_snapshots, long).await?;
    let long_plain = Uuid::now_v7();
    seed_stream(&pool, long_plain, LONG).await?;

    let (mut vs_short, mut plain_vs_short) = (Vec::new(), Vec::new());
    let (mut saving, mut other) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let mut shorts = Vec::with_capacity(block);
        let mut longs = Vec::with_capacity(block);
        let sides = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for on_long in sides {
            if on_long {
                for _ in 0..block {
                    let (took, version) = timed(&with_snapshots, long).await?;
                    // The command that saved: the one whose events brought the count after
                    // the snapshot to a hundred.
                    if version % u64::from(EVERY) == 1 {
                        saving.push(took);
                    } else {
                        other.push(took);
                    }
                    longs.push(took);
                }
            } else {
                for _ in 0..block {
                    let id = Uuid::now_v7();
                    seed_stream(&pool, id, SHORT).await?;
                    shorts.push(timed(&plain, id).await?.0);
                }
            }
        }
        let short_us = mean_us(&shorts);
        vs_short.push(mean_us(&longs) / short_us.max(f64::EPSILON));
        // A few commands folding the whole 10 000 events, against the same round's short ones.
        let mut unsnapshotted = Vec::new();
        for _ in 0..3 {
            unsnapshotted.push(timed(&plain, long_plain).await?.0);
        }
        plain_vs_short.push(mean_us(&unsnapshotted) / short_us.max(f64::EPSILON));
    }
    pool.close();
    let figure = |r: Option<f64>| r.map_or("n/a".to_owned(), |r| format!("{r:.2}"));
    let saving_vs_other =
        (!saving.is_empty() && !other.is_empty()).then(|| mean_us(&saving) / mean_us(&other));
    Ok(vec![
        format!(
            "command_10k_snapshot_vs_50={}",
            figure(median_if_any(&vs_short))
        ),
        format!(
            "command_10k_plain_vs_50={}",
            figure(median_if_any(&plain_vs_short))
        ),
        format!(
            "snapshot_saving_command_vs_other={}",
            figure(saving_vs_other)
        ),
    ])
}
