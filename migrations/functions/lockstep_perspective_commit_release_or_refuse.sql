-- lockstep_perspective_commit_release, but a refused commit is an error instead of a row: for a
-- statement sent in the same round trip as the transaction's COMMIT (lockstep-pg-store's
-- commit_state_releasing_and_end, the worker's rewind;
-- docs/adr/0034-fenced-commit-sent-with-the-commit.md). The store sends it without waiting for
-- its answer; an error turns that COMMIT into a rollback, so a refused state change (a stale
-- revision, no cursor, a lost lease) commits nothing of the transaction, exactly as when the
-- caller reads the refusal and rolls back.
-- Same parameters and columns as lockstep_perspective_commit_release; outcome is always
-- 'committed'. Raises SQLSTATE LSREF on a refusal: the message is the outcome ('conflict',
-- 'no_cursor', 'lease_lost'), the detail the revision found (empty when none); the store maps it
-- back to the error the row would have given.
CREATE OR REPLACE FUNCTION lockstep_perspective_commit_release_or_refuse(
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
BEGIN
    SELECT r.outcome, r.revision, r.released INTO outcome, revision, released
      FROM lockstep_perspective_commit_release(
               p_stream_id, p_perspective, p_expected_revision, p_state, p_last_event_id,
               p_applied_count, p_applied, p_rewound_from, p_snapshot, p_keep,
               p_fence_holder, p_fence_epoch) r;
    IF outcome IS DISTINCT FROM 'committed' THEN
        RAISE EXCEPTION USING ERRCODE = 'LSREF',
            MESSAGE = coalesce(outcome, 'none'),
            DETAIL = coalesce(revision::text, '');
    END IF;
END
$$;
