//! The snapshot-store conformance suite: aggregate snapshots beside the events — loaded with
//! the events after them, kept per aggregate type and state schema version, never going back,
//! committed and rolled back with their transaction, ignored past the stream's end, taken under
//! the lock first, refused when malformed, deleted by type and schema version.
//!
//! It runs on the [`EventStoreFixture`] of the event-store suite, for a store that is also a
//! [`SnapshotStore`]. Every case uses fresh streams and aggregate types, so the suite can run
//! against a shared database; no case asserts on timing.
//!
//! Run it with [`snapshot_store_conformance!`](crate::snapshot_store_conformance) (one test per
//! case), or call the cases or [`run_all`] yourself.

use std::sync::Arc;

use lockstep_core::{
    AggregateSnapshot, AggregateType, ErrorKind, EventStore, ExpectedVersion, LoadedStream,
    LockFirst, NewEvent, ResourceKey, SnapshotKey, SnapshotStore, StreamId,
};
use serde_json::json;

use super::event_store::EventStoreFixture;
use super::{begin, commit, rollback, until_waiting};

/// An aggregate type no other case uses.
fn fresh_type() -> AggregateType {
    AggregateType::new(format!("Conformance-{}", uuid::Uuid::new_v4().simple())).expect("type")
}

fn key(aggregate_type: &AggregateType, stream: StreamId, schema_version: u32) -> SnapshotKey {
    SnapshotKey::new(aggregate_type.clone(), stream, schema_version).expect("key")
}

fn snapshot(version: u64) -> AggregateSnapshot {
    AggregateSnapshot {
        version,
        state: json!({ "through": version, "note": "ünïcödé" }),
    }
}

fn events(n: u64) -> Vec<NewEvent> {
    (1..=n)
        .map(|i| NewEvent::new("Counted", json!({ "i": i })).expect("event"))
        .collect()
}

/// Appends `n` events to `stream` (starting at `from`) and commits.
async fn append_committed<F: EventStoreFixture>(fixture: &F, stream: StreamId, from: u64, n: u64) {
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .append(&tx, stream, ExpectedVersion::Exact(from), &events(n))
        .await
        .expect("append");
    commit(tx).await.expect("commit");
}

/// What a fresh transaction loads for `key`, without a lock.
async fn load_committed<F>(fixture: &F, key: &SnapshotKey) -> LoadedStream
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    let tx = begin(fixture.source()).await;
    let loaded = fixture
        .store()
        .load_from_snapshot(&tx, key, None)
        .await
        .expect("load_from_snapshot");
    rollback(tx).await;
    loaded
}

fn versions(loaded: &LoadedStream) -> Vec<u64> {
    loaded.events.iter().map(|e| e.version).collect()
}

/// Without a snapshot a load is the whole stream (nothing for a stream that does not exist).
pub async fn a_load_without_a_snapshot_is_the_whole_stream<F>(fixture: Arc<F>)
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    let (ty, stream) = (fresh_type(), StreamId::new_v7());
    let k = key(&ty, stream, 1);
    assert_eq!(load_committed(&*fixture, &k).await, LoadedStream::default());
    append_committed(&*fixture, stream, 0, 3).await;
    let loaded = load_committed(&*fixture, &k).await;
    assert_eq!(loaded.snapshot, None);
    assert_eq!(versions(&loaded), [1, 2, 3]);
    assert_eq!(loaded.events[2].payload["i"], 3);
    assert_eq!(loaded.version(), 3);
}

