//! Issue 8, defect 3: the cancel request of an abandoned lock wait can lose its race. It travels
//! on a connection of its own and can reach the server before the statement does; the server
//! ignores a cancel that finds the backend idle, and the statement then waits for the lock (and
//! would get it) for a caller that gave up.
//!
//! The race is made deterministic with a relay between the pool and the server that holds the
//! pool connection's bytes back for a while: the statement reaches the server after the first
//! cancel request. The cancel is sent again after short delays, so the wait still ends.

use std::time::Duration;

use lockstep_core::Transaction as _;
use lockstep_core::{DistributedLock, ResourceKey};
use lockstep_pg::{PgTransaction, migrate};
use lockstep_pg_advisory::PgDistributedLock;
use lockstep_testkit::pg_harness::test_database;
use lockstep_testkit::relay::Relay;

/// How long the relay holds back each chunk the slowed connection sends.
const HOLD_BACK: Duration = Duration::from_millis(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_wait_is_cancelled_even_when_the_first_cancel_arrives_before_the_statement() {
    let db = test_database().await;
    migrate(&db.pool(1)).await.expect("migrate");
    // The pool's only connection goes through the relay; the cancel requests, sent to the
    // connection's address, do too, on connections of their own.
    let relay = Relay::start(db.server_address().expect("a TCP server"))
        .await
        .expect("start the relay");
    let pool = db.pool_through(relay.addr(), 1);
    let lock = PgDistributedLock::from_pool(pool.clone());
    let key = ResourceKey::new(format!("cancel-race:{}", uuid::Uuid::new_v4())).expect("key");

    // Another transaction (straight to the server) holds the lock.
    let holder_pool = db.pool(1);
    let holder = PgTransaction::begin(&holder_pool).await.expect("begin");
    lock.acquire_for_transaction(&holder, &key, None)
        .await
        .expect("the holder takes the lock");

    let waiter = PgTransaction::begin(&pool)
        .await
        .expect("begin through the relay");
    let pid: i32 = waiter
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);

    // From here the waiter's statement reaches the server ~300 ms after it is sent; the caller
    // gives up after 50 ms, so the first cancel request arrives while the backend is idle.
    // Only the connection open now: the cancel requests (new connections) go straight through.
    assert_eq!(relay.hold_back(HOLD_BACK), 1, "the pool's one connection");
    let abandoned = tokio::time::timeout(
        Duration::from_millis(50),
        lock.acquire_for_transaction(&waiter, &key, None),
    )
    .await;
    assert!(abandoned.is_err(), "the wait is abandoned: {abandoned:?}");

    // Long after the statement reached the server, its backend must not be waiting any more.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let observer = db.connect().await;
    let row = observer
        .query_one(
            "SELECT state, coalesce(wait_event_type, '') FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .await
        .expect("the waiter's backend is still there (its transaction is open)");
    let (state, wait): (String, String) = (row.get(0), row.get(1));
    assert_ne!(
        wait, "Lock",
        "the abandoned statement still waits for the lock (state {state}): the cancel request \
         that arrived before it was the only one"
    );
    assert_eq!(
        state, "idle in transaction (aborted)",
        "the statement reached the server and was cancelled"
    );

    // The holder commits: nobody else gets the lock for the caller that gave up.
    holder.commit().await.expect("commit");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let granted: i64 = observer
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1 AND granted",
            &[&pid],
        )
        .await
        .expect("pg_locks")
        .get(0);
    assert_eq!(granted, 0, "the abandoned wait was granted the lock");
    relay.hold_back(Duration::ZERO);
    drop(waiter);
}
