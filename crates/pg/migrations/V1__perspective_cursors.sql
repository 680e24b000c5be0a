-- Perspective cursors: one row per (stream, perspective), the position of the perspective
-- worker in that stream, and the stream lease (seed: perspective stream locking, storage model).
CREATE TABLE IF NOT EXISTS wh_perspective_cursors (
    stream_id                uuid         NOT NULL,
    perspective_name         text         NOT NULL,
    -- cursor (used by the perspective worker)
    last_event_id            uuid,
    status                   integer      NOT NULL DEFAULT 0,   -- bit flags, e.g. RewindRequired
    processed_at             timestamptz,
    error                    text,
    rewind_trigger_event_id  uuid,
    rewind_flagged_at        timestamptz,
    rewind_first_flagged_at  timestamptz,
    -- stream lease, exactly as the seed's storage model ...
    stream_lock_instance_id  uuid,                               -- NULL = unlocked
    stream_lock_expiry       timestamptz,                        -- NULL = unlocked
    stream_lock_reason       varchar(50),
    -- ... plus the fencing token: increases whenever a lease is established anew
    stream_lock_epoch        bigint       NOT NULL DEFAULT 0,
    PRIMARY KEY (stream_id, perspective_name),
    CONSTRAINT wh_perspective_cursors_name_not_blank CHECK (btrim(perspective_name) <> ''),
    CONSTRAINT wh_perspective_cursors_reason_not_blank CHECK (btrim(stream_lock_reason) <> ''),
    -- the three lease columns are set together or cleared together
    CONSTRAINT wh_perspective_cursors_lease_complete CHECK (
        (stream_lock_instance_id IS NULL) = (stream_lock_expiry IS NULL)
        AND (stream_lock_instance_id IS NULL) = (stream_lock_reason IS NULL)
    )
);

-- Held (or expired but uncleared) leases: what admin listing and release-all scan (batched
-- renew goes by primary key). The expiry is deliberately not indexed: a renew then changes no
-- indexed column, so the keepalive's update is HOT (no index writes, no index bloat).
CREATE INDEX IF NOT EXISTS wh_perspective_cursors_held_leases
    ON wh_perspective_cursors (stream_lock_instance_id)
    WHERE stream_lock_instance_id IS NOT NULL;
