//! [`InMemoryPerspectiveStore`]: the perspective store on the fake transactions, over an
//! [`InMemoryEventStore`] (the events) and an [`InMemoryStreamLocker`] (the cursor rows' leases),
//! behaving like the Postgres store (`lockstep-pg-store`'s `PgPerspectiveStore`).
//!
//! - **Work** is derived rather than stored: a pair's pending work is every committed event of
//!   its stream, for a registered perspective, that the pair has not applied (or purged). So work
//!   appears exactly when the appender commits and a perspective registered later catches up,
//!   as the Postgres fan-out does.
//! - **Row locks.** Every write takes the pair's cursor-row lock for its transaction (waiting, like
//!   an `UPDATE`); [`lockstep_core::PairWork::claim`] and [`lockstep_core::WorkQueue::claim_batch`] take it
//!   without waiting (`SKIP LOCKED`). The key is the one the in-memory locker waits on, so a
//!   lease write waits for a claiming transaction, as on Postgres.
//! - **Batches.** [`lockstep_core::WorkQueue::claim_batch`] serves the requested perspectives' rewind
//!   requests first (oldest `flagged_at` first, only servable ones, bounded by `pairs`), then
//!   walks each perspective's pairs with work in stream order from its position, wrapping round
//!   once; every pair of the walk counts towards `scan`. It skips pairs whose row is locked,
//!   under a live lease, backing off or parked (checked before the row lock is taken, as a
//!   `WHERE` would). Sizes are the JSON text's length (decoded sizes on Postgres too). A pair
//!   whose state and first event do not fit the bytes left ends the batch without moving the
//!   position past it. [`lockstep_core::WorkQueue::commit_batch`] checks every entry first (an entry
//!   needs a commit or a failure) and drops what it staged if an entry fails with anything but a
//!   refusal (one statement on Postgres).
//! - **Failures.** `retry_at` is the store clock plus the backoff, clamped to the calendar's end.
//!   A successful commit, [`lockstep_core::PerspectiveAdmin::unpark`], [`lockstep_core::PerspectiveAdmin::skip_event`] and
//!   [`lockstep_core::PerspectiveAdmin::request_rewind`] clear the parking, the backoff and the failure count
//!   (the commit also the error and the failed event). Skipped events are kept per pair: a
//!   purge keeps them, deleting the cursor deletes them.
//! - **Upcasting.** Every event handed out (claims, batches, rewind pages, stream reads) goes
//!   through the store's upcasters ([`InMemoryPerspectiveStore::with_upcasters`]); the byte
//!   bounds count the payloads as stored, as on Postgres. The first event an upcaster fails on
//!   is unreadable: the answer ends before it, with its id and why.
//! - **Visibility.** Writes are staged per transaction and applied when it commits (an
//!   [`FakeTransaction::on_end`] hook); a transaction reads its own staged writes.
//!
//! Differences from PostgreSQL: `ensure_cursor` and the cursor rows of `claim`, `claim_batch`,
//! `record_failure` and `skip_event` are created at once, not at commit (an empty cursor row
//! changes nothing observable); `stream_events` does not see the calling transaction's own
//! uncommitted appends.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use lockstep_core::perspective_store::{
    CursorRows, PairWork, PerspectiveAdmin, PerspectiveLifecycle, PerspectiveReads, RewindReads,
    WorkQueue,
};
use lockstep_core::{
    BatchClaim, BatchCommitted, BatchEntry, BatchLimits, Claim, ClaimedBatch, ClaimedPair,
    ClaimedWork, Committed, Cursor, CursorLease, DistributedLock, Error, ErrorKind, EventPage,
    InstanceId, LeaseEpoch, LeaseFence, LeaseStatus, PageLimits, PairFailure, PendingPair,
    PendingThrough, PerspectiveName, PerspectiveStatus, ProgressReport, Rebuild, RecordedEvent,
    Registration, Release, ResourceKey, Result, RetireStates, Retired, RewindDebounce,
    RewindProgress, RewindRequest, SkippedEvent, Snapshot, StateCommit, StoredState, StreamId,
    StreamLockAdmin, Upcasters,
    perspective_store::{DEFAULT_KEEP_SNAPSHOTS, check_progress_limit},
};
use std::time::Duration;

use time::{OffsetDateTime, PrimitiveDateTime};
use tokio::time::Instant;
use uuid::Uuid;

use crate::event_store::InMemoryEventStore;
use lockstep_core::Transaction as _;

use crate::fake_lock::{FakeDatabase, FakeDistributedLock, FakeTransaction, TxEnd};
use crate::stream_locker::InMemoryStreamLocker;

mod versions;

type Key = (StreamId, PerspectiveName);

/// One pair's stored data: its cursor (without the lease, which the locker keeps), state,
/// snapshots and the events it no longer has work for.
#[derive(Debug, Clone, Default)]
struct Pair {
    last_event_id: Option<Uuid>,
    revision: i64,
    applied_count: u64,
    rewind: Option<RewindRequest>,
    error: Option<String>,
    failures: u32,
    failed_event_id: Option<Uuid>,
    retry_at: Option<OffsetDateTime>,
    parked_at: Option<OffsetDateTime>,
    state: Option<serde_json::Value>,
    /// By event id, oldest first.
    snapshots: BTreeMap<Uuid, Snapshot>,
    /// Purged and not rebuilt since: the next claim that finds work turns it into a rewind
    /// from the start (Postgres: status bit 2).
    purged: bool,
    /// By event id. Kept by a purge, deleted with the cursor.
    skipped: BTreeMap<Uuid, SkippedEvent>,
}

impl Pair {
    /// Backing off at `now`, or parked: no batch claims it.
    fn blocked(&self, now: OffsetDateTime) -> bool {
        self.parked_at.is_some() || self.retry_at.is_some_and(|at| at > now)
    }

    /// Clears the parking, the backoff and the failure count (an operator's retry).
    fn unpark(&mut self) {
        self.parked_at = None;
        self.retry_at = None;
        self.failures = 0;
    }
}

#[derive(Debug, Default, Clone)]
struct Staged {
    pairs: HashMap<Key, Pair>,
    registered: BTreeSet<PerspectiveName>,
    done: HashMap<Key, HashSet<Uuid>>,
    /// Retirements, applied at commit before the registrations.
    retire: Vec<(PerspectiveName, RetireStates)>,
    /// Version rows written.
    versions: BTreeMap<(PerspectiveName, u32), lockstep_core::PerspectiveVersion>,
}

/// A rewind's last progress report, as stored.
#[derive(Debug, Clone)]
struct Progress {
    run: Uuid,
    lease: Option<(InstanceId, LeaseEpoch)>,
    replayed: u64,
    to_replay: u64,
    started_at: OffsetDateTime,
    updated_at: OffsetDateTime,
}

#[derive(Debug, Default)]
struct State {
    registered: BTreeSet<PerspectiveName>,
    pairs: HashMap<Key, Pair>,
    /// Events whose work item is gone (applied, purged, or deleted with the cursor), per pair;
    /// kept apart from the pair so that deleting a cursor does not bring its work back.
    done: HashMap<Key, HashSet<Uuid>>,
    /// Perspectives retired with their states kept.
    retired: BTreeSet<PerspectiveName>,
    /// Rewinds' progress, by pair (written at once, not at commit).
    progress: HashMap<Key, Progress>,
    /// Catch-up rates, by perspective (written at once, not at commit): the open window's
    /// start and count, and the last closed window's rate.
    throughput: BTreeMap<PerspectiveName, (OffsetDateTime, u64, Option<f64>)>,
    /// Writes of open transactions, by transaction id.
    staged: HashMap<u64, Staged>,
    /// The page limits of every `rewind_events` call, by pair, in order.
    rewind_pages: HashMap<Key, Vec<PageLimits>>,
    /// Perspective versions, by perspective and version.
    versions: BTreeMap<(PerspectiveName, u32), lockstep_core::PerspectiveVersion>,
}

