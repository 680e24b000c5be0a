//! The statements, each one round trip (sent with `query_typed`: no separate prepare).
//!
//! Transaction-scoped statements check the isolation level **in the same statement** and take
//! the lock only under READ COMMITTED (`CASE` evaluates its branch lazily, and the lock
//! functions are volatile, so they are never folded at plan time): a refused transaction holds
//! nothing and is not aborted.

/// `transaction_isolation` of a READ COMMITTED transaction.
pub(crate) const READ_COMMITTED: &str = "read committed";
/// PostgreSQL runs READ UNCOMMITTED as READ COMMITTED.
pub(crate) const READ_UNCOMMITTED: &str = "read uncommitted";

/// `$1` key → (isolation, '' when locked).
pub(crate) const LOCK_XACT: &str = "SELECT current_setting('transaction_isolation'), \
     CASE WHEN current_setting('transaction_isolation') IN ('read committed', 'read uncommitted') \
     THEN pg_advisory_xact_lock($1)::text END";

/// `$1` key, `$2` lock_timeout → (isolation, restored lock_timeout). `lock_timeout` is set
/// transaction-locally for the wait and put back to its previous value in the same statement;
/// when the wait fails the transaction is aborted and the setting goes with it. `OFFSET 0`
/// keeps the inner select (evaluated left to right) from being merged into the outer one.
pub(crate) const LOCK_XACT_TIMEOUT: &str = "SELECT s.isolation, set_config('lock_timeout', s.previous, true) FROM ( \
     SELECT current_setting('transaction_isolation') AS isolation, \
            current_setting('lock_timeout') AS previous, \
            set_config('lock_timeout', $2, true) AS applied, \
            CASE WHEN current_setting('transaction_isolation') IN ('read committed', 'read uncommitted') \
            THEN pg_advisory_xact_lock($1)::text END AS locked \
     OFFSET 0) s";

/// `$1` key → (isolation, acquired; NULL when refused).
pub(crate) const TRY_XACT: &str = "SELECT current_setting('transaction_isolation'), \
     CASE WHEN current_setting('transaction_isolation') IN ('read committed', 'read uncommitted') \
     THEN pg_try_advisory_xact_lock($1) END";

/// `$1` key → ''. A session lock, on a connection outside any transaction block.
pub(crate) const LOCK_SESSION: &str = "SELECT pg_advisory_lock($1)::text";

/// `$1` key, `$2` lock_timeout → restored lock_timeout. Runs as its own implicit transaction:
/// if the wait fails, the setting change is rolled back with it.
pub(crate) const LOCK_SESSION_TIMEOUT: &str = "SELECT set_config('lock_timeout', s.previous, false) FROM ( \
     SELECT current_setting('lock_timeout') AS previous, \
            set_config('lock_timeout', $2, false) AS applied, \
            pg_advisory_lock($1)::text AS locked \
     OFFSET 0) s";

/// `$1` key → acquired.
pub(crate) const TRY_SESSION: &str = "SELECT pg_try_advisory_lock($1)";

/// `$1` key → whether it was held.
pub(crate) const UNLOCK_SESSION: &str = "SELECT pg_advisory_unlock($1)";
