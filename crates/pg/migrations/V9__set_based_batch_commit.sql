-- lockstep V9: a batch commits its ordinary entries set-based (issue 18;
-- docs/adr/0012-batch-claims-backoff-and-parking.md §7).
--
-- `lockstep_perspective_commit_batch` keeps its signature and its outcomes, so a binary of the
-- previous release keeps working on a V9 schema. Its body no longer calls V5's per-pair commit
-- for every entry: the entries that are a plain state change — no failure, no rewind, a pair
-- that appears once in the batch, its cursor there with the expected revision and the fence
-- (if any) held — are committed with one statement per table over the entries' arrays: lock
-- and check the cursors, delete exactly the applied work rows, upsert the states, advance the
-- cursors, write the snapshots, prune. Every other entry (refused, a failure, a rewind, a pair
-- twice) goes through the per-entry functions of V8 as before, so its outcome is the same.
--
-- A rewind also commits and releases its lease in one statement:
-- `lockstep_perspective_commit_release` is V5's commit, fenced on the lease, that clears the
-- lease (as the stream locker's release does) when it commits.
--
-- Every statement of the batch commit joins the entries (unnest of an array of ordinals) with
-- a table's primary key and has no OR on a parameter, so the generic plan PL/pgSQL caches after
-- a few calls keeps every probe an index condition (ADR 0012 §1): on a large table a nested
-- loop of index descents (unnest is estimated at 10 rows), on a small one a hash of it.
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
        -- Exactly the applied work rows (not a range up to the last one: a late arrival
        -- enqueued inside the range after the claim must stay, it triggers the rewind).
        DELETE FROM wh_perspective_events w
         USING unnest(fast) f(i)
         WHERE w.perspective_name = p_perspectives[f.i]
           AND w.stream_id = p_stream_ids[f.i]
           AND w.event_id = ANY (p_applied[offs[f.i] + 1 : offs[f.i] + p_applied_lens[f.i]]);

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

-- A fenced commit that also releases the fence's lease (the rewind's last two steps in one
-- statement): lockstep_perspective_commit, then, if it committed, the lease columns cleared as
-- the stream locker's release clears them (holder and epoch must still match; the epoch stays,
-- so the next acquire gets a later one). `released`: whether the lease was released.
CREATE OR REPLACE FUNCTION lockstep_perspective_commit_release(
    p_stream_id         uuid,
    p_perspective       text,
    p_expected_revision bigint,
    p_state             jsonb,
    p_last_event_id     uuid,
    p_applied_count     bigint,
    p_applied           uuid[],
    p_rewound_from      uuid,
    p_snapshot          boolean,
    p_keep              integer,
    p_fence_holder      uuid,
    p_fence_epoch       bigint,
    OUT outcome         text,
    OUT revision        bigint,
    OUT released        boolean
)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    SELECT c.outcome, c.revision INTO outcome, revision
      FROM lockstep_perspective_commit(p_stream_id, p_perspective, p_expected_revision, p_state,
                                       p_last_event_id, p_applied_count, p_applied,
                                       p_rewound_from, p_snapshot, p_keep, p_fence_holder,
                                       p_fence_epoch) c;
    released := false;
    IF outcome = 'committed' AND p_fence_holder IS NOT NULL THEN
        UPDATE wh_perspective_cursors k
           SET stream_lock_instance_id = NULL, stream_lock_reason = NULL,
               stream_lock_expiry = NULL
         WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
           AND k.stream_lock_instance_id = p_fence_holder
           AND k.stream_lock_epoch = p_fence_epoch;
        released := FOUND;
    END IF;
END
$$;
