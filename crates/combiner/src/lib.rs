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
//! Built only on the `lockstep-core` contracts ([`TransactionSource`], [`EventStore`] with
//! [`EventStore::load_locked`] and [`EventStore::append_at_commit`], [`Decider`]), so it runs on
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
//!   submission is gone (nothing of it was committed).
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

use std::collections::{HashMap, VecDeque};
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
    Decider, Error, ErrorKind, EventStore, ExpectedVersion, NewEvent, RetryPolicy, Retryable,
    StreamId, Transaction, TransactionSource, aggregate_key,
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

/// A committed command: where its events went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    last_version: u64,
    event_ids: Vec<Uuid>,
    batch_commands: usize,
    attempts: u32,
}

impl Accepted {
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

/// One queued command.
struct Pending<D: Decider> {
    seq: u64,
    command: D::Command,
    reply: oneshot::Sender<Answer<D>>,
    /// The ids its events got in the batch's latest attempt.
    event_ids: Vec<Uuid>,
}

/// The queue of one aggregate.
struct AggregateQueue<D: Decider> {
    pending: VecDeque<Pending<D>>,
}

/// Every aggregate with queued commands or a batch in flight (an entry exists exactly while
/// its batch task runs).
struct Queues<D: Decider> {
    map: Mutex<HashMap<Uuid, AggregateQueue<D>>>,
    next_seq: std::sync::atomic::AtomicU64,
}

impl<D: Decider> Queues<D> {
    fn lock(&self) -> MutexGuard<'_, HashMap<Uuid, AggregateQueue<D>>> {
        // A panic while holding the map leaves it consistent (every change is one call).
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next open command of `id`'s queue (dropped submissions are skipped).
    fn pop(&self, id: Uuid) -> Option<Pending<D>> {
        let mut map = self.lock();
        let queue = map.get_mut(&id)?;
        while let Some(next) = queue.pending.pop_front() {
            if !next.reply.is_closed() {
                return Some(next);
            }
        }
        None
    }

