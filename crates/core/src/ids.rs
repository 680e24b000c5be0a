//! Validated identifiers: who holds a lease ([`InstanceId`]), what it is on ([`StreamId`],
//! [`PerspectiveName`]) and which aggregate a write lock protects ([`AggregateType`]).
//!
//! Each newtype checks its value once, at construction, so a value that the database would
//! truncate, reject or misread can never reach SQL.

use std::fmt;
use std::sync::OnceLock;

use uuid::Uuid;

use crate::error::{Error, Result, ValidationError};

/// The identity of one running process of the application: the holder recorded on every lease
/// it takes.
///
/// [`InstanceId::process`] is fresh at each process start and stable for the process's life, so
/// a restarted instance never mistakes a lease of its previous life for its own (that lease
/// simply expires). Tests that play several instances in one process use
/// [`InstanceId::random`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceId(Uuid);

impl InstanceId {
    /// The id of this process, drawn once (UUIDv7, so ids sort by start time).
    pub fn process() -> InstanceId {
        static PROCESS: OnceLock<InstanceId> = OnceLock::new();
        *PROCESS.get_or_init(InstanceId::random)
    }

    /// A new, unique id (UUIDv7).
    pub fn random() -> InstanceId {
        InstanceId(Uuid::now_v7())
    }

    /// Wraps an id read back from storage or chosen by the caller (e.g. from configuration).
    ///
    /// The nil UUID is refused ([`ValidationError::NilId`]): it is what an unset or defaulted
    /// configuration value looks like, and every process configured that way would share one
    /// identity — and with it every lease.
    pub fn from_uuid(uuid: Uuid) -> Result<InstanceId> {
        if uuid.is_nil() {
            return Err(Error::from(ValidationError::NilId {
                field: "instance id",
            }));
        }
        Ok(InstanceId(uuid))
    }

    /// The underlying UUID.
    pub const fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl TryFrom<Uuid> for InstanceId {
    type Error = Error;
    /// See [`InstanceId::from_uuid`]: the nil UUID is refused.
    fn try_from(uuid: Uuid) -> Result<Self> {
        InstanceId::from_uuid(uuid)
    }
}

/// The id of an event stream (one aggregate instance's events).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(Uuid);

impl StreamId {
    /// Wraps a stream's UUID.
    pub const fn from_uuid(uuid: Uuid) -> StreamId {
        StreamId(uuid)
    }

    /// A new stream id (UUIDv7).
    pub fn new_v7() -> StreamId {
        StreamId(Uuid::now_v7())
    }

    /// The underlying UUID.
    pub const fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl From<Uuid> for StreamId {
    fn from(uuid: Uuid) -> Self {
        StreamId(uuid)
    }
}

/// The name of a perspective (a read model), e.g. `OrderPerspective`.
///
/// Not blank, at most [`PerspectiveName::MAX_CHARS`] characters, no NUL, and no look-alike of
/// another name: no whitespace at either end, no control or format character (a newline,
/// U+200B ZERO WIDTH SPACE, U+FEFF), no whitespace but the plain space, and in Unicode
/// normalization form C — so two names that print alike are one name (`Seq ` and `Seq` + U+200B
/// are refused, not registered beside `Seq`). Any other text — quotes, semicolons, SQL — is
/// kept verbatim: backends always bind it as a parameter.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PerspectiveName(String);

impl PerspectiveName {
    /// The longest name accepted, in characters.
    pub const MAX_CHARS: usize = 200;

