//! The composition root: the [`UnitOfWork`]s that bind the generic handler to a backend —
//! PostgreSQL ([`PgUnitOfWork`], with [`postgres_handler`]) or the testkit fakes
//! ([`FakeUnitOfWork`], with [`fake_handler`]). Domain code never imports this module.

use deadpool_postgres::Pool;
use lockstep_core::{DistributedAggregateWriteLock, Result};
use lockstep_pg::PgTransaction;
use lockstep_pg_advisory::{PostgresAggregateWriteLock, PostgresDistributedLock};
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, FakeTransaction, InMemoryEventStore};

use crate::handler::{LockMode, ReserveStockHandler, UnitOfWork};

/// Units of work on PostgreSQL: owned READ COMMITTED transactions from a pool.
#[derive(Debug, Clone)]
pub struct PgUnitOfWork {
    pool: Pool,
}

impl PgUnitOfWork {
    /// Transactions on connections from `pool`.
    pub fn new(pool: Pool) -> Self {
        PgUnitOfWork { pool }
    }
}

impl UnitOfWork for PgUnitOfWork {
    type Tx = PgTransaction;

    async fn begin(&self) -> Result<PgTransaction> {
        PgTransaction::begin(&self.pool).await
    }

    async fn commit(&self, tx: PgTransaction) -> Result<()> {
        tx.commit().await
    }

    async fn rollback(&self, tx: PgTransaction) {
        // A failed rollback discards the connection; the server rolls back.
        let _ = tx.rollback().await;
    }
}

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

/// Units of work on the testkit's fake transactions.
#[derive(Debug, Clone, Default)]
pub struct FakeUnitOfWork {
    db: FakeDatabase,
}

impl FakeUnitOfWork {
    /// Transactions on `db`.
    pub fn new(db: &FakeDatabase) -> Self {
        FakeUnitOfWork { db: db.clone() }
    }

    /// The fake database.
    pub fn database(&self) -> &FakeDatabase {
        &self.db
    }
}

impl UnitOfWork for FakeUnitOfWork {
    type Tx = FakeTransaction;

    async fn begin(&self) -> Result<FakeTransaction> {
        Ok(self.db.begin())
    }

    async fn commit(&self, tx: FakeTransaction) -> Result<()> {
        tx.commit().await
    }

    async fn rollback(&self, tx: FakeTransaction) {
        tx.rollback().await;
    }
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
