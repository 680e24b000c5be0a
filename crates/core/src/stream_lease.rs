//! The stream-lease contract: one instance at a time may rewind, bootstrap or purge a
//! `(stream, perspective)` pair.
//!
//! A lease lives on the pair's perspective cursor row. [`StreamLocker`] is the hot path used by
//! the perspective worker (try-acquire, renew, release); [`StreamLockAdmin`] is for operators
//! (list, inspect, force-release, release everything an instance holds).
//!
//! Semantics every implementation shares (checked by the testkit's conformance suite):
//!
//! - **try-acquire** succeeds when the pair is unlocked, its lease has expired, or the same
//!   instance already holds it (refreshing the expiry and overwriting the reason; the lease then
//!   says [`StreamLease::reentered`], because the caller joined a lease it — or another task of
//!   the same instance — already held, and one release ends it for everyone). It is denied
//!   when another instance holds a live lease, and the denial says who, why and until when. A
//!   pair without a cursor row is never acquired. It never waits: a cursor row locked by
//!   another transaction is answered [`AcquireOutcome::Busy`] at once (an outcome like a
//!   denial, not an error).
//! - **Cancel safety**: dropping the future of any operation leaves no statement running and
//!   no lease behind (Postgres: a cancel request, and the connection is closed).
//! - **epoch** (the fencing token) increases whenever a lease is established anew: a new holder,
//!   or a takeover of an expired lease (even by the same instance). A same-instance re-acquire of
//!   a live lease keeps the epoch. Force-release also increases it.
//! - **renew** extends only a live lease held by the caller with the same epoch, and reports
//!   whether it did; it never resurrects an expired lease.
//! - **release** clears the lease only if held by the caller with the same epoch, and reports
//!   whether it did; releasing what one does not hold is not an error.
//! - Expiry is computed and compared on one clock, the backend's (the database clock for
//!   Postgres), never on the clients'.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use time::OffsetDateTime;

use crate::error::Result;
use crate::ids::{InstanceId, PerspectiveName, StreamId};
use crate::options::StreamLockOptions;
use crate::reason::LockReason;

/// The fencing token of a lease: increases every time the lease is established anew, so work
/// done under an older epoch can be refused at commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseEpoch(i64);

impl LeaseEpoch {
    /// Wraps a stored epoch.
    pub const fn new(value: i64) -> LeaseEpoch {
        LeaseEpoch(value)
    }

    /// The epoch as stored (`stream_lock_epoch bigint`).
    pub const fn get(self) -> i64 {
        self.0
    }
}

impl fmt::Display for LeaseEpoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// Names one held lease: the pair, the holder and the epoch it was acquired at. Renew and
/// release act only on a lease that still matches all four.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct LeaseId {
    /// The stream.
    pub stream_id: StreamId,
    /// The perspective.
    pub perspective: PerspectiveName,
    /// The instance that holds (or believes it holds) the lease.
    pub holder: InstanceId,
    /// The epoch the lease was acquired at.
    pub epoch: LeaseEpoch,
}

impl LeaseId {
    /// Names the lease on `(stream_id, perspective)` held by `holder` at `epoch`.
    pub fn new(
        stream_id: StreamId,
        perspective: PerspectiveName,
        holder: InstanceId,
        epoch: LeaseEpoch,
    ) -> LeaseId {
        LeaseId {
            stream_id,
            perspective,
            holder,
            epoch,
        }
    }
}

/// A lease the caller acquired.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamLease {
    /// Which lease (pass it to renew, release and fenced commits).
    pub id: LeaseId,
    /// Why it was taken.
    pub reason: LockReason,
    /// When it expires unless renewed, on the backend's clock.
    pub expires_at: OffsetDateTime,
    /// Whether the caller's instance already held this lease, live, when it asked: the call
    /// *joined* an existing lease (same epoch, refreshed expiry, overwritten reason) instead of
    /// establishing a new one. Two tasks sharing one [`InstanceId`] (e.g.
    /// [`InstanceId::process`]) share such a lease: the first release ends it for both. A task
    /// that needs the lease to itself treats `reentered == true` as busy and does not release it.
    pub reentered: bool,
    /// Whether this lease replaced an **expired** lease that was never released — its holder
    /// (another instance, or this one before a stall) crashed or stopped renewing: a
    /// *takeover*, which operators want to see. The backend knows it from the same statement;
    /// it travels here so that the observe layer can count it and the worker can log it.
    pub took_over: bool,
}

