//! Every way of running a unit of work, called the way an application calls it: from inside
//! `tokio::spawn`, with the concrete types of the fakes and of PostgreSQL (issue 17: with the
//! old closure runner, generic over the closure's future type, these did not compile —
//! "one type is more general than the other"). Generic test code would prove `Send` from its
//! bounds and hide exactly that, so each call below is made in non-generic code.

use lockstep_core::{
    AggregateWriteLock, DistributedAggregateWriteLock, Error, EventStore, ExpectedVersion,
    NewEvent, RetryPolicy, StreamId, Transaction, TransactionSource, tokio_sleep,
};
use lockstep_example_inventory::{LockMode, ReserveStock, handler, wiring};
use lockstep_pg::PgDatabase;
use lockstep_pg_advisory::PgDistributedLock;
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::pg_harness::test_database;
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, InMemoryEventStore};
use uuid::Uuid;

/// The README's domain function: the guard form.
async fn reserve<S, L, E>(source: &S, lock: &L, store: &E, sku: Uuid) -> Result<u64, Error>
where
    S: TransactionSource,
    L: AggregateWriteLock<S::Tx>,
    E: EventStore<S::Tx>,
{
    let stream = StreamId::from_uuid(sku);
    let tx = source.begin().await?;
    lock.acquire(&tx, "StockItem", sku).await?;
    let history = store.load(&tx, stream).await?;
    let reserved = NewEvent::new("StockReserved", serde_json::json!({ "quantity": 1 }))?;
    let at = ExpectedVersion::Exact(history.len() as u64);
    let version = store.append(&tx, stream, at, &[reserved]).await?;
    tx.commit().await?;
    Ok(version)
}

/// The same unit of work through the one-transaction runner, its closure borrowing the
/// caller's lock and store.
async fn reserve_in_runner<S, L, E>(
    source: &S,
    lock: &L,
    store: &E,
    sku: Uuid,
) -> Result<u64, Error>
where
    S: TransactionSource,
    L: AggregateWriteLock<S::Tx>,
    E: EventStore<S::Tx>,
{
    let stream = StreamId::from_uuid(sku);
    source
        .transaction(|tx| {
            Box::pin(async move {
                lock.acquire(&*tx, "StockItem", sku).await?;
                let history = store.load(&*tx, stream).await?;
                let reserved =
                    NewEvent::new("StockReserved", serde_json::json!({ "quantity": 1 }))?;
                let at = ExpectedVersion::Exact(history.len() as u64);
                store.append(&*tx, stream, at, &[reserved]).await
            })
        })
        .await
}

/// Through the retrying runner, told the attempt number.
async fn reserve_with_retry<S, L, E>(
    source: &S,
    lock: &L,
    store: &E,
    sku: Uuid,
) -> Result<(u64, u32), Error>
where
    S: TransactionSource,
    L: AggregateWriteLock<S::Tx>,
    E: EventStore<S::Tx>,
{
    let stream = StreamId::from_uuid(sku);
    source
        .transaction_with_retry(&RetryPolicy::default(), tokio_sleep, |tx, attempt| {
            Box::pin(async move {
                lock.acquire(&*tx, "StockItem", sku).await?;
                let history = store.load(&*tx, stream).await?;
                let reserved =
                    NewEvent::new("StockReserved", serde_json::json!({ "quantity": 1 }))?;
                let at = ExpectedVersion::Exact(history.len() as u64);
                Ok((store.append(&*tx, stream, at, &[reserved]).await?, attempt))
            })
        })
        .await
}

