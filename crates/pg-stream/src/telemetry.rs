//! Observability: the metric names the locker reports and the span fields it records.
//!
//! # Metrics
//!
//! Counters, reported through the `metrics` facade (install any recorder, e.g. a
//! Prometheus exporter; without one they cost next to nothing). They carry no labels, so their
//! cardinality is fixed.
//!
//! | constant | name | counts |
//! |---|---|---|
//! | [`ACQUIRED`] | `lockstep_stream_lease_acquired_total` | try-acquires that returned a lease (new, taken over, or re-acquired by its holder) |
//! | [`TAKEOVERS`] | `lockstep_stream_lease_takeovers_total` | acquisitions that replaced an **expired**, uncleared lease (a holder that crashed or stalled); also counted in `acquired` |
//! | [`DENIED`] | `lockstep_stream_lease_denied_total` | try-acquires denied because another instance holds a live lease |
//! | [`NO_CURSOR`] | `lockstep_stream_lease_no_cursor_total` | try-acquires on a pair without a cursor row |
//! | [`BUSY`] | `lockstep_stream_lease_busy_total` | try-acquires answered busy: the cursor row was locked by another transaction (nothing written) |
//! | [`RENEWED`] | `lockstep_stream_lease_renewed_total` | leases extended (by `renew` or `renew_many`) |
//! | [`RENEW_LOST`] | `lockstep_stream_lease_renew_lost_total` | renews refused because the lease is no longer held at that epoch (the protected work must stop) |
//! | [`RELEASED`] | `lockstep_stream_lease_released_total` | leases cleared by their holder |
//! | [`FORCE_RELEASED`] | `lockstep_stream_lease_force_released_total` | leases cleared by an operator (epoch bumped) |
//! | [`FENCE_LOST`] | `lockstep_stream_lease_fence_lost_total` | fenced-commit checks that found the lease lost |
//!
//! Takeover detection adds no round trip: the try-acquire statement itself returns whether the
//! lease it replaced had expired.
//!
//! # Spans
//!
//! Every operation runs in a `tracing` span named after it (`try_acquire`, `renew`, `release`,
//! `renew_many`, `check_lease`, `list_leases`, `list_lease_entries`, `inspect`,
//! `force_release`, `release_all_held_by`) with the fixed fields below, recorded with `Display` and never as
//! whole values:
//!
//! | field | value |
//! |---|---|
//! | `stream_id` | the stream id |
//! | `perspective` | the perspective name |
//! | `reason` | the lease reason (try-acquire) |
//! | `epoch` | the lease epoch (recorded once known) |

/// Try-acquires that returned a lease.
pub const ACQUIRED: &str = "lockstep_stream_lease_acquired_total";
/// Acquisitions that took over an expired lease.
pub const TAKEOVERS: &str = "lockstep_stream_lease_takeovers_total";
/// Try-acquires denied because another instance holds a live lease.
pub const DENIED: &str = "lockstep_stream_lease_denied_total";
/// Try-acquires on a pair without a cursor row.
pub const NO_CURSOR: &str = "lockstep_stream_lease_no_cursor_total";
/// Try-acquires answered busy (the cursor row was locked by another transaction).
pub const BUSY: &str = "lockstep_stream_lease_busy_total";
/// Leases extended.
pub const RENEWED: &str = "lockstep_stream_lease_renewed_total";
/// Renews refused because the lease was lost.
pub const RENEW_LOST: &str = "lockstep_stream_lease_renew_lost_total";
/// Leases released by their holder.
pub const RELEASED: &str = "lockstep_stream_lease_released_total";
/// Leases force-released by an operator.
pub const FORCE_RELEASED: &str = "lockstep_stream_lease_force_released_total";
/// Fenced-commit checks that found the lease lost.
pub const FENCE_LOST: &str = "lockstep_stream_lease_fence_lost_total";

/// Every counter name, for recorders that want to describe them up front.
pub const ALL_COUNTERS: [&str; 10] = [
    ACQUIRED,
    TAKEOVERS,
    DENIED,
    NO_CURSOR,
    BUSY,
    RENEWED,
    RENEW_LOST,
    RELEASED,
    FORCE_RELEASED,
    FENCE_LOST,
];

pub(crate) fn count(name: &'static str, n: u64) {
    ::metrics::counter!(name).increment(n);
}
