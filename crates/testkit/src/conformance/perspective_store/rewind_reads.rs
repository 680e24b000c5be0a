//! Cases of [`RewindReads`](lockstep_core::RewindReads): what a rewind reads and reports.
//!
//! `load_rewind` reading the snapshot before the trigger and the events after it, a rewind's
//! events in pages bounded by events and bytes, and a rewind's progress (`record_progress`)
//! listed while the rewind runs and not after it commits.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    ErrorKind, LockReason, PageLimits, Pair, PerspectiveName, ProgressReport, RewindProgress,
    StreamId,
};
use uuid::Uuid;

use super::{
    ALL_EVENTS, PerspectiveStoreFixture, append, apply, assert_counted, counted_stream,
    counted_upcasters, cursor, event, event_ids, ids, lease, name, register, renew, request,
    rewind, stream_with,
};
use crate::conformance::{begin, commit, rollback};

/// `load_rewind` reads what a rewind restores and replays, as the separate reads would: no
/// cursor → `None`; no request → the cursor alone; a request → the latest snapshot strictly
/// before its trigger and the stream's events after it, less the pair's skipped events (all
/// of them, from the start, without a snapshot).
pub async fn load_rewind_reads_the_snapshot_before_the_trigger_and_the_events_after_it<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("LoadRewind");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(5);
    let stream = stream_with(&*fixture, &ids[..4]).await;
    apply(&*fixture, stream, &p, 1, true).await; // snapshot at ids[0]
    apply(&*fixture, stream, &p, 1, true).await; // snapshot at ids[1]
    apply(&*fixture, stream, &p, 2, false).await;
    // A fifth event, skipped by an operator.
    append(&*fixture, stream, &[event(ids[4], 5)]).await;
    let tx = begin(fixture.source()).await;
    assert!(
        fixture
            .store()
            .skip_event(
                &tx,
                &lockstep_core::Pair::new(stream, p.clone()),
                ids[4],
                "conformance"
            )
            .await
            .expect("skip_event")
    );
    commit(tx).await.expect("commit");

    let load = |stream: StreamId| {
        let fixture = Arc::clone(&fixture);
        let p = p.clone();
        async move {
            let tx = begin(fixture.source()).await;
            let loaded = fixture
                .store()
                .load_rewind(
                    &tx,
                    &lockstep_core::Pair::new(stream, p.clone()),
                    PageLimits::default(),
                )
                .await
                .expect("load_rewind");
            rollback(tx).await;
            loaded
        }
    };
    assert_eq!(load(StreamId::new_v7()).await, None, "no cursor");
    let loaded = load(stream).await.expect("a cursor");
    assert_eq!(
        loaded.cursor,
        cursor(&*fixture, stream, &p).await.expect("cursor")
    );
    assert_eq!(loaded.cursor.rewind, None);
    assert_eq!((loaded.snapshot, loaded.events), (None, Vec::new()));

    for (from, snapshot_at, replayed) in [
        (Some(ids[2]), Some(ids[1]), &ids[2..4]),
        (Some(ids[1]), Some(ids[0]), &ids[1..4]),
        (None, None, &ids[..4]),
    ] {
        let tx = begin(fixture.source()).await;
        fixture
            .store()
            .request_rewind(&tx, &lockstep_core::Pair::new(stream, p.clone()), from)
            .await
            .expect("request_rewind");
        commit(tx).await.expect("commit");
        let loaded = load(stream).await.expect("a cursor");
        let before = cursor(&*fixture, stream, &p).await.expect("cursor");
        assert_eq!(loaded.cursor, before);
        let trigger = before.rewind.expect("a request").trigger;
        let tx = begin(fixture.source()).await;
        let snapshot = fixture
            .store()
            .snapshot_before(&tx, &lockstep_core::Pair::new(stream, p.clone()), trigger)
            .await
            .expect("snapshot_before");
        rollback(tx).await;
        assert_eq!(loaded.snapshot, snapshot);
        assert_eq!(loaded.snapshot.as_ref().map(|s| s.event_id), snapshot_at);
        if let Some(s) = &loaded.snapshot {
            let n = ids
                .iter()
                .position(|id| *id == s.event_id)
                .expect("an event") as u64;
            assert_eq!(s.applied_count, n + 1);
        }
        assert_eq!(
            event_ids(&loaded.events),
            replayed,
            "skipped ids[4] left out"
        );
        assert!(!loaded.more, "every event fits one page");
        assert!(loaded.events.iter().all(|e| e.stream_id == stream));
    }
}

