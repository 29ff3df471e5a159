//! `cargo xtask image`: kpr's container image, built offline with no base image. One layer
//! holds a static (musl) `kpr` at /usr/local/bin/kpr, which reads the kernel's /proc and /sys
//! and talks to the API server (no shell, no certificates: the API server's CA comes from the
//! service account's mount), and the netfilter tools that take a node over from kube-proxy
//! (iptables' save/restore, nft) with their libraries, from this machine's Debian packages.
//!
//! The output is an OCI image layout (`target/image/kpr`, as `umoci`, `skopeo` and
//! `crane` read it) and the same layout as one tar (`target/image/kpr.oci.tar`), which
//! `ctr images import` and `docker load` take. Entries, times and owners are fixed, so the
//! same binary gives the same digests.
//!
//! The tests' pod image, `kpr-testpod`, is written the same way: a static `kpr-probe` alone.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result};
use serde_json::json;
use sha2::{Digest as _, Sha256};

use crate::setup;

pub const MUSL_TARGET: &str = "x86_64-unknown-linux-musl";
const BINARY_PATH: &str = "/usr/local/bin/kpr";

/// What one image holds: its repository name (`docker.io/library/<name>`), root file system and
/// command.
struct Image {
    name: &'static str,
    files: BTreeMap<String, Entry>,
    entrypoint: &'static str,
    cmd: &'static str,
}

/// Build the static binary and write the image; returns the layout directory
/// (`target/image/kpr`, or `target/image/kpr-<tag>` for a tag other than `latest`).
pub fn build(root: &Path, env: &setup::Env, tag: &str) -> Result<PathBuf> {
    let binary = static_binary(root, env, "proxy-user", "kpr")?;
    let mut files = netfilter_tools()?;
    files.insert(BINARY_PATH.trim_start_matches('/').to_owned(), Entry::File(binary, 0o755));
    write_image(root, &Image { name: "kpr", files, entrypoint: BINARY_PATH, cmd: "agent" }, tag)
}

/// The test pods' image, `kpr-testpod:latest`: `kpr-probe` alone (it serves, asks, holds a
/// connection, or pauses; also the kubelets' sandbox image in `tests/tests/daemonset.rs`).
pub fn build_testpod(root: &Path, env: &setup::Env) -> Result<PathBuf> {
    let binary = static_binary(root, env, "kpr-tests", "kpr-probe")?;
    let files = BTreeMap::from([("kpr-probe".to_owned(), Entry::File(binary, 0o755))]);
    write_image(root, &Image { name: "kpr-testpod", files, entrypoint: "/kpr-probe", cmd: "pause" }, "latest")
}

/// `bin` of `package`, built static (musl, release) and stripped: symbols are half the
/// binary and nothing in a container reads them.
fn static_binary(root: &Path, env: &setup::Env, package: &str, bin: &str) -> Result<Vec<u8>> {
    let mut cargo = env.cargo(root);
    cargo.args(["build", "--release", "--package", package, "--bin", bin, "--target", MUSL_TARGET]);
    crate::run(&mut cargo)?;
    let built = static_binary_path(root, bin);
    let out = root.join("target/image");
    fs::create_dir_all(&out)?;
    let stripped = out.join(format!("{bin}.stripped"));
    crate::run(Command::new("strip").arg("--strip-all").arg(&built).arg("-o").arg(&stripped))?;
    Ok(fs::read(&stripped)?)
}

/// Where [`static_binary`] builds `bin` (unstripped).
pub fn static_binary_path(root: &Path, bin: &str) -> PathBuf {
    root.join("target").join(MUSL_TARGET).join("release").join(bin)
}

