//! Cases of [`PerspectiveAdmin`](lockstep_core::PerspectiveAdmin): an operator's view and
//! levers.
//!
//! Parked pairs listed and claimed again only after `unpark`, a rewind request retrying a
//! parked pair, `skip_event` skipping a pending event for good (and a reason over the limit
//! refused with nothing changed), and `perspective_status` counting work, failures, backoff
//! and parking.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    ErrorKind, PairFailure, PerspectiveName, SkippedEvent, StreamId, ValidationError,
};
use uuid::Uuid;

use super::{
    ALL_PAIRS, PerspectiveStoreFixture, append, cursor, event, fail, from_start, ids, isolate,
    limits, name, peek_batch, pending, register, request, stream_with, work_of,
};
use crate::conformance::{begin, commit, rollback};

/// A parked pair is left out of batches while its work keeps queueing; `parked_pairs` lists it
/// with its error, failure count and failed event; after `unpark` (which keeps the error text)
/// a batch claims it with all its work.
pub async fn a_parked_pair_is_listed_and_only_claimed_again_after_unpark<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Parked");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids[..1]).await;
    assert!(
        !fail(
            &*fixture,
            stream,
            &p,
            PairFailure::new("first").at_event(Some(ids[0]))
        )
        .await
    );
    let failure = PairFailure::new("apply failed")
        .at_event(Some(ids[0]))
        .retry_after(Duration::ZERO)
        .park(true);
    assert!(fail(&*fixture, stream, &p, failure).await, "parked");

    let asked = from_start(std::slice::from_ref(&p));
    assert!(
        peek_batch(&*fixture, asked.clone(), limits(10, 10, 100))
            .await
            .pairs
            .is_empty()
    );
    append(&*fixture, stream, &[event(ids[1], 2)]).await;
    assert_eq!(
        pending(&*fixture, stream, &p).await,
        ids,
        "work keeps queueing"
    );

    let tx = begin(fixture.source()).await;
    let parked = fixture
        .store()
        .parked_pairs(&tx, std::slice::from_ref(&p), ALL_PAIRS)
        .await
        .expect("parked_pairs");
    let all = fixture
        .store()
        .parked_pairs(&tx, &[], ALL_PAIRS)
        .await
        .expect("parked_pairs");
    let other = fixture
        .store()
        .parked_pairs(&tx, &[name("NoneParked")], ALL_PAIRS)
        .await
        .expect("parked_pairs");
    rollback(tx).await;
    let listed = parked
        .iter()
        .find(|c| c.pair.stream_id == stream)
        .expect("listed");
    assert_eq!(listed.pair.perspective, p);
    assert_eq!(listed.error.as_deref(), Some("apply failed"));
    assert_eq!(listed.failures, 2);
    assert_eq!(listed.failed_event_id, Some(ids[0]));
    assert!(listed.parked_at.is_some() && listed.retry_at.is_some());
    assert!(
        all.iter()
            .any(|c| c.pair.stream_id == stream && c.pair.perspective == p),
        "all perspectives"
    );
    assert!(other.is_empty());
    assert!(
        parked
            .iter()
            .all(|c| c.pair.perspective == p && c.parked_at.is_some())
    );
    assert!(
        parked.windows(2).all(|w| w[0].parked_at <= w[1].parked_at),
        "longest parked first"
    );

    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .unpark(&tx, &lockstep_core::Pair::new(stream, p.clone()))
            .await
            .expect("unpark")
    );
    assert!(
        !fixture
            .store()
            .unpark(
                &tx,
                &lockstep_core::Pair::new(StreamId::new_v7(), p.clone())
            )
            .await
            .expect("unpark"),
        "no cursor"
    );
    commit(tx).await.expect("commit");
    let retried = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (retried.parked_at, retried.retry_at, retried.failures),
        (None, None, 0)
    );
    assert_eq!(
        retried.error.as_deref(),
        Some("apply failed"),
        "the text stays"
    );
    // ... but a retried pair is not failing (an operator's `--check` must not fail on the
    // pair it just retried) until it fails again.
    let failing_and_in_error = || async {
        let tx = begin(fixture.source()).await;
        let failing = fixture
            .store()
            .failing_pairs(&tx, std::slice::from_ref(&p), ALL_PAIRS)
            .await
            .expect("failing_pairs");
        let status = fixture
            .store()
            .perspective_status(&tx)
            .await
            .expect("perspective_status");
        rollback(tx).await;
        let in_error = status
            .iter()
            .find(|s| s.perspective == p)
            .map(|s| s.in_error);
        (
            failing
                .iter()
                .filter(|c| c.pair.stream_id == stream)
                .count(),
            in_error,
        )
    };
    assert_eq!(failing_and_in_error().await, (0, Some(0)), "retried");
    let batch = peek_batch(&*fixture, asked, limits(10, 10, 100)).await;
    assert_eq!(work_of(&batch), [(stream, p.clone(), Some(ids.clone()))]);
    assert!(
        !fail(
            &*fixture,
            stream,
            &p,
            PairFailure::new("again").at_event(Some(ids[0]))
        )
        .await
    );
    assert_eq!(failing_and_in_error().await, (1, Some(1)), "failed again");
}

