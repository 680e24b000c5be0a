//! The fleet on the fakes, with paused time: a worker given a fleet announces itself when it
//! runs (with its perspectives and identity), its keeper's keepalive marks it seen with **one
//! call per interval** whether or not it holds leases, a clean stop departs, and a worker
//! dropped without stopping goes stale after the lock timeout. A worker with a locker but no
//! fleet runs unannounced. A process whose instance id another process took over neither
//! marks the new owner seen nor removes it. Every entry point is called from inside
//! `tokio::spawn` with concrete types.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::{
    ErrorKind, Fleet, FleetAdmin, InstanceAnnouncement, InstanceId, InstanceState, LockReason,
    Perspective, PerspectiveName, PerspectiveRegistry, RecordedEvent, StreamId, StreamLockOptions,
    StreamLocker, Uuid, WorkerInstance,
};
use lockstep_testkit::{
    FakeDatabase, InMemoryEventStore, InMemoryPerspectiveStore, InMemoryStreamLocker,
};
use lockstep_worker::{
    CancellationToken, InstanceIdentity, LeaseKeeper, Leased, PerspectiveWorker, WorkerOptions,
};

struct Count;

impl Perspective for Count {
    type State = u64;
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        "Count"
    }

    fn apply(&self, state: &mut u64, _: &RecordedEvent) -> Result<(), Self::Error> {
        *state += 1;
        Ok(())
    }
}

const KEEPALIVE: Duration = Duration::from_secs(1);

fn options() -> StreamLockOptions {
    StreamLockOptions::new(Duration::from_secs(4), KEEPALIVE).expect("options")
}

type Worker = PerspectiveWorker<FakeDatabase, InMemoryPerspectiveStore>;

/// A worker with the locker as its stream locker only: leases, no fleet.
fn unannounced_worker(
    locker: &InMemoryStreamLocker,
    db: &FakeDatabase,
    instance: InstanceId,
) -> Worker {
    let events = InMemoryEventStore::new();
    let store = InMemoryPerspectiveStore::new(db, &events, locker);
    let mut registry = PerspectiveRegistry::new();
    registry.register(Count).expect("register");
    PerspectiveWorker::new(
        db.clone(),
        store,
        registry,
        WorkerOptions::default(),
        instance,
        Some(Arc::new(locker.clone()) as Arc<dyn StreamLocker>),
    )
    .expect("worker")
}

/// A worker in the locker's fleet.
fn worker(locker: &InMemoryStreamLocker, db: &FakeDatabase, instance: InstanceId) -> Worker {
    unannounced_worker(locker, db, instance)
        .with_fleet(Arc::new(locker.clone()))
        .with_identity(
            InstanceIdentity::detect()
                .with_name("count-worker-0")
                .with_version("9.9.9"),
        )
        .expect("identity")
}

async fn listed(locker: &InMemoryStreamLocker, instance: InstanceId) -> Option<WorkerInstance> {
    let locker = locker.clone();
    tokio::spawn(async move { locker.list_instances().await })
        .await
        .expect("the listing task")
        .expect("list_instances")
        .into_iter()
        .find(|i| i.announcement.instance == instance)
}

