//! The in-memory event store: the shared event-store conformance suite (one test per case), plus
//! the fake's own documented behaviour (deadlock detection among writers waiting for each
//! other's versions, or for versions and locks).

use lockstep_core::Transaction as _;
use std::time::Duration;

use lockstep_core::{
    DistributedLock, ErrorKind, EventStore, ExpectedVersion, NewEvent, ResourceKey, StreamId,
};
use lockstep_testkit::conformance::event_store::Fixture;
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, InMemoryEventStore};

type InMemory = Fixture<FakeDatabase, InMemoryEventStore>;

fn fixture() -> InMemory {
    Fixture::new(FakeDatabase::new(), InMemoryEventStore::new())
}

mod suite {
    use super::*;

    lockstep_testkit::event_store_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: fixture(),
        after_each: |fixture: &InMemory| {
            assert!(fixture.source.held_keys().is_empty(), "no lock outlives its transaction");
            assert!(fixture.source.is_idle(), "no lock or waiting append is left behind");
        },
    }
}

mod snapshot_suite {
    use super::*;

    lockstep_testkit::snapshot_store_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: fixture(),
        after_each: |fixture: &InMemory| {
            assert!(fixture.source.held_keys().is_empty(), "no lock outlives its transaction");
            assert!(fixture.source.is_idle(), "no lock or waiting save is left behind");
        },
    }
}

mod snapshot_suite_on_real_time_and_threads {
    use super::*;

    lockstep_testkit::snapshot_store_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(),
    }
}

mod suite_on_real_time_and_threads {
    use super::*;

    lockstep_testkit::event_store_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(),
    }
}

fn event() -> NewEvent {
    NewEvent::new("E", serde_json::Value::Null).expect("event")
}

#[tokio::test(start_paused = true)]
async fn writers_waiting_for_each_others_versions_get_a_deadlock_error() {
    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let (s1, s2) = (StreamId::new_v7(), StreamId::new_v7());
    let (a, b) = (db.begin_now(), db.begin_now());
    store
        .append(&a, s1, ExpectedVersion::NoStream, &[event()])
        .await
        .expect("a s1");
    store
        .append(&b, s2, ExpectedVersion::NoStream, &[event()])
        .await
        .expect("b s2");
    let one = [event()];
    let (a_waits, b_closes_cycle) = tokio::join!(
        store.append(&a, s2, ExpectedVersion::NoStream, &one),
        async {
            tokio::task::yield_now().await;
            let result = store.append(&b, s1, ExpectedVersion::NoStream, &one).await;
            // The victim ends, so the other writer can finish.
            b.rollback().await.expect("rollback");
            result
        }
    );
    assert_eq!(
        b_closes_cycle.expect_err("victim").kind(),
        ErrorKind::Deadlock
    );
    assert_eq!(
        a_waits.expect("b rolled back, so a's append goes through"),
        1
    );
    a.commit().await.expect("commit");
    assert_eq!(store.committed(s1).len(), 1);
    assert_eq!(store.committed(s2).len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiting_append_aborts_its_transaction() {
    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let stream = StreamId::new_v7();
    let (a, b) = (db.begin_now(), db.begin_now());
    store
        .append(&a, stream, ExpectedVersion::Any, &[event()])
        .await
        .expect("a");
    let waiting = tokio::time::timeout(
        std::time::Duration::from_millis(100),
        store.append(&b, stream, ExpectedVersion::Any, &[event()]),
    )
    .await;
    assert!(waiting.is_err(), "b waited for a's version");
    assert!(!b.is_usable(), "abandoned statement, aborted transaction");
    a.commit().await.expect("commit");
    assert_eq!(
        b.commit().await.expect_err("aborted").kind(),
        ErrorKind::TransactionAborted
    );
    assert_eq!(store.committed(stream).len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_cycle_of_a_version_wait_and_a_lock_wait_is_a_deadlock() {
    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let lock = FakeDistributedLock::new(&db);
    let (stream, key) = (
        StreamId::new_v7(),
        ResourceKey::new("test:mixed").expect("key"),
    );
    let (a, b) = (db.begin_now(), db.begin_now());
    assert!(
        lock.try_acquire_for_transaction(&a, &key)
            .await
            .expect("a locks")
    );
    store
        .append(&b, stream, ExpectedVersion::NoStream, &[event()])
        .await
        .expect("b reserves version 1");
    let one = [event()];
    let (a_waits, b_closes_cycle) = tokio::join!(
        store.append(&a, stream, ExpectedVersion::NoStream, &one),
        async {
            tokio::task::yield_now().await;
            let result = lock.acquire_for_transaction(&b, &key, None).await;
            b.rollback().await.expect("rollback");
            result
        }
    );
    assert_eq!(
        b_closes_cycle.expect_err("victim").kind(),
        ErrorKind::Deadlock
    );
    assert_eq!(
        a_waits.expect("b rolled back, so a's append goes through"),
        1
    );
    a.commit().await.expect("commit");
    assert_eq!(store.committed(stream).len(), 1);
    assert!(db.is_idle());
}

#[tokio::test(start_paused = true)]
async fn a_store_refuses_transactions_of_another_database() {
    let (db, other, store) = (
        FakeDatabase::new(),
        FakeDatabase::new(),
        InMemoryEventStore::new(),
    );
    let stream = StreamId::new_v7();
    let tx = db.begin_now();
    store
        .append(&tx, stream, ExpectedVersion::NoStream, &[event()])
        .await
        .expect("the first database binds the store");
    let foreign = other.begin_now();
    let err = store.load(&foreign, stream).await.expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    let err = tokio::time::timeout(
        Duration::from_secs(1),
        store.append(&foreign, stream, ExpectedVersion::Any, &[event()]),
    )
    .await
    .expect("refused at once")
    .expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    tx.commit().await.expect("commit");
    assert_eq!(store.committed(stream).len(), 1);
}
