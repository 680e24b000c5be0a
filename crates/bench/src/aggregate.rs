//! `aggregate`: the pessimistic per-aggregate write lock against the optimistic default, on the
//! Postgres event store, with the floor and a pgbench peer for the hot case.
//!
//! Every command is one unit of work on an owned READ COMMITTED transaction: begin, (lock,)
//! load the stream, decide — fold the events and hold `--hold-ms` of simulated work — then
//! append one event with the expected version **together with the COMMIT**
//! (`EventStore::append_at_commit`: one round trip for both).
//!
//! - **optimistic**: load, decide, append + commit; a conflict (`23505`, reported by the
//!   commit) rolls back and retries the whole unit of work with `lockstep_core::RetryPolicy`
//!   (exponential backoff, full jitter).
//! - **pessimistic**: `EventStore::load_locked` — the advisory lock and the load in one
//!   statement — then the same decide and append + commit. Conflicts should not happen; they
//!   are counted.
//! - **combined**: the same command submitted to a `lockstep_combiner::Combiner` (ADR 0013):
//!   one batch task per aggregate takes the lock and loads once, decides the queued commands in
//!   turn (each one the same fold and hold), and appends all their events with one COMMIT.
//!   Latency is from `submit` to the answer.
//!
//! **The hold is honest**: a blocking-pool thread sleeps it (`std::thread::sleep`, the
//! kernel's high-resolution timer) instead of tokio's millisecond timer wheel, on which a 1 ms
//! sleep lasts 1–2 ms. Both modes use the same mechanism, and the actual hold of every command
//! is measured (column *hold ms*, line `hold_ms_mean`).
//!
//! Streams start with `--seed-events` events. **hot**: every writer on one stream; **cold**:
//! each writer on its own stream. Each scenario runs until `--commits` commands have committed
//! (a fixed count, so both modes grow the hot stream by the same number of events) on a fresh
//! set of streams, with a pool of one connection per writer.
//!
//! **Round trips per command** are counted, not inferred: a second, shorter pass of every
//! scenario runs through a TCP relay (`lockstep_testkit::relay`) that counts each burst of
//! client bytes following server bytes (pipelined statements travel in one burst). Throughput
//! comes from the direct pass.
//!
//! Each scenario runs `--rounds` rounds, alternating which mode goes first; the table shows the
//! totals over all rounds, and the ratio row under each pair is the **median of the per-round
//! ratios** (each round's two modes ran back to back, so drift on a shared machine hits both).
//!
//! **Hot, 32 writers** also gets, in every round:
//! - **the floor**: the mean round trip of `SELECT 1` on the benchmark's connections, measured
//!   just before the pessimistic run. Writers take turns, so the best a serialized section can
//!   do is one hold plus one round trip: `floor = 1 / (mean hold + mean round trip)` commits/s.
//! - **the pgbench peer**: pgbench at 32 clients running the same statements on a fresh stream
//!   of the same size for the same number of commits — `BEGIN`, `lockstep_lock_and_load`, the
//!   hold as `\sleep`, then `lockstep_append_events` and `COMMIT` in a `\startpipeline` block.
//!
//! Rounds rotate which of the three modes goes first. The combined lines: `hot32_combined_vs_decision_limit`
//! (median over rounds of combined commits/s ÷ (1 / its mean measured hold) — one aggregate's
//! physical ceiling), `hot32_combined_vs_optimistic`, `cold16_combined_vs_optimistic` (medians
//! of per-round ratios), `hot32_combined_p99_vs_pessimistic` (p99 over all rounds) and
//! `hot32_combined_conflicts`.
//!
//! **First commands** (a table after the main one): per scenario and mode, each writer's first
//! committed command (p50 and max) against the p99 of its other commands. Each mode of each
//! round gets a fresh pool, so a first command is its connection's first use of the statements
//! and its backend's first call of the functions they run; the table shows how much of the p99
//! that is. It changes no figure: the headline p99 counts every command.
//!
//! **Append vs plain insert** (module `append_cost`, after the scenarios): the server time of
//! `lockstep_append_events` per event, no perspective registered, against a bare `INSERT` into
//! an equally indexed table, both via pgbench, alternating ABBA; lines `append_server_us`,
//! `plain_insert_server_us` and `append_server_us_vs_plain_insert` (median of per-pass ratios).
//!
//! Every scenario also prints `<hot|cold><writers>_<optimistic|pessimistic|combined>_commits_per_s`
//! (over all rounds) and `…_p99_ms` (what `scripts/bench-vs-cqrs-es` compares with the peer).
//!
//! The last lines are the headline figures: `hot32_pessimistic_vs_optimistic`,
//! `cold16_pessimistic_vs_optimistic` (median commits/s ratios), `hot32_pessimistic_conflicts`
//! (over all rounds), `hot32_pessimistic_vs_floor`, `hot32_pessimistic_vs_pgbench` (medians of
//! the rounds' ratios), `hot32_p99_pessimistic_vs_optimistic` (p99 latencies over all rounds)
//! and `hold_ms_mean` (the measured hold, pessimistic hot 32).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use deadpool_postgres::Pool;
use hdrhistogram::Histogram;
use lockstep_combiner::Combiner;
use lockstep_command::{CommandRunner, RunnerOptions};
use lockstep_core::TransactionSource as _;
use lockstep_core::{
    AggregateType, Decider, ErrorKind, EventStore, ExpectedVersion, NewEvent, RecordedEvent,
    RetryPolicy, StreamId, aggregate_key,
};
use lockstep_pg::sqlx::SqlxDatabase;
use lockstep_pg::{LockQueue, PgDatabase, PgTransaction};
use lockstep_pg_advisory::PgDistributedLock;
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::pg_harness::server_address;
use lockstep_testkit::relay::Relay;
use uuid::Uuid;

pub(crate) mod drivers;
mod runner;

use crate::append_cost;
use crate::bench_db::{BenchDatabase, admin_url};
use crate::pgbench::{self, PgbenchRun};
use crate::report::{median_if_any, new_histogram};
use lockstep_core::Transaction as _;

