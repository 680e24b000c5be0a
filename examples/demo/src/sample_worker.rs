//! `lockstep-demo worker`: a perspective worker process for the sample `Ledger` perspective, until
//! Ctrl-C or SIGTERM (then it releases its leases). What an application's worker process looks
//! like, and what the multi-process tests and the status page's tests run.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use axum::Router;
use axum::routing::get;
use clap::Args;
use lockstep_core::{Fleet, InstanceId, PerspectiveRegistry, StreamLockOptions};
use lockstep_pg_store::PgPerspectiveStore;
use lockstep_pg_stream::PgStreamLocker;
use lockstep_worker::{CancellationToken, PerspectiveWorker, WorkerOptions};
use tokio::net::TcpListener;
use uuid::Uuid;

use lockstep_observe::Observed;

use crate::db_url::DbUrl;
use crate::ledger::{LEDGER, Ledger};
use crate::{bad_argument, say};

/// `lockstep-demo worker`
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

/// Runs the sample worker on `url` until a signal.
pub(crate) async fn run(url: &DbUrl, args: WorkerArgs) -> Result<ExitCode> {
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
    if let Some(addr) = &args.metrics_addr {
        let listener = listen(addr).await?;
        let bound = metrics_endpoint(listener)?;
        say!("metrics on http://{bound}/metrics");
    }
    let db = url.handle(8).await?;
    if !args.register_sample && !sample_registered(&db).await? {
        return Err(bad_argument(format!(
            "the sample perspective `{LEDGER}` is not registered in {}: `lockstep-demo worker` \
             runs only that sample, and registering it makes every event appended to this \
             database queue work for it from then on; pass --register-sample to register it (a \
             database of its own, never an application's)",
            url.database()
        )));
    }
    let ledger = Ledger::default();
    ledger
        .slow
        .store(args.slow_apply_us, std::sync::atomic::Ordering::SeqCst);
    let mut registry = PerspectiveRegistry::new();
    registry.register(ledger)?;
    // The one telemetry layer, wired here at the composition root: a span and metrics per call
    // of the locker and the store (the backends report none of their own).
    // The locker keeps the fleet too: the worker takes its leases through it and announces
    // itself.
    let fleet: Arc<dyn Fleet> = Arc::new(Observed::new(PgStreamLocker::new(&db, options)));
    let worker = PerspectiveWorker::new(
        db.clone(),
        Observed::new(PgPerspectiveStore::new()),
        registry,
        WorkerOptions::default(),
        instance,
        None,
    )?
    .with_fleet(fleet);
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
    worker.run(shutdown).await?;
    say!("worker {instance} stopped; its leases are released");
    Ok(ExitCode::SUCCESS)
}

/// A listener on `addr`; an address that does not parse or is not this machine's is a bad
/// argument.
async fn listen(addr: &str) -> Result<TcpListener> {
    let refused = |why: String| {
        bad_argument(format!(
            "--metrics-addr {addr:?}: {why}; expected host:port to listen on, e.g. \
             127.0.0.1:9100 (port 0 picks a free one)"
        ))
    };
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host(addr)
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
        Err(e) => Err(anyhow!(e).context(format!("listening on {addr} (--metrics-addr)"))),
    }
}

/// Serves `/metrics` (and `/healthz`) from a Prometheus recorder installed now, in a background
/// task. axum's accept loop pauses a second after a failed accept (EMFILE), so running out of
/// descriptors does not make it spin.
fn metrics_endpoint(listener: TcpListener) -> Result<std::net::SocketAddr> {
    let metrics =
        lockstep_observe::prometheus::install().context("installing the metrics recorder")?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let body = metrics.render();
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4",
                        )],
                        body,
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("the metrics endpoint stopped: {e}");
        }
    });
    Ok(bound)
}

/// Whether the sample `Ledger` perspective is registered in `db`.
async fn sample_registered(db: &lockstep_pg::PgDatabase) -> Result<bool> {
    let client = db.checkout().await?;
    let row = client
        .query_opt(
            "SELECT 1 FROM wh_perspectives WHERE perspective_name = $1",
            &[&LEDGER],
        )
        .await
        .map_err(|e| {
            let e = lockstep_pg::map_error(e, "reading the registered perspectives");
            anyhow!("{e}; is the database migrated (`lockstep migrate`)?")
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
