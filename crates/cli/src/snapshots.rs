//! `lockstep snapshots drop`: deletes aggregate snapshots no build reads any more — those of an
//! aggregate type below a state schema version (a decider that changed its state's shape
//! reads only its own version), or all of them. Snapshots are a cache of the fold: deleting
//! them changes no command's answer, only how much its next load folds.

use std::process::ExitCode;

use anyhow::Result;
use clap::Subcommand;
use lockstep_core::{AggregateType, NewEvent, SnapshotStore, Transaction as _, TransactionSource};
use lockstep_pg_store::PgEventStore;
use serde_json::json;

use crate::pg::{DbUrl, explain};
use crate::{bad_argument, say};

/// `lockstep snapshots …`
#[derive(Debug, Subcommand)]
pub(crate) enum SnapshotsCommand {
    /// Deletes the snapshots of one aggregate type: those of state schema versions below
    /// `--below-schema`, or every one with `--all` (one of the two is required).
    #[command(after_help = crate::EXIT_CODES)]
    Drop {
        /// The aggregate type (the decider's, as in `relay:aggregate:{type}:{id}`).
        aggregate_type: String,
        /// Delete the snapshots whose state schema version is below this one.
        #[arg(long, value_name = "VERSION", conflicts_with = "all")]
        below_schema: Option<u32>,
        /// Delete every snapshot of the type.
        #[arg(long)]
        all: bool,
    },
}

pub(crate) async fn run(url: &DbUrl, cmd: SnapshotsCommand, json: bool) -> Result<ExitCode> {
    let SnapshotsCommand::Drop {
        aggregate_type,
        below_schema,
        all,
    } = cmd;
    // The arguments first: a bad one is refused before anything connects.
    let ty = AggregateType::new(&aggregate_type)
        .map_err(|e| bad_argument(format!("invalid aggregate type: {e}")))?;
    match (below_schema, all) {
        (None, false) => {
            return Err(bad_argument(
                "say which snapshots to delete: --below-schema VERSION or --all",
            ));
        }
        (Some(v), _) if v == 0 || v > NewEvent::MAX_SCHEMA_VERSION => {
            return Err(bad_argument(format!(
                "--below-schema {v} is out of range: schema versions run from 1 to {}",
                NewEvent::MAX_SCHEMA_VERSION
            )));
        }
        _ => {}
    }
    let db = url.handle(1).await?;
    let store = PgEventStore::new(&db);
    let tx = db.begin().await.map_err(explain)?;
    let deleted = store
        .delete_snapshots(&tx, &ty, below_schema)
        .await
        .map_err(explain)?;
    tx.commit().await.map_err(explain)?;
    if json {
        say!(
            "{}",
            json!({
                "aggregate_type": ty.as_str(),
                "below_schema_version": below_schema,
                "deleted": deleted,
            })
        );
    } else {
        let which = below_schema.map_or_else(
            || "every schema version".to_owned(),
            |v| format!("schema versions below {v}"),
        );
        say!("deleted {deleted} snapshots of {ty} ({which})");
    }
    Ok(ExitCode::SUCCESS)
}
