//! The aggregate section of `drivers`: the pessimistic unit of work of `aggregate`
//! (`EventStore::load_locked`, the fold and the measured hold, `append_at_commit`, commit) on
//! tokio-postgres (`PgDatabase`, `PgEventStore::new`) and on sqlx (`SqlxDatabase`,
//! `PgEventStore::for_sqlx`), hot (every writer on one stream) and cold (each writer on its own
//! stream).
//!
//! Each round runs both drivers back to back, the one that goes first alternating, each on a
//! fresh pool of one connection per writer and fresh streams of `--seed-events` events (seeded
//! on a connection of their own). A pool first runs an untimed pass of two commands per writer,
//! so the timed pass sees every connection in steady state (sqlx prepares a statement on its
//! first use on a connection: a round trip more; tokio-postgres sends typed statements
//! unprepared). The ratio of a scenario is the median of the per-round ratios (commits/s on
//! sqlx ÷ on tokio-postgres).
//!
//! **Round trips per command** are counted by the relay (`lockstep_testkit::relay`) in a
//! second pass per driver and scenario, on pools through it, after the same untimed pass. A
//! third, one-writer pass through the relay counts each step of the unit of work on its own —
//! a connection's first command and its later ones — which shows where the drivers differ.

use std::time::Duration;

use anyhow::{Context, Result};
use lockstep_core::{
    AggregateType, EventStore, ExpectedVersion, NewEvent, RetryPolicy, StreamId, aggregate_key,
};
use lockstep_pg::PgDatabase;
use lockstep_pg::sqlx::SqlxDatabase;
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::relay::Relay;
use uuid::Uuid;

use super::{AGGREGATE, Driver, Heat, Mode, Outcome, Setup, Via, scenario, seed, warm_up};
use crate::bench_db::BenchDatabase;
use crate::report::median_if_any;

/// What the aggregate section runs.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// Writers of the hot scenario (all on one stream) and of the cold one (one stream each).
    pub(crate) hot_writers: usize,
    pub(crate) cold_writers: usize,
    /// Commits per hot scenario, side and round.
    pub(crate) commits: usize,
    /// Cold: commits per writer (at least `commits` in all).
    pub(crate) cold_commits_per_writer: usize,
    pub(crate) rounds: usize,
    /// Commits per scenario and driver in the round-trip pass.
    pub(crate) rt_commits: usize,
    /// Commands per driver in the one-writer pass that counts each step.
    pub(crate) step_commands: usize,
    pub(crate) seed_events: usize,
    pub(crate) hold: Duration,
    /// sqlx's `test_before_acquire` on the sqlx pools.
    pub(crate) sqlx_test_before_acquire: bool,
}

/// The two drivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    TokioPostgres = 0,
    Sqlx = 1,
}

impl Side {
    /// The driver's name in `key=value` lines.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Side::TokioPostgres => "tokio_postgres",
            Side::Sqlx => "sqlx",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Side::TokioPostgres => "tokio-postgres",
            Side::Sqlx => "sqlx",
        }
    }
}

/// What the section measured: its tables, its `key=value` lines, and per scenario
/// (`hot32`, `cold16`) the median ratio sqlx ÷ tokio-postgres.
pub(crate) struct Section {
    pub(crate) tables: Vec<String>,
    pub(crate) lines: Vec<String>,
    pub(crate) ratios: Vec<(String, Option<f64>)>,
}

