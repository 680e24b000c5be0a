//! Transactions as the Postgres backends see them.
//!
//! [`PgTransaction`] owns its pooled connection, so it is `'static` and a handler holding it can
//! be spawned. It runs at READ COMMITTED (lock-then-load needs each statement to see the latest
//! committed data). It is a guard ([`lockstep_core::Transaction`]): `commit(self)`,
//! `rollback(self)`, and dropped open it is rolled back — in the background, the connection
//! pooled again only once the server confirmed the `ROLLBACK` (within
//! [`DROPPED_ROLLBACK_WAIT`], else it is closed; without a tokio runtime it is closed at once).
//! It is never returned to the pool mid-transaction. It is the transaction the contracts that **wait for a lock** are implemented for
//! (`DistributedLock`, `EventStore` with its `load_locked`): a wait that is abandoned is ended
//! with a cancel request, which can arrive late — after the statement ended — and so must not
//! find the connection serving anyone else. A [`PgTransaction`] then closes its connection when
//! it ends instead of pooling it. A borrowed transaction cannot promise that (its connection
//! goes back to whoever lent it), so the waiting contracts are not implemented for one: it
//! does not compile, rather than relying on every caller to discard the connection by hand.
//!
//! **The last write travels with the `COMMIT`.** [`PgTransaction::write_at_commit`] holds a
//! write back until [`PgTransaction::commit`], which sends it and the `COMMIT` together, in one
//! round trip (pipelined: tokio-postgres sends both before it reads either reply). A failed
//! write turns the `COMMIT` into a rollback at the server (a `COMMIT` in a failed transaction
//! rolls back), so nothing is lost by not waiting for the write's reply first: the commit reports
//! the write's error and the transaction is over. `lockstep_pg_store::PgEventStore` builds
//! `EventStore::append_at_commit` on it: for a unit of work under a per-aggregate lock, the lock
//! is held for one round trip less.
//!
//! **The `BEGIN` travels with the first statement.** [`PgTransaction::begin_on`] hands `BEGIN`
//! to the connection and returns without waiting for its reply; the transaction's first
//! statement follows it on the wire (tokio-postgres sends requests in order), so a unit of work
//! pays no round trip of its own for `BEGIN` (ADR 0024). Its reply is read, already there by
//! then, when the transaction ends: [`Transaction::commit`] and [`Transaction::rollback`] report
//! a `BEGIN` the server refused — which leaves a statement sent after it outside any transaction
//! — as [`ErrorKind::CommitUnknown`]. On an idle pooled session that takes running out of
//! memory, or a cancel request that arrives while `BEGIN` itself runs (an abandoned lock wait's,
//! sent the moment its statement is dropped); a lost connection fails every statement after it
//! as well. The reply is at most two messages, which tokio-postgres buffers per request, so an
//! unread reply never holds up the replies after it.
//!
//! **A connection to a server that cannot write is not pooled again.** Every `ROLLBACK` asks, in
//! the same round trip, whether the server still accepts writes (`transaction_read_only`); a
//! standby, or a primary made read-only to fence it during a switchover, gets its connection
//! closed, so the next checkout connects anew — with `target_session_attrs=read-write`, to the
//! primary.
//!
//! [`PgTransactionRef`] is the view that statements which never wait for a lock take (event
//! store load and append, the lease fence), so they also run on a transaction the application
//! manages itself: a borrowed `tokio_postgres::Transaction` or `deadpool_postgres::Transaction`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use futures_util::StreamExt as _;
use lockstep_core::{Error, ErrorKind, Result, Transaction};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, GenericClient, Row, SimpleQueryStream};

use crate::error::map_error;

/// A transaction that statements which never wait for a lock can run on: the owned
/// [`PgTransaction`], or one the application manages itself — `&tokio_postgres::Transaction`
/// or `&deadpool_postgres::Transaction`.
///
/// The contracts that wait for a lock (`DistributedLock`, `EventStore::load_locked`) take a
/// [`PgTransaction`] only (see the [module docs](self)).
pub trait PgTransactionRef: Send + Sync {
    /// The statement executor (the transaction itself, or the connection it runs on).
    type Executor: GenericClient + Sync;

    /// Where to send statements that belong to this transaction.
    fn executor(&self) -> &Self::Executor;

