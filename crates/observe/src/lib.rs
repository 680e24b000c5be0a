//! # lockstep-observe
//!
//! Observability as a layer: [`Observed`] wraps any implementation of a lockstep contract — the
//! Postgres backends and the testkit fakes alike — and reports every call as a `tracing` span
//! and as metrics, with the same names whatever the backend. Application code keeps depending
//! on the contracts; the composition root decides what to observe:
//!
//! ```
//! use std::sync::Arc;
//! use lockstep_core::{StreamLockOptions, StreamLocker};
//! use lockstep_observe::Observed;
//! use lockstep_testkit::InMemoryStreamLocker;
//!
//! let locker: Arc<dyn StreamLocker> =
//!     Arc::new(Observed::new(InMemoryStreamLocker::new(StreamLockOptions::default())));
//! # let _ = locker;
//! ```
//!
//! Wrapped contracts: [`StreamLocker`], [`StreamLockAdmin`], [`LeaseFence`],
//! [`Fleet`](lockstep_core::Fleet), [`FleetAdmin`](lockstep_core::FleetAdmin),
//! [`DistributedLock`] (and so the aggregate write lock built on it), [`EventStore`],
//! [`PerspectiveStore`](lockstep_core::PerspectiveStore) and [`TransactionSource`].
//!
//! # Metrics
//!
//! Through the `metrics` facade (install any recorder; without one they cost next to nothing).
//! Labels have fixed, small cardinality: `contract` and `op` are from the tables below,
//! `outcome` is `ok`, an outcome name (`acquired`, `taken_over` — an expired lease replaced,
//! which the backend reports in [`lockstep_core::StreamLease::took_over`] — `denied`, `busy`,
//! `no_cursor`, `renewed`, `lost`, `released`, `not_held`) or the [`lockstep_core::ErrorKind`]
//! of a failure. Backends emit no spans or metrics of their own: this layer is the one place
//! (ADR 0018). [`describe`] gives every family its `# HELP`; [`SECONDS_BUCKETS`] makes the
//! durations histograms.
//!
//! | constant | name | kind | labels |
//! |---|---|---|---|
//! | [`CALLS`] | `lockstep_calls_total` | counter | `contract`, `op`, `outcome` |
//! | [`CALL_SECONDS`] | `lockstep_call_duration_seconds` | histogram | `contract`, `op` |
//!
//! | `contract` | `op` |
//! |---|---|
//! | `stream_locker` | `try_acquire`, `renew`, `release`, `renew_many` |
//! | `stream_lock_admin` | `list_leases`, `list_lease_entries`, `inspect`, `force_release`, `release_all_held_by` |
//! | `fleet` | `announce`, `keepalive`, `depart` |
//! | `fleet_admin` | `list_instances`, `list_instance_entries` |
//! | `lease_fence` | `check_lease` |
//! | `distributed_lock` | `acquire_for_transaction`, `try_acquire_for_transaction` |
//! | `event_store` | `load`, `load_locked`, `append` |
//! | `perspective_store` | `claim_batch`, `commit_batch`, `claim`, `commit`, `pending_pairs`, `save_snapshot`, `purge`, `request_rewind`, `record_failure`, … (every method) |
//! | `transaction_source` | `begin` (commit and rollback are methods of the transaction guard, which the layer does not wrap: the contracts take the backend's own `Tx`) |
//!
//! # Spans
//!
//! One span per call, named after the operation (`try_acquire`, `append`, …), with the fixed
//! fields of the call that exist: `stream_id`, `perspective`, `reason`, `epoch`, `key`
//! (recorded with `Display`, never whole values). A failed call records an `error` event with
//! its kind inside the span.

#[cfg(feature = "prometheus")]
pub mod prometheus;

use std::future::Future;
use std::time::{Duration, Instant};

