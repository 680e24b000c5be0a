//! The worker's typed failures: [`PairError`] (why a pair failed, as
//! [`PairOutcome::Failed`](crate::PairOutcome::Failed) and
//! [`CycleReport::failures`](crate::CycleReport::failures) carry it) and [`CycleError`] (an error
//! of a cycle itself, as [`CycleReport::errors`](crate::CycleReport::errors) carries it).
//!
//! Both are `Clone` and compare equal by what they say, so that reports can be kept, compared
//! and sent between tasks. Their text ([`Display`](std::fmt::Display)) is what the worker stores
//! on the pair's cursor (the store's `error` column: `perspectives parked` shows it) and logs;
//! code branches on [`PairError::kind`] and [`CycleError::kind`] instead.
//!
//! ```
//! use lockstep_core::ErrorKind;
//! use lockstep_worker::{PairError, PairErrorKind};
//!
//! fn advice(error: &PairError) -> &'static str {
//!     match error.kind() {
//!         PairErrorKind::Apply | PairErrorKind::Panicked => "fix the perspective or skip the event",
//!         PairErrorKind::UnreadableEvent => "repair or skip the event",
//!         PairErrorKind::State => "fix the state type, then request a rewind",
//!         PairErrorKind::Store(kind) if kind.is_retryable() => "transient: it is retried",
//!         PairErrorKind::LeaseLost => "another instance took the pair over: it is retried",
//!         _ => "look at the stored error",
//!     }
//! }
//! # let _ = advice;
//! ```

use std::fmt;

use lockstep_core::{ApplyError, Error, ErrorKind, ValidationError};
use uuid::Uuid;

/// What kind of failure a [`PairError`] is: what an operator's code matches on.
///
/// New kinds may be added in minor releases, so match with a wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PairErrorKind {
    /// The perspective's `apply` returned an error at an event ([`PairError::event_id`]);
    /// [`PairError::message`] is the perspective's error text.
    Apply,
    /// The perspective's `apply` panicked; [`PairError::event_id`] is the event it panicked at
    /// when the worker found it (by applying the events again one at a time), and
    /// [`PairError::message`] the panic's message.
    Panicked,
    /// The pair's state could not be handled: the stored state does not decode into the
    /// perspective's state type, the new (or the default) state does not serialize, or the new
    /// state is one the store refuses (nested too deep, a NUL character). At the event whose
    /// state it was, when known.
    State,
    /// A table perspective's `reset` failed or panicked (before a rewind's replay).
    Reset,
    /// An event could not be read (its stored payload does not decode, or an upcaster failed
    /// on it: `lockstep_core::upcast`);
    /// [`PairError::event_id`] is that event, [`PairError::message`] why.
    UnreadableEvent,
    /// The pair's lease was lost (it expired and was taken over, or was force-released), so the
    /// work was abandoned or its commit refused by the fence; nothing was committed.
    LeaseLost,
    /// The database (the store) failed: a commit refused or lost, a read that failed, the
    /// runtime ending a task; with the store's [`ErrorKind`] (never
    /// [`ErrorKind::LeaseLost`]: that is [`PairErrorKind::LeaseLost`]).
    Store(ErrorKind),
}

impl fmt::Display for PairErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PairErrorKind::Apply => f.write_str("apply failed"),
            PairErrorKind::Panicked => f.write_str("apply panicked"),
            PairErrorKind::State => f.write_str("state"),
            PairErrorKind::Reset => f.write_str("reset failed"),
            PairErrorKind::UnreadableEvent => f.write_str("unreadable event"),
            PairErrorKind::LeaseLost => f.write_str("lease lost"),
            PairErrorKind::Store(kind) => write!(f, "store: {kind}"),
        }
    }
}

/// Why a pair failed: what [`PairOutcome::Failed`](crate::PairOutcome::Failed) and
/// [`CycleReport::failures`](crate::CycleReport::failures) carry. The worker stores its text on
/// the pair's cursor, with [`PairError::event_id`] as the event it failed at, backs the pair
/// off and, after `park_after_failures` in a row, parks it.
///
/// `Display` is the stored text: the perspective's error (`apply failed on event …: …`,
/// `apply panicked: …`), prefixed `the perspective failed during replay: ` in a rewind, or the
/// store's error (`connection lost: …`, `lease lost: …`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PairError {
    kind: PairErrorKind,
    event_id: Option<Uuid>,
    cause: Cause,
    context: Option<Context>,
}

/// What a [`PairError`]'s text is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cause {
    /// The perspective's code failed (its text is the error's).
    Perspective(ApplyError),
    /// An error of the contracts, by its kind and message (its text: `kind: message`).
    Error { kind: ErrorKind, message: String },
    /// Why an event could not be read, as the store said.
    Unreadable(String),
}

/// Where a [`PairError`] happened, when its text says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Context {
    /// In a rewind's replay.
    Replay,
    /// Checking the new state before the commit.
    NewState,
}

impl PairError {
    /// What kind of failure it is.
    pub fn kind(&self) -> PairErrorKind {
        self.kind
    }

