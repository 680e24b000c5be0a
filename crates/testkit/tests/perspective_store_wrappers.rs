//! The perspective-store wrappers: the whole conformance suite through
//! [`RecordingPerspectiveStore`] and through [`FaultyPerspectiveStore`] with no fault armed
//! (each wraps the in-memory store, on the same fixture as `perspective_store_in_memory.rs`),
//! which shows that every method forwards; then what the recording records and how each fault
//! fires once per arm and then stops, from inside `tokio::spawn` as an application's task
//! would call them.

use lockstep_core::StreamLockOptions;
use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    BatchClaim, BatchEntry, ErrorKind, EventStore, ExpectedVersion, NewEvent, PageLimits, Pair,
    PairFailure, PerspectiveLifecycle, PerspectiveName, Release, RewindDebounce, StateCommit,
    StreamId, Transaction, TransactionSource,
};
use lockstep_testkit::conformance::perspective_store::Fixture;
use lockstep_testkit::conformance::stream_locker::{SHORT_KEEPALIVE, SHORT_LOCK_TIMEOUT};
use lockstep_testkit::{
    ClaimKind, FakeDatabase, FaultyPerspectiveStore, InMemoryEventStore, InMemoryPerspectiveStore,
    InMemoryStreamLocker, PerspectiveMethod, PerspectiveStoreFaults, RecordingPerspectiveStore,
    Returned,
};

type Recording = Fixture<
    FakeDatabase,
    RecordingPerspectiveStore<InMemoryPerspectiveStore>,
    InMemoryEventStore,
    InMemoryStreamLocker,
>;

type Faulty = Fixture<
    FakeDatabase,
    FaultyPerspectiveStore<InMemoryPerspectiveStore>,
    InMemoryEventStore,
    InMemoryStreamLocker,
>;

/// The in-memory store over a fresh fake database, its event store and a locker on the same
/// cursor rows, as `perspective_store_in_memory.rs` builds it.
fn parts() -> (
    FakeDatabase,
    InMemoryPerspectiveStore,
    InMemoryEventStore,
    InMemoryStreamLocker,
) {
    let db = FakeDatabase::new();
    let events = InMemoryEventStore::new();
    let options = StreamLockOptions::new(SHORT_LOCK_TIMEOUT, SHORT_KEEPALIVE).expect("valid");
    let locker = InMemoryStreamLocker::with_database(options, &db);
    let store = InMemoryPerspectiveStore::new(&db, &events, &locker);
    (db, store, events, locker)
}

fn recording() -> Recording {
    let (db, store, events, locker) = parts();
    Fixture::new(db, RecordingPerspectiveStore::new(store), events, locker)
}

fn faulty() -> (Faulty, PerspectiveStoreFaults) {
    let (db, store, events, locker) = parts();
    let (store, faults) = FaultyPerspectiveStore::new(store);
    (Fixture::new(db, store, events, locker), faults)
}

mod recording_conformance {
    use super::{Recording, recording};

    lockstep_testkit::perspective_store_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: recording(),
        after_each: |f: &Recording| {
            assert!(f.source.is_idle(), "the case leaves no lock or waiter behind");
            assert!(!f.store.calls().is_empty(), "the calls went through the recording");
        },
    }
}

mod faulty_conformance {
    use super::{Faulty, faulty};

    lockstep_testkit::perspective_store_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: faulty().0,
        after_each: |f: &Faulty| {
            assert!(f.source.is_idle(), "the case leaves no lock or waiter behind");
        },
    }
}

fn perspective() -> PerspectiveName {
    PerspectiveName::new(format!("P-{}", uuid::Uuid::new_v4().simple())).expect("valid")
}

/// Registers `p` and appends one event to a fresh stream: one pair with one event of work.
async fn one_pair_of_work<S: PerspectiveLifecycle<lockstep_testkit::FakeTransaction>>(
    db: &FakeDatabase,
    store: &S,
    events: &InMemoryEventStore,
    p: &PerspectiveName,
) -> Pair {
    let tx = db.begin().await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(p))
        .await
        .expect("register");
    tx.commit().await.expect("commit");
    let stream = StreamId::new_v7();
    let tx = db.begin().await.expect("begin");
    let event = NewEvent::new("Added", serde_json::json!({ "n": 1 })).expect("event");
    events
        .append(&tx, stream, ExpectedVersion::Any, &[event])
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    Pair::new(stream, p.clone())
}

