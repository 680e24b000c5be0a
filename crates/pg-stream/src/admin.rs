//! [`StreamLockAdmin`] for [`PgStreamLocker`]: list, inspect, force-release and
//! release-all, for operators and for graceful shutdown. The operators' listing
//! ([`StreamLockAdmin::list_lease_entries`]) shows a row it cannot read as unreadable, with its
//! key, beside the others.
//!
//! Like the hot path, each operation is one statement; "time left" and held/expired are
//! computed on the database clock.

use std::time::Duration;

use async_trait::async_trait;
use lockstep_core::{
    CursorLease, InstanceId, LeaseEntry, LeaseEpoch, LeaseId, LeaseInfo, LeaseStatus,
    PerspectiveName, ReleaseOutcome, Result, StreamId, StreamLockAdmin, UnreadableLease,
};
use lockstep_pg::driver::{Row, Timestamp};

use crate::locker::{PgStreamLocker, stored_holder, stored_name, stored_reason};
use crate::sql;
use crate::statement::{RowName, column, opt_time_column, time_column};

#[async_trait]
impl StreamLockAdmin for PgStreamLocker {
    async fn list_leases(&self) -> Result<Vec<LeaseInfo>> {
        let rows: Vec<Row> = self
            .run(sql::LIST_LEASES, &[], "listing stream leases")
            .await?;
        rows.iter()
            .map(|row| {
                let (stream_id, perspective) = listed_key(row)?;
                listed_lease(row, stream_id, perspective)
            })
            .collect()
    }

    /// One entry per row: a row whose lease cannot be read (an operator's `'infinity'` expiry,
    /// a nil holder, a name or reason that does not validate) is [`LeaseEntry::Unreadable`]
    /// with its key; only a row without a readable key fails the listing.
    async fn list_lease_entries(&self) -> Result<Vec<LeaseEntry>> {
        let rows: Vec<Row> = self
            .run(sql::LIST_LEASES, &[], "listing stream leases")
            .await?;
        rows.iter()
            .map(|row| {
                let (stream_id, perspective) = listed_key(row)?;
                Ok(match listed_lease(row, stream_id, perspective.clone()) {
                    Ok(lease) => LeaseEntry::Lease(lease),
                    Err(err) => {
                        tracing::warn!(
                            stream_id = %stream_id,
                            perspective = %perspective,
                            error = %err,
                            "a listed lease cannot be read"
                        );
                        LeaseEntry::Unreadable(UnreadableLease {
                            stream_id,
                            perspective,
                            problem: problem(&err),
                        })
                    }
                })
            })
            .collect()
    }

    async fn inspect(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<Option<CursorLease>> {
        let row: Option<Row> = self
            .run(
                sql::INSPECT,
                &[&stream_id.as_uuid(), &perspective.as_str()],
                "inspecting a cursor's lease",
            )
            .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let at = RowName::Pair(stream_id, perspective.as_str());
        let holder: Option<uuid::Uuid> = column(&row, 0, "stream_lock_instance_id", at)?;
        let reason: Option<String> = column(&row, 1, "stream_lock_reason", at)?;
        Ok(Some(CursorLease {
            holder: holder.map(|h| stored_holder(h, at)).transpose()?,
            reason: reason.map(stored_reason).transpose()?,
            expires_at: opt_time_column(&row, 2, "stream_lock_expiry", at)?,
            epoch: LeaseEpoch::new(column(&row, 3, "stream_lock_epoch", at)?),
        }))
    }

    async fn force_release(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<ReleaseOutcome> {
        let cleared: u64 = self
            .run(
                sql::FORCE_RELEASE,
                &[&stream_id.as_uuid(), &perspective.as_str()],
                "force-releasing a stream lease",
            )
            .await?;
        if cleared > 0 {
            tracing::warn!(stream_id = %stream_id, perspective = %perspective, "lease force-released; its holder is fenced out");
            Ok(ReleaseOutcome::Released)
        } else {
            Ok(ReleaseOutcome::NotHeld)
        }
    }

    async fn release_all_held_by(&self, instance: InstanceId) -> Result<u64> {
        let cleared: u64 = self
            .run(
                sql::RELEASE_ALL_HELD_BY,
                &[&instance.as_uuid()],
                "releasing an instance's stream leases",
            )
            .await?;
        tracing::info!(instance = %instance, cleared, "released every lease of the instance");
        Ok(cleared)
    }
}

/// The key of a listed row: its stream id and its perspective name as stored.
fn listed_key(row: &Row) -> Result<(StreamId, String)> {
    let listed = RowName::Listed;
    let stream_id = StreamId::from_uuid(column(row, 0, "stream_id", listed)?);
    let perspective: String = column(row, 1, "perspective_name", listed)?;
    Ok((stream_id, perspective))
}

/// The lease of a listed row, or a typed error naming the row.
fn listed_lease(row: &Row, stream_id: StreamId, perspective: String) -> Result<LeaseInfo> {
    let at = RowName::Pair(stream_id, &perspective);
    let live: bool = column(row, 8, "live", at)?;
    let expires_at = time_column(row, 5, "stream_lock_expiry", at)?;
    let time_left_us: i64 = column(row, 7, "time_left_us", at)?;
    let holder = stored_holder(column(row, 2, "stream_lock_instance_id", at)?, at)?;
    let reason = stored_reason(column(row, 3, "stream_lock_reason", at)?)?;
    let epoch = LeaseEpoch::new(column(row, 4, "stream_lock_epoch", at)?);
    let time_left = Duration::from_micros(u64::try_from(time_left_us).unwrap_or(0));
    let status = if live {
        LeaseStatus::Held
    } else {
        LeaseStatus::Expired
    };
    // Informational only: a start that cannot be read (an operator's `'infinity'`) lists as not
    // recorded rather than making the whole lease unreadable.
    let acquired_at = match row.get::<Option<Timestamp>>(6).map(|t| t.map(|t| t.0)) {
        Ok(at) => at,
        Err(err) => {
            tracing::warn!(%stream_id, %perspective, error = %err, "a lease's start cannot be read");
            None
        }
    };
    Ok(LeaseInfo::new(
        LeaseId::new(stream_id, stored_name(perspective)?, holder, epoch),
        reason,
        expires_at,
        time_left,
        status,
    )
    .with_acquired_at(acquired_at))
}

/// An error and its causes, on one line.
pub(crate) fn problem(err: &lockstep_core::Error) -> String {
    let mut text = err.message().to_owned();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
