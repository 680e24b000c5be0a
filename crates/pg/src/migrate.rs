//! lockstep's schema: installing it ([`migrate`]), reading where a database stands
//! ([`migration_status`]) and refusing a database this build cannot run on ([`check_schema`]).
//!
//! The schema is the workspace's top-level `migrations/` folder (this crate's `migrations/` is a
//! symlink to it, which `cargo package` follows), embedded at compile time:
//!
//! - **numbered migrations** `V{n}__{name}.sql`, the tables, indexes and other stored objects,
//!   applied once each, in order, by refinery, and recorded in its history table
//!   [`MIGRATION_TABLE`]. `V1__baseline.sql` is the schema of 0.1; a later release adds at most
//!   one file that rolls its table changes up. An applied file is never edited.
//! - **function files** `functions/{name}.sql`, each the only definition of the function or
//!   view it is named after, applied after the numbered migrations with `CREATE OR REPLACE`, in
//!   the order of [`FUNCTION_FILES`]. Each is recorded with the md5 of its text in
//!   [`FUNCTIONS_TABLE`]: a file whose text changed is applied again, an unchanged one is not.
//!   A function's overloads that its file no longer defines are dropped, and so is a function
//!   whose file is gone: nothing dead stays installed.
//! - **the schema version** [`SCHEMA_VERSION`], written to [`VERSION_TABLE`] with the last
//!   breaking version [`SCHEMA_LAST_BREAKING`]: a build refuses a database it was not built for
//!   ([`check_schema`], [`SchemaMismatch`]), and `migrate` never installs an older schema over a
//!   newer one.
//!
//! `migrations/schema.sql` is the resulting schema as `pg_dump --schema-only` prints it; a test
//! regenerates it and fails when the checked-in file differs. `docs/adr/0039-schema-files.md`
//! says what may change in a function file, what needs a numbered migration and what is
//! breaking.
//!
//! Applying is explicit: call [`migrate`] (`lockstep migrate`); no constructor does it behind
//! your back. It is idempotent, and safe from two processes at once: a run is one transaction
//! that first takes a transaction-scoped advisory lock on [`MIGRATION_LOCK_KEY`], so concurrent
//! runs queue instead of racing, and a run that fails leaves nothing half applied. Holding no
//! session state, it runs through a transaction pooler (PgBouncer `pool_mode = transaction`)
//! as well as on a direct connection. Every
//! object is created in the first schema of the `search_path`. An application that runs its
//! own refinery migrations in the same database keeps its `refinery_schema_history` to itself.
//!
//! # What is created
//!
//! - Tables prefixed `wh_` (`wh_perspective_cursors`, `wh_events`, and the perspective
//!   store's `wh_perspectives`, `wh_perspective_events`, `wh_perspective_states`,
//!   `wh_perspective_snapshots`, …): the prefix and the names come from the storage model of
//!   the reference implementation the lease design is taken from (Whizbang's perspective
//!   stream locking), so a database laid out like it reads the same. The prefix says nothing
//!   beyond that.
//! - Functions and views prefixed `lockstep_`: the advisory-key hash
//!   (`lockstep_advisory_key`), the `pg_locks` view (`lockstep_advisory_locks`), the advisory
//!   lock protocol every lock statement calls (`lockstep_advisory_lock`), the event store's
//!   one-statement operations (`lockstep_append_events`, which also enqueues perspective work,
//!   and `lockstep_lock_and_load`), and the perspective store's
//!   (`lockstep_register_perspectives`, `lockstep_perspective_claim_pairs`,
//!   `lockstep_perspective_commit_batch`, …).
//! - The bookkeeping tables [`MIGRATION_TABLE`], [`FUNCTIONS_TABLE`] and [`VERSION_TABLE`].

use std::fmt;

use deadpool_postgres::Pool;
use lockstep_core::{Error, ErrorKind, Result, advisory_key};
use tokio_postgres::GenericClient;
use tokio_postgres::types::Type;

use crate::driver::{DbError, Executor, Tp, query_one, query_opt};
use crate::error::{map_db_error, map_error};

mod files;

