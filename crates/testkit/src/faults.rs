//! Fault-injecting wrappers: forward to the wrapped implementation unless the test, through the
//! wrapper's handle, has asked for a fault — deny the next acquires (or answer them busy), fail
//! or lose the next renews, fail the next lock calls, fence checks, loads or appends with a
//! chosen kind, add latency to every call.
//!
//! Each wrapper has a handle of its own type, offering only the faults that can happen to it
//! (the model is tower-test's `mock::Handle`): [`StreamLockerFaults`] for
//! [`FaultyStreamLocker`], [`DistributedLockFaults`] for [`FaultyDistributedLock`],
//! [`EventStoreFaults`] for [`FaultyEventStore`].
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> lockstep_core::Result<()> {
//! use lockstep_core::*;
//! use lockstep_testkit::{FaultyStreamLocker, InMemoryStreamLocker};
//!
//! let inner = InMemoryStreamLocker::new(StreamLockOptions::default());
//! let (stream, name) = (StreamId::new_v7(), PerspectiveName::new("P")?);
//! inner.create_cursor(stream, &name);
//! let (locker, faults) = FaultyStreamLocker::new(inner);
//! faults.deny_next_acquires(1);
//! let me = InstanceId::random();
//! assert!(!locker.try_acquire(stream, &name, me, &LockReason::Rewind).await?.is_acquired());
//! assert!(locker.try_acquire(stream, &name, me, &LockReason::Rewind).await?.is_acquired());
//! # Ok(()) }
//! ```
//!
//! An injected failure never reaches the wrapped implementation, so unlike a real failed
//! statement it does **not** abort the caller's transaction (a wrapper cannot reach into an
//! arbitrary transaction type). Code under test must still retry in a new transaction, as the
//! contracts require; these wrappers will not catch a retry on the failed one.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lockstep_core::{
    AcquireOutcome, CursorLease, DistributedLock, Error, ErrorKind, EventStore, ExpectedVersion,
    Fleet, FleetAdmin, InstanceId, LeaseEpoch, LeaseFence, LeaseHolder, LeaseId, LeaseInfo,
    LockReason, NewEvent, PerspectiveName, RecordedEvent, ReleaseOutcome, RenewOutcome,
    ResourceKey, Result, StreamId, StreamLockAdmin, StreamLockOptions, StreamLocker, Uuid,
    VersionConflict, async_trait,
};
use lockstep_core::{
    AggregateSnapshot, AggregateType, LoadedStream, LockFirst, SnapshotKey, SnapshotStore,
};
use time::OffsetDateTime;

/// A countdown of calls that fail with an error of one kind.
type Failures = Option<(u32, ErrorKind)>;

/// Takes one from a countdown; true if a fault fires.
fn take(count: &mut u32) -> bool {
    if *count > 0 {
        *count -= 1;
        true
    } else {
        false
    }
}

fn take_kind(slot: &mut Failures) -> Option<ErrorKind> {
    let (count, kind) = slot.as_mut()?;
    let kind = *kind;
    if take(count) { Some(kind) } else { None }
}

fn injected(kind: ErrorKind, what: &str) -> Error {
    Error::new(kind, format!("fault injected into {what}"))
}

/// The state behind a handle: the pending faults of one wrapper and its latency. Clones share it.
struct Controls<S> {
    state: Arc<Mutex<(S, Duration)>>,
}

impl<S> Clone for Controls<S> {
    fn clone(&self) -> Self {
        Controls {
            state: Arc::clone(&self.state),
        }
    }
}

impl<S: Default> Default for Controls<S> {
    fn default() -> Self {
        Controls {
            state: Arc::new(Mutex::new((S::default(), Duration::ZERO))),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Controls<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("Faults")
            .field("pending", &state.0)
            .field("latency", &state.1)
            .finish()
    }
}

impl<S> Controls<S> {
    fn lock(&self) -> MutexGuard<'_, (S, Duration)> {
        // Every update is a single assignment, so a poisoned state is consistent.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl<S: Default> Controls<S> {
    fn with<T>(&self, f: impl FnOnce(&mut S) -> T) -> T {
        f(&mut self.lock().0)
    }

    fn set_latency(&self, latency: Duration) {
        self.lock().1 = latency;
    }

    fn clear(&self) {
        *self.lock() = (S::default(), Duration::ZERO);
    }

