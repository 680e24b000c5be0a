//! The shared conformance suites against the in-memory implementations (paused tokio time: lease
//! expiry costs nothing).

use std::sync::Arc;

use lockstep_core::StreamLockOptions;
use lockstep_testkit::conformance::{distributed_lock, stream_locker};
use lockstep_testkit::{FakeDatabase, FakeDistributedLock, InMemoryStreamLocker};

#[tokio::test(start_paused = true)]
async fn in_memory_stream_locker_passes_the_stream_locker_suite_with_default_options() {
    stream_locker::run_all(&InMemoryStreamLocker::new(StreamLockOptions::default())).await;
}

#[tokio::test(start_paused = true)]
async fn in_memory_stream_locker_passes_the_stream_locker_suite_with_short_options() {
    let options = StreamLockOptions::new(
        lockstep_testkit::stream_locker::SHORT_LOCK_TIMEOUT,
        lockstep_testkit::stream_locker::SHORT_KEEPALIVE,
    )
    .expect("valid options");
    stream_locker::run_all(&InMemoryStreamLocker::new(options)).await;
}

#[tokio::test(start_paused = true)]
async fn fake_distributed_lock_passes_the_distributed_lock_suite() {
    let db = FakeDatabase::new();
    distributed_lock::run_all(Arc::new(FakeDistributedLock::new(&db))).await;
    assert!(db.held_keys().is_empty(), "the suite leaves no lock behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_distributed_lock_passes_the_distributed_lock_suite_on_real_time_and_threads() {
    let db = FakeDatabase::new();
    distributed_lock::run_all(Arc::new(FakeDistributedLock::new(&db))).await;
    assert!(db.held_keys().is_empty());
}

#[tokio::test(start_paused = true)]
async fn in_memory_stream_locker_passes_the_lease_fence_suite() {
    let db = FakeDatabase::new();
    let locker = InMemoryStreamLocker::with_database(StreamLockOptions::default(), &db);
    lockstep_testkit::conformance::lease_fence::run_all(Arc::new(locker)).await;
    assert!(
        db.held_keys().is_empty(),
        "no row lock outlives its transaction"
    );
}

#[tokio::test(start_paused = true)]
async fn fake_session_locks_pass_the_session_lock_suite() {
    let db = FakeDatabase::new();
    lockstep_testkit::conformance::session_lock::run_all(Arc::new(FakeDistributedLock::new(&db)))
        .await;
    assert!(db.held_keys().is_empty());
}
