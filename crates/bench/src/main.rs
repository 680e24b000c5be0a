//! The `lockstep-bench` program: see the library's docs (`lockstep_bench`). The same
//! benchmarks run as `lockstep bench …`; `lockstep-bench reliability` is the long run of the
//! reliability suite.

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
    lockstep_bench::run(Cli::parse().args).await
}
