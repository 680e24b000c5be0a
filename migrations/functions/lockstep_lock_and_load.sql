-- Takes the transaction-scoped advisory lock p_key, waiting for it, then loads the stream
-- p_stream_id in version order: lock and load in one statement and one round trip, the cost of
-- a plain load. Called by lockstep-pg-store's load_locked (EventStore::load_locked), under the
-- store's LockQueue, which adds the in-process queue, the deadline and the cancel-on-drop.
--
-- The lock is taken through lockstep_advisory_lock, so the isolation check and the handling of
-- lock_timeout are the protocol's. Outside READ COMMITTED it returns a single row whose
-- refused_isolation names the level (every other column NULL) and locks nothing. Otherwise
-- one row per event, refused_isolation NULL (no row for an empty stream). p_lock_timeout
-- (e.g. '250ms'; NULL: wait without limit) bounds the wait only; a failed wait raises as
-- lockstep_advisory_lock's does (55P03, 57014, 40P01).
--
-- Why a VOLATILE PL/pgSQL function: the load is a statement of its own, run after the lock is
-- granted, and under READ COMMITTED each statement of a VOLATILE function takes a fresh
-- snapshot, so the load sees what the previous holder of the lock committed. A single SQL
-- statement would read with a snapshot taken before it waited for the lock.
CREATE OR REPLACE FUNCTION lockstep_lock_and_load(
    p_key          bigint,
    p_lock_timeout text,
    p_stream_id    uuid
) RETURNS TABLE (
    refused_isolation text,
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
    SELECT l.refused_isolation INTO refused
    FROM lockstep_advisory_lock(p_key, false, true, p_lock_timeout) l;
    IF refused IS NOT NULL THEN
        refused_isolation := refused;
        RETURN NEXT;
        RETURN;
    END IF;
    -- A new statement, so a new snapshot: taken after the lock was granted.
    RETURN QUERY
        SELECT NULL::text, e.event_id, e.version, e.event_type, e.payload, e.recorded_at,
               e.schema_version
        FROM wh_events e
        WHERE e.stream_id = p_stream_id
        ORDER BY e.version;
END
$$;