use lockstep_core::perspective_store::{
    CursorRows, PairWork, PerspectiveAdmin, PerspectiveLifecycle, PerspectiveReads, RewindReads,
    WorkQueue,
};
use lockstep_core::{
    AcquireOutcome, BatchClaim, BatchCommitted, BatchEntry, Claim, ClaimedBatch, Committed, Cursor,
    DistributedLock, EventPage, EventStore, ExpectedVersion, InstanceId, LeaseFence, LeaseId,
    LeaseInfo, LockReason, NewEvent, PageLimits, Pair, PairFailure, PendingPair, PerspectiveName,
    PerspectiveStatus, RecordedEvent, Release, ReleaseOutcome, RenewOutcome, ResourceKey, Result,
    RewindDebounce, RewindLoad, SkippedEvent, Snapshot, StateCommit, StreamId, StreamLockAdmin,
    StreamLockOptions, StreamLocker, TransactionSource, async_trait,
};
use tracing::Instrument;
use uuid::Uuid;

/// Calls per contract, operation and outcome.
pub const CALLS: &str = "lockstep_calls_total";
/// Call duration in seconds per contract and operation.
pub const CALL_SECONDS: &str = "lockstep_call_duration_seconds";

/// Histogram buckets for every lockstep metric in seconds (names ending in `_seconds`: call
/// durations, the worker's lag and rewind durations), from half a millisecond to an hour.
/// Give them to the exporter so that these export as histograms, which aggregate across
/// instances (summaries do not), e.g. with `metrics-exporter-prometheus`:
/// `PrometheusBuilder::new().set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)`.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0, 900.0, 3600.0,
];

/// Describes this layer's metric families (`# HELP`, units) to the installed recorder; call it
/// once after installing one, at the composition root.
pub fn describe() {
    metrics::describe_counter!(
        CALLS,
        "Calls of a lockstep contract, by contract, operation and outcome (ok, an outcome such \
         as acquired / taken_over / denied / busy, or the error kind)"
    );
    metrics::describe_histogram!(
        CALL_SECONDS,
        metrics::Unit::Seconds,
        "Duration of a call of a lockstep contract, by contract and operation"
    );
}

/// Wraps a contract implementation `T`, reporting spans and metrics for every call and
/// otherwise behaving exactly like `T`.
#[derive(Debug, Clone, Default)]
pub struct Observed<T> {
    inner: T,
}

impl<T> Observed<T> {
    /// Observes `inner`.
    pub fn new(inner: T) -> Self {
        Observed { inner }
    }

    /// The wrapped implementation.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    /// Unwraps it.
    pub fn into_inner(self) -> T {
        self.inner
    }
}

/// Runs `call` in `span`, then records its duration and outcome.
async fn observe<F, R>(
    contract: &'static str,
    op: &'static str,
    span: tracing::Span,
    outcome: fn(&R) -> &'static str,
    call: F,
) -> Result<R>
where
    F: Future<Output = Result<R>>,
{
    let started = Instant::now();
    let result = call.instrument(span.clone()).await;
    let label = match &result {
        Ok(value) => outcome(value),
        Err(err) => {
            span.in_scope(|| tracing::debug!(kind = %err.kind(), error = %err, "call failed"));
            kind_label(err.kind())
        }
    };
    metrics::counter!(CALLS, "contract" => contract, "op" => op, "outcome" => label).increment(1);
    metrics::histogram!(CALL_SECONDS, "contract" => contract, "op" => op)
        .record(secs(started.elapsed()));
    result
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn ok<R>(_: &R) -> &'static str {
    "ok"
}

fn kind_label(kind: lockstep_core::ErrorKind) -> &'static str {
    use lockstep_core::ErrorKind as K;
    match kind {
        K::InvalidInput => "invalid_input",
        K::LockTimeout => "lock_timeout",
        K::Cancelled => "cancelled",
        K::Deadlock => "deadlock",
        K::TransactionAborted => "transaction_aborted",
        K::ConnectionLost => "connection_lost",
        K::Conflict => "conflict",
        K::LeaseLost => "lease_lost",
        K::Unsupported => "unsupported",
        K::CommitUnknown => "commit_unknown",
        _ => "backend",
    }
}

