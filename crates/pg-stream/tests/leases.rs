//! Lease operations and the admin view against a real PostgreSQL: what a user of the locker
//! sees from each call, and what is stored.

mod common;

use std::time::Duration;

use common::{Db, acquire, acquire_by_anyone, inspect_row, long_options, name, short_options};
use lockstep_core::{
    AcquireOutcome, InstanceId, LeaseEpoch, LeaseId, LeaseStatus, LockReason, ReleaseOutcome,
    RenewOutcome, StreamId, StreamLockAdmin, StreamLocker,
};

#[tokio::test]
async fn try_acquire_without_a_cursor_row_reports_no_cursor_and_creates_none() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let outcome = locker
        .try_acquire(
            StreamId::new_v7(),
            &name("OrderPerspective"),
            InstanceId::random(),
            &LockReason::Rewind,
        )
        .await
        .expect("try_acquire runs");
    assert_eq!(outcome, AcquireOutcome::NoCursor);
    assert!(db.lease_snapshot().await.is_empty());
}

#[tokio::test]
async fn the_first_acquire_starts_epoch_one_and_expires_on_the_database_clock() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (stream, perspective) = db.order_cursor().await;
    let timeout = long_options().lock_timeout();

    let before = db.db_now().await;
    let lease = acquire_by_anyone(&locker, stream, &perspective).await;
    let after = db.db_now().await;
    assert_eq!(lease.id.epoch, LeaseEpoch::new(1));
    // expiry = the server's clock_timestamp() during the statement + the lock timeout.
    assert!(
        lease.expires_at >= before + timeout,
        "{lease:?} vs {before}"
    );
    assert!(lease.expires_at <= after + timeout, "{lease:?} vs {after}");
}

#[tokio::test]
async fn reacquiring_an_own_live_lease_keeps_the_epoch_refreshes_the_expiry_and_overwrites_the_reason()
 {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (stream, perspective) = db.order_cursor().await;
    let a = InstanceId::random();

    let first = acquire(&locker, stream, &perspective, a, LockReason::Rewind).await;
    let again = acquire(&locker, stream, &perspective, a, LockReason::Bootstrap).await;
    assert_eq!(again.id, first.id);
    assert!(again.expires_at > first.expires_at);
    let row = inspect_row(&locker, stream, &perspective).await;
    assert_eq!(row.reason, Some(LockReason::Bootstrap));
    assert_eq!(row.expires_at, Some(again.expires_at));
    assert_eq!(row.epoch, first.id.epoch);
}

#[tokio::test]
async fn release_clears_the_lease_but_keeps_the_epoch_and_the_next_holder_gets_the_next_one() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (stream, perspective) = db.order_cursor().await;
    let (a, b) = (InstanceId::random(), InstanceId::random());

    let lease = acquire(&locker, stream, &perspective, a, LockReason::Rewind).await;
    // Another instance cannot release it.
    let mut foreign = lease.id.clone();
    foreign.holder = b;
    assert_eq!(
        locker.release(&foreign).await.expect("release runs"),
        ReleaseOutcome::NotHeld
    );
    assert_eq!(
        locker.release(&lease.id).await.expect("release runs"),
        ReleaseOutcome::Released
    );
    let row = inspect_row(&locker, stream, &perspective).await;
    assert!(row.is_unlocked());
    assert_eq!(row.epoch, lease.id.epoch);
    // Releasing twice is not an error.
    assert_eq!(
        locker.release(&lease.id).await.expect("release runs"),
        ReleaseOutcome::NotHeld
    );
    let next = acquire(&locker, stream, &perspective, b, LockReason::Bootstrap).await;
    assert_eq!(next.id.epoch.get(), lease.id.epoch.get() + 1);
    // Even the same instance gets a new epoch after a release.
    assert_eq!(
        locker.release(&next.id).await.expect("release runs"),
        ReleaseOutcome::Released
    );
    let again = acquire(&locker, stream, &perspective, b, LockReason::Bootstrap).await;
    assert_eq!(again.id.epoch.get(), next.id.epoch.get() + 1);
}

