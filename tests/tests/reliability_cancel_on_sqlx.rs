//! The cancellation scenario (`lockstep_tests::reliability::cancel`), short, on sqlx: every
//! stream-locker and admin operation (also behind a row lock held elsewhere), `append`, and
//! `SqlxTransaction` begin / commit (healthy and failed) / rollback, each future dropped after
//! `N = 1, 2, …` polls on an sqlx pool of its own. The checks are the tokio-postgres run's
//! (`tests/tests/reliability_cancel.rs`, which also shows that each of them can fail); what
//! sqlx does differently (no cancel request) is in the scenario's module docs.

use lockstep_tests::reliability::{Driver, Scale, cancel};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_dropped_at_every_await_point_leaves_nothing_behind_on_sqlx() {
    let started = std::time::Instant::now();
    let tally = tokio::spawn(cancel::run_on(Scale::Short, Driver::Sqlx))
        .await
        .expect("the scenario does not panic")
        .expect("cancel scenario");
    eprintln!("cancel on sqlx: {tally}");
    for detail in &tally.details {
        eprintln!("  {detail}");
    }
    eprintln!("cancel on sqlx: {:?}", started.elapsed());
    assert!(tally.cases > 0, "no case ran");
    assert!(tally.is_clean(), "{tally}");
}
