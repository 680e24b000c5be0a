//! [`SnapshotStore`] for [`InMemoryEventStore`]: aggregate snapshots on the fake transactions,
//! behaving like the Postgres table `wh_aggregate_snapshots`.
//!
//! - A save is staged per transaction and becomes visible to others when it commits; a
//!   rollback, an abort or a drop discards it. It keeps the newest: nothing is stored when the
//!   snapshot the transaction sees is at the same or a later version.
//! - Like the Postgres upsert, a save row-locks its key until the transaction ends: a second
//!   transaction saving the same key waits for the first (in the database's wait graph, so a
//!   cycle is a deadlock), then compares with what it committed.
//! - A load returns the visible snapshot (the transaction's own staged one, else the committed
//!   one) and the events after it, read through the store's upcasters as a load reads them
//!   (the events before the snapshot are not read); a snapshot past the stream's last event is
//!   ignored. With a lock, the lock is taken first, as
//!   [`EventStore::load_locked`](lockstep_core::EventStore::load_locked) takes it.

use std::collections::{HashMap, HashSet};

use lockstep_core::snapshot::check_snapshot;
use lockstep_core::{
    AggregateSnapshot, AggregateType, DistributedLock, LoadedStream, LockFirst, Result,
    SnapshotKey, SnapshotStore,
};

use crate::event_store::InMemoryEventStore;
use crate::fake_lock::{Attempt, FakeDistributedLock, FakeTransaction, LockOwner, TxEnd};

/// The snapshots of one [`InMemoryEventStore`] (shared by its clones).
#[derive(Default)]
pub(crate) struct Snapshots {
    committed: HashMap<SnapshotKey, AggregateSnapshot>,
    /// Saves of open transactions: transaction → key → snapshot.
    staged: HashMap<u64, HashMap<SnapshotKey, AggregateSnapshot>>,
    /// Transactions whose end hook is installed.
    hooked: HashSet<u64>,
}

impl Snapshots {
    fn visible(&self, tx: u64, key: &SnapshotKey) -> Option<&AggregateSnapshot> {
        self.staged
            .get(&tx)
            .and_then(|staged| staged.get(key))
            .or_else(|| self.committed.get(key))
    }

    /// The open transaction other than `tx` that saved `key`, if any.
    fn holder(&self, tx: u64, key: &SnapshotKey) -> Option<u64> {
        self.staged
            .iter()
            .find(|(holder, staged)| **holder != tx && staged.contains_key(key))
            .map(|(holder, _)| *holder)
    }
}

impl InMemoryEventStore {
    /// Installs the end-of-transaction hook of the snapshots once per transaction.
    fn join_snapshots(&self, tx: &FakeTransaction) {
        let id = tx.id();
        if !self.snapshots().hooked.insert(id) {
            return;
        }
        let store = self.clone();
        tx.on_end(move |how| {
            let mut snapshots = store.snapshots();
            snapshots.hooked.remove(&id);
            let staged = snapshots.staged.remove(&id).unwrap_or_default();
            if how == TxEnd::Committed {
                snapshots.committed.extend(staged);
            }
        });
    }

    /// How many snapshots are committed, outside any transaction (for assertions).
    pub fn snapshot_count(&self) -> usize {
        self.snapshots().committed.len()
    }
}

impl SnapshotStore<FakeTransaction> for InMemoryEventStore {
    async fn load_from_snapshot(
        &self,
        tx: &FakeTransaction,
        key: &SnapshotKey,
        lock: Option<LockFirst<'_>>,
    ) -> Result<LoadedStream> {
        self.check(tx)?;
        if let Some(LockFirst {
            key: lock_key,
            timeout,
        }) = lock
        {
            FakeDistributedLock::new(tx.database())
                .acquire_for_transaction(tx, lock_key, timeout)
                .await?;
        }
        // As stored; only the events after the snapshot are read (and upcast), as on Postgres.
        let mut events = self.visible_as_stored(tx, key.stream_id());
        let snapshot = self
            .snapshots()
            .visible(tx.id(), key)
            .filter(|s| s.version <= events.len() as u64)
            .cloned();
        if let Some(snapshot) = &snapshot {
            events.retain(|e| e.version > snapshot.version);
        }
        let events = events
            .into_iter()
            .map(|event| self.upcasters().upcast(event))
            .collect::<Result<_>>()?;
        Ok(LoadedStream { snapshot, events })
    }

    async fn save_snapshot(
        &self,
        tx: &FakeTransaction,
        key: &SnapshotKey,
        snapshot: &AggregateSnapshot,
    ) -> Result<bool> {
        self.check(tx)?;
        check_snapshot(snapshot)?;
        self.join_snapshots(tx);
        let id = tx.id();
        let what = format!("saving the snapshot of {}", key.stream_id());
        tx.statement(tx.database().wait_for(tx.owner(), &what, || {
            let mut snapshots = self.snapshots();
            if let Some(holder) = snapshots.holder(id, key) {
                return Ok(Attempt::Blocked(LockOwner::Transaction(holder)));
            }
            if snapshots
                .visible(id, key)
                .is_some_and(|stored| stored.version >= snapshot.version)
            {
                return Ok(Attempt::Done(false));
            }
            snapshots
                .staged
                .entry(id)
                .or_default()
                .insert(key.clone(), snapshot.clone());
            Ok(Attempt::Done(true))
        }))
        .await
    }

    async fn delete_snapshots(
        &self,
        tx: &FakeTransaction,
        aggregate_type: &AggregateType,
        below_schema_version: Option<u32>,
    ) -> Result<u64> {
        self.check(tx)?;
        // Applied at once (test-sized data): the committed rows go, and so do this
        // transaction's own staged ones.
        let doomed = |key: &SnapshotKey| {
            key.aggregate_type() == aggregate_type
                && below_schema_version.is_none_or(|below| key.schema_version() < below)
        };
        let mut snapshots = self.snapshots();
        let before = snapshots.committed.len();
        snapshots.committed.retain(|key, _| !doomed(key));
        let mut deleted = (before - snapshots.committed.len()) as u64;
        if let Some(staged) = snapshots.staged.get_mut(&tx.id()) {
            let before = staged.len();
            staged.retain(|key, _| !doomed(key));
            deleted += (before - staged.len()) as u64;
        }
        Ok(deleted)
    }
}
