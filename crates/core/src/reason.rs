//! [`LockReason`]: why a stream lease was taken, stored on the lease for observability.

use std::fmt;

use crate::error::{Error, Result, ValidationError};

/// Why a stream lease is held.
///
/// The standard reasons are the stream-locking design's; any other reason is a custom string of at most
/// [`LockReason::MAX_CHARS`] characters (the `varchar(50)` column). A longer reason is an
/// error, never truncated.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LockReason {
    /// `rewind`: a late-arriving event forces restore-from-snapshot and replay.
    Rewind,
    /// `bootstrap`: the first snapshot of an existing stream is being created.
    Bootstrap,
    /// `purge`: the stream's perspective data is being purged.
    Purge,
    /// Any other reason, validated by [`LockReason::custom`].
    Custom(CustomReason),
}

/// A validated custom reason: not blank, at most 50 characters, no NUL.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CustomReason(String);

impl CustomReason {
    /// The reason text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl LockReason {
    /// The longest reason accepted, in characters (the column is `varchar(50)`).
    pub const MAX_CHARS: usize = 50;

    /// A custom reason. Passing a standard name (`"rewind"`) yields the standard variant, so a
    /// reason read back from storage compares equal to the one written.
    pub fn custom(reason: impl Into<String>) -> Result<LockReason> {
        LockReason::parse(reason)
    }

    /// Parses a stored or user-supplied reason.
    pub fn parse(reason: impl Into<String>) -> Result<LockReason> {
        let reason = reason.into();
        match reason.as_str() {
            "rewind" => return Ok(LockReason::Rewind),
            "bootstrap" => return Ok(LockReason::Bootstrap),
            "purge" => return Ok(LockReason::Purge),
            _ => {}
        }
        if reason.trim().is_empty() {
            return Err(Error::from(ValidationError::BlankReason));
        }
        let chars = reason.chars().count();
        if chars > Self::MAX_CHARS {
            return Err(Error::from(ValidationError::ReasonTooLong {
                chars,
                max: Self::MAX_CHARS,
            }));
        }
        if reason.contains('\0') {
            return Err(Error::from(ValidationError::ContainsNul {
                field: "lock reason",
            }));
        }
        Ok(LockReason::Custom(CustomReason(reason)))
    }

    /// The text stored in `stream_lock_reason`.
    pub fn as_str(&self) -> &str {
        match self {
            LockReason::Rewind => "rewind",
            LockReason::Bootstrap => "bootstrap",
            LockReason::Purge => "purge",
            LockReason::Custom(custom) => custom.as_str(),
        }
    }
}

impl fmt::Display for LockReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for LockReason {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        LockReason::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::typed;

    #[test]
    fn standard_reasons_round_trip() {
        for r in [LockReason::Rewind, LockReason::Bootstrap, LockReason::Purge] {
            assert_eq!(typed(LockReason::parse(r.as_str())), Ok(r.clone()));
        }
    }

    #[test]
    fn custom_reason_of_fifty_characters_is_kept_and_fifty_one_refused() {
        let fifty = "ü".repeat(50);
        assert_eq!(
            typed(LockReason::custom(fifty.clone()).map(|r| r.to_string())),
            Ok(fifty)
        );
        assert_eq!(
            typed(LockReason::custom("x".repeat(51))),
            Err(ValidationError::ReasonTooLong { chars: 51, max: 50 })
        );
        assert_eq!(
            typed(LockReason::custom("")),
            Err(ValidationError::BlankReason)
        );
        assert!(LockReason::custom("a\0").is_err());
    }
}
