-- Commits a batch in one statement: lockstep-pg-store's commit_batch, the commit of a batch the
-- worker claimed with lockstep_perspective_claim_pairs.
--
-- Entry i is the i-th element of every array. It is a state change when p_has_commit[i] (the
-- parameters of lockstep_perspective_commit; its applied events are p_applied_lens[i] elements
-- of p_applied, the entries' ids concatenated in entry order), then a failure when p_errors[i]
-- is not NULL (the parameters of lockstep_perspective_record_failure: p_failed_events,
-- p_retry_after_us, p_park). For a pair whose apply failed at an event, the worker sends one
-- entry: the fold of the events before that event, and the failure.
-- One row per entry, in entry order: its ordinal (from 1); outcome 'committed', 'recorded' (no
-- state change; its failure, if any, stored) or the refusal of its state change ('conflict',
-- 'no_cursor', 'lease_lost': nothing of the entry written, its failure not stored, the other
-- entries unaffected); the new revision; whether the pair is parked.
-- Raises SQLSTATE 22023 when the applied events do not add up to their lengths, and 40001 if a
-- cursor the set-based path locked has another revision than expected at its update (the lock
-- rules that out; the check keeps a cursor from ever moving without its compare-and-set).
--
-- The ordinary entries are committed set-based: a state change that is not a rewind's
-- (p_rewound_from NULL), of a pair that appears once in the batch, its cursor at the expected
-- revision with the fence (if any) held. One statement per table serves all of them: lock and
-- check the cursors, delete the applied work rows, upsert the states, advance the cursors, write
-- the snapshots, prune; then one upsert stores their failures. A call per entry cost seven
-- statements each, most of a batch commit's time. Every other entry (refused, a rewind's commit,
-- a pair twice) goes through lockstep_perspective_commit and lockstep_perspective_record_failure
-- one by one, after them: entries of different pairs touch disjoint rows, so the order between
-- the two groups changes no outcome. Each set-based statement joins the entries (unnest of
-- arrays, estimated at 10 rows) with a table's primary key and has no OR on a parameter, so the
-- generic plan PL/pgSQL caches after a few calls keeps every probe an index condition.
--
-- Lock order: the set-based entries' cursor rows in entry order, then the failure upsert's rows
-- in entry order, then the per-entry path's. In the worker every row of the batch is already
-- locked by its claim, so nothing waits. Callers that commit unclaimed batches concurrently, on
-- overlapping pairs in different orders, can deadlock (PostgreSQL detects it: 40P01).
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
    -- The entries whose failure the one upsert stored, and whether it parked them.
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
        -- event, which cost more than half of the commit's server time
        -- (docs/adr/0022-range-deleted-batch-work.md). The range holds the applied rows and any
        -- late arrival enqueued inside it after the claim (it must stay: it triggers the
        -- rewind); no applied row goes meanwhile, since every other path that deletes work rows
        -- locks the cursor row first, and this transaction holds it. So equal counts mean the
        -- very rows applied. When they differ (a late arrival, or an applied id that is no work
        -- row), the range delete is rolled back (the block is a subtransaction) and every
        -- set-based entry's rows are deleted exactly, by id. A pair whose applied ids do not
        -- start with the smallest and end with the largest (the store sends them in ascending
        -- order) goes the exact way at once. The counts are compared in total: a late arrival in
        -- one pair's range and an applied id that is no work row in another's would cancel out.
        -- Applied ids are claimed work rows (StateCommit::applied_events requires it); a check
        -- pair by pair (the delete's RETURNING, grouped) cost the catch-up 8-10 %.
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
            -- LSRNG: this function's own SQLSTATE, caught right below.
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
    -- order after the commits, each row as lockstep_perspective_record_failure writes it (a
    -- commit reset the count to 0, so a committed pair's count becomes 1). One statement for
    -- all, not a call each: that SQL-language function is planned again on every call.
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

    -- One row per entry, in entry order. An entry committed or recorded above has its result;
    -- every other entry goes through the per-pair functions here: its state change (whose
    -- refusal is its outcome), then its failure if the state change went ahead.
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
