//! The stream-locker conformance suite: the lease semantics of the stream-locking design, case
//! by case; and the fleet's cases, for a locker that keeps a fleet of worker instances
//! ([`Fleet`], [`FleetAdmin`]).
//!
//! Every case uses fresh stream ids, so the suite can run against a shared database. Expiry is
//! waited out with `tokio::time::sleep(lock_timeout + margin)`: on the in-memory locker with
//! paused time that is instant; on Postgres, give the fixture a short lock timeout
//! ([`SHORT_LOCK_TIMEOUT`]).
//!
//! Run it with [`stream_locker_conformance!`](crate::stream_locker_conformance) (one test per
//! case), or call the cases or [`run_all`] yourself; the fleet's cases with
//! [`fleet_conformance!`](crate::fleet_conformance) or [`run_all_fleet`], on a
//! [`FleetFixture`].

use std::future::Future;
use std::time::Duration;

use lockstep_core::{
    AcquireOutcome, ErrorKind, Fleet, FleetAdmin, InstanceAnnouncement, InstanceId, InstanceState,
    LeaseId, LockReason, PerspectiveName, ReleaseOutcome, RenewOutcome, StreamId, StreamLease,
    StreamLockAdmin, StreamLocker, Uuid, WorkerInstance, instance_in_use,
};

use crate::InMemoryStreamLocker;

/// A lock timeout short enough for suites on real clocks, valid with [`SHORT_KEEPALIVE`].
pub const SHORT_LOCK_TIMEOUT: Duration = Duration::from_millis(400);
/// A keepalive interval valid with [`SHORT_LOCK_TIMEOUT`].
pub const SHORT_KEEPALIVE: Duration = Duration::from_millis(100);

/// What the suite needs from a backend: the locker under test, its admin view, and a way to
/// create cursor rows.
pub trait StreamLockerFixture: Send + Sync + 'static {
    /// The locker under test (a concrete type, or `dyn StreamLocker`).
    type Locker: StreamLocker + ?Sized;
    /// The admin view over the same storage (normally the locker itself).
    type Admin: StreamLockAdmin + ?Sized;

    /// The locker under test. Its `options().lock_timeout()` is how long the suite waits for
    /// a lease to expire, so keep it short on real databases (e.g. [`SHORT_LOCK_TIMEOUT`]).
    fn locker(&self) -> &Self::Locker;

    /// The admin view over the same storage.
    fn admin(&self) -> &Self::Admin;

    /// Creates the cursor row of `(stream_id, perspective)`, unlocked.
    fn create_cursor(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> impl Future<Output = ()> + Send;
}

/// What the fleet's cases need beyond a [`StreamLockerFixture`]: the locker as a [`Fleet`] and
/// its admin view as a [`FleetAdmin`], over the same storage (normally the locker itself; the
/// fleet's keepalive renews leases taken through [`StreamLockerFixture::locker`]).
pub trait FleetFixture: StreamLockerFixture {
    /// The fleet under test (a concrete type, or `dyn Fleet`).
    type Fleet: Fleet + ?Sized;
    /// The fleet's admin view over the same storage.
    type FleetAdmin: FleetAdmin + ?Sized;

    /// The fleet under test.
    fn fleet(&self) -> &Self::Fleet;

    /// The fleet's admin view.
    fn fleet_admin(&self) -> &Self::FleetAdmin;
}

/// The in-memory locker is its own fixture.
impl FleetFixture for InMemoryStreamLocker {
    type Fleet = InMemoryStreamLocker;
    type FleetAdmin = InMemoryStreamLocker;

    fn fleet(&self) -> &InMemoryStreamLocker {
        self
    }

    fn fleet_admin(&self) -> &InMemoryStreamLocker {
        self
    }
}

/// The in-memory locker is its own fixture.
impl StreamLockerFixture for InMemoryStreamLocker {
    type Locker = InMemoryStreamLocker;
    type Admin = InMemoryStreamLocker;

    fn locker(&self) -> &InMemoryStreamLocker {
        self
    }

    fn admin(&self) -> &InMemoryStreamLocker {
        self
    }

    async fn create_cursor(&self, stream_id: StreamId, perspective: &PerspectiveName) {
        InMemoryStreamLocker::create_cursor(self, stream_id, perspective);
    }
}

fn name() -> PerspectiveName {
    PerspectiveName::new("ConformancePerspective").expect("valid name")
}

async fn fresh_cursor<F: StreamLockerFixture>(fixture: &F) -> (StreamId, PerspectiveName) {
    let (stream, name) = (StreamId::new_v7(), name());
    fixture.create_cursor(stream, &name).await;
    (stream, name)
}

async fn acquire<F: StreamLockerFixture>(
    fixture: &F,
    stream: StreamId,
    name: &PerspectiveName,
    instance: InstanceId,
    reason: &LockReason,
) -> StreamLease {
    match fixture
        .locker()
        .try_acquire(stream, name, instance, reason)
        .await
        .expect("try_acquire")
    {
        AcquireOutcome::Acquired(lease) => lease,
        other => panic!("expected the lease to be acquired, got {other:?}"),
    }
}

async fn state<F: StreamLockerFixture>(
    fixture: &F,
    stream: StreamId,
    name: &PerspectiveName,
) -> lockstep_core::CursorLease {
    fixture
        .admin()
        .inspect(stream, name)
        .await
        .expect("inspect")
        .expect("cursor row exists")
}