    /// Runs `sql` as this transaction's last statement and commits: the statement's rows once
    /// committed. A statement that fails at the server leaves nothing of the transaction
    /// committed and returns its error mapped by `map_error` (a lost connection is not passed
    /// to it). The default runs the statement, then commits: two round trips.
    /// [`PgTransaction`] sends both in one ([`PgTransaction::commit_returning`], which says what
    /// a caller must know about it).
    fn commit_returning<'a>(
        self,
        sql: &'a str,
        params: &'a [(&'a (dyn ToSql + Sync), Type)],
        map_error: impl FnOnce(tokio_postgres::Error) -> Error + Send + 'a,
    ) -> impl Future<Output = Result<Vec<Row>>> + Send + 'a
    where
        Self: Transaction,
    {
        async move {
            let rows = match self.executor().query_typed(sql, params).await {
                Ok(rows) => rows,
                Err(e) => {
                    let err = if crate::error::kind_of(&e) == ErrorKind::ConnectionLost {
                        crate::error::map_error(e, "running a transaction's last statement")
                    } else {
                        map_error(e)
                    };
                    // The transaction ends either way (dropping it rolls it back); its
                    // statement's error says why.
                    drop(self);
                    return Err(err);
                }
            };
            self.commit().await?;
            Ok(rows)
        }
    }
}

impl PgTransactionRef for tokio_postgres::Transaction<'_> {
    type Executor = Self;

    fn executor(&self) -> &Self {
        self
    }
}

impl<'a> PgTransactionRef for deadpool_postgres::Transaction<'a> {
    type Executor = tokio_postgres::Transaction<'a>;

    fn executor(&self) -> &tokio_postgres::Transaction<'a> {
        self
    }
}

/// A write held back until commit ([`PgTransaction::write_at_commit`]): one statement with its
/// parameters, sent with `tokio_postgres::Client::query_typed` — parse, bind and execute in a
/// single message, so it is sure to reach the server before the `COMMIT` that follows it (a
/// statement that needed a prepare round trip first would let the `COMMIT` overtake it and run
/// outside the transaction; that is why this is a statement and not a closure).
///
/// ```
/// use lockstep_core::{Error, ErrorKind};
/// use lockstep_pg::WriteAtCommit;
/// use tokio_postgres::types::Type;
///
/// let write = WriteAtCommit::new("UPDATE stock SET reserved = reserved + $1 WHERE sku = $2")
///     .bind(1_i32, Type::INT4)
///     .bind(7_i64, Type::INT8)
///     .map_error(|e| Error::new(ErrorKind::Backend, "reserving stock").with_source(e));
/// # let _ = write;
/// ```
pub struct WriteAtCommit {
    sql: String,
    params: Vec<(Box<dyn ToSql + Send + Sync>, Type)>,
    map_error: Box<dyn FnOnce(tokio_postgres::Error) -> Error + Send + Sync>,
}

impl std::fmt::Debug for WriteAtCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteAtCommit")
            .field("sql", &self.sql)
            .field("params", &self.params.len())
            .finish()
    }
}

impl WriteAtCommit {
    /// The statement `sql` (`$1`, `$2`, … for the parameters bound next). A server error is
    /// reported by the commit with the kind of its SQLSTATE unless [`WriteAtCommit::map_error`]
    /// says otherwise.
    pub fn new(sql: impl Into<String>) -> WriteAtCommit {
        WriteAtCommit {
            sql: sql.into(),
            params: Vec::new(),
            map_error: Box::new(|e| map_error(e, "running a write held back until commit")),
        }
    }

    /// Binds the next parameter, with its type (no prepare round trip is spent to learn it).
    #[must_use]
    pub fn bind<T: ToSql + Send + Sync + 'static>(mut self, value: T, ty: Type) -> Self {
        self.params.push((Box::new(value), ty));
        self
    }

    /// How a server error of the statement becomes the commit's error (e.g. a unique violation
    /// that means a version conflict). A lost connection is never passed here: it is the
    /// commit's [`ErrorKind::CommitUnknown`].
    #[must_use]
    pub fn map_error(
        mut self,
        f: impl FnOnce(tokio_postgres::Error) -> Error + Send + Sync + 'static,
    ) -> Self {
        self.map_error = Box::new(f);
        self
    }
}

/// A statement's reply: its rows, or why it failed.
type StatementOutcome = std::result::Result<Vec<Row>, tokio_postgres::Error>;

