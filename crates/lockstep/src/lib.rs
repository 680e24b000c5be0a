//! # lockstep
//!
//! Safe multi-instance event sourcing on PostgreSQL — stream leases, per-aggregate write locks,
//! a perspective worker — in one dependency. This crate re-exports lockstep's split crates, each
//! behind a feature, so an application names one crate and one line in its manifest; its only
//! code is test support, `lockstep::testing` (feature `testkit`):
//!
//! ```toml
//! [dependencies]
//! lockstep = { version = "0.1", features = ["postgres", "worker"] }
//!
//! [dev-dependencies]
//! # the in-memory fakes and `lockstep::testing` for the application's own tests
//! lockstep = { version = "0.1", features = ["postgres", "testkit"] }
//! ```
//!
//! The split crates stay published: a domain crate that only needs the contracts may depend on
//! `lockstep-core` alone, and its types are the very ones re-exported here.
//!
//! ## Features and where their names land
//!
//! | feature | crates | names |
//! |---|---|---|
//! | *(none, the default)* | `lockstep-core` | the crate root: every name of `lockstep-core` — contracts, ids, options, errors (`lockstep::EventStore`, `lockstep::StreamId`, `lockstep::Error`, …), its modules (`lockstep::stream_lease`, …) and re-exports (`lockstep::Uuid`, `lockstep::serde_json`, …), documented in `lockstep_core`; [`prelude`] |
//! | `postgres` | `lockstep-pg`, `lockstep-pg-advisory`, `lockstep-pg-store`, `lockstep-pg-stream` | `lockstep::postgres`: `PgDatabase`, `migrate`, `PgTransaction`, `PgDistributedLock`, `PgAggregateWriteLock`, `PgEventStore`, `PgPerspectiveStore`, `PgStreamLocker`, … |
//! | `sqlx` | the four Postgres crates (their `sqlx`) | `lockstep::postgres::sqlx`: `SqlxDatabase` (on the application's `sqlx::PgPool`), `SqlxTransaction`; `lockstep::postgres::SqlxDistributedLock`, …: the same backends on sqlx transactions; implies `postgres` |
//! | `worker` | `lockstep-worker` | `lockstep::worker`: `PerspectiveWorker`, `WorkerOptions`, `ReadModels`, `LeaseKeeper`, … |
//! | `combiner` | `lockstep-combiner` | `lockstep::combiner`: `Combiner`, `CombinerOptions`, `CombineError`, … |
//! | `command` | `lockstep-command` | `lockstep::command`: `CommandRunner`, `Mode`, `RunnerOptions`, `Handled`, `CommandError` |
//! | `observe` | `lockstep-observe` | `lockstep::observe`: `Observed`, the metric names |
//! | `prometheus` | `lockstep-observe` (its `prometheus`) | `lockstep::observe::prometheus::install`; implies `observe` |
//! | `tokio` | `lockstep-core` (its `tokio`) | `lockstep::tokio_sleep`, the sleep between retries |
//! | `testkit` | `lockstep-testkit` | `lockstep::testkit`: `FakeDatabase`, `InMemoryEventStore`, recording and faulty wrappers, …; `lockstep::testing`: one test body on the fakes and (with `postgres`) on a fresh, migrated database — `Backend`, `on_fakes`, `on_postgres`, `fresh_database` (for `[dev-dependencies]`) |
//! | `full` | all of the above but `testkit` and `sqlx` (a second driver is the application's choice) | |
//!
//! With `testkit` and `postgres` both on, the testkit's `pg-harness` is on too: `lockstep::testing`
//! creates a database per test. The testkit's other features (`conformance`, `relay`,
//! `testcontainers`) serve backend crates and lockstep's own tests: depend on
//! `lockstep-testkit` directly for them.
//!
//! ## Module layout: nothing is ambiguous
//!
//! Every split crate keeps its own module, so names two crates share never meet:
//!
//! - `fleet`: `lockstep::fleet` is the contract's (`lockstep-core`: `InstanceAnnouncement`,
//!   `WorkerInstance`, …), `lockstep::worker::fleet` the worker's (`InstanceIdentity`).
//! - `perspective`: `lockstep::perspective` is the `Perspective` trait's module
//!   (`lockstep-core`), `lockstep::postgres::perspective` the Postgres perspective store's.
//! - `error`: `lockstep::error` holds `Error` and `ErrorKind`, `lockstep::postgres::error` the
//!   SQLSTATE mapping (`map_error`, `describe`).
//! - `describe`: `lockstep::postgres::describe` describes a driver error,
//!   `lockstep::observe::describe` registers the metrics' `# HELP` texts.
//! - `worker`: `lockstep::worker` is the crate, `lockstep::worker::worker` its engine module
//!   (`PerspectiveWorker` is at `lockstep::worker::PerspectiveWorker` too).
//! - `Transaction`, `TransactionSource`: one trait each, at the root (`lockstep-pg` re-exports
//!   the same traits; `lockstep::postgres` does not repeat them).
//!
//! The four Postgres crates share one module, `lockstep::postgres`: their names do not
//! overlap (each is `Pg…`, or a module of one crate: `session`, `perspective`, `admin`,
//! `fence`, `interval`, `locker`, `database`, `error`, `migrate`, `pool`, `target`,
//! `transaction`). `lockstep-pg`'s hidden `internal` module — the plumbing its sibling crates
//! share, not an API — is not re-exported.
//!
//! [`prelude`] is flat: the traits an application calls methods of, and the types it builds,
//! of every feature turned on. It leaves out `Error` and `Result`, so that a glob import never
//! shadows an application's own; write `lockstep::Error` and `lockstep::Result`.
//!
//! ## Quick start
//!
//! With `features = ["postgres"]`: one handle, every backend built from it, and a unit of work
//! (lock the aggregate, load, decide, append, commit):
//!
//! ```no_run
//! use lockstep::postgres::{PgDatabase, PgDistributedLock, PgEventStore};
//! use lockstep::prelude::*;
//!
//! # async fn demo() -> lockstep::Result<()> {
//! let db = PgDatabase::connect("postgres://app@db.internal/app").await?;
//! db.migrate().await?;
//! let lock = PgDistributedLock::new(&db).aggregate_write_lock();
//! let store = PgEventStore::new(&db);
//!
//! let sku = lockstep::Uuid::now_v7();
//! let stream = StreamId::from_uuid(sku);
//! let tx = db.begin().await?;
//! lock.acquire(&tx, "StockItem", sku).await?; // writers of this SKU queue here
//! let history = store.load(&tx, stream).await?;
//! let event = NewEvent::new("StockReserved", lockstep::serde_json::json!({ "quantity": 1 }))?;
//! let expected = ExpectedVersion::Exact(history.len() as u64);
//! store.append(&tx, stream, expected, &[event]).await?;
//! tx.commit().await?; // releases the lock
//! # Ok(()) }
//! ```
//!
//! With `worker` too: a perspective worker on the same handle, its rewinds under stream leases
//! of the Postgres locker, which also keeps the fleet the worker announces itself in:
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use lockstep::postgres::{PgDatabase, PgPerspectiveStore, PgStreamLocker};
//! use lockstep::prelude::*;
//! use lockstep::worker::{CancellationToken, PerspectiveWorker, WorkerOptions};
//!
//! struct Reservations;
//!
//! impl Perspective for Reservations {
//!     type State = u64;
//!     type Error = std::convert::Infallible;
//!     fn name(&self) -> &str {
//!         "Reservations"
//!     }
//!     fn apply(&self, seen: &mut u64, _: &RecordedEvent) -> Result<(), Self::Error> {
//!         *seen += 1;
//!         Ok(())
//!     }
//! }
//!
//! # async fn demo(db: PgDatabase, shutdown: CancellationToken) -> lockstep::Result<()> {
//! let mut registry = PerspectiveRegistry::new();
//! registry.register(Reservations)?;
//! let fleet: Arc<dyn Fleet> = Arc::new(PgStreamLocker::new(&db, StreamLockOptions::default()));
//! let worker = PerspectiveWorker::new(
//!     db.clone(),
//!     PgPerspectiveStore::new(),
//!     registry,
//!     WorkerOptions::default(),
//!     InstanceId::process(),
//!     None, // the leases go through the fleet
//! )?
//! .with_fleet(fleet);
//! worker.run(shutdown).await?; // until shutdown.cancel()
//! # Ok(()) }
//! ```
//!
//! Each split crate's own documentation (`lockstep_core`, `lockstep_pg`, …) says what its
//! names guarantee; the modules here carry the same items.
//!
//! ## Stability
//!
//! The re-exports follow semver with the crates they come from; this crate pins them with an
//! exact `=` version, as they pin each other.

