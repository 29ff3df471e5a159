//! kpr against the real kube-proxy on upstream's own packet-flow tests.
//!
//! The cases are transcribed from `pkg/proxy/iptables/proxier_test.go` (and `nftables/`) of
//! Kubernetes v1.36: the same Services, EndpointSlices and configuration, the same clients
//! (a pod in 10.0.0.0/8 or fd00:10::/64, the node, localhost, external clients 203.0.113.2, .130
//! and 2600:5200::1) and the
//! same expected outcome per row (the endpoints that may answer and whether the endpoint sees
//! the client masqueraded, or DROP, REJECT, or not handled). Two identical worlds
//! (`kpr_tests::world`) are built: the real kube-proxy runs in one, kpr in the other, both
//! started from the *same* KubeProxyConfiguration file. kube-proxy reads the objects from the
//! API server; kpr reads the very objects the API server holds, dumped to a manifest directory
//! (`kpr agent --config FILE --manifests DIR`). Every row is probed through both, and:
//! - each side must show upstream's expected outcome (so a case that the topology does not
//!   really exercise fails instead of passing vacuously);
//! - kpr must observe exactly what kube-proxy observes: which endpoints answered, the source
//!   address they saw, the error — except for the deviations listed in [`DEVIATIONS`], each
//!   with its reason (also in docs/behaviour.md).
//!
//! Differences to upstream's fixtures: NodePorts and ClusterIPs are the same (the test API
//! server gets upstream's service ranges), clients of "the node" do not bind a source address
//! (upstream writes the node's IP as source; a connect() from the node picks it by routing),
//! and the "SNATted to the LB IP" rows are left out (they need the LB IP to be a local address).
//!
//! A third agent, `kpr agent --shadow`, runs beside kube-proxy in its world with kpr's
//! configuration and objects: after every case its comparison with kube-proxy's rules must
//! show no mismatch, and in one case, given one endpoint fewer than kube-proxy, it must name
//! that Service.
//! Needs root; `cargo xtask test` runs it.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use kpr_tests::{
    cluster::{Cluster, KubeProxy},
    probe::{Kind, Outcome, probe_from},
    world::{
        EXT_CLIENT, EXT_CLIENT_BLOCKED, EXT_CLIENT6, KprAgent, NODE_IP, NODE_IP6, UNHANDLED, UNHANDLED_LOCAL, World,
        is_node_address,
    },
};
use testbed::Cgroup;

const NODE: &str = "test-node";
const PROBE_TIMEOUT: Duration = Duration::from_millis(1000);

/// Who sends.
#[derive(Clone, Copy, Debug)]
enum Client {
    Pod(IpAddr),
    /// A socket of the node (the source address is the kernel's choice).
    Node,
    /// A socket of the node connecting to 127.0.0.1 or ::1.
    Localhost,
    External(IpAddr),
}

#[derive(Clone, Debug, PartialEq)]
enum Expect {
    /// These endpoints (`ip:port`) answer; `true`: the endpoint sees a masqueraded source.
    To(&'static [&'static str], bool),
    Drop,
    Reject,
    /// No proxy takes it: the packet lands where routing sends it (the router).
    Unhandled,
}
use Expect::*;

struct Row {
    name: &'static str,
    from: Client,
    udp: bool,
    dst: IpAddr,
    port: u16,
    expect: Expect,
}

fn tcp(name: &'static str, from: Client, dst: &str, port: u16, expect: Expect) -> Row {
    Row { name, from, udp: false, dst: dst.parse().unwrap(), port, expect }
}

fn udp(name: &'static str, from: Client, dst: &str, port: u16, expect: Expect) -> Row {
    Row { udp: true, ..tcp(name, from, dst, port, expect) }
}

/// The configuration knobs upstream's fake proxier varies.
#[derive(Clone, Debug, PartialEq)]
struct Knobs {
    masquerade_all: bool,
    /// The ClusterCIDR detector with 10.0.0.0/8 and fd00:10::/64 (upstream's `localDetector`
    /// of each family).
    detect_local: bool,
    localhost_node_ports: bool,
    node_port_addresses: &'static [&'static str],
}

const BASE: Knobs =
    Knobs { masquerade_all: false, detect_local: true, localhost_node_ports: true, node_port_addresses: &[] };

struct Case {
    /// The upstream test (and subtest) this is transcribed from.
    source: &'static str,
    knobs: Knobs,
    /// Services (with their status) and EndpointSlices.
    objects: String,
    rows: Vec<Row>,
}

// ---------- objects, written as upstream's helpers build them ----------

/// A Service; `ports` are (name, port, protocol, nodePort, targetPort).
fn service(
    ns: &str,
    name: &str,
    ty: &str,
    cluster_ip: &str,
    ports: &[(&str, u16, &str, u16, u16)],
    spec: &str,
    lb_ips: &[&str],
) -> String {
    let ports: String = ports
        .iter()
        .map(|(n, p, proto, np, tp)| {
            let np = if *np > 0 { format!(", nodePort: {np}") } else { String::new() };
            format!("  - {{name: \"{n}\", port: {p}, protocol: {proto}, targetPort: {tp}{np}}}\n")
        })
        .collect();
    let status = if lb_ips.is_empty() {
        String::new()
    } else {
        let ingress: Vec<String> = lb_ips.iter().map(|ip| format!("{{ip: \"{ip}\"}}")).collect();
        format!("status:\n  loadBalancer:\n    ingress: [{}]\n", ingress.join(", "))
    };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  type: {ty}\n  clusterIP: \"{cluster_ip}\"\n{spec}  ports:\n{ports}{status}---\n"
    )
}

/// An endpoint: address, node (None: unset), ready, serving, terminating (None: unset).
type Ep = (&'static str, Option<&'static str>, Option<bool>, Option<bool>, Option<bool>);

fn ep(ip: &'static str, node: Option<&'static str>) -> Ep {
    (ip, node, None, None, None)
}

/// An EndpointSlice of `svc`; `ports` are (name, port, protocol).
fn slice(ns: &str, svc: &str, ports: &[(&str, u16, &str)], eps: &[Ep]) -> String {
    let address_type = if eps.iter().any(|e| e.0.contains(':')) { "IPv6" } else { "IPv4" };
    let ports: String =
        ports.iter().map(|(n, p, proto)| format!("- {{name: \"{n}\", port: {p}, protocol: {proto}}}\n")).collect();
    let eps: String = eps
        .iter()
        .map(|(ip, node, ready, serving, terminating)| {
            let mut conds = Vec::new();
            for (k, v) in [("ready", ready), ("serving", serving), ("terminating", terminating)] {
                if let Some(v) = v {
                    conds.push(format!("{k}: {v}"));
                }
            }
            let node = node.map(|n| format!("\n  nodeName: {n}")).unwrap_or_default();
            format!("- addresses: [\"{ip}\"]{node}\n  conditions: {{{}}}\n", conds.join(", "))
        })
        .collect();
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {svc}-1\n  namespace: {ns}\n  labels: {{kubernetes.io/service-name: {svc}}}\naddressType: {address_type}\nports:\n{ports}endpoints:\n{eps}---\n"
    )
}

const POD: Client = Client::Pod(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)));
const EXT: Client = Client::External(IpAddr::V4(EXT_CLIENT));
const EXT_BLOCKED: Client = Client::External(IpAddr::V4(EXT_CLIENT_BLOCKED));
const NODE_IP_S: &str = "192.168.0.2";
const NODE_IP_ALT_S: &str = "192.168.1.2";