/// A rewind reads its events in pages: `load_rewind` returns the first page and whether more
/// follow, `rewind_events` the page after a given event — at most the page's events, within its
/// bytes but the first event always, never the pair's skipped events, and `more` false on the
/// last page even when it is exactly full. Pages read one after another give the stream's
/// events, in order, each once — also after a snapshot, whose first page starts after it. The
/// page after a skipped event, or after an id that is not in the stream, starts at the next
/// event. A page limit of 0 is refused before anything is read.
pub async fn a_rewind_reads_its_events_in_pages_bounded_by_events_and_bytes<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("RewindPages");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(8);
    let stream = stream_with(&*fixture, &ids).await;
    let pair = lockstep_core::Pair::new(stream, p.clone());
    apply(&*fixture, stream, &p, 3, false).await;
    let store = fixture.store();
    let tx = begin(fixture.source()).await;
    assert!(
        store
            .skip_event(&tx, &pair, ids[3], "conformance")
            .await
            .expect("skip_event")
    );
    commit(tx).await.expect("commit");
    apply(&*fixture, stream, &p, 8, false).await;
    let tx = begin(fixture.source()).await;
    assert!(
        store
            .request_rewind(&tx, &pair, None)
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");
    let expected: Vec<Uuid> = ids.iter().copied().filter(|id| *id != ids[3]).collect();

    // Reads every page of the rewind with `page`: the pages' sizes and their events.
    let read_all = |page: PageLimits| {
        let fixture = Arc::clone(&fixture);
        let pair = pair.clone();
        async move {
            let store = fixture.store();
            let tx = begin(fixture.source()).await;
            let first = store
                .load_rewind(&tx, &pair, page)
                .await
                .expect("load_rewind")
                .expect("a cursor");
            let mut sizes = vec![first.events.len()];
            let mut events = event_ids(&first.events);
            let mut more = first.more;
            while more {
                let next = store
                    .rewind_events(&tx, &pair, events.last().copied(), page)
                    .await
                    .expect("rewind_events");
                assert!(!next.events.is_empty(), "a page holds at least one event");
                sizes.push(next.events.len());
                events.extend(event_ids(&next.events));
                more = next.more;
                assert!(sizes.len() <= 10, "the pages do not end");
            }
            rollback(tx).await;
            (sizes, events)
        }
    };
    let roomy = 1 << 30;
    // 7 events (one skipped): pages of 3, 3, 1; pages of 7 — one, exactly full, `more` false.
    for (events, sizes) in [(3, vec![3, 3, 1]), (7, vec![7]), (1000, vec![7])] {
        let page = PageLimits::new(events, roomy).expect("page limits");
        assert_eq!(
            read_all(page).await,
            (sizes, expected.clone()),
            "{events} per page"
        );
    }
    // One byte: the first event of each page always, no second one.
    let page = PageLimits::new(1000, 1).expect("page limits");
    assert_eq!(read_all(page).await, (vec![1; 7], expected.clone()));

    // From the start, and after an event: the skipped one is never handed out.
    let tx = begin(fixture.source()).await;
    let page = PageLimits::new(2, roomy).expect("page limits");
    let from_start = store
        .rewind_events(&tx, &pair, None, page)
        .await
        .expect("page");
    assert_eq!(
        (event_ids(&from_start.events), from_start.more),
        (ids[..2].to_vec(), true)
    );
    let after = store
        .rewind_events(&tx, &pair, Some(ids[2]), page)
        .await
        .expect("page");
    assert_eq!(
        (event_ids(&after.events), after.more),
        (ids[4..6].to_vec(), true)
    );
    let last = store
        .rewind_events(&tx, &pair, Some(ids[7]), page)
        .await
        .expect("page");
    assert_eq!(
        (last.events.len(), last.more),
        (0, false),
        "nothing after the last event"
    );
    // After the skipped event itself, and after an id between two events of the stream.
    let after_skipped = store
        .rewind_events(&tx, &pair, Some(ids[3]), page)
        .await
        .expect("page");
    assert_eq!(
        (event_ids(&after_skipped.events), after_skipped.more),
        (ids[4..6].to_vec(), true),
        "after the skipped event"
    );
    let between = Uuid::from_u128(ids[4].as_u128() + 1);
    assert!(between < ids[5], "ids are far apart");
    let after_unknown = store
        .rewind_events(&tx, &pair, Some(between), page)
        .await
        .expect("page");
    assert_eq!(
        (event_ids(&after_unknown.events), after_unknown.more),
        (ids[5..7].to_vec(), true),
        "after an id that is not in the stream"
    );

    // A page of no events is refused.
    let mut bad = PageLimits::default();
    bad.events = 0;
    let err = store
        .load_rewind(&tx, &pair, bad)
        .await
        .expect_err("0 events per page");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    let err = store
        .rewind_events(&tx, &pair, None, bad)
        .await
        .expect_err("0 events per page");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert_eq!(
        PageLimits::new(1, 0).expect_err("0 bytes").kind(),
        ErrorKind::InvalidInput
    );
    rollback(tx).await;

    // After a snapshot: a second stream, a snapshot at its third event, a rewind from its
    // fifth. The first page starts after the snapshot; the next after the first's last event.
    let ids = self::ids(8);
    let stream = stream_with(&*fixture, &ids).await;
    let pair = lockstep_core::Pair::new(stream, p.clone());
    apply(&*fixture, stream, &p, 3, true).await;
    apply(&*fixture, stream, &p, 8, false).await;
    let tx = begin(fixture.source()).await;
    assert!(
        store
            .request_rewind(&tx, &pair, Some(ids[4]))
            .await
            .expect("request_rewind")
    );
    commit(tx).await.expect("commit");
    let tx = begin(fixture.source()).await;
    let page = PageLimits::new(3, roomy).expect("page limits");
    let first = store
        .load_rewind(&tx, &pair, page)
        .await
        .expect("load_rewind")
        .expect("a cursor");
    assert_eq!(
        first.snapshot.as_ref().map(|s| s.event_id),
        Some(ids[2]),
        "the snapshot before the trigger"
    );
    assert_eq!(
        (event_ids(&first.events), first.more),
        (ids[3..6].to_vec(), true)
    );
    let next = store
        .rewind_events(&tx, &pair, Some(ids[5]), page)
        .await
        .expect("page");
    assert_eq!(
        (event_ids(&next.events), next.more),
        (ids[6..8].to_vec(), false)
    );
    rollback(tx).await;
}

