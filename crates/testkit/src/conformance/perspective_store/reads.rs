//! Cases of [`PerspectiveReads`](lockstep_core::PerspectiveReads): what read models, waits and
//! operators read.
//!
//! A stream's events in event-id order after a given id, paging through one perspective's
//! states in stream order (`states`), and `pending_through`: what is not applied up to an
//! event, and whether the perspective is registered.

use std::sync::Arc;

use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    ErrorKind, PairFailure, PerspectiveName, Registration, RetireStates, StreamId,
};
use uuid::Uuid;

use super::{
    ALL_EVENTS, PerspectiveStoreFixture, apply, event_ids, folded, ids, name, register, retire,
    stream_with,
};
use crate::conformance::{begin, commit, rollback};

/// What `perspective` (one stream of it) has not applied of the events up to `up_to`.
async fn pending_through<F: PerspectiveStoreFixture>(
    fixture: &F,
    name: &PerspectiveName,
    stream: Option<StreamId>,
    up_to: Uuid,
) -> lockstep_core::PendingThrough {
    let tx = begin(fixture.source()).await;
    let pending = fixture
        .store()
        .pending_through(&tx, name, stream, up_to)
        .await
        .expect("pending_through");
    rollback(tx).await;
    pending
}

/// `stream_events` returns a stream's events in event-id order (not append order), after the
/// given id when one is given.
pub async fn stream_events_come_in_event_id_order_after_the_given_id<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let ids = ids(4);
    let stream = stream_with(&*fixture, &[ids[2], ids[0], ids[3], ids[1]]).await;
    let tx = begin(fixture.source()).await;
    let all = fixture
        .store()
        .stream_events(&tx, stream, None)
        .await
        .expect("stream_events");
    assert_eq!(event_ids(&all), ids);
    assert_eq!(
        all.iter().map(|e| e.version).collect::<Vec<_>>(),
        [2, 4, 1, 3],
        "versions keep append order"
    );
    assert!(all.iter().all(|e| e.stream_id == stream));
    let after = fixture
        .store()
        .stream_events(&tx, stream, Some(ids[1]))
        .await
        .expect("stream_events");
    assert_eq!(event_ids(&after), ids[2..]);
    let none = fixture
        .store()
        .stream_events(&tx, StreamId::new_v7(), None)
        .await
        .expect("stream_events");
    assert!(none.is_empty());
    rollback(tx).await;
}

/// `states` pages through one perspective's stored states in stream-id order: only pairs that
/// have a state, only of that perspective, each page after the last stream of the one before;
/// a page of 0 or more than `MAX_STATES_PAGE` is invalid input.
pub async fn states_page_through_one_perspectives_states_in_stream_order<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Paged");
    let other = name("PagedOther");
    register(&*fixture, &[p.clone(), other.clone()]).await;
    let mut streams = Vec::new();
    for n in 1..=3 {
        let stream = stream_with(&*fixture, &ids(n)).await;
        apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
        streams.push(stream);
    }
    // A stream with work but no state yet, and a state of another perspective: not listed.
    let _unapplied = stream_with(&*fixture, &ids(1)).await;
    apply(&*fixture, streams[0], &other, ALL_EVENTS, false).await;
    streams.sort();

    let tx = begin(fixture.source()).await;
    let store = fixture.store();
    let first = store.states(&tx, &p, None, 2).await.expect("first page");
    let mine = |page: &[lockstep_core::StoredState]| -> Vec<StreamId> {
        page.iter()
            .map(|s| s.cursor.pair.stream_id)
            .filter(|s| streams.contains(s))
            .collect()
    };
    // Other cases' streams (a shared database) may sort among ours; walk every page.
    let mut seen = mine(&first);
    let mut after = first.last().map(|s| s.cursor.pair.stream_id);
    assert!(first.len() <= 2, "a page holds at most its limit");
    for stored in &first {
        assert_eq!(stored.cursor.pair.perspective, p);
    }
    while let Some(last) = after {
        let page = store
            .states(&tx, &p, Some(last), 2)
            .await
            .expect("next page");
        assert!(page.len() <= 2);
        assert!(
            page.iter().all(|s| s.cursor.pair.stream_id > last),
            "a page starts after the stream it was asked to"
        );
        for stored in &page {
            if let Some(i) = streams
                .iter()
                .position(|s| *s == stored.cursor.pair.stream_id)
            {
                let events = store
                    .stream_events(&tx, stored.cursor.pair.stream_id, None)
                    .await
                    .expect("events");
                assert_eq!(stored.state, folded(None, &events), "stream {i}'s state");
                assert_eq!(stored.cursor.applied_count, events.len() as u64);
            }
        }
        seen.extend(mine(&page));
        after = page.last().map(|s| s.cursor.pair.stream_id);
    }
    assert_eq!(
        seen, streams,
        "every state of the perspective, in stream order"
    );
    for limit in [0, lockstep_core::MAX_STATES_PAGE + 1] {
        let err = store
            .states(&tx, &p, None, limit)
            .await
            .expect_err("a page size out of range");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "limit {limit}");
    }
    rollback(tx).await;
}

