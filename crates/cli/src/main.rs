//! # lockstep (the command)
//!
//! The operator's command for a PostgreSQL database that lockstep runs on: apply the schema
//! (and see which migrations are applied), see and force-release stream leases, see advisory
//! locks, delete aggregate snapshots no build reads, list the worker instances, see how far each perspective lags and check it, list, promote and abandon its versions, request a rewind, purge a pair, deal
//! with parked pairs, serve a status page and metrics. `lockstep --help` lists the commands with
//! their exit codes.
//!
//! It depends on the library crates only: the demo and the sample worker are in
//! `examples/demo`, the benchmarks in `crates/bench`.

// A command-line program: printing is its job.
#![allow(clippy::print_stdout)]

mod life;
mod ops;
mod pg;
mod serve;
mod snapshots;
mod versions;
mod workers;

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

/// The exit codes, the same for every command (shown in every command's `--help`).
pub(crate) const EXIT_CODES: &str = "Exit codes (every command): 0 success, healthy; 1 refused or unhealthy \
(e.g. a lease held by another instance, a cursor row another transaction holds, a perspective \
that is not registered, a failed --check); 2 bad arguments (checked before anything connects: \
nothing changes); 3 the database is unreachable or not migrated, or another error. With --json, \
standard output carries one JSON document whatever the exit code (an error is \
{\"error\": …, \"exit_code\": …}); docs/operations.md gives each command's schema.";

/// Operations on a lockstep database (safe multi-instance event sourcing on PostgreSQL).
#[derive(Debug, Parser)]
#[command(name = "lockstep", version, after_help = EXIT_CODES)]
struct Cli {
    /// PostgreSQL URL (postgres://user@host:port/database). Default: DATABASE_URL.
    #[arg(long, global = true, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,

    /// Print one JSON document on standard output (also for a refusal or an error).
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Applies the schema (idempotent; safe from several processes at once); with --status,
    /// only says which migrations are applied or pending (exit 3 while any is pending).
    #[command(after_help = EXIT_CODES)]
    Migrate {
        /// Change nothing: list every migration as applied, pending, changed or unknown.
        #[arg(long)]
        status: bool,
    },
    /// Stream leases and advisory locks.
    #[command(subcommand, after_help = EXIT_CODES)]
    Locks(ops::LocksCommand),
    /// Perspectives: status (and --check), rewind, rebuild, retire, purge, parked, retry, skip,
    /// and their versions: versions, promote, abandon.
    #[command(subcommand, after_help = EXIT_CODES)]
    Perspectives(ops::PerspectivesCommand),
    /// Aggregate snapshots: `drop` deletes those of an aggregate type that no build reads any
    /// more (a cache: no answer changes).
    #[command(subcommand, after_help = EXIT_CODES)]
    Snapshots(snapshots::SnapshotsCommand),
    /// The worker instances (the fleet): without a subcommand, lists them (id, name, host, pid,
    /// version, perspectives, started, last seen, leases held, live, stale or unreadable);
    /// `forget` and `prune` remove instances that died.
    #[command(after_help = EXIT_CODES)]
    Workers {
        #[command(subcommand)]
        command: Option<workers::WorkersCommand>,
    },
    /// Serves a status page (leases, advisory locks, perspectives; refreshes itself) and
    /// /metrics until Ctrl-C.
    #[command(after_help = EXIT_CODES)]
    Serve {
        /// Address to listen on (port 0 picks a free one; the URL is printed).
        #[arg(long, default_value = "127.0.0.1:7878")]
        addr: String,
        /// Name an advisory key you know; repeatable.
        #[arg(long = "name")]
        names: Vec<String>,
        /// Enables the page's actions (force-release, rewind, rebuild, retry, skip) for whoever
        /// gives this token (at least 16 characters). Prefer the environment variable: a
        /// command line is visible to every user of the machine.
        #[arg(long, env = "LOCKSTEP_SERVE_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// A URL people reach the page at besides its address and localhost (a DNS name, a
        /// proxy), e.g. `https://status.example.com`; repeatable. Its host is accepted in the
        /// Host header and its origin for the actions; a request naming any other host name
        /// is refused (421), so a DNS-rebinding page cannot read the page.
        #[arg(long = "public-url", value_name = "URL")]
        public_urls: Vec<String>,
        /// Seconds a client has to send a request's headers; the connection is closed after
        /// that.
        #[arg(long, value_name = "SECONDS", default_value_t = 10,
              value_parser = clap::value_parser!(u64).range(1..=3600))]
        header_read_timeout: u64,
    },
}

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
                _ => {
                    // The parse failed, so whether --json was asked is read from the raw words.
                    if std::env::args_os().any(|a| a == "--json") {
                        say!(
                            "{}",
                            serde_json::json!({
                                "error": err.kind().to_string(),
                                "exit_code": 2
                            })
                        );
                    }
                    ExitCode::from(2)
                }
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
    let json = cli.json;
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(err) => {
            let code = if err.chain().any(|e| e.is::<BadArgument>()) {
                2
            } else {
                3
            };
            fail(json, code, &format!("{err:#}"))
        }
    }
}

/// Reports an error (on standard error, and as `{"error", "exit_code"}` on standard output with
/// `--json`) and gives its exit code.
fn fail(json: bool, code: u8, message: &str) -> ExitCode {
    eprintln!("error: {message}");
    if json {
        say!(
            "{}",
            serde_json::json!({ "error": message, "exit_code": code })
        );
    }
    ExitCode::from(code)
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
    let url = url.map_err(|e| bad_argument(format!("{e:#}")))?;
    let json = cli.json;
    match cli.command {
        Command::Migrate { status: false } => ops::migrate(&require(url)?, json).await,
        Command::Migrate { status: true } => ops::migration_status(&require(url)?, json).await,
        Command::Locks(cmd) => ops::locks(&require(url)?, cmd, json).await,
        Command::Perspectives(cmd) => ops::perspectives(&require(url)?, cmd, json).await,
        Command::Snapshots(cmd) => snapshots::run(&require(url)?, cmd, json).await,
        Command::Workers { command } => {
            workers::run(&require(url)?, command.unwrap_or_default(), json).await
        }
        Command::Serve {
            addr,
            names,
            token,
            public_urls,
            header_read_timeout,
        } => {
            let options = serve::ServeOptions {
                addr,
                names,
                token,
                public_urls,
                header_read_timeout: std::time::Duration::from_secs(header_read_timeout),
            };
            serve::serve(&require(url)?, options, json).await
        }
    }
}

fn require(url: Option<pg::DbUrl>) -> anyhow::Result<pg::DbUrl> {
    url.ok_or_else(|| {
        bad_argument("this command needs a database: pass --database-url or set DATABASE_URL")
    })
}