/// Through `RetryPolicy::run`, each attempt beginning its own guard.
async fn reserve_with_policy<S, L, E>(
    source: &S,
    lock: &L,
    store: &E,
    sku: Uuid,
) -> Result<u64, Error>
where
    S: TransactionSource,
    L: AggregateWriteLock<S::Tx>,
    E: EventStore<S::Tx>,
{
    RetryPolicy::default()
        .run(tokio_sleep, |_attempt| {
            Box::pin(reserve(source, lock, store, sku))
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_unit_of_work_form_runs_in_a_spawned_task_on_the_fakes() {
    type Lock = DistributedAggregateWriteLock<FakeDistributedLock>;
    let db = FakeDatabase::new();
    let lock: Lock = DistributedAggregateWriteLock::new(FakeDistributedLock::new(&db));
    let store = InMemoryEventStore::new();
    let sku = Uuid::now_v7();

    let (d, l, s) = (db.clone(), lock.clone(), store.clone());
    let v = tokio::spawn(async move { reserve(&d, &l, &s, sku).await }).await;
    assert_eq!(v.expect("no panic").expect("guard form"), 1);
    let (d, l, s) = (db.clone(), lock.clone(), store.clone());
    let v = tokio::spawn(async move { reserve_in_runner(&d, &l, &s, sku).await }).await;
    assert_eq!(v.expect("no panic").expect("runner"), 2);
    let (d, l, s) = (db.clone(), lock.clone(), store.clone());
    let v = tokio::spawn(async move { reserve_with_retry(&d, &l, &s, sku).await }).await;
    assert_eq!(v.expect("no panic").expect("retrying runner"), (3, 1));
    let (d, l, s) = (db.clone(), lock.clone(), store.clone());
    let v = tokio::spawn(async move { reserve_with_policy(&d, &l, &s, sku).await }).await;
    assert_eq!(v.expect("no panic").expect("retry policy"), 4);

    // The sample's handler, as the issue spawned it.
    let other = Uuid::now_v7();
    handler::stock_new_item(&db, &store, other, 10)
        .await
        .expect("stock");
    let reserve_stock = wiring::fake_handler(&db, &store, LockMode::Pessimistic);
    let d = db.clone();
    let done = tokio::spawn(async move {
        let cmd = ReserveStock {
            sku: other,
            quantity: 3,
            reservation_id: Uuid::now_v7(),
        };
        reserve_stock.handle(&d, &cmd).await
    })
    .await
    .expect("no panic")
    .expect("reserved");
    assert_eq!((done.available, done.attempts), (7, 1));
    assert!(
        db.held_keys().is_empty(),
        "every lock went with its transaction"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_unit_of_work_form_runs_in_a_spawned_task_on_postgres() {
    let test_db = test_database().await;
    let db = PgDatabase::builder()
        .pool(test_db.pool(4))
        .build()
        .expect("handle");
    db.migrate().await.expect("migrate");
    let lock = PgDistributedLock::new(&db).aggregate_write_lock();
    let store = PgEventStore::new(&db);
    let sku = Uuid::now_v7();

    let (d, l, s) = (db.clone(), lock.clone(), store.clone());
    let v = tokio::spawn(async move { reserve(&d, &l, &s, sku).await }).await;
    assert_eq!(v.expect("no panic").expect("guard form"), 1);
    let (d, l, s) = (db.clone(), lock.clone(), store.clone());
    let v = tokio::spawn(async move { reserve_in_runner(&d, &l, &s, sku).await }).await;
    assert_eq!(v.expect("no panic").expect("runner"), 2);
    let (d, l, s) = (db.clone(), lock.clone(), store.clone());
    let v = tokio::spawn(async move { reserve_with_retry(&d, &l, &s, sku).await }).await;
    assert_eq!(v.expect("no panic").expect("retrying runner"), (3, 1));
    let (d, l, s) = (db.clone(), lock.clone(), store.clone());
    let v = tokio::spawn(async move { reserve_with_policy(&d, &l, &s, sku).await }).await;
    assert_eq!(v.expect("no panic").expect("retry policy"), 4);

    let other = Uuid::now_v7();
    handler::stock_new_item(&db, &store, other, 10)
        .await
        .expect("stock");
    let reserve_stock = wiring::postgres_handler(&db, LockMode::PessimisticPipelined);
    let d = db.clone();
    let done = tokio::spawn(async move {
        let cmd = ReserveStock {
            sku: other,
            quantity: 3,
            reservation_id: Uuid::now_v7(),
        };
        reserve_stock.handle(&d, &cmd).await
    })
    .await
    .expect("no panic")
    .expect("reserved");
    assert_eq!((done.available, done.attempts), (7, 1));
}

/// The handle's own async entry points (build from a config, migrate, check out, begin), each
/// called from a spawned task as a service's start-up or a handler would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handle_s_entry_points_run_in_spawned_tasks() {
    let test_db = test_database().await;
    let db = PgDatabase::builder()
        .config(test_db.config().clone())
        .max_connections(2)
        .build()
        .expect("handle");
    let d = db.clone();
    let migrated = tokio::spawn(async move { d.migrate().await })
        .await
        .expect("no panic")
        .expect("migrate");
    assert!(
        !migrated.applied.is_empty(),
        "a fresh database gets the schema"
    );
    let d = db.clone();
    tokio::spawn(async move {
        let conn = d.checkout().await.expect("checkout");
        let tx = d.begin().await.expect("begin");
        tx.commit().await.expect("commit");
        drop(conn);
    })
    .await
    .expect("no panic");
}

/// A guard dropped open (an early `?`, a cancelled task) rolls back: on Postgres its connection
/// is rolled back in the background and pooled again, outside any transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_dropped_in_a_spawned_task_rolls_back() {
    let test_db = test_database().await;
    let db = PgDatabase::from_pool(test_db.pool(1));
    db.migrate().await.expect("migrate");
    let store = PgEventStore::new(&db);
    let stream = StreamId::new_v7();
    let (d, s) = (db.clone(), store.clone());
    tokio::spawn(async move {
        let tx = d.begin().await.expect("begin");
        let event = NewEvent::new("Dropped", serde_json::json!({})).expect("event");
        s.append(&tx, stream, ExpectedVersion::NoStream, &[event])
            .await
            .expect("append");
        // dropped here, uncommitted
    })
    .await
    .expect("no panic");
    // The pool's only connection comes back (after the background ROLLBACK), clean.
    let tx = tokio::time::timeout(std::time::Duration::from_secs(10), db.begin())
        .await
        .expect("the connection came back")
        .expect("begin");
    assert!(store.load(&tx, stream).await.expect("load").is_empty());
    tx.rollback().await.expect("rollback");
}
