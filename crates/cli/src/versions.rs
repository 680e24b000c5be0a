//! Perspective versions for operators: `lockstep perspectives versions | promote | abandon`,
//! the versions beside `perspectives status` and on the status page, and the checks
//! `status --check` adds for them.
//!
//! A new version of a perspective builds beside the serving one under its own stored name
//! (`Statement@v2`), so its progress is that stored name's row of `perspectives status`. The
//! commands go through `lockstep_worker::versions`: `promote` records a request that a worker
//! running the version performs (it has the table perspective's hook), then polls until the
//! version serves; `abandon` stops a version that does not serve.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use lockstep_core::{
    PerspectiveName, PerspectiveVersion, PreviousVersion, Promotion, RetireStates, VersionStatus,
};
use lockstep_pg::PgDatabase;
use lockstep_pg_store::PgPerspectiveStore;
use lockstep_worker::VersionError;
use serde_json::{Value, json};

use crate::ops::outcome as finish;
use crate::pg::explain;
use crate::say;

/// How long a promotion may stay requested and not performed before `status --check` reports
/// it (its default) and the status page shows it in red.
pub(crate) const PROMOTION_WAIT_S: f64 = 60.0;

/// How often `promote` looks whether the version serves.
const POLL_EVERY: Duration = Duration::from_millis(200);

/// The database's clock, as seconds since the epoch: request ages are measured on the clock
/// that stamped the requests.
async fn database_now(pool: &deadpool_postgres::Pool) -> Result<f64> {
    let client = pool.get().await.context("checking out a connection")?;
    // Unnamed (one round trip, no prepared statement): works behind a transaction pooler too.
    let row = client
        .query_typed(
            "SELECT extract(epoch FROM clock_timestamp())::float8 AS now",
            &[],
        )
        .await
        .map_err(|e| explain(lockstep_pg::map_error(e, "reading the database clock")))?;
    row.first()
        .context("reading the database clock")?
        .try_get("now")
        .context("reading the database clock")
}

fn rfc3339(at: time::OffsetDateTime) -> Value {
    at.format(&time::format_description::well_known::Rfc3339)
        .map_or(Value::Null, Value::String)
}

/// What a version's promotion does to the version it replaces, in words.
fn previous_words(previous: PreviousVersion) -> &'static str {
    match previous {
        PreviousVersion::Keep => "previous kept",
        PreviousVersion::Retire(RetireStates::Keep) => "previous retired",
        PreviousVersion::Retire(RetireStates::Drop) => "previous retired, states dropped",
    }
}

fn promotion_word(promotion: Promotion) -> &'static str {
    match promotion {
        Promotion::Automatic => "automatic",
        Promotion::Manual => "manual",
    }
}

/// One version as JSON (`perspectives versions --json`, the status page): its row, and for a
/// live version its progress from `status` (the `perspectives status` row of its stored
/// name), with `now` the database's clock.
fn version_json(v: &PerspectiveVersion, status: &[Value], now: f64) -> Value {
    let requested = v.promotion_requested.map(|r| {
        let at = r.requested_at.unix_timestamp_nanos() as f64 / 1e9;
        json!({
            "requested_at": rfc3339(r.requested_at),
            "requested_s_ago": ((now - at).max(0.0) * 10.0).round() / 10.0,
            "force": r.force,
        })
    });
    let progress = if v.status.is_live() {
        status
            .iter()
            .find(|p| p["perspective"] == v.stored_name.as_str())
            .map_or_else(
                || {
                    // Live but not registered (yet): no worker running it has started.
                    json!({
                        "pairs": 0, "pending_events": 0, "lag_s": 0.0, "rewinds_pending": 0,
                        "parked": 0, "in_error": 0, "live_workers": [], "registered": false,
                    })
                },
                |p| {
                    json!({
                        "pairs": p["pairs"],
                        "pending_events": p["pending_events"],
                        "lag_s": p["lag_s"],
                        "rewinds_pending": p["rewinds_pending"],
                        "parked": p["parked"],
                        "in_error": p["in_error"],
                        "live_workers": p["live_workers"],
                        "registered": true,
                    })
                },
            )
    } else {
        Value::Null
    };
    json!({
        "perspective": v.perspective.as_str(),
        "version": v.version,
        "stored_name": v.stored_name.as_str(),
        "status": v.status.as_str(),
        "serving": v.status == VersionStatus::Serving,
        "promotion": promotion_word(v.policy.promotion),
        "previous": v.policy.previous.as_str(),
        "promotion_requested": requested,
        "declared_at": rfc3339(v.declared_at),
        "changed_at": rfc3339(v.changed_at),
        "progress": progress,
    })
}

