//! The process side of lockstep's transaction-scoped advisory locks, shared by every backend
//! that waits for one (`lockstep-pg-advisory`'s `PgDistributedLock`, `lockstep-pg-store`'s
//! `load_locked`): the in-process queue in front of the server's lock ([`LockQueue`]), the
//! deadline, and cancel-on-drop. The protocol at the server — isolation check, `lock_timeout`
//! for the wait — is the SQL function `lockstep_advisory_lock`
//! (`migrations/functions/lockstep_advisory_lock.sql`); the statements here only call it.
//! Design: `docs/adr/0003-advisory-lock-design.md`.
//!
//! Waiting for a lock needs an owned [`PgTransaction`]: an abandoned wait is cancelled with a
//! cancel request that can arrive late, after the statement ended, so the connection must not
//! serve anyone else afterwards, and only a transaction that owns its connection can promise
//! that (it closes the connection when it ends instead of pooling it). A borrowed
//! `tokio_postgres::Transaction` cannot, so nothing here accepts one (ADR 0003, addendum).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::{Error, ErrorKind, ResourceKey, Result, ValidationError};
use tokio::time::Instant;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{Row, Socket};

use futures_util::future::BoxFuture;

use crate::cancel::{CancelOnDrop, Canceller};
use crate::driver::{Column, DbError, Executor, query_one};
use crate::queue::LocalQueue;
use crate::transaction::PgTransaction;

/// The in-process queue in front of PostgreSQL advisory locks, and how an abandoned wait is
/// cancelled.
///
/// Waiters of one process for one key queue in memory and only the head of the queue waits at
/// the server, so a hot key has one waiting backend per process, not one per waiter. The head
/// holds its place only while it waits at the server, never while it holds the lock (so a
/// transaction that never commits cannot wedge the queue). A waiter that finds the queue busy
/// waits in memory, sending nothing, at most [`LockQueue::with_local_patience`] before going to
/// the server anyway (the server's deadlock detector cannot see the in-process queue). A
/// transaction that already holds the key (taken through lockstep: the transaction keeps the
/// list) skips the queue, so re-entry never waits behind a waiter that waits for it — and no
/// statement is spent finding out (ADR 0009).
///
/// Use one per process and share it (clones share the queue): build the process's
/// `lockstep_pg_advisory::PgDistributedLock` and hand it, or its queue, to
/// `lockstep_pg_store::PgEventStore::with_lock`, so that the aggregate lock and `load_locked`
/// queue together.
///
/// ```
/// use std::time::Duration;
///
/// let queue = lockstep_pg::LockQueue::new()
///     .with_local_patience(Duration::from_millis(500))
///     .with_cancel_tls(tokio_postgres::NoTls); // the connector the pool was built with
/// assert_eq!(queue.locally_queued_keys(), 0);
/// ```
#[derive(Clone)]
pub struct LockQueue {
    queue: Arc<LocalQueue>,
    local_queue: bool,
    local_patience: Duration,
    canceller: Canceller,
}

impl std::fmt::Debug for LockQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockQueue")
            .field("local_queue", &self.local_queue)
            .field("local_patience", &self.local_patience)
            .field("locally_queued_keys", &self.queue.len())
            .field("cancel_requests", &self.canceller)
            .finish()
    }
}

impl Default for LockQueue {
    fn default() -> Self {
        LockQueue::new()
    }
}

impl LockQueue {
    /// How long a waiter queues in process before it waits at the server regardless
    /// (default 1 s); see [`LockQueue::with_local_patience`].
    pub const DEFAULT_LOCAL_PATIENCE: Duration = Duration::from_secs(1);

    /// A new, empty queue: on, [`LockQueue::DEFAULT_LOCAL_PATIENCE`], cancel requests without
    /// TLS.
    pub fn new() -> LockQueue {
        LockQueue {
            queue: Arc::new(LocalQueue::default()),
            local_queue: true,
            local_patience: Self::DEFAULT_LOCAL_PATIENCE,
            canceller: Canceller::default(),
        }
    }

    /// Turns the in-process queue on (default) or off. Off, every waiter waits at the server
    /// (one waiting backend per waiter).
    #[must_use]
    pub fn with_local_queue(mut self, enabled: bool) -> Self {
        self.local_queue = enabled;
        self
    }

