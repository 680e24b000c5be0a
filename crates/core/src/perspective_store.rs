//! The perspective store contract: the work queue, cursors, states and snapshots the
//! perspective worker runs on — on the caller's unit-of-work transaction `Tx`, like
//! [`crate::EventStore`].
//!
//! # Model (the stream-locking design's, made precise)
//!
//! - **Work.** Appending an event enqueues one work item per registered perspective for its
//!   stream (Postgres: rows of `wh_perspective_events`, written by the append statement itself),
//!   visible when the appender commits. A newly registered perspective gets work for every event
//!   that already exists.
//! - **Cursor** ([`Cursor`]), one per `(stream, perspective)` pair: the last applied event id, a
//!   revision that increases with every committed state change, the rewind request, the last
//!   error, and the stream lease (the storage model of the stream leases; see
//!   [`crate::stream_lease`]).
//! - **Order.** A pair applies events in event-id order. A pending event whose id sorts before
//!   the cursor's last applied event is a **late arrival**: [`PairWork::claim`] then sets
//!   a rewind request whose trigger is the earliest such id (an earlier trigger replaces a later
//!   one, never the reverse) and hands the pair to the rewind path instead of applying.
//! - **Exclusive application.** [`PairWork::claim`] locks the pair's cursor row for the
//!   claiming transaction without waiting (`SKIP LOCKED`: a pair another transaction holds is
//!   [`Claim::Busy`]), and refuses a pair under a live lease of any holder (normal application
//!   pauses while a rewind, bootstrap or purge holds it; its work keeps queueing). The commit is
//!   a compare-and-set on the cursor's revision, so two appliers can never both advance it.
//! - **Commit** ([`PairWork::commit`]): in one transaction, save the state, advance
//!   the cursor, delete exactly the applied work items, optionally clear the rewind request and
//!   save a snapshot, and — for work under a lease — check the lease's holder and epoch (the
//!   fenced commit, [`crate::ErrorKind::LeaseLost`] otherwise).
//! - **Snapshots** ([`Snapshot`]): the state at an event id, the last `keep` kept per pair. A
//!   rewind restores the latest snapshot strictly before its trigger; committing a rewind
//!   deletes the snapshots at or after the trigger (they may miss the late event).
//!
//! Every implementation passes the testkit's perspective-store conformance suite: the in-memory
//! one (`lockstep_testkit::InMemoryPerspectiveStore`) and the Postgres one
//! (`lockstep_pg_store::PgPerspectiveStore`).

use std::future::Future;
use std::time::Duration;

use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::{Error, Result, ValidationError};
use crate::event_store::RecordedEvent;
use crate::ids::{InstanceId, PerspectiveName, StreamId};
use crate::perspective_version::PerspectiveVersions;
use crate::stream_lease::{CursorLease, LeaseId};
use crate::unit_of_work::Transaction;

/// A request to rebuild a pair's state from an event on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RewindRequest {
    /// Replay from the latest snapshot strictly before this event id. [`Uuid::nil`] (which sorts
    /// before every event id) means from the start.
    pub trigger: Uuid,
    /// When the request was last moved or confirmed (store clock): a late event arriving again
    /// restarts the debounce window from here.
    pub flagged_at: OffsetDateTime,
    /// When the pair was first flagged since its last rewind (store clock).
    pub first_flagged_at: OffsetDateTime,
}

/// How long a rewind request is held back so that a burst of late events costs one rewind, not
/// many ([`CursorRows::pending_pairs`] and [`PairWork::claim`] take it).
///
/// A flagged pair is held back — work and all — while **both** hold: no late event moved or
/// confirmed the request for `window` (a sliding quiet period from
/// [`RewindRequest::flagged_at`]), and less than `max_delay` has passed since the pair was first
/// flagged ([`RewindRequest::first_flagged_at`]). The cap keeps a steady trickle of late events
/// from postponing the rewind forever. Times are the store's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RewindDebounce {
    /// The quiet period a request waits for, restarted by every late event.
    pub window: Duration,
    /// The longest a request is held back from its first flag, whatever keeps arriving.
    pub max_delay: Duration,
}

impl RewindDebounce {
    /// No debounce: a request is served at once.
    pub const NONE: RewindDebounce = RewindDebounce {
        window: Duration::ZERO,
        max_delay: Duration::ZERO,
    };

    /// The default cap on how long a request is held back: 30 s from its first flag.
    pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(30);

    /// A sliding `window` capped at [`RewindDebounce::DEFAULT_MAX_DELAY`] from the first flag.
    pub const fn window(window: Duration) -> RewindDebounce {
        RewindDebounce {
            window,
            max_delay: RewindDebounce::DEFAULT_MAX_DELAY,
        }
    }

    /// Whether `request` is still held back at `now`. A bound past the calendar's end holds the
    /// request back (saturating, never a panic).
    pub fn holds_back(&self, request: &RewindRequest, now: OffsetDateTime) -> bool {
        let before = |from: OffsetDateTime, wait: Duration| {
            time::Duration::try_from(wait)
                .ok()
                .and_then(|d| from.checked_add(d))
                .is_none_or(|until| now < until)
        };
        before(request.flagged_at, self.window) && before(request.first_flagged_at, self.max_delay)
    }
}

impl Default for RewindDebounce {
    /// [`RewindDebounce::NONE`].
    fn default() -> Self {
        RewindDebounce::NONE
    }
}

/// One pair's cursor, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Cursor {
    /// The pair.
    pub pair: Pair,
    /// The last event applied to the state (`None`: none yet).
    pub last_event_id: Option<Uuid>,
    /// Increases with every committed change of the state (the compare-and-set token).
    pub revision: i64,
    /// How many events the state is the fold of.
    pub applied_count: u64,
    /// The pending rewind, if any.
    pub rewind: Option<RewindRequest>,
    /// The last failure of this pair (cleared by the next successful commit).
    pub error: Option<String>,
    /// Failures since the last successful commit.
    pub failures: u32,
    /// The event the last failure happened at, when it was an event's (the one an operator
    /// would skip).
    pub failed_event_id: Option<Uuid>,
    /// Until when the pair backs off after a failure (store clock): no batch claims it before.
    /// Stored on the cursor, so every instance sees the same backoff.
    pub retry_at: Option<OffsetDateTime>,
    /// When the pair was parked (store clock): after too many failures it is not claimed again
    /// until an operator retries it, skips its failing event or requests a rewind. Its work
    /// keeps queueing.
    pub parked_at: Option<OffsetDateTime>,
    /// The event id of the latest snapshot, if any.
    pub latest_snapshot: Option<Uuid>,
    /// The stream lease on this cursor row.
    pub lease: CursorLease,
}

impl Cursor {
    /// The cursor of `pair` with nothing applied yet: no last event, revision 0, no applied
    /// events, no rewind, no error, failures, backoff or parking, no snapshot and no lease
    /// ([`CursorLease::default`]).
    pub fn new(pair: Pair) -> Cursor {
        Cursor {
            pair,
            last_event_id: None,
            revision: 0,
            applied_count: 0,
            rewind: None,
            error: None,
            failures: 0,
            failed_event_id: None,
            retry_at: None,
            parked_at: None,
            latest_snapshot: None,
            lease: CursorLease::default(),
        }
    }
}

/// A `(stream, perspective)` pair: the unit the worker applies, leases, fails and parks.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pair {
    /// The stream.
    pub stream_id: StreamId,
    /// The perspective.
    pub perspective: PerspectiveName,
}

impl Pair {
    /// The pair of `stream_id` and `perspective`.
    pub fn new(stream_id: StreamId, perspective: PerspectiveName) -> Pair {
        Pair {
            stream_id,
            perspective,
        }
    }
}

impl std::fmt::Display for Pair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.stream_id, self.perspective)
    }
}

