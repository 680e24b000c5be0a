//! # lockstep-pg-advisory
//!
//! The PostgreSQL advisory-lock backend of lockstep's lock contracts (`lockstep-core`). It
//! depends on `lockstep-core` and `lockstep-pg` only; the in-process queue, the deadline and
//! cancel-on-drop are `lockstep-pg`'s [`LockQueue`](lockstep_pg::LockQueue), which the event
//! store's `load_locked` shares.
//!
//! - [`PgDistributedLock`] implements [`DistributedLock`](lockstep_core::DistributedLock)
//!   for the owned [`PgTransaction`](lockstep_pg::PgTransaction): a **transaction-scoped**
//!   advisory lock (`pg_advisory_xact_lock`) taken on the caller's own unit-of-work
//!   transaction, released by the server at commit or rollback — and when the client dies.
//!   (Not for a borrowed `tokio_postgres::Transaction` or `deadpool_postgres::Transaction`:
//!   after an abandoned wait the connection must be closed, which only a transaction that owns
//!   it can do; see [`PgDistributedLock`].)
//! - It also implements [`SessionLocks`](lockstep_core::SessionLocks): a **session-scoped**
//!   lock held by a [`PgSessionGuard`] that owns its pooled connection ([`session`]). The lock
//!   is built with its pool, so session locks are always available. A session lock lives as
//!   long as its connection: [`PgSessionGuard::is_held`] tells a holder whether it still has
//!   it (a lost connection loses the lock silently otherwise), and a release never pools a
//!   connection left inside a transaction block.
//! - [`PgAggregateWriteLock`] is the per-aggregate write lock
//!   `relay:aggregate:{type}:{id}`: the pure
//!   [`DistributedAggregateWriteLock`](lockstep_core::DistributedAggregateWriteLock) of
//!   `lockstep-core` over this lock.
//!
//! ```no_run
//! # async fn demo(db: lockstep_pg::PgDatabase) -> lockstep_core::Result<()> {
//! use lockstep_core::{AggregateWriteLock, Transaction, TransactionSource};
//! use lockstep_pg_advisory::PgDistributedLock;
//!
//! db.migrate().await?; // the lock statements call SQL functions of the schema
//! let aggregate_lock = PgDistributedLock::new(&db).aggregate_write_lock();
//!
//! let tx = db.begin().await?;
//! let sku = uuid::Uuid::now_v7();
//! aggregate_lock.acquire(&tx, "StockItem", sku).await?; // lock first …
//! // … then load, decide, append on &tx …
//! tx.commit().await?; // the server releases the lock
//! # Ok(()) }
//! ```
//!
//! # Keys
//!
//! A [`ResourceKey`](lockstep_core::ResourceKey) maps to the `bigint` advisory key by
//! [`ResourceKey::advisory_key`](lockstep_core::ResourceKey::advisory_key) (first 8 bytes of
//! SHA-256, big-endian). The schema has the same function in SQL,
//! `lockstep_advisory_key(text)`, and a view `lockstep_advisory_locks` that puts the key back
//! together from `pg_locks` (which shows a `bigint` advisory key as `classid` = high 32 bits,
//! `objid` = low 32 bits, `objsubid = 1`). Who holds or waits for an aggregate's lock:
//!
//! ```sql
//! SELECT pid, granted, state, transaction_age
//! FROM lockstep_advisory_locks
//! WHERE advisory_key = lockstep_advisory_key('relay:aggregate:StockItem:0123456789abcdef0123456789abcdef');
//! ```
//!
//! # Semantics (see `docs/adr/0003-advisory-lock-design.md`)
//!
//! - **Schema**: every lock statement calls the SQL function `lockstep_advisory_lock`
//!   (`migrations/functions/lockstep_advisory_lock.sql`; it tries a free lock first, ADR
//!   0028), the one place where the protocol below — isolation check, `lock_timeout` set for
//!   the wait and restored — is written (the event store's `lockstep_lock_and_load` calls it
//!   too). Apply the schema
//!   first with [`lockstep_pg::migrate()`].
//! - **Timeouts** map to a transaction-local `lock_timeout` for the one statement (restored in
//!   the same statement) and fail with [`ErrorKind::LockTimeout`](lockstep_core::ErrorKind).
//!   As in plain PostgreSQL, a failed wait **aborts the caller's transaction**: roll it back
//!   and retry in a new one. The testkit fake behaves the same. (No savepoint: a lock taken
//!   inside a savepoint is released when the savepoint is rolled back, which is exactly the
//!   silent-loss hazard below.)
//! - **Cancellation**: dropping a waiting acquire sends a cancel request for the connection
//!   (tokio-postgres sends nothing on drop), so the server-side wait ends at once and the
//!   backend never gets the lock for a caller that is gone. The request is a new connection to
//!   the server, made with the TLS connector of the [`lockstep_pg::PgDatabase`] the lock was
//!   built from (`PgDatabaseBuilder::tls`; wired by hand, [`PgDistributedLock::with_cancel_tls`];
//!   default: none). The transaction's connection is closed rather than pooled
//!   when the transaction ends (a late request must not cancel the next borrower's statement);
//!   a session lock's waiting connection is closed at once. After a dropped acquire the
//!   transaction's state is unspecified (aborted by the cancel, or holding the lock if the
//!   grant won the race, or untouched if it was still queued in process): roll it back.
//! - **SQLSTATEs** map through `lockstep-pg`: `55P03` → `LockTimeout`, `57014` →
//!   `Cancelled`, `40P01` → `Deadlock`, `25P02` → `TransactionAborted`, `08xxx`/`57P0x`/I/O →
//!   `ConnectionLost`. Never by message text.
//! - **Isolation**: lock-then-load needs READ COMMITTED (each statement sees the latest
//!   commits). The isolation level is checked **in the lock statement itself** (no extra round
//!   trip) and a REPEATABLE READ or SERIALIZABLE transaction is refused with
//!   [`ErrorKind::Unsupported`](lockstep_core::ErrorKind) before any lock is taken.
//! - **Savepoints**: a transaction-scoped advisory lock taken inside a savepoint is released
//!   by `ROLLBACK TO SAVEPOINT`, silently. PostgreSQL offers no cheap way to detect a
//!   savepoint, so this is documented, not refused: take the lock at the top level of the
//!   transaction, before any savepoint.
//! - **In-process queue**: waiters of one process for one key queue in memory and only the
//!   head of the queue waits at the server, so a hot aggregate has one waiting backend per
//!   instance, not one per waiter. The permit is held only while waiting at the server (never
//!   while the lock is held, so a transaction that never commits cannot wedge the queue). A
//!   waiter that finds the queue busy first tries the lock without waiting (its transaction
//!   may already hold it: re-entrancy), and waits in memory at most
//!   [`PgDistributedLock::with_local_patience`] before going to the server anyway.
//! - **No extra round trip**: [`PgDistributedLock::acquire_then`] pipelines the lock
//!   statement with the statements that follow (the aggregate load), and the event store's
//!   `load_locked` calls a SQL function that locks, then loads, under the same queue, deadline
//!   and cancellation. Every statement is sent with `query_typed` (no prepare round trip).
//!
//! # Operations
//!
//! A transaction-scoped lock is released when its transaction ends — including when the
//! client process dies, **once the server notices**. A backend whose client vanished without
//! closing the socket (power loss, network partition) keeps its transaction, and the lock,
//! until the server finds out. Make that prompt:
//!
//! - `idle_in_transaction_session_timeout` (e.g. `30s`): ends sessions that sit in an open
//!   transaction without sending anything — a crashed or stalled holder.
//! - `tcp_keepalives_idle` / `tcp_keepalives_interval` / `tcp_keepalives_count` (server side;
//!   and `keepalives` on the client): detect a dead peer on an idle connection in seconds
//!   instead of the OS default of hours.
//! - `client_connection_check_interval` (PostgreSQL 14+, e.g. `5s`): lets a backend that is
//!   busy running a statement notice that its client is gone.
//!
//! **Connection poolers**: transaction-scoped locks work behind PgBouncer in transaction
//! pooling mode (the lock lives and dies with the transaction, which stays on one server
//! connection). Session-scoped locks do **not**: the unlock may run on another server
//! connection, and the lock stays with a connection another client now uses. Use session
//! locks only on direct connections or session-pooled ones: behind a transaction pooler a
//! session acquire refuses with `ErrorKind::Unsupported` naming the pooler (the handle is told
//! with `PgDatabaseBuilder::transaction_pooler(true)`, or finds out by itself where it can; see
//! [`session`]).

mod lock;
#[cfg(feature = "sqlx")]
mod on_sqlx;
pub mod session;
mod sql;

pub use lock::{PgAggregateWriteLock, PgDistributedLock};
#[cfg(feature = "sqlx")]
pub use on_sqlx::{SqlxAggregateWriteLock, SqlxDistributedLock, SqlxSessionGuard};
pub use session::PgSessionGuard;
