//! Faults injected while leases are held and advisory-lock waits are blocked, and the promises
//! checked afterwards: no lease held by two instances, no lock or lease left behind, nothing
//! acknowledged lost, every interrupted operation ends with a typed error (never a hang, never
//! a panic), and the pools recover.
//!
//! 1. **PostgreSQL restart** ([`restart`] rounds) on a private server ([`super::server`]; the
//!    shared one is never stopped). A [`LeaseKeeper`] keeps leases alive, a lease is held
//!    without keepalive, a [`PgDistributedLock`] holder and an
//!    [`AggregateWriteLock`] holder each have a waiter blocked
//!    at the server (plus one queued in process), then the server stops (`-m fast` or
//!    `-m immediate`, sometimes for longer than the lock timeout) and starts again on the same
//!    port. Checked: every waiter and holder ends within a bound with a retryable or
//!    commit-unknown error; the lock pool and the locker's pool work again; a keeper lease the
//!    keeper still believes held is held on the database and a second instance is denied; after
//!    a downtime longer than the lock timeout every keeper lease's lost signal has fired; the
//!    lease held without keepalive still names its holder after the restart, a second instance
//!    is denied until its expiry (on the database clock) and takes it over only then, the old
//!    holder's fenced commit succeeds before and is refused after; a fenced write acknowledged
//!    before the restart is still there; no advisory lock and no live lease is left.
//! 2. **`pg_terminate_backend`** (on the harness database of the shared server): of the
//!    keepalive's pooled connection — the keeper's next renews succeed on a new connection, the
//!    lease is not lost, a second instance stays denied, the fenced commit works; and of an
//!    advisory-lock holder's connection (the distributed lock and the aggregate lock in turn) —
//!    the waiter behind it is granted the lock (and only it holds it), the holder's next lock
//!    call fails `ConnectionLost` and its commit fails typed, its uncommitted write is gone, the
//!    pool recovers and no lock is left.
//! 3. **A keepalive that stalls**: its connections go through a [`Relay`] that is paused,
//!    or its pool is exhausted by a connection held elsewhere. A second instance polls the lease;
//!    the stalled holder's lost signal must fire *before* the try-acquire that took the lease
//!    over was sent ([`lost_before_takeover`]), and after the stall ends the old holder's fenced
//!    commit is refused, its release does not end the successor's lease, and the successor's
//!    fenced commit succeeds.
//!
//! 4. **A lost `COMMIT` reply**: a [`Relay`] forwards a transaction's `COMMIT` (after an
//!    `append`, or with an `append_at_commit` travelling in the same message) and cuts the
//!    connection before the reply. The commit must report `CommitUnknown` (never success, never a
//!    retryable error), and the caller's retry — a new transaction appending the same events,
//!    same ids, same expected version — must succeed as a replay: the stream then holds each
//!    event exactly once (a missing one is **lost**, an extra one **duplicated**), and the
//!    relayed pool works again.
//! 5. **A dropped release** (issue 19): `HeldLease::release` given up on by its caller while
//!    another transaction holds the cursor row — the lease must still be released once the
//!    row is free, and a shutdown started meanwhile waits for that release and counts it.
//!
//! On sqlx ([`run_on`] with [`Driver::Sqlx`]) the two parts that put a relay in front of the
//! pool run with an `sqlx::PgPool` behind it, the same rounds and checks: part 3's network
//! stall (the stalled holder's keeper on `PgStreamLocker::for_sqlx`, its fenced commits in
//! `SqlxTransaction`s; the successor stays on tokio-postgres) and part 4 (`SqlxTransaction`s,
//! `PgEventStore::for_sqlx`). The restart, termination, exhausted-pool and dropped-release
//! parts stay on tokio-postgres: they drive the advisory locks and deadpool pools directly.
//!
//! Each fault × check is one case in the [`Tally`]. Setup failures (no database, a server that
//! does not start again) are errors of [`run`], not violations.
//!
//! **No `initdb`**: if the private server cannot be started, the restart part is **skipped with
//! a printed reason** (on stderr) at [`Scale::Short`] — CI machines without the PostgreSQL
//! server programs still run parts 2 and 3 — and **reported as a violation** with the reason at
//! [`Scale::Long`], where a missing part must not pass silently.
//!
//! Short: 2 restarts (fast with no downtime; immediate with a downtime past the lock timeout),
//! 2 + 2 terminations, 2 stalls (a network stall of a renewed lease at a 3.75:1 lock-timeout /
//! keepalive ratio, an exhausted pool right after the acquire at the default 3:1 ratio), 4 lost
//! `COMMIT` replies — about 18 s. Long: 20 restarts, 20 + 20 terminations, 24 stalls over four
//! ratios and random stall phases, 100 lost `COMMIT` replies — about 3 min.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use deadpool_postgres::{ManagerConfig, Pool, RecyclingMethod};
use lockstep_core::TransactionSource;
use lockstep_core::{
    AcquireOutcome, AggregateWriteLock, DistributedAggregateWriteLock, DistributedLock, Error,
    ErrorKind, ExpectedVersion, InstanceId, LeaseFence, LeaseId, LockReason, NewEvent,
    OffsetDateTime, PerspectiveName, ReleaseOutcome, ResourceKey, StreamId, StreamLockOptions,
    StreamLocker,
};
use lockstep_pg::PgTransaction;
use lockstep_pg::driver::Executor;
use lockstep_pg::sqlx::SqlxDatabase;
use lockstep_pg_advisory::PgDistributedLock;
use lockstep_pg_store::PgEventStore;
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::relay::Relay;
use lockstep_worker::{HeldLease, LeaseKeeper, Leased};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_postgres::{Client, Config, NoTls};
use uuid::Uuid;

use super::server::{PrivateServer, StopMode};
use super::{Driver, Scale, Tally};
use lockstep_core::EventStore;
use lockstep_core::Transaction as _;

/// The perspective of every cursor row the scenario creates.
const PERSPECTIVE: &str = "FaultsPerspective";
/// The aggregate type of the aggregate-lock cases.
const AGGREGATE: &str = "FaultsAggregate";
/// How long an interrupted operation may take to end before it counts as hung.
const END_LIMIT: Duration = Duration::from_secs(15);
/// How long a pool may take to work again after a fault.
const RECOVERY_LIMIT: Duration = Duration::from_secs(10);
/// Bound of any single harness step (a query, a fenced commit) that must not hang.
const STEP_LIMIT: Duration = Duration::from_secs(10);

/// Runs the three fault families at `scale` and returns what they found.
pub async fn run(scale: Scale) -> anyhow::Result<Tally> {
    let mut tally = Tally::default();
    restart::run(scale, &mut tally).await?;
    terminate(scale, &mut tally).await?;
    stall(scale, &mut tally, Driver::TokioPostgres).await?;
    lost_commit(scale, &mut tally, Driver::TokioPostgres).await?;
    dropped_release(scale, &mut tally).await?;
    Ok(tally)
}

