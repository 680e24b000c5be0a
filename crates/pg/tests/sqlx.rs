//! `SqlxTransaction`, lockstep's unit of work on an application's sqlx pool, against a real
//! PostgreSQL (a database per test), each from a spawned task with the concrete types: it
//! commits what the application wrote with sqlx on it, reports a failed transaction at commit,
//! a lost commit reply as `CommitUnknown`, an exhausted pool as a typed error, and never pools
//! a connection inside a transaction — dropped open, it is rolled back first (or closed).

use std::time::Duration;

use lockstep_core::{ErrorKind, Transaction as _, TransactionSource as _};
use lockstep_pg::sqlx::{SqlxDatabase, SqlxTransaction, map_sqlx_error};
use lockstep_testkit::pg_harness::{TestDatabase, test_database};
use lockstep_testkit::relay::Relay;

/// A database with table `t (x int)`, and its sqlx handle of `size` connections.
async fn with_table(size: u32) -> (TestDatabase, SqlxDatabase) {
    let db = test_database().await;
    let pool = db.sqlx_pool(size);
    sqlx::query("CREATE TABLE t (x int)")
        .execute(&pool)
        .await
        .expect("create");
    (db, SqlxDatabase::new(pool))
}

async fn insert(tx: &SqlxTransaction, x: i32) -> lockstep_core::Result<()> {
    let mut conn = tx.connection().await?;
    sqlx::query("INSERT INTO t VALUES ($1)")
        .bind(x)
        .execute(&mut *conn)
        .await
        .map_err(map_sqlx_error)?;
    Ok(())
}

