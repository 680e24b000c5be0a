//! The unit-of-work contract: where transactions come from and how they end.
//!
//! Every transaction-bound contract ([`crate::DistributedLock`], [`crate::AggregateWriteLock`],
//! [`crate::EventStore`], [`crate::LeaseFence`]) takes the caller's transaction as a type
//! parameter `Tx`. A [`TransactionSource`] is the other half: it begins a `Tx` and ends it by
//! commit or rollback. The Postgres backend implements it over a connection pool
//! (`lockstep_pg::PgTransactionSource`, whose `Tx` is the owned `PgTransaction`), the testkit over
//! its fake database (`FakeDatabase`, whose `Tx` is `FakeTransaction`); application code is
//! generic over `S: TransactionSource` and runs unchanged on both.
//!
//! Most code never calls `begin` / `commit` / `rollback` itself. It hands a closure to
//! [`TransactionSource::transaction`] (commit on `Ok`, roll back on `Err` — sqlx's
//! `Connection::transaction` shape) or to [`TransactionSource::transaction_with_retry`], which
//! runs the whole unit of work again in a new transaction when it fails with a retryable error
//! (a version conflict, a deadlock, a lock timeout, a lost connection), under a [`RetryPolicy`].
//!
//! The closure receives the transaction as an `Arc<Tx>` (pass `&tx` to the contracts) and
//! returns any `Send` future: it may borrow whatever the caller has in scope (the handler, the
//! command), which a closure over `&Tx` returning a boxed future could not without `'static`
//! captures. The runner takes the transaction back when the future is done; a unit of work that
//! kept a clone of the `Arc` (spawned a task holding it, say) cannot be committed and fails
//! with [`crate::ErrorKind::Unsupported`] — its transaction rolls back when the last clone is
//! dropped.
//!
//! ```
//! use lockstep_core::{Error, TransactionSource};
//!
//! async fn answer<S: TransactionSource>(source: &S, question: &str) -> Result<usize, Error> {
//!     source
//!         .transaction(|_tx| async move {
//!             // take locks, load, decide and append on `&_tx` here
//!             Ok(question.len())
//!         })
//!         .await
//! }
//! # let _ = answer::<lockstep_core::unit_of_work::tests_support::NoDatabase>;
//! ```
//!
//! An application error type works too: it needs `From<Error>` (to carry a failed begin or
//! commit) and, for the retrying runner, [`Retryable`] (which of its variants are worth another
//! attempt). A business answer such as "insufficient stock" is returned as an `Err` that is not
//! retryable: the transaction is rolled back and the answer is returned at once.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};
use crate::retry::RetryPolicy;

/// Whether an error is worth running the whole unit of work again.
///
/// Implemented by [`Error`] ([`Error::is_retryable`]); implement it for an application error
/// type that wraps [`Error`] to use it with [`TransactionSource::transaction_with_retry`] and
/// [`RetryPolicy::run`].
pub trait Retryable {
    /// Whether a new attempt, in a new transaction, may succeed.
    fn is_retryable(&self) -> bool;
}

impl Retryable for Error {
    fn is_retryable(&self) -> bool {
        Error::is_retryable(self)
    }
}

/// Where transactions of type [`TransactionSource::Tx`] come from, and how they end.
///
/// Ending a transaction (commit or rollback, or dropping it open) releases its
/// transaction-scoped locks. A dropped open transaction is rolled back and never reused
/// half-finished (the Postgres backend closes its connection instead of pooling it).
pub trait TransactionSource: Send + Sync {
    /// The transaction the backends' contracts run on. Owned and `'static`, so a unit of work
    /// holding it can be spawned.
    type Tx: Send + Sync + 'static;

    /// Begins a transaction (on Postgres: checks a connection out of the pool and begins READ
    /// COMMITTED, which lock-then-load needs).
    fn begin(&self) -> impl Future<Output = Result<Self::Tx>> + Send;

    /// Commits `tx`. A transaction that had failed (a statement errored in it) is rolled back
    /// instead and reported as [`crate::ErrorKind::TransactionAborted`] — never as committed.
    fn commit(&self, tx: Self::Tx) -> impl Future<Output = Result<()>> + Send;

    /// Rolls `tx` back. An error here means the backend could not confirm the rollback; the
    /// transaction is ended anyway (the Postgres backend closes the connection, and the server
    /// rolls back).
    fn rollback(&self, tx: Self::Tx) -> impl Future<Output = Result<()>> + Send;

    /// Runs `work` in one new transaction: commits when it returns `Ok`, rolls back when it
    /// returns `Err` (the work's error is returned; a failure to roll back is not, since the
    /// transaction ends either way). A failed begin or commit is returned as `E::from(Error)`.
    ///
    /// Dropping the returned future drops the open transaction, which rolls it back.
    fn transaction<T, E, F, Fut>(&self, work: F) -> impl Future<Output = Result<T, E>> + Send
    where
        T: Send,
        E: From<Error> + Send,
        F: FnOnce(Arc<Self::Tx>) -> Fut + Send,
        Fut: Future<Output = Result<T, E>> + Send,
    {
        async move {
            let tx = Arc::new(self.begin().await?);
            let outcome = work(Arc::clone(&tx)).await;
            finish(self, tx, outcome).await
        }
    }

