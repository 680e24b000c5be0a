//! [`PgStreamLocker`]: the hot path (try-acquire, renew, release, batched renew) over a pool of
//! either driver: a `deadpool_postgres` pool, or (feature `sqlx`) an application's
//! `sqlx::PgPool` (`PgStreamLocker::for_sqlx`).
//!
//! Each call checks a connection out of the pool, runs exactly one statement (one round trip)
//! and returns the connection. On tokio-postgres the statements are prepared once per
//! connection (`prepare_cached`); sqlx prepares and caches them itself. That block is one
//! helper, `PgStreamLocker::run`.

use std::collections::HashMap;

use async_trait::async_trait;
use deadpool_postgres::Pool;
use lockstep_core::{
    AcquireOutcome, Error, ErrorKind, InstanceId, LeaseEpoch, LeaseHolder, LeaseId, LockReason,
    PerspectiveName, ReleaseOutcome, RenewOutcome, Result, StreamId, StreamLease,
    StreamLockOptions, StreamLocker,
};
use lockstep_pg::driver::{Connections, Interval, Row};
use lockstep_pg::internal::PoolerState;
use lockstep_pg::{LockQueue, PgDatabase};
use time::OffsetDateTime;
use tokio_postgres::Socket;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use uuid::Uuid;

use crate::sql;
use crate::statement::{RowName, column, opt_time_column, statement_error, time_column};

/// Stream leases on `wh_perspective_cursors`, one atomic statement per operation, on the
/// database clock.
///
/// Built from a [`PgDatabase`] ([`PgStreamLocker::new`]), a `deadpool_postgres` pool
/// ([`PgStreamLocker::from_pool`]) or, with feature `sqlx`, an
/// `lockstep_pg::sqlx::SqlxDatabase` (`PgStreamLocker::for_sqlx`): the same
/// statements, decoding and error mapping on either driver.
///
/// Cheap to clone (the pool is reference-counted). The locker holds no lease state of its own:
/// the instance is passed to every call, so one locker serves a whole process.
#[derive(Clone)]
pub struct PgStreamLocker {
    pub(crate) connections: Connections,
    options: StreamLockOptions,
    pub(crate) timeout: Interval,
    // Only its cancel requests are used (their TLS connector).
    pub(crate) cancel: LockQueue,
    // Whether statements must go unnamed (behind a transaction pooler): shared with the handle.
    pub(crate) pooler: PoolerState,
}

impl std::fmt::Debug for PgStreamLocker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStreamLocker")
            .field("options", &self.options)
            .field("connections", &self.connections)
            .finish_non_exhaustive()
    }
}

impl PgStreamLocker {
    /// The stream locker of `db`, granting leases with `options` (already validated): on its
    /// pool, cancelling abandoned statements with its TLS.
    ///
    /// Does not touch the database: apply the schema first with
    /// [`PgDatabase::migrate`](lockstep_pg::PgDatabase::migrate).
    pub fn new(db: &PgDatabase, options: StreamLockOptions) -> PgStreamLocker {
        let mut locker = PgStreamLocker::from_pool(db.pool().clone(), options);
        locker.cancel = db.lock_queue().clone();
        locker.pooler = lockstep_pg::internal::pooler_state(db).clone();
        locker
    }

    /// For wiring by hand (prefer [`PgStreamLocker::new`]): a locker over `pool` granting
    /// leases with `options`, cancelling without TLS unless told
    /// ([`PgStreamLocker::with_cancel_tls`]).
    pub fn from_pool(pool: Pool, options: StreamLockOptions) -> PgStreamLocker {
        PgStreamLocker::on(Connections::TokioPostgres(pool), options)
    }

    /// The stream locker of an application on sqlx, granting leases with `options` (already
    /// validated): on `db`'s pool, the same statements as on tokio-postgres.
    ///
    /// What differs, because sqlx does not hand out a connection's cancel key and prepares
    /// statements itself (see `lockstep_pg::driver::pool`): an operation whose future is
    /// dropped closes its connection but sends no cancel request, so its statement runs to its
    /// end at the server — what a later call of the same caller would do, on its own lease only;
    /// behind a transaction pooler, configure the sqlx pool for it (`statement_cache_capacity(0)`,
    /// or PgBouncer ≥ 1.21 with `max_prepared_statements`).
    ///
    /// Does not touch the database: apply the schema first ([`lockstep_pg::migrate()`]).
    #[cfg(feature = "sqlx")]
    pub fn for_sqlx(db: &lockstep_pg::sqlx::SqlxDatabase, options: StreamLockOptions) -> Self {
        let mut locker = PgStreamLocker::on(Connections::Sqlx(db.pool().clone()), options);
        locker.cancel = db.lock_queue().clone();
        locker
    }

    fn on(connections: Connections, options: StreamLockOptions) -> PgStreamLocker {
        let timeout = match Interval::from_duration(options.lock_timeout()) {
            Some(timeout) => timeout,
            // `StreamLockOptions::new` refuses timeouts beyond i64 microseconds.
            None => unreachable!("StreamLockOptions guarantees the lock timeout fits"),
        };
        PgStreamLocker {
            connections,
            options,
            timeout,
            cancel: LockQueue::new(),
            pooler: PoolerState::default(),
        }
    }

