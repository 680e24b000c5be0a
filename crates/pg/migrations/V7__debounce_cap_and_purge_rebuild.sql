-- lockstep V7: the rewind debounce gets a cap, and a purged pair is rebuilt from the start.
--
-- 1. A flagged pair was held back for as long as late events kept arriving inside the debounce
--    window (the window slides on every late event), so a steady trickle could postpone its
--    rewind forever. The claim now also takes the cap, `p_debounce_max_us`: a request first
--    flagged at least that long ago is served whatever keeps arriving (NULL: no cap).
--    `PENDING_PAIRS`, a statement of lockstep-pg-store, applies the same cap.
-- 2. After a purge, the next event was applied to an empty state: a state that is the fold of
--    no prefix of the stream. A purge now sets status bit 2 ("purged"); the first claim that
--    finds work on such a pair turns it into a rewind from the start (trigger: the nil id),
--    which replays the whole stream.
--
-- The five-argument claim is new; the four-argument one of V5 becomes a wrapper of it without
-- a cap, so that binaries of the previous release keep working during a rolling upgrade (and
-- get the purge fix). Everything else in the claim's body is V5's.

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
    recorded_at             timestamptz
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
            -- Created meanwhile by a transaction that has now committed: try once more.
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
        -- the earliest late event, and when the last late event was enqueued
        SELECT w.event_id, max(w.enqueued_at) OVER () INTO late, late_at
          FROM wh_perspective_events w
         WHERE w.stream_id = p_stream_id AND w.perspective_name = p_perspective
           AND w.event_id < c.last_event_id
         ORDER BY w.event_id
         LIMIT 1;
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

    IF c.rewind_trigger_event_id IS NOT NULL THEN
        -- Held back while no late event came for the window AND the cap from the first flag
        -- has not passed (issue 19: a steady trickle must not postpone the rewind forever).
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
    IF verdict <> 'apply' THEN
        RETURN;
    END IF;
    RETURN QUERY
        SELECT NULL::text, NULL::uuid, NULL::bigint, NULL::bigint, NULL::uuid, NULL::timestamptz,
               NULL::timestamptz, NULL::text, NULL::integer, NULL::uuid, NULL::uuid, NULL::text,
               NULL::timestamptz, NULL::bigint, NULL::jsonb,
               e.event_id, e.version, e.event_type, e.payload, e.recorded_at
          FROM wh_perspective_events w
          JOIN wh_events e ON e.event_id = w.event_id AND e.stream_id = w.stream_id
         WHERE w.stream_id = p_stream_id AND w.perspective_name = p_perspective
           AND (c.last_event_id IS NULL OR w.event_id > c.last_event_id)
         ORDER BY w.event_id
         LIMIT p_max_events;
END
$$;

CREATE OR REPLACE FUNCTION lockstep_perspective_claim(
    p_stream_id   uuid,
    p_perspective text,
    p_max_events  bigint,
    p_debounce_us bigint
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
    recorded_at             timestamptz
)
LANGUAGE sql VOLATILE AS $$
    SELECT * FROM lockstep_perspective_claim(p_stream_id, p_perspective, p_max_events,
                                             p_debounce_us, NULL::bigint)
$$;

-- V5's purge, which now also marks the pair purged (status bit 2; see 2. above).
CREATE OR REPLACE FUNCTION lockstep_perspective_purge(
    p_stream_id    uuid,
    p_perspective  text,
    p_fence_holder uuid,
    p_fence_epoch  bigint
) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    refused text;
BEGIN
    SELECT ch.refusal INTO refused
      FROM lockstep_perspective_check(p_stream_id, p_perspective, NULL,
                                      p_fence_holder, p_fence_epoch) ch;
    IF refused IS NOT NULL THEN
        RETURN refused;
    END IF;
    DELETE FROM wh_perspective_states s
     WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective;
    DELETE FROM wh_perspective_snapshots s
     WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective;
    DELETE FROM wh_perspective_events w
     WHERE w.stream_id = p_stream_id AND w.perspective_name = p_perspective;
    UPDATE wh_perspective_cursors k
       SET last_event_id = NULL, applied_count = 0, revision = k.revision + 1,
           processed_at = clock_timestamp(), error = NULL, failures = 0,
           rewind_trigger_event_id = NULL, rewind_flagged_at = NULL,
           rewind_first_flagged_at = NULL, status = (k.status & ~1) | 2
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective;
    RETURN 'purged';
END
$$;
