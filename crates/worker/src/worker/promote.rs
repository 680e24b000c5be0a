//! The worker's side of perspective versions: declaring its versions when it registers,
//! promoting one on request ([`PerspectiveWorker::promote`]), and the check after each cycle,
//! at most once per [`CHECK_EVERY`], that promotes the versions it runs which are due (an
//! automatic version that has caught up, a version an operator requested). A check that fails
//! is logged, never the cycle's error; a version far behind is checked less often (the check
//! counts its pending work).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use lockstep_core::{
    PerspectiveName, PerspectiveStore, Promotion, Result, Transaction, TransactionSource,
    VersionStatus,
};
use time::OffsetDateTime;
use tokio::time::Instant;
use uuid::Uuid;

use super::PerspectiveWorker;
use crate::telemetry::{self, count};
use crate::versions::{CHECK_EVERY, Promoted, VersionError, event_id_at, promote_in};

/// How a promotion through [`PerspectiveWorker::promote`] checks the version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PromoteOptions {
    /// Promote without checking that the version has caught up (an operator's override).
    pub force: bool,
    /// How long to wait for the version to apply every event appended before the call.
    pub wait: Duration,
}

impl Default for PromoteOptions {
    fn default() -> Self {
        PromoteOptions {
            force: false,
            wait: Duration::from_secs(30),
        }
    }
}

impl PromoteOptions {
    /// Checked, waiting at most `wait` for the version to catch up.
    pub fn waiting(wait: Duration) -> PromoteOptions {
        PromoteOptions { force: false, wait }
    }

    /// Forced: no check.
    pub fn forced() -> PromoteOptions {
        PromoteOptions {
            force: true,
            wait: Duration::ZERO,
        }
    }
}

/// When the worker last checked its versions, the caught-up point of that check, and the
/// versions it checks again only later (far behind).
#[derive(Debug, Default)]
pub(super) struct VersionChecks(Mutex<Checks>);

#[derive(Debug, Default)]
pub(super) struct Checks {
    /// When the last check ran, and the caught-up point the next one uses.
    last: Option<(Instant, Uuid)>,
    /// Versions far behind, and when to check each again.
    later: HashMap<PerspectiveName, Instant>,
}

/// The longest pause between two checks of a version that is far behind.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