/// A fresh cursor leased by a random instance for `rewind`.
async fn leased<F: StreamLockerFixture>(fixture: &F) -> (StreamId, PerspectiveName, StreamLease) {
    let (stream, name) = fresh_cursor(fixture).await;
    let lease = acquire(
        fixture,
        stream,
        &name,
        InstanceId::random(),
        &LockReason::Rewind,
    )
    .await;
    (stream, name, lease)
}

/// Two lease ids that do not hold `lease`: another instance, and the holder at an epoch moved
/// by `epoch_delta`.
fn not_the_holder(lease: &LeaseId, epoch_delta: i64) -> [LeaseId; 2] {
    let mut other_instance = lease.clone();
    other_instance.holder = InstanceId::random();
    let mut other_epoch = lease.clone();
    other_epoch.epoch = lockstep_core::LeaseEpoch::new(lease.epoch.get() + epoch_delta);
    [other_instance, other_epoch]
}

/// Waits until a lease taken now has expired on the backend's clock.
async fn wait_past_expiry<F: StreamLockerFixture>(fixture: &F) {
    let timeout = fixture.locker().options().lock_timeout();
    tokio::time::sleep(timeout + timeout / 2 + Duration::from_millis(50)).await;
}

/// An unlocked cursor is acquired, with holder, reason, expiry and a new epoch stored.
pub async fn acquires_an_unlocked_cursor<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let before = state(fixture, stream, &name).await;
    assert!(before.is_unlocked());
    let a = InstanceId::random();
    let lease = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    assert_eq!(lease.id.holder, a);
    assert_eq!(lease.id.stream_id, stream);
    assert_eq!(lease.reason, LockReason::Rewind);
    assert!(
        lease.id.epoch > before.epoch,
        "a new lease gets a new epoch"
    );
    let after = state(fixture, stream, &name).await;
    assert_eq!(after.holder, Some(a));
    assert_eq!(after.reason, Some(LockReason::Rewind));
    assert_eq!(after.expires_at, Some(lease.expires_at));
    assert_eq!(after.epoch, lease.id.epoch);
}

/// A pair without a cursor row is never acquired.
pub async fn missing_cursor_row_is_not_acquired<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = (StreamId::new_v7(), name());
    let outcome = fixture
        .locker()
        .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("try_acquire");
    assert_eq!(outcome, AcquireOutcome::NoCursor);
    assert_eq!(
        fixture
            .admin()
            .inspect(stream, &name)
            .await
            .expect("inspect"),
        None
    );
}

/// Another instance is denied while the lease is live; the denial names the holder, reason
/// and expiry, and the row is unchanged.
pub async fn held_by_another_is_denied_and_unchanged<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let (a, b) = (InstanceId::random(), InstanceId::random());
    let lease = acquire(fixture, stream, &name, a, &LockReason::Bootstrap).await;
    let before = state(fixture, stream, &name).await;
    let outcome = fixture
        .locker()
        .try_acquire(stream, &name, b, &LockReason::Rewind)
        .await
        .expect("try_acquire");
    match outcome {
        AcquireOutcome::Denied(holder) => {
            assert_eq!(holder.instance, a);
            assert_eq!(holder.reason, LockReason::Bootstrap);
            assert_eq!(holder.expires_at, lease.expires_at);
            assert_eq!(holder.epoch, lease.id.epoch);
        }
        other => panic!("expected a denial, got {other:?}"),
    }
    assert_eq!(state(fixture, stream, &name).await, before);
}

/// The holder re-acquires idempotently: the reason is overwritten, the expiry refreshed, the
/// epoch kept.
pub async fn same_instance_reacquires_and_the_reason_changes<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let a = InstanceId::random();
    let first = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    tokio::time::sleep(fixture.locker().options().lock_timeout() / 8).await;
    let second = acquire(fixture, stream, &name, a, &LockReason::Purge).await;
    assert_eq!(second.id, first.id, "same holder, same epoch");
    assert_eq!(second.reason, LockReason::Purge);
    assert!(second.expires_at > first.expires_at, "expiry refreshed");
    assert_eq!(
        state(fixture, stream, &name).await.reason,
        Some(LockReason::Purge)
    );
}

/// A lease says whether the caller joined one its instance already held: not on the first
/// acquire, yes on a re-acquire of the live lease (same epoch), not once the lease expired or
/// was released (a new lease).
pub async fn a_reacquire_by_the_holder_says_it_reentered<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let a = InstanceId::random();
    let first = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    assert!(!first.reentered, "a new lease is not re-entered");
    let joined = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    assert!(
        joined.reentered,
        "the holder's second acquire joins its lease"
    );
    assert_eq!(joined.id, first.id);
    wait_past_expiry(fixture).await;
    let renewed = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    assert!(!renewed.reentered, "an expired lease is established anew");
    assert!(renewed.id.epoch > first.id.epoch);
    let released = fixture
        .locker()
        .release(&renewed.id)
        .await
        .expect("release");
    assert!(released.is_released());
    let again = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    assert!(!again.reentered, "a released lease is established anew");
    assert!(!again.took_over, "a released lease is not taken over");
    assert!(!joined.took_over, "joining a live lease takes nothing over");
}

