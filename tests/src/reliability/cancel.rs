//! Cancel safety: a dropped future at every await point of every operation.
//!
//! Each operation's future is polled exactly `N` times, with real I/O in between (a short sleep,
//! or a bare yield in the long run), and then dropped, for `N = 1, 2, …` until it completes
//! within `N` polls (with bare yields, `N` is sampled: a few dozen growing drop points per
//! operation, elsewhere in each round). Every `N` is a case, run on a pool of its own whose
//! connections carry an `application_name` naming the case, so the server says what that pool
//! left behind. After each drop:
//!
//! - **no statement keeps running** and no connection of the case's pool sits inside a
//!   transaction (`pg_stat_activity`, once the operation's transaction, if any, has ended);
//! - **no advisory lock is left** in the database (`pg_locks`), and an acquire dropped while it
//!   waited behind a holder is never granted once the holder lets go;
//! - **no ghost lease**: a lease operation took effect entirely or not at all. The one remnant
//!   ADR 0002's addendum allows — a try-acquire the server finished in the instant of the drop —
//!   is a lease for the caller's own instance id, and its next try-acquire must re-enter it
//!   (same epoch, `reentered`); anything else is a violation. A lease operation dropped while it
//!   waited for a row lock — the server showed it waiting (`pg_stat_activity.wait_event_type =
//!   'Lock'`) at the drop — must not have happened once the row lock is released. One dropped
//!   before it reached the server may still run once it arrives, like a call made a moment
//!   later (the contract of `PgStreamLocker`'s cancel safety); it must then have taken effect
//!   entirely;
//! - **no half-appended events**: a stream holds all of an append's events or none;
//! - **the pool still works**: a checkout answers, outside any transaction.
//!
//! The operations: every [`StreamLocker`] op (try-acquire, renew, renew-many, release, also
//! behind a row lock held elsewhere), the [`StreamLockAdmin`] ops, the transaction-scoped
//! advisory lock (try, and a blocking acquire behind a holder), the event store's `append` and
//! `load_locked` (free and behind a holder), and [`PgTransaction`] begin / commit (of a healthy
//! and of a failed transaction) / rollback.
//!
//! The sweeps run on either driver ([`run_on`]): each case's pool is a deadpool pool (the
//! locker from `PgStreamLocker::from_pool`, [`PgTransaction`]s) or an `sqlx::PgPool`
//! (`PgStreamLocker::for_sqlx`, `PgEventStore::for_sqlx`, `SqlxTransaction`s), the same cases
//! and checks. What differs on sqlx, whose dropped operations close their connection but send
//! no cancel request: a lease operation dropped while it waited for a row lock keeps waiting at
//! the server and may run once the row is free, so there it must only have taken effect
//! entirely or not at all, and have ended once the row is free. The advisory-lock cases
//! (`LockTry`, `LockAcquire`, `LoadLocked`) run on tokio-postgres only.
//!
//! [`demonstrate_checks`] runs deliberately broken operations through the same checks: each must
//! be caught (a statement left running, a pooled connection inside a transaction, an advisory
//! lock left, a ghost lease, half an append).

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use anyhow::Context as _;
use deadpool_postgres::Pool;
use lockstep_core::{
    DistributedLock, ErrorKind, EventStore, ExpectedVersion, InstanceId, LeaseId, LockReason,
    PerspectiveName, ResourceKey, StreamId, StreamLockAdmin, StreamLockOptions, StreamLocker,
    Transaction, TransactionSource,
};
use lockstep_pg::driver::Executor;
use lockstep_pg::sqlx::SqlxDatabase;
use lockstep_pg::{LockQueue, PgTransaction};
use lockstep_pg_advisory::PgDistributedLock;
use lockstep_pg_store::PgEventStore;
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};
use tokio::sync::Notify;
use tokio_postgres::Client;
use uuid::Uuid;

use super::{Driver, Scale, Tally};
use crate::number_event;

/// The most polls a sweep tries before it reports an operation that never completes, with 1 ms
/// between polls.
const MAX_POLLS: u32 = 400;

/// The same with bare yields between polls: a round trip takes hundreds to thousands of yields
/// (more on a quiet machine, where a yield is quicker), a new connection several round trips.
const MAX_YIELDS: u32 = 1_000_000;

/// How long the checks wait for the server to settle (a cancel request lands, a discarded
/// connection's backend exits). Far above what either takes; a check that is still failing
/// then is a violation.
const SETTLE: Duration = Duration::from_secs(3);

/// After how many polls a holder lets go in the "behind a holder" sweeps: by then the waiter
/// waits at the server (1 ms between polls), so smaller `N` drop a waiting acquire and larger
/// ones see it granted.
const RELEASE_AFTER_POLLS: u32 = 12;

/// How long an abandoned waiter is given to (wrongly) get a lock or row once its holder let go.
const GHOST_WINDOW: Duration = Duration::from_millis(150);

/// What runs between two polls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gap {
    /// A 1 ms sleep: a round trip on a local server usually completes in one gap, so each `N`
    /// stops at the next await point.
    Sleep,
    /// A bare yield to the runtime: drops land mid-round-trip (long run only).
    Yield,
}

impl Gap {
    async fn wait(self) {
        match self {
            Gap::Sleep => tokio::time::sleep(Duration::from_millis(1)).await,
            Gap::Yield => tokio::task::yield_now().await,
        }
    }
}

/// Polls `fut` at most `n` times (running `gap` between polls and notifying `release`, if any,
/// right after poll `RELEASE_AFTER_POLLS`), then drops it. `Some` if it completed.
async fn poll_n<F: Future>(
    fut: F,
    n: u32,
    gap: Gap,
    release: Option<&Notify>,
) -> (Option<F::Output>, bool) {
    let (outcome, released, _) = poll_n_then(fut, n, gap, release, async || false).await;
    (outcome, released)
}

