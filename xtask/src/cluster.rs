//! The local Kubernetes of the tests: `etcd`, `kube-apiserver`, `kube-controller-manager`,
//! `kube-scheduler`, `kubelet`, `kube-proxy` and `kubectl` built from source with the installed
//! Go, from the Go module proxy only, as pinned by `tools/k8s/go.mod` + `go.sum`.
//!
//! The binaries are cached outside the checkout, in `$KPR_K8S_CACHE` or
//! `$HOME/.cache/kpr/k8s-<version>-<hash of go.mod and go.sum>/bin`, so a fresh clone on the same
//! machine (and CI with a kept home directory) reuses them; `.tools/k8s-<version>` is a symlink to
//! that directory for convenience. They are rebuilt only when the pin changes.
//!
//! Starting and stopping a control plane lives in the `kpr-tests` crate (`tests/src/cluster.rs`),
//! which the tests use directly; `cargo xtask cluster` runs its `kpr-cluster` program.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

/// The programs built from `tools/k8s`, and the Go package each comes from.
const BINARIES: &[GoBinary] = &[
    GoBinary::program("etcd", "go.etcd.io/etcd/server/v3"),
    GoBinary::program("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
    GoBinary::program("kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager"),
    GoBinary::program("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
    GoBinary::program("kubelet", "k8s.io/kubernetes/cmd/kubelet"),
    GoBinary::program("kube-proxy", "k8s.io/kubernetes/cmd/kube-proxy"),
    GoBinary::program("kubectl", "k8s.io/kubernetes/cmd/kubectl"),
];

/// A binary built from a Go module: a program (`go build`) or a package's tests (`go test -c`).
pub struct GoBinary {
    pub name: &'static str,
    pub package: &'static str,
    pub test: bool,
}

impl GoBinary {
    pub const fn program(name: &'static str, package: &'static str) -> Self {
        Self { name, package, test: false }
    }
}

/// Bumped when the way the binaries are built changes (flags below), to invalidate caches.
const RECIPE: &str = "1";

/// The directory holding the binaries of the pinned version, building them first if needed.
pub fn ensure_k8s_binaries(root: &Path) -> Result<PathBuf> {
    ensure_go_binaries(
        root,
        "k8s",
        BINARIES,
        "etcd, the control plane, kubelet, kube-proxy and kubectl (about 20 minutes on 2 cores when Go's caches are cold)",
    )
}

/// `binaries` of module `tools/<module>`, cached in `<cache>/<module>-<version>-<hash>/bin`
/// (the version is the module's `k8s.io/kubernetes` pin), built first if any is missing.
pub fn ensure_go_binaries(root: &Path, module: &str, binaries: &[GoBinary], what: &str) -> Result<PathBuf> {
    let dir_of_module = root.join("tools").join(module);
    let read = |f: &str| {
        fs::read_to_string(dir_of_module.join(f)).with_context(|| format!("failed to read tools/{module}/{f}"))
    };
    let (go_mod, go_sum) = (read("go.mod")?, read("go.sum")?);
    let version = pinned_version(&go_mod)?;
    let key = format!("{version}-{:016x}", fnv1a(&[RECIPE.as_bytes(), go_mod.as_bytes(), go_sum.as_bytes()]));
    let dir = cache_root()?.join(format!("{module}-{key}"));
    let bin = dir.join("bin");
    let complete = |bin: &Path| binaries.iter().all(|b| bin.join(b.name).is_file());
    if !complete(&bin) {
        build(&dir_of_module, &version, &dir, binaries, what)?;
    }
    // A convenience link in the (ignored) .tools directory.
    let link = root.join(".tools").join(format!("{module}-{version}"));
    if fs::read_link(&link).ok().as_deref() != Some(dir.as_path()) {
        fs::create_dir_all(root.join(".tools"))?;
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&dir, &link)?;
    }
    Ok(bin)
}

/// Where built tools are kept across checkouts: `$KPR_K8S_CACHE`, else `~/.cache/kpr`.
pub fn cache_root() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("KPR_K8S_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").context("HOME is not set (or set KPR_K8S_CACHE)")?;
    Ok(PathBuf::from(home).join(".cache/kpr"))
}

