//! Every guarantee through a primary failover ([`super::replication`]): the primary is killed
//! in the middle of the work and its standby promoted, while the clients reach "whichever is the
//! primary" through one multi-host URL with `target_session_attrs=read-write`.
//!
//! - [`commands`] — writers run commands through the command runner under the aggregate lock
//!   ([`Mode::Locked`]) and through the combiner ([`Mode::Combined`]) while the primary fails.
//!   Every command's answer is checked against the new primary: an acknowledged command's event
//!   is there exactly once at the version it was answered with (with asynchronous replication, a
//!   missing one is counted as lost by the failover, [`FailoverStats::lost_acknowledged`], not
//!   as a violation: that is what asynchronous replication gives up); a command answered with a
//!   failure is not there (a wrong answer otherwise); a [`CommandError::CommitUnknown`] may be
//!   either; every stream's versions run 1, 2, 3… without a gap or a repeat.
//! - [`lost_epoch`] — asynchronous replication loses a lease's epoch increment: holder A takes a
//!   lease at epoch *e* on a primary whose standby does not receive it, the primary fails, and on
//!   the promoted standby holder B takes the same pair at the same epoch *e*. A's fenced commit
//!   must be refused (the fence checks the holder as well as the epoch) and B's accepted; A's
//!   acknowledged appends of that time are lost, and counted.
//! - The worker fleet through failovers is [`super::workers::run_through_failovers`].
//!
//! A scenario counts ([`Tally`]), it never asserts; the short tests assert the counts are zero.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use lockstep_command::{CommandError, CommandRunner, Mode};
use lockstep_core::{
    AcquireOutcome, AggregateType, Decider, ErrorKind, ExpectedVersion, InstanceId, LeaseFence,
    LockReason, NewEvent, PerspectiveName, RecordedEvent, StreamId, StreamLockOptions,
    StreamLocker, Transaction as _, TransactionSource as _, serde_json,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::PgEventStore;
use lockstep_pg_stream::PgStreamLocker;
use tokio::sync::Mutex;
use uuid::Uuid;

use super::replication::{Failover, ReplicatedPair, Replication};
use super::{Scale, Tally};
use lockstep_core::EventStore as _;

/// The database the scenarios create on their pair.
const DB: &str = "lockstep_failover";
/// How long a step (a connection through the failover, a check) may take.
const STEP_LIMIT: Duration = Duration::from_secs(60);

/// What a failover run measured.
#[derive(Debug, Default, Clone)]
pub struct FailoverStats {
    /// Replication of the pair (`synchronous` or `asynchronous`).
    pub replication: &'static str,
    /// Promotions survived.
    pub failovers: u64,
    /// Commands (or appends) acknowledged.
    pub acknowledged: u64,
    /// Commands answered `CommitUnknown`, and of those, how many were committed after all.
    pub commit_unknown: u64,
    /// Of the `CommitUnknown` answers, those whose events are on the new primary.
    pub commit_unknown_committed: u64,
    /// Commands answered with a failure (nothing committed).
    pub failed: u64,
    /// Acknowledged commands or appends missing after an asynchronous failover (what
    /// asynchronous replication gives up; with synchronous replication a missing one is a
    /// violation and counted in the tally as lost instead).
    pub lost_acknowledged: u64,
    /// Lease epochs found lower on the new primary than a holder had seen on the old one.
    pub epochs_back: u64,
    /// The longest `pg_ctl promote` (milliseconds).
    pub promote_ms: u64,
    /// The most WAL the standby had not flushed when a primary was killed (bytes).
    pub unflushed_bytes: i64,
    /// The longest time from a promotion to the first work done on the new primary
    /// (milliseconds): a command acknowledged, or an event applied by a worker.
    pub resume_ms: u64,
}

impl std::fmt::Display for FailoverStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "replication={} failovers={} acknowledged={} commit_unknown={} \
             commit_unknown_committed={} failed={} lost_acknowledged={} epochs_back={} \
             promote_ms={} unflushed_bytes={} resume_ms={}",
            self.replication,
            self.failovers,
            self.acknowledged,
            self.commit_unknown,
            self.commit_unknown_committed,
            self.failed,
            self.lost_acknowledged,
            self.epochs_back,
            self.promote_ms,
            self.unflushed_bytes,
            self.resume_ms
        )
    }
}

