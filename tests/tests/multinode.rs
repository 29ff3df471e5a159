//! Several "nodes" on one machine: network namespaces joined by a bridge (in its own
//! namespace), each node with its own kpr agent (own cgroup, own pins, tc programs on its
//! interfaces), its own pod, and an external client. No namespace has a route off the machine.
//!
//! ```text
//!   ext 10.0.0.100 ─┐
//!   node-a 10.0.0.1 ┼─ br0 (switch netns)      node-a ── pod-a 10.244.1.2
//!   node-b 10.0.0.2 ┘                          node-b ── pod-b 10.244.2.2
//! ```
//!
//! Every link is dual-stack: fd00::100 (ext), fd00::1 and fd00::2 (nodes), fd00:10:244:1::2 and
//! fd00:10:244:2::2 (pods).
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, TcpStream},
    path::PathBuf,
    process::{Child, Command},
    time::Duration,
};

use anyhow::{Context as _, Result};
use kpr::datapath::bpf;
use testbed::{AgentCommand, Cgroup, NameServer, Netns, tcp_ask, tcp_ask_peer};

const POD_PORT: u16 = 8080;
const EXT_CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 100);
const LB_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const TIMEOUT: Duration = Duration::from_secs(2);

/// A node of the [`Bridged`] cluster: its own namespace, agent, pins, cgroup and pod.
/// How long a node's agent may take to program a change, its start included.
const PROGRAMMED_WITHIN: Duration = Duration::from_secs(60);

struct BridgedNode {
    name: String,
    ip: Ipv4Addr,
    ip6: Ipv6Addr,
    pod_ip: Ipv4Addr,
    pod_ip6: Ipv6Addr,
    agent: Option<Child>,
    pins: PathBuf,
    /// The node's KubeProxyConfiguration.
    config: PathBuf,
    _servers: Vec<NameServer>,
    cgroup: Cgroup,
    _pod: Netns,
    netns: Netns,
}

/// The nodes on the bridge, each running kpr from the same manifests (no control plane).
struct Bridged {
    nodes: Vec<BridgedNode>,
    /// More `kpr agent` arguments, for every node.
    agent_args: Vec<String>,
    manifests: PathBuf,
    log: PathBuf,
    ext: Netns,
    _switch: Netns,
}

impl Bridged {
    fn new(tag: &str) -> Result<Self> {
        Self::new_with(tag, &[])
    }

    fn new_with(tag: &str, agent_args: &[&str]) -> Result<Self> {
        let prefix = testbed::unique_name(tag);
        // Built at a time, in one `ip` each (`Netns::ip_batch`).
        let switch = Netns::new(&format!("{prefix}-sw"))?;
        let ext = Netns::new(&format!("{prefix}-ext"))?;
        let mut namespaces = Vec::new();
        for name in ["node-a", "node-b"] {
            namespaces.push((Netns::new(&format!("{prefix}-{name}"))?, Netns::new(&format!("{prefix}-{name}-pod"))?));
        }
        let mut ports = vec!["link add br0 type bridge".to_owned(), "link set br0 up".to_owned()];
        let plugged =
            std::iter::once(("ext", &ext)).chain(["node-a", "node-b"].into_iter().zip(namespaces.iter().map(|n| &n.0)));
        for (name, ns) in plugged {
            ports.push(format!("link add p-{name} type veth peer name eth0 netns {}", ns.name));
            ports.push(format!("link set p-{name} master br0 up"));
        }
        switch.ip_batch(&ports)?;
        // A namespace's end of its switch port.
        let eth0 = |addr: &str, addr6: &str| {
            [
                format!("addr add {addr} dev eth0"),
                format!("addr add {addr6} dev eth0 nodad"),
                "link set eth0 up".to_owned(),
            ]
        };
        ext.ip_batch(eth0(&format!("{EXT_CLIENT}/24"), "fd00::100/64").into_iter().chain([
            // The LoadBalancer IP is announced by node-a (as a cloud LB would send it there).
            format!("route add {LB_IP}/32 via 10.0.0.1"),
        ]))?;

        let manifests = std::env::temp_dir().join(&prefix);
        std::fs::create_dir_all(&manifests)?;
        let mut nodes = Vec::new();
        for (i, (name, (netns, pod))) in ["node-a", "node-b"].iter().zip(namespaces).enumerate() {
            let n = i as u8 + 1;
            let ip = Ipv4Addr::new(10, 0, 0, n);
            let ip6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, n.into());
            let pod_ip = Ipv4Addr::new(10, 244, n, 2);
            let pod_ip6 = Ipv6Addr::new(0xfd00, 0x10, 0x244, n.into(), 0, 0, 0, 2);
            let other = 3 - n;
            netns.ip_batch(eth0(&format!("{ip}/24"), &format!("{ip6}/64")).into_iter().chain([
                format!("link add veth-pod type veth peer name eth0 netns {}", pod.name),
                format!("addr add 10.244.{n}.1/24 dev veth-pod"),
                format!("addr add fd00:10:244:{n}::1/64 dev veth-pod nodad"),
                "link set veth-pod up".to_owned(),
                format!("route add 10.244.{other}.0/24 via 10.0.0.{other}"),
                format!("route add fd00:10:244:{other}::/64 via fd00::{other}"),
            ]))?;
            pod.ip_batch([
                format!("addr add {pod_ip}/24 dev eth0"),
                format!("addr add {pod_ip6}/64 dev eth0 nodad"),
                "link set eth0 up".to_owned(),
                format!("route add default via 10.244.{n}.1"),
                format!("route add default via fd00:10:244:{n}::1"),
            ])?;
            netns.route_packets()?;
            let pod_name = format!("pod-{}", &name[5..]);
            let servers = vec![
                NameServer::tcp(&pod, SocketAddrV4::new(pod_ip, POD_PORT), &pod_name)?,
                NameServer::udp(&pod, SocketAddrV4::new(pod_ip, POD_PORT), &pod_name)?,
                NameServer::tcp(&pod, SocketAddr::new(pod_ip6.into(), POD_PORT), &pod_name)?,
                NameServer::udp(&pod, SocketAddr::new(pod_ip6.into(), POD_PORT), &pod_name)?,
            ];
            let cgroup = Cgroup::new(&format!("{prefix}-{name}"))?;
            let pins = PathBuf::from(format!("/sys/fs/bpf/{prefix}-{name}"));
            // What kubeadm gives kube-proxy: the pods' range; the node is named by hostnameOverride.
            let config = std::env::temp_dir().join(format!("{prefix}-{name}.kube-proxy.yaml"));
            std::fs::write(
                &config,
                format!(
                    "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.244.0.0/16\nhostnameOverride: {name}\n"
                ),
            )?;
            nodes.push(BridgedNode {
                name: (*name).to_owned(),
                ip,
                ip6,
                pod_ip,
                pod_ip6,
                agent: None,
                pins,
                config,
                _servers: servers,
                cgroup,
                _pod: pod,
                netns,
            });
        }
        let log = std::env::temp_dir().join(format!("{prefix}.agents.log"));
        let agent_args = agent_args.iter().map(|a| (*a).to_owned()).collect();
        let mut cluster = Self { nodes, agent_args, manifests, log, ext, _switch: switch };
        for i in 0..cluster.nodes.len() {
            cluster.start_agent(i)?;
        }
        Ok(cluster)
    }

    /// The node's agent, inside the node's network namespace (joined before exec, so the
    /// agent sees the node's interfaces while bpffs stays the machine's).
    fn start_agent(&mut self, i: usize) -> Result<()> {
        let node = &mut self.nodes[i];
        let mut agent =
            AgentCommand::new(&node.cgroup.path, &node.pins).manifests(&self.manifests).config(&node.config);
        // Small tables, unless the test sizes one itself.
        for (flag, value) in [("--max-service-ports", "256"), ("--max-backends", "1024"), ("--max-conntrack", "4096")] {
            if !self.agent_args.iter().any(|a| a == flag) {
                agent = agent.args([flag, value]);
            }
        }
        let agent = agent.args(&self.agent_args).log_to(&self.log)?.in_netns(&node.netns)?;
        node.agent = Some(agent.spawn()?);
        Ok(())
    }

    fn write(&self, name: &str, text: &str) {
        testbed::write_atomic(&self.manifests, name, text).unwrap();
    }

    /// Wait until every node's maps hold `address` with `backends` backends. Generous: the
    /// first wait includes the agents' start, and two agents loading their programs at once
    /// on a busy two-CPU machine took 10 s (a 10 s wait failed three tests of one CI run).
    fn wait(&self, address: &str, backends: usize) {
        for node in &self.nodes {
            testbed::wait_programmed(&node.pins, address, Some(backends), testbed::slow(PROGRAMMED_WITHIN))
                .with_context(|| {
                    format!("{}: agents' log:\n{}", node.name, std::fs::read_to_string(&self.log).unwrap_or_default())
                })
                .unwrap();
        }
    }

    fn ext<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        self.ext.run(f).unwrap()
    }
}

impl Drop for Bridged {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut agent) = node.agent.take() {
                let _ = agent.kill();
                let _ = agent.wait();
            }
            let _ = bpf::cleanup(&node.pins);
            let _ = std::fs::remove_file(&node.config);
        }
        let _ = std::fs::remove_dir_all(&self.manifests);
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A Service with one TCP port, a NodePort, an optional LoadBalancer IP, the given
/// externalTrafficPolicy, and an EndpointSlice listing (pod IP, node name).
fn service(policy: &str, node_port: u16, endpoints: &[(Ipv4Addr, &str)]) -> String {
    dual_stack_service(policy, node_port, endpoints, None)
}

