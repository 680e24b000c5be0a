//! Versions of a perspective: a new version of a read model builds beside the one that serves
//! and takes over at once.
//!
//! A perspective's code declares its version ([`crate::Perspective::version`],
//! [`crate::TablePerspective::version`]; 1 by default). Registering version 2 of `Statement`
//! while version 1 serves starts version 2 **beside** it: version 2 is stored under its own
//! name, `Statement@v2` ([`PerspectiveName::versioned`]), so it has its own cursors, work,
//! states and leases, and the workers build it from the first event of every stream with the
//! same claims, leases, fencing, batching, parking and progress as any perspective — while
//! version 1 keeps serving and keeps applying new events. Version 1 is stored under the plain
//! name, so a perspective that never had a second version stores exactly as before.
//!
//! Which version **serves** is a row per version ([`PerspectiveVersion`], Postgres:
//! `wh_perspective_versions`). Reads by a perspective's name (`ReadModels` in the worker crate)
//! resolve the serving version and read that version only: a read never mixes versions.
//!
//! - **Declare** ([`PerspectiveVersions::declare`]): what a worker does when it registers its
//!   perspectives. A version not known yet is recorded: as serving when the perspective has no
//!   serving version (its first version, or the plain name registered before versions were
//!   recorded, which then serves as version 1), else as [`VersionStatus::Building`]. A retired
//!   or abandoned version stays so: a worker still running its code does not bring it back
//!   (ship a fix as the next version).
//! - **Promote**: when a building (or kept) version has caught up, it becomes the serving one
//!   in one transaction that locks the perspective's version rows
//!   ([`PerspectiveVersions::versions`] with `lock`), checks that it has applied every event up
//!   to a point (unless forced), sets the previous serving version to kept or retired as the
//!   promoted version's [`PreviousVersion`] says, and runs the table perspective's hook that
//!   repoints the application's view. The worker does this (it has the hook); an operator
//!   requests it ([`PerspectiveVersions::request_promotion`]) and a worker running that
//!   version performs it.
//! - **Abandon / retire**: a version that does not serve can be retired ([`VersionStatus`]
//!   `Abandoned` when it never served, `Retired` otherwise); its work stops.
//!
//! Every method runs inside `tx` and takes effect when it commits.

use std::fmt;
use std::future::Future;

use time::OffsetDateTime;

use crate::error::{Error, ErrorKind, Result};
use crate::ids::PerspectiveName;
use crate::perspective_store::RetireStates;

/// Where a version stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum VersionStatus {
    /// Built beside the serving version; not read by name.
    Building,
    /// The version reads by name resolve to (one per perspective).
    Serving,
    /// Served before and still applies new events, so that promoting it again (a rollback)
    /// is instant.
    Kept,
    /// Served before; no longer applies events.
    Retired,
    /// Dropped without ever serving.
    Abandoned,
}

impl VersionStatus {
    /// The status as stored and printed: `building`, `serving`, `kept`, `retired`,
    /// `abandoned`.
    pub fn as_str(self) -> &'static str {
        match self {
            VersionStatus::Building => "building",
            VersionStatus::Serving => "serving",
            VersionStatus::Kept => "kept",
            VersionStatus::Retired => "retired",
            VersionStatus::Abandoned => "abandoned",
        }
    }

    /// Parses [`VersionStatus::as_str`]'s text.
    pub fn parse(text: &str) -> Result<VersionStatus> {
        Ok(match text {
            "building" => VersionStatus::Building,
            "serving" => VersionStatus::Serving,
            "kept" => VersionStatus::Kept,
            "retired" => VersionStatus::Retired,
            "abandoned" => VersionStatus::Abandoned,
            other => {
                return Err(Error::new(
                    ErrorKind::Backend,
                    format!("unknown perspective version status {other:?}"),
                ));
            }
        })
    }

    /// Whether the version still applies events (building, serving or kept).
    pub fn is_live(self) -> bool {
        matches!(
            self,
            VersionStatus::Building | VersionStatus::Serving | VersionStatus::Kept
        )
    }
}

impl fmt::Display for VersionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who promotes a building version once it has caught up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Promotion {
    /// A worker running the version promotes it as soon as it has caught up.
    #[default]
    Automatic,
    /// An operator (or the application) promotes it.
    Manual,
}

