//! The distributed-lock conformance suite: transaction-scoped exclusion, re-entrancy, release
//! at commit and rollback, blocking acquire.
//!
//! Every case uses fresh random keys, so the suite can run against a shared database.
//!
//! Run it with [`distributed_lock_conformance!`](crate::distributed_lock_conformance) (one test
//! per case), or call the cases or [`run_all`] yourself.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::{DistributedLock, ResourceKey, TransactionSource};

use super::{begin, commit, rollback};
use crate::{FakeDatabase, FakeDistributedLock, FakeTransaction};

/// What the suite needs from a backend: the lock under test and owned transactions of the type
/// it locks on.
pub trait DistributedLockFixture: Send + Sync + 'static {
    /// An owned, open transaction (must be `'static` so a waiting writer can be spawned).
    type Tx: lockstep_core::Transaction;
    /// Where the suite's transactions come from (each on its own connection, for a database
    /// backend).
    type Source: TransactionSource<Tx = Self::Tx>;
    /// The lock under test.
    type Lock: DistributedLock<Self::Tx> + 'static;

    /// The lock under test.
    fn lock(&self) -> &Self::Lock;

    /// The transaction source.
    fn source(&self) -> &Self::Source;
}

/// The fake lock is its own fixture: transactions are begun on its database.
impl DistributedLockFixture for FakeDistributedLock {
    type Tx = FakeTransaction;
    type Source = FakeDatabase;
    type Lock = FakeDistributedLock;

    fn lock(&self) -> &FakeDistributedLock {
        self
    }

    fn source(&self) -> &FakeDatabase {
        self.database()
    }
}

fn fresh_key() -> ResourceKey {
    ResourceKey::new(format!("conformance:{}", uuid::Uuid::new_v4())).expect("valid key")
}

async fn try_lock<F: DistributedLockFixture>(fixture: &F, tx: &F::Tx, key: &ResourceKey) -> bool {
    fixture
        .lock()
        .try_acquire_for_transaction(tx, key)
        .await
        .expect("try_acquire_for_transaction")
}

/// While one transaction holds a key, another transaction's try-acquire is denied.
pub async fn same_key_in_two_transactions_excludes<F: DistributedLockFixture>(fixture: Arc<F>) {
    let key = fresh_key();
    let (a, b) = (begin(fixture.source()).await, begin(fixture.source()).await);
    assert!(try_lock(&*fixture, &a, &key).await);
    assert!(!try_lock(&*fixture, &b, &key).await);
    rollback(b).await;
    rollback(a).await;
}

/// Different keys never block each other.
pub async fn different_keys_never_block<F: DistributedLockFixture>(fixture: Arc<F>) {
    let (k1, k2) = (fresh_key(), fresh_key());
    let (a, b) = (begin(fixture.source()).await, begin(fixture.source()).await);
    assert!(try_lock(&*fixture, &a, &k1).await);
    assert!(try_lock(&*fixture, &b, &k2).await);
    let blocking = fixture
        .lock()
        .acquire_for_transaction(&b, &fresh_key(), Some(Duration::from_secs(5)))
        .await;
    assert!(
        blocking.is_ok(),
        "a free key is acquired at once: {blocking:?}"
    );
    commit(a).await.expect("commit");
    commit(b).await.expect("commit");
}

/// The lock is re-entrant within one transaction, and still exclusive to it.
pub async fn reentrant_within_one_transaction<F: DistributedLockFixture>(fixture: Arc<F>) {
    let key = fresh_key();
    let (a, b) = (begin(fixture.source()).await, begin(fixture.source()).await);
    assert!(try_lock(&*fixture, &a, &key).await);
    assert!(try_lock(&*fixture, &a, &key).await);
    fixture
        .lock()
        .acquire_for_transaction(&a, &key, Some(Duration::from_secs(5)))
        .await
        .expect("re-entrant blocking acquire");
    assert!(!try_lock(&*fixture, &b, &key).await);
    rollback(b).await;
    commit(a).await.expect("commit");
}