fn no_endpoints_reject() -> Case {
    let objects = service(
        "ns1",
        "svc1",
        "LoadBalancer",
        "172.30.0.41",
        &[("p80", 80, "TCP", 3001, 80)],
        "  externalIPs: [192.168.99.11]\n",
        &["1.2.3.4"],
    );
    Case {
        source: "TestNoEndpointsReject",
        knobs: BASE,
        objects,
        rows: vec![
            tcp("pod to cluster IP with no endpoints", POD, "172.30.0.41", 80, Reject),
            tcp("external to external IP with no endpoints", EXT, "192.168.99.11", 80, Reject),
            tcp("pod to NodePort with no endpoints", POD, NODE_IP_S, 3001, Reject),
            tcp("external to NodePort with no endpoints", EXT, NODE_IP_S, 3001, Reject),
            tcp("pod to LoadBalancer IP with no endpoints", POD, "1.2.3.4", 80, Reject),
            tcp("external to LoadBalancer IP with no endpoints", EXT, "1.2.3.4", 80, Reject),
        ],
    }
}

fn cluster_ip_general(mode: &str) -> Case {
    let mut objects = service("ns1", "svc1", "ClusterIP", "172.30.0.41", &[("http", 80, "TCP", 0, 80)], "", &[]);
    objects += &service(
        "ns2",
        "svc2",
        "ClusterIP",
        "172.30.0.42",
        &[
            ("http", 80, "TCP", 0, 80),
            ("https", 443, "TCP", 0, 8443),
            ("dns-udp", 53, "UDP", 0, 53),
            ("dns-tcp", 53, "TCP", 0, 5353),
        ],
        "",
        &[],
    );
    objects += &slice("ns1", "svc1", &[("http", 80, "TCP")], &[ep("10.180.0.1", Some(NODE))]);
    objects += &slice(
        "ns2",
        "svc2",
        &[("http", 80, "TCP"), ("https", 8443, "TCP"), ("dns-udp", 53, "UDP"), ("dns-tcp", 5353, "TCP")],
        &[ep("10.180.0.1", Some(NODE)), ep("10.180.2.1", Some("node2"))],
    );
    // nftables rejects unknown ports of a ClusterIP; iptables leaves them alone.
    let unknown_port = if mode == "nftables" { Reject } else { Unhandled };
    let client = Client::Pod(IpAddr::V4(Ipv4Addr::new(10, 180, 0, 2)));
    Case {
        source: "TestClusterIPGeneral",
        knobs: BASE,
        objects,
        rows: vec![
            tcp("simple clusterIP", client, "172.30.0.41", 80, To(&["10.180.0.1:80"], false)),
            tcp(
                "hairpin to cluster IP",
                Client::Pod(IpAddr::V4(Ipv4Addr::new(10, 180, 0, 1))),
                "172.30.0.41",
                80,
                To(&["10.180.0.1:80"], true),
            ),
            tcp(
                "clusterIP with multiple endpoints",
                client,
                "172.30.0.42",
                80,
                To(&["10.180.0.1:80", "10.180.2.1:80"], false),
            ),
            tcp(
                "clusterIP with TargetPort",
                client,
                "172.30.0.42",
                443,
                To(&["10.180.0.1:8443", "10.180.2.1:8443"], false),
            ),
            tcp(
                "clusterIP with TCP, UDP, and SCTP on same port (TCP)",
                client,
                "172.30.0.42",
                53,
                To(&["10.180.0.1:5353", "10.180.2.1:5353"], false),
            ),
            udp(
                "clusterIP with TCP, UDP, and SCTP on same port (UDP)",
                client,
                "172.30.0.42",
                53,
                To(&["10.180.0.1:53", "10.180.2.1:53"], false),
            ),
            udp("TCP-only port does not match UDP traffic", client, "172.30.0.42", 80, unknown_port.clone()),
            tcp("svc1 does not accept svc2's ports", client, "172.30.0.41", 443, unknown_port),
        ]
        .into_iter()
        // Upstream's nftables row; iptables mode has no rule for it (kpr's deviation there).
        .chain([tcp(
            "packet to unallocated cluster ip",
            client,
            "172.30.0.50",
            80,
            if mode == "nftables" { Drop } else { Unhandled },
        )])
        .collect(),
    }
}

fn load_balancer() -> Case {
    let mut objects = service(
        "ns1",
        "svc1",
        "LoadBalancer",
        "172.30.0.41",
        &[("p80", 80, "TCP", 3001, 80)],
        "  loadBalancerSourceRanges: [\"192.168.0.0/24\", \" 203.0.113.0/25\"]\n",
        &["1.2.3.4", "5.6.7.8"],
    );
    objects += &slice("ns1", "svc1", &[("p80", 80, "TCP")], &[ep("10.180.0.1", None)]);
    let to = To(&["10.180.0.1:80"], true);
    Case {
        source: "TestLoadBalancer",
        knobs: BASE,
        objects,
        rows: vec![
            tcp("pod to cluster IP", POD, "172.30.0.41", 80, To(&["10.180.0.1:80"], false)),
            tcp("external to nodePort", EXT, NODE_IP_S, 3001, to.clone()),
            tcp("nodePort bypasses LoadBalancerSourceRanges", EXT_BLOCKED, NODE_IP_S, 3001, to.clone()),
            tcp("accepted external to LB1", EXT, "1.2.3.4", 80, to.clone()),
            tcp("accepted external to LB2", EXT, "5.6.7.8", 80, to.clone()),
            tcp("blocked external to LB1", EXT_BLOCKED, "1.2.3.4", 80, Drop),
            tcp("blocked external to LB2", EXT_BLOCKED, "5.6.7.8", 80, Drop),
            tcp("pod to LB1 (blocked by LoadBalancerSourceRanges)", POD, "1.2.3.4", 80, Drop),
            tcp("pod to LB2 (blocked by LoadBalancerSourceRanges)", POD, "5.6.7.8", 80, Drop),
            tcp("node to LB1 (allowed by LoadBalancerSourceRanges)", Client::Node, "1.2.3.4", 80, to.clone()),
            tcp("node to LB2 (allowed by LoadBalancerSourceRanges)", Client::Node, "5.6.7.8", 80, to),
        ],
    }
}