    /// Validates and wraps a name.
    pub fn new(name: impl Into<String>) -> Result<PerspectiveName> {
        let name = name.into();
        if name.trim().is_empty() {
            return Err(Error::from(ValidationError::BlankPerspectiveName));
        }
        let chars = name.chars().count();
        if chars > Self::MAX_CHARS {
            return Err(Error::from(ValidationError::PerspectiveNameTooLong {
                chars,
                max: Self::MAX_CHARS,
            }));
        }
        if name.contains('\0') {
            return Err(Error::from(ValidationError::ContainsNul {
                field: "perspective name",
            }));
        }
        crate::text::check_unambiguous("perspective name", &name)?;
        Ok(PerspectiveName(name))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name version `version` of this perspective is stored under: the name itself for
    /// version 1, `{name}@v{version}` for a later one (see [`crate::perspective_version`]).
    /// Version 0, and a versioned name longer than [`PerspectiveName::MAX_CHARS`], are
    /// [`crate::ErrorKind::InvalidInput`].
    pub fn versioned(&self, version: u32) -> Result<PerspectiveName> {
        match version {
            0 => Err(Error::new(
                crate::ErrorKind::InvalidInput,
                format!("perspective {self}: versions start at 1, not 0"),
            )),
            1 => Ok(self.clone()),
            n => PerspectiveName::new(format!("{}@v{n}", self.0)),
        }
    }

    /// Splits a stored name of a later version (`Statement@v2`) into the perspective's name
    /// and the version; `None` for any other name (a version 1 is stored under the plain
    /// name).
    pub fn version_suffix(&self) -> Option<(&str, u32)> {
        let (base, digits) = self.0.rsplit_once("@v")?;
        if base.is_empty() || digits.is_empty() || digits.starts_with('0') {
            return None;
        }
        if !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let version: u32 = digits.parse().ok()?;
        (version >= 2).then_some((base, version))
    }
}

impl fmt::Display for PerspectiveName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<&str> for PerspectiveName {
    type Error = Error;
    fn try_from(value: &str) -> Result<Self, Self::Error> {
        PerspectiveName::new(value)
    }
}

impl AsRef<str> for PerspectiveName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// The type name of an aggregate, the `{type}` of the write-lock key
/// `relay:aggregate:{type}:{id}`.
///
/// Not blank, no `:` (otherwise `A:B`/`c` and `A`/`B:c` would share a key), no NUL, at most
/// [`AggregateType::MAX_CHARS`] characters, and no look-alike of another type (the rules of
/// [`PerspectiveName`]: `Stock ` or `Stock` + U+200B would be another lock key than `Stock`,
/// so two writers of what reads as one aggregate would not exclude each other). Case is kept
/// exactly: `Stock` and `stock` are different types.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AggregateType(String);

impl AggregateType {
    /// The longest type name accepted, in characters.
    pub const MAX_CHARS: usize = 200;

