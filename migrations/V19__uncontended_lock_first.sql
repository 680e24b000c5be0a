-- lockstep V19: an advisory lock that is free is taken without touching lock_timeout
-- (issue 22, cold parity of the pessimistic path; docs/adr/0028-uncontended-lock-first.md).
--
-- `lockstep_advisory_lock` (V4) set `lock_timeout` for the wait and restored it after, on
-- every call that may wait — two `set_config` calls and a `current_setting`, even when the
-- lock was free, which it is for every writer of a cold aggregate. It now first tries the
-- lock without waiting (`pg_try_advisory_xact_lock` / `pg_try_advisory_lock`); only when that
-- fails does it set the timeout, wait and restore, as before.
--
-- Same signature, outcomes and errors. The order of the waiters is kept: PostgreSQL's lock
-- manager refuses a try while other sessions wait for a conflicting lock (the request joins
-- no queue and takes nothing), so a try never overtakes a queued waiter; the wait after it
-- joins the queue as the single call did. The isolation check comes first, as before. A
-- session lock the session already holds is taken again by the try (re-entrant, as the wait
-- was). `lockstep_lock_and_load` calls it, so the pessimistic load gets the same.
--
-- Measured (pgbench, 16 clients on 2 cores, a cold aggregate each: BEGIN, lock-and-load of 50
-- events, COMMIT, 6 s per run, alternating): 10 800–11 900 transactions/s before,
-- 12 100–14 200 after.
--
-- Re-runnable.

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
    -- Uncontended (the common case): taken at once, no lock_timeout to set and restore.
    IF p_session THEN
        acquired := pg_try_advisory_lock(p_key);
    ELSE
        acquired := pg_try_advisory_xact_lock(p_key);
    END IF;
    IF acquired THEN
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