/// How much one [`WorkQueue::claim_batch`] hands out. Every bound is at least 1.
///
/// The batch stops growing at the first bound reached; its first pair always gets at least one
/// event, whatever its size, so that an event larger than `bytes` is still applied (alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchLimits {
    /// Pairs per batch. Default 32.
    pub pairs: usize,
    /// Events per pair. Default 1 000.
    pub events_per_pair: usize,
    /// Events in the whole batch. Default 10 000.
    pub events: usize,
    /// Bytes of event payloads and states in the whole batch, decoded: what the worker holds,
    /// not what they take on disk (Postgres stores a large value compressed; it counts each
    /// payload's uncompressed `jsonb` size, stored with the event, and each state as it
    /// arrives). Default 16 MiB.
    pub bytes: u64,
    /// Pairs looked at per claim, claimable or not (busy, leased, backing off, parked): what
    /// bounds a claim's cost when most pairs with work cannot be served now. At least `pairs`.
    /// Default 256.
    pub scan: usize,
}

impl Default for BatchLimits {
    fn default() -> Self {
        BatchLimits {
            pairs: 32,
            events_per_pair: 1000,
            events: 10_000,
            bytes: 16 * 1024 * 1024,
            scan: 256,
        }
    }
}

impl BatchLimits {
    /// A batch of one pair with at most `events` events (the smallest batch: what a batch
    /// shrinks to after its claim outlived a server timeout).
    pub fn single(events: usize) -> BatchLimits {
        BatchLimits {
            pairs: 1,
            events_per_pair: events,
            events,
            ..BatchLimits::default()
        }
    }

    /// Checks the bounds: each at least 1, `scan >= pairs`, and each at most 1 000 000 pairs or
    /// events (bytes: at most 1 TiB). A bad bound is [`crate::ErrorKind::InvalidInput`]
    /// naming it.
    pub fn validate(&self) -> Result<()> {
        const MAX: usize = 1_000_000;
        let bad = |what: &str| {
            Err(crate::Error::new(
                crate::ErrorKind::InvalidInput,
                format!("batch limits: {what}"),
            ))
        };
        for (name, n) in [
            ("pairs", self.pairs),
            ("events_per_pair", self.events_per_pair),
            ("events", self.events),
            ("scan", self.scan),
        ] {
            if n == 0 || n > MAX {
                return bad(&format!("{name} must be between 1 and {MAX}, not {n}"));
            }
        }
        if self.bytes == 0 || self.bytes > 1 << 40 {
            return bad("bytes must be between 1 and 1 TiB");
        }
        if self.scan < self.pairs {
            return bad("scan must be at least pairs");
        }
        Ok(())
    }
}

/// How much one read of a rewind's events takes ([`RewindReads::load_rewind`],
/// [`RewindReads::rewind_events`]): events are taken in event-id order while fewer than
/// `events` are taken and their payloads' bytes stay within `bytes` — and the first event
/// always, whatever its size (a rewind could never pass it otherwise). So a rewind holds a
/// page of events at a time, whatever the length of the stream it replays.
///
/// Bytes are counted as [`BatchLimits::bytes`] counts them: decoded (Postgres: the payload's
/// uncompressed `jsonb` size; the in-memory store: the payload's JSON text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PageLimits {
    /// Events per page. Default 10 000.
    pub events: usize,
    /// Bytes of payloads per page. Default 16 MiB (as a batch's [`BatchLimits::bytes`]).
    pub bytes: u64,
}

impl Default for PageLimits {
    fn default() -> Self {
        PageLimits {
            events: 10_000,
            bytes: 16 * 1024 * 1024,
        }
    }
}

impl PageLimits {
    /// At most `events` events and `bytes` bytes per page. Either 0, more than 1 000 000 events
    /// or more than 1 TiB is [`crate::ErrorKind::InvalidInput`]; nothing is read with it.
    pub fn new(events: usize, bytes: u64) -> Result<PageLimits> {
        let page = PageLimits { events, bytes };
        page.validate()?;
        Ok(page)
    }

    /// Checks the bounds (as [`PageLimits::new`]); the stores check them before reading.
    pub fn validate(&self) -> Result<()> {
        BatchLimits {
            events_per_pair: self.events,
            bytes: self.bytes,
            ..BatchLimits::default()
        }
        .validate()
        .map_err(|_| {
            crate::Error::new(
                crate::ErrorKind::InvalidInput,
                format!(
                    "page limits: events must be between 1 and 1000000 and bytes between 1 and \
                     1 TiB, not {} events and {} bytes",
                    self.events, self.bytes
                ),
            )
        })
    }

    /// Takes the longest prefix of `events` (in order) that fits the page; whether some were
    /// left out. `size` is an event's stored size.
    pub fn cut(
        &self,
        events: &mut Vec<RecordedEvent>,
        size: impl Fn(&RecordedEvent) -> u64,
    ) -> bool {
        let mut bytes = 0u64;
        let mut keep = 0;
        for event in events.iter() {
            let next = bytes.saturating_add(size(event));
            if keep >= self.events || (keep > 0 && next > self.bytes) {
                break;
            }
            bytes = next;
            keep += 1;
        }
        let more = keep < events.len();
        events.truncate(keep);
        more
    }
}

/// A request for a batch of work ([`WorkQueue::claim_batch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchClaim {
    /// The perspectives to claim work of, each with the stream its scan continues after
    /// (`None`: from the first stream). They are served in this order: rotate it between claims
    /// so that one perspective's backlog does not always fill the batch.
    pub positions: Vec<(PerspectiveName, Option<StreamId>)>,
    /// How long a rewind request is held back ([`RewindDebounce`]).
    pub debounce: RewindDebounce,
    /// How much to hand out.
    pub limits: BatchLimits,
}

impl BatchClaim {
    /// A claim of `perspectives`' work from their first streams, with no debounce and the
    /// default limits.
    pub fn new(perspectives: &[PerspectiveName]) -> BatchClaim {
        BatchClaim {
            positions: perspectives.iter().map(|p| (p.clone(), None)).collect(),
            debounce: RewindDebounce::NONE,
            limits: BatchLimits::default(),
        }
    }
}

/// What a batch claimed for one pair. Its cursor row stays locked by the claiming transaction
/// until that ends.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ClaimedWork {
    /// Pending events after the cursor, in event-id order (at least one).
    Apply {
        /// The current state (`None`: nothing applied yet).
        state: Option<serde_json::Value>,
        /// The events to apply.
        events: Vec<RecordedEvent>,
    },
    /// The pair needs a rewind (the request may have been written by this claim: commit the
    /// transaction to keep it). Run the rewind path after the transaction ends.
    Rewind,
    /// Pending events after the cursor of which one, `event_id`, could not be read (its stored
    /// payload does not decode — a number out of range, nesting too deep — written by SQL
    /// that bypassed the event store's checks — or an upcaster failed on it,
    /// [`crate::upcast`]): `events` are the pending events before it, in
    /// event-id order (possibly none). The pair fails at `event_id`, as if `apply` had failed
    /// on it: the events before it are applied and committed with the failure, which is stored
    /// on the cursor, backed off and parked like any other, so that an operator can skip the
    /// event. The other pairs of the batch are not affected.
    Unreadable {
        /// The current state (`None`: nothing applied yet).
        state: Option<serde_json::Value>,
        /// The events before the unreadable one.
        events: Vec<RecordedEvent>,
        /// The event that could not be read.
        event_id: Uuid,
        /// Why it could not be read.
        error: String,
    },
}

/// One pair of a claimed batch.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ClaimedPair {
    /// The cursor as locked.
    pub cursor: Cursor,
    /// What to do.
    pub work: ClaimedWork,
}

impl ClaimedPair {
    /// A claimed pair: its cursor and what to do.
    pub fn new(cursor: Cursor, work: ClaimedWork) -> ClaimedPair {
        ClaimedPair { cursor, work }
    }
}

