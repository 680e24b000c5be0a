//! # lockstep-command
//!
//! The command runner: one way to run a command on an aggregate written as a
//! [`Decider`] — load, fold, decide, encode, append at the expected version, commit, retry a
//! conflict, tell a business refusal from a failure — in one of three [`Mode`]s chosen per
//! runner (that is, per aggregate type) by configuration:
//!
//! - [`Mode::Optimistic`]: no lock. Load, decide, append at the loaded version with the commit;
//!   a version conflict (another writer appended first) runs the whole unit of work again,
//!   loading anew, under the [`RetryPolicy`].
//! - [`Mode::Locked`]: the aggregate's write lock `relay:aggregate:{type}:{id}` first, in the
//!   transaction, then the load ([`lockstep_core::EventStore::load_locked`]): writers of one aggregate queue
//!   instead of racing. The version check stays on underneath.
//! - [`Mode::Combined`]: through the command combiner (`lockstep-combiner`): commands of one
//!   aggregate queue in the process and are decided in turn, one batch per lock and commit.
//!
//! Every mode answers the same way: [`Handled`] — the state after the command, the stream's
//! version and the events' ids — or a [`CommandError`]: the decider's own business error
//! ([`CommandError::Rejected`], never retried, nothing appended), a failure
//! ([`CommandError::Failed`]: nothing of the command was committed), or
//! [`CommandError::CommitUnknown`] (the `COMMIT`'s reply was lost: the command may have been
//! committed; its events' ids are given so the caller can look for them — never retried
//! blindly). Switching an aggregate between the modes is one line:
//!
//! ```no_run
//! use lockstep_command::{CommandError, CommandRunner, Mode};
//! # use lockstep_core::{AggregateType, Decider, NewEvent, RecordedEvent, Result, Uuid};
//! # struct Account(AggregateType);
//! # impl Decider for Account {
//! #     type State = u64; type Command = u64; type Event = u64; type Error = String;
//! #     fn aggregate_type(&self) -> &AggregateType { &self.0 }
//! #     fn initial_state(&self, _: Uuid) -> u64 { 100 }
//! #     async fn decide(&self, balance: &u64, n: &u64) -> std::result::Result<Vec<u64>, String> {
//! #         if n > balance { Err("insufficient funds".into()) } else { Ok(vec![*n]) } }
//! #     fn evolve(&self, balance: u64, n: &u64) -> u64 { balance - n }
//! #     fn encode(&self, n: &u64) -> Result<NewEvent> {
//! #         NewEvent::new("Withdrawn", lockstep_core::serde_json::json!({ "n": n })) }
//! #     fn decode(&self, e: &RecordedEvent) -> Result<u64> { Ok(e.payload["n"].as_u64().unwrap_or(0)) }
//! # }
//! # async fn demo(db: lockstep_testkit::FakeDatabase, store: lockstep_testkit::InMemoryEventStore, id: Uuid) -> Result<()> {
//! let accounts = CommandRunner::new(db, store, Account(AggregateType::new("Account")?), Mode::Locked);
//! match accounts.handle(id, 30).await {
//!     Ok(done) => println!("balance {} at version {}", done.state(), done.version()),
//!     Err(CommandError::Rejected(why)) => println!("refused: {why}"),
//!     Err(CommandError::CommitUnknown { event_ids, .. }) => println!("check {event_ids:?}"),
//!     Err(other) => println!("failed: {other}"),
//! }
//! # Ok(()) }
//! ```
//!
//! ## Which mode when
//!
//! Optimistic is the default of event sourcing and the cheapest when writers of one aggregate
//! rarely meet. When they do, the losers' work is wasted and retried: take the lock for that
//! aggregate type ([`Mode::Locked`]). When one aggregate is hot enough that its lock is the
//! bottleneck (one decision per commit), combine ([`Mode::Combined`]: one batch per commit).
//! Measure first; the guide's section on the command runner has the numbers.
//!
//! ## Inside the caller's unit of work
//!
//! [`CommandRunner::handle_in`] decides and appends on a transaction the caller began, without
//! committing: the application's other writes (an outbox row, a second aggregate) commit with
//! the command or not at all. Its errors are the caller's to retry (a [`CommandError`] is
//! [`Retryable`], so it fits [`TransactionSource::transaction_with_retry`]).
//!
//! ## What a command can count on
//!
//! - **A refusal is final.** The decider's business error is answered at once, the transaction
//!   rolled back, nothing appended; it is never retried. An event the decider cannot encode is
//!   [`ErrorKind::InvalidInput`], also never retried.
//! - **A conflict is retried, a lost commit is not.** A retryable failure (a version conflict,
//!   a deadlock, a lock timeout, a lost connection before the commit) runs the whole unit of
//!   work again, in a new transaction, on state loaded anew — so `decide` must have no side
//!   effects. A lost `COMMIT` reply is [`CommandError::CommitUnknown`] with the ids of the
//!   events the command appended; to make a command safe to send again, let
//!   [`Decider::encode`] choose its events' ids ([`lockstep_core::NewEvent::with_id`]): a
//!   second append of a stored id fails with [`ErrorKind::InvalidInput`] and writes nothing.
//! - **Cancelling is safe.** Dropping [`CommandRunner::handle`]'s future (a web request
//!   cancelled) drops the open transaction, which rolls back; dropped while its `COMMIT` is in
//!   flight, the command may have been committed, as with any unit of work. In
//!   [`Mode::Combined`], the combiner's rules apply: a command dropped before its batch took it
//!   is never decided; one dropped later is committed with its batch.
//!
//! Built on the `lockstep-core` contracts only, so it runs on the testkit's fakes and on
//! PostgreSQL alike. [`CommandRunner::handle`] needs a tokio runtime (the sleep between
//! retries; the combiner's batch tasks).

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lockstep_combiner::{CombineError, Combiner, CombinerOptions};
use lockstep_core::{
    AggregateType, Decider, Error, ErrorKind, ExpectedVersion, LockFirst, NewEvent, RetryPolicy,
    Retryable, SnapshotStore, StreamId, TransactionSource, aggregate_key, load_aggregate,
    save_snapshot_if_due, tokio_sleep,
};
use uuid::Uuid;

