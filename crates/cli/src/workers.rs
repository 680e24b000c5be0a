//! The fleet for operators (`docs/adr/0015-worker-fleet.md`): `lockstep workers`, the holder
//! names of stream leases, and which perspectives no live worker runs — for
//! `perspectives status` (and its `--check --max-unserved`) and the status page. A fleet row
//! lockstep cannot read (written by hand) is listed as unreadable, with its id, beside the
//! others; it counts as no live worker.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use lockstep_core::{FleetAdmin, InstanceEntry, InstanceId, WorkerInstance};
use lockstep_pg_stream::ForgetInstance;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::ops::locker;
use crate::pg::{DbUrl, explain};
use crate::{bad_argument, say};

/// `lockstep workers …`.
#[derive(Debug, Default, clap::Subcommand)]
pub(crate) enum WorkersCommand {
    /// Lists the worker instances, live, stale or unreadable (the default).
    #[default]
    #[command(after_help = crate::EXIT_CODES)]
    List,
    /// Forgets one instance that is not live (it died without departing), at once instead of
    /// after a day. A live instance is refused (exit 1): it would announce itself again at
    /// its next keepalive; stop it first.
    #[command(after_help = crate::EXIT_CODES)]
    Forget {
        /// The instance id (as `lockstep workers` lists it).
        instance: Uuid,
    },
    /// Forgets every stale instance not seen for at least --older-than (a live one never).
    #[command(after_help = crate::EXIT_CODES)]
    Prune {
        /// How long an instance has not been seen: a number with a unit, s, m, h or d (e.g.
        /// 90s, 30m, 12h, 1d); a bare number is seconds.
        #[arg(long, value_name = "DURATION")]
        older_than: String,
    },
}

/// `lockstep workers [list|forget|prune]`.
pub(crate) async fn run(url: &DbUrl, command: WorkersCommand, json: bool) -> Result<ExitCode> {
    match command {
        WorkersCommand::List => workers(url, json).await,
        WorkersCommand::Forget { instance } => {
            let instance = InstanceId::from_uuid(instance)
                .map_err(|e| bad_argument(format!("invalid instance id: {e}")))?;
            forget(url, instance, json).await
        }
        WorkersCommand::Prune { older_than } => {
            let unseen_for = duration(&older_than).map_err(|why| {
                bad_argument(format!(
                    "--older-than {older_than:?}: {why}; expected a number with a unit, s, m, \
                     h or d (e.g. 90s, 30m, 12h, 1d)"
                ))
            })?;
            prune(url, unseen_for, json).await
        }
    }
}