/// [`poll_n`], asking `before_drop` (what the server shows) just before an unfinished `fut` is
/// dropped; its answer is the third value (`false` when `fut` completed).
async fn poll_n_then<F: Future>(
    fut: F,
    n: u32,
    gap: Gap,
    release: Option<&Notify>,
    before_drop: impl AsyncFnOnce() -> bool,
) -> (Option<F::Output>, bool, bool) {
    let mut fut = Box::pin(fut);
    let mut released = false;
    for i in 1..=n {
        if i > 1 {
            gap.wait().await;
        }
        let polled = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
        if let Poll::Ready(out) = polled {
            return (Some(out), released, false);
        }
        if i == RELEASE_AFTER_POLLS
            && let Some(notify) = release
        {
            notify.notify_one();
            released = true;
        }
    }
    let answer = before_drop().await;
    drop(fut);
    (None, released, answer)
}

/// Every operation under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    TryAcquire,
    Renew,
    RenewMany,
    Release,
    ListLeases,
    Inspect,
    ForceRelease,
    ReleaseAll,
    /// A lease op waiting for a cursor row locked by another transaction.
    RowLocked(LeaseWait),
    LockTry {
        held: bool,
    },
    LockAcquire {
        held: bool,
    },
    LoadLocked {
        held: bool,
    },
    Append,
    Begin,
    Commit,
    CommitFailed,
    Rollback,
}

/// The lease operations that wait for a row lock (try-acquire never does: `NOWAIT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseWait {
    Renew,
    RenewMany,
    Release,
    ForceRelease,
    ReleaseAll,
}

impl LeaseWait {
    fn op(self) -> Op {
        match self {
            LeaseWait::Renew => Op::Renew,
            LeaseWait::RenewMany => Op::RenewMany,
            LeaseWait::Release => Op::Release,
            LeaseWait::ForceRelease => Op::ForceRelease,
            LeaseWait::ReleaseAll => Op::ReleaseAll,
        }
    }
}

const ALL: [Op; 25] = [
    Op::TryAcquire,
    Op::Renew,
    Op::RenewMany,
    Op::Release,
    Op::ListLeases,
    Op::Inspect,
    Op::ForceRelease,
    Op::ReleaseAll,
    Op::RowLocked(LeaseWait::Renew),
    Op::RowLocked(LeaseWait::RenewMany),
    Op::RowLocked(LeaseWait::Release),
    Op::RowLocked(LeaseWait::ForceRelease),
    Op::RowLocked(LeaseWait::ReleaseAll),
    Op::LockTry { held: false },
    Op::LockTry { held: true },
    Op::LockAcquire { held: false },
    Op::LockAcquire { held: true },
    Op::LoadLocked { held: false },
    Op::LoadLocked { held: true },
    Op::Append,
    Op::Begin,
    Op::Commit,
    Op::CommitFailed,
    Op::Rollback,
    // Repeated on purpose: the try-acquire remnant (a lease the server wrote in the instant of
    // the drop) is the one subtle outcome, so it gets a second sweep.
    Op::TryAcquire,
];

impl Op {
    /// Whether the operation runs on `driver` (the advisory-lock cases run on tokio-postgres
    /// only).
    fn runs_on(self, driver: Driver) -> bool {
        driver == Driver::TokioPostgres
            || !matches!(
                self,
                Op::LockTry { .. } | Op::LockAcquire { .. } | Op::LoadLocked { .. }
            )
    }

    fn name(self) -> String {
        match self {
            Op::RowLocked(w) => format!("{}_rowlocked", w.op().name()),
            Op::LockTry { held } => format!("locktry{}", if held { "_held" } else { "" }),
            Op::LockAcquire { held } => format!("lockacq{}", if held { "_held" } else { "" }),
            Op::LoadLocked { held } => format!("loadlocked{}", if held { "_held" } else { "" }),
            other => format!("{other:?}").to_lowercase(),
        }
    }
}

/// What every case shares: the database, a pool for setup and holders, an observer connection.
struct Ctx {
    db: TestDatabase,
    admin: Pool,
    observer: Client,
    /// The setup locker (on the admin pool).
    setup: PgStreamLocker,
    perspective: PerspectiveName,
}

fn options() -> anyhow::Result<StreamLockOptions> {
    Ok(StreamLockOptions::new(
        Duration::from_secs(600),
        Duration::from_secs(60),
    )?)
}

/// Runs every operation's sweep. `Short`: 1 ms gaps, once, every `N`. `Long`: two rounds of
/// 1 ms gaps (every `N`) and four of bare yields, whose drop points are sampled (see
/// `next_drop_point`) so that each round drops at other points and the run stays near ten
/// minutes however fast the machine is (every `N` would be thousands of cases per operation on
/// a quiet machine, where a round trip takes thousands of yields).
pub async fn run(scale: Scale) -> anyhow::Result<Tally> {
    run_on(scale, Driver::TokioPostgres).await
}

