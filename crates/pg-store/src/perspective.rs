//! The perspective store on PostgreSQL: [`PgPerspectiveStore`] implements
//! [`PerspectiveStore`] for every [`PgTransactionRef`] (the owned [`lockstep_pg::PgTransaction`],
//! a borrowed `tokio_postgres::Transaction`).
//!
//! The schema and the protocol are in migration `V5` and `docs/adr/0006-perspective-store.md`:
//!
//! - tables `wh_perspectives` (registered names), `wh_perspective_events` (the work queue,
//!   `(stream_id, perspective_name, event_id)`), `wh_perspective_states`,
//!   `wh_perspective_snapshots`, and the columns `revision`, `applied_count`, `failures` on
//!   `wh_perspective_cursors` (the cursor row that also carries the stream lease);
//! - **fan-out with no extra round trip**: `lockstep_append_events`, the statement
//!   [`PgEventStore`](crate::PgEventStore) appends with, also inserts one work row per
//!   registered perspective and the pairs' cursor rows;
//! - **one statement per operation**: [`claim`](PerspectiveStore::claim) is the SQL function
//!   `lockstep_perspective_claim` (lock the cursor row `FOR NO KEY UPDATE SKIP LOCKED` unless a
//!   live lease is on it, detect late arrivals and write the rewind request, return the cursor,
//!   the state and the pending events joined with `wh_events` in event-id order);
//!   [`commit_state`](PerspectiveStore::commit_state) is `lockstep_perspective_commit` (fence,
//!   compare-and-set on the revision, state upsert, delete the applied work, advance the cursor,
//!   clear the rewind request conditionally, snapshot and prune). A refused commit (conflict,
//!   lease lost) writes nothing and leaves the transaction usable.
//!
//! Every statement is sent with `query_typed` (parse, bind and execute in one round trip), with
//! every value bound as a parameter. Bad input (a state that `jsonb` cannot store or that is
//! nested deeper than a claim can read back, [`lockstep_core::json`]; a count out of range; a
//! fence naming another pair) is refused with [`ErrorKind::InvalidInput`] before any SQL is sent.
//!
//! ```no_run
//! # async fn demo(db: lockstep_pg::PgDatabase) -> lockstep_core::Result<()> {
//! use lockstep_core::{
//!     Claim, PerspectiveName, PerspectiveStore, RewindDebounce, StateCommit, StreamId,
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
//! if let Claim::Apply { cursor, state, events } =
//!     store.claim(&tx, stream, &name, 100, RewindDebounce::NONE).await?
//! {
//!     let new_state = serde_json::json!({ "seen": cursor.applied_count + events.len() as u64 });
//! #   let _ = state;
//!     let mut commit = StateCommit::new(stream, name.clone(), cursor.revision, new_state);
//!     commit.last_event_id = events.last().map(|e| e.event_id);
//!     commit.applied_count = cursor.applied_count + events.len() as u64;
//!     commit.applied_events = events.iter().map(|e| e.event_id).collect();
//!     store.commit_state(&tx, &commit).await?;
//! }
//! tx.commit().await?;
//! # Ok(()) }
//! ```

use std::time::Duration;

use lockstep_core::perspective_store::DEFAULT_KEEP_SNAPSHOTS;
use lockstep_core::{
    Claim, Cursor, CursorLease, Error, ErrorKind, InstanceId, LeaseEpoch, LeaseId, LockReason,
    PendingPair, PerspectiveName, PerspectiveStore, RecordedEvent, Result, RewindDebounce,
    RewindRequest, Snapshot, StateCommit, StreamId, ValidationError,
};
use lockstep_pg::PgTransactionRef;
use lockstep_pg::internal::statement_error;
use time::OffsetDateTime;
use tokio_postgres::GenericClient;
use tokio_postgres::Row;
use tokio_postgres::types::Type;
use uuid::Uuid;

