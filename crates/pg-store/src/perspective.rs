//! The perspective store on PostgreSQL: [`PgPerspectiveStore`] implements
//! [`PerspectiveStore`](lockstep_core::PerspectiveStore) for every [`PerspectiveTransaction`]:
//! the owned [`lockstep_pg::PgTransaction`], a borrowed `tokio_postgres::Transaction` or
//! `deadpool_postgres::Transaction`, and with feature `sqlx` the owned
//! `lockstep_pg::sqlx::SqlxTransaction`. Each statement, its parameters, its row decoding and
//! its error mapping are written once over the driver seam (`lockstep_pg::driver`).
//!
//! The schema is in `migrations/` (the baseline's tables, one file per SQL function in
//! `migrations/functions/`), the protocol in `docs/adr/0006-perspective-store.md`:
//!
//! - tables `wh_perspectives` (registered names), `wh_perspective_events` (the work queue,
//!   `(stream_id, perspective_name, event_id)`), `wh_perspective_states`,
//!   `wh_perspective_snapshots`, and the columns `revision`, `applied_count`, `failures` on
//!   `wh_perspective_cursors` (the cursor row that also carries the stream lease);
//! - **fan-out with no extra round trip**: `lockstep_append_events`, the statement
//!   [`PgEventStore`](crate::PgEventStore) appends with, also inserts one work row per
//!   registered perspective and the pairs' cursor rows;
//! - **one statement per operation**: [`claim`](lockstep_core::PairWork::claim) is the SQL function
//!   `lockstep_perspective_claim` (lock the cursor row `FOR NO KEY UPDATE SKIP LOCKED` unless a
//!   live lease is on it, detect late arrivals and write the rewind request, return the cursor,
//!   the state and the pending events joined with `wh_events` in event-id order);
//!   [`commit`](lockstep_core::PairWork::commit) is `lockstep_perspective_commit_release_or_refuse`
//!   (fence, compare-and-set on the revision, state upsert, delete the applied work, advance the
//!   cursor, clear the rewind request conditionally, snapshot and prune, release the lease),
//!   sent in the same round trip as the transaction's `COMMIT`. A refused commit (conflict,
//!   lease lost) raises, which turns the `COMMIT` into a rollback: nothing of the transaction
//!   is committed.
//!
//! On tokio-postgres every statement is sent with `query_typed` (parse, bind and execute in
//! one round trip; the rewind's read with `query_typed_raw`, the same messages with its rows
//! streamed), with every value bound as a parameter. On sqlx each statement is prepared once
//! per connection (the first use costs a round trip more), a rewind's rows are read in full
//! before they are decoded, and a state change and its `COMMIT` are two round trips
//! ([`PerspectiveTransaction`] says what each driver does). Bad input (a state that `jsonb`
//! cannot store or that is nested deeper than a claim can read back, [`lockstep_core::json`]; a
//! count out of range; a fence naming another pair) is refused with [`ErrorKind::InvalidInput`]
//! before any SQL is sent.
//!
//! ```no_run
//! # async fn demo(db: lockstep_pg::PgDatabase) -> lockstep_core::Result<()> {
//! use lockstep_core::perspective_store::prelude::*;
//! use lockstep_core::{
//!     Claim, Pair, PerspectiveName, Release, RewindDebounce, StateCommit, StreamId,
//!     Transaction, TransactionSource,
//! };
//! use lockstep_pg_store::PgPerspectiveStore;
//!
//! db.migrate().await?;
//! let store = PgPerspectiveStore::new();
//! let name = PerspectiveName::new("OrderPerspective")?;
//! let tx = db.begin().await?;
//! store.register(&tx, std::slice::from_ref(&name)).await?;
//! tx.commit().await?;
//!
//! # let stream = StreamId::new_v7();
//! let tx = db.begin().await?;
//! let pair = Pair::new(stream, name.clone());
//! match store.claim(&tx, &pair, 100, RewindDebounce::NONE).await? {
//!     Claim::Apply { cursor, state, events, .. } => {
//!         let seen = cursor.applied_count + events.len() as u64;
//! #       let _ = state;
//!         let mut commit = StateCommit::new(pair, cursor.revision, serde_json::json!({ "seen": seen }));
//!         commit.last_event_id = events.last().map(|e| e.event_id);
//!         commit.applied_count = seen;
//!         commit.applied_events = events.iter().map(|e| e.event_id).collect();
//!         // The state change and the COMMIT, in one round trip.
//!         store.commit(tx, &commit, Release::Keep).await?;
//!     }
//!     _ => tx.commit().await?,
//! }
//! # Ok(()) }
//! ```

mod batch;
mod life;
mod transaction;
mod versions;

use std::time::Duration;

use futures_util::TryStreamExt as _;
use lockstep_core::perspective_store::DEFAULT_KEEP_SNAPSHOTS;
use lockstep_core::perspective_store::{
    CursorRows, PairWork, PerspectiveAdmin, PerspectiveLifecycle, PerspectiveReads, RewindReads,
    WorkQueue,
};
use lockstep_core::{
    BatchClaim, BatchCommitted, BatchEntry, Claim, ClaimedBatch, Committed, Cursor, CursorLease,
    Error, ErrorKind, EventPage, InstanceId, LeaseEpoch, LeaseId, LockReason, PageLimits, Pair,
    PairFailure, PendingPair, PendingThrough, PerspectiveName, PerspectiveStatus, ProgressReport,
    Rebuild, RecordedEvent, Registration, Release, Result, RetireStates, Retired, RewindDebounce,
    RewindLoad, RewindProgress, RewindRequest, SkippedEvent, Snapshot, StateCommit, StoredState,
    StreamId, Upcasters, ValidationError,
};
use lockstep_pg::driver::{Columns, DbError, Executor, Param, Row, query_one, query_opt};
use lockstep_pg::internal::db_statement_error as statement_error;
use time::OffsetDateTime;
use uuid::Uuid;

pub use transaction::PerspectiveTransaction;

/// The statements of [`PgPerspectiveStore`], one per operation. Private to this crate: they
/// change with the schema, so they are no API.
mod sql {
    /// The cursor columns every read returns, in the order `decode_cursor` reads them; the
    /// cursor row is `k`.
    macro_rules! cursor_columns {
        () => {
            "k.last_event_id, k.revision, k.applied_count, k.rewind_trigger_event_id, \
             k.rewind_flagged_at, k.rewind_first_flagged_at, k.error, k.failures, \
             (SELECT s.event_id FROM wh_perspective_snapshots s \
               WHERE s.stream_id = k.stream_id AND s.perspective_name = k.perspective_name \
               ORDER BY s.event_id DESC LIMIT 1), \
             k.stream_lock_instance_id, k.stream_lock_reason::text, k.stream_lock_expiry, \
             k.stream_lock_epoch, k.failed_event_id, k.retry_at, k.parked_at"
        };
    }

    /// Whether `$1` is registered: a row, or none.
    pub(super) const IS_REGISTERED: &str =
        "SELECT 1 FROM wh_perspectives WHERE perspective_name = $1";

    /// Registers names (`$1 text[]`); returns how many were new (they catch up). Appends
    /// queue behind its exclusive lock for at most `$2` µs at a time, and it gives up after
    /// `$3` µs with 55P03 naming the transaction it waits for (see
    /// `lockstep_lock_perspectives_for_change`).
    pub(super) const REGISTER: &str = "SELECT lockstep_register_perspectives($1, \
         $2 * interval '1 microsecond', $3 * interval '1 microsecond')";

    /// Pairs of the perspectives `$5 text[]` with work, or with a rewind request whose debounce
    /// window (`$2` µs) has passed or that was first flagged at least `$4` µs ago (the cap), not
    /// under a live lease of another instance than `$1`; oldest work first, at most `$3`. A pair with a request inside its
    /// window is held back, work and all.
    pub(super) const PENDING_PAIRS: &str = "\
WITH n AS (SELECT clock_timestamp() AS now),
work AS (
    SELECT w.stream_id, w.perspective_name, count(*) AS pending, min(w.enqueued_at) AS oldest
      FROM wh_perspective_events w
     WHERE w.perspective_name = ANY($5)
     GROUP BY w.stream_id, w.perspective_name
), pairs AS (
    SELECT work.stream_id, work.perspective_name FROM work
    UNION
    SELECT k.stream_id, k.perspective_name FROM wh_perspective_cursors k
     WHERE k.rewind_trigger_event_id IS NOT NULL
       AND k.perspective_name = ANY($5)
)
SELECT p.stream_id, p.perspective_name, coalesce(w.pending, 0),
       k.rewind_trigger_event_id IS NOT NULL
  FROM pairs p
 CROSS JOIN n
  LEFT JOIN work w ON w.stream_id = p.stream_id AND w.perspective_name = p.perspective_name
  LEFT JOIN wh_perspective_cursors k
         ON k.stream_id = p.stream_id AND k.perspective_name = p.perspective_name
 WHERE (k.rewind_trigger_event_id IS NULL
        OR k.rewind_flagged_at + $2 * interval '1 microsecond' <= n.now
        OR coalesce(k.rewind_first_flagged_at, k.rewind_flagged_at)
           + $4 * interval '1 microsecond' <= n.now)
   AND NOT (k.stream_lock_instance_id IS NOT NULL AND k.stream_lock_instance_id <> $1
            AND k.stream_lock_expiry > n.now)
 ORDER BY coalesce(w.oldest, k.rewind_flagged_at), p.stream_id, p.perspective_name COLLATE \"C\"
 LIMIT $3";

