//! The composition root: the handler bound to a backend — PostgreSQL ([`postgres_handler`],
//! with units of work from `lockstep_pg::PgDatabase`) or the testkit fakes
//! ([`fake_handler`], with units of work from `lockstep_testkit::FakeDatabase`). Domain code
//! never imports this module.

use lockstep_combiner::Combiner;
use lockstep_core::DistributedAggregateWriteLock;
use lockstep_pg::PgDatabase;
use lockstep_pg_advisory::{PgAggregateWriteLock, PgDistributedLock};
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, InMemoryEventStore};

use crate::decider::StockItemDecider;
use crate::handler::{LockMode, ReserveStockHandler};

/// The handler on PostgreSQL: the advisory write lock and the event store, both built from the
/// process's one [`PgDatabase`], so they share its in-process lock queue.
pub fn postgres_handler(
    db: &PgDatabase,
    mode: LockMode,
) -> ReserveStockHandler<PgAggregateWriteLock, PgEventStore> {
    let lock = PgDistributedLock::new(db).aggregate_write_lock();
    ReserveStockHandler::new(lock, PgEventStore::new(db), mode)
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

/// The command combiner for stock items on PostgreSQL, built from the process's one
/// [`PgDatabase`].
pub fn postgres_combiner(db: &PgDatabase) -> Combiner<PgDatabase, PgEventStore, StockItemDecider> {
    Combiner::new(
        db.clone(),
        PgEventStore::new(db),
        StockItemDecider::default(),
    )
}

/// The command combiner for stock items on the fakes of `db`, over `store` (any store on the
/// fake transactions: the in-memory one, or a wrapper of it).
pub fn fake_combiner<S>(db: &FakeDatabase, store: S) -> Combiner<FakeDatabase, S, StockItemDecider>
where
    S: lockstep_core::SnapshotStore<lockstep_testkit::FakeTransaction> + 'static,
{
    Combiner::new(db.clone(), store, StockItemDecider::default())
}