/// Options of the `aggregate` benchmark.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Args {
    /// Writer counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 4, 16, 32])]
    writers: Vec<usize>,
    /// Commits per hot scenario and round (throughput pass).
    #[arg(long, default_value_t = 300)]
    commits: usize,
    /// Cold scenarios: commits per writer (at least `--commits` in all).
    #[arg(long, default_value_t = 100)]
    cold_commits_per_writer: usize,
    /// Rounds per scenario; the mode that goes first alternates, and the headline ratio is the
    /// median of the rounds' ratios (robust to a noisy neighbour on the machine).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Commits per scenario in the round-trip counting pass.
    #[arg(long, default_value_t = 200)]
    rt_commits: usize,
    /// Events each stream starts with.
    #[arg(long, default_value_t = 50)]
    seed_events: usize,
    /// Simulated work inside each transaction, in milliseconds.
    #[arg(long, default_value_t = 1)]
    hold_ms: u64,
    /// Give the optimistic and pessimistic commands' events random (v4) ids instead of
    /// lockstep's time-ordered v7 ones: an experiment on the cold tail (the v7 primary key's
    /// inserts all land on its right-most leaf). The combined mode keeps v7 ids.
    #[arg(long)]
    random_event_ids: bool,
    /// Optimistic retries: attempt cap (default: `RetryPolicy::default()`, 10).
    #[arg(long, default_value_t = 10)]
    max_attempts: u32,
    /// Optimistic retries: first backoff ceiling, in milliseconds, doubling per retry
    /// (default: `RetryPolicy::default()`, 5).
    #[arg(long, default_value_t = 5)]
    initial_backoff_ms: u64,
    /// Optimistic retries: backoff cap, in milliseconds (default: `RetryPolicy::default()`,
    /// 200).
    #[arg(long, default_value_t = 200)]
    max_backoff_ms: u64,
    /// `synchronous_commit` of the benchmark database. Off by default, so the figures measure
    /// locking rather than the machine's WAL flush latency (which every hot-aggregate commit
    /// otherwise holds the lock through); `on` measures durable commits.
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    synchronous_commit: String,
    /// Server to create the benchmark database on (default: `DATABASE_URL`, else
    /// postgres://postgres@127.0.0.1:5432/postgres).
    #[arg(long)]
    database_url: Option<String>,
    /// The pgbench program (the hot 32 peer).
    #[arg(long, default_value = "pgbench")]
    pgbench: String,
    /// `SELECT 1` round trips timed per round for the floor.
    #[arg(long, default_value_t = 300)]
    floor_samples: usize,
    /// Append vs plain insert (`append_cost`): events per side and pass.
    #[arg(long, default_value_t = 3000)]
    append_events: usize,
    /// Append vs plain insert: passes, alternating which side goes first (ABBA); 0 skips it.
    #[arg(long, default_value_t = 4)]
    append_passes: usize,
    /// The command runner against the hand-written paths (module `runner`): rounds per
    /// scenario and mode, alternating which side goes first; 0 skips it.
    #[arg(long, default_value_t = 3)]
    runner_rounds: usize,
    /// Aggregate snapshots (module `runner`): rounds, alternating which side goes first; 0
    /// skips it.
    #[arg(long, default_value_t = 4)]
    snapshot_rounds: usize,
    /// Aggregate snapshots: timed commands per side and round.
    #[arg(long, default_value_t = 50)]
    snapshot_block: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Optimistic = 0,
    Pessimistic = 1,
    Combined = 2,
}

impl Mode {
    /// The mode's name in `key=value` lines.
    fn key(self) -> &'static str {
        match self {
            Mode::Optimistic => "optimistic",
            Mode::Pessimistic => "pessimistic",
            Mode::Combined => "combined",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Mode::Optimistic => "optimistic+retry",
            Mode::Pessimistic => "pessimistic",
            Mode::Combined => "combined",
        }
    }
}

/// Who runs a scenario's commands: the benchmark's own unit of work (and the combiner), or
/// the command runner in the matching mode (`runner` module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    Handwritten,
    Runner,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Heat {
    Hot,
    Cold,
}

impl Heat {
    fn label(self) -> &'static str {
        match self {
            Heat::Hot => "hot",
            Heat::Cold => "cold",
        }
    }
}

/// What one scenario did.
struct Outcome {
    commits: usize,
    attempts: u64,
    conflicts: u64,
    failed: u64,
    elapsed: Duration,
    latency_us: Histogram<u64>,
    /// The same latencies split: each writer's first committed command of the scenario (its
    /// connection's first use of the statements — and, on a fresh backend, of the functions
    /// they call) and all the others. Diagnostic only: the headline uses `latency_us`.
    first_latency_us: Histogram<u64>,
    later_latency_us: Histogram<u64>,
    /// Sum of the measured holds, µs, and how many there were.
    hold_us: u64,
    holds: u64,
    /// Where the serialized section's time went (pessimistic commands).
    section: Section,
    /// Each committed attempt's steps (optimistic and pessimistic commands).
    steps: Vec<Steps>,
}

impl Outcome {
    fn empty() -> Outcome {
        Outcome {
            commits: 0,
            attempts: 0,
            conflicts: 0,
            failed: 0,
            elapsed: Duration::ZERO,
            latency_us: new_histogram(),
            first_latency_us: new_histogram(),
            later_latency_us: new_histogram(),
            hold_us: 0,
            holds: 0,
            section: Section::default(),
            steps: Vec::new(),
        }
    }

    fn merge(&mut self, other: &Outcome) {
        self.commits += other.commits;
        self.attempts += other.attempts;
        self.conflicts += other.conflicts;
        self.failed += other.failed;
        self.elapsed += other.elapsed;
        self.hold_us += other.hold_us;
        self.holds += other.holds;
        self.section.merge(&other.section);
        self.steps.extend_from_slice(&other.steps);
        // Same bounds on both sides; values beyond them were saturated on record.
        let _ = self.latency_us.add(&other.latency_us);
        let _ = self.first_latency_us.add(&other.first_latency_us);
        let _ = self.later_latency_us.add(&other.later_latency_us);
    }

    fn commits_per_sec(&self) -> f64 {
        self.commits as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }

    fn per_commit(&self, n: u64) -> f64 {
        n as f64 / self.commits.max(1) as f64
    }

    /// The mean measured hold, in milliseconds.
    fn hold_ms_mean(&self) -> f64 {
        self.hold_us as f64 / self.holds.max(1) as f64 / 1000.0
    }
}

/// The shared pieces of one scenario.
#[derive(Clone)]
struct Setup {
    store: PgEventStore,
    retry: RetryPolicy,
    hold: Duration,
    /// `--random-event-ids`.
    random_ids: bool,
    /// Who runs the commands.
    via: Via,
    /// Which driver the hand-written commands begin their transactions on.
    driver: Driver,
}

/// The driver of the hand-written commands' transactions (module `drivers`). The scenario's
/// pool seeds the streams either way.
#[derive(Clone)]
enum Driver {
    /// `PgTransaction::begin` on the scenario's pool.
    Pool,
    /// A `PgDatabase` (tokio-postgres) of its own.
    TokioPostgres(PgDatabase),
    /// An sqlx pool: `SqlxTransaction`, the same statements one round trip each.
    Sqlx(SqlxDatabase),
}

const AGGREGATE: &str = "BenchItem";

/// Runs the benchmark and prints the table and the headline figures.
pub(crate) async fn run(args: Args) -> Result<()> {
    let url = admin_url(args.database_url.clone());
    let db = BenchDatabase::create(&url).await?;
    let result = run_on(&args, &db).await;
    db.drop_database().await?;
    result
}

