//! Mutual-exclusion audit on the database clock (issue 8's suite, part 2).
//!
//! Several instances (each with a pool and an [`InstanceId`] of its own, as separate processes
//! would have) run one task per `(stream, perspective)` pair on a shared database, with a short
//! lock timeout so that leases really expire and are taken over. Each task loops:
//!
//! 1. **try-acquire** with [`PgStreamLocker`]; a denial or a busy row backs off;
//! 2. **hold** for a random time: mostly a few milliseconds, sometimes longer than the keepalive
//!    interval (with one renew in the middle), sometimes a **stall** longer than the lock timeout
//!    without renewing, so the lease expires and another instance takes it over;
//! 3. a **fenced commit**: a transaction fenced by [`LeaseFence::check_lease`] (what the worker
//!    uses) that inserts `(attempt, pair, instance, epoch, transaction start,
//!    clock_timestamp())`. After a stall the fence must refuse it. Sometimes the stall happens
//!    *inside* the fenced transaction, after the check: the row lock the fence holds must keep
//!    every successor out until it commits;
//! 4. **release** — or, after a stall, only half of the time (the other half leaves the expired
//!    lease to be taken over).
//!
//! Every acquired lease is one case. What is checked, from the database's own records (a
//! trigger logs every update of a cursor row, in the row's update order, with
//! `clock_timestamp()`; and the fenced records):
//!
//! - **the row's history** ([`audit_history`]): each update continues from the previous one; no
//!   update replaces a live lease by another holder; the epoch rule holds on every update (kept
//!   only when the holder refreshes its own live lease, +1 otherwise, kept on release) so epochs
//!   only grow; the holder intervals rebuilt from it (grant → release, takeover or the end)
//!   never overlap on the database clock (an interval's right ends at its release or its last
//!   expiry, whichever comes first) and their epochs strictly grow;
//! - **the fenced records** ([`audit_records`]): each belongs to the holder of its epoch and lies
//!   between that epoch's grant and its end (release, or the successor's grant); none comes from
//!   a transaction that began after its lease had expired (the fence must have refused it);
//!   none was written by a stalled holder; in time order the epochs of one pair never go back
//!   (no interleaved critical sections);
//! - **what the callers were told** ([`audit_told`]): every grant is the history's, and every
//!   interval was granted to someone who was told (no ghost lease); every `Released` ended its
//!   interval; every acknowledged fenced commit is in the table (else it is *lost*) and no
//!   refused one is.
//!
//! The checks are shown to fail on synthetic histories (overlap, epoch going down, stale and
//! misplaced records) and on a real run whose holders skip the fence ([`Fence::Skipped`]), in
//! `tests/tests/reliability_audit.rs`.
//!
//! The audit runs on either driver ([`AuditConfig::driver`]): each instance's pool is a deadpool
//! pool with a [`PgStreamLocker::from_pool`] and [`PgTransaction`]s, or an `sqlx::PgPool` with a
//! [`PgStreamLocker::for_sqlx`] and [`SqlxTransaction`]s; the racers, the fenced commit (the fence
//! and the insert go through the driver seam) and every check are the same code.
//!
//! Times are microseconds since the Unix epoch on the database clock ([`Micros`]), converted in
//! SQL, so the audit does no date arithmetic of its own.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lockstep_core::{
    AcquireOutcome, ErrorKind, InstanceId, LeaseFence, LockReason, PerspectiveName, ReleaseOutcome,
    RenewOutcome, StreamId, StreamLease, StreamLockOptions, StreamLocker,
};
use lockstep_core::{Transaction, TransactionSource};
use lockstep_pg::PgTransaction;
use lockstep_pg::driver::Executor;
use lockstep_pg::sqlx::{SqlxDatabase, SqlxTransaction};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::test_database;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;
use uuid::Uuid;

use super::{Driver, Scale, Tally};

/// Microseconds since the Unix epoch, on the database clock.
pub type Micros = i64;

/// The audit's tables: the row-history trigger on `wh_perspective_cursors` and the fenced
/// records. The sequence number is taken inside the updating statement, while the row lock is
/// held, so one row's updates are numbered in the order they happened.
const AUDIT_SCHEMA: &str = "
CREATE TABLE audit_lease_log (
    seq              bigint      PRIMARY KEY,
    stream_id        uuid        NOT NULL,
    perspective_name text        NOT NULL,
    at               timestamptz NOT NULL,
    old_holder uuid, old_expiry timestamptz, old_epoch bigint NOT NULL,
    new_holder uuid, new_expiry timestamptz, new_epoch bigint NOT NULL
);
CREATE SEQUENCE audit_lease_log_seq;
CREATE FUNCTION audit_log_lease_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO audit_lease_log VALUES (
        nextval('audit_lease_log_seq'), NEW.stream_id, NEW.perspective_name, clock_timestamp(),
        OLD.stream_lock_instance_id, OLD.stream_lock_expiry, OLD.stream_lock_epoch,
        NEW.stream_lock_instance_id, NEW.stream_lock_expiry, NEW.stream_lock_epoch);
    RETURN NEW;
END $$;
CREATE TRIGGER audit_log_lease_change AFTER UPDATE ON wh_perspective_cursors
    FOR EACH ROW EXECUTE FUNCTION audit_log_lease_change();
CREATE TABLE audit_fenced (
    attempt          uuid        PRIMARY KEY,
    stream_id        uuid        NOT NULL,
    perspective_name text        NOT NULL,
    instance         uuid        NOT NULL,
    epoch            bigint      NOT NULL,
    stalled          boolean     NOT NULL,
    tx_start         timestamptz NOT NULL DEFAULT now(),
    at               timestamptz NOT NULL DEFAULT clock_timestamp()
);";

