//! Cases of [`WorkQueue`](lockstep_core::WorkQueue): the queue a worker's batches draw from.
//!
//! Appended events become work for every registered perspective when the append commits (none
//! for a rolled-back one). The batch claim: the requested perspectives only, within the
//! `pairs` / `events_per_pair` / `events` / `bytes` bounds (bytes counted decoded), disjoint
//! batches without waiting, leased and backing-off pairs left out, positions going round the
//! pairs in stream order, the `scan` bound, late arrivals and rewind requests handed out as
//! rewinds (no more requests looked at than there is room for), a failed pair retried up to
//! its failing event, a skipped event never handed out. The batch commit: each entry as
//! a single `commit` would, a stale entry refused alone, an invalid entry writing nothing of any
//! entry, an entry committing its prefix and parking its pair, a late arrival inside a claimed
//! range surviving it, a successful commit clearing the error, backoff and parking.
//! `record_failure` keeping the request and the work until a commit succeeds.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::perspective_store::DEFAULT_KEEP_SNAPSHOTS;
use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    BatchClaim, BatchCommitted, BatchEntry, Claim, ClaimedBatch, ClaimedWork, ErrorKind,
    EventStore, ExpectedVersion, InstanceId, LockReason, NewEvent, PageLimits, Pair, PairFailure,
    PerspectiveName, Release, RewindDebounce, StateCommit, StreamId, StreamLocker,
};
use uuid::Uuid;

use super::{
    ALL_EVENTS, ALL_PAIRS, HOUR, PerspectiveStoreFixture, append, apply, assert_counted, claim,
    claim_batch, commit_of, counted_stream, counted_upcasters, cursor, ensure_cursor, event,
    event_ids, fail, from_start, ids, isolate, lease, limits, listed, name, peek_batch, pending,
    register, renew, request, rewind, snapshots, state, stream_with, trigger, trigger_after_claim,
    work_of,
};
use crate::conformance::{begin, commit, rollback};

/// Appended events become work for every registered perspective, visible to others only when
/// the appender commits.
pub async fn appended_events_become_work_for_every_registered_perspective_on_commit<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let (a, b) = (name("Alpha"), name("Beta"));
    register(&*fixture, &[a.clone(), b.clone()]).await;
    let (stream, ids) = (StreamId::new_v7(), ids(2));
    let writer = begin(fixture.source()).await;
    fixture
        .events()
        .append(
            &writer,
            stream,
            ExpectedVersion::NoStream,
            &[event(ids[0], 1), event(ids[1], 2)],
        )
        .await
        .expect("append");
    let reader = begin(fixture.source()).await;
    for name in [&a, &b] {
        let seen = fixture
            .store()
            .pending_events(&reader, &lockstep_core::Pair::new(stream, name.clone()))
            .await
            .expect("pending_events");
        assert!(seen.is_empty(), "no work before the appender commits");
    }
    commit(writer).await.expect("commit");
    for name in [&a, &b] {
        let seen = fixture
            .store()
            .pending_events(&reader, &lockstep_core::Pair::new(stream, name.clone()))
            .await
            .expect("pending_events");
        assert_eq!(seen, ids, "work for {name} once the appender committed");
    }
    rollback(reader).await;
    assert_eq!(
        listed(
            &*fixture,
            InstanceId::random(),
            RewindDebounce::NONE,
            stream,
            &a
        )
        .await,
        Some((2, false))
    );
}

/// A rolled-back append leaves no work behind.
pub async fn a_rolled_back_append_leaves_no_work<F: PerspectiveStoreFixture>(fixture: Arc<F>) {
    let a = name("Alpha");
    register(&*fixture, std::slice::from_ref(&a)).await;
    let stream = StreamId::new_v7();
    let tx = begin(fixture.source()).await;
    fixture
        .events()
        .append(
            &tx,
            stream,
            ExpectedVersion::NoStream,
            &[event(ids(1)[0], 1)],
        )
        .await
        .expect("append");
    rollback(tx).await;
    assert!(pending(&*fixture, stream, &a).await.is_empty());
    assert_eq!(
        listed(
            &*fixture,
            InstanceId::random(),
            RewindDebounce::NONE,
            stream,
            &a
        )
        .await,
        None
    );
}

/// A recorded failure keeps the rewind request and the work, and counts; the next successful
/// commit clears the error and the count.
pub async fn a_recorded_failure_keeps_the_request_and_the_work_until_a_commit_succeeds<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Failing");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(2);
    let stream = stream_with(&*fixture, &ids[1..]).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    append(&*fixture, stream, &[event(ids[0], 1)]).await;
    assert_eq!(trigger_after_claim(&*fixture, stream, &p).await, ids[0]);
    for message in ["apply failed: boom", "apply failed: boom again"] {
        let tx = begin(fixture.source()).await;
        fixture
            .store()
            .record_failure(
                &tx,
                &lockstep_core::Pair::new(stream, p.clone()),
                &PairFailure::new(message),
            )
            .await
            .expect("record_failure");
        commit(tx).await.expect("commit");
    }
    let failed = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(failed.error.as_deref(), Some("apply failed: boom again"));
    assert_eq!(failed.failures, 2);
    assert_eq!(
        failed.rewind.map(|r| r.trigger),
        Some(ids[0]),
        "still requested"
    );
    assert_eq!(pending(&*fixture, stream, &p).await, ids[..1], "work kept");

    rewind(&*fixture, stream, &p, ids[0], None)
        .await
        .expect("rewind");
    let healed = cursor(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (healed.error, healed.failures, healed.rewind),
        (None, 0, None)
    );
}

/// The streams a batch claimed, in claim order.
fn streams_of(batch: &ClaimedBatch) -> Vec<StreamId> {
    batch
        .pairs
        .iter()
        .map(|p| p.cursor.pair.stream_id)
        .collect()
}

/// `n` fresh streams of `events` events each, in stream order, with their event ids.
async fn streams_with<F: PerspectiveStoreFixture>(
    fixture: &F,
    n: usize,
    events: usize,
) -> Vec<(StreamId, Vec<Uuid>)> {
    let mut streams = Vec::new();
    for _ in 0..n {
        let ids = ids(events);
        streams.push((stream_with(fixture, &ids).await, ids));
    }
    streams.sort();
    streams
}

