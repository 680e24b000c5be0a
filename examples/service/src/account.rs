//! The domain: a bank account as an event-sourced aggregate, and its command handlers. Written
//! against `lockstep-core` only — generic over the unit of work, the aggregate write lock and
//! the event store — so the same handlers run on PostgreSQL and on the testkit fakes.
//!
//! Every command is one unit of work, run by `lockstep-command`'s runner in its locked mode: take
//! the account's write lock (`relay:aggregate:Account:{id}`), load, decide, append with the
//! expected version (the optimistic check stays on), commit. Writers of one account queue on the
//! lock instead of racing; a retryable failure (a deadlock, a lost connection) runs the whole
//! unit again.

use lockstep_command::{CommandError, CommandRunner, Mode, RunnerOptions};
use lockstep_core::{
    AggregateType, Decider, Error, ErrorKind, NewEvent, RecordedEvent, RetryPolicy, Retryable,
    SnapshotPolicy, SnapshotStore, StreamId, Transaction, TransactionSource,
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
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

/// The account as a [`Decider`]: `decide` is [`Account`]'s, `evolve` applies an event, and the
/// events are stored as their JSON.
#[derive(Debug, Clone)]
pub struct AccountDecider {
    ty: AggregateType,
}

impl Default for AccountDecider {
    fn default() -> Self {
        AccountDecider {
            // ACCOUNT is a valid aggregate type (not blank, no ':').
            ty: AggregateType::new(ACCOUNT).unwrap_or_else(|e| unreachable!("{e}")),
        }
    }
}

impl Decider for AccountDecider {
    type State = Account;
    type Command = Command;
    type Event = AccountEvent;
    type Error = AccountError;

    fn aggregate_type(&self) -> &AggregateType {
        &self.ty
    }

    fn initial_state(&self, _id: Uuid) -> Account {
        Account::default()
    }

    async fn decide(
        &self,
        account: &Account,
        command: &Command,
    ) -> Result<Vec<AccountEvent>, AccountError> {
        Ok(vec![account.decide(*command)?])
    }

    fn evolve(&self, mut account: Account, event: &AccountEvent) -> Account {
        // `decide` refused every event that would overflow the balance, and `fold` (below)
        // checks stored ones, so this cannot fail; a failure would leave the account as it was.
        let _ = account.apply(*event);
        account
    }

    fn encode(&self, event: &AccountEvent) -> lockstep_core::Result<NewEvent> {
        event.to_new_event().map_err(|e| match e {
            AccountError::Store(e) => e,
            other => Error::new(ErrorKind::InvalidInput, other.to_string()),
        })
    }

    fn decode(&self, event: &RecordedEvent) -> lockstep_core::Result<AccountEvent> {
        serde_json::from_value(event.payload.clone()).map_err(|e| {
            Error::new(
                ErrorKind::Backend,
                format!("event {} is not an account event: {e}", event.event_id),
            )
        })
    }

    /// A hot account (the house) grows by thousands of events: its state is saved every 100,
    /// and a command folds at most the hundred after the latest snapshot.
    fn snapshots(&self) -> Option<SnapshotPolicy<Account>> {
        Some(SnapshotPolicy::json(100))
    }

    fn fold(&self, _id: Uuid, events: &[RecordedEvent]) -> lockstep_core::Result<Account> {
        Account::from_events(events).map_err(|e| match e {
            AccountError::Store(e) => e,
            other => Error::new(ErrorKind::Backend, other.to_string()),
        })
    }
}

/// The command handlers: a [`CommandRunner`] of the account, under the account's write lock
/// ([`Mode::Locked`]: `relay:aggregate:Account:{id}` first, then the load; switching the
/// aggregate to another mode is this one value), and the store for reads.
#[derive(Debug, Clone)]
pub struct Accounts<S: TransactionSource, E> {
    runner: CommandRunner<S, E, AccountDecider>,
    store: E,
}

impl<S, E> Accounts<S, E>
where
    S: TransactionSource + 'static,
    E: SnapshotStore<S::Tx> + Clone + 'static,
{
    /// Handlers on `source` and `store`, retrying retryable failures with `retry`.
    pub fn new(source: S, store: E, retry: RetryPolicy) -> Self {
        let options = RunnerOptions::new(Mode::Locked).retry(retry);
        Accounts {
            runner: CommandRunner::with_options(
                source,
                store.clone(),
                AccountDecider::default(),
                options,
            ),
            store,
        }
    }

    /// Runs `command` on `account` as whole units of work, retried under the retry policy:
    /// lock, load, decide, append, commit.
    pub async fn execute(&self, account: Uuid, command: Command) -> Result<Receipt, AccountError> {
        match self.runner.handle(account, command).await {
            Ok(done) => Ok(Receipt {
                balance: done.state().balance,
                version: done.version(),
                attempts: done.attempts(),
                // A command decides exactly one event.
                event_id: done.event_ids().first().copied().unwrap_or_default(),
            }),
            Err(CommandError::Rejected(refused)) => Err(refused),
            Err(CommandError::Failed(e)) => Err(AccountError::Store(e)),
            Err(CommandError::CommitUnknown { error, .. }) => Err(AccountError::Store(*error)),
            Err(other) => Err(AccountError::Store(Error::new(
                other.kind().unwrap_or(ErrorKind::Backend),
                other.to_string(),
            ))),
        }
    }

    /// The committed state of `account` (a read-only transaction, rolled back).
    pub async fn balance(&self, source: &S, account: Uuid) -> Result<Account, AccountError> {
        let tx = source.begin().await?;
        let events = self.store.load(&tx, StreamId::from_uuid(account)).await?;
        tx.rollback().await?;
        Account::from_events(&events)
    }
}
