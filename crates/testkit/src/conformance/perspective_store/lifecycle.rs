//! Cases of [`PerspectiveLifecycle`](lockstep_core::PerspectiveLifecycle): a perspective's life.
//!
//! A perspective registered later catches up on existing events; retired with its states kept
//! it gets no work and continues from its cursors when registered again (an event appended
//! while it was retired before a cursor is a late arrival); retired with its states dropped it
//! starts again from the first event; a rebuild requests a rewind from the start on every pair
//! and keeps the old states; applied events add up in the catch-up window (`record_applied`,
//! `throughput`).

use std::sync::Arc;

use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{ErrorKind, PairFailure, PerspectiveName, Rebuild, RetireStates, Retired};
use uuid::Uuid;

use super::{
    ALL_EVENTS, PerspectiveStoreFixture, append, apply, cursor, event, ids, name, pending,
    register, retire, rewind, snapshots, state, stream_with, trigger, trigger_after_claim,
};
use crate::conformance::{begin, commit, rollback};

/// A perspective registered after events were appended gets work for them (catch-up);
/// registering it again enqueues nothing twice.
pub async fn a_perspective_registered_later_catches_up_on_existing_events<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids).await;
    let late = name("Latecomer");
    assert!(pending(&*fixture, stream, &late).await.is_empty());
    register(&*fixture, std::slice::from_ref(&late)).await;
    assert_eq!(pending(&*fixture, stream, &late).await, ids, "caught up");
    apply(&*fixture, stream, &late, ALL_EVENTS, false).await;
    register(&*fixture, std::slice::from_ref(&late)).await;
    assert!(
        pending(&*fixture, stream, &late).await.is_empty(),
        "registering again enqueues nothing"
    );
    let (_, state) = state(&*fixture, stream, &late).await.expect("cursor");
    assert_eq!(state, Some(serde_json::json!({ "sum": 6 })));
}

async fn retired_names<F: PerspectiveStoreFixture>(fixture: &F) -> Vec<PerspectiveName> {
    let tx = begin(fixture.source()).await;
    let names = fixture.store().retired(&tx).await.expect("retired");
    rollback(tx).await;
    names
}

async fn rebuild<F: PerspectiveStoreFixture>(fixture: &F, name: &PerspectiveName) -> Rebuild {
    let tx = begin(fixture.source()).await;
    let rebuilt = fixture.store().rebuild(&tx, name).await.expect("rebuild");
    commit(tx).await.expect("commit");
    rebuilt
}

async fn listed_in_status<F: PerspectiveStoreFixture>(fixture: &F, name: &PerspectiveName) -> bool {
    let tx = begin(fixture.source()).await;
    let status = fixture
        .store()
        .perspective_status(&tx)
        .await
        .expect("perspective_status");
    rollback(tx).await;
    status.iter().any(|s| &s.perspective == name)
}

/// Retiring a perspective with its states kept: its queued work is gone, appends enqueue none
/// for it, its states stay readable; registered again, each pair continues from its cursor with
/// the events appended meanwhile as its work. Retiring an unknown perspective does nothing.
pub async fn a_retired_perspective_gets_no_work_keeps_its_states_and_continues_when_registered_again<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Retired");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(4);
    let stream = stream_with(&*fixture, &ids[..3]).await;
    apply(&*fixture, stream, &p, 2, false).await;
    assert_eq!(pending(&*fixture, stream, &p).await, vec![ids[2]]);

    let Retired::Retired {
        work_removed,
        pairs,
    } = retire(&*fixture, &p, RetireStates::Keep).await
    else {
        panic!("a registered perspective is retired");
    };
    assert!(work_removed >= 1, "its queued work is removed");
    assert!(pairs >= 1, "its pairs are kept");
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    assert!(retired_names(&*fixture).await.contains(&p));
    assert!(
        !listed_in_status(&*fixture, &p).await,
        "no longer registered"
    );
    let (cursor, kept) = state(&*fixture, stream, &p).await.expect("cursor kept");
    assert_eq!(cursor.applied_count, 2);
    assert_eq!(
        kept,
        Some(serde_json::json!({ "sum": 3 })),
        "the state is kept"
    );

    // Appends while retired enqueue nothing for it, on its streams and on new ones.
    append(&*fixture, stream, &[event(ids[3], 4)]).await;
    let newer = stream_with(&*fixture, &self::ids(1)).await;
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    assert!(pending(&*fixture, newer, &p).await.is_empty());
    assert_eq!(
        rebuild(&*fixture, &p).await,
        Rebuild::NotRegistered,
        "a retired perspective is not rebuilt"
    );

    // Registered again: from the cursor, with what was queued and what was appended meanwhile.
    register(&*fixture, std::slice::from_ref(&p)).await;
    assert!(!retired_names(&*fixture).await.contains(&p));
    assert_eq!(pending(&*fixture, stream, &p).await, vec![ids[2], ids[3]]);
    assert_eq!(pending(&*fixture, newer, &p).await.len(), 1);
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    let (cursor, rebuilt) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(cursor.applied_count, 4);
    assert_eq!(rebuilt, Some(serde_json::json!({ "sum": 10 })));

    assert_eq!(
        retire(&*fixture, &name("NeverRegistered"), RetireStates::Keep).await,
        Retired::NotRegistered
    );
    assert_eq!(
        retire(&*fixture, &name("NeverRegistered"), RetireStates::Drop).await,
        Retired::NotRegistered
    );
}

