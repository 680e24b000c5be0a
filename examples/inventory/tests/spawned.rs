//! Every way of running a unit of work, called the way an application calls it: from inside
//! `tokio::spawn`, with the concrete types of the fakes and of PostgreSQL (issue 17: with the
//! old closure runner, generic over the closure's future type, these did not compile —
//! "one type is more general than the other"). The forms are awaited in the body that
//! `lockstep::testing` spawns with each stack's concrete types, so the compiler proves the
//! body's future — every form's future in it — `Send` for `Fakes` and for `Postgres`, not
//! from generic bounds (a `tokio::spawn` inside generic code would prove it from the bounds
//! and hide exactly that).

use lockstep::testing::{Backend, Fakes, fresh_database_with, on_fakes, on_postgres};
use lockstep_core::{
    AggregateWriteLock, Error, EventStore, ExpectedVersion, NewEvent, RetryPolicy, StreamId,
    Transaction, TransactionSource, tokio_sleep,
};
use lockstep_example_inventory::{LockMode, ReserveStock, ReserveStockHandler, handler};
use lockstep_pg::PgDatabase;
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::pg_harness::test_database;
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

/// Every form in turn on one SKU (versions 1 to 4), then the sample's handler in `mode` on
/// another, as the issue spawned it.
async fn every_unit_of_work_form<B: Backend>(b: B, mode: LockMode) {
    let (db, lock, store) = (b.source(), b.aggregate_lock(), b.event_store());
    let sku = Uuid::now_v7();

    let v = reserve(db, &lock, &store, sku).await;
    assert_eq!(v.expect("guard form"), 1);
    let v = reserve_in_runner(db, &lock, &store, sku).await;
    assert_eq!(v.expect("runner"), 2);
    let v = reserve_with_retry(db, &lock, &store, sku).await;
    assert_eq!(v.expect("retrying runner"), (3, 1));
    let v = reserve_with_policy(db, &lock, &store, sku).await;
    assert_eq!(v.expect("retry policy"), 4);

    let other = Uuid::now_v7();
    handler::stock_new_item(db, &store, other, 10)
        .await
        .expect("stock");
    let reserve_stock = ReserveStockHandler::new(lock, store, mode);
    let cmd = ReserveStock {
        sku: other,
        quantity: 3,
        reservation_id: Uuid::now_v7(),
    };
    let done = reserve_stock.handle(db, &cmd).await.expect("reserved");
    assert_eq!((done.available, done.attempts), (7, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_unit_of_work_form_runs_in_a_spawned_task_on_the_fakes() {
    on_fakes(|b: Fakes| async move {
        every_unit_of_work_form(b.clone(), LockMode::Pessimistic).await;
        assert!(
            b.database().held_keys().is_empty(),
            "every lock went with its transaction"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_unit_of_work_form_runs_in_a_spawned_task_on_postgres() {
    on_postgres(|b| every_unit_of_work_form(b, LockMode::PessimisticPipelined)).await;
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
    let db = fresh_database_with(|handle| handle.max_connections(1)).await;
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
