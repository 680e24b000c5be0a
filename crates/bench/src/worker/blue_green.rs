//! `blue-green`: version 2 of a **table perspective** built beside version 1 while appends go on
//! and version 1 serves, then promoted (issue 43's measured case), on one database.
//!
//! The perspective, `BgTally`: one row per stream, `(stream_id, events, total, version)`,
//! version 1 in `bg_tally_v1` (`total` = Σ n), version 2 in `bg_tally_v2` (`total` = Σ 2n);
//! each writes its version number in `version`. The application reads the view `bg_tally`, which
//! starts on `bg_tally_v1`; version 2's `promote` hook repoints it (`CREATE OR REPLACE VIEW
//! bg_tally AS … FROM bg_tally_v2`) in the promoting transaction. `apply` is one upsert per
//! event (`query_typed`: one round trip), `reset` one `DELETE`.
//!
//! In order:
//!
//! 1. **Load**: `--blue-green-events` (1 000 000) numbered events, spread evenly over
//!    `--blue-green-streams` (10 000), appended as the catch-up section does (500 per append,
//!    no perspective registered).
//! 2. **Version 1 up to date**: a worker instance running version 1 only (instance A) registers
//!    it (one work row per event), then one set-based statement does what its catch-up would:
//!    deletes the work rows, writes the rows of `bg_tally_v1` and advances the cursors (its build
//!    is not what is measured).
//! 3. **Reference catch-up**: a fresh perspective `BgTallyRef` of the same code as version 2
//!    (writing `bg_tally_ref`), one worker instance, nothing else running (no appends, instance A
//!    not started yet). Timed from the instance's start (its `run` registers the perspective —
//!    the work rows of every event — and serves) until the rows of `bg_tally_ref` hold every
//!    event (`sum(events)`, polled every 100 ms). The perspective is then retired with its
//!    states dropped, so that appends no longer fan out to it, and the queue is vacuumed.
//! 4. **Idle lag**: instance A runs (`PerspectiveWorker::run`), and `--blue-green-appenders` (4)
//!    tasks append `--blue-green-rate` (200) single-event appends per second in all, paced by
//!    time (append k is due at start + k / rate; a task that is late sends at once, so that a
//!    stall is made up for rather than dropped), each task to streams of its own (so it knows each
//!    stream's event count). For `--blue-green-idle-secs` (20 s), **version 1's lag** is
//!    recorded: the time from an append's commit (its `COMMIT` returned) until version 1's row
//!    of that stream holds that many events. What sees it: one poller on a connection of its
//!    own, reading `SELECT stream_id, events FROM bg_tally_v1 WHERE stream_id = ANY($1)` for the
//!    streams with an append not seen yet, every 5 ms while there is one (by primary key: a few
//!    rows per read, about 200 reads/s, idle when nothing is pending). The lag is taken at the
//!    start of the read that saw it, so the poll period overstates it by up to 5 ms, on both
//!    sides of the ratio alike.
//! 5. **Build**: the appends go on; a second worker instance (B) starts with versions 1 and 2
//!    (`--blue-green-builder v1-and-v2`, the default: the new code deployed beside the old;
//!    `v2-only` runs version 2 alone), version 2 registered with the manual policy so that the
//!    benchmark promotes. Its `run` declares and registers version 2 (the work rows of every
//!    event: appends wait for that transaction) and builds it while instance A keeps serving
//!    version 1. The build's time runs from B's start until `bg_tally_v2` holds every event
//!    committed before the poll that sees it (polled every 100 ms, as the reference).
//!    `bluegreen_build_vs_catchup` = that time ÷ the reference's; the build also applied the
//!    events appended meanwhile (printed). Version 1's lag is recorded for the appends committed
//!    during the build; `bluegreen_v1_lag_vs_idle` = its p99 ÷ the idle phase's p99. With
//!    `--blue-green-analyze`, the benchmark runs `ANALYZE` on the work queue and the cursors as
//!    soon as it sees version 2 registered (not something the library does): instance A's
//!    sessions planned their claims while the queue was short, and keep those plans while
//!    version 2's backlog fills the same table; the option shows what that costs.
//! 6. **Promotion**: `PerspectiveWorker::promote(BgTally, 2, PromoteOptions::waiting(60 s))` on
//!    instance B (checked: every event appended before the call applied), version 1 retired
//!    (the default policy). The appends go on `--blue-green-after-secs` (5 s) more, then stop;
//!    the benchmark waits until `bg_tally_v2` holds every event and stops both instances.
//! 7. **Check**: every stream's row of `bg_tally_v2` against the fold of its events in
//!    `wh_events`. `bluegreen_lost_or_doubled` = Σ over streams |events of the stream − `events`
//!    of its row| (a stream without a row counts all its events) plus the streams without a row;
//!    rows whose `total` is not Σ 2n or whose `version` is not 2 are printed apart.
//!
//! **Reads** during the build and across the switch: one reader on a connection of its own runs
//! `SELECT version, count(*), sum(events) FROM bg_tally GROUP BY version` every 20 ms from B's
//! start, back to back from just before the promotion call until 2 s after it returns, until the
//! appends have stopped. A read is **mixed** when it returns more than one version. It is
//! **half-built** when it returns fewer rows than streams, or version 2 with fewer events than
//! were committed before the promotion call started (`E0`: every event appended before the call
//! is applied by version 2 before it may serve — the promotion's own check — so a read that
//! sees version 2 must see at least `E0`; a read of version 2 before the call is half-built by
//! that rule too, `E0` being unknown then). `bluegreen_mixed_reads` = mixed + half-built. Not
//! counted, printed: reads of version 2 with fewer events than the last read of version 1
//! showed. Version 1 may have applied events appended after the call started that version 2 had
//! not yet applied when it was promoted, so a reader can see the count step back across the
//! switch; the promotion guarantees `E0`, not version 1's last state.
//!
//! Last, not part of the lines: the cost of one `pending_through` (what a promotion's wait, a
//! promotion check and `ReadModels::wait_for_perspective` run) on a backlog of every event,
//! for a perspective registered for that alone and retired after.