/// The in-memory perspective store. Clones share state.
#[derive(Clone)]
pub struct InMemoryPerspectiveStore {
    state: Arc<Mutex<State>>,
    events: InMemoryEventStore,
    /// What every event handed out goes through.
    upcasters: Upcasters,
    locker: InMemoryStreamLocker,
    rows: FakeDistributedLock,
    origin: Instant,
    origin_wall: OffsetDateTime,
}

impl fmt::Debug for InMemoryPerspectiveStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock_state();
        f.debug_struct("InMemoryPerspectiveStore")
            .field("perspectives", &state.registered)
            .field("pairs", &state.pairs.len())
            .finish()
    }
}

impl InMemoryPerspectiveStore {
    /// A store over `events` and the cursor rows of `locker`, on transactions of `db`. The
    /// locker should be built with [`InMemoryStreamLocker::with_database`] on the same `db`, so
    /// that lease writes wait for claimed rows and fenced commits work.
    pub fn new(
        db: &FakeDatabase,
        events: &InMemoryEventStore,
        locker: &InMemoryStreamLocker,
    ) -> InMemoryPerspectiveStore {
        InMemoryPerspectiveStore {
            state: Arc::default(),
            events: events.clone(),
            upcasters: Upcasters::new(),
            locker: locker.clone(),
            rows: FakeDistributedLock::new(db),
            origin: Instant::now(),
            origin_wall: OffsetDateTime::now_utc(),
        }
    }

    /// This store (the same state: a clone's), reading every event it hands out through
    /// `upcasters`, as `lockstep-pg-store`'s `PgPerspectiveStore::with_upcasters`: claims,
    /// batches, rewind pages and stream reads give each event in the current shape of its
    /// type; an event an upcaster fails on is unreadable where the answer has room for it
    /// ([`ClaimedWork::Unreadable`], [`Claim::Unreadable`], [`EventPage::unreadable`]), and
    /// fails a stream read with [`ErrorKind::InvalidInput`]. None by default. The event store
    /// it was built over keeps its own (its loads are its own reads).
    pub fn with_upcasters(mut self, upcasters: Upcasters) -> InMemoryPerspectiveStore {
        self.upcasters = upcasters;
        self
    }

    /// The upcasters every event handed out goes through.
    pub fn upcasters(&self) -> &Upcasters {
        &self.upcasters
    }

    /// `events` upcast in order, up to the first an upcaster fails on: that event's id and
    /// why, as the Postgres store words it.
    fn upcast(&self, events: Vec<RecordedEvent>) -> (Vec<RecordedEvent>, Option<(Uuid, String)>) {
        let mut read = Vec::with_capacity(events.len());
        for event in events {
            let event_id = event.event_id;
            match self.upcasters.upcast(event) {
                Ok(event) => read.push(event),
                Err(err) => {
                    return (
                        read,
                        Some((
                            event_id,
                            lockstep_core::perspective_store::unreadable_event_message(
                                event_id, &err,
                            ),
                        )),
                    );
                }
            }
        }
        (read, None)
    }

    /// The event store the work is derived from.
    pub fn events(&self) -> &InMemoryEventStore {
        &self.events
    }

    /// The locker whose cursor rows this store shares.
    pub fn locker(&self) -> &InMemoryStreamLocker {
        &self.locker
    }

    /// The committed state of a pair, outside any transaction (for assertions).
    pub fn committed_state(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Option<serde_json::Value> {
        self.lock_state()
            .pairs
            .get(&(stream_id, perspective.clone()))
            .and_then(|p| p.state.clone())
    }

    /// The page limits of every [`lockstep_core::RewindReads::rewind_events`] call for `pair`, in order
    /// (a rewind's first page included: the default `load_rewind` reads it with this call) —
    /// what a rewind asked for, for tests.
    pub fn rewind_page_requests(&self, pair: &lockstep_core::Pair) -> Vec<PageLimits> {
        self.lock_state()
            .rewind_pages
            .get(&(pair.stream_id, pair.perspective.clone()))
            .cloned()
            .unwrap_or_default()
    }

    fn lock_state(&self) -> MutexGuard<'_, State> {
        // Every update completes under the guard, so a poisoned state is consistent.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn now(&self) -> OffsetDateTime {
        let elapsed = Instant::now().saturating_duration_since(self.origin);
        time::Duration::try_from(elapsed)
            .ok()
            .and_then(|d| self.origin_wall.checked_add(d))
            .unwrap_or(self.origin_wall)
    }

    /// The cursor-row lock key, the one [`InMemoryStreamLocker`] waits on.
    fn row_key(stream_id: StreamId, perspective: &PerspectiveName) -> ResourceKey {
        // Bounded: a UUID and a perspective name of at most 200 characters.
        ResourceKey::new(format!("lockstep:cursor-row:{stream_id}:{perspective}"))
            .unwrap_or_else(|e| unreachable!("cursor row key is valid: {e}"))
    }

    /// Applies a committed retirement of `name`.
    fn retired_at_commit(
        state: &mut State,
        locker: &InMemoryStreamLocker,
        name: &PerspectiveName,
        states: RetireStates,
    ) {
        state.registered.remove(name);
        match states {
            RetireStates::Keep => {
                state.retired.insert(name.clone());
            }
            RetireStates::Drop => {
                state.retired.remove(name);
                let gone: Vec<Key> = state
                    .pairs
                    .keys()
                    .filter(|k| &k.1 == name)
                    .cloned()
                    .collect();
                for key in gone {
                    state.pairs.remove(&key);
                    locker.delete_cursor(key.0, &key.1);
                }
                state.done.retain(|k, _| &k.1 != name);
                state.progress.retain(|k, _| &k.1 != name);
                state.throughput.remove(name);
            }
        }
    }

    /// The pairs of `name` as Postgres has cursors for them: every stream, and every pair `tx`
    /// sees a cursor of.
    fn pairs_of(&self, state: &State, tx: &FakeTransaction, name: &PerspectiveName) -> Vec<Key> {
        let mut pairs: BTreeSet<Key> = self
            .events
            .streams()
            .into_iter()
            .map(|s| (s, name.clone()))
            .collect();
        pairs.extend(Self::keys(state, tx).into_iter().filter(|k| &k.1 == name));
        pairs.into_iter().collect()
    }

    fn retired_in(state: &State, tx: &FakeTransaction, name: &PerspectiveName) -> bool {
        let staged = state.staged.get(&tx.id());
        if staged.is_some_and(|s| s.registered.contains(name)) {
            return false;
        }
        if let Some(last) = staged.and_then(|s| s.retire.iter().rev().find(|(n, _)| n == name)) {
            return last.1 == RetireStates::Keep;
        }
        state.retired.contains(name)
    }

