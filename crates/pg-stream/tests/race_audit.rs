//! Race audit: two lockers (two "processes", each with its own pool and instance id) with 16
//! tasks each hammer one `(stream, perspective)` pair for 2 000 cycles per locker
//! (try-acquire → fenced record → release), and three independent records of what happened
//! are checked for two holders at once.
//!
//! 1. **The row's history**, on the database clock: a test-only trigger logs every change of
//!    the cursor row (old and new lease columns, `clock_timestamp()`, a sequence number taken
//!    while the row lock is held, so in the row's own update order). From it the audit rebuilds
//!    the holder intervals (from the update that established an epoch to the one that cleared
//!    it) and checks that no update ever replaced a live holder by another instance, that the
//!    epoch rule held on every update, that each epoch belongs to one holder, and that the
//!    intervals are disjoint and ordered on the database clock.
//! 2. **What the callers were told**: every `Acquired` and `Released` outcome, in memory. Each
//!    acquired epoch must belong to the instance it was granted to, and the number of grants and
//!    releases must equal the number of such updates in the row's history.
//! 3. **The work done under the lease**: inside the held section, each task inserts
//!    `(instance, epoch, clock_timestamp())` in a transaction fenced by `check_lease`. Every
//!    committed record must fall inside its epoch's interval, for the holder of that epoch.
//!
//! The lease timeout is long (60 s), so no lease can legitimately expire during the run: any
//! change of holder without a release in between is a double grant. The tasks of one locker
//! share its instance id, so they may legitimately share its lease (same-instance re-acquire);
//! a task whose sibling released first is refused by the fence and writes nothing.
//!
//! `the_audit_detects_*` tests show that the checks fail on histories with an overlap, both
//! synthetic and produced on a real database by a deliberately broken acquire statement.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use common::{Db, acquire, long_options};
use lockstep_core::Transaction as _;
use lockstep_core::{
    AcquireOutcome, ErrorKind, InstanceId, LeaseFence, LockReason, PerspectiveName, ReleaseOutcome,
    StreamId, StreamLocker,
};
use lockstep_pg::PgTransaction;
use lockstep_pg_stream::PgStreamLocker;
use time::OffsetDateTime;
use uuid::Uuid;

const TASKS_PER_LOCKER: usize = 16;
const CYCLES_PER_LOCKER: usize = 2_000;

const AUDIT_SCHEMA: &str = "
CREATE TABLE lease_log (
    seq        bigint      PRIMARY KEY,
    at         timestamptz NOT NULL,
    old_holder uuid, old_expiry timestamptz, old_epoch bigint NOT NULL,
    new_holder uuid, new_expiry timestamptz, new_epoch bigint NOT NULL
);
CREATE SEQUENCE lease_log_seq;
CREATE FUNCTION log_lease_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lease_log VALUES (
        nextval('lease_log_seq'), clock_timestamp(),
        OLD.stream_lock_instance_id, OLD.stream_lock_expiry, OLD.stream_lock_epoch,
        NEW.stream_lock_instance_id, NEW.stream_lock_expiry, NEW.stream_lock_epoch);
    RETURN NEW;
END $$;
CREATE TRIGGER log_lease_change AFTER UPDATE ON wh_perspective_cursors
    FOR EACH ROW EXECUTE FUNCTION log_lease_change();
CREATE TABLE held_work (
    id       bigserial   PRIMARY KEY,
    instance uuid        NOT NULL,
    epoch    bigint      NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);";

/// One update of the cursor row, as logged by the trigger.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Change {
    seq: i64,
    at: OffsetDateTime,
    old_holder: Option<Uuid>,
    old_expiry: Option<OffsetDateTime>,
    old_epoch: i64,
    new_holder: Option<Uuid>,
    new_expiry: Option<OffsetDateTime>,
    new_epoch: i64,
}

