//! Recording wrappers: forward every call to the wrapped implementation and remember what was
//! asked and what came back, in order, so a test can assert on it (which reasons a worker
//! used, whether it released what it acquired, whether it fenced its commit, which keys a
//! handler locked, which events a handler appended and how often it had to retry).
//!
//! A failed call is recorded with its [`ErrorKind`], so tests branch on kinds as application
//! code does, never on message text.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> lockstep_core::Result<()> {
//! use lockstep_core::*;
//! use lockstep_testkit::{InMemoryStreamLocker, RecordingStreamLocker};
//!
//! let inner = InMemoryStreamLocker::new(StreamLockOptions::default());
//! let (stream, name) = (StreamId::new_v7(), PerspectiveName::new("P")?);
//! inner.create_cursor(stream, &name);
//! let locker = RecordingStreamLocker::new(inner);
//! let _ = locker.try_acquire(stream, &name, InstanceId::random(), &LockReason::Bootstrap).await?;
//! assert_eq!(locker.acquire_reasons(), vec![LockReason::Bootstrap]);
//! # Ok(()) }
//! ```

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lockstep_core::{
    AcquireOutcome, CursorLease, DistributedLock, ErrorKind, EventStore, ExpectedVersion, Fleet,
    FleetAdmin, InstanceId, LeaseFence, LeaseId, LeaseInfo, LockReason, NewEvent, PerspectiveName,
    RecordedEvent, ReleaseOutcome, RenewOutcome, ResourceKey, Result, StreamId, StreamLockAdmin,
    StreamLockOptions, StreamLocker, Uuid, async_trait,
};
use lockstep_core::{
    AggregateSnapshot, AggregateType, LoadedStream, LockFirst, SnapshotKey, SnapshotStore,
};

/// What a recorded call returned: its value, or the kind of its error.
pub type Outcome<T> = std::result::Result<T, ErrorKind>;

/// One call to a [`StreamLocker`], [`StreamLockAdmin`] or [`LeaseFence`], with its result.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamLockCall {
    /// `try_acquire`.
    TryAcquire {
        /// Stream asked for.
        stream_id: StreamId,
        /// Perspective asked for.
        perspective: PerspectiveName,
        /// Instance asking.
        instance: InstanceId,
        /// Reason given.
        reason: LockReason,
        /// What came back.
        outcome: Outcome<AcquireOutcome>,
    },
    /// `renew` (also one per lease of `renew_many`).
    Renew {
        /// Lease renewed.
        lease: LeaseId,
        /// What came back.
        outcome: Outcome<RenewOutcome>,
    },
    /// `release`.
    Release {
        /// Lease released.
        lease: LeaseId,
        /// What came back.
        outcome: Outcome<ReleaseOutcome>,
    },
    /// `check_lease` ([`LeaseFence`]), on whatever transaction it was given.
    CheckLease {
        /// Lease checked.
        lease: LeaseId,
        /// What came back (`Err(ErrorKind::LeaseLost)` when fenced out).
        outcome: Outcome<()>,
    },
    /// `list_leases` ([`StreamLockAdmin`]).
    ListLeases {
        /// What came back.
        outcome: Outcome<Vec<LeaseInfo>>,
    },
    /// `list_lease_entries` ([`StreamLockAdmin`]).
    ListLeaseEntries {
        /// What came back.
        outcome: Outcome<Vec<lockstep_core::LeaseEntry>>,
    },
    /// `inspect` ([`StreamLockAdmin`]).
    Inspect {
        /// Stream inspected.
        stream_id: StreamId,
        /// Perspective inspected.
        perspective: PerspectiveName,
        /// What came back.
        outcome: Outcome<Option<CursorLease>>,
    },
    /// `force_release` ([`StreamLockAdmin`]).
    ForceRelease {
        /// Stream released.
        stream_id: StreamId,
        /// Perspective released.
        perspective: PerspectiveName,
        /// What came back.
        outcome: Outcome<ReleaseOutcome>,
    },
    /// `release_all_held_by` ([`StreamLockAdmin`]).
    ReleaseAllHeldBy {
        /// Instance whose leases were released.
        instance: InstanceId,
        /// What came back: how many leases were cleared.
        outcome: Outcome<u64>,
    },
    /// `announce` ([`Fleet`]).
    Announce {
        /// What was announced.
        announcement: lockstep_core::InstanceAnnouncement,
        /// What came back.
        outcome: Outcome<()>,
    },
    /// `depart` ([`Fleet`]).
    Depart {
        /// The instance departing.
        instance: InstanceId,
        /// What came back: whether it was announced.
        outcome: Outcome<bool>,
    },
    /// `list_instances` ([`FleetAdmin`]).
    ListInstances {
        /// What came back.
        outcome: Outcome<Vec<lockstep_core::WorkerInstance>>,
    },
    /// `list_instance_entries` ([`FleetAdmin`]).
    ListInstanceEntries {
        /// What came back.
        outcome: Outcome<Vec<lockstep_core::InstanceEntry>>,
    },
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Records every call to the wrapped [`StreamLocker`], and to its [`StreamLockAdmin`],
/// [`LeaseFence`], [`Fleet`] and [`FleetAdmin`] when it is one (as the in-memory and Postgres
/// lockers are). Clones share the record.
#[derive(Debug, Clone)]
pub struct RecordingStreamLocker<L> {
    inner: L,
    calls: Arc<Mutex<Vec<StreamLockCall>>>,
}

