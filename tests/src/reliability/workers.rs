//! Worker processes killed at random (issue 8's suite, faults part): `kill -9` of perspective
//! worker processes during a run with late events.
//!
//! Three worker processes ([`crate::worker_process`], each its own pool and instance id, 1 s
//! lock timeout, 250 ms keepalive, 1 ms per applied event so rewinds take a while, about half
//! of them with a 150 ms rewind debounce) build the
//! [`crate::Numbers`] perspective while two appenders write events to a set of streams, one in
//! twenty with a caller-chosen id that sorts before what the stream already holds (a late
//! arrival: a rewind under a `rewind` lease). Meanwhile, every 1–2 s, one process is `kill -9`ed
//! — preferably one that has just announced a `rewind` lease, so the kill lands mid-rewind — or,
//! one time in five, stopped with SIGTERM (it must drain and exit within 20 s), and a fresh
//! process with a new instance id takes its place.
//!
//! When the appends stop and the queue has drained (bounded), every process is stopped and each
//! stream's stored state is compared with the fold of its events in event-id order:
//!
//! - an event of the stream missing from the state is **lost** (one per event);
//! - an event applied more often than it exists is **duplicated** (one per extra application);
//! - the right events in the wrong order, a queue that does not drain, a process that does not
//!   stop on SIGTERM, an append that fails for good, or a state that cannot be read are
//!   **violations**.
//!
//! Every compared stream and every kill or stop is a case. The processes are started by a
//! [`WorkerCommand`]: `cargo test` gives the `lockstep-test-worker` binary, the long run its own
//! binary's hidden `test-worker` subcommand.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use lockstep_core::{ErrorKind, ExpectedVersion, NewEvent, StreamId};
use lockstep_pg::PgTransaction;
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::pg_harness::test_database;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use uuid::Uuid;

use super::failover::FailoverStats;
use super::replication::{ReplicatedPair, Replication};
use super::{Scale, Tally};
use crate::{
    APPLY_SLEEP_ENV, NUMBERS, database_url, early_id, expected_folds, number_event,
    perspective_states, queue_is_empty,
};
use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;

/// How a worker process is started: a program and the arguments before the worker's own.
#[derive(Debug, Clone)]
pub struct WorkerCommand {
    program: PathBuf,
    args: Vec<OsString>,
}

impl WorkerCommand {
    /// `program [args…] --database-url … --instance …` starts a worker process.
    pub fn new(program: impl Into<PathBuf>, args: impl IntoIterator<Item = OsString>) -> Self {
        WorkerCommand {
            program: program.into(),
            args: args.into_iter().collect(),
        }
    }
}

/// The sizes of a run.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Worker processes alive at any time.
    workers: usize,
    streams: usize,
    /// How long events are appended (and processes killed).
    appending: Duration,
    /// Bounds of the random pause between two kills.
    kill_every: (Duration, Duration),
    /// How long the workers get to drain the queue once the appends stop.
    drain: Duration,
}

impl Plan {
    fn new(scale: Scale) -> Plan {
        match scale {
            Scale::Short => Plan {
                workers: 3,
                streams: 12,
                appending: Duration::from_secs(8),
                kill_every: (Duration::from_millis(800), Duration::from_millis(1600)),
                drain: Duration::from_secs(60),
            },
            Scale::Long => Plan {
                workers: 3,
                streams: 40,
                appending: Duration::from_secs(150),
                kill_every: (Duration::from_millis(1000), Duration::from_millis(2000)),
                drain: Duration::from_secs(180),
            },
        }
    }
}

