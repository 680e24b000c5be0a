//! `upcast`: the catch-up of the `catch-up` section with one upcaster lifting every event, over
//! the same catch-up without, in one run on one database. `--upcast-streams` ×
//! `--upcast-events-per-stream` events (default 500 × 100 = 50 000) of version 1 are appended
//! once; each round registers a fresh perspective per side (its work rows: set-up, not timed)
//! and times one worker instance (concurrency 1, as the catch-up's headline) draining it: the
//! plain side on `PgPerspectiveStore::new()`, the upcast side on a store with an upcaster of
//! `Numbered` from version 1 that rebuilds every payload (`{"n": n}` →
//! `{"n": n, "unit": "each"}`). The sides alternate which goes first per round; the ratio is
//! the median of the per-round ratios of events/s (upcast ÷ plain). Both sides fold the same
//! list of numbers, checked against the events after every side.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use lockstep_core::{PerspectiveName, StreamId, StreamLockOptions, Upcasters};
use lockstep_pg_store::PgPerspectiveStore;

use super::{
    Args, Numbers, POLL, WorkLeft, append, check, create, drain, fmt_all, open_pool, options,
    register, vacuum, verify, worker_with_store,
};
use crate::report::median;

/// The upcaster of the upcast side: every stored event is of version 1, so every one is lifted.
fn lift_every_event() -> Result<Upcasters> {
    Ok(Upcasters::new().with("Numbered", 1, |mut payload| {
        let n = payload["n"].take();
        Ok(serde_json::json!({ "n": n, "unit": "each" }))
    })?)
}

/// The section's report lines and `catchup_upcast_vs_plain`.
pub(super) async fn run(url: &str, args: &Args) -> Result<(Vec<String>, f64)> {
    let db = create(url, args).await?;
    let outcome = measure(&db, args).await;
    db.drop_database().await?;
    outcome
}

async fn measure(db: &crate::bench_db::BenchDatabase, args: &Args) -> Result<(Vec<String>, f64)> {
    let streams: Vec<StreamId> = (0..args.upcast_streams)
        .map(|_| StreamId::new_v7())
        .collect();
    let total = args.upcast_streams * args.upcast_events_per_stream;
    eprintln!(
        "upcast: appending {total} events over {} streams",
        args.upcast_streams
    );
    append(db, &streams, args.upcast_events_per_stream).await?;
    let lock = StreamLockOptions::new(Duration::from_secs(30), Duration::from_secs(10))?;
    let upcasters = lift_every_event()?;
    // Side 0: plain; side 1: one upcaster lifting every event.
    let mut seconds: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut ratios = Vec::with_capacity(args.upcast_rounds);
    let progress = crate::report::Progress::new((args.upcast_rounds * 2) as u64);
    for round in 0..args.upcast_rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        let mut this = [0.0_f64; 2];
        for side in order {
            let label = if side == 0 { "plain" } else { "upcast" };
            progress.step(format!(
                "upcast round {}/{}: {label}",
                round + 1,
                args.upcast_rounds
            ));
            let name = format!("Upcast{round}{label}");
            let perspective = PerspectiveName::new(name.clone())?;
            register(db, std::slice::from_ref(&perspective)).await?;
            vacuum(db).await?;
            let store = if side == 0 {
                PgPerspectiveStore::new()
            } else {
                PgPerspectiveStore::new().with_upcasters(upcasters.clone())
            };
            let numbers: Arc<dyn lockstep_core::DynPerspective> = Arc::new(Numbers(name));
            let opts = options(args, 1);
            let pool = open_pool(db, opts.concurrency + 2).await?;
            let worker =
                worker_with_store(pool, opts, std::slice::from_ref(&numbers), lock, store)?;
            let left = WorkLeft::new(db, std::slice::from_ref(&perspective)).await?;
            let started = Instant::now();
            let applied = drain(&worker, &left, POLL).await?;
            let elapsed = started.elapsed().as_secs_f64();
            drop((worker, left));
            check(applied, total)?;
            verify(db, &perspective, args.upcast_streams).await?;
            seconds[side].push(elapsed);
            this[side] = total as f64 / elapsed;
        }
        ratios.push(this[1] / this[0]);
    }
    progress.finish();
    let ratio = median(&ratios);
    let mut lines = vec![
        format!(
            "### catch-up with an upcaster: {total} events (all of version 1) over {} streams, \
             {} rounds, sides alternating (1 worker instance, concurrency 1, poll 10 ms)",
            args.upcast_streams, args.upcast_rounds
        ),
        String::new(),
        "| side | median s | events/s | rounds (s) |".to_owned(),
        "|---|---:|---:|---|".to_owned(),
    ];
    for (side, label) in ["no upcaster", "one upcaster lifting every event"]
        .iter()
        .enumerate()
    {
        let m = median(&seconds[side]);
        lines.push(format!(
            "| {label} | {m:.3} | {:.0} | {} |",
            total as f64 / m,
            fmt_all(&seconds[side])
        ));
    }
    lines.push(String::new());
    lines.push(format!(
        "upcast ÷ plain, events/s, per round: {} (median {ratio:.3})",
        fmt_all(&ratios)
    ));
    Ok((lines, ratio))
}
