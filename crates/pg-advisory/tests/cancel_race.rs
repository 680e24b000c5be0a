//! Issue 8, defect 3: the cancel request of an abandoned lock wait can lose its race. It travels
//! on a connection of its own and can reach the server before the statement does; the server
//! ignores a cancel that finds the backend idle, and the statement then waits for the lock (and
//! would get it) for a caller that gave up.
//!
//! The race is made deterministic with a relay between the pool and the server that holds the
//! pool connection's bytes back for a while: the statement reaches the server after the first
//! cancel request. The cancel is sent again after short delays, so the wait still ends.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use lockstep_core::{DistributedLock, ResourceKey};
use lockstep_pg::{PgTransaction, migrate};
use lockstep_pg_advisory::PostgresDistributedLock;
use lockstep_testkit::pg_harness::test_database;

/// How long the relay holds back each chunk the slowed connection sends.
const HOLD_BACK: Duration = Duration::from_millis(300);

/// A TCP relay to the server. The first connection through it (the pool's only one) can be
/// slowed down: its bytes to the server are held back [`HOLD_BACK`]. Later
/// connections (the cancel requests) go straight through.
struct Relay {
    port: u16,
    slow_first: Arc<AtomicBool>,
}

impl Relay {
    fn start(server: (String, u16)) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let port = listener.local_addr().expect("relay address").port();
        let slow_first = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicUsize::new(0));
        let slow = Arc::clone(&slow_first);
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(upstream) = TcpStream::connect((server.0.as_str(), server.1)) else {
                    continue;
                };
                let first = accepted.fetch_add(1, Ordering::SeqCst) == 0;
                let slow = first.then(|| Arc::clone(&slow));
                let (client2, upstream2) = (
                    client.try_clone().expect("clone"),
                    upstream.try_clone().expect("clone"),
                );
                thread::spawn(move || pump(client, upstream, slow.as_deref()));
                thread::spawn(move || pump(upstream2, client2, None));
            }
        });
        Relay { port, slow_first }
    }
}

/// Copies `from` to `to`. While `slow` is set, each chunk is delivered [`HOLD_BACK`] after it
/// was read (the delays do not add up: chunks read together arrive together).
fn pump(mut from: TcpStream, mut to: TcpStream, slow: Option<&AtomicBool>) {
    let (chunks, delivered) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    let writer = thread::spawn(move || {
        for (due, chunk) in delivered {
            thread::sleep(due.saturating_duration_since(Instant::now()));
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let due = if slow.is_some_and(|s| s.load(Ordering::SeqCst)) {
            Instant::now() + HOLD_BACK
        } else {
            Instant::now()
        };
        if chunks.send((due, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    drop(chunks);
    let _ = writer.join();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_wait_is_cancelled_even_when_the_first_cancel_arrives_before_the_statement() {
    let db = test_database().await;
    migrate(&db.pool(1)).await.expect("migrate");
    let base = db.config().clone();
    let server = match (base.get_hosts().first(), base.get_ports().first()) {
        (Some(tokio_postgres::config::Host::Tcp(host)), port) => {
            (host.clone(), port.copied().unwrap_or(5432))
        }
        other => panic!("the test server is not on TCP: {other:?}"),
    };
    let relay = Relay::start(server);
    let mut config = tokio_postgres::Config::new();
    config
        .host("127.0.0.1")
        .port(relay.port)
        .user(base.get_user().unwrap_or("postgres"))
        .dbname(base.get_dbname().expect("dbname"));
    if let Some(password) = base.get_password() {
        config.password(password);
    }
    let manager = deadpool_postgres::Manager::from_config(
        config,
        tokio_postgres::NoTls,
        deadpool_postgres::ManagerConfig::default(),
    );
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(1)
        .build()
        .expect("pool");
    let lock = PostgresDistributedLock::new(pool.clone());
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
    relay.slow_first.store(true, Ordering::SeqCst);
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
    relay.slow_first.store(false, Ordering::SeqCst);
    drop(waiter);
}
