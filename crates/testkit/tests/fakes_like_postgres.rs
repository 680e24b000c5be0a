//! Where the fakes once answered differently from PostgreSQL (issue 8's reliability suite found
//! each one); every test here failed before its fix.

use std::time::Duration;

use lockstep_core::Transaction as _;
use lockstep_core::{
    DistributedLock, ErrorKind, EventStore, ExpectedVersion, NewEvent, ResourceKey, StreamId,
};
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, InMemoryEventStore};

fn key(name: &str) -> ResourceKey {
    ResourceKey::new(name).expect("valid key")
}

fn event() -> NewEvent {
    NewEvent::new("Happened", serde_json::json!({})).expect("valid event")
}

// Defect 7: Postgres releases an aborted transaction's locks at the error (AbortTransaction),
// not at the ROLLBACK that ends the block; the fake kept them until the transaction ended.
#[tokio::test(start_paused = true)]
async fn a_failed_statement_releases_the_transactions_locks_at_once() {
    let db = FakeDatabase::new();
    let lock = FakeDistributedLock::new(&db);
    let (k0, k1) = (key("abort:0"), key("abort:1"));
    let (a, b, c) = (db.begin_now(), db.begin_now(), db.begin_now());
    assert!(
        lock.try_acquire_for_transaction(&b, &k1)
            .await
            .expect("try")
    );
    assert!(
        lock.try_acquire_for_transaction(&a, &k0)
            .await
            .expect("try")
    );
    // B waits for A's key and times out: its transaction is aborted, not yet rolled back.
    let err = lock
        .acquire_for_transaction(&b, &k0, Some(Duration::from_millis(10)))
        .await
        .expect_err("times out");
    assert_eq!(err.kind(), ErrorKind::LockTimeout);
    assert!(!b.is_usable());
    assert!(
        lock.try_acquire_for_transaction(&c, &k1)
            .await
            .expect("try"),
        "the aborted transaction's lock is released at the error"
    );
    assert_eq!(
        lock.try_acquire_for_transaction(&b, &k1)
            .await
            .expect_err("aborted")
            .kind(),
        ErrorKind::TransactionAborted
    );
    b.rollback().await.expect("rollback");
}

#[tokio::test(start_paused = true)]
async fn a_waiter_for_a_lock_proceeds_when_the_holder_is_aborted() {
    let db = FakeDatabase::new();
    let lock = FakeDistributedLock::new(&db);
    let (k0, k1) = (key("wake:0"), key("wake:1"));
    let (a, b, c) = (db.begin_now(), db.begin_now(), db.begin_now());
    assert!(
        lock.try_acquire_for_transaction(&a, &k0)
            .await
            .expect("try")
    );
    assert!(
        lock.try_acquire_for_transaction(&b, &k1)
            .await
            .expect("try")
    );
    let waiter = {
        let lock = lock.clone();
        let k0 = k0.clone();
        tokio::spawn(async move {
            let result = lock.acquire_for_transaction(&c, &k0, None).await;
            (c, result)
        })
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(db.waiters(&k0), 1);
    // A waits for B's key and times out: A is aborted, and C gets A's key before A rolls back.
    let err = lock
        .acquire_for_transaction(&a, &k1, Some(Duration::from_millis(10)))
        .await
        .expect_err("times out");
    assert_eq!(err.kind(), ErrorKind::LockTimeout);
    let (c, result) = tokio::time::timeout(Duration::from_secs(1), waiter)
        .await
        .expect("the waiter is woken by the abort")
        .expect("task");
    result.expect("C gets the key");
    assert!(a.commit().await.is_err());
    c.commit().await.expect("commit");
    b.commit().await.expect("commit");
    assert!(db.is_idle());
}

// On Postgres a second inserter waiting for a version goes on when the first inserter's
// transaction aborts (its xid lock is released at the error); the fake's reserved versions
// now go at the abort too.
#[tokio::test(start_paused = true)]
async fn an_append_waiting_for_a_version_proceeds_when_its_writer_is_aborted() {
    let db = FakeDatabase::new();
    let (lock, store) = (FakeDistributedLock::new(&db), InMemoryEventStore::new());
    let stream = StreamId::new_v7();
    let k = key("store:abort");
    let (a, b, holder) = (db.begin_now(), db.begin_now(), db.begin_now());
    assert!(
        lock.try_acquire_for_transaction(&holder, &k)
            .await
            .expect("try")
    );
    assert_eq!(
        store
            .append(&a, stream, ExpectedVersion::NoStream, &[event()])
            .await
            .expect("append"),
        1
    );
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move {
            let result = store
                .append(&b, stream, ExpectedVersion::NoStream, &[event()])
                .await;
            (b, result)
        })
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert!(!waiter.is_finished(), "B waits for A's version");
    let err = lock
        .acquire_for_transaction(&a, &k, Some(Duration::from_millis(10)))
        .await
        .expect_err("times out");
    assert_eq!(err.kind(), ErrorKind::LockTimeout);
    let (b, result) = tokio::time::timeout(Duration::from_secs(1), waiter)
        .await
        .expect("B is woken by A's abort")
        .expect("task");
    assert_eq!(result.expect("B's append goes through"), 1);
    b.commit().await.expect("commit");
    a.rollback().await.expect("rollback");
    holder.rollback().await.expect("rollback");
    assert_eq!(store.committed(stream).len(), 1);
    assert!(db.is_idle());
}

// Defect 5: an expected version past i64::MAX is refused by lockstep-pg-store before any SQL
// (InvalidInput, the transaction stays usable); the fake answered Conflict and aborted the
// transaction.
#[tokio::test(start_paused = true)]
async fn an_expected_version_past_i64_max_is_refused_before_anything_happens() {
    let db = FakeDatabase::new();
    let store = InMemoryEventStore::new();
    let stream = StreamId::new_v7();
    let tx = db.begin_now();
    for version in [1u64 << 63, u64::MAX] {
        let expected = ExpectedVersion::Exact(version);
        let err = store
            .append(&tx, stream, expected, &[event()])
            .await
            .expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        let err = store
            .append_at_commit(&tx, stream, expected, &[event()])
            .await
            .expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert!(tx.is_usable(), "refused before anything happened");
    }
    let last = ExpectedVersion::Exact(i64::MAX as u64);
    let err = store
        .append(&tx, stream, last, &[event()])
        .await
        .expect_err("the stream is not at i64::MAX");
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    tx.rollback().await.expect("rollback");
    assert!(store.committed(stream).is_empty());
}