    /// Runs `work` as whole units of work under `policy`: each attempt begins a new transaction,
    /// runs `work`, and commits on `Ok`. An attempt that fails with a
    /// [retryable](Retryable::is_retryable) error — from `work`, from begin or from commit — is
    /// rolled back and, while attempts remain, run again after `sleep(backoff)`; any other error
    /// is returned at once after rolling back. Returns the first success or the last error.
    ///
    /// `sleep` waits between attempts: `tokio::time::sleep` in a tokio application (with the
    /// `tokio` feature, [`crate::retry::tokio_sleep`]), so tests can use paused time.
    fn transaction_with_retry<T, E, F, Fut, Sl, SlFut>(
        &self,
        policy: &RetryPolicy,
        sleep: Sl,
        mut work: F,
    ) -> impl Future<Output = Result<T, E>> + Send
    where
        T: Send,
        E: From<Error> + Retryable + Send,
        F: FnMut(Arc<Self::Tx>) -> Fut + Send,
        Fut: Future<Output = Result<T, E>> + Send,
        Sl: FnMut(Duration) -> SlFut + Send,
        SlFut: Future<Output = ()> + Send,
    {
        let policy = *policy;
        let mut sleep = sleep;
        async move {
            let mut attempt = 1;
            loop {
                let outcome = match self.begin().await {
                    Ok(tx) => {
                        let tx = Arc::new(tx);
                        let outcome = work(Arc::clone(&tx)).await;
                        finish(self, tx, outcome).await
                    }
                    Err(err) => Err(E::from(err)),
                };
                match outcome {
                    Ok(value) => return Ok(value),
                    Err(err) => match policy.retry_after(attempt, &err) {
                        Some(delay) => {
                            if !delay.is_zero() {
                                sleep(delay).await;
                            }
                            attempt += 1;
                        }
                        None => return Err(err),
                    },
                }
            }
        }
    }
}

/// Ends `tx` according to `outcome`: commit on `Ok`, rollback on `Err`.
async fn finish<S, T, E>(source: &S, tx: Arc<S::Tx>, outcome: Result<T, E>) -> Result<T, E>
where
    S: TransactionSource + ?Sized,
    E: From<Error>,
{
    let tx = match Arc::try_unwrap(tx) {
        Ok(tx) => tx,
        Err(shared) => {
            // Never commit a transaction something else may still be writing on. Dropping our
            // clone leaves the last holder to end it; an open transaction rolls back on drop.
            drop(shared);
            return match outcome {
                Ok(_) => Err(E::from(Error::new(
                    ErrorKind::Unsupported,
                    "the unit of work kept a clone of its transaction, so it was not committed; \
                     it rolls back when the last clone is dropped",
                ))),
                Err(err) => Err(err),
            };
        }
    };
    match outcome {
        Ok(value) => {
            source.commit(tx).await?;
            Ok(value)
        }
        Err(err) => {
            // The work's error is the one to report; a failed rollback still ends the
            // transaction (the backend discards the connection).
            let _ = source.rollback(tx).await;
            Err(err)
        }
    }
}

#[doc(hidden)]
pub mod tests_support {
    //! A transaction source with nothing behind it, for doc examples.
    use super::TransactionSource;
    use crate::error::{Error, ErrorKind, Result};

    /// Refuses to begin.
    #[derive(Debug)]
    pub struct NoDatabase;

    impl TransactionSource for NoDatabase {
        type Tx = ();

        async fn begin(&self) -> Result<()> {
            Err(Error::new(ErrorKind::Unsupported, "no database"))
        }

        async fn commit(&self, (): ()) -> Result<()> {
            Ok(())
        }