/// [`service`], dual-stack when `endpoints6` is given (IPv4 first): a ClusterIP of each
/// family, and an IPv6 EndpointSlice.
fn dual_stack_service(
    policy: &str,
    node_port: u16,
    endpoints: &[(Ipv4Addr, &str)],
    endpoints6: Option<&[(Ipv6Addr, &str)]>,
) -> String {
    let slice = |family: &str, eps: &[(IpAddr, &str)]| {
        let eps: String = eps
            .iter()
            .map(|(ip, node)| format!("- addresses: [\"{ip}\"]\n  nodeName: {node}\n  conditions: {{ready: true}}\n"))
            .collect();
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-{node_port}-{family}\n  namespace: t\n  \
             labels: {{kubernetes.io/service-name: web-{node_port}}}\naddressType: {family}\nports: [{{name: http, port: {POD_PORT}}}]\nendpoints:{}",
            if eps.is_empty() { " []\n".to_owned() } else { format!("\n{eps}") },
        )
    };
    let ip = node_port % 250;
    let (families, cluster_ips) = match endpoints6 {
        Some(_) => ("[IPv4, IPv6]", format!("[\"10.96.0.{ip}\", \"fd00:96::{ip:x}\"]")),
        None => ("[IPv4]", format!("[\"10.96.0.{ip}\"]")),
    };
    let v4: Vec<(IpAddr, &str)> = endpoints.iter().map(|(ip, node)| ((*ip).into(), *node)).collect();
    let v6: Vec<(IpAddr, &str)> =
        endpoints6.unwrap_or_default().iter().map(|(ip, node)| ((*ip).into(), *node)).collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web-{node_port}, namespace: t}}\nspec:\n  type: LoadBalancer\n  \
         clusterIP: 10.96.0.{ip}\n  clusterIPs: {cluster_ips}\n  ipFamilies: {families}\n  externalTrafficPolicy: {policy}\n{hc}  \
         ports: [{{name: http, port: 80, nodePort: {node_port}}}]\n\
         status:\n  loadBalancer:\n    ingress: [{{ip: \"{LB_IP}\"}}]\n{}{}",
        slice("IPv4", &v4),
        if endpoints6.is_some() { slice("IPv6", &v6) } else { String::new() },
        // The API server allocates a health check port for LoadBalancer services with eTP=Local.
        hc = if policy == "Local" { format!("  healthCheckNodePort: {}\n", node_port + 1000) } else { String::new() },
    )
}

#[test]
fn node_port_reaches_a_pod_on_another_node_masqueraded() {
    let c = Bridged::new("km-np").unwrap();
    let pod_b = c.nodes[1].pod_ip;
    c.write("svc.yaml", &service("Cluster", 30080, &[(pod_b, "node-b")]));
    c.wait("*:30080/TCP ext", 1);
    for node in 0..2 {
        let ip = c.nodes[node].ip;
        let (name, seen) = c.ext(move || tcp_ask_peer(SocketAddrV4::new(ip, 30080), TIMEOUT).unwrap());
        assert_eq!(name, "pod-b", "via {ip}");
        // eTP=Cluster: the pod sees the node that took the connection, not the client: the
        // address of the link the packet left that node by, as MASQUERADE picks it (node-a
        // forwards over eth0, node-b hands it to its pod over veth-pod).
        let expected = if node == 0 { ip.to_string() } else { "10.244.2.1".to_owned() };
        assert_eq!(seen, expected, "source address seen by the pod, via {ip}");
    }
    // The LoadBalancer IP (routed to node-a) works the same way.
    let (name, seen) = c.ext(|| tcp_ask_peer(SocketAddrV4::new(LB_IP, 80), TIMEOUT).unwrap());
    assert_eq!((name.as_str(), seen.as_str()), ("pod-b", "10.0.0.1"));
}

/// Maglev (`kpr.io/lb-algorithm: maglev`, one `--maglev-seed` for the cluster): a client's
/// tuple to the LoadBalancer IP reaches the same pod whichever node the router sends it to
/// (here: node-a, then node-b), and that pod is the one the model's table names at the
/// tuple's hash, which any node computes alike.
///
/// The flows are not moved mid-connection: with eTP=Cluster each node masquerades, so the pod
/// would see another source (that takes direct server return, issue 47 part 2).
///
/// Both agents run on one kernel, so they share the boot's flow-hash seed too: agreeing nodes
/// alone would not tell Maglev from a random pick; the pods the table predicts do (with
/// `kpr.io/lb-algorithm: random` the comparison fails).
#[test]
fn maglev_sends_a_tuple_to_the_same_pod_through_either_node() {
    const SEED: u32 = 4_747;
    let c = Bridged::new_with("km-mg", &["--maglev-seed", &SEED.to_string()]).unwrap();
    let (pod_a, pod_b) = (c.nodes[0].pod_ip, c.nodes[1].pod_ip);
    let svc = service("Cluster", 30090, &[(pod_a, "node-a"), (pod_b, "node-b")]);
    let svc = svc.replacen("namespace: t}", "namespace: t, annotations: {kpr.io/lb-algorithm: maglev}}", 1);
    c.write("svc.yaml", &svc);
    c.wait("*:30090/TCP ext", 2);
    // The model's table for the pods in the order the maps hold them (sorted).
    let endpoints: Vec<SocketAddr> = [pod_a, pod_b].iter().map(|ip| SocketAddr::from((*ip, POD_PORT))).collect();
    let table =
        kpr::model::maglev::table(&endpoints, proxy_common::MAGLEV_DEFAULT_TABLE_SIZE, u64::from(SEED)).unwrap();
    let ports: Vec<u16> = (41_000..41_012).collect();
    let expected: Vec<&str> = ports
        .iter()
        .map(|sport| {
            let hash = proxy_common::tuple_hash(
                SEED,
                &IpAddr::from(EXT_CLIENT).into(),
                &IpAddr::from(LB_IP).into(),
                sport.to_be(),
                80u16.to_be(),
                proxy_common::IPPROTO_TCP,
            );
            ["pod-a", "pod-b"][table[(hash % proxy_common::MAGLEV_DEFAULT_TABLE_SIZE) as usize] as usize]
        })
        .collect();
    assert!(expected.contains(&"pod-a") && expected.contains(&"pod-b"), "the tuples cover both pods: {expected:?}");
    for via in [1u8, 2] {
        c.ext.ip(&["route", "replace", &format!("{LB_IP}/32"), "via", &format!("10.0.0.{via}")]).unwrap();
        let asked = ports.clone();
        let names =
            c.ext(move || asked.iter().map(|sport| ask_from(*sport, SocketAddrV4::new(LB_IP, 80))).collect::<Vec<_>>());
        assert_eq!(names, expected, "through node {via}: the table's pod for each source port");
    }
}

/// Ask `addr` (TCP) for its name from the client's source port `sport`, then reset the
/// connection (no TIME_WAIT: the tuple is asked again through another node).
fn ask_from(sport: u16, addr: SocketAddrV4) -> String {
    use std::io::BufRead as _;
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_reuse_address(true).unwrap();
    socket.set_linger(Some(Duration::ZERO)).unwrap();
    socket.bind(&SocketAddrV4::new(EXT_CLIENT, sport).into()).unwrap();
    socket.connect_timeout(&addr.into(), TIMEOUT).unwrap_or_else(|e| panic!("{sport} -> {addr}: {e}"));
    socket.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut name = String::new();
    std::io::BufReader::new(TcpStream::from(socket)).read_line(&mut name).unwrap();
    name.trim().to_owned()
}

/// Direct server return (`kpr.io/lb-mode: dsr`): a client's connection to the LoadBalancer IP
/// (routed to node-a) or to node-a's NodePort reaches the pod on node-b with the client's own
/// address, and the pod's answers go from node-b straight to the client: node-a receives the
/// client's bytes, not the pod's (its eth0 counts a 1 MiB echo once, where masquerade would
/// count it twice). The echo's full-sized segments fit the tunnel: node-b's SYN-ACK announced
/// room for its header. IPv6 (IPv6 in IPv6) alike, through node-a's IPv6 NodePort. node-a's
/// self-check (`kpr verify`) reads its probes' tunnelled packets and finds them right.
#[test]
fn dsr_lets_a_pod_on_another_node_see_the_client_and_answer_it_directly() {
    let c = Bridged::new("km-dsr").unwrap();
    let (pod_b, pod_b6) = (c.nodes[1].pod_ip, c.nodes[1].pod_ip6);
    let svc = dual_stack_service("Cluster", 30091, &[(pod_b, "node-b")], Some(&[(pod_b6, "node-b")]));
    c.write("svc.yaml", &svc.replacen("namespace: t}", "namespace: t, annotations: {kpr.io/lb-mode: dsr}}", 1));
    c.wait("*:30091/TCP ext", 1);
    c.wait("[*]:30091/TCP ext", 1);
    let (a, a6) = (c.nodes[0].ip, c.nodes[0].ip6);
    let through: [(SocketAddr, &str); 3] =
        [((LB_IP, 80).into(), "10.0.0.100"), ((a, 30091).into(), "10.0.0.100"), ((a6, 30091).into(), "fd00::100")];
    for (addr, client) in through {
        let (name, seen) = c.ext(move || tcp_ask_peer(addr, TIMEOUT).unwrap());
        assert_eq!((name.as_str(), seen.as_str()), ("pod-b", client), "through {addr}");
    }
    let mut verify = Command::new(kpr_tests::kpr_bin());
    verify.args(["verify", "--output", "json", "--metrics-address", "127.0.0.1:10249"]);
    c.nodes[0].netns.exec_in(&mut verify).unwrap();
    let out = verify.output().unwrap();
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!((out.status.code(), &report["failures"]), (Some(0), &serde_json::json!([])), "{report}");
    // The client sends full-sized frames (no segmentation offload on its link), which the
    // tunnel's header would take past node-a's MTU but for the clamp.
    c.ext(|| kpr_tests::set_tx_checksum_offload("eth0", false)).unwrap();
    let received = || rx_bytes(&c.nodes[0].netns, "eth0");
    let before = received();
    const BULK: usize = 1 << 20;
    let (echoed, path_mtu) = c.ext(|| bulk_echo(SocketAddrV4::new(LB_IP, 80), BULK));
    assert_eq!(echoed, BULK, "the whole echo came back");
    // The segments fit from the start: no "fragmentation needed" lowered the path's MTU.
    assert_eq!(path_mtu, 1500, "the path MTU the client's connection ended with");
    let through_a = received() - before;
    assert!(
        (BULK as u64..BULK as u64 * 13 / 10).contains(&through_a),
        "node-a received {through_a} bytes for {BULK} sent and {BULK} echoed: the client's only"
    );
}

/// Direct server return with Maglev (`kpr.io/lb-mode: dsr`, `kpr.io/lb-algorithm: maglev`):
/// connections to the LoadBalancer IP opened through node-a keep working when the router sends
/// them to node-b instead, in the middle of the connection, and through an agent restart on
/// either node. Both nodes pick the same pod for a tuple and neither masquerades, so the pod,
/// on either node, sees the same client all along; a flow whose pod is on the other node
/// goes there in the tunnel, one whose pod is local goes straight to it.
#[test]
fn dsr_connections_survive_a_move_between_nodes_and_agent_restarts() {
    const SEED: u32 = 4_747;
    let mut c = Bridged::new_with("km-dsrmv", &["--maglev-seed", &SEED.to_string()]).unwrap();
    let (pod_a, pod_b) = (c.nodes[0].pod_ip, c.nodes[1].pod_ip);
    let svc = service("Cluster", 30092, &[(pod_a, "node-a"), (pod_b, "node-b")]).replacen(
        "namespace: t}",
        "namespace: t, annotations: {kpr.io/lb-mode: dsr, kpr.io/lb-algorithm: maglev}}",
        1,
    );
    c.write("svc.yaml", &svc);
    c.wait("*:30092/TCP ext", 2);
    // Client ports whose tuples the table sends to either pod (the Maglev test's).
    let mut conns = c.ext(|| {
        (41_000..41_012).map(|sport| connect_from_port(sport, SocketAddrV4::new(LB_IP, 80))).collect::<Vec<_>>()
    });
    let pods: std::collections::BTreeSet<&str> = conns.iter().map(|(_, pod)| pod.as_str()).collect();
    assert_eq!(pods, ["pod-a", "pod-b"].into(), "the connections cover both pods");
    let route_via = |c: &Bridged, node: u8| {
        c.ext.ip(&["route", "replace", &format!("{LB_IP}/32"), "via", &format!("10.0.0.{node}")]).unwrap();
    };
    let all_answer = |conns: &mut Vec<(TcpStream, String)>, when: &str| {
        for (conn, pod) in conns.iter_mut() {
            let seen = ask_peer_on(conn).unwrap_or_else(|e| panic!("{pod}'s connection {when}: {e}"));
            assert_eq!(seen, EXT_CLIENT.to_string(), "the address {pod} sees {when}");
        }
    };
    all_answer(&mut conns, "through node-a");
    route_via(&c, 2);
    all_answer(&mut conns, "moved to node-b");
    for node in [1, 0] {
        let mut agent = c.nodes[node].agent.take().unwrap();
        agent.kill().unwrap();
        agent.wait().unwrap();
        all_answer(&mut conns, &format!("while {}'s agent is down", c.nodes[node].name));
        c.start_agent(node).unwrap();
        std::thread::sleep(testbed::slow(Duration::from_secs(3)));
        all_answer(&mut conns, &format!("after {}'s agent restarted", c.nodes[node].name));
        route_via(&c, 2 - node as u8);
        all_answer(&mut conns, &format!("moved again after {}'s restart", c.nodes[node].name));
    }
}

/// UDP with direct server return: with `kpr.io/lb-mode: dsr` a datagram to the LoadBalancer IP
/// reaches the pod on node-b with the client's address, and one too big for node-a's link
/// once in the tunnel gets "fragmentation needed" from the frontend, naming the room the
/// tunnel leaves (1480); with `hybrid` UDP is masqueraded (the pod sees node-a) while TCP
/// returns directly.
#[test]
fn dsr_udp_keeps_the_client_and_hybrid_masquerades_it() {
    let c = Bridged::new("km-dsru").unwrap();
    let pod_b = c.nodes[1].pod_ip;
    let lb_udp = SocketAddr::from((LB_IP, 53));
    // Each mode with NodePorts of its own: their entries tell that the agents applied it.
    for (mode, node_port, udp_seen) in [("dsr", 30093, EXT_CLIENT), ("hybrid", 30095, c.nodes[0].ip)] {
        c.write("svc.yaml", &tcp_udp_service(node_port, pod_b, mode));
        c.wait(&format!("*:{}/UDP ext", node_port + 1), 1);
        let (name, seen) = c.ext(move || udp_ask_peer(lb_udp));
        assert_eq!((name.as_str(), seen), ("pod-b", udp_seen.to_string()), "UDP in {mode}");
        let (name, seen) = c.ext(|| tcp_ask_peer(SocketAddrV4::new(LB_IP, 80), TIMEOUT).unwrap());
        assert_eq!((name.as_str(), seen), ("pod-b", EXT_CLIENT.to_string()), "TCP in {mode}");
        if mode == "dsr" {
            let (big, mtu) = c.ext(move || {
                let socket = std::net::UdpSocket::bind(any_port_of(lb_udp.ip())).unwrap();
                socket.connect(lb_udp).unwrap();
                socket.set_read_timeout(Some(TIMEOUT)).unwrap();
                setsockopt_int(&socket, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO);
                // Fits the client's link (1500), not node-a's once in the tunnel.
                socket.send(&[7u8; 1472]).unwrap();
                let mut buf = [0u8; 64];
                let big = socket.recv(&mut buf).map_err(|e| e.raw_os_error());
                (big, getsockopt_int(&socket, libc::IPPROTO_IP, libc::IP_MTU))
            });
            assert_eq!(big, Err(Some(libc::EMSGSIZE)), "the big datagram: fragmentation needed");
            assert_eq!(mtu, 1480, "the path MTU the client learned");
        }
    }
}

/// A LoadBalancer Service with a TCP port (80, NodePort `node_port`) and a UDP one (53,
/// NodePort `node_port` + 1), both to `pod` on node-b, in `kpr.io/lb-mode: mode`.
fn tcp_udp_service(node_port: u16, pod: Ipv4Addr, mode: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: tu, namespace: t, annotations: {{kpr.io/lb-mode: {mode}}}}}\nspec:\n  \
         type: LoadBalancer\n  clusterIP: 10.96.0.93\n  externalTrafficPolicy: Cluster\n  ports: [{{name: http, port: 80, \
         nodePort: {node_port}}}, {{name: dns, port: 53, protocol: UDP, nodePort: {}}}]\nstatus:\n  loadBalancer:\n    \
         ingress: [{{ip: \"{LB_IP}\"}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: tu-1, \
         namespace: t, labels: {{kubernetes.io/service-name: tu}}}}\naddressType: IPv4\nports: [{{name: http, port: {POD_PORT}}}, \
         {{name: dns, port: {POD_PORT}, protocol: UDP}}]\nendpoints: [{{addresses: [\"{pod}\"], nodeName: node-b, conditions: \
         {{ready: true}}}}]\n",
        node_port + 1
    )
}

/// UDP: the pod's name, then the address it sees (its answer to "peer?").
fn udp_ask_peer(addr: SocketAddr) -> (String, String) {
    let socket = std::net::UdpSocket::bind(any_port_of(addr.ip())).unwrap();
    socket.connect(addr).unwrap();
    socket.set_read_timeout(Some(TIMEOUT)).unwrap();
    let ask = |question: &[u8]| {
        socket.send(question).unwrap();
        let mut buf = [0u8; 256];
        let n = socket.recv(&mut buf).unwrap_or_else(|e| panic!("UDP {addr}: {e}"));
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    (ask(b"who"), ask(b"peer?"))
}

/// A connection from the client's port `sport` to `addr`, and the name its pod greeted with.
fn connect_from_port(sport: u16, addr: SocketAddrV4) -> (TcpStream, String) {
    use std::io::BufRead as _;
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_reuse_address(true).unwrap();
    socket.bind(&SocketAddrV4::new(EXT_CLIENT, sport).into()).unwrap();
    socket.connect_timeout(&addr.into(), TIMEOUT).unwrap_or_else(|e| panic!("{sport} -> {addr}: {e}"));
    let conn = TcpStream::from(socket);
    conn.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut name = String::new();
    std::io::BufReader::new(&conn).read_line(&mut name).unwrap();
    (conn, name.trim().to_owned())
}

/// The pod's answer to "peer?" on an open connection: the address it sees.
fn ask_peer_on(conn: &mut TcpStream) -> std::io::Result<String> {
    use std::io::{BufRead as _, Write as _};
    conn.write_all(b"peer?\n")?;
    let mut peer = String::new();
    std::io::BufReader::new(&*conn).read_line(&mut peer)?;
    Ok(peer.trim().to_owned())
}

/// Bytes received by `link` in `netns` (`ip -s`: sysfs would show the test's own namespace).
fn rx_bytes(netns: &Netns, link: &str) -> u64 {
    let out = Command::new("ip").args(["-n", &netns.name, "-j", "-s", "link", "show", link]).output().unwrap();
    let links: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    links[0]["stats64"]["rx"]["bytes"].as_u64().unwrap_or_else(|| panic!("rx bytes of {link}: {links}"))
}

/// Send `len` bytes through a connection to `addr` (after its greeting line) and read them back:
/// how many came back, and the connection's path MTU after.
fn bulk_echo(addr: SocketAddrV4, len: usize) -> (usize, i32) {
    use std::io::{BufRead as _, Read as _, Write as _};
    use std::os::fd::AsRawFd as _;
    let conn = TcpStream::connect_timeout(&addr.into(), TIMEOUT).unwrap();
    conn.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut reader = std::io::BufReader::new(conn.try_clone().unwrap());
    let mut greeting = String::new();
    reader.read_line(&mut greeting).unwrap();
    let mut writer = conn;
    let sender = std::thread::spawn(move || writer.write_all(&vec![b'x'; len]).map(|()| writer));
    let mut back = vec![0u8; len];
    let read = reader.read_exact(&mut back).map(|()| len).unwrap_or_else(|e| panic!("echo of {len} bytes: {e}"));
    let conn = sender.join().unwrap().unwrap();
    let (mut mtu, mut size) = (0i32, size_of::<i32>() as u32);
    // SAFETY: an int option of a socket this function owns.
    let rc =
        unsafe { libc::getsockopt(conn.as_raw_fd(), libc::IPPROTO_IP, libc::IP_MTU, (&raw mut mtu).cast(), &mut size) };
    assert_eq!(rc, 0, "IP_MTU: {}", std::io::Error::last_os_error());
    (read, mtu)
}

/// The endpoint's node takes the tunnel's header off only for an endpoint of the frontend
/// the inner packet names: a crafted IP-in-IP packet from outside, a spoofed client's SYN to
/// the LoadBalancer IP inside, opens a flow on node-b while pod-b is the Service's endpoint
/// (as node-a's tunnel would), and none once the endpoint is pod-a: its outer header names an
/// address that is no endpoint of it, and the packet is left as it came.
#[test]
fn dsr_takes_a_tunnel_off_only_for_an_endpoint_of_its_frontend() {
    let c = Bridged::new("km-dsrx").unwrap();
    let (pod_a, pod_b) = (c.nodes[0].pod_ip, c.nodes[1].pod_ip);
    let dsr = |endpoint, node| {
        service("Cluster", 30096, &[(endpoint, node)]).replacen(
            "namespace: t}",
            "namespace: t, annotations: {kpr.io/lb-mode: dsr}}",
            1,
        )
    };
    c.ext.ip(&["route", "add", "10.244.2.0/24", "via", "10.0.0.2"]).unwrap();
    let spoofed = Ipv4Addr::new(203, 0, 113, 9);
    let flows_on_b = |sport: u16| {
        let flows = kpr_conntrack(&c.nodes[1].pins, &["list"]);
        flows.lines().any(|l| l.starts_with(&format!("TCP {spoofed}:{sport} -> {LB_IP}:80")))
    };
    for (endpoint, node, sport, opened) in [(pod_b, "node-b", 45_001, true), (pod_a, "node-a", 45_002, false)] {
        c.write("svc.yaml", &dsr(endpoint, node));
        testbed::wait_for_backends(&c.nodes[1].pins, "*:30096/TCP ext", Duration::from_secs(10), |have| {
            have == Some(&[(IpAddr::from(endpoint), POD_PORT)][..])
        })
        .unwrap();
        c.ext(move || send_in_tunnel(EXT_CLIENT, pod_b, spoofed, sport, SocketAddrV4::new(LB_IP, 80)));
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(flows_on_b(sport), opened, "a flow on node-b for the tunnel to pod-b, the endpoint {endpoint}");
    }
}

/// Send a TCP SYN from `client:sport` to `to`, inside an IPv4-in-IPv4 header from `outer_src` to
/// `outer_dst` (its id the port 8080, as direct server return's), through a raw socket.
fn send_in_tunnel(outer_src: Ipv4Addr, outer_dst: Ipv4Addr, client: Ipv4Addr, sport: u16, to: SocketAddrV4) {
    let header = |src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize, id: u16| {
        let mut ip = [0u8; 20];
        ip[..10].copy_from_slice(&[0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, proto]);
        ip[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&id.to_be_bytes());
        ip[12..16].copy_from_slice(&src.octets());
        ip[16..20].copy_from_slice(&dst.octets());
        let sum: u32 = ip.chunks(2).map(|w| u32::from(u16::from_be_bytes([w[0], w[1]]))).sum();
        let sum = (sum & 0xffff) + (sum >> 16);
        ip[10..12].copy_from_slice(&(!((sum & 0xffff) + (sum >> 16)) as u16).to_be_bytes());
        ip
    };
    let mut tcp = [0u8; 20];
    tcp[0..2].copy_from_slice(&sport.to_be_bytes());
    tcp[2..4].copy_from_slice(&to.port().to_be_bytes());
    tcp[12] = 0x50;
    tcp[13] = 0x02;
    let inner = [&header(client, *to.ip(), 6, 40, 0)[..], &tcp[..]].concat();
    let packet = [&header(outer_src, outer_dst, 4, 60, POD_PORT)[..], &inner[..]].concat();
    let socket = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::RAW,
        Some(socket2::Protocol::from(libc::IPPROTO_RAW)),
    )
    .unwrap();
    socket.send_to(&packet, &SocketAddrV4::new(outer_dst, 0).into()).unwrap();
}

/// The same over IPv6: a dual-stack NodePort from outside, on either node, reaches the pod on
/// node-b through its IPv6 slice, masqueraded to the IPv6 address of the link the packet left
/// by; without an IPv6 endpoint it is refused while IPv4 serves.
#[test]
fn ipv6_node_port_reaches_a_pod_on_another_node_masqueraded() {
    let c = Bridged::new("km-np6").unwrap();
    let (pod_b, pod_b6) = (c.nodes[1].pod_ip, c.nodes[1].pod_ip6);
    c.write("svc.yaml", &dual_stack_service("Cluster", 30080, &[(pod_b, "node-b")], Some(&[(pod_b6, "node-b")])));
    c.wait("[*]:30080/TCP ext", 1);
    for node in 0..2 {
        let ip6 = c.nodes[node].ip6;
        let (name, seen) = c.ext(move || tcp_ask_peer(SocketAddr::new(ip6.into(), 30080), TIMEOUT).unwrap());
        assert_eq!(name, "pod-b", "via {ip6}");
        let expected = if node == 0 { ip6.to_string() } else { "fd00:10:244:2::1".to_owned() };
        assert_eq!(seen, expected, "source address seen by the pod, via {ip6}");
    }
    // The ClusterIP from outside (routed to node-a) is translated as well. clusterCIDR has no
    // IPv6 range, so the IPv6 proxier's local-traffic detector is the no-op one: no masquerade
    // (kube-proxy's rule) and the pod sees the client; its endpoint is node-a's own pod, so
    // the reply comes back through node-a.
    let pod_a6 = c.nodes[0].pod_ip6;
    c.write("svc.yaml", &dual_stack_service("Cluster", 30080, &[(pod_b, "node-b")], Some(&[(pod_a6, "node-a")])));
    let cluster_ip6: Ipv6Addr = format!("fd00:96::{:x}", 30080 % 250).parse().unwrap();
    let on_pod_a = |have: Option<&[(IpAddr, u16)]>| have == Some(&[(IpAddr::from(pod_a6), POD_PORT)][..]);
    testbed::wait_for_backends(&c.nodes[0].pins, &format!("[{cluster_ip6}]:80/TCP"), Duration::from_secs(10), on_pod_a)
        .unwrap();
    let a6 = c.nodes[0].ip6;
    c.ext.ip(&["-6", "route", "add", "fd00:96::/108", "via", &a6.to_string()]).unwrap();
    let (name, seen) = c.ext(move || tcp_ask_peer(SocketAddr::new(cluster_ip6.into(), 80), TIMEOUT).unwrap());
    assert_eq!((name.as_str(), seen.as_str()), ("pod-a", "fd00::100"));

    // No IPv6 endpoint: the IPv6 NodePort refuses (a reset), the IPv4 one still serves.
    c.write("svc.yaml", &dual_stack_service("Cluster", 30080, &[(pod_b, "node-b")], Some(&[])));
    c.wait("[*]:30080/TCP ext", 0);
    let err = c.ext(move || TcpStream::connect_timeout(&SocketAddr::new(a6.into(), 30080), TIMEOUT).unwrap_err());
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
    let a = c.nodes[0].ip;
    let (name, _) = c.ext(move || tcp_ask_peer(SocketAddrV4::new(a, 30080), TIMEOUT).unwrap());
    assert_eq!(name, "pod-b");
}

/// `--forward-direct always`: translated packets skip the host's forwarding path even where it
/// filters (the operator's choice; a NetworkPolicy there does not hold for them).
#[test]
fn forward_direct_always_skips_a_forward_chain_that_drops() {
    let c = Bridged::new_with("km-fwd", &["--forward-direct", "always"]).unwrap();
    // Docker's FORWARD policy on node-a: the host's forwarding path drops whatever it sees.
    c.nodes[0]
        .netns
        .sh("nft add table ip kprtest && nft add chain ip kprtest kprforward '{ type filter hook forward priority 0; policy drop; }'")
        .unwrap();
    let pod_b = c.nodes[1].pod_ip;
    c.write("svc.yaml", &service("Cluster", 30080, &[(pod_b, "node-b")]));
    c.wait("*:30080/TCP ext", 1);
    let a = c.nodes[0].ip;
    let (name, seen) = c.ext(move || tcp_ask_peer(SocketAddrV4::new(a, 30080), TIMEOUT).unwrap());
    // Translated on node-a's eth0 and sent straight back out of it, the reply likewise.
    assert_eq!((name.as_str(), seen), ("pod-b", a.to_string()));
    let counters = bpf::read_counters(&c.nodes[0].pins).unwrap();
    let forwarded = counters[proxy_common::counter::TC_FORWARDED_DIRECT as usize].1;
    assert!(forwarded >= 2, "the SYN and the SYN-ACK at least: {forwarded}");
    // node-a's eth0 is a veth whose other end is the switch's port: what goes back to the
    // client (the SYN-ACK, the pod's answer) is handed to that end at once, with the MAC
    // addresses the switch forwards by (they came to node-a's own MAC: kept, the switch would
    // drop them as frames for the port they came from). The SYN's next hop, node-b, is not
    // resolved yet: it takes `bpf_redirect_neigh`, which resolves it.
    let to_peer = counters[proxy_common::counter::TC_REDIRECTED_PEER as usize].1;
    assert!(to_peer >= 2, "the SYN-ACK and the answer to the switch's end of eth0: {to_peer}");
}

/// The value the agent keeps in `KPR_HOST_STATE` for the programs, once it is `want`
/// (`--forward-direct auto` follows the host's forward hook, checked every second).
fn wait_host_state(pins: &std::path::Path, want: bool) {
    let deadline = std::time::Instant::now() + testbed::slow(Duration::from_secs(10));
    loop {
        let have = bpf::HostState::open(pins).and_then(|s| s.forward_direct()).ok();
        if have == Some(want) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "forward direct is {have:?}, not {want}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A NetworkPolicy as Calico's iptables dataplane enforces one, in `node`'s forward hook: what
/// goes to pod-b's port is dropped (and counted: [`forward_rule_packets`]).
fn deny_pod_b_in_forward(node: &Netns) {
    node.sh("nft add table inet kprpol && \
             nft add chain inet kprpol forward '{ type filter hook forward priority 0; policy accept; }' && \
             nft add rule inet kprpol forward ip daddr 10.244.2.2 tcp dport 8080 counter drop")
        .unwrap();
}

/// The packets the first counter rule of a node's `inet kprpol forward` chain has seen.
fn forward_rule_packets(node: &Netns) -> u64 {
    let mut nft = Command::new("nft");
    nft.args(["list", "chain", "inet", "kprpol", "forward"]);
    node.exec_in(&mut nft).unwrap();
    let out = nft.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let words: Vec<&str> = text.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "packets").expect("a counter in the chain");
    words[at + 1].parse().unwrap()
}

/// A NetworkPolicy enforced in the host's FORWARD chain (as Calico's iptables dataplane,
/// kube-router and kube-network-policies enforce it: a rule that drops what goes to pod-b's
/// port) holds for Service traffic through kpr as it does through kube-proxy, whose DNATed
/// packets are forwarded by the host: a NodePort from outside and the ClusterIP from pod-a
/// (translated per packet on node-a) both fail, and the policy's counter saw them. With the
/// policy gone, the same connections are served again, straight out of their link.
#[test]
fn a_network_policy_in_the_forward_chain_holds_for_service_traffic() {
    let c = Bridged::new("km-pol").unwrap();
    let pod_b = c.nodes[1].pod_ip;
    c.write("svc.yaml", &service("Cluster", 30080, &[(pod_b, "node-b")]));
    c.wait("*:30080/TCP ext", 1);
    let (a, cluster_ip) = (c.nodes[0].ip, SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, (30080 % 250) as u8), 80));
    let node_a = &c.nodes[0];
    let direct = || bpf::read_counters(&node_a.pins).unwrap()[proxy_common::counter::TC_FORWARDED_DIRECT as usize].1;
    // Nothing filters yet: straight out.
    wait_host_state(&node_a.pins, true);
    let before = direct();
    let (name, _) = c.ext(move || tcp_ask_peer(SocketAddrV4::new(a, 30080), TIMEOUT).unwrap());
    assert_eq!(name, "pod-b");
    assert!(direct() > before, "sent straight out while nothing filters");

    // The policy: pod-b's port denied in node-a's forward hook.
    deny_pod_b_in_forward(&node_a.netns);
    wait_host_state(&node_a.pins, false);
    let short = Duration::from_millis(500);
    for attempt in 0..3 {
        let err = c.ext(move || tcp_ask_peer(SocketAddrV4::new(a, 30080), short).unwrap_err());
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "NodePort attempt {attempt}: {err}");
        let err = node_a._pod.run(move || tcp_ask_peer(cluster_ip, short).unwrap_err()).unwrap();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "ClusterIP from pod-a, attempt {attempt}: {err}");
    }
    let dropped = forward_rule_packets(&node_a.netns);
    assert!(dropped >= 6, "the policy saw every SYN (3 NodePort, 3 ClusterIP): {dropped}");

    // The policy gone: served again, straight out.
    node_a.netns.sh("nft delete table inet kprpol").unwrap();
    wait_host_state(&node_a.pins, true);
    let before = direct();
    let (name, _) = c.ext(move || tcp_ask_peer(SocketAddrV4::new(a, 30080), TIMEOUT).unwrap());
    assert_eq!(name, "pod-b");
    let (name, _) = node_a._pod.run(move || tcp_ask_peer(cluster_ip, TIMEOUT).unwrap()).unwrap();
    assert_eq!(name, "pod-b");
    assert!(direct() > before);
}

