//! `lockstep serve`: a status page (server-rendered HTML that refreshes itself) with the stream
//! leases, the advisory locks and the perspectives' status, and `/metrics` in the Prometheus
//! text format (gauges computed from the database at each scrape).
//!
//! A deliberately small HTTP/1.1 responder over tokio: `GET` only, one request per connection,
//! a bounded request head and a read timeout. It serves operators on a trusted network; put it
//! behind your usual proxy for anything else. Its accept loop, [`accept_loop`], outlives failed
//! accepts.

use std::fmt::Write as _;
use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::ops::{advisory_rows, lease_rows, status_rows};
use crate::pg::DbUrl;
use crate::{bad_argument, say};

/// The longest request head accepted.
const MAX_HEAD: usize = 8 * 1024;

struct Shared {
    pool: deadpool_postgres::Pool,
    metrics: PrometheusHandle,
    names: Vec<String>,
    database: String,
}

pub(crate) async fn serve(
    url: &DbUrl,
    addr: &str,
    names: Vec<String>,
    json: bool,
) -> Result<ExitCode> {
    let listener = listen("--addr", addr).await?;
    let metrics = PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    let db = url.handle(4).await?;
    let pool = db.pool().clone();
    let shared = Arc::new(Shared {
        pool,
        metrics,
        names,
        database: url.database().to_owned(),
    });
    let bound = listener.local_addr()?;
    if json {
        say!(
            "{}",
            serde_json::json!({
                "page": format!("http://{bound}/"),
                "metrics": format!("http://{bound}/metrics"),
                "database": url.database(),
            })
        );
    } else {
        say!("serving the status page on http://{bound}/ (metrics on /metrics; Ctrl-C stops it)");
    }
    let stop = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    accept_loop(&listener, stop, |stream| {
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let _ = respond(stream, &shared).await;
        });
    })
    .await;
    Ok(ExitCode::SUCCESS)
}

/// A listener on `addr`, the value of the option `flag`. An address that does not parse or
/// resolve, or is not one of this machine's, is a bad argument (exit 2); a port in use or
/// refused is another error.
pub(crate) async fn listen(flag: &str, addr: &str) -> Result<TcpListener> {
    let refused = |why: String| {
        bad_argument(format!(
            "{flag} {addr:?}: {why}; expected host:port to listen on, e.g. 127.0.0.1:7878 \
             (port 0 picks a free one)"
        ))
    };
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| refused(format!("not an address ({e})")))?
        .collect();
    if addrs.is_empty() {
        return Err(refused("it resolves to no address".to_owned()));
    }
    match TcpListener::bind(&addrs[..]).await {
        Ok(listener) => Ok(listener),
        Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
            Err(refused(format!("not an address of this machine ({e})")))
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("listening on {addr} ({flag})"))),
    }
}

/// The pause after a failed accept; it doubles while accepts go on failing, up to
/// [`ACCEPT_PAUSE_MAX`], and starts again from here after a success.
const ACCEPT_PAUSE_MIN: Duration = Duration::from_millis(50);
/// The longest pause after failed accepts: how late a server notices that it can accept again.
const ACCEPT_PAUSE_MAX: Duration = Duration::from_secs(1);

/// Where a server's connections come from: a `tokio::net::TcpListener`, or a fake in tests.
pub(crate) trait Acceptor {
    /// An accepted connection.
    type Connection;
    /// The next connection.
    fn accept(&self) -> impl Future<Output = std::io::Result<Self::Connection>> + Send;
}

impl Acceptor for TcpListener {
    type Connection = TcpStream;

    async fn accept(&self) -> std::io::Result<TcpStream> {
        TcpListener::accept(self).await.map(|(stream, _)| stream)
    }
}

/// The accept loop of the server: accepts connections
/// until `stop` completes and hands each to `handle`. A failed accept — most often EMFILE, out
/// of file descriptors, which fails again at once as long as it lasts — is logged and followed
/// by a pause ([`ACCEPT_PAUSE_MIN`], doubling up to [`ACCEPT_PAUSE_MAX`] while failures go on):
/// the server neither spins on it nor stops serving, and recovers once descriptors are free.
pub(crate) async fn accept_loop<A: Acceptor>(
    acceptor: &A,
    stop: impl Future<Output = ()>,
    mut handle: impl FnMut(A::Connection),
) {
    tokio::pin!(stop);
    let mut pause = ACCEPT_PAUSE_MIN;
    let mut failures: u64 = 0;
    loop {
        let accepted = tokio::select! {
            () = &mut stop => return,
            accepted = acceptor.accept() => accepted,
        };
        match accepted {
            Ok(connection) => {
                if failures > 0 {
                    eprintln!("accepting connections again after {failures} failed accept(s)");
                    failures = 0;
                    pause = ACCEPT_PAUSE_MIN;
                }
                handle(connection);
            }
            Err(err) => {
                failures += 1;
                eprintln!(
                    "accepting a connection failed: {err}; trying again in {} ms",
                    pause.as_millis()
                );
                tokio::select! {
                    () = &mut stop => return,
                    () = tokio::time::sleep(pause) => {}
                }
                pause = pause.saturating_mul(2).min(ACCEPT_PAUSE_MAX);
            }
        }
    }
}