/// TestNodePorts: (subtest, IPv6, localhostNodePorts, nodePortAddresses, NodePorts on the
/// alternate node IP); the iptables and nftables tables differ.
fn node_ports(mode: &str) -> Vec<Case> {
    const MULTIPLE: &[&str] = &["192.168.0.0/24", "192.168.1.0/24", "2001:db8::/64"];
    type Subtest = (&'static str, bool, bool, &'static [&'static str], bool);
    let subtests: &[Subtest] = if mode == "nftables" {
        &[
            ("TestNodePorts/ipv4", false, false, &[], false),
            ("TestNodePorts/ipv4, multiple nodeport-addresses", false, false, MULTIPLE, true),
            ("TestNodePorts/ipv6", true, false, &[], false),
            (
                "TestNodePorts/ipv6, multiple nodeport-addresses",
                true,
                false,
                &["192.168.0.0/24", "192.168.1.0/24", "2001:db8::/64", "2001:db8:1::2/128"],
                true,
            ),
        ]
    } else {
        &[
            ("TestNodePorts/ipv4, localhost-nodeports enabled", false, true, &[], true),
            ("TestNodePorts/ipv4, localhost-nodeports disabled", false, false, &[], true),
            (
                "TestNodePorts/ipv4, localhost-nodeports disabled, localhost in nodeport-addresses",
                false,
                false,
                &["192.168.0.0/24", "127.0.0.1/32"],
                false,
            ),
            (
                "TestNodePorts/ipv4, localhost-nodeports enabled, multiple nodeport-addresses",
                false,
                false,
                MULTIPLE,
                true,
            ),
            ("TestNodePorts/ipv6, localhost-nodeports enabled", true, true, &[], true),
            ("TestNodePorts/ipv6, localhost-nodeports disabled", true, false, &[], true),
            (
                "TestNodePorts/ipv6, localhost-nodeports disabled, multiple nodeport-addresses",
                true,
                false,
                MULTIPLE,
                false,
            ),
        ]
    };
    subtests
        .iter()
        .map(|(source, v6, localhost, npa, alt)| {
            // Upstream's addresses of each family.
            const BOTH4: &[&str] = &["10.180.0.1:80", "10.180.2.1:80"];
            const BOTH6: &[&str] = &["[fd00:10:180::1]:80", "[fd00:10:180::2:1]:80"];
            let (svc_ip, ep1, ep2, both, pod, ext, node_ip, alt_ip, localhost_ip) = if *v6 {
                (
                    "fd00:172:30::41",
                    "fd00:10:180::1",
                    "fd00:10:180::2:1",
                    BOTH6,
                    "fd00:10::2",
                    IpAddr::V6(EXT_CLIENT6),
                    "2001:db8::1",
                    "2001:db8:1::2",
                    "::1",
                )
            } else {
                (
                    "172.30.0.41",
                    "10.180.0.1",
                    "10.180.2.1",
                    BOTH4,
                    "10.0.0.2",
                    IpAddr::V4(EXT_CLIENT),
                    NODE_IP_S,
                    NODE_IP_ALT_S,
                    "127.0.0.1",
                )
            };
            let mut objects = service("ns1", "svc1", "NodePort", svc_ip, &[("p80", 80, "TCP", 3001, 80)], "", &[]);
            let other = if mode == "nftables" { Some("other-node") } else { None };
            objects += &slice("ns1", "svc1", &[("p80", 80, "TCP")], &[ep(ep1, other), ep(ep2, Some(NODE))]);
            let (pod, ext) = (Client::Pod(pod.parse().unwrap()), Client::External(ext));
            let masqueraded = To(both, true);
            let mut rows = vec![
                tcp("pod to cluster IP", pod, svc_ip, 80, To(both, false)),
                tcp("external to nodePort", ext, node_ip, 3001, masqueraded.clone()),
                tcp("node to nodePort", Client::Node, node_ip, 3001, masqueraded.clone()),
            ];
            if mode != "nftables" {
                // Only IPv4 offers NodePorts on localhost.
                let localhost = if *localhost && !v6 { masqueraded.clone() } else { Unhandled };
                rows.push(tcp("localhost to nodePort", Client::Localhost, localhost_ip, 3001, localhost));
            }
            let alt_expect = if *alt { masqueraded } else { Unhandled };
            rows.push(tcp("external to nodePort on secondary IP", ext, alt_ip, 3001, alt_expect));
            Case {
                source,
                knobs: Knobs { localhost_node_ports: *localhost, node_port_addresses: npa, ..BASE },
                objects,
                rows,
            }
        })
        .collect()
}

fn external_traffic_policy(local: bool) -> Case {
    let policy = if local { "Local" } else { "Cluster" };
    let mut objects = service(
        "ns1",
        "svc1",
        "LoadBalancer",
        "172.30.0.41",
        &[("p80", 80, "TCP", 3001, 80)],
        &format!("  externalIPs: [192.168.99.11]\n  externalTrafficPolicy: {policy}\n"),
        &["1.2.3.4"],
    );
    objects += &slice("ns1", "svc1", &[("p80", 80, "TCP")], &[ep("10.180.0.1", None), ep("10.180.2.1", Some(NODE))]);
    const BOTH: &[&str] = &["10.180.0.1:80", "10.180.2.1:80"];
    let rows = if local {
        vec![
            tcp("pod to cluster IP hits both endpoints, unmasqueraded", POD, "172.30.0.41", 80, To(BOTH, false)),
            tcp("pod to external IP hits both endpoints, unmasqueraded", POD, "192.168.99.11", 80, To(BOTH, false)),
            tcp(
                "external to external IP hits only local endpoint, unmasqueraded",
                EXT,
                "192.168.99.11",
                80,
                To(&["10.180.2.1:80"], false),
            ),
            tcp("pod to LB IP hits only both endpoints, unmasqueraded", POD, "1.2.3.4", 80, To(BOTH, false)),
            tcp(
                "external to LB IP hits only local endpoint, unmasqueraded",
                EXT,
                "1.2.3.4",
                80,
                To(&["10.180.2.1:80"], false),
            ),
            tcp("pod to NodePort hits both endpoints, unmasqueraded", POD, NODE_IP_S, 3001, To(BOTH, false)),
            tcp(
                "external to NodePort hits only local endpoint, unmasqueraded",
                EXT,
                NODE_IP_S,
                3001,
                To(&["10.180.2.1:80"], false),
            ),
        ]
    } else {
        vec![
            tcp("pod to cluster IP hits both endpoints, unmasqueraded", POD, "172.30.0.41", 80, To(BOTH, false)),
            tcp("pod to external IP hits both endpoints, masqueraded", POD, "192.168.99.11", 80, To(BOTH, true)),
            tcp("external to external IP hits both endpoints, masqueraded", EXT, "192.168.99.11", 80, To(BOTH, true)),
            tcp("pod to LB IP hits both endpoints, masqueraded", POD, "1.2.3.4", 80, To(BOTH, true)),
            tcp("external to LB IP hits both endpoints, masqueraded", EXT, "1.2.3.4", 80, To(BOTH, true)),
            tcp("pod to NodePort hits both endpoints, masqueraded", POD, NODE_IP_S, 3001, To(BOTH, true)),
            tcp("external to NodePort hits both endpoints, masqueraded", EXT, NODE_IP_S, 3001, To(BOTH, true)),
        ]
    };
    Case {
        source: if local { "TestExternalTrafficPolicyLocal" } else { "TestExternalTrafficPolicyCluster" },
        knobs: BASE,
        objects,
        rows,
    }
}

/// An upstream subtest of `TestInternalTrafficPolicy`: its name, the policy, three endpoints
/// (address, node) and what the client sees.
type PolicySubtest = (&'static str, &'static str, [(&'static str, &'static str); 3], Expect);

fn internal_traffic_policy() -> Vec<Case> {
    let subtests: [PolicySubtest; 4] = [
        (
            "TestInternalTrafficPolicy/internalTrafficPolicy is cluster",
            "Cluster",
            [("10.0.1.1", NODE), ("10.0.1.2", "node1"), ("10.0.1.3", "node2")],
            To(&["10.0.1.1:80", "10.0.1.2:80", "10.0.1.3:80"], false),
        ),
        (
            "TestInternalTrafficPolicy/internalTrafficPolicy is local and there is one local endpoint",
            "Local",
            [("10.0.1.1", NODE), ("10.0.1.2", "node1"), ("10.0.1.3", "node2")],
            To(&["10.0.1.1:80"], false),
        ),
        (
            "TestInternalTrafficPolicy/internalTrafficPolicy is local and there are multiple local endpoints",
            "Local",
            [("10.0.1.1", NODE), ("10.0.1.2", NODE), ("10.0.1.3", "node2")],
            To(&["10.0.1.1:80", "10.0.1.2:80"], false),
        ),
        (
            "TestInternalTrafficPolicy/internalTrafficPolicy is local and there are no local endpoints",
            "Local",
            [("10.0.1.1", "node0"), ("10.0.1.2", "node1"), ("10.0.1.3", "node2")],
            Drop,
        ),
    ];
    subtests
        .into_iter()
        .flat_map(|(source, policy, eps, expect)| {
            let objects = service(
                "ns1",
                "svc1",
                "ClusterIP",
                "172.30.1.1",
                &[("", 80, "TCP", 0, 80)],
                &format!("  internalTrafficPolicy: {policy}\n"),
                &[],
            );
            let eps: Vec<Ep> = eps.iter().map(|(ip, node)| (*ip, Some(*node), Some(true), None, None)).collect();
            let with = objects.clone() + &slice("ns1", "svc1", &[("", 80, "TCP")], &eps);
            [
                Case {
                    source,
                    knobs: BASE,
                    objects: with,
                    rows: vec![tcp("pod to ClusterIP", POD, "172.30.1.1", 80, expect)],
                },
                // Then the slice is deleted.
                Case {
                    source,
                    knobs: BASE,
                    objects,
                    rows: vec![tcp("endpoints deleted", POD, "172.30.1.1", 80, Reject)],
                },
            ]
        })
        .collect()
}

/// TestTerminatingEndpointsTrafficPolicyLocal / ...Cluster: ready → serving-terminating
/// fallback, per traffic policy.
fn terminating_endpoints(local: bool) -> Vec<Case> {
    let policy = if local { "Local" } else { "Cluster" };
    let source = if local {
        "TestTerminatingEndpointsTrafficPolicyLocal"
    } else {
        "TestTerminatingEndpointsTrafficPolicyCluster"
    };
    let objects = service(
        "ns1",
        "svc1",
        "LoadBalancer",
        "172.30.1.1",
        &[("", 80, "TCP", 0, 80)],
        &format!("  externalTrafficPolicy: {policy}\n"),
        &["1.2.3.4"],
    );
    let other = if local { "node-1" } else { "another-node" };
    // (address, ready, serving, terminating, on this node)
    let e = |ip: &'static str, r: bool, s: bool, t: bool, here: bool| -> Ep {
        (ip, Some(if here { NODE } else { other }), Some(r), Some(s), Some(t))
    };
    let remote =
        |ip: &'static str, r: bool, s: bool, t: bool| -> Ep { (ip, Some("node-1"), Some(r), Some(s), Some(t)) };
    let masq = !local;
    let subtests: Vec<(&'static str, Vec<Ep>, Expect, Expect)> = vec![
        (
            "ready endpoints exist",
            vec![
                e("10.0.1.1", true, true, false, true),
                e("10.0.1.2", true, true, false, true),
                e("10.0.1.3", false, true, true, local),
                e("10.0.1.4", false, false, true, local),
                e("10.0.1.5", true, true, false, false),
            ],
            To(&["10.0.1.1:80", "10.0.1.2:80", "10.0.1.5:80"], false),
            if local {
                To(&["10.0.1.1:80", "10.0.1.2:80"], false)
            } else {
                To(&["10.0.1.1:80", "10.0.1.2:80", "10.0.1.5:80"], true)
            },
        ),
        (
            "only terminating endpoints exist",
            vec![
                e("10.0.1.2", false, true, true, true),
                e("10.0.1.3", false, true, true, true),
                e("10.0.1.4", false, false, true, local),
                if local { e("10.0.1.5", true, true, false, false) } else { e("10.0.1.5", false, true, true, false) },
            ],
            if local { To(&["10.0.1.5:80"], false) } else { To(&["10.0.1.2:80", "10.0.1.3:80", "10.0.1.5:80"], false) },
            if local {
                To(&["10.0.1.2:80", "10.0.1.3:80"], false)
            } else {
                To(&["10.0.1.2:80", "10.0.1.3:80", "10.0.1.5:80"], true)
            },
        ),
        (
            "terminating endpoints on remote node",
            vec![remote("10.0.1.5", false, true, true)],
            To(&["10.0.1.5:80"], false),
            if local { Drop } else { To(&["10.0.1.5:80"], masq) },
        ),
        (
            "no usable endpoints on any node",
            vec![e("10.0.1.5", false, false, true, true), remote("10.0.1.5", false, false, true)],
            Reject,
            Reject,
        ),
    ];
    let mut cases: Vec<Case> = subtests
        .into_iter()
        .map(|(name, eps, to_cluster_ip, to_lb)| Case {
            source: Box::leak(format!("{source}/{name}").into_boxed_str()),
            knobs: BASE,
            objects: objects.clone() + &slice("ns1", "svc1", &[("", 80, "TCP")], &eps),
            rows: vec![
                tcp("pod to clusterIP", POD, "172.30.1.1", 80, to_cluster_ip),
                tcp("external to LB", EXT, "1.2.3.4", 80, to_lb),
            ],
        })
        .collect();
    cases.push(Case {
        source,
        knobs: BASE,
        objects,
        rows: vec![
            tcp("pod to clusterIP after endpoints deleted", POD, "172.30.1.1", 80, Reject),
            tcp("external to LB after endpoints deleted", EXT, "1.2.3.4", 80, Reject),
        ],
    });
    cases
}

/// TestInternalExternalMasquerade: one table, four configurations with overrides.
fn internal_external_masquerade() -> Vec<Case> {
    let lb = |ns: &str, svc: &str, ip: &str, np: u16, spec: &str, lbip: &'static str| {
        service(ns, svc, "LoadBalancer", ip, &[("p80", 80, "TCP", np, 80)], spec, &[lbip])
    };
    let mut objects = lb("ns1", "svc1", "172.30.0.41", 3001, "", "1.2.3.4");
    objects += &lb("ns2", "svc2", "172.30.0.42", 3002, "  externalTrafficPolicy: Local\n", "5.6.7.8");
    objects += &lb("ns3", "svc3", "172.30.0.43", 3003, "  internalTrafficPolicy: Local\n", "9.10.11.12");
    for (ns, svc, n) in [("ns1", "svc1", 1), ("ns2", "svc2", 2), ("ns3", "svc3", 3)] {
        let local: &'static str = ["10.180.0.1", "10.180.0.2", "10.180.0.3"][n - 1];
        let remote: &'static str = ["10.180.1.1", "10.180.1.2", "10.180.1.3"][n - 1];
        objects += &slice(ns, svc, &[("p80", 80, "TCP")], &[ep(local, Some(NODE)), ep(remote, Some("remote"))]);
    }
    const S1: &[&str] = &["10.180.0.1:80", "10.180.1.1:80"];
    const S2: &[&str] = &["10.180.0.2:80", "10.180.1.2:80"];
    const S3: &[&str] = &["10.180.0.3:80", "10.180.1.3:80"];
    let (node, lo) = (Client::Node, Client::Localhost);
    let base = || {
        vec![
            tcp("pod to ClusterIP", POD, "172.30.0.41", 80, To(S1, false)),
            tcp("pod to NodePort", POD, NODE_IP_S, 3001, To(S1, true)),
            tcp("pod to LB", POD, "1.2.3.4", 80, To(S1, true)),
            tcp("node to ClusterIP", node, "172.30.0.41", 80, To(S1, true)),
            tcp("node to NodePort", node, NODE_IP_S, 3001, To(S1, true)),
            tcp("localhost to NodePort", lo, "127.0.0.1", 3001, To(S1, true)),
            tcp("node to LB", node, "1.2.3.4", 80, To(S1, true)),
            tcp("external to ClusterIP", EXT, "172.30.0.41", 80, To(S1, true)),
            tcp("external to NodePort", EXT, NODE_IP_S, 3001, To(S1, true)),
            tcp("external to LB", EXT, "1.2.3.4", 80, To(S1, true)),
            tcp("pod to ClusterIP with eTP:Local", POD, "172.30.0.42", 80, To(S2, false)),
            tcp("pod to NodePort with eTP:Local", POD, NODE_IP_S, 3002, To(S2, false)),
            tcp("pod to LB with eTP:Local", POD, "5.6.7.8", 80, To(S2, false)),
            tcp("node to ClusterIP with eTP:Local", node, "172.30.0.42", 80, To(S2, true)),
            tcp("node to NodePort with eTP:Local", node, NODE_IP_S, 3001, To(S1, true)),
            tcp("localhost to NodePort with eTP:Local", lo, "127.0.0.1", 3002, To(S2, true)),
            tcp("node to LB with eTP:Local", node, "5.6.7.8", 80, To(S2, true)),
            tcp("external to ClusterIP with eTP:Local", EXT, "172.30.0.42", 80, To(S2, true)),
            tcp("external to NodePort with eTP:Local", EXT, NODE_IP_S, 3002, To(&["10.180.0.2:80"], false)),
            tcp("external to LB with eTP:Local", EXT, "5.6.7.8", 80, To(&["10.180.0.2:80"], false)),
            tcp("pod to ClusterIP with iTP:Local", POD, "172.30.0.43", 80, To(&["10.180.0.3:80"], false)),
            tcp("pod to NodePort with iTP:Local", POD, NODE_IP_S, 3003, To(S3, true)),
            tcp("pod to LB with iTP:Local", POD, "9.10.11.12", 80, To(S3, true)),
            tcp("node to ClusterIP with iTP:Local", node, "172.30.0.43", 80, To(&["10.180.0.3:80"], true)),
            tcp("node to NodePort with iTP:Local", node, NODE_IP_S, 3003, To(S3, true)),
            tcp("localhost to NodePort with iTP:Local", lo, "127.0.0.1", 3003, To(S3, true)),
            tcp("node to LB with iTP:Local", node, "9.10.11.12", 80, To(S3, true)),
            tcp("external to ClusterIP with iTP:Local", EXT, "172.30.0.43", 80, To(&["10.180.0.3:80"], true)),
            tcp("external to NodePort with iTP:Local", EXT, NODE_IP_S, 3003, To(S3, true)),
            tcp("external to LB with iTP:Local", EXT, "9.10.11.12", 80, To(S3, true)),
        ]
    };
    type Override = (&'static str, Option<&'static [&'static str]>, Option<bool>);
    let no_detector: &[Override] = &[
        ("node to ClusterIP", None, Some(false)),
        ("node to ClusterIP with eTP:Local", None, Some(false)),
        ("node to ClusterIP with iTP:Local", None, Some(false)),
        ("external to ClusterIP", None, Some(false)),
        ("external to ClusterIP with eTP:Local", None, Some(false)),
        ("external to ClusterIP with iTP:Local", None, Some(false)),
        ("pod to NodePort with eTP:Local", Some(&["10.180.0.2:80"]), None),
        ("pod to LB with eTP:Local", Some(&["10.180.0.2:80"]), None),
    ];
    let masquerade_all: &[Override] = &[
        ("pod to ClusterIP", None, Some(true)),
        ("pod to ClusterIP with eTP:Local", None, Some(true)),
        ("pod to ClusterIP with iTP:Local", None, Some(true)),
    ];
    let both: Vec<Override> = masquerade_all.iter().chain(&no_detector[6..]).copied().collect();
    let variants: [(&'static str, bool, bool, &[Override]); 4] = [
        ("TestInternalExternalMasquerade/base", false, true, &[]),
        ("TestInternalExternalMasquerade/no LocalTrafficDetector", false, false, no_detector),
        ("TestInternalExternalMasquerade/masqueradeAll", true, true, masquerade_all),
        ("TestInternalExternalMasquerade/masqueradeAll, no LocalTrafficDetector", true, false, &both),
    ];
    variants
        .into_iter()
        .map(|(source, masquerade_all, detect_local, overrides)| {
            let mut rows = base();
            for (name, output, masq) in overrides {
                let row = rows.iter_mut().find(|r| r.name == *name).unwrap_or_else(|| panic!("no row {name}"));
                let To(eps, m) = &mut row.expect else { panic!("{name}: not an endpoint row") };
                if let Some(o) = output {
                    *eps = o;
                }
                if let Some(v) = masq {
                    *m = *v;
                }
            }
            Case { source, knobs: Knobs { masquerade_all, detect_local, ..BASE }, objects: objects.clone(), rows }
        })
        .collect()
}

/// Not upstream's: a Service whose endpoint is a host-network pod of this node (the node's
/// own address; the node's listener on port 9 answers `node`). kube-proxy DNATs and the packet
/// is delivered locally, never through POSTROUTING: the endpoint sees the client's own
/// address, also where the Service masquerades (eTP=Cluster), and answers it directly.
fn host_network_endpoint() -> Case {
    let mut objects =
        service("ns1", "svc1", "LoadBalancer", "172.30.0.41", &[("p80", 80, "TCP", 3001, 9)], "", &["1.2.3.4"]);
    objects += &slice("ns1", "svc1", &[("p80", 9, "TCP")], &[ep(NODE_IP_S, Some(NODE))]);
    let v6 = "  ipFamilies: [IPv6]\n  ipFamilyPolicy: SingleStack\n";
    objects += &service("ns2", "svc2", "NodePort", "fd00:172:30::42", &[("p80", 80, "TCP", 3002, 9)], v6, &[]);
    objects += &slice("ns2", "svc2", &[("p80", 9, "TCP")], &[ep("2001:db8::1", Some(NODE))]);
    const NODE_EP: &[&str] = &["node"];
    let ext6 = Client::External(IpAddr::V6(EXT_CLIENT6));
    Case {
        source: "kpr/host-network endpoint on this node",
        knobs: BASE,
        objects,
        rows: vec![
            tcp("external to NodePort, unmasqueraded", EXT, NODE_IP_S, 3001, To(NODE_EP, false)),
            tcp("external to LB IP, unmasqueraded", EXT, "1.2.3.4", 80, To(NODE_EP, false)),
            tcp("pod to NodePort, unmasqueraded", POD, NODE_IP_S, 3001, To(NODE_EP, false)),
            tcp("pod to cluster IP, unmasqueraded", POD, "172.30.0.41", 80, To(NODE_EP, false)),
            tcp("node to NodePort", Client::Node, NODE_IP_S, 3001, To(NODE_EP, true)),
            tcp("external to IPv6 NodePort, unmasqueraded", ext6, "2001:db8::1", 3002, To(NODE_EP, false)),
        ],
    }
}

/// nftables' copy of a table: the same rows without the localhost ones (nftables mode has no
/// localhost NodePorts, and its tests have no such rows).
fn for_mode(mode: &str, mut cases: Vec<Case>) -> Vec<Case> {
    if mode == "nftables" {
        for case in &mut cases {
            case.rows.retain(|r| !matches!(r.from, Client::Localhost));
        }
    }
    cases
}

fn cases(mode: &str) -> Vec<Case> {
    let mut all = vec![no_endpoints_reject(), cluster_ip_general(mode), load_balancer()];
    all.extend(node_ports(mode));
    all.push(external_traffic_policy(true));
    all.push(external_traffic_policy(false));
    all.extend(internal_traffic_policy());
    all.extend(terminating_endpoints(true));
    all.extend(terminating_endpoints(false));
    all.extend(internal_external_masquerade());
    all.push(host_network_endpoint());
    for_mode(mode, all)
}

/// Where kpr differs from kube-proxy on purpose, each with kpr's own outcome and the reason (also
/// in docs/behaviour.md): (mode or "*", case source prefix, row name, kpr's outcome, why). kube-proxy
/// must still show upstream's outcome there, and kpr its own.
const DEVIATIONS: &[(&str, &str, &str, Expect, &str)] = &[
    ("iptables", "TestClusterIPGeneral", "TCP-only port does not match UDP traffic", Reject, SERVICE_RANGE),
    ("iptables", "TestClusterIPGeneral", "svc1 does not accept svc2's ports", Reject, SERVICE_RANGE),
    ("iptables", "TestClusterIPGeneral", "packet to unallocated cluster ip", Drop, SERVICE_RANGE),
];

const SERVICE_RANGE: &str = "kpr refuses the service range in iptables mode too (unless --pass-service-range): \
     kube-proxy's iptables mode lets these packets leave the node by its default route";

fn deviation(mode: &str, case: &Case, row: &Row) -> Option<(&'static Expect, &'static str)> {
    DEVIATIONS
        .iter()
        .find(|(m, src, name, ..)| (*m == "*" || *m == mode) && case.source.starts_with(src) && *name == row.name)
        .map(|d| (&d.3, d.4))
}

// ---------- running the table ----------

fn config_yaml(mode: &str, knobs: &Knobs) -> String {
    let detect = if knobs.detect_local { "clusterCIDR: 10.0.0.0/8,fd00:10::/64\n" } else { "" };
    let npa = if knobs.node_port_addresses.is_empty() {
        String::new()
    } else {
        format!(
            "nodePortAddresses: [{}]\n",
            knobs.node_port_addresses.iter().map(|a| format!("\"{a}\"")).collect::<Vec<_>>().join(", ")
        )
    };
    let block = format!("  masqueradeAll: {}\n  syncPeriod: 1s\n  minSyncPeriod: 0s\n", knobs.masquerade_all);
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: {mode}\nhostnameOverride: {NODE}\n\
         bindAddress: {NODE_IP}\nmetricsBindAddress: 127.0.0.1:10249\nhealthzBindAddress: 127.0.0.1:10256\n{detect}{npa}\
         conntrack: {{maxPerCore: 0}}\niptables:\n  localhostNodePorts: {}\n{}nftables:\n{block}",
        knobs.localhost_node_ports,
        if mode == "nftables" { "  syncPeriod: 1s\n  minSyncPeriod: 0s\n".to_owned() } else { block.clone() },
    )
}

/// What a client observed, reduced to what must agree: answering endpoints, the sources they
/// saw, the errors.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    endpoints: BTreeSet<String>,
    sources: BTreeSet<String>,
    errors: BTreeSet<String>,
}

fn seen(o: &Outcome) -> Seen {
    let mut endpoints = BTreeSet::new();
    let mut sources = BTreeSet::new();
    for answer in o.answers.keys() {
        let (name, source) = answer.split_once("<-").unwrap_or((answer, ""));
        endpoints.insert(name.to_owned());
        sources.insert(source.to_owned());
    }
    Seen { endpoints, sources, errors: o.error_kinds() }
}

/// Does `s` show `expect` for a client at `client` (its own address, when it has a fixed one)?
fn check(s: &Seen, expect: &Expect, udp: bool, dst: IpAddr, client: Option<IpAddr>) -> Result<(), String> {
    let ok = match expect {
        To(eps, masq) => {
            let names: BTreeSet<String> = eps.iter().map(|e| e.to_string()).collect();
            let source_ok = match client {
                Some(c) => s.sources.iter().all(|src| (src != &c.to_string()) == *masq),
                None => true,
            };
            s.errors.is_empty() && s.endpoints == names && source_ok
        }
        Drop => {
            s.endpoints.is_empty()
                && s.errors == BTreeSet::from([if udp { "recv:timeout" } else { "connect:timeout" }.to_owned()])
        }
        Reject => {
            s.endpoints.is_empty()
                && s.errors
                    == BTreeSet::from([if udp { "recv:ECONNREFUSED" } else { "connect:ECONNREFUSED" }.to_owned()])
        }
        // A datagram answered by the router comes back from the router's own address, which a
        // connected socket ignores: for UDP, "not handled" is a timeout.
        Unhandled if udp => s.endpoints.is_empty() && s.errors == BTreeSet::from(["recv:timeout".to_owned()]),
        Unhandled => {
            let landing = if is_node_address(dst) { UNHANDLED_LOCAL } else { UNHANDLED };
            s.errors.is_empty() && s.endpoints == BTreeSet::from([landing.to_owned()])
        }
    };
    if ok { Ok(()) } else { Err(format!("expected {expect:?}, observed {s:?}")) }
}

/// Probe a row in `world`; clients on the node (its pods and itself) run in `node_cgroup`
/// (kpr's socket hooks apply there, as at a real node's cgroup root), external clients in
/// `other_cgroup` (they are other machines).
fn probe_row(world: &World, node_cgroup: &Path, other_cgroup: &Path, row: &Row) -> Outcome {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_kpr-probe"));
    let kind = if row.udp { Kind::UdpSource } else { Kind::TcpSource };
    let n = match &row.expect {
        To(eps, _) => 8 * eps.len(),
        _ => 2,
    };
    let timeout = if matches!(row.expect, To(..)) { PROBE_TIMEOUT } else { Duration::from_millis(600) };
    let (netns, source, cgroup) = match row.from {
        Client::Pod(ip) => (&world.pod(ip).name, None, node_cgroup),
        Client::Node | Client::Localhost => (&world.node.name, None, node_cgroup),
        Client::External(ip) => (&world.ext.name, Some(ip), other_cgroup),
    };
    probe_from(&exe, netns, cgroup, kind, SocketAddr::new(row.dst, row.port), n, timeout, source).unwrap()
}

fn pods_and_ports(cases: &[Case]) -> (Vec<IpAddr>, Vec<u16>) {
    let mut pods = BTreeSet::new();
    // 9: the marker service's port (unhandled, the router answers it).
    let mut probed = BTreeSet::from([9]);
    for case in cases {
        for row in &case.rows {
            probed.insert(row.port);
            if let Client::Pod(ip) = row.from {
                pods.insert(ip);
            }
            if let To(eps, _) = &row.expect {
                // Not an `ip:port`: the node's own listener.
                for e in eps.iter().filter_map(|e| e.parse::<SocketAddr>().ok()) {
                    pods.insert(e.ip());
                }
            }
        }
    }
    (pods.into_iter().collect(), probed.into_iter().collect())
}

fn differential(mode: &str) {
    // KPR_FLOWS_ONLY=<part of a case name>: run only those cases (for debugging).
    let only = std::env::var("KPR_FLOWS_ONLY").unwrap_or_default();
    let cases: Vec<Case> = cases(mode).into_iter().filter(|c| c.source.contains(&only)).collect();
    let (pods, probed) = pods_and_ports(&cases);
    let cluster = Cluster::start_with(
        &format!("kf-{}", &mode[..3]),
        &["--service-cluster-ip-range=172.30.0.0/16,fd00:172:30::/108", "--service-node-port-range=3000-32767"],
    )
    .expect("control plane");
    let tag = testbed::unique_name(&format!("kf{}", &mode[..2]));
    // The pod links' gateway address: of scope link in one mode's worlds (MASQUERADE then takes
    // the node's first global address for what leaves by a pod link), global in the other's;
    // the masquerade source does not depend on the mode, so each is covered once.
    let scope = if mode == "iptables" { "link" } else { "global" };
    let world = |side: &str| {
        World::with_pod_gateway_scope(&format!("{tag}{side}"), &pods, &[80, 53, 8443, 5353], &probed, scope)
    };
    let kp_world = world("k").expect("kube-proxy's world");
    let kpr_world = world("r").expect("kpr's world");
    let cgroup = Cgroup::new(&tag).expect("kpr's cgroup");
    cluster
        .apply(&format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE}}}\n---\n{}",
            (1..=3)
                .map(|i| format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: ns{i}}}\n---\n"))
                .collect::<String>()
        ))
        .unwrap();

    // kube-proxy (and kpr) take the node's primary IP from the Node's status.
    let status = format!(
        "{{\"status\":{{\"addresses\":[{{\"type\":\"InternalIP\",\"address\":\"{NODE_IP}\"}},\
         {{\"type\":\"InternalIP\",\"address\":\"{NODE_IP6}\"}}]}}}}"
    );
    cluster.kubectl(&["patch", "node", NODE, "--subresource=status", "--type=merge", "-p", &status]).unwrap();

    let mut failures = Vec::new();
    let mut report = Vec::new();
    let mut running: Option<(Knobs, KubeProxy, KprAgent, KprAgent)> = None;
    let mut rows_checked = 0;
    for (index, case) in cases.iter().enumerate() {
        let case_started = std::time::Instant::now();
        if running.as_ref().is_none_or(|(k, ..)| *k != case.knobs) {
            drop(running.take()); // stop the previous pair first
            let (kube_proxy, file) =
                KubeProxy::start_with_config(&cluster, &kp_world.node, &config_yaml(mode, &case.knobs))
                    .expect("kube-proxy");
            let kpr = KprAgent::start(&kpr_world.node, &file, &cgroup, &format!("{tag}-{index}"), &[]);
            let shadow = KprAgent::start(&kp_world.node, &file, &cgroup, &format!("{tag}-s{index}"), &SHADOW_ARGS);
            running = Some((case.knobs.clone(), kube_proxy, kpr, shadow));
        }
        let (_, kube_proxy, kpr, shadow) = running.as_mut().unwrap();

        // The case's objects replace the previous case's, in the API and in kpr's manifests.
        cluster.kubectl(&["delete", "services,endpointslices", "-A", "-l", "kpr-flows", "--wait=true"]).unwrap();
        // A marker of each family: kube-proxy runs a proxier per family.
        let markers = [format!("172.30.255.{}", index + 1), format!("fd00:172:30::ff{:02x}", index + 1)];
        let dual =
            format!("  ipFamilyPolicy: RequireDualStack\n  clusterIPs: [\"{}\", \"{}\"]\n", markers[0], markers[1]);
        let objects = format!(
            "{}{}",
            case.objects,
            service("ns1", "marker", "ClusterIP", &markers[0], &[("m", 9, "TCP", 0, 9)], &dual, &[])
        );
        let objects = objects.replace("metadata: {name: ", "metadata: {labels: {kpr-flows: \"\"}, name: ").replace(
            "  labels: {kubernetes.io/service-name:",
            "  labels: {kpr-flows: \"\", kubernetes.io/service-name:",
        );
        cluster.apply(&objects).unwrap_or_else(|e| panic!("{}: {e}", case.source));
        for doc in objects.split("---\n").filter(|d| d.contains("kind: Service\n") && d.contains("status:")) {
            let name = doc.split("name: ").nth(1).unwrap().split(',').next().unwrap();
            let ns = doc.split("namespace: ").nth(1).unwrap().split('}').next().unwrap();
            let status = &doc[doc.find("status:").unwrap()..];
            let ips: Vec<String> = status
                .split("ip: \"")
                .skip(1)
                .map(|s| format!("{{\"ip\":\"{}\"}}", s.split('"').next().unwrap()))
                .collect();
            let patch = format!("{{\"status\":{{\"loadBalancer\":{{\"ingress\":[{}]}}}}}}", ips.join(","));
            cluster
                .kubectl(&["patch", "service", name, "-n", ns, "--subresource=status", "--type=merge", "-p", &patch])
                .unwrap();
        }
        let dump = cluster.kubectl(&["get", "services,endpointslices,nodes,servicecidrs", "-A", "-o", "yaml"]).unwrap();
        testbed::write_atomic(&kpr.manifests, "cluster.yaml", &dump).unwrap();
        testbed::write_atomic(&shadow.manifests, "cluster.yaml", &dump).unwrap();
        let marker_addrs = markers.map(|m| SocketAddr::new(m.parse().unwrap(), 9));
        for addr in marker_addrs {
            testbed::wait_programmed(&kpr.pins, &format!("{addr}/TCP"), Some(0), Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("{}: kpr did not program the case: {e}\n{}", case.source, kpr.log_tail()));
        }
        // kube-proxy has the case when it rejects the markers (a service without endpoints,
        // written last): until then the router answers.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        for marker_addr in marker_addrs {
            loop {
                let exe = PathBuf::from(env!("CARGO_BIN_EXE_kpr-probe"));
                let o = probe_from(
                    &exe,
                    &kp_world.node.name,
                    cluster.home_cgroup(),
                    Kind::Tcp,
                    marker_addr,
                    1,
                    // An IPv6 REJECT of the node's own SYN is seen at its retransmission, after 1 s.
                    Duration::from_millis(1500),
                    None,
                )
                .unwrap();
                if o.errors.contains_key("connect:ECONNREFUSED") {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline && kube_proxy.running(),
                    "{}: kube-proxy did not program the case (its marker {marker_addr}: {o:?}):\n{}",
                    case.source,
                    kube_proxy.log_tail()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }

        // kube-proxy has the case: the shadow agent's comparisons from now on must find no
        // difference, confirmed or not (asked for while the rows are probed).
        let shadow_node = kp_world.node.name.clone();
        let shadow_check = std::thread::spawn(move || -> Result<serde_json::Value, String> {
            // The agent may not have read the case's objects yet: a real difference persists.
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            loop {
                let report = shadow_report(&shadow_node)?;
                let clean = report["mismatches"].as_array().is_some_and(Vec::is_empty) && report["pending"] == 0;
                if clean || std::time::Instant::now() > deadline {
                    return Ok(report);
                }
            }
        });
        if let Ok(ms) = std::env::var("KPR_FLOWS_SETTLE_MS") {
            std::thread::sleep(Duration::from_millis(ms.parse().unwrap_or(0)));
        }
        for row in &case.rows {
            rows_checked += 1;
            let client = match row.from {
                Client::Pod(ip) | Client::External(ip) => Some(ip),
                Client::Node | Client::Localhost => None,
            };
            let home = cluster.home_cgroup();
            let what = format!("{mode} {} / {}", case.source, row.name);
            let deviation = deviation(mode, case, row);
            // A row is judged on its last of up to three probes: a probe on a loaded machine
            // can time out, a real difference persists. Retries are reported.
            let mut problems = Vec::new();
            for attempt in 1..=3 {
                // Both worlds at once: a row's timeouts (drops, retransmissions) are waited once.
                let (via_kube_proxy, via_kpr) = std::thread::scope(|s| {
                    let kpr_side = s.spawn(|| seen(&probe_row(&kpr_world, &cgroup.path, home, row)));
                    (seen(&probe_row(&kp_world, home, home, row)), kpr_side.join().unwrap())
                });
                report.push(format!("{what}: kube-proxy {via_kube_proxy:?} | kpr {via_kpr:?}"));
                problems.clear();
                if let Err(e) = check(&via_kube_proxy, &row.expect, row.udp, row.dst, client) {
                    problems.push(format!("{what}: kube-proxy does not show upstream's expectation: {e}"));
                }
                match deviation {
                    Some((own, _)) => {
                        if let Err(e) = check(&via_kpr, own, row.udp, row.dst, client) {
                            problems.push(format!("{what}: kpr does not show its listed deviation: {e}"));
                        }
                    }
                    None => {
                        if let Err(e) = check(&via_kpr, &row.expect, row.udp, row.dst, client) {
                            problems.push(format!("{what}: kpr: {e}"));
                        }
                        // Sources included: in the worlds whose pod links carry only a
                        // link-scoped IPv4 address, the node's own masqueraded connections
                        // show MASQUERADE's source through kpr too (`KPR_NODE_SOURCES`).
                        if via_kpr != via_kube_proxy {
                            problems.push(format!("{what}: kpr {via_kpr:?} but kube-proxy {via_kube_proxy:?}"));
                        }
                    }
                }
                if problems.is_empty() {
                    break;
                }
                report.push(format!("{what}: attempt {attempt} of 3 differs: {}", problems.join("; ")));
            }
            if let Some((_, why)) = deviation {
                report.push(format!("{what}: listed deviation ({why})"));
            }
            failures.append(&mut problems);
        }
        assert!(kube_proxy.running(), "kube-proxy exited:\n{}", kube_proxy.log_tail());
        let after = shadow_check.join().unwrap().unwrap_or_else(|e| panic!("{e}\n{}", shadow.log_tail()));
        let (mismatches, pending) = (&after["mismatches"], after["pending"].as_u64().unwrap_or(0));
        if mismatches.as_array().is_none_or(|m| !m.is_empty()) || pending != 0 {
            failures.push(format!(
                "{mode} {}: shadow mode differs from kube-proxy ({pending} pending): {mismatches:#}",
                case.source
            ));
        }
        assert!(after["verdicts"].as_u64().unwrap_or(0) > 0, "{}: shadow mode compared nothing: {after}", case.source);
        if case.source == "TestClusterIPGeneral" {
            shadow_finds_a_missing_endpoint(&kp_world, shadow, &dump);
        }
        report.push(format!(
            "{mode} {}: {} rows in {:.1} s",
            case.source,
            case.rows.len(),
            case_started.elapsed().as_secs_f64()
        ));
        // KPR_FLOWS_DEBUG=<part of a case name>: kube-proxy's rules and kpr's maps after it.
        if std::env::var("KPR_FLOWS_DEBUG").is_ok_and(|c| case.source.contains(&c)) {
            let ns = &kp_world.node.name;
            let out = Command::new("ip").args(["netns", "exec", ns, "iptables-save"]).output().unwrap();
            report.push(String::from_utf8_lossy(&out.stdout).into_owned());
            let links = kpr.pins.join(format!("v{}/KPR_LINKS", proxy_common::PIN_LAYOUT_VERSION));
            let out = Command::new("bpftool").args(["map", "dump", "pinned"]).arg(links).output().unwrap();
            report.push(String::from_utf8_lossy(&out.stdout).into_owned());
            report.push(kpr::inspect::services::render(&kpr.pins).unwrap_or_default());
        }
    }
    println!("{}", report.join("\n"));
    println!("{mode}: {} cases, {rows_checked} rows", cases.len());
    if let Some((_, kp, kpr, _)) = running.as_ref().filter(|_| !failures.is_empty()) {
        println!("kube-proxy's log:\n{}\nkpr's log:\n{}", kp.log_tail(), kpr.log_tail());
    }
    drop(running);
    assert!(failures.is_empty(), "{} of {rows_checked} rows differ:\n{}", failures.len(), failures.join("\n"));
}

