//! Table perspectives: read models in the application's own tables.
//!
//! A [`crate::Perspective`] folds a stream into a JSON state that lockstep stores. A
//! [`TablePerspective`] instead gets the worker's **unit-of-work transaction** with each event
//! and writes wherever the application wants — on Postgres the real transaction (run SQL on
//! it), on the testkit fakes the fake transaction (stage rows in an in-memory table, so the
//! application's tests stay in memory). Its writes commit **in the same transaction** that
//! advances the pair's cursor and deletes its work, so each event's effect lands exactly once,
//! whatever crashes: a batch that does not commit leaves neither the cursor nor the rows.
//!
//! What the worker asks of a table perspective:
//!
//! - `apply(tx, event)`: the effect of one event of one stream, in event-id order per stream.
//!   Failing (an error, a failed statement, a panic) is the pair's failure as for JSON
//!   perspectives: the events before it are committed, the failure is stored on the cursor and
//!   backed off; the other pairs are served. A failing SQL statement aborts a Postgres
//!   transaction, so the worker then rolls back what it shared the transaction with and
//!   applies the failing pair alone (see the worker's docs).
//! - `reset(tx, stream_id)`: remove everything `apply` wrote for that stream. A rewind (a late
//!   arrival, an operator's request) runs `reset` and then every event of the stream again, in
//!   one transaction, under the pair's rewind lease and fenced on it; a purge runs `reset`.
//!   Rows keyed by stream make this one `DELETE`.
//!
//! Both run on the runtime's threads (they are `async`): keep them to database work, and put
//! any heavy computation behind `spawn_blocking` yourself. The worker stops a replay within one
//! event when its lease is lost.
//!
//! Register one with [`crate::PerspectiveRegistry::register_table`]; the registry is shared
//! with JSON perspectives (one namespace of names), and the worker checks that the
//! transaction type matches its own when it is built.
//!
//! ```
//! use lockstep_core::{RecordedEvent, StreamId, TablePerspective};
//!
//! /// Deposits per stream, in an application table (here: any transaction type, no rows).
//! struct Deposits;
//!
//! impl<Tx: Sync> TablePerspective<Tx> for Deposits {
//!     type Error = std::convert::Infallible;
//!
//!     fn name(&self) -> &str {
//!         "Deposits"
//!     }
//!
//!     async fn apply(&self, _tx: &Tx, _event: &RecordedEvent) -> Result<(), Self::Error> {
//!         // e.g. tx.client().execute("INSERT INTO deposits …", &[…]).await on Postgres
//!         Ok(())
//!     }
//!
//!     async fn reset(&self, _tx: &Tx, _stream_id: StreamId) -> Result<(), Self::Error> {
//!         // e.g. DELETE FROM deposits WHERE account = $1
//!         Ok(())
//!     }
//! }
//! ```

use std::future::Future;

use crate::apply_error::ApplyError;
use crate::event_store::RecordedEvent;
use crate::future::BoxFuture;
use crate::ids::StreamId;

/// A read model that writes the application's own tables, in the worker's transaction `Tx`;
/// see the [module docs](self).
pub trait TablePerspective<Tx: Sync>: Send + Sync + 'static {
    /// What a failing `apply` or `reset` reports (stored on the pair's cursor as text).
    type Error: std::error::Error + Send + Sync + 'static;

    /// The perspective's name: the key of its cursors and leases. Must be a valid
    /// [`crate::PerspectiveName`].
    fn name(&self) -> &str;

    /// The version of this perspective's code (1 unless overridden); see
    /// [`crate::perspective_version`]. A new version writes its own tables (name them after
    /// the version, e.g. `statement_v2`), so that it builds beside the serving one.
    fn version(&self) -> u32 {
        1
    }

    /// Runs in the transaction that makes this version the serving one, after the switch:
    /// repoint what the application reads (Postgres: `CREATE OR REPLACE VIEW statement AS
    /// SELECT … FROM statement_v2`), so that readers switch in the same commit. Failing
    /// rolls the promotion back. Keep it short: when the promotion retires the previous
    /// version in the same transaction, appends wait for that transaction (on Postgres), hook
    /// included. Does nothing by default.
    fn promote<'a>(
        &'a self,
        tx: &'a Tx,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'a {
        let _ = tx;
        std::future::ready(Ok(()))
    }

    /// Writes the effect of one event, in `tx`. Deterministic in what it leaves behind: a
    /// rewind resets the stream and applies the same events again.
    fn apply<'a>(
        &'a self,
        tx: &'a Tx,
        event: &'a RecordedEvent,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'a;

    /// Removes everything `apply` wrote for `stream_id`, in `tx` (before a rewind's replay, and
    /// on a purge).
    fn reset<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'a;
}

/// A table perspective with its error erased, as the worker holds it.
pub trait DynTablePerspective<Tx>: Send + Sync {
    /// The perspective's name, as given by [`TablePerspective::name`].
    fn name(&self) -> &str;

    /// The version of its code, as given by [`TablePerspective::version`].
    fn version(&self) -> u32;

    /// Runs [`TablePerspective::promote`]; a failure is its error's text.
    fn promote_version<'a>(&'a self, tx: &'a Tx) -> BoxFuture<'a, Result<(), String>>;

    /// Applies one event; a failure is [`ApplyError::Apply`] naming it.
    fn apply_one<'a>(
        &'a self,
        tx: &'a Tx,
        event: &'a RecordedEvent,
    ) -> BoxFuture<'a, Result<(), ApplyError>>;

    /// Resets one stream's rows; a failure is [`ApplyError::Reset`].
    fn reset_stream<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
    ) -> BoxFuture<'a, Result<(), ApplyError>>;
}

impl<Tx: Sync, T: TablePerspective<Tx>> DynTablePerspective<Tx> for T {
    fn name(&self) -> &str {
        TablePerspective::name(self)
    }

    fn version(&self) -> u32 {
        TablePerspective::version(self)
    }

    fn promote_version<'a>(&'a self, tx: &'a Tx) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move { self.promote(tx).await.map_err(|e| with_sources(&e)) })
    }

    fn apply_one<'a>(
        &'a self,
        tx: &'a Tx,
        event: &'a RecordedEvent,
    ) -> BoxFuture<'a, Result<(), ApplyError>> {
        Box::pin(async move {
            self.apply(tx, event).await.map_err(|e| ApplyError::Apply {
                event_id: event.event_id,
                detail: with_sources(&e),
            })
        })
    }

    fn reset_stream<'a>(
        &'a self,
        tx: &'a Tx,
        stream_id: StreamId,
    ) -> BoxFuture<'a, Result<(), ApplyError>> {
        Box::pin(async move {
            self.reset(tx, stream_id)
                .await
                .map_err(|e| ApplyError::Reset {
                    detail: with_sources(&e),
                })
        })
    }
}

/// The error and its sources, `: `-separated: a database error's text (`db error`) says little
/// without the server's message, which is its source.
fn with_sources(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // Some errors repeat their source's text in their own: say it once.
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
