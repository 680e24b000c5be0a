//! Connecting to PostgreSQL with errors a person can act on: the connection target is shown as
//! it was *parsed* (hosts, ports, database, user — never the text the user typed, so never a
//! password), an unreachable server says what to check, a database that was never migrated says
//! to run `lockstep migrate`.

use std::fmt;
use std::time::Duration;

use anyhow::{Result, anyhow};
use lockstep_pg::PgDatabase;
use lockstep_pg::target::connection_target;
use tokio_postgres::Config;

/// A database URL, parsed; it displays as its connection target ([`connection_target`]), never as the text
/// it was parsed from.
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
    /// Parses `url` (`postgres://user:password@host:port/db` or key=value form). The error never
    /// repeats the text (nor the driver's message about it, which can quote part of it).
    pub(crate) fn parse(url: &str) -> Result<DbUrl> {
        let config = lockstep_pg::target::parse_url(url).map_err(|e| anyhow!("{}", e.message()))?;
        Ok(DbUrl { config })
    }

    /// The database name.
    pub(crate) fn database(&self) -> &str {
        self.config.get_dbname().unwrap_or("postgres")
    }

    /// The database handle ([`DbUrl::connected`]) on a database whose schema this build runs
    /// on: a database never migrated, migrated by an older build, or by a newer incompatible
    /// one is refused here, saying what to do, before any command reads or changes it.
    pub(crate) async fn handle(&self, size: usize) -> Result<PgDatabase> {
        let db = self.connected(size).await?;
        db.check_schema().await.map_err(explain)?;
        Ok(db)
    }

    /// The database handle: a pool of at most `size` connections whose checkout waits at most
    /// 10 s, checked by connecting once, so a wrong target fails here, with advice, rather than
    /// deep inside the first operation. The schema is not checked (`migrate` installs it).
    pub(crate) async fn connected(&self, size: usize) -> Result<PgDatabase> {
        let db = self.handle_lazy(size, "lockstep")?;
        drop(db.checkout().await.map_err(|e| {
            // The pool's message already names the target ("connecting to <target>: why"):
            // say it once.
            let message = e.message();
            let prefix = format!("connecting to {self}: ");
            self.unreachable(&message.strip_prefix(&prefix).unwrap_or(message))
        })?);
        Ok(db)
    }

    /// A handle like [`DbUrl::handle`] that connects only when first used (on the runtime
    /// that first uses it); its connections report `application_name` (unless the URL sets
    /// one).
    pub(crate) fn handle_lazy(&self, size: usize, application_name: &str) -> Result<PgDatabase> {
        PgDatabase::builder()
            .config(self.config.clone())
            .application_name(application_name)
            .max_connections(size)
            .checkout_wait(Duration::from_secs(10))
            .build()
            .map_err(|e| anyhow!("{}", e.message()))
    }

    fn unreachable(&self, cause: &dyn fmt::Display) -> anyhow::Error {
        anyhow!(
            "cannot connect to {self}: {cause}\n\
             check that PostgreSQL is running and accepting connections there, that the user and \
             database exist, and the URL (--database-url or DATABASE_URL)"
        )
    }
}

/// Rolls `tx` back where nothing depends on how the rollback went (`what` names the
/// transaction in the log): a rollback that fails still ends the transaction (the connection is
/// closed, and the server rolls back), so its error is logged at `debug`, not returned — except
/// a `BEGIN` the server refused (`CommitUnknown`: the transaction's statements ran outside it),
/// logged at `warn`. Awaited here rather than left to the guard's drop, which rolls back in the
/// background and may close the connection instead of pooling it.
pub(crate) async fn rollback<T: lockstep_core::Transaction>(tx: T, what: &'static str) {
    match tx.rollback().await {
        Ok(()) => {}
        Err(err) if err.kind() == lockstep_core::ErrorKind::CommitUnknown => {
            tracing::warn!(error = %err, transaction = what, "rolling back failed: its statements may have run outside a transaction");
        }
        Err(err) => {
            tracing::debug!(error = %err, transaction = what, "rolling back failed; the transaction ended all the same");
        }
    }
}

/// Turns a lockstep error on a database that was never migrated into advice.
pub(crate) fn explain(err: lockstep_core::Error) -> anyhow::Error {
    let text = format!("{err}");
    // The driver error is the one the message already describes (`Error::underlying`).
    let mut source: Option<&(dyn std::error::Error + 'static)> = err
        .underlying()
        .map(|e| e as &(dyn std::error::Error + 'static));
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