    /// Claims a pair (`$1` stream, `$2` perspective, `$3` max events, `$4` debounce window µs,
    /// `$5` debounce cap µs) through `lockstep_perspective_claim`: a header row (outcome, the
    /// cursor columns, state), then for `apply` the events (the event columns), every row
    /// ending with the database's clock. The function returns the cursor columns but the
    /// failed event, backoff and parking, which it does not change: those are read from the
    /// cursor row and selected right after the function's, so the row holds the cursor columns
    /// as one block in the order of `cursor_columns!`.
    pub(super) const CLAIM: &str = "\
SELECT c.outcome, c.last_event_id, c.revision, c.applied_count, c.rewind_trigger_event_id,
       c.rewind_flagged_at, c.rewind_first_flagged_at, c.error, c.failures, c.latest_snapshot,
       c.stream_lock_instance_id, c.stream_lock_reason, c.stream_lock_expiry, c.stream_lock_epoch,
       k.failed_event_id, k.retry_at, k.parked_at,
       c.state, c.event_id, c.version, c.event_type, c.payload, c.recorded_at, c.schema_version,
       clock_timestamp()
  FROM lockstep_perspective_claim($1, $2, $3, $4, $5) c
  LEFT JOIN wh_perspective_cursors k ON k.stream_id = $1 AND k.perspective_name = $2";

    /// Claims a batch's pairs (see `lockstep_perspective_claim_pairs`, in
    /// `migrations/functions/lockstep_perspective_claim_pairs.sql`): `$1` perspective names,
    /// `$2` their positions, `$3` pairs, `$4` events per pair, `$5` events, `$6` scan, `$7`
    /// debounce window µs, `$8` debounce cap µs. Rows: `rewind` and `apply` pairs in claim
    /// order (an `apply` row with its state, its work rows' ids, the state's size and the
    /// walk's position before it), then one `position` per perspective.
    pub(super) const CLAIM_PAIRS: &str =
        "SELECT * FROM lockstep_perspective_claim_pairs($1, $2, $3, $4, $5, $6, $7, $8)";

    /// The events of a batch's claimed pairs (`$1` streams, `$2` and `$3` the first and last
    /// work id of each, `$4` the sizes of the pairs' states summed up to each pair, `$5` the
    /// byte bound): each pair's events as one range of `wh_events (stream_id, event_id)`, in
    /// pair then event-id order, `o` the pair's ordinal (from 1), each row with the database's
    /// clock (what the events' ages are measured against). An event is returned while the
    /// states and events before it and itself fit the byte bound, the batch's first always. An
    /// event counts its payload's decoded size (`payload_bytes`, stored by the append; for an
    /// event written by other means, its `jsonb` decompressed — not `pg_column_size`, which is
    /// the compressed size of a large value). The range may hold events that are not the pair's
    /// work (skipped, or enqueued since the claim): the caller keeps only the work ids; their
    /// sizes count.
    pub(super) const CLAIM_EVENTS: &str = "\
SELECT x.o, x.event_id, x.version, x.event_type, x.payload, x.recorded_at, x.schema_version,
       clock_timestamp()
  FROM (SELECT p.o, e.event_id, e.version, e.event_type, e.payload, e.recorded_at,
               e.schema_version, e.size,
               sum(e.size) OVER (ORDER BY p.o, e.event_id ROWS UNBOUNDED PRECEDING) AS cum,
               p.stb
          FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::int8[])
               WITH ORDINALITY AS p(sid, lo, hi, stb, o)
         CROSS JOIN LATERAL (
               SELECT e.event_id, e.version, e.event_type, e.payload, e.recorded_at,
                      e.schema_version, coalesce(e.payload_bytes, pg_column_size(e.payload #> '{}')) AS size
                 FROM wh_events e
                WHERE e.stream_id = p.sid AND e.event_id >= p.lo AND e.event_id <= p.hi
                ORDER BY e.event_id) e) x
 WHERE x.cum = x.size OR x.stb + x.cum <= $5
 ORDER BY x.o, x.event_id";

    /// Commits a batch (see `lockstep_perspective_commit_batch`).
    pub(super) const COMMIT_BATCH: &str = "SELECT ord, outcome, revision, parked \
         FROM lockstep_perspective_commit_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, \
                                                $12, $13, $14, $15, $16, $17, $18)";

    /// The parked pairs of the perspectives `$1` (all when empty), longest parked first, at
    /// most `$2`.
    pub(super) const PARKED_PAIRS: &str = concat!(
        "SELECT k.stream_id, k.perspective_name, ",
        cursor_columns!(),
        " FROM wh_perspective_cursors k WHERE k.parked_at IS NOT NULL \
           AND (cardinality($1::text[]) = 0 OR k.perspective_name = ANY ($1)) \
         ORDER BY k.parked_at, k.stream_id, k.perspective_name COLLATE \"C\" LIMIT $2"
    );

    /// Every registered perspective's pairs, work, oldest work's age (µs), rewinds, failing,
    /// backing-off and parked pairs.
    pub(super) const PERSPECTIVE_STATUS: &str = "\
SELECT p.perspective_name,
       (SELECT count(*) FROM wh_perspective_cursors k WHERE k.perspective_name = p.perspective_name),
       (SELECT count(*) FROM wh_perspective_events w WHERE w.perspective_name = p.perspective_name),
       (SELECT (extract(epoch FROM clock_timestamp() - min(w.enqueued_at)) * 1000000)::bigint
          FROM wh_perspective_events w WHERE w.perspective_name = p.perspective_name),
       (SELECT count(*) FROM wh_perspective_cursors k WHERE k.perspective_name = p.perspective_name
           AND k.rewind_trigger_event_id IS NOT NULL),
       (SELECT count(*) FROM wh_perspective_cursors k WHERE k.perspective_name = p.perspective_name
           AND k.error IS NOT NULL AND k.failures > 0),
       (SELECT count(*) FROM wh_perspective_cursors k WHERE k.perspective_name = p.perspective_name
           AND k.parked_at IS NULL AND k.retry_at > clock_timestamp()),
       (SELECT count(*) FROM wh_perspective_cursors k WHERE k.perspective_name = p.perspective_name
           AND k.parked_at IS NOT NULL)
  FROM wh_perspectives p
 ORDER BY p.perspective_name COLLATE \"C\"";

    /// The failing pairs of the perspectives `$1` (all when empty), by perspective and stream,
    /// at most `$2`: an error and a failure count above 0 (a retried pair keeps its text).
    pub(super) const FAILING_PAIRS: &str = concat!(
        "SELECT k.stream_id, k.perspective_name, ",
        cursor_columns!(),
        " FROM wh_perspective_cursors k WHERE k.error IS NOT NULL AND k.failures > 0 \
           AND (cardinality($1::text[]) = 0 OR k.perspective_name = ANY ($1)) \
         ORDER BY k.perspective_name COLLATE \"C\", k.stream_id LIMIT $2"
    );

    /// Retries a pair: parking, backoff and failure count cleared. No row: no cursor.
    pub(super) const UNPARK: &str = "UPDATE wh_perspective_cursors k \
         SET parked_at = NULL, retry_at = NULL, failures = 0 \
         WHERE k.stream_id = $1 AND k.perspective_name = $2 RETURNING 1";

    /// Skips the pending event `$3` of a pair for good, with the reason `$4`: records it,
    /// deletes its work item and retries the pair. The count is 0 when it was not pending.
    /// The pair's cursor row is locked first (the `InitPlan` of `k` runs before the delete):
    /// a batch that has the pair claimed is waited for, so no work row of a claimed pair
    /// disappears before its batch commits (`lockstep_perspective_commit_batch` deletes a
    /// pair's applied work as the range from its first to its last id, and counts on it).
    pub(super) const SKIP_EVENT: &str = "\
WITH k AS (
    SELECT 1 FROM wh_perspective_cursors c
     WHERE c.stream_id = $1 AND c.perspective_name = $2
       FOR NO KEY UPDATE
), w AS (
    DELETE FROM wh_perspective_events x
     WHERE x.perspective_name = $2 AND x.stream_id = $1 AND x.event_id = $3
       AND (SELECT count(*) FROM k) >= 0
    RETURNING x.event_id
), recorded AS (
    INSERT INTO wh_perspective_skipped_events (stream_id, perspective_name, event_id, reason)
    SELECT $1, $2, w.event_id, $4 FROM w
    ON CONFLICT (stream_id, perspective_name, event_id)
    DO UPDATE SET reason = EXCLUDED.reason, skipped_at = clock_timestamp()
), retried AS (
    UPDATE wh_perspective_cursors k SET parked_at = NULL, retry_at = NULL, failures = 0
      FROM w WHERE k.stream_id = $1 AND k.perspective_name = $2
)
SELECT count(*) FROM w";

    /// The events skipped for a pair, in event-id order.
    pub(super) const SKIPPED_EVENTS: &str = "SELECT x.event_id, x.reason, x.skipped_at \
         FROM wh_perspective_skipped_events x \
         WHERE x.stream_id = $1 AND x.perspective_name = $2 ORDER BY x.event_id";

    /// Commits a state change (see `lockstep_perspective_commit`).
    pub(super) const COMMIT: &str = "SELECT outcome, revision \
         FROM lockstep_perspective_commit($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)";

    /// A state change that also releases the fence's lease, if any, and refuses by raising
    /// (SQLSTATE `LSREF`; see `lockstep_perspective_commit_release_or_refuse`): the statement
    /// sent with the transaction's `COMMIT`, which a refusal turns into a rollback. As
    /// [`COMMIT`], and `released`.
    pub(super) const COMMIT_RELEASE_OR_REFUSE: &str = "SELECT outcome, revision, released \
         FROM lockstep_perspective_commit_release_or_refuse($1, $2, $3, $4, $5, $6, $7, $8, $9, \
         $10, $11, $12)";

