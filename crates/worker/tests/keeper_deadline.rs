//! The keeper's lost signal fires at the lease's local deadline whatever the renews do (issue 8):
//! on the testkit's in-memory locker with paused tokio time, behind a wrapper that stalls or
//! delays the keeper's `renew_many` calls (a network stall, an exhausted pool) and records them.
//!
//! The deadline is `sent + lock_timeout − keepalive_interval`, `sent` being when the last
//! confirmed acquire or renew was sent; a confirmation that arrives at or after the deadline is
//! too late. A second instance polls try-acquire every 10 ms: the lost signal must fire at least
//! one keepalive interval before its first successful one was sent.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lockstep_core::{
    AcquireOutcome, ErrorKind, InstanceId, LeaseId, LockReason, PerspectiveName, ReleaseOutcome,
    RenewOutcome, Result, StreamId, StreamLockOptions, StreamLocker, async_trait,
};
use lockstep_testkit::{FaultyStreamLocker, InMemoryStreamLocker};
use lockstep_worker::{HeldLease, LeaseKeeper, Leased};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

/// Longer than any test: a renew delayed this long is cut off by the keeper's own bound.
const STALL: Duration = Duration::from_secs(3600);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// One `renew_many` call as the locker saw it.
#[derive(Debug, Clone)]
struct Call {
    sent: Instant,
    ids: Vec<LeaseId>,
    /// When it returned, and what; `None` while in flight or when cut off.
    confirmed: Option<(Instant, Vec<RenewOutcome>)>,
}

#[derive(Debug, Default)]
struct Plan {
    /// Delays of the next renew calls, in order; then `then` for every later one.
    renews: VecDeque<Duration>,
    then: Duration,
    acquire_delay: Duration,
    calls: Vec<Call>,
}

/// The keeper's locker: the shared in-memory leases, reached late or never.
#[derive(Debug, Clone)]
struct Stalling {
    inner: InMemoryStreamLocker,
    plan: Arc<Mutex<Plan>>,
}

impl Stalling {
    fn plan(&self) -> MutexGuard<'_, Plan> {
        self.plan.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next renews wait `delays` (in order), every later one `then`, before reaching the
    /// leases; the keeper cuts a wait longer than its interval off.
    fn delay_renews(&self, delays: &[Duration], then: Duration) {
        let mut plan = self.plan();
        plan.renews = delays.iter().copied().collect();
        plan.then = then;
    }

    fn calls(&self) -> Vec<Call> {
        self.plan().calls.clone()
    }

    /// The calls as "sent → confirmed" offsets from `origin`, for failure messages.
    fn timeline(&self, origin: Instant) -> Vec<String> {
        self.calls()
            .iter()
            .map(|c| match &c.confirmed {
                Some((at, _)) => format!("{:?} → {:?}", c.sent - origin, *at - origin),
                None => format!("{:?} → cut off", c.sent - origin),
            })
            .collect()
    }
}

#[async_trait]
impl StreamLocker for Stalling {
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
        let delay = self.plan().acquire_delay;
        sleep(delay).await;
        self.inner
            .try_acquire(stream_id, perspective, instance, reason)
            .await
    }

    async fn renew(&self, lease: &LeaseId) -> Result<RenewOutcome> {
        self.inner.renew(lease).await
    }

    async fn release(&self, lease: &LeaseId) -> Result<ReleaseOutcome> {
        self.inner.release(lease).await
    }

    async fn renew_many(&self, leases: &[LeaseId]) -> Result<Vec<RenewOutcome>> {
        let (call, delay) = {
            let mut plan = self.plan();
            let delay = plan.renews.pop_front().unwrap_or(plan.then);
            plan.calls.push(Call {
                sent: Instant::now(),
                ids: leases.to_vec(),
                confirmed: None,
            });
            (plan.calls.len() - 1, delay)
        };
        sleep(delay).await;
        let outcomes = self.inner.renew_many(leases).await?;
        self.plan().calls[call].confirmed = Some((Instant::now(), outcomes.clone()));
        Ok(outcomes)
    }
}

struct Rig {
    /// The database's view: the second instance uses it directly.
    db: InMemoryStreamLocker,
    keeper_locker: Stalling,
    keeper: LeaseKeeper,
    name: PerspectiveName,
    options: StreamLockOptions,
}

impl Rig {
    /// A keeper started now on leases with `lock_timeout` / `keepalive` (ms).
    fn start(lock_timeout: u64, keepalive: u64) -> Rig {
        let options = StreamLockOptions::new(ms(lock_timeout), ms(keepalive)).expect("options");
        let db = InMemoryStreamLocker::new(options);
        let keeper_locker = Stalling {
            inner: db.clone(),
            plan: Arc::default(),
        };
        let keeper = LeaseKeeper::start(Arc::new(keeper_locker.clone()), InstanceId::random());
        Rig {
            db,
            keeper_locker,
            keeper,
            name: PerspectiveName::new("Orders").expect("name"),
            options,
        }
    }

