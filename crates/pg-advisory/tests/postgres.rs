//! lockstep-pg-advisory against a real PostgreSQL (each test on a database of its own): the
//! distributed-lock and session-lock conformance suites (one test per case), cancellation,
//! timeouts, crash release, deadlock-free multi-aggregate locking, the isolation check, session
//! locks, the in-process queue and the SQL key function.

use lockstep_core::Transaction as _;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use lockstep_core::{
    ADVISORY_KEY_GOLDEN_VECTORS, AggregateWriteLock, DistributedLock, ErrorKind, ResourceKey,
    SessionLockGuard, SessionLocks,
};
use lockstep_pg::{PgDatabase, PgTransaction, migrate};
use lockstep_pg_advisory::PgDistributedLock;
use lockstep_testkit::conformance::distributed_lock::DistributedLockFixture;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};
use tokio_postgres::Client;
use uuid::Uuid;

struct Fixture {
    _db: TestDatabase,
    source: PgDatabase,
    lock: PgDistributedLock,
}

impl DistributedLockFixture for Fixture {
    type Tx = PgTransaction;
    type Source = PgDatabase;
    type Lock = PgDistributedLock;

    fn lock(&self) -> &PgDistributedLock {
        &self.lock
    }

    fn source(&self) -> &PgDatabase {
        &self.source
    }
}

async fn setup(pool_size: usize) -> (TestDatabase, Pool, PgDistributedLock) {
    let db = test_database().await;
    let pool = db.pool(pool_size);
    // The lock statements call the SQL function `lockstep_advisory_lock`.
    migrate(&pool).await.expect("migrate");
    let lock = PgDistributedLock::from_pool(pool.clone());
    (db, pool, lock)
}

/// A new transaction on `pool` that has taken `key` (waiting for it without a timeout).
async fn holding(pool: &Pool, lock: &PgDistributedLock, key: &ResourceKey) -> PgTransaction {
    let tx = PgTransaction::begin(pool).await.expect("begin");
    lock.acquire_for_transaction(&tx, key, None)
        .await
        .expect("the key is granted");
    tx
}

fn fresh_key() -> ResourceKey {
    ResourceKey::new(format!("test:{}", Uuid::new_v4())).expect("key")
}

/// Advisory locks on `key` in this database: (granted, waiting).
async fn lock_counts(client: &Client, key: &ResourceKey) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE granted), count(*) FILTER (WHERE NOT granted) \
             FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             AND ((classid::bigint << 32) | objid::bigint) = $1",
            &[&key.advisory_key()],
        )
        .await
        .expect("pg_locks");
    (row.get(0), row.get(1))
}

/// Polls (every 20 ms, at most `limit`) until `check` holds; false if it never did.
async fn eventually<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn backend_pid(tx: &PgTransaction) -> i32 {
    tx.client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0)
}

/// The lock on a migrated database of the test's own (8 connections), with the in-process
/// queue on (the default) or off.
async fn fixture(local_queue: bool) -> Fixture {
    let (db, pool, lock) = setup(8).await;
    Fixture {
        _db: db,
        source: PgDatabase::from_pool(pool),
        lock: if local_queue {
            lock
        } else {
            lock.with_local_queue(false)
        },
    }
}

/// The distributed-lock conformance suite, one test per case.
mod distributed_lock_suite {
    use super::*;

    lockstep_testkit::distributed_lock_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(true).await,
    }
}

/// The distributed-lock conformance suite without the in-process queue.
mod distributed_lock_suite_without_the_local_queue {
    use super::*;

    lockstep_testkit::distributed_lock_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(false).await,
    }
}

/// The session-lock conformance suite, one test per case.
mod session_lock_suite {
    use super::*;