/// [`run`] with each case's pool, locker, store and transactions on `driver`.
pub async fn run_on(scale: Scale, driver: Driver) -> anyhow::Result<Tally> {
    let ctx = Arc::new(Ctx::new().await?);
    let sweeps: &[(Gap, u32)] = match scale {
        Scale::Short => &[(Gap::Sleep, 1)],
        Scale::Long => &[(Gap::Sleep, 2), (Gap::Yield, 4)],
    };
    let mut tally = Tally::default();
    for &(gap, rounds) in sweeps {
        for _ in 0..rounds {
            for op in ALL.into_iter().filter(|op| op.runs_on(driver)) {
                let ctx = Arc::clone(&ctx);
                // A task per sweep, so a panic in lockstep code is counted, not fatal.
                match tokio::spawn(async move { sweep(&ctx, op, gap, driver).await }).await {
                    Ok(Ok(t)) => tally.merge(t),
                    Ok(Err(e)) => tally.violation(format!("{} ({gap:?}): {e:#}", op.name())),
                    Err(e) if e.is_panic() => {
                        tally.panic(format!("{} ({gap:?}) panicked: {e}", op.name()));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    Ok(tally)
}

/// The drop point after `n` in a sweep with `gap`: every `N` with 1 ms gaps; with bare yields,
/// every `N` up to 8 (the first await points), then a random step of 1 to `n / 4`, so the
/// points grow by about an eighth each time (a few dozen per operation) and land elsewhere in
/// each round.
fn next_drop_point(n: u32, gap: Gap) -> u32 {
    match gap {
        Gap::Sleep => n + 1,
        Gap::Yield if n < 8 => n + 1,
        Gap::Yield => n.saturating_add(rand::random_range(1..=n / 4)),
    }
}

/// `N = 1, 2, …` (or sampled, see [`next_drop_point`]) for one operation until it completes
/// within `N` polls.
async fn sweep(ctx: &Ctx, op: Op, gap: Gap, driver: Driver) -> anyhow::Result<Tally> {
    let mut tally = Tally::default();
    let max = match gap {
        Gap::Sleep => MAX_POLLS,
        Gap::Yield => MAX_YIELDS,
    };
    let mut n = 0;
    while n < max {
        n = next_drop_point(n, gap);
        let label = format!("{} N={n} ({gap:?})", op.name());
        let pool = ctx.case_pool(&op.name(), n, driver)?;
        let completed = case(ctx, &pool, op, n, gap, &label, &mut tally)
            .await
            .with_context(|| label.clone())?;
        pool.check_works(&label, &mut tally).await;
        pool.close().await;
        tally.cases += 1;
        if completed {
            return Ok(tally);
        }
    }
    tally.violation(format!(
        "{} ({gap:?}): did not complete within {max} polls",
        op.name()
    ));
    Ok(tally)
}

/// One case. Returns whether the operation completed within `n` polls.
async fn case(
    ctx: &Ctx,
    pool: &CasePool,
    op: Op,
    n: u32,
    gap: Gap,
    label: &str,
    tally: &mut Tally,
) -> anyhow::Result<bool> {
    match op {
        Op::TryAcquire
        | Op::Renew
        | Op::RenewMany
        | Op::Release
        | Op::ListLeases
        | Op::Inspect
        | Op::ForceRelease
        | Op::ReleaseAll => lease_case(ctx, pool, op, None, n, gap, label, tally).await,
        Op::RowLocked(wait) => {
            lease_case(ctx, pool, wait.op(), Some(()), n, gap, label, tally).await
        }
        Op::LockTry { held } => {
            let pool = pool.deadpool(op)?;
            lock_try_case(ctx, pool, held, n, gap, label, tally).await
        }
        Op::LockAcquire { held } | Op::LoadLocked { held } => {
            let pool = pool.deadpool(op)?;
            let load = matches!(op, Op::LoadLocked { .. });
            lock_wait_case(ctx, pool, load, held, n, gap, label, tally).await
        }
        Op::Append => match pool {
            CasePool::TokioPostgres(p) => {
                let store = PgEventStore::with_queue(LockQueue::new());
                append_case(
                    ctx,
                    &store,
                    PgTransaction::begin(p).await?,
                    n,
                    gap,
                    label,
                    tally,
                )
                .await
            }
            CasePool::Sqlx(db) => {
                let store = PgEventStore::for_sqlx(db);
                append_case(ctx, &store, db.begin().await?, n, gap, label, tally).await
            }
        },
        Op::Begin => match pool {
            CasePool::TokioPostgres(p) => {
                begin_case(ctx, PgTransaction::begin(p), n, gap, label, tally).await
            }
            CasePool::Sqlx(db) => begin_case(ctx, db.begin(), n, gap, label, tally).await,
        },
        Op::Commit | Op::CommitFailed | Op::Rollback => match pool {
            CasePool::TokioPostgres(p) => {
                let store = PgEventStore::with_queue(LockQueue::new());
                let tx = PgTransaction::begin(p).await?;
                end_case(ctx, &store, tx, op, n, gap, label, tally).await
            }
            CasePool::Sqlx(db) => {
                let store = PgEventStore::for_sqlx(db);
                end_case(ctx, &store, db.begin().await?, op, n, gap, label, tally).await
            }
        },
    }
}

/// A case's pool, on the driver under test; its connections carry the case's
/// `application_name`.
enum CasePool {
    TokioPostgres(Pool),
    Sqlx(SqlxDatabase),
}

impl CasePool {
    /// The stream locker under test, on this pool.
    fn locker(&self) -> anyhow::Result<PgStreamLocker> {
        Ok(match self {
            CasePool::TokioPostgres(pool) => PgStreamLocker::from_pool(pool.clone(), options()?),
            CasePool::Sqlx(db) => PgStreamLocker::for_sqlx(db, options()?),
        })
    }

    /// Whether a dropped statement is cancelled at the server (tokio-postgres sends a cancel
    /// request; sqlx only closes the connection, and a statement waiting for a lock runs on).
    fn cancels_at_the_server(&self) -> bool {
        matches!(self, CasePool::TokioPostgres(_))
    }

    /// The deadpool pool of a case that runs on tokio-postgres only.
    fn deadpool(&self, op: Op) -> anyhow::Result<&Pool> {
        match self {
            CasePool::TokioPostgres(pool) => Ok(pool),
            CasePool::Sqlx(_) => anyhow::bail!("{} runs on tokio-postgres only", op.name()),
        }
    }

    async fn close(&self) {
        match self {
            CasePool::TokioPostgres(pool) => pool.close(),
            CasePool::Sqlx(db) => db.pool().close().await,
        }
    }

    /// The pool serves a checkout, and the connection is outside any transaction (with the
    /// simple query protocol, `now() = statement_timestamp()` only in a statement's own
    /// transaction; an open one started earlier).
    async fn check_works(&self, label: &str, tally: &mut Tally) {
        match self {
            CasePool::TokioPostgres(pool) => check_pool_works(pool, label, tally).await,
            CasePool::Sqlx(db) => {
                let answer = async {
                    let mut conn = db.pool().acquire().await?;
                    let rows = sqlx::Executor::fetch_all(
                        &mut *conn,
                        sqlx::raw_sql("SELECT now() = statement_timestamp()"),
                    )
                    .await?;
                    let row = rows.first().context("no row")?;
                    anyhow::Ok(sqlx::Row::try_get::<bool, _>(row, 0)?)
                };
                pool_answer(
                    tokio::time::timeout(Duration::from_secs(10), answer).await,
                    label,
                    tally,
                );
            }
        }
    }
}

impl Ctx {
    async fn new() -> anyhow::Result<Ctx> {
        let db = test_database().await;
        let admin = named_pool(&db, "lockstep_cancel_admin", 4)?;
        lockstep_pg::migrate(&admin).await?;
        let observer = db.connect().await;
        observer
            .batch_execute("SET application_name = 'lockstep_cancel_observer'")
            .await?;
        let setup = PgStreamLocker::from_pool(admin.clone(), options()?);
        Ok(Ctx {
            db,
            admin,
            observer,
            setup,
            perspective: PerspectiveName::new("CancelModel")?,
        })
    }

    /// A pool of two connections on `driver`, named after the case.
    fn case_pool(&self, op: &str, n: u32, driver: Driver) -> anyhow::Result<CasePool> {
        let app = format!("lockstep_cancel_{op}_{n}");
        Ok(match driver {
            Driver::TokioPostgres => CasePool::TokioPostgres(named_pool(&self.db, &app, 2)?),
            Driver::Sqlx => {
                // The pool connects lazily: no connection exists before its name is set.
                let pool = self.db.sqlx_pool(2);
                let options = (*pool.connect_options()).clone().application_name(&app);
                pool.set_connect_options(options);
                CasePool::Sqlx(SqlxDatabase::new(pool))
            }
        })
    }

    /// Two fresh cursor rows.
    async fn cursors(&self) -> anyhow::Result<[StreamId; 2]> {
        let streams = [StreamId::new_v7(), StreamId::new_v7()];
        for stream in streams {
            self.observer
                .execute(
                    "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) \
                     VALUES ($1, $2)",
                    &[&stream.as_uuid(), &self.perspective.as_str()],
                )
                .await?;
        }
        Ok(streams)
    }

    async fn acquire(&self, stream: StreamId, me: InstanceId) -> anyhow::Result<LeaseId> {
        self.setup
            .try_acquire(stream, &self.perspective, me, &LockReason::Rewind)
            .await?
            .into_lease()
            .map(|l| l.id)
            .context("setup lease not acquired")
    }

    async fn lease_row(&self, stream: StreamId) -> anyhow::Result<LeaseRow> {
        lease_row(&self.observer, stream, &self.perspective).await
    }

    /// Waits until no backend of `app` runs a statement (`active`), and with `idle_only` also
    /// none sits inside a transaction, and no advisory lock is held in the database (when
    /// `no_locks`). Records a violation naming what is left if the server does not settle.
    async fn settle(
        &self,
        app: &str,
        idle_only: bool,
        no_locks: bool,
        label: &str,
        tally: &mut Tally,
    ) {
        let deadline = tokio::time::Instant::now() + SETTLE;
        // Two clean looks in a row: a statement still on its way to the server (a `BEGIN` sent
        // in the instant of the drop) shows only once it arrives.
        let mut clean_looks = 0;
        loop {
            let last = match self.leftovers(app, idle_only, no_locks).await {
                Ok(left) if left.is_empty() => {
                    clean_looks += 1;
                    if clean_looks == 2 {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    continue;
                }
                Ok(left) => left.join("; "),
                Err(e) => format!("checking: {e:#}"),
            };
            clean_looks = 0;
            if tokio::time::Instant::now() >= deadline {
                tally.violation(format!("{label}: left behind after {SETTLE:?}: {last}"));
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn leftovers(
        &self,
        app: &str,
        idle_only: bool,
        no_locks: bool,
    ) -> anyhow::Result<Vec<String>> {
        let mut left = Vec::new();
        let rows = self
            .observer
            .query(
                "SELECT pid, coalesce(state, '?'), left(query, 60) FROM pg_stat_activity \
                  WHERE application_name = $1 AND pid <> pg_backend_pid() \
                    AND (state = 'active' OR ($2 AND state <> 'idle'))",
                &[&app, &idle_only],
            )
            .await?;
        for row in rows {
            let (pid, state, query): (i32, String, String) =
                (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
            left.push(format!("backend {pid} {state}: {query}"));
        }
        if no_locks {
            let rows = self
                .observer
                .query(
                    "SELECT l.pid, coalesce(a.application_name, '?'), l.granted FROM pg_locks l \
                       LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
                      WHERE l.locktype = 'advisory' \
                        AND l.database = (SELECT oid FROM pg_database \
                                           WHERE datname = current_database())",
                    &[],
                )
                .await?;
            for row in rows {
                let (pid, app, granted): (i32, String, bool) =
                    (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
                left.push(format!(
                    "advisory lock of backend {pid} ({app}) granted={granted}"
                ));
            }
        }
        Ok(left)
    }

    /// Whether a backend of the case's pool (`app`) is waiting for a lock or row right now.
    async fn waits_for_lock(&self, app: &str) -> anyhow::Result<bool> {
        let row = self
            .observer
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity \
                  WHERE application_name = $1 AND wait_event_type = 'Lock')",
                &[&app],
            )
            .await?;
        Ok(row.try_get(0)?)
    }

    /// Events of `stream`: how many, and whether their versions are exactly 1..=count.
    async fn events(&self, stream: StreamId) -> anyhow::Result<(i64, bool)> {
        let row = self
            .observer
            .query_one(
                "SELECT count(*), coalesce(min(version), 1) = 1 \
                        AND coalesce(max(version), 0) = count(*) \
                   FROM wh_events WHERE stream_id = $1",
                &[&stream.as_uuid()],
            )
            .await?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }

    /// Advisory locks granted to backend `pid`.
    async fn granted_to(&self, pid: i32) -> anyhow::Result<i64> {
        let row = self
            .observer
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND granted",
                &[&pid],
            )
            .await?;
        Ok(row.try_get(0)?)
    }
}

/// A pool whose connections carry `application_name = app`.
fn named_pool(db: &TestDatabase, app: &str, size: usize) -> anyhow::Result<Pool> {
    let mut config = db.config().clone();
    config.application_name(app);
    let manager = deadpool_postgres::Manager::from_config(
        config,
        tokio_postgres::NoTls,
        deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        },
    );
    Ok(lockstep_pg::pool::bounded_pool(manager, size)?)
}

/// The pool serves a checkout, and the connection is outside any transaction
/// (with the simple query protocol, `now() = statement_timestamp()` only in a statement's own
/// transaction; an open one started earlier).
async fn check_pool_works(pool: &Pool, label: &str, tally: &mut Tally) {
    let answer = async {
        let conn = lockstep_pg::checkout(pool, Duration::from_secs(5)).await?;
        let messages = conn
            .simple_query("SELECT now() = statement_timestamp()")
            .await?;
        let own = messages.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(|v| v == "t"),
            _ => None,
        });
        anyhow::Ok(own.context("no row")?)
    };
    pool_answer(
        tokio::time::timeout(Duration::from_secs(10), answer).await,
        label,
        tally,
    );
}

/// Records what a pool's check answered.
fn pool_answer(
    answer: Result<anyhow::Result<bool>, tokio::time::error::Elapsed>,
    label: &str,
    tally: &mut Tally,
) {
    match answer {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => tally.violation(format!(
            "{label}: the pool handed out a connection inside an open transaction"
        )),
        Ok(Err(e)) => tally.violation(format!("{label}: the pool no longer works: {e:#}")),
        Err(_) => tally.violation(format!("{label}: the pool did not answer within 10 s")),
    }
}

/// A cursor row's lease columns (expiry in microseconds since the epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LeaseRow {
    holder: Option<Uuid>,
    epoch: i64,
    expiry: Option<i64>,
}

async fn lease_row(
    client: &Client,
    stream: StreamId,
    perspective: &PerspectiveName,
) -> anyhow::Result<LeaseRow> {
    let row = client
        .query_one(
            "SELECT stream_lock_instance_id, stream_lock_epoch, \
                    floor(extract(epoch FROM stream_lock_expiry) * 1000000)::bigint \
               FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2",
            &[&stream.as_uuid(), &perspective.as_str()],
        )
        .await?;
    Ok(LeaseRow {
        holder: row.try_get(0)?,
        epoch: row.try_get(1)?,
        expiry: row.try_get(2)?,
    })
}

/// Whether a lease operation took effect on the two rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Effect {
    Untouched,
    Applied,
}

/// What a lease operation may leave: the rows as before, or as after the whole operation
/// (all-or-nothing). Anything else is described as an error.
fn classify(
    op: Op,
    before: [LeaseRow; 2],
    after: [LeaseRow; 2],
    me: Uuid,
) -> Result<Effect, String> {
    if after == before {
        return Ok(Effect::Untouched);
    }
    let unchanged_second = after[1] == before[1];
    let renewed = |b: LeaseRow, a: LeaseRow| {
        a.holder == b.holder && a.epoch == b.epoch && a.expiry > b.expiry
    };
    let released = |b: LeaseRow, a: LeaseRow, epoch_step: i64| {
        a.holder.is_none() && a.expiry.is_none() && a.epoch == b.epoch + epoch_step
    };
    let applied = match op {
        Op::TryAcquire => {
            unchanged_second
                && after[0].holder == Some(me)
                && after[0].epoch == before[0].epoch + 1
                && after[0].expiry.is_some()
        }
        Op::Renew => unchanged_second && renewed(before[0], after[0]),
        Op::RenewMany => renewed(before[0], after[0]) && renewed(before[1], after[1]),
        Op::Release => unchanged_second && released(before[0], after[0], 0),
        Op::ForceRelease => unchanged_second && released(before[0], after[0], 1),
        Op::ReleaseAll => released(before[0], after[0], 0) && released(before[1], after[1], 0),
        _ => false,
    };
    if applied {
        Ok(Effect::Applied)
    } else {
        Err(format!("neither before nor after: {before:?} -> {after:?}"))
    }
}

#[allow(clippy::too_many_arguments)]
async fn lease_case(
    ctx: &Ctx,
    pool: &CasePool,
    op: Op,
    row_locked: Option<()>,
    n: u32,
    gap: Gap,
    label: &str,
    tally: &mut Tally,
) -> anyhow::Result<bool> {
    let me = InstanceId::random();
    let streams = ctx.cursors().await?;
    let mut ids = Vec::new();
    if op != Op::TryAcquire {
        for stream in streams {
            ids.push(ctx.acquire(stream, me).await?);
        }
    }
    let before = [
        ctx.lease_row(streams[0]).await?,
        ctx.lease_row(streams[1]).await?,
    ];
    // A transaction elsewhere holding row 0 (a claim applying events, a fenced commit), let go
    // after RELEASE_AFTER_POLLS polls.
    let release = Arc::new(Notify::new());
    let holder = match row_locked {
        Some(()) => Some(row_holder(ctx, streams[0], Arc::clone(&release)).await?),
        None => None,
    };
    let locker = pool.locker()?;
    let name = &ctx.perspective;
    let fut = async {
        match op {
            Op::TryAcquire => locker
                .try_acquire(streams[0], name, me, &LockReason::Rewind)
                .await
                .map(|_| ()),
            Op::Renew => locker.renew(&ids[0]).await.map(|_| ()),
            Op::RenewMany => locker.renew_many(&ids).await.map(|_| ()),
            Op::Release => locker.release(&ids[0]).await.map(|_| ()),
            Op::ListLeases => locker.list_leases().await.map(|_| ()),
            Op::Inspect => locker.inspect(streams[0], name).await.map(|_| ()),
            Op::ForceRelease => locker.force_release(streams[0], name).await.map(|_| ()),
            Op::ReleaseAll => locker.release_all_held_by(me).await.map(|_| ()),
            _ => Ok(()),
        }
    };
    let app = case_app(op_with_lock(op, row_locked), n);
    // Dropped while it waited means: the server showed the statement waiting for the row at the
    // drop. A drop before that (the statement still on its way, as on a busy machine) may let
    // it run once it arrives, like a call made a moment later — renew, release and the admin
    // operations act only on what the caller still holds — and such a drop is not checked as
    // one that waited.
    let (outcome, released, waited) = poll_n_then(
        fut,
        n,
        gap,
        holder.as_ref().map(|_| &*release),
        async || holder.is_some() && ctx.waits_for_lock(&app).await.unwrap_or(false),
    )
    .await;
    let completed = outcome.is_some();
    if let Some(Err(e)) = &outcome {
        tally.violation(format!("{label}: the operation failed: {e}"));
    }
    // On sqlx a drop sends no cancel request: the statement waits on and may run once the row
    // is free, so only the all-or-nothing checks below apply to it.
    let early = holder.is_some() && !released && waited && pool.cancels_at_the_server();
    if let Some(holder) = holder {
        if early {
            // Dropped while it waited: the wait must end (cancel request) before the row is let
            // go, and the statement must not run once it is.
            ctx.settle(&app, false, false, label, tally).await;
        }
        if !released {
            release.notify_one();
        }
        join_holder(holder, label, tally).await;
        if early {
            tokio::time::sleep(GHOST_WINDOW).await;
        }
    }
    ctx.settle(&app, true, true, label, tally).await;
    let after = [
        ctx.lease_row(streams[0]).await?,
        ctx.lease_row(streams[1]).await?,
    ];
    match classify(op, before, after, me.as_uuid()) {
        Err(what) => tally.violation(format!("{label}: {what}")),
        Ok(effect) => {
            let mutating = !matches!(op, Op::ListLeases | Op::Inspect);
            if completed && mutating && effect != Effect::Applied {
                tally.violation(format!("{label}: completed but took no effect"));
            }
            if early && effect != Effect::Untouched {
                tally.violation(format!(
                    "{label}: dropped while waiting for the row, yet it ran once the row was free"
                ));
            }
            if op == Op::TryAcquire && effect == Effect::Applied && !completed {
                // The remnant the ADR allows: the caller's own instance must re-enter it.
                let again = ctx
                    .setup
                    .try_acquire(streams[0], name, me, &LockReason::Rewind)
                    .await?;
                match again.lease() {
                    Some(l) if l.reentered && l.id.epoch.get() == after[0].epoch => {}
                    _ => tally.violation(format!(
                        "{label}: a lease left by the drop is not re-entered by its instance: \
                         {again:?}"
                    )),
                }
            }
        }
    }
    Ok(completed)
}

fn op_with_lock(op: Op, row_locked: Option<()>) -> Op {
    match (op, row_locked) {
        (Op::Renew, Some(())) => Op::RowLocked(LeaseWait::Renew),
        (Op::RenewMany, Some(())) => Op::RowLocked(LeaseWait::RenewMany),
        (Op::Release, Some(())) => Op::RowLocked(LeaseWait::Release),
        (Op::ForceRelease, Some(())) => Op::RowLocked(LeaseWait::ForceRelease),
        (Op::ReleaseAll, Some(())) => Op::RowLocked(LeaseWait::ReleaseAll),
        (op, _) => op,
    }
}

fn case_app(op: Op, n: u32) -> String {
    format!("lockstep_cancel_{}_{n}", op.name())
}

/// A transaction on the admin pool holding `stream`'s row `FOR UPDATE` until `release` is
/// notified (or 30 s pass), then committing.
async fn row_holder(
    ctx: &Ctx,
    stream: StreamId,
    release: Arc<Notify>,
) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let tx = PgTransaction::begin(&ctx.admin).await?;
    tx.client()
        .execute(
            "SELECT 1 FROM wh_perspective_cursors WHERE stream_id = $1 FOR UPDATE",
            &[&stream.as_uuid()],
        )
        .await?;
    Ok(tokio::spawn(async move {
        let _ = tokio::time::timeout(Duration::from_secs(30), release.notified()).await;
        tx.commit().await?;
        Ok(())
    }))
}

/// A transaction on the admin pool holding advisory `key` until `release` is notified.
async fn lock_holder(
    ctx: &Ctx,
    key: &ResourceKey,
    release: Arc<Notify>,
) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let lock = PgDistributedLock::from_pool(ctx.admin.clone());
    let tx = PgTransaction::begin(&ctx.admin).await?;
    lock.acquire_for_transaction(&tx, key, Some(Duration::from_secs(5)))
        .await?;
    Ok(tokio::spawn(async move {
        let _ = tokio::time::timeout(Duration::from_secs(30), release.notified()).await;
        tx.commit().await?;
        Ok(())
    }))
}

async fn join_holder(
    holder: tokio::task::JoinHandle<anyhow::Result<()>>,
    label: &str,
    tally: &mut Tally,
) {
    match tokio::time::timeout(Duration::from_secs(40), holder).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tally.violation(format!("{label}: the holder could not commit: {e:#}")),
        Ok(Err(e)) => tally.panic(format!("{label}: the holder task failed: {e}")),
        Err(_) => tally.violation(format!("{label}: the holder never finished")),
    }
}

