//! The event store on sqlx (`SqlxDatabase`, `SqlxTransaction`) against a real PostgreSQL, a
//! database per test: the same event-store conformance suite as on
//! tokio-postgres, one test per case, and a unit of work as a web handler runs it.

use lockstep_core::{
    AggregateType, ErrorKind, EventStore, ExpectedVersion, NewEvent, StreamId, Transaction as _,
    TransactionSource as _, aggregate_key,
};
use lockstep_pg::LockQueue;
use lockstep_pg::sqlx::{SqlxDatabase, SqlxTransaction};
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::conformance::event_store::EventStoreFixture;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};

struct Fixture {
    db: TestDatabase,
    source: SqlxDatabase,
    store: PgEventStore,
}

impl EventStoreFixture for Fixture {
    type Tx = SqlxTransaction;
    type Source = SqlxDatabase;
    type Store = PgEventStore;

    fn store(&self) -> &PgEventStore {
        &self.store
    }

    fn store_with_upcasters(&self, upcasters: lockstep_core::Upcasters) -> PgEventStore {
        self.store.clone().with_upcasters(upcasters)
    }

    fn source(&self) -> &SqlxDatabase {
        &self.source
    }

    async fn waiting(&self) -> usize {
        // The test's own database: only this case's statements run there.
        let client = self.db.connect().await;
        lockstep_testkit::pg_harness::lock_waiters(&client).await
    }
}

/// A migrated database of the test's own, its sqlx handle (8 connections).
async fn migrated() -> (TestDatabase, SqlxDatabase) {
    let db = test_database().await;
    lockstep_pg::migrate(&db.pool(1)).await.expect("migrate");
    let source = SqlxDatabase::new(db.sqlx_pool(8));
    (db, source)
}

async fn fixture(queue: LockQueue) -> Fixture {
    let (db, source) = migrated().await;
    let source = source.with_lock_queue(queue.clone());
    Fixture {
        db,
        source,
        store: PgEventStore::with_queue(queue),
    }
}

/// The event-store conformance suite on sqlx, one test per case.
mod event_store_suite {
    use super::*;

    lockstep_testkit::event_store_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(LockQueue::new()).await,
    }
}

/// The suite with the in-process queue off: every waiter waits at the server.
mod event_store_suite_without_the_local_queue {
    use super::*;

    lockstep_testkit::event_store_conformance! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        fixture: fixture(LockQueue::new().with_local_queue(false)).await,
    }
}

/// A handler's unit of work on sqlx, run from a spawned task with the concrete types: lock,
/// load, append, write the application's own row with sqlx on the same transaction, commit
/// once. Both are stored, or (rolled back) neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_commits_its_own_rows_and_its_events_in_one_sqlx_transaction() {
    let (_db, source) = migrated().await;
    sqlx::query("CREATE TABLE audit (stream uuid NOT NULL, note text NOT NULL)")
        .execute(source.pool())
        .await
        .expect("create table");
    let store = PgEventStore::for_sqlx(&source);
    let item = AggregateType::new("StockItem").expect("type");

    let handler = |commit: bool, note: &'static str| {
        let (source, store, item) = (source.clone(), store.clone(), item.clone());
        tokio::spawn(async move {
            let id = uuid::Uuid::now_v7();
            let stream = StreamId::from_uuid(id);
            let tx: SqlxTransaction = source.begin().await?;
            let events = store
                .load_locked(&tx, stream, &aggregate_key(&item, id), None)
                .await?;
            assert!(events.is_empty());
            let event = NewEvent::new("Reserved", serde_json::json!({ "note": note }))?;
            store
                .append(&tx, stream, ExpectedVersion::NoStream, &[event])
                .await?;
            {
                let mut conn = tx.connection().await?;
                sqlx::query("INSERT INTO audit (stream, note) VALUES ($1, $2)")
                    .bind(id)
                    .bind(note)
                    .execute(&mut *conn)
                    .await
                    .map_err(lockstep_pg::sqlx::map_sqlx_error)?;
            }
            if commit {
                tx.commit().await?;
            } else {
                tx.rollback().await?;
            }
            Ok::<_, lockstep_core::Error>(stream)
        })
    };

    let kept = handler(true, "kept")
        .await
        .expect("task")
        .expect("unit of work");
    let dropped = handler(false, "rolled back")
        .await
        .expect("task")
        .expect("unit of work");

    let count = |stream: StreamId, table: &'static str| {
        let pool = source.pool().clone();
        async move {
            let column = if table == "audit" {
                "stream"
            } else {
                "stream_id"
            };
            let sql = format!("SELECT count(*) FROM {table} WHERE {column} = $1");
            sqlx::query_scalar::<_, i64>(&sql)
                .bind(stream.as_uuid())
                .fetch_one(&pool)
                .await
                .expect("count")
        }
    };
    assert_eq!(count(kept, "wh_events").await, 1);
    assert_eq!(count(kept, "audit").await, 1);
    assert_eq!(count(dropped, "wh_events").await, 0);
    assert_eq!(count(dropped, "audit").await, 0);
}

