//! # lockstep-combiner
//!
//! The command combiner for hot aggregates: commands submitted for one aggregate queue in the
//! process, and one batch at a time is decided and committed — one transaction, the aggregate's
//! write lock, one load, the queued commands decided **in FIFO order, each on the state the
//! previous ones left**, and the events of every accepted command appended with the expected
//! version in one statement that travels with the `COMMIT`. Under the per-aggregate lock a hot
//! aggregate takes one decision per commit; here it takes one *batch* per commit, and every
//! command still gets its own answer: its events' versions, or its own business error with
//! nothing appended for it (ADR 0013).
//!
//! Built only on the `lockstep-core` contracts ([`TransactionSource`], [`SnapshotStore`] (an
//! [`EventStore`](lockstep_core::EventStore) with the aggregate snapshots a decider may keep),
//! [`Decider`]), so it runs on
//! the testkit's fakes and on PostgreSQL alike. Other processes still serialize on the
//! aggregate's write lock `relay:aggregate:{type}:{id}` (the pessimistic path's lock), and the
//! optimistic version check stays on underneath.
//!
//! ```no_run
//! use lockstep_combiner::{CombineError, Combiner};
//! # use lockstep_core::{AggregateType, Decider, NewEvent, RecordedEvent, Result, Uuid};
//! # struct Stock(AggregateType);
//! # impl Decider for Stock {
//! #     type State = u64; type Command = u64; type Event = u64; type Error = String;
//! #     fn aggregate_type(&self) -> &AggregateType { &self.0 }
//! #     fn initial_state(&self, _: Uuid) -> u64 { 10 }
//! #     async fn decide(&self, left: &u64, n: &u64) -> std::result::Result<Vec<u64>, String> {
//! #         if n > left { Err("sold out".into()) } else { Ok(vec![*n]) } }
//! #     fn evolve(&self, left: u64, n: &u64) -> u64 { left - n }
//! #     fn encode(&self, n: &u64) -> Result<NewEvent> {
//! #         NewEvent::new("Reserved", lockstep_core::serde_json::json!({ "n": n })) }
//! #     fn decode(&self, e: &RecordedEvent) -> Result<u64> { Ok(e.payload["n"].as_u64().unwrap_or(0)) }
//! # }
//! # async fn demo(db: lockstep_testkit::FakeDatabase, store: lockstep_testkit::InMemoryEventStore, sku: Uuid) -> Result<()> {
//! let combiner = Combiner::new(db, store, Stock(AggregateType::new("StockItem")?));
//! // From a request handler (a spawned task): one submission, one answer.
//! match combiner.submit(sku, 2).await {
//!     Ok(accepted) => println!("reserved at version {}", accepted.last_version()),
//!     Err(CombineError::Rejected(why)) => println!("refused: {why}"),
//!     Err(CombineError::CommitUnknown { event_ids, .. }) => println!("check {event_ids:?}"),
//!     Err(other) => println!("failed: {other}"),
//! }
//! # Ok(()) }
//! ```
//!
//! ## What a submission can count on
//!
//! - **Its own answer.** [`Accepted`] (the versions and ids of its events, the batch's size and
//!   attempts) once the batch committed; [`CombineError::Rejected`] with its own business error
//!   (nothing appended for it, the others unaffected); [`CombineError::Failed`] when the batch
//!   failed — a failed append or commit answers every command of the batch with that error,
//!   retryable where it is (after the batch was retried under the [`RetryPolicy`], which
//!   re-decides every command on freshly loaded state); [`CombineError::CommitUnknown`] when the
//!   `COMMIT`'s reply was lost (the batch may have committed; the command's event ids are given
//!   so the caller can check).
//! - **FIFO.** Commands of one aggregate are decided in submission order (the order of the
//!   [`Combiner::submit`] calls).
//! - **Dropping.** A [`Submission`] dropped before its turn (before a batch took it) is removed
//!   from the queue and never decided. One dropped after its batch took it is decided and
//!   committed with the batch — nobody hears the answer; its events carry ids (choose them with
//!   [`lockstep_core::NewEvent::with_id`] in [`Decider::encode`] to find them later) — unless
//!   that batch's attempt fails and is retried: a retry leaves out every command whose
//!   submission is gone (nothing of it was committed); nor is it decided again when its batch
//!   puts it back in the queue. Dropping costs O(log n) in the queue's length: the command is
//!   removed by its key from its aggregate's own queue, under that queue's lock only, so a storm
//!   of cancelled requests stays cheap and never holds up the other aggregates.
//! - **One command's fault stays its own.** Events whose ids the store refuses (an id already
//!   stored, or chosen by two commands of one batch) make it refuse the batch's append as a
//!   whole; the batch's commands are then decided again one per batch, so that only the command
//!   at fault is answered [`ErrorKind::InvalidInput`]. A panic in the decider's code answers the
//!   command it was deciding [`CombineError::Failed`] ([`ErrorKind::Backend`], not retryable),
//!   and the others are decided as if it had not been submitted.
//! - **Bounded batches.** At most [`CombinerOptions::max_commands`] commands and
//!   [`CombinerOptions::max_bytes`] of event payload per batch, and no new command is taken once
//!   the batch has decided for [`CombinerOptions::max_batch_time`]: a long queue is served in
//!   several commits instead of starving everyone's latency. The lock wait is bounded by
//!   [`CombinerOptions::lock_timeout`].
//!
//! The batches of one aggregate run on a task the first waiting submission starts (and that
//! ends when the queue is empty), so a caller that is cancelled never cancels a batch in flight:
//! [`Combiner::submit`] needs a tokio runtime.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::io;
use std::num::NonZeroUsize;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::FutureExt as _;
use lockstep_core::{
    Decider, Error, ErrorKind, ExpectedVersion, LockFirst, NewEvent, RetryPolicy, Retryable,
    SnapshotStore, StreamId, Transaction, TransactionSource, aggregate_key, load_aggregate,
    save_snapshot_if_due,
};
use tokio::sync::oneshot;
use uuid::Uuid;

