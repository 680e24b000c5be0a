//! Connecting to PostgreSQL with errors a person can act on: the URL is shown without its
//! password, an unreachable server says what to check, a database that was never migrated says
//! to run `lockstep migrate`.

use std::fmt;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use deadpool_postgres::{Manager, Pool, Runtime, Timeouts};
use tokio_postgres::{Config, NoTls};

/// A database URL, parsed, printable without its password.
#[derive(Clone)]
pub(crate) struct DbUrl {
    config: Config,
    shown: String,
}

impl fmt::Debug for DbUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

impl fmt::Display for DbUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

impl DbUrl {
    /// Parses `url` (`postgres://user:password@host:port/db` or key=value form).
    pub(crate) fn parse(url: &str) -> Result<DbUrl> {
        let config: Config = url.parse().map_err(|e| {
            anyhow!(
                "the database URL is not valid ({e}); expected postgres://user@host:port/database"
            )
        })?;
        Ok(DbUrl {
            shown: redact(url),
            config,
        })
    }

    /// The same server, another database.
    pub(crate) fn with_database(&self, name: &str) -> DbUrl {
        let mut config = self.config.clone();
        config.dbname(name);
        let shown = match self.shown.rsplit_once('/') {
            Some((server, _)) if self.shown.contains("://") => format!("{server}/{name}"),
            _ => format!("{} (database {name})", self.shown),
        };
        DbUrl { config, shown }
    }

    /// The database name.
    pub(crate) fn database(&self) -> &str {
        self.config.get_dbname().unwrap_or("postgres")
    }

    /// A pool of at most `size` connections whose checkout waits at most 10 s.
    pub(crate) async fn pool(&self, size: usize) -> Result<Pool> {
        let pool = self.pool_lazy(size)?;
        // Fail here, with advice, rather than deep inside the first operation.
        drop(pool.get().await.map_err(|e| self.unreachable(&e))?);
        Ok(pool)
    }

    /// A pool like [`DbUrl::pool`] that connects only when first used (on the runtime that
    /// first uses it).
    pub(crate) fn pool_lazy(&self, size: usize) -> Result<Pool> {
        let manager = Manager::new(self.config.clone(), NoTls);
        Pool::builder(manager)
            .max_size(size)
            .runtime(Runtime::Tokio1)
            .timeouts(Timeouts {
                wait: Some(Duration::from_secs(10)),
                create: Some(Duration::from_secs(10)),
                recycle: Some(Duration::from_secs(10)),
            })
            .build()
            .context("building the connection pool")
    }

    /// One connection, outside any pool (for creating and dropping databases).
    pub(crate) async fn connect(&self) -> Result<tokio_postgres::Client> {
        let (client, connection) = tokio::time::timeout(
            Duration::from_secs(10),
            self.config.connect(NoTls),
        )
        .await
        .map_err(|_| anyhow!("connecting to {self} timed out after 10 s: check that PostgreSQL is running and reachable"))?
        .map_err(|e| self.unreachable(&e))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }

    fn unreachable(&self, cause: &dyn fmt::Display) -> anyhow::Error {
        anyhow!(
            "cannot connect to {self}: {cause}\n\
             check that PostgreSQL is running and accepting connections there, that the user and \
             database exist, and the URL (--database-url or DATABASE_URL)"
        )
    }
}

/// `url` with any password replaced by `***`.
pub(crate) fn redact(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://")
        && let Some((userinfo, host)) = rest.split_once('@')
    {
        let user = userinfo.split(':').next().unwrap_or("");
        let hidden = if userinfo.contains(':') { ":***" } else { "" };
        return format!("{scheme}://{user}{hidden}@{host}");
    }
    // key=value form: hide password=...
    url.split_whitespace()
        .map(|part| {
            if part.starts_with("password=") {
                "password=***"
            } else {
                part
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Turns a lockstep error on a database that was never migrated into advice.
pub(crate) fn explain(err: lockstep_core::Error) -> anyhow::Error {
    let text = format!("{err}");
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(&err);
    let mut missing = false;
    while let Some(e) = source {
        if let Some(db) = e.downcast_ref::<tokio_postgres::Error>()
            && let Some(code) = db.code()
            && (code.code() == "42P01" || code.code() == "42883")
        {
            missing = true;
        }
        source = e.source();
    }
    if missing {
        anyhow!(
            "{text}\nthe lockstep schema is missing in this database: run `lockstep migrate` first"
        )
    } else {
        anyhow::Error::new(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_never_shown() {
        assert_eq!(
            redact("postgres://app:s3cret@db.internal:5432/prod"),
            "postgres://app:***@db.internal:5432/prod"
        );
        assert_eq!(redact("postgres://app@db/prod"), "postgres://app@db/prod");
        assert_eq!(
            redact("host=db user=app password=s3cret dbname=prod"),
            "host=db user=app password=*** dbname=prod"
        );
        let url = DbUrl::parse("postgres://app:s3cret@db:5432/prod").expect("valid");
        assert!(!format!("{url} {url:?}").contains("s3cret"));
        assert_eq!(
            url.with_database("demo").to_string(),
            "postgres://app:***@db:5432/demo"
        );
    }
}
