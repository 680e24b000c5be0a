//! [`ApplyError`]: why a perspective could not apply events to a pair's state — the error of
//! JSON perspectives ([`crate::DynPerspective`]) and table perspectives
//! ([`crate::DynTablePerspective`]) alike, which the worker stores on the pair's cursor.

use std::fmt;

/// Why a perspective could not apply events to a pair's state.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ApplyError {
    /// `apply` failed on this event.
    Apply {
        /// The event that failed.
        event_id: uuid::Uuid,
        /// The perspective's error, as text.
        detail: String,
    },
    /// The stored state does not deserialize into the perspective's state type (the type
    /// changed incompatibly: request a rewind from the start), or the new state does not
    /// serialize.
    State {
        /// The serde error, as text.
        detail: String,
    },
    /// A table perspective's `reset` failed (before a rewind's replay, or in a purge).
    Reset {
        /// The perspective's error, as text.
        detail: String,
    },
    /// `apply` panicked on this event (caught by the worker).
    Panicked {
        /// The event being applied, when known.
        event_id: Option<uuid::Uuid>,
        /// The panic message, when it was a string.
        detail: String,
    },
}

impl fmt::Display for ApplyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApplyError::Apply { event_id, detail } => {
                write!(f, "apply failed on event {event_id}: {detail}")
            }
            ApplyError::State { detail } => write!(f, "state (de)serialization failed: {detail}"),
            ApplyError::Reset { detail } => write!(f, "reset failed: {detail}"),
            ApplyError::Panicked {
                event_id: Some(id),
                detail,
            } => write!(f, "apply panicked on event {id}: {detail}"),
            ApplyError::Panicked {
                event_id: None,
                detail,
            } => write!(f, "apply panicked: {detail}"),
        }
    }
}

impl std::error::Error for ApplyError {}
