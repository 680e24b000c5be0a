//! The composition root: the handler bound to a backend — PostgreSQL ([`postgres_handler`],
//! with units of work from `lockstep_pg::PgTransactionSource`) or the testkit fakes
//! ([`fake_handler`], with units of work from `lockstep_testkit::FakeDatabase`). Domain code
//! never imports this module.

use deadpool_postgres::Pool;
use lockstep_core::DistributedAggregateWriteLock;
use lockstep_pg_advisory::{PostgresAggregateWriteLock, PostgresDistributedLock};
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, InMemoryEventStore};

use crate::handler::{LockMode, ReserveStockHandler};

/// The handler on PostgreSQL: advisory write lock and event store sharing one lock (and its
/// in-process queue).
pub fn postgres_handler(
    pool: &Pool,
    mode: LockMode,
) -> ReserveStockHandler<PostgresAggregateWriteLock, PgEventStore> {
    let lock = PostgresDistributedLock::new(pool.clone());
    let store = PgEventStore::with_lock(lock.clone());
    ReserveStockHandler::new(lock.aggregate_write_lock(), store, mode)
}

/// The handler on the fakes of `db`.
pub fn fake_handler(
    db: &FakeDatabase,
    store: &InMemoryEventStore,
    mode: LockMode,
) -> ReserveStockHandler<DistributedAggregateWriteLock<FakeDistributedLock>, InMemoryEventStore> {
    ReserveStockHandler::new(
        DistributedAggregateWriteLock::new(FakeDistributedLock::new(db)),
        store.clone(),
        mode,
    )
}
