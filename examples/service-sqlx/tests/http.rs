//! The sqlx service end to end, over HTTP, on a fresh database of each test's own (migrated,
//! with an sqlx pool on it): concurrent commands on one account, each on axum's spawned tasks
//! under the account's write lock, none lost; a command with an idempotency key commits the
//! key's row with its event or neither; the daily statement, read after the caller's own last
//! write, shows every command once. Each body runs in a task of its own; the service is wired
//! by its own composition root (`wiring`), which is not generic, so axum checks each handler
//! for the concrete types.

use std::net::SocketAddr;

use futures_util::future::join_all;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use lockstep::postgres::sqlx::SqlxDatabase;
use lockstep::postgres::{PgStreamLocker, SqlxDistributedLock};
use lockstep::worker::CancellationToken;
use lockstep::{
    AggregateWriteLock as _, FleetAdmin as _, PerspectiveName, StreamLockOptions, Transaction as _,
    TransactionSource as _,
};
use lockstep_example_service::account::ACCOUNT;
use lockstep_example_service_sqlx::command::{IDEMPOTENCY_KEY, REPLAYED};
use lockstep_example_service_sqlx::statement::DAILY_STATEMENT;
use lockstep_example_service_sqlx::{serve, wiring};
use lockstep_testkit::pg_harness::{TestDatabase, test_database, until_lock_waiters};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::sync::oneshot;
use uuid::Uuid;

/// The service on a fresh database and an ephemeral port.
struct Running {
    db: TestDatabase,
    pool: PgPool,
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    shutdown: CancellationToken,
    worker: tokio::task::JoinHandle<lockstep::Result<()>>,
}

async fn start() -> Running {
    let db = test_database().await;
    let pool = db.sqlx_pool(20);
    let lockstep = SqlxDatabase::new(pool.clone());
    lockstep.migrate().await.expect("lockstep's migrations");
    let shutdown = CancellationToken::new();
    let service = wiring::service(&lockstep, shutdown.clone())
        .await
        .expect("the service");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind an ephemeral port");
    let addr = listener.local_addr().expect("address");
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, service.router, async {
        let _ = stopped.await;
    }));
    Running {
        db,
        pool,
        addr,
        stop,
        server,
        shutdown,
        worker: service.worker,
    }
}

impl Running {
    /// Stops the server and the worker; both end cleanly.
    async fn stop(self) {
        drop(self.stop);
        self.server
            .await
            .expect("the server task")
            .expect("a graceful stop");
        self.shutdown.cancel();
        self.worker.await.expect("worker task").expect("worker");
        self.pool.close().await;
        drop(self.db);
    }

    /// The stored events of `account`.
    async fn events_of(&self, account: Uuid) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM wh_events WHERE stream_id = $1")
            .bind(account)
            .fetch_one(&self.pool)
            .await
            .expect("count the events")
    }

    /// The event stored with `key`, if the key is stored and its event is too.
    async fn event_of_key(&self, key: &str) -> Option<Uuid> {
        sqlx::query_scalar(
            "SELECT k.event_id FROM idempotency_keys k JOIN wh_events e USING (event_id) \
             WHERE k.key = $1",
        )
        .bind(key)
        .fetch_optional(&self.pool)
        .await
        .expect("read the key")
    }

    async fn keys(&self, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key = $1")
            .bind(key)
            .fetch_one(&self.pool)
            .await
            .expect("count the keys")
    }
}

/// An answer: its status, whether it says it is a replay, and its JSON body.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: Value,
}

/// One request on a connection of its own.
async fn call(
    addr: SocketAddr,
    method: Method,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> Answer {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header(IDEMPOTENCY_KEY, key);
    }
    let request = request
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .expect("request");
    let response = sender.send_request(request).await.expect("response");
    let status = response.status();
    let replayed = response
        .headers()
        .get(REPLAYED)
        .is_some_and(|v| v == "true");
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Answer {
        status,
        replayed,
        body,
    }
}