/// Write `image` as an OCI layout and its tar under target/image; returns the layout directory.
fn write_image(root: &Path, image: &Image, tag: &str) -> Result<PathBuf> {
    let out = root.join("target/image");
    let dir_name = if tag == "latest" { image.name.to_owned() } else { format!("{}-{tag}", image.name) };
    let layout = out.join(&dir_name);
    let revision = git_revision(root);
    write_layout(&layout, image, tag, &revision)?;
    let archive = out.join(format!("{dir_name}.oci.tar"));
    archive_layout(&layout, &archive)?;
    let layer_size: u64 = fs::read_dir(layout.join("blobs/sha256"))?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .max()
        .unwrap_or(0);
    let binary_size = match image.files.get(image.entrypoint.trim_start_matches('/')) {
        Some(Entry::File(data, _)) => data.len(),
        _ => 0,
    };
    println!(
        "xtask: image {}:{tag} ({revision}): {} (layout), {} (archive); layer {:.1} MiB compressed, binary {:.1} MiB",
        image.name,
        layout.display(),
        archive.display(),
        layer_size as f64 / 1048576.0,
        binary_size as f64 / 1048576.0,
    );
    Ok(layout)
}

/// The OCI image layout: `oci-layout`, `index.json` and the blobs (layer, config, manifest).
fn write_layout(dir: &Path, image: &Image, tag: &str, revision: &str) -> Result<()> {
    if dir.exists() {
        fs::remove_dir_all(dir)?;
    }
    fs::create_dir_all(dir.join("blobs/sha256"))?;
    let layer_tar = layer(&image.files)?;
    let diff_id = sha256(&layer_tar);
    let mut gz = flate2::GzBuilder::new().mtime(0).write(Vec::new(), flate2::Compression::best());
    gz.write_all(&layer_tar)?;
    let layer_gz = gz.finish()?;
    let layer = blob(dir, &layer_gz)?;

    let config = serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": [image.entrypoint],
            "Cmd": [image.cmd],
            // The tag too: images of one build under two tags are two images (a rolling
            // update's "new image" in the tests).
            "Labels": { "org.opencontainers.image.revision": revision, "org.opencontainers.image.version": tag },
        },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{diff_id}")] },
        "history": [{ "created_by": "cargo xtask image" }],
    }))?;
    let config = blob(dir, &config)?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": descriptor("application/vnd.oci.image.config.v1+json", &config),
        "layers": [descriptor("application/vnd.oci.image.layer.v1.tar+gzip", &layer)],
        "annotations": { "org.opencontainers.image.revision": revision },
    }))?;
    let manifest = blob(dir, &manifest)?;
    let mut entry = descriptor("application/vnd.oci.image.manifest.v1+json", &manifest);
    entry["annotations"] = json!({
        "org.opencontainers.image.ref.name": tag,
        // containerd's importer names the image after this.
        "io.containerd.image.name": format!("docker.io/library/{}:{tag}", image.name),
    });
    let index = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [entry],
    });
    fs::write(dir.join("index.json"), serde_json::to_vec_pretty(&index)?)?;
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    Ok(())
}

/// The tools `kpr agent --cleanup-kube-proxy` removes kube-proxy's rules with (the ones
/// kube-proxy itself uses), taken from this machine's Debian packages with the shared
/// libraries they load: (path, the names linked to it in its directory).
const NETFILTER_TOOLS: [(&str, &[&str]); 3] = [
    (
        "/usr/sbin/xtables-nft-multi",
        &["iptables-nft-save", "iptables-nft-restore", "ip6tables-nft-save", "ip6tables-nft-restore"],
    ),
    (
        "/usr/sbin/xtables-legacy-multi",
        &["iptables-legacy-save", "iptables-legacy-restore", "ip6tables-legacy-save", "ip6tables-legacy-restore"],
    ),
    ("/usr/sbin/nft", &[]),
];
/// iptables' match and target extensions (`-m comment`, `-j MARK`, ...), loaded when it parses rules.
const XTABLES_EXTENSIONS: &str = "/usr/lib/x86_64-linux-gnu/xtables";

