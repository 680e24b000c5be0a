//! Connecting to PostgreSQL with errors a person can act on: the connection target is shown as
//! it was *parsed* (hosts, ports, database, user — never the text the user typed, so never a
//! password), an unreachable server says what to check, a database that was never migrated says
//! to run `lockstep migrate`.

use std::fmt;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use deadpool_postgres::{Manager, Pool, Runtime, Timeouts};
use tokio_postgres::config::Host;
use tokio_postgres::{Config, NoTls};

/// A database URL, parsed; it displays as its connection target ([`target`]), never as the text
/// it was parsed from.
#[derive(Clone)]
pub(crate) struct DbUrl {
    config: Config,
}

impl fmt::Debug for DbUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&target(&self.config))
    }
}

impl fmt::Display for DbUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&target(&self.config))
    }
}

/// What the user is told when the URL does not parse: how to write one, never the text itself
/// (it may hold a password, whole or in part).
const URL_FORMS: &str = "expected postgres://user:password@host:port/database or key=value pairs \
     (host=… port=… user=… password='…' dbname=…); percent-encode '@', '/', '?' and ':' in a URL's \
     user name or password (e.g. '@' as %40)";

impl DbUrl {
    /// Parses `url` (`postgres://user:password@host:port/db` or key=value form). The error never
    /// repeats the text (nor the driver's message about it, which can quote part of it).
    pub(crate) fn parse(url: &str) -> Result<DbUrl> {
        if let Some(problem) = ambiguous_url(url) {
            return Err(anyhow!(
                "the database URL does not parse as written: {problem}; {URL_FORMS}"
            ));
        }
        let config: Config = url.parse().map_err(|e: tokio_postgres::Error| {
            // Only the driver's messages that name an option (never a value) are repeated.
            let detail = std::error::Error::source(&e)
                .map(ToString::to_string)
                .filter(|s| s.starts_with("invalid value for option `"))
                .map(|s| format!(" ({s})"))
                .unwrap_or_default();
            anyhow!("the database URL does not parse{detail}; {URL_FORMS}")
        })?;
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

/// The connection target of `config`, for people: `database "db" on host:port as user "u"`.
/// Built only from the parsed hosts (or host addresses), ports, database name and user, so a
/// password — whole or in part — is never part of it, whatever form the URL had.
pub(crate) fn target(config: &Config) -> String {
    let ports = config.get_ports();
    // One port applies to every host; otherwise there is one per host.
    let port = |i: usize| ports.get(i).or(ports.first()).copied().unwrap_or(5432);
    let hosts: Vec<String> = if config.get_hosts().is_empty() {
        config
            .get_hostaddrs()
            .iter()
            .enumerate()
            .map(|(i, addr)| std::net::SocketAddr::new(*addr, port(i)).to_string())
            .collect()
    } else {
        config
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, host)| match host {
                Host::Tcp(name) if name.contains(':') => format!("[{name}]:{}", port(i)),
                Host::Tcp(name) => format!("{name}:{}", port(i)),
                #[cfg(unix)]
                Host::Unix(dir) => format!("the socket in {} (port {})", dir.display(), port(i)),
            })
            .collect()
    };
    let mut shown = match config.get_dbname() {
        Some(db) => format!("database {db:?}"),
        None => "the user's default database".to_owned(),
    };
    if hosts.is_empty() {
        shown.push_str(" (no host given)");
    } else {
        shown.push_str(" on ");
        shown.push_str(&hosts.join(","));
    }
    if let Some(user) = config.get_user() {
        shown.push_str(&format!(" as user {user:?}"));
    }
    shown
}