/// [`run`] on `driver`: every part on tokio-postgres; on sqlx, the network stalls (part 3) and
/// the lost `COMMIT` replies (part 4), the parts with a relay in front of the pool (see the
/// module docs).
pub async fn run_on(scale: Scale, driver: Driver) -> anyhow::Result<Tally> {
    match driver {
        Driver::TokioPostgres => run(scale).await,
        Driver::Sqlx => {
            let mut tally = Tally::default();
            stall(scale, &mut tally, Driver::Sqlx).await?;
            lost_commit(scale, &mut tally, Driver::Sqlx).await?;
            Ok(tally)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Checks (public so the test file can show that each can fail)
// ---------------------------------------------------------------------------------------------

/// Counts one check as a case; a failed one is a violation described by `detail`. Returns
/// whether it held.
pub fn check(tally: &mut Tally, held: bool, detail: impl FnOnce() -> String) -> bool {
    tally.cases += 1;
    if !held {
        tally.violation(detail());
    }
    held
}

/// How a task run under a fault ended.
#[derive(Debug)]
pub enum Ended<T> {
    /// It returned this.
    Returned(T),
    /// It had not ended after this long (it was then aborted).
    Hung(Duration),
    /// It panicked (the panic's message).
    Panicked(String),
}

/// Waits at most `limit` for `task`; a task still running then is aborted and reported hung.
pub async fn bounded<T: Send + 'static>(limit: Duration, task: JoinHandle<T>) -> Ended<T> {
    let abort = task.abort_handle();
    match tokio::time::timeout(limit, task).await {
        Ok(Ok(value)) => Ended::Returned(value),
        Ok(Err(e)) if e.is_panic() => Ended::Panicked(panic_message(&*e.into_panic())),
        // Only `abort` cancels these tasks, and nothing aborts them before the limit.
        Ok(Err(_)) => Ended::Hung(limit),
        Err(_) => {
            abort.abort();
            Ended::Hung(limit)
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Whether `kind` is what an operation cut off by a lost connection may report: a retryable
/// kind (`ConnectionLost` above all), or `CommitUnknown` for a `COMMIT` in flight.
pub fn lost_connection(kind: ErrorKind) -> bool {
    kind.is_retryable() || kind == ErrorKind::CommitUnknown
}

/// The promise for an operation a fault interrupted: it ended within its bound, without a
/// panic, with an error whose kind `allowed` accepts. A success is a violation too (it could
/// not have survived the fault). One case; a panic is counted as a panic.
pub fn expect_failure<T: Debug>(
    tally: &mut Tally,
    what: &str,
    ended: Ended<lockstep_core::Result<T>>,
    allowed: fn(ErrorKind) -> bool,
) -> bool {
    tally.cases += 1;
    match ended {
        Ended::Returned(Err(e)) if allowed(e.kind()) => true,
        Ended::Returned(Err(e)) => {
            tally.violation(format!(
                "{what}: failed with the wrong kind {:?}: {e}",
                e.kind()
            ));
            false
        }
        Ended::Returned(Ok(value)) => {
            tally.violation(format!(
                "{what}: succeeded ({value:?}) although the fault must have ended it"
            ));
            false
        }
        Ended::Hung(limit) => {
            tally.violation(format!("{what}: still running {limit:?} after the fault"));
            false
        }
        Ended::Panicked(message) => {
            tally.panic(format!("{what}: panicked: {message}"));
            false
        }
    }
}

/// The stall promise: the stalled holder's lost signal fired (`lost`) no later than the moment
/// the try-acquire that took its lease over was sent (`takeover_sent`). A signal that never
/// fired, or fired later, is a violation. One case.
pub fn lost_before_takeover(
    tally: &mut Tally,
    what: &str,
    lost: Option<Instant>,
    takeover_sent: Instant,
) -> bool {
    match lost {
        Some(lost) if lost <= takeover_sent => check(tally, true, String::new),
        Some(lost) => check(tally, false, || {
            format!(
                "{what}: the lost signal fired {:?} after another instance's try-acquire that \
                 took the lease over was sent",
                lost.saturating_duration_since(takeover_sent)
            )
        }),
        None => check(tally, false, || {
            format!("{what}: the lease was taken over and the lost signal never fired")
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Shared plumbing
// ---------------------------------------------------------------------------------------------

/// A pool of at most `size` connections (bounded waits) named `app` in `pg_stat_activity`.
fn pool(config: &Config, app: &str, size: usize) -> anyhow::Result<Pool> {
    let mut config = config.clone();
    config.application_name(app);
    let manager = deadpool_postgres::Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Ok(lockstep_pg::pool::bounded_pool(manager, size)?)
}

/// One direct connection (its connection task runs on the current runtime).
async fn connect(config: &Config) -> anyhow::Result<Client> {
    let (client, connection) = tokio::time::timeout(STEP_LIMIT, config.connect(NoTls))
        .await
        .context("connecting timed out")??;
    tokio::spawn(async move {
        // Ends with the client or the server; errors surface on the client's next call.
        let _ = connection.await;
    });
    Ok(client)
}

/// Applies lockstep's schema and the table of fenced writes (`faults_marks`).
async fn prepare_schema(pool: &Pool) -> anyhow::Result<()> {
    lockstep_pg::migrate(pool).await?;
    let client = lockstep_pg::checkout(pool, STEP_LIMIT).await?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS faults_marks (
                 mark uuid PRIMARY KEY, stream_id uuid NOT NULL, holder uuid NOT NULL,
                 epoch bigint NOT NULL)",
        )
        .await?;
    Ok(())
}

fn perspective() -> anyhow::Result<PerspectiveName> {
    Ok(PerspectiveName::new(PERSPECTIVE)?)
}

/// `count` fresh, unlocked cursor rows.
async fn new_cursors(client: &Client, count: usize) -> anyhow::Result<Vec<StreamId>> {
    let streams: Vec<StreamId> = (0..count).map(|_| StreamId::new_v7()).collect();
    for stream in &streams {
        client
            .execute(
                "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)",
                &[&stream.as_uuid(), &PERSPECTIVE],
            )
            .await?;
    }
    Ok(streams)
}

/// A cursor row's lease as stored, judged on the database clock.
#[derive(Debug)]
struct LeaseRow {
    holder: Option<Uuid>,
    epoch: i64,
    live: bool,
    /// The expiry in microseconds since the Unix epoch.
    expiry_us: Option<i64>,
}

async fn lease_row(client: &Client, stream: StreamId) -> anyhow::Result<LeaseRow> {
    let row = client
        .query_one(
            "SELECT stream_lock_instance_id, stream_lock_epoch,
                    coalesce(stream_lock_expiry > clock_timestamp(), false),
                    (extract(epoch FROM stream_lock_expiry) * 1000000)::bigint
               FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2",
            &[&stream.as_uuid(), &PERSPECTIVE],
        )
        .await?;
    Ok(LeaseRow {
        holder: row.try_get(0)?,
        epoch: row.try_get(1)?,
        live: row.try_get(2)?,
        expiry_us: row.try_get(3)?,
    })
}

/// The database clock in microseconds since the Unix epoch.
async fn db_now_us(client: &Client) -> anyhow::Result<i64> {
    let row = client
        .query_one(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
            &[],
        )
        .await?;
    Ok(row.try_get(0)?)
}

fn micros(at: OffsetDateTime) -> i64 {
    i64::try_from(at.unix_timestamp_nanos() / 1000).unwrap_or(i64::MAX)
}

fn duration_us(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// Advisory locks in the connected database: (granted, waiting), all keys or one.
async fn advisory_locks(client: &Client, key: Option<i64>) -> anyhow::Result<(i64, i64)> {
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE granted), count(*) FILTER (WHERE NOT granted)
               FROM pg_locks
              WHERE locktype = 'advisory'
                AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND ($1::bigint IS NULL
                     OR (objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = $1))",
            &[&key],
        )
        .await?;
    Ok((row.try_get(0)?, row.try_get(1)?))
}

/// Polls every 50 ms, at most `limit`, until `probe` says yes; whether it did.
async fn eventually<F, Fut>(limit: Duration, mut probe: F) -> anyhow::Result<bool>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if probe().await? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Commits a fresh mark under the fence of `lease` on a transaction of `pool`: check the
/// fence, write, commit (a refused fence rolls back). `None` if it did not end in time.
async fn fenced_commit(
    locker: &PgStreamLocker,
    pool: impl Into<TxPool>,
    lease: &LeaseId,
) -> (Uuid, Option<lockstep_core::Result<()>>) {
    let mark = Uuid::new_v4();
    let commit = async {
        match pool.into() {
            TxPool::TokioPostgres(pool) => {
                let tx = PgTransaction::begin_within(&pool, STEP_LIMIT).await?;
                fenced_write(locker, tx, lease, mark).await
            }
            TxPool::Sqlx(db) => fenced_write(locker, db.begin().await?, lease, mark).await,
        }
    };
    (mark, tokio::time::timeout(STEP_LIMIT, commit).await.ok())
}

/// Where a fenced commit begins its transaction: a deadpool pool or an sqlx database.
#[derive(Clone)]
enum TxPool {
    TokioPostgres(Pool),
    Sqlx(SqlxDatabase),
}

impl From<&Pool> for TxPool {
    fn from(pool: &Pool) -> TxPool {
        TxPool::TokioPostgres(pool.clone())
    }
}

impl From<&TxPool> for TxPool {
    fn from(pool: &TxPool) -> TxPool {
        pool.clone()
    }
}

/// [`fenced_commit`] in `tx`, on either driver: check the fence, write `mark`, commit.
async fn fenced_write<T>(
    locker: &PgStreamLocker,
    tx: T,
    lease: &LeaseId,
    mark: Uuid,
) -> lockstep_core::Result<()>
where
    T: lockstep_core::Transaction + Executor,
    PgStreamLocker: LeaseFence<T>,
{
    if let Err(e) = locker.check_lease(&tx, lease).await {
        let _ = tx.rollback().await;
        return Err(e);
    }
    tx.query(
        "INSERT INTO faults_marks (mark, stream_id, holder, epoch) VALUES ($1, $2, $3, $4)",
        &[
            &mark,
            &lease.stream_id.as_uuid(),
            &lease.holder.as_uuid(),
            &lease.epoch.get(),
        ],
    )
    .await
    .map_err(|e| lockstep_pg::internal::db_statement_error(e, "writing a mark"))?;
    tx.commit().await
}

async fn mark_count(client: &Client, mark: Uuid) -> anyhow::Result<i64> {
    let row = client
        .query_one(
            "SELECT count(*) FROM faults_marks WHERE mark = $1",
            &[&mark],
        )
        .await?;
    Ok(row.try_get(0)?)
}

/// A fenced commit by the holder of a live lease: it commits and its write is stored once.
/// Returns the mark (for a later "nothing lost" check) when it committed.
async fn expect_fenced_ok(
    tally: &mut Tally,
    what: &str,
    locker: &PgStreamLocker,
    pool: impl Into<TxPool>,
    client: &Client,
    lease: &LeaseId,
) -> anyhow::Result<Option<Uuid>> {
    let (mark, outcome) = fenced_commit(locker, pool, lease).await;
    let committed = match outcome {
        Some(Ok(())) => check(tally, true, String::new),
        Some(Err(e)) => check(tally, false, || {
            format!("{what}: the holder's fenced commit failed: {e}")
        }),
        None => check(tally, false, || {
            format!("{what}: the holder's fenced commit hung")
        }),
    };
    let stored = mark_count(client, mark).await?;
    tally.cases += 1;
    match (committed, stored) {
        (true, 1) | (false, 0) => {}
        (true, 0) => tally.lost(format!("{what}: an acknowledged fenced write is missing")),
        (_, n) => tally.duplicated(format!("{what}: a fenced write is stored {n} times")),
    }
    Ok(committed.then_some(mark))
}

/// A fenced commit by a holder whose lease is gone: refused with `LeaseLost`, nothing written.
async fn expect_fenced_refused(
    tally: &mut Tally,
    what: &str,
    locker: &PgStreamLocker,
    pool: impl Into<TxPool>,
    client: &Client,
    lease: &LeaseId,
) -> anyhow::Result<()> {
    let (mark, outcome) = fenced_commit(locker, pool, lease).await;
    let ended = match outcome {
        Some(result) => Ended::Returned(result),
        None => Ended::Hung(STEP_LIMIT),
    };
    expect_failure(tally, what, ended, |k| k == ErrorKind::LeaseLost);
    let stored = mark_count(client, mark).await?;
    check(tally, stored == 0, || {
        format!(
            "{what}: a refused fenced commit wrote anyway ({stored} rows): a fenced write by a non-holder"
        )
    });
    Ok(())
}

/// A try-acquire by a second instance; a busy row and transient (retryable) errors are retried
/// a few times, anything else is a violation (`None`). Never returns `Busy`.
async fn try_acquire_as(
    tally: &mut Tally,
    what: &str,
    locker: &PgStreamLocker,
    stream: StreamId,
    instance: InstanceId,
) -> anyhow::Result<Option<AcquireOutcome>> {
    let perspective = perspective()?;
    for _ in 0..20 {
        let attempt = tokio::time::timeout(
            STEP_LIMIT,
            locker.try_acquire(stream, &perspective, instance, &LockReason::Rewind),
        )
        .await;
        match attempt {
            // The row is in use by another transaction right now: like a transient error.
            Ok(Ok(AcquireOutcome::Busy)) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(Ok(outcome)) => return Ok(Some(outcome)),
            Ok(Err(e)) if e.is_retryable() => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(Err(e)) => {
                check(tally, false, || format!("{what}: try-acquire failed: {e}"));
                return Ok(None);
            }
            Err(_) => {
                check(tally, false, || format!("{what}: try-acquire hung"));
                return Ok(None);
            }
        }
    }
    check(tally, false, || {
        format!("{what}: try-acquire kept answering busy or failing with retryable errors")
    });
    Ok(None)
}

/// Releases a lease, tolerating nothing but typed errors (logged as violations).
async fn release(tally: &mut Tally, what: &str, locker: &PgStreamLocker, lease: &LeaseId) {
    if let Ok(Err(e)) | Err(e) = tokio::time::timeout(STEP_LIMIT, locker.release(lease))
        .await
        .map_err(|_| Error::new(ErrorKind::Backend, "release hung"))
    {
        check(tally, false, || format!("{what}: release failed: {e}"));
    }
}

/// Runs a unit of work on `pool` until it succeeds (retryable failures are what a pool coming
/// back from a fault may report first); one case: it worked within [`RECOVERY_LIMIT`].
async fn expect_recovery<F, Fut>(tally: &mut Tally, what: &str, mut work: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = lockstep_core::Result<()>>,
{
    let deadline = Instant::now() + RECOVERY_LIMIT;
    let mut last;
    loop {
        match tokio::time::timeout(STEP_LIMIT, work()).await {
            Ok(Ok(())) => return check(tally, true, String::new),
            Ok(Err(e)) if lost_connection(e.kind()) => last = e.to_string(),
            Ok(Err(e)) => {
                return check(tally, false, || {
                    format!("{what}: failed with the wrong kind {:?}: {e}", e.kind())
                });
            }
            Err(_) => last = "hung".to_owned(),
        }
        if Instant::now() >= deadline {
            return check(tally, false, || {
                format!("{what}: the pool did not recover within {RECOVERY_LIMIT:?}: {last}")
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Checks that no advisory lock is left in the database and no live lease on `streams`.
async fn expect_nothing_left(
    tally: &mut Tally,
    what: &str,
    client: &Client,
    streams: &[StreamId],
) -> anyhow::Result<()> {
    // A server notices a dropped connection a moment later: poll.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut locks = advisory_locks(client, None).await?;
    while locks != (0, 0) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        locks = advisory_locks(client, None).await?;
    }
    let clear = locks == (0, 0);
    check(tally, clear, || {
        format!("{what}: advisory locks left behind (granted, waiting) = {locks:?}")
    });
    let ids: Vec<Uuid> = streams.iter().map(|s| s.as_uuid()).collect();
    let live: i64 = client
        .query_one(
            "SELECT count(*) FROM wh_perspective_cursors
              WHERE stream_id = ANY($1) AND stream_lock_instance_id IS NOT NULL
                AND stream_lock_expiry > clock_timestamp()",
            &[&ids],
        )
        .await?
        .try_get(0)?;
    check(tally, live == 0, || {
        format!("{what}: {live} live lease(s) left behind after every holder released")
    });
    Ok(())
}

/// A waiter's unit of work: begin, wait for the lock, commit. Across a fault it must fail.
async fn wait_then_commit<F, Fut>(pool: &Pool, wait: F) -> lockstep_core::Result<()>
where
    F: FnOnce(Arc<PgTransaction>) -> Fut,
    Fut: std::future::Future<Output = lockstep_core::Result<()>>,
{
    let tx = Arc::new(PgTransaction::begin_within(pool, STEP_LIMIT).await?);
    let waited = wait(Arc::clone(&tx)).await;
    let Ok(tx) = Arc::try_unwrap(tx) else {
        return Err(Error::new(ErrorKind::Backend, "transaction still shared"));
    };
    match waited {
        Ok(()) => tx.commit().await,
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

fn aggregate_key(id: Uuid) -> anyhow::Result<ResourceKey> {
    Ok(DistributedAggregateWriteLock::<()>::resource_key(
        AGGREGATE, id,
    )?)
}

fn fresh_key() -> anyhow::Result<ResourceKey> {
    Ok(ResourceKey::new(format!("faults:{}", Uuid::new_v4()))?)
}

// ---------------------------------------------------------------------------------------------
// 1. PostgreSQL restart
// ---------------------------------------------------------------------------------------------

pub mod restart {
    //! Part 1: a PostgreSQL restart on a private server while leases are held and advisory
    //! waits are blocked (see the module above).

    use super::*;

    /// Lock timeout of the restart rounds: long enough to outlive a quick restart.
    const LOCK_TIMEOUT: Duration = Duration::from_secs(2);
    const KEEPALIVE: Duration = Duration::from_millis(400);

    struct Rig {
        server: PrivateServer,
        config: Config,
        keeper_pool: Pool,
        other_pool: Pool,
        lock_pool: Pool,
        locker_a: PgStreamLocker,
        locker_b: PgStreamLocker,
        lock: PgDistributedLock,
    }

    /// Runs the restart rounds of `scale` (see the module docs for a server that cannot be
    /// started).
    pub async fn run(scale: Scale, tally: &mut Tally) -> anyhow::Result<()> {
        let server = match PrivateServer::start().await {
            Ok(server) => server,
            Err(e) => {
                let reason = format!(
                    "PostgreSQL restart faults not run: no private server could be started: \
                     {e:#}"
                );
                match scale {
                    Scale::Short => eprintln!("faults: skipped — {reason}"),
                    Scale::Long => {
                        check(tally, false, || reason);
                    }
                }
                return Ok(());
            }
        };
        let rig = rig(server).await?;
        let rounds: Vec<(StopMode, bool)> = match scale {
            Scale::Short => vec![(StopMode::Fast, false), (StopMode::Immediate, true)],
            Scale::Long => (0..20)
                .map(|i| {
                    let mode = if i % 2 == 0 {
                        StopMode::Fast
                    } else {
                        StopMode::Immediate
                    };
                    (mode, i % 3 == 2)
                })
                .collect(),
        };
        let mut rig = rig;
        for (round, (mode, long_down)) in rounds.into_iter().enumerate() {
            round_with(&mut rig, tally, round, mode, long_down)
                .await
                .with_context(|| format!("restart round {round} ({mode:?})"))?;
        }
        Ok(())
    }

    async fn rig(server: PrivateServer) -> anyhow::Result<Rig> {
        let admin = connect(&server.config()).await?;
        admin.batch_execute("CREATE DATABASE faults").await?;
        drop(admin);
        let mut config = server.config();
        config.dbname("faults");
        let options = StreamLockOptions::new(LOCK_TIMEOUT, KEEPALIVE)?;
        let keeper_pool = pool(&config, "faults-keeper", 4)?;
        let other_pool = pool(&config, "faults-other", 4)?;
        let lock_pool = pool(&config, "faults-locks", 8)?;
        prepare_schema(&keeper_pool).await?;
        Ok(Rig {
            locker_a: PgStreamLocker::from_pool(keeper_pool.clone(), options),
            locker_b: PgStreamLocker::from_pool(other_pool.clone(), options),
            lock: PgDistributedLock::from_pool(lock_pool.clone()),
            server,
            config,
            keeper_pool,
            other_pool,
            lock_pool,
        })
    }

    async fn round_with(
        rig: &mut Rig,
        tally: &mut Tally,
        round: usize,
        mode: StopMode,
        long_down: bool,
    ) -> anyhow::Result<()> {
        let at = format!("restart {round} ({mode:?}, down {long_down})");
        let perspective = perspective()?;
        let admin = connect(&rig.config).await?;
        let streams = new_cursors(&admin, 4).await?;
        let (kept, raw_stream) = (&streams[..3], streams[3]);

        // Leases kept alive by a keeper, and one held without keepalive.
        let keeper = LeaseKeeper::start(Arc::new(rig.locker_a.clone()), InstanceId::random());
        let a = keeper.instance();
        let mut held: Vec<HeldLease> = Vec::new();
        for stream in kept {
            match keeper
                .try_acquire(*stream, &perspective, &LockReason::Rewind)
                .await?
            {
                Leased::Acquired(lease) => held.push(lease),
                other => bail!("setup: a fresh cursor was not leased: {other:?}"),
            }
        }
        let raw = match rig
            .locker_a
            .try_acquire(raw_stream, &perspective, a, &LockReason::Bootstrap)
            .await?
        {
            AcquireOutcome::Acquired(lease) => lease,
            other => bail!("setup: a fresh cursor was not leased: {other:?}"),
        };
        let acknowledged = expect_fenced_ok(
            tally,
            &format!("{at}: before the restart"),
            &rig.locker_a,
            &rig.keeper_pool,
            &admin,
            &raw.id,
        )
        .await?;

        // Advisory holders, and waiters blocked behind them.
        let key = fresh_key()?;
        let aggregate = Uuid::new_v4();
        let aggregate_lock = rig.lock.aggregate_write_lock();
        let holder = PgTransaction::begin(&rig.lock_pool).await?;
        rig.lock
            .acquire_for_transaction(&holder, &key, None)
            .await?;
        let aggregate_holder = PgTransaction::begin(&rig.lock_pool).await?;
        aggregate_lock
            .acquire(&aggregate_holder, AGGREGATE, aggregate)
            .await?;
        let mut waiters: Vec<(&str, JoinHandle<lockstep_core::Result<()>>)> = Vec::new();
        for name in [
            "distributed-lock waiter",
            "distributed-lock waiter queued in process",
        ] {
            let (pool, lock, key) = (rig.lock_pool.clone(), rig.lock.clone(), key.clone());
            waiters.push((
                name,
                tokio::spawn(async move {
                    wait_then_commit(&pool, move |tx| async move {
                        lock.acquire_for_transaction(&*tx, &key, None).await
                    })
                    .await
                }),
            ));
        }
        let (pool, lock) = (rig.lock_pool.clone(), aggregate_lock.clone());
        waiters.push((
            "aggregate-lock waiter",
            tokio::spawn(async move {
                wait_then_commit(&pool, move |tx| async move {
                    lock.acquire(&*tx, AGGREGATE, aggregate).await
                })
                .await
            }),
        ));
        let blocked = eventually(STEP_LIMIT, || async {
            Ok(advisory_locks(&admin, None).await?.1 >= 2)
        })
        .await?;
        if !blocked {
            bail!("setup: the waiters never blocked at the server");
        }
        drop(admin);

        // The fault.
        let downtime = if long_down {
            LOCK_TIMEOUT + Duration::from_millis(500)
        } else {
            Duration::ZERO
        };
        rig.server.restart(mode, downtime).await?;
        let admin = connect(&rig.config).await?;

        for (name, waiter) in waiters {
            let ended = bounded(END_LIMIT, waiter).await;
            expect_failure(tally, &format!("{at}: {name}"), ended, lost_connection);
        }
        for (name, tx) in [
            ("distributed-lock holder's commit", holder),
            ("aggregate-lock holder's commit", aggregate_holder),
        ] {
            let ended = bounded(END_LIMIT, tokio::spawn(tx.commit())).await;
            expect_failure(tally, &format!("{at}: {name}"), ended, |k| {
                k == ErrorKind::ConnectionLost || k == ErrorKind::CommitUnknown
            });
        }
        expect_recovery(tally, &format!("{at}: lock pool"), || async {
            let tx = PgTransaction::begin_within(&rig.lock_pool, STEP_LIMIT).await?;
            let free = rig.lock.try_acquire_for_transaction(&tx, &key).await?
                && aggregate_lock
                    .try_acquire(&tx, AGGREGATE, aggregate)
                    .await?;
            tx.commit().await?;
            if free {
                Ok(())
            } else {
                Err(Error::new(
                    ErrorKind::Backend,
                    "a lock held before the restart is still held",
                ))
            }
        })
        .await;

        // The keeper's leases: held on the database whenever the keeper says so.
        tokio::time::sleep(KEEPALIVE * 2).await;
        let other = InstanceId::random();
        for (i, lease) in held.iter().enumerate() {
            let what = format!("{at}: keeper lease {i}");
            let lost = lease.lost().is_cancelled();
            if long_down {
                check(tally, lost, || {
                    format!(
                        "{what}: the server was down longer than the lock timeout and the \
                         lost signal has not fired"
                    )
                });
            }
            let row = lease_row(&admin, lease.id().stream_id).await?;
            if !lost {
                check(
                    tally,
                    row.holder == Some(a.as_uuid())
                        && row.epoch == lease.id().epoch.get()
                        && row.live,
                    || {
                        format!(
                            "{what}: the keeper believes it holds the lease but the row says \
                             {row:?}"
                        )
                    },
                );
            }
            let Some(outcome) =
                try_acquire_as(tally, &what, &rig.locker_b, lease.id().stream_id, other).await?
            else {
                continue;
            };
            match outcome {
                AcquireOutcome::Acquired(taken) => {
                    check(tally, lease.lost().is_cancelled(), || {
                        format!(
                            "{what}: another instance took the lease over while its keeper's \
                             lost signal had not fired"
                        )
                    });
                    expect_fenced_refused(
                        tally,
                        &format!("{what}: fenced commit after the takeover"),
                        &rig.locker_a,
                        &rig.keeper_pool,
                        &admin,
                        lease.id(),
                    )
                    .await?;
                    release(tally, &what, &rig.locker_b, &taken.id).await;
                }
                AcquireOutcome::Denied(by) => {
                    check(tally, by.instance == a, || {
                        format!("{what}: denied by {:?}, not by the keeper's instance", by)
                    });
                    if i == 0 && !lease.lost().is_cancelled() {
                        expect_fenced_ok(
                            tally,
                            &format!("{what}: fenced commit of the kept lease"),
                            &rig.locker_a,
                            &rig.keeper_pool,
                            &admin,
                            lease.id(),
                        )
                        .await?;
                    }
                }
                AcquireOutcome::NoCursor => {
                    check(tally, false, || format!("{what}: the cursor row is gone"));
                }
                AcquireOutcome::Busy => {
                    check(tally, false, || format!("{what}: busy after retries"));
                }
            }
        }
        expect_recovery(tally, &format!("{at}: locker pool"), || async {
            let fresh = StreamId::new_v7();
            // NoCursor is a full round trip through the pool: enough to show it works.
            rig.locker_a
                .try_acquire(fresh, &perspective, a, &LockReason::Rewind)
                .await
                .map(drop)
        })
        .await;

        // The lease held without keepalive: still its holder's until expiry, then taken over.
        raw_takeover(tally, rig, &admin, &at, &raw.id, micros(raw.expires_at)).await?;

        if let Some(mark) = acknowledged {
            let stored = mark_count(&admin, mark).await?;
            tally.cases += 1;
            if stored != 1 {
                tally.lost(format!(
                    "{at}: a fenced write acknowledged before the restart is stored {stored} times"
                ));
            }
        }
        for lease in held {
            // A lease lost meanwhile is NotHeld: fine. Errors must still be typed.
            if let Ok(Err(e)) | Err(e) = tokio::time::timeout(STEP_LIMIT, lease.release())
                .await
                .map_err(|_| Error::new(ErrorKind::Backend, "release hung"))
            {
                check(tally, lost_connection(e.kind()), || {
                    format!("{at}: releasing a keeper lease: {e}")
                });
            }
        }
        let _ = keeper.shutdown().await;
        expect_nothing_left(tally, &at, &admin, &streams).await?;
        Ok(())
    }

    /// After the restart the row still names `raw`'s holder until its expiry: a second
    /// instance is denied (the holder's fenced commit still works) until the database clock
    /// passes the expiry, then takes over with a higher epoch, and the old holder's fenced
    /// commit is refused.
    async fn raw_takeover(
        tally: &mut Tally,
        rig: &Rig,
        admin: &Client,
        at: &str,
        raw: &LeaseId,
        expiry_us: i64,
    ) -> anyhow::Result<()> {
        let what = format!("{at}: lease without keepalive");
        let other = InstanceId::random();
        let deadline = Instant::now() + LOCK_TIMEOUT + Duration::from_secs(5);
        let mut denials_ok = true;
        let mut checked_commit = false;
        loop {
            let now_us = db_now_us(admin).await?;
            let Some(outcome) =
                try_acquire_as(tally, &what, &rig.locker_b, raw.stream_id, other).await?
            else {
                return Ok(());
            };
            match outcome {
                AcquireOutcome::Denied(by) => {
                    denials_ok &= by.instance == raw.holder && by.epoch == raw.epoch;
                    // Only well before the expiry: near it a refusal would be legitimate.
                    if !checked_commit && now_us < expiry_us.saturating_sub(700_000) {
                        checked_commit = true;
                        expect_fenced_ok(
                            tally,
                            &format!("{what}: fenced commit before the expiry"),
                            &rig.locker_a,
                            &rig.keeper_pool,
                            admin,
                            raw,
                        )
                        .await?;
                    }
                }
                AcquireOutcome::Acquired(taken) => {
                    check(tally, denials_ok, || {
                        format!("{what}: a denial named someone other than the holder")
                    });
                    let granted_at = micros(taken.expires_at)
                        .saturating_sub(duration_us(rig.locker_b.options().lock_timeout()));
                    check(tally, granted_at >= expiry_us, || {
                        format!(
                            "{what}: taken over {} µs before the holder's expiry: two holders",
                            expiry_us.saturating_sub(granted_at)
                        )
                    });
                    check(tally, taken.id.epoch.get() > raw.epoch.get(), || {
                        format!(
                            "{what}: the takeover kept epoch {} (holder's {})",
                            taken.id.epoch.get(),
                            raw.epoch.get()
                        )
                    });
                    expect_fenced_refused(
                        tally,
                        &format!("{what}: old holder's fenced commit after the takeover"),
                        &rig.locker_a,
                        &rig.keeper_pool,
                        admin,
                        raw,
                    )
                    .await?;
                    expect_fenced_ok(
                        tally,
                        &format!("{what}: new holder's fenced commit"),
                        &rig.locker_b,
                        &rig.other_pool,
                        admin,
                        &taken.id,
                    )
                    .await?;
                    release(tally, &what, &rig.locker_b, &taken.id).await;
                    return Ok(());
                }
                AcquireOutcome::NoCursor => {
                    check(tally, false, || format!("{what}: the cursor row is gone"));
                    return Ok(());
                }
                AcquireOutcome::Busy => {
                    check(tally, false, || format!("{what}: busy after retries"));
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                check(tally, false, || {
                    format!("{what}: never taken over although it expired")
                });
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. pg_terminate_backend
// ---------------------------------------------------------------------------------------------

/// Part 2: `pg_terminate_backend` of the keepalive's connection and of a lock holder's.
async fn terminate(scale: Scale, tally: &mut Tally) -> anyhow::Result<()> {
    let db = lockstep_testkit::pg_harness::test_database().await;
    let config = db.config().clone();
    let rounds = match scale {
        Scale::Short => 2,
        Scale::Long => 20,
    };
    let options = StreamLockOptions::new(Duration::from_secs(2), Duration::from_millis(400))?;
    let keeper_pool = pool(&config, "faults-keepalive", 2)?;
    let other_pool = pool(&config, "faults-other", 4)?;
    prepare_schema(&other_pool).await?;
    let locker_k = PgStreamLocker::from_pool(keeper_pool.clone(), options);
    let locker_b = PgStreamLocker::from_pool(other_pool.clone(), options);
    let admin = connect(&config).await?;
    for round in 0..rounds {
        let at = format!("terminate keepalive {round}");
        let stream = new_cursors(&admin, 1).await?[0];
        let keeper = LeaseKeeper::start(Arc::new(locker_k.clone()), InstanceId::random());
        let lease = match keeper
            .try_acquire(stream, &perspective()?, &LockReason::Rewind)
            .await?
        {
            Leased::Acquired(lease) => lease,
            other => bail!("setup: a fresh cursor was not leased: {other:?}"),
        };
        // Let a renew go through, so the pool holds the keepalive's connection.
        let renewed = eventually(STEP_LIMIT, || async { Ok(keeper.renew_calls() >= 1) }).await?;
        if !renewed {
            bail!("setup: the keeper never renewed");
        }
        let before = lease_row(&admin, stream).await?;
        let terminated: i64 = admin
            .query_one(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
                  WHERE datname = current_database() AND application_name = 'faults-keepalive'",
                &[],
            )
            .await?
            .try_get(0)?;
        check(tally, terminated >= 1, || {
            format!("{at}: no keepalive connection to terminate (the fault was not injected)")
        });
        let other = InstanceId::random();
        let denied = |outcome: &Option<AcquireOutcome>| matches!(outcome, Some(AcquireOutcome::Denied(by)) if by.instance == lease.id().holder);
        let first = try_acquire_as(tally, &at, &locker_b, stream, other).await?;
        check(tally, denied(&first), || {
            format!("{at}: a second instance was not denied right after the fault: {first:?}")
        });
        let calls = keeper.renew_calls();
        let kept_renewing = eventually(STEP_LIMIT, || async {
            Ok(keeper.renew_calls() >= calls + 3)
        })
        .await?;
        check(tally, kept_renewing, || {
            format!("{at}: the keepalive stopped renewing")
        });
        check(tally, !lease.lost().is_cancelled(), || {
            format!(
                "{at}: one terminated connection made the keeper give up a lease it could renew \
                 on a new connection"
            )
        });
        let after = lease_row(&admin, stream).await?;
        check(
            tally,
            after.live
                && after.holder == Some(lease.id().holder.as_uuid())
                && after.epoch == lease.id().epoch.get()
                && after.expiry_us > before.expiry_us,
            || format!("{at}: the lease was not renewed after the fault: {before:?} → {after:?}"),
        );
        let second = try_acquire_as(tally, &at, &locker_b, stream, other).await?;
        check(tally, denied(&second), || {
            format!("{at}: a second instance was not denied after the renewals: {second:?}")
        });
        expect_fenced_ok(tally, &at, &locker_k, &keeper_pool, &admin, lease.id()).await?;
        let released = tokio::time::timeout(STEP_LIMIT, lease.release()).await;
        check(
            tally,
            matches!(released, Ok(Ok(ReleaseOutcome::Released))),
            || format!("{at}: the holder's release after the fault: {released:?}"),
        );
        let _ = keeper.shutdown().await;
        expect_nothing_left(tally, &at, &admin, &[stream]).await?;
    }
    for round in 0..rounds {
        terminate_holder(tally, &config, &admin, round, round % 2 == 1).await?;
    }
    Ok(())
}

/// One round of `pg_terminate_backend` of an advisory-lock holder with a waiter behind it (the
/// aggregate write lock when `aggregate`, else the distributed lock).
async fn terminate_holder(
    tally: &mut Tally,
    config: &Config,
    admin: &Client,
    round: usize,
    aggregate: bool,
) -> anyhow::Result<()> {
    let at = format!(
        "terminate {} holder {round}",
        if aggregate { "aggregate-lock" } else { "lock" }
    );
    // Separate pools and locks: the waiter waits at the server, not in the holder's queue.
    let holder_pool = pool(config, "faults-holder", 1)?;
    let waiter_pool = pool(config, "faults-waiter", 1)?;
    let lock_h = PgDistributedLock::from_pool(holder_pool.clone());
    let lock_w = PgDistributedLock::from_pool(waiter_pool.clone());
    let id = Uuid::new_v4();
    let key = if aggregate {
        aggregate_key(id)?
    } else {
        fresh_key()?
    };
    let holder = PgTransaction::begin(&holder_pool).await?;
    if aggregate {
        lock_h
            .aggregate_write_lock()
            .acquire(&holder, AGGREGATE, id)
            .await?;
    } else {
        lock_h.acquire_for_transaction(&holder, &key, None).await?;
    }
    let pid: i32 = holder
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .try_get(0)?;
    let holder_mark = Uuid::new_v4();
    holder
        .client()
        .execute(
            "INSERT INTO faults_marks (mark, stream_id, holder, epoch) VALUES ($1, $1, $1, 0)",
            &[&holder_mark],
        )
        .await?;

    let (wait_key, wait_lock) = (key.clone(), lock_w);
    let waiter: JoinHandle<lockstep_core::Result<PgTransaction>> = tokio::spawn(async move {
        let tx = PgTransaction::begin_within(&waiter_pool, STEP_LIMIT).await?;
        let waited = if aggregate {
            wait_lock
                .aggregate_write_lock()
                .with_timeout(END_LIMIT)
                .acquire(&tx, AGGREGATE, id)
                .await
        } else {
            wait_lock
                .acquire_for_transaction(&tx, &wait_key, Some(END_LIMIT))
                .await
        };
        waited.map(|()| tx)
    });
    let advisory = key.advisory_key();
    let blocked = eventually(STEP_LIMIT, || async {
        Ok(advisory_locks(admin, Some(advisory)).await? == (1, 1))
    })
    .await?;
    if !blocked {
        bail!("setup: the waiter never blocked behind the holder");
    }
    check(tally, !waiter.is_finished(), || {
        format!("{at}: the waiter ended while the holder held the lock")
    });

    let terminated: bool = admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await?
        .try_get(0)?;
    check(tally, terminated, || {
        format!("{at}: the holder's backend could not be terminated")
    });

    match bounded(END_LIMIT, waiter).await {
        Ended::Returned(Ok(tx)) => {
            check(tally, true, String::new);
            let locks = advisory_locks(admin, Some(advisory)).await?;
            check(tally, locks == (1, 0), || {
                format!("{at}: after the holder died, (granted, waiting) = {locks:?}, want (1, 0)")
            });
            // The holder's transaction is gone: its next lock call and its commit fail typed.
            let other_key = fresh_key()?;
            let next = bounded(
                END_LIMIT,
                tokio::spawn(async move {
                    let call = lock_h
                        .try_acquire_for_transaction(&holder, &other_key)
                        .await;
                    (call, holder.commit().await)
                }),
            )
            .await;
            let (call, commit) = match next {
                Ended::Returned((call, commit)) => (Ended::Returned(call), Ended::Returned(commit)),
                Ended::Hung(limit) => (Ended::Hung(limit), Ended::Hung(limit)),
                Ended::Panicked(message) => {
                    (Ended::Panicked(message.clone()), Ended::Panicked(message))
                }
            };
            expect_failure(
                tally,
                &format!("{at}: the dead holder's next lock call"),
                call,
                |k| k == ErrorKind::ConnectionLost,
            );
            expect_failure(
                tally,
                &format!("{at}: the dead holder's commit"),
                commit,
                |k| k == ErrorKind::ConnectionLost || k == ErrorKind::CommitUnknown,
            );
            let waiter_mark = Uuid::new_v4();
            tx.client()
                .execute(
                    "INSERT INTO faults_marks (mark, stream_id, holder, epoch) \
                     VALUES ($1, $1, $1, 1)",
                    &[&waiter_mark],
                )
                .await?;
            let committed = tx.commit().await;
            check(tally, committed.is_ok(), || {
                format!("{at}: the new holder's commit failed: {committed:?}")
            });
            let stored = mark_count(admin, waiter_mark).await?;
            tally.cases += 1;
            if committed.is_ok() && stored != 1 {
                tally.lost(format!(
                    "{at}: the new holder's committed write is stored {stored} times"
                ));
            }
        }
        ended => {
            drop(holder);
            expect_failure(
                tally,
                &format!("{at}: the waiter behind the terminated holder"),
                ended,
                |_| false,
            );
        }
    }
    let dead = mark_count(admin, holder_mark).await?;
    check(tally, dead == 0, || {
        format!("{at}: the terminated holder's uncommitted write is visible")
    });
    expect_recovery(tally, &format!("{at}: holder's pool"), || async {
        let lock = PgDistributedLock::from_pool(holder_pool.clone());
        let tx = PgTransaction::begin_within(&holder_pool, STEP_LIMIT).await?;
        let free = lock.try_acquire_for_transaction(&tx, &key).await?;
        tx.commit().await?;
        if free {
            Ok(())
        } else {
            Err(Error::new(ErrorKind::Backend, "the lock is still held"))
        }
    })
    .await;
    expect_nothing_left(tally, &at, admin, &[]).await
}

// ---------------------------------------------------------------------------------------------
// 3. A keepalive that stalls
// ---------------------------------------------------------------------------------------------

/// How the keepalive is stalled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stall {
    /// Its connections go through a paused [`Relay`].
    Network,
    /// Its pool's only connection is held by someone else.
    PoolExhausted,
}

/// Lock timeout / keepalive pairs of the stall rounds (all valid: keepalive < timeout / 2).
const STALL_OPTIONS: [(u64, u64); 4] = [(1500, 400), (1200, 400), (2200, 400), (1000, 300)];

/// Part 3: a keepalive that stalls, through a paused relay or an exhausted pool.
async fn stall(scale: Scale, tally: &mut Tally, driver: Driver) -> anyhow::Result<()> {
    let db = lockstep_testkit::pg_harness::test_database().await;
    let config = db.config().clone();
    let relay = Relay::start(db.server_address().context("the stall relay")?)
        .await
        .context("starting the stall relay")?;
    let mut via_relay = db.config_through(relay.addr());
    via_relay.connect_timeout(Duration::from_secs(5));
    let other_pool = pool(&config, "faults-other", 4)?;
    prepare_schema(&other_pool).await?;
    let admin = connect(&config).await?;
    // (how, which options, keeper started this long before the acquire, stall this long after)
    let rounds: Vec<(Stall, usize, Duration, Duration)> = match scale {
        Scale::Short => vec![
            (
                Stall::Network,
                0,
                Duration::ZERO,
                Duration::from_millis(900),
            ),
            // The default 3:1 ratio, stalled before the first renew, the acquire half an
            // interval into the keepalive's cycle.
            (
                Stall::PoolExhausted,
                1,
                Duration::from_millis(200),
                Duration::ZERO,
            ),
        ],
        Scale::Long => (0..24)
            .map(|i| {
                let stall = if i % 2 == 0 {
                    Stall::Network
                } else {
                    Stall::PoolExhausted
                };
                let phase = Duration::from_millis(rand::random_range(0..400));
                let settle = Duration::from_millis(rand::random_range(0..1300));
                (stall, (i / 2) % STALL_OPTIONS.len(), phase, settle)
            })
            .collect(),
    };
    // On sqlx, the network stalls: an exhausted pool is a deadpool checkout held elsewhere.
    let rounds = rounds
        .into_iter()
        .filter(|(kind, ..)| driver == Driver::TokioPostgres || *kind == Stall::Network);
    for (round, (kind, which, phase, settle)) in rounds.enumerate() {
        let (timeout_ms, keepalive_ms) = STALL_OPTIONS
            .get(which)
            .copied()
            .unwrap_or(STALL_OPTIONS[0]);
        let options = StreamLockOptions::new(
            Duration::from_millis(timeout_ms),
            Duration::from_millis(keepalive_ms),
        )?;
        let at = format!(
            "stall {round} ({kind:?} on {driver}, lock timeout {timeout_ms} ms, keepalive {keepalive_ms} ms, \
             acquired {} ms after the keeper started, stalled {} ms later)",
            phase.as_millis(),
            settle.as_millis()
        );
        let holder_pool = match (kind, driver) {
            (Stall::Network, Driver::TokioPostgres) => {
                TxPool::TokioPostgres(pool(&via_relay, "faults-stalled", 2)?)
            }
            (Stall::Network, Driver::Sqlx) => {
                TxPool::Sqlx(SqlxDatabase::new(db.sqlx_pool_through(relay.addr(), 2)))
            }
            (Stall::PoolExhausted, _) => TxPool::TokioPostgres(pool(&config, "faults-stalled", 1)?),
        };
        let locker_a = match &holder_pool {
            TxPool::TokioPostgres(pool) => PgStreamLocker::from_pool(pool.clone(), options),
            TxPool::Sqlx(db) => PgStreamLocker::for_sqlx(db, options),
        };
        let rig = StallRig {
            locker_a,
            locker_b: PgStreamLocker::from_pool(other_pool.clone(), options),
            holder_pool,
            other_pool: other_pool.clone(),
            relay: &relay,
        };
        stall_round(tally, &rig, &admin, &at, kind, (phase, settle))
            .await
            .with_context(|| at.clone())?;
    }
    Ok(())
}

struct StallRig<'a> {
    locker_a: PgStreamLocker,
    locker_b: PgStreamLocker,
    holder_pool: TxPool,
    other_pool: Pool,
    relay: &'a Relay,
}

async fn stall_round(
    tally: &mut Tally,
    rig: &StallRig<'_>,
    admin: &Client,
    at: &str,
    kind: Stall,
    (phase, settle): (Duration, Duration),
) -> anyhow::Result<()> {
    let stream = new_cursors(admin, 1).await?[0];
    let keeper = LeaseKeeper::start(Arc::new(rig.locker_a.clone()), InstanceId::random());
    // Where in the keepalive's cycle the lease's local deadline falls.
    tokio::time::sleep(phase).await;
    let lease = match keeper
        .try_acquire(stream, &perspective()?, &LockReason::Rewind)
        .await?
    {
        Leased::Acquired(lease) => lease,
        other => bail!("setup: a fresh cursor was not leased: {other:?}"),
    };
    tokio::time::sleep(settle).await;
    if lease.lost().is_cancelled() {
        bail!("setup: the lease was lost before the stall");
    }
    let token = lease.lost().clone();
    let lost_at = tokio::spawn(async move {
        token.cancelled().await;
        Instant::now()
    });

    // The fault.
    let hog = match kind {
        Stall::Network => {
            rig.relay.pause();
            None
        }
        Stall::PoolExhausted => match &rig.holder_pool {
            TxPool::TokioPostgres(pool) => Some(lockstep_pg::checkout(pool, STEP_LIMIT).await?),
            TxPool::Sqlx(_) => bail!("an exhausted pool is a deadpool pool's"),
        },
    };

    let other = InstanceId::random();
    let timeout = rig.locker_a.options().lock_timeout();
    let deadline = Instant::now() + timeout + Duration::from_secs(5);
    let mut denials_ok = true;
    let mut taken = None;
    while Instant::now() < deadline {
        let sent = Instant::now();
        let Some(outcome) = try_acquire_as(tally, at, &rig.locker_b, stream, other).await? else {
            break;
        };
        match outcome {
            AcquireOutcome::Acquired(lease) => {
                taken = Some((lease, sent));
                break;
            }
            AcquireOutcome::Denied(by) => denials_ok &= by.instance == lease.id().holder,
            AcquireOutcome::NoCursor | AcquireOutcome::Busy => break,
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    check(tally, denials_ok, || {
        format!("{at}: a denial named someone other than the stalled holder")
    });
    let lost = match bounded(timeout.saturating_mul(2), lost_at).await {
        Ended::Returned(at) => Some(at),
        _ => None,
    };
    match &taken {
        Some((_, sent)) => {
            lost_before_takeover(tally, at, lost, *sent);
        }
        None => {
            check(tally, false, || {
                format!("{at}: the stalled holder's lease was never taken over (not stalled?)")
            });
        }
    }

    // The stall ends; the old holder must not commit, nor end its successor's lease.
    match kind {
        Stall::Network => rig.relay.resume(),
        Stall::PoolExhausted => drop(hog),
    }
    if let Some((successor, _)) = taken {
        expect_fenced_refused(
            tally,
            &format!("{at}: stalled holder's fenced commit after the takeover"),
            &rig.locker_a,
            &rig.holder_pool,
            admin,
            lease.id(),
        )
        .await?;
        let released = tokio::time::timeout(STEP_LIMIT, lease.release()).await;
        check(
            tally,
            matches!(released, Ok(Ok(ReleaseOutcome::NotHeld))),
            || format!("{at}: the stalled holder's release after the takeover: {released:?}"),
        );
        let row = lease_row(admin, stream).await?;
        check(
            tally,
            row.live && row.holder == Some(successor.id.holder.as_uuid()),
            || format!("{at}: the successor's lease did not survive the old holder: {row:?}"),
        );
        expect_fenced_ok(
            tally,
            &format!("{at}: successor's fenced commit"),
            &rig.locker_b,
            &rig.other_pool,
            admin,
            &successor.id,
        )
        .await?;
        release(tally, at, &rig.locker_b, &successor.id).await;
    } else {
        drop(lease);
    }
    let _ = keeper.shutdown().await;
    expect_nothing_left(tally, at, admin, &[stream]).await
}

// ---------------------------------------------------------------------------------------------
// 4. A lost COMMIT reply
// ---------------------------------------------------------------------------------------------

/// Part 4: a lost `COMMIT` reply, then the caller's retry with the same events.
async fn lost_commit(scale: Scale, tally: &mut Tally, driver: Driver) -> anyhow::Result<()> {
    let rounds = match scale {
        Scale::Short => 4,
        Scale::Long => 100,
    };
    let db = lockstep_testkit::pg_harness::test_database().await;
    let direct = db.pool(2);
    lockstep_pg::migrate(&direct).await?;
    let observer = db.connect().await;
    let relay = Relay::start(db.server_address().context("the commit relay")?)
        .await
        .context("starting the commit relay")?;
    match driver {
        Driver::TokioPostgres => {
            let relayed = PoolSource(db.pool_through(relay.addr(), 2));
            let store = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
            lost_commit_rounds(rounds, tally, &observer, &relay, relayed, store).await
        }
        Driver::Sqlx => {
            let relayed = SqlxDatabase::new(db.sqlx_pool_through(relay.addr(), 2));
            let store = PgEventStore::for_sqlx(&relayed);
            lost_commit_rounds(rounds, tally, &observer, &relay, relayed, store).await
        }
    }
}

/// Begins [`PgTransaction`]s on a deadpool pool (`PgTransaction::begin`), as part 4 always has.
#[derive(Clone)]
struct PoolSource(Pool);

impl TransactionSource for PoolSource {
    type Tx = PgTransaction;

    async fn begin(&self) -> lockstep_core::Result<PgTransaction> {
        PgTransaction::begin(&self.0).await
    }
}

/// Part 4's rounds on `relayed`, a source whose connections go through `relay`.
async fn lost_commit_rounds<S>(
    rounds: usize,
    tally: &mut Tally,
    observer: &Client,
    relay: &Relay,
    relayed: S,
    store: PgEventStore,
) -> anyhow::Result<()>
where
    S: TransactionSource + Clone + 'static,
    S::Tx: Sync + 'static,
    PgEventStore: EventStore<S::Tx>,
{
    for round in 0..rounds {
        let at_commit = round % 2 == 1;
        let expected = match round % 4 {
            0 | 1 => ExpectedVersion::Any,
            _ => ExpectedVersion::NoStream,
        };
        let what = format!(
            "lost COMMIT reply {round} ({}, {expected:?})",
            if at_commit {
                "append_at_commit"
            } else {
                "append"
            }
        );
        let stream = StreamId::new_v7();
        let events: Vec<NewEvent> = (0..3).map(crate::number_event).collect();

        // The first attempt: the server commits, the reply never arrives.
        let tx = relayed.begin().await?;
        // A unit of work reads before it writes: the load also makes sure the unawaited
        // `BEGIN` (ADR 0024) and its reply are through before the cut is armed. Without it,
        // `BEGIN`, the held-back append and `COMMIT` leave in one burst, the server's replies
        // hit the closed socket, and the server may abort instead of committing — a lost
        // reply all the same (`CommitUnknown`), but not the case this part checks.
        store.load(&tx, stream).await?;
        if at_commit {
            store
                .append_at_commit(&tx, stream, expected, &events)
                .await?;
        } else {
            store.append(&tx, stream, expected, &events).await?;
        }
        // `COMMIT` and its terminating NUL: `BEGIN … READ COMMITTED`, which may still be on its
        // way (it is not waited for, ADR 0024), contains `COMMIT` too but not that.
        relay.cut_after_client_sends(b"COMMIT\0");
        let first = bounded(STEP_LIMIT, tokio::spawn(tx.commit())).await;
        check(
            tally,
            matches!(&first, Ended::Returned(Err(e)) if e.kind() == ErrorKind::CommitUnknown),
            || format!("{what}: the commit returned {first:?}, not CommitUnknown"),
        );

        // The server committed before it saw the connection close: wait until the rows are
        // visible, so the retry below is a replay, not a race with that commit.
        let committed = eventually(STEP_LIMIT, || async {
            Ok(observer
                .query_one(
                    "SELECT count(*) FROM wh_events WHERE stream_id = $1",
                    &[&stream.as_uuid()],
                )
                .await?
                .try_get::<_, i64>(0)?
                == 3)
        })
        .await?;
        check(tally, committed, || {
            format!("{what}: the COMMIT forwarded before the cut did not commit")
        });

        // The caller's retry: same events, same ids, same expected version — a replay.
        let retry = bounded(STEP_LIMIT, {
            let (relayed, store, events) = (relayed.clone(), store.clone(), events.clone());
            tokio::spawn(async move {
                let mut attempt = 0;
                loop {
                    attempt += 1;
                    let outcome: lockstep_core::Result<u64> = async {
                        let tx = relayed.begin().await?;
                        let version = store.append(&tx, stream, expected, &events).await?;
                        tx.commit().await?;
                        lockstep_core::Result::Ok(version)
                    }
                    .await;
                    match outcome {
                        // A connection the cut left in the pool fails once: a new one.
                        Err(e) if e.is_retryable() && attempt < 5 => {}
                        other => return other,
                    }
                }
            })
        })
        .await;
        check(tally, matches!(retry, Ended::Returned(Ok(3))), || {
            format!("{what}: the retry returned {retry:?}, not the replay's version 3")
        });

        let stored: Vec<Uuid> = observer
            .query(
                "SELECT event_id FROM wh_events WHERE stream_id = $1 ORDER BY version",
                &[&stream.as_uuid()],
            )
            .await?
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()?;
        tally.cases += 1;
        for event in &events {
            match stored.iter().filter(|id| **id == event.event_id()).count() {
                1 => {}
                0 => tally.lost(format!("{what}: event {} is not stored", event.event_id())),
                n => tally.duplicated(format!(
                    "{what}: event {} is stored {n} times",
                    event.event_id()
                )),
            }
        }
        let in_order = stored
            .iter()
            .copied()
            .eq(events.iter().map(NewEvent::event_id));
        check(tally, in_order || stored.len() != events.len(), || {
            format!("{what}: the events are stored out of order: {stored:?}")
        });

        expect_recovery(tally, &format!("{what}: the relayed pool"), || {
            let relayed = relayed.clone();
            async move {
                let tx = relayed.begin().await?;
                tx.rollback().await
            }
        })
        .await;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Part 5: a dropped release (issue 19, defect 4)
// ---------------------------------------------------------------------------------------------

/// Rounds of a `HeldLease::release` given up on by its caller (a `timeout` of 0–30 ms around
/// it) while, in most rounds, another transaction holds the cursor row for 0–60 ms so that the
/// release waits: the lease must be released all the same once the row is free (within 3 s),
/// and in every fifth round the keeper's shutdown, started while the release still waits,
/// must wait for it and count it. A lease left set is a violation.
async fn dropped_release(scale: Scale, tally: &mut Tally) -> anyhow::Result<()> {
    use rand::{Rng, SeedableRng};
    let rounds = match scale {
        Scale::Short => 10,
        Scale::Long => 300,
    };
    let db = lockstep_testkit::pg_harness::test_database().await;
    let config = db.config().clone();
    let leases = pool(&config, "faults-dropped-release", 4)?;
    prepare_schema(&leases).await?;
    let admin = connect(&config).await?;
    let mut blocker = connect(&config).await?;
    let options = StreamLockOptions::new(Duration::from_secs(30), Duration::from_secs(10))?;
    let locker = PgStreamLocker::from_pool(leases, options);
    let name = perspective()?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(19);
    let mut keeper = LeaseKeeper::start(Arc::new(locker.clone()), InstanceId::random());
    for round in 0..rounds {
        let what = format!("dropped release {round}");
        let stream = new_cursors(&admin, 1).await?[0];
        let Leased::Acquired(lease) = keeper
            .try_acquire(stream, &name, &LockReason::Rewind)
            .await?
        else {
            bail!("{what}: a fresh cursor's lease was not acquired");
        };
        let block = rng.random_bool(0.8);
        let row = blocker.transaction().await?;
        if block {
            row.execute(
                "SELECT 1 FROM wh_perspective_cursors
                  WHERE stream_id = $1 AND perspective_name = $2 FOR UPDATE",
                &[&stream.as_uuid(), &PERSPECTIVE],
            )
            .await?;
        }
        let give_up = Duration::from_millis(rng.random_range(0..=30));
        let _ = tokio::time::timeout(give_up, lease.release()).await;
        let shut_down = round % 5 == 4;
        let shutdown = shut_down.then(|| {
            let keeper = keeper.clone();
            tokio::spawn(async move { keeper.shutdown().await })
        });
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..=60))).await;
        row.rollback().await?;
        if let Some(shutdown) = shutdown {
            let ended = bounded(END_LIMIT, shutdown).await;
            check(
                tally,
                matches!(ended, Ended::Returned(Ok(n)) if n <= 1),
                || format!("{what}: the shutdown ended with {ended:?}"),
            );
            keeper = LeaseKeeper::start(Arc::new(locker.clone()), InstanceId::random());
        }
        let released = eventually(Duration::from_secs(3), || async {
            Ok(!lease_row(&admin, stream).await?.live)
        })
        .await?;
        check(tally, released, || {
            format!(
                "{what} (row blocked: {block}, given up after {give_up:?}): the lease is still set"
            )
        });
    }
    let _ = keeper.shutdown().await;
    Ok(())
}
