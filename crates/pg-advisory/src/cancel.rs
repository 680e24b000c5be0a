//! Ending a server-side wait that nobody awaits any more.
//!
//! tokio-postgres sends nothing when a query future is dropped: the backend keeps waiting for
//! the lock (and would get it, holding it for a caller that is gone). [`CancelOnDrop`] is armed
//! around a waiting statement; if it is dropped before being disarmed, it sends a cancel request
//! for that connection from a spawned task, and the wait ends with `57014 query_canceled`.

use tokio_postgres::{CancelToken, NoTls};

/// Sends a cancel request for its connection when dropped while armed.
pub(crate) struct CancelOnDrop {
    token: Option<CancelToken>,
}

impl CancelOnDrop {
    /// Armed: dropping it cancels whatever runs on the token's connection.
    pub(crate) fn arm(token: CancelToken) -> CancelOnDrop {
        CancelOnDrop { token: Some(token) }
    }

    /// The statement finished: nothing to cancel.
    pub(crate) fn disarm(mut self) {
        self.token = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let Some(token) = self.token.take() else {
            return;
        };
        tracing::debug!("waiting lock statement abandoned; sending a cancel request");
        // The cancel request goes over a new connection (plain TCP/Unix socket: `NoTls`; a
        // server that refuses non-TLS connections ignores it and the wait ends when the
        // connection is closed instead).
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let _ = token.cancel_query(NoTls).await;
                });
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
                            let _ = runtime.block_on(token.cancel_query(NoTls));
                        }
                    });
            }
        }
    }
}
