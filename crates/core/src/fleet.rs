//! The fleet: which worker instances are running, what they run, and when they were last seen
//! (`docs/adr/0015-worker-fleet.md`).
//!
//! The fleet is a capability of its own, beside the stream leases: a backend that keeps one
//! implements [`Fleet`] (the instance's side) and [`FleetAdmin`] (the operators' listing).
//! `Fleet` extends [`StreamLocker`], because the keepalive that says "alive" is the keepalive
//! that renews the instance's leases, in one call.
//!
//! An instance **announces** itself once when it starts ([`Fleet::announce`]: its
//! [`InstanceId`] — the same id its stream leases are held by — a name, the host, the process
//! id, a version, the perspectives it runs and the token of the process). From then on the
//! keepalive it already runs for its leases also says it is alive ([`Fleet::keepalive`]: one
//! call per keepalive interval that renews the leases *and* refreshes the instance's
//! `last_seen_at`, for the announcement of the same token only), and a clean stop **departs**
//! ([`Fleet::depart`]). An instance that dies without departing is listed as
//! [`InstanceState::Stale`] once it has not been seen for its `stale_after` (the lock timeout
//! of its locker: by then its leases have expired too), and forgotten by the next announce of
//! any instance after [`FORGET_STALE_AFTER`].
//!
//! The operator's listing is [`FleetAdmin::list_instances`]. Both the in-memory locker of the
//! testkit and the PostgreSQL locker implement all of it and pass one conformance suite.

use std::fmt;
use std::sync::OnceLock;
use std::time::Duration;

use async_trait::async_trait;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::{Error, ErrorKind, Result, ValidationError};
use crate::ids::{InstanceId, PerspectiveName};
use crate::stream_lease::{LeaseId, RenewOutcome, StreamLockAdmin, StreamLocker};

/// How long an instance may go unseen before any instance's announce forgets it (one day): long
/// enough for an operator to see that an instance died, short enough that instances replaced
/// by a deployment do not pile up.
pub const FORGET_STALE_AFTER: Duration = Duration::from_secs(24 * 60 * 60);

/// What an instance says about itself when it starts. Every text is validated here, so a bad
/// value cannot reach the backend.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InstanceAnnouncement {
    /// The instance (the holder of its stream leases).
    pub instance: InstanceId,
    /// A name for people (e.g. `host:pid`, a pod name).
    pub name: String,
    /// The host it runs on.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// The version of the application (or of lockstep) it runs.
    pub version: String,
    /// The perspectives it runs, sorted, without duplicates.
    pub perspectives: Vec<PerspectiveName>,
    /// Which process announces: [`InstanceAnnouncement::process_token`] unless set
    /// ([`InstanceAnnouncement::with_token`]). An instance id names one running instance: an
    /// announce of an id whose announcement is live and carries another token is refused
    /// ([`InstanceInUse`]); the same token (a re-announce of the same process) replaces it.
    /// The keepalive and the depart carry it too, so a process whose id was taken over by
    /// another cannot mark the new owner's announcement seen nor remove it. The nil UUID when
    /// listed from a row announced without one.
    pub token: Uuid,
}

impl InstanceAnnouncement {
    /// The most characters a name, host or version may have.
    pub const MAX_TEXT_CHARS: usize = 200;

    /// An announcement of `instance`, called `name`, on `host` as process `pid`, running
    /// `version` and `perspectives` (sorted and deduplicated here). A blank text, one longer
    /// than [`Self::MAX_TEXT_CHARS`] or one with a NUL character is
    /// [`ErrorKind::InvalidInput`].
    pub fn new(
        instance: InstanceId,
        name: impl Into<String>,
        host: impl Into<String>,
        pid: u32,
        version: impl Into<String>,
        mut perspectives: Vec<PerspectiveName>,
    ) -> Result<InstanceAnnouncement> {
        let name = checked_text("instance name", name.into())?;
        let host = checked_text("instance host", host.into())?;
        let version = checked_text("instance version", version.into())?;
        perspectives.sort();
        perspectives.dedup();
        Ok(InstanceAnnouncement {
            instance,
            name,
            host,
            pid,
            version,
            perspectives,
            token: InstanceAnnouncement::process_token(),
        })
    }

