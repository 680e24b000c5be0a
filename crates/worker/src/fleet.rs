//! How a worker instance names itself in the fleet ([`lockstep_core::fleet`],
//! `docs/adr/0015-worker-fleet.md`): [`InstanceIdentity`], given to
//! [`PerspectiveWorker::with_identity`](crate::PerspectiveWorker::with_identity) or detected.
//!
//! A worker given a fleet ([`PerspectiveWorker::with_fleet`](crate::PerspectiveWorker::with_fleet):
//! a stream locker that keeps one, as the Postgres and in-memory lockers do) announces itself
//! when [`run`](crate::PerspectiveWorker::run) starts (its instance id, this identity and the
//! perspectives it runs), says it is alive with the keepalive its
//! [`LeaseKeeper`](crate::LeaseKeeper) already sends once per interval (the same statement
//! renews its leases and marks it seen, if the announcement still carries this process's
//! token), and departs when `run` ends. A worker that is dropped or killed without stopping
//! leaves its announcement to go stale after the locker's lock timeout. A worker without a
//! fleet is not announced.
//!
//! An instance id names one running process: a worker whose id is announced, live, by another
//! process (another [`InstanceIdentity::token`]) refuses to start — `run` returns the
//! [`ErrorKind::Conflict`](lockstep_core::ErrorKind::Conflict) error of
//! [`InstanceInUse`](lockstep_core::InstanceInUse), which names that process's host and pid —
//! until that process stops or its announcement goes stale.
//!
//! ```
//! use lockstep_worker::InstanceIdentity;
//!
//! let identity = InstanceIdentity::detect()
//!     .with_name("orders-worker-0")
//!     .with_version(env!("CARGO_PKG_VERSION"));
//! assert_eq!(identity.name(), "orders-worker-0");
//! assert_eq!(identity.pid(), std::process::id());
//! ```

use lockstep_core::{InstanceAnnouncement, InstanceId, PerspectiveName, Result, Uuid};

/// What a worker instance says about itself besides its id and perspectives: a name for
/// people, the host, the process id and a version. Validated when it is given to a worker
/// ([`InstanceAnnouncement::new`]'s rules: not blank, at most 200 characters, no NUL).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceIdentity {
    name: String,
    host: String,
    pid: u32,
    version: String,
    token: Uuid,
}

impl InstanceIdentity {
    /// This process: the host name (`HOSTNAME`, else the kernel's, else `unknown-host`), the
    /// process id, the name `host:pid` and the version `lockstep-worker <version>`.
    pub fn detect() -> InstanceIdentity {
        let host = host_name();
        let pid = std::process::id();
        InstanceIdentity {
            name: format!("{host}:{pid}"),
            host,
            pid,
            version: format!("lockstep-worker {}", env!("CARGO_PKG_VERSION")),
            token: InstanceAnnouncement::process_token(),
        }
    }

    /// The same, called `name` (e.g. a pod name).
    #[must_use]
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The same, on `host`.
    #[must_use]
    pub fn with_host(mut self, host: impl Into<String>) -> Self {
        self.host = host.into();
        self
    }

    /// The same, running `version` (the application's, say).
    #[must_use]
    pub fn with_version(mut self, version: impl Into<String>) -> Self {
        self.version = version.into();
        self
    }

    /// The same, announcing with `token` instead of this process's
    /// ([`InstanceAnnouncement::process_token`]): for a worker that stands for a process of its
    /// own (a test that plays two processes in one).
    #[must_use]
    pub fn with_token(mut self, token: Uuid) -> Self {
        self.token = token;
        self
    }

    /// The token the announcement carries: which process announces
    /// ([`InstanceAnnouncement::token`]).
    pub fn token(&self) -> Uuid {
        self.token
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The host.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The version.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The announcement of `instance` running `perspectives` under this identity.
    pub fn announcement(
        &self,
        instance: InstanceId,
        perspectives: Vec<PerspectiveName>,
    ) -> Result<InstanceAnnouncement> {
        InstanceAnnouncement::new(
            instance,
            self.name.clone(),
            self.host.clone(),
            self.pid,
            self.version.clone(),
            perspectives,
        )
        .map(|a| a.with_token(self.token))
    }
}

impl Default for InstanceIdentity {
    fn default() -> Self {
        InstanceIdentity::detect()
    }
}

/// The host's name, trimmed and cut to what an announcement accepts; never fails.
fn host_name() -> String {
    let from_env = std::env::var("HOSTNAME").ok();
    let from_kernel = || {
        ["/proc/sys/kernel/hostname", "/etc/hostname"]
            .iter()
            .find_map(|path| std::fs::read_to_string(path).ok())
    };
    let name = from_env
        .filter(|h| !h.trim().is_empty())
        .or_else(from_kernel)
        .map(|h| h.trim().replace('\0', ""))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_owned());
    name.chars()
        .take(InstanceAnnouncement::MAX_TEXT_CHARS)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_detected_identity_makes_a_valid_announcement() {
        let identity = InstanceIdentity::detect();
        assert!(!identity.host().is_empty());
        assert!(
            identity
                .name()
                .ends_with(&format!(":{}", std::process::id()))
        );
        let a = identity
            .announcement(InstanceId::random(), Vec::new())
            .expect("valid");
        assert_eq!(a.pid, std::process::id());
    }

    #[test]
    fn a_blank_name_is_refused_when_announced() {
        let err = InstanceIdentity::detect()
            .with_name(" ")
            .announcement(InstanceId::random(), Vec::new())
            .expect_err("blank");
        assert_eq!(err.kind(), lockstep_core::ErrorKind::InvalidInput);
    }
}
