//! The fleet of worker instances on PostgreSQL (`wh_worker_instances`;
//! `docs/adr/0015-worker-fleet.md`): [`PgStreamLocker`]'s [`Fleet`] (announce, keepalive,
//! depart), its [`FleetAdmin`] (the operators' listing: a row it cannot read is listed as
//! unreadable, with its id, beside the others) and the operators' forget and prune of stale
//! instances.
//! The keepalive that marks an instance seen is the locker's batched renew with one more CTE
//! ([`sql::KEEPALIVE`]), so an announced instance costs no statement of its own per interval;
//! that CTE and the depart touch the instance's row only when it carries the caller's token.

use std::time::Duration;

use async_trait::async_trait;
use lockstep_core::{
    Error, ErrorKind, FORGET_STALE_AFTER, Fleet, FleetAdmin, InstanceAnnouncement, InstanceEntry,
    InstanceId, InstanceInUse, InstanceState, KeepaliveOutcome, LeaseId, PerspectiveName, Result,
    StreamLocker, UnreadableInstance, WorkerInstance,
};
use lockstep_pg::driver::{Interval, Param, Row};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::locker::{PgStreamLocker, lease_arrays, renew_outcomes, stored_holder, stored_name};
use crate::sql;
use crate::statement::{RowName, column, time_column};

#[async_trait]
impl Fleet for PgStreamLocker {
    async fn announce(&self, announcement: &InstanceAnnouncement) -> Result<()> {
        self.announce_instance(announcement).await
    }

    /// One statement: the batched renew, and the instance's row marked seen when it carries
    /// `token`.
    async fn keepalive(
        &self,
        instance: InstanceId,
        token: Uuid,
        leases: &[LeaseId],
    ) -> Result<KeepaliveOutcome> {
        let (streams, perspectives, holders, epochs) = lease_arrays(leases);
        let rows: Vec<Row> = self
            .run(
                sql::KEEPALIVE,
                &[
                    &streams,
                    &perspectives,
                    &holders,
                    &epochs,
                    &self.timeout,
                    &instance.as_uuid(),
                    &token,
                ],
                "renewing stream leases and marking the instance seen",
            )
            .await?;
        let mut seen = false;
        let mut renewed = Vec::with_capacity(rows.len());
        for row in rows {
            if column::<bool>(&row, 5, "seen", RowName::Listed)? {
                seen = true;
            } else {
                renewed.push(row);
            }
        }
        Ok(KeepaliveOutcome::new(
            renew_outcomes(leases, &renewed)?,
            seen,
        ))
    }

    async fn depart(&self, instance: InstanceId, token: Uuid) -> Result<bool> {
        let deleted: u64 = self
            .run(
                sql::DEPART,
                &[&instance.as_uuid(), &token],
                "removing a worker instance's announcement",
            )
            .await?;
        Ok(deleted > 0)
    }
}

#[async_trait]
impl FleetAdmin for PgStreamLocker {
    async fn list_instances(&self) -> Result<Vec<WorkerInstance>> {
        self.instances().await
    }

    /// One entry per row: a row that cannot be read (an operator's `'infinity'` time, a nil id,
    /// a blank name, a perspective name that does not validate) is
    /// [`InstanceEntry::Unreadable`] with its id.
    async fn list_instance_entries(&self) -> Result<Vec<InstanceEntry>> {
        self.instance_entries().await
    }
}