#[tokio::test]
async fn renew_extends_only_the_holders_lease_at_its_epoch() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (stream, perspective) = db.order_cursor().await;
    let (a, b) = (InstanceId::random(), InstanceId::random());
    let lease = acquire(&locker, stream, &perspective, a, LockReason::Rewind).await;

    let renewed = match locker.renew(&lease.id).await.expect("renew runs") {
        RenewOutcome::Renewed { expires_at } => expires_at,
        RenewOutcome::Lost => panic!("the holder's renew must succeed"),
    };
    assert!(renewed > lease.expires_at);

    let before = db.lease_snapshot().await;
    let mut by_other = lease.id.clone();
    by_other.holder = b;
    let mut stale_epoch = lease.id.clone();
    stale_epoch.epoch = LeaseEpoch::new(lease.id.epoch.get() + 7);
    assert_eq!(
        locker.renew(&by_other).await.expect("renew runs"),
        RenewOutcome::Lost
    );
    assert_eq!(
        locker.renew(&stale_epoch).await.expect("renew runs"),
        RenewOutcome::Lost
    );
    assert_eq!(
        db.lease_snapshot().await,
        before,
        "refused renews change nothing"
    );
}

#[tokio::test]
async fn renew_many_renews_in_one_batch_and_reports_in_input_order() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let a = InstanceId::random();
    let (streams, perspective) = db.order_cursors(4).await;
    let held_1 = acquire(&locker, streams[0], &perspective, a, LockReason::Rewind).await;
    let held_2 = acquire(&locker, streams[1], &perspective, a, LockReason::Rewind).await;
    let forced = acquire(&locker, streams[2], &perspective, a, LockReason::Rewind).await;
    let _ = locker
        .force_release(streams[2], &perspective)
        .await
        .expect("force_release runs");
    let no_row = LeaseId::new(
        StreamId::new_v7(),
        perspective.clone(),
        a,
        LeaseEpoch::new(1),
    );
    let mut someone_else = held_1.id.clone();
    someone_else.holder = InstanceId::random();

    // Listed out of key order, with a duplicate.
    let batch = vec![
        held_2.id.clone(),
        no_row,
        held_1.id.clone(),
        forced.id.clone(),
        someone_else,
        held_2.id.clone(),
    ];
    let outcomes = locker.renew_many(&batch).await.expect("renew_many runs");
    let renewed: Vec<bool> = outcomes.iter().map(RenewOutcome::is_renewed).collect();
    assert_eq!(renewed, vec![true, false, true, false, false, true]);
    let expiry_of = |i: usize| match outcomes[i] {
        RenewOutcome::Renewed { expires_at } => expires_at,
        RenewOutcome::Lost => panic!("outcome {i} should be renewed"),
    };
    assert!(expiry_of(0) > held_2.expires_at);
    assert!(expiry_of(2) > held_1.expires_at);
    assert_eq!(expiry_of(0), expiry_of(5));
    let stored = inspect_row(&locker, streams[0], &perspective).await;
    assert_eq!(stored.expires_at, Some(expiry_of(2)));
    assert_eq!(
        locker.renew_many(&[]).await.expect("empty batch"),
        Vec::new()
    );
}

#[tokio::test]
async fn renew_many_never_resurrects_an_expired_lease() {
    let db = Db::new(2).await;
    let locker = db.locker(short_options());
    let (stream, perspective) = db.order_cursor().await;
    let lease = acquire_by_anyone(&locker, stream, &perspective).await;
    db.wait_until_expired_on_db_clock(lease.expires_at).await;
    assert_eq!(
        locker
            .renew_many(std::slice::from_ref(&lease.id))
            .await
            .expect("renew_many runs"),
        vec![RenewOutcome::Lost]
    );
}

#[tokio::test]
async fn admin_lists_held_and_expired_leases_with_time_left_on_the_database_clock() {
    let db = Db::new(2).await;
    let long = db.locker(long_options());
    let short = db.locker(short_options());
    let (a, b) = (InstanceId::random(), InstanceId::random());
    let mut streams: Vec<StreamId> = (0..3).map(|_| StreamId::new_v7()).collect();
    streams.sort();
    let (p1, p2) = (name("Alpha"), name("beta"));
    for s in &streams {
        db.create_cursor(*s, &p1).await;
        db.create_cursor(*s, &p2).await;
    }
    let held_b = acquire(&long, streams[1], &p2, b, LockReason::Bootstrap).await;
    let held_a = acquire(&long, streams[1], &p1, a, LockReason::Rewind).await;
    let expired = acquire(&short, streams[0], &p2, a, LockReason::Purge).await;
    db.wait_until_expired_on_db_clock(expired.expires_at).await;

    let leases = long.list_leases().await.expect("list_leases runs");
    let keys: Vec<(StreamId, &str)> = leases
        .iter()
        .map(|l| (l.stream_id, l.perspective.as_str()))
        .collect();
    assert_eq!(
        keys,
        vec![
            (streams[0], "beta"),
            (streams[1], "Alpha"),
            (streams[1], "beta")
        ]
    );
    let first = &leases[0];
    assert_eq!(first.status, LeaseStatus::Expired);
    assert_eq!(first.time_left, Duration::ZERO);
    assert_eq!(first.holder, a);
    assert_eq!(first.reason, LockReason::Purge);
    assert_eq!(first.expires_at, expired.expires_at);
    for (info, lease) in [(&leases[1], &held_a), (&leases[2], &held_b)] {
        assert_eq!(info.status, LeaseStatus::Held);
        assert_eq!(info.holder, lease.id.holder);
        assert_eq!(info.epoch, lease.id.epoch);
        assert_eq!(info.reason, lease.reason);
        assert_eq!(info.expires_at, lease.expires_at);
        assert!(info.time_left > Duration::ZERO);
        assert!(info.time_left <= long_options().lock_timeout());
    }
}

