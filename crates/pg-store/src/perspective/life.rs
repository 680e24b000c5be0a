//! A perspective's life on PostgreSQL (ADR 0016): retire, list the retired, rebuild, and the
//! progress of rewinds. Each is one statement; the trait methods of
//! [`PgPerspectiveStore`](super::PgPerspectiveStore) call these.

use lockstep_core::perspective_store::check_progress_limit;
use lockstep_core::{
    Error, ErrorKind, InstanceId, PerspectiveName, ProgressReport, Rebuild, Result, RetireStates,
    Retired, RewindProgress, StreamId, THROUGHPUT_WINDOW, Throughput,
};
use lockstep_pg::driver::{Columns as _, Executor, query_one, query_opt};
use lockstep_pg::internal::db_statement_error as statement_error;
use time::OffsetDateTime;
use uuid::Uuid;

use super::{decode_error, stored_count, stored_name};

/// The statements of this module.
pub(super) mod sql {
    /// Retires `$1`, keeping its states when `$2` (see `lockstep_retire_perspective`). No row:
    /// not registered. It first locks the perspective's cursor rows in stream order, the
    /// workers' order, so it waits for the batches that hold some instead of deadlocking with
    /// them. Appends queue behind its exclusive lock for at most `$3` µs at a time, and it
    /// gives up after `$4` µs with 55P03 naming the transaction it waits for.
    pub(super) const RETIRE: &str = "SELECT work_removed, pairs FROM lockstep_retire_perspective(\
         $1, $2, $3 * interval '1 microsecond', $4 * interval '1 microsecond')";

    /// The perspectives retired with their states kept, by name.
    pub(super) const RETIRED: &str = "SELECT r.perspective_name FROM wh_retired_perspectives r \
         ORDER BY r.perspective_name COLLATE \"C\"";

    /// Requests a rewind from the start on every pair of `$1` (see
    /// `lockstep_rebuild_perspective`). NULL: not registered.
    pub(super) const REBUILD: &str = "SELECT lockstep_rebuild_perspective($1)";

    /// Records a rewind's progress: `$1` stream, `$2` perspective, `$3` run, `$4` holder, `$5`
    /// epoch, `$6` replayed, `$7` to replay, `$8` µs the run has been going. A new run restarts
    /// `started_at` (the clock less `$8`).
    pub(super) const RECORD_PROGRESS: &str = "\
INSERT INTO wh_perspective_rewind_progress AS p
       (stream_id, perspective_name, run_id, instance_id, epoch, replayed, to_replay,
        started_at, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, clock_timestamp() - $8 * interval '1 microsecond',
        clock_timestamp())
ON CONFLICT (stream_id, perspective_name) DO UPDATE
   SET started_at = CASE WHEN p.run_id = EXCLUDED.run_id THEN p.started_at
                         ELSE EXCLUDED.started_at END,
       run_id = EXCLUDED.run_id, instance_id = EXCLUDED.instance_id, epoch = EXCLUDED.epoch,
       replayed = EXCLUDED.replayed, to_replay = EXCLUDED.to_replay,
       updated_at = EXCLUDED.updated_at";

    /// Adds applied events (`$1` names, `$2` counts) to the catch-up rates, closing windows of
    /// at least `$3` µs (see `lockstep_perspective_record_applied`).
    pub(super) const RECORD_APPLIED: &str =
        "SELECT lockstep_perspective_record_applied($1, $2, $3)";

    /// Every perspective's catch-up rate (see `Throughput`): the last closed window's, or the
    /// open window's when it is at least `$1` µs old or none closed yet (from a second on).
    pub(super) const THROUGHPUT: &str = "\
SELECT t.perspective_name, t.window_applied, t.window_started_at,
       CASE WHEN t.rate IS NULL
                 OR clock_timestamp() - t.window_started_at >= $1 * interval '1 microsecond'
            THEN CASE WHEN clock_timestamp() - t.window_started_at >= interval '1 second'
                      THEN (t.window_applied
                            / extract(epoch FROM clock_timestamp() - t.window_started_at))::float8
                 END
            ELSE t.rate
       END
  FROM wh_perspective_throughput t
 ORDER BY t.perspective_name COLLATE \"C\"";

    /// The current progress of the rewinds of `$1` (all when empty), at most `$2`: the pair
    /// still has a rewind request, and a report made under a lease names the live lease. Each
    /// row with the database's clock, what its times are read against.
    pub(super) const PROGRESS: &str = "\
SELECT p.stream_id, p.perspective_name, p.instance_id, p.replayed, p.to_replay,
       p.started_at, p.updated_at, clock_timestamp()
  FROM wh_perspective_rewind_progress p
  JOIN wh_perspective_cursors k
    ON k.stream_id = p.stream_id AND k.perspective_name = p.perspective_name
 WHERE k.rewind_trigger_event_id IS NOT NULL
   AND (cardinality($1::text[]) = 0 OR p.perspective_name = ANY ($1))
   AND (p.instance_id IS NULL
        OR (k.stream_lock_instance_id = p.instance_id AND k.stream_lock_epoch = p.epoch
            AND k.stream_lock_expiry > clock_timestamp()))
 ORDER BY p.perspective_name COLLATE \"C\", p.stream_id
 LIMIT $2";
}

pub(super) async fn retire<T: Executor + ?Sized>(
    tx: &T,
    perspective: &PerspectiveName,
    states: RetireStates,
    (queue_us, give_up_us): (i64, i64),
) -> Result<Retired> {
    let keep = states == RetireStates::Keep;
    let row = query_opt(
        tx,
        sql::RETIRE,
        &[&perspective.as_str(), &keep, &queue_us, &give_up_us],
    )
    .await
    .map_err(|e| statement_error(e, "retiring a perspective"))?;
    let Some(row) = row else {
        return Ok(Retired::NotRegistered);
    };
    let work: i64 = row.column(0).map_err(decode_error)?;
    let pairs: i64 = row.column(1).map_err(decode_error)?;
    Ok(Retired::Retired {
        work_removed: stored_count(work)?,
        pairs: stored_count(pairs)?,
    })
}