/// `timestamptz` → [`Micros`] in SQL (`extract` is exact `numeric` since PostgreSQL 14).
macro_rules! micros {
    ($col:literal) => {
        concat!("floor(extract(epoch FROM ", $col, ") * 1000000)::bigint")
    };
}

const LOAD_HISTORY: &str = concat!(
    "SELECT seq, stream_id, perspective_name, ",
    micros!("at"),
    ", old_holder, ",
    micros!("old_expiry"),
    ", old_epoch, new_holder, ",
    micros!("new_expiry"),
    ", new_epoch FROM audit_lease_log ORDER BY seq"
);

const LOAD_RECORDS: &str = concat!(
    "SELECT attempt, stream_id, perspective_name, instance, epoch, stalled, ",
    micros!("tx_start"),
    ", ",
    micros!("at"),
    " FROM audit_fenced ORDER BY at, epoch"
);

/// Every wait on the database is bounded by this (plus any deliberate stall).
const OP_LIMIT: Duration = Duration::from_secs(10);
/// How long the run waits for a task to stop once told to.
const JOIN_LIMIT: Duration = Duration::from_secs(30);

/// Whether the holders fence their commits: [`Fence::Skipped`] is a deliberately broken holder
/// that writes without [`LeaseFence::check_lease`], to show that the audit catches the stale
/// commits it lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// Every commit checks the lease first (the real thing).
    Checked,
    /// No check (broken on purpose).
    Skipped,
}

/// The audit's knobs; [`AuditConfig::new`] gives the short or long run.
#[derive(Debug, Clone)]
pub struct AuditConfig {
    /// Instances (pools and instance ids); each runs one task per pair.
    pub instances: usize,
    /// Streams; each has one cursor row per perspective.
    pub streams: usize,
    /// Perspectives per stream.
    pub perspectives: usize,
    /// The lease's lock timeout (short, so stalls outlive it).
    pub lock_timeout: Duration,
    /// The keepalive interval; holds longer than this renew once.
    pub keepalive: Duration,
    /// Stop once this many leases were acquired …
    pub target_cycles: u64,
    /// … or after this long, whichever comes first.
    pub max_duration: Duration,
    /// Chance that a hold stalls past the lock timeout before its fenced commit.
    pub stall_probability: f64,
    /// Chance that a hold stalls past the lock timeout inside its fenced transaction.
    pub fenced_stall_probability: f64,
    /// Chance that a hold outlasts the keepalive interval (and renews once).
    pub long_hold_probability: f64,
    /// Whether the holders fence their commits.
    pub fence: Fence,
    /// Seed of the tasks' random choices (the interleaving itself is not reproducible).
    pub seed: u64,
    /// The driver the instances' pools, lockers and fenced transactions run on.
    pub driver: Driver,
}

impl AuditConfig {
    /// Short: a few seconds, some hundreds of lease cycles. Long: at least 10 000 cycles.
    pub fn new(scale: Scale) -> AuditConfig {
        let (target_cycles, max_duration) = match scale {
            Scale::Short => (600, Duration::from_secs(5)),
            Scale::Long => (12_000, Duration::from_secs(20 * 60)),
        };
        AuditConfig {
            instances: 3,
            streams: 4,
            perspectives: 2,
            lock_timeout: Duration::from_millis(500),
            keepalive: Duration::from_millis(200),
            target_cycles,
            max_duration,
            stall_probability: 0.02,
            fenced_stall_probability: 0.01,
            long_hold_probability: 0.1,
            fence: Fence::Checked,
            seed: rand::random(),
            driver: Driver::TokioPostgres,
        }
    }

    fn pairs(&self) -> usize {
        self.streams.saturating_mul(self.perspectives)
    }
}

/// The figures of a run, beyond the [`Tally`].
#[derive(Debug, Default, Clone)]
pub struct AuditStats {
    /// Instances that raced.
    pub instances: usize,
    /// `(stream, perspective)` pairs they raced on.
    pub pairs: usize,
    /// Leases acquired (the cases).
    pub cycles: u64,
    /// Leases established by replacing an expired, uncleared one (from the row history).
    pub takeovers: u64,
    /// Updates of cursor rows logged by the trigger.
    pub row_updates: u64,
    /// Holds that stalled past the lock timeout before their fenced commit.
    pub stalls: u64,
    /// Fenced commits of stalled holders that the fence refused (as it must).
    pub refused_stale: u64,
    /// Holds that stalled past the lock timeout inside their fenced transaction (which then
    /// committed, the row lock keeping every successor out).
    pub fenced_stalls: u64,
    /// Fenced records committed.
    pub fenced_commits: u64,
    /// Fenced commits refused although the holder did not stall (its lease expired under load).
    pub refused_unstalled: u64,
    /// Renews that extended the lease.
    pub renewed: u64,
    /// Renews that found the lease lost.
    pub renew_lost: u64,
    /// Releases that found the lease no longer held (it had expired and was taken over).
    pub release_not_held: u64,
    /// Try-acquires denied by a live lease.
    pub denied: u64,
    /// Try-acquires that found the row busy (locked by a fenced transaction or a statement).
    pub busy: u64,
    /// Acquires that joined the task's own live lease (after a release that failed).
    pub reentered: u64,
    /// Retryable errors other than a busy row (a pool checkout that timed out under load).
    pub transient_errors: u64,
    /// The random seed.
    pub seed: u64,
    /// How long the racing ran.
    pub duration: Duration,
}

