//! Rebuild when a migration file is added, removed or changed: `refinery::embed_migrations!`
//! reads the folder at compile time, and cargo would otherwise only notice edits of files the
//! crate already includes.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