/// `pending_through` says what a pair, and a whole perspective, has not applied of the events
/// up to a given one: the work up to it (not after it), a rewind requested from such an event,
/// and whether the pairs holding it are parked (with their error).
pub async fn pending_through_counts_what_is_not_applied_up_to_an_event<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Through");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids).await;
    let whole_before = pending_through(&*fixture, &p, None, ids[2]).await;
    assert!(whole_before.events >= 3, "{whole_before:?}");

    let pair = pending_through(&*fixture, &p, Some(stream), ids[2]).await;
    assert_eq!((pair.events, pair.rewinds, pair.parked), (3, 0, 0));
    assert!(!pair.is_caught_up());
    assert_eq!(
        pending_through(&*fixture, &p, Some(stream), ids[0])
            .await
            .events,
        1,
        "only the events up to the one asked for"
    );

    apply(&*fixture, stream, &p, 2, false).await;
    assert!(
        pending_through(&*fixture, &p, Some(stream), ids[1])
            .await
            .is_caught_up(),
        "applied up to the second event"
    );
    assert_eq!(
        pending_through(&*fixture, &p, Some(stream), ids[2])
            .await
            .events,
        1
    );
    assert_eq!(
        pending_through(&*fixture, &p, None, ids[2]).await.events,
        whole_before.events - 2,
        "the perspective's count goes down with the pair's"
    );

    // A failing, parked pair: counted with its error.
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .record_failure(
            &tx,
            &lockstep_core::Pair::new(stream, p.clone()),
            &PairFailure::new("boom").park(true),
        )
        .await
        .expect("record_failure");
    commit(tx).await.expect("commit");
    let parked = pending_through(&*fixture, &p, Some(stream), ids[2]).await;
    assert_eq!((parked.events, parked.parked), (1, 1));
    assert_eq!(parked.error.as_deref(), Some("boom"));
    let before = pending_through(&*fixture, &p, Some(stream), ids[1]).await;
    assert_eq!(
        (before.events, before.rewinds, before.parked, before.error),
        (0, 0, 0, None),
        "a pair parked after the event asked for does not hold it up"
    );

    // A rewind requested from an event up to the one asked for holds it up until committed.
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .request_rewind(
                &tx,
                &lockstep_core::Pair::new(stream, p.clone()),
                Some(ids[1])
            )
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");
    let rewinding = pending_through(&*fixture, &p, Some(stream), ids[2]).await;
    assert_eq!((rewinding.events, rewinding.rewinds), (0, 1));
    assert!(
        pending_through(&*fixture, &p, Some(stream), ids[0])
            .await
            .is_caught_up(),
        "a rewind from a later event does not hold up an earlier one"
    );
}

/// `pending_through` says whether the perspective is registered: a registered one is, a name
/// never registered (misspelt) is not, one retired with its states kept is retired, and one
/// retired with its states dropped is not registered — so that a wait can refuse to call
/// "caught up" a perspective that nothing applies.
pub async fn pending_through_says_whether_the_perspective_is_registered<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Registration");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(1);
    let stream = stream_with(&*fixture, &ids).await;
    let registration = async |name: &PerspectiveName| {
        pending_through(&*fixture, name, Some(stream), ids[0])
            .await
            .registration
    };
    assert_eq!(registration(&p).await, Some(Registration::Registered));
    assert_eq!(
        registration(&name("Registratoin")).await,
        Some(Registration::NotRegistered)
    );
    retire(&*fixture, &p, RetireStates::Keep).await;
    assert_eq!(registration(&p).await, Some(Registration::Retired));
    register(&*fixture, std::slice::from_ref(&p)).await;
    assert_eq!(registration(&p).await, Some(Registration::Registered));
    retire(&*fixture, &p, RetireStates::Drop).await;
    assert_eq!(registration(&p).await, Some(Registration::NotRegistered));
}
