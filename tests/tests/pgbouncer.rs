//! lockstep through PgBouncer in transaction mode (`pool_mode = transaction`), started by each
//! test in front of its own database (`lockstep_testkit::pg_harness::pgbouncer`): the
//! conformance suites that apply there — stream locker, fleet, lease fence, distributed
//! (transaction-scoped) lock, event store, snapshot store, perspective store — the perspective
//! worker with a late event and its rewind lease, the command runner in every mode (the
//! combiner included) and the combiner itself, and `migrate`, each through the pooler; session
//! locks refused with the pooler named, told or detected; and a handle that was not told finding
//! the pooler out and working on.
//!
//! The pooler hands a client's consecutive transactions to different server connections
//! (`server_round_robin`), so a statement relying on session state fails here instead of passing
//! by luck. Whatever observes the server (`pg_locks`, `pg_stat_activity`, the fixtures' own rows)
//! connects directly, not through the pooler. Every test module and function name contains
//! `pgbouncer`.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;
use lockstep_core::{
    AcquireOutcome, DistributedLock, ErrorKind, ExpectedVersion, InstanceId, LockReason,
    PerspectiveName, PerspectiveRegistry, ReleaseOutcome, ResourceKey, SessionLocks, StreamId,
    StreamLockOptions, StreamLocker, TransactionSource,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_advisory::PgDistributedLock;
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::pgbouncer::PgBouncer;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};
use lockstep_tests::{NUMBERS, Numbers, number_event};

/// A database of the test's own, a PgBouncer in front of it, and a handle through the pooler
/// (told it is behind one unless the test says otherwise), migrated through the pooler.
struct Bounced {
    // Dropped in this order: the handle's pool, the pooler, then the database.
    db: PgDatabase,
    bouncer: PgBouncer,
    test: TestDatabase,
}

impl Bounced {
    async fn new(pool_size: usize) -> Bounced {
        Bounced::with(pool_size, Some(true)).await
    }

    /// `told`: what the handle is told about the pooler (`None`: nothing).
    async fn with(pool_size: usize, told: Option<bool>) -> Bounced {
        let test = test_database().await;
        // Semantics under concurrency, not durability, are under test.
        test.skip_wal_flush().await.expect("synchronous_commit");
        let bouncer = PgBouncer::for_database(&test).await;
        let db = handle(&bouncer, &test, pool_size, told);
        db.migrate().await.expect("migrate through the pooler");
        Bounced { db, bouncer, test }
    }

    /// A direct connection, for what observes the server.
    async fn direct(&self) -> tokio_postgres::Client {
        self.test.connect().await
    }
}

/// A handle on `test` through `bouncer`.
fn handle(
    bouncer: &PgBouncer,
    test: &TestDatabase,
    pool_size: usize,
    told: Option<bool>,
) -> PgDatabase {
    let builder = PgDatabase::builder()
        .config(bouncer.config(test))
        .max_connections(pool_size);
    match told {
        Some(behind) => builder.transaction_pooler(behind),
        None => builder,
    }
    .build()
    .expect("a handle through the pooler")
}

fn short_options() -> StreamLockOptions {
    StreamLockOptions::new(Duration::from_millis(400), Duration::from_millis(100))
        .expect("400 ms / 100 ms is a valid pair")
}

fn medium_options() -> StreamLockOptions {
    StreamLockOptions::new(Duration::from_secs(2), Duration::from_millis(500))
        .expect("2 s / 500 ms is a valid pair")
}

fn perspective(name: &str) -> PerspectiveName {
    PerspectiveName::new(name).expect("a valid perspective name")
}

/// Inserts the unlocked cursor row of a pair, on a direct connection.
async fn create_cursor(test: &TestDatabase, stream_id: StreamId, perspective: &PerspectiveName) {
    test.connect()
        .await
        .execute(
            "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)",
            &[&stream_id.as_uuid(), &perspective.as_str()],
        )
        .await
        .expect("inserting a cursor row");
}

