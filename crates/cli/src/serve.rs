//! `lockstep serve`: the on-call engineer's page and `/metrics`, on axum.
//!
//! - `GET /` — the page: a summary line with health colours, the worker instances (live or
//!   stale), stream leases (holders by name, a running rewind's start and progress), advisory
//!   locks
//!   grouped per key (holder, waiters, longest wait, each connection's `application_name`),
//!   perspectives (lag highlighted, failures, backoff, parking, the live workers that run it or
//!   "no live worker"), the versions of each perspective (which serves, each building
//!   version's progress and parked pairs, promotions requested and how long ago) and the
//!   parked pairs. It is
//!   rendered on the server (so it reads without JavaScript) and then updates itself in place
//!   from `GET /fragment` every 2 s — no reload, the scroll position stays — saying when it last
//!   refreshed and how long the database took. While the database is unreachable or not
//!   migrated it says so and goes on trying, so it recovers by itself.
//! - `GET /api/status` — the same snapshot as JSON; `GET /metrics` — gauges read from the
//!   database at each scrape, in the Prometheus text format with `# HELP` on every family;
//!   `GET /healthz` — database reachability and schema state (200 only when both are fine).
//! - `POST /actions` — force-release a lease, request a rewind of a pair or a rebuild of a
//!   perspective, retry or skip a parked pair —
//!   only when the operator configured a token (`LOCKSTEP_SERVE_TOKEN`); see [`actions`].
//!
//! Other methods on these paths get 405, other paths 404. It listens on loopback by default;
//! put it behind your usual proxy (TLS, single sign-on) for anything else. It answers only to
//! an address, `localhost` or a `--public-url` in the `Host` header, and every answer forbids
//! framing and sniffing ([`guard`]). A client has `--header-read-timeout` to send its headers
//! (hyper closes the connection after that), so idle or slow connections cannot pile up. The
//! accept loop pauses after a failed accept (EMFILE), so running out of descriptors does not
//! make it spin.
//!
//! Every page, fragment, `/api/status` and `/metrics` request reads the same snapshot: while
//! one is being read, the requests that arrive wait for it and share it, so a burst of scrapes
//! costs one read of the database rather than one per request (which emptied the pool).

mod actions;
mod guard;
mod render;

