//! The daily statement on sqlx: a read model in the application's own tables (`account_daily`
//! and the view `daily_totals`, the tokio-postgres sample's [`SCHEMA`]), kept by a perspective
//! worker that runs beside the HTTP service.
//!
//! [`DailyStatement`] is a table perspective on [`SqlxTransaction`], written once, with sqlx:
//! for each account event it adds the amount to the account's row for the event's day (UTC),
//! with `sqlx::query` on the worker's transaction ([`SqlxTransaction::connection`]), so the row
//! commits with the worker's cursor. A rewind deletes the account's rows and replays its
//! events.
//!
//! `GET /statements/daily?after={event_id}` answers the totals per day over all accounts, after
//! waiting (at most [`WAIT`]) until the statement has applied every event up to `event_id` — the
//! `event_id` of a command's receipt — so a client reads its own write.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Query, State};
use lockstep::postgres::PgPerspectiveStore;
use lockstep::postgres::sqlx::{SqlxDatabase, SqlxTransaction, map_sqlx_error};
use lockstep::worker::ReadModels;
use lockstep::{PerspectiveName, RecordedEvent, StreamId, TablePerspective};
use lockstep_example_service::account::AccountEvent;
pub use lockstep_example_service::statement::{
    After, DAILY_STATEMENT, DayTotal, SCHEMA, StatementApiError, WAIT,
};
use sqlx::PgPool;

const ADD: &str = "INSERT INTO account_daily (account, day, deposited, withdrawn, events)
     VALUES ($1, $2, $3, $4, 1)
     ON CONFLICT (account, day) DO UPDATE
     SET deposited = account_daily.deposited + EXCLUDED.deposited,
         withdrawn = account_daily.withdrawn + EXCLUDED.withdrawn,
         events = account_daily.events + 1";

const RESET: &str = "DELETE FROM account_daily WHERE account = $1";

const TOTALS: &str =
    "SELECT day::text, deposited, withdrawn, events FROM daily_totals ORDER BY day";

/// The table perspective; see the [module docs](self).
#[derive(Debug, Clone, Copy, Default)]
pub struct DailyStatement;

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
    Sqlx(#[from] sqlx::Error),
    /// The worker's transaction has ended.
    #[error(transparent)]
    Store(#[from] lockstep::Error),
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

impl TablePerspective<SqlxTransaction> for DailyStatement {
    type Error = StatementError;

    fn name(&self) -> &str {
        DAILY_STATEMENT
    }

    async fn apply(
        &self,
        tx: &SqlxTransaction,
        event: &RecordedEvent,
    ) -> Result<(), StatementError> {
        let (deposited, withdrawn, day) = amounts(event)?;
        let mut conn = tx.connection().await?;
        sqlx::query(ADD)
            .bind(event.stream_id.as_uuid())
            .bind(day)
            .bind(deposited)
            .bind(withdrawn)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn reset(&self, tx: &SqlxTransaction, stream_id: StreamId) -> Result<(), StatementError> {
        let mut conn = tx.connection().await?;
        sqlx::query(RESET)
            .bind(stream_id.as_uuid())
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

/// The totals per day over all accounts, from the view.
pub async fn totals(pool: &PgPool) -> lockstep::Result<Vec<DayTotal>> {
    let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(TOTALS)
        .fetch_all(pool)
        .await
        .map_err(map_sqlx_error)?;
    Ok(rows
        .into_iter()
        .map(|(day, deposited, withdrawn, events)| DayTotal {
            day,
            deposited,
            withdrawn,
            events,
        })
        .collect())
}

/// What the statement route shares: the application's pool (the view is read from it) and
/// the reads the waits go through.
#[derive(Debug, Clone)]
pub struct Statement {
    /// The application's pool.
    pub pool: PgPool,
    /// The reads the waits go through.
    pub reads: ReadModels<SqlxDatabase, PgPerspectiveStore>,
}

/// `GET /statements/daily`.
pub async fn daily(
    State(statement): State<Arc<Statement>>,
    Query(after): Query<After>,
) -> Result<Json<Vec<DayTotal>>, StatementApiError> {
    if let Some(up_to) = after.after {
        statement
            .reads
            .wait_for_perspective(&name(), up_to, WAIT)
            .await?;
    }
    Ok(Json(totals(&statement.pool).await?))
}

fn name() -> PerspectiveName {
    match PerspectiveName::new(DAILY_STATEMENT) {
        Ok(name) => name,
        Err(e) => unreachable!("a constant, valid name: {e}"),
    }
}