/// The longest lock wait a batch sets (about 24.8 days): PostgreSQL's `lock_timeout` is a
/// 32-bit count of milliseconds. [`CombinerOptions::lock_timeout`] takes longer waits as this.
pub const MAX_LOCK_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// How big a batch may grow, how long its lock wait lasts, and how failed batches are retried.
/// Every value is valid by its type; the defaults are on each setter.
#[derive(Debug, Clone, Copy)]
pub struct CombinerOptions {
    max_commands: NonZeroUsize,
    max_bytes: NonZeroUsize,
    max_batch_time: Duration,
    lock_timeout: Option<Duration>,
    retry: RetryPolicy,
}

impl Default for CombinerOptions {
    fn default() -> Self {
        CombinerOptions {
            max_commands: NonZeroUsize::new(64).unwrap_or(NonZeroUsize::MIN),
            max_bytes: NonZeroUsize::new(1 << 20).unwrap_or(NonZeroUsize::MIN),
            max_batch_time: Duration::from_millis(50),
            lock_timeout: Some(Duration::from_secs(10)),
            retry: RetryPolicy::default(),
        }
    }
}

impl CombinerOptions {
    /// At most this many commands per batch (default 64).
    #[must_use]
    pub fn max_commands(mut self, n: NonZeroUsize) -> Self {
        self.max_commands = n;
        self
    }

    /// At most this many bytes of events per batch, counted as each event's type plus its
    /// payload's JSON text (default 1 MiB). A command whose events alone exceed it goes in a
    /// batch of its own.
    #[must_use]
    pub fn max_bytes(mut self, n: NonZeroUsize) -> Self {
        self.max_bytes = n;
        self
    }

    /// Once a batch has been deciding this long (from its load), it takes no further command
    /// and commits (default 50 ms; zero: one command per batch). The command being decided
    /// when the budget runs out finishes its decision.
    #[must_use]
    pub fn max_batch_time(mut self, budget: Duration) -> Self {
        self.max_batch_time = budget;
        self
    }

    /// How long a batch waits for the aggregate's write lock before failing with a retryable
    /// [`ErrorKind::LockTimeout`] (default 10 s; `None`: without limit). A wait longer than
    /// [`MAX_LOCK_TIMEOUT`] is that long.
    #[must_use]
    pub fn lock_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.lock_timeout = timeout.map(|t| t.min(MAX_LOCK_TIMEOUT));
        self
    }

    /// How a failed batch is retried — begun again, locked, loaded and every command re-decided
    /// (default [`RetryPolicy::default`]).
    #[must_use]
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }
}

/// A committed command: where its events went, and — from [`Combiner::submit_with_state`] —
/// the aggregate's state right after them (`S`; `()` from [`Combiner::submit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted<S = ()> {
    last_version: u64,
    event_ids: Vec<Uuid>,
    batch_commands: usize,
    attempts: u32,
    state: S,
}

impl<S> Accepted<S> {
    /// The aggregate's state right after this command's events: the state the batch's next
    /// command was decided on (`()` unless the command came from
    /// [`Combiner::submit_with_state`]).
    pub fn state(&self) -> &S {
        &self.state
    }

    /// The state, by value (see [`Accepted::state`]).
    pub fn into_state(self) -> S {
        self.state
    }

    /// The same answer with the state `f` makes of this one's.
    fn map_state<T>(self, f: impl FnOnce(S) -> T) -> Accepted<T> {
        Accepted {
            last_version: self.last_version,
            event_ids: self.event_ids,
            batch_commands: self.batch_commands,
            attempts: self.attempts,
            state: f(self.state),
        }
    }

    /// The stream's version right after this command's events (the version of its last event;
    /// for a command that decided no events, the version its decision saw).
    pub fn last_version(&self) -> u64 {
        self.last_version
    }

    /// The version of its first event (equal to [`Accepted::last_version`] + 1 when it decided
    /// none).
    pub fn first_version(&self) -> u64 {
        self.last_version + 1 - self.event_ids.len() as u64
    }

    /// Its events' ids, in version order.
    pub fn event_ids(&self) -> &[Uuid] {
        &self.event_ids
    }

    /// How many commands its batch decided (itself included).
    pub fn batch_commands(&self) -> usize {
        self.batch_commands
    }

    /// Attempts the batch took (1 = no retry).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
}

/// Why a submission was not accepted.
#[derive(Debug)]
#[non_exhaustive]
pub enum CombineError<E> {
    /// The decider refused the command: its own business error. Nothing was appended for it;
    /// the batch's other commands were decided and committed. Never retryable.
    Rejected(E),
    /// Nothing of the command was committed: the batch failed (its append, its commit, its lock
    /// or its load — every command of the batch gets the error, retryable where it is, after
    /// the retry policy was used up), or the command's events could not be stored
    /// ([`ErrorKind::InvalidInput`], that command only), or the decider panicked on it
    /// ([`ErrorKind::Backend`], that command only), or the combiner stopped.
    Failed(Error),
    /// The `COMMIT`'s reply was lost: the batch may or may not have committed. Not retryable as
    /// such; look for `event_ids` in the stream (empty when the command had no events to append).
    CommitUnknown {
        /// The error ([`ErrorKind::CommitUnknown`]), boxed to keep the answer small.
        error: Box<Error>,
        /// The ids of this command's events in the batch whose commit is unknown.
        event_ids: Vec<Uuid>,
    },
}

