//! Bad input: every constructor's limits and every bad-input case of issue 8 is a typed error
//! that changes nothing (issue 8's suite, part 4).
//!
//! Each case runs in a task of its own (a panic is counted, not fatal) between two checksums of
//! every table of the database (`md5(string_agg(t::text, ',' ORDER BY t::text))` per table, the
//! list of tables included) and of the fakes' state (leases, committed events, held locks): a
//! refused input must leave both exactly as they were. Where the fakes take the same input,
//! they must refuse it with the same [`ErrorKind`] (and [`ValidationError`]) as PostgreSQL.
//!
//! - Constructors at and past their limits: [`StreamLockOptions`] (zero, sub-millisecond,
//!   9000 years, `Duration::MAX`, `i64::MAX` µs, keepalive not below half), nil instance and
//!   event ids, blank / oversized / NUL perspective names, reasons, aggregate types, resource
//!   keys and event types, NUL in payloads, [`RetryPolicy::backoff`] with NaN / infinite units
//!   and `Duration::MAX` ceilings, [`WorkerOptions::validate`].
//! - Calls with bad arguments, on PostgreSQL and the fakes: lock timeouts past 24.8 days,
//!   appends of no events / a repeated id / an unrepresentable expected version, a lock in a
//!   REPEATABLE READ transaction, `with_local_patience(Duration::MAX)` under contention, and
//!   odd-but-valid calls that must change nothing either (renew or release of a lease nobody
//!   holds, a pair without a cursor, an empty or huge `renew_many`).
//! - Stored values lockstep cannot read (`stream_lock_expiry = 'infinity'` / `'-infinity'`, a
//!   blank stored reason, a nil stored holder, a blank stored perspective name): every reading
//!   operation is a typed error, never a panic, and writes nothing.
//! - A database that was never migrated: every operation is a typed error that says to run the
//!   migrations, and creates nothing.
//! - Accepted limits (the longest lock timeout, the longest names and keys) work end to end on
//!   both implementations.
//!
//! The long run adds random durations and lengths around every bound (accepted exactly when
//! within it, never a panic).

use lockstep_core::perspective_store::prelude::*;
use std::future::Future;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use deadpool_postgres::Pool;
use lockstep_core::{
    AcquireOutcome, AggregateType, DistributedLock, Error, ErrorKind, EventStore, ExpectedVersion,
    InstanceId, LeaseEpoch, LeaseId, LockReason, NewEvent, Pair, PerspectiveName, ResourceKey,
    RetryPolicy, SkippedEvent, StreamId, StreamLockAdmin, StreamLockOptions, StreamLocker,
    ValidationError,
};
use lockstep_pg::{LockQueue, PgTransaction};
use lockstep_pg_advisory::PgDistributedLock;
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};
use lockstep_testkit::{
    FakeDatabase, FakeDistributedLock, InMemoryEventStore, InMemoryPerspectiveStore,
    InMemoryStreamLocker,
};
use lockstep_worker::WorkerOptions;
use rand::Rng as _;
use tokio_postgres::Client;
use uuid::Uuid;

use super::{Scale, Tally};
use crate::number_event;
use lockstep_core::Transaction as _;

const YEAR: Duration = Duration::from_secs(365 * 24 * 60 * 60);
const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// Everything the cases share: a migrated database with leases, events and a lock held, and
/// the fakes with the same kind of state.
struct Ctx {
    _db: TestDatabase,
    pool: Pool,
    observer: Client,
    locker: PgStreamLocker,
    lock: PgDistributedLock,
    store: PgEventStore,
    fake_db: FakeDatabase,
    fake_locker: InMemoryStreamLocker,
    fake_lock: FakeDistributedLock,
    fake_store: InMemoryEventStore,
    perspectives: PgPerspectiveStore,
    fake_perspectives: InMemoryPerspectiveStore,
    perspective: PerspectiveName,
    /// A pair with a cursor row on both sides, held by `holder`.
    pair: StreamId,
    holder: InstanceId,
}

fn long_options() -> anyhow::Result<StreamLockOptions> {
    Ok(StreamLockOptions::new(
        Duration::from_secs(3600),
        Duration::from_secs(600),
    )?)
}

/// What a case found wrong (one line each).
type Problems = Vec<String>;

/// Runs every case (`Long`: plus random values around every bound).
pub async fn run(scale: Scale) -> anyhow::Result<Tally> {
    let ctx = Arc::new(Ctx::new().await?);
    let mut tally = Tally::default();
    let checked: Vec<(&str, CaseFn)> = vec![
        (
            "stream lock options",
            Box::new(|c| Box::pin(options_case(c))),
        ),
        ("ids and names", Box::new(|c| Box::pin(names_case(c)))),
        (
            "look-alike names and long skip reasons",
            Box::new(|c| Box::pin(look_alike_case(c))),
        ),
        ("events", Box::new(|c| Box::pin(events_case(c)))),
        (
            "retry and worker options",
            Box::new(|c| Box::pin(retry_case(c))),
        ),
        (
            "lock timeouts",
            Box::new(|c| Box::pin(lock_timeout_case(c))),
        ),
        ("bad appends", Box::new(|c| Box::pin(append_case(c)))),
        ("isolation", Box::new(|c| Box::pin(isolation_case(c)))),
        ("endless patience", Box::new(|c| Box::pin(patience_case(c)))),
        (
            "leases nobody holds",
            Box::new(|c| Box::pin(nobody_case(c))),
        ),
    ];
    for (name, f) in checked {
        guarded(&ctx, &mut tally, name, true, f).await?;
    }
    let unchecked: Vec<(&str, CaseFn)> = vec![
        // These checksum around their own operations (they set a row up first).
        ("stored values", Box::new(|c| Box::pin(stored_case(c)))),
        ("accepted limits", Box::new(|c| Box::pin(limits_case(c)))),
        (
            "unmigrated database",
            Box::new(|_| Box::pin(unmigrated_case())),
        ),
    ];
    for (name, f) in unchecked {
        guarded(&ctx, &mut tally, name, false, f).await?;
    }
    if scale == Scale::Long {
        for round in 0..200 {
            let name = format!("random bounds #{round}");
            guarded(
                &ctx,
                &mut tally,
                &name,
                true,
                Box::new(|c| Box::pin(random_case(c))),
            )
            .await?;
        }
    }
    Ok(tally)
}

type CaseFuture = std::pin::Pin<Box<dyn Future<Output = anyhow::Result<(u64, Problems)>> + Send>>;
type CaseFn = Box<dyn FnOnce(Arc<Ctx>) -> CaseFuture + Send>;

