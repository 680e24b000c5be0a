//! lockstep-pg against a real PostgreSQL: migrations and owned transactions.

use lockstep_core::ErrorKind;
use lockstep_core::Transaction as _;
use lockstep_pg::{PgTransaction, migrate, migrate::embedded_migrations};
use lockstep_testkit::pg_harness::{TestDatabase, test_database};
use lockstep_testkit::relay::Relay;

/// The server process id of `client`'s connection.
async fn backend_pid(client: &tokio_postgres::Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0)
}

/// `pg_stat_activity.state` of backend `pid` (`idle`, `idle in transaction`, …), read by `setup`.
async fn backend_state(setup: &tokio_postgres::Client, pid: i32) -> String {
    setup
        .query_one("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await
        .expect("state")
        .get(0)
}

#[tokio::test]
async fn migrations_apply_once_even_when_two_runs_race() {
    let db = test_database().await;
    let (pool_a, pool_b) = (db.pool(2), db.pool(2));
    let (a, b) = tokio::join!(migrate(&pool_a), migrate(&pool_b));
    let (a, b) = (a.expect("first run"), b.expect("second run"));
    let mut applied = a.applied.clone();
    applied.extend(b.applied.clone());
    applied.sort();
    assert_eq!(
        applied,
        embedded_migrations(),
        "every migration applied exactly once"
    );
    let mut functions = a.functions_applied.clone();
    functions.extend(b.functions_applied.clone());
    let every_file: Vec<String> = lockstep_pg::migrate::FUNCTION_FILES
        .iter()
        .map(|f| f.name.to_owned())
        .collect();
    assert_eq!(
        functions, every_file,
        "every function file applied once, in order"
    );
    let again = migrate(&pool_a).await.expect("third run");
    assert!(again.is_empty(), "{again:?}");
    assert_eq!(again.schema_version, lockstep_pg::migrate::SCHEMA_VERSION);
    let client = db.connect().await;
    let row = client
        .query_one("SELECT count(*) FROM wh_perspective_cursors", &[])
        .await
        .expect("table exists");
    assert_eq!(row.get::<_, i64>(0), 0);
}

/// The status of the migrations and function files, read only — pending on a new database (and nothing
/// created), applied after `migrate`, an edited file shows as changed, a version this build
/// does not know as unknown; called from a spawned task with the concrete handle.
#[tokio::test]
async fn migration_status_says_applied_pending_changed_and_unknown_and_changes_nothing() {
    use lockstep_pg::migrate::MigrationState;
    let db = test_database().await;
    let handle = lockstep_pg::PgDatabase::from_pool(db.pool(2));
    let spawned = handle.clone();
    let fresh = tokio::spawn(async move { spawned.migration_status().await })
        .await
        .expect("task")
        .expect("status");
    assert_eq!(fresh.migrations.len(), embedded_migrations().len());
    assert!(
        fresh
            .migrations
            .iter()
            .all(|m| m.state == MigrationState::Pending)
    );
    assert!(
        fresh
            .functions
            .iter()
            .all(|f| f.state == MigrationState::Pending)
    );
    assert_eq!(
        fresh.functions.len(),
        lockstep_pg::migrate::FUNCTION_FILES.len()
    );
    assert_eq!(fresh.schema, None);
    assert!(!fresh.is_up_to_date());
    let admin = db.connect().await;
    let tables: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'",
            &[],
        )
        .await
        .expect("tables")
        .get(0);
    assert_eq!(tables, 0, "reading the status creates nothing");

    handle.migrate().await.expect("migrate");
    let migrated = handle.migration_status().await.expect("status");
    assert!(migrated.is_up_to_date(), "{migrated:?}");
    assert!(
        migrated
            .migrations
            .iter()
            .all(|m| matches!(m.state, MigrationState::Applied { .. }))
    );
    assert!(
        migrated
            .functions
            .iter()
            .all(|f| matches!(f.state, MigrationState::Applied { .. }))
    );
    assert_eq!(
        migrated.schema.as_ref().map(|s| s.version),
        Some(lockstep_pg::migrate::SCHEMA_VERSION)
    );

    admin
        .batch_execute(
            "UPDATE lockstep_schema_history SET checksum = '1' WHERE version = 1;
             INSERT INTO lockstep_schema_history (version, name, applied_on, checksum)
             VALUES (9999, 'from_a_newer_build', '2026-12-02T00:00:00Z', '2')",
        )
        .await
        .expect("tamper");
    let tampered = handle.migration_status().await.expect("status");
    assert!(!tampered.is_up_to_date());
    assert!(matches!(
        tampered.migrations[0].state,
        MigrationState::Changed { .. }
    ));
    let last = tampered.migrations.last().expect("entries");
    assert_eq!(
        (last.version, last.name.as_str()),
        (9999, "from_a_newer_build")
    );
    assert!(matches!(last.state, MigrationState::Unknown { .. }));

    admin
        .batch_execute(
            "UPDATE lockstep_schema_functions SET checksum = 'edited' \
              WHERE name = 'lockstep_append_events'",
        )
        .await
        .expect("tamper with a function's record");
    let changed = handle.migration_status().await.expect("status");
    let entry = changed
        .functions
        .iter()
        .find(|f| f.name == "lockstep_append_events")
        .expect("listed");
    assert!(matches!(entry.state, MigrationState::Changed { .. }));
}

