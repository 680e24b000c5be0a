//! The combiner on PostgreSQL (a database per test): the shared suite — with every connection
//! of "the process" through a relay that can lose a `COMMIT` reply, and "another process" on a
//! pool and handle of its own — plus the public entry points called from inside
//! `tokio::spawn` with the concrete Postgres types, as a web handler would.

mod suite;

use std::sync::Arc;

use lockstep_combiner::{CombineError, Combiner};
use lockstep_core::Uuid;
use lockstep_pg::PgDatabase;
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};
use lockstep_testkit::relay::Relay;

use suite::{Backend, Cmd, Shop};

struct Postgres {
    relay: Relay,
    db: PgDatabase,
    other: PgDatabase,
    // Dropped last: dropping it drops the database.
    _test_db: TestDatabase,
}

impl Postgres {
    async fn new() -> Postgres {
        let test_db = test_database().await;
        test_db.skip_wal_flush().await.expect("synchronous_commit");
        let relay = Relay::start(test_db.server_address().expect("a TCP server"))
            .await
            .expect("relay");
        let db = PgDatabase::from_pool(test_db.pool_through(relay.addr(), 8));
        db.migrate().await.expect("migrate");
        let other = PgDatabase::from_pool(test_db.pool(8));
        Postgres {
            relay,
            db,
            other,
            _test_db: test_db,
        }
    }
}

impl Backend for Postgres {
    type Src = PgDatabase;
    type Store = PgEventStore;

    fn process(&self) -> (PgDatabase, PgEventStore) {
        (self.db.clone(), PgEventStore::new(&self.db))
    }

    fn another_process(&self) -> (PgDatabase, PgEventStore) {
        (self.other.clone(), PgEventStore::new(&self.other))
    }

    fn lose_next_commit_reply(&self) {
        // `COMMIT` and its NUL, not the `READ COMMITTED` of a `BEGIN` still on its way.
        self.relay.cut_after_client_sends(b"COMMIT\0");
    }
}

combiner_suite!(Postgres::new());

/// `Combiner::submit` from inside `tokio::spawn`, with the concrete Postgres types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_runs_inside_a_spawned_task_with_concrete_postgres_types() {
    let test_db = test_database().await;
    let db = PgDatabase::from_pool(test_db.pool(4));
    db.migrate().await.expect("migrate");
    let store = PgEventStore::new(&db);
    let (shop, _handle) = Shop::new();
    let combiner: Arc<Combiner<PgDatabase, PgEventStore, Shop>> =
        Arc::new(Combiner::new(db.clone(), store.clone(), shop));
    let id = Uuid::now_v7();
    let c = Arc::clone(&combiner);
    let stocked = tokio::spawn(async move { c.submit(id, Cmd::Stock(3)).await })
        .await
        .expect("task");
    assert_eq!(stocked.expect("stocked").last_version(), 1);
    let handlers: Vec<_> = (0..5u32)
        .map(|tag| {
            let c = Arc::clone(&combiner);
            tokio::spawn(async move {
                c.submit(
                    id,
                    Cmd::Reserve {
                        qty: 1,
                        tag,
                        wait: false,
                    },
                )
                .await
            })
        })
        .collect();
    let mut ok = 0;
    for h in handlers {
        match h.await.expect("task") {
            Ok(_) => ok += 1,
            Err(CombineError::Rejected(_)) => {}
            Err(other) => panic!("{other:?}"),
        }
    }
    assert_eq!(ok, 3);
    assert_eq!(suite::reserved_tags(&db, &store, id).await.len(), 3);
}
