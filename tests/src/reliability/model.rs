//! Fake = Postgres, by model (issue 8's suite, part 1): proptest generates sequences of
//! operations and runs each sequence on the in-memory implementation and on PostgreSQL; every
//! observable outcome must agree.
//!
//! - **Stream leases**, with time advancing: try-acquire (three instances, two pairs with a
//!   cursor row and one without, any reason), renew, release, force-release, renew_many (each
//!   side's own lease ids fed back), a listing (holder, epoch, held or expired), a **fenced
//!   commit** (`LeaseFence::check_lease` in a transaction, optionally with another try-acquire
//!   while it is open, then commit), and **`Advance`**: the leases expire on both sides, so
//!   expiry, takeover (a new epoch) and lost renewals are compared too.
//! - **Transaction-scoped locks**: try-acquire and a bounded blocking acquire (three
//!   transactions, two keys, re-entrant; a timed-out wait aborts the transaction on both),
//!   commit, rollback and **drop** of a transaction.
//!
//! # Time
//!
//! Both sides run on the real clock: the in-memory locker reads tokio's clock, which in a
//! running (unpaused) runtime is the real monotonic clock, and Postgres reads
//! `clock_timestamp()`. So one sleep past the lock timeout ([`ADVANCE`] > [`LOCK_TIMEOUT`])
//! expires every lease on both. The margins are wide for a loaded machine: the operations
//! between two advances must finish within [`MAX_SEGMENT`] (a fraction of the timeout); a
//! sequence whose operations ran slower than that is rejected (not counted, never a false
//! failure), since near an expiry the two sides could then legitimately disagree.
//!
//! # Drops
//!
//! Dropping a Postgres transaction closes its connection, and the server releases its locks
//! only once it notices. The model makes that deterministic by waiting (bounded) until the
//! transaction's backend is gone before the next operation.
//!
//! [`run`] is async and called from inside a runtime: the proptest runner (blocking) runs on a
//! blocking thread and drives each sequence with `Handle::block_on`. A failure is reported in
//! the tally with its minimal failing sequence.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deadpool_postgres::Pool;
use lockstep_core::{
    AcquireOutcome, DistributedLock, InstanceId, LeaseEpoch, LeaseFence, LeaseId, LockReason,
    PerspectiveName, ResourceKey, StreamId, StreamLockAdmin, StreamLockOptions, StreamLocker,
};
use lockstep_pg::PgTransaction;
use lockstep_pg_advisory::PgDistributedLock;
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::test_database;
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, FakeTransaction, InMemoryStreamLocker};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use tokio::runtime::Handle;

use super::{Scale, Tally};
use lockstep_core::Transaction as _;

/// The lock timeout of the lease model (both sides).
pub const LOCK_TIMEOUT: Duration = Duration::from_millis(1000);
/// How long an `Advance` sleeps: past the lock timeout by a wide margin.
pub const ADVANCE: Duration = Duration::from_millis(1400);
/// The longest the operations between two advances may take for a sequence to count: every
/// lease they set is then live until the next advance and expired after it, on both sides.
pub const MAX_SEGMENT: Duration = Duration::from_millis(500);
/// How long a blocking acquire in the lock model waits for a key held elsewhere.
const LOCK_WAIT: Duration = Duration::from_millis(100);

fn options() -> Result<StreamLockOptions, TestCaseError> {
    StreamLockOptions::new(LOCK_TIMEOUT, Duration::from_millis(100))
        .map_err(|e| TestCaseError::fail(format!("options: {e}")))
}

