//! Behind a transaction pooler (PgBouncer `pool_mode = transaction`): what a handle knows about
//! the pooler in front of the server, and how it finds out.
//!
//! A transaction pooler gives a client a server connection for one transaction at a time: two
//! statements sent outside a transaction may run on two different server sessions. What lives
//! in a session therefore does not carry from one statement to the next — a named prepared
//! statement, a session setting, a session-scoped advisory lock. lockstep copes with the first
//! (its statements outside a transaction are unnamed behind a pooler, one round trip each) and
//! refuses the last: a session lock could be left on a server connection that other clients then
//! use. Everything inside a transaction is fine: the pooler keeps the transaction on one server
//! connection.
//!
//! A handle learns about the pooler in three ways:
//!
//! 1. it is told: [`PgDatabaseBuilder::transaction_pooler`](crate::PgDatabaseBuilder::transaction_pooler)
//!    (`true`: a transaction pooler; `false`: connected directly or through a pooler in session
//!    mode — no probe then);
//! 2. it probes ([`PgDatabase::detect_transaction_pooler`](crate::PgDatabase::detect_transaction_pooler),
//!    which the session locks call before their first lock when the handle was not told): two of
//!    the pool's connections ask the server for their backend's process id
//!    (`pg_backend_pid()`) while one of them holds a transaction open. A client connected
//!    directly always sees its own backend; behind a transaction pooler a client sees another
//!    client's backend, or two backends in a row. The probe proves a pooler when it sees one, but
//!    it can miss one: a pooler that happens to hand each client the same server connection again
//!    looks like a direct connection. So a deployment behind PgBouncer in transaction mode says so
//!    with the builder setting;
//! 3. it sees one: a prepared statement that vanished between two statements (SQLSTATE `26000`),
//!    or a statement name already taken by another client's session (`42P05`), can only happen
//!    behind a transaction pooler; the stream locker then switches the handle to the pooler's
//!    path and runs the statement again unnamed (it had not run).
//!
//! What the pooler itself reports cannot tell: PgBouncer 1.18 forwards the server's parameters
//! (`server_version`, `application_name`, …) unchanged and answers `SHOW` on the server's
//! behalf only on its admin console, a database the application does not connect to. Its
//! cancel key differs from the server's backend process id, but the key is not visible through
//! `tokio-postgres`, and PgBouncer in session mode (where session locks work) rewrites it too.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use lockstep_core::{Error, ErrorKind, Result};
use tokio_postgres::SimpleQueryMessage;

const UNKNOWN: u8 = 0;
const DIRECT: u8 = 1;
const TRANSACTION: u8 = 2;

/// How long the probe's one statement waits while the other connection holds a transaction
/// open: behind a pooler with a single server connection it would wait for that transaction.
const PROBE_STATEMENT_WAIT: Duration = Duration::from_secs(2);

/// What a handle (and every backend built from it) knows about a transaction pooler in front
/// of the server; shared by clones. Internal: see [`crate::internal`].
#[derive(Debug, Clone, Default)]
pub struct PoolerState(Arc<AtomicU8>);

impl PoolerState {
    /// A state told by the application: `Some(true)` a transaction pooler, `Some(false)` none
    /// (or a session pooler), `None` not told (probed or seen later).
    pub fn told(pooler: Option<bool>) -> PoolerState {
        let state = PoolerState::default();
        if let Some(pooler) = pooler {
            state.set(pooler);
        }
        state
    }

    /// `Some(true)` behind a transaction pooler, `Some(false)` known not to be, `None` unknown.
    pub fn get(&self) -> Option<bool> {
        match self.0.load(Ordering::Acquire) {
            TRANSACTION => Some(true),
            DIRECT => Some(false),
            _ => None,
        }
    }

    /// Whether statements outside a transaction must not rely on the session (known to be
    /// behind a transaction pooler).
    pub fn is_transaction_pooler(&self) -> bool {
        self.get() == Some(true)
    }

