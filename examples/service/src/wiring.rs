//! The composition root: the routes bound to a concrete stack — PostgreSQL ([`postgres_service`],
//! one [`PgDatabase`] and every backend built from it) or the testkit fakes
//! ([`in_memory_service`]) — and the perspective worker that keeps the daily statement
//! ([`crate::statement`]), running beside the routes until the service's shutdown token fires.
//! Not generic, so axum checks each handler for the concrete types.

use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use lockstep_core::{
    Fleet, InstanceId, PerspectiveRegistry, RetryPolicy, StreamLockOptions, Transaction as _,
    TransactionSource as _,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::{
    FakeDatabase, FakeTransaction, InMemoryEventStore, InMemoryPerspectiveStore,
    InMemoryStreamLocker,
};
use lockstep_worker::{CancellationToken, PerspectiveWorker, ReadModels, WorkerOptions};
use tokio::task::JoinHandle;

use crate::account::Accounts;
use crate::http::{App, balance, execute};
use crate::statement::{
    DailyStatement, InMemoryStatement, PgStatement, SCHEMA, daily_in_memory, daily_on_postgres,
    rebuild_in_memory, rebuild_on_postgres, retire_in_memory, retire_on_postgres,
};

/// The stack on PostgreSQL.
pub type PgApp = App<PgDatabase, PgEventStore>;

/// The stack on the testkit fakes.
pub type InMemoryApp = App<FakeDatabase, InMemoryEventStore>;

/// The routes, and the worker task keeping the read model (it ends when the shutdown token
/// given to the constructor fires; await it after the server has stopped).
#[derive(Debug)]
pub struct Service {
    /// The routes.
    pub router: Router,
    /// The perspective worker's task.
    pub worker: JoinHandle<lockstep_core::Result<()>>,
}

/// The service on `db` (already migrated): creates the application's tables if missing, and
/// starts the worker (call within a tokio runtime).
pub async fn postgres_service(
    db: &PgDatabase,
    shutdown: CancellationToken,
) -> lockstep_core::Result<Service> {
    let tx = db.begin().await?;
    tx.client().batch_execute(SCHEMA).await.map_err(|e| {
        lockstep_core::Error::new(
            lockstep_core::ErrorKind::Backend,
            "creating the application's tables",
        )
        .with_source(e)
    })?;
    tx.commit().await?;

    let mut registry = PerspectiveRegistry::new();
    registry.register_table::<PgTransaction, _>(DailyStatement::default())?;
    // The locker keeps the fleet too: the worker takes its leases through it and announces
    // itself (`lockstep workers` lists it; a wait that times out says whether one runs).
    let fleet: Arc<dyn Fleet> = Arc::new(PgStreamLocker::new(db, StreamLockOptions::default()));
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

    let app: Arc<PgApp> = Arc::new(App {
        source: db.clone(),
        accounts: Accounts::new(db.clone(), PgEventStore::new(db), RetryPolicy::default()),
    });
    let statement = Arc::new(PgStatement {
        db: db.clone(),
        reads: ReadModels::new(db.clone(), PgPerspectiveStore::new()),
    });
    let router = Router::new()
        .route(
            "/accounts/{id}/commands",
            post(execute::<PgDatabase, PgEventStore>),
        )
        .route("/accounts/{id}", get(balance::<PgDatabase, PgEventStore>))
        .with_state(app)
        .merge(
            Router::new()
                .route("/statements/daily", get(daily_on_postgres))
                .route("/admin/statements/rebuild", post(rebuild_on_postgres))
                .route("/admin/statements/retire", post(retire_on_postgres))
                .with_state(statement),
        );
    Ok(Service { router, worker })
}

/// The service on the testkit fakes of `db` (in memory; state lasts as long as the process),
/// with its worker started (call within a tokio runtime).
pub async fn in_memory_service(
    db: &FakeDatabase,
    shutdown: CancellationToken,
) -> lockstep_core::Result<Service> {
    let events = InMemoryEventStore::new();
    let locker = InMemoryStreamLocker::with_database(StreamLockOptions::default(), db);
    let store = InMemoryPerspectiveStore::new(db, &events, &locker);
    let statement = DailyStatement::default();
    let mut registry = PerspectiveRegistry::new();
    registry.register_table::<FakeTransaction, _>(statement.clone())?;
    let worker = PerspectiveWorker::new(
        db.clone(),
        store.clone(),
        registry,
        WorkerOptions::default(),
        InstanceId::process(),
        None,
    )?
    .with_fleet(Arc::new(locker));
    worker.register().await?;
    let worker = tokio::spawn(async move { worker.run(shutdown).await });

    let app: Arc<InMemoryApp> = Arc::new(App {
        source: db.clone(),
        accounts: Accounts::new(db.clone(), events, RetryPolicy::default()),
    });
    let statement = Arc::new(InMemoryStatement {
        statement,
        db: db.clone(),
        store: store.clone(),
        reads: ReadModels::new(db.clone(), store),
    });
    let router = Router::new()
        .route(
            "/accounts/{id}/commands",
            post(execute::<FakeDatabase, InMemoryEventStore>),
        )
        .route(
            "/accounts/{id}",
            get(balance::<FakeDatabase, InMemoryEventStore>),
        )
        .with_state(app)
        .merge(
            Router::new()
                .route("/statements/daily", get(daily_in_memory))
                .route("/admin/statements/rebuild", post(rebuild_in_memory))
                .route("/admin/statements/retire", post(retire_in_memory))
                .with_state(statement),
        );
    Ok(Service { router, worker })
}
