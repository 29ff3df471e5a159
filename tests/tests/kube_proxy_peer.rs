//! Differential tests: the real kube-proxy (iptables and nftables modes, built from
//! `tools/k8s`) and kpr watch the same API server; a table of scenarios is applied once, and the
//! same client requests go through each. What the clients observe — which backends answer, the
//! error when none does, the address the client sees — must agree, apart from the differences
//! kpr intends, listed in [`INTENDED`] with the reason.
//!
//! Two copies of the same pods (same names, same addresses) hang off two "node" namespaces:
//! kube-proxy runs in one (the client runs beside it, outside kpr's cgroup), kpr's client runs
//! in the other, inside kpr's cgroup. Needs root; `cargo xtask test` runs it.
use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr, SocketAddrV4},
    path::PathBuf,
    time::Duration,
};

use kpr_tests::{
    Harness, POD_PORT,
    cluster::{Cluster, KubeProxy, unix_now},
    probe::{Kind, Outcome, probe_in},
};
use testbed::{NameServer, Topology};

const PODS: [&str; 3] = ["pod-a", "pod-b", "pod-c"];
/// Second port the pods serve (TCP and UDP), answering `<pod>:8081`.
const ALT_PORT: u16 = 8081;
const PROBE_TIMEOUT: Duration = Duration::from_millis(1500);
/// The cluster's service range, dual-stack: the IPv6 scenarios get a ClusterIP of each family.
const DUAL_STACK_RANGE: &str = "--service-cluster-ip-range=10.96.0.0/16,fd00:96::/108";

/// An endpoint: pod index and conditions (ready, serving, terminating); `None` = unset.
#[derive(Clone, Copy)]
struct Ep(usize, Option<bool>, Option<bool>, Option<bool>);
const READY: fn(usize) -> Ep = |i| Ep(i, Some(true), Some(true), Some(false));
const NOT_READY: fn(usize) -> Ep = |i| Ep(i, Some(false), Some(false), Some(false));
const TERMINATING_SERVING: fn(usize) -> Ep = |i| Ep(i, Some(false), Some(true), Some(true));
const TERMINATING_NOT_SERVING: fn(usize) -> Ep = |i| Ep(i, Some(false), Some(false), Some(true));

/// What a probe must observe (on both sides, unless an intended difference says otherwise).
#[derive(Clone, Debug, PartialEq)]
enum Expect {
    /// Exactly these backends answer, and the client sees the ClusterIP:port as its peer.
    Backends(&'static [&'static str]),
    /// Every attempt fails with these `stage:ERRNO` kinds.
    Errors(&'static [&'static str]),
    /// sessionAffinity: every answer comes from one backend, one of these.
    OneOf(&'static [&'static str]),
}

/// Probes of one ClusterIP: (kind, service port, expected outcome).
type Probes = &'static [(Kind, u16, Expect)];

struct Scenario {
    service: &'static str,
    /// Service ports: (name, port, protocol).
    ports: &'static [(&'static str, u16, &'static str)],
    /// EndpointSlice ports: (name, port, protocol); `None`: no slice at all.
    slice_ports: Option<&'static [(&'static str, u16, &'static str)]>,
    endpoints: Vec<Ep>,
    /// sessionAffinity ClientIP with this timeout (seconds).
    affinity: Option<u32>,
    /// (kind, service port, expected outcome).
    probes: Probes,
    /// A dual-stack Service (RequireDualStack): whether its IPv6 EndpointSlice lists the same
    /// endpoints (else there is none), and the probes of its IPv6 ClusterIP.
    ipv6: Option<(bool, Probes)>,
}