/// Runs one case in a task of its own (panics counted) between two checksums (when
/// `checksum`). A case returns how many inputs it tried and what went wrong.
async fn guarded(
    ctx: &Arc<Ctx>,
    tally: &mut Tally,
    name: &str,
    checksum: bool,
    case: CaseFn,
) -> anyhow::Result<()> {
    let before = if checksum {
        Some(ctx.fingerprint().await?)
    } else {
        None
    };
    let task = tokio::spawn(case(Arc::clone(ctx)));
    match tokio::time::timeout(Duration::from_secs(120), task).await {
        Ok(Ok(Ok((inputs, problems)))) => {
            tally.cases += inputs;
            for p in problems {
                tally.violation(format!("{name}: {p}"));
            }
        }
        Ok(Ok(Err(e))) => tally.violation(format!("{name}: {e:#}")),
        Ok(Err(e)) if e.is_panic() => tally.panic(format!("{name}: panicked: {e}")),
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => tally.violation(format!("{name}: did not finish within 120 s")),
    }
    if let Some(before) = before {
        let after = ctx.fingerprint().await?;
        if after != before {
            tally.violation(format!(
                "{name}: bad input changed the state: {}",
                diff(&before, &after)
            ));
        }
    }
    Ok(())
}

/// The parts of two fingerprints that differ.
fn diff(before: &str, after: &str) -> String {
    let b: Vec<&str> = before.split(';').collect();
    let a: Vec<&str> = after.split(';').collect();
    let changed: Vec<String> = a
        .iter()
        .filter(|part| !b.contains(part))
        .map(|part| part.chars().take(120).collect())
        .collect();
    changed.join(" | ")
}

impl Ctx {
    async fn new() -> anyhow::Result<Ctx> {
        let db = test_database().await;
        let pool = db.pool(6);
        lockstep_pg::migrate(&pool).await?;
        let observer = db.connect().await;
        let fake_db = FakeDatabase::new();
        let fake_locker = InMemoryStreamLocker::with_database(long_options()?, &fake_db);
        let fake_store = InMemoryEventStore::new();
        let ctx = Ctx {
            locker: PgStreamLocker::from_pool(pool.clone(), long_options()?),
            lock: PgDistributedLock::from_pool(pool.clone()),
            store: PgEventStore::with_queue(lockstep_pg::LockQueue::new()),
            perspectives: PgPerspectiveStore::new(),
            fake_perspectives: InMemoryPerspectiveStore::new(&fake_db, &fake_store, &fake_locker),
            fake_locker,
            fake_lock: FakeDistributedLock::new(&fake_db),
            fake_store,
            fake_db,
            perspective: PerspectiveName::new("BadInput")?,
            pair: StreamId::new_v7(),
            holder: InstanceId::random(),
            _db: db,
            pool,
            observer,
        };
        // State for the checksums to cover: a held lease, a free cursor, a stream of events.
        let free = StreamId::new_v7();
        for stream in [ctx.pair, free] {
            insert_cursor(&ctx.observer, stream, &ctx.perspective).await?;
            ctx.fake_locker.create_cursor(stream, &ctx.perspective);
        }
        let reason = LockReason::Rewind;
        let pg = ctx
            .locker
            .try_acquire(ctx.pair, &ctx.perspective, ctx.holder, &reason)
            .await?;
        let fake = ctx
            .fake_locker
            .try_acquire(ctx.pair, &ctx.perspective, ctx.holder, &reason)
            .await?;
        anyhow::ensure!(pg.is_acquired() && fake.is_acquired(), "setup leases");
        let stream = StreamId::new_v7();
        let events = [number_event(1), number_event(2)];
        let tx = PgTransaction::begin(&ctx.pool).await?;
        EventStore::append(&ctx.store, &tx, stream, ExpectedVersion::NoStream, &events).await?;
        tx.commit().await?;
        let ftx = ctx.fake_db.begin_now();
        EventStore::append(
            &ctx.fake_store,
            &ftx,
            stream,
            ExpectedVersion::NoStream,
            &events,
        )
        .await?;
        ftx.commit().await?;
        Ok(ctx)
    }

    /// The checksum of every table and of the fakes' state.
    async fn fingerprint(&self) -> anyhow::Result<String> {
        let mut parts = vec![checksum(&self.observer).await?];
        let mut leases: Vec<String> = self
            .fake_locker
            .list_leases()
            .await?
            .into_iter()
            .map(|l| {
                format!(
                    "{}/{}/{}/{}/{}",
                    l.stream_id, l.perspective, l.holder, l.epoch, l.expires_at
                )
            })
            .collect();
        leases.sort();
        parts.push(format!("fake leases:{}", leases.join(",")));
        let mut streams: Vec<String> = self
            .fake_store
            .streams()
            .into_iter()
            .map(|s| format!("{s}={}", self.fake_store.committed(s).len()))
            .collect();
        streams.sort();
        parts.push(format!("fake events:{}", streams.join(",")));
        parts.push(format!("fake locks:{:?}", self.fake_db.held_keys()));
        let ftx = self.fake_db.begin_now();
        let registered: Vec<String> = self
            .fake_perspectives
            .perspective_status(&ftx)
            .await?
            .into_iter()
            .map(|s| s.perspective.to_string())
            .collect();
        ftx.rollback().await?;
        parts.push(format!("fake perspectives:{registered:?}"));
        Ok(parts.join(";"))
    }
}

/// Every table of the database (schemas other than the system ones), with its row count and
/// the md5 of its rows in a fixed order.
async fn checksum(client: &Client) -> anyhow::Result<String> {
    let tables = client
        .query(
            "SELECT quote_ident(table_schema) || '.' || quote_ident(table_name) \
               FROM information_schema.tables \
              WHERE table_schema NOT IN ('pg_catalog', 'information_schema') \
                AND table_type = 'BASE TABLE' ORDER BY 1",
            &[],
        )
        .await?;
    let mut sums = Vec::with_capacity(tables.len());
    for table in tables {
        let name: String = table.try_get(0)?;
        let row = client
            .query_one(
                &format!(
                    "SELECT count(*), md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) \
                       FROM {name} t"
                ),
                &[],
            )
            .await?;
        let (count, md5): (i64, String) = (row.try_get(0)?, row.try_get(1)?);
        sums.push(format!("{name}:{count}:{md5}"));
    }
    Ok(sums.join(";"))
}