/// What [`WorkQueue::claim_batch`] handed out.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct ClaimedBatch {
    /// The pairs, in the order they were claimed.
    pub pairs: Vec<ClaimedPair>,
    /// Where each perspective's scan stopped, in the request's order: the last stream looked
    /// at (the request's position when none was). Pass them back as the next claim's positions
    /// so that successive claims go round every pair with work.
    pub positions: Vec<(PerspectiveName, Option<StreamId>)>,
    /// The store's clock when the claim read its events (`None`: the store does not say, or
    /// no event was read): the clock [`RecordedEvent::recorded_at`] was written with, so that
    /// an event's age (a lag) is measured on one clock, not against this host's.
    pub claimed_at: Option<OffsetDateTime>,
}

/// A pair's failure, as stored on its cursor ([`WorkQueue::record_failure`],
/// [`BatchEntry::failure`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PairFailure {
    /// What went wrong (U+0000 is stored as U+FFFD).
    pub error: String,
    /// The event it failed at, when it was one event's.
    pub event_id: Option<Uuid>,
    /// How long no claim hands the pair out (the backoff; `retry_at` is the store's clock plus
    /// this).
    pub retry_after: Duration,
    /// Park the pair: no claim hands it out until an operator retries it
    /// ([`PerspectiveAdmin::unpark`]), skips the failing event
    /// ([`PerspectiveAdmin::skip_event`]) or requests a rewind.
    pub park: bool,
}

impl PairFailure {
    /// A failure with `error`, at no particular event, retried at once and not parked.
    pub fn new(error: impl Into<String>) -> PairFailure {
        PairFailure {
            error: error.into(),
            event_id: None,
            retry_after: Duration::ZERO,
            park: false,
        }
    }

    /// This failure, at `event_id`.
    #[must_use]
    pub fn at_event(mut self, event_id: Option<Uuid>) -> PairFailure {
        self.event_id = event_id;
        self
    }

    /// This failure, backed off for `retry_after`.
    #[must_use]
    pub fn retry_after(mut self, retry_after: Duration) -> PairFailure {
        self.retry_after = retry_after;
        self
    }

    /// This failure, parking the pair when `park`.
    #[must_use]
    pub fn park(mut self, park: bool) -> PairFailure {
        self.park = park;
        self
    }
}

/// One pair's result in a batch commit ([`WorkQueue::commit_batch`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct BatchEntry {
    /// The pair.
    pub pair: Pair,
    /// The state change, when events were applied (for a pair that failed part-way: the fold
    /// of the events before the failing one). Its pair must be `pair`.
    pub commit: Option<StateCommit>,
    /// The failure, when the pair failed; stored after the commit (which clears the previous
    /// failure), so a pair that made progress counts one failure again.
    pub failure: Option<PairFailure>,
}

impl BatchEntry {
    /// An entry for `pair`: its state change and its failure, each when there is one.
    pub fn new(
        pair: Pair,
        commit: Option<StateCommit>,
        failure: Option<PairFailure>,
    ) -> BatchEntry {
        BatchEntry {
            pair,
            commit,
            failure,
        }
    }
}

/// What [`WorkQueue::commit_batch`] did with one entry, in the entries' order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BatchCommitted {
    /// The state change is committed (`revision`: the new one); the failure, if any, is stored
    /// (`parked`: the pair is now parked).
    Committed {
        /// The new revision.
        revision: i64,
        /// Whether the entry's failure parked the pair.
        parked: bool,
    },
    /// Only a failure was stored (`parked`: the pair is now parked).
    FailureRecorded {
        /// Whether the failure parked the pair.
        parked: bool,
    },
    /// The state change was refused and nothing of the entry was written: another applier
    /// moved the cursor first ([`crate::ErrorKind::Conflict`]), the cursor is gone, or the
    /// fence's lease was lost ([`crate::ErrorKind::LeaseLost`]). The other entries are not
    /// affected.
    Refused(crate::ErrorKind),
}

/// An event an operator skipped for a pair ([`PerspectiveAdmin::skip_event`]): never applied to
/// the pair, not by later claims nor by rewinds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SkippedEvent {
    /// The event.
    pub event_id: Uuid,
    /// Why it was skipped (the operator's note, or the failure it was skipped for).
    pub reason: String,
    /// When (store clock).
    pub skipped_at: OffsetDateTime,
}

impl SkippedEvent {
    /// The longest skip reason accepted, in characters: room for an operator's note or the
    /// failure an event was skipped for, never a payload. A longer reason is refused
    /// ([`SkippedEvent::check_reason`]), never truncated.
    pub const MAX_REASON_CHARS: usize = 1000;

    /// Checks a skip reason before it is stored: at most [`SkippedEvent::MAX_REASON_CHARS`]
    /// characters, else [`ValidationError::TextTooLong`] (field `"skip reason"`), an
    /// [`crate::ErrorKind::InvalidInput`] error. Every store runs it before writing anything
    /// ([`PerspectiveAdmin::skip_event`]).
    pub fn check_reason(reason: &str) -> Result<()> {
        // Counting stops just past the limit: a reason of megabytes costs no more to refuse.
        if reason.chars().nth(Self::MAX_REASON_CHARS).is_some() {
            return Err(ValidationError::TextTooLong {
                field: "skip reason",
                chars: reason.chars().count(),
                max: Self::MAX_REASON_CHARS,
            }
            .into());
        }
        Ok(())
    }

    /// A skipped event.
    pub fn new(event_id: Uuid, reason: impl Into<String>, skipped_at: OffsetDateTime) -> Self {
        SkippedEvent {
            event_id,
            reason: reason.into(),
            skipped_at,
        }
    }
}

/// One registered perspective's work, as [`PerspectiveAdmin::perspective_status`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PerspectiveStatus {
    /// The perspective.
    pub perspective: PerspectiveName,
    /// Pairs with a cursor.
    pub pairs: u64,
    /// Work items (events) not applied yet.
    pub pending_events: u64,
    /// How long the oldest of them has waited (store clock; `None`: nothing pending). For a
    /// perspective that no running worker serves it only grows.
    pub oldest_pending_age: Option<Duration>,
    /// Pairs with a rewind requested.
    pub rewinds_pending: u64,
    /// Pairs that failed since their last commit or retry (parked or not): a stored error and
    /// a failure count above 0. A pair an operator retried ([`PerspectiveAdmin::unpark`]) keeps
    /// its error text but is not counted until it fails again.
    pub in_error: u64,
    /// Pairs waiting out their backoff (not parked).
    pub backing_off: u64,
    /// Parked pairs.
    pub parked: u64,
}

impl PerspectiveStatus {
    /// The status of a perspective with nothing: no pairs, no work.
    pub fn new(perspective: PerspectiveName) -> PerspectiveStatus {
        PerspectiveStatus {
            perspective,
            pairs: 0,
            pending_events: 0,
            oldest_pending_age: None,
            rewinds_pending: 0,
            in_error: 0,
            backing_off: 0,
            parked: 0,
        }
    }
}

/// One pair's stored state, as [`PerspectiveReads::states`] pages through them.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct StoredState {
    /// The pair's cursor (where its state is).
    pub cursor: Cursor,
    /// The state.
    pub state: serde_json::Value,
}

/// The most states one [`PerspectiveReads::states`] page holds.
pub const MAX_STATES_PAGE: usize = 10_000;

/// Refuses a page size of 0 or above [`MAX_STATES_PAGE`] with
/// [`crate::ErrorKind::InvalidInput`] (what every store's `states` checks first).
pub fn check_states_page(limit: usize) -> Result<()> {
    if limit == 0 || limit > MAX_STATES_PAGE {
        return Err(crate::Error::new(
            crate::ErrorKind::InvalidInput,
            format!("a page of states holds 1 to {MAX_STATES_PAGE} states, not {limit}"),
        ));
    }
    Ok(())
}