    /// What a rewind reads first, in one statement (`$1` stream, `$2` perspective, `$3` at most
    /// this many events), through `lockstep_load_rewind`: a header row (part 0: the cursor
    /// columns, then the latest snapshot strictly before the request's trigger) and, when the
    /// cursor has a request, the first events of the stream after that snapshot but the pair's
    /// skipped ones (part 1), in event-id order. No row: no cursor. The function keeps
    /// its plans for the session and walks the stream's own range of `wh_events_stream_event`
    /// whatever the statistics say (ADR 0033); as a plain statement this was planned on every
    /// call, and with few streams in the table it read every later event of every stream.
    ///
    /// An event row ends with its payload's decoded size (`payload_bytes`: what the worker
    /// holds once it decoded the event, not its compressed size), and `$3` is one
    /// event more than the page holds: the store takes rows while they fit the page's events
    /// and bytes and stops reading at the first that does not (which says that more follow).
    /// The byte bound is the store's, not the statement's: a running total in SQL (a window)
    /// cost a 100-event read 0.3–0.5 ms more (ADR 0031).
    pub(super) const LOAD_REWIND: &str = "SELECT * FROM lockstep_load_rewind($1, $2, $3)";

    /// A page of the events a rewind replays (`$1` stream, `$2` perspective, `$3` at most this
    /// many events, `$4` after this event, from the first when NULL): the events but the pair's
    /// skipped ones, in event-id order, each with its payload's decoded size as in
    /// [`LOAD_REWIND`]. Through `lockstep_rewind_page`, which pins the plan to the stream's own
    /// range of `wh_events_stream_event`, read in order.
    pub(super) const REWIND_EVENTS: &str = "SELECT * FROM lockstep_rewind_page($1, $2, $4, $3)";

    /// One pair's cursor.
    pub(super) const CURSOR: &str = concat!(
        "SELECT ",
        cursor_columns!(),
        " FROM wh_perspective_cursors k WHERE k.stream_id = $1 AND k.perspective_name = $2"
    );

    /// One pair's cursor and state.
    pub(super) const STATE: &str = concat!(
        "SELECT ",
        cursor_columns!(),
        ", st.state FROM wh_perspective_cursors k \
         LEFT JOIN wh_perspective_states st \
                ON st.stream_id = k.stream_id AND st.perspective_name = k.perspective_name \
         WHERE k.stream_id = $1 AND k.perspective_name = $2"
    );

    /// A page of one perspective's states in stream order (`$1` perspective, `$2` limit):
    /// pairs with a state only; the stream id is the last column.
    pub(super) const STATES_FIRST: &str = concat!(
        "SELECT ",
        cursor_columns!(),
        ", st.state, k.stream_id FROM wh_perspective_cursors k \
         JOIN wh_perspective_states st \
           ON st.stream_id = k.stream_id AND st.perspective_name = k.perspective_name \
         WHERE k.perspective_name = $1 ORDER BY k.stream_id LIMIT $2"
    );

    /// The next page, after stream `$3`. (Two statements rather than `$3 IS NULL OR …`, so
    /// that each is planned as an index range.)
    pub(super) const STATES_AFTER: &str = concat!(
        "SELECT ",
        cursor_columns!(),
        ", st.state, k.stream_id FROM wh_perspective_cursors k \
         JOIN wh_perspective_states st \
           ON st.stream_id = k.stream_id AND st.perspective_name = k.perspective_name \
         WHERE k.perspective_name = $1 AND k.stream_id > $3 ORDER BY k.stream_id LIMIT $2"
    );

    /// What a perspective (`$1`; one stream of it when `$2` is not NULL) has not applied of
    /// the events up to `$3`: work rows, rewinds requested from such an event, and of the
    /// pairs holding either how many are parked and one failing pair's error; then whether
    /// the perspective is registered, retired (its states kept) or neither, and how many live
    /// worker instances announce it (live as the fleet listing counts them).
    pub(super) const PENDING_THROUGH: &str = "\
        WITH w AS (SELECT w.stream_id FROM wh_perspective_events w \
                    WHERE w.perspective_name = $1 AND ($2::uuid IS NULL OR w.stream_id = $2) \
                      AND w.event_id <= $3), \
             r AS (SELECT k.stream_id FROM wh_perspective_cursors k \
                    WHERE k.perspective_name = $1 AND ($2::uuid IS NULL OR k.stream_id = $2) \
                      AND k.rewind_trigger_event_id <= $3), \
             held AS (SELECT k.parked_at, k.error FROM wh_perspective_cursors k \
                       WHERE k.perspective_name = $1 \
                         AND k.stream_id IN (SELECT stream_id FROM w UNION SELECT stream_id FROM r)) \
        SELECT (SELECT count(*) FROM w), (SELECT count(*) FROM r), \
               (SELECT count(*) FROM held WHERE parked_at IS NOT NULL), \
               (SELECT error FROM held WHERE error IS NOT NULL LIMIT 1), \
               CASE WHEN EXISTS (SELECT FROM wh_perspectives p WHERE p.perspective_name = $1) \
                    THEN 'registered' \
                    WHEN EXISTS (SELECT FROM wh_retired_perspectives r \
                                  WHERE r.perspective_name = $1) \
                    THEN 'retired' \
                    ELSE 'not registered' END, \
               (SELECT count(*) FROM wh_worker_instances i \
                 WHERE $1 = ANY (i.perspectives) \
                   AND i.last_seen_at + i.stale_after > clock_timestamp())";

    /// The event ids of a pair's work, in event-id order.
    pub(super) const PENDING_EVENTS: &str = "SELECT w.event_id FROM wh_perspective_events w \
         WHERE w.stream_id = $1 AND w.perspective_name = $2 ORDER BY w.event_id";

    /// A stream's events after `$2` (all when NULL), in event-id order.
    pub(super) const STREAM_EVENTS: &str = "SELECT e.event_id, e.version, e.event_type, e.payload, \
         e.recorded_at, e.schema_version FROM wh_events e WHERE e.stream_id = $1 AND ($2::uuid IS NULL OR e.event_id > $2) \
         ORDER BY e.event_id";

    /// The latest snapshot strictly before `$3`.
    pub(super) const SNAPSHOT_BEFORE: &str = "SELECT s.event_id, s.state, s.applied_count \
         FROM wh_perspective_snapshots s \
         WHERE s.stream_id = $1 AND s.perspective_name = $2 AND s.event_id < $3 \
         ORDER BY s.event_id DESC LIMIT 1";

    /// Bootstrap snapshot (see `lockstep_perspective_save_snapshot`).
    pub(super) const SAVE_SNAPSHOT: &str =
        "SELECT lockstep_perspective_save_snapshot($1, $2, $3, $4, $5, $6)";

    /// Sets the rewind request to `$3`, or moves it earlier; the window restarts when it
    /// moves. An operator's rewind is also a retry: parking, backoff and failure count are
    /// cleared. No row: no cursor.
    pub(super) const REQUEST_REWIND: &str = "\
WITH n AS (SELECT clock_timestamp() AS now)
UPDATE wh_perspective_cursors k
   SET rewind_trigger_event_id = CASE WHEN k.rewind_trigger_event_id IS NULL OR $3 < k.rewind_trigger_event_id
                                      THEN $3 ELSE k.rewind_trigger_event_id END,
       rewind_flagged_at = CASE WHEN k.rewind_trigger_event_id IS NULL OR $3 < k.rewind_trigger_event_id
                                THEN n.now ELSE k.rewind_flagged_at END,
       rewind_first_flagged_at = CASE WHEN k.rewind_trigger_event_id IS NULL
                                      THEN n.now ELSE k.rewind_first_flagged_at END,
       status = k.status | 1,
       parked_at = NULL, retry_at = NULL, failures = 0
  FROM n
 WHERE k.stream_id = $1 AND k.perspective_name = $2
RETURNING k.revision";

    /// Records a failure (see `lockstep_perspective_record_failure`): `$3` error, `$4` event,
    /// `$5` backoff µs, `$6` park. Returns whether the pair is parked.
    pub(super) const RECORD_FAILURE: &str =
        "SELECT lockstep_perspective_record_failure($1, $2, $3, $4, $5, $6)";

    /// Purges a pair (see `lockstep_perspective_purge`).
    pub(super) const PURGE: &str = "SELECT lockstep_perspective_purge($1, $2, $3, $4)";

    /// Creates a cursor row; a row back means it was created.
    pub(super) const ENSURE_CURSOR: &str = "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) \
         VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING 1";

    /// Deletes a cursor row with its state, snapshots and work; a row back means it existed.
    pub(super) const DELETE_CURSOR: &str = "\
WITH w AS (DELETE FROM wh_perspective_events x WHERE x.stream_id = $1 AND x.perspective_name = $2),
     sk AS (DELETE FROM wh_perspective_skipped_events x
             WHERE x.stream_id = $1 AND x.perspective_name = $2),
     st AS (DELETE FROM wh_perspective_states x WHERE x.stream_id = $1 AND x.perspective_name = $2),
     sn AS (DELETE FROM wh_perspective_snapshots x WHERE x.stream_id = $1 AND x.perspective_name = $2)
DELETE FROM wh_perspective_cursors k WHERE k.stream_id = $1 AND k.perspective_name = $2
RETURNING 1";
}

