//! Versions of a table perspective on PostgreSQL: each version writes its own table
//! (`tally_v1`, `tally_v2`), the application reads a view (`tally`) that the promoted version's
//! hook repoints in the promoting transaction. While version 2 builds and appends go on, every
//! read of the view sees one version's complete table; the promotion switches the view in the
//! commit that makes version 2 serve; a hook that fails rolls the promotion back and leaves the
//! view and the versions as they were. Workers and readers run in tasks of their own, with the
//! concrete Postgres types, as a service runs them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;
use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    ExpectedVersion, InstanceId, NewEvent, PerspectiveName, PerspectiveRegistry, RecordedEvent,
    Registration, StreamId, StreamLocker, TablePerspective, TransactionSource as _, VersionPolicy,
    VersionStatus,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::test_database;
use lockstep_worker::versions::{self, Promoted, VersionError, event_id_at};
use lockstep_worker::{CancellationToken, PerspectiveWorker, PromoteOptions, WorkerOptions};
use uuid::Uuid;

/// The application's schema: a table per version and the view its handlers read.
const SCHEMA: &str = "
CREATE TABLE tally_v1 (stream_id uuid PRIMARY KEY, total bigint NOT NULL, events int NOT NULL,
                       version int NOT NULL);
CREATE TABLE tally_v2 (LIKE tally_v1 INCLUDING ALL);
CREATE TABLE tally_v3 (LIKE tally_v1 INCLUDING ALL);
CREATE VIEW tally AS SELECT * FROM tally_v1;
";

/// Per stream, in `tally_v{version}`: the sum of `n` times the version, the events applied and
/// the version that wrote the row. Version 3's hook is broken: it would change the view's
/// columns, which PostgreSQL refuses.
struct Tally {
    version: u32,
}

impl Tally {
    fn table(&self) -> String {
        format!("tally_v{}", self.version)
    }
}

impl TablePerspective<PgTransaction> for Tally {
    type Error = tokio_postgres::Error;

    fn name(&self) -> &str {
        "Tally"
    }

    fn version(&self) -> u32 {
        self.version
    }

    async fn promote(&self, tx: &PgTransaction) -> Result<(), Self::Error> {
        let view = match self.version {
            3 => "CREATE OR REPLACE VIEW tally AS SELECT stream_id FROM tally_v3".to_owned(),
            _ => format!(
                "CREATE OR REPLACE VIEW tally AS SELECT * FROM {}",
                self.table()
            ),
        };
        tx.client().batch_execute(&view).await
    }

    async fn apply(&self, tx: &PgTransaction, event: &RecordedEvent) -> Result<(), Self::Error> {
        let n = event.payload["n"].as_i64().unwrap_or(0) * i64::from(self.version);
        let version = i32::try_from(self.version).unwrap_or(i32::MAX);
        tx.client()
            .execute(
                &format!(
                    "INSERT INTO {} AS t (stream_id, total, events, version) VALUES ($1, $2, 1, $3)
                     ON CONFLICT (stream_id) DO UPDATE
                     SET total = t.total + EXCLUDED.total, events = t.events + 1",
                    self.table()
                ),
                &[&event.stream_id.as_uuid(), &n, &version],
            )
            .await?;
        Ok(())
    }

    async fn reset(&self, tx: &PgTransaction, stream_id: StreamId) -> Result<(), Self::Error> {
        tx.client()
            .execute(
                &format!("DELETE FROM {} WHERE stream_id = $1", self.table()),
                &[&stream_id.as_uuid()],
            )
            .await?;
        Ok(())
    }
}

fn registry(versions: &[u32]) -> PerspectiveRegistry {
    let mut registry = PerspectiveRegistry::new();
    for version in versions {
        registry
            .register_table_with::<PgTransaction, _>(
                Tally { version: *version },
                VersionPolicy::new().manual(),
            )
            .expect("register");
    }
    registry
}

type Worker = PerspectiveWorker<PgDatabase, PgPerspectiveStore>;

