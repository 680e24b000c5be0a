//! **Not part of the public API, and not semver-stable.**
//!
//! What lockstep's own Postgres backends (`lockstep-pg-advisory`, `lockstep-pg-store`,
//! `lockstep-pg-stream`) share beyond the public API: the advisory-lock waiting machinery
//! (in-process queue, deadline, cancel-on-drop), the SQLSTATE mapping of a single driver error,
//! and the error of one of lockstep's own statements (which says to run the migrations when the
//! schema is missing). It is public only because those sibling crates call it; it is hidden
//! from the documentation and may change in any release, patch releases included. The sibling
//! crates pin this crate with an exact version (`=x.y.z` in the workspace manifest), so they
//! always build against the version they were written for. Do not depend on anything here: use [`crate::LockQueue`], the backends, and
//! [`crate::map_error`] instead. (sqlx-core carries the same note for the same reason.)

pub use crate::advisory::{
    LockCall, LockingTransaction, acquire_with, cancel_on_drop, check_isolation, column, db_column,
    deadline_after, in_turn, lock_db_error, lock_error, lock_statement, lock_timeout_setting,
    try_lock_statement,
};
pub use crate::cancel::{CancelOnDrop, SendCancel};
pub use crate::pooler::{PoolerState, probe as probe_pooler, session_state_refused};

/// What `db` knows about a transaction pooler in front of its server, shared with the backends
/// built from it.
pub fn pooler_state(db: &crate::PgDatabase) -> &PoolerState {
    db.pooler_state()
}

/// A driver error of one of lockstep's own statements: [`crate::map_error`], and a database
/// without lockstep's schema (undefined table, column or function) says to run
/// [`crate::migrate()`].
pub fn statement_error(err: tokio_postgres::Error, doing: &str) -> lockstep_core::Error {
    crate::error::map_statement_error(err, doing)
}

/// [`statement_error`] of either driver ([`crate::driver::DbError`]).
pub fn db_statement_error(err: crate::driver::DbError, doing: &str) -> lockstep_core::Error {
    crate::error::map_db_statement_error(err, doing)
}

/// The [`ErrorKind`](lockstep_core::ErrorKind) of a driver error of either driver.
pub fn db_kind_of(err: &crate::driver::DbError) -> lockstep_core::ErrorKind {
    crate::error::kind_of_db(err)
}

/// The [`ErrorKind`](lockstep_core::ErrorKind) of a driver error: by SQLSTATE when the server
/// sent one, else connection loss for closed connections and I/O failures.
pub fn kind_of(err: &tokio_postgres::Error) -> lockstep_core::ErrorKind {
    crate::error::kind_of(err)
}

/// [`crate::migrate::check_schema_on`] on either driver's executor.
pub async fn check_schema_with<E: crate::driver::Executor + ?Sized>(
    conn: &E,
) -> lockstep_core::Result<crate::migrate::InstalledSchema> {
    crate::migrate::check_schema_with(conn).await
}