    /// Sleeps the latency (on tokio's clock) before a call does anything.
    async fn delay(&self) {
        let latency = self.lock().1;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
    }
}

/// Denied or failed acquires: one fault per call, an injected error before a denial.
#[derive(Debug, Default)]
struct AcquireFaults {
    deny: u32,
    fail: Failures,
}

impl AcquireFaults {
    /// `(denied, failed with)` for the next acquire.
    fn next(&mut self) -> (bool, Option<ErrorKind>) {
        match take_kind(&mut self.fail) {
            Some(kind) => (false, Some(kind)),
            None => (take(&mut self.deny), None),
        }
    }
}

#[derive(Debug, Default)]
struct LockerState {
    acquires: AcquireFaults,
    busy_acquires: u32,
    fail_renews: Failures,
    lose_renews: u32,
    fail_releases: Failures,
    fail_lease_checks: Failures,
    fail_admin_calls: Failures,
}

/// Controls the faults of a [`FaultyStreamLocker`]. Clones control the same wrapper.
///
/// Only faults a stream locker can have are offered; an event store's do not compile:
///
/// ```compile_fail,E0599
/// use lockstep_core::{ErrorKind, StreamLockOptions};
/// use lockstep_testkit::{FaultyStreamLocker, InMemoryStreamLocker};
///
/// let (_locker, faults) =
///     FaultyStreamLocker::new(InMemoryStreamLocker::new(StreamLockOptions::default()));
/// faults.fail_next_appends(1, ErrorKind::Conflict); // a stream locker appends nothing
/// ```
///
/// while the same handle takes a locker's faults:
///
/// ```
/// use lockstep_core::{ErrorKind, StreamLockOptions};
/// use lockstep_testkit::{FaultyStreamLocker, InMemoryStreamLocker};
///
/// let (_locker, faults) =
///     FaultyStreamLocker::new(InMemoryStreamLocker::new(StreamLockOptions::default()));
/// faults.fail_next_renews(1, ErrorKind::ConnectionLost);
/// ```
#[derive(Debug, Clone, Default)]
pub struct StreamLockerFaults {
    controls: Controls<LockerState>,
}

impl StreamLockerFaults {
    /// The next `n` `try_acquire` calls report [`AcquireOutcome::Denied`], naming a made-up
    /// holder, without reaching the locker.
    pub fn deny_next_acquires(&self, n: u32) {
        self.controls.with(|f| f.acquires.deny = n);
    }

    /// The next `n` `try_acquire` calls fail with an error of `kind`.
    pub fn fail_next_acquires(&self, n: u32, kind: ErrorKind) {
        self.controls.with(|f| f.acquires.fail = Some((n, kind)));
    }

    /// The next `n` `try_acquire` calls report [`AcquireOutcome::Busy`] (the cursor row in use
    /// by another transaction) without reaching the locker. An injected error or denial of the
    /// same call comes first.
    pub fn busy_next_acquires(&self, n: u32) {
        self.controls.with(|f| f.busy_acquires = n);
    }

    /// The next `n` renews fail with an error of `kind` (the lease itself is untouched).
    /// `renew_many` counts one renew per lease.
    pub fn fail_next_renews(&self, n: u32, kind: ErrorKind) {
        self.controls.with(|f| f.fail_renews = Some((n, kind)));
    }

    /// The next `n` renews report [`RenewOutcome::Lost`] without touching the lease.
    pub fn lose_next_renews(&self, n: u32) {
        self.controls.with(|f| f.lose_renews = n);
    }

    /// The next `n` releases fail with an error of `kind` (the lease stays held).
    pub fn fail_next_releases(&self, n: u32, kind: ErrorKind) {
        self.controls.with(|f| f.fail_releases = Some((n, kind)));
    }

    /// The next `n` fence checks ([`LeaseFence::check_lease`]) fail with an error of `kind`
    /// without reaching the locker: [`ErrorKind::LeaseLost`] drives the "lease lost, roll back"
    /// path of code that fences its commits, as if the lease had been taken over.
    pub fn fail_next_lease_checks(&self, n: u32, kind: ErrorKind) {
        self.controls
            .with(|f| f.fail_lease_checks = Some((n, kind)));
    }