/// Commit releases the transaction's locks.
pub async fn released_at_commit<F: DistributedLockFixture>(fixture: Arc<F>) {
    let key = fresh_key();
    let a = begin(fixture.source()).await;
    assert!(try_lock(&*fixture, &a, &key).await);
    assert!(try_lock(&*fixture, &a, &key).await, "held twice");
    commit(a).await.expect("commit");
    let b = begin(fixture.source()).await;
    assert!(
        try_lock(&*fixture, &b, &key).await,
        "released by commit, however deep"
    );
    rollback(b).await;
}

/// Rollback releases the transaction's locks.
pub async fn released_at_rollback<F: DistributedLockFixture>(fixture: Arc<F>) {
    let key = fresh_key();
    let a = begin(fixture.source()).await;
    assert!(try_lock(&*fixture, &a, &key).await);
    rollback(a).await;
    let b = begin(fixture.source()).await;
    assert!(try_lock(&*fixture, &b, &key).await, "released by rollback");
    rollback(b).await;
}

/// A blocking acquire waits while the holder's transaction is open (still pending 200 ms
/// later) and completes once the holder ends (within 5 s), by commit or rollback.
pub async fn blocking_acquire_completes_once_the_holder_ends<F: DistributedLockFixture>(
    fixture: Arc<F>,
) {
    for end_by_commit in [true, false] {
        let key = fresh_key();
        let a = begin(fixture.source()).await;
        assert!(try_lock(&*fixture, &a, &key).await);
        let waiter = {
            let (fixture, key) = (Arc::clone(&fixture), key.clone());
            tokio::spawn(async move {
                let b = begin(fixture.source()).await;
                let result = fixture.lock().acquire_for_transaction(&b, &key, None).await;
                (b, result)
            })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !waiter.is_finished(),
            "the waiter is still waiting 200 ms later"
        );
        if end_by_commit {
            commit(a).await.expect("commit");
        } else {
            rollback(a).await;
        }
        let (b, result) = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter completes within 5 s of the holder ending")
            .expect("waiter task");
        result.expect("the waiter holds the lock");
        let c = begin(fixture.source()).await;
        assert!(
            !try_lock(&*fixture, &c, &key).await,
            "now the waiter holds it"
        );
        rollback(c).await;
        commit(b).await.expect("commit");
    }
}

/// A blocking acquire with a timeout fails with [`lockstep_core::ErrorKind::LockTimeout`] and
/// leaves the holder holding.
pub async fn acquire_with_timeout_fails_with_lock_timeout<F: DistributedLockFixture>(
    fixture: Arc<F>,
) {
    let key = fresh_key();
    let (a, b) = (begin(fixture.source()).await, begin(fixture.source()).await);
    assert!(try_lock(&*fixture, &a, &key).await);
    let err = fixture
        .lock()
        .acquire_for_transaction(&b, &key, Some(Duration::from_millis(100)))
        .await
        .expect_err("the wait times out");
    assert_eq!(err.kind(), lockstep_core::ErrorKind::LockTimeout, "{err}");
    assert!(err.is_retryable());
    rollback(b).await;
    let c = begin(fixture.source()).await;
    assert!(
        !try_lock(&*fixture, &c, &key).await,
        "the holder still holds"
    );
    rollback(c).await;
    commit(a).await.expect("commit");
}

/// A timeout longer than Postgres's `lock_timeout` can hold (`i32::MAX` milliseconds, about
/// 24.8 days) is [`lockstep_core::ErrorKind::InvalidInput`] before anything is locked or sent:
/// the transaction stays usable and the key free. The longest accepted timeout works.
pub async fn a_timeout_beyond_what_postgres_accepts_is_invalid_input<F: DistributedLockFixture>(
    fixture: Arc<F>,
) {
    let key = fresh_key();
    let longest = Duration::from_millis(i32::MAX as u64);
    let tx = begin(fixture.source()).await;
    for too_long in [longest + Duration::from_micros(1), Duration::MAX] {
        let err = fixture
            .lock()
            .acquire_for_transaction(&tx, &key, Some(too_long))
            .await
            .expect_err("refused");
        assert_eq!(err.kind(), lockstep_core::ErrorKind::InvalidInput, "{err}");
        assert!(err.validation().is_some(), "typed: {err}");
    }
    let other = begin(fixture.source()).await;
    assert!(try_lock(&*fixture, &other, &key).await, "nothing locked");
    rollback(other).await;
    fixture
        .lock()
        .acquire_for_transaction(&tx, &key, Some(longest))
        .await
        .expect("the longest timeout is accepted, and the transaction is usable");
    commit(tx).await.expect("commit");
}

