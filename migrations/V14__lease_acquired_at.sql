-- lockstep V14: when a stream lease was acquired (issue 21; docs/adr/0021-lease-acquired-at.md).
--
-- An operator looking at a held lease asks how long it has been held: the expiry alone cannot
-- say, because every renewal moves it. The try-acquire that begins a lease's epoch now also
-- sets `stream_lock_acquired_at` to the database clock, in the same statement; a holder's
-- re-entry into its own live lease and every renewal keep it. The lockstep releases clear it
-- with the other lease columns. Like `stream_lock_epoch`, it is meaningful only while a holder
-- is set: the listing reads it only then, and a lease acquired before this migration lists
-- with no start ("not recorded") instead of a guessed one.
--
-- There is no V12: V13 landed first, and refinery refuses a version lower than the last one
-- applied, so the gap is left as it is.
--
-- Adding a nullable column without a default rewrites nothing and takes its ACCESS EXCLUSIVE
-- lock only for the catalog change. Every statement is re-runnable.

ALTER TABLE wh_perspective_cursors
    ADD COLUMN IF NOT EXISTS stream_lock_acquired_at timestamptz;

COMMENT ON COLUMN wh_perspective_cursors.stream_lock_acquired_at IS
    'lockstep: when the current (or last) stream lease was acquired, database clock; set by the '
    'try-acquire that began its epoch, kept by renewals and re-entry (V14, '
    'docs/adr/0021-lease-acquired-at.md)';
