//! Aggregate snapshots: the state of an aggregate saved at a version, so that a command loads
//! the latest snapshot and the events after it instead of folding the whole stream.
//!
//! A [`crate::Decider`] declares a [`SnapshotPolicy`] ([`crate::Decider::snapshots`]): how
//! many events a load may fold before the command runner saves the state again, how the state
//! is written to JSON and read back, and the **schema version of the state's shape**. A
//! snapshot is kept per aggregate type, stream and schema version ([`SnapshotKey`]): a decider
//! whose state changed shape declares a new version and never reads the older snapshots (an
//! instance of the previous build, still running during a rolling deploy, keeps reading and
//! writing its own). `lockstep snapshots drop` deletes the ones no build reads any more.
//!
//! # The contract of a [`SnapshotStore`]
//!
//! - A snapshot is saved **in the transaction** of the events it folds, so it commits with them
//!   or not at all; a snapshot is never ahead of the events the transaction can see.
//! - [`SnapshotStore::save_snapshot`] keeps the newest: it stores the snapshot unless one at
//!   the same or a later version is there already.
//! - [`SnapshotStore::load_from_snapshot`] reads the snapshot and the events after it in one
//!   step (Postgres: one statement, also with the write lock first), and ignores a snapshot
//!   whose version is past the stream's last event (written by other means): it then returns
//!   the whole stream.
//!
//! A snapshot is a cache of the fold: deleting every snapshot changes no answer, only how much
//! a load reads.

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use uuid::Uuid;

use crate::decider::Decider;
use crate::error::{Error, ErrorKind, Result, ValidationError};
use crate::event_store::{EventStore, NewEvent, RecordedEvent};
use crate::ids::{AggregateType, StreamId};
use crate::resource_key::ResourceKey;

/// When and how a decider's state is snapshotted (see the [module docs](self)).
pub struct SnapshotPolicy<S> {
    every: u32,
    schema_version: u32,
    encode: fn(&S) -> Result<serde_json::Value>,
    decode: fn(serde_json::Value) -> Result<S>,
}

impl<S> Clone for SnapshotPolicy<S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S> Copy for SnapshotPolicy<S> {}

impl<S> std::fmt::Debug for SnapshotPolicy<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotPolicy")
            .field("every", &self.every)
            .field("schema_version", &self.schema_version)
            .finish_non_exhaustive()
    }
}

impl<S> SnapshotPolicy<S> {
    /// Saves the state whenever a command's load folded, with the command's own events, `every`
    /// events or more since the latest snapshot (0 and 1: after every command); the state is
    /// written by `encode` and read back by `decode`. Schema version 1.
    pub fn new(
        every: u32,
        encode: fn(&S) -> Result<serde_json::Value>,
        decode: fn(serde_json::Value) -> Result<S>,
    ) -> SnapshotPolicy<S> {
        SnapshotPolicy {
            every: every.max(1),
            schema_version: 1,
            encode,
            decode,
        }
    }

    /// The schema version of the state's shape (default 1). Raise it when the state's shape
    /// changes: snapshots of other versions are not read. A version of 0 or above
    /// [`NewEvent::MAX_SCHEMA_VERSION`] makes every command of the decider fail with
    /// [`ValidationError::SchemaVersionOutOfRange`] (nothing is appended).
    #[must_use]
    pub fn schema_version(mut self, version: u32) -> SnapshotPolicy<S> {
        self.schema_version = version;
        self
    }

    /// How many events a load may fold before the state is saved again.
    pub fn every(&self) -> u32 {
        self.every
    }

    /// The state's schema version.
    pub fn state_schema_version(&self) -> u32 {
        self.schema_version
    }

    /// Whether a command that folded `folded` events since the latest snapshot (its own
    /// included) saves one.
    pub fn is_due(&self, folded: u64) -> bool {
        folded >= u64::from(self.every)
    }

    /// The state as stored.
    pub fn encode(&self, state: &S) -> Result<serde_json::Value> {
        (self.encode)(state)
    }

