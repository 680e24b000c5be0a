//! [`StreamLockOptions`]: how long a stream lease lasts and how often the keepalive renews it.

use std::time::Duration;

use crate::error::{Error, Result, ValidationError};

/// Timing of stream leases, validated at construction.
///
/// Invariant: both durations are at least [`MIN_DURATION`](Self::MIN_DURATION) (1 ms), the lock
/// timeout is at most [`MAX_LOCK_TIMEOUT`](Self::MAX_LOCK_TIMEOUT) (100 years, so every expiry
/// is a timestamp the storage can write and read back), and `keepalive_interval < lock_timeout
/// / 2`, so a lease survives one missed renew. A bad pair is an error carrying a
/// [`ValidationError`], never a silent clamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLockOptions {
    lock_timeout: Duration,
    keepalive_interval: Duration,
}

impl StreamLockOptions {
    /// Default lock timeout: 30 s.
    pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(30);
    /// Default keepalive interval: 10 s.
    pub const DEFAULT_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

    /// The shortest lock timeout or keepalive interval accepted: 1 ms. Backends keep
    /// microseconds at best, so a shorter duration could not be stored as given.
    pub const MIN_DURATION: Duration = Duration::from_millis(1);
    /// The longest lock timeout accepted: 100 years (36 525 days). An expiry must stay a
    /// timestamp every backend can write and read back (drivers read up to year 9999).
    pub const MAX_LOCK_TIMEOUT: Duration = Duration::from_secs(36_525 * 24 * 60 * 60);

    /// Validates a pair of durations: both at least [`MIN_DURATION`](Self::MIN_DURATION), the
    /// lock timeout at most [`MAX_LOCK_TIMEOUT`](Self::MAX_LOCK_TIMEOUT), and
    /// `keepalive_interval < lock_timeout / 2`. A bad pair is an
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) error whose
    /// [`validation()`](Error::validation) says which bound, never a silent clamp.
    pub fn new(lock_timeout: Duration, keepalive_interval: Duration) -> Result<StreamLockOptions> {
        if lock_timeout.is_zero() {
            return Err(Error::from(ValidationError::NonPositiveDuration {
                field: "lock timeout",
            }));
        }
        if keepalive_interval.is_zero() {
            return Err(Error::from(ValidationError::NonPositiveDuration {
                field: "keepalive interval",
            }));
        }
        // Backends keep microseconds at best: a shorter duration would be truncated (to zero
        // below 1 µs) and every acquire would take the lease over at once. A lease shorter than
        // a millisecond cannot outlive one round trip anyway.
        for (field, value) in [
            ("lock timeout", lock_timeout),
            ("keepalive interval", keepalive_interval),
        ] {
            if value < Self::MIN_DURATION {
                return Err(Error::from(ValidationError::DurationTooShort {
                    field,
                    min: Self::MIN_DURATION,
                }));
            }
        }
        // Postgres stores an expiry as a timestamp up to year 294276 but the drivers read back
        // only up to year 9999: bound the timeout well inside what every backend can write and
        // read back (clock + timeout), and inside i64 microseconds.
        if lock_timeout > Self::MAX_LOCK_TIMEOUT {
            return Err(Error::from(ValidationError::DurationTooLong {
                field: "lock timeout",
                max: Self::MAX_LOCK_TIMEOUT,
            }));
        }
        // Compare 2 * keepalive < timeout, which is exact (no rounding of timeout / 2).
        if keepalive_interval.saturating_mul(2) >= lock_timeout {
            return Err(Error::from(ValidationError::KeepaliveTooLong {
                keepalive: keepalive_interval,
                lock_timeout,
            }));
        }
        Ok(StreamLockOptions {
            lock_timeout,
            keepalive_interval,
        })
    }

    /// How long a lease is valid after each acquire or renew (default 30 s).
    pub fn lock_timeout(&self) -> Duration {
        self.lock_timeout
    }

    /// How often a keepalive renews a held lease (default 10 s).
    pub fn keepalive_interval(&self) -> Duration {
        self.keepalive_interval
    }
}

impl Default for StreamLockOptions {
    fn default() -> Self {
        StreamLockOptions {
            lock_timeout: Self::DEFAULT_LOCK_TIMEOUT,
            keepalive_interval: Self::DEFAULT_KEEPALIVE_INTERVAL,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::typed;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn defaults_are_thirty_and_ten_seconds_and_valid() {
        let d = StreamLockOptions::default();
        assert_eq!((d.lock_timeout(), d.keepalive_interval()), (S(30), S(10)));
        assert_eq!(typed(StreamLockOptions::new(S(30), S(10))), Ok(d));
    }

    #[test]
    fn zero_durations_are_refused() {
        assert!(matches!(
            typed(StreamLockOptions::new(Duration::ZERO, S(1))),
            Err(ValidationError::NonPositiveDuration { .. })
        ));
        assert!(matches!(
            typed(StreamLockOptions::new(S(30), Duration::ZERO)),
            Err(ValidationError::NonPositiveDuration { .. })
        ));
    }

    #[test]
    fn keepalive_must_be_strictly_below_half_the_timeout() {
        assert!(matches!(
            typed(StreamLockOptions::new(S(30), S(15))),
            Err(ValidationError::KeepaliveTooLong { .. })
        ));
        assert!(matches!(
            typed(StreamLockOptions::new(S(30), S(20))),
            Err(ValidationError::KeepaliveTooLong { .. })
        ));
        assert!(StreamLockOptions::new(S(30), Duration::from_millis(14_999)).is_ok());
    }

    #[test]
    fn sub_millisecond_durations_are_refused_not_truncated() {
        let ns = Duration::from_nanos;
        assert!(matches!(
            typed(StreamLockOptions::new(ns(999), ns(1))),
            Err(ValidationError::DurationTooShort { .. })
        ));
        assert!(matches!(
            typed(StreamLockOptions::new(S(1), Duration::from_micros(999))),
            Err(ValidationError::DurationTooShort {
                field: "keepalive interval",
                ..
            })
        ));
        assert!(StreamLockOptions::new(Duration::from_millis(3), Duration::from_millis(1)).is_ok());
    }

    #[test]
    fn lock_timeouts_beyond_a_hundred_years_are_refused() {
        const YEAR: Duration = Duration::from_secs(365 * 24 * 60 * 60);
        for (timeout, keepalive) in [
            (YEAR * 9000, YEAR),
            (Duration::from_micros(i64::MAX as u64), S(1)),
            (Duration::MAX, S(1)),
        ] {
            assert!(matches!(
                typed(StreamLockOptions::new(timeout, keepalive)),
                Err(ValidationError::DurationTooLong { .. })
            ));
        }
        let max = StreamLockOptions::MAX_LOCK_TIMEOUT;
        assert!(StreamLockOptions::new(max, S(60)).is_ok());
        assert!(StreamLockOptions::new(max + Duration::from_micros(1), S(60)).is_err());
    }
}
