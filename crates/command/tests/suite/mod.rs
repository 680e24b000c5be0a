//! The command runner's behaviour, written once and run on the testkit's fakes
//! (`tests/fakes.rs`) and on PostgreSQL (`tests/postgres.rs`), in every mode: no lost update
//! with many concurrent handlers, every answer carries the state after its own command, a
//! business refusal is neither retried nor appended, a conflict is retried in the optimistic
//! mode, and `handle_in` commits with the caller's other write or not at all. Every command is
//! handled from inside `tokio::spawn`, with the backend's concrete types.

#![allow(dead_code, unreachable_pub)]

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use lockstep_command::{CommandError, CommandRunner, Mode, RunnerOptions};
use lockstep_core::serde_json::json;
use lockstep_core::{
    AggregateType, Decider, EventStore, ExpectedVersion, NewEvent, RecordedEvent, Result,
    RetryPolicy, SnapshotStore, StreamId, Transaction, TransactionSource, Uuid,
};
use tokio::sync::{Semaphore, mpsc};

/// Every mode.
pub const MODES: [Mode; 3] = [Mode::Optimistic, Mode::Locked, Mode::Combined];

/// What a counter is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmd {
    /// Add one.
    Add,
    /// Add one once the gate lets the decision through (it says when it started).
    AddAtTheGate,
    /// Add `n`, refused when the count would pass the limit.
    AddUpTo { n: u64, limit: u64 },
}

/// The business answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverLimit {
    pub count: u64,
}

impl std::fmt::Display for OverLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the count is already {}", self.count)
    }
}

/// A counter whose decisions are counted and may wait at a gate.
pub struct Counter {
    ty: AggregateType,
    decisions: Arc<AtomicU32>,
    gate: Arc<Semaphore>,
    entered: mpsc::UnboundedSender<()>,
}

/// The test's side of a [`Counter`].
pub struct CounterHandle {
    pub decisions: Arc<AtomicU32>,
    pub gate: Arc<Semaphore>,
    pub entered: mpsc::UnboundedReceiver<()>,
}

impl Counter {
    pub fn new() -> (Counter, CounterHandle) {
        let decisions = Arc::new(AtomicU32::new(0));
        let gate = Arc::new(Semaphore::new(0));
        let (tx, rx) = mpsc::unbounded_channel();
        (
            Counter {
                ty: AggregateType::new("Counter").expect("valid"),
                decisions: Arc::clone(&decisions),
                gate: Arc::clone(&gate),
                entered: tx,
            },
            CounterHandle {
                decisions,
                gate,
                entered: rx,
            },
        )
    }
}

impl Decider for Counter {
    type State = u64;
    type Command = Cmd;
    type Event = u64;
    type Error = OverLimit;

    fn aggregate_type(&self) -> &AggregateType {
        &self.ty
    }

    fn initial_state(&self, _id: Uuid) -> u64 {
        0
    }

    async fn decide(&self, count: &u64, cmd: &Cmd) -> std::result::Result<Vec<u64>, OverLimit> {
        self.decisions.fetch_add(1, Ordering::SeqCst);
        match *cmd {
            Cmd::Add => Ok(vec![1]),
            Cmd::AddAtTheGate => {
                let _ = self.entered.send(());
                self.gate.acquire().await.expect("gate open").forget();
                Ok(vec![1])
            }
            Cmd::AddUpTo { n, limit } if count + n > limit => Err(OverLimit { count: *count }),
            Cmd::AddUpTo { n, .. } => Ok(vec![n]),
        }
    }

    fn evolve(&self, count: u64, added: &u64) -> u64 {
        count + added
    }

    fn encode(&self, added: &u64) -> Result<NewEvent> {
        NewEvent::new("Added", json!({ "n": added }))
    }

    fn decode(&self, event: &RecordedEvent) -> Result<u64> {
        Ok(event.payload["n"].as_u64().unwrap_or(0))
    }
}

/// A backend: how "the process" reaches the database.
pub trait Backend: Send + Sync + 'static {
    type Src: TransactionSource + Clone + 'static;
    type Store: SnapshotStore<<Self::Src as TransactionSource>::Tx> + Clone + 'static;

    fn process(&self) -> (Self::Src, Self::Store);

    /// The next `COMMIT` of the process's connections commits, and its reply is lost.
    fn lose_next_commit_reply(&self);
}