impl fmt::Display for AuditStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "audit: {} instances x {} pairs, {} lease cycles in {:.1} s; {} takeovers, {} stalls \
             ({} stale commits refused), {} fenced stalls, {} fenced commits, {} refused without \
             a stall, {} renews ({} lost), {} releases not held, {} denials, {} busy, {} \
             transient errors, {} row updates audited (seed {})",
            self.instances,
            self.pairs,
            self.cycles,
            self.duration.as_secs_f64(),
            self.takeovers,
            self.stalls,
            self.refused_stale,
            self.fenced_stalls,
            self.fenced_commits,
            self.refused_unstalled,
            self.renewed,
            self.renew_lost,
            self.release_not_held,
            self.denied,
            self.busy,
            self.transient_errors,
            self.row_updates,
            self.seed,
        )
    }
}

/// A run's tally and figures.
#[derive(Debug, Clone)]
pub struct AuditReport {
    /// Cases and what went wrong.
    pub tally: Tally,
    /// The figures.
    pub stats: AuditStats,
}

/// One update of a cursor row, as the trigger logged it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Position in the row's update order.
    pub seq: i64,
    /// When the update ran.
    pub at: Micros,
    /// The lease before the update.
    pub old_holder: Option<Uuid>,
    /// Its expiry.
    pub old_expiry: Option<Micros>,
    /// Its epoch.
    pub old_epoch: i64,
    /// The lease after the update.
    pub new_holder: Option<Uuid>,
    /// Its expiry.
    pub new_expiry: Option<Micros>,
    /// Its epoch.
    pub new_epoch: i64,
}

/// How a holder interval ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The holder released it.
    Released(Micros),
    /// Another grant replaced the expired lease.
    TakenOver(Micros),
    /// An operator force-released it (epoch + 1).
    ForceReleased(Micros),
}

impl End {
    /// When.
    pub fn at(self) -> Micros {
        match self {
            End::Released(at) | End::TakenOver(at) | End::ForceReleased(at) => at,
        }
    }
}

/// One holder's lease of a pair at one epoch, rebuilt from the row's history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interval {
    /// The holder.
    pub holder: Uuid,
    /// The epoch.
    pub epoch: i64,
    /// When it was granted.
    pub from: Micros,
    /// `(when, expiry)` for the grant and each refresh (renew or re-acquire), in order.
    pub expiries: Vec<(Micros, Micros)>,
    /// How it ended; `None` while it was still set at the end of the run.
    pub end: Option<End>,
}

impl Interval {
    /// The expiry in force at `t`: the one set by the last grant or refresh at or before `t`.
    pub fn expiry_as_of(&self, t: Micros) -> Option<Micros> {
        self.expiries
            .iter()
            .take_while(|(set_at, _)| *set_at <= t)
            .last()
            .map(|&(_, expiry)| expiry)
    }

    /// When the holder's right ended on the database clock: its release (or force-release) or
    /// its last expiry, whichever came first. A takeover comes after the expiry, which is then
    /// the end of the right.
    pub fn right_until(&self) -> Option<Micros> {
        let expiry = self.expiries.last().map(|&(_, expiry)| expiry);
        match (self.end, expiry) {
            (Some(End::Released(at) | End::ForceReleased(at)), Some(e)) => Some(at.min(e)),
            (Some(end), None) => Some(end.at()),
            (_, expiry) => expiry,
        }
    }
}

/// The intervals of one pair, and how many grants were takeovers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct History {
    /// In grant order.
    pub intervals: Vec<Interval>,
    /// Grants that replaced an expired, uncleared lease.
    pub takeovers: u64,
}