impl<L> RecordingStreamLocker<L> {
    /// Wraps `inner`.
    pub fn new(inner: L) -> Self {
        RecordingStreamLocker {
            inner,
            calls: Arc::default(),
        }
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<StreamLockCall> {
        lock(&self.calls).clone()
    }

    /// The reasons of every `try_acquire`, in order.
    pub fn acquire_reasons(&self) -> Vec<LockReason> {
        lock(&self.calls)
            .iter()
            .filter_map(|c| match c {
                StreamLockCall::TryAcquire { reason, .. } => Some(reason.clone()),
                _ => None,
            })
            .collect()
    }

    /// Leases acquired and not released since, in acquisition order. A lease counts as
    /// released after a successful `release` of it or `release_all_held_by` of its holder; a
    /// `force_release` does not count (it is an operator fencing the holder out, not the holder
    /// letting go).
    pub fn unreleased(&self) -> Vec<LeaseId> {
        let mut held: Vec<LeaseId> = Vec::new();
        for call in lock(&self.calls).iter() {
            match call {
                StreamLockCall::TryAcquire {
                    outcome: Ok(AcquireOutcome::Acquired(lease)),
                    ..
                } if !held.contains(&lease.id) => held.push(lease.id.clone()),
                StreamLockCall::Release {
                    lease,
                    outcome: Ok(_),
                } => held.retain(|h| h != lease),
                StreamLockCall::ReleaseAllHeldBy {
                    instance,
                    outcome: Ok(_),
                } => held.retain(|h| h.holder != *instance),
                _ => {}
            }
        }
        held
    }

    /// The leases of every `check_lease`, with what came back, in order.
    pub fn lease_checks(&self) -> Vec<(LeaseId, Outcome<()>)> {
        lock(&self.calls)
            .iter()
            .filter_map(|c| match c {
                StreamLockCall::CheckLease { lease, outcome } => Some((lease.clone(), *outcome)),
                _ => None,
            })
            .collect()
    }

    /// The wrapped locker.
    pub fn inner(&self) -> &L {
        &self.inner
    }

    fn record(&self, call: StreamLockCall) {
        lock(&self.calls).push(call);
    }
}

fn outcome<T: Clone>(r: &Result<T>) -> Outcome<T> {
    match r {
        Ok(value) => Ok(value.clone()),
        Err(e) => Err(e.kind()),
    }
}

#[async_trait]
impl<L: StreamLocker> StreamLocker for RecordingStreamLocker<L> {
    fn options(&self) -> StreamLockOptions {
        self.inner.options()
    }

