-- Retires the perspective p_name: deletes its registration (appends then enqueue no more work
-- for it) and its queued work, and keeps (p_keep) or drops its cursors, states, snapshots,
-- skipped events, rewind progress and throughput row. Called by lockstep-pg-store's retire
-- (`lockstep perspectives retire NAME --keep-states | --drop-states`). Deploy the workers
-- without the perspective first: a worker that starts with it registers it again.
--
-- No row back: the name is neither registered nor retired with its states kept. Otherwise one
-- row: the work rows deleted and the pairs kept or dropped. A name retired with its states
-- kept can be retired again with p_keep false, to drop what was kept; again with p_keep true,
-- it only counts (its retired_at stays).
--
-- With the states kept, the queued work that sorts before its pair's cursor (a late arrival
-- not claimed yet) first becomes a rewind request from its earliest event (an earlier trigger
-- is kept), so deleting the work loses nothing. The name is then recorded in
-- wh_retired_perspectives, from which a later registration catches up.
--
-- Locks, taken in this order so that it waits for the workers in flight instead of
-- deadlocking with them (40P01):
-- 1. SHARE ROW EXCLUSIVE on wh_perspectives: registrations and retirements take turns, and
--    appends do not wait for it. An unknown name returns here.
-- 2. the perspective's cursor rows, FOR UPDATE, in stream order: the order in which every
--    worker locks cursor rows (its claims skip locked rows instead). A batch or a fenced
--    commit that holds some of them is waited for before this touches any row it writes (work
--    rows, states, snapshots), so neither waits for the other in a cycle.
-- 3. ACCESS EXCLUSIVE on wh_perspectives, through lockstep_lock_perspectives_for_change: it
--    waits for every transaction that appended, so no append can enqueue work for the name
--    after its work is deleted. Appends queue behind the request for at most p_queue_at_most
--    at a time; after p_give_up_after, 55P03 naming the transaction it waits for, and nothing
--    is retired.
-- 4. the cursor rows again: those that appends committed between 2 and 3 (new streams).
-- A name that is retired already skips 3 and 4: no append enqueues work for it.
CREATE OR REPLACE FUNCTION lockstep_retire_perspective(
    p_name          text,
    p_keep          boolean,
    p_queue_at_most interval DEFAULT interval '50 milliseconds',
    p_give_up_after interval DEFAULT interval '5 seconds'
)
RETURNS TABLE (work_removed bigint, pairs bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n_work  bigint;
    n_pairs bigint;
    was_registered boolean;
BEGIN
    -- 1. Registrations and retirements take turns.
    LOCK TABLE wh_perspectives IN SHARE ROW EXCLUSIVE MODE;
    was_registered := EXISTS (SELECT 1 FROM wh_perspectives p WHERE p.perspective_name = p_name);
    IF NOT was_registered
       AND NOT EXISTS (SELECT 1 FROM wh_retired_perspectives r WHERE r.perspective_name = p_name) THEN
        RETURN;
    END IF;
    -- 2. The cursor rows, in the workers' order.
    PERFORM 1 FROM wh_perspective_cursors k WHERE k.perspective_name = p_name
     ORDER BY k.stream_id FOR UPDATE;
    IF was_registered THEN
        -- 3. Every append in flight is waited for; later ones wait for this commit.
        PERFORM lockstep_lock_perspectives_for_change('retiring a perspective', p_queue_at_most,
                                                      p_give_up_after);
        -- 4. The cursor rows of streams appended between 2 and 3.
        PERFORM 1 FROM wh_perspective_cursors k WHERE k.perspective_name = p_name
         ORDER BY k.stream_id FOR UPDATE;
        DELETE FROM wh_perspectives p WHERE p.perspective_name = p_name;
    END IF;
    -- Late arrivals become rewind requests from their pair's earliest one, or the pair's
    -- earlier trigger is kept; status bit 1 (RewindRequired) goes with the trigger.
    IF p_keep THEN
        WITH late AS (
            SELECT w.stream_id, (array_agg(w.event_id ORDER BY w.event_id))[1] AS trigger
              FROM wh_perspective_events w
              JOIN wh_perspective_cursors k
                ON k.stream_id = w.stream_id AND k.perspective_name = w.perspective_name
             WHERE w.perspective_name = p_name
               AND k.last_event_id IS NOT NULL AND w.event_id < k.last_event_id
             GROUP BY w.stream_id
        )
        UPDATE wh_perspective_cursors k
           SET rewind_trigger_event_id = CASE
                   WHEN k.rewind_trigger_event_id IS NULL OR late.trigger < k.rewind_trigger_event_id
                   THEN late.trigger ELSE k.rewind_trigger_event_id END,
               rewind_flagged_at = clock_timestamp(),
               rewind_first_flagged_at = coalesce(k.rewind_first_flagged_at, clock_timestamp()),
               status = k.status | 1
          FROM late
         WHERE k.stream_id = late.stream_id AND k.perspective_name = p_name;
    END IF;
    DELETE FROM wh_perspective_events w WHERE w.perspective_name = p_name;
    GET DIAGNOSTICS n_work = ROW_COUNT;
    IF p_keep THEN
        SELECT count(*) INTO n_pairs FROM wh_perspective_cursors k WHERE k.perspective_name = p_name;
        -- Recorded once, at the retirement of the registered name: retiring it again keeps
        -- the time that its catch-up starts from.
        IF was_registered THEN
            INSERT INTO wh_retired_perspectives AS r (perspective_name, retired_at)
            VALUES (p_name, clock_timestamp())
            ON CONFLICT (perspective_name) DO UPDATE SET retired_at = EXCLUDED.retired_at;
        END IF;
    ELSE
        DELETE FROM wh_perspective_states x WHERE x.perspective_name = p_name;
        DELETE FROM wh_perspective_snapshots x WHERE x.perspective_name = p_name;
        DELETE FROM wh_perspective_skipped_events x WHERE x.perspective_name = p_name;
        DELETE FROM wh_perspective_rewind_progress x WHERE x.perspective_name = p_name;
        DELETE FROM wh_perspective_throughput x WHERE x.perspective_name = p_name;
        DELETE FROM wh_perspective_cursors k WHERE k.perspective_name = p_name;
        GET DIAGNOSTICS n_pairs = ROW_COUNT;
        DELETE FROM wh_retired_perspectives r WHERE r.perspective_name = p_name;
    END IF;
    RETURN QUERY SELECT n_work, n_pairs;
END
$$;
