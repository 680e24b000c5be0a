//! The batch operations of [`PgPerspectiveStore`](super::PgPerspectiveStore): two statements
//! claim a batch (`lockstep_perspective_claim_pairs`, in
//! `migrations/functions/lockstep_perspective_claim_pairs.sql`, for the pairs and their work
//! ids; `CLAIM_EVENTS` for their events, each pair's as one range of `wh_events`: ADR 0022 §2),
//! one commits it (`lockstep_perspective_commit_batch`, its work rows deleted by range: ADR
//! 0022). A pair that failed is handed out up to its failed event only (ADR 0030), and a
//! batch's failures are stored by one statement.

use lockstep_core::{
    BatchClaim, BatchCommitted, BatchEntry, ClaimedBatch, ClaimedPair, ClaimedWork, Error,
    ErrorKind, PerspectiveName, RecordedEvent, Result, StreamId, Upcasters,
};
use lockstep_pg::driver::{Columns as _, Executor, ReceivedLen, Row};
use lockstep_pg::internal::db_statement_error as statement_error;
use uuid::Uuid;

use super::{
    BATCH_CURSOR_AT, BATCH_STATE_AT, BATCH_WORK_AT, backoff_micros, check_json, count_param,
    decode_cursor, decode_error, fence_params, micros, sql,
};

/// A pair to apply, claimed by the first statement, waiting for its events.
struct Apply {
    cursor: lockstep_core::Cursor,
    state: Option<serde_json::Value>,
    /// The ids of its pending work rows it is handed, ascending (at least one).
    work: Vec<Uuid>,
    /// The size of its state as it arrived (the JSON text): what the worker holds.
    state_bytes: i64,
    /// Where its perspective's walk stood before it (the position to go back to when the
    /// byte bound leaves it out).
    walk_from: Option<StreamId>,
    events: Vec<RecordedEvent>,
    /// The first of its work events that could not be read, and why: the pair is handed out
    /// up to it ([`ClaimedWork::Unreadable`]).
    unreadable: Option<(Uuid, String)>,
}

/// A claimed pair in claim order: a rewind (boxed: rare, and much larger than an index), or
/// the index of a pair to apply.
enum Claimed {
    Rewind(Box<ClaimedPair>),
    Apply(usize),
}

