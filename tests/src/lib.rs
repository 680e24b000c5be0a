//! # lockstep-tests
//!
//! Cross-crate and multi-process tests of lockstep (see `tests/README.md`), and what they share:
//!
//! - [`Numbers`], the perspective every test runs: its state is the list of the numbers its
//!   events carry, in the order applied, so a lost event and an event applied twice both show;
//!   its `apply` can be slowed down (a rewind that takes long enough to kill its process).
//! - [`worker_process`], the body of the `lockstep-test-worker` binary: one
//!   [`lockstep_worker::PerspectiveWorker`] on PostgreSQL as a process that a test can start and
//!   `kill -9`; it prints a line when it holds a `rewind` lease.
//! - [`reliability`]: the scenarios of issue 8's reliability suite (mutual-exclusion audit,
//!   faults, cancellation, bad input, fake = Postgres by model, worker processes killed at
//!   random), run short by
//!   `tests/reliability_*.rs` and `tests/model.rs`, long by `lockstep-bench reliability`.
//! - [`expected_folds`] and [`perspective_states`]: the fold of every stream's events in
//!   event-id order, and the states the workers stored, read back from the database.
//!
//! ```no_run
//! # async fn demo(client: &tokio_postgres::Client) -> anyhow::Result<()> {
//! let expected = lockstep_tests::expected_folds(client).await?;
//! let stored = lockstep_tests::perspective_states(client, lockstep_tests::NUMBERS).await?;
//! assert_eq!(stored, expected);
//! # Ok(()) }
//! ```

pub mod reliability;
pub mod worker_process;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lockstep_core::{NewEvent, Perspective, RecordedEvent};
use tokio_postgres::config::Host;
use uuid::Uuid;

/// The name of the [`Numbers`] perspective.
pub const NUMBERS: &str = "Numbers";

/// The environment variable that slows [`Numbers::apply`] down in the test worker: milliseconds
/// of sleep per applied event.
pub const APPLY_SLEEP_ENV: &str = "LOCKSTEP_TEST_APPLY_SLEEP_MS";

/// Folds a stream's events into the list of their `n` payload fields, in the order applied.
/// A missing or non-integer `n` is an error of the pair. Clones share one count of `apply`
/// calls ([`Numbers::applied`]): more calls than events means rewinds replayed some.
#[derive(Debug, Clone, Default)]
pub struct Numbers {
    sleep_per_event: Duration,
    applied: Arc<AtomicU64>,
}

impl Numbers {
    /// A perspective that applies at full speed.
    pub fn new() -> Numbers {
        Numbers::default()
    }

    /// A perspective that sleeps this long per event (blocking the thread: `apply` is
    /// synchronous, as a CPU-heavy perspective would be).
    pub fn slowed(sleep_per_event: Duration) -> Numbers {
        Numbers {
            sleep_per_event,
            ..Numbers::default()
        }
    }

    /// How many times `apply` ran, on this perspective and its clones (replays included).
    pub fn applied(&self) -> u64 {
        self.applied.load(Ordering::Relaxed)
    }
}

/// An event without an integer `n`.
#[derive(Debug)]
pub struct NotANumber(pub Uuid);

impl std::fmt::Display for NotANumber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "event {} carries no integer `n`", self.0)
    }
}

impl std::error::Error for NotANumber {}

impl Perspective for Numbers {
    type State = Vec<i64>;
    type Error = NotANumber;

    fn name(&self) -> &str {
        NUMBERS
    }

    fn apply(&self, state: &mut Vec<i64>, event: &RecordedEvent) -> Result<(), NotANumber> {
        if !self.sleep_per_event.is_zero() {
            std::thread::sleep(self.sleep_per_event);
        }
        let n = event.payload["n"]
            .as_i64()
            .ok_or(NotANumber(event.event_id))?;
        state.push(n);
        self.applied.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The name of [`NumberRows`].
pub const NUMBER_ROWS: &str = "NumberRows";

/// The application's table [`NumberRows`] writes: one row per applied event (the primary key
/// refuses a second write of one event).
pub const NUMBER_ROWS_TABLE: &str = "CREATE TABLE IF NOT EXISTS number_rows (
    event_id uuid PRIMARY KEY,
    stream_id uuid NOT NULL,
    n bigint NOT NULL
)";

/// A table perspective beside [`Numbers`]: each event's `n` as a row of the application's table
/// `number_rows` ([`NUMBER_ROWS_TABLE`]), written with SQL in the worker's transaction; a reset
/// deletes the stream's rows.
#[derive(Debug, Clone, Copy, Default)]
pub struct NumberRows;

impl lockstep_core::TablePerspective<lockstep_pg::PgTransaction> for NumberRows {
    type Error = tokio_postgres::Error;

    fn name(&self) -> &str {
        NUMBER_ROWS
    }

    async fn apply(
        &self,
        tx: &lockstep_pg::PgTransaction,
        event: &RecordedEvent,
    ) -> Result<(), tokio_postgres::Error> {
        let n = event.payload["n"].as_i64().unwrap_or(i64::MIN);
        tx.client()
            .execute(
                "INSERT INTO number_rows (event_id, stream_id, n) VALUES ($1, $2, $3)",
                &[&event.event_id, &event.stream_id.as_uuid(), &n],
            )
            .await?;
        Ok(())
    }

