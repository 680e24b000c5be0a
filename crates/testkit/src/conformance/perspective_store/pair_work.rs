//! Cases of [`PairWork`](lockstep_core::PairWork): one pair's claim and commits, snapshots and
//! purge.
//!
//! The claim: pending events after the cursor in event-id order up to the limit, the cursor
//! row created when missing, a second claim busy until the first transaction ends, a leased
//! pair held back while its events keep queueing; late arrivals turning the claim into a
//! rewind (the earliest is the trigger, a trigger only ever moves earlier) and the debounce
//! window (holding a flagged pair back, capped from the first flag). The commit: state, cursor
//! and exactly the applied work; a stale revision is a conflict; fenced commits by the holder,
//! after a takeover and after a force-release; a rewind commit clearing its request only if the
//! trigger is unchanged and deleting the snapshots at or after it; states that cannot be stored
//! or read back are invalid input; releasing the fence with the commit, and ending the
//! transaction with it (all or nothing). Snapshots: saved with a commit, the newest kept,
//! `save_snapshot` idempotent and refused after the revision moved. `purge` empties the pair and
//! keeps its lease.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::json::MAX_DEPTH;
use lockstep_core::perspective_store::DEFAULT_KEEP_SNAPSHOTS;
use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    AcquireOutcome, Claim, Cursor, ErrorKind, InstanceId, LeaseEpoch, LeaseId, LockReason,
    NewEvent, Pair, PerspectiveName, Release, RewindDebounce, StateCommit, StreamId,
    StreamLockAdmin, StreamLocker, ValidationError,
};
use uuid::Uuid;

use super::{
    ALL_EVENTS, HOUR, PerspectiveStoreFixture, append, apply, assert_counted, claim,
    claim_and_commit, counted_stream, counted_upcasters, cursor, ensure_cursor, event, event_ids,
    folded, ids, lease, listed, name, pending, register, renew, request, rewind, snapshots, state,
    stream_with, trigger, trigger_after_claim,
};
use crate::conformance::{begin, commit, rollback};

async fn wait_past_expiry<F: PerspectiveStoreFixture>(fixture: &F) {
    let timeout = fixture.locker().options().lock_timeout();
    tokio::time::sleep(timeout + timeout / 2 + Duration::from_millis(50)).await;
}

/// A claim hands out the pending events after the cursor in event-id order (not append order),
/// at most the limit asked for, with the cursor and the state; the next claim continues after
/// the committed cursor.
pub async fn claim_returns_pending_events_after_the_cursor_in_event_id_order_up_to_the_limit<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Ordered");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(5);
    // Appended out of event-id order (caller-chosen ids), n = position in event-id order.
    let order = [3, 0, 4, 1, 2];
    let stream = StreamId::new_v7();
    let events: Vec<NewEvent> = order.iter().map(|&i| event(ids[i], i as i64 + 1)).collect();
    append(&*fixture, stream, &events).await;

    let tx = begin(fixture.source()).await;
    let Claim::Apply {
        cursor,
        state,
        events,
        ..
    } = claim(&*fixture, &tx, stream, &p, 3, RewindDebounce::NONE).await
    else {
        panic!("expected events to apply");
    };
    assert_eq!(event_ids(&events), ids[..3], "event-id order, at most 3");
    for e in &events {
        let i = ids
            .iter()
            .position(|id| *id == e.event_id)
            .expect("known id");
        assert_eq!(e.stream_id, stream);
        assert_eq!(e.payload["n"], serde_json::json!(i + 1));
        let appended_as = order.iter().position(|&o| o == i).expect("appended");
        assert_eq!(
            e.version,
            appended_as as u64 + 1,
            "versions keep append order"
        );
        assert_eq!(e.event_type, "Added");
    }
    assert_eq!(
        (cursor.last_event_id, cursor.applied_count, state),
        (None, 0, None)
    );
    let mut change = StateCommit::new(
        Pair::new(stream, p.clone()),
        cursor.revision,
        folded(None, &events),
    );
    change.last_event_id = Some(ids[2]);
    change.applied_count = 3;
    change.applied_events = event_ids(&events);
    fixture
        .store()
        .commit(tx, &change, Release::Keep)
        .await
        .map(|c| c.revision)
        .expect("commit");

    let tx = begin(fixture.source()).await;
    let Claim::Apply {
        cursor,
        state,
        events,
        ..
    } = claim(&*fixture, &tx, stream, &p, ALL_EVENTS, RewindDebounce::NONE).await
    else {
        panic!("expected the rest to apply");
    };
    assert_eq!(event_ids(&events), ids[3..], "only events after the cursor");
    assert_eq!(cursor.last_event_id, Some(ids[2]));
    assert_eq!(cursor.applied_count, 3);
    assert_eq!(state, Some(serde_json::json!({ "sum": 6 })));
    rollback(tx).await;
}

/// Claiming a pair that has no cursor row creates it (empty, unlocked) and finds nothing to do.
pub async fn claim_creates_the_cursor_of_a_pair_that_has_none<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let (stream, p) = (StreamId::new_v7(), name("Fresh"));
    assert!(cursor(&*fixture, stream, &p).await.is_none());
    let tx = begin(fixture.source()).await;
    assert_eq!(
        claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await,
        Claim::Idle
    );
    commit(tx).await.expect("commit");
    let created = cursor(&*fixture, stream, &p).await.expect("created");
    assert_eq!(created.last_event_id, None);
    assert_eq!(created.applied_count, 0);
    assert_eq!(created.rewind, None);
    assert_eq!(created.error, None);
    assert_eq!(created.failures, 0);
    assert_eq!(created.latest_snapshot, None);
    assert!(created.lease.is_unlocked());
}

