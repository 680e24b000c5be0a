//! The operations on a lockstep database: `migrate`, `locks …`, `perspectives …`.
//! Everything a script reads has `--json`.

use lockstep_core::Pair;
use lockstep_core::perspective_store::prelude::*;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Subcommand;
use lockstep_core::{
    ErrorKind, InstanceId, LeaseEntry, LeaseStatus, LockReason, PerspectiveName, ReleaseOutcome,
    StreamId, StreamLockAdmin, StreamLockOptions, StreamLocker, TransactionSource, advisory_key,
};
use lockstep_pg::PgDatabase;
use lockstep_pg::migrate::MIGRATION_LOCK_KEY;
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_worker::{LeaseKeeper, Leased};
use serde_json::json;
use uuid::Uuid;

use crate::pg::{DbUrl, explain};
use crate::{bad_argument, say};
use lockstep_core::Transaction as _;

/// `lockstep locks …`
#[derive(Debug, Subcommand)]
pub(crate) enum LocksCommand {
    /// Lists stream leases: stream, perspective, holder, reason, epoch, how long held and time
    /// left on the database clock, held or expired.
    #[command(after_help = crate::EXIT_CODES)]
    List {
        /// Only leases of this perspective.
        #[arg(long)]
        perspective: Option<String>,
        /// Only leases held by this instance id.
        #[arg(long)]
        holder: Option<Uuid>,
    },
    /// Force-releases a pair's lease whoever holds it (the epoch increases, so the old holder's
    /// renews, releases and fenced commits fail). Refuses without --force.
    #[command(after_help = crate::EXIT_CODES)]
    Release {
        /// The stream id.
        stream: Uuid,
        /// The perspective name.
        perspective: String,
        /// Really take the lease away from its holder.
        #[arg(long)]
        force: bool,
    },
    /// Who holds and who waits for which advisory lock right now.
    #[command(after_help = crate::EXIT_CODES)]
    Advisory {
        /// Name a key you know (e.g. `relay:aggregate:StockItem:{id}`); repeatable.
        #[arg(long = "name")]
        names: Vec<String>,
    },
}

/// `lockstep perspectives …`
#[derive(Debug, Subcommand)]
pub(crate) enum PerspectivesCommand {
    /// Per perspective: pairs, pending work, lag, rewinds pending, pairs in error, backing off,
    /// parked, and the live workers that run it ("no live worker" when none does and work is
    /// pending). With --check, a health check: exit 1 when a threshold is passed.
    #[command(after_help = crate::EXIT_CODES)]
    Status {
        /// Check the thresholds below and exit 1 (listing what failed) when one is passed.
        #[arg(long)]
        check: bool,
        /// --check: the most seconds the oldest pending work of a perspective may wait.
        #[arg(long, default_value_t = 60.0, value_name = "SECONDS")]
        max_lag: f64,
        /// --check: the most pending events a perspective may have (default: no limit).
        #[arg(long, value_name = "EVENTS")]
        max_pending: Option<u64>,
        /// --check: the most pairs of a perspective that may be failing (in error).
        #[arg(long, default_value_t = 0, value_name = "PAIRS")]
        max_in_error: u64,
        /// --check: the most parked pairs a perspective may have.
        #[arg(long, default_value_t = 0, value_name = "PAIRS")]
        max_parked: u64,
        /// --check: the most pending events a perspective that no live worker runs may have
        /// (0: any pending work without a live worker is unhealthy). Workers announce
        /// themselves only when they run with a stream locker.
        #[arg(long, default_value_t = 0, value_name = "EVENTS")]
        max_unserved: u64,
        /// --check: the most seconds a requested promotion of a perspective version may wait
        /// for a worker to perform it (no worker runs the version, or it cannot catch up).
        #[arg(long, default_value_t = crate::versions::PROMOTION_WAIT_S, value_name = "SECONDS")]
        max_promotion_wait: f64,
    },
    /// Every version of every perspective (or of NAME): version, stored name, status (building,
    /// serving, kept, retired, abandoned; the serving one marked `*`), policy (automatic or
    /// manual promotion, what happens to the previous version), a promotion requested and not
    /// performed yet, and each live version's progress (pairs, pending, lag, rewinds, parked).
    #[command(after_help = crate::EXIT_CODES)]
    Versions {
        /// Only this perspective's versions (its name without a version).
        perspective: Option<String>,
    },
    /// Promotes a version to the serving one: records the request, which a worker running that
    /// version performs once the version has caught up (running the table perspective's
    /// hook), and waits until it serves. A rollback is the promotion of the kept previous
    /// version. Exit 1 when the version does not exist, is retired or abandoned, or does not
    /// serve within --wait (the request stays recorded; the message says what is pending).
    #[command(after_help = crate::EXIT_CODES)]
    Promote {
        /// The perspective's name (without a version).
        perspective: String,
        /// The version to promote.
        #[arg(value_parser = clap::value_parser!(u32).range(1..))]
        version: u32,
        /// Promote without waiting for the version to catch up (it may serve stale states).
        #[arg(long)]
        force: bool,
        /// Seconds to wait for the version to serve (0: record the request and return).
        #[arg(long, default_value_t = 30, value_name = "SECONDS",
              value_parser = clap::value_parser!(u64).range(0..=86_400))]
        wait: u64,
    },
    /// Abandons a version that does not serve: its work stops and its states are dropped
    /// (kept with --keep-states); a version that never served is abandoned, a kept one
    /// retired. The serving version is refused (exit 1): promote another first.
    #[command(after_help = crate::EXIT_CODES)]
    Abandon {
        /// The perspective's name (without a version).
        perspective: String,
        /// The version to abandon.
        #[arg(value_parser = clap::value_parser!(u32).range(1..))]
        version: u32,
        /// Keep its cursors, states and snapshots.
        #[arg(long)]
        keep_states: bool,
    },
    /// Requests a rewind of a pair from an event (from the start without --from); a worker
    /// carries it out under a 'rewind' lease.
    #[command(after_help = crate::EXIT_CODES)]
    Rewind {
        /// The stream id.
        stream: Uuid,
        /// The perspective name.
        perspective: String,
        /// Replay from the latest snapshot before this event id.
        #[arg(long)]
        from: Option<Uuid>,
    },
    /// Deletes a pair's state, snapshots and pending work and resets its cursor, under a
    /// 'purge' lease (refused while another instance holds the pair's lease or another
    /// transaction holds its cursor row).
    #[command(after_help = crate::EXIT_CODES)]
    Purge {
        /// The stream id.
        stream: Uuid,
        /// The perspective name.
        perspective: String,
    },
    /// Rebuilds a perspective from the start: requests a rewind from the start on every pair
    /// at once; the workers of every instance carry them out pair by pair under their rewind
    /// leases, each pair serving its old state until its rewind commits.
    #[command(after_help = crate::EXIT_CODES)]
    Rebuild {
        /// The perspective name.
        perspective: String,
    },
    /// Retires a perspective: appends enqueue no more work for it and its queued work is
    /// deleted; its states are kept (registering it again continues from its cursors) or
    /// dropped. A worker that starts with it registers it again.
    #[command(after_help = crate::EXIT_CODES)]
    #[command(group(clap::ArgGroup::new("states").required(true).args(["keep_states", "drop_states"])))]
    Retire {
        /// The perspective name.
        perspective: String,
        /// Keep its cursors, states and snapshots.
        #[arg(long)]
        keep_states: bool,
        /// Delete its cursors, states, snapshots and skipped events.
        #[arg(long)]
        drop_states: bool,
    },
    /// Lists the parked pairs (failed too often in a row; their work keeps queueing): the
    /// failing event, the error, how often.
    #[command(after_help = crate::EXIT_CODES)]
    Parked {
        /// Only this perspective's.
        #[arg(long)]
        perspective: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Retries a parked (or backing-off) pair now: its parking, backoff and failure count are
    /// cleared; the next batch claims it.
    #[command(after_help = crate::EXIT_CODES)]
    Retry {
        /// The stream id.
        stream: Uuid,
        /// The perspective name.
        perspective: String,
    },
    /// Skips one pending event of a pair for good (recorded on the pair, never silent; rewinds
    /// leave it out too) and retries the pair. Without --event: the event its last failure
    /// happened at.
    #[command(after_help = crate::EXIT_CODES)]
    Skip {
        /// The stream id.
        stream: Uuid,
        /// The perspective name.
        perspective: String,
        /// The event to skip (default: the pair's failing event).
        #[arg(long)]
        event: Option<Uuid>,
        /// Why (recorded with the skip).
        #[arg(long, default_value = "skipped by an operator")]
        reason: String,
    },
}