    /// A stored state read back.
    pub fn decode(&self, state: serde_json::Value) -> Result<S> {
        (self.decode)(state)
    }

    /// The key of aggregate `stream_id`'s snapshot of `aggregate_type` under this policy.
    pub fn key(&self, aggregate_type: &AggregateType, stream_id: StreamId) -> Result<SnapshotKey> {
        SnapshotKey::new(aggregate_type.clone(), stream_id, self.schema_version)
    }
}

impl<S: Serialize + DeserializeOwned> SnapshotPolicy<S> {
    /// [`SnapshotPolicy::new`] with the state written and read by serde (`serde_json`).
    pub fn json(every: u32) -> SnapshotPolicy<S> {
        SnapshotPolicy::new(every, to_json::<S>, from_json::<S>)
    }
}

fn to_json<S: Serialize>(state: &S) -> Result<serde_json::Value> {
    serde_json::to_value(state).map_err(|e| {
        Error::new(ErrorKind::InvalidInput, "the state does not serialize").with_source(e)
    })
}

fn from_json<S: DeserializeOwned>(state: serde_json::Value) -> Result<S> {
    serde_json::from_value(state).map_err(|e| {
        Error::new(ErrorKind::InvalidInput, "the snapshot does not deserialize").with_source(e)
    })
}

/// Which snapshot: an aggregate type, a stream, and the schema version of the state's shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SnapshotKey {
    aggregate_type: AggregateType,
    stream_id: StreamId,
    schema_version: u32,
}

impl SnapshotKey {
    /// The key; a schema version of 0 or above [`NewEvent::MAX_SCHEMA_VERSION`] is refused.
    pub fn new(
        aggregate_type: AggregateType,
        stream_id: StreamId,
        schema_version: u32,
    ) -> Result<SnapshotKey> {
        if schema_version == 0 || schema_version > NewEvent::MAX_SCHEMA_VERSION {
            return Err(ValidationError::SchemaVersionOutOfRange {
                version: u64::from(schema_version),
            }
            .into());
        }
        Ok(SnapshotKey {
            aggregate_type,
            stream_id,
            schema_version,
        })
    }

    /// The aggregate type.
    pub fn aggregate_type(&self) -> &AggregateType {
        &self.aggregate_type
    }

    /// The stream.
    pub fn stream_id(&self) -> StreamId {
        self.stream_id
    }

    /// The state's schema version.
    pub fn schema_version(&self) -> u32 {
        self.schema_version
    }
}

/// A state saved at a stream version.
#[derive(Debug, Clone, PartialEq)]
pub struct AggregateSnapshot {
    /// The version of the last event the state is the fold of (from 1).
    pub version: u64,
    /// The state, as the policy's `encode` wrote it.
    pub state: serde_json::Value,
}

/// A stream as [`SnapshotStore::load_from_snapshot`] read it: the latest snapshot (if any) and
/// the events after it, in version order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoadedStream {
    /// The snapshot the events follow (`None`: the events are the whole stream).
    pub snapshot: Option<AggregateSnapshot>,
    /// The events after the snapshot, through upcasters like every load.
    pub events: Vec<RecordedEvent>,
}

impl LoadedStream {
    /// The stream's version: the last event's, else the snapshot's, else 0.
    pub fn version(&self) -> u64 {
        self.events
            .last()
            .map(|e| e.version)
            .or(self.snapshot.as_ref().map(|s| s.version))
            .unwrap_or(0)
    }
}

/// The lock [`SnapshotStore::load_from_snapshot`] takes first: a key and how long to wait (as
/// [`EventStore::load_locked`]).
#[derive(Debug, Clone, Copy)]
pub struct LockFirst<'a> {
    /// The lock's key (for an aggregate, [`crate::aggregate_key`]).
    pub key: &'a ResourceKey,
    /// How long to wait (`None`: without limit).
    pub timeout: Option<Duration>,
}

