//! [`BoxFuture`]: the boxed, `Send` future that the unit-of-work runners
//! ([`crate::TransactionSource::transaction`], [`crate::TransactionSource::transaction_with_retry`]),
//! the retry loop ([`crate::RetryPolicy::run`]) and the erased table perspectives
//! ([`crate::DynTablePerspective`]) take and return.
//!
//! A future whose type names only the lifetime of what it borrows is `Send` by its type, so a
//! caller spawned with concrete types never asks the compiler to prove it for every lifetime
//! (see [`crate::unit_of_work`]).

use std::future::Future;
use std::pin::Pin;

/// A boxed, `Send` future borrowing for `'a` (the same type as `futures::future::BoxFuture`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
