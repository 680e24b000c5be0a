//! Multi-process: a worker process is `kill -9`ed while it holds a `rewind` lease mid-rewind;
//! another process takes the lease over once it expires, completes the rewind, and the final
//! state is exactly the fold of the stream's events in event-id order.

use std::process::Stdio;
use std::time::Duration;

use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;
use lockstep_core::{ExpectedVersion, InstanceId, PerspectiveRegistry, StreamId};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_testkit::pg_harness::{TestDatabase, test_database};
use lockstep_tests::{
    APPLY_SLEEP_ENV, NUMBERS, Numbers, database_url, early_id, expected_folds, number_event,
    perspective_states, queue_is_empty,
};
use lockstep_worker::{PerspectiveWorker, WorkerOptions};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use uuid::Uuid;

/// Events on the stream before the late one.
const EVENTS: i64 = 300;
/// Per-event sleep of the first process's `apply`: its full replay takes ~6 s, far longer than
/// the 2 s lock timeout.
const SLOW_APPLY_MS: u64 = 20;

/// A started `lockstep-test-worker` and its standard output, line by line.
struct WorkerProcess {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    instance: Uuid,
}

impl WorkerProcess {
    fn start(db: &TestDatabase, slow_apply_ms: u64) -> WorkerProcess {
        let instance = Uuid::now_v7();
        let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep-test-worker"))
            .args(["--database-url", &database_url(db.config())])
            .args(["--instance", &instance.to_string()])
            .args(["--lock-timeout-ms", "2000", "--keepalive-ms", "500"])
            .env(APPLY_SLEEP_ENV, slow_apply_ms.to_string())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start lockstep-test-worker");
        let stdout = child.stdout.take().expect("piped stdout");
        WorkerProcess {
            child,
            lines: BufReader::new(stdout).lines(),
            instance,
        }
    }