/// Advisory locks held or awaited in the test's database, read directly.
async fn advisory_locks(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

// --- the conformance suites ----------------------------------------------------------------

mod pgbouncer_stream_locker {
    //! Stream locker, fleet and lease fence through the pooler.

    use lockstep_testkit::conformance::lease_fence::LeaseFenceFixture;
    use lockstep_testkit::conformance::stream_locker::{FleetFixture, StreamLockerFixture};

    use super::*;

    pub(super) struct Fixture {
        bounced: Bounced,
        locker: PgStreamLocker,
    }

    impl StreamLockerFixture for Fixture {
        type Locker = PgStreamLocker;
        type Admin = PgStreamLocker;

        fn locker(&self) -> &PgStreamLocker {
            &self.locker
        }

        fn admin(&self) -> &PgStreamLocker {
            &self.locker
        }

        async fn create_cursor(&self, stream_id: StreamId, perspective: &PerspectiveName) {
            create_cursor(&self.bounced.test, stream_id, perspective).await;
        }
    }

    impl FleetFixture for Fixture {
        type Fleet = PgStreamLocker;
        type FleetAdmin = PgStreamLocker;

        fn fleet(&self) -> &PgStreamLocker {
            &self.locker
        }

        fn fleet_admin(&self) -> &PgStreamLocker {
            &self.locker
        }
    }

    impl LeaseFenceFixture for Fixture {
        type Tx = PgTransaction;
        type Source = PgDatabase;
        type Fence = PgStreamLocker;

        fn fence(&self) -> &PgStreamLocker {
            &self.locker
        }

        fn source(&self) -> &PgDatabase {
            &self.bounced.db
        }
    }

    pub(super) async fn fixture() -> Fixture {
        let bounced = Bounced::new(4).await;
        let locker = PgStreamLocker::new(&bounced.db, short_options());
        Fixture { bounced, locker }
    }

    mod locker {
        lockstep_testkit::stream_locker_conformance! {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            fixture: super::fixture().await,
        }
    }

    mod fleet {
        lockstep_testkit::fleet_conformance! {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            fixture: super::fixture().await,
        }
    }

    mod lease_fence {
        lockstep_testkit::lease_fence_conformance! {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            fixture: super::fixture().await,
        }
    }
}

mod pgbouncer_distributed_lock {
    //! Transaction-scoped advisory locks through the pooler, with the in-process queue on and
    //! off (off, every waiter waits at the server: the pooler pins each waiting transaction).

    use lockstep_testkit::conformance::distributed_lock::DistributedLockFixture;

    use super::*;

    pub(super) struct Fixture {
        bounced: Bounced,
        lock: PgDistributedLock,
    }

    impl DistributedLockFixture for Fixture {
        type Tx = PgTransaction;
        type Source = PgDatabase;
        type Lock = PgDistributedLock;

        fn lock(&self) -> &PgDistributedLock {
            &self.lock
        }

        fn source(&self) -> &PgDatabase {
            &self.bounced.db
        }
    }

    pub(super) async fn fixture(local_queue: bool) -> Fixture {
        let bounced = Bounced::new(8).await;
        let lock = PgDistributedLock::new(&bounced.db).with_local_queue(local_queue);
        Fixture { bounced, lock }
    }

    mod queued {
        lockstep_testkit::distributed_lock_conformance! {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            fixture: super::fixture(true).await,
        }
    }

    mod at_the_server {
        lockstep_testkit::distributed_lock_conformance! {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            fixture: super::fixture(false).await,
        }
    }
}

mod pgbouncer_event_store {
    //! Event store and snapshot store through the pooler; waits are read on a direct connection.

    use lockstep_testkit::conformance::event_store::EventStoreFixture;

    use super::*;

    pub(super) struct Fixture {
        bounced: Arc<Bounced>,
        store: PgEventStore,
    }

    impl EventStoreFixture for Fixture {
        type Tx = PgTransaction;
        type Source = PgDatabase;
        type Store = PgEventStore;

        fn store(&self) -> &PgEventStore {
            &self.store
        }

        fn store_with_upcasters(&self, upcasters: lockstep_core::Upcasters) -> PgEventStore {
            self.store.clone().with_upcasters(upcasters)
        }

        fn source(&self) -> &PgDatabase {
            &self.bounced.db
        }

        async fn waiting(&self) -> usize {
            let bounced = Arc::clone(&self.bounced);
            let client = bounced.direct().await;
            lockstep_testkit::pg_harness::lock_waiters(&client).await
        }
    }

    pub(super) async fn fixture() -> Fixture {
        let bounced = Bounced::new(8).await;
        let store = PgEventStore::new(&bounced.db);
        Fixture {
            bounced: Arc::new(bounced),
            store,
        }
    }

    mod events {
        lockstep_testkit::event_store_conformance! {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            fixture: super::fixture().await,
        }
    }

    mod snapshots {
        lockstep_testkit::snapshot_store_conformance! {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            fixture: super::fixture().await,
        }
    }
}

mod pgbouncer_perspective_store {
    //! The worker's store through the pooler.

    use lockstep_testkit::conformance::perspective_store::PerspectiveStoreFixture;

    use super::*;

    pub(super) struct Fixture {
        bounced: Bounced,
        store: PgPerspectiveStore,
        events: PgEventStore,
        locker: PgStreamLocker,
    }

    impl PerspectiveStoreFixture for Fixture {
        type Tx = PgTransaction;
        type Source = PgDatabase;
        type Store = PgPerspectiveStore;
        type Events = PgEventStore;
        type Locker = PgStreamLocker;
        type Admin = PgStreamLocker;

        fn source(&self) -> &PgDatabase {
            &self.bounced.db
        }

        fn store(&self) -> &PgPerspectiveStore {
            &self.store
        }

        fn store_with_upcasters(&self, upcasters: lockstep_core::Upcasters) -> PgPerspectiveStore {
            self.store.clone().with_upcasters(upcasters)
        }

        fn events(&self) -> &PgEventStore {
            &self.events
        }

        fn locker(&self) -> &PgStreamLocker {
            &self.locker
        }

        fn admin(&self) -> &PgStreamLocker {
            &self.locker
        }
    }

    pub(super) async fn fixture() -> Fixture {
        let bounced = Bounced::new(6).await;
        Fixture {
            store: PgPerspectiveStore::new(),
            events: PgEventStore::new(&bounced.db),
            locker: PgStreamLocker::new(&bounced.db, medium_options()),
            bounced,
        }
    }

    mod store {
        lockstep_testkit::perspective_store_conformance! {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            fixture: super::fixture().await,
        }
    }
}

// --- session state: refused, detected ------------------------------------------------------

/// A handle told it is behind a transaction pooler refuses every session lock, naming the
/// pooler, before it locks anything; transaction-scoped locks work on the same handle. Called
/// from spawned tasks with the concrete types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_session_locks_are_refused_naming_the_pooler() {
    let bounced = Bounced::new(4).await;
    let lock = PgDistributedLock::new(&bounced.db);
    let key = ResourceKey::new("pgbouncer:session").expect("key");
    let refusals = {
        let (lock, key) = (lock.clone(), key.clone());
        tokio::spawn(async move {
            let waited = lock
                .acquire_session(&key, Some(Duration::from_secs(1)))
                .await;
            let tried = lock.try_acquire_session(&key).await;
            (waited.map(drop), tried.map(drop))
        })
        .await
        .expect("task")
    };
    for refused in [refusals.0, refusals.1] {
        let e = refused.expect_err("a session lock behind a transaction pooler");
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        let message = e.to_string();
        assert!(
            message.contains("PgBouncer") && message.contains("pool_mode = transaction"),
            "the refusal names the pooler: {message}"
        );
    }
    let direct = bounced.direct().await;
    assert_eq!(advisory_locks(&direct).await, 0, "nothing was locked");
    let db = bounced.db.clone();
    let taken = tokio::spawn(async move {
        let tx = db.begin().await?;
        let got = lock.try_acquire_for_transaction(&tx, &key).await?;
        tx.commit().await?;
        Ok::<_, lockstep_core::Error>(got)
    })
    .await
    .expect("task")
    .expect("a transaction-scoped lock through the pooler");
    assert!(taken);
    assert_eq!(advisory_locks(&direct).await, 0, "released with the commit");
}

