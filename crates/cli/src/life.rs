//! `lockstep perspectives rebuild` and `retire`: a perspective's whole life from the
//! operator's side (ADR 0016), through the library's `lockstep_worker::life`. Both name a
//! perspective; one that is not registered is refused (exit 1, outcome `not_registered`).
//!
//! - `rebuild NAME`: a rewind from the start is requested on every pair at once; the workers
//!   of every instance carry them out pair by pair under their rewind leases, and each pair
//!   serves its old state until its rewind commits. `perspectives status` shows the rewinds
//!   pending and the running ones' progress.
//! - `retire NAME --keep-states|--drop-states`: appends stop enqueueing work for it, its queued
//!   work is deleted, its states are kept (a later registration continues from the cursors) or
//!   deleted. Live worker instances that still run it are named in a warning (and in the JSON,
//!   `live_workers`): a worker registers its perspectives when it starts, so the perspective
//!   comes back as soon as one of them restarts, until they are deployed without it.

use lockstep_core::perspective_store::prelude::*;
use std::process::ExitCode;

use anyhow::Result;
use lockstep_core::{PerspectiveName, Rebuild, RetireStates, Retired, TransactionSource};
use lockstep_pg::PgDatabase;
use lockstep_pg_store::PgPerspectiveStore;
use serde_json::json;

use crate::ops::outcome as finish;
use crate::pg::{DbUrl, explain};

fn not_registered(json: bool, url: &DbUrl, name: &PerspectiveName) -> ExitCode {
    finish(
        json,
        false,
        &json!({ "perspective": name.as_str(), "outcome": "not_registered" }),
        &format!(
            "perspective `{name}` is not registered in {}: nothing was changed \
             (`lockstep perspectives status` lists the registered ones)",
            url.database()
        ),
    )
}

/// `lockstep perspectives rebuild NAME`.
pub(crate) async fn rebuild(
    db: &PgDatabase,
    url: &DbUrl,
    name: &PerspectiveName,
    json: bool,
) -> Result<ExitCode> {
    let store = PgPerspectiveStore::new();
    let outcome = lockstep_worker::life::rebuild(db, &store, name)
        .await
        .map_err(explain)?;
    Ok(match outcome {
        Rebuild::Requested { pairs } => finish(
            json,
            true,
            &json!({ "perspective": name.as_str(), "outcome": "requested", "pairs": pairs }),
            &format!(
                "rebuild of `{name}` requested: a rewind from the start on each of its {pairs} \
                 pairs; the workers carry them out one by one (each pair serves its old state \
                 until its rewind commits; `lockstep perspectives status` shows the progress)"
            ),
        ),
        _ => not_registered(json, url, name),
    })
}

/// `lockstep perspectives retire NAME --keep-states|--drop-states`.
pub(crate) async fn retire(
    db: &PgDatabase,
    url: &DbUrl,
    name: &PerspectiveName,
    states: RetireStates,
    json: bool,
) -> Result<ExitCode> {
    // Read first: a fleet that cannot be read stops the command before it changes anything.
    let running: Vec<String> = crate::workers::instances(db.pool())
        .await?
        .iter()
        .filter_map(|e| match e {
            lockstep_core::InstanceEntry::Instance(i) if i.is_live() && i.runs(name) => {
                Some(i.announcement.name.clone())
            }
            _ => None,
        })
        .collect();
    let store = PgPerspectiveStore::new();
    let outcome = lockstep_worker::life::retire(db, &store, name, states)
        .await
        .map_err(explain)?;
    let (kept, how) = match states {
        RetireStates::Keep => (
            "kept",
            "kept: registering it again continues from its cursors",
        ),
        RetireStates::Drop => (
            "dropped",
            "deleted: registering it again starts from the first event",
        ),
    };
    Ok(match outcome {
        Retired::Retired {
            work_removed,
            pairs,
        } => {
            if !running.is_empty() {
                let names: Vec<String> = running
                    .iter()
                    .map(|n| format!("{:?}", n.as_str()))
                    .collect();
                eprintln!(
                    "warning: {} live worker instances still run `{name}` ({}): a worker \
                     registers its perspectives when it starts, so `{name}` is registered again \
                     as soon as one of them restarts; deploy the workers without it \
                     (`lockstep workers` lists them)",
                    running.len(),
                    names.join(", ")
                );
            }
            finish(
                json,
                true,
                &json!({
                    "perspective": name.as_str(), "outcome": "retired", "states": kept,
                    "work_removed": work_removed, "pairs": pairs, "live_workers": running,
                }),
                &format!(
                    "`{name}` retired: appends enqueue no more work for it, {work_removed} queued \
                 work items deleted, the states of its {pairs} pairs {how}"
                ),
            )
        }
        _ => not_registered(json, url, name),
    })
}

