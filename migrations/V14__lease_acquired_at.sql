-- lockstep V14: when a stream lease was acquired (issue 21; docs/adr/0021-lease-acquired-at.md).
--
-- An operator looking at a held lease asks how long it has been held: the expiry alone cannot
-- say, because every renewal moves it. The try-acquire that begins a lease's epoch now also
-- sets `stream_lock_acquired_at` to the database clock and `stream_lock_acquired_epoch` to that
-- epoch, in the same statement; a holder's re-entry into its own live lease and every renewal
-- keep both. The lockstep releases clear them with the other lease columns.
--
-- The start is read only while a holder is set and only when `stream_lock_acquired_epoch`
-- equals `stream_lock_epoch`: a lease whose epoch began elsewhere — acquired before this
-- migration, or by a binary of an earlier release still running during a rolling upgrade (it
-- moves the epoch without touching these columns) — lists with no start ("not recorded")
-- instead of the start of an earlier lease.
--
-- There is no V12: V13 landed first, and refinery refuses a version lower than the last one
-- applied, so the gap is left as it is.
--
-- Adding nullable columns without a default rewrites nothing and takes the ACCESS EXCLUSIVE
-- lock only for the catalog change. Every statement is re-runnable.

ALTER TABLE wh_perspective_cursors
    ADD COLUMN IF NOT EXISTS stream_lock_acquired_at timestamptz,
    ADD COLUMN IF NOT EXISTS stream_lock_acquired_epoch bigint;

COMMENT ON COLUMN wh_perspective_cursors.stream_lock_acquired_at IS
    'lockstep: when the lease of epoch stream_lock_acquired_epoch was acquired, database clock; '
    'meaningful only while a holder is set and that epoch is stream_lock_epoch (V14, '
    'docs/adr/0021-lease-acquired-at.md)';
COMMENT ON COLUMN wh_perspective_cursors.stream_lock_acquired_epoch IS
    'lockstep: the epoch whose acquisition stream_lock_acquired_at records (V14)';