async fn insert_cursor(
    client: &Client,
    stream: StreamId,
    perspective: &PerspectiveName,
) -> anyhow::Result<()> {
    client
        .execute(
            "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)",
            &[&stream.as_uuid(), &perspective.as_str()],
        )
        .await?;
    Ok(())
}

/// Checks one refusal: an error of `kind`, carrying `validation` when given.
fn refused<T: std::fmt::Debug>(
    problems: &mut Problems,
    what: &str,
    result: Result<T, Error>,
    kind: ErrorKind,
    validation: Option<ValidationError>,
) {
    match result {
        Ok(v) => problems.push(format!("{what}: accepted ({v:?})")),
        Err(e) if e.kind() != kind => {
            problems.push(format!("{what}: {:?} instead of {kind:?}: {e}", e.kind()));
        }
        Err(e) => {
            if let Some(want) = validation
                && e.validation() != Some(&want)
            {
                problems.push(format!(
                    "{what}: validation {:?} instead of {want:?}",
                    e.validation()
                ));
            }
        }
    }
}

/// The fake and Postgres answered the same kind (both `Ok`, or errors of one kind), and that
/// kind is `want` (`None`: both succeeded).
fn same_kind<A: std::fmt::Debug, B: std::fmt::Debug>(
    problems: &mut Problems,
    what: &str,
    fake: &Result<A, Error>,
    pg: &Result<B, Error>,
    want: Option<ErrorKind>,
) {
    let f = fake.as_ref().map(|_| ()).map_err(Error::kind);
    let p = pg.as_ref().map(|_| ()).map_err(Error::kind);
    if f != p {
        problems.push(format!(
            "{what}: the fake answered {fake:?}, Postgres {pg:?}"
        ));
    }
    let validations = (
        fake.as_ref().err().and_then(Error::validation),
        pg.as_ref().err().and_then(Error::validation),
    );
    if validations.0 != validations.1 {
        problems.push(format!("{what}: validations differ: {validations:?}"));
    }
    match (want, &p) {
        (None, Ok(())) => {}
        (Some(k), Err(got)) if *got == k => {}
        _ => problems.push(format!("{what}: expected {want:?}, got {pg:?}")),
    }
}

async fn options_case(_: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let ms = Duration::from_millis;
    let too_long = |max| {
        Some(ValidationError::DurationTooLong {
            field: "lock timeout",
            max,
        })
    };
    let max = StreamLockOptions::MAX_LOCK_TIMEOUT;
    let cases: Vec<(Duration, Duration, Option<ValidationError>)> = vec![
        (
            Duration::ZERO,
            ms(1),
            Some(ValidationError::NonPositiveDuration {
                field: "lock timeout",
            }),
        ),
        (
            ms(30),
            Duration::ZERO,
            Some(ValidationError::NonPositiveDuration {
                field: "keepalive interval",
            }),
        ),
        (
            Duration::from_nanos(999),
            Duration::from_nanos(1),
            Some(ValidationError::DurationTooShort {
                field: "lock timeout",
                min: ms(1),
            }),
        ),
        (
            ms(30),
            Duration::from_micros(999),
            Some(ValidationError::DurationTooShort {
                field: "keepalive interval",
                min: ms(1),
            }),
        ),
        (YEAR * 9000, YEAR, too_long(max)),
        (Duration::MAX, ms(1), too_long(max)),
        (Duration::from_micros(i64::MAX as u64), ms(1), too_long(max)),
        (max + Duration::from_micros(1), ms(60), too_long(max)),
        (
            ms(30),
            ms(15),
            Some(ValidationError::KeepaliveTooLong {
                keepalive: ms(15),
                lock_timeout: ms(30),
            }),
        ),
        (Duration::MAX, Duration::MAX, too_long(max)),
    ];
    let n = cases.len() as u64;
    for (timeout, keepalive, want) in cases {
        refused(
            &mut p,
            &format!("StreamLockOptions::new({timeout:?}, {keepalive:?})"),
            StreamLockOptions::new(timeout, keepalive),
            ErrorKind::InvalidInput,
            want,
        );
    }
    // The limits themselves are accepted.
    for (timeout, keepalive) in [(max, ms(60)), (ms(3), ms(1))] {
        if let Err(e) = StreamLockOptions::new(timeout, keepalive) {
            p.push(format!(
                "StreamLockOptions::new({timeout:?}, {keepalive:?}) refused: {e}"
            ));
        }
    }
    Ok((n + 2, p))
}

async fn names_case(_: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let mut n = 0;
    let mut check = |what: &str, r: Result<String, Error>, want: Option<ValidationError>| {
        n += 1;
        refused(&mut p, what, r, ErrorKind::InvalidInput, want);
    };
    let name = |s: String| PerspectiveName::new(s).map(|v| v.to_string());
    let reason = |s: String| LockReason::custom(s).map(|v| v.to_string());
    let parsed = |s: String| LockReason::parse(s).map(|v| v.to_string());
    let aggregate = |s: String| AggregateType::new(s).map(|v| v.to_string());
    let key = |s: String| ResourceKey::new(s).map(|v| v.to_string());
    check(
        "nil instance id",
        InstanceId::from_uuid(Uuid::nil()).map(|i| i.to_string()),
        Some(ValidationError::NilId {
            field: "instance id",
        }),
    );
    check(
        "nil event id",
        number_event(1)
            .with_id(Uuid::nil())
            .map(|e| e.event_id().to_string()),
        Some(ValidationError::NilId { field: "event id" }),
    );
    for blank in ["", " ", "\t\n"] {
        check(
            "blank perspective name",
            name(blank.into()),
            Some(ValidationError::BlankPerspectiveName),
        );
        check(
            "blank reason",
            reason(blank.into()),
            Some(ValidationError::BlankReason),
        );
        check(
            "blank parsed reason",
            parsed(blank.into()),
            Some(ValidationError::BlankReason),
        );
        check(
            "blank aggregate type",
            aggregate(blank.into()),
            Some(ValidationError::BlankAggregateType),
        );
    }
    check(
        "empty resource key",
        key(String::new()),
        Some(ValidationError::EmptyResourceKey),
    );
    let over = |max: usize| "é".repeat(max + 1);
    check(
        "perspective name of 201 characters",
        name(over(PerspectiveName::MAX_CHARS)),
        Some(ValidationError::PerspectiveNameTooLong {
            chars: 201,
            max: 200,
        }),
    );
    check(
        "reason of 51 characters",
        reason(over(LockReason::MAX_CHARS)),
        Some(ValidationError::ReasonTooLong { chars: 51, max: 50 }),
    );
    check(
        "aggregate type of 201 characters",
        aggregate(over(AggregateType::MAX_CHARS)),
        Some(ValidationError::AggregateTypeTooLong {
            chars: 201,
            max: 200,
        }),
    );
    check(
        "resource key of 1025 bytes",
        key("k".repeat(ResourceKey::MAX_BYTES + 1)),
        Some(ValidationError::ResourceKeyTooLong {
            bytes: 1025,
            max: 1024,
        }),
    );
    check(
        "aggregate type with a colon",
        aggregate("Stock:Item".into()),
        Some(ValidationError::AggregateTypeContainsColon(
            "Stock:Item".into(),
        )),
    );
    for (what, r) in [
        ("NUL in a perspective name", name("a\0b".into())),
        ("NUL in a reason", reason("a\0b".into())),
        ("NUL in an aggregate type", aggregate("a\0b".into())),
        ("NUL in a resource key", key("a\0b".into())),
    ] {
        check(what, r, None);
    }
    // The limits themselves are accepted.
    for (what, r) in [
        ("perspective name of 200 characters", name("é".repeat(200))),
        ("reason of 50 characters", reason("é".repeat(50))),
        (
            "aggregate type of 200 characters",
            aggregate("é".repeat(200)),
        ),
        ("resource key of 1024 bytes", key("k".repeat(1024))),
    ] {
        n += 1;
        if let Err(e) = r {
            p.push(format!("{what} refused: {e}"));
        }
    }
    Ok((n, p))
}

