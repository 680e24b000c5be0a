//! A fake distributed lock with fake transactions that behave like PostgreSQL advisory locks:
//! exclusive across transactions and sessions, re-entrant within one transaction, released when
//! the transaction commits or rolls back (or is dropped).
//!
//! [`FakeDatabase`] is the shared state (one "server"); [`FakeTransaction`]s are begun on it;
//! [`FakeDistributedLock`] and [`FakeSessionLocks`] lock on it. Other fakes that take part in a
//! unit of work (an event store) hook into the transaction's end with
//! [`FakeTransaction::on_end`].
//!
//! Like Postgres, a transaction whose lock wait fails (timeout, deadlock, a dropped waiting
//! acquire) is aborted: further locks on it fail with
//! [`ErrorKind::TransactionAborted`] and it can only be rolled back. Unlike Postgres, a deadlock
//! is reported at once (Postgres waits `deadlock_timeout` first).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> lockstep_core::Result<()> {
//! use lockstep_core::{DistributedLock, ResourceKey};
//! use lockstep_testkit::{FakeDatabase, FakeDistributedLock};
//!
//! let db = FakeDatabase::new();
//! let lock = FakeDistributedLock::new(&db);
//! let key = ResourceKey::new("relay:aggregate:StockItem:1")?;
//! let (a, b) = (db.begin(), db.begin());
//! assert!(lock.try_acquire_for_transaction(&a, &key).await?);
//! assert!(!lock.try_acquire_for_transaction(&b, &key).await?);
//! a.commit().await?;
//! assert!(lock.try_acquire_for_transaction(&b, &key).await?);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lockstep_core::{
    DistributedLock, Error, ErrorKind, ResourceKey, Result, SessionLockGuard, SessionLocks,
};
use tokio::sync::Notify;

/// Who holds a fake lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockOwner {
    /// A transaction, by [`FakeTransaction::id`].
    Transaction(u64),
    /// A session lock guard, by its id.
    Session(u64),
}

/// How a fake transaction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxEnd {
    /// Committed: staged effects become visible.
    Committed,
    /// Rolled back (explicitly, by drop, or because it was aborted): staged effects vanish.
    RolledBack,
}

type EndHook = Box<dyn FnOnce(TxEnd) + Send>;

#[derive(Default)]
struct LockTable {
    /// Held keys: owner and re-entrancy depth.
    held: HashMap<ResourceKey, (LockOwner, u32)>,
    /// What each blocked owner waits for (for deadlock detection).
    waiting_for: HashMap<LockOwner, ResourceKey>,
    /// Number of waiting acquires per key.
    waiters: HashMap<ResourceKey, usize>,
}

struct DbInner {
    table: Mutex<LockTable>,
    released: Notify,
    next_id: AtomicU64,
}

/// The shared state of the fakes: one fake "server". Cheap to clone (clones share state).
#[derive(Clone)]
pub struct FakeDatabase {
    inner: Arc<DbInner>,
}

impl fmt::Debug for FakeDatabase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeDatabase")
            .field("held", &self.held_keys().len())
            .finish()
    }
}

impl Default for FakeDatabase {
    fn default() -> Self {
        FakeDatabase::new()
    }
}

/// The unit-of-work contract on the fake database: `begin` never fails; `commit` of an aborted
/// transaction rolls it back and fails with [`ErrorKind::TransactionAborted`], as on Postgres.
impl lockstep_core::TransactionSource for FakeDatabase {
    type Tx = FakeTransaction;

    fn begin(&self) -> impl Future<Output = Result<FakeTransaction>> + Send {
        std::future::ready(Ok(FakeDatabase::begin(self)))
    }

    fn commit(&self, tx: FakeTransaction) -> impl Future<Output = Result<()>> + Send {
        tx.commit()
    }

    async fn rollback(&self, tx: FakeTransaction) -> Result<()> {
        tx.rollback().await;
        Ok(())
    }
}

impl FakeDatabase {
    /// A new, empty fake server.
    pub fn new() -> FakeDatabase {
        FakeDatabase {
            inner: Arc::new(DbInner {
                table: Mutex::new(LockTable::default()),
                released: Notify::new(),
                next_id: AtomicU64::new(1),
            }),
        }
    }

    /// Begins a transaction.
    pub fn begin(&self) -> FakeTransaction {
        FakeTransaction {
            db: self.clone(),
            id: self.next_id(),
            state: Mutex::new(TxState {
                status: TxStatus::Open,
                hooks: Vec::new(),
            }),
        }
    }