/// The recording keeps each call's method, pairs, perspectives and a summary of what came back
/// (or the error's kind), in order, and forgets them when cleared.
#[tokio::test]
async fn the_recording_records_each_call_in_order_with_its_outcome() {
    let task = tokio::spawn(async {
        let f = recording();
        let p = perspective();
        let pair = one_pair_of_work(&f.source, &f.store, &f.events, &p).await;

        let tx = f.source.begin().await.expect("begin");
        let batch = f
            .store
            .claim_batch(&tx, &BatchClaim::new(std::slice::from_ref(&p)))
            .await
            .expect("claim_batch");
        let cursor = batch.pairs[0].cursor.clone();
        let mut change = StateCommit::new(pair.clone(), cursor.revision, serde_json::json!({}));
        change.applied_count = 1;
        let entries = [BatchEntry::new(pair.clone(), Some(change), None)];
        f.store
            .commit_batch(&tx, &entries)
            .await
            .expect("commit_batch");
        tx.commit().await.expect("commit");

        let tx = f.source.begin().await.expect("begin");
        let unknown = Pair::new(StreamId::new_v7(), p.clone());
        assert!(
            f.store
                .cursor(&tx, &unknown)
                .await
                .expect("cursor")
                .is_none()
        );
        let err = f
            .store
            .states(&tx, &p, None, 0)
            .await
            .expect_err("a limit of 0 is invalid");
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        tx.rollback().await.expect("rollback");

        let calls = f.store.calls();
        assert_eq!(
            f.store.methods(),
            [
                PerspectiveMethod::Register,
                PerspectiveMethod::ClaimBatch,
                PerspectiveMethod::CommitBatch,
                PerspectiveMethod::Cursor,
                PerspectiveMethod::States,
            ]
        );
        assert_eq!(calls[0].perspectives, std::slice::from_ref(&p));
        assert_eq!(calls[0].outcome, Ok(Returned::Done));
        assert_eq!(calls[1].perspectives, std::slice::from_ref(&p));
        assert_eq!(calls[1].outcome, Ok(Returned::Pairs(vec![pair.clone()])));
        assert_eq!(calls[2].pairs, std::slice::from_ref(&pair));
        assert!(
            matches!(&calls[2].outcome, Ok(Returned::Entries(done)) if done.len() == 1),
            "{:?}",
            calls[2].outcome
        );
        assert_eq!(calls[3].pairs, [unknown]);
        assert_eq!(calls[3].outcome, Ok(Returned::Found(false)));
        assert_eq!(calls[4].outcome, Err(ErrorKind::InvalidInput));
        assert_eq!(f.store.calls_of(PerspectiveMethod::Cursor).len(), 1);

        f.store.clear();
        assert!(f.store.calls().is_empty());
        let tx = f.source.begin().await.expect("begin");
        let claim = f
            .store
            .claim(&tx, &pair, 10, RewindDebounce::NONE)
            .await
            .expect("claim");
        tx.rollback().await.expect("rollback");
        // The batch commit above applied no event, so its work is still there.
        assert!(
            matches!(&claim, lockstep_core::Claim::Apply { events, .. } if events.len() == 1),
            "{claim:?}"
        );
        assert_eq!(f.store.calls().len(), 1);
        assert_eq!(
            f.store.calls()[0].outcome,
            Ok(Returned::Claim(ClaimKind::Apply { events: 1 }))
        );
    });
    task.await.expect("the task ran");
}

/// Asserts that the call fails once with `kind` and then goes through.
macro_rules! fails_once {
    ($kind:expr, $call:expr) => {{
        let err = $call.await.expect_err("the armed fault fires");
        assert_eq!(err.kind(), $kind, "{err}");
        $call.await.expect("the fault fired once and stopped");
    }};
}

/// Each fault of the handle fails the next call of its method (or group) once per arm, with
/// the kind asked for, then the calls go through again; an armed fault of another method
/// leaves the others alone.
#[tokio::test]
async fn each_fault_fires_once_per_arm_and_then_stops() {
    let task = tokio::spawn(async {
        let (f, faults) = faulty();
        let p = perspective();
        faults.fail_next_registers(1, ErrorKind::ConnectionLost);
        let tx = f.source.begin().await.expect("begin");
        fails_once!(
            ErrorKind::ConnectionLost,
            f.store.register(&tx, std::slice::from_ref(&p))
        );
        tx.commit().await.expect("commit");
        let pair = one_pair_of_work(&f.source, &f.store, &f.events, &p).await;
        let tx = f.source.begin().await.expect("begin");
        let claim = BatchClaim::new(std::slice::from_ref(&p));

        faults.fail_next_claims(1, ErrorKind::Backend);
        faults.fail_next_claim_batches(1, ErrorKind::LockTimeout);
        fails_once!(ErrorKind::LockTimeout, f.store.claim_batch(&tx, &claim));
        fails_once!(
            ErrorKind::Backend,
            f.store.claim(&tx, &pair, 10, RewindDebounce::NONE)
        );

        faults.fail_next_batch_commits(1, ErrorKind::ConnectionLost);
        fails_once!(ErrorKind::ConnectionLost, f.store.commit_batch(&tx, &[]));

        let failure = PairFailure::new("boom");
        faults.fail_next_failure_records(1, ErrorKind::Backend);
        fails_once!(
            ErrorKind::Backend,
            f.store.record_failure(&tx, &pair, &failure)
        );

        faults.fail_next_rewind_loads(1, ErrorKind::LockTimeout);
        fails_once!(
            ErrorKind::LockTimeout,
            f.store.load_rewind(&tx, &pair, PageLimits::default())
        );

        // The state reads count together: one fault for whichever comes next.
        faults.fail_next_state_reads(2, ErrorKind::ConnectionLost);
        let err = f.store.state(&tx, &pair).await.expect_err("first");
        assert_eq!(err.kind(), ErrorKind::ConnectionLost);
        let err = f.store.cursor(&tx, &pair).await.expect_err("second");
        assert_eq!(err.kind(), ErrorKind::ConnectionLost);
        f.store.states(&tx, &p, None, 10).await.expect("stopped");

        // Any method, by name.
        faults.fail_next_calls(PerspectiveMethod::Throughput, 1, ErrorKind::Backend);
        fails_once!(ErrorKind::Backend, f.store.throughput(&tx));

        // A failed commit rolls its transaction back; after two, the commits go through.
        let cursor = f
            .store
            .cursor(&tx, &pair)
            .await
            .expect("cursor")
            .expect("a cursor row");
        tx.commit().await.expect("commit");
        let change = StateCommit::new(pair.clone(), cursor.revision, serde_json::json!({}));
        faults.fail_next_commits(2, ErrorKind::Conflict);
        for which in ["first", "second"] {
            let tx = f.source.begin().await.expect("begin");
            let err = f
                .store
                .commit(tx, &change, Release::Keep)
                .await
                .expect_err(which);
            assert_eq!(err.kind(), ErrorKind::Conflict);
            assert!(f.source.is_idle(), "the transaction was ended");
        }
        let tx = f.source.begin().await.expect("begin");
        f.store
            .commit(tx, &change, Release::Keep)
            .await
            .expect("stopped: the commit goes through");
    });
    task.await.expect("the task ran");
}