/// A saved snapshot is loaded with the events after it; the saving transaction sees it at
/// once, others after its commit.
pub async fn a_saved_snapshot_is_loaded_with_the_events_after_it<F>(fixture: Arc<F>)
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    let (ty, stream) = (fresh_type(), StreamId::new_v7());
    let k = key(&ty, stream, 1);
    append_committed(&*fixture, stream, 0, 5).await;
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .save_snapshot(&tx, &k, &snapshot(3))
            .await
            .expect("save")
    );
    let own = fixture
        .store()
        .load_from_snapshot(&tx, &k, None)
        .await
        .expect("load");
    assert_eq!(
        own.snapshot,
        Some(snapshot(3)),
        "the saver sees its snapshot"
    );
    assert_eq!(versions(&own), [4, 5]);
    assert_eq!(
        load_committed(&*fixture, &k).await.snapshot,
        None,
        "others see it only after the commit"
    );
    commit(tx).await.expect("commit");
    append_committed(&*fixture, stream, 5, 2).await;
    let loaded = load_committed(&*fixture, &k).await;
    assert_eq!(loaded.snapshot, Some(snapshot(3)));
    assert_eq!(versions(&loaded), [4, 5, 6, 7]);
    assert_eq!(loaded.version(), 7);
}

/// A save keeps the newest snapshot: one at the same or an older version is not stored.
pub async fn a_snapshot_never_goes_back<F>(fixture: Arc<F>)
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    let (ty, stream) = (fresh_type(), StreamId::new_v7());
    let k = key(&ty, stream, 1);
    append_committed(&*fixture, stream, 0, 6).await;
    for (version, stored) in [(5, true), (3, false), (5, false), (6, true)] {
        let tx = begin(fixture.source()).await;
        let saved = fixture
            .store()
            .save_snapshot(&tx, &k, &snapshot(version))
            .await
            .expect("save");
        assert_eq!(saved, stored, "saving version {version}");
        commit(tx).await.expect("commit");
    }
    let loaded = load_committed(&*fixture, &k).await;
    assert_eq!(loaded.snapshot, Some(snapshot(6)));
    assert!(loaded.events.is_empty());
}

/// Snapshots are kept per aggregate type and state schema version: a key reads its own only.
pub async fn snapshots_are_kept_per_type_and_schema_version<F>(fixture: Arc<F>)
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    let (a, b, stream) = (fresh_type(), fresh_type(), StreamId::new_v7());
    append_committed(&*fixture, stream, 0, 4).await;
    let tx = begin(fixture.source()).await;
    for (k, version) in [(key(&a, stream, 1), 2), (key(&a, stream, 2), 3)] {
        assert!(
            fixture
                .store()
                .save_snapshot(&tx, &k, &snapshot(version))
                .await
                .expect("save")
        );
    }
    commit(tx).await.expect("commit");
    let v1 = load_committed(&*fixture, &key(&a, stream, 1)).await;
    assert_eq!(v1.snapshot, Some(snapshot(2)));
    assert_eq!(versions(&v1), [3, 4]);
    let v2 = load_committed(&*fixture, &key(&a, stream, 2)).await;
    assert_eq!(v2.snapshot, Some(snapshot(3)));
    assert_eq!(versions(&v2), [4]);
    let v3 = load_committed(&*fixture, &key(&a, stream, 3)).await;
    assert_eq!(v3.snapshot, None);
    assert_eq!(versions(&v3), [1, 2, 3, 4]);
    let other = load_committed(&*fixture, &key(&b, stream, 1)).await;
    assert_eq!(other.snapshot, None, "another aggregate type");
}

/// A save rolled back — or undone by a failed statement of its transaction — is not stored.
pub async fn a_rolled_back_save_vanishes<F>(fixture: Arc<F>)
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    let (ty, stream) = (fresh_type(), StreamId::new_v7());
    let k = key(&ty, stream, 1);
    append_committed(&*fixture, stream, 0, 2).await;
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .save_snapshot(&tx, &k, &snapshot(2))
        .await
        .expect("save");
    rollback(tx).await;
    assert_eq!(load_committed(&*fixture, &k).await.snapshot, None);

    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .save_snapshot(&tx, &k, &snapshot(2))
        .await
        .expect("save");
    let err = fixture
        .store()
        .append(&tx, stream, ExpectedVersion::Exact(0), &events(1))
        .await
        .expect_err("a stale expectation");
    assert_eq!(err.kind(), ErrorKind::Conflict);
    let err = commit(tx).await.expect_err("an aborted transaction");
    assert_eq!(err.kind(), ErrorKind::TransactionAborted);
    assert_eq!(load_committed(&*fixture, &k).await.snapshot, None);
}

