//! The `ReserveStock` command handler, written against `lockstep-core` contracts only: generic
//! over the transaction type, the [`EventStore`] and the [`AggregateWriteLock`], so the same
//! code runs on the testkit fakes and on PostgreSQL.
//!
//! Three ways to handle concurrent writers of one SKU ([`LockMode`]):
//!
//! - **Optimistic** (the default for event sourcing): load, decide, append with the expected
//!   version; a loser gets a conflict and the whole unit of work is retried with backoff.
//! - **Pessimistic**: take the SKU's write lock first, then load — writers queue instead of
//!   racing. `PessimisticPipelined` does the same through [`EventStore::load_locked`], which
//!   sends lock and load together (one round trip on Postgres).
//! - **Fail-fast**: try the lock; if another writer holds it, answer
//!   [`InventoryError::Busy`] at once.
//!
//! Whatever the mode, the expected-version check stays on and [`StockItem::reserve`] enforces
//! the invariant.

use std::sync::atomic::{AtomicU32, Ordering};

use lockstep_core::{
    AggregateType, AggregateWriteLock, ErrorKind, EventStore, ExpectedVersion, ResourceKey,
    RetryPolicy, StreamId, TransactionSource, aggregate_key, tokio_sleep,
};
use uuid::Uuid;

use crate::domain::{InventoryError, STOCK_ITEM, StockEvent, StockItem};
use lockstep_core::Transaction as _;

/// How the handler deals with concurrent writers of one SKU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    /// No lock; conflicts are retried.
    Optimistic,
    /// `AggregateWriteLock::acquire`, then load.
    Pessimistic,
    /// Lock and load in one step (`EventStore::load_locked`).
    PessimisticPipelined,
    /// `AggregateWriteLock::try_acquire`; busy is an answer.
    FailFast,
}

impl LockMode {
    /// Every mode.
    pub const ALL: [LockMode; 4] = [
        LockMode::Optimistic,
        LockMode::Pessimistic,
        LockMode::PessimisticPipelined,
        LockMode::FailFast,
    ];
}

/// Reserve `quantity` units of `sku`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveStock {
    /// The SKU (also its stream id and its lock's id).
    pub sku: Uuid,
    /// Units to reserve.
    pub quantity: u32,
    /// The reservation's id.
    pub reservation_id: Uuid,
}

/// A reservation that was committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    /// The stream version of the reservation event.
    pub version: u64,
    /// Units still available after it.
    pub available: u64,
    /// Attempts it took (1 = no retry).
    pub attempts: u32,
    /// Attempts that lost an optimistic-concurrency race (wasted appends).
    pub conflicts: u32,
}

/// The write-lock key of a stock item, `relay:aggregate:StockItem:{sku}`.
pub fn stock_item_key(sku: Uuid) -> ResourceKey {
    // STOCK_ITEM is a valid aggregate type (not blank, no ':').
    let ty = AggregateType::new(STOCK_ITEM).unwrap_or_else(|e| unreachable!("{e}"));
    aggregate_key(&ty, sku)
}

/// Handles [`ReserveStock`] in one [`LockMode`], retrying retryable failures with a
/// [`RetryPolicy`].
#[derive(Debug, Clone)]
pub struct ReserveStockHandler<L, S> {
    lock: L,
    store: S,
    mode: LockMode,
    retry: RetryPolicy,
}

impl<L, S> ReserveStockHandler<L, S> {
    /// A handler over `lock` and `store` (retries: [`RetryPolicy::default`]).
    pub fn new(lock: L, store: S, mode: LockMode) -> Self {
        ReserveStockHandler {
            lock,
            store,
            mode,
            retry: RetryPolicy::default(),
        }
    }

    /// Sets the retry policy.
    #[must_use]
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// The mode.
    pub fn mode(&self) -> LockMode {
        self.mode
    }