/// How a statement's server error becomes the caller's error.
type StatementErrorMap<'a> = Box<dyn FnOnce(tokio_postgres::Error) -> Error + Send + 'a>;

/// The statement [`PgTransaction::commit_returning`] sends with the `COMMIT`.
struct LastStatement<'a> {
    sql: &'a str,
    params: &'a [(&'a (dyn ToSql + Sync), Type)],
    map_error: StatementErrorMap<'a>,
}

/// An owned READ COMMITTED transaction on a pooled connection.
pub struct PgTransaction {
    // `None` once committed or rolled back.
    conn: Option<Object>,
    // Set when a cancel request may still arrive for this connection: close it at the end.
    discard: AtomicBool,
    // Writes held back until commit, in the order given.
    at_commit: Mutex<Vec<WriteAtCommit>>,
    // The reply to `BEGIN`, not read yet (module docs); `None` once read.
    begin: Mutex<Option<Pin<Box<SimpleQueryStream>>>>,
    // Advisory keys this transaction took through lockstep (the in-process queue must not make
    // a transaction wait behind a waiter that waits for it). Only ever grows: a lock released by
    // rolling back to a savepoint is still listed, which costs the queue, never correctness.
    held_keys: Mutex<Vec<i64>>,
}

impl std::fmt::Debug for PgTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTransaction")
            .field("open", &self.conn.is_some())
            .finish()
    }
}

impl PgTransaction {
    /// Checks a connection out of `pool` (waiting at most
    /// [`DEFAULT_CHECKOUT_WAIT`](crate::DEFAULT_CHECKOUT_WAIT) for one) and begins a READ
    /// COMMITTED transaction on it.
    pub async fn begin(pool: &Pool) -> Result<PgTransaction> {
        PgTransaction::begin_within(pool, crate::DEFAULT_CHECKOUT_WAIT).await
    }

    /// Like [`PgTransaction::begin`], waiting at most `wait` for a connection (an exhausted
    /// pool is a retryable [`ErrorKind::ConnectionLost`]; see [`crate::pool`]).
    pub async fn begin_within(pool: &Pool, wait: std::time::Duration) -> Result<PgTransaction> {
        let conn = crate::pool::checkout(pool, wait).await?;
        PgTransaction::begin_on(conn).await
    }