use lockstep_core::perspective_store::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use lockstep_core::{
    EventStore as _, ExpectedVersion, InstanceId, PerspectiveName, PerspectiveRegistry,
    RecordedEvent, RetireStates, StreamId, StreamLockOptions, StreamLocker, TablePerspective,
    Transaction as _, VersionPolicy,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_worker::{CancellationToken, PerspectiveWorker, PromoteOptions, Promoted};
use tokio::sync::mpsc;
use tokio_postgres::Client;
use tokio_postgres::types::Type;
use uuid::Uuid;

use super::{Args, append_with, create, fmt_all, number_event, open_pool, options, vacuum};
use crate::bench_db::BenchDatabase;

/// Which versions the building instance runs.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Builder {
    /// Versions 1 and 2: the new code deployed beside the old (its batches serve version 1
    /// too).
    V1AndV2,
    /// Version 2 only.
    V2Only,
}

/// The perspective's name (the view's and version 1's stored name).
const NAME: &str = "BgTally";
/// How often a build's or catch-up's end is polled.
const DONE_POLL: Duration = Duration::from_millis(100);
/// How often the lag poller reads while an append is not seen yet.
const LAG_POLL: Duration = Duration::from_millis(5);
/// The reader's pause between two reads, outside the promotion's window.
const READ_PAUSE: Duration = Duration::from_millis(20);
/// How long a wait for rows goes on without progress before the benchmark gives up.
const STALLED_AFTER: Duration = Duration::from_secs(60);

const SCHEMA: &str = "
CREATE TABLE bg_tally_v1 (
    stream_id uuid PRIMARY KEY,
    events bigint NOT NULL,
    total bigint NOT NULL,
    version int NOT NULL
);
CREATE TABLE bg_tally_v2 (LIKE bg_tally_v1 INCLUDING ALL);
CREATE TABLE bg_tally_ref (LIKE bg_tally_v1 INCLUDING ALL);
CREATE VIEW bg_tally AS SELECT stream_id, events, total, version FROM bg_tally_v1;
";

/// Version 1 up to date in one statement, as its catch-up would leave it: work rows deleted,
/// rows written, cursors advanced (a table perspective's state row holds JSON `null`).
const V1_UP_TO_DATE: &str = "\
WITH done AS (
    DELETE FROM wh_perspective_events WHERE perspective_name = $1
    RETURNING stream_id, event_id
), folded AS (
    SELECT d.stream_id, count(*) AS applied, sum((e.payload->>'n')::bigint) AS total,
           (array_agg(e.event_id ORDER BY e.event_id DESC))[1] AS last_event_id
      FROM done d JOIN wh_events e ON e.stream_id = d.stream_id AND e.event_id = d.event_id
     GROUP BY d.stream_id
), tally AS (
    INSERT INTO bg_tally_v1 (stream_id, events, total, version)
    SELECT stream_id, applied, total, 1 FROM folded
), saved AS (
    INSERT INTO wh_perspective_states (stream_id, perspective_name, state)
    SELECT stream_id, $1, 'null'::jsonb FROM folded
    ON CONFLICT (stream_id, perspective_name) DO UPDATE SET state = EXCLUDED.state
)
UPDATE wh_perspective_cursors c
   SET last_event_id = f.last_event_id, applied_count = c.applied_count + f.applied,
       revision = c.revision + 1, processed_at = clock_timestamp()
  FROM folded f
 WHERE c.stream_id = f.stream_id AND c.perspective_name = $1";

/// `BgTally` version 1 or 2, or the reference catch-up's perspective (version 2's code under
/// another name and table).
struct Tally {
    name: &'static str,
    version: u32,
    factor: i64,
    upsert: String,
    delete: String,
    view: String,
}