/// One holder interval rebuilt from the row's history.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Interval {
    holder: Uuid,
    epoch: i64,
    from: OffsetDateTime,
    /// `None` while still held at the end of the history.
    until: Option<OffsetDateTime>,
    grants: usize,
}

/// Checks the row's history and rebuilds the holder intervals; returns every violation found.
fn audit_history(changes: &[Change]) -> Result<Vec<Interval>, Vec<String>> {
    let mut violations = Vec::new();
    let mut intervals: Vec<Interval> = Vec::new();
    let mut previous: Option<&Change> = None;
    for c in changes {
        if let Some(p) = previous {
            // A complete, serial history: each update starts from the previous one's result.
            if (c.old_holder, c.old_expiry, c.old_epoch)
                != (p.new_holder, p.new_expiry, p.new_epoch)
            {
                violations.push(format!(
                    "seq {}: does not continue from seq {}",
                    c.seq, p.seq
                ));
            }
            if c.at < p.at {
                violations.push(format!("seq {}: database time went backwards", c.seq));
            }
        }
        previous = Some(c);
        let old_live = match (c.old_holder, c.old_expiry) {
            (Some(_), Some(expiry)) => expiry > c.at,
            _ => false,
        };
        match c.new_holder {
            Some(new_holder) => {
                if old_live && c.old_holder != Some(new_holder) {
                    violations.push(format!(
                        "seq {}: live lease of {:?} (epoch {}) taken by {new_holder} (epoch {})",
                        c.seq, c.old_holder, c.old_epoch, c.new_epoch
                    ));
                }
                let refresh = old_live && c.old_holder == Some(new_holder);
                let expected = if refresh {
                    c.old_epoch
                } else {
                    c.old_epoch + 1
                };
                if c.new_epoch != expected {
                    violations.push(format!(
                        "seq {}: epoch {} -> {} where the rule gives {expected}",
                        c.seq, c.old_epoch, c.new_epoch
                    ));
                }
                if refresh {
                    // Same holder, same epoch: a re-acquire of the open interval (the race
                    // runs no renews, so every refresh is a grant).
                    match intervals.last_mut() {
                        Some(open) if open.until.is_none() && open.epoch == c.new_epoch => {
                            open.grants += 1;
                        }
                        _ => violations.push(format!("seq {}: refresh outside an interval", c.seq)),
                    }
                } else {
                    if let Some(open) = intervals.last_mut() {
                        // A takeover of an expired lease ends the old interval at its expiry.
                        if open.until.is_none() {
                            open.until = c.old_expiry;
                        }
                    }
                    intervals.push(Interval {
                        holder: new_holder,
                        epoch: c.new_epoch,
                        from: c.at,
                        until: None,
                        grants: 1,
                    });
                }
            }
            None => {
                // A release keeps the epoch and closes the open interval.
                if c.new_epoch != c.old_epoch {
                    violations.push(format!("seq {}: release changed the epoch", c.seq));
                }
                match intervals.last_mut() {
                    Some(open) if open.until.is_none() && open.epoch == c.old_epoch => {
                        open.until = Some(c.at);
                    }
                    _ => violations.push(format!("seq {}: release outside an interval", c.seq)),
                }
            }
        }
    }
    // Epochs unique per holder interval; intervals disjoint and ordered on the database clock.
    let mut owner: HashMap<i64, Uuid> = HashMap::new();
    for interval in &intervals {
        if let Some(other) = owner.insert(interval.epoch, interval.holder) {
            violations.push(format!(
                "epoch {} granted to {other} and to {}",
                interval.epoch, interval.holder
            ));
        }
    }
    for pair in intervals.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        match a.until {
            Some(until) if until <= b.from => {}
            _ => violations.push(format!(
                "interval of {} (epoch {}) overlaps the next one of {} (epoch {}) starting {}",
                a.holder, a.epoch, b.holder, b.epoch, b.from
            )),
        }
        if b.epoch <= a.epoch {
            violations.push(format!("epoch {} follows epoch {}", b.epoch, a.epoch));
        }
    }
    if violations.is_empty() {
        Ok(intervals)
    } else {
        Err(violations)
    }
}

