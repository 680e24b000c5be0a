//! The `lockstep` command end to end: migrate (twice and concurrently), lease listing and force-release, advisory-lock listing, rewind requests,
//! purge, status, and the actionable errors. Postgres commands run against a database of the
//! test's own.

mod support;

use lockstep_core::perspective_store::prelude::*;
use std::os::unix::process::CommandExt as _;
use std::process::{Command, Output};
use support::{doc, lockstep, lockstep_on, migrated, serve_with, text, url_of};

use lockstep_core::EventStore as _;
use lockstep_core::Pair;
use lockstep_core::Transaction as _;
use lockstep_core::{
    AcquireOutcome, ExpectedVersion, Fleet as _, InstanceId, LockReason, NewEvent, PerspectiveName,
    StreamId, StreamLockOptions, StreamLocker,
};
use lockstep_pg::PgTransaction;
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_pg_stream::PgStreamLocker;
use lockstep_testkit::pg_harness::test_database;

#[test]
fn an_unreachable_database_is_an_actionable_error_without_the_password() {
    let out = lockstep(
        &["locks", "list"],
        Some("postgres://app:s3cret@127.0.0.1:1/nowhere"),
    );
    let report = text(&out);
    assert_eq!(out.status.code(), Some(3), "{report}");
    assert!(
        report.contains("cannot connect to database \"nowhere\" on 127.0.0.1:1 as user \"app\""),
        "{report}"
    );
    assert!(
        report.contains("check that PostgreSQL is running"),
        "{report}"
    );
    assert!(!report.contains("s3cret"), "{report}");
}

/// Issue 17: the server's own refusal is shown, once — not "Error occurred while creating a new
/// object: db error".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_does_not_exist_says_so_once() {
    let db = test_database().await;
    let url = url_of(&db);
    let missing = format!(
        "{}/lockstep_no_such_database",
        &url[..url.rfind('/').expect("a path")]
    );
    let out = lockstep(&["locks", "list"], Some(&missing));
    let report = text(&out);
    assert_eq!(out.status.code(), Some(3), "{report}");
    assert_eq!(
        report
            .matches(r#"database "lockstep_no_such_database" does not exist (SQLSTATE 3D000)"#)
            .count(),
        1,
        "{report}"
    );
    assert!(
        report.contains(r#"cannot connect to database "lockstep_no_such_database" on "#),
        "{report}"
    );
    assert!(!report.contains("db error"), "{report}");
}

/// Issue 17: a port nobody listens on says "connection refused", once.
#[test]
fn a_refused_connection_says_so_once() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("address")
        .port();
    let out = lockstep(
        &["locks", "list"],
        Some(&format!("postgres://app:s3cret@127.0.0.1:{port}/app")),
    );
    let report = text(&out);
    assert_eq!(out.status.code(), Some(3), "{report}");
    assert_eq!(
        report.to_lowercase().matches("connection refused").count(),
        1,
        "{report}"
    );
    assert!(report.contains(&format!("127.0.0.1:{port}")), "{report}");
    assert!(!report.contains("s3cret"), "{report}");
}

/// Issue 19, defect 3: no form a password can take in a URL shows in the output, whole or in
/// part, in "cannot connect" (nothing listens on port 1).
#[test]
fn no_form_of_a_password_is_ever_printed() {
    const PARTS: [&str; 2] = ["Zq7Kx", "Wv9Pm"];
    let connectable = [
        "postgres://app:Zq7KxWv9Pm@127.0.0.1:1/nowhere",
        "postgres://app@127.0.0.1:1/nowhere?password=Zq7KxWv9Pm",
        "postgresql://127.0.0.1:1/nowhere?user=app&password=Zq7KxWv9Pm",
        "host=127.0.0.1 port=1 user=app password = Zq7KxWv9Pm dbname=nowhere",
        "host=127.0.0.1 port=1 user=app password='Zq7Kx Wv9Pm' dbname=nowhere",
    ];
    let misread = [
        "postgres://app:Zq7Kx@Wv9Pm@127.0.0.1:1/nowhere",
        "postgres://127.0.0.1:1/nowhere?password=Zq7Kx@Wv9Pm",
    ];
    for url in connectable.iter().chain(&misread) {
        for args in [&["locks", "list"][..], &["perspectives", "status"]] {
            let out = lockstep(args, Some(url));
            let report = text(&out);
            assert_ne!(out.status.code(), Some(0), "{url}: {report}");
            for part in PARTS {
                assert!(
                    !report.contains(part),
                    "{args:?} with {url} printed: {report}"
                );
            }
        }
    }
    for url in connectable {
        let report = text(&lockstep(&["locks", "list"], Some(url)));
        assert!(
            report
                .contains("cannot connect to database \"nowhere\" on 127.0.0.1:1 as user \"app\""),
            "{report}"
        );
    }
    for url in misread {
        let out = lockstep(&["locks", "list"], Some(url));
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).contains("does not parse"), "{}", text(&out));
    }
}

#[test]
fn bad_arguments_exit_2_and_commands_that_need_a_database_say_so() {
    assert_eq!(lockstep(&["no-such-command"], None).status.code(), Some(2));
    assert_eq!(
        lockstep(&["locks", "list"], Some("not a url"))
            .status
            .code(),
        Some(2)
    );
    let out = lockstep(&["migrate"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("DATABASE_URL"));
}

/// Issue 19, defect 9: every bad argument exits 2 (as documented) with a message naming it, and
/// changes nothing — checked before the database is touched, so also with an unreachable one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_argument_exits_2_with_a_clear_message_and_changes_nothing() {
    let (_db, url, pool) = migrated().await;
    let snapshot = || async {
        let client = pool.get().await.expect("connection");
        let count = |table: &'static str| {
            let client = &client;
            async move {
                client
                    .query_one(&format!("SELECT count(*) FROM {table}"), &[])
                    .await
                    .expect("count")
                    .get::<_, i64>(0)
            }
        };
        (
            count("wh_perspectives").await,
            count("wh_perspective_cursors").await,
            count("wh_perspective_events").await,
            count("wh_aggregate_snapshots").await,
        )
    };
    let before = snapshot().await;
    let stream = StreamId::new_v7().to_string();
    let long = "N".repeat(201);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["locks", "release", &stream, " ", "--force"],
            "perspective name",
        ),
        (
            vec!["locks", "release", &stream, &long, "--force"],
            "perspective name",
        ),
        (
            vec!["locks", "list", "--perspective", ""],
            "perspective name",
        ),
        (
            vec!["perspectives", "rewind", &stream, ""],
            "perspective name",
        ),
        (
            vec!["perspectives", "purge", &stream, " "],
            "perspective name",
        ),
        (
            vec!["perspectives", "purge", &stream, &long],
            "perspective name",
        ),
        (
            vec!["snapshots", "drop", "Stock:Item", "--all"],
            "aggregate type",
        ),
        (vec!["snapshots", "drop", "StockItem"], "--below-schema"),
        (
            vec!["snapshots", "drop", "StockItem", "--below-schema", "0"],
            "--below-schema",
        ),
        (vec!["serve", "--addr", "nonsense"], "--addr"),
        (vec!["serve", "--addr", "127.0.0.1:99999"], "--addr"),
    ];
    for db_url in [url.as_str(), "postgres://app@127.0.0.1:1/nowhere"] {
        for (args, names) in &cases {
            let (args, db_url) = (args.clone(), db_url.to_owned());
            let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
            let out = tokio::task::spawn_blocking(move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                (lockstep(&args, Some(&db_url)), args.join(" "))
            })
            .await
            .expect("task");
            let (out, shown) = out;
            let report = text(&out);
            assert_eq!(out.status.code(), Some(2), "{shown}: {report}");
            assert!(report.contains(names), "{shown}: {report}");
        }
    }
    let out = lockstep(&["migrate"], None);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("DATABASE_URL"), "{}", text(&out));
    assert_eq!(snapshot().await, before, "nothing changed");
}

/// `snapshots drop` deletes one aggregate type's snapshots below a state schema version, then
/// all of them, and no other type's; `--json` says how many.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_drop_deletes_below_a_schema_version_or_all() {
    use lockstep_core::{
        AggregateSnapshot, AggregateType, ExpectedVersion, NewEvent, SnapshotKey, SnapshotStore,
    };
    let (_db, url, pool) = migrated().await;
    let db = lockstep_pg::PgDatabase::from_pool(pool.clone());
    let store = PgEventStore::new(&db);
    let stream = StreamId::new_v7();
    let (stock, other) = (
        AggregateType::new("StockItem").expect("type"),
        AggregateType::new("Order").expect("type"),
    );
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let event = NewEvent::new("Stocked", serde_json::json!({})).expect("event");
    store
        .append(&tx, stream, ExpectedVersion::NoStream, &[event])
        .await
        .expect("append");
    for (ty, schema) in [(&stock, 1), (&stock, 2), (&stock, 3), (&other, 1)] {
        let key = SnapshotKey::new(ty.clone(), stream, schema).expect("key");
        let snapshot = AggregateSnapshot {
            version: 1,
            state: serde_json::json!({ "units": 1 }),
        };
        store
            .save_snapshot(&tx, &key, &snapshot)
            .await
            .expect("save");
    }
    tx.commit().await.expect("commit");
    let count = || async {
        let client = pool.get().await.expect("connection");
        client
            .query_one("SELECT count(*) FROM wh_aggregate_snapshots", &[])
            .await
            .expect("count")
            .get::<_, i64>(0)
    };
    let out = lockstep_on(
        &url,
        &[
            "snapshots",
            "drop",
            "StockItem",
            "--below-schema",
            "3",
            "--json",
        ],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(report["deleted"], 2, "{report}");
    assert_eq!(report["aggregate_type"], "StockItem");
    assert_eq!(count().await, 2);
    let out = lockstep_on(&url, &["snapshots", "drop", "StockItem", "--all"]).await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("deleted 1 snapshots of StockItem"),
        "{}",
        text(&out)
    );
    assert_eq!(count().await, 1, "the other type's snapshot stays");
}

/// Issue 19, defect 9: a purge of a pair whose cursor row another transaction holds right now
/// is refused (exit 1, saying so) and purges nothing, like one whose lease another instance
/// holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_of_a_row_another_transaction_holds_is_refused() {
    let (_db, url, pool) = migrated().await;
    let name = PerspectiveName::new("Ledger").expect("valid");
    let stream = StreamId::new_v7();
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    PgPerspectiveStore::new()
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect("register");
    let event = NewEvent::new("Entered", serde_json::json!({ "amount": 1 })).expect("event");
    PgEventStore::with_queue(lockstep_pg::LockQueue::new())
        .append(&tx, stream, ExpectedVersion::NoStream, &[event])
        .await
        .expect("append");
    tx.commit().await.expect("commit");

    let mut other = pool.get().await.expect("connection");
    let held = other.transaction().await.expect("begin");
    held.execute(
        "SELECT 1 FROM wh_perspective_cursors WHERE stream_id = $1 FOR UPDATE",
        &[&stream.as_uuid()],
    )
    .await
    .expect("the row is held by another transaction (a worker applying its events)");
    let s = stream.to_string();
    let out = tokio::task::spawn_blocking(move || {
        lockstep(&["perspectives", "purge", &s, "Ledger"], Some(&url))
    })
    .await
    .expect("task");
    held.rollback().await.expect("rollback");
    let report = text(&out);
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(
        report.contains("refused") && report.contains("holds"),
        "{report}"
    );
    let client = pool.get().await.expect("connection");
    let pending: i64 = client
        .query_one(
            "SELECT count(*) FROM wh_perspective_events WHERE stream_id = $1",
            &[&stream.as_uuid()],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(pending, 1, "nothing was purged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_was_never_migrated_says_to_run_migrate() {
    let db = test_database().await;
    let url = url_of(&db);
    let out = tokio::task::spawn_blocking(move || lockstep(&["locks", "list"], Some(&url)))
        .await
        .expect("task");
    let report = text(&out);
    assert_ne!(out.status.code(), Some(0), "{report}");
    assert!(report.contains("lockstep migrate"), "{report}");
}

/// A database a newer, incompatible lockstep migrated is refused by every command but
/// `migrate --status`, which says so; `migrate` itself refuses to install an older schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_of_a_newer_incompatible_schema_is_refused_with_advice() {
    let (_db, url, pool) = migrated().await;
    let newer = lockstep_pg::migrate::SCHEMA_VERSION + 1;
    pool.get()
        .await
        .expect("connection")
        .batch_execute(&format!(
            "UPDATE lockstep_schema_version SET version = {newer}, last_breaking = {newer}"
        ))
        .await
        .expect("a newer schema");
    for args in [
        &["locks", "list"][..],
        &["migrate"][..],
        &["migrate", "--status"][..],
    ] {
        let out = lockstep_on(&url, args).await;
        let report = text(&out);
        assert_eq!(out.status.code(), Some(3), "{args:?}: {report}");
        assert!(report.contains("upgrade this binary"), "{args:?}: {report}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_safe_to_repeat_and_to_run_concurrently() {
    let db = test_database().await;
    let url = url_of(&db);
    let runs: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || lockstep(&["migrate", "--json"], Some(&url)))
        })
        .collect();
    let mut applied = 0;
    for run in runs {
        let out = run.join().expect("thread");
        assert!(out.status.success(), "{}", text(&out));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON output");
        applied += json["applied"].as_array().map_or(0, Vec::len);
    }
    let again = lockstep(&["migrate"], Some(&url));
    assert!(text(&again).contains("up to date"), "{}", text(&again));
    assert!(applied > 0, "one of the concurrent runs applied the schema");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_list_shows_a_held_lease_and_release_needs_force() {
    let (_db, url, pool) = migrated().await;
    let locker = PgStreamLocker::from_pool(pool.clone(), StreamLockOptions::default());
    let (stream, name) = (
        StreamId::new_v7(),
        PerspectiveName::new("Orders").expect("valid"),
    );
    let client = pool.get().await.expect("connection");
    client
        .execute(
            "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)",
            &[&stream.as_uuid(), &name.as_str()],
        )
        .await
        .expect("cursor");
    let holder = InstanceId::random();
    let lease = match locker
        .try_acquire(stream, &name, holder, &LockReason::Rewind)
        .await
        .expect("acquire")
    {
        AcquireOutcome::Acquired(lease) => lease,
        other => panic!("expected a lease, got {other:?}"),
    };
    let list = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || lockstep(&["locks", "list", "--json"], Some(&url)))
            .await
            .expect("task")
    };
    let rows: serde_json::Value = serde_json::from_slice(&list.stdout).expect("JSON");
    let row = &rows[0];
    assert_eq!(row["stream_id"], stream.to_string());
    assert_eq!(row["holder"], holder.to_string());
    assert_eq!(row["reason"], "rewind");
    assert_eq!(row["status"], "held");
    assert!(row["time_left_ms"].as_u64().unwrap_or(0) > 20_000);

    let (s, n) = (stream.to_string(), name.as_str().to_owned());
    let refused = {
        let (url, s, n) = (url.clone(), s.clone(), n.clone());
        tokio::task::spawn_blocking(move || lockstep(&["locks", "release", &s, &n], Some(&url)))
            .await
            .expect("task")
    };
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    assert!(text(&refused).contains("--force"));
    assert!(
        locker.renew(&lease.id).await.expect("renew").is_renewed(),
        "still held"
    );
    let forced = tokio::task::spawn_blocking(move || {
        lockstep(&["locks", "release", &s, &n, "--force"], Some(&url))
    })
    .await
    .expect("task");
    assert!(forced.status.success(), "{}", text(&forced));
    assert!(
        !locker.renew(&lease.id).await.expect("renew").is_renewed(),
        "fenced out"
    );
}