pub use files::{FUNCTION_FILES, FunctionFile};

mod embedded {
    // Relative to this crate's manifest: `migrations` is a symlink to the workspace's folder.
    refinery::embed_migrations!("migrations");
}

/// The schema version this build installs and runs on. A release that changes any file of
/// `migrations/` raises it by one (`docs/adr/0039-schema-files.md`).
pub const SCHEMA_VERSION: i32 = 3;

/// The newest schema version that older builds cannot run on: the version of the last breaking
/// change (a function's signature or result, a column an older build reads or writes). A
/// database at schema version `v` serves every build whose [`SCHEMA_VERSION`] is at least the
/// `last_breaking` it records and at most `v`.
pub const SCHEMA_LAST_BREAKING: i32 = 2;

/// The table in which refinery records the applied numbered migrations (under a name of
/// lockstep's own instead of refinery's default `refinery_schema_history`).
pub const MIGRATION_TABLE: &str = "lockstep_schema_history";

/// The table in which [`migrate`] records the applied function files and their checksums.
pub const FUNCTIONS_TABLE: &str = "lockstep_schema_functions";

/// The one-row table in which [`migrate`] records the installed schema version.
pub const VERSION_TABLE: &str = "lockstep_schema_version";

/// The resource key whose advisory lock serializes concurrent migration runs.
pub const MIGRATION_LOCK_KEY: &str = "lockstep:migrations";

/// How long [`migrate`] and [`migration_status`] wait for a connection: 60 s. They run at a
/// deploy or at start-up, when the server may be busy (a new connection to a loaded server can
/// take seconds); waiting beats failing the deploy. The wait for the migration lock itself is
/// not bounded: another run holding it finishes first.
pub const MIGRATE_CHECKOUT_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// What a [`migrate`] run did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationReport {
    /// Numbered migrations applied by this run, as (version, name); empty when none was due.
    pub applied: Vec<(i32, String)>,
    /// Function files applied by this run (new or changed), in the order applied.
    pub functions_applied: Vec<String>,
    /// Functions and views dropped by this run: overloads a file no longer defines (as their
    /// signatures) and names whose file is gone.
    pub functions_dropped: Vec<String>,
    /// The schema version the database is at after the run: [`SCHEMA_VERSION`], or a newer
    /// compatible version a newer build installed (then this run changed nothing).
    pub schema_version: i32,
}

impl MigrationReport {
    /// Whether the run changed nothing.
    pub fn is_empty(&self) -> bool {
        self.applied.is_empty()
            && self.functions_applied.is_empty()
            && self.functions_dropped.is_empty()
    }
}

/// The schema version a database records ([`VERSION_TABLE`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InstalledSchema {
    /// The installed schema version.
    pub version: i32,
    /// The version of its last breaking change: builds with an older [`SCHEMA_VERSION`] cannot
    /// run on it.
    pub last_breaking: i32,
    /// The lockstep-pg release that installed it.
    pub installed_by: String,
}

impl InstalledSchema {
    /// [`SchemaMismatch::Newer`] when a newer build installed this schema with a breaking change
    /// after this build's [`SCHEMA_VERSION`].
    fn breaks_this_build(&self) -> Option<SchemaMismatch> {
        (self.last_breaking > SCHEMA_VERSION).then_some(SchemaMismatch::Newer {
            database: self.version,
            last_breaking: self.last_breaking,
            build: SCHEMA_VERSION,
        })
    }
}

/// Why this build refuses a database ([`check_schema`], [`migrate`]). Carried by the
/// [`Error`] (kind [`ErrorKind::Unsupported`]) as its [`Error::underlying`] cause; find it with
/// [`SchemaMismatch::of`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchemaMismatch {
    /// The database has no lockstep schema: run `migrate`.
    NotInstalled,
    /// The database was created by a development snapshot from before 0.1, whose migrations
    /// have no upgrade path: use a new database (or drop lockstep's tables and migrate).
    Snapshot,
    /// The database is at an older schema version than this build's: run `migrate` with this
    /// build.
    Older {
        /// The database's version.
        database: i32,
        /// This build's [`SCHEMA_VERSION`].
        build: i32,
    },
    /// A newer build installed a schema this build cannot run on: upgrade this binary.
    Newer {
        /// The database's version.
        database: i32,
        /// The database's last breaking version, newer than this build.
        last_breaking: i32,
        /// This build's [`SCHEMA_VERSION`].
        build: i32,
    },
    /// The database is at this build's version, but function files differ from this build's
    /// (a development build changed them without raising [`SCHEMA_VERSION`]): run `migrate`.
    FunctionsDiffer {
        /// The names whose installed text differs or is missing.
        names: Vec<String>,
    },
}