    /// The next `n` admin calls ([`StreamLockAdmin`]: list, inspect, force-release,
    /// release-all; [`FleetAdmin`]: list instances) fail with an error of `kind` and change nothing.
    pub fn fail_next_admin_calls(&self, n: u32, kind: ErrorKind) {
        self.controls.with(|f| f.fail_admin_calls = Some((n, kind)));
    }

    /// Every call sleeps `latency` (on tokio's clock) before doing anything.
    pub fn set_latency(&self, latency: Duration) {
        self.controls.set_latency(latency);
    }

    /// Removes every pending fault and the latency.
    pub fn clear(&self) {
        self.controls.clear();
    }
}

/// A [`StreamLocker`] (and, when the wrapped locker is one, a [`StreamLockAdmin`], a
/// [`LeaseFence`], a [`Fleet`] and a [`FleetAdmin`]) that injects the faults its [`StreamLockerFaults`] handle asks for.
#[derive(Debug, Clone)]
pub struct FaultyStreamLocker<L> {
    inner: L,
    faults: StreamLockerFaults,
}

impl<L> FaultyStreamLocker<L> {
    /// Wraps `inner`; returns the wrapper and its handle.
    pub fn new(inner: L) -> (Self, StreamLockerFaults) {
        let faults = StreamLockerFaults::default();
        (
            FaultyStreamLocker {
                inner,
                faults: faults.clone(),
            },
            faults,
        )
    }

    /// The wrapped locker.
    pub fn inner(&self) -> &L {
        &self.inner
    }

    /// Waits the latency, then takes the next admin-call fault, if any.
    async fn admin_fault(&self, what: &str) -> Result<()> {
        self.faults.controls.delay().await;
        match self
            .faults
            .controls
            .with(|f| take_kind(&mut f.fail_admin_calls))
        {
            Some(kind) => Err(injected(kind, what)),
            None => Ok(()),
        }
    }
}

#[async_trait]
impl<L: StreamLocker> StreamLocker for FaultyStreamLocker<L> {
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
        self.faults.controls.delay().await;
        let (deny, fail, busy) = self.faults.controls.with(|f| {
            let (deny, fail) = f.acquires.next();
            let busy = fail.is_none() && !deny && take(&mut f.busy_acquires);
            (deny, fail, busy)
        });
        if let Some(kind) = fail {
            return Err(injected(kind, "try_acquire"));
        }
        if deny {
            return Ok(AcquireOutcome::Denied(LeaseHolder {
                instance: InstanceId::random(),
                reason: LockReason::custom("fault-injected")?,
                expires_at: OffsetDateTime::now_utc() + self.inner.options().lock_timeout(),
                epoch: LeaseEpoch::new(0),
            }));
        }
        if busy {
            return Ok(AcquireOutcome::Busy);
        }
        self.inner
            .try_acquire(stream_id, perspective, instance, reason)
            .await
    }

    async fn renew(&self, lease: &LeaseId) -> Result<RenewOutcome> {
        self.faults.controls.delay().await;
        // One fault per call: an error first, then a lost renew.
        let (fail, lose) = self
            .faults
            .controls
            .with(|f| match take_kind(&mut f.fail_renews) {
                Some(kind) => (Some(kind), false),
                None => (None, take(&mut f.lose_renews)),
            });
        if let Some(kind) = fail {
            return Err(injected(kind, "renew"));
        }
        if lose {
            return Ok(RenewOutcome::Lost);
        }
        self.inner.renew(lease).await
    }

    async fn release(&self, lease: &LeaseId) -> Result<ReleaseOutcome> {
        self.faults.controls.delay().await;
        if let Some(kind) = self
            .faults
            .controls
            .with(|f| take_kind(&mut f.fail_releases))
        {
            return Err(injected(kind, "release"));
        }
        self.inner.release(lease).await
    }

    async fn renew_many(&self, leases: &[LeaseId]) -> Result<Vec<RenewOutcome>> {
        // One renew each, so per-renew faults apply to batched keepalives too.
        let mut outcomes = Vec::with_capacity(leases.len());
        for lease in leases {
            outcomes.push(self.renew(lease).await?);
        }
        Ok(outcomes)
    }
}

/// Admin calls pass through unless [`StreamLockerFaults::fail_next_admin_calls`] fails them.
#[async_trait]
impl<L: StreamLockAdmin> StreamLockAdmin for FaultyStreamLocker<L> {
    async fn list_leases(&self) -> Result<Vec<LeaseInfo>> {
        self.admin_fault("list_leases").await?;
        self.inner.list_leases().await
    }

