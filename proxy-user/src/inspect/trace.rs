//! `kpr trace SRC DST:PORT/PROTO`: what the datapath does with a new connection, decided the
//! way the programs decide it (`proxy-ebpf`: `sock_lb::forward4`, `tc::nat::lookup_frontend`,
//! `new_flow`) and looked up in the live pinned maps: which path handles it, which frontend
//! entry matches, which policy applies, the candidate endpoints, masquerade, and the verdict.
use std::{fmt::Write as _, net::IpAddr, path::Path, str::FromStr};

use anyhow::{Context as _, Result, bail};
use proxy_common::{
    IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, NODE_ADDR_LOCAL, NODE_ADDR_NODEPORT, PROTO_ANY, SCOPE_EXTERNAL, SCOPE_NODE,
    SCOPE_POD, SERVICE_FLAG_DROP_NO_ENDPOINTS, SERVICE_FLAG_EXTERNAL_ADDR, SERVICE_FLAG_SNAT, SERVICE_FLAG_SOCKET_SKIP,
    SERVICE_FLAG_SOURCE_RANGES, ServiceKey,
};
use serde::Serialize;

use super::services::PortView;
use crate::datapath::{
    Programmed,
    bpf::{self, BpfMaps, NodeView},
    read_programmed,
};
use crate::model::cidr::Cidr;

/// Where a connection comes from, as kube-proxy tells sources apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum From {
    /// A pod on this node.
    Pod,
    /// The node itself (a process in the node's network namespace).
    Node,
    /// Anywhere else: another node, a load balancer, a client outside the cluster.
    External,
}

/// `10.96.0.10:80/TCP`, `[fd00::10]:80/TCP`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Destination {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
}

