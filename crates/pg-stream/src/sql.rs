//! The SQL of the stream locker, one constant per operation.
//!
//! Every statement is a single atomic statement on `wh_perspective_cursors`, sent as a prepared
//! statement with bound parameters (names and reasons are never spliced into the text). Times
//! are computed and compared on the database clock, `clock_timestamp()`, and the lock timeout is
//! bound as an `interval` parameter. A lease is *live* while `stream_lock_expiry >
//! clock_timestamp()` and *expired* once `stream_lock_expiry <= clock_timestamp()`.
//!
//! Private to this crate: the statements change with the schema, so they are no API. Why they
//! look the way they do is recorded in `docs/adr/0002-stream-lease-sql.md`.

/// Try-acquire: `$1` stream id (`uuid`), `$2` perspective (`text`), `$3` instance (`uuid`),
/// `$4` reason (`text`, at most 50 characters), `$5` lock timeout (`interval`).
///
/// - `cur` locks the cursor row (`FOR NO KEY UPDATE NOWAIT`) and reads its lease as it is *now*:
///   when another transaction holds the row's lock (a perspective store's claim applying events,
///   a fenced commit, another lease operation in flight) the statement fails at once with
///   `55P03 lock_not_available` instead of waiting (try-acquire never waits), which the locker
///   answers [`AcquireOutcome::Busy`](lockstep_core::AcquireOutcome::Busy). Otherwise, under
///   READ COMMITTED a row updated by a transaction that committed after the statement's
///   snapshot is re-read at its latest version, so the decision and the denial report never
///   see a stale lease.
/// - `upd` takes the lease when it is free, expired, or already held by `$3`, in the same
///   statement. The epoch is kept only when `$3` re-acquires its own live lease; otherwise
///   (new holder, unlocked row, expired lease — even `$3`'s own) it increases by one.
///   `took_over` says whether an expired, uncleared lease was replaced; `reentered` whether `$3`
///   already held the lease, live (the same test that keeps the epoch). The same test keeps
///   `stream_lock_acquired_at` and `stream_lock_acquired_epoch`; a new epoch sets them to the
///   statement's clock and to that epoch.
/// - No row: the pair has no cursor. A row without `acquired_epoch`: denied, and the `holder`,
///   `reason`, `expiry`, `epoch` columns say by whom.
pub(crate) const TRY_ACQUIRE: &str = "\
WITH cur AS MATERIALIZED (
    SELECT stream_id, perspective_name,
           stream_lock_instance_id AS holder, stream_lock_reason AS reason,
           stream_lock_expiry AS expiry, stream_lock_epoch AS epoch,
           stream_lock_acquired_at AS started_at, stream_lock_acquired_epoch AS started_epoch
      FROM wh_perspective_cursors
     WHERE stream_id = $1::uuid AND perspective_name = $2::text
       FOR NO KEY UPDATE NOWAIT
), upd AS (
    UPDATE wh_perspective_cursors c
       SET stream_lock_instance_id = $3::uuid,
           stream_lock_reason = $4::text,
           stream_lock_expiry = n.now + $5::interval,
           stream_lock_epoch = CASE WHEN cur.holder = $3::uuid AND cur.expiry > n.now
                                    THEN cur.epoch ELSE cur.epoch + 1 END,
           stream_lock_acquired_at = CASE WHEN cur.holder = $3::uuid AND cur.expiry > n.now
                                          THEN cur.started_at ELSE n.now END,
           stream_lock_acquired_epoch = CASE WHEN cur.holder = $3::uuid AND cur.expiry > n.now
                                             THEN cur.started_epoch ELSE cur.epoch + 1 END
      FROM cur, (SELECT clock_timestamp() AS now) n
     WHERE c.stream_id = cur.stream_id AND c.perspective_name = cur.perspective_name
       AND (cur.holder IS NULL OR cur.expiry <= n.now OR cur.holder = $3::uuid)
 RETURNING c.stream_lock_epoch AS acquired_epoch, c.stream_lock_expiry AS acquired_expiry,
           (cur.holder IS NOT NULL AND cur.expiry <= n.now) AS took_over,
           (cur.holder = $3::uuid AND cur.expiry > n.now) AS reentered
)
SELECT upd.acquired_epoch, upd.acquired_expiry, upd.took_over, upd.reentered,
       cur.holder, cur.reason, cur.expiry, cur.epoch
  FROM cur LEFT JOIN upd ON true";

