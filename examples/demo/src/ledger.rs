//! The sample perspective of the demo and of `lockstep-demo worker`: a ledger per stream, the list of
//! amounts in event-id order. Order-sensitive on purpose — a late event applied at the end
//! instead of in its place would show.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use lockstep_core::{NewEvent, Perspective, PerspectiveName, RecordedEvent};
use serde::{Deserialize, Serialize};

/// The ledger's name.
pub(crate) const LEDGER: &str = "Ledger";

/// The perspective's name, validated.
pub(crate) fn ledger_name() -> PerspectiveName {
    PerspectiveName::new(LEDGER).unwrap_or_else(|e| unreachable!("{LEDGER} is valid: {e}"))
}

/// The state of one stream.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Entries {
    /// Amounts in event-id order.
    pub(crate) amounts: Vec<i64>,
}

/// The ledger perspective. `slow` (microseconds per event) makes `apply` take time, so that a
/// rewind lasts long enough to watch its lease.
#[derive(Debug, Clone, Default)]
pub(crate) struct Ledger {
    pub(crate) slow: Arc<AtomicU64>,
    /// While set, `apply` stalls (a process paused mid-work: a long GC pause, SIGSTOP, a VM
    /// migration).
    pub(crate) stalled: Arc<AtomicBool>,
}

/// The payload does not carry an amount.
#[derive(Debug)]
pub(crate) struct NotAnAmount;

impl std::fmt::Display for NotAnAmount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the event has no integer amount")
    }
}

impl std::error::Error for NotAnAmount {}

impl Perspective for Ledger {
    type State = Entries;
    type Error = NotAnAmount;

    fn name(&self) -> &str {
        LEDGER
    }

    fn apply(&self, state: &mut Entries, event: &RecordedEvent) -> Result<(), NotAnAmount> {
        if event.event_type != ENTERED {
            return Ok(()); // another aggregate's event in the same store: not a ledger line
        }
        while self.stalled.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let micros = self.slow.load(Ordering::Relaxed);
        if micros > 0 {
            // A CPU-heavy projection, simulated (apply is synchronous by contract).
            std::thread::sleep(Duration::from_micros(micros));
        }
        let amount = event.payload["amount"].as_i64().ok_or(NotAnAmount)?;
        state.amounts.push(amount);
        Ok(())
    }
}

/// The event type the ledger folds; it ignores every other.
pub(crate) const ENTERED: &str = "Entered";

/// A ledger event for `amount`.
pub(crate) fn entry(amount: i64) -> NewEvent {
    NewEvent::new(ENTERED, serde_json::json!({ "amount": amount }))
        .unwrap_or_else(|e| unreachable!("a plain JSON payload is valid: {e}"))
}

/// The fold of `events` (any order) in event-id order.
pub(crate) fn fold(events: &[RecordedEvent]) -> Entries {
    let mut sorted: Vec<&RecordedEvent> = events.iter().collect();
    sorted.sort_by_key(|e| e.event_id);
    Entries {
        amounts: sorted
            .iter()
            .filter(|e| e.event_type == ENTERED)
            .filter_map(|e| e.payload["amount"].as_i64())
            .collect(),
    }
}
