//! The daily statement: a read model in the application's own table, kept by a perspective
//! worker that runs beside the HTTP service.
//!
//! [`DailyStatement`] is a table perspective (`lockstep_core::TablePerspective`): for each
//! account event it adds the amount to the account's row for the event's day (UTC), in the
//! worker's transaction — on PostgreSQL the table `account_daily` and a view `daily_totals`
//! summing it over all accounts ([`SCHEMA`]); on the fakes a `FakeTable`. A rewind (a late
//! event, an operator's request) deletes the account's rows and replays its events: the late
//! event's day changes when the rewind commits, and no other account's rows are touched.
//!
//! `GET /statements/daily?after={event_id}` answers the totals per day over all accounts, after
//! waiting (at most [`WAIT`]) until the statement has applied every event up to `event_id` — the
//! `event_id` of a command's receipt — so a client reads its own write. The operator's routes
//! `POST /admin/statements/rebuild` and `POST /admin/statements/retire?states=keep|drop` rebuild
//! the statement from every event (after its code changed) and retire it.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lockstep_core::{
    PerspectiveName, Rebuild, RecordedEvent, RetireStates, Retired, StreamId, TablePerspective,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::PgPerspectiveStore;
use lockstep_testkit::{FakeDatabase, FakeTable, FakeTransaction, InMemoryPerspectiveStore};
use lockstep_worker::{ReadModels, WaitError, life};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::account::AccountEvent;

/// The perspective's name (its cursors and leases are keyed by it).
pub const DAILY_STATEMENT: &str = "DailyStatement";

/// How long `GET /statements/daily?after=…` waits for the statement to catch up.
pub const WAIT: Duration = Duration::from_secs(5);

/// The application's tables on PostgreSQL (idempotent: run at every start).
pub const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS account_daily (
    account uuid NOT NULL,
    day date NOT NULL,
    deposited bigint NOT NULL DEFAULT 0,
    withdrawn bigint NOT NULL DEFAULT 0,
    events bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (account, day)
);
CREATE OR REPLACE VIEW daily_totals AS
    SELECT day, sum(deposited)::bigint AS deposited, sum(withdrawn)::bigint AS withdrawn,
           sum(events)::bigint AS events
    FROM account_daily GROUP BY day;
";

/// One day's totals over all accounts, in cents.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DayTotal {
    /// `YYYY-MM-DD` (UTC).
    pub day: String,
    /// Cents paid in.
    pub deposited: i64,
    /// Cents taken out.
    pub withdrawn: i64,
    /// Events.
    pub events: i64,
}

/// The table perspective; see the [module docs](self). `rows` is the in-memory table it writes
/// on the fakes (unused on PostgreSQL).
#[derive(Debug, Clone, Default)]
pub struct DailyStatement {
    rows: FakeTable<(Uuid, time::Date), DayTotal>,
}