fn worker(db: &PgDatabase, versions: &[u32]) -> Arc<Worker> {
    let locker: Arc<dyn StreamLocker> = Arc::new(PgStreamLocker::new(
        db,
        lockstep_core::StreamLockOptions::default(),
    ));
    Arc::new(
        PerspectiveWorker::new(
            db.clone(),
            PgPerspectiveStore::new(),
            registry(versions),
            WorkerOptions::default().with_poll_interval(Duration::from_millis(10)),
            InstanceId::random(),
            Some(locker),
        )
        .expect("worker"),
    )
}

async fn append(db: &PgDatabase, stream: StreamId, n: i64) -> Uuid {
    let event = NewEvent::new("Added", serde_json::json!({ "n": n })).expect("event");
    let id = event.event_id();
    let tx = db.begin().await.expect("begin");
    PgEventStore::new(db)
        .append(&tx, stream, ExpectedVersion::Any, &[event])
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    id
}

/// Waits (bounded) until `stored` is registered and has applied every event up to `up_to`.
async fn caught_up(db: &PgDatabase, stored: &PerspectiveName, up_to: Uuid) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let tx = db.begin().await.expect("begin");
        let pending = PgPerspectiveStore::new()
            .pending_through(&tx, stored, None, up_to)
            .await
            .expect("pending");
        tx.rollback().await.expect("rollback");
        if pending.registration == Some(Registration::Registered) && pending.is_caught_up() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{stored}: {pending:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One read of the view: (version, rows, events) per version it shows.
async fn read_view(client: &tokio_postgres::Client) -> Vec<(i32, i64, i64)> {
    client
        .query(
            "SELECT version, count(*), sum(events)::bigint FROM tally GROUP BY version",
            &[],
        )
        .await
        .expect("read the view")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_version_builds_in_its_own_table_and_the_view_switches_in_the_promoting_commit() {
    let test_db = test_database().await;
    let db = PgDatabase::from_pool(test_db.pool(8));
    db.migrate().await.expect("migrate");
    let admin = test_db.connect().await;
    admin.batch_execute(SCHEMA).await.expect("schema");
    let name = PerspectiveName::new("Tally").expect("valid");
    const STREAMS: usize = 20;
    let streams: Vec<StreamId> = (0..STREAMS).map(|_| StreamId::new_v7()).collect();
    let mut last = Uuid::nil();
    for stream in &streams {
        for n in 1..=3 {
            last = last.max(append(&db, *stream, n).await);
        }
    }
    let shutdown = CancellationToken::new();
    let v1 = worker(&db, &[1]);
    let running = tokio::spawn({
        let (v1, shutdown) = (Arc::clone(&v1), shutdown.clone());
        async move { v1.run(shutdown).await }
    });
    caught_up(&db, &name, last).await;
    shutdown.cancel();
    running.await.expect("task").expect("run");
    assert_eq!(
        read_view(&admin).await,
        [(1, STREAMS as i64, 3 * STREAMS as i64)]
    );

    // Versions 1 and 2 side by side, appends and reads of the view going on.
    let both = worker(&db, &[1, 2]);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (both, shutdown) = (Arc::clone(&both), shutdown.clone());
        async move { both.run(shutdown).await }
    });
    let done = Arc::new(AtomicBool::new(false));
    let promoted = Arc::new(AtomicBool::new(false));
    let appended = Arc::new(AtomicU64::new(0));
    let appender = tokio::spawn({
        let (db, done, appended, streams) = (
            db.clone(),
            Arc::clone(&done),
            Arc::clone(&appended),
            streams.clone(),
        );
        async move {
            let mut last = Uuid::nil();
            let mut i = 0;
            while !done.load(Ordering::Acquire) {
                last = last.max(append(&db, streams[i % streams.len()], 10).await);
                appended.fetch_add(1, Ordering::AcqRel);
                i += 1;
            }
            last
        }
    });
    let reads_after = Arc::new(AtomicU64::new(0));
    let reader = tokio::spawn({
        let (reader_client, done, promoted, reads_after) = (
            test_db.connect().await,
            Arc::clone(&done),
            Arc::clone(&promoted),
            Arc::clone(&reads_after),
        );
        async move {
            let mut bad = Vec::new();
            while !done.load(Ordering::Acquire) {
                let after = promoted.load(Ordering::Acquire);
                let read = read_view(&reader_client).await;
                let complete = read.len() == 1 && read[0].1 == STREAMS as i64;
                let right_version = !after || read.first().is_some_and(|r| r.0 == 2);
                if !complete || !right_version {
                    bad.push(format!("after promotion: {after}: {read:?}"));
                }
                if after {
                    reads_after.fetch_add(1, Ordering::AcqRel);
                }
            }
            bad
        }
    });
    let v2 = name.versioned(2).expect("versioned");
    caught_up(
        &db,
        &v2,
        event_id_at(lockstep_core::OffsetDateTime::now_utc()),
    )
    .await;
    // From a task of its own, as a request handler or an admin endpoint calls it.
    let outcome = tokio::spawn({
        let (both, name) = (Arc::clone(&both), name.clone());
        async move {
            both.promote(&name, 2, PromoteOptions::waiting(Duration::from_secs(60)))
                .await
        }
    })
    .await
    .expect("task")
    .expect("promote");
    assert_eq!(outcome, Promoted::Promoted { previous: Some(1) });
    promoted.store(true, Ordering::Release);
    let after_switch = appended.load(Ordering::Acquire) + 5;
    while appended.load(Ordering::Acquire) < after_switch || reads_after.load(Ordering::Acquire) < 3
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    done.store(true, Ordering::Release);
    let last = appender.await.expect("appender");
    let bad = reader.await.expect("reader");
    assert!(
        bad.is_empty(),
        "mixed or half-built reads of the view: {bad:?}"
    );
    caught_up(&db, &v2, last).await;

    // The view reads version 2, which holds every event once: 3 + the appended per stream.
    let total_events: i64 = admin
        .query_one("SELECT count(*) FROM wh_events", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(read_view(&admin).await, [(2, STREAMS as i64, total_events)]);
    let wrong: i64 = admin
        .query_one(
            "SELECT count(*) FROM tally t
               JOIN (SELECT stream_id, sum((payload->>'n')::bigint) * 2 AS total, count(*) AS n
                       FROM wh_events GROUP BY stream_id) e USING (stream_id)
              WHERE t.total <> e.total OR t.events <> e.n",
            &[],
        )
        .await
        .expect("compare")
        .get(0);
    assert_eq!(wrong, 0, "every row is version 2's fold of its stream");

    // A version whose hook fails: the promotion is rolled back, nothing moves.
    shutdown.cancel();
    running.await.expect("task").expect("run");
    let broken = worker(&db, &[2, 3]);
    broken.register().await.expect("register");
    let refused = broken.promote(&name, 3, PromoteOptions::forced()).await;
    assert!(
        matches!(refused, Err(VersionError::Hook { version: 3, .. })),
        "{refused:?}"
    );
    let listed = tokio::spawn({
        let (db, name) = (db.clone(), name.clone());
        async move { versions::versions(&db, &PgPerspectiveStore::new(), Some(&name)).await }
    });
    let statuses: Vec<(u32, VersionStatus)> = listed
        .await
        .expect("task")
        .expect("versions")
        .iter()
        .map(|v| (v.version, v.status))
        .collect();
    assert_eq!(
        statuses,
        [
            (1, VersionStatus::Retired),
            (2, VersionStatus::Serving),
            (3, VersionStatus::Building)
        ]
    );
    assert_eq!(read_view(&admin).await, [(2, STREAMS as i64, total_events)]);
    let serving = tokio::spawn({
        let (db, name) = (db.clone(), name.clone());
        async move {
            lockstep_worker::ReadModels::new(db, PgPerspectiveStore::new())
                .serving_version(&name)
                .await
        }
    });
    assert_eq!(serving.await.expect("task").expect("serving"), Some(2));
}
