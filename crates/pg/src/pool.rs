//! Checking connections out of a pool **with a bounded wait**, and how big the pool should be.
//!
//! deadpool's defaults wait for a free connection for ever: with every connection busy, a
//! lease renewal, a lock or a commit would hang while the lease it is meant to keep expires.
//! Every checkout lockstep makes therefore waits at most a bounded time ([`checkout`],
//! [`DEFAULT_CHECKOUT_WAIT`] unless configured: `PgDatabaseBuilder::checkout_wait`,
//! `PgTransaction::begin_within`, `PgDistributedLock::with_checkout_wait`) and then fails
//! with a retryable [`ErrorKind::ConnectionLost`] that names the pool's state — an exhausted
//! pool is an error you can see, not a hang. A pool's own `wait` timeout, if shorter, applies
//! too. A component that must act within a deadline (a keepalive renewing a lease every
//! interval) passes a wait no longer than that deadline.
//!
//! A connection whose statement failed with a lost connection is never pooled again
//! ([`return_or_discard`], and what [`PgTransaction`](crate::PgTransaction) does at its end).
//!
//! [`bounded_pool`] builds a pool whose own `pool.get()` is bounded the same way (wait, create
//! and recycle timeouts on tokio), for application code that checks connections out itself.
//!
//! # Sizing the pool
//!
//! Count what holds a connection at the same time, per process:
//!
//! - every open unit of work ([`PgTransaction`](crate::PgTransaction)), for its whole life —
//!   including one that waits at the server for an advisory lock (waiters queued in process
//!   hold none: only the head of each key's queue waits at the server);
//! - every held session lock (its guard owns a connection) and every session acquire waiting
//!   at the server;
//! - the stream-lease operations and the keepalive: one connection each, for one statement.
//!
//! Size the pool for the peak of the first two plus a few for the third, so that the keepalive
//! always finds a connection within its wait; or give lease operations a pool of their own.
//! The server's `max_connections` bounds the sum over all processes.

use std::time::Duration;

use deadpool_postgres::{Manager, Object, Pool, Runtime, Timeouts};
use lockstep_core::{Error, ErrorKind, Result};

use crate::error::map_pool_error_for;

/// How long a lockstep checkout waits for a free connection unless configured otherwise: 5 s.
pub const DEFAULT_CHECKOUT_WAIT: Duration = Duration::from_secs(5);

/// Checks a connection out of `pool`, waiting at most `wait` for one to come free (the pool's
/// own wait timeout applies too, if shorter). An exhausted pool is
/// [`ErrorKind::ConnectionLost`] (retryable), its message naming the pool's size and waiters.
pub async fn checkout(pool: &Pool, wait: Duration) -> Result<Object> {
    checkout_naming(pool, wait, None).await
}

/// [`checkout`], naming `target` (host, port, database, user) in its errors.
pub(crate) async fn checkout_naming(
    pool: &Pool,
    wait: Duration,
    target: Option<&str>,
) -> Result<Object> {
    match tokio::time::timeout(wait, pool.get()).await {
        Ok(conn) => conn.map_err(|e| map_pool_error_for(e, target)),
        Err(_) => {
            let status = pool.status();
            let in_use = status.size - status.available.min(status.size);
            let to = target.map(|t| format!(" to {t}")).unwrap_or_default();
            // A pool with room opens a new connection for the checkout: then the time went to
            // the server accepting it, not to other borrowers.
            let why = if in_use < status.max_size {
                format!(
                    "opening a new connection took longer ({in_use} of {} in use): the server \
                     is slow to accept connections or unreachable",
                    status.max_size
                )
            } else {
                format!(
                    "pool exhausted: {in_use} of {} in use, {} waiting; see lockstep_pg::pool \
                     for sizing",
                    status.max_size, status.waiting
                )
            };
            Err(Error::new(
                ErrorKind::ConnectionLost,
                format!("no pooled connection{to} within {wait:?}: {why}"),
            ))
        }
    }
}

/// Gives a checked-out connection back after a statement that may have failed: to the pool
/// when it is healthy, **closed** (detached from the pool) when it is closed or the statement
/// failed with a lost connection (`08xxx`, `57P0x`, I/O) — such a connection would fail the
/// next borrower. (deadpool's fast recycling only notices a connection whose closing the
/// driver has already seen; a server that ended the session may not have closed the socket
/// yet.) Returns whether it went back to the pool.
pub fn return_or_discard(conn: Object, error: Option<&tokio_postgres::Error>) -> bool {
    let lost = error.is_some_and(|e| crate::error::kind_of(e) == ErrorKind::ConnectionLost);
    if lost || conn.is_closed() {
        drop(Object::take(conn));
        false
    } else {
        drop(conn);
        true
    }
}

/// A pool of at most `max_size` connections made by `manager`, whose checkouts wait at most
/// [`DEFAULT_CHECKOUT_WAIT`] for a free connection and as long for a new one to be created or
/// a returned one recycled (on the tokio runtime, which the timeouts need).
///
/// ```no_run
/// # fn demo() -> lockstep_core::Result<()> {
/// let config: tokio_postgres::Config = "postgres://app@db/app".parse().expect("url");
/// let manager = deadpool_postgres::Manager::from_config(
///     config,
///     tokio_postgres::NoTls,
///     deadpool_postgres::ManagerConfig::default(),
/// );
/// let pool = lockstep_pg::pool::bounded_pool(manager, 16)?;
/// # let _ = pool; Ok(()) }
/// ```
pub fn bounded_pool(manager: Manager, max_size: usize) -> Result<Pool> {
    bounded_pool_within(manager, max_size, DEFAULT_CHECKOUT_WAIT)
}

/// [`bounded_pool`] whose checkouts wait at most `wait` (for a free connection, a new one, a
/// recycled one).
pub(crate) fn bounded_pool_within(
    manager: Manager,
    max_size: usize,
    wait: Duration,
) -> Result<Pool> {
    Pool::builder(manager)
        .max_size(max_size)
        .runtime(Runtime::Tokio1)
        .timeouts(Timeouts {
            wait: Some(wait),
            create: Some(wait),
            recycle: Some(wait),
        })
        .build()
        .map_err(|e| Error::new(ErrorKind::Backend, "building a bounded pool").with_source(e))
}
