//! The mutual-exclusion audit of issue 8's suite, short: instances × pairs racing on a real
//! database with stalls past the lock timeout and fenced commits (`lockstep_tests::reliability::
//! audit`); the long run is `cargo run --release -p lockstep-bench -- reliability`.
//!
//! The other tests show that every check can fail: synthetic histories with an overlap, a
//! double grant, an epoch going down, stale and misplaced fenced records, a ghost lease and a
//! lost commit; and a real run whose holders skip the fence.

use lockstep_tests::reliability::audit::{
    self, AuditConfig, Change, End, Fence, FencedRecord, Interval, Micros, Told, audit_history,
    audit_records, audit_told,
};
use lockstep_tests::reliability::{Scale, Tally};
use std::time::Duration;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_two_holders_overlap_on_the_database_clock() {
    // `audit::run(Scale::Short)` is exactly this, without the figures.
    let report = audit::run_report(&AuditConfig::new(Scale::Short))
        .await
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_catches_holders_that_skip_the_fence() {
    // Smaller than the real run (it shares the server's connections with it): 2 instances x 4
    // pairs, 10 connections.
    let config = AuditConfig {
        fence: Fence::Skipped,
        instances: 2,
        streams: 2,
        max_duration: Duration::from_secs(3),
        ..AuditConfig::new(Scale::Short)
    };
    let report = audit::run_report(&config).await.expect("the audit runs");
    let tally = &report.tally;
    eprintln!("{}\n{tally}", report.stats);
    assert!(report.stats.stalls > 0, "{}", report.stats);
    assert!(tally.violations > 0, "a broken fence went unnoticed");
    assert!(
        tally.details.iter().any(|d| d.contains("stale commit")),
        "{:#?}",
        tally.details
    );
    assert!(
        tally
            .details
            .iter()
            .any(|d| d.contains("stalled holder's fenced commit was committed")),
        "{:#?}",
        tally.details
    );
}

const A: Uuid = Uuid::from_u128(0xa);
const B: Uuid = Uuid::from_u128(0xb);
const TIMEOUT: Micros = 500_000;

fn change(
    seq: i64,
    at: Micros,
    old: (Option<Uuid>, Option<Micros>, i64),
    new: (Option<Uuid>, Option<Micros>, i64),
) -> Change {
    Change {
        seq,
        at,
        old_holder: old.0,
        old_expiry: old.1,
        old_epoch: old.2,
        new_holder: new.0,
        new_expiry: new.1,
        new_epoch: new.2,
    }
}

/// A is granted epoch 1 at 0, renews at 200 ms and releases at 300 ms; B is granted epoch 2 at
/// 400 ms and stalls; A takes B's expired lease (expiry 900 ms) over at 1 000 ms (epoch 3) and
/// releases it at 1 100 ms.
fn clean_history() -> Vec<Change> {
    vec![
        change(1, 0, (None, None, 0), (Some(A), Some(TIMEOUT), 1)),
        change(
            2,
            200_000,
            (Some(A), Some(TIMEOUT), 1),
            (Some(A), Some(700_000), 1),
        ),
        change(3, 300_000, (Some(A), Some(700_000), 1), (None, None, 1)),
        change(4, 400_000, (None, None, 1), (Some(B), Some(900_000), 2)),
        change(
            5,
            1_000_000,
            (Some(B), Some(900_000), 2),
            (Some(A), Some(1_500_000), 3),
        ),
        change(6, 1_100_000, (Some(A), Some(1_500_000), 3), (None, None, 3)),
    ]
}

fn record(instance: Uuid, epoch: i64, tx_start: Micros, at: Micros) -> FencedRecord {
    FencedRecord {
        attempt: Uuid::new_v4(),
        instance,
        epoch,
        stalled: false,
        tx_start,
        at,
    }
}

fn clean_intervals() -> Vec<Interval> {
    let mut tally = Tally::default();
    let history = audit_history("clean", &clean_history(), &mut tally);
    assert!(tally.is_clean(), "{tally:#?}");
    history.intervals
}

#[test]
fn a_clean_history_passes_and_rebuilds_its_intervals() {
    let mut tally = Tally::default();
    let history = audit_history("clean", &clean_history(), &mut tally);
    assert!(tally.is_clean(), "{tally:#?}");
    assert_eq!(history.takeovers, 1);
    let ends: Vec<(Uuid, i64, Option<End>)> = history
        .intervals
        .iter()
        .map(|i| (i.holder, i.epoch, i.end))
        .collect();
    assert_eq!(
        ends,
        vec![
            (A, 1, Some(End::Released(300_000))),
            (B, 2, Some(End::TakenOver(1_000_000))),
            (A, 3, Some(End::Released(1_100_000))),
        ]
    );
    // The renew moved A's expiry; B's right ended at its expiry, before the takeover.
    assert_eq!(history.intervals[0].expiry_as_of(250_000), Some(700_000));
    assert_eq!(history.intervals[1].right_until(), Some(900_000));
}

#[test]
fn the_audit_catches_a_live_lease_taken_by_another_holder() {
    // B takes A's live lease (a broken acquire), bumping the epoch as if it were free.
    let stolen = vec![
        change(1, 0, (None, None, 0), (Some(A), Some(TIMEOUT), 1)),
        change(
            2,
            100_000,
            (Some(A), Some(TIMEOUT), 1),
            (Some(B), Some(600_000), 2),
        ),
    ];
    let mut tally = Tally::default();
    audit_history("stolen", &stolen, &mut tally);
    assert!(
        tally.details.iter().any(|d| d.contains("live lease")),
        "{tally:#?}"
    );
    assert!(
        tally.details.iter().any(|d| d.contains("overlaps")),
        "{tally:#?}"
    );
}

#[test]
fn the_audit_catches_a_double_grant_that_keeps_the_epoch() {
    let shared = vec![
        change(1, 0, (None, None, 0), (Some(A), Some(TIMEOUT), 1)),
        change(
            2,
            100_000,
            (Some(A), Some(TIMEOUT), 1),
            (Some(B), Some(600_000), 1),
        ),
    ];
    let mut tally = Tally::default();
    audit_history("shared", &shared, &mut tally);
    assert!(tally.violations >= 2, "{tally:#?}");
    assert!(
        tally.details.iter().any(|d| d.contains("rule gives 2")),
        "{tally:#?}"
    );
}

#[test]
fn the_audit_catches_epochs_that_do_not_grow() {
    // Released at epoch 2, then granted again at epoch 1 (an epoch reset).
    let reset = vec![
        change(1, 0, (None, None, 1), (Some(A), Some(TIMEOUT), 2)),
        change(2, 100_000, (Some(A), Some(TIMEOUT), 2), (None, None, 2)),
        change(3, 200_000, (None, None, 2), (Some(B), Some(700_000), 1)),
    ];
    let mut tally = Tally::default();
    audit_history("reset", &reset, &mut tally);
    assert!(
        tally.details.iter().any(|d| d.contains("went down")),
        "{tally:#?}"
    );
    assert!(
        tally
            .details
            .iter()
            .any(|d| d.contains("was granted after epoch")),
        "{tally:#?}"
    );

    // A renew that resurrects an expired lease keeps the epoch where the rule wants + 1.
    let resurrected = vec![
        change(1, 0, (None, None, 0), (Some(A), Some(TIMEOUT), 1)),
        change(
            2,
            600_000,
            (Some(A), Some(TIMEOUT), 1),
            (Some(A), Some(1_100_000), 1),
        ),
    ];
    let mut tally = Tally::default();
    audit_history("resurrected", &resurrected, &mut tally);
    assert!(
        tally.details.iter().any(|d| d.contains("rule gives 2")),
        "{tally:#?}"
    );

    // A gap in the log (an update that does not continue from the previous one).
    let gap = vec![
        change(1, 0, (None, None, 0), (Some(A), Some(TIMEOUT), 1)),
        change(3, 100_000, (None, None, 1), (Some(B), Some(600_000), 2)),
    ];
    let mut tally = Tally::default();
    audit_history("gap", &gap, &mut tally);
    assert!(
        tally
            .details
            .iter()
            .any(|d| d.contains("does not continue")),
        "{tally:#?}"
    );
}

#[test]
fn fenced_records_inside_their_intervals_pass() {
    let intervals = clean_intervals();
    let records = vec![
        record(A, 1, 10_000, 250_000),
        // B's record committed late but before the takeover: the fence held the row.
        record(B, 2, 450_000, 950_000),
        record(A, 3, 1_010_000, 1_050_000),
    ];
    let mut tally = Tally::default();
    audit_records("clean", &intervals, &records, &mut tally);
    assert!(tally.is_clean(), "{tally:#?}");
}

#[test]
fn the_audit_catches_a_stale_fenced_commit() {
    let intervals = clean_intervals();
    // B stalled: its transaction began at 950 ms, after its lease expired at 900 ms, and it
    // still committed (before the takeover, so only the expiry gives it away).
    let stale = vec![record(B, 2, 950_000, 960_000)];
    let mut tally = Tally::default();
    audit_records("stale", &intervals, &stale, &mut tally);
    assert!(
        tally.details.iter().any(|d| d.contains("stale commit")),
        "{tally:#?}"
    );

    // The same, flagged by the holder as written after a stall.
    let stalled = vec![FencedRecord {
        stalled: true,
        ..record(B, 2, 450_000, 460_000)
    }];
    let mut tally = Tally::default();
    audit_records("stalled", &intervals, &stalled, &mut tally);
    assert!(
        tally
            .details
            .iter()
            .any(|d| d.contains("stalled holder's fenced commit was committed")),
        "{tally:#?}"
    );
}

#[test]
fn the_audit_catches_misplaced_fenced_records() {
    let intervals = clean_intervals();
    let cases: Vec<(FencedRecord, &str)> = vec![
        // After A's release.
        (record(A, 1, 10_000, 350_000), "after the lease ended"),
        // After the successor took B's lease over.
        (record(B, 2, 450_000, 1_020_000), "after the lease ended"),
        // Written by the wrong instance.
        (record(B, 1, 10_000, 20_000), "non-holder"),
        // Under an epoch nobody was granted.
        (record(A, 7, 10_000, 20_000), "never granted"),
        // Before the grant.
        (record(B, 2, 300_000, 350_000), "precedes the grant"),
    ];
    for (bad, expected) in cases {
        let mut tally = Tally::default();
        audit_records("bad", &intervals, std::slice::from_ref(&bad), &mut tally);
        assert!(
            tally.details.iter().any(|d| d.contains(expected)),
            "{bad:?} should give {expected:?}: {tally:#?}"
        );
    }

    // Interleaved critical sections: epoch 1 writes after epoch 2 did.
    let interleaved = vec![
        record(B, 2, 450_000, 460_000),
        record(A, 1, 10_000, 470_000),
    ];
    let mut tally = Tally::default();
    audit_records("interleaved", &intervals, &interleaved, &mut tally);
    assert!(
        tally.details.iter().any(|d| d.contains("follows a record")),
        "{tally:#?}"
    );
}

#[test]
fn the_audit_catches_what_the_callers_were_told_wrongly() {
    let intervals = clean_intervals();
    let committed = record(A, 1, 10_000, 250_000);
    let told = Told {
        acquired: vec![(A, 1), (B, 2), (A, 3)],
        released: vec![(A, 1), (A, 3)],
        committed: vec![committed.attempt],
        refused: vec![Uuid::new_v4()],
    };
    let mut tally = Tally::default();
    audit_told(
        "clean",
        &intervals,
        std::slice::from_ref(&committed),
        &told,
        &mut tally,
    );
    assert!(tally.is_clean(), "{tally:#?}");

    // A ghost lease (epoch 2 was never reported to its caller), a grant the history gives to
    // someone else, a release of an interval that was taken over, an acknowledged commit that
    // is missing, and a refused commit that is stored.
    let refused = record(A, 3, 1_010_000, 1_050_000);
    let told = Told {
        acquired: vec![(A, 1), (B, 3)],
        released: vec![(A, 1), (B, 2), (A, 3)],
        committed: vec![Uuid::new_v4()],
        refused: vec![refused.attempt],
    };
    let mut tally = Tally::default();
    audit_told(
        "wrong",
        &intervals,
        std::slice::from_ref(&refused),
        &told,
        &mut tally,
    );
    for expected in [
        "ghost lease",
        "which the row's history gives",
        "told released = true",
        "was refused, yet",
    ] {
        assert!(
            tally.details.iter().any(|d| d.contains(expected)),
            "{expected:?}: {tally:#?}"
        );
    }
    assert_eq!(tally.lost, 1, "{tally:#?}");
}
