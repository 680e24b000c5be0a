//! The Postgres test-database harness (feature `pg-harness`): every test gets a database of its
//! own, created on a real server and dropped afterwards, so Postgres tests run in parallel and
//! leave nothing behind.
//!
//! Where the server comes from, in order:
//!
//! 1. `DATABASE_URL`, if set (it must be reachable: a set but broken URL fails the test rather
//!    than quietly testing something else);
//! 2. the local server at `postgres://postgres@127.0.0.1:5432/postgres`;
//! 3. a `postgres:15-alpine` container started with testcontainers (feature `testcontainers`,
//!    which implies `pg-harness`; off by default; needs a Docker engine);
//! 4. otherwise the test fails with a message saying how to provide a database.
//!
//! A database per test (not a schema) because advisory locks are scoped to a database: tests
//! using the same lock keys in one database would block each other.
//!
//! To put a relay between a test and its database (the `relay` module, feature `relay`): start
//! it on [`TestDatabase::server_address`] and connect through it with
//! [`TestDatabase::pool_through`] or [`TestDatabase::config_through`] (or the free functions
//! [`server_address`] and [`config_through`] for a `Config` from elsewhere).
//!
//! To run a test through PgBouncer in transaction mode: [`pgbouncer::PgBouncer`] starts one in
//! front of the test's server and gives the test's database through it.
//!
//! ```no_run
//! # async fn demo() {
//! let db = lockstep_testkit::pg_harness::test_database().await;
//! let pool = db.pool(4);
//! let client = pool.get().await.expect("connection");
//! client.batch_execute("SELECT 1").await.expect("query");
//! # }
//! ```

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use tokio::sync::OnceCell;
use tokio_postgres::config::Host;
use tokio_postgres::{Config, NoTls};

pub mod pgbouncer;

/// The local server tried when `DATABASE_URL` is not set.
pub const LOCAL_SERVER_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// Prefix of every database the harness creates (`lockstep_t_<32 hex>`).
pub const DATABASE_PREFIX: &str = "lockstep_t_";

const HOW_TO_PROVIDE: &str = "no PostgreSQL server for the tests: set DATABASE_URL \
(e.g. postgres://postgres@127.0.0.1:5432/postgres), start a local server on 127.0.0.1:5432, \
or run a Docker engine so the harness can start a container (feature `testcontainers`)";

/// Where the harness found a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerSource {
    /// From `DATABASE_URL`.
    Environment,
    /// The local server at [`LOCAL_SERVER_URL`].
    Local,
    /// A container started by the harness.
    Container,
}

#[derive(Debug, Clone)]
struct Server {
    admin: Config,
    source: ServerSource,
}

static SERVER: OnceCell<Server> = OnceCell::const_new();

/// One test's own database. Dropping it drops the database (terminating leftover connections).
#[derive(Debug)]
pub struct TestDatabase {
    name: String,
    config: Config,
    admin: Config,
    source: ServerSource,
}

/// Creates a fresh, empty database for one test. Panics, saying how to provide a server, when
/// none can be reached.
pub async fn test_database() -> TestDatabase {
    let server = SERVER.get_or_init(find_server).await;
    let name = format!("{DATABASE_PREFIX}{}", uuid::Uuid::new_v4().simple());
    let admin = connect(&server.admin)
        .await
        .unwrap_or_else(|e| panic!("connecting to the test server failed: {e}"));
    admin
        .batch_execute(&format!("CREATE DATABASE \"{name}\""))
        .await
        .unwrap_or_else(|e| panic!("CREATE DATABASE {name} failed: {e}"));
    let mut config = server.admin.clone();
    config.dbname(&name);
    TestDatabase {
        name,
        config,
        admin: server.admin.clone(),
        source: server.source,
    }
}

impl TestDatabase {
    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connection settings for this database.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Where the server came from.
    pub fn source(&self) -> ServerSource {
        self.source
    }

    /// A pool of at most `max_size` connections to this database.
    pub fn pool(&self, max_size: usize) -> deadpool_postgres::Pool {
        pool(self.config.clone(), max_size)
    }

    /// The server's TCP address (host and port), where a relay forwards to. An error when the
    /// server is reached over a Unix socket (possible with `DATABASE_URL`).
    pub fn server_address(&self) -> Result<(String, u16), NotOnTcp> {
        server_address(&self.config)
    }

    /// Connection settings for this database through a relay listening on `relay` (see
    /// [`config_through`]).
    pub fn config_through(&self, relay: SocketAddr) -> Config {
        config_through(&self.config, relay)
    }