impl Tally {
    fn new(name: &'static str, version: u32, table: &str, factor: i64) -> Tally {
        Tally {
            name,
            version,
            factor,
            upsert: format!(
                "INSERT INTO {table} (stream_id, events, total, version) VALUES ($1, 1, $2, $3) \
                 ON CONFLICT (stream_id) DO UPDATE \
                 SET events = {table}.events + 1, total = {table}.total + EXCLUDED.total, \
                     version = EXCLUDED.version"
            ),
            delete: format!("DELETE FROM {table} WHERE stream_id = $1"),
            view: format!(
                "CREATE OR REPLACE VIEW bg_tally AS \
                 SELECT stream_id, events, total, version FROM {table}"
            ),
        }
    }

    fn v1() -> Tally {
        Tally::new(NAME, 1, "bg_tally_v1", 1)
    }

    fn v2() -> Tally {
        Tally::new(NAME, 2, "bg_tally_v2", 2)
    }

    fn reference() -> Tally {
        Tally::new("BgTallyRef", 1, "bg_tally_ref", 2)
    }
}

impl TablePerspective<PgTransaction> for Tally {
    type Error = tokio_postgres::Error;

    fn name(&self) -> &str {
        self.name
    }

    fn version(&self) -> u32 {
        self.version
    }

    async fn promote(&self, tx: &PgTransaction) -> Result<(), Self::Error> {
        tx.client().batch_execute(&self.view).await
    }

    async fn apply(&self, tx: &PgTransaction, event: &RecordedEvent) -> Result<(), Self::Error> {
        let n = event.payload["n"].as_i64().unwrap_or(0) * self.factor;
        let version = i32::try_from(self.version).unwrap_or(i32::MAX);
        tx.client()
            .query_typed(
                &self.upsert,
                &[
                    (&event.stream_id.as_uuid(), Type::UUID),
                    (&n, Type::INT8),
                    (&version, Type::INT4),
                ],
            )
            .await?;
        Ok(())
    }

    async fn reset(&self, tx: &PgTransaction, stream_id: StreamId) -> Result<(), Self::Error> {
        tx.client()
            .query_typed(&self.delete, &[(&stream_id.as_uuid(), Type::UUID)])
            .await?;
        Ok(())
    }
}

type PgWorker = PerspectiveWorker<PgDatabase, PgPerspectiveStore>;

/// A worker instance of its own (pool with its connections open, locker, `InstanceId`) for
/// `tallies`, with the benchmark's worker options at concurrency 1.
async fn tally_worker(
    db: &BenchDatabase,
    args: &Args,
    tallies: Vec<(Tally, VersionPolicy)>,
) -> Result<PgWorker> {
    let opts = options(args, 1);
    let pool = open_pool(db, opts.concurrency + 2).await?;
    let mut registry = PerspectiveRegistry::new();
    for (tally, policy) in tallies {
        registry.register_table_with::<PgTransaction, _>(tally, policy)?;
    }
    let lock = StreamLockOptions::new(Duration::from_secs(30), Duration::from_secs(10))?;
    let locker: Arc<dyn StreamLocker> = Arc::new(PgStreamLocker::from_pool(pool.clone(), lock));
    Ok(PerspectiveWorker::new(
        PgDatabase::from_pool(pool),
        PgPerspectiveStore::new(),
        registry,
        opts,
        InstanceId::random(),
        Some(locker),
    )?)
}

/// A worker instance running (`PerspectiveWorker::run`) in a task of its own.
struct Running {
    worker: Arc<PgWorker>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<lockstep_core::Result<()>>,
}

