//! Perspectives: read models built from events, written by the application.
//!
//! A [`Perspective`] is a name, a state type (serde, with a `Default` for "no events yet") and a
//! pure `apply(state, event)`. It applies a stream's events in **event-id order** (UUIDv7, so
//! normally append order). An event whose id sorts before events the perspective already
//! applied to that stream — an import with caller-chosen ids, an offline client, a replica —
//! is a *late arrival*: the worker then rewinds the pair (restores the latest snapshot before
//! it and replays), under a stream lease (see [`crate::stream_lease`]).
//!
//! `apply` must be deterministic: a rewind replays the same events and must reach the same
//! state. A failing `apply` is an error of that `(stream, perspective)` pair only: the worker
//! records it on the pair's cursor and keeps serving every other pair.
//!
//! The worker runs perspectives of different state types side by side, so it holds them as
//! [`DynPerspective`] (state as JSON); every [`Perspective`] is one through a blanket impl.
//!
//! ```
//! use lockstep_core::{Perspective, RecordedEvent};
//!
//! /// How many units of each SKU were reserved.
//! struct Reserved;
//!
//! impl Perspective for Reserved {
//!     type State = u64;
//!     type Error = serde_json::Error;
//!
//!     fn name(&self) -> &str {
//!         "Reserved"
//!     }
//!
//!     fn apply(&self, state: &mut u64, event: &RecordedEvent) -> Result<(), serde_json::Error> {
//!         if event.event_type == "StockReserved" {
//!             *state += event.payload["quantity"].as_u64().unwrap_or(0);
//!         }
//!         Ok(())
//!     }
//! }
//! ```

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::apply_error::ApplyError;
use crate::error::{Error, ErrorKind, Result};
use crate::event_store::RecordedEvent;
use crate::ids::PerspectiveName;
use crate::perspective_version::{VersionDeclaration, VersionPolicy};
use crate::table_perspective::{DynTablePerspective, TablePerspective};

/// A read model: folds a stream's events, in event-id order, into a state.
pub trait Perspective: Send + Sync + 'static {
    /// The state of one stream in this perspective. `Default` is the state before any event.
    type State: Serialize + DeserializeOwned + Default + Send + Sync;
    /// What a failing `apply` reports (stored on the pair's cursor as text).
    type Error: std::error::Error + Send + Sync + 'static;

    /// The perspective's name: the key of its cursors, leases and states. Must be a valid
    /// [`PerspectiveName`] (not blank, at most 200 characters, no NUL, no look-alike: no
    /// whitespace at either end, no control or format character, in NFC).
    fn name(&self) -> &str;

    /// The version of this perspective's code (1 unless overridden). A new version of a
    /// perspective registered beside the serving one is built beside it, under the stored
    /// name [`PerspectiveName::versioned`], and takes over once promoted; see
    /// [`crate::perspective_version`].
    fn version(&self) -> u32 {
        1
    }

    /// Applies one event to the state. Deterministic: a replay must reach the same state.
    fn apply(&self, state: &mut Self::State, event: &RecordedEvent) -> Result<(), Self::Error>;
}

/// A perspective with its state erased to JSON, as the worker holds it.
pub trait DynPerspective: Send + Sync {
    /// The perspective's name, as given by [`Perspective::name`].
    fn name(&self) -> &str;

    /// The version of its code, as given by [`Perspective::version`].
    fn version(&self) -> u32 {
        1
    }

    /// The state before any event, as JSON.
    fn initial_state(&self) -> Result<serde_json::Value>;

    /// Applies `events` in the given order to `state` (JSON). On failure, names the event that
    /// failed; `state` is left as it was before the call.
    fn apply_all(
        &self,
        state: &mut serde_json::Value,
        events: &[RecordedEvent],
    ) -> Result<(), ApplyError>;

    /// Applies `events` in order to `state` while `go_on()` says so, asking before each event:
    /// a long replay can then be stopped within one event (a lost lease, a shutdown). Returns
    /// how many events were applied; `state` is the fold of exactly those. On failure, names
    /// the event that failed; `state` is left as it was before the call — also when the
    /// perspective's code panics (the worker catches the panic and folds again one event at a
    /// time from that state to find the event to blame).
    ///
    /// The default calls [`DynPerspective::apply_all`] one event at a time, and puts the state
    /// back while unwinding from a panic in it; the implementation for every [`Perspective`]
    /// decodes and encodes the state once per call instead (a panic leaves its copy behind).
    fn apply_while(
        &self,
        state: &mut serde_json::Value,
        events: &[RecordedEvent],
        go_on: &dyn Fn() -> bool,
    ) -> Result<usize, ApplyError> {
        let mut guard = RestoreUnlessDone {
            before: Some(state.clone()),
            state,
        };
        for (applied, event) in events.iter().enumerate() {
            if !go_on() {
                guard.before = None;
                return Ok(applied);
            }
            // On an error the guard puts the state back as it goes, as it does on a panic.
            self.apply_all(guard.state, std::slice::from_ref(event))?;
        }
        guard.before = None;
        Ok(events.len())
    }
}

