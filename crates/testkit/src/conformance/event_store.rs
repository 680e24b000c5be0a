//! The event-store conformance suite: versions, expected-version checks, transaction
//! visibility, concurrent appends of one version, aborted transactions, idempotent appends by
//! event id, lock-first loads, the last append held back until commit (`append_at_commit`),
//! schema versions stored with the events and upcasters applied on every load.
//!
//! Every case uses fresh stream ids and lock keys, so the suite can run against a shared
//! database. No case asserts on timing: a concurrent writer is spawned and the suite waits for
//! its outcome after ending the transaction it waits for.
//!
//! Run it with [`event_store_conformance!`](crate::event_store_conformance) (one test per case),
//! or call the cases or [`run_all`] yourself.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::{
    ErrorKind, EventStore, ExpectedVersion, NewEvent, ResourceKey, StreamId, Transaction,
    TransactionSource, Upcasters, ValidationError, version_conflict,
};

use super::{Upcasting, begin, commit, rollback, until_waiting};

/// What the suite needs from a backend: the store under test and owned transactions of the
/// type it runs on.
pub trait EventStoreFixture: Send + Sync + 'static {
    /// An owned, open transaction (`'static`, so a concurrent writer can be spawned).
    type Tx: lockstep_core::Transaction;
    /// The store under test.
    type Store: EventStore<Self::Tx> + 'static;
    /// The transaction source.
    type Source: TransactionSource<Tx = Self::Tx>;

    /// The store under test.
    fn store(&self) -> &Self::Store;

    /// The store under test over the same storage, reading every event through `upcasters`
    /// (the upcasting cases append with [`store`](Self::store) and load with this one).
    fn store_with_upcasters(&self, upcasters: Upcasters) -> Self::Store;

    /// Where the suite's transactions come from (each on its own connection, for a database
    /// backend). Committing a transaction aborted by a failed append must fail with
    /// [`ErrorKind::TransactionAborted`].
    fn source(&self) -> &Self::Source;

    /// How many statements on the fixture's database wait right now for a row or lock that
    /// another transaction holds (Postgres: backends of the test's database whose
    /// `pg_stat_activity.wait_event_type` is `Lock`; the fakes:
    /// [`FakeDatabase::waiting`](crate::FakeDatabase::waiting)). The concurrent cases wait on it
    /// before ending the transaction a second writer must wait for, so they test that order on
    /// a machine of any speed.
    fn waiting(&self) -> impl Future<Output = usize> + Send;
}

/// A transaction source whose database shows how many statements wait
/// ([`EventStoreFixture::waiting`]), so [`Fixture`] can serve the concurrent cases.
pub trait ShowsWaits {
    /// How many statements wait right now for a row or lock another transaction holds.
    fn waiting(&self) -> impl Future<Output = usize> + Send;
}

impl ShowsWaits for crate::FakeDatabase {
    fn waiting(&self) -> impl Future<Output = usize> + Send {
        std::future::ready(crate::FakeDatabase::waiting(self))
    }
}

/// A fixture made of a transaction source and a store running on its transactions (the
/// in-memory store on a [`FakeDatabase`](crate::FakeDatabase), or a Postgres store on a
/// pool's source).
#[derive(Debug, Clone)]
pub struct Fixture<S, St> {
    /// Where transactions come from.
    pub source: S,
    /// The store under test.
    pub store: St,
}

impl<S, St> Fixture<S, St> {
    /// A fixture of `store` on transactions of `source`.
    pub fn new(source: S, store: St) -> Self {
        Fixture { source, store }
    }
}

