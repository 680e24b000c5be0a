//! Schema migrations: the numbered SQL files of this crate's `migrations/` folder
//! (`V{n}__{name}.sql`), embedded at compile time and applied by refinery.
//!
//! The files are a byte-for-byte copy of the workspace's top-level `migrations/` folder, the
//! single source of the schema that a DBA reads; a test (`tests/schema_copy.rs`) fails when the
//! two differ, and the crate carries its copy so that it builds from its own folder when
//! packaged (`docs/adr/0004-schema-ownership.md`).
//!
//! Applying is explicit: call [`migrate`] (`lockstep migrate`); no constructor does it behind
//! your back. [`migration_status`] (`lockstep migrate --status`) says, read only, which
//! migrations are applied, pending, changed since they were applied, or unknown to this build. It is idempotent: applied
//! versions are recorded in a history table of lockstep's own, [`MIGRATION_TABLE`]
//! (`lockstep_schema_history`, in the first schema of the `search_path`), so an application
//! that runs its own refinery migrations in the same database keeps its
//! `refinery_schema_history` to itself; and every file is written to be re-runnable. It is safe
//! from two processes at once: the run holds a session advisory lock on
//! [`MIGRATION_LOCK_KEY`] so concurrent runs queue instead of racing on the history table.
//!
//! # What is created
//!
//! - Tables prefixed `wh_` (`wh_perspective_cursors`, `wh_events`, and the perspective
//!   store's `wh_perspectives`, `wh_perspective_events`, `wh_perspective_states`,
//!   `wh_perspective_snapshots`): the prefix and the names come from the storage model of the
//!   reference implementation the lease design is taken from (Whizbang's perspective stream
//!   locking), so a database laid out like it reads the same. The prefix says nothing beyond
//!   that.
//! - Functions and views prefixed `lockstep_`: the advisory-key hash
//!   (`lockstep_advisory_key`), the `pg_locks` view (`lockstep_advisory_locks`), the advisory
//!   lock protocol every lock statement calls (`lockstep_advisory_lock`), and the event store's
//!   one-statement operations (`lockstep_append_events`, which also enqueues perspective work,
//!   and `lockstep_lock_and_load`), and the perspective store's
//!   (`lockstep_register_perspectives`, `lockstep_perspective_claim`,
//!   `lockstep_perspective_commit`, … — ADR 0006).
//! - The history table [`MIGRATION_TABLE`].

use deadpool_postgres::Pool;
use lockstep_core::{Error, ErrorKind, Result, advisory_key};

use crate::error::map_error;

mod embedded {
    // Relative to this crate's manifest: the crate's own copy (see the module docs).
    refinery::embed_migrations!("migrations");
}

/// The table in which [`migrate`] records the applied versions (refinery's history table, under
/// a name of lockstep's own instead of refinery's default `refinery_schema_history`).
pub const MIGRATION_TABLE: &str = "lockstep_schema_history";

/// The resource key whose advisory lock serializes concurrent migration runs.
pub const MIGRATION_LOCK_KEY: &str = "lockstep:migrations";

/// What a [`migrate`] run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    /// Versions and names applied by this run (empty when the schema was up to date).
    pub applied: Vec<(i32, String)>,
}

/// How long [`migrate`] and [`migration_status`] wait for a connection: 60 s. They run at a
/// deploy or at start-up, when the server may be busy (a new connection to a loaded server can
/// take seconds); waiting beats failing the deploy. The wait for the migration lock itself is
/// not bounded: another run holding it finishes first.
pub const MIGRATE_CHECKOUT_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Applies every migration not yet applied to the database behind `pool`.
pub async fn migrate(pool: &Pool) -> Result<MigrationReport> {
    let mut conn = crate::pool::checkout(pool, MIGRATE_CHECKOUT_WAIT).await?;
    let key = advisory_key(MIGRATION_LOCK_KEY);
    conn.execute("SELECT pg_advisory_lock($1)", &[&key])
        .await
        .map_err(|e| map_error(e, "locking the migration run"))?;
    let client: &mut tokio_postgres::Client = &mut conn;
    let outcome = runner().run_async(client).await;
    // Unlock on every path; if even that fails, do not return the connection to the pool
    // still holding the lock.
    let unlocked = conn.execute("SELECT pg_advisory_unlock($1)", &[&key]).await;
    if unlocked.is_err() {
        let _ = deadpool_postgres::Object::take(conn);
    }
    let report = outcome
        .map_err(|e| Error::new(ErrorKind::Backend, "applying migrations failed").with_source(e))?;
    Ok(MigrationReport {
        applied: report
            .applied_migrations()
            .iter()
            .map(|m| (m.version(), m.name().to_owned()))
            .collect(),
    })
}

