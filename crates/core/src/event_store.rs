//! The event-store contract: append events to a stream with an expected version, load a stream
//! in version order — on the caller's unit-of-work transaction.
//!
//! Optimistic concurrency is intrinsic to [`EventStore::append`]: every event gets the next
//! version of its stream, `(stream_id, version)` is unique, and an append whose
//! [`ExpectedVersion`] no longer matches fails with [`ErrorKind::Conflict`] (retryable; details
//! in [`VersionConflict`]). The pessimistic per-aggregate write lock
//! ([`crate::AggregateWriteLock`]) only removes those conflicts on hot aggregates; it never
//! replaces the check.
//!
//! # Versions
//!
//! A stream's version is the number of events in it: an empty stream is at version 0 and the
//! first event has version 1. [`EventStore::append`] returns the version of the last event it
//! appended.
//!
//! # Transactions
//!
//! Like [`crate::DistributedLock`], the transaction is a type parameter: the testkit's
//! in-memory store runs on its fake transactions, the Postgres store on a Postgres transaction.
//! Both behave like READ COMMITTED: a transaction sees what other transactions committed before
//! each call, plus its own appends; its appends become visible to others at commit and vanish
//! at rollback.
//!
//! A failed append (a conflict, a deadlock, a lost connection) leaves the transaction
//! **aborted**, as a failed statement does in PostgreSQL: every later call on it fails with
//! [`ErrorKind::TransactionAborted`] and committing it rolls it back. Retry in a new transaction
//! (see [`crate::retry`]).
//!
//! # Lock first, then load — in one step
//!
//! [`EventStore::load_locked`] takes the transaction-scoped lock on a key (the lock a
//! [`crate::DistributedLock`] of the same backend takes, with the same timeout and abort
//! semantics) and then loads the stream, as one operation. A backend that can pipeline sends
//! both statements together (Postgres: one round trip instead of two), and the load always
//! runs after the lock is held, so it sees what the previous holder committed.
//!
//! # The last write, with the commit
//!
//! [`EventStore::append_at_commit`] is an append that a backend may hold back and send together
//! with the transaction's `COMMIT` (Postgres: one round trip for both). It is meant for a unit
//! of work's last write — lock and load, decide, append, commit — and shortens the time a
//! per-aggregate lock is held by a round trip. Its outcome is the commit's: a conflict is
//! reported by the commit (a retryable [`ErrorKind::Conflict`], the transaction rolled back),
//! so [`crate::TransactionSource::transaction_with_retry`] retries it like any other conflict.
//! A backend that cannot hold it back appends at once (the provided implementation), which is
//! the same contract with the error reported earlier.
//!
//! ```
//! use lockstep_core::{ExpectedVersion, NewEvent};
//!
//! let event = NewEvent::new("StockReserved", serde_json::json!({ "quantity": 2 }))?;
//! assert_eq!(ExpectedVersion::Exact(0), ExpectedVersion::NoStream.into_exact());
//! # let _ = event;
//! # Ok::<(), lockstep_core::Error>(())
//! ```

use std::fmt;
use std::future::Future;
use std::time::Duration;

use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::{BoxError, Error, ErrorKind, Result, ValidationError};
use crate::ids::StreamId;
use crate::resource_key::ResourceKey;

/// What the appender believes the stream's current version to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpectedVersion {
    /// No check: append after whatever the stream holds. Two concurrent `Any` appends to one
    /// stream can still conflict (both pick the same next version; the second one fails).
    Any,
    /// The stream must be empty (version 0).
    NoStream,
    /// The stream must be at exactly this version (0 = empty).
    Exact(u64),
}

impl ExpectedVersion {
    /// `NoStream` as `Exact(0)`; `Any` and `Exact` unchanged.
    pub fn into_exact(self) -> ExpectedVersion {
        match self {
            ExpectedVersion::NoStream => ExpectedVersion::Exact(0),
            other => other,
        }
    }

    /// The version the stream must be at, or `None` for [`ExpectedVersion::Any`].
    pub fn as_version(self) -> Option<u64> {
        match self {
            ExpectedVersion::Any => None,
            ExpectedVersion::NoStream => Some(0),
            ExpectedVersion::Exact(v) => Some(v),
        }
    }
}

