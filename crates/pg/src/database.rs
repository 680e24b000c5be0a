//! [`PgDatabase`]: the one Postgres handle every lockstep backend is built from.
//!
//! A process builds it once — from a URL, a `tokio_postgres::Config` or a pool of its own — with
//! the pool's size, how long a checkout waits, the TLS connector (for new connections **and**
//! for the cancel requests that end abandoned waits) and the in-process lock queue's settings.
//! Then:
//!
//! - it is the unit-of-work source ([`lockstep_core::TransactionSource`], `Tx` =
//!   [`PgTransaction`]): `let tx = db.begin().await?; …; tx.commit().await?`;
//! - [`PgDatabase::migrate`] applies the schema and [`PgDatabase::check_schema`] says whether
//!   this build runs on the database's;
//! - every backend takes it — `PgDistributedLock::new(&db)`, `PgStreamLocker::new(&db, …)`,
//!   `PgEventStore::new(&db)` — so the aggregate lock and the event store's `load_locked` share
//!   one queue, and every cancel request uses the pool's TLS, by construction.
//!
//! Clones share everything (the pool, the queue).
//!
//! # A primary with standbys
//!
//! Give every server of the cluster and ask for the one that writes:
//! `postgres://app@db-a:5432,db-b:5432/app?target_session_attrs=read-write&connect_timeout=2`.
//! Each new connection tries the hosts in order and keeps the first that accepts writes, so
//! after a failover the pool's new connections reach the promoted standby. The pool's old
//! connections to the failed primary are closed with it and never handed out again; a statement
//! that reaches a server that cannot write (`read_only_sql_transaction`, a standby or a demoted
//! primary behind a name that moved) is [`ErrorKind::ConnectionLost`] — retryable — and its
//! connection is discarded rather than pooled. `connect_timeout` bounds the time a new
//! connection spends on a host that does not answer at all (a machine that vanished rather than
//! refused). What each replication setting guarantees through a failover is in the operations
//! guide.
//!
//! ```no_run
//! # async fn demo() -> lockstep_core::Result<()> {
//! use lockstep_core::{Transaction, TransactionSource};
//! use lockstep_pg::PgDatabase;
//!
//! let db = PgDatabase::builder()
//!     .url("postgres://app@db.internal/app")
//!     .max_connections(32)
//!     .build()?;
//! db.migrate().await?;
//! let tx = db.begin().await?;
//! // … lock, load, decide, append on &tx …
//! tx.commit().await?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use lockstep_core::{Error, ErrorKind, Result, TransactionSource};
use tokio_postgres::Socket;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};

use crate::advisory::LockQueue;
use crate::migrate::MigrationReport;
use crate::pooler::PoolerState;
use crate::transaction::PgTransaction;

/// The one Postgres handle: a pool, how long checkouts wait, and the lock queue (with the TLS
/// connector for cancel requests) that every backend built from it shares. See the
/// [module docs](self).
#[derive(Clone)]
pub struct PgDatabase {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    checkout_wait: Duration,
    queue: LockQueue,
    // Where the pool connects (database, hosts, ports, user; never the password), for errors.
    target: Option<String>,
    // Set once `ensure_schema` found a schema this build runs on; a failure is not remembered
    // (a `migrate` may fix it).
    schema_checked: std::sync::atomic::AtomicBool,
    // What is known about a transaction pooler in front of the server (told, probed or seen).
    pooler: PoolerState,
}

impl fmt::Debug for PgDatabase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The pool's configuration holds the connection string: never print it.
        f.debug_struct("PgDatabase")
            .field("target", &self.inner.target)
            .field("pool_status", &self.inner.pool.status())
            .field("checkout_wait", &self.inner.checkout_wait)
            .field("queue", &self.inner.queue)
            .field("transaction_pooler", &self.inner.pooler.get())
            .finish()
    }
}

impl PgDatabase {
    /// The default pool size of [`PgDatabase::builder`]: 16 connections.
    pub const DEFAULT_MAX_CONNECTIONS: usize = 16;