    /// One attempt on `tx`: (lock,) load, decide, append. Returns the new version and the
    /// units left. The caller commits or rolls back.
    pub async fn attempt<Tx>(
        &self,
        tx: &Tx,
        cmd: &ReserveStock,
    ) -> Result<(u64, u64), InventoryError>
    where
        Tx: ?Sized + Sync,
        L: AggregateWriteLock<Tx>,
        S: EventStore<Tx>,
    {
        let stream = StreamId::from_uuid(cmd.sku);
        let events = match self.mode {
            LockMode::Optimistic => self.store.load(tx, stream).await?,
            LockMode::Pessimistic => {
                // Lock first, then load: the loser loads fresh state after the winner commits.
                self.lock.acquire(tx, STOCK_ITEM, cmd.sku).await?;
                self.store.load(tx, stream).await?
            }
            LockMode::PessimisticPipelined => {
                self.store
                    .load_locked(tx, stream, &stock_item_key(cmd.sku), None)
                    .await?
            }
            LockMode::FailFast => {
                if !self.lock.try_acquire(tx, STOCK_ITEM, cmd.sku).await? {
                    return Err(InventoryError::Busy { sku: cmd.sku });
                }
                self.store.load(tx, stream).await?
            }
        };
        let mut item = StockItem::from_events(cmd.sku, &events)?;
        let event = item.reserve(cmd.quantity, cmd.reservation_id)?;
        let version = self
            .store
            .append(
                tx,
                stream,
                ExpectedVersion::Exact(item.version()),
                &[event.to_new_event()?],
            )
            .await?;
        item.apply(&event);
        Ok((version, item.available()))
    }

    /// Runs the command as whole units of work — begin, attempt, commit — on transactions from
    /// `source`, retrying retryable failures (conflicts, deadlocks, timeouts, lost connections)
    /// with the retry policy ([`TransactionSource::transaction_with_retry`], sleeping on tokio's
    /// clock). Business answers (insufficient stock, busy) are returned at once, after rolling
    /// back.
    pub async fn handle<Src>(
        &self,
        source: &Src,
        cmd: &ReserveStock,
    ) -> Result<Reserved, InventoryError>
    where
        Src: TransactionSource,
        L: AggregateWriteLock<Src::Tx>,
        S: EventStore<Src::Tx>,
    {
        let attempts = AtomicU32::new(0);
        let conflicts = AtomicU32::new(0);
        let (version, available) = source
            .transaction_with_retry(&self.retry, tokio_sleep, |tx, attempt| {
                attempts.store(attempt, Ordering::Relaxed);
                let conflicts = &conflicts;
                Box::pin(async move {
                    let outcome = self.attempt(&*tx, cmd).await;
                    if let Err(InventoryError::Store(err)) = &outcome
                        && err.kind() == ErrorKind::Conflict
                    {
                        conflicts.fetch_add(1, Ordering::Relaxed);
                    }
                    outcome
                })
            })
            .await?;
        Ok(Reserved {
            version,
            available,
            attempts: attempts.load(Ordering::Relaxed),
            conflicts: conflicts.load(Ordering::Relaxed),
        })
    }
}

/// Stocks `quantity` units of a new SKU (expects the stream not to exist).
pub async fn stock_new_item<Src, S>(
    source: &Src,
    store: &S,
    sku: Uuid,
    quantity: u32,
) -> Result<u64, InventoryError>
where
    Src: TransactionSource,
    S: EventStore<Src::Tx>,
{
    let event = StockEvent::Stocked { quantity }.to_new_event()?;
    let stream = StreamId::from_uuid(sku);
    let tx = source.begin().await?;
    let version = store
        .append(&tx, stream, ExpectedVersion::NoStream, &[event])
        .await?;
    tx.commit().await?;
    Ok(version)
}

/// The committed state of a SKU, read in its own transaction (rolled back: it writes nothing).
pub async fn load_item<Src, S>(
    source: &Src,
    store: &S,
    sku: Uuid,
) -> Result<StockItem, InventoryError>
where
    Src: TransactionSource,
    S: EventStore<Src::Tx>,
{
    let tx = source.begin().await?;
    let events = store.load(&tx, StreamId::from_uuid(sku)).await;
    // A read-only transaction: how it ends changes nothing, and a failed rollback still ends it.
    let _ = tx.rollback().await;
    StockItem::from_events(sku, &events?)
}
