//! `reliability`: the long run of the reliability suite.
//!
//! Runs every scenario of [`lockstep_tests::reliability`] (`audit`, `faults`, `cancel`,
//! `bad_input`, `model`, `workers`, `failover`), long by default, each in a spawned task so that a scenario
//! that panics or fails is counted and the run goes on, and prints:
//!
//! - one Markdown table row per scenario: cases, violations, lost, duplicated, panics, seconds;
//! - the details of every failure, and a scenario's own figures when it has some (the audit's
//!   lease cycles, takeovers and refused stale commits);
//! - last, exactly one line: the merged [`Tally`],
//!   `reliability violations=<n> lost=<n> duplicated=<n> panics=<n> cases=<n> failovers=<n>`
//!   (`failovers`: primary promotions the work went through).
//!
//! A scenario that returns an error counts as one violation, one that panics as one panic. The
//! command fails (exit status 1, [`ProblemsFound`], nothing printed after the last line) unless
//! the merged tally is clean.
//!
//! The scenarios that exercise a backend on a pool of their own (`audit`, `cancel`, and the
//! lost-`COMMIT` part of `faults`) run on both drivers, tokio-postgres and then sqlx (rows
//! `audit` and `audit on sqlx`), unless `--driver` picks one; the others run on tokio-postgres
//! (the worker processes of `workers` and `failover` are tokio-postgres programs). The last line merges every row. The scenarios create their
//! own databases on the test server (`DATABASE_URL`, else the local server; see
//! `lockstep_testkit::pg_harness`).
//!
//! ```text
//! cargo run --release -p lockstep-bench -- reliability [--only audit] [--scale short|long]
//!     [--driver all|tokio-postgres|sqlx]
//! ```

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use std::ffi::OsString;

use anyhow::{Context as _, Result, bail};
use lockstep_tests::reliability::replication::Replication;
use lockstep_tests::reliability::workers::{self, WorkerCommand};
use lockstep_tests::reliability::{
    Driver, Scale, Tally, audit, bad_input, cancel, failover, faults, model,
};

/// Options of the `reliability` command.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Args {
    /// Run only this scenario.
    #[arg(long, value_parser = scenario_names())]
    only: Option<String>,
    /// `long` (minutes per scenario, at least 10 000 lease cycles in the audit) or `short` (the
    /// few seconds each of `cargo test`).
    #[arg(long, value_enum, default_value_t = ScaleArg::Long)]
    scale: ScaleArg,
    /// The drivers the scenarios that exercise a backend run on: `all` (tokio-postgres, then
    /// sqlx), or one of them. Scenarios that run on tokio-postgres only are skipped with `sqlx`.
    #[arg(long, value_enum, default_value_t = DriverArg::All)]
    driver: DriverArg,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum DriverArg {
    All,
    TokioPostgres,
    Sqlx,
}

