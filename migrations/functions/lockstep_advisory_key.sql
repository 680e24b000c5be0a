-- The advisory-lock key of a lockstep resource key, computed in SQL exactly as
-- lockstep_core::advisory_key does in Rust: the first 8 bytes of SHA-256 over the key's UTF-8
-- bytes (convert_to makes them UTF-8 whatever the database's encoding), read as a big-endian
-- signed 64-bit integer. The two must agree bit for bit; the Postgres tests of
-- lockstep-pg-advisory check this function against ADVISORY_KEY_GOLDEN_VECTORS.
--
-- The Rust side computes its keys itself and does not call this: it is for people reading
-- pg_locks. Operators use it to find who holds (or waits for) a lock:
--   SELECT * FROM lockstep_advisory_locks
--   WHERE advisory_key = lockstep_advisory_key('relay:aggregate:StockItem:0123…');
--
-- IMMUTABLE, STRICT (NULL in, NULL out) and PARALLEL SAFE: a pure function of its argument,
-- which the planner folds to a constant when it is given a literal.
CREATE OR REPLACE FUNCTION lockstep_advisory_key(resource_key text) RETURNS bigint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT ('x' || substr(encode(sha256(convert_to(resource_key, 'UTF8')), 'hex'), 1, 16))::bit(64)::bigint $$;
