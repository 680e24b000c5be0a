//! Fake = Postgres, by model (issue 8's suite, part 1), short: the scenario
//! `lockstep_tests::reliability::model` (lease sequences with time advancing and fenced
//! commits, transaction-lock sequences with drops) must agree on every answer, and must catch
//! deliberately wrong fakes.

use lockstep_tests::reliability::{Scale, model};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fakes_answer_like_postgres() {
    let started = std::time::Instant::now();
    let tally = model::run(Scale::Short).await.expect("model scenario");
    eprintln!("model: {tally} in {:?}", started.elapsed());
    for detail in &tally.details {
        eprintln!("  {detail}");
    }
    assert!(tally.cases > 0, "no case ran");
    assert!(tally.is_clean(), "{tally}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_catches_wrong_fakes() {
    let (missed, tally) = model::demonstrate_checks().await.expect("wrong fakes");
    for detail in &tally.details {
        eprintln!("  {detail}");
    }
    assert!(missed.is_empty(), "checks that did not fire: {missed:?}");
    assert_eq!(tally.violations, 1, "{tally}");
    assert!(
        tally.details[0].contains("minimal failing sequence"),
        "{:?}",
        tally.details
    );
}