/// Once a lease has expired, another instance takes it over with a higher epoch.
pub async fn expired_lease_is_taken_over_by_another_instance<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let (a, b) = (InstanceId::random(), InstanceId::random());
    let old = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    assert!(!old.took_over, "a first lease takes nothing over");
    wait_past_expiry(fixture).await;
    let new = acquire(fixture, stream, &name, b, &LockReason::Bootstrap).await;
    assert_eq!(new.id.holder, b);
    assert!(new.id.epoch > old.id.epoch);
    assert!(new.took_over, "an expired, unreleased lease is taken over");
    let listed = fixture.admin().list_leases().await.expect("list");
    let row = listed
        .iter()
        .find(|l| l.stream_id == stream)
        .expect("the new lease is listed");
    assert_eq!(row.holder, b);
}

/// The holder's own expired lease is established anew, with a new epoch: work done under the
/// lapsed lease stays fenced out.
pub async fn reacquiring_an_own_expired_lease_bumps_the_epoch<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let a = InstanceId::random();
    let old = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    wait_past_expiry(fixture).await;
    let new = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    assert!(new.id.epoch > old.id.epoch);
    let locker = fixture.locker();
    assert_eq!(
        locker.renew(&old.id).await.expect("renew"),
        RenewOutcome::Lost
    );
}

/// Leasing one pair leaves the other perspective of the stream and other streams unlocked.
pub async fn only_the_target_cursor_is_locked<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let other_name = PerspectiveName::new("OtherPerspective").expect("valid");
    fixture.create_cursor(stream, &other_name).await;
    let (other_stream, _) = fresh_cursor(fixture).await;
    let (a, b) = (InstanceId::random(), InstanceId::random());
    acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    assert!(state(fixture, stream, &other_name).await.is_unlocked());
    assert!(state(fixture, other_stream, &name).await.is_unlocked());
    acquire(fixture, stream, &other_name, b, &LockReason::Rewind).await;
    acquire(fixture, other_stream, &name, b, &LockReason::Rewind).await;
}

/// Renew by the holder extends the expiry.
pub async fn renew_extends_the_lease<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name, lease) = leased(fixture).await;
    tokio::time::sleep(fixture.locker().options().lock_timeout() / 4).await;
    match fixture.locker().renew(&lease.id).await.expect("renew") {
        RenewOutcome::Renewed { expires_at } => {
            assert!(expires_at > lease.expires_at);
            assert_eq!(
                state(fixture, stream, &name).await.expires_at,
                Some(expires_at)
            );
        }
        RenewOutcome::Lost => panic!("the holder's renew must succeed"),
    }
}

/// A renew by another instance (or a stale epoch) reports `Lost` and changes nothing.
pub async fn renew_by_another_instance_changes_nothing<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name, lease) = leased(fixture).await;
    let before = state(fixture, stream, &name).await;
    let [imposter, stale] = not_the_holder(&lease.id, -1);
    let locker = fixture.locker();
    assert_eq!(
        locker.renew(&imposter).await.expect("renew"),
        RenewOutcome::Lost
    );
    assert_eq!(
        locker.renew(&stale).await.expect("renew"),
        RenewOutcome::Lost
    );
    assert_eq!(state(fixture, stream, &name).await, before);
}

/// An expired lease is never resurrected by a late renew.
pub async fn renew_after_expiry_is_lost<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name, lease) = leased(fixture).await;
    wait_past_expiry(fixture).await;
    let before = state(fixture, stream, &name).await;
    assert_eq!(
        fixture.locker().renew(&lease.id).await.expect("renew"),
        RenewOutcome::Lost
    );
    assert_eq!(state(fixture, stream, &name).await, before);
}

/// Release by the holder clears holder, expiry and reason (the epoch stays).
pub async fn release_clears_all_lease_fields<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let lease = acquire(
        fixture,
        stream,
        &name,
        InstanceId::random(),
        &LockReason::Purge,
    )
    .await;
    assert_eq!(
        fixture.locker().release(&lease.id).await.expect("release"),
        ReleaseOutcome::Released
    );
    let after = state(fixture, stream, &name).await;
    assert!(
        after.is_unlocked(),
        "holder, expiry and reason cleared: {after:?}"
    );
    assert_eq!(after.epoch, lease.id.epoch, "the epoch survives release");
}

/// A release by another instance (or a stale epoch) reports `NotHeld` and changes nothing.
pub async fn release_by_another_instance_changes_nothing<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name, lease) = leased(fixture).await;
    let before = state(fixture, stream, &name).await;
    let [imposter, stale] = not_the_holder(&lease.id, 1);
    let locker = fixture.locker();
    assert_eq!(
        locker.release(&imposter).await.expect("release"),
        ReleaseOutcome::NotHeld
    );
    assert_eq!(
        locker.release(&stale).await.expect("release"),
        ReleaseOutcome::NotHeld
    );
    assert_eq!(state(fixture, stream, &name).await, before);
}

/// Releasing an unlocked pair, or a pair without a cursor row, is fine and changes nothing.
pub async fn release_when_unlocked_is_fine<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let before = state(fixture, stream, &name).await;
    let id = LeaseId::new(stream, name.clone(), InstanceId::random(), before.epoch);
    let locker = fixture.locker();
    assert_eq!(
        locker.release(&id).await.expect("release"),
        ReleaseOutcome::NotHeld
    );
    assert_eq!(state(fixture, stream, &name).await, before);
    let mut missing = id;
    missing.stream_id = StreamId::new_v7();
    assert_eq!(
        locker.release(&missing).await.expect("release"),
        ReleaseOutcome::NotHeld
    );
}

