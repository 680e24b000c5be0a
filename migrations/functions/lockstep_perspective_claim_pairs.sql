-- Claims a batch's pairs: the first of the two statements of lockstep-pg-store's claim_batch
-- (the worker's claim). It walks, locks and judges the pairs and gives each pair to apply the
-- ids of the pending work rows it is handed; the store's second statement (CLAIM_EVENTS) reads
-- their events, each pair's as one range of wh_events (stream_id, event_id), and applies the
-- byte bound. The events are not read here because a read per event costs an index descent
-- per event, a range per pair does not (docs/adr/0022-range-deleted-batch-work.md §2). The walk
-- and the claim: docs/adr/0012-batch-claims-backoff-and-parking.md.
--
-- Parameters: p_names, the perspectives in the order they are served (the worker rotates them,
-- so that no perspective's backlog fills every batch); p_after[i], the stream after which the
-- walk of p_names[i] continues (NULL: from the first stream). Bounds: at most p_max_pairs pairs
-- claimed, p_events_per_pair work ids per pair, p_max_events work ids in all, p_scan pairs
-- looked at by the walk. p_debounce_us and p_debounce_max_us: the rewind debounce, as in
-- lockstep_perspective_try_claim.
--
-- Rows, in this order:
--   kind 'rewind'    a claimed pair that needs a rewind: its cursor columns and latest snapshot;
--   kind 'apply'     a claimed pair to apply: its cursor columns, latest snapshot and state;
--                    work_ids, the ids of its work rows it is handed (ascending, at least one);
--                    state_bytes, pg_column_size of the state (the store counts the state's
--                    size as it arrives instead); walk_from, its perspective's position before
--                    it (where the store sends the walk back when the byte bound leaves the pair
--                    out, so that the next claim starts with it);
--   kind 'position'  one per perspective: where its walk stopped (stream_id; NULL when no pair
--                    was looked at and no position was given).
--
-- First the pairs with a rewind request whose debounce has passed, oldest request first, work or
-- not (an operator's request on an up-to-date pair has no work row to be found by); they are not
-- counted as looked at. Then, perspective by perspective, the pairs with work in stream order
-- from the perspective's position, wrapping round once: one descent of the work table's key
-- (perspective_name, stream_id, event_id) per pair, so a claim costs what the pairs it looks at
-- cost, never what the length of the queue is, and every pair with work is reached within one
-- round of the walk. Each pair is tried by lockstep_perspective_try_claim: rows other batches
-- hold, live leases, pairs backing off and parked pairs are passed over at one probe each and
-- never waited for, so instances split the work without segments or membership and a claim
-- never waits on another's cursor rows. The claimed rows stay locked FOR NO KEY UPDATE until
-- the batch's transaction ends (its commit is lockstep_perspective_commit_batch); so do the rows
-- that try_claim locked but that are not handed out ('idle', or no work left).
--
-- A pair that failed at an event after its cursor is handed out up to that event only: the
-- events before the failing one were committed with the failure, so its retry costs the failing
-- event alone, not its whole queue and the batch's event budget. The commit that succeeds clears
-- the failure, and the next claim hands out the rest at full size.
-- Raises no error of its own.
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
    -- The last work id a pair is handed out to: its failed event when it failed before.
    upto        uuid;
BEGIN
    -- Pairs whose rewind was requested, work or not (an operator's request on a pair that is
    -- up to date has no work row to be found by). This query locks nothing: try_claim locks and
    -- judges each pair again. A pair whose verdict is not 'rewind' is passed over here; if it
    -- has work, the walk can still hand it out (SKIP LOCKED does not skip a row that this
    -- transaction holds).
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
        res := lockstep_perspective_try_claim(rq.s, rq.p, p_debounce_us, p_debounce_max_us);
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
            -- Called as an expression: PL/pgSQL evaluates it without setting up a query.
            res := lockstep_perspective_try_claim(cand, name_, p_debounce_us, p_debounce_max_us);
            CONTINUE WHEN res.verdict IN ('skip', 'idle');
            c := res.c;
            kind := res.verdict; stream_id := c.stream_id; perspective_name := c.perspective_name;
            last_event_id := c.last_event_id; revision := c.revision;
            applied_count := c.applied_count;
            rewind_trigger_event_id := c.rewind_trigger_event_id;
            rewind_flagged_at := c.rewind_flagged_at;
            rewind_first_flagged_at := c.rewind_first_flagged_at;
            error := c.error; failures := c.failures;
            stream_lock_instance_id := c.stream_lock_instance_id;
            stream_lock_reason := c.stream_lock_reason; stream_lock_expiry := c.stream_lock_expiry;
            stream_lock_epoch := c.stream_lock_epoch; failed_event_id := c.failed_event_id;
            retry_at := c.retry_at; parked_at := c.parked_at;
            state := NULL; work_ids := NULL; state_bytes := NULL; walk_from := NULL;
            IF res.verdict = 'rewind' THEN
                latest_snapshot := (SELECT s.event_id FROM wh_perspective_snapshots s
                                     WHERE s.stream_id = c.stream_id
                                       AND s.perspective_name = c.perspective_name
                                     ORDER BY s.event_id DESC LIMIT 1);
                claimed := claimed + 1;
                taken := taken || (cand::text || '/' || name_);
                RETURN NEXT;
                CONTINUE;
            END IF;
            -- A pair that failed at an event after its cursor is handed out up to that event
            -- only: its retry costs what the failing event costs.
            upto := CASE WHEN c.failures > 0 AND c.failed_event_id IS NOT NULL
                               AND (c.last_event_id IS NULL
                                    OR c.failed_event_id > c.last_event_id)
                          THEN c.failed_event_id
                          ELSE 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid END;
            LOOP
                -- The pair's pending work after its cursor, in event-id order, as much as it is
                -- handed: an index range of the work table's key (no event is read here), as
                -- ARRAY(...) of the ordered subquery, so no sort. Its work ids, its state and its
                -- latest snapshot come from one statement: each statement PL/pgSQL runs costs its
                -- executor's start-up and shutdown. Two statements rather than an OR on
                -- c.last_event_id, as for the walk's probe: no OR on a variable in the cached
                -- generic plan.
                IF c.last_event_id IS NULL THEN
                    SELECT ARRAY(SELECT w.event_id FROM wh_perspective_events w
                                  WHERE w.perspective_name = name_ AND w.stream_id = cand
                                    AND w.event_id <= upto
                                  ORDER BY w.perspective_name, w.stream_id, w.event_id
                                  LIMIT least(p_events_per_pair, events_left)),
                           (SELECT s.state FROM wh_perspective_states s
                             WHERE s.stream_id = cand AND s.perspective_name = name_),
                           (SELECT s.event_id FROM wh_perspective_snapshots s
                             WHERE s.stream_id = cand AND s.perspective_name = name_
                             ORDER BY s.event_id DESC LIMIT 1)
                      INTO ids, st, latest_snapshot;
                ELSE
                    SELECT ARRAY(SELECT w.event_id FROM wh_perspective_events w
                                  WHERE w.perspective_name = name_ AND w.stream_id = cand
                                    AND w.event_id > c.last_event_id AND w.event_id <= upto
                                  ORDER BY w.perspective_name, w.stream_id, w.event_id
                                  LIMIT least(p_events_per_pair, events_left)),
                           (SELECT s.state FROM wh_perspective_states s
                             WHERE s.stream_id = cand AND s.perspective_name = name_),
                           (SELECT s.event_id FROM wh_perspective_snapshots s
                             WHERE s.stream_id = cand AND s.perspective_name = name_
                             ORDER BY s.event_id DESC LIMIT 1)
                      INTO ids, st, latest_snapshot;
                END IF;
                n := coalesce(cardinality(ids), 0);
                -- Nothing pending up to the failed event (a failure recorded at an event that is
                -- no work row of the pair): the pair's work without that bound, so the bound
                -- never holds a pair back.
                EXIT WHEN n > 0 OR upto = 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid;
                upto := 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid;
            END LOOP;
            -- No work after the cursor (e.g. another transaction committed it between the
            -- walk's probe and the claim): not handed out; the row stays locked.
            CONTINUE WHEN n = 0;
            claimed := claimed + 1;
            taken := taken || (cand::text || '/' || name_);
            events_left := events_left - n;
            kind := 'apply';
            state := st;
            work_ids := ids;
            state_bytes := coalesce(pg_column_size(state), 0);
            walk_from := prev_pos;
            RETURN NEXT;
        END LOOP;
    END LOOP;

    -- Where each perspective's walk stopped: the next claim of this instance continues after it.
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
