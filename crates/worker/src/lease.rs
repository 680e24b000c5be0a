//! The lease lifecycle as a library piece: [`LeaseKeeper`] keeps an instance's stream leases
//! alive and [`HeldLease`] is one of them — the design's "acquire, start keepalive, work, stop
//! keepalive, release in `finally`", made safe by construction.
//!
//! - **One keepalive per instance**, not per lease: every `keepalive_interval` (at a fixed rate)
//!   the keeper renews all leases it holds with one [`StreamLocker::renew_many`] call (one
//!   statement on Postgres), bounded by the interval itself so a stuck call cannot delay the
//!   next renew.
//! - **Lost signal.** Each lease has a [`CancellationToken`] ([`HeldLease::lost`]). It fires when
//!   a renew reports the lease [`RenewOutcome::Lost`], or when the lease's **local monotonic
//!   deadline** passes without a confirmed renew. The deadline is `sent + lock_timeout −
//!   keepalive_interval`, where `sent` is when the last successful acquire or renew was *sent*:
//!   the backend computed the expiry no earlier than that, so the signal fires at least one
//!   keepalive interval before any other instance can take the lease over — whatever the clocks
//!   say, since only durations on this machine's monotonic clock are compared. The deadlines run
//!   on a timer of their own, while the keeper sleeps and while a renew is in flight, so a
//!   stalled renew cannot delay the signal (it fires at the deadline, give or take the timer's
//!   millisecond and the runtime's scheduling).
//! - **Lost is final.** A renew confirmed at or after a lease's deadline is too late: the signal
//!   has fired (or fires then) and the holder is stopping, so the keeper does not take the lease
//!   back — it never renews a lost lease again (nor one whose acquire returned after its
//!   deadline: that lease is lost on arrival). A late renew may have extended the row; the
//!   holder's [`HeldLease::release`] (or drop) still releases it, otherwise it expires.
//! - **Fenced commit.** [`HeldLease::id`] is what the protected work passes as the fence of its
//!   commit (`StateCommit::fence`, `LeaseFence::check_lease`): even a holder that stalled past
//!   its deadline cannot commit over a successor's work.
//! - **Release on every path.** [`HeldLease::release`] stops the keepalive for the lease and
//!   releases it; dropping a `HeldLease` without releasing (an error path, a panic, a cancelled
//!   future — a dropped `release` included) stops the keepalive at once and releases in a
//!   spawned task that [`LeaseKeeper::shutdown`] waits for.
//!
//! ```no_run
//! # async fn demo(locker: std::sync::Arc<dyn lockstep_core::StreamLocker>) -> lockstep_core::Result<()> {
//! use lockstep_core::{InstanceId, LockReason, PerspectiveName, StreamId};
//! use lockstep_worker::{LeaseKeeper, Leased};
//!
//! let keeper = LeaseKeeper::start(locker, InstanceId::process());
//! let (stream, name) = (StreamId::new_v7(), PerspectiveName::new("OrderPerspective")?);
//! match keeper.try_acquire(stream, &name, &LockReason::Rewind).await? {
//!     Leased::Acquired(lease) => {
//!         tokio::select! {
//!             () = lease.lost().cancelled() => { /* stop: commit nothing */ }
//!             () = async { /* rebuild, then commit fenced with lease.id() */ } => {}
//!         }
//!         lease.release().await?;
//!     }
//!     Leased::Denied(holder) => { /* another instance holds it: skip, retry later */ let _ = holder; }
//!     Leased::Busy => { /* another transaction is using the cursor row: skip, retry later */ }
//!     Leased::NoCursor => { /* nothing to lease */ }
//! }
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use lockstep_core::{
    AcquireOutcome, Error, ErrorKind, Fleet, InstanceAnnouncement, InstanceId, LeaseHolder,
    LeaseId, LockReason, PerspectiveName, ReleaseOutcome, RenewOutcome, Result, StreamId,
    StreamLease, StreamLocker,
};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::telemetry::{self, count};

