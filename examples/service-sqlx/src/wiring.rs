//! The composition root: the routes and the perspective worker on the application's
//! `sqlx::PgPool`, through one [`SqlxDatabase`] every lockstep backend is built from (one lock
//! queue for the write lock and the locked loads; the stream locker's statements on the same
//! pool). Not generic, so axum checks each handler for the concrete types.

use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use lockstep::postgres::sqlx::{SqlxDatabase, SqlxTransaction, map_sqlx_error};
use lockstep::postgres::{PgEventStore, PgPerspectiveStore, PgStreamLocker};
use lockstep::worker::{CancellationToken, PerspectiveWorker, ReadModels, WorkerOptions};
use lockstep::{
    Fleet, InstanceId, PerspectiveRegistry, RetryPolicy, StreamLockOptions, Transaction as _,
    TransactionSource as _,
};
use lockstep_example_service::http::{App, balance};
pub use lockstep_example_service::wiring::Service;

use crate::command::{Commands, KEYS_SCHEMA, execute};
use crate::statement::{DailyStatement, SCHEMA, Statement, daily};

/// The service on `db` (the application's pool, migrated: [`SqlxDatabase::migrate`]): creates
/// the application's tables if missing (in one transaction), registers the daily statement and
/// starts the worker (call within a tokio runtime; it stops when `shutdown` fires).
pub async fn service(db: &SqlxDatabase, shutdown: CancellationToken) -> lockstep::Result<Service> {
    create_tables(db).await?;

    // The locker keeps the fleet too: the worker takes its leases through it and announces
    // itself (`lockstep workers` lists it; a wait that times out says whether one runs).
    let fleet: Arc<dyn Fleet> =
        Arc::new(PgStreamLocker::for_sqlx(db, StreamLockOptions::default()));
    let mut registry = PerspectiveRegistry::new();
    registry.register_table::<SqlxTransaction, _>(DailyStatement)?;
    let worker = PerspectiveWorker::new(
        db.clone(),
        PgPerspectiveStore::new(),
        registry,
        WorkerOptions::default(),
        InstanceId::process(),
        None,
    )?
    .with_fleet(fleet);
    // Registered before the first request: every command's event then queues its work.
    worker.register().await?;
    let worker = tokio::spawn(async move { worker.run(shutdown).await });

    let commands = Commands::new(db, RetryPolicy::default());
    let app = Arc::new(App {
        source: db.clone(),
        accounts: commands.accounts().clone(),
    });
    let statement = Arc::new(Statement {
        pool: db.pool().clone(),
        reads: ReadModels::new(db.clone(), PgPerspectiveStore::new()),
    });
    let router = Router::new()
        .route("/accounts/{id}/commands", post(execute))
        .with_state(Arc::new(commands))
        .merge(
            Router::new()
                .route("/accounts/{id}", get(balance::<SqlxDatabase, PgEventStore>))
                .with_state(app),
        )
        .merge(
            Router::new()
                .route("/statements/daily", get(daily))
                .with_state(statement),
        );
    Ok(Service { router, worker })
}

/// The statement's and the idempotency keys' tables, with sqlx in a unit of work.
async fn create_tables(db: &SqlxDatabase) -> lockstep::Result<()> {
    let tx = db.begin().await?;
    {
        let mut conn = tx.connection().await?;
        // `Executor::execute(conn, raw_sql(…))`, not `raw_sql(…).execute(conn)`: the method
        // form's future is not `Send` for every lifetime, so a spawned caller fails to compile.
        for schema in [SCHEMA, KEYS_SCHEMA] {
            sqlx::Executor::execute(&mut *conn, sqlx::raw_sql(schema))
                .await
                .map_err(map_sqlx_error)?;
        }
    }
    tx.commit().await
}