/// A snapshot past the stream's last event (written by other means) is ignored: the load is
/// the whole stream.
pub async fn a_snapshot_past_the_last_event_is_ignored<F>(fixture: Arc<F>)
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    let (ty, stream) = (fresh_type(), StreamId::new_v7());
    let k = key(&ty, stream, 1);
    append_committed(&*fixture, stream, 0, 2).await;
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .save_snapshot(&tx, &k, &snapshot(5))
        .await
        .expect("save");
    commit(tx).await.expect("commit");
    let loaded = load_committed(&*fixture, &k).await;
    assert_eq!(loaded.snapshot, None);
    assert_eq!(versions(&loaded), [1, 2]);
    append_committed(&*fixture, stream, 2, 3).await;
    let caught_up = load_committed(&*fixture, &k).await;
    assert_eq!(
        caught_up.snapshot,
        Some(snapshot(5)),
        "the stream reached it"
    );
    assert!(caught_up.events.is_empty());
}

/// A snapshot with a version of 0 or past `i64::MAX`, or a state that cannot be stored, is
/// [`ErrorKind::InvalidInput`]; nothing is stored and the transaction stays usable.
pub async fn bad_snapshots_are_refused_and_change_nothing<F>(fixture: Arc<F>)
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    let (ty, stream) = (fresh_type(), StreamId::new_v7());
    let k = key(&ty, stream, 1);
    append_committed(&*fixture, stream, 0, 1).await;
    let tx = begin(fixture.source()).await;
    for bad in [
        AggregateSnapshot {
            version: 0,
            state: json!({}),
        },
        AggregateSnapshot {
            version: u64::MAX,
            state: json!({}),
        },
        AggregateSnapshot {
            version: 1,
            state: json!({ "a\u{0}": 1 }),
        },
    ] {
        let err = fixture
            .store()
            .save_snapshot(&tx, &k, &bad)
            .await
            .expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    }
    let loaded = fixture
        .store()
        .load_from_snapshot(&tx, &k, None)
        .await
        .expect("the transaction is usable");
    assert_eq!(loaded.snapshot, None);
    commit(tx).await.expect("commit");
    assert_eq!(load_committed(&*fixture, &k).await.snapshot, None);
}

/// With a lock, the load takes it first: a second locked load waits for the holder and sees
/// the events and the snapshot it committed.
pub async fn a_locked_load_waits_for_the_holder_and_sees_its_commit<F>(fixture: Arc<F>)
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    let (ty, stream) = (fresh_type(), StreamId::new_v7());
    let k = key(&ty, stream, 1);
    let lock = ResourceKey::new(format!("conformance:snapshot:{}", uuid::Uuid::new_v4()))
        .expect("lock key");
    append_committed(&*fixture, stream, 0, 2).await;
    let holder = begin(fixture.source()).await;
    let first = fixture
        .store()
        .load_from_snapshot(
            &holder,
            &k,
            Some(LockFirst {
                key: &lock,
                timeout: None,
            }),
        )
        .await
        .expect("free");
    assert_eq!(versions(&first), [1, 2]);
    fixture
        .store()
        .save_snapshot(&holder, &k, &snapshot(3))
        .await
        .expect("save");
    fixture
        .store()
        .append(&holder, stream, ExpectedVersion::Exact(2), &events(1))
        .await
        .expect("append");

    let waiter = {
        let (fixture, k, lock) = (Arc::clone(&fixture), k.clone(), lock.clone());
        tokio::spawn(async move {
            let tx = begin(fixture.source()).await;
            let loaded = fixture
                .store()
                .load_from_snapshot(
                    &tx,
                    &k,
                    Some(LockFirst {
                        key: &lock,
                        timeout: None,
                    }),
                )
                .await
                .expect("lock and load");
            rollback(tx).await;
            loaded
        })
    };
    until_waiting(|| fixture.waiting(), 1, "the second locked load").await;
    commit(holder).await.expect("commit");
    let loaded = waiter.await.expect("waiter");
    assert_eq!(
        loaded.snapshot,
        Some(snapshot(3)),
        "loaded after the commit"
    );
    assert!(loaded.events.is_empty());
    assert_eq!(loaded.version(), 3);
}

