//! The recording and fault-injecting stream-locker wrappers over the in-memory locker: without
//! faults they pass the stream-locker and lease-fence suites (as the hot path, the admin view
//! and the fence, and behind `dyn` as the worker holds a locker); with faults, fence checks and
//! admin calls fail as asked and never reach the locker; the record keeps error kinds.

use lockstep_core::Transaction as _;
use std::future::Future;
use std::time::Duration;

use lockstep_core::{
    ErrorKind, Fleet, InstanceId, LeaseFence, LockReason, PerspectiveName, ReleaseOutcome,
    StreamId, StreamLease, StreamLockAdmin, StreamLockOptions, StreamLocker,
};
use lockstep_testkit::conformance::lease_fence::LeaseFenceFixture;
use lockstep_testkit::conformance::stream_locker::{FleetFixture, StreamLockerFixture};
use lockstep_testkit::{
    FakeDatabase, FakeTransaction, FaultyStreamLocker, InMemoryStreamLocker, RecordingStreamLocker,
    StreamLockCall, StreamLockerFaults,
};

type Stack = RecordingStreamLocker<FaultyStreamLocker<InMemoryStreamLocker>>;

/// The wrappers (recording outside, faulty inside) over an in-memory locker with a database.
struct Wrapped {
    inner: InMemoryStreamLocker,
    stack: Stack,
    faults: StreamLockerFaults,
}

fn wrapped() -> Wrapped {
    let inner =
        InMemoryStreamLocker::with_database(StreamLockOptions::default(), &FakeDatabase::new());
    let (faulty, faults) = FaultyStreamLocker::new(inner.clone());
    Wrapped {
        inner,
        stack: RecordingStreamLocker::new(faulty),
        faults,
    }
}

/// The hot path behind `dyn`, as the worker holds it; the admin view and the fence concrete.
impl StreamLockerFixture for Wrapped {
    type Locker = dyn StreamLocker;
    type Admin = Stack;

    fn locker(&self) -> &(dyn StreamLocker + 'static) {
        &self.stack
    }

    fn admin(&self) -> &Stack {
        &self.stack
    }

    fn create_cursor(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> impl Future<Output = ()> + Send {
        self.inner.create_cursor(stream_id, perspective);
        std::future::ready(())
    }
}

/// The fleet behind `dyn`, as the worker holds it; its admin view concrete.
impl FleetFixture for Wrapped {
    type Fleet = dyn Fleet;
    type FleetAdmin = Stack;

    fn fleet(&self) -> &(dyn Fleet + 'static) {
        &self.stack
    }

    fn fleet_admin(&self) -> &Stack {
        &self.stack
    }
}

impl LeaseFenceFixture for Wrapped {
    type Tx = FakeTransaction;
    type Source = FakeDatabase;
    type Fence = Stack;

    fn fence(&self) -> &Stack {
        &self.stack
    }

    fn source(&self) -> &FakeDatabase {
        self.inner.database().expect("built with a database")
    }
}

mod the_wrappers_without_faults_pass_the_stream_locker_suite {
    use super::*;

    lockstep_testkit::stream_locker_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: wrapped(),
        after_each: |fixture: &Wrapped| {
            let calls = fixture.stack.calls();
            assert!(!calls.is_empty(), "every call goes through the recording wrapper");
            assert!(fixture.stack.lease_checks().is_empty(), "the suite does not fence");
        },
    }
}

mod the_wrappers_without_faults_pass_the_fleet_suite {
    use super::*;

    lockstep_testkit::fleet_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: wrapped(),
        after_each: |fixture: &Wrapped| {
            assert!(!fixture.stack.calls().is_empty(), "every call goes through the recording wrapper");
        },
    }
}

mod the_wrappers_without_faults_pass_the_lease_fence_suite {
    use super::*;