/// How many cursor columns every read returns, in the order `decode_cursor` reads them (those
/// of `cursor_columns!`).
const CURSOR_COLUMNS: usize = 16;
/// Where the cursor columns start in a claim's header row (after `outcome`).
const CLAIM_CURSOR_AT: usize = 1;
/// Where the state is in a claim's header row.
const CLAIM_STATE_AT: usize = CLAIM_CURSOR_AT + CURSOR_COLUMNS;
/// Where the event columns start in a claim's event rows.
const CLAIM_EVENT_AT: usize = CLAIM_STATE_AT + 1;
/// Where the database's clock at the claim is in a claim's rows (after the event columns).
const CLAIM_CLOCK_AT: usize = CLAIM_EVENT_AT + 6;
/// A batch claim's pair rows: kind, stream, perspective, the cursor columns, the state, the
/// work ids, the state's size, the walk's position before the pair.
const BATCH_CURSOR_AT: usize = 3;
const BATCH_STATE_AT: usize = BATCH_CURSOR_AT + CURSOR_COLUMNS;
const BATCH_WORK_AT: usize = BATCH_STATE_AT + 1;

/// A rewind load's rows: part, the cursor columns, the snapshot (event, state, count), the
/// event columns.
const LOAD_CURSOR_AT: usize = 1;
const LOAD_SNAPSHOT_AT: usize = LOAD_CURSOR_AT + CURSOR_COLUMNS;
const LOAD_EVENT_AT: usize = LOAD_SNAPSHOT_AT + 3;

/// The PostgreSQL perspective store. Cheap to clone; holds no connection (every call runs on
/// the transaction it is given). Apply the schema first with [`lockstep_pg::migrate()`]: its
/// first registration (a worker's start) checks that this build runs on the database's schema
/// ([`lockstep_pg::migrate::check_schema_on`]) and refuses it otherwise, saying what to do.
#[derive(Debug, Clone)]
pub struct PgPerspectiveStore {
    keep_snapshots: i32,
    /// What every event read goes through.
    upcasters: Upcasters,
    /// Set once a registration found a schema this build runs on (shared by clones).
    schema_checked: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// How long appends may queue behind a registration's or retirement's exclusive lock at a
    /// time, µs.
    change_queue_us: i64,
    /// How long a registration or retirement tries before it gives up, µs.
    change_give_up_us: i64,
}

/// The most [`PgPerspectiveStore::with_registration_wait`] accepts for either bound.
const MAX_REGISTRATION_WAIT: Duration = Duration::from_secs(3600);

impl Default for PgPerspectiveStore {
    fn default() -> Self {
        PgPerspectiveStore::new()
    }
}

impl PgPerspectiveStore {
    /// Whether `name` is a registered perspective: for an operator's tool that refuses a
    /// command on a name nothing serves (`lockstep perspectives purge|rewind|retry|skip`)
    /// rather than report a pair without a cursor. One primary-key lookup.
    pub async fn is_registered<T: Executor + ?Sized>(
        &self,
        tx: &T,
        name: &PerspectiveName,
    ) -> Result<bool> {
        let row = query_opt(tx, sql::IS_REGISTERED, &[&name.as_str()])
            .await
            .map_err(|e| statement_error(e, "reading the registered perspectives"))?;
        Ok(row.is_some())
    }

    /// A store keeping the last [`DEFAULT_KEEP_SNAPSHOTS`] snapshots per pair, whose
    /// registrations and retirements let appends queue behind them for at most
    /// [`Self::DEFAULT_QUEUE_AT_MOST`] at a time and give up after
    /// [`Self::DEFAULT_GIVE_UP_AFTER`] ([`Self::with_registration_wait`]).
    pub fn new() -> PgPerspectiveStore {
        PgPerspectiveStore {
            // A small constant: it fits.
            keep_snapshots: DEFAULT_KEEP_SNAPSHOTS as i32,
            upcasters: Upcasters::new(),
            schema_checked: Default::default(),
            change_queue_us: 50_000,
            change_give_up_us: 5_000_000,
        }
    }

    /// How long appends may queue behind a registration's or retirement's lock at a time, by
    /// default: 50 ms.
    pub const DEFAULT_QUEUE_AT_MOST: Duration = Duration::from_millis(50);

    /// How long a registration or retirement waits for the transactions that hold the
    /// registered perspectives' table, by default: 5 s.
    pub const DEFAULT_GIVE_UP_AFTER: Duration = Duration::from_secs(5);

    /// This store, with the bounds of the wait of [`register`](lockstep_core::PerspectiveLifecycle::register)
    /// (when a name is new) and [`retire`](lockstep_core::PerspectiveLifecycle::retire) for their exclusive lock
    /// on the registered perspectives, which every append holds a shared lock on until its
    /// transaction ends, and which every append queues behind while it is requested:
    ///
    /// - `queue_at_most`: how long a request waits at a time, so how long appends may queue
    ///   behind it (0: it is granted at once or not at all). A request that timed out is not
    ///   made again while a transaction it waited for still holds the table: an append left
    ///   open holds the registration back, not the appends;
    /// - `give_up_after`: how long the call keeps trying (polling every 20 ms) before it fails
    ///   with [`ErrorKind::LockTimeout`] (retryable), whose message names the transaction it
    ///   waited for: its pid, since when it has been open and its application.
    ///
    /// Either above an hour is [`ErrorKind::InvalidInput`].
    pub fn with_registration_wait(
        mut self,
        queue_at_most: Duration,
        give_up_after: Duration,
    ) -> Result<PgPerspectiveStore> {
        if queue_at_most > MAX_REGISTRATION_WAIT || give_up_after > MAX_REGISTRATION_WAIT {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "a registration's wait must be at most an hour, not {queue_at_most:?} at a \
                     time and {give_up_after:?} in all"
                ),
            ));
        }
        // At most an hour: the microseconds fit.
        self.change_queue_us = queue_at_most.as_micros() as i64;
        self.change_give_up_us = give_up_after.as_micros() as i64;
        Ok(self)
    }

    /// A store keeping the last `keep` snapshots per pair (at least 1). Fails with
    /// [`ErrorKind::InvalidInput`] for 0 or more than `i32::MAX`.
    pub fn with_keep_snapshots(keep: usize) -> Result<PgPerspectiveStore> {
        match i32::try_from(keep) {
            Ok(keep) if keep >= 1 => Ok(PgPerspectiveStore {
                keep_snapshots: keep,
                ..PgPerspectiveStore::new()
            }),
            _ => Err(Error::new(
                ErrorKind::InvalidInput,
                "keep_snapshots must be between 1 and 2147483647",
            )),
        }
    }

    /// This store, reading every event through `upcasters` ([`lockstep_core::upcast`]): claims,
    /// batches, rewind loads and pages, and stream reads hand out each event in the current
    /// shape of its type. An event an upcaster fails on is unreadable where the store has that
    /// answer ([`ClaimedWork::Unreadable`](lockstep_core::ClaimedWork::Unreadable),
    /// [`Claim::Unreadable`], [`RewindLoad::unreadable`], [`EventPage::unreadable`]): the
    /// worker parks the pair at it; a stream read fails with [`ErrorKind::InvalidInput`].
    /// None by default: events are read as stored.
    pub fn with_upcasters(mut self, upcasters: Upcasters) -> PgPerspectiveStore {
        self.upcasters = upcasters;
        self
    }

    /// The upcasters every event read goes through.
    pub fn upcasters(&self) -> &Upcasters {
        &self.upcasters
    }

    /// How many snapshots per pair are kept.
    pub fn keep_snapshots(&self) -> usize {
        // Positive by construction.
        self.keep_snapshots.unsigned_abs() as usize
    }

    /// The cursors a listing statement (`$1` perspectives, `$2` limit; stream, perspective, then
    /// the cursor columns) returns.
    async fn listed_cursors<T: Executor + ?Sized>(
        &self,
        tx: &T,
        statement: &str,
        perspectives: &[PerspectiveName],
        limit: usize,
        what: &str,
    ) -> Result<Vec<Cursor>> {
        let names: Vec<&str> = perspectives.iter().map(PerspectiveName::as_str).collect();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = tx
            .query(statement, &[&names, &limit])
            .await
            .map_err(|e| statement_error(e, what))?;
        rows.iter()
            .map(|row| {
                let stream_id = StreamId::from_uuid(row.column(0).map_err(decode_error)?);
                let name = stored_name(row.column(1).map_err(decode_error)?)?;
                decode_cursor(row, 2, stream_id, &name)
            })
            .collect()
    }
}

impl<T: PerspectiveTransaction> WorkQueue<T> for PgPerspectiveStore {
    async fn record_failure(&self, tx: &T, pair: &Pair, failure: &PairFailure) -> Result<bool> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        // Text cannot hold U+0000; the message is diagnostics, so it is kept readable rather
        // than refused (a failure must always be recordable).
        let error = failure.error.replace('\0', "\u{FFFD}");
        let retry_after = backoff_micros(failure.retry_after);
        let row = query_one(
            tx,
            sql::RECORD_FAILURE,
            &[
                &stream_id.as_uuid(),
                &perspective.as_str(),
                &error,
                &failure.event_id,
                &retry_after,
                &failure.park,
            ],
        )
        .await
        .map_err(|e| statement_error(e, "recording a perspective failure"))?;
        row.column(0).map_err(decode_error)
    }

    async fn claim_batch(&self, tx: &T, request: &BatchClaim) -> Result<ClaimedBatch> {
        batch::claim(tx, request, &self.upcasters).await
    }

    async fn commit_batch(&self, tx: &T, entries: &[BatchEntry]) -> Result<Vec<BatchCommitted>> {
        batch::commit(tx, entries, self.keep_snapshots).await
    }
}