/// Claims a batch in two statements (ADR 0022 §2): `lockstep_perspective_claim_pairs` walks,
/// locks and judges the pairs and gives each pair to apply its work rows' ids; `CLAIM_EVENTS`
/// reads their events, each pair's as one range of `wh_events`, within the byte bound.
pub(super) async fn claim<T: Executor + ?Sized>(
    tx: &T,
    request: &BatchClaim,
    upcasters: &Upcasters,
) -> Result<ClaimedBatch> {
    let limits = &request.limits;
    limits.validate()?;
    // Validated: at most 1 000 000, and bytes at most 1 TiB.
    let int = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
    let bytes = i64::try_from(limits.bytes).unwrap_or(i64::MAX);
    let (window, max_delay) = (
        micros(request.debounce.window)?,
        micros(request.debounce.max_delay)?,
    );
    let names: Vec<&str> = request.positions.iter().map(|(p, _)| p.as_str()).collect();
    let after: Vec<Option<Uuid>> = request
        .positions
        .iter()
        .map(|(_, s)| s.map(|s| s.as_uuid()))
        .collect();
    let rows = tx
        .query(
            sql::CLAIM_PAIRS,
            &[
                &names,
                &after,
                &int(limits.pairs),
                &int(limits.events_per_pair),
                &int(limits.events),
                &int(limits.scan),
                &window,
                &max_delay,
            ],
        )
        .await
        .map_err(|e| statement_error(e, "claiming a batch of perspective work"))?;
    // The requested names, to give rows back the caller's values without re-validating.
    let requested = |name: &str| -> Result<PerspectiveName> {
        request
            .positions
            .iter()
            .find(|(p, _)| p.as_str() == name)
            .map(|(p, _)| p.clone())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Backend,
                    format!("a batch claim returned perspective {name:?}, which was not asked for"),
                )
            })
    };
    let mut positions = Vec::with_capacity(request.positions.len());
    let mut claimed = Vec::new();
    let mut applies: Vec<Apply> = Vec::new();
    for row in &rows {
        let kind: String = row.column(0).map_err(decode_error)?;
        let stream: Option<Uuid> = row.column(1).map_err(decode_error)?;
        let name: String = row.column(2).map_err(decode_error)?;
        let name = requested(&name)?;
        match kind.as_str() {
            "position" => positions.push((name, stream.map(StreamId::from_uuid))),
            "apply" | "rewind" => {
                let stream =
                    StreamId::from_uuid(stream.ok_or_else(|| unexpected("a pair without stream"))?);
                let cursor = pair_cursor(row, stream, &name)?;
                if kind == "rewind" {
                    claimed.push(Claimed::Rewind(Box::new(ClaimedPair::new(
                        cursor,
                        ClaimedWork::Rewind,
                    ))));
                    continue;
                }
                let work: Vec<Uuid> = row
                    .column::<Option<Vec<Uuid>>>(BATCH_WORK_AT)
                    .map_err(decode_error)?
                    .unwrap_or_default();
                if work.is_empty() || !work.windows(2).all(|w| w[0] < w[1]) {
                    return Err(unexpected("a pair to apply without ascending work ids"));
                }
                let walk_from: Option<Uuid> =
                    row.column(BATCH_WORK_AT + 2).map_err(decode_error)?;
                claimed.push(Claimed::Apply(applies.len()));
                applies.push(Apply {
                    cursor,
                    state: row.column(BATCH_STATE_AT).map_err(decode_error)?,
                    work,
                    state_bytes: row
                        .column::<ReceivedLen>(BATCH_STATE_AT)
                        .map_err(decode_error)?
                        .0
                        .map_or(0, |n| i64::try_from(n).unwrap_or(i64::MAX)),
                    walk_from: walk_from.map(StreamId::from_uuid),
                    events: Vec::new(),
                    unreadable: None,
                });
            }
            other => return Err(unexpected(&format!("a row of unknown kind {other:?}"))),
        }
    }
    if positions.len() != request.positions.len() {
        return Err(unexpected("positions missing"));
    }
    let claimed_at = if applies.is_empty() {
        None
    } else {
        read_events(tx, &mut applies, bytes, upcasters).await?
    };
    // A pair the byte bound left out entirely is not in this batch: its perspective's walk
    // goes back to just before the first such pair, so that the next claim starts with it.
    let mut applies: Vec<Option<Apply>> = applies.into_iter().map(Some).collect();
    let mut went_back: Vec<bool> = vec![false; positions.len()];
    let mut batch = ClaimedBatch::default();
    for slot in claimed {
        let apply = match slot {
            Claimed::Rewind(pair) => {
                batch.pairs.push(*pair);
                continue;
            }
            Claimed::Apply(i) => applies
                .get_mut(i)
                .and_then(Option::take)
                .ok_or_else(|| unexpected("a pair twice"))?,
        };
        if apply.events.is_empty() && apply.unreadable.is_none() {
            if let Some(at) = positions
                .iter()
                .position(|(p, _)| *p == apply.cursor.pair.perspective)
                && !went_back[at]
            {
                went_back[at] = true;
                positions[at].1 = apply.walk_from;
            }
            continue;
        }
        let work = match apply.unreadable {
            Some((event_id, error)) => ClaimedWork::Unreadable {
                state: apply.state,
                events: apply.events,
                event_id,
                error,
            },
            None => ClaimedWork::Apply {
                state: apply.state,
                events: apply.events,
            },
        };
        batch.pairs.push(ClaimedPair::new(apply.cursor, work));
    }
    batch.positions = positions;
    batch.claimed_at = claimed_at;
    Ok(batch)
}
/// Reads the events of the pairs to apply (`CLAIM_EVENTS`) and keeps, per pair, the events
/// that are its work, in order, up to the first that did not come (the byte bound stopped
/// the batch there; a pair with none is left out by the caller) or could not be read (the
/// pair is then handed out up to it, [`ClaimedWork::Unreadable`]: one bad row fails its pair,
/// not the claim). Returns the database's clock when it read them (`None`: no row).
async fn read_events<T: Executor + ?Sized>(
    tx: &T,
    applies: &mut [Apply],
    bytes: i64,
    upcasters: &Upcasters,
) -> Result<Option<time::OffsetDateTime>> {
    let mut streams = Vec::with_capacity(applies.len());
    let mut first = Vec::with_capacity(applies.len());
    let mut last = Vec::with_capacity(applies.len());
    let mut state_bytes = Vec::with_capacity(applies.len());
    let mut total: i64 = 0;
    for apply in applies.iter() {
        streams.push(apply.cursor.pair.stream_id.as_uuid());
        // Not empty: checked when the pair was decoded.
        first.push(apply.work.first().copied().unwrap_or_default());
        last.push(apply.work.last().copied().unwrap_or_default());
        total = total.saturating_add(apply.state_bytes.max(0));
        state_bytes.push(total);
    }
    let rows = tx
        .query(
            sql::CLAIM_EVENTS,
            &[&streams, &first, &last, &state_bytes, &bytes],
        )
        .await
        .map_err(|e| statement_error(e, "reading a claimed batch's events"))?;
    let claimed_at = match rows.first() {
        Some(row) => Some(row.column(7).map_err(decode_error)?),
        None => None,
    };
    // How far each pair's work ids have been matched; a pair stops at its first gap.
    let mut matched = vec![0_usize; applies.len()];
    let mut stopped = vec![false; applies.len()];
    for row in &rows {
        let ordinal: i64 = row.column(0).map_err(decode_error)?;
        let i = usize::try_from(ordinal)
            .ok()
            .and_then(|o| o.checked_sub(1))
            .filter(|i| *i < applies.len())
            .ok_or_else(|| unexpected("an event of a pair that was not claimed"))?;
        let apply = &mut applies[i];
        if stopped[i] {
            continue;
        }
        let event = match crate::decode(row, 1, apply.cursor.pair.stream_id, upcasters) {
            Ok(event) => event,
            Err(err) => {
                // The id is read on its own: only the payload (or another column) is bad.
                let id: Uuid = row.column(1).map_err(decode_error)?;
                match apply.work.get(matched[i]) {
                    Some(next) if *next == id => {
                        apply.unreadable = Some((
                            id,
                            lockstep_core::perspective_store::unreadable_event_message(id, &err),
                        ));
                        stopped[i] = true;
                    }
                    // Not the pair's work (skipped, or enqueued after the claim).
                    Some(next) if *next > id => {}
                    _ => stopped[i] = true,
                }
                continue;
            }
        };
        match apply.work.get(matched[i]) {
            Some(id) if *id == event.event_id => {
                matched[i] += 1;
                apply.events.push(event);
            }
            // Inside the range but not work (skipped, or enqueued after the claim).
            Some(id) if *id > event.event_id => {}
            // A work id without its event: hand out the events before it only.
            _ => stopped[i] = true,
        }
    }
    Ok(claimed_at)
}

