//! The sample on the testkit fakes: the seed's three lock tests (same SKU serializes,
//! different SKUs never wait, the key is namespaced by type and id), the flash sale in every
//! mode, fail-fast's typed busy answer, and the domain's dependency rule.

use std::sync::Arc;

use lockstep_core::Transaction as _;
use lockstep_core::{AggregateWriteLock, DistributedAggregateWriteLock, EventStore, StreamId};
use lockstep_example_inventory::flash_sale::{self, Tally};
use lockstep_example_inventory::handler::{self, stock_item_key};
use lockstep_example_inventory::wiring::fake_handler;
use lockstep_example_inventory::{InventoryError, LockMode, ReserveStock, STOCK_ITEM};
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, InMemoryEventStore, LockOwner};
use uuid::Uuid;

fn write_lock(db: &FakeDatabase) -> DistributedAggregateWriteLock<FakeDistributedLock> {
    DistributedAggregateWriteLock::new(FakeDistributedLock::new(db))
}

#[tokio::test]
async fn writers_to_the_same_sku_serialize_on_the_write_lock() {
    let db = FakeDatabase::new();
    let lock = Arc::new(write_lock(&db));
    let sku = Uuid::now_v7();
    let (a, b) = (db.begin_now(), db.begin_now());
    assert!(lock.try_acquire(&a, STOCK_ITEM, sku).await.expect("a"));
    assert!(
        !lock
            .try_acquire(&b, STOCK_ITEM, sku)
            .await
            .expect("b is denied")
    );

    // A blocking acquire waits rather than failing — until A's transaction ends.
    let writer_b = {
        let lock = Arc::clone(&lock);
        tokio::spawn(async move {
            lock.acquire(&b, STOCK_ITEM, sku).await.expect("b gets it");
            b
        })
    };
    while db.waiters(&stock_item_key(sku)) == 0 {
        tokio::task::yield_now().await;
    }
    assert!(!writer_b.is_finished(), "b waits while a holds the SKU");
    a.commit().await.expect("a commits, releasing the lock");
    let b = writer_b.await.expect("b");
    let b_id = b.id();
    assert_eq!(
        db.holder_of(&stock_item_key(sku)),
        Some(LockOwner::Transaction(b_id))
    );
    b.rollback().await.expect("rollback");
}

#[tokio::test]
async fn writers_to_different_skus_never_wait() {
    let db = FakeDatabase::new();
    let lock = write_lock(&db);
    let (a, b) = (db.begin_now(), db.begin_now());
    assert!(
        lock.try_acquire(&a, STOCK_ITEM, Uuid::now_v7())
            .await
            .expect("a")
    );
    lock.acquire(&b, STOCK_ITEM, Uuid::now_v7())
        .await
        .expect("another SKU is free at once");
    assert_eq!(db.held_keys().len(), 2);
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

    // The same id under another aggregate type is another lock.
    let db = FakeDatabase::new();
    let lock = write_lock(&db);
    let (a, b) = (db.begin_now(), db.begin_now());
    assert!(
        lock.try_acquire(&a, STOCK_ITEM, sku)
            .await
            .expect("stock item")
    );
    assert!(
        lock.try_acquire(&b, "Order", sku)
            .await
            .expect("order, same id")
    );
}