    async fn reset(
        &self,
        tx: &lockstep_pg::PgTransaction,
        stream_id: lockstep_core::StreamId,
    ) -> Result<(), tokio_postgres::Error> {
        tx.client()
            .execute(
                "DELETE FROM number_rows WHERE stream_id = $1",
                &[&stream_id.as_uuid()],
            )
            .await?;
        Ok(())
    }
}

/// Every stream's rows of `number_rows`, their `n` in event-id order.
pub async fn number_rows(
    client: &tokio_postgres::Client,
) -> anyhow::Result<BTreeMap<Uuid, Vec<i64>>> {
    let rows = client
        .query(
            "SELECT stream_id, n FROM number_rows ORDER BY stream_id, event_id",
            &[],
        )
        .await?;
    let mut states: BTreeMap<Uuid, Vec<i64>> = BTreeMap::new();
    for row in rows {
        states
            .entry(row.try_get(0)?)
            .or_default()
            .push(row.try_get(1)?);
    }
    Ok(states)
}

/// An event carrying the number `n` ([`Numbers`] folds it), with a fresh UUIDv7 id.
pub fn number_event(n: i64) -> NewEvent {
    match NewEvent::new("Numbered", serde_json::json!({ "n": n })) {
        Ok(event) => event,
        Err(e) => unreachable!("a small JSON object is a valid payload: {e}"),
    }
}

/// Appends to `stream`, through the SQL function as a writer outside Rust would, a `Numbered`
/// event whose payload cannot be read back: `jsonb` keeps the number `1e400`, which
/// `serde_json` refuses as out of range. Returns its id.
pub async fn append_unreadable(
    client: &impl tokio_postgres::GenericClient,
    stream: lockstep_core::StreamId,
) -> Result<Uuid, tokio_postgres::Error> {
    let id = Uuid::now_v7();
    client
        .execute(
            "SELECT lockstep_append_events($1, NULL, ARRAY[$2::uuid], ARRAY['Numbered'], \
             ARRAY['{\"n\": 1e400}'::jsonb])",
            &[&stream.as_uuid(), &id],
        )
        .await?;
    Ok(id)
}

/// A UUIDv7 whose timestamp lies `ago` before now: it sorts before every id generated since,
/// as the id of an imported or replicated event would.
pub fn early_id(ago: Duration) -> Uuid {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let then = now.saturating_sub(ago);
    Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        then.as_secs(),
        then.subsec_nanos(),
    ))
}

/// A `postgres://` URL for `config`: the first host and port, the user, the password if any
/// (percent-encoded), the database.
pub fn database_url(config: &tokio_postgres::Config) -> String {
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        #[cfg(unix)]
        Some(Host::Unix(path)) => path.display().to_string(),
        None => "127.0.0.1".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let mut user = encode(config.get_user().unwrap_or("postgres").as_bytes());
    if let Some(password) = config.get_password() {
        user = format!("{user}:{}", encode(password));
    }
    let db = encode(config.get_dbname().unwrap_or("postgres").as_bytes());
    if host.starts_with('/') {
        format!(
            "postgres://{user}@/{db}?host={}&port={port}",
            encode(host.as_bytes())
        )
    } else {
        format!("postgres://{user}@{host}:{port}/{db}")
    }
}

/// Percent-encodes everything but unreserved URL characters.
fn encode(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// For every stream in `wh_events`: the numbers of its events in event-id order — what
/// [`Numbers`] must hold for it once the queue is empty.
pub async fn expected_folds(
    client: &tokio_postgres::Client,
) -> anyhow::Result<BTreeMap<Uuid, Vec<i64>>> {
    let rows = client
        .query(
            "SELECT stream_id, (payload->>'n')::bigint FROM wh_events ORDER BY stream_id, event_id",
            &[],
        )
        .await?;
    let mut folds: BTreeMap<Uuid, Vec<i64>> = BTreeMap::new();
    for row in rows {
        folds
            .entry(row.try_get(0)?)
            .or_default()
            .push(row.try_get(1)?);
    }
    Ok(folds)
}

/// Every stored state of `perspective`, by stream.
pub async fn perspective_states(
    client: &tokio_postgres::Client,
    perspective: &str,
) -> anyhow::Result<BTreeMap<Uuid, Vec<i64>>> {
    let rows = client
        .query(
            "SELECT stream_id, state FROM wh_perspective_states WHERE perspective_name = $1",
            &[&perspective],
        )
        .await?;
    let mut states = BTreeMap::new();
    for row in rows {
        let state: serde_json::Value = row.try_get(1)?;
        states.insert(row.try_get(0)?, serde_json::from_value(state)?);
    }
    Ok(states)
}

/// Whether the queue is drained: no work row and no rewind request left.
pub async fn queue_is_empty(client: &tokio_postgres::Client) -> anyhow::Result<bool> {
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM wh_perspective_events)
                  + (SELECT count(*) FROM wh_perspective_cursors
                      WHERE rewind_trigger_event_id IS NOT NULL)",
            &[],
        )
        .await?;
    Ok(row.try_get::<_, i64>(0)? == 0)
}
