//! The driver seam: what lockstep's SQL paths need from a Postgres driver, so that each path —
//! its SQL text, its parameters, how it decodes rows and maps errors — is written once and runs
//! on tokio-postgres or on sqlx (feature `sqlx`).
//!
//! - [`Param`]: a statement parameter with its Postgres type, bound by either driver.
//! - [`Column`]: a value decoded from a result column by either driver.
//! - [`Row`]: a result row of either driver.
//! - [`DbError`]: a driver error reduced to what lockstep decides on (SQLSTATE, constraint,
//!   detail, message, whether the connection is gone); [`crate::error`] maps it to an
//!   [`ErrorKind`](lockstep_core::ErrorKind) once for both drivers.
//! - [`Executor`]: runs one statement with its parameters, taking `&self`, so two statements of
//!   one transaction can be in flight together (tokio-postgres pipelines them; sqlx runs them in
//!   turn).
//! - [`Tp`]: the tokio-postgres executor over any `GenericClient` (a client, a transaction).
//!
//! Semver-exempt like [`crate::internal`]: for lockstep's own backend crates.

use std::fmt;

use std::future::Future;

use futures_util::future::BoxFuture;
use lockstep_core::{Error, Result as LockstepResult, Transaction};
use tokio_postgres::types::{ToSql, Type};

use crate::transaction::PgTransactionRef;

pub mod pool;
mod values;

pub use pool::{Connections, PooledConnection, Sending};
pub use values::{Column, Interval, Param, ReceivedLen, Timestamp};

/// A result row of either driver.
pub enum Row {
    /// A tokio-postgres row.
    TokioPostgres(tokio_postgres::Row),
    /// An sqlx row.
    #[cfg(feature = "sqlx")]
    Sqlx(sqlx::postgres::PgRow),
}

impl fmt::Debug for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Row::TokioPostgres(_) => "Row(tokio-postgres)",
            #[cfg(feature = "sqlx")]
            Row::Sqlx(_) => "Row(sqlx)",
        })
    }
}

impl Row {
    /// Column `idx`, decoded; a column of another type, or out of range, is an error.
    pub fn get<T: Column>(&self, idx: usize) -> Result<T, DbError> {
        match self {
            Row::TokioPostgres(row) => T::from_tokio_postgres(row, idx),
            #[cfg(feature = "sqlx")]
            Row::Sqlx(row) => T::from_sqlx(row, idx),
        }
    }
}

/// A row whose columns can be decoded into [`Column`] values: a [`Row`] of either driver, or
/// a tokio-postgres row (for paths that run on tokio-postgres only), so one decoding function
/// serves both.
pub trait Columns {
    /// Column `idx`, decoded.
    fn column<T: Column>(&self, idx: usize) -> Result<T, DbError>;
}

impl Columns for Row {
    fn column<T: Column>(&self, idx: usize) -> Result<T, DbError> {
        self.get(idx)
    }
}

impl Columns for tokio_postgres::Row {
    fn column<T: Column>(&self, idx: usize) -> Result<T, DbError> {
        T::from_tokio_postgres(self, idx)
    }
}

/// A driver error, reduced to what lockstep decides on. The driver's own error is kept as the
/// source.
pub struct DbError {
    code: Option<String>,
    message: Option<String>,
    detail: Option<String>,
    constraint: Option<String>,
    connection_lost: bool,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl DbError {
    /// The SQLSTATE the server sent, if it sent one.
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }

    /// The server's message, if the server sent the error.
    pub fn message(&self) -> Option<&str> {
        self.message.as_deref()
    }

    /// The server's `DETAIL`, if any.
    pub fn detail(&self) -> Option<&str> {
        self.detail.as_deref()
    }

    /// The constraint the server named, if any.
    pub fn constraint(&self) -> Option<&str> {
        self.constraint.as_deref()
    }

    /// Whether the error came from the server (it has a SQLSTATE).
    pub fn is_server_error(&self) -> bool {
        self.code.is_some()
    }

    /// Whether the connection is gone (closed, an I/O failure): nothing more can be sent on it.
    pub fn is_connection_lost(&self) -> bool {
        self.connection_lost
    }

    /// The driver's error.
    pub fn into_source(self) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self.source
    }

    /// A failure on the client side, before anything reached the server (a parameter that
    /// could not be encoded, a value that could not be decoded).
    pub fn client(source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Self {
        DbError {
            code: None,
            message: None,
            detail: None,
            constraint: None,
            connection_lost: false,
            source: source.into(),
        }
    }

    #[cfg(feature = "sqlx")]
    pub(crate) fn encode(source: Box<dyn std::error::Error + Send + Sync + 'static>) -> Self {
        DbError::client(source)
    }
}

impl fmt::Debug for DbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DbError")
            .field("code", &self.code)
            .field("message", &self.message)
            .field("connection_lost", &self.connection_lost)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for DbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::error::describe_db(self))
    }
}

impl std::error::Error for DbError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

impl From<tokio_postgres::Error> for DbError {
    fn from(err: tokio_postgres::Error) -> Self {
        let db = err.as_db_error();
        DbError {
            code: err.code().map(|c| c.code().to_owned()),
            message: db.map(|d| d.message().to_owned()),
            detail: db.and_then(|d| d.detail()).map(str::to_owned),
            constraint: db.and_then(|d| d.constraint()).map(str::to_owned),
            connection_lost: crate::error::kind_of(&err)
                == lockstep_core::ErrorKind::ConnectionLost
                && err.code().is_none(),
            source: Box::new(err),
        }
    }
}

