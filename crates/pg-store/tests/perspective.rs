//! `PgPerspectiveStore` against a real PostgreSQL: the testkit's perspective-store conformance
//! suite (one test per case, each on a database of its own), and what only Postgres can show —
//! a registration waits for an append in flight and catches its events up, a refused claim
//! leaves the leased row to the keepalive, the store runs on a borrowed transaction.

use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;
use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{PageLimits, Pair, Release};
use std::time::Duration;

use lockstep_core::{
    AcquireOutcome, Claim, ExpectedVersion, InstanceId, LockReason, NewEvent, PerspectiveName,
    RewindDebounce, StreamId, StreamLockOptions, StreamLocker,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::conformance::perspective_store::PerspectiveStoreFixture;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};

/// The store, the event store and a stream locker (2 s leases: live through a few statements
/// on a loaded machine, expired after a 3 s wait) on a migrated database of the test's own.
struct PgFixture {
    db: TestDatabase,
    pool: deadpool_postgres::Pool,
    source: PgDatabase,
    store: PgPerspectiveStore,
    events: PgEventStore,
    locker: PgStreamLocker,
}

impl PerspectiveStoreFixture for PgFixture {
    type Tx = PgTransaction;
    type Source = PgDatabase;
    type Store = PgPerspectiveStore;
    type Events = PgEventStore;
    type Locker = PgStreamLocker;
    type Admin = PgStreamLocker;

    fn source(&self) -> &PgDatabase {
        &self.source
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

async fn fixture() -> PgFixture {
    let db = test_database().await;
    // Lease semantics, not durability, are under test.
    db.skip_wal_flush().await.expect("synchronous_commit");
    let pool = db.pool(6);
    lockstep_pg::migrate(&pool).await.expect("migrate");
    let options = StreamLockOptions::new(Duration::from_secs(2), Duration::from_millis(500))
        .expect("2 s / 500 ms is a valid pair");
    PgFixture {
        source: PgDatabase::from_pool(pool.clone()),
        store: PgPerspectiveStore::new(),
        events: PgEventStore::with_queue(lockstep_pg::LockQueue::new()),
        locker: PgStreamLocker::from_pool(pool.clone(), options),
        pool,
        db,
    }
}

mod conformance {
    use super::fixture;

    lockstep_testkit::perspective_store_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture().await,
    }
}

/// The ids of a stream's events, in event-id order, as stored.
async fn stream_event_ids(f: &PgFixture, stream: StreamId) -> Vec<uuid::Uuid> {
    f.pool
        .get()
        .await
        .expect("connection")
        .query(
            "SELECT event_id FROM wh_events WHERE stream_id = $1 ORDER BY event_id",
            &[&stream.as_uuid()],
        )
        .await
        .expect("the stream's event ids")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn name(label: &str) -> PerspectiveName {
    PerspectiveName::new(format!("{label}-{}", uuid::Uuid::new_v4().simple())).expect("name")
}

fn event(n: i64) -> NewEvent {
    NewEvent::new("Added", serde_json::json!({ "n": n })).expect("event")
}

/// A new perspective registered while an appender's transaction is open waits for it, and
/// then has work for its events: the append did not see the name, the catch-up sees the events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_waits_for_an_append_in_flight_and_catches_its_events_up() {
    let f = fixture().await;
    let stream = StreamId::new_v7();
    let appender = PgTransaction::begin(&f.pool).await.expect("begin");
    let appended = [event(1), event(2)];
    f.events
        .append(&appender, stream, ExpectedVersion::NoStream, &appended)
        .await
        .expect("append");

    let late = name("Registered");
    let registration = {
        let (pool, store, late) = (f.pool.clone(), f.store.clone(), late.clone());
        tokio::spawn(async move {
            let tx = PgTransaction::begin(&pool).await.expect("begin");
            store
                .register(&tx, std::slice::from_ref(&late))
                .await
                .expect("register");
            tx.commit().await.expect("commit");
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !registration.is_finished(),
        "a new registration waits for the open appender"
    );
    appender.commit().await.expect("commit");
    tokio::time::timeout(Duration::from_secs(10), registration)
        .await
        .expect("the registration proceeds once the appender committed")
        .expect("task");

    let tx = PgTransaction::begin(&f.pool).await.expect("begin");
    let pending = f
        .store
        .pending_events(&tx, &Pair::new(stream, late.clone()))
        .await
        .expect("pending_events");
    let ids: Vec<_> = appended.iter().map(NewEvent::event_id).collect();
    assert_eq!(pending, ids, "the in-flight append's events were caught up");
    tx.rollback().await.expect("rollback");
}

/// Retiring waits for an appender in flight (whose append already enqueued work for the
/// perspective) and then removes that work too: no work row of a retired perspective survives,
/// and appends after the retirement enqueue none. Called from a spawned task with concrete
/// types, as a handler would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retiring_waits_for_an_append_in_flight_and_leaves_none_of_its_work() {
    let f = fixture().await;
    let retired = name("RetiredInFlight");
    let tx = PgTransaction::begin(&f.pool).await.expect("begin");
    f.store
        .register(&tx, std::slice::from_ref(&retired))
        .await
        .expect("register");
    tx.commit().await.expect("commit");

    let stream = StreamId::new_v7();
    let appender = PgTransaction::begin(&f.pool).await.expect("begin");
    f.events
        .append(&appender, stream, ExpectedVersion::NoStream, &[event(1)])
        .await
        .expect("append");
    let retirement = {
        let (pool, store, retired) = (f.pool.clone(), f.store.clone(), retired.clone());
        tokio::spawn(async move {
            let tx = PgTransaction::begin(&pool).await.expect("begin");
            let outcome = store
                .retire(&tx, &retired, lockstep_core::RetireStates::Keep)
                .await
                .expect("retire");
            tx.commit().await.expect("commit");
            outcome
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !retirement.is_finished(),
        "a retirement waits for the open appender"
    );
    appender.commit().await.expect("commit");
    let outcome = tokio::time::timeout(Duration::from_secs(10), retirement)
        .await
        .expect("the retirement proceeds once the appender committed")
        .expect("task");
    assert!(matches!(outcome, lockstep_core::Retired::Retired { .. }));

    let tx = PgTransaction::begin(&f.pool).await.expect("begin");
    f.events
        .append(&tx, stream, ExpectedVersion::Any, &[event(2)])
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    let tx = PgTransaction::begin(&f.pool).await.expect("begin");
    let pending = f
        .store
        .pending_events(&tx, &Pair::new(stream, retired.clone()))
        .await
        .expect("pending_events");
    assert!(
        pending.is_empty(),
        "no work of a retired perspective: {pending:?}"
    );
    tx.rollback().await.expect("rollback");
}

/// Registering names that are already registered neither waits for appenders nor blocks them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_a_known_name_does_not_wait_for_appenders() {
    let f = fixture().await;
    let known = name("Known");
    let tx = PgTransaction::begin(&f.pool).await.expect("begin");
    f.store
        .register(&tx, std::slice::from_ref(&known))
        .await
        .expect("register");
    tx.commit().await.expect("commit");

    let appender = PgTransaction::begin(&f.pool).await.expect("begin");
    f.events
        .append(
            &appender,
            StreamId::new_v7(),
            ExpectedVersion::NoStream,
            &[event(1)],
        )
        .await
        .expect("append");
    let tx = PgTransaction::begin(&f.pool).await.expect("begin");
    tokio::time::timeout(
        Duration::from_secs(5),
        f.store.register(&tx, std::slice::from_ref(&known)),
    )
    .await
    .expect("no wait for a known name")
    .expect("register");
    tx.commit().await.expect("commit");
    appender.commit().await.expect("commit");
}

/// A claim refused because of a live lease does not lock the cursor row: the holder's renew
/// goes through while the claiming transaction is still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_refused_for_a_lease_leaves_the_row_to_the_keepalive() {
    let f = fixture().await;
    let p = name("Leased");
    let stream = StreamId::new_v7();
    let tx = PgTransaction::begin(&f.pool).await.expect("begin");
    f.store
        .ensure_cursor(&tx, &Pair::new(stream, p.clone()))
        .await
        .expect("ensure_cursor");
    tx.commit().await.expect("commit");
    let AcquireOutcome::Acquired(lease) = f
        .locker
        .try_acquire(stream, &p, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("try_acquire")
    else {
        panic!("expected to acquire");
    };

    let claiming = PgTransaction::begin(&f.pool).await.expect("begin");
    let claim = f
        .store
        .claim(
            &claiming,
            &Pair::new(stream, p.clone()),
            10,
            RewindDebounce::NONE,
        )
        .await
        .expect("claim");
    assert_eq!(claim, Claim::Busy);
    let renewed = tokio::time::timeout(Duration::from_secs(5), f.locker.renew(&lease.id))
        .await
        .expect("the renew does not wait for the claiming transaction")
        .expect("renew");
    assert!(renewed.is_renewed());
    claiming.rollback().await.expect("rollback");
}

/// A pair's claim returns its whole cursor, as a cursor read does: the failed event, the
/// backoff and the parking too, which `lockstep_perspective_claim` leaves to the statement to
/// read from the cursor row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_returns_the_pairs_failed_event_backoff_and_parking() {
    use lockstep_core::PairFailure;
    let f = fixture().await;
    let p = name("Failed");
    let stream = StreamId::new_v7();
    let pair = Pair::new(stream, p.clone());
    let tx = PgTransaction::begin(&f.pool).await.expect("begin");
    f.store
        .register(&tx, std::slice::from_ref(&p))
        .await
        .expect("register");
    f.events
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[event(1), event(2)],
        )
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    let ids = stream_event_ids(&f, stream).await;

    let tx = PgTransaction::begin(&f.pool).await.expect("begin");
    let failure = PairFailure::new("the first event failed")
        .at_event(Some(ids[0]))
        .retry_after(Duration::from_secs(3600))
        .park(true);
    let parked = f
        .store
        .record_failure(&tx, &pair, &failure)
        .await
        .expect("record_failure");
    assert!(parked);
    let read = f
        .store
        .cursor(&tx, &pair)
        .await
        .expect("cursor")
        .expect("a cursor");
    let claim = f
        .store
        .claim(&tx, &pair, 10, RewindDebounce::NONE)
        .await
        .expect("claim");
    let Claim::Apply { cursor, events, .. } = claim else {
        panic!("expected events, got {claim:?}");
    };
    assert_eq!(events.len(), 2);
    assert_eq!(cursor.failed_event_id, Some(ids[0]));
    assert!(cursor.retry_at.is_some() && cursor.parked_at.is_some());
    assert_eq!(
        (cursor.failures, cursor.error.as_deref()),
        (1, Some("the first event failed"))
    );
    assert_eq!(cursor, read);
    tx.rollback().await.expect("rollback");
}

/// The store runs on a transaction the application manages itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_runs_on_a_borrowed_tokio_postgres_transaction() {
    let f = fixture().await;
    let mut client = f.db.connect().await;
    let p = name("Borrowed");
    let stream = StreamId::new_v7();
    let tx = client.transaction().await.expect("begin");
    f.store
        .register(&tx, std::slice::from_ref(&p))
        .await
        .expect("register");
    f.events
        .append_on(&tx, stream, ExpectedVersion::NoStream, &[event(3)])
        .await
        .expect("append");
    tx.commit().await.expect("commit");

