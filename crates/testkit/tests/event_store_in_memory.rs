//! The in-memory event store: the shared event-store conformance suite, plus the fake's own
//! documented behaviour (deadlock detection among writers waiting for each other's versions).

use std::sync::Arc;

use lockstep_core::{ErrorKind, EventStore, ExpectedVersion, NewEvent, StreamId};
use lockstep_testkit::conformance::event_store::{self, EventStoreFixture};
use lockstep_testkit::{FakeDatabase, FakeTransaction, InMemoryEventStore};

struct Fixture {
    db: FakeDatabase,
    store: InMemoryEventStore,
}

impl EventStoreFixture for Fixture {
    type Tx = FakeTransaction;
    type Source = FakeDatabase;
    type Store = InMemoryEventStore;

    fn store(&self) -> &InMemoryEventStore {
        &self.store
    }

    fn source(&self) -> &FakeDatabase {
        &self.db
    }
}

fn fixture() -> Arc<Fixture> {
    Arc::new(Fixture {
        db: FakeDatabase::new(),
        store: InMemoryEventStore::new(),
    })
}

#[tokio::test(start_paused = true)]
async fn in_memory_event_store_passes_the_event_store_suite() {
    let fixture = fixture();
    event_store::run_all(Arc::clone(&fixture)).await;
    assert!(
        fixture.db.held_keys().is_empty(),
        "no lock outlives its transaction"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_event_store_passes_the_event_store_suite_on_real_time_and_threads() {
    event_store::run_all(fixture()).await;
}

fn event() -> NewEvent {
    NewEvent::new("E", serde_json::Value::Null).expect("event")
}

#[tokio::test(start_paused = true)]
async fn writers_waiting_for_each_others_versions_get_a_deadlock_error() {
    let (db, store) = (FakeDatabase::new(), InMemoryEventStore::new());
    let (s1, s2) = (StreamId::new_v7(), StreamId::new_v7());
    let (a, b) = (db.begin(), db.begin());
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
            b.rollback().await;
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
    let (a, b) = (db.begin(), db.begin());
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
