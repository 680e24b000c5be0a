//! The demo (`cargo run -p lockstep-demo`): both halves of lockstep, explained as they run.
//!
//! 1. **The flash sale** of the aggregate-lock seed: one `StockItem`, stock 100, 32 concurrent
//!    buyers of 4 units, first with optimistic concurrency + retry, then with the pessimistic
//!    per-aggregate write lock, then through the command combiner (queued buyers decided in
//!    turn under one lock and one commit). Checks that nothing is oversold, every buyer is
//!    answered, and neither the lock nor the combiner has a conflict.
//! 2. **Perspectives on three worker instances**: events flow, a late event arrives, one
//!    instance rewinds under a `rewind` lease while the others leave the pair alone and its new
//!    events queue; then an instance is stopped mid-rewind and another takes over after the lock
//!    timeout. Checks every read model against the fold of its events.
//!
//! On the in-memory backends by default (with a little latency on the fake event store, so that
//! optimistic writers really race); on PostgreSQL with `--database-url`, in a database of its own
//! that it creates, migrates and drops.

use lockstep_core::Pair;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use lockstep_combiner::{CombineError, Combiner};
use lockstep_core::{
    AggregateWriteLock, DistributedAggregateWriteLock, EventStore, ExpectedVersion, Fleet,
    InstanceId, LeaseStatus, NewEvent, PerspectiveRegistry, PerspectiveStore, StreamId,
    StreamLockAdmin, StreamLockOptions, StreamLocker, TransactionSource,
};
use lockstep_example_inventory::handler::{self, LockMode, ReserveStock, ReserveStockHandler};
use lockstep_example_inventory::{InventoryError, Reserve, StockItemDecider, wiring};
use lockstep_testkit::{
    FakeDatabase, FakeDistributedLock, FaultyEventStore, InMemoryEventStore,
    InMemoryPerspectiveStore, InMemoryStreamLocker,
};
use lockstep_worker::{CancellationToken, PerspectiveWorker, WorkerOptions};
use uuid::Uuid;

use crate::db_url::DbUrl;
use crate::ledger::{Entries, Ledger, entry, fold, ledger_name};
use crate::say;
use lockstep_core::Transaction as _;

const BUYERS: usize = 32;
const STOCK: u32 = 100;
const EACH: u32 = 4;

/// Runs the demo; `Err` when a check failed (the report says which).
pub(crate) async fn run(url: Option<DbUrl>) -> Result<()> {
    match url {
        None => in_memory().await,
        Some(url) => on_postgres(&url).await,
    }
}

async fn in_memory() -> Result<()> {
    say!(
        "lockstep demo — in memory (pass --database-url or set DATABASE_URL to run it on PostgreSQL)"
    );
    say!("The fake event store answers each call after 2 ms, like a database on the network,");
    say!("so concurrent writers really overlap.");
    let mut checks = Checks::default();

    say!(
        "\n== 1. Flash sale: {BUYERS} buyers, {EACH} units each, stock {STOCK} (25 can buy, 7 must be told 'sold out')"
    );
    explain_modes();
    for mode in [LockMode::Optimistic, LockMode::Pessimistic] {
        let db = FakeDatabase::new();
        let (store, faults) = FaultyEventStore::new(InMemoryEventStore::new());
        faults.set_latency(Duration::from_millis(2));
        let lock = DistributedAggregateWriteLock::new(FakeDistributedLock::new(&db));
        let handler = Arc::new(ReserveStockHandler::new(lock, store.clone(), mode));
        let report = sale(Arc::new(db), handler, &store).await?;
        report.print(&mut checks);
    }
    {
        let db = FakeDatabase::new();
        let (store, faults) = FaultyEventStore::new(InMemoryEventStore::new());
        faults.set_latency(Duration::from_millis(2));
        let combiner = wiring::fake_combiner(&db, store.clone());
        let report = combined_sale(&db, &combiner, &store).await?;
        report.print(&mut checks);
    }

    say!("\n== 2. Perspectives on three worker instances (lock timeout 3 s, keepalive 1 s)");
    let db = FakeDatabase::new();
    let events = InMemoryEventStore::new();
    let locker = InMemoryStreamLocker::with_database(demo_lock_options()?, &db);
    let store = InMemoryPerspectiveStore::new(&db, &events, &locker);
    let (fork_db, fork_locker) = (db.clone(), locker.clone());
    let stack = Stack {
        source: db,
        store,
        events,
        locker: Arc::new(locker.clone()),
        admin: Arc::new(locker),
        fork: Box::new(move || {
            let fleet: Arc<dyn Fleet> = Arc::new(fork_locker.clone());
            Ok((fork_db.clone(), fleet))
        }),
    };
    perspectives(&stack, &mut checks).await?;
    checks.finish()
}