    /// Installs the commit hook of `tx` once.
    fn stage<'s>(&self, state: &'s mut State, tx: &FakeTransaction) -> &'s mut Staged {
        let id = tx.id();
        if !state.staged.contains_key(&id) {
            let shared = Arc::clone(&self.state);
            let locker = self.locker.clone();
            tx.on_end(move |end| {
                let mut state = shared
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let staged = state.staged.remove(&id);
                if let (Some(staged), TxEnd::Committed) = (staged, end) {
                    for (name, states) in staged.retire {
                        Self::retired_at_commit(&mut state, &locker, &name, states);
                    }
                    for name in &staged.registered {
                        state.retired.remove(name);
                    }
                    state.registered.extend(staged.registered);
                    state.versions.extend(staged.versions);
                    state.pairs.extend(staged.pairs);
                    for (key, ids) in staged.done {
                        state.done.entry(key).or_default().extend(ids);
                    }
                }
            });
        }
        state.staged.entry(id).or_default()
    }

    /// The pair as `tx` sees it (its own staged write, else the committed one).
    fn read(state: &State, tx: &FakeTransaction, key: &Key) -> Option<Pair> {
        state
            .staged
            .get(&tx.id())
            .and_then(|s| s.pairs.get(key))
            .or_else(|| state.pairs.get(key))
            .cloned()
    }

    fn registered(state: &State, tx: &FakeTransaction, name: &PerspectiveName) -> bool {
        state.registered.contains(name)
            || state
                .staged
                .get(&tx.id())
                .is_some_and(|s| s.registered.contains(name))
    }

    /// Writes `pair` for `tx` (visible to others at commit).
    fn write(&self, tx: &FakeTransaction, key: Key, pair: Pair) {
        let mut state = self.lock_state();
        self.stage(&mut state, tx).pairs.insert(key, pair);
    }

    /// Completes the work items of `ids` for `tx` (gone for others at commit).
    fn complete(&self, tx: &FakeTransaction, key: Key, ids: impl IntoIterator<Item = Uuid>) {
        let mut state = self.lock_state();
        self.stage(&mut state, tx)
            .done
            .entry(key)
            .or_default()
            .extend(ids);
    }

    /// Takes the pair's row lock for `tx`, waiting like an `UPDATE`.
    async fn lock_row(&self, tx: &FakeTransaction, key: &Key) -> Result<()> {
        self.rows
            .acquire_for_transaction(tx, &Self::row_key(key.0, &key.1), None)
            .await
    }

    /// The pair's lease columns and whether its lease is live.
    async fn lease(&self, key: &Key) -> Result<(CursorLease, bool)> {
        let lease = self
            .locker
            .inspect(key.0, &key.1)
            .await?
            .unwrap_or(CursorLease {
                holder: None,
                reason: None,
                expires_at: None,
                epoch: LeaseEpoch::new(0),
            });
        let live = lease.holder.is_some()
            && self.locker.list_leases().await?.iter().any(|l| {
                l.stream_id == key.0 && l.perspective == key.1 && l.status == LeaseStatus::Held
            });
        Ok((lease, live))
    }

    fn pending(&self, state: &State, tx: &FakeTransaction, key: &Key) -> Vec<RecordedEvent> {
        if !Self::registered(state, tx, &key.1) {
            return Vec::new();
        }
        let committed = state.done.get(key);
        let staged = state.staged.get(&tx.id()).and_then(|s| s.done.get(key));
        let mut events: Vec<RecordedEvent> = self
            .events
            .committed(key.0)
            .into_iter()
            .filter(|e| {
                !committed.is_some_and(|d| d.contains(&e.event_id))
                    && !staged.is_some_and(|d| d.contains(&e.event_id))
            })
            .collect();
        events.sort_by_key(|e| e.event_id);
        events
    }

    fn cursor_of(key: &Key, pair: &Pair, lease: CursorLease) -> Cursor {
        let mut cursor = Cursor::new(lockstep_core::Pair::new(key.0, key.1.clone()));
        cursor.last_event_id = pair.last_event_id;
        cursor.revision = pair.revision;
        cursor.applied_count = pair.applied_count;
        cursor.rewind = pair.rewind;
        cursor.error = pair.error.clone();
        cursor.failures = pair.failures;
        cursor.failed_event_id = pair.failed_event_id;
        cursor.retry_at = pair.retry_at;
        cursor.parked_at = pair.parked_at;
        cursor.latest_snapshot = pair.snapshots.keys().next_back().copied();
        cursor.lease = lease;
        cursor
    }

    /// Makes sure the pair has a cursor row (the locker's and ours).
    fn create(&self, tx: &FakeTransaction, key: &Key) -> bool {
        self.locker.create_cursor(key.0, &key.1);
        let exists = Self::read(&self.lock_state(), tx, key).is_some();
        if !exists {
            self.lock_state().pairs.entry(key.clone()).or_default();
        }
        !exists
    }

    async fn fence(
        &self,
        tx: &FakeTransaction,
        fence: Option<&lockstep_core::LeaseId>,
    ) -> Result<()> {
        match fence {
            Some(lease) => self.locker.check_lease(tx, lease).await,
            None => Ok(()),
        }
    }

    fn missing(key: &Key) -> Error {
        Error::new(
            ErrorKind::InvalidInput,
            format!("no cursor for stream {} and perspective {}", key.0, key.1),
        )
    }

    /// Moves the pair's rewind request to `trigger` if that is earlier (or sets it).
    fn flag(pair: &mut Pair, trigger: Uuid, now: OffsetDateTime) {
        pair.rewind = Some(match pair.rewind {
            Some(r) => RewindRequest {
                trigger: r.trigger.min(trigger),
                flagged_at: now,
                first_flagged_at: r.first_flagged_at,
            },
            None => RewindRequest {
                trigger,
                flagged_at: now,
                first_flagged_at: now,
            },
        });
    }

    fn debounced(&self, rewind: &RewindRequest, debounce: RewindDebounce) -> bool {
        debounce.holds_back(rewind, self.now())
    }

    /// Turns a purged pair's new work or a late arrival into a rewind request (staged for
    /// `tx`), as every claim does before deciding what to hand out.
    fn flag_if_needed(
        &self,
        tx: &FakeTransaction,
        key: &Key,
        pair: &mut Pair,
        pending: &[RecordedEvent],
    ) {
        // A purged pair that has work again is rebuilt from the start of the stream, never
        // folded from the events after the purge alone.
        if pair.purged && !pending.is_empty() {
            pair.purged = false;
            Self::flag(pair, Uuid::nil(), self.now());
            self.write(tx, key.clone(), pair.clone());
        }
        let late = pair
            .last_event_id
            .and_then(|last| pending.iter().map(|e| e.event_id).find(|id| *id < last));
        if let Some(trigger) = late.filter(|t| pair.rewind.is_none_or(|r| *t < r.trigger)) {
            Self::flag(pair, trigger, self.now());
            self.write(tx, key.clone(), pair.clone());
        }
    }

    /// The streams of `perspective` whose pair has pending work for `tx`, in stream order.
    fn with_work(&self, tx: &FakeTransaction, perspective: &PerspectiveName) -> Vec<StreamId> {
        let state = self.lock_state();
        if !Self::registered(&state, tx, perspective) {
            return Vec::new();
        }
        let mut streams: BTreeSet<StreamId> = self.events.streams().into_iter().collect();
        streams.extend(
            state
                .pairs
                .keys()
                .filter(|(_, p)| p == perspective)
                .map(|(s, _)| *s),
        );
        streams
            .into_iter()
            .filter(|s| {
                !self
                    .pending(&state, tx, &(*s, perspective.clone()))
                    .is_empty()
            })
            .collect()
    }

    /// Every pair `tx` sees a cursor of: committed, created, or staged by `tx`.
    fn keys(state: &State, tx: &FakeTransaction) -> BTreeSet<Key> {
        let mut keys: BTreeSet<Key> = state.pairs.keys().cloned().collect();
        if let Some(staged) = state.staged.get(&tx.id()) {
            keys.extend(staged.pairs.keys().cloned());
        }
        keys
    }

    /// Tries to claim one pair for a batch (see [`lockstep_core::WorkQueue::claim_batch`]).
    async fn take(
        &self,
        tx: &FakeTransaction,
        key: &Key,
        debounce: RewindDebounce,
        limits: &BatchLimits,
        budget: &mut Budget,
    ) -> Result<Taken> {
        let now = self.now();
        // What the statement's WHERE filters out before it locks anything.
        if Self::read(&self.lock_state(), tx, key).is_some_and(|p| p.blocked(now)) {
            return Ok(Taken::Passed);
        }
        if !self
            .rows
            .try_acquire_for_transaction(tx, &Self::row_key(key.0, &key.1))
            .await?
        {
            return Ok(Taken::Passed);
        }
        self.create(tx, key);
        let (lease, live) = self.lease(key).await?;
        let (mut pair, pending) = {
            let state = self.lock_state();
            (
                Self::read(&state, tx, key).unwrap_or_default(),
                self.pending(&state, tx, key),
            )
        };
        if live || pair.blocked(now) {
            return Ok(Taken::Passed);
        }
        self.flag_if_needed(tx, key, &mut pair, &pending);
        if let Some(rewind) = &pair.rewind {
            if self.debounced(rewind, debounce) {
                return Ok(Taken::Passed);
            }
            return Ok(Taken::Claimed(Box::new(ClaimedPair::new(
                Self::cursor_of(key, &pair, lease),
                ClaimedWork::Rewind,
            ))));
        }
        let Some(first) = pending.first() else {
            return Ok(Taken::Passed);
        };
        let state_size = pair.state.as_ref().map_or(0, size);
        // The batch's first event is always taken, whatever its size (it could never be
        // applied otherwise); later pairs only when their state and first event fit.
        if budget.events > 0
            && budget
                .bytes
                .saturating_add(state_size.saturating_add(size(&first.payload)))
                > limits.bytes
        {
            return Ok(Taken::NoRoom);
        }
        budget.bytes = budget.bytes.saturating_add(state_size);
        // A pair that failed at a pending event is handed out up to that event only (its
        // retry costs what the failing event costs); with nothing pending up to it, as usual.
        let upto = pair
            .failed_event_id
            .filter(|failed| pair.failures > 0 && first.event_id <= *failed);
        let mut events = Vec::new();
        for event in pending {
            if events.len() >= limits.events_per_pair
                || budget.events >= limits.events
                || upto.is_some_and(|failed| event.event_id > failed)
            {
                break;
            }
            let bytes = budget.bytes.saturating_add(size(&event.payload));
            if budget.events > 0 && bytes > limits.bytes {
                break;
            }
            budget.bytes = bytes;
            budget.events += 1;
            events.push(event);
        }
        let cursor = Self::cursor_of(key, &pair, lease);
        let work = match self.upcast(events) {
            (events, None) => ClaimedWork::Apply {
                state: pair.state,
                events,
            },
            (events, Some((event_id, error))) => ClaimedWork::Unreadable {
                state: pair.state,
                events,
                event_id,
                error,
            },
        };
        Ok(Taken::Claimed(Box::new(ClaimedPair::new(cursor, work))))
    }

    /// A state change on a pair whose state was checked: a refusal (`Conflict`, `LeaseLost`)
    /// writes nothing.
    async fn commit_checked(&self, tx: &FakeTransaction, commit: &StateCommit) -> Result<i64> {
        let key = (commit.pair.stream_id, commit.pair.perspective.clone());
        self.lock_row(tx, &key).await?;
        self.fence(tx, commit.fence.as_ref()).await?;
        let Some(mut pair) = Self::read(&self.lock_state(), tx, &key) else {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!("stream {} perspective {}: the cursor is gone", key.0, key.1),
            ));
        };
        if pair.revision != commit.expected_revision {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "stream {} perspective {}: expected revision {}, found {}",
                    key.0, key.1, commit.expected_revision, pair.revision
                ),
            ));
        }
        pair.revision += 1;
        pair.state = Some(commit.state.clone());
        pair.last_event_id = commit.last_event_id;
        pair.applied_count = commit.applied_count;
        pair.error = None;
        pair.failed_event_id = None;
        pair.unpark();
        if let Some(trigger) = commit.rewound_from {
            pair.snapshots.retain(|id, _| *id < trigger);
            if pair.rewind.is_some_and(|r| r.trigger == trigger) {
                pair.rewind = None;
            }
        }
        if commit.snapshot
            && let Some(at) = commit.last_event_id
        {
            pair.snapshots.insert(
                at,
                Snapshot {
                    event_id: at,
                    state: commit.state.clone(),
                    applied_count: commit.applied_count,
                },
            );
            while pair.snapshots.len() > DEFAULT_KEEP_SNAPSHOTS {
                pair.snapshots.pop_first();
            }
        }
        let revision = pair.revision;
        self.complete(tx, key.clone(), commit.applied_events.iter().copied());
        self.write(tx, key, pair);
        Ok(revision)
    }

    /// Stores a failure on the pair (creating its cursor); whether it is now parked.
    async fn fail(&self, tx: &FakeTransaction, key: &Key, failure: &PairFailure) -> Result<bool> {
        self.lock_row(tx, key).await?;
        self.create(tx, key);
        let mut pair = Self::read(&self.lock_state(), tx, key).unwrap_or_default();
        let now = self.now();
        pair.error = Some(failure.error.replace('\0', "\u{FFFD}"));
        pair.failures = pair.failures.saturating_add(1);
        pair.failed_event_id = failure.event_id;
        pair.retry_at = Some(later(now, failure.retry_after));
        if failure.park {
            pair.parked_at = pair.parked_at.or(Some(now));
        }
        let parked = pair.parked_at.is_some();
        self.write(tx, key.clone(), pair);
        Ok(parked)
    }

    /// The entries of a batch commit, checked (see [`lockstep_core::WorkQueue::commit_batch`]).
    async fn commit_entries(
        &self,
        tx: &FakeTransaction,
        entries: &[BatchEntry],
    ) -> Result<Vec<BatchCommitted>> {
        let mut done = Vec::with_capacity(entries.len());
        for entry in entries {
            let key = (entry.pair.stream_id, entry.pair.perspective.clone());
            let revision = match &entry.commit {
                Some(commit) => match self.commit_checked(tx, commit).await {
                    Ok(revision) => Some(revision),
                    Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::LeaseLost) => {
                        done.push(BatchCommitted::Refused(e.kind()));
                        continue;
                    }
                    Err(e) => return Err(e),
                },
                None => None,
            };
            let parked = match &entry.failure {
                Some(failure) => self.fail(tx, &key, failure).await?,
                None => false,
            };
            done.push(match revision {
                Some(revision) => BatchCommitted::Committed { revision, parked },
                None => BatchCommitted::FailureRecorded { parked },
            });
        }
        Ok(done)
    }
}

