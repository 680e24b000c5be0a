//! `drivers`: lockstep on sqlx against lockstep on tokio-postgres, the same statements in the
//! same run, section by section.
//!
//! - **Aggregate** (module `aggregate::drivers`): the pessimistic unit of work of `aggregate`
//!   on `PgDatabase` and on `SqlxDatabase`, hot (32 writers on one stream) and cold (16
//!   writers, a stream each); rounds alternate which driver goes first, and each scenario's
//!   figure is the median of the per-round ratios of commits/s, sqlx ÷ tokio-postgres. The
//!   relay counts the round trips per command on each driver, and per step of the unit of work.
//! - **Worker catch-up**: the catch-up of `worker` (its seeding, registration, drain and check,
//!   `crate::worker`) on a database of its own: `--catchup-streams` × `--catchup-events-per-stream`
//!   events (default 320 × 100 = 32 000, a third of `worker`'s store: five batches of the
//!   default 64 pairs), one `PerspectiveWorker` with `WorkerOptions::default()` draining a
//!   freshly registered perspective, on `PgDatabase` + `PgPerspectiveStore` +
//!   `PgStreamLocker::new` and on `SqlxDatabase` + `PgPerspectiveStore` +
//!   `PgStreamLocker::for_sqlx`. Each driver has one pool for the whole section (its
//!   connections open, and an untimed first round, so that sqlx's per-connection statement
//!   preparation is behind it); rounds alternate which driver goes first, and the figure is the
//!   median of the per-round ratios of events/s, sqlx ÷ tokio-postgres. The relay counts the
//!   round trips per batch (a worker cycle that claimed work) on each driver, after an untimed
//!   catch-up on the same pool.
//!
//! ```text
//! cargo run --release -p lockstep-bench -- drivers [--rounds 5] [--commits 300]
//! ```
//!
//! Lines: per scenario and driver `drivers_<scenario>_<driver>_commits_per_s=` and `…_p99_ms=`,
//! `<driver>_round_trips_per_command_<scenario>=`; `drivers_catchup_<driver>_events_per_s=` and
//! `<driver>_round_trips_per_batch_catchup=`; then `sqlx_vs_tokio_postgres_hot32=`,
//! `sqlx_vs_tokio_postgres_cold16=`, `sqlx_vs_tokio_postgres_catchup=` and
//! `sqlx_vs_tokio_postgres_min=` (the lowest of the three).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use lockstep_core::{DynPerspective, PerspectiveName, StreamId, StreamLockOptions, StreamLocker};
use lockstep_pg::PgDatabase;
use lockstep_pg::sqlx::SqlxDatabase;
use lockstep_pg_store::PgPerspectiveStore;
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::server_address;
use lockstep_testkit::relay::Relay;
use lockstep_worker::WorkerOptions;

use crate::aggregate::drivers::{self as aggregate_drivers, Options, Side};
use crate::bench_db::{BenchDatabase, admin_url};
use crate::report::median_if_any;
use crate::worker::{
    Drained, Numbers, WorkLeft, append, check, drain_counted, open_pool, register, vacuum, verify,
    worker_from,
};

/// Options of the `drivers` benchmark.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Args {
    /// Rounds per scenario; the driver that goes first alternates, and each ratio is the
    /// median of the rounds' ratios.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Writers of the hot scenario (all on one stream).
    #[arg(long, default_value_t = 32)]
    hot_writers: usize,
    /// Writers of the cold scenario (a stream each).
    #[arg(long, default_value_t = 16)]
    cold_writers: usize,
    /// Commits per hot scenario, driver and round.
    #[arg(long, default_value_t = 300)]
    commits: usize,
    /// Cold scenario: commits per writer (at least `--commits` in all).
    #[arg(long, default_value_t = 100)]
    cold_commits_per_writer: usize,
    /// Commits per scenario and driver in the round-trip counting pass.
    #[arg(long, default_value_t = 200)]
    rt_commits: usize,
    /// Commands per driver in the one-writer pass that counts the round trips of each step.
    #[arg(long, default_value_t = 20)]
    step_commands: usize,
    /// Events each stream starts with.
    #[arg(long, default_value_t = 50)]
    seed_events: usize,
    /// Simulated work inside each transaction, in milliseconds.
    #[arg(long, default_value_t = 1)]
    hold_ms: u64,
    /// sqlx's `test_before_acquire` (its default is on: a ping, one round trip, on every
    /// checkout of an idle connection). Off by default here, like the deadpool pools of the
    /// tokio-postgres side, which check nothing on checkout.
    #[arg(long)]
    sqlx_test_before_acquire: bool,
    /// Streams of the worker catch-up.
    #[arg(long, default_value_t = 320)]
    catchup_streams: usize,
    /// Events per stream of the worker catch-up.
    #[arg(long, default_value_t = 100)]
    catchup_events_per_stream: usize,
    /// `synchronous_commit` of the benchmark database (as in `aggregate`).
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    synchronous_commit: String,
    /// Server to create the benchmark database on (default: `DATABASE_URL`, else
    /// postgres://postgres@127.0.0.1:5432/postgres).
    #[arg(long)]
    database_url: Option<String>,
}

