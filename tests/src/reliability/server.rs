//! A private PostgreSQL 15 cluster for the fault scenarios that must stop the server
//! ([`super::faults`], [`super::failover`]): `initdb` into a temporary directory, `pg_ctl start`
//! on a free port of 127.0.0.1 with its Unix socket in that directory, `stop -m fast` or `-m
//! immediate`, restart on the same port, a streaming standby made with `pg_basebackup` and its
//! promotion, and removal (stop + delete) on drop. The shared server at 5432 is never touched.
//!
//! `initdb` refuses to run as root, so when this process is root every PostgreSQL program runs
//! as the `postgres` OS user (`runuser -u postgres --`) and the directory is handed to that user
//! first. The binaries are looked up in `$LOCKSTEP_PG_BINDIR`, then
//! `/usr/lib/postgresql/15/bin`, then `PATH`; [`PrivateServer::start`] fails with a clear error
//! when there is no `initdb` (the caller decides whether that is a skip or a violation).
//!
//! The cluster runs with `fsync = off`: a stopped or killed *server* loses nothing committed
//! (the WAL is written before a commit is acknowledged and the OS keeps it), only an OS crash
//! would, and the scenarios never crash the OS.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio_postgres::Config;

/// Where the PostgreSQL 15 programs usually live on Debian and Ubuntu.
const DEBIAN_BINDIR: &str = "/usr/lib/postgresql/15/bin";
/// The environment variable naming another directory of PostgreSQL programs.
pub const BINDIR_ENV: &str = "LOCKSTEP_PG_BINDIR";
/// How long one `pg_ctl` call may take (its own `-t` is shorter; this bounds a wedged call).
const PG_CTL_LIMIT: Duration = Duration::from_secs(60);

/// How to stop the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// `-m fast`: backends are terminated (`57P01`), the server shuts down cleanly.
    Fast,
    /// `-m immediate`: every server process is killed at once; crash recovery at the next start.
    Immediate,
}

impl StopMode {
    fn flag(self) -> &'static str {
        match self {
            StopMode::Fast => "fast",
            StopMode::Immediate => "immediate",
        }
    }
}

/// A running (or stopped) private cluster; dropped, it is stopped and its directory removed.
#[derive(Debug)]
pub struct PrivateServer {
    dir: PathBuf,
    bindir: PathBuf,
    port: u16,
    as_postgres: bool,
    running: bool,
    /// Settings given at every start (`-c name=value`), besides the fixed ones.
    settings: Vec<(String, String)>,
}

impl PrivateServer {
    /// `initdb` a fresh cluster into a temporary directory and start it on a free port.
    pub async fn start() -> anyhow::Result<PrivateServer> {
        PrivateServer::start_with(&[]).await
    }

