//! The transaction-scoped advisory locks on sqlx (`SqlxDistributedLock` on `SqlxTransaction`s)
//! against a real PostgreSQL, a database per test: the same distributed-lock conformance suite
//! as on tokio-postgres, one test per case, the aggregate write lock from a spawned handler, and
//! an abandoned wait ended at the server (sqlx has no cancel key: `pg_cancel_backend`).

use std::time::Duration;

use lockstep_core::{
    AggregateType, AggregateWriteLock, DistributedLock, ErrorKind, ResourceKey, SessionLockGuard,
    SessionLocks, Transaction as _, TransactionSource as _,
};
use lockstep_pg::sqlx::{SqlxDatabase, SqlxTransaction};
use lockstep_pg_advisory::SqlxDistributedLock;
use lockstep_testkit::conformance::distributed_lock::DistributedLockFixture;
use lockstep_testkit::pg_harness::{TestDatabase, lock_waiters, test_database, until_lock_waiters};
use uuid::Uuid;

struct Fixture {
    _db: TestDatabase,
    source: SqlxDatabase,
    lock: SqlxDistributedLock,
}

impl DistributedLockFixture for Fixture {
    type Tx = SqlxTransaction;
    type Source = SqlxDatabase;
    type Lock = SqlxDistributedLock;

    fn lock(&self) -> &SqlxDistributedLock {
        &self.lock
    }

    fn source(&self) -> &SqlxDatabase {
        &self.source
    }
}

/// A migrated database of the test's own and its sqlx handle (`pool_size` connections).
async fn setup(pool_size: u32, local_queue: bool) -> (TestDatabase, SqlxDatabase) {
    let db = test_database().await;
    // The lock statements call the SQL function `lockstep_advisory_lock`.
    lockstep_pg::migrate(&db.pool(1)).await.expect("migrate");
    let source = SqlxDatabase::new(db.sqlx_pool(pool_size))
        .with_lock_queue(lockstep_pg::LockQueue::new().with_local_queue(local_queue));
    (db, source)
}

async fn fixture(local_queue: bool) -> Fixture {
    let (db, source) = setup(8, local_queue).await;
    let lock = SqlxDistributedLock::new(&source);
    Fixture {
        _db: db,
        source,
        lock,
    }
}

/// The distributed-lock conformance suite on sqlx, one test per case.
mod distributed_lock_suite {
    use super::*;

    lockstep_testkit::distributed_lock_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(true).await,
    }
}

/// The session-lock conformance suite on sqlx, one test per case.
mod session_lock_suite {
    use super::*;

    lockstep_testkit::session_lock_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(true).await,
    }
}

/// The suite with the in-process queue off.
mod distributed_lock_suite_without_the_local_queue {
    use super::*;

    lockstep_testkit::distributed_lock_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(false).await,
    }
}

fn fresh_key() -> ResourceKey {
    ResourceKey::new(format!("test:{}", Uuid::new_v4())).expect("key")
}