pub type Runner<B> = CommandRunner<<B as Backend>::Src, <B as Backend>::Store, Counter>;

/// Retries enough for every loser of a contended optimistic run to get through.
pub fn patient() -> RetryPolicy {
    RetryPolicy::new(
        NonZeroU32::new(10_000).expect("non-zero"),
        Duration::from_millis(1),
        Duration::from_millis(20),
    )
}

pub fn runner<B: Backend>(backend: &B, mode: Mode) -> (Runner<B>, CounterHandle) {
    let (src, store) = backend.process();
    let (counter, handle) = Counter::new();
    let options = RunnerOptions::new(mode).retry(patient());
    (
        CommandRunner::with_options(src, store, counter, options),
        handle,
    )
}

/// The stream of `id` as committed.
pub async fn committed<B: Backend>(backend: &B, id: Uuid) -> Vec<RecordedEvent> {
    let (src, store) = backend.process();
    let tx = src.begin().await.expect("begin");
    let events = store
        .load(&tx, StreamId::from_uuid(id))
        .await
        .expect("load");
    let _ = tx.rollback().await;
    events
}

/// `n` handlers add one each, at once, each from a task of its own: the counter ends at
/// exactly `n`, every answer holds the state after its own command (the count equals its
/// version), and the versions are 1..=n.
pub async fn concurrent_handlers_lose_no_update<B: Backend>(backend: B) {
    const N: u64 = 16;
    for mode in MODES {
        let (runner, _handle) = runner(&backend, mode);
        let id = Uuid::now_v7();
        let tasks: Vec<_> = (0..N)
            .map(|_| {
                let runner = runner.clone();
                tokio::spawn(async move { runner.handle(id, Cmd::Add).await })
            })
            .collect();
        let mut versions = Vec::new();
        for task in tasks {
            let done = task
                .await
                .expect("task")
                .unwrap_or_else(|e| panic!("{mode:?}: {e:?}"));
            assert_eq!(
                *done.state(),
                done.version(),
                "{mode:?}: the state after the command"
            );
            assert_eq!(done.event_ids().len(), 1);
            assert_eq!(done.first_version(), done.version());
            versions.push(done.version());
        }
        versions.sort_unstable();
        assert_eq!(versions, (1..=N).collect::<Vec<_>>(), "{mode:?}");
        let events = committed(&backend, id).await;
        assert_eq!(events.len() as u64, N, "{mode:?}: no lost update");
    }
}

/// A refusal is answered once, with the decider's own error: decided once, nothing appended.
pub async fn a_refusal_is_not_retried_and_appends_nothing<B: Backend>(backend: B) {
    for mode in MODES {
        let (runner, handle) = runner(&backend, mode);
        let id = Uuid::now_v7();
        let r = runner.clone();
        let first =
            tokio::spawn(async move { r.handle(id, Cmd::AddUpTo { n: 3, limit: 5 }).await })
                .await
                .expect("task")
                .expect("accepted");
        assert_eq!(
            (*first.state(), first.version(), first.attempts()),
            (3, 1, 1)
        );
        let before = handle.decisions.load(Ordering::SeqCst);
        let r = runner.clone();
        let refused =
            tokio::spawn(async move { r.handle(id, Cmd::AddUpTo { n: 3, limit: 5 }).await })
                .await
                .expect("task");
        match refused {
            Err(CommandError::Rejected(why)) => assert_eq!(why, OverLimit { count: 3 }),
            other => panic!("{mode:?}: {other:?}"),
        }
        assert_eq!(
            handle.decisions.load(Ordering::SeqCst) - before,
            1,
            "{mode:?}: decided once"
        );
        assert_eq!(committed(&backend, id).await.len(), 1, "{mode:?}");
    }
}

