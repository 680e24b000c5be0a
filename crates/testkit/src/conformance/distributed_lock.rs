//! The distributed-lock conformance suite: transaction-scoped exclusion, re-entrancy, release
//! at commit and rollback, blocking acquire.
//!
//! Every case uses fresh random keys, so the suite can run against a shared database.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::{DistributedLock, ResourceKey};

/// What the suite needs from a backend: the lock under test and owned transactions of the type
/// it locks on.
pub trait DistributedLockFixture: Send + Sync + 'static {
    /// An owned, open transaction (must be `'static` so a waiting writer can be spawned).
    type Tx: Send + Sync + 'static;
    /// The lock under test.
    type Lock: DistributedLock<Self::Tx> + 'static;

    /// The lock under test.
    fn lock(&self) -> &Self::Lock;

    /// Begins a new transaction (on its own connection, for a database backend).
    fn begin(&self) -> impl Future<Output = Self::Tx> + Send;

    /// Commits `tx`; its transaction-scoped locks are released.
    fn commit(&self, tx: Self::Tx) -> impl Future<Output = ()> + Send;

    /// Rolls `tx` back; its transaction-scoped locks are released.
    fn rollback(&self, tx: Self::Tx) -> impl Future<Output = ()> + Send;
}
