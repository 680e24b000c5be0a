//! The stream locker on sqlx (`PgStreamLocker::for_sqlx`, fenced commits in `SqlxTransaction`s)
//! against a real PostgreSQL, a database per test: the same stream-locker, fleet and lease-fence
//! conformance suites as on tokio-postgres, one test per case; the locker used from spawned
//! tasks with the concrete types; and what an abandoned statement does to its connection.

use std::time::Duration;

use lockstep_core::{
    AcquireOutcome, InstanceId, LeaseFence as _, LockReason, PerspectiveName, ReleaseOutcome,
    RenewOutcome, StreamId, StreamLockAdmin as _, StreamLockOptions, StreamLocker as _,
    Transaction as _, TransactionSource as _,
};
use lockstep_pg::sqlx::{SqlxDatabase, SqlxTransaction};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::conformance::lease_fence::LeaseFenceFixture;
use lockstep_testkit::conformance::stream_locker::{FleetFixture, StreamLockerFixture};
use lockstep_testkit::pg_harness::{TestDatabase, test_database, until_lock_waiters};

/// A 400 ms lock timeout (keepalive 100 ms), so the suites' leases expire within a test.
fn short_options() -> StreamLockOptions {
    StreamLockOptions::new(Duration::from_millis(400), Duration::from_millis(100))
        .expect("400 ms / 100 ms is a valid pair")
}

/// A migrated database of the test's own and its sqlx handle (`size` connections).
async fn migrated(size: u32) -> (TestDatabase, SqlxDatabase) {
    let db = test_database().await;
    db.skip_wal_flush()
        .await
        .expect("setting synchronous_commit for the test database");
    lockstep_pg::migrate(&db.pool(1)).await.expect("migrate");
    let source = SqlxDatabase::new(db.sqlx_pool(size));
    (db, source)
}

/// Creates the unlocked cursor row of a pair, with sqlx.
async fn create_cursor(source: &SqlxDatabase, stream_id: StreamId, perspective: &PerspectiveName) {
    sqlx::query("INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)")
        .bind(stream_id.as_uuid())
        .bind(perspective.as_str())
        .execute(source.pool())
        .await
        .expect("inserting a cursor row");
}

/// The locker built for sqlx, on the test's database.
struct Fixture {
    _db: TestDatabase,
    source: SqlxDatabase,
    locker: PgStreamLocker,
}

impl StreamLockerFixture for Fixture {
    type Locker = PgStreamLocker;
    type Admin = PgStreamLocker;

    fn locker(&self) -> &PgStreamLocker {
        &self.locker
    }

    fn admin(&self) -> &PgStreamLocker {
        &self.locker
    }

    async fn create_cursor(&self, stream_id: StreamId, perspective: &PerspectiveName) {
        create_cursor(&self.source, stream_id, perspective).await;
    }
}

impl FleetFixture for Fixture {
    type Fleet = PgStreamLocker;
    type FleetAdmin = PgStreamLocker;

    fn fleet(&self) -> &PgStreamLocker {
        &self.locker
    }

    fn fleet_admin(&self) -> &PgStreamLocker {
        &self.locker
    }
}

/// Fenced commits in `SqlxTransaction`s on the locker's pool.
impl LeaseFenceFixture for Fixture {
    type Tx = SqlxTransaction;
    type Source = SqlxDatabase;
    type Fence = PgStreamLocker;

    fn fence(&self) -> &PgStreamLocker {
        &self.locker
    }

    fn source(&self) -> &SqlxDatabase {
        &self.source
    }
}

async fn fixture() -> Fixture {
    let (db, source) = migrated(4).await;
    let locker = PgStreamLocker::for_sqlx(&source, short_options());
    Fixture {
        _db: db,
        source,
        locker,
    }
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

fn name(s: &str) -> PerspectiveName {
    PerspectiveName::new(s).expect("valid perspective name")
}

/// The locker on sqlx from spawned tasks, with the concrete types: one instance acquires,
/// renews, passes the fence in an `SqlxTransaction` and releases; two lockers (two
/// "processes") racing for one pair from their own tasks: exactly one wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_locker_on_sqlx_acquires_renews_and_releases_from_spawned_tasks() {
    let (db, source) = migrated(8).await;
    let (stream, perspective) = (StreamId::new_v7(), name("OrderPerspective"));
    create_cursor(&source, stream, &perspective).await;
    let locker = PgStreamLocker::for_sqlx(&source, short_options());

    let task = {
        let (locker, source, perspective) = (locker.clone(), source.clone(), perspective.clone());
        tokio::spawn(async move {
            let instance = InstanceId::random();
            let AcquireOutcome::Acquired(lease) = locker
                .try_acquire(stream, &perspective, instance, &LockReason::Rewind)
                .await?
            else {
                panic!("a free pair is acquired");
            };
            let renewed = locker.renew(&lease.id).await?;
            let tx: SqlxTransaction = source.begin().await?;
            locker.check_lease(&tx, &lease.id).await?;
            tx.commit().await?;
            let released = locker.release(&lease.id).await?;
            Ok::<_, lockstep_core::Error>((renewed, released))
        })
    };
    let (renewed, released) = task.await.expect("task").expect("lease calls");
    assert!(
        matches!(renewed, RenewOutcome::Renewed { .. }),
        "{renewed:?}"
    );
    assert_eq!(released, ReleaseOutcome::Released);

    // Two lockers on pools of their own race for the pair: one acquires, the other is denied
    // (or finds the row busy while the winner's statement holds it).
    let other = PgStreamLocker::for_sqlx(&SqlxDatabase::new(db.sqlx_pool(2)), short_options());
    let race = |locker: PgStreamLocker| {
        let perspective = perspective.clone();
        tokio::spawn(async move {
            locker
                .try_acquire(
                    stream,
                    &perspective,
                    InstanceId::random(),
                    &LockReason::Rewind,
                )
                .await
        })
    };
    let (a, b) = (race(locker), race(other));
    let outcomes = [
        a.await.expect("task").expect("try-acquire"),
        b.await.expect("task").expect("try-acquire"),
    ];
    let won = outcomes
        .iter()
        .filter(|o| matches!(o, AcquireOutcome::Acquired(_)))
        .count();
    assert_eq!(won, 1, "exactly one wins: {outcomes:?}");
    assert!(
        outcomes.iter().all(|o| matches!(
            o,
            AcquireOutcome::Acquired(_) | AcquireOutcome::Denied(_) | AcquireOutcome::Busy
        )),
        "{outcomes:?}"
    );
}