    async fn list_lease_entries(&self) -> Result<Vec<lockstep_core::LeaseEntry>> {
        self.admin_fault("list_lease_entries").await?;
        self.inner.list_lease_entries().await
    }

    async fn inspect(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<Option<CursorLease>> {
        self.admin_fault("inspect").await?;
        self.inner.inspect(stream_id, perspective).await
    }

    async fn force_release(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<ReleaseOutcome> {
        self.admin_fault("force_release").await?;
        self.inner.force_release(stream_id, perspective).await
    }

    async fn release_all_held_by(&self, instance: InstanceId) -> Result<u64> {
        self.admin_fault("release_all_held_by").await?;
        self.inner.release_all_held_by(instance).await
    }
}

/// The fleet's calls, when the wrapped locker keeps one: the latency applies; a keepalive's
/// renewals take the renew faults.
#[async_trait]
impl<L: Fleet> Fleet for FaultyStreamLocker<L> {
    async fn announce(&self, announcement: &lockstep_core::InstanceAnnouncement) -> Result<()> {
        self.faults.controls.delay().await;
        self.inner.announce(announcement).await
    }

    /// One renew each (the per-renew faults apply), then the inner keepalive with no lease to
    /// mark the instance seen.
    async fn keepalive(
        &self,
        instance: InstanceId,
        token: Uuid,
        leases: &[LeaseId],
    ) -> Result<lockstep_core::KeepaliveOutcome> {
        let renewed = self.renew_many(leases).await?;
        let seen = self.inner.keepalive(instance, token, &[]).await?.seen;
        Ok(lockstep_core::KeepaliveOutcome::new(renewed, seen))
    }

    async fn depart(&self, instance: InstanceId, token: Uuid) -> Result<bool> {
        self.faults.controls.delay().await;
        self.inner.depart(instance, token).await
    }
}

/// The fleet's listing passes through unless [`StreamLockerFaults::fail_next_admin_calls`]
/// fails it.
#[async_trait]
impl<L: FleetAdmin> FleetAdmin for FaultyStreamLocker<L> {
    async fn list_instances(&self) -> Result<Vec<lockstep_core::WorkerInstance>> {
        self.admin_fault("list_instances").await?;
        self.inner.list_instances().await
    }

    async fn list_instance_entries(&self) -> Result<Vec<lockstep_core::InstanceEntry>> {
        self.admin_fault("list_instance_entries").await?;
        self.inner.list_instance_entries().await
    }
}

/// Fence checks pass through unless [`StreamLockerFaults::fail_next_lease_checks`] fails them.
impl<Tx, L> LeaseFence<Tx> for FaultyStreamLocker<L>
where
    Tx: ?Sized + Sync,
    L: LeaseFence<Tx>,
{
    async fn check_lease(&self, tx: &Tx, lease: &LeaseId) -> Result<()> {
        self.faults.controls.delay().await;
        if let Some(kind) = self
            .faults
            .controls
            .with(|f| take_kind(&mut f.fail_lease_checks))
        {
            return Err(injected(kind, "check_lease"));
        }
        self.inner.check_lease(tx, lease).await
    }
}

/// Controls the faults of a [`FaultyDistributedLock`]. Clones control the same wrapper.
#[derive(Debug, Clone, Default)]
pub struct DistributedLockFaults {
    controls: Controls<AcquireFaults>,
}

impl DistributedLockFaults {
    /// The next `n` acquires are denied without reaching the lock: a try-acquire returns
    /// `false`, a blocking acquire fails with [`ErrorKind::LockTimeout`].
    pub fn deny_next_acquires(&self, n: u32) {
        self.controls.with(|f| f.deny = n);
    }

    /// The next `n` acquires (blocking or try) fail with an error of `kind`.
    pub fn fail_next_acquires(&self, n: u32, kind: ErrorKind) {
        self.controls.with(|f| f.fail = Some((n, kind)));
    }

    /// Every call sleeps `latency` (on tokio's clock) before doing anything.
    pub fn set_latency(&self, latency: Duration) {
        self.controls.set_latency(latency);
    }

    /// Removes every pending fault and the latency.
    pub fn clear(&self) {
        self.controls.clear();
    }
}

/// A [`DistributedLock`] that injects the faults its [`DistributedLockFaults`] handle asks for.
#[derive(Debug, Clone)]
pub struct FaultyDistributedLock<L> {
    inner: L,
    faults: DistributedLockFaults,
}

impl<L> FaultyDistributedLock<L> {
    /// Wraps `inner`; returns the wrapper and its handle.
    pub fn new(inner: L) -> (Self, DistributedLockFaults) {
        let faults = DistributedLockFaults::default();
        (
            FaultyDistributedLock {
                inner,
                faults: faults.clone(),
            },
            faults,
        )
    }

    /// The wrapped lock.
    pub fn inner(&self) -> &L {
        &self.inner
    }
}

impl<Tx, L> DistributedLock<Tx> for FaultyDistributedLock<L>
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
        self.faults.controls.delay().await;
        let (deny, fail) = self.faults.controls.with(AcquireFaults::next);
        if let Some(kind) = fail {
            return Err(injected(kind, "acquire_for_transaction"));
        }
        if deny {
            return Err(injected(ErrorKind::LockTimeout, "acquire_for_transaction"));
        }
        self.inner.acquire_for_transaction(tx, key, timeout).await
    }

