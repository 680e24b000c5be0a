# Commands people actually run; each is a thin line over cargo. `just --list` shows them.

# Run every test: the README's command (PostgreSQL up, Chromium installed when missing, then
# cargo test --workspace).
test *args:
    scripts/test {{args}}

# What CI runs: Postgres up, tests, fmt, clippy, docs.
ci:
    bash .ci/run

# Build the docs with warnings as errors, and check that every intra-doc link resolved.
doc:
    scripts/doc

# Format everything.
fmt:
    cargo fmt --all

# Lint like CI.
lint:
    cargo clippy --workspace --all-targets -- -D warnings

# Licenses, bans and sources of the dependency tree, like CI (needs cargo-deny; see deny.toml).
deny:
    cargo deny check licenses bans sources

# Check every crate with each feature alone, with none and with all, like CI (needs cargo-hack).
features:
    cargo hack check --each-feature --workspace

# Run a benchmark: `just bench locker`, `just bench aggregate` or `just bench worker`.
bench which:
    cargo run --release -p lockstep-bench -- {{which}}

# lockstep vs the cqrs-es peer on the aggregate workload, alternating ABBA; ends with the
# `vs_cqrs_es_<workload>_<commits|p99>=` lines (docs/benchmarks.md). Flags pass through, e.g.
# `just bench-vs-cqrs-es --passes 4` or `--peer DIR`.
bench-vs-cqrs-es *args:
    scripts/bench-vs-cqrs-es {{args}}

# The long run of the reliability suite (docs/reliability.md); ends with the tally line.
reliability:
    cargo run --release -p lockstep-bench -- reliability

# The demo (in memory by default, Postgres when DATABASE_URL is set).
demo:
    cargo run -p lockstep-demo