    async fn try_acquire(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        instance: InstanceId,
        reason: &LockReason,
    ) -> Result<AcquireOutcome> {
        let result = self
            .inner
            .try_acquire(stream_id, perspective, instance, reason)
            .await;
        self.record(StreamLockCall::TryAcquire {
            stream_id,
            perspective: perspective.clone(),
            instance,
            reason: reason.clone(),
            outcome: outcome(&result),
        });
        result
    }

    async fn renew(&self, lease: &LeaseId) -> Result<RenewOutcome> {
        let result = self.inner.renew(lease).await;
        self.record(StreamLockCall::Renew {
            lease: lease.clone(),
            outcome: outcome(&result),
        });
        result
    }

    async fn release(&self, lease: &LeaseId) -> Result<ReleaseOutcome> {
        let result = self.inner.release(lease).await;
        self.record(StreamLockCall::Release {
            lease: lease.clone(),
            outcome: outcome(&result),
        });
        result
    }

    async fn renew_many(&self, leases: &[LeaseId]) -> Result<Vec<RenewOutcome>> {
        let result = self.inner.renew_many(leases).await;
        for (i, lease) in leases.iter().enumerate() {
            let outcome = match &result {
                // A locker that returns fewer outcomes than leases breaks the contract: record
                // the missing ones as a backend failure.
                Ok(outcomes) => outcomes.get(i).copied().ok_or(ErrorKind::Backend),
                Err(e) => Err(e.kind()),
            };
            self.record(StreamLockCall::Renew {
                lease: lease.clone(),
                outcome,
            });
        }
        result
    }
}

#[async_trait]
impl<L: StreamLockAdmin> StreamLockAdmin for RecordingStreamLocker<L> {
    async fn list_leases(&self) -> Result<Vec<LeaseInfo>> {
        let result = self.inner.list_leases().await;
        self.record(StreamLockCall::ListLeases {
            outcome: outcome(&result),
        });
        result
    }

    // Forwarded, not left to the default: a backend's own listing reports a row it cannot
    // read as an entry of its own instead of failing the whole listing.
    async fn list_lease_entries(&self) -> Result<Vec<lockstep_core::LeaseEntry>> {
        let result = self.inner.list_lease_entries().await;
        self.record(StreamLockCall::ListLeaseEntries {
            outcome: outcome(&result),
        });
        result
    }

