-- lockstep V25: what a worker holds is bounded by the decoded size of the events it reads; a
-- change of the registered perspectives never holds appends back for more than a moment; a
-- retirement takes a perspective's rows in the workers' order
-- (docs/adr/0037-byte-bounds-count-decoded-sizes.md,
-- docs/adr/0038-registrations-wait-beside-appends.md).
--
-- - `wh_events.payload_bytes`: the payload's decoded size, the size of its uncompressed `jsonb`,
--   written by `lockstep_append_events` (replaced with the same signature, result and errors).
--   Left NULL on the rows stored before this migration (no rewrite of the events table while
--   it is applied): every reader takes `coalesce(payload_bytes, pg_column_size(payload #> '{}'))`,
--   the same number (`#> '{}'` hands back the whole value, decompressed).
-- - `lockstep_load_rewind` and `lockstep_rewind_page`: the same rows, the last column the
--   payload's decoded size (`payload_bytes`) instead of its stored, possibly compressed, size
--   (`pg_column_size`): a page's byte bound is what the worker holds once it decoded the page.
-- - `lockstep_lock_perspectives_for_change` (new): ACCESS EXCLUSIVE on `wh_perspectives` for a
--   registration or a retirement, queueing behind the transactions that hold the table (every
--   append holds ACCESS SHARE on it until it ends) for at most `p_queue_at_most` at a time —
--   appends that arrive meanwhile queue behind the request — and not again while one it timed
--   out behind still holds it; after `p_give_up_after`, `lock_not_available` (55P03) naming
--   the oldest of them.
-- - `lockstep_register_perspectives(names, queue_at_most, give_up_after)` and
--   `lockstep_retire_perspective(name, keep, queue_at_most, give_up_after)` replace the
--   functions of V11 (dropped; the new parameters have defaults, so a call with the old
--   arguments still works) and take their exclusive lock through it. A retirement first locks
--   the perspective's cursor rows in stream order (the order in which every worker locks
--   cursor rows, or skips them), waiting for the batches and fenced commits that hold some of
--   them before it touches any row they write: it no longer deadlocks with them.
--
-- Every statement is re-runnable.

ALTER TABLE wh_events ADD COLUMN IF NOT EXISTS payload_bytes bigint;

-- V13's append (same signature, result, errors and statements), which also stores each
-- payload's decoded size: `pg_column_size` of the value the insert is given, an element of
-- the `jsonb[]` parameter — never compressed (an array holds its elements uncompressed), so
-- this is the size of the uncompressed `jsonb`, read from its header: no work per byte.
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
    n bigint := coalesce(cardinality(p_event_ids), 0);
    inserted bigint := 0;
    stored bigint;
    replayed bigint;
    first_version bigint;
    sample_id uuid;
    sample_stream uuid;
    sample_version bigint;