#[tokio::test]
async fn migrations_keep_their_history_apart_from_an_applications_refinery_history() {
    let db = test_database().await;
    let pool = db.pool(1);
    let client = db.connect().await;
    // An application that uses refinery too has already applied its own V1..V3.
    client
        .batch_execute(
            "CREATE TABLE refinery_schema_history (version int4 PRIMARY KEY, name varchar(255), \
             applied_on varchar(255), checksum varchar(255)); \
             INSERT INTO refinery_schema_history VALUES \
             (1, 'app_one', '2026-01-01T00:00:00Z', '1'), (2, 'app_two', '2026-01-01T00:00:00Z', '2'), \
             (3, 'app_three', '2026-01-01T00:00:00Z', '3')",
        )
        .await
        .expect("the application's history");
    let report = migrate(&pool).await.expect("migrate");
    assert_eq!(
        report.applied,
        embedded_migrations(),
        "every lockstep migration applied"
    );
    let versions: Vec<i32> = client
        .query(
            &format!(
                "SELECT version FROM {} ORDER BY version",
                lockstep_pg::migrate::MIGRATION_TABLE
            ),
            &[],
        )
        .await
        .expect("lockstep's history")
        .iter()
        .map(|row| row.get(0))
        .collect();
    let expected: Vec<i32> = embedded_migrations().iter().map(|(v, _)| *v).collect();
    assert_eq!(versions, expected);
    let app: i64 = client
        .query_one("SELECT count(*) FROM refinery_schema_history", &[])
        .await
        .expect("the application's history")
        .get(0);
    assert_eq!(app, 3, "the application's history is untouched");
}

#[tokio::test]
async fn committing_a_failed_transaction_reports_it_and_keeps_nothing() {
    let db = test_database().await;
    let pool = db.pool(2);
    let setup = db.connect().await;
    setup
        .batch_execute("CREATE TABLE t (x int)")
        .await
        .expect("create");

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.client()
        .execute("INSERT INTO t VALUES (1)", &[])
        .await
        .expect("insert");
    let failed = tx.client().execute("SELECT 1/0", &[]).await;
    assert!(failed.is_err());
    let err = tx
        .commit()
        .await
        .expect_err("commit of a failed transaction");
    assert_eq!(err.kind(), ErrorKind::TransactionAborted);

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.client()
        .execute("INSERT INTO t VALUES (2)", &[])
        .await
        .expect("insert");
    tx.commit().await.expect("commit");

    let rows = setup.query("SELECT x FROM t", &[]).await.expect("select");
    let xs: Vec<i32> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(xs, vec![2]);
}