/// Checks one row's history (in update order) and rebuilds its holder intervals; every broken
/// rule is a violation in `tally`, prefixed with `label`.
pub fn audit_history(label: &str, changes: &[Change], tally: &mut Tally) -> History {
    let mut history = History::default();
    let mut previous: Option<&Change> = None;
    for c in changes {
        if let Some(p) = previous {
            // A complete, serial history: each update starts from the previous one's result.
            if (c.old_holder, c.old_expiry, c.old_epoch)
                != (p.new_holder, p.new_expiry, p.new_epoch)
            {
                tally.violation(format!(
                    "{label}: update {} does not continue from update {}",
                    c.seq, p.seq
                ));
            }
            if c.at < p.at {
                tally.violation(format!(
                    "{label}: update {}: the database clock went backwards",
                    c.seq
                ));
            }
        }
        previous = Some(c);
        if c.new_epoch < c.old_epoch {
            tally.violation(format!(
                "{label}: update {}: the epoch went down from {} to {}",
                c.seq, c.old_epoch, c.new_epoch
            ));
        }
        let old_live = match (c.old_holder, c.old_expiry) {
            (Some(_), Some(expiry)) => expiry > c.at,
            _ => false,
        };
        match c.new_holder {
            Some(new_holder) => {
                if old_live && c.old_holder != Some(new_holder) {
                    tally.violation(format!(
                        "{label}: update {}: the live lease of {:?} (epoch {}, expiring at {:?}) \
                         was taken by {new_holder} (epoch {}) at {}",
                        c.seq, c.old_holder, c.old_epoch, c.old_expiry, c.new_epoch, c.at
                    ));
                }
                let refresh = old_live && c.old_holder == Some(new_holder);
                let expected = if refresh {
                    c.old_epoch
                } else {
                    c.old_epoch.saturating_add(1)
                };
                if c.new_epoch != expected {
                    tally.violation(format!(
                        "{label}: update {}: epoch {} -> {} where the rule gives {expected}",
                        c.seq, c.old_epoch, c.new_epoch
                    ));
                }
                let Some(new_expiry) = c.new_expiry else {
                    tally.violation(format!("{label}: update {}: a lease without expiry", c.seq));
                    continue;
                };
                if refresh {
                    match history.intervals.last_mut() {
                        Some(open) if open.end.is_none() && open.epoch == c.new_epoch => {
                            open.expiries.push((c.at, new_expiry));
                        }
                        _ => tally.violation(format!(
                            "{label}: update {}: a refresh outside any interval",
                            c.seq
                        )),
                    }
                } else {
                    if c.old_holder.is_some() {
                        history.takeovers += 1;
                    }
                    if let Some(open) = history.intervals.last_mut()
                        && open.end.is_none()
                    {
                        open.end = Some(End::TakenOver(c.at));
                    }
                    history.intervals.push(Interval {
                        holder: new_holder,
                        epoch: c.new_epoch,
                        from: c.at,
                        expiries: vec![(c.at, new_expiry)],
                        end: None,
                    });
                }
            }
            None => {
                let end = if c.new_epoch == c.old_epoch {
                    End::Released(c.at)
                } else if c.new_epoch == c.old_epoch.saturating_add(1) {
                    End::ForceReleased(c.at)
                } else {
                    tally.violation(format!(
                        "{label}: update {}: a release moved the epoch from {} to {}",
                        c.seq, c.old_epoch, c.new_epoch
                    ));
                    End::ForceReleased(c.at)
                };
                match history.intervals.last_mut() {
                    Some(open)
                        if open.end.is_none()
                            && Some(open.holder) == c.old_holder
                            && open.epoch == c.old_epoch =>
                    {
                        open.end = Some(end);
                    }
                    _ => tally.violation(format!(
                        "{label}: update {}: a release of {:?} at epoch {} outside its interval",
                        c.seq, c.old_holder, c.old_epoch
                    )),
                }
            }
        }
    }
    // Intervals disjoint and ordered on the database clock, epochs strictly growing.
    for w in history.intervals.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        match a.right_until() {
            Some(until) if until <= b.from => {}
            until => tally.violation(format!(
                "{label}: the interval of {} (epoch {}, from {}, right until {until:?}) overlaps \
                 the next one of {} (epoch {}) from {}",
                a.holder, a.epoch, a.from, b.holder, b.epoch, b.from
            )),
        }
        if b.epoch <= a.epoch {
            tally.violation(format!(
                "{label}: epoch {} was granted after epoch {}",
                b.epoch, a.epoch
            ));
        }
    }
    history
}

/// One committed fenced record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencedRecord {
    /// The attempt's id (one per fenced transaction).
    pub attempt: Uuid,
    /// Who wrote it.
    pub instance: Uuid,
    /// Under which epoch.
    pub epoch: i64,
    /// Whether its holder had stalled past the lock timeout before the fence check.
    pub stalled: bool,
    /// When its transaction began (`now()`): the fence check came after.
    pub tx_start: Micros,
    /// When the record was inserted (`clock_timestamp()`).
    pub at: Micros,
}

/// Checks one pair's committed fenced records (in `at` order) against its intervals.
pub fn audit_records(
    label: &str,
    intervals: &[Interval],
    records: &[FencedRecord],
    tally: &mut Tally,
) {
    let by_epoch: HashMap<i64, &Interval> = intervals.iter().map(|i| (i.epoch, i)).collect();
    for r in records {
        let who = format!(
            "{label}: the fenced record {} of {} under epoch {}",
            r.attempt, r.instance, r.epoch
        );
        let Some(i) = by_epoch.get(&r.epoch) else {
            tally.violation(format!("{who} names an epoch never granted"));
            continue;
        };
        if i.holder != r.instance {
            tally.violation(format!(
                "{who} was written by a non-holder ({} held it)",
                i.holder
            ));
        }
        if r.at < i.from {
            tally.violation(format!(
                "{who} at {} precedes the grant at {}",
                r.at, i.from
            ));
        }
        if let Some(end) = i.end
            && r.at > end.at()
        {
            tally.violation(format!(
                "{who} at {} lies after the lease ended ({end:?})",
                r.at
            ));
        }
        match i.expiry_as_of(r.tx_start) {
            None => tally.violation(format!(
                "{who}: its transaction began at {}, before the grant at {}",
                r.tx_start, i.from
            )),
            Some(expiry) if r.tx_start >= expiry => tally.violation(format!(
                "{who}: a stale commit — its transaction began at {}, after the lease expired at \
                 {expiry}, yet it passed the fence",
                r.tx_start
            )),
            Some(_) => {}
        }
        if r.stalled {
            tally.violation(format!(
                "{who}: a stalled holder's fenced commit was committed"
            ));
        }
    }
    // No interleaving: once a later epoch wrote, an earlier one never writes again.
    let mut highest: Option<&FencedRecord> = None;
    for r in records {
        match highest {
            Some(h) if r.epoch < h.epoch => tally.violation(format!(
                "{label}: a record of epoch {} at {} follows a record of epoch {} at {}",
                r.epoch, r.at, h.epoch, h.at
            )),
            Some(h) if r.epoch == h.epoch => {}
            _ => highest = Some(r),
        }
    }
}