impl SchemaMismatch {
    /// The mismatch an error from [`check_schema`] or [`migrate`] carries, if it is one.
    pub fn of(error: &Error) -> Option<&SchemaMismatch> {
        error.underlying()?.downcast_ref::<SchemaMismatch>()
    }

    fn into_error(self) -> Error {
        Error::new(ErrorKind::Unsupported, self.to_string()).with_cause_in_message(self)
    }
}

impl fmt::Display for SchemaMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SchemaMismatch::NotInstalled => f.write_str(
                "the database has no lockstep schema: run `lockstep migrate` (or \
                 lockstep_pg::migrate) first",
            ),
            SchemaMismatch::Snapshot => f.write_str(
                "the database holds a lockstep schema from a development snapshot before 0.1, \
                 which cannot be upgraded: use a new database, or drop lockstep's tables \
                 (wh_*, lockstep_*) and run `lockstep migrate`",
            ),
            SchemaMismatch::Older { database, build } => write!(
                f,
                "the database's lockstep schema is version {database}, this build needs \
                 version {build}: run `lockstep migrate` with this build"
            ),
            SchemaMismatch::Newer {
                database,
                last_breaking,
                build,
            } => write!(
                f,
                "the database's lockstep schema is version {database}, installed by a newer \
                 lockstep and incompatible with this build (schema version {build}; it needs a \
                 build of schema version {last_breaking} or later): upgrade this binary"
            ),
            SchemaMismatch::FunctionsDiffer { names } => write!(
                f,
                "the database's lockstep functions differ from this build's ({}): run \
                 `lockstep migrate` with this build",
                names.join(", ")
            ),
        }
    }
}

impl std::error::Error for SchemaMismatch {}

/// Applies lockstep's schema to the database behind `pool`: every numbered migration not yet
/// applied, then every function file that is new or changed, then the schema version.
///
/// On a database a newer build migrated it changes nothing: it returns the newer version when
/// that schema still serves this build, and [`SchemaMismatch::Newer`] when it does not. On a
/// database of a development snapshot from before 0.1 it returns
/// [`SchemaMismatch::Snapshot`].
///
/// The whole run is one transaction: it begins with `pg_advisory_xact_lock` on
/// [`MIGRATION_LOCK_KEY`] (a concurrent run waits there until this one commits, then finds
/// nothing left to do), applies what is due, and commits; a failure rolls everything back.
pub async fn migrate(pool: &Pool) -> Result<MigrationReport> {
    let mut conn = crate::pool::checkout(pool, MIGRATE_CHECKOUT_WAIT).await?;
    let tx = conn
        .transaction()
        .await
        .map_err(|e| map_error(e, "beginning the migration run"))?;
    tx.query_typed(
        "SELECT pg_advisory_xact_lock($1)",
        &[(&advisory_key(MIGRATION_LOCK_KEY), Type::INT8)],
    )
    .await
    .map_err(|e| map_error(e, "locking the migration run"))?;
    tracing::debug!("migration run: the migration lock is held");
    let report = migrate_locked(&Tp(&*tx)).await?;
    tx.commit()
        .await
        .map_err(|e| map_error(e, "committing the migration run"))?;
    Ok(report)
}