/// How a runner serializes the writers of one aggregate (see the [crate docs](crate)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Mode {
    /// No lock: load, decide, append at the loaded version; a conflict is retried.
    #[default]
    Optimistic,
    /// The aggregate's write lock first, then the load: writers queue instead of racing.
    Locked,
    /// Through the command combiner: one batch of queued commands per lock and commit.
    Combined,
}

/// A runner's configuration: its [`Mode`], how failures are retried and how long the write
/// lock is waited for. Every value is valid by its type; the defaults are on each setter.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunnerOptions {
    mode: Mode,
    retry: RetryPolicy,
    lock_timeout: LockTimeout,
    combiner: CombinerOptions,
}

/// The lock wait, defaulting to the combiner's default.
#[derive(Debug, Clone, Copy)]
struct LockTimeout(Option<Duration>);

impl Default for LockTimeout {
    fn default() -> Self {
        LockTimeout(Some(Duration::from_secs(10)))
    }
}

impl RunnerOptions {
    /// Options for `mode`, everything else by default.
    pub fn new(mode: Mode) -> Self {
        RunnerOptions::default().mode(mode)
    }

    /// The mode (default [`Mode::Optimistic`]).
    #[must_use]
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// How a retryable failure is retried, in every mode (default [`RetryPolicy::default`]).
    #[must_use]
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// How long [`Mode::Locked`], [`Mode::Combined`] and [`CommandRunner::handle_in`] in those
    /// modes wait for the aggregate's write lock before failing with a retryable
    /// [`ErrorKind::LockTimeout`] (default 10 s; `None`: without limit; at most
    /// [`lockstep_combiner::MAX_LOCK_TIMEOUT`]).
    #[must_use]
    pub fn lock_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.lock_timeout =
            LockTimeout(timeout.map(|t| t.min(lockstep_combiner::MAX_LOCK_TIMEOUT)));
        self
    }

    /// The combiner's batch bounds in [`Mode::Combined`] (default
    /// [`CombinerOptions::default`]); its retry policy and lock wait are this runner's.
    #[must_use]
    pub fn combiner(mut self, options: CombinerOptions) -> Self {
        self.combiner = options;
        self
    }

    /// The configured mode.
    pub fn current_mode(&self) -> Mode {
        self.mode
    }
}