    /// Validates and wraps a type name.
    pub fn new(name: impl Into<String>) -> Result<AggregateType> {
        let name = name.into();
        if name.trim().is_empty() {
            return Err(Error::from(ValidationError::BlankAggregateType));
        }
        if name.contains(':') {
            return Err(Error::from(ValidationError::AggregateTypeContainsColon(
                name,
            )));
        }
        if name.contains('\0') {
            return Err(Error::from(ValidationError::ContainsNul {
                field: "aggregate type",
            }));
        }
        let chars = name.chars().count();
        if chars > Self::MAX_CHARS {
            return Err(Error::from(ValidationError::AggregateTypeTooLong {
                chars,
                max: Self::MAX_CHARS,
            }));
        }
        crate::text::check_unambiguous("aggregate type", &name)?;
        Ok(AggregateType(name))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for AggregateType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::typed;

    #[test]
    fn process_instance_id_is_stable_and_random_ones_differ() {
        assert_eq!(InstanceId::process(), InstanceId::process());
        assert_ne!(InstanceId::random(), InstanceId::random());
    }

    #[test]
    fn the_nil_instance_id_is_refused() {
        assert_eq!(
            typed(InstanceId::from_uuid(Uuid::nil())),
            Err(ValidationError::NilId {
                field: "instance id"
            })
        );
        assert!(InstanceId::try_from(Uuid::nil()).is_err());
        let id = Uuid::now_v7();
        assert_eq!(
            InstanceId::from_uuid(id).map(|i| i.as_uuid()).ok(),
            Some(id)
        );
    }

    #[test]
    fn perspective_names_are_validated_but_otherwise_verbatim() {
        assert_eq!(
            typed(PerspectiveName::new("")),
            Err(ValidationError::BlankPerspectiveName)
        );
        assert_eq!(
            typed(PerspectiveName::new("  \t")),
            Err(ValidationError::BlankPerspectiveName)
        );
        assert!(matches!(
            typed(PerspectiveName::new("x".repeat(201))),
            Err(ValidationError::PerspectiveNameTooLong {
                chars: 201,
                max: 200
            })
        ));
        assert!(PerspectiveName::new("é".repeat(200)).is_ok());
        assert!(PerspectiveName::new("a\0b").is_err());
        let sql = "x'); DROP TABLE wh_perspective_cursors; --";
        assert_eq!(
            typed(PerspectiveName::new(sql).map(|n| n.0)),
            Ok(sql.to_owned())
        );
    }

    /// The names of the look-alike report: each prints like `Seq` or `Café` and is refused by
    /// both name types, with the field it names; the plain names stay accepted.
    #[test]
    fn look_alike_perspective_names_and_aggregate_types_are_refused() {
        enum Want {
            Accepted,
            Space,
            Hidden(char),
            NotNfc,
        }
        let refusal = |want: &Want, field| match *want {
            Want::Accepted => None,
            Want::Space => Some(ValidationError::SurroundingWhitespace { field }),
            Want::Hidden(character) => {
                Some(ValidationError::LookAlikeCharacter { field, character })
            }
            Want::NotNfc => Some(ValidationError::NotNfc { field }),
        };
        let cases = [
            ("Seq", Want::Accepted),
            ("Café", Want::Accepted),
            ("Seq ", Want::Space),
            (" Seq", Want::Space),
            ("Seq\n", Want::Space),
            ("Seq\u{200B}", Want::Hidden('\u{200B}')),
            ("Se\u{200E}q", Want::Hidden('\u{200E}')),
            ("\u{FEFF}Seq", Want::Hidden('\u{FEFF}')),
            ("Seq\u{2060}", Want::Hidden('\u{2060}')),
            ("Se\tq", Want::Hidden('\t')),
            ("Cafe\u{301}", Want::NotNfc),
        ];
        for (name, want) in &cases {
            let perspective = typed(PerspectiveName::new(*name).map(|n| n.0));
            let aggregate = typed(AggregateType::new(*name).map(|t| t.0));
            match (
                refusal(want, "perspective name"),
                refusal(want, "aggregate type"),
            ) {
                (Some(p), Some(a)) => {
                    assert_eq!(perspective, Err(p), "{name:?}");
                    assert_eq!(aggregate, Err(a), "{name:?}");
                }
                _ => {
                    assert_eq!(perspective.as_deref(), Ok(*name));
                    assert_eq!(aggregate.as_deref(), Ok(*name));
                }
            }
        }
        // The NUL check keeps its own error; a blank name is still blank, not "whitespace".
        assert_eq!(
            typed(PerspectiveName::new("a\0b")),
            Err(ValidationError::ContainsNul {
                field: "perspective name"
            })
        );
        assert_eq!(
            typed(PerspectiveName::new(" ")),
            Err(ValidationError::BlankPerspectiveName)
        );
    }

    #[test]
    fn aggregate_types_refuse_blank_and_colon() {
        assert_eq!(
            typed(AggregateType::new(" ")),
            Err(ValidationError::BlankAggregateType)
        );
        assert_eq!(
            typed(AggregateType::new("A:B")),
            Err(ValidationError::AggregateTypeContainsColon("A:B".into()))
        );
        assert!(AggregateType::new("x".repeat(201)).is_err());
        assert_eq!(
            typed(AggregateType::new("StockItem").map(|t| t.0)),
            Ok("StockItem".into())
        );
    }
}