    /// How long a waiter queues in process before it goes to wait at the server anyway
    /// (default [`Self::DEFAULT_LOCAL_PATIENCE`]). The bound exists because the server's
    /// deadlock detector cannot see the in-process queue: with locks taken in inconsistent
    /// orders, a cycle through the queue is found only once its waiters reach the server.
    #[must_use]
    pub fn with_local_patience(mut self, patience: Duration) -> Self {
        self.local_patience = patience;
        self
    }

    /// Sends the cancel requests that end abandoned waits with `tls`: **pass the connector the
    /// pool was built with** (`deadpool_postgres::Manager::new(config, tls)`, or
    /// `Config::create_pool(runtime, tls)`). A cancel request is a new connection to the server,
    /// and deadpool does not hand out its manager's connector. The default is
    /// `tokio_postgres::NoTls`, right for a pool built with `NoTls`; with a server that refuses
    /// connections without TLS, a request sent without it fails (logged as a warning) and the
    /// abandoned wait ends only when its connection is closed, at the end of its transaction.
    #[must_use]
    pub fn with_cancel_tls<T>(mut self, tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
        T::Stream: Sync + Send,
        T::TlsConnect: Sync + Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        self.canceller = Canceller::new(tls);
        self
    }

    /// Whether the in-process queue is on.
    pub fn local_queue(&self) -> bool {
        self.local_queue
    }

    /// How long a waiter queues in process before it waits at the server regardless.
    pub fn local_patience(&self) -> Duration {
        self.local_patience
    }

    /// How many keys have local waiters right now (0 when idle: entries are removed when their
    /// last waiter leaves).
    pub fn locally_queued_keys(&self) -> usize {
        self.queue.len()
    }
}

/// What a locking statement run by [`acquire_with`] must do.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockCall {
    /// The key to lock.
    pub advisory_key: i64,
    /// The `lock_timeout` for the wait (`p_lock_timeout` of `lockstep_advisory_lock`), e.g.
    /// `"250ms"`; `None`: wait without limit.
    pub lock_timeout: Option<String>,
}

/// `$1` key, `$2` lock_timeout (`NULL`: no limit) → refused isolation level (`NULL` when
/// locked). Waits.
const LOCK_XACT: &str = "SELECT refused_isolation FROM lockstep_advisory_lock(\
     p_key => $1, p_session => false, p_wait => true, p_lock_timeout => $2)";

/// `$1` key → (refused isolation level, acquired). Never waits.
const TRY_XACT: &str = "SELECT refused_isolation, acquired FROM lockstep_advisory_lock(\
     p_key => $1, p_session => false, p_wait => false, p_lock_timeout => NULL)";

/// Takes `key` for `tx` through `queue` (in-process queue, deadline, cancel-on-drop) by running
/// `locking`, a statement that takes the lock itself: a plain lock statement
/// ([`lock_statement`]), one pipelined with follow-up queries, or a server-side function that
/// locks and then loads. `locking` gets the advisory key and the `lock_timeout` for the wait,
/// must take the lock through `lockstep_advisory_lock` (isolation check first), and may be
/// called with the lock already held by `tx` (re-entrant).
///
/// Dropped before the statement returns, a cancel request ends the server-side wait, and the
/// transaction's connection is closed rather than pooled when the transaction ends.
#[doc(hidden)]
pub async fn acquire_with<T, R, F, Fut>(
    queue: &LockQueue,
    tx: &T,
    key: &ResourceKey,
    timeout: Option<Duration>,
    mut locking: F,
) -> Result<R>
where
    T: LockingTransaction + ?Sized,
    F: FnMut(LockCall) -> Fut,
    Fut: Future<Output = Result<R>>,
{
    let advisory = key.advisory_key();
    if let Some(limit) = timeout {
        lock_timeout_setting(limit)?; // refuse a bad timeout before anything is sent
    }
    let deadline = timeout.map(deadline_after);
    let slot = queue.local_queue.then(|| queue.queue.slot(advisory));
    let mut permit = None;
    if let Some(slot) = &slot {
        if tx.holds_lock(advisory) {
            // Re-entrant: the server grants it at once. Queueing behind a local waiter would
            // deadlock unseen (that waiter may be waiting for this very transaction).
        } else {
            match slot.mutex().try_lock() {
                Ok(free) => permit = Some(free),
                Err(_) => {
                    // Another transaction of this process waits at the server for this key:
                    // wait behind it in memory (no statement of our own meanwhile — on a hot key
                    // that would cost every writer a round trip), for at most the patience.
                    let patience_end = deadline_after(queue.local_patience);
                    let until = deadline.map_or(patience_end, |d| d.min(patience_end));
                    permit = tokio::time::timeout_at(until, slot.mutex().lock())
                        .await
                        .ok();
                }
            }
        }
    }
    // Past the deadline this is a last 1 ms chance, so a timeout always comes from the server
    // and leaves the transaction aborted, like any other failed lock wait.
    let lock_timeout = deadline
        .map(|d| lock_timeout_setting(d.saturating_duration_since(Instant::now())))
        .transpose()?;
    // Dropped before the statement returns: a cancel request ends the server-side wait, and
    // the connection is closed rather than pooled when the transaction ends (the request may
    // arrive late and would cancel the next borrower's statement).
    let cancel = tx.cancel_on_drop(queue);
    let discard = DiscardOnDrop(Some(tx));
    let outcome = locking(LockCall {
        advisory_key: advisory,
        lock_timeout,
    })
    .await;
    cancel.disarm();
    discard.disarm();
    match &outcome {
        Ok(_) => tx.note_lock_held(advisory),
        Err(e) if e.kind() != ErrorKind::ConnectionLost => {
            // Bounded: the error stands whatever becomes of this.
            let _ = tokio::time::timeout(ABORT_SYNC_WAIT, tx.await_abort()).await;
        }
        Err(_) => {}
    }
    drop(permit);
    outcome
}

