//! A primary and a streaming standby of their own ([`ReplicatedPair`]), for the failover
//! scenarios ([`super::failover`]): two private clusters ([`super::server`]) on two ports of
//! 127.0.0.1, the standby made with `pg_basebackup` and streaming from the primary, replication
//! synchronous (`synchronous_standby_names` names the standby, `synchronous_commit = on`: a
//! commit is acknowledged once the standby has flushed it) or asynchronous.
//!
//! A failover is what a crash of the primary's machine does to the database: every process of
//! the primary is killed at once (`pg_ctl stop -m immediate`, so the clients' connections break
//! rather than hang), then the standby is promoted (`pg_ctl promote`, waiting until it accepts
//! writes). [`ReplicatedPair::rebuild_standby`] then makes a new standby of the new primary on
//! the old primary's port, so the pair's two ports stay the same and one multi-host URL
//! ([`ReplicatedPair::url`], `target_session_attrs=read-write`) reaches whichever server is the
//! primary through any number of failovers.
//!
//! With synchronous replication, a promoted primary has no standby yet: it runs asynchronous
//! until its new standby streams, then synchronous again (`synchronous_standby_names` set with
//! `ALTER SYSTEM` and a reload) — what Patroni's non-strict `synchronous_mode` does, so that
//! the new primary accepts commits at once instead of waiting for a standby that does not
//! exist yet.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tokio_postgres::{Client, Config, NoTls};

use super::server::{PrivateServer, StopMode};

/// The standby's `application_name`, which `synchronous_standby_names` names.
const STANDBY_NAME: &str = "lockstep_standby";
/// How long a standby gets to connect and stream after it starts.
const STANDBY_WAIT: Duration = Duration::from_secs(60);

/// How commits wait for the standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// A commit is acknowledged once the standby has flushed its WAL (`synchronous_commit =
    /// on` with the standby named in `synchronous_standby_names`).
    Synchronous,
    /// A commit is acknowledged once the primary has it; the standby follows as fast as it can.
    Asynchronous,
}

impl Replication {
    /// `synchronous` or `asynchronous`, for reports.
    pub fn name(self) -> &'static str {
        match self {
            Replication::Synchronous => "synchronous",
            Replication::Asynchronous => "asynchronous",
        }
    }
}

/// What a failover took and what it left behind.
#[derive(Debug, Clone, Copy)]
pub struct Failover {
    /// How long `pg_ctl promote` took.
    pub promotion: Duration,
    /// The primary's WAL the standby had not flushed just before the kill, in bytes (`None`:
    /// the standby was not connected). With synchronous replication, no acknowledged commit
    /// is in it.
    pub unflushed_bytes: Option<i64>,
}

/// A primary and its standby; dropped, both are stopped and removed.
#[derive(Debug)]
pub struct ReplicatedPair {
    replication: Replication,
    primary: PrivateServer,
    /// `None` between a failover and the next [`ReplicatedPair::rebuild_standby`].
    standby: Option<PrivateServer>,
    /// The old primary after a failover (stopped), until its port is reused.
    retired: Option<PrivateServer>,
    failovers: u64,
}

impl ReplicatedPair {
    /// Starts a primary and a standby streaming from it, and waits until the primary sees the
    /// standby streaming (as its synchronous standby when `replication` is synchronous).
    pub async fn start(replication: Replication) -> anyhow::Result<ReplicatedPair> {
        let primary = PrivateServer::start_with(&[])
            .await
            .context("starting the primary")?;
        let standby = PrivateServer::standby_of(&primary, STANDBY_NAME, None, &[])
            .await
            .context("starting the standby")?;
        let pair = ReplicatedPair {
            replication,
            primary,
            standby: Some(standby),
            retired: None,
            failovers: 0,
        };
        pair.wait_for_standby().await?;
        Ok(pair)
    }

    /// How commits wait for the standby.
    pub fn replication(&self) -> Replication {
        self.replication
    }

    /// How many failovers the pair went through.
    pub fn failovers(&self) -> u64 {
        self.failovers
    }

    /// The two ports, in a fixed order (whichever server is the primary).
    fn ports(&self) -> Vec<u16> {
        let mut ports: Vec<u16> = [
            Some(self.primary.port()),
            self.standby.as_ref().map(PrivateServer::port),
            self.retired.as_ref().map(PrivateServer::port),
        ]
        .into_iter()
        .flatten()
        .collect();
        ports.sort_unstable();
        ports
    }

    /// A URL for database `db` as user `postgres` that reaches whichever server is the
    /// primary: both hosts, `target_session_attrs=read-write`, a 2 s connect timeout.
    pub fn url(&self, db: &str) -> String {
        let hosts: Vec<String> = self
            .ports()
            .iter()
            .map(|port| format!("127.0.0.1:{port}"))
            .collect();
        format!(
            "postgres://postgres@{}/{db}?target_session_attrs=read-write&connect_timeout=2",
            hosts.join(",")
        )
    }

    /// Connection settings for database `db` on the current primary only.
    pub fn primary_config(&self, db: &str) -> Config {
        let mut config = self.primary.config();
        config.dbname(db);
        config
    }

    /// A connection to database `db` on the current primary (its connection task spawned).
    pub async fn connect_primary(&self, db: &str) -> anyhow::Result<Client> {
        connect(&self.primary_config(db)).await
    }