/// Aggregate snapshots beside an event store, on the same transactions (see the
/// [module docs](self)).
pub trait SnapshotStore<Tx: ?Sized + Sync>: EventStore<Tx> {
    /// The latest snapshot under `key` that `tx` sees and the stream's events after it (every
    /// event when there is none), in one step; with `lock`, the lock is taken first, as
    /// [`EventStore::load_locked`] takes it, and the read sees what its previous holder
    /// committed. A snapshot past the stream's last event is ignored.
    fn load_from_snapshot<'a>(
        &'a self,
        tx: &'a Tx,
        key: &'a SnapshotKey,
        lock: Option<LockFirst<'a>>,
    ) -> impl Future<Output = Result<LoadedStream>> + Send + 'a;

    /// Saves `snapshot` under `key` on `tx` unless one at the same or a later version is
    /// stored; `true` when it was stored. A version of 0 or above `i64::MAX`, and a state that
    /// cannot be stored (see [`crate::json`]), are [`ErrorKind::InvalidInput`] and change
    /// nothing.
    fn save_snapshot<'a>(
        &'a self,
        tx: &'a Tx,
        key: &'a SnapshotKey,
        snapshot: &'a AggregateSnapshot,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;

    /// Deletes the snapshots of `aggregate_type` whose schema version is below
    /// `below_schema_version` (`None`: all of them); returns how many.
    fn delete_snapshots<'a>(
        &'a self,
        tx: &'a Tx,
        aggregate_type: &'a AggregateType,
        below_schema_version: Option<u32>,
    ) -> impl Future<Output = Result<u64>> + Send + 'a;
}

/// The checks of [`SnapshotStore::save_snapshot`] that need no database.
pub fn check_snapshot(snapshot: &AggregateSnapshot) -> Result<()> {
    if snapshot.version == 0 || snapshot.version > i64::MAX as u64 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "a snapshot's version must be from 1 to {}, not {}",
                i64::MAX,
                snapshot.version
            ),
        ));
    }
    crate::json::check_storable(&snapshot.state, "snapshot state")
}

/// An aggregate's state as a runner loads it for a decision ([`load_aggregate`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedAggregate<S> {
    /// The state through `version`.
    pub state: S,
    /// The stream's version the state is the fold of (0: no event).
    pub version: u64,
    /// How many events were folded since the latest snapshot (every event when none was
    /// used): what [`SnapshotPolicy::is_due`] is asked with, plus the decision's own events.
    pub folded: u64,
}

/// Loads aggregate `id` (stream `StreamId::from_uuid(id)`) for a decision, as the command
/// runner and the combiner do: with `lock` first when given, then — when the decider declares
/// a [`SnapshotPolicy`] — its latest snapshot and the events after it, folded onto the
/// snapshot's state; otherwise the whole stream folded from [`Decider::initial_state`]. A
/// snapshot the policy cannot decode (its state changed shape without a new schema version)
/// is not used: the whole stream is folded instead, and the next save replaces it.
pub async fn load_aggregate<Tx, St, D>(
    decider: &D,
    store: &St,
    tx: &Tx,
    id: Uuid,
    lock: Option<LockFirst<'_>>,
) -> Result<LoadedAggregate<D::State>>
where
    Tx: ?Sized + Sync,
    St: SnapshotStore<Tx>,
    D: Decider,
{
    let stream = StreamId::from_uuid(id);
    let whole = |events: Vec<RecordedEvent>| -> Result<LoadedAggregate<D::State>> {
        Ok(LoadedAggregate {
            version: events.last().map_or(0, |e| e.version),
            folded: events.len() as u64,
            state: decider.fold(id, &events)?,
        })
    };
    let Some(policy) = decider.snapshots() else {
        let events = match lock {
            Some(LockFirst { key, timeout }) => store.load_locked(tx, stream, key, timeout).await?,
            None => store.load(tx, stream).await?,
        };
        return whole(events);
    };
    let key = policy.key(decider.aggregate_type(), stream)?;
    let loaded = store.load_from_snapshot(tx, &key, lock).await?;
    let version = loaded.version();
    let Some(snapshot) = loaded.snapshot else {
        return whole(loaded.events);
    };
    match policy.decode(snapshot.state) {
        Ok(state) => Ok(LoadedAggregate {
            state: loaded.events.iter().try_fold(state, |state, event| {
                Ok::<_, Error>(decider.evolve(state, &decider.decode(event)?))
            })?,
            version,
            folded: loaded.events.len() as u64,
        }),
        // The lock (if any) is held already: a plain load sees the same stream.
        Err(_) => whole(store.load(tx, stream).await?),
    }
}