// The contracts: every name of `lockstep-core` at the root. Shown as one re-export, linking to
// `lockstep-core`'s documentation: inlined, rustdoc would document again the crates and foreign
// types `lockstep-core` re-exports (`serde_json`, `serde`, `Uuid`, …). The prelude's names are
// documented here.
#[doc(no_inline)]
pub use lockstep_core::*;

pub mod prelude {
    //! The names an application uses, flat, of every feature turned on:
    //! `use lockstep::prelude::*;`.
    //!
    //! Traits (so their methods resolve) and the types an application builds. `Error` and
    //! `Result` are left out, so a glob import never shadows an application's own: write
    //! `lockstep::Error` and `lockstep::Result`.

    pub use lockstep_core::{
        AcquireOutcome, AggregateType, AggregateWriteLock, Decider, DistributedAggregateWriteLock,
        DistributedLock, EventStore, ExpectedVersion, Fleet, FleetAdmin, InstanceId, LeaseFence,
        LockReason, NewEvent, Perspective, PerspectiveName, PerspectiveRegistry, PerspectiveStore,
        PreviousVersion, Promotion, RecordedEvent, RetireStates, RetryPolicy, Retryable,
        SessionLocks, SnapshotPolicy, SnapshotStore, StreamId, StreamLockAdmin, StreamLockOptions,
        StreamLocker, TablePerspective, Transaction, TransactionSource, Upcasters, VersionPolicy,
        VersionStatus,
    };
    // The perspective store's capability traits, so a concrete store's methods resolve.
    pub use lockstep_core::perspective_store::prelude::*;

