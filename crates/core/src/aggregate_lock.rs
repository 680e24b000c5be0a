//! The pessimistic per-aggregate write lock: writers to one aggregate instance queue on a
//! transaction-scoped lock keyed `relay:aggregate:{type}:{id}` instead of racing and retrying.
//!
//! Take it inside the command **before** loading the aggregate (lock, then load, decide, append,
//! commit). It is released when the unit-of-work transaction ends. Optimistic concurrency (the
//! expected-version check on append) stays on underneath; the lock only removes the conflicts.
//!
//! [`DistributedAggregateWriteLock`] is the one implementation: it builds the key and delegates
//! to any [`DistributedLock`], so the same wrapper runs over the testkit fake and over Postgres.
//!
//! ```
//! use lockstep_core::{aggregate_key, AggregateType};
//! use uuid::Uuid;
//!
//! let key = aggregate_key(&AggregateType::new("StockItem")?, Uuid::nil());
//! assert_eq!(key.as_str(), "relay:aggregate:StockItem:00000000000000000000000000000000");
//! # Ok::<(), lockstep_core::Error>(())
//! ```

use std::borrow::Cow;
use std::future::Future;
use std::time::Duration;

use uuid::Uuid;

use crate::distributed_lock::DistributedLock;
use crate::error::Result;
use crate::ids::AggregateType;
use crate::resource_key::ResourceKey;

/// The prefix of every aggregate write-lock key.
pub const AGGREGATE_KEY_PREFIX: &str = "relay:aggregate:";

/// The write-lock key of one aggregate: `relay:aggregate:{type}:{id}`, the id as 32 lowercase
/// hex digits.
pub fn aggregate_key(aggregate_type: &AggregateType, id: Uuid) -> ResourceKey {
    let key = format!(
        "{AGGREGATE_KEY_PREFIX}{}:{}",
        aggregate_type.as_str(),
        id.simple()
    );
    // Validated type (≤ 200 chars, no NUL) + fixed-size id always makes a valid key.
    ResourceKey::new(key).unwrap_or_else(|e| unreachable!("aggregate key is valid: {e}"))
}

/// What names an aggregate type in the write-lock calls: an [`AggregateType`] validated once
/// (used as is, nothing checked per call), or text as a convenience (validated on every call:
/// a blank type or one containing `:` is an [`crate::ErrorKind::InvalidInput`] error and locks
/// nothing).
///
/// ```
/// use lockstep_core::{AggregateType, AsAggregateType};
///
/// let stock = AggregateType::new("StockItem")?; // validated once, e.g. in a `static`/field
/// assert_eq!(stock.to_aggregate_type()?.as_str(), "StockItem");
/// assert_eq!("StockItem".to_aggregate_type()?.as_str(), "StockItem");
/// assert!("A:B".to_aggregate_type().is_err());
/// # Ok::<(), lockstep_core::Error>(())
/// ```
pub trait AsAggregateType: Sync {
    /// The validated type: borrowed when it already is one.
    fn to_aggregate_type(&self) -> Result<Cow<'_, AggregateType>>;
}

impl AsAggregateType for AggregateType {
    fn to_aggregate_type(&self) -> Result<Cow<'_, AggregateType>> {
        Ok(Cow::Borrowed(self))
    }
}

impl AsAggregateType for str {
    fn to_aggregate_type(&self) -> Result<Cow<'_, AggregateType>> {
        AggregateType::new(self).map(Cow::Owned)
    }
}

impl AsAggregateType for String {
    fn to_aggregate_type(&self) -> Result<Cow<'_, AggregateType>> {
        self.as_str().to_aggregate_type()
    }
}

impl<T: AsAggregateType + ?Sized> AsAggregateType for &T {
    fn to_aggregate_type(&self) -> Result<Cow<'_, AggregateType>> {
        (**self).to_aggregate_type()
    }
}

/// Per-aggregate write lock on the unit-of-work transaction `Tx`.
///
/// The aggregate type is an `&AggregateType` (validated once, see [`AggregateType::new`]) or,
/// as a convenience, a `&str` validated on every call ([`AsAggregateType`]): a blank type or
/// one containing `:` is an [`crate::ErrorKind::InvalidInput`] error and locks nothing.
pub trait AggregateWriteLock<Tx: ?Sized + Sync>: Send + Sync {
    /// Waits until this transaction holds the aggregate's write lock.
    fn acquire<'a, T: AsAggregateType + ?Sized>(
        &'a self,
        tx: &'a Tx,
        aggregate_type: &'a T,
        id: Uuid,
    ) -> impl Future<Output = Result<()>> + Send + 'a;

    /// Takes the aggregate's write lock without waiting; `Ok(false)` if another writer holds it.
    fn try_acquire<'a, T: AsAggregateType + ?Sized>(
        &'a self,
        tx: &'a Tx,
        aggregate_type: &'a T,
        id: Uuid,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;

    /// Locks several aggregates in one canonical order (sorted by key, duplicates once), so two
    /// commands locking the same aggregates in any argument order cannot deadlock. Validates
    /// every type before taking any lock.
    fn acquire_all<'a, T: AsAggregateType>(
        &'a self,
        tx: &'a Tx,
        aggregates: &'a [(T, Uuid)],
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        async move {
            for (aggregate_type, id) in canonical_order(aggregates)? {
                self.acquire(tx, &aggregate_type, id).await?;
            }
            Ok(())
        }
    }
}

