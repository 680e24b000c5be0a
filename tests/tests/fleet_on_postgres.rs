//! The fleet on PostgreSQL (issue 20, item 5), with two worker instances on one database, each
//! running in a task of its own with the concrete Postgres types: both are listed with their
//! identity and perspectives, their keepalives advance `last_seen_at`, a clean stop removes
//! its row, and a killed one (its task aborted, the worker dropped) is listed stale once its
//! lock timeout has passed. Waits are bounded; nothing is timed.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::{
    FleetAdmin, InstanceId, InstanceState, PerspectiveName, PerspectiveRegistry, StreamLockOptions,
    WorkerInstance,
};
use lockstep_pg::PgDatabase;
use lockstep_pg_store::PgPerspectiveStore;
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::test_database;
use lockstep_tests::{NUMBERS, Numbers};
use lockstep_worker::{CancellationToken, InstanceIdentity, PerspectiveWorker, WorkerOptions};

fn options() -> StreamLockOptions {
    StreamLockOptions::new(Duration::from_millis(600), Duration::from_millis(150)).expect("options")
}

fn worker(
    pool: &deadpool_postgres::Pool,
    instance: InstanceId,
    name: &str,
) -> PerspectiveWorker<PgDatabase, PgPerspectiveStore> {
    let mut registry = PerspectiveRegistry::new();
    registry.register(Numbers::new()).expect("register");
    PerspectiveWorker::new(
        PgDatabase::from_pool(pool.clone()),
        PgPerspectiveStore::new(),
        registry,
        WorkerOptions::default(),
        instance,
        None,
    )
    .expect("worker")
    .with_fleet(Arc::new(PgStreamLocker::from_pool(pool.clone(), options())))
    .with_identity(
        InstanceIdentity::detect()
            .with_name(name)
            .with_version("fleet-test 1"),
    )
    .expect("identity")
}

/// The instance's listing, read from inside a spawned task as a web handler would.
async fn listed(locker: &PgStreamLocker, instance: InstanceId) -> Option<WorkerInstance> {
    let locker = locker.clone();
    tokio::spawn(async move { locker.list_instances().await })
        .await
        .expect("the listing task")
        .expect("list_instances")
        .into_iter()
        .find(|i| i.announcement.instance == instance)
}

async fn until(
    locker: &PgStreamLocker,
    instance: InstanceId,
    what: &str,
    check: impl Fn(Option<&WorkerInstance>) -> bool,
) -> Option<WorkerInstance> {
    for _ in 0..300 {
        let found = listed(locker, instance).await;
        if check(found.as_ref()) {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what}: not within 30 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_are_listed_kept_alive_and_gone_or_stale_when_they_stop_or_die() {
    let db = test_database().await;
    let pool = db.pool(8);
    lockstep_pg::migrate(&pool).await.expect("migrate");
    let locker = PgStreamLocker::from_pool(pool.clone(), options());
    let (stops, dies) = (InstanceId::random(), InstanceId::random());

    let shutdown = CancellationToken::new();
    let stopping = tokio::spawn({
        let (worker, shutdown) = (worker(&pool, stops, "fleet-stops"), shutdown.clone());
        async move { worker.run(shutdown).await }
    });
    let dying = tokio::spawn({
        let worker = worker(&pool, dies, "fleet-dies");
        async move { worker.run(CancellationToken::new()).await }
    });

    for (id, name) in [(stops, "fleet-stops"), (dies, "fleet-dies")] {
        let found = until(&locker, id, "announced", |i| i.is_some())
            .await
            .expect("listed");
        assert_eq!(found.announcement.name, name);
        assert_eq!(found.announcement.version, "fleet-test 1");
        assert_eq!(found.announcement.pid, std::process::id());
        assert_eq!(
            found.announcement.perspectives,
            vec![PerspectiveName::new(NUMBERS).expect("valid")]
        );
        assert_eq!(found.stale_after, options().lock_timeout());
        // The keepalive (no lease is held) moves last_seen_at on.
        let first = found.last_seen_at;
        until(&locker, id, "seen by a keepalive", |i| {
            i.is_some_and(|i| i.last_seen_at > first && i.state == InstanceState::Live)
        })
        .await;
    }

    dying.abort();
    assert!(dying.await.expect_err("aborted").is_cancelled());
    let stale = until(&locker, dies, "stale", |i| {
        i.is_some_and(|i| i.state == InstanceState::Stale)
    })
    .await
    .expect("a killed instance stays listed");
    assert!(stale.since_seen >= options().lock_timeout());
    assert_eq!(
        listed(&locker, stops).await.expect("listed").state,
        InstanceState::Live,
        "the other instance is still alive"
    );

    shutdown.cancel();
    stopping.await.expect("the worker task").expect("run");
    assert_eq!(
        listed(&locker, stops).await,
        None,
        "a clean stop removes the row"
    );
}

/// Two workers given one instance id, as two processes would be (each with its own token and
/// host): the second refuses to start with a conflict that names the first's host and pid and
/// writes nothing; the first, killed (its task aborted), leaves a row that the second takes
/// over once it is stale — and the second then runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_with_a_running_instance_id_refuses_to_start_until_that_one_is_stale() {
    let db = test_database().await;
    let pool = db.pool(8);
    lockstep_pg::migrate(&pool).await.expect("migrate");
    let locker = PgStreamLocker::from_pool(pool.clone(), options());
    let me = InstanceId::random();

    let first = tokio::spawn({
        let worker = worker(&pool, me, "fleet-first");
        async move { worker.run(CancellationToken::new()).await }
    });
    let announced = until(&locker, me, "announced", |i| i.is_some())
        .await
        .expect("listed");

    let second = Arc::new(
        worker(&pool, me, "fleet-second")
            .with_identity(
                InstanceIdentity::detect()
                    .with_name("fleet-second")
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
            "fleet-first",
            announced.announcement.host.as_str(),
            std::process::id()
        )
    );
    assert_eq!(other.stale_after, options().lock_timeout());
    let unchanged = listed(&locker, me).await.expect("listed");
    assert_eq!(
        (unchanged.announcement, unchanged.started_at),
        (announced.announcement.clone(), announced.started_at)
    );

    first.abort();
    assert!(first.await.expect_err("aborted").is_cancelled());
    until(&locker, me, "the first is stale", |i| {
        i.is_some_and(|i| i.state == InstanceState::Stale)
    })
    .await;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (second, shutdown) = (Arc::clone(&second), shutdown.clone());
        async move { second.run(shutdown).await }
    });
    let taken = until(&locker, me, "taken over", |i| {
        i.is_some_and(|i| i.announcement.name == "fleet-second" && i.state == InstanceState::Live)
    })
    .await
    .expect("listed");
    assert_eq!(taken.announcement.host, "second-host");
    assert!(taken.started_at > announced.started_at, "a new start");
    shutdown.cancel();
    running
        .await
        .expect("the second worker's task")
        .expect("run");
}
