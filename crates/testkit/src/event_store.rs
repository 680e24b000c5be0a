//! [`InMemoryEventStore`]: the event store on the fake transactions of [`crate::fake_lock`],
//! behaving like the Postgres store (`lockstep-pg-store`) on a unique `(stream_id, version)`.
//!
//! - Appends are staged per transaction and become visible to others when it commits (an
//!   [`FakeTransaction::on_end`] hook); a rollback, an abort or a drop discards them. A
//!   transaction sees the committed events plus its own staged ones (READ COMMITTED).
//! - The expected version is checked against what the transaction sees; a mismatch is a
//!   [`ErrorKind::Conflict`] at once.
//! - The versions an append writes are reserved while its transaction is open, like the
//!   entries of a unique index. A second transaction appending a reserved version **waits for
//!   the first one to end**, as PostgreSQL's second inserter does: if the first commits, the
//!   waiter fails with a conflict (`23505` on Postgres); if it rolls back — or is aborted by a
//!   failed statement, which frees its versions at the error as Postgres does — the waiter's
//!   append goes through. So conflicts are detected at append time — never at commit, which
//!   cannot conflict because reserved versions are exclusive.
//! - Every failed append aborts the transaction (as a failed statement does in PostgreSQL), and
//!   so does dropping an append while it waits.
//! - Appends are idempotent by event id, exactly like Postgres (`lockstep_append_events`): an
//!   append whose event ids are all stored in that stream at consecutive versions in the order
//!   given (and whose expected version, if any, is the one before the first) is a replay that
//!   writes nothing and returns the version of its last event; other stored ids are
//!   [`ErrorKind::InvalidInput`]; an id another open transaction staged is waited for, and is a
//!   retryable [`ErrorKind::Conflict`] if that transaction commits. An append listing one id
//!   twice is refused before anything happens.
//!
//! A writer waiting for another transaction's version waits in the wait graph of the
//! transactions' [`crate::FakeDatabase`], with the fake locks' waits, so a cycle of waits is a
//! [`ErrorKind::Deadlock`] for the waiter that closes it, whether it goes through versions,
//! locks or both. Unlike Postgres, the deadlock is reported at once (Postgres waits
//! `deadlock_timeout` first).
//!
//! A store serves the transactions of one [`crate::FakeDatabase`]: the first transaction it
//! sees binds it, and a transaction of another database is refused with
//! [`ErrorKind::Unsupported`] (as a Postgres table lives in one database).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> lockstep_core::Result<()> {
//! use lockstep_core::{EventStore, ExpectedVersion, NewEvent, StreamId, Transaction, TransactionSource};
//! use lockstep_testkit::{FakeDatabase, InMemoryEventStore};
//!
//! let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
//! let stream = StreamId::new_v7();
//! let tx = db.begin().await?;
//! let event = NewEvent::new("StockAdded", serde_json::json!({ "quantity": 100 }))?;
//! assert_eq!(store.append(&tx, stream, ExpectedVersion::NoStream, &[event]).await?, 1);
//! tx.commit().await?;
//! assert_eq!(store.load(&db.begin().await?, stream).await?.len(), 1);
//! # Ok(()) }
//! ```

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use lockstep_core::{
    DistributedLock, Error, ErrorKind, EventStore, ExpectedVersion, NewEvent, RecordedEvent,
    ResourceKey, Result, StreamId, Upcasters, VersionConflict,
};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::fake_lock::{
    Attempt, FakeDatabase, FakeDistributedLock, FakeTransaction, LockOwner, TxEnd,
};

#[derive(Default)]
struct State {
    /// Committed events per stream, in version order (index = version - 1).
    committed: HashMap<StreamId, Vec<RecordedEvent>>,
    /// Staged (uncommitted) events per transaction, in append order.
    staged: HashMap<u64, Vec<RecordedEvent>>,
    /// Versions written by open transactions: (stream, version) → transaction.
    reserved: HashMap<(StreamId, u64), u64>,
    /// Transactions whose end hook is installed.
    hooked: HashSet<u64>,
}

