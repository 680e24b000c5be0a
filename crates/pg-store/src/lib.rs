//! # lockstep-pg-store
//!
//! The PostgreSQL implementations of [`lockstep_core::EventStore`] ([`PgEventStore`]) and of
//! [`lockstep_core::PerspectiveStore`] ([`PgPerspectiveStore`], module [`perspective`]: the
//! perspective worker's work queue, cursors, states and snapshots). It depends on
//! `lockstep-core` and `lockstep-pg` only.
//!
//! - The [`EventStore`] contract is implemented for the owned
//!   [`PgTransaction`]: its `load_locked` waits for a lock, and only a transaction that owns
//!   its connection can close it after an abandoned wait (a late cancel request must not hit
//!   the next borrower).
//! - [`PgEventStore::load_on`] and [`PgEventStore::append_on`], which never wait for a lock,
//!   also run on any [`PgTransactionRef`]: a borrowed `tokio_postgres::Transaction` or
//!   `deadpool_postgres::Transaction` the application manages itself (pass `&tx`).
//!
//! - Storage: table `wh_events` (the baseline schema in `migrations/`): `event_id uuid` primary
//!   key (the id the caller's [`NewEvent`] carries: a fresh UUIDv7 unless chosen with
//!   `with_id`), `stream_id`, `version bigint`, `event_type`, `payload jsonb`, `recorded_at
//!   timestamptz DEFAULT clock_timestamp()`, `schema_version integer` (the shape of the
//!   payload, [`NewEvent::with_schema_version`]), and **`UNIQUE (stream_id, version)`**.
//! - Every read of an event goes through the store's [`Upcasters`]
//!   ([`PgEventStore::with_upcasters`]; none by default): a stored payload is never rewritten,
//!   it is lifted to the current shape of its type as it is read.
//! - [`append`](lockstep_core::EventStore::append) calls the SQL function
//!   `lockstep_append_events` (one statement, one round trip): it reads the stream's version,
//!   checks the expected version and inserts the events with the next versions, then enqueues
//!   one perspective work row per registered perspective ([`perspective`]). A stale
//!   expectation raises `unique_violation`, exactly like losing a race on the unique index, so
//!   every conflict is SQLSTATE `23505` →
//!   [`ErrorKind::Conflict`](lockstep_core::ErrorKind) with a [`VersionConflict`], and every
//!   conflict leaves the transaction aborted. Of two transactions appending the same version,
//!   the second waits for the first and fails only if the first commits. A `23505` is a
//!   version conflict only when its constraint is `wh_events_stream_version`.
//! - Appends are **idempotent by event id** (`lockstep_append_events`: the primary key detects
//!   a stored id as part of the insert, so an append that is neither a replay nor a refusal
//!   pays no probe of its own, and the fan-out runs only when a perspective is registered — ADR
//!   0019), so a unit of work retried after a lost `COMMIT` reply
//!   ([`ErrorKind::CommitUnknown`](lockstep_core::ErrorKind)) cannot write its events twice:
//!   when every event id of an append is already stored in that stream, at consecutive versions
//!   in the order given (and the expected version, if any, is the one before the first), the
//!   append is a **replay**: nothing is written and it returns what the original append
//!   returned (the version of its last event). Stored ids that are anything else — some stored
//!   and some not, in another stream, at other positions, at another expected version — are
//!   refused with [`ErrorKind::InvalidInput`] (not retryable; the transaction is aborted). An
//!   id another transaction is storing right now in the same stream is waited for and, if it
//!   commits, is a retryable [`ErrorKind::Conflict`]: the retry then replays or is refused
//!   (stored meanwhile in another stream, it is refused at once: the retry's answer). An append
//!   listing one id twice is refused before any SQL.
//! - [`load`](lockstep_core::EventStore::load) reads a stream in version order (an index scan
//!   of the unique index).
//! - [`load_locked`](lockstep_core::EventStore::load_locked) locks and loads in **one
//!   statement**, the SQL function `lockstep_lock_and_load` (it takes the advisory lock through
//!   `lockstep_advisory_lock`, which checks the isolation level first, then loads in a fresh
//!   READ COMMITTED snapshot), under the store's [`LockQueue`] (in-process queue, deadline,
//!   cancel on drop). Built from the process's one [`PgDatabase`] ([`PgEventStore::new`]), the
//!   store shares that queue with the aggregate lock built from the same handle, so that
//!   `load_locked` and the aggregate lock queue together. Lock and load cost one round trip and
//!   one statement together, like a plain load.
//!
//! Every statement is sent with `query_typed` (no separate prepare round trip). Apply the
//! schema first with [`PgDatabase::migrate`].
//!
//! ```no_run
//! # async fn demo(db: lockstep_pg::PgDatabase) -> lockstep_core::Result<()> {
//! use lockstep_core::{
//!     AggregateType, EventStore, ExpectedVersion, NewEvent, StreamId, Transaction,
//!     TransactionSource, aggregate_key,
//! };
//! use lockstep_pg_store::PgEventStore;
//!
//! db.migrate().await?;
//! let store = PgEventStore::new(&db); // queues with every lock built from `db`
//!
//! let sku = uuid::Uuid::now_v7();
//! let key = aggregate_key(&AggregateType::new("StockItem")?, sku);
//! let tx = db.begin().await?;
//! let events = store.load_locked(&tx, StreamId::from_uuid(sku), &key, None).await?; // 1 round trip
//! let event = NewEvent::new("StockReserved", serde_json::json!({ "quantity": 1 }))?;
//! let expected = ExpectedVersion::Exact(events.len() as u64);
//! store.append(&tx, StreamId::from_uuid(sku), expected, &[event]).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```

