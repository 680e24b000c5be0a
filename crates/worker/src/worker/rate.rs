//! The catch-up rate: after each cycle the worker adds the events it applied per perspective
//! to the store's rolling figure ([`lockstep_core::PerspectiveLifecycle::record_applied`]) — at most once per
//! [`REPORT_EVERY`], in a transaction of its own, and only when it applied something (an idle
//! worker sends nothing). Counts that could not be reported are kept for the next report; a
//! failed report is logged, never the cycle's error.
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use lockstep_core::{PerspectiveName, PerspectiveStore, Transaction, TransactionSource};
use tokio::time::Instant;

use super::{CycleReport, PerspectiveWorker};

/// The shortest time between two reports of one worker.
pub(super) const REPORT_EVERY: Duration = Duration::from_secs(1);

/// Applied events not reported yet, and when the last report was made.
#[derive(Debug, Default)]
pub(super) struct Unreported(Mutex<(Option<Instant>, BTreeMap<PerspectiveName, u64>)>);

impl<S, P> PerspectiveWorker<S, P>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    /// Adds the cycle's applied events and reports them when the last report is old enough.
    pub(super) async fn report_applied(&self, report: &CycleReport) {
        let due: Vec<(PerspectiveName, u64)> = {
            let mut guard = self
                .applied
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let (last, counts) = &mut *guard;
            for (name, n) in &report.applied_by_perspective {
                *counts.entry(name.clone()).or_default() += *n as u64;
            }
            if counts.is_empty() || last.is_some_and(|at| at.elapsed() < REPORT_EVERY) {
                return;
            }
            *last = Some(Instant::now());
            std::mem::take(counts).into_iter().collect()
        };
        let reported = async {
            let tx = self.source.begin().await?;
            self.store.record_applied(&tx, &due).await?;
            tx.commit().await
        }
        .await;
        if let Err(err) = reported {
            tracing::debug!(error = %err, "reporting applied events failed; kept for the next report");
            let mut guard = self
                .applied
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (name, n) in due {
                *guard.1.entry(name).or_default() += n;
            }
        }
    }
}