    /// A pool of at most `max_size` connections to this database, each through the relay
    /// listening on `relay` (and [`pool`](Self::pool)'s settings otherwise).
    pub fn pool_through(&self, relay: SocketAddr, max_size: usize) -> deadpool_postgres::Pool {
        pool(self.config_through(relay), max_size)
    }

    /// An sqlx pool of at most `max_size` connections to this database (feature `sqlx`),
    /// connecting lazily: for running lockstep's backends, or an application's table
    /// perspective, on sqlx.
    #[cfg(feature = "sqlx")]
    pub fn sqlx_pool(&self, max_size: u32) -> sqlx::PgPool {
        sqlx_pool(&self.config, max_size)
    }

    /// [`sqlx_pool`](Self::sqlx_pool) through the relay listening on `relay`.
    #[cfg(feature = "sqlx")]
    pub fn sqlx_pool_through(&self, relay: SocketAddr, max_size: u32) -> sqlx::PgPool {
        sqlx_pool(&self.config_through(relay), max_size)
    }

    /// One direct connection (its connection task runs on the current runtime).
    pub async fn connect(&self) -> tokio_postgres::Client {
        connect(&self.config)
            .await
            .unwrap_or_else(|e| panic!("connecting to {} failed: {e}", self.name))
    }

    /// Connections opened from now on commit without waiting for the WAL flush
    /// (`synchronous_commit = off` for the database): for tests of semantics under concurrency,
    /// not of durability, which then run faster. Connections already open keep their setting.
    pub async fn skip_wal_flush(&self) -> Result<(), tokio_postgres::Error> {
        let client = connect(&self.config).await?;
        client
            .batch_execute(&format!(
                "ALTER DATABASE \"{}\" SET synchronous_commit = off",
                self.name.replace('"', "\"\"")
            ))
            .await
    }
}

/// How many backends of `client`'s database wait for a lock or a row right now
/// (`pg_stat_activity.wait_event_type = 'Lock'`): in a test's own database, the test's own
/// statements. A failed read panics (test code).
pub async fn lock_waiters(client: &tokio_postgres::Client) -> usize {
    let row = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
              WHERE datname = current_database() AND wait_event_type = 'Lock'",
            &[],
        )
        .await
        .unwrap_or_else(|e| panic!("reading pg_stat_activity: {e}"));
    usize::try_from(row.get::<_, i64>(0)).unwrap_or(usize::MAX)
}

/// Waits until at least `n` backends of `client`'s database wait for a lock or a row
/// ([`lock_waiters`]): a test that needs "the other writer is waiting now" asks the server
/// instead of sleeping, which a busy machine makes wrong. Bounded: panics naming `what` after
/// 60 s.
pub async fn until_lock_waiters(client: &tokio_postgres::Client, n: usize, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while lock_waiters(client).await < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not waiting for a lock after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        // Drop runs inside (or outside) some runtime; a thread with its own runtime works in
        // both cases and lets the test's runtime shut down independently.
        let (admin, name) = (self.admin.clone(), self.name.clone());
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async move {
                let client = connect(&admin).await.ok()?;
                client
                    .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                    .await
                    .ok()
            })
        })
        .join();
        if !matches!(dropped, Ok(Some(()))) {
            eprintln!(
                "lockstep-testkit: could not drop test database {}",
                self.name
            );
        }
    }
}

/// The server of a `Config` cannot be relayed: it is not reached over TCP.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NotOnTcp {
    /// The config names no host at all.
    NoHost,
    /// The server is reached through the Unix socket in this directory.
    UnixSocket(std::path::PathBuf),
}

impl fmt::Display for NotOnTcp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotOnTcp::NoHost => f.write_str("the PostgreSQL config names no host"),
            NotOnTcp::UnixSocket(path) => write!(
                f,
                "the PostgreSQL server is reached through a Unix socket in {}, not over TCP",
                path.display()
            ),
        }
    }
}

impl std::error::Error for NotOnTcp {}

/// The TCP address (host and port) a client of `config` connects to: its first `hostaddr` if
/// it has one (which libpq and tokio-postgres prefer to the host name), else its first host;
/// its first port, or 5432. Hand it to `Relay::start` (feature `relay`).
pub fn server_address(config: &Config) -> Result<(String, u16), NotOnTcp> {
    let port = config.get_ports().first().copied().unwrap_or(5432);
    if let Some(ip) = config.get_hostaddrs().first() {
        return Ok((ip.to_string(), port));
    }
    match config.get_hosts().first() {
        Some(Host::Tcp(host)) => Ok((host.clone(), port)),
        #[cfg(unix)]
        Some(Host::Unix(path)) => Err(NotOnTcp::UnixSocket(path.clone())),
        None => Err(NotOnTcp::NoHost),
    }
}

