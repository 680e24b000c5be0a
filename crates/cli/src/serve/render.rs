//! The status page's HTML: the shell (styles and the script that refreshes it in place and runs
//! the actions) and the fragment it refreshes (summary, workers, leases, advisory locks,
//! perspectives, perspective versions, parked pairs). Everything from the database is escaped.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::Snapshot;

/// Lag above this is amber on the page.
const LAG_WARN_S: f64 = 5.0;
/// Lag above this is red on the page (the default of `perspectives status --check`).
const LAG_BAD_S: f64 = 60.0;

/// HTML-escapes text from the database (perspective names and errors are user data).
pub(super) fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Advisory lock rows grouped per key: the holder(s), how many wait, the longest wait, and the
/// application of every connection involved.
pub(super) fn group_advisory(rows: &[Value]) -> Vec<Value> {
    let mut groups: Vec<Value> = Vec::new();
    for row in rows {
        let key = row["key"].as_i64().unwrap_or(0);
        let at = match groups.iter().position(|g| g["key"] == key) {
            Some(at) => at,
            None => {
                groups.push(json!({
                    "key": key, "name": row["name"], "holders": [], "waiting": 0,
                    "longest_wait_s": 0.0, "waiters": [],
                }));
                groups.len() - 1
            }
        };
        let group = &mut groups[at];
        let who = json!({
            "pid": row["pid"], "application": row["application"],
            "transaction_age_s": row["transaction_age_s"],
        });
        if row["granted"] == true {
            if let Some(holders) = group["holders"].as_array_mut() {
                holders.push(who);
            }
        } else {
            let age = row["transaction_age_s"].as_f64().unwrap_or(0.0);
            group["waiting"] = json!(group["waiting"].as_u64().unwrap_or(0) + 1);
            if age > group["longest_wait_s"].as_f64().unwrap_or(0.0) {
                group["longest_wait_s"] = json!(age);
            }
            if let Some(waiters) = group["waiters"].as_array_mut() {
                waiters.push(who);
            }
        }
    }
    groups
}

/// The summary line's figures.
pub(super) fn summary(snap: &Snapshot) -> Value {
    let leases = |status: &str| snap.leases.iter().filter(|l| l["status"] == status).count();
    let sum = |key: &str| {
        snap.perspectives
            .iter()
            .map(|p| p[key].as_u64().unwrap_or(0))
            .sum::<u64>()
    };
    let max_lag = snap
        .perspectives
        .iter()
        .map(|p| p["lag_s"].as_f64().unwrap_or(0.0))
        .fold(0.0_f64, f64::max);
    let mut holders: Vec<&str> = snap
        .leases
        .iter()
        .filter_map(|l| l["holder"].as_str())
        .collect();
    holders.sort_unstable();
    holders.dedup();
    let groups = group_advisory(&snap.advisory);
    json!({
        "leases_held": leases("held"),
        "leases_expired": leases("expired"),
        "leases_unreadable": leases("unreadable"),
        "instances_holding_leases": holders.len(),
        "advisory_keys": groups.len(),
        "advisory_waiting": groups.iter().map(|g| g["waiting"].as_u64().unwrap_or(0)).sum::<u64>(),
        "max_lag_s": max_lag,
        "pending_events": sum("pending_events"),
        "pairs_in_error": sum("in_error"),
        "pairs_parked": sum("parked"),
        "pairs_backing_off": sum("backing_off"),
        "workers_live": snap.workers.iter().filter(|w| w["state"] == "live").count(),
        "workers_stale": snap.workers.iter().filter(|w| w["state"] == "stale").count(),
        "workers_unreadable": snap.workers.iter().filter(|w| w["state"] == "unreadable").count(),
        "perspectives_unserved": snap.perspectives.iter().filter(|p| p["unserved"] == true).count(),
        "versions_building": snap.versions.iter().filter(|v| v["status"] == "building").count(),
        "promotions_waiting": snap.versions.iter().filter(|v| v["promotion_requested"].is_object()).count(),
        "promotions_stale": snap.versions.iter().filter(|v| promotion_stale(v)).count(),
    })
}