    /// Keys currently held, with their owners.
    pub fn held_keys(&self) -> Vec<(ResourceKey, LockOwner)> {
        let table = self.table();
        let mut held: Vec<_> = table
            .held
            .iter()
            .map(|(k, (owner, _))| (k.clone(), *owner))
            .collect();
        held.sort_by(|a, b| a.0.cmp(&b.0));
        held
    }

    /// Who holds `key`, if anyone.
    pub fn holder_of(&self, key: &ResourceKey) -> Option<LockOwner> {
        self.table().held.get(key).map(|(owner, _)| *owner)
    }

    /// How many acquires are waiting for `key` right now.
    pub fn waiters(&self, key: &ResourceKey) -> usize {
        self.table().waiters.get(key).copied().unwrap_or(0)
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.inner.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn table(&self) -> MutexGuard<'_, LockTable> {
        // A panic while holding this mutex cannot leave the table half-updated (every update is
        // a single map operation), so a poisoned lock is still consistent.
        self.inner
            .table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn same(&self, other: &FakeDatabase) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Takes `key` for `owner` if free or already its own.
    fn try_take(&self, table: &mut LockTable, key: &ResourceKey, owner: LockOwner) -> bool {
        match table.held.get_mut(key) {
            Some((holder, depth)) if *holder == owner => {
                *depth += 1;
                true
            }
            Some(_) => false,
            None => {
                table.held.insert(key.clone(), (owner, 1));
                true
            }
        }
    }

    /// Whether `owner` waiting for `key` would close a cycle of waits.
    fn would_deadlock(table: &LockTable, key: &ResourceKey, owner: LockOwner) -> bool {
        let mut next = table.held.get(key).map(|(holder, _)| *holder);
        let mut steps = 0;
        while let Some(holder) = next {
            if holder == owner {
                return true;
            }
            steps += 1;
            if steps > table.waiting_for.len() {
                return false;
            }
            next = table
                .waiting_for
                .get(&holder)
                .and_then(|k| table.held.get(k))
                .map(|(h, _)| *h);
        }
        false
    }

    fn release_owner(&self, owner: LockOwner) {
        let mut table = self.table();
        table.held.retain(|_, (holder, _)| *holder != owner);
        drop(table);
        self.inner.released.notify_waiters();
    }

    pub(crate) fn release_one(&self, key: &ResourceKey, owner: LockOwner) {
        let mut table = self.table();
        if let Some((holder, depth)) = table.held.get_mut(key)
            && *holder == owner
        {
            *depth -= 1;
            if *depth == 0 {
                table.held.remove(key);
            }
        }
        drop(table);
        self.inner.released.notify_waiters();
    }

    /// Waits until `owner` holds `key`. Dropping the returned future leaves no waiter behind.
    pub(crate) async fn acquire(&self, key: &ResourceKey, owner: LockOwner) -> Result<()> {
        let mut registration: Option<WaiterRegistration<'_>> = None;
        loop {
            let notified = self.inner.released.notified();
            tokio::pin!(notified);
            // Register interest before checking, so a release between check and await is seen.
            notified.as_mut().enable();
            {
                let mut table = self.table();
                if self.try_take(&mut table, key, owner) {
                    return Ok(());
                }
                if Self::would_deadlock(&table, key, owner) {
                    return Err(Error::new(
                        ErrorKind::Deadlock,
                        format!("deadlock detected while waiting for {key}"),
                    ));
                }
                if registration.is_none() {
                    *table.waiters.entry(key.clone()).or_default() += 1;
                    table.waiting_for.insert(owner, key.clone());
                    registration = Some(WaiterRegistration {
                        db: self,
                        key,
                        owner,
                    });
                }
            }
            notified.await;
        }
    }
}

/// Counts one waiting acquire; un-counts it however the wait ends (success, error, drop).
struct WaiterRegistration<'a> {
    db: &'a FakeDatabase,
    key: &'a ResourceKey,
    owner: LockOwner,
}

