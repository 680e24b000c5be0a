//! The testkit's stream-locker and lease-fence conformance suites, run against PostgreSQL: the
//! same cases the in-memory locker passes.

mod common;

use std::sync::Arc;

use common::{Db, create_cursor, short_options};
use lockstep_core::{PerspectiveName, StreamId, StreamLockAdmin, StreamLocker, async_trait};
use lockstep_pg::{PgTransaction, PgTransactionSource};
use lockstep_pg_stream::PostgresStreamLocker;
use lockstep_testkit::conformance::lease_fence::{self, LeaseFenceFixture};
use lockstep_testkit::conformance::stream_locker::{self, StreamLockerFixture};

/// A locker with a 400 ms lock timeout (keepalive 100 ms) on a database of the test's own.
struct PgFixture {
    db: Db,
    source: PgTransactionSource,
    locker: Arc<PostgresStreamLocker>,
}

#[async_trait]
impl StreamLockerFixture for PgFixture {
    fn locker(&self) -> Arc<dyn StreamLocker> {
        self.locker.clone()
    }

    fn admin(&self) -> Arc<dyn StreamLockAdmin> {
        self.locker.clone()
    }

    async fn create_cursor(&self, stream_id: StreamId, perspective: &PerspectiveName) {
        create_cursor(&self.db.pool, stream_id, perspective).await;
    }
}

/// Fenced commits in owned `PgTransaction`s on the locker's pool.
impl LeaseFenceFixture for PgFixture {
    type Tx = PgTransaction;
    type Source = PgTransactionSource;
    type Fence = PostgresStreamLocker;

    fn fence(&self) -> &PostgresStreamLocker {
        &self.locker
    }

    fn source(&self) -> &PgTransactionSource {
        &self.source
    }
}

async fn fixture() -> PgFixture {
    let db = Db::new(4).await;
    let locker = Arc::new(db.locker(short_options()));
    let source = PgTransactionSource::new(db.pool.clone());
    PgFixture { db, source, locker }
}

#[tokio::test]
async fn postgres_stream_locker_passes_the_conformance_suite() {
    stream_locker::run_all(&fixture().await).await;
}

#[tokio::test]
async fn postgres_lease_fence_passes_the_conformance_suite() {
    lease_fence::run_all(Arc::new(fixture().await)).await;
}