#[tokio::test]
async fn release_all_held_by_clears_only_that_instances_leases_and_keeps_their_epochs() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (a, b) = (InstanceId::random(), InstanceId::random());
    let (streams, perspective) = db.order_cursors(3).await;
    let a1 = acquire(&locker, streams[0], &perspective, a, LockReason::Rewind).await;
    let a2 = acquire(&locker, streams[1], &perspective, a, LockReason::Bootstrap).await;
    let b1 = acquire(&locker, streams[2], &perspective, b, LockReason::Rewind).await;

    assert_eq!(
        locker
            .release_all_held_by(a)
            .await
            .expect("release_all runs"),
        2
    );
    for lease in [&a1, &a2] {
        let row = inspect_row(&locker, lease.id.stream_id, &perspective).await;
        assert!(row.is_unlocked());
        assert_eq!(row.epoch, lease.id.epoch);
    }
    let kept = inspect_row(&locker, streams[2], &perspective).await;
    assert_eq!(kept.holder, Some(b));
    assert_eq!(kept.epoch, b1.id.epoch);
    assert_eq!(
        locker
            .release_all_held_by(a)
            .await
            .expect("release_all runs"),
        0
    );
    assert_eq!(
        locker
            .inspect(StreamId::new_v7(), &perspective)
            .await
            .expect("inspect runs"),
        None
    );
}

/// ADR 0021: a lease whose epoch was begun by a binary that does not record starts (one of an
/// earlier release during a rolling upgrade, which moves the epoch and leaves the start columns
/// as they were) lists with no start, not with the start of an earlier lease; the next
/// acquisition by this binary records one again.
#[tokio::test]
async fn a_lease_begun_without_recording_its_start_lists_none_not_an_older_one() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (stream, perspective) = db.order_cursor().await;
    let listed = || async {
        locker
            .list_leases()
            .await
            .expect("list")
            .into_iter()
            .find(|l| l.stream_id == stream)
            .expect("listed")
    };
    let first = acquire_by_anyone(&locker, stream, &perspective).await;
    let started = listed().await.acquired_at.expect("recorded");
    // The release of the rewind's fenced commit clears the holder and keeps the start
    // columns; then an earlier release's try-acquire (no start columns) begins epoch 2.
    let old_binary = InstanceId::random();
    db.client()
        .await
        .execute(
            "UPDATE wh_perspective_cursors SET stream_lock_instance_id = NULL, \
                    stream_lock_reason = NULL, stream_lock_expiry = NULL \
              WHERE stream_id = $1 AND perspective_name = $2",
            &[&stream.as_uuid(), &perspective.as_str()],
        )
        .await
        .expect("fenced release");
    db.client()
        .await
        .execute(
            "UPDATE wh_perspective_cursors SET stream_lock_instance_id = $3, \
                    stream_lock_reason = 'rewind', \
                    stream_lock_expiry = clock_timestamp() + interval '30 s', \
                    stream_lock_epoch = stream_lock_epoch + 1 \
              WHERE stream_id = $1 AND perspective_name = $2",
            &[
                &stream.as_uuid(),
                &perspective.as_str(),
                &old_binary.as_uuid(),
            ],
        )
        .await
        .expect("an earlier release's acquire");
    let theirs = listed().await;
    assert_eq!(theirs.holder, old_binary);
    assert_eq!(theirs.epoch.get(), first.id.epoch.get() + 1);
    assert_eq!(
        theirs.acquired_at, None,
        "not {started}, the previous lease's start"
    );

    // Once it expires or is released, this binary's next acquisition records its own start.
    assert_eq!(
        locker
            .force_release(stream, &perspective)
            .await
            .expect("force"),
        ReleaseOutcome::Released
    );
    acquire_by_anyone(&locker, stream, &perspective).await;
    let ours = listed().await.acquired_at.expect("recorded again");
    assert!(ours > started, "{ours} after {started}");
}
