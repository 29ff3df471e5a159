//! kpr's container image (`cargo xtask image`), run the way deploy/daemonset.yaml runs it, with
//! an OCI runtime (runc, what containerd starts for the kubelet) in place of a kubelet: the
//! image's one layer as a read-only root file system; the DaemonSet's command and its
//! capabilities and no others (not privileged), no new privileges, /proc/sys read-only; the
//! node's network namespace (hostNetwork); bpffs, the cgroup and the ConfigMap's files mounted
//! where the DaemonSet mounts them. The "node" is a test namespace and the cgroup a test cgroup.
//! Needs root and `KPR_IMAGE` (the layout `cargo xtask test` builds).
use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{ConfigMap, Container as PodContainer},
};
use kpr_tests::{Harness, TIMEOUT, sa};
use sha2::{Digest as _, Sha256};
use testbed::tcp_ask;

const IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const HTTP: (&str, u16, &str) = ("http", 80, "TCP");
/// Where the container sees the test's manifests (the API's stand-in).
const MANIFESTS: &str = "/run/kpr/manifests";

fn deploy(file: &str) -> String {
    std::fs::read_to_string(format!("{}/../deploy/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

fn daemonset_container() -> PodContainer {
    let daemonset: DaemonSet = serde_yaml::from_str(&deploy("daemonset.yaml")).unwrap();
    daemonset.spec.template.spec.unwrap().containers.remove(0)
}

fn mount_path(container: &PodContainer, volume: &str) -> String {
    let mounts = container.volume_mounts.as_ref().unwrap();
    mounts.iter().find(|m| m.name == volume).unwrap_or_else(|| panic!("no {volume} mount")).mount_path.clone()
}

fn hex_sha256(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

/// The blob a descriptor names, checked against its digest and size.
fn blob(layout: &Path, descriptor: &serde_json::Value) -> Vec<u8> {
    let digest = descriptor["digest"].as_str().unwrap();
    let hex = digest.strip_prefix("sha256:").unwrap();
    let data = std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap();
    assert_eq!(hex_sha256(&data), hex, "blob {digest} has another digest");
    assert_eq!(descriptor["size"].as_u64(), Some(data.len() as u64), "blob {digest} has another size");
    data
}

/// Check the layout (index → manifest → config and layer, every digest), unpack the layer into
/// `rootfs`; returns the layer's entries.
fn unpack(layout: &Path, rootfs: &Path) -> Vec<String> {
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let manifest: serde_json::Value = serde_json::from_slice(&blob(layout, &index["manifests"][0])).unwrap();
    let config: serde_json::Value = serde_json::from_slice(&blob(layout, &manifest["config"])).unwrap();
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "one layer");
    let gz = blob(layout, &layers[0]);
    let mut tar = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut tar).unwrap();
    assert_eq!(config["rootfs"]["diff_ids"][0].as_str().unwrap(), format!("sha256:{}", hex_sha256(&tar)));
    let mut archive = tar::Archive::new(&tar[..]);
    let entries = archive
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().to_string_lossy().trim_end_matches('/').to_owned())
        .collect();
    tar::Archive::new(&tar[..]).unpack(rootfs).unwrap();
    entries
}

/// Linux capability numbers (linux/capability.h) of the names a pod spec uses.
fn capability_bit(name: &str) -> u32 {
    match name {
        "NET_ADMIN" => 12,
        "SYS_ADMIN" => 21,
        "SYS_RESOURCE" => 24,
        "PERFMON" => 38,
        "BPF" => 39,
        other => panic!("capability {other}: add it to this table"),
    }
}

/// This process's capability set of `field` (`CapEff`, `CapBnd`) of /proc/`pid`/status.
fn capability_set(pid: &str, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = status.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':')).unwrap().trim();
    u64::from_str_radix(hex, 16).unwrap()
}

/// The DaemonSet's capabilities that this machine can grant: a sandbox's bounding set may lack
/// one (SYS_RESOURCE, which only kernels before 5.11 use), which is said, not hidden.
fn granted_capabilities(container: &PodContainer) -> Vec<String> {
    let security = container.security_context.as_ref().unwrap();
    let wanted = security.capabilities.as_ref().unwrap().add.as_ref().unwrap();
    let bounding = capability_set("self", "CapBnd");
    let (granted, missing): (Vec<String>, Vec<String>) =
        wanted.iter().cloned().partition(|c| bounding & (1 << capability_bit(c)) != 0);
    if !missing.is_empty() {
        eprintln!("this machine's bounding set lacks {missing:?}: the container gets {granted:?}");
    }
    granted
}