/// A batch claims pairs of the requested perspectives only, and stops at its bounds: `pairs`,
/// `events_per_pair`, `events`; with `bytes = 1` it holds exactly one event. Bad limits are
/// `InvalidInput`.
pub async fn a_batch_claims_only_the_requested_perspectives_within_its_limits<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let (a, b, c) = (name("BatchA"), name("BatchB"), name("NotAsked"));
    register(&*fixture, &[a.clone(), b.clone(), c.clone()]).await;
    isolate(&*fixture, &[a.clone(), b.clone(), c.clone()]).await;
    let streams = streams_with(&*fixture, 3, 3).await;
    let asked = from_start(&[a.clone(), b.clone()]);

    let batch = peek_batch(&*fixture, asked.clone(), limits(4, 2, 7)).await;
    let expected = vec![
        (streams[0].0, a.clone(), Some(streams[0].1[..2].to_vec())),
        (streams[1].0, a.clone(), Some(streams[1].1[..2].to_vec())),
        (streams[2].0, a.clone(), Some(streams[2].1[..2].to_vec())),
        // Seven events in all: one left for the fourth pair.
        (streams[0].0, b.clone(), Some(streams[0].1[..1].to_vec())),
    ];
    assert_eq!(
        work_of(&batch),
        expected,
        "a's pairs in stream order, then b's"
    );
    assert!(batch.pairs.iter().all(|p| p.cursor.pair.perspective != c));
    let first = &batch.pairs[0];
    assert_eq!(first.cursor.revision, 0);
    assert!(
        matches!(&first.work, ClaimedWork::Apply { state: None, events } if events[0].payload["n"] == 1)
    );

    let batch = peek_batch(&*fixture, asked.clone(), limits(2, ALL_EVENTS, ALL_EVENTS)).await;
    assert_eq!(
        work_of(&batch),
        vec![
            (streams[0].0, a.clone(), Some(streams[0].1.clone())),
            (streams[1].0, a.clone(), Some(streams[1].1.clone())),
        ],
        "two pairs, every event of each"
    );

    let mut tiny = limits(ALL_PAIRS, ALL_EVENTS, ALL_EVENTS);
    tiny.bytes = 1;
    let batch = peek_batch(&*fixture, asked.clone(), tiny).await;
    assert_eq!(
        work_of(&batch),
        vec![(streams[0].0, a.clone(), Some(streams[0].1[..1].to_vec()))],
        "one event, larger than the bound, alone"
    );

    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&c)),
        limits(1, 1, 1),
    )
    .await;
    assert_eq!(batch.pairs.len(), 1, "c's own batch does claim c");
    assert_eq!(batch.pairs[0].cursor.pair.perspective, c);

    let tx = begin(fixture.source()).await;
    for bad in [limits(0, 1, 1), limits(1, 0, 1), limits(1, 1, 0)] {
        let mut request = BatchClaim::new(std::slice::from_ref(&a));
        request.limits = bad;
        let err = fixture
            .store()
            .claim_batch(&tx, &request)
            .await
            .expect_err("bad limits");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    }
    rollback(tx).await;
}

/// Two open transactions' batches claim disjoint pairs: the second skips the rows the first
/// holds, without waiting for it.
pub async fn concurrent_batches_claim_disjoint_pairs_without_waiting<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("Disjoint");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 4, 2).await;
    let all: Vec<StreamId> = streams.iter().map(|(s, _)| *s).collect();
    let first = begin(fixture.source()).await;
    let one = claim_batch(
        &*fixture,
        &first,
        from_start(std::slice::from_ref(&p)),
        limits(2, 10, 100),
    )
    .await;
    assert_eq!(streams_of(&one), all[..2]);
    let second = begin(fixture.source()).await;
    let two = tokio::time::timeout(
        Duration::from_secs(10),
        claim_batch(
            &*fixture,
            &second,
            from_start(std::slice::from_ref(&p)),
            limits(10, 10, 100),
        ),
    )
    .await
    .expect("a batch never waits for another transaction's rows");
    assert_eq!(
        streams_of(&two),
        all[2..],
        "only the pairs the first does not hold"
    );
    rollback(second).await;
    rollback(first).await;
    let again = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(streams_of(&again), all, "every pair once both ended");
}

/// A pair under a live lease is left out of every batch, and claimed again after the release.
pub async fn a_batch_skips_a_pair_under_a_live_lease<F: PerspectiveStoreFixture>(fixture: Arc<F>) {
    let p = name("BatchLeased");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 2, 1).await;
    let (leased, free) = (streams[0].0, streams[1].0);
    let lease = lease(&*fixture, leased, &p, &LockReason::Rewind).await;
    renew(&*fixture, &lease).await;
    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(streams_of(&batch), [free], "the leased pair is not claimed");
    let released = fixture.locker().release(&lease.id).await.expect("release");
    assert!(released.is_released());
    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(streams_of(&batch), [leased, free]);
}

/// A pair whose failure backs it off (an hour) is left out of batches — an explicit claim still
/// gets it; a failure retried at once does not hold its pair back.
pub async fn a_batch_skips_a_pair_that_backs_off<F: PerspectiveStoreFixture>(fixture: Arc<F>) {
    let p = name("BackingOff");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 2, 1).await;
    let (waiting, retried) = (streams[0].0, streams[1].0);
    let hour = Duration::from_secs(3600);
    assert!(
        !fail(
            &*fixture,
            waiting,
            &p,
            PairFailure::new("boom").retry_after(hour)
        )
        .await
    );
    assert!(
        !fail(
            &*fixture,
            retried,
            &p,
            PairFailure::new("boom").retry_after(Duration::ZERO)
        )
        .await
    );
    let backing_off = cursor(&*fixture, waiting, &p).await.expect("cursor");
    let at_once = cursor(&*fixture, retried, &p).await.expect("cursor");
    let (later, now) = (
        backing_off.retry_at.expect("backing off"),
        at_once.retry_at.expect("retry_at"),
    );
    assert!(
        later >= now + time::Duration::minutes(59),
        "{later} vs {now}"
    );

    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        streams_of(&batch),
        [retried],
        "only the pair retried at once"
    );
    let tx = begin(fixture.source()).await;
    assert!(
        matches!(
            claim(&*fixture, &tx, waiting, &p, 10, RewindDebounce::NONE).await,
            Claim::Apply { .. }
        ),
        "an explicit claim does not wait for the backoff"
    );
    rollback(tx).await;
}

