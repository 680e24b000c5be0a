//! The testkit's stream-locker (with the fleet's cases) and lease-fence conformance suites, run
//! against PostgreSQL: the
//! same cases the in-memory locker passes, one test per case, each on a database of its own.

mod common;

use common::{Db, create_cursor, short_options};
use lockstep_core::{PerspectiveName, StreamId};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::conformance::lease_fence::LeaseFenceFixture;
use lockstep_testkit::conformance::stream_locker::{FleetFixture, StreamLockerFixture};

/// A locker with a 400 ms lock timeout (keepalive 100 ms) on a database of the test's own.
struct PgFixture {
    db: Db,
    source: PgDatabase,
    locker: PgStreamLocker,
}

impl StreamLockerFixture for PgFixture {
    type Locker = PgStreamLocker;
    type Admin = PgStreamLocker;

    fn locker(&self) -> &PgStreamLocker {
        &self.locker
    }

    fn admin(&self) -> &PgStreamLocker {
        &self.locker
    }

    async fn create_cursor(&self, stream_id: StreamId, perspective: &PerspectiveName) {
        create_cursor(&self.db.pool, stream_id, perspective).await;
    }
}

/// The locker keeps the fleet too.
impl FleetFixture for PgFixture {
    type Fleet = PgStreamLocker;
    type FleetAdmin = PgStreamLocker;

    fn fleet(&self) -> &PgStreamLocker {
        &self.locker
    }

    fn fleet_admin(&self) -> &PgStreamLocker {
        &self.locker
    }
}

/// Fenced commits in owned `PgTransaction`s on the locker's pool.
impl LeaseFenceFixture for PgFixture {
    type Tx = PgTransaction;
    type Source = PgDatabase;
    type Fence = PgStreamLocker;

    fn fence(&self) -> &PgStreamLocker {
        &self.locker
    }

    fn source(&self) -> &PgDatabase {
        &self.source
    }
}

async fn fixture() -> PgFixture {
    let db = Db::new(4).await;
    let locker = db.locker(short_options());
    let source = PgDatabase::from_pool(db.pool.clone());
    PgFixture { db, source, locker }
}

mod stream_locker {
    use super::*;

    lockstep_testkit::stream_locker_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture().await,
    }
}

mod fleet {
    use super::*;

    lockstep_testkit::fleet_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture().await,
    }
}

mod lease_fence {
    use super::*;

    lockstep_testkit::lease_fence_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture().await,
    }
}
