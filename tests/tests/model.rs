//! Fake = Postgres, by model: proptest generates sequences of operations and runs each sequence
//! on the in-memory implementation and on PostgreSQL; every observable outcome must agree
//! (issue 8's suite, first part).
//!
//! - Stream leases: try-acquire (three instances, two pairs with a cursor row and one without,
//!   any reason), renew, release, force-release and renew_many, with each side's own lease ids
//!   fed back. Outcomes are compared whole: acquired (epoch, re-entered), denied (holder,
//!   reason, epoch), no cursor, renewed / lost, released / not held.
//! - Transaction-scoped locks: try-acquire (three transactions, two keys, re-entrant), commit and
//!   rollback, comparing every answer.
//!
//! Time does not move within a sequence (hour-long leases): expiry is covered by the
//! conformance suites on both implementations. Dropping a Postgres transaction releases its locks
//! only when the server notices the closed connection, so drops are left to the conformance
//! suites too.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use deadpool_postgres::Pool;
use lockstep_core::{
    AcquireOutcome, DistributedLock, InstanceId, LeaseEpoch, LeaseId, LockReason, PerspectiveName,
    ResourceKey, StreamId, StreamLockAdmin, StreamLockOptions, StreamLocker,
};
use lockstep_pg::PgTransaction;
use lockstep_pg_advisory::PostgresDistributedLock;
use lockstep_pg_stream::PostgresStreamLocker;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, FakeTransaction, InMemoryStreamLocker};
use proptest::prelude::*;
use tokio::runtime::Runtime;

/// One runtime for every case, so the database's pooled connections outlive a case.
fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
    })
}

/// One migrated database for every case (each case uses fresh streams and keys).
fn database() -> &'static (TestDatabase, Pool) {
    static DB: OnceLock<(TestDatabase, Pool)> = OnceLock::new();
    DB.get_or_init(|| {
        runtime().block_on(async {
            let db = test_database().await;
            let pool = db.pool(8);
            lockstep_pg::migrate(&pool).await.expect("migrate");
            (db, pool)
        })
    })
}

fn options() -> StreamLockOptions {
    StreamLockOptions::new(Duration::from_secs(3600), Duration::from_secs(600)).expect("valid")
}

#[derive(Debug, Clone)]
enum LeaseOp {
    TryAcquire {
        who: usize,
        pair: usize,
        reason: usize,
    },
    Renew {
        who: usize,
        pair: usize,
    },
    Release {
        who: usize,
        pair: usize,
    },
    ForceRelease {
        pair: usize,
    },
    RenewMany {
        who: usize,
    },
}

fn lease_op() -> impl Strategy<Value = LeaseOp> {
    prop_oneof![
        4 => (0..3usize, 0..3usize, 0..3usize)
            .prop_map(|(who, pair, reason)| LeaseOp::TryAcquire { who, pair, reason }),
        2 => (0..3usize, 0..3usize).prop_map(|(who, pair)| LeaseOp::Renew { who, pair }),
        2 => (0..3usize, 0..3usize).prop_map(|(who, pair)| LeaseOp::Release { who, pair }),
        1 => (0..3usize).prop_map(|pair| LeaseOp::ForceRelease { pair }),
        1 => (0..3usize).prop_map(|who| LeaseOp::RenewMany { who }),
    ]
}

const REASONS: [LockReason; 3] = [LockReason::Rewind, LockReason::Bootstrap, LockReason::Purge];

/// One implementation under the lease model, with the lease ids it handed out.
struct LeaseSide<L: ?Sized> {
    locker: Arc<L>,
    /// The last lease id each (instance, pair) was given.
    held: [[Option<LeaseId>; 3]; 3],
}

impl<L: StreamLocker + StreamLockAdmin + ?Sized> LeaseSide<L> {
    fn lease_of(
        &self,
        who: usize,
        pair: usize,
        instances: &[InstanceId],
        pairs: &[(StreamId, PerspectiveName)],
    ) -> LeaseId {
        self.held[who][pair].clone().unwrap_or_else(|| LeaseId {
            stream_id: pairs[pair].0,
            perspective: pairs[pair].1.clone(),
            holder: instances[who],
            epoch: LeaseEpoch::new(0),
        })
    }

