//! Observability: the metric names the worker and the lease keeper report, and the span fields
//! they record.
//!
//! # Metrics
//!
//! Reported through the `metrics` facade (install any recorder, e.g. a Prometheus exporter;
//! without one they cost next to nothing). They carry one label, `perspective`, whose
//! cardinality is the number of registered perspective versions: a version after the first
//! reports under its stored name (`Statement@v2`), so a build beside the serving version has
//! series of its own.
//!
//! | constant | name | kind | counts / measures |
//! |---|---|---|---|
//! | [`EVENTS_APPLIED`] | `lockstep_worker_events_applied_total` | counter | events applied by the normal path |
//! | [`REWINDS`] | `lockstep_worker_rewinds_total` | counter | rewinds committed |
//! | [`REWIND_FAILURES`] | `lockstep_worker_rewind_failures_total` | counter | rewinds that failed (apply error, panic, store error, lease lost) |
//! | [`REWIND_SECONDS`] | `lockstep_worker_rewind_duration_seconds` | histogram | rewind duration, lease acquired to released |
//! | [`EVENTS_REPLAYED`] | `lockstep_worker_events_replayed_total` | counter | events replayed by rewinds |
//! | [`REPLAYS_FROM_SNAPSHOT`] | `lockstep_worker_replays_from_snapshot_total` | counter | rewinds that started from a snapshot |
//! | [`REPLAYS_FULL`] | `lockstep_worker_replays_full_total` | counter | rewinds that replayed the whole stream |
//! | [`BOOTSTRAPS`] | `lockstep_worker_bootstraps_total` | counter | snapshots created by bootstrap |
//! | [`SKIPPED_LEASED`] | `lockstep_worker_pairs_skipped_leased_total` | counter | pairs skipped because another instance holds their lease |
//! | [`SKIPPED_BUSY`] | `lockstep_worker_pairs_skipped_busy_total` | counter | rewinds skipped because another transaction was using the pair's cursor row (the lease's try-acquire answered busy) |
//! | [`APPLY_FAILURES`] | `lockstep_worker_apply_failures_total` | counter | normal-path applies that failed (error or panic) |
//! | [`PAIR_FAILURES`] | `lockstep_worker_pair_failures_total` | counter | normal-path failures outside `apply` (a state that does not serialize, a refused or lost commit), stored on the pair's cursor |
//! | [`PAIRS_PARKED`] | `lockstep_worker_pairs_parked_total` | counter | pairs parked after `park_after_failures` failures in a row |
//! | [`BATCH_FAILURES`] | `lockstep_worker_batch_failures_total` | counter | batches whose commit failed after the claim (a server timeout, a lost connection); the next batches are smaller |
//! | [`BATCH_PAIRS`] | `lockstep_worker_batch_pairs` | histogram | pairs per claimed batch (label: the batch's first perspective) |
//! | [`LEASES_LOST`] | `lockstep_worker_leases_lost_total` | counter | held leases reported lost by the keeper (renew refused or local deadline passed) |
//! | [`LAG_SECONDS`] | `lockstep_worker_lag_seconds` | histogram | age of the oldest event applied in a batch, at commit, on the database's clock |
//! | [`REWINDS_RUNNING`] | `lockstep_worker_rewinds_running` | gauge | replays of this instance running for more than a progress interval (1 s) |
//! | [`REWIND_EVENTS_REMAINING`] | `lockstep_worker_rewind_events_remaining` | gauge | events those replays still have to replay, at their last progress report |
//! | [`PAIRS_RETRIED`] | `lockstep_worker_pairs_processed_alone_total` | counter | pairs whose batch was rolled back because a table perspective failed in it, then processed alone |
//! | [`VERSIONS_PROMOTED`] | `lockstep_worker_versions_promoted_total` | counter | promotions of a version to the serving one performed by this instance |
//!
//! [`describe`] gives every family its `# HELP` (the worker calls it when it starts running,
//! and exports every counter from zero for each of its perspectives); histogram buckets are the
//! exporter's to set: `lockstep_observe::prometheus::install()` sets them for every family here
//! (`_seconds` ones and [`BATCH_PAIRS`]), so that they export as histograms, not summaries.
//!
//! # Logs
//!
//! Through `tracing`: a rewind started (`info`, with its trigger) and committed (`info`, events
//! replayed, from a snapshot or not), a takeover of an expired lease (`info`), a pair failed
//! (`warn`, with its `kind` — a [`crate::PairErrorKind`] — and `parked` when it was parked), a
//! rewind failed (`warn`, with its `kind`), a lease lost (`warn`), a batch that failed after its
//! claim (`warn`), a cycle error (`warn`). A rollback whose outcome changes nothing and that
//! fails is logged at `debug`.
//!
//! # Spans
//!
//! `process_pair`, `rewind`, `bootstrap`, `purge` and `keepalive` spans carry the fixed fields
//! `stream_id`, `perspective`, `reason` and `epoch` (recorded
//! with `Display`, never whole values).