/// Renew: `$1` stream id, `$2` perspective, `$3` holder, `$4` epoch (`bigint`), `$5` lock
/// timeout (`interval`). Extends only a live lease held by `$3` at `$4`; returns the new expiry,
/// or no row when the lease is lost. Never resurrects an expired lease.
pub(crate) const RENEW: &str = "\
UPDATE wh_perspective_cursors
   SET stream_lock_expiry = clock_timestamp() + $5::interval
 WHERE stream_id = $1::uuid AND perspective_name = $2::text
   AND stream_lock_instance_id = $3::uuid AND stream_lock_epoch = $4::bigint
   AND stream_lock_expiry > clock_timestamp()
RETURNING stream_lock_expiry";

/// Release: `$1` stream id, `$2` perspective, `$3` holder, `$4` epoch. Clears the lease when
/// held by `$3` at `$4` (live or expired but uncleared); the epoch is kept. One row affected
/// means released, none means not held.
pub(crate) const RELEASE: &str = "\
UPDATE wh_perspective_cursors
   SET stream_lock_instance_id = NULL, stream_lock_reason = NULL, stream_lock_expiry = NULL,
       stream_lock_acquired_at = NULL, stream_lock_acquired_epoch = NULL
 WHERE stream_id = $1::uuid AND perspective_name = $2::text
   AND stream_lock_instance_id = $3::uuid AND stream_lock_epoch = $4::bigint";

/// Batched renew: `$1` stream ids (`uuid[]`), `$2` perspectives (`text[]`), `$3` holders
/// (`uuid[]`), `$4` epochs (`bigint[]`), `$5` lock timeout. One statement for any number of
/// leases; returns the key and new expiry of each lease it renewed.
///
/// `locked` first locks the named rows **in key order** (`ORDER BY … FOR NO KEY UPDATE`: the
/// row-locking step runs above the sort), so two concurrent batches always lock their common
/// rows in the same order and cannot deadlock, whatever plan the `UPDATE` gets (a small batch
/// plans as a nested loop in input order, a large one as a hash join over a sequential scan in
/// physical order). The `UPDATE` then finds its rows already locked by this statement.
pub(crate) const RENEW_MANY: &str = "\
WITH l AS (
    SELECT * FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::bigint[])
                  AS l(stream_id, perspective_name, holder, epoch)
), locked AS MATERIALIZED (
    SELECT c.stream_id, c.perspective_name
      FROM wh_perspective_cursors c
     WHERE (c.stream_id, c.perspective_name) IN (SELECT stream_id, perspective_name FROM l)
     ORDER BY c.stream_id, c.perspective_name COLLATE \"C\"
       FOR NO KEY UPDATE OF c
)
UPDATE wh_perspective_cursors c
   SET stream_lock_expiry = clock_timestamp() + $5::interval
  FROM l, locked k
 WHERE c.stream_id = k.stream_id AND c.perspective_name = k.perspective_name
   AND l.stream_id = k.stream_id AND l.perspective_name = k.perspective_name
   AND c.stream_lock_instance_id = l.holder AND c.stream_lock_epoch = l.epoch
   AND c.stream_lock_expiry > clock_timestamp()
RETURNING c.stream_id, c.perspective_name, c.stream_lock_instance_id, c.stream_lock_epoch,
          c.stream_lock_expiry";

/// The fenced-commit check, run inside the caller's transaction: `$1` stream id, `$2`
/// perspective, `$3` holder, `$4` epoch. Returns a row only when the lease is live, held by
/// `$3` at `$4`, and then keeps the row locked (`FOR NO KEY UPDATE`) until the transaction ends,
/// so a takeover, renew, release or force-release waits for it.
pub(crate) const FENCE: &str = "\
SELECT stream_lock_epoch
  FROM wh_perspective_cursors
 WHERE stream_id = $1::uuid AND perspective_name = $2::text
   AND stream_lock_instance_id = $3::uuid AND stream_lock_epoch = $4::bigint
   AND stream_lock_expiry > clock_timestamp()
   FOR NO KEY UPDATE";

