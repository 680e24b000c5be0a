-- Bootstrap: snapshots the pair's current state at its last applied event if the cursor is
-- still at p_expected_revision and has applied events, then prunes the pair's snapshots to the
-- newest p_keep. Returns 'saved', 'unchanged' (no cursor, moved on, nothing applied, or that
-- snapshot exists) or 'lease_lost' (the fence p_fence_holder, p_fence_epoch does not hold; NULL:
-- no fence). Writes no state and does not move the revision.
-- Caller: lockstep-pg-store's save_snapshot, for the worker's bootstrap on the one-pair path
-- (PerspectiveWorker::process_pair) of a pair that has applied events but no snapshot, under a
-- 'bootstrap' lease when it gets one and without a fence when it does not: the save is
-- idempotent and refused once the cursor moved on. (A batch's commit writes a pair's first
-- snapshot itself.)
-- The cursor row is locked FOR NO KEY UPDATE until the transaction ends
-- (lockstep_perspective_check), so the state read is the fold at the cursor's last event: no
-- commit can move it meanwhile.
CREATE OR REPLACE FUNCTION lockstep_perspective_save_snapshot(
    p_stream_id         uuid,
    p_perspective       text,
    p_expected_revision bigint,
    p_keep              integer,
    p_fence_holder      uuid,
    p_fence_epoch       bigint
) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    refused text;
BEGIN
    SELECT ch.refusal INTO refused
      FROM lockstep_perspective_check(p_stream_id, p_perspective, p_expected_revision,
                                      p_fence_holder, p_fence_epoch) ch;
    IF refused = 'lease_lost' THEN
        RETURN 'lease_lost';
    ELSIF refused IS NOT NULL THEN
        RETURN 'unchanged';
    END IF;
    INSERT INTO wh_perspective_snapshots (stream_id, perspective_name, event_id, state, applied_count)
    SELECT k.stream_id, k.perspective_name, k.last_event_id, s.state, k.applied_count
      FROM wh_perspective_cursors k
      JOIN wh_perspective_states s
        ON s.stream_id = k.stream_id AND s.perspective_name = k.perspective_name
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
       AND k.last_event_id IS NOT NULL
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN 'unchanged';
    END IF;
    PERFORM lockstep_perspective_prune_snapshots(p_stream_id, p_perspective, p_keep);
    RETURN 'saved';
END
$$;
