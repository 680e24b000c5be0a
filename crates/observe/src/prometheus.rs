//! The Prometheus recorder set up the way lockstep's metrics are meant to be exported (feature
//! `prometheus`): durations and lags as **histograms** with [`crate::SECONDS_BUCKETS`] (not the
//! exporter's default summaries, which cannot be aggregated across instances), the worker's
//! batch sizes with their own buckets, and `# HELP` on every family lockstep reports.
//!
//! ```no_run
//! let handle = lockstep_observe::prometheus::install()?;
//! // … serve `handle.render()` on /metrics …
//! # Ok::<(), metrics_exporter_prometheus::BuildError>(())
//! ```

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

/// Pairs per claimed batch (the worker's `lockstep_worker_batch_pairs`).
const BATCH_PAIRS: &str = "lockstep_worker_batch_pairs";
const BATCH_PAIRS_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// A builder with lockstep's histogram buckets, for callers that configure more (an HTTP
/// listener of the exporter's own, global labels).
pub fn builder() -> Result<PrometheusBuilder, BuildError> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), crate::SECONDS_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(BATCH_PAIRS.into()), BATCH_PAIRS_BUCKETS)
}

/// Installs the recorder globally (see the [module docs](self)) and describes the observe
/// layer's families; the worker describes its own when it starts running. Returns the handle
/// whose `render()` is the `/metrics` body.
pub fn install() -> Result<PrometheusHandle, BuildError> {
    let handle = builder()?.install_recorder()?;
    crate::describe();
    Ok(handle)
}