impl<E> CombineError<E> {
    /// The lockstep error behind a failure (`None` for a rejection).
    pub fn error(&self) -> Option<&Error> {
        match self {
            CombineError::Rejected(_) => None,
            CombineError::Failed(error) => Some(error),
            CombineError::CommitUnknown { error, .. } => Some(error),
        }
    }

    /// The error's kind (`None` for a rejection).
    pub fn kind(&self) -> Option<ErrorKind> {
        self.error().map(Error::kind)
    }

    /// The business error, if the command was rejected.
    pub fn rejection(&self) -> Option<&E> {
        match self {
            CombineError::Rejected(e) => Some(e),
            _ => None,
        }
    }
}

impl<E> From<Error> for CombineError<E> {
    fn from(error: Error) -> Self {
        CombineError::Failed(error)
    }
}

impl<E> Retryable for CombineError<E> {
    fn is_retryable(&self) -> bool {
        matches!(self, CombineError::Failed(e) if e.is_retryable())
    }
}

impl<E: fmt::Display> fmt::Display for CombineError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CombineError::Rejected(e) => write!(f, "command rejected: {e}"),
            CombineError::Failed(_) => {
                f.write_str("the command's batch failed; nothing of it was committed")
            }
            CombineError::CommitUnknown { .. } => {
                f.write_str("the command's batch may or may not have committed")
            }
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for CombineError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// A submission's answer.
pub type Answer<D> = Result<Accepted, CombineError<<D as Decider>::Error>>;

/// The answer of a [`Combiner::submit_with_state`]: with the state after the command.
pub type StateAnswer<D> =
    Result<Accepted<<D as Decider>::State>, CombineError<<D as Decider>::Error>>;

/// What a queued command is answered on: the state after it when its submission asked for it.
type RawAnswer<D> =
    Result<Accepted<Option<<D as Decider>::State>>, CombineError<<D as Decider>::Error>>;

/// Copies a state for the answer of a submission that asked for it (`Clone::clone`, taken
/// where the state is known to be `Clone`).
type CloneState<D> = fn(&<D as Decider>::State) -> <D as Decider>::State;

/// One queued command.
struct Pending<D: Decider> {
    /// Its place in its aggregate's queue (the order of the `submit` calls).
    seq: u64,
    command: D::Command,
    reply: oneshot::Sender<RawAnswer<D>>,
    /// The ids its events got in the batch's latest attempt.
    event_ids: Vec<Uuid>,
    /// Set when the submission wants the state after the command in its answer.
    clone_state: Option<CloneState<D>>,
}

/// What one aggregate's queue holds: its open commands by sequence number, so that the next
/// one is the first key, a dropped submission is removed by its key and a command put back
/// returns to its place, each in O(log n).
struct QueueState<D: Decider> {
    pending: BTreeMap<u64, Pending<D>>,
    next_seq: u64,
}

/// The queue of one aggregate, with a lock of its own: a submission dropped or a command taken
/// on one aggregate never waits for another aggregate's queue, and no operation on a queue
/// walks it (the one exception, a command put back by its batch and dropped since, is skipped
/// and removed when it comes first — each such entry once).
struct AggregateQueue<D: Decider> {
    state: Mutex<QueueState<D>>,
    #[cfg(test)]
    scanned: Arc<std::sync::atomic::AtomicU64>,
}

impl<D: Decider> AggregateQueue<D> {
    fn lock(&self) -> MutexGuard<'_, QueueState<D>> {
        // A panic while holding the queue leaves it consistent (every change is one call).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues a command at the back, returning its sequence number.
    fn push_back(
        &self,
        command: D::Command,
        reply: oneshot::Sender<RawAnswer<D>>,
        clone_state: Option<CloneState<D>>,
    ) -> u64 {
        let mut state = self.lock();
        let seq = state.next_seq;
        state.next_seq += 1;
        state.pending.insert(
            seq,
            Pending {
                seq,
                command,
                reply,
                event_ids: Vec::new(),
                clone_state,
            },
        );
        seq
    }

    /// Removes the command `seq` (a submission dropped before a batch took it). The command is
    /// dropped after the lock is released.
    fn remove(&self, seq: u64) -> Option<Pending<D>> {
        self.lock().pending.remove(&seq)
    }

    /// The next open command (put-back commands whose submission was dropped are removed).
    fn pop(&self) -> Option<Pending<D>> {
        let mut state = self.lock();
        while let Some((_, next)) = state.pending.pop_first() {
            if !next.reply.is_closed() {
                return Some(next);
            }
            self.count_scanned();
        }
        None
    }

    /// Whether an open command is queued (put-back commands whose submission was dropped are
    /// removed from the front first).
    fn has_open(&self) -> bool {
        let mut state = self.lock();
        while let Some(first) = state.pending.first_entry() {
            if !first.get().reply.is_closed() {
                return true;
            }
            first.remove();
            self.count_scanned();
        }
        false
    }

    /// Puts commands of a batch back in their places: ahead of every command queued after
    /// them, in their order.
    fn put_back(&self, commands: Vec<Pending<D>>) {
        if commands.is_empty() {
            return;
        }
        let mut state = self.lock();
        for command in commands {
            state.pending.insert(command.seq, command);
        }
    }