async fn progress_of<F: PerspectiveStoreFixture>(
    fixture: &F,
    name: &PerspectiveName,
) -> Vec<RewindProgress> {
    let tx = begin(fixture.source()).await;
    let rows = fixture
        .store()
        .rewind_progress(&tx, std::slice::from_ref(name), 100)
        .await
        .expect("rewind_progress");
    rollback(tx).await;
    rows
}

/// A rewind's progress is listed while its pair has a rewind request and its lease is live;
/// a report of the same run keeps its start, a bad report or limit is invalid input, and once
/// the rewind commits it is no longer listed.
pub async fn rewind_progress_is_listed_while_the_rewind_runs_and_not_after_it_commits<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("Progress");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let stream = stream_with(&*fixture, &ids(3)).await;
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    request(&*fixture, stream, &p, None).await;
    let lease = lease(&*fixture, stream, &p, &LockReason::Rewind).await;
    let run = Uuid::new_v4();
    let mut report = ProgressReport::new(Pair::new(stream, p.clone()), run, 1, 3);
    report.lease = Some(lease.id.clone());
    report.elapsed = Duration::from_secs(5);
    let store = fixture.store();

    let tx = begin(fixture.source()).await;
    store.record_progress(&tx, &report).await.expect("record");
    commit(tx).await.expect("commit");
    let rows = progress_of(&*fixture, &p).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        (rows[0].pair.stream_id, rows[0].replayed, rows[0].to_replay),
        (stream, 1, 3)
    );
    assert_eq!(rows[0].holder, Some(lease.id.holder));
    assert!(
        rows[0].started_at + Duration::from_secs(5) <= rows[0].updated_at,
        "started when the run began, {:?} before its first report",
        report.elapsed
    );
    let started = rows[0].started_at;

    report.replayed = 2;
    renew(&*fixture, &lease).await;
    let tx = begin(fixture.source()).await;
    store.record_progress(&tx, &report).await.expect("record");
    commit(tx).await.expect("commit");
    let rows = progress_of(&*fixture, &p).await;
    assert_eq!(
        (rows.len(), rows[0].replayed, rows[0].started_at),
        (1, 2, started)
    );

    let tx = begin(fixture.source()).await;
    report.replayed = 4;
    let err = store
        .record_progress(&tx, &report)
        .await
        .expect_err("4 of 3");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    for limit in [0, lockstep_core::MAX_PROGRESS_ROWS + 1] {
        let err = store
            .rewind_progress(&tx, &[], limit)
            .await
            .expect_err("a limit out of range");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "limit {limit}");
    }
    rollback(tx).await;

    renew(&*fixture, &lease).await;
    rewind(&*fixture, stream, &p, Uuid::nil(), Some(lease.id.clone()))
        .await
        .expect("the rewind commits");
    assert!(
        progress_of(&*fixture, &p).await.is_empty(),
        "a committed rewind is no longer in progress"
    );
}

