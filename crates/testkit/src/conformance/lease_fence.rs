//! The fenced-commit conformance suite: work protected by a stream lease commits only while the
//! lease is still held at the same epoch, and a takeover cannot slip in between the check and
//! the commit.
//!
//! Run it with [`lease_fence_conformance!`](crate::lease_fence_conformance) (one test per
//! case), or call the cases or [`run_all`] yourself.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::{
    AcquireOutcome, ErrorKind, InstanceId, LeaseFence, LockReason, PerspectiveName, StreamId,
    StreamLease, StreamLockAdmin, StreamLocker, TransactionSource,
};

use super::stream_locker::StreamLockerFixture;
use super::{begin, commit, rollback};
use crate::{FakeDatabase, FakeTransaction, InMemoryStreamLocker};

/// What the suite needs beyond a [`StreamLockerFixture`]: the fence and transactions of the type
/// it checks in.
pub trait LeaseFenceFixture: StreamLockerFixture {
    /// An owned, open transaction.
    type Tx: lockstep_core::Transaction;
    /// The transaction source.
    type Source: TransactionSource<Tx = Self::Tx>;
    /// The fence under test (normally the locker itself).
    type Fence: LeaseFence<Self::Tx> + 'static;

    /// The fence under test, over the same storage as the locker.
    fn fence(&self) -> &Self::Fence;

    /// Where the suite's transactions come from.
    fn source(&self) -> &Self::Source;
}

/// The in-memory locker is its own fixture when built
/// [`with_database`](InMemoryStreamLocker::with_database): transactions are begun on that
/// database. Panics (failing the case) on a locker built without one.
impl LeaseFenceFixture for InMemoryStreamLocker {
    type Tx = FakeTransaction;
    type Source = FakeDatabase;
    type Fence = InMemoryStreamLocker;

    fn fence(&self) -> &InMemoryStreamLocker {
        self
    }

    fn source(&self) -> &FakeDatabase {
        self.database()
            .expect("the lease-fence fixture needs InMemoryStreamLocker::with_database")
    }
}

async fn leased<F: LeaseFenceFixture>(fixture: &F) -> (StreamId, PerspectiveName, StreamLease) {
    let (stream, name) = (
        StreamId::new_v7(),
        PerspectiveName::new("FencedPerspective").expect("valid"),
    );
    fixture.create_cursor(stream, &name).await;
    let lease = match fixture
        .locker()
        .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("try_acquire")
    {
        AcquireOutcome::Acquired(lease) => lease,
        other => panic!("expected to acquire, got {other:?}"),
    };
    (stream, name, lease)
}

async fn wait_past_expiry<F: LeaseFenceFixture>(fixture: &F) {
    let timeout = fixture.locker().options().lock_timeout();
    tokio::time::sleep(timeout + timeout / 2 + Duration::from_millis(50)).await;
}

/// The current holder's fence check passes and its transaction commits.
pub async fn fence_passes_for_the_current_holder<F: LeaseFenceFixture>(fixture: Arc<F>) {
    let (_, _, lease) = leased(&*fixture).await;
    let tx = begin(fixture.source()).await;
    fixture
        .fence()
        .check_lease(&tx, &lease.id)
        .await
        .expect("the holder passes the fence");
    commit(tx).await.expect("commit");
    let _ = fixture.locker().release(&lease.id).await.expect("release");
}

/// After expiry and takeover by another instance, the old holder's fence fails with
/// `LeaseLost`.
pub async fn fence_fails_after_takeover<F: LeaseFenceFixture>(fixture: Arc<F>) {
    let (stream, name, old) = leased(&*fixture).await;
    wait_past_expiry(&*fixture).await;
    let taken = fixture
        .locker()
        .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("try_acquire");
    assert!(taken.is_acquired());
    let tx = begin(fixture.source()).await;
    let err = fixture
        .fence()
        .check_lease(&tx, &old.id)
        .await
        .expect_err("stale holder is fenced out");
    assert_eq!(err.kind(), ErrorKind::LeaseLost, "{err}");
    rollback(tx).await;
}

/// An expired lease fails the fence even before anyone takes it over.
pub async fn fence_fails_after_expiry<F: LeaseFenceFixture>(fixture: Arc<F>) {
    let (_, _, lease) = leased(&*fixture).await;
    wait_past_expiry(&*fixture).await;
    let tx = begin(fixture.source()).await;
    let err = fixture
        .fence()
        .check_lease(&tx, &lease.id)
        .await
        .expect_err("expired");
    assert_eq!(err.kind(), ErrorKind::LeaseLost);
    rollback(tx).await;
}

/// Force-release fences the old holder out at once.
pub async fn fence_fails_after_force_release<F: LeaseFenceFixture>(fixture: Arc<F>) {
    let (stream, name, lease) = leased(&*fixture).await;
    let released = fixture
        .admin()
        .force_release(stream, &name)
        .await
        .expect("force release");
    assert!(released.is_released());
    let tx = begin(fixture.source()).await;
    let err = fixture
        .fence()
        .check_lease(&tx, &lease.id)
        .await
        .expect_err("force-released");
    assert_eq!(err.kind(), ErrorKind::LeaseLost);
    rollback(tx).await;
}