/// `config`, rewritten to connect to `relay` (its IP and port) instead of the server: a fresh
/// `Config` — a `Config`'s hosts can only be added to, and the relay must be the only one —
/// with `config`'s user, password, database, options, application name, connect timeout and
/// SSL mode.
pub fn config_through(config: &Config, relay: SocketAddr) -> Config {
    let mut through = Config::new();
    through
        .host(relay.ip().to_string())
        .port(relay.port())
        .ssl_mode(config.get_ssl_mode());
    if let Some(user) = config.get_user() {
        through.user(user);
    }
    if let Some(password) = config.get_password() {
        through.password(password);
    }
    if let Some(dbname) = config.get_dbname() {
        through.dbname(dbname);
    }
    if let Some(options) = config.get_options() {
        through.options(options);
    }
    if let Some(application_name) = config.get_application_name() {
        through.application_name(application_name);
    }
    if let Some(timeout) = config.get_connect_timeout() {
        through.connect_timeout(*timeout);
    }
    through
}

fn pool(config: Config, max_size: usize) -> deadpool_postgres::Pool {
    let manager = deadpool_postgres::Manager::from_config(
        config,
        NoTls,
        deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        },
    );
    deadpool_postgres::Pool::builder(manager)
        .max_size(max_size)
        .build()
        .unwrap_or_else(|e| panic!("building a pool failed: {e}"))
}

/// An sqlx pool with the settings of `config` (host or socket directory, port, user, password,
/// database, application name), connecting lazily.
#[cfg(feature = "sqlx")]
fn sqlx_pool(config: &Config, max_size: u32) -> sqlx::PgPool {
    use tokio_postgres::config::Host;
    let mut options = sqlx::postgres::PgConnectOptions::new_without_pgpass();
    match config.get_hosts().first() {
        Some(Host::Tcp(host)) => options = options.host(host),
        #[cfg(unix)]
        Some(Host::Unix(dir)) => options = options.socket(dir),
        None => {}
    }
    if let Some(port) = config.get_ports().first() {
        options = options.port(*port);
    }
    if let Some(user) = config.get_user() {
        options = options.username(user);
    }
    if let Some(password) = config.get_password() {
        options = options.password(&String::from_utf8_lossy(password));
    }
    if let Some(dbname) = config.get_dbname() {
        options = options.database(dbname);
    }
    options = options.application_name(config.get_application_name().unwrap_or("lockstep-test"));
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max_size)
        .connect_lazy_with(options)
}

async fn connect(config: &Config) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        // Ends with the client; an error here surfaces on the client's next call.
        let _ = connection.await;
    });
    Ok(client)
}

