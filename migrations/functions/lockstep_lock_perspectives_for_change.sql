-- Takes ACCESS EXCLUSIVE on wh_perspectives for a change of the registered perspectives,
-- without holding every append of the database back behind one slow transaction. Called by
-- lockstep_register_perspectives and lockstep_retire_perspective, which already hold SHARE ROW
-- EXCLUSIVE on the table; the lock is kept until the caller's transaction ends.
--
-- p_doing          what the change is ('registering perspectives'), named in the error.
-- p_queue_at_most  how long one request may wait in the table's lock queue; 0: not at all
--                  (NOWAIT).
-- p_give_up_after  how long the call may go on, from its start, before it fails.
--
-- Why not a plain LOCK TABLE: every append holds ACCESS SHARE on the table until its
-- transaction ends, and every append that starts while an ACCESS EXCLUSIVE request waits
-- queues behind the request. A plain LOCK TABLE behind one append left open would stall every
-- append of the database for as long as that append stays open. So:
-- - a request waits at most p_queue_at_most (its lock_timeout): appends queue behind it at
--   most that long;
-- - once a request timed out behind some transactions, it is not made again while any of them
--   still holds the table (they are known to be slow; the appends that arrive meanwhile go
--   through). pg_locks is polled every 20 ms, and the request is made again once they are
--   gone. Holders are told apart by their virtual transaction ids, so a pooled connection's
--   next transaction is a new holder;
-- - once p_give_up_after has passed: lock_not_available (55P03, retryable), naming the oldest
--   of those transactions: pid, the start of its transaction (when this role may see it) and
--   its application; DETAIL '<p_doing>; pid=<pid>'. The exclusive lock is not taken, and the
--   error aborts the caller's transaction.
-- The caller's lock_timeout is left as it was, whatever happens.
--
-- A change may starve while appends that each stay open longer than p_queue_at_most overlap
-- without a gap: it then fails after p_give_up_after and is retried (a worker retries its
-- registration every poll interval). The defaults and the designs not taken are in
-- docs/adr/0038-registrations-wait-beside-appends.md.
CREATE OR REPLACE FUNCTION lockstep_lock_perspectives_for_change(
    p_doing         text,
    p_queue_at_most interval,
    p_give_up_after interval
) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    started   constant timestamptz := clock_timestamp();
    previous  constant text := current_setting('lock_timeout');
    queue_ms  constant bigint := greatest(ceil(extract(epoch FROM p_queue_at_most) * 1000), 0);
    db        constant oid := (SELECT d.oid FROM pg_database d WHERE d.datname = current_database());
    holders   text[];
    waited_on text[] := '{}';
    b         record;
BEGIN
    LOOP
        -- The transactions, other than this one, that hold a lock on the table now (prepared
        -- transactions included: their pid is NULL).
        SELECT coalesce(array_agg(DISTINCT l.virtualtransaction), '{}') INTO holders
          FROM pg_locks l
         WHERE l.locktype = 'relation' AND l.database = db
           AND l.relation = 'wh_perspectives'::regclass
           AND l.granted AND l.pid IS DISTINCT FROM pg_backend_pid();
        -- Request the lock unless one of the transactions it last timed out behind still
        -- holds the table. The block is a subtransaction: a request that times out is rolled
        -- back, its lock_timeout setting with it, and the loop goes on.
        IF NOT holders && waited_on THEN
            BEGIN
                IF queue_ms = 0 THEN
                    LOCK TABLE wh_perspectives IN ACCESS EXCLUSIVE MODE NOWAIT;
                ELSE
                    PERFORM set_config('lock_timeout', queue_ms::text, true);
                    LOCK TABLE wh_perspectives IN ACCESS EXCLUSIVE MODE;
                    PERFORM set_config('lock_timeout', previous, true);
                END IF;
                RETURN;
            EXCEPTION WHEN lock_not_available THEN
                -- The transactions that hold the table now: the request timed out behind
                -- them.
                SELECT coalesce(array_agg(DISTINCT l.virtualtransaction), '{}') INTO waited_on
                  FROM pg_locks l
                 WHERE l.locktype = 'relation' AND l.database = db
                   AND l.relation = 'wh_perspectives'::regclass
                   AND l.granted AND l.pid IS DISTINCT FROM pg_backend_pid();
            END;
        END IF;
        -- Give up, naming the oldest of those transactions that still holds the table. When
        -- none does, the request is made again on the next round.
        IF clock_timestamp() - started >= p_give_up_after THEN
            SELECT l.pid, a.xact_start, a.application_name INTO b
              FROM pg_locks l
              LEFT JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE l.locktype = 'relation' AND l.database = db
               AND l.relation = 'wh_perspectives'::regclass
               AND l.granted AND l.pid IS DISTINCT FROM pg_backend_pid()
               AND l.virtualtransaction = ANY (waited_on)
             ORDER BY a.xact_start NULLS LAST
             LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'lock_not_available',
                    MESSAGE = format(
                        'an append transaction (or another transaction that read the '
                        'registered perspectives) has been open since %s (pid %s%s); waited %s '
                        'for it and gave up rather than hold every append back behind it: '
                        'retry once it has ended',
                        coalesce(b.xact_start::text, 'a time this role cannot see'),
                        coalesce(b.pid::text, 'none: a prepared transaction'),
                        CASE WHEN b.application_name <> ''
                             THEN format(', application %L', b.application_name) ELSE '' END,
                        p_give_up_after),
                    DETAIL = format('%s; pid=%s', p_doing, coalesce(b.pid::text, ''));
            END IF;
        END IF;
        PERFORM pg_sleep(0.02);
    END LOOP;
END
$$;
