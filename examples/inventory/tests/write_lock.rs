//! The sample's write lock, written once and run on the testkit fakes and on a fresh PostgreSQL
//! database (`lockstep::testing`): writers of the same SKU serialize, writers of different
//! SKUs never wait, and the key is namespaced by aggregate type and id. What only the fakes
//! show (who holds which key) is checked in their tests.

use lockstep::testing::{Backend, Fakes, on_fakes, on_postgres};
use lockstep_core::{
    AggregateWriteLock, DistributedAggregateWriteLock, Transaction, TransactionSource as _,
};
use lockstep_example_inventory::STOCK_ITEM;
use lockstep_example_inventory::handler::stock_item_key;
use lockstep_testkit::{FakeDistributedLock, LockOwner};
use uuid::Uuid;

/// A holds the SKU; B is denied a try, then queues on a blocking acquire until A commits.
/// Returns B's transaction, holding the lock, and the SKU.
async fn writers_to_the_same_sku_serialize<B: Backend>(b: B) -> (B::Tx, Uuid) {
    let lock = b.aggregate_lock();
    let sku = Uuid::now_v7();
    let a = b.source().begin().await.expect("begin a");
    let tx_b = b.source().begin().await.expect("begin b");
    assert!(lock.try_acquire(&a, STOCK_ITEM, sku).await.expect("a"));
    assert!(
        !lock
            .try_acquire(&tx_b, STOCK_ITEM, sku)
            .await
            .expect("b is denied")
    );

    // A blocking acquire waits rather than failing — until A's transaction ends.
    let writer_b = {
        let lock = lock.clone();
        tokio::spawn(async move {
            lock.acquire(&tx_b, STOCK_ITEM, sku)
                .await
                .expect("b gets it");
            tx_b
        })
    };
    b.until_lock_waiters(1, "writer b").await;
    assert!(!writer_b.is_finished(), "b waits while a holds the SKU");
    a.commit().await.expect("a commits, releasing the lock");
    (writer_b.await.expect("b"), sku)
}

#[tokio::test]
async fn writers_to_the_same_sku_serialize_on_the_write_lock_on_the_fakes() {
    on_fakes(|b: Fakes| async move {
        let (tx_b, sku) = writers_to_the_same_sku_serialize(b.clone()).await;
        assert_eq!(
            b.database().holder_of(&stock_item_key(sku)),
            Some(LockOwner::Transaction(tx_b.id()))
        );
        tx_b.rollback().await.expect("rollback");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_to_the_same_sku_serialize_on_the_write_lock_on_postgres() {
    on_postgres(|b| async move {
        let (tx_b, _) = writers_to_the_same_sku_serialize(b).await;
        tx_b.rollback().await.expect("rollback");
    })
    .await;
}

/// Two writers of two SKUs both get their lock at once; returns their open transactions.
async fn writers_to_different_skus_never_wait<B: Backend>(b: B) -> (B::Tx, B::Tx) {
    let lock = b.aggregate_lock();
    let a = b.source().begin().await.expect("begin a");
    let tx_b = b.source().begin().await.expect("begin b");
    assert!(
        lock.try_acquire(&a, STOCK_ITEM, Uuid::now_v7())
            .await
            .expect("a")
    );
    lock.acquire(&tx_b, STOCK_ITEM, Uuid::now_v7())
        .await
        .expect("another SKU is free at once");
    (a, tx_b)
}

#[tokio::test]
async fn writers_to_different_skus_never_wait_on_the_fakes() {
    on_fakes(|b: Fakes| async move {
        let (_a, _b) = writers_to_different_skus_never_wait(b.clone()).await;
        assert_eq!(b.database().held_keys().len(), 2);
    })
    .await;
}

#[tokio::test]
async fn writers_to_different_skus_never_wait_on_postgres() {
    on_postgres(|b| async move {
        let (a, tx_b) = writers_to_different_skus_never_wait(b).await;
        a.rollback().await.expect("rollback a");
        tx_b.rollback().await.expect("rollback b");
    })
    .await;
}

/// The same id under another aggregate type is another lock.
async fn the_same_id_of_another_type_is_another_lock<B: Backend>(b: B) {
    let sku = Uuid::parse_str("0123456789abcdef0123456789abcdef").expect("uuid");
    let lock = b.aggregate_lock();
    let a = b.source().begin().await.expect("begin a");
    let tx_b = b.source().begin().await.expect("begin b");
    assert!(
        lock.try_acquire(&a, STOCK_ITEM, sku)
            .await
            .expect("stock item")
    );
    assert!(
        lock.try_acquire(&tx_b, "Order", sku)
            .await
            .expect("order, same id")
    );
}

#[tokio::test]
async fn the_lock_key_is_namespaced_by_aggregate_type_and_id() {
    let sku = Uuid::parse_str("0123456789abcdef0123456789abcdef").expect("uuid");
    let key = DistributedAggregateWriteLock::<FakeDistributedLock>::resource_key(STOCK_ITEM, sku)
        .expect("key");
    assert_eq!(
        key.as_str(),
        "relay:aggregate:StockItem:0123456789abcdef0123456789abcdef"
    );
    assert_eq!(key, stock_item_key(sku));
    on_fakes(the_same_id_of_another_type_is_another_lock).await;
}

#[tokio::test]
async fn the_same_id_of_another_type_is_another_lock_on_postgres() {
    on_postgres(the_same_id_of_another_type_is_another_lock).await;
}