/// While one transaction holds a claim, another transaction's claim of the same pair is `Busy`
/// at once (it never waits); once the first ends, the pair can be claimed again.
pub async fn a_second_claim_of_a_claimed_pair_is_busy_until_the_first_transaction_ends<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Exclusive");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    let first = begin(fixture.source()).await;
    assert!(matches!(
        claim(&*fixture, &first, stream, &p, 10, RewindDebounce::NONE).await,
        Claim::Apply { .. }
    ));
    let second = begin(fixture.source()).await;
    let busy = tokio::time::timeout(
        Duration::from_secs(10),
        claim(&*fixture, &second, stream, &p, 10, RewindDebounce::NONE),
    )
    .await
    .expect("a claim never waits for another transaction's claim");
    assert_eq!(busy, Claim::Busy);
    rollback(second).await;
    rollback(first).await;
    let third = begin(fixture.source()).await;
    match claim(&*fixture, &third, stream, &p, 10, RewindDebounce::NONE).await {
        Claim::Apply { events, .. } => assert_eq!(event_ids(&events), ids),
        other => panic!("expected the pair to be claimable again, got {other:?}"),
    }
    rollback(third).await;
}

/// A pair under a live lease is `Busy` for every claim and absent from other instances'
/// `pending_pairs` (listed for the holder); its events keep queueing and are claimed after the
/// release.
pub async fn a_leased_pair_is_held_back_while_its_events_keep_queueing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Leased");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids[..1]).await;
    let lease = lease(&*fixture, stream, &p, &LockReason::Rewind).await;

    let tx = begin(fixture.source()).await;
    assert_eq!(
        claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await,
        Claim::Busy,
        "a live lease holds normal application back"
    );
    rollback(tx).await;
    renew(&*fixture, &lease).await;
    assert_eq!(
        listed(
            &*fixture,
            InstanceId::random(),
            RewindDebounce::NONE,
            stream,
            &p
        )
        .await,
        None,
        "not listed for another instance"
    );
    assert_eq!(
        listed(&*fixture, lease.id.holder, RewindDebounce::NONE, stream, &p).await,
        Some((1, false)),
        "listed for the holder"
    );
    append(&*fixture, stream, &[event(ids[1], 2)]).await;
    assert_eq!(pending(&*fixture, stream, &p).await, ids, "still queueing");

    let released = fixture.locker().release(&lease.id).await.expect("release");
    assert!(released.is_released());
    let tx = begin(fixture.source()).await;
    match claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await {
        Claim::Apply { events, .. } => assert_eq!(event_ids(&events), ids),
        other => panic!("expected the queued events after the release, got {other:?}"),
    }
    rollback(tx).await;
}

/// A commit saves the state, advances the cursor, increments the revision and deletes exactly
/// the work items it names: a claimed event it does not name stays pending.
pub async fn a_commit_saves_the_state_advances_the_cursor_and_deletes_exactly_the_applied_work<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Committed");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids).await;
    let tx = begin(fixture.source()).await;
    let Claim::Apply { cursor, events, .. } =
        claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await
    else {
        panic!("expected events to apply");
    };
    assert_eq!(events.len(), 3);
    let mut change = StateCommit::new(
        Pair::new(stream, p.clone()),
        cursor.revision,
        folded(None, &events[..2]),
    );
    change.last_event_id = Some(ids[1]);
    change.applied_count = 2;
    change.applied_events = ids[..2].to_vec();
    let revision = fixture
        .store()
        .commit(tx, &change, Release::Keep)
        .await
        .map(|c| c.revision)
        .expect("commit");
    assert_eq!(revision, cursor.revision + 1);

    let (after, state) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(after.last_event_id, Some(ids[1]));
    assert_eq!(after.applied_count, 2);
    assert_eq!(after.revision, revision);
    assert_eq!(state, Some(serde_json::json!({ "sum": 3 })));
    assert_eq!(
        pending(&*fixture, stream, &p).await,
        ids[2..],
        "the unnamed item stays"
    );
}

/// A commit computed from a revision the cursor is no longer at is a retryable `Conflict`; it
/// writes nothing and its transaction can still commit.
pub async fn a_stale_expected_revision_is_a_conflict_that_writes_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Stale");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    let revision = apply(&*fixture, stream, &p, 1, false).await;

    let tx = begin(fixture.source()).await;
    let mut change = StateCommit::new(
        Pair::new(stream, p.clone()),
        revision - 1,
        serde_json::json!({ "sum": 999 }),
    );
    change.last_event_id = Some(ids[1]);
    change.applied_count = 2;
    change.applied_events = vec![ids[1]];
    change.snapshot = true;
    let err = fixture
        .store()
        .commit(tx, &change, Release::Keep)
        .await
        .map(|c| c.revision)
        .expect_err("stale revision");
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(err.is_retryable());

    let (after, state) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (after.revision, after.last_event_id, after.applied_count),
        (revision, Some(ids[0]), 1)
    );
    assert_eq!(state, Some(serde_json::json!({ "sum": 1 })));
    assert_eq!(pending(&*fixture, stream, &p).await, ids[1..]);
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());
}

/// A commit fenced by the live lease it names is written.
pub async fn a_fenced_commit_by_the_lease_holder_is_written<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("Fenced");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(1);
    let stream = stream_with(&*fixture, &ids).await;
    let lease = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    let revision = rewind(&*fixture, stream, &p, Uuid::nil(), Some(lease.id.clone()))
        .await
        .expect("the holder's fenced commit");
    let (after, state) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(after.revision, revision);
    assert_eq!(state, Some(serde_json::json!({ "sum": 1 })));
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    let _ = fixture.locker().release(&lease.id).await.expect("release");
}

