//! `worker`: the perspective worker (`lockstep_worker::PerspectiveWorker` on
//! `PgPerspectiveStore`, claiming **batches**: ADR 0012) against the floor of the same data
//! movement done by one set-based SQL statement, in the same run, on the same database; then
//! what batches are for (I/O-bound perspectives on several instances, long queues, pairs that
//! cannot be served), rewinds and the keepalive.
//!
//! - **catch-up**: `--streams` streams × `--events-per-stream` events (default 1 000 × 100 =
//!   100 000) are appended with no perspective registered; each round then registers a fresh
//!   perspective (its registration enqueues one work row per event: set-up, not timed) and
//!   times draining that queue — by 1 worker instance, by 2 instances (each with a pool and a
//!   locker of its own), and by one SQL statement that deletes the work rows, folds the events
//!   per stream (`jsonb_agg(payload->'n' ORDER BY event_id)`), upserts the states and advances
//!   the cursors. The perspective's state is the same list of numbers on every side. Each
//!   `--concurrency` value (`WorkerOptions::concurrency`, default 1 and 4) is a pair of sides (1
//!   and 2 instances); the order of the sides rotates per round; ratios are medians over rounds
//!   of per-round ratios, the headline uses the first (1: the worker as shipped). An instance
//!   stops when a cycle claimed nothing **and** the perspective has no work row left (a cycle
//!   that finds nothing while another instance holds the rest waits a poll interval, as
//!   `PerspectiveWorker::run` does). Where the time goes: the machine's CPU busy share while
//!   each side ran (`/proc/stat`), the server's CPU time per event (`server_cpu`: the benchmark
//!   database's backends, from `/proc/<pid>/stat`), the mean latency of a `claim_batch` on the
//!   full queue (rolled back), and the server time of the claim and commit functions during the
//!   first side (`pg_stat_user_functions`, `track_functions = 'pl'` on the benchmark database).
//! - **I/O-bound** (`io_bound`): a perspective that waits `--io-wait-ms` (5 ms) per
//!   `apply_while` call outside the database — once per pair per batch — caught up by 1, 2 and
//!   4 instances; events/s ratios, and how evenly 4 instances share the work.
//! - **claim latency** (`claims`): the mean latency of one `claim_batch` with 10 000 and with
//!   1 000 000 queued work rows of the claimed perspective (two databases side by side).
//! - **starved** (`starved`): healthy pairs caught up next to pairs that fail until parked and
//!   work of a registered perspective that no worker runs, against the healthy pairs alone.
//! - **rewind** (a database of its own, so its 40 000 events do not join the catch-up): two
//!   streams of `--rewind-events` events (20 000), applied by the worker with a snapshot every
//!   100 events. Each round rewinds one stream from the event 100 before the end (restored from
//!   the snapshot just before it: 100 events replayed) and the other from the start (every
//!   event replayed), timing `PerspectiveWorker::rewind` from lease acquire to release, after
//!   `--rewind-warmup` rounds reported apart (new pooled connections warm up). Run
//!   once with a perspective of constant-size state (count and sum: the headline) and once with
//!   the list state of the catch-up (the state itself grows with the stream). Then the rewind
//!   from the snapshot step by step (`rewind_parts`: the worker's store and locker calls, each
//!   timed) to show where its time goes.
//! - **upcast** (`upcast`): the catch-up with one upcaster lifting every event against the same
//!   catch-up without, sides alternating, in one run (`catchup_upcast_vs_plain`).
//! - **blue/green** (`blue_green`): version 2 of a table perspective built over 1 000 000 events
//!   while appends go on and version 1 serves, then promoted; reads of the view checked across
//!   the switch, version 2 checked against the events, the build against a plain catch-up and
//!   version 1's lag against its lag without a build (`bluegreen_*`).
//! - **keepalive**: one `LeaseKeeper` holding `--leases` leases (1 000) for several keepalive
//!   intervals; statements per interval counted by the server (`pg_stat_database` transaction
//!   deltas of a run with `--keepalive-intervals` intervals minus a run with none: acquires,
//!   releases and connection set-up cancel out) and by the keeper (`renew_calls`).

mod blue_green;
mod claims;
mod io_bound;
mod rewind_parts;
mod server_cpu;
mod starved;
mod upcast;

