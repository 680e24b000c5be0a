//! # lockstep-example-service-sqlx
//!
//! The account service of `lockstep-example-service`, for a team on sqlx: the application owns
//! its `sqlx::PgPool`, lockstep is wired from it (`SqlxDatabase::new(pool)`), and the
//! application's own rows commit in lockstep's unit of work, with the events or not at all.
//! The domain — the account, its decider and command handlers (`Accounts<S, E>`, generic over
//! the transaction source and the event store) — is the tokio-postgres sample's, reused on
//! `SqlxDatabase` and `PgEventStore::for_sqlx`.
//!
//! - [`command`]: `POST /accounts/{id}/commands` under the account's write lock; with an
//!   `Idempotency-Key` header, the key's row (the application's own table, written with
//!   `sqlx::query` on the transaction's connection) commits with the command's events.
//! - [`statement`]: the daily statement, a table perspective written once, with sqlx, in the
//!   worker's transaction, and its route, which waits until the caller's own write is applied.
//! - [`wiring`]: the routes and the perspective worker on one `SqlxDatabase`.
//! - `main`: serves on `SERVICE_ADDR` (default `127.0.0.1:3000`) on the database at
//!   `DATABASE_URL`, which is required: sqlx has no in-memory mode (the tokio-postgres sample
//!   runs on the testkit's fakes without it). lockstep's migrations run first, on the
//!   application's pool (`SqlxDatabase::migrate`).
//!
//! `tests/http.rs` runs the service on a fresh database and sends it requests over HTTP.

pub mod command;
pub mod statement;
pub mod wiring;

pub use lockstep_example_service::serve;