/// A conflict on sqlx has the same kind and details as on tokio-postgres: one error mapping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_expected_version_is_the_same_typed_conflict_on_sqlx() {
    let (_db, source) = migrated().await;
    let store = PgEventStore::for_sqlx(&source);
    let stream = StreamId::new_v7();
    let task = tokio::spawn({
        let (source, store) = (source.clone(), store.clone());
        async move {
            let tx = source.begin().await?;
            let first = NewEvent::new("Opened", serde_json::json!({}))?;
            store
                .append(&tx, stream, ExpectedVersion::NoStream, &[first])
                .await?;
            let stale = NewEvent::new("Opened", serde_json::json!({}))?;
            let err = store
                .append(&tx, stream, ExpectedVersion::Exact(0), &[stale])
                .await
                .expect_err("stale");
            tx.rollback().await?;
            Ok::<_, lockstep_core::Error>(err)
        }
    });
    let err = task.await.expect("task").expect("unit of work");
    assert_eq!(err.kind(), ErrorKind::Conflict);
    let conflict = lockstep_core::version_conflict(&err).expect("a version conflict");
    assert_eq!(conflict.actual(), Some(1));
}

/// On a database that was never migrated, the stores on sqlx say what to do, as on
/// tokio-postgres: the event store with the server's message and SQLSTATE, a registration (a
/// worker's start) with the schema check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_an_unmigrated_database_the_stores_on_sqlx_say_to_run_the_migrations() {
    use lockstep_core::perspective_store::prelude::*;

    let db = test_database().await;
    let source = SqlxDatabase::new(db.sqlx_pool(2));
    let task = tokio::spawn(async move {
        let store = PgEventStore::for_sqlx(&source);
        let tx: SqlxTransaction = source.begin().await?;
        let event = NewEvent::new("Happened", serde_json::json!({}))?;
        let append = store
            .append(&tx, StreamId::new_v7(), ExpectedVersion::Any, &[event])
            .await
            .expect_err("no schema");
        tx.rollback().await?;

        let tx: SqlxTransaction = source.begin().await?;
        let name = lockstep_core::PerspectiveName::new("Unmigrated")?;
        let register = lockstep_pg_store::PgPerspectiveStore::new()
            .register(&tx, std::slice::from_ref(&name))
            .await
            .expect_err("no schema");
        tx.rollback().await?;
        Ok::<_, lockstep_core::Error>((append, register))
    });
    let (append, register) = task.await.expect("task").expect("transactions");
    let shown = append.to_string();
    assert!(shown.contains("lockstep_pg::migrate"), "{shown}");
    assert!(shown.contains("SQLSTATE 42"), "{shown}");
    assert_eq!(
        lockstep_pg::migrate::SchemaMismatch::of(&register),
        Some(&lockstep_pg::migrate::SchemaMismatch::NotInstalled),
        "{register:?}"
    );
}