/// In the optimistic mode, a command whose stream moved between its load and its append is
/// run again on the state loaded anew: it answers after two attempts, on top of the other
/// writer's event.
pub async fn a_conflict_is_retried_in_optimistic_mode<B: Backend>(backend: B) {
    let (runner, mut handle) = runner(&backend, Mode::Optimistic);
    let id = Uuid::now_v7();
    let r = runner.clone();
    let gated = tokio::spawn(async move { r.handle(id, Cmd::AddAtTheGate).await });
    handle.entered.recv().await.expect("the decision started");
    // Another writer appends while the decision waits.
    let (src, store) = backend.process();
    let tx = src.begin().await.expect("begin");
    let event = NewEvent::new("Added", json!({ "n": 10 })).expect("event");
    store
        .append(
            &tx,
            StreamId::from_uuid(id),
            ExpectedVersion::NoStream,
            &[event],
        )
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    handle.gate.add_permits(2);
    let done = gated.await.expect("task").expect("accepted");
    assert_eq!(done.attempts(), 2, "the conflict was retried");
    assert_eq!((*done.state(), done.version()), (11, 2));
    assert_eq!(committed(&backend, id).await.len(), 2);
}

/// `handle_in` appends on the caller's transaction: a second stream written on the same
/// transaction commits with the command, and a rollback takes both back.
pub async fn handle_in_commits_with_the_callers_other_write_or_not_at_all<B: Backend>(backend: B) {
    for mode in MODES {
        for commit in [true, false] {
            let (runner, _handle) = runner(&backend, mode);
            let (id, other) = (Uuid::now_v7(), Uuid::now_v7());
            let (src, store) = backend.process();
            let done = tokio::spawn(async move {
                let tx = src.begin().await.expect("begin");
                let done = runner
                    .handle_in(&tx, id, &Cmd::AddUpTo { n: 2, limit: 9 })
                    .await
                    .expect("decided");
                let note = NewEvent::new("Noted", json!({})).expect("event");
                store
                    .append(
                        &tx,
                        StreamId::from_uuid(other),
                        ExpectedVersion::NoStream,
                        &[note],
                    )
                    .await
                    .expect("the caller's other write");
                if commit {
                    tx.commit().await.expect("commit");
                } else {
                    tx.rollback().await.expect("rollback");
                }
                done
            })
            .await
            .expect("task");
            assert_eq!((*done.state(), done.version()), (2, 1));
            let expected = usize::from(commit);
            assert_eq!(committed(&backend, id).await.len(), expected, "{mode:?}");
            assert_eq!(committed(&backend, other).await.len(), expected, "{mode:?}");
        }
    }
}

/// A refusal inside the caller's unit of work leaves its transaction usable.
pub async fn a_refusal_in_handle_in_leaves_the_transaction_usable<B: Backend>(backend: B) {
    let (runner, _handle) = runner(&backend, Mode::Locked);
    let (id, other) = (Uuid::now_v7(), Uuid::now_v7());
    let (src, store) = backend.process();
    tokio::spawn(async move {
        let tx = src.begin().await.expect("begin");
        let refused = runner
            .handle_in(&tx, id, &Cmd::AddUpTo { n: 20, limit: 9 })
            .await;
        assert!(
            matches!(refused, Err(CommandError::Rejected(_))),
            "{refused:?}"
        );
        let note = NewEvent::new("Noted", json!({})).expect("event");
        store
            .append(
                &tx,
                StreamId::from_uuid(other),
                ExpectedVersion::NoStream,
                &[note],
            )
            .await
            .expect("the transaction is still usable");
        tx.commit().await.expect("commit");
    })
    .await
    .expect("task");
    assert!(committed(&backend, id).await.is_empty());
    assert_eq!(committed(&backend, other).await.len(), 1);
}