/// The running rewinds of `perspective` among `progress`, as `perspectives status --json`
/// shows them: stream, holder, replayed, to replay, percent, started at, seconds running and
/// since the last report (on the database's clock, as the read returned it).
pub(crate) fn progress_json(
    progress: &[lockstep_core::RewindProgress],
    perspective: &PerspectiveName,
) -> serde_json::Value {
    let secs = |d: time::Duration| d.as_seconds_f64().max(0.0);
    progress
        .iter()
        .filter(|r| &r.pair.perspective == perspective)
        .map(|r| {
            let now = r.read_at.unwrap_or_else(time::OffsetDateTime::now_utc);
            let percent = if r.to_replay == 0 {
                100.0
            } else {
                r.replayed as f64 * 100.0 / r.to_replay as f64
            };
            json!({
                "stream_id": r.pair.stream_id.to_string(),
                "holder": r.holder.map(|h| h.to_string()),
                "replayed": r.replayed,
                "to_replay": r.to_replay,
                "percent": (percent * 10.0).round() / 10.0,
                "started_at": r.started_at.format(&time::format_description::well_known::Rfc3339).ok(),
                "running_s": secs(now - r.started_at),
                "reported_s_ago": secs(now - r.updated_at),
            })
        })
        .collect()
}

/// One running rewind of [`progress_json`] as a line of text.
pub(crate) fn progress_line(r: &serde_json::Value) -> String {
    format!(
        "rewinding {}: {} of {} events ({}%), running {:.1} s{}",
        r["stream_id"].as_str().unwrap_or(""),
        r["replayed"],
        r["to_replay"],
        r["percent"],
        r["running_s"].as_f64().unwrap_or(0.0),
        r["holder"]
            .as_str()
            .map_or(String::new(), |h| format!(", by {h}"))
    )
}

/// `perspective`'s catch-up rate (events applied per second, every instance together), rounded
/// to a tenth; `null` when none was measured.
pub(crate) fn rate_of(
    rates: &[lockstep_core::Throughput],
    perspective: &PerspectiveName,
) -> serde_json::Value {
    rates
        .iter()
        .find(|t| &t.perspective == perspective)
        .and_then(|t| t.events_per_second)
        .map_or(serde_json::Value::Null, |r| {
            json!((r * 10.0).round() / 10.0)
        })
}

/// How many seconds emptying `pending` events takes at `perspective`'s catch-up rate: 0 when
/// nothing is pending, `null` without a rate above 0 (nothing is being applied).
pub(crate) fn time_to_empty(
    rates: &[lockstep_core::Throughput],
    perspective: &PerspectiveName,
    pending: u64,
) -> serde_json::Value {
    if pending == 0 {
        return json!(0.0);
    }
    rates
        .iter()
        .find(|t| &t.perspective == perspective)
        .and_then(|t| t.time_to_empty(pending))
        .map_or(serde_json::Value::Null, |d| {
            json!((d.as_secs_f64() * 10.0).round() / 10.0)
        })
}

/// The perspectives retired with their states kept, by name (for `perspectives status`).
pub(crate) async fn retired(pool: &deadpool_postgres::Pool) -> Result<Vec<String>> {
    let db = PgDatabase::from_pool(pool.clone());
    let store = PgPerspectiveStore::new();
    let tx = db.begin().await.map_err(explain)?;
    let names = store.retired(&tx).await;
    // Read only: a rollback that fails still ends it, and changes nothing.
    crate::pg::rollback(tx, "a read of the retired perspectives").await;
    Ok(names
        .map_err(explain)?
        .into_iter()
        .map(|n| n.as_str().to_owned())
        .collect())
}
