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

/// The server's TCP address, or a typed error when there is none (a Unix socket, no host).
#[test]
fn the_server_address_is_the_first_tcp_host_or_a_typed_error() {
    use std::str::FromStr;

    use lockstep_testkit::pg_harness::{NotOnTcp, server_address};
    use tokio_postgres::Config;

    let tcp = Config::from_str("postgres://u@db.example:6543/d").expect("url");
    assert_eq!(server_address(&tcp), Ok(("db.example".to_owned(), 6543)));
    let default_port = Config::from_str("host=db.example user=u").expect("key-value");
    assert_eq!(
        server_address(&default_port),
        Ok(("db.example".to_owned(), 5432))
    );
    let hostaddr = Config::from_str("host=db.example hostaddr=10.0.0.7 port=6000").expect("kv");
    assert_eq!(
        server_address(&hostaddr),
        Ok(("10.0.0.7".to_owned(), 6000)),
        "hostaddr is what a client connects to"
    );
    #[cfg(unix)]
    {
        let unix = Config::from_str("host=/var/run/postgresql user=u").expect("key-value");
        assert_eq!(
            server_address(&unix),
            Err(NotOnTcp::UnixSocket("/var/run/postgresql".into()))
        );
    }
    assert_eq!(server_address(&Config::new()), Err(NotOnTcp::NoHost));
}

/// A pool through a relay reaches the same database as the direct one, with the relay the only
/// host, and its traffic goes through the relay.
#[tokio::test]
async fn a_pool_through_a_relay_reaches_the_test_database() {
    use lockstep_testkit::relay::Relay;
    use tokio_postgres::config::Host;

    let db = test_database().await;
    let relay = Relay::start(db.server_address().expect("a TCP server"))
        .await
        .expect("relay");
    let through = db.config_through(relay.addr());
    assert_eq!(
        through.get_hosts(),
        [Host::Tcp(relay.addr().ip().to_string())]
    );
    assert_eq!(through.get_ports(), [relay.addr().port()]);
    assert_eq!(through.get_dbname(), Some(db.name()));
    assert_eq!(through.get_user(), db.config().get_user());

    let pool = db.pool_through(relay.addr(), 1);
    let client = pool.get().await.expect("a connection through the relay");
    let current: String = client
        .query_one("SELECT current_database()", &[])
        .await
        .expect("query")
        .get(0);
    assert_eq!(current, db.name());
    assert!(
        relay.round_trips() > 0,
        "the traffic went through the relay"
    );
}
