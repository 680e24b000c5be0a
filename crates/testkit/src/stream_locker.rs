//! [`InMemoryStreamLocker`]: stream leases in memory, on tokio's clock, with exactly the
//! semantics of the Postgres locker (it passes the same conformance suite).
//!
//! Built [`with_database`](InMemoryStreamLocker::with_database), it also implements
//! [`LeaseFence`] over [`FakeTransaction`]s of that database, like Postgres: a fence check that
//! finds the lease held locks the cursor row until the transaction ends; renew, release and the
//! admin operations on that row wait for it, and try-acquire answers [`AcquireOutcome::Busy`] at
//! once (a takeover cannot slip in between a fenced check and its commit).
//! A check that finds the lease lost locks nothing, as the Postgres `SELECT … FOR NO KEY UPDATE`
//! locks no row its `WHERE` rejects.
//!
//! Tests expire leases with paused time instead of sleeping:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() -> lockstep_core::Result<()> {
//! use lockstep_core::*;
//! use lockstep_testkit::InMemoryStreamLocker;
//!
//! let locker = InMemoryStreamLocker::new(StreamLockOptions::default());
//! let (stream, name) = (StreamId::new_v7(), PerspectiveName::new("Orders")?);
//! locker.create_cursor(stream, &name);
//! let (a, b) = (InstanceId::random(), InstanceId::random());
//! assert!(locker.try_acquire(stream, &name, a, &LockReason::Rewind).await?.is_acquired());
//! assert!(!locker.try_acquire(stream, &name, b, &LockReason::Rewind).await?.is_acquired());
//! tokio::time::advance(StreamLockOptions::DEFAULT_LOCK_TIMEOUT).await;
//! assert!(locker.try_acquire(stream, &name, b, &LockReason::Rewind).await?.is_acquired());
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use lockstep_core::{
    AcquireOutcome, CursorLease, Error, ErrorKind, Fleet, FleetAdmin, InstanceAnnouncement,
    InstanceId, InstanceState, KeepaliveOutcome, LeaseEpoch, LeaseFence, LeaseHolder, LeaseId,
    LeaseInfo, LeaseStatus, LockReason, PerspectiveName, ReleaseOutcome, RenewOutcome, ResourceKey,
    Result, StreamId, StreamLease, StreamLockAdmin, StreamLockOptions, StreamLocker, Uuid,
    WorkerInstance, async_trait,
};
use time::OffsetDateTime;
use tokio::time::Instant;

use crate::fake_lock::{FakeDatabase, FakeTransaction, LockOwner};

/// One cursor row's lease columns: the three seed columns are set or cleared together.
#[derive(Debug, Clone, Default)]
struct Row {
    lease: Option<Held>,
    epoch: i64,
}

#[derive(Debug, Clone)]
struct Held {
    holder: InstanceId,
    reason: LockReason,
    expires: Instant,
    /// When the try-acquire that began this epoch ran (kept by renewals and re-entry).
    acquired: Instant,
}

impl Row {
    /// The lease, if set and not expired at `now`.
    fn live(&self, now: Instant) -> Option<&Held> {
        self.lease.as_ref().filter(|l| l.expires > now)
    }

    fn held_by(&self, lease: &LeaseId) -> bool {
        self.epoch == lease.epoch.get()
            && self
                .lease
                .as_ref()
                .is_some_and(|l| l.holder == lease.holder)
    }
}

type Key = (StreamId, PerspectiveName);

/// The clock of the fake: tokio's (pausable) monotonic clock, shown as wall-clock times
/// anchored at construction.
#[derive(Debug, Clone, Copy)]
struct Clock {
    origin: Instant,
    origin_wall: OffsetDateTime,
}

impl Clock {
    fn wall(&self, at: Instant) -> OffsetDateTime {
        self.origin_wall + at.saturating_duration_since(self.origin)
    }
}

/// One announced instance of the fleet, as the fake keeps it.
#[derive(Debug, Clone)]
struct Announced {
    announcement: InstanceAnnouncement,
    started: Instant,
    seen: Instant,
    stale_after: std::time::Duration,
}

