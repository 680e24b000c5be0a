//! Bootstrap: a pair that has applied events but no snapshot gets one, under a `bootstrap`
//! lease when it can be had and without one when not (graceful degradation: the save
//! is idempotent and fenced by the cursor's revision); only a lease it acquired is released.
use lockstep_core::Pair;
use lockstep_core::{
    Error, LockReason, PerspectiveName, PerspectiveStore, Result, StreamId, Transaction,
    TransactionSource,
};

use super::{PerspectiveWorker, release};
use crate::lease::Leased;
use crate::telemetry::{self, count};

impl<S, P> PerspectiveWorker<S, P>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    /// Bootstrap: snapshot a pair that has applied events but no snapshot (see the module
    /// docs). Returns whether a snapshot was written.
    pub(super) async fn bootstrap(
        &self,
        stream_id: StreamId,
        name: &PerspectiveName,
        revision: i64,
    ) -> Result<bool> {
        let lease = match &self.keeper {
            Some(keeper) => match keeper
                .try_acquire(stream_id, name, &LockReason::Bootstrap)
                .await
            {
                // Joined, not taken (another task of this instance holds it): proceed without
                // it, as when it is denied, and leave it to its holder.
                Ok(Leased::Acquired(lease)) if lease.lease().reentered => {
                    lease.leave();
                    None
                }
                Ok(Leased::Acquired(lease)) => Some(lease),
                // Graceful degradation: proceed without the lease; the save is
                // idempotent and refused if the cursor moved on.
                Ok(Leased::Denied(_) | Leased::Busy | Leased::NoCursor) => None,
                Err(err) => {
                    tracing::debug!(error = %err, "bootstrap lease unavailable; proceeding without");
                    None
                }
            },
            None => None,
        };
        let fence = lease.as_ref().map(|l| l.id().clone());
        let saved = async {
            let tx = self.source.begin().await?;
            let saved = self
                .store
                .save_snapshot(
                    &tx,
                    &Pair::new(stream_id, name.clone()),
                    revision,
                    fence.as_ref(),
                )
                .await?;
            tx.commit().await?;
            Ok::<_, Error>(saved)
        }
        .await;
        if let Some(lease) = lease {
            release(lease).await;
        }
        let saved = saved?;
        if saved {
            count(telemetry::BOOTSTRAPS, name.as_str(), 1);
        }
        Ok(saved)
    }
}
