//! `locker`: `PgStreamLocker` against `pgbench` running the very statements the locker
//! sends, in the same run, on the same database.
//!
//! The locker's SQL is private to `lockstep-pg-stream`, so the benchmark keeps no copy of it: it
//! drives the locker through its public API once (try-acquire, renew, release on one row) and
//! reads each statement back from the server, as that connection prepared it
//! (`pg_prepared_statements`). pgbench runs those texts; their parameter types are checked
//! against the variables the scripts bind, so a statement whose parameters change fails the
//! run instead of timing something else.
//!
//! Set-up: a fresh database, the migrations, 10 000 cursor rows (one stream, perspectives
//! `"1"` … `"10000"`: pgbench can draw integers but not UUIDs, and a decimal name is a valid
//! perspective name, so both clients address rows the same way).
//!
//! Workloads, each at every concurrency (pool size = pgbench `-c`/`-j` = concurrency):
//!
//! - **acquire+release**: a cycle over a random row: try-acquire, then release the lease at the
//!   epoch the acquire returned (pgbench: the acquire statement, `\gset`, the release statement).
//!   One operation = one cycle = two statements.
//! - **renew**: every row is held by the benchmark instance at one epoch; renew a random row.
//!   One operation = one statement.
//!
//! **Each client draws from rows of its own**: client `k` of `c` (a locker task, a pgbench
//! client, `:client_id`) only uses rows `k`, `k + c`, `k + 2c`, … So no two clients ever meet on
//! a row: the benchmark measures lease operations, not row-lock contention. With rows shared,
//! two clients drawing the same row at once made the loser's try-acquire find the row locked by
//! the winner's statement (`FOR NO KEY UPDATE NOWAIT`): the locker answers `Busy`, but pgbench
//! aborts a client on that `55P03` and fails the run ("Run was aborted").
//!
//! Each side runs `--duration-secs` per round, for `--rounds` rounds, alternating which side
//! goes first (ABBA…) so drift on a shared machine hits both. A workload's ratio is the median
//! over rounds of lockstep ops/s divided by pgbench ops/s in the same round; the headline ratio
//! for a concurrency is the lower of the two workloads' ratios.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hdrhistogram::Histogram;
use lockstep_core::{
    AcquireOutcome, InstanceId, LeaseEpoch, LeaseId, LockReason, PerspectiveName, StreamId,
    StreamLockOptions, StreamLocker,
};
use lockstep_pg_stream::{PgInterval, PgStreamLocker};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::bench_db::{BenchDatabase, admin_url};
use crate::pgbench::{self, PgbenchRun, to_pgbench};
use crate::report::{self, Measurement, Row, median, new_histogram};
use crate::server_stats::StatementCounter;

/// Options of the `locker` benchmark.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Args {
    /// Seconds each client runs per round, workload and concurrency.
    #[arg(long, default_value_t = 3)]
    duration_secs: u64,
    /// Rounds per workload and concurrency; the side that goes first alternates, and the
    /// ratio is the median of the rounds' ratios (robust to a noisy neighbour on the machine).
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// `synchronous_commit` of the benchmark database: `on` (the server default; every
    /// operation waits for its WAL flush) or `off` (measures CPU and protocol cost only).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    synchronous_commit: String,
    /// Cursor rows to spread the operations over.
    #[arg(long, default_value_t = 10_000)]
    rows: usize,
    /// Concurrency levels, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 8])]
    concurrency: Vec<usize>,
    /// Server to create the benchmark database on (default: `DATABASE_URL`, else
    /// postgres://postgres@127.0.0.1:5432/postgres).
    #[arg(long)]
    database_url: Option<String>,
    /// The pgbench program.
    #[arg(long, default_value = "pgbench")]
    pgbench: String,
    /// Keep the benchmark database instead of dropping it.
    #[arg(long)]
    keep_database: bool,
    /// Run the locker as behind a transaction pooler: its statements sent unnamed
    /// (`query_typed`, parsed on every call) instead of prepared once per connection. The
    /// connection is still direct: this measures the unnamed statements' cost, not a pooler's.
    #[arg(long)]
    unnamed: bool,
}

