//! Perspective versions on PostgreSQL ([`PerspectiveVersions`]): the rows of
//! `wh_perspective_versions`, locked per perspective with a transaction-scoped advisory lock on
//! `lockstep:perspective-versions:{perspective}` (a lock, not a row lock, so that a perspective
//! with no row yet is locked too); the declaration is `lockstep_declare_perspective_versions`.

use lockstep_core::{
    Error, ErrorKind, PerspectiveName, PerspectiveVersion, PerspectiveVersions, PreviousVersion,
    Promotion, PromotionRequest, Result, VersionDeclaration, VersionPolicy, VersionStatus,
};
use lockstep_pg::driver::{Columns, query_one};
use lockstep_pg::internal::db_statement_error as statement_error;
use time::OffsetDateTime;

use super::{PerspectiveTransaction, PgPerspectiveStore, decode_error, stored_name};

/// The statements of this module.
mod sql {
    /// The columns every read returns, in [`super::decode`]'s order.
    macro_rules! columns {
        () => {
            "perspective_name, version, stored_name, status, automatic, previous, \
             promote_requested_at, promote_forced, declared_at, changed_at"
        };
    }

    /// Declares `$1[i]` version `$2[i]` (automatic `$3[i]`, previous `$4[i]`).
    pub(super) const DECLARE: &str = concat!(
        "SELECT ",
        columns!(),
        " FROM lockstep_declare_perspective_versions($1, $2, $3, $4)"
    );

    /// Every version, by perspective and version.
    pub(super) const ALL: &str = concat!(
        "SELECT ",
        columns!(),
        " FROM wh_perspective_versions ORDER BY perspective_name COLLATE \"C\", version"
    );

    /// The versions of `$1`.
    pub(super) const OF: &str = concat!(
        "SELECT ",
        columns!(),
        " FROM wh_perspective_versions WHERE perspective_name = $1 ORDER BY version"
    );

    /// Takes the version lock of `$1` for the transaction.
    pub(super) const LOCK: &str = "SELECT pg_advisory_xact_lock(\
         lockstep_advisory_key('lockstep:perspective-versions:' || $1))";

    /// Sets `$1` version `$2` to status `$3`, clearing its promotion request, unless `$3` is
    /// `serving` while another version serves: `updated` 0 or 1, and that other version.
    pub(super) const SET_STATUS: &str = "\
WITH other AS (
    SELECT version FROM wh_perspective_versions
     WHERE perspective_name = $1 AND version <> $2 AND status = 'serving' AND $3 = 'serving'
), updated AS (
    UPDATE wh_perspective_versions
       SET status = $3, changed_at = clock_timestamp(),
           promote_requested_at = NULL, promote_forced = false
     WHERE perspective_name = $1 AND version = $2 AND NOT EXISTS (SELECT 1 FROM other)
    RETURNING 1
)
SELECT (SELECT count(*) FROM updated), (SELECT min(version) FROM other)";

    /// Requests the promotion of `$1` version `$2`, forced when `$3`: a row when that version
    /// is stored.
    pub(super) const REQUEST: &str = "\
UPDATE wh_perspective_versions
   SET promote_requested_at = clock_timestamp(), promote_forced = $3
 WHERE perspective_name = $1 AND version = $2
RETURNING 1";
}

