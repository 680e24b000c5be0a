//! Cases of [`PerspectiveVersions`](lockstep_core::PerspectiveVersions): the rows that say
//! which version of a perspective serves.
//!
//! The first version declared serves, a later one builds; a perspective registered under its
//! plain name before versions were recorded serves as version 1; a declared version keeps its
//! status and takes the declared policy; version 0 is refused with nothing recorded; two
//! versions never serve at once; a promotion request is recorded and a status change clears
//! it; a transaction that locks a perspective's versions holds another locking one back until
//! it ends, which then reads what it committed.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    ErrorKind, PerspectiveName, PerspectiveVersion, PreviousVersion, RetireStates,
    VersionDeclaration, VersionPolicy, VersionStatus,
};

use super::{PerspectiveStoreFixture, name, register};
use crate::conformance::{begin, commit, rollback};

async fn declare<F: PerspectiveStoreFixture>(
    fixture: &F,
    versions: &[VersionDeclaration],
) -> Vec<PerspectiveVersion> {
    let tx = begin(fixture.source()).await;
    let rows = fixture
        .store()
        .declare(&tx, versions)
        .await
        .expect("declare");
    commit(tx).await.expect("commit");
    rows
}

async fn versions<F: PerspectiveStoreFixture>(
    fixture: &F,
    perspective: &PerspectiveName,
) -> Vec<(u32, VersionStatus)> {
    let tx = begin(fixture.source()).await;
    let rows = fixture
        .store()
        .versions(&tx, Some(perspective), false)
        .await
        .expect("versions");
    rollback(tx).await;
    rows.iter().map(|v| (v.version, v.status)).collect()
}

fn version(perspective: &PerspectiveName, version: u32) -> VersionDeclaration {
    VersionDeclaration::new(perspective.clone(), version, VersionPolicy::new())
}

/// The first version declared of a perspective serves; a later one declared beside it builds,
/// stored under its own name; declaring again keeps each status and takes the declared policy;
/// version 0 is invalid input and records nothing; the list of every perspective's versions
/// holds them.
pub async fn the_first_version_declared_serves_and_a_later_one_builds<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Versioned");
    let rows = declare(&*fixture, &[version(&p, 1)]).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        (rows[0].version, rows[0].status, &rows[0].stored_name),
        (1, VersionStatus::Serving, &p)
    );
    let manual = VersionPolicy::new()
        .manual()
        .previous(PreviousVersion::Keep);
    let rows = declare(
        &*fixture,
        &[
            version(&p, 1),
            VersionDeclaration::new(p.clone(), 2, manual),
        ],
    )
    .await;
    let v2 = rows.iter().find(|v| v.version == 2).expect("version 2");
    assert_eq!(v2.status, VersionStatus::Building);
    assert_eq!(v2.stored_name, p.versioned(2).expect("versioned"));
    assert_eq!(v2.policy, manual);
    assert_eq!(v2.promotion_requested, None);
    assert_eq!(
        versions(&*fixture, &p).await,
        [(1, VersionStatus::Serving), (2, VersionStatus::Building)]
    );
    // Declared again with another policy: the status stays, the policy is the declared one.
    let rows = declare(&*fixture, &[version(&p, 2)]).await;
    let v2 = rows.iter().find(|v| v.version == 2).expect("version 2");
    assert_eq!(
        (v2.status, v2.policy),
        (VersionStatus::Building, VersionPolicy::new())
    );
    // Version 0: refused, nothing recorded.
    let other = name("Versioned");
    let tx = begin(fixture.source()).await;
    let refused = fixture
        .store()
        .declare(&tx, &[version(&other, 1), version(&other, 0)])
        .await
        .expect_err("version 0");
    assert_eq!(refused.kind(), ErrorKind::InvalidInput);
    commit(tx).await.expect("commit");
    assert!(versions(&*fixture, &other).await.is_empty());
    // Every perspective's versions list these too.
    let tx = begin(fixture.source()).await;
    let all = fixture
        .store()
        .versions(&tx, None, false)
        .await
        .expect("versions");
    rollback(tx).await;
    assert_eq!(all.iter().filter(|v| v.perspective == p).count(), 2);
}

/// A perspective registered under its plain name before versions were recorded serves as
/// version 1 once a version of it is declared, and the declared version builds beside it.
pub async fn a_perspective_registered_before_versions_serves_as_version_one<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Older");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let rows = declare(&*fixture, &[version(&p, 3)]).await;
    assert_eq!(
        rows.iter()
            .map(|v| (v.version, v.status, v.stored_name.clone()))
            .collect::<Vec<_>>(),
        [
            (1, VersionStatus::Serving, p.clone()),
            (
                3,
                VersionStatus::Building,
                p.versioned(3).expect("versioned")
            ),
        ]
    );
}