/// What happens to the serving version when another is promoted over it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PreviousVersion {
    /// It is retired in the promoting transaction: its work stops; its states are kept
    /// ([`RetireStates::Keep`], the default) or deleted ([`RetireStates::Drop`]). A table
    /// perspective's tables are the application's: they stay either way.
    Retire(RetireStates),
    /// It is kept applying new events ([`VersionStatus::Kept`]), so that promoting it again
    /// rolls back at once; retire it when the rollback window is over (its work queues
    /// for as long as it is kept: keep a worker running its code).
    Keep,
}

impl Default for PreviousVersion {
    fn default() -> Self {
        PreviousVersion::Retire(RetireStates::Keep)
    }
}

impl PreviousVersion {
    /// As stored: `keep`, `retire` (states kept) or `drop`.
    pub fn as_str(self) -> &'static str {
        match self {
            PreviousVersion::Keep => "keep",
            PreviousVersion::Retire(RetireStates::Keep) => "retire",
            PreviousVersion::Retire(RetireStates::Drop) => "drop",
        }
    }

    /// Parses [`PreviousVersion::as_str`]'s text.
    pub fn parse(text: &str) -> Result<PreviousVersion> {
        Ok(match text {
            "keep" => PreviousVersion::Keep,
            "retire" => PreviousVersion::Retire(RetireStates::Keep),
            "drop" => PreviousVersion::Retire(RetireStates::Drop),
            other => {
                return Err(Error::new(
                    ErrorKind::Backend,
                    format!("unknown previous-version policy {other:?}"),
                ));
            }
        })
    }
}

/// How a version is registered: its promotion and what its promotion does to the version it
/// replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub struct VersionPolicy {
    /// Who promotes it.
    pub promotion: Promotion,
    /// What its promotion does to the version serving before it.
    pub previous: PreviousVersion,
}

impl VersionPolicy {
    /// Automatic promotion; the previous version retired with its states kept (the default).
    pub fn new() -> VersionPolicy {
        VersionPolicy::default()
    }

    /// Promoted by an operator or the application only.
    pub fn manual(mut self) -> VersionPolicy {
        self.promotion = Promotion::Manual;
        self
    }

    /// What the promotion does to the version it replaces.
    pub fn previous(mut self, previous: PreviousVersion) -> VersionPolicy {
        self.previous = previous;
        self
    }
}

/// One version a worker runs, as [`PerspectiveVersions::declare`] records it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct VersionDeclaration {
    /// The perspective's name (without a version).
    pub perspective: PerspectiveName,
    /// The version, at least 1.
    pub version: u32,
    /// Its promotion and what it does to the previous version.
    pub policy: VersionPolicy,
}

impl VersionDeclaration {
    /// Version `version` of `perspective` under `policy`.
    pub fn new(
        perspective: PerspectiveName,
        version: u32,
        policy: VersionPolicy,
    ) -> VersionDeclaration {
        VersionDeclaration {
            perspective,
            version,
            policy,
        }
    }

    /// The name the version is stored under.
    pub fn stored_name(&self) -> Result<PerspectiveName> {
        self.perspective.versioned(self.version)
    }
}

/// An operator's request to promote a version, waiting for a worker that runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PromotionRequest {
    /// When it was requested (store clock).
    pub requested_at: OffsetDateTime,
    /// Promote without checking that the version has caught up.
    pub force: bool,
}

impl PromotionRequest {
    /// A request made at `requested_at`.
    pub fn new(requested_at: OffsetDateTime, force: bool) -> PromotionRequest {
        PromotionRequest {
            requested_at,
            force,
        }
    }
}

/// One version of a perspective, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PerspectiveVersion {
    /// The perspective's name (without a version).
    pub perspective: PerspectiveName,
    /// The version.
    pub version: u32,
    /// The name its cursors, work and states are stored under.
    pub stored_name: PerspectiveName,
    /// Where it stands.
    pub status: VersionStatus,
    /// Its promotion policy.
    pub policy: VersionPolicy,
    /// A promotion an operator requested, not performed yet.
    pub promotion_requested: Option<PromotionRequest>,
    /// When it was first declared (store clock).
    pub declared_at: OffsetDateTime,
    /// When its status last changed (store clock).
    pub changed_at: OffsetDateTime,
}

