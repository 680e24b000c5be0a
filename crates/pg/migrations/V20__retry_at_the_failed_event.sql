-- lockstep V20: a failing pair's retry costs what its failing event costs, and a batch's
-- failures are stored by one statement (issue 18, the starved line;
-- docs/adr/0030-retry-at-the-failed-event.md).
--
-- `lockstep_perspective_claim_pairs`: a pair that failed before (`failures > 0`) at an event
-- after its cursor (`failed_event_id`) is handed out up to that event only. When `apply`
-- failed, the events before the failing one were committed with the failure (ADR 0012), so
-- that is the failing event alone: a poisoned pair with 1 000 events queued was read in full
-- on every retry, and now costs one event of the batch's budget. (A state that could not be
-- stored is recorded at the last event of its fold: its retry gets the same events again.)
-- When the retry succeeds (the failure was transient, or an operator fixed the cause) the
-- commit clears the failure and the next claim hands out the rest at full size. When nothing
-- is pending up to that event (a failure recorded at an event that is not pending work; a
-- skip or a purge clears the count), the pair is handed out as before. Everything else is
-- V18's.
--
-- `lockstep_perspective_commit_batch`: an entry that commits the events before its failing
-- one takes the set-based path of V9 like any other (it went entry by entry), and the
-- failures of a batch — of those entries and of the entries with nothing to commit, their
-- pair once in the batch — are stored by one upsert in entry order, after the commits,
-- instead of one `lockstep_perspective_record_failure` call each (a SQL function, planned on
-- every call). Same rows, outcomes and parking; the other entries are V15's.
--
-- Same signatures and results. Re-runnable.

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
            -- only (V20): its retry costs what the failing event costs.
            upto := CASE WHEN c.failures > 0 AND c.failed_event_id IS NOT NULL
                               AND (c.last_event_id IS NULL
                                    OR c.failed_event_id > c.last_event_id)
                          THEN c.failed_event_id
                          ELSE 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid END;
            LOOP
                -- The pair's pending work after its cursor, in event-id order, as much as it is
                -- handed: an index range of the work table's key (no event is read here).
                -- Its work ids, its state and its latest snapshot: one statement.
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
                -- Nothing pending up to the failed event (not a work row of the pair): the
                -- pair's work as V18 hands it out.
                EXIT WHEN n > 0 OR upto = 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid;
                upto := 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid;
            END LOOP;
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

CREATE OR REPLACE FUNCTION lockstep_perspective_commit_batch(
    p_stream_ids      uuid[],
    p_perspectives    text[],
    p_has_commit      boolean[],
    p_expected        bigint[],
    p_states          jsonb[],
    p_last_event_ids  uuid[],
    p_applied_counts  bigint[],
    p_applied_lens    integer[],
    p_applied         uuid[],
    p_rewound_from    uuid[],
    p_snapshots       boolean[],
    p_fence_holders   uuid[],
    p_fence_epochs    bigint[],
    p_keep            integer,
    p_errors          text[],
    p_failed_events   uuid[],
    p_retry_after_us  bigint[],
    p_park            boolean[]
) RETURNS TABLE (ord integer, outcome text, revision bigint, parked boolean)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    n_    integer := coalesce(cardinality(p_stream_ids), 0);
    -- offs[i]: where entry i's applied events start in p_applied (0-based).
    offs  integer[];
    -- The ordinals of the entries committed set-based, and their new revisions by ordinal.
    fast  integer[];
    revs  bigint[];
    off_  integer := 0;
    len_  integer;
    n_up  integer := 0;
    r     record;
    -- The set-based entries whose work rows go by range, those that go one by one, how
    -- many rows the ranges must hold, and how many they did.
    ranged    integer[];
    exact     integer[];
    n_applied bigint;
    n_deleted bigint;
    -- The entries whose failure the one upsert stored (V20), and whether it parked them.
    failed_  boolean[];
    parked_  boolean[];
