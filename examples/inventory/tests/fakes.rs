//! The sample on the testkit fakes: the domain's dependency rule, and the combined mode. The
//! write lock's tests (`write_lock.rs`), the flash sale in every mode and fail-fast's busy
//! answer (`flash_sale.rs`) run on the fakes and on PostgreSQL.

use lockstep_example_inventory::handler;
use lockstep_example_inventory::{InventoryError, wiring::fake_combiner};
use lockstep_testkit::{FakeDatabase, InMemoryEventStore};

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
    use lockstep_example_inventory::Reserve;

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
