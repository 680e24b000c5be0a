//! Purge under a `purge` lease (the reserved reason): the pair's state, snapshots and
//! pending work are deleted and its cursor reset; a table perspective's rows for the stream are
//! reset in the same transaction.
use lockstep_core::Pair;
use lockstep_core::{
    LeaseId, LockReason, PerspectiveName, PerspectiveStore, Result, StreamId, Transaction,
    TransactionSource,
};
use tracing::Instrument;

use super::{Kind, PerspectiveWorker, PurgeOutcome, release};
use crate::lease::Leased;

impl<S, P> PerspectiveWorker<S, P>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    /// Purges a pair under a `purge` lease (the reserved reason): its state, snapshots
    /// and pending work are deleted and its cursor reset (see
    /// [`lockstep_core::PairWork::purge`]). Without a locker it runs unlocked.
    pub async fn purge(&self, stream_id: StreamId, name: &PerspectiveName) -> Result<PurgeOutcome> {
        let span = tracing::info_span!("purge", stream_id = %stream_id, perspective = %name, reason = "purge");
        async move {
            let _pair = self.coordinator.lock(stream_id, name).await;
            let lease = match &self.keeper {
                Some(keeper) => match keeper
                    .try_acquire(stream_id, name, &LockReason::Purge)
                    .await?
                {
                    // Another task of this instance holds the lease: busy, not ours to release.
                    Leased::Acquired(lease) if lease.lease().reentered => {
                        lease.leave();
                        return Ok(PurgeOutcome::Busy);
                    }
                    Leased::Acquired(lease) => Some(lease),
                    Leased::Denied(holder) => return Ok(PurgeOutcome::Denied(holder)),
                    Leased::Busy => return Ok(PurgeOutcome::Busy),
                    Leased::NoCursor => return Ok(PurgeOutcome::NoCursor),
                },
                None => None,
            };
            let fence: Option<LeaseId> = lease.as_ref().map(|l| l.id().clone());
            let purged: Result<bool> = async {
                let tx = self.source.begin().await?;
                let exists = self
                    .store
                    .cursor(&tx, &Pair::new(stream_id, name.clone()))
                    .await?
                    .is_some();
                if exists {
                    self.store
                        .purge(&tx, &Pair::new(stream_id, name.clone()), fence.as_ref())
                        .await?;
                    // A table perspective's rows go with its cursor, in the same transaction.
                    if let Some(Kind::Table(p)) = self.kind(name) {
                        self.table_reset_for_purge(&tx, stream_id, &p).await?;
                    }
                }
                tx.commit().await?;
                Ok(exists)
            }
            .await;
            if let Some(lease) = lease {
                release(lease).await;
            }
            Ok(if purged? {
                PurgeOutcome::Purged
            } else {
                PurgeOutcome::NoCursor
            })
        }
        .instrument(span)
        .await
    }
}
