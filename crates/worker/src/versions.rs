//! Versions of a perspective from the application's side: list them, promote one, abandon or
//! retire one (see [`lockstep_core::perspective_version`] for the model).
//!
//! - **Promotion** ([`crate::PerspectiveWorker::promote`], and the worker's own automatic and
//!   requested promotions): one transaction that locks the perspective's version rows, checks
//!   that the version has applied every event up to a point (none pending, no rewind, so no
//!   parked pair either; skipped when forced), sets the version serving before it to kept or
//!   retired as the promoted version's policy says (a retirement stops its work in the same
//!   transaction), makes the version the serving one and runs its table perspective's
//!   [`lockstep_core::TablePerspective::promote`] hook, so that the application's view is
//!   repointed in the same commit. Readers resolve the serving version per read: they switch
//!   at that commit, and no read sees two versions. Two promotions at once queue on the lock;
//!   the second finds the version serving ([`Promoted::AlreadyServing`]).
//! - **Who promotes**: a worker promotes the versions it runs — automatically ones registered
//!   with [`lockstep_core::Promotion::Automatic`] once caught up, and the ones an operator
//!   requested ([`request_promotion`], `lockstep perspectives promote`), at most once per
//!   [`CHECK_EVERY`]. The caught-up point of such a check is the time of the worker's previous
//!   check: the version had that long to apply what was appended before it.
//! - **Abandon** ([`abandon`]): a version that does not serve stops (its work is removed, its
//!   states kept or dropped): [`VersionStatus::Abandoned`] when it never served,
//!   [`VersionStatus::Retired`] when it did (a kept version at the end of its rollback window).
//!   The application's tables of a table perspective are its own to drop.

use std::time::Duration;

use lockstep_core::{
    DynTablePerspective, Error, PendingThrough, PerspectiveName, PerspectiveStore,
    PerspectiveVersion, PreviousVersion, Result, RetireStates, Transaction, TransactionSource,
    VersionStatus,
};
use time::OffsetDateTime;
use uuid::Uuid;

/// How often a worker looks for versions to promote.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// What a promotion did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Promoted {
    /// The version serves now.
    Promoted {
        /// The version that served before (now kept or retired), if any.
        previous: Option<u32>,
    },
    /// The version was serving already (another instance promoted it first).
    AlreadyServing,
}

/// Why a version could not be promoted or abandoned. Nothing was changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VersionError {
    /// The perspective has no such version.
    #[error("perspective {perspective} has no version {version}")]
    NoSuchVersion {
        /// The perspective.
        perspective: PerspectiveName,
        /// The version asked for.
        version: u32,
    },
    /// The version no longer applies events (retired or abandoned): it cannot serve again.
    #[error("perspective {perspective} version {version} is {status}: it cannot be promoted")]
    NotPromotable {
        /// The perspective.
        perspective: PerspectiveName,
        /// The version.
        version: u32,
        /// Its status.
        status: VersionStatus,
    },
    /// The version has not applied every event up to `up_to` (unforced promotion).
    #[error(
        "perspective {perspective} version {version} has not caught up: {} events and {} \
         rewinds pending up to {up_to}{}",
        pending.events,
        pending.rewinds,
        if pending.parked > 0 { format!(", {} parked pairs", pending.parked) } else { String::new() }
    )]
    NotCaughtUp {
        /// The perspective.
        perspective: PerspectiveName,
        /// The version.
        version: u32,
        /// The point it was checked against.
        up_to: Uuid,
        /// What it had not applied at the last check.
        pending: PendingThrough,
    },
    /// The serving version cannot be abandoned or retired: promote another first.
    #[error("perspective {perspective} version {version} serves: promote another version first")]
    Serving {
        /// The perspective.
        perspective: PerspectiveName,
        /// The version.
        version: u32,
    },
    /// This worker does not run the version, so it cannot run its promotion hook: promote it
    /// from a worker that runs it, or request it ([`request_promotion`]).
    #[error("this worker does not run perspective {perspective} version {version}")]
    NotRunHere {
        /// The perspective.
        perspective: PerspectiveName,
        /// The version.
        version: u32,
    },
    /// The table perspective's promotion hook failed; the promotion was rolled back.
    #[error("the promotion hook of perspective {perspective} version {version} failed: {detail}")]
    Hook {
        /// The perspective.
        perspective: PerspectiveName,
        /// The version.
        version: u32,
        /// The hook's error.
        detail: String,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] Error),
}