impl PgStreamLocker {
    /// [`Fleet::announce`]: one statement (run once more in the rare case that the
    /// row it conflicts with was committed after the statement's snapshot and could not be
    /// read by it). A live row of another process is [`InstanceInUse`], nothing written.
    pub(crate) async fn announce_instance(&self, a: &InstanceAnnouncement) -> Result<()> {
        let stale_after = interval(self.options().lock_timeout(), "the lock timeout")?;
        let forget = interval(FORGET_STALE_AFTER, "FORGET_STALE_AFTER")?;
        let perspectives: Vec<&str> = a.perspectives.iter().map(PerspectiveName::as_str).collect();
        let pid = i64::from(a.pid);
        let instance = a.instance.as_uuid();
        let params: [&dyn Param; 9] = [
            &instance,
            &a.name,
            &a.host,
            &pid,
            &a.version,
            &perspectives,
            &stale_after,
            &forget,
            &a.token,
        ];
        for _ in 0..3 {
            let row: Option<Row> = self
                .run(sql::ANNOUNCE, &params, "announcing a worker instance")
                .await?;
            let Some(row) = row else {
                continue; // the conflicting row is newer than the snapshot: look again
            };
            let at = RowName::Listed;
            if column::<bool>(&row, 0, "announced", at)? {
                return Ok(());
            }
            let id = a.instance.as_uuid();
            let pid: i64 = column(&row, 3, "pid", at)?;
            return Err(InstanceInUse::new(
                a.instance,
                column::<String>(&row, 1, "name", at)?,
                column::<String>(&row, 2, "host", at)?,
                u32::try_from(pid).unwrap_or(0),
                micros(column(&row, 4, "since_seen_us", at)?, "last_seen_at", id)?,
                micros(column(&row, 5, "stale_after_us", at)?, "stale_after", id)?,
            )
            .into_error());
        }
        Err(Error::new(
            ErrorKind::Conflict,
            format!(
                "instance {} is being announced by another process at the same time; an \
                 instance id names one running process",
                a.instance
            ),
        ))
    }

    /// [`FleetAdmin::list_instances`]: one statement.
    pub(crate) async fn instances(&self) -> Result<Vec<WorkerInstance>> {
        let rows: Vec<Row> = self
            .run(sql::LIST_INSTANCES, &[], "listing worker instances")
            .await?;
        rows.iter().map(listed_instance).collect()
    }

    /// [`FleetAdmin::list_instance_entries`]: one statement; a row that cannot be read is [`InstanceEntry::Unreadable`] with its id,
    /// and only a row whose id cannot be read fails the listing.
    pub(crate) async fn instance_entries(&self) -> Result<Vec<InstanceEntry>> {
        let rows: Vec<Row> = self
            .run(sql::LIST_INSTANCES, &[], "listing worker instances")
            .await?;
        rows.iter()
            .map(|row| {
                let id: Uuid = column(row, 0, "instance_id", RowName::Listed)?;
                Ok(match listed_instance(row) {
                    Ok(instance) => InstanceEntry::Instance(instance),
                    Err(err) => {
                        tracing::warn!(
                            instance = %id,
                            error = %err,
                            "a listed worker instance cannot be read"
                        );
                        InstanceEntry::Unreadable(UnreadableInstance::new(
                            id,
                            row.get::<String>(1).ok(),
                            crate::admin::problem(&err),
                        ))
                    }
                })
            })
            .collect()
    }

    /// Forgets `instance`'s announcement if it is not live (one statement): what an operator
    /// does for an instance that died, instead of waiting a day for an announce to forget it.
    /// A live instance is kept ([`ForgetInstance::Live`]): it would announce itself again at its
    /// next keepalive.
    pub async fn forget_instance(&self, instance: InstanceId) -> Result<ForgetInstance> {
        let row: Option<Row> = self
            .run(
                sql::FORGET_INSTANCE,
                &[&instance.as_uuid()],
                "forgetting a worker instance",
            )
            .await?;
        let Some(row) = row else {
            return Ok(ForgetInstance::NotAnnounced);
        };
        let at = RowName::Instance(instance.as_uuid());
        let live: bool = column(&row, 0, "live", at)?;
        let forgotten: bool = column(&row, 1, "forgotten", at)?;
        Ok(match (live, forgotten) {
            (_, true) => {
                tracing::info!(instance = %instance, "worker instance forgotten");
                ForgetInstance::Forgotten
            }
            (true, false) => ForgetInstance::Live,
            // Not live yet not deleted cannot happen in one statement; say what was found.
            (false, false) => ForgetInstance::NotAnnounced,
        })
    }

