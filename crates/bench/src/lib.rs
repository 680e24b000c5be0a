//! # lockstep-bench
//!
//! Benchmarks of the lockstep backends. Each one compares a backend with `pgbench` running the
//! same SQL against the same database in the same run, prints a Markdown table and ends with
//! one `key=value` line per headline figure. Results and how to rerun them are in
//! `docs/benchmarks.md`.
//!
//! ```text
//! cargo run --release -p lockstep-bench -- locker [--duration-secs 5] [--rounds 2]
//! ```
//!
//! `drivers` compares two lockstep stacks rather than lockstep with pgbench: the backends on
//! sqlx against the same backends on tokio-postgres, ending with `sqlx_vs_tokio_postgres_*`
//! lines.
//!
//! `reliability` is not a benchmark but the long run of the reliability suite (the
//! scenarios of `lockstep_tests::reliability`): a table of cases and failures per scenario,
//! ending with the line `reliability violations=<n> lost=<n> duplicated=<n> panics=<n>
//! cases=<n> failovers=<n>`.
//!
//! One module per subcommand; the modules below them (`bench_db`, `pgbench`, `server_stats`,
//! `report`) are shared: a throwaway database, a pgbench driver fed with a backend's SQL
//! constants, server-side statement counting, and the table.

// A benchmark's report is its standard output.
#![allow(clippy::print_stdout)]

mod aggregate;
mod append_cost;
mod bench_db;
mod drivers;
mod locker;
mod pgbench;
mod reliability;
mod report;
mod server_stats;
mod worker;

use clap::Subcommand;

pub use reliability::ProblemsFound;

/// The benchmarks' command line: `locker`, `aggregate`, `drivers`, `worker` or `reliability` with their
/// flags. Used by this crate's binary.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: Command,
}

/// One variant per benchmark; each lives in the module of the same name.
#[derive(Subcommand, Debug)]
enum Command {
    /// Stream locker: try-acquire+release cycles and renews vs pgbench (same statements).
    Locker(locker::Args),
    /// Aggregate write lock: pessimistic (advisory lock pipelined with the load) vs optimistic + retry.
    Aggregate(aggregate::Args),
    /// sqlx against tokio-postgres: the pessimistic unit of work, hot 32 and cold 16, on each
    /// driver in the same run (ratios, round trips per command and per step).
    Drivers(drivers::Args),
    /// Perspective worker: catch-up by 1 and 2 instances vs one set-based SQL statement,
    /// I/O-bound catch-up on 1, 2 and 4 instances, claim latency vs queue length, healthy pairs
    /// next to failing and unserved ones, rewind from a snapshot vs full replay, keepalive
    /// statements per interval.
    Worker(worker::Args),
    /// The long run of the reliability suite: every scenario, a table, and the last line
    /// `reliability violations=… lost=… duplicated=… panics=… cases=… failovers=…`.
    Reliability(reliability::Args),
    /// One perspective worker process for the reliability run's `workers` scenario, which
    /// starts and kills these (`lockstep_tests::worker_process`).
    #[command(hide = true)]
    TestWorker(lockstep_tests::worker_process::Args),
}

/// Runs the chosen benchmark, printing its table and its `key=value` lines.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.command {
        Command::Locker(args) => locker::run(args).await,
        Command::Aggregate(args) => aggregate::run(args).await,
        Command::Drivers(args) => drivers::run(args).await,
        // Boxed: every section's state lives in this one future (clippy's large_futures).
        Command::Worker(args) => Box::pin(worker::run(args)).await,
        Command::Reliability(args) => reliability::run(args).await,
        Command::TestWorker(args) => lockstep_tests::worker_process::run(args).await,
    }
}
