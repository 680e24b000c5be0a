-- Rebuilds the perspective p_name: requests a rewind from the start on every pair, in one
-- UPDATE, as the single pair's request_rewind does. The trigger becomes the nil id, which sorts
-- before every event id; the flag time moves unless the pair was already to be rewound from
-- the start; the first flag time is kept when a request was pending; the parking, backoff and
-- failure count are cleared (a parked pair is never claimed, so a request that left it parked
-- would never run). Returns NULL when the name is not registered (a retired perspective must
-- be registered first), else the number of pairs.
--
-- Nothing else changes: the workers of every instance serve the requests pair by pair under
-- their rewind leases, and each pair's old state stays readable until its rewind commits. A
-- rewind already running commits its request away only if its own trigger is still there, so
-- it leaves this request behind and the pair is rewound again from the start. Called by
-- lockstep-pg-store's rebuild (`lockstep perspectives rebuild NAME`).
CREATE OR REPLACE FUNCTION lockstep_rebuild_perspective(p_name text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n bigint;
    nil constant uuid := '00000000-0000-0000-0000-000000000000';
BEGIN
    IF NOT EXISTS (SELECT 1 FROM wh_perspectives p WHERE p.perspective_name = p_name) THEN
        RETURN NULL;
    END IF;
    -- Status bit 1 (RewindRequired) is set exactly when there is a trigger.
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
