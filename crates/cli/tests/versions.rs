//! `lockstep perspectives versions | promote | abandon` end to end, the versions in
//! `perspectives status` (and its `--check`) and on the status page, against a database of the
//! test's own. A promotion is performed by a worker running the version, started in the test.

use std::time::Duration;

use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;
use lockstep_core::perspective_store::prelude::*;
use lockstep_core::{
    ExpectedVersion, InstanceId, NewEvent, Pair, PairFailure, PerspectiveName, PerspectiveRegistry,
    PerspectiveVersion, PreviousVersion, RecordedEvent, StreamId, VersionDeclaration,
    VersionPolicy, VersionStatus,
};
use lockstep_pg::{PgDatabase, PgTransaction};
use lockstep_pg_store::{PgEventStore, PgPerspectiveStore};
use lockstep_worker::{CancellationToken, PerspectiveWorker, WorkerOptions};

mod support;

use support::{doc, lockstep_on, migrated, serve_with, text};

fn statement() -> PerspectiveName {
    PerspectiveName::new("Statement").expect("valid")
}

/// Counts a stream's events; its version is the test's to choose.
struct Counted(u32);

impl lockstep_core::Perspective for Counted {
    type State = u64;
    type Error = std::convert::Infallible;

    fn name(&self) -> &str {
        "Statement"
    }

    fn version(&self) -> u32 {
        self.0
    }

    fn apply(&self, state: &mut u64, _: &RecordedEvent) -> Result<(), Self::Error> {
        *state += 1;
        Ok(())
    }
}

/// Records `Statement` version 1 (serving) and `versions` as a worker running them would
/// (manual promotion, the previous version kept), registers their stored names and appends
/// one event to a new stream: the stream.
async fn declared(pool: &deadpool_postgres::Pool, versions: &[u32]) -> StreamId {
    let manual = VersionPolicy::new()
        .manual()
        .previous(PreviousVersion::Keep);
    let mut declarations = vec![VersionDeclaration::new(
        statement(),
        1,
        VersionPolicy::new(),
    )];
    declarations.extend(
        versions
            .iter()
            .map(|v| VersionDeclaration::new(statement(), *v, manual)),
    );
    let names: Vec<PerspectiveName> = declarations
        .iter()
        .map(|d| d.stored_name().expect("a stored name"))
        .collect();
    let store = PgPerspectiveStore::new();
    let stream = StreamId::new_v7();
    let tx = PgTransaction::begin(pool).await.expect("begin");
    store.declare(&tx, &declarations).await.expect("declare");
    store.register(&tx, &names).await.expect("register");
    let event = NewEvent::new("Entered", serde_json::json!({ "amount": 1 })).expect("event");
    PgEventStore::with_queue(lockstep_pg::LockQueue::new())
        .append(&tx, stream, ExpectedVersion::NoStream, &[event])
        .await
        .expect("append");
    tx.commit().await.expect("commit");
    stream
}

/// The versions of `Statement` as stored.
async fn versions(pool: &deadpool_postgres::Pool) -> Vec<PerspectiveVersion> {
    let db = PgDatabase::from_pool(pool.clone());
    lockstep_worker::versions::versions(&db, &PgPerspectiveStore::new(), Some(&statement()))
        .await
        .expect("versions")
}

async fn status_of(pool: &deadpool_postgres::Pool, version: u32) -> Option<VersionStatus> {
    versions(pool)
        .await
        .iter()
        .find(|v| v.version == version)
        .map(|v| v.status)
}

