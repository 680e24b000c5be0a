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
//!   handler holding it can be spawned), and [`PgTransactionRef`], the view every Postgres
//!   backend takes of a transaction, implemented by [`PgTransaction`] and by
//!   `tokio_postgres::Transaction` (which `deadpool_postgres::Transaction` derefs to).
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

pub mod error;
pub mod migrate;
pub mod source;
pub mod transaction;

pub use error::{map_error, map_pool_error};
pub use migrate::migrate;
pub use source::PgTransactionSource;
pub use transaction::{PgTransaction, PgTransactionRef};

/// Re-exported so users name the same driver versions as the backends.
pub use deadpool_postgres;
pub use tokio_postgres;
