-- Loads an aggregate from its latest snapshot: the snapshot of (p_stream_id, p_aggregate_type,
-- p_schema_version), if any, and the stream's events after it, in one statement and one round
-- trip; with p_key, the transaction-scoped advisory lock p_key is taken first, as
-- lockstep_lock_and_load takes it. Called by lockstep-pg-store's load_from_snapshot
-- (SnapshotStore::load_from_snapshot), under the store's LockQueue when it locks.
--
-- Rows, in order:
-- - outside READ COMMITTED with p_key: one row whose refused_isolation names the level (every
--   other column NULL), and nothing is locked or read;
-- - the snapshot, when there is one: event_id NULL, version the snapshot's, snapshot_state the
--   state;
-- - one row per event after the snapshot (every event when there is none), snapshot_state NULL.
-- A snapshot whose version is past the stream's last event (written by other means) is
-- ignored: the rows are then the whole stream. p_lock_timeout as for lockstep_lock_and_load.
--
-- A VOLATILE PL/pgSQL function for the reason lockstep_lock_and_load is one: the read is a
-- statement of its own, after the lock was granted, so its snapshot sees what the previous
-- holder committed. The snapshot row is found by its primary key; the events after it by the
-- unique (stream_id, version) index, from the snapshot's version on.
CREATE OR REPLACE FUNCTION lockstep_load_from_snapshot(
    p_key            bigint,
    p_lock_timeout   text,
    p_stream_id      uuid,
    p_aggregate_type text,
    p_schema_version integer
) RETURNS TABLE (
    refused_isolation text,
    snapshot_state    jsonb,
    event_id          uuid,
    version           bigint,
    event_type        text,
    payload           jsonb,
    recorded_at       timestamptz,
    schema_version    integer
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    refused text;
BEGIN
    IF p_key IS NOT NULL THEN
        SELECT l.refused_isolation INTO refused
        FROM lockstep_advisory_lock(p_key, false, true, p_lock_timeout) l;
        IF refused IS NOT NULL THEN
            refused_isolation := refused;
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;
    -- A new statement, so a new snapshot: taken after the lock was granted.
    RETURN QUERY
        WITH snap AS (
            SELECT s.version, s.state
            FROM wh_aggregate_snapshots s
            WHERE s.stream_id = p_stream_id
              AND s.aggregate_type = p_aggregate_type
              AND s.schema_version = p_schema_version
              AND EXISTS (SELECT 1 FROM wh_events e
                          WHERE e.stream_id = p_stream_id AND e.version = s.version)
        )
        SELECT NULL::text, snap.state, NULL::uuid, snap.version, NULL::text, NULL::jsonb,
               NULL::timestamptz, NULL::integer
        FROM snap
        UNION ALL
        SELECT NULL::text, NULL::jsonb, e.event_id, e.version, e.event_type, e.payload,
               e.recorded_at, e.schema_version
        FROM wh_events e
        WHERE e.stream_id = p_stream_id
          AND e.version > coalesce((SELECT snap.version FROM snap), 0)
        ORDER BY 4, 3 NULLS FIRST;
END
$$;