impl Drop for WaiterRegistration<'_> {
    fn drop(&mut self) {
        let mut table = self.db.table();
        if let Some(count) = table.waiters.get_mut(self.key) {
            *count -= 1;
            if *count == 0 {
                table.waiters.remove(self.key);
            }
        }
        table.waiting_for.remove(&self.owner);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TxStatus {
    Open,
    Aborted,
    Ended,
}

struct TxState {
    status: TxStatus,
    hooks: Vec<EndHook>,
}

/// A fake unit-of-work transaction. Locks taken on it are released when it ends: by
/// [`commit`](FakeTransaction::commit), [`rollback`](FakeTransaction::rollback) or drop
/// (drop rolls back, as a Postgres transaction whose client goes away).
pub struct FakeTransaction {
    db: FakeDatabase,
    id: u64,
    state: Mutex<TxState>,
}

impl fmt::Debug for FakeTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeTransaction")
            .field("id", &self.id)
            .field("status", &self.state().status)
            .finish()
    }
}

impl FakeTransaction {
    /// The transaction's id (its [`LockOwner::Transaction`]).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The database it was begun on.
    pub fn database(&self) -> &FakeDatabase {
        &self.db
    }

    /// This transaction as a lock owner.
    pub fn owner(&self) -> LockOwner {
        LockOwner::Transaction(self.id)
    }

    /// Whether the transaction is open and usable (not aborted, not ended).
    pub fn is_usable(&self) -> bool {
        self.state().status == TxStatus::Open
    }

    /// Fails with [`ErrorKind::TransactionAborted`] unless the transaction is usable; other
    /// fakes call this before acting on the transaction.
    pub fn check_usable(&self) -> Result<()> {
        match self.state().status {
            TxStatus::Open => Ok(()),
            TxStatus::Aborted => Err(Error::new(
                ErrorKind::TransactionAborted,
                "current transaction is aborted, commands ignored until end of transaction block",
            )),
            TxStatus::Ended => Err(Error::new(
                ErrorKind::Unsupported,
                "transaction has already ended",
            )),
        }
    }

    /// Marks the transaction aborted, as a failed statement does in Postgres.
    pub fn abort(&self) {
        let mut state = self.state();
        if state.status == TxStatus::Open {
            state.status = TxStatus::Aborted;
        }
    }

    /// Runs `hook` when the transaction ends, with how it ended.
    pub fn on_end(&self, hook: impl FnOnce(TxEnd) + Send + 'static) {
        self.state().hooks.push(Box::new(hook));
    }

    /// Commits: releases every lock and runs the end hooks with [`TxEnd::Committed`]. An aborted
    /// transaction is rolled back instead and the commit fails with
    /// [`ErrorKind::TransactionAborted`].
    pub async fn commit(self) -> Result<()> {
        let aborted = self.state().status == TxStatus::Aborted;
        if aborted {
            self.end(TxEnd::RolledBack);
            return Err(Error::new(
                ErrorKind::TransactionAborted,
                "transaction was aborted and has been rolled back",
            ));
        }
        self.end(TxEnd::Committed);
        Ok(())
    }

    /// Rolls back: releases every lock and runs the end hooks with [`TxEnd::RolledBack`].
    pub async fn rollback(self) {
        self.end(TxEnd::RolledBack);
    }

    fn state(&self) -> MutexGuard<'_, TxState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn end(&self, how: TxEnd) {
        let hooks = {
            let mut state = self.state();
            if state.status == TxStatus::Ended {
                return;
            }
            state.status = TxStatus::Ended;
            std::mem::take(&mut state.hooks)
        };
        // Effects become visible before the locks go, as in Postgres (commit, then unlock).
        for hook in hooks {
            hook(how);
        }
        self.db.release_owner(LockOwner::Transaction(self.id));
    }
}

impl Drop for FakeTransaction {
    fn drop(&mut self) {
        self.end(TxEnd::RolledBack);
    }
}

/// Transaction-scoped fake locks on a [`FakeDatabase`].
#[derive(Debug, Clone)]
pub struct FakeDistributedLock {
    db: FakeDatabase,
}

impl FakeDistributedLock {
    /// Locks on `db`.
    pub fn new(db: &FakeDatabase) -> FakeDistributedLock {
        FakeDistributedLock { db: db.clone() }
    }

    /// The database it locks on.
    pub fn database(&self) -> &FakeDatabase {
        &self.db
    }

    fn check(&self, tx: &FakeTransaction) -> Result<()> {
        if !self.db.same(&tx.db) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "transaction belongs to another FakeDatabase",
            ));
        }
        tx.check_usable()
    }
}