    /// The token of this process: random, drawn once, the same for every announcement the
    /// process makes, so a process that announces again (its keepalive, after its row was
    /// forgotten) is told from a second process started with the same instance id.
    pub fn process_token() -> Uuid {
        static TOKEN: OnceLock<Uuid> = OnceLock::new();
        *TOKEN.get_or_init(Uuid::new_v4)
    }

    /// The same announcement, made with `token` instead of the process's: what a component
    /// that stands for a process of its own uses (tests that play two processes in one).
    #[must_use]
    pub fn with_token(mut self, token: Uuid) -> Self {
        self.token = token;
        self
    }
}

/// Why an announce was refused: the instance id is announced, live, by another process (another
/// [`InstanceAnnouncement::token`]). Two processes with one id would share one fleet row and
/// each hold every lease of the other re-entrantly, so the second one must not start. The
/// error is [`ErrorKind::Conflict`]; [`instance_in_use`] returns these details.
///
/// The other announcement is taken over once it is stale (not seen for `stale_after`, its
/// locker's lock timeout: its leases have expired by then too) or gone (a clean stop departs).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InstanceInUse {
    /// The instance id both processes were given.
    pub instance: InstanceId,
    /// The name the other process announced.
    pub name: String,
    /// Its host.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// How long ago it was last seen, on the backend's clock.
    pub since_seen: Duration,
    /// How long it may go unseen before it is stale and its announcement can be taken over.
    pub stale_after: Duration,
}

impl InstanceInUse {
    /// `instance` is announced by the process `name` on `host` as `pid`, seen `since_seen`
    /// ago, stale after `stale_after`.
    pub fn new(
        instance: InstanceId,
        name: impl Into<String>,
        host: impl Into<String>,
        pid: u32,
        since_seen: Duration,
        stale_after: Duration,
    ) -> InstanceInUse {
        InstanceInUse {
            instance,
            name: name.into(),
            host: host.into(),
            pid,
            since_seen,
            stale_after,
        }
    }

    /// The [`ErrorKind::Conflict`] error that carries it (its message says all of it).
    pub fn into_error(self) -> Error {
        Error::new(ErrorKind::Conflict, self.to_string()).with_cause_in_message(self)
    }
}

impl fmt::Display for InstanceInUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "instance {} is already running in another process: {:?} on host {:?}, pid {}, \
             seen {:.1} s ago. An instance id names one running process: give this one its \
             own id, or start it once that one has stopped (its announcement is taken over \
             {:.1} s after it was last seen)",
            self.instance,
            self.name,
            self.host,
            self.pid,
            self.since_seen.as_secs_f64(),
            self.stale_after.as_secs_f64(),
        )
    }
}

impl std::error::Error for InstanceInUse {}

/// The [`InstanceInUse`] behind an error, if that is why an announce was refused.
pub fn instance_in_use(err: &Error) -> Option<&InstanceInUse> {
    err.underlying()?.downcast_ref::<InstanceInUse>()
}

fn checked_text(field: &'static str, value: String) -> Result<String> {
    if value.trim().is_empty() {
        return Err(ValidationError::BlankText { field }.into());
    }
    if value.contains('\0') {
        return Err(ValidationError::ContainsNul { field }.into());
    }
    let chars = value.chars().count();
    if chars > InstanceAnnouncement::MAX_TEXT_CHARS {
        return Err(ValidationError::TextTooLong {
            field,
            chars,
            max: InstanceAnnouncement::MAX_TEXT_CHARS,
        }
        .into());
    }
    Ok(value)
}

/// What one [`Fleet::keepalive`] call did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeepaliveOutcome {
    /// The leases' renewals, in the order they were given.
    pub renewed: Vec<RenewOutcome>,
    /// Whether the instance's announcement, made with the keepalive's token, was found and
    /// marked seen. `false`: this process's announcement is not there — never made, forgotten
    /// or removed meanwhile (announce it again), or the id was taken over by another process
    /// (another token; announcing again is then refused with [`InstanceInUse`]). Nothing of
    /// the fleet changed.
    pub seen: bool,
}

