-- The advisory locks of this database, granted and awaited, as pg_locks shows them, with the
-- 64-bit key put back together and the session's activity beside each: what `lockstep locks`
-- and the status page list, and what an operator filters with lockstep_advisory_key('…') to
-- see who holds or waits for one resource.
--
-- pg_locks splits a bigint advisory key into classid (high 32 bits) and objid (low 32 bits),
-- with objsubid = 1; objsubid = 2 marks a lock taken with two int4 keys, which lockstep never
-- takes, so those rows are left out. pg_locks lists every database of the cluster: the view
-- keeps the current one. The join is a LEFT JOIN so that a prepared transaction's locks (no
-- session, pid NULL) are listed too. The activity columns of another role's sessions are NULL
-- unless the reader may see them (pg_read_all_stats). transaction_age is measured from the
-- start of the reading transaction (now()).
CREATE OR REPLACE VIEW lockstep_advisory_locks AS
SELECT ((l.classid::bigint << 32) | l.objid::bigint) AS advisory_key,
       l.pid,
       l.granted,
       l.mode,
       l.virtualtransaction,
       a.state,
       a.xact_start,
       now() - a.xact_start AS transaction_age,
       a.wait_event_type,
       a.application_name,
       a.client_addr
FROM pg_locks l
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database());