/// A container run by runc from an unpacked image, stopped and deleted on drop.
struct Container {
    id: String,
    state: PathBuf,
    child: Option<Child>,
}

impl Container {
    fn runc(&self) -> Command {
        let mut cmd = Command::new("runc");
        cmd.arg("--root").arg(&self.state);
        cmd
    }

    /// `runc run` of `bundle` (foreground; its output appended to `log`).
    fn run(id: &str, state: &Path, bundle: &Path, log: &Path) -> Self {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
        let mut c = Self { id: id.to_owned(), state: state.to_owned(), child: None };
        let mut run = c.runc();
        // A test killed outright takes its runc (and so the container's agent) with it.
        testbed::die_with_parent(&mut run);
        let child = run
            .args(["run", "--bundle"])
            .arg(bundle)
            .arg(id)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("runc (installed by cargo xtask setup)");
        c.child = Some(child);
        c
    }

    /// The container's process, as this machine's pid namespace sees it.
    fn pid(&self) -> u32 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let out = self.runc().args(["state", &self.id]).output().unwrap();
            if let Ok(state) = serde_json::from_slice::<serde_json::Value>(&out.stdout)
                && state["status"] == "running"
            {
                return state["pid"].as_u64().unwrap() as u32;
            }
            assert!(Instant::now() < deadline, "container {} never ran", self.id);
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Wait up to `timeout` for the container's process to end on its own: its exit status.
    fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.as_mut()?.try_wait().ok().flatten() {
                self.child = None;
                let _ = self.runc().args(["delete", "--force", &self.id]).status();
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// SIGTERM, as the kubelet stops a pod, then wait for the container to end.
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        let _ = self.runc().args(["kill", &self.id, "TERM"]).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while child.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                let _ = self.runc().args(["kill", &self.id, "KILL"]).status();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.runc().args(["delete", "--force", &self.id]).status();
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A bundle for runc: the image's root file system and a runtime spec made from the
/// DaemonSet's container (command, capabilities, mounts), in the node namespace `netns`.
fn bundle(h: &Harness, dir: &Path, config_dir: &Path, container: &PodContainer, caps: &[String]) -> Vec<String> {
    let rootfs = dir.join("rootfs");
    std::fs::create_dir_all(&rootfs).unwrap();
    let layout = PathBuf::from(std::env::var_os("KPR_IMAGE").expect("KPR_IMAGE: run through cargo xtask test"));
    let entries = unpack(&layout, &rootfs);

    let security = container.security_context.as_ref().unwrap();
    assert_ne!(security.privileged, Some(true), "the DaemonSet asks for capabilities, not privileged");
    let caps_oci: Vec<String> = caps.iter().map(|c| format!("CAP_{c}")).collect();
    let mut args = container.command.clone().unwrap();
    // The test's stand-ins: manifests for the API, its own pins and node name.
    args.extend(["--manifests".into(), MANIFESTS.into(), "--pin-root".into(), h.pin_root.display().to_string()]);
    args.extend(["--hostname-override".into(), "test-node".into()]);
    // The node's iptables lock (a file of the test's here).
    let lock = dir.join("xtables.lock");
    std::fs::write(&lock, "").unwrap();
    let bind = |source: &Path, destination: &str, mode: &str| serde_json::json!({"destination": destination, "type": "bind", "source": source, "options": ["rbind", mode]});
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": ["PATH=/usr/local/bin", "RUST_LOG=info", "NO_COLOR=1"],
            "cwd": "/",
            "capabilities": {"bounding": caps_oci, "effective": caps_oci, "permitted": caps_oci},
            "noNewPrivileges": security.allow_privilege_escalation == Some(false),
        },
        "root": {"path": "rootfs", "readonly": true},
        "hostname": "kpr",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            bind(Path::new("/sys/fs/bpf"), &mount_path(container, "bpffs"), "rw"),
            bind(&h.cgroup.path, &mount_path(container, "cgroup2"), "rw"),
            bind(config_dir, &mount_path(container, "config"), "ro"),
            bind(&h.manifests, MANIFESTS, "ro"),
            bind(&lock, &mount_path(container, "xtables-lock"), "rw"),
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
                {"type": "network", "path": format!("/run/netns/{}", h.topology.client.name)},
            ],
            // containerd's defaults for an unprivileged container.
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    });
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    entries
}

