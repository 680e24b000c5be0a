//! The perspective store contract: the work queue, cursors, states and snapshots the
//! perspective worker runs on — on the caller's unit-of-work transaction `Tx`, like
//! [`crate::EventStore`].
//!
//! # Model (the seed's, made precise)
//!
//! - **Work.** Appending an event enqueues one work item per registered perspective for its
//!   stream (Postgres: rows of `wh_perspective_events`, written by the append statement itself),
//!   visible when the appender commits. A newly registered perspective gets work for every event
//!   that already exists.
//! - **Cursor** ([`Cursor`]), one per `(stream, perspective)` pair: the last applied event id, a
//!   revision that increases with every committed state change, the rewind request, the last
//!   error, and the stream lease (the seed's storage model; see [`crate::stream_lease`]).
//! - **Order.** A pair applies events in event-id order. A pending event whose id sorts before
//!   the cursor's last applied event is a **late arrival**: [`PerspectiveStore::claim`] then sets
//!   a rewind request whose trigger is the earliest such id (an earlier trigger replaces a later
//!   one, never the reverse) and hands the pair to the rewind path instead of applying.
//! - **Exclusive application.** [`PerspectiveStore::claim`] locks the pair's cursor row for the
//!   claiming transaction without waiting (`SKIP LOCKED`: a pair another transaction holds is
//!   [`Claim::Busy`]), and refuses a pair under a live lease of any holder (normal application
//!   pauses while a rewind, bootstrap or purge holds it; its work keeps queueing). The commit is
//!   a compare-and-set on the cursor's revision, so two appliers can never both advance it.
//! - **Commit** ([`PerspectiveStore::commit_state`]): in one transaction, save the state, advance
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

use crate::error::Result;
use crate::event_store::RecordedEvent;
use crate::ids::{InstanceId, PerspectiveName, StreamId};
use crate::stream_lease::{CursorLease, LeaseId};

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
/// many ([`PerspectiveStore::pending_pairs`] and [`PerspectiveStore::claim`] take it).
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
    /// The stream.
    pub stream_id: StreamId,
    /// The perspective.
    pub perspective: PerspectiveName,
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
    /// The event id of the latest snapshot, if any.
    pub latest_snapshot: Option<Uuid>,
    /// The stream lease on this cursor row.
    pub lease: CursorLease,
}

impl Cursor {
    /// The cursor of a pair with nothing applied yet: no last event, revision 0, no applied
    /// events, no rewind, no error or failures, no snapshot and no lease
    /// ([`CursorLease::default`]).
    pub fn new(stream_id: StreamId, perspective: PerspectiveName) -> Cursor {
        Cursor {
            stream_id,
            perspective,
            last_event_id: None,
            revision: 0,
            applied_count: 0,
            rewind: None,
            error: None,
            failures: 0,
            latest_snapshot: None,
            lease: CursorLease::default(),
        }
    }
}

/// A pair with something to do, as listed by [`PerspectiveStore::pending_pairs`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingPair {
    /// The stream.
    pub stream_id: StreamId,
    /// The perspective.
    pub perspective: PerspectiveName,
    /// Work items waiting.
    pub pending: u64,
    /// Whether a rewind is requested (and its debounce window has passed).
    pub rewind: bool,
}

/// What [`PerspectiveStore::claim`] found.
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