/// A committed command (or, from [`CommandRunner::handle_in`], one appended on the caller's
/// transaction): the state after it, where its events went, and how many attempts it took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handled<S> {
    state: S,
    version: u64,
    event_ids: Vec<Uuid>,
    attempts: u32,
}

impl<S> Handled<S> {
    /// The aggregate's state right after the command's events.
    pub fn state(&self) -> &S {
        &self.state
    }

    /// The state, by value.
    pub fn into_state(self) -> S {
        self.state
    }

    /// The stream's version right after the command's events (the version of its last event;
    /// for a command that decided no events, the version its decision saw).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The version of the command's first event ([`Handled::version`] + 1 when it decided
    /// none).
    pub fn first_version(&self) -> u64 {
        self.version + 1 - self.event_ids.len() as u64
    }

    /// The ids of the command's events, in version order.
    pub fn event_ids(&self) -> &[Uuid] {
        &self.event_ids
    }

    /// Attempts it took (1 = no retry; in [`Mode::Combined`], its batch's attempts).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
}

/// Why a command was not carried out.
#[derive(Debug)]
#[non_exhaustive]
pub enum CommandError<E> {
    /// The decider refused the command: its own business error. Nothing was appended; never
    /// retried.
    Rejected(E),
    /// Nothing of the command was committed: a failure that was not retryable, or still failed
    /// when the retry policy was used up (retryable where it is), or an event the decider
    /// could not encode ([`ErrorKind::InvalidInput`]).
    Failed(Error),
    /// The `COMMIT`'s reply was lost: the command may or may not have been committed. Not
    /// retried; look for `event_ids` in the stream (empty when it decided no events).
    CommitUnknown {
        /// The error ([`ErrorKind::CommitUnknown`]), boxed to keep the answer small.
        error: Box<Error>,
        /// The ids of the command's events in the transaction whose commit is unknown.
        event_ids: Vec<Uuid>,
    },
}

impl<E> CommandError<E> {
    /// The lockstep error behind a failure (`None` for a rejection).
    pub fn error(&self) -> Option<&Error> {
        match self {
            CommandError::Rejected(_) => None,
            CommandError::Failed(error) => Some(error),
            CommandError::CommitUnknown { error, .. } => Some(error),
        }
    }

    /// The error's kind (`None` for a rejection).
    pub fn kind(&self) -> Option<ErrorKind> {
        self.error().map(Error::kind)
    }

    /// The business error, if the command was rejected.
    pub fn rejection(&self) -> Option<&E> {
        match self {
            CommandError::Rejected(e) => Some(e),
            _ => None,
        }
    }
}

impl<E> From<Error> for CommandError<E> {
    fn from(error: Error) -> Self {
        CommandError::Failed(error)
    }
}

impl<E> From<CombineError<E>> for CommandError<E> {
    fn from(error: CombineError<E>) -> Self {
        match error {
            CombineError::Rejected(e) => CommandError::Rejected(e),
            CombineError::Failed(error) => CommandError::Failed(error),
            CombineError::CommitUnknown { error, event_ids } => {
                CommandError::CommitUnknown { error, event_ids }
            }
            other => CommandError::Failed(Error::new(
                other.kind().unwrap_or(ErrorKind::Backend),
                "the combiner did not carry the command out",
            )),
        }
    }
}

impl<E> Retryable for CommandError<E> {
    fn is_retryable(&self) -> bool {
        matches!(self, CommandError::Failed(e) if e.is_retryable())
    }
}

impl<E: fmt::Display> fmt::Display for CommandError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommandError::Rejected(e) => write!(f, "command rejected: {e}"),
            CommandError::Failed(_) => {
                f.write_str("the command failed; nothing of it was committed")
            }
            CommandError::CommitUnknown { .. } => {
                f.write_str("the command may or may not have been committed")
            }
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for CommandError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// A command's answer.
pub type Outcome<D> = Result<Handled<<D as Decider>::State>, CommandError<<D as Decider>::Error>>;

