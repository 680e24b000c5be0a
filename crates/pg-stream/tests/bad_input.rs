//! Bad input never reaches SQL, and odd-but-valid input is stored verbatim.
//!
//! The value types refuse what the schema cannot hold (a reason over 50 characters, a blank
//! perspective name) at construction, so no call can even be made with them; everything else,
//! SQL included, is bound as a parameter and stored exactly.

mod common;

use common::{Db, acquire, inspect_row, long_options, name};
use lockstep_core::{
    AcquireOutcome, Error, ErrorKind, InstanceId, LockReason, PerspectiveName, StreamId,
    StreamLockAdmin, StreamLocker, ValidationError,
};

const SQL_NAME: &str = "x'); DROP TABLE wh_perspective_cursors; --";
const SQL_REASON: &str = "'; UPDATE wh_perspective_cursors SET epoch = 0; --";

async fn populated() -> (Db, Vec<common::LeaseRow>) {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let perspective = name("OrderPerspective");
    for _ in 0..3 {
        let stream = StreamId::new_v7();
        db.create_cursor(stream, &perspective).await;
        let _ = locker
            .try_acquire(
                stream,
                &perspective,
                InstanceId::random(),
                &LockReason::Rewind,
            )
            .await
            .expect("try_acquire runs");
    }
    let snapshot = db.lease_snapshot().await;
    (db, snapshot)
}

#[tokio::test]
async fn a_fifty_one_character_reason_is_refused_at_construction_and_changes_no_row() {
    let (db, before) = populated().await;
    let refused = LockReason::custom("r".repeat(51));
    let err: Error = refused.expect_err("refused");
    assert_eq!(
        err.validation(),
        Some(&ValidationError::ReasonTooLong { chars: 51, max: 50 })
    );
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    // Also when the 51st character is a multi-byte one (the limit is characters, not bytes).
    assert!(LockReason::custom(format!("{}é", "r".repeat(50))).is_err());
    assert_eq!(
        db.lease_snapshot().await,
        before,
        "no row changed: nothing was sent"
    );
}

#[tokio::test]
async fn an_empty_perspective_name_is_refused_at_construction_and_changes_no_row() {
    let (db, before) = populated().await;
    for blank in ["", "   ", "\t\n"] {
        assert_eq!(
            PerspectiveName::new(blank)
                .expect_err("refused")
                .validation(),
            Some(&ValidationError::BlankPerspectiveName)
        );
    }
    let err: Error = PerspectiveName::new("").expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert_eq!(db.lease_snapshot().await, before);
}

#[tokio::test]
async fn a_perspective_name_and_a_reason_containing_sql_are_stored_verbatim() {
    let (db, before) = populated().await;
    let locker = db.locker(long_options());
    let perspective = PerspectiveName::new(SQL_NAME).expect("SQL text is a valid name");
    let reason = LockReason::custom(SQL_REASON).expect("SQL text is a valid reason");
    let stream = StreamId::new_v7();
    db.create_cursor(stream, &perspective).await;
    let instance = InstanceId::random();

    let lease = acquire(&locker, stream, &perspective, instance, reason.clone()).await;
    assert_eq!(lease.id.perspective.as_str(), SQL_NAME);

    // The table is still there, the other rows are untouched, and the new row holds the
    // texts exactly.
    let after = db.lease_snapshot().await;
    let (others, ours): (Vec<_>, Vec<_>) = after
        .into_iter()
        .partition(|r| r.stream_id != stream.as_uuid());
    assert_eq!(others, before);
    assert_eq!(ours.len(), 1);
    assert_eq!(ours[0].perspective, SQL_NAME);
    assert_eq!(ours[0].reason.as_deref(), Some(SQL_REASON));
    assert_eq!(ours[0].holder, Some(instance.as_uuid()));

    let listed = locker.list_leases().await.expect("list_leases runs");
    assert!(
        listed
            .iter()
            .any(|l| l.perspective.as_str() == SQL_NAME && l.reason == reason)
    );
    // A name that differs only by the SQL has no row.
    let lookalike = PerspectiveName::new("x").expect("valid");
    assert_eq!(
        locker
            .try_acquire(stream, &lookalike, instance, &reason)
            .await
            .expect("try_acquire runs"),
        AcquireOutcome::NoCursor
    );
}

#[tokio::test]
async fn a_fifty_character_multibyte_reason_is_stored_whole() {
    let db = Db::new(2).await;
    let locker = db.locker(long_options());
    let (stream, perspective) = db.order_cursor().await;
    let text = "ü".repeat(50);
    let reason = LockReason::custom(text.clone()).expect("50 characters fit");
    acquire(&locker, stream, &perspective, InstanceId::random(), reason).await;
    let row = inspect_row(&locker, stream, &perspective).await;
    assert_eq!(row.reason.map(|r| r.to_string()), Some(text));
}
