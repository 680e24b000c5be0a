//! `aggregate`: the pessimistic per-aggregate write lock against the optimistic default, on the
//! Postgres event store.
//!
//! Every command is one unit of work on an owned READ COMMITTED transaction: begin, (lock,)
//! load the stream, decide (fold the events), append one event with the expected version,
//! hold `--hold-ms` of simulated work inside the transaction, commit.
//!
//! - **optimistic**: load, append; a conflict (`23505`) rolls back and retries the whole unit
//!   of work with `lockstep_core::RetryPolicy` (exponential backoff, full jitter).
//! - **pessimistic**: `EventStore::load_locked` — the advisory lock pipelined with the load
//!   (one round trip), then the same append. Conflicts should not happen; they are counted.
//!
//! Streams start with `--seed-events` events. **hot**: every writer on one stream; **cold**:
//! each writer on its own stream. Each scenario runs until `--commits` commands have committed
//! (a fixed count, so both modes grow the hot stream by the same number of events) on a fresh
//! set of streams, with a pool of one connection per writer.
//!
//! **Round trips per command** are counted, not inferred: a second, shorter pass of every
//! scenario runs through a TCP relay that counts each burst of client bytes following server
//! bytes (pipelined statements travel in one burst). Throughput comes from the direct pass.
//!
//! Each scenario runs `--rounds` rounds, alternating which mode goes first; the table shows the
//! totals over all rounds, and the ratio row under each pair is the **median of the per-round
//! ratios** (each round's two modes ran back to back, so drift on a shared machine hits both).
//!
//! The last three lines are the headline figures: `hot32_pessimistic_vs_optimistic`,
//! `cold16_pessimistic_vs_optimistic` (median commits/s ratios) and
//! `hot32_pessimistic_conflicts` (over all rounds).

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use hdrhistogram::Histogram;
use lockstep_core::{
    AggregateType, ErrorKind, EventStore, ExpectedVersion, NewEvent, RetryPolicy, StreamId,
    aggregate_key,
};
use lockstep_pg::PgTransaction;
use lockstep_pg_advisory::PostgresDistributedLock;
use lockstep_pg_store::PgEventStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_postgres::NoTls;
use tokio_postgres::config::Host;
use uuid::Uuid;

use crate::bench_db::{BenchDatabase, admin_url};
use crate::report::new_histogram;

/// Options of the `aggregate` benchmark.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Args {
    /// Writer counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 4, 16, 32])]
    writers: Vec<usize>,
    /// Commits per hot scenario and round (throughput pass).
    #[arg(long, default_value_t = 300)]
    commits: usize,
    /// Cold scenarios: commits per writer (at least `--commits` in all).
    #[arg(long, default_value_t = 100)]
    cold_commits_per_writer: usize,
    /// Rounds per scenario; the mode that goes first alternates, and the headline ratio is the
    /// median of the rounds' ratios (robust to a noisy neighbour on the machine).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Commits per scenario in the round-trip counting pass.
    #[arg(long, default_value_t = 200)]
    rt_commits: usize,
    /// Events each stream starts with.
    #[arg(long, default_value_t = 50)]
    seed_events: usize,
    /// Simulated work inside each transaction, in milliseconds.
    #[arg(long, default_value_t = 1)]
    hold_ms: u64,
    /// Optimistic retries: attempt cap (default: `RetryPolicy::default()`, 10).
    #[arg(long, default_value_t = 10)]
    max_attempts: u32,
    /// Optimistic retries: first backoff ceiling, in milliseconds, doubling per retry
    /// (default: `RetryPolicy::default()`, 5).
    #[arg(long, default_value_t = 5)]
    initial_backoff_ms: u64,
    /// Optimistic retries: backoff cap, in milliseconds (default: `RetryPolicy::default()`,
    /// 200).
    #[arg(long, default_value_t = 200)]
    max_backoff_ms: u64,
    /// `synchronous_commit` of the benchmark database. Off by default, so the figures measure
    /// locking rather than the machine's WAL flush latency (which every hot-aggregate commit
    /// otherwise holds the lock through); `on` measures durable commits.
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    synchronous_commit: String,
    /// Server to create the benchmark database on (default: `DATABASE_URL`, else
    /// postgres://postgres@127.0.0.1:5432/postgres).
    #[arg(long)]
    database_url: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Optimistic = 0,
    Pessimistic = 1,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Optimistic => "optimistic+retry",
            Mode::Pessimistic => "pessimistic",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Heat {
    Hot,
    Cold,
}