/// Migrates the benchmark database and sets its `synchronous_commit` (`on` or `off`).
pub(crate) async fn prepare(db: &BenchDatabase, synchronous_commit: &str) -> Result<()> {
    let setup_pool = db.pool(2)?;
    lockstep_pg::migrate(&setup_pool)
        .await
        .context("migrating the benchmark database")?;
    // `on`/`off` only (checked by clap): safe to inline.
    db.client()
        .await?
        .batch_execute(&format!(
            "ALTER DATABASE \"{}\" SET synchronous_commit = {synchronous_commit}",
            db.name(),
        ))
        .await
        .context("setting synchronous_commit")?;
    setup_pool.close();
    Ok(())
}

async fn run_on(args: &Args, db: &BenchDatabase) -> Result<()> {
    prepare(db, &args.synchronous_commit).await?;
    let retry = RetryPolicy::new(
        std::num::NonZeroU32::new(args.max_attempts.max(1)).unwrap_or(std::num::NonZeroU32::MIN),
        Duration::from_millis(args.initial_backoff_ms),
        Duration::from_millis(args.max_backoff_ms),
    );
    let hold = Duration::from_millis(args.hold_ms);
    println!(
        "# aggregate: {} seed events, {} ms held in each transaction, {} commits per scenario \
         ({} in the round-trip pass), synchronous_commit = {}; optimistic retry: {} attempts, \
         backoff ceiling {} ms doubling to {} ms, full jitter",
        args.seed_events,
        args.hold_ms,
        args.commits,
        args.rt_commits,
        args.synchronous_commit,
        args.max_attempts,
        args.initial_backoff_ms,
        args.max_backoff_ms
    );
    println!();
    println!(
        "| writers | streams | mode | commits/s | retries/commit | wasted appends/commit | \
         failed | p50 ms | p99 ms | hold ms | round trips/command | round trips/attempt |"
    );
    println!("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");

    let relay = Relay::start(server_address(db.config()).context("the round-trip relay")?)
        .await
        .context("starting the round-trip relay")?;
    let relayed_pool = |size: usize| db.pool_through(relay.addr(), size);
    let work_dir = std::env::temp_dir().join(db.name());
    std::fs::create_dir_all(&work_dir).context("creating a work directory")?;

    let mut headline = Headline::default();
    // One row per scenario and mode: the first command of each writer against the others.
    let mut first_rows = String::new();
    // The slowest 1 % of each scenario's attempts, phase by phase, against all of them.
    let mut slow_rows = String::new();
    for &writers in &args.writers {
        for heat in [Heat::Hot, Heat::Cold] {
            let commits = match heat {
                Heat::Hot => args.commits,
                Heat::Cold => args.commits.max(args.cold_commits_per_writer * writers),
            };
            // The floor and the pgbench peer: hot, 32 writers.
            let peer = heat == Heat::Hot && writers == 32;
            // Rounds alternate which mode goes first, so drift on a shared machine hits both.
            let mut totals = [Outcome::empty(), Outcome::empty(), Outcome::empty()];
            let mut ratios = Vec::new();
            let mut combined_ratios = Vec::new();
            let mut vs_limit = Vec::new();
            let mut peer_rounds = PeerRounds::default();
            for round in 0..args.rounds.max(1) {
                let mut this_round = [0.0f64; 3];
                let mut this_hold_ms = 0.0;
                let mut order = [Mode::Optimistic, Mode::Pessimistic, Mode::Combined];
                order.rotate_left(round % 3);
                if peer && round % 2 == 1 {
                    peer_rounds.pgbench.push(
                        pgbench_peer(args, db, &work_dir, round, writers, commits, hold).await?,
                    );
                }
                for mode in order {
                    let pool = db.pool(writers)?;
                    let setup = Setup {
                        store: PgEventStore::with_queue(PgDistributedLock::from_pool(pool.clone())),
                        retry,
                        hold,
                        random_ids: args.random_event_ids,
                        via: Via::Handwritten,
                        driver: Driver::Pool,
                    };
                    warm_up(&pool, writers).await?;
                    if peer && mode == Mode::Pessimistic {
                        peer_rounds
                            .round_trip_ms
                            .push(mean_round_trip_ms(&pool, args.floor_samples).await?);
                    }
                    let outcome = scenario(
                        &pool,
                        &setup,
                        writers,
                        heat,
                        mode,
                        args.seed_events,
                        commits,
                    )
                    .await?;
                    pool.close();
                    this_round[mode as usize] = outcome.commits_per_sec();
                    if mode == Mode::Pessimistic {
                        this_hold_ms = outcome.hold_ms_mean();
                    }
                    if mode == Mode::Combined && outcome.holds > 0 {
                        // One aggregate's ceiling: 1 / the time one decision takes.
                        let limit = 1000.0 / outcome.hold_ms_mean().max(f64::EPSILON);
                        vs_limit.push(outcome.commits_per_sec() / limit);
                    }
                    totals[mode as usize].merge(&outcome);
                }
                if peer && round % 2 == 0 {
                    peer_rounds.pgbench.push(
                        pgbench_peer(args, db, &work_dir, round, writers, commits, hold).await?,
                    );
                }
                if this_round[0] > 0.0 {
                    ratios.push(this_round[1] / this_round[0]);
                    combined_ratios.push(this_round[2] / this_round[0]);
                }
                if peer {
                    peer_rounds.pessimistic.push(this_round[1]);
                    peer_rounds.hold_ms.push(this_hold_ms);
                }
            }
            let median_ratio = median_if_any(&ratios);
            let combined_ratio = median_if_any(&combined_ratios);
            for mode in [Mode::Optimistic, Mode::Pessimistic, Mode::Combined] {
                let rt_pool = relayed_pool(writers)?;
                let rt_setup = Setup {
                    store: PgEventStore::with_queue(PgDistributedLock::from_pool(rt_pool.clone())),
                    retry,
                    hold,
                    random_ids: args.random_event_ids,
                    via: Via::Handwritten,
                    driver: Driver::Pool,
                };
                // Warm the pool up (connection start-up is not a command's round trip).
                warm_up(&rt_pool, writers).await?;
                let before = relay.round_trips();
                let rt = scenario(
                    &rt_pool,
                    &rt_setup,
                    writers,
                    heat,
                    mode,
                    args.seed_events,
                    args.rt_commits,
                )
                .await?;
                let round_trips = relay
                    .round_trips()
                    .saturating_sub(before + seed_round_trips(heat, writers));
                rt_pool.close();

                let outcome = &totals[mode as usize];
                let ms = |q: f64| outcome.latency_us.value_at_quantile(q) as f64 / 1000.0;
                println!(
                    "| {writers} | {} | {} | {:.0} | {:.2} | {:.2} | {} | {:.2} | {:.2} | {:.3} | {:.2} | {:.2} |",
                    heat.label(),
                    mode.label(),
                    outcome.commits_per_sec(),
                    outcome.per_commit(outcome.attempts - outcome.commits as u64),
                    outcome.per_commit(outcome.conflicts),
                    outcome.failed,
                    ms(0.5),
                    ms(0.99),
                    outcome.hold_ms_mean(),
                    round_trips as f64 / rt.commits.max(1) as f64,
                    round_trips as f64 / rt.attempts.max(1) as f64,
                );
                let key = format!("{}{writers}_{}", heat.label(), mode.key());
                headline.scenario_lines.push(format!(
                    "{key}_commits_per_s={:.1}",
                    outcome.commits_per_sec()
                ));
                headline
                    .scenario_lines
                    .push(format!("{key}_p99_ms={:.2}", ms(0.99)));
            }
            println!(
                "|  |  | *pessimistic / optimistic, median of {} rounds* | **{}** |  |  |  |  |  |  |  |  |",
                ratios.len(),
                median_ratio.map_or("n/a".to_owned(), |r| format!("{r:.2}"))
            );
            println!(
                "|  |  | *combined / optimistic, median of {} rounds* | **{}** |  |  |  |  |  |  |  |  |",
                combined_ratios.len(),
                combined_ratio.map_or("n/a".to_owned(), |r| format!("{r:.2}"))
            );
            // Where the tail comes from: each writer's first command against the rest, and
            // the phases of the slowest attempts.
            for mode in [Mode::Optimistic, Mode::Pessimistic, Mode::Combined] {
                let o = &totals[mode as usize];
                if let Some(row) = Steps::slow_row(
                    &format!("{writers} {} {}", heat.label(), mode.label()),
                    &o.steps,
                ) {
                    slow_rows.push_str(&row);
                }
                let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
                first_rows.push_str(&format!(
                    "| {writers} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} |\n",
                    heat.label(),
                    mode.label(),
                    ms(&o.first_latency_us, 0.5),
                    ms(&o.first_latency_us, 1.0),
                    ms(&o.later_latency_us, 0.99),
                    ms(&o.latency_us, 0.99),
                ));
            }
            match (heat, writers) {
                (Heat::Hot, 32) => {
                    headline.hot32 = median_ratio;
                    headline.hot32_conflicts = Some(totals[Mode::Pessimistic as usize].conflicts);
                    let p99 = |m: Mode| totals[m as usize].latency_us.value_at_quantile(0.99);
                    let optimistic_p99 = p99(Mode::Optimistic);
                    if optimistic_p99 > 0 {
                        headline.p99_ratio =
                            Some(p99(Mode::Pessimistic) as f64 / optimistic_p99 as f64);
                    }
                    let pessimistic_p99 = p99(Mode::Pessimistic);
                    if pessimistic_p99 > 0 {
                        headline.combined_p99_vs_pessimistic =
                            Some(p99(Mode::Combined) as f64 / pessimistic_p99 as f64);
                    }
                    headline.combined_vs_optimistic = combined_ratio;
                    headline.combined_vs_limit = median_if_any(&vs_limit);
                    headline.combined_conflicts = Some(totals[Mode::Combined as usize].conflicts);
                    let pessimistic = &totals[Mode::Pessimistic as usize];
                    headline.hold_ms = Some(pessimistic.hold_ms_mean());
                    let peer_table = peer_rounds.report(&mut headline);
                    headline.tables.push(peer_table);
                    headline
                        .tables
                        .push(pessimistic.section.table(pessimistic.commits_per_sec()));
                    headline.tables.push(
                        server_view(db, args.seed_events + commits / 2, args.floor_samples).await?,
                    );
                }
                (Heat::Cold, 16) => {
                    headline.cold16 = median_ratio;
                    headline.cold16_combined = combined_ratio;
                }
                _ => {}
            }
        }
    }
    drop(relay);
    headline.tables.push(format!(
        "| writers | streams | mode | each writer's first command: p50 ms | its max ms | p99 ms \
         of the other commands | p99 ms of all |\n|---:|---|---|---:|---:|---:|---:|\n{first_rows}"
    ));
    headline.tables.push(format!(
        "| writers, streams, mode | attempts | which | BEGIN ms | load ms | decide + hold ms | \
         append + COMMIT ms | total ms |\n|---|---:|---|---:|---:|---:|---:|---:|\n{slow_rows}\
         (means per attempt, client clock; committed attempts of the optimistic and pessimistic \
         modes; the slowest 1 % by total against all)"
    ));
    if args.append_passes > 0 {
        let cost = append_cost::measure(
            &args.pgbench,
            db,
            &work_dir,
            args.append_events,
            args.append_passes,
        )
        .await?;
        headline.tables.push(cost.table(args.append_events));
        (headline.append_server_us, headline.plain_insert_server_us) = cost.medians();
        headline.append_vs_plain_insert = cost.ratio();
    }
    std::fs::remove_dir_all(&work_dir).ok();
    let mut runner_lines = Vec::new();
    if args.runner_rounds > 0 {
        let base = Setup {
            store: PgEventStore::with_queue(LockQueue::new()),
            retry,
            hold,
            random_ids: false,
            via: Via::Handwritten,
            driver: Driver::Pool,
        };
        runner_lines.extend(
            runner::runner_vs_handwritten(
                db,
                &base,
                args.seed_events,
                args.commits,
                args.runner_rounds,
            )
            .await?,
        );
    }
    if args.snapshot_rounds > 0 {
        runner_lines
            .extend(runner::snapshots(db, args.snapshot_rounds, args.snapshot_block.max(1)).await?);
    }
    for table in &headline.tables {
        println!();
        print!("{table}");
    }
    println!();
    headline.print();
    for line in runner_lines {
        println!("{line}");
    }
    Ok(())
}