    /// Waits for the process to print that it holds a `rewind` lease; returns the epoch.
    async fn rewind_lease(&mut self) -> i64 {
        let wait = async {
            loop {
                let line = self
                    .lines
                    .next_line()
                    .await
                    .expect("read stdout")
                    .expect("the worker exited before holding a rewind lease");
                if let Some(rest) = line.strip_prefix("lease rewind ") {
                    let epoch = rest
                        .split_whitespace()
                        .find_map(|kv| kv.strip_prefix("epoch="))
                        .expect("epoch field");
                    return epoch.parse::<i64>().expect("epoch is a number");
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(60), wait)
            .await
            .expect("a rewind lease within 60 s")
    }

    /// `kill -9`: no release, no graceful anything.
    async fn kill_9(mut self) {
        self.child.start_kill().expect("SIGKILL");
        self.child.wait().await.expect("reaped");
    }
}

/// The cursor's lease holder, epoch and whether a rewind is still requested.
async fn cursor_row(
    client: &tokio_postgres::Client,
    stream: StreamId,
) -> (Option<Uuid>, i64, bool) {
    let row = client
        .query_one(
            "SELECT stream_lock_instance_id, stream_lock_epoch, rewind_trigger_event_id IS NOT NULL
               FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2",
            &[&stream.as_uuid(), &NUMBERS],
        )
        .await
        .expect("cursor row");
    (row.get(0), row.get(1), row.get(2))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rewind_is_taken_over_after_the_lock_timeout_and_completed_exactly() {
    let db = test_database().await;
    let pool = db.pool(3);
    lockstep_pg::migrate(&pool).await.expect("migrate");
    let client = db.connect().await;
    let (source, store, events) = (
        PgDatabase::from_pool(pool.clone()),
        PgPerspectiveStore::new(),
        PgEventStore::with_queue(lockstep_pg::LockQueue::new()),
    );

    // A stream of EVENTS events, applied by an in-process worker (snapshots included).
    let mut registry = PerspectiveRegistry::new();
    registry.register(Numbers::new()).expect("register");
    let local = PerspectiveWorker::new(
        source,
        store,
        registry,
        WorkerOptions::default(),
        InstanceId::random(),
        None,
    )
    .expect("worker");
    local.register().await.expect("register");
    let stream = StreamId::new_v7();
    for chunk in (0..EVENTS).collect::<Vec<_>>().chunks(100) {
        let new: Vec<_> = chunk.iter().map(|n| number_event(*n)).collect();
        let tx = PgTransaction::begin(&pool).await.expect("begin");
        events
            .append(&tx, stream, ExpectedVersion::Any, &new)
            .await
            .expect("append");
        tx.commit().await.expect("commit");
    }
    while !queue_is_empty(&client).await.expect("queue") {
        local.run_once().await;
    }
    drop(local);

    // A late event: its id sorts before every event of the stream, so the rewind replays all
    // of them.
    let late = number_event(EVENTS)
        .with_id(early_id(Duration::from_secs(3600)))
        .expect("id");
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    events
        .append(&tx, stream, ExpectedVersion::Any, &[late])
        .await
        .expect("append late");
    tx.commit().await.expect("commit");

    // Process A starts the (slow) rewind and is killed while holding its lease.
    let mut a = WorkerProcess::start(&db, SLOW_APPLY_MS);
    let a_epoch = a.rewind_lease().await;
    let a_instance = a.instance;
    tokio::time::sleep(Duration::from_millis(300)).await; // well into the replay
    a.kill_9().await;

    let (holder, epoch, requested) = cursor_row(&client, stream).await;
    assert_eq!(
        holder,
        Some(a_instance),
        "the dead process still holds the lease"
    );
    assert_eq!(epoch, a_epoch);
    assert!(
        requested,
        "nothing was committed: the rewind is still requested"
    );
    let before = perspective_states(&client, NUMBERS).await.expect("states");
    assert_eq!(
        before.get(&stream.as_uuid()).map(Vec::len),
        Some(EVENTS as usize),
        "the state is still the one before the late event"
    );

    // Process B takes the lease over once it expires and completes the rewind.
    let mut b = WorkerProcess::start(&db, 0);
    let b_epoch = b.rewind_lease().await;
    assert!(
        b_epoch > a_epoch,
        "a takeover: the epoch increased ({a_epoch} -> {b_epoch})"
    );
    // The fleet (ADR 0015): both processes announced themselves; the killed one is stale by
    // the time its lease could be taken over (its last keepalive marked both), the other live.
    let live = |instance: Uuid| {
        let client = &client;
        async move {
            client
                .query_one(
                    "SELECT last_seen_at + stale_after > clock_timestamp() \
                     FROM wh_worker_instances WHERE instance_id = $1",
                    &[&instance],
                )
                .await
                .expect("the instance is listed")
                .get::<_, bool>(0)
        }
    };
    assert!(!live(a_instance).await, "the killed process is stale");
    assert!(live(b.instance).await, "the running process is live");
    tokio::time::timeout(Duration::from_secs(60), async {
        while !queue_is_empty(&client).await.expect("queue") {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("B completes the rewind");
    b.kill_9().await;

    let expected = expected_folds(&client).await.expect("events");
    let stored = perspective_states(&client, NUMBERS).await.expect("states");
    let fold = expected.get(&stream.as_uuid()).expect("the stream's fold");
    assert_eq!(fold.first(), Some(&EVENTS), "the late event sorts first");
    assert_eq!(
        stored.get(&stream.as_uuid()),
        Some(fold),
        "the final state is exactly the fold in event-id order"
    );
    let (holder, epoch, requested) = cursor_row(&client, stream).await;
    assert!(!requested, "the rewind request is cleared");
    assert!(
        epoch >= b_epoch && epoch > a_epoch,
        "the epoch never went back"
    );
    assert_ne!(holder, Some(a_instance), "the dead process holds nothing");
}