impl FromStr for Destination {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let (addr_port, proto) = s.split_once('/').unwrap_or((s, "TCP"));
        let (addr, port) = addr_port.rsplit_once(':').context("expected ADDRESS:PORT[/TCP|UDP|SCTP]")?;
        let proto = match proto.to_ascii_uppercase().as_str() {
            "TCP" => IPPROTO_TCP,
            "UDP" => IPPROTO_UDP,
            "SCTP" => IPPROTO_SCTP,
            other => bail!("protocol `{other}`: TCP, UDP or SCTP"),
        };
        let addr = addr.trim_start_matches('[').trim_end_matches(']');
        Ok(Self { addr: addr.parse().context("address")?, port: port.parse().context("port")?, proto })
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TraceReport {
    pub source: IpAddr,
    pub destination: String,
    pub from: From,
    /// Why the source counts as `from`.
    pub from_reason: String,
    /// `socket` (the cgroup connect/sendmsg hooks) or `per-packet` (tc on the node's links).
    pub path: &'static str,
    /// The frontend entry that matches, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frontend: Option<PortView>,
    /// What the datapath checks, in order, and what it finds.
    pub steps: Vec<String>,
    /// Endpoints a new connection may go to.
    pub candidates: Vec<String>,
    /// Per-packet path: the endpoint sees the node's address instead of the source's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade: Option<bool>,
    pub verdict: String,
}

fn contains(cidrs: &[Cidr], ip: IpAddr) -> bool {
    cidrs.iter().any(|c| c.contains(ip))
}

/// Where `source` comes from, as the programs classify it (`tc::nat::source_scope`).
fn classify(node: &NodeView, source: IpAddr) -> (From, String) {
    if node.node_addrs.get(&source).is_some_and(|f| f & NODE_ADDR_LOCAL != 0) {
        return (From::Node, format!("{source} is one of this node's addresses"));
    }
    if contains(&node.local_cidrs, source) {
        return (From::Pod, format!("{source} is in the local-traffic detector's CIDRs"));
    }
    (From::External, format!("{source} is neither this node's address nor in the local-traffic detector's CIDRs"))
}

pub fn trace(pin_root: &Path, source: IpAddr, dst: Destination, from: Option<From>) -> Result<TraceReport> {
    let node = bpf::read_node_view(pin_root)?;
    let programmed = read_programmed(&BpfMaps::open_pinned(pin_root)?)?;
    let (from, from_reason) = match from {
        Some(f) => (f, "given with --from".to_owned()),
        None => classify(&node, source),
    };
    let scope = match from {
        From::Pod => SCOPE_POD,
        From::Node => SCOPE_NODE,
        From::External => SCOPE_EXTERNAL,
    };
    // The kernel runs no socket hook for SCTP: a pod's SCTP is translated per packet, at the
    // node's side of its link.
    let socket = from != From::External && dst.proto != IPPROTO_SCTP;
    let proto_name = proxy_common::proto_name(dst.proto);
    let mut report = TraceReport {
        source,
        destination: format!("{}/{proto_name}", std::net::SocketAddr::new(dst.addr, dst.port)),
        from,
        from_reason,
        path: if socket { "socket" } else { "per-packet" },
        frontend: None,
        steps: Vec::new(),
        candidates: Vec::new(),
        masquerade: None,
        verdict: String::new(),
    };
    let key = |addr: IpAddr, port: u16, proto: u8| ServiceKey { addr: addr.into(), port: port.to_be(), proto, scope };
    let exact = key(dst.addr, dst.port, dst.proto);
    let node_port = node.node_addrs.get(&dst.addr).is_some_and(|f| f & NODE_ADDR_NODEPORT != 0);
    let found = match programmed.get(&exact) {
        Some(entry) => {
            report.steps.push("frontend: an entry for this address, port and source class".into());
            Some((exact, entry))
        }
        None if node_port => {
            let any_addr = ServiceKey { addr: exact.addr.unspecified_like(), ..exact };
            report.steps.push(format!("{} is a NodePort address of this node: the NodePort entry", dst.addr));
            programmed.get(&any_addr).map(|e| (any_addr, e))
        }
        None => None,
    };
    let Some((key, entry)) = found else {
        report.verdict = miss(&node, &programmed, dst.addr, &mut report.steps);
        return Ok(report);
    };
    report.frontend = Some(PortView::new(&key, entry));
    if from == From::Node && dst.proto == IPPROTO_SCTP {
        report.path = "none";
        report.verdict = "not translated: the kernel runs no socket hook for SCTP, and the node's own packets \
                          meet kpr's per-packet path only on their way out (a deviation: docs/behaviour.md)"
            .into();
        return Ok(report);
    }
    report.verdict = verdict(&mut report, entry, socket, dst.proto);
    Ok(report)
}

/// No entry: a refused service range (nftables mode's rule) still covers the address.
fn miss(
    node: &NodeView,
    programmed: &std::collections::BTreeMap<ServiceKey, Programmed>,
    addr: IpAddr,
    steps: &mut Vec<String>,
) -> String {
    steps.push("frontend: no entry for this address, port and source class".into());
    // Any-port entries exist only when the service range is refused.
    let refused = programmed.keys().any(|k| k.proto == PROTO_ANY);
    if !refused || !contains(&node.service_cidrs, addr) {
        return "not a service: passed untouched".into();
    }
    let any = ServiceKey { addr: addr.into(), port: 0, proto: PROTO_ANY, scope: SCOPE_POD };
    if programmed.contains_key(&any) {
        steps.push("service range: a ClusterIP's port that no service port has".into());
        "rejected (TCP reset / ICMP port unreachable; ECONNREFUSED on the socket path)".into()
    } else {
        steps.push("service range: an address of it that no service has".into());
        "dropped".into()
    }
}

fn verdict(report: &mut TraceReport, entry: &Programmed, socket: bool, proto: u8) -> String {
    let value = &entry.value;
    let steps = &mut report.steps;
    let mut socket = socket;
    if socket && value.flags & SERVICE_FLAG_SOCKET_SKIP != 0 {
        steps.push(
            "the socket path steps aside for this entry where the per-packet path covers the pods' links \
             (e.g. a pod reaching itself): the per-packet path translates it"
                .into(),
        );
        report.path = "socket, then per-packet";
        socket = false;
    }
    if value.affinity_timeout != 0 {
        steps.push(format!(
            "sessionAffinity ClientIP: a client that got a connection in the last {}s keeps its endpoint",
            value.affinity_timeout
        ));
    }
    if socket && value.flags & SERVICE_FLAG_EXTERNAL_ADDR != 0 {
        steps.push("an externalIP or LoadBalancer IP: the agent's own sockets are not translated to it".into());
    }
    if value.flags & SERVICE_FLAG_SOURCE_RANGES != 0 {
        let allowed = contains(&entry.source_ranges, report.source);
        steps.push(format!(
            "loadBalancerSourceRanges: {} is {}in them",
            report.source,
            if allowed { "" } else { "not " }
        ));
        if !allowed {
            return "dropped (source not in loadBalancerSourceRanges)".into();
        }
    }
    if entry.backends.is_empty() {
        let drop = value.flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0;
        steps.push(if drop {
            "no usable endpoints for this source class (traffic policy Local without a local endpoint): DROP".into()
        } else {
            "the service has no endpoints: REJECT".into()
        });
        return match (drop, socket) {
            (true, true) => "dropped (connect() fails: EPERM, or a TCP connect from the node times out)".into(),
            (true, false) => "dropped".into(),
            (false, true) => "rejected: connect() fails with ECONNREFUSED".into(),
            (false, false) if proto == IPPROTO_TCP => "rejected with a TCP reset".into(),
            (false, false) => "rejected with ICMP port unreachable".into(),
        };
    }
    report.candidates = super::services::backends(entry);
    let n = report.candidates.len();
    if socket {
        steps.push(format!("endpoint: one of {n} at random when the socket connects (or sends, for UDP)"));
        steps.push(format!(
            "no packet is rewritten: the socket talks to the endpoint directly and the endpoint sees {}",
            report.source
        ));
    } else {
        steps.push(if value.flags & proxy_common::SERVICE_FLAG_MAGLEV != 0 {
            format!(
                "endpoint: one of {n} by Maglev: the slot of a hash of the connection's addresses and ports, \
                 seeded alike on every node, in this frontend's table (the same endpoint on every node with the same endpoints)"
            )
        } else {
            format!("endpoint: one of {n} by a hash of the connection's addresses and ports")
        });
        let hairpin = report.candidates.iter().any(|c| c.starts_with(&format!("{}:", report.source)));
        let masquerade = value.flags & SERVICE_FLAG_SNAT != 0 || hairpin;
        report.masquerade = Some(masquerade);
        steps.push(if masquerade {
            let why = if hairpin && value.flags & SERVICE_FLAG_SNAT == 0 { " (hairpin)" } else { "" };
            format!("masqueraded{why}: the endpoint sees the node's address on the link toward it")
        } else if value.flags & proxy_common::SERVICE_FLAG_DSR != 0 {
            format!(
                "direct server return: not masqueraded, the endpoint sees {}; an endpoint on another node gets \
                 the client's packets in IP-in-IP and its node answers the client directly",
                report.source
            )
        } else {
            format!("not masqueraded: the endpoint sees {}", report.source)
        });
    }
    format!("to one of {n} endpoints")
}

pub fn text(r: &TraceReport) -> String {
    let mut out = String::new();
    let from = serde_json::to_value(r.from).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    let _ = writeln!(out, "{} -> {} from {from} ({})", r.source, r.destination, r.from_reason);
    let _ = writeln!(out, "  path: {}", r.path);
    if let Some(frontend) = &r.frontend {
        let _ = writeln!(out, "  entry: {}", frontend.line());
    }
    for step in &r.steps {
        let _ = writeln!(out, "  - {step}");
    }
    let _ = writeln!(out, "  verdict: {}", r.verdict);
    out
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn destinations_parse() {
        let d: Destination = "10.96.0.10:53/udp".parse().unwrap();
        assert_eq!((d.addr, d.port, d.proto), (Ipv4Addr::new(10, 96, 0, 10).into(), 53, IPPROTO_UDP));
        assert_eq!("10.96.0.10:80".parse::<Destination>().unwrap().proto, IPPROTO_TCP);
        assert_eq!("10.96.0.10:80/sctp".parse::<Destination>().unwrap().proto, IPPROTO_SCTP);
        assert!("10.96.0.10:80/DCCP".parse::<Destination>().is_err());
        let v6: Destination = "[fd00::10]:80/tcp".parse().unwrap();
        assert_eq!(v6.addr, "fd00::10".parse::<IpAddr>().unwrap());
        assert!("10.96.0.10".parse::<Destination>().is_err());
    }

    #[test]
    fn sources_are_classified_like_the_programs_do() {
        let node = NodeView {
            node_addrs: [(Ipv4Addr::new(10, 0, 0, 1).into(), NODE_ADDR_LOCAL | NODE_ADDR_NODEPORT)].into(),
            local_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
            service_cidrs: vec![],
        };
        assert_eq!(classify(&node, Ipv4Addr::new(10, 0, 0, 1).into()).0, From::Node);
        assert_eq!(classify(&node, Ipv4Addr::new(10, 244, 3, 4).into()).0, From::Pod);
        assert_eq!(classify(&node, Ipv4Addr::new(10, 245, 0, 1).into()).0, From::External);
    }
}
