//! Fault-injecting wrappers: forward to the wrapped implementation unless the test, through a
//! handle, has asked for a fault — deny the next acquires, fail or lose the next renews, fail
//! the next lock calls, loads or appends with a chosen kind, add latency to every call.
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

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lockstep_core::{
    AcquireOutcome, DistributedLock, Error, ErrorKind, EventStore, ExpectedVersion, InstanceId,
    LeaseEpoch, LeaseHolder, LeaseId, LockReason, NewEvent, PerspectiveName, RecordedEvent,
    ReleaseOutcome, RenewOutcome, ResourceKey, Result, StreamId, StreamLockOptions, StreamLocker,
    VersionConflict, async_trait,
};
use time::OffsetDateTime;

#[derive(Debug, Default)]
struct Faults {
    deny_acquires: u32,
    fail_acquires: Option<(u32, ErrorKind)>,
    fail_renews: Option<(u32, ErrorKind)>,
    lose_renews: u32,
    fail_releases: Option<(u32, ErrorKind)>,
    fail_loads: Option<(u32, ErrorKind)>,
    fail_appends: Option<(u32, ErrorKind)>,
    latency: Duration,
}

/// Takes one from a countdown; true if a fault fires.
fn take(count: &mut u32) -> bool {
    if *count > 0 {
        *count -= 1;
        true
    } else {
        false
    }
}

fn take_kind(slot: &mut Option<(u32, ErrorKind)>) -> Option<ErrorKind> {
    let (count, kind) = slot.as_mut()?;
    let kind = *kind;
    if take(count) { Some(kind) } else { None }
}

fn injected(kind: ErrorKind, what: &str) -> Error {
    Error::new(kind, format!("fault injected into {what}"))
}

/// Controls the faults of a faulty wrapper. Clones control the same wrapper.
#[derive(Debug, Clone, Default)]
pub struct FaultHandle {
    faults: Arc<Mutex<Faults>>,
}

impl FaultHandle {
    fn faults(&self) -> MutexGuard<'_, Faults> {
        self.faults
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The next `n` acquires are denied (stream locker: `Denied` by a made-up holder;
    /// distributed lock: try-acquire returns `false`, blocking acquire times out; event store:
    /// `load_locked` times out).
    pub fn deny_next_acquires(&self, n: u32) {
        self.faults().deny_acquires = n;
    }

    /// The next `n` acquires (event store: `load_locked` calls) fail with an error of `kind`.
    pub fn fail_next_acquires(&self, n: u32, kind: ErrorKind) {
        self.faults().fail_acquires = Some((n, kind));
    }

    /// The next `n` renews fail with an error of `kind` (the lease itself is untouched).
    pub fn fail_next_renews(&self, n: u32, kind: ErrorKind) {
        self.faults().fail_renews = Some((n, kind));
    }

    /// The next `n` renews report [`RenewOutcome::Lost`] without touching the lease.
    pub fn lose_next_renews(&self, n: u32) {
        self.faults().lose_renews = n;
    }

    /// The next `n` releases fail with an error of `kind` (the lease stays held).
    pub fn fail_next_releases(&self, n: u32, kind: ErrorKind) {
        self.faults().fail_releases = Some((n, kind));
    }

    /// The next `n` loads (`load` or `load_locked`, which then takes no lock) fail with an
    /// error of `kind`.
    pub fn fail_next_loads(&self, n: u32, kind: ErrorKind) {
        self.faults().fail_loads = Some((n, kind));
    }

    /// The next `n` appends fail with an error of `kind` and append nothing. A
    /// [`ErrorKind::Conflict`] carries a [`VersionConflict`] (read it with
    /// [`lockstep_core::version_conflict`]) whose actual version is unknown, as when another
    /// writer appended the same version first; use it to drive an application's optimistic
    /// retry path.
    pub fn fail_next_appends(&self, n: u32, kind: ErrorKind) {
        self.faults().fail_appends = Some((n, kind));
    }

    /// Every call sleeps `latency` (on tokio's clock) before doing anything.
    pub fn set_latency(&self, latency: Duration) {
        self.faults().latency = latency;
    }

    /// Removes every pending fault and the latency.
    pub fn clear(&self) {
        *self.faults() = Faults::default();
    }

    /// One fault per call: an injected error first, then a denial.
    fn next_acquire_fault(&self) -> (bool, Option<ErrorKind>) {
        let mut f = self.faults();
        match take_kind(&mut f.fail_acquires) {
            Some(kind) => (false, Some(kind)),
            None => (take(&mut f.deny_acquires), None),
        }
    }

    async fn delay(&self) {
        let latency = self.faults().latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
    }
}

/// A [`StreamLocker`] that injects the faults its [`FaultHandle`] asks for.
#[derive(Debug, Clone)]
pub struct FaultyStreamLocker<L> {
    inner: L,
    handle: FaultHandle,
}

impl<L> FaultyStreamLocker<L> {
    /// Wraps `inner`; returns the wrapper and its handle.
    pub fn new(inner: L) -> (Self, FaultHandle) {
        let handle = FaultHandle::default();
        (
            FaultyStreamLocker {
                inner,
                handle: handle.clone(),
            },
            handle,
        )
    }