async fn assert_fenced_out<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    p: &PerspectiveName,
    ids: &[Uuid],
    old: &LeaseId,
) {
    let before = cursor(fixture, stream, p).await.expect("cursor");
    let err = rewind(fixture, stream, p, Uuid::nil(), Some(old.clone()))
        .await
        .expect_err("fenced out");
    assert_eq!(err.kind(), ErrorKind::LeaseLost, "{err}");
    let tx = begin(fixture.source()).await;
    let err = fixture
        .store()
        .save_snapshot(
            &tx,
            &lockstep_core::Pair::new(stream, p.clone()),
            before.revision,
            Some(old),
        )
        .await
        .expect_err("a fenced snapshot too");
    assert_eq!(err.kind(), ErrorKind::LeaseLost, "{err}");
    let err = fixture
        .store()
        .purge(&tx, &lockstep_core::Pair::new(stream, p.clone()), Some(old))
        .await
        .expect_err("a fenced purge too");
    assert_eq!(err.kind(), ErrorKind::LeaseLost, "{err}");
    commit(tx).await.expect("still usable");
    let (after, state) = state(fixture, stream, p).await.expect("cursor");
    assert_eq!(after.revision, before.revision, "nothing written");
    assert_eq!(state, None);
    assert_eq!(pending(fixture, stream, p).await, ids);
}

/// After the lease expired and another instance took it over, the old holder's fenced commit
/// (and fenced snapshot and purge) is `LeaseLost` and writes nothing.
pub async fn a_fenced_commit_after_a_takeover_is_lease_lost_and_writes_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("TakenOver");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(1);
    let stream = stream_with(&*fixture, &ids).await;
    let old = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    wait_past_expiry(&*fixture).await;
    let taken = fixture
        .locker()
        .try_acquire(stream, &p, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("try_acquire");
    assert!(taken.is_acquired(), "expired lease taken over: {taken:?}");
    assert_fenced_out(&*fixture, stream, &p, &ids, &old.id).await;
}

/// After a force-release, the old holder's fenced writes are `LeaseLost` and write nothing.
pub async fn a_fenced_commit_after_a_force_release_is_lease_lost_and_writes_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("ForceReleased");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(1);
    let stream = stream_with(&*fixture, &ids).await;
    let old = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    let released = fixture
        .admin()
        .force_release(stream, &p)
        .await
        .expect("force_release");
    assert!(released.is_released());
    assert_fenced_out(&*fixture, stream, &p, &ids, &old.id).await;
}

/// An event whose caller-chosen id sorts before the last applied one turns the claim into a
/// `Rewind` with that event as trigger; the request is kept, and so is the work.
pub async fn a_late_arrival_turns_the_claim_into_a_rewind_from_that_event<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Late");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids[1..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    append(&*fixture, stream, &[event(ids[0], 5)]).await;

    let tx = begin(fixture.source()).await;
    let Claim::Rewind { cursor: flagged } =
        claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await
    else {
        panic!("expected a rewind");
    };
    let request = flagged.rewind.expect("a rewind request");
    assert_eq!(request.trigger, ids[0]);
    assert!(request.first_flagged_at <= request.flagged_at);
    assert_eq!(flagged.last_event_id, Some(ids[1]));
    commit(tx).await.expect("commit");
    assert_eq!(trigger(&*fixture, stream, &p).await, Some(ids[0]), "kept");
    assert_eq!(pending(&*fixture, stream, &p).await, ids[..1], "work kept");
}

/// Of two late arrivals, the earlier one is the trigger.
pub async fn of_two_late_arrivals_the_earliest_is_the_trigger<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("TwoLate");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids[2..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    append(&*fixture, stream, &[event(ids[1], 2)]).await;
    append(&*fixture, stream, &[event(ids[0], 1)]).await;
    let tx = begin(fixture.source()).await;
    match claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await {
        Claim::Rewind { cursor } => {
            assert_eq!(cursor.rewind.map(|r| r.trigger), Some(ids[0]));
        }
        other => panic!("expected a rewind, got {other:?}"),
    }
    commit(tx).await.expect("commit");
}