impl<S, St> EventStoreFixture for Fixture<S, St>
where
    S: TransactionSource + ShowsWaits + Sync + 'static,
    St: EventStore<S::Tx> + Upcasting + 'static,
{
    type Tx = S::Tx;
    type Store = St;
    type Source = S;

    fn store(&self) -> &St {
        &self.store
    }

    fn store_with_upcasters(&self, upcasters: Upcasters) -> St {
        self.store.upcasting(upcasters)
    }

    fn source(&self) -> &S {
        &self.source
    }

    fn waiting(&self) -> impl Future<Output = usize> + Send {
        self.source.waiting()
    }
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
    rollback(tx).await;
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
    commit(tx).await.expect("commit");

    let tx = begin(fixture.source()).await;
    let events = fixture.store().load(&tx, stream).await.expect("load");
    rollback(tx).await;
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
    commit(writer).await.expect("commit");
    assert_eq!(
        versions(&*fixture, &reader, stream).await,
        [1],
        "READ COMMITTED: the next read sees the commit"
    );
    rollback(reader).await;
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
    rollback(tx).await;
    assert!(committed_versions(&*fixture, stream).await.is_empty());
    let tx = begin(fixture.source()).await;
    let v = fixture
        .store()
        .append(&tx, stream, ExpectedVersion::NoStream, &[event("A", 1)])
        .await
        .expect("version 1 is free again");
    assert_eq!(v, 1);
    commit(tx).await.expect("commit");
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
    commit(tx).await.expect("commit");

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
        let commit = commit(tx).await;
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
        commit(tx).await.expect("commit");
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
    commit(tx).await.expect("commit");
}

/// Appends are idempotent by event id. Appending events whose ids are all stored in that
/// stream, at consecutive versions in the order given (with the expected version of the
/// original append, or `Any`), is a replay: it writes nothing and returns the version of the
/// last of them, even after the stream moved on. Stored ids that are anything else (some new,
/// another order, another stream, another expected version) are a non-retryable
/// [`ErrorKind::InvalidInput`] that aborts the transaction and writes nothing. An append that
/// lists one id twice is refused before anything happens (the transaction stays usable).
pub async fn appending_stored_event_ids_again_is_a_replay_or_a_refusal<F: EventStoreFixture>(
    fixture: Arc<F>,
) {
    let (stream, other) = (StreamId::new_v7(), StreamId::new_v7());
    let (a, b) = (event("A", 1), event("B", 2));
    let tx = begin(fixture.source()).await;
    let v = fixture
        .store()
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[a.clone(), b.clone()],
        )
        .await
        .expect("append");
    assert_eq!(v, 2);
    commit(tx).await.expect("commit");

    // Replays: the same append again (a retry after an unknown commit outcome), with `Any`,
    // of a suffix, and after the stream moved on.
    let replays: [(ExpectedVersion, Vec<NewEvent>); 3] = [
        (ExpectedVersion::NoStream, vec![a.clone(), b.clone()]),
        (ExpectedVersion::Any, vec![a.clone(), b.clone()]),
        (ExpectedVersion::Exact(1), vec![b.clone()]),
    ];
    for (expected, events) in &replays {
        let tx = begin(fixture.source()).await;
        let v = fixture
            .store()
            .append(&tx, stream, *expected, events)
            .await
            .unwrap_or_else(|e| panic!("replay at {expected}: {e}"));
        assert_eq!(v, 2, "{expected}: the original append's result");
        commit(tx).await.expect("commit");
    }
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .append(&tx, stream, ExpectedVersion::Exact(2), &[event("C", 3)])
        .await
        .expect("append");
    commit(tx).await.expect("commit");
    let tx = begin(fixture.source()).await;
    let v = fixture
        .store()
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[a.clone(), b.clone()],
        )
        .await
        .expect("a replay after the stream moved on");
    assert_eq!(v, 2);
    commit(tx).await.expect("commit");
    assert_eq!(committed_versions(&*fixture, stream).await, [1, 2, 3]);

    // Refusals. The last: an id stored in another stream, appended to a stream with events at
    // a wrong expected version, is refused as such (the ids decide first), not a conflict.
    let third = StreamId::new_v7();
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .append(&tx, third, ExpectedVersion::NoStream, &[event("G", 7)])
        .await
        .expect("append");
    commit(tx).await.expect("commit");
    let refused: [(StreamId, ExpectedVersion, Vec<NewEvent>); 6] = [
        (stream, ExpectedVersion::Any, vec![a.clone(), event("D", 4)]),
        (stream, ExpectedVersion::Any, vec![b.clone(), a.clone()]),
        (
            stream,
            ExpectedVersion::Exact(1),
            vec![a.clone(), b.clone()],
        ),
        (other, ExpectedVersion::Any, vec![a.clone()]),
        (
            other,
            ExpectedVersion::NoStream,
            vec![event("E", 5), b.clone()],
        ),
        (third, ExpectedVersion::Exact(9), vec![a.clone()]),
    ];
    for (target, expected, events) in &refused {
        let tx = begin(fixture.source()).await;
        let err = fixture
            .store()
            .append(&tx, *target, *expected, events)
            .await
            .expect_err("not a replay");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert!(!err.is_retryable());
        let after = fixture.store().load(&tx, stream).await;
        assert_eq!(
            after.expect_err("aborted").kind(),
            ErrorKind::TransactionAborted
        );
        rollback(tx).await;
    }
    assert_eq!(committed_versions(&*fixture, stream).await, [1, 2, 3]);
    assert!(committed_versions(&*fixture, other).await.is_empty());
    assert_eq!(committed_versions(&*fixture, third).await, [1]);

    let tx = begin(fixture.source()).await;
    let twice = event("F", 6);
    let err = fixture
        .store()
        .append(&tx, other, ExpectedVersion::Any, &[twice.clone(), twice])
        .await
        .expect_err("one id twice");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(versions(&*fixture, &tx, other).await.is_empty(), "usable");
    commit(tx).await.expect("commit");
}

