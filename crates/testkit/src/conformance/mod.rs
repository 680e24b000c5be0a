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
