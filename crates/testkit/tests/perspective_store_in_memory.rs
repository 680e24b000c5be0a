//! The perspective-store conformance suite against [`InMemoryPerspectiveStore`], one test per
//! case on paused tokio time (lease expiry costs nothing): the same cases `PgPerspectiveStore`
//! passes on PostgreSQL.

use lockstep_core::Pair;
use lockstep_core::StreamLockOptions;
use lockstep_core::Transaction as _;
use lockstep_core::perspective_store::prelude::*;
use lockstep_testkit::conformance::perspective_store::Fixture;
use lockstep_testkit::conformance::stream_locker::{SHORT_KEEPALIVE, SHORT_LOCK_TIMEOUT};
use lockstep_testkit::{
    FakeDatabase, InMemoryEventStore, InMemoryPerspectiveStore, InMemoryStreamLocker,
};

type InMemory =
    Fixture<FakeDatabase, InMemoryPerspectiveStore, InMemoryEventStore, InMemoryStreamLocker>;

/// A store over a fresh fake database, its event store and a locker on the same cursor rows.
fn in_memory() -> InMemory {
    let db = FakeDatabase::new();
    let events = InMemoryEventStore::new();
    let options = StreamLockOptions::new(SHORT_LOCK_TIMEOUT, SHORT_KEEPALIVE).expect("valid");
    let locker = InMemoryStreamLocker::with_database(options, &db);
    let store = InMemoryPerspectiveStore::new(&db, &events, &locker);
    Fixture::new(db, store, events, locker)
}

lockstep_testkit::perspective_store_conformance! {
    #[tokio::test(start_paused = true)]
    fixture: in_memory(),
    after_each: |f: &InMemory| assert!(f.source.is_idle(), "the case leaves no lock or waiter behind"),
}

/// A debounce past the calendar's end holds a flagged pair back instead of panicking.
#[tokio::test(start_paused = true)]
async fn an_unbounded_debounce_holds_the_pair_back_without_panicking() {
    use lockstep_core::{Claim, InstanceId, PerspectiveName, RewindDebounce, StreamId};
    use std::time::Duration;

    const UNBOUNDED: RewindDebounce = RewindDebounce {
        window: Duration::MAX,
        max_delay: Duration::MAX,
    };

    let fixture = in_memory();
    let (stream, name) = (
        StreamId::new_v7(),
        PerspectiveName::new("P").expect("valid"),
    );
    let tx = fixture.source.begin_now();
    fixture
        .store
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect("register");
    fixture
        .store
        .ensure_cursor(&tx, &Pair::new(stream, name.clone()))
        .await
        .expect("cursor");
    assert!(
        fixture
            .store
            .request_rewind(&tx, &Pair::new(stream, name.clone()), None)
            .await
            .expect("request")
    );
    tx.commit().await.expect("commit");
    let tx = fixture.source.begin_now();
    let pairs = fixture
        .store
        .pending_pairs(
            &tx,
            InstanceId::random(),
            std::slice::from_ref(&name),
            UNBOUNDED,
            10,
        )
        .await
        .expect("pending pairs");
    assert!(pairs.is_empty(), "held back: {pairs:?}");
    let claim = fixture
        .store
        .claim(&tx, &Pair::new(stream, name.clone()), 10, UNBOUNDED)
        .await
        .expect("claim");
    assert_eq!(claim, Claim::Idle);
    tx.rollback().await.expect("rollback");
}

/// A backoff past the calendar's end is stored as its last instant, without panicking, and
/// holds the pair back from batches.
#[tokio::test(start_paused = true)]
async fn an_unbounded_backoff_is_clamped_without_panicking() {
    use lockstep_core::{
        BatchClaim, EventStore, ExpectedVersion, NewEvent, OffsetDateTime, PairFailure,
        PerspectiveName, StreamId,
    };
    use std::time::Duration;

    let fixture = in_memory();
    let name = PerspectiveName::new("P").expect("valid");
    let stream = StreamId::new_v7();
    let tx = fixture.source.begin_now();
    fixture
        .store
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect("register");
    let failure = PairFailure::new("boom").retry_after(Duration::MAX);
    let parked = fixture
        .store
        .record_failure(&tx, &Pair::new(stream, name.clone()), &failure)
        .await
        .expect("record_failure");
    assert!(!parked);
    tx.commit().await.expect("commit");
    let tx = fixture.source.begin_now();
    let cursor = fixture
        .store
        .cursor(&tx, &Pair::new(stream, name.clone()))
        .await
        .expect("cursor")
        .expect("created");
    let retry_at = cursor.retry_at.expect("backing off");
    assert_eq!(retry_at.year(), 9999);
    assert!(retry_at > OffsetDateTime::now_utc());
    tx.rollback().await.expect("rollback");

    let tx = fixture.source.begin_now();
    let event = NewEvent::new("Added", serde_json::json!(1)).expect("event");
    fixture
        .events
        .append(&tx, stream, ExpectedVersion::Any, &[event])
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    let tx = fixture.source.begin_now();
    let batch = fixture
        .store
        .claim_batch(&tx, &BatchClaim::new(std::slice::from_ref(&name)))
        .await
        .expect("claim_batch");
    assert!(batch.pairs.is_empty(), "still backing off: {batch:?}");
    tx.rollback().await.expect("rollback");
}

/// An entry that fails with an error other than a refusal (here: a fence the locker cannot
/// check) leaves none of the batch's entries written, the ones before it included.
#[tokio::test(start_paused = true)]
async fn a_batch_commit_that_fails_part_way_writes_no_entry() {
    use lockstep_core::{
        BatchEntry, ErrorKind, InstanceId, LockReason, Pair, PairFailure, PerspectiveName,
        StateCommit, StreamId, StreamLocker,
    };

    let db = FakeDatabase::new();
    let events = InMemoryEventStore::new();
    let options = StreamLockOptions::new(SHORT_LOCK_TIMEOUT, SHORT_KEEPALIVE).expect("valid");
    // Without the database: a fenced commit cannot be checked (`Unsupported`).
    let locker = InMemoryStreamLocker::new(options);
    let store = InMemoryPerspectiveStore::new(&db, &events, &locker);
    let name = PerspectiveName::new("P").expect("valid");
    let (failed, fenced) = (StreamId::new_v7(), StreamId::new_v7());
    let tx = db.begin_now();
    store
        .ensure_cursor(&tx, &Pair::new(fenced, name.clone()))
        .await
        .expect("cursor");
    tx.commit().await.expect("commit");
    let lease = locker
        .try_acquire(fenced, &name, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("try_acquire")
        .lease()
        .cloned()
        .expect("acquired");

    let tx = db.begin_now();
    let mut change = StateCommit::new(Pair::new(fenced, name.clone()), 0, serde_json::json!({}));
    change.fence = Some(lease.id.clone());
    let entries = [
        BatchEntry::new(
            Pair::new(failed, name.clone()),
            None,
            Some(PairFailure::new("boom")),
        ),
        BatchEntry::new(Pair::new(fenced, name.clone()), Some(change), None),
    ];
    let err = store
        .commit_batch(&tx, &entries)
        .await
        .expect_err("the fence cannot be checked");
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    tx.commit().await.expect("still usable");
    let tx = db.begin_now();
    let cursor = store
        .cursor(&tx, &Pair::new(failed, name.clone()))
        .await
        .expect("cursor");
    assert!(
        cursor
            .as_ref()
            .is_none_or(|c| c.failures == 0 && c.error.is_none()),
        "the first entry's failure is not stored: {cursor:?}"
    );
    tx.rollback().await.expect("rollback");
}
