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

/// What one image holds: its name (the layout's directory), repository (`docker.io/library/<name>`
/// unless set), root file system, command and environment.
struct Image {
    name: &'static str,
    repository: Option<&'static str>,
    files: BTreeMap<String, Entry>,
    entrypoint: &'static str,
    cmd: &'static str,
    env: &'static [&'static str],
}

impl Image {
    fn new(name: &'static str, files: BTreeMap<String, Entry>, entrypoint: &'static str, cmd: &'static str) -> Self {
        Self { name, repository: None, files, entrypoint, cmd, env: &[] }
    }
}

/// Build the static binary and write the image; returns the layout directory
/// (`target/image/kpr`, or `target/image/kpr-<tag>` for a tag other than `latest`).
pub fn build(root: &Path, env: &setup::Env, tag: &str) -> Result<PathBuf> {
    let binary = static_binary(root, env, "proxy-user", "kpr")?;
    let mut files = netfilter_tools()?;
    files.insert(BINARY_PATH.trim_start_matches('/').to_owned(), Entry::File(binary, 0o755));
    write_image(root, &Image::new("kpr", files, BINARY_PATH, "agent"), tag)
}

/// The test pods' image, `kpr-testpod:latest`: `kpr-probe` alone (it serves, asks, holds a
/// connection, or pauses; also the kubelets' sandbox image in `tests/tests/daemonset.rs`).
pub fn build_testpod(root: &Path, env: &setup::Env) -> Result<PathBuf> {
    let binary = static_binary(root, env, "kpr-tests", "kpr-probe")?;
    let files = BTreeMap::from([("kpr-probe".to_owned(), Entry::File(binary, 0o755))]);
    write_image(root, &Image::new("kpr-testpod", files, "/kpr-probe", "pause"), "latest")
}

/// The static binaries of the images: (package, binary).
const STATIC_BINARIES: [(&str, &str); 2] = [("proxy-user", "kpr"), ("kpr-tests", "kpr-probe")];

