-- lockstep V16: a batch is claimed in two statements, and its events are read by stream range
-- (issue 18, speed; docs/adr/0022-range-deleted-batch-work.md §2).
--
-- `lockstep_perspective_claim_batch` (V8) read every claimed event with its own descent of an
-- index of `wh_events` (≈ 3 µs of server time per event on the benchmark's machine) and handed
-- it out with a `RETURN NEXT` of 25 columns. `lockstep_perspective_claim_pairs` is its walk,
-- verdicts and row locks, unchanged, returning for each pair to apply its cursor, state, the
-- state's size and the ids of its pending work rows (one index range of the work table per
-- pair, as many as V8 would hand out: the events bounds are the same); the store then reads
-- the events of each pair as one range of `wh_events (stream_id, event_id)` from the first to
-- the last of those ids, with the byte bound applied by a running total (one plain statement,
-- `lockstep-pg-store`'s `CLAIM_EVENTS`), and keeps the events whose ids are work.
--
-- V8's function stays, unchanged, for binaries of the previous release. A V16 binary needs
-- this migration (migrate before rolling the binaries out, as for every migration).
--
-- Every statement is re-runnable.

CREATE OR REPLACE FUNCTION lockstep_perspective_claim_pairs(
    p_names           text[],
    p_after           uuid[],
    p_max_pairs       integer,
    p_events_per_pair integer,
    p_max_events      integer,
    p_scan            integer,
    p_debounce_us     bigint,
    p_debounce_max_us bigint
) RETURNS TABLE (
    kind                    text,
    stream_id               uuid,
    perspective_name        text,
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
    failed_event_id         uuid,
    retry_at                timestamptz,
    parked_at               timestamptz,
    state                   jsonb,
    work_ids                uuid[],
    state_bytes             bigint,
    walk_from               uuid
)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    n_names     integer := coalesce(cardinality(p_names), 0);
    positions   uuid[] := p_after;
    scanned     integer := 0;
    claimed     integer := 0;
    events_left integer := p_max_events;
    taken       text[] := '{}';
    i           integer;
    name_       text;
    start_      uuid;
    pos         uuid;
    prev_pos    uuid;
    upper_      uuid;
    wrapped     boolean;
    cand        uuid;
    rq          record;
    res         record;
    c           wh_perspective_cursors%ROWTYPE;
    st          jsonb;
    n           integer;
    ids         uuid[];
BEGIN
    -- Pairs whose rewind was requested, work or not (an operator's request on a pair that is
    -- up to date has no work row to be found by).
    FOR rq IN
        SELECT k.stream_id AS s, k.perspective_name AS p FROM wh_perspective_cursors k
         WHERE k.rewind_trigger_event_id IS NOT NULL AND k.perspective_name = ANY (p_names)
           AND k.parked_at IS NULL
           AND (k.retry_at IS NULL OR k.retry_at <= clock_timestamp())
           AND NOT (k.stream_lock_instance_id IS NOT NULL AND k.stream_lock_expiry > clock_timestamp())
           AND (k.rewind_flagged_at + p_debounce_us * interval '1 microsecond' <= clock_timestamp()
                OR coalesce(k.rewind_first_flagged_at, k.rewind_flagged_at)
                   + p_debounce_max_us * interval '1 microsecond' <= clock_timestamp())
         ORDER BY k.rewind_flagged_at, k.stream_id, k.perspective_name COLLATE "C"
         LIMIT p_max_pairs
    LOOP
        SELECT * INTO res FROM lockstep_perspective_try_claim(rq.s, rq.p, p_debounce_us,
                                                              p_debounce_max_us) t;
        CONTINUE WHEN res.verdict <> 'rewind';
        c := res.c;
        claimed := claimed + 1;
        taken := taken || (c.stream_id::text || '/' || c.perspective_name);
        kind := 'rewind'; stream_id := c.stream_id; perspective_name := c.perspective_name;
        last_event_id := c.last_event_id; revision := c.revision; applied_count := c.applied_count;
        rewind_trigger_event_id := c.rewind_trigger_event_id;
        rewind_flagged_at := c.rewind_flagged_at;
        rewind_first_flagged_at := c.rewind_first_flagged_at;
        error := c.error; failures := c.failures;
        latest_snapshot := (SELECT s.event_id FROM wh_perspective_snapshots s
                             WHERE s.stream_id = c.stream_id
                               AND s.perspective_name = c.perspective_name
                             ORDER BY s.event_id DESC LIMIT 1);
        stream_lock_instance_id := c.stream_lock_instance_id;
        stream_lock_reason := c.stream_lock_reason; stream_lock_expiry := c.stream_lock_expiry;
        stream_lock_epoch := c.stream_lock_epoch; failed_event_id := c.failed_event_id;
        retry_at := c.retry_at; parked_at := c.parked_at;
        state := NULL; work_ids := NULL; state_bytes := NULL; walk_from := NULL;
        RETURN NEXT;
    END LOOP;

    FOR i IN 1 .. n_names LOOP
        EXIT WHEN scanned >= p_scan OR claimed >= p_max_pairs OR events_left <= 0;
        name_ := p_names[i];
        start_ := p_after[i];
        pos := start_;
        wrapped := false;
        LOOP
            EXIT WHEN scanned >= p_scan OR claimed >= p_max_pairs OR events_left <= 0;
            -- The next pair of this perspective with work: one descent of the work table's key.
            -- Two statements, not `pos IS NULL OR stream_id > pos`: PL/pgSQL caches a generic
            -- plan, and an OR on a parameter turns its range into a filter over the whole
            -- perspective (measured: seconds per claim on 1 000 000 work rows).
            upper_ := CASE WHEN wrapped THEN start_
                           ELSE 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid END;
            IF pos IS NULL THEN
                SELECT w.stream_id INTO cand FROM wh_perspective_events w
                 WHERE w.perspective_name = name_ AND w.stream_id <= upper_
                 ORDER BY w.perspective_name, w.stream_id
                 LIMIT 1;
            ELSE
                SELECT w.stream_id INTO cand FROM wh_perspective_events w
                 WHERE w.perspective_name = name_ AND w.stream_id > pos AND w.stream_id <= upper_
                 ORDER BY w.perspective_name, w.stream_id
                 LIMIT 1;
            END IF;
            IF NOT FOUND THEN
                EXIT WHEN wrapped OR start_ IS NULL;
                wrapped := true;
                pos := NULL;
                CONTINUE;
            END IF;
            pos := cand;
            -- A pair this batch already holds (its rewind) is passed over, not counted.
            CONTINUE WHEN (cand::text || '/' || name_) = ANY (taken);
            prev_pos := positions[i];
            positions[i] := cand;
            scanned := scanned + 1;
            SELECT * INTO res FROM lockstep_perspective_try_claim(cand, name_, p_debounce_us,
                                                                  p_debounce_max_us) t;
            CONTINUE WHEN res.verdict IN ('skip', 'idle');
            c := res.c;
            kind := res.verdict; stream_id := c.stream_id; perspective_name := c.perspective_name;
            last_event_id := c.last_event_id; revision := c.revision;
            applied_count := c.applied_count;
            rewind_trigger_event_id := c.rewind_trigger_event_id;
            rewind_flagged_at := c.rewind_flagged_at;
            rewind_first_flagged_at := c.rewind_first_flagged_at;
            error := c.error; failures := c.failures;
            latest_snapshot := (SELECT s.event_id FROM wh_perspective_snapshots s
                                 WHERE s.stream_id = c.stream_id
                                   AND s.perspective_name = c.perspective_name
                                 ORDER BY s.event_id DESC LIMIT 1);
            stream_lock_instance_id := c.stream_lock_instance_id;
            stream_lock_reason := c.stream_lock_reason; stream_lock_expiry := c.stream_lock_expiry;
            stream_lock_epoch := c.stream_lock_epoch; failed_event_id := c.failed_event_id;
            retry_at := c.retry_at; parked_at := c.parked_at;
            state := NULL; work_ids := NULL; state_bytes := NULL; walk_from := NULL;
            IF res.verdict = 'rewind' THEN
                claimed := claimed + 1;
                taken := taken || (cand::text || '/' || name_);
                RETURN NEXT;
                CONTINUE;
            END IF;
            -- The pair's pending work after its cursor, in event-id order, as much as it is
            -- handed: an index range of the work table's key (no event is read here).
            IF c.last_event_id IS NULL THEN
                SELECT array_agg(x.id ORDER BY x.id) INTO ids FROM (
                    SELECT w.event_id AS id FROM wh_perspective_events w
                     WHERE w.perspective_name = name_ AND w.stream_id = cand
                     ORDER BY w.perspective_name, w.stream_id, w.event_id
                     LIMIT least(p_events_per_pair, events_left)) x;
            ELSE
                SELECT array_agg(x.id ORDER BY x.id) INTO ids FROM (
                    SELECT w.event_id AS id FROM wh_perspective_events w
                     WHERE w.perspective_name = name_ AND w.stream_id = cand
                       AND w.event_id > c.last_event_id
                     ORDER BY w.perspective_name, w.stream_id, w.event_id
                     LIMIT least(p_events_per_pair, events_left)) x;
            END IF;
            n := coalesce(cardinality(ids), 0);
            CONTINUE WHEN n = 0;
            claimed := claimed + 1;
            taken := taken || (cand::text || '/' || name_);
            events_left := events_left - n;
            kind := 'apply';
            state := (SELECT s.state FROM wh_perspective_states s
                       WHERE s.stream_id = cand AND s.perspective_name = name_);
            work_ids := ids;
            state_bytes := coalesce(pg_column_size(state), 0);
            walk_from := prev_pos;
            RETURN NEXT;
        END LOOP;
    END LOOP;

    FOR i IN 1 .. n_names LOOP
        kind := 'position'; stream_id := positions[i]; perspective_name := p_names[i];
        last_event_id := NULL; revision := NULL; applied_count := NULL;
        rewind_trigger_event_id := NULL; rewind_flagged_at := NULL;
        rewind_first_flagged_at := NULL; error := NULL; failures := NULL;
        latest_snapshot := NULL; stream_lock_instance_id := NULL; stream_lock_reason := NULL;
        stream_lock_expiry := NULL; stream_lock_epoch := NULL; failed_event_id := NULL;
        retry_at := NULL; parked_at := NULL; state := NULL; work_ids := NULL;
        state_bytes := NULL; walk_from := NULL;
        RETURN NEXT;
    END LOOP;
END
$$;
