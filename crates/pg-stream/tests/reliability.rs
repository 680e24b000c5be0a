//! Regression tests for the reliability defects of issue 8 found in the stream locker: values at
//! the limits of storage, cancelled operations, concurrent batches, bad ids, an unmigrated
//! database. Each failed before its fix.

mod common;

use std::time::Duration;

use common::{Db, acquire, long_options};
use lockstep_core::{
    AcquireOutcome, ErrorKind, InstanceId, LeaseEntry, LockReason, StreamId, StreamLockAdmin,
    StreamLockOptions, StreamLocker,
};

/// Issue 8, defect 1: the longest accepted lock timeout writes an expiry that reads back.
#[tokio::test]
async fn the_longest_accepted_lock_timeout_is_written_and_read_back() {
    let db = Db::new(2).await;
    let options =
        StreamLockOptions::new(StreamLockOptions::MAX_LOCK_TIMEOUT, Duration::from_secs(60))
            .expect("100 years is accepted");
    let locker = db.locker(options);
    let (stream, perspective) = db.order_cursor().await;
    let me = InstanceId::random();
    let lease = acquire(&locker, stream, &perspective, me, LockReason::Rewind).await;
    assert!(lease.expires_at.year() >= 2100);
    let denied = locker
        .try_acquire(
            stream,
            &perspective,
            InstanceId::random(),
            &LockReason::Rewind,
        )
        .await
        .expect("a denial reads the stored expiry");
    assert!(matches!(denied, AcquireOutcome::Denied(_)));
    assert_eq!(locker.list_leases().await.expect("listing").len(), 1);
    assert!(locker.renew(&lease.id).await.expect("renew").is_renewed());
}

/// Issue 8, defect 1: an expiry lockstep cannot read (an operator's `'infinity'`) is a typed
/// error naming the row from every operation that reads it — never a panic.
#[tokio::test]
async fn an_infinite_expiry_set_by_an_operator_is_a_typed_error_naming_the_row() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (stream, perspective) = db.order_cursor().await;
    let holder = InstanceId::random();
    let lease = acquire(&locker, stream, &perspective, holder, LockReason::Rewind).await;
    db.client()
        .await
        .execute(
            "UPDATE wh_perspective_cursors SET stream_lock_expiry = 'infinity' \
              WHERE stream_id = $1",
            &[&stream.as_uuid()],
        )
        .await
        .expect("operator update");

    let unreadable = |err: lockstep_core::Error| {
        assert_eq!(err.kind(), ErrorKind::Backend, "{err}");
        assert!(err.message().contains(&stream.to_string()), "{err}");
        assert!(err.message().contains("expiry"), "{err}");
    };
    unreadable(locker.list_leases().await.expect_err("unreadable"));
    unreadable(
        locker
            .inspect(stream, &perspective)
            .await
            .expect_err("unreadable"),
    );
    unreadable(
        locker
            .try_acquire(
                stream,
                &perspective,
                InstanceId::random(),
                &LockReason::Rewind,
            )
            .await
            .expect_err("unreadable"),
    );
    // The holder can still renew (the statement writes a readable expiry) and release.
    assert!(locker.renew(&lease.id).await.expect("renew").is_renewed());
    assert!(
        locker
            .release(&lease.id)
            .await
            .expect("release")
            .is_released()
    );
    assert!(locker.list_leases().await.expect("listing").is_empty());
}

/// Issue 19, defect 7: one row lockstep cannot read (an operator's `'infinity'` expiry, a nil
/// holder, a name that does not validate) does not break the operators' listing: the others are
/// listed, and each bad row is an unreadable entry with its key.
#[tokio::test]
async fn unreadable_rows_are_listed_as_unreadable_beside_the_others() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (good, perspective) = db.order_cursor().await;
    let holder = InstanceId::random();
    acquire(&locker, good, &perspective, holder, LockReason::Rewind).await;
    let (infinite, nil_holder, long_name) =
        (StreamId::new_v7(), StreamId::new_v7(), StreamId::new_v7());
    let name_201 = "N".repeat(201);
    let client = db.client().await;
    for (stream, name, holder, expiry) in [
        (
            infinite,
            perspective.as_str(),
            holder.as_uuid(),
            "'infinity'",
        ),
        (
            nil_holder,
            perspective.as_str(),
            uuid::Uuid::nil(),
            "now() + interval '1 minute'",
        ),
        (
            long_name,
            name_201.as_str(),
            holder.as_uuid(),
            "now() + interval '1 minute'",
        ),
    ] {
        client
            .execute(
                &format!(
                    "INSERT INTO wh_perspective_cursors (stream_id, perspective_name, \
                     stream_lock_instance_id, stream_lock_reason, stream_lock_expiry) \
                     VALUES ($1, $2, $3, 'rewind', {expiry})"
                ),
                &[&stream.as_uuid(), &name, &holder],
            )
            .await
            .expect("an operator's insert");
    }

    let entries = locker.list_lease_entries().await.expect("the listing runs");
    assert_eq!(entries.len(), 4, "{entries:?}");
    let leases: Vec<_> = entries
        .iter()
        .filter_map(|e| match e {
            LeaseEntry::Lease(l) => Some(l),
            LeaseEntry::Unreadable(_) => None,
        })
        .collect();
    assert_eq!(leases.len(), 1, "{entries:?}");
    assert_eq!(
        (leases[0].stream_id, leases[0].holder),
        (good, holder),
        "the readable lease is listed"
    );
    let unreadable = |stream: StreamId| {
        entries
            .iter()
            .find_map(|e| match e {
                LeaseEntry::Unreadable(u) if u.stream_id == stream => Some(u),
                _ => None,
            })
            .unwrap_or_else(|| panic!("{stream} is listed as unreadable: {entries:?}"))
    };
    let bad = unreadable(infinite);
    assert_eq!(bad.perspective, perspective.as_str());
    assert!(bad.problem.contains("stream_lock_expiry"), "{bad:?}");
    assert!(
        unreadable(nil_holder).problem.contains("nil"),
        "{entries:?}"
    );
    assert_eq!(unreadable(long_name).perspective, name_201);

    // The strict listing still refuses to leave a row out.
    let err = locker
        .list_leases()
        .await
        .expect_err("a row cannot be read");
    assert_eq!(err.kind(), ErrorKind::Backend, "{err}");
}