/// The headline figures, filled in as their scenarios run.
#[derive(Default)]
struct Headline {
    hot32: Option<f64>,
    cold16: Option<f64>,
    hot32_conflicts: Option<u64>,
    vs_floor: Option<f64>,
    vs_pgbench: Option<f64>,
    p99_ratio: Option<f64>,
    hold_ms: Option<f64>,
    combined_vs_limit: Option<f64>,
    combined_vs_optimistic: Option<f64>,
    combined_p99_vs_pessimistic: Option<f64>,
    combined_conflicts: Option<u64>,
    cold16_combined: Option<f64>,
    /// Server time per appended event, µs (median over passes), and per plain insert.
    append_server_us: Option<f64>,
    plain_insert_server_us: Option<f64>,
    /// Median over passes of append ÷ plain insert server time.
    append_vs_plain_insert: Option<f64>,
    /// Per scenario and mode: `<hot|cold><writers>_<mode>_commits_per_s` (over all rounds)
    /// and `…_p99_ms`, printed before the headline figures.
    scenario_lines: Vec<String>,
    /// Tables printed after the main one (hot 32: floor and peer, section timeline).
    tables: Vec<String>,
}

impl Headline {
    fn print(&self) {
        let figure =
            |r: Option<f64>, digits: usize| r.map_or("n/a".to_owned(), |r| format!("{r:.digits$}"));
        for line in &self.scenario_lines {
            println!("{line}");
        }
        println!("hot32_pessimistic_vs_optimistic={}", figure(self.hot32, 2));
        println!(
            "cold16_pessimistic_vs_optimistic={}",
            figure(self.cold16, 2)
        );
        println!(
            "hot32_pessimistic_conflicts={}",
            self.hot32_conflicts
                .map_or("n/a".to_owned(), |c| c.to_string())
        );
        println!("hot32_pessimistic_vs_floor={}", figure(self.vs_floor, 2));
        println!(
            "hot32_pessimistic_vs_pgbench={}",
            figure(self.vs_pgbench, 2)
        );
        println!(
            "hot32_p99_pessimistic_vs_optimistic={}",
            figure(self.p99_ratio, 2)
        );
        println!("hold_ms_mean={}", figure(self.hold_ms, 3));
        println!(
            "hot32_combined_vs_decision_limit={}",
            figure(self.combined_vs_limit, 2)
        );
        println!(
            "hot32_combined_vs_optimistic={}",
            figure(self.combined_vs_optimistic, 2)
        );
        println!(
            "hot32_combined_p99_vs_pessimistic={}",
            figure(self.combined_p99_vs_pessimistic, 2)
        );
        println!(
            "hot32_combined_conflicts={}",
            self.combined_conflicts
                .map_or("n/a".to_owned(), |c| c.to_string())
        );
        println!(
            "cold16_combined_vs_optimistic={}",
            figure(self.cold16_combined, 2)
        );
        println!("append_server_us={}", figure(self.append_server_us, 1));
        println!(
            "plain_insert_server_us={}",
            figure(self.plain_insert_server_us, 1)
        );
        println!(
            "append_server_us_vs_plain_insert={}",
            figure(self.append_vs_plain_insert, 2)
        );
    }
}

