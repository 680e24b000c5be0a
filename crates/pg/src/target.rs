//! Connection targets: reading a database URL without ever repeating it ([`parse_url`]), and
//! saying where a config connects for people ([`connection_target`]) — hosts, ports, database
//! and user, built from the parsed config, so a password, whole or in part, is never shown
//! whatever form the URL had. [`crate::PgDatabase`] names its target in connection errors with
//! these; so does the `lockstep` command.

use lockstep_core::{Error, ErrorKind, Result};
use tokio_postgres::Config;
use tokio_postgres::config::Host;

/// What a refused URL's error says: how to write one, never the text itself (it may hold a
/// password, whole or in part).
pub const URL_FORMS: &str = "expected postgres://user:password@host:port/database or key=value pairs \
     (host=… port=… user=… password='…' dbname=…); percent-encode '@', '/', '?' and ':' in a URL's \
     user name or password (e.g. '@' as %40)";

/// Parses `url` (`postgres://user:password@host:port/db` or the key=value form). A URL that does
/// not parse — or that the driver would read differently from libpq, taking part of a password
/// for the host, the database or the user — is [`ErrorKind::InvalidInput`], and the error never
/// repeats the text (nor the driver's message about it, which can quote part of it).
pub fn parse_url(url: &str) -> Result<Config> {
    if let Some(problem) = ambiguous_url(url) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("the database URL does not parse as written: {problem}; {URL_FORMS}"),
        ));
    }
    url.parse().map_err(|e: tokio_postgres::Error| {
        // Only the driver's messages that name an option (never a value) are repeated.
        let detail = std::error::Error::source(&e)
            .map(ToString::to_string)
            .filter(|s| s.starts_with("invalid value for option `"))
            .map(|s| format!(" ({s})"))
            .unwrap_or_default();
        Error::new(
            ErrorKind::InvalidInput,
            format!("the database URL does not parse{detail}; {URL_FORMS}"),
        )
    })
}

/// The connection target of `config`, for people: `database "db" on host:port as user "u"`.
/// Built only from the parsed hosts (or host addresses), ports, database name and user, so a
/// password — whole or in part — is never part of it, whatever form the URL had.
pub fn connection_target(config: &Config) -> String {
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
            let parsed = parse_url(url).expect("valid");
            assert_eq!(connection_target(&parsed), shown, "{url}");
            let mut other = parsed.clone();
            other.dbname("demo");
            let other = connection_target(&other);
            assert!(other.starts_with(r#"database "demo""#), "{other}");
            shows_no_secret(&other);
        }
    }

    /// A primary with standbys: every host is kept, with its port, and so is
    /// `target_session_attrs`, so new connections skip a server that cannot write.
    #[test]
    fn a_multi_host_url_keeps_every_host_and_asks_for_the_primary() {
        let parsed = parse_url(
            "postgres://app:Zq7KxWv9Pm@db-a:5432,db-b:5433/prod?target_session_attrs=read-write\
             &connect_timeout=2",
        )
        .expect("valid");
        assert_eq!(
            connection_target(&parsed),
            r#"database "prod" on db-a:5432,db-b:5433 as user "app""#
        );
        assert_eq!(
            parsed.get_target_session_attrs(),
            tokio_postgres::config::TargetSessionAttrs::ReadWrite
        );
        assert_eq!(
            parsed.get_connect_timeout(),
            Some(&std::time::Duration::from_secs(2))
        );
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
            let err = parse_url(url).expect_err(url);
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
            let text = format!("{err:#} {err:?}");
            assert!(text.contains("does not parse"), "{text}");
            shows_no_secret(&text);
        }
    }
}