    /// Runs `op`, returning what a caller observes, normalized (instances by index).
    async fn run(
        &mut self,
        op: &LeaseOp,
        instances: &[InstanceId],
        pairs: &[(StreamId, PerspectiveName)],
    ) -> String {
        let index = |id: InstanceId| instances.iter().position(|i| *i == id);
        match op {
            LeaseOp::TryAcquire { who, pair, reason } => {
                let (stream, name) = &pairs[*pair];
                match self
                    .locker
                    .try_acquire(*stream, name, instances[*who], &REASONS[*reason])
                    .await
                {
                    Ok(AcquireOutcome::Acquired(lease)) => {
                        let out = format!(
                            "acquired epoch={} reentered={} reason={}",
                            lease.id.epoch, lease.reentered, lease.reason
                        );
                        self.held[*who][*pair] = Some(lease.id);
                        out
                    }
                    Ok(AcquireOutcome::Denied(holder)) => format!(
                        "denied by {:?} reason={} epoch={}",
                        index(holder.instance),
                        holder.reason,
                        holder.epoch
                    ),
                    Ok(AcquireOutcome::NoCursor) => "no cursor".to_owned(),
                    Err(e) => format!("error {}", e.kind()),
                }
            }
            LeaseOp::Renew { who, pair } => {
                let id = self.lease_of(*who, *pair, instances, pairs);
                match self.locker.renew(&id).await {
                    Ok(o) => format!("renewed={}", o.is_renewed()),
                    Err(e) => format!("error {}", e.kind()),
                }
            }
            LeaseOp::Release { who, pair } => {
                let id = self.lease_of(*who, *pair, instances, pairs);
                match self.locker.release(&id).await {
                    Ok(o) => format!("released={}", o.is_released()),
                    Err(e) => format!("error {}", e.kind()),
                }
            }
            LeaseOp::ForceRelease { pair } => {
                let (stream, name) = &pairs[*pair];
                match self.locker.force_release(*stream, name).await {
                    Ok(o) => format!("force released={}", o.is_released()),
                    Err(e) => format!("error {}", e.kind()),
                }
            }
            LeaseOp::RenewMany { who } => {
                let ids: Vec<LeaseId> = (0..3)
                    .map(|pair| self.lease_of(*who, pair, instances, pairs))
                    .collect();
                match self.locker.renew_many(&ids).await {
                    Ok(outcomes) => format!(
                        "renew_many {:?}",
                        outcomes.iter().map(|o| o.is_renewed()).collect::<Vec<_>>()
                    ),
                    Err(e) => format!("error {}", e.kind()),
                }
            }
        }
    }
}

async fn insert_cursor(pool: &Pool, stream: StreamId, name: &PerspectiveName) {
    let client = pool.get().await.expect("connection");
    client
        .execute(
            "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)",
            &[&stream.as_uuid(), &name.as_str()],
        )
        .await
        .expect("cursor row");
}

async fn lease_case(pool: &Pool, ops: Vec<LeaseOp>) -> Result<(), TestCaseError> {
    let instances: Vec<InstanceId> = (0..3).map(|_| InstanceId::random()).collect();
    let name = PerspectiveName::new("Model").expect("valid");
    let pairs: Vec<(StreamId, PerspectiveName)> =
        (0..3).map(|_| (StreamId::new_v7(), name.clone())).collect();
    let fake = InMemoryStreamLocker::new(options());
    // Pairs 0 and 1 have a cursor row; pair 2 has none (NoCursor).
    for (stream, name) in &pairs[..2] {
        fake.create_cursor(*stream, name);
        insert_cursor(pool, *stream, name).await;
    }
    let mut in_memory = LeaseSide {
        locker: Arc::new(fake),
        held: Default::default(),
    };
    let mut postgres = LeaseSide {
        locker: Arc::new(PostgresStreamLocker::new(pool.clone(), options())),
        held: Default::default(),
    };
    for (step, op) in ops.iter().enumerate() {
        let a = in_memory.run(op, &instances, &pairs).await;
        let b = postgres.run(op, &instances, &pairs).await;
        prop_assert_eq!(&a, &b, "step {} ({:?}) of {:?}", step, op, ops);
    }
    Ok(())
}