/// Two transactions append the same event ids: the second waits for the first. When the first
/// commits, the second fails with a retryable conflict, and its retry is a replay that writes
/// nothing; when the first rolls back, the second's append goes through. The events are
/// stored once either way.
pub async fn a_concurrent_append_of_the_same_event_ids_stores_them_once<F: EventStoreFixture>(
    fixture: Arc<F>,
) {
    for first_commits in [true, false] {
        let stream = StreamId::new_v7();
        let (a, b) = (event("A", 1), event("B", 2));
        let first = begin(fixture.source()).await;
        fixture
            .store()
            .append(
                &first,
                stream,
                ExpectedVersion::NoStream,
                &[a.clone(), b.clone()],
            )
            .await
            .expect("first append");
        let second = {
            let (fixture, events) = (Arc::clone(&fixture), [a.clone(), b.clone()]);
            tokio::spawn(async move {
                let tx = begin(fixture.source()).await;
                let result = fixture
                    .store()
                    .append(&tx, stream, ExpectedVersion::NoStream, &events)
                    .await;
                (tx, result)
            })
        };
        // The second writer must wait for the first, whichever way the first ends.
        until_waiting(|| fixture.waiting(), 1, "the second writer's append").await;
        if first_commits {
            commit(first).await.expect("commit");
        } else {
            rollback(first).await;
        }
        let (tx, result) = second.await.expect("second writer");
        if first_commits {
            let err = result.expect_err("the second append lost the race");
            assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
            assert!(err.is_retryable());
            rollback(tx).await;
            let retry = begin(fixture.source()).await;
            let v = fixture
                .store()
                .append(&retry, stream, ExpectedVersion::NoStream, &[a, b])
                .await
                .expect("the retry is a replay");
            assert_eq!(v, 2);
            commit(retry).await.expect("commit");
        } else {
            assert_eq!(result.expect("the second append goes through"), 2);
            commit(tx).await.expect("commit");
        }
        assert_eq!(committed_versions(&*fixture, stream).await, [1, 2]);
    }
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
    commit(a).await.expect("commit");
    commit(b).await.expect("commit");
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
        // The second writer must wait for the first, whichever way the first ends.
        until_waiting(|| fixture.waiting(), 1, "the second writer's append").await;
        if first_commits {
            commit(first).await.expect("commit");
        } else {
            rollback(first).await;
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
                commit(tx).await.expect_err("aborted").kind(),
                ErrorKind::TransactionAborted
            );
            let tx = begin(fixture.source()).await;
            let events = fixture.store().load(&tx, stream).await.expect("load");
            rollback(tx).await;
            assert_eq!(events.len(), 1);
            assert_eq!(events[0].event_type, "A");
        } else {
            assert_eq!(result.expect("the second append goes through"), 1);
            commit(tx).await.expect("commit");
            let tx = begin(fixture.source()).await;
            let events = fixture.store().load(&tx, stream).await.expect("load");
            rollback(tx).await;
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
    rollback(timed_out).await;

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
            commit(tx).await.expect("commit");
            (events.len(), v)
        })
    };
    until_waiting(|| fixture.waiting(), 1, "the second load_locked").await;
    commit(holder).await.expect("commit");
    let (loaded, v) = waiter.await.expect("waiter");
    assert_eq!(loaded, 1, "loaded after the holder's commit");
    assert_eq!(v, 2);
}