    async fn inspect(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<Option<CursorLease>> {
        let result = self.inner.inspect(stream_id, perspective).await;
        self.record(StreamLockCall::Inspect {
            stream_id,
            perspective: perspective.clone(),
            outcome: outcome(&result),
        });
        result
    }

    async fn force_release(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<ReleaseOutcome> {
        let result = self.inner.force_release(stream_id, perspective).await;
        self.record(StreamLockCall::ForceRelease {
            stream_id,
            perspective: perspective.clone(),
            outcome: outcome(&result),
        });
        result
    }

    async fn release_all_held_by(&self, instance: InstanceId) -> Result<u64> {
        let result = self.inner.release_all_held_by(instance).await;
        self.record(StreamLockCall::ReleaseAllHeldBy {
            instance,
            outcome: outcome(&result),
        });
        result
    }
}

/// The fleet's calls, when the wrapped locker keeps one.
#[async_trait]
impl<L: Fleet> Fleet for RecordingStreamLocker<L> {
    async fn announce(&self, announcement: &lockstep_core::InstanceAnnouncement) -> Result<()> {
        let result = self.inner.announce(announcement).await;
        self.record(StreamLockCall::Announce {
            announcement: announcement.clone(),
            outcome: outcome(&result),
        });
        result
    }

    /// Forwarded; each lease's renewal is recorded as a [`StreamLockCall::Renew`], as for
    /// `renew_many`.
    async fn keepalive(
        &self,
        instance: InstanceId,
        token: Uuid,
        leases: &[LeaseId],
    ) -> Result<lockstep_core::KeepaliveOutcome> {
        let result = self.inner.keepalive(instance, token, leases).await;
        for (i, lease) in leases.iter().enumerate() {
            let outcome = match &result {
                Ok(done) => done.renewed.get(i).copied().ok_or(ErrorKind::Backend),
                Err(e) => Err(e.kind()),
            };
            self.record(StreamLockCall::Renew {
                lease: lease.clone(),
                outcome,
            });
        }
        result
    }

    async fn depart(&self, instance: InstanceId, token: Uuid) -> Result<bool> {
        let result = self.inner.depart(instance, token).await;
        self.record(StreamLockCall::Depart {
            instance,
            outcome: outcome(&result),
        });
        result
    }
}

#[async_trait]
impl<L: FleetAdmin> FleetAdmin for RecordingStreamLocker<L> {
    async fn list_instances(&self) -> Result<Vec<lockstep_core::WorkerInstance>> {
        let result = self.inner.list_instances().await;
        self.record(StreamLockCall::ListInstances {
            outcome: outcome(&result),
        });
        result
    }

    async fn list_instance_entries(&self) -> Result<Vec<lockstep_core::InstanceEntry>> {
        let result = self.inner.list_instance_entries().await;
        self.record(StreamLockCall::ListInstanceEntries {
            outcome: outcome(&result),
        });
        result
    }
}

impl<Tx, L> LeaseFence<Tx> for RecordingStreamLocker<L>
where
    Tx: ?Sized + Sync,
    L: LeaseFence<Tx>,
{
    async fn check_lease(&self, tx: &Tx, lease: &LeaseId) -> Result<()> {
        let result = self.inner.check_lease(tx, lease).await;
        self.record(StreamLockCall::CheckLease {
            lease: lease.clone(),
            outcome: outcome(&result),
        });
        result
    }
}

/// How a [`DistributedLock`] was called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    /// `acquire_for_transaction`, with its timeout.
    Acquire(Option<Duration>),
    /// `try_acquire_for_transaction`.
    TryAcquire,
}

/// One call to a [`DistributedLock`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockCall {
    /// The key.
    pub key: ResourceKey,
    /// How it was asked for.
    pub mode: LockMode,
    /// `Ok(true)` acquired, `Ok(false)` denied (try only), `Err` the error's kind.
    pub outcome: Outcome<bool>,
}

/// Records every call to the wrapped [`DistributedLock`] (for any transaction type).
#[derive(Debug, Clone)]
pub struct RecordingDistributedLock<L> {
    inner: L,
    calls: Arc<Mutex<Vec<LockCall>>>,
}

impl<L> RecordingDistributedLock<L> {
    /// Wraps `inner`.
    pub fn new(inner: L) -> Self {
        RecordingDistributedLock {
            inner,
            calls: Arc::default(),
        }
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<LockCall> {
        lock(&self.calls).clone()
    }

    /// The keys of every call, in order.
    pub fn keys(&self) -> Vec<ResourceKey> {
        lock(&self.calls).iter().map(|c| c.key.clone()).collect()
    }

    /// The wrapped lock.
    pub fn inner(&self) -> &L {
        &self.inner
    }
}

impl<Tx, L> DistributedLock<Tx> for RecordingDistributedLock<L>
where
    Tx: ?Sized + Sync,
    L: DistributedLock<Tx>,
{
    async fn acquire_for_transaction(
        &self,
        tx: &Tx,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let result = self.inner.acquire_for_transaction(tx, key, timeout).await;
        lock(&self.calls).push(LockCall {
            key: key.clone(),
            mode: LockMode::Acquire(timeout),
            outcome: result
                .as_ref()
                .map(|()| true)
                .map_err(lockstep_core::Error::kind),
        });
        result
    }

    async fn try_acquire_for_transaction(&self, tx: &Tx, key: &ResourceKey) -> Result<bool> {
        let result = self.inner.try_acquire_for_transaction(tx, key).await;
        lock(&self.calls).push(LockCall {
            key: key.clone(),
            mode: LockMode::TryAcquire,
            outcome: outcome(&result),
        });
        result
    }
}

/// One call to an [`EventStore`], with its result: `Ok` the stream's version (for a load, the
/// version of the last event loaded, 0 for an empty stream; for an append, the new version),
/// `Err` the error's kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventStoreCall {
    /// `load`.
    Load {
        /// Stream loaded.
        stream_id: StreamId,
        /// What came back.
        outcome: Outcome<u64>,
    },
    /// `load_locked`.
    LoadLocked {
        /// Stream loaded.
        stream_id: StreamId,
        /// Key locked first.
        key: ResourceKey,
        /// Lock timeout given.
        timeout: Option<Duration>,
        /// What came back.
        outcome: Outcome<u64>,
    },
    /// `append`.
    Append {
        /// Stream appended to.
        stream_id: StreamId,
        /// Version expected.
        expected: ExpectedVersion,
        /// Types of the events, in order.
        event_types: Vec<String>,
        /// What came back.
        outcome: Outcome<u64>,
    },
    /// `append_at_commit`: `Ok(())` means held back (or appended at once, by a backend that
    /// cannot hold it back); whether it was stored is the commit's outcome.
    AppendAtCommit {
        /// Stream appended to.
        stream_id: StreamId,
        /// Version expected.
        expected: ExpectedVersion,
        /// Types of the events, in order.
        event_types: Vec<String>,
        /// What came back.
        outcome: Outcome<()>,
    },
    /// `load_from_snapshot`.
    LoadFromSnapshot {
        /// Stream loaded.
        stream_id: StreamId,
        /// The snapshot's aggregate type and state schema version.
        key: SnapshotKey,
        /// Key locked first, if any.
        lock: Option<ResourceKey>,
        /// The version of the snapshot found, if any (when the load succeeded).
        snapshot_version: Option<u64>,
        /// The stream's version it saw.
        outcome: Outcome<u64>,
    },
    /// `save_snapshot`.
    SaveSnapshot {
        /// Stream of the snapshot.
        stream_id: StreamId,
        /// The snapshot's aggregate type and state schema version.
        key: SnapshotKey,
        /// The version saved.
        version: u64,
        /// Whether it was stored.
        outcome: Outcome<bool>,
    },
}

impl EventStoreCall {
    /// The stream the call was about.
    pub fn stream_id(&self) -> StreamId {
        match self {
            EventStoreCall::Load { stream_id, .. }
            | EventStoreCall::LoadLocked { stream_id, .. }
            | EventStoreCall::Append { stream_id, .. }
            | EventStoreCall::AppendAtCommit { stream_id, .. }
            | EventStoreCall::LoadFromSnapshot { stream_id, .. }
            | EventStoreCall::SaveSnapshot { stream_id, .. } => *stream_id,
        }
    }