/// In-memory stream leases (and the fleet of instances announced through them). Clones share
/// state, like lockers on one database.
#[derive(Debug, Clone)]
pub struct InMemoryStreamLocker {
    rows: Arc<Mutex<BTreeMap<Key, Row>>>,
    instances: Arc<Mutex<BTreeMap<InstanceId, Announced>>>,
    options: StreamLockOptions,
    clock: Clock,
    // Where cursor-row locks live, when fenced commits are used.
    db: Option<FakeDatabase>,
}

impl InMemoryStreamLocker {
    /// An empty store (no cursor rows) granting leases with `options`.
    pub fn new(options: StreamLockOptions) -> InMemoryStreamLocker {
        InMemoryStreamLocker {
            rows: Arc::default(),
            instances: Arc::default(),
            options,
            clock: Clock {
                origin: Instant::now(),
                origin_wall: OffsetDateTime::now_utc(),
            },
            db: None,
        }
    }

    /// Like [`new`](InMemoryStreamLocker::new), and fenced commits ([`LeaseFence`]) work on
    /// transactions of `db`.
    pub fn with_database(options: StreamLockOptions, db: &FakeDatabase) -> InMemoryStreamLocker {
        InMemoryStreamLocker {
            db: Some(db.clone()),
            ..InMemoryStreamLocker::new(options)
        }
    }

    /// The database fenced commits run on, if built
    /// [`with_database`](InMemoryStreamLocker::with_database).
    pub fn database(&self) -> Option<&FakeDatabase> {
        self.db.as_ref()
    }

    /// The key of a cursor row's lock in the fake database.
    fn row_key(stream_id: StreamId, perspective: &PerspectiveName) -> ResourceKey {
        // Bounded: a UUID and a perspective name of at most 200 characters.
        ResourceKey::new(format!("lockstep:cursor-row:{stream_id}:{perspective}"))
            .unwrap_or_else(|e| unreachable!("cursor row key is valid: {e}"))
    }

    /// Waits while a fenced transaction holds the row, as an `UPDATE` waits for a row lock.
    async fn wait_for_row(&self, stream_id: StreamId, perspective: &PerspectiveName) -> Result<()> {
        if let Some(db) = &self.db {
            let key = Self::row_key(stream_id, perspective);
            let owner = LockOwner::Session(db.next_id());
            db.acquire(&key, owner).await?;
            db.release_one(&key, owner);
        }
        Ok(())
    }

    /// Whether a fenced transaction holds the row's lock now: try-acquire then answers busy at
    /// once, like Postgres's `FOR NO KEY UPDATE NOWAIT` (try-acquire never waits).
    fn row_locked(&self, stream_id: StreamId, perspective: &PerspectiveName) -> bool {
        self.db.as_ref().is_some_and(|db| {
            db.holder_of(&Self::row_key(stream_id, perspective))
                .is_some()
        })
    }

    /// Creates the cursor row of a pair (unlocked); does nothing if it exists.
    pub fn create_cursor(&self, stream_id: StreamId, perspective: &PerspectiveName) {
        self.rows()
            .entry((stream_id, perspective.clone()))
            .or_default();
    }

    /// Deletes the cursor row of a pair (and with it any lease).
    pub fn delete_cursor(&self, stream_id: StreamId, perspective: &PerspectiveName) {
        self.rows().remove(&(stream_id, perspective.clone()));
    }

    fn rows(&self) -> MutexGuard<'_, BTreeMap<Key, Row>> {
        // Every update below completes before the guard drops, so a poisoned map is consistent.
        self.rows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn instances(&self) -> MutexGuard<'_, BTreeMap<InstanceId, Announced>> {
        // As for the rows: every update completes before the guard drops.
        self.instances
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Clears `lease` if its holder still holds it at its epoch, expired or not (a fenced
    /// commit that releases its lease, as it commits): whether it did. Synchronous, for a
    /// transaction's end hook.
    pub(crate) fn release_at_commit(&self, lease: &LeaseId) -> bool {
        let mut rows = self.rows();
        match rows.get_mut(&(lease.stream_id, lease.perspective.clone())) {
            Some(row) if row.held_by(lease) => {
                row.lease = None;
                true
            }
            _ => false,
        }
    }

    /// How many live announced instances run `perspective` (live as
    /// [`FleetAdmin::list_instances`] says: seen within their lock timeout).
    pub(crate) fn live_instances_running(&self, perspective: &PerspectiveName) -> u64 {
        let now = Instant::now();
        self.instances()
            .values()
            .filter(|i| {
                now.saturating_duration_since(i.seen) < i.stale_after
                    && i.announcement.perspectives.contains(perspective)
            })
            .count() as u64
    }

    fn expiry_from(&self, now: Instant) -> Instant {
        now + self.options.lock_timeout()
    }
}

#[async_trait]
impl StreamLocker for InMemoryStreamLocker {
    fn options(&self) -> StreamLockOptions {
        self.options
    }