/// The stream all benchmark rows belong to.
const BENCH_STREAM: uuid::Uuid = uuid::Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0001);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
    AcquireRelease,
    Renew,
}

impl Workload {
    fn label(self) -> &'static str {
        match self {
            Workload::AcquireRelease => "acquire+release",
            Workload::Renew => "renew",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Locker,
    Pgbench,
}

/// Everything both sides share.
struct Setup {
    db: BenchDatabase,
    counter: StatementCounter,
    instance: InstanceId,
    names: Arc<Vec<PerspectiveName>>,
    options: StreamLockOptions,
    statements: LockerStatements,
    work_dir: PathBuf,
}

/// The statements the locker sends for the two workloads, as the server received them.
struct LockerStatements {
    try_acquire: String,
    renew: String,
    release: String,
}

/// Runs the benchmark and prints its report.
pub(crate) async fn run(args: Args) -> Result<()> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!("--concurrency needs positive values");
    }
    if args.rows == 0 || args.rounds == 0 || args.duration_secs == 0 {
        bail!("--rows, --rounds and --duration-secs must be positive");
    }
    if let Some(&c) = args.concurrency.iter().find(|&&c| c > args.rows) {
        bail!("--rows must be at least the concurrency ({c}): each client needs rows of its own");
    }
    let db = BenchDatabase::create(&admin_url(args.database_url.clone())).await?;
    let work_dir = std::env::temp_dir().join(db.name());
    std::fs::create_dir_all(&work_dir).context("creating a work directory")?;
    let name = db.name().to_owned();
    let outcome = run_on(db, &args, work_dir.clone()).await;
    std::fs::remove_dir_all(&work_dir).ok();
    let db = match outcome {
        Ok((db, report)) => {
            println!("{report}");
            db
        }
        Err((db, e)) => {
            if let Some(db) = db {
                db.drop_database().await.ok();
            }
            return Err(e);
        }
    };
    if args.keep_database {
        eprintln!("kept database {name}");
    } else {
        db.drop_database().await?;
    }
    Ok(())
}

type Failure = (Option<BenchDatabase>, anyhow::Error);

async fn run_on(
    db: BenchDatabase,
    args: &Args,
    work_dir: PathBuf,
) -> Result<(BenchDatabase, String), Failure> {
    let setup = match prepare(db, args, work_dir).await {
        Ok(setup) => setup,
        Err(e) => return Err((None, e)),
    };
    match measure_all(&setup, args).await {
        Ok(report) => Ok((setup.db, report)),
        Err(e) => Err((Some(setup.db), e)),
    }
}

