//! Real Kubernetes nodes on one machine, for the DaemonSet test: each node is a network
//! namespace, a mount namespace and a cgroup of its own, running its own containerd (Debian's,
//! with runc and the CNI bridge plugin) and a kubelet built from `tools/k8s`, registered with
//! the test's API server, as kind runs nodes in containers, without a container engine.
//!
//! ```text
//!  host: etcd, kube-apiserver, controller-manager, scheduler (127.0.0.1)
//!    │ relay on each node's 127.0.0.1:6443
//!  node a (netns + mount ns + cgroup) ── eth0 192.168.77.1 ═══ 192.168.77.2 eth0 ── node b
//!    containerd, kubelet, cni0 10.244.1.1/24                 containerd, kubelet, cni0 10.244.2.1/24
//!    pods 10.244.1.x (CNI bridge)                            pods 10.244.2.x
//! ```
//!
//! In a node's mount namespace `/run` and `/var/log` are its own tmpfs and `/var/lib` a
//! directory of its own (the runtime's state, images, pod volumes and logs), `/sys/fs/bpf` is a
//! bpffs of its own (kpr's pins), and the cgroup2 hierarchy (`/sys/fs/cgroup/unified` on this hybrid host) is the node's
//! cgroup: everything the node runs, pods included, stays below it, and a kpr there balances
//! the node's sockets only. The kubelet's pod cgroups (cgroup v1 here) are under a cgroup root
//! of the node's name. The kernel settings the kubelet checks are shown to it, not changed on
//! the machine. All of it is removed on drop (every process of the node killed through its
//! cgroup), also when a test fails.
use std::{
    fs,
    net::{Ipv4Addr, SocketAddrV4},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use kpr::datapath::bpf;
use testbed::Netns;

use crate::cluster::{Cluster, Relay, k8s_bin, kubeconfig_yaml, spawn_child};

/// Where every node reaches the API server (a relay to the host's).
pub const API_PORT: u16 = 6443;
/// The cluster DNS Service's address the kubelets give the pods (`clusterDNS`).
pub const CLUSTER_DNS: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The host's address on its links to the nodes ([`Node::expose_to_host`]).
pub const HOST_LEG_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 76, 1);

/// The two nodes' addresses on their link, and their pod ranges (routed to each other).
pub const NODE_A: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
pub const NODE_B: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 2);
pub const PODS_A: &str = "10.244.1.0/24";
pub const PODS_B: &str = "10.244.2.0/24";

