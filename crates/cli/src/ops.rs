//! The operations on a lockstep database: `migrate`, `locks …`, `perspectives …`, `worker`.
//! Everything a script reads has `--json`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use lockstep_core::{
    ErrorKind, InstanceId, LeaseEntry, LeaseStatus, LockReason, PerspectiveName,
    PerspectiveRegistry, PerspectiveStore, ReleaseOutcome, StreamId, StreamLockAdmin,
    StreamLockOptions, StreamLocker, TransactionSource, advisory_key,
};
use lockstep_pg::migrate::MIGRATION_LOCK_KEY;
use lockstep_pg_store::PgPerspectiveStore;
use lockstep_pg_stream::PgStreamLocker;
use lockstep_worker::{CancellationToken, LeaseKeeper, Leased, PerspectiveWorker, WorkerOptions};
use serde_json::json;
use uuid::Uuid;

use crate::ledger::{LEDGER, Ledger};
use crate::pg::{DbUrl, explain};
use crate::{bad_argument, say};
use lockstep_core::Transaction as _;

/// `lockstep locks …`
#[derive(Debug, Subcommand)]
pub(crate) enum LocksCommand {
    /// Lists stream leases: stream, perspective, holder, reason, epoch, time left on the
    /// database clock, held or expired.
    List {
        /// Only leases of this perspective.
        #[arg(long)]
        perspective: Option<String>,
        /// Only leases held by this instance id.
        #[arg(long)]
        holder: Option<Uuid>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Force-releases a pair's lease whoever holds it (the epoch increases, so the old holder's
    /// renews, releases and fenced commits fail). Refuses without --force.
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
    Advisory {
        /// Name a key you know (e.g. `relay:aggregate:StockItem:{id}`); repeatable.
        #[arg(long = "name")]
        names: Vec<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `lockstep perspectives …`
#[derive(Debug, Subcommand)]
pub(crate) enum PerspectivesCommand {
    /// Per perspective: pairs, pending work, lag, rewinds pending, pairs in error.
    Status {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Requests a rewind of a pair from an event (from the start without --from); a worker
    /// carries it out under a 'rewind' lease.
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
    Purge {
        /// The stream id.
        stream: Uuid,
        /// The perspective name.
        perspective: String,
    },
    /// Lists the parked pairs (failed too often in a row; their work keeps queueing): the
    /// failing event, the error, how often.
    Parked {
        /// Only this perspective's.
        #[arg(long)]
        perspective: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Retries a parked (or backing-off) pair now: its parking, backoff and failure count are
    /// cleared; the next batch claims it.
    Retry {
        /// The stream id.
        stream: Uuid,
        /// The perspective name.
        perspective: String,
    },
    /// Skips one pending event of a pair for good (recorded on the pair, never silent; rewinds
    /// leave it out too) and retries the pair. Without --event: the event its last failure
    /// happened at.
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

/// `lockstep worker`
#[derive(Debug, Args)]
pub(crate) struct WorkerArgs {
    /// This instance's id (default: a new one).
    #[arg(long)]
    instance: Option<Uuid>,
    /// Lease lock timeout in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    lock_timeout_ms: u64,
    /// Keepalive interval in milliseconds (less than half the lock timeout).
    #[arg(long, default_value_t = 10_000)]
    keepalive_ms: u64,
    /// Microseconds each applied event takes (to watch rewinds in tests and demos).
    #[arg(long, default_value_t = 0)]
    slow_apply_us: u64,
    /// Serve the worker's metrics in the Prometheus text format on this address (`/metrics`).
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Register the sample `Ledger` perspective in this database if it is not registered yet.
    /// A registered perspective gets work for every event appended from then on, whoever
    /// appends it, so the worker never registers it unasked: do not pass this on an
    /// application's database.
    #[arg(long)]
    register_sample: bool,
}

pub(crate) async fn migrate(url: &DbUrl, json: bool) -> Result<ExitCode> {
    let db = url.handle(2).await?;
    let report = db.migrate().await.map_err(explain)?;
    if json {
        let applied: Vec<_> = report
            .applied
            .iter()
            .map(|(v, n)| json!({ "version": v, "name": n }))
            .collect();
        say!(
            "{}",
            json!({ "database": url.database(), "applied": applied })
        );
    } else if report.applied.is_empty() {
        say!("{}: the schema is up to date.", url.database());
    } else {
        for (version, name) in &report.applied {
            say!("applied V{version} {name}");
        }
        say!(
            "{}: {} migration(s) applied.",
            url.database(),
            report.applied.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn locker(pool: &deadpool_postgres::Pool) -> PgStreamLocker {
    PgStreamLocker::from_pool(pool.clone(), StreamLockOptions::default())
}

/// `name` as a perspective name; a bad one is a bad argument (exit 2).
fn perspective(name: &str) -> Result<PerspectiveName> {
    PerspectiveName::new(name).map_err(|e| bad_argument(format!("invalid perspective name: {e}")))
}

pub(crate) async fn locks(url: &DbUrl, cmd: LocksCommand) -> Result<ExitCode> {
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
            json,
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
            if json {
                let rows: Vec<_> = entries.iter().map(entry_json).collect();
                say!("{}", serde_json::Value::Array(rows));
            } else if entries.is_empty() {
                say!("no stream leases");
            } else {
                say!(
                    "{:<36}  {:<20}  {:<36}  {:<10}  {:>6}  {:>10}  status",
                    "stream",
                    "perspective",
                    "holder",
                    "reason",
                    "epoch",
                    "time left"
                );
                for entry in &entries {
                    match entry {
                        LeaseEntry::Lease(l) => say!(
                            "{:<36}  {:<20}  {:<36}  {:<10}  {:>6}  {:>9.1}s  {}",
                            l.stream_id.to_string(),
                            l.perspective.as_str(),
                            l.holder.to_string(),
                            l.reason.as_str(),
                            l.epoch.get(),
                            l.time_left.as_secs_f64(),
                            status(l.status)
                        ),
                        LeaseEntry::Unreadable(u) => say!(
                            "{:<36}  {:<20}  {:<36}  {:<10}  {:>6}  {:>10}  unreadable: {}",
                            u.stream_id.to_string(),
                            // As stored, unvalidated: escaped, never raw control characters.
                            u.perspective.escape_debug().to_string(),
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
                eprintln!(
                    "refusing to take the lease of {stream}/{name} from its holder without --force \
                     (its work will be fenced out: its commit fails with 'lease lost')"
                );
                return Ok(ExitCode::from(1));
            }
            let outcome = locker(&pool)
                .force_release(StreamId::from_uuid(stream), &name)
                .await
                .map_err(explain)?;
            match outcome {
                ReleaseOutcome::Released => {
                    say!("released the lease of {stream}/{name}; its epoch increased")
                }
                _ => say!("{stream}/{name} had no lease to release"),
            }
            Ok(ExitCode::SUCCESS)
        }
        LocksCommand::Advisory { names, json } => {
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
    })
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
    Ok(entries.iter().map(entry_json).collect())
}

/// Advisory locks held or awaited now, with the names lockstep knows and `names` gives.
pub(crate) async fn advisory_rows(
    pool: &deadpool_postgres::Pool,
    names: &[String],
) -> Result<Vec<serde_json::Value>> {
    let client = pool.get().await.context("checking out a connection")?;
    let rows = client
        .query(
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
        Ok::<_, lockstep_core::Error>((status, failing))
    }
    .await;
    // Read only: the rollback cannot lose anything.
    let _ = tx.rollback().await;
    let (status, failing) = read.map_err(explain)?;
    Ok(status
        .iter()
        .map(|p| {
            let in_error: Vec<_> = failing
                .iter()
                .filter(|c| c.perspective == p.perspective)
                .map(|c| {
                    json!({
                        "stream_id": c.stream_id.to_string(),
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
            })
        })
        .collect())
}

fn status(status: LeaseStatus) -> &'static str {
    match status {
        LeaseStatus::Held => "held",
        LeaseStatus::Expired => "expired",
    }
}

pub(crate) async fn perspectives(url: &DbUrl, cmd: PerspectivesCommand) -> Result<ExitCode> {
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
    } = &cmd
    {
        perspective(name)?;
    }
    let db = url.handle(4).await?;
    let pool = db.pool().clone();
    let source = db.clone();
    let store = PgPerspectiveStore::new();
    match cmd {
        PerspectivesCommand::Status { json } => perspective_status(&pool, json).await,
        cmd @ (PerspectivesCommand::Parked { .. }
        | PerspectivesCommand::Retry { .. }
        | PerspectivesCommand::Skip { .. }) => parking(&source, &store, cmd).await,
        PerspectivesCommand::Rewind {
            stream,
            perspective: name,
            from,
        } => {
            let name = perspective(&name)?;
            let tx = source.begin().await.map_err(explain)?;
            // Also a retry: a parked pair's parking is cleared (the store's rule).
            let requested = store
                .request_rewind(&tx, StreamId::from_uuid(stream), &name, from)
                .await;
            let requested = match requested {
                Ok(r) => {
                    tx.commit().await.map_err(explain)?;
                    r
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(explain(e));
                }
            };
            if requested {
                say!(
                    "rewind of {stream}/{name} requested from {}; a worker carries it out",
                    from.map_or("the start".to_owned(), |f| f.to_string())
                );
                Ok(ExitCode::SUCCESS)
            } else {
                eprintln!("{stream}/{name} has no cursor: nothing to rewind");
                Ok(ExitCode::from(1))
            }
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
                eprintln!(
                    "refused: another transaction holds the cursor row of {stream}/{name} right now \
                     (a worker applying its events, or an open transaction of an operator); \
                     nothing was purged: try again"
                );
                Ok(ExitCode::from(1))
            };
            let acquired = keeper.try_acquire(stream, &name, &LockReason::Purge).await;
            let lease = match acquired {
                Err(e) if e.kind() == ErrorKind::LockTimeout => return busy(),
                Err(e) => return Err(explain(e)),
                Ok(Leased::Acquired(lease)) => lease,
                Ok(Leased::Denied(holder)) => {
                    eprintln!(
                        "refused: instance {} holds the lease of {stream}/{name} ({}) for {} more",
                        holder.instance, holder.reason, holder.expires_at
                    );
                    return Ok(ExitCode::from(1));
                }
                Ok(Leased::Busy) => return busy(),
                Ok(Leased::NoCursor) => {
                    eprintln!("{stream}/{name} has no cursor: nothing to purge");
                    return Ok(ExitCode::from(1));
                }
            };
            let tx = source.begin().await.map_err(explain)?;
            let purged = store.purge(&tx, stream, &name, Some(lease.id())).await;
            let outcome = match purged {
                Ok(()) => tx.commit().await,
                Err(e) => {
                    let _ = tx.rollback().await;
                    Err(e)
                }
            };
            let released = lease.release().await;
            match outcome {
                // The purge waited for the row past its lock timeout; it rolled back.
                Err(e) if e.kind() == ErrorKind::LockTimeout => return busy(),
                outcome => outcome.map_err(explain)?,
            }
            let released = released.map_err(explain)?;
            say!(
                "purged {stream}/{name} under a 'purge' lease ({})",
                if released.is_released() {
                    "released"
                } else {
                    "it had expired meanwhile"
                }
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `lockstep perspectives parked | retry | skip`: the parked pairs and what an operator does
/// about them, through the store's contract.
async fn parking(
    source: &lockstep_pg::PgDatabase,
    store: &PgPerspectiveStore,
    cmd: PerspectivesCommand,
) -> Result<ExitCode> {
    let tx = source.begin().await.map_err(explain)?;
    let done = match cmd {
        PerspectivesCommand::Parked {
            perspective: name,
            limit,
            json,
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
            let rows: Vec<serde_json::Value> = parked
                .iter()
                .map(|c| {
                    json!({
                        "stream_id": c.stream_id.to_string(),
                        "perspective": c.perspective.as_str(),
                        "failures": c.failures,
                        "error": c.error,
                        "failed_event_id": c.failed_event_id.map(|e| e.to_string()),
                        "parked_at": c.parked_at.map(|t| t.to_string()),
                        "last_event_id": c.last_event_id.map(|e| e.to_string()),
                    })
                })
                .collect();
            if json {
                say!("{}", serde_json::Value::Array(rows));
            } else if parked.is_empty() {
                say!("no parked pairs");
            } else {
                for c in &parked {
                    say!(
                        "{}/{} parked after {} failures at event {}: {}",
                        c.stream_id,
                        c.perspective,
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
                .unpark(&tx, StreamId::from_uuid(stream), &name)
                .await
                .map_err(explain)?
            {
                say!("{stream}/{name} is retried: the next batch claims it");
                ExitCode::SUCCESS
            } else {
                eprintln!("{stream}/{name} has no cursor: nothing to retry");
                ExitCode::from(1)
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
                    .cursor(&tx, stream_id, &name)
                    .await
                    .map_err(explain)?
                    .and_then(|c| c.failed_event_id),
            };
            let Some(event) = event else {
                eprintln!(
                    "{stream}/{name} has no failing event on record: name the event with --event"
                );
                return Ok(ExitCode::from(1));
            };
            if store
                .skip_event(&tx, stream_id, &name, event, &reason)
                .await
                .map_err(explain)?
            {
                say!(
                    "skipped event {event} of {stream}/{name} (recorded: {reason}); the pair is retried"
                );
                ExitCode::SUCCESS
            } else {
                eprintln!("event {event} is not pending work of {stream}/{name}: nothing skipped");
                ExitCode::from(1)
            }
        }
        _ => return Err(anyhow::anyhow!("not a parking command")),
    };
    tx.commit().await.map_err(explain)?;
    Ok(done)
}

async fn perspective_status(pool: &deadpool_postgres::Pool, json: bool) -> Result<ExitCode> {
    let out = status_rows(pool).await?;
    if json {
        say!("{}", serde_json::Value::Array(out));
    } else if out.is_empty() {
        say!("no perspectives registered");
    } else {
        say!(
            "{:<24} {:>8} {:>10} {:>9} {:>8} {:>7} {:>8} {:>7}",
            "perspective",
            "pairs",
            "pending",
            "lag",
            "rewinds",
            "errors",
            "backoff",
            "parked"
        );
        for p in &out {
            say!(
                "{:<24} {:>8} {:>10} {:>8.1}s {:>8} {:>7} {:>8} {:>7}",
                p["perspective"].as_str().unwrap_or(""),
                p["pairs"].as_i64().unwrap_or(0),
                p["pending_events"].as_i64().unwrap_or(0),
                p["lag_s"].as_f64().unwrap_or(0.0),
                p["rewinds_pending"].as_i64().unwrap_or(0),
                p["in_error"].as_i64().unwrap_or(0),
                p["backing_off"].as_i64().unwrap_or(0),
                p["parked"].as_i64().unwrap_or(0)
            );
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
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn worker(url: &DbUrl, args: WorkerArgs) -> Result<ExitCode> {
    // The arguments first: a bad one is refused before anything binds or connects.
    let options = StreamLockOptions::new(
        Duration::from_millis(args.lock_timeout_ms),
        Duration::from_millis(args.keepalive_ms),
    )
    .map_err(|e| bad_argument(format!("--lock-timeout-ms / --keepalive-ms: {e}")))?;
    let instance = match args.instance {
        Some(id) => {
            InstanceId::from_uuid(id).map_err(|e| bad_argument(format!("--instance: {e}")))?
        }
        None => InstanceId::random(),
    };
    let metrics = match &args.metrics_addr {
        Some(addr) => Some(crate::serve::listen("--metrics-addr", addr).await?),
        None => None,
    };
    if let Some(listener) = metrics {
        let bound = crate::serve::metrics_endpoint(listener)?;
        say!("metrics on http://{bound}/metrics");
    }
    let db = url.handle(8).await?;
    if !args.register_sample && !sample_registered(&db).await? {
        return Err(bad_argument(format!(
            "the sample perspective `{LEDGER}` is not registered in {}: `lockstep worker` runs \
             only that sample, and registering it makes every event appended to this database \
             queue work for it from then on; pass --register-sample to register it (a database \
             of its own, never an application's)",
            url.database()
        )));
    }
    let ledger = Ledger::default();
    ledger
        .slow
        .store(args.slow_apply_us, std::sync::atomic::Ordering::SeqCst);
    let mut registry = PerspectiveRegistry::new();
    registry.register(ledger)?;
    let locker: Arc<dyn StreamLocker> = Arc::new(PgStreamLocker::new(&db, options));
    let worker = PerspectiveWorker::new(
        db.clone(),
        PgPerspectiveStore::new(),
        registry,
        WorkerOptions::default(),
        instance,
        Some(locker),
    )?;
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        signal.cancel();
    });
    say!(
        "worker {instance} running on {} (Ctrl-C or SIGTERM stops it)",
        url.database()
    );
    worker.run(shutdown).await.map_err(explain)?;
    say!("worker {instance} stopped; its leases are released");
    Ok(ExitCode::SUCCESS)
}

/// Whether the sample `Ledger` perspective is registered in `db`.
async fn sample_registered(db: &lockstep_pg::PgDatabase) -> Result<bool> {
    let client = db.checkout().await.map_err(explain)?;
    let row = client
        .query_opt(
            "SELECT 1 FROM wh_perspectives WHERE perspective_name = $1",
            &[&LEDGER],
        )
        .await
        .map_err(|e| {
            explain(lockstep_pg::map_error(
                e,
                "reading the registered perspectives",
            ))
        })?;
    Ok(row.is_some())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
