//! The flash sale the demo and the tests run: `customers` concurrent [`ReserveStock`] commands
//! of `each` units against one SKU, each on its own spawned task, and a [`Tally`] of what they
//! were answered. Composition-root code (it spawns tasks), so it sits beside [`crate::wiring`],
//! not in the domain.

use std::sync::Arc;

use lockstep_core::{AggregateWriteLock, EventStore, TransactionSource};
use uuid::Uuid;

use crate::domain::InventoryError;
use crate::handler::{self, ReserveStock, ReserveStockHandler};

/// What the customers of one flash sale were answered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Reservations committed.
    pub ok: u64,
    /// Units reserved by them.
    pub reserved: u64,
    /// Customers told the stock was insufficient.
    pub sold_out: u64,
    /// Customers told the SKU was busy (fail-fast mode).
    pub busy: u64,
    /// Retried attempts over all committed reservations.
    pub retries: u64,
    /// Attempts that lost an optimistic-concurrency race, over all committed reservations.
    pub conflicts: u64,
    /// Any other outcome (an error, a panicked task), as text.
    pub failures: Vec<String>,
    /// Units still available after the sale, as loaded from the store.
    pub available: u64,
}

impl Tally {
    /// Customers who got an answer of any kind.
    pub fn answered(&self) -> u64 {
        self.ok + self.sold_out + self.busy + self.failures.len() as u64
    }
}

/// Runs the sale against `sku` (already stocked) and loads what is left.
pub async fn run<U, L, S>(
    source: Arc<U>,
    reserve: Arc<ReserveStockHandler<L, S>>,
    store: &S,
    sku: Uuid,
    customers: usize,
    each: u32,
) -> Result<Tally, InventoryError>
where
    U: TransactionSource + 'static,
    L: AggregateWriteLock<U::Tx> + 'static,
    S: EventStore<U::Tx> + 'static,
{
    let tasks: Vec<_> = (0..customers)
        .map(|_| {
            let (source, reserve) = (Arc::clone(&source), Arc::clone(&reserve));
            tokio::spawn(async move {
                let cmd = ReserveStock {
                    sku,
                    quantity: each,
                    reservation_id: Uuid::now_v7(),
                };
                reserve.handle(&*source, &cmd).await
            })
        })
        .collect();
    let mut tally = Tally::default();
    for task in tasks {
        match task.await {
            Ok(Ok(done)) => {
                tally.ok += 1;
                tally.reserved += u64::from(each);
                tally.retries += u64::from(done.attempts - 1);
                tally.conflicts += u64::from(done.conflicts);
            }
            Ok(Err(InventoryError::InsufficientStock { .. })) => tally.sold_out += 1,
            Ok(Err(InventoryError::Busy { .. })) => tally.busy += 1,
            Ok(Err(other)) => tally.failures.push(other.to_string()),
            Err(panicked) => tally.failures.push(panicked.to_string()),
        }
    }
    tally.available = handler::load_item(&*source, store, sku).await?.available();
    Ok(tally)
}
