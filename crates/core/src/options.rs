//! [`StreamLockOptions`]: how long a stream lease lasts and how often the keepalive renews it.

use std::time::Duration;

use crate::error::{Error, Result, ValidationError};

/// Timing of stream leases, validated at construction.
///
/// Invariant: both durations are positive and `keepalive_interval < lock_timeout / 2`, so a
/// lease survives one missed renew. A bad pair is a [`ValidationError`], never a silent clamp.
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

    /// Validates a pair of durations.
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
        // Compare 2 * keepalive < timeout, which is exact (no rounding of timeout / 2).
        if keepalive_interval.saturating_mul(2) >= lock_timeout {
            return Err(Error::from(ValidationError::KeepaliveTooLong {
                keepalive: keepalive_interval,
                lock_timeout,
            }));
        }
        // Backends store intervals in microseconds as i64.
        if i64::try_from(lock_timeout.as_micros()).is_err() {
            return Err(Error::from(ValidationError::DurationTooLarge {
                field: "lock timeout",
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
}