impl KeepaliveOutcome {
    /// The outcome of renewing `renewed`, the instance `seen` or not.
    pub fn new(renewed: Vec<RenewOutcome>, seen: bool) -> KeepaliveOutcome {
        KeepaliveOutcome { renewed, seen }
    }
}

/// Whether an announced instance is still alive, as far as the backend can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstanceState {
    /// Seen within its `stale_after`.
    Live,
    /// Not seen for longer than its `stale_after`: it died, or cannot reach the backend.
    Stale,
}

impl InstanceState {
    /// `"live"` or `"stale"` (the CLI's and the page's words).
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceState::Live => "live",
            InstanceState::Stale => "stale",
        }
    }
}

/// One announced instance, as listed for operators.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerInstance {
    /// What it announced.
    pub announcement: InstanceAnnouncement,
    /// When it (last) announced itself, on the backend's clock.
    pub started_at: OffsetDateTime,
    /// When it was last seen (announce or keepalive), on the backend's clock.
    pub last_seen_at: OffsetDateTime,
    /// How long it may go unseen before it is stale (its locker's lock timeout).
    pub stale_after: Duration,
    /// How long ago it was last seen, on the backend's clock.
    pub since_seen: Duration,
    /// Live or stale.
    pub state: InstanceState,
}

impl WorkerInstance {
    /// The listing of `announcement`, started at `started_at`, last seen at `last_seen_at`
    /// (`since_seen` ago), stale after `stale_after`, in `state`.
    pub fn new(
        announcement: InstanceAnnouncement,
        started_at: OffsetDateTime,
        last_seen_at: OffsetDateTime,
        stale_after: Duration,
        since_seen: Duration,
        state: InstanceState,
    ) -> WorkerInstance {
        WorkerInstance {
            announcement,
            started_at,
            last_seen_at,
            stale_after,
            since_seen,
            state,
        }
    }

    /// Whether it is live.
    pub fn is_live(&self) -> bool {
        self.state == InstanceState::Live
    }

    /// Whether it runs `perspective`.
    pub fn runs(&self, perspective: &PerspectiveName) -> bool {
        self.announcement.perspectives.contains(perspective)
    }
}

/// A worker-instance row that cannot be read (a value written by hand outside lockstep, e.g. a
/// `last_seen_at` of `'infinity'`, a blank name, a perspective name that does not validate),
/// named by its id.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct UnreadableInstance {
    /// The instance id as stored (raw: it may itself be what cannot be read, the nil UUID).
    pub instance_id: uuid::Uuid,
    /// The name as stored, when it can be read as text (raw, unvalidated).
    pub name: Option<String>,
    /// What cannot be read, for people.
    pub problem: String,
}

impl UnreadableInstance {
    /// The row of `instance_id` (called `name` as stored, if readable) that cannot be read
    /// because of `problem`.
    pub fn new(
        instance_id: uuid::Uuid,
        name: Option<String>,
        problem: impl Into<String>,
    ) -> UnreadableInstance {
        UnreadableInstance {
            instance_id,
            name,
            problem: problem.into(),
        }
    }
}

/// One row of [`FleetAdmin::list_instance_entries`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InstanceEntry {
    /// An instance, read.
    Instance(WorkerInstance),
    /// A row that cannot be read.
    Unreadable(UnreadableInstance),
}

/// The instance's side of the fleet: announce, keepalive, depart. A stream locker that keeps a
/// fleet of worker instances implements it; one that does not simply does not (a worker given
/// only a [`StreamLocker`] runs unannounced).
///
/// Object safe: the worker holds an `Option<Arc<dyn Fleet>>`, and takes its leases through the
/// same object (`Arc<dyn Fleet>` converts to `Arc<dyn StreamLocker>`).
#[async_trait]
pub trait Fleet: StreamLocker {
    /// Announces a worker instance: inserts it, or replaces what the same process
    /// ([`InstanceAnnouncement::token`]) announced before under this id (its `started_at` is
    /// kept), seen now, stale after this locker's lock timeout. An id announced by another
    /// process (another token) is taken over once that announcement is stale (a new
    /// `started_at`); while it is live the announce is refused with [`ErrorKind::Conflict`]
    /// and [`InstanceInUse`] naming the other process, and nothing changes: an instance id
    /// names one running process. Instances not seen for [`FORGET_STALE_AFTER`] are forgotten
    /// on the way.
    async fn announce(&self, announcement: &InstanceAnnouncement) -> Result<()>;