    /// Records what is now known. A pooler once seen stays seen.
    pub fn set(&self, pooler: bool) {
        if pooler {
            self.0.store(TRANSACTION, Ordering::Release);
        } else {
            let _ = self
                .0
                .compare_exchange(UNKNOWN, DIRECT, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// The handle saw what only a transaction pooler does (`what`): from now on it takes the
    /// pooler's path. Logged once.
    pub fn seen(&self, what: &str) {
        if self.0.swap(TRANSACTION, Ordering::AcqRel) != TRANSACTION {
            tracing::warn!(
                seen = what,
                "the server session changes between statements: behind a transaction pooler \
                 (PgBouncer pool_mode = transaction); statements outside a transaction now run \
                 unnamed. Say so with PgDatabaseBuilder::transaction_pooler(true)"
            );
        }
    }

    /// [`PoolerState::get`], probing `pool` first when unknown ([`probe`]); an inconclusive
    /// probe leaves the state unknown and answers `false`.
    pub async fn detect(&self, pool: &Pool, wait: Duration) -> Result<bool> {
        if let Some(known) = self.get() {
            return Ok(known);
        }
        match probe(pool, wait).await? {
            Some(pooler) => {
                self.set(pooler);
                Ok(self.is_transaction_pooler())
            }
            None => Ok(false),
        }
    }
}

/// The error of something that needs one server session across statements, behind a
/// transaction pooler: [`ErrorKind::Unsupported`], naming the pooler, `what` and the way out.
pub fn session_state_refused(what: &str) -> Error {
    Error::new(
        ErrorKind::Unsupported,
        format!(
            "{what} needs one server session across statements, which a transaction pooler \
             (PgBouncer pool_mode = transaction) does not give: the session could be handed to \
             another client while it still holds the state. Use a transaction-scoped lock \
             instead, or connect directly or through a pooler in session mode (then build the \
             handle with PgDatabaseBuilder::transaction_pooler(false))"
        ),
    )
}

/// Whether the sessions behind `pool` change between statements: `Some(true)` when a
/// transaction pooler was seen, `Some(false)` when the probe ran and saw none, `None` when it
/// could not run (a pool of one connection, fewer than two connections free within `wait`, or
/// its statement waited longer than 2 s). Sends four short statements on two connections
/// (simple queries: nothing named, nothing left behind) and rolls back the one transaction it
/// opens.
pub async fn probe(pool: &Pool, wait: Duration) -> Result<Option<bool>> {
    if pool.status().max_size < 2 {
        // Two connections at once are the probe: a pool of one cannot run it.
        return Ok(None);
    }
    let a = crate::pool::checkout(pool, wait).await?;
    // The second connection only if one is free or can be opened now: the probe never makes a
    // caller wait for another borrower.
    let b = match pool
        .timeout_get(&deadpool_postgres::Timeouts {
            wait: Some(Duration::ZERO),
            create: Some(wait),
            recycle: Some(wait),
        })
        .await
    {
        Ok(b) => b,
        Err(_) => return Ok(None),
    };
    let first = backend_pid(&a, "probing for a transaction pooler").await?;
    b.batch_execute("BEGIN")
        .await
        .map_err(|e| crate::map_error(e, "probing for a transaction pooler"))?;
    let pinned = backend_pid(&b, "probing for a transaction pooler").await;
    let again = tokio::time::timeout(PROBE_STATEMENT_WAIT, backend_pid(&a, "probing again")).await;
    let rolled_back = b.batch_execute("ROLLBACK").await;
    let pinned = pinned?;
    if rolled_back.is_err() {
        let _ = Object::take(b);
    }
    let again = match again {
        Ok(again) => again?,
        Err(_) => {
            // Still waiting for a server connection: never pool a connection mid-statement.
            let _ = Object::take(a);
            return Ok(None);
        }
    };
    Ok(Some(pinned == first || again != first))
}

async fn backend_pid(client: &tokio_postgres::Client, doing: &str) -> Result<i32> {
    let messages = client
        .simple_query("SELECT pg_backend_pid()")
        .await
        .map_err(|e| crate::map_error(e, doing))?;
    messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0).and_then(|pid| pid.parse().ok()),
            _ => None,
        })
        .ok_or_else(|| Error::new(ErrorKind::Backend, format!("{doing}: no backend pid")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn told_probed_and_seen_states_are_shared_and_a_pooler_seen_stays_seen() {
        assert_eq!(PoolerState::told(None).get(), None);
        assert_eq!(PoolerState::told(Some(true)).get(), Some(true));
        let direct = PoolerState::told(Some(false));
        assert_eq!(direct.get(), Some(false));
        let clone = direct.clone();
        clone.seen("a vanished prepared statement");
        assert_eq!(direct.get(), Some(true), "clones share what is known");
        direct.set(false);
        assert!(
            direct.is_transaction_pooler(),
            "a pooler once seen stays seen"
        );
        let unknown = PoolerState::default();
        unknown.set(false);
        assert_eq!(unknown.get(), Some(false));
    }

    #[test]
    fn the_refusal_names_the_pooler_and_the_way_out() {
        let e = session_state_refused("a session-scoped advisory lock");
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        let message = e.to_string();
        assert!(
            message.contains("PgBouncer pool_mode = transaction"),
            "{message}"
        );
        assert!(message.contains("transaction_pooler(false)"), "{message}");
    }
}