/// The pids of this database's idle backends (pooled connections outside a transaction).
async fn idle_pids(db: &TestDatabase) -> Vec<i32> {
    let client = db.connect().await;
    client
        .query(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
             AND state = 'idle' AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .expect("pg_stat_activity")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// An acquire abandoned while it waits at the server is ended there (`pg_cancel_backend` of
/// its backend), its connection is closed rather than pooled, and the pool stays healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_wait_is_ended_at_the_server_and_its_connection_is_not_pooled() {
    let (db, source) = setup(3, true).await;
    let lock = SqlxDistributedLock::new(&source);
    let admin = db.connect().await;
    let key = fresh_key();
    let holder = source.begin().await.expect("begin");
    assert!(
        lock.try_acquire_for_transaction(&holder, &key)
            .await
            .expect("try")
    );

    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let waiter = tokio::spawn({
        let (source, lock, key) = (source.clone(), lock.clone(), key.clone());
        async move {
            let tx = source.begin().await.expect("begin");
            let _ = pid_tx.send(tx.backend_pid());
            // Waits until the task is aborted.
            let waited = lock.acquire_for_transaction(&tx, &key, None).await;
            (tx, waited)
        }
    });
    let waiter_pid = pid_rx.await.expect("the waiter's pid");
    until_lock_waiters(&admin, 1, "the waiter").await;
    waiter.abort();
    assert!(waiter.await.expect_err("aborted").is_cancelled());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while lock_waiters(&admin).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server-side wait was not ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(lock.queue().locally_queued_keys(), 0);
    holder.commit().await.expect("commit");

    // Every pooled connection works and the key is free; the waiter's connection is gone.
    let txs = [
        source.begin().await.expect("begin"),
        source.begin().await.expect("begin"),
        source.begin().await.expect("begin"),
    ];
    assert!(
        lock.try_acquire_for_transaction(&txs[0], &key)
            .await
            .expect("try")
    );
    let pids: Vec<i32> = txs.iter().map(SqlxTransaction::backend_pid).collect();
    assert!(
        !pids.contains(&waiter_pid),
        "the abandoned waiter's connection is closed, not pooled"
    );
    for tx in txs {
        tx.rollback().await.expect("rollback");
    }
    let idle = idle_pids(&db).await;
    assert!(pids.iter().all(|pid| idle.contains(pid)), "{idle:?}");
    assert!(!idle.contains(&waiter_pid), "{idle:?}");
}

/// The aggregate write lock (`relay:aggregate:{type}:{id}`) from handlers on spawned tasks:
/// the second waits for the first to commit, with a bounded wait that times out typed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_aggregate_write_lock_queues_handlers_on_sqlx() {
    let (db, source) = setup(4, true).await;
    let admin = db.connect().await;
    let lock = SqlxDistributedLock::new(&source).aggregate_write_lock();
    let item = AggregateType::new("StockItem").expect("type");
    let id = Uuid::now_v7();

    let first = source.begin().await.expect("begin");
    lock.acquire(&first, &item, id).await.expect("lock");
    let second = tokio::spawn({
        let (source, lock, item) = (source.clone(), lock.clone(), item.clone());
        async move {
            let tx: SqlxTransaction = source.begin().await?;
            lock.acquire(&tx, &item, id).await?;
            tx.commit().await
        }
    });
    until_lock_waiters(&admin, 1, "the second handler").await;
    let third = tokio::spawn({
        let lock = lock.clone().with_timeout(Duration::from_millis(50));
        let (source, item) = (source.clone(), item.clone());
        async move {
            let tx: SqlxTransaction = source.begin().await?;
            let err = lock.acquire(&tx, &item, id).await.expect_err("held");
            tx.rollback().await?;
            Ok::<_, lockstep_core::Error>(err.kind())
        }
    });
    assert_eq!(
        third.await.expect("task").expect("rollback"),
        ErrorKind::LockTimeout
    );
    first.commit().await.expect("commit");
    second
        .await
        .expect("task")
        .expect("the second handler got the lock");
}

/// A session acquire abandoned while it waits at the server is ended there (`pg_cancel_backend`),
/// and the key is free once the holder releases it; a dropped guard's connection is closed and
/// the server frees its key. From spawned tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_session_wait_ends_at_the_server_and_nothing_is_pooled_dirty() {
    let (db, source) = setup(3, true).await;
    let lock = SqlxDistributedLock::new(&source);
    let admin = db.connect().await;
    let key = fresh_key();
    let guard = tokio::spawn({
        let (lock, key) = (lock.clone(), key.clone());
        async move { lock.acquire_session(&key, None).await }
    })
    .await
    .expect("task")
    .expect("lock");
    let waiter = tokio::spawn({
        let (lock, key) = (lock.clone(), key.clone());
        async move { lock.acquire_session(&key, None).await }
    });
    until_lock_waiters(&admin, 1, "the session waiter").await;
    waiter.abort();
    assert!(waiter.await.expect_err("aborted").is_cancelled());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while lock_waiters(&admin).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server-side wait was not ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    guard.release().await.expect("release");
    let next = lock
        .try_acquire_session(&key)
        .await
        .expect("try")
        .expect("free");
    next.release().await.expect("release");

    // Held, as the server shows; released from a spawned task.
    let mut guard = lock.acquire_session(&key, None).await.expect("lock");
    assert!(guard.is_held().await.expect("is_held"));
    tokio::spawn(async move { guard.release().await })
        .await
        .expect("task")
        .expect("release");
    let again = lock
        .try_acquire_session(&key)
        .await
        .expect("try")
        .expect("free after release");
    drop(again); // dropped: the connection is closed and the server frees the key
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let free = lock.try_acquire_session(&key).await.expect("try");
        if let Some(guard) = free {
            guard.release().await.expect("release");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a dropped guard's lock was not freed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
