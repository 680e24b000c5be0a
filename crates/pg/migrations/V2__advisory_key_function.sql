-- The advisory-lock key of a lockstep resource key, computed in SQL exactly as
-- lockstep_core::advisory_key does in Rust: the first 8 bytes of SHA-256 over the key's UTF-8
-- bytes, read as a big-endian signed 64-bit integer. Tested against ADVISORY_KEY_GOLDEN_VECTORS.
--
-- Operators use it to find who holds (or waits for) a lock:
--   SELECT * FROM lockstep_advisory_locks
--   WHERE advisory_key = lockstep_advisory_key('relay:aggregate:StockItem:0123…');
CREATE OR REPLACE FUNCTION lockstep_advisory_key(resource_key text) RETURNS bigint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT ('x' || substr(encode(sha256(convert_to(resource_key, 'UTF8')), 'hex'), 1, 16))::bit(64)::bigint $$;

-- Advisory locks as pg_locks shows them, with the 64-bit key put back together. pg_locks splits
-- a bigint advisory key into classid (high 32 bits) and objid (low 32 bits), objsubid = 1.
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
