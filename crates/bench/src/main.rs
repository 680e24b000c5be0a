//! The `lockstep-bench` program: see the library's docs (`lockstep_bench`);
//! `lockstep-bench reliability` is the long run of the reliability suite. The operator's
//! `lockstep` command does not carry the benchmarks (it depends on the library crates only).

use clap::Parser;
use lockstep_bench::BenchArgs;

/// lockstep benchmarks, each against pgbench running the same SQL, and the reliability suite's
/// long run.
#[derive(Parser, Debug)]
#[command(name = "lockstep-bench", version, about)]
struct Cli {
    #[command(flatten)]
    args: BenchArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match lockstep_bench::run(Cli::parse().args).await {
        // `reliability` already said so, and its tally's line must stay the last one.
        Err(e) if e.is::<lockstep_bench::ProblemsFound>() => std::process::exit(1),
        other => other,
    }
}