    lockstep_testkit::session_lock_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(true).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_waiting_acquire_leaves_no_waiting_backend_and_the_pool_stays_healthy() {
    let (db, pool, lock) = setup(3).await;
    let admin = db.connect().await;
    let key = fresh_key();
    let holder = PgTransaction::begin(&pool).await.expect("begin");
    assert!(
        lock.try_acquire_for_transaction(&holder, &key)
            .await
            .expect("try")
    );

    let waiter = PgTransaction::begin(&pool).await.expect("begin");
    let waiter_pid: i32 = waiter
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    let abandoned = tokio::time::timeout(
        Duration::from_millis(300),
        lock.acquire_for_transaction(&waiter, &key, None),
    )
    .await;
    assert!(abandoned.is_err(), "the acquire was still waiting");
    assert!(
        eventually(Duration::from_secs(2), || async {
            lock_counts(&admin, &key).await.1 == 0
        })
        .await,
        "the server-side wait ended within 2 s of the drop"
    );
    assert_eq!(lock.locally_queued_keys(), 0);
    waiter
        .rollback()
        .await
        .expect("the waiter's connection is usable");
    holder.commit().await.expect("commit");

    // Every pooled connection works, and the key is free.
    let txs = [
        PgTransaction::begin(&pool).await.expect("begin"),
        PgTransaction::begin(&pool).await.expect("begin"),
        PgTransaction::begin(&pool).await.expect("begin"),
    ];
    for tx in &txs {
        let pid: i32 = tx
            .client()
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .expect("healthy")
            .get(0);
        assert_ne!(
            pid, waiter_pid,
            "the abandoned waiter's connection is closed, not pooled (a late cancel request \
             must not hit another borrower)"
        );
    }
    assert!(
        lock.try_acquire_for_transaction(&txs[0], &key)
            .await
            .expect("try")
    );
    for tx in txs {
        tx.rollback().await.expect("rollback");
    }
}

/// A TLS connector that counts the connections it is asked to make (and makes them without
/// TLS, like `NoTls`).
#[derive(Clone, Default)]
struct CountingTls(Arc<std::sync::atomic::AtomicUsize>);

impl tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket> for CountingTls {
    type Stream = tokio_postgres::tls::NoTlsStream;
    type TlsConnect = tokio_postgres::NoTls;
    type Error = std::convert::Infallible;

