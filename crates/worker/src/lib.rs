//! # lockstep-worker
//!
//! The perspective worker: builds read models ("perspectives") from events on as many instances
//! as you run, with the rewind path (late-arriving event → restore snapshot → replay) and
//! bootstrap path under stream leases kept alive by a keepalive.
//!
//! - [`PerspectiveWorker`] — the engine: normal path, bootstrap, rewind, purge, graceful
//!   shutdown ([`worker`]).
//! - [`LeaseKeeper`] / [`HeldLease`] — the lease lifecycle as a library piece: one keepalive
//!   per instance (`renew_many`), a lost signal as a cancellation token, the fence for the
//!   protected commit, release on finish or drop ([`lease`]). Applications that rebuild a read
//!   model of their own use it too.
//! - [`InstanceIdentity`] — how an instance names itself in the fleet: a worker given a fleet
//!   ([`PerspectiveWorker::with_fleet`]) announces itself when it runs, is kept alive by the keepalive it already sends, and departs
//!   when it stops ([`fleet`]).
//! - [`ApplyCoordinator`] — serializes every apply path of a pair inside one instance
//!   ([`coordinator`]).
//! - [`ReadModels`] — typed reads of a perspective's states and waits until it has caught up
//!   with an append, so a request handler reads its own write ([`reads`]); they read the
//!   version of the perspective that serves.
//! - Versions of a perspective ([`versions`]): a new version builds beside the serving one and
//!   is promoted at once ([`PerspectiveWorker::promote`], [`Promoted`], [`VersionError`]), by
//!   the worker itself when automatic or requested; `abandon` stops one that does not serve.
//! - [`PairError`] — why a pair failed, by kind ([`PairErrorKind`]: apply, panic, state, an
//!   unreadable event, a lost lease, the store), as [`PairOutcome::Failed`] and
//!   [`CycleReport::failures`] carry it; [`CycleError`] — an error of a cycle itself ([`error`]).
//! - [`WorkerOptions`] — validated options ([`options`]); metric names and span fields in
//!   [`telemetry`].
//!
//! The worker is generic over the unit of work ([`lockstep_core::TransactionSource`]) and the
//! store ([`lockstep_core::PerspectiveStore`]): the testkit's in-memory store and
//! `lockstep-pg-store`'s Postgres store both fit. The stream locker is optional, and so is the
//! fleet: a locker that keeps one ([`lockstep_core::Fleet`], as the Postgres and in-memory
//! lockers do), given with [`PerspectiveWorker::with_fleet`], through which the worker takes its
//! leases and announces itself.
//!
//! ```no_run
//! # async fn demo<S, P>(source: S, store: P, fleet: std::sync::Arc<dyn lockstep_core::Fleet>)
//! # -> lockstep_core::Result<()>
//! # where S: lockstep_core::TransactionSource, P: lockstep_core::PerspectiveStore<S::Tx> {
//! use lockstep_core::{InstanceId, PerspectiveRegistry};
//! use lockstep_worker::{PerspectiveWorker, WorkerOptions};
//! # struct Orders;
//! # impl lockstep_core::Perspective for Orders {
//! #     type State = u64; type Error = std::convert::Infallible;
//! #     fn name(&self) -> &str { "Orders" }
//! #     fn apply(&self, s: &mut u64, _: &lockstep_core::RecordedEvent) -> Result<(), Self::Error> { *s += 1; Ok(()) }
//! # }
//!
//! let mut registry = PerspectiveRegistry::new();
//! registry.register(Orders)?;
//! let worker = PerspectiveWorker::new(
//!     source, store, registry, WorkerOptions::default(), InstanceId::process(), None,
//! )?
//! .with_fleet(fleet);
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! worker.run(shutdown).await?; // until shutdown.cancel()
//! # Ok(()) }
//! ```

pub mod coordinator;
pub mod error;
pub mod fleet;
pub mod lease;
pub mod life;
pub mod options;
pub mod reads;
pub mod telemetry;
pub mod versions;
pub mod worker;

pub use coordinator::{ApplyCoordinator, PairGuard};
pub use error::{CycleError, PairError, PairErrorKind};
pub use fleet::InstanceIdentity;
pub use lease::{HeldLease, LeaseKeeper, Leased};
pub use options::WorkerOptions;
pub use reads::{ReadModels, WaitError, WaitOptions};
pub use versions::{Promoted, VersionError};
pub use worker::{
    CycleReport, FailedPair, PairOutcome, PerspectiveWorker, PromoteOptions, PurgeOutcome,
    SkipReason,
};

/// Re-exported: the worker's shutdown signal and the lost signal of a lease.
pub use tokio_util::sync::CancellationToken;