/// A takeover of an expired lease is refused at once while a fenced transaction is open
/// (try-acquire never waits: [`AcquireOutcome::Busy`], the cursor row is in use, and nothing is
/// written) and succeeds once it ends.
pub async fn fence_holds_off_a_takeover_until_the_transaction_ends<F: LeaseFenceFixture>(
    fixture: Arc<F>,
) {
    let (stream, name, lease) = leased(&*fixture).await;
    let tx = begin(fixture.source()).await;
    fixture
        .fence()
        .check_lease(&tx, &lease.id)
        .await
        .expect("holder passes");
    wait_past_expiry(&*fixture).await;
    let takeover = || {
        fixture
            .locker()
            .try_acquire(stream, &name, InstanceId::random(), &LockReason::Bootstrap)
    };
    let busy = tokio::time::timeout(Duration::from_secs(5), takeover())
        .await
        .expect("try-acquire does not wait for the fenced transaction")
        .expect("a busy row is an outcome, not an error");
    assert_eq!(busy, AcquireOutcome::Busy);
    assert!(!busy.is_acquired());
    commit(tx).await.expect("the fenced commit succeeds");
    let outcome = takeover().await.expect("try_acquire");
    assert!(
        outcome.is_acquired(),
        "expired lease taken over: {outcome:?}"
    );
}

/// A fence check that finds the lease lost locks nothing (the `WHERE` rejected the row): while
/// its transaction is still open, another instance takes the expired lease over at once.
pub async fn a_fence_check_that_finds_the_lease_lost_locks_nothing<F: LeaseFenceFixture>(
    fixture: Arc<F>,
) {
    let (stream, name, lease) = leased(&*fixture).await;
    wait_past_expiry(&*fixture).await;
    let tx = begin(fixture.source()).await;
    let err = fixture
        .fence()
        .check_lease(&tx, &lease.id)
        .await
        .expect_err("expired");
    assert_eq!(err.kind(), ErrorKind::LeaseLost, "{err}");
    let outcome = tokio::time::timeout(
        Duration::from_secs(5),
        fixture
            .locker()
            .try_acquire(stream, &name, InstanceId::random(), &LockReason::Bootstrap),
    )
    .await
    .expect("try-acquire never waits")
    .expect("the cursor row is not locked by the failed fence check");
    assert!(
        outcome.is_acquired(),
        "expired lease taken over: {outcome:?}"
    );
    rollback(tx).await;
}

/// Runs every case, in order, in one test. Prefer
/// [`lease_fence_conformance!`](crate::lease_fence_conformance): a test per case.
pub async fn run_all<F: LeaseFenceFixture>(fixture: Arc<F>) {
    crate::__lockstep_lease_fence_cases!(__lockstep_conformance_run_all! { by_arc fixture });
}

#[doc(hidden)]
#[macro_export]
macro_rules! __lockstep_lease_fence_cases {
    ($then:ident ! { $($args:tt)* }) => {
        $crate::$then! { $($args)* cases: [
            fence_passes_for_the_current_holder,
            fence_fails_after_takeover,
            fence_fails_after_expiry,
            fence_fails_after_force_release,
            fence_holds_off_a_takeover_until_the_transaction_ends,
            a_fence_check_that_finds_the_lease_lost_locks_nothing,
        ] }
    };
}

/// Expands to one test per case of the [fenced-commit conformance
/// suite](crate::conformance::lease_fence), each on a fixture of its own.
///
/// `fixture:` is an expression evaluated inside each test (it may `.await`) that yields a
/// [`LeaseFenceFixture`](crate::conformance::lease_fence::LeaseFenceFixture); the test wraps it in an `Arc`.
/// Attributes written first replace the default `#[tokio::test]`:
/// `#[tokio::test(start_paused = true)]` for the fakes,
/// `#[tokio::test(flavor = "multi_thread")]` for a database. `after_each:` (optional) is a
/// closure called with `&fixture` after the case passed, to check what the case left behind.
/// See [`stream_locker_conformance!`](crate::stream_locker_conformance) for what the calling
/// crate needs. Not covered by semver (see [`conformance`](crate::conformance)).
///
/// ```
/// mod in_memory {
///     use lockstep_core::StreamLockOptions;
///     use lockstep_testkit::{FakeDatabase, InMemoryStreamLocker};
///
///     lockstep_testkit::lease_fence_conformance! {
///         #[tokio::test(start_paused = true)]
///         fixture: InMemoryStreamLocker::with_database(
///             StreamLockOptions::default(),
///             &FakeDatabase::new(),
///         ),
///     }
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! lease_fence_conformance {
    ($(#[$attr:meta])+ fixture: $fixture:expr $(, after_each: $after:expr)? $(,)?) => {
        $crate::__lockstep_lease_fence_cases!(__lockstep_conformance_tests! {
            suite: lease_fence,
            pass: by_arc,
            attrs: [$(#[$attr])+],
            fixture: $fixture,
            after_each: [$($after)?],
        });
    };
    (fixture: $($rest:tt)*) => {
        $crate::lease_fence_conformance! { #[::tokio::test] fixture: $($rest)* }
    };
}