impl DistributedLock<FakeTransaction> for FakeDistributedLock {
    async fn acquire_for_transaction(
        &self,
        tx: &FakeTransaction,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<()> {
        self.check(tx)?;
        // Aborts the transaction if the wait ends any way but success (drop included).
        let abort_guard = AbortOnDrop(Some(tx));
        let owner = LockOwner::Transaction(tx.id);
        let result = match timeout {
            None => self.db.acquire(key, owner).await,
            Some(limit) => match tokio::time::timeout(limit, self.db.acquire(key, owner)).await {
                Ok(result) => result,
                Err(_) => Err(Error::new(
                    ErrorKind::LockTimeout,
                    format!("canceling statement due to lock timeout on {key} after {limit:?}"),
                )),
            },
        };
        if result.is_ok() {
            abort_guard.disarm();
        }
        result
    }

    async fn try_acquire_for_transaction(
        &self,
        tx: &FakeTransaction,
        key: &ResourceKey,
    ) -> Result<bool> {
        self.check(tx)?;
        let mut table = self.db.table();
        Ok(self
            .db
            .try_take(&mut table, key, LockOwner::Transaction(tx.id)))
    }
}

struct AbortOnDrop<'a>(Option<&'a FakeTransaction>);

impl AbortOnDrop<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(tx) = self.0 {
            tx.abort();
        }
    }
}

/// Session-scoped fake locks on a [`FakeDatabase`]; every guard is its own session.
#[derive(Debug, Clone)]
pub struct FakeSessionLocks {
    db: FakeDatabase,
}

impl FakeSessionLocks {
    /// Session locks on `db`.
    pub fn new(db: &FakeDatabase) -> FakeSessionLocks {
        FakeSessionLocks { db: db.clone() }
    }
}

/// Holds a fake session lock until released or dropped.
#[derive(Debug)]
pub struct FakeSessionGuard {
    db: FakeDatabase,
    key: ResourceKey,
    owner: LockOwner,
    held: bool,
}

impl SessionLocks for FakeSessionLocks {
    type Guard = FakeSessionGuard;

    async fn acquire_session(
        &self,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<FakeSessionGuard> {
        {
            let owner = LockOwner::Session(self.db.next_id());
            let wait = self.db.acquire(key, owner);
            match timeout {
                None => wait.await?,
                Some(limit) => tokio::time::timeout(limit, wait).await.map_err(|_| {
                    Error::new(
                        ErrorKind::LockTimeout,
                        format!("lock timeout on {key} after {limit:?}"),
                    )
                })??,
            }
            Ok(FakeSessionGuard {
                db: self.db.clone(),
                key: key.clone(),
                owner,
                held: true,
            })
        }
    }

    async fn try_acquire_session(&self, key: &ResourceKey) -> Result<Option<FakeSessionGuard>> {
        {
            let owner = LockOwner::Session(self.db.next_id());
            let mut table = self.db.table();
            if !self.db.try_take(&mut table, key, owner) {
                return Ok(None);
            }
            Ok(Some(FakeSessionGuard {
                db: self.db.clone(),
                key: key.clone(),
                owner,
                held: true,
            }))
        }
    }
}

impl SessionLockGuard for FakeSessionGuard {
    fn key(&self) -> &ResourceKey {
        &self.key
    }

    fn release(mut self) -> impl Future<Output = Result<()>> + Send {
        self.held = false;
        self.db.release_one(&self.key, self.owner);
        std::future::ready(Ok(()))
    }
}

impl Drop for FakeSessionGuard {
    fn drop(&mut self) {
        if self.held {
            self.db.release_one(&self.key, self.owner);
        }
    }
}

/// Session locks on the same database, so one value offers both scopes (as the Postgres lock
/// does); same as [`FakeSessionLocks`].
impl SessionLocks for FakeDistributedLock {
    type Guard = FakeSessionGuard;

    async fn acquire_session(
        &self,
        key: &ResourceKey,
        timeout: Option<Duration>,
    ) -> Result<FakeSessionGuard> {
        FakeSessionLocks::new(&self.db)
            .acquire_session(key, timeout)
            .await
    }

    async fn try_acquire_session(&self, key: &ResourceKey) -> Result<Option<FakeSessionGuard>> {
        FakeSessionLocks::new(&self.db)
            .try_acquire_session(key)
            .await
    }
}

/// The fake lock as a conformance fixture: transactions are begun on its database.
impl crate::conformance::distributed_lock::DistributedLockFixture for FakeDistributedLock {
    type Tx = FakeTransaction;
    type Source = FakeDatabase;
    type Lock = FakeDistributedLock;

    fn lock(&self) -> &FakeDistributedLock {
        self
    }

    fn source(&self) -> &FakeDatabase {
        &self.db
    }
}