/// The run on `tx`, the migration lock held: either driver's transaction.
pub(crate) async fn migrate_locked<E: Executor + ?Sized>(tx: &E) -> Result<MigrationReport> {
    let conn = tx;
    if is_snapshot(conn).await? {
        return Err(SchemaMismatch::Snapshot.into_error());
    }
    if let Some(installed) = installed_schema(conn).await?
        && installed.version > SCHEMA_VERSION
    {
        if let Some(newer) = installed.breaks_this_build() {
            return Err(newer.into_error());
        }
        // A newer build's schema that still serves this one: installing this build's
        // function files would downgrade it.
        return Ok(MigrationReport {
            applied: Vec::new(),
            functions_applied: Vec::new(),
            functions_dropped: Vec::new(),
            schema_version: installed.version,
        });
    }
    let report = runner()
        .run_async(&mut InRun(tx))
        .await
        .map_err(|e| Error::new(ErrorKind::Backend, "applying migrations failed").with_source(e))?;
    let applied = report
        .applied_migrations()
        .iter()
        .map(|m| (m.version(), m.name().to_owned()))
        .collect();
    let (functions_applied, functions_dropped) = apply_function_files(tx).await?;
    Ok(MigrationReport {
        applied,
        functions_applied,
        functions_dropped,
        schema_version: SCHEMA_VERSION,
    })
}

/// Applies the new and changed function files, drops what no file defines, and records the
/// schema version, in the run's transaction: a database never has half of a build's functions.
async fn apply_function_files<E: Executor + ?Sized>(tx: &E) -> Result<(Vec<String>, Vec<String>)> {
    let names: Vec<String> = FUNCTION_FILES.iter().map(|f| f.name.to_owned()).collect();
    let texts: Vec<String> = FUNCTION_FILES.iter().map(|f| f.sql.to_owned()).collect();
    let due: Vec<String> = tx
        .query(
            &format!(
                "SELECT f.name FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS f(name, body, o) \
                 LEFT JOIN {FUNCTIONS_TABLE} s ON s.name = f.name \
                 WHERE s.checksum IS DISTINCT FROM md5(f.body) ORDER BY f.o"
            ),
            &[&names, &texts],
        )
        .await
        .map_err(|e| map_db_error(e, "comparing the function files with the installed ones"))?
        .iter()
        .map(|row| row.get(0))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| map_db_error(e, "reading a function file's name"))?;
    let mut dropped = Vec::new();
    for name in &due {
        let Some(file) = FUNCTION_FILES.iter().find(|f| f.name == name) else {
            continue;
        };
        // A function whose result type changed (42P13), or a view that lost a column (42P16),
        // cannot be replaced in place: drop the old definition and create the new one. The
        // savepoint lets the transaction go on after the first attempt failed.
        let before = overloads(tx, name).await?;
        tx.batch("SAVEPOINT lockstep_function_file")
            .await
            .map_err(|e| map_db_error(e, "setting a savepoint"))?;
        if let Err(e) = tx.batch(file.sql).await {
            // invalid_function_definition, invalid_table_definition
            let replaceable = matches!(e.code(), Some("42P13" | "42P16"));
            if !replaceable {
                return Err(map_db_error(e, &format!("applying functions/{name}.sql")));
            }
            tx.batch("ROLLBACK TO SAVEPOINT lockstep_function_file")
                .await
                .map_err(|e| map_db_error(e, "rolling back to the savepoint"))?;
            dropped.extend(drop_functions(tx, &overloads(tx, name).await?).await?);
            tx.batch(&format!("DROP VIEW IF EXISTS {}", quote_ident(name)))
                .await
                .map_err(|e| map_db_error(e, &format!("dropping the view {name}")))?;
            tx.batch(file.sql)
                .await
                .map_err(|e| map_db_error(e, &format!("applying functions/{name}.sql")))?;
        }
        // Overloads of the name that the file did not create or replace (their catalog rows
        // are the rows from before it ran): the file no longer defines them.
        let after = overloads(tx, name).await?;
        let stale: Vec<(String, String)> = before
            .into_iter()
            .filter(|old| after.contains(old))
            .collect();
        dropped.extend(drop_functions(tx, &stale).await?);
        tx.query(
            &format!(
                "INSERT INTO {FUNCTIONS_TABLE} (name, checksum, applied_at) \
                 VALUES ($1, md5($2), clock_timestamp()) \
                 ON CONFLICT (name) DO UPDATE SET checksum = EXCLUDED.checksum, \
                 applied_at = EXCLUDED.applied_at"
            ),
            &[&file.name, &file.sql],
        )
        .await
        .map_err(|e| map_db_error(e, "recording a function file"))?;
    }
    // Names recorded by an earlier build whose file is gone.
    let gone: Vec<String> = tx
        .query(
            &format!("SELECT name FROM {FUNCTIONS_TABLE} WHERE NOT name = ANY($1) ORDER BY name"),
            &[&names],
        )
        .await
        .map_err(|e| map_db_error(e, "listing the recorded function files"))?
        .iter()
        .map(|row| row.get(0))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| map_db_error(e, "reading a recorded function file's name"))?;
    for name in &gone {
        dropped.extend(drop_functions(tx, &overloads(tx, name).await?).await?);
        tx.batch(&format!("DROP VIEW IF EXISTS {}", quote_ident(name)))
            .await
            .map_err(|e| map_db_error(e, "dropping a view whose file is gone"))?;
        tx.query(
            &format!("DELETE FROM {FUNCTIONS_TABLE} WHERE name = $1"),
            &[name],
        )
        .await
        .map_err(|e| map_db_error(e, "forgetting a function file"))?;
    }
    tx.query(
        &format!(
            "INSERT INTO {VERSION_TABLE} (version, last_breaking, installed_by, installed_at) \
             VALUES ($1, $2, $3, clock_timestamp()) \
             ON CONFLICT (only_row) DO UPDATE SET version = EXCLUDED.version, \
             last_breaking = EXCLUDED.last_breaking, installed_by = EXCLUDED.installed_by, \
             installed_at = EXCLUDED.installed_at \
             WHERE ({VERSION_TABLE}.version, {VERSION_TABLE}.last_breaking, \
                    {VERSION_TABLE}.installed_by) \
                   IS DISTINCT FROM (EXCLUDED.version, EXCLUDED.last_breaking, \
                                     EXCLUDED.installed_by)"
        ),
        &[
            &SCHEMA_VERSION,
            &SCHEMA_LAST_BREAKING,
            &env!("CARGO_PKG_VERSION"),
        ],
    )
    .await
    .map_err(|e| map_db_error(e, "recording the schema version"))?;
    Ok((due, dropped))
}