/// ADR 0024: `BEGIN` is not waited for, yet the statements after it run inside the
/// transaction — a second session sees nothing until the commit, and a rollback keeps nothing —
/// from a spawned task with the concrete types.
#[tokio::test]
async fn statements_after_an_unawaited_begin_run_inside_the_transaction() {
    let db = test_database().await;
    let pool = db.pool(2);
    let setup = db.connect().await;
    setup
        .batch_execute("CREATE TABLE t (x int)")
        .await
        .expect("create");
    let spawned = pool.clone();
    let (pid, xid) = tokio::spawn(async move {
        let tx = PgTransaction::begin(&spawned).await.expect("begin");
        tx.client()
            .execute("INSERT INTO t VALUES (1)", &[])
            .await
            .expect("insert");
        // The insert's transaction id is still this transaction's (outside one, the insert
        // would have committed on its own and the next statement would have none).
        let xid: Option<i64> = tx
            .client()
            .query_one("SELECT txid_current_if_assigned()", &[])
            .await
            .expect("probe")
            .get(0);
        let pid = backend_pid(tx.client()).await;
        tx.rollback().await.expect("rollback");
        (pid, xid)
    })
    .await
    .expect("no panic");
    assert!(xid.is_some(), "the insert ran inside the transaction");
    let rows: i64 = setup
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(
        rows, 0,
        "the rollback kept nothing: the insert was in the transaction"
    );
    assert_eq!(backend_state(&setup, pid).await, "idle");

    let spawned = pool.clone();
    tokio::spawn(async move {
        let tx = PgTransaction::begin(&spawned).await.expect("begin");
        tx.client()
            .execute("INSERT INTO t VALUES (2)", &[])
            .await
            .expect("insert");
        tx.commit().await.expect("commit");
        // Nothing but BEGIN and COMMIT: both replies read in one trip.
        let empty = PgTransaction::begin(&spawned).await.expect("begin");
        empty.commit().await.expect("an empty transaction commits");
    })
    .await
    .expect("no panic");
    let rows: i64 = setup
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(rows, 1);
}

/// ADR 0024: a `BEGIN` the server refuses is never a silent success. A connection handed to
/// `begin_on` inside a failed transaction makes the server refuse it (25P02), and every
/// statement after it: the commit reports `TransactionAborted` (nothing ran), the rollback
/// too (where it used to answer `Ok`), and the connection is usable again
/// afterwards. (A refusal on an idle session — out of memory, a cancel request hitting `BEGIN`
/// — is `CommitUnknown` by the same path; it cannot be provoked on demand.)
#[tokio::test]
async fn a_begin_the_server_refuses_is_reported_when_the_transaction_ends() {
    let db = test_database().await;
    let pool = db.pool(1);
    for end in ["commit", "rollback"] {
        let conn = pool.get().await.expect("checkout");
        // A session inside a failed transaction: BEGIN and every statement after it error.
        conn.batch_execute("BEGIN").await.expect("begin by hand");
        assert!(conn.batch_execute("SELECT 1/0").await.is_err());
        let tx = PgTransaction::begin_on(conn)
            .await
            .expect("begin_on does not wait for the server");
        assert!(tx.client().execute("SELECT 1", &[]).await.is_err());
        let err = match end {
            "commit" => tx.commit().await.expect_err("a refused BEGIN"),
            _ => tx.rollback().await.expect_err("a refused BEGIN"),
        };
        assert_eq!(err.kind(), ErrorKind::TransactionAborted, "{end}: {err}");
    }
    // The pool's one connection was rolled back and pooled, or closed and replaced.
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let one: i32 = tx
        .client()
        .query_one("SELECT 1", &[])
        .await
        .expect("select")
        .get(0);
    assert_eq!(one, 1);
    tx.commit().await.expect("commit");
}

#[tokio::test]
async fn dropping_an_open_transaction_rolls_back_and_never_pools_the_connection_inside_it() {
    let db = test_database().await;
    let pool = db.pool(1);
    let setup = db.connect().await;
    setup
        .batch_execute("CREATE TABLE t (x int)")
        .await
        .expect("create");

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.client()
        .execute("INSERT INTO t VALUES (1)", &[])
        .await
        .expect("insert");
    drop(tx);

    // The pool (size 1) hands the connection back only after the background ROLLBACK: it is
    // outside any transaction, and the insert is gone.
    let conn = tokio::time::timeout(std::time::Duration::from_secs(10), pool.get())
        .await
        .expect("the connection comes back")
        .expect("connection");
    let pid = backend_pid(&conn).await;
    let state = backend_state(&setup, pid).await;
    assert_eq!(state, "idle", "pooled outside any transaction");
    let count: i64 = setup
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(count, 0);
}