/// A handle not told about the pooler finds it out before its first session lock (the probe
/// sees two clients share a server backend, or one client move between two) and refuses; a
/// handle on a direct connection probes, sees none, and takes session locks as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_in_transaction_mode_is_detected_before_a_session_lock() {
    let bounced = Bounced::with(4, None).await;
    assert_eq!(bounced.db.transaction_pooler(), None, "not told");
    let lock = PgDistributedLock::new(&bounced.db);
    let key = ResourceKey::new("pgbouncer:detected").expect("key");
    let refused = {
        let (lock, key) = (lock.clone(), key.clone());
        tokio::spawn(async move { lock.try_acquire_session(&key).await.map(drop) })
            .await
            .expect("task")
    };
    let e = refused.expect_err("detected");
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.to_string().contains("PgBouncer"), "{e}");
    assert_eq!(bounced.db.transaction_pooler(), Some(true), "remembered");
    assert_eq!(advisory_locks(&bounced.direct().await).await, 0);

    // The same server, directly: no pooler seen, session locks work.
    let direct = PgDatabase::builder()
        .config(bounced.test.config().clone())
        .max_connections(4)
        .build()
        .expect("a direct handle");
    let probe = direct.clone();
    let seen = tokio::spawn(async move { probe.detect_transaction_pooler().await })
        .await
        .expect("task")
        .expect("the probe runs");
    assert!(!seen, "a direct connection is no pooler");
    assert_eq!(direct.transaction_pooler(), Some(false));
    let guard = PgDistributedLock::new(&direct)
        .try_acquire_session(&key)
        .await
        .expect("try")
        .expect("a session lock on a direct connection");
    lockstep_core::SessionLockGuard::release(guard)
        .await
        .expect("release");
}

