//! # lockstep-pg-stream
//!
//! Stream leases on PostgreSQL: [`PgStreamLocker`] implements the
//! [`StreamLocker`](lockstep_core::StreamLocker) hot path, the
//! [`StreamLockAdmin`](lockstep_core::StreamLockAdmin) operator view and the
//! [`LeaseFence`](lockstep_core::LeaseFence) fenced commit of `lockstep-core`, storing each
//! lease on its `(stream_id, perspective_name)` row of `wh_perspective_cursors` (the schema is
//! applied by [`lockstep_pg::migrate()`]).
//!
//! The same statements, row decoding and error mapping run on either driver: on tokio-postgres
//! ([`PgStreamLocker::new`] from a [`lockstep_pg::PgDatabase`]) or, with feature `sqlx`, on an
//! application's `sqlx::PgPool` (`PgStreamLocker::for_sqlx` from a
//! `lockstep_pg::sqlx::SqlxDatabase`); the fenced commit works in a transaction of either.
//!
//! What it guarantees, beyond the contract in [`lockstep_core::stream_lease`]:
//!
//! - **One statement, one round trip** per try-acquire, renew, release and batched renew: an
//!   atomic `UPDATE … WHERE` (for try-acquire, a CTE that also reports the current holder on
//!   denial and tells "no cursor row" apart), sent as a prepared statement with bound
//!   parameters. No read-then-write. The statements are private to this crate (their design
//!   is recorded in `docs/adr/0002-stream-lease-sql.md`).
//! - **The database clock only**: expiry is `clock_timestamp() + lock_timeout` (the timeout
//!   bound as an `interval` parameter) and is compared with `clock_timestamp()`; the clients'
//!   clocks never matter.
//! - **Fencing**: the epoch increases whenever a lease is established anew and on
//!   force-release; renew, release and the fenced commit ([`fence`]) match holder *and* epoch.
//! - **Try-acquire never waits**: a cursor row locked by another transaction (a claim applying
//!   events, a fenced commit, another lease statement) is answered
//!   [`AcquireOutcome::Busy`](lockstep_core::AcquireOutcome::Busy) at once (`55P03` from the
//!   statement's `NOWAIT`, and only from that statement, nothing written) — skip the pair and
//!   retry, as after a denial. A live lease the caller's instance already held is joined, and
//!   says so ([`StreamLease::reentered`](lockstep_core::StreamLease::reentered)).
//! - **Cancel safety**: dropping the future of any operation (a caller's timeout) sends a cancel
//!   request for its statement and closes its connection instead of pooling it, so no
//!   statement keeps running and no lease is written for a caller that gave up. The request uses
//!   the TLS connector of the [`lockstep_pg::PgDatabase`] the locker was built from (wired by
//!   hand: [`PgStreamLocker::with_cancel_tls`]). What a dropped call may still do: a statement
//!   the server finished in the instant of the drop stays done, and one still on its way to the
//!   server (a cancel request can arrive first; it is sent again for 2 s) may run once it
//!   arrives — exactly as the same call made a moment later would: renew and release act only
//!   on a lease the caller still holds at that epoch, and a try-acquire's lease is the caller's
//!   own, re-entered by its next try-acquire. On sqlx, which hands out no cancel key, the
//!   connection is closed but no cancel request is sent: the statement runs to its end at the
//!   server, with the same consequences as that later call (see `PgStreamLocker::for_sqlx`).
//! - **No panics on stored values**: a row lockstep cannot read (an expiry past year 9999 or
//!   `'infinity'` written by hand) is an [`ErrorKind::Backend`](lockstep_core::ErrorKind::Backend)
//!   error naming the row; a database without lockstep's schema says to run
//!   [`lockstep_pg::migrate()`].
//! - **The fleet** (`wh_worker_instances`): announce, depart and list worker instances; the
//!   keepalive of an announced instance renews its leases and marks it seen in one statement.
//! - **Observability** comes from one layer, not from the backend: wrap the locker, admin and
//!   fence in `lockstep_observe::Observed` at the composition root for a span and metrics per
//!   call (ADR 0018). What only this backend knows travels in the outcome — a takeover of an
//!   expired lease is [`StreamLease::took_over`](lockstep_core::StreamLease::took_over) — and it
//!   logs (`tracing` events, no spans of its own) what an operator should see: a force-release,
//!   a renew that found its lease lost, a fenced commit refused.
//!
//! Domain code should depend on `lockstep-core` only and receive the locker as an
//! `Arc<dyn StreamLocker>`; this crate is for the composition root.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use lockstep_core::{
//!     InstanceId, LockReason, PerspectiveName, StreamId, StreamLockOptions, StreamLocker,
//!     AcquireOutcome, LeaseFence, Transaction, TransactionSource,
//! };
//! use lockstep_pg::PgDatabase;
//! use lockstep_pg_stream::PgStreamLocker;
//!
//! # async fn demo(db: PgDatabase, stream_id: StreamId) -> lockstep_core::Result<()> {
//! db.migrate().await?;
//! let options = StreamLockOptions::new(Duration::from_secs(60), Duration::from_secs(20))?;
//! let locker = PgStreamLocker::new(&db, options);
//!
//! let perspective = PerspectiveName::new("OrderPerspective")?;
//! let instance = InstanceId::process();
//! match locker
//!     .try_acquire(stream_id, &perspective, instance, &LockReason::Rewind)
//!     .await?
//! {
//!     AcquireOutcome::Acquired(lease) => {
//!         // ... rebuild the read model; a keepalive calls `locker.renew(&lease.id)` ...
//!         let tx = db.begin().await?;
//!         locker.check_lease(&tx, &lease.id).await?; // LeaseLost if taken over meanwhile
//!         // ... write the rebuilt state on `tx` ...
//!         tx.commit().await?;
//!         let _ = locker.release(&lease.id).await?;
//!     }
//!     AcquireOutcome::Denied(holder) => {
//!         // Another instance is rewinding this stream: skip it this cycle.
//!         let _ = (holder.instance, holder.reason, holder.expires_at);
//!     }
//!     // Another transaction is using the cursor row right now: skip it, like a denial.
//!     AcquireOutcome::Busy => {}
//!     AcquireOutcome::NoCursor => {}
//! }
//! // As a trait object, the way the perspective worker takes it:
//! let _shared: Arc<dyn StreamLocker> = Arc::new(locker);
//! # Ok(()) }
//! ```

