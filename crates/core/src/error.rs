//! The one error type of the lockstep contracts: an [`ErrorKind`] to branch on, a message for
//! people, and the underlying cause as [`std::error::Error::source`].
//!
//! Backends map their native failures (for Postgres: SQLSTATE codes, never message text) onto a
//! kind, so application code written against `lockstep-core` handles a lock timeout the same way
//! whether it runs on the in-memory fakes or on PostgreSQL.

use std::borrow::Cow;
use std::fmt;

/// A boxed cause, kept as the error's `source()`.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with the lockstep [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, in terms a caller can act on.
///
/// New kinds may be added in minor releases, so match with a wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The caller passed a value the contract refuses (see [`ValidationError`]). Nothing was
    /// sent to the backend and nothing changed.
    InvalidInput,
    /// A blocking lock acquire did not get the lock within its timeout
    /// (Postgres SQLSTATE `55P03`).
    LockTimeout,
    /// The operation was cancelled, by the caller or by the server (SQLSTATE `57014`).
    Cancelled,
    /// The backend detected a deadlock and chose this transaction as the victim (`40P01`).
    Deadlock,
    /// The transaction had already failed; every statement is refused until it ends (`25P02`).
    TransactionAborted,
    /// The connection to the backend was lost (SQLSTATE classes `08`, `57P0x`, or I/O errors).
    /// A transaction-scoped lock held on it is gone with it.
    ConnectionLost,
    /// An optimistic-concurrency check failed: another writer got there first
    /// (the event store's expected version, SQLSTATE `23505`).
    Conflict,
    /// A lease the work relied on is no longer held with the same epoch (it expired and was
    /// taken over, or was force-released). The work must not commit.
    LeaseLost,
    /// The call is not valid in this state, e.g. a lock-then-load inside a transaction that is
    /// not READ COMMITTED, or a transaction that belongs to another backend.
    Unsupported,
    /// The connection was lost after `COMMIT` was sent and before its reply arrived: the
    /// transaction may or may not have committed. **Not retryable** as such — running the unit
    /// of work again could apply it twice; check what was written (appends are idempotent by
    /// event id, so re-appending the same events is safe) before deciding.
    CommitUnknown,
    /// Anything the backend reported that has no kind of its own.
    Backend,
}

impl ErrorKind {
    /// Whether running the same unit of work again (in a new transaction) may succeed.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::LockTimeout
                | ErrorKind::Deadlock
                | ErrorKind::TransactionAborted
                | ErrorKind::ConnectionLost
                | ErrorKind::Conflict
        )
    }

    fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidInput => "invalid input",
            ErrorKind::LockTimeout => "lock timeout",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::Deadlock => "deadlock",
            ErrorKind::TransactionAborted => "transaction aborted",
            ErrorKind::ConnectionLost => "connection lost",
            ErrorKind::Conflict => "concurrency conflict",
            ErrorKind::LeaseLost => "lease lost",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::CommitUnknown => "commit outcome unknown",
            ErrorKind::Backend => "backend error",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error of every lockstep contract.
///
/// `Display` prints the kind and the message, never the source; walk
/// [`std::error::Error::source`] for the cause. A cause whose text the message already tells
/// (the server's message and SQLSTATE, the I/O failure — [`Error::with_cause_in_message`]) is
/// not returned by `source()`, so a report that prints the whole chain (`anyhow`'s `{:#}`) says
/// it once; [`Error::underlying`] still returns it, for downcasting.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    message: Cow<'static, str>,
    source: Option<BoxError>,
    // A cause the message already describes: reachable through `underlying`, not `source`.
    described: Option<BoxError>,
    // Kept beside, not as, the source: its text is already the message (Display must not
    // print the cause twice).
    validation: Option<ValidationError>,
}

impl Error {
    /// An error of `kind` with a message for people.
    pub fn new(kind: ErrorKind, message: impl Into<Cow<'static, str>>) -> Self {
        Error {
            kind,
            message: message.into(),
            source: None,
            described: None,
            validation: None,
        }
    }

    /// Attaches the underlying cause, returned by [`std::error::Error::source`] (the message
    /// should then not repeat its text).
    #[must_use]
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// Attaches a cause whose text the message already tells (a driver error whose server
    /// message and SQLSTATE were written into it). It is kept for [`Error::underlying`] but not
    /// returned by [`std::error::Error::source`]: printed as a chain, the error says its cause
    /// once.
    #[must_use]
    pub fn with_cause_in_message(mut self, cause: impl Into<BoxError>) -> Self {
        self.described = Some(cause.into());
        self
    }