/// Reads a request head (bounded in size and time) and returns the path of a `GET`.
async fn read_path(stream: &mut TcpStream) -> Result<String> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let read = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .context("reading the request timed out")??;
    let line = String::from_utf8_lossy(&head);
    let mut parts = line.split_whitespace();
    match (parts.next(), parts.next()) {
        (Some("GET"), Some(path)) => Ok(path.split('?').next().unwrap_or("").to_owned()),
        _ => Ok(String::new()),
    }
}

async fn write_response(
    stream: &mut TcpStream,
    status: &str,
    kind: &str,
    body: &str,
) -> Result<()> {
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await?;
    Ok(())
}

async fn respond(mut stream: TcpStream, shared: &Shared) -> Result<()> {
    let path = read_path(&mut stream).await?;
    let (status, kind, body) = match path.as_str() {
        "/" => match page(shared).await {
            Ok(html) => ("200 OK", "text/html; charset=utf-8", html),
            Err(err) => (
                "503 Service Unavailable",
                "text/plain; charset=utf-8",
                format!("{err:#}\n"),
            ),
        },
        "/metrics" => match gauges(shared).await {
            Ok(()) => (
                "200 OK",
                "text/plain; version=0.0.4",
                shared.metrics.render(),
            ),
            Err(err) => (
                "503 Service Unavailable",
                "text/plain; charset=utf-8",
                format!("{err:#}\n"),
            ),
        },
        "/healthz" => ("200 OK", "text/plain", "ok\n".to_owned()),
        _ => (
            "404 Not Found",
            "text/plain",
            "not found (GET /, /metrics, /healthz)\n".to_owned(),
        ),
    };
    write_response(&mut stream, status, kind, &body).await
}

/// Sets the gauges a scrape reads from the database.
async fn gauges(shared: &Shared) -> Result<()> {
    let leases = lease_rows(&shared.pool).await?;
    let count = |status: &str| leases.iter().filter(|l| l["status"] == status).count() as f64;
    metrics::gauge!("lockstep_stream_leases_held").set(count("held"));
    metrics::gauge!("lockstep_stream_leases_expired").set(count("expired"));
    metrics::gauge!("lockstep_stream_leases_unreadable").set(count("unreadable"));
    for p in status_rows(&shared.pool).await? {
        let name = p["perspective"].as_str().unwrap_or("").to_owned();
        let get = |k: &str| p[k].as_f64().unwrap_or(0.0);
        metrics::gauge!("lockstep_perspective_pending_events", "perspective" => name.clone())
            .set(get("pending_events"));
        metrics::gauge!("lockstep_perspective_lag_seconds", "perspective" => name.clone())
            .set(get("lag_s"));
        metrics::gauge!("lockstep_perspective_rewinds_pending", "perspective" => name.clone())
            .set(get("rewinds_pending"));
        metrics::gauge!("lockstep_perspective_pairs_parked", "perspective" => name.clone())
            .set(get("parked"));
        metrics::gauge!("lockstep_perspective_pairs_backing_off", "perspective" => name.clone())
            .set(get("backing_off"));
        metrics::gauge!("lockstep_perspective_pairs_in_error", "perspective" => name)
            .set(get("in_error"));
    }
    Ok(())
}

