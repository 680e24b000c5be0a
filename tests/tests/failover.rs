//! Every guarantee through a primary failover (`lockstep_tests::reliability::failover` and
//! `::workers::run_through_failovers`): a primary and a streaming standby of the test's own,
//! the primary killed mid-work and the standby promoted, the clients on one multi-host URL with
//! `target_session_attrs=read-write`. Synchronous replication must lose nothing acknowledged;
//! asynchronous replication may lose the last acknowledged writes (counted and printed), and
//! everything else still holds: no wrong answer, no event applied twice or skipped, exact folds
//! in the JSON states and in the application's table, a fence that refuses a stale holder.
//!
//! One pair at a time: each test starts two clusters and worker processes of its own, and the
//! machine has few cores.

use lockstep_tests::reliability::Scale;
use lockstep_tests::reliability::failover::{self, FailoverReport};
use lockstep_tests::reliability::replication::Replication;
use lockstep_tests::reliability::workers::{self, WorkerCommand};

static ONE_PAIR_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn print(what: &str, report: &FailoverReport) {
    eprintln!("{what}: {} ({})", report.tally, report.stats);
    for detail in &report.tally.details {
        eprintln!("  {detail}");
    }
}

/// Commands under the aggregate lock and through the combiner, synchronous replication:
/// every acknowledged command is on the new primary at the version it was answered with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_sync_commands_lose_nothing_acknowledged_and_never_answer_wrong() {
    let _one = ONE_PAIR_AT_A_TIME.lock().await;
    let report = tokio::spawn(failover::commands(Replication::Synchronous, Scale::Short))
        .await
        .expect("the scenario does not panic")
        .expect("the scenario runs");
    print("failover sync commands", &report);
    assert_eq!(report.stats.failovers, 1, "{}", report.stats);
    assert!(report.stats.acknowledged > 0, "{}", report.stats);
    assert_eq!(report.stats.lost_acknowledged, 0, "{}", report.stats);
    assert!(report.tally.is_clean(), "{}", report.tally);
}

/// The same with asynchronous replication: acknowledged commands may be lost (counted), no
/// answer is wrong, and the versions stay gapless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_async_commands_may_lose_the_last_acknowledged_but_never_answer_wrong() {
    let _one = ONE_PAIR_AT_A_TIME.lock().await;
    let report = tokio::spawn(failover::commands(Replication::Asynchronous, Scale::Short))
        .await
        .expect("the scenario does not panic")
        .expect("the scenario runs");
    print("failover async commands", &report);
    assert_eq!(report.stats.failovers, 1, "{}", report.stats);
    assert!(report.stats.acknowledged > 0, "{}", report.stats);
    assert!(report.tally.is_clean(), "{}", report.tally);
}

/// Asynchronous replication loses a lease's epoch increment: the holder the new primary never
/// saw is refused by the fence, although its epoch matches the new holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_async_fence_refuses_a_holder_whose_epoch_increment_was_lost() {
    let _one = ONE_PAIR_AT_A_TIME.lock().await;
    let report = tokio::spawn(failover::lost_epoch())
        .await
        .expect("the scenario does not panic")
        .expect("the scenario runs");
    print("failover async lost epoch", &report);
    assert_eq!(report.stats.epochs_back, 1, "{}", report.stats);
    assert_eq!(report.stats.lost_acknowledged, 5, "{}", report.stats);
    assert!(report.tally.is_clean(), "{}", report.tally);
}

fn worker_command() -> WorkerCommand {
    WorkerCommand::new(env!("CARGO_BIN_EXE_lockstep-test-worker"), [])
}

/// Worker processes catching up and rewinding with leases held (JSON states and a table
/// perspective), synchronous replication: the processes live through the failover, resume,
/// and every fold is exact; lease epochs continue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_sync_worker_fleet_resumes_with_exact_folds_in_states_and_tables() {
    let _one = ONE_PAIR_AT_A_TIME.lock().await;
    let command = worker_command();
    let (report, stats) = tokio::spawn(async move {
        workers::run_through_failovers(Scale::Short, Replication::Synchronous, &command).await
    })
    .await
    .expect("the scenario does not panic")
    .expect("the scenario runs");
    eprintln!(
        "failover sync workers: {} ({}; {stats})",
        report.tally, report.stats
    );
    for detail in &report.tally.details {
        eprintln!("  {detail}");
    }
    assert_eq!(stats.failovers, 1, "{stats}");
    assert_eq!(stats.lost_acknowledged, 0, "{stats}");
    assert!(report.stats.late > 0, "{}", report.stats);
    assert!(report.tally.is_clean(), "{}", report.tally);
}

