//! The mutual-exclusion audit (`lockstep_tests::reliability::audit`), short, on sqlx: each
//! instance's stream locker built with `PgStreamLocker::for_sqlx` on an `sqlx::PgPool` of its
//! own, its fenced commits in `SqlxTransaction`s. The checks are the tokio-postgres run's
//! (`tests/tests/reliability_audit.rs`, which also shows that each of them can fail).

use lockstep_tests::reliability::audit::{self, AuditConfig};
use lockstep_tests::reliability::{Driver, Scale};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_two_holders_overlap_on_the_database_clock_on_sqlx() {
    let config = AuditConfig {
        driver: Driver::Sqlx,
        ..AuditConfig::new(Scale::Short)
    };
    let handle = tokio::spawn(async move { audit::run_report(&config).await });
    let report = handle
        .await
        .expect("the audit does not panic")
        .expect("the audit runs");
    let (tally, stats) = (&report.tally, &report.stats);
    eprintln!("{stats}");
    eprintln!("{tally}");
    for detail in &tally.details {
        eprintln!("  {detail}");
    }
    assert!(tally.is_clean(), "the audit found problems: {tally:#?}");
    assert!(tally.cases > 0, "no lease cycle ran");
    // Leases really expired and changed hands, and the fence really refused stale holders.
    assert!(stats.stalls > 0 && stats.refused_stale > 0, "{stats}");
    assert!(stats.takeovers > 0, "{stats}");
    assert!(stats.fenced_commits > 0, "{stats}");
}