use lockstep_core::perspective_store::prelude::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use lockstep_core::{
    ExpectedVersion, InstanceId, LockReason, NewEvent, Perspective, PerspectiveName,
    PerspectiveRegistry, PerspectiveStore, RecordedEvent, StreamId, StreamLockOptions,
    StreamLocker, TransactionSource,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_worker::{LeaseKeeper, Leased, PairOutcome, PerspectiveWorker, WorkerOptions};
use uuid::Uuid;

use crate::bench_db::{BenchDatabase, admin_url};
use crate::report::median;
use crate::server_stats::StatementCounter;
use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;

/// Options of the `worker` benchmark.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Args {
    /// Streams in the catch-up.
    #[arg(long, default_value_t = 1000)]
    streams: usize,
    /// Events per stream in the catch-up.
    #[arg(long, default_value_t = 100)]
    events_per_stream: usize,
    /// Catch-up rounds (each side once per round, order alternating).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Events of each rewound stream.
    #[arg(long, default_value_t = 20_000)]
    rewind_events: usize,
    /// How far from the end the snapshot rewind's trigger is, in events.
    #[arg(long, default_value_t = 100)]
    rewind_tail: usize,
    /// Rewinds per kind (the median is reported: a few ms per rewind move with the machine's
    /// load).
    #[arg(long, default_value_t = 11)]
    rewind_rounds: usize,
    /// Rewinds per kind run before the timed ones, reported apart and left out of the
    /// medians: the worker's pooled connections are new, and the first calls on a backend
    /// compile the PL/pgSQL functions and fill its caches (a rewind from a snapshot took
    /// 2.4–2.7 ms over its first 10 rounds and 2.0–2.3 ms after, 2026-12-04).
    #[arg(long, default_value_t = 6)]
    rewind_warmup: usize,
    /// Per-cycle concurrency of each worker instance (`WorkerOptions::concurrency`), one
    /// catch-up configuration per value, comma-separated; the headline uses the first.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 4])]
    concurrency: Vec<usize>,
    /// Pairs per cycle of each worker instance (`WorkerOptions::pairs_per_cycle`).
    #[arg(long, default_value_t = WorkerOptions::default().pairs_per_cycle)]
    pairs_per_cycle: usize,
    /// Leases held by the keepalive measurement.
    #[arg(long, default_value_t = 1000)]
    leases: usize,
    /// Keepalive intervals measured.
    #[arg(long, default_value_t = 10)]
    keepalive_intervals: u32,
    /// `synchronous_commit` of the benchmark databases: `off` (default: measures the worker,
    /// not this machine's WAL flush; the SQL floor is one commit) or `on`.
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    synchronous_commit: String,
    /// Streams of the I/O-bound catch-up (default: 16 batches of the default 64 pairs, so that
    /// 4 instances can split them evenly; the bound this puts on the ratios is printed).
    #[arg(long, default_value_t = 1024)]
    io_streams: usize,
    /// Events per stream of the I/O-bound catch-up.
    #[arg(long, default_value_t = 20)]
    io_events_per_stream: usize,
    /// How long the I/O-bound perspective waits per `apply_while` call (once per pair per
    /// batch), in ms.
    #[arg(long, default_value_t = 5)]
    io_wait_ms: u64,
    /// Rounds of the I/O-bound catch-up (1, 2 and 4 instances once per round).
    #[arg(long, default_value_t = 3)]
    io_rounds: usize,
    /// Streams of the short queue of the claim-latency measurement.
    #[arg(long, default_value_t = 100)]
    claim_small_streams: usize,
    /// Streams of the long queue of the claim-latency measurement.
    #[arg(long, default_value_t = 10_000)]
    claim_large_streams: usize,
    /// Events per stream of both claim-latency queues (100: 10 000 and 1 000 000 work rows).
    #[arg(long, default_value_t = 100)]
    claim_events_per_stream: usize,
    /// Claims timed per queue (after one untimed claim each).
    #[arg(long, default_value_t = 50)]
    claims: usize,
    /// Rounds the claims are split into (the queues' order alternates per claim; a ratio per
    /// round).
    #[arg(long, default_value_t = 5)]
    claim_rounds: usize,
    /// Healthy streams of the starvation measurement.
    #[arg(long, default_value_t = 200)]
    starved_streams: usize,
    /// Streams with a poison event (parked on the way) in the starvation measurement.
    #[arg(long, default_value_t = 100)]
    starved_poisoned: usize,
    /// Streams with work of the registered perspective no worker runs.
    #[arg(long, default_value_t = 100)]
    starved_unserved: usize,
    /// Events per stream of the starvation measurement.
    #[arg(long, default_value_t = 20)]
    starved_events_per_stream: usize,
    /// Position of the poison event in its stream (0: the first event; the events before it
    /// are applied and committed).
    #[arg(long, default_value_t = 0)]
    starved_poison_at: usize,
    /// Rounds of the starvation measurement (with and without, order alternating).
    #[arg(long, default_value_t = 5)]
    starved_rounds: usize,
    /// Streams of the catch-up with an upcaster.
    #[arg(long, default_value_t = 500)]
    upcast_streams: usize,
    /// Events per stream of the catch-up with an upcaster.
    #[arg(long, default_value_t = 100)]
    upcast_events_per_stream: usize,
    /// Rounds of the catch-up with an upcaster (both sides once per round, the first side
    /// alternating).
    #[arg(long, default_value_t = 6)]
    upcast_rounds: usize,
    /// Events of the blue/green measurement, spread evenly over `--blue-green-streams` (a
    /// multiple of it).
    #[arg(long, default_value_t = 1_000_000)]
    blue_green_events: usize,
    /// Streams of the blue/green measurement.
    #[arg(long, default_value_t = 10_000)]
    blue_green_streams: usize,
    /// Appends per second during the blue/green measurement (one event each).
    #[arg(long, default_value_t = 200)]
    blue_green_rate: u32,
    /// Tasks sending the blue/green appends (each to streams of its own).
    #[arg(long, default_value_t = 4)]
    blue_green_appenders: usize,
    /// Seconds of the blue/green idle phase (version 1's lag without a build).
    #[arg(long, default_value_t = 20)]
    blue_green_idle_secs: u64,
    /// Seconds the blue/green appends go on after the promotion.
    #[arg(long, default_value_t = 5)]
    blue_green_after_secs: u64,
    /// Run `ANALYZE` on the work queue and the cursors as soon as the blue/green build's
    /// registration is seen (not what the library does: shows what stale plans cost the
    /// serving instance).
    #[arg(long)]
    blue_green_analyze: bool,
    /// The versions the blue/green building instance runs.
    #[arg(long, value_enum, default_value_t = blue_green::Builder::V1AndV2)]
    blue_green_builder: blue_green::Builder,
    /// Sections to run, comma-separated (default: all). The key=value lines of the others
    /// are not printed.
    #[arg(long, value_delimiter = ',', value_enum,
          default_values_t = vec![Section::CatchUp, Section::IoBound, Section::Claims,
                                  Section::Starved, Section::Rewind, Section::Keepalive,
                                  Section::Upcast, Section::BlueGreen])]
    only: Vec<Section>,
    /// `plan_cache_mode` of the benchmark databases: `auto` (default: the server's setting
    /// is left alone), or `force_custom_plan` / `force_generic_plan` to see how the store's
    /// PL/pgSQL statements behave under either plan.
    #[arg(long, default_value = "auto",
          value_parser = ["auto", "force_custom_plan", "force_generic_plan"])]
    plan_cache_mode: String,
    /// Server to create the benchmark databases on (default: `DATABASE_URL`, else
    /// postgres://postgres@127.0.0.1:5432/postgres).
    #[arg(long)]
    database_url: Option<String>,
}

/// A part of the benchmark (`--only`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Section {
    /// Catch-up against the SQL floor.
    CatchUp,
    /// I/O-bound catch-up on 1, 2 and 4 instances.
    IoBound,
    /// Claim latency on a short and a long queue.
    Claims,
    /// Healthy pairs next to failing and unserved ones.
    Starved,
    /// Rewind from a snapshot against a full replay.
    Rewind,
    /// Keepalive statements per interval.
    Keepalive,
    /// Catch-up with one upcaster lifting every event against the same without.
    Upcast,
    /// Version 2 of a table perspective built while version 1 serves, then promoted.
    BlueGreen,
}

/// The catch-up's perspective: the list of the events' numbers, in the order applied (the SQL
/// floor builds the same list with `jsonb_agg`).
pub(crate) struct Numbers(pub(crate) String);

impl Perspective for Numbers {
    type State = Vec<i64>;
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        &self.0
    }

    fn apply(&self, state: &mut Vec<i64>, event: &RecordedEvent) -> Result<(), Self::Error> {
        state.push(event.payload["n"].as_i64().unwrap_or(-1));
        Ok(())
    }
}

/// The rewind's headline perspective: count and sum (a state of constant size).
struct Totals(String);

impl Perspective for Totals {
    type State = (u64, i64);
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        &self.0
    }

    fn apply(&self, state: &mut (u64, i64), event: &RecordedEvent) -> Result<(), Self::Error> {
        state.0 += 1;
        state.1 += event.payload["n"].as_i64().unwrap_or(0);
        Ok(())
    }
}

type PgWorker = PerspectiveWorker<PgDatabase, PgPerspectiveStore>;

