//! The domain: a bank account as an event-sourced aggregate, and its command handlers. Written
//! against `lockstep-core` only — generic over the unit of work, the aggregate write lock and
//! the event store — so the same handlers run on PostgreSQL and on the testkit fakes.
//!
//! Every command is one unit of work: take the account's write lock
//! (`relay:aggregate:Account:{id}`), load, decide, append with the expected version (the
//! optimistic check stays on), commit. Writers of one account queue on the lock instead of
//! racing; a retryable failure (a deadlock, a lost connection) runs the whole unit again.

use lockstep_core::{
    AggregateWriteLock, Error, EventStore, ExpectedVersion, NewEvent, RecordedEvent, RetryPolicy,
    Retryable, StreamId, Transaction, TransactionSource, tokio_sleep,
};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The aggregate type the write lock is keyed by.
pub const ACCOUNT: &str = "Account";

/// What happened to an account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AccountEvent {
    /// Money paid in.
    Deposited {
        /// Cents.
        amount: u64,
    },
    /// Money taken out.
    Withdrawn {
        /// Cents.
        amount: u64,
    },
}

impl AccountEvent {
    fn event_type(&self) -> &'static str {
        match self {
            AccountEvent::Deposited { .. } => "Deposited",
            AccountEvent::Withdrawn { .. } => "Withdrawn",
        }
    }

    fn to_new_event(self) -> Result<NewEvent, AccountError> {
        let payload =
            serde_json::to_value(self).map_err(|e| AccountError::Corrupt(e.to_string()))?;
        Ok(NewEvent::new(self.event_type(), payload)?)
    }
}

/// An account's state: its balance and the version it was loaded at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Account {
    /// Cents.
    pub balance: u64,
    /// Events applied (the stream's version).
    pub version: u64,
}

impl Account {
    /// Folds a stream's events.
    pub fn from_events(events: &[RecordedEvent]) -> Result<Account, AccountError> {
        let mut account = Account::default();
        for recorded in events {
            let event: AccountEvent = serde_json::from_value(recorded.payload.clone())
                .map_err(|e| AccountError::Corrupt(format!("event {}: {e}", recorded.event_id)))?;
            account.apply(event)?;
        }
        Ok(account)
    }

    fn apply(&mut self, event: AccountEvent) -> Result<(), AccountError> {
        self.balance = match event {
            AccountEvent::Deposited { amount } => self.balance.checked_add(amount),
            AccountEvent::Withdrawn { amount } => self.balance.checked_sub(amount),
        }
        .ok_or_else(|| AccountError::Corrupt("the stored events overflow the balance".into()))?;
        self.version += 1;
        Ok(())
    }

    /// The event a command produces, or why it is refused.
    fn decide(&self, command: Command) -> Result<AccountEvent, AccountError> {
        match command {
            Command::Deposit { amount: 0 } | Command::Withdraw { amount: 0 } => {
                Err(AccountError::ZeroAmount)
            }
            Command::Deposit { amount } => {
                self.balance
                    .checked_add(amount)
                    .ok_or(AccountError::TooLarge)?;
                Ok(AccountEvent::Deposited { amount })
            }
            Command::Withdraw { amount } if amount > self.balance => {
                Err(AccountError::InsufficientFunds {
                    balance: self.balance,
                    requested: amount,
                })
            }
            Command::Withdraw { amount } => Ok(AccountEvent::Withdrawn { amount }),
        }
    }
}

/// A command on one account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Command {
    /// Pay `amount` cents in.
    Deposit {
        /// Cents.
        amount: u64,
    },
    /// Take `amount` cents out, if the balance covers it.
    Withdraw {
        /// Cents.
        amount: u64,
    },
}

/// Why a command was not carried out.
#[derive(Debug, thiserror::Error)]
pub enum AccountError {
    /// The balance does not cover the withdrawal (a business answer: nothing was written).
    #[error("insufficient funds: balance {balance}, requested {requested}")]
    InsufficientFunds {
        /// Cents available.
        balance: u64,
        /// Cents asked for.
        requested: u64,
    },
    /// An amount of zero.
    #[error("the amount must be at least 1 cent")]
    ZeroAmount,
    /// The balance would overflow.
    #[error("the deposit would overflow the balance")]
    TooLarge,
    /// A stored event that does not read back as an account event.
    #[error("the account's events do not read back: {0}")]
    Corrupt(String),
    /// The store, the lock or the transaction failed.
    #[error(transparent)]
    Store(#[from] Error),
}

impl Retryable for AccountError {
    fn is_retryable(&self) -> bool {
        matches!(self, AccountError::Store(e) if e.is_retryable())
    }
}

/// The result of a command that was committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Receipt {
    /// The balance after the command.
    pub balance: u64,
    /// The stream version of the command's event.
    pub version: u64,
    /// Attempts it took (1 = no retry).
    pub attempts: u32,
    /// The id of the command's event: wait for a read model to have applied it to read this
    /// write there (`GET /statements/daily?after={event_id}`).
    pub event_id: Uuid,
}

/// The command handlers over a lock and a store (generic: the composition root picks them).
#[derive(Debug, Clone)]
pub struct Accounts<L, E> {
    lock: L,
    store: E,
    retry: RetryPolicy,
}

impl<L, E> Accounts<L, E> {
    /// Handlers over `lock` and `store`, retrying retryable failures with `retry`.
    pub fn new(lock: L, store: E, retry: RetryPolicy) -> Self {
        Accounts { lock, store, retry }
    }

    /// Runs `command` on `account` as whole units of work, retried under the retry policy
    /// ([`TransactionSource::transaction_with_retry`]): lock, load, decide, append, commit.
    pub async fn execute<S>(
        &self,
        source: &S,
        account: Uuid,
        command: Command,
    ) -> Result<Receipt, AccountError>
    where
        S: TransactionSource,
        L: AggregateWriteLock<S::Tx>,
        E: EventStore<S::Tx>,
    {
        let stream = StreamId::from_uuid(account);
        source
            .transaction_with_retry(&self.retry, tokio_sleep, |tx, attempt| {
                Box::pin(async move {
                    self.lock.acquire(&*tx, ACCOUNT, account).await?;
                    let history = self.store.load(&*tx, stream).await?;
                    let mut state = Account::from_events(&history)?;
                    let event = state.decide(command)?;
                    let expected = ExpectedVersion::Exact(state.version);
                    let new_event = event.to_new_event()?;
                    let event_id = new_event.event_id();
                    let version = self
                        .store
                        .append(&*tx, stream, expected, &[new_event])
                        .await?;
                    state.apply(event)?;
                    Ok(Receipt {
                        balance: state.balance,
                        version,
                        attempts: attempt,
                        event_id,
                    })
                })
            })
            .await
    }

    /// The committed state of `account` (a read-only transaction, rolled back).
    pub async fn balance<S>(&self, source: &S, account: Uuid) -> Result<Account, AccountError>
    where
        S: TransactionSource,
        E: EventStore<S::Tx>,
    {
        let tx = source.begin().await?;
        let events = self.store.load(&tx, StreamId::from_uuid(account)).await?;
        tx.rollback().await?;
        Account::from_events(&events)
    }
}
