-- Event streams (lockstep-pg-store). Optimistic concurrency rests on the unique
-- (stream_id, version): of two writers appending the same version, the second waits for the
-- first transaction and then fails with unique_violation (23505) if it committed.
CREATE TABLE IF NOT EXISTS wh_events (
    event_id     uuid         PRIMARY KEY,                 -- UUIDv7, chosen by the appender
    stream_id    uuid         NOT NULL,
    version      bigint       NOT NULL CHECK (version >= 1),
    event_type   text         NOT NULL CHECK (btrim(event_type) <> ''),
    payload      jsonb        NOT NULL,
    recorded_at  timestamptz  NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT wh_events_stream_version UNIQUE (stream_id, version)
);

-- Appends events to a stream at an expected version, in one statement and one round trip.
-- p_expected NULL = any version. A stale expectation raises unique_violation (23505), the same
-- error a lost race on the unique index gives, so that every conflict aborts the transaction
-- alike. Returns the stream's new version.
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
    n bigint := cardinality(p_event_ids);
BEGIN
    SELECT coalesce(max(version), 0) INTO current_version
    FROM wh_events WHERE stream_id = p_stream_id;
    IF p_expected IS NOT NULL AND current_version <> p_expected THEN
        RAISE EXCEPTION USING
            ERRCODE = 'unique_violation',
            CONSTRAINT = 'wh_events_stream_version',
            MESSAGE = format('stream %s: expected version %s, but it is at version %s',
                             p_stream_id, p_expected, current_version),
            DETAIL = format('actual_version=%s', current_version);
    END IF;
    INSERT INTO wh_events (event_id, stream_id, version, event_type, payload)
    SELECT e.event_id, p_stream_id, current_version + e.ord, e.event_type, e.payload
    FROM unnest(p_event_ids, p_types, p_payloads) WITH ORDINALITY AS e(event_id, event_type, payload, ord);
    RETURN current_version + n;
END
$$;

-- Takes the transaction-scoped advisory lock p_key, then loads a stream — one statement, one
-- round trip (lockstep-pg-store's load_locked, run by lockstep-pg-advisory's acquire_with, which
-- adds the in-process queue, the deadline and the cancel-on-drop). The isolation level is
-- checked before anything is locked: outside READ COMMITTED it returns a single row naming the
-- level and locks nothing. p_lock_timeout (e.g. '250ms'; NULL = wait without limit) applies to
-- the wait only and is restored. The load is a new statement of a VOLATILE function, so under
-- READ COMMITTED it reads a fresh snapshot, taken after the lock was granted: it sees what the
-- previous holder committed.
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
    recorded_at       timestamptz
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    isolation text := current_setting('transaction_isolation');
    previous  text;
BEGIN
    IF isolation NOT IN ('read committed', 'read uncommitted') THEN
        refused_isolation := isolation;
        RETURN NEXT;
        RETURN;
    END IF;
    IF p_lock_timeout IS NULL THEN
        PERFORM pg_advisory_xact_lock(p_key);
    ELSE
        previous := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', p_lock_timeout, true);
        PERFORM pg_advisory_xact_lock(p_key);
        PERFORM set_config('lock_timeout', previous, true);
    END IF;
    RETURN QUERY
        SELECT NULL::text, e.event_id, e.version, e.event_type, e.payload, e.recorded_at
        FROM wh_events e
        WHERE e.stream_id = p_stream_id
        ORDER BY e.version;
END
$$;
