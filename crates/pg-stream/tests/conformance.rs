//! The testkit's stream-locker conformance suite, run against PostgreSQL: the same cases the
//! in-memory locker passes.

mod common;

use std::sync::Arc;

use common::{Db, create_cursor, short_options};
use lockstep_core::{PerspectiveName, StreamId, StreamLockAdmin, StreamLocker, async_trait};
use lockstep_pg_stream::PostgresStreamLocker;
use lockstep_testkit::conformance::stream_locker::{StreamLockerFixture, run_all};

/// A locker with a 400 ms lock timeout (keepalive 100 ms) on a database of the test's own.
struct PgFixture {
    db: Db,
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

#[tokio::test]
async fn postgres_stream_locker_passes_the_conformance_suite() {
    let db = Db::new(4).await;
    let locker = Arc::new(db.locker(short_options()));
    let fixture = PgFixture { db, locker };
    run_all(&fixture).await;
}
