//! Upgrades: a database populated by a released schema version is migrated by this build with
//! its data intact, ends with exactly the schema of a fresh install, and runs: the worker
//! catches up the pending work (under the expired lease a dead process left too) with exact
//! folds, and leaves the parked pair parked.
//!
//! Each released version has a fixture, `tests/fixtures/schema-{version}.sql`: a `pg_dump
//! --inserts` of a database that version's code populated (events, cursors, a held lease, a
//! parked pair, a JSON perspective's states, a table perspective's rows in the application's
//! tables). It is written once, when the version is released, by the ignored test
//! `write_the_fixture_of_this_schema_version` (`cargo test -p lockstep-tests --test upgrade --
//! --ignored`), and never edited after (docs/adr/0039-schema-files.md).
//!
//! For the fixture of this build's own schema version, `migrate()` must change nothing: a
//! schema file changed without raising `SCHEMA_VERSION` fails here.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::{
    AcquireOutcome, EventStore as _, ExpectedVersion, InstanceId, LockReason, NewEvent,
    PerspectiveName, PerspectiveRegistry, RecordedEvent, StreamId, StreamLockOptions, StreamLocker,
    TablePerspective, Transaction as _, TransactionSource as _,
};
use lockstep_pg::migrate::SCHEMA_VERSION;
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::{TestDatabase, normalise_schema_dump, test_database};
use lockstep_tests::{NUMBERS, Numbers, number_event};
use lockstep_worker::{PerspectiveWorker, WorkerOptions};

/// The application's table, written by the table perspective.
const APP_SCHEMA: &str = "
CREATE TABLE upgrade_seen_events (
    event_id uuid PRIMARY KEY,
    stream_id uuid NOT NULL,
    n bigint NOT NULL
);";

/// A table perspective: one row per event in the application's table.
struct SeenEvents;

impl TablePerspective<PgTransaction> for SeenEvents {
    type Error = tokio_postgres::Error;

    fn name(&self) -> &str {
        "SeenEvents"
    }

    async fn apply(&self, tx: &PgTransaction, event: &RecordedEvent) -> Result<(), Self::Error> {
        tx.client()
            .execute(
                "INSERT INTO upgrade_seen_events (event_id, stream_id, n) VALUES ($1, $2, $3)",
                &[
                    &event.event_id,
                    &event.stream_id.as_uuid(),
                    &event.payload["n"].as_i64().unwrap_or(0),
                ],
            )
            .await?;
        Ok(())
    }

    async fn reset(&self, tx: &PgTransaction, stream_id: StreamId) -> Result<(), Self::Error> {
        tx.client()
            .execute(
                "DELETE FROM upgrade_seen_events WHERE stream_id = $1",
                &[&stream_id.as_uuid()],
            )
            .await?;
        Ok(())
    }
}

type Worker = PerspectiveWorker<PgDatabase, PgPerspectiveStore>;

fn worker(db: &PgDatabase) -> Worker {
    let locker = PgStreamLocker::new(
        db,
        StreamLockOptions::new(Duration::from_secs(5), Duration::from_secs(1)).expect("options"),
    );
    let mut registry = PerspectiveRegistry::new();
    registry.register(Numbers::default()).expect("register");
    registry
        .register_table::<PgTransaction, _>(SeenEvents)
        .expect("register");
    PerspectiveWorker::new(
        db.clone(),
        PgPerspectiveStore::new(),
        registry,
        // A pair parks at its first failure.
        WorkerOptions::default().with_park_after_failures(Some(1)),
        InstanceId::random(),
        Some(Arc::new(locker) as Arc<dyn StreamLocker>),
    )
    .expect("worker")
}

async fn append(db: &PgDatabase, stream: StreamId, events: Vec<NewEvent>) {
    let tx = db.begin().await.expect("begin");
    PgEventStore::new(db)
        .append(&tx, stream, ExpectedVersion::Any, &events)
        .await
        .expect("append");
    tx.commit().await.expect("commit");
}

/// Runs cycles until one does no work (at most 50).
async fn drain(worker: &Worker) {
    for _ in 0..50 {
        if !worker.run_once().await.did_work() {
            return;
        }
    }
    panic!("the worker still had work after 50 cycles");
}

fn numbered(ns: std::ops::Range<i64>) -> Vec<NewEvent> {
    ns.map(number_event).collect()
}

