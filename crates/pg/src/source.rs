//! [`PgTransactionSource`]: the unit-of-work contract ([`TransactionSource`]) over a connection
//! pool. Each transaction is an owned READ COMMITTED [`PgTransaction`] on a pooled connection.

use std::time::Duration;

use deadpool_postgres::Pool;
use lockstep_core::{Result, TransactionSource};

use crate::transaction::PgTransaction;

/// Units of work on PostgreSQL: owned READ COMMITTED transactions on connections from a pool.
///
/// ```no_run
/// # async fn demo(pool: deadpool_postgres::Pool) -> lockstep_core::Result<()> {
/// use lockstep_core::TransactionSource;
/// use lockstep_pg::PgTransactionSource;
///
/// let source = PgTransactionSource::new(pool);
/// let one: i32 = source
///     .transaction(|tx| async move {
///         let row = tx.client().query_one("SELECT 1", &[]).await
///             .map_err(|e| lockstep_pg::map_error(e, "selecting one"))?;
///         row.try_get(0).map_err(|e| lockstep_pg::map_error(e, "reading one"))
///     })
///     .await?;
/// assert_eq!(one, 1);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgTransactionSource {
    pool: Pool,
    checkout_wait: Duration,
}

impl std::fmt::Debug for PgTransactionSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The pool's configuration holds the connection string: never print it.
        f.debug_struct("PgTransactionSource")
            .field("pool_status", &self.pool.status())
            .field("checkout_wait", &self.checkout_wait)
            .finish()
    }
}

impl PgTransactionSource {
    /// Transactions on connections from `pool`, waiting at most
    /// [`DEFAULT_CHECKOUT_WAIT`](crate::DEFAULT_CHECKOUT_WAIT) for a free one.
    pub fn new(pool: Pool) -> Self {
        PgTransactionSource {
            pool,
            checkout_wait: crate::DEFAULT_CHECKOUT_WAIT,
        }
    }

    /// How long `begin` waits for a free connection before failing with a retryable
    /// [`ErrorKind::ConnectionLost`](lockstep_core::ErrorKind::ConnectionLost) (default
    /// [`DEFAULT_CHECKOUT_WAIT`](crate::DEFAULT_CHECKOUT_WAIT); see [`crate::pool`] for sizing).
    #[must_use]
    pub fn with_checkout_wait(mut self, wait: Duration) -> Self {
        self.checkout_wait = wait;
        self
    }

    /// How long `begin` waits for a free connection.
    pub fn checkout_wait(&self) -> Duration {
        self.checkout_wait
    }

    /// The pool transactions are begun on.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
}

impl TransactionSource for PgTransactionSource {
    type Tx = PgTransaction;

    fn begin(&self) -> impl std::future::Future<Output = Result<PgTransaction>> + Send {
        PgTransaction::begin_within(&self.pool, self.checkout_wait)
    }

    fn commit(&self, tx: PgTransaction) -> impl std::future::Future<Output = Result<()>> + Send {
        tx.commit()
    }

    fn rollback(&self, tx: PgTransaction) -> impl std::future::Future<Output = Result<()>> + Send {
        tx.rollback()
    }
}