    /// The keepalive of an announced instance: renews `leases` (as
    /// [`StreamLocker::renew_many`], outcomes in the order of `leases`, each fenced by its
    /// holder and epoch) and marks `instance` seen if its announcement carries `token`, **in
    /// one call** (one statement on Postgres), so that saying "alive" costs no statement of its
    /// own. `leases` may be empty (the instance holds none right now).
    ///
    /// An announcement of another token (the id was taken over by another process while this
    /// one was not seen) is left as it is, and [`KeepaliveOutcome::seen`] is `false`, as for an
    /// instance that is not announced.
    async fn keepalive(
        &self,
        instance: InstanceId,
        token: Uuid,
        leases: &[LeaseId],
    ) -> Result<KeepaliveOutcome>;

    /// Removes `instance`'s announcement if it carries `token` (a clean stop); `Ok(false)` when
    /// there was none, or when another process (another token) holds the id now.
    async fn depart(&self, instance: InstanceId, token: Uuid) -> Result<bool>;
}

/// The operators' side of the fleet: the listing of announced instances.
#[async_trait]
pub trait FleetAdmin: StreamLockAdmin {
    /// Every announced worker instance, live or stale (on the backend's clock), ordered by
    /// name, then id. Fails if one of them cannot be read; an operator's view that must show
    /// the others wants [`FleetAdmin::list_instance_entries`].
    async fn list_instances(&self) -> Result<Vec<WorkerInstance>>;

    /// Like [`FleetAdmin::list_instances`], but a row that cannot be read is an
    /// [`InstanceEntry::Unreadable`] entry, in its place and with its id, instead of failing the
    /// whole listing (it still fails when the listing itself cannot be read).
    ///
    /// The default lists [`FleetAdmin::list_instances`] as [`InstanceEntry::Instance`] entries:
    /// right for a backend that cannot hold an unreadable row (the in-memory fake cannot); the
    /// PostgreSQL locker overrides it, and wrappers forward it.
    async fn list_instance_entries(&self) -> Result<Vec<InstanceEntry>> {
        Ok(self
            .list_instances()
            .await?
            .into_iter()
            .map(InstanceEntry::Instance)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::typed;

    fn announce(name: &str, host: &str, version: &str) -> Result<InstanceAnnouncement> {
        InstanceAnnouncement::new(InstanceId::random(), name, host, 7, version, Vec::new())
    }

    #[test]
    fn texts_are_validated_and_perspectives_sorted() {
        assert_eq!(
            typed(announce(" ", "h", "1")),
            Err(ValidationError::BlankText {
                field: "instance name"
            })
        );
        assert_eq!(
            typed(announce("n", "h\0", "1")),
            Err(ValidationError::ContainsNul {
                field: "instance host"
            })
        );
        assert_eq!(
            typed(announce("n", "h", &"v".repeat(201))),
            Err(ValidationError::TextTooLong {
                field: "instance version",
                chars: 201,
                max: 200
            })
        );
        let (a, b) = (
            PerspectiveName::new("B").expect("valid"),
            PerspectiveName::new("A").expect("valid"),
        );
        let ok = InstanceAnnouncement::new(
            InstanceId::random(),
            "n",
            "h",
            1,
            "1",
            vec![a.clone(), b.clone(), a.clone()],
        )
        .expect("valid");
        assert_eq!(ok.perspectives, vec![b, a]);
    }

    // Compile-time check that the worker can keep these behind `dyn`, and take its leases
    // through the fleet.
    #[allow(dead_code)]
    fn object_safe(fleet: std::sync::Arc<dyn Fleet>, _: &dyn FleetAdmin) {
        let _: std::sync::Arc<dyn StreamLocker> = fleet;
    }
}
