//! Every guarantee through a primary failover (`lockstep_tests::reliability::failover` and
//! `::workers::run_through_failovers`): a primary and a streaming standby of the test's own,
//! the primary killed mid-work and the standby promoted, the clients on one multi-host URL with
//! `target_session_attrs=read-write`. Synchronous replication must lose nothing acknowledged;
//! asynchronous replication may lose the last acknowledged writes (counted and printed), and
//! everything else still holds: no wrong answer, no event applied twice or skipped, exact folds
//! in the JSON states and in the application's table, a fence that refuses a stale holder.
//!
//! One pair at a time: each test starts two clusters and worker processes of its own, and the
//! machine has few cores.

use lockstep_tests::reliability::Scale;
use lockstep_tests::reliability::failover::{self, FailoverReport};
use lockstep_tests::reliability::replication::Replication;
use lockstep_tests::reliability::workers::{self, WorkerCommand};

static ONE_PAIR_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn print(what: &str, report: &FailoverReport) {
    eprintln!("{what}: {} ({})", report.tally, report.stats);
    for detail in &report.tally.details {
        eprintln!("  {detail}");
    }
}

/// Commands under the aggregate lock and through the combiner, synchronous replication:
/// every acknowledged command is on the new primary at the version it was answered with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_sync_commands_lose_nothing_acknowledged_and_never_answer_wrong() {
    let _one = ONE_PAIR_AT_A_TIME.lock().await;
    let report = tokio::spawn(failover::commands(Replication::Synchronous, Scale::Short))
        .await
        .expect("the scenario does not panic")
        .expect("the scenario runs");
    print("failover sync commands", &report);
    assert_eq!(report.stats.failovers, 1, "{}", report.stats);
    assert!(report.stats.acknowledged > 0, "{}", report.stats);
    assert_eq!(report.stats.lost_acknowledged, 0, "{}", report.stats);
    assert!(report.tally.is_clean(), "{}", report.tally);
}

/// The same with asynchronous replication: acknowledged commands may be lost (counted), no
/// answer is wrong, and the versions stay gapless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_async_commands_may_lose_the_last_acknowledged_but_never_answer_wrong() {
    let _one = ONE_PAIR_AT_A_TIME.lock().await;
    let report = tokio::spawn(failover::commands(Replication::Asynchronous, Scale::Short))
        .await
        .expect("the scenario does not panic")
        .expect("the scenario runs");
    print("failover async commands", &report);
    assert_eq!(report.stats.failovers, 1, "{}", report.stats);
    assert!(report.stats.acknowledged > 0, "{}", report.stats);
    assert!(report.tally.is_clean(), "{}", report.tally);
}

/// Asynchronous replication loses a lease's epoch increment: the holder the new primary never
/// saw is refused by the fence, although its epoch matches the new holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_async_fence_refuses_a_holder_whose_epoch_increment_was_lost() {
    let _one = ONE_PAIR_AT_A_TIME.lock().await;
    let report = tokio::spawn(failover::lost_epoch())
        .await
        .expect("the scenario does not panic")
        .expect("the scenario runs");
    print("failover async lost epoch", &report);
    assert_eq!(report.stats.epochs_back, 1, "{}", report.stats);
    assert_eq!(report.stats.lost_acknowledged, 5, "{}", report.stats);
    assert!(report.tally.is_clean(), "{}", report.tally);
}

fn worker_command() -> WorkerCommand {
    WorkerCommand::new(env!("CARGO_BIN_EXE_lockstep-test-worker"), [])
}

/// Worker processes catching up and rewinding with leases held (JSON states and a table
/// perspective), synchronous replication: the processes live through the failover, resume,
/// and every fold is exact; lease epochs continue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_sync_worker_fleet_resumes_with_exact_folds_in_states_and_tables() {
    let _one = ONE_PAIR_AT_A_TIME.lock().await;
    let command = worker_command();
    let (report, stats) = tokio::spawn(async move {
        workers::run_through_failovers(Scale::Short, Replication::Synchronous, &command).await
    })
    .await
    .expect("the scenario does not panic")
    .expect("the scenario runs");
    eprintln!(
        "failover sync workers: {} ({}; {stats})",
        report.tally, report.stats
    );
    for detail in &report.tally.details {
        eprintln!("  {detail}");
    }
    assert_eq!(stats.failovers, 1, "{stats}");
    assert_eq!(stats.lost_acknowledged, 0, "{stats}");
    assert!(report.stats.late > 0, "{}", report.stats);
    assert!(report.tally.is_clean(), "{}", report.tally);
}

/// The same with asynchronous replication: what was lost is counted; the folds equal what the
/// new primary holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_async_worker_fleet_resumes_with_exact_folds_of_what_survived() {
    let _one = ONE_PAIR_AT_A_TIME.lock().await;
    let command = worker_command();
    let (report, stats) = tokio::spawn(async move {
        workers::run_through_failovers(Scale::Short, Replication::Asynchronous, &command).await
    })
    .await
    .expect("the scenario does not panic")
    .expect("the scenario runs");
    eprintln!(
        "failover async workers: {} ({}; {stats})",
        report.tally, report.stats
    );
    for detail in &report.tally.details {
        eprintln!("  {detail}");
    }
    assert_eq!(stats.failovers, 1, "{stats}");
    assert!(report.tally.is_clean(), "{}", report.tally);
}