impl<T: PerspectiveTransaction> PairWork<T> for PgPerspectiveStore {
    async fn claim(
        &self,
        tx: &T,
        pair: &Pair,
        max_events: usize,
        debounce: RewindDebounce,
    ) -> Result<Claim> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        if max_events == 0 {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "a claim must ask for at least one event",
            ));
        }
        let max_events = i64::try_from(max_events).unwrap_or(i64::MAX);
        let (window, max_delay) = (micros(debounce.window)?, micros(debounce.max_delay)?);
        let rows = tx
            .query(
                sql::CLAIM,
                &[
                    &stream_id.as_uuid(),
                    &perspective.as_str(),
                    &max_events,
                    &window,
                    &max_delay,
                ],
            )
            .await
            .map_err(|e| statement_error(e, "claiming a perspective pair"))?;
        let Some((header, event_rows)) = rows.split_first() else {
            return Err(Error::new(ErrorKind::Backend, "a claim returned no row"));
        };
        let outcome: Option<String> = header.column(0).map_err(decode_error)?;
        match outcome.as_deref() {
            Some("busy") => Ok(Claim::Busy),
            Some("idle") => Ok(Claim::Idle),
            Some("rewind") => Ok(Claim::Rewind {
                cursor: decode_cursor(header, CLAIM_CURSOR_AT, stream_id, perspective)?,
            }),
            Some("apply") if event_rows.is_empty() => Ok(Claim::Idle),
            Some("apply") => {
                let cursor = decode_cursor(header, CLAIM_CURSOR_AT, stream_id, perspective)?;
                let state = header.column(CLAIM_STATE_AT).map_err(decode_error)?;
                let mut events = Vec::with_capacity(event_rows.len());
                for row in event_rows {
                    match crate::decode(row, CLAIM_EVENT_AT, stream_id, &self.upcasters) {
                        Ok(event) => events.push(event),
                        // The pair fails at this event, after the ones before it.
                        Err(err) => {
                            // The id is read on its own: only the payload (or another column)
                            // is bad.
                            let event_id: Uuid =
                                row.column(CLAIM_EVENT_AT).map_err(decode_error)?;
                            return Ok(Claim::Unreadable {
                                cursor,
                                state,
                                events,
                                event_id,
                                error: lockstep_core::perspective_store::unreadable_event_message(
                                    event_id, &err,
                                ),
                            });
                        }
                    }
                }
                Ok(Claim::Apply {
                    cursor,
                    state,
                    events,
                    claimed_at: Some(header.column(CLAIM_CLOCK_AT).map_err(decode_error)?),
                })
            }
            other => Err(Error::new(
                ErrorKind::Backend,
                format!("a claim returned an unknown outcome {other:?}"),
            )),
        }
    }

    // Not an `async fn`: with the `where` clause, that form's future fails the higher-ranked
    // `Send` check of a worker spawned with the concrete types (examples/service).
    #[allow(clippy::manual_async_fn)]
    fn commit<'a>(
        &'a self,
        tx: T,
        commit: &'a StateCommit,
        release: Release,
    ) -> impl Future<Output = Result<Committed>> + Send + 'a
    where
        T: lockstep_core::Transaction,
    {
        async move {
            if release == Release::Keep && commit.fence.is_some() {
                // A fenced change that keeps its lease: the statement whose refusal is a row,
                // read before the COMMIT (two round trips; the worker's fenced commits all
                // release).
                let row = match self.send_commit(&tx, commit).await {
                    Ok(row) => row,
                    Err(err) => {
                        // Dropping the transaction rolls it back.
                        drop(tx);
                        return Err(err);
                    }
                };
                let revision = match commit_outcome(&row, commit) {
                    Ok(revision) => revision,
                    Err(refused) => {
                        drop(tx);
                        return Err(refused);
                    }
                };
                tx.commit().await?;
                return Ok(Committed::new(revision, false));
            }
            // The change and the COMMIT in one round trip: a refusal is an error at the server,
            // which makes the COMMIT a rollback. Without a fence nothing is released. (On sqlx:
            // the change, then the COMMIT — a round trip more.)
            let params = CommitParams::new(commit, self.keep_snapshots)?;
            let params = params.as_params();
            let rows = tx
                .commit_last(sql::COMMIT_RELEASE_OR_REFUSE, &params, |e| {
                    refused_or_statement_error(e, commit)
                })
                .await?;
            let row = rows.first().ok_or_else(|| {
                Error::new(
                    ErrorKind::CommitUnknown,
                    "a state commit committed without its row: its revision is not known",
                )
            })?;
            let revision = commit_outcome(row, commit)?;
            let released: Option<bool> = row.column(2).map_err(decode_error)?;
            Ok(Committed::new(revision, released.unwrap_or(false)))
        }
    }

    async fn save_snapshot(
        &self,
        tx: &T,
        pair: &Pair,
        expected_revision: i64,
        fence: Option<&LeaseId>,
    ) -> Result<bool> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let (holder, epoch) = fence_params(fence, stream_id, perspective)?;
        let row = query_one(
            tx,
            sql::SAVE_SNAPSHOT,
            &[
                &stream_id.as_uuid(),
                &perspective.as_str(),
                &expected_revision,
                &self.keep_snapshots,
                &holder,
                &epoch,
            ],
        )
        .await
        .map_err(|e| statement_error(e, "saving a perspective snapshot"))?;
        let outcome: String = row.column(0).map_err(decode_error)?;
        match outcome.as_str() {
            "saved" => Ok(true),
            "unchanged" => Ok(false),
            "lease_lost" => Err(lease_lost()),
            other => Err(Error::new(
                ErrorKind::Backend,
                format!("saving a snapshot returned an unknown outcome {other:?}"),
            )),
        }
    }

    async fn purge(&self, tx: &T, pair: &Pair, fence: Option<&LeaseId>) -> Result<()> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let (holder, epoch) = fence_params(fence, stream_id, perspective)?;
        let row = query_one(
            tx,
            sql::PURGE,
            &[&stream_id.as_uuid(), &perspective.as_str(), &holder, &epoch],
        )
        .await
        .map_err(|e| statement_error(e, "purging a perspective pair"))?;
        let outcome: String = row.column(0).map_err(decode_error)?;
        match outcome.as_str() {
            "purged" | "no_cursor" => Ok(()),
            "lease_lost" => Err(lease_lost()),
            other => Err(Error::new(
                ErrorKind::Backend,
                format!("a purge returned an unknown outcome {other:?}"),
            )),
        }
    }
}

impl<T: PerspectiveTransaction> PerspectiveReads<T> for PgPerspectiveStore {
    async fn cursor(&self, tx: &T, pair: &Pair) -> Result<Option<Cursor>> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let row = query_opt(
            tx,
            sql::CURSOR,
            &[&stream_id.as_uuid(), &perspective.as_str()],
        )
        .await
        .map_err(|e| statement_error(e, "reading a perspective cursor"))?;
        row.map(|row| decode_cursor(&row, 0, stream_id, perspective))
            .transpose()
    }

    async fn state(
        &self,
        tx: &T,
        pair: &Pair,
    ) -> Result<Option<(Cursor, Option<serde_json::Value>)>> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let row = query_opt(
            tx,
            sql::STATE,
            &[&stream_id.as_uuid(), &perspective.as_str()],
        )
        .await
        .map_err(|e| statement_error(e, "reading a perspective state"))?;
        row.map(|row| {
            Ok((
                decode_cursor(&row, 0, stream_id, perspective)?,
                row.column(CURSOR_COLUMNS).map_err(decode_error)?,
            ))
        })
        .transpose()
    }

    async fn pending_events(&self, tx: &T, pair: &Pair) -> Result<Vec<Uuid>> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let rows = tx
            .query(
                sql::PENDING_EVENTS,
                &[&stream_id.as_uuid(), &perspective.as_str()],
            )
            .await
            .map_err(|e| statement_error(e, "reading a pair's pending work"))?;
        rows.iter()
            .map(|row| row.column(0).map_err(decode_error))
            .collect()
    }

    async fn stream_events(
        &self,
        tx: &T,
        stream_id: StreamId,
        after: Option<Uuid>,
    ) -> Result<Vec<RecordedEvent>> {
        let rows = tx
            .query(sql::STREAM_EVENTS, &[&stream_id.as_uuid(), &after])
            .await
            .map_err(|e| statement_error(e, "reading a stream in event-id order"))?;
        rows.iter()
            .map(|row| crate::decode(row, 0, stream_id, &self.upcasters))
            .collect()
    }

    async fn states(
        &self,
        tx: &T,
        perspective: &PerspectiveName,
        after: Option<StreamId>,
        limit: usize,
    ) -> Result<Vec<StoredState>> {
        lockstep_core::check_states_page(limit)?;
        // At most MAX_STATES_PAGE: fits an i64.
        let limit = limit as i64;
        let rows = match after {
            None => {
                tx.query(sql::STATES_FIRST, &[&perspective.as_str(), &limit])
                    .await
            }
            Some(after) => {
                tx.query(
                    sql::STATES_AFTER,
                    &[&perspective.as_str(), &limit, &after.as_uuid()],
                )
                .await
            }
        }
        .map_err(|e| statement_error(e, "reading a page of perspective states"))?;
        rows.iter()
            .map(|row| {
                let stream: Uuid = row.column(CURSOR_COLUMNS + 1).map_err(decode_error)?;
                let stream_id = StreamId::from_uuid(stream);
                Ok(StoredState::new(
                    decode_cursor(row, 0, stream_id, perspective)?,
                    row.column(CURSOR_COLUMNS).map_err(decode_error)?,
                ))
            })
            .collect()
    }

    async fn pending_through(
        &self,
        tx: &T,
        perspective: &PerspectiveName,
        stream_id: Option<StreamId>,
        up_to: Uuid,
    ) -> Result<PendingThrough> {
        let stream = stream_id.map(|s| s.as_uuid());
        let row = query_one(
            tx,
            sql::PENDING_THROUGH,
            &[&perspective.as_str(), &stream, &up_to],
        )
        .await
        .map_err(|e| statement_error(e, "reading what a perspective has not applied yet"))?;
        let count = |i: usize| -> Result<u64> {
            let n: i64 = row.column(i).map_err(decode_error)?;
            Ok(u64::try_from(n).unwrap_or(0))
        };
        let mut pending = PendingThrough::default();
        pending.events = count(0)?;
        pending.rewinds = count(1)?;
        pending.parked = count(2)?;
        pending.error = row.column(3).map_err(decode_error)?;
        let registration: String = row.column(4).map_err(decode_error)?;
        pending.registration = Some(match registration.as_str() {
            "registered" => Registration::Registered,
            "retired" => Registration::Retired,
            _ => Registration::NotRegistered,
        });
        pending.live_workers = Some(count(5)?);
        Ok(pending)
    }

    async fn skipped_events(&self, tx: &T, pair: &Pair) -> Result<Vec<SkippedEvent>> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let rows = tx
            .query(
                sql::SKIPPED_EVENTS,
                &[&stream_id.as_uuid(), &perspective.as_str()],
            )
            .await
            .map_err(|e| statement_error(e, "reading a pair's skipped events"))?;
        rows.iter()
            .map(|row| {
                Ok(SkippedEvent::new(
                    row.column(0).map_err(decode_error)?,
                    row.column::<String>(1).map_err(decode_error)?,
                    row.column(2).map_err(decode_error)?,
                ))
            })
            .collect()
    }
}

