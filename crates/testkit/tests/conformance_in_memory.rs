//! The shared conformance suites against the in-memory implementations, one test per case
//! (paused tokio time: lease expiry costs nothing). After each case, nothing is left locked
//! or waiting on the fake database.

use std::sync::Arc;

use lockstep_core::StreamLockOptions;
use lockstep_testkit::conformance::stream_locker::{SHORT_KEEPALIVE, SHORT_LOCK_TIMEOUT};
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, InMemoryStreamLocker};

/// A fake lock on a new database of its own.
fn fake_lock() -> FakeDistributedLock {
    FakeDistributedLock::new(&FakeDatabase::new())
}

/// No lock held and no statement waiting: the case left nothing behind.
fn nothing_left(db: &FakeDatabase) {
    assert!(db.held_keys().is_empty(), "the case leaves no lock behind");
    assert!(db.is_idle(), "the case leaves no lock or waiter behind");
}

mod stream_locker_with_default_options {
    use super::*;

    lockstep_testkit::stream_locker_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: InMemoryStreamLocker::new(StreamLockOptions::default()),
    }
}

mod stream_locker_with_short_options {
    use super::*;

    lockstep_testkit::stream_locker_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: InMemoryStreamLocker::new(
            StreamLockOptions::new(SHORT_LOCK_TIMEOUT, SHORT_KEEPALIVE).expect("valid options"),
        ),
    }
}

mod fleet_with_default_options {
    use super::*;

    lockstep_testkit::fleet_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: InMemoryStreamLocker::new(StreamLockOptions::default()),
    }
}

mod fleet_with_short_options {
    use super::*;

    lockstep_testkit::fleet_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: InMemoryStreamLocker::new(
            StreamLockOptions::new(SHORT_LOCK_TIMEOUT, SHORT_KEEPALIVE).expect("valid options"),
        ),
    }
}

mod distributed_lock {
    use super::*;

    lockstep_testkit::distributed_lock_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: fake_lock(),
        after_each: |lock: &FakeDistributedLock| nothing_left(lock.database()),
    }
}

mod distributed_lock_on_real_time_and_threads {
    use super::*;

    lockstep_testkit::distributed_lock_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fake_lock(),
        after_each: |lock: &FakeDistributedLock| nothing_left(lock.database()),
    }
}

mod lease_fence {
    use super::*;

    lockstep_testkit::lease_fence_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: InMemoryStreamLocker::with_database(
            StreamLockOptions::default(),
            &FakeDatabase::new(),
        ),
        // No cursor-row lock outlives its transaction.
        after_each: |locker: &InMemoryStreamLocker| {
            nothing_left(locker.database().expect("built with a database"));
        },
    }
}

mod session_lock {
    use super::*;

    lockstep_testkit::session_lock_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: fake_lock(),
        after_each: |lock: &FakeDistributedLock| nothing_left(lock.database()),
    }
}

/// `run_all` (kept for callers who want the whole suite in one test) runs every case too.
#[tokio::test(start_paused = true)]
async fn run_all_runs_every_case_of_every_suite_in_one_test() {
    let db = FakeDatabase::new();
    let locker = InMemoryStreamLocker::new(StreamLockOptions::default());
    lockstep_testkit::conformance::stream_locker::run_all(&locker).await;
    lockstep_testkit::conformance::stream_locker::run_all_fleet(&locker).await;
    let lock = Arc::new(FakeDistributedLock::new(&db));
    lockstep_testkit::conformance::distributed_lock::run_all(Arc::clone(&lock)).await;
    lockstep_testkit::conformance::session_lock::run_all(lock).await;
    let locker = InMemoryStreamLocker::with_database(StreamLockOptions::default(), &db);
    lockstep_testkit::conformance::lease_fence::run_all(Arc::new(locker)).await;
    nothing_left(&db);
}