/// Admin listing: every set lease (held or expired but uncleared), with the time left and the
/// status computed on the database clock, when it was acquired (only when the start recorded is
/// this epoch's; NULL otherwise), ordered by stream then perspective (byte order, so it matches
/// Rust's `str` ordering whatever the database collation). `time_left_us` is NULL for an
/// infinite expiry (which the locker reports as a row it cannot read, not as an SQL error that
/// hides which row it is).
pub(crate) const LIST_LEASES: &str = "\
SELECT c.stream_id, c.perspective_name, c.stream_lock_instance_id, c.stream_lock_reason,
       c.stream_lock_epoch, c.stream_lock_expiry,
       CASE WHEN c.stream_lock_acquired_epoch = c.stream_lock_epoch
            THEN c.stream_lock_acquired_at END AS stream_lock_acquired_at,
       CASE WHEN isfinite(c.stream_lock_expiry) THEN
           GREATEST(0, floor(extract(epoch FROM c.stream_lock_expiry - n.now) * 1000000))::bigint
       END AS time_left_us,
       c.stream_lock_expiry > n.now AS live
  FROM wh_perspective_cursors c, (SELECT clock_timestamp() AS now) n
 WHERE c.stream_lock_instance_id IS NOT NULL
 ORDER BY c.stream_id, c.perspective_name COLLATE \"C\"";

/// Admin inspect: `$1` stream id, `$2` perspective. The lease columns of one cursor row.
pub(crate) const INSPECT: &str = "\
SELECT stream_lock_instance_id, stream_lock_reason, stream_lock_expiry, stream_lock_epoch
  FROM wh_perspective_cursors
 WHERE stream_id = $1::uuid AND perspective_name = $2::text";

/// Admin force-release: `$1` stream id, `$2` perspective. Clears a set lease whoever holds it
/// and increases the epoch, so the old holder's renew, release and fenced commits fail.
pub(crate) const FORCE_RELEASE: &str = "\
UPDATE wh_perspective_cursors
   SET stream_lock_instance_id = NULL, stream_lock_reason = NULL, stream_lock_expiry = NULL,
       stream_lock_acquired_at = NULL, stream_lock_acquired_epoch = NULL,
       stream_lock_epoch = stream_lock_epoch + 1
 WHERE stream_id = $1::uuid AND perspective_name = $2::text
   AND stream_lock_instance_id IS NOT NULL";

/// Admin release-all: `$1` instance. Clears every lease the instance holds (live or expired),
/// keeping the epochs, as a release would. Returns the number of rows cleared.
///
/// Like the batched renew, it locks its rows in key order first, so it cannot deadlock with a
/// concurrent batched renew of the same instance.
pub(crate) const RELEASE_ALL_HELD_BY: &str = "\
WITH locked AS MATERIALIZED (
    SELECT stream_id, perspective_name
      FROM wh_perspective_cursors
     WHERE stream_lock_instance_id = $1::uuid
     ORDER BY stream_id, perspective_name COLLATE \"C\"
       FOR NO KEY UPDATE
)
UPDATE wh_perspective_cursors c
   SET stream_lock_instance_id = NULL, stream_lock_reason = NULL, stream_lock_expiry = NULL,
       stream_lock_acquired_at = NULL, stream_lock_acquired_epoch = NULL
  FROM locked k
 WHERE c.stream_id = k.stream_id AND c.perspective_name = k.perspective_name
   AND c.stream_lock_instance_id = $1::uuid";

