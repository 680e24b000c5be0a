//! The flash sale, written once and run on the testkit fakes and on a fresh PostgreSQL database
//! (`lockstep::testing`): 32 concurrent writers reserve 4 units each of a SKU stocked with
//! 100 — never oversold, every unit accounted for, in every mode and through the command
//! combiner — and fail-fast's typed busy answer while another writer holds the SKU.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use lockstep::testing::{Backend, Fakes, on_fakes, on_postgres, on_sqlx};
use lockstep_combiner::{CombineError, Combiner};
use lockstep_core::TransactionSource as _;
use lockstep_core::{AggregateWriteLock, EventStore, RetryPolicy, StreamId, Transaction as _};
use lockstep_example_inventory::flash_sale;
use lockstep_example_inventory::handler;
use lockstep_example_inventory::{
    InventoryError, LockMode, Reserve, ReserveStock, ReserveStockHandler, STOCK_ITEM,
    StockItemDecider,
};
use uuid::Uuid;

/// The sale in every mode, each on a SKU of its own stocked with 100, through handlers built
/// from `b`'s aggregate lock and event store with `retry`; `after_each` checks what only one
/// stack shows.
async fn every_mode<B: Backend>(b: B, retry: RetryPolicy, after_each: impl Fn(&B, LockMode)) {
    let store = b.event_store();
    let source = Arc::new(b.source().clone());
    for mode in LockMode::ALL {
        let sku = Uuid::now_v7();
        handler::stock_new_item(&*source, &store, sku, 100)
            .await
            .expect("stock");
        let reserve = Arc::new(
            ReserveStockHandler::new(b.aggregate_lock(), b.event_store(), mode).with_retry(retry),
        );
        let tally = flash_sale::run(Arc::clone(&source), reserve, &store, sku, 32, 4)
            .await
            .expect("sale");
        let (ok, sold_out, busy) = (tally.ok, tally.sold_out, tally.busy);
        assert!(
            tally.failures.is_empty(),
            "{mode:?} on {}: unexpected failures: {:?}",
            B::NAME,
            tally.failures
        );
        after_each(&b, mode);
        let item = handler::load_item(&*source, &store, sku)
            .await
            .expect("load");
        assert_eq!(tally.answered(), 32, "{mode:?}: every command answered");
        assert_eq!(item.reserved(), ok * 4, "{mode:?}: one event per success");
        assert_eq!(
            ok * 4 + tally.available,
            100,
            "{mode:?}: every unit accounted for"
        );
        assert_eq!(
            item.reserved() + item.available(),
            100,
            "{mode:?}: every unit accounted for"
        );
        assert!(item.reserved() <= 100, "{mode:?}: never oversold");
        match mode {
            LockMode::FailFast => assert!(ok >= 1, "the first writer always gets through"),
            _ => {
                assert_eq!((ok, sold_out, busy), (25, 7, 0), "{mode:?}");
                assert_eq!(tally.available, 0, "{mode:?}");
            }
        }
        if matches!(mode, LockMode::Pessimistic | LockMode::PessimisticPipelined) {
            assert_eq!(
                tally.conflicts, 0,
                "{mode:?}: writers queue instead of racing"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_writers_never_oversell_in_any_mode_on_the_fakes() {
    on_fakes(|b: Fakes| {
        every_mode(b, RetryPolicy::default(), |b, mode| {
            assert!(
                b.database().held_keys().is_empty(),
                "{mode:?}: every lock released"
            );
        })
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_writers_never_oversell_on_postgres_in_any_mode() {
    // Generous attempts: the optimistic mode on one hot SKU loses many races.
    let retry = RetryPolicy::new(
        NonZeroU32::new(200).expect("non-zero"),
        Duration::from_millis(1),
        Duration::from_millis(50),
    );
    on_postgres(|b| every_mode(b, retry, |_, _| {})).await;
}

/// The same domain code on the application's sqlx pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_writers_never_oversell_on_sqlx_in_any_mode() {
    let retry = RetryPolicy::new(
        NonZeroU32::new(200).expect("non-zero"),
        Duration::from_millis(1),
        Duration::from_millis(50),
    );
    on_sqlx(|b| every_mode(b, retry, |_, _| {})).await;
}

/// Fail-fast answers "busy" while another transaction holds the SKU's write lock, and
/// reserves once it is free.
async fn fail_fast_answers_busy_while_another_writer_holds_the_sku<B: Backend>(b: B) {
    let (source, store) = (b.source(), b.event_store());
    let sku = Uuid::now_v7();
    handler::stock_new_item(source, &store, sku, 10)
        .await
        .expect("stock");
    let holder = source.begin().await.expect("begin");
    assert!(
        b.aggregate_lock()
            .try_acquire(&holder, STOCK_ITEM, sku)
            .await
            .expect("hold")
    );
    let reserve = ReserveStockHandler::new(b.aggregate_lock(), store.clone(), LockMode::FailFast);
    let cmd = ReserveStock {
        sku,
        quantity: 1,
        reservation_id: Uuid::now_v7(),
    };
    let err = reserve.handle(source, &cmd).await.expect_err("busy");
    assert!(
        matches!(err, InventoryError::Busy { sku: s } if s == sku),
        "{err}"
    );
    holder.rollback().await.expect("rollback");
    let done = reserve.handle(source, &cmd).await.expect("free now");
    assert_eq!(done.available, 9);
    let tx = source.begin().await.expect("begin");
    assert_eq!(
        store
            .load(&tx, StreamId::from_uuid(sku))
            .await
            .expect("load")
            .len(),
        2
    );
    tx.rollback().await.expect("rollback");
}

#[tokio::test]
async fn fail_fast_answers_busy_while_another_writer_holds_the_sku_on_the_fakes() {
    on_fakes(fail_fast_answers_busy_while_another_writer_holds_the_sku).await;
}

#[tokio::test]
async fn fail_fast_answers_busy_while_another_writer_holds_the_sku_on_postgres() {
    on_postgres(fail_fast_answers_busy_while_another_writer_holds_the_sku).await;
}

/// The combined mode: 32 buyers of 4 units of a SKU stocked with 100, through the command
/// combiner — 25 reserved, 7 told "sold out", never oversold.
async fn thirty_two_buyers_through_the_combiner_never_oversell<B: Backend>(b: B) {
    let store = b.event_store();
    let sku = Uuid::now_v7();
    handler::stock_new_item(b.source(), &store, sku, 100)
        .await
        .expect("stock");
    let combiner = Combiner::new(
        b.source().clone(),
        store.clone(),
        StockItemDecider::default(),
    );
    let buyers: Vec<_> = (0..32)
        .map(|_| {
            let c = combiner.clone();
            tokio::spawn(async move {
                c.submit(
                    sku,
                    Reserve {
                        quantity: 4,
                        reservation_id: Uuid::now_v7(),
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
            Err(other) => panic!("a buyer failed on {}: {other:?}", B::NAME),
        }
    }
    assert_eq!((ok, sold_out), (25, 7), "on {}", B::NAME);
    let item = handler::load_item(b.source(), &store, sku)
        .await
        .expect("load");
    assert_eq!((item.reserved(), item.available()), (100, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_buyers_through_the_combiner_never_oversell_on_the_fakes() {
    on_fakes(thirty_two_buyers_through_the_combiner_never_oversell).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_buyers_through_the_combiner_never_oversell_on_postgres() {
    on_postgres(thirty_two_buyers_through_the_combiner_never_oversell).await;
}