impl fmt::Display for ExpectedVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExpectedVersion::Any => f.write_str("any version"),
            ExpectedVersion::NoStream => f.write_str("no stream"),
            ExpectedVersion::Exact(v) => write!(f, "version {v}"),
        }
    }
}

/// An event to append: its id, type name, JSON payload and the schema version of the payload's
/// shape (1 unless set with [`NewEvent::with_schema_version`]; see [`crate::upcast`]).
///
/// The id is a fresh UUIDv7 unless the caller chooses one ([`NewEvent::with_id`]: imported
/// history, offline clients, replication). Perspectives apply a stream's events in event-id
/// order, so an event whose chosen id sorts before events already applied is a late arrival
/// (see [`crate::perspective`]). Appending the same `NewEvent` twice writes it once: the second
/// append fails on the event's id (see [`EventStore::append`]).
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    event_id: Uuid,
    event_type: String,
    payload: serde_json::Value,
    schema_version: u32,
}

impl NewEvent {
    /// The highest schema version an event can carry (it is stored as a Postgres `integer`).
    pub const MAX_SCHEMA_VERSION: u32 = i32::MAX as u32;

    /// The longest event type accepted, in characters.
    pub const MAX_TYPE_CHARS: usize = 200;

    /// The deepest nesting of arrays and objects a payload may have: [`crate::json::MAX_DEPTH`]
    /// (127), the deepest a load can read back.
    pub const MAX_PAYLOAD_DEPTH: usize = crate::json::MAX_DEPTH;

    /// Validates the type name (not blank, at most [`NewEvent::MAX_TYPE_CHARS`] characters,
    /// no NUL) and the payload (storable, see [`crate::json`]: nested at most
    /// [`NewEvent::MAX_PAYLOAD_DEPTH`] levels deep — [`ValidationError::JsonTooDeep`] — and no
    /// U+0000 in any string or key) and wraps the event. The payload is stored as given
    /// (Postgres: `jsonb`) and read back unchanged. A refused payload is dropped without
    /// recursing ([`crate::json::drop_iteratively`]), however deep code nested it.
    ///
    /// This is the only way to build a `NewEvent` ([`NewEvent::with_id`] changes only the id of
    /// one built here), so every event an [`EventStore`] is given has a payload it can load.
    pub fn new(event_type: impl Into<String>, payload: serde_json::Value) -> Result<NewEvent> {
        match Self::checked_type(event_type.into(), &payload) {
            Ok(event_type) => Ok(NewEvent {
                event_id: Uuid::now_v7(),
                event_type,
                payload,
                schema_version: 1,
            }),
            Err(err) => {
                // A refused payload may be nested far deeper than it may be stored (built in
                // code): dropping it recursively could overflow the stack.
                crate::json::drop_iteratively(payload);
                Err(err)
            }
        }
    }

    /// The checks of [`NewEvent::new`]: the type name, then the payload.
    fn checked_type(event_type: String, payload: &serde_json::Value) -> Result<String> {
        if event_type.trim().is_empty() {
            return Err(ValidationError::BlankEventType.into());
        }
        let chars = event_type.chars().count();
        if chars > Self::MAX_TYPE_CHARS {
            return Err(ValidationError::EventTypeTooLong {
                chars,
                max: Self::MAX_TYPE_CHARS,
            }
            .into());
        }
        if event_type.contains('\0') {
            return Err(ValidationError::ContainsNul {
                field: "event type",
            }
            .into());
        }
        // A payload nested deeper than a load can read would make the stream unloadable for
        // good; PostgreSQL's jsonb cannot store U+0000 in any string (key or value). Refuse both
        // here so every backend rejects the same event the same way, before anything is written.
        crate::json::check_storable(payload, "event payload")?;
        Ok(event_type)
    }

    /// Gives the event a caller-chosen id instead of a fresh UUIDv7. The nil UUID is refused
    /// (it stands for "from the start" in rewind requests).
    pub fn with_id(mut self, event_id: Uuid) -> Result<NewEvent> {
        if event_id.is_nil() {
            return Err(ValidationError::NilId { field: "event id" }.into());
        }
        self.event_id = event_id;
        Ok(self)
    }

