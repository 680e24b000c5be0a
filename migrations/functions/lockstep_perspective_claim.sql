-- Claims one pair for normal application, in one statement (one round trip): lockstep-pg-store's
-- PerspectiveStore::claim, used by PerspectiveWorker::process_pair (the "process this pair now"
-- of an operator, a tool or a test). The worker's batches claim with
-- lockstep_perspective_claim_pairs instead.
--
-- Returns a header row (outcome, the cursor columns, the latest snapshot's event id and, for
-- 'apply', the state), followed for 'apply' by the pending events after the cursor in event-id
-- order, at most p_max_events (outcome NULL, only the event columns set). The outcomes:
--   'busy'    another transaction holds the cursor row (SKIP LOCKED: the claim never waits for
--             it), or a live lease of any holder is on it (the row is then not locked);
--   'rewind'  a rewind is requested and its debounce has passed;
--   'idle'    a rewind is requested inside its debounce window;
--   'apply'   no rewind is requested; no event rows means there is nothing to apply.
-- For every outcome but 'busy' the cursor row is locked FOR NO KEY UPDATE until the claiming
-- transaction ends, so a rewind request the claim writes is kept when it commits.
--
-- Late arrivals, purged pairs and the debounce follow the rules of
-- lockstep_perspective_try_claim (the batch's claim of one pair): a purged pair with work gets
-- a rewind request from the nil id; the earliest work row before last_event_id writes the
-- request or moves its trigger earlier; the request is held back while p_debounce_us has not
-- passed since it was last flagged and p_debounce_max_us (NULL: no cap) has not passed since it
-- was first flagged. Unlike a batch, this claim does not wait for a pair's backoff or parking
-- (the caller asked for this very pair); failed_event_id, retry_at and parked_at are not in its
-- result, the store's statement (CLAIM) joins them from the cursor row. A missing cursor row is
-- created. Raises no error of its own.
CREATE OR REPLACE FUNCTION lockstep_perspective_claim(
    p_stream_id   uuid,
    p_perspective text,
    p_max_events  bigint,
    p_debounce_us bigint,
    p_debounce_max_us bigint
) RETURNS TABLE (
    outcome                 text,
    last_event_id           uuid,
    revision                bigint,
    applied_count           bigint,
    rewind_trigger_event_id uuid,
    rewind_flagged_at       timestamptz,
    rewind_first_flagged_at timestamptz,
    error                   text,
    failures                integer,
    latest_snapshot         uuid,
    stream_lock_instance_id uuid,
    stream_lock_reason      text,
    stream_lock_expiry      timestamptz,
    stream_lock_epoch       bigint,
    state                   jsonb,
    event_id                uuid,
    version                 bigint,
    event_type              text,
    payload                 jsonb,
    recorded_at             timestamptz,
    schema_version          integer
)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    c        wh_perspective_cursors%ROWTYPE;
    now_     timestamptz;
    late     uuid;
    late_at  timestamptz;
    verdict  text;
BEGIN
    SELECT * INTO c FROM wh_perspective_cursors k
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
       AND NOT (k.stream_lock_instance_id IS NOT NULL AND k.stream_lock_expiry > clock_timestamp())
       FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM wh_perspective_cursors k
                    WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective) THEN
            outcome := 'busy';
            RETURN NEXT;
            RETURN;
        END IF;
        INSERT INTO wh_perspective_cursors AS k (stream_id, perspective_name)
        VALUES (p_stream_id, p_perspective)
        ON CONFLICT DO NOTHING
        RETURNING * INTO c;
        IF NOT FOUND THEN
            -- Created meanwhile by another transaction (the insert waited for it to commit):
            -- try once more to lock it.
            SELECT * INTO c FROM wh_perspective_cursors k
             WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
               AND NOT (k.stream_lock_instance_id IS NOT NULL AND k.stream_lock_expiry > clock_timestamp())
               FOR NO KEY UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                outcome := 'busy';
                RETURN NEXT;
                RETURN;
            END IF;
        END IF;
    END IF;

    now_ := clock_timestamp();
    -- A purged pair (status bit 2) that has work again is rebuilt from the start of the
    -- stream: a rewind request from the nil id, never a fold of the events after the purge.
    IF c.status & 2 <> 0 AND EXISTS (
        SELECT 1 FROM wh_perspective_events w
         WHERE w.stream_id = p_stream_id AND w.perspective_name = p_perspective) THEN
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
         WHERE w.stream_id = p_stream_id AND w.perspective_name = p_perspective
           AND w.event_id < c.last_event_id
         ORDER BY w.event_id
         LIMIT 1;
        IF late IS NOT NULL AND (c.rewind_trigger_event_id IS NULL
                                 OR late < c.rewind_trigger_event_id
                                 OR late_at > c.rewind_flagged_at) THEN
            -- Write the request, or move its trigger earlier and restart its window; a late
            -- event the request already covers changes nothing.
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

    IF c.rewind_trigger_event_id IS NOT NULL THEN
        -- Held back while no late event came for the window AND the cap from the first flag
        -- has not passed: a steady trickle of late events must not postpone the rewind forever.
        IF c.rewind_flagged_at + p_debounce_us * interval '1 microsecond' > now_
           AND (p_debounce_max_us IS NULL
                OR coalesce(c.rewind_first_flagged_at, c.rewind_flagged_at)
                   + p_debounce_max_us * interval '1 microsecond' > now_) THEN
            verdict := 'idle';
        ELSE
            verdict := 'rewind';
        END IF;
    ELSE
        verdict := 'apply';
    END IF;

    outcome := verdict;
    last_event_id := c.last_event_id;
    revision := c.revision;
    applied_count := c.applied_count;
    rewind_trigger_event_id := c.rewind_trigger_event_id;
    rewind_flagged_at := c.rewind_flagged_at;
    rewind_first_flagged_at := c.rewind_first_flagged_at;
    error := c.error;
    failures := c.failures;
    latest_snapshot := (SELECT s.event_id FROM wh_perspective_snapshots s
                         WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective
                         ORDER BY s.event_id DESC LIMIT 1);
    stream_lock_instance_id := c.stream_lock_instance_id;
    stream_lock_reason := c.stream_lock_reason;
    stream_lock_expiry := c.stream_lock_expiry;
    stream_lock_epoch := c.stream_lock_epoch;
    IF verdict = 'apply' THEN
        state := (SELECT s.state FROM wh_perspective_states s
                   WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective);
    END IF;
    RETURN NEXT;
    -- The events: the pair's pending work after the cursor joined with its events (a skipped
    -- event has no work row, so it is never handed out).
    IF verdict <> 'apply' THEN
        RETURN;
    END IF;
    RETURN QUERY
        SELECT NULL::text, NULL::uuid, NULL::bigint, NULL::bigint, NULL::uuid, NULL::timestamptz,
               NULL::timestamptz, NULL::text, NULL::integer, NULL::uuid, NULL::uuid, NULL::text,
               NULL::timestamptz, NULL::bigint, NULL::jsonb,
               e.event_id, e.version, e.event_type, e.payload, e.recorded_at, e.schema_version
          FROM wh_perspective_events w
          JOIN wh_events e ON e.event_id = w.event_id AND e.stream_id = w.stream_id
         WHERE w.stream_id = p_stream_id AND w.perspective_name = p_perspective
           AND (c.last_event_id IS NULL OR w.event_id > c.last_event_id)
         ORDER BY w.event_id
         LIMIT p_max_events;
END
$$;