impl StoredState {
    /// A stored state of the pair `cursor` belongs to.
    pub fn new(cursor: Cursor, state: serde_json::Value) -> StoredState {
        StoredState { cursor, state }
    }
}

/// What stands between a read and every event up to a given one, as
/// [`PerspectiveReads::pending_through`] reports it: the work of a pair (or of a whole
/// perspective) not applied yet among the events whose id is at most that one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PendingThrough {
    /// Events with an id at most the given one that are not applied yet.
    pub events: u64,
    /// Pairs with a rewind requested from an event at most the given one (their state is
    /// replayed before it counts as caught up).
    pub rewinds: u64,
    /// Of the pairs with such work, how many are parked (they will not catch up by
    /// themselves: an operator must retry, skip or rewind them).
    pub parked: u64,
    /// The last error of one such pair that is failing, if any.
    pub error: Option<String>,
    /// Whether the perspective is registered, retired or neither (`None`: the store does not
    /// say). Only a registered perspective's appends queue work: for the others nothing is
    /// pending, yet nothing will ever be applied either.
    pub registration: Option<Registration>,
    /// How many live worker instances announce that they run the perspective (the fleet:
    /// [`crate::WorkerInstance`]; `None`: the store does not say). 0 while work is pending: no
    /// worker that could apply it is running, or the ones running have no stream locker (a
    /// worker without one is not announced).
    pub live_workers: Option<u64>,
}

/// Whether a perspective is registered ([`PendingThrough::registration`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Registration {
    /// Registered: appends queue work for it.
    Registered,
    /// Retired with its states kept ([`RetireStates::Keep`]): the states stay readable, but
    /// appends queue no work for it until it is registered again.
    Retired,
    /// Neither: never registered (a misspelt name), or retired with its states dropped.
    NotRegistered,
}

impl PendingThrough {
    /// Nothing pending: the pair (or perspective) has applied every event up to the given one.
    pub fn is_caught_up(&self) -> bool {
        self.events == 0 && self.rewinds == 0
    }
}

/// A pair with something to do, as listed by [`CursorRows::pending_pairs`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingPair {
    /// The pair.
    pub pair: Pair,
    /// Work items waiting.
    pub pending: u64,
    /// Whether a rewind is requested (and its debounce window has passed).
    pub rewind: bool,
}

/// What [`PairWork::claim`] found.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Claim {
    /// Pending events, all after the cursor, in event-id order (at most the limit asked for).
    /// The cursor row stays locked by the claiming transaction until it ends.
    Apply {
        /// The cursor as locked.
        cursor: Cursor,
        /// The current state (`None`: nothing applied yet).
        state: Option<serde_json::Value>,
        /// The events to apply.
        events: Vec<RecordedEvent>,
        /// The store's clock when the claim read them (`None`: the store does not say), as
        /// [`ClaimedBatch::claimed_at`].
        claimed_at: Option<OffsetDateTime>,
    },
    /// Pending events after the cursor of which one, `event_id`, could not be read (its payload
    /// does not decode, or an upcaster failed on it): `events` are the pending events before
    /// it, in event-id order (possibly none), as for [`ClaimedWork::Unreadable`]. The pair
    /// fails at `event_id`: the events before it are applied and committed with the failure.
    /// The cursor row stays locked by the claiming transaction until it ends.
    Unreadable {
        /// The cursor as locked.
        cursor: Cursor,
        /// The current state (`None`: nothing applied yet).
        state: Option<serde_json::Value>,
        /// The events before the unreadable one.
        events: Vec<RecordedEvent>,
        /// The event that could not be read.
        event_id: Uuid,
        /// Why it could not be read.
        error: String,
    },
    /// The pair needs a rewind (requested before, or a late arrival found now — the request is
    /// then written in the claiming transaction: commit it). Nothing else was claimed.
    Rewind {
        /// The cursor, with its rewind request.
        cursor: Cursor,
    },
    /// Nothing to apply (no pending work, or a rewind inside its debounce window). The claim
    /// may have written a rewind request (a late arrival found inside the window): commit `tx`
    /// to keep it, as for [`Claim::Rewind`].
    Idle,
    /// Another transaction holds the cursor row, or a live lease holds the pair: skip it now.
    Busy,
}

/// A saved state at an event id.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// The last event the state is the fold of.
    pub event_id: Uuid,
    /// The state.
    pub state: serde_json::Value,
    /// How many events it is the fold of.
    pub applied_count: u64,
}

/// One state change of a pair, committed by [`PairWork::commit`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct StateCommit {
    /// The pair.
    pub pair: Pair,
    /// The cursor revision the new state was computed from; anything else is a
    /// [`crate::ErrorKind::Conflict`] and nothing is written.
    pub expected_revision: i64,
    /// The new state. It must be storable ([`crate::json::check_storable`]: nested at most
    /// [`crate::json::MAX_DEPTH`] levels deep, no U+0000); anything else is refused with
    /// [`crate::ErrorKind::InvalidInput`] and nothing is written.
    pub state: serde_json::Value,
    /// The last event it is the fold of.
    pub last_event_id: Option<Uuid>,
    /// How many events it is the fold of.
    pub applied_count: u64,
    /// The work items it applied: exactly these are deleted. They must be pending work of the
    /// pair (what a claim handed out). An id that is not may let a batch commit on Postgres
    /// delete another pending row inside the range of the pair's applied ids (ADR 0030 §3).
    pub applied_events: Vec<Uuid>,
    /// For a rewind: the trigger it rewound from. The snapshots at or after it are deleted, and
    /// the rewind request is cleared if its trigger is still this one (an earlier trigger that
    /// arrived meanwhile stays requested).
    pub rewound_from: Option<Uuid>,
    /// Also save the new state as a snapshot at `last_event_id`.
    pub snapshot: bool,
    /// For work under a stream lease: the lease that must still be held, at its epoch.
    pub fence: Option<LeaseId>,
}

impl StateCommit {
    /// A commit of `state` to the pair, computed from the cursor at `expected_revision`; the
    /// rest is empty (no last event, no applied events or count, no rewind, no snapshot, no
    /// fence): set the fields that apply.
    pub fn new(pair: Pair, expected_revision: i64, state: serde_json::Value) -> StateCommit {
        StateCommit {
            pair,
            expected_revision,
            state,
            last_event_id: None,
            applied_count: 0,
            applied_events: Vec::new(),
            rewound_from: None,
            snapshot: false,
            fence: None,
        }
    }
}

/// Whether [`PairWork::commit`] also releases the lease the commit is fenced on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Release {
    /// Keep the lease (the holder releases it, or goes on working under it).
    #[default]
    Keep,
    /// Release the fence's lease in the same change, if the commit goes ahead: the protected
    /// work's last two steps as one. Without a fence there is nothing to release.
    Lease,
}

/// What [`PairWork::commit`] did, once its transaction committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Committed {
    /// The cursor's new revision.
    pub revision: i64,
    /// Whether the fence's lease was released with the commit ([`Release::Lease`]).
    pub released: bool,
}

impl Committed {
    /// A commit that moved the cursor to `revision` and released the lease or not.
    pub fn new(revision: i64, released: bool) -> Committed {
        Committed { revision, released }
    }
}

