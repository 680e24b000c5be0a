//! The crate's `migrations/` folder is a byte-for-byte copy of the workspace's top-level
//! `migrations/`, the single source of the schema (`docs/adr/0004-schema-ownership.md`). The
//! crate embeds its own copy so it builds when packaged; this test makes any drift fail CI.
//!
//! In a packaged crate (no workspace around it) the top-level folder is absent and there is
//! nothing to compare: the test then passes after saying so.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `V{n}__{name}.sql` files of `dir`, by file name, with their bytes.
fn sql_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {dir:?}: {e}"));
    let mut files = BTreeMap::new();
    for entry in entries {
        let path = entry.expect("directory entry").path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if path.is_file() && name.ends_with(".sql") {
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {path:?}: {e}"));
            files.insert(name.to_owned(), bytes);
        }
    }
    files
}

#[test]
fn the_crates_migrations_equal_the_top_level_migrations_byte_for_byte() {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let own = crate_dir.join("migrations");
    let top = crate_dir.join("../../migrations");
    if !top.is_dir() {
        eprintln!("no top-level migrations/ at {top:?} (a packaged crate): nothing to compare");
        return;
    }
    let (own_files, top_files) = (sql_files(&own), sql_files(&top));
    assert!(
        !top_files.is_empty(),
        "the top-level migrations/ holds no .sql file"
    );
    let only_top: Vec<&String> = top_files
        .keys()
        .filter(|n| !own_files.contains_key(*n))
        .collect();
    let only_own: Vec<&String> = own_files
        .keys()
        .filter(|n| !top_files.contains_key(*n))
        .collect();
    let differing: Vec<&String> = top_files
        .iter()
        .filter(|(n, bytes)| own_files.get(*n).is_some_and(|own| own != *bytes))
        .map(|(n, _)| n)
        .collect();
    assert!(
        only_top.is_empty() && only_own.is_empty() && differing.is_empty(),
        "crates/pg/migrations/ must be a copy of migrations/ (copy the top-level files over): \
         missing from the crate {only_top:?}, only in the crate {only_own:?}, differing \
         {differing:?}"
    );
}