    fn make_tls_connect(&mut self, _domain: &str) -> Result<tokio_postgres::NoTls, Self::Error> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(tokio_postgres::NoTls)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_requests_connect_with_the_configured_tls_connector() {
    let (db, pool, lock) = setup(2).await;
    let tls = CountingTls::default();
    let lock = lock.with_cancel_tls(tls.clone());
    let admin = db.connect().await;
    let key = fresh_key();
    let holder = holding(&pool, &lock, &key).await;
    let waiter = PgTransaction::begin(&pool).await.expect("begin");
    let abandoned = tokio::time::timeout(
        Duration::from_millis(300),
        lock.acquire_for_transaction(&waiter, &key, None),
    )
    .await;
    assert!(abandoned.is_err(), "the acquire was still waiting");
    assert!(
        eventually(Duration::from_secs(2), || async {
            lock_counts(&admin, &key).await.1 == 0
        })
        .await,
        "the cancel request ended the server-side wait"
    );
    // At least one: the request is sent again on a short schedule in case it lost its race
    // with the statement (ADR 0003, issue 8 addendum).
    assert!(
        tls.0.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "the cancel request was made through the lock's connector"
    );
    waiter.rollback().await.expect("rollback");
    holder.commit().await.expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_is_a_typed_lock_timeout_that_aborts_the_transaction() {
    let (_db, pool, lock) = setup(3).await;
    let key = fresh_key();
    let holder = holding(&pool, &lock, &key).await;
    let waiter = PgTransaction::begin(&pool).await.expect("begin");
    let err = lock
        .acquire_for_transaction(&waiter, &key, Some(Duration::from_millis(100)))
        .await
        .expect_err("times out");
    assert_eq!(err.kind(), ErrorKind::LockTimeout, "{err}");
    assert!(err.is_retryable());
    let after = lock.try_acquire_for_transaction(&waiter, &key).await;
    assert_eq!(
        after.expect_err("aborted").kind(),
        ErrorKind::TransactionAborted,
        "like a failed statement, a timed-out wait aborts the transaction"
    );
    waiter.rollback().await.expect("rollback");
    holder.commit().await.expect("commit");
}

/// Threads that spin until dropped, to load the machine's cores (bounded: at most 60 s).
struct BusyCores {
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl BusyCores {
    fn start(threads: usize) -> BusyCores {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let until = std::time::Instant::now() + Duration::from_secs(60);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed)
                        && std::time::Instant::now() < until
                    {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        BusyCores { stop, threads }
    }
}

impl Drop for BusyCores {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// PostgreSQL sends a statement's error before it aborts the transaction and releases its
/// locks; a timed-out acquire returns only after the abort (the fake releases at the error, and
/// the model of the reliability suite compares the two). The server's window between the error
/// and the release is widened by many locks held by the waiter and by threads that keep the
/// cores busy (the backend is then often descheduled in between): without the wait for the
/// abort, this fails within a few rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_wait_has_released_the_transactions_other_locks_when_it_returns() {
    let (_db, pool, lock) = setup(4).await;
    let _busy = BusyCores::start(3);
    for round in 0..60 {
        let (wanted, other) = (fresh_key(), fresh_key());
        let holder = holding(&pool, &lock, &wanted).await;
        let waiter = holding(&pool, &lock, &other).await;
        waiter
            .client()
            .batch_execute("SELECT pg_advisory_xact_lock(1, k) FROM generate_series(1, 3000) AS k")
            .await
            .expect("many locks");
        let observer = PgTransaction::begin(&pool).await.expect("begin");
        let err = lock
            .acquire_for_transaction(&waiter, &wanted, Some(Duration::from_millis(20)))
            .await
            .expect_err("times out");
        assert_eq!(err.kind(), ErrorKind::LockTimeout, "{err}");
        let free = lock
            .try_acquire_for_transaction(&observer, &other)
            .await
            .expect("try");
        assert!(
            free,
            "round {round}: the timed-out transaction still held its other lock"
        );
        observer.rollback().await.expect("rollback");
        waiter.rollback().await.expect("rollback");
        holder.commit().await.expect("commit");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_acquire_restores_the_previous_lock_timeout() {
    let (_db, pool, lock) = setup(2).await;
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.client()
        .batch_execute("SET LOCAL lock_timeout = '7s'")
        .await
        .expect("set");
    lock.acquire_for_transaction(&tx, &fresh_key(), Some(Duration::from_millis(250)))
        .await
        .expect("free key");
    let setting: String = tx
        .client()
        .query_one("SHOW lock_timeout", &[])
        .await
        .expect("show")
        .get(0);
    assert_eq!(setting, "7s");
    tx.commit().await.expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_the_holder_lets_the_waiter_in_and_fails_the_holders_commit() {
    let (db, pool, lock) = setup(3).await;
    let admin = db.connect().await;
    let key = fresh_key();
    let holder = holding(&pool, &lock, &key).await;
    let holder_pid = backend_pid(&holder).await;

    let waiter = {
        let (pool, lock, key) = (pool.clone(), lock.clone(), key.clone());
        tokio::spawn(async move {
            let tx = PgTransaction::begin(&pool).await.expect("begin");
            let acquired = lock.acquire_for_transaction(&tx, &key, None).await;
            (tx, acquired)
        })
    };
    assert!(
        eventually(Duration::from_secs(10), || async {
            lock_counts(&admin, &key).await.1 == 1
        })
        .await,
        "the waiter waits at the server"
    );
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&holder_pid])
        .await
        .expect("terminate");

    let (tx, acquired) = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter gets the lock once the holder's backend is gone")
        .expect("task");
    acquired.expect("acquired");
    // The waiter's grant proves the holder's backend is gone; the holder's client learns it
    // when its connection task reads the server's FATAL. Until then a commit would send its
    // COMMIT and see the connection fail with it in flight (`CommitUnknown`, also right): wait
    // for that, so that this checks the case of a loss known before the COMMIT.
    assert!(
        eventually(Duration::from_secs(10), || async {
            holder.client().is_closed()
        })
        .await,
        "the holder's client sees its connection closed"
    );
    let err = holder
        .commit()
        .await
        .expect_err("the holder's session is gone");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost, "{err}");
    tx.commit().await.expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_commands_locking_two_aggregates_in_opposite_order_never_deadlock() {
    let (_db, pool, lock) = setup(4).await;
    let aggregates = lock.aggregate_write_lock();
    let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
    let command = |order: [(&'static str, Uuid); 2]| {
        let (pool, aggregates) = (pool.clone(), aggregates.clone());
        tokio::spawn(async move {
            for _ in 0..40 {
                let tx = PgTransaction::begin(&pool).await.expect("begin");
                aggregates
                    .acquire_all(&tx, &order)
                    .await
                    .expect("no deadlock, no error");
                tokio::task::yield_now().await;
                tx.commit().await.expect("commit");
            }
        })
    };
    let forward = command([("StockItem", a), ("StockItem", b)]);
    let backward = command([("StockItem", b), ("StockItem", a)]);
    forward.await.expect("forward");
    backward.await.expect("backward");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locking_in_inconsistent_order_is_reported_as_a_deadlock() {
    let (_db, pool, lock) = setup(4).await;
    let (k1, k2) = (fresh_key(), fresh_key());
    let t1 = PgTransaction::begin(&pool).await.expect("begin");
    let t2 = PgTransaction::begin(&pool).await.expect("begin");
    lock.acquire_for_transaction(&t1, &k1, None)
        .await
        .expect("k1");
    lock.acquire_for_transaction(&t2, &k2, None)
        .await
        .expect("k2");
    // Each side rolls back as soon as it fails, so the survivor can go on.
    let second = |tx: PgTransaction, key: ResourceKey| {
        let lock = lock.clone();
        tokio::spawn(async move {
            match lock.acquire_for_transaction(&tx, &key, None).await {
                Ok(()) => {
                    tx.commit().await.expect("commit");
                    None
                }
                Err(e) => {
                    tx.rollback().await.expect("rollback");
                    Some(e.kind())
                }
            }
        })
    };
    let (r1, r2) = (second(t1, k2), second(t2, k1));
    let kinds: Vec<_> = [r1.await.expect("t1"), r2.await.expect("t2")]
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(
        kinds,
        vec![ErrorKind::Deadlock],
        "exactly one victim, typed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_vectors_equal_the_sql_function_and_the_view_finds_a_held_key() {
    let (db, pool, lock) = setup(2).await;
    migrate(&pool).await.expect("migrate");
    let client = db.connect().await;
    for (key, expected) in ADVISORY_KEY_GOLDEN_VECTORS {
        let row = client
            .query_one("SELECT lockstep_advisory_key($1)", &[key])
            .await
            .expect("function");
        assert_eq!(row.get::<_, i64>(0), *expected, "key {key:?}");
    }
    let key = ResourceKey::new("relay:aggregate:StockItem:0123456789abcdef0123456789abcdef")
        .expect("key");
    let tx = holding(&pool, &lock, &key).await;
    let pid = backend_pid(&tx).await;
    let row = client
        .query_one(
            "SELECT pid, granted FROM lockstep_advisory_locks \
             WHERE advisory_key = lockstep_advisory_key($1)",
            &[&key.as_str()],
        )
        .await
        .expect("the operator's query finds the lock");
    assert_eq!(row.get::<_, i32>(0), pid);
    assert!(row.get::<_, bool>(1));
    tx.commit().await.expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_that_are_not_read_committed_are_refused_before_locking() {
    let (db, pool, lock) = setup(2).await;
    let admin = db.connect().await;
    let key = fresh_key();
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        // A PgTransaction begins READ COMMITTED; switch it before its first query.
        let tx = PgTransaction::begin(&pool).await.expect("begin");
        tx.client()
            .batch_execute(&format!("SET TRANSACTION ISOLATION LEVEL {level}"))
            .await
            .expect("isolation level");
        let err = lock
            .acquire_for_transaction(&tx, &key, None)
            .await
            .expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
        let err = lock
            .acquire_for_transaction(&tx, &key, Some(Duration::from_secs(1)))
            .await
            .expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::Unsupported);
        let err = lock
            .try_acquire_for_transaction(&tx, &key)
            .await
            .expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::Unsupported);
        assert_eq!(lock_counts(&admin, &key).await, (0, 0), "nothing locked");
        tx.client()
            .query_one("SELECT 1", &[])
            .await
            .expect("the transaction is still usable");
        tx.rollback().await.expect("rollback");
    }
    // A READ COMMITTED one locks. (A borrowed tokio_postgres::Transaction does not compile
    // with the lock at all: see the compile_fail example on PgDistributedLock.)
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    assert!(
        lock.try_acquire_for_transaction(&tx, &key)
            .await
            .expect("try")
    );
    tx.commit().await.expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_taken_inside_a_rolled_back_savepoint_is_silently_released() {
    // Documents the hazard (see the crate docs): lock at the top level of the transaction.
    let (_db, pool, lock) = setup(3).await;
    let key = fresh_key();
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.client()
        .batch_execute("SAVEPOINT s")
        .await
        .expect("savepoint");
    lock.acquire_for_transaction(&tx, &key, None)
        .await
        .expect("lock");
    tx.client()
        .batch_execute("ROLLBACK TO SAVEPOINT s")
        .await
        .expect("rollback to");
    let other = PgTransaction::begin(&pool).await.expect("begin");
    assert!(
        lock.try_acquire_for_transaction(&other, &key)
            .await
            .expect("try"),
        "the lock went with the savepoint"
    );
    other.rollback().await.expect("rollback");
    tx.rollback().await.expect("rollback");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reentrant_acquire_does_not_queue_behind_a_local_waiter() {
    // Patience of an hour: if the re-entrant acquire queued behind the local waiter (which
    // waits for this very transaction), it would hang instead of returning.
    let (db, pool, lock) = setup(3).await;
    let lock = lock.with_local_patience(Duration::from_secs(3600));
    let admin = db.connect().await;
    let key = fresh_key();
    let t1 = holding(&pool, &lock, &key).await;
    let waiter = {
        let (pool, lock, key) = (pool.clone(), lock.clone(), key.clone());
        tokio::spawn(async move {
            let tx = holding(&pool, &lock, &key).await;
            tx.commit().await.expect("commit");
        })
    };
    assert!(
        eventually(Duration::from_secs(10), || async {
            lock_counts(&admin, &key).await.1 == 1
        })
        .await
    );
    tokio::time::timeout(
        Duration::from_secs(10),
        lock.acquire_for_transaction(&t1, &key, None),
    )
    .await
    .expect("re-entrant acquire returns")
    .expect("held");
    t1.commit().await.expect("commit");
    waiter.await.expect("waiter");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_waiters_for_one_key_keep_one_waiting_backend() {
    let (db, pool, lock) = setup(8).await;
    let admin = db.connect().await;
    let key = fresh_key();
    let holder = holding(&pool, &lock, &key).await;
    let waiters: Vec<_> = (0..5)
        .map(|_| {
            let (pool, lock, key) = (pool.clone(), lock.clone(), key.clone());
            tokio::spawn(async move {
                let tx = holding(&pool, &lock, &key).await;
                tx.commit().await.expect("commit");
            })
        })
        .collect();
    // One waits at the server; four are queued in process and sent nothing after their BEGIN
    // (issue 11: no try statement on a hot key).
    let settled = eventually(Duration::from_secs(10), || async {
        let queued: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND state = 'idle in transaction' AND query LIKE 'BEGIN%'",
                &[],
            )
            .await
            .expect("activity")
            .get(0);
        queued == 4 && lock_counts(&admin, &key).await.1 == 1
    })
    .await;
    let tried: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND query LIKE '%p_wait => false%' AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .expect("activity")
        .get(0);
    assert_eq!(tried, 0, "no waiter spent a try statement");
    assert!(settled, "one waiting backend, four local waiters");
    assert_eq!(lock_counts(&admin, &key).await, (1, 1));
    holder.commit().await.expect("commit");
    for waiter in waiters {
        waiter.await.expect("every waiter gets the lock in turn");
    }
    assert_eq!(lock.locally_queued_keys(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_then_pipelines_a_query_that_sees_the_previous_holders_commit() {
    let (db, pool, lock) = setup(3).await;
    let admin = db.connect().await;
    admin
        .batch_execute("CREATE TABLE t (x int)")
        .await
        .expect("table");
    let key = fresh_key();
    let holder = holding(&pool, &lock, &key).await;
    holder
        .client()
        .execute("INSERT INTO t VALUES (1)", &[])
        .await
        .expect("insert");
    let reader = {
        let (pool, lock, key) = (pool.clone(), lock.clone(), key.clone());
        tokio::spawn(async move {
            let tx = PgTransaction::begin(&pool).await.expect("begin");
            let count = lock
                .acquire_then(&tx, &key, None, || async {
                    let row = tx
                        .client()
                        .query_typed_one("SELECT count(*) FROM t", &[])
                        .await
                        .map_err(|e| lockstep_pg::map_error(e, "counting"))?;
                    Ok(row.get::<_, i64>(0))
                })
                .await
                .expect("lock and count");
            tx.commit().await.expect("commit");
            count
        })
    };
    assert!(
        eventually(Duration::from_secs(10), || async {
            lock_counts(&admin, &key).await.1 == 1
        })
        .await
    );
    holder.commit().await.expect("commit");
    assert_eq!(reader.await.expect("reader"), 1, "loaded after the lock");
}

/// A `then` that fails at once, without the server, must not cut the lock statement's wait
/// short: the call ends with the lock's own outcome (here its timeout), and no wait is left at
/// the server to be granted later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_then_waits_for_the_lock_statement_even_when_then_fails_at_once() {
    let (db, pool, lock) = setup(3).await;
    let admin = db.connect().await;
    let key = fresh_key();
    let holder = holding(&pool, &lock, &key).await;
    let waiter = PgTransaction::begin(&pool).await.expect("begin");
    let err = lock
        .acquire_then(&waiter, &key, Some(Duration::from_millis(300)), || async {
            Err::<(), _>(lockstep_core::Error::new(
                ErrorKind::InvalidInput,
                "refused before reaching the server",
            ))
        })
        .await
        .expect_err("fails");
    assert_eq!(
        err.kind(),
        ErrorKind::LockTimeout,
        "the lock statement ran to its end and its outcome wins: {err}"
    );
    assert_eq!(
        lock_counts(&admin, &key).await,
        (1, 0),
        "no wait is left at the server"
    );
    waiter.rollback().await.expect("rollback");
    holder.commit().await.expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_locks_exclude_and_release_returns_the_connection_to_the_pool() {
    let (db, pool, lock) = setup(3).await;
    let admin = db.connect().await;
    let key = fresh_key();
    let guard = lock.acquire_session(&key, None).await.expect("lock");
    assert_eq!(guard.key(), &key);
    assert!(lock.try_acquire_session(&key).await.expect("try").is_none());
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    assert!(
        !lock
            .try_acquire_for_transaction(&tx, &key)
            .await
            .expect("try"),
        "session and transaction locks exclude each other"
    );
    tx.rollback().await.expect("rollback");
    let err = lock
        .acquire_session(&key, Some(Duration::from_millis(100)))
        .await
        .expect_err("times out");
    assert_eq!(err.kind(), ErrorKind::LockTimeout);
    guard.release().await.expect("release");
    assert_eq!(lock_counts(&admin, &key).await, (0, 0));
    let again = lock
        .try_acquire_session(&key)
        .await
        .expect("try")
        .expect("free after release");
    let setting: String = again
        .client()
        .query_one("SHOW lock_timeout", &[])
        .await
        .expect("show")
        .get(0);
    assert_eq!(setting, "0", "session lock_timeout restored");
    again.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_session_guard_closes_its_connection_and_the_server_releases_the_lock() {
    let (db, _pool, lock) = setup(2).await;
    let admin = db.connect().await;
    let key = fresh_key();
    let guard = lock.acquire_session(&key, None).await.expect("lock");
    let pid: i32 = guard
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    drop(guard);
    assert!(
        eventually(Duration::from_secs(5), || async {
            lock_counts(&admin, &key).await == (0, 0)
        })
        .await,
        "released by the server once the connection closed"
    );
    let reused = lock
        .try_acquire_session(&key)
        .await
        .expect("try")
        .expect("free");
    let new_pid: i32 = reused
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    assert_ne!(
        pid, new_pid,
        "the dropped guard's connection was not pooled"
    );
    reused.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_waiting_session_acquire_ends_its_wait() {
    let (db, _pool, lock) = setup(3).await;
    let admin = db.connect().await;
    let key = fresh_key();
    let guard = lock.acquire_session(&key, None).await.expect("lock");
    let abandoned =
        tokio::time::timeout(Duration::from_millis(300), lock.acquire_session(&key, None)).await;
    assert!(abandoned.is_err(), "still waiting when dropped");
    assert!(
        eventually(Duration::from_secs(2), || async {
            lock_counts(&admin, &key).await.1 == 0
        })
        .await,
        "no waiting backend within 2 s"
    );
    guard.release().await.expect("release");
    let next = lock
        .try_acquire_session(&key)
        .await
        .expect("try")
        .expect("free");
    next.release().await.expect("release");
}

/// Issue 8, defect 7: a release after the holder ran `BEGIN` on the guard's connection used
/// to hand that connection back to the pool inside the open transaction, and the next borrower
/// ran inside it. Now the lock is released, the connection closed (rolling the transaction
/// back) and the release says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_never_pools_a_connection_left_inside_a_transaction() {
    let (_db, pool, lock) = setup(1).await;
    let key = fresh_key();
    let guard = lock.acquire_session(&key, None).await.expect("lock");
    let pid: i32 = guard
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    guard
        .client()
        .batch_execute("BEGIN; CREATE TABLE left_open (x int)")
        .await
        .expect("the holder's transaction");
    let err = guard.release().await.expect_err("reported");
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    let next = lock
        .try_acquire_session(&key)
        .await
        .expect("try")
        .expect("the lock was released");
    // A simple query (one message): outside a transaction block it is its own transaction's
    // first command, whose transaction_timestamp() equals statement_timestamp().
    let state = next
        .client()
        .simple_query(
            "SELECT pg_backend_pid() <> $$PID$$::int, \
             transaction_timestamp() = statement_timestamp(), to_regclass('left_open') IS NULL"
                .replace("$$PID$$", &pid.to_string())
                .as_str(),
        )
        .await
        .expect("state");
    let row = state
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .expect("a row");
    assert_eq!(row.get(0), Some("t"), "a new connection");
    assert_eq!(row.get(1), Some("t"), "not inside a transaction block");
    assert_eq!(
        row.get(2),
        Some("t"),
        "the open transaction was rolled back"
    );
    next.release().await.expect("a clean release pools it");
    let conn = pool.get().await.expect("pooled");
    drop(conn);
}

/// Risk "a session lock lost with its connection is silent": the guard can ask. After its
/// backend is terminated, `is_held` says no (and another session takes the lock); after an
/// unlock behind its back, too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_learns_that_its_session_lock_was_lost() {
    let (db, _pool, lock) = setup(3).await;
    let admin = db.connect().await;
    let key = fresh_key();
    let guard = lock.acquire_session(&key, None).await.expect("lock");
    assert!(guard.is_held().await.expect("asked"));
    assert!(!guard.is_closed());
    let pid: i32 = guard
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .expect("terminate");
    assert!(
        eventually(Duration::from_secs(5), || async {
            !guard.is_held().await.expect("no error, just not held")
        })
        .await
    );
    assert!(
        eventually(Duration::from_secs(5), || async { guard.is_closed() }).await,
        "the driver learns the connection is gone"
    );
    let other = lock
        .try_acquire_session(&key)
        .await
        .expect("try")
        .expect("another session took it");
    assert!(other.is_held().await.expect("asked"));
    other
        .client()
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .expect("unlock behind the guard's back");
    assert!(!other.is_held().await.expect("asked"));
    assert!(other.release().await.is_err(), "not held at release");
    assert!(guard.release().await.is_err(), "its connection is gone");
}

/// Issue 8, defect 2: `with_local_patience(Duration::MAX)` ("queue in process for ever")
/// panicked with "overflow when adding duration to instant" as soon as a waiter queued, on the
/// transaction path and on the session path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbounded_local_patience_queues_instead_of_panicking() {
    let (db, pool, lock) = setup(4).await;
    let lock = lock.with_local_patience(Duration::MAX);
    let admin = db.connect().await;
    let key = fresh_key();
    let holder = holding(&pool, &lock, &key).await;
    // The first waiter waits at the server; the second queues behind it in process.
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let (lock, pool, key) = (lock.clone(), pool.clone(), key.clone());
            tokio::spawn(async move {
                let tx = holding(&pool, &lock, &key).await;
                tx.commit().await.expect("commit");
            })
        })
        .collect();
    assert!(
        eventually(Duration::from_secs(10), || async {
            lock_counts(&admin, &key).await.1 == 1 && lock.locally_queued_keys() == 1
        })
        .await
    );
    holder.commit().await.expect("commit");
    for waiter in waiters {
        waiter.await.expect("no panic");
    }
    let session_key = fresh_key();
    let guard = lock
        .acquire_session(&session_key, None)
        .await
        .expect("session lock");
    guard.release().await.expect("release");
}

/// Issue 8, risk "pool exhaustion": a session acquire on an exhausted pool fails after the
/// lock's checkout wait (or its own timeout, if shorter) with a typed, retryable error instead
/// of waiting for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_acquires_on_an_exhausted_pool_fail_after_the_checkout_wait() {
    let (_db, _pool, lock) = setup(1).await;
    let lock = lock.with_checkout_wait(Duration::from_millis(100));
    let guard = lock
        .acquire_session(&fresh_key(), None)
        .await
        .expect("the only connection");
    let other = fresh_key();
    for timeout in [
        None,
        Some(Duration::from_millis(50)),
        Some(Duration::from_secs(60)),
    ] {
        let err = tokio::time::timeout(
            Duration::from_secs(10),
            lock.acquire_session(&other, timeout),
        )
        .await
        .expect("bounded, not a hang")
        .map(drop)
        .expect_err("exhausted");
        assert_eq!(err.kind(), ErrorKind::ConnectionLost, "{err}");
        assert!(err.is_retryable());
    }
    let err = tokio::time::timeout(Duration::from_secs(10), lock.try_acquire_session(&other))
        .await
        .expect("bounded, not a hang")
        .map(drop)
        .expect_err("exhausted");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost, "{err}");
    guard.release().await.expect("release");
    let next = lock
        .try_acquire_session(&other)
        .await
        .expect("try")
        .expect("free");
    next.release().await.expect("release");
}

/// Issue 19, defect 10: every advisory-lock operation on a database that was never migrated
/// (no `lockstep_advisory_lock` function) says to run the migrations, like the other backends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_on_an_unmigrated_database_say_to_run_the_migrations() {
    let db = test_database().await;
    let pool = db.pool(2);
    let lock = PgDistributedLock::from_pool(pool.clone());
    let key = fresh_key();
    let says_migrate = |err: lockstep_core::Error, doing: &str| {
        let text = err.to_string();
        assert!(
            text.contains("run the migrations") && text.contains("lockstep_pg::migrate"),
            "{doing}: {text}"
        );
        assert!(
            text.contains(&key.to_string()),
            "{doing} names the key: {text}"
        );
    };
    for timeout in [None, Some(Duration::from_secs(1))] {
        let tx = PgTransaction::begin(&pool).await.expect("begin");
        let err = lock
            .acquire_for_transaction(&tx, &key, timeout)
            .await
            .expect_err("no schema");
        says_migrate(err, "acquire_for_transaction");
        tx.rollback().await.expect("rollback");
    }
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let err = lock
        .try_acquire_for_transaction(&tx, &key)
        .await
        .expect_err("no schema");
    says_migrate(err, "try_acquire_for_transaction");
    tx.rollback().await.expect("rollback");
    for timeout in [None, Some(Duration::from_secs(1))] {
        let err = lock
            .acquire_session(&key, timeout)
            .await
            .map(drop)
            .expect_err("no schema");
        says_migrate(err, "acquire_session");
    }
    let err = lock
        .try_acquire_session(&key)
        .await
        .map(drop)
        .expect_err("no schema");
    says_migrate(err, "try_acquire_session");
}