    /// Takes every queued command out (the queue's task is gone).
    fn take_all(&self) -> BTreeMap<u64, Pending<D>> {
        std::mem::take(&mut self.lock().pending)
    }

    /// Counts, for the tests, an entry that a queue operation visited besides the one it took
    /// or removed.
    fn count_scanned(&self) {
        #[cfg(test)]
        self.scanned
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Every aggregate with queued commands or a batch in flight (an entry exists exactly while
/// its batch task runs). The map's lock is held only to find, add or remove an aggregate's
/// queue (and, when adding a command, for that queue's O(log n) insert, so that a task that
/// saw its queue empty and ends cannot miss it).
struct Queues<D: Decider> {
    map: Mutex<HashMap<Uuid, Arc<AggregateQueue<D>>>>,
    #[cfg(test)]
    scanned: Arc<std::sync::atomic::AtomicU64>,
}

impl<D: Decider> Queues<D> {
    fn lock(&self) -> MutexGuard<'_, HashMap<Uuid, Arc<AggregateQueue<D>>>> {
        // A panic while holding the map leaves it consistent (every change is one call).
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct Inner<Src, St, D: Decider> {
    source: Src,
    store: St,
    decider: D,
    options: CombinerOptions,
    queues: Arc<Queues<D>>,
}

/// The command combiner of one decider over a transaction source and an event store. Cheap to
/// clone (clones share the queues). See the [crate docs](crate).
pub struct Combiner<Src, St, D: Decider> {
    inner: Arc<Inner<Src, St, D>>,
}

impl<Src, St, D: Decider> Clone for Combiner<Src, St, D> {
    fn clone(&self) -> Self {
        Combiner {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<Src, St, D: Decider> fmt::Debug for Combiner<Src, St, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Combiner")
            .field("aggregate_type", &self.inner.decider.aggregate_type())
            .field("options", &self.inner.options)
            .field("queued_aggregates", &self.inner.queues.lock().len())
            .finish()
    }
}

impl<Src, St, D> Combiner<Src, St, D>
where
    Src: TransactionSource + 'static,
    St: SnapshotStore<Src::Tx> + 'static,
    D: Decider + 'static,
    D::Command: 'static,
    D::Error: 'static,
    D::State: 'static,
    D::Event: 'static,
{
    /// A combiner with [`CombinerOptions::default`].
    pub fn new(source: Src, store: St, decider: D) -> Self {
        Combiner::with_options(source, store, decider, CombinerOptions::default())
    }

    /// A combiner with `options`.
    pub fn with_options(source: Src, store: St, decider: D, options: CombinerOptions) -> Self {
        Combiner {
            inner: Arc::new(Inner {
                source,
                store,
                decider,
                options,
                queues: Arc::new(Queues {
                    map: Mutex::new(HashMap::new()),
                    #[cfg(test)]
                    scanned: Arc::default(),
                }),
            }),
        }
    }

    /// The decider.
    pub fn decider(&self) -> &D {
        &self.inner.decider
    }

    /// The options.
    pub fn options(&self) -> &CombinerOptions {
        &self.inner.options
    }

    /// Queues `command` for aggregate `id` (its stream is `StreamId::from_uuid(id)`) and returns
    /// its answer's future. The command joins the queue **now**, in the order of `submit`
    /// calls; awaiting the [`Submission`] only waits for the answer, and dropping it before
    /// its batch takes the command removes the command. Without a tokio runtime the answer is
    /// [`CombineError::Failed`] ([`ErrorKind::Unsupported`]) and nothing is queued.
    pub fn submit(&self, id: Uuid, command: D::Command) -> Submission<D> {
        self.enqueue(id, command, None)
    }

    /// [`Combiner::submit`], answered with the aggregate's state right after the command
    /// ([`Accepted::state`]) — the state its batch's next command is decided on, copied for
    /// the answer (one `clone` per command that asks). A handler that must answer "the balance
    /// after the withdrawal" needs no second load.
    pub fn submit_with_state(&self, id: Uuid, command: D::Command) -> SubmissionWithState<D>
    where
        D::State: Clone,
    {
        SubmissionWithState {
            submission: self.enqueue(id, command, Some(<D::State as Clone>::clone)),
        }
    }

    fn enqueue(
        &self,
        id: Uuid,
        command: D::Command,
        clone_state: Option<CloneState<D>>,
    ) -> Submission<D> {
        let (reply, answer) = oneshot::channel();
        let runtime = match tokio::runtime::Handle::try_current() {
            Ok(runtime) => runtime,
            Err(_) => {
                let _ = reply.send(Err(CombineError::Failed(Error::new(
                    ErrorKind::Unsupported,
                    "the command combiner needs a tokio runtime",
                ))));
                return Submission {
                    answer,
                    queued: None,
                };
            }
        };
        let (queue, seq, start) = {
            let mut map = self.inner.queues.lock();
            let (queue, start) = match map.get(&id) {
                Some(queue) => (Arc::clone(queue), false),
                None => {
                    let queue = Arc::new(AggregateQueue {
                        state: Mutex::new(QueueState {
                            pending: BTreeMap::new(),
                            next_seq: 0,
                        }),
                        #[cfg(test)]
                        scanned: Arc::clone(&self.inner.queues.scanned),
                    });
                    map.insert(id, Arc::clone(&queue));
                    (queue, true)
                }
            };
            // Under the map's lock: the aggregate's task, once it saw the queue empty, removes
            // it under this lock, so the command is in a queue that a task serves.
            let seq = queue.push_back(command, reply, clone_state);
            (queue, seq, start)
        };
        if start {
            // The guard exists before the task: a task dropped unpolled (its runtime is shutting
            // down) still removes the queue, so that no submission waits for ever and the next
            // one starts a task of its own.
            let guard = TaskGuard {
                queues: Arc::clone(&self.inner.queues),
                id,
                done: false,
            };
            runtime.spawn(run_aggregate(
                Arc::clone(&self.inner),
                id,
                Arc::clone(&queue),
                guard,
            ));
        }
        Submission {
            answer,
            queued: Some(Queued { queue, id, seq }),
        }
    }
}

/// Where a submission waits in its queue, to remove it if it is dropped before its turn.
struct Queued<D: Decider> {
    queue: Arc<AggregateQueue<D>>,
    id: Uuid,
    seq: u64,
}

/// The answer of one [`Combiner::submit`]: a future (`Send`, `'static`) resolving to
/// [`Accepted`] or a [`CombineError`]. Dropping it before its batch took the command removes
/// the command from the queue (in O(log n), holding up no other aggregate); dropped later, the command is committed with its batch (unless
/// the batch is retried: a retry leaves it out).
pub struct Submission<D: Decider> {
    answer: oneshot::Receiver<RawAnswer<D>>,
    queued: Option<Queued<D>>,
}

impl<D: Decider> fmt::Debug for Submission<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Submission")
            .field("aggregate", &self.queued.as_ref().map(|q| q.id))
            .finish_non_exhaustive()
    }
}

impl<D: Decider> Future for Submission<D> {
    type Output = Answer<D>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answer<D>> {
        self.poll_raw(cx)
            .map(|answer| answer.map(|accepted| accepted.map_state(drop)))
    }
}

/// The answer of one [`Combiner::submit_with_state`]: a [`Submission`] whose [`Accepted`]
/// carries the state after the command. Dropping it works as dropping a [`Submission`].
pub struct SubmissionWithState<D: Decider> {
    submission: Submission<D>,
}

impl<D: Decider> fmt::Debug for SubmissionWithState<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SubmissionWithState")
            .field("aggregate", &self.submission.queued.as_ref().map(|q| q.id))
            .finish_non_exhaustive()
    }
}

impl<D: Decider> Future for SubmissionWithState<D> {
    type Output = StateAnswer<D>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<StateAnswer<D>> {
        self.submission.poll_raw(cx).map(|answer| {
            let Accepted {
                last_version,
                event_ids,
                batch_commands,
                attempts,
                state,
            } = answer?;
            // Every command submitted with its state is answered with it (see `decide_batch`).
            let state = state.ok_or_else(|| {
                CombineError::Failed(Error::new(
                    ErrorKind::Backend,
                    "the combiner answered an accepted command without its state",
                ))
            })?;
            Ok(Accepted {
                last_version,
                event_ids,
                batch_commands,
                attempts,
                state,
            })
        })
    }
}

impl<D: Decider> Submission<D> {
    fn poll_raw(&mut self, cx: &mut Context<'_>) -> Poll<RawAnswer<D>> {
        let this = self;
        match Pin::new(&mut this.answer).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(answer) => {
                this.queued = None;
                Poll::Ready(answer.unwrap_or_else(|_| {
                    Err(CombineError::Failed(Error::new(
                        ErrorKind::Cancelled,
                        "the combiner stopped before answering (its runtime shut down while \
                         this command's batch was in flight); the command may have been \
                         committed",
                    )))
                }))
            }
        }
    }
}

