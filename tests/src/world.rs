//! A node as upstream kube-proxy's packet-flow tests picture it (`pkg/proxy/iptables/
//! proxier_test.go`: node 192.168.0.2 and 192.168.1.2, 2001:db8::1 and 2001:db8:1::2, external
//! clients 203.0.113.2, 203.0.113.130 and 2600:5200::1, pods in 10.0.0.0/8 and fd00:10::/32),
//! built in network namespaces so that the real kube-proxy and kpr can each be given an
//! identical copy. Every link is dual-stack:
//!
//! ```text
//!   ext 203.0.113.2, .130, 2600:5200::1 ──(203.0.113.1, 2600:5200::fe) ext0 ┐
//!                         node 192.168.0.2, 192.168.1.2, 2001:db8::1, 2001:db8:1::2 ── eth0 ── router
//!   pod <ip> (one namespace per pod IP) ── vp<i> ┘                  (192.168.0.1, 2001:db8::fe)
//!       (169.254.1.1 and fe80::1 on every pod link, as Calico does; 169.254.1.1 of scope
//!        global, or of scope link as unnumbered and gateway-style CNIs set it up)
//! ```
//!
//! The router is the node's default gateway and answers for *every* address (a local route for
//! 0.0.0.0/0 and ::/0) with the name `router`, and the node itself answers `node` on its own addresses:
//! a packet no proxy took lands at one of them, so "not handled" is an observable outcome, and
//! nothing ever leaves the machine. Every pod serves TCP and UDP on
//! the given ports, answering `<ip>:<port>`; asked `peer?`, it tells the source it saw.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use anyhow::Result;
use testbed::{NameServer, Netns};

pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);
pub const NODE_IP_ALT: Ipv4Addr = Ipv4Addr::new(192, 168, 1, 2);
pub const ROUTER_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 1);
pub const EXT_GATEWAY: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
pub const EXT_CLIENT: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
pub const EXT_CLIENT_BLOCKED: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 130);
/// The node's address on every pod link.
pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
pub const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
pub const NODE_IP6_ALT: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 2);
pub const ROUTER_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0xfe);
pub const EXT_GATEWAY6: Ipv6Addr = Ipv6Addr::new(0x2600, 0x5200, 0, 0, 0, 0, 0, 0xfe);
pub const EXT_CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2600, 0x5200, 0, 0, 0, 0, 0, 1);
/// The node's IPv6 address on every pod link: link-local only, as Calico's host side of a pod link.
pub const POD_GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// Answer of the router: the packet was not handled by the proxy.
pub const UNHANDLED: &str = "router";
/// Answer of the node's own listeners: a packet for one of its addresses no proxy took.
pub const UNHANDLED_LOCAL: &str = "node";

/// The node's own addresses (where an untaken packet is delivered locally).
pub fn is_node_address(ip: IpAddr) -> bool {
    ip.is_loopback()
        || match ip {
            IpAddr::V4(ip) => [NODE_IP, NODE_IP_ALT, EXT_GATEWAY, POD_GATEWAY].contains(&ip),
            IpAddr::V6(ip) => [NODE_IP6, NODE_IP6_ALT, EXT_GATEWAY6].contains(&ip),
        }
}

pub struct World {
    pub prefix: String,
    pub pods: Vec<(IpAddr, Netns)>,
    servers: Vec<NameServer>,
    pub ext: Netns,
    pub router: Netns,
    /// Dropped last: the links of the others hang off it.
    pub node: Netns,
}

impl World {
    /// A node with pods at `pod_ips`, each serving `ports` (TCP and UDP); the router answers
    /// on `probed_ports`.
    pub fn new(prefix: &str, pod_ips: &[IpAddr], ports: &[u16], probed_ports: &[u16]) -> Result<Self> {
        Self::with_pod_gateway_scope(prefix, pod_ips, ports, probed_ports, "global")
    }