/// Issue 8, defect 3: try-acquire does not wait for a cursor row locked by another transaction
/// (it is busy at once), and nothing is written once that transaction commits — no ghost lease
/// for a caller that gave up. Issue 19, item 11: busy is the outcome `AcquireOutcome::Busy`,
/// not an error.
#[tokio::test(flavor = "multi_thread")]
async fn try_acquire_on_a_row_locked_elsewhere_is_busy_at_once_and_leaves_no_ghost_lease() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (stream, perspective) = db.order_cursor().await;
    let mut other = db.client().await;
    let tx = other.transaction().await.expect("begin");
    tx.execute(
        "SELECT 1 FROM wh_perspective_cursors WHERE stream_id = $1 FOR UPDATE",
        &[&stream.as_uuid()],
    )
    .await
    .expect("row lock held elsewhere (a claim applying events)");

    let outcome = tokio::time::timeout(
        Duration::from_secs(2),
        locker.try_acquire(
            stream,
            &perspective,
            InstanceId::random(),
            &LockReason::Rewind,
        ),
    )
    .await;
    let outcome = outcome
        .expect("try-acquire does not wait for the row lock")
        .expect("a busy row is an outcome, not an error");
    assert_eq!(outcome, AcquireOutcome::Busy);
    assert!(!outcome.is_acquired());

    tx.commit().await.expect("the other transaction commits");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let row = common::inspect_row(&locker, stream, &perspective).await;
    assert!(row.is_unlocked(), "no lease was written: {row:?}");
    assert!(
        locker
            .try_acquire(
                stream,
                &perspective,
                InstanceId::random(),
                &LockReason::Rewind
            )
            .await
            .expect("try_acquire")
            .is_acquired()
    );
}

/// A lease operation whose future is dropped mid-statement (here a renew waiting for a row
/// lock, given up by its caller) leaves no statement running: the
/// renew does not happen when the lock is released, and the pool goes on working.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_lease_operation_leaves_no_statement_running() {
    let db = Db::new(1).await;
    let locker = db.locker(long_options());
    let (stream, perspective) = db.order_cursor().await;
    let lease = acquire(
        &locker,
        stream,
        &perspective,
        InstanceId::random(),
        LockReason::Rewind,
    )
    .await;
    let mut other = db.client().await;
    let tx = other.transaction().await.expect("begin");
    tx.execute(
        "SELECT 1 FROM wh_perspective_cursors WHERE stream_id = $1 FOR UPDATE",
        &[&stream.as_uuid()],
    )
    .await
    .expect("row lock held elsewhere");

    // Dropped once the server shows it waiting for the row (not after a guess at how long it
    // takes to get there): a renew still on its way may run later, like a renew made then.
    let observer = db.client().await;
    let mut renew = Box::pin(locker.renew(&lease.id));
    tokio::select! {
        outcome = &mut renew => panic!("the renew must wait for the row lock: {outcome:?}"),
        () = lockstep_testkit::pg_harness::until_lock_waiters(&observer, 1, "the renew") => {}
    }
    drop(renew);
    // The cancel request ends the server-side wait; nothing of the lease statement is left.
    let mut waiting = i64::MAX;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        waiting = db
            .client()
            .await
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND query LIKE '%stream_lock_expiry%' \
                    AND state = 'active' AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .expect("activity")
            .get(0);
        if waiting == 0 {
            break;
        }
    }
    assert_eq!(waiting, 0, "no lease statement keeps running");
    tx.commit().await.expect("the other transaction commits");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let row = common::inspect_row(&locker, stream, &perspective).await;
    assert_eq!(
        row.expires_at,
        Some(lease.expires_at),
        "the abandoned renew did not run"
    );
    // The pool (one connection) still serves the next call.
    assert!(locker.renew(&lease.id).await.expect("renew").is_renewed());
}

