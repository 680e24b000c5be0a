//! The session-lock conformance suite: locks held by a guard (not by a transaction), exclusive
//! across sessions and against transaction-scoped locks on the same key, released by
//! `release()` or by dropping the guard.
//!
//! It runs on any [`DistributedLockFixture`] whose lock also offers [`SessionLocks`] (the
//! Postgres lock and the fake both do), since one case checks that the two scopes exclude each
//! other.
//!
//! Run it with [`session_lock_conformance!`](crate::session_lock_conformance) (one test per
//! case), or call the cases or [`run_all`] yourself.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::{DistributedLock, ErrorKind, ResourceKey, SessionLockGuard, SessionLocks};

use super::distributed_lock::DistributedLockFixture;

/// A [`DistributedLockFixture`] whose lock also offers session locks (implemented for every
/// such fixture).
pub trait SessionLockFixture: DistributedLockFixture<Lock: SessionLocks<Guard: 'static>> {}

impl<F> SessionLockFixture for F where F: DistributedLockFixture<Lock: SessionLocks<Guard: 'static>> {}

fn fresh_key() -> ResourceKey {
    ResourceKey::new(format!("conformance:session:{}", uuid::Uuid::new_v4())).expect("valid key")
}

async fn try_session<L: SessionLocks>(locks: &L, key: &ResourceKey) -> Option<L::Guard> {
    locks
        .try_acquire_session(key)
        .await
        .expect("try_acquire_session")
}