impl DriverArg {
    fn includes(self, driver: Driver) -> bool {
        match self {
            DriverArg::All => true,
            DriverArg::TokioPostgres => driver == Driver::TokioPostgres,
            DriverArg::Sqlx => driver == Driver::Sqlx,
        }
    }
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum ScaleArg {
    Short,
    Long,
}

impl From<ScaleArg> for Scale {
    fn from(scale: ScaleArg) -> Scale {
        match scale {
            ScaleArg::Short => Scale::Short,
            ScaleArg::Long => Scale::Long,
        }
    }
}

/// What a scenario returns: its tally, and its own figures if it has some.
struct Finished {
    tally: Tally,
    figures: Option<String>,
}

type Running = Pin<Box<dyn Future<Output = Result<Finished>> + Send>>;

/// A scenario: its name, the drivers it runs on and how to start it on one.
#[derive(Clone, Copy)]
struct Scenario {
    name: &'static str,
    drivers: &'static [Driver],
    start: fn(Scale, Driver) -> Running,
}

/// The drivers of a scenario that runs on tokio-postgres only.
const TOKIO_POSTGRES: &[Driver] = &[Driver::TokioPostgres];

/// A scenario on tokio-postgres that reports a [`Tally`] only.
macro_rules! tally_only {
    ($name:literal, $module:ident) => {
        Scenario {
            name: $name,
            drivers: TOKIO_POSTGRES,
            start: |scale, _| {
                Box::pin(async move {
                    Ok(Finished {
                        tally: $module::run(scale).await?,
                        figures: None,
                    })
                })
            },
        }
    };
}

/// Every scenario, in the order they run.
fn scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "audit",
            drivers: &Driver::ALL,
            start: |scale, driver| {
                Box::pin(async move {
                    let config = audit::AuditConfig {
                        driver,
                        ..audit::AuditConfig::new(scale)
                    };
                    let report = audit::run_report(&config).await?;
                    let figures = match driver {
                        Driver::TokioPostgres => report.stats.to_string(),
                        Driver::Sqlx => format!("{} (on sqlx)", report.stats),
                    };
                    Ok(Finished {
                        tally: report.tally,
                        figures: Some(figures),
                    })
                })
            },
        },
        Scenario {
            name: "faults",
            drivers: &Driver::ALL,
            start: |scale, driver| {
                Box::pin(async move {
                    Ok(Finished {
                        tally: faults::run_on(scale, driver).await?,
                        figures: None,
                    })
                })
            },
        },
        Scenario {
            name: "cancel",
            drivers: &Driver::ALL,
            start: |scale, driver| {
                Box::pin(async move {
                    Ok(Finished {
                        tally: cancel::run_on(scale, driver).await?,
                        figures: None,
                    })
                })
            },
        },
        tally_only!("bad_input", bad_input),
        tally_only!("model", model),
        Scenario {
            name: "workers",
            drivers: TOKIO_POSTGRES,
            start: |scale, _| {
                Box::pin(async move {
                    let report = workers::run(scale, &this_program_as_worker()?).await?;
                    Ok(Finished {
                        tally: report.tally,
                        figures: Some(format!("workers: {}", report.stats)),
                    })
                })
            },
        },
        Scenario {
            name: "failover",
            drivers: TOKIO_POSTGRES,
            start: |scale, _| Box::pin(failovers(scale)),
        },
    ]
}

/// The failover scenarios, one after the other (each starts a primary and a standby of its
/// own): commands and the worker fleet with synchronous and with asynchronous replication, and
/// the lost epoch increment. Their failovers add up in the tally's `failovers`.
async fn failovers(scale: Scale) -> Result<Finished> {
    let mut tally = Tally::default();
    let mut figures = Vec::new();
    for replication in [Replication::Synchronous, Replication::Asynchronous] {
        let report = failover::commands(replication, scale).await?;
        figures.push(format!("failover commands: {}", report.stats));
        tally.merge(report.tally);
        let (report, stats) =
            workers::run_through_failovers(scale, replication, &this_program_as_worker()?).await?;
        figures.push(format!("failover workers: {}; {stats}", report.stats));
        tally.merge(report.tally);
    }
    let report = failover::lost_epoch().await?;
    figures.push(format!("failover lost epoch: {}", report.stats));
    tally.merge(report.tally);
    Ok(Finished {
        tally,
        figures: Some(figures.join("\n")),
    })
}

/// How the `workers` scenario starts its worker processes: this very program, with the
/// arguments that led to `reliability` followed by the hidden `test-worker` subcommand (so
/// `lockstep-bench reliability` starts `lockstep-bench test-worker …`). A `cargo run` of the bench does not
/// build the `lockstep-test-worker` binary that `cargo test` uses.
fn this_program_as_worker() -> Result<WorkerCommand> {
    let program = std::env::current_exe().context("locating this program")?;
    let mut args: Vec<OsString> = std::env::args_os()
        .skip(1)
        .take_while(|arg| arg != "reliability")
        .collect();
    args.push("test-worker".into());
    Ok(WorkerCommand::new(program, args))
}

fn scenario_names() -> Vec<&'static str> {
    scenarios().iter().map(|s| s.name).collect()
}

/// One scenario's result, for the table.
struct Row {
    name: String,
    tally: Tally,
    figures: Option<String>,
    elapsed: Duration,
}

/// A scenario's row name on `driver`: its name on tokio-postgres, `<name> on sqlx` on sqlx.
fn row_name(scenario: &Scenario, driver: Driver) -> String {
    match driver {
        Driver::TokioPostgres => scenario.name.to_owned(),
        Driver::Sqlx => format!("{} on sqlx", scenario.name),
    }
}

