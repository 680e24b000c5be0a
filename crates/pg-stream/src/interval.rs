//! [`PgInterval`]: a [`Duration`] bound as a PostgreSQL `interval` parameter, so the lock
//! timeout is added to `clock_timestamp()` on the server, exactly, to the microsecond.

use std::error::Error as StdError;
use std::time::Duration;

use bytes::BytesMut;
use tokio_postgres::types::{IsNull, ToSql, Type, to_sql_checked};

/// A fixed-length `interval` (microseconds only: no days, no months, so adding it never
/// depends on calendars or time zones).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PgInterval {
    micros: i64,
}

impl PgInterval {
    /// The interval of `duration`, truncated to whole microseconds; `None` if it does not fit
    /// an `i64` of microseconds (`StreamLockOptions` already refuses such timeouts).
    pub fn from_duration(duration: Duration) -> Option<PgInterval> {
        i64::try_from(duration.as_micros())
            .ok()
            .map(|micros| PgInterval { micros })
    }

    /// The length in microseconds.
    pub fn micros(self) -> i64 {
        self.micros
    }
}

impl ToSql for PgInterval {
    fn to_sql(
        &self,
        _ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn StdError + Sync + Send>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_microseconds_then_zero_days_and_months() {
        let interval = PgInterval::from_duration(Duration::from_millis(400)).expect("fits");
        assert_eq!(interval.micros(), 400_000);
        let mut out = BytesMut::new();
        let is_null = interval.to_sql(&Type::INTERVAL, &mut out).expect("encodes");
        assert!(matches!(is_null, IsNull::No));
        assert_eq!(&out[..8], &400_000_i64.to_be_bytes());
        assert_eq!(&out[8..], &[0; 8]);
        assert!(PgInterval::accepts(&Type::INTERVAL));
        assert!(!PgInterval::accepts(&Type::INT8));
    }

    #[test]
    fn refuses_durations_beyond_i64_microseconds() {
        assert_eq!(PgInterval::from_duration(Duration::MAX), None);
    }
}