pub mod perspective;
mod snapshot;

pub use perspective::PgPerspectiveStore;

use std::time::Duration;

use lockstep_core::{
    Error, ErrorKind, EventStore, ExpectedVersion, NewEvent, RecordedEvent, ResourceKey, Result,
    StreamId, Upcasters, VersionConflict,
};
use lockstep_pg::driver::{Columns, DbError, Executor, Tp, query_one, query_opt};
use lockstep_pg::internal::{self, LockingTransaction, check_isolation};
#[cfg(feature = "sqlx")]
use lockstep_pg::sqlx::SqlxTransaction;
use lockstep_pg::{LockQueue, PgDatabase, PgTransaction, PgTransactionRef, WriteAtCommit};
use time::OffsetDateTime;
use tokio_postgres::types::Type;
use uuid::Uuid;

/// SQLSTATE `unique_violation`.
const UNIQUE_VIOLATION: &str = "23505";

const LOAD: &str = "SELECT event_id, version, event_type, payload, recorded_at, schema_version \
     FROM wh_events WHERE stream_id = $1 ORDER BY version";

const LOCK_AND_LOAD: &str = "SELECT refused_isolation, event_id, version, event_type, payload, \
     recorded_at, schema_version FROM lockstep_lock_and_load($1, $2, $3)";

const APPEND: &str = "SELECT lockstep_append_events($1, $2, $3, $4, $5, $6)";

/// The stream of one event (`$1`), by the primary key.
const STREAM_OF_EVENT: &str = "SELECT stream_id FROM wh_events WHERE event_id = $1";

/// The prefix of the `DETAIL` that `lockstep_append_events` puts on a stale expectation.
const ACTUAL_VERSION_DETAIL: &str = "actual_version=";

/// The `DETAIL` that `lockstep_append_events` puts on stored event ids that are not a replay.
const NOT_A_REPLAY_DETAIL: &str = "not_a_replay";

/// The unique `(stream_id, version)` constraint of `wh_events`.
const STREAM_VERSION_CONSTRAINT: &str = "wh_events_stream_version";

/// The primary key (`event_id`) of `wh_events`.
const EVENT_ID_CONSTRAINT: &str = "wh_events_pkey";

/// The Postgres event store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct PgEventStore {
    queue: LockQueue,
    upcasters: Upcasters,
}

impl PgEventStore {
    /// The event store of `db`: its [`EventStore::load_locked`] queues in the handle's lock
    /// queue, shared with the aggregate write lock built from the same handle
    /// (`lockstep_pg_advisory::PgDistributedLock::new(&db)`).
    pub fn new(db: &PgDatabase) -> PgEventStore {
        PgEventStore::with_queue(db.lock_queue().clone())
    }

    /// The event store of an application on sqlx (feature `sqlx`): its
    /// [`EventStore::load_locked`] queues in the handle's lock queue, shared with the aggregate
    /// lock built from the same handle (`lockstep_pg_advisory::sqlx::SqlxDistributedLock::new`).
    #[cfg(feature = "sqlx")]
    pub fn for_sqlx(db: &lockstep_pg::sqlx::SqlxDatabase) -> PgEventStore {
        PgEventStore::with_queue(db.lock_queue().clone())
    }