/// The statements of [`PgPerspectiveStore`], one per operation.
pub mod sql {
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
             k.stream_lock_epoch"
        };
    }

    /// Registers names (`$1 text[]`); returns how many were new (they catch up).
    pub const REGISTER: &str = "SELECT lockstep_register_perspectives($1)";

    /// Pairs of the perspectives `$5 text[]` with work, or with a rewind request whose debounce
    /// window (`$2` µs) has passed or that was first flagged at least `$4` µs ago (the cap), not
    /// under a live lease of another instance than `$1`; oldest work first, at most `$3`. A pair with a request inside its
    /// window is held back, work and all.
    pub const PENDING_PAIRS: &str = "\
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
    /// `$5` debounce cap µs): a header row (outcome, cursor columns, state), then for `apply`
    /// the events.
    pub const CLAIM: &str = "SELECT * FROM lockstep_perspective_claim($1, $2, $3, $4, $5)";

    /// Commits a state change (see `lockstep_perspective_commit`).
    pub const COMMIT: &str = "SELECT outcome, revision \
         FROM lockstep_perspective_commit($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)";

    /// One pair's cursor.
    pub const CURSOR: &str = concat!(
        "SELECT ",
        cursor_columns!(),
        " FROM wh_perspective_cursors k WHERE k.stream_id = $1 AND k.perspective_name = $2"
    );

    /// One pair's cursor and state.
    pub const STATE: &str = concat!(
        "SELECT ",
        cursor_columns!(),
        ", st.state FROM wh_perspective_cursors k \
         LEFT JOIN wh_perspective_states st \
                ON st.stream_id = k.stream_id AND st.perspective_name = k.perspective_name \
         WHERE k.stream_id = $1 AND k.perspective_name = $2"
    );

    /// The event ids of a pair's work, in event-id order.
    pub const PENDING_EVENTS: &str = "SELECT w.event_id FROM wh_perspective_events w \
         WHERE w.stream_id = $1 AND w.perspective_name = $2 ORDER BY w.event_id";

    /// A stream's events after `$2` (all when NULL), in event-id order.
    pub const STREAM_EVENTS: &str = "SELECT e.event_id, e.version, e.event_type, e.payload, e.recorded_at \
         FROM wh_events e WHERE e.stream_id = $1 AND ($2::uuid IS NULL OR e.event_id > $2) \
         ORDER BY e.event_id";

    /// The latest snapshot strictly before `$3`.
    pub const SNAPSHOT_BEFORE: &str = "SELECT s.event_id, s.state, s.applied_count \
         FROM wh_perspective_snapshots s \
         WHERE s.stream_id = $1 AND s.perspective_name = $2 AND s.event_id < $3 \
         ORDER BY s.event_id DESC LIMIT 1";

    /// Bootstrap snapshot (see `lockstep_perspective_save_snapshot`).
    pub const SAVE_SNAPSHOT: &str =
        "SELECT lockstep_perspective_save_snapshot($1, $2, $3, $4, $5, $6)";

    /// Sets the rewind request to `$3`, or moves it earlier; the window restarts when it
    /// moves. No row: no cursor.
    pub const REQUEST_REWIND: &str = "\
WITH n AS (SELECT clock_timestamp() AS now)
UPDATE wh_perspective_cursors k
   SET rewind_trigger_event_id = CASE WHEN k.rewind_trigger_event_id IS NULL OR $3 < k.rewind_trigger_event_id
                                      THEN $3 ELSE k.rewind_trigger_event_id END,
       rewind_flagged_at = CASE WHEN k.rewind_trigger_event_id IS NULL OR $3 < k.rewind_trigger_event_id
                                THEN n.now ELSE k.rewind_flagged_at END,
       rewind_first_flagged_at = CASE WHEN k.rewind_trigger_event_id IS NULL
                                      THEN n.now ELSE k.rewind_first_flagged_at END,
       status = k.status | 1
  FROM n
 WHERE k.stream_id = $1 AND k.perspective_name = $2
RETURNING k.revision";

    /// Records a failure (creating the cursor row if the pair has none).
    pub const RECORD_FAILURE: &str = "\
INSERT INTO wh_perspective_cursors AS k (stream_id, perspective_name, error, failures)
VALUES ($1, $2, $3, 1)
ON CONFLICT (stream_id, perspective_name)
DO UPDATE SET error = EXCLUDED.error, failures = k.failures + 1";

    /// Purges a pair (see `lockstep_perspective_purge`).
    pub const PURGE: &str = "SELECT lockstep_perspective_purge($1, $2, $3, $4)";

    /// Creates a cursor row; a row back means it was created.
    pub const ENSURE_CURSOR: &str = "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) \
         VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING 1";

    /// Deletes a cursor row with its state, snapshots and work; a row back means it existed.
    pub const DELETE_CURSOR: &str = "\
WITH w AS (DELETE FROM wh_perspective_events x WHERE x.stream_id = $1 AND x.perspective_name = $2),
     st AS (DELETE FROM wh_perspective_states x WHERE x.stream_id = $1 AND x.perspective_name = $2),
     sn AS (DELETE FROM wh_perspective_snapshots x WHERE x.stream_id = $1 AND x.perspective_name = $2)