/// What the callers of one pair were told, to hold against the database's records.
#[derive(Debug, Default, Clone)]
pub struct Told {
    /// `(instance, epoch)` of every `Acquired` that established a lease (not re-entered).
    pub acquired: Vec<(Uuid, i64)>,
    /// `(instance, epoch)` of every `Released`.
    pub released: Vec<(Uuid, i64)>,
    /// Attempts whose fenced commit was acknowledged.
    pub committed: Vec<Uuid>,
    /// Attempts the fence refused (rolled back).
    pub refused: Vec<Uuid>,
}

/// Checks what one pair's callers were told against its intervals and records.
pub fn audit_told(
    label: &str,
    intervals: &[Interval],
    records: &[FencedRecord],
    told: &Told,
    tally: &mut Tally,
) {
    let granted: HashMap<i64, Uuid> = intervals.iter().map(|i| (i.epoch, i.holder)).collect();
    let mut told_grants: HashMap<i64, Uuid> = HashMap::new();
    for &(instance, epoch) in &told.acquired {
        if granted.get(&epoch) != Some(&instance) {
            tally.violation(format!(
                "{label}: {instance} was told it acquired epoch {epoch}, which the row's history \
                 gives to {:?}",
                granted.get(&epoch)
            ));
        }
        if let Some(other) = told_grants.insert(epoch, instance) {
            tally.violation(format!(
                "{label}: epoch {epoch} was granted to {other} and to {instance}"
            ));
        }
    }
    for i in intervals {
        if !told_grants.contains_key(&i.epoch) {
            tally.violation(format!(
                "{label}: a ghost lease — {} holds epoch {} from {} but nobody was told",
                i.holder, i.epoch, i.from
            ));
        }
    }
    let released: HashSet<(Uuid, i64)> = told.released.iter().copied().collect();
    for i in intervals {
        let ended_by_release = matches!(i.end, Some(End::Released(_)));
        let told_released = released.contains(&(i.holder, i.epoch));
        if ended_by_release != told_released {
            tally.violation(format!(
                "{label}: epoch {} of {}: the history says released = {ended_by_release}, its \
                 holder was told released = {told_released}",
                i.epoch, i.holder
            ));
        }
    }
    let stored: HashSet<Uuid> = records.iter().map(|r| r.attempt).collect();
    for attempt in &told.committed {
        if !stored.contains(attempt) {
            tally.lost(format!(
                "{label}: the acknowledged fenced commit {attempt} is not in the table"
            ));
        }
    }
    for attempt in &told.refused {
        if stored.contains(attempt) {
            tally.violation(format!(
                "{label}: the fenced commit {attempt} was refused, yet its record is in the table"
            ));
        }
    }
}

/// Runs the audit at `scale` (see the module docs).
pub async fn run(scale: Scale) -> anyhow::Result<Tally> {
    Ok(run_report(&AuditConfig::new(scale)).await?.tally)
}

/// Where an instance begins its fenced transactions: its deadpool pool or its sqlx database
/// (the one its locker runs on).
#[derive(Clone)]
enum Instance {
    TokioPostgres(deadpool_postgres::Pool),
    Sqlx(SqlxDatabase),
}

/// One racing task: one instance's loop on one pair.
struct Racer {
    locker: PgStreamLocker,
    pool: Instance,
    instance: InstanceId,
    instance_index: usize,
    stream: StreamId,
    perspective: PerspectiveName,
    config: Arc<AuditConfig>,
    rng: StdRng,
    stop: Arc<AtomicBool>,
    cycles: Arc<AtomicU64>,
}

/// What one task saw, returned when it stops.
#[derive(Debug, Default)]
struct RacerLog {
    told: Told,
    stats: AuditStats,
    /// Broken promises seen by the caller itself.
    problems: Vec<String>,
}

/// How a fenced commit went.
enum Fenced {
    Committed,
    Refused,
    Failed(String),
}

/// How a hold goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// A few ms, or longer than the keepalive with one renew, then the fenced commit.
    Normal(Duration),
    /// Past the lock timeout without renewing, then the fenced commit (to be refused).
    Stall(Duration),
    /// The fence check, then past the lock timeout inside the transaction, then the commit.
    FencedStall(Duration),
}

