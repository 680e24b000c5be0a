//! The in-process queue in front of the server's lock: one async mutex per advisory key,
//! created on first use and removed when its last user leaves.
//!
//! A permit is held only while its owner **waits at the server** (see [`crate::LockQueue`]):
//! local waiters queue for the right to wait there, so a hot key has one waiting backend per
//! process instead of one per waiter, and the permit is never held while the lock itself is
//! held (a caller that never commits cannot wedge the queue).
//!
//! Moved here from `lockstep-pg-advisory` so that every backend that waits for an advisory lock
//! (the lock itself, the event store's `load_locked`) shares one queue per process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// One async mutex per advisory key.
#[derive(Debug, Default)]
pub(crate) struct LocalQueue {
    slots: Mutex<HashMap<i64, Arc<tokio::sync::Mutex<()>>>>,
}

impl LocalQueue {
    /// The slot of `key`, created if needed. Keep it for as long as its permit is wanted.
    pub(crate) fn slot(&self, key: i64) -> Slot<'_> {
        let mut slots = self.slots();
        let mutex = Arc::clone(slots.entry(key).or_default());
        Slot {
            queue: self,
            key,
            mutex: Some(mutex),
        }
    }

    /// How many keys have a slot right now (every slot in use; idle ones are removed).
    pub(crate) fn len(&self) -> usize {
        self.slots().len()
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<i64, Arc<tokio::sync::Mutex<()>>>> {
        // Every update is a single map operation, so a poisoned map is still consistent.
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A reference to one key's mutex; removes the map entry when the last reference goes.
#[derive(Debug)]
pub(crate) struct Slot<'q> {
    queue: &'q LocalQueue,
    key: i64,
    mutex: Option<Arc<tokio::sync::Mutex<()>>>,
}

impl Slot<'_> {
    /// The key's mutex; its guard is the permit to wait at the server.
    pub(crate) fn mutex(&self) -> &tokio::sync::Mutex<()> {
        match &self.mutex {
            Some(mutex) => mutex,
            None => unreachable!("the mutex is only taken in drop"),
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut slots = self.queue.slots();
        // Strong counts only change under the map lock (clone in `slot`, drop here), so
        // "only the map holds it" cannot race with a new user.
        drop(self.mutex.take());
        if slots
            .get(&self.key)
            .is_some_and(|mutex| Arc::strong_count(mutex) == 1)
        {
            slots.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn slots_are_shared_per_key_and_removed_when_unused() {
        let queue = LocalQueue::default();
        let a = queue.slot(1);
        let b = queue.slot(1);
        let c = queue.slot(2);
        assert_eq!(queue.len(), 2);
        let permit = a.mutex().try_lock().expect("free");
        assert!(b.mutex().try_lock().is_err(), "same key, same mutex");
        assert!(c.mutex().try_lock().is_ok(), "other key, other mutex");
        drop(permit);
        drop(a);
        assert_eq!(queue.len(), 2, "b still uses key 1");
        drop(b);
        drop(c);
        assert_eq!(queue.len(), 0);
    }
}
