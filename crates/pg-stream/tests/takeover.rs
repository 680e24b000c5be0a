//! Expiry, takeover and fencing against a real PostgreSQL, with lock timeouts of 400 ms (or
//! 2 s where a lease must first stay live across a few statements).
//!
//! Waiting for expiry never asserts on elapsed time: the tests wait until the *database* clock
//! has passed the lease's expiry, then check what the lease operations report.

mod common;

use std::time::Duration;

use common::{
    Db, acquire, acquire_by_anyone, inspect_row, long_options, medium_options, short_options,
};
use lockstep_core::Transaction as _;
use lockstep_core::{
    AcquireOutcome, InstanceId, LeaseFence, LockReason, ReleaseOutcome, RenewOutcome,
    StreamLockAdmin, StreamLocker,
};
use lockstep_pg::PgTransaction;
use lockstep_pg_stream::PgStreamLocker;

#[tokio::test]
async fn an_expired_lease_is_taken_over_with_a_new_epoch_and_the_old_holder_is_fenced_out() {
    let db = Db::new(4).await;
    let locker = db.locker(medium_options());
    let (stream, perspective) = db.order_cursor().await;
    let (a, b) = (InstanceId::random(), InstanceId::random());

    let old = acquire(&locker, stream, &perspective, a, LockReason::Rewind).await;
    // While A's lease is live, B is denied and told who holds it.
    match locker
        .try_acquire(stream, &perspective, b, &LockReason::Bootstrap)
        .await
        .expect("try_acquire runs")
    {
        AcquireOutcome::Denied(holder) => {
            assert_eq!(holder.instance, a);
            assert_eq!(holder.reason, LockReason::Rewind);
            assert_eq!(holder.epoch, old.id.epoch);
            assert_eq!(holder.expires_at, old.expires_at);
        }
        other => panic!("expected a denial, got {other:?}"),
    }

    db.wait_until_expired_on_db_clock(old.expires_at).await;
    let new = acquire(&locker, stream, &perspective, b, LockReason::Bootstrap).await;
    assert_eq!(new.id.epoch.get(), old.id.epoch.get() + 1);
    assert_eq!(new.id.holder, b);

    // The old holder's renew, release and fenced commit all fail; B's lease is untouched.
    db.assert_lease_lost(&locker, &old.id, "the old holder's fence must fail")
        .await;

    let row = inspect_row(&locker, stream, &perspective).await;
    assert_eq!(row.holder, Some(b));
    assert_eq!(row.reason, Some(LockReason::Bootstrap));
    assert_eq!(row.epoch, new.id.epoch);
    assert_eq!(row.expires_at, Some(new.expires_at));
    db.fence_outcome(&locker, &new.id)
        .await
        .expect("the new holder's fence passes");
}

#[tokio::test]
async fn reacquiring_an_own_expired_lease_starts_a_new_epoch_and_fences_the_old_one() {
    let db = Db::new(4).await;
    let locker = db.locker(short_options());
    let (stream, perspective) = db.order_cursor().await;
    let a = InstanceId::random();

    let first = acquire(&locker, stream, &perspective, a, LockReason::Rewind).await;
    db.wait_until_expired_on_db_clock(first.expires_at).await;
    // An expired lease cannot be renewed back to life, not even by its holder.
    assert_eq!(
        locker.renew(&first.id).await.expect("renew runs"),
        RenewOutcome::Lost
    );
    let second = acquire(&locker, stream, &perspective, a, LockReason::Rewind).await;
    assert_eq!(second.id.epoch.get(), first.id.epoch.get() + 1);
    db.assert_fenced_out(&locker, &first.id, "the first epoch is fenced out")
        .await;
    assert_eq!(
        locker.release(&first.id).await.expect("release runs"),
        ReleaseOutcome::NotHeld
    );
    assert!(
        locker
            .renew(&second.id)
            .await
            .expect("renew runs")
            .is_renewed()
    );
}

#[tokio::test]
async fn force_release_bumps_the_epoch_and_fences_the_old_holder_out() {
    let db = Db::new(4).await;
    let locker = db.locker(long_options());
    let (stream, perspective) = db.order_cursor().await;
    let (a, b) = (InstanceId::random(), InstanceId::random());
    let old = acquire(&locker, stream, &perspective, a, LockReason::Purge).await;

    assert_eq!(
        locker
            .force_release(stream, &perspective)
            .await
            .expect("force_release runs"),
        ReleaseOutcome::Released
    );
    let row = inspect_row(&locker, stream, &perspective).await;
    assert!(row.is_unlocked());
    assert_eq!(row.epoch.get(), old.id.epoch.get() + 1);

    db.assert_lease_lost(&locker, &old.id, "the force-released holder is fenced out")
        .await;
    // Nothing left to force-release: no change, not even to the epoch.
    assert_eq!(
        locker
            .force_release(stream, &perspective)
            .await
            .expect("force_release runs"),
        ReleaseOutcome::NotHeld
    );
    let next = acquire(&locker, stream, &perspective, b, LockReason::Rewind).await;
    assert_eq!(next.id.epoch.get(), old.id.epoch.get() + 2);
    // The old holder cannot even re-acquire over the new one.
    assert!(matches!(
        locker
            .try_acquire(stream, &perspective, a, &LockReason::Purge)
            .await
            .expect("try_acquire runs"),
        AcquireOutcome::Denied(h) if h.instance == b
    ));
}