BEGIN
    IF n_ = 0 THEN
        RETURN;
    END IF;
    offs := array_fill(0, ARRAY[n_]);
    revs := array_fill(NULL::bigint, ARRAY[n_]);
    FOR i IN 1 .. n_ LOOP
        offs[i] := off_;
        off_ := off_ + coalesce(p_applied_lens[i], 0);
    END LOOP;
    IF off_ <> coalesce(cardinality(p_applied), 0) THEN
        RAISE EXCEPTION 'lockstep_perspective_commit_batch: the applied events (%) do not add up to their lengths (%)',
            coalesce(cardinality(p_applied), 0), off_
            USING ERRCODE = '22023';
    END IF;

    -- The set-based entries: lock their cursor rows (in entry order, as the per-entry path
    -- does) and keep those whose revision and fence hold. A row another transaction changes
    -- while we wait is re-checked on its new version (READ COMMITTED); an entry that does not
    -- pass is left to the per-entry path, which gives its refusal.
    SELECT coalesce(array_agg(x.i ORDER BY x.i), '{}') INTO fast
      FROM (SELECT e.i
              FROM (SELECT s.i, s.sid, s.pn,
                           count(*) OVER (PARTITION BY s.sid, s.pn) AS dup
                      FROM unnest(p_stream_ids, p_perspectives) WITH ORDINALITY s(sid, pn, i)) e
              JOIN wh_perspective_cursors k
                ON k.stream_id = e.sid AND k.perspective_name = e.pn
             WHERE e.dup = 1
               AND p_has_commit[e.i]
               AND p_rewound_from[e.i] IS NULL
               AND k.revision = p_expected[e.i]
               AND (p_fence_holders[e.i] IS NULL
                    OR (k.stream_lock_instance_id = p_fence_holders[e.i]
                        AND k.stream_lock_epoch = p_fence_epochs[e.i]
                        AND k.stream_lock_expiry > clock_timestamp()))
             ORDER BY e.i
               FOR NO KEY UPDATE OF k) x;

    IF cardinality(fast) > 0 THEN
        -- Exactly the applied work rows. Each pair's rows from its first to its last applied
        -- event are one range of the work table's key: one descent per pair instead of one per
        -- event (V9). The range holds exactly the applied rows unless a late arrival was
        -- enqueued inside it after the claim (it must stay: it triggers the rewind) or an
        -- applied row is gone; then the counts differ, the range delete is rolled back (the
        -- block is a subtransaction) and V9's exact delete runs. A pair whose applied ids do
        -- not start with the smallest and end with the largest (the store sends them in
        -- ascending order) goes the exact way at once. The counts are compared in total: a
        -- late arrival in one pair's range and an applied id that is no work row in another's
        -- would cancel out. Applied ids are claimed work rows (the contract says so); a check
        -- pair by pair (the delete's RETURNING, grouped) cost the catch-up 8-10 % (ADR 0030).
        SELECT coalesce(array_agg(f.i ORDER BY f.i), '{}'),
               coalesce(sum(p_applied_lens[f.i]), 0)
          INTO ranged, n_applied
          FROM unnest(fast) f(i)
         WHERE p_applied_lens[f.i] > 0
           AND p_applied[offs[f.i] + 1]
               <= ALL (p_applied[offs[f.i] + 1 : offs[f.i] + p_applied_lens[f.i]])
           AND p_applied[offs[f.i] + p_applied_lens[f.i]]
               >= ALL (p_applied[offs[f.i] + 1 : offs[f.i] + p_applied_lens[f.i]]);
        exact := ARRAY(SELECT f.i FROM unnest(fast) f(i) WHERE f.i <> ALL (ranged));
        BEGIN
            DELETE FROM wh_perspective_events w
             USING unnest(ranged) f(i)
             WHERE w.perspective_name = p_perspectives[f.i]
               AND w.stream_id = p_stream_ids[f.i]
               AND w.event_id >= p_applied[offs[f.i] + 1]
               AND w.event_id <= p_applied[offs[f.i] + p_applied_lens[f.i]];
            GET DIAGNOSTICS n_deleted = ROW_COUNT;
            IF n_deleted <> n_applied THEN
                RAISE EXCEPTION USING ERRCODE = 'LSRNG',
                    MESSAGE = 'an applied range holds other work rows';
            END IF;
        EXCEPTION WHEN SQLSTATE 'LSRNG' THEN
            exact := fast;
        END;
        IF cardinality(exact) > 0 THEN
            DELETE FROM wh_perspective_events w
             USING unnest(exact) f(i)
             WHERE w.perspective_name = p_perspectives[f.i]
               AND w.stream_id = p_stream_ids[f.i]
               AND w.event_id = ANY (p_applied[offs[f.i] + 1 : offs[f.i] + p_applied_lens[f.i]]);
        END IF;

        INSERT INTO wh_perspective_states AS s (stream_id, perspective_name, state)
        SELECT p_stream_ids[f.i], p_perspectives[f.i], p_states[f.i]
          FROM unnest(fast) f(i)
        ON CONFLICT (stream_id, perspective_name)
        DO UPDATE SET state = EXCLUDED.state, updated_at = clock_timestamp();

        -- The check again: the rows are locked by this transaction, so it holds; it keeps a
        -- cursor from ever moving without its compare-and-set.
        FOR r IN
            WITH u AS (
                UPDATE wh_perspective_cursors k
                   SET last_event_id = p_last_event_ids[f.i],
                       applied_count = p_applied_counts[f.i],
                       revision = k.revision + 1,
                       processed_at = clock_timestamp(),
                       error = NULL,
                       failures = 0,
                       failed_event_id = NULL,
                       retry_at = NULL,
                       parked_at = NULL
                  FROM unnest(fast) f(i)
                 WHERE k.stream_id = p_stream_ids[f.i]
                   AND k.perspective_name = p_perspectives[f.i]
                   AND k.revision = p_expected[f.i]
                RETURNING f.i AS i, k.revision AS rev)
            SELECT u.i, u.rev FROM u
        LOOP
            revs[r.i] := r.rev;
            n_up := n_up + 1;
        END LOOP;
        IF n_up <> cardinality(fast) THEN
            RAISE EXCEPTION 'lockstep_perspective_commit_batch: % of % locked cursors moved during the commit',
                cardinality(fast) - n_up, cardinality(fast)
                USING ERRCODE = '40001';
        END IF;

        INSERT INTO wh_perspective_snapshots AS s
               (stream_id, perspective_name, event_id, state, applied_count)
        SELECT p_stream_ids[f.i], p_perspectives[f.i], p_last_event_ids[f.i], p_states[f.i],
               p_applied_counts[f.i]
          FROM unnest(fast) f(i)
         WHERE p_snapshots[f.i] AND p_last_event_ids[f.i] IS NOT NULL
        ON CONFLICT (stream_id, perspective_name, event_id)
        DO UPDATE SET state = EXCLUDED.state, applied_count = EXCLUDED.applied_count,
                      created_at = clock_timestamp();
        GET DIAGNOSTICS n_up = ROW_COUNT;
        IF n_up > 0 THEN
            -- As lockstep_perspective_prune_snapshots, for every pair that wrote one.
            DELETE FROM wh_perspective_snapshots s
             USING unnest(fast) f(i)
             WHERE p_snapshots[f.i] AND p_last_event_ids[f.i] IS NOT NULL
               AND s.stream_id = p_stream_ids[f.i]
               AND s.perspective_name = p_perspectives[f.i]
               AND s.event_id < (SELECT k.event_id FROM wh_perspective_snapshots k
                                  WHERE k.stream_id = p_stream_ids[f.i]
                                    AND k.perspective_name = p_perspectives[f.i]
                                  ORDER BY k.event_id DESC
                                 OFFSET greatest(p_keep, 1) - 1 LIMIT 1);
        END IF;
    END IF;

    -- The failures of the entries with no state to commit and of those committed above (the
    -- events before the failing one), their pair once in the batch: one upsert in entry
    -- order after the commits, each row as lockstep_perspective_record_failure writes it
    -- (V20; that SQL function is planned on every call).
    failed_ := array_fill(false, ARRAY[n_]);
    parked_ := array_fill(false, ARRAY[n_]);
    -- (A simple expression: a batch without failures sets up no query for them.)
    IF cardinality(array_remove(p_errors, NULL)) > 0 THEN
        FOR r IN
            WITH f AS (
                SELECT e.i, e.sid, e.pn
                  FROM (SELECT s.i, s.sid, s.pn,
                               count(*) OVER (PARTITION BY s.sid, s.pn) AS dup
                          FROM unnest(p_stream_ids, p_perspectives) WITH ORDINALITY s(sid, pn, i)) e
                 WHERE e.dup = 1
                   AND p_errors[e.i] IS NOT NULL
                   AND (NOT coalesce(p_has_commit[e.i], false) OR revs[e.i] IS NOT NULL)),
            u AS (
                INSERT INTO wh_perspective_cursors AS k
                       (stream_id, perspective_name, error, failures, failed_event_id, retry_at,
                        parked_at)
                SELECT f.sid, f.pn, p_errors[f.i], 1, p_failed_events[f.i],
                       clock_timestamp() + p_retry_after_us[f.i] * interval '1 microsecond',
                       CASE WHEN p_park[f.i] THEN clock_timestamp() END
                  FROM f
                 ORDER BY f.i
                ON CONFLICT (stream_id, perspective_name)
                DO UPDATE SET error = EXCLUDED.error,
                              failures = CASE WHEN k.failures >= 2147483647 THEN k.failures
                                              ELSE k.failures + 1 END,
                              failed_event_id = EXCLUDED.failed_event_id,
                              retry_at = EXCLUDED.retry_at,
                              -- Parked when asked (EXCLUDED.parked_at is set), and never unparked.
                              parked_at = coalesce(k.parked_at, EXCLUDED.parked_at)
                RETURNING k.stream_id, k.perspective_name, k.parked_at IS NOT NULL AS parked)
            SELECT f.i, u.parked FROM u JOIN f ON f.sid = u.stream_id AND f.pn = u.perspective_name
        LOOP
            failed_[r.i] := true;
            parked_[r.i] := r.parked;
        END LOOP;
    END IF;

    -- One row per entry, in entry order; the others as V8 did them.
    FOR i IN 1 .. n_ LOOP
        ord := i;
        parked := false;
        IF revs[i] IS NOT NULL THEN
            outcome := 'committed';
            revision := revs[i];
            parked := parked_[i];
            RETURN NEXT;
            CONTINUE;
        END IF;
        IF failed_[i] THEN
            outcome := 'recorded';
            revision := NULL;
            parked := parked_[i];
            RETURN NEXT;
            CONTINUE;
        END IF;
        outcome := 'recorded';
        revision := NULL;
        off_ := offs[i];
        len_ := coalesce(p_applied_lens[i], 0);
        IF p_has_commit[i] THEN
            SELECT * INTO r FROM lockstep_perspective_commit(
                p_stream_ids[i], p_perspectives[i], p_expected[i], p_states[i],
                p_last_event_ids[i], p_applied_counts[i], p_applied[off_ + 1 : off_ + len_],
                p_rewound_from[i], p_snapshots[i], p_keep, p_fence_holders[i],
                p_fence_epochs[i]) x;
            outcome := r.outcome;
            revision := r.revision;
        END IF;
        IF outcome IN ('committed', 'recorded') AND p_errors[i] IS NOT NULL THEN
            parked := lockstep_perspective_record_failure(
                p_stream_ids[i], p_perspectives[i], p_errors[i], p_failed_events[i],
                p_retry_after_us[i], p_park[i]);
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