fn fresh_key() -> anyhow::Result<ResourceKey> {
    Ok(ResourceKey::new(format!("cancel:{}", Uuid::new_v4()))?)
}

/// The backend pid of `tx`'s connection.
async fn pid_of(tx: &PgTransaction) -> anyhow::Result<i32> {
    Ok(tx
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .try_get(0)?)
}

/// Try-acquire of a transaction-scoped advisory lock, on a free key or one held elsewhere.
async fn lock_try_case(
    ctx: &Ctx,
    pool: &Pool,
    held: bool,
    n: u32,
    gap: Gap,
    label: &str,
    tally: &mut Tally,
) -> anyhow::Result<bool> {
    let key = fresh_key()?;
    let release = Arc::new(Notify::new());
    let holder = if held {
        Some(lock_holder(ctx, &key, Arc::clone(&release)).await?)
    } else {
        None
    };
    let lock = PgDistributedLock::from_pool(pool.clone());
    let tx = PgTransaction::begin(pool).await?;
    let (outcome, _) = poll_n(lock.try_acquire_for_transaction(&tx, &key), n, gap, None).await;
    match &outcome {
        Some(Ok(got)) if *got == held => tally.violation(format!(
            "{label}: try-acquire answered {got} on a key {}",
            if held {
                "held elsewhere"
            } else {
                "nobody holds"
            }
        )),
        Some(Err(e)) => tally.violation(format!("{label}: try-acquire failed: {e}")),
        _ => {}
    }
    // The transaction's state after a drop is unspecified: end it (rolling back), then nothing
    // of it may be left.
    let _ = tx.rollback().await;
    release.notify_one();
    if let Some(holder) = holder {
        join_holder(holder, label, tally).await;
    }
    ctx.settle(&case_app(Op::LockTry { held }, n), true, true, label, tally)
        .await;
    Ok(outcome.is_some())
}