/// `append_at_commit` stores its events when the transaction commits, at the next versions,
/// visible to others only after the commit; a rollback discards it.
pub async fn append_at_commit_is_stored_by_the_commit<F: EventStoreFixture>(fixture: Arc<F>) {
    let stream = StreamId::new_v7();
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .append(&tx, stream, ExpectedVersion::NoStream, &[event("A", 1)])
        .await
        .expect("append");
    let last = [event("B", 2), event("B", 3)];
    fixture
        .store()
        .append_at_commit(&tx, stream, ExpectedVersion::Exact(1), &last)
        .await
        .expect("accepted");
    assert!(
        committed_versions(&*fixture, stream).await.is_empty(),
        "nothing is visible before the commit"
    );
    commit(tx).await.expect("commit");
    let tx = begin(fixture.source()).await;
    let events = fixture.store().load(&tx, stream).await.expect("load");
    rollback(tx).await;
    let seen: Vec<_> = events.iter().map(|e| (e.version, e.event_id)).collect();
    assert_eq!(
        seen,
        [
            (1, events[0].event_id),
            (2, last[0].event_id()),
            (3, last[1].event_id())
        ]
    );

    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .append_at_commit(&tx, stream, ExpectedVersion::Exact(3), &[event("C", 4)])
        .await
        .expect("accepted");
    rollback(tx).await;
    assert_eq!(committed_versions(&*fixture, stream).await, [1, 2, 3]);
}

/// A stale expectation in `append_at_commit` is a retryable conflict — returned by the call or
/// by the commit — and the transaction is rolled back: nothing it wrote is stored and its
/// locks are released.
pub async fn a_conflicting_append_at_commit_rolls_the_transaction_back<F: EventStoreFixture>(
    fixture: Arc<F>,
) {
    let stream = StreamId::new_v7();
    let other = StreamId::new_v7();
    let key = fresh_key();
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .append(&tx, stream, ExpectedVersion::NoStream, &[event("A", 1)])
        .await
        .expect("append");
    commit(tx).await.expect("commit");

    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .load_locked(&tx, stream, &key, None)
        .await
        .expect("lock and load");
    fixture
        .store()
        .append(&tx, other, ExpectedVersion::NoStream, &[event("O", 1)])
        .await
        .expect("an earlier write of the same transaction");
    let stale = fixture
        .store()
        .append_at_commit(&tx, stream, ExpectedVersion::NoStream, &[event("B", 2)])
        .await;
    let err = match stale {
        Err(err) => {
            let _ = commit(tx).await;
            err
        }
        Ok(()) => commit(tx)
            .await
            .expect_err("the commit reports the conflict"),
    };
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(err.is_retryable());
    assert_eq!(version_conflict(&err).map(|c| c.stream_id()), Some(stream));
    assert_eq!(committed_versions(&*fixture, stream).await, [1]);
    assert!(
        committed_versions(&*fixture, other).await.is_empty(),
        "the earlier write was rolled back with it"
    );
    // The lock went with the transaction.
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .load_locked(&tx, stream, &key, Some(Duration::from_secs(5)))
        .await
        .expect("the key is free again");
    rollback(tx).await;
}

/// Bad input is refused by `append_at_commit` itself, with nothing held back: the transaction
/// stays usable and commits what else it wrote.
pub async fn append_at_commit_refuses_bad_input_at_once<F: EventStoreFixture>(fixture: Arc<F>) {
    let stream = StreamId::new_v7();
    let tx = begin(fixture.source()).await;
    let err = fixture
        .store()
        .append_at_commit(&tx, stream, ExpectedVersion::NoStream, &[])
        .await
        .expect_err("empty");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    let twice = event("A", 1);
    let err = fixture
        .store()
        .append_at_commit(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[twice.clone(), twice],
        )
        .await
        .expect_err("an id listed twice");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    fixture
        .store()
        .append(&tx, stream, ExpectedVersion::NoStream, &[event("B", 1)])
        .await
        .expect("the transaction is still usable");
    commit(tx).await.expect("commit");
    assert_eq!(committed_versions(&*fixture, stream).await, [1]);
}

