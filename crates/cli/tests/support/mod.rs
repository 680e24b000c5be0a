//! What the CLI's test files share: running the binary (with or without a database, off the
//! runtime's threads), its output as text or as one JSON document, a migrated test database and
//! its URL, and `lockstep serve` on a free port.

#![allow(dead_code, unreachable_pub)]

use std::process::{Command, Output};

use lockstep_testkit::pg_harness::{TestDatabase, test_database};

pub fn lockstep(args: &[&str], url: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lockstep"));
    cmd.args(args).env_remove("DATABASE_URL");
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    cmd.output().expect("running lockstep")
}

/// Runs `lockstep` with `args` on `url` off the runtime's threads.
pub async fn lockstep_on(url: &str, args: &[&str]) -> Output {
    let (url, args): (String, Vec<String>) = (
        url.to_owned(),
        args.iter().map(|a| (*a).to_owned()).collect(),
    );
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        lockstep(&args, Some(&url))
    })
    .await
    .expect("task")
}

pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

pub fn doc(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("one JSON document on stdout ({e}): {}", text(out)))
}

/// A URL for the test database (trust auth: no password).
pub fn url_of(db: &TestDatabase) -> String {
    let config = db.config();
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config.get_user().unwrap_or("postgres");
    format!("postgres://{user}@{host}:{port}/{}", db.name())
}

pub async fn migrated() -> (TestDatabase, String, deadpool_postgres::Pool) {
    let db = test_database().await;
    let url = url_of(&db);
    let out = lockstep(&["migrate"], Some(&url));
    assert!(out.status.success(), "{}", text(&out));
    let pool = db.pool(4);
    (db, url, pool)
}

/// `lockstep serve` on a free port with `envs` set (standard error piped): the process and the
/// address it printed.
pub async fn serve_with(
    url: &str,
    envs: &[(&str, &str)],
    args: &[&str],
) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader};
    let mut server = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["serve", "--addr", "127.0.0.1:0"])
        .args(args)
        .env("DATABASE_URL", url)
        .env_remove("LOCKSTEP_SERVE_TOKEN")
        .envs(envs.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting lockstep serve");
    let stdout = server.stdout.take().expect("stdout");
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).map(|_| line)
    })
    .await
    .expect("task")
    .expect("the serve banner");
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("the banner names the address: {line}"))
        .to_owned();
    (server, addr)
}
