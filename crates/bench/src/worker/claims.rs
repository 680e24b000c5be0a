//! The latency of one `claim_batch` (two statements: `lockstep_perspective_claim_pairs` for the
//! pairs and their work ids, then the pairs' events) against the length of the queue: a
//! database with `--claim-small-streams` × `--claim-events-per-stream` work rows (100 × 100 =
//! 10 000) and one with `--claim-large-streams` × the same (10 000 × 100 = 1 000 000) of the
//! claimed perspective — the same events per pair, so every claim hands out the same work (64
//! pairs of 100 events) and only the queue's length differs. The events are appended before the
//! perspective is registered (the registration enqueues the work), then `VACUUM ANALYZE`. Each
//! claim runs in a transaction of its own that is rolled back (the queue stays as it is), with
//! the worker's default limits, the positions carried from one claim to the next as the worker
//! does; only the claim's statements are timed. One untimed claim per queue first (plans,
//! caches); then `--claims` per queue, alternating between the queues (the order swapped every
//! claim), in `--claim-rounds` rounds: the ratio of the means per round, and their median.

use lockstep_core::perspective_store::prelude::*;
use std::time::Instant;

use anyhow::{Result, bail};
use lockstep_core::{
    BatchClaim, BatchLimits, ClaimedBatch, ClaimedWork, PerspectiveName, StreamId, Transaction as _,
};
use lockstep_pg::PgTransaction;
use lockstep_pg_store::PgPerspectiveStore;

use super::{Args, append_with, create, fmt_all, median, number_event, options, register, vacuum};
use crate::bench_db::BenchDatabase;

/// Claims of one perspective on a connection of their own, each rolled back, the positions
/// carried from one to the next.
pub(super) struct Claimer {
    pool: deadpool_postgres::Pool,
    request: BatchClaim,
}

impl Claimer {
    pub(super) fn new(
        db: &BenchDatabase,
        perspective: &PerspectiveName,
        limits: BatchLimits,
    ) -> Result<Claimer> {
        let mut request = BatchClaim::new(std::slice::from_ref(perspective));
        request.limits = limits;
        Ok(Claimer {
            pool: db.pool(1)?,
            request,
        })
    }

    /// One claim, rolled back: its latency in ms (the claim's statements only) and what it
    /// handed out.
    pub(super) async fn claim(&mut self) -> Result<(f64, ClaimedBatch)> {
        let store = PgPerspectiveStore::new();
        let tx = PgTransaction::begin(&self.pool).await?;
        let started = Instant::now();
        let batch = store.claim_batch(&tx, &self.request).await?;
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        tx.rollback().await?;
        self.request.positions.clone_from(&batch.positions);
        Ok((ms, batch))
    }
}

/// Every claimed pair is of a stream of the queue, needs no rewind, and has its events in
/// event-id order, `per_pair` of them (the last pair may have fewer: the batch's event bound).
/// Returns the events handed out.
fn check_batch(batch: &ClaimedBatch, per_pair: usize, max_pairs: usize) -> Result<usize> {
    if batch.pairs.is_empty() || batch.pairs.len() > max_pairs {
        bail!(
            "a claim on a full queue handed out {} pairs (expected 1 to {max_pairs})",
            batch.pairs.len()
        );
    }
    let mut events = 0;
    let last = batch.pairs.len() - 1;
    for (i, pair) in batch.pairs.iter().enumerate() {
        let ClaimedWork::Apply {
            events: claimed, ..
        } = &pair.work
        else {
            bail!(
                "a claim handed out {} for a rewind",
                pair.cursor.pair.clone()
            );
        };
        let ordered = claimed.windows(2).all(|w| w[0].event_id < w[1].event_id);
        let own = claimed
            .iter()
            .all(|e| e.stream_id == pair.cursor.pair.stream_id);
        if !ordered || !own || claimed.is_empty() || (i < last && claimed.len() != per_pair) {
            bail!(
                "a claim handed out {} events for {} (expected {per_pair} of its stream, in \
                 order)",
                claimed.len(),
                pair.cursor.pair.clone()
            );
        }
        events += claimed.len();
    }
    Ok(events)
}

/// The mean latency of `claims` claims on the queue as it is (after one untimed claim), in ms.
pub(super) async fn mean_claim_ms(
    db: &BenchDatabase,
    perspective: &PerspectiveName,
    limits: BatchLimits,
    claims: usize,
) -> Result<f64> {
    let mut claimer = Claimer::new(db, perspective, limits)?;
    let (_, warm) = claimer.claim().await?;
    if warm.pairs.is_empty() {
        bail!("claim_batch found nothing on a full queue");
    }
    let mut ms = Vec::with_capacity(claims);
    for _ in 0..claims {
        let (t, batch) = claimer.claim().await?;
        if batch.pairs.is_empty() {
            bail!("claim_batch found nothing on a full queue");
        }
        ms.push(t);
    }
    Ok(ms.iter().sum::<f64>() / ms.len().max(1) as f64)
}

/// One queue of the measurement.
struct Queue {
    db: BenchDatabase,
    streams: usize,
    claimer: Option<Claimer>,
    ms: Vec<Vec<f64>>,
    pairs: Vec<usize>,
    events: Vec<usize>,
}