    /// A store whose [`EventStore::load_locked`] queues in `queue` — a [`LockQueue`], or the
    /// process's `lockstep_pg_advisory::PgDistributedLock` (or a reference to it). Clones share
    /// one queue. For wiring by hand; [`PgEventStore::new`] shares the handle's queue.
    pub fn with_queue(queue: impl Into<LockQueue>) -> PgEventStore {
        PgEventStore {
            queue: queue.into(),
            upcasters: Upcasters::new(),
        }
    }

    /// This store, reading every event through `upcasters` ([`lockstep_core::upcast`]): its
    /// loads hand out each event in the current shape of its type. An upcaster that fails
    /// fails the load with [`ErrorKind::InvalidInput`]. None by default: events are read as
    /// stored.
    pub fn with_upcasters(mut self, upcasters: Upcasters) -> PgEventStore {
        self.upcasters = upcasters;
        self
    }

    /// The upcasters every read goes through.
    pub fn upcasters(&self) -> &Upcasters {
        &self.upcasters
    }

    /// The queue [`EventStore::load_locked`] waits in.
    pub fn queue(&self) -> &LockQueue {
        &self.queue
    }

    /// The stream's events in version order ([`EventStore::load`]), on any transaction,
    /// including one the application manages itself (`&tokio_postgres::Transaction`,
    /// `&deadpool_postgres::Transaction`).
    pub async fn load_on<T: PgTransactionRef + ?Sized>(
        &self,
        tx: &T,
        stream_id: StreamId,
    ) -> Result<Vec<RecordedEvent>> {
        self.load_with(&Tp(tx.executor()), stream_id).await
    }

    /// [`PgEventStore::load_on`] on either driver's executor.
    async fn load_with<E: Executor + ?Sized>(
        &self,
        executor: &E,
        stream_id: StreamId,
    ) -> Result<Vec<RecordedEvent>> {
        let rows = executor
            .query(LOAD, &[&stream_id.as_uuid()])
            .await
            .map_err(|e| statement_error(e, "loading stream", stream_id))?;
        rows.iter()
            .map(|row| decode(row, 0, stream_id, &self.upcasters))
            .collect()
    }

    /// The stream that the event `event_id` belongs to, `None` when this database has no such
    /// event: for an operator's tool that checks an event id it was given (`lockstep
    /// perspectives rewind --from`) before it acts on it. One primary-key lookup.
    pub async fn stream_of_event<T: PgTransactionRef + ?Sized>(
        &self,
        tx: &T,
        event_id: Uuid,
    ) -> Result<Option<StreamId>> {
        let row = query_opt(&Tp(tx.executor()), STREAM_OF_EVENT, &[&event_id])
            .await
            .map_err(|e| internal::db_statement_error(e, "looking up an event"))?;
        row.map(|r| r.get::<Uuid>(0).map(StreamId::from_uuid))
            .transpose()
            .map_err(decode_error)
    }