/// The ConfigMap's files in a directory, as the kubelet projects them.
fn config_dir(dir: &Path) -> PathBuf {
    let configmap: ConfigMap = serde_yaml::from_str(&deploy("configmap.yaml")).unwrap();
    let out = dir.join("config");
    std::fs::create_dir_all(&out).unwrap();
    for (name, text) in configmap.data.unwrap() {
        std::fs::write(out.join(name), text).unwrap();
    }
    out
}

fn tcp_spread(h: &Harness, n: usize) -> BTreeMap<String, usize> {
    h.client(move || {
        let mut seen = BTreeMap::new();
        for _ in 0..n {
            let (name, peer) = tcp_ask(sa(IP, 80), TIMEOUT).expect("TCP through the ClusterIP");
            assert_eq!(peer, SocketAddr::from(sa(IP, 80)), "the client sees the ClusterIP");
            *seen.entry(name).or_insert(0) += 1;
        }
        seen
    })
}

/// GET `path` of the agent's healthz server, on the node's loopback (a hostNetwork pod's
/// probe): the status code.
fn probe(h: &Harness, path: &'static str) -> u16 {
    h.client(move || kpr_tests::http_get("127.0.0.1:10256".parse().unwrap(), path).map(|(code, _)| code).unwrap_or(0))
}

#[test]
fn image_runs_with_the_daemonsets_capabilities_and_a_new_pod_keeps_connections() {
    let h = Harness::new("ki-image", &["pod-a", "pod-b"]).expect("harness");
    h.write_service("web", IP, &[HTTP], &[0, 1]).unwrap();
    let work = std::env::temp_dir().join(format!("{}-runc", h.name));
    let state = work.join("state");
    std::fs::create_dir_all(&state).unwrap();
    let container = daemonset_container();
    let config = config_dir(&work);
    let bundle_dir = work.join("bundle");
    let entries = bundle(&h, &bundle_dir, &config, &container, &granted_capabilities(&container));
    // kpr, and the netfilter tools of --cleanup-kube-proxy with their libraries: no shell.
    for wanted in
        ["usr/local/bin/kpr", "usr/sbin/nft", "usr/sbin/iptables-nft-restore", "usr/sbin/iptables-legacy-save"]
    {
        assert!(entries.iter().any(|e| e == wanted), "the image has {wanted}: {entries:?}");
    }
    assert!(!entries.iter().any(|e| e.ends_with("bin/sh")), "no shell in the image: {entries:?}");

    let log = h.log_path();
    let mut first = Container::run(&format!("{}-1", h.name), &state, &bundle_dir, &log);
    h.wait("10.96.0.10:80/TCP", Some(2)).unwrap();
    let pid = first.pid();

    // Exactly the DaemonSet's capabilities, no more.
    let wanted: u64 = granted_capabilities(&container).iter().map(|c| 1u64 << capability_bit(c)).sum();
    assert_eq!(capability_set(&pid.to_string(), "CapEff"), wanted, "the agent's effective capabilities");

    // The takeover's tools run in the image, with the DaemonSet's capabilities, in the node's
    // netfilter (each in a container of its own: `runc exec` cannot enter a container whose
    // root was set by chroot, as runc does in the VMs' initramfs).
    for (i, tool) in
        [&["/usr/sbin/nft", "list", "tables"][..], &["/usr/sbin/iptables-nft-save", "-t", "nat"][..]].iter().enumerate()
    {
        let tool_bundle = work.join(format!("tool-{i}"));
        bundle(&h, &tool_bundle, &config, &container, &granted_capabilities(&container));
        let spec_path = tool_bundle.join("config.json");
        let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&spec_path).unwrap()).unwrap();
        spec["process"]["args"] = serde_json::json!(tool);
        std::fs::write(&spec_path, serde_json::to_vec(&spec).unwrap()).unwrap();
        let tool_log = work.join(format!("tool-{i}.log"));
        let mut run = Container::run(&format!("{}-tool-{i}", h.name), &state, &tool_bundle, &tool_log);
        let status = run.wait_exit(Duration::from_secs(30));
        let text = std::fs::read_to_string(&tool_log).unwrap_or_default();
        assert!(status.is_some_and(|s| s.success()), "{tool:?} in the image: {status:?}\n{text}");
    }
    let seen = tcp_spread(&h, 40);
    assert_eq!(seen.len(), 2, "both pods answer through the ClusterIP: {seen:?}");
    assert_eq!(probe(&h, "/healthz"), 200, "readiness probe");
    assert_eq!(probe(&h, "/livez"), 200, "liveness probe");
    // Set over rtnetlink: the container's /proc/sys is read-only.
    // veth0: the node's side of pod-a's link.
    let accept_local =
        h.client(|| std::fs::read_to_string("/proc/sys/net/ipv4/conf/veth0/accept_local").unwrap().trim().to_owned());
    assert_eq!(accept_local, "1", "accept_local on the links kpr serves, from a container");

    // A rolling update: the old pod ends, the new one starts on the same pins.
    let mut conn = h.client(|| {
        let conn = TcpStream::connect_timeout(&sa(IP, 80).into(), TIMEOUT).unwrap();
        conn.set_read_timeout(Some(TIMEOUT)).unwrap();
        conn
    });
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line).unwrap();
    first.stop();
    let mut second = Container::run(&format!("{}-2", h.name), &state, &bundle_dir, &log);
    second.pid();
    conn.write_all(b"after the update\n").unwrap();
    let mut echo = String::new();
    BufReader::new(&conn).read_line(&mut echo).expect("the connection outlives the old pod");
    assert_eq!(echo.trim_end(), "after the update");
    // The new pod programs changes: a service written after it started.
    h.write_service("later", Ipv4Addr::new(10, 96, 0, 11), &[HTTP], &[1]).unwrap();
    h.wait("10.96.0.11:80/TCP", Some(1)).unwrap();
    let later = h.client(|| tcp_ask(sa(Ipv4Addr::new(10, 96, 0, 11), 80), TIMEOUT).unwrap().0);
    assert_eq!(later, h.pod_name(1));
    assert_eq!(tcp_spread(&h, 20).len(), 2);
    second.stop();
    let _ = std::fs::remove_dir_all(&work);
}