impl<D: Decider> Drop for Submission<D> {
    /// Removes the command by its key, under its aggregate's lock only (O(log n)); a command a
    /// batch already took is not in the queue, and is left to its batch.
    fn drop(&mut self) {
        if let Some(queued) = self.queued.take() {
            drop(queued.queue.remove(queued.seq));
        }
    }
}

/// Ends an aggregate's batch task: on a normal end the queue entry is already gone; when the
/// task is dropped (its runtime shut down, even before it ran) the entry is removed and the
/// commands still queued are answered [`ErrorKind::Cancelled`], never decided. The commands of
/// a batch in flight are dropped with it: their submissions hear that they may have been
/// committed.
struct TaskGuard<D: Decider> {
    queues: Arc<Queues<D>>,
    id: Uuid,
    done: bool,
}

impl<D: Decider> Drop for TaskGuard<D> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let removed = self.queues.lock().remove(&self.id);
        let pending = removed.map(|queue| queue.take_all()).unwrap_or_default();
        for pending in pending.into_values() {
            let _ = pending.reply.send(Err(CombineError::Failed(Error::new(
                ErrorKind::Cancelled,
                "the combiner stopped (its runtime shut down) before deciding this command; \
                 nothing of it was committed",
            ))));
        }
    }
}

/// Runs batches of aggregate `id` until its queue is empty. After a batch whose append was
/// refused as a whole ([`ErrorKind::InvalidInput`]: an event id one of its commands chose is
/// already stored, or two chose the same), its commands are decided again one per batch, so
/// that only the command at fault is refused.
async fn run_aggregate<Src, St, D>(
    inner: Arc<Inner<Src, St, D>>,
    id: Uuid,
    queue: Arc<AggregateQueue<D>>,
    mut guard: TaskGuard<D>,
) where
    Src: TransactionSource,
    St: SnapshotStore<Src::Tx>,
    D: Decider,
{
    let mut alone = 0usize;
    loop {
        let max = if alone > 0 {
            alone -= 1;
            1
        } else {
            inner.options.max_commands.get()
        };
        if let Some(refused) = run_batch(&inner, &queue, id, max).await {
            alone = refused;
        }
        if queue.has_open() {
            continue;
        }
        // Seen empty: look again under the map's lock, which every submission holds while it
        // adds its command.
        let mut map = inner.queues.lock();
        if !queue.has_open() {
            map.remove(&id);
            guard.done = true;
            return;
        }
    }
}