/// Dropped with no runtime to roll back on, the connection is closed, never pooled.
#[test]
fn dropping_an_open_transaction_without_a_runtime_closes_its_connection() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (db, pool, tx, pid) = runtime.block_on(async {
        let db = test_database().await;
        let pool = db.pool(1);
        let tx = PgTransaction::begin(&pool).await.expect("begin");
        let pid = backend_pid(tx.client()).await;
        (db, pool, tx, pid)
    });
    drop(tx); // outside the runtime: nothing to roll back on
    runtime.block_on(async {
        let conn = pool.get().await.expect("connection");
        let now = backend_pid(&conn).await;
        assert_ne!(now, pid, "the open transaction's connection was not pooled");
        drop(db);
    });
}

/// A relay in front of `db`'s server and a pool of 2 connections through it: arm
/// [`Relay::cut_after_client_sends`] with `COMMIT` and the server commits, the client never
/// hears back (a lost COMMIT reply).
async fn relayed(db: &TestDatabase) -> (Relay, deadpool_postgres::Pool) {
    let relay = Relay::start(db.server_address().expect("a TCP server"))
        .await
        .expect("start the relay");
    let pool = db.pool_through(relay.addr(), 2);
    (relay, pool)
}

/// Issue 8, risk "a lost COMMIT reply is a retryable ConnectionLost": the server committed, the
/// reply was lost with the connection. The commit reports `CommitUnknown` (not retryable), the
/// row is there, and the connection is not pooled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_reply_is_commit_unknown_not_a_retryable_connection_loss() {
    let db = test_database().await;
    let setup = db.connect().await;
    setup
        .batch_execute("CREATE TABLE t (x int)")
        .await
        .expect("create");
    let (relay, pool) = relayed(&db).await;

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.client()
        .execute("INSERT INTO t VALUES (1)", &[])
        .await
        .expect("insert");
    // `COMMIT` and its NUL, not the `READ COMMITTED` of a `BEGIN` still on its way (ADR 0024).
    relay.cut_after_client_sends(b"COMMIT\0");
    let err = tx.commit().await.expect_err("the reply was lost");
    assert_eq!(err.kind(), ErrorKind::CommitUnknown, "{err}");
    assert!(
        !err.is_retryable(),
        "running the work again could apply it twice"
    );
    let mut committed = 0;
    for _ in 0..100 {
        committed = setup
            .query_one("SELECT count(*) FROM t", &[])
            .await
            .expect("count")
            .get::<_, i64>(0);
        if committed == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(committed, 1, "the server did commit");
    // The pool hands out a working connection (the lost one was not pooled).
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.client().execute("SELECT 1", &[]).await.expect("works");
    tx.rollback().await.expect("rollback");
}

/// A connection lost before COMMIT was sent is a plain, retryable `ConnectionLost` (the server
/// rolled back), and the pool replaces the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_before_commit_is_a_retryable_connection_loss() {
    let db = test_database().await;
    let pool = db.pool(1);
    let admin = db.connect().await;
    admin
        .batch_execute("CREATE TABLE t (x int)")
        .await
        .expect("create");
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.client()
        .execute("INSERT INTO t VALUES (1)", &[])
        .await
        .expect("insert");
    let pid = backend_pid(tx.client()).await;
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .expect("terminate");
    for _ in 0..250 {
        if tx.client().is_closed() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(tx.client().is_closed(), "the driver noticed");
    let err = tx.commit().await.expect_err("lost");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost, "{err}");
    assert!(err.is_retryable());
    let count: i64 = admin
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(count, 0);
    let tx = PgTransaction::begin(&pool).await.expect("a new connection");
    tx.rollback().await.expect("rollback");
}

/// Issue 8, risk "pool exhaustion": with deadpool's defaults a checkout waited for ever. Every
/// lockstep checkout now waits a bounded time and then fails with a typed, retryable error
/// that names the pool's state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_is_a_typed_error_after_the_checkout_wait_not_a_hang() {
    use lockstep_core::TransactionSource;
    use std::time::Duration;

    let db = test_database().await;
    let pool = db.pool(1);
    let held = PgTransaction::begin(&pool)
        .await
        .expect("the only connection");
    let source = lockstep_pg::PgDatabase::builder()
        .pool(pool.clone())
        .checkout_wait(Duration::from_millis(100))
        .build()
        .expect("handle");
    let err = tokio::time::timeout(Duration::from_secs(10), source.begin())
        .await
        .expect("bounded, not a hang")
        .expect_err("exhausted");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost, "{err}");
    assert!(err.is_retryable());
    assert!(err.message().contains("exhausted"), "{err}");
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        PgTransaction::begin_within(&pool, Duration::from_millis(50)),
    )
    .await
    .expect("bounded, not a hang")
    .expect_err("exhausted");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost, "{err}");
    held.rollback().await.expect("rollback");
    let tx = source.begin().await.expect("free again");
    tx.rollback().await.expect("rollback");
}