/// Runs both models (`Short`: a few dozen sequences each, under a minute; `Long`: hundreds).
pub async fn run(scale: Scale) -> anyhow::Result<Tally> {
    let db = test_database().await;
    let pool = db.pool(8);
    lockstep_pg::migrate(&pool).await?;
    let handle = Handle::current();
    let (lease_cases, lock_cases, shrink) = match scale {
        Scale::Short => (12, 40, 64),
        Scale::Long => (300, 1000, 1024),
    };
    let tally = tokio::task::spawn_blocking(move || {
        let mut tally = Tally::default();
        let lease = |ops| handle.block_on(lease_case(&pool, ops, Sabotage::None));
        let lock = |ops| handle.block_on(lock_case(&pool, ops, Sabotage::None));
        // Fixed sequences first: the time-dependent paths every run must cover, and the
        // failures proptest once found (formerly model.proptest-regressions).
        for ops in lease_regressions() {
            check_fixed(&mut tally, "lease model", &ops, lease(ops.clone()));
        }
        for ops in lock_regressions() {
            check_fixed(
                &mut tally,
                "transaction-lock model",
                &ops,
                lock(ops.clone()),
            );
        }
        run_model(
            &mut tally,
            "lease model",
            lease_cases,
            shrink,
            proptest::collection::vec(lease_op(), 1..20),
            &lease,
        );
        run_model(
            &mut tally,
            "transaction-lock model",
            lock_cases,
            shrink,
            proptest::collection::vec(lock_op(), 1..30),
            &lock,
        );
        tally
    })
    .await?;
    drop(db);
    Ok(tally)
}

fn check_fixed<T: std::fmt::Debug>(
    tally: &mut Tally,
    model: &str,
    ops: &T,
    outcome: Result<(), TestCaseError>,
) {
    match outcome {
        Ok(()) => tally.cases += 1,
        // A fixed sequence that ran too slowly proves nothing either way.
        Err(TestCaseError::Reject(_)) => {}
        Err(TestCaseError::Fail(reason)) => {
            tally.cases += 1;
            tally.violation(format!("{model}: {reason} (fixed sequence {ops:?})"));
        }
    }
}

/// Runs `cases` proptest sequences of `strategy` through `case`, recording passes as cases and
/// a failure (shrunk to its minimal sequence) as a violation.
fn run_model<S: Strategy>(
    tally: &mut Tally,
    model: &str,
    cases: u32,
    shrink: u32,
    strategy: S,
    case: &dyn Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S::Value: std::fmt::Debug,
{
    let passed = AtomicU64::new(0);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: shrink,
        ..Config::default()
    });
    let result = runner.run(&strategy, |ops| {
        let outcome = case(ops);
        if outcome.is_ok() {
            passed.fetch_add(1, Ordering::Relaxed);
        }
        outcome
    });
    tally.cases += passed.load(Ordering::Relaxed);
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, ops)) => {
            tally.cases += 1;
            let detail = format!("{model}: {reason}; minimal failing sequence: {ops:?}");
            if reason.message().contains("panicked") {
                tally.panic(detail);
            } else {
                tally.violation(detail);
            }
        }
        Err(TestError::Abort(reason)) => {
            tally.violation(format!("{model}: aborted: {reason}"));
        }
    }
}

/// One lease-model operation.
#[derive(Debug, Clone)]
pub enum LeaseOp {
    /// Instance `who` tries pair `pair` for reason `reason`.
    TryAcquire {
        /// Instance index.
        who: usize,
        /// Pair index (pair 2 has no cursor row).
        pair: usize,
        /// Reason index.
        reason: usize,
    },
    /// `who` renews its last lease on `pair`.
    Renew {
        /// Instance index.
        who: usize,
        /// Pair index.
        pair: usize,
    },
    /// `who` releases its last lease on `pair`.
    Release {
        /// Instance index.
        who: usize,
        /// Pair index.
        pair: usize,
    },
    /// An operator force-releases `pair`.
    ForceRelease {
        /// Pair index.
        pair: usize,
    },
    /// `who` renews its last lease on every pair in one batch.
    RenewMany {
        /// Instance index.
        who: usize,
    },
    /// The lease listing: pair, holder, epoch, held or expired.
    List,
    /// A fenced commit: `who`'s last lease on `pair` checked in a transaction; while it is
    /// open, instance `then_try` (if any) tries the pair; then the transaction commits.
    Fenced {
        /// Instance index.
        who: usize,
        /// Pair index.
        pair: usize,
        /// Who tries the pair while the fenced transaction is open.
        then_try: Option<usize>,
    },
    /// Time passes beyond the lock timeout on both sides.
    Advance,
}