impl FailoverStats {
    /// Adds one failover's figures (the maxima).
    pub fn note(&mut self, failover: Failover) {
        self.promote_ms = self.promote_ms.max(millis(failover.promotion));
        self.unflushed_bytes = self
            .unflushed_bytes
            .max(failover.unflushed_bytes.unwrap_or(0));
    }
}

/// A run's tally and figures.
#[derive(Debug, Default)]
pub struct FailoverReport {
    /// Cases and failures.
    pub tally: Tally,
    /// What happened.
    pub stats: FailoverStats,
}

/// How many failovers a run goes through, and how long the writers run around each.
#[derive(Debug, Clone, Copy)]
struct Plan {
    failovers: u64,
    /// Writing before each failover.
    before: Duration,
    /// Writing after the last failover once the writers resumed.
    after: Duration,
}

impl Plan {
    fn new(scale: Scale) -> Plan {
        match scale {
            Scale::Short => Plan {
                failovers: 1,
                before: Duration::from_millis(1500),
                after: Duration::from_millis(1000),
            },
            Scale::Long => Plan {
                failovers: 4,
                before: Duration::from_secs(15),
                after: Duration::from_secs(5),
            },
        }
    }
}

/// A counter aggregate: each command appends one event with the id the command chose (so an
/// answer can be checked against the database), and the state counts the events.
struct Ledger {
    ty: AggregateType,
}

impl Decider for Ledger {
    type State = u64;
    /// The event's id and its number.
    type Command = (Uuid, i64);
    type Event = (Uuid, i64);
    type Error = std::convert::Infallible;

    fn aggregate_type(&self) -> &AggregateType {
        &self.ty
    }

    fn initial_state(&self, _id: Uuid) -> u64 {
        0
    }

    async fn decide(
        &self,
        _count: &u64,
        command: &(Uuid, i64),
    ) -> Result<Vec<(Uuid, i64)>, std::convert::Infallible> {
        Ok(vec![*command])
    }

    fn evolve(&self, count: u64, _event: &(Uuid, i64)) -> u64 {
        count + 1
    }

    fn encode(&self, (id, n): &(Uuid, i64)) -> lockstep_core::Result<NewEvent> {
        NewEvent::new("Counted", serde_json::json!({ "n": n }))?.with_id(*id)
    }

    fn decode(&self, event: &RecordedEvent) -> lockstep_core::Result<(Uuid, i64)> {
        Ok((event.event_id, event.payload["n"].as_i64().unwrap_or(-1)))
    }
}

/// One command's answer, as a writer saw it.
#[derive(Debug, Clone)]
enum Answer {
    /// Acknowledged at this version, with this state (the event count).
    Done { version: u64, state: u64 },
    /// `CommitUnknown`.
    Unknown,
    /// A failure: nothing of the command may be committed.
    Failed(ErrorKind),
    /// Anything else (a rejection, a non-retryable failure of a command that cannot fail).
    Wrong(String),
}

/// What the writers answered: by event id, the stream, the answer and when the command started.
type Answers = Arc<Mutex<Vec<(Uuid, StreamId, Answer, Instant, Instant)>>>;