/// A handle not told about the pooler runs its lease statements through it: a prepared
/// statement that vanished between two statements (the pooler moved the client to another
/// server connection) is recognised, the statement runs again unnamed, and the handle takes the
/// unnamed path from then on. No operation fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_untold_handle_finds_the_pooler_and_keeps_its_leases_working() {
    let bounced = Bounced::with(4, None).await;
    let locker = PgStreamLocker::new(&bounced.db, medium_options());
    let me = InstanceId::random();
    let reason = LockReason::parse("rewind").expect("reason");
    let name = perspective("Orders");
    let mut streams = Vec::new();
    for _ in 0..8 {
        let stream = StreamId::new_v7();
        create_cursor(&bounced.test, stream, &name).await;
        streams.push(stream);
    }
    let tasks: Vec<_> = streams
        .iter()
        .map(|&stream| {
            let (locker, name, reason) = (locker.clone(), name.clone(), reason.clone());
            tokio::spawn(async move {
                for _ in 0..10 {
                    let lease = match locker.try_acquire(stream, &name, me, &reason).await? {
                        AcquireOutcome::Acquired(lease) => lease,
                        other => panic!("a free row of the test's own: {other:?}"),
                    };
                    let renewed = locker.renew(&lease.id).await?;
                    assert!(
                        matches!(renewed, lockstep_core::RenewOutcome::Renewed { .. }),
                        "{renewed:?}"
                    );
                    assert_eq!(locker.release(&lease.id).await?, ReleaseOutcome::Released);
                }
                Ok::<_, lockstep_core::Error>(())
            })
        })
        .collect();
    for task in tasks {
        task.await
            .expect("task")
            .expect("every lease operation through the pooler");
    }
    assert_eq!(
        bounced.db.transaction_pooler(),
        Some(true),
        "240 statements on rotating server connections revealed the pooler"
    );
    assert!(bounced.bouncer.transactions_of(bounced.test.name()).await >= 240);
}

// --- migrate -------------------------------------------------------------------------------

/// Two migrations at once through the pooler: one transaction each under a transaction-scoped
/// lock, so the second waits, then finds the schema installed; no lock is left on any server
/// connection, and the schema is the one a direct migration installs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_migrate_runs_through_the_pooler_and_leaves_no_lock_behind() {
    let test = test_database().await;
    let bouncer = PgBouncer::for_database(&test).await;
    let first = handle(&bouncer, &test, 2, Some(true));
    let second = handle(&bouncer, &test, 2, None);
    let (a, b) = (first.clone(), second.clone());
    let (ran_a, ran_b) = tokio::join!(
        tokio::spawn(async move { a.migrate().await }),
        tokio::spawn(async move { b.migrate().await })
    );
    let ran_a = ran_a.expect("task").expect("the first migration");
    let ran_b = ran_b.expect("task").expect("the second migration");
    assert!(
        ran_a.is_empty() != ran_b.is_empty(),
        "one run applied the schema, the other found it applied: {ran_a:?} / {ran_b:?}"
    );
    let direct = test.connect().await;
    assert_eq!(advisory_locks(&direct).await, 0, "no migration lock left");
    first
        .check_schema()
        .await
        .expect("the schema this build runs on");
    let status = second
        .migration_status()
        .await
        .expect("status through the pooler");
    assert!(status.is_up_to_date(), "{status:?}");
    let again = first.migrate().await.expect("idempotent");
    assert!(again.is_empty(), "{again:?}");
    let through = test.schema_dump().await.expect("pg_dump");
    let reference = test_database().await;
    lockstep_pg::migrate(&reference.pool(1))
        .await
        .expect("a direct migration");
    assert_eq!(
        through,
        reference.schema_dump().await.expect("pg_dump"),
        "the same schema through the pooler as directly"
    );
}