/// Where one migration stands in a database ([`migration_status`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MigrationState {
    /// Applied, with the file this build embeds; `applied_on` as refinery recorded it (RFC 3339).
    Applied {
        /// When it was applied.
        applied_on: String,
    },
    /// Embedded in this build, not applied yet: `migrate` applies it.
    Pending,
    /// Applied, but from a file whose checksum differs from this build's (an edited migration;
    /// `migrate` refuses to run on such a database).
    Changed {
        /// When it was applied.
        applied_on: String,
    },
    /// Recorded in the database but not embedded in this build: a newer build migrated the
    /// database (a rolling upgrade in progress, or this binary is older than the schema).
    Unknown {
        /// When it was applied.
        applied_on: String,
    },
}

/// One migration and where it stands.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationEntry {
    /// Its version (`V{n}`).
    pub version: i32,
    /// Its name.
    pub name: String,
    /// Where it stands.
    pub state: MigrationState,
}

/// Every migration this build embeds and every one the database recorded, by version.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationStatus {
    /// By version.
    pub migrations: Vec<MigrationEntry>,
}

impl MigrationStatus {
    /// Whether every embedded migration is applied from an unchanged file.
    pub fn is_up_to_date(&self) -> bool {
        self.migrations.iter().all(|m| {
            matches!(
                m.state,
                MigrationState::Applied { .. } | MigrationState::Unknown { .. }
            )
        })
    }
}

/// Where each migration stands in the database behind `pool`, read only: the history table is
/// read if it exists (a database never migrated lists every migration as pending) and nothing
/// is created or locked.
pub async fn migration_status(pool: &Pool) -> Result<MigrationStatus> {
    let conn = crate::pool::checkout(pool, MIGRATE_CHECKOUT_WAIT).await?;
    // `to_regclass` resolves the name on the search_path as refinery does; NULL when absent.
    let exists: bool = conn
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&MIGRATION_TABLE])
        .await
        .map_err(|e| map_error(e, "looking for the migration history"))?
        .get(0);
    let mut recorded: Vec<(i32, String, String, String)> = Vec::new();
    if exists {
        let rows = conn
            .query(
                &format!(
                    "SELECT version, coalesce(name, ''), coalesce(applied_on, ''), \
                     coalesce(checksum, '') FROM {MIGRATION_TABLE} ORDER BY version"
                ),
                &[],
            )
            .await
            .map_err(|e| map_error(e, "reading the migration history"))?;
        for row in rows {
            let read = |e| map_error(e, "reading a migration history row");
            recorded.push((
                row.try_get(0).map_err(read)?,
                row.try_get(1).map_err(read)?,
                row.try_get(2).map_err(read)?,
                row.try_get(3).map_err(read)?,
            ));
        }
    }
    let mut migrations: Vec<MigrationEntry> = runner()
        .get_migrations()
        .iter()
        .map(|m| {
            let state = match recorded.iter().find(|r| r.0 == m.version()) {
                None => MigrationState::Pending,
                Some((_, _, on, sum)) if *sum == m.checksum().to_string() => {
                    MigrationState::Applied {
                        applied_on: on.clone(),
                    }
                }
                Some((_, _, on, _)) => MigrationState::Changed {
                    applied_on: on.clone(),
                },
            };
            MigrationEntry {
                version: m.version(),
                name: m.name().to_owned(),
                state,
            }
        })
        .collect();
    for (version, name, on, _) in recorded {
        if !migrations.iter().any(|m| m.version == version) {
            migrations.push(MigrationEntry {
                version,
                name,
                state: MigrationState::Unknown { applied_on: on },
            });
        }
    }
    migrations.sort_by_key(|m| m.version);
    Ok(MigrationStatus { migrations })
}

/// Every embedded migration, as (version, name), in order.
pub fn embedded_migrations() -> Vec<(i32, String)> {
    let mut migrations: Vec<(i32, String)> = runner()
        .get_migrations()
        .iter()
        .map(|m| (m.version(), m.name().to_owned()))
        .collect();
    // The embedded list follows the file names, where `V10__…` sorts before `V1__…`.
    migrations.sort_by_key(|(version, _)| *version);
    migrations
}

/// The refinery runner over the embedded files, recording into [`MIGRATION_TABLE`].
fn runner() -> refinery::Runner {
    let mut runner = embedded::migrations::runner();
    runner.set_migration_table_name(MIGRATION_TABLE);
    runner
}