    /// Begins a READ COMMITTED transaction on a connection already checked out: hands `BEGIN`
    /// to the connection without waiting for the server's reply, which the transaction reads
    /// when it ends (module docs). Fails only when the connection is already closed.
    ///
    /// Cancel-safe: it does not wait for the server; dropped before it returns, the
    /// connection (which may be inside the new transaction by then) is closed, never pooled.
    pub async fn begin_on(conn: Object) -> Result<PgTransaction> {
        let mut conn = DetachOnDrop(Some(conn));
        // Hands the request to the connection and returns: no reply is awaited here.
        let begin = match conn
            .client()
            .simple_query_raw("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
        {
            Ok(reply) => reply,
            // The connection is gone: never pool it. The guard closes it.
            Err(e) => return Err(map_error(e, "beginning a transaction")),
        };
        Ok(PgTransaction {
            conn: Some(conn.disarm()),
            discard: AtomicBool::new(false),
            at_commit: Mutex::new(Vec::new()),
            begin: Mutex::new(Some(Box::pin(begin))),
            held_keys: Mutex::new(Vec::new()),
        })
    }

    /// Reads the reply to `BEGIN` (there already once any later statement has answered): the
    /// server's refusal, if it refused. A lost connection is not reported here: every
    /// statement after `BEGIN` failed with it too, and the end of the transaction says so.
    async fn begin_refused(&self) -> Option<tokio_postgres::Error> {
        let mut reply = lock(&self.begin).take()?;
        while let Some(message) = reply.next().await {
            if let Err(e) = message {
                return (crate::error::kind_of(&e) != ErrorKind::ConnectionLost).then_some(e);
            }
        }
        None
    }

    /// [`PgTransaction::begin_refused`] without waiting, where the transaction ends without a
    /// reply to wait for (a closed or discarded connection): what has arrived of the reply.
    fn begin_refused_now(&self) -> Option<tokio_postgres::Error> {
        futures_util::FutureExt::now_or_never(self.begin_refused()).flatten()
    }

    /// The connection the transaction runs on.
    pub fn client(&self) -> &Client {
        // Invariant: `conn` is `Some` for as long as `self` is reachable (commit and rollback
        // take `self` by value).
        match &self.conn {
            Some(conn) => conn,
            None => unreachable!("PgTransaction used after it ended"),
        }
    }

    /// Holds `write` back until [`PgTransaction::commit`], which sends it together with the
    /// `COMMIT`, in one round trip (several such writes go in the order given, all in that one
    /// trip). Meant for a unit of work's **last** write: statements run on the transaction after
    /// this call run *before* the write, and do not see it.
    ///
    /// The write's outcome is the commit's: if it fails, the server rolls the transaction back
    /// (a `COMMIT` in a failed transaction rolls back) and `commit` returns the write's error —
    /// a version conflict stays a retryable [`ErrorKind::Conflict`]. A rollback or a drop
    /// discards held-back writes unsent.
    ///
    /// ```no_run
    /// # async fn demo(pool: deadpool_postgres::Pool) -> lockstep_core::Result<()> {
    /// use lockstep_core::Transaction as _; // commit
    /// use lockstep_pg::{PgTransaction, WriteAtCommit};
    /// use tokio_postgres::types::Type;
    ///
    /// let tx = PgTransaction::begin(&pool).await?;
    /// // … lock, load, decide …
    /// tx.write_at_commit(
    ///     WriteAtCommit::new("UPDATE stock SET reserved = reserved + 1 WHERE sku = $1")
    ///         .bind(7_i64, Type::INT8),
    /// );
    /// tx.commit().await?; // the UPDATE and the COMMIT in one round trip
    /// # Ok(()) }
    /// ```
    pub fn write_at_commit(&self, write: WriteAtCommit) {
        lock(&self.at_commit).push(write);
    }

    /// How many writes are held back until commit.
    pub fn writes_at_commit(&self) -> usize {
        lock(&self.at_commit).len()
    }

    /// Sends `sql` as the transaction's **last** statement together with the `COMMIT`, in one
    /// round trip (after any write held back by [`PgTransaction::write_at_commit`]), and returns
    /// the statement's rows once the transaction committed. It is sent with
    /// `tokio_postgres::Client::query_typed` (parse, bind and execute in one message, so it
    /// reaches the server before the `COMMIT`), the parameters with their types.
    ///
    /// For a last write whose answer the caller needs. A statement that fails at the server
    /// makes the `COMMIT` a rollback: the error is the statement's, mapped by `map_error`
    /// (a lost connection is not passed to it), and nothing of the transaction is committed.
    /// So a statement that *refuses* (a compare-and-set that lost, say) must raise an error to
    /// keep the rest of the transaction from committing; rows that say "refused" come back
    /// committed. Otherwise the outcomes of [`Transaction::commit`]: a lost connection while
    /// the `COMMIT` was in flight is [`ErrorKind::CommitUnknown`]. Cancel-safe as `commit`.
    pub async fn commit_returning(
        self,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
        map_error: impl FnOnce(tokio_postgres::Error) -> Error + Send,
    ) -> Result<Vec<Row>> {
        self.commit_now_with(Some(LastStatement {
            sql,
            params,
            map_error: Box::new(map_error),
        }))
        .await
    }

    /// The commit of [`Transaction::commit`] (documented there, for this type).
    async fn commit_now(self) -> Result<()> {
        self.commit_now_with(None).await.map(drop)
    }

    /// The commit, with `last` sent just before the `COMMIT`: its rows (none without it).
    async fn commit_now_with(mut self, last: Option<LastStatement<'_>>) -> Result<Vec<Row>> {
        let Some(conn) = self.conn.take() else {
            return Ok(Vec::new());
        };
        let writes = std::mem::take(&mut *lock(&self.at_commit));
        if conn.is_closed() {
            // Nothing was sent: the server ended the transaction with the connection — unless
            // it had refused BEGIN, and what ran after it is applied.
            let _ = Object::take(conn);
            if let Some(refused) = self.begin_refused_now() {
                return Err(refused_begin(refused));
            }
            return Err(Error::new(
                ErrorKind::ConnectionLost,
                "committing: the connection was lost before COMMIT was sent; the transaction \
                 was rolled back by the server",
            ));
        }
        let conn = DetachOnDrop(Some(conn));
        if writes.is_empty() && last.is_none() {
            self.commit_alone(conn).await.map(|()| Vec::new())
        } else {
            self.commit_with(conn, writes, last).await
        }
    }

    async fn commit_alone(&self, mut conn: DetachOnDrop) -> Result<()> {
        // COMMIT of a failed transaction "succeeds" (the server answers ROLLBACK), so probe
        // first in the same round trip: in a failed transaction `SELECT 1` errors with 25P02
        // and the rest of the batch, COMMIT included, is skipped.
        let (refused, committed) = futures_util::future::join(
            self.begin_refused(),
            conn.client().batch_execute("SELECT 1; COMMIT"),
        )
        .await;
        if let Some(e) = refused {
            return self.ran_outside_a_transaction(conn, e).await;
        }
        match committed {
            Ok(()) => {
                self.release(conn.disarm());
                Ok(())
            }
            Err(e) => {
                let kind = crate::error::kind_of(&e);
                if kind == ErrorKind::ConnectionLost {
                    // The COMMIT went out (or may have) and no answer came back.
                    return Err(commit_unknown(e));
                }
                // Never pool a connection still inside a transaction.
                self.roll_back_and_release(conn).await;
                if kind == ErrorKind::TransactionAborted {
                    Err(Error::new(
                        ErrorKind::TransactionAborted,
                        "the transaction had failed and was rolled back instead of committed",
                    )
                    .with_source(e))
                } else {
                    Err(map_error(e, "committing"))
                }
            }
        }
    }

    /// The held-back writes, then `last`, and the `COMMIT`, pipelined; `last`'s rows. No probe
    /// is needed: a write that succeeds proves the transaction had not failed before it (in a
    /// failed transaction every statement errors with 25P02), and a write that fails makes the
    /// `COMMIT` a rollback.
    async fn commit_with(
        &self,
        mut conn: DetachOnDrop,
        writes: Vec<WriteAtCommit>,
        last: Option<LastStatement<'_>>,
    ) -> Result<Vec<Row>> {
        let client = conn.client();
        // `join_all` and `join` poll in order, and `query_typed` hands its whole statement to
        // the connection on its first poll: the writes reach the server before the COMMIT, all
        // before any reply is awaited — one round trip.
        let params: Vec<Vec<(&(dyn ToSql + Sync), Type)>> = writes
            .iter()
            .map(|write| {
                write
                    .params
                    .iter()
                    .map(|(value, ty)| (&**value as &(dyn ToSql + Sync), ty.clone()))
                    .collect()
            })
            .collect();
        let (last_sent, last_map) = match last {
            Some(LastStatement {
                sql,
                params,
                map_error,
            }) => (Some((sql, params)), Some(map_error)),
            None => (None, None),
        };
        let mut sent: Vec<_> = writes
            .iter()
            .zip(&params)
            .map(|(write, params)| (write.sql.as_str(), params.as_slice()))
            .chain(last_sent)
            .map(|(sql, params)| Box::pin(client.query_typed(sql, params)))
            .collect();
        // Each statement is handed to the connection on its first poll — or refused there by
        // the client, unsent (a parameter that cannot be encoded). Then no COMMIT may follow:
        // it would commit the rest of the transaction without the statement.
        let mut early: Vec<Option<StatementOutcome>> = sent.iter().map(|_| None).collect();
        std::future::poll_fn(|cx| {
            for (slot, statement) in early.iter_mut().zip(sent.iter_mut()) {
                if let std::task::Poll::Ready(outcome) = statement.as_mut().poll(cx) {
                    *slot = Some(outcome);
                }
            }
            std::task::Poll::Ready(())
        })
        .await;
        if let Some(unsent) = early.iter_mut().find_map(|slot| match slot.take() {
            Some(Err(e)) if e.as_db_error().is_none() && !e.is_closed() => Some(e),
            other => {
                *slot = other;
                None
            }
        }) {
            // The statements sent before it run ahead of the ROLLBACK; their replies are
            // discarded by the connection.
            drop(sent);
            let refused = self.begin_refused().await;
            if let Some(e) = refused {
                return self
                    .ran_outside_a_transaction(conn, e)
                    .await
                    .map(|()| Vec::new());
            }
            self.roll_back_and_release(conn).await;
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "a statement sent with the commit could not be encoded (a parameter of the \
                 wrong type?): it was not sent, and the transaction was rolled back",
            )
            .with_source(unsent));
        }
        let statements = sent
            .into_iter()
            .zip(early)
            .map(|(statement, early)| async move {
                match early {
                    Some(outcome) => outcome,
                    None => statement.await,
                }
            });
        let (refused, (outcomes, commit)) = futures_util::future::join(
            self.begin_refused(),
            futures_util::future::join(
                futures_util::future::join_all(statements),
                client.batch_execute("COMMIT"),
            ),
        )
        .await;
        if let Some(e) = refused {
            return self
                .ran_outside_a_transaction(conn, e)
                .await
                .map(|()| Vec::new());
        }
        // The first failed statement's error, in its caller's terms (a lost connection stays
        // one); the last statement's rows.
        let last_at = last_map.is_some().then_some(writes.len());
        let mappers = writes
            .into_iter()
            .map(|write| -> StatementErrorMap<'_> { write.map_error })
            .chain(last_map);
        let (mut rows, mut failed) = (Vec::new(), None);
        for (at, (outcome, map)) in outcomes.into_iter().zip(mappers).enumerate() {
            match outcome {
                Ok(got) if Some(at) == last_at => rows = got,
                Ok(_) => {}
                Err(e) if failed.is_none() => {
                    failed = Some(if crate::error::kind_of(&e) == ErrorKind::ConnectionLost {
                        map_error(e, "running a write held back until commit")
                    } else {
                        map(e)
                    });
                }
                Err(_) => {}
            }
        }
        match (failed, commit) {
            (None, Ok(())) => {
                self.release(conn.disarm());
                Ok(rows)
            }
            // A write failed at the server: the COMMIT rolled the transaction back. A server
            // that cannot write (a lost connection's kind) does not get the connection back.
            (Some(write_error), Ok(())) => {
                if write_error.kind() != ErrorKind::ConnectionLost {
                    self.release(conn.disarm());
                }
                Err(write_error)
            }
            (failed, Err(e)) => {
                let kind = crate::error::kind_of(&e);
                match failed {
                    // The server refused a write, so whatever became of the COMMIT it could not
                    // commit: the outcome is known even if the connection then went.
                    Some(write_error) if write_error.kind() != ErrorKind::ConnectionLost => {
                        if kind != ErrorKind::ConnectionLost {
                            self.roll_back_and_release(conn).await;
                        }
                        Err(write_error)
                    }
                    _ if kind == ErrorKind::ConnectionLost => Err(commit_unknown(e)),
                    _ => {
                        // The COMMIT itself failed at the server (a deferred constraint, a
                        // serialization failure): the transaction is over; make sure before
                        // pooling the connection.
                        self.roll_back_and_release(conn).await;
                        Err(map_error(e, "committing"))
                    }
                }
            }
        }
    }