/// What one command's decision came to in an attempt.
enum Decision<S, E> {
    /// `state`: the state after the command, when its submission asked for it.
    Accepted {
        last_version: u64,
        state: Option<S>,
    },
    Rejected(E),
    Invalid(Error),
}

/// One batch of at most `max` commands: attempts under the retry policy, then every taken
/// command answered. `Some(n)`: the batch's append was refused as a whole and its `n` commands
/// were put back, unanswered, to be decided one per batch.
async fn run_batch<Src, St, D>(
    inner: &Inner<Src, St, D>,
    queue: &AggregateQueue<D>,
    id: Uuid,
    max: usize,
) -> Option<usize>
where
    Src: TransactionSource,
    St: SnapshotStore<Src::Tx>,
    D: Decider,
{
    let mut taken: Vec<Pending<D>> = Vec::new();
    let mut attempt = 1;
    loop {
        match attempt_batch(inner, queue, id, &mut taken, max).await {
            Ok(decisions) => {
                let batch_commands = taken.len();
                for (pending, decision) in taken.into_iter().zip(decisions) {
                    let answer = match decision {
                        Decision::Accepted {
                            last_version,
                            state,
                        } => Ok(Accepted {
                            last_version,
                            event_ids: pending.event_ids,
                            batch_commands,
                            attempts: attempt,
                            state,
                        }),
                        Decision::Rejected(e) => Err(CombineError::Rejected(e)),
                        Decision::Invalid(e) => Err(CombineError::Failed(e)),
                    };
                    // A dropped submission does not hear its answer (it was committed).
                    let _ = pending.reply.send(answer);
                }
                return None;
            }
            Err(error) => {
                if let Some(delay) = inner.options.retry.retry_after(attempt, &error) {
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    attempt += 1;
                    continue;
                }
                if error.kind() == ErrorKind::InvalidInput && taken.len() > 1 {
                    // The store refused the batch's events as a whole, for one command's ids:
                    // nothing was committed; decide them again one per batch.
                    let n = taken.len();
                    queue.put_back(taken);
                    return Some(n);
                }
                let error = if taken.is_empty() {
                    // Failed before any command was taken (begin, lock or load): the commands
                    // that would have formed the batch get the error. None of them was
                    // decided, so a lost reply to the empty batch's COMMIT is no news for them.
                    while taken.len() < inner.options.max_commands.get() {
                        match queue.pop() {
                            Some(next) => taken.push(next),
                            None => break,
                        }
                    }
                    if error.kind() == ErrorKind::CommitUnknown {
                        Error::new(
                            ErrorKind::ConnectionLost,
                            "the connection was lost before this command was decided; nothing \
                             of it was committed",
                        )
                    } else {
                        error
                    }
                } else {
                    error
                };
                answer_failure(taken, &error);
                return None;
            }
        }
    }
}

/// Answers every command of a failed batch with (a copy of) `error`.
fn answer_failure<D: Decider>(taken: Vec<Pending<D>>, error: &Error) {
    for pending in taken {
        let copy = Error::new(error.kind(), error.message().to_owned());
        let answer = if error.kind() == ErrorKind::CommitUnknown {
            CombineError::CommitUnknown {
                error: Box::new(copy),
                event_ids: pending.event_ids,
            }
        } else {
            CombineError::Failed(copy)
        };
        let _ = pending.reply.send(Err(answer));
    }
}

/// One attempt: begin, lock and load, decide the taken commands (from an earlier attempt) and
/// then queued ones within the bounds, append everything with the commit. `taken` holds the
/// batch's commands in order, also when the attempt fails.
async fn attempt_batch<Src, St, D>(
    inner: &Inner<Src, St, D>,
    queue: &AggregateQueue<D>,
    id: Uuid,
    taken: &mut Vec<Pending<D>>,
    max: usize,
) -> Result<Vec<Decision<D::State, D::Error>>, Error>
where
    Src: TransactionSource,
    St: SnapshotStore<Src::Tx>,
    D: Decider,
{
    let tx = inner.source.begin().await?;
    match decide_batch(inner, queue, &tx, id, taken, max).await {
        Ok(decisions) => {
            tx.commit().await?;
            Ok(decisions)
        }
        Err(error) => {
            // The attempt's error is the one to report: dropping the transaction rolls it back.
            drop(tx);
            Err(error)
        }
    }
}

