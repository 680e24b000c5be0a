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
//!   waiter fails with a conflict (`23505` on Postgres); if it rolls back, the waiter's append
//!   goes through. So conflicts are detected at append time — never at commit, which cannot
//!   conflict because reserved versions are exclusive.
//! - Every failed append aborts the transaction (as a failed statement does in PostgreSQL), and
//!   so does dropping an append while it waits.
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
//! use lockstep_core::{EventStore, ExpectedVersion, NewEvent, StreamId};
//! use lockstep_testkit::{FakeDatabase, InMemoryEventStore};
//!
//! let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
//! let stream = StreamId::new_v7();
//! let tx = db.begin();
//! let event = NewEvent::new("StockAdded", serde_json::json!({ "quantity": 100 }))?;
//! assert_eq!(store.append(&tx, stream, ExpectedVersion::NoStream, &[event]).await?, 1);
//! tx.commit().await?;
//! assert_eq!(store.load(&db.begin(), stream).await?.len(), 1);
//! # Ok(()) }
//! ```

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use lockstep_core::{
    DistributedLock, Error, ErrorKind, EventStore, ExpectedVersion, NewEvent, RecordedEvent,
    ResourceKey, Result, StreamId, VersionConflict,
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
    /// The database whose transactions this store serves (bound by the first one it sees).
    database: OnceLock<FakeDatabase>,
}

/// In-memory [`EventStore`] on [`FakeTransaction`]s. Cheap to clone (clones share state).
#[derive(Clone)]
pub struct InMemoryEventStore {
    inner: Arc<Inner>,
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
                database: OnceLock::new(),
            }),
        }
    }

    /// Every committed event of `stream_id`, outside any transaction (for assertions).
    pub fn committed(&self, stream_id: StreamId) -> Vec<RecordedEvent> {
        self.state()
            .committed
            .get(&stream_id)
            .cloned()
            .unwrap_or_default()
    }

    /// Whether an event with this id is committed or staged (a linear scan: test-sized data).
    fn id_taken(state: &State, id: Uuid) -> bool {
        state
            .committed
            .values()
            .chain(state.staged.values())
            .flatten()
            .any(|e| e.event_id == id)
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

    /// Refuses transactions that are not usable or belong to another database than the first
    /// one this store saw.
    fn check(&self, tx: &FakeTransaction) -> Result<()> {
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
            // transaction has ended.
        });
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
        // Like the Postgres statement: the current version is read once, at the start; the
        // versions written are fixed from there.
        let base = {
            let state = self.state();
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
                // The event id is the primary key (Postgres: 23505 on wh_events_pkey).
                if let Some(dup) = events.iter().find(|e| Self::id_taken(&state, e.event_id())) {
                    return Err(Error::new(
                        ErrorKind::Conflict,
                        format!("event {} was already appended", dup.event_id()),
                    ));
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
                    });
                }
                Ok(Attempt::Done(base + events.len() as u64))
            })
            .await
    }
}

impl EventStore<FakeTransaction> for InMemoryEventStore {
    async fn load(&self, tx: &FakeTransaction, stream_id: StreamId) -> Result<Vec<RecordedEvent>> {
        self.check(tx)?;
        let state = self.state();
        Ok(Self::visible(&state, tx.id(), stream_id))
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
        if events.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "an append needs at least one event",
            ));
        }
        self.join(tx);
        // A failed or abandoned append is a failed statement: it aborts the transaction.
        tx.statement(self.append_inner(tx, stream_id, expected, events))
            .await
    }
}
