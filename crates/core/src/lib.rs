//! # lockstep-core
//!
//! The contracts of lockstep, a library that makes event-sourced systems on PostgreSQL safe to
//! run on many instances at once. Application code depends on this crate only; a backend
//! (`lockstep-pg-stream`, `lockstep-pg-advisory`, `lockstep-pg-store`) is chosen at the
//! composition root, and the in-memory fakes of `lockstep-testkit` stand in for it in tests.
//! This crate has no database driver and no async runtime.
//!
//! ## A command handler on the contracts
//!
//! Written once, generic over the unit of work, the aggregate write lock and the event store;
//! the same function runs on the testkit's fakes in tests and on PostgreSQL in production:
//!
//! ```
//! use lockstep_core::{
//!     AggregateType, AggregateWriteLock, Error, EventStore, ExpectedVersion, NewEvent, StreamId,
//!     Transaction, TransactionSource, serde_json::json,
//! };
//!
//! /// Reserves `quantity` of a stock item: lock the aggregate, load it, decide, append — in one
//! /// transaction, which releases the lock when it ends.
//! async fn reserve<S, L, E>(
//!     source: &S,
//!     lock: &L,
//!     store: &E,
//!     stock: &AggregateType, // validated once, at start-up
//!     item: StreamId,
//!     quantity: u32,
//! ) -> Result<u64, Error>
//! where
//!     S: TransactionSource,
//!     L: AggregateWriteLock<S::Tx>,
//!     E: EventStore<S::Tx>,
//! {
//!     let tx = source.begin().await?; // rolled back if dropped before commit (`?` below)
//!     lock.acquire(&tx, stock, item.as_uuid()).await?; // writers queue here
//!     let history = store.load(&tx, item).await?;
//!     let event = NewEvent::new("StockReserved", json!({ "quantity": quantity }))?;
//!     let expected = ExpectedVersion::Exact(history.len() as u64);
//!     let version = store.append(&tx, item, expected, &[event]).await?;
//!     tx.commit().await?; // releases the lock
//!     Ok(version)
//! }
//! # fn main() {}
//! ```
//!
//! Wire it with one `lockstep_pg::PgDatabase` (the transaction source) and the backends built
//! from it, `lockstep_pg_advisory::PgAggregateWriteLock` and `lockstep_pg_store::PgEventStore`,
//! or in tests with the testkit's `FakeDatabase`, `DistributedAggregateWriteLock<FakeDistributedLock>`
//! and `InMemoryEventStore`. It compiles and runs from inside `tokio::spawn` with those concrete
//! types, as a web handler calls it.
//!
//! ## What is here
//!
//! Contracts:
//! - [`TransactionSource`] / [`Transaction`] — where transactions come from and the guard that
//!   ends them (commit, rollback, or rollback on drop); [`TransactionSource::transaction`] and
//!   [`TransactionSource::transaction_with_retry`] run a unit of work ([`unit_of_work`]),
//!   retried under a [`RetryPolicy`] when it fails with a [`Retryable`] error ([`retry`]);
//!   their closures return a [`BoxFuture`] ([`future`]).
//! - [`AggregateWriteLock`] / [`DistributedAggregateWriteLock`] — the pessimistic
//!   per-aggregate write lock `relay:aggregate:{type}:{id}` ([`aggregate_lock`]), over any
//!   [`DistributedLock`]; [`SessionLocks`] / [`SessionLockGuard`] for session-scoped locks
//!   ([`distributed_lock`]).
//! - [`Decider`] — an aggregate as `decide(state, command)` and `evolve(state, event)`, what
//!   the command combiner (`lockstep-combiner`) runs ([`decider`]).
//! - [`EventStore`] — append with an [`ExpectedVersion`] ([`VersionConflict`] on a conflict),
//!   load in order; [`NewEvent`] in, [`RecordedEvent`] out ([`event_store`]); every event
//!   carries the schema version of its payload, and [`Upcasters`] lift old shapes as they are
//!   read ([`upcast`]).
//! - [`SnapshotStore`] — aggregate snapshots beside the events: the latest
//!   [`AggregateSnapshot`] and the events after it in one load, for a decider that declares a
//!   [`SnapshotPolicy`] ([`snapshot`]).
//! - [`StreamLocker`] / [`StreamLockAdmin`] / [`LeaseFence`] — leases per `(stream,
//!   perspective)` for rewind, bootstrap and purge: [`AcquireOutcome`], [`StreamLease`],
//!   [`LeaseId`], [`RenewOutcome`], [`ReleaseOutcome`], [`LeaseInfo`], [`LeaseEntry`]
//!   ([`stream_lease`]).
//! - [`Fleet`] / [`FleetAdmin`] — the fleet of worker instances, a capability of a stream
//!   locker (the keepalive renews the leases and marks the instance seen in one call):
//!   [`InstanceAnnouncement`], [`KeepaliveOutcome`], [`WorkerInstance`], [`InstanceEntry`]
//!   ([`fleet`]).
//! - [`Perspective`] / [`PerspectiveStore`] — read models and their storage ([`perspective`],
//!   [`perspective_store`]); [`TablePerspective`] — read models in the application's own tables,
//!   written in the worker's transaction ([`table_perspective`]); both fail with an
//!   [`ApplyError`] ([`apply_error`]).
//!
//! Values, validated at construction: [`InstanceId`], [`StreamId`], [`PerspectiveName`],
//! [`LockReason`], [`AggregateType`], [`ResourceKey`], [`StreamLockOptions`], and
//! [`RetryPolicy`].
//!
//! Errors: every constructor and operation returns one [`Error`], with an [`ErrorKind`] to
//! branch on ([`ErrorKind::is_retryable`]) and, for refused input, the typed
//! [`ValidationError`] behind [`Error::validation`]:
//!
//! ```
//! use lockstep_core::{ErrorKind, LockReason, ValidationError};
//!
//! let err = LockReason::custom("x".repeat(51)).unwrap_err();
//! assert_eq!(err.kind(), ErrorKind::InvalidInput);
//! assert_eq!(err.validation(), Some(&ValidationError::ReasonTooLong { chars: 51, max: 50 }));
//! ```