async fn flash_sale(mode: LockMode) -> Tally {
    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let uow = Arc::new(db.clone());
    let sku = Uuid::now_v7();
    handler::stock_new_item(&*uow, &store, sku, 100)
        .await
        .expect("stock");
    let reserve = Arc::new(fake_handler(&db, &store, mode));
    let tally = flash_sale::run(uow, reserve, &store, sku, 32, 4)
        .await
        .expect("sale");
    assert!(
        tally.failures.is_empty(),
        "{mode:?}: unexpected failures: {:?}",
        tally.failures
    );
    assert!(db.held_keys().is_empty(), "every lock released");
    tally
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_writers_never_oversell_in_any_mode() {
    for mode in LockMode::ALL {
        let tally = flash_sale(mode).await;
        assert_eq!(tally.answered(), 32, "{mode:?}: every command answered");
        assert_eq!(
            tally.ok * 4 + tally.available,
            100,
            "{mode:?}: every unit accounted for"
        );
        if mode != LockMode::FailFast {
            assert_eq!(
                (tally.ok, tally.sold_out, tally.busy),
                (25, 7, 0),
                "{mode:?}"
            );
            assert_eq!(tally.available, 0);
        }
    }
}

#[tokio::test]
async fn fail_fast_answers_busy_while_another_writer_holds_the_sku() {
    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let uow = db.clone();
    let sku = Uuid::now_v7();
    handler::stock_new_item(&uow, &store, sku, 10)
        .await
        .expect("stock");
    let holder = db.begin_now();
    assert!(
        write_lock(&db)
            .try_acquire(&holder, STOCK_ITEM, sku)
            .await
            .expect("hold")
    );
    let reserve = fake_handler(&db, &store, LockMode::FailFast);
    let cmd = ReserveStock {
        sku,
        quantity: 1,
        reservation_id: Uuid::now_v7(),
    };
    let err = reserve.handle(&uow, &cmd).await.expect_err("busy");
    assert!(
        matches!(err, InventoryError::Busy { sku: s } if s == sku),
        "{err}"
    );
    holder.rollback().await.expect("rollback");
    let done = reserve.handle(&uow, &cmd).await.expect("free now");
    assert_eq!(done.available, 9);
    let tx = db.begin_now();
    assert_eq!(
        store
            .load(&tx, StreamId::from_uuid(sku))
            .await
            .expect("load")
            .len(),
        2
    );
}

#[test]
fn domain_code_depends_on_lockstep_core_only() {
    for (file, source) in [
        ("domain.rs", include_str!("../src/domain.rs")),
        ("handler.rs", include_str!("../src/handler.rs")),
    ] {
        // Code only: comments may mention the runtime.
        let code: String = source
            .lines()
            .filter(|line| !line.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        for crate_name in [
            "lockstep_pg",
            "lockstep_testkit",
            "tokio",
            "deadpool",
            "crate::wiring",
        ] {
            assert!(
                !code.contains(&format!("use {crate_name}"))
                    && !code.contains(&format!("{crate_name}::")),
                "{file} must not use {crate_name}"
            );
        }
    }
}

/// The combined mode (issue 22): 32 buyers of 4 units of a SKU stocked with 100, through the
/// command combiner on the fakes — 25 reserved, 7 told "sold out", never oversold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_buyers_through_the_combiner_never_oversell() {
    use lockstep_combiner::CombineError;
    use lockstep_example_inventory::{Reserve, wiring::fake_combiner};

    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let sku = uuid::Uuid::now_v7();
    handler::stock_new_item(&db, &store, sku, 100)
        .await
        .expect("stock");
    let combiner = fake_combiner(&db, store.clone());
    let buyers: Vec<_> = (0..32)
        .map(|_| {
            let c = combiner.clone();
            tokio::spawn(async move {
                c.submit(
                    sku,
                    Reserve {
                        quantity: 4,
                        reservation_id: uuid::Uuid::now_v7(),
                    },
                )
                .await
            })
        })
        .collect();
    let (mut ok, mut sold_out) = (0, 0);
    for buyer in buyers {
        match buyer.await.expect("task") {
            Ok(_) => ok += 1,
            Err(CombineError::Rejected(InventoryError::InsufficientStock { .. })) => sold_out += 1,
            Err(other) => panic!("a buyer failed: {other:?}"),
        }
    }
    assert_eq!((ok, sold_out), (25, 7));
    let item = handler::load_item(&db, &store, sku).await.expect("load");
    assert_eq!((item.reserved(), item.available()), (100, 0));
}
