//! `drivers`: lockstep on sqlx against lockstep on tokio-postgres, the same statements in the
//! same run, section by section.
//!
//! - **Aggregate** (module `aggregate::drivers`): the pessimistic unit of work of `aggregate`
//!   on `PgDatabase` and on `SqlxDatabase`, hot (32 writers on one stream) and cold (16
//!   writers, a stream each); rounds alternate which driver goes first, and each scenario's
//!   figure is the median of the per-round ratios of commits/s, sqlx ÷ tokio-postgres. The
//!   relay counts the round trips per command on each driver, and per step of the unit of work.
//! - **Worker catch-up**: not measured yet — the perspective store does not run on sqlx. Its
//!   line, `sqlx_vs_tokio_postgres_catchup=`, says `n/a`, and the minimum is over the sections
//!   that ran.
//!
//! ```text
//! cargo run --release -p lockstep-bench -- drivers [--rounds 5] [--commits 300]
//! ```
//!
//! Lines: per scenario and driver `drivers_<scenario>_<driver>_commits_per_s=` and `…_p99_ms=`,
//! `<driver>_round_trips_per_command_<scenario>=`; then `sqlx_vs_tokio_postgres_hot32=`,
//! `sqlx_vs_tokio_postgres_cold16=`, `sqlx_vs_tokio_postgres_catchup=` and
//! `sqlx_vs_tokio_postgres_min=` (the lowest of the ratios measured).

use std::time::Duration;

use anyhow::{Context, Result};
use lockstep_testkit::pg_harness::server_address;
use lockstep_testkit::relay::Relay;

use crate::aggregate::drivers::{self as aggregate_drivers, Options};
use crate::bench_db::{BenchDatabase, admin_url};

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
    let db = BenchDatabase::create(&admin_url(args.database_url.clone())).await?;
    let result = run_on(&args, &db).await;
    db.drop_database().await?;
    result
}

async fn run_on(args: &Args, db: &BenchDatabase) -> Result<()> {
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
    drop(relay);

    for table in &aggregate.tables {
        println!();
        print!("{table}");
    }
    println!();
    println!(
        "# worker catch-up: not measured yet (the perspective store does not run on sqlx); \
         sqlx_vs_tokio_postgres_min is over the aggregate scenarios only"
    );
    for line in &aggregate.lines {
        println!("{line}");
    }
    let figure = |r: Option<f64>| r.map_or("n/a".to_owned(), |r| format!("{r:.2}"));
    let mut measured = Vec::new();
    for (key, ratio) in &aggregate.ratios {
        println!("sqlx_vs_tokio_postgres_{key}={}", figure(*ratio));
        measured.extend(*ratio);
    }
    println!("sqlx_vs_tokio_postgres_catchup=n/a");
    println!(
        "sqlx_vs_tokio_postgres_min={}",
        figure(measured.into_iter().reduce(f64::min))
    );
    Ok(())
}
