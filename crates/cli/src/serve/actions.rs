//! The status page's actions: force-release a lease, request a rewind of a pair or a rebuild
//! of a whole perspective, retry or skip a parked pair.
//!
//! - **No token, no actions**: without `LOCKSTEP_SERVE_TOKEN` every `POST /actions` answers 403.
//! - **The token travels in a header** (`X-Lockstep-Token`), compared in constant time. A
//!   cross-site page cannot send a custom header without a CORS preflight, which this server
//!   never grants, and a request whose `Origin` is not this page's (scheme and host, see
//!   [`super::guard`]) is refused outright: no cross-site request forgery.
//! - **Nothing is read before the token is checked**: a request without it is answered without
//!   reading its body, and a body longer than [`MAX_BODY_BYTES`] is refused (413) unread past
//!   that.
//! - **Two steps**: the first request (no `confirm`) validates the action and answers a prompt
//!   and a nonce; only a second request carrying that nonce, for the same action, within
//!   [`CONFIRM_WITHIN`], does it. The page shows the prompt in a confirmation dialog.
//! - **An audit line** on standard error for every action done or refused after the token
//!   check: when, from which address, what, and the outcome. Perspective names are quoted and
//!   every text escaped, so one audit event is always exactly one line (a name with a newline
//!   cannot forge another).

use lockstep_core::Pair;
use lockstep_core::perspective_store::prelude::*;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use lockstep_core::{
    PerspectiveName, Rebuild, ReleaseOutcome, StreamId, StreamLockAdmin, StreamLockOptions,
    Transaction as _, TransactionSource,
};
use lockstep_observe::Observed;
use lockstep_pg_store::PgPerspectiveStore;
use lockstep_pg_stream::PgStreamLocker;
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use super::Shared;

/// How long a confirmation nonce stays valid.
pub(super) const CONFIRM_WITHIN: Duration = Duration::from_secs(60);

/// At most this many actions wait for their confirmation at once.
const MAX_PENDING: usize = 256;

/// The longest action request body read (an action is a few hundred bytes).
pub(super) const MAX_BODY_BYTES: usize = 16 * 1024;

/// What an action request says.
#[derive(Debug, Deserialize)]
pub(super) struct Request {
    action: String,
    /// Every action but `rebuild` names a pair; `rebuild` names a perspective only.
    #[serde(default)]
    stream_id: Option<String>,
    perspective: String,
    #[serde(default)]
    event_id: Option<String>,
    #[serde(default)]
    confirm: Option<String>,
}

/// A validated action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Action {
    /// Force-release a pair's lease.
    Release(StreamId, PerspectiveName),
    /// Request a rewind of a pair from the start.
    Rewind(StreamId, PerspectiveName),
    /// Request a rewind from the start of every pair of a perspective (ADR 0016 §3).
    Rebuild(PerspectiveName),
    /// Retry a parked or backing-off pair.
    Retry(StreamId, PerspectiveName),
    /// Skip one pending event of a pair.
    Skip(StreamId, PerspectiveName, Uuid),
}

impl Action {
    fn parse(request: &Request) -> Result<Action, String> {
        let name = PerspectiveName::new(request.perspective.as_str())
            .map_err(|e| format!("invalid perspective name: {e}"))?;
        let action = request.action.as_str();
        if !["release", "rewind", "rebuild", "retry", "skip"].contains(&action) {
            return Err(format!(
                "unknown action {action:?} (release, rewind, rebuild, retry, skip)"
            ));
        }
        if action == "rebuild" {
            return match &request.stream_id {
                None => Ok(Action::Rebuild(name)),
                Some(_) => Err(
                    "rebuild applies to a whole perspective and takes no stream_id \
                     (rewind rewinds one pair)"
                        .to_owned(),
                ),
            };
        }
        let stream = match request.stream_id.as_deref() {
            None => return Err(format!("{action} needs stream_id")),
            Some(id) => Uuid::parse_str(id)
                .map(StreamId::from_uuid)
                .map_err(|_| format!("stream_id {id:?} is not a UUID"))?,
        };
        match request.action.as_str() {
            "release" => Ok(Action::Release(stream, name)),
            "rewind" => Ok(Action::Rewind(stream, name)),
            "retry" => Ok(Action::Retry(stream, name)),
            "skip" => {
                let event = request.event_id.as_deref().ok_or("skip needs event_id")?;
                let event = Uuid::parse_str(event)
                    .map_err(|_| format!("event_id {event:?} is not a UUID"))?;
                Ok(Action::Skip(stream, name, event))
            }
            other => Err(format!(
                "unknown action {other:?} (release, rewind, rebuild, retry, skip)"
            )),
        }
    }