    /// Creates database `db` on the primary (it reaches the standby by replication).
    pub async fn create_database(&self, db: &str) -> anyhow::Result<()> {
        let admin = self.connect_primary("postgres").await?;
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .with_context(|| format!("creating database {db}"))?;
        Ok(())
    }

    /// Kills the primary (every process at once) and promotes the standby; says how long the
    /// promotion took and how much WAL the standby had not flushed just before the kill. A
    /// stopped standby (see [`ReplicatedPair::stop_standby`]) is started first: it is promoted
    /// with whatever WAL it had.
    pub async fn fail_over(&mut self) -> anyhow::Result<Failover> {
        let Some(mut standby) = self.standby.take() else {
            bail!("no standby to promote: rebuild_standby after a failover");
        };
        let unflushed_bytes = self.unflushed_bytes().await.ok().flatten();
        self.primary
            .stop(StopMode::Immediate)
            .await
            .context("killing the primary")?;
        if !standby.is_running() {
            standby
                .start_again()
                .await
                .context("starting the stopped standby")?;
        }
        let started = Instant::now();
        standby.promote().await.context("promoting the standby")?;
        let promotion = started.elapsed();
        let old = std::mem::replace(&mut self.primary, standby);
        self.retired = Some(old);
        self.failovers += 1;
        if self.replication == Replication::Synchronous {
            self.set_synchronous(false).await?;
        }
        Ok(Failover {
            promotion,
            unflushed_bytes,
        })
    }

    /// The primary's WAL the standby has not flushed yet, in bytes (`None`: no standby
    /// connected).
    async fn unflushed_bytes(&self) -> anyhow::Result<Option<i64>> {
        let client = self.connect_primary("postgres").await?;
        let row = client
            .query_opt(
                "SELECT (pg_current_wal_lsn() - flush_lsn)::bigint FROM pg_stat_replication \
                 WHERE application_name = $1",
                &[&STANDBY_NAME],
            )
            .await?;
        Ok(row.map(|r| r.try_get(0)).transpose()?)
    }

    /// Makes a new standby of the current primary on the old primary's port (the old cluster
    /// is removed) and waits until it streams.
    pub async fn rebuild_standby(&mut self) -> anyhow::Result<()> {
        let Some(old) = self.retired.take() else {
            bail!("nothing to rebuild: the pair has its standby");
        };
        let port = old.port();
        drop(old);
        let standby = PrivateServer::standby_of(&self.primary, STANDBY_NAME, Some(port), &[])
            .await
            .context("rebuilding the standby")?;
        self.standby = Some(standby);
        self.wait_for_standby().await
    }

    /// Stops the standby (`-m fast`): from now on the primary's commits do not reach it. With
    /// synchronous replication, commits wait for it; use only with asynchronous replication.
    pub async fn stop_standby(&mut self) -> anyhow::Result<()> {
        match self.standby.as_mut() {
            Some(standby) => standby.stop(StopMode::Fast).await,
            None => bail!("no standby to stop"),
        }
    }

    /// Waits (bounded) until the primary's `pg_stat_replication` shows the standby streaming;
    /// with synchronous replication, then makes it the synchronous standby and waits until the
    /// primary says so.
    async fn wait_for_standby(&self) -> anyhow::Result<()> {
        self.wait_for_sync_state("async").await?;
        if self.replication == Replication::Synchronous {
            self.set_synchronous(true).await?;
            self.wait_for_sync_state("sync").await?;
        }
        Ok(())
    }

    /// Names the standby in the primary's `synchronous_standby_names` (or none), and reloads.
    async fn set_synchronous(&self, on: bool) -> anyhow::Result<()> {
        let client = self.connect_primary("postgres").await?;
        let names = if on { STANDBY_NAME } else { "" };
        // Two statements: ALTER SYSTEM refuses to run in a (multi-statement) transaction.
        client
            .batch_execute(&format!(
                "ALTER SYSTEM SET synchronous_standby_names = '{names}'"
            ))
            .await
            .context("setting synchronous_standby_names")?;
        client
            .batch_execute("SELECT pg_reload_conf()")
            .await
            .context("reloading the configuration")?;
        Ok(())
    }

    /// Waits (bounded) until the primary's `pg_stat_replication` shows the standby streaming
    /// with `sync_state = wanted`.
    async fn wait_for_sync_state(&self, wanted: &str) -> anyhow::Result<()> {
        let client = self.connect_primary("postgres").await?;
        let deadline = Instant::now() + STANDBY_WAIT;
        loop {
            let row = client
                .query_opt(
                    "SELECT sync_state FROM pg_stat_replication \
                     WHERE application_name = $1 AND state = 'streaming'",
                    &[&STANDBY_NAME],
                )
                .await
                .context("reading pg_stat_replication")?;
            let state: Option<String> = row.map(|r| r.try_get(0)).transpose()?;
            if state.as_deref() == Some(wanted) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "the standby was not streaming ({wanted}) within {STANDBY_WAIT:?} (state \
                     {state:?}); primary log: {}",
                    self.primary.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A connection with its connection task spawned.
async fn connect(config: &Config) -> anyhow::Result<Client> {
    let (client, connection) = config
        .connect(NoTls)
        .await
        .context("connecting to the primary")?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}