/// Runs the hot and cold scenarios on both drivers, then the one-writer step count.
pub(crate) async fn measure(db: &BenchDatabase, relay: &Relay, opts: &Options) -> Result<Section> {
    let retry = RetryPolicy::default();
    let mut table = String::from(
        "| scenario | driver | commits/s | p50 ms | p99 ms | conflicts | failed | hold ms | \
         round trips/command |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut lines = Vec::new();
    let mut ratios = Vec::new();
    for (heat, writers) in [
        (Heat::Hot, opts.hot_writers),
        (Heat::Cold, opts.cold_writers),
    ] {
        let key = format!("{}{writers}", heat.label());
        let commits = match heat {
            Heat::Hot => opts.commits,
            Heat::Cold => opts.commits.max(opts.cold_commits_per_writer * writers),
        };
        let mut totals = [Outcome::empty(), Outcome::empty()];
        let mut per_round = Vec::new();
        for round in 0..opts.rounds.max(1) {
            let order = if round % 2 == 0 {
                [Side::TokioPostgres, Side::Sqlx]
            } else {
                [Side::Sqlx, Side::TokioPostgres]
            };
            let mut this_round = [0.0f64; 2];
            for side in order {
                let (outcome, _) = run(db, None, side, heat, writers, commits, retry, opts).await?;
                this_round[side as usize] = outcome.commits_per_sec();
                totals[side as usize].merge(&outcome);
            }
            if this_round[Side::TokioPostgres as usize] > 0.0 {
                per_round.push(
                    this_round[Side::Sqlx as usize] / this_round[Side::TokioPostgres as usize],
                );
            }
        }
        let ratio = median_if_any(&per_round);
        for side in [Side::TokioPostgres, Side::Sqlx] {
            let (rt, round_trips) = run(
                db,
                Some(relay),
                side,
                heat,
                writers,
                opts.rt_commits,
                retry,
                opts,
            )
            .await?;
            let per_command = round_trips as f64 / rt.commits.max(1) as f64;
            let outcome = &totals[side as usize];
            let ms = |q: f64| outcome.latency_us.value_at_quantile(q) as f64 / 1000.0;
            table.push_str(&format!(
                "| {key} | {} | {:.0} | {:.2} | {:.2} | {} | {} | {:.3} | {per_command:.2} |\n",
                side.label(),
                outcome.commits_per_sec(),
                ms(0.5),
                ms(0.99),
                outcome.conflicts,
                outcome.failed,
                outcome.hold_ms_mean(),
            ));
            let prefix = format!("drivers_{key}_{}", side.key());
            lines.push(format!(
                "{prefix}_commits_per_s={:.1}",
                outcome.commits_per_sec()
            ));
            lines.push(format!("{prefix}_p99_ms={:.2}", ms(0.99)));
            lines.push(format!(
                "{}_round_trips_per_command_{key}={per_command:.2}",
                side.key()
            ));
        }
        table.push_str(&format!(
            "|  | *sqlx / tokio-postgres, median of {} rounds* | **{}** |  |  |  |  |  |  |\n",
            per_round.len(),
            ratio.map_or("n/a".to_owned(), |r| format!("{r:.2}"))
        ));
        ratios.push((key, ratio));
    }
    let steps = step_round_trips(db, relay, opts).await?;
    Ok(Section {
        tables: vec![table, steps],
        lines,
        ratios,
    })
}

/// One side of one scenario: a fresh pool of `writers` connections (through `relay` if
/// given), the untimed pass, then `commits` commits; returns them and the relay's round trips
/// during them.
#[allow(clippy::too_many_arguments)]
async fn run(
    db: &BenchDatabase,
    relay: Option<&Relay>,
    side: Side,
    heat: Heat,
    writers: usize,
    commits: usize,
    retry: RetryPolicy,
    opts: &Options,
) -> Result<(Outcome, u64)> {
    let (driver, store) = match side {
        Side::TokioPostgres => {
            let pool = match relay {
                Some(relay) => db.pool_through(relay.addr(), writers)?,
                None => db.pool(writers)?,
            };
            warm_up(&pool, writers).await?;
            let pg = PgDatabase::from_pool(pool);
            let store = PgEventStore::new(&pg);
            (Driver::TokioPostgres(pg), store)
        }
        Side::Sqlx => {
            let pool = match relay {
                Some(relay) => {
                    db.sqlx_pool_through(relay.addr(), writers, opts.sqlx_test_before_acquire)
                }
                None => db.sqlx_pool(writers, opts.sqlx_test_before_acquire),
            };
            warm_up_sqlx(&pool, writers).await?;
            let sqlx = SqlxDatabase::new(pool);
            let store = PgEventStore::for_sqlx(&sqlx);
            (Driver::Sqlx(sqlx), store)
        }
    };
    let setup = Setup {
        store,
        retry,
        hold: opts.hold,
        random_ids: false,
        via: Via::Handwritten,
        driver: driver.clone(),
    };
    // The streams are seeded directly, never through the relay.
    let seeding = db.pool(1)?;
    let untimed = 2 * writers;
    scenario(
        &seeding,
        &setup,
        writers,
        heat,
        Mode::Pessimistic,
        opts.seed_events,
        untimed,
    )
    .await?;
    let before = relay.map_or(0, Relay::round_trips);
    let outcome = scenario(
        &seeding,
        &setup,
        writers,
        heat,
        Mode::Pessimistic,
        opts.seed_events,
        commits,
    )
    .await;
    let round_trips = relay.map_or(0, |relay| relay.round_trips() - before);
    seeding.close();
    match driver {
        Driver::TokioPostgres(pg) => pg.pool().close(),
        Driver::Sqlx(sqlx) => sqlx.pool().close().await,
        Driver::Pool => {}
    }
    Ok((outcome?, round_trips))
}

/// Opens every connection of an sqlx pool once.
async fn warm_up_sqlx(pool: &sqlx::PgPool, size: usize) -> Result<()> {
    let mut held = Vec::with_capacity(size);
    for _ in 0..size {
        held.push(pool.acquire().await.context("warming the sqlx pool up")?);
    }
    Ok(())
}

/// The round trips of each step, one writer through the relay: its connection's first command
/// and the mean of the `--step-commands` after it, per driver.
async fn step_round_trips(db: &BenchDatabase, relay: &Relay, opts: &Options) -> Result<String> {
    let later = opts.step_commands.max(1);
    let mut columns = Vec::new();
    for side in [Side::TokioPostgres, Side::Sqlx] {
        let seeding = db.pool(1)?;
        let sku = Uuid::now_v7();
        seed(
            &seeding,
            &PgEventStore::with_queue(lockstep_pg::LockQueue::new()),
            &[sku],
            opts.seed_events,
        )
        .await?;
        seeding.close();
        let counts = match side {
            Side::TokioPostgres => {
                let pool = db.pool_through(relay.addr(), 1)?;
                warm_up(&pool, 1).await?;
                let pg = PgDatabase::from_pool(pool);
                // deadpool takes a connection back as it is dropped.
                let counts =
                    count_steps(relay, &pg, &PgEventStore::new(&pg), sku, later, || true).await;
                pg.pool().close();
                counts?
            }
            Side::Sqlx => {
                let pool = db.sqlx_pool_through(relay.addr(), 1, opts.sqlx_test_before_acquire);
                warm_up_sqlx(&pool, 1).await?;
                let sqlx = SqlxDatabase::new(pool);
                let pool = sqlx.pool().clone();
                let idle = move || pool.num_idle() == pool.size() as usize;
                let counts = count_steps(
                    relay,
                    &sqlx,
                    &PgEventStore::for_sqlx(&sqlx),
                    sku,
                    later,
                    idle,
                )
                .await;
                sqlx.pool().close().await;
                counts?
            }
        };
        columns.push(counts);
    }
    let mut out = format!(
        "| step (one writer, through the relay) | tokio-postgres: first command | later (mean \
         of {later}) | sqlx: first command | later (mean of {later}) |\n|---|---:|---:|---:|---:|\n"
    );
    let names = [
        "begin (checkout, `BEGIN`)",
        "`load_locked` (lock + load, one statement)",
        "`append_at_commit`",
        "commit",
        "back in the pool",
        "the command",
    ];
    for (k, name) in names.iter().enumerate() {
        out.push_str(&format!("| {name} |"));
        for [first, mean] in &columns {
            out.push_str(&format!(" {:.0} | {:.2} |", first[k], mean[k]));
        }
        out.push('\n');
    }
    out.push_str(
        "(a step's figure is the bursts of client bytes the relay saw while it ran: a statement \
         sent along with an earlier one counts 0; *back in the pool* is from the commit's \
         return until the pool has the connection idle again — sqlx pings every connection \
         given back to it)\n",
    );
    Ok(out)
}

/// Runs `1 + later` commands of the unit of work on one connection of `source`, counting the
/// relay's round trips step by step: `[first command's, mean of the later ones]`, each as
/// `[begin, load_locked, append_at_commit, commit, back in the pool, total]`. `idle` says
/// whether the pool has its connection back.
async fn count_steps<D>(
    relay: &Relay,
    source: &D,
    store: &PgEventStore,
    sku: Uuid,
    later: usize,
    idle: impl Fn() -> bool,
) -> Result<[[f64; 6]; 2]>
where
    D: lockstep_core::TransactionSource,
    PgEventStore: EventStore<D::Tx>,
{
    use lockstep_core::Transaction as _;
    let stream = StreamId::from_uuid(sku);
    let key = aggregate_key(&AggregateType::new(AGGREGATE)?, sku);
    let settle = async || {
        let waited = std::time::Instant::now();
        while !idle() && waited.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    // The warm-up's connection back in the pool first.
    settle().await;
    let mut first = [0.0; 6];
    let mut sum = [0.0; 6];
    for n in 0..=later {
        let t0 = relay.round_trips();
        let tx = source.begin().await?;
        let t1 = relay.round_trips();
        let loaded = store.load_locked(&tx, stream, &key, None).await?;
        let t2 = relay.round_trips();
        let event = NewEvent::new("Reserved", serde_json::json!({ "quantity": 1 }))?;
        store
            .append_at_commit(
                &tx,
                stream,
                ExpectedVersion::Exact(loaded.len() as u64),
                &[event],
            )
            .await?;
        let t3 = relay.round_trips();
        tx.commit().await?;
        let t4 = relay.round_trips();
        settle().await;
        let t5 = relay.round_trips();
        let steps = [t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0];
        let target = if n == 0 { &mut first } else { &mut sum };
        for (total, step) in target.iter_mut().zip(steps) {
            *total += step as f64;
        }
    }
    Ok([first, sum.map(|s| s / later as f64)])
}
