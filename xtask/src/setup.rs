//! Idempotent machine set-up: everything a fresh machine lacks, installed by the project itself.
//!
//! - the pinned Rust toolchain with `rust-src` (rustup does not auto-install it here);
//! - `bpf-linker`, built against the LLVM that the pinned toolchain ships (the linker must use the
//!   same LLVM major as rustc's bitcode, and no prebuilt linker can be downloaded);
//! - Debian packages the tests and demo use (`bpftool`, `iproute2`; `iptables`, `nftables`,
//!   `conntrack` and `openssl` for the control plane and kube-proxy tests);
//! - the test control plane, built from `tools/k8s` by `cluster::ensure_k8s_binaries` (called
//!   by `cargo xtask test` and `cargo xtask cluster`);
//! - bpffs at /sys/fs/bpf and a cgroup2 mount.
use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

const BPF_LINKER_VERSION: &str = "0.13.0";

/// What the rest of xtask needs to build with the pinned toolchain.
#[derive(Clone)]
pub struct Env {
    pub toolchain: String,
    /// Directory holding `bpf-linker`, put first on PATH.
    pub linker_bin: PathBuf,
}

impl Env {
    /// `cargo` of the pinned toolchain, with bpf-linker on PATH and no toolchain overrides
    /// inherited from the cargo that runs xtask.
    pub fn cargo(&self, root: &Path) -> Command {
        let mut cmd = Command::new("rustup");
        cmd.args(["run", &self.toolchain, "cargo"]).current_dir(root);
        for var in ["RUSTUP_TOOLCHAIN", "RUSTC", "RUSTDOC", "CARGO", "RUSTC_WRAPPER", "RUSTC_WORKSPACE_WRAPPER"] {
            cmd.env_remove(var);
        }
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut paths = vec![self.linker_bin.clone()];
        paths.extend(std::env::split_paths(&path));
        cmd.env("PATH", std::env::join_paths(paths).expect("PATH entries are valid"));
        cmd
    }
}

pub fn ensure_all(root: &Path) -> Result<Env> {
    let toolchain =
        fs::read_to_string(root.join("toolchain.pin")).context("failed to read toolchain.pin")?.trim().to_owned();
    ensure_toolchain(&toolchain)?;
    ensure_target(&toolchain, crate::image::MUSL_TARGET)?;
    let linker_bin = ensure_bpf_linker(&toolchain)?;
    ensure_packages()?;
    if is_root() {
        ensure_mounts()?;
    }
    Ok(Env { toolchain, linker_bin })
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions; declared here to keep xtask free of the libc crate.
    unsafe extern "C" {
        fn geteuid() -> u32;
    }
    unsafe { geteuid() == 0 }
}

fn ensure_toolchain(toolchain: &str) -> Result<()> {
    let installed = Command::new("rustup")
        .args(["run", toolchain, "rustc", "--print", "sysroot"])
        .stderr(Stdio::null())
        .output()
        .context("rustup is required (https://rustup.rs)")?;
    let has_src = installed.status.success() && {
        let sysroot = String::from_utf8_lossy(&installed.stdout).trim().to_owned();
        Path::new(&sysroot).join("lib/rustlib/src/rust/library/core").exists()
    };
    if has_src {
        return Ok(());
    }
    println!("setup: installing Rust {toolchain} with rust-src (pinned in toolchain.pin)");
    let status = Command::new("rustup")
        .args(["toolchain", "install", toolchain, "--profile", "minimal"])
        .args(["--component", "rust-src,clippy,rustfmt"])
        // A fresh RUSTUP_HOME would otherwise try to update rustup itself.
        .env("RUSTUP_AUTO_SELF_UPDATE", "disable")
        .status()?;
    if !status.success() {
        bail!("rustup toolchain install {toolchain} failed");
    }
    Ok(())
}

/// The standard library for `target` (the image's static build).
fn ensure_target(toolchain: &str, target: &str) -> Result<()> {
    let installed = capture(Command::new("rustup").args(["target", "list", "--installed", "--toolchain", toolchain]))?;
    if installed.lines().any(|l| l.trim() == target) {
        return Ok(());
    }
    println!("setup: adding the {target} target to Rust {toolchain}");
    run_quiet(Command::new("rustup").args(["target", "add", "--toolchain", toolchain, target]))
}