async fn prepare(db: BenchDatabase, args: &Args, work_dir: PathBuf) -> Result<Setup> {
    {
        let admin = db.admin_client().await?;
        admin
            .batch_execute(&format!(
                "ALTER DATABASE \"{}\" SET synchronous_commit = {}",
                db.name(),
                if args.synchronous_commit == "off" {
                    "off"
                } else {
                    "on"
                }
            ))
            .await
            .context("setting synchronous_commit")?;
        let pool = db.pool(2)?;
        lockstep_pg::migrate(&pool).await?;
        let client = pool.get().await?;
        let rows = i32::try_from(args.rows).context("--rows")?;
        client
            .execute(
                "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) \
                 SELECT $1, g::text FROM generate_series(1, $2) AS g",
                &[&BENCH_STREAM, &rows],
            )
            .await
            .context("creating cursor rows")?;
        client
            .batch_execute("VACUUM ANALYZE wh_perspective_cursors")
            .await?;
        drop(client);
        pool.close();
    }
    let counter = StatementCounter::new(&db, "wh_perspective_cursors").await?;
    let names = (1..=args.rows)
        .map(|i| PerspectiveName::new(i.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let instance = InstanceId::random();
    // Long enough that no benchmark lease expires between two renews of a random row.
    let options = StreamLockOptions::new(Duration::from_secs(3600), Duration::from_secs(1200))?;
    let statements = locker_statements(&db, options, instance, &names[0]).await?;
    Ok(Setup {
        db,
        counter,
        instance,
        names: Arc::new(names),
        options,
        statements,
        work_dir,
    })
}

/// Runs try-acquire, renew and release on `name`'s row through the locker's public API, on a
/// pool of one connection, and reads what each call prepared on that connection from
/// `pg_prepared_statements`: the texts pgbench runs. The row ends as it began, without a lease
/// (its epoch one higher).
async fn locker_statements(
    db: &BenchDatabase,
    options: StreamLockOptions,
    instance: InstanceId,
    name: &PerspectiveName,
) -> Result<LockerStatements> {
    let pool = db.pool(1)?;
    let locker = PgStreamLocker::from_pool(pool.clone(), options);
    let mut seen = HashSet::new();
    prepared_since(&pool, &mut seen).await?;
    let stream = StreamId::from_uuid(BENCH_STREAM);
    let lease = match locker
        .try_acquire(stream, name, instance, &LockReason::Rewind)
        .await?
    {
        AcquireOutcome::Acquired(lease) => lease,
        other => bail!("reading the locker's statements: try-acquire answered {other:?}"),
    };
    let try_acquire = only_statement(
        "try_acquire",
        prepared_since(&pool, &mut seen).await?,
        &["uuid", "text", "uuid", "text", "interval"],
    )?;
    if !locker.renew(&lease.id).await?.is_renewed() {
        bail!("reading the locker's statements: the renew lost the lease");
    }
    let renew = only_statement(
        "renew",
        prepared_since(&pool, &mut seen).await?,
        &["uuid", "text", "uuid", "bigint", "interval"],
    )?;
    let _ = locker.release(&lease.id).await?;
    let release = only_statement(
        "release",
        prepared_since(&pool, &mut seen).await?,
        &["uuid", "text", "uuid", "bigint"],
    )?;
    drop(locker);
    pool.close();
    Ok(LockerStatements {
        try_acquire,
        renew,
        release,
    })
}

/// The statements prepared on the pool's one connection that are not in `seen` yet, with their
/// parameter types; adds them to `seen`. (`query_typed` sends an unnamed statement, which
/// `pg_prepared_statements` does not list, so this query never lists itself.)
async fn prepared_since(
    pool: &deadpool_postgres::Pool,
    seen: &mut HashSet<String>,
) -> Result<Vec<(String, Vec<String>)>> {
    let client = pool.get().await?;
    let rows = client
        .query_typed(
            "SELECT statement, parameter_types::text[] FROM pg_prepared_statements",
            &[],
        )
        .await
        .context("reading pg_prepared_statements")?;
    let mut new = Vec::new();
    for row in rows {
        let statement: String = row.try_get(0)?;
        if seen.insert(statement.clone()) {
            new.push((statement, row.try_get(1)?));
        }
    }
    Ok(new)
}

/// The one statement a call prepared, checked to take the parameter types pgbench binds.
fn only_statement(
    call: &str,
    prepared: Vec<(String, Vec<String>)>,
    types: &[&str],
) -> Result<String> {
    let [(statement, parameters)] = <[_; 1]>::try_from(prepared).map_err(|all| {
        anyhow::anyhow!(
            "the locker's {call} prepared {} statements, the benchmark expects one",
            all.len()
        )
    })?;
    if parameters != types {
        bail!(
            "the locker's {call} statement takes ({}), the pgbench script binds ({})",
            parameters.join(", "),
            types.join(", ")
        );
    }
    Ok(statement)
}

async fn measure_all(setup: &Setup, args: &Args) -> Result<String> {
    let duration = Duration::from_secs(args.duration_secs);
    let mut lines = vec![report::header()];
    let mut ratios: Vec<(usize, Workload, Vec<f64>)> = Vec::new();
    let progress = report::Progress::new((2 * args.concurrency.len() * args.rounds * 2) as u64);
    for workload in [Workload::AcquireRelease, Workload::Renew] {
        let epoch = match workload {
            Workload::AcquireRelease => None,
            Workload::Renew => Some(hold_every_row(setup).await?),
        };
        for &concurrency in &args.concurrency {
            let mut locker = Measurement::empty();
            let mut pgbench = Measurement::empty();
            let mut round_ratios = Vec::with_capacity(args.rounds);
            for round in 0..args.rounds {
                let mut this_round = [0.0_f64; 2];
                let order = if round % 2 == 0 {
                    [Side::Locker, Side::Pgbench]
                } else {
                    [Side::Pgbench, Side::Locker]
                };
                for side in order {
                    progress.step(format!(
                        "{} c={concurrency} round {}/{}: {side:?}",
                        workload.label(),
                        round + 1,
                        args.rounds
                    ));
                    let m =
                        measure(setup, args, workload, side, concurrency, duration, epoch).await?;
                    match side {
                        Side::Locker => {
                            this_round[0] = m.ops_per_sec();
                            locker.merge(&m);
                        }
                        Side::Pgbench => {
                            this_round[1] = m.ops_per_sec();
                            pgbench.merge(&m);
                        }
                    }
                }
                round_ratios.push(this_round[0] / this_round[1]);
            }
            for (side, m) in [("lockstep", &locker), ("pgbench", &pgbench)] {
                lines.push(report::row(&Row {
                    workload: workload.label(),
                    concurrency,
                    side,
                    measurement: m,
                }));
            }
            ratios.push((concurrency, workload, round_ratios));
        }
    }
    progress.finish();
    lines.push(String::new());
    lines.push(setup.counter.describe().to_owned());
    lines.push(format!(
        "{} rounds of {} s per client, workload and concurrency (sides alternate: ABBA...); \
         {} rows; pgbench -M prepared; synchronous_commit = {}; locker statements {}",
        args.rounds,
        args.duration_secs,
        args.rows,
        args.synchronous_commit,
        if args.unnamed {
            "unnamed (--unnamed: as behind a transaction pooler)"
        } else {
            "prepared once per connection"
        }
    ));
    lines.push(
        "ratio = median over rounds of (lockstep ops/s / pgbench ops/s) of the same round; \
         the headline per concurrency is the lower of the two workloads' ratios"
            .to_owned(),
    );
    lines.push(String::new());
    let mut medians: Vec<(usize, f64)> = Vec::new();
    for (concurrency, workload, round_ratios) in &ratios {
        let median = median(round_ratios);
        medians.push((*concurrency, median));
        let rounds: Vec<String> = round_ratios.iter().map(|r| format!("{r:.3}")).collect();
        lines.push(format!(
            "ratio {} c{concurrency} = {median:.3} (rounds: {})",
            workload.label(),
            rounds.join(", ")
        ));
    }
    for &concurrency in &args.concurrency {
        let worst = medians
            .iter()
            .filter(|(c, _)| *c == concurrency)
            .map(|(_, r)| *r)
            .fold(f64::INFINITY, f64::min);
        lines.push(format!("locker_vs_pgbench_c{concurrency}={worst:.3}"));
    }
    Ok(lines.join("\n"))
}

/// The rows one client uses: indices `client`, `client + clients`, `client + 2 clients`, … below
/// `rows`, the same `slots` of them for every client (so that pgbench, which draws
/// `client + clients * random(0, slots - 1)`, addresses exactly the same rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slice {
    client: usize,
    clients: usize,
    slots: usize,
}

impl Slice {
    /// `clients` is at least 1 and at most `rows` (checked by `run`).
    fn new(client: usize, clients: usize, rows: usize) -> Slice {
        let clients = clients.max(1);
        Slice {
            client,
            clients,
            slots: (rows / clients).max(1),
        }
    }

    /// A random row index of this client's, 0-based.
    fn draw(&self, rng: &mut StdRng) -> usize {
        self.client + self.clients * rng.random_range(0..self.slots)
    }
}

/// Puts every row under a lease of the benchmark instance, at one new epoch above every epoch
/// used so far, so renews by both clients address them the same way. Returns that epoch.
async fn hold_every_row(setup: &Setup) -> Result<i64> {
    let client = setup.db.client().await?;
    let held = client
        .execute(
            "WITH next AS (SELECT max(stream_lock_epoch) + 1 AS epoch FROM wh_perspective_cursors) \
             UPDATE wh_perspective_cursors \
                SET stream_lock_instance_id = $1, stream_lock_reason = 'bench', \
                    stream_lock_expiry = clock_timestamp() + interval '1 day', \
                    stream_lock_epoch = next.epoch \
               FROM next \
              WHERE stream_id = $2",
            &[&setup.instance.as_uuid(), &BENCH_STREAM],
        )
        .await
        .context("holding every row for the renew workload")?;
    if held != setup.names.len() as u64 {
        bail!("held {held} rows instead of {}", setup.names.len());
    }
    let epoch: i64 = client
        .query_one(
            "SELECT min(stream_lock_epoch) FROM wh_perspective_cursors \
              WHERE stream_lock_instance_id = $1",
            &[&setup.instance.as_uuid()],
        )
        .await?
        .get(0);
    let spread: i64 = client
        .query_one(
            "SELECT count(DISTINCT stream_lock_epoch) FROM wh_perspective_cursors",
            &[],
        )
        .await?
        .get(0);
    if spread != 1 {
        bail!("setting up the renew workload left {spread} different epochs");
    }
    client
        .batch_execute("VACUUM ANALYZE wh_perspective_cursors")
        .await?;
    Ok(epoch)
}

async fn measure(
    setup: &Setup,
    args: &Args,
    workload: Workload,
    side: Side,
    concurrency: usize,
    duration: Duration,
    epoch: Option<i64>,
) -> Result<Measurement> {
    let before = setup.counter.read(&setup.db).await?;
    let mut m = match side {
        Side::Locker => {
            run_locker(setup, workload, concurrency, duration, epoch, args.unnamed).await?
        }
        Side::Pgbench => run_pgbench(setup, args, workload, concurrency, duration, epoch).await?,
    };
    let after = setup.counter.read(&setup.db).await?;
    m.statements = Some(after.saturating_sub(before));
    Ok(m)
}

async fn run_locker(
    setup: &Setup,
    workload: Workload,
    concurrency: usize,
    duration: Duration,
    epoch: Option<i64>,
    unnamed: bool,
) -> Result<Measurement> {
    let pool = setup.db.pool(concurrency)?;
    let locker = if unnamed {
        let db = lockstep_pg::PgDatabase::builder()
            .pool(pool.clone())
            .transaction_pooler(true)
            .build()?;
        PgStreamLocker::new(&db, setup.options)
    } else {
        PgStreamLocker::from_pool(pool.clone(), setup.options)
    };
    // Open every connection and prepare the statements before the clock starts (pgbench also
    // reports its rate without connection set-up).
    {
        let mut conns = Vec::with_capacity(concurrency);
        for _ in 0..concurrency {
            conns.push(pool.get().await?);
        }
        for conn in &conns {
            let s = &setup.statements;
            for statement in [&s.try_acquire, &s.release, &s.renew] {
                conn.prepare_cached(statement).await?;
            }
        }
    }
    let leases: Option<Arc<Vec<LeaseId>>> = epoch.map(|epoch| {
        Arc::new(
            setup
                .names
                .iter()
                .map(|name| {
                    LeaseId::new(
                        StreamId::from_uuid(BENCH_STREAM),
                        name.clone(),
                        setup.instance,
                        LeaseEpoch::new(epoch),
                    )
                })
                .collect(),
        )
    });

    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = Vec::with_capacity(concurrency);
    for client in 0..concurrency {
        let locker = locker.clone();
        let names = Arc::clone(&setup.names);
        let leases = leases.clone();
        let instance = setup.instance;
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::from_os_rng();
            let mut histogram = new_histogram();
            let mut ops = 0_usize;
            let stream = StreamId::from_uuid(BENCH_STREAM);
            let reason = LockReason::Rewind;
            let slice = Slice::new(client, concurrency, names.len());
            while Instant::now() < deadline {
                let i = slice.draw(&mut rng);
                let t = Instant::now();
                match (&leases, workload) {
                    (Some(leases), Workload::Renew) => {
                        let outcome = locker.renew(&leases[i]).await?;
                        if !outcome.is_renewed() {
                            bail!("a benchmark lease was lost");
                        }
                    }
                    _ => match locker
                        .try_acquire(stream, &names[i], instance, &reason)
                        .await?
                    {
                        AcquireOutcome::Acquired(lease) => {
                            let _ = locker.release(&lease.id).await?;
                        }
                        // No other task uses this row (see `Slice`): busy means the set-up is
                        // broken, and the comparison with pgbench would not be fair.
                        other => bail!(
                            "the benchmark instance is the only holder and no other task uses \
                             this row: {other:?}"
                        ),
                    },
                }
                histogram.saturating_record(t.elapsed().as_micros().try_into().unwrap_or(u64::MAX));
                ops += 1;
            }
            Ok::<(usize, Histogram<u64>), anyhow::Error>((ops, histogram))
        }));
    }
    let mut m = Measurement::empty();
    for task in tasks {
        let (ops, histogram) = task.await??;
        m.ops += ops;
        let _ = m.latency_us.add(&histogram);
    }
    m.elapsed = start.elapsed();
    drop(locker);
    pool.close();
    Ok(m)
}