fn acquire_label(o: &AcquireOutcome) -> &'static str {
    match o {
        // What only the backend knows travels in the outcome: a takeover of an expired lease.
        AcquireOutcome::Acquired(lease) if lease.took_over => "taken_over",
        AcquireOutcome::Acquired(_) => "acquired",
        AcquireOutcome::Denied(_) => "denied",
        AcquireOutcome::Busy => "busy",
        AcquireOutcome::NoCursor => "no_cursor",
    }
}

fn renew_label(o: &RenewOutcome) -> &'static str {
    if o.is_renewed() { "renewed" } else { "lost" }
}

fn release_label(o: &ReleaseOutcome) -> &'static str {
    if o.is_released() {
        "released"
    } else {
        "not_held"
    }
}

fn bool_label(acquired: &bool) -> &'static str {
    if *acquired { "acquired" } else { "busy" }
}

fn claim_label(c: &Claim) -> &'static str {
    match c {
        Claim::Apply { .. } => "apply",
        Claim::Rewind { .. } => "rewind",
        Claim::Busy => "busy",
        Claim::Unreadable { .. } => "unreadable",
        _ => "idle",
    }
}

fn lease_span(op: &'static str, id: &LeaseId) -> tracing::Span {
    tracing::info_span!(
        "lockstep",
        op,
        stream_id = %id.stream_id,
        perspective = %id.perspective,
        epoch = id.epoch.get(),
    )
}

fn pair_span(
    op: &'static str,
    stream_id: StreamId,
    perspective: &PerspectiveName,
) -> tracing::Span {
    tracing::info_span!("lockstep", op, stream_id = %stream_id, perspective = %perspective)
}

#[async_trait]
impl<T: StreamLocker> StreamLocker for Observed<T> {
    fn options(&self) -> StreamLockOptions {
        self.inner.options()
    }

    async fn try_acquire(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
        instance: InstanceId,
        reason: &LockReason,
    ) -> Result<AcquireOutcome> {
        let span = tracing::info_span!(
            "lockstep",
            op = "try_acquire",
            stream_id = %stream_id,
            perspective = %perspective,
            reason = %reason,
        );
        let call = self
            .inner
            .try_acquire(stream_id, perspective, instance, reason);
        observe("stream_locker", "try_acquire", span, acquire_label, call).await
    }

    async fn renew(&self, lease: &LeaseId) -> Result<RenewOutcome> {
        let span = lease_span("renew", lease);
        observe(
            "stream_locker",
            "renew",
            span,
            renew_label,
            self.inner.renew(lease),
        )
        .await
    }

    async fn release(&self, lease: &LeaseId) -> Result<ReleaseOutcome> {
        let span = lease_span("release", lease);
        observe(
            "stream_locker",
            "release",
            span,
            release_label,
            self.inner.release(lease),
        )
        .await
    }

    async fn renew_many(&self, leases: &[LeaseId]) -> Result<Vec<RenewOutcome>> {
        let span = tracing::info_span!("lockstep", op = "renew_many", leases = leases.len());
        observe(
            "stream_locker",
            "renew_many",
            span,
            ok,
            self.inner.renew_many(leases),
        )
        .await
    }
}

#[async_trait]
impl<T: StreamLockAdmin> StreamLockAdmin for Observed<T> {
    async fn list_leases(&self) -> Result<Vec<LeaseInfo>> {
        let span = tracing::info_span!("lockstep", op = "list_leases");
        observe(
            "stream_lock_admin",
            "list_leases",
            span,
            ok,
            self.inner.list_leases(),
        )
        .await
    }

    async fn list_lease_entries(&self) -> Result<Vec<lockstep_core::LeaseEntry>> {
        let span = tracing::info_span!("lockstep", op = "list_lease_entries");
        observe(
            "stream_lock_admin",
            "list_lease_entries",
            span,
            ok,
            self.inner.list_lease_entries(),
        )
        .await
    }