/// Waits (bounded, on the paused clock) until `check` holds for the instance's listing.
async fn until(
    locker: &InMemoryStreamLocker,
    instance: InstanceId,
    what: &str,
    check: impl Fn(Option<&WorkerInstance>) -> bool,
) -> Option<WorkerInstance> {
    for _ in 0..600 {
        let found = listed(locker, instance).await;
        if check(found.as_ref()) {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what}: not within 60 s");
}

#[tokio::test(start_paused = true)]
async fn a_running_worker_is_announced_seen_by_its_keepalive_and_departs_when_it_stops() {
    let (locker, db) = (InMemoryStreamLocker::new(options()), FakeDatabase::new());
    let me = InstanceId::random();
    let worker = worker(&locker, &db, me);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(shutdown).await }
    });
    let found = until(&locker, me, "announced", |i| i.is_some())
        .await
        .expect("listed");
    assert_eq!(found.announcement.name, "count-worker-0");
    assert_eq!(found.announcement.version, "9.9.9");
    assert_eq!(found.announcement.pid, std::process::id());
    assert_eq!(
        found.announcement.perspectives,
        vec![PerspectiveName::new("Count").expect("valid")]
    );
    assert_eq!(found.state, InstanceState::Live);
    // Seen again by the keepalive, with no lease held, and live well past the lock timeout.
    let first_seen = found.last_seen_at;
    let later = until(&locker, me, "seen again", |i| {
        i.is_some_and(|i| i.last_seen_at > first_seen)
    })
    .await
    .expect("listed");
    assert_eq!(later.started_at, found.started_at);
    tokio::time::sleep(options().lock_timeout() * 3).await;
    assert_eq!(
        listed(&locker, me).await.expect("listed").state,
        InstanceState::Live
    );
    shutdown.cancel();
    running.await.expect("the worker task").expect("run");
    assert_eq!(listed(&locker, me).await, None, "a clean stop departs");
}

#[tokio::test(start_paused = true)]
async fn a_worker_dropped_without_stopping_goes_stale_after_the_lock_timeout() {
    let (locker, db) = (InMemoryStreamLocker::new(options()), FakeDatabase::new());
    let me = InstanceId::random();
    let worker = worker(&locker, &db, me);
    let running = tokio::spawn(async move { worker.run(CancellationToken::new()).await });
    until(&locker, me, "announced", |i| i.is_some()).await;
    running.abort();
    let _ = running.await;
    let stale = until(&locker, me, "stale", |i| {
        i.is_some_and(|i| i.state == InstanceState::Stale)
    })
    .await
    .expect("a killed instance stays listed");
    assert!(stale.since_seen >= options().lock_timeout());
}

#[tokio::test(start_paused = true)]
async fn an_announced_keeper_sends_one_keepalive_per_interval_with_or_without_leases() {
    let locker = InMemoryStreamLocker::new(options());
    let me = InstanceId::random();
    let keeper = LeaseKeeper::start_in_fleet(Arc::new(locker.clone()), me);
    let announcement = InstanceIdentity::detect()
        .announcement(me, Vec::new())
        .expect("valid");
    let announced = {
        let keeper = keeper.clone();
        tokio::spawn(async move { keeper.announce(announcement).await })
    };
    announced.await.expect("task").expect("announce");
    assert!(keeper.is_announced());
    // Unannounced keepers send nothing while they hold no lease; an announced one sends one
    // call per interval.
    tokio::time::sleep(KEEPALIVE * 5 + KEEPALIVE / 2).await;
    assert_eq!(keeper.renew_calls(), 5);
    let (stream, name) = (
        StreamId::new_v7(),
        PerspectiveName::new("Count").expect("valid"),
    );
    locker.create_cursor(stream, &name);
    let Leased::Acquired(lease) = keeper
        .try_acquire(stream, &name, &LockReason::Rewind)
        .await
        .expect("try_acquire")
    else {
        panic!("acquired");
    };
    // Holding a lease past its lock timeout: still one call per interval, renewing it too.
    tokio::time::sleep(KEEPALIVE * 5).await;
    assert_eq!(keeper.renew_calls(), 10);
    assert!(!lease.lost().is_cancelled(), "the lease was renewed");
    assert_eq!(
        listed(&locker, me).await.expect("listed").state,
        InstanceState::Live
    );
    assert!(lease.release().await.expect("release").is_released());
    // An operator removed the announcement: the next keepalive announces again.
    assert!(
        locker
            .depart(me, InstanceAnnouncement::process_token())
            .await
            .expect("depart")
    );
    until(&locker, me, "announced again", |i| i.is_some()).await;
    let stopping = keeper.clone();
    tokio::spawn(async move { stopping.shutdown().await })
        .await
        .expect("task")
        .expect("shutdown");
    assert_eq!(listed(&locker, me).await, None, "shutdown departs");
    assert!(!keeper.is_announced());
}

