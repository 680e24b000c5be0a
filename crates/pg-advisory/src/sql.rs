//! The session-lock statements, each one round trip (sent with `query_typed`: no separate
//! prepare). The transaction-scoped statements are `lockstep-pg`'s, next to the queue that
//! runs them.
//!
//! Every lock statement calls the SQL function `lockstep_advisory_lock`, the one place the
//! protocol is written: for transaction-scoped locks it checks the isolation level **in the
//! same statement** and locks only under READ COMMITTED (a refused transaction holds nothing
//! and is not aborted); for a wait with a limit it sets `lock_timeout` for the wait and
//! restores it. The event store's `lockstep_lock_and_load` calls the same function.

/// `$1` key, `$2` lock_timeout (`NULL`: no limit) → acquired. A session lock, on a connection
/// outside any transaction block: the statement is its own implicit transaction, so a failed
/// wait takes the `lock_timeout` change with it.
pub(crate) const LOCK_SESSION: &str = "SELECT acquired FROM lockstep_advisory_lock(\
     p_key => $1, p_session => true, p_wait => true, p_lock_timeout => $2)";

/// `$1` key → acquired. Never waits.
pub(crate) const TRY_SESSION: &str = "SELECT acquired FROM lockstep_advisory_lock(\
     p_key => $1, p_session => true, p_wait => false, p_lock_timeout => NULL)";

/// The unlock of `key` → (whether it was held, whether the connection is inside a transaction
/// block), **to be sent as a simple query** (one message). Outside a block the statement is the
/// first command of its own transaction, and `transaction_timestamp()` equals
/// `statement_timestamp()`; inside one it is the time of the block's `BEGIN`. (With the
/// extended protocol the two differ even outside a block: Parse, Bind and Execute are
/// separate messages.)
pub(crate) fn unlock_session(key: i64) -> String {
    format!(
        "SELECT pg_advisory_unlock({key}::bigint), transaction_timestamp() <> statement_timestamp()"
    )
}

/// `$1` key → whether this session holds the session lock (its own row of `pg_locks`).
pub(crate) const IS_HELD_SESSION: &str = "SELECT EXISTS (SELECT 1 FROM pg_locks \
     WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted AND objsubid = 1 \
     AND mode = 'ExclusiveLock' \
     AND ((classid::bigint << 32) | objid::bigint) = $1)";
