//! `lockstep serve`: a status page (server-rendered HTML that refreshes itself) with the stream
//! leases, the advisory locks and the perspectives' status, and `/metrics` in the Prometheus
//! text format (gauges computed from the database at each scrape).
//!
//! A deliberately small HTTP/1.1 responder over tokio: `GET` only, one request per connection,
//! a bounded request head and a read timeout. It serves operators on a trusted network; put it
//! behind your usual proxy for anything else.

use std::fmt::Write as _;
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
use crate::say;

/// The longest request head accepted.
const MAX_HEAD: usize = 8 * 1024;

struct Shared {
    pool: deadpool_postgres::Pool,
    metrics: PrometheusHandle,
    names: Vec<String>,
    database: String,
}

pub(crate) async fn serve(url: &DbUrl, addr: &str, names: Vec<String>) -> Result<ExitCode> {
    let metrics = PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    let pool = url.pool(4).await?;
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("listening on {addr}"))?;
    let shared = Arc::new(Shared {
        pool,
        metrics,
        names,
        database: url.database().to_owned(),
    });
    say!(
        "serving the status page on http://{}/ (metrics on /metrics; Ctrl-C stops it)",
        listener.local_addr()?
    );
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let shared = Arc::clone(&shared);
                tokio::spawn(async move {
                    let _ = respond(stream, &shared).await;
                });
            }
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Serves only `/metrics` (and `/healthz`) on `addr`, from a Prometheus recorder installed now,
/// in a background task: `lockstep worker --metrics-addr`. Returns the bound address.
pub(crate) async fn metrics_endpoint(addr: &str) -> Result<std::net::SocketAddr> {
    let metrics = PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("listening on {addr}"))?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let body = metrics.render();
            tokio::spawn(async move {
                let path = read_path(&mut stream).await.unwrap_or_default();
                let (status, body) = match path.as_str() {
                    "/metrics" => ("200 OK", body),
                    "/healthz" => ("200 OK", "ok\n".to_owned()),
                    _ => ("404 Not Found", "not found\n".to_owned()),
                };
                let _ =
                    write_response(&mut stream, status, "text/plain; version=0.0.4", &body).await;
            });
        }
    });
    Ok(bound)
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
        metrics::gauge!("lockstep_perspective_pairs_in_error", "perspective" => name)
            .set(p["pairs_in_error"].as_array().map_or(0, Vec::len) as f64);
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
    #[test]
    fn database_text_is_escaped() {
        assert_eq!(
            super::escape("<b>\"x\" & y</b>"),
            "&lt;b&gt;&quot;x&quot; &amp; y&lt;/b&gt;"
        );
    }
}