/// A rewind request's trigger only ever moves earlier — by a later late arrival or by
/// `request_rewind` — and a request "from the start" beats every event; a pair without a
/// cursor cannot be asked to rewind.
pub async fn an_existing_trigger_only_ever_moves_earlier<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("Earlier");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(4); // a1 < a2 < a3 < b
    let stream = stream_with(&*fixture, &ids[3..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;

    append(&*fixture, stream, &[event(ids[1], 2)]).await;
    assert!(matches!(
        claim_and_commit(&*fixture, stream, &p).await,
        Claim::Rewind { .. }
    ));
    assert_eq!(trigger(&*fixture, stream, &p).await, Some(ids[1]));
    request(&*fixture, stream, &p, Some(ids[2])).await;
    assert_eq!(
        trigger(&*fixture, stream, &p).await,
        Some(ids[1]),
        "not later"
    );
    append(&*fixture, stream, &[event(ids[2], 3)]).await;
    assert!(matches!(
        claim_and_commit(&*fixture, stream, &p).await,
        Claim::Rewind { .. }
    ));
    assert_eq!(
        trigger(&*fixture, stream, &p).await,
        Some(ids[1]),
        "not later"
    );
    append(&*fixture, stream, &[event(ids[0], 1)]).await;
    assert!(matches!(
        claim_and_commit(&*fixture, stream, &p).await,
        Claim::Rewind { .. }
    ));
    assert_eq!(
        trigger(&*fixture, stream, &p).await,
        Some(ids[0]),
        "earlier"
    );
    request(&*fixture, stream, &p, None).await;
    assert_eq!(
        trigger(&*fixture, stream, &p).await,
        Some(Uuid::nil()),
        "from the start"
    );
    request(&*fixture, stream, &p, Some(ids[0])).await;
    assert_eq!(trigger(&*fixture, stream, &p).await, Some(Uuid::nil()));

    let tx = begin(fixture.source()).await;
    let found = fixture
        .store()
        .request_rewind(
            &tx,
            &lockstep_core::Pair::new(StreamId::new_v7(), p.clone()),
            None,
        )
        .await
        .expect("request_rewind");
    assert!(!found, "no cursor, no request");
    rollback(tx).await;
}

/// Inside the debounce window a flagged pair is held back: its claim is `Idle` and
/// `pending_pairs` leaves it out, work and all; once the window has passed it is listed as a
/// rewind and claimed as one.
pub async fn the_debounce_window_holds_a_flagged_pair_back<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("Debounced");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids[1..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    append(&*fixture, stream, &[event(ids[0], 1)]).await;

    let tx = begin(fixture.source()).await;
    assert_eq!(
        claim(&*fixture, &tx, stream, &p, 10, HOUR).await,
        Claim::Idle,
        "found late, inside the window"
    );
    commit(tx).await.expect("commit");
    assert_eq!(
        trigger(&*fixture, stream, &p).await,
        Some(ids[0]),
        "flagged"
    );

    let instance = InstanceId::random();
    assert_eq!(listed(&*fixture, instance, HOUR, stream, &p).await, None);
    let tx = begin(fixture.source()).await;
    assert_eq!(
        claim(&*fixture, &tx, stream, &p, 10, HOUR).await,
        Claim::Idle
    );
    rollback(tx).await;

    assert_eq!(
        listed(&*fixture, instance, RewindDebounce::NONE, stream, &p).await,
        Some((1, true))
    );
    let tx = begin(fixture.source()).await;
    match claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await {
        Claim::Rewind { cursor } => assert_eq!(cursor.rewind.map(|r| r.trigger), Some(ids[0])),
        other => panic!("expected a rewind, got {other:?}"),
    }
    rollback(tx).await;
}

/// The debounce window slides with every late event, but only up to `max_delay` from the first
/// flag: a pair re-flagged just now is still served once the cap has passed, by `claim` and by
/// `pending_pairs` alike (a steady trickle of late events cannot postpone its rewind forever).
/// Real time passes here (about 2.6 s on a database; nothing with paused time).
pub async fn the_debounce_window_is_capped_from_the_first_flag<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    // The cap leaves the steps before it seconds of slack on a busy machine; the wait past it
    // is counted from an instant taken after the first flag committed, so it is always past.
    const CAPPED: RewindDebounce = RewindDebounce {
        window: Duration::from_secs(3600),
        max_delay: Duration::from_millis(2500),
    };
    let p = name("Capped");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids[2..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    let instance = InstanceId::random();

    append(&*fixture, stream, &[event(ids[1], 1)]).await;
    let tx = begin(fixture.source()).await;
    assert_eq!(
        claim(&*fixture, &tx, stream, &p, 10, CAPPED).await,
        Claim::Idle
    );
    commit(tx).await.expect("commit");
    let flagged = tokio::time::Instant::now();
    let first = cursor(&*fixture, stream, &p).await.expect("cursor");
    let first = first.rewind.expect("flagged");

    tokio::time::sleep(Duration::from_millis(600)).await;
    // An earlier late event moves the trigger and restarts the window, not the cap.
    append(&*fixture, stream, &[event(ids[0], 0)]).await;
    let tx = begin(fixture.source()).await;
    assert_eq!(
        claim(&*fixture, &tx, stream, &p, 10, CAPPED).await,
        Claim::Idle
    );
    commit(tx).await.expect("commit");
    let moved = cursor(&*fixture, stream, &p).await.expect("cursor");
    let moved = moved.rewind.expect("still flagged");
    assert_eq!(moved.trigger, ids[0], "the trigger moved earlier");
    assert!(moved.flagged_at > first.flagged_at, "the window restarted");
    assert_eq!(
        moved.first_flagged_at, first.first_flagged_at,
        "the cap did not"
    );
    assert_eq!(listed(&*fixture, instance, CAPPED, stream, &p).await, None);

    tokio::time::sleep_until(flagged + CAPPED.max_delay + Duration::from_millis(100)).await;
    // Past the cap from the first flag, well inside the window from the last: the cap serves it.
    assert_eq!(
        listed(&*fixture, instance, CAPPED, stream, &p).await,
        Some((2, true)),
        "listed once the cap has passed"
    );
    assert_eq!(
        listed(&*fixture, instance, HOUR, stream, &p).await,
        None,
        "a longer cap still holds it back"
    );
    let tx = begin(fixture.source()).await;
    match claim(&*fixture, &tx, stream, &p, 10, CAPPED).await {
        Claim::Rewind { cursor } => assert_eq!(cursor.rewind.map(|r| r.trigger), Some(ids[0])),
        other => panic!("expected a rewind, got {other:?}"),
    }
    rollback(tx).await;
}

/// A rewind's commit clears the request only if its trigger is still the one it rewound from:
/// an earlier trigger that arrived meanwhile stays requested, and is cleared by its own rewind.
pub async fn a_rewind_commit_clears_the_request_only_if_its_trigger_is_unchanged<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Rewound");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3); // a1 < a2 < b
    let stream = stream_with(&*fixture, &ids[2..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    append(&*fixture, stream, &[event(ids[1], 2)]).await;
    let tx = begin(fixture.source()).await;
    assert!(matches!(
        claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await,
        Claim::Rewind { .. }
    ));
    commit(tx).await.expect("commit");

    let lease = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    // Meanwhile an operator asks for an earlier rewind.
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .request_rewind(
                &tx,
                &lockstep_core::Pair::new(stream, p.clone()),
                Some(ids[0])
            )
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");
    renew(&*fixture, &lease).await;
    rewind(&*fixture, stream, &p, ids[1], Some(lease.id.clone()))
        .await
        .expect("rewind from a2");
    let after = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        after.rewind.map(|r| r.trigger),
        Some(ids[0]),
        "still requested"
    );
    assert!(
        pending(&*fixture, stream, &p).await.is_empty(),
        "a2 applied"
    );

    renew(&*fixture, &lease).await;
    rewind(&*fixture, stream, &p, ids[0], Some(lease.id.clone()))
        .await
        .expect("rewind from a1");
    let (after, state) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(after.rewind, None, "cleared");
    assert_eq!(after.last_event_id, Some(ids[2]));
    assert_eq!(after.applied_count, 2);
    assert_eq!(state, Some(serde_json::json!({ "sum": 3 })));
    let _ = fixture.locker().release(&lease.id).await.expect("release");
}

/// A rewind's commit deletes the snapshots at or after its trigger (they may miss the late
/// event) and keeps the ones before it.
pub async fn a_rewind_commit_deletes_the_snapshots_at_or_after_its_trigger<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("SnapshotsRewound");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(4); // e1 < late < e2 < e3
    let (e1, late, e2, e3) = (ids[0], ids[1], ids[2], ids[3]);
    let stream = stream_with(&*fixture, &[e1, e2, e3]).await;
    for _ in 0..3 {
        apply(&*fixture, stream, &p, 1, true).await;
    }
    let kept: Vec<Uuid> = snapshots(&*fixture, stream, &p)
        .await
        .iter()
        .map(|s| s.event_id)
        .collect();
    assert_eq!(kept, [e3, e2, e1]);
    append(&*fixture, stream, &[event(late, 10)]).await;
    assert_eq!(trigger_after_claim(&*fixture, stream, &p).await, late);
    rewind(&*fixture, stream, &p, late, None)
        .await
        .expect("rewind");
    let kept: Vec<Uuid> = snapshots(&*fixture, stream, &p)
        .await
        .iter()
        .map(|s| s.event_id)
        .collect();
    assert_eq!(kept, [e1], "the snapshots after the trigger are gone");
    let after = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(after.latest_snapshot, Some(e1));

    // "At" the trigger counts too.
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .request_rewind(&tx, &lockstep_core::Pair::new(stream, p.clone()), Some(e1))
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");
    rewind(&*fixture, stream, &p, e1, None)
        .await
        .expect("rewind");
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());
    assert_eq!(
        cursor(&*fixture, stream, &p)
            .await
            .expect("cursor")
            .latest_snapshot,
        None
    );
}