    let tx = client.transaction().await.expect("begin");
    match f
        .store
        .claim(&tx, &Pair::new(stream, p.clone()), 10, RewindDebounce::NONE)
        .await
        .expect("claim")
    {
        Claim::Apply { events, .. } => {
            assert_eq!(events.len(), 1);
            assert_eq!(events[0].payload["n"], 3);
        }
        other => panic!("expected the event, got {other:?}"),
    }
    tx.rollback().await.expect("rollback");
}

/// Issue 18's store methods the way an application calls them: from inside `tokio::spawn`
/// (a web handler, a background task), with the concrete `PgDatabase` / `PgTransaction` /
/// `PgPerspectiveStore` — generic test code would hide a future that is not `Send`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_batch_and_admin_methods_run_inside_spawned_tasks() {
    use lockstep_core::{
        BatchClaim, BatchCommitted, BatchEntry, ClaimedWork, PairFailure, StateCommit,
        TransactionSource as _,
    };
    let f = fixture().await;
    let (db, store) = (f.source.clone(), f.store.clone());
    let p = name("Spawned");
    let stream = StreamId::new_v7();
    let tx = db.begin().await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&p))
        .await
        .expect("register");
    f.events
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[event(1), event(2)],
        )
        .await
        .expect("append");
    tx.commit().await.expect("commit");

    let handler = tokio::spawn(async move {
        let tx: PgTransaction = db.begin().await.expect("begin");
        let batch = store
            .claim_batch(&tx, &BatchClaim::new(std::slice::from_ref(&p)))
            .await
            .expect("claim_batch");
        let claimed = batch.pairs.into_iter().next().expect("the pair");
        let ClaimedWork::Apply { events, .. } = claimed.work else {
            panic!("expected events");
        };
        let cursor = claimed.cursor;
        let mut commit = StateCommit::new(
            Pair::new(stream, p.clone()),
            cursor.revision,
            serde_json::json!([1]),
        );
        commit.last_event_id = Some(events[0].event_id);
        commit.applied_count = 1;
        commit.applied_events = vec![events[0].event_id];
        let failure = PairFailure::new("the second event failed")
            .at_event(Some(events[1].event_id))
            .park(true);
        let outcomes = store
            .commit_batch(
                &tx,
                &[BatchEntry::new(
                    cursor.pair.clone(),
                    Some(commit),
                    Some(failure),
                )],
            )
            .await
            .expect("commit_batch");
        assert!(matches!(
            outcomes[0],
            BatchCommitted::Committed { parked: true, .. }
        ));
        tx.commit().await.expect("commit");

        let tx = db.begin().await.expect("begin");
        let parked = store.parked_pairs(&tx, &[], 10).await.expect("parked");
        assert_eq!(parked.len(), 1);
        let failing = store.failing_pairs(&tx, &[], 10).await.expect("failing");
        assert_eq!(failing.len(), 1);
        let status = store.perspective_status(&tx).await.expect("status");
        assert!(status.iter().any(|s| s.perspective == p && s.parked == 1));
        assert!(
            store
                .unpark(&tx, &Pair::new(stream, p.clone()))
                .await
                .expect("unpark")
        );
        let failure = PairFailure::new("again").at_event(Some(events[1].event_id));
        store
            .record_failure(&tx, &Pair::new(stream, p.clone()), &failure)
            .await
            .expect("record");
        assert!(
            store
                .skip_event(
                    &tx,
                    &Pair::new(stream, p.clone()),
                    events[1].event_id,
                    "spawned"
                )
                .await
                .expect("skip")
        );
        let skipped = store
            .skipped_events(&tx, &Pair::new(stream, p.clone()))
            .await
            .expect("skipped");
        tx.commit().await.expect("commit");
        skipped.len()
    });
    assert_eq!(handler.await.expect("the spawned task"), 1);
}