    /// The end of a transaction whose `BEGIN` the server refused: whatever was sent after it
    /// ran outside any transaction, each statement on its own, so nobody can say what of it
    /// took effect ([`ErrorKind::CommitUnknown`]). The connection is pooled only after a
    /// `ROLLBACK` succeeded.
    async fn ran_outside_a_transaction(
        &self,
        conn: DetachOnDrop,
        refused: tokio_postgres::Error,
    ) -> Result<()> {
        self.roll_back_and_release(conn).await;
        Err(refused_begin(refused))
    }

    /// Sends `ROLLBACK` (harmless when no transaction is open) and pools the connection, or
    /// closes it if that fails.
    async fn roll_back_and_release(&self, mut conn: DetachOnDrop) {
        if matches!(roll_back(conn.client()).await, Ok(Writable::Yes)) {
            self.release(conn.disarm());
        }
        // Otherwise the guard closes the connection.
    }

    /// The rollback of [`Transaction::rollback`].
    async fn rollback_now(mut self) -> Result<()> {
        let Some(conn) = self.conn.take() else {
            return Ok(());
        };
        if conn.is_closed() {
            // The server rolled back when the connection went: nothing left to do (unless it
            // had refused BEGIN).
            let _ = Object::take(conn);
            if let Some(refused) = self.begin_refused_now() {
                return Err(refused_begin(refused));
            }
            return Err(Error::new(
                ErrorKind::ConnectionLost,
                "rolling back: the connection was lost (the server rolled the transaction back)",
            ));
        }
        if self.discard.load(Ordering::Acquire) {
            // An abandoned lock wait's cancel requests may still arrive (they are re-sent for a
            // while) and would cancel the ROLLBACK: close the connection instead — the server
            // rolls the transaction back when it goes. One of them may have hit BEGIN itself:
            // what has arrived of its reply says so.
            let refused = self.begin_refused_now();
            let _ = Object::take(conn);
            return refused.map_or(Ok(()), |e| Err(refused_begin(e)));
        }
        // A connection whose ROLLBACK fails or is dropped mid-flight is closed, never pooled.
        let mut conn = DetachOnDrop(Some(conn));
        let (refused, rolled_back) =
            futures_util::future::join(self.begin_refused(), roll_back(conn.client())).await;
        if let Some(e) = refused {
            // Reported before a failed ROLLBACK: it says more (what ran may be applied).
            if matches!(rolled_back, Ok(Writable::Yes)) {
                self.release(conn.disarm());
            }
            return Err(refused_begin(e));
        }
        match rolled_back {
            Ok(Writable::Yes) => self.release(conn.disarm()),
            // Rolled back; the guard closes the connection to a server that cannot write.
            Ok(Writable::No) => {}
            Err(e) => return Err(map_error(e, "rolling back")),
        }
        Ok(())
    }