    /// A handle on the database at `url` (`postgres://user@host:port/database`), with the
    /// defaults: [`PgDatabase::DEFAULT_MAX_CONNECTIONS`], checkouts waiting at most
    /// [`crate::DEFAULT_CHECKOUT_WAIT`], no TLS, the lock queue on. Connects lazily: nothing is
    /// sent until the first checkout ([`PgDatabase::connect`] checks at once).
    ///
    /// A URL that does not parse is [`ErrorKind::InvalidInput`] (the message never repeats
    /// the URL, which may hold a password).
    pub fn from_url(url: &str) -> Result<PgDatabase> {
        PgDatabase::builder().url(url).build()
    }

    /// [`PgDatabase::from_url`], then one connection checked out and returned, so a wrong
    /// host, port, database or password is an error now, naming the target, rather than at
    /// the first unit of work.
    pub async fn connect(url: &str) -> Result<PgDatabase> {
        let db = PgDatabase::from_url(url)?;
        drop(db.checkout().await?);
        Ok(db)
    }

    /// A handle on a pool the application built itself, with the defaults: checkouts waiting
    /// at most [`crate::DEFAULT_CHECKOUT_WAIT`], cancel requests without TLS, the lock queue
    /// on. For a pool built with a TLS connector, use [`PgDatabaseBuilder::pool`] and
    /// [`PgDatabaseBuilder::tls`] with the same connector.
    pub fn from_pool(pool: Pool) -> PgDatabase {
        PgDatabase::builder().pool(pool).build_with_pool()
    }