/// With `pairs = 1` and the returned positions passed back, successive batches hand out the
/// pairs in stream order and wrap round to the first.
pub async fn batch_positions_go_round_the_pairs_in_stream_order<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("Rotating");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams: Vec<StreamId> = streams_with(&*fixture, 3, 1)
        .await
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let mut positions = from_start(std::slice::from_ref(&p));
    for expected in [streams[0], streams[1], streams[2], streams[0], streams[1]] {
        let batch = peek_batch(&*fixture, positions, limits(1, 10, 100)).await;
        assert_eq!(streams_of(&batch), [expected]);
        assert_eq!(
            batch.positions,
            [(p.clone(), Some(expected))],
            "stopped at the claimed pair"
        );
        positions = batch.positions;
    }
}

/// A batch looks at no more than `scan` pairs: when the first pairs in stream order are all
/// parked, it comes back empty with its position moved past the ones it looked at, and the next
/// claim from there reaches the healthy pair.
pub async fn the_scan_bound_moves_the_position_past_pairs_it_cannot_serve<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Scanned");
    register(&*fixture, std::slice::from_ref(&p)).await;
    // Streams of one random 64-bit prefix: no other stream sorts between them.
    let prefix = Uuid::new_v4().as_u64_pair().0;
    let stream = |i: u64| StreamId::from_uuid(Uuid::from_u64_pair(prefix, i));
    for i in 1..=4 {
        append(&*fixture, stream(i), &[event(Uuid::now_v7(), 1)]).await;
    }
    for i in 1..=3 {
        assert!(
            fail(
                &*fixture,
                stream(i),
                &p,
                PairFailure::new("boom").park(true)
            )
            .await
        );
    }
    let mut bounded = limits(1, 10, 100);
    bounded.scan = 2;
    let batch = peek_batch(&*fixture, vec![(p.clone(), Some(stream(0)))], bounded).await;
    assert!(
        batch.pairs.is_empty(),
        "two parked pairs looked at: {batch:?}"
    );
    assert_eq!(
        batch.positions,
        [(p.clone(), Some(stream(2)))],
        "moved past them"
    );
    let batch = peek_batch(&*fixture, batch.positions, bounded).await;
    assert_eq!(streams_of(&batch), [stream(4)], "the healthy pair");
    assert_eq!(batch.positions, [(p.clone(), Some(stream(4)))]);
}

/// `commit_batch` commits every entry in one call and reports each: a commit; a commit with a
/// stale expected revision, refused alone (`Conflict`, nothing of it written); one under a lost
/// lease (`LeaseLost`); the events before a failing one committed with the failure stored;
/// a failure alone, parking its pair.
pub async fn commit_batch_commits_each_entry_and_refuses_a_stale_one_alone<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("BatchCommit");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 5, 3).await;
    let (ok, stale, fenced, partial, failed) = (
        &streams[0],
        &streams[1],
        &streams[2],
        &streams[3],
        &streams[4],
    );
    let lost = lease(&*fixture, fenced.0, &p, &LockReason::Rewind).await;
    let released = fixture.locker().release(&lost.id).await.expect("release");
    assert!(released.is_released());

    let tx = begin(fixture.source()).await;
    let batch = claim_batch(
        &*fixture,
        &tx,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        streams_of(&batch),
        streams.iter().map(|(s, _)| *s).collect::<Vec<_>>()
    );
    let mut entries = Vec::new();
    for claimed in &batch.pairs {
        let ClaimedWork::Apply { state, events } = &claimed.work else {
            panic!("expected events to apply");
        };
        let cursor = &claimed.cursor;
        let pair = cursor.pair.clone();
        let stream = cursor.pair.stream_id;
        let entry = if stream == ok.0 {
            BatchEntry::new(pair, Some(commit_of(cursor, state.as_ref(), events)), None)
        } else if stream == stale.0 {
            let mut change = commit_of(cursor, state.as_ref(), events);
            change.expected_revision = cursor.revision + 1;
            BatchEntry::new(pair, Some(change), None)
        } else if stream == fenced.0 {
            let mut change = commit_of(cursor, state.as_ref(), events);
            change.fence = Some(lost.id.clone());
            BatchEntry::new(pair, Some(change), None)
        } else if stream == partial.0 {
            let failure = PairFailure::new("apply failed at the second event")
                .at_event(Some(events[1].event_id))
                .retry_after(Duration::from_secs(3600));
            BatchEntry::new(
                pair,
                Some(commit_of(cursor, state.as_ref(), &events[..1])),
                Some(failure),
            )
        } else {
            let failure = PairFailure::new("apply failed at once")
                .at_event(Some(events[0].event_id))
                .park(true);
            BatchEntry::new(pair, None, Some(failure))
        };
        entries.push(entry);
    }
    let done = fixture
        .store()
        .commit_batch(&tx, &entries)
        .await
        .expect("commit_batch");
    let revision = batch.pairs[0].cursor.revision + 1;
    assert_eq!(
        done,
        [
            BatchCommitted::Committed {
                revision,
                parked: false
            },
            BatchCommitted::Refused(ErrorKind::Conflict),
            BatchCommitted::Refused(ErrorKind::LeaseLost),
            BatchCommitted::Committed {
                revision: batch.pairs[3].cursor.revision + 1,
                parked: false
            },
            BatchCommitted::FailureRecorded { parked: true },
        ]
    );
    commit(tx).await.expect("commit");

    let (after, stored) = state(&*fixture, ok.0, &p).await.expect("cursor");
    assert_eq!(
        (after.revision, after.last_event_id),
        (revision, Some(ok.1[2]))
    );
    assert_eq!(stored, Some(serde_json::json!({ "sum": 6 })));
    assert!(pending(&*fixture, ok.0, &p).await.is_empty());
    for untouched in [stale, fenced] {
        let (after, stored) = state(&*fixture, untouched.0, &p).await.expect("cursor");
        assert_eq!(
            (after.last_event_id, after.applied_count, stored),
            (None, 0, None)
        );
        assert_eq!((after.error, after.failures), (None, 0));
        assert_eq!(
            pending(&*fixture, untouched.0, &p).await,
            untouched.1,
            "nothing written"
        );
    }
    let (after, stored) = state(&*fixture, partial.0, &p).await.expect("cursor");
    assert_eq!(
        (after.last_event_id, after.applied_count),
        (Some(partial.1[0]), 1)
    );
    assert_eq!(stored, Some(serde_json::json!({ "sum": 1 })));
    assert_eq!(
        after.error.as_deref(),
        Some("apply failed at the second event")
    );
    assert_eq!(
        (after.failures, after.failed_event_id),
        (1, Some(partial.1[1]))
    );
    assert!(after.retry_at.is_some() && after.parked_at.is_none());
    assert_eq!(pending(&*fixture, partial.0, &p).await, partial.1[1..]);
    let after = cursor(&*fixture, failed.0, &p).await.expect("cursor");
    assert_eq!(
        (after.failures, after.failed_event_id),
        (1, Some(failed.1[0]))
    );
    assert!(after.parked_at.is_some());
    assert_eq!(pending(&*fixture, failed.0, &p).await, failed.1);

    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        streams_of(&batch),
        [stale.0, fenced.0],
        "not the backing-off and the parked pair, nor the one without work"
    );
}