impl PerspectiveVersion {
    /// A version row (for stores and tests).
    pub fn new(
        perspective: PerspectiveName,
        version: u32,
        status: VersionStatus,
        policy: VersionPolicy,
        at: OffsetDateTime,
    ) -> Result<PerspectiveVersion> {
        Ok(PerspectiveVersion {
            stored_name: perspective.versioned(version)?,
            perspective,
            version,
            status,
            policy,
            promotion_requested: None,
            declared_at: at,
            changed_at: at,
        })
    }
}

/// The version of `perspective` that serves among `versions` (a store's rows for it), as
/// reads resolve it: the serving row's stored name, or the plain name when no version is
/// recorded (a perspective registered before versions were, or not registered at all).
pub fn serving_name(
    perspective: &PerspectiveName,
    versions: &[PerspectiveVersion],
) -> (Option<u32>, PerspectiveName) {
    versions
        .iter()
        .find(|v| &v.perspective == perspective && v.status == VersionStatus::Serving)
        .map_or_else(
            || (None, perspective.clone()),
            |v| (Some(v.version), v.stored_name.clone()),
        )
}

/// Versions of perspectives, stored; see the [module docs](self).
///
/// Every method runs inside `tx` and takes effect when it commits.
pub trait PerspectiveVersions<Tx: ?Sized + Sync>: Send + Sync {
    /// Records the versions a worker runs (see the [module docs](self)) and returns every
    /// version of their perspectives as stored after it, in (perspective, version) order. A
    /// version already recorded keeps its status; its policy is updated to the declared one.
    /// A version of 0 is [`ErrorKind::InvalidInput`], and nothing is recorded.
    fn declare<'a>(
        &'a self,
        tx: &'a Tx,
        versions: &'a [VersionDeclaration],
    ) -> impl Future<Output = Result<Vec<PerspectiveVersion>>> + Send + 'a;

    /// The versions of `perspective` (every perspective's when `None`), in (perspective,
    /// version) order. With `lock`, the rows of `perspective` are locked for `tx` until it
    /// ends (another locking read waits): what a promotion takes first, so that two cannot
    /// interleave.
    fn versions<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: Option<&'a PerspectiveName>,
        lock: bool,
    ) -> impl Future<Output = Result<Vec<PerspectiveVersion>>> + Send + 'a;

    /// Sets a version's status (and clears its promotion request). `Ok(false)` when there is
    /// no such version. Setting [`VersionStatus::Serving`] while another version serves is
    /// [`ErrorKind::Conflict`]: set that one's status first.
    fn set_version_status<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: &'a PerspectiveName,
        version: u32,
        status: VersionStatus,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;

    /// Requests the promotion of a version (see [`PromotionRequest`]); a worker running it
    /// performs it. `Ok(false)` when there is no such version.
    fn request_promotion<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: &'a PerspectiveName,
        version: u32,
        force: bool,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_policies_round_trip_through_their_text() {
        for status in [
            VersionStatus::Building,
            VersionStatus::Serving,
            VersionStatus::Kept,
            VersionStatus::Retired,
            VersionStatus::Abandoned,
        ] {
            assert_eq!(VersionStatus::parse(status.as_str()).ok(), Some(status));
        }
        assert!(VersionStatus::parse("promoted").is_err());
        for previous in [
            PreviousVersion::Keep,
            PreviousVersion::Retire(RetireStates::Keep),
            PreviousVersion::Retire(RetireStates::Drop),
        ] {
            assert_eq!(
                PreviousVersion::parse(previous.as_str()).ok(),
                Some(previous)
            );
        }
        assert!(PreviousVersion::parse("").is_err());
    }

    #[test]
    fn reads_resolve_the_serving_row_or_the_plain_name() {
        let name = PerspectiveName::new("Statement").expect("valid");
        let at = OffsetDateTime::UNIX_EPOCH;
        let v1 = PerspectiveVersion::new(
            name.clone(),
            1,
            VersionStatus::Kept,
            VersionPolicy::new(),
            at,
        )
        .expect("v1");
        let v2 = PerspectiveVersion::new(
            name.clone(),
            2,
            VersionStatus::Serving,
            VersionPolicy::new(),
            at,
        )
        .expect("v2");
        assert_eq!(
            serving_name(&name, &[v1.clone(), v2]),
            (
                Some(2),
                PerspectiveName::new("Statement@v2").expect("valid")
            )
        );
        assert_eq!(serving_name(&name, &[v1]), (None, name.clone()));
        assert_eq!(serving_name(&name, &[]), (None, name));
    }
}