/// A commit with `snapshot: true` saves the new state at its last event, and
/// `snapshot_before` returns the latest snapshot strictly before the id asked for.
pub async fn a_commit_can_save_a_snapshot_and_snapshot_before_finds_the_latest_strictly_before<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Snapshotted");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids).await;
    apply(&*fixture, stream, &p, 1, true).await;
    apply(&*fixture, stream, &p, 1, true).await;
    apply(&*fixture, stream, &p, 1, false).await;

    let tx = begin(fixture.source()).await;
    let key = lockstep_core::Pair::new(stream, p.clone());
    let before = |id: Uuid| fixture.store().snapshot_before(&tx, &key, id);
    let s = before(ids[2]).await.expect("snapshot_before").expect("one");
    assert_eq!(s.event_id, ids[1]);
    assert_eq!(s.applied_count, 2);
    assert_eq!(s.state, serde_json::json!({ "sum": 3 }));
    let s = before(ids[1]).await.expect("snapshot_before").expect("one");
    assert_eq!(s.event_id, ids[0], "strictly before");
    assert_eq!(s.applied_count, 1);
    assert_eq!(s.state, serde_json::json!({ "sum": 1 }));
    assert_eq!(before(ids[0]).await.expect("snapshot_before"), None);
    rollback(tx).await;
    let after = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(after.latest_snapshot, Some(ids[1]));
}

/// Only the last [`DEFAULT_KEEP_SNAPSHOTS`] snapshots of a pair are kept.
pub async fn only_the_newest_snapshots_are_kept<F: PerspectiveStoreFixture>(fixture: Arc<F>) {
    let p = name("Pruned");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(DEFAULT_KEEP_SNAPSHOTS + 2);
    let stream = stream_with(&*fixture, &ids).await;
    for _ in 0..ids.len() {
        apply(&*fixture, stream, &p, 1, true).await;
    }
    let kept: Vec<Uuid> = snapshots(&*fixture, stream, &p)
        .await
        .iter()
        .map(|s| s.event_id)
        .collect();
    let newest: Vec<Uuid> = ids
        .iter()
        .rev()
        .take(DEFAULT_KEEP_SNAPSHOTS)
        .copied()
        .collect();
    assert_eq!(kept, newest);
}

/// The bootstrap snapshot saves the current state once (a second call does nothing), does not
/// change the revision, and does nothing for a pair that moved on or applied nothing.
pub async fn save_snapshot_is_idempotent_and_refuses_a_moved_revision<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Bootstrapped");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    ensure_cursor(&*fixture, stream, &p).await;
    let fresh = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert!(
        !save(&*fixture, stream, &p, fresh.revision).await,
        "nothing applied yet"
    );

    let revision = apply(&*fixture, stream, &p, 1, false).await;
    assert!(save(&*fixture, stream, &p, revision).await, "saved");
    assert!(
        !save(&*fixture, stream, &p, revision).await,
        "already there"
    );
    let after = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(after.revision, revision, "a snapshot is not a state change");
    assert_eq!(after.latest_snapshot, Some(ids[0]));
    let kept = snapshots(&*fixture, stream, &p).await;
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0].state, serde_json::json!({ "sum": 1 }));
    assert_eq!(kept[0].applied_count, 1);

    apply(&*fixture, stream, &p, 1, false).await;
    assert!(
        !save(&*fixture, stream, &p, revision).await,
        "the cursor moved on"
    );
    assert_eq!(snapshots(&*fixture, stream, &p).await.len(), 1);
}

/// The bootstrap snapshot in a transaction of its own.
async fn save<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    p: &PerspectiveName,
    revision: i64,
) -> bool {
    let tx = begin(fixture.source()).await;
    let saved = fixture
        .store()
        .save_snapshot(
            &tx,
            &lockstep_core::Pair::new(stream, p.clone()),
            revision,
            None,
        )
        .await
        .expect("save_snapshot");
    commit(tx).await.expect("commit");
    saved
}