/// One held lease as the keeper tracks it. Once `lost` has fired the entry stays until the
/// lease is released or dropped (so shutdown still releases it) but is never renewed again.
#[derive(Debug)]
struct Entry {
    id: LeaseId,
    lost: CancellationToken,
    deadline: Instant,
    /// A [`HeldLease::release`] is in flight: no longer renewed, but still tracked until its
    /// statement has run, so that shutdown (or the drop of that release) still releases it.
    releasing: bool,
}

impl Entry {
    fn kept(&self) -> bool {
        !self.lost.is_cancelled() && !self.releasing
    }
}

struct Shared {
    locker: Arc<dyn StreamLocker>,
    /// The same object as `locker`, as a fleet, when the keeper was started in one
    /// ([`LeaseKeeper::start_in_fleet`]): what it announces, keeps alive and departs through.
    fleet: Option<Arc<dyn Fleet>>,
    instance: InstanceId,
    entries: Mutex<HashMap<u64, Entry>>,
    next: std::sync::atomic::AtomicU64,
    /// Renews sent by the keeper (one per interval with leases held, more after a failed one);
    /// for tests and benchmarks.
    renew_calls: std::sync::atomic::AtomicU64,
    stop: CancellationToken,
    /// Woken when a lease is tracked: its deadline may be earlier than the one being waited for.
    tracked: Arc<Notify>,
    /// The background releases of dropped leases, so that shutdown can wait for them.
    releases: TaskTracker,
    /// Leases those background releases released (shutdown reports the ones it waited for).
    released_in_background: std::sync::atomic::AtomicU64,
    /// What the instance announced ([`LeaseKeeper::announce`]): from then on every keepalive
    /// also marks it seen, and shutdown departs.
    announced: Mutex<Option<InstanceAnnouncement>>,
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
    fn announced(&self) -> Option<InstanceAnnouncement> {
        self.announced
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn entries(&self) -> MutexGuard<'_, HashMap<u64, Entry>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The earliest deadline of a lease still kept alive.
    fn earliest_deadline(&self) -> Option<Instant> {
        self.entries()
            .values()
            .filter(|e| e.kept())
            .map(|e| e.deadline)
            .min()
    }

    /// Fires the lost signal of every kept lease whose deadline is `now` or earlier.
    fn expire(&self, now: Instant) {
        for entry in self.entries().values() {
            if now >= entry.deadline {
                lose(entry, "no renew was confirmed before the local deadline");
            }
        }
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
/// once per keepalive interval (a failed renew is tried again sooner). Cheap to clone; the
/// task stops when the last clone is dropped or [`LeaseKeeper::shutdown`] is called.
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
    /// Acquired, and kept alive until released or dropped.
    Acquired(HeldLease),
    /// Another instance holds a live lease.
    Denied(LeaseHolder),
    /// The pair's cursor row is in use by another transaction right now
    /// ([`AcquireOutcome::Busy`]): handle it like a denial, skip the pair and retry later.
    Busy,
    /// The pair has no cursor row.
    NoCursor,
}

impl LeaseKeeper {
    /// Starts the keepalive task for leases of `instance` taken through `locker` (on the
    /// current tokio runtime). The instance is not announced: see
    /// [`LeaseKeeper::start_in_fleet`].
    pub fn start(locker: Arc<dyn StreamLocker>, instance: InstanceId) -> LeaseKeeper {
        LeaseKeeper::started(locker, None, instance)
    }

    /// Starts the keepalive task for leases of `instance` taken through `fleet` (on the
    /// current tokio runtime), which can then announce the instance
    /// ([`LeaseKeeper::announce`]): a fleet is a stream locker whose keepalive also marks the
    /// instance seen.
    pub fn start_in_fleet(fleet: Arc<dyn Fleet>, instance: InstanceId) -> LeaseKeeper {
        let locker: Arc<dyn StreamLocker> = Arc::clone(&fleet) as Arc<dyn StreamLocker>;
        LeaseKeeper::started(locker, Some(fleet), instance)
    }

    fn started(
        locker: Arc<dyn StreamLocker>,
        fleet: Option<Arc<dyn Fleet>>,
        instance: InstanceId,
    ) -> LeaseKeeper {
        let stop = CancellationToken::new();
        let shared = Arc::new(Shared {
            locker,
            fleet,
            instance,
            entries: Mutex::default(),
            next: std::sync::atomic::AtomicU64::new(1),
            renew_calls: std::sync::atomic::AtomicU64::new(0),
            stop: stop.clone(),
            tracked: Arc::new(Notify::new()),
            releases: TaskTracker::new(),
            released_in_background: std::sync::atomic::AtomicU64::new(0),
            announced: Mutex::new(None),
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

    /// The same locker as a fleet, when the keeper was started in one
    /// ([`LeaseKeeper::start_in_fleet`]).
    pub fn fleet(&self) -> Option<&Arc<dyn Fleet>> {
        self.shared.fleet.as_ref()
    }

    /// Tries to take the pair's lease for this instance (see [`StreamLocker::try_acquire`]); a
    /// held lease is kept alive from now on.
    ///
    /// A lease this instance already holds live is *re-entered* (the design's idempotent
    /// re-acquire): both `HeldLease`s then name one lease, and the first release ends it for
    /// both. Inside one instance, serialize work on a pair (the worker's
    /// [`crate::ApplyCoordinator`]) instead of relying on that; the worker treats a re-entered
    /// lease as busy and leaves it to its holder ([`HeldLease::leave`]).
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
            AcquireOutcome::Acquired(lease) => Leased::Acquired(self.track(lease, sent)),
            AcquireOutcome::Denied(holder) => Leased::Denied(holder),
            AcquireOutcome::Busy => Leased::Busy,
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
        let entry = Entry {
            id: lease.id.clone(),
            lost: lost.clone(),
            deadline,
            releasing: false,
        };
        // An acquire that returned after its own deadline hands out a lease that is lost on
        // arrival: the holder must not start work another instance may soon take over.
        if Instant::now() >= deadline {
            lose(&entry, "the acquire was confirmed after the local deadline");
        }
        self.shared.entries().insert(key, entry);
        // The keepalive may be waiting for a later deadline than this one.
        self.shared.tracked.notify_one();
        HeldLease {
            lease,
            lost,
            key,
            shared: Arc::clone(&self.shared),
            released: false,
        }
    }

    /// How many leases are kept alive now (held, and not lost).
    pub fn held(&self) -> usize {
        self.shared.entries().values().filter(|e| e.kept()).count()
    }

    /// Announces the instance to the fleet ([`Fleet::announce`]; see
    /// [`lockstep_core::fleet`]): from now on each keepalive interval sends one
    /// [`Fleet::keepalive`] with the announcement's token (which renews the leases held, if
    /// any, and marks the instance seen) — even while no lease is held — and
    /// [`LeaseKeeper::shutdown`] departs. A keepalive that finds the announcement gone
    /// (removed by an operator, forgotten after a long partition) announces again.
    ///
    /// An announcement of another instance than the keeper's is
    /// [`ErrorKind::InvalidInput`]; a keeper started without a fleet ([`LeaseKeeper::start`])
    /// cannot announce: [`ErrorKind::Unsupported`], nothing sent. An instance id announced,
    /// live, by another process is [`ErrorKind::Conflict`] ([`lockstep_core::InstanceInUse`]),
    /// and the keeper stays unannounced.
    pub async fn announce(&self, announcement: InstanceAnnouncement) -> Result<()> {
        let Some(fleet) = &self.shared.fleet else {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "this lease keeper was started with a stream locker, not a fleet \
                 (LeaseKeeper::start_in_fleet), so it cannot announce the instance",
            ));
        };
        if announcement.instance != self.shared.instance {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "the announcement is of instance {}, the keeper keeps leases of {}",
                    announcement.instance, self.shared.instance
                ),
            ));
        }
        fleet.announce(&announcement).await?;
        *self
            .shared
            .announced
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(announcement);
        // The keepalive may be waiting with nothing to renew: it has something to do now.
        self.shared.tracked.notify_one();
        Ok(())
    }

    /// Whether the instance is announced (and not departed).
    pub fn is_announced(&self) -> bool {
        self.shared.announced().is_some()
    }

    /// How many keepalive calls (`renew_many`, or `keepalive` once announced) the keeper has
    /// sent so far.
    pub fn renew_calls(&self) -> u64 {
        self.shared
            .renew_calls
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops the keepalive and releases every lease it held (graceful shutdown), then departs
    /// from the fleet if the instance was announced ([`LeaseKeeper::announce`]), including
    /// leases whose [`HeldLease::release`] is in flight or was dropped; their lost signals fire.
    /// Then waits for the background releases of dropped leases, at most the lock timeout
    /// (after that their leases have expired anyway). Returns how many leases were released —
    /// by this call or by a background release it waited for. Every lease is tried; if a
    /// release failed, the first error is returned after all were tried (that lease expires).
    pub async fn shutdown(&self) -> Result<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        self.shared.stop.cancel();
        let background_before = self.shared.released_in_background.load(Relaxed);
        let entries: Vec<Entry> = self.shared.entries().drain().map(|(_, e)| e).collect();
        let mut released = 0;
        let mut first_error = None;
        // All of them within one lock timeout: by then a lease not released has expired.
        let until = Instant::now()
            .checked_add(self.shared.locker.options().lock_timeout())
            .unwrap_or_else(Instant::now);
        for entry in entries {
            entry.lost.cancel();
            // Every lease is tried, even after one failed: an error stops none of the others.
            let release = tokio::time::timeout_at(until, self.shared.locker.release(&entry.id));
            let outcome = release.await.unwrap_or_else(|_| Err(no_answer()));
            match outcome {
                Ok(ReleaseOutcome::Released) => released += 1,
                Ok(ReleaseOutcome::NotHeld) => {}
                Err(err) => {
                    tracing::warn!(error = %err, stream_id = %entry.id.stream_id, "releasing a lease on shutdown failed; it will expire");
                    first_error.get_or_insert(err);
                }
            }
        }
        self.shared.releases.close();
        let bound = self.shared.locker.options().lock_timeout();
        if tokio::time::timeout(bound, self.shared.releases.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                pending = self.shared.releases.len(),
                "background lease releases still running after the lock timeout; they will expire"
            );
        }
        released += self
            .shared
            .released_in_background
            .load(Relaxed)
            .saturating_sub(background_before);
        let announced = self
            .shared
            .announced
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let (Some(announced), Some(fleet)) = (announced, &self.shared.fleet) {
            // A failure leaves the announcement to go stale (the keepalive has stopped). The
            // token: an announcement another process took over is not this one's to remove.
            match fleet.depart(self.shared.instance, announced.token).await {
                Ok(_) => tracing::debug!(instance = %self.shared.instance, "instance departed"),
                Err(err) => {
                    tracing::warn!(error = %err, instance = %self.shared.instance, "departing from the fleet failed; the instance will show as stale");
                }
            }
        }
        match first_error {
            Some(err) => Err(err),
            None => Ok(released),
        }
    }
}