fn lease_op() -> impl Strategy<Value = LeaseOp> {
    prop_oneof![
        4 => (0..3usize, 0..3usize, 0..3usize)
            .prop_map(|(who, pair, reason)| LeaseOp::TryAcquire { who, pair, reason }),
        2 => (0..3usize, 0..3usize).prop_map(|(who, pair)| LeaseOp::Renew { who, pair }),
        2 => (0..3usize, 0..3usize).prop_map(|(who, pair)| LeaseOp::Release { who, pair }),
        1 => (0..3usize).prop_map(|pair| LeaseOp::ForceRelease { pair }),
        1 => (0..3usize).prop_map(|who| LeaseOp::RenewMany { who }),
        1 => Just(LeaseOp::List),
        2 => (0..3usize, 0..3usize, proptest::option::of(0..3usize))
            .prop_map(|(who, pair, then_try)| LeaseOp::Fenced { who, pair, then_try }),
        1 => Just(LeaseOp::Advance),
    ]
}

/// Sequences every run covers: expiry and takeover with a new epoch, a lost renew, the same
/// instance's re-acquire after expiry (new epoch, not re-entered), a fenced commit before and
/// after expiry, a takeover refused while a fenced transaction is open; and the failures
/// proptest once found.
fn lease_regressions() -> Vec<Vec<LeaseOp>> {
    use LeaseOp::*;
    let take = |who, pair| TryAcquire {
        who,
        pair,
        reason: 0,
    };
    vec![
        vec![take(0, 0)],
        vec![
            take(0, 0),
            Advance,
            List,
            take(1, 0),
            Renew { who: 0, pair: 0 },
            List,
        ],
        vec![take(0, 0), Advance, take(0, 0), Release { who: 0, pair: 0 }],
        vec![
            take(0, 1),
            Fenced {
                who: 0,
                pair: 1,
                then_try: Some(1),
            },
            Advance,
            Fenced {
                who: 0,
                pair: 1,
                then_try: None,
            },
            RenewMany { who: 0 },
            take(2, 1),
            Fenced {
                who: 2,
                pair: 1,
                then_try: Some(0),
            },
        ],
    ]
}

/// Which reasons the model uses.
const REASONS: [LockReason; 3] = [LockReason::Rewind, LockReason::Bootstrap, LockReason::Purge];

/// One implementation under the lease model, with the lease ids it handed out.
struct LeaseSide<L> {
    locker: Arc<L>,
    /// The last lease id each (instance, pair) was given.
    held: [[Option<LeaseId>; 3]; 3],
}

/// What the model shares between the two sides.
struct World {
    instances: Vec<InstanceId>,
    pairs: Vec<(StreamId, PerspectiveName)>,
}

impl World {
    fn index(&self, id: InstanceId) -> Option<usize> {
        self.instances.iter().position(|i| *i == id)
    }

    fn pair_index(&self, stream: StreamId) -> Option<usize> {
        self.pairs.iter().position(|(s, _)| *s == stream)
    }
}

impl<L: StreamLocker + StreamLockAdmin> LeaseSide<L> {
    fn lease_of(&self, who: usize, pair: usize, world: &World) -> LeaseId {
        self.held[who][pair].clone().unwrap_or_else(|| {
            LeaseId::new(
                world.pairs[pair].0,
                world.pairs[pair].1.clone(),
                world.instances[who],
                LeaseEpoch::new(0),
            )
        })
    }

    async fn try_acquire(
        &mut self,
        who: usize,
        pair: usize,
        reason: usize,
        world: &World,
    ) -> String {
        let (stream, name) = &world.pairs[pair];
        match self
            .locker
            .try_acquire(*stream, name, world.instances[who], &REASONS[reason])
            .await
        {
            Ok(AcquireOutcome::Acquired(lease)) => {
                let out = format!(
                    "acquired epoch={} reentered={} reason={}",
                    lease.id.epoch, lease.reentered, lease.reason
                );
                self.held[who][pair] = Some(lease.id);
                out
            }
            Ok(AcquireOutcome::Denied(holder)) => format!(
                "denied by {:?} reason={} epoch={}",
                world.index(holder.instance),
                holder.reason,
                holder.epoch
            ),
            Ok(AcquireOutcome::NoCursor) => "no cursor".to_owned(),
            Ok(AcquireOutcome::Busy) => "busy".to_owned(),
            Err(e) => format!("error {}", e.kind()),
        }
    }

