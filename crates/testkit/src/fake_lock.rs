//! A fake distributed lock with fake transactions that behave like PostgreSQL advisory locks:
//! exclusive across transactions and sessions, re-entrant within one transaction, released when
//! the transaction commits or rolls back (or is dropped), or as soon as a failed statement
//! aborts it.
//!
//! [`FakeDatabase`] is the shared state (one "server"); [`FakeTransaction`]s are begun on it;
//! [`FakeDistributedLock`] and [`FakeSessionLocks`] lock on it. Other fakes that take part in a
//! unit of work (an event store) hook into the transaction's end with
//! [`FakeTransaction::on_end`].
//!
//! Like Postgres, a transaction whose lock wait fails (timeout, deadlock, a dropped waiting
//! acquire) is aborted: its locks are released at once (Postgres runs `AbortTransaction` at the
//! error and only waits for `ROLLBACK` to end the block), further locks on it fail with
//! [`ErrorKind::TransactionAborted`] and it can only be rolled back. Unlike Postgres, a deadlock
//! is reported at once (Postgres waits `deadlock_timeout` first).
//!
//! Every fake that makes a statement wait — a lock acquire here, an append waiting for another
//! transaction's version in [`crate::InMemoryEventStore`], a lease operation waiting for a fenced
//! transaction's cursor row in [`crate::InMemoryStreamLocker`] — waits through the one wait graph
//! of its [`FakeDatabase`], so a cycle is found whichever fakes its waits go through.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> lockstep_core::Result<()> {
//! use lockstep_core::{DistributedLock, ResourceKey, Transaction, TransactionSource};
//! use lockstep_testkit::{FakeDatabase, FakeDistributedLock};
//!
//! let db = FakeDatabase::new();
//! let lock = FakeDistributedLock::new(&db);
//! let key = ResourceKey::new("relay:aggregate:StockItem:1")?;
//! let (a, b) = (db.begin().await?, db.begin().await?);
//! assert!(lock.try_acquire_for_transaction(&a, &key).await?);
//! assert!(!lock.try_acquire_for_transaction(&b, &key).await?);
//! a.commit().await?;
//! assert!(lock.try_acquire_for_transaction(&b, &key).await?);
//! # Ok(()) }
//! ```

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lockstep_core::{
    DistributedLock, Error, ErrorKind, ResourceKey, Result, SessionLockGuard, SessionLocks,
    ValidationError,
};
use tokio::sync::Notify;

/// The longest lock wait Postgres accepts: `lock_timeout` is an `int` of milliseconds (and
/// lockstep-pg rounds a wait up to whole milliseconds), so about 24.8 days.
pub const MAX_LOCK_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// Refuses a lock timeout Postgres would refuse, exactly as lockstep-pg does before any SQL:
/// [`ErrorKind::InvalidInput`] with [`ValidationError::DurationTooLarge`].
fn check_lock_timeout(timeout: Option<Duration>) -> Result<()> {
    match timeout {
        Some(limit) if limit.as_micros().div_ceil(1000) > MAX_LOCK_TIMEOUT.as_millis() => {
            Err(ValidationError::DurationTooLarge {
                field: "lock timeout",
            }
            .into())
        }
        _ => Ok(()),
    }
}

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

/// A write held back until commit on a [`FakeTransaction`]
/// ([`FakeTransaction::write_at_commit`]): given the transaction, it runs the write.
pub type FakeWriteAtCommit = Box<
    dyn for<'t> FnOnce(
            &'t FakeTransaction,
        ) -> std::pin::Pin<Box<dyn Future<Output = Result<()>> + Send + 't>>
        + Send,
>;

#[derive(Default)]
struct LockTable {
    /// Held keys: owner and re-entrancy depth.
    held: HashMap<ResourceKey, (LockOwner, u32)>,
    /// The wait graph: every statement waiting right now, in any fake on this database, by wait
    /// id (one owner may run several waiting statements).
    waits: HashMap<u64, WaitEdge>,
}

