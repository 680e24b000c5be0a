-- lockstep V8: the worker claims batches of its own share of the work (issue 18;
-- docs/adr/0012-batch-claims-and-parking.md).
--
-- 1. A pair's backoff and parking live on its cursor, so every instance sees them and none
--    wastes a claim on a pair that waits: `retry_at` (no batch hands the pair out before it),
--    `parked_at` (none hands it out until an operator retries it), and `failed_event_id` (the
--    event the last failure happened at, the one an operator would skip). A successful commit
--    and a purge clear them (the V5/V7 commit and purge are replaced, same signatures).
-- 2. Events an operator skipped for a pair: `wh_perspective_skipped_events`. A skipped event's
--    work item is deleted; rewinds leave it out too.
-- 3. The work table's key becomes (perspective_name, stream_id, event_id): a batch walks one
--    perspective's pairs with work in stream order, one index descent per pair, so the cost of
--    a claim grows with the pairs it looks at, never with the length of the queue.
-- 4. `lockstep_perspective_claim_batch` hands out up to N pairs with their states and events in
--    one statement, skipping (never waiting for) rows other batches hold, live leases, pairs
--    backing off and parked pairs; `lockstep_perspective_commit_batch` commits every pair of a
--    batch in one statement, each with its own compare-and-set and fence, and stores the
--    failures.
--
-- Every statement is re-runnable.

ALTER TABLE wh_perspective_cursors
    ADD COLUMN IF NOT EXISTS failed_event_id uuid,
    ADD COLUMN IF NOT EXISTS retry_at        timestamptz,
    ADD COLUMN IF NOT EXISTS parked_at       timestamptz;

-- The parked pairs (a partial index: a keepalive renew changes none of its columns, so the
-- renew stays a HOT update, ADR 0002).
CREATE INDEX IF NOT EXISTS wh_perspective_cursors_parked
    ON wh_perspective_cursors (parked_at)
    WHERE parked_at IS NOT NULL;

CREATE TABLE IF NOT EXISTS wh_perspective_skipped_events (
    stream_id        uuid         NOT NULL,
    perspective_name text         NOT NULL,
    event_id         uuid         NOT NULL,
    reason           text         NOT NULL,
    skipped_at       timestamptz  NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (stream_id, perspective_name, event_id)
);

-- 3. The work table's key, perspective first (only when it is not already).
DO $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM pg_index i
          JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
         WHERE i.indrelid = 'wh_perspective_events'::regclass AND i.indisprimary
           AND a.attname <> 'perspective_name'
    ) THEN
        ALTER TABLE wh_perspective_events DROP CONSTRAINT wh_perspective_events_pkey;
        ALTER TABLE wh_perspective_events
            ADD CONSTRAINT wh_perspective_events_pkey
            PRIMARY KEY (perspective_name, stream_id, event_id);
    END IF;
END
$$;

-- Stores a failure of a pair (creating its cursor row if it has none): the error, the event it
-- failed at, one more failure, the backoff, and the parking when p_park. Returns whether the
-- pair is now parked.
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

-- V5's commit, which now also clears the backoff, the parking and the failed event.
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
     WHERE w.perspective_name = p_perspective AND w.stream_id = p_stream_id
       AND w.event_id = ANY (p_applied);
    UPDATE wh_perspective_cursors k
       SET last_event_id = p_last_event_id,
           applied_count = p_applied_count,
           revision = k.revision + 1,
           processed_at = clock_timestamp(),
           error = NULL,
           failures = 0,
           failed_event_id = NULL,
           retry_at = NULL,
           parked_at = NULL,
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

-- V7's purge, which now also clears the backoff, the parking and the failed event (the
-- skipped events stay skipped: the operator's decision outlives a rebuild).
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
     WHERE w.perspective_name = p_perspective AND w.stream_id = p_stream_id;
    UPDATE wh_perspective_cursors k
       SET last_event_id = NULL, applied_count = 0, revision = k.revision + 1,
           processed_at = clock_timestamp(), error = NULL, failures = 0,
           failed_event_id = NULL, retry_at = NULL, parked_at = NULL,
           rewind_trigger_event_id = NULL, rewind_flagged_at = NULL,
           rewind_first_flagged_at = NULL, status = (k.status & ~1) | 2
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective;
    RETURN 'purged';