async fn command(
    addr: SocketAddr,
    account: Uuid,
    key: Option<&str>,
    kind: &str,
    amount: u64,
) -> Answer {
    call(
        addr,
        Method::POST,
        &format!("/accounts/{account}/commands"),
        key,
        Some(json!({ "type": kind, "amount": amount })),
    )
    .await
}

async fn account(addr: SocketAddr, account: Uuid) -> Value {
    let answer = call(
        addr,
        Method::GET,
        &format!("/accounts/{account}"),
        None,
        None,
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    answer.body
}

/// [`start`] in a task of its own, as an application's `main` may wire it: the service's
/// construction is `Send` for the concrete types (its handlers are spawned by axum).
async fn spawned_start() -> Running {
    match tokio::spawn(start()).await {
        Ok(running) => running,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// 32 concurrent deposits of 10, then 40 concurrent withdrawals of 10 on one account: every
/// deposit commits at its own version, exactly 32 withdrawals commit and 8 are told
/// "insufficient funds", the balance ends at 0 with 64 events — and the daily statement, read
/// after the last withdrawal's event, has every one of them once; the worker that applied them
/// is listed in the fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_commands_on_one_account_are_all_kept_and_read_back_in_the_statement() {
    let service = spawned_start().await;
    let addr = service.addr;
    let id = Uuid::now_v7();

    let deposits = join_all((0..32).map(|_| command(addr, id, None, "deposit", 10))).await;
    let mut versions: Vec<u64> = deposits
        .iter()
        .map(|a| {
            assert_eq!(a.status, StatusCode::OK, "{a:?}");
            a.body["version"].as_u64().expect("a version")
        })
        .collect();
    versions.sort_unstable();
    assert_eq!(versions, (1..=32).collect::<Vec<_>>(), "one version each");

    let withdrawals = join_all((0..40).map(|_| command(addr, id, None, "withdraw", 10))).await;
    let ok: Vec<&Answer> = withdrawals
        .iter()
        .filter(|a| a.status == StatusCode::OK)
        .collect();
    let refused = withdrawals
        .iter()
        .filter(|a| {
            a.status == StatusCode::CONFLICT
                && a.body["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("insufficient funds"))
        })
        .count();
    assert_eq!((ok.len(), refused), (32, 8), "{withdrawals:?}");
    assert_eq!(
        account(addr, id).await,
        json!({ "balance": 0, "version": 64 })
    );
    assert_eq!(service.events_of(id).await, 64);

    let last = ok
        .iter()
        .filter_map(|a| a.body["event_id"].as_str())
        .max()
        .expect("an event id in every receipt")
        .to_owned();
    let totals = call(
        addr,
        Method::GET,
        &format!("/statements/daily?after={last}"),
        None,
        None,
    )
    .await;
    assert_eq!(totals.status, StatusCode::OK, "{totals:?}");
    let days = totals.body.as_array().expect("a list of days");
    let sum = |field: &str| {
        days.iter()
            .map(|d| d[field].as_i64().unwrap_or(0))
            .sum::<i64>()
    };
    assert_eq!(
        (sum("deposited"), sum("withdrawn"), sum("events")),
        (320, 320, 64),
        "{totals:?}"
    );
    let bad = call(
        addr,
        Method::GET,
        "/statements/daily?after=nope",
        None,
        None,
    )
    .await;
    assert!(bad.status.is_client_error(), "a bad id is refused: {bad:?}");

    // The worker that applied them announced itself through the stream locker on sqlx.
    let fleet = PgStreamLocker::for_sqlx(
        &SqlxDatabase::new(service.pool.clone()),
        StreamLockOptions::default(),
    );
    let instances = fleet.list_instances().await.expect("the fleet");
    let statement = PerspectiveName::new(DAILY_STATEMENT).expect("a valid name");
    assert!(
        instances.iter().any(|i| i.is_live() && i.runs(&statement)),
        "{instances:?}"
    );

    service.stop().await;
}

/// A command, keyed or not, waits for the account's write lock: the test holds it in a
/// transaction of its own (`SqlxDistributedLock`, as another writer of the account would), the
/// request waits at the server until that commits, then commits after it. Another account is
/// not held up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_wait_for_the_accounts_write_lock() {
    let service = spawned_start().await;
    let addr = service.addr;
    let observer = service.db.connect().await;
    let id = Uuid::now_v7();
    // A handle of its own: its lock queue is not the service's, so the request waits at the
    // server, where the test sees it.
    let writer = SqlxDatabase::new(service.pool.clone());
    let lock = SqlxDistributedLock::new(&writer).aggregate_write_lock();

    for (version, key) in [(1, None), (2, Some("pay-5"))] {
        let held = writer.begin().await.expect("begin");
        lock.acquire(&held, ACCOUNT, id)
            .await
            .expect("the account's write lock");
        let request = tokio::spawn(command(addr, id, key, "deposit", 10));
        until_lock_waiters(&observer, 1, "the command at the account's lock").await;
        let free = command(addr, Uuid::now_v7(), None, "deposit", 10).await;
        assert_eq!(free.status, StatusCode::OK, "another account: {free:?}");
        assert!(!request.is_finished(), "the command waits ({key:?})");
        held.commit().await.expect("commit");
        let answer = request.await.expect("the command");
        assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
        assert_eq!(answer.body["version"], version, "{answer:?}");
    }
    assert_eq!(
        account(addr, id).await,
        json!({ "balance": 20, "version": 2 })
    );

    drop(observer);
    service.stop().await;
}

/// A keyed deposit stores its key's row with its event; the same request again answers the
/// stored receipt and appends nothing; the key with another request is refused; 16 concurrent
/// requests with one key run the command once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_command_commits_its_key_with_its_event_and_runs_once() {
    let service = spawned_start().await;
    let addr = service.addr;
    let id = Uuid::now_v7();

    let first = command(addr, id, Some("pay-1"), "deposit", 100).await;
    assert_eq!(first.status, StatusCode::OK, "{first:?}");
    assert!(!first.replayed);
    assert_eq!(first.body["version"], 1);
    let event = first.body["event_id"].as_str().expect("an event id");
    assert_eq!(
        service.event_of_key("pay-1").await.map(|e| e.to_string()),
        Some(event.to_owned()),
        "the key's row and its event, committed together"
    );

    let again = command(addr, id, Some("pay-1"), "deposit", 100).await;
    assert_eq!(again.status, StatusCode::OK, "{again:?}");
    assert!(again.replayed, "{again:?}");
    assert_eq!(
        (&again.body["event_id"], &again.body["version"]),
        (&first.body["event_id"], &first.body["version"])
    );
    assert_eq!(
        account(addr, id).await,
        json!({ "balance": 100, "version": 1 })
    );

    let other = command(addr, id, Some("pay-1"), "deposit", 5).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY, "{other:?}");
    let elsewhere = command(addr, Uuid::now_v7(), Some("pay-1"), "deposit", 100).await;
    assert_eq!(
        elsewhere.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{elsewhere:?}"
    );
    let empty = command(addr, id, Some(""), "deposit", 100).await;
    assert_eq!(empty.status, StatusCode::UNPROCESSABLE_ENTITY, "{empty:?}");

    let racing = join_all((0..16).map(|_| command(addr, id, Some("pay-2"), "deposit", 10))).await;
    assert!(
        racing.iter().all(|a| a.status == StatusCode::OK),
        "{racing:?}"
    );
    let ran: Vec<&Answer> = racing.iter().filter(|a| !a.replayed).collect();
    assert_eq!(ran.len(), 1, "one request ran the command: {racing:?}");
    assert!(
        racing
            .iter()
            .all(|a| a.body["event_id"] == ran[0].body["event_id"]),
        "every answer is the one receipt: {racing:?}"
    );
    assert_eq!(
        account(addr, id).await,
        json!({ "balance": 110, "version": 2 })
    );
    assert_eq!(service.events_of(id).await, 2);

    service.stop().await;
}

