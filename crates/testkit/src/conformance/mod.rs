//! Conformance suites, written once and run against every implementation of a contract: the
//! in-memory fakes of this crate and each Postgres backend. A fake that disagrees with Postgres
//! is a bug in one of them.
//!
//! Each suite is a set of public async functions, one per case, plus a `run_*` function that
//! runs every case in order. A backend's test provides a fixture (how to build the thing under
//! test, how to create its data) and calls the suite:
//!
//! ```no_run
//! # async fn demo() {
//! use lockstep_testkit::conformance::stream_locker;
//! use lockstep_testkit::InMemoryStreamLocker;
//!
//! let fixture = InMemoryStreamLocker::new(Default::default());
//! stream_locker::run_all(&fixture).await;
//! # }
//! ```

pub mod distributed_lock;
pub mod event_store;
pub mod lease_fence;
pub mod session_lock;
pub mod stream_locker;

use lockstep_core::{Result, TransactionSource};

/// Begins a transaction for a case; a backend that cannot begin fails the case.
async fn begin<S: TransactionSource>(source: &S) -> S::Tx {
    source.begin().await.expect("beginning a transaction")
}

/// Commits, reporting failure (some cases expect a commit to fail).
async fn commit<S: TransactionSource>(source: &S, tx: S::Tx) -> Result<()> {
    source.commit(tx).await
}

/// Rolls back; a backend that cannot confirm the rollback fails the case.
async fn rollback<S: TransactionSource>(source: &S, tx: S::Tx) {
    source.rollback(tx).await.expect("rolling back");
}