/// Names that print like `Seq` or `Café` are refused before they can be registered (a worker
/// registers what it can name), so neither Postgres nor the fakes get a second perspective that
/// reads as the first; a skip reason of 10 MB is refused by both stores before any write.
async fn look_alike_case(ctx: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let mut n = 0;
    for (what, text) in [
        ("a trailing space", "Seq "),
        ("a leading space", " Seq"),
        ("a trailing newline", "Seq\n"),
        ("a zero width space", "Seq\u{200B}"),
        ("a left-to-right mark", "Se\u{200E}q"),
        ("a byte order mark", "\u{FEFF}Seq"),
        ("a word joiner", "Seq\u{2060}"),
        ("NFD", "Cafe\u{301}"),
    ] {
        n += 1;
        let what = format!("perspective name with {what}");
        match PerspectiveName::new(text) {
            Err(e) => refused(
                &mut p,
                &what,
                Err::<(), _>(e),
                ErrorKind::InvalidInput,
                None,
            ),
            Ok(name) => {
                p.push(format!("{what}: accepted"));
                // Registered as a worker would register it: the checksums show the change.
                let names = [name];
                let tx = PgTransaction::begin(&ctx.pool).await?;
                ctx.perspectives.register(&tx, &names).await?;
                tx.commit().await?;
                let ftx = ctx.fake_db.begin_now();
                ctx.fake_perspectives.register(&ftx, &names).await?;
                ftx.commit().await?;
            }
        }
    }
    n += 1;
    let pair = Pair::new(ctx.pair, ctx.perspective.clone());
    let reason = "x".repeat(10 << 20);
    let event = Uuid::now_v7();
    let tx = PgTransaction::begin(&ctx.pool).await?;
    let pg = ctx
        .perspectives
        .skip_event(&tx, &pair, event, &reason)
        .await;
    tx.commit().await?;
    let ftx = ctx.fake_db.begin_now();
    let fake = ctx
        .fake_perspectives
        .skip_event(&ftx, &pair, event, &reason)
        .await;
    ftx.commit().await?;
    same_kind(
        &mut p,
        "a skip reason of 10 MB",
        &fake,
        &pg,
        Some(ErrorKind::InvalidInput),
    );
    if let Err(e) = &pg
        && e.validation()
            != Some(&ValidationError::TextTooLong {
                field: "skip reason",
                chars: reason.len(),
                max: SkippedEvent::MAX_REASON_CHARS,
            })
    {
        p.push(format!("a skip reason of 10 MB: {e}"));
    }
    Ok((n, p))
}

async fn events_case(_: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    use serde_json::json;
    let cases: Vec<(&str, Result<NewEvent, Error>, Option<ValidationError>)> = vec![
        (
            "blank event type",
            NewEvent::new(" ", json!({})),
            Some(ValidationError::BlankEventType),
        ),
        (
            "event type of 201 characters",
            NewEvent::new("x".repeat(201), json!({})),
            Some(ValidationError::EventTypeTooLong {
                chars: 201,
                max: 200,
            }),
        ),
        (
            "NUL in an event type",
            NewEvent::new("a\0b", json!({})),
            Some(ValidationError::ContainsNul {
                field: "event type",
            }),
        ),
        (
            "NUL in a payload value",
            NewEvent::new("T", json!({"a": ["x\0"]})),
            Some(ValidationError::ContainsNul {
                field: "event payload",
            }),
        ),
        (
            "NUL in a payload key",
            NewEvent::new("T", json!({"a\0": 1})),
            Some(ValidationError::ContainsNul {
                field: "event payload",
            }),
        ),
    ];
    let n = cases.len() as u64;
    for (what, r, want) in cases {
        refused(&mut p, what, r, ErrorKind::InvalidInput, want);
    }
    Ok((n, p))
}

async fn retry_case(_: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let mut n = 0;
    let one = NonZeroU32::MIN;
    let policies = [
        RetryPolicy::default(),
        RetryPolicy::new(one, Duration::MAX, Duration::MAX),
        RetryPolicy::new(one, Duration::ZERO, Duration::MAX),
        RetryPolicy::new(one, Duration::MAX, Duration::ZERO),
    ];
    for policy in policies {
        for retry in [0, 1, 2, 31, 32, 64, u32::MAX] {
            for unit in [
                f64::NAN,
                f64::INFINITY,
                f64::NEG_INFINITY,
                -1.0,
                0.0,
                0.5,
                1.0,
                2.0,
                f64::MAX,
            ] {
                n += 1;
                let ceiling = policy.ceiling(retry);
                let backoff = policy.backoff(retry, unit);
                if backoff > ceiling {
                    p.push(format!(
                        "{policy:?} backoff({retry}, {unit}) = {backoff:?} > {ceiling:?}"
                    ));
                }
            }
        }
    }
    let mut bad_worker = |what: &str, options: WorkerOptions| {
        n += 1;
        refused(
            &mut p,
            what,
            options.validate(),
            ErrorKind::InvalidInput,
            None,
        );
    };
    let d = WorkerOptions::default();
    bad_worker(
        "worker poll interval of zero",
        d.with_poll_interval(Duration::ZERO),
    );
    bad_worker(
        "worker poll interval of Duration::MAX",
        d.with_poll_interval(Duration::MAX),
    );
    bad_worker(
        "worker shutdown grace of Duration::MAX",
        d.with_shutdown_grace(Duration::MAX),
    );
    bad_worker("worker concurrency of zero", d.with_concurrency(0));
    bad_worker(
        "worker batch of usize::MAX",
        d.with_max_events_per_claim(usize::MAX),
    );
    bad_worker(
        "worker backoff above its maximum",
        d.with_failure_backoff(DAY)
            .with_failure_backoff_max(Duration::from_secs(1)),
    );
    Ok((n, p))
}