pub mod aggregate_lock;
pub mod apply_error;
pub mod decider;
pub mod distributed_lock;
pub mod error;
pub mod event_store;
pub mod fleet;
pub mod future;
pub mod ids;
pub mod json;
pub mod options;
pub mod perspective;
pub mod perspective_store;
pub mod perspective_version;
pub mod reason;
pub mod resource_key;
pub mod retry;
pub mod snapshot;
pub mod stream_lease;
pub mod table_perspective;
mod text;
pub mod unit_of_work;
pub mod upcast;

pub use aggregate_lock::{
    AGGREGATE_KEY_PREFIX, AggregateWriteLock, AsAggregateType, DistributedAggregateWriteLock,
    aggregate_key, canonical_order,
};
pub use apply_error::ApplyError;
pub use decider::Decider;
pub use distributed_lock::{DistributedLock, SessionLockGuard, SessionLocks};
pub use error::{BoxError, Error, ErrorKind, Result, ValidationError};
pub use event_store::{
    EventStore, ExpectedVersion, NewEvent, RecordedEvent, VersionConflict, version_conflict,
};
pub use fleet::{
    FORGET_STALE_AFTER, Fleet, FleetAdmin, InstanceAnnouncement, InstanceEntry, InstanceInUse,
    InstanceState, KeepaliveOutcome, UnreadableInstance, WorkerInstance, instance_in_use,
};
pub use future::BoxFuture;
pub use ids::{AggregateType, InstanceId, PerspectiveName, StreamId};
pub use options::StreamLockOptions;
pub use perspective::{DynPerspective, Perspective, PerspectiveRegistry};
pub use perspective_store::{
    BatchClaim, BatchCommitted, BatchEntry, BatchLimits, Claim, ClaimedBatch, ClaimedPair,
    ClaimedWork, Committed, Cursor, CursorRows, EventPage, MAX_PROGRESS_ROWS, MAX_STATES_PAGE,
    PageLimits, Pair, PairFailure, PairWork, PendingPair, PendingThrough, PerspectiveAdmin,
    PerspectiveLifecycle, PerspectiveReads, PerspectiveStatus, PerspectiveStore, ProgressReport,
    Rebuild, Registration, Release, RetireStates, Retired, RewindDebounce, RewindLoad,
    RewindProgress, RewindReads, RewindRequest, SkippedEvent, Snapshot, StateCommit, StoredState,
    THROUGHPUT_WINDOW, Throughput, WorkQueue, check_progress_limit, check_states_page,
};
pub use perspective_version::{
    PerspectiveVersion, PerspectiveVersions, PreviousVersion, Promotion, PromotionRequest,
    VersionDeclaration, VersionPolicy, VersionStatus,
};
pub use reason::{CustomReason, LockReason};
pub use resource_key::{ADVISORY_KEY_GOLDEN_VECTORS, ResourceKey, advisory_key};
#[cfg(feature = "tokio")]
pub use retry::tokio_sleep;
pub use retry::{RetryPolicy, Retryable};
pub use snapshot::{
    AggregateSnapshot, LoadedAggregate, LoadedStream, LockFirst, SnapshotKey, SnapshotPolicy,
    SnapshotStore, load_aggregate, save_snapshot_if_due,
};
pub use stream_lease::{
    AcquireOutcome, CursorLease, LeaseEntry, LeaseEpoch, LeaseFence, LeaseHolder, LeaseId,
    LeaseInfo, LeaseStatus, ReleaseOutcome, RenewOutcome, StreamLease, StreamLockAdmin,
    StreamLocker, UnreadableLease,
};
pub use table_perspective::{DynTablePerspective, TablePerspective};
pub use unit_of_work::{Transaction, TransactionSource};
pub use upcast::Upcasters;

/// Re-exported so implementors and users name the same versions.
pub use async_trait::async_trait;
/// The `serde` a [`Perspective::State`] derives `Serialize` / `Deserialize` from (with the
/// `derive` feature), so an application needs no `serde` dependency of its own. Through this
/// re-export, tell the derive where it is:
///
/// ```
/// use lockstep_core::serde::{Deserialize, Serialize};
///
/// #[derive(Debug, Default, Clone, Serialize, Deserialize)]
/// #[serde(crate = "lockstep_core::serde")]
/// struct Seen {
///     count: u64,
/// }
/// let state = lockstep_core::serde_json::to_value(Seen { count: 2 }).expect("serializes");
/// assert_eq!(state["count"], 2);
/// ```
pub use serde;
pub use serde_json;
pub use time::OffsetDateTime;
pub use uuid::Uuid;