/// A keyed withdrawal the balance does not cover is refused, and leaves neither its key's row
/// nor an event: the same key serves the same withdrawal once the money is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_keyed_command_leaves_neither_its_key_nor_an_event() {
    let service = spawned_start().await;
    let addr = service.addr;
    let id = Uuid::now_v7();

    let refused = command(addr, id, Some("take-1"), "withdraw", 50).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{refused:?}");
    assert_eq!(service.keys("take-1").await, 0);
    assert_eq!(service.events_of(id).await, 0);

    let paid = command(addr, id, None, "deposit", 50).await;
    assert_eq!(paid.status, StatusCode::OK, "{paid:?}");
    let taken = command(addr, id, Some("take-1"), "withdraw", 50).await;
    assert_eq!(taken.status, StatusCode::OK, "{taken:?}");
    assert!(!taken.replayed, "the refusal left the key unused");
    assert_eq!(
        account(addr, id).await,
        json!({ "balance": 0, "version": 2 })
    );
    assert!(service.event_of_key("take-1").await.is_some());

    service.stop().await;
}

/// A keyed command whose key's row fails after its append leaves no event: the test stores
/// the key in a transaction of its own (another instance handling the same key), the request
/// appends and then waits at its key's row; when the test commits, the request's insert fails,
/// its transaction rolls back with its event, and its next attempt answers the stored receipt.
/// When the test rolls back instead, the request's key and event commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_command_whose_key_row_fails_after_its_append_leaves_no_event() {
    let service = spawned_start().await;
    let addr = service.addr;
    let observer = service.db.connect().await;

    // Committed first by the other holder of the key: the request appends, fails, rolls
    // back, and replays the other's receipt.
    let id = Uuid::now_v7();
    let theirs = Uuid::now_v7();
    let mut other = service.pool.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO idempotency_keys \
         (key, account, command, amount, event_id, version, balance) \
         VALUES ('pay-3', $1, 'deposit', 70, $2, 1, 70)",
    )
    .bind(id)
    .bind(theirs)
    .execute(&mut *other)
    .await
    .expect("store the key");
    let request = tokio::spawn(command(addr, id, Some("pay-3"), "deposit", 70));
    until_lock_waiters(&observer, 1, "the request at its key's row").await;
    other.commit().await.expect("commit");
    let answer = request.await.expect("the request");
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert!(answer.replayed, "{answer:?}");
    assert_eq!(answer.body["event_id"], theirs.to_string());
    assert_eq!(answer.body["attempts"], 2, "the first attempt rolled back");
    assert_eq!(service.events_of(id).await, 0, "its append rolled back");
    assert_eq!(
        account(addr, id).await,
        json!({ "balance": 0, "version": 0 })
    );

    // Rolled back by the other holder: the request's key and event commit together.
    let id = Uuid::now_v7();
    let mut other = service.pool.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO idempotency_keys \
         (key, account, command, amount, event_id, version, balance) \
         VALUES ('pay-4', $1, 'deposit', 70, $2, 1, 70)",
    )
    .bind(id)
    .bind(Uuid::now_v7())
    .execute(&mut *other)
    .await
    .expect("store the key");
    let request = tokio::spawn(command(addr, id, Some("pay-4"), "deposit", 70));
    until_lock_waiters(&observer, 1, "the request at its key's row").await;
    other.rollback().await.expect("roll back");
    let answer = request.await.expect("the request");
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    assert!(!answer.replayed, "{answer:?}");
    assert_eq!(answer.body["attempts"], 1);
    assert_eq!(
        service.event_of_key("pay-4").await.map(|e| e.to_string()),
        answer.body["event_id"].as_str().map(str::to_owned)
    );
    assert_eq!(
        account(addr, id).await,
        json!({ "balance": 70, "version": 1 })
    );

    drop(observer);
    service.stop().await;
}