/// A batch commit with one bad entry — a commit of another pair, a state that cannot be
/// stored, neither commit nor failure — is `InvalidInput` and writes none of its entries.
pub async fn an_invalid_batch_entry_writes_nothing_of_any_entry<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("BatchInvalid");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 2, 1).await;
    let tx = begin(fixture.source()).await;
    let batch = claim_batch(
        &*fixture,
        &tx,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    let commits: Vec<(Pair, StateCommit)> = batch
        .pairs
        .iter()
        .map(|c| {
            let ClaimedWork::Apply { state, events } = &c.work else {
                panic!("expected events to apply");
            };
            (
                c.cursor.pair.clone(),
                commit_of(&c.cursor, state.as_ref(), events),
            )
        })
        .collect();
    assert_eq!(commits.len(), 2);
    let good = BatchEntry::new(commits[0].0.clone(), Some(commits[0].1.clone()), None);
    let mut unstorable = commits[1].1.clone();
    unstorable.state = serde_json::json!({ "note": "a\u{0}b" });
    let bad = [
        BatchEntry::new(commits[1].0.clone(), Some(commits[0].1.clone()), None),
        BatchEntry::new(commits[1].0.clone(), Some(unstorable), None),
        BatchEntry::new(commits[1].0.clone(), None, None),
    ];
    for bad in bad {
        let err = fixture
            .store()
            .commit_batch(&tx, &[good.clone(), bad.clone()])
            .await
            .expect_err("a bad entry");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{bad:?}: {err}");
    }
    commit(tx).await.expect("still usable");
    for (stream, ids) in &streams {
        let (after, stored) = state(&*fixture, *stream, &p).await.expect("cursor");
        assert_eq!(
            (after.revision, after.last_event_id, stored),
            (0, None, None)
        );
        assert_eq!(
            &pending(&*fixture, *stream, &p).await,
            ids,
            "nothing written"
        );
    }
}

/// A successful commit — by `commit` or in a batch — clears the pair's error, failure
/// count, failed event, backoff and parking.
pub async fn a_successful_commit_clears_the_error_the_backoff_and_the_parking<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Healed");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 2, 1).await;
    let hour = Duration::from_secs(3600);
    for (i, (stream, ids)) in streams.iter().enumerate() {
        let failure = PairFailure::new("boom")
            .at_event(Some(ids[0]))
            .retry_after(hour)
            .park(true);
        assert!(fail(&*fixture, *stream, &p, failure).await);
        let failed = cursor(&*fixture, *stream, &p).await.expect("cursor");
        assert!(failed.parked_at.is_some() && failed.retry_at.is_some());
        assert_eq!((failed.failures, failed.failed_event_id), (1, Some(ids[0])));

        // An explicit claim does not wait for the parking.
        let tx = begin(fixture.source()).await;
        let Claim::Apply {
            cursor: claimed,
            state,
            events,
            ..
        } = claim(&*fixture, &tx, *stream, &p, 10, RewindDebounce::NONE).await
        else {
            panic!("expected events to apply");
        };
        let change = commit_of(&claimed, state.as_ref(), &events);
        if i == 0 {
            fixture
                .store()
                .commit(tx, &change, Release::Keep)
                .await
                .expect("commit");
        } else {
            let done = fixture
                .store()
                .commit_batch(
                    &tx,
                    &[BatchEntry::new(claimed.pair.clone(), Some(change), None)],
                )
                .await
                .expect("commit_batch");
            assert_eq!(
                done,
                [BatchCommitted::Committed {
                    revision: claimed.revision + 1,
                    parked: false
                }]
            );
            commit(tx).await.expect("commit");
        }
        let healed = cursor(&*fixture, *stream, &p).await.expect("cursor");
        assert_eq!(
            (healed.error, healed.failures, healed.failed_event_id),
            (None, 0, None)
        );
        assert_eq!((healed.retry_at, healed.parked_at), (None, None));
    }
}

