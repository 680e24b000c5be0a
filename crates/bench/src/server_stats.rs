//! What the *server* did while one side of a comparison ran: the statements it executed
//! ([`StatementCounter`]) and the time it spent executing them ([`ServerTime`]).
//!
//! Counting the statements the *server* executed while one side of a comparison ran, so the
//! "one statement per operation" claim is measured, not assumed.
//!
//! - With `pg_stat_statements` in `shared_preload_libraries`: the sum of `calls` of the
//!   statements on the benchmark's tables in the benchmark database.
//! - Otherwise: `pg_stat_database.xact_commit + xact_rollback` of the benchmark database. Every
//!   statement sent outside an explicit transaction is its own transaction, so this counts
//!   statements; it also counts each connection's set-up and statement preparation (a few per
//!   connection, well under 1 % of a run). Backends publish these counters when they exit, so
//!   every reading first waits until no client is connected to the benchmark database.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio_postgres::Client;

use crate::bench_db::BenchDatabase;

/// Where the counts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// `pg_stat_statements.calls`.
    PgStatStatements,
    /// `pg_stat_database.xact_commit + xact_rollback`.
    Transactions,
}

/// Reads statement counts of one benchmark database.
pub(crate) struct StatementCounter {
    source: Source,
    admin: Client,
    database: String,
    table_filter: String,
}

impl StatementCounter {
    /// Picks the best source the server offers. `table` names the benchmark's table (used to
    /// pick its statements out of `pg_stat_statements`).
    pub(crate) async fn new(db: &BenchDatabase, table: &str) -> Result<StatementCounter> {
        let admin = db.admin_client().await?;
        let preload: String = admin
            .query_one("SHOW shared_preload_libraries", &[])
            .await?
            .get(0);
        let source = if preload
            .split(',')
            .any(|lib| lib.trim().trim_matches('"') == "pg_stat_statements")
        {
            let client = db.client().await?;
            client
                .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                .await
                .context("creating pg_stat_statements")?;
            Source::PgStatStatements
        } else {
            Source::Transactions
        };
        Ok(StatementCounter {
            source,
            admin,
            database: db.name().to_owned(),
            table_filter: format!("%{table}%"),
        })
    }

    /// A sentence saying how statements were counted.
    pub(crate) fn describe(&self) -> &'static str {
        match self.source {
            Source::PgStatStatements => {
                "statements/op = pg_stat_statements calls on the benchmark table / ops"
            }
            Source::Transactions => {
                "statements/op = pg_stat_database (xact_commit + xact_rollback) delta / ops \
                 (pg_stat_statements is not in shared_preload_libraries; every statement runs \
                 in its own transaction; connection set-up and statement preparation included)"
            }
        }
    }

    /// The current count, once every client of the benchmark database has gone.
    pub(crate) async fn read(&self, db: &BenchDatabase) -> Result<u64> {
        self.wait_for_no_clients().await?;
        match self.source {
            Source::Transactions => self.read_transactions().await,
            Source::PgStatStatements => {
                // The view lives in the benchmark database; ask there on a short-lived
                // connection (its own statements do not match the table filter).
                let client = db.client().await?;
                let calls: i64 = client
                    .query_one(
                        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
                          WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1) \
                            AND query LIKE $2",
                        &[&self.database, &self.table_filter],
                    )
                    .await
                    .context("reading pg_stat_statements")?
                    .get(0);
                Ok(u64::try_from(calls).unwrap_or(0))
            }
        }
    }

    async fn wait_for_no_clients(&self) -> Result<()> {
        for _ in 0..200 {
            let clients: i64 = self
                .admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                      WHERE datname = $1 AND backend_type = 'client backend'",
                    &[&self.database],
                )
                .await?
                .get(0);
            if clients == 0 {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        bail!("clients of the benchmark database did not disconnect")
    }

    async fn read_transactions(&self) -> Result<u64> {
        // Exiting backends flush their counters on the way out; wait until two readings agree.
        let mut last = None;
        for _ in 0..40 {
            let row = self
                .admin
                .query_one(
                    "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database \
                      WHERE datname = $1",
                    &[&self.database],
                )
                .await?;
            let now: i64 = row.get(0);
            if last == Some(now) {
                return Ok(u64::try_from(now).unwrap_or(0));
            }
            last = Some(now);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("pg_stat_database did not settle")
    }
}

/// Reads the time the server spent executing statements in one benchmark database:
/// `pg_stat_database.active_time` (PostgreSQL 14 and later), the sum over its backends of the
/// time each spent in the `active` state — from a statement's Bind (or Query) to the
/// `ReadyForQuery` after it, so parse, plan, execution and, outside an explicit transaction,
/// the commit; never the client's time or the network's. Backends publish it when they exit,
/// so every reading first waits until no client is connected to the benchmark database and
/// the counter has settled.
pub(crate) struct ServerTime {
    admin: Client,
    database: String,
}

impl ServerTime {
    /// A reader of `db`'s active time, over a connection to the admin database (whose own
    /// statements do not count in the benchmark database).
    pub(crate) async fn new(db: &BenchDatabase) -> Result<ServerTime> {
        Ok(ServerTime {
            admin: db.admin_client().await?,
            database: db.name().to_owned(),
        })
    }

    /// The active time so far, in microseconds, once every client has gone.
    pub(crate) async fn read_us(&self) -> Result<f64> {
        for _ in 0..200 {
            let clients: i64 = self
                .admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                      WHERE datname = $1 AND backend_type = 'client backend'",
                    &[&self.database],
                )
                .await?
                .get(0);
            if clients == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let mut last: Option<f64> = None;
        for _ in 0..40 {
            let row = self
                .admin
                .query_one(
                    "SELECT active_time FROM pg_stat_database WHERE datname = $1",
                    &[&self.database],
                )
                .await
                .context("reading pg_stat_database.active_time (PostgreSQL 14 or later)")?;
            let now_ms: f64 = row.try_get(0).context("active_time")?;
            if last == Some(now_ms) {
                return Ok(now_ms * 1000.0);
            }
            last = Some(now_ms);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("pg_stat_database.active_time did not settle")
    }
}