/// Issue 19, defect 7: a cursor row whose lease lockstep cannot read (an operator's
/// `'infinity'` expiry) is listed as unreadable, with its key, beside the other leases — by
/// `locks list` (text and JSON, exit 0) and on the status page — instead of failing them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_lease_row_is_listed_as_unreadable_beside_the_others() {
    let (_db, url, pool) = migrated().await;
    let locker = PgStreamLocker::from_pool(pool.clone(), StreamLockOptions::default());
    let name = PerspectiveName::new("Orders").expect("valid");
    let (good, bad) = (StreamId::new_v7(), StreamId::new_v7());
    let client = pool.get().await.expect("connection");
    for stream in [good, bad] {
        client
            .execute(
                "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)",
                &[&stream.as_uuid(), &name.as_str()],
            )
            .await
            .expect("cursor");
        assert!(
            locker
                .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
                .await
                .expect("acquire")
                .is_acquired()
        );
    }
    client
        .execute(
            "UPDATE wh_perspective_cursors SET stream_lock_expiry = 'infinity' WHERE stream_id = $1",
            &[&bad.as_uuid()],
        )
        .await
        .expect("an operator's update");

    let run = |args: &'static [&'static str]| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || lockstep(args, Some(&url)))
    };
    let listed = run(&["locks", "list", "--json"]).await.expect("task");
    assert_eq!(listed.status.code(), Some(0), "{}", text(&listed));
    let rows: serde_json::Value = serde_json::from_slice(&listed.stdout).expect("JSON");
    let rows = rows.as_array().expect("an array");
    assert_eq!(rows.len(), 2, "{rows:?}");
    let row = |stream: StreamId| {
        rows.iter()
            .find(|r| r["stream_id"] == stream.to_string())
            .unwrap_or_else(|| panic!("{stream} is listed: {rows:?}"))
    };
    assert_eq!(row(good)["status"], "held");
    assert_eq!(row(bad)["status"], "unreadable");
    assert_eq!(row(bad)["perspective"], "Orders");
    assert!(
        row(bad)["error"]
            .as_str()
            .is_some_and(|e| e.contains("stream_lock_expiry")),
        "{rows:?}"
    );

    let table = run(&["locks", "list"]).await.expect("task");
    let report = text(&table);
    assert_eq!(table.status.code(), Some(0), "{report}");
    assert!(report.contains(&good.to_string()), "{report}");
    let line = report
        .lines()
        .find(|l| l.contains(&bad.to_string()))
        .unwrap_or_else(|| panic!("the bad row is listed: {report}"));
    assert!(
        line.contains("Orders") && line.contains("unreadable"),
        "{report}"
    );

    let (mut server, addr) = serve(&url).await;
    let (page, metrics) =
        tokio::task::spawn_blocking(move || (http_get(&addr, "/"), http_get(&addr, "/metrics")))
            .await
            .expect("task");
    let _ = server.kill();
    let _ = server.wait();
    assert!(page.0.contains("200"), "{page:?}");
    assert!(page.1.contains(&good.to_string()), "{}", page.1);
    assert!(page.1.contains(&bad.to_string()), "{}", page.1);
    assert!(page.1.contains("unreadable"), "{}", page.1);
    assert!(metrics.0.contains("200"), "{metrics:?}");
    assert!(
        metrics.1.contains("lockstep_stream_leases_unreadable 1"),
        "{}",
        metrics.1
    );
    assert!(
        metrics.1.contains("lockstep_stream_leases_expired 0"),
        "{}",
        metrics.1
    );
}

/// Starts `lockstep serve` on a free port of 127.0.0.1: the process and its address.
async fn serve(url: &str) -> (std::process::Child, String) {
    serve_with(url, &[], &[]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_advisory_names_a_key_a_test_holds() {
    let (_db, url, pool) = migrated().await;
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let key_text = "relay:aggregate:StockItem:0123456789abcdef0123456789abcdef";
    tx.client()
        .execute(
            "SELECT pg_advisory_xact_lock($1)",
            &[&lockstep_core::advisory_key(key_text)],
        )
        .await
        .expect("lock");
    let out = tokio::task::spawn_blocking(move || {
        lockstep(
            &["locks", "advisory", "--json", "--name", key_text],
            Some(&url),
        )
    })
    .await
    .expect("task");
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let held = rows
        .as_array()
        .expect("array")
        .iter()
        .find(|r| r["name"] == key_text)
        .expect("the held key is listed with its name");
    assert_eq!(held["granted"], true);
    tx.rollback().await.expect("rollback");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perspectives_rewind_purge_and_status() {
    let (_db, url, pool) = migrated().await;
    let name = PerspectiveName::new("Ledger").expect("valid");
    let store = PgPerspectiveStore::new();
    let stream = StreamId::new_v7();
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect("register");
    let event = NewEvent::new("Entered", serde_json::json!({ "amount": 1 })).expect("event");
    PgEventStore::with_queue(lockstep_pg::LockQueue::new())
        .append(&tx, stream, ExpectedVersion::NoStream, &[event])
        .await
        .expect("append");
    tx.commit().await.expect("commit");

    let status = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            lockstep(&["perspectives", "status", "--json"], Some(&url))
        })
        .await
        .expect("task")
    };
    let rows: serde_json::Value = serde_json::from_slice(&status.stdout).expect("JSON");
    assert_eq!(rows[0]["perspective"], "Ledger");
    assert_eq!(rows[0]["pending_events"], 1);

    let s = stream.to_string();
    let rewind = {
        let (url, s) = (url.clone(), s.clone());
        tokio::task::spawn_blocking(move || {
            lockstep(&["perspectives", "rewind", &s, "Ledger"], Some(&url))
        })
        .await
        .expect("task")
    };
    assert!(rewind.status.success(), "{}", text(&rewind));
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let cursor = store
        .cursor(&tx, &Pair::new(stream, name.clone()))
        .await
        .expect("cursor")
        .expect("exists");
    tx.rollback().await.expect("rollback");
    assert_eq!(
        cursor.rewind.map(|r| r.trigger),
        Some(uuid::Uuid::nil()),
        "from the start"
    );

    let purge = {
        let (url, s) = (url.clone(), s.clone());
        tokio::task::spawn_blocking(move || {
            lockstep(&["perspectives", "purge", &s, "Ledger"], Some(&url))
        })
        .await
        .expect("task")
    };
    assert!(purge.status.success(), "{}", text(&purge));
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let pending = store
        .pending_events(&tx, &Pair::new(stream, name.clone()))
        .await
        .expect("pending");
    tx.rollback().await.expect("rollback");
    assert!(pending.is_empty(), "purge dropped the pending work");

    // Purge is refused while another instance holds the pair's lease.
    let locker = PgStreamLocker::from_pool(pool.clone(), StreamLockOptions::default());
    let _held = locker
        .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("acquire");
    let refused = tokio::task::spawn_blocking(move || {
        lockstep(&["perspectives", "purge", &s, "Ledger"], Some(&url))
    })
    .await
    .expect("task");
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    assert!(text(&refused).contains("holds the lease"));
}

/// Issue 18: a parked pair shows in `status` and `parked` (with its failing event), `skip`
/// records the skip and retries the pair, `retry` clears the parking, and an event that is not
/// pending is refused with exit 1, changing nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perspectives_parked_retry_and_skip() {
    use lockstep_core::PairFailure;
    let (_db, url, pool) = migrated().await;
    let name = PerspectiveName::new("Ledger").expect("valid");
    let store = PgPerspectiveStore::new();
    let (stream, other) = (StreamId::new_v7(), StreamId::new_v7());
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect("register");
    let event = NewEvent::new("Entered", serde_json::json!({ "amount": 1 })).expect("event");
    let poison = event.event_id();
    let events = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    events
        .append(&tx, stream, ExpectedVersion::NoStream, &[event])
        .await
        .expect("append");
    let event = NewEvent::new("Entered", serde_json::json!({ "amount": 2 })).expect("event");
    events
        .append(&tx, other, ExpectedVersion::NoStream, &[event])
        .await
        .expect("append");
    for pair in [stream, other] {
        let failure = PairFailure::new("boom at the poison event")
            .at_event(Some(poison))
            .retry_after(std::time::Duration::from_secs(3600))
            .park(true);
        assert!(
            store
                .record_failure(&tx, &Pair::new(pair, name.clone()), &failure)
                .await
                .expect("record")
        );
    }
    tx.commit().await.expect("commit");

    let status = lockstep_on(&url, &["perspectives", "status", "--json"]).await;
    let rows: serde_json::Value = serde_json::from_slice(&status.stdout).expect("JSON");
    assert_eq!(rows[0]["parked"], 2, "{rows}");
    let parked = lockstep_on(&url, &["perspectives", "parked", "--json"]).await;
    assert!(parked.status.success(), "{}", text(&parked));
    let rows: serde_json::Value = serde_json::from_slice(&parked.stdout).expect("JSON");
    assert_eq!(rows.as_array().map(Vec::len), Some(2), "{rows}");
    let row = rows
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["stream_id"] == stream.to_string())
        .expect("listed");
    assert_eq!(row["failed_event_id"], poison.to_string());
    assert_eq!(row["error"], "boom at the poison event");
    let human = lockstep_on(&url, &["perspectives", "parked"]).await;
    assert!(
        text(&human).contains("parked after 1 failures"),
        "{}",
        text(&human)
    );

    // Not pending work of the pair: refused, nothing changed.
    let (s, o) = (stream.to_string(), other.to_string());
    let stray = uuid::Uuid::now_v7().to_string();
    let refused = lockstep_on(
        &url,
        &["perspectives", "skip", &s, "Ledger", "--event", &stray],
    )
    .await;
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    // The failing event by default, with the reason recorded.
    let skipped = lockstep_on(
        &url,
        &[
            "perspectives",
            "skip",
            &s,
            "Ledger",
            "--reason",
            "garbled import",
        ],
    )
    .await;
    assert!(skipped.status.success(), "{}", text(&skipped));
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let recorded = store
        .skipped_events(&tx, &Pair::new(stream, name.clone()))
        .await
        .expect("skipped");
    assert_eq!(recorded.len(), 1);
    assert_eq!(
        (recorded[0].event_id, recorded[0].reason.as_str()),
        (poison, "garbled import")
    );
    assert!(
        store
            .pending_events(&tx, &Pair::new(stream, name.clone()))
            .await
            .expect("pending")
            .is_empty()
    );
    let cursor = store
        .cursor(&tx, &Pair::new(stream, name.clone()))
        .await
        .expect("cursor")
        .expect("exists");
    assert!(
        cursor.parked_at.is_none() && cursor.retry_at.is_none(),
        "{cursor:?}"
    );
    tx.rollback().await.expect("rollback");

    let retried = lockstep_on(&url, &["perspectives", "retry", &o, "Ledger"]).await;
    assert!(retried.status.success(), "{}", text(&retried));
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let cursor = store
        .cursor(&tx, &Pair::new(other, name.clone()))
        .await
        .expect("cursor")
        .expect("exists");
    assert!(
        cursor.parked_at.is_none() && cursor.failures == 0,
        "{cursor:?}"
    );
    assert_eq!(
        store
            .pending_events(&tx, &Pair::new(other, name.clone()))
            .await
            .expect("pending")
            .len(),
        1,
        "retry keeps the work"
    );
    tx.rollback().await.expect("rollback");
    let none = lockstep_on(&url, &["perspectives", "parked"]).await;
    assert!(text(&none).contains("no parked pairs"), "{}", text(&none));
    let bad = lockstep_on(&url, &["perspectives", "retry", &o, " "]).await;
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad));
}