/// A pair that failed at an event after its cursor is handed out by a batch up to that event
/// only, so that a poisoned pair's retry costs what its failing event costs; once a commit has
/// cleared the failure, the rest comes at full size. A failed event with no work left up to it
/// (skipped or purged meanwhile) does not hold the pair back: its work comes as before.
pub async fn a_failed_pair_is_retried_up_to_its_failed_event<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("RetriedAtItsEvent");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 2, 5).await;
    let ((poisoned, poisoned_ids), (gone, gone_ids)) = (&streams[0], &streams[1]);
    let at = |event: Uuid| {
        PairFailure::new("boom")
            .at_event(Some(event))
            .retry_after(Duration::ZERO)
    };
    assert!(!fail(&*fixture, *poisoned, &p, at(poisoned_ids[2])).await);
    // An id below every event of the stream: nothing is pending up to it.
    assert!(!fail(&*fixture, *gone, &p, at(Uuid::from_u128(1))).await);

    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        work_of(&batch),
        [
            (*poisoned, p.clone(), Some(poisoned_ids[..3].to_vec())),
            (*gone, p.clone(), Some(gone_ids.clone())),
        ],
        "the failed pair up to its failed event; the other with all its work"
    );

    // The retry succeeds: its commit clears the failure, and the rest comes at full size.
    let tx = begin(fixture.source()).await;
    let batch = claim_batch(
        &*fixture,
        &tx,
        from_start(std::slice::from_ref(&p)),
        limits(1, 10, 100),
    )
    .await;
    let [claimed] = &batch.pairs[..] else {
        panic!("one pair claimed, not {:?}", work_of(&batch));
    };
    let ClaimedWork::Apply { state, events } = &claimed.work else {
        panic!("expected events to apply");
    };
    assert_eq!(event_ids(events), poisoned_ids[..3]);
    let change = commit_of(&claimed.cursor, state.as_ref(), events);
    let done = fixture
        .store()
        .commit_batch(
            &tx,
            &[BatchEntry::new(
                claimed.cursor.pair.clone(),
                Some(change),
                None,
            )],
        )
        .await
        .expect("commit_batch");
    assert!(matches!(done[..], [BatchCommitted::Committed { .. }]));
    commit(tx).await.expect("commit");
    let healed = cursor(&*fixture, *poisoned, &p).await.expect("cursor");
    assert_eq!((healed.failures, healed.failed_event_id), (0, None));
    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        work_of(&batch)[0],
        (*poisoned, p.clone(), Some(poisoned_ids[3..].to_vec())),
    );
}

/// Claims the one pair of `p` with work in a batch, commits its first event with `failure` in
/// one entry (the events before a failing one, as the worker commits them) and ends the
/// transaction; the claimed revision and the commit's answer.
async fn commit_first_event_with<F: PerspectiveStoreFixture>(
    fixture: &F,
    p: &PerspectiveName,
    failure: PairFailure,
) -> (i64, Vec<BatchCommitted>) {
    let tx = begin(fixture.source()).await;
    let batch = claim_batch(
        fixture,
        &tx,
        from_start(std::slice::from_ref(p)),
        limits(10, 10, 100),
    )
    .await;
    let [claimed] = &batch.pairs[..] else {
        panic!("one pair claimed, not {:?}", work_of(&batch));
    };
    let ClaimedWork::Apply { state, events } = &claimed.work else {
        panic!("expected events to apply");
    };
    let prefix = commit_of(&claimed.cursor, state.as_ref(), &events[..1]);
    let done = fixture
        .store()
        .commit_batch(
            &tx,
            &[BatchEntry::new(
                claimed.cursor.pair.clone(),
                Some(prefix),
                Some(failure),
            )],
        )
        .await
        .expect("commit_batch");
    commit(tx).await.expect("commit");
    (claimed.cursor.revision, done)
}

/// A pair whose batch committed the events before its failing one is retried at the failing
/// event alone; a failure recorded at an event its cursor has passed does not bound it.
pub async fn a_pair_failed_after_its_prefix_is_retried_at_the_failing_event<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("RetriedAfterPrefix");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 1, 4).await;
    let (stream, ids) = &streams[0];
    let failure = PairFailure::new("apply failed at the second event")
        .at_event(Some(ids[1]))
        .retry_after(Duration::ZERO);
    let (_, done) = commit_first_event_with(&*fixture, &p, failure).await;
    assert!(matches!(
        done[..],
        [BatchCommitted::Committed { parked: false, .. }]
    ));

    let retry = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        work_of(&retry),
        [(*stream, p.clone(), Some(vec![ids[1]]))],
        "the failing event alone"
    );

    // A failure recorded at an event the cursor has passed: no bound.
    let passed = PairFailure::new("boom")
        .at_event(Some(ids[0]))
        .retry_after(Duration::ZERO);
    assert!(!fail(&*fixture, *stream, &p, passed).await);
    let retry = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(
        work_of(&retry),
        [(*stream, p.clone(), Some(ids[1..].to_vec()))]
    );
}

/// A batch entry that commits the events before its failing one and parks the pair (a
/// perspective that parks at its first failure) is answered `Committed { parked: true }`: the
/// prefix is stored, the failure and the parking too, and the work from the failing event on
/// stays queued.
pub async fn a_batch_entry_can_commit_its_prefix_and_park_its_pair<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("PrefixThenParked");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 1, 3).await;
    let (stream, ids) = &streams[0];
    let failure = PairFailure::new("apply failed at the second event")
        .at_event(Some(ids[1]))
        .park(true);
    let (revision, done) = commit_first_event_with(&*fixture, &p, failure).await;
    assert_eq!(
        done,
        [BatchCommitted::Committed {
            revision: revision + 1,
            parked: true
        }]
    );
    let (after, stored) = state(&*fixture, *stream, &p).await.expect("cursor");
    assert_eq!(
        (after.last_event_id, after.applied_count),
        (Some(ids[0]), 1)
    );
    assert_eq!(stored, Some(serde_json::json!({ "sum": 1 })));
    assert_eq!((after.failures, after.failed_event_id), (1, Some(ids[1])));
    assert!(after.parked_at.is_some() && after.error.is_some());
    assert_eq!(pending(&*fixture, *stream, &p).await, ids[1..]);
}

