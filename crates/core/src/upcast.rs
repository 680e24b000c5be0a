//! Events that change shape: a schema version stored with every event, and upcasters that lift
//! an old payload to the current shape as it is read.
//!
//! An event's payload is stored once and never rewritten. When the code that reads an event
//! type needs a new shape (`{"amount": 5}` becomes `{"amount": {"value": 5, "currency":
//! "EUR"}}`), the writer marks new events with the new schema version
//! ([`NewEvent::with_schema_version`]), and every reader is given an upcaster from the old
//! version to the next one ([`Upcasters::with`]). The stores apply them on read — the event
//! store's loads (so the command runner and the combiner), the perspective store's claims,
//! batches, rewinds and rebuilds (so the worker) — and domain code (`Decider::decode`,
//! `Perspective::apply`) only ever sees the current shape of each type.
//!
//! - A stored event of version `v` is lifted by the upcaster registered for `(type, v)`, then
//!   by the one for `(type, v + 1)`, and so on while there is one. Its
//!   [`RecordedEvent::schema_version`] is then the version it was lifted to.
//! - An event stored with a version no upcaster starts from (current, or newer than this build
//!   knows) is read as stored.
//! - An upcaster that fails is an error **of that event**: a load fails with
//!   [`ErrorKind::InvalidInput`] naming the event, and the worker parks the pair at the event
//!   as for any event it cannot read, so an operator can repair or skip it.
//! - An upcaster must be a pure function of the payload: it runs again on every read.
//!
//! ```
//! use lockstep_core::{NewEvent, RecordedEvent, StreamId, Upcasters, Uuid, serde_json::json};
//!
//! // Version 2 of "Deposited" carries a currency; version 1 was euros only.
//! let upcasters = Upcasters::new().with("Deposited", 1, |mut payload| {
//!     let amount = payload["amount"].take();
//!     payload["amount"] = json!({ "value": amount, "currency": "EUR" });
//!     Ok(payload)
//! })?;
//!
//! let stored = RecordedEvent {
//!     event_id: Uuid::now_v7(),
//!     stream_id: StreamId::new_v7(),
//!     version: 1,
//!     event_type: "Deposited".into(),
//!     payload: json!({ "amount": 5 }),
//!     recorded_at: lockstep_core::OffsetDateTime::UNIX_EPOCH,
//!     schema_version: 1,
//! };
//! let read = upcasters.upcast(stored)?;
//! assert_eq!(read.payload, json!({ "amount": { "value": 5, "currency": "EUR" } }));
//! assert_eq!(read.schema_version, 2);
//!
//! // New events are written in the new shape, marked as such.
//! let new = NewEvent::new("Deposited", json!({ "amount": { "value": 7, "currency": "EUR" } }))?
//!     .with_schema_version(2)?;
//! assert_eq!(new.schema_version(), 2);
//! # Ok::<(), lockstep_core::Error>(())
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

use crate::error::{BoxError, Error, ErrorKind, Result, ValidationError};
use crate::event_store::{NewEvent, RecordedEvent};

/// One upcaster: the payload of version `v` in, the payload of version `v + 1` out.
type UpcastFn =
    dyn Fn(serde_json::Value) -> std::result::Result<serde_json::Value, BoxError> + Send + Sync;

/// The upcasters of an application, per event type and the version each lifts from. Cheap to
/// clone (clones share them); empty by default, which reads every event as stored. See the
/// [module docs](self).
#[derive(Clone, Default)]
pub struct Upcasters {
    by_type: Arc<HashMap<String, BTreeMap<u32, Arc<UpcastFn>>>>,
}

impl Upcasters {
    /// No upcasters: every event is read as stored.
    pub fn new() -> Upcasters {
        Upcasters::default()
    }

    /// Adds the upcaster that lifts a payload of `event_type` from schema version
    /// `from_version` to `from_version + 1`. Refused ([`ErrorKind::InvalidInput`]): a blank
    /// type, `from_version` 0 or at [`NewEvent::MAX_SCHEMA_VERSION`] (there is no next one),
    /// and a second upcaster for the same type and version.
    pub fn with<F>(mut self, event_type: &str, from_version: u32, upcaster: F) -> Result<Upcasters>
    where
        F: Fn(serde_json::Value) -> std::result::Result<serde_json::Value, BoxError>
            + Send
            + Sync
            + 'static,
    {
        if event_type.trim().is_empty() {
            return Err(ValidationError::BlankEventType.into());
        }
        if from_version == 0 || from_version >= NewEvent::MAX_SCHEMA_VERSION {
            return Err(ValidationError::SchemaVersionOutOfRange {
                version: u64::from(from_version),
            }
            .into());
        }
        let versions = Arc::make_mut(&mut self.by_type)
            .entry(event_type.to_owned())
            .or_default();
        if versions.contains_key(&from_version) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "an upcaster of {event_type:?} from version {from_version} is registered already"
                ),
            ));
        }
        versions.insert(from_version, Arc::new(upcaster));
        Ok(self)
    }

    /// Whether there is no upcaster at all.
    pub fn is_empty(&self) -> bool {
        self.by_type.is_empty()
    }

    /// The version a payload of `event_type` stored at `stored` is read at: after every
    /// upcaster that applies in turn.
    pub fn version_read(&self, event_type: &str, stored: u32) -> u32 {
        let Some(versions) = self.by_type.get(event_type) else {
            return stored;
        };
        let mut version = stored;
        while versions.contains_key(&version) {
            version += 1;
        }
        version
    }

    /// `event` in the current shape of its type: lifted by every upcaster from its schema
    /// version on, in turn (unchanged when none applies). An upcaster's failure is an
    /// [`ErrorKind::InvalidInput`] error that names the event and the version it failed at,
    /// with the upcaster's error as its source.
    pub fn upcast(&self, mut event: RecordedEvent) -> Result<RecordedEvent> {
        let Some(versions) = self.by_type.get(event.event_type.as_str()) else {
            return Ok(event);
        };
        while let Some(upcaster) = versions.get(&event.schema_version) {
            let payload = std::mem::take(&mut event.payload);
            event.payload = upcaster(payload).map_err(|source| {
                Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "event {} ({} version {}) could not be upcast",
                        event.event_id, event.event_type, event.schema_version
                    ),
                )
                .with_source(source)
            })?;
            event.schema_version += 1;
        }
        Ok(event)
    }
}

