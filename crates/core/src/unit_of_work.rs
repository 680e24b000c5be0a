//! The unit-of-work contract: where transactions come from and how they end.
//!
//! Every transaction-bound contract ([`crate::DistributedLock`], [`crate::AggregateWriteLock`],
//! [`crate::EventStore`], [`crate::LeaseFence`]) takes the caller's transaction as a type
//! parameter `Tx`. A [`TransactionSource`] begins one; the [`Transaction`] it returns is a
//! **guard**, held the way sqlx users hold theirs: `let tx = source.begin().await?`, pass `&tx`
//! to the contracts, then `tx.commit().await?` — or `tx.rollback().await`, or just let it drop
//! (on an early `?` return, a panic, a cancelled task), which rolls it back. The Postgres backend
//! implements the pair over a connection pool (`lockstep_pg::PgDatabase`, whose `Tx` is the
//! owned `PgTransaction`), the testkit over its fake database (`FakeDatabase`, whose `Tx` is
//! `FakeTransaction`); application code is generic over `S: TransactionSource` and runs
//! unchanged on both — including from inside `tokio::spawn`, as a web handler runs.
//!
//! ```
//! use lockstep_core::{Error, Transaction, TransactionSource};
//!
//! async fn answer<S: TransactionSource>(source: &S, question: &str) -> Result<usize, Error> {
//!     let tx = source.begin().await?;
//!     // take locks, load, decide and append on `&tx` here; a `?` rolls back
//!     tx.commit().await?;
//!     Ok(question.len())
//! }
//! # let _ = answer::<lockstep_core::unit_of_work::tests_support::NoDatabase>;
//! ```
//!
//! Two runners cover the common shapes, and compile wherever the guard does:
//! [`TransactionSource::transaction`] (one transaction: commit on `Ok`, roll back on `Err`) and
//! [`TransactionSource::transaction_with_retry`] (the whole unit of work again, in a new
//! transaction, when it fails with a retryable error — a version conflict, a deadlock, a lock
//! timeout, a lost connection — under a [`RetryPolicy`], the attempt number passed in). Their
//! closures return a [`BoxFuture`] (`Box::pin(async move { … })`), and the runners return one:
//! a future whose type names only the lifetime of what it borrows is `Send` by its type, so the
//! compiler never has to prove it for every lifetime — the proof that fails
//! ("one type is more general than the other") when a generic runner over the closure's own
//! future type is called from a spawned task with concrete types (ADR 0011).
//!
//! An application error type works too: it needs `From<Error>` (to carry a failed begin or
//! commit) and, for the retrying runner, [`Retryable`] (which of its variants are worth another
//! attempt). A business answer such as "insufficient stock" is returned as an `Err` that is not
//! retryable: the transaction is rolled back and the answer is returned at once.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};
use crate::future::BoxFuture;
use crate::retry::{RetryPolicy, Retryable};

/// An open transaction, as a guard: end it with [`Transaction::commit`] or
/// [`Transaction::rollback`]; **dropping it open rolls it back**.
///
/// Ending a transaction (commit, rollback or drop) releases its transaction-scoped locks.
/// Implementations are cancel-safe: a transaction dropped in the middle of a statement, or a
/// `commit` / `rollback` future dropped before it finished, never leaves its connection pooled
/// inside the transaction — it is rolled back before anyone reuses it, or discarded.
pub trait Transaction: Send + Sync + Sized + 'static {
    /// Commits. A transaction that had failed (a statement errored in it) is rolled back
    /// instead and reported as [`crate::ErrorKind::TransactionAborted`] — never as committed.
    /// A connection lost while the commit was in flight is [`crate::ErrorKind::CommitUnknown`]
    /// (not retryable: it may have committed).
    fn commit(self) -> impl Future<Output = Result<()>> + Send;

    /// Rolls back. An error here means the backend could not confirm the rollback; the
    /// transaction is ended anyway (the Postgres backend closes the connection, and the server
    /// rolls back).
    fn rollback(self) -> impl Future<Output = Result<()>> + Send;
}

/// Where transactions of type [`TransactionSource::Tx`] come from.
pub trait TransactionSource: Send + Sync {
    /// The transaction the backends' contracts run on: an owned, `'static` guard, so a unit of
    /// work holding it can be spawned.
    type Tx: Transaction;

    /// Begins a transaction (on Postgres: checks a connection out of the pool, waiting a
    /// bounded time, and begins READ COMMITTED, which lock-then-load needs).
    fn begin(&self) -> impl Future<Output = Result<Self::Tx>> + Send;