/// Whether a version's promotion was requested longer ago than `status --check` allows by
/// default, and is still not performed.
fn promotion_stale(v: &Value) -> bool {
    v["promotion_requested"]["requested_s_ago"]
        .as_f64()
        .is_some_and(|ago| ago > crate::versions::PROMOTION_WAIT_S)
}

/// A badge: `ok`, `warn` or `bad`.
fn badge(html: &mut String, level: &str, label: &str) {
    let _ = write!(
        html,
        "<span class=\"badge {level}\">{}</span> ",
        escape(label)
    );
}

fn level(bad: bool, warn: bool) -> &'static str {
    if bad {
        "bad"
    } else if warn {
        "warn"
    } else {
        "ok"
    }
}

/// A button that asks for an action (the script confirms and sends it); `stream` is `None` for
/// an action on a whole perspective (rebuild).
fn action_button(
    action: &str,
    stream: Option<&str>,
    perspective: &str,
    event: Option<&str>,
    label: &str,
) -> String {
    format!(
        "<button data-action=\"{}\"{} data-perspective=\"{}\"{}>{}</button>",
        escape(action),
        stream.map_or_else(String::new, |s| format!(" data-stream=\"{}\"", escape(s))),
        escape(perspective),
        event.map_or_else(String::new, |e| format!(" data-event=\"{}\"", escape(e))),
        escape(label)
    )
}

/// A table; cells are HTML already escaped by the caller.
fn table(html: &mut String, id: &str, title: &str, headers: &[&str], rows: &[Vec<String>]) {
    let _ = write!(
        html,
        "<h2>{} <small>({})</small></h2><table id=\"{id}\"><tr>",
        escape(title),
        rows.len()
    );
    for h in headers {
        let _ = write!(html, "<th>{}</th>", escape(h));
    }
    html.push_str("</tr>");
    for row in rows {
        html.push_str("<tr>");
        for cell in row {
            let _ = write!(html, "<td>{cell}</td>");
        }
        html.push_str("</tr>");
    }
    if rows.is_empty() {
        let _ = write!(
            html,
            "<tr><td colspan=\"{}\" class=\"none\">none</td></tr>",
            headers.len()
        );
    }
    html.push_str("</table>");
}

