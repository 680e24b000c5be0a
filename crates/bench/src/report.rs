//! Measurements and the printed table.

use std::time::Duration;

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};

/// A histogram of latencies in microseconds (1 µs to 60 s, 3 significant digits).
pub(crate) fn new_histogram() -> Histogram<u64> {
    match Histogram::new_with_bounds(1, 60_000_000, 3) {
        Ok(h) => h,
        Err(e) => unreachable!("constant histogram bounds are valid: {e}"),
    }
}

/// The median of `values` (the mean of the two middle ones for an even count), NaN for none.
/// The one median of every benchmark's per-round ratios and times.
pub(crate) fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// [`median`], `None` for no values (for figures printed as "n/a").
pub(crate) fn median_if_any(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| median(values))
}

/// What one side of a comparison did.
#[derive(Debug, Clone)]
pub(crate) struct Measurement {
    /// Operations completed.
    pub(crate) ops: usize,
    /// The time they took (without connection set-up).
    pub(crate) elapsed: Duration,
    /// Per-operation latency, µs.
    pub(crate) latency_us: Histogram<u64>,
    /// Statements the server counted while this side ran, if known.
    pub(crate) statements: Option<u64>,
}

impl Measurement {
    /// An empty measurement to merge rounds into.
    pub(crate) fn empty() -> Measurement {
        Measurement {
            ops: 0,
            elapsed: Duration::ZERO,
            latency_us: new_histogram(),
            statements: Some(0),
        }
    }

    /// Adds another round.
    pub(crate) fn merge(&mut self, other: &Measurement) {
        self.ops += other.ops;
        self.elapsed += other.elapsed;
        // Both histograms have the same bounds; values beyond them were saturated on record.
        let _ = self.latency_us.add(&other.latency_us);
        self.statements = match (self.statements, other.statements) {
            (Some(a), Some(b)) => Some(a + b),
            _ => None,
        };
    }

    /// Operations per second.
    pub(crate) fn ops_per_sec(&self) -> f64 {
        if self.elapsed.is_zero() {
            0.0
        } else {
            self.ops as f64 / self.elapsed.as_secs_f64()
        }
    }

    /// Server-counted statements per operation.
    pub(crate) fn statements_per_op(&self) -> Option<f64> {
        match self.statements {
            Some(s) if self.ops > 0 => Some(s as f64 / self.ops as f64),
            _ => None,
        }
    }
}

/// One printed row.
pub(crate) struct Row<'a> {
    pub(crate) workload: &'a str,
    pub(crate) concurrency: usize,
    pub(crate) side: &'a str,
    pub(crate) measurement: &'a Measurement,
}

/// The header of the table, in Markdown.
pub(crate) fn header() -> String {
    "| workload | concurrency | client | ops | ops/s | p50 (ms) | p99 (ms) | statements/op |\n\
     |---|---:|---|---:|---:|---:|---:|---:|"
        .to_owned()
}

/// One table row, in Markdown.
pub(crate) fn row(r: &Row<'_>) -> String {
    let m = r.measurement;
    let ms = |q: f64| m.latency_us.value_at_quantile(q) as f64 / 1000.0;
    let statements = m
        .statements_per_op()
        .map_or_else(|| "n/a".to_owned(), |s| format!("{s:.2}"));
    format!(
        "| {} | {} | {} | {} | {:.0} | {:.3} | {:.3} | {} |",
        r.workload,
        r.concurrency,
        r.side,
        m.ops,
        m.ops_per_sec(),
        ms(0.50),
        ms(0.99),
        statements
    )
}

/// Progress of a long run: a bar on a terminal (stderr), one line per step otherwise (logs, CI).
pub(crate) struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A run of `total` steps.
    pub(crate) fn new(total: u64) -> Progress {
        let bar = ProgressBar::new(total);
        if let Ok(style) =
            ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed_precise} {wide_msg}")
        {
            bar.set_style(style);
        }
        Progress { bar }
    }

    /// Starts the next step, described by `what`.
    pub(crate) fn step(&self, what: String) {
        if self.bar.is_hidden() {
            eprintln!("{what}");
        } else {
            self.bar.set_message(what);
        }
        self.bar.inc(1);
    }

    /// Clears the bar.
    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