/// An operator's rewind request retries a parked pair: the next batch hands it out as a rewind.
pub async fn a_rewind_request_retries_a_parked_pair<F: PerspectiveStoreFixture>(fixture: Arc<F>) {
    let p = name("ParkedRewound");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(1);
    let stream = stream_with(&*fixture, &ids).await;
    let hour = Duration::from_secs(3600);
    assert!(
        fail(
            &*fixture,
            stream,
            &p,
            PairFailure::new("boom").retry_after(hour).park(true)
        )
        .await
    );
    let asked = from_start(std::slice::from_ref(&p));
    assert!(
        peek_batch(&*fixture, asked.clone(), limits(10, 10, 100))
            .await
            .pairs
            .is_empty()
    );
    request(&*fixture, stream, &p, None).await;
    let after = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (after.parked_at, after.retry_at, after.failures),
        (None, None, 0)
    );
    let batch = peek_batch(&*fixture, asked, limits(10, 10, 100)).await;
    assert_eq!(work_of(&batch), [(stream, p.clone(), None)]);
}

/// `skip_event` skips a pending event for good: recorded with its reason, its work item gone,
/// the pair retried (unparked, no backoff); it changes nothing for an event that is not
/// pending. A purge keeps the skipped events, deleting the cursor deletes them.
pub async fn skip_event_skips_a_pending_event_for_good_and_retries_the_pair<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Skipping");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    let failure = PairFailure::new("poison")
        .at_event(Some(ids[0]))
        .retry_after(Duration::from_secs(3600))
        .park(true);
    assert!(fail(&*fixture, stream, &p, failure).await);

    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .skip_event(
                &tx,
                &lockstep_core::Pair::new(stream, p.clone()),
                ids[0],
                "poison payload"
            )
            .await
            .expect("skip_event")
    );
    commit(tx).await.expect("commit");
    assert_eq!(
        pending(&*fixture, stream, &p).await,
        ids[1..],
        "its work item is gone"
    );
    let retried = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (retried.parked_at, retried.retry_at, retried.failures),
        (None, None, 0)
    );
    let recorded = skipped(&*fixture, stream, &p).await;
    assert_eq!(recorded.len(), 1);
    assert_eq!(
        (recorded[0].event_id, recorded[0].reason.as_str()),
        (ids[0], "poison payload")
    );
    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        work_of(&batch),
        [(stream, p.clone(), Some(ids[1..].to_vec()))]
    );

    assert!(fail(&*fixture, stream, &p, PairFailure::new("again").park(true)).await);
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");
    let tx = begin(fixture.source()).await;
    for not_pending in [ids[0], Uuid::now_v7()] {
        assert!(
            !fixture
                .store()
                .skip_event(
                    &tx,
                    &lockstep_core::Pair::new(stream, p.clone()),
                    not_pending,
                    "nothing"
                )
                .await
                .expect("skip_event"),
            "not pending"
        );
    }
    commit(tx).await.expect("commit");
    assert_eq!(
        cursor(&*fixture, stream, &p).await,
        Some(before),
        "nothing changed"
    );
    assert_eq!(skipped(&*fixture, stream, &p).await.len(), 1);
    assert_eq!(pending(&*fixture, stream, &p).await, ids[1..]);

    let tx = begin(fixture.source()).await;
    fixture
        .store()
        .purge(&tx, &lockstep_core::Pair::new(stream, p.clone()), None)
        .await
        .expect("purge");
    commit(tx).await.expect("commit");
    let purged = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (purged.error, purged.failures, purged.failed_event_id),
        (None, 0, None)
    );
    assert_eq!((purged.retry_at, purged.parked_at), (None, None));
    assert_eq!(
        skipped(&*fixture, stream, &p).await.len(),
        1,
        "a purge keeps them"
    );
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .delete_cursor(&tx, &lockstep_core::Pair::new(stream, p.clone()))
            .await
            .expect("delete")
    );
    commit(tx).await.expect("commit");
    assert!(
        skipped(&*fixture, stream, &p).await.is_empty(),
        "deleted with the cursor"
    );
}

