//! The sample on a real PostgreSQL (a database per test): 32 concurrent writers reserve 4 units
//! each of a SKU stocked with 100 — never oversold, every unit accounted for, in every mode.

use std::sync::Arc;

use lockstep_core::RetryPolicy;
use lockstep_example_inventory::handler;
use lockstep_example_inventory::wiring::{PgUnitOfWork, postgres_handler};
use lockstep_example_inventory::{InventoryError, LockMode, ReserveStock};
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::pg_harness::test_database;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_writers_never_oversell_on_postgres_in_any_mode() {
    let db = test_database().await;
    let pool = db.pool(16);
    lockstep_pg::migrate(&pool).await.expect("migrate");
    let uow = Arc::new(PgUnitOfWork::new(pool.clone()));
    let store = PgEventStore::new();
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
        let reserve = Arc::new(postgres_handler(&pool, mode).with_retry(retry));
        let writers: Vec<_> = (0..32)
            .map(|_| {
                let (uow, reserve) = (Arc::clone(&uow), Arc::clone(&reserve));
                tokio::spawn(async move {
                    let cmd = ReserveStock {
                        sku,
                        quantity: 4,
                        reservation_id: Uuid::now_v7(),
                    };
                    reserve.handle(&*uow, tokio::time::sleep, &cmd).await
                })
            })
            .collect();
        let (mut ok, mut sold_out, mut busy, mut conflicts) = (0u64, 0, 0, 0);
        for writer in writers {
            match writer.await.expect("writer") {
                Ok(done) => {
                    ok += 1;
                    conflicts += done.conflicts;
                }
                Err(InventoryError::InsufficientStock { .. }) => sold_out += 1,
                Err(InventoryError::Busy { .. }) => busy += 1,
                Err(other) => panic!("{mode:?}: unexpected failure: {other}"),
            }
        }
        let item = handler::load_item(&*uow, &store, sku).await.expect("load");
        assert_eq!(ok + sold_out + busy, 32, "{mode:?}: every command answered");
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
            assert_eq!(conflicts, 0, "{mode:?}: writers queue instead of racing");
        }
    }
}