/// One waiting statement: `waiter` waits for `holder` to release something (for a transaction:
/// to end).
struct WaitEdge {
    waiter: LockOwner,
    holder: LockOwner,
    /// The key waited for, when it is a lock key (counted by [`FakeDatabase::waiters`]).
    key: Option<ResourceKey>,
}

impl LockTable {
    /// Takes `key` for `owner` if free or already its own.
    fn try_take(&mut self, key: &ResourceKey, owner: LockOwner) -> bool {
        match self.held.get_mut(key) {
            Some((holder, depth)) if *holder == owner => {
                *depth += 1;
                true
            }
            Some(_) => false,
            None => {
                self.held.insert(key.clone(), (owner, 1));
                true
            }
        }
    }

    /// Whether `from` waits, directly or through others, for `to`.
    fn reaches(&self, from: LockOwner, to: LockOwner) -> bool {
        let mut seen = HashSet::new();
        let mut next = vec![from];
        while let Some(owner) = next.pop() {
            if owner == to {
                return true;
            }
            if seen.insert(owner) {
                next.extend(
                    self.waits
                        .values()
                        .filter(|w| w.waiter == owner)
                        .map(|w| w.holder),
                );
            }
        }
        false
    }
}

/// What one attempt of a waiting statement found.
pub(crate) enum Attempt<T> {
    /// It went through.
    Done(T),
    /// It must wait until `holder` releases what it needs (for a transaction: until it ends).
    Blocked(LockOwner),
}

