//! The event-store conformance suite: versions, expected-version checks, transaction
//! visibility, concurrent appends of one version, aborted transactions, lock-first loads.
//!
//! Every case uses fresh stream ids and lock keys, so the suite can run against a shared
//! database. No case asserts on timing: a concurrent writer is spawned and the suite waits for
//! its outcome after ending the transaction it waits for.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::{
    ErrorKind, EventStore, ExpectedVersion, NewEvent, ResourceKey, StreamId, TransactionSource,
    version_conflict,
};

use super::{begin, commit, rollback};

/// What the suite needs from a backend: the store under test and owned transactions of the
/// type it runs on.
pub trait EventStoreFixture: Send + Sync + 'static {
    /// An owned, open transaction (`'static`, so a concurrent writer can be spawned).
    type Tx: Send + Sync + 'static;
    /// The store under test.
    type Store: EventStore<Self::Tx> + 'static;
    /// The transaction source.
    type Source: TransactionSource<Tx = Self::Tx>;

    /// The store under test.
    fn store(&self) -> &Self::Store;

    /// Where the suite's transactions come from (each on its own connection, for a database
    /// backend). Committing a transaction aborted by a failed append must fail with
    /// [`ErrorKind::TransactionAborted`].
    fn source(&self) -> &Self::Source;
}

fn event(event_type: &str, n: u64) -> NewEvent {
    NewEvent::new(event_type, serde_json::json!({ "n": n, "note": "ünïcödé" })).expect("event")
}

fn fresh_key() -> ResourceKey {
    ResourceKey::new(format!("conformance:event-store:{}", uuid::Uuid::new_v4())).expect("key")
}

async fn versions<F: EventStoreFixture>(fixture: &F, tx: &F::Tx, stream: StreamId) -> Vec<u64> {
    let events = fixture.store().load(tx, stream).await.expect("load");
    events.iter().map(|e| e.version).collect()
}

async fn committed_versions<F: EventStoreFixture>(fixture: &F, stream: StreamId) -> Vec<u64> {
    let tx = begin(fixture.source()).await;
    let seen = versions(fixture, &tx, stream).await;
    rollback(fixture.source(), tx).await;
    seen
}

/// A new stream starts at version 1; appends return the new version; a load returns every
/// event in version order with its type, payload, stream, a UUIDv7 id and a recorded time.
pub async fn appends_number_versions_from_one_and_load_in_order<F: EventStoreFixture>(
    fixture: Arc<F>,
) {
    let stream = StreamId::new_v7();
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .load(&tx, stream)
            .await
            .expect("load")
            .is_empty()
    );
    let v = fixture
        .store()
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[event("A", 1), event("B", 2)],
        )
        .await
        .expect("append");
    assert_eq!(v, 2);
    let v = fixture
        .store()
        .append(&tx, stream, ExpectedVersion::Exact(2), &[event("C", 3)])
        .await
        .expect("append");
    assert_eq!(v, 3);
    commit(fixture.source(), tx).await.expect("commit");

    let tx = begin(fixture.source()).await;
    let events = fixture.store().load(&tx, stream).await.expect("load");
    rollback(fixture.source(), tx).await;
    assert_eq!(
        events.iter().map(|e| e.version).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    let types: Vec<_> = events.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(types, ["A", "B", "C"]);
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.stream_id, stream);
        assert_eq!(e.payload["n"], serde_json::json!(i as u64 + 1));
        assert_eq!(e.payload["note"], serde_json::json!("ünïcödé"));
        assert_eq!(e.event_id.get_version_num(), 7, "UUIDv7 event ids");
    }
    let mut ids: Vec<_> = events.iter().map(|e| e.event_id).collect();
    ids.dedup();
    assert_eq!(ids.len(), 3, "unique event ids");
    assert!(events[0].recorded_at <= events[2].recorded_at);
}

/// Appends are visible to their own transaction at once, to others only after commit.
pub async fn appends_are_visible_to_others_only_after_commit<F: EventStoreFixture>(
    fixture: Arc<F>,
) {
    let stream = StreamId::new_v7();
    let (writer, reader) = (begin(fixture.source()).await, begin(fixture.source()).await);
    fixture
        .store()
        .append(&writer, stream, ExpectedVersion::Any, &[event("A", 1)])
        .await
        .expect("append");
    assert_eq!(versions(&*fixture, &writer, stream).await, [1]);
    assert!(versions(&*fixture, &reader, stream).await.is_empty());
    commit(fixture.source(), writer).await.expect("commit");
    assert_eq!(
        versions(&*fixture, &reader, stream).await,
        [1],
        "READ COMMITTED: the next read sees the commit"
    );
    rollback(fixture.source(), reader).await;
}