    /// The wrapped locker.
    pub fn inner(&self) -> &L {
        &self.inner
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
        self.handle.delay().await;
        let (deny, fail) = self.handle.next_acquire_fault();
        if let Some(kind) = fail {
            return Err(injected(kind, "try_acquire"));
        }
        if deny {
            return Ok(AcquireOutcome::Denied(LeaseHolder {
                instance: InstanceId::random(),
                reason: LockReason::custom("fault-injected").map_err(Error::from)?,
                expires_at: OffsetDateTime::now_utc() + self.inner.options().lock_timeout(),
                epoch: LeaseEpoch::new(0),
            }));
        }
        self.inner
            .try_acquire(stream_id, perspective, instance, reason)
            .await
    }

    async fn renew(&self, lease: &LeaseId) -> Result<RenewOutcome> {
        self.handle.delay().await;
        // One fault per call: an error first, then a lost renew.
        let (fail, lose) = {
            let mut f = self.handle.faults();
            match take_kind(&mut f.fail_renews) {
                Some(kind) => (Some(kind), false),
                None => (None, take(&mut f.lose_renews)),
            }
        };
        if let Some(kind) = fail {
            return Err(injected(kind, "renew"));
        }
        if lose {
            return Ok(RenewOutcome::Lost);
        }
        self.inner.renew(lease).await
    }

    async fn release(&self, lease: &LeaseId) -> Result<ReleaseOutcome> {
        self.handle.delay().await;
        let fail = take_kind(&mut self.handle.faults().fail_releases);
        if let Some(kind) = fail {
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

/// A [`DistributedLock`] that injects the faults its [`FaultHandle`] asks for.
#[derive(Debug, Clone)]
pub struct FaultyDistributedLock<L> {
    inner: L,
    handle: FaultHandle,
}

impl<L> FaultyDistributedLock<L> {
    /// Wraps `inner`; returns the wrapper and its handle.
    pub fn new(inner: L) -> (Self, FaultHandle) {
        let handle = FaultHandle::default();
        (
            FaultyDistributedLock {
                inner,
                handle: handle.clone(),
            },
            handle,
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
        self.handle.delay().await;
        let (deny, fail) = self.handle.next_acquire_fault();
        if let Some(kind) = fail {
            return Err(injected(kind, "acquire_for_transaction"));
        }
        if deny {
            return Err(injected(ErrorKind::LockTimeout, "acquire_for_transaction"));
        }
        self.inner.acquire_for_transaction(tx, key, timeout).await
    }

    async fn try_acquire_for_transaction(&self, tx: &Tx, key: &ResourceKey) -> Result<bool> {
        self.handle.delay().await;
        let (deny, fail) = self.handle.next_acquire_fault();
        if let Some(kind) = fail {
            return Err(injected(kind, "try_acquire_for_transaction"));
        }
        if deny {
            return Ok(false);
        }
        self.inner.try_acquire_for_transaction(tx, key).await
    }
}

/// An [`EventStore`] that injects the faults its [`FaultHandle`] asks for: failed loads
/// ([`FaultHandle::fail_next_loads`]), failed appends ([`FaultHandle::fail_next_appends`]),
/// and for `load_locked` also failed or denied acquires (a denial is a
/// [`ErrorKind::LockTimeout`]); latency applies to every call. One fault per call, a load
/// failure before an acquire fault.
///
/// An injected failure never reaches the wrapped store, so unlike a real failed statement it
/// does **not** abort the caller's transaction (the wrapper cannot reach into an arbitrary
/// transaction type). Code under test must still retry in a new transaction, as the contract
/// requires; this wrapper will not catch a retry on the failed one.
#[derive(Debug, Clone)]
pub struct FaultyEventStore<S> {
    inner: S,
    handle: FaultHandle,
}

impl<S> FaultyEventStore<S> {
    /// Wraps `inner`; returns the wrapper and its handle.
    pub fn new(inner: S) -> (Self, FaultHandle) {
        let handle = FaultHandle::default();
        (
            FaultyEventStore {
                inner,
                handle: handle.clone(),
            },
            handle,
        )
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl<Tx, S> EventStore<Tx> for FaultyEventStore<S>
where
    Tx: ?Sized + Sync,
    S: EventStore<Tx>,
{
    async fn load(&self, tx: &Tx, stream_id: StreamId) -> Result<Vec<RecordedEvent>> {
        self.handle.delay().await;
        let fail = take_kind(&mut self.handle.faults().fail_loads);
        if let Some(kind) = fail {
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
        self.handle.delay().await;
        let fail = take_kind(&mut self.handle.faults().fail_loads);
        if let Some(kind) = fail {
            return Err(injected(kind, "load_locked"));
        }
        let (deny, fail) = self.handle.next_acquire_fault();
        if let Some(kind) = fail {
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
        self.handle.delay().await;
        let fail = take_kind(&mut self.handle.faults().fail_appends);
        match fail {
            Some(ErrorKind::Conflict) => Err(VersionConflict::new(stream_id, expected, None)
                .with_source(injected(ErrorKind::Conflict, "append"))
                .into_error()),
            Some(kind) => Err(injected(kind, "append")),
            None => self.inner.append(tx, stream_id, expected, events).await,
        }
    }
}