    /// Runs `op` (all but `Fenced` and `Advance`), returning what a caller observes,
    /// normalized (instances and pairs by index).
    async fn run(&mut self, op: &LeaseOp, world: &World) -> String {
        match op {
            LeaseOp::TryAcquire { who, pair, reason } => {
                self.try_acquire(*who, *pair, *reason, world).await
            }
            LeaseOp::Renew { who, pair } => {
                match self.locker.renew(&self.lease_of(*who, *pair, world)).await {
                    Ok(o) => format!("renewed={}", o.is_renewed()),
                    Err(e) => format!("error {}", e.kind()),
                }
            }
            LeaseOp::Release { who, pair } => {
                match self
                    .locker
                    .release(&self.lease_of(*who, *pair, world))
                    .await
                {
                    Ok(o) => format!("released={}", o.is_released()),
                    Err(e) => format!("error {}", e.kind()),
                }
            }
            LeaseOp::ForceRelease { pair } => {
                let (stream, name) = &world.pairs[*pair];
                match self.locker.force_release(*stream, name).await {
                    Ok(o) => format!("force released={}", o.is_released()),
                    Err(e) => format!("error {}", e.kind()),
                }
            }
            LeaseOp::RenewMany { who } => {
                let ids: Vec<LeaseId> = (0..3)
                    .map(|pair| self.lease_of(*who, pair, world))
                    .collect();
                match self.locker.renew_many(&ids).await {
                    Ok(outcomes) => format!(
                        "renew_many {:?}",
                        outcomes.iter().map(|o| o.is_renewed()).collect::<Vec<_>>()
                    ),
                    Err(e) => format!("error {}", e.kind()),
                }
            }
            LeaseOp::List => match self.locker.list_leases().await {
                Ok(leases) => {
                    let mut seen: Vec<String> = leases
                        .iter()
                        // Other sequences share the database: only this world's pairs.
                        .filter_map(|l| {
                            let pair = world.pair_index(l.stream_id)?;
                            Some(format!(
                                "pair {pair} holder {:?} epoch {} {:?}",
                                world.index(l.holder),
                                l.epoch,
                                l.status
                            ))
                        })
                        .collect();
                    seen.sort();
                    format!("leases {seen:?}")
                }
                Err(e) => format!("error {}", e.kind()),
            },
            LeaseOp::Fenced { .. } | LeaseOp::Advance => String::new(),
        }
    }
}

async fn insert_cursor(
    pool: &Pool,
    stream: StreamId,
    name: &PerspectiveName,
) -> Result<(), TestCaseError> {
    let client = pool.get().await.map_err(fail)?;
    client
        .execute(
            "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)",
            &[&stream.as_uuid(), &name.as_str()],
        )
        .await
        .map_err(fail)?;
    Ok(())
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(format!("harness: {e}"))
}

fn show<T: std::fmt::Debug>(r: &lockstep_core::Result<T>) -> String {
    match r {
        Ok(v) => format!("ok {v:?}"),
        Err(e) => format!("error {}", e.kind()),
    }
}