/// The refreshed part of the page.
pub(super) fn fragment(snap: &Snapshot, actions: bool) -> String {
    let mut html = String::new();
    let s = summary(snap);
    let n = |k: &str| s[k].as_u64().unwrap_or(0);
    let max_lag = s["max_lag_s"].as_f64().unwrap_or(0.0);
    html.push_str("<p id=\"summary\">");
    badge(
        &mut html,
        "ok",
        &format!("{} leases held", n("leases_held")),
    );
    badge(
        &mut html,
        level(n("leases_unreadable") > 0, n("leases_expired") > 0),
        &format!(
            "{} expired, {} unreadable",
            n("leases_expired"),
            n("leases_unreadable")
        ),
    );
    badge(
        &mut html,
        level(false, n("advisory_waiting") > 0),
        &format!(
            "{} advisory keys, {} waiting",
            n("advisory_keys"),
            n("advisory_waiting")
        ),
    );
    badge(
        &mut html,
        level(max_lag > LAG_BAD_S, max_lag > LAG_WARN_S),
        &format!("max lag {max_lag:.1} s ({} pending)", n("pending_events")),
    );
    badge(
        &mut html,
        level(n("pairs_in_error") > 0, n("pairs_backing_off") > 0),
        &format!(
            "{} pairs in error, {} backing off",
            n("pairs_in_error"),
            n("pairs_backing_off")
        ),
    );
    badge(
        &mut html,
        level(n("pairs_parked") > 0, false),
        &format!("{} parked", n("pairs_parked")),
    );
    badge(
        &mut html,
        level(n("promotions_stale") > 0, n("promotions_waiting") > 0),
        &format!(
            "{} versions building, {} promotions requested ({} waiting over {:.0} s)",
            n("versions_building"),
            n("promotions_waiting"),
            n("promotions_stale"),
            crate::versions::PROMOTION_WAIT_S
        ),
    );
    badge(
        &mut html,
        "ok",
        &format!("{} instances holding leases", n("instances_holding_leases")),
    );
    badge(
        &mut html,
        level(
            n("perspectives_unserved") > 0 || n("workers_unreadable") > 0,
            n("workers_stale") > 0,
        ),
        &format!(
            "{} workers live, {} stale, {}{} perspectives with no live worker",
            n("workers_live"),
            n("workers_stale"),
            if n("workers_unreadable") > 0 {
                format!("{} unreadable, ", n("workers_unreadable"))
            } else {
                String::new()
            },
            n("perspectives_unserved")
        ),
    );
    html.push_str("</p>");

    let workers: Vec<Vec<String>> = snap
        .workers
        .iter()
        .map(|w| {
            if let Some(error) = w["error"].as_str() {
                let mut row = vec![escape(&text(&w["name"])), escape(&text(&w["instance_id"]))];
                row.extend(std::iter::repeat_n(String::new(), 7));
                row.push(format!(
                    "<span class=\"bad\">unreadable: {}</span>",
                    escape(error)
                ));
                return row;
            }
            let perspectives: Vec<String> = w["perspectives"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| escape(&text(p)))
                .collect();
            vec![
                escape(&text(&w["name"])),
                escape(&text(&w["instance_id"])),
                escape(&text(&w["host"])),
                escape(&text(&w["pid"])),
                escape(&text(&w["version"])),
                perspectives.join(", "),
                escape(&text(&w["started_at"])),
                format!("{:.1} s ago", w["last_seen_s_ago"].as_f64().unwrap_or(0.0)),
                escape(&text(&w["leases_held"])),
                if w["state"] == "live" {
                    "<span class=\"ok\">live</span>".to_owned()
                } else {
                    "<span class=\"bad\">stale</span>".to_owned()
                },
            ]
        })
        .collect();
    table(
        &mut html,
        "workers",
        "Workers",
        &[
            "name",
            "instance",
            "host",
            "pid",
            "version",
            "perspectives",
            "started",
            "last seen",
            "leases",
            "state",
        ],
        &workers,
    );

    let leases: Vec<Vec<String>> = snap
        .leases
        .iter()
        .map(|l| {
            let status = match l["error"].as_str() {
                Some(error) => format!("<span class=\"bad\">unreadable: {}</span>", escape(error)),
                None if l["status"] == "expired" => "<span class=\"bad\">expired</span>".to_owned(),
                None => escape(&text(&l["status"])),
            };
            let stream = text(&l["stream_id"]);
            let perspective = text(&l["perspective"]);
            vec![
                escape(&stream),
                escape(&perspective),
                match l["holder_name"].as_str() {
                    Some(name) => format!(
                        "{}<br><small>{}</small>",
                        escape(name),
                        escape(&text(&l["holder"]))
                    ),
                    None => escape(&text(&l["holder"])),
                },
                escape(&text(&l["reason"])),
                escape(&text(&l["epoch"])),
                match l["started_at"].as_str() {
                    Some(at) => format!(
                        "{}<br><small>held {:.1} s</small>",
                        escape(at),
                        l["held_s"].as_f64().unwrap_or(0.0)
                    ),
                    None if l["error"].is_null() => "<span class=\"none\" title=\"the \
                        lease's start is not recorded for its epoch\">not recorded</span>"
                        .to_owned(),
                    None => String::new(),
                },
                if l["progress"].is_object() {
                    format!(
                        "{} of {} events ({}%)<br><small>reported {:.1} s ago</small>",
                        escape(&text(&l["progress"]["replayed"])),
                        escape(&text(&l["progress"]["to_replay"])),
                        escape(&text(&l["progress"]["percent"])),
                        l["progress"]["reported_s_ago"].as_f64().unwrap_or(0.0)
                    )
                } else {
                    String::new()
                },
                l["time_left_ms"]
                    .as_f64()
                    .map_or_else(String::new, |ms| format!("{:.1} s", ms / 1000.0)),
                status,
                if actions && l["error"].is_null() {
                    action_button(
                        "release",
                        Some(&stream),
                        &perspective,
                        None,
                        "force-release",
                    )
                } else {
                    String::new()
                },
            ]
        })
        .collect();
    table(
        &mut html,
        "leases",
        "Stream leases",
        &[
            "stream",
            "perspective",
            "holder",
            "reason",
            "epoch",
            "started",
            "progress",
            "time left",
            "status",
            "",
        ],
        &leases,
    );

    let groups = group_advisory(&snap.advisory);
    let who = |list: &Value| -> String {
        list.as_array()
            .into_iter()
            .flatten()
            .map(|w| {
                format!(
                    "pid {} ({}, {:.1} s)",
                    escape(&text(&w["pid"])),
                    escape(
                        w["application"]
                            .as_str()
                            .filter(|a| !a.is_empty())
                            .unwrap_or("no application_name")
                    ),
                    w["transaction_age_s"].as_f64().unwrap_or(0.0)
                )
            })
            .collect::<Vec<_>>()
            .join("<br>")
    };
    let advisory: Vec<Vec<String>> = groups
        .iter()
        .map(|g| {
            let waiting = g["waiting"].as_u64().unwrap_or(0);
            vec![
                escape(&text(&g["key"])),
                escape(
                    g["name"]
                        .as_str()
                        .unwrap_or("(unknown: name it with --name)"),
                ),
                who(&g["holders"]),
                if waiting > 0 {
                    format!("<span class=\"warn\">{waiting} waiting</span>")
                } else {
                    "0".to_owned()
                },
                format!("{:.1} s", g["longest_wait_s"].as_f64().unwrap_or(0.0)),
                who(&g["waiters"]),
            ]
        })
        .collect();
    table(
        &mut html,
        "advisory",
        "Advisory locks",
        &[
            "key",
            "name",
            "held by",
            "waiting",
            "longest wait",
            "waiters",
        ],
        &advisory,
    );

    let perspectives: Vec<Vec<String>> = snap
        .perspectives
        .iter()
        .map(|p| {
            let name = text(&p["perspective"]);
            let lag = p["lag_s"].as_f64().unwrap_or(0.0);
            let errors: Vec<String> = p["pairs_in_error"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| {
                    let stream = text(&e["stream_id"]);
                    format!(
                        "{} failed {}×{}: {} {}",
                        escape(&stream),
                        escape(&text(&e["failures"])),
                        if e["parked"] == true { " (parked)" } else { "" },
                        escape(&text(&e["error"])),
                        if actions {
                            action_button("rewind", Some(&stream), &name, None, "rewind")
                        } else {
                            String::new()
                        }
                    )
                })
                .collect();
            vec![
                if actions {
                    format!(
                        "{}{}",
                        escape(&name),
                        action_button("rebuild", None, &name, None, "rebuild")
                    )
                } else {
                    escape(&name)
                },
                escape(&text(&p["pairs"])),
                escape(&text(&p["pending_events"])),
                format!(
                    "<span class=\"{}\">{lag:.1} s</span>",
                    level(lag > LAG_BAD_S, lag > LAG_WARN_S)
                ),
                format!(
                    "{} / {}",
                    p["applied_per_s"]
                        .as_f64()
                        .map_or("-".to_owned(), |r| format!("{r:.1}")),
                    p["time_to_empty_s"]
                        .as_f64()
                        .map_or("-".to_owned(), |t| format!("{t:.0} s"))
                ),
                {
                    // The pending count, then each running rewind's progress under it.
                    let running: Vec<String> = p["rewinds_running"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|r| escape(&crate::life::progress_line(r)))
                        .collect();
                    if running.is_empty() {
                        escape(&text(&p["rewinds_pending"]))
                    } else {
                        format!(
                            "{}<br><small>{}</small>",
                            escape(&text(&p["rewinds_pending"])),
                            running.join("<br>")
                        )
                    }
                },
                escape(&text(&p["backing_off"])),
                escape(&text(&p["parked"])),
                {
                    let live: Vec<String> = p["live_workers"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|w| escape(&text(w)))
                        .collect();
                    if p["unserved"] == true {
                        "<span class=\"bad unserved\">no live worker</span>".to_owned()
                    } else if live.is_empty() {
                        "<span class=\"none\">none</span>".to_owned()
                    } else {
                        live.join(", ")
                    }
                },
                if errors.is_empty() {
                    "0".to_owned()
                } else {
                    format!(
                        "<span class=\"bad\">{}</span><br>{}",
                        errors.len(),
                        errors.join("<br>")
                    )
                },
            ]
        })
        .collect();
    table(
        &mut html,
        "perspectives",
        "Perspectives",
        &[
            "perspective",
            "pairs",
            "pending",
            "lag",
            "applied/s / to empty",
            "rewinds pending (running)",
            "backing off",
            "parked",
            "live workers",
            "pairs in error",
        ],
        &perspectives,
    );

    let versions: Vec<Vec<String>> = snap.versions.iter().map(version_cells).collect();
    table(
        &mut html,
        "versions",
        "Perspective versions",
        &[
            "perspective",
            "version",
            "status",
            "stored name",
            "policy",
            "pending",
            "lag",
            "parked",
            "promotion requested",
        ],
        &versions,
    );

    let parked: Vec<Vec<String>> = snap
        .parked
        .iter()
        .map(|c| {
            let stream = text(&c["stream_id"]);
            let perspective = text(&c["perspective"]);
            let event = c["failed_event_id"].as_str();
            let mut buttons = String::new();
            if actions {
                buttons.push_str(&action_button(
                    "retry",
                    Some(&stream),
                    &perspective,
                    None,
                    "retry",
                ));
                if event.is_some() {
                    buttons.push_str(&action_button(
                        "skip",
                        Some(&stream),
                        &perspective,
                        event,
                        "skip event",
                    ));
                }
            }
            vec![
                escape(&stream),
                escape(&perspective),
                escape(&text(&c["failures"])),
                escape(event.unwrap_or("")),
                escape(&text(&c["error"])),
                escape(&text(&c["parked_at"])),
                buttons,
            ]
        })
        .collect();
    table(
        &mut html,
        "parked",
        "Parked pairs",
        &[
            "stream",
            "perspective",
            "failures",
            "failing event",
            "error",
            "parked at",
            "",
        ],
        &parked,
    );
    let _ = write!(
        html,
        "<p class=\"meta\" id=\"took\">read from the database in {:.0} ms</p>",
        snap.took_ms
    );
    html
}