/// Why a `postgres://` URL cannot be read the way it was meant, if so. The driver takes the user
/// name and password up to the first `@` anywhere in the text (libpq only before the first
/// `/`), so an unencoded `@` anywhere but before the host makes it read part of a password as a
/// host, a database name or a user — and print it. Refused instead; `%40` says `@`.
fn ambiguous_url(url: &str) -> Option<&'static str> {
    let rest = ["postgres://", "postgresql://"]
        .iter()
        .find_map(|scheme| url.strip_prefix(scheme))?;
    let (authority, after) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    if authority.matches('@').count() > 1 {
        Some("it has more than one '@' before the host")
    } else if after.contains('@') {
        Some(
            "it has an '@' after the host (in the database name or a parameter, or in a password holding '/' or '?')",
        )
    } else {
        None
    }
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

    /// A password no target may contain, whole or in part.
    const SECRET: [&str; 2] = ["Zq7Kx", "Wv9Pm"];

    fn shows_no_secret(text: &str) {
        for part in SECRET {
            assert!(!text.contains(part), "a password shows in {text:?}");
        }
    }

    /// Issue 19, defect 3: every form a password can take in a URL, and the target shown.
    #[test]
    fn the_connection_target_is_built_from_the_parsed_url_and_never_shows_a_password() {
        for (url, shown) in [
            (
                "postgres://app:Zq7KxWv9Pm@db.internal:5432/prod",
                r#"database "prod" on db.internal:5432 as user "app""#,
            ),
            (
                "postgres://app@db/prod?password=Zq7KxWv9Pm",
                r#"database "prod" on db:5432 as user "app""#,
            ),
            (
                "postgresql://db:6543/prod?user=app&password=Zq7KxWv9Pm",
                r#"database "prod" on db:6543 as user "app""#,
            ),
            (
                "postgres://app:Zq7Kx%40Wv9Pm@db/prod",
                r#"database "prod" on db:5432 as user "app""#,
            ),
            (
                "host=db user=app password=Zq7KxWv9Pm dbname=prod",
                r#"database "prod" on db:5432 as user "app""#,
            ),
            (
                "host=db user=app password = Zq7KxWv9Pm dbname=prod",
                r#"database "prod" on db:5432 as user "app""#,
            ),
            (
                "host=db port=1 user=app password='Zq7Kx Wv9Pm' dbname=prod",
                r#"database "prod" on db:1 as user "app""#,
            ),
            (
                "host=a,b port=1,2 password=Zq7KxWv9Pm",
                "the user's default database on a:1,b:2",
            ),
            (
                "postgres://[::1]:5433/prod?password=Zq7KxWv9Pm",
                r#"database "prod" on [::1]:5433"#,
            ),
        ] {
            let parsed = DbUrl::parse(url).expect("valid");
            assert_eq!(parsed.to_string(), shown, "{url}");
            shows_no_secret(&format!("{parsed} {parsed:?}"));
            let other = parsed.with_database("demo");
            assert!(
                other.to_string().starts_with(r#"database "demo""#),
                "{other}"
            );
            shows_no_secret(&format!("{other} {other:?}"));
        }
    }

    /// Issue 19, defect 3: a URL the driver would read wrongly (part of the password as the
    /// host, database or user) or cannot read is refused without repeating any of it.
    #[test]
    fn a_url_that_does_not_parse_is_refused_without_echoing_it() {
        for url in [
            "postgres://app:Zq7Kx@Wv9Pm@127.0.0.1:1/prod",
            "postgres://127.0.0.1:1/prod?password=Zq7Kx@Wv9Pm",
            "postgres://app:Zq7Kx@Wv9Pm/x@127.0.0.1/prod",
            "postgres://app:Zq7Kx/Wv9Pm@127.0.0.1/prod",
            "host=db password=Zq7Kx Wv9Pm=x",
            "host=db password=Zq7Kx Wv9Pm",
            "host=db password='Zq7Kx Wv9Pm",
            "postgres://db:Zq7KxWv9Pm/prod",
            "postgres://db/prod?Zq7KxWv9Pm=1",
        ] {
            let err = DbUrl::parse(url).expect_err(url);
            let text = format!("{err:#} {err:?}");
            assert!(text.contains("does not parse"), "{text}");
            shows_no_secret(&text);
        }
    }
}