/// Retiring with the states dropped deletes the perspective's pairs; registered again, it
/// starts from the first event like a new perspective. A perspective retired with kept states
/// can be retired again to drop them.
pub async fn a_perspective_retired_with_dropped_states_starts_again_from_the_first_event<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Dropped");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, true).await;

    assert!(matches!(
        retire(&*fixture, &p, RetireStates::Keep).await,
        Retired::Retired { .. }
    ));
    let Retired::Retired {
        work_removed,
        pairs,
    } = retire(&*fixture, &p, RetireStates::Drop).await
    else {
        panic!("a perspective retired with kept states can be dropped");
    };
    assert_eq!(work_removed, 0, "its work was already removed");
    assert!(pairs >= 1);
    assert_eq!(
        cursor(&*fixture, stream, &p).await,
        None,
        "the pair is gone"
    );
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());
    assert!(!retired_names(&*fixture).await.contains(&p));
    assert_eq!(
        retire(&*fixture, &p, RetireStates::Drop).await,
        Retired::NotRegistered,
        "nothing is left to retire"
    );

    register(&*fixture, std::slice::from_ref(&p)).await;
    assert_eq!(pending(&*fixture, stream, &p).await, ids);
    // A new cursor (Postgres creates it at registration, the fake at the first claim).
    if let Some((cursor, none)) = state(&*fixture, stream, &p).await {
        assert_eq!(
            (cursor.last_event_id, cursor.applied_count, none),
            (None, 0, None)
        );
    }
}

/// An event appended while a perspective was retired that sorts before a kept cursor is a late
/// arrival once the perspective is registered again: the claim turns it into a rewind.
pub async fn an_event_appended_while_retired_before_the_cursor_is_a_late_arrival<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("RetiredLate");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &[ids[0], ids[2]]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    retire(&*fixture, &p, RetireStates::Keep).await;
    append(&*fixture, stream, &[event(ids[1], 3)]).await;
    register(&*fixture, std::slice::from_ref(&p)).await;
    assert_eq!(pending(&*fixture, stream, &p).await, vec![ids[1]]);
    assert_eq!(trigger_after_claim(&*fixture, stream, &p).await, ids[1]);
}

/// A rebuild requests a rewind from the start on every pair of the perspective (a parked pair
/// included, which it also retries); each pair keeps its old state until its own rewind
/// commits. An unknown perspective is not rebuilt.
pub async fn a_rebuild_requests_a_rewind_from_the_start_on_every_pair_and_keeps_the_old_states<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Rebuilt");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let first = stream_with(&*fixture, &ids(2)).await;
    let second = stream_with(&*fixture, &ids(3)).await;
    apply(&*fixture, first, &p, ALL_EVENTS, false).await;
    apply(&*fixture, second, &p, ALL_EVENTS, false).await;
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .record_failure(
            &tx,
            &lockstep_core::Pair::new(second, p.clone()),
            &PairFailure::new("boom").park(true),
        )
        .await
        .expect("record_failure");
    commit(tx).await.expect("commit");

    let Rebuild::Requested { pairs } = rebuild(&*fixture, &p).await else {
        panic!("a registered perspective is rebuilt");
    };
    assert!(pairs >= 2, "every pair, {pairs}");
    for stream in [first, second] {
        let c = cursor(&*fixture, stream, &p).await.expect("cursor");
        assert_eq!(
            c.rewind.map(|r| r.trigger),
            Some(Uuid::nil()),
            "from the start"
        );
        assert_eq!((c.parked_at, c.failures), (None, 0), "retried");
    }
    let old = state(&*fixture, second, &p).await.expect("cursor").1;
    assert_eq!(old, Some(serde_json::json!({ "sum": 6 })));

    rewind(&*fixture, first, &p, Uuid::nil(), None)
        .await
        .expect("the first pair's rewind commits");
    assert_eq!(trigger(&*fixture, first, &p).await, None);
    assert_eq!(
        trigger(&*fixture, second, &p).await,
        Some(Uuid::nil()),
        "the other pair waits for its own rewind"
    );
    assert_eq!(
        state(&*fixture, second, &p).await.expect("cursor").1,
        old,
        "and serves its old state meanwhile"
    );
    assert_eq!(
        rebuild(&*fixture, &name("NeverRegistered")).await,
        Rebuild::NotRegistered
    );
}

/// Applied events reported with `record_applied` add up in the perspective's open window
/// (every instance's together); a count a database cannot store is invalid input.
pub async fn applied_events_add_up_in_the_perspectives_catch_up_window<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let (p, other) = (name("Rate"), name("RateOther"));
    let store = fixture.store();
    let tx = begin(fixture.source()).await;
    store
        .record_applied(&tx, &[(p.clone(), 5), (other.clone(), 1)])
        .await
        .expect("record_applied");
    store
        .record_applied(&tx, &[(p.clone(), 1), (p.clone(), 2)])
        .await
        .expect("a name given twice counts twice");
    let err = store
        .record_applied(&tx, &[(p.clone(), u64::MAX)])
        .await
        .expect_err("out of range");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    commit(tx).await.expect("commit");

    let tx = begin(fixture.source()).await;
    let rates = store.throughput(&tx).await.expect("throughput");
    rollback(tx).await;
    let mine = rates
        .iter()
        .find(|t| t.perspective == p)
        .expect("the perspective's rate");
    assert_eq!(mine.window_applied, 8, "{mine:?}");
    assert!(
        mine.events_per_second
            .is_none_or(|r| (0.0..=8.0).contains(&r)),
        "no rate before a second, at most 8 events over it: {mine:?}"
    );
    let theirs = rates
        .iter()
        .find(|t| t.perspective == other)
        .expect("other");
    assert_eq!(theirs.window_applied, 1);
}