/// What a batch handed out so far.
#[derive(Debug, Default)]
struct Budget {
    events: usize,
    bytes: u64,
}

/// One pair's outcome in a batch claim.
enum Taken {
    Claimed(Box<ClaimedPair>),
    /// Not claimable now (locked, leased, backing off, parked, debounced, no work left).
    Passed,
    /// Its state and first event do not fit the bytes left: the batch is full.
    NoRoom,
}

/// The size the byte bound counts for a value: its JSON text.
fn size(value: &serde_json::Value) -> u64 {
    serde_json::to_string(value).map_or(0, |text| text.len() as u64)
}

/// `now + wait`, or the calendar's last instant when that is past it.
fn later(now: OffsetDateTime, wait: std::time::Duration) -> OffsetDateTime {
    time::Duration::try_from(wait)
        .ok()
        .and_then(|d| now.checked_add(d))
        .unwrap_or(PrimitiveDateTime::MAX.assume_utc())
}

/// Refuses a state Postgres could not store or read back (U+0000, nested deeper than
/// [`lockstep_core::json::MAX_DEPTH`]), with the same typed error as the Postgres store.
fn check_state(state: &serde_json::Value) -> Result<()> {
    lockstep_core::json::check_storable(state, "perspective state")
}

impl WorkQueue<FakeTransaction> for InMemoryPerspectiveStore {
    async fn claim_batch(
        &self,
        tx: &FakeTransaction,
        request: &BatchClaim,
    ) -> Result<ClaimedBatch> {
        tx.check_usable()?;
        let limits = request.limits;
        limits.validate()?;
        let debounce = request.debounce;
        let mut budget = Budget::default();
        let mut batch = ClaimedBatch::default();
        // The clock the event store writes `recorded_at` with.
        batch.claimed_at = Some(OffsetDateTime::now_utc());
        let mut claimed: HashSet<Key> = HashSet::new();
        let full = |batch: &ClaimedBatch, budget: &Budget| {
            batch.pairs.len() >= limits.pairs
                || budget.events >= limits.events
                || budget.bytes >= limits.bytes
        };

        // Rewind requests first, oldest first: a request on a pair without pending work is
        // in no work walk. Bounded by `pairs`, not by `scan`: only servable ones are looked at,
        // and no more of them than the batch has room for pairs — one another claim holds is
        // not replaced by the next (Postgres's `LIMIT` on the candidates, in
        // `lockstep_perspective_claim_pairs`).
        let requested: Vec<Key> = {
            let now = self.now();
            let leased: HashSet<Key> = self
                .locker
                .list_leases()
                .await?
                .into_iter()
                .filter(|l| l.status == LeaseStatus::Held)
                .map(|l| (l.stream_id, l.perspective))
                .collect();
            let state = self.lock_state();
            let mut found: Vec<(OffsetDateTime, Key)> = Self::keys(&state, tx)
                .into_iter()
                .filter(|key| request.positions.iter().any(|(p, _)| *p == key.1))
                .filter(|key| !leased.contains(key))
                .filter_map(|key| {
                    let pair = Self::read(&state, tx, &key)?;
                    let rewind = pair.rewind?;
                    (!pair.blocked(now) && !self.debounced(&rewind, debounce))
                        .then_some((rewind.flagged_at, key))
                })
                .collect();
            found.sort();
            found.into_iter().map(|(_, key)| key).collect()
        };
        for key in requested.into_iter().take(limits.pairs) {
            if full(&batch, &budget) {
                break;
            }
            if let Taken::Claimed(pair) =
                self.take(tx, &key, debounce, &limits, &mut budget).await?
            {
                claimed.insert(key);
                batch.pairs.push(*pair);
            }
        }

        // Then each perspective's work, in stream order from its position, wrapping round once.
        let mut looked = 0usize;
        let mut stopped = false;
        for (perspective, position) in &request.positions {
            let mut last = *position;
            let mut streams = if stopped {
                Vec::new()
            } else {
                self.with_work(tx, perspective)
            };
            let after = position.map_or(0, |p| streams.partition_point(|s| *s <= p));
            streams.rotate_left(after);
            for stream in streams {
                let key = (stream, perspective.clone());
                if claimed.contains(&key) {
                    continue;
                }
                if full(&batch, &budget) || looked >= limits.scan {
                    stopped = true;
                    break;
                }
                looked += 1;
                match self.take(tx, &key, debounce, &limits, &mut budget).await? {
                    Taken::Claimed(pair) => {
                        claimed.insert(key);
                        batch.pairs.push(*pair);
                    }
                    Taken::Passed => {}
                    // Not moved past: the next claim starts with this pair.
                    Taken::NoRoom => {
                        stopped = true;
                        break;
                    }
                }
                last = Some(stream);
            }
            batch.positions.push((perspective.clone(), last));
        }
        Ok(batch)
    }

