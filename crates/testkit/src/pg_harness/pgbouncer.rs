//! A PgBouncer in transaction mode in front of the test server, started by the test itself:
//! [`PgBouncer::start`] writes an ini into a temporary directory, spawns `pgbouncer` on a free
//! port of 127.0.0.1 forwarding every database (`* = host=… port=…`) to the harness's server,
//! waits until it accepts a connection, and kills it when dropped.
//!
//! The pooler is set up so that a statement relying on session state fails instead of passing
//! by luck: `pool_mode = transaction`, and `server_round_robin = 1`, so a client's consecutive
//! transactions run on different server connections (by default PgBouncer hands a client the
//! server connection it used last, which hides a named prepared statement or a session setting
//! that another server connection lacks). [`PgBouncer::for_database`] opens
//! [`WARM_SERVER_CONNECTIONS`] server connections to the test's database before it returns, so
//! there are several to rotate through from the first statement on.
//!
//! `pgbouncer` refuses to run as root: a test process running as root starts it as the
//! `postgres` user (the server package's user). The program is looked up as `pgbouncer` on the
//! `PATH`, then `/usr/sbin/pgbouncer` (Debian's package); `scripts/test` installs it.
//!
//! ```no_run
//! # async fn demo() {
//! use lockstep_testkit::pg_harness::{pgbouncer::PgBouncer, test_database};
//!
//! let db = test_database().await;
//! let bouncer = PgBouncer::for_database(&db).await;
//! let pool = bouncer.pool(&db, 4); // every connection goes through the pooler
//! let client = pool.get().await.expect("connection");
//! client.batch_execute("SELECT 1").await.expect("query");
//! # }
//! ```

use std::fmt;
use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio_postgres::{Config, NoTls};

use super::TestDatabase;

/// How long [`PgBouncer::start`] waits for the pooler to accept a connection: 20 s (it starts
/// in milliseconds; the bound is for a machine busy building).
pub const START_WAIT: Duration = Duration::from_secs(20);

/// Server connections per database and user: enough for the suites' pools (each test has a
/// database of its own, so a pool of its own at the pooler).
pub const DEFAULT_POOL_SIZE: usize = 20;

/// Server connections [`PgBouncer::for_database`] opens to the test's database up front.
pub const WARM_SERVER_CONNECTIONS: usize = 3;

const HOW_TO_GET: &str = "install PgBouncer (Debian: apt-get install pgbouncer; scripts/test \
installs it when run as root)";

/// Why a [`PgBouncer`] did not start.
#[derive(Debug)]
pub struct PgBouncerError(String);

impl fmt::Display for PgBouncerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PgBouncerError {}

/// A running `pgbouncer` in transaction mode; killed (and its directory removed) on drop.
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    dir: PathBuf,
    address: SocketAddr,
    server: (String, u16),
}

impl PgBouncer {
    /// A pooler in front of `db`'s server, with [`WARM_SERVER_CONNECTIONS`] server
    /// connections to `db` open ([`PgBouncer::warm`]). Panics, saying how to get PgBouncer, when
    /// it cannot start (test code).
    pub async fn for_database(db: &TestDatabase) -> PgBouncer {
        let server = db
            .server_address()
            .unwrap_or_else(|e| panic!("PgBouncer needs the test server on TCP: {e}"));
        let bouncer = PgBouncer::start(server)
            .await
            .unwrap_or_else(|e| panic!("starting PgBouncer failed: {e}"));
        bouncer.warm(db, WARM_SERVER_CONNECTIONS).await;
        bouncer
    }

    /// Makes the pooler open at least `n` server connections to `db`: `n` clients each hold a
    /// transaction open at once (the pooler gives each a server connection of its own), then
    /// roll back. The connections stay in the pooler's pool for the clients that follow.
    pub async fn warm(&self, db: &TestDatabase, n: usize) {
        let mut clients = Vec::with_capacity(n);
        for _ in 0..n {
            let client = self.connect(db).await;
            client
                .batch_execute("BEGIN; SELECT 1")
                .await
                .unwrap_or_else(|e| panic!("a transaction through PgBouncer: {e}"));
            clients.push(client);
        }
        for client in clients {
            client
                .batch_execute("ROLLBACK")
                .await
                .unwrap_or_else(|e| panic!("a rollback through PgBouncer: {e}"));
        }
    }