/// How long a failed lock statement waits for the server to finish aborting its transaction
/// ([`await_abort`]): one round trip on a responsive server; past it the error is returned
/// anyway (the release then happens a little later, as PostgreSQL itself would have it).
const ABORT_SYNC_WAIT: Duration = Duration::from_secs(1);

/// The blocking lock statement for `tx` (isolation check, `lock_timeout` for the wait when
/// set), to run inside [`acquire_with`].
#[doc(hidden)]
pub async fn lock_statement<T: LockingTransaction + ?Sized>(
    tx: &T,
    key: &ResourceKey,
    call: LockCall,
) -> Result<()> {
    let row = query_one(tx, LOCK_XACT, &[&call.advisory_key, &call.lock_timeout])
        .await
        .map_err(|e| lock_db_error(e, key, "waiting for"))?;
    check_isolation(db_column::<Option<String>>(&row, 0)?.as_deref(), key)
}

/// One try of `key` for `tx`, never waiting (with the isolation check): whether `tx` holds it
/// now.
#[doc(hidden)]
pub async fn try_lock_statement<T: LockingTransaction + ?Sized>(
    tx: &T,
    key: &ResourceKey,
) -> Result<bool> {
    let row = query_one(tx, TRY_XACT, &[&key.advisory_key()])
        .await
        .map_err(|e| lock_db_error(e, key, "trying"))?;
    check_isolation(db_column::<Option<String>>(&row, 0)?.as_deref(), key)?;
    let acquired = db_column(&row, 1)?;
    if acquired {
        tx.note_lock_held(key.advisory_key());
    }
    Ok(acquired)
}

/// Waits for this process's turn to wait at the server for `advisory`, then runs
/// `wait_at_server` holding it (the session-lock path, which queues before it takes a pooled
/// connection). The turn comes when the waiter ahead is done waiting at the server, or after
/// the queue's patience, or at `deadline`; with the queue off, at once.
#[doc(hidden)]
pub async fn in_turn<R, Fut>(
    queue: &LockQueue,
    advisory: i64,
    deadline: Option<Instant>,
    wait_at_server: impl FnOnce() -> Fut,
) -> R
where
    Fut: Future<Output = R>,
{
    let slot = queue.local_queue.then(|| queue.queue.slot(advisory));
    let permit = match &slot {
        Some(slot) => {
            let patience_end = deadline_after(queue.local_patience);
            let until = deadline.map_or(patience_end, |d| d.min(patience_end));
            tokio::time::timeout_at(until, slot.mutex().lock())
                .await
                .ok()
        }
        None => None,
    };
    let outcome = wait_at_server().await;
    drop(permit);
    outcome
}