    /// Everything configurable; see [`PgDatabaseBuilder`].
    pub fn builder() -> PgDatabaseBuilder {
        PgDatabaseBuilder::default()
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// How long a checkout waits for a free connection before failing with a retryable
    /// [`ErrorKind::ConnectionLost`].
    pub fn checkout_wait(&self) -> Duration {
        self.inner.checkout_wait
    }

    /// The in-process lock queue the backends built from this handle share.
    pub fn lock_queue(&self) -> &LockQueue {
        &self.inner.queue
    }

    /// Where the pool connects — `database "d" on host:port as user "u"`
    /// ([`crate::target::connection_target`]) — when the handle was built from a URL or a
    /// config (never the password); `None` for a pool of the application's.
    pub fn target(&self) -> Option<&str> {
        self.inner.target.as_deref()
    }

    /// Checks a connection out, waiting at most [`PgDatabase::checkout_wait`]. A failure says
    /// why once (the server's refusal with its SQLSTATE, `Connection refused`, a timeout) and
    /// names the target; it is never the password.
    pub async fn checkout(&self) -> Result<Object> {
        crate::pool::checkout_naming(
            &self.inner.pool,
            self.inner.checkout_wait,
            self.inner.target.as_deref(),
        )
        .await
    }

    /// What the handle knows about a transaction pooler (PgBouncer `pool_mode = transaction`)
    /// in front of the server: `Some(true)` behind one (told by
    /// [`PgDatabaseBuilder::transaction_pooler`], detected, or seen when a prepared statement
    /// vanished between two statements), `Some(false)` not (told, or a probe saw none), `None`
    /// not known yet.
    ///
    /// Behind a transaction pooler, lockstep's statements outside a transaction are sent unnamed
    /// (no prepared statement to lose between two statements) and session-scoped advisory locks
    /// refuse with [`ErrorKind::Unsupported`]; everything that runs in a transaction works as
    /// without the pooler. The operations guide's section "Behind PgBouncer" has the details.
    pub fn transaction_pooler(&self) -> Option<bool> {
        self.inner.pooler.get()
    }

    /// Whether the handle is behind a transaction pooler, probing the server when it does not
    /// know yet ([`PgDatabase::transaction_pooler`] is `None`); the answer is remembered by the
    /// handle and its clones. The session locks call it before their first lock.
    ///
    /// The probe checks out two connections (the second only if one is free at once: it never
    /// waits for another borrower) and asks for their server backend's process id while one of
    /// them holds a transaction open: connected directly, a client always sees its own backend;
    /// behind a transaction pooler it sees another client's, or a different one each time. It
    /// proves a pooler when it sees one but can miss one (a pooler that hands a client the same
    /// server connection again looks direct), so it answers `false` then without proving
    /// anything: a deployment behind PgBouncer in transaction mode says so with
    /// [`PgDatabaseBuilder::transaction_pooler`]. Four short statements; nothing named or
    /// left behind. When it cannot run (a pool of one connection, or no second connection
    /// free at once) it answers `false` and probes again next time.
    pub async fn detect_transaction_pooler(&self) -> Result<bool> {
        self.inner
            .pooler
            .detect(&self.inner.pool, self.inner.checkout_wait)
            .await
    }

    pub(crate) fn pooler_state(&self) -> &PoolerState {
        &self.inner.pooler
    }

    /// Applies lockstep's schema ([`crate::migrate()`]).
    pub async fn migrate(&self) -> Result<MigrationReport> {
        crate::migrate::migrate(&self.inner.pool).await
    }

    /// Where each of lockstep's migrations stands in this database, read only
    /// ([`crate::migrate::migration_status`]).
    pub async fn migration_status(&self) -> Result<crate::migrate::MigrationStatus> {
        crate::migrate::migration_status(&self.inner.pool).await
    }

    /// Whether this build can run on the database, read only ([`crate::migrate::check_schema`]):
    /// the installed schema version, or an [`ErrorKind::Unsupported`] error whose
    /// [`SchemaMismatch`](crate::migrate::SchemaMismatch) says to run `migrate` or to upgrade
    /// the binary.
    pub async fn check_schema(&self) -> Result<crate::migrate::InstalledSchema> {
        crate::migrate::check_schema(&self.inner.pool).await
    }

    /// [`PgDatabase::check_schema`] once per handle (and its clones): the first call that
    /// succeeds is remembered, and later calls return at once. The perspective worker's
    /// Postgres backends call it when they start, so a worker refuses a database it was not
    /// built for before it takes any work.
    pub async fn ensure_schema(&self) -> Result<()> {
        use std::sync::atomic::Ordering;
        if self.inner.schema_checked.load(Ordering::Acquire) {
            return Ok(());
        }
        self.check_schema().await?;
        self.inner.schema_checked.store(true, Ordering::Release);
        Ok(())
    }
}

/// Units of work on PostgreSQL: owned READ COMMITTED [`PgTransaction`]s on pooled connections.
///
/// ```no_run
/// # async fn demo(db: lockstep_pg::PgDatabase) -> lockstep_core::Result<()> {
/// use lockstep_core::{Transaction, TransactionSource};
///
/// let tx = db.begin().await?;
/// let row = tx.client().query_one("SELECT 1", &[]).await
///     .map_err(|e| lockstep_pg::map_error(e, "selecting one"))?;
/// let one: i32 = row.try_get(0).map_err(|e| lockstep_pg::map_error(e, "reading one"))?;
/// tx.commit().await?;
/// assert_eq!(one, 1);
/// # Ok(()) }
/// ```
impl TransactionSource for PgDatabase {
    type Tx = PgTransaction;

    async fn begin(&self) -> Result<PgTransaction> {
        PgTransaction::begin_on(self.checkout().await?).await
    }
}

type MakeManager = Box<dyn FnOnce(tokio_postgres::Config) -> Manager + Send>;

/// Builds a [`PgDatabase`]: where to connect ([`url`](Self::url), [`config`](Self::config) or an
/// existing [`pool`](Self::pool)), the pool's size, the checkout wait, TLS and the lock queue.
///
/// ```
/// use std::time::Duration;
/// # fn demo() -> lockstep_core::Result<()> {
/// let db = lockstep_pg::PgDatabase::builder()
///     .url("postgres://app@127.0.0.1:5432/app")
///     .max_connections(8)
///     .checkout_wait(Duration::from_secs(2))
///     .local_patience(Duration::from_millis(500))
///     .tls(tokio_postgres::NoTls)
///     .build()?;
/// assert_eq!(db.target(), Some(r#"database "app" on 127.0.0.1:5432 as user "app""#));
/// # Ok(()) }
/// # #[tokio::main(flavor = "current_thread")] async fn main() { demo().expect("built"); }
/// ```
#[must_use]
pub struct PgDatabaseBuilder {
    config: Option<std::result::Result<tokio_postgres::Config, Error>>,
    pool: Option<Pool>,
    max_connections: usize,
    checkout_wait: Duration,
    queue: LockQueue,
    make_manager: Option<MakeManager>,
    application_name: Option<String>,
    transaction_pooler: Option<bool>,
}

impl Default for PgDatabaseBuilder {
    fn default() -> Self {
        PgDatabaseBuilder {
            config: None,
            pool: None,
            max_connections: PgDatabase::DEFAULT_MAX_CONNECTIONS,
            checkout_wait: crate::DEFAULT_CHECKOUT_WAIT,
            queue: LockQueue::new(),
            application_name: None,
            make_manager: None,
            transaction_pooler: None,
        }
    }
}

impl fmt::Debug for PgDatabaseBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgDatabaseBuilder")
            .field("has_config", &self.config.is_some())
            .field("has_pool", &self.pool.is_some())
            .field("max_connections", &self.max_connections)
            .field("checkout_wait", &self.checkout_wait)
            .field("queue", &self.queue)
            .field("transaction_pooler", &self.transaction_pooler)
            .finish_non_exhaustive()
    }
}

