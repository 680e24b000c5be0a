-- lockstep's tables and indexes as of schema version 1 (lockstep 0.1).
--
-- The functions and views are not here: each lives in a file of its own under `functions/`,
-- applied by `migrate()` after the numbered migrations (docs/adr/0039-schema-files.md).
-- `schema.sql` is the whole schema as `pg_dump --schema-only` prints it.
--
-- Table names keep the `wh_` prefix of the storage model the stream leases are taken from
-- (Whizbang's perspective stream locking); `wh_perspective_cursors` is that model's table,
-- column for column, plus the columns after `stream_lock_reason`.

-- Event streams. Optimistic concurrency rests on the unique (stream_id, version): of two
-- writers appending the same version, the second waits for the first transaction and then
-- fails with unique_violation (23505) if it committed.
CREATE TABLE wh_events (
    event_id      uuid         PRIMARY KEY,                 -- UUIDv7, chosen by the appender
    stream_id     uuid         NOT NULL,
    version       bigint       NOT NULL CHECK (version >= 1),
    event_type    text         NOT NULL CHECK (btrim(event_type) <> ''),
    payload       jsonb        NOT NULL,
    recorded_at   timestamptz  NOT NULL DEFAULT clock_timestamp(),
    -- The payload's decoded size (its uncompressed jsonb), what a worker holds once it read the
    -- event: the byte bounds of claims and rewind pages count it. `lockstep_append_events`
    -- writes it; readers take `coalesce(payload_bytes, pg_column_size(payload #> '{}'))`, the
    -- same number, for a row written by other means.
    payload_bytes bigint,
    CONSTRAINT wh_events_stream_version UNIQUE (stream_id, version)
);

-- A stream in event-id order (rewind replays, reads after an event).
CREATE INDEX wh_events_stream_event ON wh_events (stream_id, event_id);

-- Perspective cursors: one row per (stream, perspective), the position of the perspective
-- worker in that stream, and the stream lease.
CREATE TABLE wh_perspective_cursors (
    stream_id                  uuid         NOT NULL,
    perspective_name           text         NOT NULL,
    -- the cursor
    last_event_id              uuid,
    status                     integer      NOT NULL DEFAULT 0,  -- bit flags: 1 RewindRequired, 2 purged
    processed_at               timestamptz,
    error                      text,
    rewind_trigger_event_id    uuid,        -- set exactly when status has RewindRequired
    rewind_flagged_at          timestamptz,
    rewind_first_flagged_at    timestamptz,
    -- the stream lease
    stream_lock_instance_id    uuid,                             -- NULL = unlocked
    stream_lock_expiry         timestamptz,                      -- NULL = unlocked
    stream_lock_reason         varchar(50),
    -- the fencing token: increases whenever a lease is established anew
    stream_lock_epoch          bigint       NOT NULL DEFAULT 0,
    -- the state's compare-and-set revision and the number of events folded into it
    revision                   bigint       NOT NULL DEFAULT 0,
    applied_count              bigint       NOT NULL DEFAULT 0,
    -- failures in a row, the event the last one happened at, the backoff and the parking:
    -- every instance sees them, so none claims a pair that waits
    failures                   integer      NOT NULL DEFAULT 0,
    failed_event_id            uuid,
    retry_at                   timestamptz,  -- not handed out before
    parked_at                  timestamptz,  -- not handed out until an operator retries it
    -- when the lease of epoch stream_lock_acquired_epoch began (database clock); read only while
    -- a holder is set and that epoch is stream_lock_epoch
    stream_lock_acquired_at    timestamptz,
    stream_lock_acquired_epoch bigint,
    PRIMARY KEY (stream_id, perspective_name),
    CONSTRAINT wh_perspective_cursors_name_not_blank CHECK (btrim(perspective_name) <> ''),
    CONSTRAINT wh_perspective_cursors_reason_not_blank CHECK (btrim(stream_lock_reason) <> ''),
    -- the three lease columns are set together or cleared together
    CONSTRAINT wh_perspective_cursors_lease_complete CHECK (
        (stream_lock_instance_id IS NULL) = (stream_lock_expiry IS NULL)
        AND (stream_lock_instance_id IS NULL) = (stream_lock_reason IS NULL)
    )
);

COMMENT ON COLUMN wh_perspective_cursors.stream_lock_acquired_at IS
    'lockstep: when the lease of epoch stream_lock_acquired_epoch was acquired, database clock; '
    'meaningful only while a holder is set and that epoch is stream_lock_epoch';
COMMENT ON COLUMN wh_perspective_cursors.stream_lock_acquired_epoch IS
    'lockstep: the epoch whose acquisition stream_lock_acquired_at records';

-- The indexes on the cursors are partial and leave the expiry out: a keepalive's renewal then
-- changes no indexed column and stays a HOT update (no index writes, no index bloat).

-- Held (or expired but uncleared) leases: what the admin listing and release-all scan.
CREATE INDEX wh_perspective_cursors_held_leases
    ON wh_perspective_cursors (stream_lock_instance_id)
    WHERE stream_lock_instance_id IS NOT NULL;

-- Pairs with a rewind request (listed even without work).
CREATE INDEX wh_perspective_cursors_rewind_requested
    ON wh_perspective_cursors (rewind_flagged_at)
    WHERE rewind_trigger_event_id IS NOT NULL;

-- Parked pairs.
CREATE INDEX wh_perspective_cursors_parked
    ON wh_perspective_cursors (parked_at)
    WHERE parked_at IS NOT NULL;

-- Perspectives whose work the append enqueues. A registration or a retirement takes this
-- table's ACCESS EXCLUSIVE lock (`lockstep_lock_perspectives_for_change`); every append holds
-- ACCESS SHARE on it.
CREATE TABLE wh_perspectives (
    perspective_name text         PRIMARY KEY CHECK (btrim(perspective_name) <> ''),
    registered_at    timestamptz  NOT NULL DEFAULT clock_timestamp()
);

-- Perspectives retired with their states kept: what a later registration catches up from.
CREATE TABLE wh_retired_perspectives (
    perspective_name text        PRIMARY KEY CHECK (btrim(perspective_name) <> ''),
    retired_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Pending work: one row per (perspective, stream, event) not yet applied. Perspective first: a
-- batch walks one perspective's pairs with work in stream order, one index descent per pair,
-- so a claim costs what it looks at, never the length of the queue.
CREATE TABLE wh_perspective_events (
    stream_id        uuid         NOT NULL,
    perspective_name text         NOT NULL,
    event_id         uuid         NOT NULL,
    enqueued_at      timestamptz  NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (perspective_name, stream_id, event_id)
);

-- The current state of each pair (a table of its own keeps the cursor row, which the keepalive
-- renews, narrow).
CREATE TABLE wh_perspective_states (
    stream_id        uuid         NOT NULL,
    perspective_name text         NOT NULL,
    state            jsonb        NOT NULL,
    updated_at       timestamptz  NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (stream_id, perspective_name)
);

-- The state of a pair at an event id (the last event it is the fold of).
CREATE TABLE wh_perspective_snapshots (
    stream_id        uuid         NOT NULL,
    perspective_name text         NOT NULL,
    event_id         uuid         NOT NULL,
    state            jsonb        NOT NULL,
    applied_count    bigint       NOT NULL CHECK (applied_count >= 0),
    created_at       timestamptz  NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (stream_id, perspective_name, event_id)
);

-- Events an operator skipped for a pair: their work is deleted and rewinds leave them out.
CREATE TABLE wh_perspective_skipped_events (
    stream_id        uuid         NOT NULL,
    perspective_name text         NOT NULL,
    event_id         uuid         NOT NULL,
    reason           text         NOT NULL,
    skipped_at       timestamptz  NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (stream_id, perspective_name, event_id)
);

-- Where a pair's rewind stands. `run_id` names one rewind (chosen by the worker): a new run
-- restarts `started_at`. A row is current while its pair still has a rewind request and, when
-- the rewind runs under a lease (`instance_id`, `epoch`), while that lease is live.
CREATE TABLE wh_perspective_rewind_progress (
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

-- Events applied per perspective, by every instance together: the open window (since
-- `window_started_at`, `window_applied` events) and the rate of the last closed one.
CREATE TABLE wh_perspective_throughput (
    perspective_name  text             PRIMARY KEY,
    window_started_at timestamptz      NOT NULL,
    window_applied    bigint           NOT NULL CHECK (window_applied >= 0),
    rate              double precision CHECK (rate >= 0),
    rate_at           timestamptz
);

-- The announced perspective worker instances, live while last_seen_at + stale_after is in the
-- future. Rewritten by every keepalive: half of each page is left free for HOT updates.
CREATE TABLE wh_worker_instances (
    instance_id  uuid        PRIMARY KEY,
    name         text        NOT NULL,
    host         text        NOT NULL,
    pid          bigint      NOT NULL,
    version      text        NOT NULL,
    perspectives text[]      NOT NULL DEFAULT '{}',
    started_at   timestamptz NOT NULL,
    last_seen_at timestamptz NOT NULL,
    stale_after  interval    NOT NULL,
    -- the token of the process that announced the instance (random per process): a live row of
    -- another token is not replaced
    token        uuid,
    CONSTRAINT wh_worker_instances_stale_after_positive CHECK (stale_after > interval '0')
) WITH (fillfactor = 50);

COMMENT ON TABLE wh_worker_instances IS
    'lockstep: the announced perspective worker instances; '
    'live while last_seen_at + stale_after is in the future';
COMMENT ON COLUMN wh_worker_instances.token IS
    'lockstep: the token of the process that announced the instance (random per process); '
    'a live row of another token is not replaced';

-- What `migrate()` installed, one row: the schema version, and the oldest version a build must
-- know to run on this database (the last breaking change). A build refuses a database whose
-- breaking version is newer than its own schema version, and one older than its own.
CREATE TABLE lockstep_schema_version (
    only_row      boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    version       integer     NOT NULL,
    last_breaking integer     NOT NULL,
    installed_by  text        NOT NULL,  -- the lockstep-pg release that wrote this row
    installed_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT lockstep_schema_version_positive CHECK (version >= 1),
    CONSTRAINT lockstep_schema_version_breaking_known CHECK (last_breaking BETWEEN 1 AND version)
);

-- The function and view files `migrate()` applied, by name, with the md5 of the text applied:
-- a file whose text changed is applied again, an unchanged one is not, and a name no longer
-- among the files is dropped.
CREATE TABLE lockstep_schema_functions (
    name       text        PRIMARY KEY,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