/// The functions named `name` in the current schema: each one's signature and the version of
/// its catalog row (`xmin`), which `CREATE OR REPLACE` changes and leaves alone otherwise.
async fn overloads<E: Executor + ?Sized>(tx: &E, name: &str) -> Result<Vec<(String, String)>> {
    tx.query(
        "SELECT p.oid::regprocedure::text, p.xmin::text FROM pg_proc p \
              WHERE p.proname = $1 AND p.pronamespace = current_schema()::regnamespace \
              ORDER BY 1",
        &[&name],
    )
    .await
    .map_err(|e| map_db_error(e, "listing a function's overloads"))?
    .iter()
    .map(|row| Ok((row.get(0)?, row.get(1)?)))
    .collect::<std::result::Result<_, DbError>>()
    .map_err(|e| map_db_error(e, "reading a function's overloads"))
}

/// Drops the given functions; returns their signatures.
async fn drop_functions<E: Executor + ?Sized>(
    tx: &E,
    functions: &[(String, String)],
) -> Result<Vec<String>> {
    let mut dropped = Vec::with_capacity(functions.len());
    for (signature, _) in functions {
        // `regprocedure::text` is a qualified, quoted signature, safe to splice.
        tx.batch(&format!("DROP FUNCTION {signature}"))
            .await
            .map_err(|e| map_db_error(e, &format!("dropping {signature}")))?;
        dropped.push(signature.clone());
    }
    Ok(dropped)
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Whether the history table holds migrations of a development snapshot from before 0.1
/// (whose first migration was not the baseline).
async fn is_snapshot<E: Executor + ?Sized>(conn: &E) -> Result<bool> {
    if !table_exists(conn, MIGRATION_TABLE).await? {
        return Ok(false);
    }
    let row = query_one(
        conn,
        &format!(
            "SELECT EXISTS (SELECT 1 FROM {MIGRATION_TABLE} \
             WHERE version = 1 AND name <> 'baseline')"
        ),
        &[],
    )
    .await
    .map_err(|e| map_db_error(e, "reading the migration history"))?;
    row.get(0)
        .map_err(|e| map_db_error(e, "reading the migration history"))
}

async fn table_exists<E: Executor + ?Sized>(conn: &E, table: &str) -> Result<bool> {
    // `to_regclass` resolves the name on the search_path as refinery does; NULL when absent.
    let row = query_one(conn, "SELECT to_regclass($1) IS NOT NULL", &[&table])
        .await
        .map_err(|e| map_db_error(e, "looking for lockstep's schema"))?;
    row.get(0)
        .map_err(|e| map_db_error(e, "looking for lockstep's schema"))
}

/// The version row, when the table and the row exist.
async fn installed_schema<E: Executor + ?Sized>(conn: &E) -> Result<Option<InstalledSchema>> {
    if !table_exists(conn, VERSION_TABLE).await? {
        return Ok(None);
    }
    let row = query_opt(
        conn,
        &format!("SELECT version, last_breaking, installed_by FROM {VERSION_TABLE}"),
        &[],
    )
    .await
    .map_err(|e| map_db_error(e, "reading the schema version"))?;
    let read = |e| map_db_error(e, "reading the schema version");
    row.map(|row| {
        Ok(InstalledSchema {
            version: row.get(0).map_err(read)?,
            last_breaking: row.get(1).map_err(read)?,
            installed_by: row.get(2).map_err(read)?,
        })
    })
    .transpose()
}

/// Whether this build can run on the database behind `pool`, read only: `Ok` with the
/// installed version when it is this build's [`SCHEMA_VERSION`] with this build's function
/// files, or a newer version that still serves this build; else an error of kind
/// [`ErrorKind::Unsupported`] whose [`SchemaMismatch`] says what to do (run `migrate`, or
/// upgrade the binary). One checkout and up to four short reads.
pub async fn check_schema(pool: &Pool) -> Result<InstalledSchema> {
    let conn = crate::pool::checkout(pool, MIGRATE_CHECKOUT_WAIT).await?;
    check_schema_on(&**conn).await
}

/// [`check_schema`] on a connection the caller holds (in a transaction or not): it only reads.
pub async fn check_schema_on<C: GenericClient + Sync>(conn: &C) -> Result<InstalledSchema> {
    check_schema_with(&Tp(conn)).await
}

/// [`check_schema_on`] on either driver's executor.
pub(crate) async fn check_schema_with<E: Executor + ?Sized>(conn: &E) -> Result<InstalledSchema> {
    if is_snapshot(conn).await? {
        return Err(SchemaMismatch::Snapshot.into_error());
    }
    let Some(installed) = installed_schema(conn).await? else {
        return Err(SchemaMismatch::NotInstalled.into_error());
    };
    if installed.version < SCHEMA_VERSION {
        return Err(SchemaMismatch::Older {
            database: installed.version,
            build: SCHEMA_VERSION,
        }
        .into_error());
    }
    if let Some(newer) = installed.breaks_this_build() {
        return Err(newer.into_error());
    }
    if installed.version == SCHEMA_VERSION {
        let differ = differing_functions(conn).await?;
        if !differ.is_empty() {
            return Err(SchemaMismatch::FunctionsDiffer { names: differ }.into_error());
        }
    }
    Ok(installed)
}

/// This build's function files whose installed text differs or is missing.
async fn differing_functions<E: Executor + ?Sized>(conn: &E) -> Result<Vec<String>> {
    Ok(function_states(conn)
        .await?
        .into_iter()
        .filter(|f| !matches!(f.state, MigrationState::Applied { .. }))
        .filter(|f| !matches!(f.state, MigrationState::Unknown { .. }))
        .map(|f| f.name)
        .collect())
}

/// Where one migration or function file stands in a database ([`migration_status`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MigrationState {
    /// Applied, with the file this build embeds; `applied_on` as recorded (RFC 3339).
    Applied {
        /// When it was applied.
        applied_on: String,
    },
    /// Embedded in this build, not applied yet: `migrate` applies it.
    Pending,
    /// Applied, but from a file whose checksum differs from this build's. For a numbered
    /// migration an edited file (`migrate` refuses to run on such a database); for a function
    /// file, `migrate` applies this build's text.
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

/// One numbered migration and where it stands.
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

/// One function file and where it stands.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FunctionEntry {
    /// The function's (or view's) name.
    pub name: String,
    /// Where it stands.
    pub state: MigrationState,
}