/// Runs the sections and prints their tables and the headline lines.
pub(crate) async fn run(args: Args) -> Result<()> {
    let url = admin_url(args.database_url.clone());
    let db = BenchDatabase::create(&url).await?;
    // The catch-up's database is its own: a registration enqueues work for every event of the
    // database, the aggregate section's included.
    let catchup_db = BenchDatabase::create(&url).await?;
    let result = run_on(&args, &db, &catchup_db).await;
    db.drop_database().await?;
    catchup_db.drop_database().await?;
    result
}

async fn run_on(args: &Args, db: &BenchDatabase, catchup_db: &BenchDatabase) -> Result<()> {
    crate::aggregate::prepare(db, &args.synchronous_commit).await?;
    println!(
        "# drivers: sqlx against tokio-postgres; aggregate: pessimistic unit of work, {} seed \
         events, {} ms held in each transaction, {} commits per hot scenario ({} in the \
         round-trip pass), synchronous_commit = {}, sqlx test_before_acquire = {}",
        args.seed_events,
        args.hold_ms,
        args.commits,
        args.rt_commits,
        args.synchronous_commit,
        args.sqlx_test_before_acquire
    );
    let relay = Relay::start(server_address(db.config()).context("the round-trip relay")?)
        .await
        .context("starting the round-trip relay")?;
    let options = Options {
        hot_writers: args.hot_writers.max(1),
        cold_writers: args.cold_writers.max(1),
        commits: args.commits.max(1),
        cold_commits_per_writer: args.cold_commits_per_writer,
        rounds: args.rounds.max(1),
        rt_commits: args.rt_commits.max(1),
        step_commands: args.step_commands.max(1),
        seed_events: args.seed_events,
        hold: Duration::from_millis(args.hold_ms),
        sqlx_test_before_acquire: args.sqlx_test_before_acquire,
    };
    let aggregate = aggregate_drivers::measure(db, &relay, &options).await?;
    crate::aggregate::prepare(catchup_db, &args.synchronous_commit).await?;
    let catchup = catch_up(catchup_db, &relay, args).await?;
    drop(relay);

    for table in &aggregate.tables {
        println!();
        print!("{table}");
    }
    println!();
    print!("{}", catchup.table);
    println!();
    for line in aggregate.lines.iter().chain(&catchup.lines) {
        println!("{line}");
    }
    let figure = |r: Option<f64>| r.map_or("n/a".to_owned(), |r| format!("{r:.2}"));
    let mut measured = Vec::new();
    for (key, ratio) in aggregate
        .ratios
        .iter()
        .chain([&("catchup".to_owned(), catchup.ratio)])
    {
        println!("sqlx_vs_tokio_postgres_{key}={}", figure(*ratio));
        measured.extend(*ratio);
    }
    println!(
        "sqlx_vs_tokio_postgres_min={}",
        figure(measured.into_iter().reduce(f64::min))
    );
    Ok(())
}

/// What the catch-up section measured: its table, its `key=value` lines and the median ratio
/// of events/s, sqlx ÷ tokio-postgres.
struct Catchup {
    table: String,
    lines: Vec<String>,
    ratio: Option<f64>,
}

/// One driver's worker wiring: the transaction source and the stream locker built from it.
enum Wiring {
    TokioPostgres(PgDatabase),
    Sqlx(SqlxDatabase),
}