/// What a rewind restores and replays, read at once ([`RewindReads::load_rewind`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RewindLoad {
    /// The pair's cursor (its [`Cursor::rewind`] is the request; `None`: nothing to rewind,
    /// and `snapshot` and `events` are empty).
    pub cursor: Cursor,
    /// The latest snapshot strictly before the request's trigger, if any.
    pub snapshot: Option<Snapshot>,
    /// The first page ([`PageLimits`]) of the stream's events after the snapshot (from the
    /// first without one), in event-id order, without the events an operator skipped for the
    /// pair.
    pub events: Vec<RecordedEvent>,
    /// Whether the stream has more such events after the last of `events`: the next pages come
    /// from [`RewindReads::rewind_events`].
    pub more: bool,
    /// The event right after `events` when it could not be read (its stored payload does not
    /// decode, as for [`ClaimedWork::Unreadable`]), and why: the page ends before it and
    /// `more` is false. A rewind fails at it, so that an operator can skip it.
    pub unreadable: Option<(Uuid, String)>,
}

impl RewindLoad {
    /// A load of `cursor` with its snapshot and all its events (`more` false, none unreadable).
    pub fn new(cursor: Cursor, snapshot: Option<Snapshot>, events: Vec<RecordedEvent>) -> Self {
        RewindLoad {
            cursor,
            snapshot,
            events,
            more: false,
            unreadable: None,
        }
    }

    /// The same, with `more` events after the last of `events`.
    #[must_use]
    pub fn with_more(mut self, more: bool) -> Self {
        self.more = more;
        self
    }
}

/// One page of a pair's events ([`RewindReads::rewind_events`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct EventPage {
    /// The events, in event-id order.
    pub events: Vec<RecordedEvent>,
    /// Whether more events follow the last of them.
    pub more: bool,
    /// The event right after `events` when it could not be read, and why (as
    /// [`RewindLoad::unreadable`]): the page ends before it and `more` is false.
    pub unreadable: Option<(Uuid, String)>,
}

impl EventPage {
    /// A page of `events`, `more` when others follow (none unreadable).
    pub fn new(events: Vec<RecordedEvent>, more: bool) -> Self {
        EventPage {
            events,
            more,
            unreadable: None,
        }
    }
}

/// What [`PerspectiveLifecycle::retire`] does with a retired perspective's cursors, states and
/// snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetireStates {
    /// Keep them: the states stay readable, and registering the perspective again continues
    /// each pair from its cursor (the events appended meanwhile become its work).
    Keep,
    /// Delete them (cursors, states, snapshots, skipped events, progress): registering the
    /// perspective again starts it from the first event, like a new one.
    Drop,
}

/// What [`PerspectiveLifecycle::retire`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Retired {
    /// The perspective is retired: appends enqueue no work for it any more.
    Retired {
        /// Queued work items deleted.
        work_removed: u64,
        /// Pairs whose cursors were kept ([`RetireStates::Keep`]) or deleted
        /// ([`RetireStates::Drop`]).
        pairs: u64,
    },
    /// Nothing done: the perspective is neither registered nor retired with its states kept.
    NotRegistered,
}

/// What [`PerspectiveLifecycle::rebuild`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rebuild {
    /// A rewind from the start was requested on every pair of the perspective.
    Requested {
        /// The pairs (cursors) with a request now.
        pairs: u64,
    },
    /// Nothing done: the perspective is not registered (a retired one must be registered
    /// again first).
    NotRegistered,
}

/// A rewind's progress as the worker reports it ([`RewindReads::record_progress`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProgressReport {
    /// The pair.
    pub pair: Pair,
    /// Names this rewind (chosen by the reporter, e.g. a random UUID): a report with another
    /// run restarts [`RewindProgress::started_at`].
    pub run: Uuid,
    /// The lease the rewind runs under, if any: the progress is current only while it is live.
    pub lease: Option<LeaseId>,
    /// Events replayed so far.
    pub replayed: u64,
    /// Events the rewind replays in all.
    pub to_replay: u64,
    /// How long the rewind has been running: a report of a new run sets
    /// [`RewindProgress::started_at`] to the store's clock less this (so that a first report
    /// made a second into the rewind still says when it started).
    pub elapsed: Duration,
}

impl ProgressReport {
    /// A report of `replayed` of `to_replay` events for the pair, in rewind `run`, without a
    /// lease.
    pub fn new(pair: Pair, run: Uuid, replayed: u64, to_replay: u64) -> ProgressReport {
        ProgressReport {
            pair,
            run,
            lease: None,
            replayed,
            to_replay,
            elapsed: Duration::ZERO,
        }
    }
}

/// Where a running rewind stands ([`PerspectiveAdmin::rewind_progress`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RewindProgress {
    /// The pair.
    pub pair: Pair,
    /// The instance that reported it, when the rewind runs under a lease.
    pub holder: Option<InstanceId>,
    /// Events replayed at the last report.
    pub replayed: u64,
    /// Events the rewind replays in all.
    pub to_replay: u64,
    /// When the rewind started: its first report's arrival (store clock) less the
    /// [`ProgressReport::elapsed`] it carried.
    pub started_at: OffsetDateTime,
    /// When its last report arrived (store clock).
    pub updated_at: OffsetDateTime,
    /// The store's clock when this was read (`None`: the store does not say): how long the
    /// rewind has been running and since its last report are measured against it, on the
    /// clock `started_at` and `updated_at` were written with.
    pub read_at: Option<OffsetDateTime>,
}

impl RewindProgress {
    /// The progress of the pair's rewind, with no holder.
    pub fn new(
        pair: Pair,
        replayed: u64,
        to_replay: u64,
        started_at: OffsetDateTime,
        updated_at: OffsetDateTime,
    ) -> RewindProgress {
        RewindProgress {
            pair,
            holder: None,
            replayed,
            to_replay,
            started_at,
            updated_at,
            read_at: None,
        }
    }
}

/// How a perspective catches up: events applied per second by every instance together
/// ([`PerspectiveLifecycle::throughput`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Throughput {
    /// The perspective.
    pub perspective: PerspectiveName,
    /// Events applied per second over the last window of at least [`THROUGHPUT_WINDOW`]; when
    /// the current window is older than that (nobody reported for a while), over the current
    /// window so far, so that a stalled perspective's rate falls towards 0. `None` before a
    /// first window of at least a second.
    pub events_per_second: Option<f64>,
    /// Events applied in the current window so far.
    pub window_applied: u64,
    /// When the current window started (store clock).
    pub window_started_at: OffsetDateTime,
}

impl Throughput {
    /// A perspective's throughput.
    pub fn new(
        perspective: PerspectiveName,
        events_per_second: Option<f64>,
        window_applied: u64,
        window_started_at: OffsetDateTime,
    ) -> Throughput {
        Throughput {
            perspective,
            events_per_second,
            window_applied,
            window_started_at,
        }
    }

    /// How long emptying `pending` events takes at this rate (`None` without a rate above 0,
    /// or beyond any representable duration).
    pub fn time_to_empty(&self, pending: u64) -> Option<Duration> {
        let rate = self
            .events_per_second
            .filter(|r| *r > 0.0 && r.is_finite())?;
        Duration::try_from_secs_f64(pending as f64 / rate).ok()
    }
}

/// The shortest window a catch-up rate is measured over (see [`Throughput`]).
pub const THROUGHPUT_WINDOW: Duration = Duration::from_secs(10);

/// The most [`PerspectiveAdmin::rewind_progress`] returns at once.
pub const MAX_PROGRESS_ROWS: usize = 10_000;