/// The default wait is bounded too: [`lockstep_pg::DEFAULT_CHECKOUT_WAIT`] (tokio's paused
/// clock skips it: the test does not take 5 s).
#[tokio::test]
async fn the_default_checkout_wait_is_bounded() {
    let db = test_database().await;
    let pool = db.pool(1);
    let held = PgTransaction::begin(&pool)
        .await
        .expect("the only connection");
    // Paused only now: the harness's connect timeout runs on tokio's clock too.
    tokio::time::pause();
    let started = tokio::time::Instant::now();
    let err = PgTransaction::begin(&pool).await.expect_err("exhausted");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost, "{err}");
    assert!(started.elapsed() >= lockstep_pg::DEFAULT_CHECKOUT_WAIT);
    held.rollback().await.expect("rollback");
}

/// Issue 8, risk "a connection that failed with ConnectionLost goes back to the pool": after a
/// statement failed because its backend was terminated, the connection is closed, not pooled,
/// and the next checkout gets a working one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_failed_with_a_lost_connection_is_not_pooled_again() {
    let db = test_database().await;
    let pool = db.pool(1);
    let admin = db.connect().await;
    let conn = lockstep_pg::checkout(&pool, std::time::Duration::from_secs(5))
        .await
        .expect("checkout");
    let pid = backend_pid(&conn).await;
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .expect("terminate");
    let err = conn
        .query_one("SELECT 1", &[])
        .await
        .expect_err("terminated");
    assert_eq!(
        lockstep_pg::map_error(err, "probing").kind(),
        ErrorKind::ConnectionLost
    );
    let err = conn
        .query_one("SELECT 1", &[])
        .await
        .expect_err("still lost");
    assert!(!lockstep_pg::pool::return_or_discard(conn, Some(&err)));
    assert_eq!(pool.status().size, 0, "detached from the pool");
    let next = lockstep_pg::checkout(&pool, std::time::Duration::from_secs(5))
        .await
        .expect("a new connection");
    next.query_one("SELECT 1", &[]).await.expect("works");
    assert!(lockstep_pg::pool::return_or_discard(next, None));
    assert_eq!(pool.status().size, 1, "a healthy one is pooled");
}

/// A test database with a table `t (x int PRIMARY KEY)`, and a connection of its own to look.
async fn database_with_table_t() -> (TestDatabase, tokio_postgres::Client) {
    let db = test_database().await;
    let setup = db.connect().await;
    setup
        .batch_execute("CREATE TABLE t (x int PRIMARY KEY)")
        .await
        .expect("create");
    (db, setup)
}

/// A write held back with `write_at_commit` until a pipelined commit.
fn insert_at_commit(x: i32) -> lockstep_pg::WriteAtCommit {
    lockstep_pg::WriteAtCommit::new("INSERT INTO t VALUES ($1)")
        .bind(x, tokio_postgres::types::Type::INT4)
        .map_error(|e| lockstep_core::Error::new(ErrorKind::Conflict, "inserting").with_source(e))
}

