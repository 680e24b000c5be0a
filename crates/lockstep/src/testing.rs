//! One test body, run on the fakes and on a fresh PostgreSQL database (feature `testkit`; the
//! Postgres half with `postgres` too).
//!
//! An application's domain code is generic over the contracts (a [`TransactionSource`], an
//! [`AggregateWriteLock`], an [`EventStore`](lockstep_core::EventStore), …). Its tests are written the same way, once,
//! over a [`Backend`]: the stack an application wires, named by associated types. Two stacks
//! implement it:
//!
//! - [`Fakes`]: the testkit's in-memory fakes, all on one `FakeDatabase` (so a deadlock that
//!   spans them is reported, and every lock goes with its transaction);
//! - `Postgres` (with `postgres`): a database of its own, created for the test on the server
//!   of `DATABASE_URL` or the local one (`lockstep_testkit::pg_harness`), migrated, one
//!   `PgDatabase` on it and every Postgres backend built from that handle. The database is
//!   dropped after the test.
//! - `Sqlx` (with `sqlx`): the same on an `sqlx::PgPool` — one `SqlxDatabase` and every backend
//!   on `SqlxTransaction`s; `on_sqlx` runs the same body on the application's driver. A table
//!   perspective written with sqlx is tested there, on a real database, with no in-memory twin.
//!
//! [`on_fakes`] and `on_postgres` build a stack, run the body **in a task of its own**
//! (`tokio::spawn`: the body's future must be `Send` for the stack's concrete types, as a web
//! handler's is) and return what it returned; a panic in the body fails the test with the
//! body's own message. One `#[tokio::test]` per stack:
//!
//! ```
//! use lockstep::prelude::*;
//! use lockstep::testing::{Backend, on_fakes};
//!
//! /// Appends under the aggregate's write lock, then reads back: the same body for every stack.
//! async fn appends_and_reads_back<B: Backend>(b: B) {
//!     let (lock, store) = (b.aggregate_lock(), b.event_store());
//!     let sku = lockstep::Uuid::now_v7();
//!     let stream = StreamId::from_uuid(sku);
//!     let tx = b.source().begin().await.expect("begin");
//!     lock.acquire(&tx, "StockItem", sku).await.expect("lock");
//!     let event = NewEvent::new("Stocked", lockstep::serde_json::json!({ "units": 3 }))
//!         .expect("event");
//!     let version = store
//!         .append(&tx, stream, ExpectedVersion::NoStream, &[event])
//!         .await
//!         .expect("append");
//!     tx.commit().await.expect("commit");
//!     assert_eq!(version, 1);
//!
//!     let tx = b.source().begin().await.expect("begin");
//!     let history = store.load(&tx, stream).await.expect("load");
//!     assert_eq!(history[0].event_type, "Stocked", "on {}", B::NAME);
//! }
//!
//! // #[tokio::test]
//! async fn appends_and_reads_back_on_the_fakes() {
//!     on_fakes(appends_and_reads_back).await;
//! }
//!
//! // #[tokio::test]
//! // async fn appends_and_reads_back_on_postgres() {
//! //     lockstep::testing::on_postgres(appends_and_reads_back).await;
//! // }
//! # tokio::runtime::Builder::new_current_thread()
//! #     .enable_all()
//! #     .build()
//! #     .expect("runtime")
//! #     .block_on(appends_and_reads_back_on_the_fakes());
//! ```
//!
//! A body that needs more than the stack (a lock mode, a count) is a closure:
//! `on_fakes(|b| sale(b, LockMode::Pessimistic))`. One that checks what only one stack shows
//! (the fakes' lock table, a `pg_dump`) does it in that stack's test, after the shared body:
//! `on_fakes(|b| async move { sale(b.clone(), mode).await; assert!(b.database().is_idle()) })`.
//!
//! Why two calls and not one: a Rust closure cannot be generic, so one value cannot be called
//! with a `Fakes` and then with a `Postgres`; a generic `async fn` can be named twice.
//!
//! `fresh_database` (with `postgres`) is the Postgres half on its own: a migrated `PgDatabase` on a database of
//! the test's own, for tests that build their stack themselves.
//!
//! Like the testkit it is built on, this module is test support: its functions panic (failing
//! the test, saying why) where a database cannot be created, migrated or read.

