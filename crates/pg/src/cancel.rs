//! Ending a server-side wait that nobody awaits any more.
//!
//! tokio-postgres sends nothing when a query future is dropped: the backend keeps waiting for
//! the lock (and would get it, holding it for a caller that is gone). [`CancelOnDrop`] is armed
//! around a waiting statement; if it is dropped before being disarmed, it sends a cancel request
//! for that connection from a spawned task, and the wait ends with `57014 query_canceled`. The
//! request is sent again after short delays (up to 2 s after the drop, then the task ends),
//! because a cancel that reaches the server before the statement is ignored (see
//! `CANCEL_SCHEDULE` and ADR 0003).
//!
//! A cancel request travels on a new connection to the server, which must be made like the
//! pool's connections: with the same TLS connector ([`Canceller`]). deadpool does not hand out
//! the connector its manager was built with, so the caller passes it
//! ([`crate::LockQueue::with_cancel_tls`]); the default is no TLS, which is right for a pool
//! built with `NoTls`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{CancelToken, NoTls, Socket};

type CancelFuture = Pin<Box<dyn Future<Output = Result<(), tokio_postgres::Error>> + Send>>;

/// Sends cancel requests with one TLS connector.
#[derive(Clone)]
pub(crate) struct Canceller {
    send: Arc<dyn Fn(CancelToken) -> CancelFuture + Send + Sync>,
    tls: &'static str,
}

impl std::fmt::Debug for Canceller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Canceller").field("tls", &self.tls).finish()
    }
}

impl Default for Canceller {
    fn default() -> Self {
        Canceller::new(NoTls)
    }
}

impl Canceller {
    /// Cancel requests connect with `tls` — the same bounds as `deadpool_postgres::Manager::new`,
    /// so the connector the pool was built with fits.
    pub(crate) fn new<T>(tls: T) -> Canceller
    where
        T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
        T::Stream: Sync + Send,
        T::TlsConnect: Sync + Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        Canceller {
            send: Arc::new(move |token: CancelToken| {
                let tls = tls.clone();
                Box::pin(async move { token.cancel_query(tls).await })
            }),
            tls: std::any::type_name::<T>(),
        }
    }

    /// Arms a guard that cancels what runs on `token`'s connection unless disarmed.
    pub(crate) fn arm(&self, token: CancelToken) -> CancelOnDrop {
        let canceller = self.clone();
        CancelOnDrop::new(
            canceller.tls,
            Arc::new(move || {
                let send = (canceller.send)(token.clone());
                Box::pin(async move { send.await.map_err(|e| e.to_string()) })
            }),
        )
    }
}

/// Sends one cancel request for the statement a guard watches: a cancel request with the
/// connection's key (tokio-postgres), or `pg_cancel_backend` of its backend from another pooled
/// connection (sqlx, which does not hand out the key). The error says why it could not be sent.
pub type SendCancel =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

/// Sends a cancel request for its connection when dropped while armed.
#[doc(hidden)]
#[must_use = "dropping the guard at once cancels the statement"]
pub struct CancelOnDrop {
    send: Option<SendCancel>,
    // How the requests are sent (for the log).
    how: &'static str,
}

impl std::fmt::Debug for CancelOnDrop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CancelOnDrop")
            .field("armed", &self.send.is_some())
            .field("how", &self.how)
            .finish()
    }
}

impl CancelOnDrop {
    /// A guard that, dropped armed, calls `send` on the schedule below; `how` names the way
    /// the requests travel, for the log.
    pub fn new(how: &'static str, send: SendCancel) -> CancelOnDrop {
        CancelOnDrop {
            send: Some(send),
            how,
        }
    }

    /// The statement finished: nothing to cancel.
    pub fn disarm(mut self) {
        self.send = None;
    }
}

/// When the cancel request is sent, counted from the drop: at once, then again after short
/// delays, because one request can lose its race. A cancel request travels on a connection of
/// its own and may reach the server before the statement it is meant for (still in flight on
/// the statement's connection, or not yet read by the backend); the server ignores a cancel
/// that finds its backend idle, and the statement then waits on — a backend waiting for a lock
/// does not notice that its client's socket was closed — and runs later for a caller that gave
/// up. Sending again is harmless: the guard's connection is never used for another statement
/// (closed, or only ever rolled back), and the cancel key carries a per-session secret, so a
/// late request can only hit that dead or dying session's own statement. Bounded: the last one
/// goes 2 s after the drop, and the task ends then.
const CANCEL_SCHEDULE: [Duration; 5] = [
    Duration::ZERO,
    Duration::from_millis(25),
    Duration::from_millis(100),
    Duration::from_millis(500),
    Duration::from_secs(2),
];

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let Some(cancel) = self.send.take() else {
            return;
        };
        tracing::debug!("waiting lock statement abandoned; sending cancel requests");
        let how = self.how;
        let send = async move {
            let dropped = tokio::time::Instant::now();
            for after in CANCEL_SCHEDULE {
                // Saturating: an instant too far away for the clock is never reached anyway.
                if let Some(at) = dropped.checked_add(after) {
                    tokio::time::sleep_until(at).await;
                }
                if let Err(error) = cancel().await {
                    // E.g. the server wants TLS and the cancel request was configured without
                    // it: the next attempts would fail the same way. The wait then ends only
                    // when its connection is closed (the caller's transaction discards it at its
                    // end, a session waiter at once) and the backend notices.
                    tracing::warn!(
                        %error,
                        how,
                        "could not send a cancel request for an abandoned lock wait"
                    );
                    return;
                }
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(send);
            }
            Err(_) => {
                // Dropped outside a runtime (e.g. while one shuts down): a short-lived thread
                // with its own runtime still delivers the requests.
                let _ = std::thread::Builder::new()
                    .name("lockstep-cancel".into())
                    .spawn(move || {
                        if let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                        {
                            runtime.block_on(send);
                        }
                    });
            }
        }
    }
}