END
$$;

-- Tries to claim one pair for a batch: locks its cursor row without waiting unless a live lease
-- is on it, it backs off or it is parked (verdict 'skip', nothing locked), creating a missing
-- row; then V7's claim logic — a purged pair with work, or a late arrival, writes or moves the
-- rewind request — and the verdict: 'rewind', 'idle' (a request inside its debounce window;
-- the row stays locked, the request written is kept by committing) or 'apply'.
CREATE OR REPLACE FUNCTION lockstep_perspective_try_claim(
    p_stream_id       uuid,
    p_perspective     text,
    p_debounce_us     bigint,
    p_debounce_max_us bigint,
    OUT verdict       text,
    OUT c             wh_perspective_cursors
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    now_    timestamptz := clock_timestamp();
    late    uuid;
    late_at timestamptz;
BEGIN
    SELECT * INTO c FROM wh_perspective_cursors k
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
       AND NOT (k.stream_lock_instance_id IS NOT NULL AND k.stream_lock_expiry > now_)
       AND k.parked_at IS NULL
       AND (k.retry_at IS NULL OR k.retry_at <= now_)
       FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM wh_perspective_cursors k
                    WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective) THEN
            verdict := 'skip';
            RETURN;
        END IF;
        INSERT INTO wh_perspective_cursors AS k (stream_id, perspective_name)
        VALUES (p_stream_id, p_perspective)
        ON CONFLICT DO NOTHING
        RETURNING * INTO c;
        IF NOT FOUND THEN
            verdict := 'skip';
            RETURN;
        END IF;
    END IF;
    IF c.status & 2 <> 0 AND EXISTS (
        SELECT 1 FROM wh_perspective_events w
         WHERE w.perspective_name = p_perspective AND w.stream_id = p_stream_id) THEN
        UPDATE wh_perspective_cursors k
           SET rewind_trigger_event_id = '00000000-0000-0000-0000-000000000000'::uuid,
               rewind_flagged_at = now_,
               rewind_first_flagged_at = coalesce(k.rewind_first_flagged_at, now_),
               status = (k.status | 1) & ~2
         WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
        RETURNING * INTO c;
    END IF;
    IF c.last_event_id IS NOT NULL THEN
        SELECT w.event_id, max(w.enqueued_at) OVER () INTO late, late_at
          FROM wh_perspective_events w
         WHERE w.perspective_name = p_perspective AND w.stream_id = p_stream_id
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
    IF c.rewind_trigger_event_id IS NULL THEN
        verdict := 'apply';
    ELSIF c.rewind_flagged_at + p_debounce_us * interval '1 microsecond' > now_
          AND (p_debounce_max_us IS NULL
               OR coalesce(c.rewind_first_flagged_at, c.rewind_flagged_at)
                  + p_debounce_max_us * interval '1 microsecond' > now_) THEN
        verdict := 'idle';
    ELSE
        verdict := 'rewind';
    END IF;
END
$$;

