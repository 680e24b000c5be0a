-- lockstep V15: a batch commit deletes each pair's applied work rows as one index range
-- (issue 18, speed; docs/adr/0022-range-deleted-batch-work.md).
--
-- `lockstep_perspective_commit_batch` keeps its signature, its outcomes and V9's body but for
-- one statement. V9's set-based path deleted exactly the applied work rows with
-- `event_id = ANY (…)`: one descent of the work table's key per event, more than half the
-- commit's server time in the catch-up benchmark. Now it deletes each pair's rows from its
-- first to its last applied event — one descent per pair — inside a subtransaction, and checks
-- that it deleted as many rows as were applied. The range holds other rows only if a work row
-- was enqueued inside it after the claim (a late arrival: it must stay, it triggers the
-- rewind) or an applied row disappeared meanwhile; then the counts differ, the range delete is
-- rolled back and V9's exact delete runs instead. Nothing else deletes the work rows of a pair
-- whose cursor row this transaction holds locked — every other path locks the cursor row
-- first (skipping an event does since this release) — and the store sends each pair's applied
-- ids in ascending order without repeats, so equal counts mean the very rows applied. A pair
-- whose ids do not start with the smallest and end with the largest is deleted exactly at
-- once.
--
-- A binary of the previous release keeps working on a V15 schema (same function, same rows),
-- and a V15 binary on a V14 schema (it only sorts what it sends).
--
-- Every statement is re-runnable.

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
               AND p_errors[e.i] IS NULL
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
        -- ascending order) goes the exact way at once.
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

    -- One row per entry, in entry order; the others as V8 did them.
    FOR i IN 1 .. n_ LOOP
        ord := i;
        parked := false;
        IF revs[i] IS NOT NULL THEN
            outcome := 'committed';
            revision := revs[i];
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