impl Wiring {
    /// Pools of `size` connections, every one open (through `relay` if given).
    async fn open(
        db: &BenchDatabase,
        side: Side,
        size: usize,
        relay: Option<&Relay>,
        test_before_acquire: bool,
    ) -> Result<Wiring> {
        Ok(match side {
            Side::TokioPostgres => {
                let pool = match relay {
                    Some(relay) => {
                        let pool = db.pool_through(relay.addr(), size)?;
                        let mut held = Vec::with_capacity(size);
                        for _ in 0..size {
                            held.push(pool.get().await.context("opening a worker connection")?);
                        }
                        drop(held);
                        pool
                    }
                    None => open_pool(db, size).await?,
                };
                Wiring::TokioPostgres(PgDatabase::from_pool(pool))
            }
            Side::Sqlx => {
                let pool = match relay {
                    Some(relay) => db.sqlx_pool_through(relay.addr(), size, test_before_acquire),
                    None => db.sqlx_pool(size, test_before_acquire),
                };
                let mut held = Vec::with_capacity(size);
                for _ in 0..size {
                    let mut conn = pool.acquire().await.context("opening an sqlx connection")?;
                    sqlx::Executor::execute(&mut *conn, sqlx::raw_sql("SELECT 1"))
                        .await
                        .context("an sqlx worker connection")?;
                    held.push(conn);
                }
                drop(held);
                Wiring::Sqlx(SqlxDatabase::new(pool))
            }
        })
    }

    /// A worker instance for `perspective` on this wiring, then its drain of the
    /// perspective's work: the time the drain took and what it did.
    async fn catch_up(
        &self,
        db: &BenchDatabase,
        perspective: &PerspectiveName,
        options: &WorkerOptions,
    ) -> Result<(Duration, Drained)> {
        let numbers: Arc<dyn DynPerspective> = Arc::new(Numbers(perspective.as_str().to_owned()));
        let perspectives = std::slice::from_ref(&numbers);
        let left = WorkLeft::new(db, std::slice::from_ref(perspective)).await?;
        let lock = StreamLockOptions::default();
        let poll = options.poll_interval;
        match self {
            Wiring::TokioPostgres(pg) => {
                let locker: Arc<dyn StreamLocker> = Arc::new(PgStreamLocker::new(pg, lock));
                let worker = worker_from(
                    pg.clone(),
                    PgPerspectiveStore::new(),
                    locker,
                    *options,
                    perspectives,
                )?;
                let started = Instant::now();
                let drained = drain_counted(&worker, &left, poll).await?;
                Ok((started.elapsed(), drained))
            }
            Wiring::Sqlx(sqlx) => {
                let locker: Arc<dyn StreamLocker> = Arc::new(PgStreamLocker::for_sqlx(sqlx, lock));
                let worker = worker_from(
                    sqlx.clone(),
                    PgPerspectiveStore::new(),
                    locker,
                    *options,
                    perspectives,
                )?;
                let started = Instant::now();
                let drained = drain_counted(&worker, &left, poll).await?;
                Ok((started.elapsed(), drained))
            }
        }
    }

    async fn close(self) {
        match self {
            Wiring::TokioPostgres(pg) => pg.pool().close(),
            Wiring::Sqlx(sqlx) => sqlx.pool().close().await,
        }
    }
}

/// Registers a fresh perspective (its work rows: set-up, not timed), has `wiring`'s worker
/// drain it and checks every state; returns the drain's time and what it did.
async fn catch_up_once(
    db: &BenchDatabase,
    wiring: &Wiring,
    name: String,
    streams: usize,
    total: usize,
    options: &WorkerOptions,
) -> Result<(Duration, Drained)> {
    let perspective = PerspectiveName::new(name)?;
    register(db, std::slice::from_ref(&perspective)).await?;
    vacuum(db).await?;
    let (elapsed, drained) = wiring.catch_up(db, &perspective, options).await?;
    check(drained.applied, total)?;
    verify(db, &perspective, streams).await?;
    Ok((elapsed, drained))
}