/// Validates and sorts aggregates into the canonical locking order (by key), without duplicates.
pub fn canonical_order<T: AsAggregateType>(
    aggregates: &[(T, Uuid)],
) -> Result<Vec<(AggregateType, Uuid)>> {
    let mut keyed = aggregates
        .iter()
        .map(|(t, id)| {
            let t = t.to_aggregate_type()?.into_owned();
            Ok((aggregate_key(&t, *id), (t, *id)))
        })
        .collect::<Result<Vec<_>>>()?;
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    keyed.dedup_by(|a, b| a.0 == b.0);
    Ok(keyed.into_iter().map(|(_, agg)| agg).collect())
}

/// The aggregate write lock over any [`DistributedLock`]: builds the key, delegates.
#[derive(Debug, Clone)]
pub struct DistributedAggregateWriteLock<L> {
    lock: L,
    timeout: Option<Duration>,
}

impl<L> DistributedAggregateWriteLock<L> {
    /// Wraps a distributed lock; blocking acquires wait without limit.
    pub fn new(lock: L) -> Self {
        DistributedAggregateWriteLock {
            lock,
            timeout: None,
        }
    }

    /// Bounds how long [`AggregateWriteLock::acquire`] waits before failing with
    /// [`crate::ErrorKind::LockTimeout`].
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The wrapped distributed lock.
    pub fn inner(&self) -> &L {
        &self.lock
    }

    /// The key this lock uses for an aggregate (a `&str` type is validated first).
    pub fn resource_key<T: AsAggregateType + ?Sized>(
        aggregate_type: &T,
        id: Uuid,
    ) -> Result<ResourceKey> {
        Ok(aggregate_key(&*aggregate_type.to_aggregate_type()?, id))
    }
}

impl<Tx, L> AggregateWriteLock<Tx> for DistributedAggregateWriteLock<L>
where
    Tx: ?Sized + Sync,
    L: DistributedLock<Tx>,
{
    async fn acquire<T: AsAggregateType + ?Sized>(
        &self,
        tx: &Tx,
        aggregate_type: &T,
        id: Uuid,
    ) -> Result<()> {
        let key = Self::resource_key(aggregate_type, id)?;
        self.lock
            .acquire_for_transaction(tx, &key, self.timeout)
            .await
    }

    async fn try_acquire<T: AsAggregateType + ?Sized>(
        &self,
        tx: &Tx,
        aggregate_type: &T,
        id: Uuid,
    ) -> Result<bool> {
        let key = Self::resource_key(aggregate_type, id)?;
        self.lock.try_acquire_for_transaction(tx, &key).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn key_is_namespaced_by_type_and_lowercase_simple_id() {
        let id = Uuid::parse_str("0123456789ABCDEF0123456789ABCDEF").expect("uuid");
        let key = DistributedAggregateWriteLock::<()>::resource_key("StockItem", id).expect("key");
        assert_eq!(
            key.as_str(),
            "relay:aggregate:StockItem:0123456789abcdef0123456789abcdef"
        );
        let other = DistributedAggregateWriteLock::<()>::resource_key("Order", id).expect("key");
        assert_ne!(key, other);
    }

    #[test]
    fn blank_or_colon_types_are_invalid_input() {
        for bad in ["", "  ", "A:B"] {
            let err = DistributedAggregateWriteLock::<()>::resource_key(bad, Uuid::nil())
                .expect_err("refused");
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
        }
    }

    #[test]
    fn canonical_order_sorts_by_key_and_drops_duplicates() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let forward = canonical_order(&[("S", a), ("S", b), ("S", a)]).expect("valid");
        let backward = canonical_order(&[("S", b), ("S", a)]).expect("valid");
        let s = AggregateType::new("S").expect("valid");
        assert_eq!(forward, vec![(s.clone(), a), (s.clone(), b)]);
        assert_eq!(forward, backward);
        assert!(canonical_order(&[("S", a), ("", b)]).is_err());
        let typed = canonical_order(&[(s.clone(), b), (s, a)]).expect("valid");
        assert_eq!(typed, forward);
    }

    #[test]
    fn a_validated_type_and_its_text_name_the_same_key() {
        let id = Uuid::from_u128(7);
        let stock = AggregateType::new("StockItem").expect("valid");
        assert_eq!(
            DistributedAggregateWriteLock::<()>::resource_key(&stock, id).expect("key"),
            DistributedAggregateWriteLock::<()>::resource_key("StockItem", id).expect("key")
        );
    }
}
