//! The combiner's behaviour, written once and run on the testkit's fakes (`tests/fakes.rs`)
//! and on PostgreSQL (`tests/postgres.rs`): FIFO decisions, per-command answers, a business
//! error or an unstorable event in the middle of a batch, an event id already stored or chosen
//! twice (also with a submission dropped in the refused batch), a panicking decider, a
//! conflicting commit (retried and re-decided), a submission dropped while its batch is
//! retried, a failed commit, a lost `COMMIT` reply, dropped submissions, the bounds, and two
//! processes on one aggregate.

#![allow(dead_code, unreachable_pub)]

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockstep_combiner::{Accepted, CombineError, Combiner, CombinerOptions};
use lockstep_core::serde_json::json;
use lockstep_core::{
    AggregateType, Decider, Error, ErrorKind, ExpectedVersion, NewEvent, RecordedEvent, Result,
    RetryPolicy, SnapshotStore, StreamId, Transaction, TransactionSource, Uuid,
};
use lockstep_testkit::FaultyEventStore;
use tokio::sync::{Semaphore, mpsc};

/// What a test shop is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmd {
    /// Units arrive.
    Stock(u32),
    /// Reserve `qty`; `tag` names the command; `wait`: the decision waits for the gate.
    Reserve { qty: u32, tag: u32, wait: bool },
    /// Decides an event that cannot be stored (a blank type).
    Unstorable { tag: u32 },
    /// Reserves one unit with an event whose id the command chose.
    Tagged { tag: u32, id: Uuid },
    /// `decide` panics.
    PanicInDecide { tag: u32 },
    /// `decide` answers an event on which `evolve` panics.
    PanicInEvolve { tag: u32 },
}

/// What happened in a test shop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ev {
    Stocked(u32),
    Reserved { qty: u32, tag: u32 },
    Unstorable,
    Tagged { tag: u32, id: Uuid },
    Boom,
}

/// The business answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    SoldOut { tag: u32, available: u64 },
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::SoldOut { tag, available } => {
                write!(f, "command {tag}: only {available} available")
            }
        }
    }
}

/// Units stocked and reserved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stock {
    pub stocked: u64,
    pub reserved: u64,
}

/// The test decider: every decision's tag is logged and sent to `entered`; a waiting decision
/// waits for a permit of the gate (opened for good with [`Shop::open`]).
pub struct Shop {
    ty: AggregateType,
    gate: Arc<Semaphore>,
    log: Arc<Mutex<Vec<u32>>>,
    entered: mpsc::UnboundedSender<u32>,
}

/// The test's side of a [`Shop`].
pub struct ShopHandle {
    gate: Arc<Semaphore>,
    log: Arc<Mutex<Vec<u32>>>,
    entered: mpsc::UnboundedReceiver<u32>,
}

impl Shop {
    pub fn new() -> (Shop, ShopHandle) {
        let gate = Arc::new(Semaphore::new(0));
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::unbounded_channel();
        (
            Shop {
                ty: AggregateType::new("Shop").expect("valid"),
                gate: Arc::clone(&gate),
                log: Arc::clone(&log),
                entered: tx,
            },
            ShopHandle {
                gate,
                log,
                entered: rx,
            },
        )
    }
}

impl ShopHandle {
    /// Lets every waiting decision through, now and later.
    pub fn open(&self) {
        self.gate.add_permits(Semaphore::MAX_PERMITS / 2);
    }

    /// Lets one waiting decision through (each decision uses up its permit).
    pub fn let_one(&self) {
        self.gate.add_permits(1);
    }

    /// Waits (at most 10 s) until the decision of `tag` has started.
    pub async fn entered(&mut self, tag: u32) {
        loop {
            let got = tokio::time::timeout(Duration::from_secs(10), self.entered.recv())
                .await
                .expect("a decision started within 10 s")
                .expect("the shop is alive");
            if got == tag {
                return;
            }
        }
    }

    /// The tags in the order they were decided (every attempt).
    pub fn decided(&self) -> Vec<u32> {
        self.log.lock().expect("log").clone()
    }
}

impl Decider for Shop {
    type State = Stock;
    type Command = Cmd;
    type Event = Ev;
    type Error = Refused;

