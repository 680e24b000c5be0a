-- The perspective store (lockstep-pg-store's PgPerspectiveStore; docs/adr/0006-perspective-store.md):
-- the registered perspectives, the work queue, the perspective states and snapshots, the cursor
-- columns the worker needs, and its operations as functions of one statement each (register,
-- claim, commit, save a snapshot, purge). The event store's append (replaced below, same
-- signature and result) now also enqueues the work: no extra round trip.
--
-- Order is event-id order: uuid comparison is bytewise, like Rust's Uuid ordering. (uuid has
-- no min/max aggregates: the earliest or latest id is an ORDER BY … LIMIT 1 on an index.)

-- Perspectives whose work the append enqueues.
CREATE TABLE IF NOT EXISTS wh_perspectives (
    perspective_name text         PRIMARY KEY CHECK (btrim(perspective_name) <> ''),
    registered_at    timestamptz  NOT NULL DEFAULT clock_timestamp()
);

-- Pending work: one row per (stream, perspective, event) not yet applied.
CREATE TABLE IF NOT EXISTS wh_perspective_events (
    stream_id        uuid         NOT NULL,
    perspective_name text         NOT NULL,
    event_id         uuid         NOT NULL,
    enqueued_at      timestamptz  NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (stream_id, perspective_name, event_id)
);

-- The current state of each pair (a table of its own keeps the cursor row, which the
-- keepalive renews, narrow).
CREATE TABLE IF NOT EXISTS wh_perspective_states (
    stream_id        uuid         NOT NULL,
    perspective_name text         NOT NULL,
    state            jsonb        NOT NULL,
    updated_at       timestamptz  NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (stream_id, perspective_name)
);

-- The state of a pair at an event id (the last event it is the fold of).
CREATE TABLE IF NOT EXISTS wh_perspective_snapshots (
    stream_id        uuid         NOT NULL,
    perspective_name text         NOT NULL,
    event_id         uuid         NOT NULL,
    state            jsonb        NOT NULL,
    applied_count    bigint       NOT NULL CHECK (applied_count >= 0),
    created_at       timestamptz  NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (stream_id, perspective_name, event_id)
);

-- The cursor's position beyond last_event_id. status bit 1 is RewindRequired, set exactly when
-- rewind_trigger_event_id is (the seed's model; the trigger is what the store reads).
ALTER TABLE wh_perspective_cursors
    ADD COLUMN IF NOT EXISTS revision      bigint   NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS applied_count bigint   NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS failures      integer  NOT NULL DEFAULT 0;

-- Pairs with a rewind request (pending_pairs lists them even without work). Only rewind
-- columns are indexed: a lease renew still changes no indexed column (HOT update, ADR 0002).
CREATE INDEX IF NOT EXISTS wh_perspective_cursors_rewind_requested
    ON wh_perspective_cursors (rewind_flagged_at)
    WHERE rewind_trigger_event_id IS NOT NULL;

-- A stream in event-id order (rewind replays, stream_events(after)).
CREATE INDEX IF NOT EXISTS wh_events_stream_event ON wh_events (stream_id, event_id);

-- Same signature and result as in V3, plus the fan-out: the events are inserted with the ids
-- the caller chose, then one work row per registered perspective and event, and the cursor
-- rows of the pairs (ON CONFLICT DO NOTHING: an existing cursor is neither written nor locked).
-- Reading wh_perspectives holds ACCESS SHARE on it until the appender's transaction ends,
-- which is what lockstep_register_perspectives waits for (no append can miss a registration).
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
BEGIN
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

-- Registers perspectives (idempotent); returns how many were new. A new perspective gets a
-- cursor and work for every event that exists (catch-up). Registrations are serialized by the
-- SHARE ROW EXCLUSIVE lock (it does not block appenders). When a name is new, ACCESS EXCLUSIVE
-- waits for every open transaction that appended (they hold ACCESS SHARE) and holds new
-- appends back until this transaction ends; the catch-up statement, whose snapshot is taken
-- after that, sees every event appended without the new name, and every later append sees it.
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
        SELECT e.stream_id, new.perspective_name, e.event_id FROM wh_events e CROSS JOIN new
        ON CONFLICT DO NOTHING
    )
    SELECT count(*) INTO added FROM new;
    RETURN added;
END
$$;