/// Events applied by the normal path.
pub const EVENTS_APPLIED: &str = "lockstep_worker_events_applied_total";
/// Rewinds committed.
pub const REWINDS: &str = "lockstep_worker_rewinds_total";
/// Rewinds that failed.
pub const REWIND_FAILURES: &str = "lockstep_worker_rewind_failures_total";
/// Rewind duration in seconds.
pub const REWIND_SECONDS: &str = "lockstep_worker_rewind_duration_seconds";
/// Events replayed by rewinds.
pub const EVENTS_REPLAYED: &str = "lockstep_worker_events_replayed_total";
/// Rewinds that started from a snapshot.
pub const REPLAYS_FROM_SNAPSHOT: &str = "lockstep_worker_replays_from_snapshot_total";
/// Rewinds that replayed the whole stream.
pub const REPLAYS_FULL: &str = "lockstep_worker_replays_full_total";
/// Snapshots created by bootstrap.
pub const BOOTSTRAPS: &str = "lockstep_worker_bootstraps_total";
/// Pairs skipped because another instance holds their lease.
pub const SKIPPED_LEASED: &str = "lockstep_worker_pairs_skipped_leased_total";
/// Rewinds skipped because the pair's cursor row was busy (another transaction).
pub const SKIPPED_BUSY: &str = "lockstep_worker_pairs_skipped_busy_total";
/// Normal-path applies that failed.
pub const APPLY_FAILURES: &str = "lockstep_worker_apply_failures_total";
/// Normal-path failures of a pair outside `apply`, stored on its cursor.
pub const PAIR_FAILURES: &str = "lockstep_worker_pair_failures_total";
/// Pairs parked after too many failures in a row.
pub const PAIRS_PARKED: &str = "lockstep_worker_pairs_parked_total";
/// Batches whose commit failed after the claim (the batch shrinks).
pub const BATCH_FAILURES: &str = "lockstep_worker_batch_failures_total";
/// Pairs per claimed batch.
pub const BATCH_PAIRS: &str = "lockstep_worker_batch_pairs";
/// Held leases reported lost by the keeper.
pub const LEASES_LOST: &str = "lockstep_worker_leases_lost_total";
/// Age of the oldest event applied in a batch, at commit, in seconds.
pub const LAG_SECONDS: &str = "lockstep_worker_lag_seconds";

/// Every counter, with its `# HELP` text.
const COUNTERS: [(&str, &str); 16] = [
    (EVENTS_APPLIED, "Events applied by the normal path"),
    (REWINDS, "Rewinds committed"),
    (
        REWIND_FAILURES,
        "Rewinds that failed (apply error, panic, store error, lease lost)",
    ),
    (EVENTS_REPLAYED, "Events replayed by rewinds"),
    (
        REPLAYS_FROM_SNAPSHOT,
        "Rewinds that started from a snapshot",
    ),
    (REPLAYS_FULL, "Rewinds that replayed the whole stream"),
    (BOOTSTRAPS, "Snapshots created by bootstrap"),
    (
        SKIPPED_LEASED,
        "Pairs skipped because another instance holds their lease",
    ),
    (
        SKIPPED_BUSY,
        "Rewinds skipped because another transaction was using the pair's cursor row",
    ),
    (
        APPLY_FAILURES,
        "Applies that failed (error or panic), stored on the pair's cursor",
    ),
    (
        PAIR_FAILURES,
        "Failures of a pair outside apply (state, decoding, commit), stored on its cursor",
    ),
    (
        PAIRS_PARKED,
        "Pairs parked after too many failures in a row",
    ),
    (
        BATCH_FAILURES,
        "Batches whose commit failed after the claim (the next batches are smaller)",
    ),
    (
        LEASES_LOST,
        "Held leases reported lost by the keeper (renew refused or local deadline passed)",
    ),
    (
        PAIRS_RETRIED,
        "Pairs whose failing batch was rolled back and that were then processed alone",
    ),
    (
        VERSIONS_PROMOTED,
        "Promotions of a perspective version to the serving one performed by this instance",
    ),
];

