//! Commands on accounts: `POST /accounts/{id}/commands` with `{"type": "deposit" | "withdraw",
//! "amount": cents}`, each a unit of work on an `SqlxTransaction` under the account's write lock
//! (`relay:aggregate:Account:{id}`), answered as the tokio-postgres sample answers (a
//! [`Receipt`]; `409` insufficient funds, `422` a bad amount, `503` retry later).
//!
//! Without an `Idempotency-Key` header the domain's own handler runs the command
//! ([`Accounts::execute`]). With one, the command and the application's own row commit
//! together, in one unit of work retried as a whole:
//!
//! 1. the key's row in `idempotency_keys` is read: a key stored for the same request answers
//!    its stored receipt with `Idempotent-Replayed: true` and runs nothing; a key stored for
//!    another request is refused (`422`);
//! 2. the command runs on the transaction (`CommandRunner::handle_in`: the write lock, the
//!    load, decide, append — not committed);
//! 3. the key's row is inserted with `sqlx::query` on the transaction's connection
//!    ([`SqlxTransaction::connection`]), holding the receipt;
//! 4. one commit: the events and the key's row, or neither.
//!
//! A request that lost the race for its key (another request with the same key committed
//! first) fails at step 3 with a unique violation, after its append: its transaction rolls
//! back, its events with it, and the unit of work runs again and finds the stored key. A
//! refused command rolls back too and leaves its key unused. A request whose `COMMIT` reply was
//! lost (`500`: the command may or may not have committed) is safe to send again with its key:
//! it runs once, or answers what was committed.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use lockstep::command::{CommandError, CommandRunner, Mode, RunnerOptions};
use lockstep::postgres::PgEventStore;
use lockstep::postgres::sqlx::{SqlxDatabase, SqlxTransaction, map_sqlx_error};
use lockstep::{Error, ErrorKind, RetryPolicy, Retryable, TransactionSource as _, tokio_sleep};
use lockstep_example_service::account::{AccountDecider, AccountError, Accounts, Command, Receipt};
use lockstep_example_service::http::ApiError;
use sqlx::Row as _;
use uuid::Uuid;

/// The request header naming an idempotency key (at most [`MAX_KEY_LEN`] visible ASCII
/// characters, chosen by the client, one per request it may send again).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header set (`true`) on a stored receipt answered again.
pub const REPLAYED: &str = "idempotent-replayed";

/// The longest idempotency key accepted.
pub const MAX_KEY_LEN: usize = 255;

/// The application's own table of idempotency keys (idempotent: run at every start).
pub const KEYS_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key text PRIMARY KEY,
    account uuid NOT NULL,
    command text NOT NULL,
    amount bigint NOT NULL,
    event_id uuid NOT NULL,
    version bigint NOT NULL,
    balance bigint NOT NULL,
    stored_at timestamptz NOT NULL DEFAULT now()
);
";

const STORED: &str = "SELECT account, command, amount, event_id, version, balance \
     FROM idempotency_keys WHERE key = $1";

const STORE: &str = "INSERT INTO idempotency_keys \
     (key, account, command, amount, event_id, version, balance) \
     VALUES ($1, $2, $3, $4, $5, $6, $7)";

/// The command handlers on sqlx: the domain's [`Accounts`], and a runner of the domain's
/// decider for commands that write the application's own row in their unit of work. Both
/// under the account's write lock, from one [`SqlxDatabase`] (one lock queue).
#[derive(Debug, Clone)]
pub struct Commands {
    db: SqlxDatabase,
    accounts: Accounts<SqlxDatabase, PgEventStore>,
    runner: CommandRunner<SqlxDatabase, PgEventStore, AccountDecider>,
    retry: RetryPolicy,
}

/// A keyed command's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keyed {
    /// The command's receipt (`attempts` counts this request's units of work).
    pub receipt: Receipt,
    /// `true` when the key was stored already: the receipt is the one stored with it, and
    /// nothing ran.
    pub replayed: bool,
}

/// Why a keyed command was not carried out.
#[derive(Debug, thiserror::Error)]
pub enum KeyedError {
    /// The command was refused or failed, as the domain reports it.
    #[error(transparent)]
    Account(#[from] AccountError),
    /// The key is stored for another request (another account, command or amount).
    #[error("idempotency key {0:?} was used for another request")]
    Reused(String),
}

impl From<Error> for KeyedError {
    fn from(err: Error) -> Self {
        KeyedError::Account(AccountError::Store(err))
    }
}

impl Retryable for KeyedError {
    fn is_retryable(&self) -> bool {
        matches!(self, KeyedError::Account(e) if e.is_retryable())
    }
}

impl Commands {
    /// The handlers on `db`, retrying retryable failures (a lost race for a key included)
    /// under `retry`.
    pub fn new(db: &SqlxDatabase, retry: RetryPolicy) -> Commands {
        let store = PgEventStore::for_sqlx(db);
        let options = RunnerOptions::new(Mode::Locked).retry(retry);
        Commands {
            db: db.clone(),
            accounts: Accounts::new(db.clone(), store.clone(), retry),
            runner: CommandRunner::with_options(
                db.clone(),
                store,
                AccountDecider::default(),
                options,
            ),
            retry,
        }
    }

    /// The domain's handlers.
    pub fn accounts(&self) -> &Accounts<SqlxDatabase, PgEventStore> {
        &self.accounts
    }

    /// Runs `command` on `account` unless `key` is stored already, committing the key's row
    /// with the command's events (see the [module docs](self)).
    pub async fn execute_once(
        &self,
        key: &str,
        account: Uuid,
        command: Command,
    ) -> Result<Keyed, KeyedError> {
        self.db
            .transaction_with_retry(&self.retry, tokio_sleep, |tx, attempt| {
                Box::pin(async move { self.attempt(&tx, key, account, command, attempt).await })
            })
            .await
    }