    /// [`World::new`] with the pod links' 169.254.1.1 of `scope` (`global`, `link`): with
    /// `link`, MASQUERADE never picks it for what leaves by a pod link and takes the first
    /// global address of the node (`inet_select_addr`).
    pub fn with_pod_gateway_scope(
        prefix: &str,
        pod_ips: &[IpAddr],
        ports: &[u16],
        probed_ports: &[u16],
        scope: &str,
    ) -> Result<Self> {
        let node = Netns::new(&format!("{prefix}-n"))?;
        let router = Netns::new(&format!("{prefix}-r"))?;
        let ext = Netns::new(&format!("{prefix}-x"))?;
        node.route_packets()?;
        node.ip(&["link", "set", "lo", "up"])?;

        node.ip(&["link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &router.name])?;
        node.ip(&["addr", "add", &format!("{NODE_IP}/24"), "dev", "eth0"])?;
        node.ip(&["addr", "add", &format!("{NODE_IP_ALT}/24"), "dev", "eth0"])?;
        // nodad: usable at once, not after duplicate address detection.
        node.ip(&["-6", "addr", "add", &format!("{NODE_IP6}/64"), "dev", "eth0", "nodad"])?;
        node.ip(&["-6", "addr", "add", &format!("{NODE_IP6_ALT}/64"), "dev", "eth0", "nodad"])?;
        node.ip(&["link", "set", "eth0", "up"])?;
        node.ip(&["route", "add", "default", "via", &ROUTER_IP.to_string()])?;
        node.ip(&["-6", "route", "add", "default", "via", &ROUTER_IP6.to_string()])?;
        router.ip(&["link", "set", "lo", "up"])?;
        router.ip(&["addr", "add", &format!("{ROUTER_IP}/24"), "dev", "eth0"])?;
        router.ip(&["-6", "addr", "add", &format!("{ROUTER_IP6}/64"), "dev", "eth0", "nodad"])?;
        router.ip(&["link", "set", "eth0", "up"])?;
        router.ip(&["route", "add", "local", "0.0.0.0/0", "dev", "lo"])?;
        // In the main table: IPv6 looks up the local table first (IPv4 merges the two), where
        // ::/0 would swallow the router's own replies.
        router.ip(&["-6", "route", "add", "local", "::/0", "dev", "lo", "table", "main"])?;
        for back in ["10.0.0.0/8", "203.0.113.0/24", "169.254.0.0/16"] {
            router.ip(&["route", "add", back, "via", &NODE_IP.to_string()])?;
        }
        for back in ["fd00:10::/32", "2600:5200::/64", "2001:db8:1::/64"] {
            router.ip(&["-6", "route", "add", back, "via", &NODE_IP6.to_string()])?;
        }

        node.ip(&["link", "add", "ext0", "type", "veth", "peer", "name", "eth0", "netns", &ext.name])?;
        node.ip(&["addr", "add", &format!("{EXT_GATEWAY}/24"), "dev", "ext0"])?;
        node.ip(&["-6", "addr", "add", &format!("{EXT_GATEWAY6}/64"), "dev", "ext0", "nodad"])?;
        node.ip(&["link", "set", "ext0", "up"])?;
        ext.ip(&["link", "set", "lo", "up"])?;
        ext.ip(&["addr", "add", &format!("{EXT_CLIENT}/24"), "dev", "eth0"])?;
        ext.ip(&["addr", "add", &format!("{EXT_CLIENT_BLOCKED}/24"), "dev", "eth0"])?;
        ext.ip(&["-6", "addr", "add", &format!("{EXT_CLIENT6}/64"), "dev", "eth0", "nodad"])?;
        ext.ip(&["link", "set", "eth0", "up"])?;
        ext.ip(&["route", "add", "default", "via", &EXT_GATEWAY.to_string()])?;
        ext.ip(&["-6", "route", "add", "default", "via", &EXT_GATEWAY6.to_string()])?;

        let mut servers = Vec::new();
        for port in probed_ports {
            // [::] without IPV6_V6ONLY: one listener for both families.
            let any = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), *port);
            servers.push(NameServer::tcp(&router, any, UNHANDLED)?);
            servers.push(NameServer::udp(&router, any, UNHANDLED)?);
            servers.push(NameServer::tcp(&node, any, UNHANDLED_LOCAL)?);
        }
        let mut pods = Vec::new();
        for (i, ip) in pod_ips.iter().enumerate() {
            let pod = Netns::new(&format!("{prefix}-p{i}"))?;
            let link = format!("vp{i}");
            node.ip(&["link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", &pod.name])?;
            node.ip(&["addr", "add", &format!("{POD_GATEWAY}/32"), "dev", &link, "scope", scope])?;
            node.ip(&["-6", "addr", "add", &format!("{POD_GATEWAY6}/64"), "dev", &link, "nodad"])?;
            node.ip(&["link", "set", &link, "up"])?;
            pod.ip(&["link", "set", "lo", "up"])?;
            pod.ip(&["link", "set", "eth0", "up"])?;
            if ip.is_ipv4() {
                node.ip(&["route", "add", &format!("{ip}/32"), "dev", &link])?;
                pod.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"])?;
                pod.ip(&["route", "add", &POD_GATEWAY.to_string(), "dev", "eth0", "scope", "link"])?;
                pod.ip(&["route", "add", "default", "via", &POD_GATEWAY.to_string()])?;
            } else {
                node.ip(&["-6", "route", "add", &format!("{ip}/128"), "dev", &link])?;
                pod.ip(&["-6", "addr", "add", &format!("{ip}/128"), "dev", "eth0", "nodad"])?;
                pod.ip(&["-6", "route", "add", "default", "via", &POD_GATEWAY6.to_string(), "dev", "eth0"])?;
            }
            for port in ports {
                let addr = SocketAddr::new(*ip, *port);
                servers.push(NameServer::tcp(&pod, addr, &addr.to_string())?);
                servers.push(NameServer::udp(&pod, addr, &addr.to_string())?);
            }
            pods.push((*ip, pod));
        }
        Ok(Self { prefix: prefix.to_owned(), pods, servers, ext, router, node })
    }

