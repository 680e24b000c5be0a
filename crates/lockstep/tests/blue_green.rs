//! Versions of a perspective, built beside the serving one and promoted at once: each case once
//! over a `Backend`, on the fakes and on a fresh PostgreSQL database on either driver
//! (tokio-postgres, sqlx), with workers running as an application runs them (`run` in a task of
//! its own).
//!
//! - A version 2 builds while version 1 serves and appends go on; reads during the build and
//!   across the switch never see two versions, nor a half-built one; after the promotion every
//!   state is version 2's fold of every event, and version 1 is retired.
//! - A worker killed during the build leaves nothing wrong behind: another finishes the build.
//! - Two instances promoting at once promote once.
//! - A promotion dropped inside its hook changes nothing and holds no lock.
//! - An abandoned version stops, stays abandoned when a worker runs its code again, and the
//!   serving version cannot be abandoned.
//! - A kept version keeps applying and a requested promotion of it (a rollback) is performed by
//!   a worker.
//! - An automatic version is promoted by the worker once it has caught up.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use lockstep::prelude::*;
use lockstep::testing::{Backend, on_fakes, on_postgres, on_sqlx};
use lockstep::worker::versions::{self, Promoted, VersionError};
use lockstep::{PendingThrough, Registration, Uuid, serde_json::json};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// Per stream: the version that wrote the state, the sum of `n` times that version, and how
/// many events it applied. Two versions of one name, told apart by their states.
struct Tally {
    version: u32,
}

type TallyState = (u32, i64, u64);

impl Perspective for Tally {
    type State = TallyState;
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        "Tally"
    }

    fn version(&self) -> u32 {
        self.version
    }

    fn apply(&self, state: &mut TallyState, event: &RecordedEvent) -> Result<(), Self::Error> {
        state.0 = self.version;
        state.1 += event.payload["n"].as_i64().unwrap_or(0) * i64::from(self.version);
        state.2 += 1;
        Ok(())
    }
}

fn tally() -> PerspectiveName {
    PerspectiveName::new("Tally").expect("valid")
}

/// A registry of the `Tally` versions given, each with its policy.
fn tallies(versions: &[(u32, VersionPolicy)]) -> PerspectiveRegistry {
    let mut registry = PerspectiveRegistry::new();
    for (version, policy) in versions {
        registry
            .register_with(Tally { version: *version }, *policy)
            .expect("register");
    }
    registry
}

fn manual() -> VersionPolicy {
    VersionPolicy::new().manual()
}

type Worker<B> = PerspectiveWorker<<B as Backend>::Source, <B as Backend>::PerspectiveStore>;

/// A worker on the stack, polling every 10 ms.
fn worker<B: Backend>(b: &B, registry: PerspectiveRegistry) -> Arc<Worker<B>> {
    let locker: Arc<dyn StreamLocker> = Arc::new(b.stream_locker());
    let options = WorkerOptions::default().with_poll_interval(Duration::from_millis(10));
    Arc::new(
        PerspectiveWorker::new(
            b.source().clone(),
            b.perspective_store(),
            registry,
            options,
            InstanceId::random(),
            Some(locker),
        )
        .expect("worker"),
    )
}

/// A worker running in a task of its own until the token fires.
struct Running<B: Backend> {
    worker: Arc<Worker<B>>,
    shutdown: CancellationToken,
    task: JoinHandle<lockstep::Result<()>>,
}