/// Lock waits past what Postgres's `lock_timeout` holds (about 24.8 days), on both sides.
async fn lock_timeout_case(ctx: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let key = ResourceKey::new(format!("bad-input:{}", Uuid::new_v4()))?;
    let stream = StreamId::new_v7();
    let mut n = 0;
    for timeout in [
        Duration::from_millis(i32::MAX as u64 + 1),
        DAY * 25,
        YEAR,
        Duration::MAX,
    ] {
        n += 2;
        let ftx = ctx.fake_db.begin_now();
        let tx = PgTransaction::begin(&ctx.pool).await?;
        let fake = ctx
            .fake_lock
            .acquire_for_transaction(&ftx, &key, Some(timeout))
            .await;
        let pg = ctx
            .lock
            .acquire_for_transaction(&tx, &key, Some(timeout))
            .await;
        same_kind(
            &mut p,
            &format!("acquire waiting {timeout:?}"),
            &fake,
            &pg,
            Some(ErrorKind::InvalidInput),
        );
        let fake =
            EventStore::load_locked(&ctx.fake_store, &ftx, stream, &key, Some(timeout)).await;
        let pg = EventStore::load_locked(&ctx.store, &tx, stream, &key, Some(timeout)).await;
        same_kind(
            &mut p,
            &format!("load_locked waiting {timeout:?}"),
            &fake,
            &pg,
            Some(ErrorKind::InvalidInput),
        );
        ftx.rollback().await.expect("rollback");
        tx.rollback().await?;
    }
    Ok((n, p))
}

/// Appends the stores refuse: no events, one id twice, an expected version no row can hold.
async fn append_case(ctx: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let event = number_event(7);
    let cases: Vec<(&str, Vec<NewEvent>, ExpectedVersion)> = vec![
        ("no events", vec![], ExpectedVersion::Any),
        (
            "one id twice",
            vec![event.clone(), event.clone()],
            ExpectedVersion::Any,
        ),
        (
            "expected version u64::MAX",
            vec![number_event(8)],
            ExpectedVersion::Exact(u64::MAX),
        ),
        (
            "expected version 2^63",
            vec![number_event(9)],
            ExpectedVersion::Exact(1 << 63),
        ),
    ];
    let n = cases.len() as u64;
    for (what, events, expected) in cases {
        let stream = StreamId::new_v7();
        let ftx = ctx.fake_db.begin_now();
        let tx = PgTransaction::begin(&ctx.pool).await?;
        let fake = EventStore::append(&ctx.fake_store, &ftx, stream, expected, &events).await;
        let pg = EventStore::append(&ctx.store, &tx, stream, expected, &events).await;
        let want = match expected {
            // Nothing can be at that version: a conflict or a refusal, but the same on both.
            ExpectedVersion::Exact(v) if v > 0 => None,
            _ => Some(ErrorKind::InvalidInput),
        };
        match want {
            Some(_) => same_kind(&mut p, what, &fake, &pg, want),
            None => {
                if fake.is_ok()
                    || pg.is_ok()
                    || fake.as_ref().err().map(Error::kind) != pg.as_ref().err().map(Error::kind)
                {
                    p.push(format!(
                        "{what}: the fake answered {fake:?}, Postgres {pg:?}"
                    ));
                }
            }
        }
        // Committing what is left must store nothing either.
        let _ = ftx.commit().await;
        let _ = tx.commit().await;
    }
    Ok((n, p))
}

/// A lock in a REPEATABLE READ transaction is refused before any lock is taken (Postgres only:
/// the fake has no isolation levels).
async fn isolation_case(ctx: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let key = ResourceKey::new(format!("bad-input:{}", Uuid::new_v4()))?;
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        let tx = PgTransaction::begin(&ctx.pool).await?;
        tx.client()
            .batch_execute(&format!("SET TRANSACTION ISOLATION LEVEL {level}"))
            .await?;
        let r = ctx
            .lock
            .acquire_for_transaction(&tx, &key, Some(Duration::from_secs(1)))
            .await;
        refused(
            &mut p,
            &format!("acquire in {level}"),
            r,
            ErrorKind::Unsupported,
            None,
        );
        let r = ctx.lock.try_acquire_for_transaction(&tx, &key).await;
        refused(
            &mut p,
            &format!("try in {level}"),
            r,
            ErrorKind::Unsupported,
            None,
        );
        let r = EventStore::load_locked(&ctx.store, &tx, StreamId::new_v7(), &key, None).await;
        refused(
            &mut p,
            &format!("load_locked in {level}"),
            r,
            ErrorKind::Unsupported,
            None,
        );
        let _ = tx.rollback().await;
    }
    Ok((6, p))
}

/// `with_local_patience(Duration::MAX)` with a waiter queued in process: a bounded wait ends
/// with a lock timeout, never an overflow panic.
async fn patience_case(ctx: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let key = ResourceKey::new(format!("bad-input:{}", Uuid::new_v4()))?;
    let queue = LockQueue::new().with_local_patience(Duration::MAX);
    let lock = PgDistributedLock::with_queue(ctx.pool.clone(), queue);
    let holder = PgTransaction::begin(&ctx.pool).await?;
    lock.acquire_for_transaction(&holder, &key, Some(Duration::from_secs(5)))
        .await?;
    // Two waiters: the first waits at the server, the second in the process's queue.
    let (a, b) = (
        PgTransaction::begin(&ctx.pool).await?,
        PgTransaction::begin(&ctx.pool).await?,
    );
    let wait = Some(Duration::from_millis(300));
    let (ra, rb) = tokio::join!(
        lock.acquire_for_transaction(&a, &key, wait),
        lock.acquire_for_transaction(&b, &key, wait)
    );
    refused(
        &mut p,
        "first waiter behind a holder",
        ra,
        ErrorKind::LockTimeout,
        None,
    );
    refused(
        &mut p,
        "queued waiter with endless patience",
        rb,
        ErrorKind::LockTimeout,
        None,
    );
    for tx in [holder, a, b] {
        let _ = tx.rollback().await;
    }
    Ok((2, p))
}

