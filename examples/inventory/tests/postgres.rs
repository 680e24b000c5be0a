//! The sample on a real PostgreSQL (a database per test): 32 concurrent writers reserve 4 units
//! each of a SKU stocked with 100 — never oversold, every unit accounted for, in every mode.

use std::sync::Arc;

use lockstep_core::RetryPolicy;
use lockstep_example_inventory::LockMode;
use lockstep_example_inventory::flash_sale;
use lockstep_example_inventory::handler;
use lockstep_example_inventory::wiring::postgres_handler;
use lockstep_pg::PgDatabase;
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::pg_harness::test_database;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_writers_never_oversell_on_postgres_in_any_mode() {
    let db = test_database().await;
    let pool = db.pool(16);
    let uow = Arc::new(PgDatabase::from_pool(pool));
    uow.migrate().await.expect("migrate");
    let store = PgEventStore::new(&uow);
    for mode in LockMode::ALL {
        let sku = Uuid::now_v7();
        handler::stock_new_item(&*uow, &store, sku, 100)
            .await
            .expect("stock");
        // Generous attempts: the optimistic mode on one hot SKU loses many races.
        let retry = RetryPolicy::new(
            std::num::NonZeroU32::new(200).expect("non-zero"),
            std::time::Duration::from_millis(1),
            std::time::Duration::from_millis(50),
        );
        let reserve = Arc::new(postgres_handler(&uow, mode).with_retry(retry));
        let tally = flash_sale::run(Arc::clone(&uow), reserve, &store, sku, 32, 4)
            .await
            .expect("sale");
        let (ok, sold_out, busy) = (tally.ok, tally.sold_out, tally.busy);
        assert!(
            tally.failures.is_empty(),
            "{mode:?}: unexpected failures: {:?}",
            tally.failures
        );
        let item = handler::load_item(&*uow, &store, sku).await.expect("load");
        assert_eq!(tally.answered(), 32, "{mode:?}: every command answered");
        assert_eq!(item.reserved(), ok * 4, "{mode:?}: one event per success");
        assert_eq!(
            item.reserved() + item.available(),
            100,
            "{mode:?}: every unit accounted for"
        );
        assert!(item.reserved() <= 100, "{mode:?}: never oversold");
        match mode {
            LockMode::FailFast => assert!(ok >= 1, "the first writer always gets through"),
            _ => assert_eq!((ok, sold_out, busy), (25, 7, 0), "{mode:?}"),
        }
        if matches!(mode, LockMode::Pessimistic | LockMode::PessimisticPipelined) {
            assert_eq!(
                tally.conflicts, 0,
                "{mode:?}: writers queue instead of racing"
            );
        }
    }
}
