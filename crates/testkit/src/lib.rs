//! # lockstep-testkit
//!
//! Test support for lockstep and for applications built on it, for three audiences, each with
//! the feature it needs:
//!
//! | you are | you use | features |
//! |---|---|---|
//! | an application testing its domain code | the fakes and the wrappers | none (the default) |
//! | a crate testing against a real PostgreSQL | `pg_harness` | `pg-harness` (`testcontainers` adds the container fallback) |
//! | a backend (lockstep's own, or yours) | the `conformance` suites | `conformance` (and usually `pg-harness`) |
//! | a test injecting network faults (a stall, a slow link, a lost reply) | the `relay` | `relay` (with `pg-harness` for its Postgres helpers) |
//!
//! With no feature, the testkit pulls neither a Postgres driver nor testcontainers into an
//! application's dev-dependencies:
//!
//! ```toml
//! [dev-dependencies]
//! lockstep-testkit = "0.1"
//! # a backend's tests:
//! # lockstep-testkit = { version = "0.1", features = ["conformance", "pg-harness"] }
//! ```
//!
//! What it offers:
//!
//! - In-memory implementations of every contract, on tokio's clock so tests can expire leases
//!   with paused time.
//!   [`InMemoryStreamLocker`] for stream leases (and fenced commits); [`FakeDatabase`],
//!   [`FakeTransaction`], [`FakeDistributedLock`] and [`FakeSessionLocks`] for the distributed
//!   lock and, through `lockstep_core::DistributedAggregateWriteLock`, the aggregate write lock.
//!   [`InMemoryEventStore`] for the event store, on the same fake transactions. Every wait in
//!   the fakes goes through one wait graph on the [`FakeDatabase`], so deadlocks are reported
//!   whichever fakes they span. [`FakeTable`] is an application table in memory whose writes
//!   commit and roll back with a [`FakeTransaction`], for table perspectives
//!   (`lockstep_core::TablePerspective`) on the fakes.
//! - Wrappers users can drive: [`RecordingStreamLocker`] / [`RecordingDistributedLock`] /
//!   [`RecordingEventStore`] (what was called, with which reason, key or events, in order, and
//!   what came back — a value, or the [`ErrorKind`](lockstep_core::ErrorKind) of the error),
//!   and [`FaultyStreamLocker`] / [`FaultyDistributedLock`] / [`FaultyEventStore`], each with a
//!   handle of its own type ([`StreamLockerFaults`], [`DistributedLockFaults`],
//!   [`EventStoreFaults`]: deny the next acquire, fail the next N renews or fence checks, fail
//!   the next N appends with a conflict, add latency). The stream-locker wrappers also wrap the
//!   admin view ([`StreamLockAdmin`](lockstep_core::StreamLockAdmin)) and the fence
//!   ([`LeaseFence`](lockstep_core::LeaseFence)).
//! - The same two for a perspective store, per capability trait (each implemented when the
//!   wrapped store implements it, so they wrap the in-memory store, a Postgres store, or a
//!   store with some of the capabilities): [`RecordingPerspectiveStore`] records each call's
//!   [`PerspectiveMethod`], pairs, perspectives and a summary of what came back
//!   ([`PerspectiveCall`], [`Returned`]); [`FaultyPerspectiveStore`], with its
//!   [`PerspectiveStoreFaults`] handle, fails the next N calls of a method (batch claims and
//!   commits, failure records, claims, the single-pair commits, rewind loads, state reads,
//!   registrations, or any method by name), loses the reply of a commit that ends its
//!   transaction, and adds latency.
//! - `conformance` (feature `conformance`): the shared suites that the fakes and every
//!   Postgres backend pass, with one macro per suite generating one test per case. Not
//!   covered by semver.
//! - `pg_harness` (feature `pg-harness`): a fresh PostgreSQL database per test, and the
//!   helpers that connect to it through a relay.
//! - `relay` (feature `relay`): a fault-injecting TCP relay between a client and a server —
//!   pause and resume all traffic, hold back the bytes of the connections open now (so a
//!   cancel request overtakes a statement), cut a connection right after the client sends a
//!   pattern (a lost `COMMIT` reply), count round trips.

#[cfg(feature = "conformance")]
pub mod conformance;
pub mod event_store;
pub mod fake_lock;
pub mod fake_table;
pub mod faults;
pub mod faulty_perspective_store;
pub mod perspective_store;
#[cfg(feature = "pg-harness")]
pub mod pg_harness;
pub mod recording;
pub mod recording_perspective_store;
#[cfg(feature = "relay")]
pub mod relay;
pub mod snapshot_store;
pub mod stream_locker;

pub use event_store::InMemoryEventStore;
pub use fake_lock::{
    FakeDatabase, FakeDistributedLock, FakeSessionGuard, FakeSessionLocks, FakeTransaction,
    FakeWriteAtCommit, LockOwner, TxEnd,
};
pub use fake_table::FakeTable;
pub use faults::{
    DistributedLockFaults, EventStoreFaults, FaultyDistributedLock, FaultyEventStore,
    FaultyStreamLocker, StreamLockerFaults,
};
pub use faulty_perspective_store::{FaultyPerspectiveStore, PerspectiveStoreFaults};
pub use perspective_store::InMemoryPerspectiveStore;
pub use recording::{
    EventStoreCall, LockCall, LockMode, Outcome, RecordingDistributedLock, RecordingEventStore,
    RecordingStreamLocker, StreamLockCall,
};
pub use recording_perspective_store::{
    ClaimKind, PerspectiveCall, PerspectiveMethod, RecordingPerspectiveStore, Returned,
};
pub use stream_locker::InMemoryStreamLocker;