/// Odd but valid calls that must answer the same on both sides and change nothing: a lease id
/// nobody holds, a pair without a cursor, empty and huge batches, release-all of a stranger.
async fn nobody_case(ctx: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let stranger = InstanceId::random();
    let ghost = LeaseId::new(
        ctx.pair,
        ctx.perspective.clone(),
        stranger,
        LeaseEpoch::new(1),
    );
    let mut wrong_epoch = ghost.clone();
    wrong_epoch.holder = ctx.holder;
    wrong_epoch.epoch = LeaseEpoch::new(i64::MAX);
    let mut no_cursor = ghost.clone();
    no_cursor.stream_id = StreamId::new_v7();
    let mut n = 0;
    for (what, id) in [
        ("a stranger's lease", &ghost),
        ("a wrong epoch", &wrong_epoch),
        ("no cursor", &no_cursor),
    ] {
        n += 2;
        let fake = ctx.fake_locker.renew(id).await.map(|o| o.is_renewed());
        let pg = ctx.locker.renew(id).await.map(|o| o.is_renewed());
        same_kind(&mut p, &format!("renew of {what}"), &fake, &pg, None);
        if fake.as_ref().ok() != Some(&false) || pg.as_ref().ok() != Some(&false) {
            p.push(format!("renew of {what}: renewed ({fake:?}, {pg:?})"));
        }
        let fake = ctx.fake_locker.release(id).await.map(|o| o.is_released());
        let pg = ctx.locker.release(id).await.map(|o| o.is_released());
        if fake.as_ref().ok() != Some(&false) || pg.as_ref().ok() != Some(&false) {
            p.push(format!("release of {what}: released ({fake:?}, {pg:?})"));
        }
    }
    n += 1;
    let fake = ctx
        .fake_locker
        .try_acquire(
            StreamId::new_v7(),
            &ctx.perspective,
            stranger,
            &LockReason::Rewind,
        )
        .await;
    let pg = ctx
        .locker
        .try_acquire(
            StreamId::new_v7(),
            &ctx.perspective,
            stranger,
            &LockReason::Rewind,
        )
        .await;
    if !matches!(
        (&fake, &pg),
        (Ok(AcquireOutcome::NoCursor), Ok(AcquireOutcome::NoCursor))
    ) {
        p.push(format!("try-acquire without a cursor: {fake:?} / {pg:?}"));
    }
    for size in [0usize, 5000] {
        n += 1;
        let ids: Vec<LeaseId> = (0..size)
            .map(|_| {
                let mut id = ghost.clone();
                id.stream_id = StreamId::new_v7();
                id
            })
            .collect();
        let fake = ctx.fake_locker.renew_many(&ids).await;
        let pg = ctx.locker.renew_many(&ids).await;
        fn renewed(
            r: &Result<Vec<lockstep_core::RenewOutcome>, Error>,
        ) -> Result<(usize, usize), ErrorKind> {
            r.as_ref()
                .map(|v| (v.len(), v.iter().filter(|o| o.is_renewed()).count()))
                .map_err(Error::kind)
        }
        let (f, g) = (renewed(&fake), renewed(&pg));
        if f.as_ref().ok() != Some(&(size, 0)) || g.as_ref().ok() != Some(&(size, 0)) {
            p.push(format!(
                "renew_many of {size} unknown leases: {f:?} / {g:?}"
            ));
        }
    }
    n += 1;
    let fake = ctx.fake_locker.release_all_held_by(stranger).await;
    let pg = ctx.locker.release_all_held_by(stranger).await;
    if fake.as_ref().ok() != Some(&0) || pg.as_ref().ok() != Some(&0) {
        p.push(format!("release-all of a stranger: {fake:?} / {pg:?}"));
    }
    Ok((n, p))
}

/// Stored values lockstep cannot read: every reading operation is a typed error naming what it
/// could not read, never a panic, and nothing is written.
async fn stored_case(ctx: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let holder = Uuid::now_v7();
    let stored: [(&str, &str, Uuid); 5] = [
        (
            "an infinite expiry",
            "stream_lock_expiry = 'infinity'",
            holder,
        ),
        (
            "a minus-infinite expiry",
            "stream_lock_expiry = '-infinity'",
            holder,
        ),
        ("a blank reason", "stream_lock_reason = ''", holder),
        (
            "a nil holder",
            "stream_lock_instance_id = '00000000-0000-0000-0000-000000000000'",
            holder,
        ),
        (
            "a reason of only spaces",
            "stream_lock_reason = repeat(' ', 50)",
            holder,
        ),
    ];
    let mut n = 0;
    for (what, set, holder) in stored {
        let stream = StreamId::new_v7();
        let name = ctx.perspective.as_str();
        ctx.observer
            .execute(
                "INSERT INTO wh_perspective_cursors (stream_id, perspective_name, \
                   stream_lock_instance_id, stream_lock_reason, stream_lock_expiry, \
                   stream_lock_epoch) \
                 VALUES ($1, $2, $3, 'rewind', clock_timestamp() + interval '1 hour', 1)",
                &[&stream.as_uuid(), &name, &holder],
            )
            .await?;
        let stored = ctx
            .observer
            .execute(
                &format!("UPDATE wh_perspective_cursors SET {set} WHERE stream_id = $1"),
                &[&stream.as_uuid()],
            )
            .await;
        if let Err(e) = stored {
            // The schema refusing to store the value (a CHECK constraint) is as good as it
            // gets; anything else is the case's own failure.
            n += 1;
            if e.code() != Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION) {
                return Err(e.into());
            }
            ctx.observer
                .execute(
                    "DELETE FROM wh_perspective_cursors WHERE stream_id = $1",
                    &[&stream.as_uuid()],
                )
                .await?;
            continue;
        }
        let before = checksum(&ctx.observer).await?;
        let other = InstanceId::random();
        let mut unreadable = |op: &str, r: Result<String, Error>| {
            n += 1;
            match r {
                // A minus-infinite expiry is simply expired: a takeover is a valid reading.
                Ok(v) if what == "a minus-infinite expiry" && op == "try-acquire" => {
                    let _ = v;
                }
                Ok(v) => p.push(format!("{op} with {what}: read as {v}")),
                Err(e) if e.kind() != ErrorKind::Backend => {
                    p.push(format!(
                        "{op} with {what}: {:?} instead of Backend: {e}",
                        e.kind()
                    ));
                }
                Err(_) => {}
            }
        };
        let listed = ctx.locker.list_leases().await.map(|l| format!("{l:?}"));
        unreadable("list_leases", listed);
        let inspected = ctx
            .locker
            .inspect(stream, &ctx.perspective)
            .await
            .map(|l| format!("{l:?}"));
        unreadable("inspect", inspected);
        let tried = ctx
            .locker
            .try_acquire(stream, &ctx.perspective, other, &LockReason::Rewind)
            .await
            .map(|o| format!("{o:?}"));
        let took_over = tried.is_ok();
        unreadable("try-acquire", tried);
        if !took_over {
            let after = checksum(&ctx.observer).await?;
            if after != before {
                p.push(format!(
                    "reading {what} changed the tables: {}",
                    diff(&before, &after)
                ));
            }
        }
        ctx.observer
            .execute(
                "DELETE FROM wh_perspective_cursors WHERE stream_id = $1",
                &[&stream.as_uuid()],
            )
            .await?;
    }
    Ok((n, p))
}