/// Issue 11: writes held back until commit are stored by it, in order; one that fails rolls the
/// whole transaction back, the commit returns its error, and the connection goes back to the
/// pool outside any transaction.
#[tokio::test]
async fn writes_held_back_until_commit_are_stored_by_it_or_roll_everything_back() {
    let (db, setup) = database_with_table_t().await;
    let pool = db.pool(1);

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.client()
        .execute("INSERT INTO t VALUES (1)", &[])
        .await
        .expect("insert");
    tx.write_at_commit(insert_at_commit(2));
    tx.write_at_commit(insert_at_commit(3));
    assert_eq!(tx.writes_at_commit(), 2);
    let seen: i64 = setup
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(seen, 0, "nothing is sent before the commit");
    tx.commit().await.expect("commit");

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let pid = backend_pid(tx.client()).await;
    tx.client()
        .execute("INSERT INTO t VALUES (4)", &[])
        .await
        .expect("insert");
    tx.write_at_commit(insert_at_commit(2)); // a duplicate: fails at the server
    tx.write_at_commit(insert_at_commit(5));
    let err = tx.commit().await.expect_err("the held-back write failed");
    assert_eq!(
        err.kind(),
        ErrorKind::Conflict,
        "the write's own error: {err}"
    );

    let xs: Vec<i32> = setup
        .query("SELECT x FROM t ORDER BY x", &[])
        .await
        .expect("select")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(xs, vec![1, 2, 3], "the failed transaction kept nothing");
    // The same connection, pooled again, is outside any transaction.
    let state = backend_state(&setup, pid).await;
    assert_eq!(state, "idle", "not inside a transaction");
    let conn = pool.get().await.expect("connection");
    let again = backend_pid(&conn).await;
    assert_eq!(again, pid, "the clean connection was pooled again");

    // A rollback discards held-back writes unsent.
    drop(conn);
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.write_at_commit(insert_at_commit(9));
    tx.rollback().await.expect("rollback");
    let nine: i64 = setup
        .query_one("SELECT count(*) FROM t WHERE x = 9", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(nine, 0);
}

/// A statement's error as a conflict (the caller's own mapping).
fn as_conflict(e: tokio_postgres::Error) -> lockstep_core::Error {
    lockstep_core::Error::new(ErrorKind::Conflict, "the last statement").with_source(e)
}

/// The values stored in `t`, in order.
async fn stored(setup: &tokio_postgres::Client) -> Vec<i32> {
    setup
        .query("SELECT x FROM t ORDER BY x", &[])
        .await
        .expect("select")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// ADR 0034: `commit_returning` sends its statement after the held-back writes and with the
/// `COMMIT`, and returns its rows once committed; a statement that fails rolls the whole
/// transaction back and returns its error as the caller maps it, and the connection is pooled
/// outside any transaction. From a spawned task, with the concrete types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_statement_sent_with_the_commit_returns_its_rows_or_rolls_everything_back() {
    use tokio_postgres::types::Type;
    let (db, setup) = database_with_table_t().await;
    let pool = db.pool(1);

    let (pool2, rows) = tokio::spawn(async move {
        let tx = PgTransaction::begin(&pool).await.expect("begin");
        tx.client()
            .execute("INSERT INTO t VALUES (1)", &[])
            .await
            .expect("insert");
        tx.write_at_commit(insert_at_commit(2));
        let rows = tx
            .commit_returning(
                "INSERT INTO t VALUES ($1) RETURNING x * 10",
                &[(&3_i32, Type::INT4)],
                as_conflict,
            )
            .await
            .expect("committed");
        (pool, rows)
    })
    .await
    .expect("the spawned task");
    let pool = pool2;
    let tens: Vec<i32> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(tens, vec![30], "the statement's rows");
    assert_eq!(stored(&setup).await, vec![1, 2, 3], "all of it committed");

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let pid = backend_pid(tx.client()).await;
    tx.client()
        .execute("INSERT INTO t VALUES (4)", &[])
        .await
        .expect("insert");
    tx.write_at_commit(insert_at_commit(5));
    let err = tx
        .commit_returning("INSERT INTO t VALUES (1)", &[], as_conflict)
        .await
        .expect_err("a duplicate");
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(
        err.to_string().contains("the last statement"),
        "the caller's mapping: {err}"
    );
    assert_eq!(
        stored(&setup).await,
        vec![1, 2, 3],
        "the failed transaction kept nothing"
    );
    assert_eq!(backend_state(&setup, pid).await, "idle");
    let conn = pool.get().await.expect("connection");
    assert_eq!(
        backend_pid(&conn).await,
        pid,
        "the clean connection was pooled again"
    );
}

/// A held-back write or a last statement whose parameter cannot be encoded (a text bound as
/// an `int4`) is refused by the client before anything is sent: the `COMMIT` must not follow
/// it, or the rest of the transaction would commit without it. Both roll back, say so as
/// invalid input, and pool the connection outside any transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_that_cannot_be_encoded_is_not_followed_by_the_commit() {
    use tokio_postgres::types::Type;
    let (db, setup) = database_with_table_t().await;
    let pool = db.pool(1);
    let task_pool = pool.clone();
    let handler = tokio::spawn(async move {
        let pool = task_pool;
        let tx = PgTransaction::begin(&pool).await.expect("begin");
        tx.client()
            .execute("INSERT INTO t VALUES (1)", &[])
            .await
            .expect("insert");
        tx.write_at_commit(
            lockstep_pg::WriteAtCommit::new("INSERT INTO t VALUES ($1)")
                .bind("two".to_owned(), Type::INT4),
        );
        let held_back = tx.commit().await.expect_err("not encodable").kind();

        let tx = PgTransaction::begin(&pool).await.expect("begin");
        let pid = backend_pid(tx.client()).await;
        tx.client()
            .execute("INSERT INTO t VALUES (3)", &[])
            .await
            .expect("insert");
        tx.write_at_commit(insert_at_commit(4));
        let last = tx
            .commit_returning(
                "INSERT INTO t VALUES ($1)",
                &[(&"five", Type::INT4)],
                as_conflict,
            )
            .await
            .expect_err("not encodable")
            .kind();
        (held_back, last, pid)
    });
    let (held_back, last, pid) = handler.await.expect("the spawned task");
    assert_eq!(
        (held_back, last),
        (ErrorKind::InvalidInput, ErrorKind::InvalidInput)
    );
    assert_eq!(
        stored(&setup).await,
        Vec::<i32>::new(),
        "nothing of either transaction committed"
    );
    assert_eq!(backend_state(&setup, pid).await, "idle");
    let conn = pool.get().await.expect("connection");
    assert_eq!(backend_pid(&conn).await, pid, "pooled again");
}