    async fn commit_batch(
        &self,
        tx: &FakeTransaction,
        entries: &[BatchEntry],
    ) -> Result<Vec<BatchCommitted>> {
        tx.check_usable()?;
        for (i, entry) in entries.iter().enumerate() {
            let bad = |what: String| {
                Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!("batch entry {i} ({}): {what}", entry.pair),
                ))
            };
            match &entry.commit {
                Some(commit) => {
                    if commit.pair != entry.pair {
                        return bad(format!("a commit of another pair ({})", commit.pair));
                    }
                    check_state(&commit.state)?;
                }
                None if entry.failure.is_none() => {
                    return bad("neither a commit nor a failure".to_owned());
                }
                None => {}
            }
        }
        // One statement on Postgres: an error part-way writes none of the entries.
        let before = self.lock_state().staged.get(&tx.id()).cloned();
        let result = self.commit_entries(tx, entries).await;
        if result.is_err() {
            let mut state = self.lock_state();
            if let Some(staged) = state.staged.get_mut(&tx.id()) {
                *staged = before.unwrap_or_default();
            }
        }
        result
    }

    async fn record_failure(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
        failure: &PairFailure,
    ) -> Result<bool> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        self.fail(tx, &(stream_id, perspective.clone()), failure)
            .await
    }
}

impl PairWork<FakeTransaction> for InMemoryPerspectiveStore {
    async fn claim(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
        max_events: usize,
        debounce: RewindDebounce,
    ) -> Result<Claim> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        let key = (stream_id, perspective.clone());
        if !self
            .rows
            .try_acquire_for_transaction(tx, &Self::row_key(stream_id, perspective))
            .await?
        {
            return Ok(Claim::Busy);
        }
        self.create(tx, &key);
        let (lease, live) = self.lease(&key).await?;
        if live {
            return Ok(Claim::Busy);
        }
        let (mut pair, pending) = {
            let state = self.lock_state();
            (
                Self::read(&state, tx, &key).unwrap_or_default(),
                self.pending(&state, tx, &key),
            )
        };
        self.flag_if_needed(tx, &key, &mut pair, &pending);
        if let Some(rewind) = &pair.rewind {
            if self.debounced(rewind, debounce) {
                return Ok(Claim::Idle);
            }
            return Ok(Claim::Rewind {
                cursor: Self::cursor_of(&key, &pair, lease),
            });
        }
        if pending.is_empty() {
            return Ok(Claim::Idle);
        }
        let events: Vec<RecordedEvent> = pending.into_iter().take(max_events).collect();
        let cursor = Self::cursor_of(&key, &pair, lease);
        Ok(match self.upcast(events) {
            (events, None) => Claim::Apply {
                cursor,
                state: pair.state,
                events,
                // The clock the event store writes `recorded_at` with.
                claimed_at: Some(OffsetDateTime::now_utc()),
            },
            (events, Some((event_id, error))) => Claim::Unreadable {
                cursor,
                state: pair.state,
                events,
                event_id,
                error,
            },
        })
    }

    async fn commit(
        &self,
        tx: FakeTransaction,
        commit: &StateCommit,
        release: Release,
    ) -> Result<Committed> {
        let changed = async {
            tx.check_usable()?;
            check_state(&commit.state)?;
            self.commit_checked(&tx, commit).await
        };
        let revision = match changed.await {
            Ok(revision) => revision,
            Err(refused) => {
                // Nothing of the transaction commits: dropping it rolls it back.
                drop(tx);
                return Err(refused);
            }
        };
        let released = Arc::new(AtomicBool::new(false));
        if let (Release::Lease, Some(lease)) = (release, commit.fence.clone()) {
            // At the commit, before the row lock the fence took is let go: no other
            // transaction sees the new state with the lease still held.
            let locker = self.locker.clone();
            let done = Arc::clone(&released);
            tx.on_end(move |end| {
                if end == TxEnd::Committed && locker.release_at_commit(&lease) {
                    done.store(true, Ordering::Release);
                }
            });
        }
        tx.commit().await?;
        Ok(Committed::new(revision, released.load(Ordering::Acquire)))
    }

    async fn save_snapshot(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
        expected_revision: i64,
        fence: Option<&lockstep_core::LeaseId>,
    ) -> Result<bool> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        let key = (stream_id, perspective.clone());
        self.lock_row(tx, &key).await?;
        self.fence(tx, fence).await?;
        let Some(mut pair) = Self::read(&self.lock_state(), tx, &key) else {
            return Ok(false);
        };
        let (Some(at), Some(state)) = (pair.last_event_id, pair.state.clone()) else {
            return Ok(false);
        };
        if pair.revision != expected_revision || pair.snapshots.contains_key(&at) {
            return Ok(false);
        }
        pair.snapshots.insert(
            at,
            Snapshot {
                event_id: at,
                state,
                applied_count: pair.applied_count,
            },
        );
        while pair.snapshots.len() > DEFAULT_KEEP_SNAPSHOTS {
            pair.snapshots.pop_first();
        }
        self.write(tx, key, pair);
        Ok(true)
    }

    async fn purge(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
        fence: Option<&lockstep_core::LeaseId>,
    ) -> Result<()> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        let key = (stream_id, perspective.clone());
        self.lock_row(tx, &key).await?;
        self.fence(tx, fence).await?;
        let pair = Self::read(&self.lock_state(), tx, &key).ok_or_else(|| Self::missing(&key))?;
        let purged = Pair {
            revision: pair.revision + 1,
            purged: true,
            skipped: pair.skipped,
            ..Pair::default()
        };
        let all = self
            .events
            .committed(stream_id)
            .into_iter()
            .map(|e| e.event_id);
        self.complete(tx, key.clone(), all);
        self.write(tx, key, purged);
        Ok(())
    }
}