-- Claims a pair for normal application, in one statement. Returns a header row (outcome set,
-- then the cursor and the state) followed, for 'apply', by the pending events after the
-- cursor in event-id order (outcome NULL), at most p_max_events.
--
-- outcome 'busy'   another transaction holds the cursor row (SKIP LOCKED: never waits on it),
--                  or a live lease of any holder is on it (the row is then not locked);
--         'rewind' a rewind is requested and its debounce window has passed;
--         'idle'   a rewind is requested inside its debounce window;
--         'apply'  the cursor row is locked until the claiming transaction ends; no event
--                  rows means there was nothing to apply.
-- A late arrival (pending work before last_event_id) writes or moves the rewind request
-- first: the trigger only ever moves earlier; the window restarts when the trigger moves or a
-- late event was enqueued after the request was last flagged. A missing cursor row is created
-- (this waits only if another transaction is creating the same row right now).
CREATE OR REPLACE FUNCTION lockstep_perspective_claim(
    p_stream_id   uuid,
    p_perspective text,
    p_max_events  bigint,
    p_debounce_us bigint
) RETURNS TABLE (
    outcome                 text,
    last_event_id           uuid,
    revision                bigint,
    applied_count           bigint,
    rewind_trigger_event_id uuid,
    rewind_flagged_at       timestamptz,
    rewind_first_flagged_at timestamptz,
    error                   text,
    failures                integer,
    latest_snapshot         uuid,
    stream_lock_instance_id uuid,
    stream_lock_reason      text,
    stream_lock_expiry      timestamptz,
    stream_lock_epoch       bigint,
    state                   jsonb,
    event_id                uuid,
    version                 bigint,
    event_type              text,
    payload                 jsonb,
    recorded_at             timestamptz
)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    c        wh_perspective_cursors%ROWTYPE;
    now_     timestamptz;
    late     uuid;
    late_at  timestamptz;
    verdict  text;
BEGIN
    SELECT * INTO c FROM wh_perspective_cursors k
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
       AND NOT (k.stream_lock_instance_id IS NOT NULL AND k.stream_lock_expiry > clock_timestamp())
       FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM wh_perspective_cursors k
                    WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective) THEN
            outcome := 'busy';
            RETURN NEXT;
            RETURN;
        END IF;
        INSERT INTO wh_perspective_cursors AS k (stream_id, perspective_name)
        VALUES (p_stream_id, p_perspective)
        ON CONFLICT DO NOTHING
        RETURNING * INTO c;
        IF NOT FOUND THEN
            -- Created meanwhile by a transaction that has now committed: try once more.
            SELECT * INTO c FROM wh_perspective_cursors k
             WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
               AND NOT (k.stream_lock_instance_id IS NOT NULL AND k.stream_lock_expiry > clock_timestamp())
               FOR NO KEY UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                outcome := 'busy';
                RETURN NEXT;
                RETURN;
            END IF;
        END IF;
    END IF;

    now_ := clock_timestamp();
    IF c.last_event_id IS NOT NULL THEN
        -- the earliest late event, and when the last late event was enqueued
        SELECT w.event_id, max(w.enqueued_at) OVER () INTO late, late_at
          FROM wh_perspective_events w
         WHERE w.stream_id = p_stream_id AND w.perspective_name = p_perspective
           AND w.event_id < c.last_event_id
         ORDER BY w.event_id
         LIMIT 1;
        IF late IS NOT NULL AND (c.rewind_trigger_event_id IS NULL
                                 OR late < c.rewind_trigger_event_id
                                 OR late_at > c.rewind_flagged_at) THEN
            UPDATE wh_perspective_cursors k
               SET rewind_trigger_event_id = CASE WHEN k.rewind_trigger_event_id IS NULL THEN late
                                                  ELSE least(k.rewind_trigger_event_id, late) END,
                   rewind_flagged_at = now_,
                   rewind_first_flagged_at = CASE WHEN k.rewind_trigger_event_id IS NULL THEN now_
                                                  ELSE k.rewind_first_flagged_at END,
                   status = k.status | 1
             WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
            RETURNING * INTO c;
        END IF;
    END IF;

    IF c.rewind_trigger_event_id IS NOT NULL THEN
        IF c.rewind_flagged_at + p_debounce_us * interval '1 microsecond' > now_ THEN
            verdict := 'idle';
        ELSE
            verdict := 'rewind';
        END IF;
    ELSE
        verdict := 'apply';
    END IF;

    outcome := verdict;
    last_event_id := c.last_event_id;
    revision := c.revision;
    applied_count := c.applied_count;
    rewind_trigger_event_id := c.rewind_trigger_event_id;
    rewind_flagged_at := c.rewind_flagged_at;
    rewind_first_flagged_at := c.rewind_first_flagged_at;
    error := c.error;
    failures := c.failures;
    latest_snapshot := (SELECT s.event_id FROM wh_perspective_snapshots s
                         WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective
                         ORDER BY s.event_id DESC LIMIT 1);
    stream_lock_instance_id := c.stream_lock_instance_id;
    stream_lock_reason := c.stream_lock_reason;
    stream_lock_expiry := c.stream_lock_expiry;
    stream_lock_epoch := c.stream_lock_epoch;
    IF verdict = 'apply' THEN
        state := (SELECT s.state FROM wh_perspective_states s
                   WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective);
    END IF;
    RETURN NEXT;
    IF verdict <> 'apply' THEN
        RETURN;
    END IF;
    RETURN QUERY
        SELECT NULL::text, NULL::uuid, NULL::bigint, NULL::bigint, NULL::uuid, NULL::timestamptz,
               NULL::timestamptz, NULL::text, NULL::integer, NULL::uuid, NULL::uuid, NULL::text,
               NULL::timestamptz, NULL::bigint, NULL::jsonb,
               e.event_id, e.version, e.event_type, e.payload, e.recorded_at
          FROM wh_perspective_events w
          JOIN wh_events e ON e.event_id = w.event_id AND e.stream_id = w.stream_id
         WHERE w.stream_id = p_stream_id AND w.perspective_name = p_perspective
           AND (c.last_event_id IS NULL OR w.event_id > c.last_event_id)
         ORDER BY w.event_id
         LIMIT p_max_events;