/// The instant `after` from now, saturating: a `Duration` too large for an `Instant` (e.g.
/// `Duration::MAX`, "wait for ever") gives an instant [`FAR_FUTURE`] away instead of a panic.
#[doc(hidden)]
pub fn deadline_after(after: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(after.min(FAR_FUTURE))
        .unwrap_or_else(|| now + Duration::from_secs(24 * 60 * 60))
}

/// How far away "for ever" is for [`deadline_after`]: about 30 years (what tokio itself uses).
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// A guard that sends a cancel request for `token`'s connection when dropped before
/// [`CancelOnDrop::disarm`](crate::internal::CancelOnDrop::disarm), with `queue`'s TLS setting.
/// The caller must also make sure that connection is not used again (a late request would
/// cancel a later statement): close it.
#[doc(hidden)]
pub fn cancel_on_drop(
    queue: &LockQueue,
    token: tokio_postgres::CancelToken,
) -> crate::cancel::CancelOnDrop {
    queue.canceller.arm(token)
}

/// `lock_timeout` for a wait of `limit`: whole milliseconds, rounded up, at least 1 ms (`0`
/// would mean "no timeout").
#[doc(hidden)]
pub fn lock_timeout_setting(limit: Duration) -> Result<String> {
    let millis = limit.as_micros().div_ceil(1000).max(1);
    if millis > i32::MAX as u128 {
        return Err(ValidationError::DurationTooLarge {
            field: "lock timeout",
        }
        .into());
    }
    Ok(format!("{millis}ms"))
}

/// Turns the `refused_isolation` a lock statement returned into the caller's error: `None`
/// (the statement checked READ COMMITTED and went on to lock) is fine; `Some(level)` means the
/// transaction is REPEATABLE READ or SERIALIZABLE, where lock-then-load would read a snapshot
/// that may predate the previous holder's commit. The statement took no lock in that case.
#[doc(hidden)]
pub fn check_isolation(refused: Option<&str>, key: &ResourceKey) -> Result<()> {
    match refused {
        None => Ok(()),
        Some(level) => Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "refusing to lock {key} in a {level} transaction: lock-then-load needs READ \
                 COMMITTED (a REPEATABLE READ or SERIALIZABLE snapshot can predate the previous \
                 holder's commit)"
            ),
        )),
    }
}

/// A driver error of a lock statement, with its kind, through the helper every lockstep
/// statement shares ([`crate::internal::statement_error`]): the server's message and SQLSTATE,
/// and on a database without lockstep's schema (no `lockstep_advisory_lock`)
/// advice to run the migrations.
#[doc(hidden)]
pub fn lock_error(err: tokio_postgres::Error, key: &ResourceKey, doing: &str) -> Error {
    crate::error::map_statement_error(err, &format!("{doing} advisory lock {key}"))
}

/// [`lock_error`] of either driver.
#[doc(hidden)]
pub fn lock_db_error(err: DbError, key: &ResourceKey, doing: &str) -> Error {
    crate::error::map_db_statement_error(err, &format!("{doing} advisory lock {key}"))
}

/// Column `idx` of a lock statement's row of either driver, or a typed error (never a panic).
#[doc(hidden)]
pub fn db_column<T: Column>(row: &crate::driver::Row, idx: usize) -> Result<T> {
    row.get(idx).map_err(|e| {
        Error::new(ErrorKind::Backend, "decoding a lock statement's result").with_source(e)
    })
}

/// Column `idx` of a lock statement's row, or a typed error (never a panic).
#[doc(hidden)]
pub fn column<'r, T: tokio_postgres::types::FromSql<'r>>(row: &'r Row, idx: usize) -> Result<T> {
    row.try_get(idx).map_err(|e| {
        Error::new(ErrorKind::Backend, "decoding a lock statement's result").with_source(e)
    })
}

/// A transaction that can wait for an advisory lock through [`acquire_with`]: it owns its
/// connection, so it can close it instead of pooling it after an abandoned wait (a late cancel
/// request must not reach the next borrower), and it keeps the keys it holds. Implemented by
/// [`PgTransaction`] and, with feature `sqlx`, `SqlxTransaction`.
#[doc(hidden)]
pub trait LockingTransaction: Executor {
    /// Whether this transaction took `key` through lockstep already.
    fn holds_lock(&self, key: i64) -> bool;

