//! lockstep-pg against a real PostgreSQL: migrations and owned transactions.

use lockstep_core::ErrorKind;
use lockstep_pg::{PgTransaction, migrate, migrate::embedded_migrations};
use lockstep_testkit::pg_harness::test_database;

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
    let again = migrate(&pool_a).await.expect("third run");
    assert!(again.applied.is_empty());
    let client = db.connect().await;
    let row = client
        .query_one("SELECT count(*) FROM wh_perspective_cursors", &[])
        .await
        .expect("table exists");
    assert_eq!(row.get::<_, i64>(0), 0);
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

#[tokio::test]
async fn dropping_an_open_transaction_rolls_back_and_never_pools_the_connection() {
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
    let dropped_pid: i32 = tx
        .client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    drop(tx);

    // The pool (size 1) hands out a new connection, not the one left mid-transaction.
    let conn = pool.get().await.expect("connection");
    let pid: i32 = conn
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    assert_ne!(
        pid, dropped_pid,
        "the open transaction's connection was not pooled"
    );
    let count: i64 = setup
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(count, 0);
}
