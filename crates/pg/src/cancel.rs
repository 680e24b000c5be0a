//! Ending a server-side wait that nobody awaits any more.
//!
//! tokio-postgres sends nothing when a query future is dropped: the backend keeps waiting for
//! the lock (and would get it, holding it for a caller that is gone). [`CancelOnDrop`] is armed
//! around a waiting statement; if it is dropped before being disarmed, it sends a cancel request
//! for that connection from a spawned task, and the wait ends with `57014 query_canceled`.
//!
//! A cancel request travels on a new connection to the server, which must be made like the
//! pool's connections: with the same TLS connector ([`Canceller`]). deadpool does not hand out
//! the connector its manager was built with, so the caller passes it
//! ([`crate::LockQueue::with_cancel_tls`]); the default is no TLS, which is right for a pool
//! built with `NoTls`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

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
        CancelOnDrop {
            token: Some(token),
            canceller: self.clone(),
        }
    }
}

/// Sends a cancel request for its connection when dropped while armed.
#[doc(hidden)]
#[must_use = "dropping the guard at once cancels the statement"]
pub struct CancelOnDrop {
    token: Option<CancelToken>,
    canceller: Canceller,
}

impl std::fmt::Debug for CancelOnDrop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CancelOnDrop")
            .field("armed", &self.token.is_some())
            .field("canceller", &self.canceller)
            .finish()
    }
}

impl CancelOnDrop {
    /// The statement finished: nothing to cancel.
    pub fn disarm(mut self) {
        self.token = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let Some(token) = self.token.take() else {
            return;
        };
        tracing::debug!("waiting lock statement abandoned; sending a cancel request");
        let request = (self.canceller.send)(token);
        let tls = self.canceller.tls;
        let send = async move {
            if let Err(error) = request.await {
                // E.g. the server wants TLS and the cancel request was configured without it:
                // the wait then ends only when its connection is closed (the caller's
                // transaction discards it at its end, a session waiter at once).
                tracing::warn!(
                    %error,
                    tls,
                    "could not send a cancel request for an abandoned lock wait"
                );
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(send);
            }
            Err(_) => {
                // Dropped outside a runtime (e.g. while one shuts down): a short-lived thread
                // with its own runtime still delivers the request.
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