#[tokio::test(start_paused = true)]
async fn an_announcement_of_another_instance_is_refused() {
    let locker = InMemoryStreamLocker::new(options());
    let keeper = LeaseKeeper::start_in_fleet(Arc::new(locker.clone()), InstanceId::random());
    let other = InstanceIdentity::detect()
        .announcement(InstanceId::random(), Vec::new())
        .expect("valid");
    let err = keeper.announce(other).await.expect_err("refused");
    assert_eq!(err.kind(), lockstep_core::ErrorKind::InvalidInput);
    assert!(locker.list_instances().await.expect("list").is_empty());
}

/// A second process started with the instance id of a running one: its worker's `run` refuses
/// to start with a conflict that names the first one's host and pid, and changes nothing; the
/// first goes on (its keepalives mark it seen); once the first stops, the second starts.
#[tokio::test(start_paused = true)]
async fn a_second_worker_with_a_running_instance_id_refuses_to_start_until_the_first_stops() {
    let (locker, db) = (InMemoryStreamLocker::new(options()), FakeDatabase::new());
    let me = InstanceId::random();
    let first = worker(&locker, &db, me);
    let first_shutdown = CancellationToken::new();
    let first_running = tokio::spawn({
        let shutdown = first_shutdown.clone();
        async move { first.run(shutdown).await }
    });
    let announced = until(&locker, me, "announced", |i| i.is_some())
        .await
        .expect("listed");

    // Another process: its own token, name and host.
    let second = Arc::new(
        worker(&locker, &db, me)
            .with_identity(
                InstanceIdentity::detect()
                    .with_name("count-worker-1")
                    .with_host("second-host")
                    .with_token(lockstep_core::Uuid::new_v4()),
            )
            .expect("identity"),
    );
    let refused = tokio::spawn({
        let second = Arc::clone(&second);
        async move { second.run(CancellationToken::new()).await }
    })
    .await
    .expect("the second worker's task")
    .expect_err("the second process refuses to start");
    assert_eq!(
        refused.kind(),
        lockstep_core::ErrorKind::Conflict,
        "{refused}"
    );
    let other = lockstep_core::instance_in_use(&refused).expect("names the first process");
    assert_eq!(
        (other.name.as_str(), other.host.as_str(), other.pid),
        (
            "count-worker-0",
            announced.announcement.host.as_str(),
            std::process::id()
        )
    );
    assert!(
        refused.to_string().contains(&announced.announcement.host),
        "{refused}"
    );
    let unchanged = listed(&locker, me).await.expect("listed");
    assert_eq!(unchanged.announcement, announced.announcement);
    assert!(!second.keeper().expect("a keeper").is_announced());

    // The first goes on: its keepalive marks it seen again.
    until(&locker, me, "the first seen again", |i| {
        i.is_some_and(|i| i.last_seen_at > announced.last_seen_at && i.state == InstanceState::Live)
    })
    .await;

    first_shutdown.cancel();
    first_running
        .await
        .expect("the first worker's task")
        .expect("run");
    let second_shutdown = CancellationToken::new();
    let second_running = tokio::spawn({
        let (second, shutdown) = (Arc::clone(&second), second_shutdown.clone());
        async move { second.run(shutdown).await }
    });
    let taken = until(&locker, me, "the second announced", |i| {
        i.is_some_and(|i| i.announcement.name == "count-worker-1")
    })
    .await
    .expect("listed");
    assert_eq!(taken.announcement.host, "second-host");
    second_shutdown.cancel();
    second_running
        .await
        .expect("the second worker's task")
        .expect("run");
}

