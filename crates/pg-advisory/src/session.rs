//! Session-scoped advisory locks: a [`PgSessionGuard`] owns the pooled connection that holds
//! `pg_advisory_lock` until [`SessionLockGuard::release`] (unlock, then back to the pool) or
//! drop (the connection is detached from the pool and closed; the server releases the lock).
//!
//! Session locks need a session that stays the same: they do **not** work behind a
//! transaction-pooling proxy (PgBouncer `pool_mode = transaction`), which may run the unlock on
//! another server connection and hand the locked one to other clients. There every session
//! acquire refuses with [`ErrorKind::Unsupported`] naming the pooler, before anything is locked:
//! when the handle was built with `PgDatabaseBuilder::transaction_pooler(true)`, or when it was
//! not told and its probe before the first session lock
//! (`PgDatabase::detect_transaction_pooler`) sees one. Transaction-scoped locks work there.
//!
//! # A lock lost with its connection
//!
//! A session lock lives exactly as long as its connection. If the connection breaks (network,
//! server restart, `pg_terminate_backend`, `idle_session_timeout`), the server releases the
//! lock and another session can take it **while the guard still exists**: nothing tells the
//! guard by itself. Work that must not run without the lock asks before it commits:
//! [`PgSessionGuard::is_held`] checks `pg_locks` on the guard's own connection (one round
//! trip; `false` once the connection is gone), and [`PgSessionGuard::is_closed`] says, without
//! a round trip, whether the driver already knows the connection is gone. Even so, a check is a
//! moment in time: protect the critical writes themselves (a transaction-scoped lock or a
//! fencing token in the same transaction), or do them on the guard's own connection
//! ([`PgSessionGuard::client`]), where they fail together with the lock.
//!
//! # Transactions on the guard's connection
//!
//! The protected work may run on [`PgSessionGuard::client`], in transactions of its own; end
//! them before releasing. A release that finds the connection inside a transaction block (the
//! holder ran `BEGIN` and neither committed nor rolled back) unlocks, then **closes** the
//! connection instead of pooling it (the server rolls that transaction back), and reports
//! [`ErrorKind::Unsupported`]: a pooled connection in an open transaction would run the next
//! borrower's statements inside it.

use std::time::Duration;

use deadpool_postgres::Object;
use lockstep_core::{Error, ErrorKind, ResourceKey, Result, SessionLockGuard, SessionLocks};
use lockstep_pg::internal::{
    self, CancelOnDrop, column, kind_of, lock_error, lock_timeout_setting,
};
use tokio::time::Instant;
use tokio_postgres::types::Type;

use crate::lock::PgDistributedLock;
use crate::sql;

/// Holds one session advisory lock on its own pooled connection.
pub struct PgSessionGuard {
    // `None` only once released.
    conn: Option<Object>,
    key: ResourceKey,
}

impl std::fmt::Debug for PgSessionGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSessionGuard")
            .field("key", &self.key)
            .field("held", &self.conn.is_some())
            .finish()
    }
}

impl PgSessionGuard {
    /// The connection that holds the lock, e.g. to do the protected work on it. Do not end
    /// its session state (no `DISCARD ALL`, no `pg_advisory_unlock_all`), and end every
    /// transaction begun on it before [`SessionLockGuard::release`] (see the
    /// [module docs](self)).
    pub fn client(&self) -> &tokio_postgres::Client {
        match &self.conn {
            Some(conn) => conn,
            None => unreachable!("a guard is only without its connection inside release"),
        }
    }

