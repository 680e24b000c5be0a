-- lockstep V21: a page of a rewind's events, read in event-id order along the index
-- `wh_events_stream_event` whatever the planner's statistics say (issue 18, a rewind's memory;
-- docs/adr/0031-rewind-pages.md).
--
-- A rewind reads its events a page at a time: the first page with its cursor and snapshot
-- (`LOAD_REWIND`, a plain statement), each next one with this function, after the last event
-- of the page before. A page is the first `p_limit` events of the stream after `p_after`
-- (from the first when NULL) but the pair's skipped ones, in event-id order, each with its
-- payload's stored size (the store cuts the page at its bytes as the rows arrive).
--
-- Why a function: the page is `... ORDER BY event_id LIMIT n` after a key, and the plan that
-- reads it in one pass of the index range is an ordered index scan. When the server
-- underestimates the stream's rows — no statistics yet after a bulk load, or a long stream in
-- a table of many streams — it prefers a bitmap scan of the stream's whole rest and a sort:
-- every page then reads everything after it, and a replay of n events costs n² / page rows
-- (measured: 6.2 ms a page of 1 000 events of 20 000 instead of 1.5 ms). The function's own
-- settings (sort, bitmap and sequential scans off) leave the ordered index scans only, for
-- this statement alone: the caller's transaction keeps its settings. Custom plans: the bounds'
-- values choose between `wh_events_stream_event` and the primary key (ADR 0025: a generic plan
-- can read every later event of every stream).
--
-- Re-runnable.

CREATE OR REPLACE FUNCTION lockstep_rewind_page(
    p_stream      uuid,
    p_perspective text,
    p_after       uuid,
    p_limit       bigint
) RETURNS TABLE (
    event_id     uuid,
    version      bigint,
    event_type   text,
    payload      jsonb,
    recorded_at  timestamptz,
    stored_bytes bigint
)
LANGUAGE plpgsql STABLE
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT e.event_id, e.version, e.event_type, e.payload, e.recorded_at,
           pg_column_size(e.payload)::bigint
      FROM wh_events e
     WHERE e.stream_id = p_stream
       AND (p_after IS NULL OR e.event_id > p_after)
       AND NOT EXISTS (SELECT 1 FROM wh_perspective_skipped_events x
                        WHERE x.stream_id = p_stream AND x.perspective_name = p_perspective
                          AND x.event_id = e.event_id)
     ORDER BY e.event_id
     LIMIT p_limit;
END
$$;