        async fn rollback(&self, (): ()) -> Result<()> {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::error::ErrorKind;

    /// Records how each transaction ended.
    #[derive(Debug, Default)]
    struct Recorder {
        next: AtomicU32,
        ended: Mutex<Vec<(u32, &'static str)>>,
        fail_commit: Mutex<Option<ErrorKind>>,
    }

    impl TransactionSource for Recorder {
        type Tx = u32;

        async fn begin(&self) -> Result<u32> {
            Ok(self.next.fetch_add(1, Ordering::SeqCst) + 1)
        }

        async fn commit(&self, tx: u32) -> Result<()> {
            if let Some(kind) = self.fail_commit.lock().expect("lock").take() {
                self.ended.lock().expect("lock").push((tx, "commit failed"));
                return Err(Error::new(kind, "commit failed"));
            }
            self.ended.lock().expect("lock").push((tx, "commit"));
            Ok(())
        }

        async fn rollback(&self, tx: u32) -> Result<()> {
            self.ended.lock().expect("lock").push((tx, "rollback"));
            Ok(())
        }
    }

    fn block_on<F: Future>(fut: F) -> F::Output {
        // Nothing here ever pends (no real I/O, the sleep is a no-op), so one poll finishes it.
        let mut fut = std::pin::pin!(fut);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match fut.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(out) => out,
            std::task::Poll::Pending => unreachable!("test futures never pend"),
        }
    }

    #[derive(Debug, PartialEq)]
    enum AppError {
        Store(ErrorKind),
        SoldOut,
    }

    impl From<Error> for AppError {
        fn from(e: Error) -> Self {
            AppError::Store(e.kind())
        }
    }

    impl Retryable for AppError {
        fn is_retryable(&self) -> bool {
            matches!(self, AppError::Store(kind) if kind.is_retryable())
        }
    }

    fn no_retry_sleep(_: Duration) -> std::future::Ready<()> {
        std::future::ready(())
    }

    #[test]
    fn ok_commits_and_err_rolls_back() {
        let source = Recorder::default();
        let seen = block_on(source.transaction(|tx| async move { Ok::<_, Error>(*tx) }));
        assert_eq!(seen.expect("committed"), 1);
        let failed: Result<(), AppError> =
            block_on(source.transaction(|_| async { Err(AppError::SoldOut) }));
        assert_eq!(failed, Err(AppError::SoldOut));
        assert_eq!(
            *source.ended.lock().expect("lock"),
            vec![(1, "commit"), (2, "rollback")]
        );
    }

    #[test]
    fn a_failed_commit_is_the_error_returned() {
        let source = Recorder::default();
        *source.fail_commit.lock().expect("lock") = Some(ErrorKind::TransactionAborted);
        let out: Result<u32, Error> = block_on(source.transaction(|tx| async move { Ok(*tx) }));
        assert_eq!(
            out.expect_err("commit failed").kind(),
            ErrorKind::TransactionAborted
        );
    }

    #[test]
    fn retryable_errors_run_the_whole_unit_again_in_a_new_transaction() {
        let source = Recorder::default();
        let policy = RetryPolicy::new(
            std::num::NonZeroU32::new(5).expect("non-zero"),
            Duration::ZERO,
            Duration::ZERO,
        );
        let attempts = AtomicU32::new(0);
        let out: Result<u32, AppError> =
            block_on(
                source.transaction_with_retry(&policy, no_retry_sleep, |tx| {
                    let n = attempts.fetch_add(1, Ordering::SeqCst) + 1;
                    async move {
                        if n < 3 {
                            Err(AppError::Store(ErrorKind::Conflict))
                        } else {
                            Ok(*tx)
                        }
                    }
                }),
            );
        assert_eq!(out, Ok(3), "the third transaction commits");
        assert_eq!(
            *source.ended.lock().expect("lock"),
            vec![(1, "rollback"), (2, "rollback"), (3, "commit")]
        );
    }

    #[test]
    fn business_answers_and_exhausted_attempts_are_returned_after_rolling_back() {
        let source = Recorder::default();
        let policy = RetryPolicy::new(
            std::num::NonZeroU32::new(2).expect("non-zero"),
            Duration::ZERO,
            Duration::ZERO,
        );
        let answer: Result<(), AppError> = block_on(source.transaction_with_retry(
            &policy,
            no_retry_sleep,
            |_| async { Err(AppError::SoldOut) },
        ));
        assert_eq!(answer, Err(AppError::SoldOut));
        let exhausted: Result<(), AppError> = block_on(source.transaction_with_retry(
            &policy,
            no_retry_sleep,
            |_| async { Err(AppError::Store(ErrorKind::Deadlock)) },
        ));
        assert_eq!(exhausted, Err(AppError::Store(ErrorKind::Deadlock)));
        assert_eq!(
            *source.ended.lock().expect("lock"),
            vec![(1, "rollback"), (2, "rollback"), (3, "rollback")]
        );
    }

    #[test]
    fn a_transaction_still_shared_when_the_work_ends_is_not_committed() {
        let source = Recorder::default();
        let leaked = Mutex::new(None);
        let out: Result<(), Error> = block_on(source.transaction(|tx| {
            *leaked.lock().expect("lock") = Some(tx);
            async { Ok(()) }
        }));
        assert_eq!(
            out.expect_err("not committed").kind(),
            ErrorKind::Unsupported
        );
        assert!(
            source.ended.lock().expect("lock").is_empty(),
            "neither committed nor rolled back"
        );
    }

    #[test]
    fn a_retryable_commit_failure_is_retried() {
        let source = Recorder::default();
        *source.fail_commit.lock().expect("lock") = Some(ErrorKind::Deadlock);
        let out: Result<u32, Error> = block_on(source.transaction_with_retry(
            &RetryPolicy::default(),
            no_retry_sleep,
            |tx| async move { Ok(*tx) },
        ));
        assert_eq!(out.expect("second attempt commits"), 2);
    }
}