    fn prompt(&self) -> String {
        match self {
            Action::Release(s, p) => format!(
                "Force-release the lease of {s}/{p}? Its holder's work is fenced out (its commit \
                 fails with 'lease lost')."
            ),
            Action::Rewind(s, p) => format!(
                "Rewind {s}/{p} from the start? A worker replays the stream under a rewind lease; \
                 a parked pair is retried too."
            ),
            Action::Rebuild(p) => format!(
                "Rebuild {p}? A rewind from the start is requested on every one of its pairs; \
                 the workers replay them one by one, each pair serving its old state until its \
                 rewind commits."
            ),
            Action::Retry(s, p) => {
                format!("Retry {s}/{p} now? Its parking, backoff and failure count are cleared.")
            }
            Action::Skip(s, p, e) => format!(
                "Skip event {e} of {s}/{p} for good? The skip is recorded on the pair and the \
                 pair is retried."
            ),
        }
    }

    /// For the audit line: the perspective name quoted and escaped (it is user data).
    fn describe(&self) -> String {
        let q = |p: &PerspectiveName| format!("{:?}", p.as_str());
        match self {
            Action::Release(s, p) => format!("release {s}/{}", q(p)),
            Action::Rewind(s, p) => format!("rewind {s}/{}", q(p)),
            Action::Rebuild(p) => format!("rebuild {}", q(p)),
            Action::Retry(s, p) => format!("retry {s}/{}", q(p)),
            Action::Skip(s, p, e) => format!("skip {e} of {s}/{}", q(p)),
        }
    }
}

fn answer(code: StatusCode, body: serde_json::Value) -> Response {
    (code, [(header::CACHE_CONTROL, "no-store")], Json(body)).into_response()
}

fn refused(code: StatusCode, why: impl Into<String>) -> Response {
    answer(code, json!({ "error": why.into() }))
}

/// Equal in time independent of where they differ (the token is a secret).
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Whether the request's `Origin`, when it has one, is this page ([`super::guard::Guard`]).
fn same_origin(shared: &Shared, headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN) else {
        // Not sent by a browser for same-origin GETs and by scripts; the token and the custom
        // header still stand.
        return true;
    };
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    origin
        .to_str()
        .is_ok_and(|origin| shared.guard.origin_allowed(origin, host))
}

/// One audit line: every control or line-separating character escaped (`\n` as `\\n`), so
/// it never spans two lines.
fn audit_line(peer: SocketAddr, action: &str, outcome: &str) -> String {
    format!(
        "audit: {} from {peer}: {}: {}",
        time::OffsetDateTime::now_utc(),
        one_line(action),
        one_line(outcome)
    )
}

fn one_line(text: &str) -> String {
    let mut line = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() || c == '\u{2028}' || c == '\u{2029}' {
            line.extend(c.escape_debug());
        } else {
            line.push(c);
        }
    }
    line
}

fn audit(peer: SocketAddr, action: &str, outcome: &str) {
    eprintln!("{}", audit_line(peer, action, outcome));
}

/// `POST /actions`.
pub(super) async fn handle(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let Some(token) = &shared.token else {
        return refused(
            StatusCode::FORBIDDEN,
            "actions are disabled: start lockstep serve with LOCKSTEP_SERVE_TOKEN set",
        );
    };
    if !same_origin(&shared, &headers) {
        audit(peer, "(cross-origin request)", "refused");
        return refused(StatusCode::FORBIDDEN, "cross-origin requests are refused");
    }
    let given = headers
        .get("x-lockstep-token")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !same(given.trim(), token) {
        audit(peer, "(bad or missing token)", "refused");
        return refused(
            StatusCode::UNAUTHORIZED,
            "a valid X-Lockstep-Token header is required (enter the token on the page)",
        );
    }
    // Read only now, with the token checked, and never more than the cap.
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY_BYTES).await else {
        return refused(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("an action request has at most {MAX_BODY_BYTES} bytes"),
        );
    };
    let Ok(request) = serde_json::from_slice::<Request>(&body) else {
        return refused(
            StatusCode::BAD_REQUEST,
            "expected a JSON body {action, stream_id (not for rebuild), perspective, event_id?, \
             confirm?}",
        );
    };
    let action = match Action::parse(&request) {
        Ok(action) => action,
        Err(why) => return refused(StatusCode::UNPROCESSABLE_ENTITY, why),
    };
    let now = Instant::now();
    let Some(nonce) = request.confirm else {
        // Step one: remember the action, answer its prompt.
        let nonce = Uuid::new_v4().simple().to_string();
        let mut pending = shared
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        pending.retain(|_, (_, at)| now.duration_since(*at) < CONFIRM_WITHIN);
        if pending.len() >= MAX_PENDING {
            return refused(
                StatusCode::TOO_MANY_REQUESTS,
                "too many actions wait for their confirmation; try again in a minute",
            );
        }
        pending.insert(nonce.clone(), (action.clone(), now));
        return answer(
            StatusCode::OK,
            json!({ "confirm": nonce, "prompt": action.prompt(), "within_s": CONFIRM_WITHIN.as_secs() }),
        );
    };
    let confirmed = {
        let mut pending = shared
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        pending
            .remove(&nonce)
            .filter(|(asked, at)| *asked == action && now.duration_since(*at) < CONFIRM_WITHIN)
            .is_some()
    };
    if !confirmed {
        audit(
            peer,
            &action.describe(),
            "refused: no matching confirmation",
        );
        return refused(
            StatusCode::CONFLICT,
            "this confirmation is unknown, expired or for another action: ask again",
        );
    }
    match run(&shared, &action).await {
        Ok((done, message)) => {
            audit(
                peer,
                &action.describe(),
                if done { "done" } else { "nothing to do" },
            );
            answer(
                if done {
                    StatusCode::OK
                } else {
                    StatusCode::CONFLICT
                },
                json!({ "done": done, "message": message }),
            )
        }
        Err(e) => {
            let why = format!("{e}");
            audit(peer, &action.describe(), &format!("failed: {why}"));
            refused(StatusCode::SERVICE_UNAVAILABLE, why)
        }
    }
}