/// Issue 8, defect 4: concurrent batched renews of one instance — small batches (planned as a
/// nested loop, in input order) mixed with large ones (a hash join over a sequential scan, in
/// physical order) — never deadlock: rows are locked in one guaranteed order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_renew_many_batches_of_mixed_sizes_never_deadlock() {
    const LEASES: usize = 600;
    const TASKS: usize = 8;
    const CALLS_PER_TASK: usize = 60;
    let db = Db::new(TASKS).await;
    let locker = db.locker(long_options());
    // Keys inserted in an order unrelated to key order, so the physical order (what a
    // sequential scan sees) differs from the key order (what an index or a sorted input sees).
    let perspective = common::name("OrderPerspective");
    let mut seed = 0x2545_F491_4F6C_DD1D_u64;
    let mut streams = Vec::with_capacity(LEASES);
    for _ in 0..LEASES {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let stream = StreamId::from_uuid(uuid::Uuid::from_u64_pair(seed, seed.rotate_left(29)));
        db.create_cursor(stream, &perspective).await;
        streams.push(stream);
    }
    let me = InstanceId::random();
    let mut leases = Vec::with_capacity(LEASES);
    for stream in &streams {
        leases.push(
            acquire(&locker, *stream, &perspective, me, LockReason::Rewind)
                .await
                .id,
        );
    }
    db.client()
        .await
        .batch_execute("ANALYZE wh_perspective_cursors")
        .await
        .expect("fresh statistics, as autovacuum keeps them");
    let leases = std::sync::Arc::new(leases);
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (locker, leases) = (locker.clone(), std::sync::Arc::clone(&leases));
        tasks.push(tokio::spawn(async move {
            // A small deterministic generator per task (no rand dependency).
            let mut state = 0x9E37_79B9_7F4A_7C15_u64 ^ (task as u64 + 1);
            let mut next = move |bound: usize| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % bound as u64) as usize
            };
            let mut failures = Vec::new();
            for call in 0..CALLS_PER_TASK {
                let size = if call % 2 == 0 {
                    2 + next(6)
                } else {
                    300 + next(300)
                };
                let start = next(LEASES);
                let mut batch: Vec<_> = (0..size)
                    .map(|i| leases[(start + i * 7) % LEASES].clone())
                    .collect();
                if call % 3 == 0 {
                    batch.reverse();
                }
                match locker.renew_many(&batch).await {
                    Ok(outcomes) => assert!(outcomes.iter().all(|o| o.is_renewed())),
                    Err(err) => failures.push(err.kind()),
                }
            }
            failures
        }));
    }
    let mut failures = Vec::new();
    for task in tasks {
        failures.extend(task.await.expect("task"));
    }
    assert!(failures.is_empty(), "renew_many failed: {failures:?}");
}

/// Issue 7 part 6 / issue 8: an error's `Display` carries the database's own message and
/// SQLSTATE, and a database that was never migrated says to run the migrations.
#[tokio::test]
async fn an_unmigrated_database_says_to_run_the_migrations() {
    let db = lockstep_testkit::pg_harness::test_database().await;
    let locker = lockstep_pg_stream::PgStreamLocker::from_pool(db.pool(1), long_options());
    let err = locker
        .try_acquire(
            StreamId::new_v7(),
            &common::name("OrderPerspective"),
            InstanceId::random(),
            &LockReason::Rewind,
        )
        .await
        .expect_err("no schema");
    let shown = err.to_string();
    assert!(shown.contains("wh_perspective_cursors"), "{shown}");
    assert!(shown.contains("does not exist"), "{shown}");
    assert!(shown.contains("SQLSTATE 42P01"), "{shown}");
    assert!(shown.contains("lockstep_pg::migrate"), "{shown}");
    // The message tells the driver error, which is kept (not repeated as the `source()`).
    assert!(std::error::Error::source(&err).is_none(), "said once");
    let driver = err.underlying().expect("the driver error is kept");
    assert!(driver.downcast_ref::<tokio_postgres::Error>().is_some());
    let listing = locker.list_leases().await.expect_err("no schema");
    assert!(
        listing.to_string().contains("run the migrations"),
        "{listing}"
    );
}

/// Issue 7 part 6: a pool that cannot connect shows the server's message and SQLSTATE too.
#[tokio::test]
async fn a_pool_error_shows_the_server_message() {
    let db = lockstep_testkit::pg_harness::test_database().await;
    let mut config = db.config().clone();
    config.dbname("lockstep_no_such_database");
    let manager = deadpool_postgres::Manager::from_config(
        config,
        tokio_postgres::NoTls,
        deadpool_postgres::ManagerConfig::default(),
    );
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(1)
        .build()
        .expect("pool");
    let locker = lockstep_pg_stream::PgStreamLocker::from_pool(pool, long_options());
    let err = locker.list_leases().await.expect_err("no such database");
    let shown = err.to_string();
    assert!(shown.contains("lockstep_no_such_database"), "{shown}");
    assert!(shown.contains("SQLSTATE 3D000"), "{shown}");
}