impl Heat {
    fn label(self) -> &'static str {
        match self {
            Heat::Hot => "hot",
            Heat::Cold => "cold",
        }
    }
}

/// What one scenario did.
struct Outcome {
    commits: usize,
    attempts: u64,
    conflicts: u64,
    failed: u64,
    elapsed: Duration,
    latency_us: Histogram<u64>,
}

impl Outcome {
    fn empty() -> Outcome {
        Outcome {
            commits: 0,
            attempts: 0,
            conflicts: 0,
            failed: 0,
            elapsed: Duration::ZERO,
            latency_us: new_histogram(),
        }
    }

    fn merge(&mut self, other: &Outcome) {
        self.commits += other.commits;
        self.attempts += other.attempts;
        self.conflicts += other.conflicts;
        self.failed += other.failed;
        self.elapsed += other.elapsed;
        // Same bounds on both sides; values beyond them were saturated on record.
        let _ = self.latency_us.add(&other.latency_us);
    }

    fn commits_per_sec(&self) -> f64 {
        self.commits as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }

    fn per_commit(&self, n: u64) -> f64 {
        n as f64 / self.commits.max(1) as f64
    }
}

/// The shared pieces of one scenario.
struct Setup {
    store: PgEventStore,
    retry: RetryPolicy,
    hold: Duration,
}

const AGGREGATE: &str = "BenchItem";

/// Runs the benchmark and prints the table and the headline figures.
pub(crate) async fn run(args: Args) -> Result<()> {
    let url = admin_url(args.database_url.clone());
    let db = BenchDatabase::create(&url).await?;
    let result = run_on(&args, &url, &db).await;
    db.drop_database().await?;
    result
}