/// The rewind's store methods (ADR 0012 §8) from inside `tokio::spawn` with the concrete
/// types: `load_rewind` reads the request, the snapshot and the events in one statement, and
/// `commit` with `Release::Lease` commits fenced on the lease and releases it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rewind_methods_run_inside_spawned_tasks() {
    use lockstep_core::{StateCommit, TransactionSource as _};
    let f = fixture().await;
    let (db, store, locker) = (f.source.clone(), f.store.clone(), f.locker.clone());
    let p = name("SpawnedRewind");
    let stream = StreamId::new_v7();
    let tx = db.begin().await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&p))
        .await
        .expect("register");
    f.events
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[event(1), event(2)],
        )
        .await
        .expect("append");
    assert!(
        store
            .request_rewind(&tx, &Pair::new(stream, p.clone()), None)
            .await
            .expect("request_rewind")
    );
    tx.commit().await.expect("commit");

    let handler = tokio::spawn(async move {
        let lease = match locker
            .try_acquire(stream, &p, InstanceId::random(), &LockReason::Rewind)
            .await
            .expect("try_acquire")
        {
            AcquireOutcome::Acquired(lease) => lease,
            other => panic!("expected the lease, got {other:?}"),
        };
        let tx: PgTransaction = db.begin().await.expect("begin");
        let loaded = store
            .load_rewind(&tx, &Pair::new(stream, p.clone()), PageLimits::default())
            .await
            .expect("load_rewind")
            .expect("a cursor");
        tx.rollback().await.expect("rollback");
        let trigger = loaded.cursor.rewind.expect("the request").trigger;
        assert!(loaded.snapshot.is_none());
        assert_eq!(loaded.events.len(), 2);
        let mut commit = StateCommit::new(
            Pair::new(stream, p.clone()),
            loaded.cursor.revision,
            serde_json::json!([1, 2]),
        );
        commit.last_event_id = loaded.events.last().map(|e| e.event_id);
        commit.applied_count = 2;
        commit.applied_events = loaded.events.iter().map(|e| e.event_id).collect();
        commit.rewound_from = Some(trigger);
        commit.snapshot = true;
        commit.fence = Some(lease.id.clone());
        let tx: PgTransaction = db.begin().await.expect("begin");
        let committed = store
            .commit(tx, &commit, Release::Lease)
            .await
            .expect("commit");
        let (revision, released) = (committed.revision, committed.released);
        let renewed = locker.renew(&lease.id).await.expect("renew");
        (revision, released, renewed.is_renewed())
    });
    let (revision, released, renewed) = handler.await.expect("the spawned task");
    assert!(revision > 0);
    assert!(released, "Postgres releases the lease with the commit");
    assert!(!renewed, "the released lease cannot be renewed");
}

/// `commit` with `Release::Lease` from inside `tokio::spawn` with the concrete types, as the
/// worker calls it: the fenced commit sent with the `COMMIT` on the read's
/// transaction commits the state and releases the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fenced_commit_with_the_commit_runs_inside_a_spawned_task() {
    use lockstep_core::{StateCommit, TransactionSource as _};
    let f = fixture().await;
    let (db, store, locker) = (f.source.clone(), f.store.clone(), f.locker.clone());
    let p = name("SpawnedCommitAndEnd");
    let stream = StreamId::new_v7();
    let tx = db.begin().await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&p))
        .await
        .expect("register");
    f.events
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[event(1), event(2)],
        )
        .await
        .expect("append");
    assert!(
        store
            .request_rewind(&tx, &Pair::new(stream, p.clone()), None)
            .await
            .expect("request_rewind")
    );
    tx.commit().await.expect("commit");

    let (db2, store2, p2) = (db.clone(), store.clone(), p.clone());
    let handler = tokio::spawn(async move {
        let lease = match locker
            .try_acquire(stream, &p2, InstanceId::random(), &LockReason::Rewind)
            .await
            .expect("try_acquire")
        {
            AcquireOutcome::Acquired(lease) => lease,
            other => panic!("expected the lease, got {other:?}"),
        };
        let tx: PgTransaction = db2.begin().await.expect("begin");
        let loaded = store2
            .load_rewind(&tx, &Pair::new(stream, p2.clone()), PageLimits::default())
            .await
            .expect("load_rewind")
            .expect("a cursor");
        let mut commit = StateCommit::new(
            Pair::new(stream, p2.clone()),
            loaded.cursor.revision,
            serde_json::json!([1, 2]),
        );
        commit.last_event_id = loaded.events.last().map(|e| e.event_id);
        commit.applied_count = 2;
        commit.applied_events = loaded.events.iter().map(|e| e.event_id).collect();
        commit.rewound_from = loaded.cursor.rewind.map(|r| r.trigger);
        commit.snapshot = true;
        commit.fence = Some(lease.id.clone());
        let committed = store2
            .commit(tx, &commit, Release::Lease)
            .await
            .expect("commit");
        let (revision, released) = (committed.revision, committed.released);
        (revision, released, loaded.cursor.revision)
    });
    let (revision, released, before) = handler.await.expect("the spawned task");
    assert_eq!(revision, before + 1);
    assert!(released, "Postgres releases the lease with the commit");
    let tx = db.begin().await.expect("begin");
    let (cursor, state) = store
        .state(&tx, &Pair::new(stream, p))
        .await
        .expect("state")
        .expect("a cursor");
    tx.rollback().await.expect("rollback");
    assert_eq!(state, Some(serde_json::json!([1, 2])));
    assert!(cursor.rewind.is_none(), "the request is cleared");
    assert!(cursor.lease.is_unlocked(), "the lease is released");
}