/// Checks that every fenced record lies in the interval of its epoch, held by its instance.
fn audit_work(intervals: &[Interval], work: &[(Uuid, i64, OffsetDateTime)]) -> Vec<String> {
    let by_epoch: HashMap<i64, &Interval> = intervals.iter().map(|i| (i.epoch, i)).collect();
    let mut violations = Vec::new();
    for (instance, epoch, at) in work {
        match by_epoch.get(epoch) {
            Some(i)
                if i.holder == *instance && i.from <= *at && i.until.is_none_or(|u| *at <= u) => {}
            Some(i) => violations.push(format!(
                "work of {instance} at {at} under epoch {epoch} is outside that epoch's interval \
                 ({} from {} until {:?})",
                i.holder, i.from, i.until
            )),
            None => violations.push(format!("work of {instance} under unknown epoch {epoch}")),
        }
    }
    violations
}

/// A database of the test's own with the audit trigger and tables, and a client on it.
async fn audited_db(pool_size: usize) -> (Db, tokio_postgres::Client) {
    let db = Db::new(pool_size).await;
    let setup = db.client().await;
    setup
        .batch_execute(AUDIT_SCHEMA)
        .await
        .expect("audit schema");
    (db, setup)
}

async fn load_history(client: &tokio_postgres::Client) -> Vec<Change> {
    client
        .query("SELECT * FROM lease_log ORDER BY seq", &[])
        .await
        .expect("reading the lease log")
        .iter()
        .map(|r| Change {
            seq: r.get("seq"),
            at: r.get("at"),
            old_holder: r.get("old_holder"),
            old_expiry: r.get("old_expiry"),
            old_epoch: r.get("old_epoch"),
            new_holder: r.get("new_holder"),
            new_expiry: r.get("new_expiry"),
            new_epoch: r.get("new_epoch"),
        })
        .collect()
}

/// What the lockers told their callers.
#[derive(Debug, Default)]
struct Outcomes {
    acquired: Vec<(Uuid, i64)>,
    released: Vec<(Uuid, i64)>,
    denied: usize,
    fenced_out: usize,
}