    /// Returns the connection to the pool, or closes it if a late cancel request may hit it
    /// (or it is already closed).
    fn release(&self, conn: Object) {
        if self.discard.load(Ordering::Acquire) || conn.is_closed() {
            let _ = Object::take(conn);
        }
    }
}

/// The guard contract: [`PgTransaction`] is the `Tx` of [`crate::PgDatabase`].
impl Transaction for PgTransaction {
    /// Commits. Transaction-scoped locks are released by the server. A transaction that had
    /// failed is rolled back by the server instead, reported as
    /// [`ErrorKind::TransactionAborted`]. Writes held back by
    /// [`PgTransaction::write_at_commit`] are sent first, in the same round trip as the
    /// `COMMIT`; if one fails, the transaction is rolled back and its error returned.
    ///
    /// If the connection is lost while the `COMMIT` is in flight, nobody can say whether the
    /// server committed (it may have, and only the reply was lost): that is
    /// [`ErrorKind::CommitUnknown`], which is **not** retryable — running the unit of work again
    /// could apply it twice. Check what was written (event-store appends are idempotent by
    /// event id, so re-appending the same events is safe). A connection already known to be
    /// lost before the `COMMIT` was sent is [`ErrorKind::ConnectionLost`] (retryable: the
    /// server rolled the transaction back).
    ///
    /// Cancel-safe: dropped while the `COMMIT` is in flight, the connection is closed, never
    /// pooled (its transaction may still be open, aborted).
    fn commit(self) -> impl Future<Output = Result<()>> + Send {
        self.commit_now()
    }