use lockstep_core::perspective_store::prelude::*;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use axum::Router;
use axum::extract::{ConnectInfo, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use lockstep_core::TransactionSource;
use lockstep_observe::Observed;
use lockstep_pg::PgDatabase;
use lockstep_pg_store::PgPerspectiveStore;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::ops::{advisory_rows, lease_rows, parked_json, status_rows};
use crate::pg::DbUrl;
use crate::{bad_argument, say};

/// The shortest token accepted for the page's actions.
const MIN_TOKEN_CHARS: usize = 16;

/// What every request shares.
pub(crate) struct Shared {
    db: PgDatabase,
    metrics: PrometheusHandle,
    names: Vec<String>,
    database: String,
    /// The operator's token; `None`: actions are disabled.
    token: Option<String>,
    /// Actions asked for and not yet confirmed: nonce → (action, when asked).
    pending: Mutex<HashMap<String, (actions::Action, Instant)>>,
    /// The hosts and origins the page answers to.
    guard: guard::Guard,
    /// The snapshot being read, if one is: its result once read (`None` until then).
    reading: Mutex<Option<watch::Receiver<Option<Read>>>>,
}

/// A snapshot read once and shared by every request that waited for it.
type Read = Arc<std::result::Result<Snapshot, Unavailable>>;

/// `lockstep serve`'s options.
pub(crate) struct ServeOptions {
    /// Where to listen.
    pub(crate) addr: String,
    /// Advisory keys the operator names.
    pub(crate) names: Vec<String>,
    /// The actions' token.
    pub(crate) token: Option<String>,
    /// The URLs people reach the page at besides its address and `localhost`.
    pub(crate) public_urls: Vec<String>,
    /// How long a client has to send a request's headers.
    pub(crate) header_read_timeout: Duration,
}

/// Serves until Ctrl-C. Starts also while the database is unreachable (the page says so and
/// recovers when it comes back).
pub(crate) async fn serve(url: &DbUrl, options: ServeOptions, json: bool) -> Result<ExitCode> {
    if let Some(token) = &options.token
        && token.trim().chars().count() < MIN_TOKEN_CHARS
    {
        return Err(bad_argument(format!(
            "the actions' token (LOCKSTEP_SERVE_TOKEN / --token) must have at least \
             {MIN_TOKEN_CHARS} characters"
        )));
    }
    let guard = guard::Guard::new(&options.public_urls).map_err(bad_argument)?;
    let listener = listen("--addr", &options.addr).await?;
    let metrics =
        lockstep_observe::prometheus::install().context("installing the metrics recorder")?;
    let db = url.handle_lazy(4, "lockstep serve")?;
    let shared = Arc::new(Shared {
        db,
        metrics,
        names: options.names,
        database: url.database().to_owned(),
        token: options.token.map(|t| t.trim().to_owned()),
        pending: Mutex::new(HashMap::new()),
        guard,
        reading: Mutex::new(None),
    });
    let bound = listener.local_addr()?;
    let actions_on = shared.token.is_some();
    if json {
        say!(
            "{}",
            json!({
                "page": format!("http://{bound}/"),
                "metrics": format!("http://{bound}/metrics"),
                "database": url.database(),
                "actions": actions_on,
            })
        );
    } else {
        say!(
            "serving the status page on http://{bound}/ (metrics on /metrics; actions {}; \
             Ctrl-C stops it)",
            if actions_on {
                "enabled with the configured token"
            } else {
                "disabled: no token configured"
            }
        );
    }
    run(listener, router(shared), options.header_read_timeout).await;
    Ok(ExitCode::SUCCESS)
}

/// How long a Ctrl-C waits for the requests in flight.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Accepts connections until Ctrl-C and serves each on a task of its own with hyper: its
/// headers within `header_read_timeout` or the connection is closed. On Ctrl-C it stops
/// accepting and lets the requests in flight finish (within [`SHUTDOWN_GRACE`]).
async fn run(mut listener: TcpListener, app: Router, header_read_timeout: Duration) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let stop = tokio::signal::ctrl_c();
    tokio::pin!(stop);
    loop {
        let (io, peer) = tokio::select! {
            // axum's accept pauses after a failed accept (EMFILE) instead of spinning.
            accepted = axum::serve::Listener::accept(&mut listener) => accepted,
            _ = &mut stop => break,
        };
        let app = app.clone();
        let service = hyper::service::service_fn(
            move |mut request: hyper::Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(ConnectInfo(peer));
                let mut app = app.clone();
                async move { tower_service::Service::call(&mut app, request).await }
            },
        );
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(header_read_timeout)
            .serve_connection(hyper_util::rt::TokioIo::new(io), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(%peer, error = %err, "connection closed");
            }
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await;
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/fragment", get(fragment))
        .route("/api/status", get(api_status))
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(healthz))
        .route("/actions", post(actions::handle))
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                "not found (GET /, /fragment, /api/status, /metrics, /healthz; POST /actions)\n",
            )
        })
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&shared),
            guard::check_host,
        ))
        .layer(axum::middleware::from_fn(guard::security_headers))
        .with_state(shared)
}

