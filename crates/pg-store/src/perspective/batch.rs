//! The batch operations of [`PgPerspectiveStore`](super::PgPerspectiveStore): one statement
//! claims a batch (`lockstep_perspective_claim_batch`, migration V8), one commits it
//! (`lockstep_perspective_commit_batch`). The rows of a claim come back in the order the
//! function emits them — a pair's header, then its events — so decoding is one pass.

use lockstep_core::{
    BatchClaim, BatchCommitted, BatchEntry, ClaimedBatch, ClaimedPair, ClaimedWork, Error,
    ErrorKind, PerspectiveName, RecordedEvent, Result, StreamId,
};
use lockstep_pg::PgTransactionRef;
use lockstep_pg::internal::statement_error;
use tokio_postgres::GenericClient;
use tokio_postgres::Row;
use tokio_postgres::types::Type;
use uuid::Uuid;

use super::{
    BATCH_CURSOR_AT, BATCH_EVENT_AT, BATCH_STATE_AT, V7_CURSOR_COLUMNS, backoff_micros, check_json,
    count_param, decode_cursor, decode_error, fence_params, micros, sql,
};

/// A pair being decoded: its cursor row and the events that follow it.
struct Open {
    cursor: lockstep_core::Cursor,
    state: Option<serde_json::Value>,
    events: Vec<RecordedEvent>,
}

impl Open {
    fn close(self) -> ClaimedPair {
        ClaimedPair::new(
            self.cursor,
            ClaimedWork::Apply {
                state: self.state,
                events: self.events,
            },
        )
    }
}

pub(super) async fn claim<T: PgTransactionRef>(
    tx: &T,
    request: &BatchClaim,
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
        .executor()
        .query_typed(
            sql::CLAIM_BATCH,
            &[
                (&names, Type::TEXT_ARRAY),
                (&after, Type::UUID_ARRAY),
                (&int(limits.pairs), Type::INT4),
                (&int(limits.events_per_pair), Type::INT4),
                (&int(limits.events), Type::INT4),
                (&bytes, Type::INT8),
                (&int(limits.scan), Type::INT4),
                (&window, Type::INT8),
                (&max_delay, Type::INT8),
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
    let mut batch = ClaimedBatch::default();
    let mut open: Option<Open> = None;
    for row in &rows {
        let kind: String = row.try_get(0).map_err(decode_error)?;
        if kind == "event" {
            let Some(pair) = open.as_mut() else {
                return Err(unexpected("an event row before any pair"));
            };
            let event = crate::decode(row, BATCH_EVENT_AT, pair.cursor.stream_id)?;
            pair.events.push(event);
            continue;
        }
        if let Some(pair) = open.take() {
            batch.pairs.push(pair.close());
        }
        let stream: Option<Uuid> = row.try_get(1).map_err(decode_error)?;
        let name: String = row.try_get(2).map_err(decode_error)?;
        let name = requested(&name)?;
        match kind.as_str() {
            "position" => batch
                .positions
                .push((name, stream.map(StreamId::from_uuid))),
            "apply" | "rewind" => {
                let stream =
                    StreamId::from_uuid(stream.ok_or_else(|| unexpected("a pair without stream"))?);
                let cursor = pair_cursor(row, stream, &name)?;
                if kind == "rewind" {
                    batch
                        .pairs
                        .push(ClaimedPair::new(cursor, ClaimedWork::Rewind));
                } else {
                    open = Some(Open {
                        cursor,
                        state: row.try_get(BATCH_STATE_AT).map_err(decode_error)?,
                        events: Vec::new(),
                    });
                }
            }
            other => return Err(unexpected(&format!("a row of unknown kind {other:?}"))),
        }
    }
    if let Some(pair) = open.take() {
        batch.pairs.push(pair.close());
    }
    if batch.positions.len() != request.positions.len() {
        return Err(unexpected("positions missing"));
    }
    Ok(batch)
}

fn pair_cursor(
    row: &Row,
    stream: StreamId,
    name: &PerspectiveName,
) -> Result<lockstep_core::Cursor> {
    decode_cursor(
        row,
        BATCH_CURSOR_AT,
        BATCH_CURSOR_AT + V7_CURSOR_COLUMNS,
        stream,
        name,
    )
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

pub(super) async fn commit<T: PgTransactionRef>(
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
                if commit.stream_id != pair.stream_id || commit.perspective != pair.perspective {
                    return Err(Error::new(
                        ErrorKind::InvalidInput,
                        format!(
                            "batch entry {pair}: its state change is for {}/{}",
                            commit.stream_id, commit.perspective
                        ),
                    ));
                }
                check_json(&commit.state)?;
                let (holder, epoch) =
                    fence_params(commit.fence.as_ref(), pair.stream_id, &pair.perspective)?;
                // In ascending order without repeats: the commit deletes a pair's applied
                // work rows as the range from its first to its last id (V15), and a claim
                // hands them out in that order already.
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
        .executor()
        .query_typed(
            sql::COMMIT_BATCH,
            &[
                (&stream_ids, Type::UUID_ARRAY),
                (&perspectives, Type::TEXT_ARRAY),
                (&has_commit, Type::BOOL_ARRAY),
                (&expected, Type::INT8_ARRAY),
                (&states, Type::JSONB_ARRAY),
                (&last_event_ids, Type::UUID_ARRAY),
                (&applied_counts, Type::INT8_ARRAY),
                (&applied_lens, Type::INT4_ARRAY),
                (&applied, Type::UUID_ARRAY),
                (&rewound_from, Type::UUID_ARRAY),
                (&snapshots, Type::BOOL_ARRAY),
                (&fence_holders, Type::UUID_ARRAY),
                (&fence_epochs, Type::INT8_ARRAY),
                (&keep, Type::INT4),
                (&errors, Type::TEXT_ARRAY),
                (&failed_events, Type::UUID_ARRAY),
                (&retry_after, Type::INT8_ARRAY),
                (&park, Type::BOOL_ARRAY),
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
            let outcome: String = row.try_get(1).map_err(decode_error)?;
            let revision: Option<i64> = row.try_get(2).map_err(decode_error)?;
            let parked: bool = row.try_get(3).map_err(decode_error)?;
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