/// Finds Chromium (installed by `scripts/test`, the README's test command, when missing).
fn chromium() -> std::path::PathBuf {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
        .expect("the status page is tested in a real browser: install Debian's `chromium` package (scripts/test, the README's test command, does)")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_a_lease_a_test_holds_in_a_real_browser() {
    let (_db, url, pool) = migrated().await;
    let locker = PgStreamLocker::from_pool(pool.clone(), StreamLockOptions::default());
    let (stream, name) = (
        StreamId::new_v7(),
        PerspectiveName::new("Orders").expect("valid"),
    );
    let client = pool.get().await.expect("connection");
    client
        .execute(
            "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)",
            &[&stream.as_uuid(), &name.as_str()],
        )
        .await
        .expect("cursor");
    let holder = InstanceId::random();
    assert!(
        locker
            .try_acquire(stream, &name, holder, &LockReason::Purge)
            .await
            .expect("acquire")
            .is_acquired()
    );

    // An advisory key held by one connection with two waiting, each with its application name.
    let key = "relay:aggregate:StockItem:page-test";
    let holder_conn = db_connection(&url, "billing-api").await;
    holder_conn
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock(lockstep_advisory_key('{key}'))"
        ))
        .await
        .expect("hold");
    let mut waiters = Vec::new();
    for app in ["billing-worker-1", "billing-worker-2"] {
        let conn = db_connection(&url, app).await;
        let sql = format!("SELECT pg_advisory_xact_lock(lockstep_advisory_key('{key}'))");
        waiters.push(tokio::spawn(async move {
            let _ = conn.batch_execute(&format!("BEGIN; {sql}")).await;
            conn
        }));
    }
    // A parked pair.
    let parked = StreamId::new_v7();
    let store = PgPerspectiveStore::new();
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect("register");
    let event = NewEvent::new("Entered", serde_json::json!({ "amount": 1 })).expect("event");
    PgEventStore::with_queue(lockstep_pg::LockQueue::new())
        .append(&tx, parked, ExpectedVersion::NoStream, &[event])
        .await
        .expect("append");
    store
        .record_failure(
            &tx,
            &Pair::new(parked, name.clone()),
            &lockstep_core::PairFailure::new("the <b>poison</b> event").park(true),
        )
        .await
        .expect("park");
    tx.commit().await.expect("commit");
    wait_for_waiters(&pool, 2).await;

    let (mut server, addr) = serve_with(
        &url,
        &[("LOCKSTEP_SERVE_TOKEN", "a-token-of-the-operator")],
        &["--name", key],
    )
    .await;
    let page_url = format!("http://{addr}/");
    let dom = tokio::task::spawn_blocking(move || {
        // A loaded machine can make a first headless start fail: retry, and keep what it said.
        let mut seen = String::new();
        for _ in 0..3 {
            let profile =
                std::env::temp_dir().join(format!("lockstep-chromium-{}", uuid::Uuid::new_v4()));
            let out = Command::new(chromium())
                .args([
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                ])
                .arg(format!("--user-data-dir={}", profile.display()))
                // Lets the page's script run its first in-place refresh before the dump.
                .args(["--virtual-time-budget=4000", "--dump-dom", &page_url])
                .output()
                .expect("running chromium");
            let _ = std::fs::remove_dir_all(profile);
            let dom = String::from_utf8_lossy(&out.stdout).into_owned();
            if dom.contains("Stream leases") {
                return dom;
            }
            seen = format!(
                "{seen}\n--- attempt: {:?}\n{dom}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        seen
    })
    .await
    .expect("task");
    let _ = server.kill();
    let _ = server.wait();
    assert!(dom.contains("Stream leases"), "{dom}");
    assert!(
        dom.contains(&stream.to_string()),
        "the held lease is on the page: {dom}"
    );
    assert!(dom.contains(&holder.to_string()), "{dom}");
    assert!(dom.contains("purge"), "{dom}");
    // The summary line, the advisory key grouped (one holder, two waiting, who they are).
    assert!(dom.contains("1 leases held"), "{dom}");
    assert!(dom.contains("2 waiting"), "{dom}");
    for app in ["billing-api", "billing-worker-1", "billing-worker-2"] {
        assert!(dom.contains(app), "{app} on the page: {dom}");
    }
    assert!(dom.contains(key), "{dom}");
    // The parked pair, its error escaped, and the actions the token enables.
    assert!(dom.contains(&parked.to_string()), "{dom}");
    assert!(dom.contains("the &lt;b&gt;poison&lt;/b&gt; event"), "{dom}");
    assert!(dom.contains("1 parked"), "{dom}");
    assert!(dom.contains("data-action=\"retry\""), "{dom}");
    assert!(dom.contains("data-action=\"release\""), "{dom}");
    assert!(
        dom.contains("data-action=\"rebuild\" data-perspective=\"Orders\""),
        "{dom}"
    );
    // The purge lease's start, as the try-acquire recorded it, and how long it is held.
    assert!(!dom.contains("not recorded"), "{dom}");
    assert!(dom.contains(" s</small>") && dom.contains("held "), "{dom}");
    // The script refreshed the page in place (the server-rendered marker was replaced).
    assert!(dom.contains("updated "), "the in-place refresh ran: {dom}");
    drop(holder_conn);
    for waiter in waiters {
        waiter.abort();
    }
}

/// A connection of its own, named `application_name`.
async fn db_connection(url: &str, application_name: &str) -> tokio_postgres::Client {
    let mut config: tokio_postgres::Config = url.parse().expect("url");
    config.application_name(application_name);
    let (client, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// Waits until `n` advisory lock requests wait.
async fn wait_for_waiters(pool: &deadpool_postgres::Pool, n: i64) {
    let client = pool.get().await.expect("connection");
    for _ in 0..200 {
        let waiting: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
                &[],
            )
            .await
            .expect("count")
            .get(0);
        if waiting >= n {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("{n} advisory waiters never showed up");
}

/// One HTTP/1.1 request on `addr` (the connection closed after it): (status code, body).
fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .expect("timeout");
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, body.to_owned())
}

/// `http` off the runtime's threads.
async fn http_on(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let (addr, method, path, body) = (
        addr.to_owned(),
        method.to_owned(),
        path.to_owned(),
        body.to_owned(),
    );
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect();
    tokio::task::spawn_blocking(move || {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        http(&addr, &method, &path, &headers, &body)
    })
    .await
    .expect("task")
}

/// Issue 21: the page's actions need the configured token, refuse cross-origin requests, take
/// two steps (a prompt with a nonce, then the confirmation of that very action), do what they
/// say, and leave an audit line; with no token configured there are none. Other methods get
/// 405.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_actions_need_the_token_a_confirmation_and_the_same_origin() {
    let (_db, url, pool) = migrated().await;
    let locker = PgStreamLocker::from_pool(pool.clone(), StreamLockOptions::default());
    let (stream, name) = (
        StreamId::new_v7(),
        PerspectiveName::new("Orders").expect("valid"),
    );
    let client = pool.get().await.expect("connection");
    client
        .execute(
            "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)",
            &[&stream.as_uuid(), &name.as_str()],
        )
        .await
        .expect("cursor");
    drop(client);
    assert!(
        locker
            .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
            .await
            .expect("acquire")
            .is_acquired()
    );
    let release =
        format!("{{\"action\":\"release\",\"stream_id\":\"{stream}\",\"perspective\":\"Orders\"}}");
    let json = [("Content-Type", "application/json")];

    // No token configured: no actions.
    let (mut plain, addr) = serve(&url).await;
    let (code, body) = http_on(&addr, "POST", "/actions", &json, &release).await;
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("disabled"), "{body}");
    let (code, _) = http_on(&addr, "POST", "/", &[], "").await;
    assert_eq!(code, 405);
    let (code, _) = http_on(&addr, "GET", "/actions", &[], "").await;
    assert_eq!(code, 405);
    let (code, _) = http_on(&addr, "GET", "/nowhere", &[], "").await;
    assert_eq!(code, 404);
    let _ = plain.kill();
    let _ = plain.wait();

    let token = "a-token-of-the-operator";
    let (mut server, addr) = serve_with(&url, &[("LOCKSTEP_SERVE_TOKEN", token)], &[]).await;
    let with_token = [
        ("Content-Type", "application/json"),
        ("X-Lockstep-Token", token),
    ];
    let (code, body) = http_on(&addr, "POST", "/actions", &json, &release).await;
    assert_eq!(code, 401, "no token: {body}");
    let wrong = [
        ("Content-Type", "application/json"),
        ("X-Lockstep-Token", "a-token-of-the-operatoR"),
    ];
    let (code, _) = http_on(&addr, "POST", "/actions", &wrong, &release).await;
    assert_eq!(code, 401, "a wrong token");
    let cross = [
        ("Content-Type", "application/json"),
        ("X-Lockstep-Token", token),
        ("Origin", "http://evil.example"),
    ];
    let (code, _) = http_on(&addr, "POST", "/actions", &cross, &release).await;
    assert_eq!(code, 403, "cross-origin");
    let bad = r#"{"action":"release","stream_id":"nope","perspective":"Orders"}"#;
    let (code, body) = http_on(&addr, "POST", "/actions", &with_token, bad).await;
    assert_eq!(code, 422, "{body}");

    // Step one: a prompt and a nonce; nothing happened yet.
    let (code, body) = http_on(&addr, "POST", "/actions", &with_token, &release).await;
    assert_eq!(code, 200, "{body}");
    let asked: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert!(
        asked["prompt"]
            .as_str()
            .is_some_and(|p| p.contains("Force-release")),
        "{asked}"
    );
    let nonce = asked["confirm"].as_str().expect("nonce").to_owned();
    let held = || async {
        lockstep_core::StreamLockAdmin::list_leases(&locker)
            .await
            .expect("list")
            .iter()
            .any(|l| l.stream_id == stream && l.status == lockstep_core::LeaseStatus::Held)
    };
    assert!(held().await, "not released before the confirmation");
    // A confirmation for another action, or an unknown one, does nothing.
    let rewind_confirm = format!(
        "{{\"action\":\"rewind\",\"stream_id\":\"{stream}\",\"perspective\":\"Orders\",\"confirm\":\"{nonce}\"}}"
    );
    let (code, _) = http_on(&addr, "POST", "/actions", &with_token, &rewind_confirm).await;
    assert_eq!(code, 409);
    let (code, body) = http_on(&addr, "POST", "/actions", &with_token, &release).await;
    assert_eq!(code, 200, "{body}");
    let nonce: String = serde_json::from_str::<serde_json::Value>(&body).expect("JSON")["confirm"]
        .as_str()
        .expect("nonce")
        .to_owned();
    let confirmed = format!(
        "{{\"action\":\"release\",\"stream_id\":\"{stream}\",\"perspective\":\"Orders\",\"confirm\":\"{nonce}\"}}"
    );
    let (code, body) = http_on(&addr, "POST", "/actions", &with_token, &confirmed).await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("released the lease"), "{body}");
    assert!(!held().await, "released");
    // A nonce is used once.
    let (code, _) = http_on(&addr, "POST", "/actions", &with_token, &confirmed).await;
    assert_eq!(code, 409);

    let _ = server.kill();
    let _ = server.wait();
    let mut log = String::new();
    if let Some(mut stderr) = server.stderr.take() {
        use std::io::Read;
        let _ = stderr.read_to_string(&mut log);
    }
    assert!(
        log.contains(&format!("release {stream}/\"Orders\": done")),
        "{log}"
    );
    assert!(log.contains("(bad or missing token): refused"), "{log}");
    assert!(!log.contains(token), "the token is never logged: {log}");
}

/// Issue 21: `serve` starts while the database is unreachable and on a database without the
/// schema; `/healthz` says which (503), the page says so, and both recover by themselves once
/// the database is migrated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_starts_without_a_database_and_recovers_once_it_is_migrated() {
    let (mut down, addr) = serve_with("postgres://app@127.0.0.1:1/nowhere", &[], &[]).await;
    let (code, body) = http_on(&addr, "GET", "/healthz", &[], "").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("\"database\":\"unreachable\""), "{body}");
    let (code, body) = http_on(&addr, "GET", "/", &[], "").await;
    assert_eq!(code, 200, "the page answers, saying what is wrong: {body}");
    assert!(body.contains("unavailable"), "{body}");
    let _ = down.kill();
    let _ = down.wait();

    let db = test_database().await;
    let url = url_of(&db);
    let (mut server, addr) = serve_with(&url, &[], &[]).await;
    let (code, body) = http_on(&addr, "GET", "/healthz", &[], "").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("\"schema\":\"missing\""), "{body}");
    let (code, body) = http_on(&addr, "GET", "/fragment", &[], "").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("lockstep migrate"), "{body}");
    let out = lockstep_on(&url, &["migrate"]).await;
    assert!(out.status.success(), "{}", text(&out));
    let (code, body) = http_on(&addr, "GET", "/healthz", &[], "").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"schema\":\"up_to_date\""), "{body}");
    let (code, body) = http_on(&addr, "GET", "/fragment", &[], "").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("Stream leases"), "{body}");
    let (code, body) = http_on(&addr, "GET", "/api/status", &[], "").await;
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(status["summary"]["leases_held"], 0);
    let (code, metrics) = http_on(&addr, "GET", "/metrics", &[], "").await;
    assert_eq!(code, 200);
    assert!(
        metrics.contains("# HELP lockstep_stream_leases_held"),
        "{metrics}"
    );
    // Through a Prometheus parser: `# HELP` on every family and no summary; the page's own
    // calls are counted by the observe layer, which is wired here at the composition root.
    let scrape = prometheus_parse::Scrape::parse(metrics.lines().map(|l| Ok(l.to_owned())))
        .expect("a valid exposition");
    for sample in &scrape.samples {
        let family = ["_sum", "_count", "_bucket"]
            .iter()
            .find_map(|suffix| sample.metric.strip_suffix(suffix))
            .filter(|family| scrape.docs.contains_key(*family))
            .unwrap_or(&sample.metric);
        assert!(
            scrape.docs.contains_key(family),
            "{family} has no # HELP:\n{metrics}"
        );
        assert!(
            !matches!(sample.value, prometheus_parse::Value::Summary(_)),
            "{family} is a summary:\n{metrics}"
        );
    }
    assert!(
        scrape
            .samples
            .iter()
            .any(|s| s.metric == "lockstep_calls_total"),
        "{metrics}"
    );
    let _ = server.kill();
    let _ = server.wait();
}

/// `RUST_LOG` chooses what the binary logs, on standard error; by default only warnings.
#[tokio::test]
async fn the_binary_honours_rust_log() {
    let (_db, url, _pool) = migrated().await;
    let run = |rust_log: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lockstep"));
        cmd.args(["migrate", "--status"])
            .env("DATABASE_URL", &url)
            .env_remove("RUST_LOG");
        if let Some(filter) = rust_log {
            cmd.env("RUST_LOG", filter);
        }
        cmd.output().expect("running lockstep")
    };
    let quiet = run(None);
    assert!(quiet.status.success(), "{}", text(&quiet));
    let stderr = String::from_utf8_lossy(&quiet.stderr);
    assert!(
        !stderr.contains("DEBUG") && !stderr.contains("INFO"),
        "{stderr}"
    );
    let verbose = run(Some("debug"));
    assert!(verbose.status.success(), "{}", text(&verbose));
    let stderr = String::from_utf8_lossy(&verbose.stderr);
    assert!(stderr.contains("DEBUG"), "RUST_LOG=debug logs: {stderr}");
    assert_eq!(
        quiet.stdout, verbose.stdout,
        "logs never mix into the report on standard output"
    );
}