    async fn inspect(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<Option<lockstep_core::CursorLease>> {
        let span = pair_span("inspect", stream_id, perspective);
        let call = self.inner.inspect(stream_id, perspective);
        observe("stream_lock_admin", "inspect", span, ok, call).await
    }

    async fn force_release(
        &self,
        stream_id: StreamId,
        perspective: &PerspectiveName,
    ) -> Result<ReleaseOutcome> {
        let span = pair_span("force_release", stream_id, perspective);
        let call = self.inner.force_release(stream_id, perspective);
        observe(
            "stream_lock_admin",
            "force_release",
            span,
            release_label,
            call,
        )
        .await
    }

    async fn release_all_held_by(&self, instance: InstanceId) -> Result<u64> {
        let span =
            tracing::info_span!("lockstep", op = "release_all_held_by", instance = %instance);
        let call = self.inner.release_all_held_by(instance);
        observe("stream_lock_admin", "release_all_held_by", span, ok, call).await
    }
}

#[async_trait]
impl<T: lockstep_core::Fleet> lockstep_core::Fleet for Observed<T> {
    async fn announce(&self, announcement: &lockstep_core::InstanceAnnouncement) -> Result<()> {
        let span =
            tracing::info_span!("lockstep", op = "announce", instance = %announcement.instance);
        let call = self.inner.announce(announcement);
        observe("fleet", "announce", span, ok, call).await
    }

    async fn keepalive(
        &self,
        instance: InstanceId,
        token: lockstep_core::Uuid,
        leases: &[LeaseId],
    ) -> Result<lockstep_core::KeepaliveOutcome> {
        let span = tracing::info_span!(
            "lockstep",
            op = "keepalive",
            instance = %instance,
            leases = leases.len()
        );
        let call = self.inner.keepalive(instance, token, leases);
        observe("fleet", "keepalive", span, ok, call).await
    }

    async fn depart(&self, instance: InstanceId, token: lockstep_core::Uuid) -> Result<bool> {
        let span = tracing::info_span!("lockstep", op = "depart", instance = %instance);
        let call = self.inner.depart(instance, token);
        observe("fleet", "depart", span, ok, call).await
    }
}

#[async_trait]
impl<T: lockstep_core::FleetAdmin> lockstep_core::FleetAdmin for Observed<T> {
    async fn list_instances(&self) -> Result<Vec<lockstep_core::WorkerInstance>> {
        let span = tracing::info_span!("lockstep", op = "list_instances");
        let call = self.inner.list_instances();
        observe("fleet_admin", "list_instances", span, ok, call).await
    }

    async fn list_instance_entries(&self) -> Result<Vec<lockstep_core::InstanceEntry>> {
        let span = tracing::info_span!("lockstep", op = "list_instance_entries");
        let call = self.inner.list_instance_entries();
        observe("fleet_admin", "list_instance_entries", span, ok, call).await
    }
}

impl<Tx: ?Sized + Sync, T: LeaseFence<Tx>> LeaseFence<Tx> for Observed<T> {
    fn check_lease<'a>(
        &'a self,
        tx: &'a Tx,
        lease: &'a LeaseId,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let span = lease_span("check_lease", lease);
        observe(
            "lease_fence",
            "check_lease",
            span,
            ok,
            self.inner.check_lease(tx, lease),
        )
    }
}

impl<Tx: ?Sized + Sync, T: DistributedLock<Tx>> DistributedLock<Tx> for Observed<T> {
    fn acquire_for_transaction<'a>(
        &'a self,
        tx: &'a Tx,
        key: &'a ResourceKey,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "acquire_for_transaction", key = %key);
        let call = self.inner.acquire_for_transaction(tx, key, timeout);
        observe(
            "distributed_lock",
            "acquire_for_transaction",
            span,
            ok,
            call,
        )
    }

    fn try_acquire_for_transaction<'a>(
        &'a self,
        tx: &'a Tx,
        key: &'a ResourceKey,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "try_acquire_for_transaction", key = %key);
        let call = self.inner.try_acquire_for_transaction(tx, key);
        observe(
            "distributed_lock",
            "try_acquire_for_transaction",
            span,
            bool_label,
            call,
        )
    }
}