/// Dropping a waiting acquire leaves no waiter behind: once the holder ends, the key is free
/// for anyone at once.
pub async fn dropped_waiting_acquire_leaves_no_ghost<F: DistributedLockFixture>(fixture: Arc<F>) {
    let key = fresh_key();
    let (a, b) = (begin(fixture.source()).await, begin(fixture.source()).await);
    assert!(try_lock(&*fixture, &a, &key).await);
    let abandoned = tokio::time::timeout(
        Duration::from_millis(100),
        fixture.lock().acquire_for_transaction(&b, &key, None),
    )
    .await;
    assert!(
        abandoned.is_err(),
        "the acquire was still waiting when dropped"
    );
    rollback(b).await;
    commit(a).await.expect("commit");
    let c = begin(fixture.source()).await;
    let acquired = tokio::time::timeout(
        Duration::from_secs(5),
        fixture.lock().acquire_for_transaction(&c, &key, None),
    )
    .await
    .expect("no ghost waiter holds the key");
    acquired.expect("acquired");
    commit(c).await.expect("commit");
}

/// Runs every case, in order, in one test. Prefer
/// [`distributed_lock_conformance!`](crate::distributed_lock_conformance): a test per case.
pub async fn run_all<F: DistributedLockFixture>(fixture: Arc<F>) {
    crate::__lockstep_distributed_lock_cases!(__lockstep_conformance_run_all! { by_arc fixture });
}

#[doc(hidden)]
#[macro_export]
macro_rules! __lockstep_distributed_lock_cases {
    ($then:ident ! { $($args:tt)* }) => {
        $crate::$then! { $($args)* cases: [
            same_key_in_two_transactions_excludes,
            different_keys_never_block,
            reentrant_within_one_transaction,
            released_at_commit,
            released_at_rollback,
            blocking_acquire_completes_once_the_holder_ends,
            acquire_with_timeout_fails_with_lock_timeout,
            a_timeout_beyond_what_postgres_accepts_is_invalid_input,
            dropped_waiting_acquire_leaves_no_ghost,
        ] }
    };
}

/// Expands to one test per case of the [distributed-lock conformance
/// suite](crate::conformance::distributed_lock), each on a fixture of its own.
///
/// `fixture:` is an expression evaluated inside each test (it may `.await`) that yields a
/// [`DistributedLockFixture`](crate::conformance::distributed_lock::DistributedLockFixture); the test wraps it in an `Arc`.
/// Attributes written first replace the default `#[tokio::test]`:
/// `#[tokio::test(start_paused = true)]` for the fakes,
/// `#[tokio::test(flavor = "multi_thread")]` for a database. `after_each:` (optional) is a
/// closure called with `&fixture` after the case passed, to check what the case left behind.
/// See [`stream_locker_conformance!`](crate::stream_locker_conformance) for what the calling
/// crate needs. Not covered by semver (see [`conformance`](crate::conformance)).
///
/// ```
/// mod fake {
///     use lockstep_testkit::{FakeDatabase, FakeDistributedLock};
///
///     lockstep_testkit::distributed_lock_conformance! {
///         #[tokio::test(start_paused = true)]
///         fixture: FakeDistributedLock::new(&FakeDatabase::new()),
///         after_each: |lock: &FakeDistributedLock| assert!(lock.database().held_keys().is_empty()),
///     }
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! distributed_lock_conformance {
    ($(#[$attr:meta])+ fixture: $fixture:expr $(, after_each: $after:expr)? $(,)?) => {
        $crate::__lockstep_distributed_lock_cases!(__lockstep_conformance_tests! {
            suite: distributed_lock,
            pass: by_arc,
            attrs: [$(#[$attr])+],
            fixture: $fixture,
            after_each: [$($after)?],
        });
    };
    (fixture: $($rest:tt)*) => {
        $crate::distributed_lock_conformance! { #[::tokio::test] fixture: $($rest)* }
    };
}