/// A purge deletes the pair's state, snapshots and pending work and resets its cursor (no
/// event applied, no rewind, a higher revision) under the lease, which stays. The pair stays
/// empty until its next event, whose claim is a rewind from the start of the stream (so the
/// state is again the fold of the whole stream, never of the events after the purge alone).
pub async fn purge_empties_the_pair_and_keeps_its_lease<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("Purged");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids[..2]).await;
    let revision = apply(&*fixture, stream, &p, 1, true).await;
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .request_rewind(&tx, &lockstep_core::Pair::new(stream, p.clone()), None)
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");

    let lease = lease(&*fixture, stream, &p, &LockReason::Purge).await;
    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .purge(
            &tx,
            &lockstep_core::Pair::new(stream, p.clone()),
            Some(&lease.id),
        )
        .await
        .expect("purge");
    commit(tx).await.expect("commit");

    let (after, state) = state(&*fixture, stream, &p).await.expect("cursor kept");
    assert_eq!(state, None);
    assert_eq!((after.last_event_id, after.applied_count), (None, 0));
    assert!(after.revision > revision, "the revision increases");
    assert_eq!((after.rewind, after.latest_snapshot), (None, None));
    assert_eq!(after.lease.holder, Some(lease.id.holder), "the lease stays");
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());
    let _ = fixture.locker().release(&lease.id).await.expect("release");

    // The next event rebuilds the pair from the start of the stream (applying just
    // the new event gave a state that is the fold of no prefix of the stream).
    append(&*fixture, stream, &[event(ids[2], 7)]).await;
    let tx = begin(fixture.source()).await;
    match claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await {
        Claim::Rewind { cursor } => {
            assert_eq!(
                cursor.rewind.map(|r| r.trigger),
                Some(Uuid::nil()),
                "a rewind from the start"
            );
        }
        other => panic!("expected a rewind from the start, got {other:?}"),
    }
    commit(tx).await.expect("commit");
    let tx = begin(fixture.source()).await;
    assert!(
        matches!(
            claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await,
            Claim::Rewind { .. }
        ),
        "the request stays until a rewind commits"
    );
    rollback(tx).await;
}

/// A state `jsonb` cannot store (U+0000 in a string) is `InvalidInput`; nothing is written and
/// the transaction can still commit.
pub async fn a_state_jsonb_cannot_store_is_invalid_input_and_writes_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("BadState");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(1);
    let stream = stream_with(&*fixture, &ids).await;
    let tx = begin(fixture.source()).await;
    let Claim::Apply { cursor, .. } =
        claim(&*fixture, &tx, stream, &p, 10, RewindDebounce::NONE).await
    else {
        panic!("expected events to apply");
    };
    let mut change = StateCommit::new(
        Pair::new(stream, p.clone()),
        cursor.revision,
        serde_json::json!({ "note": "a\u{0}b" }),
    );
    change.last_event_id = Some(ids[0]);
    change.applied_count = 1;
    change.applied_events = ids.clone();
    change.snapshot = true;
    let err = fixture
        .store()
        .commit(tx, &change, Release::Keep)
        .await
        .map(|c| c.revision)
        .expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    let (after, state) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (after.revision, after.last_event_id),
        (cursor.revision, None)
    );
    assert_eq!(state, None);
    assert_eq!(pending(&*fixture, stream, &p).await, ids);
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());
}

/// `depth` arrays and objects, alternating, around a string (a scalar has depth 0).
fn nested(depth: usize) -> serde_json::Value {
    (0..depth).fold(serde_json::json!("leaf"), |value, level| {
        if level % 2 == 0 {
            serde_json::json!([1, value])
        } else {
            serde_json::json!({ "a": 1, "k": value })
        }
    })
}

/// A state nested deeper than a claim can read back (128 levels of arrays and objects) is
/// `InvalidInput` and writes nothing, instead of being stored and failing every later claim of
/// the pair; the deepest readable state (127 levels) is committed and read
/// back unchanged.
pub async fn a_state_nested_deeper_than_a_claim_can_read_is_invalid_input_and_writes_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("DeepState");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    let commit_of = |cursor: &Cursor, state: serde_json::Value, applied: &[Uuid]| {
        let mut change = StateCommit::new(Pair::new(stream, p.clone()), cursor.revision, state);
        change.last_event_id = applied.last().copied();
        change.applied_count = cursor.applied_count + applied.len() as u64;
        change.applied_events = applied.to_vec();
        change.snapshot = true;
        change
    };

    let tx = begin(fixture.source()).await;
    let Claim::Apply { cursor, .. } =
        claim(&*fixture, &tx, stream, &p, 1, RewindDebounce::NONE).await
    else {
        panic!("expected events to apply");
    };
    let err = fixture
        .store()
        .commit(
            tx,
            &commit_of(&cursor, nested(MAX_DEPTH + 1), &ids[..1]),
            Release::Keep,
        )
        .await
        .map(|c| c.revision)
        .expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert_eq!(
        err.validation(),
        Some(&ValidationError::JsonTooDeep {
            field: "perspective state",
            max: 127
        })
    );
    let (after, stored) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (after.revision, after.last_event_id),
        (cursor.revision, None)
    );
    assert_eq!(stored, None);
    assert_eq!(pending(&*fixture, stream, &p).await, ids);
    assert!(snapshots(&*fixture, stream, &p).await.is_empty());

    let deepest = nested(MAX_DEPTH);
    let tx = begin(fixture.source()).await;
    let Claim::Apply { cursor, .. } =
        claim(&*fixture, &tx, stream, &p, 1, RewindDebounce::NONE).await
    else {
        panic!("expected events to apply");
    };
    fixture
        .store()
        .commit(
            tx,
            &commit_of(&cursor, deepest.clone(), &ids[..1]),
            Release::Keep,
        )
        .await
        .map(|c| c.revision)
        .expect("the deepest readable state");
    let (_, stored) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(stored, Some(deepest.clone()));
    // The pair goes on: the next claim reads the state back.
    let tx = begin(fixture.source()).await;
    let Claim::Apply {
        state: claimed,
        events,
        ..
    } = claim(&*fixture, &tx, stream, &p, 1, RewindDebounce::NONE).await
    else {
        panic!("expected the second event to apply");
    };
    rollback(tx).await;
    assert_eq!(claimed, Some(deepest));
    assert_eq!(
        events.iter().map(|e| e.event_id).collect::<Vec<_>>(),
        ids[1..]
    );
}