/// The L4 checksum of a translated packet verifies in both of the kernel's states, which kpr
/// tells apart from the field itself: complete (a client without checksum offload; the pod
/// verifies the sum), and left to the device (`CHECKSUM_PARTIAL`, veth's default; node-a's
/// eth0, here without offload, has the kernel complete the sum from what kpr left, and the pod
/// and the client verify it). A wrong sum is a segment dropped, and a connection that never
/// answers.
#[test]
fn node_port_checksums_verify_whoever_completes_them() {
    let c = Bridged::new("km-csum").unwrap();
    let (pod_b, pod_b6) = (c.nodes[1].pod_ip, c.nodes[1].pod_ip6);
    c.write("svc.yaml", &dual_stack_service("Cluster", 30080, &[(pod_b, "node-b")], Some(&[(pod_b6, "node-b")])));
    c.wait("*:30080/TCP ext", 1);
    c.wait("[*]:30080/TCP ext", 1);
    let (a, a6) = (c.nodes[0].ip, c.nodes[0].ip6);
    // Through node-a in each family: the pod answers, and sees node-a's address (masquerade).
    let ask_both = |c: &Bridged, case: &str| {
        for (node, addr) in
            [(IpAddr::from(a), SocketAddr::new(a.into(), 30080)), (a6.into(), SocketAddr::new(a6.into(), 30080))]
        {
            let answer = c.ext(move || tcp_ask_peer(addr, TIMEOUT));
            let (name, seen) = answer.unwrap_or_else(|e| panic!("{case}, via {addr}: {e}"));
            assert_eq!((name.as_str(), seen), ("pod-b", node.to_string()), "{case}, via {addr}");
        }
    };
    c.ext(|| kpr_tests::set_tx_checksum_offload("eth0", false)).unwrap();
    ask_both(&c, "complete checksums from the client");
    c.ext(|| kpr_tests::set_tx_checksum_offload("eth0", true)).unwrap();
    c.nodes[0].netns.run(|| kpr_tests::set_tx_checksum_offload("eth0", false)).unwrap().unwrap();
    ask_both(&c, "checksums left to the device, completed by node-a");
}

/// `kpr COMMAND ARGS --pin-root pins`: stdout, after checking the command succeeded.
fn kpr(command: &str, pins: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(kpr_tests::kpr_bin())
        .arg(command)
        .args(args)
        .arg("--pin-root")
        .arg(pins)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "kpr {command} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn kpr_conntrack(pins: &std::path::Path, args: &[&str]) -> String {
    kpr("conntrack", pins, args)
}

#[test]
fn kpr_conntrack_lists_a_node_port_flow_and_flushing_it_keeps_the_connection() {
    use std::io::{BufRead as _, BufReader, Write as _};
    let c = Bridged::new("km-ct").unwrap();
    let pod_b = c.nodes[1].pod_ip;
    c.write("svc.yaml", &service("Cluster", 30080, &[(pod_b, "node-b")]));
    c.wait("*:30080/TCP ext", 1);
    let node_a = c.nodes[0].ip;
    let conn = c.ext(move || {
        let conn = TcpStream::connect_timeout(&SocketAddrV4::new(node_a, 30080).into(), TIMEOUT).unwrap();
        conn.set_read_timeout(Some(TIMEOUT)).unwrap();
        let mut line = String::new();
        BufReader::new(&conn).read_line(&mut line).unwrap();
        assert_eq!(line.trim_end(), "pod-b");
        conn
    });
    let client = conn.local_addr().unwrap().to_string();

    let pins = &c.nodes[0].pins;
    let flows: serde_json::Value = serde_json::from_str(&kpr_conntrack(pins, &["list", "-o", "json"])).unwrap();
    let flow = flows.as_array().unwrap().iter().find(|f| f["client"] == client.as_str());
    let flow = flow.unwrap_or_else(|| panic!("no flow of {client} in {flows:#}"));
    assert_eq!(flow["frontend"], format!("{node_a}:30080"));
    assert_eq!(flow["backend"], format!("{pod_b}:{POD_PORT}"));
    assert_eq!(flow["state"], "established");
    // Masqueraded (eTP=Cluster): the pod sees node-a's address.
    assert!(flow["sourceSeen"].as_str().unwrap().starts_with(&format!("{node_a}:")), "{flow}");
    assert!(kpr_conntrack(pins, &["list", "--frontend", "*:30080/TCP ext"]).contains(&client));

    let flushed = kpr_conntrack(pins, &["flush", "--frontend", "*:30080/TCP"]);
    assert!(flushed.starts_with("removed 2 conntrack entries"), "{flushed}");
    assert!(!kpr_conntrack(pins, &["list"]).contains(&client));
    // The connection's next segment finds no flow and re-creates it: same backend, same
    // masquerade port (a hash of the tuple), so the connection goes on.
    let mut conn = conn;
    conn.write_all(b"still here\n").unwrap();
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line).expect("the connection survives the flush");
    assert_eq!(line.trim_end(), "still here");
    assert!(kpr_conntrack(pins, &["list"]).contains(&client), "the flow is back");
}

/// `kpr trace ARGS -o json` on `pins`.
fn kpr_trace(pins: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let args: Vec<&str> = args.iter().copied().chain(["-o", "json"]).collect();
    serde_json::from_str(&kpr("trace", pins, &args)).unwrap()
}

#[test]
fn kpr_trace_explains_each_source_class_from_the_live_maps() {
    let c = Bridged::new("km-trace").unwrap();
    let (pod_a, pod_b) = (c.nodes[0].pod_ip, c.nodes[1].pod_ip);
    c.write("svc.yaml", &service("Local", 30082, &[(pod_a, "node-a")]));
    testbed::wait_programmed(&c.nodes[0].pins, "*:30082/TCP ext", Some(1), testbed::slow(PROGRAMMED_WITHIN)).unwrap();
    testbed::wait_programmed(&c.nodes[1].pins, "*:30082/TCP ext", Some(0), testbed::slow(PROGRAMMED_WITHIN)).unwrap();
    let (a, b) = (c.nodes[0].ip, c.nodes[1].ip);
    let ext = EXT_CLIENT.to_string();

    // An external client on node-a's NodePort: per-packet, its address kept (eTP=Local).
    let t = kpr_trace(&c.nodes[0].pins, &[&ext, &format!("{a}:30082/TCP")]);
    assert_eq!((t["from"].as_str(), t["path"].as_str()), (Some("external"), Some("per-packet")), "{t:#}");
    assert_eq!(t["frontend"]["frontend"], "*:30082/TCP ext");
    assert_eq!(t["candidates"], serde_json::json!([format!("{pod_a}:{POD_PORT}")]));
    assert_eq!(t["masquerade"], false);
    assert_eq!(t["verdict"], "to one of 1 endpoints");
    // The same on node-b, which has no local endpoint: dropped, as the real test above sees.
    let t = kpr_trace(&c.nodes[1].pins, &[&ext, &format!("{b}:30082/TCP")]);
    assert_eq!(t["verdict"], "dropped", "{t:#}");
    // A pod on node-b (inside clusterCIDR) reaching the ClusterIP: the socket path, any endpoint.
    let t = kpr_trace(&c.nodes[1].pins, &[&pod_b.to_string(), "10.96.0.82:80/TCP"]);
    assert_eq!((t["from"].as_str(), t["path"].as_str()), (Some("pod"), Some("socket")), "{t:#}");
    assert_eq!(t["verdict"], "to one of 1 endpoints");
    assert!(t.get("masquerade").is_none());
    // Not a service.
    let t = kpr_trace(&c.nodes[0].pins, &[&ext, &format!("{a}:22/TCP")]);
    assert_eq!(t["verdict"], "not a service: passed untouched", "{t:#}");
    // Masquerade with eTP=Cluster from outside.
    c.write("svc2.yaml", &service("Cluster", 30083, &[(pod_b, "node-b")]));
    c.wait("*:30083/TCP ext", 1);
    let t = kpr_trace(&c.nodes[0].pins, &[&ext, &format!("{a}:30083/TCP")]);
    assert_eq!(t["masquerade"], true, "{t:#}");
}