async fn run_on(args: &Args, url: &str, db: &BenchDatabase) -> Result<()> {
    let setup_pool = db.pool(2)?;
    lockstep_pg::migrate(&setup_pool)
        .await
        .context("migrating the benchmark database")?;
    // `on`/`off` only (checked by clap): safe to inline.
    db.client()
        .await?
        .batch_execute(&format!(
            "ALTER DATABASE \"{}\" SET synchronous_commit = {}",
            db.name(),
            args.synchronous_commit
        ))
        .await
        .context("setting synchronous_commit")?;
    setup_pool.close();
    let retry = RetryPolicy::new(
        std::num::NonZeroU32::new(args.max_attempts.max(1)).unwrap_or(std::num::NonZeroU32::MIN),
        Duration::from_millis(args.initial_backoff_ms),
        Duration::from_millis(args.max_backoff_ms),
    );
    let hold = Duration::from_millis(args.hold_ms);
    println!(
        "# aggregate: {} seed events, {} ms held in each transaction, {} commits per scenario \
         ({} in the round-trip pass), synchronous_commit = {}; optimistic retry: {} attempts, \
         backoff ceiling {} ms doubling to {} ms, full jitter",
        args.seed_events,
        args.hold_ms,
        args.commits,
        args.rt_commits,
        args.synchronous_commit,
        args.max_attempts,
        args.initial_backoff_ms,
        args.max_backoff_ms
    );
    println!();
    println!(
        "| writers | streams | mode | commits/s | retries/commit | wasted appends/commit | \
         failed | p50 ms | p99 ms | round trips/command | round trips/attempt |"
    );
    println!("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");

    let relay = Relay::start(upstream(url)?).await?;
    let relayed_pool = |size: usize| relay_pool(url, db.name(), relay.addr, size);

    let (mut hot32, mut cold16, mut hot32_conflicts) = (None, None, None);
    for &writers in &args.writers {
        for heat in [Heat::Hot, Heat::Cold] {
            let commits = match heat {
                Heat::Hot => args.commits,
                Heat::Cold => args.commits.max(args.cold_commits_per_writer * writers),
            };
            // Rounds alternate which mode goes first, so drift on a shared machine hits both.
            let mut totals = [Outcome::empty(), Outcome::empty()];
            let mut ratios = Vec::new();
            for round in 0..args.rounds.max(1) {
                let mut this_round = [0.0f64; 2];
                let order = if round % 2 == 0 {
                    [Mode::Optimistic, Mode::Pessimistic]
                } else {
                    [Mode::Pessimistic, Mode::Optimistic]
                };
                for mode in order {
                    let pool = db.pool(writers)?;
                    let setup = Setup {
                        store: PgEventStore::with_lock(PostgresDistributedLock::new(pool.clone())),
                        retry,
                        hold,
                    };
                    warm_up(&pool, writers).await?;
                    let outcome = scenario(
                        &pool,
                        &setup,
                        writers,
                        heat,
                        mode,
                        args.seed_events,
                        commits,
                    )
                    .await?;
                    pool.close();
                    this_round[mode as usize] = outcome.commits_per_sec();
                    totals[mode as usize].merge(&outcome);
                }
                if this_round[0] > 0.0 {
                    ratios.push(this_round[1] / this_round[0]);
                }
            }
            ratios.sort_by(f64::total_cmp);
            let median_ratio = ratios.get(ratios.len() / 2).copied();
            for mode in [Mode::Optimistic, Mode::Pessimistic] {
                let rt_pool = relayed_pool(writers)?;
                let rt_setup = Setup {
                    store: PgEventStore::with_lock(PostgresDistributedLock::new(rt_pool.clone())),
                    retry,
                    hold,
                };
                // Warm the pool up (connection start-up is not a command's round trip).
                warm_up(&rt_pool, writers).await?;
                let before = relay.round_trips();
                let rt = scenario(
                    &rt_pool,
                    &rt_setup,
                    writers,
                    heat,
                    mode,
                    args.seed_events,
                    args.rt_commits,
                )
                .await?;
                let round_trips = relay
                    .round_trips()
                    .saturating_sub(before + seed_round_trips(heat, writers));
                rt_pool.close();

                let outcome = &totals[mode as usize];
                let ms = |q: f64| outcome.latency_us.value_at_quantile(q) as f64 / 1000.0;
                println!(
                    "| {writers} | {} | {} | {:.0} | {:.2} | {:.2} | {} | {:.2} | {:.2} | {:.2} | {:.2} |",
                    heat.label(),
                    mode.label(),
                    outcome.commits_per_sec(),
                    outcome.per_commit(outcome.attempts - outcome.commits as u64),
                    outcome.per_commit(outcome.conflicts),
                    outcome.failed,
                    ms(0.5),
                    ms(0.99),
                    round_trips as f64 / rt.commits.max(1) as f64,
                    round_trips as f64 / rt.attempts.max(1) as f64,
                );
                if (heat, writers, mode) == (Heat::Hot, 32, Mode::Pessimistic) {
                    hot32_conflicts = Some(outcome.conflicts);
                }
            }
            println!(
                "|  |  | *pessimistic / optimistic, median of {} rounds* | **{}** |  |  |  |  |  |  |  |",
                ratios.len(),
                median_ratio.map_or("n/a".to_owned(), |r| format!("{r:.2}"))
            );
            match (heat, writers) {
                (Heat::Hot, 32) => hot32 = median_ratio,
                (Heat::Cold, 16) => cold16 = median_ratio,
                _ => {}
            }
        }
    }
    relay.stop();
    println!();
    let figure = |r: Option<f64>| r.map_or("n/a".to_owned(), |r| format!("{r:.2}"));
    println!("hot32_pessimistic_vs_optimistic={}", figure(hot32));
    println!("cold16_pessimistic_vs_optimistic={}", figure(cold16));
    println!(
        "hot32_pessimistic_conflicts={}",
        hot32_conflicts.map_or("n/a".to_owned(), |c: u64| c.to_string())
    );
    Ok(())
}