/// The operator's argument checks (`lockstep perspectives …`, ADR 0020's leftover): whether a
/// name is registered and which stream an event belongs to, from a spawned task with the
/// concrete types, on the owned transaction and on a borrowed `tokio_postgres` one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_argument_checks_run_inside_spawned_tasks() {
    use lockstep_core::TransactionSource as _;
    let f = fixture().await;
    let (db, store, events) = (f.source.clone(), f.store.clone(), f.events.clone());
    let p = name("Checked");
    let unknown = name("NeverRegistered");
    let stream = StreamId::new_v7();
    let tx = db.begin().await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&p))
        .await
        .expect("register");
    f.events
        .append(&tx, stream, ExpectedVersion::NoStream, &[event(1)])
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    let first = stream_event_ids(&f, stream).await[0];
    let pool = f.pool.clone();
    let answers = tokio::spawn(async move {
        let tx: PgTransaction = db.begin().await.expect("begin");
        let answers = (
            store.is_registered(&tx, &p).await.expect("is_registered"),
            store
                .is_registered(&tx, &unknown)
                .await
                .expect("is_registered"),
            events
                .stream_of_event(&tx, first)
                .await
                .expect("stream_of_event"),
            events
                .stream_of_event(&tx, uuid::Uuid::new_v4())
                .await
                .expect("stream_of_event"),
        );
        tx.rollback().await.expect("rollback");
        // The same on a transaction the application manages.
        let mut conn = pool.get().await.expect("connection");
        let own = conn.transaction().await.expect("begin");
        let borrowed = (
            store.is_registered(&own, &p).await.expect("is_registered"),
            events
                .stream_of_event(&own, first)
                .await
                .expect("stream_of_event"),
        );
        own.rollback().await.expect("rollback");
        (answers, borrowed)
    });
    let ((known, not_known, of_first, of_nothing), borrowed) =
        answers.await.expect("the spawned task");
    assert!(known);
    assert!(!not_known);
    assert_eq!(of_first, Some(stream));
    assert_eq!(of_nothing, None);
    assert_eq!(borrowed, (true, Some(stream)));
}

/// Appends `len` numbered events to a new `stream` in a transaction of its own.
async fn append_numbered(f: &PgFixture, stream: StreamId, len: usize) {
    use lockstep_core::TransactionSource as _;
    let events: Vec<NewEvent> = (0..len).map(|n| event(n as i64)).collect();
    let tx = f.source.begin().await.expect("begin");
    f.events
        .append(&tx, stream, ExpectedVersion::NoStream, &events)
        .await
        .expect("append");
    tx.commit().await.expect("commit");
}

/// Claims and commits the pair's events `ids[done..upto]` (its state an empty list), with a
/// snapshot or not, in a transaction of its own.
async fn apply_range(
    f: &PgFixture,
    pair: &Pair,
    ids: &[uuid::Uuid],
    done: usize,
    upto: usize,
    snapshot: bool,
) {
    use lockstep_core::{StateCommit, TransactionSource as _};
    let tx = f.source.begin().await.expect("begin");
    let cursor = match f
        .store
        .claim(&tx, pair, upto - done, RewindDebounce::NONE)
        .await
        .expect("claim")
    {
        Claim::Apply { cursor, .. } => cursor,
        other => panic!("expected work, got {other:?}"),
    };
    let mut commit = StateCommit::new(pair.clone(), cursor.revision, serde_json::json!([]));
    commit.last_event_id = Some(ids[upto - 1]);
    commit.applied_count = upto as u64;
    commit.applied_events = ids[done..upto].to_vec();
    commit.snapshot = snapshot;
    f.store
        .commit(tx, &commit, Release::Keep)
        .await
        .expect("commit");
}

/// A rewind's whole read on `tx`: the first read, then every next page (`page` each): what
/// the first read loaded, every event id in order, and each page's length.
async fn read_every_page(
    store: &PgPerspectiveStore,
    tx: &PgTransaction,
    pair: &Pair,
    page: PageLimits,
) -> (lockstep_core::RewindLoad, Vec<uuid::Uuid>, Vec<usize>) {
    let loaded = store
        .load_rewind(tx, pair, page)
        .await
        .expect("load_rewind")
        .expect("a cursor");
    let mut got: Vec<uuid::Uuid> = loaded.events.iter().map(|e| e.event_id).collect();
    let (mut more, mut pages) = (loaded.more, vec![loaded.events.len()]);
    while more {
        let next = store
            .rewind_events(tx, pair, got.last().copied(), page)
            .await
            .expect("rewind_events");
        got.extend(next.events.iter().map(|e| e.event_id));
        pages.push(next.events.len());
        more = next.more;
    }
    (loaded, got, pages)
}

