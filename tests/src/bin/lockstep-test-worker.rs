//! `lockstep-test-worker`: one perspective worker on PostgreSQL as a process, for tests that
//! start it and `kill -9` it. Everything is in [`lockstep_tests::worker_process`], which
//! documents the arguments and the lines it prints.

use clap::Parser;
use lockstep_tests::worker_process::{Args, run};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    run(Args::parse()).await
}
