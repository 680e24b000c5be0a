-- Tries to claim one pair for a batch: lockstep_perspective_claim_pairs calls it for every pair
-- it looks at. Returns a verdict and the cursor row as the claim left it:
--   'skip'    another transaction holds the cursor row, a live lease of any holder is on it,
--             the pair backs off (retry_at in the future) or it is parked (parked_at set); or
--             the row was missing and a concurrent transaction created it first. Nothing is
--             locked or written.
--   'apply'   the row is locked and no rewind is requested: the caller hands out its work.
--   'rewind'  the row is locked and a rewind is requested whose debounce has passed.
--   'idle'    the row is locked and a rewind is requested inside its debounce window: the
--             caller passes the pair over, the row stays locked until the batch's transaction
--             ends, and a request written here is kept when that transaction commits.
--
-- The row is locked FOR NO KEY UPDATE SKIP LOCKED: a batch never waits for a cursor row that
-- another batch, a commit or a lease operation holds, so a pair it cannot serve costs it one
-- probe and instances share the work without waiting for each other. A missing cursor row is
-- created (ON CONFLICT DO NOTHING waits only for a transaction inserting the same row).
--
-- Before the verdict the claim writes or moves the pair's rewind request, by the rules of the
-- one-pair claim (lockstep_perspective_claim):
-- - a purged pair (status bit 2) that has work again is rebuilt from the start of the stream:
--   a request from the nil id;
-- - a late arrival (a work row before last_event_id) requests a rewind from the earliest one;
--   the trigger only ever moves earlier, and the debounce window restarts when the trigger
--   moves or a late event was enqueued after the request was last flagged.
-- The debounce holds a request back while p_debounce_us has not passed since it was last
-- flagged and p_debounce_max_us (NULL: no cap) has not passed since it was first flagged: the
-- cap keeps a steady trickle of late events from postponing the rewind forever.
-- Raises no error of its own.
CREATE OR REPLACE FUNCTION lockstep_perspective_try_claim(
    p_stream_id       uuid,
    p_perspective     text,
    p_debounce_us     bigint,
    p_debounce_max_us bigint,
    OUT verdict       text,
    OUT c             wh_perspective_cursors
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    now_    timestamptz := clock_timestamp();
    late    uuid;
    late_at timestamptz;
BEGIN
    -- Lock the row only if the pair may be served; never wait for it.
    SELECT * INTO c FROM wh_perspective_cursors k
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
       AND NOT (k.stream_lock_instance_id IS NOT NULL AND k.stream_lock_expiry > now_)
       AND k.parked_at IS NULL
       AND (k.retry_at IS NULL OR k.retry_at <= now_)
       FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        -- The row exists but is held, leased, backing off or parked.
        IF EXISTS (SELECT 1 FROM wh_perspective_cursors k
                    WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective) THEN
            verdict := 'skip';
            RETURN;
        END IF;
        -- No row: create it (the insert locks it). Created meanwhile by another transaction:
        -- skip the pair rather than wait for it; a later claim serves it.
        INSERT INTO wh_perspective_cursors AS k (stream_id, perspective_name)
        VALUES (p_stream_id, p_perspective)
        ON CONFLICT DO NOTHING
        RETURNING * INTO c;
        IF NOT FOUND THEN
            verdict := 'skip';
            RETURN;
        END IF;
    END IF;
    -- A purged pair (status bit 2) with work: a rewind request from the nil id, which replays
    -- the whole stream, never a fold of the events after the purge onto an empty state.
    IF c.status & 2 <> 0 AND EXISTS (
        SELECT 1 FROM wh_perspective_events w
         WHERE w.perspective_name = p_perspective AND w.stream_id = p_stream_id) THEN
        UPDATE wh_perspective_cursors k
           SET rewind_trigger_event_id = '00000000-0000-0000-0000-000000000000'::uuid,
               rewind_flagged_at = now_,
               rewind_first_flagged_at = coalesce(k.rewind_first_flagged_at, now_),
               status = (k.status | 1) & ~2
         WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
        RETURNING * INTO c;
    END IF;
    IF c.last_event_id IS NOT NULL THEN
        -- The earliest late event, and when the last late event was enqueued.
        SELECT w.event_id, max(w.enqueued_at) OVER () INTO late, late_at
          FROM wh_perspective_events w
         WHERE w.perspective_name = p_perspective AND w.stream_id = p_stream_id
           AND w.event_id < c.last_event_id
         ORDER BY w.event_id
         LIMIT 1;
        -- Write the request, or move its trigger earlier and restart its window; a late event
        -- the request already covers changes nothing.
        IF late IS NOT NULL AND (c.rewind_trigger_event_id IS NULL
                                 OR late < c.rewind_trigger_event_id
                                 OR late_at > c.rewind_flagged_at) THEN
            UPDATE wh_perspective_cursors k
               SET rewind_trigger_event_id = CASE WHEN k.rewind_trigger_event_id IS NULL THEN late
                                                  ELSE least(k.rewind_trigger_event_id, late) END,
                   rewind_flagged_at = now_,
                   rewind_first_flagged_at = CASE WHEN k.rewind_trigger_event_id IS NULL THEN now_
                                                  ELSE k.rewind_first_flagged_at END,
                   status = k.status | 1
             WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
            RETURNING * INTO c;
        END IF;
    END IF;
    -- Held back ('idle') while no late event came for the window and the cap since the first
    -- flag has not passed.
    IF c.rewind_trigger_event_id IS NULL THEN
        verdict := 'apply';
    ELSIF c.rewind_flagged_at + p_debounce_us * interval '1 microsecond' > now_
          AND (p_debounce_max_us IS NULL
               OR coalesce(c.rewind_first_flagged_at, c.rewind_flagged_at)
                  + p_debounce_max_us * interval '1 microsecond' > now_) THEN
        verdict := 'idle';
    ELSE
        verdict := 'rewind';
    END IF;
END
$$;