/// A rewind's read on both sides of 1 000 events (the worker's short-replay bound, ADR 0023;
/// and the bound of the cached-plan read tried and not taken in ADR 0025, whose two fallbacks
/// these cases covered): with and without a snapshot, with events applied since the snapshot
/// or not, every event after the snapshot comes once, in event-id order, in pages of 1 000 with
/// no empty page after a full one — from a spawned task with the concrete types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewind_reads_every_event_on_both_sides_of_a_thousand() {
    use lockstep_core::TransactionSource as _;
    let f = fixture().await;
    let (db, store) = (f.source.clone(), f.store.clone());
    let p = name("LongRewind");
    let tx = db.begin().await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&p))
        .await
        .expect("register");
    tx.commit().await.expect("commit");
    // (events in the stream, events applied up to the snapshot, events applied in all)
    let cases = [
        (1_000, 0, 0),
        (1_002, 0, 0),
        (1_002, 2, 2),
        (1_004, 2, 2),
        (1_002, 2, 1_002),
        (1_003, 2, 1_003),
    ];
    for (len, snapshot_at, applied) in cases {
        let stream = StreamId::new_v7();
        append_numbered(&f, stream, len).await;
        let ids = stream_event_ids(&f, stream).await;
        let pair = Pair::new(stream, p.clone());
        // Apply the first events with a snapshot, then the rest of `applied` without one.
        let mut done = 0;
        for (upto, snapshot) in [(snapshot_at, true), (applied, false)] {
            if upto <= done {
                continue;
            }
            apply_range(&f, &pair, &ids, done, upto, snapshot).await;
            done = upto;
        }
        let tx = db.begin().await.expect("begin");
        let from = (snapshot_at > 0).then(|| ids[snapshot_at]);
        assert!(
            store
                .request_rewind(&tx, &pair, from)
                .await
                .expect("request_rewind")
        );
        tx.commit().await.expect("commit");
        let (db2, store2, pair2) = (db.clone(), store.clone(), pair.clone());
        // The first page, then the next ones, in pages of 1 000 events.
        let (loaded, got, pages) = tokio::spawn(async move {
            let tx: PgTransaction = db2.begin().await.expect("begin");
            let page = PageLimits::new(1_000, 1 << 24).expect("page limits");
            let read = read_every_page(&store2, &tx, &pair2, page).await;
            tx.rollback().await.expect("rollback");
            read
        })
        .await
        .expect("the spawned task");
        let want = &ids[snapshot_at..];
        let full = want.len() / 1_000;
        let mut expected_pages = vec![1_000; full];
        if want.len() % 1_000 > 0 || want.is_empty() {
            expected_pages.push(want.len() % 1_000);
        }
        assert_eq!(
            pages, expected_pages,
            "{len} events, snapshot after {snapshot_at}"
        );
        assert_eq!(
            got.len(),
            want.len(),
            "{len} events, snapshot after {snapshot_at}"
        );
        assert_eq!(got, want, "{len} events, snapshot after {snapshot_at}");
        assert_eq!(
            loaded.snapshot.map(|s| s.applied_count),
            (snapshot_at > 0).then_some(snapshot_at as u64)
        );
        assert!(loaded.cursor.rewind.is_some());
    }
}

/// Entries of `wh_events`' indexes read so far by the transaction `tx` (`idx_tup_read` of its
/// own counts, not flushed yet: no other backend's can arrive in them).
async fn wh_events_index_reads(tx: &PgTransaction) -> i64 {
    tx.client()
        .query_one(
            "SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(i.indexrelid)), 0)::bigint \
               FROM pg_index i WHERE i.indrelid = 'wh_events'::regclass",
            &[],
        )
        .await
        .expect("index reads")
        .get(0)
}

/// A rewind's first read and its next pages walk the stream's own events from the snapshot on,
/// whatever the statistics say (ADR 0033). Two streams of 2 000 events, the second appended
/// after the first, analysed: as plain statements planned with the statistics, the reads took
/// the primary key from the snapshot's event with a filter on the stream, and read every later
/// event of the other stream too. Counted in the server's statistics of the reading
/// transaction (entries of `wh_events`' indexes read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewind_reads_only_its_own_streams_events_whatever_the_statistics() {
    use lockstep_core::TransactionSource as _;
    const LEN: usize = 2_000;
    const SNAPSHOT_AT: usize = 1_900;
    let f = fixture().await;
    let db = f.source.clone();
    let store = f.store.clone();
    let p = name("OwnRange");
    let (stream, other) = (StreamId::new_v7(), StreamId::new_v7());
    let tx = db.begin().await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&p))
        .await
        .expect("register");
    tx.commit().await.expect("commit");
    for s in [stream, other] {
        append_numbered(&f, s, LEN).await;
    }
    let ids = stream_event_ids(&f, stream).await;
    let pair = Pair::new(stream, p.clone());
    // Applied up to a snapshot 100 events before the end, then a rewind from after it.
    apply_range(&f, &pair, &ids, 0, SNAPSHOT_AT, true).await;
    let tx = db.begin().await.expect("begin");
    assert!(
        store
            .request_rewind(&tx, &pair, Some(ids[SNAPSHOT_AT + 50]))
            .await
            .expect("request_rewind")
    );
    tx.commit().await.expect("commit");
    let tx = db.begin().await.expect("begin");
    tx.client()
        .batch_execute("ANALYZE wh_events")
        .await
        .expect("analyze");
    tx.commit().await.expect("commit");

    // One page that reaches the stream's end, then pages of 60: the last of them too.
    for (page_events, want_pages) in [(1_000, 1), (60, 2)] {
        let (db2, store2, pair2) = (db.clone(), store.clone(), pair.clone());
        let (got, pages, read) = tokio::spawn(async move {
            let tx: PgTransaction = db2.begin().await.expect("begin");
            let before = wh_events_index_reads(&tx).await;
            let page = PageLimits::new(page_events, 1 << 24).expect("page limits");
            let (loaded, got, pages) = read_every_page(&store2, &tx, &pair2, page).await;
            assert_eq!(
                loaded.snapshot.map(|s| s.applied_count),
                Some(SNAPSHOT_AT as u64)
            );
            let pages = pages.len();
            let read = wh_events_index_reads(&tx).await - before;
            tx.rollback().await.expect("rollback");
            (got, pages, read)
        })
        .await
        .expect("the spawned task");

        assert_eq!(
            got,
            ids[SNAPSHOT_AT..],
            "the events after the snapshot, once each"
        );
        assert_eq!(pages, want_pages, "pages of {page_events}");
        // Each read may take one entry past its page or its stream's end.
        let tail = (LEN - SNAPSHOT_AT) as i64;
        assert!(
            read <= tail + 4,
            "pages of {page_events}: the reads walked {read} index entries of wh_events for \
             {tail} events of their own stream (the other stream has {LEN} after them)"
        );
    }
}