    /// Starts `pgbouncer` in transaction mode forwarding every database to `server` (host,
    /// port), on a free port of 127.0.0.1, and waits (at most [`START_WAIT`]) until it
    /// accepts a connection to the `postgres` database.
    pub async fn start(server: (String, u16)) -> Result<PgBouncer, PgBouncerError> {
        let program = program()?;
        let run_as = if is_root() {
            Some(postgres_user()?)
        } else {
            None
        };
        // A port found free may be taken before pgbouncer binds it: try a few.
        let mut last = String::new();
        for _ in 0..3 {
            let dir = temp_dir()?;
            let port = free_port()?;
            write_files(&dir, port, &server)?;
            let mut command = Command::new(&program);
            command
                .arg(dir.join("pgbouncer.ini"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            if let Some((uid, gid)) = run_as {
                use std::os::unix::process::CommandExt as _;
                command.uid(uid).gid(gid);
            }
            let child = command.spawn().map_err(|e| {
                PgBouncerError(format!("running {} failed ({e}); {HOW_TO_GET}", program))
            })?;
            let mut bouncer = PgBouncer {
                child,
                dir,
                address: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
                server: server.clone(),
            };
            match bouncer.until_accepting().await {
                Ok(()) => return Ok(bouncer),
                Err(e) => last = e,
            }
        }
        Err(PgBouncerError(format!(
            "pgbouncer did not accept connections: {last}"
        )))
    }

    /// Where the pooler listens.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The server it forwards to (host, port).
    pub fn server(&self) -> (&str, u16) {
        (&self.server.0, self.server.1)
    }

    /// Connection settings for `db` through the pooler.
    pub fn config(&self, db: &TestDatabase) -> Config {
        db.config_through(self.address)
    }

    /// A pool of at most `max_size` connections to `db`, each through the pooler.
    pub fn pool(&self, db: &TestDatabase, max_size: usize) -> deadpool_postgres::Pool {
        db.pool_through(self.address, max_size)
    }

    /// One connection to `db` through the pooler (its connection task runs on the current
    /// runtime).
    pub async fn connect(&self, db: &TestDatabase) -> tokio_postgres::Client {
        connect(&self.config(db))
            .await
            .unwrap_or_else(|e| panic!("connecting to {} through PgBouncer: {e}", db.name()))
    }

    /// Runs `command` (e.g. `SHOW POOLS`) on PgBouncer's admin console and returns its rows,
    /// each as `column=value` pairs; panics on failure (test code).
    pub async fn admin(&self, command: &str) -> Vec<Vec<(String, Option<String>)>> {
        let mut config = Config::new();
        config
            .host(self.address.ip().to_string())
            .port(self.address.port())
            .user("postgres")
            .dbname("pgbouncer");
        let client = connect(&config)
            .await
            .unwrap_or_else(|e| panic!("connecting to PgBouncer's admin console: {e}"));
        let messages = client
            .simple_query(command)
            .await
            .unwrap_or_else(|e| panic!("{command} on PgBouncer's admin console: {e}"));
        messages
            .iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => Some(
                    row.columns()
                        .iter()
                        .enumerate()
                        .map(|(i, c)| (c.name().to_owned(), row.get(i).map(str::to_owned)))
                        .collect(),
                ),
                _ => None,
            })
            .collect()
    }

    /// How many transactions the pooler has run for `database` so far (`SHOW STATS`,
    /// `total_xact_count`): a test proves its traffic went through the pooler with it.
    pub async fn transactions_of(&self, database: &str) -> u64 {
        self.admin("SHOW STATS")
            .await
            .iter()
            .filter(|row| {
                row.iter()
                    .any(|(c, v)| c == "database" && v.as_deref() == Some(database))
            })
            .filter_map(|row| {
                row.iter()
                    .find(|(c, _)| c == "total_xact_count")
                    .and_then(|(_, v)| v.as_deref()?.parse::<u64>().ok())
            })
            .sum()
    }

