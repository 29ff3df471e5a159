//! Taking a node over from the real kube-proxy (built from `tools/k8s`), in iptables and
//! nftables modes, and the way back. The node is upstream's test node (`kpr_tests::world`):
//! an external client reaches a NodePort and a pod a ClusterIP, first through kube-proxy.
//! Then kube-proxy stops (its rules stay, as when its DaemonSet is deleted) and kpr starts with
//! `--cleanup-kube-proxy` on the same configuration file: kube-proxy's chains or table are
//! gone, the connections kube-proxy made still carry data (the external one still masqueraded
//! by netfilter), and new connections are kpr's. Back: `kpr cleanup`, kube-proxy again, and new
//! connections are kube-proxy's. Needs root; `cargo xtask test` runs it.
use std::{
    collections::BTreeSet,
    io::{BufRead as _, BufReader, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddrV4, TcpStream},
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use kpr_tests::{
    cluster::{Cluster, KubeProxy},
    world::{EXT_CLIENT, KprAgent, NODE_IP, World},
};
use testbed::{Cgroup, Netns};

const NODE: &str = "test-node";
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 50);
const NODE_PORT: u16 = 30080;
const BACKENDS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 1, 0, 2), Ipv4Addr::new(10, 1, 0, 3)];
/// A pod that is no endpoint: the ClusterIP's client.
const CLIENT_POD: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 4);
const TIMEOUT: Duration = Duration::from_secs(2);

fn objects() -> String {
    let eps: String = BACKENDS
        .iter()
        .map(|ip| {
            format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n")
        })
        .collect();
    format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE}}}\n---\n\
         apiVersion: v1\nkind: Namespace\nmetadata: {{name: ns1}}\n---\n\
         apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: ns1}}\nspec:\n  type: NodePort\n  \
         clusterIP: {CLUSTER_IP}\n  ports:\n  - {{name: http, port: 80, protocol: TCP, targetPort: 80, nodePort: {NODE_PORT}}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: ns1\n  \
         labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\nports:\n- {{name: http, port: 80, protocol: TCP}}\n\
         endpoints:\n{eps}"
    )
}

fn config(mode: &str) -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: {mode}\n\
         hostnameOverride: {NODE}\nbindAddress: {NODE_IP}\nclusterCIDR: 10.0.0.0/8\n\
         metricsBindAddress: 127.0.0.1:10249\nhealthzBindAddress: 127.0.0.1:10256\nconntrack: {{maxPerCore: 0}}\n\
         iptables: {{syncPeriod: 1s, minSyncPeriod: 0s}}\nnftables: {{syncPeriod: 1s, minSyncPeriod: 0s}}\n"
    )
}

/// An open TCP connection through a service: the backend that answered, and the stream.
struct Conn {
    backend: String,
    stream: TcpStream,
}

impl Conn {
    fn open(netns: &Netns, to: SocketAddrV4) -> Option<Conn> {
        let stream = netns
            .run(move || -> std::io::Result<TcpStream> {
                let stream = TcpStream::connect_timeout(&to.into(), TIMEOUT)?;
                stream.set_read_timeout(Some(TIMEOUT))?;
                Ok(stream)
            })
            .ok()?
            .ok()?;
        let mut line = String::new();
        BufReader::new(&stream).read_line(&mut line).ok()?;
        Some(Conn { backend: line.trim_end().to_owned(), stream })
    }