impl Running {
    fn start(worker: PgWorker) -> Running {
        let worker = Arc::new(worker);
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

    async fn stop(self) -> Result<()> {
        self.shutdown.cancel();
        self.task.await?.context("a worker instance's run")?;
        Ok(())
    }
}

/// `sum(events)` of a tally table (or view).
async fn events_in(client: &Client, table: &str) -> Result<i64> {
    Ok(client
        .query_one(
            &format!("SELECT coalesce(sum(events), 0)::bigint FROM {table}"),
            &[],
        )
        .await?
        .get(0))
}

/// When a perspective was first seen registered and when its table first held `target()`
/// events (`target` read before each poll), from `started`; polled every [`DONE_POLL`]. Gives
/// up when the table's events stop growing for [`STALLED_AFTER`].
async fn wait_built(
    client: &Client,
    table: &str,
    stored_name: &str,
    started: Instant,
    target: &(dyn Fn() -> i64 + Sync),
    analyze: bool,
) -> Result<(Duration, Duration, i64)> {
    let mut registered = None;
    let mut last = (-1_i64, Instant::now());
    loop {
        let want = target();
        if registered.is_none() {
            let seen: bool = client
                .query_one(
                    "SELECT EXISTS (SELECT FROM wh_perspectives WHERE perspective_name = $1)",
                    &[&stored_name],
                )
                .await?
                .get(0);
            if seen {
                registered = Some(started.elapsed());
                if analyze {
                    client
                        .batch_execute("ANALYZE wh_perspective_events, wh_perspective_cursors")
                        .await?;
                }
            }
        }
        let have = events_in(client, table).await?;
        if have >= want {
            let at = started.elapsed();
            return Ok((registered.unwrap_or(at), at, have));
        }
        if have != last.0 {
            last = (have, Instant::now());
        } else if last.1.elapsed() > STALLED_AFTER {
            bail!("{table} stuck at {have} of {want} events for {STALLED_AFTER:?}");
        }
        tokio::time::sleep(DONE_POLL).await;
    }
}

/// The lag phases: appends are tagged with the phase current at their commit.
const PHASE_NONE: u8 = 0;
const PHASE_IDLE: u8 = 1;
const PHASE_BUILD: u8 = 2;

/// The append load shared by the appender tasks.
#[derive(Default)]
struct Load {
    /// Appends committed.
    committed: AtomicU64,
    /// The next append's slot (append k is due at start + k / rate).
    next_slot: AtomicU64,
    stop: AtomicBool,
    phase: AtomicU8,
    /// The slowest append (begin to commit) and the latest commit after its due time, µs, per
    /// phase (none, idle, build).
    slowest_us: [AtomicU64; 3],
    latest_us: [AtomicU64; 3],
}

/// An append whose commit version 1 has not shown yet.
struct Unseen {
    stream: Uuid,
    events: i64,
    committed: Instant,
    phase: u8,
}

/// Appends of one task: one event per append to its own streams, paced by time.
async fn appender(
    pool: deadpool_postgres::Pool,
    load: Arc<Load>,
    streams: Vec<(StreamId, i64)>,
    started: Instant,
    period: Duration,
    unseen: mpsc::UnboundedSender<Unseen>,
) -> Result<()> {
    let events = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let mut streams = streams;
    let mut j: u64 = 0;
    while !load.stop.load(Ordering::Acquire) {
        let k = load.next_slot.fetch_add(1, Ordering::AcqRel);
        let due = started + period * u32::try_from(k).unwrap_or(u32::MAX);
        tokio::time::sleep_until(due.into()).await;
        if load.stop.load(Ordering::Acquire) {
            break;
        }
        // Spread over the task's streams (a multiplicative hash of the task's count).
        let i = usize::try_from(j.wrapping_mul(2_654_435_761) % streams.len() as u64).unwrap_or(0);
        j += 1;
        let (stream, count) = &mut streams[i];
        let begun = Instant::now();
        let tx = PgTransaction::begin(&pool).await?;
        events
            .append(
                &tx,
                *stream,
                ExpectedVersion::Any,
                &[number_event(i64::try_from(k).unwrap_or(0))?],
            )
            .await?;
        tx.commit().await?;
        let committed = Instant::now();
        *count += 1;
        load.committed.fetch_add(1, Ordering::AcqRel);
        let phase = load.phase.load(Ordering::Acquire);
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        load.slowest_us[usize::from(phase)].fetch_max(us(committed - begun), Ordering::AcqRel);
        load.latest_us[usize::from(phase)].fetch_max(
            us(committed.saturating_duration_since(due)),
            Ordering::AcqRel,
        );
        if phase != PHASE_NONE {
            // The poller may have ended (after the build): nothing to see then.
            let _ = unseen.send(Unseen {
                stream: stream.as_uuid(),
                events: *count,
                committed,
                phase,
            });
        }
    }
    Ok(())
}

/// Version 1's lag per phase (µs histograms), and the appends never seen.
struct Lags {
    idle: hdrhistogram::Histogram<u64>,
    build: hdrhistogram::Histogram<u64>,
    unseen: usize,
    reads: u64,
}

/// A histogram of lags in µs, 1 µs to 1 h (a stalled serving version lags by minutes).
fn lag_histogram() -> Result<hdrhistogram::Histogram<u64>> {
    Ok(hdrhistogram::Histogram::new_with_bounds(
        1,
        3_600_000_000,
        3,
    )?)
}

/// Reads version 1's rows of the streams with an unseen append, every [`LAG_POLL`] while
/// there is one, until `stop` and then at most 2 s more.
async fn lag_poller(
    client: Client,
    mut rx: mpsc::UnboundedReceiver<Unseen>,
    stop: Arc<AtomicBool>,
) -> Result<Lags> {
    let mut lags = Lags {
        idle: lag_histogram()?,
        build: lag_histogram()?,
        unseen: 0,
        reads: 0,
    };
    let mut pending: Vec<Unseen> = Vec::new();
    let mut stopped_at: Option<Instant> = None;
    loop {
        while let Ok(u) = rx.try_recv() {
            pending.push(u);
        }
        if stopped_at.is_none() && stop.load(Ordering::Acquire) {
            stopped_at = Some(Instant::now());
        }
        if let Some(at) = stopped_at
            && (pending.is_empty() || at.elapsed() > Duration::from_secs(2))
        {
            lags.unseen = pending.len();
            return Ok(lags);
        }
        if pending.is_empty() {
            if let Ok(Some(u)) = tokio::time::timeout(Duration::from_millis(50), rx.recv()).await {
                pending.push(u);
            }
            continue;
        }
        let mut ids: Vec<Uuid> = pending.iter().map(|u| u.stream).collect();
        ids.sort_unstable();
        ids.dedup();
        let read_at = Instant::now();
        let rows = client
            .query(
                "SELECT stream_id, events FROM bg_tally_v1 WHERE stream_id = ANY($1)",
                &[&ids],
            )
            .await?;
        lags.reads += 1;
        let shown: HashMap<Uuid, i64> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        pending.retain(|u| {
            if shown.get(&u.stream).is_some_and(|&n| n >= u.events) {
                let lag = read_at.saturating_duration_since(u.committed);
                let us = u64::try_from(lag.as_micros()).unwrap_or(u64::MAX).max(1);
                let h = if u.phase == PHASE_IDLE {
                    &mut lags.idle
                } else {
                    &mut lags.build
                };
                h.saturating_record(us);
                false
            } else {
                true
            }
        });
        tokio::time::sleep(LAG_POLL).await;
    }
}

/// What the reader saw.
#[derive(Debug, Default)]
struct Reads {
    total: u64,
    v1: u64,
    v2: u64,
    mixed: u64,
    half_built: u64,
    /// Reads of version 2 with fewer events than the last read of version 1 showed, and the
    /// largest such shortfall.
    stepped_back: u64,
    max_step_back: i64,
    /// The last read of version 1 and the first of version 2, from the reader's start.
    last_v1_at: Option<Duration>,
    first_v2_at: Option<Duration>,
}

/// The reader: the application's read of the view, every [`READ_PAUSE`] (back to back while
/// `tight`), until `stop`. `floor` is `E0` once the promotion call starts (-1 before).
async fn reader(
    client: Client,
    streams: i64,
    floor: Arc<AtomicI64>,
    tight: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    started: Instant,
) -> Result<Reads> {
    let mut reads = Reads::default();
    let mut last_v1_events = 0_i64;
    while !stop.load(Ordering::Acquire) {
        let rows = client
            .query(
                "SELECT version, count(*), coalesce(sum(events), 0)::bigint \
                   FROM bg_tally GROUP BY version",
                &[],
            )
            .await?;
        let at = started.elapsed();
        reads.total += 1;
        if rows.len() > 1 {
            reads.mixed += 1;
        } else if let Some(row) = rows.first() {
            let (version, count, events): (i32, i64, i64) = (row.get(0), row.get(1), row.get(2));
            let mut half = count < streams;
            if version == 2 {
                reads.v2 += 1;
                reads.first_v2_at.get_or_insert(at);
                let e0 = floor.load(Ordering::Acquire);
                half |= e0 < 0 || events < e0;
                if events < last_v1_events {
                    reads.stepped_back += 1;
                    reads.max_step_back = reads.max_step_back.max(last_v1_events - events);
                }
            } else {
                reads.v1 += 1;
                reads.last_v1_at = Some(at);
                last_v1_events = events;
            }
            if half {
                reads.half_built += 1;
            }
        } else {
            reads.half_built += 1; // no row at all
        }
        if !tight.load(Ordering::Acquire) {
            tokio::time::sleep(READ_PAUSE).await;
        }
    }
    Ok(reads)
}

/// The section's lines and headline figures.
pub(super) struct BlueGreen {
    pub(super) lines: Vec<String>,
    pub(super) mixed_reads: u64,
    pub(super) lost_or_doubled: i64,
    pub(super) build_vs_catchup: f64,
    pub(super) lag_vs_idle: f64,
}

/// Runs the section on a database of its own.
pub(super) async fn run(url: &str, args: &Args) -> Result<BlueGreen> {
    if args.blue_green_streams == 0
        || args.blue_green_events == 0
        || !args
            .blue_green_events
            .is_multiple_of(args.blue_green_streams)
        || args.blue_green_rate == 0
        || args.blue_green_appenders == 0
        || args.blue_green_appenders > args.blue_green_streams
        || args.blue_green_idle_secs == 0
    {
        bail!(
            "--blue-green-events must be a positive multiple of --blue-green-streams; the rate, \
             appenders (at most one per stream) and idle seconds positive"
        );
    }
    let db = create(url, args).await?;
    let outcome = measure(&db, args).await;
    db.drop_database().await?;
    outcome
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn quantile_ms(h: &hdrhistogram::Histogram<u64>, q: f64) -> f64 {
    if h.is_empty() {
        f64::NAN
    } else {
        h.value_at_quantile(q) as f64 / 1000.0
    }
}

#[expect(
    clippy::too_many_lines,
    reason = "one measurement in its order; the steps share the load, the reader and the poller"
)]
async fn measure(db: &BenchDatabase, args: &Args) -> Result<BlueGreen> {
    let section_started = Instant::now();
    let n_streams = args.blue_green_streams;
    let per_stream = args.blue_green_events / n_streams;
    let loaded = i64::try_from(args.blue_green_events)?;
    let name = PerspectiveName::new(NAME)?;
    db.client().await?.batch_execute(SCHEMA).await?;

    // 1. Load.
    let streams: Vec<StreamId> = (0..n_streams).map(|_| StreamId::new_v7()).collect();
    eprintln!(
        "blue-green: appending {} events over {n_streams} streams",
        args.blue_green_events
    );
    let load_started = Instant::now();
    append_with(
        db,
        &streams,
        per_stream,
        &|_, _, n| number_event(n),
        Some(n_streams.div_ceil(10)),
    )
    .await?;
    let load_s = load_started.elapsed().as_secs_f64();

    // 2. Version 1 up to date (instance A registers it; one statement applies it).
    let up_started = Instant::now();
    let a = tally_worker(db, args, vec![(Tally::v1(), VersionPolicy::new())]).await?;
    a.register().await?;
    let client = db.client().await?;
    client.execute(V1_UP_TO_DATE, &[&NAME]).await?;
    let (rows, events): (i64, i64) = {
        let r = client
            .query_one(
                "SELECT count(*), coalesce(sum(events), 0)::bigint FROM bg_tally_v1",
                &[],
            )
            .await?;
        (r.get(0), r.get(1))
    };
    if rows != i64::try_from(n_streams)? || events != loaded {
        bail!("version 1 up to date: {rows} rows, {events} events");
    }
    vacuum(db).await?;
    let up_s = up_started.elapsed().as_secs_f64();

    // 3. The reference catch-up, nothing else running.
    eprintln!("blue-green: reference catch-up of {loaded} events");
    let reference =
        tally_worker(db, args, vec![(Tally::reference(), VersionPolicy::new())]).await?;
    let started = Instant::now();
    let running = Running::start(reference);
    let (ref_registered, ref_done, _) = wait_built(
        &client,
        "bg_tally_ref",
        "BgTallyRef",
        started,
        &|| loaded,
        false,
    )
    .await?;
    running.stop().await?;
    {
        let pool = db.pool(1)?;
        let tx = PgTransaction::begin(&pool).await?;
        PgPerspectiveStore::new()
            .retire(
                &tx,
                &PerspectiveName::new("BgTallyRef")?,
                RetireStates::Drop,
            )
            .await?;
        tx.commit().await?;
        pool.close();
    }
    vacuum(db).await?;

    // 4. Idle lag: instance A serves version 1 under the append load.
    eprintln!(
        "blue-green: version 1 under {} appends/s for {} s",
        args.blue_green_rate, args.blue_green_idle_secs
    );
    let a = Running::start(a);
    let load = Arc::new(Load::default());
    let (unseen_tx, unseen_rx) = mpsc::unbounded_channel();
    let poller_stop = Arc::new(AtomicBool::new(false));
    let poller = tokio::spawn(lag_poller(
        db.client().await?,
        unseen_rx,
        Arc::clone(&poller_stop),
    ));
    let period = Duration::from_secs(1) / args.blue_green_rate;
    let append_pool = db.pool(args.blue_green_appenders)?;
    let load_start = Instant::now();
    load.phase.store(PHASE_IDLE, Ordering::Release);
    let appenders: Vec<_> = (0..args.blue_green_appenders)
        .map(|i| {
            let own: Vec<(StreamId, i64)> = streams
                .iter()
                .skip(i)
                .step_by(args.blue_green_appenders)
                .map(|s| (*s, i64::try_from(per_stream).unwrap_or(0)))
                .collect();
            tokio::spawn(appender(
                append_pool.clone(),
                Arc::clone(&load),
                own,
                load_start,
                period,
                unseen_tx.clone(),
            ))
        })
        .collect();
    drop(unseen_tx);
    tokio::time::sleep(Duration::from_secs(args.blue_green_idle_secs)).await;
    let idle_appends = load.committed.load(Ordering::Acquire);

    // 5. The build: instance B starts with version 2 while A serves version 1.
    eprintln!(
        "blue-green: building version 2 ({:?})",
        args.blue_green_builder
    );
    load.phase.store(PHASE_BUILD, Ordering::Release);
    let manual = VersionPolicy::new().manual();
    let mut tallies = Vec::new();
    if args.blue_green_builder == Builder::V1AndV2 {
        tallies.push((Tally::v1(), VersionPolicy::new()));
    }
    tallies.push((Tally::v2(), manual));
    let b = tally_worker(db, args, tallies).await?;
    let floor = Arc::new(AtomicI64::new(-1));
    let tight = Arc::new(AtomicBool::new(false));
    let reader_stop = Arc::new(AtomicBool::new(false));
    let committed_before_build = load.committed.load(Ordering::Acquire);
    let started = Instant::now();
    let reads = tokio::spawn(reader(
        db.client().await?,
        i64::try_from(n_streams)?,
        Arc::clone(&floor),
        Arc::clone(&tight),
        Arc::clone(&reader_stop),
        started,
    ));
    let b = Running::start(b);
    let committed_total =
        || loaded + i64::try_from(load.committed.load(Ordering::Acquire)).unwrap_or(0);
    let (build_registered, build_done, build_events) = wait_built(
        &client,
        "bg_tally_v2",
        "BgTally@v2",
        started,
        &committed_total,
        args.blue_green_analyze,
    )
    .await?;
    load.phase.store(PHASE_NONE, Ordering::Release);
    let build_appends = load.committed.load(Ordering::Acquire) - committed_before_build;
    poller_stop.store(true, Ordering::Release);
    let lags = poller.await??;

    // 6. Promotion, then appends for a few seconds more.
    tight.store(true, Ordering::Release);
    let e0 = committed_total();
    floor.store(e0, Ordering::Release);
    let promote_started = started.elapsed();
    let promoted = b
        .worker
        .promote(&name, 2, PromoteOptions::waiting(Duration::from_secs(60)))
        .await
        .context("promoting version 2")?;
    let promote_took = started.elapsed() - promote_started;
    if !matches!(promoted, Promoted::Promoted { previous: Some(1) }) {
        bail!("promoting version 2: {promoted:?}");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    tight.store(false, Ordering::Release);
    tokio::time::sleep(
        Duration::from_secs(args.blue_green_after_secs).saturating_sub(Duration::from_secs(2)),
    )
    .await;
    load.stop.store(true, Ordering::Release);
    for task in appenders {
        task.await??;
    }
    append_pool.close();
    let appended = load.committed.load(Ordering::Acquire);
    let total = committed_total();
    reader_stop.store(true, Ordering::Release);
    let reads = reads.await??;
    let drain_started = Instant::now();
    wait_built(
        &client,
        "bg_tally_v2",
        "BgTally@v2",
        Instant::now(),
        &|| total,
        false,
    )
    .await?;
    let drain_s = drain_started.elapsed().as_secs_f64();
    b.stop().await?;
    a.stop().await?;

    // 7. Check version 2 against the events.
    let check = client
        .query_one(
            "WITH e AS (SELECT stream_id, count(*) AS n, sum((payload->>'n')::bigint) AS t
                          FROM wh_events GROUP BY stream_id)
             SELECT coalesce(sum(abs(coalesce(e.n, 0) - coalesce(v.events, 0))), 0)::bigint,
                    count(*) FILTER (WHERE v.stream_id IS NULL),
                    count(*) FILTER (WHERE e.stream_id IS NULL),
                    count(*) FILTER (WHERE v.stream_id IS NOT NULL AND e.stream_id IS NOT NULL
                                       AND (v.total <> 2 * e.t OR v.version <> 2)),
                    count(*) FILTER (WHERE e.stream_id IS NOT NULL),
                    coalesce(sum(e.n), 0)::bigint
               FROM e FULL JOIN bg_tally_v2 v ON v.stream_id = e.stream_id",
            &[],
        )
        .await?;
    let (off_by, missing, extra, wrong_total, checked_streams, checked_events): (
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
    ) = (
        check.get(0),
        check.get(1),
        check.get(2),
        check.get(3),
        check.get(4),
        check.get(5),
    );
    let lost_or_doubled = off_by + missing;
    let view: String = client
        .query_one("SELECT pg_get_viewdef('bg_tally'::regclass)", &[])
        .await?
        .get(0);
    let statuses: Vec<String> = client
        .query(
            "SELECT version, status FROM wh_perspective_versions
              WHERE perspective_name = $1 ORDER BY version",
            &[&NAME],
        )
        .await?
        .iter()
        .map(|r| format!("v{} {}", r.get::<_, i32>(0), r.get::<_, String>(1)))
        .collect();

    // The cost of one pending_through on a backlog of every event.
    let probe = pending_through_cost(db).await?;

    let build_vs_catchup = build_done.as_secs_f64() / ref_done.as_secs_f64();
    let (idle_p99, build_p99) = (
        quantile_ms(&lags.idle, 0.99),
        quantile_ms(&lags.build, 0.99),
    );
    let lag_vs_idle = build_p99 / idle_p99;
    let mixed_reads = reads.mixed + reads.half_built;
    let lag_row = |label: &str, h: &hdrhistogram::Histogram<u64>| {
        format!(
            "| {label} | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
            h.len(),
            quantile_ms(h, 0.50),
            quantile_ms(h, 0.90),
            quantile_ms(h, 0.99),
            if h.is_empty() {
                f64::NAN
            } else {
                h.max() as f64 / 1000.0
            }
        )
    };
    let rate = |events: i64, d: Duration| events as f64 / d.as_secs_f64();
    let phase_us =
        |a: &[AtomicU64; 3], p: u8| a[usize::from(p)].load(Ordering::Acquire) as f64 / 1000.0;
    let lines = vec![
        format!(
            "### blue/green: version 2 of a table perspective built over {loaded} events \
             ({n_streams} streams) while {} appends/s go on and version 1 serves \
             (builder: {:?}{}; worker instances at concurrency 1, poll 10 ms)",
            args.blue_green_rate,
            args.blue_green_builder,
            if args.blue_green_analyze {
                "; ANALYZE of the queue once the build's registration was seen"
            } else {
                ""
            }
        ),
        String::new(),
        "| side | registered after (s) | caught up after (s) | events applied | events/s |"
            .to_owned(),
        "|---|---:|---:|---:|---:|".to_owned(),
        format!(
            "| reference: fresh perspective, same code, nothing else running | {:.1} | {:.1} | {loaded} | {:.0} |",
            ref_registered.as_secs_f64(),
            ref_done.as_secs_f64(),
            rate(loaded, ref_done)
        ),
        format!(
            "| build of version 2, appends going on, version 1 serving | {:.1} | {:.1} | {build_events} | {:.0} |",
            build_registered.as_secs_f64(),
            build_done.as_secs_f64(),
            rate(build_events, build_done)
        ),
        String::new(),
        format!(
            "build ÷ reference: {build_vs_catchup:.3} (time; per event applied: {:.3}); the \
             build also applied the {build_appends} events appended while it ran",
            (build_done.as_secs_f64() / build_events as f64)
                / (ref_done.as_secs_f64() / loaded as f64)
        ),
        String::new(),
        "| version 1's lag (commit → row shows it) | appends | p50 ms | p90 ms | p99 ms | max ms |"
            .to_owned(),
        "|---|---:|---:|---:|---:|---:|".to_owned(),
        lag_row(
            &format!("idle: no version 2, {} s", args.blue_green_idle_secs),
            &lags.idle,
        ),
        lag_row("during the build", &lags.build),
        String::new(),
        format!(
            "version 1's lag p99, build ÷ idle: {lag_vs_idle:.3}; the poller read {} times \
             (every 5 ms while an append was unseen); appends not seen within 2 s of the \
             build's end: {}",
            lags.reads, lags.unseen
        ),
        format!(
            "appends: {appended} committed ({idle_appends} in the idle phase, {build_appends} \
             during the build); slowest append (begin → commit): idle {:.0} ms, build {:.0} ms; \
             latest commit after its due time: idle {:.0} ms, build {:.0} ms (the \
             registration's transaction holds appends back while it writes the work rows)",
            phase_us(&load.slowest_us, PHASE_IDLE),
            phase_us(&load.slowest_us, PHASE_BUILD),
            phase_us(&load.latest_us, PHASE_IDLE),
            phase_us(&load.latest_us, PHASE_BUILD),
        ),
        format!(
            "promotion: the call took {:.0} ms (E0 = {e0} events committed before it); reads \
             of the view: {} ({} of version 1, {} of version 2), mixed {}, half-built {}; last \
             read of version 1 {:.0} ms and first of version 2 {:.0} ms after the build's \
             start, the call started at {:.0} ms; reads of version 2 below the last read of \
             version 1: {} (by at most {} events)",
            ms(promote_took),
            reads.total,
            reads.v1,
            reads.v2,
            reads.mixed,
            reads.half_built,
            reads.last_v1_at.map_or(f64::NAN, ms),
            reads.first_v2_at.map_or(f64::NAN, ms),
            ms(promote_started),
            reads.stepped_back,
            reads.max_step_back
        ),
        format!(
            "check of bg_tally_v2 after the appends stopped ({drain_s:.1} s to apply the last \
             ones): {checked_streams} streams, {checked_events} events; Σ|events − row| = \
             {off_by}, streams without a row {missing}, rows without a stream {extra}, rows \
             with a wrong total or version {wrong_total}; versions: {}; the view: {}",
            statuses.join(", "),
            view.split_whitespace().collect::<Vec<_>>().join(" ")
        ),
        format!(
            "set-up: load {load_s:.1} s, version 1 up to date (one statement) {up_s:.1} s; \
             pending_through on a backlog of {} work rows: {} ms ({} calls, median {:.0} ms; \
             registering that perspective took {:.1} s)",
            probe.rows,
            fmt_all(&probe.ms),
            probe.ms.len(),
            crate::report::median(&probe.ms),
            probe.register_s
        ),
        format!(
            "section total: {:.1} s",
            section_started.elapsed().as_secs_f64()
        ),
    ];
    Ok(BlueGreen {
        lines,
        mixed_reads,
        lost_or_doubled,
        build_vs_catchup,
        lag_vs_idle,
    })
}

