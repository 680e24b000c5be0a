-- lockstep V11: a perspective's whole life and progress on long work (issue 20, items 3 and 4;
-- docs/adr/0016-retire-rebuild-progress.md).
--
-- - Retire: `lockstep_retire_perspective` deletes the registration (so the append, which fans
--   out to `wh_perspectives`, enqueues no more work for it), deletes its queued work, and
--   either keeps its cursors, states and snapshots (recorded in `wh_retired_perspectives`) or
--   drops them.
-- - Register again: `lockstep_register_perspectives` (V5's, replaced with the same signature and
--   result) catches a perspective retired with its states kept up from each pair's cursor, not
--   from the first event: work for the events after the cursor, and for the events appended
--   while it was retired (one that sorts before the cursor is a late arrival: the claim turns it
--   into a rewind request, as always).
-- - Rebuild: `lockstep_rebuild_perspective` requests a rewind from the start on every pair of a
--   registered perspective, in one statement; the workers serve the requests pair by pair
--   under their rewind leases, and each pair's old state stays readable until its rewind commits.
-- - Progress: `wh_perspective_rewind_progress`, one row per pair, written by the rewinding
--   worker at most about once per second (events replayed of events to replay, started at).
-- - Catch-up rate: `wh_perspective_throughput`, one row per perspective, to which every
--   worker adds the events it applied at most about once per second; a window of at least
--   10 s closes into a rate (events per second) when a report finds it that old.
--
-- Every statement is re-runnable.