async fn run_task(
    locker: PgStreamLocker,
    instance: InstanceId,
    stream: StreamId,
    perspective: PerspectiveName,
    cycles: usize,
    outcomes: Arc<Mutex<Outcomes>>,
) {
    for _ in 0..cycles {
        let outcome = match locker
            .try_acquire(stream, &perspective, instance, &LockReason::Rewind)
            .await
        {
            Ok(outcome) => outcome,
            Err(err) => panic!("try_acquire runs: {err:?}"),
        };
        let lease = match outcome {
            AcquireOutcome::Acquired(lease) => lease,
            // Busy: the row is locked by another task's statement or fenced commit, which a
            // caller treats like a denial (try-acquire never waits; ADR 0002, addenda).
            AcquireOutcome::Denied(_) | AcquireOutcome::Busy => {
                outcomes.lock().expect("outcome log").denied += 1;
                tokio::task::yield_now().await;
                continue;
            }
            AcquireOutcome::NoCursor => panic!("the cursor row exists"),
        };
        let epoch = lease.id.epoch.get();
        outcomes
            .lock()
            .expect("outcome log")
            .acquired
            .push((instance.as_uuid(), epoch));

        // The held section: work committed only under the fence.
        let tx = PgTransaction::begin(locker.pool().expect("a deadpool pool"))
            .await
            .expect("begin");
        match locker.check_lease(&tx, &lease.id).await {
            Ok(()) => {
                tx.client()
                    .execute(
                        "INSERT INTO held_work (instance, epoch) VALUES ($1, $2)",
                        &[&instance.as_uuid(), &epoch],
                    )
                    .await
                    .expect("recording the held section");
                tx.commit().await.expect("fenced commit");
            }
            Err(e) if e.kind() == ErrorKind::LeaseLost => {
                // A sibling task of this instance released the shared lease first.
                tx.rollback().await.expect("rollback");
                outcomes.lock().expect("outcome log").fenced_out += 1;
            }
            Err(e) => panic!("fence check failed: {e}"),
        }

        if locker.release(&lease.id).await.expect("release runs") == ReleaseOutcome::Released {
            outcomes
                .lock()
                .expect("outcome log")
                .released
                .push((instance.as_uuid(), epoch));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_lockers_racing_on_one_pair_never_hold_it_at_the_same_time() {
    let (db, setup) = audited_db(4).await;
    let (stream, perspective) = db.order_cursor().await;

    let outcomes = Arc::new(Mutex::new(Outcomes::default()));
    let mut tasks = Vec::new();
    let instances = [InstanceId::random(), InstanceId::random()];
    for instance in instances {
        let locker = PgStreamLocker::from_pool(db.other_pool(8), long_options());
        for _ in 0..TASKS_PER_LOCKER {
            tasks.push(tokio::spawn(run_task(
                locker.clone(),
                instance,
                stream,
                perspective.clone(),
                CYCLES_PER_LOCKER / TASKS_PER_LOCKER,
                Arc::clone(&outcomes),
            )));
        }
    }
    for task in tasks {
        task.await.expect("a racing task panicked");
    }

    // 1. The row's history.
    let history = load_history(&setup).await;
    let intervals = audit_history(&history).unwrap_or_else(|v| panic!("lease overlap: {v:#?}"));
    let last = history.last().expect("the row changed");
    assert_eq!(last.new_holder, None, "every task released what it held");
    assert!(
        intervals.iter().all(|i| i.until.is_some()),
        "every interval ended"
    );

    // 2. What the callers were told agrees with the row's history.
    let outcomes = std::mem::take(&mut *outcomes.lock().expect("outcome log"));
    let owner: HashMap<i64, Uuid> = intervals.iter().map(|i| (i.epoch, i.holder)).collect();
    for (instance, epoch) in &outcomes.acquired {
        assert_eq!(
            owner.get(epoch),
            Some(instance),
            "epoch {epoch} was granted to {instance} but the row says otherwise"
        );
    }
    let grants_in_history: usize = intervals.iter().map(|i| i.grants).sum();
    assert_eq!(outcomes.acquired.len(), grants_in_history);
    let mut released: Vec<(Uuid, i64)> = outcomes.released.clone();
    released.sort_by_key(|&(_, epoch)| epoch);
    let closed: Vec<(Uuid, i64)> = intervals.iter().map(|i| (i.holder, i.epoch)).collect();
    assert_eq!(released, closed, "exactly one release ended each interval");

    // 3. The fenced work lies inside the intervals.
    let work: Vec<(Uuid, i64, OffsetDateTime)> = setup
        .query("SELECT instance, epoch, at FROM held_work ORDER BY id", &[])
        .await
        .expect("reading the held work")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let violations = audit_work(&intervals, &work);
    assert!(
        violations.is_empty(),
        "work outside its lease: {violations:#?}"
    );
    assert_eq!(
        work.len() + outcomes.fenced_out,
        outcomes.acquired.len(),
        "every grant either recorded its work or was fenced out"
    );

    // The race really happened: both instances held the pair, and it changed hands.
    let per_holder: BTreeMap<Uuid, usize> = intervals.iter().fold(BTreeMap::new(), |mut m, i| {
        *m.entry(i.holder).or_default() += 1;
        m
    });
    assert_eq!(
        per_holder.len(),
        2,
        "both instances held the lease: {per_holder:?}"
    );
    assert!(outcomes.denied > 0, "the instances contended");
    eprintln!(
        "race audit: {} grants, {} intervals, {} denials, {} fenced out, {} records",
        outcomes.acquired.len(),
        intervals.len(),
        outcomes.denied,
        outcomes.fenced_out,
        work.len()
    );
}

fn at(ms: i64) -> OffsetDateTime {
    OffsetDateTime::UNIX_EPOCH + time::Duration::milliseconds(ms)
}

fn change(
    seq: i64,
    at_ms: i64,
    old: (Option<Uuid>, Option<i64>, i64),
    new: (Option<Uuid>, Option<i64>, i64),
) -> Change {
    Change {
        seq,
        at: at(at_ms),
        old_holder: old.0,
        old_expiry: old.1.map(at),
        old_epoch: old.2,
        new_holder: new.0,
        new_expiry: new.1.map(at),
        new_epoch: new.2,
    }
}

#[test]
fn the_audit_detects_a_live_lease_taken_by_another_holder() {
    let (a, b) = (Some(Uuid::from_u128(0xa)), Some(Uuid::from_u128(0xb)));
    let clean = vec![
        change(1, 0, (None, None, 0), (a, Some(60_000), 1)),
        change(2, 10, (a, Some(60_000), 1), (None, None, 1)),
        change(3, 20, (None, None, 1), (b, Some(60_020), 2)),
        change(4, 30, (b, Some(60_020), 2), (None, None, 2)),
    ];
    let intervals = audit_history(&clean).expect("a clean history passes");
    assert_eq!(intervals.len(), 2);

    // B takes A's live lease (a broken acquire), bumping the epoch as if it were free.
    let stolen = vec![
        change(1, 0, (None, None, 0), (a, Some(60_000), 1)),
        change(2, 10, (a, Some(60_000), 1), (b, Some(60_010), 2)),
    ];
    let violations = audit_history(&stolen).expect_err("a stolen lease is caught");
    assert!(
        violations.iter().any(|v| v.contains("live lease")),
        "{violations:?}"
    );

    // A double grant that keeps the epoch: two holders for epoch 1.
    let shared_epoch = vec![
        change(1, 0, (None, None, 0), (a, Some(60_000), 1)),
        change(2, 10, (a, Some(60_000), 1), (b, Some(60_010), 1)),
    ];
    assert!(audit_history(&shared_epoch).is_err());

    // Work recorded by A after B's interval began is caught even if the row looks clean.
    let late_work = [(Uuid::from_u128(0xa), 1, at(25))];
    assert!(!audit_work(&intervals, &late_work).is_empty());
    assert!(audit_work(&intervals, &[(Uuid::from_u128(0xa), 1, at(5))]).is_empty());
}

#[tokio::test]
async fn the_audit_detects_an_overlap_produced_by_a_broken_acquire_on_a_real_database() {
    let (db, setup) = audited_db(2).await;
    let locker = db.locker(long_options());
    let (stream, perspective) = db.order_cursor().await;
    let (a, b) = (InstanceId::random(), InstanceId::random());
    acquire(&locker, stream, &perspective, a, LockReason::Rewind).await;
    // The classic bug: an acquire that forgets to check the current holder.
    setup
        .execute(
            "UPDATE wh_perspective_cursors \
                SET stream_lock_instance_id = $3, stream_lock_reason = 'rewind', \
                    stream_lock_expiry = clock_timestamp() + interval '60 s', \
                    stream_lock_epoch = stream_lock_epoch + 1 \
              WHERE stream_id = $1 AND perspective_name = $2",
            &[&stream.as_uuid(), &perspective.as_str(), &b.as_uuid()],
        )
        .await
        .expect("the broken acquire");
    let history = load_history(&setup).await;
    let violations = audit_history(&history).expect_err("the broken acquire is caught");
    assert!(
        violations.iter().any(|v| v.contains("live lease")),
        "{violations:?}"
    );
}