struct Inner {
    state: Mutex<State>,
    /// The aggregate snapshots ([`crate::snapshot_store`]).
    snapshots: Mutex<crate::snapshot_store::Snapshots>,
    /// The database whose transactions this store serves (bound by the first one it sees).
    database: OnceLock<FakeDatabase>,
}

/// In-memory [`EventStore`] on [`FakeTransaction`]s. Cheap to clone (clones share state).
#[derive(Clone)]
pub struct InMemoryEventStore {
    inner: Arc<Inner>,
    /// What every load goes through (this handle's; clones made after share them).
    upcasters: Upcasters,
}

impl fmt::Debug for InMemoryEventStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("InMemoryEventStore")
            .field("streams", &state.committed.len())
            .field("open_transactions", &state.staged.len())
            .finish()
    }
}

impl Default for InMemoryEventStore {
    fn default() -> Self {
        InMemoryEventStore::new()
    }
}

impl InMemoryEventStore {
    /// An empty store.
    pub fn new() -> InMemoryEventStore {
        InMemoryEventStore {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                snapshots: Mutex::default(),
                database: OnceLock::new(),
            }),
            upcasters: Upcasters::new(),
        }
    }

    /// This store (the same events: a clone's), reading every event through `upcasters`, as
    /// `lockstep-pg-store`'s `PgEventStore::with_upcasters`: its loads hand out each event in
    /// the current shape of its type, and an upcaster that fails fails the load with
    /// [`ErrorKind::InvalidInput`]. None by default: events are read as stored.
    pub fn with_upcasters(mut self, upcasters: Upcasters) -> InMemoryEventStore {
        self.upcasters = upcasters;
        self
    }

    /// The upcasters every load goes through.
    pub fn upcasters(&self) -> &Upcasters {
        &self.upcasters
    }

    /// Every committed event of `stream_id` as stored (not upcast), outside any transaction
    /// (for assertions).
    pub fn committed(&self, stream_id: StreamId) -> Vec<RecordedEvent> {
        self.state()
            .committed
            .get(&stream_id)
            .cloned()
            .unwrap_or_default()
    }

    /// The event with this id that transaction `tx` sees (committed, or staged by `tx`), if
    /// any (a linear scan: test-sized data).
    fn visible_by_id(state: &State, tx: u64, id: Uuid) -> Option<&RecordedEvent> {
        state
            .committed
            .values()
            .chain(state.staged.get(&tx))
            .flatten()
            .find(|e| e.event_id == id)
    }

    /// Idempotency by event id, as Postgres does it (`lockstep_append_events`): `None` when
    /// none of the ids is visible to `tx`; a replay's result when every one is stored in
    /// `stream_id` at consecutive versions in the order given (and `expected` is the version
    /// before the first); otherwise the refusal ([`ErrorKind::InvalidInput`]).
    fn replay(
        state: &State,
        tx: u64,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Option<Result<u64>> {
        let stored: Vec<Option<&RecordedEvent>> = events
            .iter()
            .map(|e| Self::visible_by_id(state, tx, e.event_id()))
            .collect();
        let sample = stored.iter().flatten().next()?;
        let count = stored.iter().flatten().count();
        let first = stored
            .first()
            .copied()
            .flatten()
            .filter(|e| e.stream_id == stream_id)
            .map(|e| e.version);
        if let Some(first) = first {
            let in_place = stored.iter().zip(first..).all(|(e, version)| {
                e.is_some_and(|e| e.stream_id == stream_id && e.version == version)
            });
            let as_expected = expected.as_version().is_none_or(|v| v + 1 == first);
            if in_place && as_expected {
                return Some(Ok(first - 1 + events.len() as u64));
            }
        }
        Some(Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "stream {stream_id}: event {} is already stored (stream {}, version {}) and \
                 this append is not a replay of the append that stored it ({count} of its {} \
                 events stored, at other positions, in another stream or at another expected \
                 version)",
                sample.event_id,
                sample.stream_id,
                sample.version,
                events.len()
            ),
        )))
    }

    /// Every stream with committed events, outside any transaction.
    pub fn streams(&self) -> Vec<StreamId> {
        self.state().committed.keys().copied().collect()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Each update is applied whole under the lock, so a poisoned state is consistent.
        self.inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn snapshots(&self) -> MutexGuard<'_, crate::snapshot_store::Snapshots> {
        self.inner
            .snapshots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Refuses transactions that are not usable or belong to another database than the first
    /// one this store saw.
    pub(crate) fn check(&self, tx: &FakeTransaction) -> Result<()> {
        let bound = self.inner.database.get_or_init(|| tx.database().clone());
        if !bound.same(tx.database()) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "transaction belongs to another FakeDatabase than this store's",
            ));
        }
        tx.check_usable()
    }

    /// Installs the end-of-transaction hook once per transaction.
    fn join(&self, tx: &FakeTransaction) {
        let id = tx.id();
        if !self.state().hooked.insert(id) {
            return;
        }
        let inner = Arc::clone(&self.inner);
        tx.on_end(move |how| {
            let mut state = inner
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            state.hooked.remove(&id);
            state.reserved.retain(|_, holder| *holder != id);
            let staged = state.staged.remove(&id).unwrap_or_default();
            if how == TxEnd::Committed {
                for event in staged {
                    let stream = state.committed.entry(event.stream_id).or_default();
                    debug_assert_eq!(stream.len() as u64 + 1, event.version, "reserved");
                    stream.push(event);
                }
            }
            // Writers waiting for these versions are woken by the database once the
            // transaction has ended or been aborted.
        });
    }

    /// The events of `stream_id` that `tx` sees, as stored (not upcast).
    pub(crate) fn visible_as_stored(
        &self,
        tx: &FakeTransaction,
        stream_id: StreamId,
    ) -> Vec<RecordedEvent> {
        Self::visible(&self.state(), tx.id(), stream_id)
    }

    fn visible(state: &State, tx: u64, stream_id: StreamId) -> Vec<RecordedEvent> {
        let mut events = state.committed.get(&stream_id).cloned().unwrap_or_default();
        if let Some(staged) = state.staged.get(&tx) {
            events.extend(staged.iter().filter(|e| e.stream_id == stream_id).cloned());
        }
        events
    }

    async fn append_inner(
        &self,
        tx: &FakeTransaction,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<u64> {
        let id = tx.id();
        // Like the Postgres statement: the event ids are looked up first (a replay writes
        // nothing), then the current version is read once; the versions written are fixed from
        // there.
        let base = {
            let state = self.state();
            if let Some(outcome) = Self::replay(&state, id, stream_id, expected, events) {
                return outcome;
            }
            Self::visible(&state, id, stream_id).len() as u64
        };
        if let Some(want) = expected.as_version()
            && want != base
        {
            return Err(VersionConflict::new(stream_id, expected, Some(base)).into_error());
        }
        let versions = (base + 1)..=(base + events.len() as u64);
        let what = format!("appending to stream {stream_id}");
        tx.database()
            .wait_for(tx.owner(), &what, || {
                let mut state = self.state();
                // The event id is the primary key, checked first (Postgres checks the primary
                // key before the (stream_id, version) index): an id another open transaction
                // staged is waited for; one committed since our read is a lost race.
                let mine = |e: &RecordedEvent| events.iter().any(|n| n.event_id() == e.event_id);
                let id_holder = state
                    .staged
                    .iter()
                    .find(|(holder, staged)| **holder != id && staged.iter().any(mine))
                    .map(|(holder, _)| *holder);
                if let Some(holder) = id_holder {
                    return Ok(Attempt::Blocked(LockOwner::Transaction(holder)));
                }
                if state.committed.values().flatten().any(mine) {
                    return Err(Error::new(
                        ErrorKind::Conflict,
                        format!(
                            "appending to stream {stream_id}: another transaction stored one \
                             of these event ids first"
                        ),
                    ));
                }
                let committed = state.committed.get(&stream_id).map_or(0, Vec::len) as u64;
                if committed > base {
                    // Another transaction committed one of these versions (while we waited,
                    // or since our read): the unique index says no.
                    return Err(VersionConflict::new(stream_id, expected, None).into_error());
                }
                let blocker = versions.clone().find_map(|v| {
                    state
                        .reserved
                        .get(&(stream_id, v))
                        .copied()
                        .filter(|holder| *holder != id)
                });
                if let Some(holder) = blocker {
                    return Ok(Attempt::Blocked(LockOwner::Transaction(holder)));
                }
                let now = OffsetDateTime::now_utc();
                for (version, event) in versions.clone().zip(events) {
                    state.reserved.insert((stream_id, version), id);
                    state.staged.entry(id).or_default().push(RecordedEvent {
                        event_id: event.event_id(),
                        stream_id,
                        version,
                        event_type: event.event_type().to_owned(),
                        payload: event.payload().clone(),
                        recorded_at: now,
                        schema_version: event.schema_version(),
                    });
                }
                Ok(Attempt::Done(base + events.len() as u64))
            })
            .await
    }
}

