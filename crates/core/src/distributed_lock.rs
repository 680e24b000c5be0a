//! The distributed-lock contract: exclusive locks on a [`ResourceKey`] across every instance.
//!
//! Two flavours:
//!
//! - [`DistributedLock`], **transaction-scoped**: the lock is taken on the caller's own
//!   unit-of-work transaction and released when that transaction ends, by commit or rollback
//!   (on Postgres, also when the client dies). There is no handle to release. Within one
//!   transaction the lock is re-entrant. The transaction type is a type parameter, so code
//!   written against this trait compiles unchanged against the testkit's fake transactions and
//!   against a Postgres transaction.
//! - [`SessionLocks`], **session-scoped**: the lock is held by a guard that owns its
//!   connection until [`SessionLockGuard::release`] (or drop).

use std::future::Future;
use std::time::Duration;

use crate::error::Result;
use crate::resource_key::ResourceKey;

/// Transaction-scoped exclusive locks, bound to a transaction of type `Tx`.
pub trait DistributedLock<Tx: ?Sized + Sync>: Send + Sync {
    /// Waits until `key` is held by `tx`, or until `timeout` passes
    /// ([`crate::ErrorKind::LockTimeout`]). `None` waits indefinitely; dropping the future
    /// abandons the wait without leaving anything behind.
    fn acquire_for_transaction<'a>(
        &'a self,
        tx: &'a Tx,
        key: &'a ResourceKey,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<()>> + Send + 'a;

    /// Takes `key` for `tx` if no other transaction or session holds it; `Ok(false)` at once
    /// otherwise. Succeeds if `tx` already holds it.
    fn try_acquire_for_transaction<'a>(
        &'a self,
        tx: &'a Tx,
        key: &'a ResourceKey,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;
}

/// Session-scoped exclusive locks, each held by a guard.
pub trait SessionLocks: Send + Sync {
    /// The guard that holds a session lock.
    type Guard: SessionLockGuard;

    /// Waits until `key` is held, or until `timeout` passes
    /// ([`crate::ErrorKind::LockTimeout`]).
    fn acquire_session<'a>(
        &'a self,
        key: &'a ResourceKey,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<Self::Guard>> + Send + 'a;

    /// Takes `key` if free; `Ok(None)` at once otherwise.
    fn try_acquire_session<'a>(
        &'a self,
        key: &'a ResourceKey,
    ) -> impl Future<Output = Result<Option<Self::Guard>>> + Send + 'a;
}

/// Holds one session lock. Dropping the guard also gives the lock up (a backend that cannot
/// unlock synchronously discards the connection instead, which the server treats the same).
pub trait SessionLockGuard: Send {
    /// The locked key.
    fn key(&self) -> &ResourceKey;

    /// Releases the lock and reports a failure to do so.
    fn release(self) -> impl Future<Output = Result<()>> + Send;
}