/// Every version of `perspective` (every perspective's when `None`), as stored.
async fn read_versions(
    db: &PgDatabase,
    perspective: Option<&PerspectiveName>,
) -> Result<Vec<PerspectiveVersion>> {
    lockstep_worker::versions::versions(db, &PgPerspectiveStore::new(), perspective)
        .await
        .map_err(explain)
}

/// Every version of `perspective` (every perspective's when `None`) as JSON rows, their
/// progress taken from `status` (the `perspectives status` rows).
pub(crate) async fn version_rows(
    pool: &deadpool_postgres::Pool,
    perspective: Option<&PerspectiveName>,
    status: &[Value],
) -> Result<Vec<Value>> {
    let db = PgDatabase::from_pool(pool.clone());
    let rows = read_versions(&db, perspective).await?;
    let now = database_now(pool).await?;
    Ok(rows.iter().map(|v| version_json(v, status, now)).collect())
}

/// Gives each `perspectives status` row its `version` (`null` for a name with no version
/// recorded): the perspective, the version, its status and whether its promotion was
/// requested.
pub(crate) fn mark_versions(status: &mut [Value], versions: &[Value]) {
    for row in status {
        let version = versions
            .iter()
            .find(|v| v["stored_name"] == row["perspective"])
            .map_or(Value::Null, |v| {
                json!({
                    "perspective": v["perspective"],
                    "version": v["version"],
                    "status": v["status"],
                    "promotion_requested": v["promotion_requested"],
                })
            });
        if let Some(row) = row.as_object_mut() {
            row.insert("version".to_owned(), version);
        }
    }
}

/// Why a requested promotion is not performed yet, from the version's progress.
fn why_not_performed(v: &Value) -> String {
    let p = &v["progress"];
    let stored = v["stored_name"].as_str().unwrap_or("");
    let count = |key: &str| p[key].as_u64().unwrap_or(0);
    let mut why = Vec::new();
    if p["live_workers"].as_array().is_some_and(Vec::is_empty) {
        why.push(format!(
            "no live worker runs {stored} (only a worker running this version performs it)"
        ));
    }
    if count("parked") > 0 {
        why.push(format!(
            "{} parked pairs block it (`lockstep perspectives parked --perspective {stored}`)",
            count("parked")
        ));
    }
    if count("pending_events") > 0 || count("rewinds_pending") > 0 {
        why.push(format!(
            "it has not caught up: {} events pending (lag {:.1} s), {} rewinds pending",
            count("pending_events"),
            p["lag_s"].as_f64().unwrap_or(0.0),
            count("rewinds_pending")
        ));
    }
    if why.is_empty() {
        "a worker running it performs it at its next check".to_owned()
    } else {
        why.join("; ")
    }
}