/// After a release another instance acquires at once, with a higher epoch.
pub async fn release_makes_it_acquirable_by_another<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let (a, b) = (InstanceId::random(), InstanceId::random());
    let first = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    let _ = fixture.locker().release(&first.id).await.expect("release");
    let second = acquire(fixture, stream, &name, b, &LockReason::Rewind).await;
    assert!(second.id.epoch > first.id.epoch);
}

/// acquire → 3 renews → release → another instance acquires.
pub async fn full_cycle<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let (a, b) = (InstanceId::random(), InstanceId::random());
    let locker = fixture.locker();
    let lease = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    let mut last = lease.expires_at;
    for _ in 0..3 {
        tokio::time::sleep(locker.options().keepalive_interval()).await;
        match locker.renew(&lease.id).await.expect("renew") {
            RenewOutcome::Renewed { expires_at } => {
                assert!(expires_at > last);
                last = expires_at;
            }
            RenewOutcome::Lost => panic!("renew within the keepalive interval must succeed"),
        }
    }
    assert!(
        locker
            .release(&lease.id)
            .await
            .expect("release")
            .is_released()
    );
    let next = acquire(fixture, stream, &name, b, &LockReason::Bootstrap).await;
    assert_eq!(next.id.holder, b);
}

/// `renew_many` renews the live leases and reports the lost ones, in input order.
pub async fn renew_many_reports_lost_leases_in_order<F: StreamLockerFixture>(fixture: &F) {
    let a = InstanceId::random();
    let (s1, name) = fresh_cursor(fixture).await;
    let (s2, _) = fresh_cursor(fixture).await;
    let (s3, _) = fresh_cursor(fixture).await;
    let l1 = acquire(fixture, s1, &name, a, &LockReason::Rewind).await;
    let l2 = acquire(fixture, s2, &name, a, &LockReason::Rewind).await;
    let l3 = acquire(fixture, s3, &name, a, &LockReason::Rewind).await;
    let _ = fixture
        .admin()
        .force_release(s2, &name)
        .await
        .expect("force release");
    let locker = fixture.locker();
    let outcomes = locker
        .renew_many(&[l1.id.clone(), l2.id.clone(), l3.id.clone()])
        .await
        .expect("renew_many");
    assert_eq!(outcomes.len(), 3);
    assert!(outcomes[0].is_renewed());
    assert_eq!(outcomes[1], RenewOutcome::Lost);
    assert!(outcomes[2].is_renewed());
    assert!(locker.renew_many(&[]).await.expect("empty").is_empty());
}

/// Force-release clears the lease whoever holds it and bumps the epoch, so the old holder's
/// renew and release fail and a new holder gets a higher epoch still.
pub async fn force_release_fences_the_old_holder<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let (a, b) = (InstanceId::random(), InstanceId::random());
    let old = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    let admin = fixture.admin();
    assert!(
        admin
            .force_release(stream, &name)
            .await
            .expect("force")
            .is_released()
    );
    let after = state(fixture, stream, &name).await;
    assert!(after.is_unlocked());
    assert!(after.epoch > old.id.epoch, "force-release bumps the epoch");
    let locker = fixture.locker();
    assert_eq!(
        locker.renew(&old.id).await.expect("renew"),
        RenewOutcome::Lost
    );
    assert_eq!(
        locker.release(&old.id).await.expect("release"),
        ReleaseOutcome::NotHeld
    );
    let new = acquire(fixture, stream, &name, b, &LockReason::Rewind).await;
    assert!(new.id.epoch > after.epoch);
    assert_eq!(
        admin
            .force_release(StreamId::new_v7(), &name)
            .await
            .expect("missing"),
        ReleaseOutcome::NotHeld
    );
}

/// `release_all_held_by` clears exactly the instance's leases.
pub async fn release_all_clears_only_that_instances_leases<F: StreamLockerFixture>(fixture: &F) {
    let (a, b) = (InstanceId::random(), InstanceId::random());
    let (s1, name) = fresh_cursor(fixture).await;
    let (s2, _) = fresh_cursor(fixture).await;
    let (s3, _) = fresh_cursor(fixture).await;
    acquire(fixture, s1, &name, a, &LockReason::Rewind).await;
    acquire(fixture, s2, &name, a, &LockReason::Bootstrap).await;
    acquire(fixture, s3, &name, b, &LockReason::Rewind).await;
    let admin = fixture.admin();
    assert_eq!(admin.release_all_held_by(a).await.expect("release all"), 2);
    assert!(state(fixture, s1, &name).await.is_unlocked());
    assert!(state(fixture, s2, &name).await.is_unlocked());
    assert_eq!(state(fixture, s3, &name).await.holder, Some(b));
}

/// The admin listing shows held leases with time left, and expired ones as expired.
pub async fn list_shows_held_and_expired_leases<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let a = InstanceId::random();
    let lease = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    let timeout = fixture.locker().options().lock_timeout();
    let find = |leases: Vec<lockstep_core::LeaseInfo>| {
        leases
            .into_iter()
            .find(|l| l.stream_id == stream && l.perspective == name)
            .expect("lease listed")
    };
    let held = find(fixture.admin().list_leases().await.expect("list"));
    assert_eq!(held.status, lockstep_core::LeaseStatus::Held);
    assert_eq!((held.holder, held.epoch), (a, lease.id.epoch));
    assert_eq!(held.reason, LockReason::Rewind);
    assert!(held.time_left > Duration::ZERO && held.time_left <= timeout);
    wait_past_expiry(fixture).await;
    let expired = find(fixture.admin().list_leases().await.expect("list"));
    assert_eq!(expired.status, lockstep_core::LeaseStatus::Expired);
    assert_eq!(expired.time_left, Duration::ZERO);
}