/// A worker given a stream locker but no fleet takes its leases and runs, unannounced: nothing
/// is listed, its keeper renews with `renew_many` and sends nothing while it holds no lease.
#[tokio::test(start_paused = true)]
async fn a_worker_without_a_fleet_runs_unannounced() {
    let (locker, db) = (InMemoryStreamLocker::new(options()), FakeDatabase::new());
    let me = InstanceId::random();
    let worker = Arc::new(unannounced_worker(&locker, &db, me));
    let announced = tokio::spawn({
        let worker = Arc::clone(&worker);
        async move { worker.announce().await }
    })
    .await
    .expect("task")
    .expect("announce");
    assert!(!announced, "no fleet, nothing announced");
    let keeper = worker.keeper().expect("a keeper");
    assert!(keeper.fleet().is_none());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (worker, shutdown) = (Arc::clone(&worker), shutdown.clone());
        async move { worker.run(shutdown).await }
    });
    tokio::time::sleep(KEEPALIVE * 3).await;
    assert_eq!(listed(&locker, me).await, None);
    assert_eq!(keeper.renew_calls(), 0, "no lease held, nothing to renew");
    shutdown.cancel();
    running.await.expect("the worker task").expect("run");
}

/// A keeper started with a stream locker, not a fleet, cannot announce.
#[tokio::test(start_paused = true)]
async fn a_keeper_without_a_fleet_refuses_to_announce() {
    let locker = InMemoryStreamLocker::new(options());
    let me = InstanceId::random();
    let keeper = LeaseKeeper::start(Arc::new(locker.clone()), me);
    let announcement = InstanceIdentity::detect()
        .announcement(me, Vec::new())
        .expect("valid");
    let err = tokio::spawn(async move { keeper.announce(announcement).await })
        .await
        .expect("task")
        .expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    assert!(locker.list_instances().await.expect("list").is_empty());
}

/// The keepalive carries the announcement's token: once another process holds the instance id
/// (here an operator removed this process's announcement and the other one announced before
/// this one's keepalive came), the keeper's keepalives do not mark the other process seen —
/// they report it not seen, the keeper's announce again is refused — and its shutdown does not
/// remove the other process's announcement.
#[tokio::test(start_paused = true)]
async fn a_keeper_whose_id_was_taken_over_neither_marks_the_new_owner_seen_nor_removes_it() {
    let locker = InMemoryStreamLocker::new(options());
    let me = InstanceId::random();
    let keeper = LeaseKeeper::start_in_fleet(Arc::new(locker.clone()), me);
    let ours = InstanceIdentity::detect()
        .announcement(me, Vec::new())
        .expect("valid");
    let announcing = keeper.clone();
    tokio::spawn(async move { announcing.announce(ours).await })
        .await
        .expect("task")
        .expect("announce");
    assert!(
        locker
            .depart(me, InstanceAnnouncement::process_token())
            .await
            .expect("depart")
    );
    let theirs = InstanceIdentity::detect()
        .with_name("the-other-process")
        .with_token(Uuid::new_v4())
        .announcement(me, Vec::new())
        .expect("valid");
    locker.announce(&theirs).await.expect("the other announces");
    let taken = listed(&locker, me).await.expect("listed");
    tokio::time::sleep(KEEPALIVE * 3 + KEEPALIVE / 2).await;
    assert_eq!(keeper.renew_calls(), 3, "the keepalive went on");
    let after = listed(&locker, me).await.expect("listed");
    assert_eq!(
        (&after.announcement, after.last_seen_at),
        (&theirs, taken.last_seen_at),
        "the other process's announcement is not marked seen"
    );
    let stopping = keeper.clone();
    tokio::spawn(async move { stopping.shutdown().await })
        .await
        .expect("task")
        .expect("shutdown");
    assert_eq!(
        listed(&locker, me).await.map(|i| i.announcement),
        Some(theirs),
        "the shutdown does not remove the other process's announcement"
    );
}
