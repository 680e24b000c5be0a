-- Keeps the newest p_keep snapshots of a pair (by event id) and deletes the older ones. A
-- p_keep below 1 counts as 1, so the newest snapshot is never deleted; a pair with no more
-- than p_keep snapshots is left as it is. Called right after a snapshot is written, by
-- lockstep_perspective_commit and lockstep_perspective_save_snapshot, under the cursor row
-- lock their check took; lockstep_perspective_commit_release and
-- lockstep_perspective_commit_batch run the same delete inline.
--
-- PL/pgSQL rather than SQL: the statement's plan is kept for the connection, where the body of
-- a SQL function is parsed and planned again on every call.
CREATE OR REPLACE FUNCTION lockstep_perspective_prune_snapshots(
    p_stream_id   uuid,
    p_perspective text,
    p_keep        integer
) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- The bound is the p_keep-th newest snapshot's event id; NULL when there are fewer, and
    -- then nothing is deleted.
    DELETE FROM wh_perspective_snapshots s
     WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective
       AND s.event_id < (SELECT k.event_id FROM wh_perspective_snapshots k
                          WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
                          ORDER BY k.event_id DESC OFFSET greatest(p_keep, 1) - 1 LIMIT 1);
END
$$;