/// In a batch, a late arrival is handed out as a rewind (the request is kept by committing),
/// held back inside the debounce window (request kept too), and a rewind request on a pair
/// with no pending work is handed out as a rewind.
pub async fn a_batch_hands_out_late_arrivals_and_rewind_requests_as_rewinds<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("BatchRewind");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let (late_ids, idle_ids) = (ids(2), ids(1));
    let late = stream_with(&*fixture, &late_ids[1..]).await;
    let idle = stream_with(&*fixture, &idle_ids).await;
    apply(&*fixture, late, &p, ALL_EVENTS, false).await;
    apply(&*fixture, idle, &p, ALL_EVENTS, false).await;
    append(&*fixture, late, &[event(late_ids[0], 5)]).await;
    let asked = from_start(std::slice::from_ref(&p));

    let mut debounced = BatchClaim::new(std::slice::from_ref(&p));
    debounced.debounce = HOUR;
    debounced.limits = limits(10, 10, 100);
    let tx = begin(fixture.source()).await;
    let batch = fixture
        .store()
        .claim_batch(&tx, &debounced)
        .await
        .expect("claim_batch");
    assert!(
        batch.pairs.is_empty(),
        "held back inside the window: {batch:?}"
    );
    commit(tx).await.expect("commit");
    assert_eq!(
        trigger(&*fixture, late, &p).await,
        Some(late_ids[0]),
        "flagged"
    );

    let tx = begin(fixture.source()).await;
    let batch = claim_batch(&*fixture, &tx, asked.clone(), limits(10, 10, 100)).await;
    assert_eq!(work_of(&batch), [(late, p.clone(), None)]);
    let flagged = batch.pairs[0].cursor.rewind.expect("a rewind request");
    assert_eq!(flagged.trigger, late_ids[0]);
    commit(tx).await.expect("commit");
    assert_eq!(
        pending(&*fixture, late, &p).await,
        late_ids[..1],
        "work kept"
    );

    request(&*fixture, idle, &p, None).await;
    assert!(pending(&*fixture, idle, &p).await.is_empty());
    let mut streams = vec![late, idle];
    streams.sort();
    let batch = peek_batch(&*fixture, asked, limits(10, 10, 100)).await;
    let mut rewinds: Vec<StreamId> = work_of(&batch)
        .into_iter()
        .map(|(s, _, events)| {
            assert_eq!(events, None, "a rewind");
            s
        })
        .collect();
    rewinds.sort();
    assert_eq!(rewinds, streams, "both requests, the one without work too");
}

/// Rewind requests are looked at oldest first, and no more of them than the batch has room for
/// pairs (the claim's cost does not grow with requests it cannot serve): with room for one
/// pair, a claim whose oldest request is held by another open claim claims no request — it
/// does not go on to the next one, which a later claim gets.
pub async fn a_claim_looks_at_no_more_rewind_requests_than_it_has_room_for<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("RequestRoom");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let older = stream_with(&*fixture, &ids(1)).await;
    let younger = stream_with(&*fixture, &ids(1)).await;
    apply(&*fixture, older, &p, ALL_EVENTS, false).await;
    apply(&*fixture, younger, &p, ALL_EVENTS, false).await;
    request(&*fixture, older, &p, None).await;
    request(&*fixture, younger, &p, None).await;
    let asked = from_start(std::slice::from_ref(&p));
    let holder = begin(fixture.source()).await;
    let held = claim_batch(&*fixture, &holder, asked.clone(), limits(1, 10, 100)).await;
    assert_eq!(
        work_of(&held),
        [(older, p.clone(), None)],
        "the older request first"
    );
    let other = begin(fixture.source()).await;
    let batch = claim_batch(&*fixture, &other, asked.clone(), limits(1, 10, 100)).await;
    assert!(
        batch.pairs.is_empty(),
        "one request looked at, and another claim holds it: {batch:?}"
    );
    rollback(other).await;
    let batch = peek_batch(&*fixture, asked, limits(2, 10, 100)).await;
    assert_eq!(
        work_of(&batch),
        [(younger, p.clone(), None)],
        "with room for two, the younger one too"
    );
    rollback(holder).await;
}

/// An event skipped between two pending ones is not handed out, however a store reads a
/// pair's events (e.g. as one range of the stream from the first pending event to the last):
/// the batch holds the events before and after it, and committing them leaves no work.
pub async fn an_event_skipped_between_pending_ones_is_not_handed_out<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    let p = name("SkipMiddle");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(4);
    let stream = stream_with(&*fixture, &ids).await;
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .skip_event(
                &tx,
                &lockstep_core::Pair::new(stream, p.clone()),
                ids[1],
                "poison in the middle"
            )
            .await
            .expect("skip_event")
    );
    commit(tx).await.expect("commit");

    let tx = begin(fixture.source()).await;
    let batch = claim_batch(
        &*fixture,
        &tx,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    let kept = vec![ids[0], ids[2], ids[3]];
    assert_eq!(work_of(&batch), [(stream, p.clone(), Some(kept.clone()))]);
    let ClaimedWork::Apply {
        state: claimed,
        events,
    } = &batch.pairs[0].work
    else {
        panic!("expected events");
    };
    let change = commit_of(&batch.pairs[0].cursor, claimed.as_ref(), events);
    let done = fixture
        .store()
        .commit_batch(
            &tx,
            &[BatchEntry::new(
                batch.pairs[0].cursor.pair.clone(),
                Some(change),
                None,
            )],
        )
        .await
        .expect("commit_batch");
    assert!(
        matches!(done[..], [BatchCommitted::Committed { .. }]),
        "{done:?}"
    );
    commit(tx).await.expect("commit");
    assert!(pending(&*fixture, stream, &p).await.is_empty());
    let (cursor, _) = state(&*fixture, stream, &p).await.expect("cursor");
    assert_eq!(
        (cursor.last_event_id, cursor.applied_count),
        (Some(ids[3]), 3)
    );
}