    /// The underlying cause, whether it is the [`std::error::Error::source`] or one the
    /// message already describes ([`Error::with_cause_in_message`]) — e.g. to downcast to the
    /// driver's error type.
    pub fn underlying(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.source.as_deref().or(self.described.as_deref())
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, without the kind or the source.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether running the same unit of work again may succeed; see [`ErrorKind::is_retryable`].
    pub fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }

    /// The validation failure behind an [`ErrorKind::InvalidInput`] error, if that is its cause.
    pub fn validation(&self) -> Option<&ValidationError> {
        self.validation.as_ref()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Why a value was refused at construction. Converts into an [`Error`] of kind
/// [`ErrorKind::InvalidInput`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// A perspective name was empty or only whitespace.
    #[error("perspective name must not be blank")]
    BlankPerspectiveName,
    /// A perspective name exceeded [`crate::PerspectiveName::MAX_CHARS`].
    #[error("perspective name has {chars} characters; at most {max} are allowed")]
    PerspectiveNameTooLong {
        /// Characters given.
        chars: usize,
        /// The limit.
        max: usize,
    },
    /// A lock reason was empty or only whitespace.
    #[error("lock reason must not be blank")]
    BlankReason,
    /// A lock reason exceeded [`crate::LockReason::MAX_CHARS`] (the `varchar(50)` column);
    /// it is refused, never truncated.
    #[error("lock reason has {chars} characters; at most {max} are allowed")]
    ReasonTooLong {
        /// Characters given.
        chars: usize,
        /// The limit.
        max: usize,
    },
    /// An aggregate type was empty or only whitespace.
    #[error("aggregate type must not be blank")]
    BlankAggregateType,
    /// An aggregate type contained `:`, which would make two different aggregates share a key
    /// (`A:B` + `c` and `A` + `B:c`).
    #[error("aggregate type {0:?} must not contain ':'")]
    AggregateTypeContainsColon(String),
    /// An aggregate type exceeded [`crate::AggregateType::MAX_CHARS`].
    #[error("aggregate type has {chars} characters; at most {max} are allowed")]
    AggregateTypeTooLong {
        /// Characters given.
        chars: usize,
        /// The limit.
        max: usize,
    },
    /// A resource key was empty.
    #[error("resource key must not be empty")]
    EmptyResourceKey,
    /// A resource key exceeded [`crate::ResourceKey::MAX_BYTES`].
    #[error("resource key has {bytes} bytes; at most {max} are allowed")]
    ResourceKeyTooLong {
        /// Bytes given.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// A text value contained a NUL character, which PostgreSQL text cannot store.
    #[error("{field} must not contain a NUL character")]
    ContainsNul {
        /// Which value.
        field: &'static str,
    },
    /// A JSON value (an event payload, a perspective state) nested arrays and objects more
    /// than [`crate::json::MAX_DEPTH`] levels deep: it could be stored but never read back.
    #[error(
        "{field} nests arrays and objects more than {max} levels deep; at most {max} can be read back"
    )]
    JsonTooDeep {
        /// Which value.
        field: &'static str,
        /// The limit ([`crate::json::MAX_DEPTH`]).
        max: usize,
    },
    /// A duration option was zero.
    #[error("{field} must be greater than zero")]
    NonPositiveDuration {
        /// Which option.
        field: &'static str,
    },
    /// The keepalive interval was not below half the lock timeout, so a single late renew
    /// could let the lease expire.
    #[error(
        "keepalive interval ({keepalive:?}) must be less than half the lock timeout ({lock_timeout:?})"
    )]
    KeepaliveTooLong {
        /// The keepalive interval given.
        keepalive: std::time::Duration,
        /// The lock timeout given.
        lock_timeout: std::time::Duration,
    },
    /// An event type was empty or only whitespace.
    #[error("event type must not be blank")]
    BlankEventType,
    /// An event type exceeded [`crate::NewEvent::MAX_TYPE_CHARS`].
    #[error("event type has {chars} characters; at most {max} are allowed")]
    EventTypeTooLong {
        /// Characters given.
        chars: usize,
        /// The limit.
        max: usize,
    },
    /// An id was the nil UUID, which lockstep reserves (an event id: "from the start" in rewind
    /// requests; an instance id: "no holder").
    #[error("{field} must not be the nil UUID")]
    NilId {
        /// Which id.
        field: &'static str,
    },
    /// An event's schema version was 0 or above [`crate::NewEvent::MAX_SCHEMA_VERSION`] (or a
    /// stored one was out of that range).
    #[error("schema version {version} is out of range: versions run from 1 to 2147483647")]
    SchemaVersionOutOfRange {
        /// The version given.
        version: u64,
    },
    /// A duration option was below its lower bound (it would be truncated by the backend).
    #[error("{field} must be at least {min:?}")]
    DurationTooShort {
        /// Which option.
        field: &'static str,
        /// The bound.
        min: std::time::Duration,
    },
    /// A duration option was above its upper bound (what the backend can store).
    #[error("{field} must be at most {max:?}")]
    DurationTooLong {
        /// Which option.
        field: &'static str,
        /// The bound.
        max: std::time::Duration,
    },
    /// A duration did not fit the backend's representation.
    #[error("{field} is too large")]
    DurationTooLarge {
        /// Which option.
        field: &'static str,
    },
    /// A name began or ended with whitespace, so it would print like the name without it.
    #[error("{field} must not begin or end with whitespace")]
    SurroundingWhitespace {
        /// Which name.
        field: &'static str,
    },
    /// A name contained a character that prints as nothing or like another one: a control
    /// character (Unicode general category Cc, e.g. a newline), a format character (Cf, e.g.
    /// U+200B ZERO WIDTH SPACE, U+FEFF) or whitespace other than a plain space (e.g. U+00A0
    /// NO-BREAK SPACE).
    #[error(
        "{field} must not contain U+{code:04X}, which prints as nothing or like another character",
        code = u32::from(*.character)
    )]
    LookAlikeCharacter {
        /// Which name.
        field: &'static str,
        /// The first such character.
        character: char,
    },
    /// A name was not in Unicode normalization form C (NFC), so it would print like its NFC
    /// form (`Cafe` + U+0301 like `Café`) yet be another name. It is refused, never normalised.
    #[error("{field} must be in Unicode normalization form C (NFC)")]
    NotNfc {
        /// Which name.
        field: &'static str,
    },
    /// A text value (an instance's name, host or version) was empty or only whitespace.
    #[error("{field} must not be blank")]
    BlankText {
        /// Which value.
        field: &'static str,
    },
    /// A text value exceeded its limit (an instance's name, host or version:
    /// [`crate::InstanceAnnouncement::MAX_TEXT_CHARS`]).
    #[error("{field} has {chars} characters; at most {max} are allowed")]
    TextTooLong {
        /// Which value.
        field: &'static str,
        /// Characters given.
        chars: usize,
        /// The limit.
        max: usize,
    },
}