/// The byte bound as the store counts it (each payload's decoded size, `payload_bytes`),
/// inside a batch: the pair whose event does not fit hands out the events before it and ends the batch;
/// a later pair whose first event does not fit is not claimed and the scan's position stays
/// before it; the batch's first event goes whatever its size, alone. The sizes come from the
/// server, so each bound sits one byte short of the next event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_stops_at_its_byte_bound_where_postgres_counts_it() {
    use lockstep_core::{BatchClaim, ClaimedBatch, ClaimedWork};
    let f = fixture().await;
    let p = name("Bytes");
    let mut streams: Vec<StreamId> = (0..3).map(|_| StreamId::new_v7()).collect();
    streams.sort_by_key(|s| s.as_uuid());
    let tx = PgTransaction::begin(&f.pool).await.expect("begin");
    f.store
        .register(&tx, std::slice::from_ref(&p))
        .await
        .expect("register");
    for (s, stream) in streams.iter().enumerate() {
        // About a kilobyte each, below the size at which Postgres compresses a value.
        let events: Vec<NewEvent> = (0..4)
            .map(|n| {
                let body = format!("{s}{n}{}", "x".repeat(900 + 10 * n));
                NewEvent::new("Padded", serde_json::json!({ "body": body })).expect("event")
            })
            .collect();
        f.events
            .append(&tx, *stream, ExpectedVersion::NoStream, &events)
            .await
            .expect("append");
    }
    tx.commit().await.expect("commit");

    let client = f.pool.get().await.expect("client");
    let size_of = |rows: &[tokio_postgres::Row], stream: StreamId| -> Vec<(uuid::Uuid, u64)> {
        rows.iter()
            .filter(|r| r.get::<_, uuid::Uuid>(0) == stream.as_uuid())
            .map(|r| (r.get(1), u64::try_from(r.get::<_, i64>(2)).expect("size")))
            .collect()
    };
    let rows = client
        .query(
            "SELECT stream_id, event_id, payload_bytes FROM wh_events ORDER BY event_id",
            &[],
        )
        .await
        .expect("sizes");
    let (s0, s1) = (size_of(&rows, streams[0]), size_of(&rows, streams[1]));
    assert_eq!((s0.len(), s1.len()), (4, 4));
    let all_of_s0: u64 = s0.iter().map(|(_, n)| n).sum();

    let claim = |bytes: u64| {
        let (pool, store, p) = (f.pool.clone(), f.store.clone(), p.clone());
        async move {
            let mut request = BatchClaim::new(std::slice::from_ref(&p));
            request.limits.bytes = bytes;
            let tx = PgTransaction::begin(&pool).await.expect("begin");
            let batch: ClaimedBatch = store.claim_batch(&tx, &request).await.expect("claim");
            tx.rollback().await.expect("rollback");
            let pairs: Vec<(StreamId, Vec<uuid::Uuid>)> = batch
                .pairs
                .iter()
                .map(|pair| match &pair.work {
                    ClaimedWork::Apply { events, .. } => (
                        pair.cursor.pair.stream_id,
                        events.iter().map(|e| e.event_id).collect(),
                    ),
                    other => panic!("expected events, got {other:?}"),
                })
                .collect();
            (pairs, batch.positions[0].1)
        }
    };
    let ids = |sizes: &[(uuid::Uuid, u64)], n: usize| -> Vec<uuid::Uuid> {
        sizes[..n].iter().map(|(id, _)| *id).collect()
    };

    // Inside the second pair: its first two events fit, its third is one byte too large.
    let bytes = all_of_s0 + s1[0].1 + s1[1].1 + s1[2].1 - 1;
    let (pairs, position) = claim(bytes).await;
    assert_eq!(
        pairs,
        vec![(streams[0], ids(&s0, 4)), (streams[1], ids(&s1, 2))],
        "all of the first pair, the second up to the event that does not fit"
    );
    assert_eq!(position, Some(streams[1]));

    // Exactly to the byte: the third event of the second pair fits too.
    let (pairs, _) = claim(bytes + 1).await;
    assert_eq!(pairs[1], (streams[1], ids(&s1, 3)));

    // Before the second pair: its first event does not fit, so it is not claimed and the next
    // claim starts with it (the position stays on the first pair).
    let (pairs, position) = claim(all_of_s0 + s1[0].1 - 1).await;
    assert_eq!(pairs, vec![(streams[0], ids(&s0, 4))]);
    assert_eq!(position, Some(streams[0]));

    // Smaller than the first event: that event goes, alone.
    let (pairs, position) = claim(s0[0].1 - 1).await;
    assert_eq!(pairs, vec![(streams[0], ids(&s0, 1))]);
    assert_eq!(position, Some(streams[0]));
}

/// A pair's state counts against the batch's byte bound at its decoded size, not as Postgres
/// stores it: a state of a megabyte of one repeated character (a few kilobytes compressed)
/// leaves a 512 KiB bound no room beyond the batch's first event, which goes whatever its
/// size, so that the pair makes progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_counts_a_compressible_state_at_its_decoded_size() {
    use lockstep_core::{BatchClaim, ClaimedWork, StateCommit, TransactionSource as _};
    let f = fixture().await;
    let p = name("CompressibleState");
    let stream = StreamId::new_v7();
    let tx = f.source.begin().await.expect("begin");
    f.store
        .register(&tx, std::slice::from_ref(&p))
        .await
        .expect("register");
    tx.commit().await.expect("commit");
    append_numbered(&f, stream, 3).await;
    let pair = Pair::new(stream, p.clone());
    let ids = stream_event_ids(&f, stream).await;

    let tx = f.source.begin().await.expect("begin");
    let Claim::Apply { cursor, .. } = f
        .store
        .claim(&tx, &pair, 1, RewindDebounce::NONE)
        .await
        .expect("claim")
    else {
        panic!("expected work");
    };
    let big = serde_json::json!({ "body": "s".repeat(1 << 20) });
    let mut commit = StateCommit::new(Pair::new(stream, p.clone()), cursor.revision, big);
    commit.last_event_id = Some(ids[0]);
    commit.applied_count = 1;
    commit.applied_events = vec![ids[0]];
    f.store
        .commit(tx, &commit, Release::Keep)
        .await
        .expect("commit");
    let stored: i32 = f
        .pool
        .get()
        .await
        .expect("client")
        .query_one(
            "SELECT pg_column_size(state) FROM wh_perspective_states WHERE perspective_name = $1",
            &[&p.as_str()],
        )
        .await
        .expect("the state's stored size")
        .get(0);
    assert!(
        stored < 64 * 1024,
        "Postgres compresses the state: {stored} bytes"
    );

    let mut request = BatchClaim::new(std::slice::from_ref(&p));
    request.limits.bytes = 512 * 1024;
    let tx = f.source.begin().await.expect("begin");
    let batch = f.store.claim_batch(&tx, &request).await.expect("claim");
    tx.rollback().await.expect("rollback");
    let events: Vec<Vec<uuid::Uuid>> = batch
        .pairs
        .iter()
        .map(|pair| match &pair.work {
            ClaimedWork::Apply { events, .. } => events.iter().map(|e| e.event_id).collect(),
            other => panic!("expected events, got {other:?}"),
        })
        .collect();
    assert_eq!(
        events,
        vec![vec![ids[1]]],
        "the megabyte state leaves room for no event but the batch's first"
    );
}

/// Waits until the server shows a backend running `statement_part` waiting — for a lock, or
/// in the poll of a registration that does not queue (`PgSleep`) — and returns its wait event.
async fn waiting_backend(f: &PgFixture, statement_part: &str) -> (String, String) {
    let client = f.pool.get().await.expect("client");
    let pattern = format!("%{statement_part}%");
    loop {
        let row = client
            .query_opt(
                "SELECT wait_event_type, wait_event FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid() \
                   AND query LIKE $1 AND state = 'active' \
                   AND (wait_event_type = 'Lock' OR wait_event = 'PgSleep')",
                &[&pattern],
            )
            .await
            .expect("pg_stat_activity");
        if let Some(row) = row {
            return (row.get(0), row.get(1));
        }
        tokio::task::yield_now().await;
    }
}