/// `GET path` on `addr` with a plain TCP client: (status line, body).
fn http_get(addr: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (
        head.lines().next().unwrap_or("").to_owned(),
        body.to_owned(),
    )
}

/// `GET path` on `addr`, giving up after `limit` (connect, write and read each).
fn try_http_get(
    addr: &str,
    path: &str,
    limit: std::time::Duration,
) -> std::io::Result<(String, String)> {
    use std::io::{Read, Write};
    let socket: std::net::SocketAddr = addr.parse().map_err(std::io::Error::other)?;
    let mut stream = std::net::TcpStream::connect_timeout(&socket, limit)?;
    stream.set_read_timeout(Some(limit))?;
    stream.set_write_timeout(Some(limit))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    Ok((
        head.lines().next().unwrap_or("").to_owned(),
        body.to_owned(),
    ))
}

/// CPU time (user + system) `pid` has used so far.
fn cpu_time(pid: u32) -> std::time::Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/<pid>/stat");
    // Fields after the command name (which is in parentheses and may hold spaces): utime and
    // stime are the 12th and 13th.
    let after = stat.rsplit_once(')').expect("stat format").1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    let per_second: u64 = String::from_utf8_lossy(
        &Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .expect("getconf")
            .stdout,
    )
    .trim()
    .parse()
    .expect("CLK_TCK");
    std::time::Duration::from_millis(ticks * 1000 / per_second)
}

/// Issue 19, defect 8: `serve`, run with 64 file descriptors, goes on
/// serving after connections exhausted them (accept fails with EMFILE), and does not spin on the
/// failing accept meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_survive_descriptor_exhaustion_without_spinning() {
    use std::io::{BufRead, BufReader};
    use std::time::{Duration, Instant};

    let (_db, url, _pool) = migrated().await;
    {
        let args = ["serve", "--addr", "127.0.0.1:0"];
        let mut server = Command::new("sh")
            .arg("-c")
            .arg("ulimit -n 64 && exec \"$0\" \"$@\"")
            .arg(env!("CARGO_BIN_EXE_lockstep"))
            .args(args)
            .env("DATABASE_URL", &url)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starting lockstep");
        let pid = server.id();
        let mut stdout = BufReader::new(server.stdout.take().expect("stdout"));
        // Kept open (and so read to the end after the kill): the process writes more lines.
        let (line, stdout) = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            stdout.read_line(&mut line)?;
            Ok::<_, std::io::Error>((line, stdout))
        })
        .await
        .expect("task")
        .expect("the banner");
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .unwrap_or_else(|| panic!("the banner names the address: {line}"))
            .to_owned();

        let outcome = tokio::task::spawn_blocking(move || {
            // More connections than the server has descriptors: it accepts until EMFILE, the
            // rest wait in the backlog (the server holds each idle one open).
            let socket: std::net::SocketAddr = addr.parse().expect("address");
            let held: Vec<_> = (0..150)
                .filter_map(|_| std::net::TcpStream::connect(socket).ok())
                .collect();
            std::thread::sleep(Duration::from_millis(300));
            let (cpu, wall) = (cpu_time(pid), Instant::now());
            std::thread::sleep(Duration::from_secs(2));
            let busy = (cpu_time(pid) - cpu).as_secs_f64() / wall.elapsed().as_secs_f64();
            drop(held);
            let deadline = Instant::now() + Duration::from_secs(15);
            let answer = loop {
                match try_http_get(&addr, "/healthz", Duration::from_secs(2)) {
                    Ok(answer) if answer.0.contains("200") => break Ok(answer),
                    other if Instant::now() > deadline => break Err(format!("{other:?}")),
                    _ => std::thread::sleep(Duration::from_millis(100)),
                }
            };
            (busy, answer)
        })
        .await
        .expect("task");
        let _ = server.kill();
        let _ = server.wait();
        drop(stdout);
        let mut log = String::new();
        if let Some(mut stderr) = server.stderr.take() {
            use std::io::Read;
            let _ = stderr.read_to_string(&mut log);
        }
        let (busy, answer) = outcome;
        assert!(
            answer.is_ok(),
            "{args:?} answers once descriptors are free again: {answer:?}\n{log}"
        );
        assert!(
            busy < 0.5,
            "{args:?} used {:.0} % of a CPU while accept failed\n{log}",
            busy * 100.0
        );
    }
}