/// Commands under the aggregate lock and through the combiner while the primary fails over.
pub async fn commands(replication: Replication, scale: Scale) -> anyhow::Result<FailoverReport> {
    let plan = Plan::new(scale);
    let mut pair = ReplicatedPair::start(replication).await?;
    pair.create_database(DB).await?;
    let db = PgDatabase::builder()
        .url(&pair.url(DB))
        .max_connections(12)
        .checkout_wait(Duration::from_secs(5))
        .build()?;
    db.migrate().await?;
    let store = PgEventStore::new(&db);
    let mut report = FailoverReport::default();
    report.stats.replication = replication.name();

    let answers: Answers = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let numbers = Arc::new(AtomicI64::new(0));
    let mut writers = tokio::task::JoinSet::new();
    for (mode, ty) in [(Mode::Locked, "Locked"), (Mode::Combined, "Combined")] {
        let runner = CommandRunner::new(
            db.clone(),
            store.clone(),
            Ledger {
                ty: AggregateType::new(ty)?,
            },
            mode,
        );
        let streams: Arc<Vec<Uuid>> = Arc::new((0..3).map(|_| Uuid::now_v7()).collect());
        for _ in 0..3 {
            let (runner, streams) = (runner.clone(), Arc::clone(&streams));
            let (answers, stop, numbers) = (
                Arc::clone(&answers),
                Arc::clone(&stop),
                Arc::clone(&numbers),
            );
            writers.spawn(async move {
                let mut k = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    k += 1;
                    let stream = streams[k % streams.len()];
                    let id = Uuid::now_v7();
                    let n = numbers.fetch_add(1, Ordering::Relaxed);
                    let started = Instant::now();
                    let answer = match runner.handle(stream, (id, n)).await {
                        Ok(done) => Answer::Done {
                            version: done.version(),
                            state: *done.state(),
                        },
                        Err(CommandError::CommitUnknown { .. }) => Answer::Unknown,
                        Err(CommandError::Failed(e)) if e.is_retryable() => {
                            Answer::Failed(e.kind())
                        }
                        Err(other) => Answer::Wrong(format!("{other}: {:?}", other.error())),
                    };
                    let failed = matches!(answer, Answer::Failed(_));
                    answers.lock().await.push((
                        id,
                        StreamId::from_uuid(stream),
                        answer,
                        started,
                        Instant::now(),
                    ));
                    if failed {
                        // The primary is gone or not promoted yet: try again shortly.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            });
        }
    }

    for _ in 0..plan.failovers {
        tokio::time::sleep(plan.before).await;
        let failover = pair.fail_over().await?;
        let promoted = Instant::now();
        report.stats.failovers += 1;
        report.stats.note(failover);
        // The writers resume on their own; the first acknowledgement of a command started after
        // the promotion says when.
        let resumed = until(STEP_LIMIT, || {
            let answers = Arc::clone(&answers);
            async move {
                let answers = answers.lock().await;
                answers
                    .iter()
                    .filter(|(_, _, a, started, _)| {
                        *started >= promoted && matches!(a, Answer::Done { .. })
                    })
                    .map(|(_, _, _, _, ended)| *ended)
                    .min()
            }
        })
        .await;
        match resumed {
            Some(at) => {
                report.stats.resume_ms = report.stats.resume_ms.max(millis(at - promoted));
            }
            None => report.tally.violation(format!(
                "no command was acknowledged within {STEP_LIMIT:?} of the promotion"
            )),
        }
        pair.rebuild_standby().await?;
    }
    tokio::time::sleep(plan.after).await;
    stop.store(true, Ordering::Relaxed);
    // Each writer ends after its command in flight; one that does not within the step limit
    // hangs (aborted when the set is dropped).
    let joined_all = tokio::time::timeout(STEP_LIMIT, async {
        while let Some(joined) = writers.join_next().await {
            if let Err(e) = joined {
                if e.is_panic() {
                    report.tally.panic(format!("a writer panicked: {e}"));
                } else {
                    report
                        .tally
                        .violation(format!("a writer was cancelled: {e}"));
                }
            }
        }
    })
    .await;
    if joined_all.is_err() {
        report.tally.violation(format!(
            "a writer's command did not end within {STEP_LIMIT:?} of the stop"
        ));
    }

    report.tally.failovers = report.stats.failovers;
    let client = pair.connect_primary(DB).await?;
    let stored = stored_events(&client).await?;
    let answers = answers.lock().await;
    check_answers(&answers, &stored, replication, &mut report);
    check_versions(&stored, &mut report.tally);
    if report.stats.failovers == 0 || report.stats.acknowledged == 0 {
        report
            .tally
            .violation("no failover or no acknowledged command: the scenario tested nothing");
    }
    Ok(report)
}

/// Every stored event: id → (stream, version).
async fn stored_events(
    client: &tokio_postgres::Client,
) -> anyhow::Result<HashMap<Uuid, (StreamId, i64)>> {
    let rows = client
        .query("SELECT event_id, stream_id, version FROM wh_events", &[])
        .await
        .context("reading the events on the new primary")?;
    let mut stored = HashMap::new();
    for row in rows {
        let id: Uuid = row.try_get(0)?;
        let stream: Uuid = row.try_get(1)?;
        stored.insert(id, (StreamId::from_uuid(stream), row.try_get(2)?));
    }
    Ok(stored)
}

/// Checks each answer against the events on the new primary.
fn check_answers(
    answers: &[(Uuid, StreamId, Answer, Instant, Instant)],
    stored: &HashMap<Uuid, (StreamId, i64)>,
    replication: Replication,
    report: &mut FailoverReport,
) {
    for (id, stream, answer, _, _) in answers {
        report.tally.cases += 1;
        let found = stored.get(id);
        match answer {
            Answer::Done { version, state } => {
                report.stats.acknowledged += 1;
                if *state != *version {
                    report.tally.violation(format!(
                        "event {id}: answered state {state} at version {version} (the state \
                         counts the events)"
                    ));
                }
                match found {
                    Some((s, v)) if s == stream && u64::try_from(*v).ok() == Some(*version) => {}
                    Some((s, v)) => report.tally.violation(format!(
                        "event {id}: answered at {stream} version {version}, stored at {s} \
                         version {v}"
                    )),
                    None if replication == Replication::Asynchronous => {
                        report.stats.lost_acknowledged += 1;
                    }
                    None => report.tally.lost(format!(
                        "event {id}: acknowledged at version {version} of {stream}, missing on \
                         the new primary"
                    )),
                }
            }
            Answer::Unknown => {
                report.stats.commit_unknown += 1;
                report.stats.commit_unknown_committed += u64::from(found.is_some());
            }
            Answer::Failed(kind) => {
                report.stats.failed += 1;
                if found.is_some() {
                    report.tally.violation(format!(
                        "event {id}: the command was answered with a failure ({kind:?}) but \
                         its event is stored: a wrong answer"
                    ));
                }
            }
            Answer::Wrong(what) => report
                .tally
                .violation(format!("event {id}: an answer no command may get: {what}")),
        }
    }
}

/// Every stream's versions run 1, 2, 3… with no gap and no repeat.
fn check_versions(stored: &HashMap<Uuid, (StreamId, i64)>, tally: &mut Tally) {
    let mut versions: BTreeMap<StreamId, Vec<i64>> = BTreeMap::new();
    for (stream, version) in stored.values() {
        versions.entry(*stream).or_default().push(*version);
    }
    for (stream, mut vs) in versions {
        tally.cases += 1;
        vs.sort_unstable();
        let expected: Vec<i64> = (1..=vs.len() as i64).collect();
        if vs != expected {
            tally.violation(format!(
                "stream {stream}: versions {vs:?} are not 1..={}",
                vs.len()
            ));
        }
    }
}

/// Asynchronous replication loses a lease's epoch increment; the fence still refuses the
/// holder that the new primary never saw.
pub async fn lost_epoch() -> anyhow::Result<FailoverReport> {
    let mut pair = ReplicatedPair::start(Replication::Asynchronous).await?;
    pair.create_database(DB).await?;
    let db = PgDatabase::builder()
        .url(&pair.url(DB))
        .max_connections(4)
        .checkout_wait(Duration::from_secs(5))
        .build()?;
    db.migrate().await?;
    let mut report = FailoverReport::default();
    report.stats.replication = Replication::Asynchronous.name();
    let perspective = PerspectiveName::new("FailoverFence")?;
    let stream = StreamId::new_v7();
    {
        let client = pair.connect_primary(DB).await?;
        client
            .execute(
                "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)",
                &[&stream.as_uuid(), &perspective.as_str()],
            )
            .await?;
    }
    let options = StreamLockOptions::new(Duration::from_secs(30), Duration::from_secs(5))?;
    let locker = PgStreamLocker::new(&db, options);
    let store = PgEventStore::new(&db);
    let (a, b) = (InstanceId::random(), InstanceId::random());

    // A first lease, released, that the standby does receive: the pair's epoch is 1 on both.
    let first = acquire(&locker, stream, &perspective, a).await?;
    let _ = locker.release(&first).await?;
    wait_replayed(&pair).await?;

    // The standby stops receiving; A takes the lease again (epoch 2, on the primary only) and
    // appends under it, acknowledged.
    pair.stop_standby().await?;
    let lease_a = acquire(&locker, stream, &perspective, a).await?;
    let mut appended = Vec::new();
    for n in 0..5 {
        let event = NewEvent::new("Counted", serde_json::json!({ "n": n }))?;
        appended.push(event.event_id());
        let tx = db.begin().await?;
        locker.check_lease(&tx, &lease_a).await?;
        store
            .append(&tx, stream, ExpectedVersion::Any, &[event])
            .await?;
        tx.commit().await?;
    }

    let failover = pair.fail_over().await?;
    report.stats.failovers = 1;
    report.tally.failovers = 1;
    report.stats.note(failover);

    // On the new primary: A's epoch and appends are gone; B takes the pair at the same epoch.
    let lease_b = until(STEP_LIMIT, || {
        let (locker, perspective) = (&locker, &perspective);
        async move { acquire(locker, stream, perspective, b).await.ok() }
    })
    .await
    .context("B could not take the lease on the new primary")?;
    report.tally.cases += 1;
    if lease_b.epoch != lease_a.epoch {
        report.tally.violation(format!(
            "the scenario did not lose the epoch increment: A held epoch {}, B got {}",
            lease_a.epoch.get(),
            lease_b.epoch.get()
        ));
    }
    report.stats.epochs_back += u64::from(lease_b.epoch <= lease_a.epoch);

    // A (same epoch, other holder) is refused; B is accepted.
    report.tally.cases += 1;
    let tx: PgTransaction = db.begin().await?;
    match locker.check_lease(&tx, &lease_a).await {
        Err(e) if e.kind() == ErrorKind::LeaseLost => {}
        Err(e) => report.tally.violation(format!(
            "A's fence after the failover failed with {:?} instead of LeaseLost: {e}",
            e.kind()
        )),
        Ok(()) => report.tally.violation(
            "A's fenced commit at an epoch the new primary gave to B was accepted: two holders",
        ),
    }
    tx.rollback().await?;
    report.tally.cases += 1;
    let tx: PgTransaction = db.begin().await?;
    if let Err(e) = locker.check_lease(&tx, &lease_b).await {
        report
            .tally
            .violation(format!("B's fence on the new primary was refused: {e}"));
    }
    tx.rollback().await?;

    let client = pair.connect_primary(DB).await?;
    let stored = stored_events(&client).await?;
    report.stats.acknowledged = appended.len() as u64;
    report.stats.lost_acknowledged = appended
        .iter()
        .filter(|id| !stored.contains_key(id))
        .count() as u64;
    report.tally.cases += 1;
    if report.stats.lost_acknowledged != appended.len() as u64 {
        report.tally.violation(format!(
            "the standby was stopped before A's appends, yet {} of {} are on the new primary",
            appended.len() as u64 - report.stats.lost_acknowledged,
            appended.len()
        ));
    }
    Ok(report)
}

/// Takes the pair's lease for `instance` (a `rewind` lease), retrying a busy row.
async fn acquire(
    locker: &PgStreamLocker,
    stream: StreamId,
    perspective: &PerspectiveName,
    instance: InstanceId,
) -> anyhow::Result<lockstep_core::LeaseId> {
    for _ in 0..50 {
        match locker
            .try_acquire(stream, perspective, instance, &LockReason::Rewind)
            .await?
        {
            AcquireOutcome::Acquired(lease) => return Ok(lease.id),
            AcquireOutcome::Busy => tokio::time::sleep(Duration::from_millis(20)).await,
            other => anyhow::bail!("try-acquire answered {other:?}"),
        }
    }
    anyhow::bail!("the cursor row stayed busy")
}

/// Waits (bounded) until the standby has replayed everything the primary has written.
async fn wait_replayed(pair: &ReplicatedPair) -> anyhow::Result<()> {
    let client = pair.connect_primary("postgres").await?;
    let lsn: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .try_get(0)?;
    let caught_up = until(STEP_LIMIT, || {
        let (client, lsn) = (&client, &lsn);
        async move {
            let row = client
                .query_opt(
                    "SELECT 1 FROM pg_stat_replication WHERE replay_lsn >= $1::text::pg_lsn",
                    &[lsn],
                )
                .await
                .ok()?;
            row.map(|_| ())
        }
    })
    .await;
    caught_up.context("the standby did not replay the primary's WAL")
}

/// Polls `probe` every 20 ms until it gives a value, for at most `limit`.
async fn until<T, F, Fut>(limit: Duration, mut probe: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = probe().await {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