    async fn try_acquire(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        instance: InstanceId,
        reason: &LockReason,
    ) -> Result<AcquireOutcome> {
        if self.row_locked(stream_id, perspective) {
            return Ok(AcquireOutcome::Busy);
        }
        let now = Instant::now();
        let expires = self.expiry_from(now);
        let mut rows = self.rows();
        let Some(row) = rows.get_mut(&(stream_id, perspective.clone())) else {
            return Ok(AcquireOutcome::NoCursor);
        };
        // An expired lease still on the row (never released): this acquire takes it over.
        let took_over = row.lease.is_some() && row.live(now).is_none();
        let reentered = match row.live(now) {
            Some(held) if held.holder != instance => {
                return Ok(AcquireOutcome::Denied(LeaseHolder {
                    instance: held.holder,
                    reason: held.reason.clone(),
                    expires_at: self.clock.wall(held.expires),
                    epoch: LeaseEpoch::new(row.epoch),
                }));
            }
            // Same instance, live: idempotent re-acquire keeps the epoch.
            Some(_) => true,
            // Unlocked or expired: a new lease, a new epoch.
            None => {
                row.epoch += 1;
                false
            }
        };
        let acquired = match (&row.lease, reentered) {
            (Some(held), true) => held.acquired,
            _ => now,
        };
        row.lease = Some(Held {
            holder: instance,
            reason: reason.clone(),
            expires,
            acquired,
        });
        Ok(AcquireOutcome::Acquired(
            StreamLease::new(
                LeaseId::new(
                    stream_id,
                    perspective.clone(),
                    instance,
                    LeaseEpoch::new(row.epoch),
                ),
                reason.clone(),
                self.clock.wall(expires),
            )
            .with_reentered(reentered)
            .with_took_over(took_over),
        ))
    }

    async fn renew(&self, lease: &LeaseId) -> Result<RenewOutcome> {
        self.wait_for_row(lease.stream_id, &lease.perspective)
            .await?;
        let now = Instant::now();
        let mut rows = self.rows();
        let Some(row) = rows.get_mut(&(lease.stream_id, lease.perspective.clone())) else {
            return Ok(RenewOutcome::Lost);
        };
        if !row.held_by(lease) || row.live(now).is_none() {
            return Ok(RenewOutcome::Lost);
        }
        let expires = self.expiry_from(now);
        if let Some(held) = row.lease.as_mut() {
            held.expires = expires;
        }
        Ok(RenewOutcome::Renewed {
            expires_at: self.clock.wall(expires),
        })
    }

    async fn release(&self, lease: &LeaseId) -> Result<ReleaseOutcome> {
        self.wait_for_row(lease.stream_id, &lease.perspective)
            .await?;
        let mut rows = self.rows();
        match rows.get_mut(&(lease.stream_id, lease.perspective.clone())) {
            Some(row) if row.held_by(lease) => {
                row.lease = None;
                Ok(ReleaseOutcome::Released)
            }
            _ => Ok(ReleaseOutcome::NotHeld),
        }
    }
}

/// `list_lease_entries` is the default (every entry a lease): the fake's rows hold typed values,
/// so it cannot have the unreadable row a hand-edited PostgreSQL row can.
#[async_trait]
impl StreamLockAdmin for InMemoryStreamLocker {
    async fn list_leases(&self) -> Result<Vec<LeaseInfo>> {
        let now = Instant::now();
        let rows = self.rows();
        Ok(rows
            .iter()
            .filter_map(|((stream_id, perspective), row)| {
                let held = row.lease.as_ref()?;
                Some(
                    LeaseInfo::new(
                        LeaseId::new(
                            *stream_id,
                            perspective.clone(),
                            held.holder,
                            LeaseEpoch::new(row.epoch),
                        ),
                        held.reason.clone(),
                        self.clock.wall(held.expires),
                        held.expires.saturating_duration_since(now),
                        if held.expires > now {
                            LeaseStatus::Held
                        } else {
                            LeaseStatus::Expired
                        },
                    )
                    .with_acquired_at(Some(self.clock.wall(held.acquired))),
                )
            })
            .collect())
    }

