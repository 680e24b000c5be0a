//! The faults scenario (`lockstep_tests::reliability::faults`), short, on sqlx: the lost `COMMIT`
//! replies through a relay in front of an `sqlx::PgPool` — `CommitUnknown`, the caller's retry a
//! replay, each event stored exactly once, the pool recovering. The checks are the
//! tokio-postgres run's (`tests/tests/reliability_faults.rs`).

use lockstep_tests::reliability::{Driver, Scale, faults};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_reply_on_sqlx_is_commit_unknown_and_its_retry_a_replay() {
    let started = std::time::Instant::now();
    let tally = tokio::spawn(faults::run_on(Scale::Short, Driver::Sqlx))
        .await
        .expect("the scenario does not panic")
        .expect("the faults scenario runs");
    eprintln!("faults on sqlx: {tally} in {:?}", started.elapsed());
    for detail in &tally.details {
        eprintln!("  {detail}");
    }
    assert!(tally.cases > 0, "no case ran");
    assert!(tally.is_clean(), "{tally}: {:#?}", tally.details);
}
