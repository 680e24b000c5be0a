-- The advisory-lock protocol of lockstep, written once. Every lock statement the Rust crates
-- send calls this function (lockstep-pg's transaction-scoped acquire, lockstep-pg-advisory's
-- session locks), and so does lockstep_lock_and_load: the isolation check, the lock_timeout
-- set for the wait and restored after it, and which pg_advisory_* function is called live here
-- and nowhere else. A call is one statement and one round trip.
--
-- p_key          the advisory key: lockstep_advisory_key(resource key), computed by the caller.
-- p_session      false: transaction-scoped (pg_advisory_xact_lock, released at commit or
--                rollback); true: session-scoped (pg_advisory_lock, released by
--                pg_advisory_unlock or when the session ends).
-- p_wait         true: wait for the lock; false: try once (pg_try_advisory_*), never wait.
-- p_lock_timeout the longest wait, as a lock_timeout value (e.g. '250ms'); NULL: no limit.
--
-- refused_isolation  set, and nothing locked, when a transaction-scoped lock is asked for in a
--                    transaction that is not READ COMMITTED: lock-then-load needs each
--                    statement after the lock to see the latest commits, which a REPEATABLE
--                    READ or SERIALIZABLE snapshot does not. (READ UNCOMMITTED runs as READ
--                    COMMITTED.) The transaction is not aborted.
-- acquired           whether the lock is now held. A try returns false when another session
--                    holds the lock or waits for it (see below); a wait either returns true or
--                    raises: 55P03 when p_lock_timeout passes, 57014 on a cancel or a
--                    statement_timeout, 40P01 on a deadlock.
--
-- A call that may wait first tries the lock without waiting, and returns at once when it is
-- free: the common case (every writer of a cold aggregate, the first writer of a hot one)
-- then reads, sets and restores no lock_timeout, about 20 µs of server time per acquire at
-- saturation. The try never overtakes a queued waiter: PostgreSQL makes a request wait when
-- other sessions wait for a conflicting lock, even while the lock itself is free, so such a
-- try takes nothing and joins no queue, and the wait after it queues as a single wait would.
-- A session lock the session already holds is taken again by the try (session locks are
-- re-entrant and counted: each needs its own unlock).
--
-- lock_timeout is set transaction-locally for the wait only and set back after it. When the
-- wait fails, the transaction is aborted (for a session lock, sent outside a transaction
-- block, its own implicit transaction) and the setting is undone with it.
CREATE OR REPLACE FUNCTION lockstep_advisory_lock(
    p_key              bigint,
    p_session          boolean,
    p_wait             boolean,
    p_lock_timeout     text,
    OUT refused_isolation text,
    OUT acquired          boolean
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    isolation text;
    previous  text;
BEGIN
    -- The isolation check comes before anything is locked. A session lock outlives the
    -- transaction and is not tied to a snapshot: no check.
    IF NOT p_session THEN
        isolation := current_setting('transaction_isolation');
        IF isolation NOT IN ('read committed', 'read uncommitted') THEN
            refused_isolation := isolation;
            acquired := false;
            RETURN;
        END IF;
    END IF;
    -- A try: one attempt, whatever p_lock_timeout says.
    IF NOT p_wait THEN
        IF p_session THEN
            acquired := pg_try_advisory_lock(p_key);
        ELSE
            acquired := pg_try_advisory_xact_lock(p_key);
        END IF;
        RETURN;
    END IF;
    -- Uncontended (the common case): taken at once, no lock_timeout to set and restore.
    IF p_session THEN
        acquired := pg_try_advisory_lock(p_key);
    ELSE
        acquired := pg_try_advisory_xact_lock(p_key);
    END IF;
    IF acquired THEN
        RETURN;
    END IF;
    -- Contended: wait, for at most p_lock_timeout. A failed wait raises and aborts the
    -- transaction, which undoes the transaction-local setting.
    IF p_lock_timeout IS NOT NULL THEN
        previous := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', p_lock_timeout, true);
    END IF;
    IF p_session THEN
        PERFORM pg_advisory_lock(p_key);
    ELSE
        PERFORM pg_advisory_xact_lock(p_key);
    END IF;
    IF p_lock_timeout IS NOT NULL THEN
        PERFORM set_config('lock_timeout', previous, true);
    END IF;
    acquired := true;
END
$$;