/// A late arrival enqueued (and committed) inside a claimed pair's range of events while its
/// batch is in flight is not deleted by the batch's commit — whatever way the store deletes
/// the applied work, e.g. by range of event ids — and the next claim rewinds the pair from it.
/// The other pair of the batch commits as usual.
pub async fn a_late_arrival_inside_a_claimed_range_survives_the_batch_commit<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("RangeLate");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let (late_ids, plain_ids) = (ids(3), ids(2));
    let late = stream_with(&*fixture, &[late_ids[0], late_ids[2]]).await;
    let plain = stream_with(&*fixture, &plain_ids).await;

    let tx = begin(fixture.source()).await;
    let batch = claim_batch(
        &*fixture,
        &tx,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    let mut claimed = work_of(&batch);
    claimed.sort();
    let mut expected = vec![
        (late, p.clone(), Some(vec![late_ids[0], late_ids[2]])),
        (plain, p.clone(), Some(plain_ids.clone())),
    ];
    expected.sort();
    assert_eq!(claimed, expected);
    // Between the first and the last claimed event of `late`, committed by another writer.
    append(&*fixture, late, &[event(late_ids[1], 7)]).await;
    let entries: Vec<BatchEntry> = batch
        .pairs
        .iter()
        .map(|pair| {
            let ClaimedWork::Apply { state, events } = &pair.work else {
                panic!("expected events: {pair:?}");
            };
            let change = commit_of(&pair.cursor, state.as_ref(), events);
            BatchEntry::new(pair.cursor.pair.clone(), Some(change), None)
        })
        .collect();
    let done = fixture
        .store()
        .commit_batch(&tx, &entries)
        .await
        .expect("commit_batch");
    assert!(
        done.iter()
            .all(|d| matches!(d, BatchCommitted::Committed { .. })),
        "{done:?}"
    );
    commit(tx).await.expect("commit");

    assert_eq!(
        pending(&*fixture, late, &p).await,
        late_ids[1..2],
        "the late arrival's work stays"
    );
    assert!(pending(&*fixture, plain, &p).await.is_empty());
    let (cursor, _) = state(&*fixture, late, &p).await.expect("cursor");
    assert_eq!(cursor.last_event_id, Some(late_ids[2]));
    let batch = peek_batch(
        &*fixture,
        from_start(std::slice::from_ref(&p)),
        limits(10, 10, 100),
    )
    .await;
    assert_eq!(work_of(&batch), [(late, p.clone(), None)], "a rewind");
    assert_eq!(
        batch.pairs[0].cursor.rewind.map(|r| r.trigger),
        Some(late_ids[1])
    );
}

/// A batch of plain entries commits each as `commit` would: exactly the applied work is
/// deleted (a work row inside the applied range that the entry did not apply stays), a fenced
/// entry under its live lease commits, an entry's snapshot is saved and only the newest
/// [`DEFAULT_KEEP_SNAPSHOTS`] are kept, and of two entries for one pair the second, computed
/// from the same revision, is refused alone.
pub async fn a_batch_of_plain_entries_commits_each_as_a_single_commit_would<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("BatchPlain");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let streams = streams_with(&*fixture, 4, 3).await;
    let (gap, fenced, twice, pruned) = (&streams[0], &streams[1], &streams[2], &streams[3]);
    for (stream, _) in &streams {
        ensure_cursor(&*fixture, *stream, &p).await;
    }
    // `pruned` has the most snapshots kept already, one per event applied.
    for _ in 0..2 {
        apply(&*fixture, pruned.0, &p, 1, true).await;
    }
    let extra = ids(1)[0];
    append(&*fixture, pruned.0, &[event(extra, 100)]).await;
    apply(&*fixture, pruned.0, &p, 1, true).await;
    let held = lease(&*fixture, fenced.0, &p, &LockReason::Rewind).await;

    let tx = begin(fixture.source()).await;
    let mut entries = Vec::new();
    for (stream, _) in [gap, fenced, twice, pruned] {
        let (cursor, stored) = fixture
            .store()
            .state(&tx, &lockstep_core::Pair::new(*stream, p.clone()))
            .await
            .expect("state")
            .expect("cursor row");
        let all = fixture
            .store()
            .stream_events(&tx, *stream, cursor.last_event_id)
            .await
            .expect("stream_events");
        let mut change = commit_of(&cursor, stored.as_ref(), &all);
        if *stream == gap.0 {
            // The middle event is not applied: its work row must stay.
            let (first, last) = (&all[0], &all[2]);
            change = commit_of(&cursor, stored.as_ref(), &[first.clone(), last.clone()]);
        } else if *stream == fenced.0 {
            change.fence = Some(held.id.clone());
        } else if *stream == pruned.0 {
            change.snapshot = true;
        }
        entries.push(BatchEntry::new(
            cursor.pair.clone(),
            Some(change.clone()),
            None,
        ));
        if *stream == twice.0 {
            entries.push(BatchEntry::new(cursor.pair.clone(), Some(change), None));
        }
    }
    renew(&*fixture, &held).await;
    let done = fixture
        .store()
        .commit_batch(&tx, &entries)
        .await
        .expect("commit_batch");
    let revisions: Vec<i64> = entries
        .iter()
        .map(|e| e.commit.as_ref().map_or(0, |c| c.expected_revision + 1))
        .collect();
    assert_eq!(
        done,
        [
            BatchCommitted::Committed {
                revision: revisions[0],
                parked: false
            },
            BatchCommitted::Committed {
                revision: revisions[1],
                parked: false
            },
            BatchCommitted::Committed {
                revision: revisions[2],
                parked: false
            },
            BatchCommitted::Refused(ErrorKind::Conflict),
            BatchCommitted::Committed {
                revision: revisions[4],
                parked: false
            },
        ]
    );
    commit(tx).await.expect("commit");

    let (after, stored) = state(&*fixture, gap.0, &p).await.expect("cursor");
    assert_eq!(
        (after.revision, after.last_event_id, after.applied_count),
        (revisions[0], Some(gap.1[2]), 2)
    );
    assert_eq!(stored, Some(serde_json::json!({ "sum": 1 + 3 })));
    assert_eq!(pending(&*fixture, gap.0, &p).await, [gap.1[1]]);
    for (stream, ids) in [fenced, twice] {
        let (after, stored) = state(&*fixture, *stream, &p).await.expect("cursor");
        assert_eq!(
            (after.last_event_id, after.applied_count, after.error),
            (Some(ids[2]), 3, None)
        );
        assert_eq!(stored, Some(serde_json::json!({ "sum": 6 })));
        assert!(pending(&*fixture, *stream, &p).await.is_empty());
    }
    assert_eq!(
        cursor(&*fixture, twice.0, &p)
            .await
            .expect("cursor")
            .revision,
        revisions[2],
        "the refused duplicate wrote nothing"
    );
    let (after, stored) = state(&*fixture, pruned.0, &p).await.expect("cursor");
    assert_eq!((after.last_event_id, after.applied_count), (Some(extra), 4));
    assert_eq!(stored, Some(serde_json::json!({ "sum": 106 })));
    assert_eq!(after.latest_snapshot, Some(extra));
    let kept = snapshots(&*fixture, pruned.0, &p).await;
    assert_eq!(kept.len(), DEFAULT_KEEP_SNAPSHOTS.min(4));
    assert_eq!(
        (kept[0].event_id, kept[0].applied_count, &kept[0].state),
        (extra, 4, &serde_json::json!({ "sum": 106 }))
    );
    let released = fixture.locker().release(&held.id).await.expect("release");
    assert!(released.is_released(), "the fenced commit kept the lease");
}