/// Two versions never serve at once: making a second one serving is a conflict that changes
/// nothing; with the first set to kept, it serves. An unknown version is `false`.
pub async fn two_versions_never_serve_at_once<F: PerspectiveStoreFixture>(fixture: Arc<F>) {
    let p = name("Switch");
    declare(&*fixture, &[version(&p, 1), version(&p, 2)]).await;
    let tx = begin(fixture.source()).await;
    let conflict = fixture
        .store()
        .set_version_status(&tx, &p, 2, VersionStatus::Serving)
        .await
        .expect_err("two serving");
    assert_eq!(conflict.kind(), ErrorKind::Conflict);
    rollback(tx).await;
    assert_eq!(
        versions(&*fixture, &p).await,
        [(1, VersionStatus::Serving), (2, VersionStatus::Building)]
    );
    let tx = begin(fixture.source()).await;
    let store = fixture.store();
    assert!(
        store
            .set_version_status(&tx, &p, 1, VersionStatus::Kept)
            .await
            .expect("kept")
    );
    assert!(
        store
            .set_version_status(&tx, &p, 2, VersionStatus::Serving)
            .await
            .expect("serving")
    );
    assert!(
        !store
            .set_version_status(&tx, &p, 7, VersionStatus::Retired)
            .await
            .expect("unknown")
    );
    commit(tx).await.expect("commit");
    assert_eq!(
        versions(&*fixture, &p).await,
        [(1, VersionStatus::Kept), (2, VersionStatus::Serving)]
    );
}

/// A promotion request is recorded with its force flag, and a status change clears it; a
/// request of an unknown version is `false`.
pub async fn a_promotion_request_is_recorded_until_the_status_changes<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Requested");
    declare(&*fixture, &[version(&p, 1), version(&p, 2)]).await;
    let tx = begin(fixture.source()).await;
    let store = fixture.store();
    assert!(
        store
            .request_promotion(&tx, &p, 2, true)
            .await
            .expect("request")
    );
    assert!(
        !store
            .request_promotion(&tx, &p, 9, false)
            .await
            .expect("unknown")
    );
    commit(tx).await.expect("commit");
    let tx = begin(fixture.source()).await;
    let rows = store
        .versions(&tx, Some(&p), false)
        .await
        .expect("versions");
    let request = rows[1].promotion_requested.expect("requested");
    assert!(request.force);
    assert_eq!(rows[0].promotion_requested, None);
    store
        .set_version_status(&tx, &p, 2, VersionStatus::Abandoned)
        .await
        .expect("abandoned");
    commit(tx).await.expect("commit");
    let tx = begin(fixture.source()).await;
    let rows = store
        .versions(&tx, Some(&p), false)
        .await
        .expect("versions");
    rollback(tx).await;
    assert_eq!(
        (rows[1].status, rows[1].promotion_requested),
        (VersionStatus::Abandoned, None)
    );
}

/// A transaction that locks a perspective's versions holds another locking read back until it
/// ends: the second reads what the first committed (the switch, not the rows before it).
pub async fn a_locking_read_of_versions_waits_for_the_transaction_holding_them<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Locked");
    declare(&*fixture, &[version(&p, 1), version(&p, 2)]).await;
    let a = begin(fixture.source()).await;
    fixture
        .store()
        .versions(&a, Some(&p), true)
        .await
        .expect("lock");
    let waiter = {
        let (fixture, p) = (Arc::clone(&fixture), p.clone());
        tokio::spawn(async move {
            let b = begin(fixture.source()).await;
            let rows = fixture
                .store()
                .versions(&b, Some(&p), true)
                .await
                .expect("locking read");
            rollback(b).await;
            rows.iter()
                .map(|v| (v.version, v.status))
                .collect::<Vec<_>>()
        })
    };
    // Give the waiter the chance to read first; whenever it runs, it must see the switch.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let store = fixture.store();
    store
        .set_version_status(&a, &p, 1, VersionStatus::Retired)
        .await
        .expect("retired");
    store
        .retire(&a, &p, RetireStates::Keep)
        .await
        .expect("retire");
    store
        .set_version_status(&a, &p, 2, VersionStatus::Serving)
        .await
        .expect("serving");
    commit(a).await.expect("commit");
    let seen = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter ends once the holder committed")
        .expect("waiter task");
    assert_eq!(
        seen,
        [(1, VersionStatus::Retired), (2, VersionStatus::Serving)]
    );
}