/// The committed revision of the pair's cursor (-1: none).
async fn revision(f: &Faulty, pair: &Pair) -> i64 {
    let tx = f.source.begin().await.expect("begin");
    let cursor = f.store.cursor(&tx, pair).await.expect("cursor");
    tx.rollback().await.expect("rollback");
    cursor.map_or(-1, |c| c.revision)
}

/// An injected failure of a commit rolls its transaction back; a lost reply commits and reports
/// `CommitUnknown`; each once, then the commits go through.
#[tokio::test]
async fn a_commit_fails_or_loses_its_reply_once() {
    let task = tokio::spawn(async {
        let (f, faults) = faulty();
        let p = perspective();
        let pair = one_pair_of_work(&f.source, &f.store, &f.events, &p).await;
        let tx = f.source.begin().await.expect("begin");
        f.store.ensure_cursor(&tx, &pair).await.expect("cursor");
        tx.commit().await.expect("commit");
        let before = revision(&f, &pair).await;
        let change =
            |revision: i64| StateCommit::new(pair.clone(), revision, serde_json::json!({}));

        faults.fail_next_commits(1, ErrorKind::LeaseLost);
        let tx = f.source.begin().await.expect("begin");
        let err = f
            .store
            .commit(tx, &change(before), Release::Lease)
            .await
            .expect_err("injected");
        assert_eq!(err.kind(), ErrorKind::LeaseLost);
        assert_eq!(revision(&f, &pair).await, before, "nothing committed");
        assert!(f.source.is_idle(), "the transaction was ended");

        faults.lose_next_commit_replies(1);
        let tx = f.source.begin().await.expect("begin");
        let err = f
            .store
            .commit(tx, &change(before), Release::Lease)
            .await
            .expect_err("reply lost");
        assert_eq!(err.kind(), ErrorKind::CommitUnknown);
        let after = revision(&f, &pair).await;
        assert!(after > before, "committed all the same");

        let tx = f.source.begin().await.expect("begin");
        let committed = f
            .store
            .commit(tx, &change(after), Release::Lease)
            .await
            .expect("stopped");
        assert_eq!(revision(&f, &pair).await, committed.revision);
    });
    task.await.expect("the task ran");
}

/// With latency set, every call waits it out on tokio's clock before going through; `clear`
/// removes the latency and every armed fault.
#[tokio::test(start_paused = true)]
async fn latency_delays_every_call_and_clear_removes_every_fault() {
    let task = tokio::spawn(async {
        let (f, faults) = faulty();
        let p = perspective();
        faults.set_latency(std::time::Duration::from_secs(5));
        let start = tokio::time::Instant::now();
        let tx = f.source.begin().await.expect("begin");
        f.store
            .register(&tx, std::slice::from_ref(&p))
            .await
            .expect("register");
        assert!(start.elapsed() >= std::time::Duration::from_secs(5));

        faults.fail_next_registers(3, ErrorKind::Backend);
        faults.fail_next_commits(3, ErrorKind::Backend);
        faults.clear();
        let start = tokio::time::Instant::now();
        f.store
            .register(&tx, std::slice::from_ref(&p))
            .await
            .expect("no fault left");
        assert_eq!(
            start.elapsed(),
            std::time::Duration::ZERO,
            "no latency left"
        );
        tx.commit().await.expect("commit");
    });
    task.await.expect("the task ran");
}