/// Runs the benchmark and prints its report.
pub(crate) async fn run(args: Args) -> Result<()> {
    if args.streams == 0
        || args.events_per_stream == 0
        || args.rounds == 0
        || args.rewind_rounds == 0
        || args.leases == 0
        || args.keepalive_intervals == 0
        || args.rewind_tail == 0
        || args.concurrency.is_empty()
        || args.concurrency.contains(&0)
        || args.rewind_tail >= args.rewind_events
        || args.io_streams == 0
        || args.io_events_per_stream == 0
        || args.io_rounds == 0
        || args.claim_small_streams == 0
        || args.claim_large_streams == 0
        || args.claim_events_per_stream == 0
        || args.claim_rounds == 0
        || args.claims < args.claim_rounds
        || args.starved_streams == 0
        || args.starved_events_per_stream == 0
        || args.starved_rounds == 0
        || args.starved_poison_at >= args.starved_events_per_stream
        || args.upcast_streams == 0
        || args.upcast_events_per_stream == 0
        || args.upcast_rounds == 0
        || args.only.is_empty()
    {
        bail!(
            "counts must be positive, --rewind-tail below --rewind-events, --claims at least \
             --claim-rounds, --starved-poison-at below --starved-events-per-stream"
        );
    }
    let url = admin_url(args.database_url.clone());
    let wants = |section: Section| args.only.contains(&section);
    let mut lines = Vec::new();
    let mut keys = Vec::new();

    if wants(Section::CatchUp) || wants(Section::Keepalive) {
        let db = create(&url, &args).await?;
        let catchup = if wants(Section::CatchUp) {
            catch_up(&db, &args).await.map(Some)
        } else {
            Ok(None)
        };
        let keepalive = match &catchup {
            Ok(_) if wants(Section::Keepalive) => keepalive(&db, &args).await.map(Some),
            _ => Ok(None),
        };
        db.drop_database().await?;
        if let Some((catchup_lines, catchup)) = catchup? {
            lines.extend(catchup_lines);
            lines.push(String::new());
            keys.push(format!("catchup_events_per_s={:.0}", catchup.one_per_s));
            keys.push(format!("catchup_vs_sql_floor={:.3}", catchup.vs_floor));
            keys.push(format!("catchup_2_vs_1={:.3}", catchup.two_vs_one));
            keys.push(format!(
                "catchup_server_us_per_event_vs_floor={:.3}",
                catchup.server_vs_floor
            ));
        }
        if let Some(keepalive) = keepalive? {
            lines.extend(keepalive.lines());
            lines.push(String::new());
            keys.push(format!(
                "keepalive_statements_per_interval={:.2}",
                keepalive.statements_per_interval
            ));
        }
    }
    if wants(Section::IoBound) {
        let io = io_bound::run(&url, &args).await?;
        lines.extend(io.lines);
        lines.push(String::new());
        keys.push(format!("io_bound_4_vs_1={:.3}", io.four_vs_one));
        keys.push(format!("io_bound_2_vs_1={:.3}", io.two_vs_one));
        keys.push(format!("share_max_vs_min={:.3}", io.share_max_vs_min));
    }
    if wants(Section::Claims) {
        let (claim_lines, ratio) = claims::run(&url, &args).await?;
        lines.extend(claim_lines);
        lines.push(String::new());
        keys.push(format!("claim_ms_1m_vs_10k={ratio:.3}"));
    }
    if wants(Section::Starved) {
        let (starved_lines, ratio) = starved::run(&url, &args).await?;
        lines.extend(starved_lines);
        lines.push(String::new());
        keys.push(format!("starved_vs_clean={ratio:.3}"));
    }
    if wants(Section::Rewind) {
        let db = create(&url, &args).await?;
        let rewind = Box::pin(rewind(&db, &args)).await;
        db.drop_database().await?;
        let (rewind_lines, rewind_ratio) = rewind?;
        lines.extend(rewind_lines);
        lines.push(String::new());
        keys.push(format!("rewind_snapshot_vs_full={rewind_ratio:.4}"));
    }
    if wants(Section::Upcast) {
        let (upcast_lines, ratio) = upcast::run(&url, &args).await?;
        lines.extend(upcast_lines);
        lines.push(String::new());
        keys.push(format!("catchup_upcast_vs_plain={ratio:.3}"));
    }
    if wants(Section::BlueGreen) {
        let bg = blue_green::run(&url, &args).await?;
        lines.extend(bg.lines);
        lines.push(String::new());
        keys.push(format!("bluegreen_mixed_reads={}", bg.mixed_reads));
        keys.push(format!("bluegreen_lost_or_doubled={}", bg.lost_or_doubled));
        keys.push(format!(
            "bluegreen_build_vs_catchup={:.3}",
            bg.build_vs_catchup
        ));
        keys.push(format!("bluegreen_v1_lag_vs_idle={:.3}", bg.lag_vs_idle));
    }
    // The existing lines first, in their old order, then the ones added with batches.
    const ORDER: [&str; 16] = [
        "catchup_events_per_s",
        "catchup_vs_sql_floor",
        "catchup_2_vs_1",
        "rewind_snapshot_vs_full",
        "keepalive_statements_per_interval",
        "catchup_server_us_per_event_vs_floor",
        "io_bound_4_vs_1",
        "io_bound_2_vs_1",
        "claim_ms_1m_vs_10k",
        "starved_vs_clean",
        "share_max_vs_min",
        "catchup_upcast_vs_plain",
        "bluegreen_mixed_reads",
        "bluegreen_lost_or_doubled",
        "bluegreen_build_vs_catchup",
        "bluegreen_v1_lag_vs_idle",
    ];
    keys.sort_by_key(|k| {
        ORDER
            .iter()
            .position(|o| k.split('=').next() == Some(*o))
            .unwrap_or(ORDER.len())
    });
    if args.plan_cache_mode != "auto" {
        lines.push(format!(
            "(every benchmark database had plan_cache_mode = {})",
            args.plan_cache_mode
        ));
    }
    lines.extend(keys);
    println!("{}", lines.join("\n"));
    Ok(())
}

async fn create(url: &str, args: &Args) -> Result<BenchDatabase> {
    let db = BenchDatabase::create(url).await?;
    let admin = db.admin_client().await?;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{}\" SET synchronous_commit = {}",
            db.name(),
            if args.synchronous_commit == "on" {
                "on"
            } else {
                "off"
            }
        ))
        .await
        .context("setting synchronous_commit")?;
    // Server time per PL/pgSQL function (claim, commit), for the breakdown of a pair's cost.
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{}\" SET track_functions = 'pl'",
            db.name()
        ))
        .await
        .context("setting track_functions")?;
    if args.plan_cache_mode != "auto" {
        let mode = if args.plan_cache_mode == "force_custom_plan" {
            "force_custom_plan"
        } else {
            "force_generic_plan"
        };
        admin
            .batch_execute(&format!(
                "ALTER DATABASE \"{}\" SET plan_cache_mode = {mode}",
                db.name()
            ))
            .await
            .context("setting plan_cache_mode")?;
    }
    let pool = db.pool(2)?;
    lockstep_pg::migrate(&pool).await?;
    pool.close();
    Ok(db)
}

fn number_event(n: i64) -> Result<NewEvent> {
    Ok(NewEvent::new("Numbered", serde_json::json!({ "n": n }))?)
}

/// Appends `per_stream` numbered events to each stream, 500 per statement.
pub(crate) async fn append(
    db: &BenchDatabase,
    streams: &[StreamId],
    per_stream: usize,
) -> Result<()> {
    append_with(db, streams, per_stream, &|_, _, n| number_event(n), None).await
}

