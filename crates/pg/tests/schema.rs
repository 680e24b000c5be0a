//! lockstep's schema on a real PostgreSQL: function files applied by checksum (a changed file
//! again, an unchanged one not, an overload or a name no file defines dropped), the schema
//! version a build checks at start, and a database of a pre-0.1 snapshot refused. Every entry
//! point is called from a spawned task with the concrete `PgDatabase`, as an application would.

use lockstep_core::ErrorKind;
use lockstep_pg::PgDatabase;
use lockstep_pg::migrate::{
    FUNCTION_FILES, MigrationReport, SCHEMA_LAST_BREAKING, SCHEMA_VERSION, SchemaMismatch,
};
use lockstep_testkit::pg_harness::{TestDatabase, test_database};

async fn database() -> (TestDatabase, PgDatabase, tokio_postgres::Client) {
    let db = test_database().await;
    let handle = PgDatabase::from_pool(db.pool(2));
    let admin = db.connect().await;
    (db, handle, admin)
}

async fn migrate(handle: &PgDatabase) -> lockstep_core::Result<MigrationReport> {
    let handle = handle.clone();
    tokio::spawn(async move { handle.migrate().await })
        .await
        .expect("migrate task")
}

async fn check(
    handle: &PgDatabase,
) -> lockstep_core::Result<lockstep_pg::migrate::InstalledSchema> {
    let handle = handle.clone();
    tokio::spawn(async move { handle.check_schema().await })
        .await
        .expect("check task")
}

fn mismatch(result: lockstep_core::Result<impl std::fmt::Debug>) -> SchemaMismatch {
    let error = result.expect_err("the schema is refused");
    assert_eq!(error.kind(), ErrorKind::Unsupported, "{error}");
    SchemaMismatch::of(&error)
        .unwrap_or_else(|| panic!("no SchemaMismatch in {error:?}"))
        .clone()
}

