//! What the page answers to: the `Host` header it accepts, the `Origin` it lets act, and the
//! headers every answer carries.
//!
//! - **Host**: an IP address (v4, or v6 in brackets) or `localhost`, on any port, or the host of
//!   a `--public-url`. A DNS-rebinding page reaches the server under the attacker's own DNS
//!   name, which is none of these, so it is refused (421) and reads nothing. A request without
//!   a `Host` header (HTTP/1.0) is not a browser's and is let through.
//! - **Origin** (for the actions): `http://` and the request's `Host` when that is an address
//!   or `localhost`, or the origin of a `--public-url` (its scheme too: `https://` behind a TLS
//!   proxy). The `Host` it is compared with has passed the check above, so a page cannot pick
//!   both.
//! - **Every answer** says `Content-Security-Policy: frame-ancestors 'none'`,
//!   `X-Frame-Options: DENY` (no other site frames the page to click its buttons),
//!   `X-Content-Type-Options: nosniff` and `Referrer-Policy: no-referrer`.

use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::Shared;

/// The hosts and origins the page answers to besides addresses and `localhost`.
#[derive(Debug, Default)]
pub(crate) struct Guard {
    /// Per `--public-url`: its host (lower case, IPv6 in brackets) and its origin
    /// (`scheme://host[:port]`, lower case, no default port).
    public: Vec<(String, String)>,
}

impl Guard {
    /// The guard for these `--public-url` values; one that is not an `http` or `https` URL
    /// with a host (and nothing but `/` after it) is refused, saying why.
    pub(crate) fn new(public_urls: &[String]) -> Result<Guard, String> {
        let public = public_urls
            .iter()
            .map(|url| public_url(url).map_err(|why| format!("--public-url {url:?}: {why}")))
            .collect::<Result<_, _>>()?;
        Ok(Guard { public })
    }

    /// Whether a request whose `Host` header is `host` (`None`: it has none) is answered.
    pub(crate) fn host_allowed(&self, host: Option<&str>) -> bool {
        let Some(host) = host else {
            return true;
        };
        let name = host_part(host).to_ascii_lowercase();
        literal(&name) || self.public.iter().any(|(h, _)| *h == name)
    }

    /// Whether a request from `origin` to `host` (its `Host` header) is this page's own.
    pub(crate) fn origin_allowed(&self, origin: &str, host: Option<&str>) -> bool {
        let origin = origin.to_ascii_lowercase();
        if self.public.iter().any(|(_, o)| *o == origin) {
            return true;
        }
        host.is_some_and(|host| {
            let host = host.to_ascii_lowercase();
            literal(host_part(&host)) && origin == format!("http://{host}")
        })
    }
}

/// The host of a `Host` header value, without its port (IPv6 keeps its brackets); the whole
/// value when what follows the host is not a port.
fn host_part(host: &str) -> &str {
    let port = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    if host.starts_with('[') {
        return match host.find(']') {
            Some(end) if host[end + 1..].is_empty() => host,
            Some(end) if host[end + 1..].strip_prefix(':').is_some_and(port) => &host[..=end],
            _ => host,
        };
    }
    match host.rsplit_once(':') {
        Some((name, p)) if port(p) => name,
        _ => host,
    }
}

/// An IP address or `localhost`: names no other site can make a browser send.
fn literal(name: &str) -> bool {
    if name == "localhost" {
        return true;
    }
    match name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
        Some(v6) => v6.parse::<Ipv6Addr>().is_ok(),
        None => name.parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv4()),
    }
}

/// A `--public-url`'s host and origin.
fn public_url(url: &str) -> Result<(String, String), &'static str> {
    let uri: Uri = url
        .parse()
        .map_err(|_| "not a URL (e.g. https://status.example.com)")?;
    let scheme = match uri.scheme_str() {
        Some(s) if s.eq_ignore_ascii_case("http") => "http",
        Some(s) if s.eq_ignore_ascii_case("https") => "https",
        _ => return Err("expected an http:// or https:// URL"),
    };
    let authority = uri.authority().ok_or("it names no host")?;
    if authority.as_str().contains('@') {
        return Err("a user name has no place in it");
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err("the page is served at / (no path or query)");
    }
    let host = authority.host().to_ascii_lowercase();
    if host.is_empty() {
        return Err("it names no host");
    }
    let origin = match authority.port_u16() {
        Some(port) if !(scheme == "http" && port == 80 || scheme == "https" && port == 443) => {
            format!("{scheme}://{host}:{port}")
        }
        _ => format!("{scheme}://{host}"),
    };
    Ok((host, origin))
}

/// Refuses (421) a request whose `Host` the page does not answer to.
pub(crate) async fn check_host(
    State(shared): State<Arc<Shared>>,
    request: Request,
    next: Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .map(|h| h.to_str().unwrap_or("\u{fffd}"));
    if shared.guard.host_allowed(host) {
        return next.run(request).await;
    }
    (
        StatusCode::MISDIRECTED_REQUEST,
        "this server does not answer to that host name: reach it by its address or \
         localhost, or start it with --public-url naming the URL people use\n",
    )
        .into_response()
}

/// Adds the headers every answer carries.
pub(crate) async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("frame-ancestors 'none'"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_localhost_and_public_urls_are_answered_other_names_are_not() {
        let guard = Guard::new(&["https://Status.Example.com".to_owned()]).expect("valid");
        for host in [
            "127.0.0.1:7878",
            "127.0.0.1",
            "10.1.2.3:80",
            "[::1]:7878",
            "[::1]",
            "localhost:7878",
            "LOCALHOST",
            "status.example.com",
            "status.example.com:443",
        ] {
            assert!(guard.host_allowed(Some(host)), "{host}");
        }
        assert!(guard.host_allowed(None));
        for host in [
            "evil.example:7878",
            "evil.example",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "[::1].evil.example",
            "status.example.com.evil.example",
            "",
            "\u{fffd}",
        ] {
            assert!(!guard.host_allowed(Some(host)), "{host}");
        }
    }

    #[test]
    fn an_origin_must_be_this_pages_with_its_scheme() {
        let guard = Guard::new(&["https://status.example.com".to_owned()]).expect("valid");
        let host = Some("127.0.0.1:7878");
        assert!(guard.origin_allowed("http://127.0.0.1:7878", host));
        assert!(!guard.origin_allowed("https://127.0.0.1:7878", host));
        assert!(!guard.origin_allowed("http://127.0.0.1:7879", host));
        assert!(!guard.origin_allowed("null", host));
        assert!(!guard.origin_allowed("http://evil.example", Some("evil.example")));
        assert!(guard.origin_allowed("https://status.example.com", Some("status.example.com")));
        assert!(!guard.origin_allowed("http://status.example.com", Some("status.example.com")));
    }

    #[test]
    fn a_public_url_must_be_http_or_https_with_a_host_and_no_path() {
        assert_eq!(
            public_url("http://ops:7878/"),
            Ok(("ops".to_owned(), "http://ops:7878".to_owned()))
        );
        assert_eq!(
            public_url("https://x:443"),
            Ok(("x".to_owned(), "https://x".to_owned()))
        );
        for bad in [
            "status.example.com",
            "ftp://x",
            "https://x/status",
            "https://u@x",
            "https://x?a=1",
            "",
        ] {
            assert!(Guard::new(&[bad.to_owned()]).is_err(), "{bad:?}");
        }
    }
}
