//! The lease lifecycle as a library piece: [`LeaseKeeper`] keeps an instance's stream leases
//! alive and [`HeldLease`] is one of them — the seed's "acquire, start keepalive, work, stop
//! keepalive, release in `finally`", made safe by construction.
//!
//! - **One keepalive per instance**, not per lease: every `keepalive_interval` the keeper renews
//!   all leases it holds with one [`StreamLocker::renew_many`] call (one statement on Postgres),
//!   bounded by the interval itself so a stuck call cannot delay the next check.
//! - **Lost signal.** Each lease has a [`CancellationToken`] ([`HeldLease::lost`]). It fires when
//!   a renew reports the lease [`RenewOutcome::Lost`], or when the lease's **local monotonic
//!   deadline** passes without a confirmed renew. The deadline is `sent + lock_timeout −
//!   keepalive_interval`, where `sent` is when the last successful acquire or renew was *sent*:
//!   the backend computed the expiry no earlier than that, so the signal fires at least one
//!   keepalive interval before any other instance can take the lease over — whatever the clocks
//!   say, since only durations on this machine's monotonic clock are compared.
//! - **Fenced commit.** [`HeldLease::id`] is what the protected work passes as the fence of its
//!   commit (`StateCommit::fence`, `LeaseFence::check_lease`): even a holder that stalled past
//!   its deadline cannot commit over a successor's work.
//! - **Release on every path.** [`HeldLease::release`] stops the keepalive for the lease and
//!   releases it; dropping a `HeldLease` without releasing (an error path, a panic, a cancelled
//!   future) stops the keepalive at once and releases in a spawned task.
//!
//! ```no_run
//! # async fn demo(locker: std::sync::Arc<dyn lockstep_core::StreamLocker>) -> lockstep_core::Result<()> {
//! use lockstep_core::{InstanceId, LockReason, PerspectiveName, StreamId};
//! use lockstep_worker::{LeaseKeeper, Leased};
//!
//! let keeper = LeaseKeeper::start(locker, InstanceId::process());
//! let (stream, name) = (StreamId::new_v7(), PerspectiveName::new("OrderPerspective")?);
//! match keeper.try_acquire(stream, &name, &LockReason::Rewind).await? {
//!     Leased::Held(lease) => {
//!         tokio::select! {
//!             () = lease.lost().cancelled() => { /* stop: commit nothing */ }
//!             () = async { /* rebuild, then commit fenced with lease.id() */ } => {}
//!         }
//!         lease.release().await?;
//!     }
//!     Leased::Denied(holder) => { /* another instance holds it: skip, retry later */ let _ = holder; }
//!     Leased::NoCursor => { /* nothing to lease */ }
//! }
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use lockstep_core::{
    AcquireOutcome, InstanceId, LeaseHolder, LeaseId, LockReason, PerspectiveName, ReleaseOutcome,
    RenewOutcome, Result, StreamId, StreamLease, StreamLocker,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::telemetry::{self, count};

/// One held lease as the keeper tracks it.
#[derive(Debug)]
struct Entry {
    id: LeaseId,
    lost: CancellationToken,
    deadline: Instant,
}

struct Shared {
    locker: Arc<dyn StreamLocker>,
    instance: InstanceId,
    entries: Mutex<HashMap<u64, Entry>>,
    next: std::sync::atomic::AtomicU64,
    /// Renews sent by the keeper (one per interval with leases held); for tests and benchmarks.
    renew_calls: std::sync::atomic::AtomicU64,
    stop: CancellationToken,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseKeeper")
            .field("instance", &self.instance)
            .field("held", &self.entries().len())
            .finish()
    }
}

impl Shared {
    fn entries(&self) -> MutexGuard<'_, HashMap<u64, Entry>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How long after a confirmed acquire or renew was sent the lost signal fires.
    fn margin(&self) -> Duration {
        let options = self.locker.options();
        // Validated options guarantee keepalive < timeout / 2, so this is > timeout / 2.
        options
            .lock_timeout()
            .saturating_sub(options.keepalive_interval())
    }
}