/// A skip reason longer than [`SkippedEvent::MAX_REASON_CHARS`] (an operator pasting a payload,
/// 10 MB) is [`ErrorKind::InvalidInput`] before anything is written: the event stays pending,
/// the pair parked, nothing is recorded. A reason of exactly the limit is stored whole.
pub async fn a_skip_reason_longer_than_the_limit_is_invalid_input_and_changes_nothing<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("SkipReason");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids).await;
    let failure = PairFailure::new("poison")
        .at_event(Some(ids[0]))
        .retry_after(Duration::from_secs(3600))
        .park(true);
    assert!(fail(&*fixture, stream, &p, failure).await);
    let pair = lockstep_core::Pair::new(stream, p.clone());
    let before = cursor(&*fixture, stream, &p).await.expect("cursor");

    for reason in [
        "é".repeat(SkippedEvent::MAX_REASON_CHARS + 1),
        "x".repeat(10 << 20),
    ] {
        let tx = begin(fixture.source()).await;
        let err = fixture
            .store()
            .skip_event(&tx, &pair, ids[0], &reason)
            .await
            .expect_err("a reason over the limit is refused");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert_eq!(
            err.validation(),
            Some(&ValidationError::TextTooLong {
                field: "skip reason",
                chars: reason.chars().count(),
                max: SkippedEvent::MAX_REASON_CHARS,
            })
        );
        // The transaction is still usable: nothing was sent.
        commit(tx).await.expect("commit");
    }
    assert_eq!(
        cursor(&*fixture, stream, &p).await,
        Some(before),
        "nothing changed"
    );
    assert!(skipped(&*fixture, stream, &p).await.is_empty());
    assert_eq!(pending(&*fixture, stream, &p).await, ids);

    let at_limit = "é".repeat(SkippedEvent::MAX_REASON_CHARS);
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .skip_event(&tx, &pair, ids[0], &at_limit)
            .await
            .expect("a reason of the limit is accepted")
    );
    commit(tx).await.expect("commit");
    let recorded = skipped(&*fixture, stream, &p).await;
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0].reason, at_limit, "stored whole");
}

/// The committed skipped events of a pair.
async fn skipped<F: PerspectiveStoreFixture>(
    fixture: &F,
    stream: StreamId,
    p: &PerspectiveName,
) -> Vec<SkippedEvent> {
    let tx = begin(fixture.source()).await;
    let skipped = fixture
        .store()
        .skipped_events(&tx, &lockstep_core::Pair::new(stream, p.clone()))
        .await
        .expect("skipped_events");
    rollback(tx).await;
    skipped
}

