//! The values lockstep's statements bind and read, for both drivers: one impl each of [`Param`]
//! and [`Column`]. Every such impl lives here (the sqlx half of each trait exists only with the
//! feature `sqlx`, so an impl elsewhere would break when another crate turns that feature on).

use std::time::Duration;

use bytes::BytesMut;
use serde_json::Value as Json;
use time::OffsetDateTime;
use tokio_postgres::types::{IsNull, ToSql, Type, to_sql_checked};
use uuid::Uuid;

use super::DbError;

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
    Vec<u8> => Type::BYTEA,
    Vec<Uuid> => Type::UUID_ARRAY,
    Vec<String> => Type::TEXT_ARRAY,
    Vec<i32> => Type::INT4_ARRAY,
    Option<Vec<i32>> => Type::INT4_ARRAY,
    Vec<i64> => Type::INT8_ARRAY,
    Vec<Json> => Type::JSONB_ARRAY,
    Option<bool> => Type::BOOL,
    Vec<bool> => Type::BOOL_ARRAY,
    Option<Vec<Uuid>> => Type::UUID_ARRAY,
    Option<Vec<String>> => Type::TEXT_ARRAY,
    Option<Vec<i64>> => Type::INT8_ARRAY,
    Option<f64> => Type::FLOAT8,
    Vec<Option<Uuid>> => Type::UUID_ARRAY,
    Vec<Option<i64>> => Type::INT8_ARRAY,
    Vec<Option<String>> => Type::TEXT_ARRAY,
}

/// Parameters that are bound only: borrowed values, and timestamps (read through [`Timestamp`]).
macro_rules! param_only {
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
    )*};
}

param_only! {
    OffsetDateTime => Type::TIMESTAMPTZ,
    Option<OffsetDateTime> => Type::TIMESTAMPTZ,
    Vec<&str> => Type::TEXT_ARRAY,
    Vec<Option<&Json>> => Type::JSONB_ARRAY,
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

/// The length of a column's value as it arrived, whatever its type, `None` for NULL: for
/// `jsonb`, a version byte and the JSON text — what decoding it holds, where `pg_column_size`
/// on the server counts a large value compressed. Both drivers receive results in binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReceivedLen(pub Option<usize>);

impl<'a> tokio_postgres::types::FromSql<'a> for ReceivedLen {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(ReceivedLen(Some(raw.len())))
    }

    fn from_sql_null(_: &Type) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(ReceivedLen(None))
    }

    fn accepts(_: &Type) -> bool {
        true
    }
}

impl Column for ReceivedLen {
    fn from_tokio_postgres(row: &tokio_postgres::Row, idx: usize) -> Result<Self, DbError> {
        row.try_get(idx).map_err(DbError::from)
    }

    #[cfg(feature = "sqlx")]
    fn from_sqlx(row: &sqlx::postgres::PgRow, idx: usize) -> Result<Self, DbError> {
        use sqlx::{Row as _, ValueRef as _};
        let value = row.try_get_raw(idx).map_err(DbError::from)?;
        if value.is_null() {
            return Ok(ReceivedLen(None));
        }
        let bytes = value.as_bytes().map_err(DbError::client)?;
        Ok(ReceivedLen(Some(bytes.len())))
    }
}

/// A `timestamptz` column read without a panic on a value `time` cannot hold: on sqlx,
/// whose own decoding of `'infinity'` or a time past year 9999 overflows and panics, it is read
/// as the server's microseconds and checked; on tokio-postgres it is an `OffsetDateTime` (whose
/// decoding already fails with an error). Such a value is an error naming the column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timestamp(pub OffsetDateTime);

impl Column for Timestamp {
    fn from_tokio_postgres(row: &tokio_postgres::Row, idx: usize) -> Result<Self, DbError> {
        row.try_get(idx).map(Timestamp).map_err(DbError::from)
    }

    #[cfg(feature = "sqlx")]
    fn from_sqlx(row: &sqlx::postgres::PgRow, idx: usize) -> Result<Self, DbError> {
        Option::<Timestamp>::from_sqlx(row, idx)?
            .ok_or_else(|| DbError::client(format!("column {idx} is NULL")))
    }
}

/// Read as a [`Timestamp`]: never a panic, on either driver.
impl Column for OffsetDateTime {
    fn from_tokio_postgres(row: &tokio_postgres::Row, idx: usize) -> Result<Self, DbError> {
        Timestamp::from_tokio_postgres(row, idx).map(|t| t.0)
    }

    #[cfg(feature = "sqlx")]
    fn from_sqlx(row: &sqlx::postgres::PgRow, idx: usize) -> Result<Self, DbError> {
        Timestamp::from_sqlx(row, idx).map(|t| t.0)
    }
}

