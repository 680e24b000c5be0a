-- lockstep V24: what a worker holds is bounded by the decoded size of the events it reads
-- (docs/adr/0037-byte-bounds-count-decoded-sizes.md).
--
-- - `wh_events.payload_bytes`: the payload's decoded size, the size of its uncompressed `jsonb`,
--   written by `lockstep_append_events` (replaced with the same signature, result and errors).
--   Left NULL on the rows stored before this migration (no rewrite of the events table while
--   it is applied): every reader takes `coalesce(payload_bytes, pg_column_size(payload #> '{}'))`,
--   the same number (`#> '{}'` hands back the whole value, decompressed).
-- - `lockstep_load_rewind` and `lockstep_rewind_page`: the same rows, the last column the
--   payload's decoded size (`payload_bytes`) instead of its stored, possibly compressed, size
--   (`pg_column_size`): a page's byte bound is what the worker holds once it decoded the page.
--
-- Every statement is re-runnable.

ALTER TABLE wh_events ADD COLUMN IF NOT EXISTS payload_bytes bigint;

-- V13's append (same signature, result, errors and statements), which also stores each
-- payload's decoded size: `pg_column_size` of the value the insert is given, an element of
-- the `jsonb[]` parameter — never compressed (an array holds its elements uncompressed), so
-- this is the size of the uncompressed `jsonb`, read from its header: no work per byte.
CREATE OR REPLACE FUNCTION lockstep_append_events(
    p_stream_id uuid,
    p_expected  bigint,
    p_event_ids uuid[],
    p_types     text[],
    p_payloads  jsonb[]
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    current_version bigint;
    n bigint := coalesce(cardinality(p_event_ids), 0);
    inserted bigint := 0;
    stored bigint;
    replayed bigint;
    first_version bigint;
    sample_id uuid;
    sample_stream uuid;
    sample_version bigint;
BEGIN
    SELECT coalesce(max(version), 0) INTO current_version
    FROM wh_events WHERE stream_id = p_stream_id;
    IF p_expected IS NULL OR p_expected = current_version THEN
        INSERT INTO wh_events (event_id, stream_id, version, event_type, payload, payload_bytes)
        SELECT e.event_id, p_stream_id, current_version + e.ord, e.event_type, e.payload,
               pg_column_size(e.payload)
        FROM unnest(p_event_ids, p_types, p_payloads) WITH ORDINALITY AS e(event_id, event_type, payload, ord)
        ON CONFLICT (event_id) DO NOTHING;
        GET DIAGNOSTICS inserted = ROW_COUNT;
        IF inserted = n THEN
            IF EXISTS (SELECT FROM wh_perspectives) THEN
                INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
                SELECT p_stream_id, p.perspective_name FROM wh_perspectives p
                ON CONFLICT DO NOTHING;
                INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
                SELECT p_stream_id, p.perspective_name, e.event_id
                FROM wh_perspectives p CROSS JOIN unnest(p_event_ids) AS e(event_id)
                ON CONFLICT DO NOTHING;
            END IF;
            RETURN current_version + n;
        END IF;
    END IF;

    -- Not the common case: the ids as stored before this append ran.
    SELECT count(w.event_id),
           min(w.version) FILTER (WHERE a.ord = 1 AND w.stream_id = p_stream_id)
      INTO stored, first_version
      FROM unnest(p_event_ids) WITH ORDINALITY AS a(event_id, ord)
      JOIN wh_events w ON w.event_id = a.event_id
     WHERE NOT (w.stream_id = p_stream_id AND w.version > current_version);
    IF stored > 0 THEN
        SELECT count(*) INTO replayed
          FROM unnest(p_event_ids) WITH ORDINALITY AS a(event_id, ord)
          JOIN wh_events w ON w.event_id = a.event_id
         WHERE w.stream_id = p_stream_id AND w.version = first_version + a.ord - 1
           AND w.version <= current_version;
        IF replayed = n AND inserted = 0
           AND (p_expected IS NULL OR p_expected = first_version - 1) THEN
            RETURN first_version - 1 + n;
        END IF;
        SELECT w.event_id, w.stream_id, w.version INTO sample_id, sample_stream, sample_version
          FROM unnest(p_event_ids) WITH ORDINALITY AS a(event_id, ord)
          JOIN wh_events w ON w.event_id = a.event_id
         WHERE NOT (w.stream_id = p_stream_id AND w.version > current_version)
         ORDER BY a.ord LIMIT 1;
        RAISE EXCEPTION USING
            ERRCODE = 'unique_violation',
            CONSTRAINT = 'wh_events_pkey',
            MESSAGE = format('stream %s: event %s is already stored (stream %s, version %s) and '
                             'this append is not a replay of the append that stored it '
                             '(%s of its %s events stored, at other positions, in another '
                             'stream or at another expected version)',
                             p_stream_id, sample_id, sample_stream, sample_version, stored, n),
            DETAIL = 'not_a_replay';
    END IF;
    IF p_expected IS NOT NULL AND current_version <> p_expected THEN
        RAISE EXCEPTION USING
            ERRCODE = 'unique_violation',
            CONSTRAINT = 'wh_events_stream_version',
            MESSAGE = format('stream %s: expected version %s, but it is at version %s',
                             p_stream_id, p_expected, current_version),
            DETAIL = format('actual_version=%s', current_version);
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'unique_violation',
        CONSTRAINT = 'wh_events_pkey',
        MESSAGE = format('stream %s: another transaction stored one of these %s event ids '
                         'while this append waited for it', p_stream_id, n);
END
$$;

-- V22's rewind reads (same parameters, plans and rows), whose last column is the payload's
-- decoded size: `payload_bytes`, or for an event stored before it existed the size of its
-- `jsonb` uncompressed (`#> '{}'` hands back the whole value, decompressed; nothing is
-- rendered). The column is renamed with its meaning, so the functions are made anew.
DROP FUNCTION IF EXISTS lockstep_load_rewind(uuid, text, bigint);
DROP FUNCTION IF EXISTS lockstep_rewind_page(uuid, text, uuid, bigint);

CREATE FUNCTION lockstep_load_rewind(
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

CREATE FUNCTION lockstep_rewind_page(
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
    -- After `p_after` (from the first when NULL): the bound includes `p_after` itself, which
    -- the second condition leaves out, so that a NULL and an id are one range of the index.
    RETURN QUERY
    SELECT e.event_id, e.version, e.event_type, e.payload, e.recorded_at,
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
