//! The PgBouncer harness against the real server: it starts in transaction mode in front of the
//! test's database, forwards to it, moves a client between server connections, and is gone once
//! dropped.

use lockstep_testkit::pg_harness::pgbouncer::PgBouncer;
use lockstep_testkit::pg_harness::test_database;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_forwards_in_transaction_mode_and_stops_on_drop() {
    let db = test_database().await;
    // Started from a spawned task, as any test's set-up may.
    let server = db.server_address().expect("the test server on TCP");
    let bouncer = tokio::spawn(PgBouncer::start(server))
        .await
        .expect("task")
        .expect("pgbouncer starts");
    bouncer
        .warm(
            &db,
            lockstep_testkit::pg_harness::pgbouncer::WARM_SERVER_CONNECTIONS,
        )
        .await;
    let client = bouncer.connect(&db).await;
    let current: String = client
        .query_typed_one("SELECT current_database()", &[])
        .await
        .expect("a statement through the pooler")
        .get(0);
    assert_eq!(current, db.name());
    let mode = bouncer
        .admin("SHOW POOLS")
        .await
        .into_iter()
        .find(|row| {
            row.iter()
                .any(|(c, v)| c == "database" && v.as_deref() == Some(db.name()))
        })
        .and_then(|row| {
            row.into_iter()
                .find(|(c, _)| c == "pool_mode")
                .and_then(|(_, v)| v)
        });
    assert_eq!(mode.as_deref(), Some("transaction"));
    // One client, its statements on more than one server backend: the pooler rotates.
    let mut pids = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let pid: i32 = client
            .query_typed_one("SELECT pg_backend_pid()", &[])
            .await
            .expect("pid")
            .get(0);
        pids.insert(pid);
    }
    assert!(
        pids.len() > 1,
        "one server backend for 20 transactions: {pids:?}"
    );
    assert!(bouncer.transactions_of(db.name()).await >= 21);
    let address = bouncer.address();
    drop(client);
    drop(bouncer);
    assert!(
        std::net::TcpStream::connect(address).is_err(),
        "nothing listens once the pooler is dropped"
    );
}
