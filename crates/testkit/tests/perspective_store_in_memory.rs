//! The perspective-store conformance suite against [`InMemoryPerspectiveStore`], one test per
//! case on paused tokio time (lease expiry costs nothing): the same cases `PgPerspectiveStore`
//! passes on PostgreSQL.

use lockstep_core::StreamLockOptions;
use lockstep_core::Transaction as _;
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
    use lockstep_core::{
        Claim, InstanceId, PerspectiveName, PerspectiveStore, RewindDebounce, StreamId,
    };
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
        .ensure_cursor(&tx, stream, &name)
        .await
        .expect("cursor");
    assert!(
        fixture
            .store
            .request_rewind(&tx, stream, &name, None)
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
        .claim(&tx, stream, &name, 10, UNBOUNDED)
        .await
        .expect("claim");
    assert_eq!(claim, Claim::Idle);
    tx.rollback().await.expect("rollback");
}
