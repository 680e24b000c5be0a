-- Stores a failure of a pair, creating its cursor row if it has none: the error text, the
-- event it failed at (p_event_id, the one an operator would skip; NULL: not at a known event),
-- one more failure, the backoff (no batch hands the pair out before now + p_retry_after_us)
-- and, when p_park, the parking (no batch hands it out until an operator retries, skips or
-- rewinds it). Returns whether the pair is parked.
--
-- The backoff and the parking live on the cursor so that every instance sees them and none
-- wastes a claim on a pair that waits. Parking is the caller's decision (the worker parks a
-- pair after WorkerOptions::park_after_failures failures in a row). A parked pair keeps its
-- parking time, and a failure without p_park never unparks it: only an operator (retry, skip,
-- rewind, purge) or a successful commit clears it. The count stops at the integer maximum
-- instead of overflowing.
--
-- Called by lockstep-pg-store's record_failure (the worker's failures stored in a transaction
-- of their own: a pair's rewind, a single pair, a table perspective's pair) and by the
-- entry-by-entry path of lockstep_perspective_commit_batch. The batch's set-based path writes
-- the same row for all its failures with one upsert instead, since a SQL function like this
-- one is planned again on every call.
CREATE OR REPLACE FUNCTION lockstep_perspective_record_failure(
    p_stream_id      uuid,
    p_perspective    text,
    p_error          text,
    p_event_id       uuid,
    p_retry_after_us bigint,
    p_park           boolean
) RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    INSERT INTO wh_perspective_cursors AS k
           (stream_id, perspective_name, error, failures, failed_event_id, retry_at, parked_at)
    VALUES (p_stream_id, p_perspective, p_error, 1, p_event_id,
            clock_timestamp() + p_retry_after_us * interval '1 microsecond',
            CASE WHEN p_park THEN clock_timestamp() END)
    ON CONFLICT (stream_id, perspective_name)
    DO UPDATE SET error = EXCLUDED.error,
                  failures = CASE WHEN k.failures >= 2147483647 THEN k.failures
                                  ELSE k.failures + 1 END,
                  failed_event_id = EXCLUDED.failed_event_id,
                  retry_at = EXCLUDED.retry_at,
                  parked_at = CASE WHEN p_park THEN coalesce(k.parked_at, EXCLUDED.parked_at)
                                   ELSE k.parked_at END
    RETURNING parked_at IS NOT NULL;
$$;