/// Appends `per_stream` events to each stream, 500 per statement: event `i` of stream `s` is
/// `make(s, i, n)`, `n` counting every event appended by this call. With `progress`, a line
/// every `progress` streams.
async fn append_with(
    db: &BenchDatabase,
    streams: &[StreamId],
    per_stream: usize,
    make: &(dyn Fn(usize, usize, i64) -> Result<NewEvent> + Sync),
    progress: Option<usize>,
) -> Result<()> {
    let pool = db.pool(1)?;
    let events = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let mut n = 0i64;
    let started = Instant::now();
    for (s, stream) in streams.iter().enumerate() {
        let mut written = 0;
        while written < per_stream {
            let batch = (per_stream - written).min(500);
            let new = (written..written + batch)
                .map(|i| make(s, i, n + (i - written) as i64))
                .collect::<Result<Vec<_>>>()?;
            n += batch as i64;
            let tx = PgTransaction::begin(&pool).await?;
            events
                .append(&tx, *stream, ExpectedVersion::Any, &new)
                .await?;
            tx.commit().await?;
            written += batch;
        }
        if let Some(every) = progress
            && (s + 1) % every == 0
        {
            eprintln!(
                "  appended {} of {} streams ({n} events, {:.0} s)",
                s + 1,
                streams.len(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    pool.close();
    Ok(())
}

/// Registers `names` (each new one gets work for every event already appended).
pub(crate) async fn register(db: &BenchDatabase, names: &[PerspectiveName]) -> Result<()> {
    let pool = db.pool(1)?;
    let tx = PgTransaction::begin(&pool).await?;
    PgPerspectiveStore::new().register(&tx, names).await?;
    tx.commit().await?;
    pool.close();
    Ok(())
}

/// `VACUUM ANALYZE` of the work queue and the cursors (after a registration or an append filled
/// them, so that the planner knows their size).
pub(crate) async fn vacuum(db: &BenchDatabase) -> Result<()> {
    db.client()
        .await?
        .batch_execute("VACUUM ANALYZE wh_perspective_events, wh_perspective_cursors")
        .await?;
    Ok(())
}

/// The worker's options: the defaults, polling every 10 ms, `concurrency` pairs at a time.
/// The poll interval of every worker of the benchmark (the default, 200 ms, would dominate a
/// catch-up of a few seconds).
const POLL: Duration = Duration::from_millis(10);

fn options(args: &Args, concurrency: usize) -> WorkerOptions {
    WorkerOptions::default()
        .with_poll_interval(POLL)
        .with_pairs_per_cycle(args.pairs_per_cycle)
        .with_concurrency(concurrency)
}

/// A worker instance of its own (pool, locker, `InstanceId`), its connections open: a running
/// instance has them open, and the floor's connection is opened before the clock too, so the
/// timed part (and the server CPU counted from before it) is the work, not the connection
/// handshakes and the new backends' start.
async fn worker(
    db: &BenchDatabase,
    options: WorkerOptions,
    perspectives: &[Arc<dyn lockstep_core::DynPerspective>],
    lock: StreamLockOptions,
) -> Result<PgWorker> {
    let pool = open_pool(db, options.concurrency + 2).await?;
    worker_on(pool, options, perspectives, lock)
}

/// A pool of `size` connections to the benchmark database, every one of them open.
pub(crate) async fn open_pool(db: &BenchDatabase, size: usize) -> Result<deadpool_postgres::Pool> {
    let pool = db.pool(size)?;
    let mut open = Vec::with_capacity(size);
    for _ in 0..size {
        let client = pool.get().await.context("opening a worker connection")?;
        client
            .simple_query("SELECT 1")
            .await
            .context("a worker connection")?;
        open.push(client);
    }
    drop(open);
    Ok(pool)
}

/// A worker instance for `perspectives` on `pool`, with a locker of its own on it.
fn worker_on(
    pool: deadpool_postgres::Pool,
    options: WorkerOptions,
    perspectives: &[Arc<dyn lockstep_core::DynPerspective>],
    lock: StreamLockOptions,
) -> Result<PgWorker> {
    worker_with_store(pool, options, perspectives, lock, PgPerspectiveStore::new())
}

/// [`worker_on`] with `store` (a store reading through upcasters).
fn worker_with_store(
    pool: deadpool_postgres::Pool,
    options: WorkerOptions,
    perspectives: &[Arc<dyn lockstep_core::DynPerspective>],
    lock: StreamLockOptions,
    store: PgPerspectiveStore,
) -> Result<PgWorker> {
    let locker: Arc<dyn StreamLocker> = Arc::new(PgStreamLocker::from_pool(pool.clone(), lock));
    worker_from(
        PgDatabase::from_pool(pool),
        store,
        locker,
        options,
        perspectives,
    )
}

/// A worker instance for `perspectives` on any transaction source (either driver), with
/// `locker` and a random `InstanceId`.
pub(crate) fn worker_from<S>(
    source: S,
    store: PgPerspectiveStore,
    locker: Arc<dyn StreamLocker>,
    options: WorkerOptions,
    perspectives: &[Arc<dyn lockstep_core::DynPerspective>],
) -> Result<PerspectiveWorker<S, PgPerspectiveStore>>
where
    S: TransactionSource,
    PgPerspectiveStore: PerspectiveStore<S::Tx>,
{
    let mut registry = PerspectiveRegistry::new();
    for p in perspectives {
        registry.register_dyn(Arc::clone(p))?;
    }
    Ok(PerspectiveWorker::new(
        source,
        store,
        registry,
        options,
        InstanceId::random(),
        Some(locker),
    )?)
}

/// The work rows left of some perspectives, on a connection opened before the clock starts.
pub(crate) struct WorkLeft {
    client: tokio_postgres::Client,
    names: Vec<String>,
}

impl WorkLeft {
    pub(crate) async fn new(db: &BenchDatabase, names: &[PerspectiveName]) -> Result<WorkLeft> {
        Ok(WorkLeft {
            client: db.client().await?,
            names: names.iter().map(|n| n.as_str().to_owned()).collect(),
        })
    }

    async fn count(&self) -> Result<i64> {
        Ok(self
            .client
            .query_one(
                "SELECT count(*) FROM wh_perspective_events WHERE perspective_name = ANY($1)",
                &[&self.names],
            )
            .await?
            .get(0))
    }
}

/// How long a drain waits with work left and none of it applied by anyone before it gives up
/// (parked or unclaimable work: a defect, reported, not waited out).
const STALLED_AFTER: Duration = Duration::from_secs(60);

/// Cycles until a cycle claims nothing **and** no work of the perspectives is left; a cycle that
/// finds nothing while work is left (other instances hold it) waits `poll`, as
/// `PerspectiveWorker::run` does. Returns the events this instance applied. Any failure or cycle
/// error is an error of the benchmark.
async fn drain(worker: &PgWorker, left: &WorkLeft, poll: Duration) -> Result<usize> {
    Ok(drain_counted(worker, left, poll).await?.applied)
}

/// What a [`drain_counted`] did.
pub(crate) struct Drained {
    /// Events this instance applied.
    pub(crate) applied: usize,
    /// Its cycles that claimed at least one pair.
    pub(crate) busy_cycles: usize,
}

/// [`drain`] on any transaction source, counting the cycles that claimed work as well.
pub(crate) async fn drain_counted<S, P>(
    worker: &PerspectiveWorker<S, P>,
    left: &WorkLeft,
    poll: Duration,
) -> Result<Drained>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let mut applied = 0;
    let mut busy_cycles = 0;
    let mut last: Option<(i64, Instant)> = None;
    loop {
        let report = worker.run_once().await;
        if let Some(error) = report.errors.first() {
            bail!("worker cycle failed: {error}");
        }
        if report.failed > 0 {
            let example = report
                .failures
                .first()
                .map_or_else(|| "?".to_owned(), ToString::to_string);
            bail!("{} pairs failed, e.g. {example}", report.failed);
        }
        applied += report.applied;
        if report.pairs > 0 {
            busy_cycles += 1;
            continue;
        }
        let n = left.count().await?;
        if n == 0 {
            return Ok(Drained {
                applied,
                busy_cycles,
            });
        }
        match last {
            Some((m, since)) if m == n => {
                if since.elapsed() > STALLED_AFTER {
                    bail!(
                        "{n} work rows left, none claimable and none applied for {STALLED_AFTER:?}"
                    );
                }
            }
            _ => last = Some((n, Instant::now())),
        }
        tokio::time::sleep(poll).await;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// `instances` workers, each processing `concurrency` pairs at a time.
    Worker {
        instances: usize,
        concurrency: usize,
    },
    Floor,
}

impl Side {
    fn label(self) -> String {
        match self {
            Side::Worker {
                instances,
                concurrency,
            } => format!(
                "worker, {instances} instance{}, concurrency {concurrency}",
                if instances == 1 { "" } else { "s" }
            ),
            Side::Floor => "one SQL statement (floor)".to_owned(),
        }
    }

    fn tag(self) -> String {
        match self {
            Side::Worker {
                instances,
                concurrency,
            } => format!("W{instances}C{concurrency}"),
            Side::Floor => "Floor".to_owned(),
        }
    }
}

struct Catchup {
    one_per_s: f64,
    vs_floor: f64,
    two_vs_one: f64,
    /// Server CPU time per event, the headline worker side ÷ the floor.
    server_vs_floor: f64,
}

/// The floor: the same data movement as the worker's normal path, set-based, one statement.
const FLOOR: &str = "\
WITH done AS (
    DELETE FROM wh_perspective_events WHERE perspective_name = $1
    RETURNING stream_id, event_id
), folded AS (
    SELECT d.stream_id,
           jsonb_agg(e.payload->'n' ORDER BY e.event_id) AS state,
           (array_agg(e.event_id ORDER BY e.event_id DESC))[1] AS last_event_id,
           count(*) AS applied
      FROM done d JOIN wh_events e ON e.stream_id = d.stream_id AND e.event_id = d.event_id
     GROUP BY d.stream_id
), saved AS (
    INSERT INTO wh_perspective_states (stream_id, perspective_name, state)
    SELECT stream_id, $1, state FROM folded
    ON CONFLICT (stream_id, perspective_name) DO UPDATE SET state = EXCLUDED.state
)
UPDATE wh_perspective_cursors c
   SET last_event_id = f.last_event_id, applied_count = c.applied_count + f.applied,
       revision = c.revision + 1, processed_at = clock_timestamp()
  FROM folded f
 WHERE c.stream_id = f.stream_id AND c.perspective_name = $1";

async fn catch_up(db: &BenchDatabase, args: &Args) -> Result<(Vec<String>, Catchup)> {
    let streams: Vec<StreamId> = (0..args.streams).map(|_| StreamId::new_v7()).collect();
    let total = args.streams * args.events_per_stream;
    eprintln!(
        "catch-up: appending {total} events over {} streams",
        args.streams
    );
    append(db, &streams, args.events_per_stream).await?;
    let lock = StreamLockOptions::new(Duration::from_secs(30), Duration::from_secs(10))?;
    let mut sides = Vec::new();
    for &concurrency in &args.concurrency {
        for instances in [1, 2] {
            sides.push(Side::Worker {
                instances,
                concurrency,
            });
        }
    }
    sides.push(Side::Floor);
    let mut seconds: Vec<Vec<f64>> = vec![Vec::new(); sides.len()];
    // Share of the machine's CPU time that was busy (all processes) while each side ran.
    let mut busy: Vec<Vec<f64>> = vec![Vec::new(); sides.len()];
    // Server CPU seconds while each side ran: the benchmark database's backends, and every
    // postgres process.
    let mut server: Vec<Vec<server_cpu::ServerCpu>> = vec![Vec::new(); sides.len()];
    let ticks_per_second = server_cpu::ticks_per_second();
    // Per-round events/s of every side, for the per-round ratios.
    let mut per_round: Vec<Vec<f64>> = Vec::new();
    let mut probe = None;
    let mut functions_before = Vec::new();
    let mut breakdown = None;
    let mut breakdown_seconds = 0.0;
    let progress = crate::report::Progress::new((args.rounds * sides.len()) as u64);
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..sides.len()).collect();
        order.rotate_left(round % sides.len());
        let mut this = vec![0.0_f64; sides.len()];
        for i in order {
            let side = sides[i];
            let name = format!("Catchup{round}{}", side.tag());
            let perspective = PerspectiveName::new(name.clone())?;
            // Register (enqueues one work row per event), outside the clock.
            register(db, std::slice::from_ref(&perspective)).await?;
            vacuum(db).await?;
            let first = round == 0 && i == 0;
            if first {
                probe = Some(
                    claims::mean_claim_ms(
                        db,
                        &perspective,
                        options(args, 1).batch_limits(),
                        PROBE_CLAIMS,
                    )
                    .await?,
                );
                functions_before = function_times(db).await?;
            }
            progress.step(format!(
                "catch-up round {}/{}: {}",
                round + 1,
                args.rounds,
                side.label()
            ));
            let numbers: Arc<dyn lockstep_core::DynPerspective> = Arc::new(Numbers(name));
            let (elapsed, cpu) = match side {
                Side::Worker {
                    instances,
                    concurrency,
                } => {
                    let mut workers = Vec::with_capacity(instances);
                    for _ in 0..instances {
                        let w = worker(
                            db,
                            options(args, concurrency),
                            std::slice::from_ref(&numbers),
                            lock,
                        )
                        .await?;
                        let left = WorkLeft::new(db, std::slice::from_ref(&perspective)).await?;
                        workers.push((w, left));
                    }
                    let server_before = server_cpu::read(db).await?;
                    let cpu_before = cpu_ticks();
                    let started = Instant::now();
                    let tasks: Vec<_> = workers
                        .into_iter()
                        .map(|(w, left)| {
                            tokio::spawn(async move {
                                let applied = drain(&w, &left, POLL).await;
                                // Handed back, so that their connections (and their backends'
                                // CPU counters) live until the server's time is read.
                                (applied, w, left)
                            })
                        })
                        .collect();
                    let mut applied = 0;
                    let mut held = Vec::new();
                    let mut failed = None;
                    for task in tasks {
                        let (outcome, w, left) = task.await?;
                        match outcome {
                            Ok(n) => applied += n,
                            Err(e) => failed = failed.or(Some(e)),
                        }
                        held.push((w, left));
                    }
                    let elapsed = started.elapsed();
                    let cpu = (
                        cpu_before,
                        cpu_ticks(),
                        server_before,
                        server_cpu::read(db).await?,
                    );
                    drop(held);
                    if let Some(e) = failed {
                        return Err(e);
                    }
                    check(applied, total)?;
                    (elapsed, cpu)
                }
                Side::Floor => {
                    let client = db.client().await?;
                    let server_before = server_cpu::read(db).await?;
                    let cpu_before = cpu_ticks();
                    let started = Instant::now();
                    let pairs = client.execute(FLOOR, &[&perspective.as_str()]).await?;
                    let elapsed = started.elapsed();
                    let cpu = (
                        cpu_before,
                        cpu_ticks(),
                        server_before,
                        server_cpu::read(db).await?,
                    );
                    drop(client);
                    check(pairs as usize, args.streams)?;
                    (elapsed, cpu)
                }
            };
            if let (Some(a), Some(b)) = (cpu.0, cpu.1) {
                busy[i].push(busy_share(a, b));
            }
            if let (Some(a), Some(b)) = (&cpu.2, &cpu.3) {
                server[i].push(server_cpu::between(a, b, ticks_per_second));
            }
            if first {
                let after = function_times(db).await?;
                breakdown = Some(
                    after
                        .iter()
                        .map(|f| {
                            let before = functions_before.iter().find(|b| b.name == f.name);
                            FunctionTime {
                                name: f.name.clone(),
                                calls: f.calls - before.map_or(0, |b| b.calls),
                                total_ms: f.total_ms - before.map_or(0.0, |b| b.total_ms),
                                self_ms: f.self_ms - before.map_or(0.0, |b| b.self_ms),
                            }
                        })
                        .filter(|f| f.calls > 0)
                        .collect::<Vec<_>>(),
                );
                breakdown_seconds = elapsed.as_secs_f64();
            }
            verify(db, &perspective, args.streams).await?;
            seconds[i].push(elapsed.as_secs_f64());
            this[i] = total as f64 / elapsed.as_secs_f64();
        }
        per_round.push(this);
    }
    progress.finish();
    let mut lines = vec![
        format!(
            "### catch-up: {total} events over {} streams, {} rounds \
             (worker: default options but poll 10 ms and the concurrency shown)",
            args.streams, args.rounds
        ),
        String::new(),
        "| side | events | median s | events/s | machine CPU busy | server CPU µs/event (db backends) | server CPU µs/event (all postgres) | rounds (s) |".to_owned(),
        "|---|---:|---:|---:|---:|---:|---:|---|".to_owned(),
    ];
    let us_per_event = |s: f64| s * 1e6 / total as f64;
    for (i, side) in sides.iter().enumerate() {
        let m = median(&seconds[i]);
        let cpu = if busy[i].is_empty() {
            "n/a".to_owned()
        } else {
            format!("{:.0} %", 100.0 * median(&busy[i]))
        };
        let (backends, all) = if server[i].is_empty() {
            ("n/a".to_owned(), "n/a".to_owned())
        } else {
            let b: Vec<f64> = server[i]
                .iter()
                .map(|c| us_per_event(c.backends_s))
                .collect();
            let a: Vec<f64> = server[i].iter().map(|c| us_per_event(c.all_s)).collect();
            (format!("{:.2}", median(&b)), format!("{:.2}", median(&a)))
        };
        lines.push(format!(
            "| {} | {total} | {m:.3} | {:.0} | {cpu} | {backends} | {all} | {} |",
            side.label(),
            total as f64 / m,
            fmt_all(&seconds[i])
        ));
    }
    lines.push(String::new());
    let floor = sides.len() - 1;
    let ratio =
        |a: usize, b: usize| -> Vec<f64> { per_round.iter().map(|r| r[a] / r[b]).collect() };
    // Server seconds per event, side a ÷ side b, per round (the same events on every side).
    let server_ratio = |a: usize, b: usize| -> Vec<f64> {
        server[a]
            .iter()
            .zip(&server[b])
            .map(|(x, y)| x.backends_s / y.backends_s)
            .collect()
    };
    let mut headline = None;
    for (k, &concurrency) in args.concurrency.iter().enumerate() {
        let (one, two) = (2 * k, 2 * k + 1);
        let (vs_floor, two_vs_one) = (ratio(one, floor), ratio(two, one));
        let server_vs_floor = server_ratio(one, floor);
        lines.push(format!(
            "concurrency {concurrency}: 1 instance / floor = {:.3} (rounds: {}); \
             2 instances / 1 = {:.3} (rounds: {}); server CPU per event, 1 instance / floor = \
             {:.3} (rounds: {})",
            median(&vs_floor),
            fmt_all(&vs_floor),
            median(&two_vs_one),
            fmt_all(&two_vs_one),
            median(&server_vs_floor),
            fmt_all(&server_vs_floor)
        ));
        if headline.is_some() {
            continue; // the headline is the first concurrency's (default 1: the worker as shipped)
        }
        headline = Some(Catchup {
            one_per_s: total as f64 / median(&seconds[one]),
            vs_floor: median(&vs_floor),
            two_vs_one: median(&two_vs_one),
            server_vs_floor: median(&server_vs_floor),
        });
    }
    lines.push(format!(
        "ratios: medians over rounds of per-round events/s ratios; the headline lines use \
         concurrency {}; machine CPU busy = all processes, from /proc/stat",
        args.concurrency.first().copied().unwrap_or(1)
    ));
    lines.push(
        "server CPU = utime+stime from /proc/<pid>/stat, read before and after each side: \
         \"db backends\" sums the benchmark database's client backends (pids from \
         pg_stat_activity, read while the side's connections were still open; a backend the \
         side opened counts from 0, its start-up included) — the headline; \"all postgres\" \
         sums every postgres process of the machine (WAL writer, checkpointer, autovacuum \
         included, and any other database's sessions); 10 ms ticks"
            .to_owned(),
    );
    if let Some(ms) = probe {
        let limits = options(args, 1).batch_limits();
        let batches = args.streams.div_ceil(limits.pairs);
        lines.push(format!(
            "claim_batch on the full queue ({total} work rows; the worker's default limits: {} \
             pairs, {} events per pair, {} events, scan {}): mean {ms:.2} ms over \
             {PROBE_CLAIMS} claims, each rolled back, positions carried from one to the next; \
             a 1-instance catch-up runs >= {batches} batches (>= {:.2} s in claims if every \
             one cost that much)",
            limits.pairs,
            limits.events_per_pair,
            limits.events,
            limits.scan,
            ms * batches as f64 / 1000.0
        ));
    }
    if let Some(functions) = breakdown {
        lines.push(format!(
            "server time in PL/pgSQL functions during the first side ({}, {breakdown_seconds:.3} s \
             wall, pg_stat_user_functions; total includes the functions called, self does not: \
             claim_pairs calls try_claim per pair looked at, commit_batch calls commit per pair; \
             the claim's second statement, which reads the events, is plain SQL and not listed):",
            sides[0].label()
        ));
        let order = [
            "lockstep_perspective_claim_pairs",
            "lockstep_perspective_try_claim",
            "lockstep_perspective_commit_batch",
            "lockstep_perspective_commit",
        ];
        let mut functions = functions;
        functions.sort_by_key(|f| {
            order
                .iter()
                .position(|o| *o == f.name)
                .unwrap_or(order.len())
        });
        for f in functions {
            lines.push(format!(
                "  {}: {} calls, {:.0} ms total ({:.3} ms/call), {:.0} ms self ({:.3} ms/call)",
                f.name,
                f.calls,
                f.total_ms,
                f.total_ms / f.calls as f64,
                f.self_ms,
                f.self_ms / f.calls as f64
            ));
        }
    }
    let headline = headline.context("no concurrency given")?;
    Ok((lines, headline))
}

/// Claims timed on the full queue before the first side.
const PROBE_CLAIMS: usize = 10;

/// One function's counters in `pg_stat_user_functions`.
struct FunctionTime {
    name: String,
    calls: i64,
    total_ms: f64,
    self_ms: f64,
}

/// The counters of `pg_stat_user_functions`, once no client is connected (backends publish
/// their counters when they exit).
async fn function_times(db: &BenchDatabase) -> Result<Vec<FunctionTime>> {
    let admin = db.admin_client().await?;
    for _ in 0..200 {
        let clients: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = $1 AND backend_type = 'client backend'",
                &[&db.name()],
            )
            .await?
            .get(0);
        if clients == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let client = db.client().await?;
    let rows = client
        .query(
            "SELECT funcname::text, calls, total_time, self_time FROM pg_stat_user_functions",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| FunctionTime {
            name: r.get(0),
            calls: r.get(1),
            total_ms: r.get(2),
            self_ms: r.get(3),
        })
        .collect())
}