impl Racer {
    async fn run(mut self) -> RacerLog {
        let mut log = RacerLog::default();
        let mut my_cycles = 0u64;
        let reason = LockReason::Rewind;
        while !self.stop.load(Ordering::Relaxed) {
            let outcome = tokio::time::timeout(
                OP_LIMIT,
                self.locker
                    .try_acquire(self.stream, &self.perspective, self.instance, &reason),
            )
            .await;
            let lease = match outcome {
                Ok(Ok(AcquireOutcome::Acquired(lease))) => lease,
                Ok(Ok(AcquireOutcome::Denied(_))) => {
                    log.stats.denied += 1;
                    self.back_off().await;
                    continue;
                }
                // A row locked by a fenced transaction or another lease statement: busy, which
                // a caller treats like a denial (try-acquire never waits).
                Ok(Ok(AcquireOutcome::Busy)) => {
                    log.stats.busy += 1;
                    self.back_off().await;
                    continue;
                }
                Ok(Ok(AcquireOutcome::NoCursor)) => {
                    log.problems.push(format!(
                        "try-acquire of {}/{} found no cursor row",
                        self.stream, self.perspective
                    ));
                    self.back_off().await;
                    continue;
                }
                Ok(Err(e)) => {
                    self.error(&mut log, "try-acquire", &e);
                    self.back_off().await;
                    continue;
                }
                Err(_) => {
                    log.problems
                        .push(format!("try-acquire did not return within {OP_LIMIT:?}"));
                    continue;
                }
            };
            self.cycles.fetch_add(1, Ordering::Relaxed);
            my_cycles += 1;
            log.stats.cycles += 1;
            if lease.reentered {
                // Only this task uses this instance on this pair, so joining its own live lease
                // means an earlier release failed (a transient error): the epoch was already
                // counted as granted.
                log.stats.reentered += 1;
            } else {
                log.told
                    .acquired
                    .push((self.instance.as_uuid(), lease.id.epoch.get()));
            }
            let hold = self.choose_hold(my_cycles);
            self.hold(&lease, hold, &mut log).await;
            // Let the other instances in before trying again.
            let pause = self.rng.random_range(0..=3);
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        log
    }

    fn choose_hold(&mut self, my_cycle: u64) -> Hold {
        let timeout = self.config.lock_timeout;
        let past_timeout = |rng: &mut StdRng| {
            timeout.saturating_add(Duration::from_millis(rng.random_range(100..=300)))
        };
        // Every run has stalls: instance 0 stalls on its second lease of each pair, instance 1
        // stalls inside the fence on its third.
        let forced_stall = self.instance_index == 0 && my_cycle == 2;
        let forced_fenced_stall = self.instance_index == 1 && my_cycle == 3;
        if forced_stall || self.rng.random_bool(self.config.stall_probability) {
            return Hold::Stall(past_timeout(&mut self.rng));
        }
        if forced_fenced_stall || self.rng.random_bool(self.config.fenced_stall_probability) {
            return Hold::FencedStall(past_timeout(&mut self.rng));
        }
        if self.rng.random_bool(self.config.long_hold_probability) {
            // Past the keepalive interval, well within the lock timeout once renewed.
            let extra = Duration::from_millis(self.rng.random_range(0..=50));
            return Hold::Normal(self.config.keepalive.saturating_add(extra));
        }
        Hold::Normal(Duration::from_millis(self.rng.random_range(0..=20)))
    }

    async fn hold(&mut self, lease: &StreamLease, hold: Hold, log: &mut RacerLog) {
        let epoch = lease.id.epoch.get();
        let me = self.instance.as_uuid();
        let attempt = Uuid::new_v4();
        let (stalled, inside) = match hold {
            Hold::Normal(d) => {
                let half = d / 2;
                tokio::time::sleep(half).await;
                if d > self.config.keepalive {
                    match tokio::time::timeout(OP_LIMIT, self.locker.renew(&lease.id)).await {
                        Ok(Ok(RenewOutcome::Renewed { .. })) => log.stats.renewed += 1,
                        Ok(Ok(RenewOutcome::Lost)) => log.stats.renew_lost += 1,
                        Ok(Err(e)) => self.error(log, "renew", &e),
                        Err(_) => log.problems.push(format!("renew hung past {OP_LIMIT:?}")),
                    }
                }
                tokio::time::sleep(d.saturating_sub(half)).await;
                (false, None)
            }
            Hold::Stall(d) => {
                log.stats.stalls += 1;
                tokio::time::sleep(d).await;
                (true, None)
            }
            Hold::FencedStall(d) => (false, Some(d)),
        };
        let limit = OP_LIMIT.saturating_add(inside.unwrap_or_default());
        let fenced =
            match tokio::time::timeout(limit, self.fenced_commit(lease, attempt, stalled, inside))
                .await
            {
                Ok(fenced) => fenced,
                Err(_) => Fenced::Failed(format!("the fenced commit hung past {limit:?}")),
            };
        match fenced {
            Fenced::Committed => {
                log.told.committed.push(attempt);
                log.stats.fenced_commits += 1;
                if stalled {
                    log.problems.push(format!(
                        "{me} stalled past its lease (epoch {epoch}) and still passed the fence"
                    ));
                }
                if inside.is_some() {
                    log.stats.fenced_stalls += 1;
                }
            }
            Fenced::Refused => {
                log.told.refused.push(attempt);
                if stalled {
                    log.stats.refused_stale += 1;
                } else {
                    log.stats.refused_unstalled += 1;
                }
            }
            Fenced::Failed(why) => log.problems.push(why),
        }
        // A stalled holder releases only half of the time: the other half leaves the expired
        // lease for a takeover.
        if stalled && self.rng.random_bool(0.5) {
            return;
        }
        match tokio::time::timeout(OP_LIMIT, self.locker.release(&lease.id)).await {
            Ok(Ok(ReleaseOutcome::Released)) => log.told.released.push((me, epoch)),
            Ok(Ok(ReleaseOutcome::NotHeld)) => log.stats.release_not_held += 1,
            Ok(Err(e)) => self.error(log, "release", &e),
            Err(_) => log.problems.push(format!("release hung past {OP_LIMIT:?}")),
        }
    }

    /// A transaction fenced by the lease that inserts the attempt's record.
    async fn fenced_commit(
        &self,
        lease: &StreamLease,
        attempt: Uuid,
        stalled: bool,
        stall_inside: Option<Duration>,
    ) -> Fenced {
        match &self.pool {
            Instance::TokioPostgres(pool) => match PgTransaction::begin(pool).await {
                Ok(tx) => {
                    self.fenced_in(tx, lease, attempt, stalled, stall_inside)
                        .await
                }
                Err(e) => Fenced::Failed(format!("begin: {e}")),
            },
            Instance::Sqlx(db) => match db.begin().await {
                Ok(tx) => {
                    self.fenced_in::<SqlxTransaction>(tx, lease, attempt, stalled, stall_inside)
                        .await
                }
                Err(e) => Fenced::Failed(format!("begin: {e}")),
            },
        }
    }

    /// [`fenced_commit`](Self::fenced_commit) in `tx`, on either driver.
    async fn fenced_in<T>(
        &self,
        tx: T,
        lease: &StreamLease,
        attempt: Uuid,
        stalled: bool,
        stall_inside: Option<Duration>,
    ) -> Fenced
    where
        T: Transaction + Executor,
        PgStreamLocker: LeaseFence<T>,
    {
        if self.config.fence == Fence::Checked {
            match self.locker.check_lease(&tx, &lease.id).await {
                Ok(()) => {}
                Err(e) => {
                    let _ = tx.rollback().await;
                    return if e.kind() == ErrorKind::LeaseLost {
                        Fenced::Refused
                    } else {
                        Fenced::Failed(format!("check_lease: {e}"))
                    };
                }
            }
        }
        if let Some(stall) = stall_inside {
            tokio::time::sleep(stall).await;
        }
        let inserted = tx
            .query(
                "INSERT INTO audit_fenced \
                   (attempt, stream_id, perspective_name, instance, epoch, stalled) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
                &[
                    &attempt,
                    &self.stream.as_uuid(),
                    &self.perspective.as_str(),
                    &self.instance.as_uuid(),
                    &lease.id.epoch.get(),
                    &stalled,
                ],
            )
            .await;
        if let Err(e) = inserted {
            let _ = tx.rollback().await;
            return Fenced::Failed(format!("inserting the fenced record: {e}"));
        }
        match tx.commit().await {
            Ok(()) => Fenced::Committed,
            Err(e) => Fenced::Failed(format!("fenced commit: {e}")),
        }
    }

    fn error(&self, log: &mut RacerLog, what: &str, e: &lockstep_core::Error) {
        if e.is_retryable() {
            log.stats.transient_errors += 1;
        } else {
            log.problems
                .push(format!("{what} by {} failed: {e}", self.instance));
        }
    }

    async fn back_off(&mut self) {
        let ms = self.rng.random_range(1..=8);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// Runs the audit with `config` and returns its tally and figures. Errors are set-up failures
/// (no database, a failed migration); what the audit finds is in the tally.
pub async fn run_report(config: &AuditConfig) -> anyhow::Result<AuditReport> {
    if config.instances == 0 || config.pairs() == 0 {
        bail!("the audit needs at least one instance and one pair");
    }
    let options = StreamLockOptions::new(config.lock_timeout, config.keepalive)
        .context("the audit's lease timings")?;
    let config = Arc::new(config.clone());
    let db = test_database().await;
    let setup = db.connect().await;
    // The audit checks lease semantics, not durability: commits need not wait for the WAL.
    db.skip_wal_flush()
        .await
        .context("setting synchronous_commit")?;
    let migrations = db.pool(1);
    lockstep_pg::migrate(&migrations)
        .await
        .context("applying the schema")?;
    drop(migrations);
    setup
        .batch_execute(AUDIT_SCHEMA)
        .await
        .context("the audit's trigger and tables")?;

    let mut pairs: Vec<(StreamId, PerspectiveName)> = Vec::new();
    for _ in 0..config.streams {
        let stream = StreamId::new_v7();
        for p in 0..config.perspectives {
            let perspective = PerspectiveName::new(format!("Audit{p}"))?;
            setup
                .execute(
                    "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) \
                     VALUES ($1, $2)",
                    &[&stream.as_uuid(), &perspective.as_str()],
                )
                .await
                .context("creating a cursor row")?;
            pairs.push((stream, perspective));
        }
    }
    let pair_index: HashMap<(Uuid, String), usize> = pairs
        .iter()
        .enumerate()
        .map(|(i, (s, p))| ((s.as_uuid(), p.as_str().to_owned()), i))
        .collect();

    // One pool per instance, one connection per task plus one; opened up front so that no
    // lease statement waits for a connection to be made.
    let stop = Arc::new(AtomicBool::new(false));
    let cycles = Arc::new(AtomicU64::new(0));
    let mut handles: Vec<(usize, JoinHandle<RacerLog>)> = Vec::new();
    let mut pools = Vec::new();
    for instance_index in 0..config.instances {
        let (pool, locker) = match config.driver {
            Driver::TokioPostgres => {
                let pool = db.pool(pairs.len() + 1);
                let mut warm = Vec::new();
                for _ in 0..pairs.len() {
                    let conn = tokio::time::timeout(OP_LIMIT, pool.get())
                        .await
                        .context("opening a pool connection timed out")?
                        .context("opening a pool connection")?;
                    warm.push(conn);
                }
                drop(warm);
                let locker = PgStreamLocker::from_pool(pool.clone(), options);
                (Instance::TokioPostgres(pool), locker)
            }
            Driver::Sqlx => {
                let sqlx_pool = db.sqlx_pool(u32::try_from(pairs.len() + 1)?);
                let mut warm = Vec::new();
                for _ in 0..pairs.len() {
                    let conn = tokio::time::timeout(OP_LIMIT, sqlx_pool.acquire())
                        .await
                        .context("opening a pool connection timed out")?
                        .context("opening a pool connection")?;
                    warm.push(conn);
                }
                drop(warm);
                let sqlx_db = SqlxDatabase::new(sqlx_pool);
                let locker = PgStreamLocker::for_sqlx(&sqlx_db, options);
                (Instance::Sqlx(sqlx_db), locker)
            }
        };
        pools.push(pool.clone());
        let instance = InstanceId::random();
        for (pair, (stream, perspective)) in pairs.iter().enumerate() {
            let task_seed = config
                .seed
                .wrapping_add((instance_index * pairs.len() + pair) as u64);
            let racer = Racer {
                locker: locker.clone(),
                pool: pool.clone(),
                instance,
                instance_index,
                stream: *stream,
                perspective: perspective.clone(),
                config: Arc::clone(&config),
                rng: StdRng::seed_from_u64(task_seed),
                stop: Arc::clone(&stop),
                cycles: Arc::clone(&cycles),
            };
            handles.push((pair, tokio::spawn(racer.run())));
        }
    }

    let started = Instant::now();
    while cycles.load(Ordering::Relaxed) < config.target_cycles
        && started.elapsed() < config.max_duration
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let duration = started.elapsed();

    let mut tally = Tally::default();
    let mut stats = AuditStats {
        instances: config.instances,
        pairs: pairs.len(),
        seed: config.seed,
        duration,
        ..AuditStats::default()
    };
    let mut told: Vec<Told> = vec![Told::default(); pairs.len()];
    for (pair, mut handle) in handles {
        match tokio::time::timeout(JOIN_LIMIT, &mut handle).await {
            Ok(Ok(log)) => {
                add_stats(&mut stats, &log.stats);
                for problem in log.problems {
                    tally.violation(format!("pair {pair}: {problem}"));
                }
                if let Some(t) = told.get_mut(pair) {
                    t.acquired.extend(log.told.acquired);
                    t.released.extend(log.told.released);
                    t.committed.extend(log.told.committed);
                    t.refused.extend(log.told.refused);
                }
            }
            Ok(Err(e)) if e.is_panic() => {
                tally.panic(format!("pair {pair}: a racer panicked: {e}"))
            }
            Ok(Err(e)) => tally.violation(format!("pair {pair}: a racer ended: {e}")),
            Err(_) => {
                handle.abort();
                tally.violation(format!(
                    "pair {pair}: a racer did not stop within {JOIN_LIMIT:?}"
                ));
            }
        }
    }
    tally.cases = stats.cycles;

    // The database's own records.
    let mut changes: Vec<Vec<Change>> = vec![Vec::new(); pairs.len()];
    for row in setup
        .query(LOAD_HISTORY, &[])
        .await
        .context("reading the lease log")?
    {
        let key: (Uuid, String) = (row.try_get(1)?, row.try_get(2)?);
        let Some(&pair) = pair_index.get(&key) else {
            tally.violation(format!(
                "an update of a cursor row not in the audit: {key:?}"
            ));
            continue;
        };
        stats.row_updates += 1;
        if let Some(list) = changes.get_mut(pair) {
            list.push(Change {
                seq: row.try_get(0)?,
                at: row.try_get(3)?,
                old_holder: row.try_get(4)?,
                old_expiry: row.try_get(5)?,
                old_epoch: row.try_get(6)?,
                new_holder: row.try_get(7)?,
                new_expiry: row.try_get(8)?,
                new_epoch: row.try_get(9)?,
            });
        }
    }
    let mut records: Vec<Vec<FencedRecord>> = vec![Vec::new(); pairs.len()];
    for row in setup
        .query(LOAD_RECORDS, &[])
        .await
        .context("reading the fenced records")?
    {
        let key: (Uuid, String) = (row.try_get(1)?, row.try_get(2)?);
        let Some(&pair) = pair_index.get(&key) else {
            tally.violation(format!(
                "a fenced record of a pair not in the audit: {key:?}"
            ));
            continue;
        };
        if let Some(list) = records.get_mut(pair) {
            list.push(FencedRecord {
                attempt: row.try_get(0)?,
                instance: row.try_get(3)?,
                epoch: row.try_get(4)?,
                stalled: row.try_get(5)?,
                tx_start: row.try_get(6)?,
                at: row.try_get(7)?,
            });
        }
    }
    let mut per_holder: BTreeMap<Uuid, u64> = BTreeMap::new();
    for (pair, ((changes, records), told)) in changes.iter().zip(&records).zip(&told).enumerate() {
        let label = format!("pair {pair}");
        let history = audit_history(&label, changes, &mut tally);
        stats.takeovers += history.takeovers;
        audit_records(&label, &history.intervals, records, &mut tally);
        audit_told(&label, &history.intervals, records, told, &mut tally);
        for i in &history.intervals {
            *per_holder.entry(i.holder).or_default() += 1;
        }
    }
    // A race needs racers: with more than one instance, at least two must have held a pair.
    if config.instances > 1 && stats.cycles > 0 && per_holder.len() < 2 {
        tally.violation(format!(
            "only {} instance(s) ever held a lease: the instances did not race",
            per_holder.len()
        ));
    }
    drop(setup);
    drop(pools);
    drop(db);
    Ok(AuditReport { tally, stats })
}

fn add_stats(total: &mut AuditStats, one: &AuditStats) {
    total.cycles += one.cycles;
    total.stalls += one.stalls;
    total.refused_stale += one.refused_stale;
    total.fenced_stalls += one.fenced_stalls;
    total.fenced_commits += one.fenced_commits;
    total.refused_unstalled += one.refused_unstalled;
    total.renewed += one.renewed;
    total.renew_lost += one.renew_lost;
    total.release_not_held += one.release_not_held;
    total.denied += one.denied;
    total.busy += one.busy;
    total.transient_errors += one.transient_errors;
    total.reentered += one.reentered;
}