/// Two fences on `live`'s pair that are not the live lease: an earlier epoch of its holder, and
/// its epoch with another holder.
fn not_live(live: &LeaseId) -> [LeaseId; 2] {
    [
        LeaseId::new(
            live.stream_id,
            live.perspective.clone(),
            live.holder,
            LeaseEpoch::new(live.epoch.get() - 1),
        ),
        LeaseId::new(
            live.stream_id,
            live.perspective.clone(),
            InstanceId::random(),
            live.epoch,
        ),
    ]
}

/// A state change from `cursor` up to the `n`th of `ids` (`{"sum": n}`), fenced on `fence`.
fn sum_commit_up_to(
    stream: StreamId,
    name: &PerspectiveName,
    ids: &[Uuid],
    cursor: &Cursor,
    n: usize,
    fence: Option<LeaseId>,
) -> StateCommit {
    let mut change = StateCommit::new(
        Pair::new(stream, name.clone()),
        cursor.revision,
        serde_json::json!({ "sum": n }),
    );
    change.last_event_id = Some(ids[n - 1]);
    change.applied_count = n as u64;
    change.applied_events = ids[cursor.applied_count as usize..n].to_vec();
    change.fence = fence;
    change
}

/// `commit` with `Release::Lease` releases the fence's lease exactly when the change commits:
/// afterwards a renew is refused and another instance acquires it at once, at a later epoch. A
/// refused change (a stale revision, a fence that is not the live lease) leaves the lease held.
/// Without a fence nothing is released; with `Release::Keep` the lease stays held.
pub async fn a_commit_releasing_its_fence_releases_the_lease_only_when_it_commits<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("CommitRelease");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(4);
    let stream = stream_with(&*fixture, &ids).await;
    let held = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    let commit_for = |cursor: &Cursor, n: usize, fence: Option<LeaseId>| {
        sum_commit_up_to(stream, &p, &ids, cursor, n, fence)
    };

    // Refused (a stale revision): nothing written, the lease held.
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");
    let mut stale = commit_for(&before, 1, Some(held.id.clone()));
    stale.expected_revision += 1;
    let tx = begin(fixture.source()).await;
    let refused = fixture.store().commit(tx, &stale, Release::Lease).await;
    assert_eq!(
        refused.map_err(|e| e.kind()).err(),
        Some(ErrorKind::Conflict)
    );
    renew(&*fixture, &held).await;

    // Fenced on a lease that is not the live one (an earlier epoch, another holder): refused
    // as lost, nothing written, the live lease held.
    for fence in not_live(&held.id) {
        let tx = begin(fixture.source()).await;
        let refused = fixture
            .store()
            .commit(tx, &commit_for(&before, 1, Some(fence)), Release::Lease)
            .await;
        assert_eq!(
            refused.map_err(|e| e.kind()).err(),
            Some(ErrorKind::LeaseLost)
        );
        renew(&*fixture, &held).await;
    }
    let now = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(now.revision, before.revision, "nothing written");
    assert_eq!(pending(&*fixture, stream, &p).await, ids);

    // No fence: committed, nothing released.
    let tx = begin(fixture.source()).await;
    let committed = fixture
        .store()
        .commit(tx, &commit_for(&before, 1, None), Release::Lease)
        .await
        .expect("commit");
    assert_eq!(
        (committed.revision, committed.released),
        (before.revision + 1, false)
    );
    renew(&*fixture, &held).await;

    // Fenced on the live lease, keeping it: committed, the lease still held.
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");
    let tx = begin(fixture.source()).await;
    let committed = fixture
        .store()
        .commit(
            tx,
            &commit_for(&before, 2, Some(held.id.clone())),
            Release::Keep,
        )
        .await
        .expect("commit");
    assert_eq!(
        (committed.revision, committed.released),
        (before.revision + 1, false)
    );
    renew(&*fixture, &held).await;

    // Fenced on the live lease, releasing it: committed and released.
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");
    let tx = begin(fixture.source()).await;
    let committed = fixture
        .store()
        .commit(
            tx,
            &commit_for(&before, 4, Some(held.id.clone())),
            Release::Lease,
        )
        .await
        .expect("commit");
    assert_eq!(
        (committed.revision, committed.released),
        (before.revision + 1, true)
    );
    let (after, stored) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (after.last_event_id, after.applied_count, stored),
        (Some(ids[3]), 4, Some(serde_json::json!({ "sum": 4 })))
    );
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    let renewed = fixture.locker().renew(&held.id).await.expect("renew");
    assert!(
        !renewed.is_renewed(),
        "the lease was released by the commit"
    );
    match fixture
        .locker()
        .try_acquire(stream, &p, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("try_acquire")
    {
        AcquireOutcome::Acquired(next) => {
            assert!(next.id.epoch > held.id.epoch, "a later epoch");
            let _ = fixture.locker().release(&next.id).await.expect("release");
        }
        other => panic!("expected the released lease to be free, got {other:?}"),
    }
}

