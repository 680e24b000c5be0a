//! The short run of the worker-process scenario of issue 8's suite
//! (`lockstep_tests::reliability::workers`): worker processes `kill -9`ed and stopped at random
//! while events, some late, are appended; every state must equal the fold of its events.

use lockstep_tests::reliability::Scale;
use lockstep_tests::reliability::workers::{self, WorkerCommand};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_processes_lose_nothing_and_apply_nothing_twice() {
    let command = WorkerCommand::new(env!("CARGO_BIN_EXE_lockstep-test-worker"), []);
    let report = workers::run(Scale::Short, &command)
        .await
        .expect("workers scenario");
    eprintln!("workers: {} ({})", report.tally, report.stats);
    for detail in &report.tally.details {
        eprintln!("  {detail}");
    }
    assert!(report.stats.kills > 0, "{}", report.stats);
    assert!(report.stats.late > 0, "{}", report.stats);
    assert!(report.stats.streams > 0, "{}", report.stats);
    assert!(report.tally.is_clean(), "{}", report.tally);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_comparison_catches_a_lost_a_duplicated_and_a_reordered_event() {
    let tally = workers::demonstrate_checks().await.expect("wrong states");
    eprintln!("workers checks on wrong states: {tally}");
    assert_eq!(
        (tally.lost, tally.duplicated, tally.violations, tally.cases),
        (1, 1, 1, 4),
        "{tally:?}"
    );
}