/// `text` as a duration: a number of seconds, minutes, hours or days (`90s`, `30m`, `12h`,
/// `1.5d`); a bare number is seconds. Negative, not finite or beyond 100 years is refused.
fn duration(text: &str) -> std::result::Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| c.is_ascii_alphabetic()) {
        Some(at) => text.split_at(at),
        None => (text, "s"),
    };
    let per_unit = match unit.trim() {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        other => return Err(format!("unknown unit {other:?}")),
    };
    let number: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{:?} is not a number", number.trim()))?;
    let seconds = number * per_unit;
    if !(seconds.is_finite() && (0.0..=100.0 * 365.0 * 86_400.0).contains(&seconds)) {
        return Err("not a duration between 0 and 100 years".to_owned());
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// `lockstep workers forget INSTANCE`: exit 0 forgotten, 1 live (kept) or not announced.
async fn forget(url: &DbUrl, instance: InstanceId, json: bool) -> Result<ExitCode> {
    let db = url.handle(1).await?;
    let outcome = locker(db.pool())
        .forget_instance(instance)
        .await
        .map_err(explain)?;
    let (done, word, sentence) = match outcome {
        ForgetInstance::Forgotten => (
            true,
            "forgotten",
            format!("worker instance {instance} forgotten"),
        ),
        ForgetInstance::Live => (
            false,
            "live",
            format!(
                "worker instance {instance} is live: nothing was changed (a live instance \
                 announces itself again at its next keepalive; stop it first, then forget it \
                 once `lockstep workers` lists it stale)"
            ),
        ),
        _ => (
            false,
            "not_announced",
            format!(
                "no worker instance {instance} is announced in {}: nothing was changed \
                 (`lockstep workers` lists them)",
                url.database()
            ),
        ),
    };
    if json {
        say!(
            "{}",
            json!({ "instance_id": instance.to_string(), "outcome": word })
        );
    } else if done {
        say!("{sentence}");
    } else {
        eprintln!("{sentence}");
    }
    Ok(if done {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `lockstep workers prune --older-than D`: exit 0, with the instances forgotten.
async fn prune(url: &DbUrl, unseen_for: Duration, json: bool) -> Result<ExitCode> {
    let db = url.handle(1).await?;
    let forgotten = locker(db.pool())
        .forget_stale_instances(unseen_for)
        .await
        .map_err(explain)?;
    if json {
        say!(
            "{}",
            json!({
                "older_than_s": unseen_for.as_secs_f64(),
                "forgotten": forgotten
                    .iter()
                    .map(|(id, name)| json!({ "instance_id": id.to_string(), "name": name }))
                    .collect::<Vec<_>>(),
            })
        );
    } else {
        for (id, name) in &forgotten {
            // Written by the instance: printed escaped, never raw control characters.
            say!("forgot {id}  {}", name.escape_debug());
        }
        say!(
            "{} stale worker instances not seen for {:.0} s or more forgotten",
            forgotten.len(),
            unseen_for.as_secs_f64()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Every announced instance, live or stale, and every fleet row that cannot be read.
pub(crate) async fn instances(pool: &deadpool_postgres::Pool) -> Result<Vec<InstanceEntry>> {
    locker(pool).list_instance_entries().await.map_err(explain)
}

/// The instances of `entries` that can be read.
pub(crate) fn readable(entries: &[InstanceEntry]) -> impl Iterator<Item = &WorkerInstance> {
    entries.iter().filter_map(|e| match e {
        InstanceEntry::Instance(i) => Some(i),
        InstanceEntry::Unreadable(_) => None,
    })
}

/// One fleet row as JSON (`lockstep workers --json`, the page): an instance with how many of
/// the `leases` rows it holds, or an unreadable row as `instance_id`, `name` (as stored, or
/// `null`), `"state": "unreadable"` and `error`.
pub(crate) fn entry_json(entry: &InstanceEntry, leases: &[Value]) -> Value {
    match entry {
        InstanceEntry::Instance(i) => instance_json(i, leases),
        InstanceEntry::Unreadable(u) => json!({
            "instance_id": u.instance_id.to_string(),
            "name": u.name,
            "state": "unreadable",
            "error": u.problem,
        }),
    }
}

/// One instance as JSON, with how many of the `leases` rows it holds.
fn instance_json(i: &WorkerInstance, leases: &[Value]) -> Value {
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
pub(crate) fn name_holders(leases: &mut [Value], instances: &[InstanceEntry]) {
    for lease in leases {
        let name = lease["holder"].as_str().and_then(|holder| {
            readable(instances)
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
pub(crate) fn mark_served(perspectives: &mut [Value], instances: &[InstanceEntry]) {
    for p in perspectives {
        let name = p["perspective"].as_str().unwrap_or("").to_owned();
        let live: Vec<&str> = readable(instances)
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
async fn workers(url: &DbUrl, json: bool) -> Result<ExitCode> {
    let db = url.handle(2).await?;
    let pool = db.pool().clone();
    let listed = instances(&pool).await?;
    let leases = crate::ops::lease_rows(&pool).await?;
    let rows: Vec<Value> = listed.iter().map(|e| entry_json(e, &leases)).collect();
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
        // Announced by the instance (or written by hand): printed escaped, never raw control
        // characters.
        let shown = |key: &str| r[key].as_str().unwrap_or("").escape_debug().to_string();
        if r["state"] == "unreadable" {
            say!(
                "{:<24} {:<36} unreadable: {}",
                shown("name"),
                r["instance_id"].as_str().unwrap_or(""),
                shown("error")
            );
            continue;
        }
        let perspectives: Vec<&str> = r["perspectives"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        say!(
            "{:<24} {:<36} {:<20} {:>8} {:<16} {:>6} {:>8.1}s ago  {:<5}  {}",
            shown("name"),
            r["instance_id"].as_str().unwrap_or(""),
            shown("host"),
            r["pid"],
            shown("version"),
            r["leases_held"],
            r["last_seen_s_ago"].as_f64().unwrap_or(0.0),
            r["state"].as_str().unwrap_or(""),
            perspectives.join(", ")
        );
    }
    let count = |state: &str| rows.iter().filter(|r| r["state"] == state).count();
    let unreadable = count("unreadable");
    say!(
        "{} live, {} stale{}",
        count("live"),
        count("stale"),
        if unreadable > 0 {
            format!(", {unreadable} unreadable")
        } else {
            String::new()
        }
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_a_unit_or_are_seconds() {
        assert_eq!(duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(duration(" 12h "), Ok(Duration::from_secs(12 * 3600)));
        assert_eq!(duration("1.5d"), Ok(Duration::from_secs(36 * 3600)));
        assert_eq!(duration("0s"), Ok(Duration::ZERO));
        for bad in ["", "h", "-1h", "1w", "1 day", "NaNs", "inf", "1e30d"] {
            assert!(duration(bad).is_err(), "{bad:?} is refused");
        }
    }
}