DELETE FROM wh_perspective_cursors k WHERE k.stream_id = $1 AND k.perspective_name = $2
RETURNING 1";
}

/// Where the cursor columns start in a claim's header row (after `outcome`).
const CLAIM_CURSOR_AT: usize = 1;
/// Where the state is in a claim's header row.
const CLAIM_STATE_AT: usize = CLAIM_CURSOR_AT + CURSOR_COLUMNS;
/// Where the event columns start in a claim's event rows.
const CLAIM_EVENT_AT: usize = CLAIM_STATE_AT + 1;
/// How many columns `decode_cursor` reads.
const CURSOR_COLUMNS: usize = 13;

/// The PostgreSQL perspective store. Cheap to clone; holds no connection (every call runs on
/// the transaction it is given). Apply the schema first with [`lockstep_pg::migrate()`].
#[derive(Debug, Clone)]
pub struct PgPerspectiveStore {
    keep_snapshots: i32,
}

impl Default for PgPerspectiveStore {
    fn default() -> Self {
        PgPerspectiveStore::new()
    }
}

impl PgPerspectiveStore {
    /// A store keeping the last [`DEFAULT_KEEP_SNAPSHOTS`] snapshots per pair.
    pub fn new() -> PgPerspectiveStore {
        PgPerspectiveStore {
            // A small constant: it fits.
            keep_snapshots: DEFAULT_KEEP_SNAPSHOTS as i32,
        }
    }

    /// A store keeping the last `keep` snapshots per pair (at least 1). Fails with
    /// [`ErrorKind::InvalidInput`] for 0 or more than `i32::MAX`.
    pub fn with_keep_snapshots(keep: usize) -> Result<PgPerspectiveStore> {
        match i32::try_from(keep) {
            Ok(keep) if keep >= 1 => Ok(PgPerspectiveStore {
                keep_snapshots: keep,
            }),
            _ => Err(Error::new(
                ErrorKind::InvalidInput,
                "keep_snapshots must be between 1 and 2147483647",
            )),
        }
    }

    /// How many snapshots per pair are kept.
    pub fn keep_snapshots(&self) -> usize {
        // Positive by construction.
        self.keep_snapshots.unsigned_abs() as usize
    }
}

