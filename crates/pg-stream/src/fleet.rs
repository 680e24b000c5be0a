//! The fleet of worker instances on PostgreSQL (`wh_worker_instances`, migration V10;
//! `docs/adr/0015-worker-fleet.md`): [`PgStreamLocker`]'s announce and the operators' listing.
//! The keepalive that marks an instance seen is the locker's batched renew with one more CTE
//! ([`sql::KEEPALIVE`]), so an announced instance costs no statement of its own per interval.

use std::time::Duration;

use lockstep_core::{
    Error, ErrorKind, FORGET_STALE_AFTER, InstanceAnnouncement, InstanceInUse, InstanceState,
    PerspectiveName, Result, StreamLocker, WorkerInstance,
};
use time::OffsetDateTime;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use crate::interval::PgInterval;
use crate::locker::{PgStreamLocker, stored_holder, stored_name};
use crate::sql;
use crate::statement::{RowName, column};

impl PgStreamLocker {
    /// [`StreamLocker::announce`]: one statement (run once more in the rare case that the
    /// row it conflicts with was committed after the statement's snapshot and could not be
    /// read by it). A live row of another process is [`InstanceInUse`], nothing written.
    pub(crate) async fn announce_instance(&self, a: &InstanceAnnouncement) -> Result<()> {
        let stale_after = interval(self.options().lock_timeout(), "the lock timeout")?;
        let forget = interval(FORGET_STALE_AFTER, "FORGET_STALE_AFTER")?;
        let perspectives: Vec<&str> = a.perspectives.iter().map(PerspectiveName::as_str).collect();
        let pid = i64::from(a.pid);
        let params: [&(dyn ToSql + Sync); 9] = [
            &a.instance.as_uuid(),
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
            if column::<bool, _>(&row, "announced", at)? {
                return Ok(());
            }
            let id = a.instance.as_uuid();
            let pid: i64 = column(&row, "pid", at)?;
            return Err(InstanceInUse::new(
                a.instance,
                column::<String, _>(&row, "name", at)?,
                column::<String, _>(&row, "host", at)?,
                u32::try_from(pid).unwrap_or(0),
                micros(column(&row, "since_seen_us", at)?, "last_seen_at", id)?,
                micros(column(&row, "stale_after_us", at)?, "stale_after", id)?,
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

    /// [`StreamLockAdmin::list_instances`](lockstep_core::StreamLockAdmin::list_instances): one
    /// statement.
    pub(crate) async fn instances(&self) -> Result<Vec<WorkerInstance>> {
        let rows: Vec<Row> = self
            .run(sql::LIST_INSTANCES, &[], "listing worker instances")
            .await?;
        rows.iter().map(listed_instance).collect()
    }
}

fn interval(duration: Duration, what: &str) -> Result<PgInterval> {
    PgInterval::from_duration(duration).ok_or_else(|| {
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
    let at = RowName::Listed;
    let id: Uuid = column(row, "instance_id", at)?;
    let instance = stored_holder(id, at)?;
    let names: Vec<String> = column(row, "perspectives", at)?;
    let perspectives = names
        .into_iter()
        .map(stored_name)
        .collect::<Result<Vec<_>>>()?;
    let pid: i64 = column(row, "pid", at)?;
    let stored = |e: Error| {
        Error::new(
            ErrorKind::Backend,
            format!("worker instance {id}: a stored value does not pass validation"),
        )
        .with_source(e)
    };
    let token: Option<Uuid> = column(row, "token", at)?;
    let announcement = InstanceAnnouncement::new(
        instance,
        column::<String, _>(row, "name", at)?,
        column::<String, _>(row, "host", at)?,
        // A pid written by hand out of range reads as 0 rather than failing the listing.
        u32::try_from(pid).unwrap_or(0),
        column::<String, _>(row, "version", at)?,
        perspectives,
    )
    .map_err(stored)?
    // A row announced without a token (before tokens were stored) lists the nil token.
    .with_token(token.unwrap_or(Uuid::nil()));
    let started_at: OffsetDateTime = column(row, "started_at", at)?;
    let last_seen_at: OffsetDateTime = column(row, "last_seen_at", at)?;
    let stale_after = micros(column(row, "stale_after_us", at)?, "stale_after", id)?;
    let since_seen = micros(column(row, "since_seen_us", at)?, "last_seen_at", id)?;
    let live: bool = column(row, "live", at)?;
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