use std::future::Future;

use lockstep_core::{
    AggregateWriteLock, DistributedLock, LeaseFence, PerspectiveStore, SnapshotStore,
    StreamLockAdmin, StreamLocker, Transaction, TransactionSource,
};

mod fakes;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlx")]
mod sqlx;

pub use fakes::{Fakes, on_fakes};
#[cfg(feature = "postgres")]
pub use postgres::{FreshDatabase, Postgres, fresh_database, fresh_database_with, on_postgres};
#[cfg(feature = "sqlx")]
pub use sqlx::{FreshSqlxDatabase, Sqlx, fresh_sqlx_database, on_sqlx};

/// One backend stack: what an application wires at its composition root, by type, on one
/// transaction type. Implemented by [`Fakes`], with `postgres` `Postgres`, with `sqlx` `Sqlx`;
/// see the [module docs](self).
///
/// Every backend the methods return is built from the stack's one transaction source, so they
/// share its transactions (and, on Postgres, its lock queue). A stack is cheap to clone: the
/// clones share everything.
pub trait Backend: Clone + Send + Sync + 'static {
    /// The stack's name in messages: `"fakes"`, `"postgres"` or `"sqlx"`.
    const NAME: &'static str;

    /// The transaction every contract below runs on.
    type Tx: Transaction;
    /// Where transactions come from (the worker's and the read models' source too).
    type Source: TransactionSource<Tx = Self::Tx> + Clone + 'static;
    /// Transaction-scoped locks by resource key.
    type DistributedLock: DistributedLock<Self::Tx> + Clone + 'static;
    /// The per-aggregate write lock, over [`Backend::DistributedLock`].
    type AggregateLock: AggregateWriteLock<Self::Tx> + Clone + 'static;
    /// The event store.
    type EventStore: SnapshotStore<Self::Tx> + Clone + 'static;
    /// The perspective store a worker and its read models run on.
    type PerspectiveStore: PerspectiveStore<Self::Tx> + Clone + 'static;
    /// Stream leases, their admin view and the fenced commit (hand it to a worker as
    /// `Some(Arc::new(b.stream_locker()))`).
    type StreamLocker: StreamLocker + StreamLockAdmin + LeaseFence<Self::Tx> + Clone + 'static;

    /// The transaction source.
    fn source(&self) -> &Self::Source;

    /// The distributed lock.
    fn distributed_lock(&self) -> Self::DistributedLock;

    /// The aggregate write lock.
    fn aggregate_lock(&self) -> Self::AggregateLock;

    /// The event store (every call returns a handle on the same events).
    fn event_store(&self) -> Self::EventStore;

    /// The perspective store, reading this stack's events.
    fn perspective_store(&self) -> Self::PerspectiveStore;

    /// The stream locker (default [`lockstep_core::StreamLockOptions`]).
    fn stream_locker(&self) -> Self::StreamLocker;

    /// How many statements wait for a lock right now: on the fakes, every wait on the fake
    /// database (a lock, a row, a version); on Postgres, the backends of the test's database
    /// whose `wait_event_type` is `Lock`.
    fn lock_waiters(&self) -> impl Future<Output = usize> + Send;

    /// Waits until at least `n` statements wait for a lock ([`Backend::lock_waiters`]): "the
    /// other writer queues now", asked of the stack instead of guessed with a sleep. Bounded:
    /// panics naming `what` after 60 s.
    fn until_lock_waiters(&self, n: usize, what: &str) -> impl Future<Output = ()> + Send;
}

/// Runs `body` in a task of its own and returns its output; a panic in it is resumed here, so
/// the test fails with the body's message.
async fn spawned<Fut>(body: Fut) -> Fut::Output
where
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    match tokio::spawn(body).await {
        Ok(output) => output,
        Err(failed) => match failed.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(cancelled) => panic!("the test body's task did not finish: {cancelled}"),
        },
    }
}