/// `commit` commits the state change and its transaction as one, or nothing: a refused change
/// (a stale revision, a fence that is not the live lease) commits nothing of the transaction —
/// not even another write made on it before — and keeps the lease held; an accepted one commits
/// the state, the other write and, with `Release::Lease`, the lease's release. Without a fence
/// nothing is released.
pub async fn a_fenced_commit_that_ends_its_transaction_commits_all_of_it_or_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("CommitAndEnd");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(3);
    let stream = stream_with(&*fixture, &ids).await;
    // The other write: a rewind request on another pair, made on the same transaction first
    // (one pair for the cases without a fence, one for the fenced commit that goes through;
    // applied, so that they have a cursor on every store).
    let (witness, fenced_witness) = (
        stream_with(&*fixture, &[Uuid::now_v7()]).await,
        stream_with(&*fixture, &[Uuid::now_v7()]).await,
    );
    for w in [witness, fenced_witness] {
        apply(&*fixture, w, &p, ALL_EVENTS, false).await;
    }
    let held = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    let commit_for = |cursor: &Cursor, n: usize, fence: Option<LeaseId>| {
        sum_commit_up_to(stream, &p, &ids, cursor, n, fence)
    };
    let requested = |fixture: Arc<F>, witness: StreamId| {
        let name = p.clone();
        async move {
            cursor(&*fixture, witness, &name)
                .await
                .and_then(|c| c.rewind)
                .is_some()
        }
    };
    let with_witness = |fixture: Arc<F>, witness: StreamId| {
        let pair = lockstep_core::Pair::new(witness, p.clone());
        async move {
            let tx = begin(fixture.source()).await;
            assert!(
                fixture
                    .store()
                    .request_rewind(&tx, &pair, None)
                    .await
                    .expect("request_rewind")
            );
            tx
        }
    };

    // Refused: a stale revision, then fences that are not the live lease.
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");
    let mut stale = commit_for(&before, 1, Some(held.id.clone()));
    stale.expected_revision += 1;
    let refusals = std::iter::once((stale, ErrorKind::Conflict)).chain(
        not_live(&held.id)
            .into_iter()
            .map(|fence| (commit_for(&before, 1, Some(fence)), ErrorKind::LeaseLost)),
    );
    for (change, kind) in refusals {
        let tx = with_witness(fixture.clone(), witness).await;
        let refused = fixture.store().commit(tx, &change, Release::Lease).await;
        assert_eq!(refused.map_err(|e| e.kind()).err(), Some(kind));
        assert!(
            !requested(fixture.clone(), witness).await,
            "a refused commit ({kind:?}) committed the transaction's other write"
        );
        renew(&*fixture, &held).await;
    }
    let now = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(now.revision, before.revision, "nothing written");
    assert_eq!(pending(&*fixture, stream, &p).await, ids);

    // No fence: committed with the other write, nothing released.
    let tx = with_witness(fixture.clone(), witness).await;
    let committed = fixture
        .store()
        .commit(tx, &commit_for(&before, 1, None), Release::Lease)
        .await
        .expect("commit");
    assert_eq!(
        (committed.revision, committed.released),
        (before.revision + 1, false)
    );
    assert!(
        requested(fixture.clone(), witness).await,
        "the other write committed"
    );
    renew(&*fixture, &held).await;

    // Fenced on the live lease: committed with the other write, and released if the store
    // says so.
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");
    let tx = with_witness(fixture.clone(), fenced_witness).await;
    let committed = fixture
        .store()
        .commit(
            tx,
            &commit_for(&before, 3, Some(held.id.clone())),
            Release::Lease,
        )
        .await
        .expect("commit");
    assert_eq!(
        (committed.revision, committed.released),
        (before.revision + 1, true)
    );
    assert!(
        requested(fixture.clone(), fenced_witness).await,
        "the other write committed with the fenced commit"
    );
    let (after, stored) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (after.last_event_id, after.applied_count, stored),
        (Some(ids[2]), 3, Some(serde_json::json!({ "sum": 3 })))
    );
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    let renewed = fixture.locker().renew(&held.id).await.expect("renew");
    assert!(
        !renewed.is_renewed(),
        "the lease was released with the commit"
    );
}

/// A claim through upcasters hands out the pending events in their current shape (version 1
/// lifted, version 2 as stored), and stops at the first event an upcaster fails on:
/// `Claim::Unreadable` at it, with the events before it. A claim whose limit ends before that
/// event is a plain `Apply`. The plain store hands every event out as stored.
pub async fn a_claim_hands_out_upcast_events_and_stops_at_one_an_upcaster_fails_on<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("UpcastClaim");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(5);
    let stream = counted_stream(&*fixture, &ids, &[1, 2, 1, 0, 2]).await;
    let upcasting = fixture.store_with_upcasters(counted_upcasters());
    let pair = Pair::new(stream, p.clone());

    let tx = begin(fixture.source()).await;
    let claimed = upcasting
        .claim(&tx, &pair, ALL_EVENTS, RewindDebounce::NONE)
        .await
        .expect("claim");
    rollback(tx).await;
    let Claim::Unreadable {
        cursor,
        state,
        events,
        event_id,
        error,
    } = claimed
    else {
        panic!("expected the claim to stop at the unreadable event, got {claimed:?}");
    };
    assert_eq!(cursor.pair, pair);
    assert_eq!(state, None);
    assert_counted(&events, &ids[..3], 1);
    assert_eq!(event_id, ids[3]);
    assert!(error.contains(&ids[3].to_string()), "{error}");

    let tx = begin(fixture.source()).await;
    let claimed = upcasting
        .claim(&tx, &pair, 3, RewindDebounce::NONE)
        .await
        .expect("claim");
    rollback(tx).await;
    match claimed {
        Claim::Apply { events, .. } => assert_counted(&events, &ids[..3], 1),
        other => panic!("expected the three events before the unreadable one, got {other:?}"),
    }

    let tx = begin(fixture.source()).await;
    let claimed = claim(&*fixture, &tx, stream, &p, ALL_EVENTS, RewindDebounce::NONE).await;
    rollback(tx).await;
    let Claim::Apply { events, .. } = claimed else {
        panic!("the plain store reads every event: {claimed:?}");
    };
    assert_eq!(event_ids(&events), ids);
    let versions: Vec<u32> = events.iter().map(|e| e.schema_version).collect();
    assert_eq!(versions, [1, 2, 1, 1, 2]);
    assert_eq!(events[0].payload, serde_json::json!({ "count": 1 }));
}