#[test]
fn local_traffic_policy_keeps_the_client_address_and_drops_without_local_endpoints() {
    let c = Bridged::new("km-local").unwrap();
    let pod_a = c.nodes[0].pod_ip;
    c.write("svc.yaml", &service("Local", 30081, &[(pod_a, "node-a")]));
    testbed::wait_programmed(&c.nodes[0].pins, "*:30081/TCP ext", Some(1), testbed::slow(PROGRAMMED_WITHIN)).unwrap();
    testbed::wait_programmed(&c.nodes[1].pins, "*:30081/TCP ext", Some(0), testbed::slow(PROGRAMMED_WITHIN)).unwrap();
    let (a, b) = (c.nodes[0].ip, c.nodes[1].ip);
    let (name, seen) = c.ext(move || tcp_ask_peer(SocketAddrV4::new(a, 30081), TIMEOUT).unwrap());
    assert_eq!(name, "pod-a");
    assert_eq!(seen, EXT_CLIENT.to_string(), "eTP=Local preserves the client source address");
    let err = c
        .ext(move || {
            TcpStream::connect_timeout(&SocketAddrV4::new(b, 30081).into(), Duration::from_millis(700)).map(drop)
        })
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "node-b has no local endpoint: dropped, not refused ({err})");

    // The healthCheckNodePort tells a cloud load balancer which node can serve.
    let (status_a, body_a) = c.ext(move || health_check(SocketAddrV4::new(a, 31081)));
    let (status_b, body_b) = c.ext(move || health_check(SocketAddrV4::new(b, 31081)));
    assert_eq!(status_a, 200, "{body_a}");
    assert_eq!(status_b, 503, "{body_b}");
    let json = |body: &str| serde_json::from_str::<serde_json::Value>(body).unwrap();
    assert_eq!(
        json(&body_a),
        serde_json::json!({"service": {"namespace": "t", "name": "web-30081"}, "localEndpoints": 1, "serviceProxyHealthy": true})
    );
    assert_eq!(json(&body_b)["localEndpoints"], 0);
}

/// (status, body) of `GET /` (retried briefly: the server starts with the sync).
fn health_check(addr: SocketAddrV4) -> (u16, String) {
    for _ in 0..50 {
        if let Ok(answer) = testbed::http_get(addr.into(), "/", TIMEOUT) {
            return answer;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("no health check server on {addr}");
}

#[test]
fn no_endpoints_is_refused_and_an_endpoint_can_move_while_traffic_runs() {
    let c = Bridged::new("km-move").unwrap();
    let (pod_a, pod_b) = (c.nodes[0].pod_ip, c.nodes[1].pod_ip);
    c.write("svc.yaml", &service("Cluster", 30082, &[]));
    c.wait("*:30082/TCP ext", 0);
    let a = c.nodes[0].ip;
    // `kpr events` on node-a shows the refusal: the reason, the client, the frontend.
    let events = Command::new(kpr_tests::kpr_bin())
        .args(["events", "--count", "1", "--timeout", "20s", "-o", "json", "--pin-root"])
        .arg(&c.nodes[0].pins)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let wanted = bpf::open_pinned_map(&c.nodes[0].pins, proxy_common::map_names::EVENTS_WANTED).unwrap();
    let wanted = aya::maps::Array::<_, u64>::try_from(aya::maps::Map::Array(wanted)).unwrap();
    while wanted.get(&0, 0).unwrap() == 0 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let (err, port) = c.ext(move || {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket.bind(&SocketAddrV4::new(EXT_CLIENT, 0).into()).unwrap();
        let port = socket.local_addr().unwrap().as_socket().unwrap().port();
        (socket.connect_timeout(&SocketAddrV4::new(a, 30082).into(), TIMEOUT).unwrap_err(), port)
    });
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
    let out = events.wait_with_output().unwrap();
    let event: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON event");
    assert_eq!(event["reason"], "rejected", "{event}");
    assert_eq!(event["protocol"], "TCP");
    assert_eq!(event["source"], format!("{EXT_CLIENT}:{port}"));
    assert_eq!(event["destination"], format!("{a}:30082"));

    c.write("svc.yaml", &service("Cluster", 30082, &[(pod_b, "node-b")]));
    c.wait("*:30082/TCP ext", 1);
    // A long-lived connection to pod-b through node-a...
    let mut conn = c.ext(move || {
        let conn = TcpStream::connect_timeout(&SocketAddrV4::new(a, 30082).into(), TIMEOUT).unwrap();
        conn.set_read_timeout(Some(TIMEOUT)).unwrap();
        conn
    });
    let mut reader = std::io::BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut reader, &mut line).unwrap();
    assert_eq!(line.trim_end(), "pod-b");

    // ...survives the endpoint moving to node-a; new connections go to the new endpoint.
    c.write("svc.yaml", &service("Cluster", 30082, &[(pod_a, "node-a")]));
    for node in &c.nodes {
        testbed::wait_for_backends(&node.pins, "*:30082/TCP ext", Duration::from_secs(10), |b| {
            b == Some(&[(pod_a.into(), POD_PORT)][..])
        })
        .unwrap();
    }
    let names: Vec<String> =
        c.ext(move || (0..10).map(|_| tcp_ask(SocketAddrV4::new(a, 30082), TIMEOUT).unwrap().0).collect());
    assert!(names.iter().all(|n| n == "pod-a"), "{names:?}");
    std::io::Write::write_all(&mut conn, b"still there\n").unwrap();
    line.clear();
    std::io::BufRead::read_line(&mut reader, &mut line).unwrap();
    assert_eq!(line, "still there\n", "the established flow keeps its backend");
}

#[test]
fn a_pod_reaching_itself_through_its_service_is_masqueraded() {
    let c = Bridged::new("km-hairpin").unwrap();
    let pod_a = c.nodes[0].pod_ip;
    c.write("svc.yaml", &service("Cluster", 30083, &[(pod_a, "node-a")]));
    c.wait("10.96.0.83:80/TCP", 1);
    let (name, seen) = c.nodes[0]
        ._pod
        .run(|| tcp_ask_peer(SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 83), 80), TIMEOUT).unwrap())
        .unwrap();
    assert_eq!(name, "pod-a");
    // Masqueraded to the node's address on the pod's link (MASQUERADE's choice).
    assert_eq!(seen, "10.244.1.1", "hairpin traffic comes from the node, so the reply returns through it");
}

/// A pod listening on the wildcard address at its service's backend port is not that
/// backend: its connection is translated at its socket, to the other pod, which sees it. A pod
/// that is its own backend, listening on the wildcard address only, is still a hairpin.
#[test]
fn a_wildcard_listener_on_the_backend_port_is_no_hairpin() {
    use proxy_common::counter::{SOCK_STEPPED_ASIDE, TC_NEW_FLOW, TRANSLATED};
    const PORT: u16 = 9090;
    let mut c = Bridged::new("km-wild").unwrap();
    // This process's sockets are node-a's pods' (the socket path's cgroup).
    c.nodes[0].cgroup.enter().unwrap();
    let (pod_a, pod_b) = (c.nodes[0].pod_ip, c.nodes[1].pod_ip);
    let on_port = |text: String| text.replace(&format!("port: {POD_PORT}}}]"), &format!("port: {PORT}}}]"));
    let _b = NameServer::tcp(&c.nodes[1]._pod, SocketAddrV4::new(pod_b, PORT), "pod-b").unwrap();
    let pod = &c.nodes[0]._pod;
    let _wildcard = NameServer::tcp(pod, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, PORT), "wildcard").unwrap();
    let counters = || bpf::read_counters(&c.nodes[0].pins).unwrap();
    let at = |i: u32, counters: &[(&str, u64)]| counters[i as usize].1;
    let ask =
        || pod.run(|| tcp_ask_peer(SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 86), 80), TIMEOUT).unwrap()).unwrap();

    c.write("svc.yaml", &on_port(service("Cluster", 30086, &[(pod_b, "node-b")])));
    c.wait("10.96.0.86:80/TCP", 1);
    let before = counters();
    let (name, seen) = ask();
    let after = counters();
    assert_eq!(name, "pod-b");
    assert_eq!(seen, pod_a.to_string(), "not masqueraded: pod-a is not the backend");
    assert_eq!(at(SOCK_STEPPED_ASIDE, &after), at(SOCK_STEPPED_ASIDE, &before), "not left to the per-packet path");
    assert_eq!(at(TRANSLATED, &after), at(TRANSLATED, &before) + 1, "translated at the socket");
    assert_eq!(at(TC_NEW_FLOW, &after), at(TC_NEW_FLOW, &before), "no per-packet flow on node-a");

    c.write("svc.yaml", &on_port(service("Cluster", 30086, &[(pod_a, "node-a")])));
    let on_pod_a = |have: Option<&[(IpAddr, u16)]>| have == Some(&[(IpAddr::from(pod_a), PORT)][..]);
    testbed::wait_for_backends(&c.nodes[0].pins, "10.96.0.86:80/TCP", Duration::from_secs(10), on_pod_a).unwrap();
    let (name, seen) = ask();
    assert_eq!(name, "wildcard");
    assert_eq!(seen, "10.244.1.1", "masqueraded as a hairpin");
}

/// A service mesh's sidecar (Istio's, Linkerd's) redirects its pod's outbound TCP to itself
/// with a NAT rule in the pod, reads the original destination (`SO_ORIGINAL_DST`) and routes
/// by it. Behind kube-proxy that is the Service's address, as the pod's packets are translated
/// only once they reach the node. With the socket path on for pods (kpr's default) the
/// sidecar sees the endpoint instead; with `--socket-lb host-only` it sees the Service, and
/// its own connection to the Service is served per packet on pod-a's link.
#[test]
fn socket_lb_host_only_lets_a_mesh_sidecar_see_the_service_address() {
    use proxy_common::counter::TRANSLATED;
    let cluster_ip = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 87), 80);
    for (args, original) in [
        (&[][..], SocketAddrV4::new(Ipv4Addr::new(10, 244, 2, 2), POD_PORT)),
        (&["--socket-lb", "host-only"][..], cluster_ip),
    ] {
        let mut c = Bridged::new_with("km-mesh", args).unwrap();
        // This process's sockets are node-a's pods' (the socket path's cgroup).
        c.nodes[0].cgroup.enter().unwrap();
        let pod = &c.nodes[0]._pod;
        redirect_to_a_sidecar(pod);
        c.write("svc.yaml", &service("Cluster", 30087, &[(c.nodes[1].pod_ip, "node-b")]));
        c.wait("10.96.0.87:80/TCP", 1);
        let translated = || bpf::read_counters(&c.nodes[0].pins).unwrap()[TRANSLATED as usize].1;
        let before = translated();
        let answer = through_the_sidecar(pod, cluster_ip);
        assert_eq!(answer, format!("{original} pod-b"), "{args:?}: what the sidecar saw, and who answered it");
        let at_socket = translated() - before;
        let expected = if args.is_empty() { 1 } else { 0 };
        assert_eq!(at_socket, expected, "{args:?}: connections translated at pod-a's sockets");
    }
}

/// Per pod, with the socket path on for the rest: a pod annotated `kpr.io/socket-lb: "off"`,
/// in a Namespace so annotated, or injected by a mesh (`sidecar.istio.io/status`) is left to
/// the per-packet path, and its sidecar sees the Service's address; `"on"` on the Pod wins over
/// its Namespace. The pod is this process, in a cgroup named as kubelet's systemd driver names
/// it, below node-a's (where the socket hooks are).
#[test]
fn a_pod_opts_out_of_the_socket_path_by_annotation() {
    const UID: &str = "5f0c1d2e-0000-4000-8000-00000000a001";
    let c = Bridged::new("km-optout").unwrap();
    let (_pod_cgroup, pod_cgroup_id) = enter_a_pod_cgroup(&c, UID);
    let pod = &c.nodes[0]._pod;
    redirect_to_a_sidecar(pod);
    c.write("svc.yaml", &service("Cluster", 30088, &[(c.nodes[1].pod_ip, "node-b")]));
    c.wait("10.96.0.88:80/TCP", 1);
    let cluster_ip = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 88), 80);
    let endpoint = SocketAddrV4::new(c.nodes[1].pod_ip, POD_PORT);
    let off = "kpr.io/socket-lb: 'off'";
    for (pod_annotations, namespace_annotations, original) in [
        ("", "", endpoint),
        (off, "", cluster_ip),
        ("", off, cluster_ip),
        ("kpr.io/socket-lb: 'on'", off, endpoint),
        ("sidecar.istio.io/status: '{}'", "", cluster_ip),
    ] {
        c.write(
            "pod.yaml",
            &format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: app, namespace: t, uid: {UID}, annotations: {{{pod_annotations}}}}}\n\
                 spec: {{nodeName: node-a, containers: [{{name: app, image: app}}]}}\n---\napiVersion: v1\nkind: Namespace\n\
                 metadata: {{name: t, annotations: {{{namespace_annotations}}}}}\n"
            ),
        );
        let skipped = original == cluster_ip;
        let deadline = std::time::Instant::now() + testbed::slow(Duration::from_secs(10));
        while bpf::read_socket_skip(&c.nodes[0].pins).unwrap().contains_key(&pod_cgroup_id) != skipped {
            assert!(
                std::time::Instant::now() < deadline,
                "pod {pod_annotations:?}, namespace {namespace_annotations:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let answer = through_the_sidecar(pod, cluster_ip);
        assert_eq!(answer, format!("{original} pod-b"), "pod {pod_annotations:?}, namespace {namespace_annotations:?}");
    }
}

/// A VM in a pod (KubeVirt's masquerade binding): the guest's NIC is joined to a TAP device in
/// the pod (the frames a hypervisor carries), and the pod masquerades the guest's traffic out
/// of its own link. The guest's sockets are its own kernel's, never the node's: here the guest
/// is a namespace whose processes are outside the cgroup kpr's socket hooks are attached to.
/// With the socket path on (kpr's default) its connection to a ClusterIP crosses the TAP
/// device and the pod's NAT untranslated and is served per packet on the pod's link, as by
/// kube-proxy: a sidecar inside the guest sees the Service's address, the endpoint answers.
#[test]
fn a_guest_behind_a_tap_device_in_a_pod_sees_the_service_address() {
    use proxy_common::counter::{TC_NEW_FLOW, TRANSLATED};
    let c = Bridged::new("km-tap").unwrap();
    let pod = &c.nodes[0]._pod;
    let (guest, _hypervisor) = guest_behind_a_tap(pod);
    c.write("svc.yaml", &service("Cluster", 30089, &[(c.nodes[1].pod_ip, "node-b")]));
    c.wait("10.96.0.89:80/TCP", 1);
    let counters = || bpf::read_counters(&c.nodes[0].pins).unwrap();
    let at = |i: u32, counters: &[(&str, u64)]| counters[i as usize].1;
    let before = counters();
    let cluster_ip = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 89), 80);
    let answer = through_the_sidecar(&guest, cluster_ip);
    let after = counters();
    assert_eq!(answer, format!("{cluster_ip} pod-b"), "what the guest's sidecar saw, and who answered");
    assert_eq!(at(TRANSLATED, &after), at(TRANSLATED, &before), "nothing translated at a socket");
    assert!(at(TC_NEW_FLOW, &after) > at(TC_NEW_FLOW, &before), "served per packet on the pod's link");
}