/// The keepalive loop: renew every lease kept alive once per interval, and fire the lost signal
/// of every lease that was refused or whose local deadline passed — the deadlines on a timer of
/// their own ([`watch_deadlines`]) while sleeping and while a renew is in flight. A renew that
/// fails (an error, not a stall) is tried again soon ([`RENEW_RETRY_DIVISOR`]), until one is
/// confirmed or the deadline passes, so that a lease survives a failed renew: without the
/// retry, the next renew came an interval later, at or after the deadline at the default 3:1
/// ratio (`keepalive_interval < lock_timeout / 2` leaves more than one interval of slack).
async fn keepalive(shared: Weak<Shared>, stop: CancellationToken) {
    let Some(tracked) = shared.upgrade().map(|s| Arc::clone(&s.tracked)) else {
        return;
    };
    let mut due = Instant::now();
    // When the last renew failed: when to try again, sooner than the next interval.
    let mut retry: Option<Instant> = None;
    loop {
        let interval = match shared.upgrade() {
            Some(s) => s.locker.options().keepalive_interval(),
            None => return,
        };
        // At a fixed rate: one interval after the last renew was *due*, not after it returned,
        // so a slow renew does not eat into the slack of the next (a renew confirmed after its
        // lease's deadline no longer counts). The renew is bounded by the interval, so it has
        // ended by then; if it is late anyway (a busy runtime), the next renew goes now, once.
        // After a failed renew, the retry's time; the fixed rate goes on from it.
        let next = match retry.take() {
            Some(at) => Some(at.max(Instant::now())),
            None => due.checked_add(interval).map(|at| at.max(Instant::now())),
        };
        let sleep = async {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                // Unrepresentable: no renew ever comes due; the deadlines still fire.
                None => std::future::pending().await,
            }
        };
        if watch_deadlines(&shared, &stop, &tracked, sleep)
            .await
            .is_none()
        {
            return;
        }
        due = next.unwrap_or(due);
        let Some(shared) = shared.upgrade() else {
            return;
        };
        // The sleep may have ended with a deadline: such a lease is not renewed.
        shared.expire(Instant::now());
        let held: Vec<(u64, LeaseId)> = shared
            .entries()
            .iter()
            .filter(|(_, e)| e.kept())
            .map(|(k, e)| (*k, e.id.clone()))
            .collect();
        // An announced instance says it is alive every interval, with or without leases.
        let announced = shared
            .announced()
            .and_then(|a| Some((a, Arc::clone(shared.fleet.as_ref()?))));
        if held.is_empty() && announced.is_none() {
            continue;
        }
        let ids: Vec<LeaseId> = held.iter().map(|(_, id)| id.clone()).collect();
        let sent = Instant::now();
        shared
            .renew_calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // One call either way: the renew alone, or (announced) the renew that also marks the
        // instance seen.
        let call = async {
            match &announced {
                Some((announcement, fleet)) => fleet
                    .keepalive(shared.instance, announcement.token, &ids)
                    .await
                    .map(|k| (k.renewed, Some(k.seen))),
                None => shared.locker.renew_many(&ids).await.map(|r| (r, None)),
            }
        };
        // Bounded by the interval so a stuck renew cannot delay the next one; the deadlines
        // are watched meanwhile.
        let renew = tokio::time::timeout(interval, call);
        let weak = Arc::downgrade(&shared);
        let Some(outcome) = watch_deadlines(&weak, &stop, &tracked, renew).await else {
            return;
        };
        let (outcome, seen) = match outcome {
            Ok(Ok((renewed, seen))) => (Ok(Ok(renewed)), seen),
            Ok(Err(err)) => (Ok(Err(err)), None),
            Err(elapsed) => (Err(elapsed), None),
        };
        // A renew confirmed at or after a deadline is too late for that lease: fire first, so
        // the outcomes below never extend a lease whose signal is due.
        shared.expire(Instant::now());
        match outcome {
            Ok(Ok(outcomes)) => {
                let mut entries = shared.entries();
                for ((key, _), renewed) in held.iter().zip(outcomes) {
                    let Some(entry) = entries.get_mut(key) else {
                        continue; // released meanwhile
                    };
                    if !entry.kept() {
                        continue; // lost meanwhile: lost is final
                    }
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
                tracing::warn!(error = %err, leases = ids.len(), "keepalive renew failed; trying again soon");
                let now = Instant::now();
                // A quarter interval, or half the time left to the earliest deadline if that is
                // sooner (options close to `keepalive < timeout / 2` leave little slack).
                let soon = interval / RENEW_RETRY_DIVISOR;
                let pause = shared
                    .earliest_deadline()
                    .map_or(soon, |d| soon.min(d.saturating_duration_since(now) / 2))
                    .max(MIN_RENEW_RETRY);
                retry = now.checked_add(pause);
            }
            Err(_) => {
                tracing::warn!(leases = ids.len(), "keepalive renew timed out");
            }
        }
        // The announcement is gone (an operator removed it, or it was forgotten after a long
        // partition): announce again, bounded like the renew.
        if let (Some(false), Some((announcement, fleet))) = (seen, announced) {
            let again = tokio::time::timeout(interval, fleet.announce(&announcement));
            match watch_deadlines(&weak, &stop, &tracked, again).await {
                None => return,
                Some(Ok(Ok(()))) => {
                    tracing::info!(instance = %shared.instance, "the instance's announcement was gone; announced again");
                }
                Some(Ok(Err(err))) if lockstep_core::instance_in_use(&err).is_some() => {
                    // Another process took the id over while this one was not seen: both now
                    // run as one instance.
                    tracing::error!(error = %err, "announcing the instance again was refused: another process runs this instance id");
                }
                Some(Ok(Err(err))) => {
                    tracing::warn!(error = %err, "announcing the instance again failed");
                }
                Some(Err(_)) => tracing::warn!("announcing the instance again timed out"),
            }
        }
    }
}