/// An append left open does not turn a registration into a write outage: while a new
/// perspective's registration waits for that append, another append goes through, with a lock
/// wait bound that fails if it queued behind the registration; once the open append commits,
/// the registration completes and has work for both appends' events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_waiting_for_an_open_append_holds_no_other_append_back() {
    use lockstep_core::TransactionSource as _;
    let f = fixture().await;
    let (first, third) = (StreamId::new_v7(), StreamId::new_v7());
    let open = f.source.begin().await.expect("begin");
    f.events
        .append(&open, first, ExpectedVersion::NoStream, &[event(1)])
        .await
        .expect("append");

    let late = name("RegisteredBesideAppends");
    let registration = {
        let (db, late) = (f.source.clone(), late.clone());
        let store = PgPerspectiveStore::new()
            .with_registration_wait(Duration::from_millis(50), Duration::from_secs(600))
            .expect("wait bounds");
        tokio::spawn(async move {
            let tx = db.begin().await.expect("begin");
            store.register(&tx, std::slice::from_ref(&late)).await?;
            tx.commit().await
        })
    };
    let (kind, what) = waiting_backend(&f, "lockstep_register_perspectives").await;

    let tx = f.source.begin().await.expect("begin");
    tx.client()
        .batch_execute("SET LOCAL lock_timeout = '5s'")
        .await
        .expect("lock_timeout");
    f.events
        .append(&tx, third, ExpectedVersion::NoStream, &[event(3)])
        .await
        .unwrap_or_else(|e| {
            panic!("an append while the registration waits ({kind}/{what}) must not queue: {e}")
        });
    tx.commit().await.expect("commit");
    assert!(
        !registration.is_finished(),
        "the registration still waits for the open append"
    );

    open.commit().await.expect("commit");
    registration
        .await
        .expect("task")
        .expect("the registration completes once the open append ended");
    let tx = f.source.begin().await.expect("begin");
    for stream in [first, third] {
        let pending = f
            .store
            .pending_events(&tx, &Pair::new(stream, late.clone()))
            .await
            .expect("pending_events");
        assert_eq!(pending.len(), 1, "work for the event of {stream}");
    }
    tx.rollback().await.expect("rollback");
}

/// A registration or retirement that waited its bound for an append left open gives up with a
/// retryable `LockTimeout` that names the append's backend and since when it is open, and
/// changes nothing; with the append ended, the same call goes through. Run from spawned tasks
/// with the concrete types, as a worker's start and the operator's CLI run them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_or_retirement_that_gives_up_names_the_open_append_and_changes_nothing() {
    use lockstep_core::{ErrorKind, RetireStates, TransactionSource as _};
    let f = fixture().await;
    let kept = name("KeptRegistered");
    let tx = f.source.begin().await.expect("begin");
    f.store
        .register(&tx, std::slice::from_ref(&kept))
        .await
        .expect("register");
    tx.commit().await.expect("commit");

    let open = f.source.begin().await.expect("begin");
    f.events
        .append(
            &open,
            StreamId::new_v7(),
            ExpectedVersion::NoStream,
            &[event(1)],
        )
        .await
        .expect("append");
    let pid: i32 = open
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    let impatient = PgPerspectiveStore::new()
        .with_registration_wait(Duration::from_millis(20), Duration::ZERO)
        .expect("wait bounds");
    let new = name("NotYetRegistered");
    let attempt = |retire: bool| {
        let (db, store, new, kept) = (
            f.source.clone(),
            impatient.clone(),
            new.clone(),
            kept.clone(),
        );
        tokio::spawn(async move {
            let tx = db.begin().await.expect("begin");
            let outcome = if retire {
                store
                    .retire(&tx, &kept, RetireStates::Drop)
                    .await
                    .map(|_| ())
            } else {
                store.register(&tx, std::slice::from_ref(&new)).await
            };
            match outcome {
                Ok(()) => tx.commit().await,
                Err(err) => {
                    tx.rollback().await.expect("rollback");
                    Err(err)
                }
            }
        })
    };
    for retire in [false, true] {
        let err = attempt(retire)
            .await
            .expect("task")
            .expect_err("the open append holds it back");
        assert_eq!(err.kind(), ErrorKind::LockTimeout, "{err}");
        assert!(err.kind().is_retryable());
        let message = err.to_string();
        assert!(
            message.contains("open since") && message.contains(&format!("pid {pid}")),
            "names the open append: {message}"
        );
    }
    let tx = f.source.begin().await.expect("begin");
    assert!(!f.store.is_registered(&tx, &new).await.expect("registered"));
    assert!(f.store.is_registered(&tx, &kept).await.expect("registered"));
    tx.rollback().await.expect("rollback");

    open.commit().await.expect("commit");
    attempt(false).await.expect("task").expect("register");
    attempt(true).await.expect("task").expect("retire");
    let tx = f.source.begin().await.expect("begin");
    assert!(f.store.is_registered(&tx, &new).await.expect("registered"));
    assert!(!f.store.is_registered(&tx, &kept).await.expect("registered"));
    tx.rollback().await.expect("rollback");
}

#[test]
fn registration_wait_bounds_above_an_hour_are_invalid_input() {
    let hour = Duration::from_secs(3600);
    assert!(
        PgPerspectiveStore::new()
            .with_registration_wait(hour, hour)
            .is_ok()
    );
    for (queue, give_up) in [(hour + Duration::from_micros(1), hour), (hour, hour * 2)] {
        assert_eq!(
            PgPerspectiveStore::new()
                .with_registration_wait(queue, give_up)
                .expect_err("above an hour")
                .kind(),
            lockstep_core::ErrorKind::InvalidInput
        );
    }
}

/// What a worker holds while an operator retires its perspective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeldByWorker {
    /// A batch that claimed the middle stream's pair and has not committed yet.
    ClaimedBatch,
    /// A fenced transaction (as a table perspective's rewind runs it) holding the middle
    /// stream's cursor row, its state change still to come.
    FencedRewind,
}

/// Three streams of a perspective, in stream order, each with an applied event (a state); the
/// middle one with two more events queued. Returns the streams and the middle one's event ids.
async fn three_applied_streams(f: &PgFixture, p: &PerspectiveName) -> Vec<StreamId> {
    use lockstep_core::TransactionSource as _;
    let tx = f.source.begin().await.expect("begin");
    f.store
        .register(&tx, std::slice::from_ref(p))
        .await
        .expect("register");
    tx.commit().await.expect("commit");
    let mut streams: Vec<StreamId> = (0..3).map(|_| StreamId::new_v7()).collect();
    streams.sort_by_key(|s| s.as_uuid());
    for stream in &streams {
        append_numbered(f, *stream, 1).await;
        let ids = stream_event_ids(f, *stream).await;
        apply_range(f, &Pair::new(*stream, p.clone()), &ids, 0, 1, false).await;
    }
    let tx = f.source.begin().await.expect("begin");
    f.events
        .append(&tx, streams[1], ExpectedVersion::Any, &[event(2), event(3)])
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    streams
}

