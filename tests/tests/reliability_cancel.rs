//! The short run of the cancellation and bad-input scenarios of issue 8's suite
//! (`lockstep_tests::reliability::{cancel, bad_input}`): each must come out clean, having run
//! cases, and the checks they rely on must catch deliberately broken operations.

use lockstep_tests::reliability::{Scale, Tally, bad_input, cancel};

fn report(name: &str, tally: &Tally) {
    eprintln!("{name}: {tally}");
    for detail in &tally.details {
        eprintln!("  {detail}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_dropped_at_every_await_point_leaves_nothing_behind() {
    let started = std::time::Instant::now();
    let tally = cancel::run(Scale::Short).await.expect("cancel scenario");
    report("cancel", &tally);
    eprintln!("cancel: {:?}", started.elapsed());
    assert!(tally.cases > 0, "no case ran");
    assert!(tally.is_clean(), "{tally}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cancellation_checks_catch_broken_operations() {
    let (tally, missed) = cancel::demonstrate_checks().await.expect("broken cases");
    report("cancel checks on broken operations", &tally);
    assert!(tally.cases >= 5, "{tally}");
    assert!(missed.is_empty(), "checks that did not fire: {missed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_is_a_typed_error_that_changes_nothing() {
    let started = std::time::Instant::now();
    let tally = bad_input::run(Scale::Short)
        .await
        .expect("bad-input scenario");
    report("bad input", &tally);
    eprintln!("bad input: {:?}", started.elapsed());
    assert!(tally.cases > 0, "no case ran");
    assert!(tally.is_clean(), "{tally}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bad_input_checks_catch_changes_and_wrong_answers() {
    let missed = bad_input::demonstrate_checks().await.expect("broken cases");
    assert!(missed.is_empty(), "checks that did not fire: {missed:?}");
}