/// Every migration and function file this build embeds and every one the database recorded,
/// and the recorded schema version.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationStatus {
    /// Numbered migrations, by version.
    pub migrations: Vec<MigrationEntry>,
    /// Function files, in the order they are applied; then recorded names this build lacks.
    pub functions: Vec<FunctionEntry>,
    /// The recorded schema version; `None` on a database never migrated.
    pub schema: Option<InstalledSchema>,
    /// Whether the database holds a development snapshot's schema from before 0.1, which
    /// cannot be upgraded ([`SchemaMismatch::Snapshot`]).
    pub snapshot: bool,
}

impl MigrationStatus {
    /// Whether this build can run on the database as it is: at this build's schema version with
    /// every embedded migration and function file applied from an unchanged file, or at a newer
    /// version that still serves this build.
    pub fn is_up_to_date(&self) -> bool {
        let applied = |state: &MigrationState| {
            matches!(
                state,
                MigrationState::Applied { .. } | MigrationState::Unknown { .. }
            )
        };
        match &self.schema {
            _ if self.snapshot => false,
            None => false,
            Some(s) if s.last_breaking > SCHEMA_VERSION || s.version < SCHEMA_VERSION => false,
            // A newer build's schema that serves this one: its files are not this build's.
            Some(s) if s.version > SCHEMA_VERSION => true,
            Some(_) => {
                self.migrations.iter().all(|m| applied(&m.state))
                    && self.functions.iter().all(|f| applied(&f.state))
            }
        }
    }
}