    /// The namespace of the pod with address `ip`.
    pub fn pod(&self, ip: impl Into<IpAddr>) -> &Netns {
        let ip = ip.into();
        &self.pods.iter().find(|(p, _)| *p == ip).unwrap_or_else(|| panic!("no pod {ip} in {}", self.prefix)).1
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Servers first (their sockets live in the namespaces), then pods, then the rest.
        self.servers.clear();
        self.pods.clear();
    }
}

/// The real `kpr agent` in a world's node namespace, on a KubeProxyConfiguration file and a
/// directory of manifests (the API's objects, dumped by the test), on its own pins; killed
/// and its pins, manifests and log removed on drop.
pub struct KprAgent {
    child: Option<std::process::Child>,
    pub pins: std::path::PathBuf,
    pub manifests: std::path::PathBuf,
    pub log: std::path::PathBuf,
}

impl KprAgent {
    /// Start it with `config`, sockets of `cgroup` balanced, and `extra` arguments.
    pub fn start(node: &Netns, config: &std::path::Path, cgroup: &testbed::Cgroup, tag: &str, extra: &[&str]) -> Self {
        let pins = std::path::PathBuf::from(format!("/sys/fs/bpf/{tag}"));
        let manifests = std::env::temp_dir().join(format!("{tag}.manifests"));
        std::fs::create_dir_all(&manifests).unwrap();
        let log = std::env::temp_dir().join(format!("{tag}.log"));
        std::fs::File::create(&log).unwrap();
        let child = testbed::AgentCommand::new(&cgroup.path, &pins)
            .config(config)
            .manifests(&manifests)
            .args(["--max-service-ports", "512", "--max-backends", "2048", "--max-conntrack", "8192"])
            .args(extra)
            .log_to(&log)
            .and_then(|agent| agent.in_netns(node))
            .and_then(testbed::AgentCommand::spawn)
            .expect("kpr starts");
        Self { child: Some(child), pins, manifests, log }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Kill the agent (its datapath stays pinned).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for KprAgent {
    fn drop(&mut self) {
        self.stop();
        let _ = kpr::datapath::bpf::cleanup(&self.pins);
        let _ = std::fs::remove_dir_all(&self.manifests);
        let _ = std::fs::remove_file(&self.log);
    }
}
