//! Regression tests for the reliability defects of issue 8 found in the stream locker: values at
//! the limits of storage, cancelled operations, concurrent batches, bad ids, an unmigrated
//! database. Each failed before its fix.

mod common;

use std::time::Duration;

use common::{Db, acquire, long_options};
use lockstep_core::{
    AcquireOutcome, ErrorKind, InstanceId, LockReason, StreamLockAdmin, StreamLockOptions,
    StreamLocker,
};

/// Issue 8, defect 1: the longest accepted lock timeout writes an expiry that reads back.
#[tokio::test]
async fn the_longest_accepted_lock_timeout_is_written_and_read_back() {
    let db = Db::new(2).await;
    let options =
        StreamLockOptions::new(StreamLockOptions::MAX_LOCK_TIMEOUT, Duration::from_secs(60))
            .expect("100 years is accepted");
    let locker = db.locker(options);
    let (stream, perspective) = db.order_cursor().await;
    let me = InstanceId::random();
    let lease = acquire(&locker, stream, &perspective, me, LockReason::Rewind).await;
    assert!(lease.expires_at.year() >= 2100);
    let denied = locker
        .try_acquire(
            stream,
            &perspective,
            InstanceId::random(),
            &LockReason::Rewind,
        )
        .await
        .expect("a denial reads the stored expiry");
    assert!(matches!(denied, AcquireOutcome::Denied(_)));
    assert_eq!(locker.list_leases().await.expect("listing").len(), 1);
    assert!(locker.renew(&lease.id).await.expect("renew").is_renewed());
}

/// Issue 8, defect 1: an expiry lockstep cannot read (an operator's `'infinity'`) is a typed
/// error naming the row from every operation that reads it — never a panic.
#[tokio::test]
async fn an_infinite_expiry_set_by_an_operator_is_a_typed_error_naming_the_row() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (stream, perspective) = db.order_cursor().await;
    let holder = InstanceId::random();
    let lease = acquire(&locker, stream, &perspective, holder, LockReason::Rewind).await;
    db.client()
        .await
        .execute(
            "UPDATE wh_perspective_cursors SET stream_lock_expiry = 'infinity' \
              WHERE stream_id = $1",
            &[&stream.as_uuid()],
        )
        .await
        .expect("operator update");

    let unreadable = |err: lockstep_core::Error| {
        assert_eq!(err.kind(), ErrorKind::Backend, "{err}");
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
    // The holder can still renew (the statement writes a readable expiry) and release.
    assert!(locker.renew(&lease.id).await.expect("renew").is_renewed());
    assert!(
        locker
            .release(&lease.id)
            .await
            .expect("release")
            .is_released()
    );
    assert!(locker.list_leases().await.expect("listing").is_empty());
}