/// The JSON document a command printed on standard output.
/// Issue 21: every command answers `--json` with one document, also when it refuses (exit 1),
/// when an argument is bad (exit 2) and when the database is unreachable (exit 3); refusals
/// name what was wrong and change nothing: a perspective that is not registered, `--from`
/// naming another stream's event or no event at all, a purge of a leased pair (which says how
/// long the lease has left, not when it ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_answers_json_and_refusals_name_what_was_wrong() {
    let (_db, url, pool) = migrated().await;
    let name = PerspectiveName::new("Ledger").expect("valid");
    let store = PgPerspectiveStore::new();
    let (stream, other) = (StreamId::new_v7(), StreamId::new_v7());
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect("register");
    let events = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let (mine, theirs) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    for (on, id) in [(stream, mine), (other, theirs)] {
        let event = NewEvent::new("Entered", serde_json::json!({ "amount": 1 }))
            .and_then(|e| e.with_id(id))
            .expect("event");
        events
            .append(&tx, on, ExpectedVersion::NoStream, &[event])
            .await
            .expect("append");
    }
    tx.commit().await.expect("commit");
    let (mine, theirs) = (mine.to_string(), theirs.to_string());
    let s = stream.to_string();
    let trigger = || async {
        let tx = PgTransaction::begin(&pool).await.expect("begin");
        let cursor = store
            .cursor(&tx, &Pair::new(stream, name.clone()))
            .await
            .expect("cursor")
            .expect("exists");
        tx.rollback().await.expect("rollback");
        cursor.rewind.map(|r| r.trigger)
    };

    // Refused, exit 1, nothing requested.
    let nobody = uuid::Uuid::now_v7().to_string();
    for (from, why) in [
        (theirs.as_str(), format!("is an event of stream {other}")),
        (nobody.as_str(), "there is no event".to_owned()),
    ] {
        let out = lockstep_on(
            &url,
            &["perspectives", "rewind", &s, "Ledger", "--from", from],
        )
        .await;
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(text(&out).contains(&why), "{}", text(&out));
        let json = lockstep_on(
            &url,
            &[
                "perspectives",
                "rewind",
                &s,
                "Ledger",
                "--from",
                from,
                "--json",
            ],
        )
        .await;
        assert_eq!(json.status.code(), Some(1));
        assert_eq!(doc(&json)["outcome"], "refused");
        assert_eq!(trigger().await, None, "nothing was requested");
    }
    for args in [
        &["perspectives", "rewind", &s, "Unregistered"][..],
        &["perspectives", "purge", &s, "Unregistered"],
        &["perspectives", "retry", &s, "Unregistered"],
        &["perspectives", "skip", &s, "Unregistered", "--event", &mine],
    ] {
        let out = lockstep_on(&url, args).await;
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
        assert!(
            text(&out).contains("`Unregistered` is not registered"),
            "{args:?}: {}",
            text(&out)
        );
        let mut with_json = args.to_vec();
        with_json.push("--json");
        let out = lockstep_on(&url, &with_json).await;
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(doc(&out)["outcome"], "not_registered", "{args:?}");
    }

    // Done, exit 0, as JSON.
    let out = lockstep_on(
        &url,
        &[
            "perspectives",
            "rewind",
            &s,
            "Ledger",
            "--from",
            &mine,
            "--json",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let answer = doc(&out);
    assert_eq!(
        (
            answer["outcome"].as_str(),
            answer["from"].as_str(),
            answer["stream_id"].as_str()
        ),
        (Some("requested"), Some(mine.as_str()), Some(s.as_str()))
    );
    assert!(trigger().await.is_some());
    let out = lockstep_on(&url, &["perspectives", "retry", &s, "Ledger", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(doc(&out)["outcome"], "retried");
    let out = lockstep_on(
        &url,
        &[
            "perspectives",
            "skip",
            &s,
            "Ledger",
            "--event",
            &mine,
            "--json",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(doc(&out)["outcome"], "skipped");

    // locks release: refused without --force, then no lease to release.
    let out = lockstep_on(&url, &["locks", "release", &s, "Ledger", "--json"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(doc(&out)["outcome"], "refused");
    let out = lockstep_on(
        &url,
        &["locks", "release", &s, "Ledger", "--force", "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(doc(&out)["outcome"], "no_lease");

    // A purge of a leased pair says how long the lease has left.
    let locker = PgStreamLocker::from_pool(pool.clone(), StreamLockOptions::default());
    let _held = locker
        .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("acquire");
    let out = lockstep_on(&url, &["perspectives", "purge", &s, "Ledger"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let said = text(&out);
    let left: f64 = said
        .split(" for ")
        .nth(1)
        .and_then(|rest| rest.split(" s more").next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("a duration in seconds: {said}"));
    assert!((0.0..=30.0).contains(&left), "{said}");
    let out = lockstep_on(&url, &["perspectives", "purge", &s, "Ledger", "--json"]).await;
    assert_eq!(out.status.code(), Some(1));
    let answer = doc(&out);
    assert_eq!(answer["outcome"], "held");
    assert_eq!(answer["holder"]["reason"], "rewind");

    // Listing commands: one array each.
    for args in [
        &["locks", "list", "--json"][..],
        &["locks", "advisory", "--json"],
        &["perspectives", "status", "--json"],
        &["perspectives", "parked", "--json"],
    ] {
        let out = lockstep_on(&url, args).await;
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", text(&out));
        assert!(doc(&out).is_array(), "{args:?}");
    }

    // A bad argument and an unreachable database, as JSON.
    let out = lockstep_on(
        &url,
        &["perspectives", "rewind", "not-a-uuid", "Ledger", "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(doc(&out)["exit_code"], 2);
    let out = lockstep_on(
        "postgres://app@127.0.0.1:1/nowhere",
        &["perspectives", "status", "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let answer = doc(&out);
    assert_eq!(answer["exit_code"], 3);
    assert!(
        answer["error"]
            .as_str()
            .is_some_and(|e| e.contains("cannot connect")),
        "{answer}"
    );
}

/// `migrate --status` changes nothing and says which migrations and function files are pending
/// (exit 3, "not migrated") or that the schema is up to date at this build's version (exit 0),
/// as text and as JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_status_lists_pending_then_applied_migrations() {
    let db = test_database().await;
    let url = url_of(&db);
    let out = lockstep_on(&url, &["migrate", "--status", "--json"]).await;
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let answer = doc(&out);
    assert_eq!(answer["up_to_date"], false);
    let count = lockstep_pg::migrate::embedded_migrations().len();
    let migrations = answer["migrations"].as_array().expect("migrations");
    assert_eq!(migrations.len(), count);
    assert!(
        migrations.iter().all(|m| m["state"] == "pending"),
        "{answer}"
    );
    let files = lockstep_pg::migrate::FUNCTION_FILES.len();
    let functions = answer["functions"].as_array().expect("functions");
    assert_eq!(functions.len(), files);
    assert!(
        functions.iter().all(|f| f["state"] == "pending"),
        "{answer}"
    );
    assert_eq!(answer["schema"], serde_json::Value::Null);
    let text_out = lockstep_on(&url, &["migrate", "--status"]).await;
    assert!(
        text(&text_out).contains(&format!("{} pending", count + files))
            && text(&text_out).contains("lockstep migrate"),
        "{}",
        text(&text_out)
    );

    let out = lockstep_on(&url, &["migrate"]).await;
    assert!(out.status.success(), "{}", text(&out));
    let out = lockstep_on(&url, &["migrate", "--status", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let answer = doc(&out);
    assert_eq!(answer["up_to_date"], true);
    assert!(
        answer["migrations"]
            .as_array()
            .expect("migrations")
            .iter()
            .all(|m| m["state"] == "applied" && m["applied_on"].is_string()),
        "{answer}"
    );
    assert!(
        answer["functions"]
            .as_array()
            .expect("functions")
            .iter()
            .all(|f| f["state"] == "applied" && f["applied_on"].is_string()),
        "{answer}"
    );
    assert_eq!(
        answer["schema"]["version"],
        lockstep_pg::migrate::SCHEMA_VERSION
    );
}

/// Issue 21: `perspectives status --check` is a health check — exit 0 while every threshold
/// holds, exit 1 naming each failed check (lag of work nobody applies, a pair in error,
/// pending events over a limit), as text and as JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_check_fails_on_lag_and_pairs_in_error() {
    let (_db, url, pool) = migrated().await;
    let name = PerspectiveName::new("Ledger").expect("valid");
    let store = PgPerspectiveStore::new();
    let out = lockstep_on(&url, &["perspectives", "status", "--check"]).await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "nothing registered is healthy: {}",
        text(&out)
    );

    let stream = StreamId::new_v7();
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect("register");
    let event = NewEvent::new("Entered", serde_json::json!({ "amount": 1 })).expect("event");
    PgEventStore::with_queue(lockstep_pg::LockQueue::new())
        .append(&tx, stream, ExpectedVersion::NoStream, &[event])
        .await
        .expect("append");
    tx.commit().await.expect("commit");

    // Issue 20: pending work that no live worker runs is unhealthy by default.
    let out = lockstep_on(&url, &["perspectives", "status", "--check"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("UNHEALTHY Ledger: unserved_pending_events is 1 (limit 0)"),
        "{}",
        text(&out)
    );
    let out = lockstep_on(
        &url,
        &["perspectives", "status", "--check", "--max-unserved", "1"],
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "fresh work is within --max-lag 60: {}",
        text(&out)
    );
    let out = lockstep_on(
        &url,
        &["perspectives", "status", "--check", "--max-pending", "0"],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("UNHEALTHY Ledger: pending_events is 1 (limit 0)"),
        "{}",
        text(&out)
    );
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let out = lockstep_on(
        &url,
        &[
            "perspectives",
            "status",
            "--check",
            "--max-lag",
            "0.1",
            "--json",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let answer = doc(&out);
    assert_eq!(answer["healthy"], false);
    assert_eq!(answer["failed"][0]["check"], "lag_s");
    assert_eq!(answer["perspectives"][0]["perspective"], "Ledger");

    // A failing pair: in error.
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    store
        .record_failure(
            &tx,
            &Pair::new(stream, name.clone()),
            &lockstep_core::PairFailure::new("boom"),
        )
        .await
        .expect("record failure");
    tx.commit().await.expect("commit");
    let out = lockstep_on(
        &url,
        &["perspectives", "status", "--check", "--max-lag", "3600"],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("in_error is 1 (limit 0)"),
        "{}",
        text(&out)
    );
    let out = lockstep_on(
        &url,
        &[
            "perspectives",
            "status",
            "--check",
            "--max-lag",
            "3600",
            "--max-in-error",
            "1",
            "--max-unserved",
            "1",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let out = lockstep_on(&url, &["perspectives", "status", "--check", "--max-lag=-1"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--max-lag"), "{}", text(&out));
}

/// Issue 20, item 5: `workers` lists the fleet (its JSON schema), lease holders are shown by
/// their instance's name, a perspective with pending work and no live worker is flagged by
/// `perspectives status` and fails `--check` (exit 1) until a live instance runs it, and again
/// once that instance is stale; the page shows the workers, escaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_lists_the_fleet_and_status_flags_perspectives_no_live_worker_runs() {
    use lockstep_core::{Fleet, FleetAdmin, InstanceAnnouncement};
    let (_db, url, pool) = migrated().await;
    let name = PerspectiveName::new("Ledger").expect("valid");
    let stream = StreamId::new_v7();
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    PgPerspectiveStore::new()
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect("register");
    let event = NewEvent::new("Entered", serde_json::json!({ "amount": 1 })).expect("event");
    PgEventStore::with_queue(lockstep_pg::LockQueue::new())
        .append(&tx, stream, ExpectedVersion::NoStream, &[event])
        .await
        .expect("append");
    tx.commit().await.expect("commit");

    let out = lockstep_on(&url, &["workers", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(doc(&out), serde_json::json!([]));
    let out = lockstep_on(&url, &["perspectives", "status"]).await;
    assert!(text(&out).contains("NO LIVE WORKER"), "{}", text(&out));
    let out = lockstep_on(&url, &["perspectives", "status", "--check", "--json"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let answer = doc(&out);
    assert_eq!(answer["failed"][0]["check"], "unserved_pending_events");
    assert_eq!(answer["perspectives"][0]["unserved"], true);
    assert_eq!(
        answer["perspectives"][0]["live_workers"],
        serde_json::json!([])
    );

    // An instance announces itself (as a worker does, from a spawned task) and takes a lease.
    let timeout = std::time::Duration::from_millis(1500);
    let locker = PgStreamLocker::from_pool(
        pool.clone(),
        StreamLockOptions::new(timeout, std::time::Duration::from_millis(300)).expect("options"),
    );
    let me = InstanceId::random();
    let announced = InstanceAnnouncement::new(
        me,
        "ledger-<1>",
        "host-a",
        4242,
        "app 1.0",
        vec![name.clone()],
    )
    .expect("valid");
    let held = tokio::spawn({
        let (locker, name) = (locker.clone(), name.clone());
        async move {
            locker.announce(&announced).await.expect("announce");
            locker
                .try_acquire(stream, &name, me, &LockReason::Rewind)
                .await
                .expect("try_acquire")
        }
    })
    .await
    .expect("task");
    assert!(held.is_acquired(), "{held:?}");

    let out = lockstep_on(&url, &["workers", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let rows = doc(&out);
    let row = &rows[0];
    let keys: Vec<&str> = row
        .as_object()
        .expect("an object per instance")
        .keys()
        .map(String::as_str)
        .collect();
    for key in [
        "instance_id",
        "name",
        "host",
        "pid",
        "version",
        "perspectives",
        "started_at",
        "last_seen_at",
        "last_seen_s_ago",
        "stale_after_s",
        "state",
        "leases_held",
    ] {
        assert!(keys.contains(&key), "{key} missing from {row}");
    }
    assert_eq!(row["instance_id"], me.to_string());
    assert_eq!(row["name"], "ledger-<1>");
    assert_eq!(row["host"], "host-a");
    assert_eq!(row["pid"], 4242);
    assert_eq!(row["version"], "app 1.0");
    assert_eq!(row["perspectives"], serde_json::json!(["Ledger"]));
    assert_eq!(row["state"], "live");
    assert_eq!(row["leases_held"], 1);
    assert_eq!(row["stale_after_s"], 1.5);
    let out = lockstep_on(&url, &["workers"]).await;
    assert!(text(&out).contains("1 live, 0 stale"), "{}", text(&out));

    let out = lockstep_on(&url, &["locks", "list", "--json"]).await;
    assert_eq!(doc(&out)[0]["holder_name"], "ledger-<1>", "{}", text(&out));
    let out = lockstep_on(&url, &["locks", "list"]).await;
    assert!(
        text(&out).contains("(held by ledger-<1>)"),
        "{}",
        text(&out)
    );

    let out = lockstep_on(&url, &["perspectives", "status", "--check", "--json"]).await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "a live instance runs it: {}",
        text(&out)
    );
    let answer = doc(&out);
    assert_eq!(answer["perspectives"][0]["unserved"], false);
    assert_eq!(
        answer["perspectives"][0]["live_workers"],
        serde_json::json!(["ledger-<1>"])
    );

    let (mut server, addr) = serve(&url).await;
    let (status, page) = tokio::task::spawn_blocking({
        let addr = addr.clone();
        move || http_get(&addr, "/fragment")
    })
    .await
    .expect("task");
    assert!(status.contains("200"), "{status}");
    assert!(page.contains("id=\"workers\""), "{page}");
    assert!(page.contains("ledger-&lt;1&gt;"), "{page}");
    assert!(
        !page.contains("ledger-<1>"),
        "announced names are escaped: {page}"
    );
    assert!(page.contains("1 workers live, 0 stale"), "{page}");

    // Not seen for its lock timeout (nobody sends its keepalive): stale, and the perspective is
    // unserved again.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let listed = locker.list_instances().await.expect("list");
        if listed[0].state == lockstep_core::InstanceState::Stale {
            break;
        }
        assert!(std::time::Instant::now() < until, "not stale within 30 s");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let out = lockstep_on(&url, &["workers", "--json"]).await;
    assert_eq!(doc(&out)[0]["state"], "stale");
    let out = lockstep_on(&url, &["perspectives", "status", "--check"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let (_, api) = tokio::task::spawn_blocking(move || http_get(&addr, "/api/status"))
        .await
        .expect("task");
    assert!(api.contains("\"workers_stale\":1"), "{api}");
    assert!(api.contains("\"perspectives_unserved\":1"), "{api}");
    let _ = server.kill();
    let _ = server.wait();
}

/// Issue 20 (items 3 and 4): `perspectives rebuild` requests a rewind from the start on every
/// pair, `status` shows a running rewind's progress, `retire` needs `--keep-states` or
/// `--drop-states` (exit 2 otherwise), stops the work, and refuses an unknown perspective.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perspectives_rebuild_retire_and_rewind_progress() {
    let (_db, url, pool) = migrated().await;
    let name = PerspectiveName::new("Ledger").expect("valid");
    let store = PgPerspectiveStore::new();
    let events = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let (first, second) = (StreamId::new_v7(), StreamId::new_v7());
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect("register");
    for stream in [first, second] {
        let batch: Vec<NewEvent> = (1..=3)
            .map(|n| NewEvent::new("Entered", serde_json::json!({ "amount": n })).expect("event"))
            .collect();
        events
            .append(&tx, stream, ExpectedVersion::NoStream, &batch)
            .await
            .expect("append");
    }
    tx.commit().await.expect("commit");

    let rebuilt = lockstep_on(&url, &["perspectives", "rebuild", "Ledger", "--json"]).await;
    assert!(rebuilt.status.success(), "{}", text(&rebuilt));
    assert_eq!(doc(&rebuilt)["outcome"], "requested");
    assert_eq!(doc(&rebuilt)["pairs"], 2);

    // A worker's progress report, as the rewind path writes it.
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let report = lockstep_core::ProgressReport::new(
        lockstep_core::Pair::new(first, name.clone()),
        uuid::Uuid::new_v4(),
        1,
        3,
    );
    store.record_progress(&tx, &report).await.expect("progress");
    tx.commit().await.expect("commit");
    let status = lockstep_on(&url, &["perspectives", "status", "--json"]).await;
    let rows = doc(&status);
    let running = &rows[0]["rewinds_running"];
    assert_eq!(rows[0]["rewinds_pending"], 2, "{rows}");
    assert!(
        rows[0]["applied_per_s"].is_null() && rows[0]["time_to_empty_s"].is_null(),
        "no worker applies anything: no rate, no time to empty: {rows}"
    );
    assert_eq!(running[0]["stream_id"], first.to_string(), "{rows}");
    assert_eq!(
        (&running[0]["replayed"], &running[0]["to_replay"]),
        (&1.into(), &3.into())
    );
    let status = lockstep_on(&url, &["perspectives", "status"]).await;
    assert!(text(&status).contains("1 of 3 events"), "{}", text(&status));

    for args in [
        &["perspectives", "retire", "Ledger"][..],
        &[
            "perspectives",
            "retire",
            "Ledger",
            "--keep-states",
            "--drop-states",
        ],
    ] {
        let out = lockstep_on(&url, args).await;
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
    }
    let retired = lockstep_on(
        &url,
        &[
            "perspectives",
            "retire",
            "Ledger",
            "--keep-states",
            "--json",
        ],
    )
    .await;
    assert!(retired.status.success(), "{}", text(&retired));
    let retired = doc(&retired);
    assert_eq!(
        (&retired["outcome"], &retired["states"], &retired["pairs"]),
        (&"retired".into(), &"kept".into(), &2.into())
    );
    assert_eq!(retired["work_removed"], 6);
    let status = lockstep_on(&url, &["perspectives", "status", "--json"]).await;
    assert_eq!(doc(&status), serde_json::json!([]), "no longer registered");
    let status = lockstep_on(&url, &["perspectives", "status"]).await;
    assert!(
        text(&status).contains("retired with their states kept: Ledger"),
        "{}",
        text(&status)
    );
    let refused = lockstep_on(&url, &["perspectives", "rebuild", "Ledger", "--json"]).await;
    assert_eq!(refused.status.code(), Some(1));
    assert_eq!(doc(&refused)["outcome"], "not_registered");

    let dropped = lockstep_on(
        &url,
        &[
            "perspectives",
            "retire",
            "Ledger",
            "--drop-states",
            "--json",
        ],
    )
    .await;
    assert!(dropped.status.success(), "{}", text(&dropped));
    assert_eq!(doc(&dropped)["states"], "dropped");
    let again = lockstep_on(&url, &["perspectives", "retire", "Ledger", "--drop-states"]).await;
    assert_eq!(again.status.code(), Some(1));
    assert!(
        text(&again).contains("`Ledger` is not registered"),
        "{}",
        text(&again)
    );
}

/// A registered `Ledger` perspective with three events on each of two streams (two pairs).
async fn two_ledger_pairs(pool: &deadpool_postgres::Pool) -> (PerspectiveName, StreamId, StreamId) {
    let name = PerspectiveName::new("Ledger").expect("valid");
    let store = PgPerspectiveStore::new();
    let events = PgEventStore::with_queue(lockstep_pg::LockQueue::new());
    let (first, second) = (StreamId::new_v7(), StreamId::new_v7());
    let tx = PgTransaction::begin(pool).await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect("register");
    for stream in [first, second] {
        let batch: Vec<NewEvent> = (1..=3)
            .map(|n| NewEvent::new("Entered", serde_json::json!({ "amount": n })).expect("event"))
            .collect();
        events
            .append(&tx, stream, ExpectedVersion::NoStream, &batch)
            .await
            .expect("append");
    }
    tx.commit().await.expect("commit");
    (name, first, second)
}

/// The pairs of `name` with a rewind requested, read through the store's status.
async fn rewinds_pending(pool: &deadpool_postgres::Pool, name: &PerspectiveName) -> u64 {
    let tx = PgTransaction::begin(pool).await.expect("begin");
    let status = PgPerspectiveStore::new()
        .perspective_status(&tx)
        .await
        .expect("status");
    tx.rollback().await.expect("rollback");
    status
        .iter()
        .find(|p| &p.perspective == name)
        .map_or(0, |p| p.rewinds_pending)
}

/// Issue 21: the page's rebuild action, like the others: no token configured 403, no or a
/// wrong token 401, cross-origin 403, bad input 422 (nothing changed), a prompt and a nonce
/// first, then a rewind from the start requested on every pair of the perspective; an unknown
/// perspective is nothing to do (409); audit lines for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_rebuild_action_needs_the_token_a_confirmation_and_requests_every_pairs_rewind() {
    let (_db, url, pool) = migrated().await;
    let (name, _, _) = two_ledger_pairs(&pool).await;
    let rebuild = r#"{"action":"rebuild","perspective":"Ledger"}"#;
    let json = [("Content-Type", "application/json")];

    let (mut plain, addr) = serve(&url).await;
    let (code, body) = http_on(&addr, "POST", "/actions", &json, rebuild).await;
    assert_eq!(code, 403, "{body}");
    let _ = plain.kill();
    let _ = plain.wait();

    let token = "a-token-of-the-operator";
    let (mut server, addr) = serve_with(&url, &[("LOCKSTEP_SERVE_TOKEN", token)], &[]).await;
    let with_token = [
        ("Content-Type", "application/json"),
        ("X-Lockstep-Token", token),
    ];
    let (code, body) = http_on(&addr, "POST", "/actions", &json, rebuild).await;
    assert_eq!(code, 401, "no token: {body}");
    let wrong = [
        ("Content-Type", "application/json"),
        ("X-Lockstep-Token", "a-token-of-the-operatoR"),
    ];
    let (code, _) = http_on(&addr, "POST", "/actions", &wrong, rebuild).await;
    assert_eq!(code, 401, "a wrong token");
    let cross = [
        ("Content-Type", "application/json"),
        ("X-Lockstep-Token", token),
        ("Origin", "http://evil.example"),
    ];
    let (code, _) = http_on(&addr, "POST", "/actions", &cross, rebuild).await;
    assert_eq!(code, 403, "cross-origin");
    for (bad, says) in [
        (
            format!(
                r#"{{"action":"rebuild","perspective":"Ledger","stream_id":"{}"}}"#,
                StreamId::new_v7()
            ),
            "takes no stream_id",
        ),
        (
            r#"{"action":"rebuild","perspective":"  "}"#.to_owned(),
            "invalid perspective name",
        ),
        (
            r#"{"action":"rewind","perspective":"Ledger"}"#.to_owned(),
            "rewind needs stream_id",
        ),
        (
            r#"{"action":"rebuild-all","perspective":"Ledger"}"#.to_owned(),
            "unknown action \\\"rebuild-all\\\"",
        ),
    ] {
        let (code, body) = http_on(&addr, "POST", "/actions", &with_token, &bad).await;
        assert_eq!(code, 422, "{bad}: {body}");
        assert!(body.contains(says), "{bad}: {body}");
    }
    assert_eq!(
        rewinds_pending(&pool, &name).await,
        0,
        "nothing changed yet"
    );

    // Step one: a prompt and a nonce; nothing requested yet.
    let (code, body) = http_on(&addr, "POST", "/actions", &with_token, rebuild).await;
    assert_eq!(code, 200, "{body}");
    let asked: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert!(
        asked["prompt"]
            .as_str()
            .is_some_and(|p| p.contains("Rebuild Ledger")),
        "{asked}"
    );
    let nonce = asked["confirm"].as_str().expect("nonce").to_owned();
    assert_eq!(
        rewinds_pending(&pool, &name).await,
        0,
        "not before the confirmation"
    );
    let confirmed = format!(r#"{{"action":"rebuild","perspective":"Ledger","confirm":"{nonce}"}}"#);
    let (code, body) = http_on(&addr, "POST", "/actions", &with_token, &confirmed).await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("each of its 2 pairs"), "{body}");
    assert_eq!(
        rewinds_pending(&pool, &name).await,
        2,
        "every pair to rewind"
    );
    let (code, _) = http_on(&addr, "POST", "/actions", &with_token, &confirmed).await;
    assert_eq!(code, 409, "a nonce is used once");

    // A perspective that is not registered: confirmed, nothing to do.
    let unknown = r#"{"action":"rebuild","perspective":"Nowhere"}"#;
    let (code, body) = http_on(&addr, "POST", "/actions", &with_token, unknown).await;
    assert_eq!(code, 200, "{body}");
    let nonce: String = serde_json::from_str::<serde_json::Value>(&body).expect("JSON")["confirm"]
        .as_str()
        .expect("nonce")
        .to_owned();
    let confirmed =
        format!(r#"{{"action":"rebuild","perspective":"Nowhere","confirm":"{nonce}"}}"#);
    let (code, body) = http_on(&addr, "POST", "/actions", &with_token, &confirmed).await;
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("Nowhere is not registered"), "{body}");

    // The page offers the button.
    let (code, page) = http_on(&addr, "GET", "/", &[], "").await;
    assert_eq!(code, 200);
    assert!(
        page.contains("data-action=\"rebuild\" data-perspective=\"Ledger\""),
        "{page}"
    );

    let _ = server.kill();
    let _ = server.wait();
    let mut log = String::new();
    if let Some(mut stderr) = server.stderr.take() {
        use std::io::Read;
        let _ = stderr.read_to_string(&mut log);
    }
    assert!(log.contains("rebuild \"Ledger\": done"), "{log}");
    assert!(log.contains("rebuild \"Nowhere\": nothing to do"), "{log}");
    assert!(log.contains("(bad or missing token): refused"), "{log}");
    assert!(log.contains("(cross-origin request): refused"), "{log}");
}

/// The lease table gives every lease's start (recorded by the try-acquire) and how long it is
/// held, and a running rewind's progress. A lease whose start is not recorded for its epoch: a
/// rewind's own report dates it, and otherwise the page says "not recorded".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_table_shows_every_leases_start_and_a_rewinds_progress() {
    let (_db, url, pool) = migrated().await;
    let (name, first, second) = two_ledger_pairs(&pool).await;
    let store = PgPerspectiveStore::new();
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    assert!(matches!(
        store.rebuild(&tx, &name).await.expect("rebuild"),
        lockstep_core::Rebuild::Requested { pairs: 2 }
    ));
    tx.commit().await.expect("commit");
    let locker = PgStreamLocker::from_pool(pool.clone(), StreamLockOptions::default());
    let (rewinder, other) = (InstanceId::random(), InstanceId::random());
    let before = time::OffsetDateTime::now_utc();
    let lease = match locker
        .try_acquire(first, &name, rewinder, &LockReason::Rewind)
        .await
        .expect("acquire")
    {
        AcquireOutcome::Acquired(lease) => lease,
        denied => panic!("{denied:?}"),
    };
    assert!(
        locker
            .try_acquire(second, &name, other, &LockReason::Purge)
            .await
            .expect("acquire")
            .is_acquired()
    );
    // The rewinding worker's report: 2 of 3 events, 5 s into the run.
    let mut report = lockstep_core::ProgressReport::new(
        lockstep_core::Pair::new(first, name.clone()),
        uuid::Uuid::new_v4(),
        2,
        3,
    );
    report.lease = Some(lease.id.clone());
    report.elapsed = std::time::Duration::from_secs(5);
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    store.record_progress(&tx, &report).await.expect("progress");
    tx.commit().await.expect("commit");

    let (mut server, addr) = serve(&url).await;
    let status_now = || async {
        let (code, body) = http_on(&addr, "GET", "/api/status", &[], "").await;
        let (page_code, page) = http_on(&addr, "GET", "/", &[], "").await;
        assert_eq!((code, page_code), (200, 200), "{body}");
        let status: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        (status, page)
    };
    let row = |status: &serde_json::Value, stream: StreamId| {
        status["leases"]
            .as_array()
            .expect("leases")
            .iter()
            .find(|l| l["stream_id"] == stream.to_string())
            .unwrap_or_else(|| panic!("{stream} listed: {status}"))
            .clone()
    };
    let (status, page) = status_now().await;
    for stream in [first, second] {
        let lease = row(&status, stream);
        assert_eq!(lease["started_at_source"], "lease", "{lease}");
        let started = lease["started_at"].as_str().expect("a start time");
        let started =
            time::OffsetDateTime::parse(started, &time::format_description::well_known::Rfc3339)
                .expect("RFC 3339");
        // One machine: the database clock and the test's agree to well under a second.
        assert!(
            started >= before - time::Duration::seconds(1),
            "{started} vs {before}"
        );
        let held = lease["held_s"].as_f64().expect("held_s");
        assert!((0.0..60.0).contains(&held), "held for {held} s: {lease}");
    }
    let rewinding = row(&status, first);
    assert_eq!(
        (
            &rewinding["progress"]["replayed"],
            &rewinding["progress"]["to_replay"]
        ),
        (&2.into(), &3.into()),
        "{rewinding}"
    );
    assert!(row(&status, second)["progress"].is_null());
    assert!(page.contains("2 of 3 events (66.7%)"), "{page}");
    assert!(!page.contains("not recorded"), "{page}");

    // Leases whose start is not recorded for their epoch.
    pool.get()
        .await
        .expect("connection")
        .execute(
            "UPDATE wh_perspective_cursors SET stream_lock_acquired_at = NULL \
              WHERE perspective_name = $1",
            &[&name.as_str()],
        )
        .await
        .expect("forget the starts");
    let (status, page) = status_now().await;
    let _ = server.kill();
    let _ = server.wait();
    let rewinding = row(&status, first);
    assert_eq!(
        rewinding["started_at_source"], "rewind_progress",
        "{rewinding}"
    );
    let running = rewinding["held_s"].as_f64().expect("held_s");
    assert!(
        running >= 4.0,
        "the run began 5 s before its report: {running} s"
    );
    let plain = row(&status, second);
    assert!(plain["started_at"].is_null(), "{plain}");
    assert_eq!(plain["started_at_source"], "not_recorded");
    assert!(plain["held_s"].is_null(), "{plain}");
    assert!(page.contains("not recorded"), "{page}");
}

/// Headless Chromium driven over the DevTools protocol on `--remote-debugging-pipe`: JSON
/// messages ending in a NUL byte, commands on the browser's descriptor 3, answers and events
/// on its descriptor 4 (what Puppeteer's `pipe: true` does). A shell maps the child's standard
/// input and output onto 3 and 4, so no WebSocket client and no `unsafe` are needed. Every wait
/// is bounded; dropping it kills the browser and removes its profile, also when a test fails.
struct Browser {
    child: std::process::Child,
    commands: std::process::ChildStdin,
    messages: std::sync::mpsc::Receiver<serde_json::Value>,
    /// Events received while waiting for an answer.
    events: Vec<serde_json::Value>,
    next_id: u64,
    session: Option<String>,
    profile: std::path::PathBuf,
}

/// How long one protocol command or one condition on the page may take.
const BROWSER_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl Browser {
    fn launch() -> Browser {
        let profile =
            std::env::temp_dir().join(format!("lockstep-chromium-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&profile).expect("profile folder");
        let log = std::fs::File::create(profile.join("chromium.log")).expect("log file");
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(r#"exec "$0" "$@" 3<&0 4>&1 </dev/null >&2"#)
            .arg(chromium())
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--remote-debugging-pipe",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(log)
            // A process group of its own (the browser, its zygotes and renderers), so that the
            // drop can end all of them by its id.
            .process_group(0)
            .spawn()
            .expect("starting chromium");
        let commands = child.stdin.take().expect("stdin");
        let mut answers = child.stdout.take().expect("stdout");
        let (tx, messages) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::Read;
            let mut pending = Vec::new();
            let mut buf = [0u8; 65536];
            while let Ok(n) = answers.read(&mut buf) {
                if n == 0 {
                    return;
                }
                pending.extend_from_slice(&buf[..n]);
                while let Some(end) = pending.iter().position(|b| *b == 0) {
                    let message: Vec<u8> = pending.drain(..=end).collect();
                    if let Ok(value) = serde_json::from_slice(&message[..end])
                        && tx.send(value).is_err()
                    {
                        return;
                    }
                }
            }
        });
        Browser {
            child,
            commands,
            messages,
            events: Vec::new(),
            next_id: 0,
            session: None,
            profile,
        }
    }

    /// What the browser wrote on standard error, for a failure's message.
    fn log(&self) -> String {
        std::fs::read_to_string(self.profile.join("chromium.log")).unwrap_or_default()
    }

    /// Sends `method` (to the attached page, once there is one) and waits for its result.
    fn call(&mut self, method: &str, params: &serde_json::Value) -> serde_json::Value {
        use std::io::Write;
        self.next_id += 1;
        let id = self.next_id;
        let mut message = serde_json::json!({ "id": id, "method": method, "params": params });
        if let Some(session) = &self.session {
            message["sessionId"] = session.clone().into();
        }
        let mut bytes = serde_json::to_vec(&message).expect("JSON");
        bytes.push(0);
        self.commands
            .write_all(&bytes)
            .and_then(|()| self.commands.flush())
            .unwrap_or_else(|e| panic!("sending {method} to chromium: {e}\n{}", self.log()));
        let deadline = std::time::Instant::now() + BROWSER_WAIT;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let answer = self.messages.recv_timeout(left).unwrap_or_else(|e| {
                panic!("chromium did not answer {method} ({e})\n{}", self.log())
            });
            if answer["id"] == id {
                assert!(
                    answer["error"].is_null(),
                    "{method} failed: {answer}\n{}",
                    self.log()
                );
                return answer["result"].clone();
            }
            self.events.push(answer);
        }
    }

    /// Opens a page on `url` and attaches to it (its commands go there from then on).
    fn open(&mut self, url: &str) {
        let target = self.call(
            "Target.createTarget",
            &serde_json::json!({ "url": "about:blank" }),
        );
        let attached = self.call(
            "Target.attachToTarget",
            &serde_json::json!({ "targetId": target["targetId"], "flatten": true }),
        );
        self.session = attached["sessionId"].as_str().map(str::to_owned);
        assert!(self.session.is_some(), "attached: {attached}");
        // Page events: the confirmation dialog is one.
        self.call("Page.enable", &serde_json::json!({}));
        self.call("Page.navigate", &serde_json::json!({ "url": url }));
    }

    /// The value of `expression` evaluated in the page (promises awaited).
    fn eval(&mut self, expression: &str) -> serde_json::Value {
        let result = self.call(
            "Runtime.evaluate",
            &serde_json::json!({
                "expression": expression, "returnByValue": true, "awaitPromise": true,
            }),
        );
        assert!(
            result["exceptionDetails"].is_null(),
            "{expression}: {result}"
        );
        result["result"]["value"].clone()
    }

    /// Waits until `expression` is true in the page; panics with `what` and the page's text
    /// when it is not within [`BROWSER_WAIT`].
    fn wait_until(&mut self, expression: &str, what: &str) {
        let deadline = std::time::Instant::now() + BROWSER_WAIT;
        while std::time::Instant::now() < deadline {
            if self.eval(expression) == true {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let text = self.eval("document.body ? document.body.innerText : ''");
        panic!("{what}: not within {BROWSER_WAIT:?}; the page says:\n{text}");
    }

    /// Waits for the page's next JavaScript dialog and answers it; gives its message.
    fn answer_dialog(&mut self, accept: bool) -> String {
        let deadline = std::time::Instant::now() + BROWSER_WAIT;
        loop {
            if let Some(at) = self
                .events
                .iter()
                .position(|e| e["method"] == "Page.javascriptDialogOpening")
            {
                let event = self.events.remove(at);
                self.call(
                    "Page.handleJavaScriptDialog",
                    &serde_json::json!({ "accept": accept }),
                );
                return event["params"]["message"].as_str().unwrap_or("").to_owned();
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let event = self
                .messages
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no confirmation dialog opened ({e})\n{}", self.log()));
            self.events.push(event);
        }
    }

    /// Whether a dialog opened (events received so far).
    fn saw_dialog(&mut self) -> bool {
        while let Ok(event) = self.messages.try_recv() {
            self.events.push(event);
        }
        self.events
            .iter()
            .any(|e| e["method"] == "Page.javascriptDialogOpening")
    }
}

impl Drop for Browser {
    /// Asks the browser to close (it then ends its renderer and helper processes itself), waits
    /// at most 5 s for it, kills its process group, and removes its profile.
    fn drop(&mut self) {
        use std::io::Write;
        let close = b"{\"id\":0,\"method\":\"Browser.close\"}\0";
        let _ = self
            .commands
            .write_all(close)
            .and_then(|()| self.commands.flush());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut closed = false;
        while !closed && std::time::Instant::now() < deadline {
            closed = matches!(self.child.try_wait(), Ok(Some(_)));
            if !closed {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
        if !closed {
            // The whole group, by its id, while its leader is not reaped yet (so the id cannot
            // have been reused): the browser and every helper it started.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.child.id())])
                .stderr(std::process::Stdio::null())
                .status();
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// Issue 21's "done when": in real headless Chromium, the page shows a lease a test holds; its
/// force-release button without the token is refused (the page says so, no confirmation is
/// asked, the lease is untouched in the database); with the token typed into the page's token
/// field and the confirmation dialog accepted, the lease is released in the database and the
/// page no longer lists it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_real_browser_an_action_needs_the_token_and_with_it_releases_the_lease() {
    let (_db, url, pool) = migrated().await;
    let locker = PgStreamLocker::from_pool(pool.clone(), StreamLockOptions::default());
    let (stream, name) = (
        StreamId::new_v7(),
        PerspectiveName::new("Orders").expect("valid"),
    );
    let client = pool.get().await.expect("connection");
    client
        .execute(
            "INSERT INTO wh_perspective_cursors (stream_id, perspective_name) VALUES ($1, $2)",
            &[&stream.as_uuid(), &name.as_str()],
        )
        .await
        .expect("cursor");
    drop(client);
    let holder = InstanceId::random();
    let lease = match locker
        .try_acquire(stream, &name, holder, &LockReason::Rewind)
        .await
        .expect("acquire")
    {
        AcquireOutcome::Acquired(lease) => lease,
        denied => panic!("{denied:?}"),
    };
    let token = "a-token-of-the-operator";
    let (mut server, addr) = serve_with(&url, &[("LOCKSTEP_SERVE_TOKEN", token)], &[]).await;
    let page_url = format!("http://{addr}/");
    let button = format!(
        "document.querySelector('button[data-action=\"release\"][data-stream=\"{stream}\"]')"
    );
    let runtime = tokio::runtime::Handle::current();
    let lease_now = {
        let locker = locker.clone();
        move || {
            runtime.block_on(async {
                lockstep_core::StreamLockAdmin::list_leases(&locker)
                    .await
                    .expect("list")
                    .into_iter()
                    .find(|l| l.stream_id == stream)
            })
        }
    };
    let driven = tokio::task::spawn_blocking(move || {
        let mut browser = Browser::launch();
        browser.open(&page_url);
        browser.wait_until(
            &format!("{button} !== null && document.getElementById('leases').innerText.includes('{holder}')"),
            "the held lease and its force-release button on the page",
        );

        // Without the token: refused, said on the page, no confirmation asked, nothing changed.
        browser.eval(&format!("{button}.click()"));
        browser.wait_until(
            "document.getElementById('message').textContent.includes('X-Lockstep-Token')",
            "the refusal on the page",
        );
        assert!(!browser.saw_dialog(), "no confirmation without the token");
        let still = lease_now().expect("the lease is still there");
        assert_eq!(
            (still.holder, still.epoch, still.status),
            (holder, lease.id.epoch, lockstep_core::LeaseStatus::Held),
            "the refused action changed nothing"
        );

        // The token typed into the page's field, the button clicked, the dialog accepted.
        browser.eval("document.getElementById('token').focus()");
        browser.call("Input.insertText", &serde_json::json!({ "text": token }));
        assert_eq!(
            browser.eval("document.getElementById('token').value"),
            token,
            "the token is in the field"
        );
        browser.eval(&format!("{button}.click()"));
        let prompt = browser.answer_dialog(true);
        assert!(prompt.contains("Force-release"), "{prompt}");
        assert!(prompt.contains(&stream.to_string()), "{prompt}");
        browser.wait_until(
            "document.getElementById('message').textContent.includes('released the lease')",
            "the page says the lease was released",
        );
        assert!(lease_now().is_none(), "the lease is released in the database");
        browser.wait_until(
            &format!("!document.getElementById('leases').innerText.includes('{stream}')"),
            "the page no longer lists the lease",
        );
    })
    .await;
    let _ = server.kill();
    let _ = server.wait();
    let mut log = String::new();
    if let Some(mut stderr) = server.stderr.take() {
        use std::io::Read;
        let _ = stderr.read_to_string(&mut log);
    }
    if let Err(e) = driven {
        std::panic::resume_unwind(e.into_panic());
    }
    assert!(log.contains("(bad or missing token): refused"), "{log}");
    assert!(
        log.contains(&format!("release {stream}/\"Orders\": done")),
        "{log}"
    );
}

/// Issue 21: `/metrics` is read from the database at each scrape, so a perspective that is
/// retired has no series any more (a gauge kept at its last value would keep an alert on its
/// pending events or its workers firing for ever); every family still has `# HELP`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retired_perspective_leaves_the_metrics() {
    let (_db, url, pool) = migrated().await;
    let (ledger, _, _) = two_ledger_pairs(&pool).await;
    let statements = PerspectiveName::new("Statements").expect("valid");
    let store = PgPerspectiveStore::new();
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    store
        .register(&tx, std::slice::from_ref(&statements))
        .await
        .expect("register");
    tx.commit().await.expect("commit");
    let (mut server, addr) = serve(&url).await;
    let pending = |metrics: &str| -> Vec<(String, f64)> {
        let scrape = prometheus_parse::Scrape::parse(metrics.lines().map(|l| Ok(l.to_owned())))
            .expect("a valid exposition");
        assert!(
            scrape
                .docs
                .contains_key("lockstep_perspective_pending_events"),
            "{metrics}"
        );
        let mut rows: Vec<(String, f64)> = scrape
            .samples
            .iter()
            .filter(|s| s.metric == "lockstep_perspective_pending_events")
            .filter_map(|s| match s.value {
                prometheus_parse::Value::Gauge(v) => {
                    Some((s.labels.get("perspective")?.to_owned(), v))
                }
                _ => None,
            })
            .collect();
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        rows
    };
    let (code, before) = http_on(&addr, "GET", "/metrics", &[], "").await;
    assert_eq!(code, 200, "{before}");
    assert_eq!(
        pending(&before),
        vec![("Ledger".to_owned(), 6.0), ("Statements".to_owned(), 6.0)],
        "{before}"
    );
    let source = lockstep_pg::PgDatabase::from_pool(pool.clone());
    let retired = tokio::spawn(async move {
        lockstep_worker::life::retire(
            &source,
            &PgPerspectiveStore::new(),
            &statements,
            lockstep_core::RetireStates::Keep,
        )
        .await
    })
    .await
    .expect("task")
    .expect("retire");
    assert!(
        matches!(retired, lockstep_core::Retired::Retired { .. }),
        "{retired:?}"
    );
    let (code, after) = http_on(&addr, "GET", "/metrics", &[], "").await;
    let _ = server.kill();
    let _ = server.wait();
    assert_eq!(code, 200, "{after}");
    assert_eq!(
        pending(&after),
        vec![(ledger.as_str().to_owned(), 6.0)],
        "the retired perspective has no series: {after}"
    );
    assert!(
        !after.contains("perspective=\"Statements\""),
        "no family keeps it: {after}"
    );
}

/// Announces `name` (instance `me`, running `perspectives`) from a spawned task, as a worker
/// does, on a locker whose lock timeout is `timeout`.
async fn announce_instance(
    pool: &deadpool_postgres::Pool,
    me: InstanceId,
    name: &str,
    perspectives: &[&PerspectiveName],
    timeout: std::time::Duration,
) -> PgStreamLocker {
    let locker = PgStreamLocker::from_pool(
        pool.clone(),
        StreamLockOptions::new(timeout, timeout / 5).expect("options"),
    );
    let announced = lockstep_core::InstanceAnnouncement::new(
        me,
        name,
        "host-a",
        4242,
        "app 1.0",
        perspectives.iter().map(|p| (*p).clone()).collect(),
    )
    .expect("valid");
    tokio::spawn({
        let locker = locker.clone();
        async move { locker.announce(&announced).await }
    })
    .await
    .expect("task")
    .expect("announce");
    locker
}

/// A fleet row lockstep cannot read (an operator's `'infinity'` last-seen time, a perspective
/// name that does not validate) is listed as unreadable, with its id, beside the other
/// instances — by `workers` (text and JSON, exit 0), and `locks list`, `perspectives status
/// --check` and the page (with its metrics) go on working — instead of failing them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_fleet_row_is_listed_as_unreadable_beside_the_others() {
    let (_db, url, pool) = migrated().await;
    let name = PerspectiveName::new("Ledger").expect("valid");
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    PgPerspectiveStore::new()
        .register(&tx, std::slice::from_ref(&name))
        .await
        .expect("register");
    let event = NewEvent::new("Entered", serde_json::json!({ "amount": 1 })).expect("event");
    let stream = StreamId::new_v7();
    PgEventStore::with_queue(lockstep_pg::LockQueue::new())
        .append(&tx, stream, ExpectedVersion::NoStream, &[event])
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    let (good, infinite, misnamed) = (
        InstanceId::random(),
        InstanceId::random(),
        InstanceId::random(),
    );
    let minute = std::time::Duration::from_secs(60);
    let locker = announce_instance(&pool, good, "good", &[&name], minute).await;
    announce_instance(&pool, infinite, "infinite", &[&name], minute).await;
    announce_instance(&pool, misnamed, "misnamed", &[&name], minute).await;
    assert!(
        locker
            .try_acquire(stream, &name, good, &LockReason::Rewind)
            .await
            .expect("try_acquire")
            .is_acquired()
    );
    let client = pool.get().await.expect("connection");
    client
        .execute(
            "UPDATE wh_worker_instances SET last_seen_at = 'infinity' WHERE instance_id = $1",
            &[&infinite.as_uuid()],
        )
        .await
        .expect("an operator's update");
    client
        .execute(
            "UPDATE wh_worker_instances SET perspectives = ARRAY[''] WHERE instance_id = $1",
            &[&misnamed.as_uuid()],
        )
        .await
        .expect("an operator's update");

    let out = lockstep_on(&url, &["workers", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let rows = doc(&out);
    let rows = rows.as_array().expect("an array");
    assert_eq!(rows.len(), 3, "{rows:?}");
    let row = |id: InstanceId| {
        rows.iter()
            .find(|r| r["instance_id"] == id.to_string())
            .unwrap_or_else(|| panic!("{id} is listed: {rows:?}"))
    };
    assert_eq!(row(good)["state"], "live");
    assert_eq!(row(good)["leases_held"], 1);
    for (bad, name, problem) in [
        (infinite, "infinite", "last_seen_at"),
        (misnamed, "misnamed", "perspective name"),
    ] {
        assert_eq!(row(bad)["state"], "unreadable", "{rows:?}");
        assert_eq!(row(bad)["name"], name, "{rows:?}");
        assert!(
            row(bad)["error"]
                .as_str()
                .is_some_and(|e| e.contains(problem)),
            "{problem}: {rows:?}"
        );
    }

    let out = lockstep_on(&url, &["workers"]).await;
    let report = text(&out);
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert!(report.contains(&good.to_string()), "{report}");
    for bad in [infinite, misnamed] {
        let line = report
            .lines()
            .find(|l| l.contains(&bad.to_string()))
            .unwrap_or_else(|| panic!("{bad} is listed: {report}"));
        assert!(line.contains("unreadable"), "{report}");
    }
    assert!(report.contains("1 live, 0 stale, 2 unreadable"), "{report}");

    let out = lockstep_on(&url, &["locks", "list", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(doc(&out)[0]["holder_name"], "good", "{}", text(&out));
    let out = lockstep_on(&url, &["perspectives", "status", "--check", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        doc(&out)["perspectives"][0]["live_workers"],
        serde_json::json!(["good"]),
        "an unreadable row runs nothing: {}",
        text(&out)
    );

    let (mut server, addr) = serve(&url).await;
    let (page, metrics) = (
        http_on(&addr, "GET", "/fragment", &[], "").await,
        http_on(&addr, "GET", "/metrics", &[], "").await,
    );
    let _ = server.kill();
    let _ = server.wait();
    assert_eq!(page.0, 200, "{}", page.1);
    for id in [good, infinite, misnamed] {
        assert!(page.1.contains(&id.to_string()), "{}", page.1);
    }
    assert!(page.1.contains("unreadable"), "{}", page.1);
    assert_eq!(metrics.0, 200, "{}", metrics.1);
    assert!(
        metrics
            .1
            .contains("lockstep_worker_instances{state=\"unreadable\"} 2"),
        "{}",
        metrics.1
    );
    assert!(
        metrics
            .1
            .contains("lockstep_worker_instances{state=\"live\"} 1"),
        "{}",
        metrics.1
    );
}

/// `workers forget` removes one instance that died (exit 0), refuses a live one and one that is
/// not announced (exit 1, nothing changed); `workers prune --older-than` removes the stale
/// instances not seen for that long and never a live one; a bad duration or id exits 2. Each
/// answers one JSON document with `--json`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_forget_and_prune_remove_instances_that_died_and_keep_live_ones() {
    let (_db, url, pool) = migrated().await;
    let name = PerspectiveName::new("Ledger").expect("valid");
    let minute = std::time::Duration::from_secs(60);
    let (live, died, old, recent) = (
        InstanceId::random(),
        InstanceId::random(),
        InstanceId::random(),
        InstanceId::random(),
    );
    for (id, n) in [
        (live, "live"),
        (died, "died"),
        (old, "old"),
        (recent, "recent"),
    ] {
        announce_instance(&pool, id, n, &[&name], minute).await;
    }
    let client = pool.get().await.expect("connection");
    for (id, ago) in [(died, "3 hours"), (old, "2 hours"), (recent, "10 minutes")] {
        client
            .execute(
                &format!(
                    "UPDATE wh_worker_instances SET last_seen_at = clock_timestamp() - \
                     interval '{ago}' WHERE instance_id = $1"
                ),
                &[&id.as_uuid()],
            )
            .await
            .expect("seen long ago");
    }
    let listed = |out: &Output| -> Vec<String> {
        let mut names: Vec<String> = doc(out)
            .as_array()
            .expect("an array")
            .iter()
            .map(|r| r["name"].as_str().unwrap_or("").to_owned())
            .collect();
        names.sort();
        names
    };

    let out = lockstep_on(&url, &["workers", "forget", &live.to_string(), "--json"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(
        doc(&out),
        serde_json::json!({ "instance_id": live.to_string(), "outcome": "live" })
    );
    let out = lockstep_on(&url, &["workers", "forget", &died.to_string()]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("forgotten"), "{}", text(&out));
    let out = lockstep_on(&url, &["workers", "forget", &died.to_string(), "--json"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(doc(&out)["outcome"], "not_announced");
    let out = lockstep_on(&url, &["workers", "--json"]).await;
    assert_eq!(listed(&out), ["live", "old", "recent"]);

    let out = lockstep_on(&url, &["workers", "prune", "--older-than", "1h", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        doc(&out),
        serde_json::json!({
            "older_than_s": 3600.0,
            "forgotten": [{ "instance_id": old.to_string(), "name": "old" }],
        })
    );
    let out = lockstep_on(&url, &["workers", "list", "--json"]).await;
    assert_eq!(listed(&out), ["live", "recent"]);
    let out = lockstep_on(&url, &["workers", "prune", "--older-than", "0s"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("1 stale worker instances"),
        "{}",
        text(&out)
    );
    let out = lockstep_on(&url, &["workers", "--json"]).await;
    assert_eq!(listed(&out), ["live"], "a live instance is never pruned");

    for args in [
        &["workers", "prune", "--older-than", "soon", "--json"][..],
        &["workers", "prune", "--older-than", "-1h", "--json"],
        &["workers", "forget", "not-a-uuid", "--json"],
        &[
            "workers",
            "forget",
            "00000000-0000-0000-0000-000000000000",
            "--json",
        ],
    ] {
        let out = lockstep_on(&url, args).await;
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
        assert_eq!(doc(&out)["exit_code"], 2, "{args:?}");
    }
    let out = lockstep_on(&url, &["workers", "--json"]).await;
    assert_eq!(listed(&out), ["live"]);
}

/// `perspectives retire` warns that live worker instances still run the perspective (they
/// register it again when they restart) and names them, on standard error and in the JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retire_warns_that_live_workers_still_run_the_perspective() {
    let (_db, url, pool) = migrated().await;
    let (ledger, _, _) = two_ledger_pairs(&pool).await;
    let statements = PerspectiveName::new("Statements").expect("valid");
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    PgPerspectiveStore::new()
        .register(&tx, std::slice::from_ref(&statements))
        .await
        .expect("register");
    tx.commit().await.expect("commit");
    let minute = std::time::Duration::from_secs(60);
    announce_instance(&pool, InstanceId::random(), "app-1", &[&ledger], minute).await;
    announce_instance(&pool, InstanceId::random(), "app-2\n", &[&ledger], minute).await;

    let out = lockstep_on(
        &url,
        &["perspectives", "retire", ledger.as_str(), "--keep-states"],
    )
    .await;
    let report = text(&out);
    assert_eq!(out.status.code(), Some(0), "{report}");
    let warning = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        warning.contains("warning: 2 live worker instances still run `Ledger`"),
        "{warning}"
    );
    assert!(
        warning.contains("\"app-1\"") && warning.contains("\"app-2\\n\""),
        "names quoted: {warning}"
    );

    let out = lockstep_on(
        &url,
        &[
            "perspectives",
            "retire",
            statements.as_str(),
            "--drop-states",
            "--json",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(doc(&out)["live_workers"], serde_json::json!([]));
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("warning"),
        "no live worker runs it: {}",
        text(&out)
    );
}

/// Sends `request` as is on a new connection to `addr` and reads one response (its head and
/// the `Content-Length` bytes of its body), giving up after `bound` without a byte: the whole
/// response as text.
fn raw_exchange(addr: &str, request: &[u8], bound: std::time::Duration) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(bound))?;
    stream.write_all(request)?;
    let mut response = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&response).to_string();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                })
                .unwrap_or(0);
            if body.len() >= length {
                return Ok(text);
            }
        }
        match stream.read(&mut chunk)? {
            0 => return Ok(String::from_utf8_lossy(&response).to_string()),
            n => response.extend_from_slice(&chunk[..n]),
        }
    }
}

/// `raw_exchange` of a GET with this `Host` header, off the runtime's threads.
async fn get_with_host(addr: &str, path: &str, host: &str) -> String {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let addr = addr.to_owned();
    tokio::task::spawn_blocking(move || {
        raw_exchange(
            &addr,
            request.as_bytes(),
            std::time::Duration::from_secs(60),
        )
    })
    .await
    .expect("task")
    .expect("an answer")
}

/// The page answers only to an address, `localhost` or a `--public-url` in `Host` (a
/// DNS-rebinding page, under its own name, is refused with 421 and reads nothing); an action's
/// `Origin` must be the page's with its scheme; every answer forbids framing and sniffing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_answers_only_to_its_own_host_names_and_forbids_framing() {
    let (_db, url, _pool) = migrated().await;
    let token = "a-token-of-sixteen-or-more";
    let (mut server, addr) = serve_with(
        &url,
        &[("LOCKSTEP_SERVE_TOKEN", token)],
        &["--public-url", "https://status.example.com"],
    )
    .await;
    let port = addr.rsplit(':').next().expect("a port").to_owned();
    for host in [
        addr.clone(),
        format!("localhost:{port}"),
        "status.example.com".to_owned(),
    ] {
        let answer = get_with_host(&addr, "/api/status", &host).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{host}: {answer}");
    }
    for host in [
        format!("rebind.evil.example:{port}"),
        "status.example.com.evil.example".to_owned(),
    ] {
        for path in ["/", "/api/status", "/metrics"] {
            let answer = get_with_host(&addr, path, &host).await;
            assert!(answer.starts_with("HTTP/1.1 421"), "{host}{path}: {answer}");
            assert!(!answer.contains("\"leases\""), "{answer}");
        }
    }
    for (path, host) in [
        ("/", addr.clone()),
        ("/metrics", addr.clone()),
        ("/nowhere", addr.clone()),
        ("/", format!("rebind.evil.example:{port}")),
    ] {
        let answer = get_with_host(&addr, path, &host).await.to_ascii_lowercase();
        for header in [
            "content-security-policy: frame-ancestors 'none'",
            "x-frame-options: deny",
            "x-content-type-options: nosniff",
        ] {
            assert!(answer.contains(header), "{path} {host}: {header}: {answer}");
        }
    }

    // The actions: the Origin is compared with the scheme too.
    let body = r#"{"action":"rebuild","perspective":"Nowhere"}"#;
    let action = |origin: String, host: String| {
        let addr = addr.clone();
        async move {
            http_on(
                &addr,
                "POST",
                "/actions",
                &[
                    ("Host", host.as_str()),
                    ("Origin", origin.as_str()),
                    ("X-Lockstep-Token", token),
                    ("Content-Type", "application/json"),
                ],
                body,
            )
            .await
        }
    };
    let (code, answer) = action(format!("http://{addr}"), addr.clone()).await;
    assert_eq!(code, 200, "its own origin: {answer}");
    let (code, answer) = action(format!("https://{addr}"), addr.clone()).await;
    assert_eq!(code, 403, "another scheme: {answer}");
    let (code, answer) = action(
        "https://status.example.com".to_owned(),
        "status.example.com".to_owned(),
    )
    .await;
    assert_eq!(code, 200, "the public URL's origin: {answer}");
    let (code, answer) = action(
        "http://status.example.com".to_owned(),
        "status.example.com".to_owned(),
    )
    .await;
    assert_eq!(code, 403, "the public URL is https: {answer}");
    let _ = server.kill();
    let _ = server.wait();
}

/// A client that never finishes its request's headers is disconnected by the server after
/// `--header-read-timeout` (waited for as the connection's end, within a generous bound), so
/// slow or idle connections cannot pile up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    let (_db, url, _pool) = migrated().await;
    let (mut server, addr) = serve_with(&url, &[], &["--header-read-timeout", "1"]).await;
    let closed = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let slow: Vec<std::net::TcpStream> = (0..20)
            .map(|_| {
                let mut stream = std::net::TcpStream::connect(&addr).expect("connect");
                stream
                    .write_all(format!("GET / HTTP/1.1\r\nHost: {addr}\r\nX-Slow: ").as_bytes())
                    .expect("a part of the headers");
                stream
            })
            .collect();
        slow.into_iter()
            .map(|mut stream| {
                // The bound only stops a server that never closes; the close itself is waited
                // for.
                stream
                    .set_read_timeout(Some(std::time::Duration::from_secs(60)))
                    .expect("timeout");
                let mut rest = Vec::new();
                match stream.read_to_end(&mut rest) {
                    Ok(_) => Ok(()),
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(()),
                    Err(e) => Err(e.kind()),
                }
            })
            .collect::<Vec<_>>()
    })
    .await
    .expect("task");
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        closed.iter().all(Result::is_ok),
        "every slow connection is closed by the server: {closed:?}"
    );
}

/// An action request without the token is answered before its body is read (a client that
/// announces 2 MB and sends none of it still gets its 401), and with the token a body over the
/// cap is refused (413), so nobody can make the page buffer large bodies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_without_the_token_is_refused_before_its_body_is_read() {
    let (_db, url, _pool) = migrated().await;
    let token = "a-token-of-sixteen-or-more";
    let (mut server, addr) = serve_with(&url, &[("LOCKSTEP_SERVE_TOKEN", token)], &[]).await;
    let announced = {
        let addr = addr.clone();
        tokio::task::spawn_blocking(move || {
            let request = format!(
                "POST /actions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
                 Content-Length: 2000000\r\n\r\n{{\"action\":"
            );
            raw_exchange(
                &addr,
                request.as_bytes(),
                std::time::Duration::from_secs(60),
            )
        })
        .await
        .expect("task")
    };
    let announced = announced.expect("an answer while the body is still owed");
    assert!(announced.starts_with("HTTP/1.1 401"), "{announced}");

    let padding = "x".repeat(100 * 1024);
    let body = format!(r#"{{"action":"rebuild","perspective":"Nowhere","pad":"{padding}"}}"#);
    let (code, answer) = http_on(
        &addr,
        "POST",
        "/actions",
        &[
            ("X-Lockstep-Token", token),
            ("Content-Type", "application/json"),
        ],
        &body,
    )
    .await;
    assert_eq!(code, 413, "{answer}");
    let (code, answer) = http_on(
        &addr,
        "POST",
        "/actions",
        &[
            ("X-Lockstep-Token", token),
            ("Content-Type", "application/json"),
        ],
        r#"{"action":"rebuild","perspective":"Nowhere"}"#,
    )
    .await;
    assert_eq!(code, 200, "a small body is read: {answer}");
    let _ = server.kill();
    let _ = server.wait();
}

/// Scrapes that arrive while a snapshot is being read share it: with the read held up (a
/// table it reads locked by the test) until every scrape has arrived, N concurrent `/metrics`
/// scrapes all succeed on one read of the database (counted from the server's debug log)
/// instead of one each on a pool of 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_scrapes_share_one_snapshot_read() {
    use std::io::{BufRead, BufReader};
    const SCRAPES: usize = 40;
    let (_db, url, pool) = migrated().await;
    let (mut server, addr) = serve_with(&url, &[("RUST_LOG", "lockstep::serve=debug")], &[]).await;
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let stderr = server.stderr.take().expect("stderr");
    let reader = std::thread::spawn({
        let log = std::sync::Arc::clone(&log);
        move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                log.lock().expect("log").push(line);
            }
        }
    });
    let count = |what: &str| {
        log.lock()
            .expect("log")
            .iter()
            .filter(|l| l.contains(what))
            .count()
    };

    let mut holder = pool.get().await.expect("connection");
    let lock = holder.transaction().await.expect("begin");
    lock.batch_execute("LOCK TABLE wh_worker_instances IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock");
    let scrapes: Vec<_> = (0..SCRAPES)
        .map(|_| {
            let addr = addr.clone();
            tokio::task::spawn_blocking(move || {
                let request =
                    format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
                raw_exchange(
                    &addr,
                    request.as_bytes(),
                    std::time::Duration::from_secs(120),
                )
            })
        })
        .collect();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while count("reads a snapshot") + count("joins the snapshot being read") < SCRAPES {
        assert!(
            std::time::Instant::now() < until,
            "every scrape arrives within 60 s: {:?}",
            log.lock().expect("log")
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    lock.rollback().await.expect("unlock");
    for scrape in scrapes {
        let answer = scrape.await.expect("task").expect("an answer");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("lockstep_worker_instances"), "{answer}");
    }
    let reads = count("reads a snapshot");
    let _ = server.kill();
    let _ = server.wait();
    let _ = reader.join();
    assert_eq!(
        reads, 1,
        "{SCRAPES} scrapes that arrived during one read share it"
    );
}

/// A perspective name with a line break cannot forge an audit line: names are quoted and
/// escaped, and every audit event is one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_with_a_line_break_cannot_forge_an_audit_line() {
    let (_db, url, _pool) = migrated().await;
    let token = "a-token-of-sixteen-or-more";
    let (mut server, addr) = serve_with(&url, &[("LOCKSTEP_SERVE_TOKEN", token)], &[]).await;
    let forged = "Orders\naudit: forged from 10.0.0.1: release all: done";
    let body = serde_json::json!({
        "action": "rebuild",
        "perspective": forged,
        "confirm": "no-such-confirmation",
    })
    .to_string();
    let (code, answer) = http_on(
        &addr,
        "POST",
        "/actions",
        &[
            ("X-Lockstep-Token", token),
            ("Content-Type", "application/json"),
        ],
        &body,
    )
    .await;
    let _ = server.kill();
    let _ = server.wait();
    let mut log = String::new();
    if let Some(mut stderr) = server.stderr.take() {
        use std::io::Read;
        let _ = stderr.read_to_string(&mut log);
    }
    assert!(
        !log.lines().any(|l| l.starts_with("audit: forged")),
        "no forged line: {log}"
    );
    // A name refused outright leaves no audit line; one accepted is audited on one line.
    if code == 409 {
        assert!(
            log.contains(r#"rebuild "Orders\naudit: forged from 10.0.0.1: release all: done""#),
            "{log}"
        );
    } else {
        assert_eq!(code, 422, "{answer}");
    }
}