impl<Tx: ?Sized + Sync, T: EventStore<Tx>> EventStore<Tx> for Observed<T> {
    fn load<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
    ) -> impl Future<Output = Result<Vec<RecordedEvent>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "load", stream_id = %stream_id);
        observe(
            "event_store",
            "load",
            span,
            ok,
            self.inner.load(tx, stream_id),
        )
    }

    fn load_locked<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        key: &'a ResourceKey,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<Vec<RecordedEvent>>> + Send + 'a {
        let span =
            tracing::info_span!("lockstep", op = "load_locked", stream_id = %stream_id, key = %key);
        let call = self.inner.load_locked(tx, stream_id, key, timeout);
        observe("event_store", "load_locked", span, ok, call)
    }

    fn append<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &'a [NewEvent],
    ) -> impl Future<Output = Result<u64>> + Send + 'a {
        let span = tracing::info_span!(
            "lockstep",
            op = "append",
            stream_id = %stream_id,
            expected = %expected,
            events = events.len(),
        );
        let call = self.inner.append(tx, stream_id, expected, events);
        observe("event_store", "append", span, ok, call)
    }

    fn append_at_commit<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        expected: ExpectedVersion,
        events: &'a [NewEvent],
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let span = tracing::info_span!(
            "lockstep",
            op = "append_at_commit",
            stream_id = %stream_id,
            expected = %expected,
            events = events.len(),
        );
        let call = self.inner.append_at_commit(tx, stream_id, expected, events);
        observe("event_store", "append_at_commit", span, ok, call)
    }
}

impl<T: TransactionSource> TransactionSource for Observed<T> {
    type Tx = T::Tx;

    fn begin(&self) -> impl Future<Output = Result<T::Tx>> + Send {
        let span = tracing::info_span!("lockstep", op = "begin");
        observe("transaction_source", "begin", span, ok, self.inner.begin())
    }
}

impl<Tx: ?Sized + Sync, T: WorkQueue<Tx>> WorkQueue<Tx> for Observed<T> {
    fn claim_batch<'a>(
        &'a self,
        tx: &'a Tx,
        request: &'a BatchClaim,
    ) -> impl Future<Output = Result<ClaimedBatch>> + Send + 'a {
        let span =
            tracing::info_span!("lockstep", op = "claim_batch", pairs = request.limits.pairs);
        let call = self.inner.claim_batch(tx, request);
        observe("perspective_store", "claim_batch", span, ok, call)
    }

    fn commit_batch<'a>(
        &'a self,
        tx: &'a Tx,
        entries: &'a [BatchEntry],
    ) -> impl Future<Output = Result<Vec<BatchCommitted>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "commit_batch", entries = entries.len());
        let call = self.inner.commit_batch(tx, entries);
        observe("perspective_store", "commit_batch", span, ok, call)
    }

    fn record_failure<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        failure: &'a PairFailure,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        let span = pair_span("record_failure", pair.stream_id, &pair.perspective);
        let call = self.inner.record_failure(tx, pair, failure);
        observe("perspective_store", "record_failure", span, ok, call)
    }
}

impl<Tx: ?Sized + Sync, T: PairWork<Tx>> PairWork<Tx> for Observed<T> {
    fn claim<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        max_events: usize,
        debounce: RewindDebounce,
    ) -> impl Future<Output = Result<Claim>> + Send + 'a {
        let span = pair_span("claim", pair.stream_id, &pair.perspective);
        let call = self.inner.claim(tx, pair, max_events, debounce);
        observe("perspective_store", "claim", span, claim_label, call)
    }

    fn commit<'a>(
        &'a self,
        tx: Tx,
        commit: &'a StateCommit,
        release: Release,
    ) -> impl Future<Output = Result<Committed>> + Send + 'a
    where
        Tx: lockstep_core::Transaction,
    {
        let span = pair_span("commit", commit.pair.stream_id, &commit.pair.perspective);
        let call = self.inner.commit(tx, commit, release);
        observe("perspective_store", "commit", span, ok, call)
    }

    fn save_snapshot<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        expected_revision: i64,
        fence: Option<&'a LeaseId>,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        let span = pair_span("save_snapshot", pair.stream_id, &pair.perspective);
        let call = self.inner.save_snapshot(tx, pair, expected_revision, fence);
        observe("perspective_store", "save_snapshot", span, ok, call)
    }

    fn purge<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        fence: Option<&'a LeaseId>,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let span = pair_span("purge", pair.stream_id, &pair.perspective);
        let call = self.inner.purge(tx, pair, fence);
        observe("perspective_store", "purge", span, ok, call)
    }
}

