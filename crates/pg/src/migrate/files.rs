//! The function and view files of `migrations/functions/`, in the order [`migrate`](super::migrate)
//! applies them: each file holds the only definition of the function (or view) it is named
//! after. A function is listed after the functions it calls, so that a SQL-language body, which
//! PostgreSQL checks when it is created, finds them; PL/pgSQL bodies are checked when called.
//!
//! A test (`tests/schema_files.rs`) fails when a file in the folder is missing from this list
//! or the list names a file the folder lacks.

/// One file of `migrations/functions/`: the function or view it defines, and its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FunctionFile {
    /// The function's (or view's) name, which is also the file's name without `.sql`.
    pub name: &'static str,
    /// The file's text, `CREATE OR REPLACE …` of that one name.
    pub sql: &'static str,
}

macro_rules! function_files {
    ($($name:literal),* $(,)?) => {
        &[$(FunctionFile {
            name: $name,
            sql: include_str!(concat!("../../migrations/functions/", $name, ".sql")),
        }),*]
    };
}

/// Every function and view file, in the order they are applied.
pub const FUNCTION_FILES: &[FunctionFile] = function_files![
    // Advisory locks: the key, the pg_locks view, the lock protocol, lock-then-load.
    "lockstep_advisory_key",
    "lockstep_advisory_locks",
    "lockstep_advisory_lock",
    "lockstep_lock_and_load",
    // Event streams and aggregate snapshots.
    "lockstep_append_events",
    "lockstep_load_from_snapshot",
    // Registering, retiring and rebuilding perspectives.
    "lockstep_lock_perspectives_for_change",
    "lockstep_register_perspectives",
    "lockstep_retire_perspective",
    "lockstep_rebuild_perspective",
    "lockstep_declare_perspective_versions",
    // The perspective store: the fence check and snapshot pruning the commits share, failures
    // and throughput, claims, commits, snapshots, purges, rewind reads.
    "lockstep_perspective_check",
    "lockstep_perspective_prune_snapshots",
    "lockstep_perspective_record_failure",
    "lockstep_perspective_record_applied",
    "lockstep_perspective_try_claim",
    "lockstep_perspective_claim",
    "lockstep_perspective_claim_pairs",
    "lockstep_perspective_commit",
    "lockstep_perspective_commit_release",
    "lockstep_perspective_commit_release_or_refuse",
    "lockstep_perspective_commit_batch",
    "lockstep_perspective_save_snapshot",
    "lockstep_perspective_purge",
    "lockstep_rewind_page",
    "lockstep_load_rewind",
];