/// The keepalive of an announced instance (`docs/adr/0015-worker-fleet.md`): the batched renew
/// ([`RENEW_MANY`], same `$1`–`$5`, the arrays may be empty) and, in the same statement, the
/// instance `$6` (`uuid`) marked seen if its row carries the token `$7` (`uuid`) of the process
/// that sends the keepalive. One row per renewed lease (`seen` false), then one row with `seen`
/// true when the instance's row was found with that token (none when it is not announced, or
/// another process took the id over: that row is left as it is).
///
/// A data-modifying CTE always runs to its end, read or not, so the instance is marked seen
/// whether or not any lease is renewed. Only the instance itself updates its row (announce,
/// keepalive, depart) besides the prune of rows stale for a day, so the extra row lock cannot
/// make two keepalives wait for each other.
pub(crate) const KEEPALIVE: &str = "\
WITH seen AS (
    UPDATE wh_worker_instances
       SET last_seen_at = clock_timestamp()
     WHERE instance_id = $6::uuid AND token = $7::uuid
    RETURNING instance_id
), l AS (
    SELECT * FROM unnest($1::uuid[], $2::text[], $3::uuid[], $4::bigint[])
                  AS l(stream_id, perspective_name, holder, epoch)
), locked AS MATERIALIZED (
    SELECT c.stream_id, c.perspective_name
      FROM wh_perspective_cursors c
     WHERE (c.stream_id, c.perspective_name) IN (SELECT stream_id, perspective_name FROM l)
     ORDER BY c.stream_id, c.perspective_name COLLATE \"C\"
       FOR NO KEY UPDATE OF c
), renewed AS (
    UPDATE wh_perspective_cursors c
       SET stream_lock_expiry = clock_timestamp() + $5::interval
      FROM l, locked k
     WHERE c.stream_id = k.stream_id AND c.perspective_name = k.perspective_name
       AND l.stream_id = k.stream_id AND l.perspective_name = k.perspective_name
       AND c.stream_lock_instance_id = l.holder AND c.stream_lock_epoch = l.epoch
       AND c.stream_lock_expiry > clock_timestamp()
    RETURNING c.stream_id, c.perspective_name, c.stream_lock_instance_id, c.stream_lock_epoch,
              c.stream_lock_expiry
)
SELECT r.stream_id, r.perspective_name, r.stream_lock_instance_id, r.stream_lock_epoch,
       r.stream_lock_expiry, false AS seen
  FROM renewed r
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, true FROM seen";

/// Announce: `$1` instance (`uuid`), `$2` name, `$3` host, `$4` pid (`bigint`), `$5` version,
/// `$6` perspectives (`text[]`), `$7` stale after (`interval`, the lock timeout), `$8` forget
/// after (`interval`), `$9` the announcing process's token (`uuid`). Inserts the instance seen
/// now; or replaces what the same process (same token) announced before, keeping its
/// `started_at`; or takes over a stale row of another process as a new start. A live row of
/// another token is left as it is. On the way, deletes every other instance not seen for `$8`.
///
/// One row: `announced` true; or false with the live row's `name`, `host`, `pid`,
/// `since_seen_us` and `stale_after_us` (the process that holds the id). No row when the
/// conflicting row was committed after this statement's snapshot (it cannot be read here):
/// run it again.
pub(crate) const ANNOUNCE: &str = "\
WITH forgotten AS (
    DELETE FROM wh_worker_instances
     WHERE instance_id <> $1::uuid AND last_seen_at < clock_timestamp() - $8::interval
), announced AS (
    INSERT INTO wh_worker_instances AS w
           (instance_id, name, host, pid, version, perspectives, started_at, last_seen_at,
            stale_after, token)
    VALUES ($1::uuid, $2::text, $3::text, $4::bigint, $5::text, $6::text[], clock_timestamp(),
            clock_timestamp(), $7::interval, $9::uuid)
    ON CONFLICT (instance_id) DO UPDATE
       SET name = EXCLUDED.name, host = EXCLUDED.host, pid = EXCLUDED.pid,
           version = EXCLUDED.version, perspectives = EXCLUDED.perspectives,
           last_seen_at = EXCLUDED.last_seen_at, stale_after = EXCLUDED.stale_after,
           started_at = CASE WHEN w.token IS NOT DISTINCT FROM EXCLUDED.token
                             THEN w.started_at ELSE EXCLUDED.started_at END,
           token = EXCLUDED.token
     WHERE w.token IS NOT DISTINCT FROM EXCLUDED.token
        OR NOT (w.last_seen_at + w.stale_after > clock_timestamp())
    RETURNING w.instance_id
)
SELECT true AS announced, NULL::text AS name, NULL::text AS host, NULL::bigint AS pid,
       NULL::bigint AS since_seen_us, NULL::bigint AS stale_after_us
  FROM announced
