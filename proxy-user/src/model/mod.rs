//! kube-proxy's semantics as pure Rust: no I/O, no BPF, unit-tested.
//!
//! - [`service`]: a `v1/Service` → its service ports ([`ServicePort`]), skipping what
//!   kube-proxy skips (headless, ExternalName, other proxies) and rejecting malformed fields;
//! - [`endpoints`]: `EndpointSlice`s → endpoints per service port (port-name join, dedup across
//!   slices) and kube-proxy's `CategorizeEndpoints` (ready/serving/terminating, topology, local);
//! - [`desired`]: both together → the datapath's desired contents, one entry per
//!   frontend and source scope, with the backends kube-proxy would DNAT to;
//! - [`node`]: the node's links, addresses and `v1/Node` → where NodePorts are served, who is
//!   local, which links the per-packet path covers;
//! - [`socket_lb`]: which pods of the node the socket path leaves to the per-packet path;
//! - [`outliers`]: endpoints that stop answering, left out of new flows for a while (opt-in);
//! - [`maglev`]: Maglev lookup tables, the same on every node for the same endpoints.
pub mod cidr;
pub mod desired;
pub mod endpoints;
pub mod maglev;
pub mod node;
pub mod outliers;
pub mod service;
pub mod socket_lb;

use std::{fmt, net::IpAddr};

/// namespace/name of a Kubernetes object.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub namespace: String,
    pub name: String,
}

impl ObjectKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self { namespace: namespace.into(), name: name.into() }
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// From an IP protocol number (`IPPROTO_*`); None for one Services do not have.
    pub fn from_ipproto(proto: u8) -> Option<Self> {
        match proto {
            proxy_common::IPPROTO_TCP => Some(Self::Tcp),
            proxy_common::IPPROTO_UDP => Some(Self::Udp),
            proxy_common::IPPROTO_SCTP => Some(Self::Sctp),
            _ => None,
        }
    }

    /// Its IP protocol number (`IPPROTO_*`).
    pub fn ipproto(self) -> u8 {
        match self {
            Self::Tcp => proxy_common::IPPROTO_TCP,
            Self::Udp => proxy_common::IPPROTO_UDP,
            Self::Sctp => proxy_common::IPPROTO_SCTP,
        }
    }

    /// Kubernetes spelling; absent means TCP.
    pub fn parse(value: Option<&str>) -> Option<Self> {
        match value.unwrap_or("TCP") {
            "TCP" => Some(Self::Tcp),
            "UDP" => Some(Self::Udp),
            "SCTP" => Some(Self::Sctp),
            _ => None,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
            Self::Sctp => "SCTP",
        })
    }
}

/// kube-proxy's `ServicePortName`: a service and one of its ports, by port name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub service: ObjectKey,
    /// Port name; empty for a single unnamed port.
    pub port: String,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}/{}", self.service, self.protocol)
        } else {
            write!(f, "{}:{}/{}", self.service, self.port, self.protocol)
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TrafficPolicy {
    #[default]
    Cluster,
    Local,
}

/// One port of a Service, with everything kube-proxy keeps about it (`BaseServicePortInfo`).
/// The ClusterIP datapath uses `cluster_ips`/`port`/`protocol`; the rest is carried for the
/// NodePort/LoadBalancer/affinity datapaths.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    pub name: ServicePortName,
    pub cluster_ips: Vec<IpAddr>,
    pub port: u16,
    pub protocol: Protocol,
    pub node_port: Option<u16>,
    pub external_ips: Vec<IpAddr>,
    pub load_balancer_ips: Vec<IpAddr>,
    pub load_balancer_source_ranges: Vec<String>,
    pub session_affinity_timeout: Option<u32>,
    pub external_policy: TrafficPolicy,
    pub internal_policy: TrafficPolicy,
    pub health_check_node_port: Option<u16>,
}

impl ServicePort {
    /// Reachable from outside the cluster (NodePort, externalIPs, LoadBalancer): eTP applies.
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some() || !self.external_ips.is_empty() || !self.load_balancer_ips.is_empty()
    }
}