    fn margin(&self) -> Duration {
        self.options.lock_timeout() - self.options.keepalive_interval()
    }

    /// A fresh pair leased through the keeper: the lease and when its acquire was sent.
    async fn acquire(&self) -> (StreamId, HeldLease, Instant) {
        let stream = StreamId::new_v7();
        self.db.create_cursor(stream, &self.name);
        let sent = Instant::now();
        match self
            .keeper
            .try_acquire(stream, &self.name, &LockReason::Rewind)
            .await
            .expect("try_acquire")
        {
            Leased::Acquired(lease) => (stream, lease, sent),
            other => panic!("a fresh cursor was not leased: {other:?}"),
        }
    }

    /// Another instance trying to take the pair over every 10 ms: when its winning try was sent.
    fn takeover(&self, stream: StreamId) -> JoinHandle<Instant> {
        let (db, name, other) = (self.db.clone(), self.name.clone(), InstanceId::random());
        tokio::spawn(async move {
            loop {
                let sent = Instant::now();
                let outcome = db
                    .try_acquire(stream, &name, other, &LockReason::Rewind)
                    .await
                    .expect("takeover try_acquire");
                if outcome.is_acquired() {
                    return sent;
                }
                sleep(ms(10)).await;
            }
        })
    }

    /// When the lost signal of `lease` should fire by the deadline rule, from the calls the
    /// locker saw: the deadline moves on with every renew confirmed before it.
    fn deadline(&self, lease: &HeldLease, acquire_sent: Instant) -> Instant {
        let mut deadline = acquire_sent + self.margin();
        for call in self.keeper_locker.calls() {
            let Some(at) = call.ids.iter().position(|id| id == lease.id()) else {
                continue;
            };
            let Some((confirmed, outcomes)) = call.confirmed else {
                continue;
            };
            if confirmed >= deadline {
                break;
            }
            match outcomes[at] {
                RenewOutcome::Renewed { .. } => deadline = call.sent + self.margin(),
                RenewOutcome::Lost => return confirmed,
            }
        }
        deadline
    }
}

/// When `lease`'s lost signal fires; `None` if it has not within 10 s (test time).
fn lost_at(lease: &HeldLease) -> JoinHandle<Option<Instant>> {
    let token = lease.lost().clone();
    tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(10), token.cancelled())
            .await
            .ok()
            .map(|()| Instant::now())
    })
}

/// The stall promise, for a lease whose keeper stalls for good: the lost signal fires exactly at
/// the lease's deadline, at least one interval before the other instance's takeover.
async fn assert_lost_at_deadline_before_takeover(
    rig: &Rig,
    stream: StreamId,
    lease: &HeldLease,
    acquire_sent: Instant,
) {
    let t0 = acquire_sent;
    let lost = lost_at(lease);
    let takeover = rig.takeover(stream).await.expect("takeover task");
    let lost = lost
        .await
        .expect("lost task")
        .expect("the lost signal never fired");
    let deadline = rig.deadline(lease, acquire_sent);
    assert_eq!(
        lost.saturating_duration_since(t0),
        deadline.saturating_duration_since(t0),
        "the lost signal fired at (left) instead of the lease's deadline (right), after the \
         acquire; renews: {:?}",
        rig.keeper_locker.timeline(t0)
    );
    assert!(
        lost + rig.options.keepalive_interval() <= takeover,
        "the lost signal fired {:?} after the acquire, the takeover was sent {:?} after it: less \
         than one interval before",
        lost - t0,
        takeover - t0
    );
}

/// Stall 0 of the fault suite: a lease renewed once, then every renew stalls (a network stall).
#[tokio::test(start_paused = true)]
async fn a_renewed_lease_whose_renews_then_stall_is_lost_at_its_deadline_before_a_takeover() {
    let rig = Rig::start(1500, 400);
    let (stream, lease, sent) = rig.acquire().await;
    // The first renew (at 400 ms) goes through; every later one stalls.
    rig.keeper_locker.delay_renews(&[Duration::ZERO], STALL);
    assert_lost_at_deadline_before_takeover(&rig, stream, &lease, sent).await;
    // 400 ms (the confirmed renew) + 1100 ms; the old keeper fired at 2000 ms, the takeover
    // came at 1900 ms.
    assert_eq!(rig.deadline(&lease, sent) - sent, ms(1500));
}