/// Runs one scenario on `driver` in a task of its own: an error is counted as a violation and a
/// panic (a `JoinError`) as a panic, so the run goes on.
async fn run_one(scenario: &Scenario, scale: Scale, driver: Driver) -> Row {
    let name = row_name(scenario, driver);
    let started = Instant::now();
    let (tally, figures) = match tokio::spawn((scenario.start)(scale, driver)).await {
        Ok(Ok(finished)) => (finished.tally, finished.figures),
        Ok(Err(e)) => {
            let mut tally = Tally::default();
            tally.violation(format!("{name} failed: {e:#}"));
            (tally, None)
        }
        Err(e) => {
            let mut tally = Tally::default();
            if e.is_panic() {
                tally.panic(format!("{name} panicked: {e}"));
            } else {
                tally.violation(format!("{name} was cancelled: {e}"));
            }
            (tally, None)
        }
    };
    Row {
        name,
        tally,
        figures,
        elapsed: started.elapsed(),
    }
}

/// Runs the scenarios and prints the table, the details and the last line.
pub(crate) async fn run(args: Args) -> Result<()> {
    let scale = Scale::from(args.scale);
    let named: Vec<Scenario> = scenarios()
        .into_iter()
        .filter(|s| args.only.as_deref().is_none_or(|only| only == s.name))
        .collect();
    if named.is_empty() {
        bail!("no scenario is called {:?}", args.only);
    }
    let chosen: Vec<(Scenario, Driver)> = named
        .into_iter()
        .flat_map(|s| {
            s.drivers
                .iter()
                .filter(|d| args.driver.includes(**d))
                .map(move |d| (s, *d))
                .collect::<Vec<_>>()
        })
        .collect();
    if chosen.is_empty() {
        bail!(
            "{:?} runs on tokio-postgres only",
            args.only.as_deref().unwrap_or("every scenario")
        );
    }

    println!("| scenario | cases | violations | lost | duplicated | panics | seconds |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for (scenario, driver) in chosen {
        eprintln!(
            "reliability: running {} ({scale:?})…",
            row_name(&scenario, driver)
        );
        let row = run_one(&scenario, scale, driver).await;
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.1} |",
            row.name,
            row.tally.cases,
            row.tally.violations,
            row.tally.lost,
            row.tally.duplicated,
            row.tally.panics,
            row.elapsed.as_secs_f64()
        );
        rows.push(row);
    }

    println!();
    let mut merged = Tally::default();
    for row in rows {
        if let Some(figures) = &row.figures {
            println!("{figures}");
        }
        if !row.tally.is_clean() || !row.tally.details.is_empty() {
            println!("{} details:", row.name);
            for detail in &row.tally.details {
                println!("  - {detail}");
            }
        }
        merged.merge(row.tally);
    }
    if !merged.is_clean() {
        // Said before the last line, which must stay last (stdout and stderr alike).
        eprintln!("reliability: the run found problems (see the details above)");
    }
    println!("{merged}");
    if merged.is_clean() {
        Ok(())
    } else {
        Err(ProblemsFound.into())
    }
}

/// The error of a reliability run that found problems: already reported, so the program only
/// exits non-zero (see `main.rs`), printing nothing after the tally's line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProblemsFound;

impl std::fmt::Display for ProblemsFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the reliability run found problems")
    }
}

impl std::error::Error for ProblemsFound {}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_failing_or_panicking_scenario_is_counted_and_the_run_goes_on() {
        let failing = Scenario {
            name: "failing",
            drivers: TOKIO_POSTGRES,
            start: |_, _| Box::pin(async { bail!("no database") }),
        };
        let row = run_one(&failing, Scale::Short, Driver::TokioPostgres).await;
        assert_eq!((row.tally.violations, row.tally.panics), (1, 0));
        assert!(
            row.tally.details[0].contains("no database"),
            "{:?}",
            row.tally
        );

        let panicking = Scenario {
            name: "panicking",
            drivers: TOKIO_POSTGRES,
            start: |_, _| Box::pin(async { panic!("boom") }),
        };
        let row = run_one(&panicking, Scale::Short, Driver::Sqlx).await;
        assert_eq!(row.name, "panicking on sqlx");
        assert_eq!((row.tally.violations, row.tally.panics), (0, 1));
        assert!(!row.tally.is_clean());

        let clean = Scenario {
            name: "clean",
            drivers: TOKIO_POSTGRES,
            start: |_, _| {
                Box::pin(async {
                    let tally = Tally {
                        cases: 3,
                        ..Tally::default()
                    };
                    Ok(Finished {
                        tally,
                        figures: None,
                    })
                })
            },
        };
        let row = run_one(&clean, Scale::Short, Driver::TokioPostgres).await;
        assert!(row.tally.is_clean() && row.tally.cases == 3);
    }
}
