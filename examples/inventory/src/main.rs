//! A small flash sale: 32 concurrent customers reserve 4 units each of a SKU stocked with 100,
//! in every [`LockMode`]. On PostgreSQL when `DATABASE_URL` is set (the schema is migrated
//! first), otherwise on the in-memory fakes. Prints what each mode did; never oversells.

// A demo program: printing is its job.
#![allow(clippy::print_stdout)]

use std::sync::Arc;

use lockstep_core::{AggregateWriteLock, EventStore, TransactionSource};
use lockstep_example_inventory::InventoryError;
use lockstep_example_inventory::flash_sale::{self, Tally};
use lockstep_example_inventory::handler::{self, LockMode, ReserveStockHandler};
use lockstep_example_inventory::wiring;
use lockstep_pg::PgDatabase;
use lockstep_testkit::{FakeDatabase, InMemoryEventStore};
use uuid::Uuid;

const CUSTOMERS: usize = 32;
const STOCK: u32 = 100;
const EACH: u32 = 4;

/// Stocks a new SKU and runs the sale on it.
async fn sale<U, L, S>(
    source: Arc<U>,
    reserve: Arc<ReserveStockHandler<L, S>>,
    store: &S,
) -> Result<Tally, InventoryError>
where
    U: TransactionSource + 'static,
    L: AggregateWriteLock<U::Tx> + 'static,
    S: EventStore<U::Tx> + 'static,
{
    let sku = Uuid::now_v7();
    handler::stock_new_item(&*source, store, sku, STOCK).await?;
    flash_sale::run(source, reserve, store, sku, CUSTOMERS, EACH).await
}

fn report(mode: LockMode, tally: &Tally) {
    println!(
        "{mode:?}: reserved {} units, {} left (stock {STOCK}); sold out: {}, busy: {}, failed: {}, retries: {}",
        tally.reserved,
        tally.available,
        tally.sold_out,
        tally.busy,
        tally.failures.len(),
        tally.retries
    );
    assert_eq!(
        tally.reserved + tally.available,
        u64::from(STOCK),
        "every unit accounted for"
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    match std::env::var("DATABASE_URL") {
        Ok(url) => {
            let db = PgDatabase::connect(&url).await?;
            db.migrate().await?;
            println!("flash sale on PostgreSQL");
            let source = Arc::new(db.clone());
            let store = lockstep_pg_store::PgEventStore::new(&db);
            for mode in LockMode::ALL {
                let reserve = wiring::postgres_handler(&db, mode);
                let tally = sale(Arc::clone(&source), Arc::new(reserve), &store).await?;
                report(mode, &tally);
            }
        }
        Err(_) => {
            println!("flash sale in memory (set DATABASE_URL to run it on PostgreSQL)");
            let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
            let source = Arc::new(db.clone());
            for mode in LockMode::ALL {
                let reserve = Arc::new(wiring::fake_handler(&db, &store, mode));
                let tally = sale(Arc::clone(&source), reserve, &store).await?;
                report(mode, &tally);
            }
        }
    }
    Ok(())
}
