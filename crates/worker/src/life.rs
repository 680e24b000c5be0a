//! A perspective's life from the application's side: retire it, rebuild it from the start on
//! every instance, and see where the rewinds stand. Each call runs one statement of the
//! [`PerspectiveStore`] in a transaction of its own from the [`TransactionSource`], so it can be
//! called from a request handler, a deploy script or a test alike (the operator's binary does
//! the same: `lockstep perspectives rebuild` / `retire`).
//!
//! - [`rebuild`] requests a rewind from the start on every pair of the perspective; the
//!   workers already running on every instance pick the pairs up one by one under their rewind
//!   leases ([`crate::PerspectiveWorker`]'s rewind path), and each pair serves its old state
//!   until its own rewind commits. Nothing has to be stopped.
//! - [`retire`] stops the perspective's work for good: appends enqueue none for it, its queued
//!   work is deleted, its states are kept or dropped. A worker still running it finds no work;
//!   a worker that *starts* with it registers it again (that is how a perspective comes back):
//!   retire a perspective after the deploy that removed it from the workers.
//! - [`rewind_progress`] lists the running rewinds' progress (events replayed of events to
//!   replay, since when), as the workers record it at most once per [`PROGRESS_EVERY`].
//!
//! ```no_run
//! # async fn demo<S, P>(db: S, store: P) -> lockstep_core::Result<()>
//! # where S: lockstep_core::TransactionSource, P: lockstep_core::PerspectiveStore<S::Tx> {
//! use lockstep_core::{PerspectiveName, Rebuild};
//!
//! // `db`: a `lockstep_pg::PgDatabase` (or the testkit's `FakeDatabase`), `store`: a
//! // `lockstep_pg_store::PgPerspectiveStore` (or the `InMemoryPerspectiveStore`).
//! let name = PerspectiveName::new("OrderPerspective")?;
//! if let Rebuild::Requested { pairs } = lockstep_worker::life::rebuild(&db, &store, &name).await? {
//!     println!("{pairs} pairs will be rebuilt");
//! }
//! for p in lockstep_worker::life::rewind_progress(&db, &store, &[name]).await? {
//!     println!("{}: {} of {}", p.pair, p.replayed, p.to_replay);
//! }
//! # Ok(()) }
//! ```

use lockstep_core::{
    PerspectiveName, PerspectiveStore, Rebuild, Result, RetireStates, Retired, RewindProgress,
    Transaction, TransactionSource,
};

pub use crate::worker::PROGRESS_EVERY;

/// Requests a rebuild of `perspective` from the start ([`lockstep_core::PerspectiveLifecycle::rebuild`]), in a
/// transaction of its own.
pub async fn rebuild<S, P>(source: &S, store: &P, perspective: &PerspectiveName) -> Result<Rebuild>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let tx = source.begin().await?;
    let outcome = store.rebuild(&tx, perspective).await?;
    tx.commit().await?;
    Ok(outcome)
}

/// Retires `perspective`, keeping or dropping its states ([`lockstep_core::PerspectiveLifecycle::retire`]), in a
/// transaction of its own.
pub async fn retire<S, P>(
    source: &S,
    store: &P,
    perspective: &PerspectiveName,
    states: RetireStates,
) -> Result<Retired>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let tx = source.begin().await?;
    let outcome = store.retire(&tx, perspective, states).await?;
    tx.commit().await?;
    Ok(outcome)
}

/// The running rewinds' progress of `perspectives` (all when empty), at most
/// [`lockstep_core::MAX_PROGRESS_ROWS`] ([`lockstep_core::PerspectiveAdmin::rewind_progress`]).
pub async fn rewind_progress<S, P>(
    source: &S,
    store: &P,
    perspectives: &[PerspectiveName],
) -> Result<Vec<RewindProgress>>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let tx = source.begin().await?;
    let rows = store
        .rewind_progress(&tx, perspectives, lockstep_core::MAX_PROGRESS_ROWS)
        .await;
    // Read only: a rollback that fails still ends it, and changes nothing.
    crate::worker::rollback(tx, "a read of rewind progress").await;
    rows
}