async fn on_postgres(url: &DbUrl) -> Result<()> {
    let name = format!(
        "lockstep_demo_{}",
        &Uuid::new_v4().simple().to_string()[..12]
    );
    say!("lockstep demo — on PostgreSQL: {url}");
    say!(
        "It creates the database {name} on that server, migrates it, runs there, and drops it at the end."
    );
    let admin = url.connect().await?;
    admin
        .batch_execute(&format!("CREATE DATABASE \"{name}\""))
        .await
        .with_context(|| format!("creating the demo database {name} (the user needs CREATEDB)"))?;
    let outcome = postgres_demo(&url.with_database(&name)).await;
    let dropped = admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
        .await;
    match &dropped {
        Ok(()) => say!("\nDropped {name}: nothing left behind."),
        Err(e) => say!("\nCould not drop {name} ({e}); drop it by hand."),
    }
    outcome
}

async fn postgres_demo(url: &DbUrl) -> Result<()> {
    let db = url.handle(24).await?;
    let report = db.migrate().await.map_err(anyhow::Error::new)?;
    say!("Migrated: {} migrations applied.", report.applied.len());
    let mut checks = Checks::default();

    say!(
        "\n== 1. Flash sale: {BUYERS} buyers, {EACH} units each, stock {STOCK} (25 can buy, 7 must be told 'sold out')"
    );
    explain_modes();
    let source = Arc::new(db.clone());
    for mode in [LockMode::Optimistic, LockMode::Pessimistic] {
        let handler = Arc::new(wiring::postgres_handler(&db, mode));
        let store = lockstep_pg_store::PgEventStore::new(&db);
        let report = sale(Arc::clone(&source), handler, &store).await?;
        report.print(&mut checks);
    }
    {
        let combiner = wiring::postgres_combiner(&db);
        let store = lockstep_pg_store::PgEventStore::new(&db);
        let report = combined_sale(&db, &combiner, &store).await?;
        report.print(&mut checks);
    }

    say!("\n== 2. Perspectives on three worker instances (lock timeout 3 s, keepalive 1 s)");
    let locker = Arc::new(lockstep_pg_stream::PgStreamLocker::new(
        &db,
        demo_lock_options()?,
    ));
    let fork_url = url.clone();
    let stack = Stack {
        source: db.clone(),
        store: lockstep_pg_store::PgPerspectiveStore::new(),
        events: lockstep_pg_store::PgEventStore::new(&db),
        locker: locker.clone(),
        admin: locker,
        fork: Box::new(move || {
            let db = fork_url.handle_lazy(4)?;
            let fleet: Arc<dyn Fleet> = Arc::new(lockstep_pg_stream::PgStreamLocker::new(
                &db,
                demo_lock_options()?,
            ));
            Ok((db, fleet))
        }),
    };
    perspectives(&stack, &mut checks).await?;
    checks.finish()
}

fn demo_lock_options() -> Result<StreamLockOptions> {
    StreamLockOptions::new(Duration::from_secs(3), Duration::from_secs(1))
        .map_err(|e| anyhow!("demo lock options: {e}"))
}

fn explain_modes() {
    say!(
        "- optimistic: every buyer loads the item, decides, and appends at the version it loaded;"
    );
    say!("  when two append the same version, the second gets a conflict and retries from scratch");
    say!(
        "  (a 'wasted append'). Correct, lock-free, but on one hot item most work is thrown away."
    );
    say!(
        "- pessimistic: every buyer first takes the item's write lock (a transaction-scoped advisory"
    );
    say!("  lock, relay:aggregate:StockItem:<id>), then loads: buyers queue instead of racing.");
    say!("  A good result: no conflicts, no retries, and a much lower p99.");
    say!("- combined: buyers submit to the command combiner; one batch at a time takes the lock,");
    say!("  loads once, decides the queued buyers in turn (each on the stock the previous left),");
    say!("  and appends all their reservations with one commit. Each buyer still gets its own");
    say!("  answer: reserved, or 'sold out'. No conflicts, and far fewer commits.");
}