impl<Tx: ?Sized + Sync, T: PerspectiveReads<Tx>> PerspectiveReads<Tx> for Observed<T> {
    fn cursor<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<Option<Cursor>>> + Send + 'a {
        let span = pair_span("cursor", pair.stream_id, &pair.perspective);
        let call = self.inner.cursor(tx, pair);
        observe("perspective_store", "cursor", span, ok, call)
    }

    fn state<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<Option<(Cursor, Option<serde_json_value::Value>)>>> + Send + 'a
    {
        let span = pair_span("state", pair.stream_id, &pair.perspective);
        let call = self.inner.state(tx, pair);
        observe("perspective_store", "state", span, ok, call)
    }

    fn pending_events<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<Vec<Uuid>>> + Send + 'a {
        let span = pair_span("pending_events", pair.stream_id, &pair.perspective);
        let call = self.inner.pending_events(tx, pair);
        observe("perspective_store", "pending_events", span, ok, call)
    }

    fn stream_events<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
        after: Option<Uuid>,
    ) -> impl Future<Output = Result<Vec<RecordedEvent>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "stream_events", stream_id = %stream_id);
        let call = self.inner.stream_events(tx, stream_id, after);
        observe("perspective_store", "stream_events", span, ok, call)
    }

    fn states<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: &'a PerspectiveName,
        after: Option<StreamId>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<lockstep_core::StoredState>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "states", perspective = %perspective);
        let call = self.inner.states(tx, perspective, after, limit);
        observe("perspective_store", "states", span, ok, call)
    }

    fn pending_through<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: &'a PerspectiveName,
        stream_id: Option<StreamId>,
        up_to: Uuid,
    ) -> impl Future<Output = Result<lockstep_core::PendingThrough>> + Send + 'a {
        let span =
            tracing::info_span!("lockstep", op = "pending_through", perspective = %perspective);
        let call = self
            .inner
            .pending_through(tx, perspective, stream_id, up_to);
        observe("perspective_store", "pending_through", span, ok, call)
    }

    fn skipped_events<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<Vec<SkippedEvent>>> + Send + 'a {
        let span = pair_span("skipped_events", pair.stream_id, &pair.perspective);
        let call = self.inner.skipped_events(tx, pair);
        observe("perspective_store", "skipped_events", span, ok, call)
    }
}

impl<Tx: ?Sized + Sync, T: RewindReads<Tx>> RewindReads<Tx> for Observed<T> {
    fn load_rewind<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        page: PageLimits,
    ) -> impl Future<Output = Result<Option<RewindLoad>>> + Send + 'a {
        let span = pair_span("load_rewind", pair.stream_id, &pair.perspective);
        let call = self.inner.load_rewind(tx, pair, page);
        observe("perspective_store", "load_rewind", span, ok, call)
    }

    fn rewind_events<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        after: Option<Uuid>,
        page: PageLimits,
    ) -> impl Future<Output = Result<EventPage>> + Send + 'a {
        let span = pair_span("rewind_events", pair.stream_id, &pair.perspective);
        let call = self.inner.rewind_events(tx, pair, after, page);
        observe("perspective_store", "rewind_events", span, ok, call)
    }

    fn snapshot_before<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        before: Uuid,
    ) -> impl Future<Output = Result<Option<Snapshot>>> + Send + 'a {
        let span = pair_span("snapshot_before", pair.stream_id, &pair.perspective);
        let call = self.inner.snapshot_before(tx, pair, before);
        observe("perspective_store", "snapshot_before", span, ok, call)
    }

    fn record_progress<'a>(
        &'a self,
        tx: &'a Tx,
        report: &'a lockstep_core::ProgressReport,
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let span = pair_span(
            "record_progress",
            report.pair.stream_id,
            &report.pair.perspective,
        );
        let call = self.inner.record_progress(tx, report);
        observe("perspective_store", "record_progress", span, ok, call)
    }
}