/// A unit of work whose `append_at_commit` conflicts is retried by
/// `transaction_with_retry` like any conflict, and its retry commits.
pub async fn a_unit_of_work_retries_a_conflicting_append_at_commit<F: EventStoreFixture>(
    fixture: Arc<F>,
) {
    let stream = StreamId::new_v7();
    let attempts = std::sync::atomic::AtomicU32::new(0);
    let policy = lockstep_core::RetryPolicy::new(
        std::num::NonZeroU32::new(3).expect("3"),
        Duration::from_millis(1),
        Duration::from_millis(2),
    );
    let fx: &F = &fixture;
    let store = fx.store();
    let attempts_ref = &attempts;
    fx.source()
        .transaction_with_retry(&policy, tokio::time::sleep, |tx, _| {
            Box::pin(async move {
                let attempt = attempts_ref.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let seen = store.load(&tx, stream).await?.len() as u64;
                if attempt == 0 {
                    // Another writer gets there first, after our load.
                    let source = fx.source();
                    let other = source.begin().await?;
                    store
                        .append(
                            &other,
                            stream,
                            ExpectedVersion::Exact(seen),
                            &[event("X", 0)],
                        )
                        .await?;
                    other.commit().await?;
                }
                store
                    .append_at_commit(&tx, stream, ExpectedVersion::Exact(seen), &[event("Y", 1)])
                    .await
            })
        })
        .await
        .expect("the retry commits");
    assert_eq!(attempts.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(committed_versions(&*fixture, stream).await, [1, 2]);
}

/// `depth` arrays and objects, alternating, around a string (a scalar has depth 0).
fn nested(depth: usize) -> serde_json::Value {
    (0..depth).fold(serde_json::json!("leaf"), |value, level| {
        if level % 2 == 0 {
            serde_json::json!([1, value])
        } else {
            serde_json::json!({ "a": 1, "k": value })
        }
    })
}

/// The deepest payload a load can read back (127 levels of arrays and objects) is appended and
/// read back unchanged, by `load` and `load_locked`; one level deeper is refused when the event
/// is built, so it can never reach a stream and make it unloadable.
pub async fn the_deepest_readable_payload_round_trips_and_one_level_deeper_is_refused<
    F: EventStoreFixture,
>(
    fixture: Arc<F>,
) {
    let (stream, key) = (StreamId::new_v7(), fresh_key());
    let deepest = nested(NewEvent::MAX_PAYLOAD_DEPTH);
    let deep = NewEvent::new("Deep", deepest.clone()).expect("the deepest readable payload");
    let err = NewEvent::new("Deep", nested(NewEvent::MAX_PAYLOAD_DEPTH + 1))
        .expect_err("one level deeper is refused");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert_eq!(
        err.validation(),
        Some(&ValidationError::JsonTooDeep {
            field: "event payload",
            max: 127
        })
    );

    let tx = begin(fixture.source()).await;
    let v = fixture
        .store()
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[deep, event("A", 1)],
        )
        .await
        .expect("append");
    assert_eq!(v, 2);
    commit(tx).await.expect("commit");

    let tx = begin(fixture.source()).await;
    let loaded = fixture.store().load(&tx, stream).await.expect("load");
    let locked = fixture
        .store()
        .load_locked(&tx, stream, &key, None)
        .await
        .expect("load_locked");
    rollback(tx).await;
    for events in [loaded, locked] {
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].payload, deepest);
        assert_eq!(events[1].version, 2);
    }
}

/// Version 1 of `Deposited` is `{"amount": n}`, version 2 `{"amount": {"value": n}}`; the
/// upcaster fails on a payload without a whole amount.
fn deposited_upcasters() -> Upcasters {
    Upcasters::new()
        .with("Deposited", 1, |payload| {
            let amount = payload["amount"].as_i64().ok_or("no whole amount")?;
            Ok(serde_json::json!({ "amount": { "value": amount } }))
        })
        .expect("one upcaster")
}

fn deposited(payload: serde_json::Value, schema_version: u32) -> NewEvent {
    NewEvent::new("Deposited", payload)
        .expect("event")
        .with_schema_version(schema_version)
        .expect("a schema version")
}

