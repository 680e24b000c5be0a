//! # lockstep-pg
//!
//! The PostgreSQL plumbing shared by the lockstep backends (`lockstep-pg-stream`,
//! `lockstep-pg-advisory`, `lockstep-pg-store`):
//!
//! - [`migrate()`]: applies the schema, the numbered SQL files of the workspace's `migrations/`
//!   folder, which this crate carries a checked copy of ([`migrate`](mod@migrate) says what
//!   it creates and what the `wh_` prefix means). Explicit, idempotent, safe from several
//!   processes at once, recorded in a history table of lockstep's own.
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
//! - [`source`]: [`PgTransactionSource`], the unit-of-work contract
//!   ([`lockstep_core::TransactionSource`]) over a pool, whose transactions are
//!   [`PgTransaction`]s.
//!
//! ```no_run
//! # async fn demo(pool: deadpool_postgres::Pool) -> lockstep_core::Result<()> {
//! lockstep_pg::migrate(&pool).await?;
//! let tx = lockstep_pg::PgTransaction::begin(&pool).await?;
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
pub mod error;
#[doc(hidden)]
pub mod internal;
pub mod migrate;
pub mod pool;
mod queue;
pub mod source;
pub mod transaction;

pub use advisory::LockQueue;
pub use error::{map_error, map_pool_error};
pub use migrate::migrate;
pub use pool::{DEFAULT_CHECKOUT_WAIT, checkout};
pub use source::PgTransactionSource;
pub use transaction::{PgTransaction, PgTransactionRef, WriteAtCommit};

/// Re-exported so users name the same driver versions as the backends.
pub use deadpool_postgres;
pub use tokio_postgres;