/// One state change of a pair, committed by [`PerspectiveStore::commit_state`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct StateCommit {
    /// The stream.
    pub stream_id: StreamId,
    /// The perspective.
    pub perspective: PerspectiveName,
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
    /// The work items it applied: exactly these are deleted.
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
    pub fn new(
        stream_id: StreamId,
        perspective: PerspectiveName,
        expected_revision: i64,
        state: serde_json::Value,
    ) -> StateCommit {
        StateCommit {
            stream_id,
            perspective,
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

/// Retention of snapshots per pair.
pub const DEFAULT_KEEP_SNAPSHOTS: usize = 3;

/// The perspective worker's storage, on the unit-of-work transaction `Tx`.
///
/// Every method runs inside `tx` and takes effect when it commits. Reads see what other
/// transactions committed before the call (READ COMMITTED).
pub trait PerspectiveStore<Tx: ?Sized + Sync>: Send + Sync {
    /// Registers perspectives by name (idempotent). From then on every appended event gets
    /// work for them, and events that already exist get work now (catch-up).
    fn register<'a>(
        &'a self,
        tx: &'a Tx,
        perspectives: &'a [PerspectiveName],
    ) -> impl Future<Output = Result<()>> + Send + 'a;

    /// Up to `limit` pairs **of `perspectives`** (the ones the caller runs; an empty slice lists
    /// none) with pending work or a rewind that `debounce` no longer holds back, skipping pairs
    /// under a live lease of another instance than `instance`. Oldest work first. Work of a
    /// registered perspective that the caller does not run is never listed, so it cannot hold
    /// the head of the caller's queue (issue 18).
    fn pending_pairs<'a>(
        &'a self,
        tx: &'a Tx,
        instance: InstanceId,
        perspectives: &'a [PerspectiveName],
        debounce: RewindDebounce,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<PendingPair>>> + Send + 'a;

    /// Claims a pair for normal application (see [`Claim`]); at most `max_events` events.
    /// Creates the cursor row if the pair has none. A late arrival among the pending events
    /// becomes a rewind request (kept by committing `tx`). `debounce` as for
    /// [`PerspectiveStore::pending_pairs`].
    fn claim<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        perspective: &'a PerspectiveName,
        max_events: usize,
        debounce: RewindDebounce,
    ) -> impl Future<Output = Result<Claim>> + Send + 'a;

    /// Commits a state change (see [`StateCommit`]). Returns the new revision.
    fn commit_state<'a>(
        &'a self,
        tx: &'a Tx,
        commit: &'a StateCommit,
    ) -> impl Future<Output = Result<i64>> + Send + 'a;

    /// The pair's cursor, if it has one.
    fn cursor<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        perspective: &'a PerspectiveName,
    ) -> impl Future<Output = Result<Option<Cursor>>> + Send + 'a;

    /// The pair's state and the cursor it belongs to (`None`: no cursor). The state is `None`
    /// when nothing was applied yet.
    fn state<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        perspective: &'a PerspectiveName,
    ) -> impl Future<Output = Result<Option<(Cursor, Option<serde_json::Value>)>>> + Send + 'a;

    /// The event ids of the pair's pending work, in event-id order.
    fn pending_events<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        perspective: &'a PerspectiveName,
    ) -> impl Future<Output = Result<Vec<Uuid>>> + Send + 'a;

    /// Every event of `stream_id` after `after` (all when `None`), in event-id order.
    fn stream_events<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        after: Option<Uuid>,
    ) -> impl Future<Output = Result<Vec<RecordedEvent>>> + Send + 'a;

    /// The latest snapshot of the pair strictly before `before`.
    fn snapshot_before<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        perspective: &'a PerspectiveName,
        before: Uuid,
    ) -> impl Future<Output = Result<Option<Snapshot>>> + Send + 'a;

    /// Saves the pair's current state as a snapshot at its last applied event (bootstrap), if
    /// the cursor is still at `expected_revision` and has applied events; keeps the last `keep`
    /// snapshots. `Ok(false)` when there was nothing to do (moved on, nothing applied, or that
    /// snapshot exists). `fence` as for [`StateCommit::fence`].
    fn save_snapshot<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        perspective: &'a PerspectiveName,
        expected_revision: i64,
        fence: Option<&'a LeaseId>,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;

    /// Requests a rewind of the pair from `from` (from the start when `None`); a request with a
    /// later trigger is moved earlier, never later. `Ok(false)` when the pair has no cursor.
    fn request_rewind<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        perspective: &'a PerspectiveName,
        from: Option<Uuid>,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;

    /// Records a failure of the pair (its error text, one more failure). The rewind request and
    /// the pending work stay.
    fn record_failure<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        perspective: &'a PerspectiveName,
        error: &'a str,
    ) -> impl Future<Output = Result<()>> + Send + 'a;

    /// Purges the pair: deletes its state, snapshots and pending work, and resets its cursor
    /// (no event applied, no rewind, no error; the revision increases and the lease stays).
    /// Events appended later are applied to an empty state; to rebuild from every event,
    /// request a rewind from the start instead. `fence` as for [`StateCommit::fence`].
    fn purge<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        perspective: &'a PerspectiveName,
        fence: Option<&'a LeaseId>,
    ) -> impl Future<Output = Result<()>> + Send + 'a;

    /// Creates the pair's cursor row if it has none (so a lease can be taken on it).
    /// `Ok(true)` when it was created.
    fn ensure_cursor<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        perspective: &'a PerspectiveName,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;

    /// Deletes the pair's cursor row, with its lease, state, snapshots and pending work.
    /// `Ok(false)` when there was none.
    fn delete_cursor<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        perspective: &'a PerspectiveName,
    ) -> impl Future<Output = Result<bool>> + Send + 'a;
}