/// Saves `state` — aggregate `id`'s state through `version`, `folded` events after the latest
/// snapshot — on `tx` when the decider's [`SnapshotPolicy`] says it is due; `true` when a
/// snapshot was stored. Call it before the transaction's last write
/// ([`EventStore::append_at_commit`]): the snapshot then commits with the events it folds, or
/// not at all. A state the policy cannot encode fails with its error.
pub async fn save_snapshot_if_due<Tx, St, D>(
    decider: &D,
    store: &St,
    tx: &Tx,
    id: Uuid,
    version: u64,
    folded: u64,
    state: &D::State,
) -> Result<bool>
where
    Tx: ?Sized + Sync,
    St: SnapshotStore<Tx>,
    D: Decider,
{
    let Some(policy) = decider.snapshots() else {
        return Ok(false);
    };
    if version == 0 || !policy.is_due(folded) {
        return Ok(false);
    }
    let key = policy.key(decider.aggregate_type(), StreamId::from_uuid(id))?;
    let snapshot = AggregateSnapshot {
        version,
        state: policy.encode(state)?,
    };
    store.save_snapshot(tx, &key, &snapshot).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Balance {
        cents: i64,
    }

    #[test]
    fn a_json_policy_round_trips_the_state_and_says_when_it_is_due() {
        let policy = SnapshotPolicy::<Balance>::json(100).schema_version(3);
        assert_eq!(policy.every(), 100);
        assert!(!policy.is_due(99));
        assert!(policy.is_due(100));
        let stored = policy.encode(&Balance { cents: 5 }).expect("valid");
        assert_eq!(policy.decode(stored).expect("valid"), Balance { cents: 5 });
        let err = policy.decode(serde_json::json!("no")).expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert!(SnapshotPolicy::<Balance>::json(0).is_due(1));
        let ty = AggregateType::new("Account").expect("valid");
        let key = policy.key(&ty, StreamId::new_v7()).expect("valid");
        assert_eq!(key.schema_version(), 3);
    }

    #[test]
    fn keys_and_snapshots_out_of_range_are_refused() {
        let ty = AggregateType::new("Account").expect("valid");
        for bad in [0, NewEvent::MAX_SCHEMA_VERSION + 1] {
            let err = SnapshotPolicy::<Balance>::json(1)
                .schema_version(bad)
                .key(&ty, StreamId::new_v7())
                .expect_err("refused");
            assert!(matches!(
                err.validation(),
                Some(ValidationError::SchemaVersionOutOfRange { .. })
            ));
        }
        for version in [0, i64::MAX as u64 + 1] {
            let err = check_snapshot(&AggregateSnapshot {
                version,
                state: serde_json::json!({}),
            })
            .expect_err("refused");
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
        }
        let nul = AggregateSnapshot {
            version: 1,
            state: serde_json::json!("a\u{0}b"),
        };
        assert_eq!(
            check_snapshot(&nul).expect_err("refused").kind(),
            ErrorKind::InvalidInput
        );
    }

    #[test]
    fn a_loaded_stream_knows_its_version() {
        assert_eq!(LoadedStream::default().version(), 0);
        let loaded = LoadedStream {
            snapshot: Some(AggregateSnapshot {
                version: 7,
                state: serde_json::json!(1),
            }),
            events: vec![],
        };
        assert_eq!(loaded.version(), 7);
    }
}
