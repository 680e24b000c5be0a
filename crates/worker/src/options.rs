//! [`WorkerOptions`]: how a [`crate::PerspectiveWorker`] polls, batches, snapshots and backs off,
//! validated in one place ([`WorkerOptions::validate`], called by the worker's constructor).

use std::time::Duration;

use lockstep_core::{BatchLimits, Error, ErrorKind, PageLimits, Result, RewindDebounce};

/// The longest duration an option accepts (a day): far beyond any sensible setting, and small
/// enough that adding it to any `Instant` or timestamp cannot overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

/// Options of a [`crate::PerspectiveWorker`]. Defaults are documented on each field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerOptions {
    /// How long an idle worker waits before polling again. Default 200 ms.
    pub poll_interval: Duration,
    /// Pairs per batch: one claim statement hands out at most this many. Default 64.
    pub pairs_per_cycle: usize,
    /// Batches of one cycle in flight at the same time (each on a transaction of its own, so
    /// the source needs this many connections, plus one for the keepalive). Batches never
    /// share a pair (the claim skips rows another batch holds); more than 1 overlaps one
    /// batch's `apply` with another's round trips. Default 1.
    pub concurrency: usize,
    /// Events applied per pair per batch. Default 1 000.
    pub max_events_per_claim: usize,
    /// Events per batch, all pairs together. Default 10 000.
    pub max_events_per_batch: usize,
    /// Bytes of event payloads and states per batch, as stored (see
    /// [`BatchLimits::bytes`]); the first event of a batch is always handed out. Default
    /// 16 MiB.
    pub max_bytes_per_batch: u64,
    /// How many events, and bytes of payloads as stored, a rewind reads at a time: it holds
    /// at most two such pages, whatever the length of the stream it replays (ADR 0031).
    /// Default [`PageLimits::default`]: 10 000 events, 16 MiB.
    pub rewind_page: PageLimits,
    /// A pair that failed this many times in a row is parked: not claimed again until an
    /// operator retries it, skips its failing event or requests a rewind (its work keeps
    /// queueing). `None`: never parked, retried after the backoff forever. Default 10.
    pub park_after_failures: Option<u32>,
    /// A snapshot is taken each time a pair's applied-event count crosses a multiple of this.
    /// Default 100.
    pub snapshot_every: u64,
    /// A rewind waits until no late event arrived for this long (late events keep arriving in
    /// bursts: one rewind instead of many). Default 0 (no debounce).
    pub rewind_debounce: Duration,
    /// The longest a rewind is held back by `rewind_debounce`, from the first late event of the
    /// burst: a steady trickle of late events cannot postpone it for longer. At least
    /// `rewind_debounce`. Default 30 s.
    pub rewind_debounce_max: Duration,
    /// First wait before a failed pair is retried; doubles per failure up to
    /// `failure_backoff_max`. Default 1 s.
    pub failure_backoff: Duration,
    /// Longest wait before a failed pair is retried. Default 60 s.
    pub failure_backoff_max: Duration,
    /// How long shutdown waits for in-flight work before giving up on it (its leases are
    /// released either way). Default 10 s.
    pub shutdown_grace: Duration,
    /// A task waiting longer than this for a pair's in-process apply lock logs a warning naming
    /// the pair. Default 5 s.
    pub coordinator_warn_after: Duration,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        WorkerOptions {
            poll_interval: Duration::from_millis(200),
            pairs_per_cycle: 64,
            concurrency: 1,
            max_events_per_claim: 1000,
            max_events_per_batch: 10_000,
            max_bytes_per_batch: 16 * 1024 * 1024,
            rewind_page: PageLimits::default(),
            park_after_failures: Some(10),
            snapshot_every: 100,
            rewind_debounce: Duration::ZERO,
            rewind_debounce_max: RewindDebounce::DEFAULT_MAX_DELAY,
            failure_backoff: Duration::from_secs(1),
            failure_backoff_max: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(10),
            coordinator_warn_after: Duration::from_secs(5),
        }
    }
}

impl WorkerOptions {
    /// These options with [`WorkerOptions::poll_interval`] set to `poll_interval`.
    #[must_use]
    pub fn with_poll_interval(mut self, poll_interval: Duration) -> Self {
        self.poll_interval = poll_interval;
        self
    }

    /// These options with [`WorkerOptions::pairs_per_cycle`] set to `pairs_per_cycle`.
    #[must_use]
    pub fn with_pairs_per_cycle(mut self, pairs_per_cycle: usize) -> Self {
        self.pairs_per_cycle = pairs_per_cycle;
        self
    }

