-- Purges a pair: deletes its state, its snapshots and its pending work, and resets its cursor:
-- no event applied, no rewind request, no error, failure count, failed event, backoff or
-- parking; revision + 1, so a commit computed from the state before the purge fails its
-- compare-and-set. A lease on the pair stays (the caller's), and the skipped events stay
-- skipped: the operator's decision outlives a rebuild.
-- The cursor is marked purged (status bit 2): the next claim that finds work on the pair turns
-- it into a rewind from the start of the stream (trigger: the nil id), which replays the whole
-- stream. Folding only the events after the purge onto an empty state would give a state that
-- is the fold of no prefix of the stream.
-- The cursor row is locked FOR NO KEY UPDATE first (lockstep_perspective_check, no revision
-- check), before any work row is deleted: a batch that holds the pair is waited for, and its
-- ranged delete of work rows counts on that (lockstep_perspective_commit_batch).
-- Returns 'purged', 'no_cursor' (no row, no fence) or 'lease_lost' (the fence p_fence_holder,
-- p_fence_epoch does not hold; NULL: no fence). Caller: lockstep-pg-store's purge, for
-- PerspectiveWorker::purge under a 'purge' lease.
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
     WHERE w.perspective_name = p_perspective AND w.stream_id = p_stream_id;
    UPDATE wh_perspective_cursors k
       SET last_event_id = NULL, applied_count = 0, revision = k.revision + 1,
           processed_at = clock_timestamp(), error = NULL, failures = 0,
           failed_event_id = NULL, retry_at = NULL, parked_at = NULL,
           rewind_trigger_event_id = NULL, rewind_flagged_at = NULL,
           rewind_first_flagged_at = NULL, status = (k.status & ~1) | 2
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective;
    RETURN 'purged';
END
$$;
