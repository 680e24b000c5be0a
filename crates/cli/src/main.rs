//! # lockstep (the command)
//!
//! `lockstep demo` shows what lockstep is for, in memory by default or on PostgreSQL; the other
//! commands operate a PostgreSQL database that lockstep runs on: apply the schema, see and
//! force-release stream leases, see advisory locks, see how far each perspective lags, request
//! a rewind, purge a pair, run a worker. `lockstep --help` lists them with their exit codes.

// A command-line program: printing is its job.
#![allow(clippy::print_stdout)]

mod demo;
mod ledger;
mod ops;
mod pg;
mod serve;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Prints a line of the report.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        // Not `println!`, which panics when standard output is closed (`lockstep … | head`):
        // output nobody reads any more is dropped, and the command goes on to its end.
        let _ = std::io::Write::write_fmt(
            &mut std::io::stdout(),
            format_args!("{}\n", format_args!($($arg)*)),
        );
    }};
}

const EXIT_CODES: &str = "Exit codes: 0 success; 1 a check failed or an operation was refused \
(e.g. a lease held by another instance, a cursor row another transaction holds); 2 bad arguments \
(checked before anything connects: nothing changes); 3 the database is unreachable or not \
migrated, or another error.";

/// Safe multi-instance event sourcing on PostgreSQL: a demo, and operations on a lockstep
/// database.
#[derive(Debug, Parser)]
#[command(name = "lockstep", version, after_help = EXIT_CODES)]
struct Cli {
    /// PostgreSQL URL (postgres://user@host:port/database). Default: DATABASE_URL. The demo
    /// runs in memory without one.
    #[arg(long, global = true, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Shows both locks at work: a flash sale (optimistic vs pessimistic) and perspectives on
    /// three worker instances (late event, rewind lease, crash and takeover).
    Demo,
    /// Applies the schema (idempotent; safe from several processes at once).
    Migrate {
        /// Print what was applied as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Stream leases and advisory locks.
    #[command(subcommand)]
    Locks(ops::LocksCommand),
    /// Perspectives: status, rewind, purge, parked, retry, skip.
    #[command(subcommand)]
    Perspectives(ops::PerspectivesCommand),
    /// Serves a status page (leases, advisory locks, perspectives; refreshes itself) and
    /// /metrics until Ctrl-C.
    Serve {
        /// Address to listen on (port 0 picks a free one; the URL is printed).
        #[arg(long, default_value = "127.0.0.1:7878")]
        addr: String,
        /// Name an advisory key you know; repeatable.
        #[arg(long = "name")]
        names: Vec<String>,
    },
    /// Runs a benchmark: `locker`, `aggregate` or `worker` (build with --release; see
    /// docs/benchmarks.md). Each needs a PostgreSQL server (DATABASE_URL) and pgbench.
    Bench(Box<lockstep_bench::BenchArgs>),
    /// Runs a perspective worker for the sample 'Ledger' perspective until Ctrl-C or SIGTERM,
    /// then releases its leases.
    Worker(ops::WorkerArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            let _ = err.print();
            return match err.kind() {
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                    ExitCode::SUCCESS
                }
                _ => ExitCode::from(2),
            };
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: starting the runtime: {err}");
            return ExitCode::from(3);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            if err.chain().any(|e| e.is::<BadArgument>()) {
                ExitCode::from(2)
            } else {
                ExitCode::from(3)
            }
        }
    }
}

/// An argument the command refuses: it exits 2 with this message. Every argument is checked
/// before the command touches the database or binds a port, so a refusal changes nothing.
#[derive(Debug)]
pub(crate) struct BadArgument(String);

impl std::fmt::Display for BadArgument {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadArgument {}

/// A [`BadArgument`] error (exit 2).
pub(crate) fn bad_argument(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(BadArgument(message.into()))
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let url = cli
        .database_url
        .as_deref()
        .map(pg::DbUrl::parse)
        .transpose();
    let url = match url {
        Ok(url) => url,
        Err(err) => {
            eprintln!("error: {err:#}");
            return Ok(ExitCode::from(2));
        }
    };
    match cli.command {
        Command::Demo => match demo::run(url).await {
            Ok(()) => Ok(ExitCode::SUCCESS),
            Err(err) => {
                eprintln!("demo failed: {err:#}");
                Ok(ExitCode::from(1))
            }
        },
        Command::Migrate { json } => ops::migrate(&require(url)?, json).await,
        Command::Locks(cmd) => ops::locks(&require(url)?, cmd).await,
        Command::Perspectives(cmd) => ops::perspectives(&require(url)?, cmd).await,
        Command::Worker(args) => ops::worker(&require(url)?, args).await,
        Command::Bench(args) => {
            lockstep_bench::run(*args).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Serve { addr, names } => serve::serve(&require(url)?, &addr, names).await,
    }
}

fn require(url: Option<pg::DbUrl>) -> anyhow::Result<pg::DbUrl> {
    url.ok_or_else(|| {
        bad_argument("this command needs a database: pass --database-url or set DATABASE_URL")
    })
}