/// The checks `status --check` adds for versions: a promotion requested more than
/// `max_wait_s` ago and still not performed. (Parked pairs of a building version fail the
/// `parked` check of its stored name like any parked pairs; [`parked_note`] says that they
/// block the promotion.)
pub(crate) fn failed_checks(versions: &[Value], max_wait_s: f64) -> Vec<Value> {
    versions
        .iter()
        .filter(|v| v["progress"].is_object())
        .filter_map(|v| {
            let waited = v["promotion_requested"]["requested_s_ago"].as_f64()?;
            (waited > max_wait_s).then(|| {
                json!({
                    "perspective": v["stored_name"],
                    "check": "promotion_pending_s",
                    "value": waited,
                    "limit": max_wait_s,
                    "why": format!(
                        "the promotion of {} version {} was requested {waited:.0} s ago and is \
                         not performed: {}",
                        v["perspective"].as_str().unwrap_or(""),
                        v["version"],
                        why_not_performed(v)
                    ),
                })
            })
        })
        .collect()
}

/// For a failed `parked` check of a version that does not serve: that the parked pairs block
/// its promotion (a promotion waits until the version has applied every event).
pub(crate) fn parked_note(status_row: &Value) -> Option<String> {
    let v = &status_row["version"];
    let status = v["status"].as_str()?;
    (status != "serving").then(|| {
        format!(
            "{} version {} is {status}: its parked pairs block its promotion",
            v["perspective"].as_str().unwrap_or(""),
            v["version"]
        )
    })
}

/// The versions of the perspectives that have more than one, or a version that does not serve,
/// as lines of text (for `perspectives status`).
pub(crate) fn summary_lines(versions: &[Value]) -> Vec<String> {
    let mut names: Vec<&str> = versions
        .iter()
        .filter_map(|v| v["perspective"].as_str())
        .collect();
    names.dedup();
    let mut lines = Vec::new();
    for name in names {
        let of: Vec<&Value> = versions
            .iter()
            .filter(|v| v["perspective"] == name)
            .collect();
        if of.len() < 2 && of.iter().all(|v| v["serving"] == true) {
            continue;
        }
        let parts: Vec<String> = of.iter().map(|v| short(v)).collect();
        lines.push(format!("versions of {name}: {}", parts.join("; ")));
    }
    lines
}

/// One version in a few words: `v2 building (Statement@v2): 3 pending, lag 1.2 s, 0 parked,
/// promotion requested 4 s ago`.
fn short(v: &Value) -> String {
    let status = v["status"].as_str().unwrap_or("");
    let mut text = format!(
        "v{} {} ({})",
        v["version"],
        if status == "serving" {
            "SERVING"
        } else {
            status
        },
        v["stored_name"].as_str().unwrap_or("")
    );
    let p = &v["progress"];
    if p.is_object() && status != "serving" {
        text.push_str(&format!(
            ": {} pending, lag {:.1} s, {} parked",
            p["pending_events"],
            p["lag_s"].as_f64().unwrap_or(0.0),
            p["parked"]
        ));
    }
    if let Some(ago) = v["promotion_requested"]["requested_s_ago"].as_f64() {
        text.push_str(&format!(
            ", promotion requested {ago:.0} s ago{}",
            if v["promotion_requested"]["force"] == true {
                " (forced)"
            } else {
                ""
            }
        ));
    }
    text
}