    /// Rolls back. Transaction-scoped locks are released by the server. A connection that
    /// fails here is closed, never pooled; so is one on which an abandoned lock wait's cancel
    /// request may still arrive (the server rolls back when it goes).
    fn rollback(self) -> impl Future<Output = Result<()>> + Send {
        self.rollback_now()
    }
}

/// How long a transaction dropped open waits for its `ROLLBACK` before its connection is closed
/// instead of pooled (a statement dropped mid-flight is still running ahead of it).
pub const DROPPED_ROLLBACK_WAIT: Duration = Duration::from_secs(5);

/// Whether the server behind a connection accepts writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writable {
    Yes,
    /// A standby, or a primary made read-only (`default_transaction_read_only`, as a
    /// switchover may do to fence the old primary): its connection must not be pooled again,
    /// so that the next checkout connects anew (and, with `target_session_attrs=read-write`,
    /// finds the primary).
    No,
}

/// `ROLLBACK` (harmless when no transaction is open), and in the same round trip whether the
/// server still accepts writes: a connection is pooled again only if it does.
async fn roll_back(client: &tokio_postgres::Client) -> Result<Writable, tokio_postgres::Error> {
    let messages = client
        .simple_query("ROLLBACK; SELECT current_setting('transaction_read_only')")
        .await?;
    let read_only = messages.iter().any(|message| match message {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0) == Some("on"),
        _ => false,
    });
    Ok(if read_only {
        Writable::No
    } else {
        Writable::Yes
    })
}

