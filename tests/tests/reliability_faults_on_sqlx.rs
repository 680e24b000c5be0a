//! The faults scenario (`lockstep_tests::reliability::faults`), short, on sqlx, the parts with a
//! relay in front of an `sqlx::PgPool`: a keepalive stalled by a paused relay (its lost signal
//! fires before the takeover, its fenced commit is refused afterwards, its release leaves the
//! successor's lease alone), and lost `COMMIT` replies (`CommitUnknown`, the caller's retry a
//! replay, each event stored exactly once, the pool recovering). The checks are the
//! tokio-postgres run's (`tests/tests/reliability_faults.rs`).

use lockstep_tests::reliability::{Driver, Scale, faults};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_keepalive_and_lost_commit_replies_on_sqlx_keep_every_promise() {
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