/// One endpoint of a service port, after the port-name join.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// `nodeName` equals this node.
    pub is_local: bool,
    /// `nodeName` is one of [`NodeInfo::down_nodes`].
    pub on_down_node: bool,
    /// The slice names the endpoint's node (`nodeName`).
    pub node_named: bool,
    /// Topology hints; `None` when the slice carries no hints of that kind.
    pub zone_hints: Option<Vec<String>>,
    pub node_hints: Option<Vec<String>>,
}

/// Where this agent runs: what "local" and topology mean.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// `topology.kubernetes.io/zone` label of the Node.
    pub zone: Option<String>,
    /// The node's addresses: every address on its links plus the Node object's (kube-proxy's
    /// `--src-type LOCAL`); loadBalancerSourceRanges holding one of them admit the node.
    pub addresses: Vec<IpAddr>,
    /// The cluster's service ranges (its ServiceCIDRs), when known: with the range refused,
    /// their ClusterIPs get an entry that rejects unknown ports.
    pub service_cidrs: Vec<cidr::Cidr>,
    /// Families whose local-traffic detector has no input (detectLocalMode ClusterCIDR or
    /// NodeCIDR without a CIDR of that family): kube-proxy's proxier of that family runs the
    /// no-op detector.
    pub undetected_families: Vec<IpFamily>,
    /// The cluster's Nodes whose Ready condition is not True (watched with `--abort-dead-tcp`
    /// only): TCP flows to their endpoints are ended.
    pub down_nodes: std::collections::BTreeSet<String>,
}

/// The parts of kube-proxy's configuration that shape the datapath entries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyOptions {
    /// `masqueradeAll`: masquerade every connection to a ClusterIP.
    pub masquerade_all: bool,
    /// A local-traffic detector is in force (`detectLocalMode` with its input present): pods it
    /// calls local are in-cluster clients, and ClusterIP traffic from any other source is
    /// masqueraded. Without one, nothing is in-cluster (kube-proxy's no-op detector).
    pub detect_local: bool,
    /// What no service port takes in the service range is refused, as kube-proxy's nftables
    /// mode does: an unknown port of a ClusterIP is rejected (and an unallocated address of
    /// the service range dropped, by the datapath). Also: the ServiceCIDRs are watched.
    pub refuse_service_range: bool,
    /// The node's own processes reach an externalIP or LoadBalancer IP that is not one of the
    /// node's addresses as it is (`--host-external-ips local`): no Service can take over the
    /// node's connections to other machines (CVE-2020-8554). Off: translated, as kube-proxy does.
    pub host_external_ips_local_only: bool,
    /// `--service-proxy-name`: serve only the Services (and slices) labelled
    /// `service.kubernetes.io/service-proxy-name` with this name, and leave the others to the
    /// kube-proxy beside it. None: kube-proxy's rule (no such label). Lives as long as the
    /// process (it comes from the command line).
    pub service_proxy_name: Option<&'static str>,
    /// `--abort-dead-tcp`: TCP flows to an endpoint that died are ended (see
    /// [`DesiredPort::alive`](desired::DesiredPort)); off, they are left as kube-proxy leaves them.
    pub abort_dead_tcp: bool,
    /// `--lb-algorithm maglev`: new flows from outside to external frontends (NodePorts,
    /// externalIPs, LoadBalancer IPs) pick their endpoint by Maglev (`SERVICE_FLAG_MAGLEV`),
    /// unless the Service's `kpr.io/lb-algorithm` says otherwise.
    pub maglev: bool,
    /// `--lb-mode`: how new flows from outside to external frontends with traffic policy
    /// Cluster reach endpoints on other nodes, unless the Service's `kpr.io/lb-mode` says
    /// otherwise.
    pub lb_mode: LbMode,
}

/// [`ProxyOptions::lb_mode`]: masquerade (kube-proxy's), direct server return, or DSR for TCP
/// only (`SERVICE_FLAG_DSR`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LbMode {
    #[default]
    Snat,
    Dsr,
    Hybrid,
}

