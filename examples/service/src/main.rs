//! Serves the account service on `SERVICE_ADDR` (default `127.0.0.1:3000`): on PostgreSQL when
//! `DATABASE_URL` is set (migrated first), else on the in-memory fakes, with the worker keeping
//! the daily statement beside it. Stops on Ctrl-C.

// A demo program: telling the user where it listens is its job.
#![allow(clippy::print_stdout)]

use lockstep_example_service::{serve, wiring};
use lockstep_pg::PgDatabase;
use lockstep_testkit::FakeDatabase;
use lockstep_worker::CancellationToken;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("SERVICE_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let shutdown = CancellationToken::new();
    let service = match std::env::var("DATABASE_URL") {
        Ok(url) => {
            let db = PgDatabase::connect(&url).await?;
            db.migrate().await?;
            println!("accounts on PostgreSQL ({})", db.target().unwrap_or("pool"));
            wiring::postgres_service(&db, shutdown.clone()).await?
        }
        Err(_) => {
            println!("accounts in memory (set DATABASE_URL to keep them in PostgreSQL)");
            wiring::in_memory_service(&FakeDatabase::new(), shutdown.clone()).await?
        }
    };
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    serve(listener, service.router, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    shutdown.cancel();
    service.worker.await??;
    Ok(())
}
