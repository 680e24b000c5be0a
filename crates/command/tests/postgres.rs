//! The command runner on PostgreSQL (a database per test): the shared suite, every command
//! handled from inside `tokio::spawn` with the concrete Postgres types (`PgDatabase`,
//! `PgEventStore`, the advisory write lock behind `load_locked`).

mod suite;

use std::sync::Arc;

use lockstep_pg::PgDatabase;
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};
use lockstep_testkit::relay::Relay;

use suite::Backend;

struct Postgres {
    /// The connections of `db` go through it, so a test can cut one after its `COMMIT`.
    relay: Arc<Relay>,
    db: PgDatabase,
    // Dropped last: dropping it drops the database.
    _test_db: Arc<TestDatabase>,
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
        Postgres {
            relay: Arc::new(relay),
            db,
            _test_db: Arc::new(test_db),
        }
    }
}

impl Backend for Postgres {
    type Src = PgDatabase;
    type Store = PgEventStore;

    fn process(&self) -> (PgDatabase, PgEventStore) {
        (self.db.clone(), PgEventStore::new(&self.db))
    }

    fn lose_next_commit_reply(&self) {
        // `COMMIT` and its NUL, not the `READ COMMITTED` of a `BEGIN` still on its way.
        self.relay.cut_after_client_sends(b"COMMIT\0");
    }
}

runner_suite!(Postgres::new().await);