/// Promotions of a perspective version to the serving one performed by this instance.
pub const VERSIONS_PROMOTED: &str = "lockstep_worker_versions_promoted_total";

/// Pairs whose batch was rolled back because a table perspective failed in it, then processed
/// alone.
pub const PAIRS_RETRIED: &str = "lockstep_worker_pairs_processed_alone_total";

/// Describes the worker's metric families (`# HELP`, units) to the installed recorder. The
/// worker calls it when it starts running, and exports every counter from zero for each of its
/// perspectives then, so an alert on a counter finds its series before the first increment.
pub fn describe() {
    for (name, help) in COUNTERS {
        metrics::describe_counter!(name, help);
    }
    metrics::describe_histogram!(
        REWIND_SECONDS,
        metrics::Unit::Seconds,
        "Rewind duration, lease acquired to released"
    );
    metrics::describe_histogram!(
        LAG_SECONDS,
        metrics::Unit::Seconds,
        "Age of the oldest event applied in a batch, at its commit"
    );
    metrics::describe_histogram!(
        BATCH_PAIRS,
        metrics::Unit::Count,
        "Pairs per claimed batch (label: the batch's first perspective)"
    );
    metrics::describe_gauge!(
        REWINDS_RUNNING,
        metrics::Unit::Count,
        "Replays of this instance running for more than a progress interval (1 s)"
    );
    metrics::describe_gauge!(
        REWIND_EVENTS_REMAINING,
        metrics::Unit::Count,
        "Events the running replays of this instance still have to replay, at their last progress report"
    );
}

/// Exports every counter at zero for `perspective` (an increment by 0 creates the series).
pub(crate) fn zero(perspective: &str) {
    for (name, _) in COUNTERS {
        count(name, perspective, 0);
    }
}

/// Replays of this instance running for more than a progress interval.
pub const REWINDS_RUNNING: &str = "lockstep_worker_rewinds_running";
/// Events the running replays still have to replay.
pub const REWIND_EVENTS_REMAINING: &str = "lockstep_worker_rewind_events_remaining";

/// Adds `delta` (negative: subtracts) to the gauge `name` for `perspective`.
pub(crate) fn gauge_add(name: &'static str, perspective: &str, delta: f64) {
    metrics::gauge!(name, "perspective" => perspective.to_owned()).increment(delta);
}

/// Adds `n` to the counter `name` for `perspective`.
pub(crate) fn count(name: &'static str, perspective: &str, n: u64) {
    metrics::counter!(name, "perspective" => perspective.to_owned()).increment(n);
}

/// The store's clock as a claim read it, carried forward on this host's monotonic clock, so
/// that an event's age ([`LAG_SECONDS`]) is measured on the clock its `recorded_at` was written
/// with (the database's), never against this host's wall clock: a host an hour ahead of the
/// database would otherwise read an hour of lag for fresh events, one behind it none at all.
pub(crate) struct StoreClock {
    at: Option<time::OffsetDateTime>,
    read: std::time::Instant,
}

impl StoreClock {
    /// The store's clock `at` (`None`: the store did not say), read now.
    pub(crate) fn new(at: Option<time::OffsetDateTime>) -> StoreClock {
        StoreClock {
            at,
            read: std::time::Instant::now(),
        }
    }

    /// How long ago `recorded_at` was, now, in seconds (0 for a time in the future): on the
    /// store's clock, or on this host's when the store did not say what its clock was.
    pub(crate) fn age_seconds(&self, recorded_at: time::OffsetDateTime) -> f64 {
        let now = match self.at {
            Some(at) => time::Duration::try_from(self.read.elapsed())
                .ok()
                .and_then(|since| at.checked_add(since))
                .unwrap_or(at),
            None => time::OffsetDateTime::now_utc(),
        };
        (now - recorded_at).as_seconds_f64().max(0.0)
    }
}

/// Records `value` in the histogram `name` for `perspective`.
pub(crate) fn observe(name: &'static str, perspective: &str, value: f64) {
    metrics::histogram!(name, "perspective" => perspective.to_owned()).record(value);
}