    /// What pgbouncer logged so far (for a failing test's message).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    async fn until_accepting(&mut self) -> Result<(), String> {
        let mut config = Config::new();
        config
            .host(self.address.ip().to_string())
            .port(self.address.port())
            .user("postgres")
            .dbname("postgres")
            .connect_timeout(Duration::from_secs(2));
        let deadline = tokio::time::Instant::now() + START_WAIT;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "pgbouncer exited with {status}; log:\n{}",
                    self.log()
                ));
            }
            let attempt = async {
                let client = connect(&config).await.map_err(|e| e.to_string())?;
                client
                    .simple_query("SELECT 1")
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            };
            let error = match tokio::time::timeout(Duration::from_secs(5), attempt).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => e,
                Err(_) => "a connection attempt timed out after 5 s".to_owned(),
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "not accepting after {START_WAIT:?} ({error}); log:\n{}",
                    self.log()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The ini and the auth file. `auth_type = trust` still wants the user in the auth file.
fn write_files(dir: &Path, port: u16, server: &(String, u16)) -> Result<(), PgBouncerError> {
    let (host, server_port) = server;
    let ini = format!(
        "[databases]\n\
         * = host={host} port={server_port}\n\
         \n\
         [pgbouncer]\n\
         listen_addr = 127.0.0.1\n\
         listen_port = {port}\n\
         unix_socket_dir =\n\
         auth_type = trust\n\
         auth_file = {auth}\n\
         admin_users = postgres\n\
         stats_users = postgres\n\
         pool_mode = transaction\n\
         max_client_conn = 1000\n\
         default_pool_size = {DEFAULT_POOL_SIZE}\n\
         reserve_pool_size = 5\n\
         server_round_robin = 1\n\
         server_reset_query = DISCARD ALL\n\
         ignore_startup_parameters = extra_float_digits,options\n\
         logfile = {log}\n\
         log_connections = 0\n\
         log_disconnections = 0\n",
        auth = dir.join("userlist.txt").display(),
        log = dir.join("pgbouncer.log").display(),
    );
    let write = |name: &str, text: &str| -> Result<(), PgBouncerError> {
        let path = dir.join(name);
        let mut file = std::fs::File::create(&path)
            .map_err(|e| PgBouncerError(format!("writing {}: {e}", path.display())))?;
        file.write_all(text.as_bytes())
            .map_err(|e| PgBouncerError(format!("writing {}: {e}", path.display())))
    };
    write("pgbouncer.ini", &ini)?;
    write("userlist.txt", "\"postgres\" \"\"\n")
}

/// A fresh directory the pooler (possibly another user) can read and write its log in.
fn temp_dir() -> Result<PathBuf, PgBouncerError> {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = std::env::temp_dir().join(format!(
        "lockstep-pgbouncer-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)))
        .map_err(|e| PgBouncerError(format!("creating {}: {e}", dir.display())))?;
    Ok(dir)
}

fn free_port() -> Result<u16, PgBouncerError> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(|e| PgBouncerError(format!("finding a free port: {e}")))
}

fn program() -> Result<String, PgBouncerError> {
    let on_path = std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| dir.join("pgbouncer").is_file())
    });
    if on_path {
        return Ok("pgbouncer".to_owned());
    }
    let debian = Path::new("/usr/sbin/pgbouncer");
    if debian.is_file() {
        return Ok(debian.display().to_string());
    }
    Err(PgBouncerError(format!(
        "pgbouncer was not found; {HOW_TO_GET}"
    )))
}

fn is_root() -> bool {
    // The owner of this process's own /proc entry is its effective user.
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// The `postgres` user's uid and gid, from `/etc/passwd`.
fn postgres_user() -> Result<(u32, u32), PgBouncerError> {
    let passwd = std::fs::read_to_string("/etc/passwd")
        .map_err(|e| PgBouncerError(format!("reading /etc/passwd: {e}")))?;
    passwd
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            match fields.as_slice() {
                ["postgres", _, uid, gid, ..] => Some((uid.parse().ok()?, gid.parse().ok()?)),
                _ => None,
            }
        })
        .ok_or_else(|| {
            PgBouncerError(
                "pgbouncer refuses to run as root and there is no `postgres` user to run it as \
                 (run the tests as another user, or install PostgreSQL's server package)"
                    .to_owned(),
            )
        })
}

async fn connect(config: &Config) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        // Ends with the client; an error here surfaces on the client's next call.
        let _ = connection.await;
    });
    Ok(client)
}
