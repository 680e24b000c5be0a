//! Serves the account service on sqlx on `SERVICE_ADDR` (default `127.0.0.1:3000`), on the
//! database at `DATABASE_URL` — required: sqlx has no in-memory mode — with the worker keeping
//! the daily statement beside it. Stops on Ctrl-C.
//!
//! The application builds its `sqlx::PgPool`; lockstep is wired from it
//! (`SqlxDatabase::new(pool)`), and its migrations run on it first
//! ([`SqlxDatabase::migrate`], idempotent; `lockstep migrate` of the CLI applies the same
//! schema from a deploy step).

// A demo program: telling the user where it listens is its job.
#![allow(clippy::print_stdout)]

use lockstep::postgres::sqlx::SqlxDatabase;
use lockstep::worker::CancellationToken;
use lockstep_example_service_sqlx::{serve, wiring};
use sqlx::postgres::PgPoolOptions;

/// The application's pool size.
const POOL_SIZE: u32 = 16;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("SERVICE_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let url = std::env::var("DATABASE_URL").map_err(|_| {
        "DATABASE_URL is required: this service keeps its accounts in PostgreSQL through sqlx, \
         which has no in-memory mode (lockstep-example-service runs on the in-memory fakes)"
    })?;

    let pool = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .connect(&url)
        .await?;
    let db = SqlxDatabase::new(pool);
    db.migrate().await?;
    let shutdown = CancellationToken::new();
    let service = wiring::service(&db, shutdown.clone()).await?;
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("accounts on PostgreSQL through sqlx");
    println!("listening on http://{}", listener.local_addr()?);
    serve(listener, service.router, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    shutdown.cancel();
    service.worker.await??;
    Ok(())
}
