//! The schema's files, read from disk without a database: every function file is listed in
//! `FUNCTION_FILES` (and nothing else is), each defines exactly the one name it is called
//! after, and no numbered migration defines a function or view, so that each is defined once.

use std::collections::BTreeSet;
use std::path::PathBuf;

use lockstep_pg::migrate::FUNCTION_FILES;

fn migrations_dir() -> PathBuf {
    // The crate's `migrations` (a symlink to the workspace's folder, or the packaged copy).
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("migrations")
}

fn sql_files(dir: &std::path::Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {dir:?}: {e}"))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| path.is_file())
        .filter_map(|path| path.file_name()?.to_str().map(str::to_owned))
        .filter(|name| name.ends_with(".sql"))
        .collect()
}

/// The names a text creates: `CREATE [OR REPLACE] FUNCTION|VIEW name`, lower-cased.
fn created_names(sql: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for line in sql.lines() {
        let code = line.split("--").next().unwrap_or("").trim();
        let upper = code.to_ascii_uppercase();
        let rest = upper
            .strip_prefix("CREATE OR REPLACE ")
            .or_else(|| upper.strip_prefix("CREATE "));
        let Some(rest) = rest else { continue };
        for kind in ["FUNCTION ", "VIEW "] {
            if let Some(after) = rest.strip_prefix(kind) {
                let start = code.len() - after.len();
                let name: String = code[start..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                found.push((kind.trim().to_owned(), name.to_ascii_lowercase()));
            }
        }
    }
    found
}

#[test]
fn every_function_file_is_listed_once_and_the_list_names_only_files_that_exist() {
    let on_disk = sql_files(&migrations_dir().join("functions"));
    let listed: Vec<String> = FUNCTION_FILES
        .iter()
        .map(|f| format!("{}.sql", f.name))
        .collect();
    let listed_set: BTreeSet<String> = listed.iter().cloned().collect();
    assert_eq!(listed.len(), listed_set.len(), "a file is listed twice");
    let unlisted: Vec<_> = on_disk.difference(&listed_set).collect();
    let missing: Vec<_> = listed_set.difference(&on_disk).collect();
    assert!(
        unlisted.is_empty() && missing.is_empty(),
        "migrations/functions/ and FUNCTION_FILES (crates/pg/src/migrate/files.rs) differ: \
         not listed {unlisted:?}, listed but missing {missing:?}"
    );
}

#[test]
fn each_function_file_defines_only_the_name_it_is_called_after() {
    for file in FUNCTION_FILES {
        let created = created_names(file.sql);
        assert!(
            !created.is_empty(),
            "functions/{}.sql creates no function or view",
            file.name
        );
        for (kind, name) in &created {
            assert_eq!(
                name, file.name,
                "functions/{}.sql creates the {kind} {name}: one name per file",
                file.name
            );
        }
        assert!(
            !file.sql.to_ascii_uppercase().contains("CREATE TABLE"),
            "functions/{}.sql creates a table: tables belong to a numbered migration",
            file.name
        );
    }
}

#[test]
fn no_numbered_migration_defines_a_function_or_a_view() {
    let dir = migrations_dir();
    let numbered: Vec<String> = sql_files(&dir)
        .into_iter()
        .filter(|name| name.starts_with('V'))
        .collect();
    assert!(
        numbered.iter().any(|n| n == "V1__baseline.sql"),
        "{numbered:?}"
    );
    for name in numbered {
        let text = std::fs::read_to_string(dir.join(&name)).expect("read");
        let created = created_names(&text);
        assert!(
            created.is_empty(),
            "{name} creates {created:?}: a function or view lives in functions/NAME.sql, its \
             only definition"
        );
    }
}