async fn reachable(config: &Config) -> Result<(), String> {
    match tokio::time::timeout(Duration::from_secs(5), connect(config)).await {
        Ok(Ok(client)) => client
            .simple_query("SELECT 1")
            .await
            .map(drop)
            .map_err(|e| e.to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("timed out after 5 s".into()),
    }
}

async fn find_server() -> Server {
    if let Ok(url) = std::env::var("DATABASE_URL") {
        let admin = Config::from_str(&url)
            .unwrap_or_else(|e| panic!("DATABASE_URL is not a valid PostgreSQL URL: {e}"));
        if let Err(e) = reachable(&admin).await {
            panic!("DATABASE_URL is set but its server is unreachable ({e}); {HOW_TO_PROVIDE}");
        }
        return Server {
            admin,
            source: ServerSource::Environment,
        };
    }
    let local = Config::from_str(LOCAL_SERVER_URL).unwrap_or_else(|e| unreachable!("{e}"));
    let local_error = match reachable(&local).await {
        Ok(()) => {
            return Server {
                admin: local,
                source: ServerSource::Local,
            };
        }
        Err(e) => e,
    };
    #[cfg(feature = "testcontainers")]
    match container::start().await {
        Ok(admin) => Server {
            admin,
            source: ServerSource::Container,
        },
        Err(container_error) => {
            panic!("{HOW_TO_PROVIDE} (local server: {local_error}; container: {container_error})")
        }
    }
    #[cfg(not(feature = "testcontainers"))]
    panic!("{HOW_TO_PROVIDE} (local server: {local_error}; feature `testcontainers` is off)");
}

#[cfg(feature = "testcontainers")]
mod container {
    //! The last resort: a throwaway PostgreSQL 15 container, kept for the whole test process.

    use std::sync::OnceLock;

    use testcontainers::core::{IntoContainerPort, WaitFor, wait::LogWaitStrategy};
    use testcontainers::runners::AsyncRunner;
    use testcontainers::{ContainerAsync, GenericImage, ImageExt};
    use tokio_postgres::Config;

    // Never dropped: statics are not, and testcontainers' reaper removes the container when
    // the process exits.
    static CONTAINER: OnceLock<ContainerAsync<GenericImage>> = OnceLock::new();

    pub(super) async fn start() -> Result<Config, String> {
        let container = GenericImage::new("postgres", "15-alpine")
            .with_exposed_port(5432.tcp())
            // The server logs "ready" once during initdb and once for real.
            .with_wait_for(WaitFor::Log(
                LogWaitStrategy::stderr("database system is ready to accept connections")
                    .with_times(2),
            ))
            .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust")
            .start()
            .await
            .map_err(|e| e.to_string())?;
        let port = container
            .get_host_port_ipv4(5432)
            .await
            .map_err(|e| e.to_string())?;
        let host = container.get_host().await.map_err(|e| e.to_string())?;
        let _ = CONTAINER.set(container);
        let mut config = Config::new();
        config
            .host(host.to_string())
            .port(port)
            .user("postgres")
            .dbname("postgres");
        Ok(config)
    }
}

/// Why [`TestDatabase::pg_dump`] printed nothing useful: `pg_dump` is missing, or it failed.
#[derive(Debug)]
pub struct PgDumpError(String);

impl fmt::Display for PgDumpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PgDumpError {}

impl TestDatabase {
    /// Runs `pg_dump` (from the `PATH`; PostgreSQL's client package) on this database with
    /// `args` added (e.g. `--schema-only`) and returns what it printed. It runs on a blocking
    /// thread; its wait is bounded by `pg_dump` itself (a dump of a test database takes well
    /// under a second, but it waits for locks another session holds on the tables).
    pub async fn pg_dump(&self, args: &[&str]) -> Result<String, PgDumpError> {
        let mut command = std::process::Command::new("pg_dump");
        command.args(["--no-owner", "--no-privileges"]).args(args);
        match self.config.get_hosts().first() {
            Some(Host::Tcp(host)) => {
                command.args(["-h", host]);
            }
            Some(Host::Unix(path)) => {
                command.arg("-h").arg(path);
            }
            None => {}
        }
        if let Some(port) = self.config.get_ports().first() {
            command.args(["-p", &port.to_string()]);
        }
        if let Some(user) = self.config.get_user() {
            command.args(["-U", user]);
        }
        if let Some(password) = self.config.get_password() {
            command.env("PGPASSWORD", String::from_utf8_lossy(password).into_owned());
        }
        command.arg(&self.name);
        let output = tokio::task::spawn_blocking(move || command.output())
            .await
            .map_err(|e| PgDumpError(format!("the pg_dump task failed: {e}")))?
            .map_err(|e| {
                PgDumpError(format!(
                    "running pg_dump failed ({e}): install PostgreSQL's client programs \
                     (Debian: postgresql-client)"
                ))
            })?;
        if !output.status.success() {
            return Err(PgDumpError(format!(
                "pg_dump exited with {}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        String::from_utf8(output.stdout)
            .map_err(|e| PgDumpError(format!("pg_dump printed something not UTF-8: {e}")))
    }

    /// The database's schema as `pg_dump --schema-only` prints it, normalised by
    /// [`normalise_schema_dump`]: what two databases with the same schema print alike.
    pub async fn schema_dump(&self) -> Result<String, PgDumpError> {
        Ok(normalise_schema_dump(
            &self.pg_dump(&["--schema-only"]).await?,
        ))
    }
}

/// A `pg_dump` text without what differs between two dumps of the same schema: its `--`
/// comments (with the versions of the server and of `pg_dump`), its `SET` and `set_config`
/// lines, its `\restrict` keys, and runs of blank lines.
pub fn normalise_schema_dump(dump: &str) -> String {
    let mut out = String::with_capacity(dump.len());
    let mut blank = true;
    for line in dump.lines() {
        let skip = line.starts_with("--")
            || line.starts_with("SET ")
            || line.starts_with("SELECT pg_catalog.set_config(")
            || line.starts_with('\\');
        if skip {
            continue;
        }
        let is_blank = line.trim().is_empty();
        if is_blank && blank {
            continue;
        }
        blank = is_blank;
        out.push_str(line.trim_end());
        out.push('\n');
    }
    let trimmed = out.trim_end().len();
    out.truncate(trimmed);
    out.push('\n');
    out
}