    /// These options with [`WorkerOptions::concurrency`] set to `concurrency`.
    #[must_use]
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// These options with [`WorkerOptions::max_events_per_claim`] set to `max_events_per_claim`.
    #[must_use]
    pub fn with_max_events_per_claim(mut self, max_events_per_claim: usize) -> Self {
        self.max_events_per_claim = max_events_per_claim;
        self
    }

    /// These options with [`WorkerOptions::max_events_per_batch`] set to `max_events_per_batch`.
    #[must_use]
    pub fn with_max_events_per_batch(mut self, max_events_per_batch: usize) -> Self {
        self.max_events_per_batch = max_events_per_batch;
        self
    }

    /// These options with [`WorkerOptions::max_bytes_per_batch`] set to `max_bytes_per_batch`.
    #[must_use]
    pub fn with_max_bytes_per_batch(mut self, max_bytes_per_batch: u64) -> Self {
        self.max_bytes_per_batch = max_bytes_per_batch;
        self
    }

    /// These options with [`WorkerOptions::rewind_page`] set to `rewind_page`.
    #[must_use]
    pub fn with_rewind_page(mut self, rewind_page: PageLimits) -> Self {
        self.rewind_page = rewind_page;
        self
    }

    /// These options with [`WorkerOptions::park_after_failures`] set to `park_after_failures`.
    #[must_use]
    pub fn with_park_after_failures(mut self, park_after_failures: Option<u32>) -> Self {
        self.park_after_failures = park_after_failures;
        self
    }

    /// These options with [`WorkerOptions::snapshot_every`] set to `snapshot_every`.
    #[must_use]
    pub fn with_snapshot_every(mut self, snapshot_every: u64) -> Self {
        self.snapshot_every = snapshot_every;
        self
    }

    /// These options with [`WorkerOptions::rewind_debounce`] set to `rewind_debounce`.
    #[must_use]
    pub fn with_rewind_debounce(mut self, rewind_debounce: Duration) -> Self {
        self.rewind_debounce = rewind_debounce;
        self
    }

    /// These options with [`WorkerOptions::rewind_debounce_max`] set to `rewind_debounce_max`.
    #[must_use]
    pub fn with_rewind_debounce_max(mut self, rewind_debounce_max: Duration) -> Self {
        self.rewind_debounce_max = rewind_debounce_max;
        self
    }

    /// These options with [`WorkerOptions::failure_backoff`] set to `failure_backoff`.
    #[must_use]
    pub fn with_failure_backoff(mut self, failure_backoff: Duration) -> Self {
        self.failure_backoff = failure_backoff;
        self
    }

    /// These options with [`WorkerOptions::failure_backoff_max`] set to `failure_backoff_max`.
    #[must_use]
    pub fn with_failure_backoff_max(mut self, failure_backoff_max: Duration) -> Self {
        self.failure_backoff_max = failure_backoff_max;
        self
    }

    /// These options with [`WorkerOptions::shutdown_grace`] set to `shutdown_grace`.
    #[must_use]
    pub fn with_shutdown_grace(mut self, shutdown_grace: Duration) -> Self {
        self.shutdown_grace = shutdown_grace;
        self
    }

    /// These options with [`WorkerOptions::coordinator_warn_after`] set to `coordinator_warn_after`.
    #[must_use]
    pub fn with_coordinator_warn_after(mut self, coordinator_warn_after: Duration) -> Self {
        self.coordinator_warn_after = coordinator_warn_after;
        self
    }

