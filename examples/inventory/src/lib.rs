//! # lockstep-example-inventory
//!
//! The flash-sale sample of the pessimistic per-aggregate write lock: a [`StockItem`] aggregate
//! whose reservations never oversell, and a [`ReserveStock`] handler in three modes —
//! optimistic with retry, pessimistic (lock first, then load; optionally pipelined), and
//! fail-fast with a typed [`InventoryError::Busy`].
//!
//! - [`domain`] and [`handler`] are domain code: they import `lockstep-core` only (a test
//!   checks), so the handler is generic over the transaction, the [`lockstep_core::EventStore`]
//!   and the [`lockstep_core::AggregateWriteLock`].
//! - [`decider`] is the same aggregate as a `lockstep_core::Decider`, for the command combiner
//!   (`lockstep-combiner`: queued reservations of one SKU decided in turn under one lock and
//!   one commit).
//! - [`wiring`] is the composition root: PostgreSQL (`lockstep-pg-advisory`,
//!   `lockstep-pg-store`) or the testkit fakes.
//! - [`flash_sale`] runs concurrent customers against one SKU and tallies their answers.
//! - `main` runs a small flash sale: on PostgreSQL when `DATABASE_URL` is set, else in memory.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), lockstep_example_inventory::InventoryError> {
//! use lockstep_example_inventory::{handler, wiring, LockMode, ReserveStock};
//! use lockstep_testkit::{FakeDatabase, InMemoryEventStore};
//!
//! let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
//! let sku = uuid::Uuid::now_v7();
//! // The fake database is the unit-of-work source (lockstep_core::TransactionSource).
//! handler::stock_new_item(&db, &store, sku, 10).await?;
//! let reserve = wiring::fake_handler(&db, &store, LockMode::Pessimistic);
//! let cmd = ReserveStock { sku, quantity: 3, reservation_id: uuid::Uuid::now_v7() };
//! let done = reserve.handle(&db, &cmd).await?;
//! assert_eq!(done.available, 7);
//! # Ok(()) }
//! ```

pub mod decider;
pub mod domain;
pub mod flash_sale;
pub mod handler;
pub mod wiring;

pub use decider::{Reserve, StockItemDecider};
pub use domain::{InventoryError, STOCK_ITEM, StockEvent, StockItem};
pub use handler::{LockMode, ReserveStock, ReserveStockHandler, Reserved};

/// The README's "used by" example, compiled and run as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