/// The shadow agent: no datapath, and ports of its own beside kube-proxy's.
const SHADOW_ARGS: [&str; 5] =
    ["--shadow", "--metrics-bind-address", "127.0.0.1:10349", "--healthz-bind-address", "127.0.0.1:10356"];

/// `kpr shadow report --now -o json` in kube-proxy's world (two comparisons made for it),
/// once the agent answers (within 30 s).
fn shadow_report(netns: &str) -> Result<serde_json::Value, String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{netns}"))
            .arg(testbed::kpr_bin())
            .args(["shadow", "report", "--now", "--metrics-address", "127.0.0.1:10349", "-o", "json"])
            .output()
            .map_err(|e| e.to_string())?;
        match serde_json::from_slice::<serde_json::Value>(&out.stdout) {
            Ok(report) if report["problems"].as_array().is_some_and(Vec::is_empty) => return Ok(report),
            Ok(report) if std::time::Instant::now() > deadline => return Err(format!("shadow mode: {report}")),
            Err(_) if std::time::Instant::now() > deadline => {
                return Err(format!("no shadow report: {}", String::from_utf8_lossy(&out.stderr)));
            }
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// Give the shadow agent ns1/svc1 without its endpoint (kube-proxy keeps it): its report must
/// name that Service, and only it; then give the objects back.
fn shadow_finds_a_missing_endpoint(world: &World, shadow: &KprAgent, dump: &str) {
    let mut objects: serde_yaml::Value = serde_yaml::from_str(dump).unwrap();
    let svc1_slice = |o: &serde_yaml::Value| {
        o["kind"] == "EndpointSlice"
            && o["metadata"]["namespace"] == "ns1"
            && o["metadata"]["labels"]["kubernetes.io/service-name"] == "svc1"
    };
    let slice = objects["items"].as_sequence_mut().unwrap().iter_mut().find(|o| svc1_slice(o)).expect("svc1's slice");
    slice["endpoints"] = serde_yaml::Value::Sequence(Vec::new());
    testbed::write_atomic(&shadow.manifests, "cluster.yaml", &serde_yaml::to_string(&objects).unwrap()).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mismatches = loop {
        let report = shadow_report(&world.node.name).unwrap();
        let mismatches = report["mismatches"].as_array().cloned().unwrap_or_default();
        if !mismatches.is_empty() {
            break mismatches;
        }
        assert!(std::time::Instant::now() < deadline, "shadow mode did not find the missing endpoint: {report}");
        std::thread::sleep(Duration::from_millis(200));
    };
    for m in &mismatches {
        assert!(m["service"].as_str().is_some_and(|s| s.starts_with("ns1/svc1:")), "{m}");
        // kpr without endpoints rejects; kube-proxy reaches the endpoint.
        assert_eq!(m["kpr"]["verdict"], "reject", "{m}");
        assert_eq!(m["kubeProxy"]["endpoints"][0], "10.180.0.1:80", "{m}");
    }
    let sources: BTreeSet<&str> = mismatches.iter().filter_map(|m| m["source"].as_str()).collect();
    assert_eq!(sources, BTreeSet::from(["pod", "external", "node"]), "{mismatches:?}");
    // Counted per Service on the metrics server, the same number.
    let metrics =
        world.node.run(|| testbed::http_get("127.0.0.1:10349".parse().unwrap(), "/metrics", Duration::from_secs(5)));
    let (_, metrics) = metrics.unwrap().unwrap();
    let line = format!("kpr_shadow_mismatches{{namespace=\"ns1\",service=\"svc1\"}} {}", mismatches.len());
    assert!(metrics.lines().any(|l| l == line), "{line} in:\n{metrics}");
    testbed::write_atomic(&shadow.manifests, "cluster.yaml", dump).unwrap();
}

/// Both modes at once: each has its own control plane, worlds and agents, and a case's time is
/// mostly waited (kube-proxy's sync, the probes' timeouts), so the two take little more than
/// one. `KPR_FLOWS_MODE=iptables` (or `nftables`): only that mode (for debugging).
#[test]
fn upstream_packet_flows_iptables_and_nftables() {
    let only = std::env::var("KPR_FLOWS_MODE").unwrap_or_default();
    let modes = ["iptables", "nftables"].into_iter().filter(|m| m.contains(only.as_str()));
    let failed: Vec<&str> = std::thread::scope(|s| {
        let runs: Vec<_> = modes.map(|mode| (mode, s.spawn(move || differential(mode)))).collect();
        runs.into_iter().filter_map(|(mode, run)| run.join().is_err().then_some(mode)).collect()
    });
    assert!(failed.is_empty(), "kpr and kube-proxy differ in mode {failed:?} (see the panics above)");
}
