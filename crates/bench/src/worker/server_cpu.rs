//! The PostgreSQL server's CPU time while one side ran, read from `/proc/<pid>/stat`
//! (`utime + stime`) of the server's processes — the benchmark runs on the same machine as the
//! server (`pg_stat_statements` is not preloaded here, and it would not count the work of a
//! statement's functions the same way anyway).
//!
//! Two sums are taken at each reading:
//!
//! - **the benchmark database's client backends**: the pids `pg_stat_activity` lists for the
//!   database (`backend_type = 'client backend'`), read while the side's connections are still
//!   open (a backend that exits takes its counters with it). A pid first seen at the second
//!   reading counts from 0 (a connection the side opened: its start-up is the side's work); a
//!   pid gone by then is left out (it ran nothing of the side). Autovacuum, the WAL writer,
//!   the checkpointer and the background writer are not in it. This is the headline.
//! - **every `postgres` process** of the machine (`/proc/*/comm`), background processes
//!   included, and other databases' sessions too, if other work uses the server at the time.
//!
//! Unavailable (not Linux, `/proc` unreadable, a remote server): `None`, printed as n/a.

use std::collections::HashMap;

use anyhow::Result;

use crate::bench_db::BenchDatabase;

/// One reading: CPU ticks per pid, for the database's backends and for every postgres process.
#[derive(Debug, Clone, Default)]
pub(crate) struct CpuReading {
    backends: HashMap<i32, u64>,
    all: HashMap<i32, u64>,
}

/// Server CPU seconds between two readings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServerCpu {
    /// The benchmark database's client backends.
    pub(crate) backends_s: f64,
    /// Every postgres process.
    pub(crate) all_s: f64,
}

/// Clock ticks per second of `/proc/<pid>/stat` (`getconf CLK_TCK`; Linux reports 100).
pub(crate) fn ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|t| *t > 0.0)
        .unwrap_or(100.0)
}

/// `utime + stime` of `pid`, in ticks, if readable.
fn ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: the fields follow the last ')'.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Every process whose command is `postgres`.
fn postgres_pids() -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|entry| {
        let entry = entry.ok()?;
        let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(entry.path().join("comm")).ok()?;
        (comm.trim() == "postgres").then_some(pid)
    })
    .collect()
}

/// Reads the CPU ticks of the benchmark database's client backends and of every postgres
/// process. `None` when no process could be read (no `/proc`, a server elsewhere).
pub(crate) async fn read(db: &BenchDatabase) -> Result<Option<CpuReading>> {
    let admin = db.admin_client().await?;
    let rows = admin
        .query(
            "SELECT pid FROM pg_stat_activity \
              WHERE datname = $1 AND backend_type = 'client backend'",
            &[&db.name()],
        )
        .await?;
    let backends: HashMap<i32, u64> = rows
        .iter()
        .filter_map(|r| r.try_get::<_, i32>(0).ok())
        .filter_map(|pid| ticks(pid).map(|t| (pid, t)))
        .collect();
    let all: HashMap<i32, u64> = postgres_pids()
        .into_iter()
        .filter_map(|pid| ticks(pid).map(|t| (pid, t)))
        .collect();
    if all.is_empty() {
        return Ok(None);
    }
    Ok(Some(CpuReading { backends, all }))
}

/// The server CPU time between `before` and `after` (see the module docs for what counts).
pub(crate) fn between(before: &CpuReading, after: &CpuReading, per_second: f64) -> ServerCpu {
    let delta = |b: &HashMap<i32, u64>, a: &HashMap<i32, u64>| -> f64 {
        a.iter()
            .map(|(pid, t)| t.saturating_sub(b.get(pid).copied().unwrap_or(0)))
            .sum::<u64>() as f64
            / per_second
    };
    ServerCpu {
        backends_s: delta(&before.backends, &after.backends),
        all_s: delta(&before.all, &after.all),
    }
}