/// A rolled-back append leaves nothing, and its version is free again.
pub async fn rolled_back_appends_vanish<F: EventStoreFixture>(fixture: Arc<F>) {
    let stream = StreamId::new_v7();
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .append(&tx, stream, ExpectedVersion::NoStream, &[event("A", 1)])
        .await
        .expect("append");
    rollback(fixture.source(), tx).await;
    assert!(committed_versions(&*fixture, stream).await.is_empty());
    let tx = begin(fixture.source()).await;
    let v = fixture
        .store()
        .append(&tx, stream, ExpectedVersion::NoStream, &[event("A", 1)])
        .await
        .expect("version 1 is free again");
    assert_eq!(v, 1);
    commit(fixture.source(), tx).await.expect("commit");
}

/// Expecting a version the stream is not at — behind it, ahead of it, or `NoStream` on an
/// existing stream — is a typed, retryable conflict that aborts the transaction; nothing is
/// written.
pub async fn a_wrong_expected_version_is_a_conflict_that_aborts_the_transaction<
    F: EventStoreFixture,
>(
    fixture: Arc<F>,
) {
    let stream = StreamId::new_v7();
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[event("A", 1), event("A", 2)],
        )
        .await
        .expect("append");
    commit(fixture.source(), tx).await.expect("commit");

    for expected in [
        ExpectedVersion::Exact(1),
        ExpectedVersion::Exact(3),
        ExpectedVersion::NoStream,
    ] {
        let tx = begin(fixture.source()).await;
        let err = fixture
            .store()
            .append(&tx, stream, expected, &[event("B", 3)])
            .await
            .expect_err("conflict");
        assert_eq!(err.kind(), ErrorKind::Conflict, "{expected}: {err}");
        assert!(err.is_retryable());
        let details = version_conflict(&err).expect("typed details");
        assert_eq!(details.stream_id(), stream);
        assert_eq!(details.expected(), expected);
        assert_eq!(details.actual(), Some(2));
        let after = fixture.store().load(&tx, stream).await;
        assert_eq!(
            after.expect_err("aborted").kind(),
            ErrorKind::TransactionAborted
        );
        let commit = commit(fixture.source(), tx).await;
        assert_eq!(
            commit.expect_err("aborted").kind(),
            ErrorKind::TransactionAborted
        );
    }
    assert_eq!(committed_versions(&*fixture, stream).await, [1, 2]);
}

/// `Any` appends after whatever the stream holds.
pub async fn any_appends_after_the_current_version<F: EventStoreFixture>(fixture: Arc<F>) {
    let stream = StreamId::new_v7();
    for expected_new in [1, 2, 3] {
        let tx = begin(fixture.source()).await;
        let v = fixture
            .store()
            .append(
                &tx,
                stream,
                ExpectedVersion::Any,
                &[event("A", expected_new)],
            )
            .await
            .expect("append");
        assert_eq!(v, expected_new);
        commit(fixture.source(), tx).await.expect("commit");
    }
}

/// An empty append is invalid input and leaves the transaction usable.
pub async fn an_empty_append_is_invalid_input<F: EventStoreFixture>(fixture: Arc<F>) {
    let stream = StreamId::new_v7();
    let tx = begin(fixture.source()).await;
    let err = fixture
        .store()
        .append(&tx, stream, ExpectedVersion::Any, &[])
        .await
        .expect_err("empty");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(versions(&*fixture, &tx, stream).await.is_empty(), "usable");
    commit(fixture.source(), tx).await.expect("commit");
}

/// Streams are independent: the same versions in two streams never conflict.
pub async fn streams_are_independent<F: EventStoreFixture>(fixture: Arc<F>) {
    let (s1, s2) = (StreamId::new_v7(), StreamId::new_v7());
    let (a, b) = (begin(fixture.source()).await, begin(fixture.source()).await);
    for (tx, stream) in [(&a, s1), (&b, s2)] {
        fixture
            .store()
            .append(tx, stream, ExpectedVersion::NoStream, &[event("A", 1)])
            .await
            .expect("append");
    }
    commit(fixture.source(), a).await.expect("commit");
    commit(fixture.source(), b).await.expect("commit");
    assert_eq!(committed_versions(&*fixture, s1).await, [1]);
    assert_eq!(committed_versions(&*fixture, s2).await, [1]);
}

