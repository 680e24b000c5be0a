-- Schema version 3: versions of a perspective, built beside each other, one serving.
-- Functions and views are in `functions/` (docs/adr/0039-schema-files.md).

-- One row per version of a perspective. Version 1 is stored under the perspective's plain
-- name, a later version `n` under `{name}@v{n}` (`stored_name`: the name of its cursors, work
-- and states). Reads by a perspective's name resolve the serving row; a perspective with no
-- row (registered before versions were recorded) serves under its plain name. A worker
-- records its versions when it registers; a promotion changes `status` under a
-- transaction-scoped advisory lock on `lockstep:perspective-versions:{perspective}`.
CREATE TABLE wh_perspective_versions (
    perspective_name      text         NOT NULL CHECK (btrim(perspective_name) <> ''),
    version               integer      NOT NULL CHECK (version >= 1),
    stored_name           text         NOT NULL UNIQUE,
    status                text         NOT NULL
        CHECK (status IN ('building', 'serving', 'kept', 'retired', 'abandoned')),
    -- Whether a worker running it promotes it once it has caught up.
    automatic             boolean      NOT NULL,
    -- What its promotion does to the version serving before it.
    previous              text         NOT NULL CHECK (previous IN ('keep', 'retire', 'drop')),
    -- An operator's request to promote it, performed by a worker running it.
    promote_requested_at  timestamptz,
    promote_forced        boolean      NOT NULL DEFAULT false,
    declared_at           timestamptz  NOT NULL DEFAULT clock_timestamp(),
    changed_at            timestamptz  NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (perspective_name, version),
    CHECK ((version = 1) = (stored_name = perspective_name))
);

-- At most one serving version per perspective.
CREATE UNIQUE INDEX wh_perspective_versions_serving
    ON wh_perspective_versions (perspective_name) WHERE status = 'serving';