/// ADR 0034: the statement and the `COMMIT` go out together. A reply lost after the `COMMIT`
/// was sent is `CommitUnknown` (both may have been applied), never a retryable error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_to_a_statement_sent_with_the_commit_is_commit_unknown() {
    let (db, _setup) = database_with_table_t().await;
    let (relay, pool) = relayed(&db).await;

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    relay.cut_after_client_sends(b"COMMIT\0");
    let err = tx
        .commit_returning("INSERT INTO t VALUES (1) RETURNING x", &[], as_conflict)
        .await
        .expect_err("the reply was lost");
    assert_eq!(err.kind(), ErrorKind::CommitUnknown, "{err}");
    assert!(!err.is_retryable());
}

/// ADR 0034: the statement and the `COMMIT` are one round trip (counted by a relay between the
/// pool and the server). On one thread, so that the connection's task writes both requests
/// together: on two, it may write the statement before the `COMMIT` is queued, and the relay
/// counts a second burst if the statement's reply came back in between — the client still
/// never waits for it.
#[tokio::test]
async fn the_statement_and_the_commit_are_one_round_trip() {
    let (db, setup) = database_with_table_t().await;
    let (relay, pool) = relayed(&db).await;
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.client()
        .execute("INSERT INTO t VALUES (1)", &[])
        .await
        .expect("insert");
    let before = relay.round_trips();
    let rows = tx
        .commit_returning("INSERT INTO t VALUES (2) RETURNING x", &[], as_conflict)
        .await
        .expect("committed");
    assert_eq!(rows.len(), 1);
    assert_eq!(relay.round_trips() - before, 1, "one round trip");
    assert_eq!(stored(&setup).await, vec![1, 2]);
}

