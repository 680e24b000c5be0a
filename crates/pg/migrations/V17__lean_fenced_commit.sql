-- lockstep V17: the fenced commit that releases its lease, in one function body
-- (issue 18, `rewind_snapshot_vs_full`; docs/adr/0026-lean-fenced-commit.md).
--
-- `lockstep_perspective_commit_release` (V9), the last statement of every rewind, called
-- `lockstep_perspective_commit` (V8), which called `lockstep_perspective_check` (V5) and
-- `lockstep_perspective_prune_snapshots` (V5, a SQL function: parsed and planned again on every
-- call), then updated the cursor row a second time to clear the lease. The same checks and
-- writes now run in the one function, and the lease is cleared by the cursor's own update:
-- three nested calls and one row version fewer per rewind. Same signature, rows and outcomes:
--
-- - the cursor row is locked (`FOR NO KEY UPDATE`); no row: 'no_cursor' without a fence,
--   'lease_lost' with one;
-- - the fence (holder, epoch, live on the database clock) and the compare-and-set on the
--   revision, in that order: 'lease_lost', 'conflict' — nothing written;
-- - the state upsert, the applied work rows deleted, the cursor advanced (revision + 1, error,
--   failures, failed event, backoff and parking cleared, the rewind request cleared if its
--   trigger is still `p_rewound_from`), the snapshots from `p_rewound_from` on dropped, the new
--   snapshot written and the pair's snapshots pruned to `p_keep`;
-- - `released`: the lease's columns (holder, reason, expiry; the epoch stays, so the next
--   acquire gets a later one) cleared in the cursor's update when the locked row's holder and
--   epoch are the fence's — as V9's separate update did, on the same locked row.
--
-- `lockstep_perspective_prune_snapshots` becomes PL/pgSQL (same signature and effect), so its
-- one statement is planned once per connection for its other callers (the per-pair commit).
-- `lockstep_perspective_commit` and `lockstep_perspective_check` are unchanged.
--
-- Every statement is re-runnable.

CREATE OR REPLACE FUNCTION lockstep_perspective_prune_snapshots(
    p_stream_id   uuid,
    p_perspective text,
    p_keep        integer
) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    DELETE FROM wh_perspective_snapshots s
     WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective
       AND s.event_id < (SELECT k.event_id FROM wh_perspective_snapshots k
                          WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
                          ORDER BY k.event_id DESC OFFSET greatest(p_keep, 1) - 1 LIMIT 1);
END
$$;

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
DECLARE
    c       wh_perspective_cursors%ROWTYPE;
    release boolean;
BEGIN
    released := false;
    -- lockstep_perspective_check, inline.
    SELECT * INTO c FROM wh_perspective_cursors k
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        outcome := CASE WHEN p_fence_holder IS NULL THEN 'no_cursor' ELSE 'lease_lost' END;
        RETURN;
    END IF;
    revision := c.revision;
    IF p_fence_holder IS NOT NULL
       AND NOT (c.stream_lock_instance_id IS NOT DISTINCT FROM p_fence_holder
                AND c.stream_lock_epoch = p_fence_epoch
                AND c.stream_lock_expiry > clock_timestamp()) THEN
        outcome := 'lease_lost';
        RETURN;
    ELSIF p_expected_revision IS NOT NULL AND c.revision <> p_expected_revision THEN
        outcome := 'conflict';
        RETURN;
    END IF;
    -- V9's release condition, on the row this transaction holds locked (the commit's own
    -- update below changes no lease column).
    release := coalesce(p_fence_holder IS NOT NULL
                        AND c.stream_lock_instance_id = p_fence_holder
                        AND c.stream_lock_epoch = p_fence_epoch, false);

    -- lockstep_perspective_commit (V8), inline.
    INSERT INTO wh_perspective_states AS s (stream_id, perspective_name, state)
    VALUES (p_stream_id, p_perspective, p_state)
    ON CONFLICT (stream_id, perspective_name)
    DO UPDATE SET state = EXCLUDED.state, updated_at = clock_timestamp();
    DELETE FROM wh_perspective_events w
     WHERE w.perspective_name = p_perspective AND w.stream_id = p_stream_id
       AND w.event_id = ANY (p_applied);
    UPDATE wh_perspective_cursors k
       SET last_event_id = p_last_event_id,
           applied_count = p_applied_count,
           revision = k.revision + 1,
           processed_at = clock_timestamp(),
           error = NULL,
           failures = 0,
           failed_event_id = NULL,
           retry_at = NULL,
           parked_at = NULL,
           rewind_trigger_event_id = CASE WHEN k.rewind_trigger_event_id = p_rewound_from
                                          THEN NULL ELSE k.rewind_trigger_event_id END,
           rewind_flagged_at = CASE WHEN k.rewind_trigger_event_id = p_rewound_from
                                    THEN NULL ELSE k.rewind_flagged_at END,
           rewind_first_flagged_at = CASE WHEN k.rewind_trigger_event_id = p_rewound_from
                                          THEN NULL ELSE k.rewind_first_flagged_at END,
           status = CASE WHEN k.rewind_trigger_event_id = p_rewound_from
                         THEN k.status & ~1 ELSE k.status END,
           -- V9's release, in the same row version.
           stream_lock_instance_id = CASE WHEN release THEN NULL
                                          ELSE k.stream_lock_instance_id END,
           stream_lock_reason = CASE WHEN release THEN NULL ELSE k.stream_lock_reason END,
           stream_lock_expiry = CASE WHEN release THEN NULL ELSE k.stream_lock_expiry END
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
    RETURNING k.revision INTO revision;
    IF p_rewound_from IS NOT NULL THEN
        DELETE FROM wh_perspective_snapshots s
         WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective
           AND s.event_id >= p_rewound_from;
    END IF;
    IF p_snapshot AND p_last_event_id IS NOT NULL THEN
        INSERT INTO wh_perspective_snapshots AS s
               (stream_id, perspective_name, event_id, state, applied_count)
        VALUES (p_stream_id, p_perspective, p_last_event_id, p_state, p_applied_count)
        ON CONFLICT (stream_id, perspective_name, event_id)
        DO UPDATE SET state = EXCLUDED.state, applied_count = EXCLUDED.applied_count,
                      created_at = clock_timestamp();
        -- lockstep_perspective_prune_snapshots, inline.
        DELETE FROM wh_perspective_snapshots s
         WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective
           AND s.event_id < (SELECT k.event_id FROM wh_perspective_snapshots k
                              WHERE k.stream_id = p_stream_id
                                AND k.perspective_name = p_perspective
                              ORDER BY k.event_id DESC OFFSET greatest(p_keep, 1) - 1 LIMIT 1);
    END IF;
    outcome := 'committed';
    released := release;
END
$$;