    /// The event the pair failed at, when it was one event's: what the cursor stores with the
    /// error (`perspectives parked` shows it, `skip` skips it).
    pub fn event_id(&self) -> Option<Uuid> {
        self.event_id
    }

    /// What the cause said, without the kind, the event or where it happened: the
    /// perspective's error text, the panic's message, the serde error, why the event could not
    /// be read, the store's message.
    pub fn message(&self) -> &str {
        match &self.cause {
            Cause::Perspective(
                ApplyError::Apply { detail, .. }
                | ApplyError::State { detail }
                | ApplyError::Reset { detail }
                | ApplyError::Panicked { detail, .. },
            ) => detail,
            // A kind of apply error added later: its text is the best there is.
            Cause::Perspective(_) => "",
            Cause::Error { message, .. } => message,
            Cause::Unreadable(reason) => reason,
        }
    }

    /// The perspective's code failed: `apply` (an error or a panic), the state's
    /// (de)serialization, or a table perspective's `reset`. At the event the error names (set
    /// another with [`PairError::at`]).
    pub(crate) fn perspective(error: ApplyError) -> PairError {
        let (kind, event_id) = match &error {
            ApplyError::Apply { event_id, .. } => (PairErrorKind::Apply, Some(*event_id)),
            ApplyError::Panicked { event_id, .. } => (PairErrorKind::Panicked, *event_id),
            ApplyError::State { .. } => (PairErrorKind::State, None),
            ApplyError::Reset { .. } => (PairErrorKind::Reset, None),
            _ => (PairErrorKind::Apply, None),
        };
        PairError {
            kind,
            event_id,
            cause: Cause::Perspective(error),
            context: None,
        }
    }

    /// An error of the store (or the contracts): [`PairErrorKind::LeaseLost`] for a lost lease,
    /// [`PairErrorKind::State`] for a perspective state the store refuses, else
    /// [`PairErrorKind::Store`] with its kind.
    pub(crate) fn store(error: &Error) -> PairError {
        let kind = match error.kind() {
            ErrorKind::LeaseLost => PairErrorKind::LeaseLost,
            _ if refuses_state(error) => PairErrorKind::State,
            kind => PairErrorKind::Store(kind),
        };
        PairError::of(kind, error)
    }

    /// A state that could not be made (the perspective's default state does not serialize).
    pub(crate) fn state(error: &Error) -> PairError {
        PairError::of(PairErrorKind::State, error)
    }

    /// A new state the store would refuse (checked before the commit).
    pub(crate) fn unstorable_state(error: &Error) -> PairError {
        PairError {
            context: Some(Context::NewState),
            ..PairError::of(PairErrorKind::State, error)
        }
    }

    /// The event `event_id` could not be read, for `reason`.
    pub(crate) fn unreadable(event_id: Uuid, reason: String) -> PairError {
        PairError {
            kind: PairErrorKind::UnreadableEvent,
            event_id: Some(event_id),
            cause: Cause::Unreadable(reason),
            context: None,
        }
    }

    /// The rewind's lease was lost while it ran: abandoned, nothing committed.
    pub(crate) fn lease_lost() -> PairError {
        PairError::of(
            PairErrorKind::LeaseLost,
            &Error::new(
                ErrorKind::LeaseLost,
                "the rewind lease was lost; the rewind was abandoned and nothing was committed",
            ),
        )
    }

    /// The same, failed at `event_id` (`None`: at no particular event).
    #[must_use]
    pub(crate) fn at(mut self, event_id: Option<Uuid>) -> PairError {
        self.event_id = event_id;
        self
    }

    /// The same, in a rewind's replay.
    #[must_use]
    pub(crate) fn in_replay(mut self) -> PairError {
        self.context = Some(Context::Replay);
        self
    }

    fn of(kind: PairErrorKind, error: &Error) -> PairError {
        PairError {
            kind,
            event_id: None,
            cause: Cause::Error {
                kind: error.kind(),
                message: error.message().to_owned(),
            },
            context: None,
        }
    }
}

/// Whether `error` is the store refusing a perspective state (`lockstep_core::json`'s check).
fn refuses_state(error: &Error) -> bool {
    matches!(
        error.validation(),
        Some(
            ValidationError::JsonTooDeep { field, .. } | ValidationError::ContainsNul { field }
        ) if *field == "perspective state"
    )
}

impl fmt::Display for PairError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.context {
            Some(Context::Replay) => f.write_str("the perspective failed during replay: ")?,
            Some(Context::NewState) => f.write_str("the new state cannot be stored: ")?,
            None => {}
        }
        match &self.cause {
            Cause::Perspective(error) => error.fmt(f),
            Cause::Error { kind, message } => write!(f, "{kind}: {message}"),
            Cause::Unreadable(reason) => f.write_str(reason),
        }
    }
}

impl std::error::Error for PairError {}