impl StreamLease {
    /// A lease `id` taken for `reason`, expiring at `expires_at` (backend clock), established
    /// anew ([`StreamLease::reentered`] is `false`; see [`StreamLease::with_reentered`]).
    pub fn new(id: LeaseId, reason: LockReason, expires_at: OffsetDateTime) -> StreamLease {
        StreamLease {
            id,
            reason,
            expires_at,
            reentered: false,
            took_over: false,
        }
    }

    /// The same lease, saying whether the caller's instance already held it
    /// ([`StreamLease::reentered`]).
    #[must_use]
    pub fn with_reentered(mut self, reentered: bool) -> Self {
        self.reentered = reentered;
        self
    }

    /// The same lease, saying whether it took over an expired one
    /// ([`StreamLease::took_over`]).
    #[must_use]
    pub fn with_took_over(mut self, took_over: bool) -> Self {
        self.took_over = took_over;
        self
    }
}

/// Who holds a lease the caller was denied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseHolder {
    /// The holding instance.
    pub instance: InstanceId,
    /// Why it holds the lease.
    pub reason: LockReason,
    /// When its lease expires unless renewed, on the backend's clock.
    pub expires_at: OffsetDateTime,
    /// The holder's epoch.
    pub epoch: LeaseEpoch,
}

/// The result of [`StreamLocker::try_acquire`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum AcquireOutcome {
    /// The caller holds the lease.
    Acquired(StreamLease),
    /// Another instance holds a live lease; skip the pair and retry later.
    Denied(LeaseHolder),
    /// The pair has no cursor row, so there is nothing to lease.
    NoCursor,
    /// The pair's cursor row is in use by another transaction right now (a claim applying
    /// events, a fenced commit, another lease statement in flight), so the lease could not be
    /// decided without waiting, and try-acquire never waits. Nothing was written. Handle it like
    /// a denial: skip the pair and retry later (the row is usually free again within one short
    /// transaction). Who holds the lease, if anyone, is unknown.
    Busy,
}

impl AcquireOutcome {
    /// Whether the lease was acquired (the design's `bool`: `false` for a denial, a busy row and
    /// a missing cursor row alike).
    pub fn is_acquired(&self) -> bool {
        matches!(self, AcquireOutcome::Acquired(_))
    }

    /// The acquired lease, if any.
    pub fn lease(&self) -> Option<&StreamLease> {
        match self {
            AcquireOutcome::Acquired(lease) => Some(lease),
            _ => None,
        }
    }

    /// The acquired lease, if any, by value.
    pub fn into_lease(self) -> Option<StreamLease> {
        match self {
            AcquireOutcome::Acquired(lease) => Some(lease),
            _ => None,
        }
    }
}

/// The result of [`StreamLocker::renew`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum RenewOutcome {
    /// The lease is extended until `expires_at` (backend clock).
    Renewed {
        /// The new expiry.
        expires_at: OffsetDateTime,
    },
    /// The lease is not held by this holder at this epoch, or has expired: the work it protects
    /// must stop.
    Lost,
}

impl RenewOutcome {
    /// Whether the lease was extended.
    pub fn is_renewed(&self) -> bool {
        matches!(self, RenewOutcome::Renewed { .. })
    }
}

/// The result of [`StreamLocker::release`] and [`StreamLockAdmin::force_release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum ReleaseOutcome {
    /// The lease was cleared.
    Released,
    /// There was nothing to clear for this holder and epoch (not an error).
    NotHeld,
}

impl ReleaseOutcome {
    /// Whether a lease was cleared.
    pub fn is_released(&self) -> bool {
        matches!(self, ReleaseOutcome::Released)
    }
}

