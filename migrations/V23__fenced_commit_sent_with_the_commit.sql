-- lockstep V23: a rewind's fenced commit travels with the transaction's `COMMIT` (issue 18,
-- `rewind_snapshot_vs_full`; docs/adr/0034-fenced-commit-sent-with-the-commit.md).
--
-- `lockstep_perspective_commit_release_or_refuse`: `lockstep_perspective_commit_release` (V17),
-- but a commit it refuses is an error instead of a row. The store sends it in the same round
-- trip as the `COMMIT` (`PerspectiveStore::commit_state_releasing_and_end`), without waiting
-- for its answer first; an error turns that `COMMIT` into a rollback, so a refused state change
-- (a stale revision, no cursor, a lost lease) commits nothing of the transaction, as when the
-- caller read the refusal and rolled back. The error: SQLSTATE `LSREF`, the message the
-- outcome (`conflict`, `no_cursor`, `lease_lost`), the detail the revision found (empty when
-- none). Same parameters and columns as V17's function.
--
-- Re-runnable.

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
