//! Transactions as the Postgres backends see them.
//!
//! [`PgTransaction`] owns its pooled connection, so it is `'static` and a handler holding it can
//! be spawned. It runs at READ COMMITTED (lock-then-load needs each statement to see the latest
//! committed data). Dropping it without commit or rollback discards the connection instead of
//! returning it to the pool mid-transaction; the server rolls the transaction back and releases
//! its locks. It is the transaction the contracts that **wait for a lock** are implemented for
//! (`DistributedLock`, `EventStore` with its `load_locked`): a wait that is abandoned is ended
//! with a cancel request, which can arrive late — after the statement ended — and so must not
//! find the connection serving anyone else. A [`PgTransaction`] then closes its connection when
//! it ends instead of pooling it. A borrowed transaction cannot promise that (its connection
//! goes back to whoever lent it), so the waiting contracts are not implemented for one: it
//! does not compile, rather than relying on every caller to discard the connection by hand.
//!
//! [`PgTransactionRef`] is the view that statements which never wait for a lock take (event
//! store load and append, the lease fence), so they also run on a transaction the application
//! manages itself: a borrowed `tokio_postgres::Transaction` or `deadpool_postgres::Transaction`.

use std::sync::atomic::{AtomicBool, Ordering};

use deadpool_postgres::{Object, Pool};
use lockstep_core::{Error, ErrorKind, Result};
use tokio_postgres::{Client, GenericClient};

use crate::error::map_error;

/// A transaction that statements which never wait for a lock can run on: the owned
/// [`PgTransaction`], or one the application manages itself — `&tokio_postgres::Transaction`
/// or `&deadpool_postgres::Transaction`.
///
/// The contracts that wait for a lock (`DistributedLock`, `EventStore::load_locked`) take a
/// [`PgTransaction`] only (see the [module docs](self)).
pub trait PgTransactionRef: Send + Sync {
    /// The statement executor (the transaction itself, or the connection it runs on).
    type Executor: GenericClient + Sync;

    /// Where to send statements that belong to this transaction.
    fn executor(&self) -> &Self::Executor;
}

impl PgTransactionRef for tokio_postgres::Transaction<'_> {
    type Executor = Self;

    fn executor(&self) -> &Self {
        self
    }
}

impl<'a> PgTransactionRef for deadpool_postgres::Transaction<'a> {
    type Executor = tokio_postgres::Transaction<'a>;

    fn executor(&self) -> &tokio_postgres::Transaction<'a> {
        self
    }
}

/// An owned READ COMMITTED transaction on a pooled connection.
pub struct PgTransaction {
    // `None` once committed or rolled back.
    conn: Option<Object>,
    // Set when a cancel request may still arrive for this connection: close it at the end.
    discard: AtomicBool,
}

impl std::fmt::Debug for PgTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTransaction")
            .field("open", &self.conn.is_some())
            .finish()
    }
}

impl PgTransaction {
    /// Checks a connection out of `pool` (waiting at most
    /// [`DEFAULT_CHECKOUT_WAIT`](crate::DEFAULT_CHECKOUT_WAIT) for one) and begins a READ
    /// COMMITTED transaction on it.
    pub async fn begin(pool: &Pool) -> Result<PgTransaction> {
        PgTransaction::begin_within(pool, crate::DEFAULT_CHECKOUT_WAIT).await
    }

    /// Like [`PgTransaction::begin`], waiting at most `wait` for a connection (an exhausted
    /// pool is a retryable [`ErrorKind::ConnectionLost`]; see [`crate::pool`]).
    pub async fn begin_within(pool: &Pool, wait: std::time::Duration) -> Result<PgTransaction> {
        let conn = crate::pool::checkout(pool, wait).await?;
        PgTransaction::begin_on(conn).await
    }

    /// Begins a READ COMMITTED transaction on a connection already checked out.
    pub async fn begin_on(conn: Object) -> Result<PgTransaction> {
        if let Err(e) = conn
            .batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
        {
            // Whatever went wrong, the connection's state is unknown: never pool it (a lost
            // connection would fail the next borrower).
            let _ = Object::take(conn);
            return Err(map_error(e, "beginning a transaction"));
        }
        Ok(PgTransaction {
            conn: Some(conn),
            discard: AtomicBool::new(false),
        })
    }