/// The hot-path lease operations.
///
/// Object safe: the perspective worker holds an `Option<Arc<dyn StreamLocker>>`. Bad input is
/// rejected by the value types before a call can be made; implementations run one atomic
/// operation per call.
#[async_trait]
pub trait StreamLocker: Send + Sync {
    /// The timing this locker grants leases with.
    fn options(&self) -> StreamLockOptions;

    /// Tries to take the lease on `(stream_id, perspective)` for `instance`, without waiting.
    ///
    /// Never waits, not even for the cursor row: while another transaction holds the row's
    /// lock (a fenced commit, a claim applying events, another lease operation in flight) it
    /// answers [`AcquireOutcome::Busy`] at once, writing nothing — skip the pair and retry
    /// later, as after a denial. Errors are left for failures (a lost connection, a database
    /// without the schema, an unreadable row).
    async fn try_acquire(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        instance: InstanceId,
        reason: &LockReason,
    ) -> Result<AcquireOutcome>;

    /// Extends a live lease held by `lease.holder` at `lease.epoch` by the lock timeout.
    async fn renew(&self, lease: &LeaseId) -> Result<RenewOutcome>;

    /// Clears the lease if held by `lease.holder` at `lease.epoch`.
    async fn release(&self, lease: &LeaseId) -> Result<ReleaseOutcome>;

    /// Renews several leases; the outcomes are in the order of `leases`.
    ///
    /// The default renews one at a time; backends override it with a single statement.
    async fn renew_many(&self, leases: &[LeaseId]) -> Result<Vec<RenewOutcome>> {
        let mut outcomes = Vec::with_capacity(leases.len());
        for lease in leases {
            outcomes.push(self.renew(lease).await?);
        }
        Ok(outcomes)
    }
}

/// The lease columns of one cursor row, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CursorLease {
    /// Holder (`None` = unlocked).
    pub holder: Option<InstanceId>,
    /// Reason (`None` = unlocked).
    pub reason: Option<LockReason>,
    /// Expiry (`None` = unlocked).
    pub expires_at: Option<OffsetDateTime>,
    /// The current epoch (kept after release; only ever increases).
    pub epoch: LeaseEpoch,
}

impl Default for CursorLease {
    /// No lease: no holder, reason or expiry, at epoch 0 (a cursor row never leased).
    fn default() -> Self {
        CursorLease {
            holder: None,
            reason: None,
            expires_at: None,
            epoch: LeaseEpoch::new(0),
        }
    }
}

impl CursorLease {
    /// Whether no lease fields are set.
    pub fn is_unlocked(&self) -> bool {
        self.holder.is_none() && self.reason.is_none() && self.expires_at.is_none()
    }
}

/// Whether a listed lease is still live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseStatus {
    /// The lease has not expired.
    Held,
    /// The lease has expired but was not cleared; any instance may take it over.
    Expired,
}

/// One lease, as listed for operators.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseInfo {
    /// The stream.
    pub stream_id: StreamId,
    /// The perspective.
    pub perspective: PerspectiveName,
    /// The holder.
    pub holder: InstanceId,
    /// Why it is held.
    pub reason: LockReason,
    /// Its epoch.
    pub epoch: LeaseEpoch,
    /// Its expiry (backend clock).
    pub expires_at: OffsetDateTime,
    /// Time left before expiry, computed on the backend clock (zero once expired).
    pub time_left: Duration,
    /// Held or expired.
    pub status: LeaseStatus,
    /// When this lease was acquired (backend clock): the try-acquire that began its epoch.
    /// Renewals and a holder's re-entry keep it. `None` when the backend did not record it —
    /// on Postgres, a lease whose cursor row holds no readable start for the lease's epoch
    /// (what an operator's page shows as "not recorded" rather than a guess).
    pub acquired_at: Option<OffsetDateTime>,
}

impl LeaseInfo {
    /// The listing of `lease` (its stream, perspective, holder and epoch), held for `reason`
    /// until `expires_at` (backend clock), with `time_left` before then and its `status`.
    pub fn new(
        lease: LeaseId,
        reason: LockReason,
        expires_at: OffsetDateTime,
        time_left: Duration,
        status: LeaseStatus,
    ) -> LeaseInfo {
        let LeaseId {
            stream_id,
            perspective,
            holder,
            epoch,
        } = lease;
        LeaseInfo {
            stream_id,
            perspective,
            holder,
            reason,
            epoch,
            expires_at,
            time_left,
            status,
            acquired_at: None,
        }
    }