    /// [`PrivateServer::start`] with `settings` given at every start (`name`, `value`; the
    /// value must not need shell quoting).
    pub async fn start_with(settings: &[(&str, &str)]) -> anyhow::Result<PrivateServer> {
        let mut server = PrivateServer::empty(settings).await?;
        let data = server.data_dir();
        let out = run(server.command("initdb").arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
        ]))
        .await?;
        check(&out, "initdb")?;
        server.start_on_a_free_port().await?;
        Ok(server)
    }

    /// A streaming standby of `primary`: `pg_basebackup` of it (with `standby.signal`), its
    /// `primary_conninfo` naming it `application_name` (what `synchronous_standby_names`
    /// matches), started on `port` (a free one when `None`) with `settings`.
    pub async fn standby_of(
        primary: &PrivateServer,
        application_name: &str,
        port: Option<u16>,
        settings: &[(&str, &str)],
    ) -> anyhow::Result<PrivateServer> {
        let mut server = PrivateServer::empty(settings).await?;
        let out = run(server
            .command("pg_basebackup")
            .arg("-D")
            .arg(server.data_dir())
            .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
            .args([
                "-U",
                "postgres",
                "-X",
                "stream",
                "-R",
                "--no-sync",
                "--checkpoint=fast",
            ]))
        .await?;
        check(&out, "pg_basebackup")?;
        // `-R` wrote a primary_conninfo without an application name; a later line wins.
        let auto_conf = server.data_dir().join("postgresql.auto.conf");
        let mut conf = std::fs::read_to_string(&auto_conf)
            .with_context(|| format!("reading {}", auto_conf.display()))?;
        conf.push_str(&format!(
            "primary_conninfo = 'host=127.0.0.1 port={} user=postgres \
             application_name={application_name}'\n",
            primary.port
        ));
        std::fs::write(&auto_conf, conf)
            .with_context(|| format!("writing {}", auto_conf.display()))?;
        match port {
            Some(port) => {
                server.port = port;
                server.start_again().await?;
            }
            None => server.start_on_a_free_port().await?,
        }
        Ok(server)
    }

    /// Promotes a standby to a primary (`pg_ctl promote`, waiting until it accepts writes).
    pub async fn promote(&mut self) -> anyhow::Result<()> {
        let out = run(self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .args(["-w", "-t", "30", "promote"]))
        .await?;
        check(&out, "pg_ctl promote")
    }

    /// A directory of its own (handed to `postgres` when this process is root), no cluster yet.
    async fn empty(settings: &[(&str, &str)]) -> anyhow::Result<PrivateServer> {
        let bindir = find_bindir().with_context(|| {
            format!(
                "no initdb found (looked in ${BINDIR_ENV}, {DEBIAN_BINDIR} and PATH): cannot \
                 start a private PostgreSQL server"
            )
        })?;
        let dir =
            std::env::temp_dir().join(format!("lockstep-faults-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let server = PrivateServer {
            dir,
            bindir,
            port: 0,
            as_postgres: is_root(),
            running: false,
            settings: settings
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        };
        if server.as_postgres {
            let out = run(tokio::process::Command::new("chown")
                .arg("postgres:postgres")
                .arg(&server.dir))
            .await?;
            check(&out, "chown postgres of the server directory")?;
        }
        Ok(server)
    }

    /// Starts the cluster on a free port: one can be taken by someone else before the server
    /// binds it, so a few are tried.
    async fn start_on_a_free_port(&mut self) -> anyhow::Result<()> {
        let mut last = None;
        for _ in 0..3 {
            self.port = free_port()?;
            match self.start_again().await {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("the private server did not start")))
    }

    /// The TCP port the server listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Connection settings for the `postgres` database as user `postgres` (trust).
    pub fn config(&self) -> Config {
        let mut config = Config::new();
        config
            .host("127.0.0.1")
            .port(self.port)
            .user("postgres")
            .dbname("postgres")
            .connect_timeout(Duration::from_secs(5));
        config
    }

    /// Whether the server was started and not stopped since.
    pub fn is_running(&self) -> bool {
        self.running
    }

    /// Stops the server (`pg_ctl stop -m <mode>`, waiting for it).
    pub async fn stop(&mut self, mode: StopMode) -> anyhow::Result<()> {
        let out = run(self.command("pg_ctl").arg("-D").arg(self.data_dir()).args([
            "-m",
            mode.flag(),
            "-w",
            "-t",
            "30",
            "stop",
        ]))
        .await?;
        check(&out, "pg_ctl stop")?;
        self.running = false;
        Ok(())
    }

    /// Starts the (stopped) server again on the same port.
    pub async fn start_again(&mut self) -> anyhow::Result<()> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off \
             -c max_connections=60 -c shared_buffers=16MB",
            self.port,
            self.dir.display()
        );
        let options = self
            .settings
            .iter()
            .fold(options, |options, (name, value)| {
                format!("{options} -c {name}={value}")
            });
        let out = run(self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .arg("-l")
            .arg(self.dir.join("server.log"))
            .args(["-w", "-t", "30", "-o", &options, "start"]))
        .await?;
        if let Err(e) = check(&out, "pg_ctl start") {
            return Err(e.context(format!("server log: {}", self.log_tail())));
        }
        self.running = true;
        Ok(())
    }

    /// Stops the server with `mode`, keeps it down for `downtime`, starts it again.
    pub async fn restart(&mut self, mode: StopMode, downtime: Duration) -> anyhow::Result<()> {
        self.stop(mode).await?;
        tokio::time::sleep(downtime).await;
        self.start_again().await
    }

    /// The last lines of the server log, for error messages.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(8)..].join(" | ")
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// A PostgreSQL program, run as the `postgres` OS user when this process is root.
    fn command(&self, program: &str) -> tokio::process::Command {
        let path = self.bindir.join(program);
        if self.as_postgres {
            let mut command = tokio::process::Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(path);
            command
        } else {
            tokio::process::Command::new(path)
        }
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        // Blocking on purpose: drop may run outside any runtime, and the server must be gone
        // before its directory is.
        let path = self.bindir.join("pg_ctl");
        let mut command = if self.as_postgres {
            let mut command = std::process::Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(path);
            command
        } else {
            std::process::Command::new(path)
        };
        let stopped = command
            .arg("-D")
            .arg(self.data_dir())
            .args(["-m", "immediate", "-w", "-t", "20", "stop"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        if self.running && !stopped.is_ok_and(|s| s.success()) {
            eprintln!(
                "lockstep-tests: could not stop the private server in {}",
                self.dir.display()
            );
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!(
                "lockstep-tests: could not remove {}: {e}",
                self.dir.display()
            );
        }
    }
}

/// The directory holding `initdb` and `pg_ctl`, if any.
fn find_bindir() -> Option<PathBuf> {
    let has_initdb = |dir: &Path| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file();
    if let Some(dir) = std::env::var_os(BINDIR_ENV).map(PathBuf::from) {
        return has_initdb(&dir).then_some(dir);
    }
    let debian = PathBuf::from(DEBIAN_BINDIR);
    if has_initdb(&debian) {
        return Some(debian);
    }
    std::env::split_paths(&std::env::var_os("PATH")?).find(|dir| has_initdb(dir))
}

/// Whether this process runs as root (the owner of `/proc/self`; not root if unknown).
fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// A port of 127.0.0.1 that was free a moment ago.
fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding a free port")?;
    Ok(listener.local_addr()?.port())
}

/// Runs a command to its end, bounded by [`PG_CTL_LIMIT`] (killed if it takes longer).
async fn run(command: &mut tokio::process::Command) -> anyhow::Result<Output> {
    command.kill_on_drop(true);
    let what = format!("{:?}", command.as_std());
    match tokio::time::timeout(PG_CTL_LIMIT, command.output()).await {
        Ok(out) => out.with_context(|| format!("running {what}")),
        Err(_) => bail!("{what} did not finish within {PG_CTL_LIMIT:?}"),
    }
}

/// A failed command as an error carrying its output.
fn check(out: &Output, what: &str) -> anyhow::Result<()> {
    if out.status.success() {
        return Ok(());
    }
    bail!(
        "{what} failed ({}): {} {}",
        out.status,
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    )
}