fn scenarios() -> Vec<Scenario> {
    use Expect::*;
    use Kind::*;
    const TCP80: &[(&str, u16, &str)] = &[("http", 80, "TCP")];
    const SLICE_TCP: &[(&str, u16, &str)] = &[("http", POD_PORT, "TCP")];
    const REFUSED_TCP: &[(Kind, u16, Expect)] = &[(Tcp, 80, Errors(&["connect:ECONNREFUSED"]))];
    vec![
        Scenario {
            service: "tcp",
            ports: TCP80,
            slice_ports: Some(SLICE_TCP),
            endpoints: vec![READY(0), READY(1), READY(2)],
            affinity: None,
            ipv6: None,
            probes: &[(Tcp, 80, Backends(&["pod-a", "pod-b", "pod-c"]))],
        },
        Scenario {
            service: "udp",
            ports: &[("dns", 53, "UDP")],
            slice_ports: Some(&[("dns", POD_PORT, "UDP")]),
            endpoints: vec![READY(0), READY(2)],
            affinity: None,
            ipv6: None,
            probes: &[(Udp, 53, Backends(&["pod-a", "pod-c"])), (UdpConnected, 53, Backends(&["pod-a", "pod-c"]))],
        },
        // Named ports: the slice lists them in another order, with another unrelated port;
        // the join is by name (+ protocol), the number comes from the slice.
        Scenario {
            service: "multi",
            ports: &[("web", 80, "TCP"), ("alt", 81, "TCP"), ("alt-udp", 81, "UDP")],
            slice_ports: Some(&[
                ("metrics", 9999, "TCP"),
                ("alt-udp", ALT_PORT, "UDP"),
                ("alt", ALT_PORT, "TCP"),
                ("web", POD_PORT, "TCP"),
            ]),
            endpoints: vec![READY(1), READY(2)],
            affinity: None,
            ipv6: None,
            probes: &[
                (Tcp, 80, Backends(&["pod-b", "pod-c"])),
                (Tcp, 81, Backends(&["pod-b:8081", "pod-c:8081"])),
                (Udp, 81, Backends(&["pod-b:8081", "pod-c:8081"])),
            ],
        },
        // Not-ready endpoints get nothing while a ready one exists.
        Scenario {
            service: "not-ready",
            ports: TCP80,
            slice_ports: Some(SLICE_TCP),
            endpoints: vec![READY(0), NOT_READY(1), TERMINATING_SERVING(2)],
            affinity: None,
            ipv6: None,
            probes: &[(Tcp, 80, Backends(&["pod-a"]))],
        },
        // No ready endpoint: fall back to the serving terminating ones.
        Scenario {
            service: "terminating",
            ports: TCP80,
            slice_ports: Some(SLICE_TCP),
            endpoints: vec![NOT_READY(0), TERMINATING_SERVING(1), TERMINATING_NOT_SERVING(2)],
            affinity: None,
            ipv6: None,
            probes: &[(Tcp, 80, Backends(&["pod-b"]))],
        },
        // Conditions left unset count as ready and serving.
        Scenario {
            service: "unset-conditions",
            ports: TCP80,
            slice_ports: Some(SLICE_TCP),
            endpoints: vec![Ep(0, None, None, None), Ep(1, None, None, None)],
            affinity: None,
            ipv6: None,
            probes: &[(Tcp, 80, Backends(&["pod-a", "pod-b"]))],
        },
        Scenario {
            service: "none-ready",
            ports: TCP80,
            slice_ports: Some(SLICE_TCP),
            endpoints: vec![NOT_READY(0), TERMINATING_NOT_SERVING(1)],
            affinity: None,
            ipv6: None,
            probes: REFUSED_TCP,
        },
        Scenario {
            service: "empty-slice",
            ports: &[("http", 80, "TCP"), ("dns", 53, "UDP")],
            slice_ports: Some(&[("http", POD_PORT, "TCP"), ("dns", POD_PORT, "UDP")]),
            endpoints: vec![],
            affinity: None,
            ipv6: None,
            probes: &[
                (Tcp, 80, Errors(&["connect:ECONNREFUSED"])),
                (Udp, 53, Errors(&["send:ECONNREFUSED"])),
                (UdpConnected, 53, Errors(&["connect:ECONNREFUSED"])),
            ],
        },
        // sessionAffinity ClientIP: one client, every connection and datagram to one endpoint.
        Scenario {
            service: "affinity",
            ports: &[("http", 80, "TCP"), ("dns", 53, "UDP")],
            slice_ports: Some(&[("http", POD_PORT, "TCP"), ("dns", POD_PORT, "UDP")]),
            endpoints: vec![READY(0), READY(1), READY(2)],
            affinity: Some(10_800),
            ipv6: None,
            probes: &[(Tcp, 80, OneOf(&["pod-a", "pod-b", "pod-c"])), (Udp, 53, OneOf(&["pod-a", "pod-b", "pod-c"]))],
        },
        // Dual-stack: each family balances over its own EndpointSlice, as kube-proxy's two
        // proxiers do; without IPv6 endpoints the IPv6 ClusterIP rejects while IPv4 serves.
        Scenario {
            service: "dual",
            ports: &[("http", 80, "TCP"), ("dns", 53, "UDP")],
            slice_ports: Some(&[("http", POD_PORT, "TCP"), ("dns", POD_PORT, "UDP")]),
            endpoints: vec![READY(0), READY(1), NOT_READY(2)],
            affinity: None,
            probes: &[(Tcp, 80, Backends(&["pod-a", "pod-b"])), (Udp, 53, Backends(&["pod-a", "pod-b"]))],
            ipv6: Some((
                true,
                &[
                    (Tcp, 80, Backends(&["pod-a", "pod-b"])),
                    (Udp, 53, Backends(&["pod-a", "pod-b"])),
                    (UdpConnected, 53, Backends(&["pod-a", "pod-b"])),
                ],
            )),
        },
        Scenario {
            service: "dual-v4-only",
            ports: TCP80,
            slice_ports: Some(SLICE_TCP),
            endpoints: vec![READY(0), READY(2)],
            affinity: None,
            probes: &[(Tcp, 80, Backends(&["pod-a", "pod-c"]))],
            ipv6: Some((false, REFUSED_TCP)),
        },
        Scenario {
            service: "no-slice",
            ports: TCP80,
            slice_ports: None,
            endpoints: vec![],
            affinity: None,
            ipv6: None,
            probes: REFUSED_TCP,
        },
    ]
}

