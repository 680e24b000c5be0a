//! Errors say why, once (issue 17): the server's message and SQLSTATE, or the I/O cause, appear
//! exactly once in `Display`; a printed chain (every `source()` joined, as `anyhow`'s `{:#}`
//! does) does not repeat them; connection errors name host, port and database — never the
//! password.

use lockstep_core::{ErrorKind, TransactionSource};
use lockstep_pg::PgDatabase;
use lockstep_testkit::pg_harness::test_database;

/// `err` and every `source()` after it, joined as `anyhow` prints `{:#}`.
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut next = err.source();
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
}

fn occurrences(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}

/// A URL for the test server with `password` and the given port and database.
fn url(host: &str, port: u16, database: &str) -> String {
    format!("postgres://postgres:Zq7KxWv9Pm@{host}:{port}/{database}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_does_not_exist_says_so_once_and_names_the_target() {
    let db = test_database().await;
    let (host, port) = db.server_address().expect("a TCP server");
    let err = PgDatabase::connect(&url(&host, port, "lockstep_no_such_db"))
        .await
        .expect_err("no such database");
    let shown = err.to_string();
    let chained = chain(&err);
    assert_eq!(
        occurrences(&shown, r#"database "lockstep_no_such_db" does not exist"#),
        1,
        "{shown}"
    );
    assert_eq!(occurrences(&shown, "SQLSTATE 3D000"), 1, "{shown}");
    assert_eq!(
        occurrences(&chained, "does not exist"),
        1,
        "a chain says it once: {chained}"
    );
    assert!(
        shown.contains(&format!("{host}:{port}")) && shown.contains("lockstep_no_such_db"),
        "names host, port and database: {shown}"
    );
    assert!(!chained.contains("Zq7Kx"), "never the password: {chained}");
    let driver = err
        .underlying()
        .and_then(|e| e.downcast_ref::<deadpool_postgres::PoolError>());
    assert!(driver.is_some(), "the driver's error is still reachable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_nobody_listens_on_says_connection_refused_once() {
    // A port just bound and released: nothing listens there.
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("address").port()
    };
    let err = PgDatabase::connect(&url("127.0.0.1", port, "app"))
        .await
        .expect_err("refused");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost, "{err}");
    let shown = err.to_string();
    let chained = chain(&err);
    assert_eq!(
        occurrences(&shown.to_lowercase(), "connection refused"),
        1,
        "{shown}"
    );
    assert_eq!(
        occurrences(&chained.to_lowercase(), "connection refused"),
        1,
        "{chained}"
    );
    assert!(shown.contains(&format!("127.0.0.1:{port}")), "{shown}");
    assert!(shown.contains(r#"database "app""#), "{shown}");
    assert!(!chained.contains("Zq7Kx"), "{chained}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_statement_says_its_server_message_and_sqlstate_once() {
    let test_db = test_database().await;
    let db = PgDatabase::from_pool(test_db.pool(1));
    let tx = db.begin().await.expect("begin");
    let failed = tx
        .client()
        .execute("SELECT * FROM no_such_table", &[])
        .await
        .expect_err("no such table");
    let err = lockstep_pg::map_error(failed, "reading the table");
    let chained = chain(&err);
    assert_eq!(
        err.to_string(),
        r#"backend error: reading the table: relation "no_such_table" does not exist (SQLSTATE 42P01)"#
    );
    assert_eq!(occurrences(&chained, "does not exist"), 1, "{chained}");
}

#[test]
fn a_url_that_does_not_parse_never_repeats_it() {
    for bad in [
        "postgres://app:Zq7Kx@Wv9Pm@127.0.0.1:1/prod",
        "postgres://db:Zq7KxWv9Pm/prod",
        "host=db password='Zq7KxWv9Pm",
    ] {
        let err = PgDatabase::from_url(bad).expect_err(bad);
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        let text = format!("{} {err:?}", chain(&err));
        assert!(!text.contains("Zq7Kx") && !text.contains("Wv9Pm"), "{text}");
    }
}
