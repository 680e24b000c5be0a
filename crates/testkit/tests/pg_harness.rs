//! The Postgres test-database harness against the real server: one fresh database per test,
//! dropped afterwards.

use lockstep_testkit::pg_harness::{DATABASE_PREFIX, test_database};

#[tokio::test]
async fn each_test_gets_its_own_empty_database_which_is_dropped_afterwards() {
    let (a, b) = (test_database().await, test_database().await);
    assert_ne!(a.name(), b.name());
    assert!(a.name().starts_with(DATABASE_PREFIX));
    let client = a.connect().await;
    let current: String = client
        .query_one("SELECT current_database()", &[])
        .await
        .expect("query")
        .get(0);
    assert_eq!(current, a.name());
    let tables: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'",
            &[],
        )
        .await
        .expect("query")
        .get(0);
    assert_eq!(tables, 0);
    drop(client);

    let observer = b.connect().await;
    let name = a.name().to_owned();
    drop(a);
    let exists: bool = observer
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)",
            &[&name],
        )
        .await
        .expect("query")
        .get(0);
    assert!(!exists, "the database is dropped with its handle");
}