    /// One unit of work of [`Commands::execute_once`], on `tx` (committed by the caller).
    async fn attempt(
        &self,
        tx: &SqlxTransaction,
        key: &str,
        account: Uuid,
        command: Command,
        attempt: u32,
    ) -> Result<Keyed, KeyedError> {
        let request = Request::of(account, command)?;
        if let Some((stored, receipt)) = stored(tx, key, attempt).await? {
            if stored != request {
                return Err(KeyedError::Reused(key.to_owned()));
            }
            return Ok(Keyed {
                receipt,
                replayed: true,
            });
        }
        let done = self
            .runner
            .handle_in(tx, account, &command)
            .await
            .map_err(account_error)?;
        let receipt = Receipt {
            balance: done.state().balance,
            version: done.version(),
            attempts: attempt,
            // A command decides exactly one event.
            event_id: done.event_ids().first().copied().unwrap_or_default(),
        };
        let mut conn = tx.connection().await?;
        sqlx::query(STORE)
            .bind(key)
            .bind(account)
            .bind(&request.command)
            .bind(request.amount)
            .bind(receipt.event_id)
            .bind(to_i64(receipt.version)?)
            .bind(to_i64(receipt.balance)?)
            .execute(&mut *conn)
            .await
            // A unique violation (the key was stored since step 1) is a retryable conflict.
            .map_err(map_sqlx_error)?;
        Ok(Keyed {
            receipt,
            replayed: false,
        })
    }
}

/// What a key is stored for: the account, the command and its amount.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Request {
    account: Uuid,
    command: String,
    amount: i64,
}

impl Request {
    fn of(account: Uuid, command: Command) -> Result<Request, Error> {
        let (command, amount) = match command {
            Command::Deposit { amount } => ("deposit", amount),
            Command::Withdraw { amount } => ("withdraw", amount),
        };
        Ok(Request {
            account,
            command: command.to_owned(),
            amount: to_i64(amount)?,
        })
    }
}

/// The request and receipt stored under `key`, if any (`attempts` set to `attempt`).
async fn stored(
    tx: &SqlxTransaction,
    key: &str,
    attempt: u32,
) -> Result<Option<(Request, Receipt)>, Error> {
    let mut conn = tx.connection().await?;
    let Some(row) = sqlx::query(STORED)
        .bind(key)
        .fetch_optional(&mut *conn)
        .await
        .map_err(map_sqlx_error)?
    else {
        return Ok(None);
    };
    let request = Request {
        account: row.try_get("account").map_err(map_sqlx_error)?,
        command: row.try_get("command").map_err(map_sqlx_error)?,
        amount: row.try_get("amount").map_err(map_sqlx_error)?,
    };
    let receipt = Receipt {
        balance: to_u64(row.try_get("balance").map_err(map_sqlx_error)?)?,
        version: to_u64(row.try_get("version").map_err(map_sqlx_error)?)?,
        attempts: attempt,
        event_id: row.try_get("event_id").map_err(map_sqlx_error)?,
    };
    Ok(Some((request, receipt)))
}

fn to_i64(n: u64) -> Result<i64, Error> {
    i64::try_from(n).map_err(|_| Error::new(ErrorKind::InvalidInput, format!("{n} is too large")))
}

fn to_u64(n: i64) -> Result<u64, Error> {
    u64::try_from(n).map_err(|_| Error::new(ErrorKind::Backend, format!("a stored {n} below 0")))
}

/// The runner's answer as the domain's error (as [`Accounts::execute`] reports it).
fn account_error(err: CommandError<AccountError>) -> AccountError {
    match err {
        CommandError::Rejected(refused) => refused,
        CommandError::Failed(e) => AccountError::Store(e),
        CommandError::CommitUnknown { error, .. } => AccountError::Store(*error),
        other => AccountError::Store(Error::new(
            other.kind().unwrap_or(ErrorKind::Backend),
            other.to_string(),
        )),
    }
}

/// `POST /accounts/{id}/commands`, with or without an `Idempotency-Key` header.
pub async fn execute(
    State(commands): State<Arc<Commands>>,
    Path(account): Path<Uuid>,
    headers: HeaderMap,
    Json(command): Json<Command>,
) -> Response {
    let key = match idempotency_key(&headers) {
        Ok(key) => key,
        Err(why) => return unprocessable(&why),
    };
    let Some(key) = key else {
        return match commands.accounts.execute(account, command).await {
            Ok(receipt) => Json(receipt).into_response(),
            Err(e) => ApiError::from(e).into_response(),
        };
    };
    match commands.execute_once(key, account, command).await {
        Ok(Keyed { receipt, replayed }) => {
            let mut response = Json(receipt).into_response();
            if replayed {
                response
                    .headers_mut()
                    .insert(REPLAYED, HeaderValue::from_static("true"));
            }
            response
        }
        Err(KeyedError::Account(e)) => ApiError::from(e).into_response(),
        Err(reused @ KeyedError::Reused(_)) => unprocessable(&reused.to_string()),
    }
}

/// The request's idempotency key, if it has one.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<&str>, String> {
    let Some(value) = headers.get(IDEMPOTENCY_KEY) else {
        return Ok(None);
    };
    let key = value
        .to_str()
        .map_err(|_| format!("{IDEMPOTENCY_KEY} must be visible ASCII"))?;
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(format!(
            "{IDEMPOTENCY_KEY} must be 1 to {MAX_KEY_LEN} characters"
        ));
    }
    Ok(Some(key))
}

fn unprocessable(why: &str) -> Response {
    (
        StatusCode::UNPROCESSABLE_ENTITY,
        Json(serde_json::json!({ "error": why })),
    )
        .into_response()
}