/// Runs the measurement; returns its lines and the headline (median of the per-round ratios of
/// the mean latencies, long queue ÷ short queue).
pub(super) async fn run(url: &str, args: &Args) -> Result<(Vec<String>, f64)> {
    let mut queues = Vec::new();
    let mut outcome = Ok(());
    for streams in [args.claim_small_streams, args.claim_large_streams] {
        match create(url, args).await {
            Ok(db) => {
                queues.push(Queue {
                    db,
                    streams,
                    claimer: None,
                    ms: vec![Vec::new(); args.claim_rounds],
                    pairs: Vec::new(),
                    events: Vec::new(),
                });
            }
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
    }
    let measured = match outcome {
        Ok(()) => measure(&mut queues, args).await,
        Err(e) => Err(e),
    };
    for q in queues {
        if let Some(claimer) = q.claimer {
            claimer.pool.close();
        }
        q.db.drop_database().await?;
    }
    measured
}

async fn measure(queues: &mut [Queue], args: &Args) -> Result<(Vec<String>, f64)> {
    let limits = options(args, 1).batch_limits();
    let per_pair = args.claim_events_per_stream.min(limits.events_per_pair);
    let name = PerspectiveName::new("Claimed")?;
    for q in queues.iter_mut() {
        let rows = q.streams * args.claim_events_per_stream;
        eprintln!(
            "claims: appending {rows} events over {} streams (then registering: {rows} work \
             rows)",
            q.streams
        );
        let streams: Vec<StreamId> = (0..q.streams).map(|_| StreamId::new_v7()).collect();
        append_with(
            &q.db,
            &streams,
            args.claim_events_per_stream,
            &|_, _, n| number_event(n),
            Some(1000),
        )
        .await?;
        let started = Instant::now();
        register(&q.db, std::slice::from_ref(&name)).await?;
        vacuum(&q.db).await?;
        eprintln!(
            "  registered and vacuumed in {:.0} s",
            started.elapsed().as_secs_f64()
        );
        let mut claimer = Claimer::new(&q.db, &name, limits)?;
        let (_, warm) = claimer.claim().await?;
        check_batch(&warm, per_pair, limits.pairs)?;
        q.claimer = Some(claimer);
    }
    let per_round = args.claims / args.claim_rounds;
    let mut k = 0usize;
    for round in 0..args.claim_rounds {
        for _ in 0..per_round {
            let order: [usize; 2] = if k.is_multiple_of(2) { [0, 1] } else { [1, 0] };
            k += 1;
            for &i in &order {
                let q = &mut queues[i];
                let Some(claimer) = q.claimer.as_mut() else {
                    bail!("a queue without its claimer");
                };
                let (ms, batch) = claimer.claim().await?;
                q.events.push(check_batch(&batch, per_pair, limits.pairs)?);
                q.pairs.push(batch.pairs.len());
                q.ms[round].push(ms);
            }
        }
    }
    // The queues are as they were: every claim was rolled back.
    for q in queues.iter() {
        let left: i64 =
            q.db.client()
                .await?
                .query_one(
                    "SELECT count(*) FROM wh_perspective_events WHERE perspective_name = $1",
                    &[&name.as_str()],
                )
                .await?
                .get(0);
        let want = (q.streams * args.claim_events_per_stream) as i64;
        if left != want {
            bail!("the queue holds {left} work rows after rolled-back claims, not {want}");
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let ratios: Vec<f64> = (0..args.claim_rounds)
        .map(|r| mean(&queues[1].ms[r]) / mean(&queues[0].ms[r]))
        .collect();
    let mut lines = vec![
        format!(
            "### claim latency: one claim_batch on a queue of {} vs {} work rows of the claimed \
             perspective ({} claims each, {} rounds)",
            queues[0].streams * args.claim_events_per_stream,
            queues[1].streams * args.claim_events_per_stream,
            per_round * args.claim_rounds,
            args.claim_rounds
        ),
        String::new(),
        "| work rows | streams | pairs per claim | events per claim | mean ms | median ms | p90 ms | rounds (mean ms) |".to_owned(),
        "|---:|---:|---:|---:|---:|---:|---:|---|".to_owned(),
    ];
    for q in queues.iter() {
        let all: Vec<f64> = q.ms.iter().flatten().copied().collect();
        let mut sorted = all.clone();
        sorted.sort_by(f64::total_cmp);
        let p90 = sorted
            .get((sorted.len() * 9 / 10).min(sorted.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN);
        let rounds: Vec<f64> = q.ms.iter().map(|r| mean(r)).collect();
        lines.push(format!(
            "| {} | {} | {:.0} | {:.0} | {:.3} | {:.3} | {p90:.3} | {} |",
            q.streams * args.claim_events_per_stream,
            q.streams,
            mean(&q.pairs.iter().map(|&p| p as f64).collect::<Vec<_>>()),
            mean(&q.events.iter().map(|&e| e as f64).collect::<Vec<_>>()),
            mean(&all),
            median(&all),
            fmt_all(&rounds)
        ));
    }
    lines.push(String::new());
    let headline = median(&ratios);
    lines.push(format!(
        "long ÷ short queue, mean claim latency: {headline:.3} (median of per-round ratios; \
         rounds: {})",
        fmt_all(&ratios)
    ));
    lines.push(format!(
        "Timed: the claim's statements only (lockstep_core::WorkQueue::claim_batch), each in a transaction \
         of its own, rolled back; the worker's default limits ({} pairs, {} events per pair, {} \
         events, scan {}); positions carried from one claim to the next; one untimed claim per \
         queue first; the two queues alternate, the order swapped every claim. Every claim \
         checked: {per_pair} events per pair, of its stream, in event-id order; the queues \
         unchanged at the end.",
        limits.pairs, limits.events_per_pair, limits.events, limits.scan
    ));
    Ok((lines, headline))
}