/// Read as an optional [`Timestamp`]: never a panic, on either driver.
impl Column for Option<OffsetDateTime> {
    fn from_tokio_postgres(row: &tokio_postgres::Row, idx: usize) -> Result<Self, DbError> {
        Option::<Timestamp>::from_tokio_postgres(row, idx).map(|t| t.map(|t| t.0))
    }

    #[cfg(feature = "sqlx")]
    fn from_sqlx(row: &sqlx::postgres::PgRow, idx: usize) -> Result<Self, DbError> {
        Option::<Timestamp>::from_sqlx(row, idx).map(|t| t.map(|t| t.0))
    }
}

impl Column for Option<Timestamp> {
    fn from_tokio_postgres(row: &tokio_postgres::Row, idx: usize) -> Result<Self, DbError> {
        row.try_get::<_, Option<OffsetDateTime>>(idx)
            .map(|t| t.map(Timestamp))
            .map_err(DbError::from)
    }

    #[cfg(feature = "sqlx")]
    fn from_sqlx(row: &sqlx::postgres::PgRow, idx: usize) -> Result<Self, DbError> {
        use sqlx::{Row as _, TypeInfo as _, ValueRef as _};
        let raw = row.try_get_raw(idx).map_err(DbError::from)?;
        if raw.is_null() {
            return Ok(None);
        }
        let ty = raw.type_info().name().to_owned();
        if ty != "TIMESTAMPTZ" {
            return Err(DbError::client(format!(
                "column {idx} is a {ty}, not a TIMESTAMPTZ"
            )));
        }
        // Binary `timestamptz`: int64 microseconds since 2000-01-01 00:00 UTC.
        let micros: i64 = row.try_get_unchecked(idx).map_err(DbError::from)?;
        const UNIX_MICROS_AT_2000: i128 = 946_684_800_000_000;
        let unix_nanos = (i128::from(micros) + UNIX_MICROS_AT_2000) * 1000;
        OffsetDateTime::from_unix_timestamp_nanos(unix_nanos)
            .map(|t| Some(Timestamp(t)))
            .map_err(|_| {
                DbError::client(format!(
                    "column {idx} holds a time out of the range lockstep reads \
                     ({micros} µs after 2000-01-01, e.g. 'infinity')"
                ))
            })
    }
}

/// A [`Duration`] bound as a PostgreSQL `interval` parameter (microseconds only: no days, no
/// months, so adding it never depends on calendars or time zones), so a timeout is added to
/// `clock_timestamp()` on the server, exactly, to the microsecond.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    micros: i64,
}

impl Interval {
    /// The interval of `duration`, truncated to whole microseconds; `None` if it does not fit
    /// an `i64` of microseconds.
    pub fn from_duration(duration: Duration) -> Option<Interval> {
        i64::try_from(duration.as_micros())
            .ok()
            .map(|micros| Interval { micros })
    }

    /// The length in microseconds.
    pub fn micros(self) -> i64 {
        self.micros
    }
}

impl ToSql for Interval {
    fn to_sql(
        &self,
        _ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        // Binary `interval`: int64 microseconds, int32 days, int32 months (network order).
        out.extend_from_slice(&self.micros.to_be_bytes());
        out.extend_from_slice(&0_i32.to_be_bytes());
        out.extend_from_slice(&0_i32.to_be_bytes());
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::INTERVAL
    }

    to_sql_checked!();
}

impl Param for Interval {
    fn tokio_postgres(&self) -> (&(dyn ToSql + Sync), Type) {
        (self, Type::INTERVAL)
    }

    #[cfg(feature = "sqlx")]
    fn bind_sqlx(&self, args: &mut sqlx::postgres::PgArguments) -> Result<(), DbError> {
        let interval = sqlx::postgres::types::PgInterval {
            months: 0,
            days: 0,
            microseconds: self.micros,
        };
        sqlx::Arguments::add(args, interval).map_err(DbError::encode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_encode_microseconds_then_zero_days_and_months() {
        let interval = Interval::from_duration(Duration::from_millis(400)).expect("fits");
        assert_eq!(interval.micros(), 400_000);
        let mut out = BytesMut::new();
        let is_null = interval.to_sql(&Type::INTERVAL, &mut out).expect("encodes");
        assert!(matches!(is_null, IsNull::No));
        assert_eq!(&out[..8], &400_000_i64.to_be_bytes());
        assert_eq!(&out[8..], &[0; 8]);
        assert!(Interval::from_duration(Duration::MAX).is_none());
    }
}