/// `PgTransactionRef::commit_returning`'s default (a transaction type that does not pipeline):
/// the statement, then the commit; a failed statement rolls the transaction back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_last_statement_runs_it_then_commits() {
    use lockstep_pg::PgTransactionRef;

    /// A transaction that keeps the trait's default.
    struct Plain(PgTransaction);

    impl PgTransactionRef for Plain {
        type Executor = tokio_postgres::Client;

        fn executor(&self) -> &tokio_postgres::Client {
            self.0.client()
        }
    }

    impl lockstep_core::Transaction for Plain {
        fn commit(self) -> impl std::future::Future<Output = lockstep_core::Result<()>> + Send {
            self.0.commit()
        }

        fn rollback(self) -> impl std::future::Future<Output = lockstep_core::Result<()>> + Send {
            self.0.rollback()
        }
    }

    let (db, setup) = database_with_table_t().await;
    let pool = db.pool(1);
    let handler = tokio::spawn(async move {
        let tx = Plain(PgTransaction::begin(&pool).await.expect("begin"));
        let rows = PgTransactionRef::commit_returning(
            tx,
            "INSERT INTO t VALUES (1) RETURNING x",
            &[],
            as_conflict,
        )
        .await
        .expect("committed");
        let tx = Plain(PgTransaction::begin(&pool).await.expect("begin"));
        tx.executor()
            .execute("INSERT INTO t VALUES (2)", &[])
            .await
            .expect("insert");
        let err =
            PgTransactionRef::commit_returning(tx, "INSERT INTO t VALUES (1)", &[], as_conflict)
                .await
                .expect_err("a duplicate");
        (rows.len(), err.kind(), err.to_string())
    });
    let (rows, kind, message) = handler.await.expect("the spawned task");
    assert_eq!((rows, kind), (1, ErrorKind::Conflict));
    assert!(
        message.contains("the last statement"),
        "the caller's mapping: {message}"
    );
    assert_eq!(stored(&setup).await, vec![1], "the failed one kept nothing");
}

/// Issue 11: a lost reply to a pipelined write + COMMIT is `CommitUnknown` (the server may have
/// committed both), never a retryable error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_to_a_pipelined_commit_is_commit_unknown() {
    let (db, _setup) = database_with_table_t().await;
    let (relay, pool) = relayed(&db).await;

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    tx.write_at_commit(insert_at_commit(1));
    // `COMMIT` and its NUL, not the `READ COMMITTED` of a `BEGIN` still on its way (ADR 0024).
    relay.cut_after_client_sends(b"COMMIT\0");
    let err = tx.commit().await.expect_err("the reply was lost");
    assert_eq!(err.kind(), ErrorKind::CommitUnknown, "{err}");
    assert!(!err.is_retryable());
    let tx = PgTransaction::begin(&pool)
        .await
        .expect("the pool recovers");
    tx.rollback().await.expect("rollback");
}

/// Issue 11 (cancel safety): a commit dropped while its pipelined write runs closes the
/// connection instead of pooling it mid-transaction.
#[tokio::test]
async fn a_commit_dropped_in_flight_never_pools_its_connection() {
    let (db, _setup) = database_with_table_t().await;
    let pool = db.pool(1);

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let pid = backend_pid(tx.client()).await;
    tx.client()
        .execute("INSERT INTO t VALUES (1)", &[])
        .await
        .expect("insert");
    tx.write_at_commit(lockstep_pg::WriteAtCommit::new("SELECT pg_sleep(2)"));
    let dropped = tokio::time::timeout(std::time::Duration::from_millis(200), tx.commit()).await;
    assert!(dropped.is_err(), "the commit was still in flight");

    let conn = pool.get().await.expect("connection");
    let now = backend_pid(&conn).await;
    assert_ne!(
        now, pid,
        "the connection of the dropped commit was not pooled"
    );
    // Its COMMIT was sent: like a lost reply, whether it committed is unknown (the server
    // decides once the held-back write ends). Either way the transaction is whole: the row
    // inserted before the commit is there exactly when the commit went through.
}

/// Issue 21: lockstep's connections say who they are in `pg_stat_activity` (so lock listings
/// can name the application holding or waiting): `lockstep` by default, the builder's name
/// when given, and the application's own when its URL or config sets one.
#[tokio::test]
async fn connections_report_an_application_name() {
    let db = test_database().await;
    let name_of = |db: lockstep_pg::PgDatabase| async move {
        let client = db.checkout().await.expect("checkout");
        client
            .query_one("SELECT current_setting('application_name')", &[])
            .await
            .expect("query")
            .get::<_, String>(0)
    };
    let plain = lockstep_pg::PgDatabase::builder()
        .config(db.config().clone())
        .build()
        .expect("handle");
    assert_eq!(name_of(plain).await, "lockstep");
    let named = lockstep_pg::PgDatabase::builder()
        .config(db.config().clone())
        .application_name("lockstep serve")
        .build()
        .expect("handle");
    assert_eq!(name_of(named).await, "lockstep serve");
    let mut own = db.config().clone();
    own.application_name("billing");
    let theirs = lockstep_pg::PgDatabase::builder()
        .config(own)
        .application_name("ignored")
        .build()
        .expect("handle");
    assert_eq!(name_of(theirs).await, "billing");
}