struct DbInner {
    table: Mutex<LockTable>,
    released: Notify,
    next_id: AtomicU64,
    /// Commits still to commit and then report a lost reply
    /// ([`FakeDatabase::lose_next_commit_replies`]).
    lose_commit_replies: AtomicU64,
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
        std::future::ready(Ok(self.begin_now()))
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
                lose_commit_replies: AtomicU64::new(0),
            }),
        }
    }

    /// Begins a transaction at once — what the unit-of-work contract's
    /// [`begin`](lockstep_core::TransactionSource::begin) does (it never fails or waits on the
    /// fake), without an `.await`, for tests.
    pub fn begin_now(&self) -> FakeTransaction {
        FakeTransaction {
            db: self.clone(),
            id: self.next_id(),
            state: Mutex::new(TxState {
                status: TxStatus::Open,
                hooks: Vec::new(),
                at_commit: Vec::new(),
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
        self.table()
            .waits
            .values()
            .filter(|w| w.key.as_ref() == Some(key))
            .count()
    }

    /// The next `n` transactions of this database that commit do commit, and then report
    /// [`ErrorKind::CommitUnknown`], as when the connection is lost after `COMMIT` was sent:
    /// to drive a caller's handling of an unknown commit (which must not retry blindly). A
    /// commit that fails (an aborted transaction, a held-back write) is not counted.
    pub fn lose_next_commit_replies(&self, n: u64) {
        self.inner.lose_commit_replies.store(n, Ordering::SeqCst);
    }

    /// Whether this commit's reply is to be lost (counting it down).
    fn loses_commit_reply(&self) -> bool {
        self.inner
            .lose_commit_replies
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    /// How many statements of any fake on this database wait right now for a lock, a row or a
    /// version another transaction holds — what `pg_stat_activity.wait_event_type = 'Lock'`
    /// shows on a server. A test waits on it instead of sleeping until a concurrent writer has
    /// surely reached its wait.
    pub fn waiting(&self) -> usize {
        self.table().waits.len()
    }

    /// Whether nothing is locked (no key, no cursor row of a fenced commit) and no statement of
    /// any fake waits on this database: what a test expects once every transaction has ended.
    pub fn is_idle(&self) -> bool {
        let table = self.table();
        table.held.is_empty() && table.waits.is_empty()
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
        let what = format!("waiting for {key}");
        self.wait(owner, Some(key), &what, |table| {
            if table.try_take(key, owner) {
                return Ok(Attempt::Done(()));
            }
            match table.held.get(key) {
                Some((holder, _)) => Ok(Attempt::Blocked(*holder)),
                // Unreachable (not taken means held by another), but harmless: try again.
                None => Ok(Attempt::Blocked(owner)),
            }
        })
        .await
    }

    /// Runs `attempt` until it is done, waiting in between for whoever it is blocked by, as a
    /// statement waits in Postgres: the wait is an edge of this database's wait graph, so a
    /// wait that would close a cycle fails at once with [`ErrorKind::Deadlock`]. `attempt` runs
    /// again whenever a lock is released or a transaction of this database ends. Dropping the
    /// returned future leaves nothing behind.
    ///
    /// For fakes whose resources live outside the lock table (versions reserved by an append).
    pub(crate) async fn wait_for<T>(
        &self,
        waiter: LockOwner,
        what: &str,
        mut attempt: impl FnMut() -> Result<Attempt<T>>,
    ) -> Result<T> {
        self.wait(waiter, None, what, |_| attempt()).await
    }

    async fn wait<T>(
        &self,
        waiter: LockOwner,
        key: Option<&ResourceKey>,
        what: &str,
        mut attempt: impl FnMut(&mut LockTable) -> Result<Attempt<T>>,
    ) -> Result<T> {
        let mut edge: Option<WaitRegistration<'_>> = None;
        loop {
            let notified = self.inner.released.notified();
            tokio::pin!(notified);
            // Register interest before trying, so a release between try and await is seen.
            notified.as_mut().enable();
            let done = {
                let mut table = self.table();
                match attempt(&mut table) {
                    Ok(Attempt::Done(value)) => Some(Ok(value)),
                    Err(e) => Some(Err(e)),
                    Ok(Attempt::Blocked(holder)) if table.reaches(holder, waiter) => {
                        Some(Err(Error::new(
                            ErrorKind::Deadlock,
                            format!("deadlock detected while {what}"),
                        )))
                    }
                    Ok(Attempt::Blocked(holder)) => {
                        match &edge {
                            Some(registered) => {
                                if let Some(w) = table.waits.get_mut(&registered.id) {
                                    w.holder = holder;
                                }
                            }
                            None => {
                                let id = self.next_id();
                                table.waits.insert(
                                    id,
                                    WaitEdge {
                                        waiter,
                                        holder,
                                        key: key.cloned(),
                                    },
                                );
                                edge = Some(WaitRegistration { db: self, id });
                            }
                        }
                        None
                    }
                }
            };
            // The table is unlocked here: dropping `edge` on return locks it again.
            match done {
                Some(result) => return result,
                None => notified.await,
            }
        }
    }
}

/// Removes a waiting statement's edge from the wait graph however the wait ends (success,
/// error, drop).
struct WaitRegistration<'a> {
    db: &'a FakeDatabase,
    id: u64,
}

impl Drop for WaitRegistration<'_> {
    fn drop(&mut self) {
        self.db.table().waits.remove(&self.id);
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
    at_commit: Vec<FakeWriteAtCommit>,
}

/// A fake unit-of-work transaction. Locks taken on it are released when it ends: by
/// [`commit`](lockstep_core::Transaction::commit), [`rollback`](lockstep_core::Transaction::rollback) or drop
/// (drop rolls back, as a Postgres transaction whose client goes away) — or earlier, when a
/// failed statement aborts it ([`FakeTransaction::abort`]), as Postgres releases them at the
/// error.
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

    /// Marks the transaction aborted, as a failed statement does in Postgres, and undoes it at
    /// once as Postgres does at the error (not at the `ROLLBACK` that ends the block): the end
    /// hooks run with [`TxEnd::RolledBack`] (staged effects vanish, reserved versions are
    /// freed), every lock of the transaction is released, and whoever waited for it is woken.
    /// The transaction itself stays open until rolled back, committed (which fails) or dropped.
    pub fn abort(&self) {
        let hooks = {
            let mut state = self.state();
            if state.status != TxStatus::Open {
                return;
            }
            state.status = TxStatus::Aborted;
            std::mem::take(&mut state.hooks)
        };
        for hook in hooks {
            hook(TxEnd::RolledBack);
        }
        self.db.release_owner(LockOwner::Transaction(self.id));
    }

    /// Runs `statement` on this transaction as Postgres runs one: if it fails, or is dropped
    /// before it finishes (a cancelled wait), the transaction is aborted. Every fake that waits
    /// or can fail mid-statement on a transaction runs through this.
    pub(crate) async fn statement<T>(
        &self,
        statement: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let mut guard = AbortUnlessDone(Some(self));
        let result = statement.await;
        if result.is_ok() {
            guard.0 = None;
        }
        result
    }

    /// Runs `hook` when the transaction ends, with how it ended — or, for a transaction that
    /// gets aborted, at the abort with [`TxEnd::RolledBack`] (its work is undone at the error,
    /// as on Postgres).
    pub fn on_end(&self, hook: impl FnOnce(TxEnd) + Send + 'static) {
        self.state().hooks.push(Box::new(hook));
    }

    /// Holds `write` back until [commit](lockstep_core::Transaction::commit), which runs it (in the order given)
    /// before committing; if it fails, the transaction is rolled back and the commit returns its
    /// error — as `lockstep_pg::PgTransaction::write_at_commit` sends the write with the
    /// `COMMIT`. A rollback or a drop discards it.
    pub fn write_at_commit(&self, write: FakeWriteAtCommit) {
        self.state().at_commit.push(write);
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

/// The guard contract: commit and rollback end the fake transaction as on Postgres.
impl lockstep_core::Transaction for FakeTransaction {
    /// Commits: runs the writes held back by [`FakeTransaction::write_at_commit`], releases
    /// every lock and runs the end hooks with [`TxEnd::Committed`]. An aborted transaction is
    /// rolled back instead and the commit fails with [`ErrorKind::TransactionAborted`]; a
    /// held-back write that fails rolls the transaction back and the commit returns its error.
    async fn commit(self) -> Result<()> {
        let writes = std::mem::take(&mut self.state().at_commit);
        if self.state().status == TxStatus::Open {
            for write in writes {
                // A failed write is a failed statement (it aborts the transaction), and a
                // COMMIT of a failed transaction rolls back.
                if let Err(e) = self.statement(write(&self)).await {
                    self.end(TxEnd::RolledBack);
                    return Err(e);
                }
            }
        }
        let aborted = self.state().status == TxStatus::Aborted;
        if aborted {
            self.end(TxEnd::RolledBack);
            return Err(Error::new(
                ErrorKind::TransactionAborted,
                "transaction was aborted and has been rolled back",
            ));
        }
        self.end(TxEnd::Committed);
        if self.db.loses_commit_reply() {
            return Err(Error::new(
                ErrorKind::CommitUnknown,
                "the connection was lost after COMMIT was sent (FakeDatabase::lose_next_commit_replies)",
            ));
        }
        Ok(())
    }

    /// Rolls back: releases every lock and runs the end hooks with [`TxEnd::RolledBack`].
    /// Never fails on the fake.
    async fn rollback(self) -> Result<()> {
        self.end(TxEnd::RolledBack);
        Ok(())
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
        check_lock_timeout(timeout)?;
        let owner = LockOwner::Transaction(tx.id);
        tx.statement(async {
            match timeout {
                None => self.db.acquire(key, owner).await,
                Some(limit) => tokio::time::timeout(limit, self.db.acquire(key, owner))
                    .await
                    .unwrap_or_else(|_| {
                        Err(Error::new(
                            ErrorKind::LockTimeout,
                            format!(
                                "canceling statement due to lock timeout on {key} after {limit:?}"
                            ),
                        ))
                    }),
            }
        })
        .await
    }

    async fn try_acquire_for_transaction(
        &self,
        tx: &FakeTransaction,
        key: &ResourceKey,
    ) -> Result<bool> {
        self.check(tx)?;
        Ok(self.db.table().try_take(key, LockOwner::Transaction(tx.id)))
    }
}

/// Aborts its transaction when dropped armed: a statement that failed or was abandoned.
struct AbortUnlessDone<'a>(Option<&'a FakeTransaction>);

impl Drop for AbortUnlessDone<'_> {
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
            check_lock_timeout(timeout)?;
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
            if !self.db.table().try_take(key, owner) {
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