/// What a store records on a cursor for an event it could not read
/// ([`ClaimedWork::Unreadable`], [`Claim::Unreadable`], [`RewindLoad::unreadable`]): the error
/// and its causes, so that every backend words it alike (an upcaster's or the driver's error
/// says what is wrong with the payload).
pub fn unreadable_event_message(event_id: Uuid, err: &Error) -> String {
    let mut message = format!("event {event_id} could not be read: {err}");
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

/// Checks a [`PerspectiveAdmin::rewind_progress`] limit: 1 to [`MAX_PROGRESS_ROWS`].
#[doc(hidden)]
pub fn check_progress_limit(limit: usize) -> Result<()> {
    if limit == 0 || limit > MAX_PROGRESS_ROWS {
        return Err(crate::Error::new(
            crate::ErrorKind::InvalidInput,
            format!("a progress listing holds 1 to {MAX_PROGRESS_ROWS} rows, not {limit}"),
        ));
    }
    Ok(())
}

impl ProgressReport {
    /// Checks the report: `replayed` at most `to_replay`, both at most `i64::MAX`, and a lease
    /// (if any) of the same pair. [`crate::ErrorKind::InvalidInput`] otherwise.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(crate::Error::new(crate::ErrorKind::InvalidInput, what));
        if self.replayed > self.to_replay {
            return bad(format!(
                "progress: {} events replayed of {} to replay",
                self.replayed, self.to_replay
            ));
        }
        if self.elapsed > Duration::from_secs(100 * 365 * 24 * 3600) {
            return bad("progress: a rewind running for more than a century".to_owned());
        }
        if i64::try_from(self.to_replay).is_err() {
            return bad(format!("progress: {} events to replay", self.to_replay));
        }
        if let Some(lease) = &self.lease
            && (lease.stream_id != self.pair.stream_id
                || lease.perspective != self.pair.perspective)
        {
            return bad("progress: the lease is another pair's".to_owned());
        }
        Ok(())
    }
}

/// The default [`RewindReads::rewind_events`]: the stream's events after `after`
/// ([`PerspectiveReads::stream_events`]) less the pair's skipped events, cut to `page`, a
/// payload's bytes counted as its JSON text. Public for a store that overrides the method only
/// to watch it (the testkit's in-memory store records what each call asked for).
pub async fn rewind_page_from_stream<Tx, S>(
    store: &S,
    tx: &Tx,
    pair: &Pair,
    after: Option<Uuid>,
    page: PageLimits,
) -> Result<EventPage>
where
    Tx: ?Sized + Sync,
    S: PerspectiveReads<Tx> + ?Sized,
{
    page.validate()?;
    let mut events = store.stream_events(tx, pair.stream_id, after).await?;
    let skipped = store.skipped_events(tx, pair).await?;
    if !skipped.is_empty() {
        events.retain(|e| !skipped.iter().any(|s| s.event_id == e.event_id));
    }
    let more = page.cut(&mut events, |e| {
        serde_json::to_string(&e.payload).map_or(0, |text| text.len() as u64)
    });
    Ok(EventPage::new(events, more))
}

/// Retention of snapshots per pair.
pub const DEFAULT_KEEP_SNAPSHOTS: usize = 3;

/// The perspective worker's storage, on the unit-of-work transaction `Tx`: the union of the
/// capability traits [`WorkQueue`], [`PairWork`], [`PerspectiveReads`], [`RewindReads`],
/// [`PerspectiveAdmin`], [`PerspectiveLifecycle`] and [`PerspectiveVersions`], implemented for every type that
/// implements all of them. A backend implements the capabilities; code that needs them all
/// (the worker) takes this one bound. To call a concrete store's methods, bring the traits into
/// scope: `use lockstep_core::perspective_store::prelude::*;`.
///
/// Every method runs inside `tx` and takes effect when it commits. Reads see what other
/// transactions committed before the call (READ COMMITTED).
pub trait PerspectiveStore<Tx: ?Sized + Sync>:
    WorkQueue<Tx>
    + PairWork<Tx>
    + PerspectiveReads<Tx>
    + RewindReads<Tx>
    + PerspectiveAdmin<Tx>
    + PerspectiveLifecycle<Tx>
    + PerspectiveVersions<Tx>
{
}

impl<Tx: ?Sized + Sync, S> PerspectiveStore<Tx> for S where
    S: WorkQueue<Tx>
        + PairWork<Tx>
        + PerspectiveReads<Tx>
        + RewindReads<Tx>
        + PerspectiveAdmin<Tx>
        + PerspectiveLifecycle<Tx>
        + PerspectiveVersions<Tx>
{
}

/// The worker's queue of work: claim a batch of pairs with their events, commit the batch, record
/// a pair's failure. What a worker's batch path calls on every cycle.
///
/// Every method runs inside `tx` and takes effect when it commits.
pub trait WorkQueue<Tx: ?Sized + Sync>: Send + Sync {
    /// Claims a batch of work in one statement (see [`BatchClaim`], [`ClaimedBatch`]): up to
    /// `limits.pairs` pairs of the requested perspectives, each with its state and pending
    /// events (or marked for a rewind), within the limits.
    ///
    /// For each perspective, in the request's order, the scan walks the pairs with pending
    /// work in stream order from its position (wrapping round once), and claims a pair only
    /// if it can lock its cursor row without waiting (`SKIP LOCKED`: another instance's batch
    /// is skipped, never waited for), no live lease is on it, it is not backing off
    /// ([`Cursor::retry_at`] in the future) and not parked ([`Cursor::parked_at`]). A late
    /// arrival or a purged pair's new work becomes a rewind request as in
    /// [`PairWork::claim`]; a request inside its debounce window holds the pair back.
    /// At most `limits.scan` pairs are looked at: the cost of a claim does not grow with the
    /// length of the queue, nor with the number of pairs that cannot be served. A pair without
    /// a cursor row gets one. A pair that failed before ([`Cursor::failures`] above 0) at a
    /// pending event ([`Cursor::failed_event_id`]) is handed out up to that event only, so that
    /// retrying a poisoned pair costs what its failing event costs; with nothing pending up to
    /// it, its work is handed out as usual. Bad limits are [`crate::ErrorKind::InvalidInput`].
    fn claim_batch<'a>(
        &'a self,
        tx: &'a Tx,
        request: &'a BatchClaim,
    ) -> impl Future<Output = Result<ClaimedBatch>> + Send + 'a;

    /// Commits a batch in one statement: for each entry, its state change (as
    /// [`PairWork::commit`], which clears the pair's error, backoff and parking)
    /// and then its failure (as [`WorkQueue::record_failure`]). An entry whose state
    /// change is refused writes nothing and does not affect the others
    /// ([`BatchCommitted::Refused`]). Bad input in any entry (a state that cannot be stored, a
    /// commit of another pair) is [`crate::ErrorKind::InvalidInput`] and nothing is written.
    fn commit_batch<'a>(
        &'a self,
        tx: &'a Tx,
        entries: &'a [BatchEntry],
    ) -> impl Future<Output = Result<Vec<BatchCommitted>>> + Send + 'a;

    /// Records a failure of the pair: its error, the event it failed at, one more failure, the
    /// backoff (`retry_at`), and parks it when `failure.park`. Returns whether the pair is now
    /// parked. The rewind request and the pending work stay. Creates the cursor row if the
    /// pair has none.
    fn record_failure<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        failure: &'a PairFailure,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;
}

