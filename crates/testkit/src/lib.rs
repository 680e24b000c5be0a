//! # lockstep-testkit
//!
//! Test support for lockstep and for applications built on it.
//!
//! - In-memory implementations of every contract, on tokio's clock so tests can expire leases
//!   with paused time.
//! - The shared [`conformance`] suites that the fakes and every Postgres backend pass.
//! - [`pg_harness`]: a fresh PostgreSQL database per test (feature `postgres`).

pub mod conformance;
pub mod fake_lock;
#[cfg(feature = "postgres")]
pub mod pg_harness;

pub use fake_lock::{
    FakeDatabase, FakeDistributedLock, FakeSessionGuard, FakeSessionLocks, FakeTransaction,
    LockOwner, TxEnd,
};