impl<T: PerspectiveTransaction> RewindReads<T> for PgPerspectiveStore {
    async fn load_rewind(
        &self,
        tx: &T,
        pair: &Pair,
        page: PageLimits,
    ) -> Result<Option<RewindLoad>> {
        const DOING: &str = "reading what a rewind restores and replays";
        page.validate()?;
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let (stream, name) = (stream_id.as_uuid(), perspective.as_str());
        let rows_limit = page_rows(page);
        // Each row is decoded as it arrives, rather than all rows collected first: a long
        // page's rows would otherwise all be held (with their share of the connection's read
        // buffers) next to the events decoded from them (ADR 0029: a full replay of 20 000
        // events 24 % faster).
        let params: [&dyn Param; 3] = [&stream, &name, &rows_limit];
        let mut rows = tx.query_rows(sql::LOAD_REWIND, &params);
        // The header is the row of part 0 (the function returns it first); checked here, not
        // assumed. The events stop at the first that
        // does not fit the page: the rest of the rows are not read (the connection discards
        // them).
        let mut header: Option<(Cursor, Option<Snapshot>)> = None;
        let mut events = PageCut::new(page);
        while let Some(row) = rows
            .try_next()
            .await
            .map_err(|e| statement_error(e, DOING))?
        {
            let part: i32 = row.column(0).map_err(decode_error)?;
            if part == 0 && header.is_none() {
                header = Some(decode_rewind_header(&row, stream_id, perspective)?);
            } else if !events.take(&row, LOAD_EVENT_AT, stream_id, &self.upcasters)?
                && header.is_some()
            {
                break;
            }
        }
        // No row at all: no cursor.
        let Some((cursor, snapshot)) = header else {
            if events.is_empty() {
                return Ok(None);
            }
            return Err(Error::new(
                ErrorKind::Backend,
                "a rewind load returned events without their cursor",
            ));
        };
        let (events, more, unreadable) = events.finish();
        let mut load = RewindLoad::new(cursor, snapshot, events).with_more(more);
        load.unreadable = unreadable;
        Ok(Some(load))
    }

    async fn rewind_events(
        &self,
        tx: &T,
        pair: &Pair,
        after: Option<Uuid>,
        page: PageLimits,
    ) -> Result<EventPage> {
        const DOING: &str = "reading a page of a rewind's events";
        page.validate()?;
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let (stream, name) = (stream_id.as_uuid(), perspective.as_str());
        let rows_limit = page_rows(page);
        let params: [&dyn Param; 4] = [&stream, &name, &rows_limit, &after];
        let mut rows = tx.query_rows(sql::REWIND_EVENTS, &params);
        let mut events = PageCut::new(page);
        while let Some(row) = rows
            .try_next()
            .await
            .map_err(|e| statement_error(e, DOING))?
        {
            if !events.take(&row, 0, stream_id, &self.upcasters)? {
                break;
            }
        }
        let (events, more, unreadable) = events.finish();
        let mut page = EventPage::new(events, more);
        page.unreadable = unreadable;
        Ok(page)
    }

    async fn snapshot_before(&self, tx: &T, pair: &Pair, before: Uuid) -> Result<Option<Snapshot>> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let row = query_opt(
            tx,
            sql::SNAPSHOT_BEFORE,
            &[&stream_id.as_uuid(), &perspective.as_str(), &before],
        )
        .await
        .map_err(|e| statement_error(e, "reading a perspective snapshot"))?;
        row.map(|row| {
            let applied: i64 = row.column(2).map_err(decode_error)?;
            Ok(Snapshot {
                event_id: row.column(0).map_err(decode_error)?,
                state: row.column(1).map_err(decode_error)?,
                applied_count: stored_count(applied)?,
            })
        })
        .transpose()
    }

    async fn record_progress(&self, tx: &T, report: &ProgressReport) -> Result<()> {
        life::record_progress(tx, report).await
    }
}

impl<T: PerspectiveTransaction> PerspectiveAdmin<T> for PgPerspectiveStore {
    async fn request_rewind(&self, tx: &T, pair: &Pair, from: Option<Uuid>) -> Result<bool> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let from = from.unwrap_or(Uuid::nil());
        let row = query_opt(
            tx,
            sql::REQUEST_REWIND,
            &[&stream_id.as_uuid(), &perspective.as_str(), &from],
        )
        .await
        .map_err(|e| statement_error(e, "requesting a rewind"))?;
        Ok(row.is_some())
    }

    async fn perspective_status(&self, tx: &T) -> Result<Vec<PerspectiveStatus>> {
        let rows = tx
            .query(sql::PERSPECTIVE_STATUS, &[])
            .await
            .map_err(|e| statement_error(e, "reading the perspectives' status"))?;
        rows.iter()
            .map(|row| {
                let count = |i: usize| -> Result<u64> {
                    stored_count(row.column(i).map_err(decode_error)?)
                };
                let mut status =
                    PerspectiveStatus::new(stored_name(row.column(0).map_err(decode_error)?)?);
                status.pairs = count(1)?;
                status.pending_events = count(2)?;
                let age: Option<i64> = row.column(3).map_err(decode_error)?;
                // A clock that went back makes an age below zero: none waited.
                status.oldest_pending_age =
                    age.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)));
                status.rewinds_pending = count(4)?;
                status.in_error = count(5)?;
                status.backing_off = count(6)?;
                status.parked = count(7)?;
                Ok(status)
            })
            .collect()
    }

    async fn failing_pairs(
        &self,
        tx: &T,
        perspectives: &[PerspectiveName],
        limit: usize,
    ) -> Result<Vec<Cursor>> {
        self.listed_cursors(
            tx,
            sql::FAILING_PAIRS,
            perspectives,
            limit,
            "listing failing perspective pairs",
        )
        .await
    }

    async fn parked_pairs(
        &self,
        tx: &T,
        perspectives: &[PerspectiveName],
        limit: usize,
    ) -> Result<Vec<Cursor>> {
        self.listed_cursors(
            tx,
            sql::PARKED_PAIRS,
            perspectives,
            limit,
            "listing parked perspective pairs",
        )
        .await
    }

    async fn unpark(&self, tx: &T, pair: &Pair) -> Result<bool> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let row = query_opt(
            tx,
            sql::UNPARK,
            &[&stream_id.as_uuid(), &perspective.as_str()],
        )
        .await
        .map_err(|e| statement_error(e, "retrying a perspective pair"))?;
        Ok(row.is_some())
    }

    async fn skip_event(&self, tx: &T, pair: &Pair, event_id: Uuid, reason: &str) -> Result<bool> {
        SkippedEvent::check_reason(reason)?;
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let reason = reason.replace('\0', "\u{FFFD}");
        let row = query_one(
            tx,
            sql::SKIP_EVENT,
            &[
                &stream_id.as_uuid(),
                &perspective.as_str(),
                &event_id,
                &reason,
            ],
        )
        .await
        .map_err(|e| statement_error(e, "skipping an event of a perspective pair"))?;
        let skipped: i64 = row.column(0).map_err(decode_error)?;
        Ok(skipped > 0)
    }

    async fn rewind_progress(
        &self,
        tx: &T,
        perspectives: &[PerspectiveName],
        limit: usize,
    ) -> Result<Vec<RewindProgress>> {
        life::rewind_progress(tx, perspectives, limit).await
    }
}

impl<T: PerspectiveTransaction> PerspectiveLifecycle<T> for PgPerspectiveStore {
    async fn register(&self, tx: &T, perspectives: &[PerspectiveName]) -> Result<()> {
        use std::sync::atomic::Ordering;
        if !self.schema_checked.load(Ordering::Acquire) {
            tx.check_schema().await?;
            self.schema_checked.store(true, Ordering::Release);
        }
        let names: Vec<&str> = perspectives.iter().map(PerspectiveName::as_str).collect();
        query_one(
            tx,
            sql::REGISTER,
            &[&names, &self.change_queue_us, &self.change_give_up_us],
        )
        .await
        .map_err(|e| statement_error(e, "registering perspectives"))?;
        Ok(())
    }

    async fn retire(
        &self,
        tx: &T,
        perspective: &PerspectiveName,
        states: RetireStates,
    ) -> Result<Retired> {
        life::retire(
            tx,
            perspective,
            states,
            (self.change_queue_us, self.change_give_up_us),
        )
        .await
    }

    async fn retired(&self, tx: &T) -> Result<Vec<PerspectiveName>> {
        life::retired(tx).await
    }