async fn stored(db: &TestDatabase) -> Vec<i32> {
    let client = db.connect().await;
    client
        .query("SELECT x FROM t ORDER BY x", &[])
        .await
        .expect("select")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// The state of backend `pid` in pg_stat_activity (`None` once it is gone).
async fn backend_state(db: &TestDatabase, pid: i32) -> Option<String> {
    let client = db.connect().await;
    client
        .query_opt("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await
        .expect("pg_stat_activity")
        .map(|row| row.get(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_keeps_the_applications_rows_and_rollback_keeps_nothing() {
    let (db, source) = with_table(2).await;
    let handler = |x: i32, commit: bool| {
        let source = source.clone();
        tokio::spawn(async move {
            let tx: SqlxTransaction = source.begin().await?;
            insert(&tx, x).await?;
            if commit {
                tx.commit().await
            } else {
                tx.rollback().await
            }
        })
    };
    handler(1, true).await.expect("task").expect("commit");
    handler(2, false).await.expect("task").expect("rollback");
    assert_eq!(stored(&db).await, vec![1]);

    // The unit-of-work runner commits on Ok and rolls back on Err.
    let runner = tokio::spawn({
        let source = source.clone();
        async move {
            source
                .transaction(|tx| Box::pin(async move { insert(&tx, 3).await }))
                .await?;
            source
                .transaction(|tx| {
                    Box::pin(async move {
                        insert(&tx, 4).await?;
                        Err::<(), _>(lockstep_core::Error::new(ErrorKind::Conflict, "refused"))
                    })
                })
                .await
        }
    });
    let err = runner.await.expect("task").expect_err("the work failed");
    assert_eq!(err.kind(), ErrorKind::Conflict);
    assert_eq!(stored(&db).await, vec![1, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committing_a_failed_transaction_reports_it_and_keeps_nothing() {
    let (db, source) = with_table(1).await;
    let task = tokio::spawn({
        let source = source.clone();
        async move {
            let tx: SqlxTransaction = source.begin().await?;
            insert(&tx, 1).await?;
            let failed = {
                let mut conn = tx.connection().await?;
                sqlx::query("SELECT 1/0").execute(&mut *conn).await
            };
            assert!(failed.is_err());
            let err = tx.commit().await.expect_err("a failed transaction");
            // The pool (one connection) hands the connection out again, outside any
            // transaction.
            let tx: SqlxTransaction = source.begin().await?;
            insert(&tx, 2).await?;
            tx.commit().await?;
            Ok::<_, lockstep_core::Error>(err)
        }
    });
    let err = task.await.expect("task").expect("unit of work");
    assert_eq!(err.kind(), ErrorKind::TransactionAborted, "{err}");
    assert_eq!(stored(&db).await, vec![2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_an_open_transaction_rolls_back_and_never_pools_the_connection_inside_it() {
    let (db, source) = with_table(1).await;
    let pid = tokio::spawn({
        let source = source.clone();
        async move {
            let tx: SqlxTransaction = source.begin().await.expect("begin");
            insert(&tx, 1).await.expect("insert");
            tx.backend_pid()
            // dropped open here
        }
    })
    .await
    .expect("task");

    // The pool (one connection) hands it back only after the background ROLLBACK.
    let tx = tokio::time::timeout(Duration::from_secs(10), source.begin())
        .await
        .expect("the connection comes back")
        .expect("begin");
    assert_eq!(tx.backend_pid(), pid, "the same connection, pooled again");
    tx.rollback().await.expect("rollback");
    assert_eq!(backend_state(&db, pid).await.as_deref(), Some("idle"));
    assert!(stored(&db).await.is_empty());
}

/// Dropped with no runtime to roll back on, the connection is closed, never pooled.
#[test]
fn dropping_an_open_transaction_without_a_runtime_closes_its_connection() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (db, source, tx) = runtime.block_on(async {
        let (db, source) = with_table(1).await;
        let tx = source.begin().await.expect("begin");
        (db, source, tx)
    });
    let pid = tx.backend_pid();
    drop(tx); // outside the runtime
    runtime.block_on(async {
        let tx = source.begin().await.expect("begin");
        assert_ne!(
            tx.backend_pid(),
            pid,
            "the open transaction's connection was not pooled"
        );
        tx.rollback().await.expect("rollback");
        drop(source);
        drop(db);
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_is_a_typed_error_after_the_checkout_wait_not_a_hang() {
    let (_db, source) = with_table(1).await;
    let source = source.with_checkout_wait(Duration::from_millis(200));
    let held = source.begin().await.expect("begin");
    let err = tokio::spawn({
        let source = source.clone();
        async move { source.begin().await.expect_err("no connection free") }
    })
    .await
    .expect("task");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost, "{err}");
    assert!(err.is_retryable());
    held.rollback().await.expect("rollback");
}

/// The server committed and the reply was lost with the connection: `CommitUnknown` (not
/// retryable), the row is there, and the connection is not pooled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_reply_is_commit_unknown() {
    let (db, _) = with_table(1).await;
    let relay = Relay::start(db.server_address().expect("a TCP server"))
        .await
        .expect("relay");
    let source = SqlxDatabase::new(db.sqlx_pool_through(relay.addr(), 1));
    let tx = source.begin().await.expect("begin");
    let pid = tx.backend_pid();
    insert(&tx, 1).await.expect("insert");
    relay.cut_after_client_sends(b"COMMIT\0");
    let err = tokio::spawn(tx.commit())
        .await
        .expect("task")
        .expect_err("the reply was lost");
    assert_eq!(err.kind(), ErrorKind::CommitUnknown, "{err}");
    assert!(!err.is_retryable());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while stored(&db).await != vec![1] {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server committed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tx = source.begin().await.expect("a new connection");
    assert_ne!(tx.backend_pid(), pid);
    tx.rollback().await.expect("rollback");
}

/// A server that no longer accepts writes (a demoted primary, a standby): the connection is not
/// pooled again after a rollback finds it read-only, so the next checkout connects anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_to_a_server_that_cannot_write_is_not_pooled_again() {
    let (db, source) = with_table(1).await;
    // The session turns read-only (as after a demotion) once this transaction commits.
    let tx = source.begin().await.expect("begin");
    let pid = tx.backend_pid();
    {
        let mut conn = tx.connection().await.expect("connection");
        sqlx::query("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
            .execute(&mut *conn)
            .await
            .expect("read only session");
    }
    tx.commit().await.expect("commit");
    let tx = source.begin().await.expect("begin");
    assert_eq!(
        tx.backend_pid(),
        pid,
        "pooled again: nothing showed it read-only yet"
    );
    tokio::spawn(tx.rollback())
        .await
        .expect("task")
        .expect("rollback");
    let tx = source.begin().await.expect("a new connection");
    assert_ne!(tx.backend_pid(), pid, "the read-only session was closed");
    tx.rollback().await.expect("rollback");
    drop(db);
}

/// `SqlxDatabase::migrate` applies the same schema as the tokio-postgres `migrate` (the dumps
/// are equal), in one transaction under the migration lock: two runs at once both succeed, one
/// applies everything and the other nothing; then the schema checks out on both drivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_on_sqlx_applies_the_same_schema_once_even_when_two_runs_race() {
    let on_sqlx = test_database().await;
    let source = SqlxDatabase::new(on_sqlx.sqlx_pool(4));
    let runs: Vec<_> = (0..2)
        .map(|_| {
            let source = source.clone();
            tokio::spawn(async move { source.migrate().await })
        })
        .collect();
    let mut applied = Vec::new();
    for run in runs {
        let report = run.await.expect("task").expect("migrate");
        applied.push(report.applied.len());
    }
    applied.sort_unstable();
    assert_eq!(applied[0], 0, "the second run found nothing to do");
    assert!(applied[1] > 0, "the first run applied the migrations");
    let installed = source.check_schema().await.expect("schema");
    assert_eq!(installed.version, lockstep_pg::migrate::SCHEMA_VERSION);
    lockstep_pg::migrate::check_schema(&on_sqlx.pool(1))
        .await
        .expect("the tokio-postgres check agrees");

    let on_tokio_postgres = test_database().await;
    lockstep_pg::migrate(&on_tokio_postgres.pool(1))
        .await
        .expect("migrate");
    let normalised = lockstep_testkit::pg_harness::normalise_schema_dump;
    let sqlx_dump = on_sqlx.schema_dump().await.expect("pg_dump");
    let tokio_postgres_dump = on_tokio_postgres.schema_dump().await.expect("pg_dump");
    assert_eq!(normalised(&sqlx_dump), normalised(&tokio_postgres_dump));
}
