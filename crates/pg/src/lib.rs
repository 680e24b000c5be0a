//! # lockstep-pg
//!
//! The PostgreSQL plumbing shared by the lockstep backends (`lockstep-pg-stream`,
//! `lockstep-pg-advisory`, `lockstep-pg-store`):
//!
//! - [`PgDatabase`] ([`database`]): **the one handle** a process builds — from a URL, a config
//!   or a pool of its own, with the pool size, checkout wait, TLS and lock-queue settings. It is
//!   the unit-of-work source ([`lockstep_core::TransactionSource`], `Tx` = [`PgTransaction`]),
//!   runs [`PgDatabase::migrate`], and every backend is built from it
//!   (`lockstep_pg_advisory::PgDistributedLock::new(&db)`,
//!   `lockstep_pg_stream::PgStreamLocker::new(&db, options)`,
//!   `lockstep_pg_store::PgEventStore::new(&db)`), so they share its queue and TLS.
//! - [`migrate()`]: applies the schema of the workspace's `migrations/` folder (a baseline,
//!   later numbered migrations, one file per SQL function) and records its version;
//!   [`migrate::check_schema`] refuses a database this build was not built for
//!   ([`migrate`](mod@migrate) says what it creates and what the `wh_` prefix means). Explicit,
//!   idempotent, safe from several processes at once.
//! - [`error`]: SQLSTATE → [`lockstep_core::ErrorKind`], never by message text.
//! - [`transaction`]: [`PgTransaction`], an owned unit-of-work transaction (`'static`, so a
//!   handler holding it can be spawned; the only transaction a lock can be **waited** for on,
//!   because it can close its connection after an abandoned wait), and [`PgTransactionRef`],
//!   the view of a transaction that the statements which never wait for a lock take (event
//!   store load and append, the lease fence), implemented by [`PgTransaction`],
//!   `tokio_postgres::Transaction` and `deadpool_postgres::Transaction` (pass `&tx`).
//! - [`LockQueue`]: the in-process queue in front of advisory locks and how an abandoned wait
//!   is cancelled (with the pool's TLS connector), shared by the aggregate lock
//!   (`lockstep-pg-advisory`) and the event store's `load_locked` (`lockstep-pg-store`).
//! - [`pool`]: every checkout lockstep makes waits a bounded time ([`checkout`],
//!   [`DEFAULT_CHECKOUT_WAIT`]), so an exhausted pool is an error instead of a hang, and how
//!   to size the pool.
//!
//! ```no_run
//! # async fn demo() -> lockstep_core::Result<()> {
//! use lockstep_pg::{PgDatabase, Transaction, TransactionSource};
//!
//! let db = PgDatabase::connect("postgres://app@db.internal/app").await?;
//! db.migrate().await?;
//! let tx = db.begin().await?;
//! // ... take locks and write through the backends on &tx ...
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! # Stability
//!
//! Everything documented here follows semver. The module `internal` (hidden from these docs)
//! does **not**: it holds what lockstep's own backend crates share (the lock-waiting machinery,
//! the SQLSTATE mapping of one driver error), may change in any release, and is for those
//! crates only; they pin this crate with an exact `=` version.

mod advisory;
mod cancel;
pub mod database;
#[doc(hidden)]
pub mod driver;
pub mod error;
#[doc(hidden)]
pub mod internal;
pub mod migrate;
pub mod pool;
mod pooler;
mod queue;
#[cfg(feature = "sqlx")]
pub mod sqlx;
pub mod target;
pub mod transaction;

pub use advisory::LockQueue;
pub use database::{PgDatabase, PgDatabaseBuilder};
pub use error::{describe, describe_pool_error, map_error, map_pool_error};
pub use migrate::migrate;
pub use pool::{DEFAULT_CHECKOUT_WAIT, checkout};
pub use transaction::{PgTransaction, PgTransactionRef, WriteAtCommit};

/// The unit-of-work traits [`PgDatabase`] and [`PgTransaction`] implement, so Postgres-only
/// code can `use lockstep_pg::{Transaction, TransactionSource}` for `begin` and `commit`.
pub use lockstep_core::{Transaction, TransactionSource};

/// Re-exported so users name the same driver versions as the backends.
pub use deadpool_postgres;
pub use tokio_postgres;