/// The netfilter tools with the libraries and extensions they load.
fn netfilter_tools() -> Result<BTreeMap<String, Entry>> {
    let mut files: BTreeMap<String, Entry> = BTreeMap::new();
    for (tool, links) in NETFILTER_TOOLS {
        let name = Path::new(tool).file_name().expect("a file").to_string_lossy().into_owned();
        files.insert(tool.trim_start_matches('/').to_owned(), Entry::File(fs::read(tool)?, 0o755));
        for link in links {
            files.insert(format!("usr/sbin/{link}"), Entry::Symlink(name.clone()));
        }
        for library in shared_libraries(tool)? {
            let data = fs::read(&library).with_context(|| format!("reading {library}"))?;
            files.insert(library.trim_start_matches('/').to_owned(), Entry::File(data, 0o755));
        }
    }
    for extension in fs::read_dir(XTABLES_EXTENSIONS).with_context(|| format!("reading {XTABLES_EXTENSIONS}"))? {
        let path = extension?.path();
        let data = fs::read(&path)?; // symlinks followed: each alias is its own copy
        files.insert(path.to_string_lossy().trim_start_matches('/').to_owned(), Entry::File(data, 0o644));
    }
    Ok(files)
}

/// The root file system as one tar layer, owned by root.
fn layer(files: &BTreeMap<String, Entry>) -> Result<Vec<u8>> {
    // Parent directories first, each once; then the entries in path order.
    let mut dirs: BTreeSet<String> = BTreeSet::new();
    for path in files.keys() {
        let mut parent = Path::new(path).parent();
        while let Some(dir) = parent.filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(format!("{}/", dir.display()));
            parent = dir.parent();
        }
    }
    let mut tar = tar::Builder::new(Vec::new());
    for dir in &dirs {
        let mut header = header(tar::EntryType::Directory, 0o755, 0);
        tar.append_data(&mut header, dir, std::io::empty())?;
    }
    for (path, entry) in files.iter() {
        match entry {
            Entry::File(data, mode) => {
                let mut header = header(tar::EntryType::Regular, *mode, data.len() as u64);
                tar.append_data(&mut header, path, &data[..])?;
            }
            Entry::Symlink(target) => {
                let mut header = header(tar::EntryType::Symlink, 0o777, 0);
                tar.append_link(&mut header, path, target)?;
            }
        }
    }
    Ok(tar.into_inner()?)
}

enum Entry {
    File(Vec<u8>, u32),
    Symlink(String),
}

/// The shared libraries `binary` loads (and the loader), as `ldd` resolves them here.
fn shared_libraries(binary: &str) -> Result<Vec<String>> {
    let out = Command::new("ldd").arg(binary).output().with_context(|| format!("ldd {binary}"))?;
    anyhow::ensure!(out.status.success(), "ldd {binary} failed");
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` or `/lib64/ld-linux-x86-64.so.2 (0x...)`
        .filter_map(|l| l.split("=>").last()?.split_whitespace().next().filter(|p| p.starts_with('/')))
        .map(str::to_owned)
        .collect())
}

fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut header = tar::Header::new_ustar();
    header.set_entry_type(kind);
    header.set_mode(mode);
    header.set_size(size);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header
}

struct Blob {
    digest: String,
    size: usize,
}

fn blob(dir: &Path, data: &[u8]) -> Result<Blob> {
    let digest = sha256(data);
    fs::write(dir.join("blobs/sha256").join(&digest), data)?;
    Ok(Blob { digest: format!("sha256:{digest}"), size: data.len() })
}

fn descriptor(media_type: &str, blob: &Blob) -> serde_json::Value {
    json!({ "mediaType": media_type, "digest": blob.digest, "size": blob.size })
}

fn sha256(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

/// The layout as one tar (what `ctr images import` and `docker load` read).
fn archive_layout(layout: &Path, archive: &Path) -> Result<()> {
    let mut tar = tar::Builder::new(fs::File::create(archive)?);
    tar.mode(tar::HeaderMode::Deterministic);
    let mut files: Vec<PathBuf> = vec![layout.join("oci-layout"), layout.join("index.json")];
    let mut blobs: Vec<PathBuf> =
        fs::read_dir(layout.join("blobs/sha256"))?.map(|e| Ok(e?.path())).collect::<Result<_>>()?;
    blobs.sort();
    files.extend(blobs);
    for file in files {
        let name = file.strip_prefix(layout).expect("inside the layout");
        tar.append_path_with_name(&file, name).with_context(|| format!("archiving {}", file.display()))?;
    }
    tar.finish()?;
    Ok(())
}

fn git_revision(root: &Path) -> String {
    Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(root)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned())
}