/// `(busy, total)` jiffies of all CPUs from `/proc/stat` (Linux), if readable.
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user)
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4)?;
    Some((total - idle, total))
}

/// The busy share of the CPU time between two `cpu_ticks` readings.
fn busy_share(before: (u64, u64), after: (u64, u64)) -> f64 {
    let total = after.1.saturating_sub(before.1);
    if total == 0 {
        return f64::NAN;
    }
    after.0.saturating_sub(before.0) as f64 / total as f64
}

pub(crate) fn check(got: usize, want: usize) -> Result<()> {
    if got != want {
        bail!("expected {want}, got {got}");
    }
    Ok(())
}

/// Every state of the run's perspective is its stream's fold, and no work is left.
pub(crate) async fn verify(
    db: &BenchDatabase,
    perspective: &PerspectiveName,
    streams: usize,
) -> Result<()> {
    let client = db.client().await?;
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM wh_perspective_events WHERE perspective_name = $1),
                    (SELECT count(*) FROM wh_perspective_states s
                      WHERE s.perspective_name = $1
                        AND s.state = (SELECT jsonb_agg(e.payload->'n' ORDER BY e.event_id)
                                         FROM wh_events e WHERE e.stream_id = s.stream_id))",
            &[&perspective.as_str()],
        )
        .await?;
    let (left, exact): (i64, i64) = (row.get(0), row.get(1));
    if left != 0 || exact as usize != streams {
        bail!("{perspective}: {left} work rows left, {exact} exact states of {streams}");
    }
    Ok(())
}