/// Seeds fresh streams, runs `writers` writers until `commits` commands committed.
async fn scenario(
    pool: &Pool,
    setup: &Setup,
    writers: usize,
    heat: Heat,
    mode: Mode,
    seed_events: usize,
    commits: usize,
) -> Result<Outcome> {
    let streams: Vec<Uuid> = match heat {
        Heat::Hot => vec![Uuid::now_v7()],
        Heat::Cold => (0..writers).map(|_| Uuid::now_v7()).collect(),
    };
    seed(pool, &setup.store, &streams, seed_events).await?;

    let committed = Arc::new(AtomicUsize::new(0));
    let attempts = Arc::new(AtomicU64::new(0));
    let conflicts = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let sku = streams[w % streams.len()];
            let (pool, store) = (pool.clone(), setup.store.clone());
            let (retry, hold) = (setup.retry, setup.hold);
            let (committed, attempts, conflicts, failed) = (
                Arc::clone(&committed),
                Arc::clone(&attempts),
                Arc::clone(&conflicts),
                Arc::clone(&failed),
            );
            tokio::spawn(async move {
                let mut latency = new_histogram();
                while committed.load(Ordering::Relaxed) < commits {
                    let t0 = Instant::now();
                    let result = retry
                        .run(tokio::time::sleep, |_| {
                            attempts.fetch_add(1, Ordering::Relaxed);
                            command(&pool, &store, sku, mode, hold, &conflicts)
                        })
                        .await;
                    match result {
                        Ok(()) => {
                            committed.fetch_add(1, Ordering::Relaxed);
                            let us = t0.elapsed().as_micros().max(1) as u64;
                            latency.saturating_record(us);
                        }
                        Err(_) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                latency
            })
        })
        .collect();
    let mut latency_us = new_histogram();
    for task in tasks {
        let h = task.await.context("writer task")?;
        let _ = latency_us.add(&h);
    }
    let elapsed = started.elapsed();
    Ok(Outcome {
        commits: committed.load(Ordering::Relaxed),
        attempts: attempts.load(Ordering::Relaxed),
        conflicts: conflicts.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        elapsed,
        latency_us,
    })
}

/// One unit of work: begin, (lock,) load, decide, append, hold, commit.
async fn command(
    pool: &Pool,
    store: &PgEventStore,
    sku: Uuid,
    mode: Mode,
    hold: Duration,
    conflicts: &AtomicU64,
) -> lockstep_core::Result<()> {
    let stream = StreamId::from_uuid(sku);
    let tx = PgTransaction::begin(pool).await?;
    let events = match mode {
        Mode::Optimistic => store.load(&tx, stream).await,
        Mode::Pessimistic => {
            let ty = AggregateType::new(AGGREGATE)?;
            store
                .load_locked(&tx, stream, &aggregate_key(&ty, sku), None)
                .await
        }
    };
    let events = match events {
        Ok(events) => events,
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(e);
        }
    };
    // Decide: fold the stream (units reserved so far) and reserve one more.
    let reserved: u64 = events
        .iter()
        .map(|e| {
            e.payload
                .get("quantity")
                .and_then(|q| q.as_u64())
                .unwrap_or(0)
        })
        .sum();
    let event = NewEvent::new(
        "Reserved",
        serde_json::json!({ "quantity": 1, "reserved_before": reserved }),
    )?;
    let expected = ExpectedVersion::Exact(events.len() as u64);
    if let Err(e) = store.append(&tx, stream, expected, &[event]).await {
        if e.kind() == ErrorKind::Conflict {
            conflicts.fetch_add(1, Ordering::Relaxed);
        }
        let _ = tx.rollback().await;
        return Err(e);
    }
    tokio::time::sleep(hold).await;
    tx.commit().await
}