-- Claims a batch (lockstep-pg-store's claim_batch). p_names are the perspectives, in the order
-- they are served; p_after[i] is where the walk of p_names[i] continues after (NULL: from the
-- first stream). Rows:
--   kind 'rewind'   a claimed pair that needs a rewind (cursor columns set);
--   kind 'apply'    a claimed pair's header (cursor columns and state), followed by
--   kind 'event'    its events in event-id order (event columns set);
--   kind 'position' where the walk of perspective_name stopped (stream_id; NULL: none looked at
--                   and no position given).
-- First the pairs with a rewind request and no work needed (oldest request first; not counted
-- as looked at), then each perspective's pairs with work in stream order from its position,
-- wrapping round once (a pair that does not fit the bytes left ends the batch and keeps the
-- position: the next claim starts with it). At most p_scan pairs are looked at, p_max_pairs
-- claimed, p_max_events events and p_max_bytes
-- bytes (pg_column_size of payloads and states) handed out; the batch's first event is always
-- handed out, whatever its size.
CREATE OR REPLACE FUNCTION lockstep_perspective_claim_batch(
    p_names           text[],
    p_after           uuid[],
    p_max_pairs       integer,
    p_events_per_pair integer,
    p_max_events      integer,
    p_max_bytes       bigint,
    p_scan            integer,
    p_debounce_us     bigint,
    p_debounce_max_us bigint
) RETURNS TABLE (
    kind                    text,
    stream_id               uuid,
    perspective_name        text,
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
    failed_event_id         uuid,
    retry_at                timestamptz,
    parked_at               timestamptz,
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
    n_names     integer := coalesce(cardinality(p_names), 0);
    positions   uuid[] := p_after;
    scanned     integer := 0;
    claimed     integer := 0;
    events_left integer := p_max_events;
    bytes_left  bigint := p_max_bytes;
    taken       text[] := '{}';
    full_       boolean := false;
    i           integer;
    name_       text;
    start_      uuid;
    pos         uuid;
    prev_pos    uuid;
    upper_      uuid;
    wrapped     boolean;
    cand        uuid;
    rq          record;
    res         record;
    c           wh_perspective_cursors%ROWTYPE;
    st          jsonb;
    st_bytes    bigint;
    n           integer;
    ev          record;
BEGIN
    -- Pairs whose rewind was requested, work or not (an operator's request on a pair that is
    -- up to date has no work row to be found by).
    FOR rq IN
        SELECT k.stream_id AS s, k.perspective_name AS p FROM wh_perspective_cursors k
         WHERE k.rewind_trigger_event_id IS NOT NULL AND k.perspective_name = ANY (p_names)
           AND k.parked_at IS NULL
           AND (k.retry_at IS NULL OR k.retry_at <= clock_timestamp())
           AND NOT (k.stream_lock_instance_id IS NOT NULL AND k.stream_lock_expiry > clock_timestamp())
           AND (k.rewind_flagged_at + p_debounce_us * interval '1 microsecond' <= clock_timestamp()
                OR coalesce(k.rewind_first_flagged_at, k.rewind_flagged_at)
                   + p_debounce_max_us * interval '1 microsecond' <= clock_timestamp())
         ORDER BY k.rewind_flagged_at, k.stream_id, k.perspective_name COLLATE "C"
         LIMIT p_max_pairs
    LOOP
        SELECT * INTO res FROM lockstep_perspective_try_claim(rq.s, rq.p, p_debounce_us,
                                                              p_debounce_max_us) t;
        CONTINUE WHEN res.verdict <> 'rewind';
        c := res.c;
        claimed := claimed + 1;
        taken := taken || (c.stream_id::text || '/' || c.perspective_name);
        kind := 'rewind'; stream_id := c.stream_id; perspective_name := c.perspective_name;
        last_event_id := c.last_event_id; revision := c.revision; applied_count := c.applied_count;
        rewind_trigger_event_id := c.rewind_trigger_event_id;
        rewind_flagged_at := c.rewind_flagged_at;
        rewind_first_flagged_at := c.rewind_first_flagged_at;
        error := c.error; failures := c.failures;
        latest_snapshot := (SELECT s.event_id FROM wh_perspective_snapshots s
                             WHERE s.stream_id = c.stream_id
                               AND s.perspective_name = c.perspective_name
                             ORDER BY s.event_id DESC LIMIT 1);
        stream_lock_instance_id := c.stream_lock_instance_id;
        stream_lock_reason := c.stream_lock_reason; stream_lock_expiry := c.stream_lock_expiry;
        stream_lock_epoch := c.stream_lock_epoch; failed_event_id := c.failed_event_id;
        retry_at := c.retry_at; parked_at := c.parked_at;
        state := NULL; event_id := NULL; version := NULL; event_type := NULL; payload := NULL;
        recorded_at := NULL;
        RETURN NEXT;
    END LOOP;

    FOR i IN 1 .. n_names LOOP
        EXIT WHEN full_ OR scanned >= p_scan OR claimed >= p_max_pairs OR events_left <= 0;
        name_ := p_names[i];
        start_ := p_after[i];
        pos := start_;
        wrapped := false;
        LOOP
            EXIT WHEN full_ OR scanned >= p_scan OR claimed >= p_max_pairs OR events_left <= 0;
            -- The next pair of this perspective with work: one descent of the work table's key.
            -- Two statements, not `pos IS NULL OR stream_id > pos`: PL/pgSQL caches a generic
            -- plan, and an OR on a parameter turns its range into a filter over the whole
            -- perspective (measured: seconds per claim on 1 000 000 work rows).
            upper_ := CASE WHEN wrapped THEN start_
                           ELSE 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid END;
            IF pos IS NULL THEN
                SELECT w.stream_id INTO cand FROM wh_perspective_events w
                 WHERE w.perspective_name = name_ AND w.stream_id <= upper_
                 ORDER BY w.perspective_name, w.stream_id
                 LIMIT 1;
            ELSE
                SELECT w.stream_id INTO cand FROM wh_perspective_events w
                 WHERE w.perspective_name = name_ AND w.stream_id > pos AND w.stream_id <= upper_
                 ORDER BY w.perspective_name, w.stream_id
                 LIMIT 1;
            END IF;
            IF NOT FOUND THEN
                EXIT WHEN wrapped OR start_ IS NULL;
                wrapped := true;
                pos := NULL;
                CONTINUE;
            END IF;
            pos := cand;
            -- A pair this batch already holds (its rewind) is passed over, not counted.
            CONTINUE WHEN (cand::text || '/' || name_) = ANY (taken);
            prev_pos := positions[i];
            positions[i] := cand;
            scanned := scanned + 1;
            SELECT * INTO res FROM lockstep_perspective_try_claim(cand, name_, p_debounce_us,
                                                                  p_debounce_max_us) t;
            CONTINUE WHEN res.verdict IN ('skip', 'idle');
            c := res.c;
            kind := res.verdict; stream_id := c.stream_id; perspective_name := c.perspective_name;
            last_event_id := c.last_event_id; revision := c.revision;
            applied_count := c.applied_count;
            rewind_trigger_event_id := c.rewind_trigger_event_id;
            rewind_flagged_at := c.rewind_flagged_at;
            rewind_first_flagged_at := c.rewind_first_flagged_at;
            error := c.error; failures := c.failures;
            latest_snapshot := (SELECT s.event_id FROM wh_perspective_snapshots s
                                 WHERE s.stream_id = c.stream_id
                                   AND s.perspective_name = c.perspective_name
                                 ORDER BY s.event_id DESC LIMIT 1);
            stream_lock_instance_id := c.stream_lock_instance_id;
            stream_lock_reason := c.stream_lock_reason; stream_lock_expiry := c.stream_lock_expiry;
            stream_lock_epoch := c.stream_lock_epoch; failed_event_id := c.failed_event_id;
            retry_at := c.retry_at; parked_at := c.parked_at;
            event_id := NULL; version := NULL; event_type := NULL; payload := NULL;
            recorded_at := NULL;
            IF res.verdict = 'rewind' THEN
                state := NULL;
                claimed := claimed + 1;
                taken := taken || (cand::text || '/' || name_);
                RETURN NEXT;
                CONTINUE;
            END IF;
            st := (SELECT s.state FROM wh_perspective_states s
                    WHERE s.stream_id = cand AND s.perspective_name = name_);
            st_bytes := coalesce(pg_column_size(st), 0);
            n := 0;
            FOR ev IN
                SELECT e.event_id AS id, e.version AS v, e.event_type AS t, e.payload AS body,
                       e.recorded_at AS at, pg_column_size(e.payload) AS size
                  FROM wh_perspective_events w
                  JOIN wh_events e ON e.event_id = w.event_id AND e.stream_id = w.stream_id
                 WHERE w.perspective_name = name_ AND w.stream_id = cand
                   AND (c.last_event_id IS NULL OR w.event_id > c.last_event_id)
                 ORDER BY w.event_id
                 LIMIT least(p_events_per_pair, events_left)
            LOOP
                IF n = 0 THEN
                    -- The batch's first event always goes; a later pair only if its state and
                    -- first event fit.
                    IF events_left < p_max_events AND st_bytes + ev.size > bytes_left THEN
                        -- The next claim starts with this pair.
                        positions[i] := prev_pos;
                        full_ := true;
                        EXIT;
                    END IF;
                    kind := 'apply'; state := st;
                    RETURN NEXT;
                    bytes_left := bytes_left - st_bytes;
                    -- event rows carry the event columns only
                    last_event_id := NULL; revision := NULL; applied_count := NULL;
                    rewind_trigger_event_id := NULL; rewind_flagged_at := NULL;
                    rewind_first_flagged_at := NULL; error := NULL; failures := NULL;
                    latest_snapshot := NULL; stream_lock_instance_id := NULL;
                    stream_lock_reason := NULL; stream_lock_expiry := NULL;
                    stream_lock_epoch := NULL; failed_event_id := NULL; retry_at := NULL;
                    parked_at := NULL;
                ELSIF ev.size > bytes_left THEN
                    full_ := true;
                    EXIT;
                END IF;
                kind := 'event'; state := NULL;
                event_id := ev.id; version := ev.v; event_type := ev.t; payload := ev.body;
                recorded_at := ev.at;
                RETURN NEXT;
                n := n + 1;
                bytes_left := bytes_left - ev.size;
                events_left := events_left - 1;
            END LOOP;
            IF n > 0 THEN
                claimed := claimed + 1;
                taken := taken || (cand::text || '/' || name_);
            END IF;
            IF bytes_left <= 0 THEN
                full_ := true;
            END IF;
        END LOOP;
    END LOOP;

    FOR i IN 1 .. n_names LOOP
        kind := 'position'; stream_id := positions[i]; perspective_name := p_names[i];
        last_event_id := NULL; revision := NULL; applied_count := NULL;
        rewind_trigger_event_id := NULL; rewind_flagged_at := NULL;
        rewind_first_flagged_at := NULL; error := NULL; failures := NULL;
        latest_snapshot := NULL; stream_lock_instance_id := NULL; stream_lock_reason := NULL;
        stream_lock_expiry := NULL; stream_lock_epoch := NULL; failed_event_id := NULL;
        retry_at := NULL; parked_at := NULL; state := NULL; event_id := NULL; version := NULL;
        event_type := NULL; payload := NULL; recorded_at := NULL;
        RETURN NEXT;
    END LOOP;
END
$$;

-- Commits a batch (lockstep-pg-store's commit_batch): entry i is a state change when
-- p_has_commit[i] (as lockstep_perspective_commit; its applied events are p_applied_lens[i]
-- elements of p_applied, in entry order) and then a failure when p_errors[i] is not NULL (as
-- lockstep_perspective_record_failure). A refused state change ('conflict', 'no_cursor',
-- 'lease_lost') writes nothing of its entry. One row per entry: its ordinal (from 1), outcome
-- 'committed', 'recorded' or the refusal, the new revision, whether the pair is now parked.
CREATE OR REPLACE FUNCTION lockstep_perspective_commit_batch(
    p_stream_ids      uuid[],
    p_perspectives    text[],
    p_has_commit      boolean[],
    p_expected        bigint[],
    p_states          jsonb[],
    p_last_event_ids  uuid[],
    p_applied_counts  bigint[],
    p_applied_lens    integer[],
    p_applied         uuid[],
    p_rewound_from    uuid[],
    p_snapshots       boolean[],
    p_fence_holders   uuid[],
    p_fence_epochs    bigint[],
    p_keep            integer,
    p_errors          text[],
    p_failed_events   uuid[],
    p_retry_after_us  bigint[],
    p_park            boolean[]
) RETURNS TABLE (ord integer, outcome text, revision bigint, parked boolean)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    off_ integer := 0;
    len_ integer;
    r    record;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_stream_ids), 0) LOOP
        ord := i;
        outcome := 'recorded';
        revision := NULL;
        parked := false;
        len_ := p_applied_lens[i];
        IF p_has_commit[i] THEN
            SELECT * INTO r FROM lockstep_perspective_commit(
                p_stream_ids[i], p_perspectives[i], p_expected[i], p_states[i],
                p_last_event_ids[i], p_applied_counts[i], p_applied[off_ + 1 : off_ + len_],
                p_rewound_from[i], p_snapshots[i], p_keep, p_fence_holders[i],
                p_fence_epochs[i]) x;
            outcome := r.outcome;
            revision := r.revision;
        END IF;
        off_ := off_ + len_;
        IF outcome IN ('committed', 'recorded') AND p_errors[i] IS NOT NULL THEN
            parked := lockstep_perspective_record_failure(
                p_stream_ids[i], p_perspectives[i], p_errors[i], p_failed_events[i],
                p_retry_after_us[i], p_park[i]);
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