/// A version as stored.
fn decode<R: Columns>(row: &R) -> Result<PerspectiveVersion> {
    let perspective = stored_name(row.column(0).map_err(decode_error)?)?;
    let version: i32 = row.column(1).map_err(decode_error)?;
    let version = u32::try_from(version).map_err(|_| {
        Error::new(
            ErrorKind::Backend,
            "a stored perspective version is negative",
        )
    })?;
    let status: String = row.column(3).map_err(decode_error)?;
    let status = VersionStatus::parse(&status)?;
    let automatic: bool = row.column(4).map_err(decode_error)?;
    let previous: String = row.column(5).map_err(decode_error)?;
    let previous = PreviousVersion::parse(&previous)?;
    let requested_at: Option<OffsetDateTime> = row.column(6).map_err(decode_error)?;
    let forced: bool = row.column(7).map_err(decode_error)?;
    let declared_at: OffsetDateTime = row.column(8).map_err(decode_error)?;
    let changed_at: OffsetDateTime = row.column(9).map_err(decode_error)?;
    let policy = VersionPolicy::new().previous(previous);
    let policy = if automatic { policy } else { policy.manual() };
    let mut out = PerspectiveVersion::new(perspective, version, status, policy, declared_at)?;
    let stored = stored_name(row.column(2).map_err(decode_error)?)?;
    if stored != out.stored_name {
        return Err(Error::new(
            ErrorKind::Backend,
            format!(
                "version {version} of {} is stored as {stored}, not {}",
                out.perspective, out.stored_name
            ),
        ));
    }
    out.changed_at = changed_at;
    out.promotion_requested = requested_at.map(|at| PromotionRequest::new(at, forced));
    Ok(out)
}

fn version_param(version: u32) -> Result<i32> {
    i32::try_from(version).map_err(|_| {
        Error::new(
            ErrorKind::InvalidInput,
            format!("perspective version {version} is above {}", i32::MAX),
        )
    })
}

impl<T: PerspectiveTransaction> PerspectiveVersions<T> for PgPerspectiveStore {
    async fn declare(
        &self,
        tx: &T,
        versions: &[VersionDeclaration],
    ) -> Result<Vec<PerspectiveVersion>> {
        let mut names = Vec::with_capacity(versions.len());
        let mut numbers = Vec::with_capacity(versions.len());
        let mut automatic = Vec::with_capacity(versions.len());
        let mut previous = Vec::with_capacity(versions.len());
        for declared in versions {
            declared.stored_name()?;
            names.push(declared.perspective.as_str());
            numbers.push(version_param(declared.version)?);
            automatic.push(declared.policy.promotion == Promotion::Automatic);
            previous.push(declared.policy.previous.as_str());
        }
        let rows = tx
            .query(sql::DECLARE, &[&names, &numbers, &automatic, &previous])
            .await
            .map_err(|e| statement_error(e, "declaring perspective versions"))?;
        rows.iter().map(decode).collect()
    }

    async fn versions(
        &self,
        tx: &T,
        perspective: Option<&PerspectiveName>,
        lock: bool,
    ) -> Result<Vec<PerspectiveVersion>> {
        let rows = match perspective {
            None => tx.query(sql::ALL, &[]).await,
            Some(name) => {
                if lock {
                    tx.query(sql::LOCK, &[&name.as_str()])
                        .await
                        .map_err(|e| statement_error(e, "locking a perspective's versions"))?;
                }
                tx.query(sql::OF, &[&name.as_str()]).await
            }
        }
        .map_err(|e| statement_error(e, "reading perspective versions"))?;
        rows.iter().map(decode).collect()
    }

    async fn set_version_status(
        &self,
        tx: &T,
        perspective: &PerspectiveName,
        version: u32,
        status: VersionStatus,
    ) -> Result<bool> {
        let row = query_one(
            tx,
            sql::SET_STATUS,
            &[
                &perspective.as_str(),
                &version_param(version)?,
                &status.as_str(),
            ],
        )
        .await
        .map_err(|e| statement_error(e, "setting a perspective version's status"))?;
        let updated: i64 = row.column(0).map_err(decode_error)?;
        let other: Option<i32> = row.column(1).map_err(decode_error)?;
        if let Some(other) = other {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "perspective {perspective} version {other} serves: set its status before \
                     making version {version} the serving one"
                ),
            ));
        }
        Ok(updated > 0)
    }

    async fn request_promotion(
        &self,
        tx: &T,
        perspective: &PerspectiveName,
        version: u32,
        force: bool,
    ) -> Result<bool> {
        let updated = tx
            .query(
                sql::REQUEST,
                &[&perspective.as_str(), &version_param(version)?, &force],
            )
            .await
            .map_err(|e| statement_error(e, "requesting a perspective version's promotion"))?;
        Ok(!updated.is_empty())
    }
}