impl<B: Backend> Running<B> {
    fn start(b: &B, registry: PerspectiveRegistry) -> Running<B> {
        let worker = worker(b, registry);
        let shutdown = CancellationToken::new();
        let task = {
            let (worker, shutdown) = (Arc::clone(&worker), shutdown.clone());
            tokio::spawn(async move { worker.run(shutdown).await })
        };
        Running {
            worker,
            shutdown,
            task,
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the worker stops within 30 s")
            .expect("worker task")
            .expect("the worker ran");
    }
}

/// Appends one event per `n` to `stream` and returns the last event's id.
async fn append<B: Backend>(b: &B, stream: StreamId, ns: &[i64]) -> Uuid {
    let events: Vec<NewEvent> = ns
        .iter()
        .map(|n| NewEvent::new("Added", json!({ "n": n })).expect("event"))
        .collect();
    let ids: Vec<Uuid> = events.iter().map(NewEvent::event_id).collect();
    let tx = b.source().begin().await.expect("begin");
    b.event_store()
        .append(&tx, stream, ExpectedVersion::Any, &events)
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    ids.into_iter().max().expect("an event")
}

/// Version `version`'s fold of every event of `stream`.
async fn fold<B: Backend>(b: &B, stream: StreamId, version: u32) -> TallyState {
    let tx = b.source().begin().await.expect("begin");
    let events = b.event_store().load(&tx, stream).await.expect("load");
    tx.rollback().await.expect("rollback");
    let mut state = TallyState::default();
    for event in &events {
        Perspective::apply(&Tally { version }, &mut state, event).expect("apply");
    }
    state
}

/// What the stored perspective `stored` (a version's stored name, read directly, not resolved)
/// has not applied of the events up to `up_to`.
async fn pending<B: Backend>(b: &B, stored: &PerspectiveName, up_to: Uuid) -> PendingThrough {
    let tx = b.source().begin().await.expect("begin");
    let pending = b
        .perspective_store()
        .pending_through(&tx, stored, None, up_to)
        .await
        .expect("pending_through");
    tx.rollback().await.expect("rollback");
    pending
}

/// Waits (bounded) until the stored perspective `stored` is registered and has applied every
/// event up to `up_to`.
async fn caught_up<B: Backend>(b: &B, stored: &PerspectiveName, up_to: Uuid) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let pending = pending(b, stored, up_to).await;
        if pending.registration == Some(Registration::Registered) && pending.is_caught_up() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{stored} did not catch up with {up_to} within 60 s on {}",
            B::NAME
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (bounded) until version `version` of `name` serves, as reads resolve it.
async fn until_serving<B: Backend>(b: &B, name: &PerspectiveName, version: u32) {
    let reads = ReadModels::new(b.source().clone(), b.perspective_store());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if reads.serving_version(name).await.expect("serving") == Some(version) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name} version {version} does not serve within 60 s on {}",
            B::NAME
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn statuses<B: Backend>(b: &B, name: &PerspectiveName) -> Vec<(u32, VersionStatus)> {
    let rows = versions::versions(b.source(), &b.perspective_store(), Some(name))
        .await
        .expect("versions");
    rows.iter().map(|v| (v.version, v.status)).collect()
}

/// Every stream's state as reads see it (the serving version's), by stream.
async fn states<B: Backend>(b: &B) -> Vec<(StreamId, TallyState)> {
    let reads = ReadModels::new(b.source().clone(), b.perspective_store());
    reads
        .states(&Tally { version: 1 }, None, 1_000)
        .await
        .expect("states")
}

/// Streams with three events each (n = 1, 2, 3); the newest event id.
async fn streams<B: Backend>(b: &B, count: usize) -> (Vec<StreamId>, Uuid) {
    let mut streams = Vec::new();
    let mut last = Uuid::nil();
    for _ in 0..count {
        let stream = StreamId::new_v7();
        last = last.max(append(b, stream, &[1, 2, 3]).await);
        streams.push(stream);
    }
    (streams, last)
}

/// Version 2 builds beside version 1 while appends go on; reads during the build and across
/// the switch see one version only, never a half-built one; the promotion switches every
/// reader at once; afterwards each state is version 2's fold of every event (those appended
/// during the switch included), and version 1, retired, gets no more work.
async fn a_version_builds_beside_the_serving_one_and_takes_over_at_once<B: Backend>(b: B) {
    let name = tally();
    let (streams, last) = streams(&b, 8).await;
    let v1 = Running::start(&b, tallies(&[(1, manual())]));
    caught_up(&b, &name, last).await;
    v1.stop().await;
    assert!(states(&b).await.iter().all(|(_, s)| *s == (1, 6, 3)));

    // The deploy with version 2 beside version 1.
    let both = Running::start(&b, tallies(&[(1, manual()), (2, manual())]));
    let done = Arc::new(AtomicBool::new(false));
    let promoted = Arc::new(AtomicBool::new(false));
    let appended = Arc::new(AtomicU64::new(0));
    let appender = {
        let (b, done, appended, streams) = (
            b.clone(),
            Arc::clone(&done),
            Arc::clone(&appended),
            streams.clone(),
        );
        tokio::spawn(async move {
            let mut last = Uuid::nil();
            let mut i = 0;
            while !done.load(Ordering::Acquire) {
                last = last.max(append(&b, streams[i % streams.len()], &[10]).await);
                appended.fetch_add(1, Ordering::AcqRel);
                i += 1;
                tokio::task::yield_now().await;
            }
            last
        })
    };
    // Reads: one version per read; after the promotion returned, version 2 only; a read of
    // version 2 holds every stream, each with at least its first three events.
    let reads_after = Arc::new(AtomicU64::new(0));
    let reader = {
        let (b, done, promoted, reads_after) = (
            b.clone(),
            Arc::clone(&done),
            Arc::clone(&promoted),
            Arc::clone(&reads_after),
        );
        let count = streams.len();
        tokio::spawn(async move {
            let (mut reads, mut bad) = (0_u64, Vec::new());
            while !done.load(Ordering::Acquire) {
                let after = promoted.load(Ordering::Acquire);
                let page = states(&b).await;
                let seen: BTreeSet<u32> = page.iter().map(|(_, s)| s.0).collect();
                let half_built =
                    seen.contains(&2) && (page.len() < count || page.iter().any(|(_, s)| s.2 < 3));
                if seen.len() != 1 || (after && !seen.contains(&2)) || half_built {
                    bad.push(format!("after promotion: {after}, read {page:?}"));
                }
                reads += 1;
                if after {
                    reads_after.fetch_add(1, Ordering::AcqRel);
                }
                tokio::task::yield_now().await;
            }
            (reads, bad)
        })
    };

    let v2 = name.versioned(2).expect("versioned");
    caught_up(
        &b,
        &v2,
        versions::event_id_at(lockstep::OffsetDateTime::now_utc()),
    )
    .await;
    let outcome = both
        .worker
        .promote(&name, 2, PromoteOptions::waiting(Duration::from_secs(60)))
        .await
        .expect("promote");
    assert_eq!(outcome, Promoted::Promoted { previous: Some(1) });
    promoted.store(true, Ordering::Release);
    // Appends and reads go on across the switch: a few of each after it.
    let after_switch = appended.load(Ordering::Acquire) + 5;
    while appended.load(Ordering::Acquire) < after_switch || reads_after.load(Ordering::Acquire) < 3
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    done.store(true, Ordering::Release);
    let last = appender.await.expect("appender");
    let (reads, bad) = reader.await.expect("reader");
    assert!(
        bad.is_empty(),
        "mixed or half-built reads on {}: {bad:?}",
        B::NAME
    );
    assert!(
        reads > 3,
        "the reader read during the build and after the switch"
    );

    let reads = ReadModels::new(b.source().clone(), b.perspective_store());
    reads
        .wait_for_perspective(&name, last, Duration::from_secs(60))
        .await
        .expect("version 2 applies what was appended after the switch");
    both.stop().await;
    for (stream, state) in states(&b).await {
        assert_eq!(
            state,
            fold(&b, stream, 2).await,
            "stream {stream} on {}",
            B::NAME
        );
    }
    assert_eq!(states(&b).await.len(), streams.len());
    assert_eq!(
        statuses(&b, &name).await,
        [(1, VersionStatus::Retired), (2, VersionStatus::Serving)]
    );
    assert_eq!(
        pending(&b, &name, last).await.registration,
        Some(Registration::Retired),
        "version 1 is retired with its states kept: appends queue no work for it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_builds_beside_the_serving_one_and_takes_over_at_once_on_the_fakes() {
    on_fakes(a_version_builds_beside_the_serving_one_and_takes_over_at_once).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_builds_beside_the_serving_one_and_takes_over_at_once_on_postgres() {
    on_postgres(a_version_builds_beside_the_serving_one_and_takes_over_at_once).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_builds_beside_the_serving_one_and_takes_over_at_once_on_sqlx() {
    on_sqlx(a_version_builds_beside_the_serving_one_and_takes_over_at_once).await;
}

/// A worker killed while version 2 builds (its task dropped mid-batch, as a killed process
/// leaves it) leaves nothing half applied: another worker finishes the build, and version 2,
/// promoted, is its fold of every event.
async fn a_worker_killed_during_the_build_leaves_nothing_wrong_behind<B: Backend>(b: B) {
    let name = tally();
    let (_, last) = streams(&b, 40).await;
    let v2 = name.versioned(2).expect("versioned");
    let registry = || tallies(&[(1, manual()), (2, manual())]);
    let killed = Running::start(&b, registry());
    // Killed once version 2 has applied some of its work, not all.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let pending = pending(&b, &v2, last).await;
        if pending.registration == Some(Registration::Registered) && pending.events < 120 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{pending:?}");
        tokio::task::yield_now().await;
    }
    killed.task.abort();
    assert!(killed.task.await.is_err(), "killed, not stopped");
    let next = Running::start(&b, registry());
    caught_up(&b, &v2, last).await;
    let promoted = next
        .worker
        .promote(&name, 2, PromoteOptions::waiting(Duration::from_secs(60)))
        .await
        .expect("promote");
    assert_eq!(promoted, Promoted::Promoted { previous: Some(1) });
    next.stop().await;
    let states = states(&b).await;
    assert_eq!(states.len(), 40);
    for (stream, state) in states {
        assert_eq!(
            state,
            fold(&b, stream, 2).await,
            "stream {stream} on {}",
            B::NAME
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_during_the_build_leaves_nothing_wrong_behind_on_the_fakes() {
    on_fakes(a_worker_killed_during_the_build_leaves_nothing_wrong_behind).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_during_the_build_leaves_nothing_wrong_behind_on_postgres() {
    on_postgres(a_worker_killed_during_the_build_leaves_nothing_wrong_behind).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_during_the_build_leaves_nothing_wrong_behind_on_sqlx() {
    on_sqlx(a_worker_killed_during_the_build_leaves_nothing_wrong_behind).await;
}

/// Two instances promoting the same version at once: one promotes, the other finds it serving.
async fn two_instances_promoting_at_once_promote_once<B: Backend>(b: B) {
    let name = tally();
    let (_, last) = streams(&b, 3).await;
    let running = Running::start(&b, tallies(&[(1, manual()), (2, manual())]));
    caught_up(&b, &name.versioned(2).expect("versioned"), last).await;
    let (a, c) = (
        worker(&b, tallies(&[(1, manual()), (2, manual())])),
        worker(&b, tallies(&[(1, manual()), (2, manual())])),
    );
    let wait = PromoteOptions::waiting(Duration::from_secs(60));
    let (x, y) = tokio::join!(
        tokio::spawn({
            let (a, name) = (Arc::clone(&a), name.clone());
            async move { a.promote(&name, 2, wait).await }
        }),
        tokio::spawn({
            let (c, name) = (Arc::clone(&c), name.clone());
            async move { c.promote(&name, 2, wait).await }
        }),
    );
    let mut outcomes = vec![
        x.expect("task").expect("promote"),
        y.expect("task").expect("promote"),
    ];
    outcomes.sort_by_key(|o| matches!(o, Promoted::AlreadyServing));
    assert_eq!(
        outcomes,
        [
            Promoted::Promoted { previous: Some(1) },
            Promoted::AlreadyServing
        ],
        "on {}",
        B::NAME
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_promoting_at_once_promote_once_on_the_fakes() {
    on_fakes(two_instances_promoting_at_once_promote_once).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_promoting_at_once_promote_once_on_postgres() {
    on_postgres(two_instances_promoting_at_once_promote_once).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_promoting_at_once_promote_once_on_sqlx() {
    on_sqlx(two_instances_promoting_at_once_promote_once).await;
}

/// A table perspective that writes nothing, whose promotion hook says it was entered and then
/// waits for `release` (forever when never notified).
struct Board {
    version: u32,
    entered: Arc<Notify>,
    release: Arc<Notify>,
    hooked: Arc<AtomicU64>,
}

impl<Tx: Sync> TablePerspective<Tx> for Board {
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        "Board"
    }

    fn version(&self) -> u32 {
        self.version
    }

    async fn promote(&self, _tx: &Tx) -> Result<(), Self::Error> {
        self.entered.notify_one();
        self.release.notified().await;
        self.hooked.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    async fn apply(&self, _tx: &Tx, _event: &RecordedEvent) -> Result<(), Self::Error> {
        Ok(())
    }

    async fn reset(&self, _tx: &Tx, _stream_id: StreamId) -> Result<(), Self::Error> {
        Ok(())
    }
}

fn boards<B: Backend>(hook: &Board) -> PerspectiveRegistry {
    let mut registry = PerspectiveRegistry::new();
    for version in [1, 2] {
        let board = Board {
            version,
            entered: Arc::clone(&hook.entered),
            release: Arc::clone(&hook.release),
            hooked: Arc::clone(&hook.hooked),
        };
        registry
            .register_table_with::<B::Tx, _>(board, manual())
            .expect("register");
    }
    registry
}

/// A promotion dropped while its table perspective's hook runs (a killed process, a cancelled
/// request) changes nothing: version 1 still serves, version 2 still builds, and the next
/// promotion goes through (no lock is left behind), running the hook once.
async fn a_promotion_dropped_inside_its_hook_changes_nothing<B: Backend>(b: B) {
    let name = PerspectiveName::new("Board").expect("valid");
    let hook = Board {
        version: 0,
        entered: Arc::new(Notify::new()),
        release: Arc::new(Notify::new()),
        hooked: Arc::new(AtomicU64::new(0)),
    };
    let first = worker(&b, boards::<B>(&hook));
    first.register().await.expect("register");
    let promoting = tokio::spawn({
        let (first, name) = (Arc::clone(&first), name.clone());
        async move { first.promote(&name, 2, PromoteOptions::forced()).await }
    });
    tokio::time::timeout(Duration::from_secs(60), hook.entered.notified())
        .await
        .expect("the hook runs");
    promoting.abort();
    assert!(promoting.await.expect_err("aborted").is_cancelled());
    assert_eq!(
        statuses(&b, &name).await,
        [(1, VersionStatus::Serving), (2, VersionStatus::Building)],
        "on {}",
        B::NAME
    );
    assert_eq!(hook.hooked.load(Ordering::Acquire), 0);

    let second = worker(&b, boards::<B>(&hook));
    let promoting = tokio::spawn({
        let (second, name) = (Arc::clone(&second), name.clone());
        async move { second.promote(&name, 2, PromoteOptions::forced()).await }
    });
    tokio::time::timeout(Duration::from_secs(60), hook.entered.notified())
        .await
        .expect("the hook runs again: the first promotion's lock is gone");
    hook.release.notify_one();
    let promoted = tokio::time::timeout(Duration::from_secs(60), promoting)
        .await
        .expect("the promotion ends")
        .expect("task")
        .expect("promote");
    assert_eq!(promoted, Promoted::Promoted { previous: Some(1) });
    assert_eq!(hook.hooked.load(Ordering::Acquire), 1);
    assert_eq!(
        statuses(&b, &name).await,
        [(1, VersionStatus::Retired), (2, VersionStatus::Serving)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_dropped_inside_its_hook_changes_nothing_on_the_fakes() {
    on_fakes(a_promotion_dropped_inside_its_hook_changes_nothing).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_dropped_inside_its_hook_changes_nothing_on_postgres() {
    on_postgres(a_promotion_dropped_inside_its_hook_changes_nothing).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_dropped_inside_its_hook_changes_nothing_on_sqlx() {
    on_sqlx(a_promotion_dropped_inside_its_hook_changes_nothing).await;
}

/// An abandoned version stops (its work and states are gone, reads are untouched) and stays
/// abandoned when a worker running its code starts again; the serving version cannot be
/// abandoned, an unknown one is named, and an abandoned one cannot be promoted.
async fn an_abandoned_version_stops_and_stays_abandoned<B: Backend>(b: B) {
    let name = tally();
    let (streams, last) = streams(&b, 4).await;
    let running = Running::start(&b, tallies(&[(1, manual()), (2, manual())]));
    caught_up(&b, &name, last).await;
    running.stop().await;
    let (source, store) = (b.source(), b.perspective_store());
    let abandoned = versions::abandon(source, &store, &name, 2, RetireStates::Drop)
        .await
        .expect("abandon");
    assert_eq!(abandoned, VersionStatus::Abandoned);
    let v2 = name.versioned(2).expect("versioned");
    assert_eq!(
        pending(&b, &v2, last).await.registration,
        Some(Registration::NotRegistered),
        "its work and states are dropped"
    );
    assert!(states(&b).await.iter().all(|(_, s)| *s == (1, 6, 3)));

    // A worker running version 2's code again does not bring it back.
    let again = Running::start(&b, tallies(&[(1, manual()), (2, manual())]));
    let last = append(&b, streams[0], &[5]).await;
    caught_up(&b, &name, last).await;
    again.stop().await;
    assert_eq!(
        statuses(&b, &name).await,
        [(1, VersionStatus::Serving), (2, VersionStatus::Abandoned)],
        "on {}",
        B::NAME
    );
    assert_eq!(
        pending(&b, &v2, last).await.registration,
        Some(Registration::NotRegistered)
    );

    let serving = versions::abandon(source, &store, &name, 1, RetireStates::Keep).await;
    assert!(
        matches!(serving, Err(VersionError::Serving { version: 1, .. })),
        "{serving:?}"
    );
    let unknown = versions::abandon(source, &store, &name, 9, RetireStates::Keep).await;
    assert!(
        matches!(unknown, Err(VersionError::NoSuchVersion { version: 9, .. })),
        "{unknown:?}"
    );
    let w = worker(&b, tallies(&[(1, manual()), (2, manual())]));
    let refused = w.promote(&name, 2, PromoteOptions::forced()).await;
    assert!(
        matches!(
            refused,
            Err(VersionError::NotPromotable {
                status: VersionStatus::Abandoned,
                ..
            })
        ),
        "{refused:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_version_stops_and_stays_abandoned_on_the_fakes() {
    on_fakes(an_abandoned_version_stops_and_stays_abandoned).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_version_stops_and_stays_abandoned_on_postgres() {
    on_postgres(an_abandoned_version_stops_and_stays_abandoned).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_version_stops_and_stays_abandoned_on_sqlx() {
    on_sqlx(an_abandoned_version_stops_and_stays_abandoned).await;
}

/// Version 2 promoted with version 1 kept: version 1 keeps applying new events; an operator's
/// request to promote it again (a rollback) is performed by a running worker, and reads are
/// version 1's, current with every event.
async fn a_kept_version_rolls_back_when_its_promotion_is_requested<B: Backend>(b: B) {
    let name = tally();
    let (streams, last) = streams(&b, 4).await;
    let keep = manual().previous(PreviousVersion::Keep);
    let running = Running::start(&b, tallies(&[(1, manual()), (2, keep)]));
    caught_up(&b, &name.versioned(2).expect("versioned"), last).await;
    let promoted = running
        .worker
        .promote(&name, 2, PromoteOptions::waiting(Duration::from_secs(60)))
        .await
        .expect("promote");
    assert_eq!(promoted, Promoted::Promoted { previous: Some(1) });
    assert_eq!(
        statuses(&b, &name).await,
        [(1, VersionStatus::Kept), (2, VersionStatus::Serving)]
    );
    let last = append(&b, streams[1], &[100]).await;
    caught_up(&b, &name, last).await;

    versions::request_promotion(b.source(), &b.perspective_store(), &name, 1, false)
        .await
        .expect("request");
    until_serving(&b, &name, 1).await;
    running.stop().await;
    for (stream, state) in states(&b).await {
        assert_eq!(
            state,
            fold(&b, stream, 1).await,
            "stream {stream} on {}",
            B::NAME
        );
    }
    assert_eq!(
        statuses(&b, &name).await,
        [(1, VersionStatus::Serving), (2, VersionStatus::Retired)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_version_rolls_back_when_its_promotion_is_requested_on_the_fakes() {
    on_fakes(a_kept_version_rolls_back_when_its_promotion_is_requested).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_version_rolls_back_when_its_promotion_is_requested_on_postgres() {
    on_postgres(a_kept_version_rolls_back_when_its_promotion_is_requested).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_version_rolls_back_when_its_promotion_is_requested_on_sqlx() {
    on_sqlx(a_kept_version_rolls_back_when_its_promotion_is_requested).await;
}

/// A version registered with automatic promotion is promoted by the worker once it has caught
/// up, and reads are its fold of every event.
async fn an_automatic_version_is_promoted_once_caught_up<B: Backend>(b: B) {
    let name = tally();
    let (_, last) = streams(&b, 6).await;
    let v1 = Running::start(&b, tallies(&[(1, manual())]));
    caught_up(&b, &name, last).await;
    v1.stop().await;
    let running = Running::start(&b, tallies(&[(1, manual()), (2, VersionPolicy::new())]));
    until_serving(&b, &name, 2).await;
    running.stop().await;
    let mut by_stream = HashMap::new();
    for (stream, state) in states(&b).await {
        by_stream.insert(stream, state);
        assert_eq!(
            state,
            fold(&b, stream, 2).await,
            "stream {stream} on {}",
            B::NAME
        );
    }
    assert_eq!(by_stream.len(), 6);
    assert_eq!(
        statuses(&b, &name).await,
        [(1, VersionStatus::Retired), (2, VersionStatus::Serving)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_automatic_version_is_promoted_once_caught_up_on_the_fakes() {
    on_fakes(an_automatic_version_is_promoted_once_caught_up).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_automatic_version_is_promoted_once_caught_up_on_postgres() {
    on_postgres(an_automatic_version_is_promoted_once_caught_up).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_automatic_version_is_promoted_once_caught_up_on_sqlx() {
    on_sqlx(an_automatic_version_is_promoted_once_caught_up).await;
}