impl InMemoryEventStore {
    /// What an append refuses before any statement, as lockstep-pg-store does and in its order
    /// (the transaction stays usable): no events, an expected version past `i64::MAX` (a
    /// Postgres `bigint` cannot hold it), an event id listed twice.
    fn check_input(expected: ExpectedVersion, events: &[NewEvent]) -> Result<()> {
        if events.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "an append needs at least one event",
            ));
        }
        if expected
            .as_version()
            .is_some_and(|v| i64::try_from(v).is_err())
        {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "expected version out of range",
            ));
        }
        let mut ids = HashSet::with_capacity(events.len());
        if let Some(repeated) = events.iter().find(|e| !ids.insert(e.event_id())) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "an append lists event {} more than once",
                    repeated.event_id()
                ),
            ));
        }
        Ok(())
    }
}

impl EventStore<FakeTransaction> for InMemoryEventStore {
    async fn load(&self, tx: &FakeTransaction, stream_id: StreamId) -> Result<Vec<RecordedEvent>> {
        self.check(tx)?;
        let visible = Self::visible(&self.state(), tx.id(), stream_id);
        visible
            .into_iter()
            .map(|event| self.upcasters.upcast(event))
            .collect()
    }

    async fn load_locked(
        &self,
        tx: &FakeTransaction,
        stream_id: StreamId,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<Vec<RecordedEvent>> {
        self.check(tx)?;
        FakeDistributedLock::new(tx.database())
            .acquire_for_transaction(tx, key, timeout)
            .await?;
        self.load(tx, stream_id).await
    }

    async fn append(
        &self,
        tx: &FakeTransaction,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<u64> {
        self.check(tx)?;
        Self::check_input(expected, events)?;
        self.join(tx);
        // A failed or abandoned append is a failed statement: it aborts the transaction.
        tx.statement(self.append_inner(tx, stream_id, expected, events))
            .await
    }

    /// Held back until commit ([`FakeTransaction::write_at_commit`]), like the Postgres store:
    /// bad input is refused here, a conflict is returned by the commit.
    async fn append_at_commit(
        &self,
        tx: &FakeTransaction,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<()> {
        self.check(tx)?;
        Self::check_input(expected, events)?;
        let store = self.clone();
        let events = events.to_vec();
        tx.write_at_commit(Box::new(move |tx| {
            Box::pin(async move {
                store.join(tx);
                store
                    .append_inner(tx, stream_id, expected, &events)
                    .await
                    .map(drop)
            })
        }));
        Ok(())
    }
}