// The registry is never changed after it is built (clones share it read-only) and its functions
// are `Fn + Sync`, so a panic inside one leaves nothing half-updated that a later read could
// observe: a store holding it stays as unwind-safe as it was without it.
impl std::panic::UnwindSafe for Upcasters {}
impl std::panic::RefUnwindSafe for Upcasters {}

impl fmt::Debug for Upcasters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_map();
        for (event_type, versions) in self.by_type.iter() {
            list.entry(event_type, &versions.keys().collect::<Vec<_>>());
        }
        list.finish()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use time::OffsetDateTime;
    use uuid::Uuid;

    use super::*;
    use crate::ids::StreamId;

    fn stored(event_type: &str, schema_version: u32, payload: serde_json::Value) -> RecordedEvent {
        RecordedEvent {
            event_id: Uuid::now_v7(),
            stream_id: StreamId::new_v7(),
            version: 1,
            event_type: event_type.into(),
            payload,
            recorded_at: OffsetDateTime::UNIX_EPOCH,
            schema_version,
        }
    }

    fn chain() -> Upcasters {
        Upcasters::new()
            .with("Deposited", 1, |p| {
                Ok(json!({ "amount": p["amount"], "v": 2 }))
            })
            .expect("valid")
            .with("Deposited", 2, |p| {
                Ok(json!({ "amount": { "value": p["amount"], "currency": "EUR" }, "v": 3 }))
            })
            .expect("valid")
    }

    #[test]
    fn an_old_event_is_lifted_through_every_version_in_turn() {
        let read = chain()
            .upcast(stored("Deposited", 1, json!({ "amount": 5 })))
            .expect("valid");
        assert_eq!(read.schema_version, 3);
        assert_eq!(
            read.payload,
            json!({ "amount": { "value": 5, "currency": "EUR" }, "v": 3 })
        );
        let from_two = chain()
            .upcast(stored("Deposited", 2, json!({ "amount": 7 })))
            .expect("valid");
        assert_eq!(from_two.schema_version, 3);
        assert_eq!(from_two.payload["amount"]["value"], 7);
        assert_eq!(chain().version_read("Deposited", 1), 3);
        assert_eq!(chain().version_read("Withdrawn", 1), 1);
    }

    #[test]
    fn current_newer_and_other_events_read_as_stored() {
        for event in [
            stored("Deposited", 3, json!({ "amount": 1 })),
            stored("Deposited", 9, json!({ "x": 1 })),
            stored("Withdrawn", 1, json!({ "amount": 1 })),
        ] {
            assert_eq!(chain().upcast(event.clone()).expect("valid"), event);
        }
        let event = stored("Deposited", 1, json!({ "amount": 1 }));
        assert_eq!(
            Upcasters::new().upcast(event.clone()).expect("valid"),
            event
        );
    }

    #[test]
    fn a_failing_upcaster_is_an_error_of_that_event() {
        let upcasters = Upcasters::new()
            .with("Deposited", 1, |_| Err("no amount".into()))
            .expect("valid");
        let event = stored("Deposited", 1, json!({}));
        let err = upcasters.upcast(event.clone()).expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert!(
            err.to_string().contains(&event.event_id.to_string()),
            "{err}"
        );
        assert!(err.to_string().contains("version 1"), "{err}");
        assert_eq!(
            std::error::Error::source(&err).map(ToString::to_string),
            Some("no amount".to_owned())
        );
    }

    #[test]
    fn bad_registrations_are_refused() {
        let ok = |p| Ok(p);
        for err in [
            Upcasters::new().with(" ", 1, ok).expect_err("refused"),
            Upcasters::new().with("A", 0, ok).expect_err("refused"),
            Upcasters::new()
                .with("A", NewEvent::MAX_SCHEMA_VERSION, ok)
                .expect_err("refused"),
            chain().with("Deposited", 2, ok).expect_err("refused"),
        ] {
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        }
        // A refused registration leaves the clone it came from as it was.
        let upcasters = chain();
        let _ = upcasters.clone().with("Deposited", 1, ok);
        assert_eq!(upcasters.version_read("Deposited", 1), 3);
    }

    #[test]
    fn schema_versions_of_new_events_are_checked() {
        let event = NewEvent::new("A", json!({})).expect("valid");
        assert_eq!(event.schema_version(), 1);
        assert_eq!(
            event
                .clone()
                .with_schema_version(4)
                .expect("valid")
                .schema_version(),
            4
        );
        for bad in [0, NewEvent::MAX_SCHEMA_VERSION + 1] {
            let err = event.clone().with_schema_version(bad).expect_err("refused");
            assert_eq!(
                err.validation(),
                Some(&ValidationError::SchemaVersionOutOfRange {
                    version: u64::from(bad)
                })
            );
        }
    }
}