/// Keeps an instance's stream leases alive: one background task renewing every lease it holds
/// once per keepalive interval. Cheap to clone; the task stops when the last clone is dropped
/// or [`LeaseKeeper::shutdown`] is called.
#[derive(Debug, Clone)]
pub struct LeaseKeeper {
    shared: Arc<Shared>,
    _task: Arc<TaskGuard>,
}

/// Stops the keepalive task when the last keeper clone goes.
#[derive(Debug)]
struct TaskGuard(CancellationToken);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// The outcome of [`LeaseKeeper::try_acquire`].
#[derive(Debug)]
#[must_use]
pub enum Leased {
    /// Held and kept alive until released or dropped.
    Held(HeldLease),
    /// Another instance holds a live lease.
    Denied(LeaseHolder),
    /// The pair has no cursor row.
    NoCursor,
}

impl LeaseKeeper {
    /// Starts the keepalive task for leases of `instance` taken through `locker` (on the
    /// current tokio runtime).
    pub fn start(locker: Arc<dyn StreamLocker>, instance: InstanceId) -> LeaseKeeper {
        let stop = CancellationToken::new();
        let shared = Arc::new(Shared {
            locker,
            instance,
            entries: Mutex::default(),
            next: std::sync::atomic::AtomicU64::new(1),
            renew_calls: std::sync::atomic::AtomicU64::new(0),
            stop: stop.clone(),
        });
        tokio::spawn(keepalive(Arc::downgrade(&shared), stop.clone()));
        LeaseKeeper {
            shared,
            _task: Arc::new(TaskGuard(stop)),
        }
    }

    /// The instance the leases are taken for.
    pub fn instance(&self) -> InstanceId {
        self.shared.instance
    }

    /// The locker the leases are taken through.
    pub fn locker(&self) -> &Arc<dyn StreamLocker> {
        &self.shared.locker
    }

    /// Tries to take the pair's lease for this instance (see [`StreamLocker::try_acquire`]); a
    /// held lease is kept alive from now on.
    ///
    /// A lease this instance already holds live is *re-entered* (the seed's idempotent
    /// re-acquire): both `HeldLease`s then name one lease, and the first release ends it for
    /// both. Inside one instance, serialize work on a pair (the worker's
    /// [`crate::ApplyCoordinator`]) instead of relying on that.
    pub async fn try_acquire(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        reason: &LockReason,
    ) -> Result<Leased> {
        let sent = Instant::now();
        let outcome = self
            .shared
            .locker
            .try_acquire(stream_id, perspective, self.shared.instance, reason)
            .await?;
        Ok(match outcome {
            AcquireOutcome::Acquired(lease) => Leased::Held(self.track(lease, sent)),
            AcquireOutcome::Denied(holder) => Leased::Denied(holder),
            AcquireOutcome::NoCursor => Leased::NoCursor,
        })
    }

    fn track(&self, lease: StreamLease, sent: Instant) -> HeldLease {
        let key = self
            .shared
            .next
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let lost = self.shared.stop.child_token();
        let deadline = sent
            .checked_add(self.shared.margin())
            // Unrepresentable: treat the lease as due for renewal now (conservative).
            .unwrap_or(sent);
        self.shared.entries().insert(
            key,
            Entry {
                id: lease.id.clone(),
                lost: lost.clone(),
                deadline,
            },
        );
        HeldLease {
            lease,
            lost,
            key,
            shared: Arc::clone(&self.shared),
            released: false,
        }
    }

    /// How many leases are kept alive now.
    pub fn held(&self) -> usize {
        self.shared.entries().len()
    }