/// Polls until `key` can be taken by a new session (at most 5 s): the release of a dropped
/// guard may be asynchronous (Postgres ends the backend).
async fn eventually_free<L: SessionLocks>(locks: &L, key: &ResourceKey) -> L::Guard {
    for _ in 0..100 {
        if let Some(guard) = try_session(locks, key).await {
            return guard;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{key} was not released within 5 s");
}

/// A held session lock excludes other sessions until released; then it is free at once.
pub async fn session_lock_excludes_other_sessions_until_released<F: SessionLockFixture>(
    fixture: Arc<F>,
) {
    let locks = fixture.lock();
    let key = fresh_key();
    let guard = locks.acquire_session(&key, None).await.expect("acquire");
    assert_eq!(guard.key(), &key);
    assert!(
        try_session(locks, &key).await.is_none(),
        "another session is denied"
    );
    guard.release().await.expect("release");
    let again = try_session(locks, &key).await.expect("free after release");
    again.release().await.expect("release");
}

/// Dropping a guard gives the lock up.
pub async fn dropping_a_session_guard_releases_the_lock<F: SessionLockFixture>(fixture: Arc<F>) {
    let locks = fixture.lock();
    let key = fresh_key();
    let guard = try_session(locks, &key).await.expect("free");
    drop(guard);
    eventually_free(locks, &key)
        .await
        .release()
        .await
        .expect("release");
}

/// Session and transaction-scoped locks on one key exclude each other, both ways.
pub async fn session_and_transaction_locks_exclude_each_other<F: SessionLockFixture>(
    fixture: Arc<F>,
) {
    let locks = fixture.lock();
    let key = fresh_key();
    let guard = try_session(locks, &key).await.expect("free");
    let tx = super::begin(fixture.source()).await;
    assert!(
        !locks
            .try_acquire_for_transaction(&tx, &key)
            .await
            .expect("try"),
        "a transaction is denied while a session holds the key"
    );
    guard.release().await.expect("release");
    assert!(
        locks
            .try_acquire_for_transaction(&tx, &key)
            .await
            .expect("try")
    );
    assert!(
        try_session(locks, &key).await.is_none(),
        "a session is denied while a transaction holds the key"
    );
    super::commit(tx).await.expect("commit");
    let after = try_session(locks, &key).await.expect("free after commit");
    after.release().await.expect("release");
}

/// A blocking session acquire with a timeout fails with `LockTimeout`; the holder keeps the
/// lock.
pub async fn session_acquire_with_timeout_fails_with_lock_timeout<F: SessionLockFixture>(
    fixture: Arc<F>,
) {
    let locks = fixture.lock();
    let key = fresh_key();
    let guard = try_session(locks, &key).await.expect("free");
    let err = locks
        .acquire_session(&key, Some(Duration::from_millis(100)))
        .await
        .map(drop)
        .expect_err("times out");
    assert_eq!(err.kind(), ErrorKind::LockTimeout, "{err}");
    assert!(try_session(locks, &key).await.is_none(), "still held");
    guard.release().await.expect("release");
}

/// A session timeout longer than Postgres's `lock_timeout` can hold (`i32::MAX`
/// milliseconds) is `InvalidInput` before anything is locked; the longest accepted one works.
pub async fn a_session_timeout_beyond_what_postgres_accepts_is_invalid_input<
    F: SessionLockFixture,
>(
    fixture: Arc<F>,
) {
    let locks = fixture.lock();
    let key = fresh_key();
    let longest = Duration::from_millis(i32::MAX as u64);
    for too_long in [longest + Duration::from_micros(1), Duration::MAX] {
        let err = locks
            .acquire_session(&key, Some(too_long))
            .await
            .map(drop)
            .expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert!(err.validation().is_some(), "typed: {err}");
    }
    let guard = locks
        .acquire_session(&key, Some(longest))
        .await
        .expect("the longest timeout is accepted");
    guard.release().await.expect("release");
}

/// A blocking session acquire waits while the key is held (still pending 200 ms later) and
/// completes once the holder releases (within 5 s).
pub async fn blocking_session_acquire_completes_once_released<F: SessionLockFixture>(
    fixture: Arc<F>,
) {
    let key = fresh_key();
    let guard = try_session(fixture.lock(), &key).await.expect("free");
    let waiter = {
        let (fixture, key) = (Arc::clone(&fixture), key.clone());
        tokio::spawn(async move { fixture.lock().acquire_session(&key, None).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiter.is_finished(),
        "the waiter is still waiting 200 ms later"
    );
    guard.release().await.expect("release");
    let granted = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter completes within 5 s of the release")
        .expect("task")
        .expect("the waiter holds the lock");
    assert!(try_session(fixture.lock(), &key).await.is_none());
    granted.release().await.expect("release");
}

/// Different keys never block each other.
pub async fn session_locks_on_different_keys_never_block<F: SessionLockFixture>(fixture: Arc<F>) {
    let locks = fixture.lock();
    let a = try_session(locks, &fresh_key()).await.expect("free");
    let b = locks
        .acquire_session(&fresh_key(), Some(Duration::from_secs(5)))
        .await
        .expect("a free key is acquired at once");
    a.release().await.expect("release");
    b.release().await.expect("release");
}

/// Runs every case, in order, in one test. Prefer
/// [`session_lock_conformance!`](crate::session_lock_conformance): a test per case.
pub async fn run_all<F: SessionLockFixture>(fixture: Arc<F>) {
    crate::__lockstep_session_lock_cases!(__lockstep_conformance_run_all! { by_arc fixture });
}

#[doc(hidden)]
#[macro_export]
macro_rules! __lockstep_session_lock_cases {
    ($then:ident ! { $($args:tt)* }) => {
        $crate::$then! { $($args)* cases: [
            session_lock_excludes_other_sessions_until_released,
            dropping_a_session_guard_releases_the_lock,
            session_and_transaction_locks_exclude_each_other,
            session_acquire_with_timeout_fails_with_lock_timeout,
            a_session_timeout_beyond_what_postgres_accepts_is_invalid_input,
            blocking_session_acquire_completes_once_released,
            session_locks_on_different_keys_never_block,
        ] }
    };
}

/// Expands to one test per case of the [session-lock conformance
/// suite](crate::conformance::session_lock), each on a fixture of its own.
///
/// `fixture:` is an expression evaluated inside each test (it may `.await`) that yields a
/// [`SessionLockFixture`](crate::conformance::session_lock::SessionLockFixture); the test wraps it in an `Arc`.
/// Attributes written first replace the default `#[tokio::test]`:
/// `#[tokio::test(start_paused = true)]` for the fakes,
/// `#[tokio::test(flavor = "multi_thread")]` for a database. `after_each:` (optional) is a
/// closure called with `&fixture` after the case passed, to check what the case left behind.
/// See [`stream_locker_conformance!`](crate::stream_locker_conformance) for what the calling
/// crate needs. Not covered by semver (see [`conformance`](crate::conformance)).
///
/// ```
/// mod fake {
///     use lockstep_testkit::{FakeDatabase, FakeDistributedLock};
///
///     lockstep_testkit::session_lock_conformance! {
///         #[tokio::test(start_paused = true)]
///         fixture: FakeDistributedLock::new(&FakeDatabase::new()),
///     }
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! session_lock_conformance {
    ($(#[$attr:meta])+ fixture: $fixture:expr $(, after_each: $after:expr)? $(,)?) => {
        $crate::__lockstep_session_lock_cases!(__lockstep_conformance_tests! {
            suite: session_lock,
            pass: by_arc,
            attrs: [$(#[$attr])+],
            fixture: $fixture,
            after_each: [$($after)?],
        });
    };
    (fixture: $($rest:tt)*) => {
        $crate::session_lock_conformance! { #[::tokio::test] fixture: $($rest)* }
    };
}
