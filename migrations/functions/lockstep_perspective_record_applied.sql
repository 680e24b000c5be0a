-- Adds applied events to the perspectives' catch-up rates: p_counts[i] events to p_names[i]
-- (a name given twice: the sum), all of them in one statement. wh_perspective_throughput has
-- one row per perspective, which every instance adds to, so the rate is the fleet's.
--
-- A window at least p_window_us old closes into the rate (its events, these included, over
-- its length, counted as at least 1 ms) and a new one opens, empty, now. A window is closed
-- only by a report that finds it old: one nobody reports to stays open, and the reader
-- (lockstep-pg-store's THROUGHPUT) takes its average so far. Called by the worker at most
-- about once a second, and only when it applied something (lockstep-pg-store's
-- record_applied, with lockstep_core::THROUGHPUT_WINDOW, 10 s).
CREATE OR REPLACE FUNCTION lockstep_perspective_record_applied(
    p_names text[], p_counts bigint[], p_window_us bigint
) RETURNS void
LANGUAGE sql VOLATILE AS $$
    INSERT INTO wh_perspective_throughput AS t (perspective_name, window_started_at, window_applied)
    SELECT x.name, clock_timestamp(), sum(x.n)
      FROM unnest(p_names, p_counts) AS x(name, n)
     GROUP BY x.name
    -- Every t.* below is the row as it was before this update. Each of the four conditions
    -- reads clock_timestamp() anew, so at the very instant the window comes of age they can
    -- disagree (the window reset without its rate closed).
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