/// One lease sequence on both sides.
async fn lease_case(
    pool: &Pool,
    ops: Vec<LeaseOp>,
    sabotage: Sabotage,
) -> Result<(), TestCaseError> {
    let name = PerspectiveName::new("Model").map_err(fail)?;
    let world = World {
        instances: (0..3).map(|_| InstanceId::random()).collect(),
        pairs: (0..3).map(|_| (StreamId::new_v7(), name.clone())).collect(),
    };
    let fake_db = FakeDatabase::new();
    let fake_options = match sabotage {
        Sabotage::LongerFakeTimeout => {
            StreamLockOptions::new(LOCK_TIMEOUT * 10, Duration::from_millis(100)).map_err(fail)?
        }
        _ => options()?,
    };
    let fake = InMemoryStreamLocker::with_database(fake_options, &fake_db);
    // Pairs 0 and 1 have a cursor row; pair 2 has none (NoCursor).
    for (stream, name) in &world.pairs[..2] {
        fake.create_cursor(*stream, name);
        insert_cursor(pool, *stream, name).await?;
    }
    let mut in_memory = LeaseSide {
        locker: Arc::new(fake),
        held: Default::default(),
    };
    let mut postgres = LeaseSide {
        locker: Arc::new(PgStreamLocker::from_pool(pool.clone(), options()?)),
        held: Default::default(),
    };
    let mut segment_start = tokio::time::Instant::now();
    for (step, op) in ops.iter().enumerate() {
        let (a, b) = match op {
            LeaseOp::Advance => {
                check_segment(segment_start)?;
                tokio::time::sleep(ADVANCE).await;
                segment_start = tokio::time::Instant::now();
                continue;
            }
            LeaseOp::Fenced {
                who,
                pair,
                then_try,
            } => {
                let id = in_memory.lease_of(*who, *pair, &world);
                let tx = fake_db.begin_now();
                let checked = in_memory.locker.check_lease(&tx, &id).await;
                let mut a = show(&checked);
                if let Some(other) = then_try {
                    a += &format!(
                        " / {}",
                        in_memory.try_acquire(*other, *pair, 0, &world).await
                    );
                }
                a += &format!(" / commit {}", show(&tx.commit().await));

                let id = postgres.lease_of(*who, *pair, &world);
                let tx = PgTransaction::begin(pool).await.map_err(fail)?;
                let checked = LeaseFence::check_lease(&*postgres.locker, &tx, &id).await;
                let mut b = show(&checked);
                if let Some(other) = then_try {
                    b += &format!(
                        " / {}",
                        postgres.try_acquire(*other, *pair, 0, &world).await
                    );
                }
                b += &format!(" / commit {}", show(&tx.commit().await));
                (a, b)
            }
            op => (
                in_memory.run(op, &world).await,
                postgres.run(op, &world).await,
            ),
        };
        // Near an expiry the sides could legitimately disagree: a sequence that ran slowly is
        // rejected before any comparison it could spoil.
        check_segment(segment_start)?;
        prop_assert_eq!(&a, &b, "step {} ({:?}): fake vs Postgres", step, op);
    }
    Ok(())
}

/// Rejects the sequence if the operations since the last advance ran past [`MAX_SEGMENT`].
fn check_segment(start: tokio::time::Instant) -> Result<(), TestCaseError> {
    if start.elapsed() > MAX_SEGMENT {
        return Err(TestCaseError::reject(
            "operations between two advances ran too slowly to compare expiry",
        ));
    }
    Ok(())
}

/// One transaction-lock operation.
#[derive(Debug, Clone)]
pub enum LockOp {
    /// Transaction `tx` tries `key` (a transaction begins at its first statement).
    Try {
        /// Transaction index.
        tx: usize,
        /// Key index.
        key: usize,
    },
    /// Transaction `tx` waits for `key` at most `LOCK_WAIT`.
    Acquire {
        /// Transaction index.
        tx: usize,
        /// Key index.
        key: usize,
    },
    /// Commits `tx`.
    Commit {
        /// Transaction index.
        tx: usize,
    },
    /// Rolls `tx` back.
    Rollback {
        /// Transaction index.
        tx: usize,
    },
    /// Drops `tx` without ending it.
    Drop {
        /// Transaction index.
        tx: usize,
    },
}

fn lock_op() -> impl Strategy<Value = LockOp> {
    prop_oneof![
        5 => (0..3usize, 0..2usize).prop_map(|(tx, key)| LockOp::Try { tx, key }),
        2 => (0..3usize, 0..2usize).prop_map(|(tx, key)| LockOp::Acquire { tx, key }),
        1 => (0..3usize).prop_map(|tx| LockOp::Commit { tx }),
        1 => (0..3usize).prop_map(|tx| LockOp::Rollback { tx }),
        1 => (0..3usize).prop_map(|tx| LockOp::Drop { tx }),
    ]
}