/// The rewound pairs' states are their streams' folds (count and sum for `Totals`, the list of
/// numbers for `Numbers`), their requests are cleared and no work is left.
async fn verify_rewound(
    db: &BenchDatabase,
    perspective: &PerspectiveName,
    streams: &[StreamId],
) -> Result<()> {
    let ids: Vec<Uuid> = streams.iter().map(StreamId::as_uuid).collect();
    let row = db
        .client()
        .await?
        .query_one(
            "SELECT count(*) FILTER (WHERE s.state = CASE WHEN $2 = 'Totals'
                        THEN (SELECT jsonb_build_array(count(*), sum((e.payload->>'n')::bigint))
                                FROM wh_events e WHERE e.stream_id = s.stream_id)
                        ELSE (SELECT jsonb_agg(e.payload->'n' ORDER BY e.event_id)
                                FROM wh_events e WHERE e.stream_id = s.stream_id) END
                      AND k.rewind_trigger_event_id IS NULL),
                    (SELECT count(*) FROM wh_perspective_events w
                      WHERE w.perspective_name = $2 AND w.stream_id = ANY($1))
               FROM wh_perspective_states s
               JOIN wh_perspective_cursors k
                 ON k.stream_id = s.stream_id AND k.perspective_name = s.perspective_name
              WHERE s.perspective_name = $2 AND s.stream_id = ANY($1)",
            &[&ids, &perspective.as_str()],
        )
        .await?;
    let (exact, left): (i64, i64) = (row.get(0), row.get(1));
    if exact as usize != streams.len() || left != 0 {
        bail!(
            "{perspective} after the rewinds: {exact} exact states of {}, {left} work rows left",
            streams.len()
        );
    }
    Ok(())
}