impl Drop for PgTransaction {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        // Never hand a connection back to the pool inside an open transaction (it may hold
        // locks or be waiting for one). On a tokio runtime, roll back in the background and
        // pool the connection once the server confirms (sqlx queues its rollback the same
        // way); a late cancel request may still hit a connection whose lock wait was
        // abandoned, so that one is closed — as is every connection when there is no runtime
        // to roll back on. Closed, the server rolls back when it notices.
        if self.discard.load(Ordering::Acquire) || conn.is_closed() {
            let _ = Object::take(conn);
            return;
        }
        let mut conn = DetachOnDrop(Some(conn));
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let rolled_back =
                        tokio::time::timeout(DROPPED_ROLLBACK_WAIT, roll_back(conn.client())).await;
                    if matches!(rolled_back, Ok(Ok(Writable::Yes))) {
                        drop(conn.disarm()); // back to the pool, outside any transaction
                    }
                    // Otherwise (or if this task is dropped) the guard closes the connection.
                });
            }
            Err(_) => drop(conn),
        }
    }
}

impl PgTransaction {
    /// Records that this transaction holds the advisory lock `key` (taken through lockstep).
    pub(crate) fn note_lock_held(&self, key: i64) {
        let mut held = lock(&self.held_keys);
        if !held.contains(&key) {
            held.push(key);
        }
    }

    /// Whether this transaction took the advisory lock `key` through lockstep.
    pub(crate) fn holds_lock(&self, key: i64) -> bool {
        lock(&self.held_keys).contains(&key)
    }

    /// Called when a lock wait on this transaction was abandoned and a cancel request for its
    /// connection may still be in flight: the connection is closed when the transaction ends
    /// instead of being returned to the pool.
    pub(crate) fn discard_connection_after_end(&self) {
        self.discard.store(true, Ordering::Release);
    }
}

impl PgTransactionRef for PgTransaction {
    type Executor = Client;

    fn executor(&self) -> &Client {
        self.client()
    }

    /// The statement and the `COMMIT` in one round trip ([`PgTransaction::commit_returning`]).
    fn commit_returning<'a>(
        self,
        sql: &'a str,
        params: &'a [(&'a (dyn ToSql + Sync), Type)],
        map_error: impl FnOnce(tokio_postgres::Error) -> Error + Send + 'a,
    ) -> impl Future<Output = Result<Vec<Row>>> + Send + 'a
    where
        Self: Transaction,
    {
        PgTransaction::commit_returning(self, sql, params, map_error)
    }
}

/// Locks `mutex`; a panic elsewhere while it was held leaves plain data behind, still usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The error for a `BEGIN` the server refused (module docs): the statements after it ran on
/// their own, so what of them took effect is unknown — except when the session was inside a
/// failed transaction (25P02, a connection handed to [`PgTransaction::begin_on`] in that
/// state): then every statement after `BEGIN` failed as well and nothing ran.
fn refused_begin(refused: tokio_postgres::Error) -> Error {
    if crate::error::kind_of(&refused) == ErrorKind::TransactionAborted {
        return Error::new(
            ErrorKind::TransactionAborted,
            "the connection was inside a failed transaction, so BEGIN and every statement \
             after it were refused: nothing ran",
        )
        .with_source(refused);
    }
    Error::new(
        ErrorKind::CommitUnknown,
        "the server refused BEGIN: the statements of this unit of work ran outside a \
         transaction, so some may have taken effect; check what was written",
    )
    .with_source(refused)
}

/// The error of a `COMMIT` whose reply never came: it may or may not have committed.
fn commit_unknown(e: tokio_postgres::Error) -> Error {
    Error::new(
        ErrorKind::CommitUnknown,
        "the connection was lost while COMMIT was in flight: the transaction may or may not \
         have committed",
    )
    .with_source(e)
}

/// A connection being committed: closed, never pooled, if the commit is dropped mid-flight
/// (its transaction may still be open) or ends in an unknown state.
struct DetachOnDrop(Option<Object>);

impl DetachOnDrop {
    fn client(&self) -> &Client {
        match &self.0 {
            Some(conn) => conn,
            None => unreachable!("DetachOnDrop used after disarm"),
        }
    }

    fn disarm(&mut self) -> Object {
        match self.0.take() {
            Some(conn) => conn,
            None => unreachable!("DetachOnDrop disarmed twice"),
        }
    }
}

impl Drop for DetachOnDrop {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            let _ = Object::take(conn);
        }
    }
}