impl<S, P> PerspectiveWorker<S, P>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    /// Declares the worker's versions and registers those that still apply events (a retired
    /// or abandoned version stays so), in one transaction.
    pub async fn register(&self) -> Result<()> {
        let tx = self.source.begin().await?;
        let rows = self.store.declare(&tx, &self.registry.versions()).await?;
        self.note_building(&rows);
        let names: Vec<PerspectiveName> = self
            .registry
            .names()
            .into_iter()
            .filter(|name| {
                rows.iter()
                    .find(|v| &v.stored_name == name)
                    .is_none_or(|v| v.status.is_live())
            })
            .collect();
        self.store.register(&tx, &names).await?;
        tx.commit().await
    }

    /// Promotes `perspective` version `version`, which this worker runs, to the serving
    /// version (see [`crate::versions`]): unless forced, it first waits up to `options.wait`
    /// for the version to apply every event appended before the call
    /// ([`VersionError::NotCaughtUp`] after that, or at once when a pair is parked), then
    /// checks it again in the promoting transaction.
    pub async fn promote(
        &self,
        perspective: &PerspectiveName,
        version: u32,
        options: PromoteOptions,
    ) -> std::result::Result<Promoted, VersionError> {
        let stored = perspective.versioned(version)?;
        if self.registry.version_of(&stored).is_none() {
            return Err(VersionError::NotRunHere {
                perspective: perspective.clone(),
                version,
            });
        }
        if options.force {
            return self.promote_now(perspective, version, &stored, None).await;
        }
        let up_to = event_id_at(OffsetDateTime::now_utc());
        let deadline = Instant::now().checked_add(options.wait);
        loop {
            let left = deadline.map_or(options.wait, |d| {
                d.saturating_duration_since(Instant::now())
            });
            self.wait_caught_up(perspective, version, &stored, up_to, left)
                .await?;
            match self
                .promote_now(perspective, version, &stored, Some(up_to))
                .await
            {
                // An append whose event id was made before `up_to` committed after the wait
                // saw it caught up: wait for it too, while time is left.
                Err(VersionError::NotCaughtUp { .. })
                    if deadline.is_none_or(|d| Instant::now() < d) => {}
                other => return other,
            }
        }
    }

    /// Polls until `stored` has applied every event up to `up_to`, for at most `wait`.
    async fn wait_caught_up(
        &self,
        perspective: &PerspectiveName,
        version: u32,
        stored: &PerspectiveName,
        up_to: Uuid,
        wait: Duration,
    ) -> std::result::Result<(), VersionError> {
        let deadline = Instant::now().checked_add(wait);
        let mut pause = Duration::from_millis(5);
        loop {
            let tx = self.source.begin().await?;
            let pending = self.store.pending_through(&tx, stored, None, up_to).await;
            super::rollback(tx, "a read of a version's pending work").await;
            let pending = pending?;
            if pending.is_caught_up() {
                return Ok(());
            }
            let out_of_time = deadline.is_some_and(|d| Instant::now() >= d);
            if pending.parked > 0 || out_of_time {
                return Err(VersionError::NotCaughtUp {
                    perspective: perspective.clone(),
                    version,
                    up_to,
                    pending,
                });
            }
            let left = deadline.map_or(pause, |d| d.saturating_duration_since(Instant::now()));
            tokio::time::sleep(pause.min(left)).await;
            // Each check counts the version's pending work: far behind, check once a second.
            let most = if pending.events > 10_000 {
                Duration::from_secs(1)
            } else {
                Duration::from_millis(100)
            };
            pause = (pause * 2).min(most);
        }
    }

    async fn promote_now(
        &self,
        perspective: &PerspectiveName,
        version: u32,
        stored: &PerspectiveName,
        up_to: Option<Uuid>,
    ) -> std::result::Result<Promoted, VersionError> {
        let hook = self
            .tables
            .iter()
            .find(|(name, _)| name == stored)
            .map(|(_, table)| table.as_ref());
        let promoted =
            promote_in(&self.source, &self.store, perspective, version, up_to, hook).await?;
        if let Promoted::Promoted { previous } = promoted {
            self.building
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(stored);
            count(telemetry::VERSIONS_PROMOTED, stored.as_str(), 1);
            tracing::info!(%perspective, version, ?previous, forced = up_to.is_none(), "perspective version promoted");
        }
        Ok(promoted)
    }

    /// After a cycle: at most once per [`CHECK_EVERY`], promotes the versions this worker runs
    /// that are due.
    pub(super) async fn check_versions(&self) {
        let now = Instant::now();
        let up_to = {
            let mut guard = self
                .version_checks
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let last = guard.last;
            if last.is_some_and(|(at, _)| now.saturating_duration_since(at) < CHECK_EVERY) {
                return;
            }
            guard.last = Some((now, event_id_at(OffsetDateTime::now_utc())));
            // The first check's point is now: it promotes only a version with nothing pending.
            last.map_or_else(|| event_id_at(OffsetDateTime::now_utc()), |(_, id)| id)
        };
        let rows = match crate::versions::versions(&self.source, &self.store, None).await {
            Ok(rows) => rows,
            Err(err) => {
                tracing::debug!(error = %err, "reading perspective versions failed");
                return;
            }
        };
        self.note_building(&rows);
        for row in rows {
            if self.registry.version_of(&row.stored_name).is_none() {
                continue;
            }
            let requested = row.promotion_requested;
            let due = match row.status {
                VersionStatus::Building => {
                    requested.is_some() || row.policy.promotion == Promotion::Automatic
                }
                VersionStatus::Kept => requested.is_some(),
                _ => false,
            };
            if !due || self.checked_recently(&row.stored_name, now) {
                continue;
            }
            let forced = requested.is_some_and(|r| r.force);
            let point = (!forced).then_some(up_to);
            match self
                .promote_now(&row.perspective, row.version, &row.stored_name, point)
                .await
            {
                Ok(_) => {}
                Err(VersionError::NotCaughtUp { pending, .. }) => {
                    // A check counts the pending work: one far behind is checked less often.
                    let secs = (pending.events / 20_000).clamp(1, MAX_BACKOFF.as_secs());
                    self.check_later(&row.stored_name, now + Duration::from_secs(secs));
                }
                Err(err) => {
                    tracing::warn!(error = %err, perspective = %row.perspective, version = row.version, "promoting a perspective version failed");
                }
            }
        }
    }

    /// Remembers which of this worker's versions are being built, as `rows` say.
    fn note_building(&self, rows: &[lockstep_core::PerspectiveVersion]) {
        let building = rows
            .iter()
            .filter(|v| v.status == VersionStatus::Building)
            .filter(|v| self.registry.version_of(&v.stored_name).is_some())
            .map(|v| v.stored_name.clone())
            .collect();
        *self
            .building
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = building;
    }

    fn checked_recently(&self, stored: &PerspectiveName, now: Instant) -> bool {
        let guard = self
            .version_checks
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        guard.later.get(stored).is_some_and(|next| now < *next)
    }

    fn check_later(&self, stored: &PerspectiveName, next: Instant) {
        let mut guard = self
            .version_checks
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        guard.later.insert(stored.clone(), next);
    }
}