impl PerspectiveReads<FakeTransaction> for InMemoryPerspectiveStore {
    async fn cursor(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
    ) -> Result<Option<Cursor>> {
        Ok(self.state(tx, pair).await?.map(|(cursor, _)| cursor))
    }

    async fn state(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
    ) -> Result<Option<(Cursor, Option<serde_json::Value>)>> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        let key = (stream_id, perspective.clone());
        let Some(pair) = Self::read(&self.lock_state(), tx, &key) else {
            return Ok(None);
        };
        let (lease, _) = self.lease(&key).await?;
        let state = pair.state.clone();
        Ok(Some((Self::cursor_of(&key, &pair, lease), state)))
    }

    async fn pending_events(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
    ) -> Result<Vec<Uuid>> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        let state = self.lock_state();
        Ok(self
            .pending(&state, tx, &(stream_id, perspective.clone()))
            .into_iter()
            .map(|e| e.event_id)
            .collect())
    }

    async fn stream_events(
        &self,
        tx: &FakeTransaction,
        stream_id: StreamId,
        after: Option<Uuid>,
    ) -> Result<Vec<RecordedEvent>> {
        tx.check_usable()?;
        let mut events: Vec<RecordedEvent> = self
            .events
            .committed(stream_id)
            .into_iter()
            .filter(|e| after.is_none_or(|a| e.event_id > a))
            .collect();
        events.sort_by_key(|e| e.event_id);
        events
            .into_iter()
            .map(|event| self.upcasters.upcast(event))
            .collect()
    }

    async fn states(
        &self,
        tx: &FakeTransaction,
        perspective: &PerspectiveName,
        after: Option<StreamId>,
        limit: usize,
    ) -> Result<Vec<StoredState>> {
        lockstep_core::check_states_page(limit)?;
        tx.check_usable()?;
        let mut page: Vec<(Key, Pair)> = {
            let state = self.lock_state();
            Self::keys(&state, tx)
                .into_iter()
                .filter(|key| key.1 == *perspective && after.is_none_or(|a| key.0 > a))
                .filter_map(|key| {
                    let pair = Self::read(&state, tx, &key)?;
                    pair.state.is_some().then_some((key, pair))
                })
                .collect()
        };
        page.sort_by_key(|(key, _)| key.0);
        page.truncate(limit);
        let mut out = Vec::with_capacity(page.len());
        for (key, pair) in page {
            let (lease, _) = self.lease(&key).await?;
            let state = pair.state.clone().unwrap_or(serde_json::Value::Null);
            out.push(StoredState::new(Self::cursor_of(&key, &pair, lease), state));
        }
        Ok(out)
    }

    async fn pending_through(
        &self,
        tx: &FakeTransaction,
        perspective: &PerspectiveName,
        stream_id: Option<StreamId>,
        up_to: Uuid,
    ) -> Result<PendingThrough> {
        tx.check_usable()?;
        let state = self.lock_state();
        let streams: BTreeSet<StreamId> = match stream_id {
            Some(stream) => BTreeSet::from([stream]),
            None => {
                let mut streams: BTreeSet<StreamId> = self.events.streams().into_iter().collect();
                streams.extend(
                    Self::keys(&state, tx)
                        .into_iter()
                        .filter(|k| k.1 == *perspective)
                        .map(|k| k.0),
                );
                streams
            }
        };
        let mut out = PendingThrough::default();
        for stream in streams {
            let key = (stream, perspective.clone());
            let events = self
                .pending(&state, tx, &key)
                .iter()
                .filter(|e| e.event_id <= up_to)
                .count() as u64;
            let pair = Self::read(&state, tx, &key);
            let rewind = pair
                .as_ref()
                .is_some_and(|p| p.rewind.is_some_and(|r| r.trigger <= up_to));
            out.events += events;
            out.rewinds += u64::from(rewind);
            if (events > 0 || rewind)
                && let Some(pair) = pair
            {
                out.parked += u64::from(pair.parked_at.is_some());
                if out.error.is_none() {
                    out.error = pair.error.clone();
                }
            }
        }
        out.registration = Some(if Self::registered(&state, tx, perspective) {
            Registration::Registered
        } else if state.retired.contains(perspective) {
            Registration::Retired
        } else {
            Registration::NotRegistered
        });
        drop(state);
        out.live_workers = Some(self.locker.live_instances_running(perspective));
        Ok(out)
    }

    async fn skipped_events(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
    ) -> Result<Vec<SkippedEvent>> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        let pair = Self::read(&self.lock_state(), tx, &(stream_id, perspective.clone()));
        Ok(pair.map_or_else(Vec::new, |p| p.skipped.into_values().collect()))
    }
}

impl RewindReads<FakeTransaction> for InMemoryPerspectiveStore {
    async fn rewind_events(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
        after: Option<Uuid>,
        page: PageLimits,
    ) -> Result<EventPage> {
        // The trait's default read on the events as stored (their sizes are the stored
        // payloads', as on Postgres), recording what was asked for; then the page's events
        // are upcast, and the first an upcaster fails on ends it.
        self.lock_state()
            .rewind_pages
            .entry((pair.stream_id, pair.perspective.clone()))
            .or_default()
            .push(page);
        let stored = InMemoryPerspectiveStore {
            upcasters: Upcasters::new(),
            ..self.clone()
        };
        let page = lockstep_core::perspective_store::rewind_page_from_stream(
            &stored, tx, pair, after, page,
        )
        .await?;
        Ok(match self.upcast(page.events) {
            (events, None) => EventPage::new(events, page.more),
            (events, Some(unreadable)) => {
                let mut cut = EventPage::new(events, false);
                cut.unreadable = Some(unreadable);
                cut
            }
        })
    }

    async fn snapshot_before(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
        before: Uuid,
    ) -> Result<Option<Snapshot>> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        let pair = Self::read(&self.lock_state(), tx, &(stream_id, perspective.clone()));
        Ok(pair.and_then(|p| {
            p.snapshots
                .range(..before)
                .next_back()
                .map(|(_, s)| s.clone())
        }))
    }

    async fn record_progress(&self, tx: &FakeTransaction, report: &ProgressReport) -> Result<()> {
        tx.check_usable()?;
        report.validate()?;
        let now = self.now();
        let key = (report.pair.stream_id, report.pair.perspective.clone());
        let mut state = self.lock_state();
        let start = time::Duration::try_from(report.elapsed)
            .ok()
            .and_then(|d| now.checked_sub(d))
            .unwrap_or(now);
        let started_at = state
            .progress
            .get(&key)
            .filter(|p| p.run == report.run)
            .map_or(start, |p| p.started_at);
        state.progress.insert(
            key,
            Progress {
                run: report.run,
                lease: report.lease.as_ref().map(|l| (l.holder, l.epoch)),
                replayed: report.replayed,
                to_replay: report.to_replay,
                started_at,
                updated_at: now,
            },
        );
        Ok(())
    }
}