#[derive(Debug, Clone)]
enum LockOp {
    Try { tx: usize, key: usize },
    Commit { tx: usize },
    Rollback { tx: usize },
}

fn lock_op() -> impl Strategy<Value = LockOp> {
    prop_oneof![
        5 => (0..3usize, 0..2usize).prop_map(|(tx, key)| LockOp::Try { tx, key }),
        1 => (0..3usize).prop_map(|tx| LockOp::Commit { tx }),
        1 => (0..3usize).prop_map(|tx| LockOp::Rollback { tx }),
    ]
}

async fn lock_case(pool: &Pool, ops: Vec<LockOp>) -> Result<(), TestCaseError> {
    let keys: Vec<ResourceKey> = (0..2)
        .map(|_| ResourceKey::new(format!("model:{}", uuid::Uuid::new_v4())).expect("key"))
        .collect();
    let db = FakeDatabase::new();
    let fake_lock = FakeDistributedLock::new(&db);
    let pg_lock = PostgresDistributedLock::new(pool.clone());
    let mut fake_tx: Vec<Option<FakeTransaction>> = vec![None, None, None];
    let mut pg_tx: Vec<Option<PgTransaction>> = vec![None, None, None];
    for (step, op) in ops.iter().enumerate() {
        let (a, b) = match op {
            LockOp::Try { tx, key } => {
                // A transaction begins at its first statement.
                let f = fake_tx[*tx].get_or_insert_with(|| db.begin());
                if pg_tx[*tx].is_none() {
                    pg_tx[*tx] = Some(PgTransaction::begin(pool).await.expect("begin"));
                }
                let p = pg_tx[*tx].as_ref().expect("open");
                let a = fake_lock.try_acquire_for_transaction(f, &keys[*key]).await;
                let b = pg_lock.try_acquire_for_transaction(p, &keys[*key]).await;
                (
                    format!("{:?}", a.map_err(|e| e.kind())),
                    format!("{:?}", b.map_err(|e| e.kind())),
                )
            }
            LockOp::Commit { tx } => {
                let a = match fake_tx[*tx].take() {
                    Some(t) => format!("{:?}", t.commit().await.map_err(|e| e.kind())),
                    None => "idle".to_owned(),
                };
                let b = match pg_tx[*tx].take() {
                    Some(t) => format!("{:?}", t.commit().await.map_err(|e| e.kind())),
                    None => "idle".to_owned(),
                };
                (a, b)
            }
            LockOp::Rollback { tx } => {
                let a = match fake_tx[*tx].take() {
                    Some(t) => {
                        t.rollback().await;
                        "rolled back".to_owned()
                    }
                    None => "idle".to_owned(),
                };
                let b = match pg_tx[*tx].take() {
                    Some(t) => {
                        t.rollback().await.expect("rollback");
                        "rolled back".to_owned()
                    }
                    None => "idle".to_owned(),
                };
                (a, b)
            }
        };
        prop_assert_eq!(&a, &b, "step {} ({:?}) of {:?}", step, op, ops);
    }
    for (f, p) in fake_tx.into_iter().zip(pg_tx) {
        if let Some(f) = f {
            f.rollback().await;
        }
        if let Some(p) = p {
            p.rollback().await.expect("rollback");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_in_memory_locker_answers_like_postgres(ops in proptest::collection::vec(lease_op(), 1..30)) {
        let pool = &database().1;
        runtime().block_on(lease_case(pool, ops))?;
    }

    #[test]
    fn the_fake_transaction_lock_answers_like_postgres(ops in proptest::collection::vec(lock_op(), 1..30)) {
        let pool = &database().1;
        runtime().block_on(lock_case(pool, ops))?;
    }
}