/// Decides the batch's commands (see [`attempt_batch`]). A panic in the decider's code fails
/// the command it was deciding, alone: in `decide` or `encode` the batch goes on with the
/// state as it was; in `evolve` the state is gone, so the attempt stops there — the commands
/// before it go back to the queue's front (nothing of them is appended by this attempt, which
/// commits nothing) and are decided again in the next batch, on the state loaded anew.
async fn decide_batch<Src, St, D>(
    inner: &Inner<Src, St, D>,
    queue: &AggregateQueue<D>,
    tx: &Src::Tx,
    id: Uuid,
    taken: &mut Vec<Pending<D>>,
    max: usize,
) -> Result<Vec<Decision<D::State, D::Error>>, Error>
where
    Src: TransactionSource,
    St: SnapshotStore<Src::Tx>,
    D: Decider,
{
    let options = &inner.options;
    let decider = &inner.decider;
    let stream = StreamId::from_uuid(id);
    let key = aggregate_key(decider.aggregate_type(), id);
    let lock = LockFirst {
        key: &key,
        timeout: options.lock_timeout,
    };
    // From the latest snapshot when the decider keeps them; folding is the decider's code.
    let loaded = AssertUnwindSafe(load_aggregate(decider, &inner.store, tx, id, Some(lock)))
        .catch_unwind()
        .await
        .map_err(|panic| panicked("folding the aggregate's stream", &*panic))??;
    let base = loaded.version;
    let folded_before = loaded.folded;
    let mut state = Some(loaded.state);
    let started = Instant::now();

    let mut replay = std::mem::take(taken).into_iter();
    let mut decisions = Vec::new();
    let mut events: Vec<NewEvent> = Vec::new();
    let mut bytes = 0usize;
    loop {
        let full = taken.len() >= max
            || (!taken.is_empty() && started.elapsed() >= options.max_batch_time);
        if full {
            break;
        }
        // A command of an earlier attempt whose submission was dropped since is left out:
        // nothing of it was committed, and nobody waits for it.
        let Some(mut next) = replay
            .by_ref()
            .find(|p| !p.reply.is_closed())
            .or_else(|| queue.pop())
        else {
            break;
        };
        let current = state.take().unwrap_or_else(|| decider.initial_state(id));
        let decided = AssertUnwindSafe(decider.decide(&current, &next.command))
            .catch_unwind()
            .await;
        next.event_ids.clear();
        let decision = match decided {
            Err(panic) => Decision::Invalid(panicked("deciding this command", &*panic)),
            Ok(Err(e)) => Decision::Rejected(e),
            Ok(Ok(decided)) => match std::panic::catch_unwind(AssertUnwindSafe(|| {
                encode(decider, &decided)
            })) {
                Err(panic) => {
                    Decision::Invalid(panicked("encoding this command's events", &*panic))
                }
                Ok(Err(e)) => Decision::Invalid(e),
                Ok(Ok((encoded, size))) => {
                    if !taken.is_empty() && bytes.saturating_add(size) > options.max_bytes.get() {
                        // Too big for this batch: it leads the next one.
                        let mut back = vec![next];
                        back.extend(&mut replay);
                        queue.put_back(back);
                        break;
                    }
                    // The copy for the answer is the decider's code too (its state's `clone`).
                    let clone_state = next.clone_state;
                    let evolved = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        let after = decided
                            .iter()
                            .fold(current, |after, event| decider.evolve(after, event));
                        let answered = clone_state.map(|clone| clone(&after));
                        (after, answered)
                    }));
                    let (after, answered) = match evolved {
                        Ok(after) => after,
                        Err(panic) => {
                            let error =
                                panicked("evolving the state by this command's events", &*panic);
                            let _ = next.reply.send(Err(CombineError::Failed(error)));
                            let mut back = std::mem::take(taken);
                            back.extend(replay);
                            queue.put_back(back);
                            return Ok(Vec::new());
                        }
                    };
                    bytes = bytes.saturating_add(size);
                    next.event_ids = encoded.iter().map(NewEvent::event_id).collect();
                    events.extend(encoded);
                    state = Some(after);
                    decisions.push(Decision::Accepted {
                        last_version: base + events.len() as u64,
                        state: answered,
                    });
                    taken.push(next);
                    continue;
                }
            },
        };
        state = Some(current);
        decisions.push(decision);
        taken.push(next);
    }
    // Commands of an earlier attempt that no longer fit lead the next batch.
    queue.put_back(replay.collect());
    if let Some(state) = &state {
        // Before the append, the last write: the snapshot commits with the batch or not at all.
        let version = base + events.len() as u64;
        let folded = folded_before + events.len() as u64;
        let save = save_snapshot_if_due(decider, &inner.store, tx, id, version, folded, state);
        AssertUnwindSafe(save)
            .catch_unwind()
            .await
            .map_err(|panic| panicked("encoding the aggregate's snapshot", &*panic))??;
    }
    if !events.is_empty() {
        inner
            .store
            .append_at_commit(tx, stream, ExpectedVersion::Exact(base), &events)
            .await?;
    }
    Ok(decisions)
}

/// The error that answers a command whose decider code panicked (not retryable: the same code
/// would panic again).
fn panicked(doing: &str, panic: &(dyn std::any::Any + Send)) -> Error {
    let detail = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned());
    Error::new(
        ErrorKind::Backend,
        format!("the decider panicked {doing} ({detail}); nothing of it was committed"),
    )
}

/// The stored form of a decision's events and their size (types plus payloads' JSON text).
fn encode<D: Decider>(decider: &D, events: &[D::Event]) -> Result<(Vec<NewEvent>, usize), Error> {
    let mut size = 0usize;
    let mut encoded = Vec::with_capacity(events.len());
    for event in events {
        let new = decider.encode(event)?;
        size = size
            .saturating_add(new.event_type().len())
            .saturating_add(json_len(new.payload()));
        encoded.push(new);
    }
    Ok((encoded, size))
}