/// An error of a cycle itself, not of one pair: the store unreachable when claiming, a batch
/// whose commit failed after its claim (rolled back; the next batches are smaller), a pair's
/// failure that could not be stored. What [`CycleReport::errors`](crate::CycleReport::errors)
/// carries: the [`lockstep_core::Error`]'s kind and message (that error is not `Clone`; its
/// source is not kept).
///
/// `Display` is the error's (`kind: message`), after `a batch of N pairs failed after its claim
/// (the next ones are smaller): ` for a failed batch.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CycleError {
    kind: ErrorKind,
    message: String,
    batch: Option<usize>,
}

impl CycleError {
    /// What went wrong, as the store said.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The store's message, without the kind.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// When a claimed batch's commit failed: how many pairs it held (its work stays queued
    /// and the next batches are smaller).
    pub fn failed_batch(&self) -> Option<usize> {
        self.batch
    }

    /// `error`, as a cycle's.
    pub(crate) fn new(error: &Error) -> CycleError {
        CycleError {
            kind: error.kind(),
            message: error.message().to_owned(),
            batch: None,
        }
    }

    /// A batch of `pairs` pairs whose commit failed with `error`.
    pub(crate) fn batch_failed(pairs: usize, error: &Error) -> CycleError {
        CycleError {
            batch: Some(pairs),
            ..CycleError::new(error)
        }
    }
}

impl fmt::Display for CycleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(pairs) = self.batch {
            write!(
                f,
                "a batch of {pairs} pairs failed after its claim (the next ones are smaller): "
            )?;
        }
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl std::error::Error for CycleError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> Uuid {
        Uuid::from_u128(7)
    }

    #[test]
    fn the_text_is_what_the_cursor_stored_before() {
        let apply = PairError::perspective(ApplyError::Apply {
            event_id: id(),
            detail: "boom".into(),
        });
        assert_eq!(
            (apply.kind(), apply.event_id(), apply.message()),
            (PairErrorKind::Apply, Some(id()), "boom")
        );
        assert_eq!(
            apply.to_string(),
            format!("apply failed on event {}: boom", id())
        );
        assert_eq!(
            apply.in_replay().to_string(),
            format!(
                "the perspective failed during replay: apply failed on event {}: boom",
                id()
            )
        );
        // A panic's event found later does not change its text.
        let panic = PairError::perspective(ApplyError::Panicked {
            event_id: None,
            detail: "oops".into(),
        })
        .at(Some(id()));
        assert_eq!(
            (panic.kind(), panic.event_id(), panic.to_string().as_str()),
            (PairErrorKind::Panicked, Some(id()), "apply panicked: oops")
        );
        let lost = PairError::lease_lost();
        assert_eq!(lost.kind(), PairErrorKind::LeaseLost);
        assert_eq!(
            lost.to_string(),
            "lease lost: the rewind lease was lost; the rewind was abandoned and nothing was committed"
        );
        let unreadable = PairError::unreadable(id(), "number out of range".into());
        assert_eq!(
            (unreadable.kind(), unreadable.event_id()),
            (PairErrorKind::UnreadableEvent, Some(id()))
        );
        assert_eq!(unreadable.to_string(), "number out of range");
    }

    #[test]
    fn store_errors_keep_their_kind_and_text() {
        let err = Error::new(
            ErrorKind::ConnectionLost,
            "the server closed the connection",
        );
        let pair = PairError::store(&err);
        assert_eq!(pair.kind(), PairErrorKind::Store(ErrorKind::ConnectionLost));
        assert_eq!(pair.to_string(), err.to_string());
        assert_eq!(pair.message(), "the server closed the connection");
        // A fenced commit refused: the lease was lost.
        let fenced = Error::new(ErrorKind::LeaseLost, "no longer held");
        assert_eq!(PairError::store(&fenced).kind(), PairErrorKind::LeaseLost);
        // A state the store refuses is the state's failure, with the store's text.
        let deep: Error = ValidationError::JsonTooDeep {
            field: "perspective state",
            max: 127,
        }
        .into();
        let refused = PairError::store(&deep);
        assert_eq!(refused.kind(), PairErrorKind::State);
        assert_eq!(refused.to_string(), deep.to_string());
        assert_eq!(
            PairError::unstorable_state(&deep).to_string(),
            format!("the new state cannot be stored: {deep}")
        );
        let payload: Error = ValidationError::JsonTooDeep {
            field: "event payload",
            max: 127,
        }
        .into();
        assert_eq!(
            PairError::store(&payload).kind(),
            PairErrorKind::Store(ErrorKind::InvalidInput)
        );
    }

    #[test]
    fn cycle_errors_say_what_the_error_said() {
        let err = Error::new(ErrorKind::Backend, "the claim failed");
        let cycle = CycleError::new(&err);
        assert_eq!(
            (cycle.kind(), cycle.failed_batch()),
            (ErrorKind::Backend, None)
        );
        assert_eq!(cycle.to_string(), err.to_string());
        let batch = CycleError::batch_failed(3, &err);
        assert_eq!(batch.failed_batch(), Some(3));
        assert_eq!(
            batch.to_string(),
            format!("a batch of 3 pairs failed after its claim (the next ones are smaller): {err}")
        );
    }
}