impl PgDatabaseBuilder {
    /// Connect to `url` (`postgres://user[:password]@host[:port]/database[?options]`). A URL
    /// that does not parse fails [`build`](Self::build) with [`ErrorKind::InvalidInput`].
    pub fn url(mut self, url: &str) -> Self {
        // Never repeats the URL, which may hold a password (crate::target::parse_url).
        self.config = Some(crate::target::parse_url(url));
        self
    }

    /// Connect with `config`.
    pub fn config(mut self, config: tokio_postgres::Config) -> Self {
        self.config = Some(Ok(config));
        self
    }

    /// Use a pool the application built itself (its size and connector are its own; pass the
    /// connector it was built with to [`tls`](Self::tls) for the cancel requests). Instead of
    /// [`url`](Self::url) / [`config`](Self::config): both is an error at
    /// [`build`](Self::build).
    pub fn pool(mut self, pool: Pool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// At most `n` connections (default [`PgDatabase::DEFAULT_MAX_CONNECTIONS`]; see
    /// [`crate::pool`] for sizing). Ignored with a pool of the application's.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n;
        self
    }

    /// How long a checkout waits for a free connection (default
    /// [`crate::DEFAULT_CHECKOUT_WAIT`]).
    pub fn checkout_wait(mut self, wait: Duration) -> Self {
        self.checkout_wait = wait;
        self
    }

    /// The TLS connector: for the pool's new connections (with a URL or a config) and for the
    /// cancel requests that end abandoned waits, so the two can never disagree. Default
    /// `tokio_postgres::NoTls`.
    pub fn tls<T>(mut self, tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
        T::Stream: Sync + Send,
        T::TlsConnect: Sync + Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        self.queue = self.queue.with_cancel_tls(tls.clone());
        self.make_manager = Some(Box::new(move |config| {
            Manager::from_config(config, tls, manager_config())
        }));
        self
    }

    /// Turns the in-process lock queue on (default) or off; see
    /// [`LockQueue::with_local_queue`].
    pub fn local_queue(mut self, enabled: bool) -> Self {
        self.queue = self.queue.with_local_queue(enabled);
        self
    }

    /// How long a lock waiter queues in process before it waits at the server anyway; see
    /// [`LockQueue::with_local_patience`].
    pub fn local_patience(mut self, patience: Duration) -> Self {
        self.queue = self.queue.with_local_patience(patience);
        self
    }