/// What the buyers of one sale were answered.
struct SaleReport {
    mode: Option<LockMode>,
    ok: u64,
    sold_out: u64,
    failed: Vec<String>,
    conflicts: u64,
    retries: u64,
    p50: Duration,
    p99: Duration,
    elapsed: Duration,
    available: u64,
}

impl SaleReport {
    fn print(&self, checks: &mut Checks) {
        let name = match self.mode {
            Some(LockMode::Optimistic) => "optimistic + retry",
            Some(LockMode::Pessimistic) => "pessimistic lock",
            None => "combined",
            _ => "other",
        };
        say!(
            "{name:>20}: {} bought, {} sold out, {} failed | wasted appends {:>3}, retries {:>3} | p50 {:>7.1} ms, p99 {:>7.1} ms | {:>6.0} ms in all | {} left",
            self.ok,
            self.sold_out,
            self.failed.len(),
            self.conflicts,
            self.retries,
            ms(self.p50),
            ms(self.p99),
            ms(self.elapsed),
            self.available
        );
        for failure in &self.failed {
            say!("{:>22}failure: {failure}", "");
        }
        let reserved = self.ok * u64::from(EACH);
        checks.check(
            &format!(
                "{name}: never oversold ({reserved} reserved + {} left = {STOCK})",
                self.available
            ),
            reserved + self.available == u64::from(STOCK),
        );
        checks.check(
            &format!("{name}: every buyer answered, none failed"),
            self.ok + self.sold_out == BUYERS as u64 && self.failed.is_empty(),
        );
        if self.mode != Some(LockMode::Optimistic) {
            checks.check(&format!("{name}: no conflicts"), self.conflicts == 0);
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Stocks a new item and lets the buyers loose on it.
async fn sale<S, L, St>(
    source: Arc<S>,
    reserve: Arc<ReserveStockHandler<L, St>>,
    store: &St,
) -> Result<SaleReport>
where
    S: TransactionSource + 'static,
    L: AggregateWriteLock<S::Tx> + 'static,
    St: EventStore<S::Tx> + 'static,
{
    let sku = Uuid::now_v7();
    handler::stock_new_item(&*source, store, sku, STOCK)
        .await
        .map_err(|e| anyhow!("stocking the item: {e}"))?;
    let started = Instant::now();
    let buyers: Vec<_> = (0..BUYERS)
        .map(|_| {
            let (source, reserve) = (Arc::clone(&source), Arc::clone(&reserve));
            tokio::spawn(async move {
                let cmd = ReserveStock {
                    sku,
                    quantity: EACH,
                    reservation_id: Uuid::now_v7(),
                };
                let t = Instant::now();
                let outcome = reserve.handle(&*source, &cmd).await;
                (t.elapsed(), outcome)
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(BUYERS);
    let mut report = SaleReport {
        mode: Some(reserve.mode()),
        ok: 0,
        sold_out: 0,
        failed: Vec::new(),
        conflicts: 0,
        retries: 0,
        p50: Duration::ZERO,
        p99: Duration::ZERO,
        elapsed: Duration::ZERO,
        available: 0,
    };
    for buyer in buyers {
        let (latency, outcome) = buyer.await.context("a buyer's task panicked")?;
        latencies.push(latency);
        match outcome {
            Ok(done) => {
                report.ok += 1;
                report.conflicts += u64::from(done.conflicts);
                report.retries += u64::from(done.attempts.saturating_sub(1));
            }
            Err(InventoryError::InsufficientStock { .. }) => report.sold_out += 1,
            Err(other) => report.failed.push(other.to_string()),
        }
    }
    report.elapsed = started.elapsed();
    latencies.sort();
    report.p50 = percentile(&latencies, 0.50);
    report.p99 = percentile(&latencies, 0.99);
    report.available = handler::load_item(&*source, store, sku)
        .await
        .map_err(|e| anyhow!("loading the item: {e}"))?
        .available();
    Ok(report)
}

/// Stocks a new item and lets the buyers loose on it through the command combiner.
async fn combined_sale<S, St>(
    source: &S,
    combiner: &Combiner<S, St, StockItemDecider>,
    store: &St,
) -> Result<SaleReport>
where
    S: TransactionSource + 'static,
    St: lockstep_core::SnapshotStore<S::Tx> + 'static,
{
    let sku = Uuid::now_v7();
    handler::stock_new_item(source, store, sku, STOCK)
        .await
        .map_err(|e| anyhow!("stocking the item: {e}"))?;
    let started = Instant::now();
    let buyers: Vec<_> = (0..BUYERS)
        .map(|_| {
            let submission = combiner.submit(
                sku,
                Reserve {
                    quantity: EACH,
                    reservation_id: Uuid::now_v7(),
                },
            );
            tokio::spawn(async move {
                let t = Instant::now();
                let outcome = submission.await;
                (t.elapsed(), outcome)
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(BUYERS);
    let mut report = SaleReport {
        mode: None,
        ok: 0,
        sold_out: 0,
        failed: Vec::new(),
        conflicts: 0,
        retries: 0,
        p50: Duration::ZERO,
        p99: Duration::ZERO,
        elapsed: Duration::ZERO,
        available: 0,
    };
    for buyer in buyers {
        let (latency, outcome) = buyer.await.context("a buyer's task panicked")?;
        latencies.push(latency);
        match outcome {
            Ok(done) => {
                report.ok += 1;
                report.retries += u64::from(done.attempts().saturating_sub(1));
            }
            Err(CombineError::Rejected(InventoryError::InsufficientStock { .. })) => {
                report.sold_out += 1
            }
            Err(other) => {
                if other.kind() == Some(lockstep_core::ErrorKind::Conflict) {
                    report.conflicts += 1;
                }
                report.failed.push(other.to_string());
            }
        }
    }
    report.elapsed = started.elapsed();
    latencies.sort();
    report.p50 = percentile(&latencies, 0.50);
    report.p99 = percentile(&latencies, 0.99);
    report.available = handler::load_item(source, store, sku)
        .await
        .map_err(|e| anyhow!("loading the item: {e}"))?
        .available();
    Ok(report)
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() as f64) * q).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The pieces of one backend the perspective demo runs on.
struct Stack<S, P, E> {
    source: S,
    store: P,
    events: E,
    /// The stream locker, which keeps the fleet too: the instances announce themselves.
    locker: Arc<dyn Fleet>,
    admin: Arc<dyn StreamLockAdmin>,
    /// A transaction source and locker of their own, for the instance that runs on a runtime
    /// of its own (on Postgres: its own pool, so that its stall never blocks a connection the
    /// other instances use).
    fork: Fork<S>,
}

type Fork<S> = Box<dyn Fn() -> Result<(S, Arc<dyn Fleet>)>>;

/// One worker instance, driven in a loop that can be paused and stopped.
struct Instance {
    name: &'static str,
    id: InstanceId,
    paused: Arc<Pause>,
    stop: CancellationToken,
    applied: Arc<AtomicUsize>,
    rewinds: Arc<AtomicUsize>,
    done: Option<std::thread::JoinHandle<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Instance {
    fn counters(name: &'static str) -> Instance {
        Instance {
            name,
            id: InstanceId::random(),
            paused: Arc::default(),
            stop: CancellationToken::new(),
            applied: Arc::default(),
            rewinds: Arc::default(),
            done: None,
            task: None,
        }
    }
}

/// A stream locker whose every call waits while `stalled` is set: the lease calls of an
/// instance that is frozen (a long GC pause, SIGSTOP, a VM migration), resumed when it thaws.
struct Frozen {
    inner: Arc<dyn Fleet>,
    stalled: Arc<AtomicBool>,
}

impl Frozen {
    async fn thawed(&self) {
        while self.stalled.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[lockstep_core::async_trait]
impl StreamLocker for Frozen {
    fn options(&self) -> StreamLockOptions {
        self.inner.options()
    }

    async fn try_acquire(
        &self,
        stream_id: StreamId,
        perspective: &lockstep_core::PerspectiveName,
        instance: InstanceId,
        reason: &lockstep_core::LockReason,
    ) -> lockstep_core::Result<lockstep_core::AcquireOutcome> {
        self.thawed().await;
        self.inner
            .try_acquire(stream_id, perspective, instance, reason)
            .await
    }

    async fn renew(
        &self,
        lease: &lockstep_core::LeaseId,
    ) -> lockstep_core::Result<lockstep_core::RenewOutcome> {
        self.thawed().await;
        self.inner.renew(lease).await
    }

    async fn release(
        &self,
        lease: &lockstep_core::LeaseId,
    ) -> lockstep_core::Result<lockstep_core::ReleaseOutcome> {
        self.thawed().await;
        self.inner.release(lease).await
    }

    async fn renew_many(
        &self,
        leases: &[lockstep_core::LeaseId],
    ) -> lockstep_core::Result<Vec<lockstep_core::RenewOutcome>> {
        self.thawed().await;
        self.inner.renew_many(leases).await
    }
}

/// The fleet calls freeze too: a frozen process neither renews nor says it is alive.
#[lockstep_core::async_trait]
impl Fleet for Frozen {
    async fn announce(
        &self,
        announcement: &lockstep_core::InstanceAnnouncement,
    ) -> lockstep_core::Result<()> {
        self.thawed().await;
        self.inner.announce(announcement).await
    }

    async fn keepalive(
        &self,
        instance: InstanceId,
        token: lockstep_core::Uuid,
        leases: &[lockstep_core::LeaseId],
    ) -> lockstep_core::Result<lockstep_core::KeepaliveOutcome> {
        self.thawed().await;
        self.inner.keepalive(instance, token, leases).await
    }

    async fn depart(
        &self,
        instance: InstanceId,
        token: lockstep_core::Uuid,
    ) -> lockstep_core::Result<bool> {
        self.thawed().await;
        self.inner.depart(instance, token).await
    }
}

/// Pausing an instance: `requested` by the demo, `parked` once its loop has seen the request
/// between two cycles (so no cycle of it is in flight any more).
#[derive(Debug, Default)]
struct Pause {
    requested: AtomicBool,
    parked: AtomicBool,
}

impl Pause {
    fn set(&self, paused: bool) {
        self.requested.store(paused, Ordering::SeqCst);
    }
}

/// Pauses `instances` and waits (at most 30 s) until none of them has a cycle in flight: a
/// cycle that started before the pause could otherwise still pick up the next late event.
async fn pause_and_wait(instances: &[Instance]) -> Result<()> {
    for instance in instances {
        instance.paused.set(true);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !instances
        .iter()
        .all(|i| i.paused.parked.load(Ordering::SeqCst))
    {
        if Instant::now() >= deadline {
            anyhow::bail!("a paused instance did not finish its cycle within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// The worker loop of an instance: cycles while not paused, until stopped.
async fn drive<S, P>(
    worker: PerspectiveWorker<S, P>,
    paused: Arc<Pause>,
    stop: CancellationToken,
    applied: Arc<AtomicUsize>,
    rewinds: Arc<AtomicUsize>,
) where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    while !stop.is_cancelled() {
        if paused.requested.load(Ordering::SeqCst) {
            paused.parked.store(true, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        paused.parked.store(false, Ordering::SeqCst);
        let report = tokio::select! {
            () = stop.cancelled() => break,
            report = worker.run_once() => report,
        };
        applied.fetch_add(report.applied, Ordering::SeqCst);
        rewinds.fetch_add(report.rewinds, Ordering::SeqCst);
        if !report.did_work() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn worker_for<S, P>(
    source: S,
    fleet: Arc<dyn Fleet>,
    store: P,
    ledger: &Ledger,
    id: InstanceId,
) -> Result<PerspectiveWorker<S, P>>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let mut registry = PerspectiveRegistry::new();
    registry.register(ledger.clone())?;
    let options = WorkerOptions::default()
        .with_poll_interval(Duration::from_millis(20))
        .with_snapshot_every(50);
    Ok(PerspectiveWorker::new(source, store, registry, options, id, None)?.with_fleet(fleet))
}

async fn perspectives<S, P, E>(stack: &Stack<S, P, E>, checks: &mut Checks) -> Result<()>
where
    S: TransactionSource + Clone + 'static,
    P: PerspectiveStore<S::Tx> + Clone + 'static,
    E: EventStore<S::Tx>,
{
    let ledger = Ledger::default();
    say!(
        "A perspective ('Ledger') folds each stream's events, in event-id order, into a read model."
    );
    say!(
        "Three instances (A, B, C) run the same worker; each pair (stream, perspective) is applied by"
    );
    say!("one instance at a time. Rewinds take a stream lease that a keepalive renews.");

    // Instances A and B run on this runtime; C on a runtime of its own, so that it can be
    // stopped dead (its runtime dropped: no release, no renew — a crashed process).
    let mut instances = vec![Instance::counters("A"), Instance::counters("B")];
    for instance in &mut instances {
        let worker = worker_for(
            stack.source.clone(),
            Arc::clone(&stack.locker),
            stack.store.clone(),
            &ledger,
            instance.id,
        )?;
        worker.register().await.map_err(anyhow::Error::new)?;
        instance.task = Some(tokio::spawn(drive(
            worker,
            Arc::clone(&instance.paused),
            instance.stop.clone(),
            Arc::clone(&instance.applied),
            Arc::clone(&instance.rewinds),
        )));
    }
    let mut c = Instance::counters("C");
    let ledger_c = Ledger {
        slow: Arc::clone(&ledger.slow),
        stalled: Arc::default(),
    };
    {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting instance C's runtime")?;
        let worker = {
            let _entered = runtime.enter();
            let (source, locker) = (stack.fork)()?;
            // A stall freezes C's lease calls too, as a paused process would: `apply` runs
            // off the runtime's threads, so a stalled `apply` alone no longer stops the
            // keepalive.
            let locker: Arc<dyn Fleet> = Arc::new(Frozen {
                inner: locker,
                stalled: Arc::clone(&ledger_c.stalled),
            });
            worker_for(source, locker, stack.store.clone(), &ledger_c, c.id)?
        };
        let (paused, stop, applied, rewinds) = (
            Arc::clone(&c.paused),
            c.stop.clone(),
            Arc::clone(&c.applied),
            Arc::clone(&c.rewinds),
        );
        // A runtime of one thread of its own, as a separate process would have.
        c.done = Some(std::thread::spawn(move || {
            runtime.block_on(drive(worker, paused, stop, applied, rewinds));
        }));
    }
    instances.push(c);

    // Events flow.
    let streams: Vec<StreamId> = (0..20).map(|_| StreamId::new_v7()).collect();
    let big = streams[0];
    for (i, stream) in streams.iter().enumerate() {
        let count = if i == 0 { 400 } else { 25 };
        append(
            stack,
            *stream,
            (0..count).map(|n| entry(i as i64 * 1000 + n)).collect(),
        )
        .await?;
    }
    say!("\nAppended 875 events to 20 streams (stream 1 has 400).");
    let started = Instant::now();
    wait_until_idle(stack, &streams, Duration::from_secs(60)).await?;
    say!(
        "All applied in {:.0} ms — by instance: {}.",
        ms(started.elapsed()),
        instances
            .iter()
            .map(|i| format!("{} {}", i.name, i.applied.load(Ordering::SeqCst)))
            .collect::<Vec<_>>()
            .join(", ")
    );

    // A late event: its id sorts before events already applied.
    say!("\nA late event arrives for stream 1: its id (chosen by an importer) sorts before every");
    say!("event already applied. The instance that sees it flags a rewind and takes the 'rewind'");
    say!(
        "lease; the others leave the pair alone. Each replayed event now costs 2 ms, to watch it."
    );
    ledger.slow.store(2_000, Ordering::SeqCst);
    let epoch_before = lease_epoch(stack, big).await?;
    append_late(stack, big, -1).await?;
    match wait_for_lease(stack, big, Some(epoch_before), Duration::from_secs(30)).await {
        Ok((holder, epoch)) => say!(
            "Instance {} holds the rewind lease of stream 1 (epoch {epoch}).",
            name_of(&instances, holder)
        ),
        // A fast machine can finish the rewind between two looks; the epoch tells it happened.
        Err(_) if lease_epoch(stack, big).await? > epoch_before => {
            say!("An instance took the rewind lease of stream 1 and finished before we looked.");
        }
        Err(err) => return Err(err),
    }
    append(stack, big, (0..5).map(|n| entry(90_000 + n)).collect()).await?;
    let queued = pending(stack, big).await?;
    say!(
        "5 new events for stream 1 arrive meanwhile: {queued} events wait in its queue; no instance applies them."
    );
    checks.check("new events queue while the pair is leased", queued >= 5);
    wait_until_idle(stack, &streams, Duration::from_secs(60)).await?;
    say!("The rewind committed (fenced on the lease's epoch), the lease was released, and the");
    say!("queued events were applied after it.");
    check_folds(stack, &streams, checks, "after the rewind").await?;

    // A holder that stalls mid-rewind.
    say!(
        "\nNow instance C is the only one running when another late event arrives, and C stalls in"
    );
    say!(
        "the middle of the rewind (a long GC pause, SIGSTOP, a VM migration): it neither renews nor"
    );
    say!("releases its lease.");
    instances[2].paused.set(false);
    pause_and_wait(&instances[..2]).await?;
    let epoch_before = lease_epoch(stack, big).await?;
    append_late(stack, big, -2).await?;
    let (holder, epoch) =
        wait_for_lease(stack, big, Some(epoch_before), Duration::from_secs(30)).await?;
    checks.check(
        "instance C took the rewind lease",
        holder == instances[2].id,
    );
    ledger_c.stalled.store(true, Ordering::SeqCst);
    let stalled = Instant::now();
    say!("Instance C stalls while holding the lease (epoch {epoch}). A and B resume: the lease is");
    say!("still live, so they leave stream 1 alone until it expires.");
    for instance in &instances[..2] {
        instance.paused.set(false);
    }
    let rewinds_a_b: Vec<usize> = instances[..2]
        .iter()
        .map(|i| i.rewinds.load(Ordering::SeqCst))
        .collect();
    let new_epoch = wait_for_epoch(stack, big, epoch, Duration::from_secs(30)).await?;
    say!(
        "After {:.1} s (the lock timeout is 3 s), the expired lease was taken over: epoch {new_epoch}.",
        stalled.elapsed().as_secs_f64()
    );
    checks.check(
        "the lease was taken over only after it expired, with a higher epoch",
        new_epoch > epoch && stalled.elapsed() >= Duration::from_secs(2),
    );
    wait_until_idle(stack, &streams, Duration::from_secs(60)).await?;
    let taker = instances[..2]
        .iter()
        .zip(&rewinds_a_b)
        .find(|(i, before)| i.rewinds.load(Ordering::SeqCst) > **before)
        .map_or("?", |(i, _)| i.name);
    say!("Instance {taker} redid the rewind and committed it.");
    checks.check("another instance completed the rewind", taker != "?");
    wait_until_idle(stack, &streams, Duration::from_secs(60)).await?;
    let rewinds_before = instances[2].rewinds.load(Ordering::SeqCst);
    say!(
        "C wakes up: its lost signal fired at its local deadline, before the takeover, so it gave"
    );
    say!(
        "up the replay — and a commit would be fenced on epoch {epoch} anyway: it cannot overwrite"
    );
    say!("what {taker} committed.");
    ledger_c.stalled.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    checks.check(
        "the stalled instance committed nothing after waking",
        instances[2].rewinds.load(Ordering::SeqCst) == rewinds_before,
    );
    wait_until_idle(stack, &streams, Duration::from_secs(60)).await?;
    ledger.slow.store(0, Ordering::SeqCst);
    check_folds(stack, &streams, checks, "after the takeover").await?;

    for instance in &mut instances {
        instance.stop.cancel();
        if let Some(task) = instance.task.take() {
            let _ = task.await;
        }
        if let Some(thread) = instance.done.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
    let leftover = stack.admin.list_leases().await?;
    let live = leftover
        .iter()
        .filter(|l| l.status == LeaseStatus::Held)
        .count();
    checks.check("no live lease left behind", live == 0);
    Ok(())
}

fn name_of(instances: &[Instance], id: InstanceId) -> &'static str {
    instances
        .iter()
        .find(|i| i.id == id)
        .map_or("?", |i| i.name)
}

async fn append<S, P, E>(
    stack: &Stack<S, P, E>,
    stream: StreamId,
    events: Vec<NewEvent>,
) -> Result<()>
where
    S: TransactionSource,
    E: EventStore<S::Tx>,
{
    let tx = stack.source.begin().await?;
    let outcome = stack
        .events
        .append(&tx, stream, ExpectedVersion::Any, &events)
        .await;
    match outcome {
        Ok(_) => tx.commit().await?,
        Err(err) => {
            let _ = tx.rollback().await;
            return Err(err.into());
        }
    }
    Ok(())
}

/// Appends an event whose id sorts before every event of the demo.
async fn append_late<S, P, E>(stack: &Stack<S, P, E>, stream: StreamId, amount: i64) -> Result<()>
where
    S: TransactionSource,
    E: EventStore<S::Tx>,
{
    // A UUIDv7 from the first second of 2020: earlier than any id drawn now.
    let early = Uuid::from_u128(
        0x016f_5e66_e800_7000_8000_0000_0000_0000 | (amount.unsigned_abs() as u128),
    );
    append(stack, stream, vec![entry(amount).with_id(early)?]).await
}

async fn pending<S, P, E>(stack: &Stack<S, P, E>, stream: StreamId) -> Result<usize>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let tx = stack.source.begin().await?;
    let pending = stack
        .store
        .pending_events(&tx, &Pair::new(stream, ledger_name()))
        .await;
    let _ = tx.rollback().await;
    Ok(pending?.len())
}

/// Waits until none of `streams` has pending work or a rewind request, and no lease is held.
/// (Not `pending_pairs`: on Postgres it skips pairs whose rows a worker has locked — exactly
/// the ones still in flight.)
async fn wait_until_idle<S, P, E>(
    stack: &Stack<S, P, E>,
    streams: &[StreamId],
    limit: Duration,
) -> Result<()>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let started = Instant::now();
    let name = ledger_name();
    loop {
        let mut busy = stack
            .admin
            .list_leases()
            .await?
            .iter()
            .any(|l| l.status == LeaseStatus::Held);
        for stream in streams {
            if busy {
                break;
            }
            let tx = stack.source.begin().await?;
            let pending = stack
                .store
                .pending_events(&tx, &Pair::new(*stream, name.clone()))
                .await;
            let cursor = stack
                .store
                .cursor(&tx, &Pair::new(*stream, name.clone()))
                .await;
            let _ = tx.rollback().await;
            busy = !pending?.is_empty() || cursor?.is_some_and(|c| c.rewind.is_some());
        }
        if !busy {
            return Ok(());
        }
        if started.elapsed() > limit {
            bail!("the workers did not finish within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Waits until the pair's lease is held live with an epoch above `above`; returns holder and
/// epoch.
async fn wait_for_lease<S, P, E>(
    stack: &Stack<S, P, E>,
    stream: StreamId,
    above: Option<i64>,
    limit: Duration,
) -> Result<(InstanceId, i64)> {
    let started = Instant::now();
    loop {
        let leases = stack.admin.list_leases().await?;
        if let Some(l) = leases.iter().find(|l| {
            l.stream_id == stream
                && l.status == LeaseStatus::Held
                && above.is_none_or(|e| l.epoch.get() > e)
        }) {
            return Ok((l.holder, l.epoch.get()));
        }
        if started.elapsed() > limit {
            bail!("no instance took the lease of stream {stream} within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The pair's lease epoch (kept after release; 0 without a cursor).
async fn lease_epoch<S, P, E>(stack: &Stack<S, P, E>, stream: StreamId) -> Result<i64> {
    Ok(stack
        .admin
        .inspect(stream, &ledger_name())
        .await?
        .map_or(0, |l| l.epoch.get()))
}

/// Waits until the pair's lease epoch (kept after release) is above `above`.
async fn wait_for_epoch<S, P, E>(
    stack: &Stack<S, P, E>,
    stream: StreamId,
    above: i64,
    limit: Duration,
) -> Result<i64> {
    let started = Instant::now();
    loop {
        if let Some(lease) = stack.admin.inspect(stream, &ledger_name()).await?
            && lease.epoch.get() > above
        {
            return Ok(lease.epoch.get());
        }
        if started.elapsed() > limit {
            bail!("nobody took the lease of stream {stream} over within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Checks every stream's read model against the fold of its events.
async fn check_folds<S, P, E>(
    stack: &Stack<S, P, E>,
    streams: &[StreamId],
    checks: &mut Checks,
    when: &str,
) -> Result<()>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    let name = ledger_name();
    let mut exact = 0;
    for stream in streams {
        let tx = stack.source.begin().await?;
        let state = stack
            .store
            .state(&tx, &Pair::new(*stream, name.clone()))
            .await;
        let events = stack.store.stream_events(&tx, *stream, None).await;
        let _ = tx.rollback().await;
        let state: Entries = match state?.and_then(|(_, s)| s) {
            Some(json) => serde_json::from_value(json).context("reading a ledger state")?,
            None => Entries::default(),
        };
        if state == fold(&events?) {
            exact += 1;
        }
    }
    checks.check(
        &format!(
            "{when}: {exact}/{} read models equal the fold of their events in event-id order",
            streams.len()
        ),
        exact == streams.len(),
    );
    Ok(())
}

/// The checks of a run, printed as they pass or fail.
#[derive(Default)]
struct Checks {
    failed: Vec<String>,
    passed: usize,
}

impl Checks {
    fn check(&mut self, what: &str, ok: bool) {
        if ok {
            self.passed += 1;
            say!("  ✓ {what}");
        } else {
            self.failed.push(what.to_owned());
            say!("  ✗ {what}");
        }
    }

    fn finish(self) -> Result<()> {
        if self.failed.is_empty() {
            say!("\nAll {} checks passed.", self.passed);
            Ok(())
        } else {
            bail!(
                "{} check(s) failed: {}",
                self.failed.len(),
                self.failed.join("; ")
            )
        }
    }
}