/// A lost `COMMIT` reply is `CommitUnknown` with the ids of the command's events, in every
/// mode, and is not retried: the events are in the stream once.
pub async fn a_lost_commit_reply_is_commit_unknown_and_not_retried<B: Backend>(backend: B) {
    for mode in MODES {
        let (runner, _handle) = runner(&backend, mode);
        let id = Uuid::now_v7();
        // A first command opens the connection (its `BEGIN` and statements are not cut).
        runner.handle(id, Cmd::Add).await.expect("handled");
        backend.lose_next_commit_reply();
        let lost = tokio::spawn(async move { runner.handle(id, Cmd::Add).await })
            .await
            .expect("task");
        let Err(CommandError::CommitUnknown { error, event_ids }) = lost else {
            panic!("{mode:?}: expected CommitUnknown, got {lost:?}");
        };
        assert_eq!(
            error.kind(),
            lockstep_core::ErrorKind::CommitUnknown,
            "{mode:?}"
        );
        assert_eq!(event_ids.len(), 1, "{mode:?}");
        let events = committed(&backend, id).await;
        let ids: Vec<Uuid> = events.iter().map(|e| e.event_id).collect();
        assert_eq!(ids.len(), 2, "{mode:?}: committed once, not retried");
        assert_eq!(
            ids[1], event_ids[0],
            "{mode:?}: the ids of what was committed"
        );
    }
}

/// A tally that keeps snapshots every four events, counting how many events it decodes.
pub struct Tally {
    ty: AggregateType,
    schema_version: u32,
    pub decoded: Arc<AtomicU32>,
}

impl Tally {
    pub fn new(schema_version: u32) -> Tally {
        Tally {
            ty: AggregateType::new("Tally").expect("valid"),
            schema_version,
            decoded: Arc::default(),
        }
    }
}

fn tally_state(count: &u64) -> Result<lockstep_core::serde_json::Value> {
    Ok(json!({ "count": count }))
}

#[expect(
    clippy::needless_pass_by_value,
    reason = "a policy's decode owns the state (serde consumes it)"
)]
fn tally_from(state: lockstep_core::serde_json::Value) -> Result<u64> {
    state["count"].as_u64().ok_or_else(|| {
        lockstep_core::Error::new(lockstep_core::ErrorKind::InvalidInput, "not a tally")
    })
}

impl Decider for Tally {
    type State = u64;
    type Command = ();
    type Event = ();
    type Error = std::convert::Infallible;

    fn aggregate_type(&self) -> &AggregateType {
        &self.ty
    }

    fn initial_state(&self, _id: Uuid) -> u64 {
        0
    }

    async fn decide(&self, _: &u64, _: &()) -> std::result::Result<Vec<()>, Self::Error> {
        Ok(vec![()])
    }

    fn evolve(&self, count: u64, _: &()) -> u64 {
        count + 1
    }

    fn encode(&self, _: &()) -> Result<NewEvent> {
        NewEvent::new("Tallied", json!({}))
    }