/// Signatures of the functions named `name` in the database.
async fn overloads(admin: &tokio_postgres::Client, name: &str) -> Vec<String> {
    admin
        .query(
            "SELECT p.oid::regprocedure::text FROM pg_proc p \
              WHERE p.proname = $1 AND p.pronamespace = current_schema()::regnamespace \
              ORDER BY 1",
            &[&name],
        )
        .await
        .expect("overloads")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[tokio::test]
async fn a_database_without_the_schema_is_refused_until_migrated_then_accepted() {
    let (_db, handle, _admin) = database().await;
    assert_eq!(mismatch(check(&handle).await), SchemaMismatch::NotInstalled);
    let error = check(&handle).await.expect_err("refused");
    assert!(
        error.to_string().contains("lockstep migrate"),
        "says what to do: {error}"
    );

    let report = migrate(&handle).await.expect("migrate");
    assert_eq!(report.schema_version, SCHEMA_VERSION);
    let installed = check(&handle).await.expect("accepted");
    assert_eq!(
        (installed.version, installed.last_breaking),
        (SCHEMA_VERSION, SCHEMA_LAST_BREAKING)
    );
    assert_eq!(installed.installed_by, env!("CARGO_PKG_VERSION"));
    let remembered = handle.clone();
    tokio::spawn(async move { remembered.ensure_schema().await })
        .await
        .expect("task")
        .expect("remembered");
}

#[tokio::test]
async fn only_a_changed_function_file_is_applied_again() {
    let (_db, handle, admin) = database().await;
    migrate(&handle).await.expect("migrate");
    admin
        .batch_execute(
            "UPDATE lockstep_schema_functions SET checksum = 'edited' \
              WHERE name = 'lockstep_rewind_page'",
        )
        .await
        .expect("tamper");
    assert_eq!(
        mismatch(check(&handle).await),
        SchemaMismatch::FunctionsDiffer {
            names: vec!["lockstep_rewind_page".to_owned()]
        }
    );
    let report = migrate(&handle).await.expect("migrate again");
    assert_eq!(report.functions_applied, vec!["lockstep_rewind_page"]);
    assert!(report.applied.is_empty() && report.functions_dropped.is_empty());
    check(&handle).await.expect("accepted again");
    assert!(migrate(&handle).await.expect("a third run").is_empty());
}

#[tokio::test]
async fn an_overload_the_file_does_not_define_and_a_function_without_a_file_are_dropped() {
    let (_db, handle, admin) = database().await;
    migrate(&handle).await.expect("migrate");
    // An overload left by an earlier definition of the key function, and a function an
    // earlier build installed whose file is gone.
    admin
        .batch_execute(
            "CREATE FUNCTION lockstep_advisory_key(resource_key text, salt integer) \
               RETURNS bigint LANGUAGE sql AS $$ SELECT 1::bigint $$; \
             UPDATE lockstep_schema_functions SET checksum = 'edited' \
              WHERE name = 'lockstep_advisory_key'; \
             CREATE FUNCTION lockstep_obsolete(a integer) RETURNS integer \
               LANGUAGE sql AS $$ SELECT a $$; \
             CREATE FUNCTION lockstep_obsolete(a text) RETURNS text \
               LANGUAGE sql AS $$ SELECT a $$; \
             INSERT INTO lockstep_schema_functions (name, checksum) \
             VALUES ('lockstep_obsolete', 'x')",
        )
        .await
        .expect("leftovers");
    let report = migrate(&handle).await.expect("migrate again");
    assert_eq!(report.functions_applied, vec!["lockstep_advisory_key"]);
    assert_eq!(
        report.functions_dropped,
        vec![
            "lockstep_advisory_key(text,integer)",
            "lockstep_obsolete(integer)",
            "lockstep_obsolete(text)",
        ]
    );
    assert_eq!(
        overloads(&admin, "lockstep_advisory_key").await,
        vec!["lockstep_advisory_key(text)"]
    );
    assert!(overloads(&admin, "lockstep_obsolete").await.is_empty());
    let recorded: i64 = admin
        .query_one(
            "SELECT count(*) FROM lockstep_schema_functions WHERE name = 'lockstep_obsolete'",
            &[],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(recorded, 0);
    check(&handle).await.expect("accepted");
}

#[tokio::test]
async fn a_function_whose_result_type_changed_is_dropped_and_created_again() {
    let (_db, handle, admin) = database().await;
    migrate(&handle).await.expect("migrate");
    // What a file that changed the result type leaves installed: CREATE OR REPLACE refuses it.
    admin
        .batch_execute(
            "DROP FUNCTION lockstep_advisory_key(text); \
             CREATE FUNCTION lockstep_advisory_key(resource_key text) RETURNS integer \
               LANGUAGE sql AS $$ SELECT 1 $$; \
             UPDATE lockstep_schema_functions SET checksum = 'edited' \
              WHERE name = 'lockstep_advisory_key'",
        )
        .await
        .expect("an older result type");
    let report = migrate(&handle).await.expect("migrate again");
    assert_eq!(report.functions_applied, vec!["lockstep_advisory_key"]);
    let key: i64 = admin
        .query_one("SELECT lockstep_advisory_key('relay:aggregate:A:1')", &[])
        .await
        .expect("the file's definition")
        .get(0);
    assert_eq!(key, lockstep_core::advisory_key("relay:aggregate:A:1"));
}

#[tokio::test]
async fn a_newer_compatible_schema_serves_an_older_build_and_is_never_downgraded() {
    let (_db, handle, admin) = database().await;
    migrate(&handle).await.expect("migrate");
    // What a newer build that changed a function compatibly leaves behind.
    admin
        .batch_execute(&format!(
            "UPDATE lockstep_schema_version SET version = {}, installed_by = '9.9.9'; \
             UPDATE lockstep_schema_functions SET checksum = 'newer' \
              WHERE name = 'lockstep_rewind_page'",
            SCHEMA_VERSION + 1
        ))
        .await
        .expect("a newer schema");
    let installed = check(&handle).await.expect("still served");
    assert_eq!(installed.version, SCHEMA_VERSION + 1);
    let report = migrate(&handle).await.expect("migrate is a no-op");
    assert!(report.is_empty(), "{report:?}");
    assert_eq!(report.schema_version, SCHEMA_VERSION + 1);
    let checksum: String = admin
        .query_one(
            "SELECT checksum FROM lockstep_schema_functions WHERE name = 'lockstep_rewind_page'",
            &[],
        )
        .await
        .expect("checksum")
        .get(0);
    assert_eq!(
        checksum, "newer",
        "the newer build's function is left in place"
    );
    let status = handle.migration_status().await.expect("status");
    assert!(status.is_up_to_date(), "{status:?}");
}

#[tokio::test]
async fn a_newer_breaking_schema_is_refused_by_the_check_and_by_migrate() {
    let (_db, handle, admin) = database().await;
    migrate(&handle).await.expect("migrate");
    admin
        .batch_execute(&format!(
            "UPDATE lockstep_schema_version SET version = {0}, last_breaking = {0}",
            SCHEMA_VERSION + 2
        ))
        .await
        .expect("a newer, breaking schema");
    let expected = SchemaMismatch::Newer {
        database: SCHEMA_VERSION + 2,
        last_breaking: SCHEMA_VERSION + 2,
        build: SCHEMA_VERSION,
    };
    assert_eq!(mismatch(check(&handle).await), expected);
    assert_eq!(mismatch(migrate(&handle).await), expected);
    let error = check(&handle).await.expect_err("refused");
    assert!(error.to_string().contains("upgrade this binary"), "{error}");
    assert!(
        !handle
            .migration_status()
            .await
            .expect("status")
            .is_up_to_date()
    );
}

#[tokio::test]
async fn an_older_schema_is_refused_until_migrate_brings_it_up() {
    let (_db, handle, admin) = database().await;
    migrate(&handle).await.expect("migrate");
    // Version 0 stands for any version older than this build's.
    admin
        .batch_execute(
            "ALTER TABLE lockstep_schema_version \
               DROP CONSTRAINT lockstep_schema_version_positive, \
               DROP CONSTRAINT lockstep_schema_version_breaking_known; \
             UPDATE lockstep_schema_version SET version = 0, last_breaking = 0",
        )
        .await
        .expect("an older schema");
    assert_eq!(
        mismatch(check(&handle).await),
        SchemaMismatch::Older {
            database: 0,
            build: SCHEMA_VERSION
        }
    );
    migrate(&handle).await.expect("migrate");
    assert_eq!(
        check(&handle).await.expect("accepted").version,
        SCHEMA_VERSION
    );
}

#[tokio::test]
async fn a_database_of_a_development_snapshot_is_refused_with_advice() {
    let (_db, handle, admin) = database().await;
    // The history a snapshot before the baseline left: its first migration was not the
    // baseline.
    admin
        .batch_execute(
            "CREATE TABLE lockstep_schema_history (version int4 PRIMARY KEY, \
               name varchar(255), applied_on varchar(255), checksum varchar(255)); \
             INSERT INTO lockstep_schema_history VALUES \
               (1, 'perspective_cursors', '2026-12-01T00:00:00Z', '1')",
        )
        .await
        .expect("a snapshot's history");
    assert_eq!(mismatch(check(&handle).await), SchemaMismatch::Snapshot);
    assert_eq!(mismatch(migrate(&handle).await), SchemaMismatch::Snapshot);
    let status = handle.migration_status().await.expect("status");
    assert!(status.snapshot && !status.is_up_to_date());
    let error = migrate(&handle).await.expect_err("refused");
    assert!(error.to_string().contains("new database"), "{error}");
}

#[tokio::test]
async fn every_function_file_is_installed_under_its_name() {
    let (_db, handle, admin) = database().await;
    migrate(&handle).await.expect("migrate");
    for file in FUNCTION_FILES {
        let exists: bool = admin
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_proc WHERE proname = $1) \
                     OR EXISTS (SELECT 1 FROM pg_views WHERE viewname = $1)",
                &[&file.name],
            )
            .await
            .expect("lookup")
            .get(0);
        assert!(exists, "{} is not installed", file.name);
    }
}