/// The length of a JSON value's text, without building it.
fn json_len(value: &lockstep_core::serde_json::Value) -> usize {
    struct Count(usize);
    impl io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0 = self.0.saturating_add(buf.len());
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a `Value` to a sink that never fails cannot fail.
    let _ = lockstep_core::serde_json::to_writer(&mut count, value);
    count.0
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::mpsc as std_mpsc;

    use lockstep_core::{AggregateType, RecordedEvent};
    use lockstep_testkit::{FakeDatabase, InMemoryEventStore};
    use tokio::sync::{Semaphore, mpsc};

    use super::*;

    /// Counts: command `n` appends one event; command 0 first waits for a permit of the gate.
    /// Every decision's command is sent to `entered` when it starts.
    struct Gated {
        ty: AggregateType,
        gate: Arc<Semaphore>,
        entered: mpsc::UnboundedSender<u64>,
    }

    impl Decider for Gated {
        type State = u64;
        type Command = u64;
        type Event = u64;
        type Error = String;

        fn aggregate_type(&self) -> &AggregateType {
            &self.ty
        }

        fn initial_state(&self, _id: Uuid) -> u64 {
            0
        }

        async fn decide(&self, _state: &u64, n: &u64) -> std::result::Result<Vec<u64>, String> {
            let _ = self.entered.send(*n);
            if *n == 0 {
                self.gate
                    .acquire()
                    .await
                    .map_err(|e| e.to_string())?
                    .forget();
            }
            Ok(vec![*n])
        }

        fn evolve(&self, state: u64, n: &u64) -> u64 {
            state + n
        }

        fn encode(&self, n: &u64) -> lockstep_core::Result<NewEvent> {
            NewEvent::new("Counted", lockstep_core::serde_json::json!({ "n": n }))
        }

        fn decode(&self, event: &RecordedEvent) -> lockstep_core::Result<u64> {
            Ok(event.payload["n"].as_u64().unwrap_or(0))
        }
    }

    type GatedCombiner = Combiner<FakeDatabase, InMemoryEventStore, Gated>;

    /// A combiner whose aggregate `id` is deciding command 0, held at the gate: every later
    /// submission for `id` waits in the queue until the gate opens.
    async fn deciding_at_the_gate(id: Uuid) -> (GatedCombiner, Arc<Semaphore>, Submission<Gated>) {
        let gate = Arc::new(Semaphore::new(0));
        let (tx, mut entered) = mpsc::unbounded_channel();
        let decider = Gated {
            ty: AggregateType::new("Gated").expect("valid"),
            gate: Arc::clone(&gate),
            entered: tx,
        };
        let options = CombinerOptions::default().max_batch_time(Duration::from_secs(30));
        let c = Combiner::with_options(
            FakeDatabase::new(),
            InMemoryEventStore::new(),
            decider,
            options,
        );
        let head = c.submit(id, 0);
        let started = tokio::time::timeout(Duration::from_secs(10), entered.recv())
            .await
            .expect("the first decision started within 10 s");
        assert_eq!(started, Some(0));
        (c, gate, head)
    }

    /// A storm of dropped submissions costs no scan of the queue: dropping each of `n` queued
    /// submissions removes it by its key, and the batches that follow skip at most the
    /// entries they remove, so the whole storm visits at most `n` entries (a scan per drop
    /// would visit about n²/2). The dropped commands are never decided.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropping_queued_submissions_visits_each_entry_at_most_once() {
        const N: u64 = 2_000;
        let id = Uuid::now_v7();
        let (c, gate, head) = deciding_at_the_gate(id).await;
        let dropped: Vec<_> = (1..=N).map(|n| c.submit(id, n)).collect();
        let kept = c.submit(id, N + 1);
        drop(dropped);
        gate.add_permits(1);
        let head = head.await.expect("accepted");
        assert_eq!(
            head.batch_commands(),
            2,
            "the dropped commands were not decided"
        );
        assert_eq!(kept.await.expect("accepted").last_version(), 2);
        let scanned = c.inner.queues.scanned.load(Ordering::Relaxed);
        assert!(
            scanned <= N,
            "dropping {N} queued submissions visited {scanned} queue entries"
        );
    }

    /// Dropping a queued submission and serving an aggregate's queue never wait for the lock
    /// every aggregate shares: while another thread holds it, a queued submission is dropped
    /// (on a thread of its own, which signals when it is done) and the aggregate's batch takes
    /// its next command and answers it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropping_and_serving_a_queue_never_wait_for_the_combiner_wide_lock() {
        let id = Uuid::now_v7();
        let (c, gate, head) = deciding_at_the_gate(id).await;
        let dropped = c.submit(id, 1);
        let kept = c.submit(id, 2);
        let queues = Arc::clone(&c.inner.queues);
        let (held, lock_held) = std_mpsc::channel();
        // Dropped (also when the test fails) to let the lock go.
        let (release, released) = std_mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let _every_aggregate = queues.lock();
            let _ = held.send(());
            let _ = released.recv();
        });
        lock_held.recv().expect("the combiner-wide lock is held");
        let (done, dropping) = std_mpsc::channel();
        std::thread::spawn(move || {
            drop(dropped);
            let _ = done.send(());
        });
        let answered = dropping.recv_timeout(Duration::from_secs(10));
        assert!(
            answered.is_ok(),
            "dropping a queued submission waited for the combiner-wide lock"
        );
        gate.add_permits(1);
        let answers =
            tokio::time::timeout(Duration::from_secs(10), async { (head.await, kept.await) }).await;
        drop(release);
        holder.join().expect("the lock's holder");
        let (head, kept) = answers.expect("the batch took its next command and answered");
        assert_eq!(head.expect("accepted").batch_commands(), 2);
        assert_eq!(kept.expect("accepted").last_version(), 2);
    }
}
