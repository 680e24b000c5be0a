//! On a database that was never migrated, the event store and the
//! perspective store say what is wrong and what to do (run `lockstep_pg::migrate`), with the
//! database's own message and SQLSTATE, instead of a bare "backend error: appending to stream".

use lockstep_core::Transaction as _;
use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    EventStore, ExpectedVersion, NewEvent, PerspectiveName, ResourceKey, StreamId,
};
use lockstep_pg::PgTransaction;
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_testkit::pg_harness::test_database;

fn says_to_migrate(what: &str, err: &lockstep_core::Error) {
    let shown = err.to_string();
    assert!(shown.contains("lockstep_pg::migrate"), "{what}: {shown}");
    assert!(shown.contains("SQLSTATE 42"), "{what}: {shown}");
    // The message tells the driver's error, so it is not repeated as the `source()`; it is
    // still reachable for downcasting.
    assert!(
        std::error::Error::source(err).is_none(),
        "{what}: said once"
    );
    let driver = err.underlying().expect("the driver error is kept");
    assert!(
        driver.downcast_ref::<tokio_postgres::Error>().is_some(),
        "{what}: {driver:?}"
    );
}

#[tokio::test]
async fn the_stores_on_an_unmigrated_database_say_to_run_the_migrations() {
    let db = test_database().await;
    let pool = db.pool(2);
    let store = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let stream = StreamId::new_v7();
    let key = ResourceKey::new("unmigrated:store").expect("key");
    let event = NewEvent::new("Happened", serde_json::json!({})).expect("event");

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let err = EventStore::append(&store, &tx, stream, ExpectedVersion::Any, &[event])
        .await
        .expect_err("no schema");
    says_to_migrate("append", &err);
    assert!(err.to_string().contains(&stream.to_string()), "{err}");
    tx.rollback().await.expect("rollback");

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let err = EventStore::load(&store, &tx, stream)
        .await
        .expect_err("no schema");
    says_to_migrate("load", &err);
    tx.rollback().await.expect("rollback");

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let err = EventStore::load_locked(&store, &tx, stream, &key, None)
        .await
        .expect_err("no schema");
    says_to_migrate("load_locked", &err);
    tx.rollback().await.expect("rollback");

    let perspectives = PgPerspectiveStore::new();
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let name = PerspectiveName::new("Unmigrated").expect("name");
    let err = perspectives
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect_err("no schema");
    // A registration (a worker's start) checks the schema version first.
    assert_eq!(
        lockstep_pg::migrate::SchemaMismatch::of(&err),
        Some(&lockstep_pg::migrate::SchemaMismatch::NotInstalled),
        "{err:?}"
    );
    assert!(err.to_string().contains("lockstep_pg::migrate"), "{err}");
    tx.rollback().await.expect("rollback");

    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let pair = lockstep_core::Pair::new(stream, name);
    let err = perspectives
        .cursor(&tx, &pair)
        .await
        .expect_err("no schema");
    says_to_migrate("cursor", &err);
    tx.rollback().await.expect("rollback");
}