/// Waits until some other session of this database waits for a row lock.
async fn wait_for_a_lock_waiter(db: &Db) {
    let observer = db.client().await;
    for _ in 0..400 {
        let waiting: i64 = observer
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND wait_event_type = 'Lock'",
                &[],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no session ever waited for the fenced row lock");
}

#[tokio::test]
async fn a_fence_check_refuses_a_takeover_until_the_fenced_transaction_ends() {
    let db = Db::new(4).await;
    let setup = db.client().await;
    setup
        .batch_execute("CREATE TABLE rebuilt (holder uuid NOT NULL, epoch bigint NOT NULL)")
        .await
        .expect("work table");
    let locker = db.locker(medium_options());
    // B runs on a pool of its own, like another process.
    let other = PgStreamLocker::from_pool(db.other_pool(2), medium_options());
    let (stream, perspective) = db.order_cursor().await;
    let (a, b) = (InstanceId::random(), InstanceId::random());

    let lease = acquire(&locker, stream, &perspective, a, LockReason::Rewind).await;
    let tx = PgTransaction::begin(&db.pool).await.expect("begin");
    locker
        .check_lease(&tx, &lease.id)
        .await
        .expect("the live lease passes the fence");
    tx.client()
        .execute(
            "INSERT INTO rebuilt VALUES ($1, $2)",
            &[&a.as_uuid(), &lease.id.epoch.get()],
        )
        .await
        .expect("fenced work");

    // A's lease expires while its fenced transaction is still open ...
    db.wait_until_expired_on_db_clock(lease.expires_at).await;
    // ... so B's takeover is refused at once (busy: the row is locked), not granted.
    let busy = other
        .try_acquire(stream, &perspective, b, &LockReason::Rewind)
        .await
        .expect("try_acquire runs");
    assert_eq!(
        busy,
        AcquireOutcome::Busy,
        "the takeover is refused while the fenced transaction is open"
    );

    tx.commit().await.expect("the fenced transaction commits");
    let taken = match other
        .try_acquire(stream, &perspective, b, &LockReason::Rewind)
        .await
        .expect("try_acquire runs")
    {
        AcquireOutcome::Acquired(lease) => lease,
        other => panic!("after the fenced commit the expired lease is taken over: {other:?}"),
    };
    assert_eq!(taken.id.epoch.get(), lease.id.epoch.get() + 1);
    assert_eq!(
        locker.renew(&lease.id).await.expect("renew runs"),
        RenewOutcome::Lost
    );

    let rows = setup
        .query("SELECT holder, epoch FROM rebuilt", &[])
        .await
        .expect("work rows");
    assert_eq!(rows.len(), 1, "A's fenced work committed exactly once");
    assert_eq!(rows[0].get::<_, uuid::Uuid>(0), a.as_uuid());
}

#[tokio::test]
async fn a_fence_check_makes_a_force_release_wait_and_changes_no_lease_column() {
    let db = Db::new(4).await;
    let locker = db.locker(long_options());
    let admin = PgStreamLocker::from_pool(db.other_pool(2), long_options());
    let (stream, perspective) = db.order_cursor().await;
    let lease = acquire_by_anyone(&locker, stream, &perspective).await;
    let before = db.lease_snapshot().await;

    let tx = PgTransaction::begin(&db.pool).await.expect("begin");
    locker
        .check_lease(&tx, &lease.id)
        .await
        .expect("the live lease passes the fence");
    let persp = perspective.clone();
    let forced = tokio::spawn(async move { admin.force_release(stream, &persp).await });
    wait_for_a_lock_waiter(&db).await;
    assert!(!forced.is_finished(), "force-release waits for the fence");
    assert_eq!(
        db.lease_snapshot().await,
        before,
        "the fence itself changes no lease column"
    );
    tx.rollback().await.expect("rollback");

    assert_eq!(
        forced
            .await
            .expect("the force-release task")
            .expect("force_release runs"),
        ReleaseOutcome::Released
    );
    db.assert_fenced_out(&locker, &lease.id, "fenced out after the force-release")
        .await;
}