    /// Marks the payload as having the shape of schema `version` of its event type (from 1, the
    /// default). Readers whose [`crate::Upcasters`] know a newer shape lift it on the way out;
    /// the stored payload is never rewritten. 0 and versions above
    /// [`NewEvent::MAX_SCHEMA_VERSION`] are refused ([`ValidationError::SchemaVersionOutOfRange`]).
    pub fn with_schema_version(mut self, version: u32) -> Result<NewEvent> {
        if version == 0 || version > Self::MAX_SCHEMA_VERSION {
            return Err(ValidationError::SchemaVersionOutOfRange {
                version: u64::from(version),
            }
            .into());
        }
        self.schema_version = version;
        Ok(self)
    }

    /// The event's id.
    pub fn event_id(&self) -> Uuid {
        self.event_id
    }

    /// The schema version of the payload's shape (1 unless set).
    pub fn schema_version(&self) -> u32 {
        self.schema_version
    }

    /// The event's type name.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// The event's payload.
    pub fn payload(&self) -> &serde_json::Value {
        &self.payload
    }
}

/// An event as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedEvent {
    /// The event's id: a UUIDv7 drawn when the [`NewEvent`] was built (sorts by creation time),
    /// or the id its appender chose.
    pub event_id: Uuid,
    /// The stream it belongs to.
    pub stream_id: StreamId,
    /// Its version in the stream, from 1.
    pub version: u64,
    /// Its type name.
    pub event_type: String,
    /// Its payload.
    pub payload: serde_json::Value,
    /// When it was recorded (the backend's clock; Postgres: `clock_timestamp()` at insert).
    pub recorded_at: OffsetDateTime,
    /// The schema version of `payload`'s shape: as appended ([`NewEvent::schema_version`]), or
    /// the version the reader's [`crate::Upcasters`] lifted it to. Stores read events back
    /// through their upcasters, so domain code sees the current shape of every type.
    pub schema_version: u32,
}

/// The details of an [`ErrorKind::Conflict`] from [`EventStore::append`], kept as the error's
/// [`source`](std::error::Error::source); read it back with [`version_conflict`].
#[derive(Debug)]
pub struct VersionConflict {
    stream_id: StreamId,
    expected: ExpectedVersion,
    actual: Option<u64>,
    source: Option<BoxError>,
}

impl VersionConflict {
    /// A conflict on `stream_id`: the append expected `expected`; the stream was at `actual`
    /// (when the backend knows).
    pub fn new(stream_id: StreamId, expected: ExpectedVersion, actual: Option<u64>) -> Self {
        VersionConflict {
            stream_id,
            expected,
            actual,
            source: None,
        }
    }

    /// Attaches the backend's own error (e.g. the unique violation).
    #[must_use]
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The stream appended to.
    pub fn stream_id(&self) -> StreamId {
        self.stream_id
    }

    /// What the append expected.
    pub fn expected(&self) -> ExpectedVersion {
        self.expected
    }

    /// The stream's version as the backend saw it, when known. `None` when another writer's
    /// append of the same version won while this one waited for it (the version is then at
    /// least the one this append tried to write).
    pub fn actual(&self) -> Option<u64> {
        self.actual
    }

    /// Wraps the conflict in an [`Error`] of kind [`ErrorKind::Conflict`].
    pub fn into_error(self) -> Error {
        Error::new(
            ErrorKind::Conflict,
            format!("appending to stream {}", self.stream_id),
        )
        .with_source(self)
    }
}

impl fmt::Display for VersionConflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.actual {
            Some(actual) => write!(
                f,
                "expected {}, but the stream is at version {actual}",
                self.expected
            ),
            None => write!(
                f,
                "expected {}, but another writer appended that version first",
                self.expected
            ),
        }
    }
}

