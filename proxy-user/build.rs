//! Builds `proxy-ebpf` for the BPF target with the pinned toolchain and embeds the object.
//! The toolchain must be installed and `bpf-linker` on PATH: `cargo xtask build` sees to both.
use aya_build::{Package, Toolchain};

const PINNED_TOOLCHAIN: &str = include_str!("../toolchain.pin");

fn main() -> anyhow::Result<()> {
    println!("cargo::rerun-if-changed=../toolchain.pin");
    // aya-build watches proxy-ebpf's own sources; the eBPF object also compiles proxy-common.
    println!("cargo::rerun-if-changed=../proxy-common/src");
    // A pinned stable toolchain builds `core` for the BPF target only with unstable `-Z build-std`;
    // aya-build passes it when RUSTC_BOOTSTRAP=1. No nightly is needed.
    // SAFETY: build scripts are single-threaded at this point.
    unsafe { std::env::set_var("RUSTC_BOOTSTRAP", "1") };
    // aya-build relays the inner cargo's stderr as `cargo:warning` lines: keep its progress
    // ("Compiling proxy-ebpf", "Finished") out of them. Real errors and compiler
    // diagnostics still come through.
    // SAFETY: as above.
    unsafe { std::env::set_var("CARGO_TERM_QUIET", "true") };
    let ebpf = Package {
        name: "proxy-ebpf",
        root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../proxy-ebpf"),
        ..Default::default()
    };
    aya_build::build_ebpf([ebpf], Toolchain::Custom(PINNED_TOOLCHAIN.trim()))?;
    // With AYA_BUILD_SKIP=1 (e.g. `cargo check` without bpf-linker) aya-build writes nothing;
    // embed an empty object so the crate compiles. Loading it fails with a clear error.
    let object = std::path::Path::new(&std::env::var("OUT_DIR")?).join("proxy");
    if !object.exists() {
        std::fs::write(&object, [])?;
    }
    Ok(())
}
