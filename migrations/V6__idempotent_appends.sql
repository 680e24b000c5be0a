-- Appends are idempotent by event id (issue 8: a retry after a lost COMMIT reply must not write
-- the same events twice). Same signature and result as V5's lockstep_append_events, which this
-- replaces; the fan-out is unchanged.
--
-- Before anything is written, the event ids are looked up (one primary-key probe each):
--
-- - none stored: the append goes on as before (expected-version check, insert, fan-out);
-- - every one stored, in this stream, at consecutive versions in the order given, and the
--   expected version (if any) is the one before the first of them: a replay of an append that
--   already happened. Nothing is written; the result is what that append returned (the version
--   of its last event), so a retry cannot tell the two apart.
-- - anything else (some stored and some not, another stream, other positions, another expected
--   version): refused with unique_violation on wh_events_pkey and DETAIL 'not_a_replay'
--   (lockstep-pg-store reports it as InvalidInput, which is not retryable: running it again
--   cannot succeed).
--
-- An id another transaction is inserting right now is not visible yet: the insert below waits
-- for that transaction on the primary key and, if it commits, fails with a plain
-- unique_violation on wh_events_pkey (no DETAIL), a lost race (Conflict, retryable); the retry
-- then finds the ids stored and is a replay or a refusal as above. A stale expectation is
-- unique_violation on wh_events_stream_version, as before.
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
    stored bigint;
    replayed bigint;
    first_version bigint;
    sample_id uuid;
    sample_stream uuid;
    sample_version bigint;
BEGIN
    SELECT count(w.event_id),
           min(w.version) FILTER (WHERE a.ord = 1 AND w.stream_id = p_stream_id)
      INTO stored, first_version
      FROM unnest(p_event_ids) WITH ORDINALITY AS a(event_id, ord)
      JOIN wh_events w ON w.event_id = a.event_id;
    IF stored > 0 THEN
        SELECT count(*) INTO replayed
          FROM unnest(p_event_ids) WITH ORDINALITY AS a(event_id, ord)
          JOIN wh_events w ON w.event_id = a.event_id
         WHERE w.stream_id = p_stream_id AND w.version = first_version + a.ord - 1;
        IF replayed = n AND (p_expected IS NULL OR p_expected = first_version - 1) THEN
            RETURN first_version - 1 + n;
        END IF;
        SELECT w.event_id, w.stream_id, w.version INTO sample_id, sample_stream, sample_version
          FROM unnest(p_event_ids) WITH ORDINALITY AS a(event_id, ord)
          JOIN wh_events w ON w.event_id = a.event_id
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
    INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
    SELECT p_stream_id, p.perspective_name FROM wh_perspectives p
    ON CONFLICT DO NOTHING;
    INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
    SELECT p_stream_id, p.perspective_name, e.event_id
    FROM wh_perspectives p CROSS JOIN unnest(p_event_ids) AS e(event_id)
    ON CONFLICT DO NOTHING;
    RETURN current_version + n;
END
$$;
