//! The `StockItem` aggregate as a [`Decider`], for the command combiner
//! (`lockstep-combiner`): `decide` is [`StockItem::reserve`], `evolve` is [`StockItem::apply`].
//! Domain code: it imports `lockstep-core` only.

use lockstep_core::{AggregateType, Decider, Error, ErrorKind, NewEvent, RecordedEvent};
use uuid::Uuid;

use crate::domain::{InventoryError, STOCK_ITEM, StockEvent, StockItem};

/// A reservation for the combiner: the SKU is the aggregate id given to `submit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserve {
    /// Units to reserve.
    pub quantity: u32,
    /// The reservation's id.
    pub reservation_id: Uuid,
}

/// `StockItem` as a decider.
#[derive(Debug, Clone)]
pub struct StockItemDecider {
    ty: AggregateType,
}

impl Default for StockItemDecider {
    fn default() -> Self {
        StockItemDecider {
            // STOCK_ITEM is a valid aggregate type (not blank, no ':').
            ty: AggregateType::new(STOCK_ITEM).unwrap_or_else(|e| unreachable!("{e}")),
        }
    }
}

impl Decider for StockItemDecider {
    type State = StockItem;
    type Command = Reserve;
    type Event = StockEvent;
    type Error = InventoryError;

    fn aggregate_type(&self) -> &AggregateType {
        &self.ty
    }

    fn initial_state(&self, id: Uuid) -> StockItem {
        StockItem::new(id)
    }

    async fn decide(
        &self,
        item: &StockItem,
        cmd: &Reserve,
    ) -> Result<Vec<StockEvent>, InventoryError> {
        Ok(vec![item.reserve(cmd.quantity, cmd.reservation_id)?])
    }

    fn evolve(&self, mut item: StockItem, event: &StockEvent) -> StockItem {
        item.apply(event);
        item
    }

    fn encode(&self, event: &StockEvent) -> lockstep_core::Result<NewEvent> {
        event.to_new_event().map_err(|e| match e {
            InventoryError::Store(e) => e,
            other => Error::new(ErrorKind::InvalidInput, other.to_string()),
        })
    }

    fn decode(&self, event: &RecordedEvent) -> lockstep_core::Result<StockEvent> {
        StockEvent::from_recorded(event).map_err(|e| Error::new(ErrorKind::Backend, e.to_string()))
    }
}
