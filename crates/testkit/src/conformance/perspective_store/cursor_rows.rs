//! Cases of [`CursorRows`](lockstep_core::CursorRows): cursor rows made and removed directly,
//! and pending pairs listed without claiming them.
//!
//! `pending_pairs` lists only the perspectives asked for; `ensure_cursor` is idempotent and
//! `delete_cursor` removes the pair.

use std::sync::Arc;

use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{InstanceId, PerspectiveName, RewindDebounce, StreamId};

use super::{
    ALL_PAIRS, PerspectiveStoreFixture, append, apply, cursor, ensure_cursor, event, ids, name,
    pending, register, request, snapshots, state, stream_with,
};
use crate::conformance::{begin, commit, rollback};

/// Issue 18: `pending_pairs` lists only pairs of the perspectives the caller runs — work or a
/// rewind request of another registered perspective, however old, never takes their places.
pub async fn pending_pairs_lists_only_the_perspectives_asked_for<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    // "Absent-…" sorts before "Served-…": unfiltered, its pair would come first.
    let (served, absent) = (name("Served"), name("Absent"));
    register(&*fixture, &[served.clone(), absent.clone()]).await;
    let old = stream_with(&*fixture, &ids(2)).await;
    let new = stream_with(&*fixture, &ids(1)).await;
    ensure_cursor(&*fixture, new, &absent).await;
    request(&*fixture, new, &absent, None).await;
    let instance = InstanceId::random();
    let tx = begin(fixture.source()).await;
    let listed = |names: Vec<PerspectiveName>, limit: usize| {
        let (store, tx) = (fixture.store(), &tx);
        async move {
            store
                .pending_pairs(tx, instance, &names, RewindDebounce::NONE, limit)
                .await
                .expect("pending_pairs")
                .into_iter()
                .map(|p| {
                    (
                        p.pair.stream_id,
                        p.pair.perspective.as_str().to_owned(),
                        p.rewind,
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        listed(vec![served.clone()], 1).await,
        [(old, served.as_str().to_owned(), false)],
        "the oldest work of the perspective asked for, not the oldest overall"
    );
    let mut mine = listed(vec![served.clone()], ALL_PAIRS).await;
    mine.sort();
    let mut expected = vec![
        (old, served.as_str().to_owned(), false),
        (new, served.as_str().to_owned(), false),
    ];
    expected.sort();
    assert_eq!(
        mine, expected,
        "no pair of another perspective, not even a rewind"
    );
    assert_eq!(
        listed(vec![served.clone(), absent.clone()], ALL_PAIRS)
            .await
            .len(),
        4,
        "both perspectives when asked for both"
    );
    assert!(
        listed(Vec::new(), ALL_PAIRS).await.is_empty(),
        "none asked for, none listed"
    );
    rollback(tx).await;
}

/// `ensure_cursor` creates a cursor row once; `delete_cursor` deletes it with its state,
/// snapshots and work, once.
pub async fn ensure_cursor_is_idempotent_and_delete_cursor_removes_the_pair<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let (stream, p) = (StreamId::new_v7(), name("Rows"));
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .ensure_cursor(&tx, &lockstep_core::Pair::new(stream, p.clone()))
            .await
            .expect("ensure")
    );
    assert!(
        !fixture
            .store()
            .ensure_cursor(&tx, &lockstep_core::Pair::new(stream, p.clone()))
            .await
            .expect("ensure"),
        "already there"
    );
    commit(tx).await.expect("commit");
    let created = cursor(&*fixture, stream, &p).await.expect("created");
    assert_eq!((created.last_event_id, created.applied_count), (None, 0));
    assert!(created.lease.is_unlocked());

    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    append(&*fixture, stream, &[event(ids[0], 1), event(ids[1], 2)]).await;
    apply(&*fixture, stream, &p, 1, true).await;
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .delete_cursor(&tx, &lockstep_core::Pair::new(stream, p.clone()))
            .await
            .expect("delete")
    );
    assert!(
        !fixture
            .store()
            .delete_cursor(&tx, &lockstep_core::Pair::new(stream, p.clone()))
            .await
            .expect("delete"),
        "already gone"
    );
    commit(tx).await.expect("commit");
    assert!(state(&*fixture, stream, &p).await.is_none());
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());
}