/// Puts `before` back into `state` when dropped while still holding it: on an early return with
/// an error, and while unwinding from a panic.
struct RestoreUnlessDone<'a> {
    state: &'a mut serde_json::Value,
    before: Option<serde_json::Value>,
}

impl Drop for RestoreUnlessDone<'_> {
    fn drop(&mut self) {
        if let Some(before) = self.before.take() {
            *self.state = before;
        }
    }
}

impl<P: Perspective> DynPerspective for P {
    fn name(&self) -> &str {
        Perspective::name(self)
    }

    fn version(&self) -> u32 {
        Perspective::version(self)
    }

    fn initial_state(&self) -> Result<serde_json::Value> {
        serde_json::to_value(P::State::default()).map_err(|e| {
            Error::new(
                ErrorKind::InvalidInput,
                "the perspective's default state does not serialize to JSON",
            )
            .with_source(e)
        })
    }

    fn apply_all(
        &self,
        state: &mut serde_json::Value,
        events: &[RecordedEvent],
    ) -> Result<(), ApplyError> {
        self.apply_while(state, events, &|| true).map(|_| ())
    }

    fn apply_while(
        &self,
        state: &mut serde_json::Value,
        events: &[RecordedEvent],
        go_on: &dyn Fn() -> bool,
    ) -> Result<usize, ApplyError> {
        let mut typed: P::State =
            serde_json::from_value(state.clone()).map_err(|e| ApplyError::State {
                detail: e.to_string(),
            })?;
        let mut applied = 0;
        for event in events {
            if !go_on() {
                break;
            }
            self.apply(&mut typed, event)
                .map_err(|e| ApplyError::Apply {
                    event_id: event.event_id,
                    detail: e.to_string(),
                })?;
            applied += 1;
        }
        *state = serde_json::to_value(typed).map_err(|e| ApplyError::State {
            detail: e.to_string(),
        })?;
        Ok(applied)
    }
}

/// A table perspective by its stored name, as [`PerspectiveRegistry::tables`] lists them.
pub type NamedTable<Tx> = (PerspectiveName, Arc<dyn DynTablePerspective<Tx>>);

/// The perspectives a worker runs, by stored name: JSON perspectives ([`Perspective`]) and
/// table perspectives ([`crate::TablePerspective`]), one namespace for both kinds. Two versions
/// of one perspective are two entries, stored under their own names
/// ([`PerspectiveName::versioned`]: `Statement` and `Statement@v2`).
#[derive(Clone, Default)]
pub struct PerspectiveRegistry {
    entries: Vec<Registered>,
}

/// One registered perspective version.
#[derive(Clone)]
struct Registered {
    /// The name it is stored under.
    stored: PerspectiveName,
    /// Its perspective's name, its version and its promotion policy.
    declaration: VersionDeclaration,
    entry: Entry,
}

/// One registered perspective.
#[derive(Clone)]
enum Entry {
    Json(Arc<dyn DynPerspective>),
    /// An `Arc<dyn DynTablePerspective<Tx>>` behind `Any` (the registry is not generic over the
    /// transaction type; the worker takes it back out for its own), and `Tx`'s name for the
    /// error when the worker's transaction type is another.
    Table {
        perspective: Arc<dyn Any + Send + Sync>,
        tx_type: &'static str,
    },
}

impl fmt::Debug for PerspectiveRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|r| r.stored.as_str()))
            .finish()
    }
}