    /// Runs `work` in one new transaction: commits when it returns `Ok`, rolls back when it
    /// returns `Err` (the work's error is returned; a failure to roll back is not, since the
    /// transaction ends either way). A failed begin or commit is returned as `E::from(Error)`.
    ///
    /// `work` receives the transaction as an `Arc` (pass `&tx` to the contracts) and returns
    /// a [`BoxFuture`] that may borrow anything the caller has in scope:
    ///
    /// ```
    /// # use lockstep_core::{Error, TransactionSource};
    /// # async fn demo<S: TransactionSource>(source: &S, name: &str) -> Result<usize, Error> {
    /// let len = source
    ///     .transaction(|_tx| Box::pin(async move { Ok::<_, Error>(name.len()) }))
    ///     .await?;
    /// # Ok(len) }
    /// ```
    ///
    /// The runner takes the transaction back when the future is done; a unit of work that
    /// kept a clone of the `Arc` (spawned a task holding it, say) is **not committed** and
    /// fails with [`crate::ErrorKind::Unsupported`] — its transaction rolls back when the last
    /// clone is dropped. Dropping the returned future drops the open transaction, which rolls
    /// it back.
    fn transaction<'a, T, E, F>(&'a self, work: F) -> BoxFuture<'a, Result<T, E>>
    where
        T: Send + 'a,
        E: From<Error> + Send + 'a,
        F: FnOnce(Arc<Self::Tx>) -> BoxFuture<'a, Result<T, E>> + Send + 'a,
    {
        Box::pin(async move {
            let tx = Arc::new(self.begin().await?);
            let outcome = work(Arc::clone(&tx)).await;
            finish(tx, outcome).await
        })
    }

    /// Runs `work` as whole units of work under `policy`: attempt `n` (1, 2, …, passed to
    /// `work`) begins a new transaction, runs `work`, and commits on `Ok`. An attempt that
    /// fails with a [retryable](Retryable::is_retryable) error — from `work`, from begin or
    /// from commit — is rolled back and, while attempts remain, run again after
    /// `sleep(backoff)`; any other error is returned at once after rolling back. Returns the
    /// first success or the last error.
    ///
    /// `sleep` waits between attempts: `tokio::time::sleep` in a tokio application (with the
    /// `tokio` feature, `lockstep_core::tokio_sleep`), so tests can use paused time.
    ///
    /// ```
    /// # use lockstep_core::{Error, RetryPolicy, TransactionSource};
    /// # async fn demo<S: TransactionSource>(source: &S, sleep: fn(std::time::Duration) -> std::future::Ready<()>) -> Result<u32, Error> {
    /// let attempts = source
    ///     .transaction_with_retry(&RetryPolicy::default(), sleep, |_tx, attempt| {
    ///         Box::pin(async move { Ok::<_, Error>(attempt) })
    ///     })
    ///     .await?;
    /// assert_eq!(attempts, 1);
    /// # Ok(attempts) }
    /// ```
    fn transaction_with_retry<'a, T, E, F, Sl, SlFut>(
        &'a self,
        policy: &RetryPolicy,
        sleep: Sl,
        work: F,
    ) -> BoxFuture<'a, Result<T, E>>
    where
        T: Send + 'a,
        E: From<Error> + Retryable + Send + 'a,
        F: FnMut(Arc<Self::Tx>, u32) -> BoxFuture<'a, Result<T, E>> + Send + 'a,
        Sl: FnMut(Duration) -> SlFut + Send + 'a,
        SlFut: Future<Output = ()> + Send,
    {
        let policy = *policy;
        Box::pin(async move {
            // The attempts run one after another, so the lock is never contended; it lets each
            // attempt's future call `work` after its `begin` without borrowing the closure
            // that `RetryPolicy::run` calls. A poisoned lock only follows a panic in `work`,
            // which unwound through this future already.
            let work = Mutex::new(work);
            let work = &work;
            policy
                .run(sleep, move |attempt| {
                    Box::pin(async move {
                        let tx = Arc::new(self.begin().await?);
                        let unit = {
                            let mut work = work.lock().unwrap_or_else(PoisonError::into_inner);
                            (*work)(Arc::clone(&tx), attempt)
                        };
                        let outcome = unit.await;
                        finish(tx, outcome).await
                    })
                })
                .await
        })
    }
}