/// Two transactions append the same version: the second waits for the first; when the first
/// commits, the second fails with a conflict (and its transaction is aborted); when the first
/// rolls back, the second's append goes through.
pub async fn concurrent_appends_of_one_version_let_exactly_one_commit<F: EventStoreFixture>(
    fixture: Arc<F>,
) {
    for first_commits in [true, false] {
        let stream = StreamId::new_v7();
        let first = begin(fixture.source()).await;
        fixture
            .store()
            .append(&first, stream, ExpectedVersion::NoStream, &[event("A", 1)])
            .await
            .expect("first append");
        let second = {
            let fixture = Arc::clone(&fixture);
            tokio::spawn(async move {
                let tx = begin(fixture.source()).await;
                let result = fixture
                    .store()
                    .append(&tx, stream, ExpectedVersion::NoStream, &[event("B", 1)])
                    .await;
                (tx, result)
            })
        };
        // Give the second writer a chance to reach its append (either way it must wait).
        tokio::time::sleep(Duration::from_millis(50)).await;
        if first_commits {
            commit(fixture.source(), first).await.expect("commit");
        } else {
            rollback(fixture.source(), first).await;
        }
        let (tx, result) = second.await.expect("second writer");
        if first_commits {
            let err = result.expect_err("the second append conflicts");
            assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
            assert_eq!(
                version_conflict(&err).map(|c| c.expected()),
                Some(ExpectedVersion::NoStream)
            );
            assert_eq!(
                commit(fixture.source(), tx)
                    .await
                    .expect_err("aborted")
                    .kind(),
                ErrorKind::TransactionAborted
            );
            let tx = begin(fixture.source()).await;
            let events = fixture.store().load(&tx, stream).await.expect("load");
            rollback(fixture.source(), tx).await;
            assert_eq!(events.len(), 1);
            assert_eq!(events[0].event_type, "A");
        } else {
            assert_eq!(result.expect("the second append goes through"), 1);
            commit(fixture.source(), tx).await.expect("commit");
            let tx = begin(fixture.source()).await;
            let events = fixture.store().load(&tx, stream).await.expect("load");
            rollback(fixture.source(), tx).await;
            assert_eq!(events.len(), 1);
            assert_eq!(events[0].event_type, "B");
        }
    }
}

/// `load_locked` waits for the key's holder and then loads what the holder committed; a
/// timeout is a typed lock timeout.
pub async fn load_locked_waits_for_the_holder_and_sees_its_commit<F: EventStoreFixture>(
    fixture: Arc<F>,
) {
    let (stream, key) = (StreamId::new_v7(), fresh_key());
    let holder = begin(fixture.source()).await;
    let seen = fixture
        .store()
        .load_locked(&holder, stream, &key, None)
        .await
        .expect("free");
    assert!(seen.is_empty());
    fixture
        .store()
        .append(&holder, stream, ExpectedVersion::NoStream, &[event("A", 1)])
        .await
        .expect("append");

    let timed_out = begin(fixture.source()).await;
    let err = fixture
        .store()
        .load_locked(&timed_out, stream, &key, Some(Duration::from_millis(100)))
        .await
        .expect_err("held");
    assert_eq!(err.kind(), ErrorKind::LockTimeout, "{err}");
    rollback(fixture.source(), timed_out).await;

    let waiter = {
        let (fixture, key) = (Arc::clone(&fixture), key.clone());
        tokio::spawn(async move {
            let tx = begin(fixture.source()).await;
            let events = fixture
                .store()
                .load_locked(&tx, stream, &key, None)
                .await
                .expect("lock and load");
            let v = fixture
                .store()
                .append(
                    &tx,
                    stream,
                    ExpectedVersion::Exact(events.len() as u64),
                    &[event("B", 2)],
                )
                .await
                .expect("no conflict under the lock");
            commit(fixture.source(), tx).await.expect("commit");
            (events.len(), v)
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    commit(fixture.source(), holder).await.expect("commit");
    let (loaded, v) = waiter.await.expect("waiter");
    assert_eq!(loaded, 1, "loaded after the holder's commit");
    assert_eq!(v, 2);
}

/// Runs every case, in order.
pub async fn run_all<F: EventStoreFixture>(fixture: Arc<F>) {
    appends_number_versions_from_one_and_load_in_order(Arc::clone(&fixture)).await;
    appends_are_visible_to_others_only_after_commit(Arc::clone(&fixture)).await;
    rolled_back_appends_vanish(Arc::clone(&fixture)).await;
    a_wrong_expected_version_is_a_conflict_that_aborts_the_transaction(Arc::clone(&fixture)).await;
    any_appends_after_the_current_version(Arc::clone(&fixture)).await;
    an_empty_append_is_invalid_input(Arc::clone(&fixture)).await;
    streams_are_independent(Arc::clone(&fixture)).await;
    concurrent_appends_of_one_version_let_exactly_one_commit(Arc::clone(&fixture)).await;
    load_locked_waits_for_the_holder_and_sees_its_commit(fixture).await;
}