impl PerspectiveRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        PerspectiveRegistry::default()
    }

    /// Adds `perspective` (its [`Perspective::version`], promoted as
    /// [`VersionPolicy::default`] says when it is a new version). Fails with
    /// [`ErrorKind::InvalidInput`] when its name is not a valid [`PerspectiveName`], ends in a
    /// version suffix (`@v2`: the stored names of later versions), or is already registered
    /// with that version, and when its version is 0.
    pub fn register<P: Perspective>(&mut self, perspective: P) -> Result<&mut Self> {
        self.register_dyn(Arc::new(perspective))
    }

    /// [`PerspectiveRegistry::register`] with the promotion policy of a new version.
    pub fn register_with<P: Perspective>(
        &mut self,
        perspective: P,
        policy: VersionPolicy,
    ) -> Result<&mut Self> {
        self.register_dyn_with(Arc::new(perspective), policy)
    }

    /// Adds a perspective already erased to [`DynPerspective`].
    pub fn register_dyn(&mut self, perspective: Arc<dyn DynPerspective>) -> Result<&mut Self> {
        self.register_dyn_with(perspective, VersionPolicy::default())
    }

    /// [`PerspectiveRegistry::register_dyn`] with the promotion policy of a new version.
    pub fn register_dyn_with(
        &mut self,
        perspective: Arc<dyn DynPerspective>,
        policy: VersionPolicy,
    ) -> Result<&mut Self> {
        let (stored, declaration) =
            self.new_version(perspective.name(), perspective.version(), policy)?;
        self.entries.push(Registered {
            stored,
            declaration,
            entry: Entry::Json(perspective),
        });
        Ok(self)
    }

    /// Adds a table perspective that runs in transactions of type `Tx` (the worker's
    /// `TransactionSource::Tx`: `lockstep_pg::PgTransaction` on Postgres, the testkit's
    /// `FakeTransaction` on the fakes). Fails with [`ErrorKind::InvalidInput`] as
    /// [`PerspectiveRegistry::register`] does; a worker on another transaction type refuses
    /// the registry when it is built.
    pub fn register_table<Tx, T>(&mut self, perspective: T) -> Result<&mut Self>
    where
        Tx: Sync + 'static,
        T: TablePerspective<Tx>,
    {
        self.register_table_with(perspective, VersionPolicy::default())
    }

    /// [`PerspectiveRegistry::register_table`] with the promotion policy of a new version.
    pub fn register_table_with<Tx, T>(
        &mut self,
        perspective: T,
        policy: VersionPolicy,
    ) -> Result<&mut Self>
    where
        Tx: Sync + 'static,
        T: TablePerspective<Tx>,
    {
        let (stored, declaration) = self.new_version(
            TablePerspective::name(&perspective),
            TablePerspective::version(&perspective),
            policy,
        )?;
        let erased: Arc<dyn DynTablePerspective<Tx>> = Arc::new(perspective);
        self.entries.push(Registered {
            stored,
            declaration,
            entry: Entry::Table {
                perspective: Arc::new(erased),
                tx_type: std::any::type_name::<Tx>(),
            },
        });
        Ok(self)
    }

    fn new_version(
        &self,
        name: &str,
        version: u32,
        policy: VersionPolicy,
    ) -> Result<(PerspectiveName, VersionDeclaration)> {
        let name = PerspectiveName::new(name)?;
        if name.version_suffix().is_some() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "perspective name {name} ends in a version suffix, which names the stored \
                     versions: give the version with `version()` instead"
                ),
            ));
        }
        let stored = name.versioned(version)?;
        if self.entries.iter().any(|r| r.stored == stored) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("perspective {name} version {version} is registered twice"),
            ));
        }
        Ok((stored, VersionDeclaration::new(name, version, policy)))
    }

    /// The JSON perspective called `name` (`None` for a table perspective).
    pub fn get(&self, name: &PerspectiveName) -> Option<&Arc<dyn DynPerspective>> {
        self.entries.iter().find_map(|r| match &r.entry {
            Entry::Json(p) if &r.stored == name => Some(p),
            _ => None,
        })
    }

    /// Whether `name` is a table perspective.
    pub fn is_table(&self, name: &PerspectiveName) -> bool {
        self.entries
            .iter()
            .any(|r| &r.stored == name && matches!(r.entry, Entry::Table { .. }))
    }

    /// Every table perspective, for transactions of type `Tx`. Fails with
    /// [`ErrorKind::InvalidInput`], naming the perspective and both types, when one was
    /// registered for another transaction type.
    pub fn tables<Tx: 'static>(&self) -> Result<Vec<NamedTable<Tx>>> {
        let mut out = Vec::new();
        for Registered {
            stored: name,
            entry,
            ..
        } in &self.entries
        {
            let Entry::Table {
                perspective,
                tx_type,
            } = entry
            else {
                continue;
            };
            let Some(p) = perspective.downcast_ref::<Arc<dyn DynTablePerspective<Tx>>>() else {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "table perspective {name} was registered for transactions of type {tx_type}, \
                         but the worker runs on {}",
                        std::any::type_name::<Tx>()
                    ),
                ));
            };
            out.push((name.clone(), Arc::clone(p)));
        }
        Ok(out)
    }

    /// Every registered version's stored name, in registration order.
    pub fn names(&self) -> Vec<PerspectiveName> {
        self.entries.iter().map(|r| r.stored.clone()).collect()
    }

    /// Every registered version, in registration order (what a worker declares).
    pub fn versions(&self) -> Vec<VersionDeclaration> {
        self.entries.iter().map(|r| r.declaration.clone()).collect()
    }

    /// The registered version stored under `stored`, if any.
    pub fn version_of(&self, stored: &PerspectiveName) -> Option<&VersionDeclaration> {
        self.entries
            .iter()
            .find(|r| &r.stored == stored)
            .map(|r| &r.declaration)
    }

    /// How many perspectives are registered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is registered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use time::OffsetDateTime;
    use uuid::Uuid;

    use super::*;
    use crate::ids::StreamId;

    struct Sum;

    #[derive(Debug)]
    struct Negative;

    impl fmt::Display for Negative {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("negative amount")
        }
    }

    impl std::error::Error for Negative {}

    impl Perspective for Sum {
        type State = i64;
        type Error = Negative;

        fn name(&self) -> &str {
            "Sum"
        }

        fn apply(&self, state: &mut i64, event: &RecordedEvent) -> Result<(), Negative> {
            let n = event.payload.as_i64().unwrap_or(0);
            if n < 0 {
                return Err(Negative);
            }
            *state += n;
            Ok(())
        }
    }

    fn event(n: i64) -> RecordedEvent {
        RecordedEvent {
            event_id: Uuid::now_v7(),
            stream_id: StreamId::new_v7(),
            version: 1,
            event_type: "Added".into(),
            payload: serde_json::json!(n),
            recorded_at: OffsetDateTime::UNIX_EPOCH,
            schema_version: 1,
        }
    }

    #[test]
    fn applies_through_json_and_leaves_the_state_alone_on_failure() {
        let p: &dyn DynPerspective = &Sum;
        let mut state = p.initial_state().expect("default");
        assert_eq!(state, serde_json::json!(0));
        p.apply_all(&mut state, &[event(2), event(3)])
            .expect("applies");
        assert_eq!(state, serde_json::json!(5));
        let bad = event(-1);
        let err = p
            .apply_all(&mut state, &[event(10), bad.clone()])
            .expect_err("fails");
        assert_eq!(
            err,
            ApplyError::Apply {
                event_id: bad.event_id,
                detail: "negative amount".into()
            }
        );
        assert_eq!(state, serde_json::json!(5), "unchanged on failure");
        let mut wrong = serde_json::json!("not a number");
        assert!(matches!(
            p.apply_all(&mut wrong, &[event(1)]),
            Err(ApplyError::State { .. })
        ));
    }

    /// A perspective of its own that implements only `apply_all`, pushing into the state in
    /// place and panicking on a negative number.
    struct PushesInPlace;

    impl DynPerspective for PushesInPlace {
        fn name(&self) -> &str {
            "PushesInPlace"
        }

        fn initial_state(&self) -> crate::Result<serde_json::Value> {
            Ok(serde_json::json!([]))
        }

        fn apply_all(
            &self,
            state: &mut serde_json::Value,
            events: &[RecordedEvent],
        ) -> Result<(), ApplyError> {
            for event in events {
                if let Some(list) = state.as_array_mut() {
                    list.push(event.payload.clone());
                }
                if event.payload.as_i64().is_some_and(|n| n < 0) {
                    panic!("a negative number");
                }
            }
            Ok(())
        }
    }

    #[test]
    fn the_default_apply_while_leaves_the_state_as_it_was_when_apply_all_panics() {
        let p: &dyn DynPerspective = &PushesInPlace;
        let mut state = serde_json::json!([0]);
        let events = [event(1), event(2), event(-3)];
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.apply_while(&mut state, &events, &|| true)
        }));
        assert!(caught.is_err(), "the panic went through");
        assert_eq!(state, serde_json::json!([0]), "as it was before the call");
        // Without a panic it applies, and stopping early keeps what was applied.
        let applied = p
            .apply_while(&mut state, &events[..2], &|| true)
            .expect("applies");
        assert_eq!((applied, &state), (2, &serde_json::json!([0, 1, 2])));
        let stopped = p
            .apply_while(&mut state, &events, &|| false)
            .expect("stops");
        assert_eq!((stopped, &state), (0, &serde_json::json!([0, 1, 2])));
    }

    #[test]
    fn the_registry_refuses_duplicate_and_invalid_names() {
        let mut registry = PerspectiveRegistry::new();
        registry.register(Sum).expect("first");
        assert_eq!(
            registry.register(Sum).expect_err("twice").kind(),
            ErrorKind::InvalidInput
        );
        assert_eq!(registry.len(), 1);
        assert!(
            registry
                .get(&PerspectiveName::new("Sum").expect("valid"))
                .is_some()
        );
    }
}