/// The largest UUIDv7 of the millisecond `at`: every event id made at or before it sorts at
/// or before this one.
pub fn event_id_at(at: OffsetDateTime) -> Uuid {
    let ms = (at.unix_timestamp_nanos() / 1_000_000).clamp(0, (1 << 48) - 1);
    let ms = u64::try_from(ms).unwrap_or(0);
    let mut bytes = [0xFF_u8; 16];
    bytes[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    bytes[6] = 0x7F; // version 7, then the highest bits
    bytes[8] = 0xBF; // the RFC 4122 variant, then the highest bits
    Uuid::from_bytes(bytes)
}

/// Every version of `perspective` (of every perspective when `None`), in a transaction of its
/// own.
pub async fn versions<S, P>(
    source: &S,
    store: &P,
    perspective: Option<&PerspectiveName>,
) -> Result<Vec<PerspectiveVersion>>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let tx = source.begin().await?;
    let rows = store.versions(&tx, perspective, false).await;
    crate::worker::rollback(tx, "a read of perspective versions").await;
    rows
}

/// Requests the promotion of `perspective` version `version`; a worker running it performs it
/// (without checking that it has caught up when `force`). Refuses a version that does not
/// exist or no longer applies events.
pub async fn request_promotion<S, P>(
    source: &S,
    store: &P,
    perspective: &PerspectiveName,
    version: u32,
    force: bool,
) -> std::result::Result<(), VersionError>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let tx = source.begin().await?;
    let requested = async {
        let rows = store.versions(&tx, Some(perspective), true).await?;
        let row = find(&rows, perspective, version)?;
        if !row.status.is_live() {
            return Err(VersionError::NotPromotable {
                perspective: perspective.clone(),
                version,
                status: row.status,
            });
        }
        if row.status != VersionStatus::Serving {
            store
                .request_promotion(&tx, perspective, version, force)
                .await?;
        }
        Ok(())
    }
    .await;
    finish(tx, requested, "a promotion request").await
}

/// Stops `perspective` version `version`, which must not serve: its work is removed and its
/// states kept or dropped as `states` says; it is [`VersionStatus::Abandoned`] when it never
/// served, else [`VersionStatus::Retired`] (the status returned). A version already stopped
/// is left as it is.
pub async fn abandon<S, P>(
    source: &S,
    store: &P,
    perspective: &PerspectiveName,
    version: u32,
    states: RetireStates,
) -> std::result::Result<VersionStatus, VersionError>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let tx = source.begin().await?;
    let abandoned = async {
        let rows = store.versions(&tx, Some(perspective), true).await?;
        let row = find(&rows, perspective, version)?;
        let status = match row.status {
            VersionStatus::Serving => {
                return Err(VersionError::Serving {
                    perspective: perspective.clone(),
                    version,
                });
            }
            VersionStatus::Retired | VersionStatus::Abandoned => return Ok(row.status),
            VersionStatus::Building => VersionStatus::Abandoned,
            VersionStatus::Kept => VersionStatus::Retired,
        };
        store.retire(&tx, &row.stored_name, states).await?;
        store
            .set_version_status(&tx, perspective, version, status)
            .await?;
        Ok(status)
    }
    .await;
    finish(tx, abandoned, "an abandonment of a version").await
}

/// Commits `tx` when `outcome` is a success, else rolls it back and returns the error.
async fn finish<T: Transaction, O>(
    tx: T,
    outcome: std::result::Result<O, VersionError>,
    what: &'static str,
) -> std::result::Result<O, VersionError> {
    match outcome {
        Ok(done) => {
            tx.commit().await?;
            Ok(done)
        }
        Err(err) => {
            crate::worker::rollback(tx, what).await;
            Err(err)
        }
    }
}