fn lock_regressions() -> Vec<Vec<LockOp>> {
    use LockOp::*;
    vec![
        vec![Try { tx: 0, key: 0 }],
        // A wait that times out aborts the transaction; a drop releases its locks.
        vec![
            Try { tx: 0, key: 0 },
            Acquire { tx: 1, key: 0 },
            Try { tx: 1, key: 1 },
            Commit { tx: 1 },
            Drop { tx: 0 },
            Acquire { tx: 2, key: 0 },
        ],
        // Found by a long run: a lock wait that times out releases the transaction's other
        // locks on both sides by the time the error returns (a later try by another transaction
        // gets them). PostgreSQL sends the error before it aborts and releases; the lock waits
        // for the abort before returning (ADR 0003, last addendum).
        vec![
            Try { tx: 1, key: 1 },
            Acquire { tx: 0, key: 0 },
            Acquire { tx: 1, key: 0 },
            Try { tx: 0, key: 1 },
            Commit { tx: 1 },
            Acquire { tx: 1, key: 1 },
        ],
    ]
}

/// A Postgres transaction of the model and its backend's pid (to wait for its end on drop).
struct PgTx {
    tx: PgTransaction,
    pid: i32,
    // When its transaction began (`now()`), to tell it from a later transaction on the same
    // backend: a dropped guard's connection goes back to the pool once rolled back.
    began: String,
}

async fn begin_pg(pool: &Pool) -> Result<PgTx, TestCaseError> {
    let tx = PgTransaction::begin(pool).await.map_err(fail)?;
    let row = tx
        .client()
        .query_one("SELECT pg_backend_pid(), now()::text", &[])
        .await
        .map_err(fail)?;
    let pid = row.try_get(0).map_err(fail)?;
    let began = row.try_get(1).map_err(fail)?;
    Ok(PgTx { tx, pid, began })
}

/// Waits (bounded) until the transaction that began at `began` on backend `pid` has ended: a
/// dropped `PgTransaction` is rolled back in the background (its connection pooled again, maybe
/// already serving another transaction) or its connection is closed (the backend exits) —
/// either way its locks are then released.
async fn wait_for_transaction_end(pool: &Pool, pid: i32, began: &str) -> Result<(), TestCaseError> {
    let client = pool.get().await.map_err(fail)?;
    for _ in 0..250 {
        let row = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND xact_start::text = $2",
                &[&pid, &began],
            )
            .await
            .map_err(fail)?;
        if row.try_get::<_, i64>(0).map_err(fail)? == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(TestCaseError::fail(format!(
        "the transaction of a dropped guard (backend {pid}, begun {began}) did not end within 5 s"
    )))
}