/// The schema version of each event is stored by `append` and by `append_at_commit`, and loads
/// (plain and lock-first) hand it back with the payload as stored when no upcaster applies.
pub async fn a_schema_version_round_trips_through_append_and_load<F: EventStoreFixture>(
    fixture: Arc<F>,
) {
    let stream = StreamId::new_v7();
    let tx = begin(fixture.source()).await;
    let first = [
        deposited(serde_json::json!({ "amount": 1 }), 1),
        deposited(serde_json::json!({ "amount": 2 }), 3),
        event("Other", 3).with_schema_version(7).expect("version"),
    ];
    fixture
        .store()
        .append(&tx, stream, ExpectedVersion::NoStream, &first)
        .await
        .expect("append");
    let held = [deposited(serde_json::json!({ "amount": 4 }), 2)];
    fixture
        .store()
        .append_at_commit(&tx, stream, ExpectedVersion::Exact(3), &held)
        .await
        .expect("append_at_commit");
    commit(tx).await.expect("commit");

    let tx = begin(fixture.source()).await;
    let loaded = fixture.store().load(&tx, stream).await.expect("load");
    let locked = fixture
        .store()
        .load_locked(&tx, stream, &fresh_key(), Some(Duration::from_secs(30)))
        .await
        .expect("load_locked");
    rollback(tx).await;
    for events in [loaded, locked] {
        let read: Vec<(u64, u32, serde_json::Value)> = events
            .iter()
            .map(|e| (e.version, e.schema_version, e.payload.clone()))
            .collect();
        let appended: Vec<(u64, u32, serde_json::Value)> = first
            .iter()
            .chain(&held)
            .zip(1..)
            .map(|(e, v)| (v, e.schema_version(), e.payload().clone()))
            .collect();
        assert_eq!(read, appended);
    }
}

/// A store reading through upcasters loads every event in the current shape of its type: an
/// event of an older version lifted (its `schema_version` the version it was lifted to), a
/// current one and another type as stored. The same events through the plain store are as
/// stored: nothing was rewritten.
pub async fn a_store_with_upcasters_loads_lifted_payloads<F: EventStoreFixture>(fixture: Arc<F>) {
    let stream = StreamId::new_v7();
    let tx = begin(fixture.source()).await;
    let stored = [
        deposited(serde_json::json!({ "amount": 5 }), 1),
        deposited(serde_json::json!({ "amount": { "value": 7 } }), 2),
        event("Other", 3),
    ];
    fixture
        .store()
        .append(&tx, stream, ExpectedVersion::NoStream, &stored)
        .await
        .expect("append");
    commit(tx).await.expect("commit");

    let upcasting = fixture.store_with_upcasters(deposited_upcasters());
    let tx = begin(fixture.source()).await;
    let loaded = upcasting.load(&tx, stream).await.expect("load");
    let locked = upcasting
        .load_locked(&tx, stream, &fresh_key(), Some(Duration::from_secs(30)))
        .await
        .expect("load_locked");
    let plain = fixture.store().load(&tx, stream).await.expect("load");
    rollback(tx).await;
    for events in [loaded, locked] {
        let read: Vec<(u32, serde_json::Value)> = events
            .iter()
            .map(|e| (e.schema_version, e.payload.clone()))
            .collect();
        assert_eq!(
            read,
            [
                (2, serde_json::json!({ "amount": { "value": 5 } })),
                (2, serde_json::json!({ "amount": { "value": 7 } })),
                (1, stored[2].payload().clone()),
            ]
        );
    }
    let as_stored: Vec<(u32, serde_json::Value)> = plain
        .iter()
        .map(|e| (e.schema_version, e.payload.clone()))
        .collect();
    let appended: Vec<(u32, serde_json::Value)> = stored
        .iter()
        .map(|e| (e.schema_version(), e.payload().clone()))
        .collect();
    assert_eq!(as_stored, appended);
}

