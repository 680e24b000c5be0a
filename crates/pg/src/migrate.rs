//! Schema migrations: the numbered SQL files of the workspace's `migrations/` folder
//! (`V{n}__{name}.sql`), embedded at compile time and applied by refinery.
//!
//! Applying is explicit (call [`migrate`] or run `lockstep migrate`; no constructor does it
//! behind your back), idempotent (refinery records applied versions in
//! `refinery_schema_history`, and every file is written to be re-runnable), and safe from two
//! processes at once: the run holds a session advisory lock on
//! [`MIGRATION_LOCK_KEY`] so concurrent runs queue instead of racing on the history table.

use deadpool_postgres::Pool;
use lockstep_core::{Error, ErrorKind, Result, advisory_key};

use crate::error::{map_error, map_pool_error};

mod embedded {
    refinery::embed_migrations!("../../migrations");
}

/// The resource key whose advisory lock serializes concurrent migration runs.
pub const MIGRATION_LOCK_KEY: &str = "lockstep:migrations";

/// What a [`migrate`] run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    /// Versions and names applied by this run (empty when the schema was up to date).
    pub applied: Vec<(i32, String)>,
}

/// Applies every migration not yet applied to the database behind `pool`.
pub async fn migrate(pool: &Pool) -> Result<MigrationReport> {
    let mut conn = pool.get().await.map_err(map_pool_error)?;
    let key = advisory_key(MIGRATION_LOCK_KEY);
    conn.execute("SELECT pg_advisory_lock($1)", &[&key])
        .await
        .map_err(|e| map_error(e, "locking the migration run"))?;
    let client: &mut tokio_postgres::Client = &mut conn;
    let outcome = embedded::migrations::runner().run_async(client).await;
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

/// Every embedded migration, as (version, name), in order.
pub fn embedded_migrations() -> Vec<(i32, String)> {
    embedded::migrations::runner()
        .get_migrations()
        .iter()
        .map(|m| (m.version(), m.name().to_owned()))
        .collect()
}
