//! # lockstep-core
//!
//! The contracts of lockstep, a library that makes event-sourced systems on PostgreSQL safe to
//! run on many instances at once. Application code depends on this crate only; a backend
//! (`lockstep-pg-stream`, `lockstep-pg-advisory`, …) is chosen at the composition root, and the
//! in-memory fakes of `lockstep-testkit` stand in for it in tests.
//!
//! - [`StreamLocker`] / [`StreamLockAdmin`] — leases per `(stream, perspective)` for rewind,
//!   bootstrap and purge ([`stream_lease`]).
//! - [`DistributedLock`] / [`SessionLocks`] — transaction- and session-scoped exclusive locks
//!   on a [`ResourceKey`] ([`distributed_lock`]).
//! - [`AggregateWriteLock`] / [`DistributedAggregateWriteLock`] — the pessimistic
//!   per-aggregate write lock `relay:aggregate:{type}:{id}` ([`aggregate_lock`]).
//! - Validated values ([`InstanceId`], [`StreamId`], [`PerspectiveName`], [`LockReason`],
//!   [`AggregateType`], [`StreamLockOptions`]) and one [`Error`] with an [`ErrorKind`].
//! - [`EventStore`] — append with an [`ExpectedVersion`], load in order ([`event_store`]), and
//!   [`RetryPolicy`], the bounded retry loop of the optimistic default ([`retry`]).
//!
//! This crate has no database driver and no async runtime.
//!
//! ```
//! use lockstep_core::{LockReason, PerspectiveName, StreamLockOptions, ErrorKind, Error};
//! use std::time::Duration;
//!
//! let name = PerspectiveName::new("OrderPerspective")?;
//! let too_long: Result<LockReason, Error> = LockReason::custom("x".repeat(51)).map_err(Error::from);
//! assert_eq!(too_long.unwrap_err().kind(), ErrorKind::InvalidInput);
//! let opts = StreamLockOptions::new(Duration::from_secs(60), Duration::from_secs(20))?;
//! # let _ = (name, opts);
//! # Ok::<(), lockstep_core::Error>(())
//! ```

pub mod aggregate_lock;
pub mod distributed_lock;
pub mod error;
pub mod event_store;
pub mod ids;
pub mod options;
pub mod perspective;
pub mod perspective_store;
pub mod reason;
pub mod resource_key;
pub mod retry;
pub mod stream_lease;
pub mod unit_of_work;

pub use aggregate_lock::{
    AGGREGATE_KEY_PREFIX, AggregateWriteLock, AsAggregateType, DistributedAggregateWriteLock,
    aggregate_key, canonical_order,
};
pub use distributed_lock::{DistributedLock, SessionLockGuard, SessionLocks};
pub use error::{BoxError, Error, ErrorKind, Result, ValidationError};
pub use event_store::{
    EventStore, ExpectedVersion, NewEvent, RecordedEvent, VersionConflict, version_conflict,
};
pub use ids::{AggregateType, InstanceId, PerspectiveName, StreamId};
pub use options::StreamLockOptions;
pub use perspective::{ApplyError, DynPerspective, Perspective, PerspectiveRegistry};
pub use perspective_store::{
    Claim, Cursor, PendingPair, PerspectiveStore, RewindRequest, Snapshot, StateCommit,
};
pub use reason::{CustomReason, LockReason};
pub use resource_key::{ADVISORY_KEY_GOLDEN_VECTORS, ResourceKey, advisory_key};
pub use retry::RetryPolicy;
#[cfg(feature = "tokio")]
pub use retry::tokio_sleep;
pub use stream_lease::{
    AcquireOutcome, CursorLease, LeaseEpoch, LeaseFence, LeaseHolder, LeaseId, LeaseInfo,
    LeaseStatus, ReleaseOutcome, RenewOutcome, StreamLease, StreamLockAdmin, StreamLocker,
};
pub use unit_of_work::{Retryable, TransactionSource};

/// Re-exported so implementors and users name the same versions.
pub use async_trait::async_trait;
pub use serde_json;
pub use time::OffsetDateTime;
pub use uuid::Uuid;