/// A listener on `addr`, the value of the option `flag`. An address that does not parse or
/// resolve, or is not one of this machine's, is a bad argument (exit 2); a port in use or
/// refused is another error.
pub(crate) async fn listen(flag: &str, addr: &str) -> Result<TcpListener> {
    let refused = |why: String| {
        bad_argument(format!(
            "{flag} {addr:?}: {why}; expected host:port to listen on, e.g. 127.0.0.1:7878 \
             (port 0 picks a free one)"
        ))
    };
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| refused(format!("not an address ({e})")))?
        .collect();
    if addrs.is_empty() {
        return Err(refused("it resolves to no address".to_owned()));
    }
    match TcpListener::bind(&addrs[..]).await {
        Ok(listener) => Ok(listener),
        Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
            Err(refused(format!("not an address of this machine ({e})")))
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("listening on {addr} ({flag})"))),
    }
}

/// Everything the page shows, read in one go.
pub(crate) struct Snapshot {
    leases: Vec<Value>,
    /// The worker instances (`lockstep workers --json` rows).
    workers: Vec<Value>,
    advisory: Vec<Value>,
    perspectives: Vec<Value>,
    /// Every version of every perspective (`perspectives versions --json` rows).
    versions: Vec<Value>,
    parked: Vec<Value>,
    /// How long reading it took.
    took_ms: f64,
}

impl Snapshot {
    fn json(&self) -> Value {
        json!({
            "leases": self.leases,
            "workers": self.workers,
            "advisory_locks": render::group_advisory(&self.advisory),
            "perspectives": self.perspectives,
            "versions": self.versions,
            "parked": self.parked,
            "summary": render::summary(self),
            "took_ms": self.took_ms,
        })
    }
}

/// Why the page cannot show the database.
enum Unavailable {
    /// The server does not answer.
    Unreachable(String),
    /// lockstep's schema is missing or incomplete.
    NotMigrated(String),
}

impl Unavailable {
    fn message(&self) -> &str {
        match self {
            Unavailable::Unreachable(m) | Unavailable::NotMigrated(m) => m,
        }
    }
}

/// The snapshot: the one being read if there is one (shared with every request waiting for
/// it), else a new read. The read runs on a task of its own, so it finishes (and gives its
/// connections back) even when every request waiting for it is gone.
async fn snapshot(shared: &Arc<Shared>) -> Read {
    let mut read = {
        let mut reading = shared
            .reading
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Still being read: the value is not in yet and the task that sends it is alive.
        match reading.as_ref() {
            Some(read) if read.borrow().is_none() && read.has_changed().is_ok() => {
                tracing::debug!(target: "lockstep::serve", "joins the snapshot being read");
                read.clone()
            }
            _ => {
                tracing::debug!(target: "lockstep::serve", "reads a snapshot");
                let (sender, read) = watch::channel(None);
                let from = Arc::clone(shared);
                tokio::spawn(async move {
                    let snapshot = read_snapshot(&from).await;
                    let _ = sender.send(Some(Arc::new(snapshot)));
                });
                *reading = Some(read.clone());
                read
            }
        }
    };
    let lost = || {
        Arc::new(Err(Unavailable::Unreachable(
            "reading the snapshot failed; the next refresh tries again".to_owned(),
        )))
    };
    match read.wait_for(Option::is_some).await {
        Ok(value) => value.clone().unwrap_or_else(lost),
        Err(_) => lost(),
    }
}

