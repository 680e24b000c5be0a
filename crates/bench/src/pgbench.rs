//! Driving `pgbench` with the very statements a lockstep backend sends: scripts built from the
//! statement texts (`$n` → `:variable`), run with `-M prepared`, and per-transaction logs (`-l`)
//! read back into a latency histogram.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use hdrhistogram::Histogram;
use tokio::process::Command;

use crate::bench_db::BenchDatabase;
use crate::report::{Measurement, new_histogram};

/// Rewrites a statement's positional parameters (`$1`, `$2`, …) as pgbench variables
/// (`:names[0]`, `:names[1]`, …), leaving everything else byte for byte.
pub(crate) fn to_pgbench(sql: &str, names: &[&str]) -> Result<String> {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut chars = sql.char_indices().peekable();
    while let Some((_, c)) = chars.next() {
        if c != '$' {
            out.push(c);
            continue;
        }
        let mut digits = String::new();
        while let Some(&(_, d)) = chars.peek() {
            if !d.is_ascii_digit() {
                break;
            }
            digits.push(d);
            chars.next();
        }
        if digits.is_empty() {
            out.push('$');
            continue;
        }
        let n: usize = digits.parse().context("parameter number")?;
        let Some(name) = n.checked_sub(1).and_then(|i| names.get(i)) else {
            bail!(
                "statement uses ${n} but only {} names were given",
                names.len()
            );
        };
        out.push(':');
        out.push_str(name);
    }
    Ok(out)
}

/// How long a pgbench run lasts.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Limit {
    /// `--time`: this long (whole seconds, at least 1).
    Duration(Duration),
    /// `--transactions`: this many per client.
    Transactions(usize),
}

/// One pgbench run.
pub(crate) struct PgbenchRun<'a> {
    /// The script text (`\set` lines and statements ending in `;` or `\gset`).
    pub(crate) script: &'a str,
    /// `-c` and `-j`.
    pub(crate) clients: usize,
    /// `-T` or `-t`.
    pub(crate) limit: Limit,
    /// `-D name=value` definitions.
    pub(crate) defines: &'a [(&'a str, String)],
}

/// Runs pgbench against `db` in `work_dir` and returns its throughput and latencies.
pub(crate) async fn run(
    program: &str,
    db: &BenchDatabase,
    work_dir: &Path,
    tag: &str,
    spec: &PgbenchRun<'_>,
) -> Result<Measurement> {
    let script_path = work_dir.join(format!("{tag}.pgbench"));
    std::fs::write(&script_path, spec.script).context("writing the pgbench script")?;
    let log_prefix = work_dir.join(format!("{tag}_log"));
    let (conn_args, password) = db.libpq_args();

    let mut cmd = Command::new(program);
    cmd.arg("--no-vacuum")
        .args(["--protocol", "prepared"])
        .args(["--client", &spec.clients.to_string()])
        .args(["--jobs", &spec.clients.to_string()])
        .args(match spec.limit {
            Limit::Duration(d) => ["--time".to_owned(), d.as_secs().max(1).to_string()],
            Limit::Transactions(n) => ["--transactions".to_owned(), n.max(1).to_string()],
        })
        .arg("--log")
        .arg(format!("--log-prefix={}", log_prefix.display()))
        .arg("--file")
        .arg(&script_path);
    for (name, value) in spec.defines {
        cmd.arg(format!("--define={name}={value}"));
    }
    cmd.args(&conn_args)
        .current_dir(work_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(password) = password {
        cmd.env("PGPASSWORD", password);
    }
    let output = cmd
        .output()
        .await
        .with_context(|| format!("running {program} (is pgbench on PATH?)"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "pgbench failed ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let tps = parse_tps(&stdout).with_context(|| format!("no tps in pgbench output:\n{stdout}"))?;
    let failed = parse_failed(&stdout);
    if failed > 0 {
        bail!("pgbench reported {failed} failed transactions:\n{stdout}");
    }
    let latencies = read_logs(work_dir, &log_prefix)?;
    let ops = usize::try_from(latencies.len()).context("transaction count")?;
    // pgbench's own rate: transactions over the run time without connection set-up.
    let elapsed = if tps > 0.0 {
        Duration::from_secs_f64(ops as f64 / tps)
    } else {
        match spec.limit {
            Limit::Duration(d) => d,
            Limit::Transactions(_) => Duration::ZERO,
        }
    };
    Ok(Measurement {
        ops,
        elapsed,
        latency_us: latencies,
        statements: None,
    })
}

fn parse_tps(stdout: &str) -> Option<f64> {
    stdout
        .lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l.trim_start_matches("tps = ").split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

fn parse_failed(stdout: &str) -> u64 {
    stdout
        .lines()
        .find(|l| l.starts_with("number of failed transactions:"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Reads every per-thread log `<prefix>.<pid>[.<thread>]`: one line per transaction, the third
/// field its latency in microseconds. The files are removed afterwards.
fn read_logs(work_dir: &Path, prefix: &Path) -> Result<Histogram<u64>> {
    let stem = prefix
        .file_name()
        .and_then(|s| s.to_str())
        .context("log prefix")?
        .to_owned();
    let mut files: Vec<PathBuf> = Vec::new();
    for entry in std::fs::read_dir(work_dir).context("listing pgbench logs")? {
        let path = entry?.path();
        if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(&format!("{stem}.")))
        {
            files.push(path);
        }
    }
    if files.is_empty() {
        bail!("pgbench wrote no transaction log");
    }
    let mut histogram = new_histogram();
    for file in files {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        for line in text.lines() {
            let latency: u64 = line
                .split_whitespace()
                .nth(2)
                .and_then(|v| v.parse().ok())
                .with_context(|| format!("bad pgbench log line {line:?}"))?;
            histogram.saturating_record(latency);
        }
        std::fs::remove_file(&file).ok();
    }
    Ok(histogram)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_become_variables_and_nothing_else_changes() {
        let sql = "SELECT $1::uuid, $2, '$x', $10 FROM t WHERE a = $1";
        let names = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"];
        assert_eq!(
            to_pgbench(sql, &names).expect("converts"),
            "SELECT :a::uuid, :b, '$x', :j FROM t WHERE a = :a"
        );
        assert!(to_pgbench("SELECT $3", &["a"]).is_err());
    }

    #[test]
    fn reads_tps_and_failures_from_pgbench_output() {
        let out = "number of failed transactions: 0 (0.000%)\n\
                   latency average = 0.679 ms\n\
                   tps = 1472.842243 (without initial connection time)\n";
        assert_eq!(parse_tps(out), Some(1472.842243));
        assert_eq!(parse_failed(out), 0);
    }
}