/// Why the statement could not apply an event.
#[derive(Debug, thiserror::Error)]
pub enum StatementError {
    /// The event is not an account event.
    #[error("not an account event: {0}")]
    Decode(#[from] serde_json::Error),
    /// An amount above what the table holds.
    #[error("the amount does not fit the table")]
    TooLarge,
    /// The database refused a statement.
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    /// The fake transaction refused a write (it was aborted or ended).
    #[error(transparent)]
    Fake(#[from] lockstep_core::Error),
}

/// The event's `(deposited, withdrawn)` cents and its day.
fn amounts(event: &RecordedEvent) -> Result<(i64, i64, time::Date), StatementError> {
    let parsed: AccountEvent = serde_json::from_value(event.payload.clone())?;
    let (deposited, withdrawn) = match parsed {
        AccountEvent::Deposited { amount } => (amount, 0),
        AccountEvent::Withdrawn { amount } => (0, amount),
    };
    let cents = |n: u64| i64::try_from(n).map_err(|_| StatementError::TooLarge);
    let day = event.recorded_at.to_offset(time::UtcOffset::UTC).date();
    Ok((cents(deposited)?, cents(withdrawn)?, day))
}

impl TablePerspective<PgTransaction> for DailyStatement {
    type Error = StatementError;

    fn name(&self) -> &str {
        DAILY_STATEMENT
    }

    async fn apply(&self, tx: &PgTransaction, event: &RecordedEvent) -> Result<(), StatementError> {
        let (deposited, withdrawn, day) = amounts(event)?;
        tx.client()
            .execute(
                "INSERT INTO account_daily (account, day, deposited, withdrawn, events)
                 VALUES ($1, $2, $3, $4, 1)
                 ON CONFLICT (account, day) DO UPDATE
                 SET deposited = account_daily.deposited + EXCLUDED.deposited,
                     withdrawn = account_daily.withdrawn + EXCLUDED.withdrawn,
                     events = account_daily.events + 1",
                &[&event.stream_id.as_uuid(), &day, &deposited, &withdrawn],
            )
            .await?;
        Ok(())
    }

    async fn reset(&self, tx: &PgTransaction, stream_id: StreamId) -> Result<(), StatementError> {
        tx.client()
            .execute(
                "DELETE FROM account_daily WHERE account = $1",
                &[&stream_id.as_uuid()],
            )
            .await?;
        Ok(())
    }
}

impl TablePerspective<FakeTransaction> for DailyStatement {
    type Error = StatementError;

    fn name(&self) -> &str {
        DAILY_STATEMENT
    }

    async fn apply(
        &self,
        tx: &FakeTransaction,
        event: &RecordedEvent,
    ) -> Result<(), StatementError> {
        let (deposited, withdrawn, day) = amounts(event)?;
        self.rows
            .update(tx, (event.stream_id.as_uuid(), day), |row| {
                let mut row = row.unwrap_or_else(|| DayTotal {
                    day: day.to_string(),
                    ..DayTotal::default()
                });
                row.deposited += deposited;
                row.withdrawn += withdrawn;
                row.events += 1;
                Some(row)
            })?;
        Ok(())
    }

    async fn reset(&self, tx: &FakeTransaction, stream_id: StreamId) -> Result<(), StatementError> {
        let account = stream_id.as_uuid();
        self.rows.delete_where(tx, |(a, _), _| *a == account)?;
        Ok(())
    }
}

impl DailyStatement {
    /// The totals per day over all accounts, from the in-memory table (the fakes' view).
    pub fn totals_in_memory(&self) -> Vec<DayTotal> {
        let mut days: std::collections::BTreeMap<time::Date, DayTotal> = Default::default();
        for ((_, day), row) in self.rows.rows() {
            let total = days.entry(day).or_insert_with(|| DayTotal {
                day: day.to_string(),
                ..DayTotal::default()
            });
            total.deposited += row.deposited;
            total.withdrawn += row.withdrawn;
            total.events += row.events;
        }
        days.into_values().collect()
    }
}

/// The totals per day over all accounts, from the view on PostgreSQL.
pub async fn totals_on_postgres(db: &PgDatabase) -> lockstep_core::Result<Vec<DayTotal>> {
    let client = db.pool().get().await.map_err(|e| {
        lockstep_core::Error::new(lockstep_core::ErrorKind::ConnectionLost, "no connection")
            .with_source(e)
    })?;
    let rows = client
        .query(
            "SELECT day::text, deposited, withdrawn, events FROM daily_totals ORDER BY day",
            &[],
        )
        .await
        .map_err(|e| {
            lockstep_core::Error::new(lockstep_core::ErrorKind::Backend, "reading daily_totals")
                .with_source(e)
        })?;
    Ok(rows
        .iter()
        .map(|r| DayTotal {
            day: r.get(0),
            deposited: r.get(1),
            withdrawn: r.get(2),
            events: r.get(3),
        })
        .collect())
}

/// `?after={event_id}`: wait for that event first.
#[derive(Debug, Deserialize)]
pub struct After {
    /// The last event id of the caller's own write.
    pub after: Option<Uuid>,
}

/// What the statement routes share on PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgStatement {
    /// The database the view is read from.
    pub db: PgDatabase,
    /// The reads the waits go through.
    pub reads: ReadModels<PgDatabase, PgPerspectiveStore>,
}

/// What the statement routes share on the fakes.
#[derive(Debug, Clone)]
pub struct InMemoryStatement {
    /// The perspective (its in-memory table).
    pub statement: DailyStatement,
    /// The fake database (for the operator's routes).
    pub db: FakeDatabase,
    /// The perspective store (for the operator's routes).
    pub store: InMemoryPerspectiveStore,
    /// The reads the waits go through.
    pub reads: ReadModels<FakeDatabase, InMemoryPerspectiveStore>,
}

/// `?states=keep|drop` of `POST /admin/statements/retire`.
#[derive(Debug, Deserialize)]
pub struct States {
    /// `keep` (the default) or `drop`.
    pub states: Option<String>,
}

fn retire_states(states: &States) -> Result<RetireStates, StatementApiError> {
    match states.states.as_deref() {
        None | Some("keep") => Ok(RetireStates::Keep),
        Some("drop") => Ok(RetireStates::Drop),
        Some(other) => Err(StatementApiError::BadInput(format!(
            "states must be keep or drop, not {other:?}"
        ))),
    }
}

fn rebuilt(outcome: Rebuild) -> Result<Json<serde_json::Value>, StatementApiError> {
    match outcome {
        Rebuild::Requested { pairs } => Ok(Json(serde_json::json!({ "requested": pairs }))),
        _ => Err(StatementApiError::NotRegistered),
    }
}

fn retired(outcome: Retired) -> Result<Json<serde_json::Value>, StatementApiError> {
    match outcome {
        Retired::Retired {
            work_removed,
            pairs,
        } => Ok(Json(
            serde_json::json!({ "retired": true, "work_removed": work_removed, "pairs": pairs }),
        )),
        _ => Err(StatementApiError::NotRegistered),
    }
}

/// `POST /admin/statements/rebuild` on PostgreSQL: every account's statement rows are rebuilt
/// from its events (after the perspective's code changed), pair by pair by the workers of every
/// instance; the old rows are served until each account's rebuild commits. An operator's route:
/// an application puts it behind its own authentication.
pub async fn rebuild_on_postgres(
    State(statement): State<Arc<PgStatement>>,
) -> Result<Json<serde_json::Value>, StatementApiError> {
    rebuilt(life::rebuild(&statement.db, &PgPerspectiveStore::new(), &name()).await?)
}

/// `POST /admin/statements/retire?states=keep|drop` on PostgreSQL: appends stop queueing work
/// for the statement (deploy the service without it first: a worker starting with it registers
/// it again). Its rows in `account_daily` are the application's: retiring leaves them.
pub async fn retire_on_postgres(
    State(statement): State<Arc<PgStatement>>,
    Query(states): Query<States>,
) -> Result<Json<serde_json::Value>, StatementApiError> {
    let states = retire_states(&states)?;
    retired(life::retire(&statement.db, &PgPerspectiveStore::new(), &name(), states).await?)
}

/// `POST /admin/statements/rebuild` on the fakes.
pub async fn rebuild_in_memory(
    State(statement): State<Arc<InMemoryStatement>>,
) -> Result<Json<serde_json::Value>, StatementApiError> {
    rebuilt(life::rebuild(&statement.db, &statement.store, &name()).await?)
}

/// `POST /admin/statements/retire?states=keep|drop` on the fakes.
pub async fn retire_in_memory(
    State(statement): State<Arc<InMemoryStatement>>,
    Query(states): Query<States>,
) -> Result<Json<serde_json::Value>, StatementApiError> {
    let states = retire_states(&states)?;
    retired(life::retire(&statement.db, &statement.store, &name(), states).await?)
}

fn name() -> PerspectiveName {
    match PerspectiveName::new(DAILY_STATEMENT) {
        Ok(name) => name,
        Err(e) => unreachable!("a constant, valid name: {e}"),
    }
}

/// `GET /statements/daily` on PostgreSQL.
pub async fn daily_on_postgres(
    State(statement): State<Arc<PgStatement>>,
    Query(after): Query<After>,
) -> Result<Json<Vec<DayTotal>>, StatementApiError> {
    if let Some(up_to) = after.after {
        statement
            .reads
            .wait_for_perspective(&name(), up_to, WAIT)
            .await?;
    }
    Ok(Json(totals_on_postgres(&statement.db).await?))
}

/// `GET /statements/daily` on the fakes.
pub async fn daily_in_memory(
    State(statement): State<Arc<InMemoryStatement>>,
    Query(after): Query<After>,
) -> Result<Json<Vec<DayTotal>>, StatementApiError> {
    if let Some(up_to) = after.after {
        statement
            .reads
            .wait_for_perspective(&name(), up_to, WAIT)
            .await?;
    }
    Ok(Json(statement.statement.totals_in_memory()))
}

/// A statement read's failure as an HTTP answer.
#[derive(Debug)]
pub enum StatementApiError {
    /// The wait ended without the write applied (boxed: it carries what was pending).
    Wait(Box<WaitError>),
    /// Reading failed.
    Store(lockstep_core::Error),
    /// A query parameter was wrong.
    BadInput(String),
    /// The statement is not registered (retired already).
    NotRegistered,
}

impl From<WaitError> for StatementApiError {
    fn from(err: WaitError) -> Self {
        StatementApiError::Wait(Box::new(err))
    }
}

impl From<lockstep_core::Error> for StatementApiError {
    fn from(err: lockstep_core::Error) -> Self {
        StatementApiError::Store(err)
    }
}

impl IntoResponse for StatementApiError {
    fn into_response(self) -> Response {
        let (status, text) = match &self {
            // Not caught up yet: the client may ask again.
            StatementApiError::Wait(e) if matches!(**e, WaitError::TimedOut { .. }) => {
                (StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
            StatementApiError::Wait(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            StatementApiError::Store(e) if e.is_retryable() => {
                (StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
            StatementApiError::Store(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            StatementApiError::BadInput(e) => (StatusCode::UNPROCESSABLE_ENTITY, e.clone()),
            StatementApiError::NotRegistered => (
                StatusCode::CONFLICT,
                format!("{DAILY_STATEMENT} is not registered (retired)"),
            ),
        };
        (status, Json(serde_json::json!({ "error": text }))).into_response()
    }
}
