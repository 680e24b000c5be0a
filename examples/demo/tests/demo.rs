//! The demo and the sample worker end to end, as processes: the demo in memory and on
//! PostgreSQL (leaving nothing behind), no password ever printed, bad arguments, the worker's
//! registration rule, its metrics endpoint, a clean stop on SIGTERM, descriptor exhaustion.

use std::process::{Command, Output};

use lockstep_core::EventStore as _;
use lockstep_core::Transaction as _;
use lockstep_core::{ExpectedVersion, NewEvent, StreamId};
use lockstep_pg::PgTransaction;
use lockstep_pg_store::PgEventStore;
use lockstep_testkit::pg_harness::{TestDatabase, test_database};

fn lockstep(args: &[&str], url: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lockstep-demo"));
    cmd.args(args).env_remove("DATABASE_URL");
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    cmd.output().expect("running lockstep-demo")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A URL for the test database (trust auth: no password).
fn url_of(db: &TestDatabase) -> String {
    let config = db.config();
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config.get_user().unwrap_or("postgres");
    format!("postgres://{user}@{host}:{port}/{}", db.name())
}

/// A migrated test database, its URL and a pool on it.
async fn migrated() -> (TestDatabase, String, deadpool_postgres::Pool) {
    let db = test_database().await;
    let url = url_of(&db);
    let pool = db.pool(4);
    lockstep_pg::PgDatabase::from_pool(pool.clone())
        .migrate()
        .await
        .expect("migrate");
    (db, url, pool)
}

#[test]
fn the_demo_passes_in_memory() {
    let out = lockstep(&[], None);
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    assert!(
        report.contains("All 1") && report.contains("checks passed"),
        "{report}"
    );
    assert!(!report.contains('✗'), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_passes_on_postgres_and_leaves_nothing_behind() {
    let db = test_database().await;
    let url = url_of(&db);
    let out = tokio::task::spawn_blocking(move || lockstep(&[], Some(&url)))
        .await
        .expect("task");
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    assert!(report.contains("nothing left behind"), "{report}");
    // The report names the database it created; it must be gone (other runs may have theirs).
    let created = report
        .split_whitespace()
        .find(|w| w.starts_with("lockstep_demo_"))
        .expect("the report names its database")
        .trim_end_matches([',', '.', ':'])
        .to_owned();
    let admin = db.connect().await;
    let left: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_database WHERE datname = $1",
            &[&created],
        )
        .await
        .expect("query")
        .get(0);
    assert_eq!(left, 0, "the demo database was dropped");
}

/// Issue 19, defect 3: no form a password can take in a URL shows in the demo's output.
#[test]
fn no_form_of_a_password_is_ever_printed() {
    const PARTS: [&str; 2] = ["Zq7Kx", "Wv9Pm"];
    let urls = [
        "postgres://app:Zq7KxWv9Pm@127.0.0.1:1/nowhere",
        "postgres://app@127.0.0.1:1/nowhere?password=Zq7KxWv9Pm",
        "postgresql://127.0.0.1:1/nowhere?user=app&password=Zq7KxWv9Pm",
        "host=127.0.0.1 port=1 user=app password = Zq7KxWv9Pm dbname=nowhere",
        "host=127.0.0.1 port=1 user=app password='Zq7Kx Wv9Pm' dbname=nowhere",
        "postgres://app:Zq7Kx@Wv9Pm@127.0.0.1:1/nowhere",
        "postgres://127.0.0.1:1/nowhere?password=Zq7Kx@Wv9Pm",
    ];
    for url in urls {
        for args in [&[][..], &["worker", "--register-sample"]] {
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
}

/// Bad arguments exit 2 with a message naming them, before anything connects or binds.
#[test]
fn bad_arguments_exit_2_with_a_clear_message() {
    let nil = uuid::Uuid::nil().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "worker",
                "--lock-timeout-ms",
                "1000",
                "--keepalive-ms",
                "900",
            ],
            "keepalive",
        ),
        (vec!["worker", "--lock-timeout-ms", "0"], "lock timeout"),
        (vec!["worker", "--instance", &nil], "--instance"),
        (
            vec!["worker", "--metrics-addr", "nonsense"],
            "--metrics-addr",
        ),
        (vec!["no-such-command"], "no-such-command"),
    ];
    for (args, names) in &cases {
        let out = lockstep(args, Some("postgres://app@127.0.0.1:1/nowhere"));
        let report = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {report}");
        assert!(report.contains(names), "{args:?}: {report}");
    }
    let out = lockstep(&["worker"], None);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("DATABASE_URL"), "{}", text(&out));
    let out = lockstep(&[], Some("not a url"));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
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

/// Issue 18: the sample worker never registers its perspective on a database unasked (once
/// registered, every event appended there queues work for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sample_worker_registers_nothing_unless_asked() {
    let (_db, url, pool) = migrated().await;
    let out = lockstep(&["worker"], Some(&url));
    let report = text(&out);
    assert_eq!(out.status.code(), Some(2), "{report}");
    assert!(report.contains("--register-sample"), "{report}");
    let client = pool.get().await.expect("connection");
    let registered: i64 = client
        .query_one("SELECT count(*) FROM wh_perspectives", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(registered, 0, "nothing registered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_process_serves_metrics_and_stops_gracefully_on_sigterm() {
    use std::io::{BufRead, BufReader};

    let (_db, url, pool) = migrated().await;
    let mut worker = Command::new(env!("CARGO_BIN_EXE_lockstep-demo"))
        .args([
            "worker",
            "--register-sample",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .env("DATABASE_URL", &url)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("starting lockstep-demo worker");
    // A failed assertion below must not leave the worker running (after its database is gone).
    let mut reaper = Reaper(Some(worker.id()));
    let mut lines = BufReader::new(worker.stdout.take().expect("stdout")).lines();
    let banner = tokio::task::spawn_blocking(move || {
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        (first, lines)
    })
    .await
    .expect("task");
    let (first, mut lines) = banner;
    let addr = first
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .expect("the metrics address is printed first")
        .to_owned();

    // An event for the sample perspective: the worker applies it and counts it.
    let stream = StreamId::new_v7();
    let event = NewEvent::new("Entered", serde_json::json!({ "amount": 7 })).expect("event");
    let mut applied = false;
    for _ in 0..100 {
        // Registration happens when the worker starts; append once it has.
        let client = pool.get().await.expect("connection");
        let registered: i64 = client
            .query_one(
                "SELECT count(*) FROM wh_perspectives WHERE perspective_name = 'Ledger'",
                &[],
            )
            .await
            .expect("query")
            .get(0);
        drop(client);
        if registered == 1 {
            let tx = PgTransaction::begin(&pool).await.expect("begin");
            PgEventStore::with_queue(lockstep_pg::LockQueue::new())
                .append(
                    &tx,
                    stream,
                    ExpectedVersion::NoStream,
                    std::slice::from_ref(&event),
                )
                .await
                .expect("append");
            tx.commit().await.expect("commit");
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    for _ in 0..100 {
        let addr = addr.clone();
        let (status, body) = tokio::task::spawn_blocking(move || http_get(&addr, "/metrics"))
            .await
            .expect("task");
        assert!(status.contains("200"), "{status}");
        let scrape = exposition(&body);
        if counter(&scrape, "lockstep_worker_events_applied_total") >= 1.0 {
            applied = true;
            // Observed at the composition root: the store's and the locker's calls are counted
            // by the one telemetry layer (the backends count nothing of their own).
            assert!(
                scrape
                    .samples
                    .iter()
                    .any(|s| s.metric == "lockstep_calls_total"
                        && s.labels.get("contract") == Some("perspective_store")),
                "{body}"
            );
            assert!(
                scrape
                    .samples
                    .iter()
                    .all(|s| !s.metric.starts_with("lockstep_stream_lease_")),
                "no backend counters of its own: {body}"
            );
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        applied,
        "the worker applied the event and reported it on /metrics"
    );

    reaper.0 = None;
    let pid = worker.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let status = tokio::task::spawn_blocking(move || worker.wait())
        .await
        .expect("task")
        .expect("wait");
    assert!(
        status.success(),
        "a SIGTERM stop is a clean exit: {status:?}"
    );
    let rest: Vec<String> = lines.by_ref().map_while(Result::ok).collect();
    assert!(
        rest.iter()
            .any(|l| l.contains("stopped; its leases are released")),
        "{rest:?}"
    );
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

/// Issue 19, defect 8: `worker --metrics-addr`, run with 64 file descriptors, goes on
/// serving after connections exhausted them (accept fails with EMFILE), and does not spin on the
/// failing accept meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_survive_descriptor_exhaustion_without_spinning() {
    use std::io::{BufRead, BufReader};
    use std::time::{Duration, Instant};

    let (_db, url, _pool) = migrated().await;
    {
        let args = [
            "worker",
            "--register-sample",
            "--metrics-addr",
            "127.0.0.1:0",
        ];
        let mut server = Command::new("sh")
            .arg("-c")
            .arg("ulimit -n 64 && exec \"$0\" \"$@\"")
            .arg(env!("CARGO_BIN_EXE_lockstep-demo"))
            .args(args)
            .env("DATABASE_URL", &url)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starting lockstep-demo");
        let pid = server.id();
        let mut stdout = BufReader::new(server.stdout.take().expect("stdout"));
        // Kept open (and so read to the end after the kill): the process writes more lines.
        let (line, stdout) = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            stdout.read_line(&mut line)?;
            // The worker prints its metrics address, then connects: wait until it runs.
            let mut running = String::new();
            stdout.read_line(&mut running)?;
            assert!(running.contains("running on"), "{running}");
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

/// Output into a pipe whose reader has gone (`lockstep-demo | head -n 1`) panicked in `println!`:
/// the command now runs to its end without a panic and with its own exit code.
#[test]
fn output_into_a_closed_pipe_does_not_panic() {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep-demo"))
        .env_remove("DATABASE_URL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting lockstep-demo");
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut first)
        .expect("the first line");
    // The reader is gone now (dropped with the BufReader).
    let out = child.wait_with_output().expect("lockstep-demo ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
}

/// Parses a `/metrics` body as Prometheus does, and checks the conventions: every family has
/// `# HELP` and `# TYPE`, none is a summary (durations and lags are histograms, which
/// aggregate across instances).
fn exposition(body: &str) -> prometheus_parse::Scrape {
    let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned())))
        .expect("a valid exposition");
    for sample in &scrape.samples {
        // A histogram's `_sum` and `_count` are samples of its family.
        let family = ["_sum", "_count", "_bucket"]
            .iter()
            .find_map(|suffix| sample.metric.strip_suffix(suffix))
            .filter(|family| scrape.docs.contains_key(*family))
            .unwrap_or(&sample.metric);
        assert!(
            scrape.docs.contains_key(family),
            "{} has no # HELP:\n{body}",
            sample.metric
        );
        assert!(
            !matches!(sample.value, prometheus_parse::Value::Summary(_)),
            "{} is a summary:\n{body}",
            sample.metric
        );
    }
    scrape
}

/// The sum of a counter's samples (0 when absent).
fn counter(scrape: &prometheus_parse::Scrape, name: &str) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
            _ => 0.0,
        })
        .sum()
}

/// Kills the process (SIGKILL) when dropped armed: a test that fails leaves no process behind.
struct Reaper(Option<u32>);

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}