/// The worker catch-up on both drivers: the timed rounds, then the round-trip pass.
async fn catch_up(db: &BenchDatabase, relay: &Relay, args: &Args) -> Result<Catchup> {
    let streams_n = args.catchup_streams.max(1);
    let per_stream = args.catchup_events_per_stream.max(1);
    let total = streams_n * per_stream;
    let streams: Vec<StreamId> = (0..streams_n).map(|_| StreamId::new_v7()).collect();
    append(db, &streams, per_stream).await?;
    let options = WorkerOptions::default();
    let size = options.concurrency + 2;
    let sides = [Side::TokioPostgres, Side::Sqlx];
    let mut wirings = Vec::with_capacity(2);
    for side in sides {
        wirings.push(Wiring::open(db, side, size, None, args.sqlx_test_before_acquire).await?);
    }
    let rounds = args.rounds.max(1);
    let mut seconds: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut per_round = Vec::new();
    // Round 0 is the untimed one.
    for round in 0..=rounds {
        let order = if round % 2 == 1 {
            [Side::TokioPostgres, Side::Sqlx]
        } else {
            [Side::Sqlx, Side::TokioPostgres]
        };
        let mut this_round = [0.0f64; 2];
        for side in order {
            let name = format!("DriversCatchup{round}{}", side.key());
            let wiring = &wirings[side as usize];
            let (elapsed, _) = catch_up_once(db, wiring, name, streams_n, total, &options).await?;
            this_round[side as usize] = total as f64 / elapsed.as_secs_f64();
            if round > 0 {
                seconds[side as usize].push(elapsed.as_secs_f64());
            }
        }
        if round > 0 {
            per_round
                .push(this_round[Side::Sqlx as usize] / this_round[Side::TokioPostgres as usize]);
        }
    }
    for wiring in wirings {
        wiring.close().await;
    }
    let ratio = median_if_any(&per_round);

    let mut table = format!(
        "| worker catch-up ({total} events, {streams_n} streams, 1 instance, \
         `WorkerOptions::default()`) | events/s (median s) | rounds (s) | batches | round \
         trips/batch |\n|---|---:|---|---:|---:|\n"
    );
    let mut lines = Vec::new();
    for side in sides {
        // The round-trip pass: an untimed catch-up on the pool through the relay first.
        let wiring =
            Wiring::open(db, side, size, Some(relay), args.sqlx_test_before_acquire).await?;
        let warm = format!("DriversCatchupRelayWarm{}", side.key());
        let counted = catch_up_once(db, &wiring, warm, streams_n, total, &options).await;
        let counted = match counted {
            Ok(_) => {
                let before = relay.round_trips();
                let name = format!("DriversCatchupRelay{}", side.key());
                let outcome = catch_up_once(db, &wiring, name, streams_n, total, &options).await;
                outcome.map(|(_, drained)| (drained, relay.round_trips() - before))
            }
            Err(e) => Err(e),
        };
        wiring.close().await;
        let (drained, round_trips) = counted?;
        let per_batch = round_trips as f64 / drained.busy_cycles.max(1) as f64;
        let s = &seconds[side as usize];
        let m = crate::report::median(s);
        let rounds_s = s
            .iter()
            .map(|x| format!("{x:.3}"))
            .collect::<Vec<_>>()
            .join(", ");
        table.push_str(&format!(
            "| {} | {:.0} ({m:.3}) | {rounds_s} | {} | {per_batch:.2} |\n",
            match side {
                Side::TokioPostgres => "tokio-postgres",
                Side::Sqlx => "sqlx",
            },
            total as f64 / m,
            drained.busy_cycles
        ));
        lines.push(format!(
            "drivers_catchup_{}_events_per_s={:.0}",
            side.key(),
            total as f64 / m
        ));
        lines.push(format!(
            "{}_round_trips_per_batch_catchup={per_batch:.2}",
            side.key()
        ));
    }
    table.push_str(&format!(
        "| *sqlx / tokio-postgres, median of {} rounds* | **{}** |  |  |  |\n\
         (a batch is a worker cycle that claimed work; its round trips are the relay's count \
         over the whole drain, the last cycle that found nothing included, ÷ the batches)\n",
        per_round.len(),
        ratio.map_or("n/a".to_owned(), |r| format!("{r:.2}"))
    ));
    Ok(Catchup {
        table,
        lines,
        ratio,
    })
}
