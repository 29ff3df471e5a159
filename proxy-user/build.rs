//! Builds `proxy-ebpf` for the BPF target with the pinned toolchain and embeds the object.
//! The toolchain must be installed and `bpf-linker` on PATH: `cargo xtask build` sees to both.
use aya_build::{Package, Toolchain};

const PINNED_TOOLCHAIN: &str = include_str!("../toolchain.pin");

/// The commit being built (`kpr --version`), rebuilt when HEAD moves; `unknown` outside a
/// git checkout.
fn git_commit() -> String {
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git").args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        let head_ref = git(&["symbolic-ref", "-q", "HEAD"]);
        for file in [Some("HEAD".to_owned()), head_ref].into_iter().flatten() {
            let path = std::path::Path::new(&dir).join(file);
            // A file that does not exist would rebuild every time (a packed ref).
            if path.exists() {
                println!("cargo::rerun-if-changed={}", path.display());
            }
        }
    }
    git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_owned())
}

fn main() -> anyhow::Result<()> {
    println!("cargo::rustc-env=KPR_GIT_COMMIT={}", git_commit());
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
