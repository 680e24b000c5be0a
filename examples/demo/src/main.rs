//! # lockstep-demo
//!
//! `cargo run -p lockstep-demo` shows what lockstep is for: a flash sale under optimistic
//! concurrency and under the pessimistic write lock, then perspectives on three worker
//! instances (a late event, a rewind lease, a crash and the takeover) — in memory by default, on
//! PostgreSQL with `--database-url` / `DATABASE_URL` (in a database of its own that it drops).
//!
//! `lockstep-demo worker` runs a worker process for the sample `Ledger` perspective: what an
//! application's worker looks like. Operating a database is the `lockstep` command's job
//! (`crates/cli`); this package is a sample and is not published.

// A command-line program: printing is its job.
#![allow(clippy::print_stdout)]

mod db_url;
mod demo;
mod ledger;
mod sample_worker;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Prints a line of the report.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        // Not `println!`, which panics when standard output is closed (`lockstep-demo | head`).
        let _ = std::io::Write::write_fmt(
            &mut std::io::stdout(),
            format_args!("{}\n", format_args!($($arg)*)),
        );
    }};
}

/// lockstep's demo: both locks at work, in memory or on PostgreSQL; and a sample worker process.
#[derive(Debug, Parser)]
#[command(
    name = "lockstep-demo",
    version,
    after_help = "Exit codes: 0 success; 1 a check of the demo failed; 2 bad arguments; 3 the \
                  database is unreachable, or another error."
)]
struct Cli {
    /// PostgreSQL URL (postgres://user@host:port/database). Default: DATABASE_URL; without
    /// one, the demo runs in memory.
    #[arg(long, global = true, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,

    /// Without a command: the demo.
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs a perspective worker for the sample 'Ledger' perspective until Ctrl-C or SIGTERM,
    /// then releases its leases.
    Worker(sample_worker::WorkerArgs),
}

/// An argument refused before anything connects or binds: exit 2 with this message.
#[derive(Debug)]
pub(crate) struct BadArgument(String);

/// A [`BadArgument`] error (exit 2).
pub(crate) fn bad_argument(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(BadArgument(message.into()))
}

impl std::fmt::Display for BadArgument {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadArgument {}

/// Logs (`tracing`) on standard error, filtered by `RUST_LOG` (default `warn`), so that standard
/// output stays the command's report and its JSON; colours only on a terminal.
fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
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
    init_logs();
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

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let url = match cli.database_url.as_deref().map(db_url::DbUrl::parse) {
        None => None,
        Some(Ok(url)) => Some(url),
        Some(Err(err)) => {
            eprintln!("error: {err:#}");
            return Ok(ExitCode::from(2));
        }
    };
    match cli.command {
        None => match demo::run(url).await {
            Ok(()) => Ok(ExitCode::SUCCESS),
            Err(err) => {
                eprintln!("demo failed: {err:#}");
                Ok(ExitCode::from(1))
            }
        },
        Some(Command::Worker(args)) => {
            let url = url.ok_or_else(|| {
                bad_argument("the worker needs a database: pass --database-url or set DATABASE_URL")
            })?;
            sample_worker::run(&url, args).await
        }
    }
}