impl PerspectiveAdmin<FakeTransaction> for InMemoryPerspectiveStore {
    async fn request_rewind(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
        from: Option<Uuid>,
    ) -> Result<bool> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        let key = (stream_id, perspective.clone());
        if Self::read(&self.lock_state(), tx, &key).is_none() {
            return Ok(false);
        }
        self.lock_row(tx, &key).await?;
        let Some(mut pair) = Self::read(&self.lock_state(), tx, &key) else {
            return Ok(false);
        };
        Self::flag(&mut pair, from.unwrap_or(Uuid::nil()), self.now());
        // An operator's rewind is also a retry: a parked or backing-off pair is served.
        pair.unpark();
        self.write(tx, key, pair);
        Ok(true)
    }

    async fn perspective_status(&self, tx: &FakeTransaction) -> Result<Vec<PerspectiveStatus>> {
        tx.check_usable()?;
        let now = self.now();
        let wall = OffsetDateTime::now_utc();
        let state = self.lock_state();
        let mut names: BTreeSet<PerspectiveName> = state.registered.clone();
        if let Some(staged) = state.staged.get(&tx.id()) {
            names.extend(staged.registered.iter().cloned());
        }
        let streams = self.events.streams();
        let keys = Self::keys(&state, tx);
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            // Postgres gives every stream a cursor per registered perspective (the append, the
            // registration's catch-up); ensure_cursor adds the others.
            let mut pairs: BTreeSet<Key> = streams.iter().map(|s| (*s, name.clone())).collect();
            pairs.extend(keys.iter().filter(|k| k.1 == name).cloned());
            let mut status = PerspectiveStatus::new(name);
            status.pairs = pairs.len() as u64;
            let mut oldest: Option<OffsetDateTime> = None;
            for key in &pairs {
                let pending = self.pending(&state, tx, key);
                status.pending_events += pending.len() as u64;
                if let Some(first) = pending.iter().map(|e| e.recorded_at).min() {
                    oldest = Some(oldest.map_or(first, |o| o.min(first)));
                }
                let Some(pair) = Self::read(&state, tx, key) else {
                    continue;
                };
                status.rewinds_pending += u64::from(pair.rewind.is_some());
                status.in_error += u64::from(pair.error.is_some() && pair.failures > 0);
                status.parked += u64::from(pair.parked_at.is_some());
                status.backing_off +=
                    u64::from(pair.parked_at.is_none() && pair.retry_at.is_some_and(|at| at > now));
            }
            // Events carry the wall clock; a clock that went back is no wait.
            status.oldest_pending_age =
                oldest.map(|at| Duration::try_from(wall - at).unwrap_or(Duration::ZERO));
            out.push(status);
        }
        Ok(out)
    }

    async fn failing_pairs(
        &self,
        tx: &FakeTransaction,
        perspectives: &[PerspectiveName],
        limit: usize,
    ) -> Result<Vec<Cursor>> {
        tx.check_usable()?;
        let mut failing: Vec<(Key, Pair)> = {
            let state = self.lock_state();
            Self::keys(&state, tx)
                .into_iter()
                .filter(|key| perspectives.is_empty() || perspectives.contains(&key.1))
                .filter_map(|key| {
                    let pair = Self::read(&state, tx, &key)?;
                    (pair.error.is_some() && pair.failures > 0).then_some((key, pair))
                })
                .collect()
        };
        failing.sort_by(|a, b| (&a.0.1, a.0.0).cmp(&(&b.0.1, b.0.0)));
        let mut cursors = Vec::new();
        for (key, pair) in failing.into_iter().take(limit) {
            let (lease, _) = self.lease(&key).await?;
            cursors.push(Self::cursor_of(&key, &pair, lease));
        }
        Ok(cursors)
    }

    async fn parked_pairs(
        &self,
        tx: &FakeTransaction,
        perspectives: &[PerspectiveName],
        limit: usize,
    ) -> Result<Vec<Cursor>> {
        tx.check_usable()?;
        let mut parked: Vec<(OffsetDateTime, Key, Pair)> = {
            let state = self.lock_state();
            Self::keys(&state, tx)
                .into_iter()
                .filter(|key| perspectives.is_empty() || perspectives.contains(&key.1))
                .filter_map(|key| {
                    let pair = Self::read(&state, tx, &key)?;
                    Some((pair.parked_at?, key, pair))
                })
                .collect()
        };
        parked.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        let mut cursors = Vec::new();
        for (_, key, pair) in parked.into_iter().take(limit) {
            let (lease, _) = self.lease(&key).await?;
            cursors.push(Self::cursor_of(&key, &pair, lease));
        }
        Ok(cursors)
    }

    async fn unpark(&self, tx: &FakeTransaction, pair: &lockstep_core::Pair) -> Result<bool> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        let key = (stream_id, perspective.clone());
        if Self::read(&self.lock_state(), tx, &key).is_none() {
            return Ok(false);
        }
        self.lock_row(tx, &key).await?;
        let Some(mut pair) = Self::read(&self.lock_state(), tx, &key) else {
            return Ok(false);
        };
        pair.unpark();
        self.write(tx, key, pair);
        Ok(true)
    }

    async fn skip_event(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
        event_id: Uuid,
        reason: &str,
    ) -> Result<bool> {
        SkippedEvent::check_reason(reason)?;
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        let key = (stream_id, perspective.clone());
        let is_pending = |store: &Self| {
            let state = store.lock_state();
            store
                .pending(&state, tx, &key)
                .iter()
                .any(|e| e.event_id == event_id)
        };
        if !is_pending(self) {
            return Ok(false);
        }
        self.lock_row(tx, &key).await?;
        // Applied (or skipped) by another transaction while this one waited for the row.
        if !is_pending(self) {
            return Ok(false);
        }
        self.create(tx, &key);
        let mut pair = Self::read(&self.lock_state(), tx, &key).unwrap_or_default();
        pair.skipped.insert(
            event_id,
            SkippedEvent::new(event_id, reason.replace('\0', "\u{FFFD}"), self.now()),
        );
        pair.unpark();
        self.complete(tx, key.clone(), [event_id]);
        self.write(tx, key, pair);
        Ok(true)
    }

    async fn rewind_progress(
        &self,
        tx: &FakeTransaction,
        perspectives: &[PerspectiveName],
        limit: usize,
    ) -> Result<Vec<RewindProgress>> {
        tx.check_usable()?;
        check_progress_limit(limit)?;
        let rows: BTreeMap<(PerspectiveName, StreamId), Progress> = {
            let state = self.lock_state();
            state
                .progress
                .iter()
                .filter(|(k, _)| perspectives.is_empty() || perspectives.contains(&k.1))
                .filter(|(k, _)| Self::read(&state, tx, k).is_some_and(|p| p.rewind.is_some()))
                .map(|(k, p)| ((k.1.clone(), k.0), p.clone()))
                .collect()
        };
        let mut out = Vec::new();
        for ((perspective, stream_id), p) in rows {
            if out.len() == limit {
                break;
            }
            if let Some((holder, epoch)) = p.lease {
                let (lease, live) = self.lease(&(stream_id, perspective.clone())).await?;
                if !(live && lease.holder == Some(holder) && lease.epoch == epoch) {
                    continue;
                }
            }
            let mut row = RewindProgress::new(
                lockstep_core::Pair::new(stream_id, perspective),
                p.replayed,
                p.to_replay,
                p.started_at,
                p.updated_at,
            );
            row.holder = p.lease.map(|(h, _)| h);
            row.read_at = Some(self.now());
            out.push(row);
        }
        Ok(out)
    }
}

impl PerspectiveLifecycle<FakeTransaction> for InMemoryPerspectiveStore {
    async fn register(&self, tx: &FakeTransaction, perspectives: &[PerspectiveName]) -> Result<()> {
        tx.check_usable()?;
        let mut state = self.lock_state();
        self.stage(&mut state, tx)
            .registered
            .extend(perspectives.iter().cloned());
        Ok(())
    }