    /// Forgets every stale instance not seen for at least `unseen_for` (one statement, on the
    /// database clock); a live instance is never forgotten. Returns the id and name of each
    /// forgotten one, ordered by name, then id.
    pub async fn forget_stale_instances(
        &self,
        unseen_for: Duration,
    ) -> Result<Vec<(uuid::Uuid, String)>> {
        let unseen_for = interval(unseen_for, "the time not seen")?;
        let rows: Vec<Row> = self
            .run(
                sql::FORGET_STALE_INSTANCES,
                &[&unseen_for],
                "pruning stale worker instances",
            )
            .await?;
        let at = RowName::Listed;
        let mut forgotten = rows
            .iter()
            .map(|row| {
                Ok((
                    column(row, 0, "instance_id", at)?,
                    column(row, 1, "name", at)?,
                ))
            })
            .collect::<Result<Vec<(Uuid, String)>>>()?;
        forgotten.sort_by(|a, b| (a.1.as_bytes(), a.0).cmp(&(b.1.as_bytes(), b.0)));
        if !forgotten.is_empty() {
            tracing::info!(count = forgotten.len(), "stale worker instances forgotten");
        }
        Ok(forgotten)
    }
}

/// What [`PgStreamLocker::forget_instance`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForgetInstance {
    /// Its announcement was deleted.
    Forgotten,
    /// It is live (seen within its `stale_after`): kept.
    Live,
    /// No such instance is announced.
    NotAnnounced,
}

fn interval(duration: Duration, what: &str) -> Result<Interval> {
    Interval::from_duration(duration).ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidInput,
            format!("{what} does not fit a PostgreSQL interval"),
        )
    })
}

fn micros(value: Option<i64>, what: &str, id: Uuid) -> Result<Duration> {
    let value = value.ok_or_else(|| {
        Error::new(
            ErrorKind::Backend,
            format!("worker instance {id}: {what} cannot be read (an infinite time?)"),
        )
    })?;
    Ok(Duration::from_micros(u64::try_from(value).unwrap_or(0)))
}

fn listed_instance(row: &Row) -> Result<WorkerInstance> {
    let id: Uuid = column(row, 0, "instance_id", RowName::Listed)?;
    let at = RowName::Instance(id);
    let instance = stored_holder(id, at)?;
    let names: Vec<String> = column(row, 5, "perspectives", at)?;
    let perspectives = names
        .into_iter()
        .map(stored_name)
        .collect::<Result<Vec<_>>>()?;
    let pid: i64 = column(row, 3, "pid", at)?;
    let stored = |e: Error| {
        Error::new(
            ErrorKind::Backend,
            format!("worker instance {id}: a stored value does not pass validation"),
        )
        .with_source(e)
    };
    let token: Option<Uuid> = column(row, 8, "token", at)?;
    let announcement = InstanceAnnouncement::new(
        instance,
        column::<String>(row, 1, "name", at)?,
        column::<String>(row, 2, "host", at)?,
        // A pid written by hand out of range reads as 0 rather than failing the listing.
        u32::try_from(pid).unwrap_or(0),
        column::<String>(row, 4, "version", at)?,
        perspectives,
    )
    .map_err(stored)?
    // A row announced without a token (before tokens were stored) lists the nil token.
    .with_token(token.unwrap_or(Uuid::nil()));
    let started_at: OffsetDateTime = time_column(row, 6, "started_at", at)?;
    let last_seen_at: OffsetDateTime = time_column(row, 7, "last_seen_at", at)?;
    let stale_after = micros(column(row, 9, "stale_after_us", at)?, "stale_after", id)?;
    let since_seen = micros(column(row, 10, "since_seen_us", at)?, "last_seen_at", id)?;
    let live: bool = column(row, 11, "live", at)?;
    Ok(WorkerInstance::new(
        announcement,
        started_at,
        last_seen_at,
        stale_after,
        since_seen,
        if live {
            InstanceState::Live
        } else {
            InstanceState::Stale
        },
    ))
}