#[cfg(feature = "sqlx")]
impl From<sqlx::Error> for DbError {
    fn from(err: sqlx::Error) -> Self {
        match &err {
            sqlx::Error::Database(db) => {
                let pg = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>();
                DbError {
                    code: db.code().map(|c| c.into_owned()),
                    message: Some(db.message().to_owned()),
                    detail: pg.and_then(|p| p.detail()).map(str::to_owned),
                    constraint: db.constraint().map(str::to_owned),
                    connection_lost: false,
                    source: Box::new(err),
                }
            }
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed => DbError {
                connection_lost: true,
                ..DbError::client(err)
            },
            _ => DbError::client(err),
        }
    }
}

/// Runs lockstep's statements. Takes `&self`: two statements of one transaction may be in
/// flight at once (tokio-postgres sends the second before the first's reply arrives; the sqlx
/// executor runs them in turn).
pub trait Executor: Send + Sync {
    /// Runs `sql` with `params`: its rows.
    fn query<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
    ) -> BoxFuture<'a, Result<Vec<Row>, DbError>>;

    /// Runs `sql`, one or more statements without parameters, with the simple query protocol
    /// (a migration file, `SAVEPOINT`, DDL): nothing is returned.
    fn batch<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<(), DbError>>;
}

/// Runs `sql` and returns its one row; no row, or more, is an error.
pub async fn query_one<E: Executor + ?Sized>(
    executor: &E,
    sql: &str,
    params: &[&dyn Param],
) -> Result<Row, DbError> {
    let mut rows = executor.query(sql, params).await?;
    match rows.len() {
        1 => Ok(rows.remove(0)),
        n => Err(DbError::client(format!(
            "expected one row, the statement returned {n}"
        ))),
    }
}

/// Runs `sql` and returns its row, if any; more than one is an error.
pub async fn query_opt<E: Executor + ?Sized>(
    executor: &E,
    sql: &str,
    params: &[&dyn Param],
) -> Result<Option<Row>, DbError> {
    let mut rows = executor.query(sql, params).await?;
    match rows.len() {
        0 => Ok(None),
        1 => Ok(Some(rows.remove(0))),
        n => Err(DbError::client(format!(
            "expected at most one row, the statement returned {n}"
        ))),
    }
}

/// The tokio-postgres executor: any `GenericClient` (a `Client`, a `Transaction`, a pooled
/// connection), statements sent with `query_typed` (parse, bind and execute in one message).
pub struct Tp<'c, C: ?Sized>(pub &'c C);

impl<C: tokio_postgres::GenericClient + Sync + ?Sized> Executor for Tp<'_, C> {
    fn query<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
    ) -> BoxFuture<'a, Result<Vec<Row>, DbError>> {
        tokio_postgres_query(self.0, sql, params)
    }

    fn batch<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<(), DbError>> {
        Box::pin(
            async move { Ok(tokio_postgres::GenericClient::batch_execute(self.0, sql).await?) },
        )
    }
}

/// Every transaction lockstep's tokio-postgres statements run on ([`PgTransactionRef`]: the owned
/// [`PgTransaction`](crate::PgTransaction), a borrowed `tokio_postgres::Transaction` or
/// `deadpool_postgres::Transaction`) is an executor of the seam.
impl<T: PgTransactionRef + ?Sized> Executor for T {
    fn query<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
    ) -> BoxFuture<'a, Result<Vec<Row>, DbError>> {
        tokio_postgres_query(self.executor(), sql, params)
    }

    fn batch<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<(), DbError>> {
        Box::pin(async move {
            Ok(tokio_postgres::GenericClient::batch_execute(self.executor(), sql).await?)
        })
    }
}

/// An owned transaction that can run a last statement together with its `COMMIT` and return
/// the statement's rows once committed ([`PgTransaction::commit_returning`](crate::PgTransaction::commit_returning):
/// one round trip on tokio-postgres; on sqlx the statement, then the commit).
///
/// A statement that fails at the server leaves nothing of the transaction committed and
/// returns its error mapped by `map_error` (a lost connection is not passed to it).
pub trait CommitReturning: Executor + Transaction {
    /// Runs `sql` as the transaction's last statement and commits.
    fn commit_returning_rows<'a>(
        self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
        map_error: impl FnOnce(DbError) -> Error + Send + 'a,
    ) -> impl Future<Output = LockstepResult<Vec<Row>>> + Send + 'a;
}

impl CommitReturning for crate::PgTransaction {
    async fn commit_returning_rows<'a>(
        self,
        sql: &'a str,
        params: &'a [&'a dyn Param],
        map_error: impl FnOnce(DbError) -> Error + Send + 'a,
    ) -> LockstepResult<Vec<Row>> {
        let typed: Vec<(&(dyn ToSql + Sync), Type)> =
            params.iter().map(|p| p.tokio_postgres()).collect();
        let rows = crate::PgTransaction::commit_returning(self, sql, &typed, |e| {
            map_error(DbError::from(e))
        })
        .await?;
        Ok(rows.into_iter().map(Row::TokioPostgres).collect())
    }
}

/// Runs `sql` on a tokio-postgres client with `query_typed`. The statement is handed to the
/// connection on the future's first poll, so futures polled in order are pipelined.
pub(crate) fn tokio_postgres_query<'a, C: tokio_postgres::GenericClient + Sync + ?Sized>(
    client: &'a C,
    sql: &'a str,
    params: &'a [&'a dyn Param],
) -> BoxFuture<'a, Result<Vec<Row>, DbError>> {
    Box::pin(async move {
        let typed: Vec<(&(dyn ToSql + Sync), Type)> =
            params.iter().map(|p| p.tokio_postgres()).collect();
        let rows = client.query_typed(sql, &typed).await?;
        Ok(rows.into_iter().map(Row::TokioPostgres).collect())
    })
}