/// Ends `tx` according to `outcome`: commit on `Ok`, rollback on `Err`.
async fn finish<Tx, T, E>(tx: Arc<Tx>, outcome: Result<T, E>) -> Result<T, E>
where
    Tx: Transaction,
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
            tx.commit().await?;
            Ok(value)
        }
        Err(err) => {
            // The work's error is the one to report; a failed rollback still ends the
            // transaction (the backend discards the connection) — unless the rollback says
            // the work may have taken effect all the same (`CommitUnknown`: on Postgres, a
            // refused `BEGIN`), which the caller must hear of, and must not retry.
            match tx.rollback().await {
                Err(unknown) if unknown.kind() == crate::ErrorKind::CommitUnknown => {
                    Err(E::from(unknown))
                }
                _ => Err(err),
            }
        }
    }
}

#[doc(hidden)]
pub mod tests_support {
    //! A transaction source with nothing behind it, for doc examples.
    use super::{Transaction, TransactionSource};
    use crate::error::{Error, ErrorKind, Result};

    /// Refuses to begin.
    #[derive(Debug)]
    pub struct NoDatabase;

    /// The transaction [`NoDatabase`] never begins.
    #[derive(Debug)]
    pub struct NoTransaction;

    impl Transaction for NoTransaction {
        async fn commit(self) -> Result<()> {
            Ok(())
        }

        async fn rollback(self) -> Result<()> {
            Ok(())
        }
    }

    impl TransactionSource for NoDatabase {
        type Tx = NoTransaction;