impl LbMode {
    /// Does a frontend of `protocol` return directly?
    pub fn direct(self, protocol: Protocol) -> bool {
        match self {
            Self::Snat => false,
            Self::Dsr => true,
            Self::Hybrid => protocol == Protocol::Tcp,
        }
    }
}

/// An IP family. kube-proxy runs one proxier per family, and each sees a Service only through
/// its ClusterIP of that family (a single-stack Service is absent from the other family's
/// rules, NodePort included), its externalIPs, LoadBalancer IPs and source ranges of that
/// family, and the EndpointSlices of that `addressType`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    pub const ALL: [Self; 2] = [Self::V4, Self::V6];

    pub fn of(ip: &IpAddr) -> Self {
        if ip.is_ipv4() { Self::V4 } else { Self::V6 }
    }

    /// The EndpointSlice `addressType` of this family.
    pub fn address_type(self) -> &'static str {
        match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        }
    }

    /// `0.0.0.0` or `::`: the address of NodePort entries.
    pub fn unspecified(self) -> IpAddr {
        match self {
            Self::V4 => std::net::Ipv4Addr::UNSPECIFIED.into(),
            Self::V6 => std::net::Ipv6Addr::UNSPECIFIED.into(),
        }
    }

    /// The addresses of this family among `ips`, in order.
    pub fn filter<'a>(self, ips: impl IntoIterator<Item = &'a IpAddr>) -> Vec<IpAddr> {
        ips.into_iter().copied().filter(|ip| Self::of(ip) == self).collect()
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.address_type())
    }
}

/// Why an object (or part of one) was skipped; logged with the object's name and counted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    #[error("invalid IP address `{0}`")]
    InvalidIp(String),
    #[error("port {0} is out of range 1-65535")]
    InvalidPort(i32),
    #[error("unknown protocol `{0}`")]
    UnknownProtocol(String),
    #[error("the object has no name")]
    Unnamed,
    #[error("the slice has no `kubernetes.io/service-name` label")]
    NoServiceLabel,
}

/// `10.96.0.10:80/TCP` (`[fd00::10]:80/TCP`) as pods see it; the other scopes are marked
/// (`ext`: from outside, `node`: from the node); a NodePort shows as `*:30080/TCP ext`
/// (`[*]:30080/TCP ext` for IPv6).
pub fn display_key(key: &proxy_common::ServiceKey) -> impl fmt::Display {
    let proto = proxy_common::proto_name(key.proto);
    let addr = match (IpAddr::from(key.addr), key.addr.is_unspecified()) {
        (IpAddr::V4(_), true) => "*".to_owned(),
        (IpAddr::V6(_), true) => "[*]".to_owned(),
        (IpAddr::V4(a), false) => a.to_string(),
        (IpAddr::V6(a), false) => format!("[{a}]"),
    };
    let scope = match key.scope {
        proxy_common::SCOPE_POD => "",
        proxy_common::SCOPE_EXTERNAL => " ext",
        proxy_common::SCOPE_NODE => " node",
        _ => " ?",
    };
    format!("{addr}:{}/{proto}{scope}", u16::from_be(key.port))
}

#[cfg(test)]
pub(crate) mod tests {
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

    use super::*;

    pub fn service_yaml(body: &str) -> Service {
        serde_yaml::from_str(&format!("apiVersion: v1\nkind: Service\n{body}")).expect("valid Service yaml")
    }

    pub fn slice_yaml(body: &str) -> EndpointSlice {
        serde_yaml::from_str(&format!("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n{body}"))
            .expect("valid EndpointSlice yaml")
    }

    /// A plain ClusterIP service port (traffic policies Cluster).
    pub fn service_port() -> ServicePort {
        ServicePort {
            name: ServicePortName {
                service: ObjectKey::new("ns", "svc"),
                port: String::new(),
                protocol: Protocol::Tcp,
            },
            cluster_ips: vec!["10.96.0.1".parse().unwrap()],
            port: 80,
            protocol: Protocol::Tcp,
            node_port: None,
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            session_affinity_timeout: None,
            external_policy: TrafficPolicy::Cluster,
            internal_policy: TrafficPolicy::Cluster,
            health_check_node_port: None,
        }
    }
}
