//! Issue 8, defect 3, for the stream locker: the cancel request of an abandoned `renew`,
//! `release` or `renew_many` can lose its race. It travels on a connection of its own and can
//! reach the server before the statement does; the server ignores a cancel that finds the
//! backend idle, and the statement then waits for the cursor row's lock and, once it gets it,
//! renews or releases the lease for a caller that gave up.
//!
//! The race is made deterministic with a relay between the locker's pool and the server that
//! holds the pool connection's bytes back for a while: the statement reaches the server after
//! the first cancel request. The cancel is sent again after short delays (lockstep-pg's
//! cancel-on-drop guard), so the wait still ends and the statement never runs.

mod common;

use std::time::Duration;

use common::{Db, acquire_by_anyone, long_options};
use lockstep_core::{
    LeaseId, PerspectiveName, ReleaseOutcome, RenewOutcome, StreamId, StreamLocker,
};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::relay::Relay;
use time::OffsetDateTime;
use tokio::time::Instant;

/// How long the relay holds back each chunk the locker's connection sends.
const HOLD_BACK: Duration = Duration::from_millis(300);
/// When the caller gives up (well before the held-back statement reaches the server).
const CALLER_TIMEOUT: Duration = Duration::from_millis(50);

/// The abandoned operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operation {
    Renew,
    Release,
    RenewMany,
}

impl Operation {
    /// Runs the operation on `lease` (its outcome is not looked at: it is abandoned).
    async fn run(self, locker: &PgStreamLocker, lease: &LeaseId) {
        match self {
            Operation::Renew => drop(locker.renew(lease).await),
            Operation::Release => drop(locker.release(lease).await),
            Operation::RenewMany => drop(locker.renew_many(std::slice::from_ref(lease)).await),
        }
    }
}

/// The lease columns of a cursor row: holder, expiry, epoch.
type LeaseColumns = (Option<uuid::Uuid>, Option<OffsetDateTime>, i64);

async fn lease_columns(
    client: &tokio_postgres::Client,
    stream: StreamId,
    perspective: &PerspectiveName,
) -> LeaseColumns {
    let row = client
        .query_one(
            "SELECT stream_lock_instance_id, stream_lock_expiry, stream_lock_epoch \
               FROM wh_perspective_cursors WHERE stream_id = $1 AND perspective_name = $2",
            &[&stream.as_uuid(), &perspective.as_str()],
        )
        .await
        .expect("the cursor row");
    (row.get(0), row.get(1), row.get(2))
}

