-- Registers perspectives (idempotent) and returns how many of the names were new. A new name
-- gets a cursor row for every stream and a work row for every event stored: its catch-up.
-- From then on every append fans out to it (lockstep_append_events). Called by
-- lockstep-pg-store's register (REGISTER); a worker registers its perspectives when it starts.
--
-- A name retired with its states kept (in wh_retired_perspectives) catches up from its kept
-- cursors instead of the first event: work for the events after each pair's cursor and for
-- every event recorded since the retirement (one that sorts before the cursor is a late
-- arrival, which the claim turns into a rewind request, as always), less the events an
-- operator skipped for the pair; a stream without a cursor gets all its events. The name then
-- leaves wh_retired_perspectives. A name retired with its states dropped is simply new.
--
-- Locks, in this order:
-- 1. SHARE ROW EXCLUSIVE on wh_perspectives: appends (ACCESS SHARE) do not wait for it, and it
--    conflicts with itself, so registrations and retirements take turns. When every name is
--    registered already it returns 0 here, without the exclusive lock: a worker's start
--    holds no append back.
-- 2. ACCESS EXCLUSIVE, through lockstep_lock_perspectives_for_change: it waits for every
--    transaction that read the table (each append holds ACCESS SHARE until it ends), and
--    appends queue behind the request for at most p_queue_at_most at a time; after
--    p_give_up_after, 55P03 naming the transaction it waits for, and nothing is registered.
-- Once the lock is granted, the catch-up statement (its snapshot taken after the lock) sees
-- every event appended without the new names, and every later append reads the table after
-- this transaction commits and fans out to them itself: no event is missed. Appends wait for
-- the rest of this transaction: a new name's catch-up writes one work row per event of the
-- database, which is what a registration costs.
--
-- A catch-up of more than 10 000 work rows also analyzes wh_perspective_events before it
-- returns: the plans the workers' sessions cached for their claims were made for the queue as
-- it was, and over a queue grown by a million rows they can run orders of magnitude slower
-- (seconds per claim, the serving perspectives stalled behind them) until the table's
-- statistics change. ANALYZE counts this transaction's own rows, and its new statistics make
-- every session plan those statements again.
CREATE OR REPLACE FUNCTION lockstep_register_perspectives(
    p_names         text[],
    p_queue_at_most interval DEFAULT interval '50 milliseconds',
    p_give_up_after interval DEFAULT interval '5 seconds'
) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    added integer;
    enqueued bigint;
BEGIN
    LOCK TABLE wh_perspectives IN SHARE ROW EXCLUSIVE MODE;
    IF NOT EXISTS (
        SELECT 1 FROM unnest(p_names) AS x(name)
        WHERE NOT EXISTS (SELECT 1 FROM wh_perspectives p WHERE p.perspective_name = x.name)
    ) THEN
        RETURN 0;
    END IF;
    PERFORM lockstep_lock_perspectives_for_change('registering perspectives', p_queue_at_most,
                                                  p_give_up_after);
    -- One statement: every part reads the same snapshot, so the work rows see the kept
    -- cursors and the retirement as they were before it (not the cursor rows it inserts, nor
    -- the retirement it deletes).
    WITH new AS (
        INSERT INTO wh_perspectives (perspective_name)
        SELECT DISTINCT x.name FROM unnest(p_names) AS x(name)
        ON CONFLICT DO NOTHING
        RETURNING perspective_name
    ), cursors AS (
        INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
        SELECT DISTINCT e.stream_id, new.perspective_name FROM wh_events e CROSS JOIN new
        ON CONFLICT DO NOTHING
    ), work AS (
        -- Every event, or for a name retired with its states kept (r found) the events after
        -- its pair's cursor and those recorded since the retirement; less skipped events.
        INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
        SELECT e.stream_id, new.perspective_name, e.event_id
          FROM new
          CROSS JOIN wh_events e
          LEFT JOIN wh_retired_perspectives r ON r.perspective_name = new.perspective_name
          LEFT JOIN wh_perspective_cursors k
                 ON r.perspective_name IS NOT NULL
                AND k.stream_id = e.stream_id AND k.perspective_name = new.perspective_name
         WHERE (k.last_event_id IS NULL
                OR e.event_id > k.last_event_id
                OR e.recorded_at >= r.retired_at)
           AND NOT EXISTS (SELECT 1 FROM wh_perspective_skipped_events s
                             WHERE s.stream_id = e.stream_id
                               AND s.perspective_name = new.perspective_name
                               AND s.event_id = e.event_id)
        ON CONFLICT DO NOTHING
        RETURNING 1
    ), unretired AS (
        DELETE FROM wh_retired_perspectives r USING new
         WHERE r.perspective_name = new.perspective_name
    )
    SELECT (SELECT count(*) FROM new), (SELECT count(*) FROM work) INTO added, enqueued;
    IF enqueued > 10000 THEN
        ANALYZE wh_perspective_events;
    END IF;
    RETURN added;
END
$$;