/// The accepted limits work end to end, the same on both sides.
async fn limits_case(ctx: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let options =
        StreamLockOptions::new(StreamLockOptions::MAX_LOCK_TIMEOUT, Duration::from_secs(60))?;
    let pg = PgStreamLocker::from_pool(ctx.pool.clone(), options);
    let fake = InMemoryStreamLocker::new(options);
    let name = PerspectiveName::new("é".repeat(PerspectiveName::MAX_CHARS))?;
    let reason = LockReason::custom("ü".repeat(LockReason::MAX_CHARS))?;
    let stream = StreamId::new_v7();
    insert_cursor(&ctx.observer, stream, &name).await?;
    fake.create_cursor(stream, &name);
    let me = InstanceId::random();
    let a = fake.try_acquire(stream, &name, me, &reason).await;
    let b = pg.try_acquire(stream, &name, me, &reason).await;
    match (&a, &b) {
        (Ok(AcquireOutcome::Acquired(x)), Ok(AcquireOutcome::Acquired(y)))
            if x.id.epoch == y.id.epoch && x.reason == y.reason => {}
        _ => p.push(format!("longest timeout, name and reason: {a:?} / {b:?}")),
    }
    let denied_fake = fake
        .try_acquire(stream, &name, InstanceId::random(), &reason)
        .await;
    let denied_pg = pg
        .try_acquire(stream, &name, InstanceId::random(), &reason)
        .await;
    same_kind(
        &mut p,
        "denial of a century-long lease",
        &denied_fake,
        &denied_pg,
        None,
    );
    if let (Ok(x), Ok(y)) = (&denied_fake, &denied_pg)
        && (x.is_acquired() || y.is_acquired())
    {
        p.push("a century-long lease was taken over".to_owned());
    }
    let listed = pg.list_leases().await;
    if listed.is_err() {
        p.push(format!("listing a century-long lease: {listed:?}"));
    }
    let key = ResourceKey::new("k".repeat(ResourceKey::MAX_BYTES))?;
    let ftx = ctx.fake_db.begin_now();
    let tx = PgTransaction::begin(&ctx.pool).await?;
    let longest = Some(lockstep_testkit::fake_lock::MAX_LOCK_TIMEOUT);
    let f = ctx
        .fake_lock
        .acquire_for_transaction(&ftx, &key, longest)
        .await;
    let g = ctx.lock.acquire_for_transaction(&tx, &key, longest).await;
    same_kind(
        &mut p,
        "the longest key, waiting the longest timeout",
        &f,
        &g,
        None,
    );
    ftx.rollback().await.expect("rollback");
    tx.rollback().await?;
    // Leave no lease behind for the checksummed cases.
    ctx.observer
        .execute(
            "DELETE FROM wh_perspective_cursors WHERE stream_id = $1",
            &[&stream.as_uuid()],
        )
        .await?;
    Ok((4, p))
}

/// A database that was never migrated: typed errors saying to run the migrations, nothing
/// created.
async fn unmigrated_case() -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let db = test_database().await;
    let pool = db.pool(3);
    let observer = db.connect().await;
    let before = checksum(&observer).await?;
    let locker = PgStreamLocker::from_pool(pool.clone(), long_options()?);
    let lock = PgDistributedLock::from_pool(pool.clone());
    let store = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let name = PerspectiveName::new("Unmigrated")?;
    let (stream, me) = (StreamId::new_v7(), InstanceId::random());
    let id = LeaseId::new(stream, name.clone(), me, LeaseEpoch::new(1));
    let key = ResourceKey::new("unmigrated")?;
    let mut results: Vec<(&str, Result<String, Error>)> = vec![
        (
            "try-acquire",
            locker
                .try_acquire(stream, &name, me, &LockReason::Rewind)
                .await
                .map(|o| format!("{o:?}")),
        ),
        ("renew", locker.renew(&id).await.map(|o| format!("{o:?}"))),
        (
            "renew_many",
            locker
                .renew_many(std::slice::from_ref(&id))
                .await
                .map(|o| format!("{o:?}")),
        ),
        (
            "release",
            locker.release(&id).await.map(|o| format!("{o:?}")),
        ),
        (
            "list_leases",
            locker.list_leases().await.map(|o| format!("{o:?}")),
        ),
        (
            "force_release",
            locker
                .force_release(stream, &name)
                .await
                .map(|o| format!("{o:?}")),
        ),
    ];
    for (what, op) in [
        ("append", 0),
        ("load_locked", 1),
        ("acquire", 2),
        ("try", 3),
        ("load", 4),
    ] {
        let tx = PgTransaction::begin(&pool)
            .await
            .context("begin on an unmigrated database")?;
        let r = match op {
            0 => EventStore::append(
                &store,
                &tx,
                stream,
                ExpectedVersion::Any,
                &[number_event(1)],
            )
            .await
            .map(|v| format!("{v}")),
            1 => EventStore::load_locked(&store, &tx, stream, &key, None)
                .await
                .map(|v| format!("{v:?}")),
            2 => lock
                .acquire_for_transaction(&tx, &key, None)
                .await
                .map(|v| format!("{v:?}")),
            3 => lock
                .try_acquire_for_transaction(&tx, &key)
                .await
                .map(|v| format!("{v:?}")),
            _ => EventStore::load(&store, &tx, stream)
                .await
                .map(|v| format!("{v:?}")),
        };
        results.push((what, r));
        let _ = tx.rollback().await;
    }
    let n = results.len() as u64;
    for (what, r) in results {
        match r {
            Ok(v) => p.push(format!("{what} on an unmigrated database answered {v}")),
            Err(e) => {
                let shown = e.to_string();
                if !shown.contains("migrat") {
                    p.push(format!("{what} on an unmigrated database does not say to run the migrations: {shown}"));
                }
            }
        }
    }
    let after = checksum(&observer).await?;
    if after != before {
        p.push(format!(
            "operations on an unmigrated database created: {}",
            diff(&before, &after)
        ));
    }
    Ok((n, p))
}