/// bpf-linker in `~/.cache/kpr/bpf-linker-<version>-<toolchain>/bin`, linked against the
/// toolchain's libLLVM. Outside the checkout, as the Kubernetes binaries are: a fresh clone
/// (CI's) finds it built.
fn ensure_bpf_linker(toolchain: &str) -> Result<PathBuf> {
    let tools = crate::cluster::cache_root()?;
    let install_root = tools.join(format!("bpf-linker-{BPF_LINKER_VERSION}-{toolchain}"));
    let bin = install_root.join("bin");
    let linker = bin.join("bpf-linker");
    if linker.exists()
        && Command::new(&linker).arg("--version").stdout(Stdio::null()).status().is_ok_and(|s| s.success())
    {
        return Ok(bin);
    }

    let sysroot = capture(Command::new("rustup").args(["run", toolchain, "rustc", "--print", "sysroot"]))?;
    let lib_dir = Path::new(sysroot.trim()).join("lib");
    let libllvm = fs::read_dir(&lib_dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libLLVM.so.")))
        .with_context(|| format!("no libLLVM.so.* in {}", lib_dir.display()))?;
    let soname = libllvm.file_name().expect("found by name").to_owned();
    let llvm_major: u32 = soname
        .to_str()
        .and_then(|n| n.strip_prefix("libLLVM.so."))
        .and_then(|v| v.split('.').next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("cannot read the LLVM version from {}", libllvm.display()))?;

    // bpf-linker's build script looks for $LLVM_PREFIX/lib64/libLLVM.so; the binary finds the
    // library at run time through an rpath to the same directory, under its soname.
    let prefix = tools.join(format!("llvm-{toolchain}"));
    let lib64 = prefix.join("lib64");
    fs::create_dir_all(&lib64)?;
    for name in [std::ffi::OsStr::new("libLLVM.so"), soname.as_os_str()] {
        let link = lib64.join(name);
        let _ = fs::remove_file(&link);
        symlink(&libllvm, &link)?;
    }

    println!(
        "setup: building bpf-linker {BPF_LINKER_VERSION} against LLVM {llvm_major} of Rust {toolchain} (about a minute)"
    );
    let status = Command::new("rustup")
        .args(["run", toolchain, "cargo", "install", "--locked", "--force"])
        .arg("--root")
        .arg(&install_root)
        .args(["--no-default-features", "--features", &format!("llvm-{llvm_major}")])
        .arg(format!("bpf-linker@{BPF_LINKER_VERSION}"))
        .env("LLVM_PREFIX", &prefix)
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO_TARGET_DIR")
        .status()?;
    if !status.success() {
        bail!("building bpf-linker failed");
    }
    Ok(bin)
}

/// Debian packages used by the tests, the demo and for inspection.
fn ensure_packages() -> Result<()> {
    // iptables, nftables and conntrack: the real kube-proxy, run as kpr's peer in the tests.
    let wanted = [
        ("bpftool", "bpftool"),
        ("ip", "iproute2"),
        ("iptables", "iptables"),
        ("nft", "nftables"),
        ("conntrack", "conntrack"),
        ("openssl", "openssl"),
        // iperf3: the NodePort throughput benchmark.
        ("iperf3", "iperf3"),
        // qemu: the privileged tests on other kernels (`xtask/src/vm.rs`); xz unpacks modules.
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("xz", "xz-utils"),
        // The container image: musl-gcc for the static build's C parts (ring), strip, and
        // runc, which runs the image in its test.
        ("musl-gcc", "musl-tools"),
        ("strip", "binutils"),
        ("runc", "runc"),
        // The kubelets' container runtime and pod network (tests/src/nodes.rs): containerd
        // (with ctr) and the CNI plugins, found by absolute path.
        ("containerd", "containerd"),
        ("/usr/lib/cni/bridge", "containernetworking-plugins"),
        // The e2e suite's agnhost image (xtask/src/image.rs): the tools its specs run.
        ("busybox", "busybox-static"),
        ("nc.openbsd", "netcat-openbsd"),
        ("dig", "bind9-dnsutils"),
        ("iperf", "iperf"),
        ("curl", "curl"),
        ("wget", "wget"),
    ];
    let present = |cmd: &str| if cmd.starts_with('/') { Path::new(cmd).is_file() } else { on_path(cmd) };
    let missing: Vec<&str> = wanted.iter().filter(|(cmd, _)| !present(cmd)).map(|(_, pkg)| *pkg).collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() || !on_path("apt-get") {
        println!("setup: please install {} (not root or no apt-get: skipping)", missing.join(" "));
        return Ok(());
    }
    println!("setup: installing {} from Debian", missing.join(" "));
    let install = |update: bool| -> Result<bool> {
        if update {
            Command::new("apt-get").args(["update", "-qq"]).status()?;
        }
        Ok(Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()?
            .success())
    };
    if !install(false)? && !install(true)? {
        bail!("apt-get install {} failed", missing.join(" "));
    }
    Ok(())
}

fn ensure_mounts() -> Result<()> {
    let mounts = fs::read_to_string("/proc/self/mounts")?;
    let has = |fstype: &str, at: Option<&str>| {
        mounts.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 2 && f[2] == fstype && at.is_none_or(|at| f[1] == at)
        })
    };
    if !has("bpf", Some("/sys/fs/bpf")) {
        println!("setup: mounting bpffs at /sys/fs/bpf");
        fs::create_dir_all("/sys/fs/bpf")?;
        run_quiet(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]))?;
    }
    if !has("cgroup2", None) {
        println!("setup: mounting cgroup2 at /sys/fs/cgroup/unified");
        fs::create_dir_all("/sys/fs/cgroup/unified")?;
        run_quiet(Command::new("mount").args(["-t", "cgroup2", "none", "/sys/fs/cgroup/unified"]))?;
    }
    Ok(())
}

fn on_path(cmd: &str) -> bool {
    std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join(cmd).is_file())).unwrap_or(false)
}

fn capture(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("failed to start {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?)
}

fn run_quiet(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("failed to start {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}