/// A release, bounded by the lease's lock timeout: a release that has not answered by then
/// (a row lock held by someone else, a connection gone silent) is abandoned — the lease has
/// expired by then anyway — so that no caller, nor a worker's cycle, waits on it for ever.
async fn bounded_release(locker: &dyn StreamLocker, id: &LeaseId) -> Result<ReleaseOutcome> {
    let bound = locker.options().lock_timeout();
    tokio::time::timeout(bound, locker.release(id))
        .await
        .unwrap_or_else(|_| Err(no_answer()))
}

/// The error of a release that got no answer within the lock timeout.
fn no_answer() -> Error {
    Error::new(
        ErrorKind::ConnectionLost,
        "the release got no answer within the lock timeout; the lease expires on its own",
    )
}

/// A failed renew is tried again after this fraction of the keepalive interval (a quarter), or
/// after half the time left to the earliest deadline if that is sooner: a few tries in the
/// slack the deadline leaves, without hammering a database that is failing.
const RENEW_RETRY_DIVISOR: u32 = 4;

/// The shortest pause before a failed renew is tried again.
const MIN_RENEW_RETRY: Duration = Duration::from_millis(1);

/// Runs `work` to its end while firing the lost signal of every kept lease whose deadline
/// passes meanwhile. `None` when the keeper stops (or is gone) first.
async fn watch_deadlines<F: Future>(
    shared: &Weak<Shared>,
    stop: &CancellationToken,
    tracked: &Notify,
    work: F,
) -> Option<F::Output> {
    let mut work = std::pin::pin!(work);
    loop {
        // Upgraded only for the look-up: while sleeping the keeper holds no strong reference.
        let earliest = shared.upgrade()?.earliest_deadline();
        let timer = async {
            match earliest {
                Some(deadline) => {
                    tokio::time::sleep_until(deadline).await;
                    deadline
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = stop.cancelled() => return None,
            output = &mut work => return Some(output),
            // At least the deadline waited for, so a timer that woke a hair early cannot spin.
            deadline = timer => shared.upgrade()?.expire(Instant::now().max(deadline)),
            // A lease tracked since the look-up (a permit is kept if it came before the wait).
            () = tracked.notified() => {}
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
    /// deadline): stop the protected work and commit nothing. Final: the keeper never renews
    /// the lease again, so release it (or drop it).
    pub fn lost(&self) -> &CancellationToken {
        &self.lost
    }

    /// Stops renewing the lease because the protected work's own commit is about to release it
    /// ([`lockstep_core::PairWork::commit`] with [`lockstep_core::Release::Lease`]): from now on it is
    /// handled like a lease whose [`HeldLease::release`] is in flight. Follow with
    /// [`HeldLease::released_by_commit`] once that commit has committed and released it, else
    /// with [`HeldLease::release`] (or a drop).
    pub fn stop_renewing(&self) {
        if let Some(entry) = self.shared.entries().get_mut(&self.key) {
            entry.releasing = true;
        }
    }

    /// Leaves a lease this instance joined rather than took ([`StreamLease::reentered`]:
    /// another task of the instance holds it — another worker sharing the instance id, an
    /// application's rebuild): stops tracking it here and releases nothing, so that its
    /// holder keeps it. The worker does this with every re-entered lease: a pair whose lease
    /// another task of the instance holds is busy.
    pub fn leave(self) {
        self.forget();
    }

    /// The protected work's commit released the lease and has committed: forget it, sending
    /// nothing.
    pub fn released_by_commit(self) {
        self.forget();
    }

    /// Stops tracking the lease and sends nothing (someone else ends it, or already has).
    fn forget(mut self) {
        self.released = true;
        self.shared.entries().remove(&self.key);
    }

    /// Stops the keepalive for this lease and releases it.
    ///
    /// Cancel-safe: if this future is dropped before the release statement has run to its end
    /// (a timeout around it, an abandoned task), the lease is released in the background as
    /// when a `HeldLease` is dropped, and [`LeaseKeeper::shutdown`] still releases it. If the
    /// release fails, it is tried once more in the background; if that fails too, the lease
    /// expires after the lock timeout.
    ///
    /// Bounded: a release that has not answered within the lock timeout (a row lock held by
    /// another transaction, a connection gone silent) is abandoned with a retryable
    /// [`ErrorKind::ConnectionLost`] — by then the lease has expired anyway — and so is the
    /// background retry. [`LeaseKeeper::shutdown`] releases every lease within one lock
    /// timeout in all.
    pub async fn release(mut self) -> Result<ReleaseOutcome> {
        // Not renewed any more, but still tracked until the statement has run.
        if let Some(entry) = self.shared.entries().get_mut(&self.key) {
            entry.releasing = true;
        }
        let outcome = bounded_release(&*self.shared.locker, &self.lease.id).await;
        if outcome.is_ok() {
            self.released = true;
            self.shared.entries().remove(&self.key);
        }
        // On an error `self` drops unreleased: the background release tries again.
        outcome
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        // An error path, a panic, a dropped future (also a dropped `release`): stop renewing
        // now, release in the background, tracked so that shutdown waits for it (if that fails
        // too, the lease simply expires).
        self.shared.entries().remove(&self.key);
        let (locker, id) = (Arc::clone(&self.shared.locker), self.lease.id.clone());
        let shared = Arc::downgrade(&self.shared);
        let task = async move {
            match bounded_release(&*locker, &id).await {
                Ok(ReleaseOutcome::Released) => {
                    if let Some(shared) = shared.upgrade() {
                        shared
                            .released_in_background
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                Ok(ReleaseOutcome::NotHeld) => {}
                Err(err) => {
                    tracing::warn!(error = %err, stream_id = %id.stream_id, "releasing a dropped lease failed; it will expire");
                }
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                self.shared.releases.spawn_on(task, &runtime);
            }
            Err(_) => {
                tracing::warn!(stream_id = %self.lease.id.stream_id, "a lease dropped outside a tokio runtime cannot be released; it will expire");
            }
        }
    }
}