/// A row of the versions table: the serving version in green, a building version's progress
/// (its parked pairs in red: they block its promotion), a promotion requested (red once it has
/// waited longer than `status --check` allows by default).
fn version_cells(v: &Value) -> Vec<String> {
    let status = text(&v["status"]);
    let building = status == "building";
    let p = &v["progress"];
    let figure = |key: &str| {
        if p.is_object() {
            escape(&text(&p[key]))
        } else {
            "-".to_owned()
        }
    };
    let parked = p["parked"].as_u64().unwrap_or(0);
    let lag = p["lag_s"].as_f64();
    let requested = &v["promotion_requested"];
    vec![
        escape(&text(&v["perspective"])),
        escape(&format!("v{}", text(&v["version"]))),
        match status.as_str() {
            "serving" => "<span class=\"ok serving\">serving</span>".to_owned(),
            "building" => "<span class=\"warn\">building</span>".to_owned(),
            other => escape(other),
        },
        escape(&text(&v["stored_name"])),
        escape(&format!(
            "{}, previous: {}",
            text(&v["promotion"]),
            text(&v["previous"])
        )),
        figure("pending_events"),
        lag.map_or_else(
            || "-".to_owned(),
            |lag| {
                format!(
                    "<span class=\"{}\">{lag:.1} s</span>",
                    level(lag > LAG_BAD_S, lag > LAG_WARN_S)
                )
            },
        ),
        if parked > 0 && building {
            format!("<span class=\"bad\">{parked}</span> <small>(block its promotion)</small>")
        } else if parked > 0 {
            format!("<span class=\"bad\">{parked}</span>")
        } else {
            figure("parked")
        },
        match requested["requested_s_ago"].as_f64() {
            Some(ago) => format!(
                "<span class=\"{}\">{ago:.0} s ago{}</span>",
                if promotion_stale(v) { "bad" } else { "warn" },
                if requested["force"] == true {
                    " (forced)"
                } else {
                    ""
                }
            ),
            None => "-".to_owned(),
        },
    ]
}