impl<Tx: ?Sized + Sync, T: PerspectiveAdmin<Tx>> PerspectiveAdmin<Tx> for Observed<T> {
    fn request_rewind<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        from: Option<Uuid>,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        let span = pair_span("request_rewind", pair.stream_id, &pair.perspective);
        let call = self.inner.request_rewind(tx, pair, from);
        observe("perspective_store", "request_rewind", span, ok, call)
    }

    fn perspective_status<'a>(
        &'a self,
        tx: &'a Tx,
    ) -> impl Future<Output = Result<Vec<PerspectiveStatus>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "perspective_status");
        let call = self.inner.perspective_status(tx);
        observe("perspective_store", "perspective_status", span, ok, call)
    }

    fn failing_pairs<'a>(
        &'a self,
        tx: &'a Tx,
        perspectives: &'a [PerspectiveName],
        limit: usize,
    ) -> impl Future<Output = Result<Vec<Cursor>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "failing_pairs", limit);
        let call = self.inner.failing_pairs(tx, perspectives, limit);
        observe("perspective_store", "failing_pairs", span, ok, call)
    }

    fn parked_pairs<'a>(
        &'a self,
        tx: &'a Tx,
        perspectives: &'a [PerspectiveName],
        limit: usize,
    ) -> impl Future<Output = Result<Vec<Cursor>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "parked_pairs", limit);
        let call = self.inner.parked_pairs(tx, perspectives, limit);
        observe("perspective_store", "parked_pairs", span, ok, call)
    }

    fn unpark<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        let span = pair_span("unpark", pair.stream_id, &pair.perspective);
        let call = self.inner.unpark(tx, pair);
        observe("perspective_store", "unpark", span, ok, call)
    }

    fn skip_event<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
        event_id: Uuid,
        reason: &'a str,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        let span = pair_span("skip_event", pair.stream_id, &pair.perspective);
        let call = self.inner.skip_event(tx, pair, event_id, reason);
        observe("perspective_store", "skip_event", span, ok, call)
    }

    fn rewind_progress<'a>(
        &'a self,
        tx: &'a Tx,
        perspectives: &'a [PerspectiveName],
        limit: usize,
    ) -> impl Future<Output = Result<Vec<lockstep_core::RewindProgress>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "rewind_progress");
        let call = self.inner.rewind_progress(tx, perspectives, limit);
        observe("perspective_store", "rewind_progress", span, ok, call)
    }
}

impl<Tx: ?Sized + Sync, T: lockstep_core::PerspectiveVersions<Tx>>
    lockstep_core::PerspectiveVersions<Tx> for Observed<T>
{
    fn declare<'a>(
        &'a self,
        tx: &'a Tx,
        versions: &'a [lockstep_core::VersionDeclaration],
    ) -> impl Future<Output = Result<Vec<lockstep_core::PerspectiveVersion>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "declare", versions = versions.len());
        let call = self.inner.declare(tx, versions);
        observe("perspective_store", "declare", span, ok, call)
    }

    fn versions<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: Option<&'a PerspectiveName>,
        lock: bool,
    ) -> impl Future<Output = Result<Vec<lockstep_core::PerspectiveVersion>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "versions", lock);
        let call = self.inner.versions(tx, perspective, lock);
        observe("perspective_store", "versions", span, ok, call)
    }

    fn set_version_status<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: &'a PerspectiveName,
        version: u32,
        status: lockstep_core::VersionStatus,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        let span = tracing::info_span!(
            "lockstep",
            op = "set_version_status",
            perspective = %perspective,
            version,
            status = status.as_str()
        );
        let call = self
            .inner
            .set_version_status(tx, perspective, version, status);
        observe("perspective_store", "set_version_status", span, ok, call)
    }

    fn request_promotion<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: &'a PerspectiveName,
        version: u32,
        force: bool,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        let span = tracing::info_span!(
            "lockstep",
            op = "request_promotion",
            perspective = %perspective,
            version,
            force
        );
        let call = self
            .inner
            .request_promotion(tx, perspective, version, force);
        observe("perspective_store", "request_promotion", span, ok, call)
    }
}