/// A rewind's reads through upcasters hand out the events in their current shape, page by
/// page, up to the first event an upcaster fails on: the page (of `load_rewind` or
/// `rewind_events`) ends before it, names it as unreadable, and says that none follow.
pub async fn rewind_reads_hand_out_upcast_events_up_to_one_an_upcaster_fails_on<
    F: PerspectiveStoreFixture,
>(
    fixture: Arc<F>,
) {
    let p = name("UpcastRewind");
    register(&*fixture, std::slice::from_ref(&p)).await;
    let ids = ids(5);
    let stream = counted_stream(&*fixture, &ids, &[1, 2, 1, 0, 2]).await;
    // Applied as stored by the plain store, then rewound from the start.
    apply(&*fixture, stream, &p, ALL_EVENTS, false).await;
    request(&*fixture, stream, &p, None).await;
    let upcasting = fixture.store_with_upcasters(counted_upcasters());
    let pair = Pair::new(stream, p.clone());
    let pages = |events: usize| {
        let mut page = PageLimits::default();
        page.events = events;
        page
    };

    let tx = begin(fixture.source()).await;
    let first = upcasting
        .load_rewind(&tx, &pair, pages(2))
        .await
        .expect("load_rewind")
        .expect("a cursor");
    assert_counted(&first.events, &ids[..2], 1);
    assert!(first.more);
    assert_eq!(first.unreadable, None);
    let next = upcasting
        .rewind_events(&tx, &pair, Some(ids[1]), pages(10))
        .await
        .expect("rewind_events");
    assert_counted(&next.events, &ids[2..3], 3);
    assert!(!next.more);
    let (event_id, error) = next
        .unreadable
        .expect("the page ends at the unreadable event");
    assert_eq!(event_id, ids[3]);
    assert!(error.contains(&ids[3].to_string()), "{error}");
    let whole = upcasting
        .load_rewind(&tx, &pair, pages(10))
        .await
        .expect("load_rewind")
        .expect("a cursor");
    rollback(tx).await;
    assert_counted(&whole.events, &ids[..3], 1);
    assert!(!whole.more);
    assert_eq!(whole.unreadable.map(|(id, _)| id), Some(ids[3]));
}
