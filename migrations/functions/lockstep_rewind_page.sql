-- A page of the events a rewind replays: the first p_limit events of the stream p_stream after
-- the event p_after (from the first when NULL), in event-id order, less the events skipped for
-- the pair (p_stream, p_perspective), each with its payload's schema version and decoded size (payload_bytes; for
-- a row written without it, the size of its jsonb decompressed: `#> '{}'` hands back the whole
-- value, nothing is rendered). Called by lockstep-pg-store's rewind_events (REWIND_EVENTS) for
-- each page after the first, which lockstep_load_rewind reads with the cursor. The store asks
-- for one event more than the page holds and cuts the page at its byte bound as the rows
-- arrive; the extra row tells it that more follow.
--
-- A page must be one pass over the stream's own range of an index, in order, whatever the
-- planner's statistics say. When the server underestimates the stream (no statistics yet
-- after a bulk load, few streams in the table, a long stream among many), a plain statement
-- gets a bitmap scan and a sort of the stream's whole rest, or the primary key with a filter
-- on the stream through every later event of every stream; each page then reads everything
-- after it, n² / page size rows for a replay of n events
-- (docs/benchmarks.md, "ADR 0033", has the measurements). Hence:
-- - The range is two row comparisons on (stream_id, event_id), and the order is (stream_id,
--   event_id): only wh_events_stream_event can serve both bounds as index conditions and
--   return the rows in that order. An equality on stream_id is left out on purpose: with it,
--   the scan starts at the stream's first entry and walks to the bound, and the primary key
--   and wh_events_stream_version become candidates again.
-- - Sorts, incremental sorts, bitmap and sequential scans are off for this function alone (SET
--   on the function: the caller's transaction keeps its settings), so no other plan of
--   wh_events is left.
-- - force_generic_plan: that plan is made once per connection, not on every call, where
--   planning cost more than the read.
-- The skipped-events check is a nested loop over the pair's skipped events, read once and
-- materialized: each event is compared with each of them, cheap for the usual none or few.
--
-- STABLE: it reads with the calling statement's snapshot. `#variable_conflict use_column`:
-- the output columns are named like the table's columns, and in the query a name is the
-- column.
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
    schema_version integer,
    payload_bytes bigint
)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
SET enable_sort = off
SET enable_incremental_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
BEGIN
    -- After `p_after` (from the first when NULL): the lower bound includes `p_after` itself,
    -- which the IS DISTINCT FROM condition leaves out, so that a NULL and an id make the same
    -- range of the index, and one generic plan serves both.
    RETURN QUERY
    SELECT e.event_id, e.version, e.event_type, e.payload, e.recorded_at, e.schema_version,
           coalesce(e.payload_bytes, pg_column_size(e.payload #> '{}'))::bigint
      FROM wh_events e
     WHERE (e.stream_id, e.event_id)
               >= (p_stream, coalesce(p_after, '00000000-0000-0000-0000-000000000000'::uuid))
       AND (e.stream_id, e.event_id) <= (p_stream, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid)
       AND e.event_id IS DISTINCT FROM p_after
       AND NOT EXISTS (SELECT 1 FROM wh_perspective_skipped_events x
                        WHERE x.stream_id = p_stream AND x.perspective_name = p_perspective
                          AND x.event_id = e.event_id)
     ORDER BY e.stream_id, e.event_id
     LIMIT p_limit;
END
$$;
