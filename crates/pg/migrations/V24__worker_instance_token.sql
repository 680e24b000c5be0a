-- lockstep V24: which process announced a worker instance (docs/adr/0015-worker-fleet.md).
--
-- An instance id names one running process: its stream leases are held by that id, so two
-- processes started with one id would share one fleet row and each hold every lease of the
-- other re-entrantly. Each announce now stores the announcing process's token (random, drawn
-- once per process). An announce whose id has a live row (`last_seen_at + stale_after` in the
-- future) with another token is refused, the row unchanged, and the announcer is told which
-- process holds the id; a row with the same token (the same process announcing again) is
-- replaced, and a stale row of another process is taken over as a new start.
--
-- Rows announced before this migration, or by a binary of an earlier release during a rolling
-- upgrade, have no token: like any other token, they are taken over once stale.
--
-- Adding a nullable column without a default rewrites nothing and takes the ACCESS EXCLUSIVE
-- lock only for the catalog change. Every statement is re-runnable.

ALTER TABLE wh_worker_instances ADD COLUMN IF NOT EXISTS token uuid;

COMMENT ON COLUMN wh_worker_instances.token IS
    'lockstep: the token of the process that announced the instance (random per process); '
    'a live row of another token is not replaced';