/// A listed lease says when it was acquired: the try-acquire that began its epoch (its expiry
/// was that moment plus the lock timeout). Renewals and the holder's re-entry keep it; a new
/// epoch (after a release, or an expired lease taken over) has a later one.
pub async fn a_listed_lease_says_when_it_was_acquired<F: StreamLockerFixture>(fixture: &F) {
    let (stream, name) = fresh_cursor(fixture).await;
    let (a, b) = (InstanceId::random(), InstanceId::random());
    let timeout = fixture.locker().options().lock_timeout();
    let listed = || async {
        fixture
            .admin()
            .list_leases()
            .await
            .expect("list")
            .into_iter()
            .find(|l| l.stream_id == stream && l.perspective == name)
            .expect("lease listed")
    };
    let lease = acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    let first = listed().await;
    let started = first.acquired_at.expect("the start of a lease is recorded");
    let held_for = lease.expires_at - started;
    assert!(
        (held_for - timeout).abs() < time::Duration::milliseconds(1),
        "acquired {started}, expiring {} (lock timeout {timeout:?})",
        lease.expires_at
    );
    // No sleep before the renewal and the re-entry: they must land inside the (short, on a real
    // database) lock timeout even on a loaded machine.
    match fixture.locker().renew(&lease.id).await.expect("renew") {
        RenewOutcome::Renewed { expires_at } => assert!(expires_at >= lease.expires_at),
        RenewOutcome::Lost => panic!("the holder's renew must succeed"),
    }
    assert_eq!(
        listed().await.acquired_at,
        Some(started),
        "a renewal keeps it"
    );
    let again = acquire(fixture, stream, &name, a, &LockReason::Purge).await;
    assert_eq!(again.id.epoch, lease.id.epoch);
    assert_eq!(
        listed().await.acquired_at,
        Some(started),
        "a re-entry keeps it"
    );
    assert_eq!(
        fixture.locker().release(&again.id).await.expect("release"),
        ReleaseOutcome::Released
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let next = acquire(fixture, stream, &name, b, &LockReason::Rewind).await;
    let second = listed().await;
    assert_eq!((second.holder, second.epoch), (b, next.id.epoch));
    let restarted = second.acquired_at.expect("recorded");
    assert!(
        restarted > started,
        "a new epoch, a new start: {restarted} after {started}"
    );
    wait_past_expiry(fixture).await;
    acquire(fixture, stream, &name, a, &LockReason::Rewind).await;
    let taken = listed().await.acquired_at.expect("recorded");
    assert!(
        taken > restarted,
        "a takeover is a new start: {taken} after {restarted}"
    );
}

/// The token [`announcement`] announces with (this process's).
fn token() -> Uuid {
    InstanceAnnouncement::process_token()
}

/// The announcement of `instance` running `perspectives`, by this process ([`token`]).
fn announcement(instance: InstanceId, perspectives: &[&str]) -> InstanceAnnouncement {
    InstanceAnnouncement::new(
        instance,
        format!("conformance-{instance}"),
        "conformance-host",
        4242,
        "1.2.3",
        perspectives
            .iter()
            .map(|p| PerspectiveName::new(*p).expect("valid name"))
            .collect(),
    )
    .expect("valid announcement")
}

async fn listed<F: FleetFixture>(fixture: &F, instance: InstanceId) -> Option<WorkerInstance> {
    fixture
        .fleet_admin()
        .list_instances()
        .await
        .expect("list_instances")
        .into_iter()
        .find(|i| i.announcement.instance == instance)
}

/// An announced instance is listed live, with everything it announced, stale after the lock
/// timeout.
pub async fn an_announced_instance_is_listed_live_with_what_it_runs<F: FleetFixture>(fixture: &F) {
    let me = InstanceId::random();
    let announced = announcement(me, &["B", "A"]);
    assert_eq!(listed(fixture, me).await, None);
    fixture
        .fleet()
        .announce(&announced)
        .await
        .expect("announce");
    let found = listed(fixture, me).await.expect("listed after announcing");
    assert_eq!(found.announcement, announced);
    assert_eq!(found.state, InstanceState::Live);
    let timeout = fixture.locker().options().lock_timeout();
    assert_eq!(found.stale_after, timeout);
    assert!(found.since_seen < timeout, "{found:?}");
    assert!(found.started_at <= found.last_seen_at);
    let names: Vec<&str> = found
        .announcement
        .perspectives
        .iter()
        .map(PerspectiveName::as_str)
        .collect();
    assert_eq!(names, ["A", "B"]);
}

/// Announcing again replaces what the instance announced, keeping when it started.
pub async fn announcing_again_replaces_the_announcement_and_keeps_started_at<F: FleetFixture>(
    fixture: &F,
) {
    let me = InstanceId::random();
    fixture
        .fleet()
        .announce(&announcement(me, &["A"]))
        .await
        .expect("announce");
    let first = listed(fixture, me).await.expect("listed");
    tokio::time::sleep(fixture.locker().options().keepalive_interval()).await;
    let again = announcement(me, &["C"]);
    fixture
        .fleet()
        .announce(&again)
        .await
        .expect("announce again");
    let second = listed(fixture, me).await.expect("still listed");
    assert_eq!(second.announcement, again);
    assert_eq!(second.started_at, first.started_at);
    assert!(second.last_seen_at > first.last_seen_at);
}

/// The keepalive of an announced instance renews its leases and marks it seen, in one call.
pub async fn keepalive_renews_the_leases_and_marks_the_instance_seen<F: FleetFixture>(fixture: &F) {
    let me = InstanceId::random();
    fixture
        .fleet()
        .announce(&announcement(me, &["A"]))
        .await
        .expect("announce");
    let (stream, name) = fresh_cursor(fixture).await;
    let lease = acquire(fixture, stream, &name, me, &LockReason::Rewind).await;
    let before = listed(fixture, me).await.expect("listed");
    tokio::time::sleep(fixture.locker().options().keepalive_interval()).await;
    let done = fixture
        .fleet()
        .keepalive(me, token(), std::slice::from_ref(&lease.id))
        .await
        .expect("keepalive");
    assert!(done.seen);
    assert_eq!(done.renewed.len(), 1);
    match done.renewed[0] {
        RenewOutcome::Renewed { expires_at } => assert!(expires_at > lease.expires_at),
        RenewOutcome::Lost => panic!("the lease was not renewed"),
    }
    let after = listed(fixture, me).await.expect("listed");
    assert!(
        after.last_seen_at > before.last_seen_at,
        "{before:?} {after:?}"
    );
    // With no lease held, the keepalive still marks the instance seen.
    let idle = fixture
        .fleet()
        .keepalive(me, token(), &[])
        .await
        .expect("keepalive");
    assert!(idle.seen && idle.renewed.is_empty());
}

/// The keepalive of an instance that is not announced renews its leases and says so.
pub async fn keepalive_of_an_unannounced_instance_is_not_seen<F: FleetFixture>(fixture: &F) {
    let (stream, name, lease) = leased(fixture).await;
    let _ = (stream, name);
    let done = fixture
        .fleet()
        .keepalive(lease.id.holder, token(), std::slice::from_ref(&lease.id))
        .await
        .expect("keepalive");
    assert!(!done.seen);
    assert!(done.renewed[0].is_renewed());
    assert_eq!(listed(fixture, lease.id.holder).await, None);
}

/// An instance not seen for its `stale_after` is listed stale, and live again once seen.
pub async fn an_instance_not_seen_for_its_stale_after_is_stale<F: FleetFixture>(fixture: &F) {
    let me = InstanceId::random();
    fixture
        .fleet()
        .announce(&announcement(me, &["A"]))
        .await
        .expect("announce");
    wait_past_expiry(fixture).await;
    let stale = listed(fixture, me)
        .await
        .expect("a stale instance stays listed");
    assert_eq!(stale.state, InstanceState::Stale);
    assert!(stale.since_seen >= stale.stale_after);
    assert!(
        fixture
            .fleet()
            .keepalive(me, token(), &[])
            .await
            .expect("keepalive")
            .seen
    );
    assert_eq!(
        listed(fixture, me).await.expect("listed").state,
        InstanceState::Live
    );
}

/// The announcement of `instance` by a second process (a token of its own) on another host.
fn second_process(instance: InstanceId) -> InstanceAnnouncement {
    InstanceAnnouncement::new(
        instance,
        "second-process",
        "second-host",
        777,
        "1.2.3",
        Vec::new(),
    )
    .expect("valid announcement")
    .with_token(Uuid::new_v4())
}

/// Announces `announcement`, which must be refused as an id another process runs, naming it
/// (`name`, `host`, `pid`), with nothing changed.
async fn refused_as_in_use<F: FleetFixture>(
    fixture: &F,
    announcement: &InstanceAnnouncement,
    (name, host, pid): (&str, &str, u32),
) {
    let me = announcement.instance;
    let before = listed(fixture, me)
        .await
        .expect("the other process is listed");
    let err = fixture
        .fleet()
        .announce(announcement)
        .await
        .expect_err("an id announced live by another process is refused");
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    let other = instance_in_use(&err).expect("the details of the other process");
    assert_eq!(
        (
            other.instance,
            other.name.as_str(),
            other.host.as_str(),
            other.pid
        ),
        (me, name, host, pid)
    );
    assert_eq!(other.stale_after, fixture.locker().options().lock_timeout());
    let text = err.to_string();
    assert!(
        text.contains(host) && text.contains(&pid.to_string()),
        "{text}"
    );
    let after = listed(fixture, me).await.expect("still listed");
    assert_eq!(
        (after.announcement, after.started_at),
        (before.announcement, before.started_at),
        "a refused announce changes nothing"
    );
}

/// An instance id names one running process: announcing an id that another process (another
/// token) has announced and that is live is refused with a conflict that names that process,
/// and changes nothing. The first process announcing again (its keepalive does when its row
/// went missing) is fine; once it departs, the second process can announce.
pub async fn an_id_announced_live_by_another_process_is_refused_until_it_departs<
    F: FleetFixture,
>(
    fixture: &F,
) {
    let me = InstanceId::random();
    let first = announcement(me, &["A"]);
    let second = second_process(me);
    fixture.fleet().announce(&first).await.expect("announce");
    refused_as_in_use(fixture, &second, (&first.name, "conformance-host", 4242)).await;
    fixture
        .fleet()
        .announce(&first)
        .await
        .expect("the same process announces again");
    refused_as_in_use(fixture, &second, (&first.name, "conformance-host", 4242)).await;
    assert!(
        !fixture
            .fleet()
            .depart(me, second.token)
            .await
            .expect("depart of another process"),
        "a depart with another token removes nothing"
    );
    assert!(
        fixture
            .fleet()
            .depart(me, first.token)
            .await
            .expect("depart")
    );
    fixture
        .fleet()
        .announce(&second)
        .await
        .expect("the id is free once the first process departed");
    let listed = listed(fixture, me).await.expect("listed");
    assert_eq!(listed.announcement, second);
}

/// A stale announcement of another process is taken over (a new start), and from then on the
/// first process is the other one: its announce is refused, naming the second.
pub async fn a_stale_announcement_of_another_process_is_taken_over<F: FleetFixture>(fixture: &F) {
    let me = InstanceId::random();
    let first = announcement(me, &["A"]);
    fixture.fleet().announce(&first).await.expect("announce");
    let started = listed(fixture, me).await.expect("listed").started_at;
    wait_past_expiry(fixture).await;
    assert_eq!(
        listed(fixture, me).await.expect("listed").state,
        InstanceState::Stale
    );
    let second = second_process(me);
    fixture
        .fleet()
        .announce(&second)
        .await
        .expect("a stale announcement is taken over");
    let taken = listed(fixture, me).await.expect("listed");
    assert_eq!(taken.announcement, second);
    assert_eq!(taken.state, InstanceState::Live);
    assert!(
        taken.started_at > started,
        "a takeover is a new start: {} after {started}",
        taken.started_at
    );
    refused_as_in_use(fixture, &first, ("second-process", "second-host", 777)).await;
}

/// Departing removes the announcement; departing again finds nothing.
pub async fn depart_removes_the_instance<F: FleetFixture>(fixture: &F) {
    let (me, other) = (InstanceId::random(), InstanceId::random());
    for id in [me, other] {
        fixture
            .fleet()
            .announce(&announcement(id, &["A"]))
            .await
            .expect("announce");
    }
    assert!(fixture.fleet().depart(me, token()).await.expect("depart"));
    assert_eq!(listed(fixture, me).await, None);
    assert!(
        listed(fixture, other).await.is_some(),
        "only that instance departs"
    );
    assert!(
        !fixture
            .fleet()
            .depart(me, token())
            .await
            .expect("depart again")
    );
    assert!(
        !fixture
            .fleet()
            .keepalive(me, token(), &[])
            .await
            .expect("keepalive")
            .seen
    );
}

/// The keepalive carries the announcement's token: a process whose id was taken over by
/// another (it was not seen for its `stale_after`, and a second process announced the id)
/// renews nothing it lost and does not mark the new owner seen — its keepalive reports
/// `seen == false` and every lease `Lost`, and leaves the new owner's announcement and leases
/// as they are; nor does its depart remove the new owner's announcement.
pub async fn a_keepalive_after_a_takeover_does_not_mark_the_new_owner_seen<F: FleetFixture>(
    fixture: &F,
) {
    let me = InstanceId::random();
    let first = announcement(me, &["A"]);
    fixture.fleet().announce(&first).await.expect("announce");
    let (stream, name) = fresh_cursor(fixture).await;
    let ours = acquire(fixture, stream, &name, me, &LockReason::Rewind).await;
    wait_past_expiry(fixture).await;
    let second = second_process(me);
    fixture
        .fleet()
        .announce(&second)
        .await
        .expect("a stale announcement is taken over");
    let theirs = acquire(fixture, stream, &name, me, &LockReason::Rewind).await;
    assert!(
        theirs.id.epoch > ours.id.epoch,
        "a takeover of an expired lease"
    );
    let taken = listed(fixture, me).await.expect("listed");
    // Some time on the backend's clock, so that a keepalive that marked the row seen would
    // show in `last_seen_at`.
    tokio::time::sleep(fixture.locker().options().keepalive_interval()).await;
    let done = fixture
        .fleet()
        .keepalive(me, first.token, std::slice::from_ref(&ours.id))
        .await
        .expect("keepalive");
    assert!(
        !done.seen,
        "the first process's keepalive does not see the second's announcement"
    );
    assert_eq!(done.renewed, vec![RenewOutcome::Lost]);
    let after = listed(fixture, me).await.expect("still listed");
    assert_eq!(
        (&after.announcement, after.last_seen_at, after.started_at),
        (&second, taken.last_seen_at, taken.started_at),
        "the new owner's announcement is left as it was"
    );
    let lease = state(fixture, stream, &name).await;
    assert_eq!(
        (lease.epoch, lease.expires_at),
        (theirs.id.epoch, Some(theirs.expires_at)),
        "the new owner's lease is left as it was"
    );
    assert!(
        !fixture
            .fleet()
            .depart(me, first.token)
            .await
            .expect("depart"),
        "the first process's depart removes nothing"
    );
    assert!(listed(fixture, me).await.is_some());
    let theirs_kept = fixture
        .fleet()
        .keepalive(me, second.token, std::slice::from_ref(&theirs.id))
        .await
        .expect("keepalive");
    assert!(theirs_kept.seen && theirs_kept.renewed[0].is_renewed());
    let seen = listed(fixture, me).await.expect("listed");
    assert!(seen.last_seen_at > taken.last_seen_at, "{seen:?}");
}

/// Runs every case, in order, in one test. Prefer
/// [`stream_locker_conformance!`](crate::stream_locker_conformance): a test per case.
pub async fn run_all<F: StreamLockerFixture>(fixture: &F) {
    crate::__lockstep_stream_locker_cases!(__lockstep_conformance_run_all! { by_ref fixture });
}

#[doc(hidden)]
#[macro_export]
macro_rules! __lockstep_stream_locker_cases {
    ($then:ident ! { $($args:tt)* }) => {
        $crate::$then! { $($args)* cases: [
            acquires_an_unlocked_cursor,
            missing_cursor_row_is_not_acquired,
            held_by_another_is_denied_and_unchanged,
            same_instance_reacquires_and_the_reason_changes,
            a_reacquire_by_the_holder_says_it_reentered,
            expired_lease_is_taken_over_by_another_instance,
            reacquiring_an_own_expired_lease_bumps_the_epoch,
            only_the_target_cursor_is_locked,
            renew_extends_the_lease,
            renew_by_another_instance_changes_nothing,
            renew_after_expiry_is_lost,
            release_clears_all_lease_fields,
            release_by_another_instance_changes_nothing,
            release_when_unlocked_is_fine,
            release_makes_it_acquirable_by_another,
            full_cycle,
            renew_many_reports_lost_leases_in_order,
            force_release_fences_the_old_holder,
            release_all_clears_only_that_instances_leases,
            list_shows_held_and_expired_leases,
            a_listed_lease_says_when_it_was_acquired,
        ] }
    };
}

/// Runs every case of the fleet, in order, in one test. Prefer
/// [`fleet_conformance!`](crate::fleet_conformance): a test per case.
pub async fn run_all_fleet<F: FleetFixture>(fixture: &F) {
    crate::__lockstep_fleet_cases!(__lockstep_conformance_run_all! { by_ref fixture });
}

#[doc(hidden)]
#[macro_export]
macro_rules! __lockstep_fleet_cases {
    ($then:ident ! { $($args:tt)* }) => {
        $crate::$then! { $($args)* cases: [
            an_announced_instance_is_listed_live_with_what_it_runs,
            announcing_again_replaces_the_announcement_and_keeps_started_at,
            keepalive_renews_the_leases_and_marks_the_instance_seen,
            keepalive_of_an_unannounced_instance_is_not_seen,
            an_instance_not_seen_for_its_stale_after_is_stale,
            depart_removes_the_instance,
            an_id_announced_live_by_another_process_is_refused_until_it_departs,
            a_stale_announcement_of_another_process_is_taken_over,
            a_keepalive_after_a_takeover_does_not_mark_the_new_owner_seen,
        ] }
    };
}

/// Expands to one test per case of the [stream-locker conformance
/// suite](crate::conformance::stream_locker), each on a fixture of its own.
///
/// `fixture:` is an expression evaluated inside each test (it may `.await`) that yields a
/// [`StreamLockerFixture`](crate::conformance::stream_locker::StreamLockerFixture). Attributes
/// written first replace the default `#[tokio::test]`: `#[tokio::test(start_paused = true)]` for
/// the fakes (expiry costs nothing), `#[tokio::test(flavor = "multi_thread")]` for a database.
/// `after_each:` (optional) is a closure called with `&fixture` after the case passed, to check
/// what the case left behind. The calling crate needs `tokio` (with `macros`, `rt`, and
/// `test-util` for paused time) among its dev-dependencies, and the testkit's `conformance`
/// feature.
///
/// Call it inside a module of its own when a file runs several suites or fixtures: the tests are
/// named after the cases. Not covered by semver (see [`conformance`](crate::conformance)).
///
/// ```
/// mod in_memory {
///     use lockstep_core::StreamLockOptions;
///     use lockstep_testkit::InMemoryStreamLocker;
///
///     lockstep_testkit::stream_locker_conformance! {
///         #[tokio::test(start_paused = true)]
///         fixture: InMemoryStreamLocker::new(StreamLockOptions::default()),
///     }
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! stream_locker_conformance {
    ($(#[$attr:meta])+ fixture: $fixture:expr $(, after_each: $after:expr)? $(,)?) => {
        $crate::__lockstep_stream_locker_cases!(__lockstep_conformance_tests! {
            suite: stream_locker,
            pass: by_ref,
            attrs: [$(#[$attr])+],
            fixture: $fixture,
            after_each: [$($after)?],
        });
    };
    (fixture: $($rest:tt)*) => {
        $crate::stream_locker_conformance! { #[::tokio::test] fixture: $($rest)* }
    };
}

/// Expands to one test per case of the fleet's part of the [stream-locker conformance
/// suite](crate::conformance::stream_locker) (announce, keepalive, depart and the listing), each
/// on a fixture of its own: a [`FleetFixture`](crate::conformance::stream_locker::FleetFixture).
/// Takes the same arguments as [`stream_locker_conformance!`](crate::stream_locker_conformance).
/// Not covered by semver (see [`conformance`](crate::conformance)).
///
/// ```
/// mod in_memory {
///     use lockstep_core::StreamLockOptions;
///     use lockstep_testkit::InMemoryStreamLocker;
///
///     lockstep_testkit::fleet_conformance! {
///         #[tokio::test(start_paused = true)]
///         fixture: InMemoryStreamLocker::new(StreamLockOptions::default()),
///     }
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! fleet_conformance {
    ($(#[$attr:meta])+ fixture: $fixture:expr $(, after_each: $after:expr)? $(,)?) => {
        $crate::__lockstep_fleet_cases!(__lockstep_conformance_tests! {
            suite: stream_locker,
            pass: by_ref,
            attrs: [$(#[$attr])+],
            fixture: $fixture,
            after_each: [$($after)?],
        });
    };
    (fixture: $($rest:tt)*) => {
        $crate::fleet_conformance! { #[::tokio::test] fixture: $($rest)* }
    };
}