impl std::error::Error for VersionConflict {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// The [`VersionConflict`] behind an error, if it is one.
pub fn version_conflict(err: &Error) -> Option<&VersionConflict> {
    std::error::Error::source(err)?.downcast_ref::<VersionConflict>()
}

/// Event streams with optimistic concurrency, on the unit-of-work transaction `Tx`.
pub trait EventStore<Tx: ?Sized + Sync>: Send + Sync {
    /// Every event of `stream_id` visible to `tx`, in version order (empty for a stream that
    /// does not exist).
    fn load<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
    ) -> impl Future<Output = Result<Vec<RecordedEvent>>> + Send + 'a;

    /// Takes the transaction-scoped lock on `key` for `tx` (waiting at most `timeout`, like
    /// [`crate::DistributedLock::acquire_for_transaction`], with the same errors), then loads
    /// `stream_id` — as one step, so that a backend can pipeline the two (see the module docs).
    /// The load always sees what the lock's previous holder committed.
    fn load_locked<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        key: &'a ResourceKey,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<Vec<RecordedEvent>>> + Send + 'a;

    /// Appends `events` (at least one) to `stream_id` if it is at `expected`, returning the
    /// stream's new version. Fails with [`ErrorKind::Conflict`] (details:
    /// [`version_conflict`]) when the stream is elsewhere or another transaction appended the
    /// same version first; the transaction is then aborted. An empty `events` is
    /// [`ErrorKind::InvalidInput`].
    fn append<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &'a [NewEvent],
    ) -> impl Future<Output = Result<u64>> + Send + 'a;

    /// Appends `events` like [`EventStore::append`], as the unit of work's **last write**: the
    /// backend may hold the append back and send it with the transaction's commit, in one round
    /// trip (see the module docs). Input that can be checked without the database (an empty
    /// `events`, an event id listed twice, a version out of range) is refused here with
    /// [`ErrorKind::InvalidInput`], changing nothing. Everything else — a version conflict
    /// included — may be reported either here or by the commit, which then rolls the
    /// transaction back and returns the append's error.
    ///
    /// Call it last: a held-back append is not visible to later loads on the same transaction,
    /// and statements run after it reach the server before it. Rolling back discards it.
    ///
    /// The provided implementation appends at once (nothing is held back); a backend that can
    /// pipeline overrides it, and so must every wrapper, delegating.
    fn append_at_commit<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &'a [NewEvent],
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let append = self.append(tx, stream_id, expected, events);
        async move { append.await.map(drop) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_are_retryable_and_keep_their_details() {
        let stream = StreamId::from_uuid(Uuid::nil());
        let err = VersionConflict::new(stream, ExpectedVersion::Exact(3), Some(5)).into_error();
        assert_eq!(err.kind(), ErrorKind::Conflict);
        assert!(err.is_retryable());
        let conflict = version_conflict(&err).expect("details");
        assert_eq!(conflict.expected(), ExpectedVersion::Exact(3));
        assert_eq!(conflict.actual(), Some(5));
        assert_eq!(
            err.to_string(),
            "concurrency conflict: appending to stream 00000000-0000-0000-0000-000000000000"
        );
        assert_eq!(
            conflict.to_string(),
            "expected version 3, but the stream is at version 5"
        );
    }

    #[test]
    fn event_types_are_validated() {
        for bad in ["", "  ", "a\0b"] {
            let err = NewEvent::new(bad, serde_json::Value::Null).expect_err("refused");
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
        }
        let blank = NewEvent::new(" ", serde_json::Value::Null).expect_err("refused");
        assert_eq!(blank.validation(), Some(&ValidationError::BlankEventType));
        let long = NewEvent::new("x".repeat(201), serde_json::Value::Null).expect_err("refused");
        assert_eq!(
            long.validation(),
            Some(&ValidationError::EventTypeTooLong {
                chars: 201,
                max: 200
            })
        );
        let nil = NewEvent::new("A", serde_json::Value::Null)
            .expect("valid")
            .with_id(Uuid::nil())
            .expect_err("refused");
        assert_eq!(
            nil.validation(),
            Some(&ValidationError::NilId { field: "event id" })
        );
        let ok = NewEvent::new("StockAdded", serde_json::json!({"q": 1})).expect("valid");
        assert_eq!(ok.event_type(), "StockAdded");
    }

    /// A payload far deeper than any parsed JSON can be (built in code) is refused, and
    /// refusing it — which drops it — does not overflow the stack of a normal test thread.
    #[test]
    fn a_payload_a_hundred_thousand_levels_deep_is_refused_without_overflowing_the_stack() {
        for level in [0, 1] {
            let deep = (0..100_000).fold(serde_json::json!("leaf"), |value, i| {
                if i % 2 == level {
                    serde_json::Value::Array(vec![value])
                } else {
                    let mut map = serde_json::Map::new();
                    map.insert("k".to_owned(), value);
                    serde_json::Value::Object(map)
                }
            });
            let err = NewEvent::new("Deep", deep).expect_err("refused");
            assert_eq!(
                err.validation(),
                Some(&ValidationError::JsonTooDeep {
                    field: "event payload",
                    max: 127
                })
            );
        }
    }

    #[test]
    fn expected_versions_normalize() {
        assert_eq!(ExpectedVersion::NoStream.as_version(), Some(0));
        assert_eq!(ExpectedVersion::Any.as_version(), None);
        assert_eq!(
            ExpectedVersion::Exact(4).into_exact(),
            ExpectedVersion::Exact(4)
        );
    }

    #[test]
    fn a_payload_with_a_nul_character_anywhere_is_refused() {
        for payload in [
            serde_json::json!({ "note": "a\u{0}b" }),
            serde_json::json!({ "a\u{0}": 1 }),
            serde_json::json!([[{ "deep": ["x\u{0}"] }]]),
        ] {
            let err = NewEvent::new("Noted", payload).expect_err("refused");
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
        }
        assert!(NewEvent::new("Noted", serde_json::json!({ "note": "ok" })).is_ok());
    }

    /// `depth` arrays and objects, alternating, around a string (a scalar has depth 0).
    fn nested(depth: usize) -> serde_json::Value {
        (0..depth).fold(serde_json::json!("leaf"), |value, level| {
            if level % 2 == 0 {
                serde_json::json!([1, value])
            } else {
                serde_json::json!({ "a": 1, "k": value })
            }
        })
    }

    /// Issue 19, item 2: a payload is refused at construction when it nests deeper than a load
    /// can read back (serde_json, which decodes the `jsonb` column, stops at 128 levels).
    #[test]
    fn the_deepest_payload_that_reads_back_is_accepted_and_one_level_deeper_is_refused() {
        assert_eq!(NewEvent::MAX_PAYLOAD_DEPTH, 127);
        let deepest = nested(NewEvent::MAX_PAYLOAD_DEPTH);
        let text = serde_json::to_vec(&deepest).expect("serializes");
        let back: serde_json::Value = serde_json::from_slice(&text).expect("reads back");
        assert_eq!(back, deepest);
        let too_deep = nested(NewEvent::MAX_PAYLOAD_DEPTH + 1);
        let text = serde_json::to_vec(&too_deep).expect("serializes");
        let err = serde_json::from_slice::<serde_json::Value>(&text).expect_err("unreadable");
        assert!(err.to_string().contains("recursion limit"), "{err}");

        let event = NewEvent::new("Deep", deepest.clone()).expect("the deepest readable payload");
        assert_eq!(event.payload(), &deepest);
        let refused = ValidationError::JsonTooDeep {
            field: "event payload",
            max: 127,
        };
        let err = NewEvent::new("Deep", too_deep).expect_err("one level deeper is refused");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert_eq!(err.validation(), Some(&refused));
        assert_eq!(
            err.to_string(),
            "invalid input: event payload nests arrays and objects more than 127 levels deep; \
             at most 127 can be read back"
        );
        // Plain arrays and plain objects count the same.
        for deep in [
            (0..128).fold(serde_json::json!(0), |v, _| serde_json::json!([v])),
            (0..128).fold(serde_json::json!(0), |v, _| serde_json::json!({ "k": v })),
        ] {
            let err = NewEvent::new("Deep", deep).expect_err("refused");
            assert_eq!(err.validation(), Some(&refused));
        }
    }
}
