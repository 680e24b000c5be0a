-- The append pays only for what it uses (issue 22; docs/adr/0019-lean-append.md). Same
-- signature, result and errors as V6's lockstep_append_events, which this replaces.
--
-- V6 ran five statements on every append: a probe of the event ids (is this a replay?), the
-- stream's version, the insert, and the two fan-out inserts (cursors, work rows) even with no
-- perspective registered. Now the common case runs three:
--
-- 1. the stream's version (one backward scan of the unique (stream_id, version) index);
-- 2. the insert, with ON CONFLICT (event_id) DO NOTHING: the primary key itself tells whether an
--    id is stored, as part of the insert (no statement of its own, no subtransaction). An id
--    another transaction is inserting right now is waited for, as before. A (stream_id,
--    version) taken by another transaction is not an arbiter: it still fails with the plain
--    unique_violation on wh_events_stream_version, as before;
-- 3. EXISTS on wh_perspectives; the fan-out inserts (unchanged) run only when it holds a row.
--    Reading wh_perspectives takes ACCESS SHARE until the transaction ends, as before: what
--    lockstep_register_perspectives and lockstep_retire_perspective wait for (V5, V11).
--
-- Everything else is decided only when the insert stored fewer rows than asked (or the
-- expected version is not the stream's), from the ids as stored before this append ran:
-- stored rows of this stream above the version read in step 1 were stored by a transaction
-- that committed while this one waited (or by this very insert), and do not count.
--
-- - every id stored, in this stream, at consecutive versions in the order given, and the
--   expected version (if any) is the one before the first of them: a replay. Nothing is
--   written (the insert skipped every row); the result is what that append returned;
-- - some ids stored otherwise: unique_violation on wh_events_pkey, DETAIL 'not_a_replay';
-- - none, and the expected version is not the stream's: unique_violation on
--   wh_events_stream_version, DETAIL 'actual_version=<n>';
-- - none, and the insert skipped rows: another transaction stored one of these ids while this
--   one waited: unique_violation on wh_events_pkey without that DETAIL (a lost race; the
--   retry replays or is refused).
--
-- One case is decided earlier than in V6: ids that another transaction stored *in another
-- stream* while this one waited were a lost race (retryable) whose retry was refused; they are
-- now refused at once (not_a_replay), the answer the retry got.
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
        INSERT INTO wh_events (event_id, stream_id, version, event_type, payload)
        SELECT e.event_id, p_stream_id, current_version + e.ord, e.event_type, e.payload
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