/// Work on one pair: the one-pair claim, the state commits (plain, releasing the lease, and
/// releasing and ending the transaction), snapshots and purges. What the worker's one-pair,
/// bootstrap, rewind and purge paths call.
///
/// Every method runs inside `tx` and takes effect when it commits.
pub trait PairWork<Tx: ?Sized + Sync>: Send + Sync {
    /// Claims a pair for normal application (see [`Claim`]); at most `max_events` events.
    /// An explicit claim of one pair does not wait for its backoff nor for its parking (an
    /// operator's "process this pair now").
    /// Creates the cursor row if the pair has none. A late arrival among the pending events
    /// becomes a rewind request (kept by committing `tx`). `debounce` as for
    /// [`CursorRows::pending_pairs`].
    fn claim<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        max_events: usize,
        debounce: RewindDebounce,
    ) -> impl Future<Output = Result<Claim>> + Send + 'a;

    /// Commits a state change (see [`StateCommit`]) as the last write of `tx`, and commits `tx`:
    /// the state, the cursor and the work rows change together with everything else `tx` wrote
    /// (a table perspective's rows, a claim's rewind request). With [`Release::Lease`] and a
    /// fence, the fence's lease is released in the same change; a refused change releases
    /// nothing.
    ///
    /// A refused change — a stale revision or a cursor that no longer exists
    /// ([`crate::ErrorKind::Conflict`]), a lost fence ([`crate::ErrorKind::LeaseLost`]), a
    /// state that cannot be stored ([`crate::ErrorKind::InvalidInput`]) — commits
    /// nothing of `tx`. A commit whose answer was lost is [`crate::ErrorKind::CommitUnknown`],
    /// as from [`Transaction::commit`]. Taking `tx` lets a store send the change with the
    /// `COMMIT` (Postgres: one round trip for both).
    fn commit<'a>(
        &'a self,
        tx: Tx,
        commit: &'a StateCommit,
        release: Release,
    ) -> impl Future<Output = Result<Committed>> + Send + 'a
    where
        Tx: Transaction;

    /// Saves the pair's current state as a snapshot at its last applied event (bootstrap), if
    /// the cursor is still at `expected_revision` and has applied events; keeps the last `keep`
    /// snapshots. `Ok(false)` when there was nothing to do (moved on, nothing applied, or that
    /// snapshot exists). `fence` as for [`StateCommit::fence`].
    fn save_snapshot<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        expected_revision: i64,
        fence: Option<&'a LeaseId>,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;

    /// Purges the pair: deletes its state, snapshots and pending work, and resets its cursor
    /// (no event applied, no rewind, no error; the revision increases and the lease stays).
    /// Events appended later are applied to an empty state; to rebuild from every event,
    /// request a rewind from the start instead. `fence` as for [`StateCommit::fence`].
    fn purge<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        fence: Option<&'a LeaseId>,
    ) -> impl Future<Output = Result<()>> + Send + 'a;
}

/// Reads of pairs and states: what read models, waits and operators read.
///
/// Every method runs inside `tx` and takes effect when it commits.
pub trait PerspectiveReads<Tx: ?Sized + Sync>: Send + Sync {
    /// The pair's cursor, if it has one.
    fn cursor<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<Option<Cursor>>> + Send + 'a;

    /// The pair's state and the cursor it belongs to (`None`: no cursor). The state is `None`
    /// when nothing was applied yet.
    fn state<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<Option<(Cursor, Option<serde_json::Value>)>>> + Send + 'a;

    /// Up to `limit` stored states of `perspective` (pairs that have one), in stream-id order,
    /// of the streams after `after` (from the first when `None`): pass the last stream of a page to get the next.
    /// The stable way to read a JSON perspective's states across streams (the tables behind it
    /// are the store's own). `limit` 0 or above 10 000 is [`crate::ErrorKind::InvalidInput`].
    fn states<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: &'a PerspectiveName,
        after: Option<StreamId>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<StoredState>>> + Send + 'a;

    /// The event ids of the pair's pending work, in event-id order.
    fn pending_events<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<Vec<Uuid>>> + Send + 'a;

    /// Every event of `stream_id` after `after` (all when `None`), in event-id order.
    fn stream_events<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        after: Option<Uuid>,
    ) -> impl Future<Output = Result<Vec<RecordedEvent>>> + Send + 'a;

    /// The events skipped for the pair, in event-id order.
    fn skipped_events<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<Vec<SkippedEvent>>> + Send + 'a;

    /// What `perspective` (one stream of it, with `stream_id`) has not applied yet of the events
    /// whose id is at most `up_to` (event-id order, the order perspectives apply in): pending
    /// work, rewinds requested from such an event, and whether the pairs holding it are parked
    /// or failing; whether the perspective is registered at all, and how many live worker
    /// instances run it. [`PendingThrough::is_caught_up`] is the "read your own write" test
    /// after an append whose last event is `up_to` (its work is queued by the append itself),
    /// for a registered perspective.
    fn pending_through<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: &'a PerspectiveName,
        stream_id: Option<StreamId>,
        up_to: Uuid,
    ) -> impl Future<Output = Result<PendingThrough>> + Send + 'a;
}

/// What a rewind reads and reports: its first page with the snapshot it starts from, the pages
/// after it, and its progress.
///
/// Every method runs inside `tx` and takes effect when it commits.
pub trait RewindReads<Tx: ?Sized + Sync>: PerspectiveReads<Tx> + Send + Sync {
    /// Everything a rewind of the pair reads first, at once ([`RewindLoad`]): the cursor, and
    /// when it has a rewind request the latest snapshot strictly before the trigger
    /// ([`RewindReads::snapshot_before`]) and the first `page` of the stream's events after
    /// it less the pair's skipped events ([`RewindReads::rewind_events`]). `None`: no
    /// cursor. A bad `page` is [`crate::ErrorKind::InvalidInput`]. The default makes those
    /// calls one after another; a store can read them in one statement.
    fn load_rewind<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        page: PageLimits,
    ) -> impl Future<Output = Result<Option<RewindLoad>>> + Send + 'a {
        async move {
            page.validate()?;
            let Some(cursor) = self.cursor(tx, pair).await? else {
                return Ok(None);
            };
            let Some(rewind) = cursor.rewind else {
                return Ok(Some(RewindLoad::new(cursor, None, Vec::new())));
            };
            let snapshot = self.snapshot_before(tx, pair, rewind.trigger).await?;
            let after = snapshot.as_ref().map(|s| s.event_id);
            let first = self.rewind_events(tx, pair, after, page).await?;
            let mut load = RewindLoad::new(cursor, snapshot, first.events).with_more(first.more);
            load.unreadable = first.unreadable;
            Ok(Some(load))
        }
    }

    /// A page of the events a rewind of the pair replays: the stream's events after `after`
    /// (from the first when `None`), in event-id order, less the pair's skipped events, as
    /// many as fit `page`; [`EventPage::more`] when others follow. A bad `page` is
    /// [`crate::ErrorKind::InvalidInput`]. The default reads the stream
    /// ([`PerspectiveReads::stream_events`]) and the skipped events and cuts the page, counting
    /// a payload's bytes as its JSON text; a store should read only the page.
    fn rewind_events<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        after: Option<Uuid>,
        page: PageLimits,
    ) -> impl Future<Output = Result<EventPage>> + Send + 'a {
        rewind_page_from_stream(self, tx, pair, after, page)
    }

    /// The latest snapshot of the pair strictly before `before`.
    fn snapshot_before<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        before: Uuid,
    ) -> impl Future<Output = Result<Option<Snapshot>>> + Send + 'a;

    /// Records where a rewind stands (one row per pair, overwritten; a new
    /// [`ProgressReport::run`] restarts its start time). Meant to be called at most about once
    /// a second per rewinding pair. `replayed > to_replay` is [`crate::ErrorKind::InvalidInput`].
    fn record_progress<'a>(
        &'a self,
        tx: &'a Tx,
        report: &'a ProgressReport,
    ) -> impl Future<Output = Result<()>> + Send + 'a;
}

