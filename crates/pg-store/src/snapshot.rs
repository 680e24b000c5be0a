//! Aggregate snapshots on PostgreSQL: [`SnapshotStore`] for [`PgEventStore`], in the table
//! `wh_aggregate_snapshots` (one row per stream, aggregate type and state schema version).
//!
//! - A load is one statement, `lockstep_load_from_snapshot`: the snapshot row by its primary
//!   key, then the events after it by the unique `(stream_id, version)` index — with the lock
//!   first when asked, as [`EventStore::load_locked`] takes it (the same queue, deadline and
//!   cancel-on-drop). A command on a stream of 10 000 events with a snapshot at 9 950 reads 51
//!   rows.
//! - A save is one `INSERT … ON CONFLICT DO UPDATE … WHERE` the stored version is older, so a
//!   snapshot never goes back; it row-locks the snapshot until the transaction ends, which
//!   writers of one aggregate serialize on anyway.

use lockstep_core::snapshot::check_snapshot;
use lockstep_core::{
    AggregateSnapshot, AggregateType, Error, ErrorKind, LoadedStream, LockFirst, Result,
    SnapshotKey, SnapshotStore,
};
use lockstep_pg::PgTransaction;
use lockstep_pg::driver::{Columns, Executor, query_opt};
use lockstep_pg::internal::{self, LockingTransaction, check_isolation};
#[cfg(feature = "sqlx")]
use lockstep_pg::sqlx::SqlxTransaction;

use crate::{PgEventStore, decode_error};

/// `$1` lock key (NULL: no lock), `$2` lock_timeout, `$3` stream, `$4` aggregate type, `$5`
/// schema version → refused isolation, snapshot state, then the event columns.
const LOAD_FROM_SNAPSHOT: &str = "SELECT refused_isolation, snapshot_state, event_id, version, \
     event_type, payload, recorded_at, schema_version \
     FROM lockstep_load_from_snapshot($1, $2, $3, $4, $5)";

/// Where the event columns of a [`LOAD_FROM_SNAPSHOT`] row start.
const EVENT_AT: usize = 2;

/// `$1` stream, `$2` aggregate type, `$3` schema version, `$4` version, `$5` state → one row
/// when stored.
const SAVE: &str = "INSERT INTO wh_aggregate_snapshots AS s \
     (stream_id, aggregate_type, schema_version, version, state) VALUES ($1, $2, $3, $4, $5) \
     ON CONFLICT (stream_id, aggregate_type, schema_version) DO UPDATE \
     SET version = excluded.version, state = excluded.state, saved_at = clock_timestamp() \
     WHERE s.version < excluded.version \
     RETURNING 1";

/// `$1` aggregate type, `$2` schema version bound (NULL: every version).
const DELETE: &str = "WITH gone AS (DELETE FROM wh_aggregate_snapshots \
     WHERE aggregate_type = $1 AND ($2::integer IS NULL OR schema_version < $2) RETURNING 1) \
     SELECT count(*) FROM gone";

impl SnapshotStore<PgTransaction> for PgEventStore {
    async fn load_from_snapshot(
        &self,
        tx: &PgTransaction,
        key: &SnapshotKey,
        lock: Option<LockFirst<'_>>,
    ) -> Result<LoadedStream> {
        self.load_snapshot_with(tx, key, lock).await
    }

    async fn save_snapshot(
        &self,
        tx: &PgTransaction,
        key: &SnapshotKey,
        snapshot: &AggregateSnapshot,
    ) -> Result<bool> {
        save_with(tx, key, snapshot).await
    }

    async fn delete_snapshots(
        &self,
        tx: &PgTransaction,
        aggregate_type: &AggregateType,
        below_schema_version: Option<u32>,
    ) -> Result<u64> {
        delete_with(tx, aggregate_type, below_schema_version).await
    }
}

/// The snapshot store on an sqlx transaction: the same statements, decoding and error mapping.
#[cfg(feature = "sqlx")]
impl SnapshotStore<SqlxTransaction> for PgEventStore {
    async fn load_from_snapshot(
        &self,
        tx: &SqlxTransaction,
        key: &SnapshotKey,
        lock: Option<LockFirst<'_>>,
    ) -> Result<LoadedStream> {
        self.load_snapshot_with(tx, key, lock).await
    }

    async fn save_snapshot(
        &self,
        tx: &SqlxTransaction,
        key: &SnapshotKey,
        snapshot: &AggregateSnapshot,
    ) -> Result<bool> {
        save_with(tx, key, snapshot).await
    }

    async fn delete_snapshots(
        &self,
        tx: &SqlxTransaction,
        aggregate_type: &AggregateType,
        below_schema_version: Option<u32>,
    ) -> Result<u64> {
        delete_with(tx, aggregate_type, below_schema_version).await
    }
}