    /// Sends the cancel requests that end an abandoned lease statement with `tls`: **pass the
    /// connector the pool was built with** (default `tokio_postgres::NoTls`). Every operation is
    /// cancel-safe: dropping its future (a caller's timeout, a cancelled task) sends a cancel
    /// request for the running statement and closes its connection, so no statement keeps
    /// running and no lease is written for a caller that gave up. See
    /// [`LockQueue::with_cancel_tls`].
    #[must_use]
    pub fn with_cancel_tls<T>(mut self, tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
        T::Stream: Sync + Send,
        T::TlsConnect: Sync + Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        self.cancel = self.cancel.with_cancel_tls(tls);
        self
    }

    /// The `deadpool_postgres` pool the locker runs on; `None` for a locker built `for_sqlx`
    /// (its pool is the application's `sqlx::PgPool`).
    pub fn pool(&self) -> Option<&Pool> {
        match &self.connections {
            Connections::TokioPostgres(pool) => Some(pool),
            // An sqlx pool: the variant exists whenever lockstep-pg has its `sqlx` feature, which
            // another crate of the build may have turned on without this crate's.
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}

pub(crate) fn stored_reason(reason: String) -> Result<LockReason> {
    LockReason::parse(reason).map_err(|e| {
        Error::new(
            ErrorKind::Backend,
            "a stored lease reason does not pass validation",
        )
        .with_source(e)
    })
}

pub(crate) fn stored_holder(holder: Uuid, at: RowName<'_>) -> Result<InstanceId> {
    InstanceId::from_uuid(holder).map_err(|e| {
        Error::new(
            ErrorKind::Backend,
            format!("the stored lease holder of {at} is the nil UUID"),
        )
        .with_source(e)
    })
}

pub(crate) fn stored_name(name: String) -> Result<PerspectiveName> {
    PerspectiveName::new(name).map_err(|e| {
        Error::new(
            ErrorKind::Backend,
            "a stored perspective name does not pass validation",
        )
        .with_source(e)
    })
}

fn inconsistent(what: &'static str) -> Error {
    Error::new(ErrorKind::Backend, what)
}

#[async_trait]
impl StreamLocker for PgStreamLocker {
    fn options(&self) -> StreamLockOptions {
        self.options
    }

    async fn try_acquire(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        instance: InstanceId,
        reason: &LockReason,
    ) -> Result<AcquireOutcome> {
        const DOING: &str = "acquiring a stream lease";
        let ran = self
            .run_statement::<Option<Row>>(
                sql::TRY_ACQUIRE,
                &[
                    &stream_id.as_uuid(),
                    &perspective.as_str(),
                    &instance.as_uuid(),
                    &reason.as_str(),
                    &self.timeout,
                ],
                DOING,
            )
            .await?;
        let row = match ran {
            Ok(row) => row,
            // `FOR NO KEY UPDATE NOWAIT` on the cursor row: another transaction holds its lock
            // right now. The statement wrote nothing; an outcome, not an error (ADR 0002).
            Err(e) if e.code() == Some("55P03") => {
                tracing::debug!("cursor row busy");
                return Ok(AcquireOutcome::Busy);
            }
            Err(e) => return Err(statement_error(e, DOING)),
        };
        let Some(row) = row else {
            tracing::debug!("no cursor row");
            return Ok(AcquireOutcome::NoCursor);
        };
        let at = RowName::Pair(stream_id, perspective.as_str());
        let acquired_epoch: Option<i64> = column(&row, 0, "acquired_epoch", at)?;
        if let Some(epoch) = acquired_epoch {
            let expires_at: OffsetDateTime = opt_time_column(&row, 1, "acquired_expiry", at)?
                .ok_or_else(|| inconsistent("an acquired lease has no expiry"))?;
            let took_over: Option<bool> = column(&row, 2, "took_over", at)?;
            let reentered: Option<bool> = column(&row, 3, "reentered", at)?;
            if took_over == Some(true) {
                tracing::info!(stream_id = %stream_id, perspective = %perspective, epoch, "took over an expired lease");
            } else {
                tracing::debug!("acquired");
            }
            return Ok(AcquireOutcome::Acquired(
                StreamLease::new(
                    LeaseId::new(
                        stream_id,
                        perspective.clone(),
                        instance,
                        LeaseEpoch::new(epoch),
                    ),
                    reason.clone(),
                    expires_at,
                )
                .with_reentered(reentered == Some(true))
                .with_took_over(took_over == Some(true)),
            ));
        }
        // Denied: `cur` is the row as locked, i.e. its latest committed version.
        let holder: Option<Uuid> = column(&row, 4, "holder", at)?;
        let stored: Option<String> = column(&row, 5, "reason", at)?;
        let expires_at: Option<OffsetDateTime> = opt_time_column(&row, 6, "expiry", at)?;
        let epoch: i64 = column(&row, 7, "epoch", at)?;
        let (Some(holder), Some(stored), Some(expires_at)) = (holder, stored, expires_at) else {
            return Err(inconsistent(
                "try-acquire was denied but the cursor row holds no lease",
            ));
        };
        tracing::debug!(holder = %holder, "denied");
        Ok(AcquireOutcome::Denied(LeaseHolder {
            instance: stored_holder(holder, at)?,
            reason: stored_reason(stored)?,
            expires_at,
            epoch: LeaseEpoch::new(epoch),
        }))
    }

    async fn renew(&self, lease: &LeaseId) -> Result<RenewOutcome> {
        let row: Option<Row> = self
            .run(
                sql::RENEW,
                &[
                    &lease.stream_id.as_uuid(),
                    &lease.perspective.as_str(),
                    &lease.holder.as_uuid(),
                    &lease.epoch.get(),
                    &self.timeout,
                ],
                "renewing a stream lease",
            )
            .await?;
        match row {
            Some(row) => {
                let at = RowName::Pair(lease.stream_id, lease.perspective.as_str());
                let expires_at = time_column(&row, 0, "stream_lock_expiry", at)?;
                Ok(RenewOutcome::Renewed { expires_at })
            }
            None => {
                tracing::warn!(stream_id = %lease.stream_id, perspective = %lease.perspective, epoch = lease.epoch.get(), "renew found the lease lost");
                Ok(RenewOutcome::Lost)
            }
        }
    }

    async fn release(&self, lease: &LeaseId) -> Result<ReleaseOutcome> {
        let cleared: u64 = self
            .run(
                sql::RELEASE,
                &[
                    &lease.stream_id.as_uuid(),
                    &lease.perspective.as_str(),
                    &lease.holder.as_uuid(),
                    &lease.epoch.get(),
                ],
                "releasing a stream lease",
            )
            .await?;
        if cleared > 0 {
            Ok(ReleaseOutcome::Released)
        } else {
            tracing::debug!("release found nothing to clear");
            Ok(ReleaseOutcome::NotHeld)
        }
    }

    async fn renew_many(&self, leases: &[LeaseId]) -> Result<Vec<RenewOutcome>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let (streams, perspectives, holders, epochs) = lease_arrays(leases);
        let rows: Vec<Row> = self
            .run(
                sql::RENEW_MANY,
                &[&streams, &perspectives, &holders, &epochs, &self.timeout],
                "renewing stream leases",
            )
            .await?;
        renew_outcomes(leases, &rows)
    }
}

/// The batched renew's parameters: the leases sorted by pair (the statement itself locks rows
/// in key order, whatever the plan), as four arrays.
pub(crate) fn lease_arrays(leases: &[LeaseId]) -> (Vec<Uuid>, Vec<&str>, Vec<Uuid>, Vec<i64>) {
    let mut order: Vec<&LeaseId> = leases.iter().collect();
    order.sort_by(|a, b| {
        (a.stream_id, a.perspective.as_str()).cmp(&(b.stream_id, b.perspective.as_str()))
    });
    (
        order.iter().map(|l| l.stream_id.as_uuid()).collect(),
        order.iter().map(|l| l.perspective.as_str()).collect(),
        order.iter().map(|l| l.holder.as_uuid()).collect(),
        order.iter().map(|l| l.epoch.get()).collect(),
    )
}

/// The outcomes of a batched renew of `leases`, in their order, from the rows it renewed
/// (stream, perspective, holder, epoch, expiry).
pub(crate) fn renew_outcomes(leases: &[LeaseId], rows: &[Row]) -> Result<Vec<RenewOutcome>> {
    // Keyed by the whole lease id, so a lease listed twice is reported twice.
    let renewed: HashMap<(Uuid, String, Uuid, i64), OffsetDateTime> = rows
        .iter()
        .map(|row| {
            let at = RowName::Listed;
            let key: (Uuid, String, Uuid, i64) = (
                column(row, 0, "stream_id", at)?,
                column(row, 1, "perspective_name", at)?,
                column(row, 2, "stream_lock_instance_id", at)?,
                column(row, 3, "stream_lock_epoch", at)?,
            );
            let expires_at = time_column(
                row,
                4,
                "stream_lock_expiry",
                RowName::Pair(StreamId::from_uuid(key.0), &key.1),
            )?;
            Ok((key, expires_at))
        })
        .collect::<Result<_>>()?;
    let outcomes: Vec<RenewOutcome> = leases
        .iter()
        .map(|l| {
            let key = (
                l.stream_id.as_uuid(),
                l.perspective.as_str().to_owned(),
                l.holder.as_uuid(),
                l.epoch.get(),
            );
            match renewed.get(&key) {
                Some(&expires_at) => RenewOutcome::Renewed { expires_at },
                None => RenewOutcome::Lost,
            }
        })
        .collect();
    let lost = outcomes.iter().filter(|o| !o.is_renewed()).count();
    if lost > 0 {
        tracing::warn!(lost, "batched renew found leases lost");
    }
    Ok(outcomes)
}