UNION ALL
SELECT false, o.name, o.host, o.pid,
       CASE WHEN isfinite(o.last_seen_at) THEN
           GREATEST(0, floor(extract(epoch FROM clock_timestamp() - o.last_seen_at) * 1000000))::bigint
       END,
       floor(extract(epoch FROM o.stale_after) * 1000000)::bigint
  FROM wh_worker_instances o
 WHERE o.instance_id = $1::uuid AND NOT EXISTS (SELECT 1 FROM announced)";

/// Depart: `$1` instance, `$2` the departing process's token. Deletes its announcement if it
/// carries that token (another process's is left as it is); one row affected means it was
/// there.
pub(crate) const DEPART: &str =
    "DELETE FROM wh_worker_instances WHERE instance_id = $1::uuid AND token = $2::uuid";

/// The fleet for operators: every announced instance with how long ago it was seen and whether
/// it is live, on the database clock, ordered by name (byte order), then id. The durations are
/// NULL for a time written by hand as `'infinity'` (reported as a row lockstep cannot read).
pub(crate) const LIST_INSTANCES: &str = "\
SELECT w.instance_id, w.name, w.host, w.pid, w.version, w.perspectives, w.started_at,
       w.last_seen_at, w.token,
       floor(extract(epoch FROM w.stale_after) * 1000000)::bigint AS stale_after_us,
       CASE WHEN isfinite(w.last_seen_at) THEN
           GREATEST(0, floor(extract(epoch FROM n.now - w.last_seen_at) * 1000000))::bigint
       END AS since_seen_us,
       w.last_seen_at + w.stale_after > n.now AS live
  FROM wh_worker_instances w, (SELECT clock_timestamp() AS now) n
 ORDER BY w.name COLLATE \"C\", w.instance_id";

/// Forget one instance (`lockstep workers forget`): `$1` instance (`uuid`). Deletes its row
/// unless it is live; one row (`live`, `forgotten`) when the instance is announced, none when it
/// is not. A `last_seen_at` written by hand as `'infinity'` does not count as live (the row is
/// one lockstep cannot read, and forgetting it is how an operator removes it). The row is
/// locked first, so a keepalive that marks it seen meanwhile either comes first (and the
/// instance is live: kept) or after (and finds it gone: the instance announces itself again).
pub(crate) const FORGET_INSTANCE: &str = "\
WITH target AS (
    SELECT w.instance_id,
           COALESCE(isfinite(w.last_seen_at)
                    AND w.last_seen_at + w.stale_after > clock_timestamp(), false) AS live
      FROM wh_worker_instances w
     WHERE w.instance_id = $1::uuid
       FOR UPDATE
), forgotten AS (
    DELETE FROM wh_worker_instances w
     USING target t
     WHERE w.instance_id = t.instance_id AND NOT t.live
    RETURNING w.instance_id
)
SELECT t.live, EXISTS (SELECT 1 FROM forgotten) AS forgotten FROM target t";

/// Prune the fleet (`lockstep workers prune`): `$1` not seen for (`interval`). Deletes every
/// stale instance not seen for at least `$1` (on the database clock) and returns the id and
/// name of each. A live instance is never deleted, nor a row whose `last_seen_at` is
/// `'infinity'` (never stale).
pub(crate) const FORGET_STALE_INSTANCES: &str = "\
DELETE FROM wh_worker_instances w
 WHERE NOT (w.last_seen_at + w.stale_after > clock_timestamp())
   AND w.last_seen_at <= clock_timestamp() - $1::interval
RETURNING w.instance_id, w.name";