async fn run_pgbench(
    setup: &Setup,
    args: &Args,
    workload: Workload,
    concurrency: usize,
    duration: Duration,
    epoch: Option<i64>,
) -> Result<Measurement> {
    let timeout = PgInterval::from_duration(setup.options.lock_timeout())
        .context("lock timeout")?
        .micros();
    // pgbench's half of `Slice`: client `:client_id` (0-based) uses perspectives
    // `1 + :client_id + c * j`, `j` in `0 .. slots`.
    let slice = Slice::new(0, concurrency, args.rows);
    let pick = format!(
        "\\set p 1 + :client_id + {concurrency} * random(0, {})\n",
        slice.slots - 1
    );
    let script = match workload {
        Workload::AcquireRelease => format!(
            "{pick}{}\n\\gset out_\n{};\n",
            to_pgbench(
                &setup.statements.try_acquire,
                &["stream", "p", "instance", "reason", "timeout"]
            )?,
            to_pgbench(
                &setup.statements.release,
                &["stream", "p", "instance", "out_acquired_epoch"]
            )?,
        ),
        Workload::Renew => format!(
            "{pick}{};\n",
            to_pgbench(
                &setup.statements.renew,
                &["stream", "p", "instance", "epoch", "timeout"]
            )?
        ),
    };
    let defines = [
        ("stream", BENCH_STREAM.to_string()),
        ("instance", setup.instance.to_string()),
        ("reason", LockReason::Rewind.to_string()),
        ("timeout", format!("{timeout} microseconds")),
        ("epoch", epoch.unwrap_or(0).to_string()),
    ];
    let tag = format!("{}_c{concurrency}", workload.label().replace('+', "_"));
    pgbench::run(
        &args.pgbench,
        &setup.db,
        &setup.work_dir,
        &tag,
        &PgbenchRun {
            script: &script,
            clients: concurrency,
            limit: pgbench::Limit::Duration(duration),
            defines: &defines,
        },
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_draw_disjoint_rows_within_range() {
        let mut rng = StdRng::seed_from_u64(7);
        for (clients, rows) in [(1, 10), (8, 10_000), (3, 10), (8, 8)] {
            let mut seen = vec![None; rows];
            for client in 0..clients {
                let slice = Slice::new(client, clients, rows);
                for _ in 0..2_000 {
                    let i = slice.draw(&mut rng);
                    assert!(i < rows, "{i} of {rows}");
                    assert_eq!(*seen[i].get_or_insert(client), client, "row {i} shared");
                }
            }
        }
    }
}