/// `lockstep perspectives versions [NAME]`.
pub(crate) async fn list(
    pool: &deadpool_postgres::Pool,
    perspective: Option<&PerspectiveName>,
    json: bool,
) -> Result<ExitCode> {
    let status = crate::ops::status_rows(pool).await?;
    let rows = version_rows(pool, perspective, &status).await?;
    if json {
        say!("{}", Value::Array(rows));
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        match perspective {
            Some(name) => say!("no versions of {name} recorded"),
            None => say!(
                "no perspective versions recorded (a worker records the versions it runs when \
                 it starts)"
            ),
        }
        return Ok(ExitCode::SUCCESS);
    }
    say!(
        "  {:<24} {:>7}  {:<9}  {:<28}  {:<34} {:>7} {:>9} {:>9} {:>8} {:>7}  promotion requested",
        "perspective",
        "version",
        "status",
        "stored name",
        "policy",
        "pairs",
        "pending",
        "lag",
        "rewinds",
        "parked",
    );
    for v in &rows {
        let serving = v["serving"] == true;
        let status = v["status"].as_str().unwrap_or("");
        let p = &v["progress"];
        let figure = |key: &str| {
            if p.is_object() {
                p[key].to_string()
            } else {
                "-".to_owned()
            }
        };
        let requested = match v["promotion_requested"]["requested_s_ago"].as_f64() {
            Some(ago) => format!(
                "{ago:.1} s ago{}",
                if v["promotion_requested"]["force"] == true {
                    " (forced)"
                } else {
                    ""
                }
            ),
            None => "-".to_owned(),
        };
        let previous =
            PreviousVersion::parse(v["previous"].as_str().unwrap_or("")).map_or("", previous_words);
        say!(
            "{} {:<24} {:>7}  {:<9}  {:<28}  {:<34} {:>7} {:>9} {:>9} {:>8} {:>7}  {}",
            if serving { "*" } else { " " },
            v["perspective"].as_str().unwrap_or(""),
            format!("v{}", v["version"]),
            if serving {
                "SERVING".to_owned()
            } else {
                status.to_owned()
            },
            v["stored_name"].as_str().unwrap_or(""),
            format!("{}, {previous}", v["promotion"].as_str().unwrap_or("")),
            figure("pairs"),
            figure("pending_events"),
            p["lag_s"]
                .as_f64()
                .map_or_else(|| "-".to_owned(), |lag| format!("{lag:.1}s")),
            figure("rewinds_pending"),
            figure("parked"),
            requested
        );
    }
    say!("* serves: reads by the perspective's name read this version");
    Ok(ExitCode::SUCCESS)
}

fn doc(name: &PerspectiveName, version: u32, outcome: &str, extra: Value) -> Value {
    let mut doc = json!({ "perspective": name.as_str(), "version": version, "outcome": outcome });
    if let (Some(doc), Value::Object(extra)) = (doc.as_object_mut(), extra) {
        doc.extend(extra);
    }
    doc
}

/// A refusal of `lockstep_worker::versions` (nothing was changed) as an outcome, exit 1; a
/// store error is the command's error.
fn refused(
    json: bool,
    name: &PerspectiveName,
    version: u32,
    err: VersionError,
) -> Result<ExitCode> {
    let outcome = match &err {
        VersionError::NoSuchVersion { .. } => "no_such_version",
        VersionError::NotPromotable { .. } => "not_promotable",
        VersionError::Serving { .. } => "serving",
        VersionError::NotCaughtUp { .. } => "not_caught_up",
        VersionError::Store(_) => return Err(explain(into_store_error(err))),
        _ => "refused",
    };
    let message = format!(
        "{err}; nothing was changed{}",
        match outcome {
            "no_such_version" => " (`lockstep perspectives versions` lists them)",
            _ => "",
        }
    );
    Ok(finish(
        json,
        false,
        &doc(name, version, outcome, json!({ "error": err.to_string() })),
        &message,
    ))
}

fn into_store_error(err: VersionError) -> lockstep_core::Error {
    match err {
        VersionError::Store(e) => e,
        other => lockstep_core::Error::new(lockstep_core::ErrorKind::Backend, other.to_string()),
    }
}