        async fn begin(&self) -> Result<NoTransaction> {
            Err(Error::new(ErrorKind::Unsupported, "no database"))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::error::ErrorKind;

    /// How each transaction ended, shared by the source and its transactions.
    #[derive(Debug, Default)]
    struct Log {
        ended: Mutex<Vec<(u32, &'static str)>>,
        fail_commit: Mutex<Option<ErrorKind>>,
        fail_begin: Mutex<Option<ErrorKind>>,
    }

    /// Records how each transaction ended.
    #[derive(Debug, Default)]
    struct Recorder {
        next: AtomicU32,
        log: Arc<Log>,
    }

    impl Recorder {
        fn ended(&self) -> Vec<(u32, &'static str)> {
            self.log.ended.lock().expect("lock").clone()
        }

        fn fail_next_commit(&self, kind: ErrorKind) {
            *self.log.fail_commit.lock().expect("lock") = Some(kind);
        }

        fn fail_next_begin(&self, kind: ErrorKind) {
            *self.log.fail_begin.lock().expect("lock") = Some(kind);
        }
    }

    #[derive(Debug)]
    struct RecordedTx {
        id: u32,
        log: Arc<Log>,
        open: bool,
    }

    impl RecordedTx {
        fn end(mut self, how: &'static str) {
            self.open = false;
            self.log.ended.lock().expect("lock").push((self.id, how));
        }
    }

    impl Drop for RecordedTx {
        fn drop(&mut self) {
            if self.open {
                self.log
                    .ended
                    .lock()
                    .expect("lock")
                    .push((self.id, "dropped"));
            }
        }
    }

    impl Transaction for RecordedTx {
        async fn commit(self) -> Result<()> {
            let failure = self.log.fail_commit.lock().expect("lock").take();
            if let Some(kind) = failure {
                self.end("commit failed");
                return Err(Error::new(kind, "commit failed"));
            }
            self.end("commit");
            Ok(())
        }

        async fn rollback(self) -> Result<()> {
            self.end("rollback");
            Ok(())
        }
    }

    impl TransactionSource for Recorder {
        type Tx = RecordedTx;

        async fn begin(&self) -> Result<RecordedTx> {
            if let Some(kind) = self.log.fail_begin.lock().expect("lock").take() {
                return Err(Error::new(kind, "begin failed"));
            }
            Ok(RecordedTx {
                id: self.next.fetch_add(1, Ordering::SeqCst) + 1,
                log: Arc::clone(&self.log),
                open: true,
            })
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

    fn zero_backoff(attempts: u32) -> RetryPolicy {
        RetryPolicy::new(
            std::num::NonZeroU32::new(attempts).expect("non-zero"),
            Duration::ZERO,
            Duration::ZERO,
        )
    }

    #[test]
    fn ok_commits_and_err_rolls_back() {
        let source = Recorder::default();
        let seen =
            block_on(source.transaction(|tx| Box::pin(async move { Ok::<_, Error>(tx.id) })));
        assert_eq!(seen.expect("committed"), 1);
        let failed: Result<(), AppError> =
            block_on(source.transaction(|_| Box::pin(async { Err(AppError::SoldOut) })));
        assert_eq!(failed, Err(AppError::SoldOut));
        assert_eq!(source.ended(), vec![(1, "commit"), (2, "rollback")]);
    }

    #[test]
    fn the_guard_rolls_back_when_dropped_open() {
        let source = Recorder::default();
        let tx = block_on(source.begin()).expect("begun");
        drop(tx);
        let tx = block_on(source.begin()).expect("begun");
        block_on(tx.commit()).expect("committed");
        assert_eq!(source.ended(), vec![(1, "dropped"), (2, "commit")]);
    }

    #[test]
    fn a_failed_commit_is_the_error_returned() {
        let source = Recorder::default();
        source.fail_next_commit(ErrorKind::TransactionAborted);
        let out: Result<u32, Error> =
            block_on(source.transaction(|tx| Box::pin(async move { Ok(tx.id) })));
        assert_eq!(
            out.expect_err("commit failed").kind(),
            ErrorKind::TransactionAborted
        );
    }

    #[test]
    fn retryable_errors_run_the_whole_unit_again_in_a_new_transaction_told_its_attempt() {
        let source = Recorder::default();
        let seen = Mutex::new(Vec::new());
        let out: Result<u32, AppError> = block_on(source.transaction_with_retry(
            &zero_backoff(5),
            no_retry_sleep,
            |tx, attempt| {
                seen.lock().expect("lock").push((tx.id, attempt));
                Box::pin(async move {
                    if attempt < 3 {
                        Err(AppError::Store(ErrorKind::Conflict))
                    } else {
                        Ok(tx.id)
                    }
                })
            },
        ));
        assert_eq!(out, Ok(3), "the third transaction commits");
        assert_eq!(
            *seen.lock().expect("lock"),
            vec![(1, 1), (2, 2), (3, 3)],
            "each attempt gets a new transaction and its number"
        );
        assert_eq!(
            source.ended(),
            vec![(1, "rollback"), (2, "rollback"), (3, "commit")]
        );
    }

    #[test]
    fn business_answers_and_exhausted_attempts_are_returned_after_rolling_back() {
        let source = Recorder::default();
        let policy = zero_backoff(2);
        let answer: Result<(), AppError> = block_on(source.transaction_with_retry(
            &policy,
            no_retry_sleep,
            |_, _| Box::pin(async { Err(AppError::SoldOut) }),
        ));
        assert_eq!(answer, Err(AppError::SoldOut));
        let exhausted: Result<(), AppError> = block_on(source.transaction_with_retry(
            &policy,
            no_retry_sleep,
            |_, _| Box::pin(async { Err(AppError::Store(ErrorKind::Deadlock)) }),
        ));
        assert_eq!(exhausted, Err(AppError::Store(ErrorKind::Deadlock)));
        assert_eq!(
            source.ended(),
            vec![(1, "rollback"), (2, "rollback"), (3, "rollback")]
        );
    }

    #[test]
    fn a_transaction_still_shared_when_the_work_ends_is_not_committed() {
        let source = Recorder::default();
        let leaked = Mutex::new(None);
        let out: Result<(), Error> = block_on(source.transaction(|tx| {
            *leaked.lock().expect("lock") = Some(tx);
            Box::pin(async { Ok(()) })
        }));
        assert_eq!(
            out.expect_err("not committed").kind(),
            ErrorKind::Unsupported
        );
        assert!(
            source.ended().is_empty(),
            "neither committed nor rolled back"
        );
        drop(leaked);
        assert_eq!(
            source.ended(),
            vec![(1, "dropped")],
            "the last clone rolls it back"
        );
    }

    #[test]
    fn a_retryable_commit_failure_is_retried() {
        let source = Recorder::default();
        source.fail_next_commit(ErrorKind::Deadlock);
        let out: Result<u32, Error> = block_on(source.transaction_with_retry(
            &RetryPolicy::default(),
            no_retry_sleep,
            |tx, _| Box::pin(async move { Ok(tx.id) }),
        ));
        assert_eq!(out.expect("second attempt commits"), 2);
    }

    #[test]
    fn a_retryable_begin_failure_is_retried_and_another_is_returned_at_once() {
        let source = Recorder::default();
        source.fail_next_begin(ErrorKind::ConnectionLost);
        let out: Result<u32, Error> = block_on(source.transaction_with_retry(
            &RetryPolicy::default(),
            no_retry_sleep,
            |tx, attempt| Box::pin(async move { Ok(tx.id * 10 + attempt) }),
        ));
        assert_eq!(out.expect("the second attempt begins"), 12);
        source.fail_next_begin(ErrorKind::InvalidInput);
        let out: Result<u32, AppError> = block_on(source.transaction_with_retry(
            &RetryPolicy::default(),
            no_retry_sleep,
            |tx, _| Box::pin(async move { Ok(tx.id) }),
        ));
        assert_eq!(out, Err(AppError::Store(ErrorKind::InvalidInput)));
        assert_eq!(source.ended(), vec![(1, "commit")]);
    }
}