/// Where each migration and function file stands in the database behind `pool`, read only: the
/// bookkeeping tables are read if they exist (a database never migrated lists everything as
/// pending) and nothing is created or locked.
pub async fn migration_status(pool: &Pool) -> Result<MigrationStatus> {
    let conn = crate::pool::checkout(pool, MIGRATE_CHECKOUT_WAIT).await?;
    let conn = &Tp(&**conn);
    tracing::debug!("reading where each migration and function file stands");
    let mut recorded: Vec<(i32, String, String, String)> = Vec::new();
    if table_exists(conn, MIGRATION_TABLE).await? {
        let rows = conn
            .query(
                &format!(
                    "SELECT version, coalesce(name, ''), coalesce(applied_on, ''), \
                     coalesce(checksum, '') FROM {MIGRATION_TABLE} ORDER BY version"
                ),
                &[],
            )
            .await
            .map_err(|e| map_db_error(e, "reading the migration history"))?;
        for row in rows {
            let read = |e| map_db_error(e, "reading a migration history row");
            recorded.push((
                row.get(0).map_err(read)?,
                row.get(1).map_err(read)?,
                row.get(2).map_err(read)?,
                row.get(3).map_err(read)?,
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
    Ok(MigrationStatus {
        migrations,
        functions: function_states(conn).await?,
        schema: installed_schema(conn).await?,
        snapshot: is_snapshot(conn).await?,
    })
}

/// Every function file and where it stands; then the recorded names this build lacks.
async fn function_states<E: Executor + ?Sized>(conn: &E) -> Result<Vec<FunctionEntry>> {
    let names: Vec<String> = FUNCTION_FILES.iter().map(|f| f.name.to_owned()).collect();
    if !table_exists(conn, FUNCTIONS_TABLE).await? {
        return Ok(names
            .iter()
            .map(|name| FunctionEntry {
                name: name.clone(),
                state: MigrationState::Pending,
            })
            .collect());
    }
    let texts: Vec<String> = FUNCTION_FILES.iter().map(|f| f.sql.to_owned()).collect();
    let rows = conn
        .query(
            &format!(
                "SELECT coalesce(f.name, s.name), f.name IS NOT NULL, s.name IS NOT NULL, \
                        s.checksum IS NOT DISTINCT FROM md5(f.body), \
                        coalesce(to_char(s.applied_at AT TIME ZONE 'UTC', \
                                         'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), '') \
                   FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS f(name, body, o) \
                   FULL JOIN {FUNCTIONS_TABLE} s ON s.name = f.name \
                  ORDER BY f.o NULLS LAST, s.name"
            ),
            &[&names, &texts],
        )
        .await
        .map_err(|e| map_db_error(e, "reading the applied function files"))?;
    rows.iter()
        .map(|row| {
            let read = |e| map_db_error(e, "reading an applied function file");
            let (embedded, recorded, same, on): (bool, bool, bool, String) = (
                row.get(1).map_err(read)?,
                row.get(2).map_err(read)?,
                row.get(3).map_err(read)?,
                row.get(4).map_err(read)?,
            );
            let state = match (embedded, recorded, same) {
                (true, false, _) => MigrationState::Pending,
                (true, true, true) => MigrationState::Applied { applied_on: on },
                (true, true, false) => MigrationState::Changed { applied_on: on },
                (false, _, _) => MigrationState::Unknown { applied_on: on },
            };
            Ok(FunctionEntry {
                name: row.get(0).map_err(read)?,
                state,
            })
        })
        .collect()
}

/// Every embedded numbered migration, as (version, name), in order.
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

/// refinery's runner on the migration run's transaction: its statements run in that
/// transaction (refinery's own driver would begin and commit one per migration on the client),
/// so the run's transaction-scoped lock covers them and a failure rolls the whole run back.
struct InRun<'a, E: ?Sized>(&'a E);

/// A failure of a statement refinery sent, or a history row it cannot read.
#[derive(Debug)]
enum RunError {
    Statement(DbError),
    History(String),
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Statement(e) => write!(f, "{e}"),
            RunError::History(what) => write!(f, "reading {MIGRATION_TABLE}: {what}"),
        }
    }
}

impl std::error::Error for RunError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RunError::Statement(e) => Some(e),
            RunError::History(_) => None,
        }
    }
}

