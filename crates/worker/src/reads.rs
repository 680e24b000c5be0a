//! Reading read models: typed states, pages of states, and waits until a perspective has
//! caught up with an append — so that a request handler can read its own write.
//!
//! [`ReadModels`] wraps the application's transaction source and perspective store (the same
//! ones the worker runs on, or clones of them) and reads through the store's contract
//! ([`lockstep_core::PerspectiveReads::state`], [`lockstep_core::PerspectiveReads::states`],
//! [`lockstep_core::PerspectiveReads::pending_through`]), so it works on Postgres and on the testkit's fakes
//! alike.
//!
//! - **The serving version**: every read and wait names a perspective and reads the version of
//!   it that serves ([`lockstep_core::perspective_version`]): the versions of the name are read
//!   first, in the read's transaction, then that version's rows. A read is of one version, the
//!   one serving when it began; a promotion switches every later read at once.
//!   [`ReadModels::serving_version`] says which one serves.
//! - **Typed reads**: [`ReadModels::state`] decodes a JSON perspective's state into its
//!   `State`; [`ReadModels::states`] pages through every stream's state in stream order (each
//!   page of one version: a paging loop across a promotion reads later pages from the new
//!   version).
//! - **Waits**: [`ReadModels::wait_for_stream`] returns once the pair has applied every event
//!   whose id is at most the given one (the last event of your append), and
//!   [`ReadModels::wait_for_perspective`] once every pair of the perspective has. Each wait is
//!   **bounded** by the timeout it is given, each check included ([`WaitError::TimedOut`],
//!   with what was still pending, and saying so when no live worker instance runs the
//!   perspective), ends at once when a pair it waits for is parked ([`WaitError::Parked`]: it
//!   will not catch up by itself) and when the perspective is not registered or is retired
//!   ([`WaitError::NotRegistered`], [`WaitError::Retired`]: no work is queued for it, so
//!   nothing it shows is ever pending, yet nothing is applied either), and is
//!   **cancel-safe**: dropping it mid-wait leaves nothing behind (each check is a read-only
//!   transaction, rolled back).
//! - The wait polls: one short read-only statement per check, starting 2 ms apart and backing
//!   off to [`WaitOptions::max_poll_interval`] (50 ms by default). Event-id order is the order
//!   perspectives apply in; an event of another stream with a smaller id (another process's
//!   clock, an import with chosen ids) counts as "before" for a perspective-wide wait.

use lockstep_core::Pair;
use std::time::Duration;

use lockstep_core::perspective_version::serving_name;
use lockstep_core::{
    Error, ErrorKind, PendingThrough, Perspective, PerspectiveName, PerspectiveStore, Registration,
    StreamId, TransactionSource,
};
use tokio::time::Instant;
use uuid::Uuid;

/// How waits poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct WaitOptions {
    /// The first pause between two checks (doubled after each, up to the maximum).
    pub first_poll_interval: Duration,
    /// The longest pause between two checks.
    pub max_poll_interval: Duration,
}

impl Default for WaitOptions {
    fn default() -> Self {
        WaitOptions {
            first_poll_interval: Duration::from_millis(2),
            max_poll_interval: Duration::from_millis(50),
        }
    }
}

impl WaitOptions {
    /// Polls starting `first` apart, backing off to at most `max` (a zero `first` is taken as
    /// 1 ms; a `max` below `first` as `first`).
    pub fn new(first: Duration, max: Duration) -> WaitOptions {
        let first = first.max(Duration::from_millis(1));
        WaitOptions {
            first_poll_interval: first,
            max_poll_interval: max.max(first),
        }
    }
}

/// Why a wait ended without the perspective having caught up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    /// The timeout passed first. `pending` is what was still not applied at the last check.
    #[error(
        "{perspective}{} has not applied every event up to {up_to} within {waited:?}: {} events and {} rewinds pending{}{}",
        stream_id.map(|s| format!(" (stream {s})")).unwrap_or_default(),
        pending.events,
        pending.rewinds,
        pending.error.as_ref().map(|e| format!("; last error: {e}")).unwrap_or_default(),
        if pending.live_workers == Some(0) {
            "; no live worker instance runs this perspective (none is announced in the fleet)"
        } else {
            ""
        }
    )]
    TimedOut {
        /// The perspective waited for.
        perspective: PerspectiveName,
        /// The stream, for a pair's wait.
        stream_id: Option<StreamId>,
        /// The event waited for.
        up_to: Uuid,
        /// How long it waited.
        waited: Duration,
        /// What was pending at the last check that ended ([`PendingThrough::default`] when
        /// none did in time); its `live_workers` says whether a live worker instance runs the
        /// perspective.
        pending: PendingThrough,
    },
    /// A pair holding the events waited for is parked: it will not catch up until an operator
    /// retries it, skips its failing event or requests a rewind.
    #[error(
        "{perspective}{} cannot catch up with {up_to}: {} parked pairs hold it{}",
        stream_id.map(|s| format!(" (stream {s})")).unwrap_or_default(),
        pending.parked,
        pending.error.as_ref().map(|e| format!(" (error: {e})")).unwrap_or_default()
    )]
    Parked {
        /// The perspective waited for.
        perspective: PerspectiveName,
        /// The stream, for a pair's wait.
        stream_id: Option<StreamId>,
        /// The event waited for.
        up_to: Uuid,
        /// What was pending.
        pending: PendingThrough,
    },
    /// The perspective is not registered (a misspelt name, or retired with its states
    /// dropped): no append queues work for it, so it would look caught up while nothing is
    /// applied.
    #[error(
        "{perspective} is not a registered perspective: nothing is applied for it, so there is \
         nothing to wait for (is the name right? has a worker running it registered it?)"
    )]
    NotRegistered {
        /// The perspective waited for.
        perspective: PerspectiveName,
    },
    /// The perspective is retired (its states kept): no append queues work for it until it is
    /// registered again, so its states do not follow the events.
    #[error(
        "{perspective} is retired: appends queue no work for it until it is registered again, \
         so there is nothing to wait for"
    )]
    Retired {
        /// The perspective waited for.
        perspective: PerspectiveName,
    },
    /// Reading from the store failed (bad input, the database).
    #[error(transparent)]
    Store(#[from] Error),
}