    fn decode(&self, _: &RecordedEvent) -> Result<()> {
        self.decoded.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn snapshots(&self) -> Option<lockstep_core::SnapshotPolicy<u64>> {
        Some(
            lockstep_core::SnapshotPolicy::new(4, tally_state, tally_from)
                .schema_version(self.schema_version),
        )
    }
}

/// The snapshot of tally `id` under `schema_version`, as committed.
pub async fn tally_snapshot<B: Backend>(
    backend: &B,
    id: Uuid,
    schema_version: u32,
) -> Option<lockstep_core::AggregateSnapshot> {
    let (src, store) = backend.process();
    let key = lockstep_core::SnapshotKey::new(
        AggregateType::new("Tally").expect("valid"),
        StreamId::from_uuid(id),
        schema_version,
    )
    .expect("key");
    let tx = src.begin().await.expect("begin");
    let loaded = store
        .load_from_snapshot(&tx, &key, None)
        .await
        .expect("load");
    let _ = tx.rollback().await;
    loaded.snapshot
}

/// A decider with a snapshot policy: in every mode, from inside `tokio::spawn`, the runner
/// saves the state every four events, in the command's transaction, and a command loads the
/// latest snapshot and decodes only the events after it; every answer is still the exact
/// count.
pub async fn snapshots_are_saved_and_loads_start_from_them<B: Backend>(backend: B) {
    for mode in MODES {
        let (src, store) = backend.process();
        let tally = Tally::new(1);
        let decoded = Arc::clone(&tally.decoded);
        let runner = CommandRunner::with_options(src, store, tally, RunnerOptions::new(mode));
        let id = Uuid::now_v7();
        let answers = tokio::spawn(async move {
            let mut answers = Vec::new();
            for _ in 0..10 {
                let before = decoded.load(Ordering::SeqCst);
                let done = runner.handle(id, ()).await.expect("handled");
                answers.push((
                    *done.state(),
                    done.version(),
                    decoded.load(Ordering::SeqCst) - before,
                ));
            }
            answers
        })
        .await
        .expect("task");
        for (n, (state, version, decodes)) in (1..).zip(answers) {
            assert_eq!((state, version), (n, n), "{mode:?}");
            assert!(
                decodes < 4,
                "{mode:?}: command {n} decoded {decodes} events; the snapshot is at most 3 behind"
            );
        }
        let snapshot = tally_snapshot(&backend, id, 1).await.expect("a snapshot");
        assert_eq!(snapshot.version, 8, "{mode:?}: saved at 4, then at 8");
        assert_eq!(snapshot.state, json!({ "count": 8 }), "{mode:?}");
        assert_eq!(committed(&backend, id).await.len(), 10, "{mode:?}");
    }
}

/// Snapshots of another state schema version are not read, and one the decider cannot decode
/// is not used: the whole stream is folded and the answer stays exact; the next save
/// replaces the bad snapshot.
pub async fn other_and_unreadable_snapshots_are_not_used<B: Backend>(backend: B) {
    for mode in MODES {
        let id = Uuid::now_v7();
        let (src, store) = backend.process();
        let old = CommandRunner::new(src, store, Tally::new(1), mode);
        for _ in 0..5 {
            old.handle(id, ()).await.expect("handled");
        }
        // A wrong state under schema 1 (as if the state's shape had changed): schema 2 must
        // not read it. And a state schema 2 cannot decode.
        let (src, store) = backend.process();
        let stream = StreamId::from_uuid(id);
        let ty = AggregateType::new("Tally").expect("valid");
        let tx = src.begin().await.expect("begin");
        for (schema, state) in [(1, json!({ "count": 1000 })), (2, json!("not a tally"))] {
            let key = lockstep_core::SnapshotKey::new(ty.clone(), stream, schema).expect("key");
            let bad = lockstep_core::AggregateSnapshot { version: 4, state };
            store
                .delete_snapshots(&tx, &ty, None)
                .await
                .expect("delete");
            let _ = store.save_snapshot(&tx, &key, &bad).await.expect("save");
        }
        tx.commit().await.expect("commit");
        let (src, store) = backend.process();
        let new = CommandRunner::new(src, store, Tally::new(2), mode);
        let done = tokio::spawn(async move { new.handle(id, ()).await })
            .await
            .expect("task")
            .expect("handled");
        assert_eq!((*done.state(), done.version()), (6, 6), "{mode:?}");
        let replaced = tally_snapshot(&backend, id, 2).await.expect("saved anew");
        assert_eq!(
            replaced.version, 6,
            "{mode:?}: the whole stream was folded and saved"
        );
        assert_eq!(replaced.state, json!({ "count": 6 }), "{mode:?}");
    }
}

/// The suite as `#[tokio::test]`s, each on a backend of its own.
#[macro_export]
macro_rules! runner_suite {
    ($backend:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn concurrent_handlers_lose_no_update_in_any_mode() {
            suite::concurrent_handlers_lose_no_update($backend).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_refusal_is_not_retried_and_appends_nothing_in_any_mode() {
            suite::a_refusal_is_not_retried_and_appends_nothing($backend).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_conflict_is_retried_in_optimistic_mode() {
            suite::a_conflict_is_retried_in_optimistic_mode($backend).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn handle_in_commits_with_the_callers_other_write_or_not_at_all() {
            suite::handle_in_commits_with_the_callers_other_write_or_not_at_all($backend).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_refusal_in_handle_in_leaves_the_transaction_usable() {
            suite::a_refusal_in_handle_in_leaves_the_transaction_usable($backend).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_lost_commit_reply_is_commit_unknown_and_not_retried_in_any_mode() {
            suite::a_lost_commit_reply_is_commit_unknown_and_not_retried($backend).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn snapshots_are_saved_and_loads_start_from_them_in_any_mode() {
            suite::snapshots_are_saved_and_loads_start_from_them($backend).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn other_and_unreadable_snapshots_are_not_used_in_any_mode() {
            suite::other_and_unreadable_snapshots_are_not_used($backend).await;
        }
    };
}
