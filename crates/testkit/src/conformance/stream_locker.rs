//! The stream-locker conformance suite: the seed's lease semantics, case by case.
//!
//! Every case uses fresh stream ids, so the suite can run against a shared database. Expiry is
//! waited out with `tokio::time::sleep(lock_timeout + margin)`: on the in-memory locker with
//! paused time that is instant; on Postgres, give the fixture a short lock timeout.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::{
    AcquireOutcome, InstanceId, LeaseId, LockReason, PerspectiveName, ReleaseOutcome, RenewOutcome,
    StreamId, StreamLease, StreamLockAdmin, StreamLocker, async_trait,
};

/// What the suite needs from a backend.
#[async_trait]
pub trait StreamLockerFixture: Send + Sync {
    /// The locker under test. Its `options().lock_timeout()` is how long the suite waits for
    /// a lease to expire, so keep it short on real databases (e.g. 400 ms).
    fn locker(&self) -> Arc<dyn StreamLocker>;

    /// The admin view over the same storage.
    fn admin(&self) -> Arc<dyn StreamLockAdmin>;

    /// Creates the cursor row of `(stream_id, perspective)`, unlocked.
    async fn create_cursor(&self, stream_id: StreamId, perspective: &PerspectiveName);
}
