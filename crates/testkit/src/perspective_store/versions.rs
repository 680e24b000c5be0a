//! The in-memory store's perspective versions ([`PerspectiveVersions`]): rows staged per
//! transaction and applied at commit, as the other writes of the store; a perspective's rows
//! are locked through the fake database's transaction-scoped locks, as Postgres locks them
//! with a transaction-scoped advisory lock.

use std::collections::{BTreeMap, BTreeSet};

use lockstep_core::{
    DistributedLock, Error, ErrorKind, PerspectiveName, PerspectiveVersion, PerspectiveVersions,
    PromotionRequest, ResourceKey, Result, VersionDeclaration, VersionStatus,
};

use super::{InMemoryPerspectiveStore, State};
use crate::fake_lock::FakeTransaction;

type VersionKey = (PerspectiveName, u32);

impl InMemoryPerspectiveStore {
    /// The lock key of a perspective's version rows.
    fn versions_key(perspective: &PerspectiveName) -> ResourceKey {
        // Bounded: a perspective name of at most 200 characters.
        ResourceKey::new(format!("lockstep:perspective-versions:{perspective}"))
            .unwrap_or_else(|e| unreachable!("versions key is valid: {e}"))
    }

    async fn lock_versions(
        &self,
        tx: &FakeTransaction,
        perspective: &PerspectiveName,
    ) -> Result<()> {
        self.rows
            .acquire_for_transaction(tx, &Self::versions_key(perspective), None)
            .await
    }

    /// Every version row as `tx` sees it: the committed ones with its own writes over them.
    fn version_rows(
        state: &State,
        tx: &FakeTransaction,
    ) -> BTreeMap<VersionKey, PerspectiveVersion> {
        let mut rows = state.versions.clone();
        if let Some(staged) = state.staged.get(&tx.id()) {
            rows.extend(staged.versions.clone());
        }
        rows
    }

    fn write_version(&self, tx: &FakeTransaction, row: PerspectiveVersion) {
        let mut state = self.lock_state();
        self.stage(&mut state, tx)
            .versions
            .insert((row.perspective.clone(), row.version), row);
    }
}

impl PerspectiveVersions<FakeTransaction> for InMemoryPerspectiveStore {
    async fn declare(
        &self,
        tx: &FakeTransaction,
        versions: &[VersionDeclaration],
    ) -> Result<Vec<PerspectiveVersion>> {
        tx.check_usable()?;
        for declared in versions {
            declared.stored_name()?;
        }
        let perspectives: BTreeSet<PerspectiveName> =
            versions.iter().map(|d| d.perspective.clone()).collect();
        for perspective in &perspectives {
            self.lock_versions(tx, perspective).await?;
        }
        let now = self.now();
        for perspective in &perspectives {
            let (rows, plain_registered) = {
                let state = self.lock_state();
                let rows: Vec<PerspectiveVersion> = Self::version_rows(&state, tx)
                    .into_values()
                    .filter(|v| &v.perspective == perspective)
                    .collect();
                let plain = Self::registered(&state, tx, perspective)
                    || Self::retired_in(&state, tx, perspective);
                (rows, plain)
            };
            let mut declared: Vec<&VersionDeclaration> = versions
                .iter()
                .filter(|d| &d.perspective == perspective)
                .collect();
            declared.sort_by_key(|d| d.version);
            let mut known: BTreeMap<u32, PerspectiveVersion> =
                rows.into_iter().map(|v| (v.version, v)).collect();
            let mut serving = known.values().any(|v| v.status == VersionStatus::Serving);
            // The plain name registered before versions were recorded serves as version 1.
            if !serving && plain_registered && !known.contains_key(&1) {
                let policy = declared
                    .iter()
                    .find(|d| d.version == 1)
                    .map(|d| d.policy)
                    .unwrap_or_default();
                let row = PerspectiveVersion::new(
                    perspective.clone(),
                    1,
                    VersionStatus::Serving,
                    policy,
                    now,
                )?;
                self.write_version(tx, row.clone());
                known.insert(1, row);
                serving = true;
            }
            for d in declared {
                match known.get(&d.version) {
                    Some(row) if row.policy == d.policy => {}
                    Some(row) => {
                        let mut row = row.clone();
                        row.policy = d.policy;
                        self.write_version(tx, row);
                    }
                    None => {
                        // The lowest version declared of a perspective with none serving serves.
                        let status = if serving {
                            VersionStatus::Building
                        } else {
                            serving = true;
                            VersionStatus::Serving
                        };
                        self.write_version(
                            tx,
                            PerspectiveVersion::new(
                                perspective.clone(),
                                d.version,
                                status,
                                d.policy,
                                now,
                            )?,
                        );
                    }
                }
            }
        }
        let state = self.lock_state();
        Ok(Self::version_rows(&state, tx)
            .into_values()
            .filter(|v| perspectives.contains(&v.perspective))
            .collect())
    }

    async fn versions(
        &self,
        tx: &FakeTransaction,
        perspective: Option<&PerspectiveName>,
        lock: bool,
    ) -> Result<Vec<PerspectiveVersion>> {
        tx.check_usable()?;
        if lock && let Some(perspective) = perspective {
            self.lock_versions(tx, perspective).await?;
        }
        let state = self.lock_state();
        Ok(Self::version_rows(&state, tx)
            .into_values()
            .filter(|v| perspective.is_none_or(|p| &v.perspective == p))
            .collect())
    }

    async fn set_version_status(
        &self,
        tx: &FakeTransaction,
        perspective: &PerspectiveName,
        version: u32,
        status: VersionStatus,
    ) -> Result<bool> {
        tx.check_usable()?;
        let rows = {
            let state = self.lock_state();
            Self::version_rows(&state, tx)
        };
        let Some(row) = rows.get(&(perspective.clone(), version)) else {
            return Ok(false);
        };
        if status == VersionStatus::Serving
            && let Some(other) = rows.values().find(|v| {
                &v.perspective == perspective
                    && v.version != version
                    && v.status == VersionStatus::Serving
            })
        {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "perspective {perspective} version {} serves: set its status before making \
                     version {version} the serving one",
                    other.version
                ),
            ));
        }
        let mut row = row.clone();
        row.status = status;
        row.changed_at = self.now();
        row.promotion_requested = None;
        self.write_version(tx, row);
        Ok(true)
    }

    async fn request_promotion(
        &self,
        tx: &FakeTransaction,
        perspective: &PerspectiveName,
        version: u32,
        force: bool,
    ) -> Result<bool> {
        tx.check_usable()?;
        let row = {
            let state = self.lock_state();
            Self::version_rows(&state, tx).remove(&(perspective.clone(), version))
        };
        let Some(mut row) = row else {
            return Ok(false);
        };
        row.promotion_requested = Some(PromotionRequest::new(self.now(), force));
        self.write_version(tx, row);
        Ok(true)
    }
}