/// `k8s.io/kubernetes vX.Y.Z` from the module's requirements.
fn pinned_version(go_mod: &str) -> Result<String> {
    go_mod
        .lines()
        .find_map(|l| {
            let mut words = l.trim().trim_start_matches("require").split_whitespace();
            (words.next()? == "k8s.io/kubernetes").then(|| words.next().map(str::to_owned))?
        })
        .context("tools/k8s/go.mod does not require k8s.io/kubernetes")
}

/// Build into a temporary directory next to `dir`, then rename it into place, so an interrupted
/// build never leaves a half-filled cache.
fn build(module: &Path, version: &str, dir: &Path, binaries: &[GoBinary], what: &str) -> Result<()> {
    if Command::new("go").arg("version").output().is_err() {
        bail!("Go is required to build the tests' Kubernetes ({what})");
    }
    let parent = dir.parent().expect("cache dir has a parent");
    fs::create_dir_all(parent)?;
    let tmp = parent.join(format!(".build-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    let tmp_bin = tmp.join("bin");
    fs::create_dir_all(&tmp_bin)?;

    // Version stamps, as Kubernetes' own build sets them (kubectl version, /version).
    let minor = version.split('.').nth(1).unwrap_or("0");
    let mut ldflags = String::from("-s -w");
    for pkg in ["k8s.io/component-base/version", "k8s.io/client-go/pkg/version"] {
        ldflags += &format!(
            " -X {pkg}.gitVersion={version} -X {pkg}.gitMajor=1 -X {pkg}.gitMinor={minor} -X {pkg}.gitTreeState=clean"
        );
    }
    println!("setup: building {what} ({version}) from {} (Go module proxy)", module.display());
    let started = Instant::now();
    for GoBinary { name, package: pkg, test } in binaries {
        let status = Command::new("go")
            .args(if *test { ["test", "-c"].as_slice() } else { ["build"].as_slice() })
            .args(["-ldflags", &ldflags, "-o"])
            .arg(tmp_bin.join(name))
            .arg(pkg)
            .current_dir(module)
            // Never download a toolchain; go.mod and go.sum are authoritative.
            .env("GOTOOLCHAIN", "local")
            .env("GOFLAGS", "-mod=readonly -buildvcs=false")
            .env("CGO_ENABLED", "0")
            .status()
            .context("failed to run go")?;
        if !status.success() {
            let _ = fs::remove_dir_all(&tmp);
            bail!("go build {pkg} failed");
        }
    }
    let _ = fs::remove_dir_all(dir);
    fs::rename(&tmp, dir)?;
    println!("setup: built {what} in {:.0?} into {}", started.elapsed(), dir.display());
    Ok(())
}

/// FNV-1a, 64 bit: a stable hash without dependencies.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff; // separator
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_pinned_version() {
        let go_mod =
            "module x\n\nrequire k8s.io/kubernetes v1.36.3\n\nreplace (\n\tk8s.io/api => k8s.io/api v0.36.3\n)\n";
        assert_eq!(pinned_version(go_mod).unwrap(), "v1.36.3");
        let block = "require (\n\tk8s.io/kubernetes v1.34.4 // indirect\n)\n";
        assert_eq!(pinned_version(block).unwrap(), "v1.34.4");
        assert!(pinned_version("module x\n").is_err());
    }

    #[test]
    fn the_cache_key_changes_with_the_pin() {
        assert_ne!(fnv1a(&[b"a", b"b"]), fnv1a(&[b"ab", b""]));
        assert_eq!(fnv1a(&[b"go.mod"]), fnv1a(&[b"go.mod"]));
    }
}