    fn aggregate_type(&self) -> &AggregateType {
        &self.ty
    }

    fn initial_state(&self, _id: Uuid) -> Stock {
        Stock::default()
    }

    async fn decide(&self, state: &Stock, command: &Cmd) -> std::result::Result<Vec<Ev>, Refused> {
        match *command {
            Cmd::Stock(n) => Ok(vec![Ev::Stocked(n)]),
            Cmd::Unstorable { tag } => {
                self.log.lock().expect("log").push(tag);
                Ok(vec![Ev::Unstorable])
            }
            Cmd::Tagged { tag, id } => {
                self.log.lock().expect("log").push(tag);
                Ok(vec![Ev::Tagged { tag, id }])
            }
            Cmd::PanicInDecide { tag } => panic!("command {tag} cannot be decided"),
            Cmd::PanicInEvolve { tag } => {
                self.log.lock().expect("log").push(tag);
                Ok(vec![Ev::Boom])
            }
            Cmd::Reserve { qty, tag, wait } => {
                self.log.lock().expect("log").push(tag);
                let _ = self.entered.send(tag);
                if wait {
                    self.gate.acquire().await.expect("gate open").forget();
                }
                let available = state.stocked - state.reserved;
                if u64::from(qty) > available {
                    return Err(Refused::SoldOut { tag, available });
                }
                Ok(vec![Ev::Reserved { qty, tag }])
            }
        }
    }

    fn evolve(&self, mut state: Stock, event: &Ev) -> Stock {
        match *event {
            Ev::Stocked(n) => state.stocked += u64::from(n),
            Ev::Reserved { qty, .. } => state.reserved += u64::from(qty),
            Ev::Tagged { .. } => state.reserved += 1,
            Ev::Unstorable => {}
            Ev::Boom => panic!("this event cannot be evolved"),
        }
        state
    }

    fn encode(&self, event: &Ev) -> Result<NewEvent> {
        match *event {
            Ev::Stocked(n) => NewEvent::new("Stocked", json!({ "n": n })),
            Ev::Reserved { qty, tag } => {
                NewEvent::new("Reserved", json!({ "qty": qty, "tag": tag }))
            }
            Ev::Unstorable => NewEvent::new(" ", json!({})),
            Ev::Tagged { tag, id } => {
                NewEvent::new("Reserved", json!({ "qty": 1, "tag": tag }))?.with_id(id)
            }
            Ev::Boom => NewEvent::new("Boom", json!({})),
        }
    }

    fn decode(&self, event: &RecordedEvent) -> Result<Ev> {
        let field = |name: &str| {
            event.payload[name]
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| Error::new(ErrorKind::Backend, format!("no {name} in {event:?}")))
        };
        match event.event_type.as_str() {
            "Stocked" => Ok(Ev::Stocked(field("n")?)),
            "Reserved" => Ok(Ev::Reserved {
                qty: field("qty")?,
                tag: field("tag")?,
            }),
            other => Err(Error::new(
                ErrorKind::Backend,
                format!("unknown event {other}"),
            )),
        }
    }
}

/// A backend the suite runs on: a transaction source and a store ("one process"), a second
/// handle on the same database ("another process"), and a way to lose the next `COMMIT` reply.
pub trait Backend {
    type Src: TransactionSource + Clone + 'static;
    type Store: SnapshotStore<<Self::Src as TransactionSource>::Tx> + Clone + 'static;

    fn process(&self) -> (Self::Src, Self::Store);
    fn another_process(&self) -> (Self::Src, Self::Store);
    /// The next `COMMIT` is carried out but its reply is lost.
    fn lose_next_commit_reply(&self);
}

/// Generous patience: the suite's batches are shaped by the gate, not by the clock.
pub fn patient() -> CombinerOptions {
    CombinerOptions::default().max_batch_time(Duration::from_secs(30))
}

pub fn combiner<B: Backend>(
    b: &B,
    options: CombinerOptions,
) -> (Combiner<B::Src, B::Store, Shop>, ShopHandle) {
    let (src, store) = b.process();
    let (shop, handle) = Shop::new();
    (Combiner::with_options(src, store, shop, options), handle)
}