    /// Notes that this transaction holds `key`.
    fn note_lock_held(&self, key: i64);

    /// A guard that ends the statement running on this transaction's connection when dropped
    /// armed (a cancel request, sent with `queue`'s settings where the driver needs them).
    fn cancel_on_drop(&self, queue: &LockQueue) -> CancelOnDrop;

    /// Closes the connection when the transaction ends instead of pooling it.
    fn discard_connection_after_end(&self);

    /// Returns once the server has finished aborting the transaction after a failed
    /// statement.
    ///
    /// PostgreSQL sends a statement's error *before* it aborts the transaction and releases
    /// its locks, so a caller that acts on a lock timeout at once (another transaction tries a
    /// key the failed one held) could still find it held. The server reads the next message
    /// only after the abort: an empty query — which even an aborted transaction answers
    /// without error — marks the moment. It costs a round trip on the failure path only, and
    /// dropping it leaves nothing running. Its own failure changes nothing.
    fn await_abort(&self) -> BoxFuture<'_, ()>;
}

impl LockingTransaction for PgTransaction {
    fn holds_lock(&self, key: i64) -> bool {
        PgTransaction::holds_lock(self, key)
    }

    fn note_lock_held(&self, key: i64) {
        PgTransaction::note_lock_held(self, key);
    }

    fn cancel_on_drop(&self, queue: &LockQueue) -> CancelOnDrop {
        queue.canceller.arm(self.client().cancel_token())
    }

    fn discard_connection_after_end(&self) {
        PgTransaction::discard_connection_after_end(self);
    }

    fn await_abort(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let _ = self.client().simple_query("").await;
        })
    }
}

/// Marks the transaction's connection for closing if the lock statement is abandoned.
struct DiscardOnDrop<'a, T: LockingTransaction + ?Sized>(Option<&'a T>);

impl<T: LockingTransaction + ?Sized> DiscardOnDrop<'_, T> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl<T: LockingTransaction + ?Sized> Drop for DiscardOnDrop<'_, T> {
    fn drop(&mut self) {
        if let Some(tx) = self.0 {
            tx.discard_connection_after_end();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_timeouts_round_up_to_whole_milliseconds() {
        let s = |d| lock_timeout_setting(d).expect("valid");
        assert_eq!(s(Duration::ZERO), "1ms");
        assert_eq!(s(Duration::from_micros(1)), "1ms");
        assert_eq!(s(Duration::from_micros(1500)), "2ms");
        assert_eq!(s(Duration::from_secs(2)), "2000ms");
        let err = lock_timeout_setting(Duration::from_secs(60 * 60 * 24 * 30)).expect_err("big");
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
    }

    #[tokio::test]
    async fn deadlines_saturate_instead_of_panicking() {
        let soon = deadline_after(Duration::from_millis(5));
        assert!(soon > Instant::now() - Duration::from_secs(1));
        let never = deadline_after(Duration::MAX);
        assert!(never > Instant::now() + Duration::from_secs(86_400 * 365));
        // A patience of Duration::MAX used to panic ("overflow when adding duration to
        // instant") as soon as a waiter queued.
        let queue = LockQueue::new().with_local_patience(Duration::MAX);
        let ran = in_turn(&queue, 7, None, || async { "ran" }).await;
        assert_eq!(ran, "ran");
    }

    #[test]
    fn a_refused_isolation_level_is_an_unsupported_error() {
        let key = ResourceKey::new("k").expect("key");
        assert!(check_isolation(None, &key).is_ok());
        for level in ["repeatable read", "serializable"] {
            let err = check_isolation(Some(level), &key).expect_err("refused");
            assert_eq!(err.kind(), ErrorKind::Unsupported);
            assert!(err.message().contains(level), "{err}");
        }
    }

    #[test]
    fn clones_share_one_queue_and_settings_are_kept() {
        let queue = LockQueue::new()
            .with_local_queue(false)
            .with_local_patience(Duration::from_millis(5));
        let clone = queue.clone();
        assert!(Arc::ptr_eq(&queue.queue, &clone.queue));
        assert!(!clone.local_queue());
        assert_eq!(clone.local_patience(), Duration::from_millis(5));
        let debug = format!("{queue:?}");
        assert!(debug.contains("NoTls"), "{debug}");
    }
}