/// The line of `out` that contains `needle`.
fn line_with<'a>(out: &'a str, needle: &str) -> &'a str {
    out.lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("a line with {needle:?} in: {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_lists_every_version_marks_the_serving_one_and_status_shows_them() {
    let (_db, url, pool) = migrated().await;
    let out = lockstep_on(&url, &["perspectives", "versions"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("no perspective versions recorded"),
        "{}",
        text(&out)
    );
    declared(&pool, &[2]).await;

    let out = lockstep_on(&url, &["perspectives", "versions"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    let v1 = line_with(&listing, " v1 ");
    assert!(v1.starts_with("* Statement"), "{listing}");
    assert!(v1.contains("SERVING"), "{listing}");
    assert!(v1.contains("automatic, previous retired"), "{listing}");
    let v2 = line_with(&listing, " v2 ");
    assert!(v2.starts_with("  Statement"), "{listing}");
    assert!(v2.contains("building"), "{listing}");
    assert!(v2.contains("Statement@v2"), "{listing}");
    assert!(v2.contains("manual, previous kept"), "{listing}");
    assert!(!v2.contains("SERVING"), "{listing}");

    let out = lockstep_on(&url, &["perspectives", "versions", "Statement", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let rows = doc(&out);
    let rows = rows.as_array().expect("an array");
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0]["perspective"], "Statement");
    assert_eq!(rows[0]["version"], 1);
    assert_eq!(rows[0]["stored_name"], "Statement");
    assert_eq!(rows[0]["status"], "serving");
    assert_eq!(rows[0]["serving"], true);
    assert_eq!(rows[0]["promotion"], "automatic");
    assert_eq!(rows[0]["previous"], "retire");
    assert_eq!(rows[1]["stored_name"], "Statement@v2");
    assert_eq!(rows[1]["status"], "building");
    assert_eq!(rows[1]["serving"], false);
    assert_eq!(rows[1]["promotion"], "manual");
    assert_eq!(rows[1]["previous"], "keep");
    assert_eq!(rows[1]["promotion_requested"], serde_json::Value::Null);
    assert_eq!(rows[1]["progress"]["pending_events"], 1);
    assert_eq!(rows[1]["progress"]["pairs"], 1);
    assert_eq!(rows[1]["progress"]["parked"], 0);
    assert!(rows[1]["progress"]["lag_s"].is_f64(), "{rows:?}");
    assert!(rows[1]["declared_at"].is_string(), "{rows:?}");

    let out = lockstep_on(&url, &["perspectives", "versions", "Ledger", "--json"]).await;
    assert_eq!(doc(&out), serde_json::json!([]), "{}", text(&out));

    let out = lockstep_on(&url, &["perspectives", "status"]).await;
    assert!(
        text(&out).contains(
            "versions of Statement: v1 SERVING (Statement); v2 building (Statement@v2): 1 \
             pending, lag "
        ),
        "{}",
        text(&out)
    );
    let out = lockstep_on(&url, &["perspectives", "status", "--json"]).await;
    let rows = doc(&out);
    let v2 = rows
        .as_array()
        .expect("an array")
        .iter()
        .find(|r| r["perspective"] == "Statement@v2")
        .expect("the stored name's row");
    assert_eq!(v2["version"]["perspective"], "Statement");
    assert_eq!(v2["version"]["version"], 2);
    assert_eq!(v2["version"]["status"], "building");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promote_with_no_worker_times_out_keeps_the_request_and_check_reports_it_once_stale() {
    let (_db, url, pool) = migrated().await;
    let stream = declared(&pool, &[2]).await;

    let out = lockstep_on(
        &url,
        &["perspectives", "promote", "Statement", "2", "--wait", "1"],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let said = text(&out);
    assert!(
        said.contains("Statement version 2 does not serve after 1 s"),
        "{said}"
    );
    assert!(said.contains("no live worker runs Statement@v2"), "{said}");
    assert!(said.contains("1 events pending"), "{said}");
    assert!(said.contains("The request is still recorded"), "{said}");
    let v2 = versions(&pool).await.into_iter().find(|v| v.version == 2);
    let v2 = v2.expect("version 2");
    assert_eq!(v2.status, VersionStatus::Building);
    assert!(v2.promotion_requested.is_some_and(|r| !r.force), "{v2:?}");

    let out = lockstep_on(
        &url,
        &[
            "perspectives",
            "promote",
            "Statement",
            "2",
            "--wait",
            "0",
            "--json",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(doc(&out)["outcome"], "requested");
    let out = lockstep_on(
        &url,
        &["perspectives", "promote", "Statement", "7", "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(doc(&out)["outcome"], "no_such_version");
    assert!(
        text(&out).contains("perspective Statement has no version 7"),
        "{}",
        text(&out)
    );
    let out = lockstep_on(&url, &["perspectives", "promote", "Statement", "0"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));

    // A request made a moment ago passes the check; the same request two minutes old fails it.
    let lenient = [
        "perspectives",
        "status",
        "--check",
        "--max-lag",
        "3600",
        "--max-unserved",
        "1000",
    ];
    let out = lockstep_on(&url, &lenient).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    pool.get()
        .await
        .expect("connection")
        .execute(
            "UPDATE wh_perspective_versions \
             SET promote_requested_at = clock_timestamp() - interval '2 minutes' \
             WHERE stored_name = 'Statement@v2'",
            &[],
        )
        .await
        .expect("backdate the request");
    let out = lockstep_on(&url, &lenient).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let said = text(&out);
    let unhealthy = line_with(&said, "UNHEALTHY Statement@v2: promotion_pending_s is 1");
    assert!(unhealthy.contains("(limit 60.0)"), "{said}");
    assert!(
        unhealthy.contains("the promotion of Statement version 2 was requested 12"),
        "{said}"
    );
    assert!(unhealthy.contains(" s ago and is not performed"), "{said}");
    assert!(
        unhealthy.contains("no live worker runs Statement@v2"),
        "{said}"
    );
    let mut json_args = lenient.to_vec();
    json_args.push("--json");
    let out = lockstep_on(&url, &json_args).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let answer = doc(&out);
    assert_eq!(answer["healthy"], false);
    assert_eq!(answer["failed"][0]["check"], "promotion_pending_s");
    assert_eq!(answer["failed"][0]["perspective"], "Statement@v2");
    assert_eq!(answer["versions"][1]["stored_name"], "Statement@v2");
    let mut patient = lenient.to_vec();
    patient.extend(["--max-promotion-wait", "3600"]);
    let out = lockstep_on(&url, &patient).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // A parked pair of the building version fails the check, saying it blocks the promotion.
    let store = PgPerspectiveStore::new();
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let parked = store
        .record_failure(
            &tx,
            &Pair::new(stream, statement().versioned(2).expect("v2")),
            &PairFailure::new("boom").park(true),
        )
        .await;
    parked.expect("park");
    tx.commit().await.expect("commit");
    let out = lockstep_on(&url, &patient).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains(
            "UNHEALTHY Statement@v2: parked is 1 (limit 0): Statement version 2 is building: \
             its parked pairs block its promotion"
        ),
        "{}",
        text(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandon_stops_a_version_and_refuses_the_serving_one() {
    let (_db, url, pool) = migrated().await;
    declared(&pool, &[2, 3]).await;

    let out = lockstep_on(&url, &["perspectives", "abandon", "Statement", "1"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains(
            "perspective Statement version 1 serves: promote another version first; nothing \
             was changed"
        ),
        "{}",
        text(&out)
    );
    assert_eq!(status_of(&pool, 1).await, Some(VersionStatus::Serving));
    let out = lockstep_on(
        &url,
        &["perspectives", "abandon", "Statement", "1", "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(doc(&out)["outcome"], "serving");

    let out = lockstep_on(&url, &["perspectives", "abandon", "Statement", "2"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out)
            .contains("Statement version 2 is abandoned: its work stopped, its states are dropped"),
        "{}",
        text(&out)
    );
    assert_eq!(status_of(&pool, 2).await, Some(VersionStatus::Abandoned));
    let out = lockstep_on(
        &url,
        &[
            "perspectives",
            "abandon",
            "Statement",
            "3",
            "--keep-states",
            "--json",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let answer = doc(&out);
    assert_eq!(answer["outcome"], "abandoned");
    assert_eq!(answer["states"], "kept");
    assert_eq!(status_of(&pool, 3).await, Some(VersionStatus::Abandoned));
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let kept = PgPerspectiveStore::new()
        .retired(&tx)
        .await
        .expect("retired");
    tx.rollback().await.expect("rollback");
    let kept: Vec<&str> = kept.iter().map(PerspectiveName::as_str).collect();
    assert!(kept.contains(&"Statement@v3"), "{kept:?}");
    assert!(!kept.contains(&"Statement@v2"), "{kept:?}");

    let out = lockstep_on(
        &url,
        &["perspectives", "abandon", "Statement", "2", "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(doc(&out)["outcome"], "already_abandoned");
    let out = lockstep_on(&url, &["perspectives", "promote", "Statement", "2"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("perspective Statement version 2 is abandoned: it cannot be promoted"),
        "{}",
        text(&out)
    );
    let out = lockstep_on(&url, &["perspectives", "versions", "--json"]).await;
    let rows = doc(&out);
    assert_eq!(rows[1]["status"], "abandoned");
    assert_eq!(rows[1]["progress"], serde_json::Value::Null);
}

/// Polls until `done` holds of the versions of `Statement`, for at most 30 s.
async fn until(
    pool: &deadpool_postgres::Pool,
    what: &str,
    done: impl Fn(&[PerspectiveVersion]) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let rows = versions(pool).await;
        if done(&rows) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within 30 s: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_running_the_version_performs_the_promotion_and_the_rollback() {
    let (_db, url, pool) = migrated().await;
    let mut registry = PerspectiveRegistry::new();
    registry.register(Counted(1)).expect("v1");
    registry
        .register_with(
            Counted(2),
            VersionPolicy::new()
                .manual()
                .previous(PreviousVersion::Keep),
        )
        .expect("v2");
    let worker = PerspectiveWorker::new(
        PgDatabase::from_pool(pool.clone()),
        PgPerspectiveStore::new(),
        registry,
        WorkerOptions::default().with_poll_interval(Duration::from_millis(50)),
        InstanceId::random(),
        None,
    )
    .expect("a worker");
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { worker.run(shutdown).await })
    };
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    for _ in 0..3 {
        let event = NewEvent::new("Entered", serde_json::json!({ "amount": 1 })).expect("event");
        PgEventStore::with_queue(lockstep_pg::LockQueue::new())
            .append(&tx, StreamId::new_v7(), ExpectedVersion::NoStream, &[event])
            .await
            .expect("append");
    }
    tx.commit().await.expect("commit");
    until(&pool, "the worker declares both versions", |rows| {
        rows.len() == 2 && rows[1].status == VersionStatus::Building
    })
    .await;

    let out = lockstep_on(
        &url,
        &["perspectives", "promote", "Statement", "2", "--wait", "30"],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("Statement version 2 serves"),
        "{}",
        text(&out)
    );
    assert_eq!(status_of(&pool, 2).await, Some(VersionStatus::Serving));
    assert_eq!(status_of(&pool, 1).await, Some(VersionStatus::Kept));
    assert!(
        versions(&pool)
            .await
            .iter()
            .all(|v| v.promotion_requested.is_none()),
        "the request is cleared once performed"
    );

    // The rollback: the kept version promoted again (its own policy retires the one it
    // replaces).
    let out = lockstep_on(
        &url,
        &[
            "perspectives",
            "promote",
            "Statement",
            "1",
            "--wait",
            "30",
            "--json",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(doc(&out)["outcome"], "serving");
    assert_eq!(status_of(&pool, 1).await, Some(VersionStatus::Serving));
    assert_eq!(status_of(&pool, 2).await, Some(VersionStatus::Retired));

    shutdown.cancel();
    running.await.expect("the worker task").expect("the worker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_the_versions_escaped() {
    use std::io::{Read, Write};
    let (_db, url, pool) = migrated().await;
    declared(&pool, &[2]).await;
    let tx = PgTransaction::begin(&pool).await.expect("begin");
    let odd = PerspectiveName::new("<b>Odd</b>").expect("valid");
    PgPerspectiveStore::new()
        .declare(
            &tx,
            &[VersionDeclaration::new(odd, 1, VersionPolicy::new())],
        )
        .await
        .expect("declare");
    tx.commit().await.expect("commit");

    let (mut server, addr) = serve_with(&url, &[], &[]).await;
    let get = |path: &str| {
        let mut stream = std::net::TcpStream::connect(&addr).expect("connect");
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )
        .expect("request");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("response");
        response
    };
    let page = tokio::task::block_in_place(|| get("/"));
    let api = tokio::task::block_in_place(|| get("/api/status"));
    let _ = server.kill();
    let _ = server.wait();

    assert!(page.contains("Perspective versions"), "{page}");
    assert!(
        page.contains("<td>Statement</td><td>v1</td><td><span class=\"ok serving\">serving</span>"),
        "{page}"
    );
    assert!(
        page.contains("<td>Statement</td><td>v2</td><td><span class=\"warn\">building</span></td><td>Statement@v2</td>"),
        "{page}"
    );
    assert!(page.contains("&lt;b&gt;Odd&lt;/b&gt;"), "{page}");
    assert!(!page.contains("<b>Odd</b>"), "{page}");
    assert!(page.contains("1 versions building"), "{page}");
    let body = api.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let status: serde_json::Value = serde_json::from_str(body).expect("JSON");
    assert_eq!(status["versions"][2]["stored_name"], "Statement@v2");
    assert_eq!(status["summary"]["versions_building"], 1);
}