    /// Checks every option: counts at least 1 (and at most 1 000 000), durations at most
    /// [`MAX_DURATION`], `poll_interval` at least 1 ms, `failure_backoff <=
    /// failure_backoff_max`, `rewind_debounce <= rewind_debounce_max`. A bad option is [`ErrorKind::InvalidInput`] naming it.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::new(ErrorKind::InvalidInput, what.to_owned()));
        for (name, value) in [
            ("pairs_per_cycle", self.pairs_per_cycle as u64),
            ("concurrency", self.concurrency as u64),
            ("max_events_per_claim", self.max_events_per_claim as u64),
            ("max_events_per_batch", self.max_events_per_batch as u64),
            ("snapshot_every", self.snapshot_every),
        ] {
            if !(1..=1_000_000).contains(&value) {
                return bad(&format!(
                    "{name} must be between 1 and 1000000, got {value}"
                ));
            }
        }
        for (name, value) in [
            ("poll_interval", self.poll_interval),
            ("rewind_debounce", self.rewind_debounce),
            ("rewind_debounce_max", self.rewind_debounce_max),
            ("failure_backoff", self.failure_backoff),
            ("failure_backoff_max", self.failure_backoff_max),
            ("shutdown_grace", self.shutdown_grace),
            ("coordinator_warn_after", self.coordinator_warn_after),
        ] {
            if value > MAX_DURATION {
                return bad(&format!("{name} must be at most one day, got {value:?}"));
            }
        }
        if self.poll_interval < Duration::from_millis(1) {
            return bad("poll_interval must be at least 1 ms");
        }
        if self.failure_backoff > self.failure_backoff_max {
            return bad("failure_backoff must not exceed failure_backoff_max");
        }
        if self.rewind_debounce > self.rewind_debounce_max {
            return bad("rewind_debounce must not exceed rewind_debounce_max");
        }
        if self.park_after_failures == Some(0) {
            return bad("park_after_failures must be at least 1 (None: never park)");
        }
        self.rewind_page.validate()?;
        self.batch_limits().validate()
    }

    /// The limits of one batch: `pairs_per_cycle` pairs, `max_events_per_claim` events per
    /// pair, `max_events_per_batch` events, `max_bytes_per_batch` bytes, and at most four
    /// times as many pairs looked at as claimed (at least 256): what a claim may skip over
    /// (pairs other batches hold, backing off, parked, leased) before it gives up for this
    /// cycle.
    pub fn batch_limits(&self) -> BatchLimits {
        let mut limits = BatchLimits::default();
        limits.pairs = self.pairs_per_cycle;
        limits.events_per_pair = self.max_events_per_claim;
        limits.events = self.max_events_per_batch;
        limits.bytes = self.max_bytes_per_batch;
        limits.scan = self.pairs_per_cycle.saturating_mul(4).clamp(256, 1_000_000);
        limits
    }

    /// Whether a pair that has now failed `failures` times in a row is parked.
    pub fn parks_after(&self, failures: u32) -> bool {
        self.park_after_failures.is_some_and(|n| failures >= n)
    }

    /// The debounce the store applies: `rewind_debounce` capped at `rewind_debounce_max`.
    pub fn debounce(&self) -> RewindDebounce {
        RewindDebounce {
            window: self.rewind_debounce,
            max_delay: self.rewind_debounce_max,
        }
    }

    /// The wait before retrying a pair after `failures` consecutive failures.
    pub fn backoff(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(20);
        self.failure_backoff
            .saturating_mul(1 << doublings)
            .min(self.failure_backoff_max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_are_named() {
        WorkerOptions::default().validate().expect("defaults");
        let cases = [
            WorkerOptions {
                pairs_per_cycle: 0,
                ..WorkerOptions::default()
            },
            WorkerOptions {
                snapshot_every: 0,
                ..WorkerOptions::default()
            },
            WorkerOptions {
                concurrency: 0,
                ..WorkerOptions::default()
            },
            WorkerOptions {
                max_events_per_batch: 0,
                ..WorkerOptions::default()
            },
            WorkerOptions {
                max_bytes_per_batch: 0,
                ..WorkerOptions::default()
            },
            WorkerOptions {
                rewind_page: {
                    let mut page = PageLimits::default();
                    page.events = 0;
                    page
                },
                ..WorkerOptions::default()
            },
            WorkerOptions {
                rewind_page: {
                    let mut page = PageLimits::default();
                    page.bytes = 0;
                    page
                },
                ..WorkerOptions::default()
            },
            WorkerOptions {
                park_after_failures: Some(0),
                ..WorkerOptions::default()
            },
            WorkerOptions {
                poll_interval: Duration::ZERO,
                ..WorkerOptions::default()
            },
            WorkerOptions {
                shutdown_grace: Duration::MAX,
                ..WorkerOptions::default()
            },
            WorkerOptions {
                failure_backoff: Duration::from_secs(120),
                ..WorkerOptions::default()
            },
        ];
        for options in cases {
            let err = options.validate().expect_err("refused");
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_never_overflows() {
        let o = WorkerOptions::default();
        assert_eq!(o.backoff(1), Duration::from_secs(1));
        assert_eq!(o.backoff(3), Duration::from_secs(4));
        assert_eq!(o.backoff(u32::MAX), Duration::from_secs(60));
    }
}
