-- What a rewind reads first, in one call: the pair's cursor, the snapshot to replay from and
-- the first page of events. Called by lockstep-pg-store's load_rewind (LOAD_REWIND); the later
-- pages come from lockstep_rewind_page.
--
-- No row: the pair (p_stream, p_perspective) has no cursor. Otherwise:
-- - first a header row, part 0: the cursor's columns; latest_snapshot_id, the pair's newest
--   snapshot; and when the cursor has a rewind request, the newest snapshot strictly before
--   the request's trigger (snapshot_event_id, snapshot_state, snapshot_applied_count; NULL:
--   none, the replay starts at the first event). Its event columns are NULL.
-- - then, only when there is a request, the first p_limit events after that snapshot, part 1
--   (the other columns NULL): exactly what lockstep_rewind_page returns after the snapshot's
--   event, less the pair's skipped events, in event-id order, each with its payload's decoded
--   size. As for the later pages, the store asks for one event more than the page holds.
--
-- Planned as lockstep_rewind_page is, for the same reasons: a range that only
-- wh_events_stream_event serves, sorts, bitmap and sequential scans off for this function
-- alone, and one generic plan per connection, so that the read walks the stream's own index
-- range from the snapshot on whatever the statistics say. A plain statement would be planned
-- on every call (about 0.5 ms, more than the read), and with few streams in the table the
-- server may walk the primary key through every later event of every stream.
--
-- STABLE: its statements share the calling statement's snapshot, so the header and the events
-- are one consistent read. `#variable_conflict use_column`: the output columns are named like
-- the table's columns, and in the queries a name is the column.
CREATE OR REPLACE FUNCTION lockstep_load_rewind(
    p_stream      uuid,
    p_perspective text,
    p_limit       bigint
) RETURNS TABLE (
    part                    integer,
    last_event_id           uuid,
    revision                bigint,
    applied_count           bigint,
    rewind_trigger_event_id uuid,
    rewind_flagged_at       timestamptz,
    rewind_first_flagged_at timestamptz,
    error                   text,
    failures                integer,
    latest_snapshot_id      uuid,
    stream_lock_instance_id uuid,
    stream_lock_reason      text,
    stream_lock_expiry      timestamptz,
    stream_lock_epoch       bigint,
    failed_event_id         uuid,
    retry_at                timestamptz,
    parked_at               timestamptz,
    snapshot_event_id       uuid,
    snapshot_state          jsonb,
    snapshot_applied_count  bigint,
    event_id                uuid,
    version                 bigint,
    event_type              text,
    payload                 jsonb,
    recorded_at             timestamptz,
    schema_version          integer,
    payload_bytes           bigint
)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
SET enable_sort = off
SET enable_incremental_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    k wh_perspective_cursors%ROWTYPE;
BEGIN
    SELECT * INTO k FROM wh_perspective_cursors c
     WHERE c.stream_id = p_stream AND c.perspective_name = p_perspective;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- Part 0, the header.
    part := 0;
    last_event_id := k.last_event_id;
    revision := k.revision;
    applied_count := k.applied_count;
    rewind_trigger_event_id := k.rewind_trigger_event_id;
    rewind_flagged_at := k.rewind_flagged_at;
    rewind_first_flagged_at := k.rewind_first_flagged_at;
    error := k.error;
    failures := k.failures;
    stream_lock_instance_id := k.stream_lock_instance_id;
    stream_lock_reason := k.stream_lock_reason;
    stream_lock_expiry := k.stream_lock_expiry;
    stream_lock_epoch := k.stream_lock_epoch;
    failed_event_id := k.failed_event_id;
    retry_at := k.retry_at;
    parked_at := k.parked_at;
    SELECT s.event_id INTO latest_snapshot_id
      FROM wh_perspective_snapshots s
     WHERE s.stream_id = p_stream AND s.perspective_name = p_perspective
     ORDER BY s.event_id DESC LIMIT 1;
    IF k.rewind_trigger_event_id IS NOT NULL THEN
        SELECT s.event_id, s.state, s.applied_count
          INTO snapshot_event_id, snapshot_state, snapshot_applied_count
          FROM wh_perspective_snapshots s
         WHERE s.stream_id = p_stream AND s.perspective_name = p_perspective
           AND s.event_id < k.rewind_trigger_event_id
         ORDER BY s.event_id DESC LIMIT 1;
    END IF;
    RETURN NEXT;
    IF k.rewind_trigger_event_id IS NULL THEN
        RETURN;
    END IF;
    -- Part 1: from the snapshot's event on (or the first), leaving the snapshot's own event
    -- out. The query of lockstep_rewind_page with the snapshot as its bound, written out here
    -- rather than called, so that the rows go through one tuplestore, not two.
    RETURN QUERY
    SELECT 1, NULL::uuid, NULL::bigint, NULL::bigint, NULL::uuid, NULL::timestamptz,
           NULL::timestamptz, NULL::text, NULL::integer, NULL::uuid, NULL::uuid, NULL::text,
           NULL::timestamptz, NULL::bigint, NULL::uuid, NULL::timestamptz, NULL::timestamptz,
           NULL::uuid, NULL::jsonb, NULL::bigint,
           e.event_id, e.version, e.event_type, e.payload, e.recorded_at, e.schema_version,
           coalesce(e.payload_bytes, pg_column_size(e.payload #> '{}'))::bigint
      FROM wh_events e
     WHERE (e.stream_id, e.event_id)
               >= (p_stream, coalesce(snapshot_event_id, '00000000-0000-0000-0000-000000000000'::uuid))
       AND (e.stream_id, e.event_id) <= (p_stream, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid)
       AND e.event_id IS DISTINCT FROM snapshot_event_id
       AND NOT EXISTS (SELECT 1 FROM wh_perspective_skipped_events x
                        WHERE x.stream_id = p_stream AND x.perspective_name = p_perspective
                          AND x.event_id = e.event_id)
     ORDER BY e.stream_id, e.event_id
     LIMIT p_limit;
END
$$;