/// An upcaster that fails fails the load (plain and lock-first) with `InvalidInput` naming the
/// event, and changes nothing: the transaction stays usable, and the event is stored as it
/// was.
pub async fn a_failing_upcaster_fails_the_load_and_changes_nothing<F: EventStoreFixture>(
    fixture: Arc<F>,
) {
    let stream = StreamId::new_v7();
    let bad = deposited(serde_json::json!({ "amount": "lots" }), 1);
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[
                deposited(serde_json::json!({ "amount": 1 }), 1),
                bad.clone(),
            ],
        )
        .await
        .expect("append");
    commit(tx).await.expect("commit");

    let upcasting = fixture.store_with_upcasters(deposited_upcasters());
    let tx = begin(fixture.source()).await;
    let err = upcasting
        .load(&tx, stream)
        .await
        .expect_err("an upcaster fails");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(
        err.to_string().contains(&bad.event_id().to_string()),
        "{err}"
    );
    let err = upcasting
        .load_locked(&tx, stream, &fresh_key(), Some(Duration::from_secs(30)))
        .await
        .expect_err("an upcaster fails");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    // The transaction is usable: it appends and commits.
    fixture
        .store()
        .append(&tx, stream, ExpectedVersion::Exact(2), &[event("After", 3)])
        .await
        .expect("the transaction is usable");
    commit(tx).await.expect("commit");

    let tx = begin(fixture.source()).await;
    let stored = fixture.store().load(&tx, stream).await.expect("load");
    rollback(tx).await;
    assert_eq!(stored.len(), 3);
    assert_eq!(stored[1].event_id, bad.event_id());
    assert_eq!(&stored[1].payload, bad.payload());
    assert_eq!(stored[1].schema_version, 1);
}

/// Runs every case, in order, in one test. Prefer
/// [`event_store_conformance!`](crate::event_store_conformance): a test per case.
pub async fn run_all<F: EventStoreFixture>(fixture: Arc<F>) {
    crate::__lockstep_event_store_cases!(__lockstep_conformance_run_all! { by_arc fixture });
}

#[doc(hidden)]
#[macro_export]
macro_rules! __lockstep_event_store_cases {
    ($then:ident ! { $($args:tt)* }) => {
        $crate::$then! { $($args)* cases: [
            appends_number_versions_from_one_and_load_in_order,
            appends_are_visible_to_others_only_after_commit,
            rolled_back_appends_vanish,
            a_wrong_expected_version_is_a_conflict_that_aborts_the_transaction,
            any_appends_after_the_current_version,
            an_empty_append_is_invalid_input,
            appending_stored_event_ids_again_is_a_replay_or_a_refusal,
            a_concurrent_append_of_the_same_event_ids_stores_them_once,
            streams_are_independent,
            concurrent_appends_of_one_version_let_exactly_one_commit,
            load_locked_waits_for_the_holder_and_sees_its_commit,
            append_at_commit_is_stored_by_the_commit,
            a_conflicting_append_at_commit_rolls_the_transaction_back,
            append_at_commit_refuses_bad_input_at_once,
            a_unit_of_work_retries_a_conflicting_append_at_commit,
            the_deepest_readable_payload_round_trips_and_one_level_deeper_is_refused,
            a_schema_version_round_trips_through_append_and_load,
            a_store_with_upcasters_loads_lifted_payloads,
            a_failing_upcaster_fails_the_load_and_changes_nothing,
        ] }
    };
}

/// Expands to one test per case of the [event-store conformance
/// suite](crate::conformance::event_store), each on a fixture of its own.
///
/// `fixture:` is an expression evaluated inside each test (it may `.await`) that yields a
/// [`EventStoreFixture`](crate::conformance::event_store::EventStoreFixture); the test wraps it in an `Arc`.
/// Attributes written first replace the default `#[tokio::test]`:
/// `#[tokio::test(start_paused = true)]` for the fakes,
/// `#[tokio::test(flavor = "multi_thread")]` for a database. `after_each:` (optional) is a
/// closure called with `&fixture` after the case passed, to check what the case left behind.
/// See [`stream_locker_conformance!`](crate::stream_locker_conformance) for what the calling
/// crate needs. Not covered by semver (see [`conformance`](crate::conformance)).
///
/// ```
/// mod in_memory {
///     use lockstep_testkit::conformance::event_store::Fixture;
///     use lockstep_testkit::{FakeDatabase, InMemoryEventStore};
///
///     lockstep_testkit::event_store_conformance! {
///         #[tokio::test(start_paused = true)]
///         fixture: Fixture::new(FakeDatabase::new(), InMemoryEventStore::new()),
///     }
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! event_store_conformance {
    ($(#[$attr:meta])+ fixture: $fixture:expr $(, after_each: $after:expr)? $(,)?) => {
        $crate::__lockstep_event_store_cases!(__lockstep_conformance_tests! {
            suite: event_store,
            pass: by_arc,
            attrs: [$(#[$attr])+],
            fixture: $fixture,
            after_each: [$($after)?],
        });
    };
    (fixture: $($rest:tt)*) => {
        $crate::event_store_conformance! { #[::tokio::test] fixture: $($rest)* }
    };
}