/// Least privilege: without any one of the DaemonSet's capabilities (but SYS_RESOURCE, which
/// this kernel does not use, and SYS_ADMIN, which only the aborts of connected UDP sockets in
/// the pods' namespaces use), the agent cannot start, and says what it was refused. SYS_ADMIN
/// would stand in for BPF and PERFMON (the kernel's `bpf_capable`, `perfmon_capable`): each is
/// dropped with it.
#[test]
fn each_of_the_daemonsets_capabilities_is_needed() {
    let h = Harness::new("ki-caps", &["pod-a"]).expect("harness");
    h.write_service("web", IP, &[HTTP], &[0]).unwrap();
    let work = std::env::temp_dir().join(format!("{}-runc", h.name));
    let state = work.join("state");
    std::fs::create_dir_all(&state).unwrap();
    let container = daemonset_container();
    let config = config_dir(&work);
    let granted = granted_capabilities(&container);
    for (i, dropped) in granted.iter().filter(|c| !["SYS_RESOURCE", "SYS_ADMIN"].contains(&c.as_str())).enumerate() {
        let caps: Vec<String> = granted.iter().filter(|c| *c != dropped && *c != "SYS_ADMIN").cloned().collect();
        let bundle_dir = work.join(format!("bundle-{i}"));
        bundle(&h, &bundle_dir, &config, &container, &caps);
        let log = work.join(format!("without-{dropped}.log"));
        let mut c = Container::run(&format!("{}-{i}", h.name), &state, &bundle_dir, &log);
        let status = c.wait_exit(Duration::from_secs(30));
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(status.is_some_and(|s| !s.success()), "without {dropped} the agent must fail to start:\n{text}");
        assert!(
            // Refused outright, or by the verifier's rules for programs without PERFMON.
            ["Permission denied", "Operation not permitted", "verifier rejected"].iter().any(|m| text.contains(m)),
            "without {dropped}, the agent says what it was refused:\n{text}"
        );
    }
    let _ = std::fs::remove_dir_all(&work);
}