impl<Tx: ?Sized + Sync, T: PerspectiveLifecycle<Tx>> PerspectiveLifecycle<Tx> for Observed<T> {
    fn register<'a>(
        &'a self,
        tx: &'a Tx,
        perspectives: &'a [PerspectiveName],
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let span = tracing::info_span!(
            "lockstep",
            op = "register",
            perspectives = perspectives.len()
        );
        observe(
            "perspective_store",
            "register",
            span,
            ok,
            self.inner.register(tx, perspectives),
        )
    }

    fn retire<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: &'a PerspectiveName,
        states: lockstep_core::RetireStates,
    ) -> impl Future<Output = Result<lockstep_core::Retired>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "retire", perspective = %perspective);
        let call = self.inner.retire(tx, perspective, states);
        observe("perspective_store", "retire", span, ok, call)
    }

    fn retired<'a>(
        &'a self,
        tx: &'a Tx,
    ) -> impl Future<Output = Result<Vec<PerspectiveName>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "retired");
        observe(
            "perspective_store",
            "retired",
            span,
            ok,
            self.inner.retired(tx),
        )
    }

    fn rebuild<'a>(
        &'a self,
        tx: &'a Tx,
        perspective: &'a PerspectiveName,
    ) -> impl Future<Output = Result<lockstep_core::Rebuild>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "rebuild", perspective = %perspective);
        let call = self.inner.rebuild(tx, perspective);
        observe("perspective_store", "rebuild", span, ok, call)
    }

    fn record_applied<'a>(
        &'a self,
        tx: &'a Tx,
        counts: &'a [(PerspectiveName, u64)],
    ) -> impl Future<Output = Result<()>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "record_applied");
        let call = self.inner.record_applied(tx, counts);
        observe("perspective_store", "record_applied", span, ok, call)
    }

    fn throughput<'a>(
        &'a self,
        tx: &'a Tx,
    ) -> impl Future<Output = Result<Vec<lockstep_core::Throughput>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "throughput");
        observe(
            "perspective_store",
            "throughput",
            span,
            ok,
            self.inner.throughput(tx),
        )
    }
}

impl<Tx: ?Sized + Sync, T: CursorRows<Tx>> CursorRows<Tx> for Observed<T> {
    fn pending_pairs<'a>(
        &'a self,
        tx: &'a Tx,
        instance: InstanceId,
        perspectives: &'a [PerspectiveName],
        debounce: RewindDebounce,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<PendingPair>>> + Send + 'a {
        let span = tracing::info_span!("lockstep", op = "pending_pairs", limit);
        let call = self
            .inner
            .pending_pairs(tx, instance, perspectives, debounce, limit);
        observe("perspective_store", "pending_pairs", span, ok, call)
    }

    fn ensure_cursor<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        let span = pair_span("ensure_cursor", pair.stream_id, &pair.perspective);
        let call = self.inner.ensure_cursor(tx, pair);
        observe("perspective_store", "ensure_cursor", span, ok, call)
    }

    fn delete_cursor<'a>(
        &'a self,
        tx: &'a Tx,
        pair: &'a Pair,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        let span = pair_span("delete_cursor", pair.stream_id, &pair.perspective);
        let call = self.inner.delete_cursor(tx, pair);
        observe("perspective_store", "delete_cursor", span, ok, call)
    }
}

/// `serde_json::Value` through the core re-export (this crate does not depend on serde_json).
mod serde_json_value {
    pub(crate) use lockstep_core::serde_json::Value;
}