/// A new database with this build's schema and the application's table.
async fn migrated_with_the_applications_table() -> (TestDatabase, PgDatabase) {
    let test_db = test_database().await;
    let db = PgDatabase::from_pool(test_db.pool(4));
    db.migrate().await.expect("migrate");
    db.pool()
        .get()
        .await
        .expect("connection")
        .batch_execute(APP_SCHEMA)
        .await
        .expect("the application's schema");
    (test_db, db)
}

/// Writes `tests/fixtures/schema-{SCHEMA_VERSION}.sql` from a database this build populates.
/// Run once per released schema version; the file is never edited after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes the fixture of a release; run by hand when a schema version is released"]
async fn write_the_fixture_of_this_schema_version() {
    let (test_db, db) = migrated_with_the_applications_table().await;
    let worker = worker(&db);
    worker.register().await.expect("register");

    // Five streams, folded by both perspectives.
    let streams: Vec<StreamId> = (0..5).map(|_| StreamId::new_v7()).collect();
    for (i, stream) in streams.iter().enumerate() {
        let base = i64::try_from(i).expect("small") * 100;
        append(&db, *stream, numbered(base..base + 5)).await;
    }
    // A stream whose third event Numbers cannot fold: its pair parks there.
    let parked = StreamId::new_v7();
    let mut events = numbered(900..902);
    events.push(NewEvent::new("Numbered", serde_json::json!({ "text": "x" })).expect("event"));
    append(&db, parked, events).await;
    drain(&worker).await;

    // Pending work on two streams, and a lease on one of them left by a process that died
    // holding it (a lease of 10 ms, expired by the time anyone reads the fixture).
    append(&db, streams[0], numbered(5..8)).await;
    append(&db, streams[1], numbered(105..108)).await;
    let locker = PgStreamLocker::new(
        &db,
        StreamLockOptions::new(Duration::from_millis(10), Duration::from_millis(2))
            .expect("options"),
    );
    let numbers = PerspectiveName::new(NUMBERS).expect("name");
    let outcome = locker
        .try_acquire(
            streams[0],
            &numbers,
            InstanceId::random(),
            &LockReason::Rewind,
        )
        .await
        .expect("acquire");
    assert!(
        matches!(outcome, AcquireOutcome::Acquired(_)),
        "{outcome:?}"
    );

    let dump = test_db
        .pg_dump(&["--inserts"])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let path = fixture_dir().join(format!("schema-{SCHEMA_VERSION}.sql"));
    std::fs::create_dir_all(fixture_dir()).expect("fixtures folder");
    std::fs::write(&path, dump).unwrap_or_else(|e| panic!("writing {path:?}: {e}"));
}

fn fixture_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// Every fixture, as (schema version, text), oldest first.
fn fixtures() -> Vec<(i32, String)> {
    let mut found: Vec<(i32, String)> = std::fs::read_dir(fixture_dir())
        .expect("tests/fixtures")
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let name = path.file_name()?.to_str()?.to_owned();
            let version = name
                .strip_prefix("schema-")?
                .strip_suffix(".sql")?
                .parse()
                .ok()?;
            Some((version, std::fs::read_to_string(&path).ok()?))
        })
        .collect();
    found.sort_by_key(|(version, _)| *version);
    found
}

/// Loads a `pg_dump --inserts` text into `db` (psql's meta-commands, lines starting with `\`,
/// left out), on a connection of its own: the dump empties its `search_path`.
async fn restore(db: &TestDatabase, dump: &str) {
    let sql: String = dump
        .lines()
        .filter(|line| !line.starts_with('\\'))
        .collect::<Vec<_>>()
        .join("\n");
    db.connect()
        .await
        .batch_execute(&sql)
        .await
        .expect("restore the fixture");
}

