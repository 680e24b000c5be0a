-- The advisory-lock protocol of lockstep, written once (ADR 0003, ADR 0004). Every lock
-- statement the Rust crates send calls lockstep_advisory_lock, and so does
-- lockstep_lock_and_load (replaced below): the isolation check, the lock_timeout set for the
-- wait and restored after it, and which pg_advisory_* function is called live here and nowhere
-- else. A call is still one statement and one round trip.
--
-- p_key          the advisory key: lockstep_advisory_key(resource key) (migration V2).
-- p_session      false: transaction-scoped (pg_advisory_xact_lock, released at commit or
--                rollback); true: session-scoped (pg_advisory_lock, released by
--                pg_advisory_unlock or when the session ends).
-- p_wait         true: wait for the lock; false: try once (pg_try_advisory_*), never wait.
-- p_lock_timeout the longest wait, as a lock_timeout value (e.g. '250ms'); NULL: no limit. It
--                is set transaction-locally for the wait only and restored afterwards; when the
--                wait fails the (possibly implicit) transaction is aborted and the setting goes
--                with it.
--
-- refused_isolation  set, and nothing locked, when a transaction-scoped lock is asked for in a
--                    transaction that is not READ COMMITTED: lock-then-load needs each statement
--                    to see the latest commits. (READ UNCOMMITTED runs as READ COMMITTED.)
--                    The transaction is not aborted.
-- acquired           whether the lock is now held (a wait either returns true or fails:
--                    55P03 lock timeout, 57014 cancelled, 40P01 deadlock).
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
    IF NOT p_session THEN
        isolation := current_setting('transaction_isolation');
        IF isolation NOT IN ('read committed', 'read uncommitted') THEN
            refused_isolation := isolation;
            acquired := false;
            RETURN;
        END IF;
    END IF;
    IF NOT p_wait THEN
        IF p_session THEN
            acquired := pg_try_advisory_lock(p_key);
        ELSE
            acquired := pg_try_advisory_xact_lock(p_key);
        END IF;
        RETURN;
    END IF;
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

-- Same signature and result as in V3; the lock is now taken through lockstep_advisory_lock.
-- Takes the transaction-scoped advisory lock p_key, then loads a stream — one statement, one
-- round trip (lockstep-pg-store's load_locked; lockstep-pg adds the in-process queue, the
-- deadline and the cancel-on-drop). Outside READ COMMITTED it returns a single row naming the
-- level and locks nothing. p_lock_timeout (NULL = wait without limit) applies to the wait only.
-- The load is a new statement of a VOLATILE function, so under READ COMMITTED it reads a fresh
-- snapshot, taken after the lock was granted: it sees what the previous holder committed.
CREATE OR REPLACE FUNCTION lockstep_lock_and_load(
    p_key          bigint,
    p_lock_timeout text,
    p_stream_id    uuid
) RETURNS TABLE (
    refused_isolation text,
    event_id          uuid,
    version           bigint,
    event_type        text,
    payload           jsonb,
    recorded_at       timestamptz
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    refused text;
BEGIN
    SELECT l.refused_isolation INTO refused
    FROM lockstep_advisory_lock(p_key, false, true, p_lock_timeout) l;
    IF refused IS NOT NULL THEN
        refused_isolation := refused;
        RETURN NEXT;
        RETURN;
    END IF;
    RETURN QUERY
        SELECT NULL::text, e.event_id, e.version, e.event_type, e.payload, e.recorded_at
        FROM wh_events e
        WHERE e.stream_id = p_stream_id
        ORDER BY e.version;
END
$$;
