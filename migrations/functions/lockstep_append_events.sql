-- Appends events to a stream at an expected version, enqueues the perspective work they make,
-- and returns the stream's new version (the version of its last event): one statement, one
-- round trip. Called by lockstep-pg-store's append (EventStore::append), which refuses an empty
-- append and an event id listed twice before any SQL.
--
-- p_stream_id   the stream.
-- p_expected    the version the stream must be at; NULL: any version.
-- p_event_ids, p_types, p_payloads
--               the events in order, one element each. The ids are chosen by the caller
--               (UUIDv7); they make the append idempotent.
-- p_schema_versions
--               the schema version of each payload's shape, one element per event; NULL: all
--               1. A replay does not compare them (the ids decide).
--
-- Every conflict is unique_violation (23505), the error a lost race on a unique index gives
-- anyway, so that every conflict aborts the transaction alike; the constraint and the DETAIL
-- tell the store which conflict it is:
-- - wh_events_stream_version, DETAIL 'actual_version=<n>': a stale expectation (the stream is
--   at n). Raised by the insert itself, with PostgreSQL's own DETAIL: another transaction
--   stored one of these versions and committed while this one waited for it. Both are a
--   retryable Conflict.
-- - wh_events_pkey, DETAIL 'not_a_replay': some ids are already stored, but not as this append
--   stores them (below). InvalidInput, not retryable: running it again cannot succeed.
-- - wh_events_pkey without a DETAIL: a transaction that committed while this one waited stored
--   one of these ids in this stream. A retryable Conflict: the retry replays or is refused.
--
-- Idempotent by event id, so that a unit of work retried after a lost COMMIT reply cannot
-- store its events twice: when every id is already stored in this stream, at consecutive
-- versions in the order given, and the expectation (if any) is the version before the first
-- of them, the append is a replay of the one that stored them. Nothing is written, and the
-- result is what that append returned. Anything else stored under these ids (some stored and
-- some not, another stream, other positions, another expected version) is not_a_replay.
--
-- The common case costs three statements, the least that keeps both guarantees (idempotency
-- and the expected version; docs/benchmarks.md, "ADR 0019", measures the alternatives):
-- 1. the stream's version (a backward scan of the unique (stream_id, version) index);
-- 2. the insert, with ON CONFLICT (event_id) DO NOTHING: the primary key tells whether an id is
--    stored as part of the insert, with no probe and no subtransaction of its own. An id that
--    another transaction is inserting is waited for. Only the primary key is an arbiter: a
--    (stream_id, version) taken by another transaction fails the insert (see above);
-- 3. EXISTS on wh_perspectives, and the fan-out only when it finds a row: a cursor row per
--    registered perspective (ON CONFLICT DO NOTHING: an existing cursor is neither written nor
--    locked) and a work row per perspective and event. Reading wh_perspectives, even empty,
--    takes ACCESS SHARE on it until the transaction ends. That is what a registration or a
--    retirement waits for (lockstep_lock_perspectives_for_change): no append misses a new
--    registration, and none enqueues work for a retired name.
-- Replays and refusals are told apart only when the insert stored fewer rows than asked, or
-- the expectation does not match.
--
-- payload_bytes is each payload's decoded size, which the byte bounds of claims and rewind
-- pages count: pg_column_size of the value the insert is given, an element of the jsonb[]
-- parameter. An array holds its elements uncompressed, so this is the size of the
-- uncompressed jsonb, read from its header: no work per byte.
CREATE OR REPLACE FUNCTION lockstep_append_events(
    p_stream_id uuid,
    p_expected  bigint,
    p_event_ids uuid[],
    p_types     text[],
    p_payloads  jsonb[],
    p_schema_versions integer[] DEFAULT NULL
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
        INSERT INTO wh_events (event_id, stream_id, version, event_type, payload, payload_bytes,
                               schema_version)
        SELECT e.event_id, p_stream_id, current_version + e.ord, e.event_type, e.payload,
               pg_column_size(e.payload), coalesce(e.schema_version, 1)
        FROM unnest(p_event_ids, p_types, p_payloads, p_schema_versions)
             WITH ORDINALITY AS e(event_id, event_type, payload, schema_version, ord)
        ON CONFLICT (event_id) DO NOTHING;
        GET DIAGNOSTICS inserted = ROW_COUNT;
        -- Every event stored: the fan-out, when some perspective is registered.
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

    -- Not the common case: the insert skipped some ids, or the expectation does not match (and
    -- the insert did not run). The ids are classified as they were stored before this append
    -- ran. This statement's snapshot is newer than the version read above: the rows of this
    -- stream above that version were stored by this insert or by a transaction that committed
    -- while this one waited, and do not count. Ids that such a transaction stored in another
    -- stream cannot be told from ids stored earlier (that would take a snapshot of the
    -- function's own): they are refused at once as not_a_replay, the answer a retry would get.
    SELECT count(w.event_id),
           min(w.version) FILTER (WHERE a.ord = 1 AND w.stream_id = p_stream_id)
      INTO stored, first_version
      FROM unnest(p_event_ids) WITH ORDINALITY AS a(event_id, ord)
      JOIN wh_events w ON w.event_id = a.event_id
     WHERE NOT (w.stream_id = p_stream_id AND w.version > current_version);
    IF stored > 0 THEN
        -- A replay: every id in this stream at consecutive versions from the first one's, in
        -- the order given, and none above the version read first; nothing inserted by this
        -- call (a partial insert is never a replay: the error below aborts it); the
        -- expectation, if any, the version before the first.
        SELECT count(*) INTO replayed
          FROM unnest(p_event_ids) WITH ORDINALITY AS a(event_id, ord)
          JOIN wh_events w ON w.event_id = a.event_id
         WHERE w.stream_id = p_stream_id AND w.version = first_version + a.ord - 1
           AND w.version <= current_version;
        IF replayed = n AND inserted = 0
           AND (p_expected IS NULL OR p_expected = first_version - 1) THEN
            RETURN first_version - 1 + n;
        END IF;
        -- Not a replay: the message names the first of the ids that are stored.
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
    -- No id was stored before: a stale expectation, reported with the actual version.
    IF p_expected IS NOT NULL AND current_version <> p_expected THEN
        RAISE EXCEPTION USING
            ERRCODE = 'unique_violation',
            CONSTRAINT = 'wh_events_stream_version',
            MESSAGE = format('stream %s: expected version %s, but it is at version %s',
                             p_stream_id, p_expected, current_version),
            DETAIL = format('actual_version=%s', current_version);
    END IF;
    -- No id was stored before and the expectation matched, yet the insert skipped some: a
    -- transaction that committed while this one waited stored them in this stream. A lost
    -- race, retryable. (An id listed twice would also end here: the store refuses that before
    -- any SQL.)
    RAISE EXCEPTION USING
        ERRCODE = 'unique_violation',
        CONSTRAINT = 'wh_events_pkey',
        MESSAGE = format('stream %s: another transaction stored one of these %s event ids '
                         'while this append waited for it', p_stream_id, n);
END
$$;
