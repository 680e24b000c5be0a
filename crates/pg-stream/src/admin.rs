//! [`StreamLockAdmin`] for [`PostgresStreamLocker`]: list, inspect, force-release and
//! release-all, for operators and for graceful shutdown.
//!
//! Like the hot path, each operation is one statement; "time left" and held/expired are
//! computed on the database clock.

use std::time::Duration;

use async_trait::async_trait;
use lockstep_core::{
    CursorLease, InstanceId, LeaseEpoch, LeaseInfo, LeaseStatus, PerspectiveName, ReleaseOutcome,
    Result, StreamId, StreamLockAdmin,
};
use lockstep_pg::map_error;
use tracing::instrument;

use crate::locker::{PostgresStreamLocker, prepare, stored_name, stored_reason};
use crate::sql;
use crate::telemetry::{self, count};

#[async_trait]
impl StreamLockAdmin for PostgresStreamLocker {
    #[instrument(name = "list_leases", skip_all)]
    async fn list_leases(&self) -> Result<Vec<LeaseInfo>> {
        let conn = self.connection().await?;
        let stmt = prepare(&conn, sql::LIST_LEASES, "preparing lease listing").await?;
        let rows = conn
            .query(&stmt, &[])
            .await
            .map_err(|e| map_error(e, "listing stream leases"))?;
        drop(conn);
        rows.into_iter()
            .map(|row| {
                let time_left_us: i64 = row.get("time_left_us");
                let live: bool = row.get("live");
                Ok(LeaseInfo {
                    stream_id: StreamId::from_uuid(row.get("stream_id")),
                    perspective: stored_name(row.get("perspective_name"))?,
                    holder: InstanceId::from_uuid(row.get("stream_lock_instance_id")),
                    reason: stored_reason(row.get("stream_lock_reason"))?,
                    epoch: LeaseEpoch::new(row.get("stream_lock_epoch")),
                    expires_at: row.get("stream_lock_expiry"),
                    time_left: Duration::from_micros(u64::try_from(time_left_us).unwrap_or(0)),
                    status: if live {
                        LeaseStatus::Held
                    } else {
                        LeaseStatus::Expired
                    },
                })
            })
            .collect()
    }

    #[instrument(
        name = "inspect",
        skip_all,
        fields(stream_id = %stream_id, perspective = %perspective)
    )]
    async fn inspect(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<Option<CursorLease>> {
        let conn = self.connection().await?;
        let stmt = prepare(&conn, sql::INSPECT, "preparing inspect").await?;
        let row = conn
            .query_opt(&stmt, &[&stream_id.as_uuid(), &perspective.as_str()])
            .await
            .map_err(|e| map_error(e, "inspecting a cursor's lease"))?;
        drop(conn);
        let Some(row) = row else {
            return Ok(None);
        };
        let holder: Option<uuid::Uuid> = row.get(0);
        let reason: Option<String> = row.get(1);
        Ok(Some(CursorLease {
            holder: holder.map(InstanceId::from_uuid),
            reason: reason.map(stored_reason).transpose()?,
            expires_at: row.get(2),
            epoch: LeaseEpoch::new(row.get(3)),
        }))
    }

    #[instrument(
        name = "force_release",
        skip_all,
        fields(stream_id = %stream_id, perspective = %perspective)
    )]
    async fn force_release(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<ReleaseOutcome> {
        let conn = self.connection().await?;
        let stmt = prepare(&conn, sql::FORCE_RELEASE, "preparing force-release").await?;
        let cleared = conn
            .execute(&stmt, &[&stream_id.as_uuid(), &perspective.as_str()])
            .await
            .map_err(|e| map_error(e, "force-releasing a stream lease"))?;
        drop(conn);
        if cleared > 0 {
            count(telemetry::FORCE_RELEASED, 1);
            tracing::warn!("lease force-released; its holder is fenced out");
            Ok(ReleaseOutcome::Released)
        } else {
            Ok(ReleaseOutcome::NotHeld)
        }
    }

    #[instrument(name = "release_all_held_by", skip_all, fields(instance = %instance))]
    async fn release_all_held_by(&self, instance: InstanceId) -> Result<u64> {
        let conn = self.connection().await?;
        let stmt = prepare(&conn, sql::RELEASE_ALL_HELD_BY, "preparing release-all").await?;
        let cleared = conn
            .execute(&stmt, &[&instance.as_uuid()])
            .await
            .map_err(|e| map_error(e, "releasing an instance's stream leases"))?;
        drop(conn);
        count(telemetry::RELEASED, cleared);
        tracing::info!(cleared, "released every lease of the instance");
        Ok(cleared)
    }
}
