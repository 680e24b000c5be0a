-- lockstep V10: the fleet of worker instances (issue 20; docs/adr/0015-worker-fleet.md).
--
-- Each perspective worker announces itself once when it starts: its instance id (the same id
-- its stream leases are held by, so a lease's holder joins to its instance), a name, the host,
-- the process id, a version and the perspectives it runs. Its keepalive, the one statement per
-- keepalive interval that renews its stream leases, also sets `last_seen_at` (a CTE of that
-- same statement); a clean stop deletes the row. An instance is live while
-- `last_seen_at + stale_after > clock_timestamp()` (`stale_after`: its locker's lock timeout),
-- stale after that; a row not seen for a day is deleted by the next announce of any instance.
--
-- The row is updated once per keepalive interval and no index covers `last_seen_at`, so those
-- updates stay HOT; the fill factor leaves room for them on the page.
--
-- Every statement is re-runnable.

CREATE TABLE IF NOT EXISTS wh_worker_instances (
    instance_id  uuid        PRIMARY KEY,
    name         text        NOT NULL,
    host         text        NOT NULL,
    pid          bigint      NOT NULL,
    version      text        NOT NULL,
    perspectives text[]      NOT NULL DEFAULT '{}',
    started_at   timestamptz NOT NULL,
    last_seen_at timestamptz NOT NULL,
    stale_after  interval    NOT NULL,
    CONSTRAINT wh_worker_instances_stale_after_positive CHECK (stale_after > interval '0')
) WITH (fillfactor = 50);

COMMENT ON TABLE wh_worker_instances IS
    'lockstep: the announced perspective worker instances (V10, docs/adr/0015-worker-fleet.md); '
    'live while last_seen_at + stale_after is in the future';