/// Differences kpr intends: (mode or "*", service, probe kind, port, what kube-proxy shows, why).
/// kpr's side must still match the scenario's expectation; kube-proxy's must match the value here.
const INTENDED: &[(&str, &str, Kind, u16, Expect, &str)] = &[
    (
        "*",
        "empty-slice",
        Kind::Udp,
        53,
        Expect::Errors(&["send:EPERM"]),
        "kube-proxy REJECTs in the OUTPUT hook: for the node's own datagram the verdict is a drop, \
         so sendto() fails with EPERM (a pod behind a bridge would get the ICMP port unreachable \
         instead); kpr answers in the sendmsg hook with ECONNREFUSED, the errno the REJECT's ICMP \
         error means, as its docs/behaviour.md documents",
    ),
    (
        "*",
        "empty-slice",
        Kind::UdpConnected,
        53,
        Expect::Errors(&["send:EPERM"]),
        "kube-proxy has no say in connect() of a UDP socket (no packet is sent), so connect() \
         succeeds and the first send() fails with EPERM; kpr's connect4 hook already knows there \
         is no backend and fails connect() with ECONNREFUSED",
    ),
];

fn intended(
    mode: &str,
    service: &str,
    kind: Kind,
    port: u16,
) -> Option<&'static (&'static str, &'static str, Kind, u16, Expect, &'static str)> {
    INTENDED.iter().find(|d| (d.0 == "*" || d.0 == mode) && d.1 == service && d.2 == kind && d.3 == port)
}

fn service_yaml(s: &Scenario) -> String {
    let ports: String = s
        .ports
        .iter()
        .map(|(n, p, proto)| format!("  - {{name: {n}, port: {p}, protocol: {proto}, targetPort: {POD_PORT}}}\n"))
        .collect();
    let affinity = s
        .affinity
        .map(|t| {
            format!("  sessionAffinity: ClientIP\n  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {t}}}}}\n")
        })
        .unwrap_or_default();
    let dual = if s.ipv6.is_some() { "  ipFamilyPolicy: RequireDualStack\n" } else { "" };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {}, namespace: test}}\nspec:\n{affinity}{dual}  ports:\n{ports}",
        s.service
    )
}

/// The EndpointSlice of `s` in the family of `pod_ips` (pod index → address).
fn slice_yaml(s: &Scenario, pod_ips: &[IpAddr]) -> Option<String> {
    let v6 = pod_ips.first().is_some_and(IpAddr::is_ipv6);
    let (suffix, address_type) = if v6 { ("v6", "IPv6") } else { ("x1y2z", "IPv4") };
    let ports: String =
        s.slice_ports?.iter().map(|(n, p, proto)| format!("- {{name: {n}, port: {p}, protocol: {proto}}}\n")).collect();
    let cond = |name: &str, v: Option<bool>| v.map(|v| format!("{name}: {v}, ")).unwrap_or_default();
    let endpoints: String = s
        .endpoints
        .iter()
        .map(|Ep(i, ready, serving, terminating)| {
            format!(
                "- addresses: [\"{}\"]\n  conditions: {{{}{}{}}}\n",
                pod_ips[*i],
                cond("ready", *ready),
                cond("serving", *serving),
                cond("terminating", *terminating)
            )
            .replace(", }", "}")
        })
        .collect();
    Some(format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {0}-{suffix}\n  namespace: test\n  labels:\n    kubernetes.io/service-name: {0}\n    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io\naddressType: {address_type}\nendpoints:{1}ports:\n{2}",
        s.service,
        if endpoints.is_empty() { " []\n".to_owned() } else { format!("\n{endpoints}") },
        ports
    ))
}