fn pair_cursor(
    row: &Row,
    stream: StreamId,
    name: &PerspectiveName,
) -> Result<lockstep_core::Cursor> {
    decode_cursor(row, BATCH_CURSOR_AT, stream, name)
}

/// `ids` in ascending order without repeats (borrowed when they are already).
fn ascending(ids: &[Uuid]) -> std::borrow::Cow<'_, [Uuid]> {
    if ids.windows(2).all(|w| w[0] < w[1]) {
        std::borrow::Cow::Borrowed(ids)
    } else {
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        std::borrow::Cow::Owned(sorted)
    }
}

fn unexpected(what: &str) -> Error {
    Error::new(
        ErrorKind::Backend,
        format!("a batch claim returned {what} (the schema and this binary do not match?)"),
    )
}

pub(super) async fn commit<T: Executor + ?Sized>(
    tx: &T,
    entries: &[BatchEntry],
    keep: i32,
) -> Result<Vec<BatchCommitted>> {
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let n = entries.len();
    let mut stream_ids = Vec::with_capacity(n);
    let mut perspectives = Vec::with_capacity(n);
    let mut has_commit = Vec::with_capacity(n);
    let mut expected = Vec::with_capacity(n);
    let mut states = Vec::with_capacity(n);
    let mut last_event_ids = Vec::with_capacity(n);
    let mut applied_counts = Vec::with_capacity(n);
    let mut applied_lens = Vec::with_capacity(n);
    let mut applied: Vec<Uuid> = Vec::new();
    let mut rewound_from = Vec::with_capacity(n);
    let mut snapshots = Vec::with_capacity(n);
    let mut fence_holders = Vec::with_capacity(n);
    let mut fence_epochs = Vec::with_capacity(n);
    let mut errors: Vec<Option<String>> = Vec::with_capacity(n);
    let mut failed_events = Vec::with_capacity(n);
    let mut retry_after = Vec::with_capacity(n);
    let mut park = Vec::with_capacity(n);
    // Everything is checked before the statement is sent: a bad entry writes nothing at all.
    for entry in entries {
        let pair = &entry.pair;
        if entry.commit.is_none() && entry.failure.is_none() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("batch entry {pair}: neither a state change nor a failure"),
            ));
        }
        stream_ids.push(pair.stream_id.as_uuid());
        perspectives.push(pair.perspective.as_str());
        match &entry.commit {
            Some(commit) => {
                if commit.pair.stream_id != pair.stream_id
                    || commit.pair.perspective != pair.perspective
                {
                    return Err(Error::new(
                        ErrorKind::InvalidInput,
                        format!(
                            "batch entry {pair}: its state change is for {}/{}",
                            commit.pair.stream_id, commit.pair.perspective
                        ),
                    ));
                }
                check_json(&commit.state)?;
                let (holder, epoch) =
                    fence_params(commit.fence.as_ref(), pair.stream_id, &pair.perspective)?;
                // In ascending order without repeats: the commit deletes a pair's applied
                // work rows as the range from its first to its last id
                // (`lockstep_perspective_commit_batch`), and a claim hands them out in that
                // order already.
                let ids = ascending(&commit.applied_events);
                let len = i32::try_from(ids.len()).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidInput,
                        "too many applied events in one entry",
                    )
                })?;
                has_commit.push(true);
                expected.push(Some(commit.expected_revision));
                states.push(Some(&commit.state));
                last_event_ids.push(commit.last_event_id);
                applied_counts.push(Some(count_param(commit.applied_count)?));
                applied_lens.push(len);
                applied.extend_from_slice(&ids);
                rewound_from.push(commit.rewound_from);
                snapshots.push(commit.snapshot);
                fence_holders.push(holder);
                fence_epochs.push(epoch);
            }
            None => {
                has_commit.push(false);
                expected.push(None);
                states.push(None);
                last_event_ids.push(None);
                applied_counts.push(None);
                applied_lens.push(0);
                rewound_from.push(None);
                snapshots.push(false);
                fence_holders.push(None);
                fence_epochs.push(None);
            }
        }
        match &entry.failure {
            Some(failure) => {
                // As record_failure: U+0000 cannot be stored, the text is kept readable.
                errors.push(Some(failure.error.replace('\0', "\u{FFFD}")));
                failed_events.push(failure.event_id);
                retry_after.push(backoff_micros(failure.retry_after));
                park.push(failure.park);
            }
            None => {
                errors.push(None);
                failed_events.push(None);
                retry_after.push(0);
                park.push(false);
            }
        }
    }
    let rows = tx
        .query(
            sql::COMMIT_BATCH,
            &[
                &stream_ids,
                &perspectives,
                &has_commit,
                &expected,
                &states,
                &last_event_ids,
                &applied_counts,
                &applied_lens,
                &applied,
                &rewound_from,
                &snapshots,
                &fence_holders,
                &fence_epochs,
                &keep,
                &errors,
                &failed_events,
                &retry_after,
                &park,
            ],
        )
        .await
        .map_err(|e| statement_error(e, "committing a batch of perspective work"))?;
    if rows.len() != n {
        return Err(Error::new(
            ErrorKind::Backend,
            format!("a batch commit of {n} entries returned {} rows", rows.len()),
        ));
    }
    rows.iter()
        .map(|row| {
            let outcome: String = row.column(1).map_err(decode_error)?;
            let revision: Option<i64> = row.column(2).map_err(decode_error)?;
            let parked: bool = row.column(3).map_err(decode_error)?;
            Ok(match (outcome.as_str(), revision) {
                ("committed", Some(revision)) => BatchCommitted::Committed { revision, parked },
                ("recorded", _) => BatchCommitted::FailureRecorded { parked },
                ("conflict" | "no_cursor", _) => BatchCommitted::Refused(ErrorKind::Conflict),
                ("lease_lost", _) => BatchCommitted::Refused(ErrorKind::LeaseLost),
                (other, _) => {
                    return Err(Error::new(
                        ErrorKind::Backend,
                        format!("a batch commit returned an unknown outcome {other:?}"),
                    ));
                }
            })
        })
        .collect()
}
