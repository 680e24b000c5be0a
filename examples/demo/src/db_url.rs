//! The demo's PostgreSQL target: the URL parsed once by `lockstep_pg::target` (so an error never
//! repeats it, password included), displayed as its connection target, with the handles the demo
//! and the sample worker build from it.

use std::fmt;
use std::time::Duration;

use anyhow::{Result, anyhow};
use lockstep_pg::PgDatabase;
use lockstep_pg::target::{connection_target, parse_url};
use tokio_postgres::{Config, NoTls};

/// A database URL, parsed; it displays as its connection target, never as the text it was
/// parsed from.
#[derive(Clone)]
pub(crate) struct DbUrl {
    config: Config,
}

impl fmt::Debug for DbUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&connection_target(&self.config))
    }
}

impl fmt::Display for DbUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&connection_target(&self.config))
    }
}

impl DbUrl {
    /// Parses `url`; the error never repeats the text.
    pub(crate) fn parse(url: &str) -> Result<DbUrl> {
        let config = parse_url(url).map_err(|e| anyhow!("{}", e.message()))?;
        Ok(DbUrl { config })
    }

    /// The same server, another database.
    pub(crate) fn with_database(&self, name: &str) -> DbUrl {
        let mut config = self.config.clone();
        config.dbname(name);
        DbUrl { config }
    }

    /// The database name.
    pub(crate) fn database(&self) -> &str {
        self.config.get_dbname().unwrap_or("postgres")
    }

    /// A handle of at most `size` connections, checked by connecting once (so a wrong target
    /// fails here, naming it).
    pub(crate) async fn handle(&self, size: usize) -> Result<PgDatabase> {
        let db = self.handle_lazy(size)?;
        drop(
            db.checkout()
                .await
                .map_err(|e| anyhow!("{}", e.message()))?,
        );
        Ok(db)
    }

    /// A handle that connects only when first used (on the runtime that first uses it).
    pub(crate) fn handle_lazy(&self, size: usize) -> Result<PgDatabase> {
        PgDatabase::builder()
            .config(self.config.clone())
            .max_connections(size)
            .checkout_wait(Duration::from_secs(10))
            .build()
            .map_err(|e| anyhow!("{}", e.message()))
    }

    /// One connection outside any pool (to create and drop the demo's database).
    pub(crate) async fn connect(&self) -> Result<tokio_postgres::Client> {
        let (client, connection) =
            tokio::time::timeout(Duration::from_secs(10), self.config.connect(NoTls))
                .await
                .map_err(|_| anyhow!("connecting to {self} timed out after 10 s"))?
                .map_err(|e| anyhow!("cannot connect to {self}: {}", lockstep_pg::describe(&e)))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }
}