    /// The connection the transaction runs on.
    pub fn client(&self) -> &Client {
        // Invariant: `conn` is `Some` for as long as `self` is reachable (commit and rollback
        // take `self` by value).
        match &self.conn {
            Some(conn) => conn,
            None => unreachable!("PgTransaction used after it ended"),
        }
    }

    /// Commits. Transaction-scoped locks are released by the server. A transaction that had
    /// failed is rolled back by the server instead, reported as
    /// [`ErrorKind::TransactionAborted`].
    ///
    /// If the connection is lost while the `COMMIT` is in flight, nobody can say whether the
    /// server committed (it may have, and only the reply was lost): that is
    /// [`ErrorKind::CommitUnknown`], which is **not** retryable — running the unit of work again
    /// could apply it twice. Check what was written (event-store appends are idempotent by
    /// event id, so re-appending the same events is safe). A connection already known to be
    /// lost before the `COMMIT` was sent is [`ErrorKind::ConnectionLost`] (retryable: the
    /// server rolled the transaction back).
    pub async fn commit(mut self) -> Result<()> {
        let Some(conn) = self.conn.take() else {
            return Ok(());
        };
        if conn.is_closed() {
            // Nothing was sent: the server ended the transaction with the connection.
            let _ = Object::take(conn);
            return Err(Error::new(
                ErrorKind::ConnectionLost,
                "committing: the connection was lost before COMMIT was sent; the transaction \
                 was rolled back by the server",
            ));
        }
        // COMMIT of a failed transaction "succeeds" (the server answers ROLLBACK), so probe
        // first in the same round trip: in a failed transaction `SELECT 1` errors with 25P02
        // and the rest of the batch, COMMIT included, is skipped.
        match conn.batch_execute("SELECT 1; COMMIT").await {
            Ok(()) => {
                self.release(conn);
                Ok(())
            }
            Err(e) => {
                let kind = crate::error::kind_of(&e);
                if kind == ErrorKind::ConnectionLost {
                    // The COMMIT went out (or may have) and no answer came back.
                    let _ = Object::take(conn);
                    return Err(Error::new(
                        ErrorKind::CommitUnknown,
                        "the connection was lost while COMMIT was in flight: the transaction \
                         may or may not have committed",
                    )
                    .with_source(e));
                }
                // Never pool a connection still inside a transaction.
                if conn.batch_execute("ROLLBACK").await.is_err() {
                    let _ = Object::take(conn);
                } else {
                    self.release(conn);
                }
                if kind == ErrorKind::TransactionAborted {
                    Err(Error::new(
                        ErrorKind::TransactionAborted,
                        "the transaction had failed and was rolled back instead of committed",
                    )
                    .with_source(e))
                } else {
                    Err(map_error(e, "committing"))
                }
            }
        }
    }

    /// Rolls back. Transaction-scoped locks are released by the server. A connection that
    /// fails here is closed, never pooled.
    pub async fn rollback(mut self) -> Result<()> {
        let Some(conn) = self.conn.take() else {
            return Ok(());
        };
        if conn.is_closed() {
            // The server rolled back when the connection went: nothing left to do.
            let _ = Object::take(conn);
            return Err(Error::new(
                ErrorKind::ConnectionLost,
                "rolling back: the connection was lost (the server rolled the transaction back)",
            ));
        }
        if let Err(e) = conn.batch_execute("ROLLBACK").await {
            let _ = Object::take(conn);
            return Err(map_error(e, "rolling back"));
        }
        self.release(conn);
        Ok(())
    }

    /// Returns the connection to the pool, or closes it if a late cancel request may hit it
    /// (or it is already closed).
    fn release(&self, conn: Object) {
        if self.discard.load(Ordering::Acquire) || conn.is_closed() {
            let _ = Object::take(conn);
        }
    }
}

impl Drop for PgTransaction {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Never hand a connection back to the pool inside an open transaction (it may hold
            // locks or be waiting for one): detach it, closing it; the server rolls back.
            let _ = Object::take(conn);
        }
    }
}

impl PgTransaction {
    /// Called when a lock wait on this transaction was abandoned and a cancel request for its
    /// connection may still be in flight: the connection is closed when the transaction ends
    /// instead of being returned to the pool.
    pub(crate) fn discard_connection_after_end(&self) {
        self.discard.store(true, Ordering::Release);
    }
}

impl PgTransactionRef for PgTransaction {
    type Executor = Client;

    fn executor(&self) -> &Client {
        self.client()
    }
}
