//! The plain write path against a plain insert (ADR 0019), run by `aggregate` after
//! its scenarios: line `append_server_us_vs_plain_insert`.
//!
//! Both sides are pgbench scripts of one statement per transaction (autocommit, `-M prepared`,
//! one client, one fresh stream per side and pass, so nothing waits for a lock), on the
//! benchmark database with its `synchronous_commit` setting and **no perspective registered**
//! (checked before measuring):
//!
//! - **append**: `SELECT lockstep_append_events(stream, v - 1, ARRAY[id], ARRAY[type],
//!   ARRAY[payload])` — lockstep's append statement, one event with the expected version;
//! - **plain insert**: `INSERT INTO bench_plain_events (event_id, stream_id, version,
//!   event_type, payload) VALUES (id, stream, v, type, payload)` into a table created `LIKE
//!   wh_events INCLUDING ALL` — the same columns, defaults, checks and the same three indexes
//!   (primary key on the id, unique (stream, version), (stream, event id)): what a store
//!   whose client computed the version (cqrs-es) sends.
//!
//! The event id is `gen_random_uuid()` on both sides; `v` is a pgbench variable counting the
//! client's transactions. **Server time** is the growth of `pg_stat_database.active_time` of
//! the benchmark database over the pgbench run ([`ServerTime`]): the time the backend spent
//! between each statement's Bind and the `ReadyForQuery` after it — bind, plan, execution and
//! the commit — read after the backend exited, divided by the events appended. pgbench's own
//! connection set-up (a few statements) is included on both sides. The sides alternate ABBA
//! (`--append-passes` passes; the first side of each pass alternates), and the line is the
//! median of the per-pass ratios.

use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::bench_db::BenchDatabase;
use crate::pgbench::{self, PgbenchRun};
use crate::server_stats::ServerTime;

/// The table the plain side inserts into.
const PLAIN_TABLE: &str = "bench_plain_events";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Append,
    PlainInsert,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Append => "lockstep_append_events",
            Side::PlainInsert => "plain INSERT",
        }
    }

    fn script(self) -> String {
        let values = "ARRAY[gen_random_uuid()], ARRAY['Deposited'], \
                      ARRAY['{\"amount\": 1}'::jsonb]";
        match self {
            Side::Append => format!(
                "\\set v :v + 1\n\
                 SELECT lockstep_append_events(:stream, :v - 1, {values});\n"
            ),
            Side::PlainInsert => format!(
                "\\set v :v + 1\n\
                 INSERT INTO {PLAIN_TABLE} (event_id, stream_id, version, event_type, payload) \
                 VALUES (gen_random_uuid(), :stream, :v, 'Deposited', '{{\"amount\": 1}}');\n"
            ),
        }
    }
}

/// Per pass, each side's server time per event, µs.
pub(crate) struct AppendCost {
    passes: Vec<(f64, f64)>,
}

impl AppendCost {
    /// The median over passes of append ÷ plain insert.
    pub(crate) fn ratio(&self) -> Option<f64> {
        let mut ratios: Vec<f64> = self
            .passes
            .iter()
            .filter(|(_, plain)| *plain > 0.0)
            .map(|(append, plain)| append / plain)
            .collect();
        ratios.sort_by(f64::total_cmp);
        ratios.get(ratios.len() / 2).copied()
    }

    /// The medians of each side's server time per event, µs.
    pub(crate) fn medians(&self) -> (Option<f64>, Option<f64>) {
        let side = |pick: fn(&(f64, f64)) -> f64| {
            crate::report::median_if_any(&self.passes.iter().map(pick).collect::<Vec<_>>())
        };
        (side(|p| p.0), side(|p| p.1))
    }

    /// The per-pass table.
    pub(crate) fn table(&self, events: usize) -> String {
        let mut out = format!(
            "| append vs plain insert, pass ({events} events each, one client, no perspective) \
             | append server µs/event | plain INSERT server µs/event | ratio |\n\
             |---:|---:|---:|---:|\n"
        );
        for (pass, (append, plain)) in self.passes.iter().enumerate() {
            out.push_str(&format!(
                "| {pass} | {append:.1} | {plain:.1} | {:.2} |\n",
                append / plain.max(f64::EPSILON)
            ));
        }
        out
    }
}

/// Measures `passes` passes of `events` appends and as many plain inserts on `db`.
pub(crate) async fn measure(
    program: &str,
    db: &BenchDatabase,
    work_dir: &Path,
    events: usize,
    passes: usize,
) -> Result<AppendCost> {
    let client = db.client().await?;
    let registered: i64 = client
        .query_one("SELECT count(*) FROM wh_perspectives", &[])
        .await
        .context("counting registered perspectives")?
        .get(0);
    if registered != 0 {
        bail!("the append cost is measured with no perspective registered ({registered} are)");
    }
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {PLAIN_TABLE} (LIKE wh_events INCLUDING ALL)"
        ))
        .await
        .context("creating the plain insert's table")?;
    drop(client);
    let server = ServerTime::new(db).await?;
    let mut cost = AppendCost { passes: Vec::new() };
    for pass in 0..passes {
        // ABBA: the side that goes first alternates from pass to pass.
        let order = if pass % 2 == 0 {
            [Side::Append, Side::PlainInsert]
        } else {
            [Side::PlainInsert, Side::Append]
        };
        let mut this_pass = (0.0, 0.0);
        for side in order {
            let stream = uuid::Uuid::now_v7().to_string();
            let defines = [("stream", stream), ("v", "0".to_owned())];
            let before = server.read_us().await?;
            let measured = pgbench::run(
                program,
                db,
                work_dir,
                &format!("append_cost_{pass}_{side:?}"),
                &PgbenchRun {
                    script: &side.script(),
                    clients: 1,
                    limit: pgbench::Limit::Transactions(events.max(1)),
                    defines: &defines,
                },
            )
            .await
            .with_context(|| format!("pgbench: {}", side.label()))?;
            let after = server.read_us().await?;
            let per_event = (after - before) / measured.ops.max(1) as f64;
            match side {
                Side::Append => this_pass.0 = per_event,
                Side::PlainInsert => this_pass.1 = per_event,
            }
        }
        cost.passes.push(this_pass);
    }
    Ok(cost)
}
