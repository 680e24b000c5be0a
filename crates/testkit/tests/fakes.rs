//! Behaviour of the fakes beyond the shared suites: what a test author relies on.

use lockstep_core::Transaction as _;
use std::time::Duration;

use lockstep_core::{
    DistributedLock, ErrorKind, InstanceId, LockReason, PerspectiveName, RenewOutcome, ResourceKey,
    SessionLockGuard, SessionLocks, StreamId, StreamLockOptions, StreamLocker,
};
use lockstep_testkit::{
    FakeDatabase, FakeDistributedLock, FakeSessionLocks, FaultyDistributedLock, FaultyStreamLocker,
    InMemoryStreamLocker, RecordingStreamLocker, StreamLockCall, TxEnd,
};

fn key(name: &str) -> ResourceKey {
    ResourceKey::new(name).expect("valid key")
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiting_acquire_leaves_no_ghost_waiter_and_aborts_its_transaction() {
    let db = FakeDatabase::new();
    let lock = FakeDistributedLock::new(&db);
    let k = key("ghost");
    let (a, b) = (db.begin_now(), db.begin_now());
    assert!(lock.try_acquire_for_transaction(&a, &k).await.expect("try"));
    let waited = tokio::time::timeout(
        Duration::from_millis(50),
        lock.acquire_for_transaction(&b, &k, None),
    )
    .await;
    assert!(waited.is_err());
    assert_eq!(db.waiters(&k), 0, "no ghost waiter");
    assert!(
        !b.is_usable(),
        "like Postgres, the interrupted statement aborts the transaction"
    );
    let err = lock
        .try_acquire_for_transaction(&b, &k)
        .await
        .expect_err("aborted");
    assert_eq!(err.kind(), ErrorKind::TransactionAborted);
    assert_eq!(
        b.commit()
            .await
            .expect_err("commit of an aborted tx")
            .kind(),
        ErrorKind::TransactionAborted
    );
    a.commit().await.expect("commit");
    assert!(db.held_keys().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_deadlock_is_reported_to_the_waiter_that_closes_the_cycle() {
    let db = FakeDatabase::new();
    let lock = std::sync::Arc::new(FakeDistributedLock::new(&db));
    let (k1, k2) = (key("k1"), key("k2"));
    let (a, b) = (db.begin_now(), db.begin_now());
    assert!(
        lock.try_acquire_for_transaction(&a, &k1)
            .await
            .expect("try")
    );
    assert!(
        lock.try_acquire_for_transaction(&b, &k2)
            .await
            .expect("try")
    );
    let a_waits = {
        let (lock, k2) = (lock.clone(), k2.clone());
        tokio::spawn(async move {
            let r = lock.acquire_for_transaction(&a, &k2, None).await;
            (a, r)
        })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    let err = lock
        .acquire_for_transaction(&b, &k1, None)
        .await
        .expect_err("deadlock");
    assert_eq!(err.kind(), ErrorKind::Deadlock);
    assert!(err.is_retryable());
    b.rollback().await.expect("rollback");
    let (a, result) = a_waits.await.expect("task");
    result.expect("A gets k2 once B rolled back");
    a.commit().await.expect("commit");
}

#[tokio::test(start_paused = true)]
async fn transaction_end_hooks_see_how_it_ended_and_drop_rolls_back() {
    let db = FakeDatabase::new();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    for commit in [true, false] {
        let tx = db.begin_now();
        let seen = seen.clone();
        tx.on_end(move |end| seen.lock().expect("lock").push(end));
        if commit {
            tx.commit().await.expect("commit");
        } else {
            drop(tx);
        }
    }
    assert_eq!(
        *seen.lock().expect("lock"),
        vec![TxEnd::Committed, TxEnd::RolledBack]
    );
}

#[tokio::test(start_paused = true)]
async fn session_locks_exclude_transactions_and_each_other_until_released() {
    let db = FakeDatabase::new();
    let (sessions, lock) = (FakeSessionLocks::new(&db), FakeDistributedLock::new(&db));
    let k = key("session");
    let guard = sessions
        .try_acquire_session(&k)
        .await
        .expect("try")
        .expect("free");
    assert!(
        sessions
            .try_acquire_session(&k)
            .await
            .expect("try")
            .is_none()
    );
    let tx = db.begin_now();
    assert!(
        !lock
            .try_acquire_for_transaction(&tx, &k)
            .await
            .expect("try")
    );
    let timed_out = sessions
        .acquire_session(&k, Some(Duration::from_millis(20)))
        .await
        .expect_err("held");
    assert_eq!(timed_out.kind(), ErrorKind::LockTimeout);
    guard.release().await.expect("release");
    assert!(
        lock.try_acquire_for_transaction(&tx, &k)
            .await
            .expect("try")
    );
    tx.rollback().await.expect("rollback");
    let dropped = sessions.acquire_session(&k, None).await.expect("acquire");
    assert_eq!(dropped.key(), &k);
    drop(dropped);
    assert!(db.held_keys().is_empty(), "dropping the guard releases");
}

#[tokio::test(start_paused = true)]
async fn a_transaction_from_another_fake_database_is_refused() {
    let (db1, db2) = (FakeDatabase::new(), FakeDatabase::new());
    let lock = FakeDistributedLock::new(&db1);
    let foreign = db2.begin_now();
    let err = lock
        .try_acquire_for_transaction(&foreign, &key("x"))
        .await
        .expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::Unsupported);
}

#[tokio::test(start_paused = true)]
async fn fault_handle_fails_and_loses_renews_then_recovers() {
    let inner = InMemoryStreamLocker::new(StreamLockOptions::default());
    let (stream, name) = (StreamId::new_v7(), PerspectiveName::new("P").expect("name"));
    inner.create_cursor(stream, &name);
    let (locker, faults) = FaultyStreamLocker::new(RecordingStreamLocker::new(inner));
    let lease = locker
        .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("acquire")
        .into_lease()
        .expect("acquired");
    faults.fail_next_renews(2, ErrorKind::ConnectionLost);
    faults.lose_next_renews(1);
    for _ in 0..2 {
        let err = locker.renew(&lease.id).await.expect_err("injected");
        assert_eq!(err.kind(), ErrorKind::ConnectionLost);
    }
    assert_eq!(
        locker.renew(&lease.id).await.expect("renew"),
        RenewOutcome::Lost
    );
    assert!(locker.renew(&lease.id).await.expect("renew").is_renewed());
    // Injected faults never reached the real locker: only the last renew was recorded there.
    let recorded = locker.inner().calls();
    assert_eq!(recorded.len(), 2);
    assert!(matches!(
        recorded[1],
        StreamLockCall::Renew {
            outcome: Ok(RenewOutcome::Renewed { .. }),
            ..
        }
    ));
    assert!(locker.inner().unreleased().contains(&lease.id));

    faults.set_latency(Duration::from_secs(3));
    let before = tokio::time::Instant::now();
    let _ = locker.release(&lease.id).await.expect("release");
    assert!(
        before.elapsed() >= Duration::from_secs(3),
        "latency applied on tokio's clock"
    );
    assert!(locker.inner().unreleased().is_empty());
}

#[tokio::test(start_paused = true)]
async fn faulty_distributed_lock_denies_then_delegates() {
    let db = FakeDatabase::new();
    let (lock, faults) = FaultyDistributedLock::new(FakeDistributedLock::new(&db));
    let tx = db.begin_now();
    faults.deny_next_acquires(1);
    assert!(
        !lock
            .try_acquire_for_transaction(&tx, &key("d"))
            .await
            .expect("try")
    );
    assert!(db.held_keys().is_empty());
    faults.fail_next_acquires(1, ErrorKind::ConnectionLost);
    let err = lock
        .acquire_for_transaction(&tx, &key("d"), None)
        .await
        .expect_err("injected");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost);
    assert!(
        lock.try_acquire_for_transaction(&tx, &key("d"))
            .await
            .expect("try")
    );
    assert_eq!(db.held_keys().len(), 1);
}