/// `lockstep perspectives promote NAME VERSION [--force] [--wait SECS]`: records the request,
/// then polls until the version serves, for at most `wait` (not at all when zero).
pub(crate) async fn promote(
    db: &PgDatabase,
    name: &PerspectiveName,
    version: u32,
    force: bool,
    wait: Duration,
    json: bool,
) -> Result<ExitCode> {
    let store = PgPerspectiveStore::new();
    if let Err(err) =
        lockstep_worker::versions::request_promotion(db, &store, name, version, force).await
    {
        return refused(json, name, version, err);
    }
    let forced = if force { " (forced)" } else { "" };
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let rows = read_versions(db, Some(name)).await?;
        let row = rows.iter().find(|v| v.version == version);
        match row.map(|v| v.status) {
            Some(VersionStatus::Serving) => {
                return Ok(finish(
                    json,
                    true,
                    &doc(name, version, "serving", json!({ "force": force })),
                    &format!(
                        "{name} version {version} serves{forced}: reads of {name} read it                          (`lockstep perspectives versions {name}` shows what became of the                          previous version)"
                    ),
                ));
            }
            Some(status) if !status.is_live() => {
                return Ok(finish(
                    json,
                    false,
                    &doc(
                        name,
                        version,
                        "not_promotable",
                        json!({ "status": status.as_str() }),
                    ),
                    &format!(
                        "{name} version {version} was {status} while its promotion waited: it \
                         cannot serve"
                    ),
                ));
            }
            None => {
                return Ok(finish(
                    json,
                    false,
                    &doc(name, version, "no_such_version", json!({})),
                    &format!("{name} has no version {version} any more"),
                ));
            }
            Some(_) => {}
        }
        if wait.is_zero() {
            return Ok(finish(
                json,
                true,
                &doc(name, version, "requested", json!({ "force": force })),
                &format!(
                    "promotion of {name} version {version} requested{forced}: a worker running \
                     that version performs it once it has caught up (`lockstep perspectives \
                     versions {name}` shows when it serves)"
                ),
            ));
        }
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(POLL_EVERY.min(deadline - tokio::time::Instant::now())).await;
    }
    // Out of time: say what is pending and whether the request is still recorded.
    let status = crate::ops::status_rows(db.pool()).await?;
    let rows = version_rows(db.pool(), Some(name), &status).await?;
    let row = rows
        .iter()
        .find(|v| v["version"] == version)
        .cloned()
        .unwrap_or(Value::Null);
    let recorded = row["promotion_requested"].is_object();
    let why = why_not_performed(&row);
    Ok(finish(
        json,
        false,
        &doc(
            name,
            version,
            "not_performed",
            json!({
                "waited_s": wait.as_secs_f64(),
                "request_recorded": recorded,
                "status": row["status"],
                "progress": row["progress"],
                "why": why,
            }),
        ),
        &format!(
            "{name} version {version} does not serve after {} s: {why}. {}",
            wait.as_secs(),
            if recorded {
                "The request is still recorded: a worker running the version performs it once \
                 it can (`lockstep perspectives versions` shows it; `abandon` drops the version)"
            } else {
                "The request is no longer recorded: request it again"
            }
        ),
    ))
}

/// `lockstep perspectives abandon NAME VERSION [--keep-states]`.
pub(crate) async fn abandon(
    db: &PgDatabase,
    name: &PerspectiveName,
    version: u32,
    states: RetireStates,
    json: bool,
) -> Result<ExitCode> {
    let before = read_versions(db, Some(name))
        .await?
        .into_iter()
        .find(|v| v.version == version)
        .map(|v| v.status);
    let store = PgPerspectiveStore::new();
    let status = match lockstep_worker::versions::abandon(db, &store, name, version, states).await {
        Ok(status) => status,
        Err(err) => return refused(json, name, version, err),
    };
    let kept = match states {
        RetireStates::Keep => "kept",
        RetireStates::Drop => "dropped",
    };
    if before.is_some_and(|s| !s.is_live()) {
        return Ok(finish(
            json,
            true,
            &doc(
                name,
                version,
                &format!("already_{status}"),
                json!({ "status": status.as_str() }),
            ),
            &format!("{name} version {version} was {status} already: nothing was changed"),
        ));
    }
    Ok(finish(
        json,
        true,
        &doc(
            name,
            version,
            status.as_str(),
            json!({ "status": status.as_str(), "states": kept }),
        ),
        &format!(
            "{name} version {version} is {status}: its work stopped, its states are {kept}; a \
             worker still running its code leaves it {status} (deploy the next version instead)"
        ),
    ))
}
