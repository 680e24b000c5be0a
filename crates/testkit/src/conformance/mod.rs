//! Conformance suites, written once and run against every implementation of a contract: the
//! in-memory fakes of this crate and each Postgres backend. A fake that disagrees with Postgres
//! is a bug in one of them. Feature `conformance`.
//!
//! **This module is not covered by semver.** Cases are added, tightened and renamed as the
//! contracts are pinned down, and fixture traits may grow, in any release. It is for
//! lockstep's own backends and for people writing a backend of their own; pin an exact version
//! (`lockstep-testkit = "=x.y.z"`) if you depend on it. Applications do not need it.
//!
//! Each suite is a module of public async functions, one per case, plus `run_all` (every case
//! in order, in one test), a fixture trait saying what the suite needs from a backend (how to
//! build the thing under test, where its transactions come from, how to create its data), and
//! a macro that expands to **one test per case**, so the first failure does not hide the others
//! and slow cases run in parallel:
//!
//! | suite | fixture trait | macro |
//! |---|---|---|
//! | [`stream_locker`] | [`StreamLockerFixture`](stream_locker::StreamLockerFixture) | [`stream_locker_conformance!`](crate::stream_locker_conformance) |
//! | [`stream_locker`], the fleet's cases | [`FleetFixture`](stream_locker::FleetFixture) | [`fleet_conformance!`](crate::fleet_conformance) |
//! | [`lease_fence`] | [`LeaseFenceFixture`](lease_fence::LeaseFenceFixture) | [`lease_fence_conformance!`](crate::lease_fence_conformance) |
//! | [`distributed_lock`] | [`DistributedLockFixture`](distributed_lock::DistributedLockFixture) | [`distributed_lock_conformance!`](crate::distributed_lock_conformance) |
//! | [`session_lock`] | [`SessionLockFixture`](session_lock::SessionLockFixture) | [`session_lock_conformance!`](crate::session_lock_conformance) |
//! | [`event_store`] | [`EventStoreFixture`](event_store::EventStoreFixture) | [`event_store_conformance!`](crate::event_store_conformance) |
//! | [`snapshot_store`] | [`EventStoreFixture`](event_store::EventStoreFixture) (a store that is also a `SnapshotStore`) | [`snapshot_store_conformance!`](crate::snapshot_store_conformance) |
//!
//! The fixture traits share one shape: associated types for what is under test (and for the
//! transactions and their [`TransactionSource`], where the contract is transaction-bound),
//! accessors returning references, and `impl Future` for anything async. The fakes are their
//! own fixtures ([`InMemoryStreamLocker`](crate::InMemoryStreamLocker) for the stream-locker
//! suite, and for the fence suite when built with a database;
//! [`FakeDistributedLock`](crate::FakeDistributedLock) for the lock suites);
//! [`event_store::Fixture`] pairs any source with any store.
//!
//! A backend's test file, one test per case on a database of its own:
//!
//! ```no_run
//! # mod pg { pub async fn fixture() -> lockstep_testkit::FakeDistributedLock {
//! #     lockstep_testkit::FakeDistributedLock::new(&lockstep_testkit::FakeDatabase::new()) } }
//! // `fixture()` builds the backend on a fresh database (e.g. with `pg_harness`).
//! use pg::fixture;
//!
//! lockstep_testkit::distributed_lock_conformance! {
//!     #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
//!     fixture: fixture().await,
//! }
//! # fn main() {}
//! ```

pub mod distributed_lock;
pub mod event_store;
pub mod lease_fence;
pub mod perspective_store;
pub mod session_lock;
pub mod snapshot_store;
pub mod stream_locker;

use lockstep_core::{Result, Transaction, TransactionSource, Upcasters};

/// A store that can be had reading through upcasters, over the same storage: how the generic
/// fixtures ([`event_store::Fixture`], [`perspective_store::Fixture`]) build the store of the
/// upcasting cases. A backend's own fixture implements
/// [`EventStoreFixture::store_with_upcasters`](event_store::EventStoreFixture::store_with_upcasters)
/// (and the perspective-store one) directly, with its store's `with_upcasters`.
pub trait Upcasting: Sized {
    /// This store's storage, read through `upcasters`.
    fn upcasting(&self, upcasters: Upcasters) -> Self;
}

impl Upcasting for crate::InMemoryEventStore {
    fn upcasting(&self, upcasters: Upcasters) -> Self {
        self.clone().with_upcasters(upcasters)
    }
}

impl Upcasting for crate::InMemoryPerspectiveStore {
    fn upcasting(&self, upcasters: Upcasters) -> Self {
        self.clone().with_upcasters(upcasters)
    }
}

