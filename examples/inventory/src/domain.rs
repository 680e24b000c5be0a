//! The `StockItem` aggregate: units stocked, units reserved, and a `reserve` decision that never
//! lets reservations exceed the stock. Pure domain code: it depends on `lockstep-core` only.

use lockstep_core::{NewEvent, RecordedEvent};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The aggregate type name, the `{type}` of the write-lock key `relay:aggregate:StockItem:{id}`.
pub const STOCK_ITEM: &str = "StockItem";

/// What happened to a stock item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum StockEvent {
    /// Units arrived.
    Stocked {
        /// How many.
        quantity: u32,
    },
    /// Units were reserved for a customer.
    Reserved {
        /// The reservation (one per command).
        reservation_id: Uuid,
        /// How many.
        quantity: u32,
    },
}

impl StockEvent {
    /// The event's type name in the store.
    pub fn event_type(&self) -> &'static str {
        match self {
            StockEvent::Stocked { .. } => "Stocked",
            StockEvent::Reserved { .. } => "Reserved",
        }
    }

    /// The event to append.
    pub fn to_new_event(&self) -> Result<NewEvent, InventoryError> {
        let payload = serde_json::to_value(self).map_err(|e| InventoryError::Corrupt {
            detail: e.to_string(),
        })?;
        NewEvent::new(self.event_type(), payload).map_err(InventoryError::Store)
    }

    /// Reads a stored event back.
    pub fn from_recorded(event: &RecordedEvent) -> Result<StockEvent, InventoryError> {
        serde_json::from_value(event.payload.clone()).map_err(|e| InventoryError::Corrupt {
            detail: format!("event {} (version {}): {e}", event.event_id, event.version),
        })
    }
}

/// One stock item (one SKU), folded from its events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StockItem {
    sku: Uuid,
    version: u64,
    stocked: u64,
    reserved: u64,
}

impl StockItem {
    /// A SKU with no events: nothing stocked, version 0.
    pub fn new(sku: Uuid) -> StockItem {
        StockItem {
            sku,
            version: 0,
            stocked: 0,
            reserved: 0,
        }
    }

    /// Folds a stream (empty: nothing stocked, version 0).
    pub fn from_events(sku: Uuid, events: &[RecordedEvent]) -> Result<StockItem, InventoryError> {
        let mut item = StockItem {
            sku,
            version: 0,
            stocked: 0,
            reserved: 0,
        };
        for event in events {
            item.apply(&StockEvent::from_recorded(event)?);
            item.version = event.version;
        }
        Ok(item)
    }

    /// The SKU.
    pub fn sku(&self) -> Uuid {
        self.sku
    }

    /// The stream version this state was folded at (the expected version of the next append).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Units ever stocked.
    pub fn stocked(&self) -> u64 {
        self.stocked
    }

    /// Units reserved.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Units still available.
    pub fn available(&self) -> u64 {
        self.stocked - self.reserved
    }

    /// Decides a reservation: the event to append, or why not. The invariant lives here — the
    /// lock only decides who decides when.
    pub fn reserve(
        &self,
        quantity: u32,
        reservation_id: Uuid,
    ) -> Result<StockEvent, InventoryError> {
        if quantity == 0 {
            return Err(InventoryError::InvalidQuantity);
        }
        if u64::from(quantity) > self.available() {
            return Err(InventoryError::InsufficientStock {
                sku: self.sku,
                requested: quantity,
                available: self.available(),
            });
        }
        Ok(StockEvent::Reserved {
            reservation_id,
            quantity,
        })
    }

    /// Applies an event to the state.
    pub fn apply(&mut self, event: &StockEvent) {
        match event {
            StockEvent::Stocked { quantity } => self.stocked += u64::from(*quantity),
            StockEvent::Reserved { quantity, .. } => self.reserved += u64::from(*quantity),
        }
    }
}

/// Why a reservation did not happen.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InventoryError {
    /// Not enough units left: a business answer, never retried.
    #[error("only {available} units of SKU {sku} are available; {requested} were requested")]
    InsufficientStock {
        /// The SKU.
        sku: Uuid,
        /// Units requested.
        requested: u32,
        /// Units available when the command decided.
        available: u64,
    },
    /// Fail-fast mode: another command is writing this SKU right now (HTTP 409 material).
    #[error("SKU {sku} is being written by another command right now")]
    Busy {
        /// The SKU.
        sku: Uuid,
    },
    /// A reservation of zero units.
    #[error("a reservation needs a positive quantity")]
    InvalidQuantity,
    /// A stored event could not be read.
    #[error("corrupt stock event: {detail}")]
    Corrupt {
        /// What was wrong.
        detail: String,
    },
    /// The store or the lock failed (after retries, if the error was retryable).
    #[error("the event store or the write lock failed")]
    Store(#[source] lockstep_core::Error),
}

impl From<lockstep_core::Error> for InventoryError {
    fn from(err: lockstep_core::Error) -> Self {
        InventoryError::Store(err)
    }
}

/// Only a store failure may go away on a new attempt; business answers never do.
impl lockstep_core::Retryable for InventoryError {
    fn is_retryable(&self) -> bool {
        matches!(self, InventoryError::Store(err) if err.is_retryable())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_core::StreamId;

    fn recorded(version: u64, event: &StockEvent) -> RecordedEvent {
        RecordedEvent {
            event_id: Uuid::now_v7(),
            stream_id: StreamId::from_uuid(Uuid::nil()),
            version,
            event_type: event.event_type().into(),
            payload: serde_json::to_value(event).expect("json"),
            recorded_at: lockstep_core::OffsetDateTime::UNIX_EPOCH,
            schema_version: 1,
        }
    }

    #[test]
    fn reserve_never_exceeds_the_available_stock() {
        let events = [
            recorded(1, &StockEvent::Stocked { quantity: 10 }),
            recorded(
                2,
                &StockEvent::Reserved {
                    reservation_id: Uuid::nil(),
                    quantity: 7,
                },
            ),
        ];
        let item = StockItem::from_events(Uuid::nil(), &events).expect("fold");
        assert_eq!((item.version(), item.available()), (2, 3));
        assert!(item.reserve(3, Uuid::nil()).is_ok());
        assert!(matches!(
            item.reserve(4, Uuid::nil()),
            Err(InventoryError::InsufficientStock { available: 3, .. })
        ));
        assert!(matches!(
            item.reserve(0, Uuid::nil()),
            Err(InventoryError::InvalidQuantity)
        ));
    }

    #[test]
    fn events_round_trip_through_json() {
        let event = StockEvent::Reserved {
            reservation_id: Uuid::now_v7(),
            quantity: 2,
        };
        let back = StockEvent::from_recorded(&recorded(1, &event)).expect("parse");
        assert_eq!(back, event);
        assert_eq!(event.to_new_event().expect("new").event_type(), "Reserved");
    }
}