/// What the kubelet sets when it may (`setupKernelTunables`); a node's mount namespace shows
/// it these values so that it needs to change nothing on the machine.
const KUBELET_SYSCTLS: [(&str, &str); 6] = [
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

/// One node: its name in the cluster, address and pod range.
pub struct Node {
    pub name: String,
    pub ip: Ipv4Addr,
    _relay: Relay,
    pub netns: Netns,
    /// Configuration and logs (on the host's file system, removed on drop).
    dir: PathBuf,
    /// The node's cgroup2 directory: all its processes, and the root kpr balances there.
    cgroup2: PathBuf,
    /// The kubelet's cgroup root in each cgroup v1 hierarchy.
    v1_cgroups: Vec<PathBuf>,
    /// The node's first process (containerd's parent, then the kubelet).
    init: Option<Child>,
    /// The host's end of the link [`Node::expose_to_host`] made.
    host_leg: Option<String>,
}

impl Node {
    /// Create the namespaces and cgroups of node `name`. [`Node::boot`] starts it once the
    /// network is wired.
    pub fn new(cluster: &Cluster, name: &str, ip: Ipv4Addr) -> Result<Self> {
        let cgroup_root = bpf::cgroup2_root()?;
        if cgroup_root.file_name().is_none_or(|n| n != "unified") {
            bail!(
                "the nodes need a hybrid cgroup host (cgroup v1 controllers, cgroup2 at \
                 /sys/fs/cgroup/unified, as this machine has); cgroup2 is at {}",
                cgroup_root.display()
            );
        }
        let unique = testbed::unique_name(&format!("kpr-node-{name}"));
        let netns = Netns::new(&unique)?;
        netns.route_packets()?;
        let relay = Relay::new(
            &netns,
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, API_PORT),
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, cluster.api_port),
        )?;
        let cgroup2 = cgroup_root.join(&unique);
        fs::create_dir(&cgroup2).with_context(|| format!("creating {}", cgroup2.display()))?;
        let dir = std::env::temp_dir().join(format!("{unique}.node"));
        // From here on, drop removes what was made, also when the rest fails.
        let mut node = Self {
            name: name.to_owned(),
            ip,
            netns,
            dir,
            cgroup2,
            v1_cgroups: Vec::new(),
            init: None,
            host_leg: None,
            _relay: relay,
        };
        fs::create_dir_all(node.dir.join("cni"))?;
        add_v1_cgroup_roots(&unique, &mut node.v1_cgroups)?;
        Ok(node)
    }

    /// A link from the host to this node (a veth pair: `host0` in the node), with host routes
    /// to the node's address and its pods only, so that the API server reaches its kubelet
    /// (exec, logs, port-forward), a test program on the host its NodePorts, and its pods the
    /// API server's advertised address ([`HOST_LEG_IP`], through a relay), as on a real
    /// cluster. The routes lead into this node's namespace and die with the link; nothing
    /// leaves the machine.
    pub fn expose_to_host(&mut self, pod_cidr: &str) -> Result<()> {
        // `kh<pid><node's last letter>`: unique on the host, within IFNAMSIZ.
        let host_side = format!("kh{}{}", std::process::id(), self.name.chars().last().unwrap_or('x'));
        testbed::ip(&["link", "add", &host_side, "type", "veth", "peer", "name", "host0", "netns", &self.netns.name])?;
        self.host_leg = Some(host_side.clone());
        testbed::ip(&["addr", "add", &format!("{HOST_LEG_IP}/32"), "dev", &host_side])?;
        testbed::ip(&["link", "set", &host_side, "up"])?;
        let (src, node) = (HOST_LEG_IP.to_string(), self.ip.to_string());
        testbed::ip(&["route", "add", &format!("{node}/32"), "dev", &host_side, "src", &src])?;
        // Through the node (it answers ARP for its own address, not for its pods').
        testbed::ip(&["route", "add", pod_cidr, "via", &node, "dev", &host_side, "src", &src])?;
        self.netns.ip(&["link", "set", "host0", "up"])?;
        self.netns.ip(&["route", "add", &format!("{HOST_LEG_IP}/32"), "dev", "host0", "src", &self.ip.to_string()])?;
        Ok(())
    }

    /// A default route out of `eth0` (the link to the other node), as a real node has one:
    /// kube-proxy's DNAT and REJECT come after the route lookup, so without it a host-network
    /// client's connection to a ClusterIP (of any ServiceCIDR, also one a spec adds) fails
    /// before kube-proxy sees it. It names no gateway: a packet no proxy translated dies
    /// unanswered at ARP in the other node; nothing leaves the namespaces.
    pub fn route_default_on_link(&self) -> Result<()> {
        self.netns.ip(&["route", "add", "default", "dev", "eth0"])
    }

    /// The node's directory (configuration and logs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The kubelet's cgroup root (the same name in every v1 hierarchy).
    fn cgroup_root_name(&self) -> String {
        self.cgroup2.file_name().expect("named").to_string_lossy().into_owned()
    }

    /// Write the node's configuration and start containerd (importing `images`, OCI archives)
    /// and the kubelet, with pods in `pod_cidr` on a CNI bridge.
    pub fn boot(&mut self, cluster: &Cluster, pod_cidr: &str, images: &[PathBuf]) -> Result<()> {
        let d = &self.dir;
        fs::write(
            d.join("kubeconfig"),
            kubeconfig_yaml(&format!("https://127.0.0.1:{API_PORT}"), &cluster.ca(), cluster.admin_token()),
        )?;
        fs::write(d.join("containerd.toml"), containerd_config(d, &runc(d)?))?;
        fs::write(d.join("cni/10-kpr.conflist"), cni_config(pod_cidr))?;
        fs::write(d.join("resolv.conf"), "")?;
        fs::write(d.join("kubelet.yaml"), kubelet_config(self.ip, &self.cgroup_root_name(), d, &cluster.ca()))?;
        for (key, value) in KUBELET_SYSCTLS {
            fs::write(d.join(format!("sysctl-{}", key.replace('/', "-"))), format!("{value}\n"))?;
        }
        let script = d.join("init.sh");
        fs::write(&script, init_script(self, images)?)?;

        let mut cmd = Command::new("unshare");
        // A UTS namespace too: a host-network pod's hostname is its node's name, as on a real node.
        cmd.args(["--mount", "--uts", "--propagation", "slave", "sh"]).arg(&script);
        self.netns.exec_in(&mut cmd)?;
        self.init = Some(spawn_child(&mut cmd, &self.cgroup2, &d.join("node.log"))?);
        Ok(())
    }

    /// Wait until the API server shows this node Ready.
    pub fn wait_ready(&mut self, cluster: &Cluster, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let jsonpath = "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}";
            let ready = cluster.kubectl(&["get", "node", &self.name, "-o", jsonpath]).unwrap_or_default();
            if ready.trim() == "True" {
                return Ok(());
            }
            if let Some(status) = self.init.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                bail!("node {} stopped ({status}):\n{}", self.name, self.logs());
            }
            if Instant::now() > deadline {
                bail!("node {} is not Ready (Ready={ready:?}):\n{}", self.name, self.logs());
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The tails of the node's logs (its start, containerd, kubelet).
    pub fn logs(&self) -> String {
        ["node.log", "containerd.log"]
            .iter()
            .map(|f| {
                let text = fs::read_to_string(self.dir.join(f)).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                format!("--- {} {f}\n{}", self.name, lines[lines.len().saturating_sub(25)..].join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Kill every process of the node (the runtime, the kubelet, the pods) through its cgroup.
    fn kill_all(&mut self) {
        if let Err(e) = fs::write(self.cgroup2.join("cgroup.kill"), "1") {
            eprintln!("nodes: cgroup.kill of {}: {e}", self.cgroup2.display());
        }
        if let Some(mut init) = self.init.take() {
            let _ = init.kill();
            let _ = init.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while populated(&self.cgroup2) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill_all();
        // Its peer goes with the node's namespace, but only once nothing holds that any more.
        if let Some(leg) = self.host_leg.take()
            && let Err(e) = testbed::ip(&["link", "del", &leg])
        {
            eprintln!("nodes: failed to remove {leg}: {e:#}");
        }
        for root in std::iter::once(&self.cgroup2).chain(&self.v1_cgroups) {
            if let Err(e) = remove_cgroup_tree(root) {
                eprintln!("nodes: failed to remove cgroup {}: {e:#}", root.display());
            }
        }
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("nodes: failed to remove {}: {e}", self.dir.display());
        }
    }
}

/// Wire nodes `a` and `b` with a veth pair (`eth0` on each) and route each one's pod range to
/// the other. Nothing else is routed: a packet for any other address fails at its node.
pub fn link(a: &Node, a_pods: &str, b: &Node, b_pods: &str) -> Result<()> {
    a.netns.ip(&["link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &b.netns.name])?;
    for (node, peer, peer_pods) in [(a, b, b_pods), (b, a, a_pods)] {
        node.netns.ip(&["addr", "add", &format!("{}/24", node.ip), "dev", "eth0"])?;
        node.netns.ip(&["link", "set", "eth0", "up"])?;
        node.netns.ip(&["route", "add", peer_pods, "via", &peer.ip.to_string()])?;
    }
    Ok(())
}

/// The node's first process: its mounts, containerd, the images, then the kubelet.
fn init_script(node: &Node, images: &[PathBuf]) -> Result<String> {
    let d = node.dir.display();
    let sysctls: String = KUBELET_SYSCTLS
        .iter()
        .map(|(key, _)| format!("mount --bind \"$D/sysctl-{}\" /proc/sys/{key}\n", key.replace('/', "-")))
        .collect();
    let imports: String = images
        .iter()
        .map(|i| format!("ctr -a \"$SOCK\" -n k8s.io images import --snapshotter native '{}'\n", i.display()))
        .collect();
    Ok(format!(
        r#"set -eu
D='{d}'
SOCK=/run/containerd/containerd.sock
# Shared within the node (pod mounts with HostToContainer propagation), never back to the host.
mount --make-rshared /
hostname '{name}'
mount -t tmpfs -o mode=755 node-run /run
mkdir -p "$D/var-lib"; mount --bind "$D/var-lib" /var/lib
mount -t tmpfs -o mode=755 node-var-log /var/log
mount -t bpf bpf /sys/fs/bpf
mount --bind '{cgroup2}' /sys/fs/cgroup/unified
{sysctls}containerd --config "$D/containerd.toml" >> "$D/containerd.log" 2>&1 &
i=0
until ctr -a "$SOCK" version > /dev/null 2>&1; do
  i=$((i + 1)); [ $i -lt 300 ] || {{ echo "containerd did not start" >&2; exit 1; }}; sleep 0.1
done
{imports}exec '{kubelet}' --config="$D/kubelet.yaml" --kubeconfig="$D/kubeconfig" \
  --hostname-override={name} --node-ip={ip} --v=1
"#,
        cgroup2 = node.cgroup2.display(),
        kubelet = k8s_bin("kubelet")?.display(),
        name = node.name,
        ip = node.ip,
    ))
}

fn containerd_config(dir: &Path, runc: &Path) -> String {
    format!(
        r#"version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  # No registry is reachable: the test pods' image (kpr-probe) is also the sandbox's.
  sandbox_image = "docker.io/library/kpr-testpod:latest"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{runc}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
"#,
        runc = runc.display(),
        cni = dir.join("cni").display()
    )
}

/// Capabilities the test pods and the DaemonSet ask for: (name, bit).
const CAPABILITIES: [(&str, u32); 5] =
    [("CAP_NET_ADMIN", 12), ("CAP_SYS_ADMIN", 21), ("CAP_SYS_RESOURCE", 24), ("CAP_PERFMON", 38), ("CAP_BPF", 39)];

/// runc, or where this machine's sandbox forbids what the kubelet asks, runc behind a script
/// that asks for less, and only that:
/// - without CAP_SYS_RESOURCE (as this sandbox runs the tests) no OOM score below the
///   process's own can be set, and the kubelet gives every pod sandbox -998 (critical pods
///   -997): such scores are raised to the runtime's own;
/// - a capability outside this machine's bounding set cannot be granted (SYS_RESOURCE, which
///   kpr uses on kernels before 5.11 only): it is left out, as the image test does.
fn runc(dir: &Path) -> Result<PathBuf> {
    let status = fs::read_to_string("/proc/self/status")?;
    let set = |name: &str| -> Result<u64> {
        let hex = status.lines().find_map(|l| l.strip_prefix(name)).with_context(|| format!("no {name}"))?;
        Ok(u64::from_str_radix(hex.trim(), 16)?)
    };
    let (effective, bounding) = (set("CapEff:")?, set("CapBnd:")?);
    let mut edits = Vec::new();
    if effective & (1 << 24) == 0 {
        edits.push(r#"s/"oomScoreAdj":-[0-9]+/"oomScoreAdj":'"$(cat /proc/self/oom_score_adj)"'/"#.to_owned());
    }
    for (name, _) in CAPABILITIES.iter().filter(|(_, bit)| bounding & (1 << bit) == 0) {
        eprintln!("nodes: this machine's bounding set lacks {name}: pods asking for it run without it");
        edits.push(format!(r#"s/,"{name}"//g; s/"{name}",?//g"#));
    }
    if edits.is_empty() {
        return Ok(PathBuf::from("/usr/sbin/runc"));
    }
    let wrapper = dir.join("runc");
    let script = format!(
        "#!/bin/sh\nprev=\"\"\nfor arg; do [ \"$prev\" = --bundle ] && bundle=$arg; prev=$arg; done\n\
         if [ -n \"${{bundle:-}}\" ]; then\n  sed -i -E '{}' \"$bundle/config.json\"\nfi\nexec /usr/sbin/runc \"$@\"\n",
        edits.join("; ")
    );
    fs::write(&wrapper, script)?;
    use std::os::unix::fs::PermissionsExt as _;
    fs::set_permissions(&wrapper, fs::Permissions::from_mode(0o755))?;
    Ok(wrapper)
}

/// A bridge (`cni0`, the pods' gateway) with host-local addresses from `pod_cidr`; no
/// masquerade (the nodes route each other's pod ranges); `portmap` for `hostPort`s (iptables
/// rules in the node's namespace, only for pods that ask for one), as kind's CNI has it.
fn cni_config(pod_cidr: &str) -> String {
    serde_json::json!({
        "cniVersion": "0.4.0",
        "name": "kpr-test",
        "plugins": [{
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": true,
            "ipMasq": false,
            "hairpinMode": true,
            "ipam": { "type": "host-local", "ranges": [[{ "subnet": pod_cidr }]], "routes": [{ "dst": "0.0.0.0/0" }] },
        }, {
            "type": "portmap",
            "capabilities": { "portMappings": true },
        }],
    })
    .to_string()
}

/// The kubelet's configuration: the node's runtime, cgroup v1 (this host's) with its own
/// cgroup root, the API server's admin credentials (no node authorizer in the test cluster),
/// client certificates of the cluster's CA for its API (the API server's, for exec and logs),
/// the cluster DNS address, thresholds that let it keep the imported images (no registry to
/// pull them again), and local-storage isolation on, as by default (a pod over its
/// `ephemeral-storage` limit is evicted; e2e's "rejected for evicted pods" counts on it).
fn kubelet_config(ip: Ipv4Addr, cgroup_root: &str, dir: &Path, ca: &Path) -> String {
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup_root}
failCgroupV1: false
failSwapOn: false
address: {ip}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: false
  x509:
    clientCAFile: {ca}
authorization:
  mode: AlwaysAllow
resolvConf: {resolv}
clusterDomain: cluster.local
clusterDNS: [{CLUSTER_DNS}]
localStorageCapacityIsolation: true
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 1Mi
  nodefs.available: 1%
  imagefs.available: 1%
nodeStatusUpdateFrequency: 2s
"#,
        resolv = dir.join("resolv.conf").display(),
        ca = ca.display(),
    )
}

/// `name` in every cgroup v1 hierarchy mounted here (the kubelet's cgroup root must exist),
/// cpuset's with the parent's CPUs and memory nodes; each added to `made` once it exists, so
/// that a failure halfway leaves them to the node's clean-up.
fn add_v1_cgroup_roots(name: &str, made: &mut Vec<PathBuf>) -> Result<()> {
    let mounts = fs::read_to_string("/proc/self/mounts")?;
    for mount in
        mounts.lines().map(|l| l.split_whitespace().collect::<Vec<_>>()).filter(|f| f.len() > 2 && f[2] == "cgroup")
    {
        let hierarchy = Path::new(mount[1]);
        let dir = hierarchy.join(name);
        fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        made.push(dir.clone());
        for file in ["cpuset.cpus", "cpuset.mems"] {
            if dir.join(file).exists() {
                fs::write(dir.join(file), fs::read_to_string(hierarchy.join(file))?.trim())?;
            }
        }
    }
    Ok(())
}

/// Whether any process is left in the cgroup2 `dir` or below it.
fn populated(dir: &Path) -> bool {
    fs::read_to_string(dir.join("cgroup.events")).map(|e| e.contains("populated 1")).unwrap_or(false)
}

/// Remove a cgroup directory and the ones the kubelet and runc made below it, deepest first.
fn remove_cgroup_tree(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            remove_cgroup_tree(&path)?;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() > deadline => return Err(e).with_context(|| format!("rmdir {}", dir.display())),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// A process of a pod, found by its command line (`kpr-probe pause <label>`): the test enters
/// its network namespace and cgroup to act as the pod would, as `kubectl exec` does (the test's
/// API server cannot reach the kubelets for exec).
pub struct PodProcess {
    pub pid: u32,
}

impl PodProcess {
    pub fn find(label: &str, timeout: Duration) -> Result<Self> {
        let wanted = format!("/kpr-probe\0pause\0{label}\0");
        let deadline = Instant::now() + timeout;
        loop {
            for entry in fs::read_dir("/proc")?.flatten() {
                let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
                if fs::read(entry.path().join("cmdline")).is_ok_and(|c| c == wanted.as_bytes()) {
                    return Ok(Self { pid });
                }
            }
            if Instant::now() > deadline {
                bail!("no process runs `kpr-probe pause {label}`");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `program` set to start in this pod's network namespace and cgroup (and to die with the
    /// thread that starts it).
    pub fn command(&self, program: &Path) -> Result<Command> {
        let cgroup = fs::read_to_string(format!("/proc/{}/cgroup", self.pid))?;
        let rel = cgroup.lines().find_map(|l| l.strip_prefix("0::")).context("no cgroup2 entry")?;
        let cgroup = bpf::cgroup2_root()?.join(rel.trim_start_matches('/'));
        let netns = fs::File::open(format!("/proc/{}/ns/net", self.pid))?;
        let mut cmd = Command::new(program);
        crate::cluster::confine(&mut cmd, &cgroup)?;
        // SAFETY: setns is async-signal-safe; the closure owns the file until exec.
        unsafe {
            cmd.pre_exec(move || {
                use std::os::fd::AsRawFd as _;
                if libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(cmd)
    }
}