/// Two transactions saving one snapshot: the second waits for the first and then compares with
/// what it committed.
pub async fn a_concurrent_save_waits_for_the_first<F>(fixture: Arc<F>)
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    let (ty, stream) = (fresh_type(), StreamId::new_v7());
    let k = key(&ty, stream, 1);
    append_committed(&*fixture, stream, 0, 4).await;
    let first = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .save_snapshot(&first, &k, &snapshot(3))
            .await
            .expect("save")
    );
    let second = {
        let (fixture, k) = (Arc::clone(&fixture), k.clone());
        tokio::spawn(async move {
            let tx = begin(fixture.source()).await;
            let newer = fixture
                .store()
                .save_snapshot(&tx, &k, &snapshot(4))
                .await
                .expect("save");
            commit(tx).await.expect("commit");
            newer
        })
    };
    until_waiting(|| fixture.waiting(), 1, "the second save").await;
    commit(first).await.expect("commit");
    assert!(
        second.await.expect("second"),
        "4 is newer than the 3 committed"
    );
    assert_eq!(
        load_committed(&*fixture, &k).await.snapshot,
        Some(snapshot(4))
    );
}

/// `delete_snapshots` deletes an aggregate type's snapshots below a schema version, or all of
/// them, and no other type's.
pub async fn delete_snapshots_by_type_and_schema_version<F>(fixture: Arc<F>)
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    let (a, b, stream) = (fresh_type(), fresh_type(), StreamId::new_v7());
    append_committed(&*fixture, stream, 0, 1).await;
    let tx = begin(fixture.source()).await;
    for k in [
        key(&a, stream, 1),
        key(&a, stream, 2),
        key(&a, stream, 3),
        key(&b, stream, 1),
    ] {
        fixture
            .store()
            .save_snapshot(&tx, &k, &snapshot(1))
            .await
            .expect("save");
    }
    commit(tx).await.expect("commit");
    let tx = begin(fixture.source()).await;
    let below_three = fixture
        .store()
        .delete_snapshots(&tx, &a, Some(3))
        .await
        .expect("delete");
    assert_eq!(below_three, 2);
    commit(tx).await.expect("commit");
    assert_eq!(
        load_committed(&*fixture, &key(&a, stream, 2))
            .await
            .snapshot,
        None
    );
    assert_eq!(
        load_committed(&*fixture, &key(&a, stream, 3))
            .await
            .snapshot,
        Some(snapshot(1))
    );
    let tx = begin(fixture.source()).await;
    let all = fixture
        .store()
        .delete_snapshots(&tx, &a, None)
        .await
        .expect("delete");
    assert_eq!(all, 1);
    commit(tx).await.expect("commit");
    assert_eq!(
        load_committed(&*fixture, &key(&a, stream, 3))
            .await
            .snapshot,
        None
    );
    assert_eq!(
        load_committed(&*fixture, &key(&b, stream, 1))
            .await
            .snapshot,
        Some(snapshot(1)),
        "another type is untouched"
    );
}