async fn read_snapshot(shared: &Shared) -> std::result::Result<Snapshot, Unavailable> {
    let started = Instant::now();
    // Schema first: a database that is not migrated answers every read with an error that
    // says less than this.
    match shared.db.migration_status().await {
        Err(e) => return Err(Unavailable::Unreachable(format!("{e}"))),
        Ok(status) if !status.is_up_to_date() => {
            return Err(Unavailable::NotMigrated(format!(
                "the lockstep schema in {} is not up to date: run `lockstep migrate` (this page \
                 recovers by itself once it is)",
                shared.database
            )));
        }
        Ok(_) => {}
    }
    let read = async {
        let pool = shared.db.pool();
        let leases = lease_rows(pool).await?;
        let advisory = advisory_rows(pool, &shared.names).await?;
        let mut perspectives = status_rows(pool).await?;
        let versions = crate::versions::version_rows(pool, None, &perspectives).await?;
        crate::versions::mark_versions(&mut perspectives, &versions);
        let parked = parked_rows(&shared.db).await?;
        let workers: Vec<Value> = crate::workers::instances(pool)
            .await?
            .iter()
            .map(|e| crate::workers::entry_json(e, &leases))
            .collect();
        Ok::<_, anyhow::Error>((leases, workers, advisory, perspectives, versions, parked))
    };
    match read.await {
        Ok((mut leases, workers, advisory, perspectives, versions, parked)) => Ok(Snapshot {
            leases: {
                started_and_progress(&mut leases, &perspectives);
                leases
            },
            workers,
            advisory,
            perspectives,
            versions,
            parked,
            took_ms: started.elapsed().as_secs_f64() * 1000.0,
        }),
        Err(e) => Err(Unavailable::Unreachable(format!("{e:#}"))),
    }
}

/// Gives each lease row its `started_at` and, for a running rewind, its `progress`.
///
/// The start is the lease's own `acquired_at` (the try-acquire that begins an epoch records
/// it; ADR 0021): `"started_at_source": "lease"`. A lease whose start is not recorded has none;
/// a running rewind's progress report (ADR 0016 §4) then dates it, since a
/// report is listed only while the lease it was made under is live with the same holder and
/// epoch: `"rewind_progress"`, a moment after the lease was taken. Otherwise `"started_at":
/// null` with `"not_recorded"`, which the page says in words rather than guessing a time.
fn started_and_progress(leases: &mut [Value], perspectives: &[Value]) {
    for lease in leases.iter_mut() {
        let running = perspectives
            .iter()
            .filter(|p| p["perspective"] == lease["perspective"])
            .filter_map(|p| p["rewinds_running"].as_array())
            .flatten()
            .find(|r| r["stream_id"] == lease["stream_id"] && r["holder"] == lease["holder"]);
        let progress = running.map_or(Value::Null, |r| {
            json!({
                "replayed": r["replayed"], "to_replay": r["to_replay"],
                "percent": r["percent"], "running_s": r["running_s"],
                "reported_s_ago": r["reported_s_ago"],
            })
        });
        let (started_at, source) = match (&lease["acquired_at"], running) {
            (Value::String(at), _) => (json!(at), "lease"),
            (_, Some(r)) if r["started_at"].is_string() => {
                (r["started_at"].clone(), "rewind_progress")
            }
            _ => (Value::Null, "not_recorded"),
        };
        let held_s = match (source, &lease["held_for_ms"], running) {
            ("lease", Value::Number(ms), _) => json!(ms.as_f64().unwrap_or(0.0) / 1000.0),
            ("rewind_progress", _, Some(r)) => r["running_s"].clone(),
            _ => Value::Null,
        };
        if let Some(row) = lease.as_object_mut()
            && !row.contains_key("error")
        {
            row.insert("started_at".to_owned(), started_at);
            row.insert("started_at_source".to_owned(), json!(source));
            row.insert("held_s".to_owned(), held_s);
            row.insert("progress".to_owned(), progress);
        }
    }
}

/// The parked pairs, at most 100.
async fn parked_rows(db: &PgDatabase) -> Result<Vec<Value>> {
    let tx = db.begin().await?;
    let parked = Observed::new(PgPerspectiveStore::new())
        .parked_pairs(&tx, &[], 100)
        .await;
    // Read only: a rollback that fails still ends it, and changes nothing.
    crate::pg::rollback(tx, "a read of the parked pairs").await;
    Ok(parked?.iter().map(parked_json).collect())
}

async fn page(State(shared): State<Arc<Shared>>) -> Html<String> {
    let body = match &*snapshot(&shared).await {
        Ok(snap) => render::fragment(snap, shared.token.is_some()),
        Err(why) => render::unavailable(why.message()),
    };
    Html(render::page(
        &shared.database,
        &body,
        shared.token.is_some(),
    ))
}

