//! # lockstep-testkit
//!
//! Test support for lockstep and for applications built on it.
//!
//! - In-memory implementations of every contract, on tokio's clock so tests can expire leases
//!   with paused time.
//!   [`InMemoryStreamLocker`] for stream leases; [`FakeDatabase`], [`FakeTransaction`],
//!   [`FakeDistributedLock`] and [`FakeSessionLocks`] for the distributed lock and, through
//!   `lockstep_core::DistributedAggregateWriteLock`, the aggregate write lock.
//!   [`InMemoryEventStore`] for the event store, on the same fake transactions.
//! - Wrappers users can drive: [`RecordingStreamLocker`] / [`RecordingDistributedLock`] /
//!   [`RecordingEventStore`] (what was called, with which reason, key or events, in order, and
//!   what came back) and [`FaultyStreamLocker`] / [`FaultyDistributedLock`] /
//!   [`FaultyEventStore`] with a [`FaultHandle`] (deny the next acquire, fail the next N renews,
//!   fail the next N appends with a conflict, add latency).
//! - The shared [`conformance`] suites that the fakes and every Postgres backend pass.
//! - [`pg_harness`]: a fresh PostgreSQL database per test (feature `postgres`).

pub mod conformance;
pub mod event_store;
pub mod fake_lock;
pub mod faults;
#[cfg(feature = "postgres")]
pub mod pg_harness;
pub mod recording;
pub mod stream_locker;

pub use event_store::InMemoryEventStore;
pub use fake_lock::{
    FakeDatabase, FakeDistributedLock, FakeSessionGuard, FakeSessionLocks, FakeTransaction,
    LockOwner, TxEnd,
};
pub use faults::{FaultHandle, FaultyDistributedLock, FaultyEventStore, FaultyStreamLocker};
pub use recording::{
    EventStoreCall, LockCall, LockMode, RecordingDistributedLock, RecordingEventStore,
    RecordingStreamLocker, StreamLockCall,
};
pub use stream_locker::InMemoryStreamLocker;