-- Perspectives retired with their states kept: what a later registration catches up from.
CREATE TABLE IF NOT EXISTS wh_retired_perspectives (
    perspective_name text        PRIMARY KEY CHECK (btrim(perspective_name) <> ''),
    retired_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Where a pair's rewind stands. `run_id` names one rewind (chosen by the worker): a new run
-- restarts `started_at`. A row is current while its pair still has a rewind request and, when
-- the rewind runs under a lease (`instance_id`, `epoch`), while that lease is live.
CREATE TABLE IF NOT EXISTS wh_perspective_rewind_progress (
    stream_id        uuid        NOT NULL,
    perspective_name text        NOT NULL,
    run_id           uuid        NOT NULL,
    instance_id      uuid,
    epoch            bigint,
    replayed         bigint      NOT NULL CHECK (replayed >= 0),
    to_replay        bigint      NOT NULL CHECK (to_replay >= 0),
    started_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    PRIMARY KEY (stream_id, perspective_name)
);

-- Retires `p_name`. No row back: it is neither registered nor retired with its states kept.
-- Otherwise how many work rows were deleted and how many pairs were kept (`p_keep`) or dropped.
--
-- ACCESS EXCLUSIVE on wh_perspectives waits for every open transaction that appended (they
-- hold ACCESS SHARE until they end) and holds new appends back until this transaction ends:
-- no append can enqueue work for the name after its work was deleted. With the states kept,
-- queued work that sorts before its pair's cursor (a late arrival not yet claimed) becomes a
-- rewind request first, so deleting it loses nothing.
CREATE OR REPLACE FUNCTION lockstep_retire_perspective(p_name text, p_keep boolean)
RETURNS TABLE (work_removed bigint, pairs bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n_work  bigint;
    n_pairs bigint;
    was_registered boolean;
BEGIN
    LOCK TABLE wh_perspectives IN ACCESS EXCLUSIVE MODE;
    DELETE FROM wh_perspectives p WHERE p.perspective_name = p_name;
    was_registered := FOUND;
    IF NOT was_registered
       AND NOT EXISTS (SELECT 1 FROM wh_retired_perspectives r WHERE r.perspective_name = p_name) THEN
        RETURN;
    END IF;
    IF p_keep THEN
        WITH late AS (
            SELECT w.stream_id, (array_agg(w.event_id ORDER BY w.event_id))[1] AS trigger
              FROM wh_perspective_events w
              JOIN wh_perspective_cursors k
                ON k.stream_id = w.stream_id AND k.perspective_name = w.perspective_name
             WHERE w.perspective_name = p_name
               AND k.last_event_id IS NOT NULL AND w.event_id < k.last_event_id
             GROUP BY w.stream_id
        )
        UPDATE wh_perspective_cursors k
           SET rewind_trigger_event_id = CASE
                   WHEN k.rewind_trigger_event_id IS NULL OR late.trigger < k.rewind_trigger_event_id
                   THEN late.trigger ELSE k.rewind_trigger_event_id END,
               rewind_flagged_at = clock_timestamp(),
               rewind_first_flagged_at = coalesce(k.rewind_first_flagged_at, clock_timestamp()),
               status = k.status | 1
          FROM late
         WHERE k.stream_id = late.stream_id AND k.perspective_name = p_name;
    END IF;
    DELETE FROM wh_perspective_events w WHERE w.perspective_name = p_name;
    GET DIAGNOSTICS n_work = ROW_COUNT;
    IF p_keep THEN
        SELECT count(*) INTO n_pairs FROM wh_perspective_cursors k WHERE k.perspective_name = p_name;
        IF was_registered THEN
            INSERT INTO wh_retired_perspectives AS r (perspective_name, retired_at)
            VALUES (p_name, clock_timestamp())
            ON CONFLICT (perspective_name) DO UPDATE SET retired_at = EXCLUDED.retired_at;
        END IF;
    ELSE
        DELETE FROM wh_perspective_states x WHERE x.perspective_name = p_name;
        DELETE FROM wh_perspective_snapshots x WHERE x.perspective_name = p_name;
        DELETE FROM wh_perspective_skipped_events x WHERE x.perspective_name = p_name;
        DELETE FROM wh_perspective_rewind_progress x WHERE x.perspective_name = p_name;
        DELETE FROM wh_perspective_throughput x WHERE x.perspective_name = p_name;
        DELETE FROM wh_perspective_cursors k WHERE k.perspective_name = p_name;
        GET DIAGNOSTICS n_pairs = ROW_COUNT;
        DELETE FROM wh_retired_perspectives r WHERE r.perspective_name = p_name;
    END IF;
    RETURN QUERY SELECT n_work, n_pairs;
END
$$;

-- V5's registration (same locks, same result: how many names were new), whose catch-up of a
-- name retired with its states kept starts at each pair's cursor: work for the events after
-- it, and for every event appended since the retirement (before the cursor: a late arrival),
-- less the events an operator skipped for the pair.
CREATE OR REPLACE FUNCTION lockstep_register_perspectives(p_names text[]) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    added integer;
BEGIN
    LOCK TABLE wh_perspectives IN SHARE ROW EXCLUSIVE MODE;
    IF NOT EXISTS (
        SELECT 1 FROM unnest(p_names) AS x(name)
        WHERE NOT EXISTS (SELECT 1 FROM wh_perspectives p WHERE p.perspective_name = x.name)
    ) THEN
        RETURN 0;
    END IF;
    LOCK TABLE wh_perspectives IN ACCESS EXCLUSIVE MODE;
    WITH new AS (
        INSERT INTO wh_perspectives (perspective_name)
        SELECT DISTINCT x.name FROM unnest(p_names) AS x(name)
        ON CONFLICT DO NOTHING
        RETURNING perspective_name
    ), cursors AS (
        INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
        SELECT DISTINCT e.stream_id, new.perspective_name FROM wh_events e CROSS JOIN new
        ON CONFLICT DO NOTHING
    ), work AS (
        INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
        SELECT e.stream_id, new.perspective_name, e.event_id
          FROM new
          CROSS JOIN wh_events e
          LEFT JOIN wh_retired_perspectives r ON r.perspective_name = new.perspective_name
          LEFT JOIN wh_perspective_cursors k
                 ON r.perspective_name IS NOT NULL
                AND k.stream_id = e.stream_id AND k.perspective_name = new.perspective_name
         WHERE (k.last_event_id IS NULL
                OR e.event_id > k.last_event_id
                OR e.recorded_at >= r.retired_at)
           AND NOT EXISTS (SELECT 1 FROM wh_perspective_skipped_events s
                             WHERE s.stream_id = e.stream_id
                               AND s.perspective_name = new.perspective_name
                               AND s.event_id = e.event_id)
        ON CONFLICT DO NOTHING
    ), unretired AS (
        DELETE FROM wh_retired_perspectives r USING new
         WHERE r.perspective_name = new.perspective_name
    )
    SELECT count(*) INTO added FROM new;
    RETURN added;
END
$$;

-- Requests a rewind from the start (the nil id) on every pair of `p_name`, as the single
-- pair's request does (an earlier trigger is kept, parking and backoff cleared). NULL: not
-- registered. Otherwise the number of pairs.
CREATE OR REPLACE FUNCTION lockstep_rebuild_perspective(p_name text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n bigint;
    nil constant uuid := '00000000-0000-0000-0000-000000000000';
BEGIN
    IF NOT EXISTS (SELECT 1 FROM wh_perspectives p WHERE p.perspective_name = p_name) THEN
        RETURN NULL;
    END IF;
    UPDATE wh_perspective_cursors k
       SET rewind_trigger_event_id = nil,
           rewind_flagged_at = CASE WHEN k.rewind_trigger_event_id IS DISTINCT FROM nil
                                    THEN clock_timestamp() ELSE k.rewind_flagged_at END,
           rewind_first_flagged_at = CASE WHEN k.rewind_trigger_event_id IS NULL
                                          THEN clock_timestamp() ELSE k.rewind_first_flagged_at END,
           status = k.status | 1,
           parked_at = NULL, retry_at = NULL, failures = 0
     WHERE k.perspective_name = p_name;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- Events applied per perspective, by every instance together: the open window (since
-- `window_started_at`, `window_applied` events) and the rate of the last closed one.
CREATE TABLE IF NOT EXISTS wh_perspective_throughput (
    perspective_name  text             PRIMARY KEY,
    window_started_at timestamptz      NOT NULL,
    window_applied    bigint           NOT NULL CHECK (window_applied >= 0),
    rate              double precision CHECK (rate >= 0),
    rate_at           timestamptz
);

-- Adds `p_counts[i]` applied events to `p_names[i]` (a name given twice: the sum); a window at least `p_window_us` old closes
-- into the rate (its events over its length) and a new one opens, empty.
CREATE OR REPLACE FUNCTION lockstep_perspective_record_applied(
    p_names text[], p_counts bigint[], p_window_us bigint
) RETURNS void
LANGUAGE sql VOLATILE AS $$
    INSERT INTO wh_perspective_throughput AS t (perspective_name, window_started_at, window_applied)
    SELECT x.name, clock_timestamp(), sum(x.n)
      FROM unnest(p_names, p_counts) AS x(name, n)
     GROUP BY x.name
    ON CONFLICT (perspective_name) DO UPDATE SET
        rate = CASE WHEN clock_timestamp() - t.window_started_at >= p_window_us * interval '1 microsecond'
                    THEN (t.window_applied + EXCLUDED.window_applied)
                         / greatest(extract(epoch FROM clock_timestamp() - t.window_started_at), 0.001)
                    ELSE t.rate END,
        rate_at = CASE WHEN clock_timestamp() - t.window_started_at >= p_window_us * interval '1 microsecond'
                       THEN clock_timestamp() ELSE t.rate_at END,
        window_applied = CASE WHEN clock_timestamp() - t.window_started_at >= p_window_us * interval '1 microsecond'
                              THEN 0 ELSE t.window_applied + EXCLUDED.window_applied END,
        window_started_at = CASE WHEN clock_timestamp() - t.window_started_at >= p_window_us * interval '1 microsecond'
                                 THEN clock_timestamp() ELSE t.window_started_at END;
$$;