    /// How many `renew_many` calls the keepalive has sent so far.
    pub fn renew_calls(&self) -> u64 {
        self.shared
            .renew_calls
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops the keepalive and releases every lease it held (graceful shutdown). Their lost
    /// signals fire. Returns how many were released.
    pub async fn shutdown(&self) -> Result<u64> {
        self.shared.stop.cancel();
        let entries: Vec<Entry> = self.shared.entries().drain().map(|(_, e)| e).collect();
        let mut released = 0;
        for entry in entries {
            entry.lost.cancel();
            if self.shared.locker.release(&entry.id).await? == ReleaseOutcome::Released {
                released += 1;
            }
        }
        Ok(released)
    }
}

/// The keepalive loop: renew everything held, then fire the lost signal of every lease that was
/// refused or whose local deadline passed.
async fn keepalive(shared: Weak<Shared>, stop: CancellationToken) {
    loop {
        let interval = match shared.upgrade() {
            Some(s) => s.locker.options().keepalive_interval(),
            None => return,
        };
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let held: Vec<(u64, LeaseId)> = shared
            .entries()
            .iter()
            .map(|(k, e)| (*k, e.id.clone()))
            .collect();
        if !held.is_empty() {
            let ids: Vec<LeaseId> = held.iter().map(|(_, id)| id.clone()).collect();
            let sent = Instant::now();
            shared
                .renew_calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // Bounded by the interval: a stuck renew must not keep the deadlines unchecked.
            let outcome = tokio::select! {
                () = stop.cancelled() => return,
                outcome = tokio::time::timeout(interval, shared.locker.renew_many(&ids)) => outcome,
            };
            match outcome {
                Ok(Ok(outcomes)) => {
                    let mut entries = shared.entries();
                    for ((key, _), renewed) in held.iter().zip(outcomes) {
                        let Some(entry) = entries.get_mut(key) else {
                            continue; // released meanwhile
                        };
                        match renewed {
                            RenewOutcome::Renewed { .. } => {
                                if let Some(deadline) = sent.checked_add(shared.margin()) {
                                    entry.deadline = deadline;
                                }
                            }
                            RenewOutcome::Lost => {
                                lose(entry, "the renew was refused: the lease is no longer held");
                            }
                        }
                    }
                }
                Ok(Err(err)) => {
                    tracing::warn!(error = %err, leases = ids.len(), "keepalive renew failed");
                }
                Err(_) => {
                    tracing::warn!(leases = ids.len(), "keepalive renew timed out");
                }
            }
        }
        let now = Instant::now();
        for entry in shared.entries().values() {
            if now >= entry.deadline && !entry.lost.is_cancelled() {
                lose(entry, "no renew was confirmed before the local deadline");
            }
        }
    }
}

fn lose(entry: &Entry, why: &str) {
    if entry.lost.is_cancelled() {
        return;
    }
    tracing::warn!(
        stream_id = %entry.id.stream_id,
        perspective = %entry.id.perspective,
        epoch = entry.id.epoch.get(),
        why,
        "stream lease lost"
    );
    count(telemetry::LEASES_LOST, entry.id.perspective.as_str(), 1);
    entry.lost.cancel();
}

/// One lease held by this instance and kept alive by its [`LeaseKeeper`].
#[derive(Debug)]
pub struct HeldLease {
    lease: StreamLease,
    lost: CancellationToken,
    key: u64,
    shared: Arc<Shared>,
    released: bool,
}

impl HeldLease {
    /// The lease (pass [`HeldLease::id`] as the fence of a commit).
    pub fn lease(&self) -> &StreamLease {
        &self.lease
    }

    /// Which lease: the fence of the protected work's commit.
    pub fn id(&self) -> &LeaseId {
        &self.lease.id
    }

    /// Fires when the lease is lost (renew refused, or no renew confirmed before the local
    /// deadline): stop the protected work and commit nothing.
    pub fn lost(&self) -> &CancellationToken {
        &self.lost
    }

    /// Stops the keepalive for this lease and releases it.
    pub async fn release(mut self) -> Result<ReleaseOutcome> {
        self.released = true;
        self.shared.entries().remove(&self.key);
        self.shared.locker.release(&self.lease.id).await
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        // An error path, a panic or a dropped future: stop renewing now, release in the
        // background (if that fails too, the lease simply expires).
        self.shared.entries().remove(&self.key);
        let (locker, id) = (Arc::clone(&self.shared.locker), self.lease.id.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(err) = locker.release(&id).await {
                    tracing::warn!(error = %err, stream_id = %id.stream_id, "releasing a dropped lease failed; it will expire");
                }
            });
        }
    }
}