    async fn try_acquire_for_transaction(&self, tx: &Tx, key: &ResourceKey) -> Result<bool> {
        self.faults.controls.delay().await;
        let (deny, fail) = self.faults.controls.with(AcquireFaults::next);
        if let Some(kind) = fail {
            return Err(injected(kind, "try_acquire_for_transaction"));
        }
        if deny {
            return Ok(false);
        }
        self.inner.try_acquire_for_transaction(tx, key).await
    }
}

#[derive(Debug, Default)]
struct StoreState {
    fail_loads: Failures,
    fail_appends: Failures,
    locks: AcquireFaults,
}

/// Controls the faults of a [`FaultyEventStore`]. Clones control the same wrapper.
#[derive(Debug, Clone, Default)]
pub struct EventStoreFaults {
    controls: Controls<StoreState>,
}

impl EventStoreFaults {
    /// The next `n` loads (`load`, `load_locked` or `load_from_snapshot`, which then take no
    /// lock) fail with an error of `kind`.
    pub fn fail_next_loads(&self, n: u32, kind: ErrorKind) {
        self.controls.with(|f| f.fail_loads = Some((n, kind)));
    }

    /// The next `n` appends fail with an error of `kind` and append nothing. A
    /// [`ErrorKind::Conflict`] carries a [`VersionConflict`] (read it with
    /// [`lockstep_core::version_conflict`]) whose actual version is unknown, as when another
    /// writer appended the same version first; use it to drive an application's optimistic
    /// retry path.
    pub fn fail_next_appends(&self, n: u32, kind: ErrorKind) {
        self.controls.with(|f| f.fail_appends = Some((n, kind)));
    }

    /// The lock of the next `n` `load_locked` calls is denied: they fail with
    /// [`ErrorKind::LockTimeout`] and take no lock.
    pub fn deny_next_acquires(&self, n: u32) {
        self.controls.with(|f| f.locks.deny = n);
    }

    /// The lock of the next `n` `load_locked` calls fails with an error of `kind` (no lock
    /// taken).
    pub fn fail_next_acquires(&self, n: u32, kind: ErrorKind) {
        self.controls.with(|f| f.locks.fail = Some((n, kind)));
    }

    /// Every call sleeps `latency` (on tokio's clock) before doing anything.
    pub fn set_latency(&self, latency: Duration) {
        self.controls.set_latency(latency);
    }

    /// Removes every pending fault and the latency.
    pub fn clear(&self) {
        self.controls.clear();
    }
}

/// An [`EventStore`] that injects the faults its [`EventStoreFaults`] handle asks for: failed
/// loads, failed appends, and for `load_locked` also failed or denied locks (a denial is a
/// [`ErrorKind::LockTimeout`]); latency applies to every call. One fault per call, a load
/// failure before a lock fault.
///
/// Like every wrapper here, an injected failure does not abort the caller's transaction (see
/// the [module docs](self)).
#[derive(Debug, Clone)]
pub struct FaultyEventStore<S> {
    inner: S,
    faults: EventStoreFaults,
}