    /// Appends `events` at `expected` ([`EventStore::append`]), on any transaction, including
    /// one the application manages itself. Returns the stream's new version.
    pub async fn append_on<T: PgTransactionRef + ?Sized>(
        &self,
        tx: &T,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<u64> {
        let append = AppendCall::new(stream_id, expected, events)?;
        append.run(&Tp(tx.executor())).await
    }

    /// Appends `events` at `expected` as the transaction's last write: the append is held
    /// back ([`PgTransaction::write_at_commit`]) and travels with the `COMMIT`, one round trip
    /// for both. Bad input is refused here; a conflict is returned by the commit (which rolls
    /// back). [`EventStore::append_at_commit`] is this.
    fn hold_append(
        &self,
        tx: &PgTransaction,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<()> {
        let append = AppendCall::new(stream_id, expected, events)?;
        tx.write_at_commit(
            WriteAtCommit::new(APPEND)
                .bind(stream_id.as_uuid(), Type::UUID)
                .bind(append.expected_version, Type::INT8)
                .bind(append.ids, Type::UUID_ARRAY)
                .bind(append.types, Type::TEXT_ARRAY)
                .bind(append.payloads, Type::JSONB_ARRAY)
                .bind(append.schema_versions, Type::INT4_ARRAY)
                .map_error(move |e| append_error(DbError::from(e), stream_id, expected)),
        );
        Ok(())
    }
}

/// One append, checked and ready to send: owned, so it can be held back until commit.
struct AppendCall {
    stream_id: StreamId,
    expected: ExpectedVersion,
    expected_version: Option<i64>,
    ids: Vec<Uuid>,
    types: Vec<String>,
    payloads: Vec<serde_json::Value>,
    /// `None` when every event is at schema version 1 (the function's default).
    schema_versions: Option<Vec<i32>>,
}

impl AppendCall {
    /// Checks what can be checked without the database (refused before any SQL, leaving the
    /// transaction usable).
    fn new(stream_id: StreamId, expected: ExpectedVersion, events: &[NewEvent]) -> Result<Self> {
        if events.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "an append needs at least one event",
            ));
        }
        let expected_version = expected
            .as_version()
            .map(|v| {
                i64::try_from(v).map_err(|_| {
                    Error::new(ErrorKind::InvalidInput, "expected version out of range")
                })
            })
            .transpose()?;
        let ids: Vec<Uuid> = events.iter().map(NewEvent::event_id).collect();
        refuse_repeated_ids(&ids)?;
        Ok(AppendCall {
            stream_id,
            expected,
            expected_version,
            ids,
            types: events.iter().map(|e| e.event_type().to_owned()).collect(),
            payloads: events.iter().map(|e| e.payload().clone()).collect(),
            schema_versions: events.iter().any(|e| e.schema_version() != 1).then(|| {
                // At most NewEvent::MAX_SCHEMA_VERSION: fits an i32.
                events
                    .iter()
                    .map(|e| i32::try_from(e.schema_version()).unwrap_or(i32::MAX))
                    .collect()
            }),
        })
    }

    /// Runs `lockstep_append_events`: one statement, the stream's new version.
    async fn run<E: Executor + ?Sized>(&self, executor: &E) -> Result<u64> {
        let row = query_one(
            executor,
            APPEND,
            &[
                &self.stream_id.as_uuid(),
                &self.expected_version,
                &self.ids,
                &self.types,
                &self.payloads,
                &self.schema_versions,
            ],
        )
        .await
        .map_err(|e| append_error(e, self.stream_id, self.expected))?;
        let version: i64 = row.get(0).map_err(decode_error)?;
        u64::try_from(version)
            .map_err(|_| Error::new(ErrorKind::Backend, "stored version is negative"))
    }
}

/// An event row whose columns start at `offset` (id, version, type, payload, recorded_at,
/// schema_version), in the current shape of its type: lifted by `upcasters`, whose failure is
/// the error of this event ([`ErrorKind::InvalidInput`]).
fn decode<R: Columns>(
    row: &R,
    offset: usize,
    stream_id: StreamId,
    upcasters: &Upcasters,
) -> Result<RecordedEvent> {
    let version: i64 = row.column(offset + 1).map_err(decode_error)?;
    let schema_version: i32 = row.column(offset + 5).map_err(decode_error)?;
    let stored = RecordedEvent {
        event_id: row.column::<Uuid>(offset).map_err(decode_error)?,
        stream_id,
        version: u64::try_from(version)
            .map_err(|_| Error::new(ErrorKind::Backend, "stored version is negative"))?,
        event_type: row.column(offset + 2).map_err(decode_error)?,
        payload: row
            .column::<serde_json::Value>(offset + 3)
            .map_err(decode_error)?,
        recorded_at: row
            .column::<OffsetDateTime>(offset + 4)
            .map_err(decode_error)?,
        schema_version: u32::try_from(schema_version)
            .map_err(|_| Error::new(ErrorKind::Backend, "stored schema version is negative"))?,
    };
    upcasters.upcast(stored)
}

impl PgEventStore {
    /// [`EventStore::load_locked`] on either driver's transaction: one statement — the function
    /// checks the isolation level, locks, then loads in a fresh snapshot; `acquire_with` adds
    /// the in-process queue, the deadline and cancel-on-drop.
    async fn lock_and_load<T: LockingTransaction + ?Sized>(
        &self,
        tx: &T,
        stream_id: StreamId,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<Vec<RecordedEvent>> {
        internal::acquire_with(&self.queue, tx, key, timeout, |call| async move {
            let rows = tx
                .query(
                    LOCK_AND_LOAD,
                    &[&call.advisory_key, &call.lock_timeout, &stream_id.as_uuid()],
                )
                .await
                .map_err(|e| statement_error(e, "locking and loading stream", stream_id))?;
            if let Some(first) = rows.first() {
                let refused: Option<String> = first.get(0).map_err(decode_error)?;
                check_isolation(refused.as_deref(), key)?;
            }
            rows.iter()
                .map(|row| decode(row, 1, stream_id, &self.upcasters))
                .collect()
        })
        .await
    }
}

/// The event store on an sqlx transaction: the same statements, decoding and error mapping.
/// `append_at_commit` appends at once (sqlx does not pipeline a write with the `COMMIT`).
#[cfg(feature = "sqlx")]
impl EventStore<SqlxTransaction> for PgEventStore {
    async fn load(&self, tx: &SqlxTransaction, stream_id: StreamId) -> Result<Vec<RecordedEvent>> {
        self.load_with(tx, stream_id).await
    }