/// The same with asynchronous replication: what was lost is counted; the folds equal what the
/// new primary holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_async_worker_fleet_resumes_with_exact_folds_of_what_survived() {
    let _one = ONE_PAIR_AT_A_TIME.lock().await;
    let command = worker_command();
    let (report, stats) = tokio::spawn(async move {
        workers::run_through_failovers(Scale::Short, Replication::Asynchronous, &command).await
    })
    .await
    .expect("the scenario does not panic")
    .expect("the scenario runs");
    eprintln!(
        "failover async workers: {} ({}; {stats})",
        report.tally, report.stats
    );
    for detail in &report.tally.details {
        eprintln!("  {detail}");
    }
    assert_eq!(stats.failovers, 1, "{stats}");
    assert!(report.tally.is_clean(), "{}", report.tally);
}

/// A primary made read-only (as a switchover fences the old primary with
/// `default_transaction_read_only`): a write fails as a lost connection (retryable), its
/// connection is closed instead of pooled, and once the server accepts writes again the next
/// unit of work connects anew and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_a_primary_made_read_only_gets_its_connections_dropped_from_the_pool() {
    use lockstep_core::TransactionSource as _;
    use lockstep_core::{ErrorKind, EventStore as _, ExpectedVersion, StreamId, Transaction as _};
    use lockstep_tests::reliability::server::PrivateServer;

    let _one = ONE_PAIR_AT_A_TIME.lock().await;
    let server = PrivateServer::start().await.expect("a private server");
    let url = lockstep_tests::database_url(&server.config());
    let outcome = tokio::spawn(async move {
        let (admin, connection) = server
            .config()
            .connect(tokio_postgres::NoTls)
            .await
            .expect("admin connection");
        tokio::spawn(connection);
        let db = lockstep_pg::PgDatabase::builder()
            .url(&url)
            .max_connections(2)
            .build()
            .expect("database");
        db.migrate().await.expect("migrate");
        let store = lockstep_pg_store::PgEventStore::new(&db);
        let stream = StreamId::new_v7();
        let append = |n: i64| {
            let (db, store) = (db.clone(), store.clone());
            async move {
                let tx = db.begin().await?;
                let appended = store
                    .append(
                        &tx,
                        stream,
                        ExpectedVersion::Any,
                        &[lockstep_tests::number_event(n)],
                    )
                    .await;
                match appended {
                    Ok(_) => tx.commit().await,
                    Err(e) => {
                        let _ = tx.rollback().await;
                        Err(e)
                    }
                }
            }
        };
        append(1).await.expect("a write on the primary");
        assert_eq!(db.pool().status().size, 1, "one pooled connection");

        let set_read_only = |on: bool| {
            let admin = &admin;
            async move {
                let setting = if on {
                    "ALTER SYSTEM SET default_transaction_read_only = on"
                } else {
                    "ALTER SYSTEM RESET default_transaction_read_only"
                };
                admin.batch_execute(setting).await.expect("alter system");
                admin
                    .batch_execute("SELECT pg_reload_conf()")
                    .await
                    .expect("reload");
                // The reload reaches every session: wait until this one sees it.
                let wanted = if on { "on" } else { "off" };
                for _ in 0..500 {
                    let row = admin
                        .query_one("SHOW default_transaction_read_only", &[])
                        .await
                        .expect("show");
                    if row.get::<_, String>(0) == wanted {
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                panic!("the server did not take default_transaction_read_only = {wanted}");
            }
        };
        set_read_only(true).await;
        let refused = append(2)
            .await
            .expect_err("a write on a read-only server fails");
        assert_eq!(refused.kind(), ErrorKind::ConnectionLost, "{refused}");
        assert!(refused.is_retryable(), "{refused}");
        assert_eq!(
            db.pool().status().size,
            0,
            "the connection to the read-only server was closed, not pooled"
        );

        set_read_only(false).await;
        append(3)
            .await
            .expect("a write once the server accepts writes again");
        let count: i64 = admin
            .query_one(
                "SELECT count(*) FROM wh_events WHERE stream_id = $1",
                &[&stream.as_uuid()],
            )
            .await
            .expect("count")
            .get(0);
        assert_eq!(count, 2, "the refused write left nothing");
        drop(server);
    })
    .await;
    outcome.expect("the test body does not panic");
}