fn reserve(qty: u32, tag: u32) -> Cmd {
    Cmd::Reserve {
        qty,
        tag,
        wait: false,
    }
}

fn gated(qty: u32, tag: u32) -> Cmd {
    Cmd::Reserve {
        qty,
        tag,
        wait: true,
    }
}

/// The committed events of `id`.
pub async fn stream<Src, St>(src: &Src, store: &St, id: Uuid) -> Vec<RecordedEvent>
where
    Src: TransactionSource,
    St: SnapshotStore<Src::Tx>,
{
    let tx = src.begin().await.expect("begin");
    let events = store
        .load(&tx, StreamId::from_uuid(id))
        .await
        .expect("load");
    let _ = tx.rollback().await;
    events
}

/// The reservation tags committed on `id`, in version order.
pub async fn reserved_tags<Src, St>(src: &Src, store: &St, id: Uuid) -> Vec<u64>
where
    Src: TransactionSource,
    St: SnapshotStore<Src::Tx>,
{
    stream(src, store, id)
        .await
        .iter()
        .filter(|e| e.event_type == "Reserved")
        .map(|e| e.payload["tag"].as_u64().expect("tag"))
        .collect()
}

async fn stocked<Src, St>(c: &Combiner<Src, St, Shop>, id: Uuid, n: u32) -> Accepted
where
    Src: TransactionSource + 'static,
    St: SnapshotStore<Src::Tx> + 'static,
{
    c.submit(id, Cmd::Stock(n)).await.expect("stocked")
}

/// FIFO, one batch, per-command versions: a gated first decision lets five more queue; they are
/// decided after it, in submission order, each on the state the previous one left, and
/// committed together.
pub async fn commands_are_decided_in_fifo_order_in_one_batch<B: Backend>(b: &B) {
    let (c, mut shop) = combiner(b, patient());
    let id = Uuid::now_v7();
    assert_eq!(stocked(&c, id, 10).await.last_version(), 1);
    let first = c.submit(id, gated(1, 0));
    shop.entered(0).await;
    let rest: Vec<_> = (1..=5).map(|tag| c.submit(id, reserve(1, tag))).collect();
    shop.open();
    let first = first.await.expect("accepted");
    assert_eq!((first.first_version(), first.last_version()), (2, 2));
    assert_eq!(
        first.batch_commands(),
        6,
        "the queued commands joined the batch"
    );
    assert_eq!(first.attempts(), 1);
    for (k, submission) in rest.into_iter().enumerate() {
        let accepted = submission.await.expect("accepted");
        assert_eq!(accepted.last_version(), 3 + k as u64, "FIFO versions");
        assert_eq!(accepted.batch_commands(), 6);
        assert_eq!(accepted.event_ids().len(), 1);
    }
    assert_eq!(shop.decided(), vec![0, 1, 2, 3, 4, 5]);
    let (src, store) = b.process();
    assert_eq!(
        reserved_tags(&src, &store, id).await,
        vec![0, 1, 2, 3, 4, 5]
    );
}