    async fn rebuild(&self, tx: &T, perspective: &PerspectiveName) -> Result<Rebuild> {
        life::rebuild(tx, perspective).await
    }

    async fn record_applied(&self, tx: &T, counts: &[(PerspectiveName, u64)]) -> Result<()> {
        life::record_applied(tx, counts).await
    }

    async fn throughput(&self, tx: &T) -> Result<Vec<lockstep_core::Throughput>> {
        life::throughput(tx).await
    }
}

impl<T: PerspectiveTransaction> CursorRows<T> for PgPerspectiveStore {
    async fn pending_pairs(
        &self,
        tx: &T,
        instance: InstanceId,
        perspectives: &[PerspectiveName],
        debounce: RewindDebounce,
        limit: usize,
    ) -> Result<Vec<PendingPair>> {
        let (window, max_delay) = (micros(debounce.window)?, micros(debounce.max_delay)?);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let names: Vec<&str> = perspectives.iter().map(PerspectiveName::as_str).collect();
        let rows = tx
            .query(
                sql::PENDING_PAIRS,
                &[&instance.as_uuid(), &window, &limit, &max_delay, &names],
            )
            .await
            .map_err(|e| statement_error(e, "listing pending perspective pairs"))?;
        rows.iter()
            .map(|row| {
                let name: String = row.column(1).map_err(decode_error)?;
                let pending: i64 = row.column(2).map_err(decode_error)?;
                Ok(PendingPair {
                    pair: Pair::new(
                        StreamId::from_uuid(row.column(0).map_err(decode_error)?),
                        stored_name(name)?,
                    ),
                    pending: stored_count(pending)?,
                    rewind: row.column(3).map_err(decode_error)?,
                })
            })
            .collect()
    }

    async fn ensure_cursor(&self, tx: &T, pair: &Pair) -> Result<bool> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let row = query_opt(
            tx,
            sql::ENSURE_CURSOR,
            &[&stream_id.as_uuid(), &perspective.as_str()],
        )
        .await
        .map_err(|e| statement_error(e, "creating a perspective cursor"))?;
        Ok(row.is_some())
    }

    async fn delete_cursor(&self, tx: &T, pair: &Pair) -> Result<bool> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        let row = query_opt(
            tx,
            sql::DELETE_CURSOR,
            &[&stream_id.as_uuid(), &perspective.as_str()],
        )
        .await
        .map_err(|e| statement_error(e, "deleting a perspective cursor"))?;
        Ok(row.is_some())
    }
}

/// The cursor columns of [`sql`] (`CURSOR_COLUMNS` of them, in the order of `cursor_columns!`),
/// starting at `at`.
fn decode_cursor<R: Columns>(
    row: &R,
    at: usize,
    stream_id: StreamId,
    perspective: &PerspectiveName,
) -> Result<Cursor> {
    let trigger: Option<Uuid> = row.column(at + 3).map_err(decode_error)?;
    let flagged_at: Option<OffsetDateTime> = row.column(at + 4).map_err(decode_error)?;
    let first_flagged_at: Option<OffsetDateTime> = row.column(at + 5).map_err(decode_error)?;
    let rewind = match (trigger, flagged_at, first_flagged_at) {
        (None, _, _) => None,
        (Some(trigger), Some(flagged_at), first) => Some(RewindRequest {
            trigger,
            flagged_at,
            first_flagged_at: first.unwrap_or(flagged_at),
        }),
        (Some(_), None, _) => {
            return Err(Error::new(
                ErrorKind::Backend,
                "a stored rewind request has no flagged time",
            ));
        }
    };
    let applied: i64 = row.column(at + 2).map_err(decode_error)?;
    let failures: i32 = row.column(at + 7).map_err(decode_error)?;
    let holder: Option<Uuid> = row.column(at + 9).map_err(decode_error)?;
    let reason: Option<String> = row.column(at + 10).map_err(decode_error)?;
    let mut cursor = Cursor::new(Pair::new(stream_id, perspective.clone()));
    cursor.last_event_id = row.column(at).map_err(decode_error)?;
    cursor.revision = row.column(at + 1).map_err(decode_error)?;
    cursor.applied_count = stored_count(applied)?;
    cursor.rewind = rewind;
    cursor.error = row.column(at + 6).map_err(decode_error)?;
    cursor.failures = u32::try_from(failures)
        .map_err(|_| Error::new(ErrorKind::Backend, "a stored failure count is negative"))?;
    cursor.latest_snapshot = row.column(at + 8).map_err(decode_error)?;
    cursor.failed_event_id = row.column(at + 13).map_err(decode_error)?;
    cursor.retry_at = row.column(at + 14).map_err(decode_error)?;
    cursor.parked_at = row.column(at + 15).map_err(decode_error)?;
    cursor.lease = CursorLease {
        holder: holder.map(InstanceId::from_uuid).transpose()?,
        reason: reason
            .map(|r| {
                LockReason::parse(r).map_err(|e| {
                    Error::new(ErrorKind::Backend, "a stored lease reason is invalid")
                        .with_source(e)
                })
            })
            .transpose()?,
        expires_at: row.column(at + 11).map_err(decode_error)?,
        epoch: LeaseEpoch::new(row.column(at + 12).map_err(decode_error)?),
    };
    Ok(cursor)
}

/// A fence as `(holder, epoch)` parameters; a fence naming another pair is invalid input.
fn fence_params(
    fence: Option<&LeaseId>,
    stream_id: StreamId,
    perspective: &PerspectiveName,
) -> Result<(Option<Uuid>, Option<i64>)> {
    match fence {
        None => Ok((None, None)),
        Some(lease) if lease.stream_id == stream_id && &lease.perspective == perspective => {
            Ok((Some(lease.holder.as_uuid()), Some(lease.epoch.get())))
        }
        Some(lease) => Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "the fence is a lease on ({}, {}), not on ({stream_id}, {perspective})",
                lease.stream_id, lease.perspective
            ),
        )),
    }
}

impl PgPerspectiveStore {
    /// Sends a state change (`COMMIT`) after checking it: the row of outcome and revision.
    async fn send_commit<T: Executor + ?Sized>(&self, tx: &T, commit: &StateCommit) -> Result<Row> {
        let params = CommitParams::new(commit, self.keep_snapshots)?;
        query_one(tx, sql::COMMIT, &params.as_params())
            .await
            .map_err(|e| statement_error(e, "committing a perspective state"))
    }
}

/// A state change's twelve parameters (`lockstep_perspective_commit` and its fenced variants),
/// checked: a state `jsonb` can store, a fence on the commit's own pair, a count that fits.
struct CommitParams<'c> {
    commit: &'c StateCommit,
    stream: Uuid,
    perspective: &'c str,
    applied_count: i64,
    holder: Option<Uuid>,
    epoch: Option<i64>,
    keep: i32,
}

