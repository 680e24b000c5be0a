//! A bounded retry loop for the optimistic default: run a unit of work again when it failed
//! with a retryable error ([`crate::Error::is_retryable`]: a conflict, a deadlock, a lock
//! timeout, a lost connection), with exponential backoff and full jitter, up to an attempt cap.
//!
//! Runtime-free: the caller passes the sleep function (`tokio::time::sleep` in a tokio
//! application, so tests can run with paused time). Each attempt must be a whole unit of work —
//! begin a new transaction, load, decide, append, commit — because a failed statement aborts
//! its transaction.
//!
//! Backoff before retry `n` (1-based) is uniform in `[0, min(max_backoff, initial_backoff ·
//! 2^(n-1))]` ("full jitter"): losers of one conflict spread out instead of colliding again in
//! lockstep. The jitter's randomness comes from the standard library's per-process random
//! hasher keys (no RNG dependency; it only has to decorrelate writers, not be unpredictable).
//!
//! ```
//! # async fn demo() -> lockstep_core::Result<()> {
//! use lockstep_core::retry::RetryPolicy;
//! use lockstep_core::{Error, ErrorKind};
//!
//! let policy = RetryPolicy::default();
//! let mut failures = 2;
//! let value = policy
//!     .run(
//!         |_delay| async {}, // in a tokio application: tokio::time::sleep
//!         |_attempt| {
//!             let fail = failures > 0;
//!             failures -= 1;
//!             Box::pin(async move {
//!                 if fail {
//!                     Err(Error::new(ErrorKind::Conflict, "lost the race"))
//!                 } else {
//!                     Ok(42)
//!                 }
//!             })
//!         },
//!     )
//!     .await?;
//! assert_eq!(value, 42);
//! # Ok(()) }
//! ```

use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::num::NonZeroU32;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::future::BoxFuture;

/// Whether an error is worth running the whole unit of work again.
///
/// Implemented by [`Error`] ([`Error::is_retryable`]); implement it for an application error
/// type that wraps [`Error`] to use it with [`RetryPolicy::run`] and
/// [`TransactionSource::transaction_with_retry`](crate::TransactionSource::transaction_with_retry).
pub trait Retryable {
    /// Whether a new attempt, in a new transaction, may succeed.
    fn is_retryable(&self) -> bool;
}

impl Retryable for Error {
    fn is_retryable(&self) -> bool {
        Error::is_retryable(self)
    }
}

/// How often and how patiently to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: NonZeroU32,
    initial_backoff: Duration,
    max_backoff: Duration,
}

impl Default for RetryPolicy {
    /// 10 attempts, backoff ceiling from 5 ms doubling up to 200 ms.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: NonZeroU32::new(10).unwrap_or(NonZeroU32::MIN),
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(200),
        }
    }
}

impl RetryPolicy {
    /// At most `max_attempts` attempts (the first one included). The backoff ceiling starts at
    /// `initial_backoff` and doubles per retry up to `max_backoff` (a `max_backoff` below
    /// `initial_backoff` caps every ceiling at `max_backoff`; zero durations retry at once).
    pub fn new(max_attempts: NonZeroU32, initial_backoff: Duration, max_backoff: Duration) -> Self {
        RetryPolicy {
            max_attempts,
            initial_backoff,
            max_backoff,
        }
    }

    /// At most this many attempts.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts.get()
    }

    /// The backoff ceiling before retry `retry` (1 = the first retry).
    pub fn ceiling(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1).min(31);
        self.initial_backoff
            .checked_mul(1u32 << doublings)
            .unwrap_or(self.max_backoff)
            .min(self.max_backoff)
    }

    /// The backoff before retry `retry` for a uniform `unit` in `[0, 1)`: `unit × ceiling`.
    /// A `unit` outside `[0, 1]` is clamped, and one that is not a number counts as 0; the
    /// result never exceeds the ceiling (no panic for any input, `Duration::MAX` included).
    pub fn backoff(&self, retry: u32, unit: f64) -> Duration {
        let ceiling = self.ceiling(retry);
        let unit = if unit.is_nan() {
            0.0
        } else {
            unit.clamp(0.0, 1.0)
        };
        // `mul_f64` panics when the product does not fit (float rounding near Duration::MAX).
        Duration::try_from_secs_f64(ceiling.as_secs_f64() * unit)
            .map_or(ceiling, |d| d.min(ceiling))
    }

    /// Whether attempt `attempt` (1-based), which failed with `err`, should be followed by
    /// another: `Some(backoff)` to wait before it (jittered, see [`RetryPolicy::backoff`]), or
    /// `None` when `err` is not retryable or the attempts are used up. The decision of
    /// [`RetryPolicy::run`], for loops of one's own.
    pub fn retry_after<E: Retryable + ?Sized>(&self, attempt: u32, err: &E) -> Option<Duration> {
        (err.is_retryable() && attempt < self.max_attempts.get())
            .then(|| self.backoff(attempt, random_unit()))
    }

    /// Runs `attempt(n)` (n = 1, 2, …) until it succeeds, fails with an error that is not
    /// [retryable](Retryable), or `max_attempts` attempts have failed; sleeps with
    /// `sleep(backoff)` between attempts. Returns the first success or the last error,
    /// unchanged.
    ///
    /// For a unit of work on a database, prefer
    /// [`TransactionSource::transaction_with_retry`](crate::TransactionSource::transaction_with_retry),
    /// which begins and ends the transaction of every attempt.
    ///
    /// `attempt` returns a [`BoxFuture`] (`Box::pin(async move { … })`) and so does `run`, so a
    /// caller spawned with concrete types compiles (see [`crate::unit_of_work`]).
    pub fn run<'a, T, E, A, S, SFut>(
        &self,
        mut sleep: S,
        mut attempt: A,
    ) -> BoxFuture<'a, Result<T, E>>
    where
        T: Send + 'a,
        E: Retryable + Send + 'a,
        A: FnMut(u32) -> BoxFuture<'a, Result<T, E>> + Send + 'a,
        S: FnMut(Duration) -> SFut + Send + 'a,
        SFut: Future<Output = ()> + Send,
    {
        let policy = *self;
        Box::pin(async move {
            let mut n = 1;
            loop {
                match attempt(n).await {
                    Ok(value) => return Ok(value),
                    Err(err) => match policy.retry_after(n, &err) {
                        Some(delay) => {
                            if !delay.is_zero() {
                                sleep(delay).await;
                            }
                            n += 1;
                        }
                        None => return Err(err),
                    },
                }
            }
        })
    }
}

