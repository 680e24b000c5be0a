//! The reliability suite of issue 8, as library code so that the same scenarios run twice: short
//! in `cargo test` (`tests/tests/reliability_*.rs`, `tests/tests/model.rs`) and long behind
//! `cargo run --release -p lockstep-bench -- reliability`, which ends with the one line
//! `reliability violations=<n> lost=<n> duplicated=<n> panics=<n> cases=<n>`.
//!
//! Every scenario returns a [`Tally`]: how many cases it ran and what went wrong. A scenario
//! never asserts: it counts, so the long run reports every failure instead of stopping at the
//! first, and the short tests assert that the counts are zero (and print the details).
//!
//! - [`audit`] — mutual exclusion on the database clock: instances × pairs with random holds,
//!   stalls past the lock timeout and fenced commits; no two critical sections on one pair
//!   overlap and epochs only grow.
//! - [`faults`] — a PostgreSQL restart on a server of its own ([`server`]) while leases are held
//!   and advisory waits are blocked, `pg_terminate_backend` of a keepalive's connection and of a
//!   lock holder, a keepalive that stalls.
//! - [`cancel`] — a dropped future at every await point of every operation: no statement left
//!   running, no lease or lock left behind.
//! - [`model`] — fake = Postgres by model: proptest sequences of lease operations (with time
//!   advancing) and of transaction-lock operations run on the in-memory implementation and on
//!   PostgreSQL; every observable outcome must agree.
//! - [`bad_input`] — every constructor's limits and every bad-input case is a typed error that
//!   changes nothing (the tables are checksummed before and after).
//! - [`workers`] — perspective worker processes `kill -9`ed (and stopped) at random while events,
//!   some of them late, are appended: every perspective state equals the fold of its events,
//!   nothing lost or applied twice. The same fleet also runs through primary failovers.
//! - [`failover`] — the primary of a streaming pair ([`replication`]) killed and its standby
//!   promoted under commands (the aggregate lock, the combiner) and under a worker fleet: no
//!   acknowledged write lost (with synchronous replication), no wrong answer, exact folds, and a
//!   fence that refuses a holder whose epoch the new primary never saw.
//!
//! The scenarios that exercise a backend on pools of their own run on either [`Driver`], one
//! implementation each: [`audit`] ([`audit::AuditConfig::driver`]), [`cancel`]
//! ([`cancel::run_on`]) and the relay parts of [`faults`] ([`faults::run_on`]) build their stack
//! from a deadpool pool or from an `sqlx::PgPool` (`SqlxDatabase::new`,
//! `PgStreamLocker::for_sqlx`, `PgEventStore::for_sqlx`, `SqlxTransaction`). The worker
//! processes of [`workers`] and [`failover`] are tokio-postgres programs.

pub mod audit;
pub mod bad_input;
pub mod cancel;
pub mod failover;
pub mod faults;
pub mod model;
pub mod replication;
pub mod server;
pub mod workers;

use std::fmt;

/// What a scenario ran and what went wrong. Added up over scenarios with [`Tally::merge`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    /// Broken promises: two holders at once, a fenced write by a non-holder, a lock or lease
    /// left behind, a statement left running, an untyped or wrong error, a table changed by
    /// bad input.
    pub violations: u64,
    /// Events (or acknowledged writes) that are missing where they must be.
    pub lost: u64,
    /// Events (or writes) applied or stored more than once.
    pub duplicated: u64,
    /// Panics caught in lockstep code (a task's `JoinError::is_panic`, `catch_unwind`).
    pub panics: u64,
    /// Cases run (a lease cycle, a fault injected, a cancellation point, a bad input).
    pub cases: u64,
    /// Primary failovers survived (a standby promoted while the work went on).
    pub failovers: u64,
    /// One line per failure, for the report (kept short: the first few hundred).
    pub details: Vec<String>,
}

/// How many details a tally keeps.
const MAX_DETAILS: usize = 200;

impl Tally {
    /// Records a broken promise.
    pub fn violation(&mut self, detail: impl Into<String>) {
        self.violations += 1;
        self.note(detail);
    }

    /// Records a lost event or write.
    pub fn lost(&mut self, detail: impl Into<String>) {
        self.lost += 1;
        self.note(detail);
    }

    /// Records a duplicated event or write.
    pub fn duplicated(&mut self, detail: impl Into<String>) {
        self.duplicated += 1;
        self.note(detail);
    }

    /// Records a panic.
    pub fn panic(&mut self, detail: impl Into<String>) {
        self.panics += 1;
        self.note(detail);
    }

    fn note(&mut self, detail: impl Into<String>) {
        if self.details.len() < MAX_DETAILS {
            self.details.push(detail.into());
        }
    }

    /// Adds another tally's counts and details to this one.
    pub fn merge(&mut self, other: Tally) {
        self.violations += other.violations;
        self.lost += other.lost;
        self.duplicated += other.duplicated;
        self.panics += other.panics;
        self.cases += other.cases;
        self.failovers += other.failovers;
        for d in other.details {
            self.note(d);
        }
    }

    /// Whether nothing went wrong.
    pub fn is_clean(&self) -> bool {
        self.violations == 0 && self.lost == 0 && self.duplicated == 0 && self.panics == 0
    }
}

/// The long run's last line: `reliability violations=<n> lost=<n> duplicated=<n> panics=<n>
/// cases=<n> failovers=<n>`.
impl fmt::Display for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "reliability violations={} lost={} duplicated={} panics={} cases={} failovers={}",
            self.violations, self.lost, self.duplicated, self.panics, self.cases, self.failovers
        )
    }
}

/// The driver a scenario's stack runs on: the same scenario code, with its backends built from
/// a deadpool pool (`PgStreamLocker::from_pool`, `PgTransaction`) or from an application's
/// `sqlx::PgPool` (`SqlxDatabase::new`, `PgStreamLocker::for_sqlx`, `SqlxTransaction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Driver {
    /// tokio-postgres on a deadpool pool.
    TokioPostgres,
    /// sqlx on an `sqlx::PgPool`.
    Sqlx,
}

impl Driver {
    /// Both drivers, tokio-postgres first.
    pub const ALL: [Driver; 2] = [Driver::TokioPostgres, Driver::Sqlx];
}

impl fmt::Display for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Driver::TokioPostgres => "tokio-postgres",
            Driver::Sqlx => "sqlx",
        })
    }
}

/// How long a scenario runs: the short suite in `cargo test`, the long run in the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// A few seconds per scenario (CI).
    Short,
    /// Minutes per scenario (`lockstep-bench reliability`).
    Long,
}