/// Test helper: a constructor's result with the typed [`ValidationError`] as its error (panics
/// when the error is not a validation failure).
#[cfg(test)]
pub(crate) fn typed<T>(result: Result<T>) -> std::result::Result<T, ValidationError> {
    result.map_err(|e| e.validation().cloned().expect("a validation error"))
}

impl From<ValidationError> for Error {
    fn from(err: ValidationError) -> Self {
        let mut error = Error::new(ErrorKind::InvalidInput, err.to_string());
        error.validation = Some(err);
        error
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_kinds_are_the_transient_ones() {
        assert!(ErrorKind::LockTimeout.is_retryable());
        assert!(ErrorKind::Deadlock.is_retryable());
        assert!(ErrorKind::ConnectionLost.is_retryable());
        assert!(ErrorKind::Conflict.is_retryable());
        assert!(!ErrorKind::InvalidInput.is_retryable());
        assert!(!ErrorKind::Cancelled.is_retryable());
        assert!(!ErrorKind::LeaseLost.is_retryable());
    }

    #[test]
    fn validation_errors_become_invalid_input_and_stay_inspectable() {
        let err: Error = ValidationError::BlankReason.into();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert_eq!(err.validation(), Some(&ValidationError::BlankReason));
        assert_eq!(
            err.to_string(),
            "invalid input: lock reason must not be blank"
        );
    }
}
