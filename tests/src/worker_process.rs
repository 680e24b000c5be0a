//! One perspective worker on PostgreSQL as a process, for tests that start it and `kill -9` it:
//! the body of the `lockstep-test-worker` binary, and of `lockstep-bench test-worker` (hidden;
//! the reliability long run's `workers` scenario starts its own binary that way, since a
//! `cargo run` of the bench does not build this crate's binaries).
//!
//! ```text
//! lockstep-test-worker --database-url postgres://postgres@127.0.0.1:5432/db \
//!     --instance 0192… [--lock-timeout-ms 2000] [--keepalive-ms 500] [--poll-ms 50] \
//!     [--rewind-debounce-ms 0] [--table-rows]
//! ```
//!
//! It runs the [`Numbers`] perspective, slowed down by `LOCKSTEP_TEST_APPLY_SLEEP_MS`
//! milliseconds per applied event when that is set, and with `--table-rows` the
//! [`NumberRows`] table perspective too. It prints `ready instance=<id>` once
//! registered, and `lease rewind stream=<id> perspective=<name> epoch=<n> instance=<id>` each
//! time it acquires a `rewind` lease. It stops gracefully on SIGTERM or Ctrl-C (releasing its
//! leases) and prints `stopped instance=<id>`; `kill -9` is the crash the tests are about.

// The process's protocol with its test is its standard output.
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::Duration;

use crate::{APPLY_SLEEP_ENV, NumberRows, Numbers};
use anyhow::Context;
use async_trait::async_trait;
use clap::Parser;
use lockstep_core::{
    AcquireOutcome, Fleet, InstanceId, LeaseId, LockReason, PerspectiveName, PerspectiveRegistry,
    ReleaseOutcome, RenewOutcome, StreamId, StreamLockOptions, StreamLocker,
};
use lockstep_pg::PgDatabase;
use lockstep_pg_store::PgPerspectiveStore;
use lockstep_pg_stream::PgStreamLocker;
use lockstep_worker::{CancellationToken, PerspectiveWorker, WorkerOptions};

/// A perspective worker process for lockstep's multi-process tests.
#[derive(Parser, Debug, Clone)]
#[command(name = "lockstep-test-worker")]
pub struct Args {
    /// The database (already migrated).
    #[arg(long)]
    pub database_url: String,
    /// This process's instance id (a UUID).
    #[arg(long)]
    pub instance: uuid::Uuid,
    /// Lease lock timeout.
    #[arg(long, default_value_t = 2000)]
    pub lock_timeout_ms: u64,
    /// Keepalive interval (less than half the lock timeout).
    #[arg(long, default_value_t = 500)]
    pub keepalive_ms: u64,
    /// Idle poll interval.
    #[arg(long, default_value_t = 50)]
    pub poll_ms: u64,
    /// The worker's `rewind_debounce` (0: none).
    #[arg(long, default_value_t = 0)]
    pub rewind_debounce_ms: u64,
    /// Also run the [`NumberRows`] table perspective (its table must exist).
    #[arg(long)]
    pub table_rows: bool,
}

/// Announces every `rewind` lease it acquires on standard output, then behaves exactly like the
/// locker it wraps.
struct Announcing {
    inner: PgStreamLocker,
}

#[async_trait]
impl StreamLocker for Announcing {
    fn options(&self) -> StreamLockOptions {
        self.inner.options()
    }

    async fn try_acquire(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        instance: InstanceId,
        reason: &LockReason,
    ) -> lockstep_core::Result<AcquireOutcome> {
        let outcome = self
            .inner
            .try_acquire(stream_id, perspective, instance, reason)
            .await?;
        if let (AcquireOutcome::Acquired(lease), LockReason::Rewind) = (&outcome, reason) {
            println!(
                "lease rewind stream={stream_id} perspective={perspective} epoch={} instance={instance}",
                lease.id.epoch.get()
            );
        }
        Ok(outcome)
    }

    async fn renew(&self, lease: &LeaseId) -> lockstep_core::Result<RenewOutcome> {
        self.inner.renew(lease).await
    }

    async fn release(&self, lease: &LeaseId) -> lockstep_core::Result<ReleaseOutcome> {
        self.inner.release(lease).await
    }

    async fn renew_many(&self, leases: &[LeaseId]) -> lockstep_core::Result<Vec<RenewOutcome>> {
        self.inner.renew_many(leases).await
    }
}

// The fleet (ADR 0015): forwarded, so the process is listed by `lockstep workers` and a killed
// one goes stale.
#[async_trait]
impl Fleet for Announcing {
    async fn announce(
        &self,
        announcement: &lockstep_core::InstanceAnnouncement,
    ) -> lockstep_core::Result<()> {
        self.inner.announce(announcement).await
    }

    async fn keepalive(
        &self,
        instance: InstanceId,
        token: lockstep_core::Uuid,
        leases: &[LeaseId],
    ) -> lockstep_core::Result<lockstep_core::KeepaliveOutcome> {
        self.inner.keepalive(instance, token, leases).await
    }

    async fn depart(
        &self,
        instance: InstanceId,
        token: lockstep_core::Uuid,
    ) -> lockstep_core::Result<bool> {
        self.inner.depart(instance, token).await
    }
}

/// Runs the worker until SIGTERM or Ctrl-C (then drains and releases its leases), printing the
/// protocol lines described in the module docs.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let config: tokio_postgres::Config = args.database_url.parse().context("database URL")?;
    let manager = deadpool_postgres::Manager::from_config(
        config,
        tokio_postgres::NoTls,
        deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        },
    );
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(4)
        .build()
        .context("pool")?;
    let lock_options = StreamLockOptions::new(
        Duration::from_millis(args.lock_timeout_ms),
        Duration::from_millis(args.keepalive_ms),
    )?;
    let sleep_ms: u64 = match std::env::var(APPLY_SLEEP_ENV) {
        Ok(v) => v
            .parse()
            .with_context(|| format!("{APPLY_SLEEP_ENV}={v}"))?,
        Err(_) => 0,
    };
    let mut registry = PerspectiveRegistry::new();
    registry.register(Numbers::slowed(Duration::from_millis(sleep_ms)))?;
    if args.table_rows {
        registry.register_table::<lockstep_pg::PgTransaction, _>(NumberRows)?;
    }
    let fleet: Arc<dyn Fleet> = Arc::new(Announcing {
        inner: PgStreamLocker::from_pool(pool.clone(), lock_options),
    });
    let options = WorkerOptions::default()
        .with_poll_interval(Duration::from_millis(args.poll_ms))
        .with_rewind_debounce(Duration::from_millis(args.rewind_debounce_ms));
    let instance = InstanceId::from_uuid(args.instance)?;
    let worker = PerspectiveWorker::new(
        PgDatabase::from_pool(pool),
        PgPerspectiveStore::new(),
        registry,
        options,
        instance,
        None,
    )?
    .with_fleet(fleet);
    // The handlers exist before `ready` is printed: a SIGTERM sent right after it must stop the
    // worker gracefully, not kill it with the default action.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("installing the SIGINT handler")?;
    worker.register().await?;
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = interrupt.recv() => {}
        }
        stop.cancel();
    });
    println!("ready instance={instance}");
    worker.run(shutdown).await?;
    println!("stopped instance={instance}");
    Ok(())
}
