//! [`PgTransactionSource`]: the unit-of-work contract ([`TransactionSource`]) over a connection
//! pool. Each transaction is an owned READ COMMITTED [`PgTransaction`] on a pooled connection.

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
}

impl std::fmt::Debug for PgTransactionSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The pool's configuration holds the connection string: never print it.
        f.debug_struct("PgTransactionSource")
            .field("pool_status", &self.pool.status())
            .finish()
    }
}

impl PgTransactionSource {
    /// Transactions on connections from `pool`.
    pub fn new(pool: Pool) -> Self {
        PgTransactionSource { pool }
    }

    /// The pool transactions are begun on.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
}

impl TransactionSource for PgTransactionSource {
    type Tx = PgTransaction;

    fn begin(&self) -> impl std::future::Future<Output = Result<PgTransaction>> + Send {
        PgTransaction::begin(&self.pool)
    }

    fn commit(&self, tx: PgTransaction) -> impl std::future::Future<Output = Result<()>> + Send {
        tx.commit()
    }

    fn rollback(&self, tx: PgTransaction) -> impl std::future::Future<Output = Result<()>> + Send {
        tx.rollback()
    }
}
