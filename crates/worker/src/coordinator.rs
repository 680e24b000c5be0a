//! [`ApplyCoordinator`]: serializes every apply path (normal, rewind, bootstrap, purge) of one
//! `(stream, perspective)` pair inside one instance, with or without a stream locker.
//!
//! The in-process apply coordinator (the design's `PerspectiveApplyCoordinator`): without it, a rewind racing a normal
//! apply of the same pair on one instance could commit a state computed before the other's
//! commit (a lost update). Across instances the store's row lock and compare-and-set, and the
//! stream lease, do that job; inside one instance this keyed async mutex makes the second task
//! wait instead of failing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockstep_core::{PerspectiveName, StreamId};
use tokio::sync::OwnedMutexGuard;

type Key = (StreamId, PerspectiveName);

/// A keyed async mutex per pair. Cheap to clone (clones share the locks).
#[derive(Debug, Clone, Default)]
pub struct ApplyCoordinator {
    locks: Arc<Mutex<HashMap<Key, Arc<tokio::sync::Mutex<()>>>>>,
    warn_after: Duration,
}

/// Holds a pair's in-process apply lock; dropping it lets the next task in.
#[derive(Debug)]
pub struct PairGuard {
    _guard: OwnedMutexGuard<()>,
    key: Key,
    coordinator: ApplyCoordinator,
}

impl ApplyCoordinator {
    /// A coordinator whose waiters log a warning after waiting `warn_after`.
    pub fn new(warn_after: Duration) -> Self {
        ApplyCoordinator {
            locks: Arc::default(),
            warn_after,
        }
    }

    /// Waits for the pair's apply lock. Cancel-safe: dropping the future gives up the wait.
    pub async fn lock(&self, stream_id: StreamId, perspective: &PerspectiveName) -> PairGuard {
        let key = (stream_id, perspective.clone());
        let mutex = self.mutex(&key);
        let acquire = Arc::clone(&mutex).lock_owned();
        tokio::pin!(acquire);
        let guard = tokio::select! {
            guard = &mut acquire => guard,
            () = tokio::time::sleep(self.warn_after) => {
                tracing::warn!(
                    stream_id = %stream_id,
                    perspective = %perspective,
                    waited_ms = self.warn_after.as_millis() as u64,
                    "still waiting for the pair's in-process apply lock"
                );
                acquire.await
            }
        };
        PairGuard {
            _guard: guard,
            key,
            coordinator: self.clone(),
        }
    }

    /// The pair's apply lock if nobody holds it now (a batch leaves a pair that another task
    /// of the instance is working on to that task instead of waiting for it while holding
    /// the rest of its batch).
    pub fn try_lock(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Option<PairGuard> {
        let key = (stream_id, perspective.clone());
        let guard = self.mutex(&key).try_lock_owned().ok();
        let guard = guard.map(|guard| PairGuard {
            _guard: guard,
            key: key.clone(),
            coordinator: self.clone(),
        });
        if guard.is_none() {
            // Not ours: forget the entry if the holder is gone meanwhile (as a dropped guard
            // does), so a failed try never grows the map.
            let mut locks = self
                .locks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if locks.get(&key).is_some_and(|m| Arc::strong_count(m) <= 1) {
                locks.remove(&key);
            }
        }
        guard
    }

    /// The pair's mutex, entered in the map if it has none.
    fn mutex(&self, key: &Key) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self
            .locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Arc::clone(locks.entry(key.clone()).or_default())
    }

    /// Pairs with a lock entry (held or recently used); for tests.
    pub fn tracked(&self) -> usize {
        self.locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }
}

impl Drop for PairGuard {
    fn drop(&mut self) {
        // Forget the pair's mutex once nobody holds or waits for it (the map holds one
        // reference, this guard's mutex another): the map stays as small as the live pairs.
        let mut locks = self
            .coordinator
            .locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if locks
            .get(&self.key)
            .is_some_and(|mutex| Arc::strong_count(mutex) <= 2)
        {
            locks.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_pair_at_a_time_and_other_pairs_never_wait() {
        let c = ApplyCoordinator::new(Duration::from_secs(5));
        let name = PerspectiveName::new("P").expect("valid");
        let (s1, s2) = (StreamId::new_v7(), StreamId::new_v7());
        let first = c.lock(s1, &name).await;
        let other = tokio::time::timeout(Duration::from_millis(10), c.lock(s2, &name)).await;
        assert!(other.is_ok(), "another pair does not wait");
        let blocked = tokio::time::timeout(Duration::from_secs(60), c.lock(s1, &name)).await;
        assert!(blocked.is_err(), "the same pair waits");
        drop(other);
        drop(first);
        let again = tokio::time::timeout(Duration::from_millis(10), c.lock(s1, &name)).await;
        assert!(again.is_ok(), "free again after the holder dropped");
        drop(again);
        assert_eq!(c.tracked(), 0, "no entry outlives its last user");
    }

    #[tokio::test]
    async fn try_lock_takes_a_free_pair_refuses_a_held_one_and_leaves_no_entry_behind() {
        let coordinator = ApplyCoordinator::new(Duration::from_secs(5));
        let (stream, name) = (
            StreamId::new_v7(),
            PerspectiveName::new("P").expect("valid"),
        );
        let held = coordinator.lock(stream, &name).await;
        assert!(coordinator.try_lock(stream, &name).is_none(), "held");
        assert_eq!(coordinator.tracked(), 1);
        drop(held);
        assert_eq!(coordinator.tracked(), 0, "the failed try left no entry");
        let guard = coordinator.try_lock(stream, &name).expect("free");
        assert!(coordinator.try_lock(stream, &name).is_none());
        drop(guard);
        assert_eq!(coordinator.tracked(), 0);
    }
}