END
$$;

-- The checks every write of a pair's state starts with, on the cursor row locked
-- FOR NO KEY UPDATE (kept until the transaction ends, so a passed fence stays passed: a
-- takeover, renew or force-release of the lease waits for this transaction; ADR 0002 §5).
-- Returns NULL when the write may go ahead, else 'no_cursor', 'lease_lost' or 'conflict'.
-- p_fence_holder NULL: no fence; p_expected_revision NULL: no revision check.
CREATE OR REPLACE FUNCTION lockstep_perspective_check(
    p_stream_id         uuid,
    p_perspective       text,
    p_expected_revision bigint,
    p_fence_holder      uuid,
    p_fence_epoch       bigint,
    OUT refusal         text,
    OUT cursor_revision bigint
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    c wh_perspective_cursors%ROWTYPE;
BEGIN
    SELECT * INTO c FROM wh_perspective_cursors k
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        refusal := CASE WHEN p_fence_holder IS NULL THEN 'no_cursor' ELSE 'lease_lost' END;
        RETURN;
    END IF;
    cursor_revision := c.revision;
    IF p_fence_holder IS NOT NULL
       AND NOT (c.stream_lock_instance_id IS NOT DISTINCT FROM p_fence_holder
                AND c.stream_lock_epoch = p_fence_epoch
                AND c.stream_lock_expiry > clock_timestamp()) THEN
        refusal := 'lease_lost';
    ELSIF p_expected_revision IS NOT NULL AND c.revision <> p_expected_revision THEN
        refusal := 'conflict';
    END IF;
END
$$;

-- Keeps the newest p_keep snapshots of a pair (by event id).
CREATE OR REPLACE FUNCTION lockstep_perspective_prune_snapshots(
    p_stream_id   uuid,
    p_perspective text,
    p_keep        integer
) RETURNS void
LANGUAGE sql VOLATILE AS $$
    DELETE FROM wh_perspective_snapshots s
     WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective
       AND s.event_id < (SELECT k.event_id FROM wh_perspective_snapshots k
                          WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
                          ORDER BY k.event_id DESC OFFSET greatest(p_keep, 1) - 1 LIMIT 1);
$$;

-- Commits a state change, in one statement: fence, compare-and-set on the revision, state
-- upsert, delete exactly the applied work, advance the cursor (revision + 1, error and
-- failures cleared), clear the rewind request if its trigger is still p_rewound_from and drop
-- the snapshots at or after it, optionally snapshot the new state and prune. Refusals are
-- returned (outcome 'no_cursor', 'lease_lost', 'conflict'), with nothing written and the
-- transaction still usable; else outcome 'committed' and the new revision.
CREATE OR REPLACE FUNCTION lockstep_perspective_commit(
    p_stream_id         uuid,
    p_perspective       text,
    p_expected_revision bigint,
    p_state             jsonb,
    p_last_event_id     uuid,
    p_applied_count     bigint,
    p_applied           uuid[],
    p_rewound_from      uuid,
    p_snapshot          boolean,
    p_keep              integer,
    p_fence_holder      uuid,
    p_fence_epoch       bigint,
    OUT outcome         text,
    OUT revision        bigint
)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    refused text;
BEGIN
    SELECT ch.refusal, ch.cursor_revision INTO refused, revision
      FROM lockstep_perspective_check(p_stream_id, p_perspective, p_expected_revision,
                                      p_fence_holder, p_fence_epoch) ch;
    IF refused IS NOT NULL THEN
        outcome := refused;
        RETURN;
    END IF;
    INSERT INTO wh_perspective_states AS s (stream_id, perspective_name, state)
    VALUES (p_stream_id, p_perspective, p_state)
    ON CONFLICT (stream_id, perspective_name)
    DO UPDATE SET state = EXCLUDED.state, updated_at = clock_timestamp();
    DELETE FROM wh_perspective_events w
     WHERE w.stream_id = p_stream_id AND w.perspective_name = p_perspective
       AND w.event_id = ANY (p_applied);
    UPDATE wh_perspective_cursors k
       SET last_event_id = p_last_event_id,
           applied_count = p_applied_count,
           revision = k.revision + 1,
           processed_at = clock_timestamp(),
           error = NULL,
           failures = 0,
           rewind_trigger_event_id = CASE WHEN k.rewind_trigger_event_id = p_rewound_from
                                          THEN NULL ELSE k.rewind_trigger_event_id END,
           rewind_flagged_at = CASE WHEN k.rewind_trigger_event_id = p_rewound_from
                                    THEN NULL ELSE k.rewind_flagged_at END,
           rewind_first_flagged_at = CASE WHEN k.rewind_trigger_event_id = p_rewound_from
                                          THEN NULL ELSE k.rewind_first_flagged_at END,
           status = CASE WHEN k.rewind_trigger_event_id = p_rewound_from
                         THEN k.status & ~1 ELSE k.status END
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
    RETURNING k.revision INTO revision;
    IF p_rewound_from IS NOT NULL THEN
        DELETE FROM wh_perspective_snapshots s
         WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective
           AND s.event_id >= p_rewound_from;
    END IF;
    IF p_snapshot AND p_last_event_id IS NOT NULL THEN
        INSERT INTO wh_perspective_snapshots AS s
               (stream_id, perspective_name, event_id, state, applied_count)
        VALUES (p_stream_id, p_perspective, p_last_event_id, p_state, p_applied_count)
        ON CONFLICT (stream_id, perspective_name, event_id)
        DO UPDATE SET state = EXCLUDED.state, applied_count = EXCLUDED.applied_count,
                      created_at = clock_timestamp();
        PERFORM lockstep_perspective_prune_snapshots(p_stream_id, p_perspective, p_keep);
    END IF;
    outcome := 'committed';
END
$$;

-- Bootstrap: snapshots the pair's current state at its last applied event if the cursor is
-- still at p_expected_revision and has applied events, then prunes. Returns 'saved',
-- 'unchanged' (moved on, nothing applied, or that snapshot exists) or 'lease_lost'.
CREATE OR REPLACE FUNCTION lockstep_perspective_save_snapshot(
    p_stream_id         uuid,
    p_perspective       text,
    p_expected_revision bigint,
    p_keep              integer,
    p_fence_holder      uuid,
    p_fence_epoch       bigint
) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    refused text;
BEGIN
    SELECT ch.refusal INTO refused
      FROM lockstep_perspective_check(p_stream_id, p_perspective, p_expected_revision,
                                      p_fence_holder, p_fence_epoch) ch;
    IF refused = 'lease_lost' THEN
        RETURN 'lease_lost';
    ELSIF refused IS NOT NULL THEN
        RETURN 'unchanged';
    END IF;
    INSERT INTO wh_perspective_snapshots (stream_id, perspective_name, event_id, state, applied_count)
    SELECT k.stream_id, k.perspective_name, k.last_event_id, s.state, k.applied_count
      FROM wh_perspective_cursors k
      JOIN wh_perspective_states s
        ON s.stream_id = k.stream_id AND s.perspective_name = k.perspective_name
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
       AND k.last_event_id IS NOT NULL
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN 'unchanged';
    END IF;
    PERFORM lockstep_perspective_prune_snapshots(p_stream_id, p_perspective, p_keep);
    RETURN 'saved';
END
$$;

-- Purges a pair: deletes its state, snapshots and pending work and resets its cursor (no
-- event applied, no rewind, no error, revision + 1; the lease stays). Returns 'purged',
-- 'no_cursor' or 'lease_lost'.
CREATE OR REPLACE FUNCTION lockstep_perspective_purge(
    p_stream_id    uuid,
    p_perspective  text,
    p_fence_holder uuid,
    p_fence_epoch  bigint
) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    refused text;
BEGIN
    SELECT ch.refusal INTO refused
      FROM lockstep_perspective_check(p_stream_id, p_perspective, NULL,
                                      p_fence_holder, p_fence_epoch) ch;
    IF refused IS NOT NULL THEN
        RETURN refused;
    END IF;
    DELETE FROM wh_perspective_states s
     WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective;
    DELETE FROM wh_perspective_snapshots s
     WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective;
    DELETE FROM wh_perspective_events w
     WHERE w.stream_id = p_stream_id AND w.perspective_name = p_perspective;
    UPDATE wh_perspective_cursors k
       SET last_event_id = NULL, applied_count = 0, revision = k.revision + 1,
           processed_at = clock_timestamp(), error = NULL, failures = 0,
           rewind_trigger_event_id = NULL, rewind_flagged_at = NULL,
           rewind_first_flagged_at = NULL, status = k.status & ~1
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective;
    RETURN 'purged';
END
$$;
