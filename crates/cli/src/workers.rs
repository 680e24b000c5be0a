//! The fleet for operators (`docs/adr/0015-worker-fleet.md`): `lockstep workers`, the holder
//! names of stream leases, and which perspectives no live worker runs — for
//! `perspectives status` (and its `--check --max-unserved`) and the status page.

use std::process::ExitCode;

use anyhow::Result;
use lockstep_core::{StreamLockAdmin, WorkerInstance};
use serde_json::{Value, json};

use crate::ops::locker;
use crate::pg::{DbUrl, explain};
use crate::say;

/// Every announced instance, live or stale.
pub(crate) async fn instances(pool: &deadpool_postgres::Pool) -> Result<Vec<WorkerInstance>> {
    locker(pool).list_instances().await.map_err(explain)
}

/// One instance as JSON (`lockstep workers --json`, the page), with how many of the `leases`
/// rows it holds.
pub(crate) fn instance_json(i: &WorkerInstance, leases: &[Value]) -> Value {
    let a = &i.announcement;
    let id = a.instance.to_string();
    let held = leases
        .iter()
        .filter(|l| l["holder"].as_str() == Some(id.as_str()) && l["status"] == "held")
        .count();
    json!({
        "instance_id": id,
        "name": a.name,
        "host": a.host,
        "pid": a.pid,
        "version": a.version,
        "perspectives": a.perspectives.iter().map(|p| p.as_str()).collect::<Vec<_>>(),
        "started_at": i.started_at.to_string(),
        "last_seen_at": i.last_seen_at.to_string(),
        "last_seen_s_ago": i.since_seen.as_secs_f64(),
        "stale_after_s": i.stale_after.as_secs_f64(),
        "state": i.state.as_str(),
        "leases_held": held,
    })
}

/// Adds `holder_name` (the holder's announced name, `null` when it is not announced) to lease
/// rows.
pub(crate) fn name_holders(leases: &mut [Value], instances: &[WorkerInstance]) {
    for lease in leases {
        let name = lease["holder"].as_str().and_then(|holder| {
            instances
                .iter()
                .find(|i| i.announcement.instance.to_string() == holder)
                .map(|i| i.announcement.name.clone())
        });
        if let Some(lease) = lease.as_object_mut()
            && lease.contains_key("holder")
        {
            lease.insert("holder_name".to_owned(), json!(name));
        }
    }
}

/// Adds to each perspective row (of `status_rows`) `live_workers` (the names of the live
/// instances that run it) and `unserved` (it has pending work and no live instance runs it).
pub(crate) fn mark_served(perspectives: &mut [Value], instances: &[WorkerInstance]) {
    for p in perspectives {
        let name = p["perspective"].as_str().unwrap_or("").to_owned();
        let live: Vec<&str> = instances
            .iter()
            .filter(|i| i.is_live())
            .filter(|i| {
                i.announcement
                    .perspectives
                    .iter()
                    .any(|n| n.as_str() == name)
            })
            .map(|i| i.announcement.name.as_str())
            .collect();
        let unserved = live.is_empty() && p["pending_events"].as_u64().unwrap_or(0) > 0;
        if let Some(p) = p.as_object_mut() {
            p.insert("live_workers".to_owned(), json!(live));
            p.insert("unserved".to_owned(), json!(unserved));
        }
    }
}

/// `lockstep workers`: the fleet, live and stale.
pub(crate) async fn workers(url: &DbUrl, json: bool) -> Result<ExitCode> {
    let db = url.handle(2).await?;
    let pool = db.pool().clone();
    let listed = instances(&pool).await?;
    let leases = crate::ops::lease_rows(&pool).await?;
    let rows: Vec<Value> = listed.iter().map(|i| instance_json(i, &leases)).collect();
    if json {
        say!("{}", Value::Array(rows));
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        say!(
            "no worker instances announced (a worker announces itself while it runs with a \
             stream locker)"
        );
        return Ok(ExitCode::SUCCESS);
    }
    say!(
        "{:<24} {:<36} {:<20} {:>8} {:<16} {:>6} {:>10}  {:<5}  perspectives",
        "name",
        "instance",
        "host",
        "pid",
        "version",
        "leases",
        "last seen",
        "state"
    );
    for r in &rows {
        let perspectives: Vec<&str> = r["perspectives"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        say!(
            "{:<24} {:<36} {:<20} {:>8} {:<16} {:>6} {:>8.1}s ago  {:<5}  {}",
            // Announced by the instance: printed escaped, never raw control characters.
            r["name"].as_str().unwrap_or("").escape_debug().to_string(),
            r["instance_id"].as_str().unwrap_or(""),
            r["host"].as_str().unwrap_or("").escape_debug().to_string(),
            r["pid"],
            r["version"]
                .as_str()
                .unwrap_or("")
                .escape_debug()
                .to_string(),
            r["leases_held"],
            r["last_seen_s_ago"].as_f64().unwrap_or(0.0),
            r["state"].as_str().unwrap_or(""),
            perspectives.join(", ")
        );
    }
    let live = rows.iter().filter(|r| r["state"] == "live").count();
    say!("{live} live, {} stale", rows.len() - live);
    Ok(ExitCode::SUCCESS)
}