/// A load from a snapshot reads the events after it through the store's upcasters, and only
/// those: an upcaster that fails on an event the snapshot already folds fails nothing, one
/// that fails on an event after it fails the load with [`ErrorKind::InvalidInput`].
pub async fn a_load_from_a_snapshot_upcasts_only_the_events_after_it<F>(fixture: Arc<F>)
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    let (ty, stream) = (fresh_type(), StreamId::new_v7());
    let k = key(&ty, stream, 1);
    let tx = begin(fixture.source()).await;
    let old = NewEvent::new("Old", json!({ "n": 1 })).expect("event");
    let counted = NewEvent::new("Counted", json!({ "i": 2 })).expect("event");
    fixture
        .store()
        .append(&tx, stream, ExpectedVersion::NoStream, &[old, counted])
        .await
        .expect("append");
    fixture
        .store()
        .save_snapshot(&tx, &k, &snapshot(1))
        .await
        .expect("save");
    commit(tx).await.expect("commit");
    let upcasters = lockstep_core::Upcasters::new()
        .with("Old", 1, |_| Err("no longer readable".into()))
        .expect("upcaster")
        .with("Counted", 1, |mut payload| {
            payload["lifted"] = json!(true);
            Ok(payload)
        })
        .expect("upcaster");
    let upcasting = fixture.store_with_upcasters(upcasters);
    let tx = begin(fixture.source()).await;
    let loaded = upcasting
        .load_from_snapshot(&tx, &k, None)
        .await
        .expect("the failing event is before the snapshot");
    assert_eq!(loaded.snapshot, Some(snapshot(1)));
    assert_eq!(versions(&loaded), [2]);
    assert_eq!(loaded.events[0].payload["lifted"], true);
    assert_eq!(loaded.events[0].schema_version, 2);
    rollback(tx).await;
    let other = key(&ty, stream, 2);
    let tx = begin(fixture.source()).await;
    let err = upcasting
        .load_from_snapshot(&tx, &other, None)
        .await
        .expect_err("without a snapshot the failing event is read");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    rollback(tx).await;
}

/// Runs every case, in order, in one test. Prefer
/// [`snapshot_store_conformance!`](crate::snapshot_store_conformance): a test per case.
pub async fn run_all<F>(fixture: Arc<F>)
where
    F: EventStoreFixture,
    F::Store: SnapshotStore<F::Tx>,
{
    crate::__lockstep_snapshot_store_cases!(__lockstep_conformance_run_all! { by_arc fixture });
}

#[doc(hidden)]
#[macro_export]
macro_rules! __lockstep_snapshot_store_cases {
    ($then:ident ! { $($args:tt)* }) => {
        $crate::$then! { $($args)* cases: [
            a_load_without_a_snapshot_is_the_whole_stream,
            a_saved_snapshot_is_loaded_with_the_events_after_it,
            a_snapshot_never_goes_back,
            snapshots_are_kept_per_type_and_schema_version,
            a_rolled_back_save_vanishes,
            a_snapshot_past_the_last_event_is_ignored,
            bad_snapshots_are_refused_and_change_nothing,
            a_locked_load_waits_for_the_holder_and_sees_its_commit,
            a_concurrent_save_waits_for_the_first,
            delete_snapshots_by_type_and_schema_version,
            a_load_from_a_snapshot_upcasts_only_the_events_after_it,
        ] }
    };
}

/// Expands to one test per case of the [snapshot-store conformance
/// suite](crate::conformance::snapshot_store), each on a fixture of its own: an
/// [`EventStoreFixture`](crate::conformance::event_store::EventStoreFixture) whose store is also
/// a [`SnapshotStore`](lockstep_core::SnapshotStore). Arguments as for
/// [`event_store_conformance!`](crate::event_store_conformance). Not covered by semver (see
/// [`conformance`](crate::conformance)).
///
/// ```
/// mod in_memory {
///     use lockstep_testkit::conformance::event_store::Fixture;
///     use lockstep_testkit::{FakeDatabase, InMemoryEventStore};
///
///     lockstep_testkit::snapshot_store_conformance! {
///         #[tokio::test(start_paused = true)]
///         fixture: Fixture::new(FakeDatabase::new(), InMemoryEventStore::new()),
///     }
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! snapshot_store_conformance {
    ($(#[$attr:meta])+ fixture: $fixture:expr $(, after_each: $after:expr)? $(,)?) => {
        $crate::__lockstep_snapshot_store_cases!(__lockstep_conformance_tests! {
            suite: snapshot_store,
            pass: by_arc,
            attrs: [$(#[$attr])+],
            fixture: $fixture,
            after_each: [$($after)?],
        });
    };
    (fixture: $($rest:tt)*) => {
        $crate::snapshot_store_conformance! { #[::tokio::test] fixture: $($rest)* }
    };
}
