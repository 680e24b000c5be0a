//! The service end to end, over HTTP, on PostgreSQL and on the testkit fakes: concurrent requests
//! on one account, each on axum's spawned tasks, each a unit of work under the account's write
//! lock. Deposits all count, withdrawals never overdraw, every request gets its answer; the daily
//! statement (a table perspective kept by the worker beside the routes) shows every command once
//! when read after the caller's own last write. Each runs in the task `lockstep::testing`
//! spawns for it, on a fresh migrated database or on a fake one; the service is wired by its
//! own composition root (`wiring`), which is not generic so that axum checks each handler for
//! the concrete types.

use std::net::SocketAddr;

use axum::Router;
use futures_util::future::join_all;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use lockstep::testing::{Fakes, Postgres, on_fakes, on_postgres};
use lockstep_example_service::{serve, wiring};
use lockstep_worker::CancellationToken;
use serde_json::{Value, json};
use tokio::sync::oneshot;
use uuid::Uuid;

/// The service on an ephemeral port; dropping it stops the server.
struct Running {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(router: Router) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind an ephemeral port");
    let addr = listener.local_addr().expect("address");
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, router, async {
        let _ = stopped.await;
    }));
    Running { addr, stop, server }
}

/// One request on a connection of its own; the status and the JSON body.
async fn call(
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .expect("request");
    let response = sender.send_request(request).await.expect("response");
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, value)
}

async fn command(addr: SocketAddr, account: Uuid, kind: &str, amount: u64) -> (StatusCode, Value) {
    call(
        addr,
        Method::POST,
        &format!("/accounts/{account}/commands"),
        Some(json!({ "type": kind, "amount": amount })),
    )
    .await
}