impl<T: PgTransactionRef> PerspectiveStore<T> for PgPerspectiveStore {
    async fn register(&self, tx: &T, perspectives: &[PerspectiveName]) -> Result<()> {
        let names: Vec<&str> = perspectives.iter().map(PerspectiveName::as_str).collect();
        tx.executor()
            .query_typed_one(sql::REGISTER, &[(&names, Type::TEXT_ARRAY)])
            .await
            .map_err(|e| statement_error(e, "registering perspectives"))?;
        Ok(())
    }

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
            .executor()
            .query_typed(
                sql::PENDING_PAIRS,
                &[
                    (&instance.as_uuid(), Type::UUID),
                    (&window, Type::INT8),
                    (&limit, Type::INT8),
                    (&max_delay, Type::INT8),
                    (&names, Type::TEXT_ARRAY),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "listing pending perspective pairs"))?;
        rows.iter()
            .map(|row| {
                let name: String = row.try_get(1).map_err(decode_error)?;
                let pending: i64 = row.try_get(2).map_err(decode_error)?;
                Ok(PendingPair {
                    stream_id: StreamId::from_uuid(row.try_get(0).map_err(decode_error)?),
                    perspective: stored_name(name)?,
                    pending: stored_count(pending)?,
                    rewind: row.try_get(3).map_err(decode_error)?,
                })
            })
            .collect()
    }

    async fn claim(
        &self,
        tx: &T,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        max_events: usize,
        debounce: RewindDebounce,
    ) -> Result<Claim> {
        if max_events == 0 {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "a claim must ask for at least one event",
            ));
        }
        let max_events = i64::try_from(max_events).unwrap_or(i64::MAX);
        let (window, max_delay) = (micros(debounce.window)?, micros(debounce.max_delay)?);
        let rows = tx
            .executor()
            .query_typed(
                sql::CLAIM,
                &[
                    (&stream_id.as_uuid(), Type::UUID),
                    (&perspective.as_str(), Type::TEXT),
                    (&max_events, Type::INT8),
                    (&window, Type::INT8),
                    (&max_delay, Type::INT8),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "claiming a perspective pair"))?;
        let Some((header, event_rows)) = rows.split_first() else {
            return Err(Error::new(ErrorKind::Backend, "a claim returned no row"));
        };
        let outcome: Option<String> = header.try_get(0).map_err(decode_error)?;
        match outcome.as_deref() {
            Some("busy") => Ok(Claim::Busy),
            Some("idle") => Ok(Claim::Idle),
            Some("rewind") => Ok(Claim::Rewind {
                cursor: decode_cursor(header, CLAIM_CURSOR_AT, stream_id, perspective)?,
            }),
            Some("apply") if event_rows.is_empty() => Ok(Claim::Idle),
            Some("apply") => Ok(Claim::Apply {
                cursor: decode_cursor(header, CLAIM_CURSOR_AT, stream_id, perspective)?,
                state: header.try_get(CLAIM_STATE_AT).map_err(decode_error)?,
                events: event_rows
                    .iter()
                    .map(|row| crate::decode(row, CLAIM_EVENT_AT, stream_id))
                    .collect::<Result<_>>()?,
            }),
            other => Err(Error::new(
                ErrorKind::Backend,
                format!("a claim returned an unknown outcome {other:?}"),
            )),
        }
    }

    async fn commit_state(&self, tx: &T, commit: &StateCommit) -> Result<i64> {
        check_json(&commit.state)?;
        let (holder, epoch) =
            fence_params(commit.fence.as_ref(), commit.stream_id, &commit.perspective)?;
        let applied_count = count_param(commit.applied_count)?;
        let row = tx
            .executor()
            .query_typed_one(
                sql::COMMIT,
                &[
                    (&commit.stream_id.as_uuid(), Type::UUID),
                    (&commit.perspective.as_str(), Type::TEXT),
                    (&commit.expected_revision, Type::INT8),
                    (&commit.state, Type::JSONB),
                    (&commit.last_event_id, Type::UUID),
                    (&applied_count, Type::INT8),
                    (&commit.applied_events, Type::UUID_ARRAY),
                    (&commit.rewound_from, Type::UUID),
                    (&commit.snapshot, Type::BOOL),
                    (&self.keep_snapshots, Type::INT4),
                    (&holder, Type::UUID),
                    (&epoch, Type::INT8),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "committing a perspective state"))?;
        let outcome: String = row.try_get(0).map_err(decode_error)?;
        let revision: Option<i64> = row.try_get(1).map_err(decode_error)?;
        match (outcome.as_str(), revision) {
            ("committed", Some(revision)) => Ok(revision),
            ("conflict", found) => Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "stream {} perspective {}: expected revision {}, the cursor is at {}",
                    commit.stream_id,
                    commit.perspective,
                    commit.expected_revision,
                    found.map_or_else(|| "?".to_owned(), |r| r.to_string())
                ),
            )),
            ("no_cursor", _) => Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "stream {} perspective {}: the cursor no longer exists",
                    commit.stream_id, commit.perspective
                ),
            )),
            ("lease_lost", _) => Err(lease_lost()),
            (other, _) => Err(Error::new(
                ErrorKind::Backend,
                format!("a commit returned an unknown outcome {other:?}"),
            )),
        }
    }

    async fn cursor(
        &self,
        tx: &T,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<Option<Cursor>> {
        let row = tx
            .executor()
            .query_typed_opt(
                sql::CURSOR,
                &[
                    (&stream_id.as_uuid(), Type::UUID),
                    (&perspective.as_str(), Type::TEXT),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "reading a perspective cursor"))?;
        row.map(|row| decode_cursor(&row, 0, stream_id, perspective))
            .transpose()
    }

    async fn state(
        &self,
        tx: &T,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<Option<(Cursor, Option<serde_json::Value>)>> {
        let row = tx
            .executor()
            .query_typed_opt(
                sql::STATE,
                &[
                    (&stream_id.as_uuid(), Type::UUID),
                    (&perspective.as_str(), Type::TEXT),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "reading a perspective state"))?;
        row.map(|row| {
            Ok((
                decode_cursor(&row, 0, stream_id, perspective)?,
                row.try_get(CURSOR_COLUMNS).map_err(decode_error)?,
            ))
        })
        .transpose()
    }

    async fn pending_events(
        &self,
        tx: &T,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<Vec<Uuid>> {
        let rows = tx
            .executor()
            .query_typed(
                sql::PENDING_EVENTS,
                &[
                    (&stream_id.as_uuid(), Type::UUID),
                    (&perspective.as_str(), Type::TEXT),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "reading a pair's pending work"))?;
        rows.iter()
            .map(|row| row.try_get(0).map_err(decode_error))
            .collect()
    }

    async fn stream_events(
        &self,
        tx: &T,
        stream_id: StreamId,
        after: Option<Uuid>,
    ) -> Result<Vec<RecordedEvent>> {
        let rows = tx
            .executor()
            .query_typed(
                sql::STREAM_EVENTS,
                &[(&stream_id.as_uuid(), Type::UUID), (&after, Type::UUID)],
            )
            .await
            .map_err(|e| statement_error(e, "reading a stream in event-id order"))?;
        rows.iter()
            .map(|row| crate::decode(row, 0, stream_id))
            .collect()
    }

    async fn snapshot_before(
        &self,
        tx: &T,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        before: Uuid,
    ) -> Result<Option<Snapshot>> {
        let row = tx
            .executor()
            .query_typed_opt(
                sql::SNAPSHOT_BEFORE,
                &[
                    (&stream_id.as_uuid(), Type::UUID),
                    (&perspective.as_str(), Type::TEXT),
                    (&before, Type::UUID),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "reading a perspective snapshot"))?;
        row.map(|row| {
            let applied: i64 = row.try_get(2).map_err(decode_error)?;
            Ok(Snapshot {
                event_id: row.try_get(0).map_err(decode_error)?,
                state: row.try_get(1).map_err(decode_error)?,
                applied_count: stored_count(applied)?,
            })
        })
        .transpose()
    }

    async fn save_snapshot(
        &self,
        tx: &T,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        expected_revision: i64,
        fence: Option<&LeaseId>,
    ) -> Result<bool> {
        let (holder, epoch) = fence_params(fence, stream_id, perspective)?;
        let row = tx
            .executor()
            .query_typed_one(
                sql::SAVE_SNAPSHOT,
                &[
                    (&stream_id.as_uuid(), Type::UUID),
                    (&perspective.as_str(), Type::TEXT),
                    (&expected_revision, Type::INT8),
                    (&self.keep_snapshots, Type::INT4),
                    (&holder, Type::UUID),
                    (&epoch, Type::INT8),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "saving a perspective snapshot"))?;
        let outcome: String = row.try_get(0).map_err(decode_error)?;
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

    async fn request_rewind(
        &self,
        tx: &T,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        from: Option<Uuid>,
    ) -> Result<bool> {
        let from = from.unwrap_or(Uuid::nil());
        let row = tx
            .executor()
            .query_typed_opt(
                sql::REQUEST_REWIND,
                &[
                    (&stream_id.as_uuid(), Type::UUID),
                    (&perspective.as_str(), Type::TEXT),
                    (&from, Type::UUID),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "requesting a rewind"))?;
        Ok(row.is_some())
    }

    async fn record_failure(
        &self,
        tx: &T,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        error: &str,
    ) -> Result<()> {
        // Text cannot hold U+0000; the message is diagnostics, so it is kept readable rather
        // than refused (a failure must always be recordable).
        let error = error.replace('\0', "\u{FFFD}");
        tx.executor()
            .query_typed(
                sql::RECORD_FAILURE,
                &[
                    (&stream_id.as_uuid(), Type::UUID),
                    (&perspective.as_str(), Type::TEXT),
                    (&error, Type::TEXT),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "recording a perspective failure"))?;
        Ok(())
    }

    async fn purge(
        &self,
        tx: &T,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        fence: Option<&LeaseId>,
    ) -> Result<()> {
        let (holder, epoch) = fence_params(fence, stream_id, perspective)?;
        let row = tx
            .executor()
            .query_typed_one(
                sql::PURGE,
                &[
                    (&stream_id.as_uuid(), Type::UUID),
                    (&perspective.as_str(), Type::TEXT),
                    (&holder, Type::UUID),
                    (&epoch, Type::INT8),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "purging a perspective pair"))?;
        let outcome: String = row.try_get(0).map_err(decode_error)?;
        match outcome.as_str() {
            "purged" | "no_cursor" => Ok(()),
            "lease_lost" => Err(lease_lost()),
            other => Err(Error::new(
                ErrorKind::Backend,
                format!("a purge returned an unknown outcome {other:?}"),
            )),
        }
    }

    async fn ensure_cursor(
        &self,
        tx: &T,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<bool> {
        let row = tx
            .executor()
            .query_typed_opt(
                sql::ENSURE_CURSOR,
                &[
                    (&stream_id.as_uuid(), Type::UUID),
                    (&perspective.as_str(), Type::TEXT),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "creating a perspective cursor"))?;
        Ok(row.is_some())
    }

    async fn delete_cursor(
        &self,
        tx: &T,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<bool> {
        let row = tx
            .executor()
            .query_typed_opt(
                sql::DELETE_CURSOR,
                &[
                    (&stream_id.as_uuid(), Type::UUID),
                    (&perspective.as_str(), Type::TEXT),
                ],
            )
            .await
            .map_err(|e| statement_error(e, "deleting a perspective cursor"))?;
        Ok(row.is_some())
    }
}

/// The cursor columns of [`sql`] starting at `at`.
fn decode_cursor(
    row: &Row,
    at: usize,
    stream_id: StreamId,
    perspective: &PerspectiveName,
) -> Result<Cursor> {
    let trigger: Option<Uuid> = row.try_get(at + 3).map_err(decode_error)?;
    let flagged_at: Option<OffsetDateTime> = row.try_get(at + 4).map_err(decode_error)?;
    let first_flagged_at: Option<OffsetDateTime> = row.try_get(at + 5).map_err(decode_error)?;
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
    let applied: i64 = row.try_get(at + 2).map_err(decode_error)?;
    let failures: i32 = row.try_get(at + 7).map_err(decode_error)?;
    let holder: Option<Uuid> = row.try_get(at + 9).map_err(decode_error)?;
    let reason: Option<String> = row.try_get(at + 10).map_err(decode_error)?;
    let mut cursor = Cursor::new(stream_id, perspective.clone());
    cursor.last_event_id = row.try_get(at).map_err(decode_error)?;
    cursor.revision = row.try_get(at + 1).map_err(decode_error)?;
    cursor.applied_count = stored_count(applied)?;
    cursor.rewind = rewind;
    cursor.error = row.try_get(at + 6).map_err(decode_error)?;
    cursor.failures = u32::try_from(failures)
        .map_err(|_| Error::new(ErrorKind::Backend, "a stored failure count is negative"))?;
    cursor.latest_snapshot = row.try_get(at + 8).map_err(decode_error)?;
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
        expires_at: row.try_get(at + 11).map_err(decode_error)?,
        epoch: LeaseEpoch::new(row.try_get(at + 12).map_err(decode_error)?),
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

fn decode_error(err: tokio_postgres::Error) -> Error {
    Error::new(ErrorKind::Backend, "decoding a perspective-store row").with_source(err)
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
        // lockstep_perspective_claim: outcome, 13 cursor columns, state, 5 event columns.
        assert_eq!(CLAIM_STATE_AT, 14);
        assert_eq!(CLAIM_EVENT_AT, 15);
    }

    #[allow(dead_code)]
    fn implemented_for_owned_and_borrowed_transactions<'t>()
    where
        PgPerspectiveStore: PerspectiveStore<lockstep_pg::PgTransaction>
            + PerspectiveStore<tokio_postgres::Transaction<'t>>,
    {
    }
}
