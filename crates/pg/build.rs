//! Rebuild when a schema file is added, removed or changed: `refinery::embed_migrations!` and
//! the function files' `include_str!`s read `migrations/` at compile time, and cargo would
//! otherwise miss a new numbered file.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
    println!("cargo:rerun-if-changed=migrations/functions");
}