impl<'c> CommitParams<'c> {
    fn new(commit: &'c StateCommit, keep: i32) -> Result<CommitParams<'c>> {
        check_json(&commit.state)?;
        let (holder, epoch) = fence_params(
            commit.fence.as_ref(),
            commit.pair.stream_id,
            &commit.pair.perspective,
        )?;
        Ok(CommitParams {
            commit,
            stream: commit.pair.stream_id.as_uuid(),
            perspective: commit.pair.perspective.as_str(),
            applied_count: count_param(commit.applied_count)?,
            holder,
            epoch,
            keep,
        })
    }

    fn as_params(&self) -> [&dyn Param; 12] {
        let c = self.commit;
        [
            &self.stream,
            &self.perspective,
            &c.expected_revision,
            &c.state,
            &c.last_event_id,
            &self.applied_count,
            &c.applied_events,
            &c.rewound_from,
            &c.snapshot,
            &self.keep,
            &self.holder,
            &self.epoch,
        ]
    }
}

/// A refusal of `lockstep_perspective_commit_release_or_refuse` (SQLSTATE `LSREF`: the outcome
/// in the message, the revision found in the detail) as the error a refused row gives;
/// anything else as a statement error.
fn refused_or_statement_error(err: DbError, commit: &StateCommit) -> Error {
    if err.code() == Some("LSREF") {
        let found = err.detail().and_then(|d| d.parse::<i64>().ok());
        return refusal(err.message().unwrap_or_default(), found, commit);
    }
    statement_error(err, "committing a perspective state")
}

/// The new revision of a commit's row (outcome, revision), or its refusal as an error.
fn commit_outcome(row: &Row, commit: &StateCommit) -> Result<i64> {
    let outcome: String = row.column(0).map_err(decode_error)?;
    let revision: Option<i64> = row.column(1).map_err(decode_error)?;
    match (outcome.as_str(), revision) {
        ("committed", Some(revision)) => Ok(revision),
        (other, found) => Err(refusal(other, found, commit)),
    }
}

/// The error of a commit refused with `outcome` (`found`: the cursor's revision, when known).
fn refusal(outcome: &str, found: Option<i64>, commit: &StateCommit) -> Error {
    match (outcome, found) {
        ("conflict", found) => Error::new(
            ErrorKind::Conflict,
            format!(
                "stream {} perspective {}: expected revision {}, the cursor is at {}",
                commit.pair.stream_id,
                commit.pair.perspective,
                commit.expected_revision,
                found.map_or_else(|| "?".to_owned(), |r| r.to_string())
            ),
        ),
        ("no_cursor", _) => Error::new(
            ErrorKind::Conflict,
            format!(
                "stream {} perspective {}: the cursor no longer exists",
                commit.pair.stream_id, commit.pair.perspective
            ),
        ),
        ("lease_lost", _) => lease_lost(),
        (other, _) => Error::new(
            ErrorKind::Backend,
            format!("a commit returned an unknown outcome {other:?}"),
        ),
    }
}

fn lease_lost() -> Error {
    Error::new(
        ErrorKind::LeaseLost,
        "the stream lease is no longer held at this epoch (expired and taken over, released, \
         or force-released); nothing was written, roll the transaction back",
    )
}

/// Refuses, before any SQL, a state `jsonb` cannot store (U+0000 in a string or key) or a
/// claim could not read back (nested deeper than [`lockstep_core::json::MAX_DEPTH`]: the
/// pair's every later claim would fail to decode it).
fn check_json(value: &serde_json::Value) -> Result<()> {
    lockstep_core::json::check_storable(value, "perspective state")
}

/// A backoff in microseconds, capped (a backoff of centuries is still "not now", never an
/// error: a failure must always be recordable).
fn backoff_micros(d: Duration) -> i64 {
    // 100 years.
    const CAP: i64 = 100 * 365 * 24 * 60 * 60 * 1_000_000;
    i64::try_from(d.as_micros()).map_or(CAP, |us| us.min(CAP))
}

fn micros(d: Duration) -> Result<i64> {
    i64::try_from(d.as_micros())
        .map_err(|_| ValidationError::DurationTooLarge { field: "debounce" }.into())
}

fn count_param(n: u64) -> Result<i64> {
    i64::try_from(n).map_err(|_| Error::new(ErrorKind::InvalidInput, "applied_count out of range"))
}

fn stored_count(n: i64) -> Result<u64> {
    u64::try_from(n).map_err(|_| Error::new(ErrorKind::Backend, "a stored count is negative"))
}

fn stored_name(name: String) -> Result<PerspectiveName> {
    PerspectiveName::new(name).map_err(|e| {
        Error::new(ErrorKind::Backend, "a stored perspective name is invalid").with_source(e)
    })
}

/// The header row of a rewind's read ([`sql::LOAD_REWIND`]): the cursor, and the latest
/// snapshot before the request's trigger.
fn decode_rewind_header<R: Columns>(
    header: &R,
    stream_id: StreamId,
    perspective: &PerspectiveName,
) -> Result<(Cursor, Option<Snapshot>)> {
    let cursor = decode_cursor(header, LOAD_CURSOR_AT, stream_id, perspective)?;
    let snapshot = match header
        .column::<Option<Uuid>>(LOAD_SNAPSHOT_AT)
        .map_err(decode_error)?
    {
        Some(event_id) => {
            let applied: i64 = header.column(LOAD_SNAPSHOT_AT + 2).map_err(decode_error)?;
            Some(Snapshot {
                event_id,
                state: header.column(LOAD_SNAPSHOT_AT + 1).map_err(decode_error)?,
                applied_count: stored_count(applied)?,
            })
        }
        None => None,
    };
    Ok((cursor, snapshot))
}

fn decode_error(err: DbError) -> Error {
    Error::new(ErrorKind::Backend, "decoding a perspective-store row").with_source(err)
}

/// A page's row limit: one event more than the page holds (that row says more follow).
fn page_rows(page: PageLimits) -> i64 {
    i64::try_from(page.events).map_or(i64::MAX, |n| n.saturating_add(1))
}

/// A rewind page as its rows arrive (`LOAD_REWIND`'s docs): events are taken in event-id order
/// while they fit the page; the first that does not ends it, and says that more follow.
struct PageCut {
    page: PageLimits,
    events: Vec<RecordedEvent>,
    bytes: u64,
    more: bool,
    /// The event the page ended at because it could not be read, and why.
    unreadable: Option<(Uuid, String)>,
}

impl PageCut {
    fn new(page: PageLimits) -> PageCut {
        PageCut {
            page,
            events: Vec::new(),
            bytes: 0,
            more: false,
            unreadable: None,
        }
    }

    /// Takes the event of `row` at `offset` (its decoded size in the column after it) if it
    /// fits: `Ok(false)` when the page is full, and no more rows are to be read. Rows out of
    /// event-id order are an error (the statement orders them), never a page cut wrongly. An
    /// event that does not decode (a payload written by SQL that bypassed the event store's
    /// checks) or that an upcaster fails on ends the page before it, recorded as unreadable:
    /// the rewind fails at that event, which an operator can skip, rather than at no event.
    fn take(
        &mut self,
        row: &Row,
        offset: usize,
        stream_id: StreamId,
        upcasters: &Upcasters,
    ) -> Result<bool> {
        if self.more || self.unreadable.is_some() {
            return Ok(false);
        }
        let size: Option<i64> = row.column(offset + 6).map_err(decode_error)?;
        let bytes = self
            .bytes
            .saturating_add(size.and_then(|n| u64::try_from(n).ok()).unwrap_or(0));
        if self.events.len() >= self.page.events
            || (!self.events.is_empty() && bytes > self.page.bytes)
        {
            self.more = true;
            return Ok(false);
        }
        let event = match crate::decode(row, offset, stream_id, upcasters) {
            Ok(event) => event,
            Err(err) => {
                // The id is read on its own: only the payload (or another column) is bad.
                let id: Uuid = row.column(offset).map_err(decode_error)?;
                self.unreadable = Some((
                    id,
                    lockstep_core::perspective_store::unreadable_event_message(id, &err),
                ));
                return Ok(false);
            }
        };
        if self
            .events
            .last()
            .is_some_and(|last| last.event_id >= event.event_id)
        {
            return Err(Error::new(
                ErrorKind::Backend,
                "a rewind page's events came out of event-id order",
            ));
        }
        self.bytes = bytes;
        self.events.push(event);
        Ok(true)
    }

    /// Whether no event row was seen.
    fn is_empty(&self) -> bool {
        self.events.is_empty() && !self.more && self.unreadable.is_none()
    }

    /// The page's events, whether more follow, and the event it ended at because it could not
    /// be read.
    fn finish(self) -> (Vec<RecordedEvent>, bool, Option<(Uuid, String)>) {
        (self.events, self.more, self.unreadable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_with_a_nul_character_is_refused_before_any_sql() {
        for bad in [
            serde_json::json!({ "note": "a\u{0}b" }),
            serde_json::json!({ "a\u{0}": 1 }),
            serde_json::json!([[{ "deep": ["x\u{0}"] }]]),
        ] {
            assert_eq!(
                check_json(&bad).expect_err("refused").kind(),
                ErrorKind::InvalidInput
            );
        }
        assert!(check_json(&serde_json::json!({ "note": "ok" })).is_ok());
        let deep = |depth: usize| {
            (0..depth).fold(serde_json::json!(1), |v, _| serde_json::json!({ "k": [v] }))
        };
        assert!(check_json(&deep(63)).is_ok(), "126 levels");
        assert_eq!(
            check_json(&deep(64)).expect_err("128 levels").validation(),
            Some(&ValidationError::JsonTooDeep {
                field: "perspective state",
                max: lockstep_core::json::MAX_DEPTH,
            })
        );
    }

    #[test]
    fn keep_snapshots_is_validated() {
        assert_eq!(
            PgPerspectiveStore::new().keep_snapshots(),
            DEFAULT_KEEP_SNAPSHOTS
        );
        assert!(PgPerspectiveStore::with_keep_snapshots(0).is_err());
        assert_eq!(
            PgPerspectiveStore::with_keep_snapshots(7)
                .expect("valid")
                .keep_snapshots(),
            7
        );
    }

    #[test]
    fn the_claim_header_columns_line_up_with_the_function() {
        // CLAIM: outcome, 13 cursor columns of lockstep_perspective_claim, then the cursor
        // row's failed event, backoff and parking (16 cursor columns), state, 6 event columns,
        // the clock.
        assert_eq!(CLAIM_STATE_AT, 17);
        assert_eq!(CLAIM_EVENT_AT, 18);
        assert_eq!(CLAIM_CLOCK_AT, 24);
        // The statement's select list puts them there (no column of it holds a comma).
        let list = sql::CLAIM
            .strip_prefix("SELECT ")
            .and_then(|s| s.split("\n  FROM ").next())
            .expect("a select list");
        let columns: Vec<&str> = list.split(',').map(str::trim).collect();
        assert_eq!(columns.len(), CLAIM_CLOCK_AT + 1);
        assert_eq!(columns[CLAIM_CURSOR_AT], "c.last_event_id");
        assert_eq!(
            columns[CLAIM_CURSOR_AT + CURSOR_COLUMNS - 3..CLAIM_STATE_AT],
            ["k.failed_event_id", "k.retry_at", "k.parked_at"]
        );
        assert_eq!(columns[CLAIM_STATE_AT], "c.state");
        assert_eq!(columns[CLAIM_EVENT_AT], "c.event_id");
        assert_eq!(columns[CLAIM_CLOCK_AT], "clock_timestamp()");
        // lockstep_perspective_claim_pairs: kind, stream, perspective, 16 cursor columns,
        // state, work ids, state size, walk position.
        assert_eq!(BATCH_STATE_AT, 19);
        assert_eq!(BATCH_WORK_AT, 20);
    }

    #[allow(dead_code)]
    fn implemented_for_owned_and_borrowed_transactions<'t>()
    where
        PgPerspectiveStore: lockstep_core::PerspectiveStore<lockstep_pg::PgTransaction>
            + lockstep_core::PerspectiveStore<tokio_postgres::Transaction<'t>>
            + lockstep_core::PerspectiveStore<lockstep_pg::deadpool_postgres::Transaction<'t>>,
    {
    }

    #[cfg(feature = "sqlx")]
    #[allow(dead_code)]
    fn implemented_for_sqlx_transactions()
    where
        PgPerspectiveStore: lockstep_core::PerspectiveStore<lockstep_pg::sqlx::SqlxTransaction>,
    {
    }
}