/// A fresh recording of the inner store read through the upcasters.
impl<S: Upcasting> Upcasting for crate::RecordingEventStore<S> {
    fn upcasting(&self, upcasters: Upcasters) -> Self {
        crate::RecordingEventStore::new(self.inner().upcasting(upcasters))
    }
}

/// The inner store read through the upcasters, with faults of its own (none armed).
impl<S: Upcasting> Upcasting for crate::FaultyEventStore<S> {
    fn upcasting(&self, upcasters: Upcasters) -> Self {
        crate::FaultyEventStore::new(self.inner().upcasting(upcasters)).0
    }
}

/// A fresh recording of the inner store read through the upcasters.
impl<S: Upcasting> Upcasting for crate::RecordingPerspectiveStore<S> {
    fn upcasting(&self, upcasters: Upcasters) -> Self {
        crate::RecordingPerspectiveStore::new(self.inner().upcasting(upcasters))
    }
}

/// The inner store read through the upcasters, with faults of its own (none armed).
impl<S: Upcasting> Upcasting for crate::FaultyPerspectiveStore<S> {
    fn upcasting(&self, upcasters: Upcasters) -> Self {
        crate::FaultyPerspectiveStore::new(self.inner().upcasting(upcasters)).0
    }
}

/// Begins a transaction for a case; a backend that cannot begin fails the case.
async fn begin<S: TransactionSource>(source: &S) -> S::Tx {
    source.begin().await.expect("beginning a transaction")
}

/// Commits, reporting failure (some cases expect a commit to fail).
async fn commit<T: Transaction>(tx: T) -> Result<()> {
    tx.commit().await
}

/// Rolls back; a backend that cannot confirm the rollback fails the case.
async fn rollback<T: Transaction>(tx: T) {
    tx.rollback().await.expect("rolling back");
}

/// Waits until `waiting()` shows at least `n` statements waiting for a lock or row held by
/// another transaction: what the database says, not a guess at how long a concurrent writer
/// takes to get there (which a busy machine makes wrong). Bounded: a writer that never waits
/// within a minute fails the case with `what`.
async fn until_waiting<Fut>(mut waiting: impl FnMut() -> Fut, n: usize, what: &str)
where
    Fut: std::future::Future<Output = usize>,
{
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    while waiting().await < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not waiting after 60 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Calls an `after_each:` check of the suite macros (a function, so the closure's argument
/// type is known).
#[doc(hidden)]
pub fn __after_each<F: ?Sized>(fixture: &F, check: impl FnOnce(&F)) {
    check(fixture);
}

/// The tests of one suite macro: one per case. Internal to the suite macros.
#[doc(hidden)]
#[macro_export]
macro_rules! __lockstep_conformance_tests {
    (
        suite: $suite:ident,
        pass: $pass:ident,
        attrs: $attrs:tt,
        fixture: $fixture:expr,
        after_each: $after:tt,
        cases: [$($case:ident),* $(,)?]
    ) => {
        $(
            $crate::__lockstep_conformance_test! { $suite $pass $attrs ($fixture) $after $case }
        )*
    };
}

/// One test of a suite macro. Internal to the suite macros.
#[doc(hidden)]
#[macro_export]
macro_rules! __lockstep_conformance_test {
    (
        $suite:ident by_ref [$(#[$attr:meta])*] ($fixture:expr) [$($after:expr)?] $case:ident
    ) => {
        $(#[$attr])*
        async fn $case() {
            let fixture = $fixture;
            $crate::conformance::$suite::$case(&fixture).await;
            $( $crate::conformance::__after_each(&fixture, $after); )?
        }
    };
    (
        $suite:ident by_arc [$(#[$attr:meta])*] ($fixture:expr) [$($after:expr)?] $case:ident
    ) => {
        $(#[$attr])*
        async fn $case() {
            let fixture = ::std::sync::Arc::new($fixture);
            $crate::conformance::$suite::$case(::std::sync::Arc::clone(&fixture)).await;
            $( $crate::conformance::__after_each(&*fixture, $after); )?
        }
    };
}

/// The body of a suite's `run_all`: every case, in order. Internal to the suites.
#[doc(hidden)]
#[macro_export]
macro_rules! __lockstep_conformance_run_all {
    (by_ref $fixture:ident cases: [$($case:ident),* $(,)?]) => {
        $( $case($fixture).await; )*
    };
    (by_arc $fixture:ident cases: [$($case:ident),* $(,)?]) => {
        $( $case(::std::sync::Arc::clone(&$fixture)).await; )*
    };
}
