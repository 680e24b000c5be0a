//! The perspective-store conformance suite against [`InMemoryPerspectiveStore`], one test per
//! case on paused tokio time (lease expiry costs nothing): the same cases `PgPerspectiveStore`
//! passes on PostgreSQL.

use lockstep_core::StreamLockOptions;
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