/// 32 concurrent deposits of 10, then 40 concurrent withdrawals of 10 on one account: every
/// deposit commits at its own version, exactly 32 withdrawals commit and 8 are told "insufficient
/// funds", and the balance ends at 0 with 64 events. Then the answers for bad input.
async fn concurrent_requests_on_one_account(router: Router) {
    let service = start(router).await;
    let addr = service.addr;
    let account = Uuid::now_v7();

    let deposits = join_all((0..32).map(|_| command(addr, account, "deposit", 10))).await;
    let mut versions: Vec<u64> = deposits
        .iter()
        .map(|(status, body)| {
            assert_eq!(*status, StatusCode::OK, "{body}");
            body["version"].as_u64().expect("a version")
        })
        .collect();
    versions.sort_unstable();
    assert_eq!(versions, (1..=32).collect::<Vec<_>>(), "one version each");

    let withdrawals = join_all((0..40).map(|_| command(addr, account, "withdraw", 10))).await;
    let ok = withdrawals
        .iter()
        .filter(|(status, _)| *status == StatusCode::OK)
        .count();
    let refused = withdrawals
        .iter()
        .filter(|(status, body)| {
            *status == StatusCode::CONFLICT
                && body["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("insufficient funds"))
        })
        .count();
    assert_eq!((ok, refused), (32, 8), "{withdrawals:?}");
    assert!(
        withdrawals.iter().all(|(_, body)| body["balance"]
            .as_u64()
            .is_none_or(|balance| balance <= 320)),
        "never more than was paid in"
    );

    let (status, state) = call(addr, Method::GET, &format!("/accounts/{account}"), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(state, json!({ "balance": 0, "version": 64 }));

    let (status, body) = command(addr, account, "deposit", 0).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let (status, _) = call(
        addr,
        Method::POST,
        &format!("/accounts/{account}/commands"),
        Some(json!({ "type": "transfer" })),
    )
    .await;
    assert!(
        status.is_client_error(),
        "an unknown command is refused: {status}"
    );
    let (status, _) = call(addr, Method::GET, "/accounts/not-a-uuid", None).await;
    assert!(status.is_client_error(), "a bad id is refused: {status}");
    let (status, state) = call(addr, Method::GET, &format!("/accounts/{account}"), None).await;
    assert_eq!(
        (status, state),
        (StatusCode::OK, json!({ "balance": 0, "version": 64 }))
    );

    // The daily statement, read after the caller's own last write: every command of the test
    // is in it (64 events: 320 cents in, 320 out), as a handler that waits for its own write
    // sees it. Without `after` it answers at once.
    let last = withdrawals
        .iter()
        .filter(|(status, _)| *status == StatusCode::OK)
        .filter_map(|(_, body)| body["event_id"].as_str())
        .max()
        .expect("an event id in every receipt")
        .to_owned();
    let (status, totals) = call(
        addr,
        Method::GET,
        &format!("/statements/daily?after={last}"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{totals}");
    let days = totals.as_array().expect("a list of days");
    let sum = |field: &str| {
        days.iter()
            .map(|d| d[field].as_i64().unwrap_or(0))
            .sum::<i64>()
    };
    assert_eq!(
        (sum("deposited"), sum("withdrawn"), sum("events")),
        (320, 320, 64),
        "{totals}"
    );
    let (status, _) = call(addr, Method::GET, "/statements/daily?after=nope", None).await;
    assert!(status.is_client_error(), "a bad id is refused: {status}");

    // The operator rebuilds the statement: every account's rows are reset and replayed; a read
    // after the rebuild's requests (they are rewinds from the start, pending until each
    // commits) shows the same totals, every event once.
    let (status, rebuilt) = call(addr, Method::POST, "/admin/statements/rebuild", None).await;
    assert_eq!(status, StatusCode::OK, "{rebuilt}");
    assert_eq!(rebuilt["requested"], 1, "one account, one pair: {rebuilt}");
    let (status, again) = call(
        addr,
        Method::GET,
        &format!("/statements/daily?after={last}"),
        None,
    )
    .await;
    assert_eq!(
        (status, &again),
        (StatusCode::OK, &totals),
        "rebuilt to the same rows"
    );

    // Retired (its rows stay: they are the application's), new commands queue no work for it.
    let (status, body) = call(
        addr,
        Method::POST,
        "/admin/statements/retire?states=sideways",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let (status, body) = call(
        addr,
        Method::POST,
        "/admin/statements/retire?states=keep",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["retired"], true, "{body}");
    let (status, _) = command(addr, account, "deposit", 5).await;
    assert_eq!(status, StatusCode::OK);
    let (status, after) = call(addr, Method::GET, "/statements/daily", None).await;
    assert_eq!(
        (status, &after),
        (StatusCode::OK, &totals),
        "retired: no longer kept"
    );
    // Kept states can be dropped later; then there is nothing left to retire.
    let (status, body) = call(
        addr,
        Method::POST,
        "/admin/statements/retire?states=drop",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = call(addr, Method::POST, "/admin/statements/retire", None).await;
    assert_eq!(status, StatusCode::CONFLICT, "retired already: {body}");
    let (status, after) = call(addr, Method::GET, "/statements/daily", None).await;
    assert_eq!(
        (status, &after),
        (StatusCode::OK, &totals),
        "the application's rows are its own: retiring leaves them"
    );

    drop(service.stop);
    service
        .server
        .await
        .expect("the server task")
        .expect("a graceful stop");
}

/// The service's routes and worker, checked over HTTP, then stopped.
async fn concurrent_requests_on_one_account_then_stop(
    service: lockstep_core::Result<wiring::Service>,
    shutdown: CancellationToken,
) {
    let service = service.expect("service");
    concurrent_requests_on_one_account(service.router).await;
    shutdown.cancel();
    service.worker.await.expect("worker task").expect("worker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_on_one_account_on_postgres() {
    on_postgres(|b: Postgres| async move {
        let shutdown = CancellationToken::new();
        let service = wiring::postgres_service(b.database(), shutdown.clone()).await;
        concurrent_requests_on_one_account_then_stop(service, shutdown).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_on_one_account_in_memory() {
    on_fakes(|b: Fakes| async move {
        let shutdown = CancellationToken::new();
        let service = wiring::in_memory_service(b.database(), shutdown.clone()).await;
        concurrent_requests_on_one_account_then_stop(service, shutdown).await;
    })
    .await;
}