    /// Send a line; what comes back (the echo, or for `peer?` the source the backend sees).
    fn ask(&mut self, line: &str) -> std::io::Result<String> {
        self.stream.write_all(format!("{line}\n").as_bytes())?;
        let mut answer = String::new();
        BufReader::new(&self.stream).read_line(&mut answer)?;
        if answer.is_empty() {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(answer.trim_end().to_owned())
    }
}

fn is_backend(answer: &str) -> bool {
    BACKENDS.iter().any(|ip| answer == format!("{ip}:80"))
}

/// New connections from `netns` to `to` until `n` of them reached a backend (or the deadline).
fn backends_reached(netns: &Netns, to: SocketAddrV4, n: usize) -> BTreeSet<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = BTreeSet::new();
    let mut answered = 0;
    while answered < n && Instant::now() < deadline {
        match Conn::open(netns, to) {
            Some(conn) if is_backend(&conn.backend) => {
                seen.insert(conn.backend);
                answered += 1;
            }
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
    seen
}

/// Whether kube-proxy's rules (of `mode`) are in the node's netfilter.
fn kube_proxy_rules(node: &Netns, mode: &str) -> bool {
    let (cmd, args, needle): (&str, &[&str], &str) = match mode {
        "iptables" => ("iptables-save", &[], ":KUBE-SERVICES"),
        _ => ("nft", &["list", "tables"], "table ip kube-proxy"),
    };
    let out = Command::new("ip").args(["netns", "exec", &node.name, cmd]).args(args).output().unwrap();
    String::from_utf8_lossy(&out.stdout).contains(needle)
}

/// kpr in the node's namespace on kube-proxy's configuration file and a dump of the API's
/// objects, taking over from kube-proxy.
fn start_kpr(world: &World, config: &Path, cluster: &Cluster, cgroup: &Cgroup, tag: &str) -> KprAgent {
    let kpr = KprAgent::start(&world.node, config, cgroup, tag, &["--cleanup-kube-proxy"]);
    let dump = cluster.kubectl(&["get", "services,endpointslices,nodes", "-A", "-o", "yaml"]).unwrap();
    testbed::write_atomic(&kpr.manifests, "cluster.yaml", &dump).unwrap();
    kpr
}

/// Wait until kpr's log says `needle`.
fn wait_log(kpr: &KprAgent, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !kpr.log_text().contains(needle) {
        assert!(Instant::now() < deadline, "kpr never logged {needle:?}:\n{}", kpr.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn takeover_and_back(mode: &str) {
    let cluster = Cluster::start(&format!("kto-{}", &mode[..3])).expect("control plane");
    cluster.apply(&objects()).unwrap();
    let status = format!("{{\"status\":{{\"addresses\":[{{\"type\":\"InternalIP\",\"address\":\"{NODE_IP}\"}}]}}}}");
    cluster.kubectl(&["patch", "node", NODE, "--subresource=status", "--type=merge", "-p", &status]).unwrap();
    let tag = testbed::unique_name(&format!("kt{}", &mode[..2]));
    let pods: Vec<IpAddr> = BACKENDS.iter().chain([&CLIENT_POD]).map(|ip| IpAddr::from(*ip)).collect();
    let world = World::new(&tag, &pods, &[80], &[NODE_PORT, 80]).expect("node");
    let cgroup = Cgroup::new(&tag).expect("kpr's cgroup");
    let node_port = SocketAddrV4::new(NODE_IP, NODE_PORT);
    let cluster_ip = SocketAddrV4::new(CLUSTER_IP, 80);

    // kube-proxy serves the node.
    let (kube_proxy, config_file) =
        KubeProxy::start_with_config(&cluster, &world.node, &config(mode)).expect("kube-proxy");
    let reached = backends_reached(&world.ext, node_port, 1);
    assert!(!reached.is_empty(), "kube-proxy ({mode}) never served the NodePort:\n{}", kube_proxy.log_tail());
    // Connections through kube-proxy, kept open: several from outside (masqueraded), one from a pod.
    let mut external: Vec<Conn> = (0..6).map(|_| Conn::open(&world.ext, node_port).expect("via kube-proxy")).collect();
    let mut from_pod = Conn::open(world.pod(CLIENT_POD), cluster_ip).expect("ClusterIP via kube-proxy");
    for conn in external.iter_mut().chain([&mut from_pod]) {
        assert!(is_backend(&conn.backend), "{}", conn.backend);
        assert_eq!(conn.ask("before").unwrap(), "before");
    }
    // Masqueraded to the node's address on the pod's link.
    let masquerade = external[0].ask("peer?").unwrap();
    assert_ne!(masquerade, EXT_CLIENT.to_string(), "kube-proxy masquerades external clients");
    drop(kube_proxy); // its DaemonSet is deleted: the process ends, its rules stay
    assert!(kube_proxy_rules(&world.node, mode), "kube-proxy's rules outlive it");

    // kpr takes over.
    let mut kpr = start_kpr(&world, &config_file, &cluster, &cgroup, &format!("{tag}-kpr"));
    wait_log(&kpr, "kube-proxy's rules removed");
    assert!(!kube_proxy_rules(&world.node, mode), "kpr removed kube-proxy's rules:\n{}", kpr.log_text());
    for (i, conn) in external.iter_mut().chain([&mut from_pod]).enumerate() {
        let answer = conn.ask("after the takeover");
        if answer.is_err() {
            let sh = |c: &str| {
                let out = Command::new("ip").args(["netns", "exec", &world.node.name, "sh", "-c", c]).output().unwrap();
                String::from_utf8_lossy(&out.stdout).into_owned()
            };
            panic!(
                "connection {i} to {} broke: {answer:?}\nnftables:\n{}\nconntrack:\n{}\nkpr:\n{}",
                conn.backend,
                sh("nft list ruleset"),
                sh("conntrack -L 2>&1"),
                kpr.log_text()
            );
        }
        assert_eq!(answer.unwrap(), "after the takeover");
    }
    assert_eq!(external[0].ask("peer?").unwrap(), masquerade, "still masqueraded by netfilter");
    let reached = backends_reached(&world.ext, node_port, 20);
    assert_eq!(reached.len(), 2, "new NodePort connections reach both backends: {reached:?}\n{}", kpr.log_text());
    let flows = kpr::inspect::conntrack::list(&kpr.pins, None, &proxy_common::CtTimeouts::DEFAULT).unwrap();
    let kprs = flows
        .iter()
        .filter(|f| f.frontend == node_port.to_string() && f.client.starts_with(&EXT_CLIENT.to_string()))
        .count();
    assert!(kprs >= 20, "the new connections are kpr's: {kprs} flows in its conntrack\n{}", kpr.log_text());
    assert_eq!(backends_reached(world.pod(CLIENT_POD), cluster_ip, 10).len(), 2);

    // And back: kpr leaves, kube-proxy returns.
    kpr.stop();
    let out = Command::new(kpr_tests::kpr_bin()).arg("cleanup").arg("--pin-root").arg(&kpr.pins).output().unwrap();
    assert!(out.status.success(), "kpr cleanup: {}", String::from_utf8_lossy(&out.stderr));
    let attached =
        Command::new("ip").args(["netns", "exec", &world.node.name, "bpftool", "net", "show"]).output().unwrap();
    let attached = String::from_utf8_lossy(&attached.stdout);
    assert!(!attached.contains("kpr_tc"), "kpr cleanup detached the per-packet programs:\n{attached}");
    let (kube_proxy, _) = KubeProxy::start_with_config(&cluster, &world.node, &config(mode)).expect("kube-proxy again");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !kube_proxy_rules(&world.node, mode) {
        assert!(Instant::now() < deadline, "kube-proxy's rules are back:\n{}", kube_proxy.log_tail());
        std::thread::sleep(Duration::from_millis(200));
    }
    let reached = backends_reached(&world.ext, node_port, 20);
    assert_eq!(reached.len(), 2, "kube-proxy serves the NodePort again: {reached:?}\n{}", kube_proxy.log_tail());
    assert_eq!(
        external[1].ask("after the way back").unwrap(),
        "after the way back",
        "kube-proxy's own connection lives on"
    );
}

#[test]
fn takeover_from_kube_proxy_iptables_keeps_its_connections_and_back() {
    takeover_and_back("iptables");
}

#[test]
fn takeover_from_kube_proxy_nftables_keeps_its_connections_and_back() {
    takeover_and_back("nftables");
}