// --- the worker ----------------------------------------------------------------------------

/// The perspective worker through the pooler, two instances on one database: every stream is
/// folded exactly, a late event rewinds its pair under a lease (kept alive by the keepalive's
/// statements through the pooler), and no lease is left held. Cycles run in spawned tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_worker_folds_exactly_and_rewinds_a_late_event() {
    use lockstep_worker::{PerspectiveWorker, WorkerOptions};

    let bounced = Bounced::new(8).await;
    let locker = PgStreamLocker::new(&bounced.db, medium_options());
    let worker = |locker: &PgStreamLocker| {
        let mut registry = PerspectiveRegistry::new();
        registry.register(Numbers::new()).expect("register");
        Arc::new(
            PerspectiveWorker::new(
                bounced.db.clone(),
                PgPerspectiveStore::new(),
                registry,
                WorkerOptions::default(),
                InstanceId::random(),
                Some(Arc::new(locker.clone()) as Arc<dyn StreamLocker>),
            )
            .expect("worker"),
        )
    };
    let workers = [worker(&locker), worker(&locker)];
    for w in &workers {
        w.register().await.expect("register through the pooler");
    }
    let store = PgEventStore::new(&bounced.db);
    let streams: Vec<StreamId> = (0..6).map(|_| StreamId::new_v7()).collect();
    for (i, &stream) in streams.iter().enumerate() {
        let tx = bounced.db.begin().await.expect("begin");
        let events: Vec<_> = (1..=5).map(|n| number_event(n * 10 + i as i64)).collect();
        store
            .append(&tx, stream, ExpectedVersion::Any, &events)
            .await
            .expect("append");
        tx.commit().await.expect("commit");
    }
    let drain = |workers: &[Arc<PerspectiveWorker<PgDatabase, PgPerspectiveStore>>; 2]| {
        let workers = workers.clone();
        async move {
            for _ in 0..100 {
                let cycles: Vec<_> = workers
                    .iter()
                    .map(|w| {
                        let w = Arc::clone(w);
                        tokio::spawn(async move { w.run_once().await })
                    })
                    .collect();
                let mut busy = false;
                for cycle in cycles {
                    let report = cycle.await.expect("a cycle");
                    assert!(report.errors.is_empty(), "{:?}", report.errors);
                    assert_eq!(report.failed, 0, "{:?}", report.failures);
                    busy |= report.did_work();
                }
                if !busy {
                    return;
                }
            }
            panic!("the workers did not go idle");
        }
    };
    drain(&workers).await;
    // A late event: an id older than the events applied, so the pair rewinds.
    let late_stream = streams[0];
    let tx = bounced.db.begin().await.expect("begin");
    let late = number_event(-1)
        .with_id(lockstep_tests::early_id(Duration::from_secs(3600)))
        .expect("an early id");
    store
        .append(&tx, late_stream, ExpectedVersion::Any, &[late])
        .await
        .expect("append the late event");
    tx.commit().await.expect("commit");
    drain(&workers).await;
    let direct = bounced.direct().await;
    let expected = lockstep_tests::expected_folds(&direct)
        .await
        .expect("the folds of the events stored");
    let states = lockstep_tests::perspective_states(&direct, NUMBERS)
        .await
        .expect("the states the workers wrote");
    assert_eq!(
        states, expected,
        "every stream folded exactly through the pooler"
    );
    let held: i64 = direct
        .query_one(
            "SELECT count(*) FROM wh_perspective_cursors \
             WHERE perspective_name = $1 AND stream_lock_instance_id IS NOT NULL",
            &[&NUMBERS],
        )
        .await
        .expect("cursors")
        .get(0);
    assert_eq!(held, 0, "every rewind lease released");
    let rewound: Option<i64> = direct
        .query_one(
            "SELECT max(stream_lock_epoch) FROM wh_perspective_cursors WHERE stream_id = $1",
            &[&late_stream.as_uuid()],
        )
        .await
        .expect("epoch")
        .get(0);
    assert!(
        rewound.unwrap_or(0) >= 1,
        "the late event was rewound under a lease"
    );
}

// --- the command runner and the combiner ---------------------------------------------------

mod pgbouncer_commands {
    //! The command runner in every mode (the combined mode is the combiner) and the combiner
    //! on its own, through the pooler, every command handled from a spawned task.