/// An operator's view and levers: failing and parked pairs, retries, skips, rewind requests,
/// the status of every perspective's work and of running rewinds.
///
/// Every method runs inside `tx` and takes effect when it commits.
pub trait PerspectiveAdmin<Tx: ?Sized + Sync>: Send + Sync {
    /// The cursors of the pairs of `perspectives` (all perspectives when empty) that failed
    /// since their last commit or retry (a stored error and a failure count above 0: see
    /// [`PerspectiveStatus::in_error`]), parked or not, by perspective and stream, at most
    /// `limit`.
    fn failing_pairs<'a>(
        &'a self,
        tx: &'a Tx,
        perspectives: &'a [PerspectiveName],
        limit: usize,
    ) -> impl Future<Output = Result<Vec<Cursor>>> + Send + 'a;

    /// The parked pairs' cursors of `perspectives` (all perspectives when empty), longest
    /// parked first, at most `limit`.
    fn parked_pairs<'a>(
        &'a self,
        tx: &'a Tx,
        perspectives: &'a [PerspectiveName],
        limit: usize,
    ) -> impl Future<Output = Result<Vec<Cursor>>> + Send + 'a;

    /// Retries a pair now: clears its parking, backoff and failure count (the last error text
    /// stays until a commit, but the pair no longer counts as failing: [`Self::failing_pairs`],
    /// [`PerspectiveStatus::in_error`]). `Ok(false)` when the pair has no cursor.
    fn unpark<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;

    /// Skips one pending event of the pair for good: records it ([`SkippedEvent`], with
    /// `reason`), deletes its work item and retries the pair ([`PerspectiveAdmin::unpark`]).
    /// A rewind of the pair leaves it out too. `Ok(false)`, with nothing changed, when the
    /// event is not pending work of the pair. A reason longer than
    /// [`SkippedEvent::MAX_REASON_CHARS`] is [`crate::ErrorKind::InvalidInput`]
    /// ([`SkippedEvent::check_reason`]), refused before anything is read or written.
    fn skip_event<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        event_id: Uuid,
        reason: &'a str,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;

    /// Requests a rewind of the pair from `from` (from the start when `None`); a request with a
    /// later trigger is moved earlier, never later. It is also a retry: a parked or backing-off
    /// pair's parking, backoff and failure count are cleared (as by
    /// [`PerspectiveAdmin::unpark`]), so the next batch serves it. `Ok(false)` when the pair has
    /// no cursor.
    fn request_rewind<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        from: Option<Uuid>,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;

    /// Every registered perspective's work, by name (for operators: it counts the whole work
    /// table, unlike a claim).
    fn perspective_status<'a>(
        &'a self,
        tx: &'a Tx,
    ) -> impl Future<Output = Result<Vec<PerspectiveStatus>>> + Send + 'a;

    /// The current progress of the rewinds of `perspectives` (all when empty): reports of
    /// pairs that still have a rewind request and, for a report made under a lease, whose lease
    /// is still live with the same holder and epoch. By perspective and stream, at most `limit`
    /// (0 or above [`MAX_PROGRESS_ROWS`] is [`crate::ErrorKind::InvalidInput`]).
    fn rewind_progress<'a>(
        &'a self,
        tx: &'a Tx,
        perspectives: &'a [PerspectiveName],
        limit: usize,
    ) -> impl Future<Output = Result<Vec<RewindProgress>>> + Send + 'a;
}

/// A perspective's life: registration (the worker's start), retirement, rebuild, and the
/// catch-up rate every instance reports to.
///
/// Every method runs inside `tx` and takes effect when it commits.
pub trait PerspectiveLifecycle<Tx: ?Sized + Sync>: Send + Sync {
    /// Registers perspectives by name (idempotent). From then on every appended event gets
    /// work for them, and events that already exist get work now (catch-up).
    fn register<'a>(
        &'a self,
        tx: &'a Tx,
        perspectives: &'a [PerspectiveName],
    ) -> impl Future<Output = Result<()>> + Send + 'a;

    /// Retires `perspective`: appends enqueue no more work for it, its queued work is deleted,
    /// and its cursors, states and snapshots are kept or deleted as `states` asks. A pair's
    /// queued late arrival (work before its cursor) becomes a rewind request first when the
    /// states are kept, so nothing is lost. [`PerspectiveLifecycle::register`] registers it again:
    /// with kept states each pair continues from its cursor, and the events appended while it
    /// was retired become its work (one before the cursor is a late arrival). Retiring a
    /// perspective already retired with kept states is allowed (to drop them now).
    /// [`Retired::NotRegistered`] otherwise. On Postgres the retirement waits for open
    /// transactions that appended and holds new appends back until it commits.
    fn retire<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: &'a PerspectiveName,
        states: RetireStates,
    ) -> impl Future<Output = Result<Retired>> + Send + 'a;

    /// The perspectives retired with their states kept, by name.
    fn retired<'a>(
        &'a self,
        tx: &'a Tx,
    ) -> impl Future<Output = Result<Vec<PerspectiveName>>> + Send + 'a;

    /// Rebuilds `perspective` from the start: requests a rewind from the start on every pair
    /// of it at once (as [`PerspectiveAdmin::request_rewind`] with `None` does for one, also a
    /// retry of parked pairs). The workers of every instance serve the requests pair by pair
    /// under their rewind leases; each pair's old state stays readable until its rewind
    /// commits.
    fn rebuild<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: &'a PerspectiveName,
    ) -> impl Future<Output = Result<Rebuild>> + Send + 'a;

    /// Adds events applied (by this instance, since its last report) to each perspective's
    /// catch-up rate ([`Throughput`]). Meant to be called at most about once a second per
    /// instance; a count above `i64::MAX` is [`crate::ErrorKind::InvalidInput`].
    fn record_applied<'a>(
        &'a self,
        tx: &'a Tx,
        counts: &'a [(PerspectiveName, u64)],
    ) -> impl Future<Output = Result<()>> + Send + 'a;

    /// Every perspective's catch-up rate that was ever reported, by name.
    fn throughput<'a>(
        &'a self,
        tx: &'a Tx,
    ) -> impl Future<Output = Result<Vec<Throughput>>> + Send + 'a;
}

/// Cursor rows made and removed directly, and the pending pairs listed without claiming them:
/// for tests and tools, not part of [`PerspectiveStore`] (the worker needs none of them).
///
/// Every method runs inside `tx` and takes effect when it commits.
pub trait CursorRows<Tx: ?Sized + Sync>: Send + Sync {
    /// Up to `limit` pairs **of `perspectives`** (the ones the caller runs; an empty slice lists
    /// none) with pending work or a rewind that `debounce` no longer holds back, skipping pairs
    /// under a live lease of another instance than `instance`. Oldest work first. Work of a
    /// registered perspective that the caller does not run is never listed, so it cannot hold
    /// the head of the caller's queue.
    fn pending_pairs<'a>(
        &'a self,
        tx: &'a Tx,
        instance: InstanceId,
        perspectives: &'a [PerspectiveName],
        debounce: RewindDebounce,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<PendingPair>>> + Send + 'a;

    /// Creates the pair's cursor row if it has none (so a lease can be taken on it).
    /// `Ok(true)` when it was created.
    fn ensure_cursor<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;

    /// Deletes the pair's cursor row, with its lease, state, snapshots and pending work.
    /// `Ok(false)` when there was none.
    fn delete_cursor<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::typed;

    #[test]
    fn a_skip_reason_is_bounded_in_characters() {
        let at_limit = "é".repeat(SkippedEvent::MAX_REASON_CHARS);
        assert_eq!(typed(SkippedEvent::check_reason(&at_limit)), Ok(()));
        assert_eq!(typed(SkippedEvent::check_reason("")), Ok(()));
        let over = "é".repeat(SkippedEvent::MAX_REASON_CHARS + 1);
        assert_eq!(
            typed(SkippedEvent::check_reason(&over)),
            Err(ValidationError::TextTooLong {
                field: "skip reason",
                chars: 1001,
                max: 1000
            })
        );
        let ten_megabytes = "x".repeat(10 << 20);
        assert!(SkippedEvent::check_reason(&ten_megabytes).is_err());
    }
}

/// The perspective store's capability traits, for code that calls a concrete store's methods:
/// `use lockstep_core::perspective_store::prelude::*;`.
pub mod prelude {
    pub use super::{
        CursorRows as _, PairWork as _, PerspectiveAdmin as _, PerspectiveLifecycle as _,
        PerspectiveReads as _, PerspectiveStore, RewindReads as _, WorkQueue as _,
    };
    pub use crate::perspective_version::PerspectiveVersions as _;
}