/// The status page.
async fn page(shared: &Shared) -> Result<String> {
    let leases = lease_rows(&shared.pool).await?;
    let advisory = advisory_rows(&shared.pool, &shared.names).await?;
    let status = status_rows(&shared.pool).await?;
    let mut html = String::new();
    let _ = write!(
        html,
        "<!doctype html><html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"2\">\
         <title>lockstep — {db}</title><style>body{{font-family:sans-serif;margin:2em}}\
         table{{border-collapse:collapse;margin-bottom:2em}}td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:left}}\
         .expired{{color:#a00}}</style></head><body><h1>lockstep — {db}</h1>\
         <p>Refreshes every 2 s. Times on the database clock.</p>",
        db = escape(&shared.database)
    );
    table(
        &mut html,
        "Stream leases",
        &[
            "stream",
            "perspective",
            "holder",
            "reason",
            "epoch",
            "time left",
            "status",
        ],
        leases.iter().map(|l| {
            vec![
                text(&l["stream_id"]),
                text(&l["perspective"]),
                text(&l["holder"]),
                text(&l["reason"]),
                text(&l["epoch"]),
                l["time_left_ms"]
                    .as_f64()
                    .map_or_else(String::new, |ms| format!("{:.1} s", ms / 1000.0)),
                match l["error"].as_str() {
                    Some(error) => format!("unreadable: {error}"),
                    None => text(&l["status"]),
                },
            ]
        }),
    );
    table(
        &mut html,
        "Advisory locks",
        &["key", "name", "pid", "state", "age"],
        advisory.iter().map(|a| {
            vec![
                text(&a["key"]),
                a["name"].as_str().unwrap_or("(unknown)").to_owned(),
                text(&a["pid"]),
                if a["granted"] == true {
                    "holds"
                } else {
                    "waits"
                }
                .to_owned(),
                format!("{:.1} s", a["transaction_age_s"].as_f64().unwrap_or(0.0)),
            ]
        }),
    );
    table(
        &mut html,
        "Perspectives",
        &[
            "perspective",
            "pairs",
            "pending",
            "lag",
            "rewinds pending",
            "pairs in error",
        ],
        status.iter().map(|p| {
            let errors: Vec<String> = p["pairs_in_error"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| format!("{}: {}", text(&e["stream_id"]), text(&e["error"])))
                .collect();
            vec![
                text(&p["perspective"]),
                text(&p["pairs"]),
                text(&p["pending_events"]),
                format!("{:.1} s", p["lag_s"].as_f64().unwrap_or(0.0)),
                text(&p["rewinds_pending"]),
                if errors.is_empty() {
                    "0".to_owned()
                } else {
                    errors.join("; ")
                },
            ]
        }),
    );
    html.push_str("<p><a href=\"/metrics\">/metrics</a></p></body></html>\n");
    Ok(html)
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn table(
    html: &mut String,
    title: &str,
    headers: &[&str],
    rows: impl Iterator<Item = Vec<String>>,
) {
    let _ = write!(html, "<h2>{}</h2><table><tr>", escape(title));
    for h in headers {
        let _ = write!(html, "<th>{}</th>", escape(h));
    }
    html.push_str("</tr>");
    let mut any = false;
    for row in rows {
        any = true;
        html.push_str("<tr>");
        for cell in row {
            let _ = write!(html, "<td>{}</td>", escape(&cell));
        }
        html.push_str("</tr>");
    }
    if !any {
        let _ = write!(html, "<tr><td colspan=\"{}\">none</td></tr>", headers.len());
    }
    html.push_str("</table>");
}

/// HTML-escapes text from the database (perspective names and errors are user data).
fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::sync::Mutex;
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{Acceptor, accept_loop};

    /// Answers accepts from a script (`true`: a connection, `false`: EMFILE), then never again;
    /// records when each accept was called.
    struct Scripted {
        script: Mutex<std::vec::IntoIter<bool>>,
        calls: Mutex<Vec<Instant>>,
    }

    impl Acceptor for Scripted {
        type Connection = usize;

        fn accept(&self) -> impl Future<Output = std::io::Result<usize>> + Send {
            let next = {
                let mut calls = self.calls.lock().expect("calls");
                calls.push(Instant::now());
                let n = calls.len();
                self.script.lock().expect("script").next().map(|ok| (ok, n))
            };
            async move {
                match next {
                    Some((true, n)) => Ok(n),
                    Some((false, _)) => Err(std::io::Error::from_raw_os_error(24)),
                    None => std::future::pending().await,
                }
            }
        }
    }

    /// Issue 19, defect 8: failed accepts pause 50 ms, doubling to at most 1 s, and the pause
    /// starts over after a success; the loop goes on accepting after failures and stops when
    /// told to.
    #[tokio::test(start_paused = true)]
    async fn failed_accepts_pause_with_a_bounded_backoff_and_serving_goes_on() {
        let mut script = vec![false; 8];
        script.extend([true, false, true]);
        let acceptor = Scripted {
            script: Mutex::new(script.into_iter()),
            calls: Mutex::new(Vec::new()),
        };
        let started = Instant::now();
        let mut handled = Vec::new();
        accept_loop(
            &acceptor,
            tokio::time::sleep(Duration::from_secs(60)),
            |n| handled.push(n),
        )
        .await;
        assert_eq!(
            handled,
            [9, 11],
            "the connections after the failures are handled"
        );
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(60),
            "the loop ran until stopped"
        );
        let calls = acceptor.calls.lock().expect("calls");
        let gaps: Vec<u64> = calls
            .windows(2)
            .map(|w| (w[1] - w[0]).as_millis() as u64)
            .collect();
        assert_eq!(gaps, [50, 100, 200, 400, 800, 1000, 1000, 1000, 0, 50, 0]);
    }

    #[test]
    fn database_text_is_escaped() {
        assert_eq!(
            super::escape("<b>\"x\" & y</b>"),
            "&lt;b&gt;&quot;x&quot; &amp; y&lt;/b&gt;"
        );
    }
}