/// A blocking acquire (or `load_locked`, which locks then loads) on a free key or behind a
/// holder that lets go after `RELEASE_AFTER_POLLS` polls.
#[allow(clippy::too_many_arguments)]
async fn lock_wait_case(
    ctx: &Ctx,
    pool: &Pool,
    load: bool,
    held: bool,
    n: u32,
    gap: Gap,
    label: &str,
    tally: &mut Tally,
) -> anyhow::Result<bool> {
    let key = fresh_key()?;
    let release = Arc::new(Notify::new());
    let holder = if held {
        Some(lock_holder(ctx, &key, Arc::clone(&release)).await?)
    } else {
        None
    };
    let lock = PgDistributedLock::from_pool(pool.clone());
    let store = PgEventStore::with_queue(LockQueue::from(&lock));
    let stream = StreamId::new_v7();
    let tx = PgTransaction::begin(pool).await?;
    let pid = pid_of(&tx).await?;
    let wait = Some(Duration::from_secs(10));
    let fut = async {
        if load {
            store.load_locked(&tx, stream, &key, wait).await.map(|_| ())
        } else {
            lock.acquire_for_transaction(&tx, &key, wait).await
        }
    };
    let app = case_app(
        if load {
            Op::LoadLocked { held }
        } else {
            Op::LockAcquire { held }
        },
        n,
    );
    // As for the lease operations: "dropped while it waited" is what the server showed at the
    // drop, not a count of polls.
    let (outcome, released, waited) = poll_n_then(
        fut,
        n,
        gap,
        holder.as_ref().map(|_| &*release),
        async || held && ctx.waits_for_lock(&app).await.unwrap_or(false),
    )
    .await;
    if let Some(Err(e)) = &outcome {
        tally.violation(format!("{label}: the acquire failed: {e}"));
    }
    if let Some(holder) = holder {
        let early = !released && outcome.is_none() && waited;
        if early {
            // Dropped while it waited behind the holder: the server-side wait must end, and
            // the abandoned waiter must never get the lock once the holder lets go (its
            // transaction is still open here: a grant would show).
            ctx.settle(&app, false, false, label, tally).await;
        }
        release.notify_one();
        join_holder(holder, label, tally).await;
        if early {
            tokio::time::sleep(GHOST_WINDOW).await;
            let granted = ctx.granted_to(pid).await?;
            if granted != 0 {
                tally.violation(format!(
                    "{label}: an acquire dropped while waiting was granted the lock afterwards"
                ));
            }
        }
    }
    let _ = tx.rollback().await;
    ctx.settle(&app, true, true, label, tally).await;
    Ok(outcome.is_some())
}

