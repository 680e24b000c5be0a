//! [`FakeTable`]: an application's table in memory, whose writes commit and roll back with a
//! [`FakeTransaction`] — what a [`lockstep_core::TablePerspective`] writes on the fakes, so an
//! application's read-model tests stay in memory.
//!
//! Writes are staged per transaction and become visible to everyone when it commits (an abort,
//! a rollback or a drop discards them, as on Postgres). Reads either see what is committed
//! ([`FakeTable::get`], [`FakeTable::rows`]) or that plus the transaction's own writes
//! ([`FakeTable::get_in`], [`FakeTable::rows_in`]). There are no row locks: two transactions
//! writing one key both commit, the later one winning. The perspective worker never applies one
//! pair in two transactions at once, so a table keyed by stream needs none.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use lockstep_core::Result;

use crate::fake_lock::{FakeTransaction, TxEnd};

/// An in-memory table of rows `V` keyed by `K`; see the [module docs](self). Clones share the
/// table.
pub struct FakeTable<K, V> {
    inner: Arc<Mutex<Inner<K, V>>>,
}

struct Inner<K, V> {
    rows: BTreeMap<K, V>,
    /// Per open transaction (by id), its writes: `None` deletes the row.
    staged: HashMap<u64, BTreeMap<K, Option<V>>>,
}

impl<K, V> Clone for FakeTable<K, V> {
    fn clone(&self) -> Self {
        FakeTable {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<K, V> Default for FakeTable<K, V> {
    fn default() -> Self {
        FakeTable {
            inner: Arc::new(Mutex::new(Inner {
                rows: BTreeMap::new(),
                staged: HashMap::new(),
            })),
        }
    }
}

impl<K: fmt::Debug, V: fmt::Debug> fmt::Debug for FakeTable<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f.debug_map().entries(inner.rows.iter()).finish()
    }
}

impl<K, V> FakeTable<K, V>
where
    K: Ord + Clone + Send + 'static,
    V: Clone + Send + 'static,
{
    /// An empty table.
    pub fn new() -> Self {
        FakeTable::default()
    }

    /// The committed row at `key`.
    pub fn get(&self, key: &K) -> Option<V> {
        self.inner().rows.get(key).cloned()
    }

    /// Every committed row, in key order.
    pub fn rows(&self) -> BTreeMap<K, V> {
        self.inner().rows.clone()
    }

    /// The row at `key` as `tx` sees it: committed rows overlaid with its own writes.
    pub fn get_in(&self, tx: &FakeTransaction, key: &K) -> Result<Option<V>> {
        tx.check_usable()?;
        let inner = self.inner();
        match inner.staged.get(&tx.id()).and_then(|s| s.get(key)) {
            Some(staged) => Ok(staged.clone()),
            None => Ok(inner.rows.get(key).cloned()),
        }
    }

    /// Every row as `tx` sees it, in key order.
    pub fn rows_in(&self, tx: &FakeTransaction) -> Result<BTreeMap<K, V>> {
        tx.check_usable()?;
        let inner = self.inner();
        let mut rows = inner.rows.clone();
        if let Some(staged) = inner.staged.get(&tx.id()) {
            apply(&mut rows, staged.clone());
        }
        Ok(rows)
    }

    /// Writes `value` at `key` in `tx`.
    pub fn upsert(&self, tx: &FakeTransaction, key: K, value: V) -> Result<()> {
        self.stage(tx, key, Some(value))
    }

    /// Replaces the row at `key` (as `tx` sees it; `None` when there is none) with what
    /// `change` returns (`None` deletes it), in `tx`.
    pub fn update(
        &self,
        tx: &FakeTransaction,
        key: K,
        change: impl FnOnce(Option<V>) -> Option<V>,
    ) -> Result<()> {
        let current = self.get_in(tx, &key)?;
        self.stage(tx, key, change(current))
    }

    /// Deletes, in `tx`, every row (as `tx` sees them) for which `doomed` says so; returns how
    /// many.
    pub fn delete_where(
        &self,
        tx: &FakeTransaction,
        doomed: impl Fn(&K, &V) -> bool,
    ) -> Result<usize> {
        let rows = self.rows_in(tx)?;
        let keys: Vec<K> = rows
            .iter()
            .filter(|(k, v)| doomed(k, v))
            .map(|(k, _)| k.clone())
            .collect();
        for key in &keys {
            self.stage(tx, key.clone(), None)?;
        }
        Ok(keys.len())
    }

    fn stage(&self, tx: &FakeTransaction, key: K, value: Option<V>) -> Result<()> {
        tx.check_usable()?;
        let first = {
            let mut inner = self.inner();
            let first = !inner.staged.contains_key(&tx.id());
            inner.staged.entry(tx.id()).or_default().insert(key, value);
            first
        };
        if first {
            // At the transaction's end (or its abort) its writes land or vanish.
            let table = self.clone();
            let id = tx.id();
            tx.on_end(move |end| {
                let mut inner = table.inner();
                if let Some(staged) = inner.staged.remove(&id)
                    && end == TxEnd::Committed
                {
                    apply(&mut inner.rows, staged);
                }
            });
        }
        Ok(())
    }

    fn inner(&self) -> MutexGuard<'_, Inner<K, V>> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn apply<K: Ord, V>(rows: &mut BTreeMap<K, V>, staged: BTreeMap<K, Option<V>>) {
    for (key, value) in staged {
        match value {
            Some(value) => {
                rows.insert(key, value);
            }
            None => {
                rows.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use lockstep_core::{Transaction, TransactionSource};

    use super::*;
    use crate::FakeDatabase;

    #[tokio::test]
    async fn writes_land_at_commit_and_vanish_at_rollback_abort_or_drop() {
        let db = FakeDatabase::new();
        let table: FakeTable<u32, &'static str> = FakeTable::new();

        let tx = db.begin().await.expect("begin");
        table.upsert(&tx, 1, "one").expect("write");
        table.upsert(&tx, 2, "two").expect("write");
        assert_eq!(table.get(&1), None, "not visible before the commit");
        assert_eq!(table.get_in(&tx, &1).expect("read"), Some("one"));
        tx.commit().await.expect("commit");
        assert_eq!(table.rows().len(), 2);

        let tx = db.begin().await.expect("begin");
        table.update(&tx, 1, |_| None).expect("delete");
        tx.rollback().await.expect("rollback");
        assert_eq!(table.get(&1), Some("one"), "rolled back");

        let tx = db.begin().await.expect("begin");
        assert_eq!(table.delete_where(&tx, |_, _| true).expect("delete"), 2);
        tx.abort();
        assert!(table.upsert(&tx, 3, "three").is_err(), "aborted: refused");
        drop(tx);
        assert_eq!(
            table.rows().len(),
            2,
            "aborted and dropped: nothing changed"
        );

        let tx = db.begin().await.expect("begin");
        table.upsert(&tx, 3, "three").expect("write");
        drop(tx);
        assert_eq!(table.get(&3), None, "dropped open: rolled back");
    }
}