/// Where decisions are made: here, or in the combiner (which owns the source and the decider).
enum Engine<Src, St, D: Decider> {
    Direct { source: Src, decider: D },
    Combined(Combiner<Src, St, D>),
}

struct Inner<Src, St, D: Decider> {
    aggregate_type: AggregateType,
    store: St,
    engine: Engine<Src, St, D>,
    options: RunnerOptions,
}

/// Runs a [`Decider`]'s commands in the configured [`Mode`] over a transaction source and an
/// event store. Cheap to clone (clones share the combiner's queues). See the
/// [crate docs](crate).
pub struct CommandRunner<Src, St, D: Decider> {
    inner: Arc<Inner<Src, St, D>>,
}

impl<Src, St, D: Decider> Clone for CommandRunner<Src, St, D> {
    fn clone(&self) -> Self {
        CommandRunner {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<Src, St, D: Decider> fmt::Debug for CommandRunner<Src, St, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommandRunner")
            .field("aggregate_type", &self.inner.aggregate_type)
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

impl<Src, St, D: Decider> CommandRunner<Src, St, D> {
    /// The options.
    pub fn options(&self) -> &RunnerOptions {
        &self.inner.options
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.inner.options.mode
    }
}

impl<Src, St, D> CommandRunner<Src, St, D>
where
    Src: TransactionSource + 'static,
    St: SnapshotStore<Src::Tx> + Clone + 'static,
    D: Decider + 'static,
    D::Command: 'static,
    D::Error: 'static,
    D::State: Clone + 'static,
    D::Event: 'static,
{
    /// A runner in `mode`, everything else by default ([`RunnerOptions::new`]).
    pub fn new(source: Src, store: St, decider: D, mode: Mode) -> Self {
        CommandRunner::with_options(source, store, decider, RunnerOptions::new(mode))
    }

    /// A runner with `options`. In [`Mode::Combined`] it starts a [`Combiner`] over the source,
    /// a clone of the store and the decider.
    pub fn with_options(source: Src, store: St, decider: D, options: RunnerOptions) -> Self {
        let aggregate_type = decider.aggregate_type().clone();
        let engine = match options.mode {
            Mode::Optimistic | Mode::Locked => Engine::Direct { source, decider },
            Mode::Combined => {
                let combiner_options = options
                    .combiner
                    .retry(options.retry)
                    .lock_timeout(options.lock_timeout.0);
                Engine::Combined(Combiner::with_options(
                    source,
                    store.clone(),
                    decider,
                    combiner_options,
                ))
            }
        };
        CommandRunner {
            inner: Arc::new(Inner {
                aggregate_type,
                store,
                engine,
                options,
            }),
        }
    }

    /// The decider.
    pub fn decider(&self) -> &D {
        match &self.inner.engine {
            Engine::Direct { decider, .. } => decider,
            Engine::Combined(combiner) => combiner.decider(),
        }
    }

    /// Runs `command` on aggregate `id` (its stream is `StreamId::from_uuid(id)`) in the
    /// runner's mode, as whole units of work retried under the retry policy, and answers with
    /// the state after it — or the decider's refusal, or why it failed (see the
    /// [crate docs](crate)).
    pub async fn handle(&self, id: Uuid, command: D::Command) -> Outcome<D> {
        match &self.inner.engine {
            Engine::Combined(combiner) => {
                let accepted = combiner.submit_with_state(id, command).await?;
                Ok(Handled {
                    version: accepted.last_version(),
                    event_ids: accepted.event_ids().to_vec(),
                    attempts: accepted.attempts(),
                    state: accepted.into_state(),
                })
            }
            Engine::Direct { source, decider } => {
                let locked = self.inner.options.mode != Mode::Optimistic;
                self.run(source, decider, id, &command, locked).await
            }
        }
    }

    /// Decides `command` on aggregate `id` and appends its events on the caller's transaction
    /// `tx`, **without committing**: the caller's other writes on `tx` commit with it, or none
    /// does. In [`Mode::Locked`] and [`Mode::Combined`] the aggregate's write lock is taken
    /// on `tx` first (the lock the combiner's batches take, so this serializes with them); in
    /// [`Mode::Optimistic`] none is.
    ///
    /// Nothing is retried here: a retryable error (a conflict: the stream moved since the
    /// load) has aborted `tx`, and the caller runs its whole unit of work again — for instance
    /// inside [`TransactionSource::transaction_with_retry`], whose error type a
    /// [`CommandError`] can be. A refusal leaves `tx` usable and appends nothing.
    pub async fn handle_in(&self, tx: &Src::Tx, id: Uuid, command: &D::Command) -> Outcome<D> {
        let locked = self.inner.options.mode != Mode::Optimistic;
        let (handled, _) = self
            .decide_on(self.decider(), tx, id, command, locked, false)
            .await?;
        Ok(handled)
    }

    /// [`CommandRunner::handle`] without the combiner: begin, (lock and) load, decide, append
    /// with the commit; retried under the policy.
    async fn run(
        &self,
        source: &Src,
        decider: &D,
        id: Uuid,
        command: &D::Command,
        locked: bool,
    ) -> Outcome<D> {
        let attempts = AtomicU32::new(0);
        // The ids of the latest attempt's events: the answer to a lost commit reply.
        let appended: Mutex<Vec<Uuid>> = Mutex::new(Vec::new());
        let outcome = source
            .transaction_with_retry(&self.inner.options.retry, tokio_sleep, |tx, attempt| {
                attempts.store(attempt, Ordering::Relaxed);
                let appended = &appended;
                Box::pin(async move {
                    appended
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clear();
                    let (handled, ids) = self
                        .decide_on(decider, &*tx, id, command, locked, true)
                        .await?;
                    *appended.lock().unwrap_or_else(PoisonError::into_inner) = ids;
                    Ok(handled)
                })
            })
            .await;
        let attempts = attempts.load(Ordering::Relaxed);
        match outcome {
            Ok(mut handled) => {
                handled.attempts = attempts;
                Ok(handled)
            }
            Err(CommandError::Failed(error)) if error.kind() == ErrorKind::CommitUnknown => {
                let event_ids =
                    std::mem::take(&mut *appended.lock().unwrap_or_else(PoisonError::into_inner));
                Err(CommandError::CommitUnknown {
                    error: Box::new(error),
                    event_ids,
                })
            }
            Err(other) => Err(other),
        }
    }

    /// One decision on `tx`: (lock and) load, fold, decide, encode, append at the loaded
    /// version — with the commit when `last_write` (the runner commits right after), else at
    /// once (the caller may write more). Returns the answer (attempts 1) and the events' ids.
    async fn decide_on(
        &self,
        decider: &D,
        tx: &Src::Tx,
        id: Uuid,
        command: &D::Command,
        locked: bool,
        last_write: bool,
    ) -> Result<(Handled<D::State>, Vec<Uuid>), CommandError<D::Error>> {
        let store = &self.inner.store;
        let stream = StreamId::from_uuid(id);
        let key = aggregate_key(decider.aggregate_type(), id);
        let lock = locked.then_some(LockFirst {
            key: &key,
            timeout: self.inner.options.lock_timeout.0,
        });
        let loaded = load_aggregate(decider, store, tx, id, lock).await?;
        let base = loaded.version;
        let state = loaded.state;
        let events = decider
            .decide(&state, command)
            .await
            .map_err(CommandError::Rejected)?;
        let encoded = events
            .iter()
            .map(|event| decider.encode(event))
            .collect::<Result<Vec<NewEvent>, Error>>()?;
        let event_ids: Vec<Uuid> = encoded.iter().map(NewEvent::event_id).collect();
        let state = events
            .iter()
            .fold(state, |state, event| decider.evolve(state, event));
        let version = base + encoded.len() as u64;
        // Before the append: that is the last write when the runner commits right after.
        let folded = loaded.folded + encoded.len() as u64;
        save_snapshot_if_due(decider, store, tx, id, version, folded, &state).await?;
        if !encoded.is_empty() {
            let expected = ExpectedVersion::Exact(base);
            if last_write {
                store
                    .append_at_commit(tx, stream, expected, &encoded)
                    .await?;
            } else {
                store.append(tx, stream, expected, &encoded).await?;
            }
        }
        let handled = Handled {
            state,
            version,
            event_ids: event_ids.clone(),
            attempts: 1,
        };
        Ok((handled, event_ids))
    }
}