/// `bin` of `package`, built static (musl, release) and stripped: symbols are half the
/// binary and nothing in a container reads them. Every image's binary is built in one cargo
/// run: built one at a time, the test pods' resolved other features of the shared
/// dependencies and compiled them again (1 min 45 s).
fn static_binary(root: &Path, env: &setup::Env, package: &str, bin: &str) -> Result<Vec<u8>> {
    debug_assert!(STATIC_BINARIES.contains(&(package, bin)), "{package} {bin}");
    let mut cargo = env.cargo(root);
    cargo.args(["build", "--release", "--target", MUSL_TARGET]);
    for (package, bin) in STATIC_BINARIES {
        cargo.args(["--package", package, "--bin", bin]);
    }
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
    let mut gz = flate2::GzBuilder::new().mtime(0).write(Vec::new(), flate2::Compression::default());
    gz.write_all(&layer_tar)?;
    let layer_gz = gz.finish()?;
    let layer = blob(dir, &layer_gz)?;

    let mut run = json!({
        "Entrypoint": [image.entrypoint],
        "Cmd": [image.cmd],
        // The tag too: images of one build under two tags are two images (a rolling
        // update's "new image" in the tests).
        "Labels": { "org.opencontainers.image.revision": revision, "org.opencontainers.image.version": tag },
    });
    if !image.env.is_empty() {
        run["Env"] = json!(image.env);
    }
    let config = serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": run,
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
        "io.containerd.image.name": match image.repository {
            Some(repository) => format!("{repository}:{tag}"),
            None => format!("docker.io/library/{}:{tag}", image.name),
        },
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
        add_libraries(&mut files, tool)?;
    }
    for extension in fs::read_dir(XTABLES_EXTENSIONS).with_context(|| format!("reading {XTABLES_EXTENSIONS}"))? {
        let path = extension?.path();
        let data = fs::read(&path)?; // symlinks followed: each alias is its own copy
        // Their own libraries too (`statistic` loads libm): a missing one fails the rule's load.
        add_libraries(&mut files, &path.to_string_lossy())?;
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

#[derive(Clone)]
enum Entry {
    File(Vec<u8>, u32),
    Symlink(String),
}

/// The shared libraries `binary` loads, at their paths in `files`.
fn add_libraries(files: &mut BTreeMap<String, Entry>, binary: &str) -> Result<()> {
    for library in shared_libraries(binary)? {
        let data = fs::read(&library).with_context(|| format!("reading {library}"))?;
        files.insert(library.trim_start_matches('/').to_owned(), Entry::File(data, 0o755));
    }
    Ok(())
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

/// The images the pinned e2e suite asks for (`test/utils/image/manifest.go`): the key of its
/// `configs` table and the repository; their tags are read from the pinned sources.
pub const E2E_IMAGES: [(&str, &str); 7] = [
    ("Agnhost", "registry.k8s.io/e2e-test-images/agnhost"),
    ("Pause", "registry.k8s.io/pause"),
    ("BusyBox", "registry.k8s.io/e2e-test-images/busybox"),
    ("RegressionIssue74839", "registry.k8s.io/e2e-test-images/regression-issue-74839"),
    // The CLOSE_WAIT spec's host-network pod: it runs `sleep`, `sh`, `conntrack` and `grep`.
    ("DistrolessIptables", "registry.k8s.io/build-image/distroless-iptables"),
    // The DNS specs' "jessie" prober: `dig`, `getent`, a shell.
    ("GlibcDnsTesting", "registry.k8s.io/e2e-test-images/glibc-dns-testing"),
    // The kube-proxy DaemonSet of `cargo xtask e2e` (not the suite's).
    ("KubeProxy", "docker.io/library/kpr-kube-proxy"),
];

/// The images of the e2e network suite (`cargo xtask e2e`), offline, under the names the suite
/// asks for so that the kubelets' `IfNotPresent` finds them: `agnhost` (the suite's Go binary,
/// the CoreDNS built beside it, and the tools its specs shell out to, from this machine's
/// Debian packages, as upstream's alpine-based image has them; also under the names of
/// `distroless-iptables` and `glibc-dns-testing`), `pause`, `busybox`, `regression-issue-74839`, and the pinned
/// kube-proxy with the netfilter tools (`kpr-kube-proxy`), the suite's reference proxy.
/// `k8s_src` is the pinned Kubernetes source tree (agnhost's TLS pair for `porter`), `tags`
/// maps [`E2E_IMAGES`]' keys to tags. Returns the archives.
pub fn build_e2e(
    root: &Path,
    e2e_bin: &Path,
    k8s_bin: &Path,
    k8s_src: &Path,
    tags: &BTreeMap<String, String>,
) -> Result<Vec<PathBuf>> {
    let read = |dir: &Path, name: &str| fs::read(dir.join(name)).with_context(|| format!("reading {name}"));
    let agnhost = read(e2e_bin, "agnhost")?;
    let mut agnhost_files = debian_tools(AGNHOST_TOOLS, "/usr/bin/dash")?;
    agnhost_files.insert("agnhost".to_owned(), Entry::File(agnhost.clone(), 0o755));
    agnhost_files.insert("coredns".to_owned(), Entry::File(read(e2e_bin, "coredns")?, 0o755));
    // Upstream's Dockerfile adds `porter`'s key pair at the root (the specs point
    // `CERT_FILE`/`KEY_FILE` there).
    let porter = k8s_src.join("test/images/agnhost/porter");
    for name in ["localhost.crt", "localhost.key"] {
        agnhost_files.insert(name.to_owned(), Entry::File(read(&porter, name)?, 0o644));
    }
    for (path, text) in AGNHOST_ETC {
        agnhost_files.insert((*path).to_owned(), Entry::File(text.as_bytes().to_vec(), 0o644));
    }
    const PATH: &[&str] = &["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"];
    let image = |name, key: &str, files, entrypoint, cmd, env| -> Result<(Image, String)> {
        let repository = E2E_IMAGES.iter().find(|(k, _)| *k == key).map(|(_, r)| *r).expect("listed");
        let tag = if key == "KubeProxy" {
            "latest".to_owned()
        } else {
            tags.get(key).with_context(|| format!("no tag for {key}"))?.clone()
        };
        Ok((Image { name, repository: Some(repository), files, entrypoint, cmd, env }, tag))
    };
    let regression = read(e2e_bin, "regression-issue-74839")?;
    let images = [
        image("agnhost", "Agnhost", agnhost_files.clone(), "/agnhost", "pause", PATH)?,
        image("distroless-iptables", "DistrolessIptables", agnhost_files.clone(), "/agnhost", "pause", PATH)?,
        image("glibc-dns-testing", "GlibcDnsTesting", agnhost_files, "/agnhost", "pause", PATH)?,
        // agnhost's own `pause` is what pause does: sleep until a signal.
        image(
            "pause",
            "Pause",
            BTreeMap::from([("pause".to_owned(), Entry::File(agnhost, 0o755))]),
            "/pause",
            "pause",
            &[],
        )?,
        image(
            "busybox",
            "BusyBox",
            debian_tools(&["/usr/bin/busybox"], "/usr/bin/busybox")?,
            "/usr/bin/busybox",
            "sh",
            PATH,
        )?,
        image(
            "regression-issue-74839",
            "RegressionIssue74839",
            BTreeMap::from([("regression-issue-74839".to_owned(), Entry::File(regression, 0o755))]),
            "/regression-issue-74839",
            "--help",
            &[],
        )?,
        image("kpr-kube-proxy", "KubeProxy", kube_proxy_files(k8s_bin)?, "/usr/local/bin/kube-proxy", "--help", PATH)?,
    ];
    let mut archives = Vec::new();
    for (image, tag) in &images {
        let layout = write_image(root, image, tag)?;
        archives.push(PathBuf::from(format!("{}.oci.tar", layout.display())));
    }
    Ok(archives)
}

/// kube-proxy (the pinned, static build) with iptables (nft and legacy), nft and conntrack;
/// `iptables` is the nft variant, as on this machine.
fn kube_proxy_files(k8s_bin: &Path) -> Result<BTreeMap<String, Entry>> {
    let mut files = netfilter_tools()?;
    files.extend(debian_tools(&["/usr/sbin/conntrack"], "")?);
    for link in ["iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"] {
        files.insert(format!("usr/sbin/{link}"), Entry::Symlink("xtables-nft-multi".to_owned()));
    }
    let binary = fs::read(k8s_bin.join("kube-proxy")).context("reading kube-proxy")?;
    files.insert("usr/local/bin/kube-proxy".to_owned(), Entry::File(binary, 0o755));
    Ok(files)
}

/// What agnhost's specs run besides agnhost (upstream's Dockerfile: bind-tools, curl,
/// netcat-openbsd, iproute2, iperf, bash; conntrack for the CLOSE_WAIT spec), and busybox for
/// the shell and coreutils.
const AGNHOST_TOOLS: &[&str] = &[
    "/usr/bin/busybox",
    "/usr/bin/dash",
    "/bin/bash",
    "/usr/bin/curl",
    // GNU wget: the static busybox's crashes resolving a name (static glibc, no NSS).
    "/usr/bin/wget",
    "/usr/bin/getent",
    "/usr/bin/nc.openbsd",
    "/usr/bin/dig",
    "/usr/bin/nslookup",
    "/usr/sbin/ip",
    "/usr/bin/ss",
    "/usr/sbin/conntrack",
    "/usr/bin/iperf",
];

const AGNHOST_ETC: &[(&str, &str)] = &[
    ("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"),
    ("etc/group", "root:x:0:\nnogroup:x:65534:\n"),
    ("etc/nsswitch.conf", "hosts: files dns\n"),
    ("tmp/.keep", ""),
];

/// `tools` from this machine with the libraries they load, at their paths; busybox's applets
/// as links for every other command (`seq`, `wget`, ...), `nc` for `nc.openbsd`, and `sh` is
/// `shell` (dash beside other tools: Debian's busybox shell runs its own applets before
/// `PATH`, and its `nc` is not OpenBSD's).
fn debian_tools(tools: &[&str], shell: &str) -> Result<BTreeMap<String, Entry>> {
    let mut files = BTreeMap::new();
    let mut provided = BTreeSet::new();
    for tool in tools {
        let data = fs::read(tool).with_context(|| format!("reading {tool} (`cargo xtask setup` installs it)"))?;
        let name = Path::new(tool).file_name().expect("a file").to_string_lossy().replace(".openbsd", "");
        provided.insert(name.clone());
        let dir = Path::new(tool).parent().expect("absolute").to_string_lossy().trim_start_matches('/').to_owned();
        files.insert(format!("{dir}/{name}"), Entry::File(data, 0o755));
        // busybox is static: nothing to load.
        if !tool.ends_with("busybox") {
            add_libraries(&mut files, tool)?;
        }
    }
    if tools.contains(&"/usr/bin/busybox") {
        let out = Command::new("/usr/bin/busybox").arg("--list-full").output().context("busybox --list-full")?;
        for applet in String::from_utf8_lossy(&out.stdout).lines() {
            let name = applet.rsplit('/').next().unwrap_or(applet);
            if !provided.contains(name) && !files.contains_key(applet) {
                files.insert(applet.to_owned(), Entry::Symlink("/usr/bin/busybox".to_owned()));
            }
        }
        files.insert("bin/sh".to_owned(), Entry::Symlink(shell.to_owned()));
    }
    Ok(files)
}

/// The tags of [`E2E_IMAGES`] in the pinned suite's `test/utils/image/manifest.go`.
pub fn e2e_tags(manifest_go: &str) -> Result<BTreeMap<String, String>> {
    // `configs[Agnhost] = Config{list.PromoterE2eRegistry, "agnhost", "2.63.0"}`
    let tag = |key: &str| -> Result<String> {
        let line = manifest_go
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("configs[{key}] =")))
            .with_context(|| format!("manifest.go has no configs[{key}]"))?;
        let quoted: Vec<&str> = line.split('"').collect();
        quoted.get(3).map(|t| (*t).to_owned()).with_context(|| format!("cannot read the tag in {line:?}"))
    };
    E2E_IMAGES
        .iter()
        .filter(|(key, _)| *key != "KubeProxy")
        .map(|(key, _)| Ok(((*key).to_owned(), tag(key)?)))
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_the_suites_image_tags() {
        let manifest = "\tconfigs[Agnhost] = Config{list.PromoterE2eRegistry, \"agnhost\", \"2.63.0\"}\n\
                        \tconfigs[AgnhostPrivate] = Config{list.PrivateRegistry, \"agnhost\", \"2.6\"}\n\
                        \tconfigs[BusyBox] = Config{list.PromoterE2eRegistry, \"busybox\", \"1.37.0-1\"}\n\
                        \tconfigs[DistrolessIptables] = Config{list.BuildImageRegistry, \"distroless-iptables\", \"v0.9.6\"}\n\
                        \tconfigs[GlibcDnsTesting] = Config{list.PromoterE2eRegistry, \"glibc-dns-testing\", \"2.0.0\"}\n\
                        \tconfigs[Pause] = Config{list.GcRegistry, \"pause\", \"3.10.2\"}\n\
                        \tconfigs[RegressionIssue74839] = Config{list.PromoterE2eRegistry, \"regression-issue-74839\", \"1.4\"}\n";
        let tags = super::e2e_tags(manifest).unwrap();
        assert_eq!(tags["Agnhost"], "2.63.0");
        assert_eq!(tags["Pause"], "3.10.2");
        assert_eq!(tags["DistrolessIptables"], "v0.9.6");
        assert!(!tags.contains_key("KubeProxy"));
        assert!(super::e2e_tags("configs[Agnhost] = Config{}").is_err());
    }
}