    async fn load_locked(
        &self,
        tx: &SqlxTransaction,
        stream_id: StreamId,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<Vec<RecordedEvent>> {
        self.lock_and_load(tx, stream_id, key, timeout).await
    }

    async fn append(
        &self,
        tx: &SqlxTransaction,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<u64> {
        AppendCall::new(stream_id, expected, events)?.run(tx).await
    }
}

impl EventStore<PgTransaction> for PgEventStore {
    async fn load(&self, tx: &PgTransaction, stream_id: StreamId) -> Result<Vec<RecordedEvent>> {
        self.load_on(tx, stream_id).await
    }

    async fn load_locked(
        &self,
        tx: &PgTransaction,
        stream_id: StreamId,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<Vec<RecordedEvent>> {
        self.lock_and_load(tx, stream_id, key, timeout).await
    }

    async fn append(
        &self,
        tx: &PgTransaction,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<u64> {
        self.append_on(tx, stream_id, expected, events).await
    }

    async fn append_at_commit(
        &self,
        tx: &PgTransaction,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<()> {
        self.hold_append(tx, stream_id, expected, events)
    }
}

/// What was being done to which stream, with the database's message and SQLSTATE; a database
/// without lockstep's schema says to run the migrations (the helper every lockstep Postgres
/// backend shares).
fn statement_error(err: DbError, doing: &str, stream_id: StreamId) -> Error {
    internal::db_statement_error(err, &format!("{doing} {stream_id}"))
}

fn decode_error(err: DbError) -> Error {
    Error::new(ErrorKind::Backend, "decoding an event row").with_source(err)
}

/// An append that lists one event id twice cannot be stored (the id is the primary key):
/// refused before any SQL, leaving the transaction usable (the in-memory store does the same).
fn refuse_repeated_ids(ids: &[Uuid]) -> Result<()> {
    let mut seen = std::collections::HashSet::with_capacity(ids.len());
    match ids.iter().find(|id| !seen.insert(**id)) {
        Some(id) => Err(Error::new(
            ErrorKind::InvalidInput,
            format!("an append lists event {id} more than once"),
        )),
        None => Ok(()),
    }
}

/// `23505` is told apart by its constraint, never by message text:
///
/// - `wh_events_stream_version` (the unique index, or the function's stale-expectation check)
///   → [`ErrorKind::Conflict`] with a [`VersionConflict`];
/// - `wh_events_pkey` with the function's `DETAIL` `not_a_replay` → [`ErrorKind::InvalidInput`]
///   (not retryable): some of the event ids are stored, and this append is not a replay of the
///   append that stored them;
/// - `wh_events_pkey` without it → a race lost on the primary key (another transaction stored
///   one of these ids while this one waited): [`ErrorKind::Conflict`], retryable — the retry
///   finds the ids stored and is a no-op replay or the refusal above;
///
/// anything else by its SQLSTATE.
fn append_error(err: DbError, stream_id: StreamId, expected: ExpectedVersion) -> Error {
    let constraint = err.constraint();
    let detail = err.detail();
    let unique = err.code() == Some(UNIQUE_VIOLATION);
    if unique && constraint == Some(EVENT_ID_CONSTRAINT) {
        if detail == Some(NOT_A_REPLAY_DETAIL) {
            let message = err.message().unwrap_or_default().to_owned();
            return Error::new(ErrorKind::InvalidInput, message).with_source(err.into_source());
        }
        return Error::new(
            ErrorKind::Conflict,
            format!(
                "appending to stream {stream_id}: another transaction stored one of these \
                 event ids first"
            ),
        )
        .with_source(err.into_source());
    }
    if unique && constraint == Some(STREAM_VERSION_CONSTRAINT) {
        // The function reports the version it saw in a machine-readable DETAIL of its own;
        // a race lost on the index has none.
        let actual = detail
            .and_then(|d| d.strip_prefix(ACTUAL_VERSION_DETAIL))
            .and_then(|v| v.parse::<u64>().ok());
        return VersionConflict::new(stream_id, expected, actual)
            .with_source(err.into_source())
            .into_error();
    }
    statement_error(err, "appending to stream", stream_id)
}