    use lockstep_combiner::Combiner;
    use lockstep_command::{CommandRunner, Mode, RunnerOptions};
    use lockstep_core::{AggregateType, Decider, NewEvent, RecordedEvent, RetryPolicy, Uuid};

    use super::*;

    /// A counter: every command adds one.
    pub(super) struct Counter(AggregateType);

    impl Counter {
        fn new() -> Counter {
            Counter(AggregateType::new("Counter").expect("valid"))
        }
    }

    impl Decider for Counter {
        type State = u64;
        type Command = ();
        type Event = u64;
        type Error = std::convert::Infallible;

        fn aggregate_type(&self) -> &AggregateType {
            &self.0
        }

        fn initial_state(&self, _id: Uuid) -> u64 {
            0
        }

        async fn decide(&self, _count: &u64, _cmd: &()) -> Result<Vec<u64>, Self::Error> {
            Ok(vec![1])
        }

        fn evolve(&self, count: u64, added: &u64) -> u64 {
            count + added
        }

        fn encode(&self, added: &u64) -> lockstep_core::Result<NewEvent> {
            NewEvent::new("Added", serde_json::json!({ "n": added }))
        }

        fn decode(&self, event: &RecordedEvent) -> lockstep_core::Result<u64> {
            Ok(event.payload["n"].as_u64().unwrap_or(0))
        }
    }

    const HANDLERS: u64 = 16;

    /// The stream's events as committed, read directly.
    async fn committed(bounced: &Bounced, id: Uuid) -> i64 {
        bounced
            .direct()
            .await
            .query_one(
                "SELECT count(*) FROM wh_events WHERE stream_id = $1",
                &[&id],
            )
            .await
            .expect("events")
            .get(0)
    }

    /// Sixteen handlers at once on one counter, in each mode: every answer is the state after
    /// its own command, the versions are 1..=16, and sixteen events are committed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pgbouncer_command_runner_loses_no_update_in_any_mode() {
        let bounced = Bounced::new(8).await;
        for mode in [Mode::Optimistic, Mode::Locked, Mode::Combined] {
            let patient = RetryPolicy::new(
                std::num::NonZeroU32::new(10_000).expect("non-zero"),
                Duration::from_millis(1),
                Duration::from_millis(20),
            );
            let runner = CommandRunner::with_options(
                bounced.db.clone(),
                PgEventStore::new(&bounced.db),
                Counter::new(),
                RunnerOptions::new(mode).retry(patient),
            );
            let id = Uuid::now_v7();
            let tasks: Vec<_> = (0..HANDLERS)
                .map(|_| {
                    let runner = runner.clone();
                    tokio::spawn(async move { runner.handle(id, ()).await })
                })
                .collect();
            let mut versions = Vec::new();
            for task in tasks {
                let done = task
                    .await
                    .expect("task")
                    .unwrap_or_else(|e| panic!("{mode:?} through the pooler: {e:?}"));
                assert_eq!(*done.state(), done.version(), "{mode:?}");
                versions.push(done.version());
            }
            versions.sort_unstable();
            assert_eq!(versions, (1..=HANDLERS).collect::<Vec<_>>(), "{mode:?}");
            assert_eq!(committed(&bounced, id).await, HANDLERS as i64, "{mode:?}");
        }
    }

    /// The combiner on its own: sixteen submissions at once, each answered once with versions
    /// of its own, all committed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pgbouncer_combiner_answers_every_command_once() {
        let bounced = Bounced::new(8).await;
        let combiner = Arc::new(Combiner::new(
            bounced.db.clone(),
            PgEventStore::new(&bounced.db),
            Counter::new(),
        ));
        let id = Uuid::now_v7();
        let tasks: Vec<_> = (0..HANDLERS)
            .map(|_| {
                let combiner = Arc::clone(&combiner);
                tokio::spawn(async move { combiner.submit(id, ()).await })
            })
            .collect();
        let mut versions = Vec::new();
        for task in tasks {
            let accepted = task
                .await
                .expect("task")
                .unwrap_or_else(|e| panic!("a submission through the pooler: {e:?}"));
            versions.push(accepted.last_version());
        }
        versions.sort_unstable();
        assert_eq!(versions, (1..=HANDLERS).collect::<Vec<_>>());
        assert_eq!(committed(&bounced, id).await, HANDLERS as i64);
    }
}