/// What the page shows while the database cannot be shown.
pub(super) fn unavailable(message: &str) -> String {
    format!(
        "<p id=\"summary\"><span class=\"badge bad\">unavailable</span></p>\
         <div class=\"down\" id=\"unavailable\">{}<br>Retrying every 2 s.</div>",
        escape(message)
    )
}

/// The whole page: `body` (a [`fragment`] or [`unavailable`]) in the shell.
pub(super) fn page(database: &str, body: &str, actions: bool) -> String {
    let db = escape(database);
    let token_box = if actions {
        "<label>action token <input id=\"token\" type=\"password\" autocomplete=\"off\"></label>"
    } else {
        "<span class=\"meta\">actions disabled: start <code>lockstep serve</code> with \
         LOCKSTEP_SERVE_TOKEN to enable them</span>"
    };
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
<title>lockstep — {db}</title><style>{STYLE}</style></head><body>\
<header><h1>lockstep — {db}</h1><span id=\"refreshed\" class=\"meta\">rendered by the server</span> \
{token_box}<span id=\"message\" role=\"status\"></span></header>\
<main id=\"content\">{body}</main>\
<p class=\"meta\">Times on the database clock. <a href=\"/api/status\">JSON</a> · \
<a href=\"/metrics\">/metrics</a> · <a href=\"/healthz\">/healthz</a></p>\
<script>{SCRIPT}</script></body></html>\n"
    )
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:0 2em 2em;color:#222}\
header{position:sticky;top:0;background:#fff;padding:.6em 0;border-bottom:1px solid #ddd}\
h1{font-size:1.3em;display:inline;margin-right:1em}h2{font-size:1.05em;margin-top:1.6em}\
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #e3e3e3;padding:.3em .6em;\
text-align:left;vertical-align:top;font-size:.9em}th{background:#f6f6f6}\
.badge{display:inline-block;padding:.15em .6em;border-radius:1em;margin:.1em;font-size:.9em}\
.badge.ok{background:#e3f4e3}.badge.warn{background:#fff1c2}.badge.bad{background:#fcd5d5}\
span.bad{color:#b00;font-weight:600}span.warn{color:#a60}span.ok{color:#070}.none,.meta{color:#777}\
.down{background:#fcd5d5;padding:1em;border-radius:.4em}#message{margin-left:1em;font-weight:600}\
button{font-size:.8em;margin-left:.3em}";

/// Refreshes `#content` in place every 2 s (no reload: the scroll position stays), keeps
/// going while the server or the database is down, and runs the actions: ask, confirm with the
/// prompt the server gives, then send the confirmation. The token stays in this tab's session
/// storage and travels in a header, which a cross-site form cannot send.
const SCRIPT: &str = r#"
const content = document.getElementById('content');
const refreshed = document.getElementById('refreshed');
const message = document.getElementById('message');
const tokenBox = document.getElementById('token');
if (tokenBox) {
  tokenBox.value = sessionStorage.getItem('lockstep-token') || '';
  tokenBox.addEventListener('change', () => sessionStorage.setItem('lockstep-token', tokenBox.value));
}
async function refresh() {
  const started = performance.now();
  try {
    const response = await fetch('/fragment', { cache: 'no-store' });
    content.innerHTML = await response.text();
    const ms = Math.round(performance.now() - started);
    refreshed.textContent = 'updated ' + new Date().toLocaleTimeString() + ' (' + ms + ' ms)' +
      (response.ok ? '' : ' — database unavailable');
  } catch (e) {
    refreshed.textContent = 'cannot reach lockstep serve (' + e + '); retrying';
  }
}
setInterval(refresh, 2000);
async function send(body) {
  const response = await fetch('/actions', {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', 'X-Lockstep-Token': tokenBox ? tokenBox.value : '' },
    body: JSON.stringify(body),
  });
  let answer = {};
  try { answer = await response.json(); } catch (e) { answer = { error: 'HTTP ' + response.status }; }
  return { ok: response.ok, answer };
}
document.addEventListener('click', async (event) => {
  const button = event.target.closest('button[data-action]');
  if (!button) return;
  const body = { action: button.dataset.action, stream_id: button.dataset.stream,
    perspective: button.dataset.perspective };
  if (button.dataset.event) body.event_id = button.dataset.event;
  let reply = await send(body);
  if (!reply.ok) { message.textContent = reply.answer.error || 'refused'; return; }
  if (!window.confirm(reply.answer.prompt)) { message.textContent = 'cancelled'; return; }
  body.confirm = reply.answer.confirm;
  reply = await send(body);
  message.textContent = reply.answer.message || reply.answer.error || '';
  refresh();
});
"#;