/// A renew abandoned while it waits for the cursor row (locked by a fenced commit in flight)
/// closes its connection: it is never pooled again mid-statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_statement_on_sqlx_closes_its_connection() {
    let (db, source) = migrated(4).await;
    let (stream, perspective) = (StreamId::new_v7(), name("OrderPerspective"));
    create_cursor(&source, stream, &perspective).await;
    let locker = PgStreamLocker::for_sqlx(&source, short_options());
    let AcquireOutcome::Acquired(lease) = locker
        .try_acquire(
            stream,
            &perspective,
            InstanceId::random(),
            &LockReason::Rewind,
        )
        .await
        .expect("try-acquire")
    else {
        panic!("a free pair is acquired");
    };
    let fenced: SqlxTransaction = source.begin().await.expect("begin");
    locker
        .check_lease(&fenced, &lease.id)
        .await
        .expect("the lease is held");

    let renew = tokio::spawn({
        let (locker, id) = (locker.clone(), lease.id.clone());
        async move { locker.renew(&id).await }
    });
    let client = db.connect().await;
    until_lock_waiters(&client, 1, "the renew behind the fenced commit").await;
    let opened = source.pool().size();
    renew.abort();
    assert!(renew.await.is_err_and(|e| e.is_cancelled()));
    assert_eq!(
        source.pool().size(),
        opened - 1,
        "the abandoned renew's connection is closed, not pooled"
    );
    fenced.rollback().await.expect("rollback");
}

/// An expiry lockstep cannot read (an operator's `'infinity'`) is a typed error naming the row
/// on sqlx too, never a panic (sqlx's own decoding of such a time would panic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_infinite_expiry_on_sqlx_is_a_typed_error_naming_the_row() {
    let (_db, source) = migrated(2).await;
    let (stream, perspective) = (StreamId::new_v7(), name("OrderPerspective"));
    create_cursor(&source, stream, &perspective).await;
    let options = StreamLockOptions::new(Duration::from_secs(60), Duration::from_secs(20))
        .expect("60 s / 20 s is a valid pair");
    let locker = PgStreamLocker::for_sqlx(&source, options);
    let AcquireOutcome::Acquired(lease) = locker
        .try_acquire(
            stream,
            &perspective,
            InstanceId::random(),
            &LockReason::Rewind,
        )
        .await
        .expect("try-acquire")
    else {
        panic!("a free pair is acquired");
    };
    sqlx::query("UPDATE wh_perspective_cursors SET stream_lock_expiry = 'infinity'")
        .execute(source.pool())
        .await
        .expect("operator update");

    let unreadable = |err: lockstep_core::Error| {
        assert_eq!(err.kind(), lockstep_core::ErrorKind::Backend, "{err}");
        assert!(err.message().contains(&stream.to_string()), "{err}");
        assert!(err.message().contains("expiry"), "{err}");
    };
    unreadable(locker.list_leases().await.expect_err("unreadable"));
    unreadable(
        locker
            .inspect(stream, &perspective)
            .await
            .expect_err("unreadable"),
    );
    unreadable(
        locker
            .try_acquire(
                stream,
                &perspective,
                InstanceId::random(),
                &LockReason::Rewind,
            )
            .await
            .expect_err("unreadable"),
    );
    let entries = locker.list_lease_entries().await.expect("listing");
    assert!(
        matches!(
            entries.as_slice(),
            [lockstep_core::LeaseEntry::Unreadable(_)]
        ),
        "{entries:?}"
    );
    assert!(locker.renew(&lease.id).await.expect("renew").is_renewed());
    assert!(
        locker
            .release(&lease.id)
            .await
            .expect("release")
            .is_released()
    );
}
