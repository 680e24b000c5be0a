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

use futures_util::future::BoxFuture;
use serde_json::Value as Json;
use time::OffsetDateTime;
use tokio_postgres::types::{ToSql, Type};
use uuid::Uuid;

/// A statement parameter that both drivers can bind, with its Postgres type (tokio-postgres
/// sends the type with the statement — `query_typed`, one round trip; sqlx binds by type).
pub trait Param: Sync + Send {
    /// The value as tokio-postgres binds it, with its type.
    fn tokio_postgres(&self) -> (&(dyn ToSql + Sync), Type);

    /// Binds the value to an sqlx query.
    #[cfg(feature = "sqlx")]
    fn bind_sqlx(&self, args: &mut sqlx::postgres::PgArguments) -> Result<(), DbError>;
}

/// A value decoded from a result column by either driver.
pub trait Column: Sized {
    /// Decodes column `idx` of a tokio-postgres row.
    fn from_tokio_postgres(row: &tokio_postgres::Row, idx: usize) -> Result<Self, DbError>;

    /// Decodes column `idx` of an sqlx row.
    #[cfg(feature = "sqlx")]
    fn from_sqlx(row: &sqlx::postgres::PgRow, idx: usize) -> Result<Self, DbError>;
}

macro_rules! param_and_column {
    ($($t:ty => $pg:expr),* $(,)?) => {$(
        impl Param for $t {
            fn tokio_postgres(&self) -> (&(dyn ToSql + Sync), Type) {
                (self, $pg)
            }

            #[cfg(feature = "sqlx")]
            fn bind_sqlx(&self, args: &mut sqlx::postgres::PgArguments) -> Result<(), DbError> {
                sqlx::Arguments::add(args, self).map_err(DbError::encode)
            }
        }

        impl Column for $t {
            fn from_tokio_postgres(row: &tokio_postgres::Row, idx: usize) -> Result<Self, DbError> {
                row.try_get(idx).map_err(DbError::from)
            }

            #[cfg(feature = "sqlx")]
            fn from_sqlx(row: &sqlx::postgres::PgRow, idx: usize) -> Result<Self, DbError> {
                sqlx::Row::try_get(row, idx).map_err(DbError::from)
            }
        }
    )*};
}

param_and_column! {
    bool => Type::BOOL,
    i32 => Type::INT4,
    Option<i32> => Type::INT4,
    i64 => Type::INT8,
    Option<i64> => Type::INT8,
    f64 => Type::FLOAT8,
    String => Type::TEXT,
    Option<String> => Type::TEXT,
    Uuid => Type::UUID,
    Option<Uuid> => Type::UUID,
    Json => Type::JSONB,
    Option<Json> => Type::JSONB,
    OffsetDateTime => Type::TIMESTAMPTZ,
    Option<OffsetDateTime> => Type::TIMESTAMPTZ,
    Vec<u8> => Type::BYTEA,
    Vec<Uuid> => Type::UUID_ARRAY,
    Vec<String> => Type::TEXT_ARRAY,
    Vec<i32> => Type::INT4_ARRAY,
    Option<Vec<i32>> => Type::INT4_ARRAY,
    Vec<i64> => Type::INT8_ARRAY,
    Vec<Json> => Type::JSONB_ARRAY,
}

impl Param for &str {
    fn tokio_postgres(&self) -> (&(dyn ToSql + Sync), Type) {
        (self, Type::TEXT)
    }

    #[cfg(feature = "sqlx")]
    fn bind_sqlx(&self, args: &mut sqlx::postgres::PgArguments) -> Result<(), DbError> {
        sqlx::Arguments::add(args, *self).map_err(DbError::encode)
    }
}

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
    fn encode(source: Box<dyn std::error::Error + Send + Sync + 'static>) -> Self {
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