/// An append of three events, then a commit of whatever the transaction holds: the stream has
/// all three events or none.
async fn append_case<T>(
    ctx: &Ctx,
    store: &PgEventStore,
    tx: T,
    n: u32,
    gap: Gap,
    label: &str,
    tally: &mut Tally,
) -> anyhow::Result<bool>
where
    T: Transaction + Sync,
    PgEventStore: EventStore<T>,
{
    let stream = StreamId::new_v7();
    let events = [number_event(1), number_event(2), number_event(3)];
    let (outcome, _) = poll_n(
        EventStore::append(store, &tx, stream, ExpectedVersion::NoStream, &events),
        n,
        gap,
        None,
    )
    .await;
    let committed = tx.commit().await;
    ctx.settle(&case_app(Op::Append, n), true, true, label, tally)
        .await;
    let (count, consecutive) = ctx.events(stream).await?;
    if !(count == 0 || count == 3) || !consecutive {
        tally.violation(format!(
            "{label}: half an append: {count} of 3 events (versions consecutive: {consecutive})"
        ));
    }
    match &outcome {
        Some(Ok(3)) if committed.is_ok() && count != 3 => {
            tally.lost(format!(
                "{label}: an append and its commit succeeded, {count} events stored"
            ));
        }
        Some(Ok(3)) | None => {}
        Some(other) => tally.violation(format!("{label}: the append answered {other:?}")),
    }
    Ok(outcome.is_some())
}