    /// The same listing, acquired at `at` (backend clock; `None`: not recorded).
    pub fn with_acquired_at(mut self, at: Option<OffsetDateTime>) -> LeaseInfo {
        self.acquired_at = at;
        self
    }
}

/// A cursor row with a lease set that cannot be read (a value written by hand outside
/// lockstep, e.g. an expiry of `'infinity'`), named by its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnreadableLease {
    /// The stream.
    pub stream_id: StreamId,
    /// The perspective name as stored (raw: it may itself be what cannot be read).
    pub perspective: String,
    /// What cannot be read, for people.
    pub problem: String,
}

/// One row of [`StreamLockAdmin::list_lease_entries`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseEntry {
    /// A lease, read.
    Lease(LeaseInfo),
    /// A row whose lease cannot be read.
    Unreadable(UnreadableLease),
}

/// Operator operations on stream leases, kept apart from the hot path.
#[async_trait]
pub trait StreamLockAdmin: Send + Sync {
    /// Every lease that is set (held or expired but not cleared), ordered by stream, then
    /// perspective. Fails if one of them cannot be read; an operator's view that must show the
    /// others wants [`StreamLockAdmin::list_lease_entries`].
    async fn list_leases(&self) -> Result<Vec<LeaseInfo>>;

    /// Like [`StreamLockAdmin::list_leases`], but a row whose lease cannot be read is an
    /// [`LeaseEntry::Unreadable`] entry, in its place and with its key, instead of failing the
    /// whole listing (it still fails when the listing itself cannot be read).
    ///
    /// The default lists [`StreamLockAdmin::list_leases`] as [`LeaseEntry::Lease`] entries: right
    /// for a backend that cannot hold an unreadable row (the in-memory fake cannot); the
    /// PostgreSQL locker overrides it, and wrappers forward it.
    async fn list_lease_entries(&self) -> Result<Vec<LeaseEntry>> {
        Ok(self
            .list_leases()
            .await?
            .into_iter()
            .map(LeaseEntry::Lease)
            .collect())
    }

    /// The lease columns of one cursor row; `None` if the row does not exist.
    async fn inspect(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<Option<CursorLease>>;

    /// Clears the lease whoever holds it and increases the epoch, so the old holder's renews,
    /// releases and fenced commits fail.
    async fn force_release(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<ReleaseOutcome>;

    /// Clears every lease `instance` holds (for shutdown); returns how many were cleared.
    async fn release_all_held_by(&self, instance: InstanceId) -> Result<u64>;
}

/// The fenced commit: work protected by a lease checks, inside its own transaction `Tx`, that the
/// lease is still held by the same holder at the same epoch, and fails with
/// [`crate::ErrorKind::LeaseLost`] otherwise (the transaction must then roll back).
///
/// Implementations also make the check stick until the transaction ends (on Postgres the check
/// locks the cursor row, so a takeover waits for this transaction), so a holder that stalled past
/// its expiry can never commit over the new holder's work.
pub trait LeaseFence<Tx: ?Sized + Sync>: Send + Sync {
    /// Checks that `lease` is still held, unexpired, at its epoch; binds the check to `tx`.
    fn check_lease<'a>(
        &'a self,
        tx: &'a Tx,
        lease: &'a LeaseId,
    ) -> impl std::future::Future<Output = Result<()>> + Send + 'a;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_is_not_acquired_and_has_no_lease() {
        let busy = AcquireOutcome::Busy;
        assert!(!busy.is_acquired());
        assert_eq!(busy.lease(), None);
        assert_eq!(busy.into_lease(), None);
    }

    // Compile-time check that the worker can keep these behind `dyn`.
    #[allow(dead_code)]
    fn object_safe(_: &dyn StreamLocker, _: &dyn StreamLockAdmin) {}
}