    async fn inspect(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<Option<CursorLease>> {
        let rows = self.rows();
        Ok(rows
            .get(&(stream_id, perspective.clone()))
            .map(|row| CursorLease {
                holder: row.lease.as_ref().map(|l| l.holder),
                reason: row.lease.as_ref().map(|l| l.reason.clone()),
                expires_at: row.lease.as_ref().map(|l| self.clock.wall(l.expires)),
                epoch: LeaseEpoch::new(row.epoch),
            }))
    }

    async fn force_release(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<ReleaseOutcome> {
        self.wait_for_row(stream_id, perspective).await?;
        let mut rows = self.rows();
        match rows.get_mut(&(stream_id, perspective.clone())) {
            Some(row) if row.lease.is_some() => {
                row.lease = None;
                row.epoch += 1;
                Ok(ReleaseOutcome::Released)
            }
            _ => Ok(ReleaseOutcome::NotHeld),
        }
    }

    async fn release_all_held_by(&self, instance: InstanceId) -> Result<u64> {
        let held: Vec<Key> = self
            .rows()
            .iter()
            .filter(|(_, row)| row.lease.as_ref().is_some_and(|l| l.holder == instance))
            .map(|(key, _)| key.clone())
            .collect();
        for (stream_id, perspective) in &held {
            self.wait_for_row(*stream_id, perspective).await?;
        }
        let mut rows = self.rows();
        let mut released = 0;
        for row in rows.values_mut() {
            if row.lease.as_ref().is_some_and(|l| l.holder == instance) {
                row.lease = None;
                released += 1;
            }
        }
        Ok(released)
    }
}

/// The fleet as the PostgreSQL locker keeps it, on the same clock as the leases.
#[async_trait]
impl Fleet for InMemoryStreamLocker {
    async fn announce(&self, announcement: &InstanceAnnouncement) -> Result<()> {
        let now = Instant::now();
        let mut instances = self.instances();
        instances.retain(|id, i| {
            *id == announcement.instance
                || now.saturating_duration_since(i.seen) <= lockstep_core::FORGET_STALE_AFTER
        });
        // An id names one process: another process's live announcement is not replaced; its
        // stale one is taken over as a new start.
        let started = match instances.get(&announcement.instance) {
            None => now,
            Some(i) if i.announcement.token == announcement.token => i.started,
            Some(i) => {
                let since_seen = now.saturating_duration_since(i.seen);
                // As listed: live while `last_seen_at + stale_after > now`.
                if since_seen < i.stale_after {
                    let other = &i.announcement;
                    return Err(lockstep_core::InstanceInUse::new(
                        other.instance,
                        other.name.clone(),
                        other.host.clone(),
                        other.pid,
                        since_seen,
                        i.stale_after,
                    )
                    .into_error());
                }
                now
            }
        };
        instances.insert(
            announcement.instance,
            Announced {
                announcement: announcement.clone(),
                started,
                seen: now,
                stale_after: self.options.lock_timeout(),
            },
        );
        Ok(())
    }

    async fn keepalive(
        &self,
        instance: InstanceId,
        token: Uuid,
        leases: &[LeaseId],
    ) -> Result<KeepaliveOutcome> {
        let renewed = self.renew_many(leases).await?;
        let now = Instant::now();
        // Only this process's announcement: a process whose id was taken over by another
        // (another token) leaves the new owner's row as it is.
        let seen = match self.instances().get_mut(&instance) {
            Some(announced) if announced.announcement.token == token => {
                announced.seen = now;
                true
            }
            _ => false,
        };
        Ok(KeepaliveOutcome::new(renewed, seen))
    }

    async fn depart(&self, instance: InstanceId, token: Uuid) -> Result<bool> {
        let mut instances = self.instances();
        match instances.get(&instance) {
            Some(announced) if announced.announcement.token == token => {
                instances.remove(&instance);
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

/// `list_instance_entries` is the default (every entry an instance): the fake holds typed values.
#[async_trait]
impl FleetAdmin for InMemoryStreamLocker {
    async fn list_instances(&self) -> Result<Vec<WorkerInstance>> {
        let now = Instant::now();
        let mut listed: Vec<WorkerInstance> = self
            .instances()
            .values()
            .map(|i| {
                let since_seen = now.saturating_duration_since(i.seen);
                WorkerInstance::new(
                    i.announcement.clone(),
                    self.clock.wall(i.started),
                    self.clock.wall(i.seen),
                    i.stale_after,
                    since_seen,
                    // As on Postgres: live while `last_seen_at + stale_after > now`.
                    if since_seen < i.stale_after {
                        InstanceState::Live
                    } else {
                        InstanceState::Stale
                    },
                )
            })
            .collect();
        listed.sort_by(|a, b| {
            (a.announcement.name.as_bytes(), a.announcement.instance)
                .cmp(&(b.announcement.name.as_bytes(), b.announcement.instance))
        });
        Ok(listed)
    }
}

impl LeaseFence<FakeTransaction> for InMemoryStreamLocker {
    async fn check_lease(&self, tx: &FakeTransaction, lease: &LeaseId) -> Result<()> {
        let Some(db) = self.db.as_ref().filter(|db| db.same(tx.database())) else {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "fenced commits need InMemoryStreamLocker::with_database on the transaction's database",
            ));
        };
        tx.check_usable()?;
        // As the `SELECT … WHERE <lease held> FOR NO KEY UPDATE` on Postgres: a row that does
        // not match is neither waited for nor locked, so a lost lease locks nothing (and does
        // not abort the transaction: the statement found no row). A matching row is locked for
        // the rest of the transaction, waiting if another transaction holds it; a wait that
        // fails (deadlock) or is abandoned aborts the transaction. After a wait the condition is
        // checked again on the row as it is now (Postgres's recheck), and a row that no longer
        // matches stays locked, as it does on Postgres.
        if !self.lease_is_live(lease) {
            return Err(Self::lease_lost(lease));
        }
        let row = Self::row_key(lease.stream_id, &lease.perspective);
        tx.statement(db.acquire(&row, tx.owner())).await?;
        if self.lease_is_live(lease) {
            Ok(())
        } else {
            Err(Self::lease_lost(lease))
        }
    }
}

impl InMemoryStreamLocker {
    /// Whether `lease` is held, at its epoch, and live now (the fence's `WHERE`).
    fn lease_is_live(&self, lease: &LeaseId) -> bool {
        let now = Instant::now();
        self.rows()
            .get(&(lease.stream_id, lease.perspective.clone()))
            .is_some_and(|row| row.held_by(lease) && row.live(now).is_some())
    }

    fn lease_lost(lease: &LeaseId) -> Error {
        Error::new(
            ErrorKind::LeaseLost,
            format!(
                "lease on ({}, {}) is no longer held by {} at epoch {}",
                lease.stream_id, lease.perspective, lease.holder, lease.epoch
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    // Issue 8, defect 1: the fake panicked on a lock timeout of 9000 years. The options now
    // refuse it, and the longest accepted one works end to end without a panic.
    #[tokio::test(start_paused = true)]
    async fn the_longest_accepted_lock_timeout_works_and_longer_ones_are_refused() {
        const YEAR: Duration = Duration::from_secs(365 * 24 * 60 * 60);
        let refused = StreamLockOptions::new(YEAR * 9000, YEAR).expect_err("refused");
        assert_eq!(refused.kind(), ErrorKind::InvalidInput);
        let options =
            StreamLockOptions::new(StreamLockOptions::MAX_LOCK_TIMEOUT, Duration::from_secs(60))
                .expect("100 years is accepted");
        let locker = InMemoryStreamLocker::new(options);
        let (stream, name) = (
            StreamId::new_v7(),
            PerspectiveName::new("Orders").expect("valid"),
        );
        locker.create_cursor(stream, &name);
        let me = InstanceId::random();
        let lease = locker
            .try_acquire(stream, &name, me, &LockReason::Rewind)
            .await
            .expect("try_acquire")
            .into_lease()
            .expect("acquired");
        assert!(lease.expires_at.year() >= 2100);
        assert!(locker.renew(&lease.id).await.expect("renew").is_renewed());
        let listed = locker.list_leases().await.expect("list");
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].status, LeaseStatus::Held);
    }
}