async fn rewind(db: &BenchDatabase, args: &Args) -> Result<(Vec<String>, f64)> {
    let mut lines = vec![
        format!(
            "### rewind: a stream of {} events, trigger {} events from the end, {} rewinds per kind",
            args.rewind_events, args.rewind_tail, args.rewind_rounds
        ),
        String::new(),
        "| perspective state | replay | events replayed | median ms | rounds (ms) |".to_owned(),
        "|---|---|---:|---:|---|".to_owned(),
    ];
    let lock = StreamLockOptions::new(Duration::from_secs(30), Duration::from_secs(10))?;
    let totals: Arc<dyn lockstep_core::DynPerspective> = Arc::new(Totals("Totals".to_owned()));
    let numbers: Arc<dyn lockstep_core::DynPerspective> = Arc::new(Numbers("Numbers".to_owned()));
    let mut headline = f64::NAN;
    let (with_snapshot, full) = (StreamId::new_v7(), StreamId::new_v7());
    // Both perspectives registered before the append: it fans out to them.
    let names = [
        PerspectiveName::new(totals.name())?,
        PerspectiveName::new(numbers.name())?,
    ];
    register(db, &names).await?;
    eprintln!("rewind: appending 2 x {} events", args.rewind_events);
    append(db, &[with_snapshot, full], args.rewind_events).await?;
    let ids: Vec<Uuid> = {
        let client = db.client().await?;
        client
            .query(
                "SELECT event_id FROM wh_events WHERE stream_id = $1 ORDER BY event_id",
                &[&with_snapshot.as_uuid()],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    let trigger = ids[ids.len() - args.rewind_tail];
    // Applied 100 events per transaction, as events trickling in would be: a snapshot at every
    // 100th event (the last 3 kept).
    let w = worker(
        db,
        options(args, 1)
            .with_max_events_per_claim(100)
            .with_snapshot_every(100),
        &[Arc::clone(&totals), Arc::clone(&numbers)],
        lock,
    )
    .await?;
    eprintln!("rewind: applying");
    drain(&w, &WorkLeft::new(db, &names).await?, POLL).await?;
    let mut parts = Vec::new();
    for (label, perspective) in [
        ("count+sum (constant size)", Arc::clone(&totals)),
        ("list of numbers", numbers),
    ] {
        let name = PerspectiveName::new(perspective.name())?;
        let mut ms: [Vec<f64>; 2] = Default::default();
        let mut warmup: [Vec<f64>; 2] = Default::default();
        let mut replayed = [0usize; 2];
        for round in 0..args.rewind_warmup + args.rewind_rounds {
            for (i, (stream, from)) in [(with_snapshot, Some(trigger)), (full, None)]
                .into_iter()
                .enumerate()
            {
                if !w.request_rewind(stream, &name, from).await? {
                    bail!("no cursor to rewind");
                }
                let started = Instant::now();
                let outcome = w.rewind(stream, &name).await?;
                let elapsed = started.elapsed();
                match outcome {
                    PairOutcome::Rewound {
                        replayed: n,
                        from_snapshot,
                    } if from_snapshot == from.is_some() => replayed[i] = n,
                    other => bail!("rewind {round}: unexpected outcome {other:?}"),
                }
                let into = if round < args.rewind_warmup {
                    &mut warmup[i]
                } else {
                    &mut ms[i]
                };
                into.push(elapsed.as_secs_f64() * 1000.0);
            }
        }
        for (i, kind) in ["from snapshot", "full"].into_iter().enumerate() {
            lines.push(format!(
                "| {label} | {kind} | {} | {:.2} | {} |",
                replayed[i],
                median(&ms[i]),
                fmt_all(&ms[i])
            ));
        }
        if args.rewind_warmup > 0 {
            lines.push(format!(
                "|  | *warm-up, not in the medians* |  | {:.2} / {:.2} | {} / {} |",
                median(&warmup[0]),
                median(&warmup[1]),
                fmt_all(&warmup[0]),
                fmt_all(&warmup[1])
            ));
        }
        let ratio = median(&ms[0]) / median(&ms[1]);
        lines.push(format!("|  | *snapshot / full* |  | **{ratio:.4}** |  |"));
        verify_rewound(db, &name, &[with_snapshot, full]).await?;
        if headline.is_nan() {
            headline = ratio;
            // Where the constant-size rewind from the snapshot spends its time, step by step.
            parts = rewind_parts::run(
                db,
                &w,
                &totals,
                with_snapshot,
                trigger,
                lock,
                args.rewind_rounds,
                (median(&ms[0]), median(&ms[1])),
            )
            .await?;
        }
    }
    lines.push(String::new());
    lines.push(
        "Timed: PerspectiveWorker::rewind (acquire the rewind lease, read cursor + snapshot + \
         events + skipped events, replay, fenced commit with a new snapshot, release); the \
         request is written before the clock starts; every rewound state checked against its \
         stream's fold. Headline: the constant-size state. The first `--rewind-warmup` \
         rounds of each perspective are timed but left out of the medians (their medians, \
         snapshot / full, on the warm-up row): the worker's connections are new, and a \
         backend's first calls compile the PL/pgSQL functions and fill its caches."
            .to_owned(),
    );
    lines.push(String::new());
    lines.extend(parts);
    Ok((lines, headline))
}

#[derive(Debug, Default)]
struct Keepalive {
    leases: usize,
    statements_per_interval: f64,
    renew_calls: u64,
    server_statements: i64,
    interval: Duration,
}

impl Keepalive {
    fn lines(&self) -> Vec<String> {
        vec![
            "### keepalive: one instance holding the leases".to_owned(),
            String::new(),
            "| leases | keepalive interval | renew_many calls (keeper) | statements (server, delta) | statements per interval |".to_owned(),
            "|---:|---:|---:|---:|---:|".to_owned(),
            format!(
                "| {} | {} ms | {} | {} | {:.2} |",
                self.leases,
                self.interval.as_millis(),
                self.renew_calls,
                self.server_statements,
                self.statements_per_interval
            ),
        ]
    }
}

async fn keepalive(db: &BenchDatabase, args: &Args) -> Result<Keepalive> {
    let counter = StatementCounter::new(db, "wh_perspective_cursors").await?;
    // Cursor rows to lease (the catch-up created 1 000 per perspective; take fresh ones).
    let name = PerspectiveName::new("Keepalive")?;
    let streams: Vec<StreamId> = (0..args.leases).map(|_| StreamId::new_v7()).collect();
    {
        let client = db.client().await?;
        let ids: Vec<Uuid> = streams.iter().map(StreamId::as_uuid).collect();
        client
            .execute(
                "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) \
                 SELECT unnest($1::uuid[]), $2",
                &[&ids, &name.as_str()],
            )
            .await?;
    }
    let lock = StreamLockOptions::new(Duration::from_secs(2), Duration::from_millis(500))?;
    let interval = lock.keepalive_interval();
    let mut runs = Vec::new();
    for intervals in [0, args.keepalive_intervals] {
        eprintln!(
            "keepalive: {} leases for {intervals} intervals",
            args.leases
        );
        let before = counter.read(db).await?;
        let pool = db.pool(1)?;
        let keeper = LeaseKeeper::start(
            Arc::new(PgStreamLocker::from_pool(pool.clone(), lock)),
            InstanceId::random(),
        );
        let mut held = Vec::with_capacity(streams.len());
        for stream in &streams {
            match keeper
                .try_acquire(*stream, &name, &LockReason::Rewind)
                .await?
            {
                Leased::Acquired(lease) => held.push(lease),
                other => bail!("keepalive lease not acquired: {other:?}"),
            }
        }
        tokio::time::sleep(interval * intervals).await;
        let lost = held.iter().filter(|l| l.lost().is_cancelled()).count();
        for lease in held {
            let _released = lease.release().await?;
        }
        // Every renew the keeper sent, during the acquires and releases too: the server's count
        // of this run includes them.
        let calls = keeper.renew_calls();
        drop(keeper);
        pool.close();
        drop(pool);
        let after = counter.read(db).await?;
        if lost > 0 {
            bail!("{lost} leases were lost during the keepalive measurement");
        }
        runs.push((after as i64 - before as i64, calls));
    }
    let (base, base_calls) = runs[0];
    let (long, long_calls) = runs[1];
    let calls = long_calls.saturating_sub(base_calls);
    let statements = long - base;
    Ok(Keepalive {
        leases: args.leases,
        statements_per_interval: if calls == 0 {
            f64::NAN
        } else {
            statements as f64 / calls as f64
        },
        renew_calls: calls,
        server_statements: statements,
        interval,
    })
}

fn fmt_all(values: &[f64]) -> String {
    values
        .iter()
        .map(|v| format!("{v:.3}"))
        .collect::<Vec<_>>()
        .join(", ")
}
