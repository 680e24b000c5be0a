//! The domain's dependency rule: domain code uses `lockstep-core` only. The sample's behaviour
//! is tested on the fakes and on PostgreSQL: the write lock in `write_lock.rs`, the flash sale
//! in every mode, through the combiner, and fail-fast's busy answer in `flash_sale.rs`, every
//! unit-of-work form in `spawned.rs`.

#[test]
fn domain_code_depends_on_lockstep_core_only() {
    for (file, source) in [
        ("domain.rs", include_str!("../src/domain.rs")),
        ("handler.rs", include_str!("../src/handler.rs")),
    ] {
        // Code only: comments may mention the runtime.
        let code: String = source
            .lines()
            .filter(|line| !line.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        for crate_name in [
            "lockstep_pg",
            "lockstep_testkit",
            "tokio",
            "deadpool",
            "crate::wiring",
        ] {
            assert!(
                !code.contains(&format!("use {crate_name}"))
                    && !code.contains(&format!("{crate_name}::")),
                "{file} must not use {crate_name}"
            );
        }
    }
}