/// Lease lock timeout and keepalive of the worker processes (milliseconds).
const LOCK_TIMEOUT_MS: u64 = 1000;
const KEEPALIVE_MS: u64 = 250;
/// The `rewind_debounce` of the processes that debounce (about half of them).
const REWIND_DEBOUNCE_MS: u64 = 150;
/// Milliseconds each process sleeps per applied event: a rewind of a few hundred events lasts
/// long enough to be killed in the middle.
const APPLY_SLEEP_MS: u64 = 1;
/// One event in this many sorts early (a late arrival).
const EARLY_EVERY: i64 = 20;
/// How long a process gets to announce `ready`, and to exit after SIGTERM (its shutdown grace
/// is 10 s).
const PROCESS_WAIT: Duration = Duration::from_secs(20);
/// How long an appender retries one batch through retryable failures (a failover included).
const RETRY_FOR: Duration = Duration::from_secs(60);
/// The pause of an appender between two batches (about 450 events per second in all: the
/// workers, sleeping per event, keep up and rewinds stay short enough to finish between kills).
const APPEND_PAUSE: Duration = Duration::from_millis(10);
/// A process that announced a `rewind` lease this recently is the preferred victim.
const MID_REWIND: Duration = Duration::from_millis(500);

/// The figures of a run, printed by the long run.
#[derive(Debug, Default, Clone)]
pub struct WorkerStats {
    /// Events appended (and acknowledged).
    pub events: u64,
    /// Of which sorted early.
    pub late: u64,
    /// Processes `kill -9`ed.
    pub kills: u64,
    /// Of which killed within 500 ms of announcing a `rewind` lease (mid-rewind).
    pub kills_mid_rewind: u64,
    /// Processes stopped with SIGTERM (each drained and exited).
    pub stops: u64,
    /// `rewind` leases announced by all processes.
    pub rewind_leases: u64,
    /// Streams compared.
    pub streams: u64,
    /// Seconds from the last append to an empty queue.
    pub drain_seconds: f64,
}

impl std::fmt::Display for WorkerStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "events={} late={} kills={} kills_mid_rewind={} sigterm_stops={} \
             rewind_leases={} streams={} drain_s={:.1}",
            self.events,
            self.late,
            self.kills,
            self.kills_mid_rewind,
            self.stops,
            self.rewind_leases,
            self.streams,
            self.drain_seconds
        )
    }
}

/// A run's tally and figures.
#[derive(Debug, Default)]
pub struct WorkersReport {
    /// Cases and failures.
    pub tally: Tally,
    /// What happened.
    pub stats: WorkerStats,
}

/// One running worker process.
struct Process {
    child: Child,
    instance: Uuid,
    /// When it last announced a `rewind` lease (updated by its stdout reader).
    last_rewind: Arc<Mutex<Option<Instant>>>,
}

/// Runs the scenario with processes started by `command`.
pub async fn run(scale: Scale, command: &WorkerCommand) -> anyhow::Result<WorkersReport> {
    let plan = Plan::new(scale);
    let db = test_database().await;
    let admin = db.connect().await;
    // Exactly-once across crashes is under test, not durability.
    db.skip_wal_flush().await?;
    lockstep_pg::migrate(&db.pool(1)).await?;

    let mut report = WorkersReport::default();
    let rewinds = Arc::new(AtomicU64::new(0));
    let url = database_url(db.config());
    let mut processes = Vec::new();
    for _ in 0..plan.workers {
        processes.push(start(command, &url, false, &rewinds).await?);
    }

    // Appenders, until `appending` is over.
    let numbers = Arc::new(AtomicI64::new(0));
    let late = Arc::new(AtomicU64::new(0));
    let streams: Arc<Vec<StreamId>> = Arc::new(
        (0..plan.streams)
            .map(|_| StreamId::new_v7())
            .collect::<Vec<_>>(),
    );
    let until = Instant::now() + plan.appending;
    // A `JoinSet`: an early return (a process that does not start) aborts the appenders.
    let acknowledged = Arc::new(Mutex::new(Vec::new()));
    let mut appenders = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let (pool, streams) = (db.pool(1), Arc::clone(&streams));
        let (numbers, late) = (Arc::clone(&numbers), Arc::clone(&late));
        let acknowledged = Arc::clone(&acknowledged);
        appenders.spawn(async move {
            append_until(until, &pool, &streams, &numbers, &late, &acknowledged).await
        });
    }

    // The chaos: kill or stop one process at a time, and replace it. (`StdRng`: the thread-local
    // generator cannot be held across an await in a `Send` future.)
    let mut rng = rand::rngs::StdRng::from_os_rng();
    while Instant::now() < until {
        let pause = rng.random_range(plan.kill_every.0..=plan.kill_every.1);
        tokio::time::sleep(pause).await;
        let victim = pick_victim(&processes, &mut rng);
        let mut process = processes.swap_remove(victim);
        if rng.random_range(0..5) == 0 {
            report.tally.cases += 1;
            match stop(&mut process).await {
                Ok(()) => report.stats.stops += 1,
                Err(e) => report
                    .tally
                    .violation(format!("worker {}: {e:#}", process.instance)),
            }
        } else {
            let mid_rewind = process
                .last_rewind
                .lock()
                .map(|t| t.is_some_and(|t| t.elapsed() < MID_REWIND))
                .unwrap_or(false);
            report.tally.cases += 1;
            match kill_9(&mut process).await {
                Ok(()) => {
                    report.stats.kills += 1;
                    report.stats.kills_mid_rewind += u64::from(mid_rewind);
                }
                Err(e) => report
                    .tally
                    .violation(format!("worker {}: {e:#}", process.instance)),
            }
        }
        processes.push(start(command, &url, false, &rewinds).await?);
    }
    // Leases of killed processes expire after the lock timeout and are taken over.
    finish(appenders, &admin, plan.drain, processes, &mut report).await?;
    report.stats.late = late.load(Ordering::Relaxed);
    report.stats.rewind_leases = rewinds.load(Ordering::Relaxed);

    compare(&admin, &mut report).await?;
    if report.stats.events > 0 && report.stats.kills == 0 {
        report
            .tally
            .violation("no process was killed: the scenario tested nothing");
    }
    drop(db);
    Ok(report)
}