/// Does `action`: `(done, what happened)`.
async fn run(shared: &Shared, action: &Action) -> lockstep_core::Result<(bool, String)> {
    // Observed: the operator's actions are counted and traced like every other call.
    let store = Observed::new(PgPerspectiveStore::new());
    let tx = shared.db.begin().await?;
    let outcome = match action {
        Action::Rewind(s, p) => store
            .request_rewind(&tx, &Pair::new(*s, p.clone()), None)
            .await
            .map(|found| {
                if found {
                    (true, format!("rewind of {s}/{p} requested from the start"))
                } else {
                    (false, format!("{s}/{p} has no cursor: nothing to rewind"))
                }
            }),
        Action::Rebuild(p) => store.rebuild(&tx, p).await.map(|outcome| match outcome {
            Rebuild::Requested { pairs } => (
                true,
                format!(
                    "rebuild of {p} requested: a rewind from the start on each of its {pairs} \
                     pairs"
                ),
            ),
            _ => (false, format!("{p} is not registered: nothing to rebuild")),
        }),
        Action::Retry(s, p) => store
            .unpark(&tx, &Pair::new(*s, p.clone()))
            .await
            .map(|found| {
                if found {
                    (
                        true,
                        format!("{s}/{p} is retried: the next batch claims it"),
                    )
                } else {
                    (false, format!("{s}/{p} has no cursor: nothing to retry"))
                }
            }),
        Action::Skip(s, p, e) => store
            .skip_event(
                &tx,
                &Pair::new(*s, p.clone()),
                *e,
                "skipped from the status page",
            )
            .await
            .map(|skipped| {
                if skipped {
                    (
                        true,
                        format!("skipped event {e} of {s}/{p}; the pair is retried"),
                    )
                } else {
                    (
                        false,
                        format!("event {e} is not pending work of {s}/{p}: nothing skipped"),
                    )
                }
            }),
        // Its own statement on its own connection; the transaction stays empty.
        Action::Release(s, p) => {
            let locker = Observed::new(PgStreamLocker::from_pool(
                shared.db.pool().clone(),
                StreamLockOptions::default(),
            ));
            locker
                .force_release(*s, p)
                .await
                .map(|released| match released {
                    ReleaseOutcome::Released => (
                        true,
                        format!("released the lease of {s}/{p}; its epoch increased"),
                    ),
                    _ => (false, format!("{s}/{p} had no lease to release")),
                })
        }
    };
    match outcome {
        Ok(done) => {
            tx.commit().await?;
            Ok(done)
        }
        Err(e) => {
            // The action's error is the one to report; a rollback that fails still ends the
            // transaction, and nothing of it is committed.
            crate::pg::rollback(tx, "a status page action that failed").await;
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_audit_line_is_one_line_whatever_the_texts_hold() {
        let peer: SocketAddr = "127.0.0.1:9".parse().expect("address");
        let line = audit_line(
            peer,
            "rewind x/Orders\naudit: 2030 from 1.2.3.4: release y/A: done",
            "failed: a\r\nb\u{2028}c\u{85}d",
        );
        assert_eq!(line.lines().count(), 1, "{line}");
        assert!(!line.contains(['\r', '\u{2028}', '\u{85}']), "{line}");
        assert!(line.contains("Orders\\naudit: 2030"), "{line}");
        assert!(
            line.ends_with("failed: a\\r\\nb\\u{2028}c\\u{85}d"),
            "{line}"
        );
    }

    #[test]
    fn an_action_names_its_perspective_quoted() {
        let stream = StreamId::from_uuid(Uuid::nil());
        let name = PerspectiveName::new("Orders").expect("valid");
        assert_eq!(
            Action::Rebuild(name.clone()).describe(),
            "rebuild \"Orders\""
        );
        assert_eq!(
            Action::Release(stream, name).describe(),
            format!("release {stream}/\"Orders\"")
        );
    }
}