/// A begin (`PgTransaction::begin`, `SqlxDatabase::begin`) dropped mid-way: no connection may
/// be left inside a transaction.
async fn begin_case<T: Transaction>(
    ctx: &Ctx,
    begin: impl Future<Output = lockstep_core::Result<T>>,
    n: u32,
    gap: Gap,
    label: &str,
    tally: &mut Tally,
) -> anyhow::Result<bool> {
    let (outcome, _) = poll_n(begin, n, gap, None).await;
    let completed = outcome.is_some();
    match outcome {
        Some(Ok(tx)) => {
            if let Err(e) = tx.rollback().await {
                tally.violation(format!("{label}: rolling back a fresh transaction: {e}"));
            }
        }
        Some(Err(e)) => tally.violation(format!("{label}: begin failed: {e}")),
        None => {}
    }
    ctx.settle(&case_app(Op::Begin, n), true, true, label, tally)
        .await;
    Ok(completed)
}

/// Commit (of a transaction holding two appended events, or of a failed one) or rollback,
/// dropped mid-way: the events are all there or none, and no connection is pooled inside a
/// transaction.
#[allow(clippy::too_many_arguments)]
async fn end_case<T>(
    ctx: &Ctx,
    store: &PgEventStore,
    tx: T,
    op: Op,
    n: u32,
    gap: Gap,
    label: &str,
    tally: &mut Tally,
) -> anyhow::Result<bool>
where
    T: Transaction + Executor,
    PgEventStore: EventStore<T>,
{
    let stream = StreamId::new_v7();
    let events = [number_event(1), number_event(2)];
    EventStore::append(store, &tx, stream, ExpectedVersion::NoStream, &events).await?;
    if op == Op::CommitFailed {
        // Any failed statement aborts the transaction.
        let failed = tx.batch("SELECT 1 / 0").await;
        anyhow::ensure!(failed.is_err(), "division by zero did not fail");
    }
    let (outcome, _) = match op {
        Op::Rollback => poll_n(tx.rollback(), n, gap, None).await,
        _ => poll_n(tx.commit(), n, gap, None).await,
    };
    ctx.settle(&case_app(op, n), true, true, label, tally).await;
    let (count, consecutive) = ctx.events(stream).await?;
    if !(count == 0 || count == 2) || !consecutive {
        tally.violation(format!(
            "{label}: half a transaction: {count} of 2 events (consecutive: {consecutive})"
        ));
    }
    let expected = match (op, &outcome) {
        (_, None) => None,
        (Op::Commit, Some(Ok(()))) => Some(2),
        (Op::CommitFailed, Some(Err(e))) if e.kind() == ErrorKind::TransactionAborted => Some(0),
        (Op::Rollback, Some(Ok(()))) => Some(0),
        (_, Some(other)) => {
            tally.violation(format!("{label}: answered {other:?}"));
            None
        }
    };
    if let Some(expected) = expected
        && count != expected
    {
        tally.violation(format!(
            "{label}: {count} events stored, {expected} expected"
        ));
    }
    if op != Op::Commit && count != 0 {
        tally.violation(format!("{label}: a {op:?} stored {count} events"));
    }
    Ok(outcome.is_some())
}

