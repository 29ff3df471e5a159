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
const BINARIES: &[(&str, &str)] = &[
    ("etcd", "go.etcd.io/etcd/server/v3"),
    ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
    ("kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager"),
    ("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
    ("kubelet", "k8s.io/kubernetes/cmd/kubelet"),
    ("kube-proxy", "k8s.io/kubernetes/cmd/kube-proxy"),
    ("kubectl", "k8s.io/kubernetes/cmd/kubectl"),
];

/// Bumped when the way the binaries are built changes (flags below), to invalidate caches.
const RECIPE: &str = "1";

/// The directory holding the binaries of the pinned version, building them first if needed.
pub fn ensure_k8s_binaries(root: &Path) -> Result<PathBuf> {
    let module = root.join("tools/k8s");
    let go_mod = fs::read_to_string(module.join("go.mod")).context("failed to read tools/k8s/go.mod")?;
    let go_sum = fs::read_to_string(module.join("go.sum")).context("failed to read tools/k8s/go.sum")?;
    let version = pinned_version(&go_mod)?;
    let key = format!("{version}-{:016x}", fnv1a(&[RECIPE.as_bytes(), go_mod.as_bytes(), go_sum.as_bytes()]));
    let dir = cache_root()?.join(format!("k8s-{key}"));
    let bin = dir.join("bin");
    let complete = |bin: &Path| BINARIES.iter().all(|(name, _)| bin.join(name).is_file());
    if !complete(&bin) {
        build(&module, &version, &dir)?;
    }
    // A convenience link in the (ignored) .tools directory.
    let link = root.join(".tools").join(format!("k8s-{version}"));
    if fs::read_link(&link).ok().as_deref() != Some(dir.as_path()) {
        fs::create_dir_all(root.join(".tools"))?;
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&dir, &link)?;
    }
    Ok(bin)
}

fn cache_root() -> Result<PathBuf> {
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
fn build(module: &Path, version: &str, dir: &Path) -> Result<()> {
    if Command::new("go").arg("version").output().is_err() {
        bail!("Go is required to build the tests' Kubernetes (etcd, kube-apiserver, kubelet, kube-proxy, ...)");
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
    println!(
        "setup: building etcd, the control plane, kubelet, kube-proxy and kubectl {version} from \
         tools/k8s (Go module proxy; about 20 minutes on 2 cores when Go's caches are cold)"
    );
    let started = Instant::now();
    for (name, pkg) in BINARIES {
        let status = Command::new("go")
            .args(["build", "-ldflags", &ldflags, "-o"])
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
    println!("setup: built the control plane in {:.0?} into {}", started.elapsed(), dir.display());
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