/// `perspective_status` counts a perspective's pairs, pending work (with the oldest's age),
/// rewind requests, failing, backing-off and parked pairs; `failing_pairs` lists the failing
/// ones of the perspectives asked for. Counted as changes from before this case's streams
/// existed, so that other streams on a shared database do not matter.
pub async fn perspective_status_counts_work_failures_backoff_and_parking<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let (p, other) = (name("Status"), name("StatusOther"));
    register(&*fixture, &[p.clone(), other.clone()]).await;
    let status_of = |name: PerspectiveName| {
        let fixture = Arc::clone(&fixture);
        async move {
            let tx = begin(fixture.source()).await;
            let all = fixture
                .store()
                .perspective_status(&tx)
                .await
                .expect("perspective_status");
            rollback(tx).await;
            all.into_iter()
                .find(|s| s.perspective == name)
                .expect("every registered perspective is listed")
        }
    };
    let before = status_of(p.clone()).await;
    let streams = [
        stream_with(&*fixture, &ids(2)).await,
        stream_with(&*fixture, &ids(1)).await,
        stream_with(&*fixture, &ids(2)).await,
    ];
    let tx = begin(fixture.source()).await;
    let store = fixture.store();
    let parked = PairFailure::new("parked here").park(true);
    assert!(
        store
            .record_failure(
                &tx,
                &lockstep_core::Pair::new(streams[0], p.clone()),
                &parked
            )
            .await
            .expect("record")
    );
    let waiting = PairFailure::new("backing off").retry_after(Duration::from_secs(3600));
    assert!(
        !store
            .record_failure(
                &tx,
                &lockstep_core::Pair::new(streams[1], p.clone()),
                &waiting
            )
            .await
            .expect("record")
    );
    store
        .ensure_cursor(&tx, &lockstep_core::Pair::new(streams[2], p.clone()))
        .await
        .expect("cursor");
    assert!(
        store
            .request_rewind(&tx, &lockstep_core::Pair::new(streams[2], p.clone()), None)
            .await
            .expect("rewind")
    );
    commit(tx).await.expect("commit");

    let after = status_of(p.clone()).await;
    assert_eq!(after.pairs - before.pairs, 3, "{after:?}");
    assert_eq!(after.pending_events - before.pending_events, 5, "{after:?}");
    assert!(after.oldest_pending_age.is_some(), "{after:?}");
    assert_eq!(
        after.rewinds_pending - before.rewinds_pending,
        1,
        "{after:?}"
    );
    assert_eq!(after.in_error - before.in_error, 2, "{after:?}");
    assert_eq!(after.backing_off - before.backing_off, 1, "{after:?}");
    assert_eq!(after.parked - before.parked, 1, "{after:?}");
    let untouched = status_of(other.clone()).await;
    assert_eq!(
        (
            untouched.in_error,
            untouched.parked,
            untouched.rewinds_pending
        ),
        (0, 0, 0),
        "another perspective's pairs are its own"
    );

    let tx = begin(fixture.source()).await;
    let failing = store
        .failing_pairs(&tx, std::slice::from_ref(&p), 100)
        .await
        .expect("failing_pairs");
    let none = store
        .failing_pairs(&tx, std::slice::from_ref(&other), 100)
        .await
        .expect("failing_pairs");
    rollback(tx).await;
    let mut listed: Vec<StreamId> = failing.iter().map(|c| c.pair.stream_id).collect();
    listed.sort();
    let mut expected = vec![streams[0], streams[1]];
    expected.sort();
    assert_eq!(listed, expected);
    assert!(
        failing
            .iter()
            .all(|c| c.pair.perspective == p && c.error.is_some())
    );
    assert!(none.is_empty());
}