/// The backend's state and wait event type (empty when not waiting), or `None` once it is gone.
async fn backend(client: &tokio_postgres::Client, pid: i32) -> Option<(String, String)> {
    client
        .query_opt(
            "SELECT coalesce(state, ''), coalesce(wait_event_type, '') \
               FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .await
        .expect("pg_stat_activity")
        .map(|row| (row.get(0), row.get(1)))
}

async fn an_abandoned_operation_never_runs_even_when_the_first_cancel_arrives_first(
    operation: Operation,
) {
    let db = Db::new(2).await;
    // The locker's pool has one connection, through the relay; the cancel requests, sent to
    // the connection's address, go through it too, on connections of their own.
    let relay = Relay::start(db.db.server_address().expect("a TCP server"))
        .await
        .expect("start the relay");
    let pool = db.db.pool_through(relay.addr(), 1);
    let locker = PgStreamLocker::from_pool(pool.clone(), long_options());
    let (stream, perspective) = db.order_cursor().await;
    let lease = acquire_by_anyone(&locker, stream, &perspective).await;

    // Prepare the operation's statement on the pool's connection now (the locker prepares once
    // per connection): held back, a prepare would outlast the caller's timeout, which would then
    // drop the operation before its statement — and its cancel guard — ever went out.
    match operation {
        Operation::Renew => assert!(matches!(
            locker.renew(&lease.id).await.expect("renew"),
            RenewOutcome::Renewed { .. }
        )),
        Operation::RenewMany => assert!(matches!(
            locker
                .renew_many(std::slice::from_ref(&lease.id))
                .await
                .expect("renew_many")[..],
            [RenewOutcome::Renewed { .. }]
        )),
        Operation::Release => {
            let (other, _) = db.order_cursor().await;
            let warm_up = acquire_by_anyone(&locker, other, &perspective).await;
            assert_eq!(
                locker.release(&warm_up.id).await.expect("release"),
                ReleaseOutcome::Released
            );
        }
    }
    let pid: i32 = pool
        .get()
        .await
        .expect("the locker's connection")
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);

    let observer = db.client().await;
    let before = lease_columns(&observer, stream, &perspective).await;
    assert_eq!(
        before.0,
        Some(lease.id.holder.as_uuid()),
        "the lease is held"
    );

    // Another transaction, straight to the server, holds the cursor row's lock.
    let mut holder = db.client().await;
    let row_lock = holder.transaction().await.expect("begin");
    row_lock
        .query_one(
            "SELECT stream_id FROM wh_perspective_cursors \
              WHERE stream_id = $1 AND perspective_name = $2 FOR UPDATE",
            &[&stream.as_uuid(), &perspective.as_str()],
        )
        .await
        .expect("the row lock");

    // From here the locker's statement reaches the server ~300 ms after it is sent; the caller
    // gives up after 50 ms, so the first cancel request arrives while the backend is idle. Only
    // the connection open now is held back: the cancel requests (new ones) go straight through.
    assert_eq!(relay.hold_back(HOLD_BACK), 1, "the pool's one connection");
    let abandoned = tokio::time::timeout(CALLER_TIMEOUT, operation.run(&locker, &lease.id)).await;
    assert!(abandoned.is_err(), "the {operation:?} is abandoned");
    let dropped = Instant::now();

    // The race is on: when the first cancel request went out (at the drop), the statement had
    // not reached the server yet; it does later, and waits for the row lock.
    let at_drop = backend(&observer, pid).await;
    assert_eq!(
        at_drop.as_ref().map(|(state, _)| state.as_str()),
        Some("idle"),
        "the statement reached the server before the caller gave up: the race is not exercised"
    );
    let mut waited = false;
    while !waited && dropped.elapsed() < Duration::from_millis(1400) {
        waited = backend(&observer, pid)
            .await
            .is_some_and(|(_, wait)| wait == "Lock");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        waited,
        "the statement never waited for the row lock after the first cancel request: the race \
         is not exercised"
    );

    // Long after the statement reached the server, its backend must not be waiting any more
    // (its connection was discarded with the abandoned operation, so it may be gone).
    tokio::time::sleep_until(dropped + Duration::from_millis(1500)).await;
    if let Some((state, wait)) = backend(&observer, pid).await {
        assert_ne!(
            wait, "Lock",
            "the abandoned {operation:?} still waits for the row lock (state {state}): the \
             cancel request that arrived before it was the only one"
        );
    }

    // The row lock is released: the abandoned statement must not run now.
    row_lock.commit().await.expect("commit");
    tokio::time::sleep(Duration::from_millis(150)).await;
    let after = lease_columns(&observer, stream, &perspective).await;
    assert_eq!(
        after, before,
        "the abandoned {operation:?} ran after the row lock was released"
    );
    relay.hold_back(Duration::ZERO);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_renew_never_runs_even_when_the_first_cancel_arrives_before_it() {
    an_abandoned_operation_never_runs_even_when_the_first_cancel_arrives_first(Operation::Renew)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_release_never_runs_even_when_the_first_cancel_arrives_before_it() {
    an_abandoned_operation_never_runs_even_when_the_first_cancel_arrives_first(Operation::Release)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_renew_many_never_runs_even_when_the_first_cancel_arrives_before_it() {
    an_abandoned_operation_never_runs_even_when_the_first_cancel_arrives_first(
        Operation::RenewMany,
    )
    .await;
}