/// `tokio::time::sleep`, as the `sleep` argument of [`RetryPolicy::run`] and
/// [`TransactionSource::transaction_with_retry`](crate::TransactionSource::transaction_with_retry)
/// (feature `tokio`; tokio's clock, so tests can run with paused time).
#[cfg(feature = "tokio")]
pub fn tokio_sleep(delay: Duration) -> tokio::time::Sleep {
    tokio::time::sleep(delay)
}

/// A uniform sample in `[0, 1)` from the standard library's randomly keyed hasher.
fn random_unit() -> f64 {
    // Each RandomState gets fresh keys (random per thread, then incremented), so hashing a
    // constant yields a new, well-mixed value per call.
    let bits = RandomState::new().hash_one(0x9e37_79b9_7f4a_7c15_u64);
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::error::ErrorKind;

    fn policy(attempts: u32) -> RetryPolicy {
        RetryPolicy::new(
            NonZeroU32::new(attempts).expect("non-zero"),
            Duration::from_millis(10),
            Duration::from_millis(80),
        )
    }

    fn block_on<F: Future>(fut: F) -> F::Output {
        // The futures here never pend (the sleep is a no-op), so one poll finishes them.
        let mut fut = std::pin::pin!(fut);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match fut.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(out) => out,
            std::task::Poll::Pending => unreachable!("test futures never pend"),
        }
    }

    #[test]
    fn ceilings_double_up_to_the_cap_and_jitter_stays_below() {
        let p = policy(5);
        let ceilings: Vec<_> = (1..=5).map(|n| p.ceiling(n).as_millis()).collect();
        assert_eq!(ceilings, vec![10, 20, 40, 80, 80]);
        assert_eq!(p.backoff(3, 0.5), Duration::from_millis(20));
        assert_eq!(p.backoff(3, 0.0), Duration::ZERO);
        assert_eq!(p.ceiling(u32::MAX), Duration::from_millis(80));
        for _ in 0..1000 {
            let u = random_unit();
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn backoff_never_panics_and_never_exceeds_its_ceiling() {
        let huge = RetryPolicy::new(NonZeroU32::MIN, Duration::MAX, Duration::MAX);
        for unit in [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -1.0,
            0.0,
            0.5,
            0.999_999,
            1.0,
            2.0,
        ] {
            for retry in [0, 1, 2, 40, u32::MAX] {
                assert!(huge.backoff(retry, unit) <= Duration::MAX);
                assert!(policy(3).backoff(retry, unit) <= policy(3).ceiling(retry));
            }
        }
        assert_eq!(policy(3).backoff(1, f64::NAN), Duration::ZERO);
        assert_eq!(huge.backoff(1, 1.0), Duration::MAX);
    }

    #[test]
    fn retries_retryable_errors_up_to_the_cap_and_returns_the_last_error() {
        let calls = AtomicU32::new(0);
        let slept = Mutex::new(Duration::ZERO);
        let result: Result<()> = block_on(policy(3).run(
            |d| {
                *slept.lock().expect("lock") += d;
                async {}
            },
            |n| {
                calls.fetch_add(1, Ordering::Relaxed);
                Box::pin(
                    async move { Err(Error::new(ErrorKind::Conflict, format!("attempt {n}"))) },
                )
            },
        ));
        let err = result.expect_err("gives up");
        assert_eq!(calls.load(Ordering::Relaxed), 3);
        assert_eq!(err.message(), "attempt 3");
        assert!(*slept.lock().expect("lock") <= Duration::from_millis(30));
    }

    #[test]
    fn does_not_retry_errors_that_are_not_retryable() {
        let calls = AtomicU32::new(0);
        let result: Result<()> = block_on(policy(5).run(
            |_| async {},
            |_| {
                calls.fetch_add(1, Ordering::Relaxed);
                Box::pin(async { Err(Error::new(ErrorKind::InvalidInput, "bad")) })
            },
        ));
        assert_eq!(result.expect_err("fails").kind(), ErrorKind::InvalidInput);
        assert_eq!(calls.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn returns_the_first_success() {
        let value = block_on(policy(5).run(
            |_| async {},
            |n| {
                Box::pin(async move {
                    if n < 3 {
                        Err(Error::new(ErrorKind::Deadlock, "victim"))
                    } else {
                        Ok(n)
                    }
                })
            },
        ));
        assert_eq!(value.expect("succeeds"), 3);
    }
}