/// Random durations and lengths around every bound: accepted exactly when within it.
async fn random_case(_: Arc<Ctx>) -> anyhow::Result<(u64, Problems)> {
    let mut p = Problems::new();
    let mut rng = rand::rng();
    let mut n = 0;
    let max = StreamLockOptions::MAX_LOCK_TIMEOUT;
    for _ in 0..50 {
        n += 1;
        let timeout = match rng.random_range(0..4) {
            0 => Duration::from_nanos(rng.random_range(0..3_000_000)),
            1 => max
                .saturating_add(Duration::from_micros(rng.random_range(0..3)))
                .saturating_sub(Duration::from_micros(1)),
            2 => Duration::new(
                rng.random_range(0..u64::MAX),
                rng.random_range(0..1_000_000_000),
            ),
            _ => Duration::from_millis(rng.random_range(1..100_000)),
        };
        let keepalive =
            Duration::from_nanos(rng.random_range(0..u64::MAX)) / rng.random_range(1..1_000_000);
        let ok = timeout >= StreamLockOptions::MIN_DURATION
            && keepalive >= StreamLockOptions::MIN_DURATION
            && timeout <= max
            && keepalive.saturating_mul(2) < timeout;
        match StreamLockOptions::new(timeout, keepalive) {
            Ok(_) if !ok => p.push(format!(
                "StreamLockOptions::new({timeout:?}, {keepalive:?}) accepted"
            )),
            Err(e) if ok => p.push(format!(
                "StreamLockOptions::new({timeout:?}, {keepalive:?}) refused: {e}"
            )),
            Err(e) if e.kind() != ErrorKind::InvalidInput || e.validation().is_none() => {
                p.push(format!(
                    "StreamLockOptions::new({timeout:?}, {keepalive:?}): untyped {e}"
                ));
            }
            _ => {}
        }
        n += 1;
        let chars = rng.random_range(0..260);
        let text: String = (0..chars)
            .map(|_| if rng.random_bool(0.5) { 'é' } else { 'x' })
            .collect();
        let cases = [
            (
                "perspective name",
                PerspectiveName::new(text.clone()).is_ok(),
                (1..=PerspectiveName::MAX_CHARS).contains(&chars),
            ),
            (
                "reason",
                LockReason::custom(text.clone()).is_ok(),
                (1..=LockReason::MAX_CHARS).contains(&chars),
            ),
            (
                "aggregate type",
                AggregateType::new(text.clone()).is_ok(),
                (1..=AggregateType::MAX_CHARS).contains(&chars),
            ),
            (
                "resource key",
                ResourceKey::new(text.clone()).is_ok(),
                !text.is_empty() && text.len() <= ResourceKey::MAX_BYTES,
            ),
        ];
        for (what, accepted, within) in cases {
            if accepted != within {
                p.push(format!(
                    "{what} of {chars} characters: accepted={accepted}, within bounds={within}"
                ));
            }
        }
    }
    Ok((n, p))
}

/// Deliberately changed state must show in the checksum, and a wrong answer in the kind
/// checks: returns the checks that did not fire (none expected).
pub async fn demonstrate_checks() -> anyhow::Result<Vec<String>> {
    let ctx = Ctx::new().await?;
    let mut missed = Vec::new();
    let before = ctx.fingerprint().await?;
    ctx.observer
        .execute(
            "UPDATE wh_perspective_cursors SET stream_lock_epoch = stream_lock_epoch WHERE false",
            &[],
        )
        .await?;
    if ctx.fingerprint().await? != before {
        missed.push("the checksum changed without a change".to_owned());
    }
    // One changed column of one row.
    ctx.observer
        .execute(
            "UPDATE wh_perspective_cursors SET stream_lock_reason = 'purge' WHERE stream_id = $1",
            &[&ctx.pair.as_uuid()],
        )
        .await?;
    if ctx.fingerprint().await? == before {
        missed.push("the checksum missed a changed reason".to_owned());
    }
    // A change on the fake side only.
    let mid = ctx.fingerprint().await?;
    ctx.fake_locker
        .create_cursor(StreamId::new_v7(), &ctx.perspective);
    let _ = ctx
        .fake_locker
        .try_acquire(
            ctx.pair,
            &ctx.perspective,
            InstanceId::random(),
            &LockReason::Rewind,
        )
        .await;
    let _ = ctx
        .fake_locker
        .force_release(ctx.pair, &ctx.perspective)
        .await?;
    if ctx.fingerprint().await? == mid {
        missed.push("the fingerprint missed a change to the fake".to_owned());
    }
    // A wrong kind, an accepted bad input, a fake that disagrees.
    let mut p = Problems::new();
    refused(
        &mut p,
        "wrong kind",
        Err::<(), _>(Error::new(ErrorKind::Backend, "x")),
        ErrorKind::InvalidInput,
        None,
    );
    refused(
        &mut p,
        "accepted",
        Ok::<_, Error>(()),
        ErrorKind::InvalidInput,
        None,
    );
    refused(
        &mut p,
        "wrong validation",
        Err::<(), _>(ValidationError::BlankReason.into()),
        ErrorKind::InvalidInput,
        Some(ValidationError::BlankEventType),
    );
    same_kind(
        &mut p,
        "disagreeing fake",
        &Ok::<_, Error>(()),
        &Err::<(), _>(Error::new(ErrorKind::InvalidInput, "x")),
        Some(ErrorKind::InvalidInput),
    );
    if p.len() != 4 {
        missed.push(format!(
            "the kind checks fired {} times of 4: {p:?}",
            p.len()
        ));
    }
    Ok(missed)
}