    async fn retire(
        &self,
        tx: &FakeTransaction,
        perspective: &PerspectiveName,
        states: RetireStates,
    ) -> Result<Retired> {
        tx.check_usable()?;
        let (registered, keys) = {
            let state = self.lock_state();
            let registered = Self::registered(&state, tx, perspective)
                && !state
                    .staged
                    .get(&tx.id())
                    .is_some_and(|s| s.retire.iter().any(|(n, _)| n == perspective));
            if !registered && !Self::retired_in(&state, tx, perspective) {
                return Ok(Retired::NotRegistered);
            }
            (registered, self.pairs_of(&state, tx, perspective))
        };
        let now = self.now();
        let mut work_removed = 0;
        for key in &keys {
            self.lock_row(tx, key).await?;
            let (pending, pair) = {
                let state = self.lock_state();
                let pending = if registered {
                    self.pending(&state, tx, key)
                } else {
                    Vec::new()
                };
                (pending, Self::read(&state, tx, key))
            };
            work_removed += pending.len() as u64;
            // A queued late arrival becomes a rewind request before its work goes.
            if states == RetireStates::Keep
                && let Some(mut pair) = pair
                && let Some(last) = pair.last_event_id
                && let Some(late) = pending.iter().map(|e| e.event_id).find(|id| *id < last)
            {
                Self::flag(&mut pair, late, now);
                self.write(tx, key.clone(), pair);
            }
        }
        let mut state = self.lock_state();
        self.stage(&mut state, tx)
            .retire
            .push((perspective.clone(), states));
        if let Some(staged) = state.staged.get_mut(&tx.id()) {
            staged.registered.remove(perspective);
        }
        Ok(Retired::Retired {
            work_removed,
            pairs: keys.len() as u64,
        })
    }

    async fn retired(&self, tx: &FakeTransaction) -> Result<Vec<PerspectiveName>> {
        tx.check_usable()?;
        let state = self.lock_state();
        let mut names: BTreeSet<PerspectiveName> = state.retired.clone();
        if let Some(staged) = state.staged.get(&tx.id()) {
            names.extend(staged.retire.iter().map(|(n, _)| n.clone()));
        }
        Ok(names
            .into_iter()
            .filter(|n| Self::retired_in(&state, tx, n))
            .collect())
    }

    async fn rebuild(
        &self,
        tx: &FakeTransaction,
        perspective: &PerspectiveName,
    ) -> Result<Rebuild> {
        tx.check_usable()?;
        let keys = {
            let state = self.lock_state();
            let retiring = state
                .staged
                .get(&tx.id())
                .is_some_and(|s| s.retire.iter().any(|(n, _)| n == perspective));
            if !Self::registered(&state, tx, perspective) || retiring {
                return Ok(Rebuild::NotRegistered);
            }
            self.pairs_of(&state, tx, perspective)
        };
        let now = self.now();
        for key in &keys {
            self.create(tx, key);
            self.lock_row(tx, key).await?;
            let mut pair = Self::read(&self.lock_state(), tx, key).unwrap_or_default();
            Self::flag(&mut pair, Uuid::nil(), now);
            pair.unpark();
            self.write(tx, key.clone(), pair);
        }
        Ok(Rebuild::Requested {
            pairs: keys.len() as u64,
        })
    }

    async fn record_applied(
        &self,
        tx: &FakeTransaction,
        counts: &[(PerspectiveName, u64)],
    ) -> Result<()> {
        tx.check_usable()?;
        if counts.iter().any(|(_, n)| i64::try_from(*n).is_err()) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "applied count out of range",
            ));
        }
        let now = self.now();
        let mut state = self.lock_state();
        for (name, n) in counts {
            let entry = state
                .throughput
                .entry(name.clone())
                .or_insert((now, 0, None));
            entry.1 += n;
            let age = (now - entry.0).as_seconds_f64();
            if age >= lockstep_core::THROUGHPUT_WINDOW.as_secs_f64() {
                *entry = (now, 0, Some(entry.1 as f64 / age.max(0.001)));
            }
        }
        Ok(())
    }

    async fn throughput(&self, tx: &FakeTransaction) -> Result<Vec<lockstep_core::Throughput>> {
        tx.check_usable()?;
        let now = self.now();
        let state = self.lock_state();
        Ok(state
            .throughput
            .iter()
            .map(|(name, (started, applied, rate))| {
                let age = (now - *started).as_seconds_f64();
                let open = (age >= 1.0).then(|| *applied as f64 / age);
                let rate = match rate {
                    Some(r) if age < lockstep_core::THROUGHPUT_WINDOW.as_secs_f64() => Some(*r),
                    _ => open,
                };
                lockstep_core::Throughput::new(name.clone(), rate, *applied, *started)
            })
            .collect())
    }
}

impl CursorRows<FakeTransaction> for InMemoryPerspectiveStore {
    async fn pending_pairs(
        &self,
        tx: &FakeTransaction,
        instance: InstanceId,
        perspectives: &[PerspectiveName],
        debounce: RewindDebounce,
        limit: usize,
    ) -> Result<Vec<PendingPair>> {
        tx.check_usable()?;
        let leased_by_others: HashSet<Key> = self
            .locker
            .list_leases()
            .await?
            .into_iter()
            .filter(|l| l.status == LeaseStatus::Held && l.holder != instance)
            .map(|l| (l.stream_id, l.perspective))
            .collect();
        let state = self.lock_state();
        let mut registered: Vec<PerspectiveName> = state.registered.iter().cloned().collect();
        if let Some(staged) = state.staged.get(&tx.id()) {
            registered.extend(staged.registered.iter().cloned());
        }
        let mut keys: BTreeSet<Key> = self
            .events
            .streams()
            .into_iter()
            .flat_map(|s| registered.iter().map(move |p| (s, p.clone())))
            .collect();
        keys.extend(state.pairs.keys().cloned());
        let mut found: Vec<(OffsetDateTime, PendingPair)> = Vec::new();
        for key in keys {
            // Only the perspectives the caller runs: others never take its places.
            if leased_by_others.contains(&key) || !perspectives.contains(&key.1) {
                continue;
            }
            let pending = self.pending(&state, tx, &key);
            let pair = Self::read(&state, tx, &key).unwrap_or_default();
            // A rewind inside its debounce window holds the whole pair back, work included.
            if pair.rewind.is_some_and(|r| self.debounced(&r, debounce)) {
                continue;
            }
            let rewind = pair.rewind.is_some();
            if pending.is_empty() && !rewind {
                continue;
            }
            let oldest = pending
                .iter()
                .map(|e| e.recorded_at)
                .min()
                .or(pair.rewind.map(|r| r.first_flagged_at))
                .unwrap_or(OffsetDateTime::UNIX_EPOCH);
            found.push((
                oldest,
                PendingPair {
                    pair: lockstep_core::Pair::new(key.0, key.1),
                    pending: pending.len() as u64,
                    rewind,
                },
            ));
        }
        found.sort_by_key(|(oldest, _)| *oldest);
        Ok(found.into_iter().take(limit).map(|(_, p)| p).collect())
    }

    async fn ensure_cursor(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
    ) -> Result<bool> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        Ok(self.create(tx, &(stream_id, perspective.clone())))
    }

    async fn delete_cursor(
        &self,
        tx: &FakeTransaction,
        pair: &lockstep_core::Pair,
    ) -> Result<bool> {
        let (stream_id, perspective) = (pair.stream_id, &pair.perspective);
        tx.check_usable()?;
        let key = (stream_id, perspective.clone());
        self.lock_row(tx, &key).await?;
        let all = self
            .events
            .committed(stream_id)
            .into_iter()
            .map(|e| e.event_id);
        self.complete(tx, key.clone(), all);
        let existed = {
            let mut state = self.lock_state();
            let staged = state
                .staged
                .get_mut(&tx.id())
                .and_then(|s| s.pairs.remove(&key))
                .is_some();
            state.pairs.remove(&key).is_some() || staged
        };
        self.locker.delete_cursor(stream_id, perspective);
        Ok(existed)
    }
}
