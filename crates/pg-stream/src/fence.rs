//! The fenced commit on PostgreSQL: [`LeaseFence`] for [`PgStreamLocker`] over every
//! transaction of the driver seam (`lockstep_pg::driver::Executor`): on tokio-postgres the owned
//! [`lockstep_pg::PgTransaction`], or a borrowed `tokio_postgres::Transaction` or
//! `deadpool_postgres::Transaction`, passed as `&tx`; on sqlx (feature `sqlx`) a
//! `lockstep_pg::sqlx::SqlxTransaction`. Whichever driver the locker itself runs on.
//!
//! Inside the caller's transaction, one statement selects the cursor row where the
//! holder and epoch match and the lease is live on the database clock, `FOR NO KEY UPDATE`.
//! No row means the lease was lost ([`ErrorKind::LeaseLost`]); the caller must roll back.
//!
//! A row means the lease is held *and stays held until the transaction ends*: the row lock
//! conflicts with every lease write (takeover, renew, release, force-release are all non-key
//! `UPDATE`s of that row), so a would-be new holder waits for the fenced transaction to commit
//! or roll back and then re-evaluates the lease. A holder that stalled past its expiry can
//! therefore never commit over its successor's work.
//!
//! Why `FOR NO KEY UPDATE` rather than `FOR SHARE`: both block the lease writes, but fenced work
//! usually goes on to update the same cursor row (advance the position, clear the rewind flag).
//! Under `FOR SHARE` two fenced transactions of one holder could both hold the share lock and
//! then deadlock upgrading it; `FOR NO KEY UPDATE` is the lock that update needs anyway, and it
//! still lets foreign-key checks (`FOR KEY SHARE`) on the cursor row through.
//!
//! The check is one round trip: on tokio-postgres an unnamed statement with typed parameters
//! (the transaction's connection is not the pool's, so there is no per-connection statement
//! cache to use); on sqlx the statement as sqlx runs any (prepared and cached per connection).

use lockstep_core::{Error, ErrorKind, LeaseFence, LeaseId, Result};
use lockstep_pg::driver::{Executor, query_opt};

use crate::locker::PgStreamLocker;
use crate::sql;
use crate::statement::statement_error;

impl<T: Executor> LeaseFence<T> for PgStreamLocker {
    async fn check_lease(&self, tx: &T, lease: &LeaseId) -> Result<()> {
        let stream = lease.stream_id.as_uuid();
        let perspective = lease.perspective.as_str();
        let holder = lease.holder.as_uuid();
        let epoch = lease.epoch.get();
        let row = query_opt(tx, sql::FENCE, &[&stream, &perspective, &holder, &epoch])
            .await
            .map_err(|e| statement_error(e, "checking the stream lease fence"))?;
        match row {
            Some(_) => Ok(()),
            None => {
                tracing::warn!(stream_id = %lease.stream_id, perspective = %lease.perspective, epoch, "fenced commit refused: lease lost");
                Err(Error::new(
                    ErrorKind::LeaseLost,
                    "the stream lease is no longer held at this epoch (expired and taken \
                     over, released, or force-released); roll the transaction back",
                ))
            }
        }
    }
}