/// The number of backends kpr must program for a service port.
fn programmed_backends(expect: &Expect) -> usize {
    match expect {
        Expect::Backends(b) | Expect::OneOf(b) => b.len(),
        Expect::Errors(_) => 0,
    }
}

/// Does `outcome` satisfy `expect` for a probe of `addr`?
fn check(outcome: &Outcome, expect: &Expect, addr: SocketAddr, n: usize) -> Result<(), String> {
    let ok = match expect {
        Expect::Backends(b) => {
            outcome.errors.is_empty()
                && outcome.backends() == b.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>()
                && outcome.peers == BTreeSet::from([addr.to_string()])
        }
        Expect::OneOf(b) => {
            outcome.errors.is_empty()
                && outcome.answers.len() == 1
                && outcome.backends().iter().all(|name| b.contains(&name.as_str()))
                && outcome.peers == BTreeSet::from([addr.to_string()])
        }
        Expect::Errors(e) => {
            outcome.answers.is_empty()
                && outcome.error_kinds() == e.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>()
                && outcome.errors.values().sum::<usize>() == n
        }
    };
    if ok { Ok(()) } else { Err(format!("expected {expect:?}, observed {outcome:?}")) }
}

fn differential(mode: &str) {
    let cluster = Cluster::start_with(&format!("kp-{}", &mode[..3]), &[DUAL_STACK_RANGE]).expect("control plane");
    // Pods, kpr's node namespace and cgroup (this process joins it), the agent on the API.
    let mut h = Harness::new(&format!("kp{}", &mode[..3]), &PODS).expect("harness");
    h.kubeconfig = Some(cluster.admin_kubeconfig.clone());
    // kube-proxy's node: the same pods again (same names and addresses) in their own namespaces.
    let mut kp_topology = Topology::new(&format!("{}-k", h.name), &PODS).expect("kube-proxy topology");
    let mut servers = Vec::new();
    for pod in &mut kp_topology.pods {
        pod.serve(POD_PORT).unwrap();
    }
    for pod in kp_topology.pods.iter().chain(&h.topology.pods) {
        let addr = SocketAddrV4::new(pod.ip, ALT_PORT);
        let name = format!("{}:{ALT_PORT}", pod.name);
        servers.push(NameServer::tcp(&pod.netns, addr, &name).unwrap());
        servers.push(NameServer::udp(&pod.netns, addr, &name).unwrap());
    }
    let pod_ips: Vec<IpAddr> = h.topology.pods.iter().map(|p| p.ip.into()).collect();
    let pod_ips6: Vec<IpAddr> = h.topology.pods.iter().map(|p| p.ip6.into()).collect();
    assert_eq!(pod_ips, kp_topology.pods.iter().map(|p| IpAddr::from(p.ip)).collect::<Vec<_>>());
    assert_eq!(pod_ips6, kp_topology.pods.iter().map(|p| IpAddr::from(p.ip6)).collect::<Vec<_>>());

    // The scenarios, applied once through the API.
    let scenarios = scenarios();
    let mut yaml = String::from(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: test}\n---\napiVersion: v1\nkind: Node\nmetadata: {name: kp-node}\n",
    );
    for s in &scenarios {
        yaml += "---\n";
        yaml += &service_yaml(s);
        if let Some(slice) = slice_yaml(s, &pod_ips) {
            yaml += "---\n";
            yaml += &slice;
        }
        if let Some((true, _)) = s.ipv6
            && let Some(slice) = slice_yaml(s, &pod_ips6)
        {
            yaml += "---\n";
            yaml += &slice;
        }
    }
    cluster.apply(&yaml).unwrap();
    let applied = unix_now();
    // Every probe: (scenario, the ClusterIP of its family, kind, port, expectation).
    let mut probes = Vec::new();
    for s in &scenarios {
        let ips = cluster.cluster_ips("test", s.service).unwrap();
        probes.extend(s.probes.iter().map(|(kind, port, expect)| (s, ips[0], *kind, *port, expect)));
        if let Some((_, probes6)) = s.ipv6 {
            assert!(ips.len() == 2 && ips[1].is_ipv6(), "{} allocated {ips:?}", s.service);
            probes.extend(probes6.iter().map(|(kind, port, expect)| (s, ips[1], *kind, *port, expect)));
        }
    }

    // kube-proxy DNATs after the route lookup: the IPv6 service range needs a route too.
    kp_topology.client.ip(&["-6", "route", "add", "fd00:96::/108", "dev", "veth0"]).unwrap();
    let mut kube_proxy = KubeProxy::start(&cluster, &kp_topology.client, mode, "kp-node", "veth0").expect("kube-proxy");
    h.start_agent().unwrap();
    for (_, ip, kind, port, expect) in &probes {
        let proto = if *kind == Kind::Tcp { "TCP" } else { "UDP" };
        let address = format!("{}/{proto}", SocketAddr::new(*ip, *port));
        h.wait_for(&address, Some(programmed_backends(expect)), Duration::from_secs(30)).unwrap();
    }
    kube_proxy.wait_synced_after(applied, Duration::from_secs(60)).unwrap();
    assert_eq!(kube_proxy.http_get(10249, "/proxyMode").unwrap().lines().last(), Some(mode), "kube-proxy's mode");

    let probe_exe = PathBuf::from(env!("CARGO_BIN_EXE_kpr-probe"));
    let mut failures = Vec::new();
    let mut report = Vec::new();
    for (s, ip, kind, port, expect) in &probes {
        {
            let (kind, port) = (kind, port);
            let addr = SocketAddr::new(*ip, *port);
            let n = if matches!(expect, Expect::Errors(_)) { 3 } else { 30 };
            let via_kube_proxy =
                probe_in(&probe_exe, &kp_topology.client.name, cluster.home_cgroup(), *kind, addr, n, PROBE_TIMEOUT)
                    .unwrap();
            let via_kpr =
                probe_in(&probe_exe, &h.topology.client.name, &h.cgroup.path, *kind, addr, n, PROBE_TIMEOUT).unwrap();
            let what = format!("{mode} {} {addr} {}", s.service, kind.as_str());
            report.push(format!("{what}: kube-proxy {via_kube_proxy:?} | kpr {via_kpr:?}"));
            if let Err(e) = check(&via_kpr, expect, addr, n) {
                failures.push(format!("{what}: kpr: {e}"));
            }
            let kp_expect = match intended(mode, s.service, *kind, *port) {
                Some(d) => &d.4,
                None => expect,
            };
            if let Err(e) = check(&via_kube_proxy, kp_expect, addr, n) {
                failures.push(format!("{what}: kube-proxy: {e}"));
            }
        }
    }
    println!("{}", report.join("\n"));
    assert!(kube_proxy.running(), "kube-proxy exited:\n{}", kube_proxy.log_tail());
    assert!(h.agent_running());
    assert!(
        failures.is_empty(),
        "kpr and kube-proxy ({mode}) disagree:\n{}\n\nall outcomes:\n{}\n\nkube-proxy log:\n{}",
        failures.join("\n"),
        report.join("\n"),
        kube_proxy.log_tail()
    );
    drop(kube_proxy);
    drop(servers);
}

