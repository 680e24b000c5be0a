//! The transactions [`PgPerspectiveStore`](super::PgPerspectiveStore) runs on
//! ([`PerspectiveTransaction`]): every statement goes through the driver seam
//! (`lockstep_pg::driver::Executor`); the three things a driver does its own way are here, once per driver.

use std::future::Future;

use futures_util::stream::{self, BoxStream, StreamExt as _, TryStreamExt as _};
use lockstep_core::{Error, ErrorKind, Result, Transaction};
use lockstep_pg::PgTransactionRef;
use lockstep_pg::driver::{CommitReturning, DbError, Executor, Param, Row};
use lockstep_pg::internal::db_kind_of;

mod sealed {
    pub trait Sealed {}
}

/// A transaction the perspective store runs on: the owned [`lockstep_pg::PgTransaction`], a
/// borrowed `tokio_postgres::Transaction` or `deadpool_postgres::Transaction` the application
/// manages itself, and with feature `sqlx` the owned `lockstep_pg::sqlx::SqlxTransaction`.
/// Sealed: the store's statements, decoding and error mapping are written once over the
/// seam's `lockstep_pg::driver::Executor`; the methods here are what each driver does its own way.
pub trait PerspectiveTransaction: Executor + sealed::Sealed {
    /// Runs `sql`: its rows as they arrive. tokio-postgres streams them (`query_typed_raw`: a
    /// reader that stops early leaves the rest to the connection, which discards them); sqlx
    /// reads them all first (its statement holds the transaction's connection until done).
    #[doc(hidden)]
    fn query_rows<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
    ) -> BoxStream<'a, std::result::Result<Row, DbError>>;

    /// Checks that this build runs on the database's schema
    /// ([`lockstep_pg::migrate::check_schema_on`]), before the first registration.
    #[doc(hidden)]
    fn check_schema(&self) -> impl Future<Output = Result<()>> + Send;

    /// Runs `sql` as the transaction's last statement and commits ([`CommitReturning`]): one
    /// round trip on [`lockstep_pg::PgTransaction`], the statement then the `COMMIT` on sqlx.
    #[doc(hidden)]
    fn commit_last<'a>(
        self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
        map_error: impl FnOnce(DbError) -> Error + Send + 'a,
    ) -> impl Future<Output = Result<Vec<Row>>> + Send + 'a
    where
        Self: Transaction;
}

/// Runs `sql` with `query_typed_raw`, its rows streamed.
fn streamed<'a, C: tokio_postgres::GenericClient + Sync>(
    client: &'a C,
    sql: &'a str,
    params: &'a [&'a dyn Param],
) -> BoxStream<'a, std::result::Result<Row, DbError>> {
    stream::once(async move {
        client
            .query_typed_raw(sql, params.iter().map(|p| p.tokio_postgres()))
            .await
    })
    .map_err(DbError::from)
    .map_ok(|rows| rows.map_ok(Row::TokioPostgres).map_err(DbError::from))
    .try_flatten()
    .boxed()
}

async fn check_schema_on<T: PgTransactionRef + ?Sized>(tx: &T) -> Result<()> {
    lockstep_pg::internal::check_schema_with(tx).await.map(drop)
}

/// The statement, then the `COMMIT`: for a transaction that is not an owned one (it never
/// commits through the store).
async fn statement_then_commit<'a, T: Executor + Transaction>(
    tx: T,
    sql: &'a str,
    params: &'a [&'a dyn Param],
    map_error: impl FnOnce(DbError) -> Error + Send + 'a,
) -> Result<Vec<Row>> {
    let rows = match tx.query(sql, params).await {
        Ok(rows) => rows,
        Err(e) => {
            let err = if db_kind_of(&e) == ErrorKind::ConnectionLost {
                lockstep_pg::internal::db_statement_error(
                    e,
                    "running a transaction's last statement",
                )
            } else {
                map_error(e)
            };
            drop(tx);
            return Err(err);
        }
    };
    tx.commit().await?;
    Ok(rows)
}

macro_rules! borrowed_tokio_postgres {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}

        impl PerspectiveTransaction for $t {
            fn query_rows<'a>(
                &'a self,
                sql: &'a str,
                params: &'a [&'a dyn Param],
            ) -> BoxStream<'a, std::result::Result<Row, DbError>> {
                streamed(self.executor(), sql, params)
            }

            async fn check_schema(&self) -> Result<()> {
                check_schema_on(self).await
            }

            fn commit_last<'a>(
                self,
                sql: &'a str,
                params: &'a [&'a dyn Param],
                map_error: impl FnOnce(DbError) -> Error + Send + 'a,
            ) -> impl Future<Output = Result<Vec<Row>>> + Send + 'a
            where
                Self: Transaction,
            {
                statement_then_commit(self, sql, params, map_error)
            }
        }
    )*};
}

borrowed_tokio_postgres!(
    tokio_postgres::Transaction<'_>,
    lockstep_pg::deadpool_postgres::Transaction<'_>
);

impl sealed::Sealed for lockstep_pg::PgTransaction {}

impl PerspectiveTransaction for lockstep_pg::PgTransaction {
    fn query_rows<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
    ) -> BoxStream<'a, std::result::Result<Row, DbError>> {
        streamed(self.client(), sql, params)
    }

    async fn check_schema(&self) -> Result<()> {
        check_schema_on(self).await
    }

    fn commit_last<'a>(
        self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
        map_error: impl FnOnce(DbError) -> Error + Send + 'a,
    ) -> impl Future<Output = Result<Vec<Row>>> + Send + 'a
    where
        Self: Transaction,
    {
        self.commit_returning_rows(sql, params, map_error)
    }
}

#[cfg(feature = "sqlx")]
impl sealed::Sealed for lockstep_pg::sqlx::SqlxTransaction {}

/// On sqlx: a rewind's rows are read in full before they are decoded (a page's rows, at most
/// one event more than the page holds); the state change and the `COMMIT` are two round trips.
#[cfg(feature = "sqlx")]
impl PerspectiveTransaction for lockstep_pg::sqlx::SqlxTransaction {
    fn query_rows<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
    ) -> BoxStream<'a, std::result::Result<Row, DbError>> {
        stream::once(self.query(sql, params))
            .map_ok(|rows| stream::iter(rows.into_iter().map(Ok)))
            .try_flatten()
            .boxed()
    }

    async fn check_schema(&self) -> Result<()> {
        lockstep_pg::internal::check_schema_with(self)
            .await
            .map(drop)
    }

    fn commit_last<'a>(
        self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
        map_error: impl FnOnce(DbError) -> Error + Send + 'a,
    ) -> impl Future<Output = Result<Vec<Row>>> + Send + 'a
    where
        Self: Transaction,
    {
        self.commit_returning_rows(sql, params, map_error)
    }
}
