//! The composition root: the routes bound to a concrete stack — PostgreSQL ([`postgres_router`],
//! one [`PgDatabase`] and every backend built from it) or the testkit fakes
//! ([`in_memory_router`]). Not generic, so axum checks each handler for the concrete types.

use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use lockstep_core::{DistributedAggregateWriteLock, RetryPolicy};
use lockstep_pg::PgDatabase;
use lockstep_pg_advisory::{PgAggregateWriteLock, PgDistributedLock};
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, InMemoryEventStore};

use crate::account::Accounts;
use crate::http::{App, balance, execute};

/// The stack on PostgreSQL.
pub type PgApp = App<PgDatabase, PgAggregateWriteLock, PgEventStore>;

/// The stack on the testkit fakes.
pub type InMemoryApp =
    App<FakeDatabase, DistributedAggregateWriteLock<FakeDistributedLock>, InMemoryEventStore>;

/// The service on `db` (already migrated).
pub fn postgres_router(db: &PgDatabase) -> Router {
    let app: Arc<PgApp> = Arc::new(App {
        source: db.clone(),
        accounts: Accounts::new(
            PgDistributedLock::new(db).aggregate_write_lock(),
            PgEventStore::new(db),
            RetryPolicy::default(),
        ),
    });
    Router::new()
        .route(
            "/accounts/{id}/commands",
            post(execute::<PgDatabase, PgAggregateWriteLock, PgEventStore>),
        )
        .route(
            "/accounts/{id}",
            get(balance::<PgDatabase, PgAggregateWriteLock, PgEventStore>),
        )
        .with_state(app)
}

/// The service on the testkit fakes of `db` (in memory; state lasts as long as the process).
pub fn in_memory_router(db: &FakeDatabase) -> Router {
    type Lock = DistributedAggregateWriteLock<FakeDistributedLock>;
    let app: Arc<InMemoryApp> = Arc::new(App {
        source: db.clone(),
        accounts: Accounts::new(
            DistributedAggregateWriteLock::new(FakeDistributedLock::new(db)),
            InMemoryEventStore::new(),
            RetryPolicy::default(),
        ),
    });
    Router::new()
        .route(
            "/accounts/{id}/commands",
            post(execute::<FakeDatabase, Lock, InMemoryEventStore>),
        )
        .route(
            "/accounts/{id}",
            get(balance::<FakeDatabase, Lock, InMemoryEventStore>),
        )
        .with_state(app)
}