/// A digest of every row of every table of the database, by table.
async fn contents(
    client: &tokio_postgres::Client,
    columns: &BTreeMap<String, Vec<String>>,
) -> Vec<(String, i64, String)> {
    let mut out = Vec::new();
    for (table, columns) in columns {
        let row_of = format!(
            "row({})::text",
            columns
                .iter()
                .map(|c| format!("t.\"{c}\""))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let row = client
            .query_one(
                &format!(
                    "SELECT count(*), coalesce(md5(string_agg({row_of}, ',' ORDER BY {row_of})), '') \
                       FROM \"{table}\" t"
                ),
                &[],
            )
            .await
            .expect("digest");
        out.push((table.clone(), row.get(0), row.get(1)));
    }
    out
}

/// Every table of the schema and its columns, in order.
async fn columns_of(client: &tokio_postgres::Client) -> BTreeMap<String, Vec<String>> {
    let rows = client
        .query(
            "SELECT c.table_name::text, c.column_name::text \
               FROM information_schema.columns c \
               JOIN pg_tables t ON t.tablename = c.table_name AND t.schemaname = c.table_schema \
              WHERE c.table_schema = current_schema() \
              ORDER BY c.table_name, c.ordinal_position",
            &[],
        )
        .await
        .expect("columns");
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for row in rows {
        out.entry(row.get(0)).or_default().push(row.get(1));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_released_schema_upgrades_with_its_data_intact_and_runs() {
    let fixtures = fixtures();
    assert!(
        fixtures.iter().any(|(v, _)| *v == 1),
        "tests/fixtures/schema-1.sql, the fixture of 0.1, is missing"
    );
    let fresh = test_database().await;
    PgDatabase::from_pool(fresh.pool(2))
        .migrate()
        .await
        .expect("a fresh install");
    let fresh_schema = fresh.schema_dump().await.unwrap_or_else(|e| panic!("{e}"));

    for (version, dump) in fixtures {
        let test_db = test_database().await;
        restore(&test_db, &dump).await;
        let admin = test_db.connect().await;
        let columns_before = columns_of(&admin).await;
        let before = contents(&admin, &columns_before).await;
        let db = PgDatabase::from_pool(test_db.pool(4));
        let migrating = db.clone();
        let report = tokio::spawn(async move { migrating.migrate().await })
            .await
            .expect("task")
            .unwrap_or_else(|e| panic!("migrating the schema of version {version}: {e}"));
        if version == SCHEMA_VERSION {
            assert!(
                report.is_empty(),
                "migrate() changed a database of this build's own schema version \
                 ({SCHEMA_VERSION}): {report:?}. A schema file changed without raising \
                 SCHEMA_VERSION (docs/adr/0039-schema-files.md)"
            );
        }
        // The data of the tables and columns the old schema had is unchanged; what the
        // migration added (tables, defaulted columns) is checked below and by the run.
        let after = contents(&admin, &columns_before).await;
        let columns_after = columns_of(&admin).await;
        for table in columns_after
            .keys()
            .filter(|t| !columns_before.contains_key(*t))
        {
            let rows: i64 = admin
                .query_one(&format!("SELECT count(*) FROM \"{table}\""), &[])
                .await
                .expect("count")
                .get(0);
            assert_eq!(
                rows, 0,
                "version {version}: the new table {table} is not empty"
            );
        }
        let unchanged = |table: &str| !table.starts_with("lockstep_schema_");
        assert_eq!(
            before
                .iter()
                .filter(|t| unchanged(&t.0))
                .collect::<Vec<_>>(),
            after.iter().filter(|t| unchanged(&t.0)).collect::<Vec<_>>(),
            "version {version}: the data changed while migrating"
        );
        let upgraded = test_db
            .pg_dump(&["--schema-only", "--exclude-table=upgrade_seen_events"])
            .await
            .map(|dump| normalise_schema_dump(&dump))
            .unwrap_or_else(|e| panic!("{e}"));
        let differ = upgraded
            .lines()
            .zip(fresh_schema.lines())
            .enumerate()
            .find(|(_, (a, b))| a != b);
        if let Some((line, (was, is))) = differ {
            panic!(
                "version {version}: the upgraded schema differs from a fresh install's at line \
                 {}: upgraded `{was}`, fresh `{is}`",
                line + 1
            );
        }
        assert_eq!(
            upgraded.lines().count(),
            fresh_schema.lines().count(),
            "version {version}: the upgraded schema differs from a fresh install's in length"
        );
        db.check_schema().await.expect("this build runs on it");

        runs_after_the_upgrade(&db, &admin).await;
    }
}

/// The worker catches up — the pair under the dead process's lease included — folds exactly
/// what each stream holds, writes each event's row once, and leaves the parked pair parked.
async fn runs_after_the_upgrade(db: &PgDatabase, admin: &tokio_postgres::Client) {
    let leases_before: Vec<(uuid::Uuid, i64)> = admin
        .query(
            "SELECT stream_id, stream_lock_epoch FROM wh_perspective_cursors \
              WHERE stream_lock_instance_id IS NOT NULL",
            &[],
        )
        .await
        .expect("leases")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(leases_before.len(), 1, "the fixture holds one lease");
    let parked: Vec<uuid::Uuid> = admin
        .query(
            "SELECT stream_id FROM wh_perspective_cursors WHERE parked_at IS NOT NULL",
            &[],
        )
        .await
        .expect("parked")
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(parked.len(), 1, "the fixture has one parked pair");
    let pending: i64 = admin
        .query_one("SELECT count(*) FROM wh_perspective_events", &[])
        .await
        .expect("work")
        .get(0);
    assert!(pending > 0, "the fixture has pending work");

    // The fixture's lease expired long ago: it does not hold its pair back.
    let worker = worker(db);
    worker.register().await.expect("register");
    let spawned = tokio::spawn(async move {
        drain(&worker).await;
    });
    spawned.await.expect("worker task");

    let left: i64 = admin
        .query_one(
            "SELECT count(*) FROM wh_perspective_events w \
              WHERE NOT EXISTS (SELECT 1 FROM wh_perspective_cursors k \
                                 WHERE k.stream_id = w.stream_id \
                                   AND k.perspective_name = w.perspective_name \
                                   AND k.parked_at IS NOT NULL)",
            &[],
        )
        .await
        .expect("work")
        .get(0);
    assert_eq!(left, 0, "every pair that is not parked caught up");

    // Folds: Numbers holds every `n` of its stream in order; the parked stream's state stops
    // before the event it parked at.
    let streams: Vec<uuid::Uuid> = admin
        .query("SELECT DISTINCT stream_id FROM wh_events ORDER BY 1", &[])
        .await
        .expect("streams")
        .iter()
        .map(|row| row.get(0))
        .collect();
    for stream in streams {
        let ns: Vec<i64> = admin
            .query(
                "SELECT (payload->>'n')::bigint FROM wh_events \
                  WHERE stream_id = $1 AND payload ? 'n' ORDER BY event_id",
                &[&stream],
            )
            .await
            .expect("events")
            .iter()
            .map(|row| row.get(0))
            .collect();
        let state: serde_json::Value = admin
            .query_one(
                "SELECT state FROM wh_perspective_states \
                  WHERE stream_id = $1 AND perspective_name = $2",
                &[&stream, &NUMBERS],
            )
            .await
            .expect("state")
            .get(0);
        assert_eq!(state, serde_json::json!(ns), "the fold of stream {stream}");
        let rows: i64 = admin
            .query_one(
                "SELECT count(*) FROM upgrade_seen_events WHERE stream_id = $1",
                &[&stream],
            )
            .await
            .expect("rows")
            .get(0);
        let events: i64 = admin
            .query_one(
                "SELECT count(*) FROM wh_events WHERE stream_id = $1",
                &[&stream],
            )
            .await
            .expect("events")
            .get(0);
        assert_eq!(
            rows, events,
            "one application row per event of stream {stream}"
        );
    }
    let still_parked: i64 = admin
        .query_one(
            "SELECT count(*) FROM wh_perspective_cursors WHERE stream_id = $1 \
                AND parked_at IS NOT NULL",
            &[&parked[0]],
        )
        .await
        .expect("parked")
        .get(0);
    assert_eq!(
        still_parked, 1,
        "the parked pair stays parked until an operator acts"
    );
}

/// A worker refuses a database a newer lockstep migrated with a breaking change, before it
/// registers or takes any work, and says to upgrade the binary; the same worker starts once the
/// schema is one it runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refuses_a_schema_it_was_not_built_for() {
    use lockstep_pg::migrate::SchemaMismatch;
    let (test_db, db) = migrated_with_the_applications_table().await;
    let admin = test_db.connect().await;
    let newer = SCHEMA_VERSION + 1;
    admin
        .batch_execute(&format!(
            "UPDATE lockstep_schema_version SET version = {newer}, last_breaking = {newer}"
        ))
        .await
        .expect("a newer, breaking schema");

    let refused = worker(&db);
    let error =
        tokio::spawn(async move { refused.run(lockstep_worker::CancellationToken::new()).await })
            .await
            .expect("task")
            .expect_err("the worker refuses the schema");
    assert!(
        matches!(
            SchemaMismatch::of(&error),
            Some(SchemaMismatch::Newer { .. })
        ),
        "{error:?}"
    );
    assert!(error.to_string().contains("upgrade this binary"), "{error}");
    let registered: i64 = admin
        .query_one("SELECT count(*) FROM wh_perspectives", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(registered, 0, "nothing registered");

    admin
        .batch_execute(&format!(
            "UPDATE lockstep_schema_version SET version = {newer}, last_breaking = 1"
        ))
        .await
        .expect("a newer, compatible schema");
    let accepted = worker(&db);
    tokio::spawn(async move { accepted.register().await })
        .await
        .expect("task")
        .expect("a compatible schema serves this build");
}