/// What the hot 32 rounds measured besides the two modes: per round, the pessimistic
/// commits/s, its mean hold, the mean round trip before it, and pgbench's commits/s.
#[derive(Default)]
struct PeerRounds {
    pessimistic: Vec<f64>,
    hold_ms: Vec<f64>,
    round_trip_ms: Vec<f64>,
    pgbench: Vec<f64>,
}

impl PeerRounds {
    /// The floor and peer table; fills in the headline's medians of per-round ratios.
    fn report(&self, headline: &mut Headline) -> String {
        let mut out = String::from(
            "| hot 32, round | pessimistic commits/s | hold ms | SELECT 1 ms | floor commits/s | \
             vs floor | pgbench commits/s | vs pgbench |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        let (mut vs_floor, mut vs_pgbench) = (Vec::new(), Vec::new());
        for (round, &pessimistic) in self.pessimistic.iter().enumerate() {
            let hold = self.hold_ms.get(round).copied().unwrap_or(0.0);
            let rt = self.round_trip_ms.get(round).copied().unwrap_or(0.0);
            let floor = 1000.0 / (hold + rt).max(f64::EPSILON);
            let pgbench = self.pgbench.get(round).copied().unwrap_or(0.0);
            vs_floor.push(pessimistic / floor);
            if pgbench > 0.0 {
                vs_pgbench.push(pessimistic / pgbench);
            }
            out.push_str(&format!(
                "| {round} | {pessimistic:.0} | {hold:.3} | {rt:.3} | {floor:.0} | {:.2} | \
                 {pgbench:.0} | {:.2} |\n",
                pessimistic / floor,
                pessimistic / pgbench.max(f64::EPSILON)
            ));
        }
        headline.vs_floor = median_if_any(&vs_floor);
        headline.vs_pgbench = median_if_any(&vs_pgbench);
        out
    }
}

/// The section's statements seen from one uncontended writer on a stream of `events` events
/// (the hot runs' mean size): each step's latency, and what is left after one `SELECT 1`
/// round trip — the server's (and the driver's) work.
async fn server_view(db: &BenchDatabase, events: usize, samples: usize) -> Result<String> {
    let samples = samples.clamp(1, 200);
    let pool = db.pool(1)?;
    warm_up(&pool, 1).await?;
    let store = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let sku = Uuid::now_v7();
    // Grows by one event per sample: seed so that the mean size is `events`.
    seed(
        &pool,
        &store,
        &[sku],
        events.saturating_sub(samples / 2).max(1),
    )
    .await?;
    let stream = StreamId::from_uuid(sku);
    let key = aggregate_key(&AggregateType::new(AGGREGATE)?, sku);
    let round_trip_ms = mean_round_trip_ms(&pool, samples).await?;
    let (mut begin, mut lock_load, mut append_commit) = (0.0, 0.0, 0.0);
    for _ in 0..samples {
        let t0 = Instant::now();
        let tx = PgTransaction::begin(&pool).await?;
        let t1 = Instant::now();
        let loaded = store.load_locked(&tx, stream, &key, None).await?;
        let t2 = Instant::now();
        let event = NewEvent::new("Reserved", serde_json::json!({ "quantity": 1 }))?;
        store
            .append_at_commit(
                &tx,
                stream,
                ExpectedVersion::Exact(loaded.len() as u64),
                &[event],
            )
            .await?;
        tx.commit().await?;
        let t3 = Instant::now();
        begin += (t1 - t0).as_secs_f64() * 1e6;
        lock_load += (t2 - t1).as_secs_f64() * 1e6;
        append_commit += (t3 - t2).as_secs_f64() * 1e6;
    }
    pool.close();
    let n = samples as f64;
    let rt = round_trip_ms * 1000.0;
    let mut out = format!(
        "| one writer, no contention, stream of ~{events} events | latency µs | minus one \
         SELECT 1 round trip ({rt:.0} µs): server + driver work µs |\n|---|---:|---:|\n"
    );
    for (step, value) in [
        ("BEGIN", begin / n),
        (
            "lock + load (`lockstep_lock_and_load`), decoded",
            lock_load / n,
        ),
        ("append + COMMIT, pipelined", append_commit / n),
    ] {
        out.push_str(&format!("| {step} | {value:.0} | {:.0} |\n", value - rt));
    }
    Ok(out)
}

/// The mean round trip of `SELECT 1` on one of `pool`'s connections, in milliseconds.
async fn mean_round_trip_ms(pool: &Pool, samples: usize) -> Result<f64> {
    let client = pool.get().await.context("a connection for the floor")?;
    let statement = client
        .prepare("SELECT 1")
        .await
        .context("preparing SELECT 1")?;
    let samples = samples.max(1);
    let started = Instant::now();
    for _ in 0..samples {
        client
            .query_one(&statement, &[])
            .await
            .context("SELECT 1")?;
    }
    Ok(started.elapsed().as_secs_f64() * 1000.0 / samples as f64)
}

/// The pgbench peer of hot 32: `writers` clients run the pessimistic command's statements on a
/// fresh stream of `--seed-events` events until about `commits` commits; returns commits/s.
async fn pgbench_peer(
    args: &Args,
    db: &BenchDatabase,
    work_dir: &std::path::Path,
    round: usize,
    writers: usize,
    commits: usize,
    hold: Duration,
) -> Result<f64> {
    let pool = db.pool(2)?;
    let store = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let sku = Uuid::now_v7();
    seed(&pool, &store, &[sku], args.seed_events).await?;
    pool.close();
    let key = aggregate_key(&AggregateType::new(AGGREGATE)?, sku).advisory_key();
    // The same functions lockstep calls (`lockstep_lock_and_load`, `lockstep_append_events`),
    // with the expected version left to the function (under the lock it is the same check).
    let script = format!(
        "BEGIN;\n\
         SELECT refused_isolation, event_id, version, event_type, payload, recorded_at \
         FROM lockstep_lock_and_load(:key, NULL, :stream);\n\
         \\sleep {} us\n\
         \\startpipeline\n\
         SELECT lockstep_append_events(:stream, NULL, ARRAY[gen_random_uuid()], \
         ARRAY['Reserved'], ARRAY['{{\"quantity\": 1}}'::jsonb]);\n\
         COMMIT;\n\
         \\endpipeline\n",
        hold.as_micros()
    );
    let defines = [("key", key.to_string()), ("stream", sku.to_string())];
    let measured = pgbench::run(
        &args.pgbench,
        db,
        work_dir,
        &format!("hot{writers}_r{round}"),
        &PgbenchRun {
            script: &script,
            clients: writers,
            limit: pgbench::Limit::Transactions(commits.div_ceil(writers.max(1))),
            defines: &defines,
        },
    )
    .await?;
    Ok(measured.ops_per_sec())
}

/// Seeds fresh streams, runs `writers` writers until `commits` commands committed.
async fn scenario(
    pool: &Pool,
    setup: &Setup,
    writers: usize,
    heat: Heat,
    mode: Mode,
    seed_events: usize,
    commits: usize,
) -> Result<Outcome> {
    let via = setup.via;
    let streams: Vec<Uuid> = match heat {
        Heat::Hot => vec![Uuid::now_v7()],
        Heat::Cold => (0..writers).map(|_| Uuid::now_v7()).collect(),
    };
    seed(pool, &setup.store, &streams, seed_events).await?;

    let committed = Arc::new(AtomicUsize::new(0));
    let attempts = Arc::new(AtomicU64::new(0));
    let conflicts = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let holds = Arc::new(Holds::default());
    let decider = || BenchDecider {
        ty: AggregateType::new(AGGREGATE).unwrap_or_else(|e| unreachable!("{e}")),
        hold: setup.hold,
        holds: Arc::clone(&holds),
        snapshot_every: None,
    };
    let runner = (via == Via::Runner).then(|| {
        let db = PgDatabase::from_pool(pool.clone());
        let store = PgEventStore::new(&db);
        let mode = match mode {
            Mode::Optimistic => lockstep_command::Mode::Optimistic,
            Mode::Pessimistic => lockstep_command::Mode::Locked,
            Mode::Combined => lockstep_command::Mode::Combined,
        };
        let options = RunnerOptions::new(mode)
            .retry(setup.retry)
            .lock_timeout(None);
        CommandRunner::with_options(db, store, decider(), options)
    });
    let combiner = (via == Via::Handwritten && mode == Mode::Combined).then(|| {
        let db = PgDatabase::from_pool(pool.clone());
        let store = PgEventStore::new(&db);
        Combiner::new(db, store, decider())
    });
    let started = Instant::now();
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let sku = streams[w % streams.len()];
            let (pool, setup) = (pool.clone(), setup.clone());
            let (combiner, runner) = (combiner.clone(), runner.clone());
            let retry = setup.retry;
            let (committed, attempts, conflicts, failed, holds) = (
                Arc::clone(&committed),
                Arc::clone(&attempts),
                Arc::clone(&conflicts),
                Arc::clone(&failed),
                Arc::clone(&holds),
            );
            tokio::spawn(async move {
                let (mut latency, mut first, mut later) =
                    (new_histogram(), new_histogram(), new_histogram());
                while committed.load(Ordering::Relaxed) < commits {
                    let t0 = Instant::now();
                    let result = match (&combiner, &runner) {
                        (_, Some(runner)) => match runner.handle(sku, ()).await {
                            Ok(done) => {
                                attempts.fetch_add(u64::from(done.attempts()), Ordering::Relaxed);
                                Ok(())
                            }
                            Err(e) => {
                                attempts.fetch_add(1, Ordering::Relaxed);
                                if e.kind() == Some(ErrorKind::Conflict) {
                                    conflicts.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(())
                            }
                        },
                        (Some(combiner), None) => {
                            attempts.fetch_add(1, Ordering::Relaxed);
                            match combiner.submit(sku, ()).await {
                                Ok(_) => Ok(()),
                                Err(e) => {
                                    if e.kind() == Some(ErrorKind::Conflict) {
                                        conflicts.fetch_add(1, Ordering::Relaxed);
                                    }
                                    Err(())
                                }
                            }
                        }
                        (None, None) => retry
                            .run(tokio::time::sleep, |_| {
                                attempts.fetch_add(1, Ordering::Relaxed);
                                Box::pin(command_via(&pool, &setup, sku, mode, &conflicts, &holds))
                            })
                            .await
                            .map_err(drop),
                    };
                    match result {
                        Ok(()) => {
                            committed.fetch_add(1, Ordering::Relaxed);
                            let us = t0.elapsed().as_micros().max(1) as u64;
                            latency.saturating_record(us);
                            if first.is_empty() {
                                first.saturating_record(us);
                            } else {
                                later.saturating_record(us);
                            }
                        }
                        Err(_) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                (latency, first, later)
            })
        })
        .collect();
    let (mut latency_us, mut first_latency_us, mut later_latency_us) =
        (new_histogram(), new_histogram(), new_histogram());
    for task in tasks {
        let (all, first, later) = task.await.context("writer task")?;
        let _ = latency_us.add(&all);
        let _ = first_latency_us.add(&first);
        let _ = later_latency_us.add(&later);
    }
    let elapsed = started.elapsed();
    let steps = std::mem::take(
        &mut *holds
            .timeline
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    Ok(Outcome {
        commits: committed.load(Ordering::Relaxed),
        attempts: attempts.load(Ordering::Relaxed),
        conflicts: conflicts.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        elapsed,
        latency_us,
        first_latency_us,
        later_latency_us,
        hold_us: holds.total_us.load(Ordering::Relaxed),
        holds: holds.count.load(Ordering::Relaxed),
        section: if mode == Mode::Pessimistic {
            Section::of(&steps)
        } else {
            Section::default()
        },
        steps,
    })
}

/// The measured holds of a scenario (their sum in µs and their count), and the steps of every
/// committed optimistic and pessimistic attempt.
#[derive(Default)]
struct Holds {
    total_us: AtomicU64,
    count: AtomicU64,
    timeline: std::sync::Mutex<Vec<Steps>>,
}

impl Steps {
    /// From `BEGIN` (the pool checkout and `PgTransaction::begin`) to the append + `COMMIT`
    /// reply, µs: `BEGIN`; the load (or lock-and-load); the decision (fold, the hand-off to a
    /// blocking thread, the hold and back); the append with the `COMMIT`.
    fn phases_us(&self) -> [u64; 4] {
        let us = |a: Instant, b: Instant| b.saturating_duration_since(a).as_micros() as u64;
        [
            us(self.started, self.begun),
            us(self.begun, self.loaded),
            us(self.loaded, self.held),
            us(self.held, self.committed),
        ]
    }

    fn total_us(&self) -> u64 {
        self.phases_us().iter().sum()
    }

    /// One table row: the mean phases (ms) of the slowest 1 % of the attempts against the
    /// mean of all of them — where a tail comes from.
    fn slow_row(label: &str, steps: &[Steps]) -> Option<String> {
        if steps.is_empty() {
            return None;
        }
        let mut sorted = steps.to_vec();
        sorted.sort_by_key(Steps::total_us);
        let slow = &sorted[sorted.len() - sorted.len().div_ceil(100)..];
        let cells = |set: &[Steps]| {
            let mut sums = [0u64; 5];
            for s in set {
                let phases = s.phases_us();
                for (sum, us) in sums.iter_mut().zip(phases.iter().chain([&s.total_us()])) {
                    *sum += us;
                }
            }
            sums.iter()
                .map(|sum| format!("{:.2}", *sum as f64 / set.len() as f64 / 1000.0))
                .collect::<Vec<_>>()
                .join(" | ")
        };
        Some(format!(
            "| {label} | {} | slowest {} | {} |\n| {label} | {} | all | {} |\n",
            steps.len(),
            slow.len(),
            cells(slow),
            steps.len(),
            cells(&sorted),
        ))
    }
}

/// Where a serialized section's time goes, summed over commands (µs, client clock): from the
/// lock-and-load reply to the decision (decoding and folding the events), the hold, from the
/// end of the hold to the append + COMMIT reply (one round trip and the server's append and
/// commit), and from that reply to the next holder's load reply (the hand-off: the lock
/// granted to the next backend, its load, the reply, the wake-up of its task).
#[derive(Debug, Default, Clone, Copy)]
struct Section {
    commands: u64,
    decide_us: f64,
    hold_us: f64,
    commit_us: f64,
    handoffs: u64,
    handoff_us: f64,
}

impl Section {
    /// Sums one run's commands, in the order they held the lock.
    fn of(timeline: &[Steps]) -> Section {
        let mut steps = timeline.to_vec();
        steps.sort_by_key(|s| s.loaded);
        let us = |a: Instant, b: Instant| {
            // Signed: the next holder's reply can arrive just before this one's.
            if b >= a {
                b.duration_since(a).as_secs_f64() * 1e6
            } else {
                -(a.duration_since(b).as_secs_f64() * 1e6)
            }
        };
        let mut section = Section::default();
        for (k, s) in steps.iter().enumerate() {
            section.commands += 1;
            section.decide_us += us(s.loaded, s.decided);
            section.hold_us += us(s.decided, s.held);
            section.commit_us += us(s.held, s.committed);
            if let Some(next) = steps.get(k + 1) {
                section.handoffs += 1;
                section.handoff_us += us(s.committed, next.loaded);
            }
        }
        section
    }

    fn merge(&mut self, other: &Section) {
        self.commands += other.commands;
        self.decide_us += other.decide_us;
        self.hold_us += other.hold_us;
        self.commit_us += other.commit_us;
        self.handoffs += other.handoffs;
        self.handoff_us += other.handoff_us;
    }

    /// The table of mean step times, µs.
    fn table(&self, commits_per_sec: f64) -> String {
        let n = self.commands.max(1) as f64;
        let (decide, hold, commit) = (self.decide_us / n, self.hold_us / n, self.commit_us / n);
        let handoff = self.handoff_us / self.handoffs.max(1) as f64;
        let mut out = String::new();
        out.push_str("| step of the serialized section (client clock) | mean µs |\n|---|---:|\n");
        for (step, value) in [
            (
                "lock+load reply → decision (decode and fold the events)",
                decide,
            ),
            ("hold (the simulated decision, measured)", hold),
            (
                "append + COMMIT sent → reply (1 round trip + server append, commit, unlock)",
                commit,
            ),
            (
                "COMMIT reply → next holder's load reply (lock grant, load, reply, wake-up)",
                handoff,
            ),
            ("sum: one section", decide + hold + commit + handoff),
        ] {
            out.push_str(&format!("| {step} | {value:.0} |\n"));
        }
        out.push_str(&format!(
            "| measured: 1 / commits per second | {:.0} |\n",
            1e6 / commits_per_sec.max(f64::EPSILON)
        ));
        out
    }
}

/// When one committed attempt's steps ended, on the client's clock.
#[derive(Debug, Clone, Copy)]
struct Steps {
    /// The attempt began (before the pool checkout).
    started: Instant,
    /// `PgTransaction::begin` returned.
    begun: Instant,
    /// `load` / `load_locked` returned (the lock is held).
    loaded: Instant,
    /// The events were folded (the decision is known).
    decided: Instant,
    /// The hold ended.
    held: Instant,
    /// The append + COMMIT reply arrived (the lock is released).
    committed: Instant,
}

/// Holds `hold` — the simulated decision — and returns how long it really lasted. A
/// blocking-pool thread sleeps it with the kernel's high-resolution timer: tokio's timer wheel
/// has millisecond slots, so `tokio::time::sleep(1 ms)` lasts 1–2 ms, and a busy-wait would
/// burn the cores the server needs (32 optimistic writers hold at once).
async fn hold_for(hold: Duration) -> Duration {
    let started = Instant::now();
    if !hold.is_zero() {
        // A failed join (the runtime shutting down) only ends the hold early.
        let _ = tokio::task::spawn_blocking(move || std::thread::sleep(hold)).await;
    }
    started.elapsed()
}

/// [`command`] on the setup's driver.
async fn command_via(
    pool: &Pool,
    setup: &Setup,
    sku: Uuid,
    mode: Mode,
    conflicts: &AtomicU64,
    holds: &Holds,
) -> lockstep_core::Result<()> {
    match &setup.driver {
        Driver::Pool => {
            command(
                PgTransaction::begin(pool),
                setup,
                sku,
                mode,
                conflicts,
                holds,
            )
            .await
        }
        Driver::TokioPostgres(db) => command(db.begin(), setup, sku, mode, conflicts, holds).await,
        Driver::Sqlx(db) => command(db.begin(), setup, sku, mode, conflicts, holds).await,
    }
}

/// One unit of work: begin, (lock,) load, decide (fold and hold), append + commit — in one
/// round trip on tokio-postgres, which holds the append back for the `COMMIT`; on sqlx
/// `append_at_commit` appends at once.
async fn command<Tx>(
    begin: impl Future<Output = lockstep_core::Result<Tx>>,
    setup: &Setup,
    sku: Uuid,
    mode: Mode,
    conflicts: &AtomicU64,
    holds: &Holds,
) -> lockstep_core::Result<()>
where
    Tx: lockstep_core::Transaction,
    PgEventStore: EventStore<Tx>,
{
    let (store, hold, random_ids) = (&setup.store, setup.hold, setup.random_ids);
    let stream = StreamId::from_uuid(sku);
    let started = Instant::now();
    let tx = begin.await?;
    let begun = Instant::now();
    let events = match mode {
        Mode::Optimistic => store.load(&tx, stream).await,
        Mode::Pessimistic | Mode::Combined => {
            let ty = AggregateType::new(AGGREGATE)?;
            store
                .load_locked(&tx, stream, &aggregate_key(&ty, sku), None)
                .await
        }
    };
    let events = match events {
        Ok(events) => events,
        Err(e) => {
            rollback(tx, "a load that failed").await;
            return Err(e);
        }
    };
    let loaded = Instant::now();
    // Decide: fold the stream (units reserved so far) and reserve one more.
    let reserved: u64 = events
        .iter()
        .map(|e| {
            e.payload
                .get("quantity")
                .and_then(|q| q.as_u64())
                .unwrap_or(0)
        })
        .sum();
    let decided = Instant::now();
    let held = hold_for(hold).await;
    let held_until = Instant::now();
    holds
        .total_us
        .fetch_add(held.as_micros() as u64, Ordering::Relaxed);
    holds.count.fetch_add(1, Ordering::Relaxed);
    let mut event = NewEvent::new(
        "Reserved",
        serde_json::json!({ "quantity": 1, "reserved_before": reserved }),
    )?;
    if random_ids {
        event = event.with_id(Uuid::new_v4())?;
    }
    let expected = ExpectedVersion::Exact(events.len() as u64);
    if let Err(e) = store
        .append_at_commit(&tx, stream, expected, &[event])
        .await
    {
        rollback(tx, "an append that failed").await;
        return Err(e);
    }
    let committed = tx.commit().await;
    match &committed {
        Err(e) if e.kind() == ErrorKind::Conflict => {
            conflicts.fetch_add(1, Ordering::Relaxed);
        }
        Ok(()) => {
            let steps = Steps {
                started,
                begun,
                loaded,
                decided,
                held: held_until,
                committed: Instant::now(),
            };
            holds
                .timeline
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(steps);
        }
        Err(_) => {}
    }
    committed
}

/// Ends a command's transaction after its statement failed: that error is the one reported. A
/// rollback that fails still ends the transaction (the connection is closed, and the server
/// rolls back; nothing of it was committed), so its error is logged at `debug`. Awaited rather
/// than left to the guard's drop, which rolls back in the background and may close the
/// connection instead of pooling it.
async fn rollback(tx: impl lockstep_core::Transaction, what: &'static str) {
    if let Err(err) = tx.rollback().await {
        tracing::debug!(error = %err, transaction = what, "rolling back failed; the transaction ended all the same");
    }
}

async fn seed(pool: &Pool, store: &PgEventStore, streams: &[Uuid], n: usize) -> Result<()> {
    for &sku in streams {
        let events: Vec<NewEvent> = (0..n)
            .map(|i| NewEvent::new("Stocked", serde_json::json!({ "batch": i, "units": 1000 })))
            .collect::<lockstep_core::Result<_>>()?;
        let tx = PgTransaction::begin(pool).await?;
        store
            .append(
                &tx,
                StreamId::from_uuid(sku),
                ExpectedVersion::NoStream,
                &events,
            )
            .await?;
        tx.commit().await?;
    }
    Ok(())
}

/// Round trips the seeding of a scenario costs per stream: the append (with the `BEGIN` that
/// travels with it, ADR 0024) and the commit.
fn seed_round_trips(heat: Heat, writers: usize) -> u64 {
    let streams = match heat {
        Heat::Hot => 1,
        Heat::Cold => writers as u64,
    };
    2 * streams
}

/// Opens every connection of the pool once.
async fn warm_up(pool: &Pool, size: usize) -> Result<()> {
    let mut held = Vec::with_capacity(size);
    for _ in 0..size {
        held.push(pool.get().await.context("warming the pool up")?);
    }
    Ok(())
}

/// The benchmark's command as a decider, for the combined mode: the same fold (units reserved
/// so far) and the same measured hold per decision as the other modes' command.
struct BenchDecider {
    ty: AggregateType,
    hold: Duration,
    holds: Arc<Holds>,
    /// A snapshot every this many events (`None`: never; module `runner`).
    snapshot_every: Option<u32>,
}

impl Decider for BenchDecider {
    type State = u64;
    type Command = ();
    type Event = u64;
    type Error = std::convert::Infallible;

    fn aggregate_type(&self) -> &AggregateType {
        &self.ty
    }

    fn initial_state(&self, _id: Uuid) -> u64 {
        0
    }

    async fn decide(&self, _reserved: &u64, _: &()) -> Result<Vec<u64>, std::convert::Infallible> {
        let held = hold_for(self.hold).await;
        self.holds
            .total_us
            .fetch_add(held.as_micros() as u64, Ordering::Relaxed);
        self.holds.count.fetch_add(1, Ordering::Relaxed);
        Ok(vec![1])
    }

    fn evolve(&self, reserved: u64, quantity: &u64) -> u64 {
        reserved + quantity
    }

    fn encode(&self, quantity: &u64) -> lockstep_core::Result<NewEvent> {
        NewEvent::new("Reserved", serde_json::json!({ "quantity": quantity }))
    }

    fn decode(&self, event: &RecordedEvent) -> lockstep_core::Result<u64> {
        // The same fold as the other modes' command: units reserved so far.
        Ok(event
            .payload
            .get("quantity")
            .and_then(|q| q.as_u64())
            .unwrap_or(0))
    }
    fn snapshots(&self) -> Option<lockstep_core::SnapshotPolicy<u64>> {
        self.snapshot_every.map(lockstep_core::SnapshotPolicy::json)
    }
}
