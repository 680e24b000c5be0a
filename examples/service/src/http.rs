//! The HTTP surface (axum): a handler per route, each running one command handler of
//! [`crate::account`] in a unit of work. axum runs every request on a spawned task, so these are
//! exactly the calls the unit of work must compile for.
//!
//! - `POST /accounts/{id}/commands` with `{"type": "deposit" | "withdraw", "amount": cents}`:
//!   `200` with a [`Receipt`], `409` for insufficient funds, `422` for a zero or overflowing
//!   amount, `503` (retry later) when the database is unavailable, `500` otherwise.
//! - `GET /accounts/{id}`: `200` with the [`Account`] (an unknown account has balance 0).
//!
//! The handlers are generic over the stack; [`crate::wiring`] instantiates them with concrete
//! types, in code that is not generic itself, so axum checks their futures `Send` for the
//! concrete types as it would in an application.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lockstep_core::{SnapshotStore, TransactionSource};
use uuid::Uuid;

use crate::account::{Account, AccountError, Accounts, Command, Receipt};

/// What every handler shares: the transaction source and the command handlers.
#[derive(Debug)]
pub struct App<S: TransactionSource, E> {
    /// Where units of work come from (for reads; the command handlers hold their own).
    pub source: S,
    /// The command handlers.
    pub accounts: Accounts<S, E>,
}

/// `POST /accounts/{id}/commands`.
pub async fn execute<S, E>(
    State(app): State<Arc<App<S, E>>>,
    Path(account): Path<Uuid>,
    Json(command): Json<Command>,
) -> Result<Json<Receipt>, ApiError>
where
    S: TransactionSource + 'static,
    E: SnapshotStore<S::Tx> + Clone + 'static,
{
    Ok(Json(app.accounts.execute(account, command).await?))
}

/// `GET /accounts/{id}`.
pub async fn balance<S, E>(
    State(app): State<Arc<App<S, E>>>,
    Path(account): Path<Uuid>,
) -> Result<Json<Account>, ApiError>
where
    S: TransactionSource + 'static,
    E: SnapshotStore<S::Tx> + Clone + 'static,
{
    Ok(Json(app.accounts.balance(&app.source, account).await?))
}

/// A command's failure as an HTTP answer: the status says who should act, the body says why.
#[derive(Debug)]
pub struct ApiError(AccountError);

impl From<AccountError> for ApiError {
    fn from(err: AccountError) -> Self {
        ApiError(err)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self.0 {
            AccountError::InsufficientFunds { .. } => StatusCode::CONFLICT,
            AccountError::ZeroAmount | AccountError::TooLarge => StatusCode::UNPROCESSABLE_ENTITY,
            // Retryable store errors outlived the retry policy: the client may try again.
            AccountError::Store(e) if e.is_retryable() => StatusCode::SERVICE_UNAVAILABLE,
            AccountError::Store(_) | AccountError::Corrupt(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let body = serde_json::json!({ "error": self.0.to_string() });
        (status, Json(body)).into_response()
    }
}