    lockstep_testkit::lease_fence_conformance! {
        #[tokio::test(start_paused = true)]
        fixture: wrapped(),
        after_each: |fixture: &Wrapped| {
            assert!(!fixture.stack.lease_checks().is_empty(), "every case fences");
            let db = fixture.inner.database().expect("database");
            assert!(db.is_idle(), "no cursor-row lock outlives its transaction");
        },
    }
}

async fn leased(fixture: &Wrapped) -> StreamLease {
    let (stream, name) = (StreamId::new_v7(), PerspectiveName::new("P").expect("name"));
    fixture.inner.create_cursor(stream, &name);
    fixture
        .stack
        .try_acquire(stream, &name, InstanceId::random(), &LockReason::Rewind)
        .await
        .expect("acquire")
        .into_lease()
        .expect("acquired")
}

#[tokio::test(start_paused = true)]
async fn injected_lease_check_failures_never_reach_the_locker_and_are_recorded_by_kind() {
    let fixture = wrapped();
    let lease = leased(&fixture).await;
    let db = fixture.inner.database().expect("database");

    fixture
        .faults
        .fail_next_lease_checks(1, ErrorKind::LeaseLost);
    let tx = db.begin_now();
    let err = fixture
        .stack
        .check_lease(&tx, &lease.id)
        .await
        .expect_err("injected");
    assert_eq!(err.kind(), ErrorKind::LeaseLost);
    assert!(
        db.is_idle(),
        "the locker never saw the check: no row locked"
    );
    tx.rollback().await.expect("rollback");

    // One fault per call: the next check goes through and locks the cursor row.
    let tx = db.begin_now();
    fixture
        .stack
        .check_lease(&tx, &lease.id)
        .await
        .expect("the holder passes the fence");
    assert_eq!(
        db.held_keys().len(),
        1,
        "the row is locked until the commit"
    );
    tx.commit().await.expect("commit");
    assert!(db.is_idle());

    assert_eq!(
        fixture.stack.lease_checks(),
        vec![
            (lease.id.clone(), Err(ErrorKind::LeaseLost)),
            (lease.id.clone(), Ok(())),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn injected_admin_failures_change_nothing_and_the_next_call_goes_through() {
    let fixture = wrapped();
    let lease = leased(&fixture).await;
    let (stream, name) = (lease.id.stream_id, lease.id.perspective.clone());

    fixture
        .faults
        .fail_next_admin_calls(2, ErrorKind::ConnectionLost);
    let err = fixture
        .stack
        .force_release(stream, &name)
        .await
        .expect_err("injected");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost);
    let err = fixture
        .stack
        .release_all_held_by(lease.id.holder)
        .await
        .expect_err("injected");
    assert_eq!(err.kind(), ErrorKind::ConnectionLost);
    let state = fixture
        .stack
        .inspect(stream, &name)
        .await
        .expect("inspect")
        .expect("cursor row");
    assert_eq!(state.holder, Some(lease.id.holder), "nothing was released");
    assert_eq!(
        fixture.stack.unreleased(),
        vec![lease.id.clone()],
        "failed release-alls release nothing"
    );

    fixture.faults.set_latency(Duration::from_secs(2));
    let before = tokio::time::Instant::now();
    assert_eq!(
        fixture
            .stack
            .release_all_held_by(lease.id.holder)
            .await
            .expect("release all"),
        1
    );
    assert!(
        before.elapsed() >= Duration::from_secs(2),
        "latency on tokio's clock"
    );
    assert!(
        fixture.stack.unreleased().is_empty(),
        "released by release_all_held_by"
    );
    fixture.faults.clear();
    assert_eq!(
        fixture
            .stack
            .force_release(stream, &name)
            .await
            .expect("force"),
        ReleaseOutcome::NotHeld
    );
    let listed = fixture.stack.list_leases().await.expect("list");
    assert!(listed.is_empty());

    let admin_calls: Vec<_> = fixture
        .stack
        .calls()
        .into_iter()
        .filter(|c| !matches!(c, StreamLockCall::TryAcquire { .. }))
        .collect();
    assert_eq!(
        admin_calls,
        vec![
            StreamLockCall::ForceRelease {
                stream_id: stream,
                perspective: name.clone(),
                outcome: Err(ErrorKind::ConnectionLost),
            },
            StreamLockCall::ReleaseAllHeldBy {
                instance: lease.id.holder,
                outcome: Err(ErrorKind::ConnectionLost),
            },
            StreamLockCall::Inspect {
                stream_id: stream,
                perspective: name.clone(),
                outcome: Ok(Some(state)),
            },
            StreamLockCall::ReleaseAllHeldBy {
                instance: lease.id.holder,
                outcome: Ok(1),
            },
            StreamLockCall::ForceRelease {
                stream_id: stream,
                perspective: name,
                outcome: Ok(ReleaseOutcome::NotHeld),
            },
            StreamLockCall::ListLeases {
                outcome: Ok(vec![])
            },
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_fenced_unit_of_work_is_rolled_back_when_the_fence_reports_the_lease_lost() {
    // Domain code generic over the fence, as an application writes it.
    async fn rebuild<F: LeaseFence<FakeTransaction>>(
        db: &FakeDatabase,
        fence: &F,
        lease: &StreamLease,
    ) -> lockstep_core::Result<()> {
        let tx = db.begin_now();
        // ... rebuild the read model on `tx` ...
        fence.check_lease(&tx, &lease.id).await?;
        tx.commit().await
    }

    let fixture = wrapped();
    let lease = leased(&fixture).await;
    let db = fixture.inner.database().expect("database").clone();
    fixture
        .faults
        .fail_next_lease_checks(1, ErrorKind::LeaseLost);
    let err = rebuild(&db, &fixture.stack, &lease)
        .await
        .expect_err("fenced out");
    assert_eq!(err.kind(), ErrorKind::LeaseLost);
    rebuild(&db, &fixture.stack, &lease)
        .await
        .expect("the holder commits once the fence passes");
    assert!(db.is_idle());
}

/// An admin view whose whole listing fails but whose entry listing answers, as the Postgres
/// locker does when one row cannot be read.
struct EntriesOnly;

#[lockstep_core::async_trait]
impl StreamLockAdmin for EntriesOnly {
    async fn list_leases(&self) -> lockstep_core::Result<Vec<lockstep_core::LeaseInfo>> {
        Err(lockstep_core::Error::new(
            ErrorKind::Backend,
            "a lease row cannot be read",
        ))
    }

    async fn list_lease_entries(&self) -> lockstep_core::Result<Vec<lockstep_core::LeaseEntry>> {
        Ok(Vec::new())
    }

    async fn inspect(
        &self,
        _stream_id: StreamId,
        _perspective: &PerspectiveName,
    ) -> lockstep_core::Result<Option<lockstep_core::CursorLease>> {
        Ok(None)
    }

    async fn force_release(
        &self,
        _stream_id: StreamId,
        _perspective: &PerspectiveName,
    ) -> lockstep_core::Result<ReleaseOutcome> {
        Ok(ReleaseOutcome::NotHeld)
    }

    async fn release_all_held_by(&self, _instance: InstanceId) -> lockstep_core::Result<u64> {
        Ok(0)
    }
}

/// The recording and the faulty wrapper forward `list_lease_entries` to the wrapped view (the
/// default would list through `list_leases` and fail on the row it cannot read), and the
/// recording records it.
#[tokio::test]
async fn the_wrappers_forward_the_entry_listing() {
    let task = tokio::spawn(async {
        let (faulty, _faults) = FaultyStreamLocker::new(EntriesOnly);
        let recording = RecordingStreamLocker::new(faulty);
        let entries = recording
            .list_lease_entries()
            .await
            .expect("the wrapped view's entry listing");
        assert!(entries.is_empty());
        assert!(matches!(
            recording.calls().as_slice(),
            [StreamLockCall::ListLeaseEntries { outcome: Ok(listed) }] if listed.is_empty()
        ));
    });
    task.await.expect("the task ran");
}