/// The worker fleet through primary failovers: the same processes, appenders and late events
/// as [`run`], on a [`ReplicatedPair`] reached through its multi-host URL, every process also
/// running the [`crate::NumberRows`] table perspective. Instead of killing processes, the
/// primary fails over (once in the short run, [`FAILOVERS_LONG`] times in the long one) while
/// they catch up and rewind with leases held; each time, the time until a worker applies an
/// event on the new primary is measured, and every pair's lease epoch read on the old primary
/// just before must not be lower on the new one (with asynchronous replication it may be: that
/// is counted, [`FailoverStats::epochs_back`]). At the end, every process must still be running
/// and stop cleanly, and both the JSON states and the application's table must equal the fold
/// of the events on the final primary. Acknowledged appends missing from it are lost (with
/// asynchronous replication, counted as [`FailoverStats::lost_acknowledged`] instead).
pub async fn run_through_failovers(
    scale: Scale,
    replication: Replication,
    command: &WorkerCommand,
) -> anyhow::Result<(WorkersReport, FailoverStats)> {
    const DB: &str = "lockstep_failover_workers";
    let plan = Plan::new(scale);
    let failovers = match scale {
        Scale::Short => 1,
        Scale::Long => FAILOVERS_LONG,
    };
    let mut pair = ReplicatedPair::start(replication).await?;
    pair.create_database(DB).await?;
    let url = pair.url(DB);
    let config: tokio_postgres::Config = url.parse().context("the pair's URL")?;
    let pool = |size| {
        let manager = deadpool_postgres::Manager::from_config(
            config.clone(),
            tokio_postgres::NoTls,
            deadpool_postgres::ManagerConfig {
                recycling_method: deadpool_postgres::RecyclingMethod::Fast,
            },
        );
        lockstep_pg::pool::bounded_pool(manager, size)
    };
    lockstep_pg::migrate(&pool(1)?).await?;
    pair.connect_primary(DB)
        .await?
        .batch_execute(crate::NUMBER_ROWS_TABLE)
        .await?;

    let mut report = WorkersReport::default();
    let mut stats = FailoverStats {
        replication: replication.name(),
        ..FailoverStats::default()
    };
    let rewinds = Arc::new(AtomicU64::new(0));
    let mut processes = Vec::new();
    for _ in 0..plan.workers {
        processes.push(start(command, &url, true, &rewinds).await?);
    }
    let numbers = Arc::new(AtomicI64::new(0));
    let late = Arc::new(AtomicU64::new(0));
    let streams: Arc<Vec<StreamId>> = Arc::new(
        (0..plan.streams)
            .map(|_| StreamId::new_v7())
            .collect::<Vec<_>>(),
    );
    let until = Instant::now() + plan.appending;
    let acknowledged = Arc::new(Mutex::new(Vec::new()));
    let mut appenders = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let (pool, streams) = (pool(1)?, Arc::clone(&streams));
        let (numbers, late) = (Arc::clone(&numbers), Arc::clone(&late));
        let acknowledged = Arc::clone(&acknowledged);
        appenders.spawn(async move {
            append_until(until, &pool, &streams, &numbers, &late, &acknowledged).await
        });
    }

    // The failovers, spread over the appending time.
    let mut epochs_before: HashMap<(Uuid, String), i64> = HashMap::new();
    let gap = plan.appending / (u32::try_from(failovers).unwrap_or(1) + 1);
    for _ in 0..failovers {
        tokio::time::sleep(gap).await;
        let old = pair.connect_primary(DB).await?;
        for (pair_key, epoch) in lease_epochs(&old).await? {
            epochs_before.insert(pair_key, epoch);
        }
        report.tally.cases += 1;
        let failover = pair.fail_over().await?;
        let promoted = Instant::now();
        stats.failovers += 1;
        stats.note(failover);
        let new = pair.connect_primary(DB).await?;
        let at_promotion = applied_count(&new).await?;
        let resumed = tokio::time::timeout(RESUME_LIMIT, async {
            loop {
                if applied_count(&new).await.is_ok_and(|n| n > at_promotion) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        match resumed {
            Ok(()) => stats.resume_ms = stats.resume_ms.max(millis(promoted.elapsed())),
            Err(_) => report.tally.violation(format!(
                "no worker applied an event within {RESUME_LIMIT:?} of the promotion"
            )),
        }
        pair.rebuild_standby().await?;
    }
    report.tally.failovers = stats.failovers;
    let admin = pair.connect_primary(DB).await?;
    // Every process lived through the failovers: it must stop cleanly.
    finish(appenders, &admin, plan.drain, processes, &mut report).await?;
    report.stats.late = late.load(Ordering::Relaxed);
    report.stats.rewind_leases = rewinds.load(Ordering::Relaxed);

    // Epochs continue on the new primary.
    for (pair_key, epoch) in lease_epochs(&admin).await? {
        if let Some(before) = epochs_before.get(&pair_key) {
            report.tally.cases += 1;
            if epoch < *before {
                match replication {
                    Replication::Asynchronous => stats.epochs_back += 1,
                    Replication::Synchronous => report.tally.violation(format!(
                        "pair {pair_key:?}: lease epoch {before} on the old primary, {epoch} on \
                         the new one"
                    )),
                }
            }
        }
    }

    // Acknowledged appends on the final primary; with asynchronous replication the missing
    // ones are what the failover lost, and the folds are compared with what is there.
    let stored: std::collections::HashSet<Uuid> = admin
        .query("SELECT event_id FROM wh_events", &[])
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<_, _>>()?;
    let acknowledged: Vec<Uuid> = acknowledged
        .lock()
        .map(|ids| ids.clone())
        .unwrap_or_default();
    let missing = acknowledged
        .iter()
        .filter(|id| !stored.contains(id))
        .count() as u64;
    stats.acknowledged = acknowledged.len() as u64;
    match replication {
        Replication::Asynchronous => {
            stats.lost_acknowledged = missing;
            report.stats.events -= missing;
        }
        Replication::Synchronous => {
            for id in acknowledged.iter().filter(|id| !stored.contains(id)) {
                report.tally.lost(format!(
                    "event {id}: acknowledged, missing on the new primary"
                ));
            }
            report.stats.events -= missing;
        }
    }
    compare(&admin, &mut report).await?;
    compare_rows(&admin, &mut report).await?;
    Ok((report, stats))
}

/// The end of a run: the appenders' counts (one that gave up is a violation), the queue drained
/// within `drain` (bounded), and every process stopped with SIGTERM (it must exit cleanly).
async fn finish(
    mut appenders: tokio::task::JoinSet<(u64, Option<anyhow::Error>)>,
    admin: &tokio_postgres::Client,
    drain: Duration,
    processes: Vec<Process>,
    report: &mut WorkersReport,
) -> anyhow::Result<()> {
    while let Some(appender) = appenders.join_next().await {
        let (appended, failure) = appender?;
        report.stats.events += appended;
        if let Some(e) = failure {
            report
                .tally
                .violation(format!("an appender gave up: {e:#}"));
        }
    }
    let drain_started = Instant::now();
    let drained = tokio::time::timeout(drain, async {
        loop {
            match queue_is_empty(admin).await {
                Ok(true) => return Ok(()),
                Ok(false) => tokio::time::sleep(Duration::from_millis(100)).await,
                Err(e) => return Err(e),
            }
        }
    })
    .await;
    report.stats.drain_seconds = drain_started.elapsed().as_secs_f64();
    match drained {
        Ok(Ok(())) => {}
        Ok(Err(e)) => report.tally.violation(format!("reading the queue: {e:#}")),
        Err(_) => report.tally.violation(format!(
            "the queue did not drain within {drain:?} of the last append"
        )),
    }
    for mut process in processes {
        report.tally.cases += 1;
        if let Err(e) = stop(&mut process).await {
            report
                .tally
                .violation(format!("worker {}: {e:#}", process.instance));
        }
    }
    Ok(())
}

/// How many failovers the long run of [`run_through_failovers`] goes through.
pub const FAILOVERS_LONG: u64 = 4;
/// How long the workers may take to apply an event on a promoted primary before it counts as a
/// violation.
const RESUME_LIMIT: Duration = Duration::from_secs(60);

/// Every cursor's lease epoch, by (stream, perspective).
async fn lease_epochs(
    client: &tokio_postgres::Client,
) -> anyhow::Result<Vec<((Uuid, String), i64)>> {
    let rows = client
        .query(
            "SELECT stream_id, perspective_name, stream_lock_epoch FROM wh_perspective_cursors",
            &[],
        )
        .await?;
    rows.iter()
        .map(|row| Ok(((row.try_get(0)?, row.try_get(1)?), row.try_get(2)?)))
        .collect()
}

/// How many events the JSON states hold in all.
async fn applied_count(client: &tokio_postgres::Client) -> anyhow::Result<i64> {
    let row = client
        .query_one(
            "SELECT coalesce(sum(jsonb_array_length(state)), 0)::bigint \
             FROM wh_perspective_states WHERE perspective_name = $1",
            &[&NUMBERS],
        )
        .await?;
    Ok(row.try_get(0)?)
}

/// Compares the application's table ([`crate::NumberRows`]) with the fold of the events.
async fn compare_rows(
    client: &tokio_postgres::Client,
    report: &mut WorkersReport,
) -> anyhow::Result<()> {
    let expected = expected_folds(client).await?;
    let rows = match crate::number_rows(client).await {
        Ok(rows) => rows,
        Err(e) => {
            report
                .tally
                .violation(format!("reading number_rows: {e:#}"));
            BTreeMap::new()
        }
    };
    for (stream, fold) in &expected {
        report.tally.cases += 1;
        let table = rows.get(stream).map(Vec::as_slice).unwrap_or_default();
        let (lost, duplicated) = differences(fold, table);
        for n in &lost {
            report.tally.lost(format!(
                "stream {stream}: event n={n} has no row in the table"
            ));
        }
        for n in &duplicated {
            report
                .tally
                .duplicated(format!("stream {stream}: event n={n} has two rows"));
        }
    }
    Ok(())
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Starts a worker process and waits (bounded) for its `ready` line; a reader task keeps
/// draining its standard output (a full pipe would block the process) and notes every `rewind`
/// lease it announces.
async fn start(
    command: &WorkerCommand,
    url: &str,
    table_rows: bool,
    rewinds: &Arc<AtomicU64>,
) -> anyhow::Result<Process> {
    let instance = Uuid::now_v7();
    // About half the processes debounce rewinds (the id's last, random bit decides), so that
    // debounced and immediate rewinds of one pair meet (issue 19: a debounce wedged its pair).
    let debounce_ms = if instance.as_u128() & 1 == 1 {
        REWIND_DEBOUNCE_MS
    } else {
        0
    };
    let mut child = Command::new(&command.program)
        .args(&command.args)
        .args(["--database-url", url])
        .args(["--instance", &instance.to_string()])
        .args(["--lock-timeout-ms", &LOCK_TIMEOUT_MS.to_string()])
        .args(["--keepalive-ms", &KEEPALIVE_MS.to_string()])
        .args(["--poll-ms", "20"])
        .args(["--rewind-debounce-ms", &debounce_ms.to_string()])
        .args(table_rows.then_some("--table-rows"))
        .env(APPLY_SLEEP_ENV, APPLY_SLEEP_MS.to_string())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", command.program.display()))?;
    let stdout = child.stdout.take().context("piped stdout")?;
    let last_rewind = Arc::new(Mutex::new(None));
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    {
        let (last_rewind, rewinds) = (Arc::clone(&last_rewind), Arc::clone(rewinds));
        tokio::spawn(async move {
            let mut ready_tx = Some(ready_tx);
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.starts_with("ready ") {
                    if let Some(tx) = ready_tx.take() {
                        let _ = tx.send(());
                    }
                } else if line.starts_with("lease rewind ") {
                    rewinds.fetch_add(1, Ordering::Relaxed);
                    if let Ok(mut at) = last_rewind.lock() {
                        *at = Some(Instant::now());
                    }
                }
            }
        });
    }
    match tokio::time::timeout(PROCESS_WAIT, ready_rx).await {
        Ok(Ok(())) => Ok(Process {
            child,
            instance,
            last_rewind,
        }),
        _ => {
            let _ = child.start_kill();
            anyhow::bail!("worker {instance} did not say ready within {PROCESS_WAIT:?}")
        }
    }
}

/// The process to kill: one that announced a `rewind` lease within [`MID_REWIND`] if any,
/// else any.
fn pick_victim(processes: &[Process], rng: &mut impl Rng) -> usize {
    let mid_rewind: Vec<usize> = processes
        .iter()
        .enumerate()
        .filter(|(_, p)| {
            p.last_rewind
                .lock()
                .map(|t| t.is_some_and(|t| t.elapsed() < MID_REWIND))
                .unwrap_or(false)
        })
        .map(|(i, _)| i)
        .collect();
    if mid_rewind.is_empty() {
        rng.random_range(0..processes.len())
    } else {
        mid_rewind[rng.random_range(0..mid_rewind.len())]
    }
}

/// `kill -9`: no release, no graceful anything. A process that already exited (a crash of its
/// own: the worker returned an error or panicked) is an error saying how it ended.
async fn kill_9(process: &mut Process) -> anyhow::Result<()> {
    if let Some(status) = process.child.try_wait().context("checking the process")? {
        anyhow::bail!("had exited on its own ({status}) before it was killed");
    }
    process.child.start_kill().context("SIGKILL")?;
    tokio::time::timeout(PROCESS_WAIT, process.child.wait())
        .await
        .context("a killed process was not reaped")??;
    Ok(())
}

/// SIGTERM, then the process must exit successfully within [`PROCESS_WAIT`] (it drains and
/// releases its leases); if it does not, it is killed and the error says so.
async fn stop(process: &mut Process) -> anyhow::Result<()> {
    let Some(pid) = process.child.id() else {
        anyhow::bail!("the process had already exited");
    };
    let pid = i32::try_from(pid).context("pid")?;
    // The standard `kill` program: no `unsafe` and no libc dependency for one signal.
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await
        .context("running kill -TERM")?;
    anyhow::ensure!(status.success(), "kill -TERM {pid} failed: {status}");
    match tokio::time::timeout(PROCESS_WAIT, process.child.wait()).await {
        Ok(Ok(status)) if status.success() => Ok(()),
        Ok(Ok(status)) => anyhow::bail!("exited with {status} after SIGTERM"),
        Ok(Err(e)) => Err(e).context("waiting for the process"),
        Err(_) => {
            let _ = kill_9(process).await;
            anyhow::bail!("did not exit within {PROCESS_WAIT:?} of SIGTERM")
        }
    }
}

/// Appends batches of 1–5 events to random streams until `until`; returns how many were
/// acknowledged and, if it gave up, why. A retryable failure is retried with the same events
/// (the same ids: an append that did commit is not written twice); any other failure ends the
/// appender.
async fn append_until(
    until: Instant,
    pool: &deadpool_postgres::Pool,
    streams: &[StreamId],
    numbers: &AtomicI64,
    late: &AtomicU64,
    acknowledged: &Mutex<Vec<Uuid>>,
) -> (u64, Option<anyhow::Error>) {
    let mut appended = 0;
    match append_batches(
        until,
        pool,
        streams,
        numbers,
        late,
        acknowledged,
        &mut appended,
    )
    .await
    {
        Ok(()) => (appended, None),
        Err(e) => (appended, Some(e)),
    }
}

async fn append_batches(
    until: Instant,
    pool: &deadpool_postgres::Pool,
    streams: &[StreamId],
    numbers: &AtomicI64,
    late: &AtomicU64,
    acknowledged: &Mutex<Vec<Uuid>>,
    appended: &mut u64,
) -> anyhow::Result<()> {
    let store = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    while Instant::now() < until {
        let (stream, batch) = {
            let mut rng = rand::rng();
            let stream = streams[rng.random_range(0..streams.len())];
            let mut batch: Vec<NewEvent> = Vec::new();
            for _ in 0..rng.random_range(1..=5) {
                let n = numbers.fetch_add(1, Ordering::Relaxed);
                let mut event = number_event(n);
                if n % EARLY_EVERY == 0 {
                    let ago = Duration::from_millis(rng.random_range(1..60_000));
                    event = event.with_id(early_id(ago))?;
                    late.fetch_add(1, Ordering::Relaxed);
                }
                batch.push(event);
            }
            (stream, batch)
        };
        // A retryable failure (two `Any` appends picking one version, a lost connection) or a
        // lost COMMIT reply: the same events again, for a while. Stored ids at their place make
        // the second append a replay, accepted without writing anything twice.
        let deadline = Instant::now() + RETRY_FOR;
        loop {
            let outcome = async {
                let tx = PgTransaction::begin(pool).await?;
                match store
                    .append(&tx, stream, ExpectedVersion::Any, &batch)
                    .await
                {
                    Ok(_) => tx.commit().await,
                    Err(e) => {
                        let _ = tx.rollback().await;
                        Err(e)
                    }
                }
            }
            .await;
            match outcome {
                Ok(()) => break,
                Err(e)
                    if (e.is_retryable() || e.kind() == ErrorKind::CommitUnknown)
                        && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(e).context("appending"),
            }
        }
        if let Ok(mut acknowledged) = acknowledged.lock() {
            acknowledged.extend(batch.iter().map(NewEvent::event_id));
        }
        *appended += batch.len() as u64;
        tokio::time::sleep(APPEND_PAUSE).await;
    }
    Ok(())
}

/// Compares every stream's stored state with the fold of its events.
async fn compare(
    client: &tokio_postgres::Client,
    report: &mut WorkersReport,
) -> anyhow::Result<()> {
    let expected = expected_folds(client).await?;
    let stored = match perspective_states(client, NUMBERS).await {
        Ok(stored) => stored,
        Err(e) => {
            report.tally.violation(format!("reading the states: {e:#}"));
            BTreeMap::new()
        }
    };
    let appended: usize = expected.values().map(Vec::len).sum();
    if appended as u64 != report.stats.events {
        report.tally.violation(format!(
            "{} events acknowledged, {appended} stored",
            report.stats.events
        ));
    }
    for (stream, fold) in &expected {
        report.tally.cases += 1;
        report.stats.streams += 1;
        let state = stored.get(stream).map(Vec::as_slice).unwrap_or_default();
        let (lost, duplicated) = differences(fold, state);
        for n in &lost {
            report.tally.lost(format!(
                "stream {stream}: event n={n} is missing from the state"
            ));
        }
        for n in &duplicated {
            report
                .tally
                .duplicated(format!("stream {stream}: event n={n} was applied twice"));
        }
        if lost.is_empty() && duplicated.is_empty() && state != fold.as_slice() {
            report.tally.violation(format!(
                "stream {stream}: the state holds the right events in the wrong order"
            ));
        }
    }
    for stream in stored.keys().filter(|s| !expected.contains_key(s)) {
        report
            .tally
            .violation(format!("stream {stream}: a state without events"));
    }
    Ok(())
}

/// Runs the final comparison on deliberately wrong states (no worker): four streams of three
/// events each whose stored states are right, miss an event, hold one twice, and hold the
/// right events in the wrong order. Returns the tally, which must show exactly one lost, one
/// duplicated and one violation.
pub async fn demonstrate_checks() -> anyhow::Result<Tally> {
    let db = test_database().await;
    let pool = db.pool(2);
    lockstep_pg::migrate(&pool).await?;
    let client = db.connect().await;
    let store = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let mut report = WorkersReport::default();
    type Wrong = fn(&[i64]) -> Vec<i64>;
    let wrong_states: [Wrong; 4] = [
        |fold| fold.to_vec(),
        |fold| fold[..2].to_vec(),
        |fold| [fold, &fold[2..]].concat(),
        |fold| fold.iter().rev().copied().collect(),
    ];
    for (i, wrong) in wrong_states.iter().enumerate() {
        let stream = StreamId::new_v7();
        let fold: Vec<i64> = (0..3).map(|k| (i * 10 + k) as i64).collect();
        let events: Vec<NewEvent> = fold.iter().map(|n| number_event(*n)).collect();
        let tx = PgTransaction::begin(&pool).await?;
        store
            .append(&tx, stream, ExpectedVersion::Any, &events)
            .await?;
        tx.commit().await?;
        report.stats.events += 3;
        client
            .execute(
                "INSERT INTO wh_perspective_states (stream_id, perspective_name, state) \
                 VALUES ($1, $2, $3)",
                &[
                    &stream.as_uuid(),
                    &NUMBERS,
                    &serde_json::to_value(wrong(&fold))?,
                ],
            )
            .await?;
    }
    compare(&client, &mut report).await?;
    drop(db);
    Ok(report.tally)
}

/// The numbers of `fold` missing from `state`, and those `state` holds more often than `fold`
/// (each once per missing or extra occurrence).
fn differences(fold: &[i64], state: &[i64]) -> (Vec<i64>, Vec<i64>) {
    let mut count: HashMap<i64, i64> = HashMap::new();
    for n in fold {
        *count.entry(*n).or_default() += 1;
    }
    for n in state {
        *count.entry(*n).or_default() -= 1;
    }
    let (mut lost, mut duplicated) = (Vec::new(), Vec::new());
    for (n, c) in count {
        for _ in 0..c.max(0) {
            lost.push(n);
        }
        for _ in 0..(-c).max(0) {
            duplicated.push(n);
        }
    }
    lost.sort_unstable();
    duplicated.sort_unstable();
    (lost, duplicated)
}

#[cfg(test)]
mod tests {
    use super::differences;

    #[test]
    fn differences_count_each_missing_and_each_extra_application() {
        assert_eq!(differences(&[1, 2, 3], &[3, 1, 2]), (vec![], vec![]));
        assert_eq!(differences(&[1, 2, 3], &[1, 3]), (vec![2], vec![]));
        assert_eq!(differences(&[1, 2], &[1, 2, 2, 2]), (vec![], vec![2, 2]));
        assert_eq!(differences(&[1, 2], &[]), (vec![1, 2], vec![]));
        assert_eq!(differences(&[5], &[6]), (vec![5], vec![6]));
    }
}
