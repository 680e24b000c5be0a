//! The decider contract: an aggregate as two pure functions — `decide(state, command)` returns
//! the events a command causes (or the application's own business error), `evolve(state,
//! event)` returns the state after an event — plus how its events are stored.
//!
//! A handler written on the lock (lock, load, fold, decide, append, commit) needs nothing more
//! than these functions, and neither does the command combiner (`lockstep-combiner`), which
//! decides many queued commands of one aggregate in turn, each on the state the previous ones
//! left, under one lock and one commit. The contract has no driver and no runtime.
//!
//! `decide` is a future so that a decision may wait (look a price up, run CPU-heavy work on a
//! blocking thread) without blocking the runtime; a pure decision is an `async fn` that never
//! awaits. It must have **no side effects**: a runner may decide the same command again on a
//! new attempt (after a conflict or a lost connection), on whatever state that attempt loads.
//!
//! ```
//! use lockstep_core::{AggregateType, Decider, NewEvent, RecordedEvent, Result};
//! use lockstep_core::serde_json::json;
//!
//! /// A counter that never goes past its limit.
//! struct Counter { ty: AggregateType, limit: u64 }
//!
//! impl Decider for Counter {
//!     type State = u64;
//!     type Command = u64; // add this much
//!     type Event = u64; // added this much
//!     type Error = String; // the business answer
//!
//!     fn aggregate_type(&self) -> &AggregateType { &self.ty }
//!     fn initial_state(&self, _id: lockstep_core::Uuid) -> u64 { 0 }
//!     async fn decide(&self, state: &u64, add: &u64) -> std::result::Result<Vec<u64>, String> {
//!         if state + add > self.limit { Err(format!("only {} left", self.limit - state)) }
//!         else { Ok(vec![*add]) }
//!     }
//!     fn evolve(&self, state: u64, added: &u64) -> u64 { state + added }
//!     fn encode(&self, added: &u64) -> Result<NewEvent> {
//!         NewEvent::new("Added", json!({ "n": added }))
//!     }
//!     fn decode(&self, event: &RecordedEvent) -> Result<u64> {
//!         Ok(event.payload["n"].as_u64().unwrap_or(0))
//!     }
//! }
//! let counter = Counter { ty: AggregateType::new("Counter")?, limit: 3 };
//! assert_eq!(counter.evolve(counter.initial_state(lockstep_core::Uuid::nil()), &2), 2);
//! # Ok::<(), lockstep_core::Error>(())
//! ```

use std::future::Future;

use uuid::Uuid;

use crate::error::Result;
use crate::event_store::{NewEvent, RecordedEvent};
use crate::ids::AggregateType;
use crate::snapshot::SnapshotPolicy;

/// An aggregate as a decider: its type, its initial state, `decide`, `evolve`, and the mapping
/// of its events to and from the store. See the [module docs](self).
pub trait Decider: Send + Sync {
    /// The aggregate's state, folded from its events.
    type State: Send + Sync;
    /// What a caller asks for.
    type Command: Send + Sync;
    /// What happened (the domain's event type).
    type Event: Send + Sync;
    /// The business answer when a command is refused ("insufficient stock"): never retried.
    type Error: Send;

    /// The aggregate type: the `{type}` of the write-lock key `relay:aggregate:{type}:{id}`.
    fn aggregate_type(&self) -> &AggregateType;

    /// The state of aggregate `id` before its first event.
    fn initial_state(&self, id: Uuid) -> Self::State;

    /// The events `command` causes on `state` (none is a valid answer), or the business error.
    /// No side effects: it may run again for the same command on a new attempt.
    fn decide<'a>(
        &'a self,
        state: &'a Self::State,
        command: &'a Self::Command,
    ) -> impl Future<Output = std::result::Result<Vec<Self::Event>, Self::Error>> + Send + 'a;

    /// The state after `event`.
    fn evolve(&self, state: Self::State, event: &Self::Event) -> Self::State;

    /// The event as stored. An event that cannot be stored is an
    /// [`crate::ErrorKind::InvalidInput`] error (from [`NewEvent::new`]); the command that
    /// decided it is then refused with that error and nothing of it is appended.
    fn encode(&self, event: &Self::Event) -> Result<NewEvent>;

    /// A stored event read back. An event that does not read back (a corrupt or foreign
    /// stream) is an error of the implementor's choice of kind; it fails the whole load.
    fn decode(&self, event: &RecordedEvent) -> Result<Self::Event>;

    /// Whether, when and how the state is snapshotted (see [`crate::snapshot`]). The default,
    /// `None`: never; every command folds the whole stream. A runner asks once per command.
    /// With a snapshot, the events after it are folded onto the snapshot's state with
    /// [`Decider::decode`] and [`Decider::evolve`] (an override of [`Decider::fold`] folds
    /// whole streams only).
    fn snapshots(&self) -> Option<SnapshotPolicy<Self::State>> {
        None
    }

    /// Folds a loaded stream: [`Decider::initial_state`], then [`Decider::evolve`] with every
    /// event read back by [`Decider::decode`].
    fn fold(&self, id: Uuid, events: &[RecordedEvent]) -> Result<Self::State> {
        events
            .iter()
            .try_fold(self.initial_state(id), |state, recorded| {
                Ok(self.evolve(state, &self.decode(recorded)?))
            })
    }
}