    /// Puts commands back at the front of `id`'s queue, in their order.
    fn push_front(&self, id: Uuid, commands: Vec<Pending<D>>) {
        if commands.is_empty() {
            return;
        }
        let mut map = self.lock();
        let queue = map.entry(id).or_insert_with(|| AggregateQueue {
            pending: VecDeque::new(),
        });
        for command in commands.into_iter().rev() {
            queue.pending.push_front(command);
        }
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
    St: EventStore<Src::Tx> + 'static,
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
                    next_seq: std::sync::atomic::AtomicU64::new(0),
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
        let (reply, answer) = oneshot::channel();
        let queues = Arc::clone(&self.inner.queues);
        let seq = queues
            .next_seq
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
        let pending = Pending {
            seq,
            command,
            reply,
            event_ids: Vec::new(),
        };
        let start = {
            let mut map = queues.lock();
            match map.get_mut(&id) {
                Some(queue) => {
                    queue.pending.push_back(pending);
                    false
                }
                None => {
                    let mut queue = AggregateQueue {
                        pending: VecDeque::new(),
                    };
                    queue.pending.push_back(pending);
                    map.insert(id, queue);
                    true
                }
            }
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
            runtime.spawn(run_aggregate(Arc::clone(&self.inner), id, guard));
        }
        Submission {
            answer,
            queued: Some(Queued { queues, id, seq }),
        }
    }
}

/// Where a submission waits in its queue, to remove it if it is dropped before its turn.
struct Queued<D: Decider> {
    queues: Arc<Queues<D>>,
    id: Uuid,
    seq: u64,
}

/// The answer of one [`Combiner::submit`]: a future (`Send`, `'static`) resolving to
/// [`Accepted`] or a [`CombineError`]. Dropping it before its batch took the command removes
/// the command from the queue; dropped later, the command is committed with its batch (unless
/// the batch is retried: a retry leaves it out).
pub struct Submission<D: Decider> {
    answer: oneshot::Receiver<Answer<D>>,
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
        let this = &mut *self;
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
    fn drop(&mut self) {
        if let Some(queued) = self.queued.take() {
            let mut map = queued.queues.lock();
            if let Some(queue) = map.get_mut(&queued.id) {
                queue.pending.retain(|p| p.seq != queued.seq);
            }
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
        for pending in removed.into_iter().flat_map(|q| q.pending) {
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
async fn run_aggregate<Src, St, D>(inner: Arc<Inner<Src, St, D>>, id: Uuid, mut guard: TaskGuard<D>)
where
    Src: TransactionSource,
    St: EventStore<Src::Tx>,
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
        if let Some(refused) = run_batch(&inner, id, max).await {
            alone = refused;
        }
        let mut map = inner.queues.lock();
        let empty = map.get_mut(&id).is_none_or(|q| {
            q.pending.retain(|p| !p.reply.is_closed());
            q.pending.is_empty()
        });
        if empty {
            map.remove(&id);
            guard.done = true;
            return;
        }
    }
}

/// What one command's decision came to in an attempt.
enum Decision<E> {
    Accepted { last_version: u64 },
    Rejected(E),
    Invalid(Error),
}

/// One batch of at most `max` commands: attempts under the retry policy, then every taken
/// command answered. `Some(n)`: the batch's append was refused as a whole and its `n` commands
/// were put back, unanswered, to be decided one per batch.
async fn run_batch<Src, St, D>(inner: &Inner<Src, St, D>, id: Uuid, max: usize) -> Option<usize>
where
    Src: TransactionSource,
    St: EventStore<Src::Tx>,
    D: Decider,
{
    let mut taken: Vec<Pending<D>> = Vec::new();
    let mut attempt = 1;
    loop {
        match attempt_batch(inner, id, &mut taken, max).await {
            Ok(decisions) => {
                let batch_commands = taken.len();
                for (pending, decision) in taken.into_iter().zip(decisions) {
                    let answer = match decision {
                        Decision::Accepted { last_version } => Ok(Accepted {
                            last_version,
                            event_ids: pending.event_ids,
                            batch_commands,
                            attempts: attempt,
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
                    inner.queues.push_front(id, taken);
                    return Some(n);
                }
                let error = if taken.is_empty() {
                    // Failed before any command was taken (begin, lock or load): the commands
                    // that would have formed the batch get the error. None of them was
                    // decided, so a lost reply to the empty batch's COMMIT is no news for them.
                    while taken.len() < inner.options.max_commands.get() {
                        match inner.queues.pop(id) {
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
    id: Uuid,
    taken: &mut Vec<Pending<D>>,
    max: usize,
) -> Result<Vec<Decision<D::Error>>, Error>
where
    Src: TransactionSource,
    St: EventStore<Src::Tx>,
    D: Decider,
{
    let tx = inner.source.begin().await?;
    match decide_batch(inner, &tx, id, taken, max).await {
        Ok(decisions) => {
            tx.commit().await?;
            Ok(decisions)
        }
        Err(error) => {
            // The attempt's error is the one to report; a failed rollback still ends it.
            let _ = tx.rollback().await;
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
    tx: &Src::Tx,
    id: Uuid,
    taken: &mut Vec<Pending<D>>,
    max: usize,
) -> Result<Vec<Decision<D::Error>>, Error>
where
    Src: TransactionSource,
    St: EventStore<Src::Tx>,
    D: Decider,
{
    let options = &inner.options;
    let decider = &inner.decider;
    let stream = StreamId::from_uuid(id);
    let key = aggregate_key(decider.aggregate_type(), id);
    let loaded = inner
        .store
        .load_locked(tx, stream, &key, options.lock_timeout)
        .await?;
    let base = loaded.len() as u64;
    let folded = std::panic::catch_unwind(AssertUnwindSafe(|| decider.fold(id, &loaded)))
        .map_err(|panic| panicked("folding the aggregate's stream", &*panic))??;
    let mut state = Some(folded);
    drop(loaded);
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
            .or_else(|| inner.queues.pop(id))
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
                        inner.queues.push_front(id, back);
                        break;
                    }
                    let evolved = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        decided
                            .iter()
                            .fold(current, |after, event| decider.evolve(after, event))
                    }));
                    let after = match evolved {
                        Ok(after) => after,
                        Err(panic) => {
                            let error =
                                panicked("evolving the state by this command's events", &*panic);
                            let _ = next.reply.send(Err(CombineError::Failed(error)));
                            let mut back = std::mem::take(taken);
                            back.extend(replay);
                            inner.queues.push_front(id, back);
                            return Ok(Vec::new());
                        }
                    };
                    bytes = bytes.saturating_add(size);
                    next.event_ids = encoded.iter().map(NewEvent::event_id).collect();
                    events.extend(encoded);
                    state = Some(after);
                    decisions.push(Decision::Accepted {
                        last_version: base + events.len() as u64,
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
    inner.queues.push_front(id, replay.collect());
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