    /// Whether the lock is still held, asked on the guard's own connection (`pg_locks`, one
    /// round trip). `Ok(false)` when the connection is gone (the server released the lock, or
    /// will once it notices) or the lock was released on it behind the guard's back
    /// (`pg_advisory_unlock_all`); an error only for failures that say nothing about the lock
    /// (e.g. the holder's transaction on this connection has failed: roll it back first).
    pub async fn is_held(&self) -> Result<bool> {
        let client = self.client();
        if client.is_closed() {
            return Ok(false);
        }
        match client
            .query_typed_one(
                sql::IS_HELD_SESSION,
                &[(&self.key.advisory_key(), Type::INT8)],
            )
            .await
        {
            Ok(row) => acquired(&row),
            Err(e) if kind_of(&e) == ErrorKind::ConnectionLost => Ok(false),
            Err(e) => Err(lock_error(e, &self.key, "checking session")),
        }
    }

    /// Whether the driver already knows the guard's connection is closed, without a round
    /// trip. `true` means the lock is lost; `false` proves nothing (a dead peer is noticed
    /// only when the connection is next used): ask [`PgSessionGuard::is_held`].
    pub fn is_closed(&self) -> bool {
        self.client().is_closed()
    }
}

impl Drop for PgSessionGuard {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Cannot unlock synchronously: never pool a connection that still holds the lock.
            let _ = Object::take(conn);
        }
    }
}

impl SessionLockGuard for PgSessionGuard {
    fn key(&self) -> &ResourceKey {
        &self.key
    }

    async fn release(mut self) -> Result<()> {
        let Some(conn) = self.conn.take() else {
            return Ok(());
        };
        let advisory = self.key.advisory_key();
        // One statement unlocks and says whether the connection is inside a transaction block:
        // sent as a simple query (one message), it is the first command of its own implicit
        // transaction, where transaction_timestamp() equals statement_timestamp() (PostgreSQL
        // documents it); after the holder's BEGIN it is BEGIN's time, an earlier message. The
        // key is an integer, written as a literal.
        let flags = match conn.simple_query(&sql::unlock_session(advisory)).await {
            Ok(messages) => unlock_outcome(&messages),
            Err(e) => Err(lock_error(e, &self.key, "releasing")),
        };
        if matches!(flags, Ok((true, false))) {
            drop(conn); // unlocked, idle: pooled again
        } else {
            // Not known to be unlocked outside a transaction block: never pool it (closing it
            // rolls back a transaction the holder left open).
            let _ = Object::take(conn);
        }
        unlocked(&self.key, flags)
    }
}

/// The outcome of a session unlock, from its two flags (whether the lock was held, whether the
/// connection was inside a transaction block), on either driver. The caller pools the
/// connection again only for `(true, false)`, and closes it otherwise.
pub(crate) fn unlocked(key: &ResourceKey, flags: Result<(bool, bool)>) -> Result<()> {
    match flags? {
        (true, false) => Ok(()),
        (held, true) => Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "session lock {key} {}, but its connection was inside a transaction block the \
                 holder never ended: the connection was closed (rolling that transaction back) \
                 instead of going back to the pool",
                if held {
                    "was released"
                } else {
                    "was no longer held at release"
                }
            ),
        )),
        (false, false) => Err(Error::new(
            ErrorKind::Backend,
            format!("session lock {key} was no longer held at release"),
        )),
    }
}

fn acquired(row: &tokio_postgres::Row) -> Result<bool> {
    column(row, 0)
}