    /// What came back (for `append_at_commit`, whose version is known only at commit, `Ok(0)`
    /// when it was accepted; for `save_snapshot`, the version saved when it succeeded, stored
    /// or not).
    pub fn outcome(&self) -> Outcome<u64> {
        match self {
            EventStoreCall::Load { outcome, .. }
            | EventStoreCall::LoadLocked { outcome, .. }
            | EventStoreCall::Append { outcome, .. }
            | EventStoreCall::LoadFromSnapshot { outcome, .. } => *outcome,
            EventStoreCall::AppendAtCommit { outcome, .. } => outcome.map(|()| 0),
            EventStoreCall::SaveSnapshot {
                outcome, version, ..
            } => outcome.map(|_| *version),
        }
    }
}

/// Records every call to the wrapped [`EventStore`] (for any transaction type). Clones share
/// the record.
///
/// A call is recorded when it returns, so concurrent calls appear in the order they finished.
/// It records calls, not transactions: a successful append whose transaction is later rolled
/// back stays in the record as a success.
#[derive(Debug, Clone)]
pub struct RecordingEventStore<S> {
    inner: S,
    calls: Arc<Mutex<Vec<EventStoreCall>>>,
}

impl<S> RecordingEventStore<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        RecordingEventStore {
            inner,
            calls: Arc::default(),
        }
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<EventStoreCall> {
        lock(&self.calls).clone()
    }

    /// Every `append` (not `append_at_commit`), successful or not, in order.
    pub fn appends(&self) -> Vec<EventStoreCall> {
        lock(&self.calls)
            .iter()
            .filter(|c| matches!(c, EventStoreCall::Append { .. }))
            .cloned()
            .collect()
    }