impl WaitError {
    /// The store error, when the wait failed on one.
    pub fn store_error(&self) -> Option<&Error> {
        match self {
            WaitError::Store(err) => Some(err),
            _ => None,
        }
    }

    /// Whether the wait timed out while no live worker instance ran the perspective (as the
    /// fleet of announced instances says): it will not catch up until one is started.
    pub fn no_live_worker(&self) -> bool {
        matches!(self, WaitError::TimedOut { pending, .. } if pending.live_workers == Some(0))
    }
}

/// Typed and waitable reads of read models; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct ReadModels<S, P> {
    source: S,
    store: P,
    options: WaitOptions,
}

impl<S, P> ReadModels<S, P>
where
    S: TransactionSource,
    P: PerspectiveStore<S::Tx>,
{
    /// Reads on transactions of `source` through `store`, waits polling as
    /// [`WaitOptions::default`].
    pub fn new(source: S, store: P) -> Self {
        ReadModels {
            source,
            store,
            options: WaitOptions::default(),
        }
    }

    /// The same, polling as `options`.
    pub fn with_options(mut self, options: WaitOptions) -> Self {
        self.options = options;
        self
    }

    /// The state of `stream_id` in `perspective`, decoded as its `State` (`None`: no event of
    /// the stream applied yet). A stored state that does not decode (the type changed:
    /// rebuild the perspective) is [`ErrorKind::InvalidInput`], naming the pair.
    pub async fn state<Pn: Perspective>(
        &self,
        perspective: &Pn,
        stream_id: StreamId,
    ) -> Result<Option<Pn::State>, Error> {
        let name = PerspectiveName::new(perspective.name())?;
        let tx = self.source.begin().await?;
        let read = match self.serving(&tx, &name).await {
            Ok(stored) => self.store.state(&tx, &Pair::new(stream_id, stored)).await,
            Err(err) => Err(err),
        };
        // Read only: a rollback that fails still ends it, and changes nothing.
        crate::worker::rollback(tx, "a read of a perspective state").await;
        match read? {
            Some((_, Some(state))) => decode::<Pn>(&name, stream_id, state).map(Some),
            _ => Ok(None),
        }
    }

    /// Up to `limit` (1 to [`lockstep_core::MAX_STATES_PAGE`]) states of `perspective`, in
    /// stream-id order, of the streams after `after` (from the first when `None`): pass the
    /// last stream of a page to read the next. Streams with no event applied are not listed.
    pub async fn states<Pn: Perspective>(
        &self,
        perspective: &Pn,
        after: Option<StreamId>,
        limit: usize,
    ) -> Result<Vec<(StreamId, Pn::State)>, Error> {
        let name = PerspectiveName::new(perspective.name())?;
        let tx = self.source.begin().await?;
        let read = match self.serving(&tx, &name).await {
            Ok(stored) => self.store.states(&tx, &stored, after, limit).await,
            Err(err) => Err(err),
        };
        // Read only: a rollback that fails still ends it, and changes nothing.
        crate::worker::rollback(tx, "a read of perspective states").await;
        read?
            .into_iter()
            .map(|stored| {
                let stream = stored.cursor.pair.stream_id;
                decode::<Pn>(&name, stream, stored.state).map(|state| (stream, state))
            })
            .collect()
    }

    /// The version of `perspective` that serves (`None`: no version is recorded, the
    /// perspective serves under its plain name as version 1, or is not registered).
    pub async fn serving_version(
        &self,
        perspective: &PerspectiveName,
    ) -> Result<Option<u32>, Error> {
        let tx = self.source.begin().await?;
        let read = self.store.versions(&tx, Some(perspective), false).await;
        crate::worker::rollback(tx, "a read of perspective versions").await;
        Ok(serving_name(perspective, &read?).0)
    }

    /// The name the serving version of `perspective` is stored under, read in `tx`.
    async fn serving(
        &self,
        tx: &S::Tx,
        perspective: &PerspectiveName,
    ) -> Result<PerspectiveName, Error> {
        let versions = self.store.versions(tx, Some(perspective), false).await?;
        Ok(serving_name(perspective, &versions).1)
    }

    /// What `perspective` (one stream of it) has not applied yet of the events up to `up_to`.
    pub async fn pending_through(
        &self,
        perspective: &PerspectiveName,
        stream_id: Option<StreamId>,
        up_to: Uuid,
    ) -> Result<PendingThrough, Error> {
        let tx = self.source.begin().await?;
        let read = match self.serving(&tx, perspective).await {
            Ok(stored) => {
                self.store
                    .pending_through(&tx, &stored, stream_id, up_to)
                    .await
            }
            Err(err) => Err(err),
        };
        // Read only: a rollback that fails still ends it, and changes nothing.
        crate::worker::rollback(tx, "a read of pending events").await;
        read
    }

    /// Waits until the pair `(stream_id, perspective)` has applied every event whose id is at
    /// most `up_to` (pass the last event id of your append), for at most `timeout`. A
    /// perspective that is not registered, or retired, is an error at once
    /// ([`WaitError::NotRegistered`], [`WaitError::Retired`]), never "caught up".
    pub async fn wait_for_stream(
        &self,
        perspective: &PerspectiveName,
        stream_id: StreamId,
        up_to: Uuid,
        timeout: Duration,
    ) -> Result<(), WaitError> {
        self.wait(perspective, Some(stream_id), up_to, timeout)
            .await
    }

    /// Waits until every pair of `perspective` has applied every event whose id is at most
    /// `up_to`, for at most `timeout`; a perspective that is not registered, or retired, is an
    /// error at once, as for [`ReadModels::wait_for_stream`].
    pub async fn wait_for_perspective(
        &self,
        perspective: &PerspectiveName,
        up_to: Uuid,
        timeout: Duration,
    ) -> Result<(), WaitError> {
        self.wait(perspective, None, up_to, timeout).await
    }

    async fn wait(
        &self,
        perspective: &PerspectiveName,
        stream_id: Option<StreamId>,
        up_to: Uuid,
        timeout: Duration,
    ) -> Result<(), WaitError> {
        let started = Instant::now();
        let deadline = started.checked_add(timeout);
        let mut pause = self.options.first_poll_interval;
        let mut last = PendingThrough::default();
        loop {
            // Each check is bounded by the time left too, but given at least the longest
            // pause (so that a wait of zero still checks once): a statement that waits for a
            // lock does not hold the wait past its timeout. Dropped, its transaction is rolled
            // back.
            let check = self.pending_through(perspective, stream_id, up_to);
            let checked = match deadline {
                Some(deadline) => {
                    let bound = Instant::now()
                        .checked_add(self.options.max_poll_interval)
                        .map_or(deadline, |least| deadline.max(least));
                    tokio::time::timeout_at(bound, check).await.ok()
                }
                None => Some(check.await),
            };
            let Some(pending) = checked else {
                let now = Instant::now();
                return Err(WaitError::TimedOut {
                    perspective: perspective.clone(),
                    stream_id,
                    up_to,
                    waited: now.saturating_duration_since(started),
                    pending: last,
                });
            };
            let pending = pending?;
            match pending.registration {
                Some(Registration::NotRegistered) => {
                    return Err(WaitError::NotRegistered {
                        perspective: perspective.clone(),
                    });
                }
                Some(Registration::Retired) => {
                    return Err(WaitError::Retired {
                        perspective: perspective.clone(),
                    });
                }
                _ => {}
            }
            if pending.is_caught_up() {
                return Ok(());
            }
            if pending.parked > 0 {
                return Err(WaitError::Parked {
                    perspective: perspective.clone(),
                    stream_id,
                    up_to,
                    pending,
                });
            }
            let now = Instant::now();
            // A timeout too large for the clock is no deadline.
            let left = deadline.map(|d| d.saturating_duration_since(now));
            if left == Some(Duration::ZERO) {
                return Err(WaitError::TimedOut {
                    perspective: perspective.clone(),
                    stream_id,
                    up_to,
                    waited: now.saturating_duration_since(started),
                    pending,
                });
            }
            let sleep = left.map_or(pause, |left| pause.min(left));
            last = pending;
            tokio::time::sleep(sleep).await;
            pause = (pause * 2).min(self.options.max_poll_interval);
        }
    }
}

fn decode<Pn: Perspective>(
    name: &PerspectiveName,
    stream_id: StreamId,
    state: serde_json::Value,
) -> Result<Pn::State, Error> {
    serde_json::from_value(state).map_err(|e| {
        Error::new(
            ErrorKind::InvalidInput,
            format!(
                "the stored state of {stream_id}/{name} does not decode as {}: rebuild the \
                 perspective after changing its state type",
                std::any::type_name::<Pn::State>()
            ),
        )
        .with_source(e)
    })
}