impl<S> FaultyEventStore<S> {
    /// Wraps `inner`; returns the wrapper and its handle.
    pub fn new(inner: S) -> (Self, EventStoreFaults) {
        let faults = EventStoreFaults::default();
        (
            FaultyEventStore {
                inner,
                faults: faults.clone(),
            },
            faults,
        )
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S> FaultyEventStore<S> {
    /// The configured delay, then the next injected append failure, if any (a conflict carries
    /// a [`VersionConflict`]); shared by `append` and `append_at_commit`.
    async fn injected_append_failure(
        &self,
        stream_id: StreamId,
        expected: ExpectedVersion,
        op: &'static str,
    ) -> Result<()> {
        self.faults.controls.delay().await;
        match self
            .faults
            .controls
            .with(|f| take_kind(&mut f.fail_appends))
        {
            Some(ErrorKind::Conflict) => Err(VersionConflict::new(stream_id, expected, None)
                .with_source(injected(ErrorKind::Conflict, op))
                .into_error()),
            Some(kind) => Err(injected(kind, op)),
            None => Ok(()),
        }
    }
}

impl<Tx, S> EventStore<Tx> for FaultyEventStore<S>
where
    Tx: ?Sized + Sync,
    S: EventStore<Tx>,
{
    async fn load(&self, tx: &Tx, stream_id: StreamId) -> Result<Vec<RecordedEvent>> {
        self.faults.controls.delay().await;
        if let Some(kind) = self.faults.controls.with(|f| take_kind(&mut f.fail_loads)) {
            return Err(injected(kind, "load"));
        }
        self.inner.load(tx, stream_id).await
    }

    async fn load_locked(
        &self,
        tx: &Tx,
        stream_id: StreamId,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<Vec<RecordedEvent>> {
        self.faults.controls.delay().await;
        let (fail_load, (deny, fail_lock)) =
            self.faults
                .controls
                .with(|f| match take_kind(&mut f.fail_loads) {
                    Some(kind) => (Some(kind), (false, None)),
                    None => (None, f.locks.next()),
                });
        if let Some(kind) = fail_load.or(fail_lock) {
            return Err(injected(kind, "load_locked"));
        }
        if deny {
            return Err(injected(ErrorKind::LockTimeout, "load_locked"));
        }
        self.inner.load_locked(tx, stream_id, key, timeout).await
    }

    async fn append(
        &self,
        tx: &Tx,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<u64> {
        self.injected_append_failure(stream_id, expected, "append")
            .await?;
        self.inner.append(tx, stream_id, expected, events).await
    }

    /// Injected append failures apply here too, reported at once (as by a backend that cannot
    /// hold the append back until commit).
    async fn append_at_commit(
        &self,
        tx: &Tx,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &[NewEvent],
    ) -> Result<()> {
        self.injected_append_failure(stream_id, expected, "append_at_commit")
            .await?;
        self.inner
            .append_at_commit(tx, stream_id, expected, events)
            .await
    }
}

/// `load_from_snapshot` is a load: the load faults apply to it, and with a lock the lock faults
/// too, as to `load_locked`; saving and deleting snapshots are passed on (latency applies).
impl<Tx, S> SnapshotStore<Tx> for FaultyEventStore<S>
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
        self.faults.controls.delay().await;
        let locked = lock.is_some();
        let (fail_load, (deny, fail_lock)) =
            self.faults
                .controls
                .with(|f| match take_kind(&mut f.fail_loads) {
                    Some(kind) => (Some(kind), (false, None)),
                    None if locked => (None, f.locks.next()),
                    None => (None, (false, None)),
                });
        if let Some(kind) = fail_load.or(fail_lock) {
            return Err(injected(kind, "load_from_snapshot"));
        }
        if deny {
            return Err(injected(ErrorKind::LockTimeout, "load_from_snapshot"));
        }
        self.inner.load_from_snapshot(tx, key, lock).await
    }

    async fn save_snapshot(
        &self,
        tx: &Tx,
        key: &SnapshotKey,
        snapshot: &AggregateSnapshot,
    ) -> Result<bool> {
        self.faults.controls.delay().await;
        self.inner.save_snapshot(tx, key, snapshot).await
    }

    async fn delete_snapshots(
        &self,
        tx: &Tx,
        aggregate_type: &AggregateType,
        below_schema_version: Option<u32>,
    ) -> Result<u64> {
        self.faults.controls.delay().await;
        self.inner
            .delete_snapshots(tx, aggregate_type, below_schema_version)
            .await
    }
}