    #[cfg(feature = "tokio")]
    pub use lockstep_core::tokio_sleep;

    #[cfg(feature = "postgres")]
    pub use crate::postgres::{
        PgAggregateWriteLock, PgDatabase, PgDistributedLock, PgEventStore, PgPerspectiveStore,
        PgStreamLocker, PgTransaction,
    };

    #[cfg(feature = "worker")]
    pub use crate::worker::{
        CancellationToken, LeaseKeeper, PerspectiveWorker, PromoteOptions, Promoted, ReadModels,
        VersionError, WaitOptions, WorkerOptions,
    };

    #[cfg(feature = "combiner")]
    pub use crate::combiner::{CombineError, Combiner, CombinerOptions};

    #[cfg(feature = "command")]
    pub use crate::command::{CommandError, CommandRunner, Mode, RunnerOptions};

    #[cfg(feature = "observe")]
    pub use crate::observe::Observed;

    #[cfg(feature = "testkit")]
    pub use crate::testkit::{
        FakeDatabase, FakeDistributedLock, FakeTable, FakeTransaction, InMemoryEventStore,
        InMemoryPerspectiveStore, InMemoryStreamLocker,
    };
}

#[cfg(feature = "postgres")]
pub mod postgres {
    //! The Postgres backends (feature `postgres`), one module for four crates: `lockstep-pg`
    //! (the one handle [`PgDatabase`], [`migrate()`], the owned [`PgTransaction`], the SQLSTATE
    //! mapping), `lockstep-pg-advisory` ([`PgDistributedLock`], [`PgAggregateWriteLock`],
    //! session locks), `lockstep-pg-store` ([`PgEventStore`], [`PgPerspectiveStore`]) and
    //! `lockstep-pg-stream` ([`PgStreamLocker`]: stream leases, the fenced commit, the fleet).
    //!
    //! Build one [`PgDatabase`] per process and every backend from it, so they share its lock
    //! queue and TLS (the `lockstep_pg` crate documentation says more).

    // Named one by one: `lockstep-pg` also has a hidden `internal` module for its sibling
    // crates, which is not an API and is not re-exported.
    /// The backends on an application's own sqlx pool (feature `sqlx`): `SqlxDatabase`,
    /// `SqlxTransaction`, `map_sqlx_error`.
    #[cfg(feature = "sqlx")]
    pub use lockstep_pg::sqlx;
    pub use lockstep_pg::{
        DEFAULT_CHECKOUT_WAIT, LockQueue, PgDatabase, PgDatabaseBuilder, PgTransaction,
        PgTransactionRef, WriteAtCommit, checkout, database, deadpool_postgres, describe,
        describe_pool_error, error, map_error, map_pool_error, migrate, pool, target,
        tokio_postgres, transaction,
    };
    pub use lockstep_pg_advisory::*;
    pub use lockstep_pg_store::*;
    pub use lockstep_pg_stream::*;
}

#[cfg(feature = "worker")]
pub mod worker {
    //! The perspective worker (feature `worker`): every name of `lockstep-worker` —
    //! [`PerspectiveWorker`], [`WorkerOptions`], [`ReadModels`], [`LeaseKeeper`],
    //! [`InstanceIdentity`], and the shutdown signal [`CancellationToken`].

    pub use lockstep_worker::*;
}

#[cfg(feature = "combiner")]
pub mod combiner {
    //! The command combiner for hot aggregates (feature `combiner`): every name of
    //! `lockstep-combiner` — [`Combiner`], [`CombinerOptions`], [`CombineError`].

    pub use lockstep_combiner::*;
}

#[cfg(feature = "command")]
pub mod command {
    //! The command runner (feature `command`): every name of `lockstep-command` —
    //! [`CommandRunner`] runs a decider's commands in the [`Mode`] its [`RunnerOptions`] name
    //! (optimistic, locked or combined) and answers [`Handled`] or a [`CommandError`].

    pub use lockstep_command::*;
}

#[cfg(feature = "observe")]
pub mod observe {
    //! Tracing spans and metrics as a layer (feature `observe`): every name of
    //! `lockstep-observe` — [`Observed`] wraps any backend, the fakes included; the module
    //! `prometheus` installs the Prometheus recorder (feature `prometheus`).

    pub use lockstep_observe::*;
}

#[cfg(feature = "testkit")]
pub mod testing;

#[cfg(feature = "testkit")]
pub mod testkit {
    //! Test support (feature `testkit`, for `[dev-dependencies]`): every name of
    //! `lockstep-testkit` — in-memory fakes of every contract ([`FakeDatabase`],
    //! [`InMemoryEventStore`], [`InMemoryPerspectiveStore`], [`InMemoryStreamLocker`], …) and
    //! the recording and faulty wrappers.

    pub use lockstep_testkit::*;
}