    /// The event types of every successful `append`, flattened, in order.
    pub fn appended_event_types(&self) -> Vec<String> {
        lock(&self.calls)
            .iter()
            .filter_map(|c| match c {
                EventStoreCall::Append {
                    event_types,
                    outcome: Ok(_),
                    ..
                } => Some(event_types.iter().cloned()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn record(&self, call: EventStoreCall) {
        lock(&self.calls).push(call);
    }
}

/// The version a load saw: that of its last event (0 for an empty stream).
fn loaded_version(result: &Result<Vec<RecordedEvent>>) -> Outcome<u64> {
    match result {
        Ok(events) => Ok(events.last().map_or(0, |e| e.version)),
        Err(e) => Err(e.kind()),
    }
}

impl<Tx, S> EventStore<Tx> for RecordingEventStore<S>
where
    Tx: ?Sized + Sync,
    S: EventStore<Tx>,
{
    async fn load(&self, tx: &Tx, stream_id: StreamId) -> Result<Vec<RecordedEvent>> {
        let result = self.inner.load(tx, stream_id).await;
        self.record(EventStoreCall::Load {
            stream_id,
            outcome: loaded_version(&result),
        });
        result
    }

    async fn load_locked(
        &self,
        tx: &Tx,
        stream_id: StreamId,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<Vec<RecordedEvent>> {
        let result = self.inner.load_locked(tx, stream_id, key, timeout).await;
        self.record(EventStoreCall::LoadLocked {
            stream_id,
            key: key.clone(),
            timeout,
            outcome: loaded_version(&result),
        });
        result
    }

    async fn append(
        &self,
        tx: &Tx,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<u64> {
        let result = self.inner.append(tx, stream_id, expected, events).await;
        self.record(EventStoreCall::Append {
            stream_id,
            expected,
            event_types: events.iter().map(|e| e.event_type().to_owned()).collect(),
            outcome: outcome(&result),
        });
        result
    }

    async fn append_at_commit(
        &self,
        tx: &Tx,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<()> {
        let result = self
            .inner
            .append_at_commit(tx, stream_id, expected, events)
            .await;
        self.record(EventStoreCall::AppendAtCommit {
            stream_id,
            expected,
            event_types: events.iter().map(|e| e.event_type().to_owned()).collect(),
            outcome: outcome(&result),
        });
        result
    }
}

/// Records `load_from_snapshot` and `save_snapshot`; `delete_snapshots` (an operator's call) is
/// passed on without a record.
impl<Tx, S> SnapshotStore<Tx> for RecordingEventStore<S>
where
    Tx: ?Sized + Sync,
    S: SnapshotStore<Tx>,
{
    async fn load_from_snapshot(
        &self,
        tx: &Tx,
        key: &SnapshotKey,
        lock: Option<LockFirst<'_>>,
    ) -> Result<LoadedStream> {
        let result = self.inner.load_from_snapshot(tx, key, lock).await;
        self.record(EventStoreCall::LoadFromSnapshot {
            stream_id: key.stream_id(),
            key: key.clone(),
            lock: lock.map(|l| l.key.clone()),
            snapshot_version: result
                .as_ref()
                .ok()
                .and_then(|l| l.snapshot.as_ref().map(|s| s.version)),
            outcome: result
                .as_ref()
                .map(LoadedStream::version)
                .map_err(|e| e.kind()),
        });
        result
    }

    async fn save_snapshot(
        &self,
        tx: &Tx,
        key: &SnapshotKey,
        snapshot: &AggregateSnapshot,
    ) -> Result<bool> {
        let result = self.inner.save_snapshot(tx, key, snapshot).await;
        self.record(EventStoreCall::SaveSnapshot {
            stream_id: key.stream_id(),
            key: key.clone(),
            version: snapshot.version,
            outcome: outcome(&result),
        });
        result
    }

    async fn delete_snapshots(
        &self,
        tx: &Tx,
        aggregate_type: &AggregateType,
        below_schema_version: Option<u32>,
    ) -> Result<u64> {
        self.inner
            .delete_snapshots(tx, aggregate_type, below_schema_version)
            .await
    }
}