pub mod admin;
pub mod fence;
mod fleet;
pub mod locker;
mod sql;
mod statement;

pub use fleet::ForgetInstance;
pub use locker::PgStreamLocker;
/// The lock timeout as the statements bind it: a `Duration` as a PostgreSQL `interval` of
/// microseconds (the driver seam's [`Interval`](lockstep_pg::driver::Interval)).
pub use lockstep_pg::driver::Interval as PgInterval;

#[cfg(test)]
mod tests {
    use super::*;

    // Compile-time checks: the locker can be shared as the worker takes it, and it fences both
    // kinds of Postgres transaction.
    #[allow(dead_code)]
    fn usable_as_trait_objects(locker: PgStreamLocker) {
        let _: std::sync::Arc<dyn lockstep_core::StreamLocker> =
            std::sync::Arc::new(locker.clone());
        let _: std::sync::Arc<dyn lockstep_core::StreamLockAdmin> = std::sync::Arc::new(locker);
    }

    #[allow(dead_code)]
    fn fences_owned_and_borrowed_transactions<'t>()
    where
        PgStreamLocker: lockstep_core::LeaseFence<lockstep_pg::PgTransaction>
            + lockstep_core::LeaseFence<tokio_postgres::Transaction<'t>>
            + lockstep_core::LeaseFence<deadpool_postgres::Transaction<'t>>,
    {
    }

    #[cfg(feature = "sqlx")]
    #[allow(dead_code)]
    fn fences_sqlx_transactions()
    where
        PgStreamLocker: lockstep_core::LeaseFence<lockstep_pg::sqlx::SqlxTransaction>,
    {
    }
}