pub(crate) async fn migrate(url: &DbUrl, json: bool) -> Result<ExitCode> {
    let db = url.connected(2).await?;
    let report = db.migrate().await.map_err(explain)?;
    let newer = report.schema_version > lockstep_pg::migrate::SCHEMA_VERSION;
    if json {
        let applied: Vec<_> = report
            .applied
            .iter()
            .map(|(v, n)| json!({ "version": v, "name": n }))
            .collect();
        say!(
            "{}",
            json!({
                "database": url.database(),
                "schema_version": report.schema_version,
                "applied": applied,
                "functions_applied": report.functions_applied,
                "functions_dropped": report.functions_dropped,
            })
        );
    } else if newer {
        say!(
            "{}: the schema is at version {}, installed by a newer lockstep that this build \
             (version {}) runs on; nothing changed.",
            url.database(),
            report.schema_version,
            lockstep_pg::migrate::SCHEMA_VERSION
        );
    } else if report.is_empty() {
        say!(
            "{}: the schema (version {}) is up to date.",
            url.database(),
            report.schema_version
        );
    } else {
        for (version, name) in &report.applied {
            say!("applied V{version} {name}");
        }
        for name in &report.functions_applied {
            say!("applied functions/{name}.sql");
        }
        for signature in &report.functions_dropped {
            say!("dropped {signature}");
        }
        say!(
            "{}: schema version {}: {} migration(s), {} function file(s) applied, {} dropped.",
            url.database(),
            report.schema_version,
            report.applied.len(),
            report.functions_applied.len(),
            report.functions_dropped.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `lockstep migrate --status`: every migration and function file and where it stands, and the
/// schema version, read only; exit 3 when this build cannot run on the database as it is (run
/// `lockstep migrate`, or upgrade the binary).
pub(crate) async fn migration_status(url: &DbUrl, json: bool) -> Result<ExitCode> {
    use lockstep_pg::migrate::{MigrationState, SCHEMA_VERSION};
    let db = url.connected(2).await?;
    let status = db.migration_status().await.map_err(explain)?;
    let state = |state: &MigrationState| match state {
        MigrationState::Applied { applied_on } => ("applied", Some(applied_on.clone())),
        MigrationState::Pending => ("pending", None),
        MigrationState::Changed { applied_on } => ("changed", Some(applied_on.clone())),
        MigrationState::Unknown { applied_on } => ("unknown", Some(applied_on.clone())),
        _ => ("unknown", None),
    };
    let rows: Vec<serde_json::Value> = status
        .migrations
        .iter()
        .map(|m| {
            let (state, applied_on) = state(&m.state);
            json!({ "version": m.version, "name": m.name, "state": state, "applied_on": applied_on })
        })
        .collect();
    let functions: Vec<serde_json::Value> = status
        .functions
        .iter()
        .map(|f| {
            let (state, applied_on) = state(&f.state);
            json!({ "name": f.name, "state": state, "applied_on": applied_on })
        })
        .collect();
    let schema = status.schema.as_ref().map(|s| {
        json!({
            "version": s.version,
            "last_breaking": s.last_breaking,
            "installed_by": s.installed_by,
        })
    });
    let up_to_date = status.is_up_to_date();
    if json {
        say!(
            "{}",
            json!({
                "database": url.database(),
                "up_to_date": up_to_date,
                "build_schema_version": SCHEMA_VERSION,
                "schema": schema,
                "snapshot": status.snapshot,
                "migrations": rows,
                "functions": functions,
            })
        );
    } else {
        say!(
            "{:>7}  {:<8}  {:<45}  applied on",
            "version",
            "state",
            "name"
        );
        for r in &rows {
            say!(
                "{:>7}  {:<8}  {:<45}  {}",
                format!("V{}", r["version"]),
                r["state"].as_str().unwrap_or(""),
                r["name"].as_str().unwrap_or(""),
                r["applied_on"].as_str().unwrap_or("-")
            );
        }
        for f in &functions {
            say!(
                "{:>7}  {:<8}  {:<45}  {}",
                "fn",
                f["state"].as_str().unwrap_or(""),
                f["name"].as_str().unwrap_or(""),
                f["applied_on"].as_str().unwrap_or("-")
            );
        }
        let all = rows.iter().chain(&functions);
        let pending = all.clone().filter(|r| r["state"] == "pending").count();
        let changed = all.filter(|r| r["state"] == "changed").count();
        let installed = match &status.schema {
            Some(s) => format!(
                "schema version {} (this build: {SCHEMA_VERSION})",
                s.version
            ),
            None => "no schema version".to_owned(),
        };
        if status.snapshot {
            say!(
                "{}: the schema of a development snapshot from before 0.1, which cannot be \
                 upgraded: use a new database, or drop lockstep's tables and run `lockstep migrate`",
                url.database()
            );
        } else if up_to_date {
            say!("{}: {installed}, up to date.", url.database());
        } else {
            let advice = match db.check_schema().await {
                Err(e) => e.message().to_owned(),
                Ok(_) => "run `lockstep migrate`".to_owned(),
            };
            say!(
                "{}: {installed}: {pending} pending, {changed} changed since applied: {advice}",
                url.database()
            );
        }
    }
    Ok(if up_to_date {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}

/// The end of a command that acts on one pair, a perspective or a version: its outcome as one
/// JSON document (`--json`) or a sentence (standard output when it was done, standard error when refused), and the exit
/// code (0 done, 1 refused).
pub(crate) fn outcome(json: bool, done: bool, doc: &serde_json::Value, sentence: &str) -> ExitCode {
    if json {
        say!("{doc}");
    } else if done {
        say!("{sentence}");
    } else {
        eprintln!("{sentence}");
    }
    if done {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// A pair's outcome as JSON: `stream_id`, `perspective`, `outcome`, then `extra`'s fields.
fn pair_doc(
    stream: Uuid,
    perspective: &str,
    outcome: &str,
    extra: serde_json::Value,
) -> serde_json::Value {
    let mut doc =
        json!({ "stream_id": stream.to_string(), "perspective": perspective, "outcome": outcome });
    if let (Some(doc), serde_json::Value::Object(extra)) = (doc.as_object_mut(), extra) {
        doc.extend(extra);
    }
    doc
}

/// Whether `name` is a registered perspective in the database behind `source`.
async fn registered(
    source: &PgDatabase,
    store: &PgPerspectiveStore,
    name: &PerspectiveName,
) -> Result<bool> {
    let tx = source.begin().await.map_err(explain)?;
    let registered = store.is_registered(&tx, name).await;
    // Read only: a rollback that fails still ends it, and changes nothing.
    crate::pg::rollback(tx, "a read of the registered perspectives").await;
    registered.map_err(explain)
}

/// The stream event `event` belongs to, if it is an event of the database behind `source`.
async fn stream_of_event(source: &PgDatabase, event: Uuid) -> Result<Option<Uuid>> {
    let tx = source.begin().await.map_err(explain)?;
    let stream = PgEventStore::new(source).stream_of_event(&tx, event).await;
    // Read only: a rollback that fails still ends it, and changes nothing.
    crate::pg::rollback(tx, "a read of an event's stream").await;
    Ok(stream.map_err(explain)?.map(|s| s.as_uuid()))
}

/// How long until `at` (on the database's clock, read against this machine's), as "12.3 s";
/// "0.0 s" when it has passed.
fn time_until(at: time::OffsetDateTime) -> String {
    let left = (at - time::OffsetDateTime::now_utc()).max(time::Duration::ZERO);
    format!("{:.1} s", left.as_seconds_f64())
}

pub(crate) fn locker(pool: &deadpool_postgres::Pool) -> PgStreamLocker {
    PgStreamLocker::from_pool(pool.clone(), StreamLockOptions::default())
}

/// `name` as a perspective name; a bad one is a bad argument (exit 2).
fn perspective(name: &str) -> Result<PerspectiveName> {
    PerspectiveName::new(name).map_err(|e| bad_argument(format!("invalid perspective name: {e}")))
}

pub(crate) async fn locks(url: &DbUrl, cmd: LocksCommand, json: bool) -> Result<ExitCode> {
    // The arguments first: a bad one is refused before anything connects.
    if let LocksCommand::List {
        perspective: Some(name),
        ..
    }
    | LocksCommand::Release {
        perspective: name, ..
    } = &cmd
    {
        perspective(name)?;
    }
    let db = url.handle(2).await?;
    let pool = db.pool().clone();
    match cmd {
        LocksCommand::List {
            perspective,
            holder,
        } => {
            let entries = locker(&pool).list_lease_entries().await.map_err(explain)?;
            // An unreadable row stays in every holder filter: its holder may be what cannot be
            // read.
            let entries: Vec<_> = entries
                .into_iter()
                .filter(|e| {
                    perspective
                        .as_deref()
                        .is_none_or(|p| entry_perspective(e) == p)
                })
                .filter(|e| match (e, holder) {
                    (LeaseEntry::Lease(l), Some(h)) => l.holder.as_uuid() == h,
                    _ => true,
                })
                .collect();
            let instances = crate::workers::instances(&pool).await?;
            let holder_name = |holder: InstanceId| {
                crate::workers::readable(&instances)
                    .find(|i| i.announcement.instance == holder)
                    .map(|i| i.announcement.name.escape_debug().to_string())
            };
            if json {
                let mut rows: Vec<_> = entries.iter().map(entry_json).collect();
                crate::workers::name_holders(&mut rows, &instances);
                say!("{}", serde_json::Value::Array(rows));
            } else if entries.is_empty() {
                say!("no stream leases");
            } else {
                say!(
                    "{:<36}  {:<20}  {:<36}  {:<10}  {:>6}  {:>10}  {:>10}  status",
                    "stream",
                    "perspective",
                    "holder",
                    "reason",
                    "epoch",
                    "held for",
                    "time left"
                );
                for entry in &entries {
                    match entry {
                        LeaseEntry::Lease(l) => say!(
                            "{:<36}  {:<20}  {:<36}  {:<10}  {:>6}  {:>10}  {:>9.1}s  {}{}",
                            l.stream_id.to_string(),
                            l.perspective.as_str(),
                            l.holder.to_string(),
                            l.reason.as_str(),
                            l.epoch.get(),
                            held_for(l).map_or_else(
                                || "?".to_owned(),
                                |d| format!("{:.1}s", d.as_secs_f64())
                            ),
                            l.time_left.as_secs_f64(),
                            status(l.status),
                            holder_name(l.holder)
                                .map_or_else(String::new, |n| format!("  (held by {n})"))
                        ),
                        LeaseEntry::Unreadable(u) => say!(
                            "{:<36}  {:<20}  {:<36}  {:<10}  {:>6}  {:>10}  {:>10}  unreadable: {}",
                            u.stream_id.to_string(),
                            // As stored, unvalidated: escaped, never raw control characters.
                            u.perspective.escape_debug().to_string(),
                            "?",
                            "?",
                            "?",
                            "?",
                            "?",
                            u.problem
                        ),
                    }
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        LocksCommand::Release {
            stream,
            perspective: name,
            force,
        } => {
            let name = perspective(&name)?;
            if !force {
                return Ok(outcome(
                    json,
                    false,
                    &pair_doc(
                        stream,
                        name.as_str(),
                        "refused",
                        json!({ "why": "--force not given" }),
                    ),
                    &format!(
                        "refusing to take the lease of {stream}/{name} from its holder without \
                         --force (its work will be fenced out: its commit fails with 'lease lost')"
                    ),
                ));
            }
            let released = locker(&pool)
                .force_release(StreamId::from_uuid(stream), &name)
                .await
                .map_err(explain)?;
            Ok(match released {
                ReleaseOutcome::Released => outcome(
                    json,
                    true,
                    &pair_doc(stream, name.as_str(), "released", json!({})),
                    &format!("released the lease of {stream}/{name}; its epoch increased"),
                ),
                _ => outcome(
                    json,
                    true,
                    &pair_doc(stream, name.as_str(), "no_lease", json!({})),
                    &format!("{stream}/{name} had no lease to release"),
                ),
            })
        }
        LocksCommand::Advisory { names } => {
            let out = advisory_rows(&pool, &names).await?;
            if json {
                say!("{}", serde_json::Value::Array(out));
            } else if out.is_empty() {
                say!("no advisory locks held or awaited in {}", url.database());
            } else {
                say!("{:>20}  {:<8}  {:>7}  {:>9}  name", "key", "", "pid", "age");
                for r in &out {
                    say!(
                        "{:>20}  {:<8}  {:>7}  {:>8.1}s  {}",
                        r["key"].as_i64().unwrap_or(0),
                        if r["granted"] == json!(true) {
                            "holds"
                        } else {
                            "waits"
                        },
                        r["pid"].as_i64().unwrap_or(0),
                        r["transaction_age_s"].as_f64().unwrap_or(0.0),
                        r["name"]
                            .as_str()
                            .unwrap_or("(unknown; name it with --name)")
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// One lease as JSON.
pub(crate) fn lease_json(l: &lockstep_core::LeaseInfo) -> serde_json::Value {
    json!({
        "stream_id": l.stream_id.to_string(),
        "perspective": l.perspective.as_str(),
        "holder": l.holder.to_string(),
        "reason": l.reason.as_str(),
        "epoch": l.epoch.get(),
        "time_left_ms": l.time_left.as_millis() as u64,
        "status": status(l.status),
        "acquired_at": l.acquired_at.and_then(|at| at.format(&time::format_description::well_known::Rfc3339).ok()),
        "held_for_ms": held_for(l).map(|d| d.as_millis() as u64),
    })
}

/// How long `l` has been held, on the database clock: a live lease's expiry minus its time left
/// is the listing's "now" there; an expired lease was held until its expiry (its holder stopped
/// renewing). `None` when the lease's start is not recorded.
pub(crate) fn held_for(l: &lockstep_core::LeaseInfo) -> Option<std::time::Duration> {
    let started = l.acquired_at?;
    let now = match l.status {
        LeaseStatus::Held => l.expires_at - l.time_left,
        LeaseStatus::Expired => l.expires_at,
    };
    // A start after "now" (clocks apart) is shown as just started, not as an error.
    Some((now - started).try_into().unwrap_or_default())
}

/// One listed row as JSON: a lease, or a row that cannot be read — its key, `"status":
/// "unreadable"` and `"error"` (what cannot be read), without the lease fields.
pub(crate) fn entry_json(entry: &LeaseEntry) -> serde_json::Value {
    match entry {
        LeaseEntry::Lease(l) => lease_json(l),
        LeaseEntry::Unreadable(u) => json!({
            "stream_id": u.stream_id.to_string(),
            "perspective": u.perspective,
            "status": "unreadable",
            "error": u.problem,
        }),
    }
}

/// The perspective a listed row names (as stored, for an unreadable row).
fn entry_perspective(entry: &LeaseEntry) -> &str {
    match entry {
        LeaseEntry::Lease(l) => l.perspective.as_str(),
        LeaseEntry::Unreadable(u) => &u.perspective,
    }
}

/// Every stream lease, as JSON rows (a row that cannot be read is listed as unreadable).
pub(crate) async fn lease_rows(pool: &deadpool_postgres::Pool) -> Result<Vec<serde_json::Value>> {
    let entries = locker(pool).list_lease_entries().await.map_err(explain)?;
    let mut rows: Vec<serde_json::Value> = entries.iter().map(entry_json).collect();
    crate::workers::name_holders(&mut rows, &crate::workers::instances(pool).await?);
    Ok(rows)
}

/// Advisory locks held or awaited now, with the names lockstep knows and `names` gives.
pub(crate) async fn advisory_rows(
    pool: &deadpool_postgres::Pool,
    names: &[String],
) -> Result<Vec<serde_json::Value>> {
    let client = pool.get().await.context("checking out a connection")?;
    // Unnamed (one round trip, no prepared statement): works behind a transaction pooler too.
    let rows = client
        .query_typed(
            "SELECT advisory_key, pid, granted, mode, state, \
             extract(epoch FROM transaction_age)::float8 AS age_s, application_name \
             FROM lockstep_advisory_locks ORDER BY advisory_key, granted DESC, pid",
            &[],
        )
        .await
        .map_err(|e| explain(lockstep_pg::map_error(e, "listing advisory locks")))?;
    let mut known: Vec<(i64, String)> = vec![(
        advisory_key(MIGRATION_LOCK_KEY),
        MIGRATION_LOCK_KEY.to_owned(),
    )];
    known.extend(names.iter().map(|n| (advisory_key(n), n.clone())));
    let mut out = Vec::new();
    for row in rows {
        let key: i64 = row.try_get("advisory_key").context("reading a lock row")?;
        let pid: i32 = row.try_get("pid").context("reading a lock row")?;
        let granted: bool = row.try_get("granted").context("reading a lock row")?;
        let mode: Option<String> = row.try_get("mode").context("reading a lock row")?;
        let state: Option<String> = row.try_get("state").context("reading a lock row")?;
        let age: Option<f64> = row.try_get("age_s").context("reading a lock row")?;
        let app: Option<String> = row
            .try_get("application_name")
            .context("reading a lock row")?;
        let name = known
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, n)| n.clone());
        out.push(json!({
            "key": key, "name": name, "pid": pid,
            "granted": granted, "mode": mode, "state": state,
            "transaction_age_s": age, "application": app,
        }));
    }
    Ok(out)
}

/// Per perspective: pairs, pending work, lag, rewinds pending, pairs in error, backing off and
/// parked — through the store's contract (`perspective_status`, `failing_pairs`).
pub(crate) async fn status_rows(pool: &deadpool_postgres::Pool) -> Result<Vec<serde_json::Value>> {
    let db = lockstep_pg::PgDatabase::from_pool(pool.clone());
    let store = PgPerspectiveStore::new();
    let tx = db.begin().await.map_err(explain)?;
    let read = async {
        let status = store.perspective_status(&tx).await?;
        let failing = store.failing_pairs(&tx, &[], 100).await?;
        let progress = store.rewind_progress(&tx, &[], 1000).await?;
        let rates = store.throughput(&tx).await?;
        Ok::<_, lockstep_core::Error>((status, failing, progress, rates))
    }
    .await;
    // Read only: a rollback that fails still ends it, and changes nothing.
    crate::pg::rollback(tx, "a read of the perspectives' status").await;
    let (status, failing, progress, rates) = read.map_err(explain)?;
    let instances = crate::workers::instances(pool).await?;
    let mut rows: Vec<serde_json::Value> = status
        .iter()
        .map(|p| {
            let in_error: Vec<_> = failing
                .iter()
                .filter(|c| c.pair.perspective == p.perspective)
                .map(|c| {
                    json!({
                        "stream_id": c.pair.stream_id.to_string(),
                        "error": c.error.clone().unwrap_or_default(),
                        "failures": c.failures,
                        "parked": c.parked_at.is_some(),
                    })
                })
                .collect();
            json!({
                "perspective": p.perspective.as_str(),
                "pairs": p.pairs,
                "pending_events": p.pending_events,
                "lag_s": p.oldest_pending_age.map_or(0.0, |d| d.as_secs_f64()),
                "rewinds_pending": p.rewinds_pending,
                "parked": p.parked,
                "backing_off": p.backing_off,
                "in_error": p.in_error,
                "pairs_in_error": in_error,
                "rewinds_running": crate::life::progress_json(&progress, &p.perspective),
                "applied_per_s": crate::life::rate_of(&rates, &p.perspective),
                "time_to_empty_s": crate::life::time_to_empty(&rates, &p.perspective, p.pending_events),
            })
        })
        .collect();
    crate::workers::mark_served(&mut rows, &instances);
    Ok(rows)
}

fn status(status: LeaseStatus) -> &'static str {
    match status {
        LeaseStatus::Held => "held",
        LeaseStatus::Expired => "expired",
    }
}

pub(crate) async fn perspectives(
    url: &DbUrl,
    cmd: PerspectivesCommand,
    json: bool,
) -> Result<ExitCode> {
    // The arguments first: a bad one is refused before anything connects.
    if let PerspectivesCommand::Rewind {
        perspective: name, ..
    }
    | PerspectivesCommand::Purge {
        perspective: name, ..
    }
    | PerspectivesCommand::Retry {
        perspective: name, ..
    }
    | PerspectivesCommand::Skip {
        perspective: name, ..
    }
    | PerspectivesCommand::Parked {
        perspective: Some(name),
        ..
    }
    | PerspectivesCommand::Rebuild { perspective: name }
    | PerspectivesCommand::Retire {
        perspective: name, ..
    }
    | PerspectivesCommand::Versions {
        perspective: Some(name),
    }
    | PerspectivesCommand::Promote {
        perspective: name, ..
    }
    | PerspectivesCommand::Abandon {
        perspective: name, ..
    } = &cmd
    {
        perspective(name)?;
    }
    if let PerspectivesCommand::Status {
        max_lag,
        max_promotion_wait,
        ..
    } = &cmd
    {
        for (flag, value) in [
            ("--max-lag", max_lag),
            ("--max-promotion-wait", max_promotion_wait),
        ] {
            if !(value.is_finite() && *value >= 0.0) {
                return Err(bad_argument(format!(
                    "{flag} {value}: expected a number of seconds, 0 or more"
                )));
            }
        }
    }
    let db = url.handle(4).await?;
    let pool = db.pool().clone();
    let source = db.clone();
    let store = PgPerspectiveStore::new();
    // A command on one pair names a perspective: one that is not registered is refused with
    // that name, rather than reported as a pair without a cursor.
    if let PerspectivesCommand::Rewind {
        stream,
        perspective: name,
        ..
    }
    | PerspectivesCommand::Purge {
        stream,
        perspective: name,
    }
    | PerspectivesCommand::Retry {
        stream,
        perspective: name,
    }
    | PerspectivesCommand::Skip {
        stream,
        perspective: name,
        ..
    } = &cmd
    {
        let name = perspective(name)?;
        if !registered(&source, &store, &name).await? {
            return Ok(outcome(
                json,
                false,
                &pair_doc(*stream, name.as_str(), "not_registered", json!({})),
                &format!(
                    "perspective `{name}` is not registered in {}: nothing was changed \
                     (`lockstep perspectives status` lists the registered ones)",
                    url.database()
                ),
            ));
        }
    }
    match cmd {
        PerspectivesCommand::Status {
            check,
            max_lag,
            max_pending,
            max_in_error,
            max_parked,
            max_unserved,
            max_promotion_wait,
        } => {
            let limits = check.then_some(Limits {
                max_lag,
                max_pending,
                max_in_error,
                max_parked,
                max_unserved,
                max_promotion_wait,
            });
            perspective_status(&pool, json, limits).await
        }
        PerspectivesCommand::Versions { perspective: name } => {
            let name = name.as_deref().map(perspective).transpose()?;
            crate::versions::list(&pool, name.as_ref(), json).await
        }
        PerspectivesCommand::Promote {
            perspective: name,
            version,
            force,
            wait,
        } => {
            let wait = std::time::Duration::from_secs(wait);
            crate::versions::promote(&source, &perspective(&name)?, version, force, wait, json)
                .await
        }
        PerspectivesCommand::Abandon {
            perspective: name,
            version,
            keep_states,
        } => {
            let states = if keep_states {
                lockstep_core::RetireStates::Keep
            } else {
                lockstep_core::RetireStates::Drop
            };
            crate::versions::abandon(&source, &perspective(&name)?, version, states, json).await
        }
        PerspectivesCommand::Rebuild { perspective: name } => {
            crate::life::rebuild(&source, url, &perspective(&name)?, json).await
        }
        PerspectivesCommand::Retire {
            perspective: name,
            keep_states,
            ..
        } => {
            let states = if keep_states {
                lockstep_core::RetireStates::Keep
            } else {
                lockstep_core::RetireStates::Drop
            };
            crate::life::retire(&source, url, &perspective(&name)?, states, json).await
        }
        cmd @ (PerspectivesCommand::Parked { .. }
        | PerspectivesCommand::Retry { .. }
        | PerspectivesCommand::Skip { .. }) => parking(&source, &store, cmd, json).await,
        PerspectivesCommand::Rewind {
            stream,
            perspective: name,
            from,
        } => {
            let name = perspective(&name)?;
            // `--from` must be an event of this stream: a rewind "from" another stream's event
            // would replay from an unrelated point in time.
            if let Some(from) = from {
                let belongs = stream_of_event(&source, from).await?;
                if belongs != Some(stream) {
                    let why = match belongs {
                        Some(other) => format!("event {from} is an event of stream {other}"),
                        None => format!("there is no event {from} in {}", url.database()),
                    };
                    return Ok(outcome(
                        json,
                        false,
                        &pair_doc(
                            stream,
                            name.as_str(),
                            "refused",
                            json!({ "from": from.to_string(), "why": why }),
                        ),
                        &format!(
                            "refused: --from must be an event of stream {stream}, and {why}; \
                             nothing was requested"
                        ),
                    ));
                }
            }
            let tx = source.begin().await.map_err(explain)?;
            // Also a retry: a parked pair's parking is cleared (the store's rule).
            let requested = store
                .request_rewind(
                    &tx,
                    &Pair::new(StreamId::from_uuid(stream), name.clone()),
                    from,
                )
                .await;
            let requested = match requested {
                Ok(r) => {
                    tx.commit().await.map_err(explain)?;
                    r
                }
                Err(e) => {
                    // The request's error is the one to report; a rollback that fails still
                    // ends the transaction, and nothing of it is committed.
                    crate::pg::rollback(tx, "a rewind request that failed").await;
                    return Err(explain(e));
                }
            };
            let from_doc = json!({ "from": from.map(|f| f.to_string()) });
            Ok(if requested {
                outcome(
                    json,
                    true,
                    &pair_doc(stream, name.as_str(), "requested", from_doc),
                    &format!(
                        "rewind of {stream}/{name} requested from {}; a worker carries it out",
                        from.map_or("the start".to_owned(), |f| f.to_string())
                    ),
                )
            } else {
                outcome(
                    json,
                    false,
                    &pair_doc(stream, name.as_str(), "no_cursor", from_doc),
                    &format!("{stream}/{name} has no cursor: nothing to rewind"),
                )
            })
        }
        PerspectivesCommand::Purge {
            stream,
            perspective: name,
        } => {
            let name = perspective(&name)?;
            let stream = StreamId::from_uuid(stream);
            let locker: Arc<dyn StreamLocker> = Arc::new(locker(&pool));
            let keeper = LeaseKeeper::start(locker, InstanceId::random());
            let busy = || {
                Ok(outcome(
                    json,
                    false,
                    &pair_doc(stream.as_uuid(), name.as_str(), "busy", json!({})),
                    &format!(
                        "refused: another transaction holds the cursor row of {stream}/{name} \
                         right now (a worker applying its events, or an open transaction of an \
                         operator); nothing was purged: try again"
                    ),
                ))
            };
            let acquired = keeper.try_acquire(stream, &name, &LockReason::Purge).await;
            let lease = match acquired {
                Err(e) if e.kind() == ErrorKind::LockTimeout => return busy(),
                Err(e) => return Err(explain(e)),
                Ok(Leased::Acquired(lease)) => lease,
                Ok(Leased::Denied(holder)) => {
                    let doc = json!({ "holder": {
                        "instance": holder.instance.to_string(),
                        "reason": holder.reason.as_str(),
                        "epoch": holder.epoch.get(),
                        "expires_at": holder.expires_at.to_string(),
                    }});
                    return Ok(outcome(
                        json,
                        false,
                        &pair_doc(stream.as_uuid(), name.as_str(), "held", doc),
                        &format!(
                            "refused: instance {} holds the lease of {stream}/{name} ({}) for \
                             {} more, unless it renews it; nothing was purged",
                            holder.instance,
                            holder.reason,
                            time_until(holder.expires_at)
                        ),
                    ));
                }
                Ok(Leased::Busy) => return busy(),
                Ok(Leased::NoCursor) => {
                    return Ok(outcome(
                        json,
                        false,
                        &pair_doc(stream.as_uuid(), name.as_str(), "no_cursor", json!({})),
                        &format!("{stream}/{name} has no cursor: nothing to purge"),
                    ));
                }
            };
            let tx = source.begin().await.map_err(explain)?;
            let purged = store
                .purge(&tx, &Pair::new(stream, name.clone()), Some(lease.id()))
                .await;
            let committed = match purged {
                Ok(()) => tx.commit().await,
                Err(e) => {
                    // The purge's error is the one to report; a rollback that fails still ends
                    // the transaction, and nothing of it is committed.
                    crate::pg::rollback(tx, "a purge that failed").await;
                    Err(e)
                }
            };
            let released = lease.release().await;
            match committed {
                // The purge waited for the row past its lock timeout; it rolled back.
                Err(e) if e.kind() == ErrorKind::LockTimeout => return busy(),
                outcome => outcome.map_err(explain)?,
            }
            let released = released.map_err(explain)?;
            Ok(outcome(
                json,
                true,
                &pair_doc(
                    stream.as_uuid(),
                    name.as_str(),
                    "purged",
                    json!({ "lease_released": released.is_released() }),
                ),
                &format!(
                    "purged {stream}/{name} under a 'purge' lease ({})",
                    if released.is_released() {
                        "released"
                    } else {
                        "it had expired meanwhile"
                    }
                ),
            ))
        }
    }
}

/// A parked pair as JSON (`perspectives parked --json`, the status page).
pub(crate) fn parked_json(c: &lockstep_core::Cursor) -> serde_json::Value {
    json!({
        "stream_id": c.pair.stream_id.to_string(),
        "perspective": c.pair.perspective.as_str(),
        "failures": c.failures,
        "error": c.error,
        "failed_event_id": c.failed_event_id.map(|e| e.to_string()),
        "parked_at": c.parked_at.map(|t| t.to_string()),
        "last_event_id": c.last_event_id.map(|e| e.to_string()),
    })
}

/// `lockstep perspectives parked | retry | skip`: the parked pairs and what an operator does
/// about them, through the store's contract.
async fn parking(
    source: &lockstep_pg::PgDatabase,
    store: &PgPerspectiveStore,
    cmd: PerspectivesCommand,
    json: bool,
) -> Result<ExitCode> {
    let tx = source.begin().await.map_err(explain)?;
    let done = match cmd {
        PerspectivesCommand::Parked {
            perspective: name,
            limit,
        } => {
            let names: Vec<PerspectiveName> = name
                .as_deref()
                .map(perspective)
                .transpose()?
                .into_iter()
                .collect();
            let parked = store
                .parked_pairs(&tx, &names, limit)
                .await
                .map_err(explain)?;
            let rows: Vec<serde_json::Value> = parked.iter().map(parked_json).collect();
            if json {
                say!("{}", serde_json::Value::Array(rows));
            } else if parked.is_empty() {
                say!("no parked pairs");
            } else {
                for c in &parked {
                    say!(
                        "{}/{} parked after {} failures at event {}: {}",
                        c.pair.stream_id,
                        c.pair.perspective,
                        c.failures,
                        c.failed_event_id
                            .map_or_else(|| "(none)".to_owned(), |e| e.to_string()),
                        c.error.as_deref().unwrap_or("")
                    );
                }
            }
            ExitCode::SUCCESS
        }
        PerspectivesCommand::Retry {
            stream,
            perspective: name,
        } => {
            let name = perspective(&name)?;
            if store
                .unpark(&tx, &Pair::new(StreamId::from_uuid(stream), name.clone()))
                .await
                .map_err(explain)?
            {
                outcome(
                    json,
                    true,
                    &pair_doc(stream, name.as_str(), "retried", json!({})),
                    &format!("{stream}/{name} is retried: the next batch claims it"),
                )
            } else {
                outcome(
                    json,
                    false,
                    &pair_doc(stream, name.as_str(), "no_cursor", json!({})),
                    &format!("{stream}/{name} has no cursor: nothing to retry"),
                )
            }
        }
        PerspectivesCommand::Skip {
            stream,
            perspective: name,
            event,
            reason,
        } => {
            let name = perspective(&name)?;
            let stream_id = StreamId::from_uuid(stream);
            let event = match event {
                Some(event) => Some(event),
                None => store
                    .cursor(&tx, &Pair::new(stream_id, name.clone()))
                    .await
                    .map_err(explain)?
                    .and_then(|c| c.failed_event_id),
            };
            let Some(event) = event else {
                // Nothing was written: a rollback that fails still ends it.
                crate::pg::rollback(tx, "a skip with no event to skip").await;
                return Ok(outcome(
                    json,
                    false,
                    &pair_doc(stream, name.as_str(), "no_failing_event", json!({})),
                    &format!(
                        "{stream}/{name} has no failing event on record: name the event with \
                         --event"
                    ),
                ));
            };
            if store
                .skip_event(&tx, &Pair::new(stream_id, name.clone()), event, &reason)
                .await
                .map_err(explain)?
            {
                outcome(
                    json,
                    true,
                    &pair_doc(
                        stream,
                        name.as_str(),
                        "skipped",
                        json!({ "event_id": event.to_string(), "reason": reason }),
                    ),
                    &format!(
                        "skipped event {event} of {stream}/{name} (recorded: {reason}); the pair \
                         is retried"
                    ),
                )
            } else {
                outcome(
                    json,
                    false,
                    &pair_doc(
                        stream,
                        name.as_str(),
                        "not_pending",
                        json!({ "event_id": event.to_string() }),
                    ),
                    &format!(
                        "event {event} is not pending work of {stream}/{name}: nothing skipped"
                    ),
                )
            }
        }
        _ => return Err(anyhow::anyhow!("not a parking command")),
    };
    tx.commit().await.map_err(explain)?;
    Ok(done)
}

/// The thresholds of `perspectives status --check`.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_lag: f64,
    max_pending: Option<u64>,
    max_in_error: u64,
    max_parked: u64,
    max_unserved: u64,
    max_promotion_wait: f64,
}

/// The checks `rows` (from [`status_rows`]) fail under `limits`: perspective, check, value, limit.
fn failed_checks(rows: &[serde_json::Value], limits: &Limits) -> Vec<serde_json::Value> {
    let mut failed = Vec::new();
    for p in rows {
        let name = p["perspective"].as_str().unwrap_or("");
        let lag = p["lag_s"].as_f64().unwrap_or(0.0);
        if lag > limits.max_lag {
            failed.push(json!({ "perspective": name, "check": "lag_s", "value": lag, "limit": limits.max_lag }));
        }
        let count = |key: &str| p[key].as_u64().unwrap_or(0);
        if let Some(max) = limits.max_pending
            && count("pending_events") > max
        {
            failed.push(json!({ "perspective": name, "check": "pending_events", "value": count("pending_events"), "limit": max }));
        }
        if count("in_error") > limits.max_in_error {
            failed.push(json!({ "perspective": name, "check": "in_error", "value": count("in_error"), "limit": limits.max_in_error }));
        }
        if count("parked") > limits.max_parked {
            let mut f = json!({ "perspective": name, "check": "parked", "value": count("parked"), "limit": limits.max_parked });
            if let Some(note) = crate::versions::parked_note(p) {
                f["why"] = json!(note);
            }
            failed.push(f);
        }
        if p["live_workers"].as_array().is_some_and(Vec::is_empty)
            && count("pending_events") > limits.max_unserved
        {
            failed.push(json!({ "perspective": name, "check": "unserved_pending_events", "value": count("pending_events"), "limit": limits.max_unserved }));
        }
    }
    failed
}

/// `lockstep perspectives status [--check …]`.
async fn perspective_status(
    pool: &deadpool_postgres::Pool,
    json: bool,
    limits: Option<Limits>,
) -> Result<ExitCode> {
    let mut out = status_rows(pool).await?;
    let versions = crate::versions::version_rows(pool, None, &out).await?;
    crate::versions::mark_versions(&mut out, &versions);
    let failed = limits.map(|l| {
        let mut failed = failed_checks(&out, &l);
        failed.extend(crate::versions::failed_checks(
            &versions,
            l.max_promotion_wait,
        ));
        failed
    });
    if json {
        match &failed {
            None => say!("{}", serde_json::Value::Array(out)),
            Some(failed) => say!(
                "{}",
                json!({
                    "healthy": failed.is_empty(), "failed": failed, "perspectives": out,
                    "versions": versions,
                })
            ),
        }
        return Ok(check_code(failed.as_deref()));
    }
    let retired = crate::life::retired(pool).await?;
    if out.is_empty() {
        say!("no perspectives registered");
    } else {
        say!(
            "{:<24} {:>8} {:>10} {:>9} {:>8} {:>7} {:>8} {:>7} {:>10} {:>9}  workers",
            "perspective",
            "pairs",
            "pending",
            "lag",
            "rewinds",
            "errors",
            "backoff",
            "parked",
            "applied/s",
            "to empty"
        );
        for p in &out {
            let live: Vec<String> = p["live_workers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|w| w.as_str())
                .map(|w| w.escape_debug().to_string())
                .collect();
            say!(
                "{:<24} {:>8} {:>10} {:>8.1}s {:>8} {:>7} {:>8} {:>7} {:>10} {:>9}  {}",
                p["perspective"].as_str().unwrap_or(""),
                p["pairs"].as_i64().unwrap_or(0),
                p["pending_events"].as_i64().unwrap_or(0),
                p["lag_s"].as_f64().unwrap_or(0.0),
                p["rewinds_pending"].as_i64().unwrap_or(0),
                p["in_error"].as_i64().unwrap_or(0),
                p["backing_off"].as_i64().unwrap_or(0),
                p["parked"].as_i64().unwrap_or(0),
                p["applied_per_s"]
                    .as_f64()
                    .map_or("-".to_owned(), |r| format!("{r:.1}")),
                p["time_to_empty_s"]
                    .as_f64()
                    .map_or("-".to_owned(), |t| format!("{t:.0}s")),
                if p["unserved"] == true {
                    "NO LIVE WORKER".to_owned()
                } else if live.is_empty() {
                    "-".to_owned()
                } else {
                    live.join(", ")
                }
            );
            for r in p["rewinds_running"].as_array().into_iter().flatten() {
                say!("    {}", crate::life::progress_line(r));
            }
            for e in p["pairs_in_error"].as_array().into_iter().flatten() {
                say!(
                    "    {} failed {}×: {}",
                    e["stream_id"].as_str().unwrap_or(""),
                    e["failures"],
                    e["error"].as_str().unwrap_or("")
                );
            }
        }
    }
    for line in crate::versions::summary_lines(&versions) {
        say!("{line}");
    }
    if !retired.is_empty() {
        say!("retired with their states kept: {}", retired.join(", "));
    }
    if let Some(failed) = &failed {
        if failed.is_empty() {
            say!("healthy: every check passed");
        } else {
            for f in failed {
                say!(
                    "UNHEALTHY {}: {} is {} (limit {}){}",
                    f["perspective"].as_str().unwrap_or(""),
                    f["check"].as_str().unwrap_or(""),
                    f["value"],
                    f["limit"],
                    f["why"]
                        .as_str()
                        .map_or_else(String::new, |why| format!(": {why}"))
                );
            }
        }
    }
    Ok(check_code(failed.as_deref()))
}

/// 0 without a check or when every check passed, 1 when one failed.
fn check_code(failed: Option<&[serde_json::Value]>) -> ExitCode {
    match failed {
        Some(failed) if !failed.is_empty() => ExitCode::from(1),
        _ => ExitCode::SUCCESS,
    }
}