/// The cost of `pending_through` on a full backlog.
struct Probe {
    rows: i64,
    ms: Vec<f64>,
    register_s: f64,
}

/// Registers a perspective of its own (a work row per event), times three `pending_through`
/// calls on it up to now (each in a transaction rolled back), and retires it, its states
/// dropped.
async fn pending_through_cost(db: &BenchDatabase) -> Result<Probe> {
    let name = PerspectiveName::new("BgProbe")?;
    let started = Instant::now();
    super::register(db, std::slice::from_ref(&name)).await?;
    let register_s = started.elapsed().as_secs_f64();
    vacuum(db).await?;
    let pool = db.pool(1)?;
    let store = PgPerspectiveStore::new();
    let mut times = Vec::new();
    let mut rows = 0;
    for _ in 0..3 {
        let tx = PgTransaction::begin(&pool).await?;
        let up_to = lockstep_worker::versions::event_id_at(time::OffsetDateTime::now_utc());
        let t = Instant::now();
        let pending = store.pending_through(&tx, &name, None, up_to).await?;
        times.push(ms(t.elapsed()));
        tx.rollback().await?;
        rows = i64::try_from(pending.events)?;
    }
    let tx = PgTransaction::begin(&pool).await?;
    store.retire(&tx, &name, RetireStates::Drop).await?;
    tx.commit().await?;
    pool.close();
    Ok(Probe {
        rows,
        ms: times,
        register_s,
    })
}