async fn fragment(State(shared): State<Arc<Shared>>) -> Response {
    match &*snapshot(&shared).await {
        Ok(snap) => Html(render::fragment(snap, shared.token.is_some())).into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Html(render::unavailable(why.message())),
        )
            .into_response(),
    }
}

async fn api_status(State(shared): State<Arc<Shared>>) -> Response {
    match &*snapshot(&shared).await {
        Ok(snap) => axum::Json(snap.json()).into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({ "error": why.message() })),
        )
            .into_response(),
    }
}

async fn healthz(State(shared): State<Arc<Shared>>) -> Response {
    let (code, body) = match shared.db.migration_status().await {
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            json!({ "database": "unreachable", "schema": "unknown", "error": format!("{e}") }),
        ),
        Ok(status) => {
            let pending = status
                .migrations
                .iter()
                .filter(|m| matches!(m.state, lockstep_pg::migrate::MigrationState::Pending))
                .count();
            let (code, schema) = if status.is_up_to_date() {
                (StatusCode::OK, "up_to_date")
            } else if pending == status.migrations.len() {
                (StatusCode::SERVICE_UNAVAILABLE, "missing")
            } else {
                (StatusCode::SERVICE_UNAVAILABLE, "not_up_to_date")
            };
            (
                code,
                json!({ "database": "reachable", "schema": schema, "pending_migrations": pending }),
            )
        }
    };
    (
        code,
        [(header::CACHE_CONTROL, "no-store")],
        axum::Json(body),
    )
        .into_response()
}

/// `# HELP` and the samples of one gauge family: `(label, value)` pairs, `None` for an
/// unlabelled sample.
fn gauge_family<'a>(
    out: &mut String,
    name: &str,
    help: &str,
    label: &str,
    samples: impl IntoIterator<Item = (Option<&'a str>, f64)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    for (value_of_label, value) in samples {
        let value = if value.is_finite() {
            format!("{value}")
        } else if value.is_nan() {
            "NaN".to_owned()
        } else if value > 0.0 {
            "+Inf".to_owned()
        } else {
            "-Inf".to_owned()
        };
        match value_of_label {
            Some(v) => {
                let v = v
                    .replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n");
                let _ = writeln!(out, "{name}{{{label}=\"{v}\"}} {value}");
            }
            None => {
                let _ = writeln!(out, "{name} {value}");
            }
        }
    }
}