/// (was held, inside a transaction block) from the unlock's simple-query answer.
fn unlock_outcome(messages: &[tokio_postgres::SimpleQueryMessage]) -> Result<(bool, bool)> {
    let flag = |row: &tokio_postgres::SimpleQueryRow, idx: usize| match row.try_get(idx) {
        Ok(Some("t")) => Ok(true),
        Ok(Some("f")) => Ok(false),
        _ => Err(Error::new(
            ErrorKind::Backend,
            "decoding the session unlock's result",
        )),
    };
    messages
        .iter()
        .find_map(|message| match message {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .ok_or_else(|| Error::new(ErrorKind::Backend, "the session unlock returned no row"))
        .and_then(|row| Ok((flag(row, 0)?, flag(row, 1)?)))
}

/// A connection waiting for a session lock: if dropped mid-wait, cancels the wait and closes
/// the connection instead of pooling it.
struct Waiting {
    conn: Option<Object>,
    cancel: Option<CancelOnDrop>,
}

impl Waiting {
    fn finish(mut self) -> Object {
        if let Some(cancel) = self.cancel.take() {
            cancel.disarm();
        }
        match self.conn.take() {
            Some(conn) => conn,
            None => unreachable!("taken only here"),
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        // Cancel first (the request goes out from a spawned task), then detach the connection.
        drop(self.cancel.take());
        if let Some(conn) = self.conn.take() {
            let _ = Object::take(conn);
        }
    }
}

impl PgDistributedLock {
    /// [`ErrorKind::Unsupported`] behind a transaction pooler (known, or seen by the probe the
    /// first time the handle is asked).
    async fn refuse_behind_transaction_pooler(&self) -> Result<()> {
        if self.pooler.detect(&self.pool, self.checkout_wait).await? {
            return Err(internal::session_state_refused(
                "a session-scoped advisory lock",
            ));
        }
        Ok(())
    }
}

impl SessionLocks for PgDistributedLock {
    type Guard = PgSessionGuard;

    async fn acquire_session(
        &self,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<PgSessionGuard> {
        let pool = &self.pool;
        if let Some(limit) = timeout {
            lock_timeout_setting(limit)?;
        }
        self.refuse_behind_transaction_pooler().await?;
        let advisory = key.advisory_key();
        let deadline = timeout.map(internal::deadline_after);
        // Queue in process before taking a connection: local waiters hold no connection.
        let (conn, outcome) = internal::in_turn(&self.queue, advisory, deadline, || async {
            let wait = deadline.map_or(self.checkout_wait, |d| {
                self.checkout_wait
                    .min(d.saturating_duration_since(Instant::now()))
            });
            let conn = lockstep_pg::checkout(pool, wait).await?;
            let cancel = internal::cancel_on_drop(&self.queue, conn.cancel_token());
            let waiting = Waiting {
                conn: Some(conn),
                cancel: Some(cancel),
            };
            let lock_timeout = deadline
                .map(|d| lock_timeout_setting(d.saturating_duration_since(Instant::now())))
                .transpose()?;
            let outcome = match waiting.conn.as_deref() {
                Some(client) => {
                    client
                        .query_typed_one(
                            sql::LOCK_SESSION,
                            &[(&advisory, Type::INT8), (&lock_timeout, Type::TEXT)],
                        )
                        .await
                }
                None => unreachable!("set above"),
            };
            Ok::<_, Error>((waiting.finish(), outcome))
        })
        .await?;
        match outcome {
            Ok(_) => Ok(PgSessionGuard {
                conn: Some(conn),
                key: key.clone(),
            }),
            Err(e) => {
                // A lock timeout leaves a clean, idle connection; anything else is not
                // worth trusting.
                if kind_of(&e) != ErrorKind::LockTimeout {
                    let _ = Object::take(conn);
                }
                Err(lock_error(e, key, "waiting for session"))
            }
        }
    }

    async fn try_acquire_session(&self, key: &ResourceKey) -> Result<Option<PgSessionGuard>> {
        self.refuse_behind_transaction_pooler().await?;
        let conn = lockstep_pg::checkout(&self.pool, self.checkout_wait).await?;
        let advisory = key.advisory_key();
        let outcome = match conn
            .query_typed_one(sql::TRY_SESSION, &[(&advisory, Type::INT8)])
            .await
        {
            Ok(row) => acquired(&row),
            Err(e) => Err(lock_error(e, key, "trying session")),
        };
        match outcome {
            Ok(true) => Ok(Some(PgSessionGuard {
                conn: Some(conn),
                key: key.clone(),
            })),
            Ok(false) => Ok(None),
            Err(e) => {
                // Possibly holding the lock: never pool it.
                let _ = Object::take(conn);
                Err(e)
            }
        }
    }
}
