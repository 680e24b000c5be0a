-- The checks every write of a pair's state starts with: lockstep_perspective_commit,
-- lockstep_perspective_save_snapshot and lockstep_perspective_purge call it, and
-- lockstep_perspective_commit_release runs the same checks inline.
--
-- It locks the pair's cursor row FOR NO KEY UPDATE, and the lock is kept until the transaction
-- ends, so a passed fence stays passed: a takeover, renew or force-release of the lease (each
-- an UPDATE of that row) waits for this transaction, and a holder that stalled past its expiry
-- cannot commit over its successor's work. FOR NO KEY UPDATE rather than FOR SHARE: the write
-- that follows updates the same row anyway, and two fenced transactions of one holder that
-- shared the row lock would deadlock upgrading it (docs/adr/0002-stream-lease-sql.md, §5).
--
-- p_expected_revision  the revision the caller read; NULL: no compare-and-set.
-- p_fence_holder       the lease holder the write must be made under, with p_fence_epoch;
--                      NULL: no fence.
-- refusal              NULL: the write may go ahead. 'no_cursor': no row (without a fence);
--                      'lease_lost': no row under a fence, or the lease is not this holder's at
--                      this epoch, or it expired on the database clock; 'conflict': the
--                      revision moved. The fence is checked before the revision. A refusal is
--                      returned, not raised: the caller's transaction stays usable.
-- cursor_revision      the row's revision (NULL without a row).
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