/// The gauges a scrape reads from the database, in the Prometheus text format.
///
/// Rendered from this scrape's snapshot alone rather than set on the global recorder: a
/// recorder keeps a gauge at its last value until the process ends, so a perspective retired
/// (or a `time_to_empty` that became unknown) would go on being exported as it last was, and
/// alerts on it would never clear. Each family has `# HELP` and `# TYPE`; a perspective that is
/// gone has no series.
fn database_gauges(snap: &Snapshot) -> String {
    let mut out = String::new();
    let count = |status: &str| snap.leases.iter().filter(|l| l["status"] == status).count() as f64;
    for (name, help, status) in [
        (
            "lockstep_stream_leases_held",
            "Stream leases held now (not expired).",
            "held",
        ),
        (
            "lockstep_stream_leases_expired",
            "Stream leases whose holder stopped renewing; any instance may take them over.",
            "expired",
        ),
        (
            "lockstep_stream_leases_unreadable",
            "Lease rows lockstep cannot read (written by hand).",
            "unreadable",
        ),
    ] {
        gauge_family(&mut out, name, help, "", [(None, count(status))]);
    }
    let workers = |state: &str| snap.workers.iter().filter(|w| w["state"] == state).count() as f64;
    gauge_family(
        &mut out,
        "lockstep_worker_instances",
        "Announced worker instances, by state (live: seen within its lock timeout; stale; \
         unreadable: a row lockstep cannot read, written by hand).",
        "state",
        [
            (Some("live"), workers("live")),
            (Some("stale"), workers("stale")),
            (Some("unreadable"), workers("unreadable")),
        ],
    );
    let name = |p: &Value| p["perspective"].as_str().unwrap_or("").to_owned();
    let names: Vec<String> = snap.perspectives.iter().map(name).collect();
    let per_perspective =
        |out: &mut String, family: &str, help: &str, value: &dyn Fn(&Value) -> Option<f64>| {
            gauge_family(
                out,
                family,
                help,
                "perspective",
                snap.perspectives
                    .iter()
                    .zip(&names)
                    .filter_map(|(p, n)| value(p).map(|v| (Some(n.as_str()), v))),
            );
        };
    let get = |key: &'static str| move |p: &Value| Some(p[key].as_f64().unwrap_or(0.0));
    let running =
        |p: &Value| -> Vec<Value> { p["rewinds_running"].as_array().cloned().unwrap_or_default() };
    per_perspective(
        &mut out,
        "lockstep_perspective_pending_events",
        "Events queued for a perspective and not applied yet.",
        &get("pending_events"),
    );
    per_perspective(
        &mut out,
        "lockstep_perspective_lag_seconds",
        "Age of a perspective's oldest pending work, in seconds.",
        &get("lag_s"),
    );
    per_perspective(
        &mut out,
        "lockstep_perspective_rewinds_pending",
        "Pairs of a perspective with a rewind requested.",
        &get("rewinds_pending"),
    );
    per_perspective(
        &mut out,
        "lockstep_perspective_pairs_parked",
        "Pairs of a perspective parked after failing too often in a row.",
        &get("parked"),
    );
    per_perspective(
        &mut out,
        "lockstep_perspective_pairs_backing_off",
        "Pairs of a perspective waiting out their failure backoff.",
        &get("backing_off"),
    );
    per_perspective(
        &mut out,
        "lockstep_perspective_pairs_in_error",
        "Pairs of a perspective whose last attempt failed.",
        &get("in_error"),
    );
    per_perspective(
        &mut out,
        "lockstep_perspective_live_workers",
        "Live worker instances that run a perspective.",
        &|p| Some(p["live_workers"].as_array().map_or(0, Vec::len) as f64),
    );
    per_perspective(
        &mut out,
        "lockstep_perspective_applied_events_per_second",
        "Events applied per second to a perspective by every worker together, over the last window of at least 10 s.",
        &get("applied_per_s"),
    );
    per_perspective(
        &mut out,
        "lockstep_perspective_time_to_empty_seconds",
        "Seconds until a perspective's pending events are applied at its current rate (absent while nothing is applied).",
        &|p| p["time_to_empty_s"].as_f64(),
    );
    per_perspective(
        &mut out,
        "lockstep_perspective_rewinds_running",
        "Rewinds of a perspective running now (their worker reported progress under a live lease).",
        &|p| Some(running(p).len() as f64),
    );
    per_perspective(
        &mut out,
        "lockstep_perspective_rewind_events_remaining",
        "Events the running rewinds of a perspective still have to replay, at their last progress report.",
        &|p| {
            Some(
                running(p)
                    .iter()
                    .map(|r| {
                        r["to_replay"].as_f64().unwrap_or(0.0)
                            - r["replayed"].as_f64().unwrap_or(0.0)
                    })
                    .sum(),
            )
        },
    );
    out
}

async fn metrics_text(State(shared): State<Arc<Shared>>) -> Response {
    match &*snapshot(&shared).await {
        Ok(snap) => {
            // The page's own calls (the observe layer's counters and histograms), then the
            // database's gauges.
            let mut body = shared.metrics.render();
            if !body.is_empty() && !body.ends_with('\n') {
                body.push('\n');
            }
            body.push_str(&database_gauges(snap));
            ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
        }
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{}\n", why.message()),
        )
            .into_response(),
    }
}