/// A retirement while a worker holds a pair (`held`): the retirement waits for the worker (the
/// server shows it waiting for a lock), the worker's state change then commits, and so does the
/// retirement — neither is a deadlock victim — and the end state is the retirement's.
async fn retire_beside_a_worker(held: HeldByWorker, states: lockstep_core::RetireStates) {
    use lockstep_core::{
        BatchClaim, BatchCommitted, BatchEntry, ClaimedWork, LeaseFence as _, RetireStates,
        Retired, StateCommit, TransactionSource as _,
    };
    let f = fixture().await;
    let p = name("RetiredBesideAWorker");
    let streams = three_applied_streams(&f, &p).await;
    let middle = Pair::new(streams[1], p.clone());
    let lease = if held == HeldByWorker::FencedRewind {
        let tx = f.source.begin().await.expect("begin");
        assert!(
            f.store
                .request_rewind(&tx, &middle, None)
                .await
                .expect("request_rewind")
        );
        tx.commit().await.expect("commit");
        match f
            .locker
            .try_acquire(streams[1], &p, InstanceId::random(), &LockReason::Rewind)
            .await
            .expect("try_acquire")
        {
            AcquireOutcome::Acquired(lease) => Some(lease),
            other => panic!("expected the lease, got {other:?}"),
        }
    } else {
        None
    };

    // The worker's transaction, holding the middle pair's cursor row.
    let worker = f.source.begin().await.expect("begin");
    let (cursor, events) = match &lease {
        None => {
            let batch = f
                .store
                .claim_batch(&worker, &BatchClaim::new(std::slice::from_ref(&p)))
                .await
                .expect("claim_batch");
            assert_eq!(batch.pairs.len(), 1, "the middle pair alone has work");
            let claimed = batch.pairs.into_iter().next().expect("a pair");
            let ClaimedWork::Apply { events, .. } = claimed.work else {
                panic!("expected events");
            };
            (claimed.cursor, events)
        }
        Some(lease) => {
            f.locker
                .check_lease(&worker, &lease.id)
                .await
                .expect("the fence");
            let loaded = f
                .store
                .load_rewind(&worker, &middle, PageLimits::default())
                .await
                .expect("load_rewind")
                .expect("a cursor");
            (loaded.cursor, loaded.events)
        }
    };

    let mut retirement = {
        let (db, store, p) = (f.source.clone(), f.store.clone(), p.clone());
        tokio::spawn(async move {
            let tx = db.begin().await.expect("begin");
            let outcome = store.retire(&tx, &p, states).await?;
            tx.commit().await?;
            Ok::<_, lockstep_core::Error>(outcome)
        })
    };
    let (kind, _) = tokio::select! {
        waiting = waiting_backend(&f, "lockstep_retire_perspective") => waiting,
        finished = &mut retirement => panic!(
            "the retirement did not wait for the worker's transaction: {finished:?}"
        ),
    };
    assert_eq!(kind, "Lock", "the retirement waits for the worker's rows");

    let mut commit = StateCommit::new(
        Pair::new(streams[1], p.clone()),
        cursor.revision,
        serde_json::json!({ "applied": events.len() }),
    );
    commit.last_event_id = events.last().map(|e| e.event_id);
    commit.applied_count = cursor.applied_count + events.len() as u64;
    commit.applied_events = events.iter().map(|e| e.event_id).collect();
    match &lease {
        None => {
            let outcomes = f
                .store
                .commit_batch(
                    &worker,
                    &[BatchEntry::new(middle.clone(), Some(commit), None)],
                )
                .await
                .expect("the batch's commit is no deadlock victim");
            assert!(matches!(outcomes[0], BatchCommitted::Committed { .. }));
            worker
                .commit()
                .await
                .expect("the worker's transaction commits");
        }
        Some(lease) => {
            commit.applied_count = events.len() as u64;
            commit.rewound_from = cursor.rewind.map(|r| r.trigger);
            commit.fence = Some(lease.id.clone());
            f.store
                .commit(worker, &commit, Release::Lease)
                .await
                .expect("the fenced commit is no deadlock victim, and commits");
        }
    }
    let outcome = retirement
        .await
        .expect("task")
        .expect("the retirement is no deadlock victim");
    assert_eq!(
        outcome,
        Retired::Retired {
            work_removed: 0,
            pairs: 3
        },
        "the worker's work was committed before the retirement deleted any"
    );

    let client = f.pool.get().await.expect("client");
    let count = |table: &'static str| {
        let client = &client;
        let p = p.clone();
        async move {
            client
                .query_one(
                    &format!("SELECT count(*) FROM {table} WHERE perspective_name = $1"),
                    &[&p.as_str()],
                )
                .await
                .expect("count")
                .get::<_, i64>(0)
        }
    };
    let left = (
        count("wh_perspective_cursors").await,
        count("wh_perspective_states").await,
        count("wh_perspective_events").await,
    );
    match states {
        RetireStates::Drop => assert_eq!(left, (0, 0, 0), "cursors, states, work"),
        RetireStates::Keep => {
            assert_eq!(left, (3, 3, 0), "cursors, states, work");
            let tx = f.source.begin().await.expect("begin");
            let (cursor, state) = f
                .store
                .state(&tx, &middle)
                .await
                .expect("state")
                .expect("a cursor");
            tx.rollback().await.expect("rollback");
            assert_eq!(state, Some(serde_json::json!({ "applied": events.len() })));
            assert_eq!(cursor.last_event_id, events.last().map(|e| e.event_id));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retiring_with_dropped_states_beside_a_claimed_batch_waits_for_it_without_deadlock() {
    retire_beside_a_worker(
        HeldByWorker::ClaimedBatch,
        lockstep_core::RetireStates::Drop,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retiring_with_kept_states_beside_a_claimed_batch_waits_for_it_without_deadlock() {
    retire_beside_a_worker(
        HeldByWorker::ClaimedBatch,
        lockstep_core::RetireStates::Keep,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retiring_with_dropped_states_beside_a_fenced_rewind_waits_for_it_without_deadlock() {
    retire_beside_a_worker(
        HeldByWorker::FencedRewind,
        lockstep_core::RetireStates::Drop,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retiring_with_kept_states_beside_a_fenced_rewind_waits_for_it_without_deadlock() {
    retire_beside_a_worker(
        HeldByWorker::FencedRewind,
        lockstep_core::RetireStates::Keep,
    )
    .await;
}