/// A refused command in the middle of a batch gets its own business error; the commands before
/// and after it are committed, the one after it decided on the state without it.
pub async fn a_business_error_in_the_middle_answers_only_its_command<B: Backend>(b: &B) {
    let (c, mut shop) = combiner(b, patient());
    let id = Uuid::now_v7();
    stocked(&c, id, 5).await;
    let a = c.submit(id, gated(3, 0));
    shop.entered(0).await;
    let refused = c.submit(id, reserve(4, 1));
    let after = c.submit(id, reserve(2, 2));
    shop.open();
    assert_eq!(a.await.expect("accepted").last_version(), 2);
    match refused.await {
        Err(CombineError::Rejected(why)) => {
            assert_eq!(
                why,
                Refused::SoldOut {
                    tag: 1,
                    available: 2
                }
            )
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    let after = after.await.expect("accepted");
    assert_eq!((after.last_version(), after.batch_commands()), (3, 3));
    let (src, store) = b.process();
    assert_eq!(reserved_tags(&src, &store, id).await, vec![0, 2]);
}

/// A command whose event cannot be stored is refused with `InvalidInput`, alone.
pub async fn an_unstorable_event_refuses_only_its_command<B: Backend>(b: &B) {
    let (c, mut shop) = combiner(b, patient());
    let id = Uuid::now_v7();
    stocked(&c, id, 5).await;
    let a = c.submit(id, gated(1, 0));
    shop.entered(0).await;
    let bad = c.submit(id, Cmd::Unstorable { tag: 1 });
    let after = c.submit(id, reserve(1, 2));
    shop.open();
    assert_eq!(a.await.expect("accepted").last_version(), 2);
    let err = bad.await.expect_err("refused");
    assert_eq!(err.kind(), Some(ErrorKind::InvalidInput), "{err}");
    assert_eq!(after.await.expect("accepted").last_version(), 3);
    let (src, store) = b.process();
    assert_eq!(reserved_tags(&src, &store, id).await, vec![0, 2]);
}

/// Event ids the commands chose: one already stored in the stream, and one chosen by two
/// commands of one batch. The store refuses the batch's append as a whole; the commands are
/// then decided again one per batch, and only the two at fault are refused (`InvalidInput`).
pub async fn an_event_id_already_stored_or_chosen_twice_refuses_only_its_command<B: Backend>(
    b: &B,
) {
    let (c, mut shop) = combiner(b, patient());
    let id = Uuid::now_v7();
    stocked(&c, id, 10).await;
    let (stored_id, chosen_id) = (Uuid::now_v7(), Uuid::now_v7());
    let stored = c.submit(
        id,
        Cmd::Tagged {
            tag: 9,
            id: stored_id,
        },
    );
    assert_eq!(stored.await.expect("stored").last_version(), 2);
    let first = c.submit(id, gated(1, 0));
    shop.entered(0).await;
    let one = c.submit(
        id,
        Cmd::Tagged {
            tag: 1,
            id: chosen_id,
        },
    );
    let twice = c.submit(
        id,
        Cmd::Tagged {
            tag: 2,
            id: chosen_id,
        },
    );
    let again = c.submit(
        id,
        Cmd::Tagged {
            tag: 3,
            id: stored_id,
        },
    );
    let last = c.submit(id, reserve(1, 4));
    shop.open();
    assert_eq!(first.await.expect("accepted").last_version(), 3);
    let one = one.await.expect("accepted");
    assert_eq!((one.last_version(), one.event_ids()), (4, &[chosen_id][..]));
    for (what, refused) in [("chosen twice", twice), ("already stored", again)] {
        let err = refused.await.expect_err(what);
        assert_eq!(err.kind(), Some(ErrorKind::InvalidInput), "{what}: {err:?}");
    }
    assert_eq!(last.await.expect("accepted").last_version(), 5);
    let (src, store) = b.process();
    assert_eq!(reserved_tags(&src, &store, id).await, vec![9, 0, 1, 4]);
}

/// A submission dropped while its batch had taken it, in a batch whose append is then refused
/// as a whole, goes back to the queue with the others but is never decided again: the
/// commands are decided again one per batch without it, and the aggregate's task ends.
pub async fn a_submission_dropped_in_a_refused_batch_is_not_decided_again<B: Backend>(b: &B) {
    let (c, mut shop) = combiner(b, patient());
    let id = Uuid::now_v7();
    stocked(&c, id, 10).await;
    let chosen_id = Uuid::now_v7();
    let first = c.submit(id, gated(1, 0));
    shop.entered(0).await;
    let one = c.submit(
        id,
        Cmd::Tagged {
            tag: 1,
            id: chosen_id,
        },
    );
    let twice = c.submit(
        id,
        Cmd::Tagged {
            tag: 2,
            id: chosen_id,
        },
    );
    let dropped = c.submit(id, gated(1, 3));
    shop.let_one();
    shop.entered(3).await;
    drop(dropped);
    shop.open();
    assert_eq!(first.await.expect("accepted").last_version(), 2);
    assert_eq!(one.await.expect("accepted").last_version(), 3);
    let err = twice.await.expect_err("chosen twice");
    assert_eq!(err.kind(), Some(ErrorKind::InvalidInput), "{err:?}");
    // The next command finds the aggregate served (the task ended or took it).
    assert_eq!(
        c.submit(id, reserve(1, 4))
            .await
            .expect("accepted")
            .last_version(),
        4
    );
    assert_eq!(shop.decided(), vec![0, 1, 2, 3, 0, 1, 2, 4]);
    let (src, store) = b.process();
    assert_eq!(reserved_tags(&src, &store, id).await, vec![0, 1, 4]);
}

/// A decider that panics fails the command it was deciding, alone (not retryable): in `decide`
/// the batch goes on; in `evolve` the commands before it are decided again in a new batch.
/// Nothing of the panicking commands is appended, and the aggregate keeps serving.
pub async fn a_panicking_decider_fails_only_the_command_it_was_deciding<B: Backend>(b: &B) {
    let (c, mut shop) = combiner(b, patient());
    let id = Uuid::now_v7();
    stocked(&c, id, 10).await;
    let first = c.submit(id, gated(1, 0));
    shop.entered(0).await;
    let in_decide = c.submit(id, Cmd::PanicInDecide { tag: 1 });
    let middle = c.submit(id, reserve(1, 2));
    let in_evolve = c.submit(id, Cmd::PanicInEvolve { tag: 3 });
    let last = c.submit(id, reserve(1, 4));
    shop.open();
    let versions = (
        first.await.expect("accepted").last_version(),
        middle.await.expect("accepted").last_version(),
        last.await.expect("accepted").last_version(),
    );
    assert_eq!(versions, (2, 3, 4));
    for (what, failed) in [("decide", in_decide), ("evolve", in_evolve)] {
        let err = failed.await.expect_err(what);
        assert_eq!(err.kind(), Some(ErrorKind::Backend), "{what}: {err:?}");
        assert!(!lockstep_core::Retryable::is_retryable(&err), "{what}");
        let message = err.error().map(Error::message).unwrap_or_default();
        assert!(message.contains("panicked"), "{what}: {message}");
    }
    let (src, store) = b.process();
    assert_eq!(reserved_tags(&src, &store, id).await, vec![0, 2, 4]);
    assert_eq!(
        c.submit(id, reserve(1, 5))
            .await
            .expect("still serving")
            .last_version(),
        5
    );
}

/// Appends `qty` reserved units directly (no lock): a writer that does not use the combiner.
async fn foreign_append<Src, St>(src: &Src, store: &St, id: Uuid, expected: u64, qty: u32)
where
    Src: TransactionSource,
    St: SnapshotStore<Src::Tx>,
{
    let tx = src.begin().await.expect("begin");
    let event = NewEvent::new("Reserved", json!({ "qty": qty, "tag": 99 })).expect("event");
    store
        .append(
            &tx,
            StreamId::from_uuid(id),
            ExpectedVersion::Exact(expected),
            &[event],
        )
        .await
        .expect("foreign append");
    tx.commit().await.expect("foreign commit");
}

/// A batch about to conflict: 10 units stocked, a gated decision of tag 0 under way, tag 1
/// (2 units) queued behind it, and `foreign` units reserved meanwhile by a writer outside the
/// lock. Retries: 3 attempts, 1–5 ms apart.
struct Conflicting {
    shop: ShopHandle,
    id: Uuid,
    first: lockstep_combiner::Submission<Shop>,
    second: lockstep_combiner::Submission<Shop>,
}

async fn conflicting<B: Backend>(b: &B, foreign: u32) -> Conflicting {
    let retry = RetryPolicy::new(
        std::num::NonZeroU32::new(3).expect("non-zero"),
        Duration::from_millis(1),
        Duration::from_millis(5),
    );
    let (c, mut shop) = combiner(b, patient().retry(retry));
    let id = Uuid::now_v7();
    stocked(&c, id, 10).await;
    let first = c.submit(id, gated(1, 0));
    shop.entered(0).await;
    let second = c.submit(id, reserve(2, 1));
    let (src, store) = b.process();
    foreign_append(&src, &store, id, 1, foreign).await;
    // The batch task holds the combiner's state: the handle may go.
    Conflicting {
        shop,
        id,
        first,
        second,
    }
}

/// A commit that conflicts (a writer outside the lock appended meanwhile) is retried: the batch
/// is loaded again and every command re-decided on the new state.
pub async fn a_conflicting_commit_is_retried_and_every_command_re_decided<B: Backend>(b: &B) {
    let Conflicting {
        shop,
        id,
        first: a,
        second: b_cmd,
    } = conflicting(b, 8).await;
    let (src, store) = b.process();
    shop.open();
    let a = a.await.expect("accepted on the second attempt");
    assert_eq!((a.attempts(), a.last_version()), (2, 3));
    match b_cmd.await {
        Err(CombineError::Rejected(why)) => {
            assert_eq!(
                why,
                Refused::SoldOut {
                    tag: 1,
                    available: 1
                },
                "re-decided"
            )
        }
        other => panic!("expected a rejection on fresh state, got {other:?}"),
    }
    assert_eq!(shop.decided(), vec![0, 1, 0, 1]);
    assert_eq!(reserved_tags(&src, &store, id).await, vec![99, 0]);
}

/// A submission dropped while its batch waits to be retried is left out of the retry: nothing
/// of it was committed, and it is not decided again.
pub async fn a_submission_dropped_before_a_retry_is_left_out_of_it<B: Backend>(b: &B) {
    let Conflicting {
        mut shop,
        id,
        first: a,
        second: dropped,
    } = conflicting(b, 3).await;
    let (src, store) = b.process();
    // The first attempt decides 0 and 1 and conflicts; the retry waits at 0's gate.
    shop.let_one();
    shop.entered(0).await;
    drop(dropped);
    shop.open();
    let a = a.await.expect("accepted on the retry");
    assert_eq!(
        (a.attempts(), a.last_version(), a.batch_commands()),
        (2, 3, 1)
    );
    assert_eq!(shop.decided(), vec![0, 1, 0]);
    assert_eq!(reserved_tags(&src, &store, id).await, vec![99, 0]);
}

/// A commit that fails for good answers every command of the batch with that error (a conflict
/// stays retryable), and nothing of the batch is committed.
pub async fn a_failed_commit_answers_every_command_with_its_error<B: Backend>(b: &B) {
    let once = RetryPolicy::new(
        std::num::NonZeroU32::MIN,
        Duration::from_millis(1),
        Duration::from_millis(1),
    );
    let (c, mut shop) = combiner(b, patient().retry(once));
    let id = Uuid::now_v7();
    stocked(&c, id, 10).await;
    let a = c.submit(id, gated(1, 0));
    shop.entered(0).await;
    let refused = c.submit(id, reserve(50, 1));
    let after = c.submit(id, reserve(1, 2));
    let (src, store) = b.process();
    foreign_append(&src, &store, id, 1, 1).await;
    shop.open();
    for answer in [a.await, refused.await, after.await] {
        match answer {
            Err(CombineError::Failed(e)) => {
                assert_eq!(e.kind(), ErrorKind::Conflict, "{e}");
                assert!(e.is_retryable());
            }
            other => panic!("expected the commit's conflict, got {other:?}"),
        }
    }
    assert_eq!(reserved_tags(&src, &store, id).await, vec![99]);

    // A failure that is not retryable is not retried: every command gets it once.
    let (src, store) = b.process();
    let (faulty, faults) = FaultyEventStore::new(store.clone());
    let (shop2, mut handle) = Shop::new();
    let c = Combiner::with_options(src.clone(), faulty, shop2, patient());
    let a = c.submit(id, gated(1, 10));
    handle.entered(10).await;
    let next = c.submit(id, reserve(1, 11));
    faults.fail_next_appends(1, ErrorKind::Backend);
    handle.open();
    for answer in [a.await, next.await] {
        assert_eq!(answer.expect_err("failed").kind(), Some(ErrorKind::Backend));
    }
    assert_eq!(handle.decided(), vec![10, 11], "decided once");
    assert_eq!(reserved_tags(&src, &store, id).await, vec![99]);
    // The combiner goes on with the next batch.
    assert_eq!(
        c.submit(id, reserve(1, 12))
            .await
            .expect("ok")
            .last_version(),
        3
    );
}

/// A lost `COMMIT` reply answers every command with `CommitUnknown` and its events' ids, which
/// the caller finds committed.
pub async fn a_lost_commit_reply_is_commit_unknown_with_the_event_ids<B: Backend>(b: &B) {
    let (c, mut shop) = combiner(b, patient());
    let id = Uuid::now_v7();
    stocked(&c, id, 10).await;
    let a = c.submit(id, gated(1, 0));
    shop.entered(0).await;
    let next = c.submit(id, reserve(2, 1));
    b.lose_next_commit_reply();
    shop.open();
    let mut ids = Vec::new();
    for answer in [a.await, next.await] {
        match answer {
            Err(CombineError::CommitUnknown { error, event_ids }) => {
                assert_eq!(error.kind(), ErrorKind::CommitUnknown);
                assert_eq!(event_ids.len(), 1);
                ids.extend(event_ids);
            }
            other => panic!("expected CommitUnknown, got {other:?}"),
        }
    }
    assert_eq!(shop.decided(), vec![0, 1], "not retried");
    let (src, store) = b.process();
    let mut found = Vec::new();
    for _ in 0..100 {
        found = stream(&src, &store, id)
            .await
            .iter()
            .map(|e| e.event_id)
            .filter(|e| ids.contains(e))
            .collect();
        if found.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(found, ids, "the server did commit them");
    // The next batch works (on a fresh connection).
    assert_eq!(
        c.submit(id, reserve(1, 2))
            .await
            .expect("ok")
            .last_version(),
        4
    );
}

/// A submission dropped before its turn is never decided; one dropped after its decision is
/// committed with its batch.
pub async fn dropped_submissions_are_removed_before_their_turn_and_committed_after<B: Backend>(
    b: &B,
) {
    let (c, mut shop) = combiner(b, patient());
    let id = Uuid::now_v7();
    stocked(&c, id, 10).await;
    let a = c.submit(id, gated(1, 0));
    shop.entered(0).await;
    let dropped = c.submit(id, reserve(1, 1));
    let kept = c.submit(id, reserve(1, 2));
    drop(dropped);
    shop.open();
    assert_eq!(a.await.expect("ok").batch_commands(), 2);
    assert_eq!(kept.await.expect("ok").last_version(), 3);

    let (c, mut shop) = combiner(b, patient());
    let late = c.submit(id, gated(1, 3));
    shop.entered(3).await;
    drop(late); // its decision is under way: it is committed with the batch
    let next = c.submit(id, reserve(1, 4));
    shop.open();
    let next = next.await.expect("ok");
    assert_eq!((next.last_version(), next.batch_commands()), (5, 2));
    let (src, store) = b.process();
    assert_eq!(reserved_tags(&src, &store, id).await, vec![0, 2, 3, 4]);
    assert_eq!(shop.decided(), vec![3, 4]);
}

/// The bounds: at most `max_commands` per batch; a zero time budget or a tiny byte budget makes
/// batches of one. Answers stay FIFO.
pub async fn batches_are_bounded_by_commands_time_and_bytes<B: Backend>(b: &B) {
    let two = NonZeroUsize::new(2).expect("non-zero");
    for (options, max) in [
        (patient().max_commands(two), 2),
        (CombinerOptions::default().max_batch_time(Duration::ZERO), 1),
        (patient().max_bytes(NonZeroUsize::MIN), 1),
    ] {
        let (c, mut shop) = combiner(b, options);
        let id = Uuid::now_v7();
        stocked(&c, id, 10).await;
        let first = c.submit(id, gated(1, 0));
        shop.entered(0).await;
        let rest: Vec<_> = (1..=4).map(|tag| c.submit(id, reserve(1, tag))).collect();
        shop.open();
        let mut versions = vec![first.await.expect("ok")];
        for s in rest {
            versions.push(s.await.expect("ok"));
        }
        for (k, accepted) in versions.iter().enumerate() {
            assert_eq!(accepted.last_version(), 2 + k as u64, "FIFO");
            assert!(
                accepted.batch_commands() <= max,
                "{options:?}: {accepted:?}"
            );
        }
        // A command that did not fit the byte budget is decided again in the next batch.
        let mut decided = shop.decided();
        decided.dedup();
        assert_eq!(decided, vec![0, 1, 2, 3, 4]);
    }
}

/// Two processes (two combiners on two handles) selling one aggregate: never oversold, every
/// buyer answered, nothing failed.
pub async fn two_processes_on_one_aggregate_never_oversell<B: Backend>(b: &B) {
    let (src1, store1) = b.process();
    let (src2, store2) = b.another_process();
    let (shop1, _h1) = Shop::new();
    let (shop2, _h2) = Shop::new();
    let options = CombinerOptions::default().lock_timeout(Some(Duration::from_secs(30)));
    let c1 = Combiner::with_options(src1.clone(), store1.clone(), shop1, options);
    let c2 = Combiner::with_options(src2, store2, shop2, options);
    let id = Uuid::now_v7();
    stocked(&c1, id, 20).await;
    let mut buyers = Vec::new();
    for tag in 0..32u32 {
        let c = if tag % 2 == 0 { c1.clone() } else { c2.clone() };
        let submission = c.submit(id, reserve(1, tag));
        buyers.push(tokio::spawn(submission));
    }
    let (mut ok, mut sold_out) = (0, 0);
    for buyer in buyers {
        match buyer.await.expect("buyer task") {
            Ok(_) => ok += 1,
            Err(CombineError::Rejected(_)) => sold_out += 1,
            Err(other) => panic!("a buyer failed: {other:?}"),
        }
    }
    assert_eq!((ok, sold_out), (20, 12));
    let tags = reserved_tags(&src1, &store1, id).await;
    assert_eq!(tags.len(), 20, "never oversold");
    let versions: Vec<u64> = stream(&src1, &store1, id)
        .await
        .iter()
        .map(|e| e.version)
        .collect();
    assert_eq!(
        versions,
        (1..=21).collect::<Vec<_>>(),
        "no gap, no duplicate"
    );
}

/// One test per case; `$make` is a future of the backend (a fresh one per test).
#[macro_export]
macro_rules! combiner_suite {
    ($make:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn commands_are_decided_in_fifo_order_in_one_batch() {
            suite::commands_are_decided_in_fifo_order_in_one_batch(&$make.await).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_business_error_in_the_middle_answers_only_its_command() {
            suite::a_business_error_in_the_middle_answers_only_its_command(&$make.await).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn an_unstorable_event_refuses_only_its_command() {
            suite::an_unstorable_event_refuses_only_its_command(&$make.await).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn an_event_id_already_stored_or_chosen_twice_refuses_only_its_command() {
            suite::an_event_id_already_stored_or_chosen_twice_refuses_only_its_command(
                &$make.await,
            )
            .await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_submission_dropped_in_a_refused_batch_is_not_decided_again() {
            suite::a_submission_dropped_in_a_refused_batch_is_not_decided_again(&$make.await).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_panicking_decider_fails_only_the_command_it_was_deciding() {
            suite::a_panicking_decider_fails_only_the_command_it_was_deciding(&$make.await).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_submission_dropped_before_a_retry_is_left_out_of_it() {
            suite::a_submission_dropped_before_a_retry_is_left_out_of_it(&$make.await).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_conflicting_commit_is_retried_and_every_command_re_decided() {
            suite::a_conflicting_commit_is_retried_and_every_command_re_decided(&$make.await).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_failed_commit_answers_every_command_with_its_error() {
            suite::a_failed_commit_answers_every_command_with_its_error(&$make.await).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_lost_commit_reply_is_commit_unknown_with_the_event_ids() {
            suite::a_lost_commit_reply_is_commit_unknown_with_the_event_ids(&$make.await).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn dropped_submissions_are_removed_before_their_turn_and_committed_after() {
            suite::dropped_submissions_are_removed_before_their_turn_and_committed_after(
                &$make.await,
            )
            .await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn batches_are_bounded_by_commands_time_and_bytes() {
            suite::batches_are_bounded_by_commands_time_and_bytes(&$make.await).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn two_processes_on_one_aggregate_never_oversell() {
            suite::two_processes_on_one_aggregate_never_oversell(&$make.await).await;
        }
    };
}