BEGIN
    SELECT coalesce(max(version), 0) INTO current_version
    FROM wh_events WHERE stream_id = p_stream_id;
    IF p_expected IS NULL OR p_expected = current_version THEN
        INSERT INTO wh_events (event_id, stream_id, version, event_type, payload, payload_bytes)
        SELECT e.event_id, p_stream_id, current_version + e.ord, e.event_type, e.payload,
               pg_column_size(e.payload)
        FROM unnest(p_event_ids, p_types, p_payloads) WITH ORDINALITY AS e(event_id, event_type, payload, ord)
        ON CONFLICT (event_id) DO NOTHING;
        GET DIAGNOSTICS inserted = ROW_COUNT;
        IF inserted = n THEN
            IF EXISTS (SELECT FROM wh_perspectives) THEN
                INSERT INTO wh_perspective_cursors (stream_id, perspective_name)
                SELECT p_stream_id, p.perspective_name FROM wh_perspectives p
                ON CONFLICT DO NOTHING;
                INSERT INTO wh_perspective_events (stream_id, perspective_name, event_id)
                SELECT p_stream_id, p.perspective_name, e.event_id
                FROM wh_perspectives p CROSS JOIN unnest(p_event_ids) AS e(event_id)
                ON CONFLICT DO NOTHING;
            END IF;
            RETURN current_version + n;
        END IF;
    END IF;

    -- Not the common case: the ids as stored before this append ran.
    SELECT count(w.event_id),
           min(w.version) FILTER (WHERE a.ord = 1 AND w.stream_id = p_stream_id)
      INTO stored, first_version
      FROM unnest(p_event_ids) WITH ORDINALITY AS a(event_id, ord)
      JOIN wh_events w ON w.event_id = a.event_id
     WHERE NOT (w.stream_id = p_stream_id AND w.version > current_version);
    IF stored > 0 THEN
        SELECT count(*) INTO replayed
          FROM unnest(p_event_ids) WITH ORDINALITY AS a(event_id, ord)
          JOIN wh_events w ON w.event_id = a.event_id
         WHERE w.stream_id = p_stream_id AND w.version = first_version + a.ord - 1
           AND w.version <= current_version;
        IF replayed = n AND inserted = 0
           AND (p_expected IS NULL OR p_expected = first_version - 1) THEN
            RETURN first_version - 1 + n;
        END IF;
        SELECT w.event_id, w.stream_id, w.version INTO sample_id, sample_stream, sample_version
          FROM unnest(p_event_ids) WITH ORDINALITY AS a(event_id, ord)
          JOIN wh_events w ON w.event_id = a.event_id
         WHERE NOT (w.stream_id = p_stream_id AND w.version > current_version)
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
    IF p_expected IS NOT NULL AND current_version <> p_expected THEN
        RAISE EXCEPTION USING
            ERRCODE = 'unique_violation',
            CONSTRAINT = 'wh_events_stream_version',
            MESSAGE = format('stream %s: expected version %s, but it is at version %s',
                             p_stream_id, p_expected, current_version),
            DETAIL = format('actual_version=%s', current_version);
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'unique_violation',
        CONSTRAINT = 'wh_events_pkey',
        MESSAGE = format('stream %s: another transaction stored one of these %s event ids '
                         'while this append waited for it', p_stream_id, n);
END
$$;

-- V22's rewind reads (same parameters, plans and rows), whose last column is the payload's
-- decoded size: `payload_bytes`, or for an event stored before it existed the size of its
-- `jsonb` uncompressed (`#> '{}'` hands back the whole value, decompressed; nothing is
-- rendered). The column is renamed with its meaning, so the functions are made anew.
DROP FUNCTION IF EXISTS lockstep_load_rewind(uuid, text, bigint);
DROP FUNCTION IF EXISTS lockstep_rewind_page(uuid, text, uuid, bigint);

