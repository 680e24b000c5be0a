//! # lockstep-example-service
//!
//! A small HTTP service on lockstep, the shape of a real application: axum runs each request on
//! a spawned task, and each handler runs one command on a bank account in a unit of work under
//! the account's write lock (`relay:aggregate:Account:{id}`), with the optimistic version check
//! still on.
//!
//! - [`account`]: the domain and its command handlers, on `lockstep-core` only.
//! - [`http`]: the routes and how failures become HTTP answers.
//! - [`statement`]: the daily statement, a read model in the application's own table written by
//!   a table perspective in the worker's transaction, and its route, which waits until the
//!   caller's own write is applied.
//! - [`wiring`]: the routes and the worker bound to PostgreSQL (one `PgDatabase`) or to the
//!   testkit fakes.
//! - `main`: serves on `SERVICE_ADDR` (default `127.0.0.1:3000`), on PostgreSQL when
//!   `DATABASE_URL` is set, else in memory.
//!
//! `tests/http.rs` starts the service on both stacks and sends it concurrent requests over HTTP.

pub mod account;
pub mod http;
pub mod statement;
pub mod wiring;

/// Serves `router` on `listener` until `shutdown` completes (in-flight requests finish first).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}
