-- A rewind's last step: the fenced commit that also releases the fence's lease, in one
-- statement. lockstep-pg-store's commit_state_releasing, and (through
-- lockstep_perspective_commit_release_or_refuse) commit_state_releasing_and_end.
-- Parameters, checks, writes and outcomes are lockstep_perspective_commit's, in the same order:
-- the cursor row locked FOR NO KEY UPDATE (waiting for it); no row: 'no_cursor', or 'lease_lost'
-- with a fence; the fence (holder, epoch, live on the database clock): 'lease_lost'; the revision:
-- 'conflict'. A refusal writes and releases nothing. Then the state, the applied work rows, the
-- cursor, the rewind request, the snapshots and the prune, as the commit does them.
-- released: whether the lease was released. It is, when the commit goes ahead with a fence
-- whose holder and epoch are the locked row's: the holder, reason and expiry are cleared as the
-- stream locker's release clears them; the epoch stays, so the next acquire gets a later one.
-- The worker stops renewing the lease before it sends this, and forgets the lease without a
-- statement once the transaction committed with released.
-- Why one body: the check and the prune are inline (no nested call, each statement planned once
-- per connection), and the lease is cleared by the cursor's own update, so a rewind writes one
-- row version, not two, on the row the keepalive renews. Raises no error of its own.
CREATE OR REPLACE FUNCTION lockstep_perspective_commit_release(
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
    OUT revision        bigint,
    OUT released        boolean
)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    c       wh_perspective_cursors%ROWTYPE;
    release boolean;
BEGIN
    released := false;
    -- The checks of lockstep_perspective_check, inline.
    SELECT * INTO c FROM wh_perspective_cursors k
     WHERE k.stream_id = p_stream_id AND k.perspective_name = p_perspective
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        outcome := CASE WHEN p_fence_holder IS NULL THEN 'no_cursor' ELSE 'lease_lost' END;
        RETURN;
    END IF;
    revision := c.revision;
    IF p_fence_holder IS NOT NULL
       AND NOT (c.stream_lock_instance_id IS NOT DISTINCT FROM p_fence_holder
                AND c.stream_lock_epoch = p_fence_epoch
                AND c.stream_lock_expiry > clock_timestamp()) THEN
        outcome := 'lease_lost';
        RETURN;
    ELSIF p_expected_revision IS NOT NULL AND c.revision <> p_expected_revision THEN
        outcome := 'conflict';
        RETURN;
    END IF;
    -- Whether the commit releases the lease, decided on the row this transaction holds locked:
    -- nothing else can change its lease columns before the update below, which clears them.
    release := coalesce(p_fence_holder IS NOT NULL
                        AND c.stream_lock_instance_id = p_fence_holder
                        AND c.stream_lock_epoch = p_fence_epoch, false);

    -- The writes of lockstep_perspective_commit, inline.
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
                         THEN k.status & ~1 ELSE k.status END,
           -- The release, in the same row version as the commit.
           stream_lock_instance_id = CASE WHEN release THEN NULL
                                          ELSE k.stream_lock_instance_id END,
           stream_lock_reason = CASE WHEN release THEN NULL ELSE k.stream_lock_reason END,
           stream_lock_expiry = CASE WHEN release THEN NULL ELSE k.stream_lock_expiry END
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
        -- lockstep_perspective_prune_snapshots, inline.
        DELETE FROM wh_perspective_snapshots s
         WHERE s.stream_id = p_stream_id AND s.perspective_name = p_perspective
           AND s.event_id < (SELECT k.event_id FROM wh_perspective_snapshots k
                              WHERE k.stream_id = p_stream_id
                                AND k.perspective_name = p_perspective
                              ORDER BY k.event_id DESC OFFSET greatest(p_keep, 1) - 1 LIMIT 1);
    END IF;
    outcome := 'committed';
    released := release;
END
$$;