/// Stall 1 of the fault suite: the default 3:1 ratio, the lease acquired half an interval into
/// the keeper's cycle and every renew stalled from the first (an exhausted pool).
#[tokio::test(start_paused = true)]
async fn a_lease_acquired_mid_cycle_whose_first_renew_stalls_is_lost_at_its_deadline_before_a_takeover()
 {
    let rig = Rig::start(1200, 400);
    sleep(ms(200)).await;
    rig.keeper_locker.delay_renews(&[], STALL);
    let (stream, lease, sent) = rig.acquire().await;
    assert_lost_at_deadline_before_takeover(&rig, stream, &lease, sent).await;
    // 200 ms + 800 ms after the keeper started; the old keeper fired at 1600 ms, the takeover
    // came at 1400 ms.
    assert_eq!(rig.deadline(&lease, sent) - sent, ms(800));
}

/// A renew in flight when the deadline passes that then succeeds does not bring the lease back:
/// the signal fired, the keeper never renews the lease again, the holder's release ends it.
#[tokio::test(start_paused = true)]
async fn a_renew_confirmed_after_the_deadline_does_not_resurrect_the_lease() {
    let rig = Rig::start(1500, 400);
    sleep(ms(200)).await;
    // The renews at 400 and 800 ms stall (cut off at 800 and 1200 ms); the one sent at 1200 ms
    // takes 300 ms and succeeds at 1500 ms, after the deadline at 1300 ms; later ones are prompt.
    rig.keeper_locker
        .delay_renews(&[STALL, STALL, ms(300)], Duration::ZERO);
    let (stream, lease, sent) = rig.acquire().await;
    let lost = lost_at(&lease);
    sleep(ms(800)).await;
    // A healthy lease taken at 1000 ms rides along in the late renew and stays held.
    let (_, healthy, _) = rig.acquire().await;
    let lost = lost
        .await
        .expect("lost task")
        .expect("the lost signal never fired");
    assert_eq!(
        lost - sent,
        ms(1100),
        "fired at the deadline, the renew still in flight"
    );

    sleep(ms(3000)).await;
    let calls = rig.keeper_locker.calls();
    let late = calls
        .iter()
        .find(|c| c.sent - sent == ms(1000))
        .expect("the renew sent at 1200 ms");
    assert!(
        matches!(&late.confirmed, Some((at, o)) if *at - sent == ms(1300) && o.iter().all(|o| o.is_renewed())),
        "the late renew succeeded: {late:?}"
    );
    assert!(lease.lost().is_cancelled(), "still lost");
    for call in calls.iter().filter(|c| c.sent > lost) {
        assert!(
            !call.ids.contains(lease.id()),
            "the lost lease was renewed again: {call:?}"
        );
        assert!(call.ids.contains(healthy.id()), "{call:?}");
    }
    assert!(calls.iter().filter(|c| c.sent > lost).count() >= 5);
    assert!(!healthy.lost().is_cancelled(), "the healthy lease is kept");
    assert_eq!(rig.keeper.held(), 1, "only the healthy lease is kept alive");

    // The late renew did extend the row; the holder's release ends it for the next instance.
    assert_eq!(
        lease.release().await.expect("release"),
        ReleaseOutcome::Released
    );
    let next = rig
        .db
        .try_acquire(stream, &rig.name, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("try_acquire");
    assert!(next.is_acquired(), "{next:?}");
    assert_eq!(
        healthy.release().await.expect("release"),
        ReleaseOutcome::Released
    );
}

/// An acquire that returns after its own deadline (sent + lock timeout − interval) hands out a
/// lease that is already lost, and the keeper never renews it.
#[tokio::test(start_paused = true)]
async fn a_lease_whose_acquire_returned_after_its_deadline_is_lost_at_once() {
    let rig = Rig::start(1500, 400);
    rig.keeper_locker.plan().acquire_delay = ms(1200);
    let (_, lease, _) = rig.acquire().await;
    assert!(lease.lost().is_cancelled(), "lost on arrival");
    assert_eq!(rig.keeper.held(), 0);
    sleep(ms(2000)).await;
    assert!(rig.keeper_locker.calls().is_empty(), "never renewed");
}

/// The fix keeps the keepalive at one `renew_many` per interval for every lease held.
#[tokio::test(start_paused = true)]
async fn healthy_leases_are_renewed_with_one_call_per_interval_and_never_lost() {
    let rig = Rig::start(1500, 400);
    let mut leases = Vec::new();
    for _ in 0..3 {
        leases.push(rig.acquire().await.1);
    }
    sleep(ms(4200)).await;
    let calls = rig.keeper_locker.calls();
    assert_eq!(calls.len(), 10, "{calls:?}");
    assert_eq!(rig.keeper.renew_calls(), 10);
    assert!(calls.iter().all(|c| c.ids.len() == 3));
    assert!(leases.iter().all(|l| !l.lost().is_cancelled()));
    assert_eq!(rig.keeper.held(), 3);
}

/// Renews that each take most of an interval keep the lease at the default 3:1 ratio: the next
/// one is sent an interval after the last was sent, not after it returned, so it is confirmed
/// before the deadline its predecessor set.
#[tokio::test(start_paused = true)]
async fn renews_that_take_most_of_an_interval_keep_the_lease_at_the_default_ratio() {
    let rig = Rig::start(1200, 400);
    rig.keeper_locker.delay_renews(&[], ms(350));
    let (_, lease, sent) = rig.acquire().await;
    sleep(ms(4200)).await;
    assert!(!lease.lost().is_cancelled(), "lost by slow renews");
    let calls = rig.keeper_locker.calls();
    let offsets: Vec<Duration> = calls.iter().map(|c| c.sent - sent).collect();
    let every_interval: Vec<Duration> = (1..=10).map(|k| ms(400 * k)).collect();
    assert_eq!(
        offsets, every_interval,
        "one renew per interval, at a fixed rate"
    );
    assert!(
        calls
            .iter()
            .filter_map(|c| c.confirmed.as_ref())
            .all(|(_, o)| o.iter().all(|o| o.is_renewed()))
    );
}

/// A renew that fails (an error, not a stall) is tried again soon, so the lease survives it, as
/// the options promise ("a lease survives one missed renew"). At the default 3:1 ratio the
/// next regular renew is due exactly at the deadline: before the retry, one failed renew lost
/// every lease the instance held. Afterwards the keepalive goes back to one call per interval.
#[tokio::test(start_paused = true)]
async fn a_lease_survives_a_renew_that_fails_and_is_tried_again_soon() {
    let options = StreamLockOptions::new(ms(1200), ms(400)).expect("options");
    let db = InMemoryStreamLocker::new(options);
    let (faulty, faults) = FaultyStreamLocker::new(db.clone());
    let keeper = LeaseKeeper::start(Arc::new(faulty), InstanceId::random());
    let name = PerspectiveName::new("Orders").expect("name");
    let stream = StreamId::new_v7();
    db.create_cursor(stream, &name);
    let lease = match keeper
        .try_acquire(stream, &name, &LockReason::Rewind)
        .await
        .expect("try_acquire")
    {
        Leased::Acquired(lease) => lease,
        other => panic!("a fresh cursor was not leased: {other:?}"),
    };
    // The deadline is 800 ms after the acquire; the renew at 400 ms fails, the next regular
    // one would come at 800 ms.
    faults.fail_next_renews(1, ErrorKind::ConnectionLost);
    sleep(ms(3000)).await;
    assert!(!lease.lost().is_cancelled(), "lost to one failed renew");
    let other = db
        .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("try_acquire");
    assert!(!other.is_acquired(), "still held: {other:?}");
    // 3 000 ms: 7 renews at one per interval, plus the one that failed.
    assert_eq!(keeper.renew_calls(), 8);
    assert_eq!(
        lease.release().await.expect("release"),
        ReleaseOutcome::Released
    );
}

/// A release that never answers (a row lock held elsewhere, a connection gone silent) is
/// abandoned after the lock timeout, with a retryable error: by then the lease has expired,
/// and no caller (a rewind ending, a worker's cycle) waits on it for ever. Shutdown releases
/// every lease within one lock timeout in all.
#[tokio::test(start_paused = true)]
async fn a_release_that_never_answers_is_abandoned_after_the_lock_timeout() {
    let options = StreamLockOptions::new(ms(1200), ms(400)).expect("options");
    let db = InMemoryStreamLocker::new(options);
    let (faulty, faults) = FaultyStreamLocker::new(db.clone());
    let keeper = LeaseKeeper::start(Arc::new(faulty), InstanceId::random());
    let name = PerspectiveName::new("Orders").expect("name");
    let mut leases = Vec::new();
    for _ in 0..3 {
        let stream = StreamId::new_v7();
        db.create_cursor(stream, &name);
        match keeper
            .try_acquire(stream, &name, &LockReason::Rewind)
            .await
            .expect("try_acquire")
        {
            Leased::Acquired(lease) => leases.push(lease),
            other => panic!("a fresh cursor was not leased: {other:?}"),
        }
    }
    // From now on every call to the locker hangs.
    faults.set_latency(Duration::from_secs(3600));
    let started = Instant::now();
    let released = tokio::time::timeout(ms(2400), leases.remove(0).release())
        .await
        .expect("the release returned within twice the lock timeout");
    let err = released.expect_err("no answer");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost, "{err:?}");
    assert!(err.is_retryable());
    assert_eq!(started.elapsed(), ms(1200), "abandoned at the lock timeout");
    let started = Instant::now();
    let shutdown = tokio::time::timeout(ms(3600), keeper.shutdown())
        .await
        .expect("shutdown returned");
    assert!(shutdown.is_err(), "the releases failed: {shutdown:?}");
    assert!(
        started.elapsed() <= ms(2400),
        "one lock timeout for the held leases, one for the background release"
    );
}