/// Promotes `perspective` version `version` in one transaction (see the [module
/// docs](self)): checked against `up_to` unless `None` (forced), running `hook` after the
/// switch.
pub(crate) async fn promote_in<S, P>(
    source: &S,
    store: &P,
    perspective: &PerspectiveName,
    version: u32,
    up_to: Option<Uuid>,
    hook: Option<&dyn DynTablePerspective<S::Tx>>,
) -> std::result::Result<Promoted, VersionError>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let tx = source.begin().await?;
    let promoted = async {
        let rows = store.versions(&tx, Some(perspective), true).await?;
        let target = find(&rows, perspective, version)?;
        match target.status {
            VersionStatus::Serving => return Ok(Promoted::AlreadyServing),
            VersionStatus::Retired | VersionStatus::Abandoned => {
                return Err(VersionError::NotPromotable {
                    perspective: perspective.clone(),
                    version,
                    status: target.status,
                });
            }
            VersionStatus::Building | VersionStatus::Kept => {}
        }
        if let Some(up_to) = up_to {
            let pending = store
                .pending_through(&tx, &target.stored_name, None, up_to)
                .await?;
            if !pending.is_caught_up() {
                return Err(VersionError::NotCaughtUp {
                    perspective: perspective.clone(),
                    version,
                    up_to,
                    pending,
                });
            }
        }
        let previous = rows.iter().find(|v| v.status == VersionStatus::Serving);
        if let Some(previous) = previous {
            let demoted = match target.policy.previous {
                PreviousVersion::Keep => VersionStatus::Kept,
                PreviousVersion::Retire(states) => {
                    store.retire(&tx, &previous.stored_name, states).await?;
                    VersionStatus::Retired
                }
            };
            store
                .set_version_status(&tx, perspective, previous.version, demoted)
                .await?;
        }
        store
            .set_version_status(&tx, perspective, version, VersionStatus::Serving)
            .await?;
        if let Some(hook) = hook
            && let Err(detail) = hook.promote_version(&tx).await
        {
            return Err(VersionError::Hook {
                perspective: perspective.clone(),
                version,
                detail,
            });
        }
        Ok(Promoted::Promoted {
            previous: previous.map(|v| v.version),
        })
    }
    .await;
    match promoted {
        // Nothing was written: end it without a commit.
        Ok(Promoted::AlreadyServing) => {
            crate::worker::rollback(tx, "a promotion of a serving version").await;
            Ok(Promoted::AlreadyServing)
        }
        other => finish(tx, other, "a promotion").await,
    }
}

fn find<'a>(
    rows: &'a [PerspectiveVersion],
    perspective: &PerspectiveName,
    version: u32,
) -> std::result::Result<&'a PerspectiveVersion, VersionError> {
    rows.iter()
        .find(|v| &v.perspective == perspective && v.version == version)
        .ok_or_else(|| VersionError::NoSuchVersion {
            perspective: perspective.clone(),
            version,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_event_id_of_a_millisecond_sorts_after_every_id_made_in_it() {
        let at =
            OffsetDateTime::from_unix_timestamp_nanos(1_765_000_000_123_456_789).expect("a time");
        let bound = event_id_at(at);
        assert_eq!(bound.get_version_num(), 7);
        let ms = 1_765_000_000_123_u64;
        let inside = Uuid::new_v7(uuid::Timestamp::from_unix(
            uuid::NoContext,
            ms / 1000,
            u32::try_from((ms % 1000) * 1_000_000 + 999_999).expect("nanos"),
        ));
        let after = Uuid::new_v7(uuid::Timestamp::from_unix(
            uuid::NoContext,
            (ms + 1) / 1000,
            u32::try_from(((ms + 1) % 1000) * 1_000_000).expect("nanos"),
        ));
        assert!(inside <= bound, "{inside} <= {bound}");
        assert!(after > bound, "{after} > {bound}");
        assert_eq!(
            event_id_at(OffsetDateTime::UNIX_EPOCH).as_bytes()[..6],
            [0; 6]
        );
    }
}