pub(super) async fn retired<T: Executor + ?Sized>(tx: &T) -> Result<Vec<PerspectiveName>> {
    let rows = tx
        .query(sql::RETIRED, &[])
        .await
        .map_err(|e| statement_error(e, "listing retired perspectives"))?;
    rows.iter()
        .map(|row| stored_name(row.column(0).map_err(decode_error)?))
        .collect()
}

pub(super) async fn rebuild<T: Executor + ?Sized>(
    tx: &T,
    perspective: &PerspectiveName,
) -> Result<Rebuild> {
    let row = query_one(tx, sql::REBUILD, &[&perspective.as_str()])
        .await
        .map_err(|e| statement_error(e, "requesting a perspective's rebuild"))?;
    let pairs: Option<i64> = row.column(0).map_err(decode_error)?;
    Ok(match pairs {
        None => Rebuild::NotRegistered,
        Some(n) => Rebuild::Requested {
            pairs: stored_count(n)?,
        },
    })
}

pub(super) async fn record_progress<T: Executor + ?Sized>(
    tx: &T,
    report: &ProgressReport,
) -> Result<()> {
    report.validate()?;
    let count = |n: u64| {
        i64::try_from(n).map_err(|_| Error::new(ErrorKind::InvalidInput, "progress out of range"))
    };
    let replayed = count(report.replayed)?;
    let to_replay = count(report.to_replay)?;
    let holder: Option<Uuid> = report.lease.as_ref().map(|l| l.holder.as_uuid());
    let epoch: Option<i64> = report.lease.as_ref().map(|l| l.epoch.get());
    // At most a century (validated): fits.
    let elapsed = i64::try_from(report.elapsed.as_micros()).unwrap_or(i64::MAX);
    tx.query(
        sql::RECORD_PROGRESS,
        &[
            &report.pair.stream_id.as_uuid(),
            &report.pair.perspective.as_str(),
            &report.run,
            &holder,
            &epoch,
            &replayed,
            &to_replay,
            &elapsed,
        ],
    )
    .await
    .map_err(|e| statement_error(e, "recording a rewind's progress"))?;
    Ok(())
}

pub(super) async fn rewind_progress<T: Executor + ?Sized>(
    tx: &T,
    perspectives: &[PerspectiveName],
    limit: usize,
) -> Result<Vec<RewindProgress>> {
    check_progress_limit(limit)?;
    let names: Vec<&str> = perspectives.iter().map(PerspectiveName::as_str).collect();
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let rows = tx
        .query(sql::PROGRESS, &[&names, &limit])
        .await
        .map_err(|e| statement_error(e, "reading rewinds' progress"))?;
    rows.iter()
        .map(|row| {
            let stream: Uuid = row.column(0).map_err(decode_error)?;
            let name: String = row.column(1).map_err(decode_error)?;
            let holder: Option<Uuid> = row.column(2).map_err(decode_error)?;
            let replayed: i64 = row.column(3).map_err(decode_error)?;
            let to_replay: i64 = row.column(4).map_err(decode_error)?;
            let started_at: OffsetDateTime = row.column(5).map_err(decode_error)?;
            let updated_at: OffsetDateTime = row.column(6).map_err(decode_error)?;
            let mut progress = RewindProgress::new(
                lockstep_core::Pair::new(StreamId::from(stream), stored_name(name)?),
                stored_count(replayed)?,
                stored_count(to_replay)?,
                started_at,
                updated_at,
            );
            progress.read_at = Some(row.column(7).map_err(decode_error)?);
            progress.holder = holder.map(InstanceId::from_uuid).transpose().map_err(|e| {
                Error::new(ErrorKind::Backend, "a stored instance id is invalid").with_source(e)
            })?;
            Ok(progress)
        })
        .collect()
}

fn window_micros() -> i64 {
    i64::try_from(THROUGHPUT_WINDOW.as_micros()).unwrap_or(i64::MAX)
}

pub(super) async fn record_applied<T: Executor + ?Sized>(
    tx: &T,
    counts: &[(PerspectiveName, u64)],
) -> Result<()> {
    if counts.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = counts.iter().map(|(n, _)| n.as_str()).collect();
    let numbers = counts
        .iter()
        .map(|(_, n)| {
            i64::try_from(*n)
                .map_err(|_| Error::new(ErrorKind::InvalidInput, "applied count out of range"))
        })
        .collect::<Result<Vec<i64>>>()?;
    tx.query(sql::RECORD_APPLIED, &[&names, &numbers, &window_micros()])
        .await
        .map_err(|e| statement_error(e, "recording applied events"))?;
    Ok(())
}

pub(super) async fn throughput<T: Executor + ?Sized>(tx: &T) -> Result<Vec<Throughput>> {
    let rows = tx
        .query(sql::THROUGHPUT, &[&window_micros()])
        .await
        .map_err(|e| statement_error(e, "reading catch-up rates"))?;
    rows.iter()
        .map(|row| {
            let name: String = row.column(0).map_err(decode_error)?;
            let applied: i64 = row.column(1).map_err(decode_error)?;
            let started: OffsetDateTime = row.column(2).map_err(decode_error)?;
            let rate: Option<f64> = row.column(3).map_err(decode_error)?;
            Ok(Throughput::new(
                stored_name(name)?,
                rate,
                stored_count(applied)?,
                started,
            ))
        })
        .collect()
}
