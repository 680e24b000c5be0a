//! The pessimistic per-aggregate write lock seed's tests, on the fakes: the same contract the
//! sample's `AggregateWriteLockTests` prove, through `DistributedAggregateWriteLock` over the
//! fake distributed lock.

use std::time::Duration;

use lockstep_core::Transaction as _;
use lockstep_core::{
    AggregateWriteLock, DistributedAggregateWriteLock, ErrorKind, ResourceKey, Uuid,
};
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, LockOwner, RecordingDistributedLock};

fn resource_key(aggregate_type: &str, id: Uuid) -> ResourceKey {
    DistributedAggregateWriteLock::<()>::resource_key(aggregate_type, id).expect("valid key")
}

#[tokio::test(start_paused = true)]
async fn a_second_writer_is_denied_while_the_first_holds_the_sku() {
    let db = FakeDatabase::new();
    let sut = DistributedAggregateWriteLock::new(FakeDistributedLock::new(&db));
    let sku = Uuid::now_v7();
    let (a, b) = (db.begin_now(), db.begin_now());
    assert!(sut.try_acquire(&a, "StockItem", sku).await.expect("try"));
    assert!(!sut.try_acquire(&b, "StockItem", sku).await.expect("try"));
    assert_eq!(
        db.holder_of(&resource_key("StockItem", sku)),
        Some(LockOwner::Transaction(a.id()))
    );
}

#[tokio::test(start_paused = true)]
async fn a_blocking_acquire_waits_until_the_first_transaction_ends() {
    let db = FakeDatabase::new();
    let sut = std::sync::Arc::new(DistributedAggregateWriteLock::new(
        FakeDistributedLock::new(&db),
    ));
    let sku = Uuid::now_v7();
    let a = db.begin_now();
    assert!(sut.try_acquire(&a, "StockItem", sku).await.expect("try"));

    let writer_b = {
        let (sut, db) = (sut.clone(), db.clone());
        tokio::spawn(async move {
            let b = db.begin_now();
            sut.acquire(&b, "StockItem", sku).await.map(|()| b)
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!writer_b.is_finished(), "B still waits 200 ms later");
    assert_eq!(db.waiters(&resource_key("StockItem", sku)), 1);

    a.commit().await.expect("A commits");
    let b = tokio::time::timeout(Duration::from_secs(5), writer_b)
        .await
        .expect("B completes within 5 s")
        .expect("task")
        .expect("B holds the lock");
    assert_eq!(
        db.holder_of(&resource_key("StockItem", sku)),
        Some(LockOwner::Transaction(b.id()))
    );
}

#[tokio::test(start_paused = true)]
async fn writers_to_different_ids_never_wait() {
    let db = FakeDatabase::new();
    let sut = DistributedAggregateWriteLock::new(FakeDistributedLock::new(&db))
        .with_timeout(Duration::from_millis(1));
    let txs: Vec<_> = (0..16).map(|_| db.begin_now()).collect();
    for tx in &txs {
        // A 1 ms timeout would fail any writer that had to wait.
        sut.acquire(tx, "StockItem", Uuid::now_v7())
            .await
            .expect("no writer waits");
    }
    assert_eq!(db.held_keys().len(), 16);
}

#[tokio::test(start_paused = true)]
async fn the_key_is_namespaced_by_aggregate_type_and_id() {
    let db = FakeDatabase::new();
    let recording = RecordingDistributedLock::new(FakeDistributedLock::new(&db));
    let sut = DistributedAggregateWriteLock::new(recording.clone());
    let id = Uuid::parse_str("0123456789abcdef0123456789abcdef").expect("uuid");
    let (a, b) = (db.begin_now(), db.begin_now());
    assert!(sut.try_acquire(&a, "StockItem", id).await.expect("try"));
    // Same id under another type: a different key, so no contention.
    assert!(sut.try_acquire(&b, "Order", id).await.expect("try"));
    let keys: Vec<String> = recording.keys().iter().map(|k| k.to_string()).collect();
    assert_eq!(
        keys,
        vec![
            "relay:aggregate:StockItem:0123456789abcdef0123456789abcdef",
            "relay:aggregate:Order:0123456789abcdef0123456789abcdef",
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn invalid_aggregate_types_are_refused_and_lock_nothing() {
    let db = FakeDatabase::new();
    let sut = DistributedAggregateWriteLock::new(FakeDistributedLock::new(&db));
    let tx = db.begin_now();
    for bad in ["", "   ", "Stock:Item"] {
        let err = sut
            .acquire(&tx, bad, Uuid::now_v7())
            .await
            .expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
    }
    assert!(db.held_keys().is_empty());
    assert!(
        tx.is_usable(),
        "a refused call does not abort the transaction"
    );
}

#[tokio::test(start_paused = true)]
async fn locking_two_aggregates_in_opposite_argument_order_never_deadlocks() {
    let db = FakeDatabase::new();
    let sut = std::sync::Arc::new(DistributedAggregateWriteLock::new(
        FakeDistributedLock::new(&db),
    ));
    let (x, y) = (Uuid::now_v7(), Uuid::now_v7());
    let mut tasks = Vec::new();
    for i in 0..20 {
        let (sut, db) = (sut.clone(), db.clone());
        tasks.push(tokio::spawn(async move {
            let tx = db.begin_now();
            let order = if i % 2 == 0 {
                [("StockItem", x), ("StockItem", y)]
            } else {
                [("StockItem", y), ("StockItem", x)]
            };
            sut.acquire_all(&tx, &order).await?;
            tokio::time::sleep(Duration::from_millis(1)).await;
            tx.commit().await
        }));
    }
    for task in tasks {
        task.await
            .expect("task")
            .expect("no deadlock, every writer commits");
    }
}
