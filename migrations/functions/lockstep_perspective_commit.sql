-- Commits one pair's state change, in one statement: lockstep-pg-store's commit_state, and the
-- per-entry path of lockstep_perspective_commit_batch (entries the set-based path does not take).
-- In this order:
-- 1. the checks (lockstep_perspective_check): the cursor row locked FOR NO KEY UPDATE, waiting
--    for it, until the transaction ends (so a passed fence stays passed: a takeover, renew or
--    force-release of the lease waits for this transaction); the fence (p_fence_holder and
--    p_fence_epoch, NULL: no fence) and the compare-and-set on the revision
--    (p_expected_revision, NULL: no check);
-- 2. the state upsert;
-- 3. exactly the applied work rows deleted (p_applied): a work row enqueued after the claim,
--    even between two applied ids, must stay, it triggers the pair's rewind;
-- 4. the cursor advanced: p_last_event_id, p_applied_count, revision + 1, processed_at; the
--    error, the failure count, the failed event, the backoff and the parking cleared (a pair that
--    made progress starts counting failures again);
-- 5. for a rewind's commit (p_rewound_from, the trigger it rewound from): the request cleared if
--    its trigger is still p_rewound_from (a late arrival that moved it earlier meanwhile keeps
--    its request, and the pair rewinds again), and the snapshots at or after p_rewound_from
--    dropped (they are folds that miss the late event);
-- 6. when p_snapshot, the new state snapshotted at p_last_event_id and the pair's snapshots
--    pruned to the newest p_keep.
-- Returns outcome 'committed' and the new revision, or a refusal: 'no_cursor' (no row, no
-- fence), 'lease_lost' (the fence does not hold, or no row with a fence) or 'conflict' (another
-- revision), with the revision found (NULL: no row). A refusal writes nothing and leaves the
-- transaction usable. Raises no error of its own.
CREATE OR REPLACE FUNCTION lockstep_perspective_commit(
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
    OUT revision        bigint
)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    refused text;
BEGIN
    SELECT ch.refusal, ch.cursor_revision INTO refused, revision
      FROM lockstep_perspective_check(p_stream_id, p_perspective, p_expected_revision,
                                      p_fence_holder, p_fence_epoch) ch;
    IF refused IS NOT NULL THEN
        outcome := refused;
        RETURN;
    END IF;
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
                         THEN k.status & ~1 ELSE k.status END
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
        PERFORM lockstep_perspective_prune_snapshots(p_stream_id, p_perspective, p_keep);
    END IF;
    outcome := 'committed';
END
$$;