impl<E: Executor + ?Sized> refinery_core::traits::r#async::AsyncTransaction for InRun<'_, E> {
    type Error = RunError;

    async fn execute<'a, T: Iterator<Item = &'a str> + Send + 'a>(
        &'a mut self,
        queries: T,
    ) -> std::result::Result<usize, RunError> {
        let mut count = 0;
        for query in queries {
            self.0.batch(query).await.map_err(RunError::Statement)?;
            count += 1;
        }
        Ok(count)
    }
}

impl<E: Executor + ?Sized> refinery_core::traits::r#async::AsyncQuery<Vec<refinery_core::Migration>>
    for InRun<'_, E>
{
    async fn query<'a>(
        &'a mut self,
        query: &'a str,
    ) -> std::result::Result<Vec<refinery_core::Migration>, RunError> {
        let rows = self
            .0
            .query(query, &[])
            .await
            .map_err(RunError::Statement)?;
        rows.iter()
            .map(|row| {
                let read = |e: DbError| RunError::History(e.to_string());
                let applied_on: String = row.get(2).map_err(read)?;
                let checksum: String = row.get(3).map_err(read)?;
                Ok(refinery_core::Migration::applied(
                    row.get(0).map_err(read)?,
                    row.get(1).map_err(read)?,
                    time::OffsetDateTime::parse(
                        &applied_on,
                        &time::format_description::well_known::Rfc3339,
                    )
                    .map_err(|e| RunError::History(format!("applied_on {applied_on:?}: {e}")))?,
                    checksum
                        .parse::<u64>()
                        .map_err(|e| RunError::History(format!("checksum {checksum:?}: {e}")))?,
                ))
            })
            .collect()
    }
}

impl<E: Executor + ?Sized> refinery_core::AsyncMigrate for InRun<'_, E> {}
