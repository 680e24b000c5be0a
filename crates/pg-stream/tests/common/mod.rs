//! Shared set-up of the Postgres tests: a fresh, migrated database per test, short lease
//! timings, and the helpers several test files use (acquiring, waiting on the database clock,
//! checking the fence).

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::time::Duration;

use deadpool_postgres::Pool;
use lockstep_core::Transaction as _;
use lockstep_core::{
    AcquireOutcome, CursorLease, ErrorKind, InstanceId, LeaseFence, LeaseId, LockReason,
    PerspectiveName, ReleaseOutcome, RenewOutcome, StreamId, StreamLease, StreamLockAdmin,
    StreamLockOptions, StreamLocker,
};
use lockstep_pg::PgTransaction;
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};
use time::OffsetDateTime;

/// Lock timeout of the short-lived leases the tests expire.
pub(crate) const LOCK_TIMEOUT: Duration = Duration::from_millis(400);
/// Keepalive interval that goes with [`LOCK_TIMEOUT`].
pub(crate) const KEEPALIVE: Duration = Duration::from_millis(100);
/// How long to wait for a [`LOCK_TIMEOUT`] lease to be expired on the database clock.
pub(crate) const PAST_EXPIRY: Duration = Duration::from_millis(600);

pub(crate) fn short_options() -> StreamLockOptions {
    StreamLockOptions::new(LOCK_TIMEOUT, KEEPALIVE).expect("400 ms / 100 ms is a valid pair")
}

/// Leases that expire within a test but stay live across a few statements even on a loaded
/// machine (for tests that need a live lease first and an expired one later).
pub(crate) fn medium_options() -> StreamLockOptions {
    StreamLockOptions::new(Duration::from_secs(2), Duration::from_millis(500))
        .expect("2 s / 500 ms is a valid pair")
}

pub(crate) fn long_options() -> StreamLockOptions {
    StreamLockOptions::new(Duration::from_secs(60), Duration::from_secs(20))
        .expect("60 s / 20 s is a valid pair")
}

/// A migrated database of this test's own.
pub(crate) struct Db {
    pub(crate) db: TestDatabase,
    pub(crate) pool: Pool,
}

impl Db {
    /// A fresh database with the schema applied; commits do not wait for the WAL flush (the
    /// tests check lease semantics, not durability, and run faster that way).
    pub(crate) async fn new(pool_size: usize) -> Db {
        let db = test_database().await;
        db.skip_wal_flush()
            .await
            .expect("setting synchronous_commit for the test database");
        let pool = db.pool(pool_size);
        lockstep_pg::migrate(&pool).await.expect("migrations apply");
        Db { db, pool }
    }

    pub(crate) fn locker(&self, options: StreamLockOptions) -> PgStreamLocker {
        PgStreamLocker::from_pool(self.pool.clone(), options)
    }

    /// Another pool on the same database (a second "process").
    pub(crate) fn other_pool(&self, size: usize) -> Pool {
        self.db.pool(size)
    }

    pub(crate) async fn client(&self) -> tokio_postgres::Client {
        self.db.connect().await
    }

    /// Creates the unlocked cursor row of a pair.
    pub(crate) async fn create_cursor(&self, stream_id: StreamId, perspective: &PerspectiveName) {
        create_cursor(&self.pool, stream_id, perspective).await;
    }

    /// A fresh stream with an unlocked `OrderPerspective` cursor row.
    pub(crate) async fn order_cursor(&self) -> (StreamId, PerspectiveName) {
        let (stream, perspective) = (StreamId::new_v7(), name("OrderPerspective"));
        self.create_cursor(stream, &perspective).await;
        (stream, perspective)
    }

    /// `count` fresh streams, each with an unlocked `OrderPerspective` cursor row.
    pub(crate) async fn order_cursors(&self, count: usize) -> (Vec<StreamId>, PerspectiveName) {
        let perspective = name("OrderPerspective");
        let streams: Vec<StreamId> = (0..count).map(|_| StreamId::new_v7()).collect();
        for s in &streams {
            self.create_cursor(*s, &perspective).await;
        }
        (streams, perspective)
    }

    /// Every row's lease columns, in key order, to show that nothing else changed.
    pub(crate) async fn lease_snapshot(&self) -> Vec<LeaseRow> {
        let client = self.pool.get().await.expect("connection");
        client
            .query(
                "SELECT stream_id, perspective_name, stream_lock_instance_id, \
                        stream_lock_reason, stream_lock_expiry, stream_lock_epoch \
                   FROM wh_perspective_cursors ORDER BY stream_id, perspective_name COLLATE \"C\"",
                &[],
            )
            .await
            .expect("snapshot of the cursor table")
            .iter()
            .map(|r| LeaseRow {
                stream_id: r.get(0),
                perspective: r.get(1),
                holder: r.get(2),
                reason: r.get(3),
                expiry: r.get(4),
                epoch: r.get(5),
            })
            .collect()
    }