/// A sandbox on the node's kernel in a pod (a container runtime in a pod, a sandbox on host
/// sockets): its processes are the pod's (its cgroup), in a namespace nested in the pod's and
/// leaving by it (here as the guest above). Opted out (`kpr.io/socket-lb: "off"`), its
/// connections are left to the per-packet path: the agent lists the pod's other namespaces as
/// covered by the link of its own (the one its sandbox's `pause` is in, behind pod-a's link).
/// Without the annotation they are translated at the socket, and the sidecar sees the
/// endpoint.
#[test]
fn a_namespace_nested_in_an_opted_out_pod_is_served_per_packet() {
    const UID: &str = "5f0c1d2e-0000-4000-8000-00000000a003";
    let c = Bridged::new("km-nest").unwrap();
    let (_pod_cgroup, pod_cgroup_id) = enter_a_pod_cgroup(&c, UID);
    let pod = &c.nodes[0]._pod;
    // The pod's sandbox process, in the pod's namespace and cgroup (this process's).
    let mut pause = std::process::Command::new("sleep");
    pause.arg("600");
    pod.exec_in(&mut pause).unwrap();
    let _pause = Reaped(pause.spawn().unwrap());
    let (guest, _hypervisor) = guest_behind_a_tap(pod);
    let guest_cookie = guest.run(kpr::netns::cookie).unwrap().expect("SO_NETNS_COOKIE");
    // The sandbox's own init, in the nested namespace and the pod's cgroup.
    let mut init = std::process::Command::new("sleep");
    init.arg("600");
    guest.exec_in(&mut init).unwrap();
    let _init = Reaped(init.spawn().unwrap());
    c.write("svc.yaml", &service("Cluster", 30090, &[(c.nodes[1].pod_ip, "node-b")]));
    c.wait("10.96.0.90:80/TCP", 1);
    let cluster_ip = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 90), 80);
    let endpoint = SocketAddrV4::new(c.nodes[1].pod_ip, POD_PORT);
    for (annotations, original) in [("", endpoint), ("kpr.io/socket-lb: 'off'", cluster_ip)] {
        c.write(
            "pod.yaml",
            &format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: sandbox, namespace: t, uid: {UID}, annotations: {{{annotations}}}}}\n\
                 spec: {{nodeName: node-a, containers: [{{name: app, image: app}}]}}\n"
            ),
        );
        // Opted out: the pod's cgroup left alone, and the guest's namespace covered as pod-a's.
        let want = original == cluster_ip;
        let deadline = std::time::Instant::now() + testbed::slow(Duration::from_secs(10));
        loop {
            let skipped = bpf::read_socket_skip(&c.nodes[0].pins).unwrap().contains_key(&pod_cgroup_id);
            let covered = bpf::read_covered_netns(&c.nodes[0].pins).unwrap().contains(&guest_cookie);
            if skipped == want && covered == want {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "pod {annotations:?}: skipped {skipped}, covered {covered}");
            std::thread::sleep(Duration::from_millis(50));
        }
        let answer = through_the_sidecar(&guest, cluster_ip);
        assert_eq!(answer, format!("{original} pod-b"), "pod {annotations:?}: what the sandbox's sidecar saw");
    }
}

/// Move this process into a cgroup of pod `uid` below node-a's (where the socket hooks are),
/// named as kubelet's systemd driver names it; the cgroup and its id.
fn enter_a_pod_cgroup(c: &Bridged, uid: &str) -> (Cgroup, u64) {
    use std::os::unix::fs::MetadataExt as _;
    let node_cgroup = c.nodes[0].cgroup.path.file_name().unwrap().to_string_lossy().into_owned();
    let mut pod_cgroup =
        Cgroup::new(&format!("{node_cgroup}/kubepods-besteffort-pod{}.slice", uid.replace('-', "_"))).unwrap();
    pod_cgroup.enter().unwrap();
    let id = std::fs::metadata(&pod_cgroup.path).unwrap().ino();
    (pod_cgroup, id)
}

/// A child process killed and reaped when dropped.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A guest namespace whose NIC is joined to a TAP device `tap0` in `pod` (the wire is the
/// hypervisor), the pod masquerading it out of its own link as KubeVirt's masquerade binding
/// does, and a sidecar redirect in the guest.
fn guest_behind_a_tap(pod: &Netns) -> (Netns, testbed::Wire) {
    let guest = Netns::new(&testbed::unique_name("km-guest")).unwrap();
    let host_side = pod.run(|| testbed::Tun::open_tap("tap0")).unwrap().unwrap();
    let guest_nic = guest.run(|| testbed::Tun::open_tap("eth0")).unwrap().unwrap();
    let wire = testbed::Tun::join(host_side, guest_nic);
    pod.sh("ip addr add 10.0.2.1/24 dev tap0 && ip link set tap0 up && sysctl -qw net.ipv4.ip_forward=1 && \
         nft add table ip vm && nft add chain ip vm post '{ type nat hook postrouting priority 100; }' && \
         nft add rule ip vm post ip saddr 10.0.2.0/24 oifname != tap0 masquerade")
        .unwrap();
    guest
        .sh("ip link set lo up && ip addr add 10.0.2.2/24 dev eth0 && ip link set eth0 up && ip route add default via 10.0.2.1")
        .unwrap();
    redirect_to_a_sidecar(&guest);
    (guest, wire)
}

const SIDECAR_PORT: u16 = 15001;
const SIDECAR_MARK: u32 = 0x539;

/// A sidecar's redirect in `pod`: every outbound TCP connection but the sidecar's own (marked)
/// goes to the sidecar's port.
fn redirect_to_a_sidecar(pod: &Netns) {
    pod.sh(&format!(
        "nft add table ip mesh && \
         nft add chain ip mesh out '{{ type nat hook output priority -100; }}' && \
         nft add rule ip mesh out meta mark != {SIDECAR_MARK} tcp dport != {SIDECAR_PORT} redirect to :{SIDECAR_PORT}"
    ))
    .unwrap();
}

/// Connect from `pod` to `service` through its sidecar, which reads the original destination,
/// connects there itself and answers "<original destination> <the name its upstream gave>".
fn through_the_sidecar(pod: &Netns, service: SocketAddrV4) -> String {
    let listener = pod.run(|| std::net::TcpListener::bind(("0.0.0.0", SIDECAR_PORT)).unwrap()).unwrap();
    let sidecar = pod
        .spawn(move || -> Result<()> {
            use std::io::{BufRead as _, Write as _};
            let (mut client, _) = listener.accept()?;
            let original = original_dst(&client)?;
            let upstream = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
            setsockopt_mark(&upstream, SIDECAR_MARK);
            upstream.connect_timeout(&SocketAddr::V4(original).into(), TIMEOUT)?;
            let upstream: TcpStream = upstream.into();
            upstream.set_read_timeout(Some(TIMEOUT))?;
            let mut name = String::new();
            std::io::BufReader::new(upstream).read_line(&mut name)?;
            writeln!(client, "{original} {}", name.trim_end())?;
            Ok(())
        })
        .unwrap();
    let answer = pod
        .run(move || {
            use std::io::BufRead as _;
            let conn = TcpStream::connect_timeout(&service.into(), TIMEOUT).unwrap();
            conn.set_read_timeout(Some(TIMEOUT)).unwrap();
            let mut line = String::new();
            std::io::BufReader::new(conn).read_line(&mut line).unwrap();
            line.trim_end().to_owned()
        })
        .unwrap();
    sidecar.join().unwrap().unwrap();
    answer
}

/// The destination a connection had before a NAT rule redirected it (`SO_ORIGINAL_DST`).
fn original_dst(conn: &TcpStream) -> std::io::Result<SocketAddrV4> {
    use std::os::fd::AsRawFd as _;
    const SO_ORIGINAL_DST: i32 = 80;
    // SAFETY: a sockaddr_in is plain bytes; getsockopt writes at most `len` of them.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
    let rc =
        unsafe { libc::getsockopt(conn.as_raw_fd(), libc::SOL_IP, SO_ORIGINAL_DST, (&raw mut addr).cast(), &mut len) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(SocketAddrV4::new(u32::from_be(addr.sin_addr.s_addr).into(), u16::from_be(addr.sin_port)))
}

fn setsockopt_mark(socket: &socket2::Socket, mark: u32) {
    use std::os::fd::AsRawFd as _;
    // SAFETY: an int option of a socket this function borrows.
    let rc =
        unsafe { libc::setsockopt(socket.as_raw_fd(), libc::SOL_SOCKET, libc::SO_MARK, (&raw const mark).cast(), 4) };
    assert_eq!(rc, 0, "SO_MARK: {}", std::io::Error::last_os_error());
}

/// A pod whose link appears while node-a's agent is down has no per-packet programs until
/// the agent is back: the socket path must not leave it a connection that nothing would
/// translate. Reaching itself through its Service (a hairpin, which the socket path otherwise
/// leaves to the per-packet path to be masqueraded), it is translated at its socket instead and
/// served, unmasqueraded; with the agent back and the link attached, masqueraded as kube-proxy
/// does. Before, its packet left for the ClusterIP untranslated (here: no route, refused).
/// Its LoadBalancer IP, whose source ranges leave the pod out, is not served at its socket
/// (which cannot check the source) nor, with the agent back, per packet: kube-proxy drops it.
#[test]
fn a_pod_whose_link_appeared_while_the_agent_was_down_is_served_at_its_socket() {
    let mut c = Bridged::new("km-down").unwrap();
    // This process's sockets are node-a's pods' (the socket path's cgroup).
    c.nodes[0].cgroup.enter().unwrap();
    let late_ip = Ipv4Addr::new(10, 244, 11, 2);
    let ranged = service("Cluster", 30089, &[(late_ip, "node-a")])
        .replace("  ports: [{name: http", "  loadBalancerSourceRanges: [\"203.0.113.0/24\"]\n  ports: [{name: http");
    c.write("svc.yaml", &ranged);
    c.wait("10.96.0.89:80/TCP", 1);
    let mut agent = c.nodes[0].agent.take().unwrap();
    agent.kill().unwrap();
    agent.wait().unwrap();
    let node_a = &c.nodes[0].netns;
    let pod = Netns::new(&format!("{}-late", node_a.name)).unwrap();
    node_a.ip(&["link", "add", "veth-late", "type", "veth", "peer", "name", "eth0", "netns", &pod.name]).unwrap();
    node_a.ip(&["addr", "add", "10.244.11.1/24", "dev", "veth-late"]).unwrap();
    node_a.ip(&["link", "set", "veth-late", "up"]).unwrap();
    pod.ip(&["addr", "add", &format!("{late_ip}/24"), "dev", "eth0"]).unwrap();
    pod.ip(&["link", "set", "eth0", "up"]).unwrap();
    pod.ip(&["route", "add", "default", "via", "10.244.11.1"]).unwrap();
    let _server = NameServer::tcp(&pod, SocketAddrV4::new(late_ip, POD_PORT), "late").unwrap();
    let cluster_ip = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 89), 80);
    let answer = pod.run(move || tcp_ask_peer(cluster_ip, TIMEOUT)).unwrap();
    let (name, seen) = answer.expect("the hairpin while the agent is down");
    assert_eq!((name.as_str(), seen), ("late", late_ip.to_string()), "translated at the socket: not masqueraded");
    let lb = SocketAddrV4::new(LB_IP, 80);
    let short = Duration::from_millis(500);
    let answer = pod.run(move || tcp_ask_peer(lb, short)).unwrap();
    assert!(answer.is_err(), "the LoadBalancer IP, outside its source ranges, while the agent is down: {answer:?}");

    c.start_agent(0).unwrap();
    let deadline = std::time::Instant::now() + testbed::slow(Duration::from_secs(10));
    loop {
        let answer = pod.run(move || tcp_ask_peer(cluster_ip, TIMEOUT)).unwrap();
        if answer.as_ref().is_ok_and(|(_, seen)| seen == "10.244.11.1") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never masqueraded once the agent was back: {answer:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let answer = pod.run(move || tcp_ask_peer(lb, short)).unwrap();
    let err = answer.expect_err("the LoadBalancer IP, outside its source ranges, with the agent back");
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "dropped per packet: {err}");
}