#[test]
fn kube_proxy_iptables_and_kpr_agree() {
    differential("iptables");
}

#[test]
fn kube_proxy_nftables_and_kpr_agree() {
    differential("nftables");
}

/// `--service-proxy-name kpr` beside the running kube-proxy (iptables mode) on one node: kpr
/// serves the Services labelled `service.kubernetes.io/service-proxy-name: kpr`, kube-proxy
/// (which skips labelled Services) the rest, and neither touches the other's. Labelling a
/// Service moves its new connections to kpr while a connection kube-proxy translated keeps
/// working; removing the label moves it back. Who translated a connection: kpr counts each at
/// its socket (`translated`).
#[test]
fn a_service_moves_to_kpr_by_its_label_and_back_with_kube_proxy_beside() {
    use std::io::{BufRead as _, BufReader, Write as _};
    let cluster = Cluster::start("kp-canary").expect("control plane");
    let mut h = Harness::new("kpcan", &PODS[..2]).expect("harness");
    h.kubeconfig = Some(cluster.admin_kubeconfig.clone());
    h.agent_args = vec!["--service-proxy-name".into(), "kpr".into()];
    let pod_ips: Vec<IpAddr> = h.topology.pods.iter().map(|p| p.ip.into()).collect();
    let http = [("http", POD_PORT, "TCP")];
    // A Service and its slice, labelled for kpr or not (the EndpointSlice controller copies
    // the Service's labels to its slices).
    let service = |name: &str, kpr: bool| {
        let label = if kpr { "\n    service.kubernetes.io/service-proxy-name: kpr" } else { "" };
        let slice = testbed::slice_manifest("test", name, &format!("{name}-abc12"), &pod_ips, &http);
        let slice = if kpr {
            slice.replace(
                "    kubernetes.io/service-name:",
                "    service.kubernetes.io/service-proxy-name: kpr\n    kubernetes.io/service-name:",
            )
        } else {
            slice
        };
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: test\n  labels:\n    app: {name}{label}\n\
             spec:\n  ports: [{{name: http, port: 80, targetPort: {POD_PORT}}}]\n---\n{slice}"
        )
    };
    cluster.apply("apiVersion: v1\nkind: Namespace\nmetadata: {name: test}\n").unwrap();
    cluster.apply(&format!("{}---\n{}", service("web", false), service("canary", true))).unwrap();
    let applied = unix_now();
    let (web, canary) = (cluster.cluster_ip("test", "web").unwrap(), cluster.cluster_ip("test", "canary").unwrap());
    let mut kube_proxy =
        KubeProxy::start(&cluster, &h.topology.client, "iptables", "kp-node", "veth0").expect("kube-proxy");
    h.start_agent().unwrap();
    h.wait(&format!("{canary}:80/TCP"), Some(2)).unwrap();
    kube_proxy.wait_synced_after(applied, Duration::from_secs(60)).unwrap();
    h.wait(&format!("{web}:80/TCP"), None).expect("web is kube-proxy's");

    // One connection through whoever serves `ip` (this process is in kpr's cgroup): the pod
    // that answered, and whether kpr translated it.
    let ask = |ip: std::net::Ipv4Addr| {
        let before = h.counter("translated");
        let (name, _) = h.client(move || testbed::tcp_ask_peer(SocketAddrV4::new(ip, 80), PROBE_TIMEOUT)).unwrap();
        (name.starts_with("pod-"), h.counter("translated") > before)
    };
    assert_eq!(ask(web), (true, false), "web: answered, through kube-proxy");
    assert_eq!(ask(canary), (true, true), "canary: answered, through kpr");

    // A connection kube-proxy translated, held open across the move.
    let held = h
        .client(move || std::net::TcpStream::connect_timeout(&SocketAddrV4::new(web, 80).into(), PROBE_TIMEOUT))
        .unwrap();
    held.set_read_timeout(Some(PROBE_TIMEOUT)).unwrap();
    let mut held_reader = BufReader::new(held.try_clone().unwrap());
    let mut line = String::new();
    held_reader.read_line(&mut line).unwrap();

    // web labelled for kpr: kpr programs it, kube-proxy drops its rules.
    cluster.apply(&service("web", true)).unwrap();
    let moved = unix_now();
    h.wait(&format!("{web}:80/TCP"), Some(2)).unwrap();
    kube_proxy.wait_synced_after(moved, Duration::from_secs(60)).unwrap();
    assert_eq!(ask(web), (true, true), "web, labelled: through kpr");
    (&held).write_all(b"peer?\n").unwrap();
    line.clear();
    held_reader.read_line(&mut line).unwrap();
    assert!(!line.trim().is_empty(), "the connection kube-proxy translated still carries data");

    // The label removed: back to kube-proxy.
    cluster.apply(&service("web", false)).unwrap();
    let back = unix_now();
    h.wait(&format!("{web}:80/TCP"), None).expect("kpr lets web go with its label");
    kube_proxy.wait_synced_after(back, Duration::from_secs(60)).unwrap();
    assert_eq!(ask(web), (true, false), "web, unlabelled again: through kube-proxy");
    assert_eq!(ask(canary), (true, true), "canary stays kpr's");
    assert!(kube_proxy.running(), "kube-proxy exited:\n{}", kube_proxy.log_tail());
}