/// Deliberately broken operations run through the same checks; each must be caught. Returns
/// the tally of what the checks reported (one violation or more per broken case, `cases` =
/// how many broken cases ran): a check that cannot fail would leave a case uncounted.
pub async fn demonstrate_checks() -> anyhow::Result<(Tally, Vec<String>)> {
    let ctx = Ctx::new().await?;
    let mut missed = Vec::new();
    let mut all = Tally::default();
    let mut record = |name: &str, t: Tally, all: &mut Tally| {
        if t.violations == 0 && t.lost == 0 {
            missed.push(name.to_owned());
        }
        all.merge(t);
        all.cases += 1;
    };

    // 1. A statement left running: a raw query with no cancel-on-drop.
    let mut t = Tally::default();
    let app = "lockstep_cancel_broken_1";
    let pool = named_pool(&ctx.db, app, 1)?;
    let conn = pool.get().await?;
    let _ = poll_n(
        conn.batch_execute("SELECT pg_sleep(5)"),
        3,
        Gap::Sleep,
        None,
    )
    .await;
    ctx.settle(app, true, true, "statement left running", &mut t)
        .await;
    drop(conn);
    record("statement left running", t, &mut all);

    // 2. A pooled connection inside a transaction.
    let mut t = Tally::default();
    let app = "lockstep_cancel_broken_2";
    let pool = named_pool(&ctx.db, app, 1)?;
    pool.get().await?.batch_execute("BEGIN").await?;
    ctx.settle(app, true, true, "idle in transaction", &mut t)
        .await;
    check_pool_works(&pool, "idle in transaction", &mut t).await;
    record("pooled connection inside a transaction", t, &mut all);
    pool.close();

    // 3. An advisory lock left behind (a session lock on an idle pooled connection).
    let mut t = Tally::default();
    let app = "lockstep_cancel_broken_3";
    let pool = named_pool(&ctx.db, app, 1)?;
    pool.get()
        .await?
        .batch_execute("SELECT pg_advisory_lock(42)")
        .await?;
    ctx.settle(app, true, true, "advisory lock left", &mut t)
        .await;
    record("advisory lock left", t, &mut all);
    pool.close();

    // 4. A ghost lease: a try-acquire whose row ends up held by another instance.
    let mut t = Tally::default();
    let streams = ctx.cursors().await?;
    let before = [
        ctx.lease_row(streams[0]).await?,
        ctx.lease_row(streams[1]).await?,
    ];
    ctx.acquire(streams[0], InstanceId::random()).await?;
    let after = [
        ctx.lease_row(streams[0]).await?,
        ctx.lease_row(streams[1]).await?,
    ];
    if let Err(what) = classify(
        Op::TryAcquire,
        before,
        after,
        InstanceId::random().as_uuid(),
    ) {
        t.violation(format!("ghost lease: {what}"));
    }
    // … and half a batch renewed.
    let me = InstanceId::random();
    let streams = ctx.cursors().await?;
    let ids = [
        ctx.acquire(streams[0], me).await?,
        ctx.acquire(streams[1], me).await?,
    ];
    let before = [
        ctx.lease_row(streams[0]).await?,
        ctx.lease_row(streams[1]).await?,
    ];
    let _ = ctx.setup.renew(&ids[0]).await?;
    let after = [
        ctx.lease_row(streams[0]).await?,
        ctx.lease_row(streams[1]).await?,
    ];
    if let Err(what) = classify(Op::RenewMany, before, after, me.as_uuid()) {
        t.violation(format!("half a batch: {what}"));
    }
    record("ghost lease", t, &mut all);

    // 5. Half an append: one event of three stored by hand.
    let mut t = Tally::default();
    let stream = StreamId::new_v7();
    let tx = PgTransaction::begin(&ctx.admin).await?;
    PgEventStore::with_queue(lockstep_pg::LockQueue::new())
        .append(&tx, stream, ExpectedVersion::NoStream, &[number_event(1)])
        .await?;
    tx.commit().await?;
    let (count, consecutive) = ctx.events(stream).await?;
    if !(count == 0 || count == 3) || !consecutive {
        t.violation(format!("half an append: {count} of 3"));
    }
    record("half an append", t, &mut all);

    Ok((all, missed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yield_drop_points_cover_the_first_awaits_then_grow_to_a_few_dozen() {
        for _ in 0..100 {
            let mut points = Vec::new();
            let mut n = 0;
            while n < 4_000 {
                n = next_drop_point(n, Gap::Yield);
                points.push(n);
            }
            assert_eq!(points[..8], [1, 2, 3, 4, 5, 6, 7, 8]);
            assert!(points.windows(2).all(|w| w[0] < w[1]), "{points:?}");
            assert!((30..=90).contains(&points.len()), "{}", points.len());
        }
        assert_eq!(next_drop_point(41, Gap::Sleep), 42);
        assert!(next_drop_point(u32::MAX - 1, Gap::Yield) == u32::MAX);
    }
}
