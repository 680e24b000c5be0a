//! A throwaway database per benchmark run: created on the server named by `DATABASE_URL` (or
//! the local server), migrated, and dropped at the end.

use std::net::SocketAddr;
use std::str::FromStr;

use anyhow::{Context, Result};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use lockstep_testkit::pg_harness::config_through;
use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

/// The server tried when `DATABASE_URL` is not set.
pub(crate) const LOCAL_SERVER_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The admin URL: `--database-url`, else `DATABASE_URL`, else the local server.
pub(crate) fn admin_url(flag: Option<String>) -> String {
    flag.or_else(|| std::env::var("DATABASE_URL").ok())
        .unwrap_or_else(|| LOCAL_SERVER_URL.to_owned())
}

/// One benchmark database (`lockstep_bench_<random>`).
pub(crate) struct BenchDatabase {
    name: String,
    admin: Config,
    config: Config,
}

impl BenchDatabase {
    /// Creates a fresh database on the server behind `admin_url`.
    pub(crate) async fn create(admin_url: &str) -> Result<BenchDatabase> {
        let admin = Config::from_str(admin_url).context("parsing the database URL")?;
        let name = format!("lockstep_bench_{}", uuid::Uuid::new_v4().simple());
        let client = connect(&admin).await.context("connecting to the server")?;
        client
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .with_context(|| format!("creating database {name}"))?;
        let mut config = admin.clone();
        config.dbname(&name);
        Ok(BenchDatabase {
            name,
            admin,
            config,
        })
    }

    /// The database's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Connection settings for the benchmark database.
    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    /// A pool of `size` connections to the benchmark database.
    pub(crate) fn pool(&self, size: usize) -> Result<Pool> {
        pool(self.config.clone(), size)
    }

    /// A pool of `size` connections to the benchmark database, each through the relay
    /// listening on `relay`.
    pub(crate) fn pool_through(&self, relay: SocketAddr, size: usize) -> Result<Pool> {
        pool(config_through(&self.config, relay), size)
    }

    /// An sqlx pool of `size` connections to the benchmark database, connecting lazily.
    /// `test_before_acquire` is sqlx's option of that name (a ping, one round trip, on every
    /// checkout of an idle connection); the deadpool pools here check nothing on checkout.
    pub(crate) fn sqlx_pool(&self, size: usize, test_before_acquire: bool) -> sqlx::PgPool {
        sqlx_pool(&self.config, size, test_before_acquire)
    }

    /// [`sqlx_pool`](Self::sqlx_pool) through the relay listening on `relay`.
    pub(crate) fn sqlx_pool_through(
        &self,
        relay: SocketAddr,
        size: usize,
        test_before_acquire: bool,
    ) -> sqlx::PgPool {
        sqlx_pool(
            &config_through(&self.config, relay),
            size,
            test_before_acquire,
        )
    }

    /// A direct connection to the server's admin database (not the benchmark database, so its
    /// queries never count in the benchmark database's statistics).
    pub(crate) async fn admin_client(&self) -> Result<Client> {
        connect(&self.admin)
            .await
            .context("connecting to the admin database")
    }

    /// A direct connection to the benchmark database.
    pub(crate) async fn client(&self) -> Result<Client> {
        connect(&self.config)
            .await
            .context("connecting to the benchmark database")
    }

    /// libpq connection arguments for `pgbench`/`psql`: `-h`, `-p`, `-U` and the database
    /// name; a password, if any, goes to `PGPASSWORD`.
    pub(crate) fn libpq_args(&self) -> (Vec<String>, Option<String>) {
        let mut args = Vec::new();
        if let Some(host) = self.config.get_hosts().first() {
            match host {
                Host::Tcp(h) => args.extend(["-h".to_owned(), h.clone()]),
                #[cfg(unix)]
                Host::Unix(path) => args.extend(["-h".to_owned(), path.display().to_string()]),
            }
        }
        if let Some(port) = self.config.get_ports().first() {
            args.extend(["-p".to_owned(), port.to_string()]);
        }
        if let Some(user) = self.config.get_user() {
            args.extend(["-U".to_owned(), user.to_owned()]);
        }
        args.push(self.name.clone());
        let password = self
            .config
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned());
        (args, password)
    }

    /// Drops the database, terminating any connection left on it.
    pub(crate) async fn drop_database(self) -> Result<()> {
        let client = connect(&self.admin).await?;
        client
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.name
            ))
            .await
            .with_context(|| format!("dropping database {}", self.name))?;
        Ok(())
    }
}

async fn connect(config: &Config) -> Result<Client> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

fn pool(config: Config, size: usize) -> Result<Pool> {
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .build()
        .context("building a pool")
}

/// An sqlx pool with the settings of `config` (host or socket directory, port, user, password,
/// database), connecting lazily.
fn sqlx_pool(config: &Config, size: usize, test_before_acquire: bool) -> sqlx::PgPool {
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
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(size).unwrap_or(u32::MAX))
        .test_before_acquire(test_before_acquire)
        .connect_lazy_with(options)
}