impl PgEventStore {
    /// [`SnapshotStore::load_from_snapshot`] on either driver's transaction: one statement,
    /// with the lock first (under `acquire_with`: the queue, the deadline, cancel-on-drop)
    /// when asked.
    async fn load_snapshot_with<T: LockingTransaction + ?Sized>(
        &self,
        tx: &T,
        key: &SnapshotKey,
        lock: Option<LockFirst<'_>>,
    ) -> Result<LoadedStream> {
        let stream = key.stream_id();
        let schema_version = schema_int(key.schema_version())?;
        let aggregate_type = key.aggregate_type().as_str();
        let rows = match lock {
            None => tx
                .query(
                    LOAD_FROM_SNAPSHOT,
                    &[
                        &None::<i64>,
                        &None::<String>,
                        &stream.as_uuid(),
                        &aggregate_type,
                        &schema_version,
                    ],
                )
                .await
                .map_err(|e| {
                    internal::db_statement_error(e, &format!("loading the snapshot of {stream}"))
                })?,
            Some(LockFirst {
                key: lock_key,
                timeout,
            }) => {
                internal::acquire_with(self.queue(), tx, lock_key, timeout, |call| async move {
                    let rows = tx
                        .query(
                            LOAD_FROM_SNAPSHOT,
                            &[
                                &Some(call.advisory_key),
                                &call.lock_timeout,
                                &stream.as_uuid(),
                                &aggregate_type,
                                &schema_version,
                            ],
                        )
                        .await
                        .map_err(|e| {
                            internal::db_statement_error(
                                e,
                                &format!("locking and loading the snapshot of {stream}"),
                            )
                        })?;
                    if let Some(first) = rows.first() {
                        let refused: Option<String> = first.get(0).map_err(decode_error)?;
                        check_isolation(refused.as_deref(), lock_key)?;
                    }
                    Ok(rows)
                })
                .await?
            }
        };
        self.decode_loaded(&rows, key)
    }
}

/// [`SnapshotStore::save_snapshot`] on either driver's transaction.
async fn save_with<T: Executor + ?Sized>(
    tx: &T,
    key: &SnapshotKey,
    snapshot: &AggregateSnapshot,
) -> Result<bool> {
    check_snapshot(snapshot)?;
    let version = i64::try_from(snapshot.version)
        .map_err(|_| Error::new(ErrorKind::InvalidInput, "a snapshot's version is too large"))?;
    let stored = query_opt(
        tx,
        SAVE,
        &[
            &key.stream_id().as_uuid(),
            &key.aggregate_type().as_str(),
            &schema_int(key.schema_version())?,
            &version,
            &snapshot.state,
        ],
    )
    .await
    .map_err(|e| {
        internal::db_statement_error(e, &format!("saving the snapshot of {}", key.stream_id()))
    })?;
    Ok(stored.is_some())
}

/// [`SnapshotStore::delete_snapshots`] on either driver's transaction.
async fn delete_with<T: Executor + ?Sized>(
    tx: &T,
    aggregate_type: &AggregateType,
    below_schema_version: Option<u32>,
) -> Result<u64> {
    let below = below_schema_version.map(schema_int).transpose()?;
    let rows = tx
        .query(DELETE, &[&aggregate_type.as_str(), &below])
        .await
        .map_err(|e| {
            internal::db_statement_error(e, &format!("deleting the snapshots of {aggregate_type}"))
        })?;
    let deleted: i64 = match rows.first() {
        Some(row) => row.get(0).map_err(decode_error)?,
        None => 0,
    };
    Ok(u64::try_from(deleted).unwrap_or(0))
}

impl PgEventStore {
    /// The snapshot row (if first) and the events after it.
    fn decode_loaded<R: Columns>(&self, rows: &[R], key: &SnapshotKey) -> Result<LoadedStream> {
        let mut loaded = LoadedStream::default();
        let mut rows = rows.iter().peekable();
        if let Some(first) = rows.peek() {
            let state: Option<serde_json::Value> = first.column(1).map_err(decode_error)?;
            if let Some(state) = state {
                let version: i64 = first.column(EVENT_AT + 1).map_err(decode_error)?;
                loaded.snapshot = Some(AggregateSnapshot {
                    version: u64::try_from(version).map_err(|_| {
                        Error::new(
                            ErrorKind::Backend,
                            "a stored snapshot's version is negative",
                        )
                    })?,
                    state,
                });
                rows.next();
            }
        }
        loaded.events = rows
            .map(|row| crate::decode(row, EVENT_AT, key.stream_id(), &self.upcasters))
            .collect::<Result<_>>()?;
        Ok(loaded)
    }
}

/// A schema version as the `integer` it is stored as (checked by [`SnapshotKey::new`] already;
/// a `u32` past `i32::MAX` cannot be one).
fn schema_int(version: u32) -> Result<i32> {
    i32::try_from(version).map_err(|_| {
        lockstep_core::ValidationError::SchemaVersionOutOfRange {
            version: u64::from(version),
        }
        .into()
    })
}
