-- lockstep V22: a rewind's reads walk the stream's own index range, with plans kept for the
-- session (issue 18, `rewind_snapshot_vs_full`; docs/adr/0033-rewind-reads-pinned-to-the-stream.md).
--
-- `lockstep_load_rewind` (new): what a rewind reads first, as the store's `LOAD_REWIND`
-- statement read it (V21) — a header row (part 0: the cursor, the id of its latest snapshot,
-- the latest snapshot strictly before the request's trigger) and, when the cursor has a
-- request, the first `p_limit` events of the stream after that snapshot but the pair's
-- skipped ones (part 1), in event-id order, each with its payload's stored size. Same columns
-- in the same order. No row: no cursor. STABLE, so its statements share the calling
-- statement's snapshot, as the one statement's parts did.
--
-- `lockstep_rewind_page` (V21, same signature and rows): the page's range is written the same
-- way.
--
-- Why: the statement was planned on every call (0.2–0.5 ms of a rewind from a snapshot, whose
-- read does 0.1 ms of work), and which index it walked depended on the statistics: with few
-- streams (the benchmark's database has two) the server chose the primary key from the
-- snapshot's event id with a filter on the stream, which reads every later event of every
-- stream. ADR 0025 tried to keep the plan and found the generic plan worse still (the whole
-- stream through `wh_events_stream_version`, sorted). Here the range is two row comparisons on
-- `(stream_id, event_id)` and the order is `(stream_id, event_id)`: only
-- `wh_events_stream_event` can serve them as index bounds and in order, and with sorts,
-- bitmap and sequential scans off for these functions alone, the generic plan is that index
-- range — the stream's own events from the bound on, whatever the statistics. So the plan is
-- made once per session (`force_generic_plan`), not on every call. (The check of the pair's
-- skipped events stays what V21's plans made it: the pair's skipped events read once and
-- kept, compared with each event.)
--
-- Re-runnable.

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
    stored_bytes            bigint
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
    -- From the snapshot's event on (or the first), leaving the snapshot's own event out: the
    -- page of `lockstep_rewind_page` below after the snapshot, written out rather than called,
    -- so that the rows go through one tuplestore, not two.
    RETURN QUERY
    SELECT 1, NULL::uuid, NULL::bigint, NULL::bigint, NULL::uuid, NULL::timestamptz,
           NULL::timestamptz, NULL::text, NULL::integer, NULL::uuid, NULL::uuid, NULL::text,
           NULL::timestamptz, NULL::bigint, NULL::uuid, NULL::timestamptz, NULL::timestamptz,
           NULL::uuid, NULL::jsonb, NULL::bigint,
           e.event_id, e.version, e.event_type, e.payload, e.recorded_at,
           pg_column_size(e.payload)::bigint
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
SET plan_cache_mode = force_generic_plan
SET enable_sort = off
SET enable_incremental_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
BEGIN
    -- After `p_after` (from the first when NULL): the bound includes `p_after` itself, which
    -- the second condition leaves out, so that a NULL and an id are one range of the index.
    RETURN QUERY
    SELECT e.event_id, e.version, e.event_type, e.payload, e.recorded_at,
           pg_column_size(e.payload)::bigint
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