    /// The database clock.
    pub(crate) async fn db_now(&self) -> time::OffsetDateTime {
        let client = self.pool.get().await.expect("connection");
        client
            .query_one("SELECT clock_timestamp()", &[])
            .await
            .expect("clock_timestamp()")
            .get(0)
    }

    /// Waits until the database clock is past `expires_at` (bounded, so a broken clock fails the
    /// test instead of hanging it).
    pub(crate) async fn wait_until_expired_on_db_clock(&self, expires_at: OffsetDateTime) {
        for _ in 0..200 {
            if self.db_now().await > expires_at {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the database clock never passed {expires_at}");
    }

    /// What `locker`'s fence says about `lease`, checked in a transaction of its own on this
    /// database's pool (rolled back afterwards).
    pub(crate) async fn fence_outcome(
        &self,
        locker: &PgStreamLocker,
        lease: &LeaseId,
    ) -> lockstep_core::Result<()> {
        let tx = PgTransaction::begin(&self.pool).await.expect("begin");
        let checked = locker.check_lease(&tx, lease).await;
        tx.rollback().await.expect("rollback");
        checked
    }

    /// Asserts that `lease` fails `locker`'s fence with `LeaseLost`; `why` is the message if the
    /// fence passes instead.
    pub(crate) async fn assert_fenced_out(
        &self,
        locker: &PgStreamLocker,
        lease: &LeaseId,
        why: &str,
    ) {
        let err = self.fence_outcome(locker, lease).await.expect_err(why);
        assert_eq!(err.kind(), ErrorKind::LeaseLost, "{why}: {err}");
    }

    /// Asserts that the holder of `lease`, which it has lost (to a takeover or a force-release),
    /// can no longer renew it, release it, or pass the fence with it; `why` is the message if
    /// the fence passes.
    pub(crate) async fn assert_lease_lost(
        &self,
        locker: &PgStreamLocker,
        lease: &LeaseId,
        why: &str,
    ) {
        assert_eq!(
            locker.renew(lease).await.expect("renew runs"),
            RenewOutcome::Lost
        );
        assert_eq!(
            locker.release(lease).await.expect("release runs"),
            ReleaseOutcome::NotHeld
        );
        self.assert_fenced_out(locker, lease, why).await;
    }
}

/// The admin view of a pair's cursor row, which must exist.
pub(crate) async fn inspect_row(
    locker: &PgStreamLocker,
    stream_id: StreamId,
    perspective: &PerspectiveName,
) -> CursorLease {
    locker
        .inspect(stream_id, perspective)
        .await
        .expect("inspect runs")
        .expect("the cursor row exists")
}

/// Acquires the lease of a pair, panicking on any outcome but `Acquired`.
pub(crate) async fn acquire(
    locker: &PgStreamLocker,
    stream_id: StreamId,
    perspective: &PerspectiveName,
    instance: InstanceId,
    reason: LockReason,
) -> StreamLease {
    match locker
        .try_acquire(stream_id, perspective, instance, &reason)
        .await
        .expect("try_acquire runs")
    {
        AcquireOutcome::Acquired(lease) => lease,
        other => panic!("expected the lease to be acquired, got {other:?}"),
    }
}

/// Acquires the lease of a pair for a new, random instance, for `Rewind`.
pub(crate) async fn acquire_by_anyone(
    locker: &PgStreamLocker,
    stream_id: StreamId,
    perspective: &PerspectiveName,
) -> StreamLease {
    acquire(
        locker,
        stream_id,
        perspective,
        InstanceId::random(),
        LockReason::Rewind,
    )
    .await
}

pub(crate) async fn create_cursor(pool: &Pool, stream_id: StreamId, perspective: &PerspectiveName) {
    let client = pool.get().await.expect("connection");
    client
        .execute(
            "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)",
            &[&stream_id.as_uuid(), &perspective.as_str()],
        )
        .await
        .expect("inserting a cursor row");
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LeaseRow {
    pub(crate) stream_id: uuid::Uuid,
    pub(crate) perspective: String,
    pub(crate) holder: Option<uuid::Uuid>,
    pub(crate) reason: Option<String>,
    pub(crate) expiry: Option<time::OffsetDateTime>,
    pub(crate) epoch: i64,
}

pub(crate) fn name(s: &str) -> PerspectiveName {
    PerspectiveName::new(s).expect("a valid perspective name")
}