/// The byte bounds count what a worker holds: each payload's size decoded, not as stored (a
/// database stores a large value compressed). Four events of a megabyte of one repeated
/// character each, which compress to a few kilobytes: a batch bounded at two and a half
/// megabytes holds two of them, and so does each rewind page; a bound below one event still
/// hands out one, so that the pair makes progress.
pub async fn the_byte_bounds_count_payloads_decoded_not_as_stored<F: PerspectiveStoreFixture>(
    fixture: Arc<F>,
) {
    const MB: usize = 1 << 20;
    let p = name("Compressible");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(4);
    let stream = StreamId::new_v7();
    let events: Vec<NewEvent> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| {
            NewEvent::new(
                "Padded",
                serde_json::json!({ "n": n, "body": "x".repeat(MB) }),
            )
            .expect("event")
            .with_id(*id)
            .expect("a chosen id")
        })
        .collect();
    append(&*fixture, stream, &events).await;

    let mut bounded = limits(ALL_PAIRS, ALL_EVENTS, ALL_EVENTS);
    bounded.bytes = (5 * MB / 2) as u64;
    let batch = peek_batch(&*fixture, from_start(std::slice::from_ref(&p)), bounded).await;
    assert_eq!(
        work_of(&batch),
        vec![(stream, p.clone(), Some(ids[..2].to_vec()))],
        "two megabytes of payloads fit two and a half, three do not"
    );
    bounded.bytes = (MB / 2) as u64;
    let batch = peek_batch(&*fixture, from_start(std::slice::from_ref(&p)), bounded).await;
    assert_eq!(
        work_of(&batch),
        vec![(stream, p.clone(), Some(ids[..1].to_vec()))],
        "one event larger than the bound, alone"
    );

    let pair = lockstep_core::Pair::new(stream, p.clone());
    let store = fixture.store();
    let tx = begin(fixture.source()).await;
    assert!(
        store
            .request_rewind(&tx, &pair, None)
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");
    let tx = begin(fixture.source()).await;
    let page = PageLimits::new(1000, (5 * MB / 2) as u64).expect("page limits");
    let first = store
        .load_rewind(&tx, &pair, page)
        .await
        .expect("load_rewind")
        .expect("a cursor");
    assert_eq!(
        (event_ids(&first.events), first.more),
        (ids[..2].to_vec(), true)
    );
    let next = store
        .rewind_events(&tx, &pair, Some(ids[1]), page)
        .await
        .expect("rewind_events");
    assert_eq!(
        (event_ids(&next.events), next.more),
        (ids[2..].to_vec(), false)
    );
    let small = PageLimits::new(1000, (MB / 2) as u64).expect("page limits");
    let page = store
        .rewind_events(&tx, &pair, None, small)
        .await
        .expect("rewind_events");
    assert_eq!(
        (event_ids(&page.events), page.more),
        (ids[..1].to_vec(), true)
    );
    rollback(tx).await;
}

/// A batch claimed through upcasters hands out every pair's events in their current shape; a
/// pair with an event an upcaster fails on is `ClaimedWork::Unreadable` at that event, with
/// the events before it, and the other pairs are not affected.
pub async fn a_batch_hands_out_upcast_events_and_a_pair_unreadable_at_the_failing_event<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("UpcastBatch");
    register(&*fixture, std::slice::from_ref(&p)).await;
    isolate(&*fixture, std::slice::from_ref(&p)).await;
    let (good_ids, bad_ids) = (ids(3), ids(3));
    let good = counted_stream(&*fixture, &good_ids, &[1, 2, 1]).await;
    let bad = counted_stream(&*fixture, &bad_ids, &[2, 0, 1]).await;
    let upcasting = fixture.store_with_upcasters(counted_upcasters());
    let mut request = BatchClaim::new(&[]);
    request.positions = from_start(std::slice::from_ref(&p));
    request.limits = limits(10, 100, 1000);
    let tx = begin(fixture.source()).await;
    let batch = upcasting
        .claim_batch(&tx, &request)
        .await
        .expect("claim_batch");
    rollback(tx).await;
    assert_eq!(batch.pairs.len(), 2, "{batch:?}");
    for pair in &batch.pairs {
        match (&pair.work, pair.cursor.pair.stream_id) {
            (ClaimedWork::Apply { events, .. }, stream) if stream == good => {
                assert_counted(events, &good_ids, 1);
            }
            (
                ClaimedWork::Unreadable {
                    events,
                    event_id,
                    error,
                    ..
                },
                stream,
            ) if stream == bad => {
                assert_counted(events, &bad_ids[..1], 1);
                assert_eq!(*event_id, bad_ids[1]);
                assert!(error.contains(&bad_ids[1].to_string()), "{error}");
            }
            other => panic!("unexpected pair {other:?}"),
        }
    }
}