#[test]
fn links_created_after_the_agent_started_are_covered() {
    let c = Bridged::new("km-links").unwrap();
    let pod_b = c.nodes[1].pod_ip;
    c.write("svc.yaml", &service("Cluster", 30084, &[(pod_b, "node-b")]));
    c.wait("10.96.0.84:80/TCP", 1);
    // A new pod on node-a, behind a link that did not exist when the agent started.
    let node_a = &c.nodes[0].netns;
    let pod = Netns::new(&format!("{}-late", node_a.name)).unwrap();
    node_a.ip(&["link", "add", "veth-late", "type", "veth", "peer", "name", "eth0", "netns", &pod.name]).unwrap();
    node_a.ip(&["addr", "add", "10.244.11.1/24", "dev", "veth-late"]).unwrap();
    node_a.ip(&["link", "set", "veth-late", "up"]).unwrap();
    pod.ip(&["addr", "add", "10.244.11.2/24", "dev", "eth0"]).unwrap();
    pod.ip(&["link", "set", "eth0", "up"]).unwrap();
    pod.ip(&["route", "add", "default", "via", "10.244.11.1"]).unwrap();
    c.nodes[1].netns.ip(&["route", "add", "10.244.11.0/24", "via", "10.0.0.1"]).unwrap();
    let cluster_ip = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 84), 80);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (name, seen) = loop {
        match pod.run(move || tcp_ask_peer(cluster_ip, Duration::from_millis(500))).unwrap() {
            Ok(answer) => break answer,
            Err(e) if std::time::Instant::now() > deadline => {
                panic!(
                    "the new pod never reached the ClusterIP: {e}; agents' log:\n{}",
                    std::fs::read_to_string(&c.log).unwrap_or_default()
                )
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    assert_eq!(name, "pod-b");
    // A pod (inside clusterCIDR) reaching a ClusterIP keeps its address, as with kube-proxy.
    assert_eq!(seen, "10.244.11.2");
}

/// A node address on a VLAN sub-interface (`eth0.100`): the frames arrive tagged on `eth0`,
/// whose program sees them first. kube-proxy's rules see them once untagged, on `eth0.100`;
/// translated on `eth0` they kept their tag and were lost on their way on (the pod, or the
/// other node, has no VLAN 100). A tagged frame is left to its VLAN's link.
#[test]
fn a_node_port_on_a_vlan_address_is_served() {
    let c = Bridged::new("km-vlan").unwrap();
    let vlan = |ns: &Netns, addr: &str| -> Result<()> {
        ns.ip(&["link", "add", "link", "eth0", "name", "eth0.100", "type", "vlan", "id", "100"])?;
        ns.ip(&["addr", "add", addr, "dev", "eth0.100"])?;
        ns.ip(&["link", "set", "eth0.100", "up"])
    };
    if let Err(e) = vlan(&c.ext, "10.1.100.100/24") {
        assert!(std::env::var_os("KPR_REQUIRE_VLAN").is_none(), "this kernel must have VLAN links: {e:#}");
        println!("skipped: this kernel has no VLAN links ({e:#}; the VM kernels of `cargo xtask test` run it)");
        return;
    }
    vlan(&c.nodes[0].netns, "10.1.100.1/24").unwrap();
    let pod_b = c.nodes[1].pod_ip;
    c.write("svc.yaml", &service("Cluster", 30085, &[(pod_b, "node-b")]));
    c.wait("*:30085/TCP ext", 1);
    let vlan_node_port = SocketAddrV4::new(Ipv4Addr::new(10, 1, 100, 1), 30085);
    // The agent takes the new address as a NodePort address once it sees it.
    let deadline = std::time::Instant::now() + testbed::slow(Duration::from_secs(10));
    let (name, seen) = loop {
        match c.ext(move || tcp_ask_peer(vlan_node_port, Duration::from_millis(500))) {
            Ok(answer) => break answer,
            Err(e) if std::time::Instant::now() > deadline => panic!(
                "the NodePort on the VLAN address never answered: {e}; agents' log:\n{}",
                std::fs::read_to_string(&c.log).unwrap_or_default()
            ),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    // Masqueraded to node-a's address on the link toward node-b (untagged eth0).
    assert_eq!((name.as_str(), seen.as_str()), ("pod-b", "10.0.0.1"));
    // The other address family and the untagged address still serve.
    let a = c.nodes[0].ip;
    let (name, _) = c.ext(move || tcp_ask_peer(SocketAddrV4::new(a, 30085), TIMEOUT).unwrap());
    assert_eq!(name, "pod-b");
}

/// The pods of the other node behind an IP-in-IP tunnel without a remote, as Calico's IPIP
/// mode sets it up: `tunl0` holds an address of the node's pod block, and the other node's
/// block is routed `via <its address> dev tunl0 onlink`. A NodePort's packet to pod-b leaves
/// node-a by the tunnel (masqueraded to tunl0's address, as MASQUERADE picks it), and pod-b's
/// answer comes back by it, with no Ethernet header. Before: sent straight to the tunnel
/// (`bpf_redirect_neigh` sets no route, which such a tunnel needs: lost on 6.3+), and the
/// answer read as if it had an Ethernet header (never translated back: reset).
#[test]
fn a_node_port_reaches_a_pod_over_ip_in_ip() {
    let c = Bridged::new("km-ipip").unwrap();
    let tunnel = |i: usize| -> Result<()> {
        let (ns, n) = (&c.nodes[i].netns, i + 1);
        // The fallback tunnel every namespace gets with the ipip module, or one like it.
        if ns.ip(&["link", "show", "tunl0"]).is_err() {
            ns.ip(&["link", "add", "tunl0", "type", "ipip"])?;
        }
        ns.ip(&["addr", "add", &format!("10.244.{n}.0/32"), "dev", "tunl0"])?;
        ns.ip(&["link", "set", "tunl0", "up"])?;
        let other = 3 - n;
        ns.ip(&[
            "route",
            "replace",
            &format!("10.244.{other}.0/24"),
            "via",
            &format!("10.0.0.{other}"),
            "dev",
            "tunl0",
            "onlink",
        ])
    };
    if let Err(e) = tunnel(0) {
        assert!(std::env::var_os("KPR_REQUIRE_IPIP").is_none(), "this kernel must have IP-in-IP links: {e:#}");
        println!("skipped: this kernel has no IP-in-IP links ({e:#}; the VM kernels of `cargo xtask test` run it)");
        return;
    }
    tunnel(1).unwrap();
    node_port_reaches_pod_b_through(&c, "tunl0", "10.244.1.0");
}

/// The same with an L3 tunnel of another kind, on any kernel: a TUN device on each node (no
/// Ethernet header, as WireGuard's), joined by this test, which carries the packets written to
/// one into the other.
#[test]
fn a_node_port_reaches_a_pod_over_a_layer_3_tunnel() {
    let c = Bridged::new("km-tun").unwrap();
    let mut ends = Vec::new();
    for (i, node) in c.nodes.iter().enumerate() {
        let n = i + 1;
        ends.push(node.netns.run(|| testbed::Tun::open("tun0")).unwrap().unwrap());
        node.netns.ip(&["addr", "add", &format!("10.244.{n}.0/32"), "dev", "tun0"]).unwrap();
        node.netns.ip(&["link", "set", "tun0", "up"]).unwrap();
        node.netns.ip(&["route", "replace", &format!("10.244.{}.0/24", 3 - n), "dev", "tun0"]).unwrap();
    }
    let _wire = testbed::Tun::join(ends.pop().unwrap(), ends.pop().unwrap());
    node_port_reaches_pod_b_through(&c, "tun0", "10.244.1.0");
}

/// An external client reaches pod-b through node-a's NodePort, masqueraded to `masquerade`,
/// in new connections one after another (each a new flow, and its answer back through the
/// tunnel).
fn node_port_reaches_pod_b_through(c: &Bridged, tunnel: &str, masquerade: &str) {
    let pod_b = c.nodes[1].pod_ip;
    c.write("svc.yaml", &service("Cluster", 30086, &[(pod_b, "node-b")]));
    c.wait("*:30086/TCP ext", 1);
    // Both agents cover the tunnel (made after they started), with the programs for packets
    // without Ethernet.
    for node in &c.nodes {
        let deadline = std::time::Instant::now() + testbed::slow(Duration::from_secs(10));
        loop {
            let (ok, out) = kpr_status(node, &node.pins);
            let status: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
            let covered = status["links"].as_array().into_iter().flatten().any(|l| l["name"] == tunnel);
            if ok && covered {
                let link = status["links"].as_array().unwrap().iter().find(|l| l["name"] == tunnel).unwrap();
                assert_eq!(link["ethernet"], false, "{status:#}");
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{}: {tunnel} never covered: {out}; agents' log:\n{}",
                node.name,
                std::fs::read_to_string(&c.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let node_port = SocketAddrV4::new(c.nodes[0].ip, 30086);
    for attempt in 0..5 {
        let answer = c.ext(move || tcp_ask_peer(node_port, TIMEOUT));
        let (name, seen) = answer.unwrap_or_else(|e| {
            panic!(
                "connection {attempt} through the NodePort got no answer: {e}; agents' log:\n{}",
                std::fs::read_to_string(&c.log).unwrap_or_default()
            )
        });
        assert_eq!((name.as_str(), seen.as_str()), ("pod-b", masquerade));
    }
}

/// The issue's experiment: a node whose established table holds 32 flows
/// (`--max-conntrack 64`), 200 NodePort connections opened one after the other and kept, then
/// each asked again. Under an LRU table the flows evicted along the way were re-created from
/// the client's next segment, but one whose replies' entry alone had gone was reset by the
/// node at the backend's answer (1 or 2 in 200 here, 485 of 500 before re-creation). Now no
/// established flow is evicted: the connections past the table's room live among the new
/// flows (counted), and every one answers.
#[test]
fn connections_past_a_full_established_table_keep_working() {
    use std::io::{BufRead as _, BufReader, Write as _};
    let c = Bridged::new_with("km-ctfull", &["--max-conntrack", "64"]).unwrap();
    c.write("svc.yaml", &service("Cluster", 30087, &[(c.nodes[1].pod_ip, "node-b")]));
    c.wait("*:30087/TCP ext", 1);
    let node_port = SocketAddrV4::new(c.nodes[0].ip, 30087);
    let conns: Vec<TcpStream> = (0..200).map(|_| connect_from(&c.ext, node_port).0).collect();
    let ask = |conn: &TcpStream| -> std::io::Result<String> {
        (&*conn).write_all(b"ping\n")?;
        let mut line = String::new();
        BufReader::new(conn).read_line(&mut line)?;
        Ok(line)
    };
    for round in 0..2 {
        let failed: Vec<String> = conns
            .iter()
            .enumerate()
            .filter_map(|(i, conn)| match ask(conn) {
                Ok(line) if line == "ping\n" => None,
                other => Some(format!("{i}: {other:?}")),
            })
            .collect();
        assert!(
            failed.is_empty(),
            "round {round}: {} of 200 connections failed: {failed:?}; node-a:\n{}\n{}",
            failed.len(),
            kpr_status_as(&c.nodes[0], &c.nodes[0].pins, "text").1,
            kpr("services", &c.nodes[0].pins, &[]),
        );
    }
    let (_, status) = kpr_status(&c.nodes[0], &c.nodes[0].pins);
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert!(status["trouble"]["tc_ct_established_full"].as_u64().is_some_and(|n| n > 0), "{status:#}");
}

/// `n` unconnected UDP sockets, all open at once, each sending one datagram to `to`: who
/// answered each, and from where.
fn ask_from_open_sockets(n: usize, to: SocketAddr) -> Vec<(String, SocketAddr)> {
    let sockets: Vec<std::net::UdpSocket> = (0..n).map(|_| std::net::UdpSocket::bind("0.0.0.0:0").unwrap()).collect();
    let ask = |s: &std::net::UdpSocket| {
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        s.send_to(b"who", to).unwrap();
        let mut buf = [0u8; 64];
        let (len, from) = s.recv_from(&mut buf).expect("an answer");
        (String::from_utf8_lossy(&buf[..len]).into_owned(), from)
    };
    sockets.iter().map(ask).collect()
}

/// A pod over its share of the socket path's reverse-translation table: its further sockets
/// are served per packet on its link, their answers still from the ClusterIP (conntrack
/// reverses them), and counted. Once its sockets close, the socket path takes it back.
#[test]
fn a_pod_over_its_share_of_the_socket_path_is_served_per_packet() {
    use proxy_common::counter::{SOCK_OVER_QUOTA, TC_NEW_FLOW, TRANSLATED};
    let mut c = Bridged::new_with("km-share", &["--max-sock-revnat-per-pod=2", "--max-sock-revnat=256"]).unwrap();
    // This process's sockets are node-a's pods' (the socket path's cgroup).
    c.nodes[0].cgroup.enter().unwrap();
    let pod_b = c.nodes[1].pod_ip;
    c.write(
        "dns.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: dns, namespace: t}}\nspec:\n  clusterIP: 10.96.0.54\n  \
             ports: [{{name: dns, port: 53, protocol: UDP}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: dns-1, namespace: t, labels: {{kubernetes.io/service-name: dns}}}}\naddressType: IPv4\n\
             ports: [{{name: dns, port: {POD_PORT}, protocol: UDP}}]\nendpoints: [{{addresses: [\"{pod_b}\"], nodeName: node-b}}]\n"
        ),
    );
    c.wait("10.96.0.54:53/UDP", 1);
    let cluster_ip = SocketAddr::from(SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 54), 53));
    let counters = || bpf::read_counters(&c.nodes[0].pins).unwrap();
    let at = |i: u32, counters: &[(&str, u64)]| counters[i as usize].1;
    let pod = &c.nodes[0]._pod;
    let before = counters();
    let answers = pod.run(move || ask_from_open_sockets(4, cluster_ip)).unwrap();
    let after = counters();
    assert_eq!(answers, vec![("pod-b".to_owned(), cluster_ip); 4], "every socket answered from the ClusterIP");
    assert_eq!(at(TRANSLATED, &after) - at(TRANSLATED, &before), 2, "two at their sockets");
    assert_eq!(at(SOCK_OVER_QUOTA, &after) - at(SOCK_OVER_QUOTA, &before), 2);
    assert_eq!(at(TC_NEW_FLOW, &after) - at(TC_NEW_FLOW, &before), 2, "two per packet on the pod's link");
    // Those sockets are closed: the pod's share is free again.
    let before = counters();
    let answers = pod.run(move || ask_from_open_sockets(1, cluster_ip)).unwrap();
    assert_eq!(answers, vec![("pod-b".to_owned(), cluster_ip)]);
    assert_eq!(at(TRANSLATED, &counters()) - at(TRANSLATED, &before), 1, "at its socket again");

    // The node's own sockets have no share, only the table's limit (256 less half kept free
    // for the LRU's per-CPU lists, whatever the CPUs); past it they are translated without
    // entries (answered from the endpoint's address), not left to the per-packet path, which
    // does not translate the node's connections.
    let before = counters();
    let answers = c.nodes[0].netns.run(move || ask_from_open_sockets(300, cluster_ip)).unwrap();
    let from: Vec<SocketAddr> = answers.into_iter().map(|(_, from)| from).collect();
    let backend = SocketAddr::from(SocketAddrV4::new(pod_b, POD_PORT));
    assert_eq!(from.iter().filter(|f| **f == cluster_ip).count(), 128);
    assert_eq!(from.iter().filter(|f| **f == backend).count(), 172);
    let after = counters();
    assert_eq!(at(TRANSLATED, &after) - at(TRANSLATED, &before), 300);
    assert_eq!(at(SOCK_OVER_QUOTA, &after) - at(SOCK_OVER_QUOTA, &before), 172);
}

#[test]
fn udp_flows_move_off_a_removed_endpoint() {
    let c = Bridged::new("km-udp").unwrap();
    let (pod_a, pod_b) = (c.nodes[0].pod_ip, c.nodes[1].pod_ip);
    let manifest = |ip: Ipv4Addr, node: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: dns, namespace: t}}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.53\n  \
             ports: [{{name: dns, port: 53, protocol: UDP, nodePort: 30053}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: dns-1, namespace: t, labels: {{kubernetes.io/service-name: dns}}}}\naddressType: IPv4\n\
             ports: [{{name: dns, port: {POD_PORT}, protocol: UDP}}]\nendpoints: [{{addresses: [\"{ip}\"], nodeName: {node}}}]\n"
        )
    };
    c.write("dns.yaml", &manifest(pod_b, "node-b"));
    c.wait("*:30053/UDP ext", 1);
    let a = c.nodes[0].ip;
    // One connected UDP socket: every datagram has the same 5-tuple, i.e. one conntrack flow.
    let socket = c.ext(move || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        s.connect(SocketAddrV4::new(a, 30053)).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        s
    });
    let ask = |s: &std::net::UdpSocket| {
        s.send(b"who").unwrap();
        let mut buf = [0u8; 64];
        let n = s.recv(&mut buf).expect("a reply through the NodePort");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    assert_eq!(ask(&socket), "pod-b");
    c.write("dns.yaml", &manifest(pod_a, "node-a"));
    for node in &c.nodes {
        testbed::wait_for_backends(&node.pins, "*:30053/UDP ext", Duration::from_secs(10), |b| {
            b == Some(&[(pod_a.into(), POD_PORT)][..])
        })
        .unwrap();
    }
    // The agent flushes the flow right after switching the backends (as kube-proxy deletes
    // conntrack entries after iptables-restore); a datagram in between still finds the old
    // flow. Wait for the flush itself, then: pod-b still runs, but the next datagram goes to pod-a.
    let old_backend = format!("{pod_b}:{POD_PORT}");
    let deadline = std::time::Instant::now() + testbed::slow(Duration::from_secs(10));
    while kpr_conntrack(&c.nodes[0].pins, &["list"]).contains(&old_backend) {
        assert!(std::time::Instant::now() < deadline, "the UDP flow to the removed endpoint was never flushed");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(ask(&socket), "pod-a");
}

/// `--abort-dead-tcp`: TCP connections to an endpoint whose pod is gone end at once instead of
/// hanging in retransmissions (kubernetes#77903): an external client's NodePort connection and
/// a pod's ClusterIP connection (per packet) get a RST at their next segment (ECONNRESET); the
/// node's own ClusterIP connection (the socket path) is aborted (ECONNABORTED). pod-b still
/// runs here, so without the option all three would go on talking to it.
#[test]
fn tcp_connections_to_an_endpoint_whose_pod_is_gone_fail_at_once() {
    let mut c = Bridged::new_with("km-deadpod", &["--abort-dead-tcp"]).unwrap();
    let (pod_a, pod_b) = (c.nodes[0].pod_ip, c.nodes[1].pod_ip);
    c.write("svc.yaml", &service("Cluster", 30084, &[(pod_b, "node-b")]));
    c.wait("*:30084/TCP ext", 1);
    let mut conns = dead_endpoint_clients(&mut c, 30084);
    // An isolated change, applied at once (not held back by minSyncPeriod, 1 s, after the last).
    std::thread::sleep(Duration::from_secs(1));
    c.write("svc.yaml", &service("Cluster", 30084, &[(pod_a, "node-a")]));
    let gone = std::time::Instant::now();
    assert_connections_end(&mut conns, gone);
    let resets = bpf::read_counters(&c.nodes[0].pins).unwrap()[proxy_common::counter::TC_DEAD_FLOW_RESET as usize].1;
    assert_eq!(resets, 2, "one RST for each per-packet flow");
    // New connections reach the endpoint that is left (from outside: out of the socket path's
    // cgroup first).
    c.nodes[0].cgroup.leave().unwrap();
    let a = c.nodes[0].ip;
    assert_eq!(c.ext(move || tcp_ask(SocketAddrV4::new(a, 30084), TIMEOUT).unwrap().0), "pod-a");
}

/// `--abort-dead-tcp`: an endpoint that turns unready on a Ready node (a failing readiness
/// probe) keeps its connections, as behind kube-proxy; once its Node is NotReady, they end as
/// if its pod were gone.
#[test]
fn tcp_connections_to_an_endpoint_on_a_node_gone_not_ready_fail_at_once() {
    let mut c = Bridged::new_with("km-deadnode", &["--abort-dead-tcp"]).unwrap();
    let pod_b = c.nodes[1].pod_ip;
    let unready = |manifest: String| {
        manifest.replace("conditions: {ready: true}", "conditions: {ready: false, serving: false, terminating: false}")
    };
    c.write("svc.yaml", &service("Cluster", 30085, &[(pod_b, "node-b")]));
    c.wait("*:30085/TCP ext", 1);
    let mut conns = dead_endpoint_clients(&mut c, 30085);
    c.write("svc.yaml", &unready(service("Cluster", 30085, &[(pod_b, "node-b")])));
    c.wait("*:30085/TCP ext", 0);
    for _ in 0..5 {
        for (what, conn, _) in &mut conns {
            echo(conn, "unready").unwrap_or_else(|e| panic!("{what}: an unready endpoint's connection ended: {e}"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    c.write(
        "node-b.yaml",
        "apiVersion: v1\nkind: Node\nmetadata: {name: node-b}\nstatus:\n  conditions: [{type: Ready, status: Unknown}]\n",
    );
    let down = std::time::Instant::now();
    assert_connections_end(&mut conns, down);
    c.nodes[0].cgroup.leave().unwrap();
}

/// Three echoing connections to pod-b through node-a, of the kinds `--abort-dead-tcp` ends:
/// (what, stream, the errno its end shows).
fn dead_endpoint_clients(c: &mut Bridged, node_port: u16) -> Vec<(&'static str, TcpStream, i32)> {
    let node_port_addr = SocketAddrV4::new(c.nodes[0].ip, node_port);
    let cluster_ip = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, (node_port % 250) as u8), 80);
    let (ext, ext_backend) = connect_from(&c.ext, node_port_addr);
    // The pod's process is outside the socket path's cgroup: its connection is translated per
    // packet on its link.
    let (pod, pod_backend) = connect_from(&c.nodes[0]._pod, cluster_ip);
    // The node's own connection is translated at its socket.
    c.nodes[0].cgroup.enter().unwrap();
    let (node, node_backend) = connect_from(&c.nodes[0].netns, cluster_ip);
    assert_eq!([ext_backend, pod_backend, node_backend], ["pod-b"; 3]);
    let mut conns = vec![
        ("NodePort from outside", ext, libc::ECONNRESET),
        ("ClusterIP from a pod", pod, libc::ECONNRESET),
        ("ClusterIP from the node", node, libc::ECONNABORTED),
    ];
    for (what, conn, _) in &mut conns {
        echo(conn, "hello").unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    conns
}

/// One line sent and echoed back.
fn echo(conn: &mut TcpStream, line: &str) -> std::io::Result<()> {
    use std::io::{BufRead as _, Write as _};
    conn.write_all(format!("{line}\n").as_bytes())?;
    let mut back = String::new();
    std::io::BufReader::new(&*conn).read_line(&mut back)?;
    if back.is_empty() {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed"));
    }
    assert_eq!(back, format!("{line}\n"));
    Ok(())
}

/// Each connection, sending a line every 20 ms, fails within a second of `since` (the
/// change the agents read, applied at once: a second after the one before) with its errno,
/// not by timing out.
fn assert_connections_end(conns: &mut [(&'static str, TcpStream, i32)], since: std::time::Instant) {
    for (what, conn, errno) in conns {
        let error = loop {
            match echo(conn, "ping") {
                Ok(()) => assert!(since.elapsed() < testbed::slow(Duration::from_secs(1)), "{what}: never ended"),
                Err(e) => break e,
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(error.raw_os_error(), Some(*errno), "{what}: {error}");
        assert!(since.elapsed() < testbed::slow(Duration::from_secs(1)), "{what}: ended after {:?}", since.elapsed());
        println!("{what}: {error} {:?} after the change", since.elapsed());
    }
}

/// A masqueraded packet too big for the link its route leaves by, that may not be cut into
/// fragments: kube-proxy's node answers "fragmentation needed" (IPv6: "packet too big")
/// before MASQUERADE rewrites it, so the client's socket learns the path's MTU. kpr masquerades
/// on the way in, so the node's own answer went to its own address and was lost: the client
/// heard nothing, and a datagram of that size never arrived.
#[test]
fn a_masqueraded_packet_too_big_for_its_link_gets_fragmentation_needed() {
    too_big_gets_fragmentation_needed("km-mtu", false);
}

/// The same where the host's forwarding path takes translated packets (a chain on node-a's
/// forward hook, as a NetworkPolicy engine's): the kernel checks a forwarded packet against
/// the link's MTU before that hook and answers its source, which is node-a once masqueraded.
#[test]
fn a_masqueraded_packet_too_big_for_the_host_forwarding_path_gets_fragmentation_needed() {
    too_big_gets_fragmentation_needed("km-mtufw", true);
}

fn too_big_gets_fragmentation_needed(name: &str, host_path: bool) {
    let c = Bridged::new(name).unwrap();
    let a = &c.nodes[0];
    if host_path {
        a.netns
            .sh("nft add table inet kprpol && \
                 nft add chain inet kprpol forward '{ type filter hook forward priority 0; policy accept; }' && \
                 nft add rule inet kprpol forward counter accept")
            .unwrap();
        wait_host_state(&a.pins, false);
    }
    // node-a's pod link is narrower than the path to it.
    a.netns.ip(&["link", "set", "veth-pod", "mtu", "1280"]).unwrap();
    a._pod.ip(&["link", "set", "eth0", "mtu", "1280"]).unwrap();
    let slice = |family: &str, ip: IpAddr| {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: big-{family}, namespace: t, labels: \
             {{kubernetes.io/service-name: big}}}}\naddressType: {family}\nports: [{{name: u, port: {POD_PORT}, protocol: UDP}}]\n\
             endpoints: [{{addresses: [\"{ip}\"], nodeName: node-a}}]\n"
        )
    };
    c.write(
        "big.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: big, namespace: t}}\nspec:\n  type: NodePort\n  \
             clusterIP: 10.96.0.70\n  clusterIPs: [\"10.96.0.70\", \"fd00:96::70\"]\n  ipFamilies: [IPv4, IPv6]\n  \
             ports: [{{name: u, port: 53, protocol: UDP, nodePort: 30070}}]\n{}{}",
            slice("IPv4", a.pod_ip.into()),
            slice("IPv6", a.pod_ip6.into()),
        ),
    );
    c.wait("*:30070/UDP ext", 1);
    c.wait("[*]:30070/UDP ext", 1);
    let direct = || bpf::read_counters(&a.pins).unwrap()[proxy_common::counter::TC_FORWARDED_DIRECT as usize].1;
    let direct_before = direct();
    for node_ip in [IpAddr::from(a.ip), IpAddr::from(a.ip6)] {
        let (small, big, mtu) = c.ext(move || {
            let socket = std::net::UdpSocket::bind(any_port_of(node_ip)).unwrap();
            socket.connect(SocketAddr::new(node_ip, 30070)).unwrap();
            socket.set_read_timeout(Some(TIMEOUT)).unwrap();
            // Path MTU discovery on: the datagram may not be fragmented on its way.
            let (level, option, on, mtu_option) = match node_ip {
                IpAddr::V4(_) => (libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO, libc::IP_MTU),
                IpAddr::V6(_) => (libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IPV6_PMTUDISC_DO, libc::IPV6_MTU),
            };
            setsockopt_int(&socket, level, option, on);
            let mut buf = [0u8; 64];
            socket.send(b"who").unwrap();
            let small = socket.recv(&mut buf).map(|n| String::from_utf8_lossy(&buf[..n]).into_owned());
            // Larger than node-a's pod link, not than the client's own.
            socket.send(&[7u8; 1400]).unwrap();
            let big = socket.recv(&mut buf).map_err(|e| e.raw_os_error());
            (small, big, getsockopt_int(&socket, level, mtu_option))
        });
        assert_eq!(small.expect("a small datagram through the NodePort"), "pod-a", "via {node_ip}");
        assert_eq!(big, Err(Some(libc::EMSGSIZE)), "the big datagram via {node_ip}: fragmentation needed");
        assert_eq!(mtu, 1280, "the path MTU the client learned via {node_ip}");
    }
    if host_path {
        assert_eq!(direct(), direct_before, "nothing sent straight out while the forward hook filters");
        assert!(forward_rule_packets(&a.netns) >= 2, "the small datagrams took the forward hook");
    }
}

/// The wildcard address of `ip`'s family, any port.
fn any_port_of(ip: IpAddr) -> SocketAddr {
    match ip {
        IpAddr::V4(_) => SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0),
        IpAddr::V6(_) => SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), 0),
    }
}

fn setsockopt_int(socket: &std::net::UdpSocket, level: i32, option: i32, value: i32) {
    use std::os::fd::AsRawFd as _;
    // SAFETY: an int option of a socket this function borrows.
    let rc = unsafe {
        libc::setsockopt(socket.as_raw_fd(), level, option, (&raw const value).cast(), size_of::<i32>() as u32)
    };
    assert_eq!(rc, 0, "setsockopt({level}, {option}): {}", std::io::Error::last_os_error());
}

fn getsockopt_int(socket: &std::net::UdpSocket, level: i32, option: i32) -> i32 {
    use std::os::fd::AsRawFd as _;
    let (mut value, mut len) = (0i32, size_of::<i32>() as u32);
    // SAFETY: an int option of a socket this function borrows.
    let rc = unsafe { libc::getsockopt(socket.as_raw_fd(), level, option, (&raw mut value).cast(), &mut len) };
    assert_eq!(rc, 0, "getsockopt({level}, {option}): {}", std::io::Error::last_os_error());
    value
}

#[test]
fn cleanup_waits_for_the_agent_and_undoes_what_kpr_changed_on_the_node() {
    let mut c = Bridged::new("km-clean").unwrap();
    c.write("svc.yaml", &service("Cluster", 30080, &[(c.nodes[1].pod_ip, "node-b")]));
    c.wait("*:30080/TCP ext", 1);
    let node = &c.nodes[0];
    let accept_local = |ns: &Netns| {
        ns.run(|| std::fs::read_to_string("/proc/sys/net/ipv4/conf/eth0/accept_local").unwrap().trim().to_owned())
            .unwrap()
    };
    assert_eq!(accept_local(&node.netns), "1", "kpr turns accept_local on where it masquerades");
    let cleanup = |node: &BridgedNode| {
        let mut cmd = Command::new(kpr_tests::kpr_bin());
        cmd.arg("cleanup").arg("--pin-root").arg(&node.pins);
        node.netns.exec_in(&mut cmd).unwrap();
        cmd.output().unwrap()
    };
    let refused = cleanup(node);
    assert!(!refused.status.success(), "cleanup refuses while the agent runs");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("agent is running"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    assert!(node.pins.exists(), "and leaves the datapath alone");

    let mut agent = c.nodes[0].agent.take().unwrap();
    agent.kill().unwrap();
    agent.wait().unwrap();
    let node = &c.nodes[0];
    let done = cleanup(node);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    assert!(!node.pins.exists(), "the pins are gone");
    assert_eq!(accept_local(&node.netns), "0", "accept_local is back to what it was");
}

#[test]
fn a_program_attached_after_kpr_still_sees_what_kpr_does_not_translate() {
    let c = Bridged::new("km-chain").unwrap();
    c.write("svc.yaml", &service("Cluster", 30080, &[(c.nodes[1].pod_ip, "node-b")]));
    c.wait("*:30080/TCP ext", 1);
    // Another program after kpr's on node-a's link (a CNI's, a monitor's): a second instance
    // of kpr's own ingress program on maps of its own, which counts the IP fragments it sees
    // (to the node's address: the only one its address filter knows).
    let pins = testbed::PinRoot::new("km-chain2");
    let cfg = bpf::DatapathConfig::new(pins.0.clone(), "/nonexistent".into());
    let node_ip = c.nodes[0].ip;
    let second = c.nodes[0]
        .netns
        .run(move || -> Result<aya::Ebpf> {
            let mut ebpf = bpf::open_object(&cfg)?;
            bpf::load_tc_programs(&mut ebpf)?;
            let prog: &mut aya::programs::SchedClassifier =
                ebpf.program_mut(proxy_common::program_names::TC_INGRESS).context("program")?.try_into()?;
            prog.attach(c"eth0", aya::programs::TcAttachType::Ingress)?; // appended after kpr's
            bpf::BpfMaps::take_from(&mut ebpf)?.mark_addresses([IpAddr::from(node_ip).into()])?;
            Ok(ebpf)
        })
        .unwrap()
        .unwrap();
    let fragments_seen =
        || bpf::read_counters(&pins.0).unwrap()[proxy_common::counter::TC_PASSED_UNSUPPORTED as usize].1;
    assert_eq!(fragments_seen(), 0);
    // A datagram larger than the link's MTU reaches node-a in fragments, which kpr does not
    // translate: the program after it must see them.
    let ip = c.nodes[0].ip;
    c.ext(move || {
        let socket = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        socket.send_to(&[0u8; 4000], SocketAddrV4::new(ip, 9)).unwrap();
    });
    std::thread::sleep(Duration::from_millis(200));
    // 4000 bytes on a 1500-byte link: three fragments; the later two carry no ports, and a
    // program without their first fragment's flow counts them as untranslatable.
    assert!(fragments_seen() >= 2, "the program after kpr saw the later fragments: {}", fragments_seen());
    // And kpr still translates what is its own.
    let (name, _) = c.ext(move || tcp_ask_peer(SocketAddrV4::new(ip, 30080), TIMEOUT).unwrap());
    assert_eq!(name, "pod-b");
    drop(second);
}

/// `kpr status` in `node`'s namespace (where the agent's lock and health server are):
/// (succeeded, stdout or stderr).
fn kpr_status(node: &BridgedNode, pins: &std::path::Path) -> (bool, String) {
    kpr_status_as(node, pins, "json")
}

fn kpr_status_as(node: &BridgedNode, pins: &std::path::Path, output: &str) -> (bool, String) {
    let mut cmd = Command::new(kpr_tests::kpr_bin());
    cmd.args(["status", "-o", output, "--pin-root"]).arg(pins).env("NO_COLOR", "1");
    node.netns.exec_in(&mut cmd).unwrap();
    let out = cmd.output().unwrap();
    let text = if out.status.success() { out.stdout } else { out.stderr };
    (out.status.success(), String::from_utf8_lossy(&text).into_owned())
}

#[test]
fn kpr_status_tells_the_agent_its_links_maps_and_a_node_without_kpr() {
    let mut c = Bridged::new("km-status").unwrap();
    c.write("svc.yaml", &service("Cluster", 30080, &[(c.nodes[1].pod_ip, "node-b")]));
    c.wait("*:30080/TCP ext", 1);
    let node_a = c.nodes[0].ip;
    let (name, _) = c.ext(move || tcp_ask_peer(SocketAddrV4::new(node_a, 30080), TIMEOUT).unwrap());
    assert_eq!(name, "pod-b");
    let pins = c.nodes[0].pins.clone();

    let (ok, out) = kpr_status(&c.nodes[0], &pins);
    assert!(ok, "{out}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["agentRunning"], true, "{status:#}");
    assert_eq!(status["health"]["ready"], true, "{status:#}");
    assert_eq!(status["health"]["healthzStatus"], 200, "{status:#}");
    assert_eq!(status["forwarding"], "direct", "{status:#}");
    let links: Vec<(&str, &str)> = status["links"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["name"].as_str().unwrap(), l["attach"].as_str().unwrap()))
        .collect();
    assert_eq!(links, [("eth0", "tcx"), ("veth-pod", "tcx")], "{status:#}");
    let map = |name: &str| status["maps"].as_array().unwrap().iter().find(|m| m["name"] == name).unwrap().clone();
    assert_eq!(map("services")["capacity"], 256, "the agent's --max-service-ports");
    assert!(map("services")["entries"].as_u64().unwrap() > 0, "{status:#}");
    // The NodePort connection above: its two entries, established.
    assert_eq!(map("conntrack_established_v4")["entries"], 2, "{status:#}");
    assert_eq!(status["trouble"], serde_json::json!({}), "{status:#}");
    let (ok, text) = kpr_status_as(&c.nodes[0], &pins, "text");
    assert!(ok && text.contains("agent:      running") && text.contains("ready (synced)"), "{text}");
    assert!(text.contains("links:      eth0 (tcx, accept_local), veth-pod (tcx"), "{text}");
    println!("{text}");

    // The agent gone: the pinned datapath is still there, and status says who is missing.
    let mut agent = c.nodes[0].agent.take().unwrap();
    agent.kill().unwrap();
    agent.wait().unwrap();
    let (ok, out) = kpr_status(&c.nodes[0], &pins);
    assert!(ok, "{out}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((status["agentRunning"].clone(), status["health"].clone()), (false.into(), serde_json::Value::Null));

    // A node without kpr's pins, or with another version's, is told so plainly.
    let (ok, out) = kpr_status(&c.nodes[0], &pins.join("nowhere"));
    assert!(!ok && out.contains("no kpr datapath on this node") && out.contains("does not exist"), "{out}");
    let other = pins.join("v1");
    std::fs::rename(bpf::pin_dir(&pins), &other).unwrap();
    let (ok, out) = kpr_status(&c.nodes[0], &pins);
    std::fs::rename(&other, bpf::pin_dir(&pins)).unwrap();
    assert!(!ok && out.contains("it holds v1"), "{out}");
}

/// What clients of one address see while the traffic of [`keep_asking`] runs.
#[derive(Debug, Default)]
struct Asked {
    /// Backends that answered new connections, with their counts.
    answers: std::collections::BTreeMap<String, usize>,
    /// Lines the established connection echoed.
    echoed: usize,
    /// What went wrong, with how often.
    failures: std::collections::BTreeMap<String, usize>,
}

/// From a thread in `netns`, until `stop`: a new connection to `addr` every few milliseconds,
/// and a line on `established` (an echoing connection to it).
fn keep_asking(
    netns: &Netns,
    addr: SocketAddrV4,
    mut established: TcpStream,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Asked> {
    use std::io::{BufRead as _, BufReader, Write as _};
    // A thread started inside the namespace stays in it.
    netns
        .run(move || {
            std::thread::spawn(move || {
                let mut asked = Asked::default();
                let mut reader = BufReader::new(established.try_clone().unwrap());
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    match tcp_ask_peer(addr, TIMEOUT) {
                        Ok((name, _)) => *asked.answers.entry(name).or_default() += 1,
                        Err(e) => *asked.failures.entry(format!("new connection: {e}")).or_default() += 1,
                    }
                    let mut line = String::new();
                    match established.write_all(b"ping\n").and_then(|()| reader.read_line(&mut line)) {
                        Ok(_) if line == "ping\n" => asked.echoed += 1,
                        Ok(_) => {
                            *asked.failures.entry(format!("established connection: read {line:?}")).or_default() += 1
                        }
                        Err(e) => *asked.failures.entry(format!("established connection: {e}")).or_default() += 1,
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                asked
            })
        })
        .unwrap()
}

/// An echoing connection to `addr` from `netns`, and the backend that answered it.
fn connect_from(netns: &Netns, addr: SocketAddrV4) -> (TcpStream, String) {
    use std::io::{BufRead as _, BufReader};
    netns
        .run(move || {
            let conn = TcpStream::connect_timeout(&addr.into(), TIMEOUT).unwrap();
            conn.set_read_timeout(Some(TIMEOUT)).unwrap();
            let mut name = String::new();
            BufReader::new(&conn).read_line(&mut name).unwrap();
            (conn, name.trim_end().to_owned())
        })
        .unwrap()
}

/// An upgrade to a new pin layout (the running agent's pins, renamed to the previous version's
/// directory, play the old release's): the old programs serve until the new agent's first sync
/// is written, the maps a flow needs carry over, and clients notice nothing. An external
/// client's established NodePort connection and a pod's ClusterIP connection keep talking, the
/// new connections both make all through the upgrade are answered, and ClientIP affinity keeps
/// each on its backend. With TCX links, and with the netlink filters of kernels before 6.6
/// (replaced in place at the new agent's attach, on the carried maps).
#[test]
fn an_upgrade_to_a_new_pin_layout_keeps_flows_affinity_and_new_connections() {
    upgrade_keeps_flows(&[]);
    upgrade_keeps_flows(&["--tc-netlink"]);
}

fn upgrade_keeps_flows(agent_args: &[&str]) {
    let mut c = Bridged::new_with("km-upgrade", agent_args).unwrap();
    let endpoints = [(c.nodes[0].pod_ip, "node-a"), (c.nodes[1].pod_ip, "node-b")];
    let manifest = service("Cluster", 30080, &endpoints)
        .replace("  externalTrafficPolicy:", "  sessionAffinity: ClientIP\n  externalTrafficPolicy:");
    c.write("svc.yaml", &manifest);
    c.wait("*:30080/TCP ext", 2);
    let node_port = SocketAddrV4::new(c.nodes[0].ip, 30080);
    let cluster_ip = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 80), 80);
    let (ext_conn, ext_backend) = connect_from(&c.ext, node_port);
    let (pod_conn, pod_backend) = connect_from(&c.nodes[0]._pod, cluster_ip);

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ext = keep_asking(&c.ext, node_port, ext_conn, stop.clone());
    let pod = keep_asking(&c.nodes[0]._pod, cluster_ip, pod_conn, stop.clone());
    std::thread::sleep(Duration::from_millis(300));

    // The upgrade: the old agent goes, its pins become the previous layout's, the new starts.
    let mut old_agent = c.nodes[0].agent.take().unwrap();
    old_agent.kill().unwrap();
    old_agent.wait().unwrap();
    let pins = c.nodes[0].pins.clone();
    let old = pins.join(format!("v{}", proxy_common::PIN_LAYOUT_VERSION - 1));
    std::fs::rename(bpf::pin_dir(&pins), &old).unwrap();
    c.start_agent(0).unwrap();
    let deadline = std::time::Instant::now() + testbed::slow(Duration::from_secs(20));
    while old.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!old.exists(), "the old layout is retired after the first sync");
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);

    let log = || std::fs::read_to_string(&c.log).unwrap_or_default();
    for (client, asked, backend) in [("ext", ext, ext_backend), ("pod-a", pod, pod_backend)] {
        let asked = asked.join().unwrap();
        assert!(asked.failures.is_empty(), "{agent_args:?} {client}: {asked:?}\nagents' log:\n{}", log());
        assert_eq!(asked.answers.keys().collect::<Vec<_>>(), [&backend], "{agent_args:?} {client}: {asked:?}");
        assert!(asked.echoed > 10 && asked.answers[&backend] > 10, "{agent_args:?} {client}: {asked:?}");
    }
    assert!(log().contains("carrying over an older layout's maps"), "{}", log());
}

#[test]
fn without_tcx_the_netlink_filters_outlive_and_survive_restarts() {
    // Kernels before 6.6 have no TCX: netlink tc filters, here asked for on a newer kernel.
    let mut c = Bridged::new_with("km-nl", &["--tc-netlink"]).unwrap();
    c.write("svc.yaml", &service("Cluster", 30080, &[(c.nodes[1].pod_ip, "node-b")]));
    c.wait("*:30080/TCP ext", 1);
    let kpr_filters = |c: &Bridged| -> usize {
        let mut cmd = Command::new("tc");
        cmd.args(["filter", "show", "dev", "eth0", "ingress"]);
        c.nodes[0].netns.exec_in(&mut cmd).unwrap();
        let out = String::from_utf8_lossy(&cmd.output().unwrap().stdout).into_owned();
        out.lines().filter(|l| l.contains("kpr_tc_ingress")).count()
    };
    let ip = c.nodes[0].ip;
    let ask = |c: &Bridged| {
        c.ext(move || tcp_ask_peer(SocketAddrV4::new(ip, 30080), TIMEOUT).map(|(name, _)| name).unwrap_or_default())
    };
    assert_eq!(kpr_filters(&c), 1, "one netlink filter");
    assert_eq!(ask(&c), "pod-b");

    // The agent goes away: the filter stays (it used to remove itself), NodePorts keep working.
    let stop = |c: &mut Bridged| {
        let mut agent = c.nodes[0].agent.take().unwrap();
        agent.kill().unwrap();
        agent.wait().unwrap();
    };
    stop(&mut c);
    assert_eq!(kpr_filters(&c), 1, "the filter outlives the agent");
    assert_eq!(ask(&c), "pod-b");
    // A restarted agent replaces it in place.
    c.start_agent(0).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(kpr_filters(&c), 1, "replaced, not added");
    assert_eq!(ask(&c), "pod-b");
    // kpr cleanup removes it.
    stop(&mut c);
    let mut cmd = Command::new(kpr_tests::kpr_bin());
    cmd.arg("cleanup").arg("--pin-root").arg(&c.nodes[0].pins);
    c.nodes[0].netns.exec_in(&mut cmd).unwrap();
    assert!(cmd.output().unwrap().status.success());
    assert_eq!(kpr_filters(&c), 0, "cleanup removed the filter");
}

/// SCTP sockets, one-to-one style (as TCP), through libc: the standard library has none.
mod sctp {
    use std::{
        net::{Ipv4Addr, SocketAddrV4},
        os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        },
        time::Duration,
    };

    use anyhow::{Result, bail};
    use testbed::Netns;

    fn socket(timeout: Duration) -> std::io::Result<OwnedFd> {
        // SAFETY: plain syscalls on a descriptor this function owns.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, libc::IPPROTO_SCTP);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let fd = OwnedFd::from_raw_fd(fd);
            let tv = libc::timeval { tv_sec: timeout.as_secs() as _, tv_usec: timeout.subsec_micros() as _ };
            for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
                let size = size_of::<libc::timeval>() as u32;
                libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, opt, (&raw const tv).cast(), size);
            }
            Ok(fd)
        }
    }

    fn sockaddr(addr: SocketAddrV4) -> libc::sockaddr_in {
        libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: addr.port().to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from(*addr.ip()).to_be() },
            sin_zero: [0; 8],
        }
    }

    /// Whether this kernel has SCTP sockets (this machine's may not; the VM kernels do).
    pub fn available() -> bool {
        socket(Duration::from_secs(1)).is_ok()
    }

    /// Connect to `addr` and read what the server says.
    pub fn ask(addr: SocketAddrV4, timeout: Duration) -> Result<String> {
        let fd = socket(timeout)?;
        let sa = sockaddr(addr);
        let size = size_of::<libc::sockaddr_in>() as u32;
        // SAFETY: `sa` and `buf` outlive the calls.
        unsafe {
            if libc::connect(fd.as_raw_fd(), (&raw const sa).cast(), size) != 0 {
                bail!("connect {addr}: {}", std::io::Error::last_os_error());
            }
            let mut buf = [0u8; 128];
            let n = libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0);
            if n <= 0 {
                bail!("recv from {addr}: {}", std::io::Error::last_os_error());
            }
            Ok(String::from_utf8_lossy(&buf[..n as usize]).into_owned())
        }
    }

    /// A server in `ns` that answers every association with `name` and the address it saw.
    pub struct Server(Arc<AtomicBool>);

    impl Server {
        pub fn start(ns: &Netns, addr: SocketAddrV4, name: &str) -> Result<Self> {
            let fd = ns.run(move || -> std::io::Result<OwnedFd> {
                let fd = socket(Duration::from_millis(200))?;
                let sa = sockaddr(addr);
                // SAFETY: `sa` outlives the calls.
                unsafe {
                    if libc::bind(fd.as_raw_fd(), (&raw const sa).cast(), size_of::<libc::sockaddr_in>() as u32) != 0
                        || libc::listen(fd.as_raw_fd(), 16) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(fd)
            })??;
            let stop = Arc::new(AtomicBool::new(false));
            let (flag, name) = (stop.clone(), name.to_owned());
            std::thread::spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    let mut peer: libc::sockaddr_in = unsafe { std::mem::zeroed() };
                    let mut len = size_of::<libc::sockaddr_in>() as u32;
                    // SAFETY: `peer` and `len` outlive the call; the new descriptor is owned at once.
                    let conn = unsafe { libc::accept(fd.as_raw_fd(), (&raw mut peer).cast(), &mut len) };
                    if conn < 0 {
                        continue; // the receive timeout: look at the stop flag again
                    }
                    let conn = unsafe { OwnedFd::from_raw_fd(conn) };
                    let seen = Ipv4Addr::from(u32::from_be(peer.sin_addr.s_addr));
                    let answer = format!("{name} {seen}");
                    unsafe { libc::send(conn.as_raw_fd(), answer.as_ptr().cast(), answer.len(), 0) };
                    std::thread::sleep(Duration::from_millis(50)); // let the answer go before the close
                }
            });
            Ok(Self(stop))
        }
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

#[test]
fn sctp_services_are_translated_for_pods_and_outside_clients() {
    if !sctp::available() {
        assert!(std::env::var_os("KPR_REQUIRE_SCTP").is_none(), "this kernel must have SCTP sockets");
        println!("skipped: this kernel has no SCTP sockets (the VM kernels of `cargo xtask test` run it)");
        return;
    }
    let c = Bridged::new("km-sctp").unwrap();
    let (pod_a, pod_b) = (c.nodes[0].pod_ip, c.nodes[1].pod_ip);
    let _server = sctp::Server::start(&c.nodes[1]._pod, SocketAddrV4::new(pod_b, POD_PORT), "pod-b").unwrap();
    c.write(
        "sctp.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: diameter, namespace: t}}\nspec:\n  type: NodePort\n  \
             clusterIP: 10.96.0.90\n  ports: [{{name: diameter, port: 3868, protocol: SCTP, nodePort: 30090}}]\n---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: diameter-1\n  namespace: t\n  \
             labels: {{kubernetes.io/service-name: diameter}}\naddressType: IPv4\n\
             ports: [{{name: diameter, port: {POD_PORT}, protocol: SCTP}}]\n\
             endpoints:\n- addresses: [\"{pod_b}\"]\n  nodeName: node-b\n  conditions: {{ready: true}}\n"
        ),
    );
    c.wait("10.96.0.90:3868/SCTP", 1);
    c.wait("*:30090/SCTP ext", 1);
    // From outside, through node-a's NodePort (another port than the pod's): masqueraded to
    // node-a, as eTP=Cluster is.
    let a = c.nodes[0].ip;
    let answer = c.ext(move || sctp::ask(SocketAddrV4::new(a, 30090), TIMEOUT)).unwrap();
    assert_eq!(answer, format!("pod-b {a}"), "NodePort from outside");
    // From pod-a, through the ClusterIP: a pod of the cluster keeps its address.
    let answer = c.nodes[0]
        ._pod
        .run(|| sctp::ask(SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 90), 3868), TIMEOUT))
        .unwrap()
        .unwrap();
    assert_eq!(answer, format!("pod-b {pod_a}"), "ClusterIP from a pod");
    let flows = kpr_conntrack(&c.nodes[0].pins, &["list", "--frontend", "*:30090/SCTP ext"]);
    assert!(
        flows.contains("SCTP") && flows.contains(&format!("{EXT_CLIENT}:")),
        "node-a tracks the outside client's association:\n{flows}"
    );
}

/// Whether link `link` of namespace `netns` holds an XDP program (`ip -d link`'s `prog/xdp`).
fn holds_xdp(netns: &Netns, link: &str) -> bool {
    let out = Command::new("ip").args(["-n", &netns.name, "-d", "link", "show", link]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).contains("prog/xdp")
}

/// `--xdp native`: each node's eth0 (the link of its primary address) holds the XDP program,
/// in front of tc. A 1 MiB echo through node-a's NodePort to pod-b, masqueraded as kube-proxy
/// does, is carried on node-a by XDP once established: its segments and the pod's come in by
/// eth0 and go back out of it (`XDP_TX`), translated, and every byte comes back. The switch's
/// ports take what a veth's native XDP sends them (they hold an XDP program: a veth drains
/// such frames only then) and the senders complete their checksums, as on a wire. A policy in
/// node-a's FORWARD chain stops the established connection as it stops kube-proxy's (XDP
/// leaves its packets to tc at once, tc takes the host's path once its kept route's period
/// ends); with the policy gone the connection goes on. A restart with `--xdp off` takes the
/// program off.
#[test]
fn xdp_carries_established_node_port_flows_and_yields_to_a_forward_policy() {
    let mut c = Bridged::new_with("km-xdp", &["--xdp", "native"]).unwrap();
    let _switch_ports_xdp = c
        ._switch
        .run(|| ["p-ext", "p-node-a", "p-node-b"].map(|port| kpr_tests::attach_xdp_stub(port, 2).unwrap()))
        .unwrap();
    c.ext(|| kpr_tests::set_tx_checksum_offload("eth0", false)).unwrap();
    for node in &c.nodes {
        node.netns.run(|| kpr_tests::set_tx_checksum_offload("eth0", false)).unwrap().unwrap();
    }
    let pod_b = c.nodes[1].pod_ip;
    c.write("svc.yaml", &service("Cluster", 30094, &[(pod_b, "node-b")]));
    c.wait("*:30094/TCP ext", 1);
    for node in &c.nodes {
        assert!(holds_xdp(&node.netns, "eth0"), "{}'s eth0 holds the XDP program", node.name);
        assert!(!holds_xdp(&node.netns, "veth-pod"), "{}'s pod link does not", node.name);
    }
    let node_a = &c.nodes[0];
    let a = node_a.ip;
    let counter = |index: u32| bpf::read_counters(&node_a.pins).unwrap()[index as usize].1;
    let xdp_forwarded = || counter(proxy_common::counter::XDP_FORWARDED);
    let (name, seen) = c.ext(move || tcp_ask_peer(SocketAddrV4::new(a, 30094), TIMEOUT).unwrap());
    assert_eq!((name.as_str(), seen), ("pod-b", a.to_string()), "masqueraded to node-a, as kube-proxy does");

    let before = xdp_forwarded();
    const BULK: usize = 1 << 20;
    let (echoed, _) = c.ext(move || bulk_echo(SocketAddrV4::new(a, 30094), BULK));
    assert_eq!(echoed, BULK, "the whole echo came back");
    let carried = xdp_forwarded() - before;
    // 1 MiB each way is over 700 full-sized segments each way, and their ACKs.
    eprintln!("XDP sent {carried} of the echo's packets back out of node-a's eth0");
    assert!(carried >= 1_000, "XDP sent {carried} of the echo's packets back out of node-a's eth0");

    // The policy: pod-b's port denied in node-a's forward hook. The connection made before it
    // stops, as kube-proxy's would: XDP leaves its packets to tc, tc to the host's path.
    let mut conn = c.ext(move || {
        let mut conn = TcpStream::connect_timeout(&SocketAddrV4::new(a, 30094).into(), TIMEOUT).unwrap();
        conn.set_read_timeout(Some(Duration::from_millis(700))).unwrap();
        let mut greeting = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(&conn), &mut greeting).unwrap();
        echo(&mut conn, "before the policy").unwrap();
        conn
    });
    deny_pod_b_in_forward(&node_a.netns);
    wait_host_state(&node_a.pins, false);
    // XDP leaves the flow at once; tc's kept route serves to the end of its period
    // (docs/host.md: about a second more).
    let period = |now: u64| now >> proxy_common::ct::ROUTE_PERIOD_SHIFT;
    let kept_in = period(kpr::datapath::conntrack::monotonic_now());
    while period(kpr::datapath::conntrack::monotonic_now()) == kept_in {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(30));
    let before = xdp_forwarded();
    let err = echo(&mut conn, "under the policy").unwrap_err();
    assert!(matches!(err.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{err}");
    assert_eq!(xdp_forwarded(), before, "XDP sent nothing past the policy");
    assert!(forward_rule_packets(&node_a.netns) >= 1, "the policy saw the segment");
    // The policy gone: the segment is sent again and answered (its line, then this one).
    node_a.netns.sh("nft delete table inet kprpol").unwrap();
    wait_host_state(&node_a.pins, true);
    conn.set_read_timeout(Some(testbed::slow(Duration::from_secs(10)))).unwrap();
    let mut back = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(&conn), &mut back).unwrap();
    assert_eq!(back, "under the policy\n");
    echo(&mut conn, "after the policy").unwrap();

    // Off: the restarted agent takes its program off the link; tc serves the connection.
    c.agent_args = vec!["--xdp".into(), "off".into()];
    let mut agent = c.nodes[0].agent.take().unwrap();
    agent.kill().unwrap();
    agent.wait().unwrap();
    c.start_agent(0).unwrap();
    let deadline = std::time::Instant::now() + testbed::slow(Duration::from_secs(20));
    while holds_xdp(&c.nodes[0].netns, "eth0") {
        assert!(std::time::Instant::now() < deadline, "node-a's eth0 still holds the XDP program");
        std::thread::sleep(Duration::from_millis(100));
    }
    echo(&mut conn, "without XDP").unwrap();
}