/// One transaction-lock sequence on both sides.
async fn lock_case(pool: &Pool, ops: Vec<LockOp>, sabotage: Sabotage) -> Result<(), TestCaseError> {
    let mut leaked = Vec::new();
    let keys: Vec<ResourceKey> = (0..2)
        .map(|_| ResourceKey::new(format!("model:{}", uuid::Uuid::new_v4())))
        .collect::<Result<_, _>>()
        .map_err(fail)?;
    let db = FakeDatabase::new();
    let fake_lock = FakeDistributedLock::new(&db);
    let pg_lock = PgDistributedLock::from_pool(pool.clone());
    let mut fake_tx: Vec<Option<FakeTransaction>> = vec![None, None, None];
    let mut pg_tx: Vec<Option<PgTx>> = vec![None, None, None];
    for (step, op) in ops.iter().enumerate() {
        let (a, b) = match op {
            LockOp::Try { tx, key } | LockOp::Acquire { tx, key } => {
                // A transaction begins at its first statement.
                if fake_tx[*tx].is_none() {
                    fake_tx[*tx] = Some(db.begin_now());
                }
                if pg_tx[*tx].is_none() {
                    pg_tx[*tx] = Some(begin_pg(pool).await?);
                }
                let (Some(f), Some(p)) = (&fake_tx[*tx], &pg_tx[*tx]) else {
                    return Err(TestCaseError::fail("transaction just begun"));
                };
                let key = &keys[*key];
                if matches!(op, LockOp::Try { .. }) {
                    (
                        show(&fake_lock.try_acquire_for_transaction(f, key).await),
                        show(&pg_lock.try_acquire_for_transaction(&p.tx, key).await),
                    )
                } else {
                    (
                        show(
                            &fake_lock
                                .acquire_for_transaction(f, key, Some(LOCK_WAIT))
                                .await,
                        ),
                        show(
                            &pg_lock
                                .acquire_for_transaction(&p.tx, key, Some(LOCK_WAIT))
                                .await,
                        ),
                    )
                }
            }
            LockOp::Commit { tx } => {
                let a = match fake_tx[*tx].take() {
                    Some(t) => show(&t.commit().await),
                    None => "idle".to_owned(),
                };
                let b = match pg_tx[*tx].take() {
                    Some(t) => show(&t.tx.commit().await),
                    None => "idle".to_owned(),
                };
                (a, b)
            }
            LockOp::Rollback { tx } => {
                let a = match fake_tx[*tx].take() {
                    Some(t) => {
                        t.rollback().await.expect("rollback");
                        "rolled back".to_owned()
                    }
                    None => "idle".to_owned(),
                };
                let b = match pg_tx[*tx].take() {
                    Some(t) => match t.tx.rollback().await {
                        Ok(()) => "rolled back".to_owned(),
                        Err(e) => format!("error {}", e.kind()),
                    },
                    None => "idle".to_owned(),
                };
                (a, b)
            }
            LockOp::Drop { tx } => {
                let a = match fake_tx[*tx].take() {
                    Some(t) if sabotage == Sabotage::LeakFakeDrops => {
                        leaked.push(t);
                        "dropped".to_owned()
                    }
                    Some(t) => {
                        drop(t);
                        "dropped".to_owned()
                    }
                    None => "idle".to_owned(),
                };
                let b = match pg_tx[*tx].take() {
                    Some(t) => {
                        let (pid, began) = (t.pid, t.began.clone());
                        drop(t);
                        wait_for_transaction_end(pool, pid, &began).await?;
                        "dropped".to_owned()
                    }
                    None => "idle".to_owned(),
                };
                (a, b)
            }
        };
        prop_assert_eq!(&a, &b, "step {} ({:?}): fake vs Postgres", step, op);
    }
    for (f, p) in fake_tx.into_iter().zip(pg_tx) {
        if let Some(f) = f {
            f.rollback().await.expect("rollback");
        }
        if let Some(p) = p {
            let _ = p.tx.rollback().await;
        }
    }
    Ok(())
}

/// A deliberately wrong fake, to show the model catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sabotage {
    /// The real fakes.
    None,
    /// The in-memory locker's leases last ten times longer (time is not compared right).
    LongerFakeTimeout,
    /// A dropped fake transaction keeps its locks (drops are not compared right).
    LeakFakeDrops,
}

/// Runs the model against deliberately wrong fakes; returns the checks that did not fire (none
/// expected), and the tally of a proptest run against a wrong fake (one violation, with its
/// minimal failing sequence).
pub async fn demonstrate_checks() -> anyhow::Result<(Vec<String>, Tally)> {
    let db = test_database().await;
    let pool = db.pool(8);
    lockstep_pg::migrate(&pool).await?;
    let mut missed = Vec::new();
    for ops in lease_regressions() {
        if !ops.iter().any(|op| matches!(op, LeaseOp::Advance)) {
            continue;
        }
        if !matches!(
            lease_case(&pool, ops.clone(), Sabotage::LongerFakeTimeout).await,
            Err(TestCaseError::Fail(_))
        ) {
            missed.push(format!("a fake with longer leases passed {ops:?}"));
        }
    }
    for ops in lock_regressions() {
        if !ops.iter().any(|op| matches!(op, LockOp::Drop { .. })) {
            continue;
        }
        if !matches!(
            lock_case(&pool, ops.clone(), Sabotage::LeakFakeDrops).await,
            Err(TestCaseError::Fail(_))
        ) {
            missed.push(format!(
                "a fake that leaks dropped transactions passed {ops:?}"
            ));
        }
    }
    let handle = Handle::current();
    let tally = tokio::task::spawn_blocking(move || {
        let mut tally = Tally::default();
        let lock = |ops| handle.block_on(lock_case(&pool, ops, Sabotage::LeakFakeDrops));
        run_model(
            &mut tally,
            "transaction-lock model on a leaking fake",
            200,
            256,
            proptest::collection::vec(lock_op(), 1..30),
            &lock,
        );
        tally
    })
    .await?;
    drop(db);
    Ok((missed, tally))
}