    /// The `application_name` the pool's connections report to the server (in
    /// `pg_stat_activity`, and so in `lockstep locks advisory` and the status page), unless the
    /// URL or config sets one. Default: `lockstep`. Ignored for a pool of the application's.
    pub fn application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = Some(name.into());
        self
    }

    /// Whether the connections go through a transaction pooler (PgBouncer
    /// `pool_mode = transaction`): `true` says so, `false` says they do not (connected directly,
    /// or through a pooler in session mode, where a client keeps its server session). Not set,
    /// the handle finds out itself where it can ([`PgDatabase::detect_transaction_pooler`]),
    /// which may miss a pooler: set it when you know.
    ///
    /// Behind a transaction pooler, lockstep's statements outside a transaction are sent unnamed
    /// (one round trip each, parsed every time: no prepared statement that another server
    /// session lacks), and session-scoped advisory locks (`SessionLocks` of
    /// `lockstep-pg-advisory`) refuse with [`ErrorKind::Unsupported`] naming the pooler: a
    /// session lock would stay on a server connection that other clients then use. Units of
    /// work, transaction-scoped advisory locks, stream leases, the event and perspective
    /// stores, the worker, the combiner and [`PgDatabase::migrate`] work as without it.
    pub fn transaction_pooler(mut self, behind: bool) -> Self {
        self.transaction_pooler = Some(behind);
        self
    }

    /// The handle. Fails with [`ErrorKind::InvalidInput`] for a URL that does not parse, for
    /// no target at all, for both a target and a pool, or for `max_connections(0)`. Sends
    /// nothing to the server. Needs a tokio runtime (the pool's timeouts run on it).
    pub fn build(mut self) -> Result<PgDatabase> {
        let config = self.config.take();
        match (config, self.pool.is_some()) {
            (Some(_), true) => Err(Error::new(
                ErrorKind::InvalidInput,
                "a PgDatabase connects either to a URL / config or through a pool of the \
                 application's, not both",
            )),
            (None, true) => Ok(self.build_with_pool()),
            (None, false) => Err(Error::new(
                ErrorKind::InvalidInput,
                "a PgDatabase needs somewhere to connect: a URL, a config or a pool",
            )),
            (Some(config), false) => {
                let mut config = config?;
                // Who holds or waits for a lock is read from pg_stat_activity: name lockstep's
                // connections there, unless the application named them itself.
                if config.get_application_name().is_none() {
                    config.application_name(self.application_name.as_deref().unwrap_or("lockstep"));
                }
                if self.max_connections == 0 {
                    return Err(Error::new(
                        ErrorKind::InvalidInput,
                        "a PgDatabase needs at least one connection (max_connections(0))",
                    ));
                }
                let target = crate::target::connection_target(&config);
                let manager = match self.make_manager.take() {
                    Some(make) => make(config),
                    None => Manager::from_config(config, tokio_postgres::NoTls, manager_config()),
                };
                let pool = crate::pool::bounded_pool_within(
                    manager,
                    self.max_connections,
                    self.checkout_wait,
                )?;
                Ok(PgDatabase {
                    inner: Arc::new(Inner {
                        pool,
                        checkout_wait: self.checkout_wait,
                        queue: self.queue,
                        target: Some(target),
                        schema_checked: Default::default(),
                        pooler: PoolerState::told(self.transaction_pooler),
                    }),
                })
            }
        }
    }

    fn build_with_pool(self) -> PgDatabase {
        let pool = match self.pool {
            Some(pool) => pool,
            None => unreachable!("build_with_pool is only called with a pool"),
        };
        PgDatabase {
            inner: Arc::new(Inner {
                pool,
                checkout_wait: self.checkout_wait,
                queue: self.queue,
                target: None,
                schema_checked: Default::default(),
                pooler: PoolerState::told(self.transaction_pooler),
            }),
        }
    }
}

fn manager_config() -> ManagerConfig {
    // Fast recycling: a connection that a lockstep transaction could not prove clean is never
    // pooled (PgTransaction closes it), so a check query per checkout would buy nothing.
    ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_that_does_not_parse_is_invalid_input_without_echoing_it() {
        let err = PgDatabaseBuilder::default()
            .url("postgres://app:s3cret@db:notaport/x")
            .build()
            .expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }

    #[test]
    fn nowhere_to_connect_both_targets_or_no_connections_are_refused() {
        let none = PgDatabaseBuilder::default().build().expect_err("no target");
        assert_eq!(none.kind(), ErrorKind::InvalidInput);
        let zero = PgDatabaseBuilder::default()
            .url("postgres://app@db/app")
            .max_connections(0)
            .build()
            .expect_err("no connections");
        assert_eq!(zero.kind(), ErrorKind::InvalidInput);
    }
}
