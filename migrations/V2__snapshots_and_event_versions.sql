-- Schema version 2: aggregate snapshots and the schema version of every event's payload.
-- Functions and views are in `functions/` (docs/adr/0039-schema-files.md).

-- The shape of an event's payload: the version of its type's schema it was written in (1 for
-- every event stored before). Readers lift older shapes with their upcasters; the stored
-- payload is never rewritten. A constant default: adding the column rewrites no row.
ALTER TABLE wh_events
    ADD COLUMN schema_version integer NOT NULL DEFAULT 1 CHECK (schema_version >= 1);

-- Aggregate snapshots: an aggregate's state folded through `version`, saved by the command
-- runner in the transaction that appended that version, one row per (stream, aggregate type,
-- schema version of the state's shape). A cache of the fold: deleting rows changes no answer.
CREATE TABLE wh_aggregate_snapshots (
    stream_id       uuid         NOT NULL,
    aggregate_type  text         NOT NULL CHECK (btrim(aggregate_type) <> ''),
    schema_version  integer      NOT NULL CHECK (schema_version >= 1),
    version         bigint       NOT NULL CHECK (version >= 1),
    state           jsonb        NOT NULL,
    saved_at        timestamptz  NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (stream_id, aggregate_type, schema_version)
);

-- `lockstep snapshots drop`: the snapshots of one aggregate type.
CREATE INDEX wh_aggregate_snapshots_type ON wh_aggregate_snapshots (aggregate_type, schema_version);