async fn seed(pool: &Pool, store: &PgEventStore, streams: &[Uuid], n: usize) -> Result<()> {
    for &sku in streams {
        let events: Vec<NewEvent> = (0..n)
            .map(|i| NewEvent::new("Stocked", serde_json::json!({ "batch": i, "units": 1000 })))
            .collect::<lockstep_core::Result<_>>()?;
        let tx = PgTransaction::begin(pool).await?;
        store
            .append(
                &tx,
                StreamId::from_uuid(sku),
                ExpectedVersion::NoStream,
                &events,
            )
            .await?;
        tx.commit().await?;
    }
    Ok(())
}

/// Round trips the seeding of a scenario costs (begin, append, commit per stream).
fn seed_round_trips(heat: Heat, writers: usize) -> u64 {
    let streams = match heat {
        Heat::Hot => 1,
        Heat::Cold => writers as u64,
    };
    3 * streams
}

/// Opens every connection of the pool once.
async fn warm_up(pool: &Pool, size: usize) -> Result<()> {
    let mut held = Vec::with_capacity(size);
    for _ in 0..size {
        held.push(pool.get().await.context("warming the pool up")?);
    }
    Ok(())
}

fn upstream(url: &str) -> Result<(String, u16)> {
    let config = tokio_postgres::Config::from_str(url).context("parsing the database URL")?;
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        _ => anyhow::bail!("the round-trip relay needs a TCP host in the database URL"),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    Ok((host, port))
}

fn relay_pool(url: &str, dbname: &str, relay: SocketAddr, size: usize) -> Result<Pool> {
    let admin = tokio_postgres::Config::from_str(url).context("parsing the database URL")?;
    // A fresh config: `host()` adds a host, and the relay must be the only one.
    let mut config = tokio_postgres::Config::new();
    config
        .dbname(dbname)
        .host(relay.ip().to_string())
        .port(relay.port());
    if let Some(user) = admin.get_user() {
        config.user(user);
    }
    if let Some(password) = admin.get_password() {
        config.password(password);
    }
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .build()
        .context("building the relayed pool")
}

/// A loopback TCP relay in front of the server that counts round trips: every burst of bytes
/// from a client that follows bytes from the server (or opens the connection) is one.
struct Relay {
    addr: SocketAddr,
    round_trips: Arc<AtomicU64>,
    accept: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(upstream: (String, u16)) -> Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the relay")?;
        let addr = listener.local_addr()?;
        let round_trips = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&round_trips);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let counter = Arc::clone(&counter);
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect((upstream.0.as_str(), upstream.1)).await
                    {
                        relay_connection(client, server, counter).await;
                    }
                });
            }
        });
        Ok(Relay {
            addr,
            round_trips,
            accept,
        })
    }

    fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    fn stop(self) {
        self.accept.abort();
    }
}

async fn relay_connection(client: TcpStream, server: TcpStream, round_trips: Arc<AtomicU64>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // True when the server spoke last: the client's next bytes start a round trip.
    let server_spoke = Arc::new(AtomicBool::new(true));
    let to_server = {
        let server_spoke = Arc::clone(&server_spoke);
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match client_read.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if server_spoke.swap(false, Ordering::SeqCst) {
                    round_trips.fetch_add(1, Ordering::Relaxed);
                }
                if server_write.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _ = server_write.shutdown().await;
        }
    };
    let to_client = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            server_spoke.store(true, Ordering::SeqCst);
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = client_write.shutdown().await;
    };
    tokio::join!(to_server, to_client);
}