CREATE FUNCTION lockstep_load_rewind(
    p_stream      uuid,
    p_perspective text,
    p_limit       bigint
) RETURNS TABLE (
    part                    integer,
    last_event_id           uuid,
    revision                bigint,
    applied_count           bigint,
    rewind_trigger_event_id uuid,
    rewind_flagged_at       timestamptz,
    rewind_first_flagged_at timestamptz,
    error                   text,
    failures                integer,
    latest_snapshot_id      uuid,
    stream_lock_instance_id uuid,
    stream_lock_reason      text,
    stream_lock_expiry      timestamptz,
    stream_lock_epoch       bigint,
    failed_event_id         uuid,
    retry_at                timestamptz,
    parked_at               timestamptz,
    snapshot_event_id       uuid,
    snapshot_state          jsonb,
    snapshot_applied_count  bigint,
    event_id                uuid,
    version                 bigint,
    event_type              text,
    payload                 jsonb,
    recorded_at             timestamptz,
    payload_bytes           bigint
)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
SET enable_sort = off
SET enable_incremental_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    k wh_perspective_cursors%ROWTYPE;
BEGIN
    SELECT * INTO k FROM wh_perspective_cursors c
     WHERE c.stream_id = p_stream AND c.perspective_name = p_perspective;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    part := 0;
    last_event_id := k.last_event_id;
    revision := k.revision;
    applied_count := k.applied_count;
    rewind_trigger_event_id := k.rewind_trigger_event_id;
    rewind_flagged_at := k.rewind_flagged_at;
    rewind_first_flagged_at := k.rewind_first_flagged_at;
    error := k.error;
    failures := k.failures;
    stream_lock_instance_id := k.stream_lock_instance_id;
    stream_lock_reason := k.stream_lock_reason;
    stream_lock_expiry := k.stream_lock_expiry;
    stream_lock_epoch := k.stream_lock_epoch;
    failed_event_id := k.failed_event_id;
    retry_at := k.retry_at;
    parked_at := k.parked_at;
    SELECT s.event_id INTO latest_snapshot_id
      FROM wh_perspective_snapshots s
     WHERE s.stream_id = p_stream AND s.perspective_name = p_perspective
     ORDER BY s.event_id DESC LIMIT 1;
    IF k.rewind_trigger_event_id IS NOT NULL THEN
        SELECT s.event_id, s.state, s.applied_count
          INTO snapshot_event_id, snapshot_state, snapshot_applied_count
          FROM wh_perspective_snapshots s
         WHERE s.stream_id = p_stream AND s.perspective_name = p_perspective
           AND s.event_id < k.rewind_trigger_event_id
         ORDER BY s.event_id DESC LIMIT 1;
    END IF;
    RETURN NEXT;
    IF k.rewind_trigger_event_id IS NULL THEN
        RETURN;
    END IF;
    -- From the snapshot's event on (or the first), leaving the snapshot's own event out: the
    -- page of `lockstep_rewind_page` below after the snapshot, written out rather than called,
    -- so that the rows go through one tuplestore, not two.
    RETURN QUERY
    SELECT 1, NULL::uuid, NULL::bigint, NULL::bigint, NULL::uuid, NULL::timestamptz,
           NULL::timestamptz, NULL::text, NULL::integer, NULL::uuid, NULL::uuid, NULL::text,
           NULL::timestamptz, NULL::bigint, NULL::uuid, NULL::timestamptz, NULL::timestamptz,
           NULL::uuid, NULL::jsonb, NULL::bigint,
           e.event_id, e.version, e.event_type, e.payload, e.recorded_at,
           coalesce(e.payload_bytes, pg_column_size(e.payload #> '{}'))::bigint
      FROM wh_events e
     WHERE (e.stream_id, e.event_id)
               >= (p_stream, coalesce(snapshot_event_id, '00000000-0000-0000-0000-000000000000'::uuid))
       AND (e.stream_id, e.event_id) <= (p_stream, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid)
       AND e.event_id IS DISTINCT FROM snapshot_event_id
       AND NOT EXISTS (SELECT 1 FROM wh_perspective_skipped_events x
                        WHERE x.stream_id = p_stream AND x.perspective_name = p_perspective
                          AND x.event_id = e.event_id)
     ORDER BY e.stream_id, e.event_id
     LIMIT p_limit;
END
$$;

CREATE FUNCTION lockstep_rewind_page(
    p_stream      uuid,
    p_perspective text,
    p_after       uuid,
    p_limit       bigint
) RETURNS TABLE (
    event_id     uuid,
    version      bigint,
    event_type   text,
    payload      jsonb,
    recorded_at  timestamptz,
    payload_bytes bigint
)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
SET enable_sort = off
SET enable_incremental_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
BEGIN
    -- After `p_after` (from the first when NULL): the bound includes `p_after` itself, which
    -- the second condition leaves out, so that a NULL and an id are one range of the index.
    RETURN QUERY
    SELECT e.event_id, e.version, e.event_type, e.payload, e.recorded_at,
           coalesce(e.payload_bytes, pg_column_size(e.payload #> '{}'))::bigint
      FROM wh_events e
     WHERE (e.stream_id, e.event_id)
               >= (p_stream, coalesce(p_after, '00000000-0000-0000-0000-000000000000'::uuid))
       AND (e.stream_id, e.event_id) <= (p_stream, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid)
       AND e.event_id IS DISTINCT FROM p_after
       AND NOT EXISTS (SELECT 1 FROM wh_perspective_skipped_events x
                        WHERE x.stream_id = p_stream AND x.perspective_name = p_perspective
                          AND x.event_id = e.event_id)
     ORDER BY e.stream_id, e.event_id
     LIMIT p_limit;
END
$$;

-- ACCESS EXCLUSIVE on `wh_perspectives`, for a change of the registered perspectives
-- (`p_doing` names it in the error). Every append holds ACCESS SHARE on the table until its
-- transaction ends, and every append that starts while an ACCESS EXCLUSIVE request waits
-- queues behind the request: a plain `LOCK TABLE` behind an append left open stalls every
-- append of the database. So the request waits at most `p_queue_at_most` at a time (0: not at
-- all, `NOWAIT`), and once it timed out behind some transactions it is not made again while
-- any of them still holds the table (they are known to be slow; the appends that arrive
-- meanwhile go through). It is polled every 20 ms until `p_give_up_after` has passed since
-- the call; then `lock_not_available` (55P03, retryable), naming the oldest of them: pid, the
-- start of its transaction (when this role may see it) and its application. The holders are
-- told apart by their virtual transaction ids (`pg_locks`), so a pooled connection's next
-- transaction is a new holder. The caller's `lock_timeout` is left as it was.
CREATE OR REPLACE FUNCTION lockstep_lock_perspectives_for_change(
    p_doing         text,
    p_queue_at_most interval,
    p_give_up_after interval
) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    started   constant timestamptz := clock_timestamp();
    previous  constant text := current_setting('lock_timeout');
    queue_ms  constant bigint := greatest(ceil(extract(epoch FROM p_queue_at_most) * 1000), 0);
    db        constant oid := (SELECT d.oid FROM pg_database d WHERE d.datname = current_database());
    holders   text[];
    waited_on text[] := '{}';
    b         record;
BEGIN
    LOOP
        SELECT coalesce(array_agg(DISTINCT l.virtualtransaction), '{}') INTO holders
          FROM pg_locks l
         WHERE l.locktype = 'relation' AND l.database = db
           AND l.relation = 'wh_perspectives'::regclass
           AND l.granted AND l.pid IS DISTINCT FROM pg_backend_pid();
        IF NOT holders && waited_on THEN
            BEGIN
                IF queue_ms = 0 THEN
                    LOCK TABLE wh_perspectives IN ACCESS EXCLUSIVE MODE NOWAIT;
                ELSE
                    PERFORM set_config('lock_timeout', queue_ms::text, true);
                    LOCK TABLE wh_perspectives IN ACCESS EXCLUSIVE MODE;
                    PERFORM set_config('lock_timeout', previous, true);
                END IF;
                RETURN;
            EXCEPTION WHEN lock_not_available THEN
                -- (The block's setting of lock_timeout is undone with it.) The transactions
                -- that hold the table now: the request timed out behind them.
                SELECT coalesce(array_agg(DISTINCT l.virtualtransaction), '{}') INTO waited_on
                  FROM pg_locks l
                 WHERE l.locktype = 'relation' AND l.database = db
                   AND l.relation = 'wh_perspectives'::regclass
                   AND l.granted AND l.pid IS DISTINCT FROM pg_backend_pid();
            END;
        END IF;
        IF clock_timestamp() - started >= p_give_up_after THEN
            SELECT l.pid, a.xact_start, a.application_name INTO b
              FROM pg_locks l
              LEFT JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE l.locktype = 'relation' AND l.database = db
               AND l.relation = 'wh_perspectives'::regclass
               AND l.granted AND l.pid IS DISTINCT FROM pg_backend_pid()
               AND l.virtualtransaction = ANY (waited_on)
             ORDER BY a.xact_start NULLS LAST
             LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'lock_not_available',
                    MESSAGE = format(
                        'an append transaction (or another transaction that read the '
                        'registered perspectives) has been open since %s (pid %s%s); waited %s '
                        'for it and gave up rather than hold every append back behind it: '
                        'retry once it has ended',
                        coalesce(b.xact_start::text, 'a time this role cannot see'),
                        coalesce(b.pid::text, 'none: a prepared transaction'),
                        CASE WHEN b.application_name <> ''
                             THEN format(', application %L', b.application_name) ELSE '' END,
                        p_give_up_after),
                    DETAIL = format('%s; pid=%s', p_doing, coalesce(b.pid::text, ''));
            END IF;
        END IF;
        PERFORM pg_sleep(0.02);
    END LOOP;
END
$$;

-- V11's registration (same result: how many names were new; same catch-up), whose exclusive
-- lock is taken by `lockstep_lock_perspectives_for_change`: appends queue behind it for at
-- most `p_queue_at_most` at a time, and after `p_give_up_after` it fails with 55P03 naming the
-- transaction it waits for. SHARE ROW EXCLUSIVE, which appends do not conflict with, still
-- comes first: names that are all registered return at once, and registrations and
-- retirements take turns. Once it holds the lock, appends wait for the registration's
-- catch-up (one work row per event of the database for a new name) until it commits.
DROP FUNCTION IF EXISTS lockstep_register_perspectives(text[]);
CREATE OR REPLACE FUNCTION lockstep_register_perspectives(
    p_names         text[],
    p_queue_at_most interval DEFAULT interval '50 milliseconds',
    p_give_up_after interval DEFAULT interval '5 seconds'
) RETURNS integer
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
    PERFORM lockstep_lock_perspectives_for_change('registering perspectives', p_queue_at_most,
                                                  p_give_up_after);
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

-- V11's retirement (same result; no row: neither registered nor retired with its states kept),
-- which takes its locks in this order:
--
-- 1. SHARE ROW EXCLUSIVE on `wh_perspectives` (registrations and retirements take turns;
--    appends do not wait for it); an unknown name returns here;
-- 2. the perspective's cursor rows, `FOR UPDATE`, in stream order — the order in which every
--    worker locks cursor rows (its claims skip locked rows instead): a batch or a fenced commit
--    that holds some of them is waited for before this touches any row it writes (work rows,
--    states, snapshots), so neither waits for the other in a cycle;
-- 3. ACCESS EXCLUSIVE on `wh_perspectives` through `lockstep_lock_perspectives_for_change`
--    (appends queue behind it for at most `p_queue_at_most` at a time; 55P03 after
--    `p_give_up_after`): no append can enqueue work for the name after its work is deleted;
-- 4. the cursor rows again: those that appends committed between 2 and 3 (new streams).
--
-- Then as V11: the registration deleted; with the states kept, queued work that sorts before
-- its pair's cursor (a late arrival not yet claimed) becomes a rewind request first; the work
-- deleted; the states, snapshots, skipped events, progress, rate and cursors kept or dropped.
DROP FUNCTION IF EXISTS lockstep_retire_perspective(text, boolean);
CREATE OR REPLACE FUNCTION lockstep_retire_perspective(
    p_name          text,
    p_keep          boolean,
    p_queue_at_most interval DEFAULT interval '50 milliseconds',
    p_give_up_after interval DEFAULT interval '5 seconds'
)
RETURNS TABLE (work_removed bigint, pairs bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n_work  bigint;
    n_pairs bigint;
    was_registered boolean;
BEGIN
    LOCK TABLE wh_perspectives IN SHARE ROW EXCLUSIVE MODE;
    was_registered := EXISTS (SELECT 1 FROM wh_perspectives p WHERE p.perspective_name = p_name);
    IF NOT was_registered
       AND NOT EXISTS (SELECT 1 FROM wh_retired_perspectives r WHERE r.perspective_name = p_name) THEN
        RETURN;
    END IF;
    PERFORM 1 FROM wh_perspective_cursors k WHERE k.perspective_name = p_name
     ORDER BY k.stream_id FOR UPDATE;
    IF was_registered THEN
        PERFORM lockstep_lock_perspectives_for_change('retiring a perspective', p_queue_at_most,
                                                      p_give_up_after);
        PERFORM 1 FROM wh_perspective_cursors k WHERE k.perspective_name = p_name
         ORDER BY k.stream_id FOR UPDATE;
        DELETE FROM wh_perspectives p WHERE p.perspective_name = p_name;
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
