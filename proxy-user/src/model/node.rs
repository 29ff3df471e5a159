//! The node as kube-proxy sees it: its links and local addresses (the kernel), its `v1/Node`
//! (zone, addresses, podCIDRs) and kube-proxy's configuration → where NodePorts are served,
//! which sources are the node or local pods, which links the per-packet path covers, and the
//! address masquerade falls back to. Pure: the agent feeds it what the host source reports.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr},
};

use k8s_openapi::api::core::v1::Node;
use proxy_common::{
    Addr, LINK_FLAG_LOCAL_TRAFFIC, LINK_FLAG_NOT_ETHERNET, LINK_FLAG_PEER, LINK_FLAG_RP_FILTER_LOOSE,
    LINK_FLAG_RP_FILTER_STRICT, LinkInfo, NODE_ADDR_LOCAL, NODE_ADDR_NODEPORT,
};

use super::{IpFamily, NodeInfo, cidr::Cidr};

/// The taint the cluster autoscaler puts on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// A network interface of the node, as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostLink {
    pub index: u32,
    pub name: String,
    pub loopback: bool,
    pub addrs: Vec<IpAddr>,
    /// IPv4 addresses of `addrs` that the kernel's source selection for a global destination
    /// passes over (`inet_select_addr`): scoped narrower than global (a link-scoped
    /// `169.254.x.y` of an unnumbered or gateway-style pod link, host-scoped `127.0.0.1`), or
    /// secondary.
    pub v4_unselectable: Vec<std::net::Ipv4Addr>,
    /// One end of a veth pair whose other end is in another network namespace (a pod's): that
    /// namespace's id as this one knows it (`IFLA_LINK_NETNSID`).
    pub peer_nsid: Option<i32>,
    /// Its packets carry an Ethernet header (not an IP-in-IP or other L3 tunnel's).
    pub ethernet: bool,
    /// IPv4 `rp_filter` in effect on the link (the larger of `all`'s and its own): 0 off,
    /// 1 strict, 2 loose.
    pub rp_filter: u8,
}

/// What kpr uses of the node's `v1/Node` object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeObject {
    /// `topology.kubernetes.io/zone` label.
    pub zone: Option<String>,
    /// `status.addresses`: InternalIPs first, then ExternalIPs (kube-proxy's order).
    pub addresses: Vec<IpAddr>,
    /// `spec.podCIDRs` (detectLocalMode NodeCIDR).
    pub pod_cidrs: Vec<Cidr>,
    /// Being deleted, or tainted `ToBeDeletedByClusterAutoscaler`: load balancers should
    /// drain it (`/healthz` answers 503).
    pub draining: bool,
}

impl NodeObject {
    pub fn from_node(node: &Node) -> Self {
        let labels = node.metadata.labels.as_ref();
        let zone = labels.and_then(|l| l.get("topology.kubernetes.io/zone")).cloned();
        let status_addrs = node.status.as_ref().and_then(|s| s.addresses.as_ref());
        let mut addresses = Vec::new();
        for kind in ["InternalIP", "ExternalIP"] {
            for a in status_addrs.into_iter().flatten().filter(|a| a.type_ == kind) {
                if let Ok(ip) = a.address.parse::<IpAddr>()
                    && !addresses.contains(&ip)
                {
                    addresses.push(ip);
                }
            }
        }
        let spec = node.spec.as_ref();
        let raw_cidrs = spec
            .and_then(|s| s.pod_cidrs.clone())
            .filter(|c| !c.is_empty())
            .or_else(|| spec.and_then(|s| s.pod_cidr.clone()).map(|c| vec![c]))
            .unwrap_or_default();
        let pod_cidrs = raw_cidrs.iter().filter_map(|c| c.parse().ok()).collect();
        let tainted =
            spec.and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
        let draining = node.metadata.deletion_timestamp.is_some() || tainted;
        Self { zone, addresses, pod_cidrs, draining }
    }
}

/// A Node whose `Ready` condition is there and not `True` (`False`: the kubelet says so;
/// `Unknown`: the node lifecycle controller stopped hearing from it): its endpoints are dead
/// for `--abort-dead-tcp`. A Node without the condition (just registered) is not down.
pub fn node_is_down(node: &Node) -> bool {
    let conditions = node.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.into_iter().flatten().any(|c| c.type_ == "Ready" && c.status != "True")
}

/// kube-proxy's local-traffic detector (`detectLocalMode` and its input).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DetectLocal {
    /// No detector: nothing is in-cluster.
    #[default]
    None,
    /// Sources inside these CIDRs (`clusterCIDR`).
    ClusterCidr(Vec<Cidr>),
    /// Sources inside the Node's `podCIDRs`.
    NodeCidr,
    /// Traffic arriving on this bridge.
    BridgeInterface(String),
    /// Traffic arriving on links whose name starts with this prefix.
    InterfaceNamePrefix(String),
}

impl DetectLocal {
    pub fn implemented(&self) -> bool {
        !matches!(self, Self::None)
    }
}

/// One entry of `nodePortAddresses`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddress {
    Cidr(Cidr),
    /// The node's primary IPs.
    Primary,
}

/// Which links get the per-packet programs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TcLinks {
    /// Every link but loopback, including links created later (kube-proxy sees every packet).
    #[default]
    All,
    /// Only these (`--interfaces`).
    Only(Vec<String>),
    /// The per-packet path is off.
    Off,
}

/// The settings that shape the node plan (from the KubeProxyConfiguration and flags).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeSettings {
    pub name: String,
    /// `nodePortAddresses`; empty: every local address.
    pub node_port_addresses: Vec<NodePortAddress>,
    pub detect_local: DetectLocal,
    /// `--node-ip`: addresses that are the node's even if no link holds them; the first is
    /// the primary address.
    pub node_ips: Vec<IpAddr>,
    /// `bindAddress` when it names an address (the primary address, as in kube-proxy).
    pub bind_address: Option<IpAddr>,
    pub tc_links: TcLinks,
    /// The cgroup the socket hooks are attached to, where pods that opt out of the socket
    /// path are looked for (the hooks heed them only where the per-packet path covers every
    /// link); None: not looked for.
    pub pod_cgroups: Option<std::path::PathBuf>,
}

/// The host side of the datapath, derived from the links, the Node and the settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePlan {
    /// Address (both families) → `NODE_ADDR_*`.
    pub node_addrs: BTreeMap<IpAddr, u32>,
    /// ifindex → link facts; 0 holds the fallback masquerade address.
    pub links: BTreeMap<u32, LinkInfo>,
    /// The detector's CIDRs (both families).
    pub local_cidrs: BTreeSet<Cidr>,
    /// ifindex → name of the links the per-packet programs go on.
    pub tc_links: BTreeMap<u32, String>,
    /// The external links among them, where `--xdp` puts its program: Ethernet links that
    /// hold a primary address (where NodePort traffic from outside comes in; a pod's veth
    /// holds none), not one the local-traffic detector names. A kind node's eth0 is a veth.
    pub xdp_links: BTreeMap<u32, String>,
    /// The primary IPv4 address (masquerade fallback, `nodePortAddresses: [primary]`).
    pub primary: Option<Ipv4Addr>,
    /// The cluster's service ranges (what no service port takes in them is refused by default);
    /// filled by the agent from the ServiceCIDR objects.
    pub service_cidrs: BTreeSet<Cidr>,
    /// What the service model needs of the node.
    pub info: NodeInfo,
    /// Endpoint → the source the node's own masqueraded connections to it are bound to
    /// ([`node_sources`]); filled by the agent from the routes to this node's endpoints.
    pub node_sources: BTreeMap<IpAddr, IpAddr>,
    /// Pods whose sockets the socket path leaves alone: cgroup id → its level; filled by the
    /// agent from the pods' annotations and the cgroup hierarchy.
    pub socket_skip: BTreeMap<u64, u32>,
    /// The pods' network namespaces behind the links (ifindex → the namespace's cookie), filled
    /// by the agent; None: it could not tell (no namespace could be entered), and the socket
    /// path takes every pod's link as covered.
    pub pod_netns: Option<BTreeMap<u32, u64>>,
    /// Namespaces nested in pods that opted out of the socket path, leaving by a pod's link
    /// (ifindex, the nested namespace's cookie): covered as that link is.
    pub nested_netns: Vec<(u32, u64)>,
}

/// The kernel's route toward an address (RTM_GETROUTE), as a socket connecting there gets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelRoute {
    /// The link it leaves by.
    pub link: u32,
    /// The source address routing picks for it (a connect() from the node gets this one).
    pub source: Option<IpAddr>,
    /// The address is the node's own (delivered locally, never masqueraded).
    pub local: bool,
}

/// The sources the node's own masqueraded connections must be bound to, per endpoint: where
/// routing toward the endpoint picks another source than MASQUERADE would
/// (`inet_select_addr(out, next hop, RT_SCOPE_UNIVERSE)`: the link's masquerade address in
/// `links`, else the fallback at 0). That is a pod behind a link whose only IPv4 address is
/// link-scoped: a route of scope link takes that address, MASQUERADE passes over it. kube-proxy
/// DNATs the node's connection and masquerades it on its way out; the socket path translates
/// it before routing, so it binds the source MASQUERADE would have written. IPv4 only: for
/// IPv6, MASQUERADE and the socket both take `ipv6_dev_get_saddr` on the same link.
pub fn node_sources(
    routes: impl IntoIterator<Item = (IpAddr, KernelRoute)>,
    links: &BTreeMap<u32, LinkInfo>,
) -> BTreeMap<IpAddr, IpAddr> {
    let masquerade = |link: u32| [link, 0].into_iter().find_map(|i| links.get(&i).map(|l| l.addr).filter(|a| *a != 0));
    let mut out = BTreeMap::new();
    for (endpoint, route) in routes {
        if !endpoint.is_ipv4() || route.local {
            continue;
        }
        let Some(masquerade) = masquerade(route.link).map(|a| IpAddr::from(Ipv4Addr::from(u32::from_be(a)))) else {
            continue;
        };
        if route.source != Some(masquerade) {
            if out.len() == proxy_common::defaults::MAX_NODE_SOURCES as usize {
                tracing::warn!(%endpoint, "more endpoints need a masquerade source than the map holds; skipped");
                continue;
            }
            out.insert(endpoint, masquerade);
        }
    }
    out
}

/// The plan for the node. The primary address is `--node-ip`, else `bindAddress`, else the
/// Node's first address (kube-proxy's node IP), else the first address of a non-loopback link.
pub fn plan(links: &[HostLink], node: Option<&NodeObject>, settings: &NodeSettings) -> NodePlan {
    let link_addrs = links.iter().flat_map(|l| l.addrs.iter().copied());
    let node_addrs_obj = node.map(|n| n.addresses.as_slice()).unwrap_or_default();
    // The primary address of each family (kube-proxy's node IPs, one per family). Only the
    // primary family falls back to a link's address; kube-proxy gives the other family none
    // it can serve NodePorts on.
    let configured = || {
        let given = settings.node_ips.iter().copied().chain(settings.bind_address.filter(|a| !a.is_unspecified()));
        given.chain(node_addrs_obj.iter().copied())
    };
    let primary_family = configured().next().as_ref().map_or(IpFamily::V4, IpFamily::of);
    let primary_of = |family: IpFamily| {
        let link_addrs = links.iter().filter(|l| !l.loopback).flat_map(|l| &l.addrs).copied();
        let first_link = link_addrs.filter(|_| family == primary_family).find(|a| IpFamily::of(a) == family);
        configured().chain(first_link).find(|a| IpFamily::of(a) == family)
    };
    let primaries = [primary_of(IpFamily::V4), primary_of(IpFamily::V6)];
    let primary = match primaries[0] {
        Some(IpAddr::V4(a)) => Some(a),
        _ => None,
    };

    let mut addresses: Vec<IpAddr> = Vec::new();
    for a in link_addrs.chain(node_addrs_obj.iter().copied()).chain(settings.node_ips.iter().copied()) {
        if !addresses.contains(&a) {
            addresses.push(a);
        }
    }
    let local: BTreeSet<IpAddr> = links.iter().flat_map(|l| l.addrs.iter().copied()).collect();
    let serves_node_ports = |a: &IpAddr| {
        // Loopback NodePorts are localhostNodePorts' business (the socket path), never here.
        if a.is_loopback() {
            return false;
        }
        if settings.node_port_addresses.is_empty() {
            return true;
        }
        settings.node_port_addresses.iter().any(|npa| match npa {
            NodePortAddress::Cidr(c) => c.contains(*a),
            NodePortAddress::Primary => primaries.contains(&Some(*a)),
        })
    };
    let mut node_addrs = BTreeMap::new();
    for a in &addresses {
        let mut flags = 0;
        if local.contains(a) || settings.node_ips.contains(a) {
            flags |= NODE_ADDR_LOCAL;
        }
        if serves_node_ports(a) {
            flags |= NODE_ADDR_NODEPORT;
        }
        if flags != 0 {
            node_addrs.insert(*a, flags);
        }
    }

    let local_traffic_link = |name: &str| match &settings.detect_local {
        DetectLocal::BridgeInterface(bridge) => name == bridge,
        DetectLocal::InterfaceNamePrefix(prefix) => name.starts_with(prefix.as_str()),
        _ => false,
    };
    let mut link_info = BTreeMap::new();
    // The IPv4 masquerade source of a link, as MASQUERADE picks it
    // (`inet_select_addr(out, next hop, RT_SCOPE_UNIVERSE)`): its first primary address of
    // global scope.
    let masquerade_v4 = |link: &HostLink| {
        link.addrs.iter().find_map(|a| match a {
            IpAddr::V4(v4) if !v4.is_loopback() && !link.v4_unselectable.contains(v4) => Some(*v4),
            _ => None,
        })
    };
    // The IPv6 masquerade source of a link: its first address MASQUERADE could pick (not
    // link-local: a backend elsewhere could not answer it).
    let masquerade_v6 = |addrs: &mut dyn Iterator<Item = &IpAddr>| {
        addrs.copied().find(|a| matches!(a, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 != 0xfe80))
    };
    // A link without one (a pod's veth with only fe80::, as Calico sets them up): MASQUERADE
    // takes the kernel's source address selection, which, with no rule of RFC 6724 telling
    // the node's addresses apart, keeps the first in the kernel's order (links by index, the
    // newest address of a link first: getifaddrs' order). Then the IPv6 node IP.
    let non_loopback = || links.iter().filter(|l| !l.loopback).flat_map(|l| &l.addrs);
    let fallback_v6 = masquerade_v6(&mut non_loopback()).or(primaries[1]);
    // A link without one: the kernel's next choice, the first such address of any link in its
    // order (by index; a global address on `lo` counts); then the primary.
    let fallback_v4 = links.iter().find_map(masquerade_v4).or(primary);
    link_info.insert(
        0,
        LinkInfo {
            addr: fallback_v4.map_or(0, |p| u32::from(p).to_be()),
            flags: 0,
            addr6: fallback_v6.map(Addr::from).unwrap_or_default(),
        },
    );
    let (mut tc_links, mut xdp_links) = (BTreeMap::new(), BTreeMap::new());
    for link in links.iter().filter(|l| !l.loopback && l.index != 0) {
        let addr = masquerade_v4(link).map(|a| u32::from(a).to_be());
        let addr6 = masquerade_v6(&mut link.addrs.iter()).map(Addr::from).unwrap_or_default();
        let flags = if local_traffic_link(&link.name) { LINK_FLAG_LOCAL_TRAFFIC } else { 0 }
            | if link.peer_nsid.is_some() { LINK_FLAG_PEER } else { 0 }
            | if link.ethernet { 0 } else { LINK_FLAG_NOT_ETHERNET }
            | match link.rp_filter {
                1 => LINK_FLAG_RP_FILTER_STRICT,
                2 => LINK_FLAG_RP_FILTER_LOOSE,
                _ => 0,
            };
        link_info.insert(link.index, LinkInfo { addr: addr.unwrap_or(0), flags, addr6 });
        let covered = match &settings.tc_links {
            TcLinks::All => true,
            TcLinks::Only(names) => names.contains(&link.name),
            TcLinks::Off => false,
        };
        if covered {
            tc_links.insert(link.index, link.name.clone());
            let external = flags & (LINK_FLAG_LOCAL_TRAFFIC | LINK_FLAG_NOT_ETHERNET) == 0
                && link.addrs.iter().any(|a| primaries.contains(&Some(*a)));
            if external {
                xdp_links.insert(link.index, link.name.clone());
            }
        }
    }

    let local_cidrs = match &settings.detect_local {
        DetectLocal::ClusterCidr(cidrs) => cidrs.iter().copied().collect(),
        DetectLocal::NodeCidr => node.into_iter().flat_map(|n| &n.pod_cidrs).copied().collect(),
        _ => BTreeSet::new(),
    };
    let by_cidr = matches!(settings.detect_local, DetectLocal::ClusterCidr(_) | DetectLocal::NodeCidr);
    let undetected_families = IpFamily::ALL
        .into_iter()
        .filter(|f| by_cidr && !local_cidrs.iter().any(|c| c.is_ipv4() == (*f == IpFamily::V4)))
        .collect();
    let info = NodeInfo {
        name: settings.name.clone(),
        zone: node.and_then(|n| n.zone.clone()),
        addresses,
        service_cidrs: Vec::new(),
        undetected_families,
        down_nodes: Default::default(),
    };
    NodePlan {
        node_addrs,
        links: link_info,
        local_cidrs,
        tc_links,
        xdp_links,
        primary,
        info,
        service_cidrs: BTreeSet::new(),
        node_sources: BTreeMap::new(),
        socket_skip: BTreeMap::new(),
        pod_netns: None,
        nested_netns: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, addrs: &[&str]) -> HostLink {
        HostLink {
            index,
            name: name.into(),
            loopback: name == "lo",
            addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
            // As the kernel reports them: link-local IPv4 addresses with scope link.
            v4_unselectable: addrs
                .iter()
                .filter_map(|a| a.parse::<Ipv4Addr>().ok())
                .filter(|a| a.is_link_local() || a.is_loopback())
                .collect(),
            peer_nsid: name.starts_with("veth").then_some(0),
            ethernet: !name.starts_with("tunl"),
            rp_filter: 0,
        }
    }

    fn host() -> Vec<HostLink> {
        vec![
            link(1, "lo", &["127.0.0.1", "::1"]),
            link(2, "eth0", &["192.168.0.2", "fd00::2"]),
            link(3, "eth1", &["172.16.0.2"]),
            link(4, "cni0", &["10.244.0.1"]),
            link(5, "vethabc", &[]),
        ]
    }

    fn nodeports(plan: &NodePlan) -> Vec<String> {
        plan.node_addrs.iter().filter(|(_, f)| *f & NODE_ADDR_NODEPORT != 0).map(|(a, _)| a.to_string()).collect()
    }

    #[test]
    fn xdp_goes_on_the_links_of_the_primary_addresses_only() {
        let node = NodeObject { addresses: vec!["192.168.0.2".parse().unwrap()], ..Default::default() };
        let settings = NodeSettings { name: "n".into(), ..Default::default() };
        let p = plan(&host(), Some(&node), &settings);
        // Not eth1 (no primary address), cni0 (the pods' bridge), a pod's veth, nor lo.
        assert_eq!(p.xdp_links.values().collect::<Vec<_>>(), ["eth0"]);
        // A kind node's eth0 is a veth.
        let mut kind = host();
        kind[1].peer_nsid = Some(0);
        assert_eq!(plan(&kind, Some(&node), &settings).xdp_links.values().collect::<Vec<_>>(), ["eth0"]);
        // The primary on a link the detector calls local: none.
        let settings =
            NodeSettings { detect_local: DetectLocal::InterfaceNamePrefix("eth".into()), ..settings.clone() };
        assert!(plan(&host(), Some(&node), &settings).xdp_links.is_empty());
        // Nor a link kpr is not on.
        let settings = NodeSettings { tc_links: TcLinks::Only(vec!["eth1".into()]), ..Default::default() };
        assert!(plan(&host(), Some(&node), &settings).xdp_links.is_empty());
    }

    #[test]
    fn node_ports_on_every_local_address_by_default_and_within_node_port_addresses() {
        let settings = NodeSettings { name: "n".into(), ..Default::default() };
        let node = NodeObject { addresses: vec!["192.168.0.2".parse().unwrap()], ..Default::default() };
        let p = plan(&host(), Some(&node), &settings);
        assert_eq!(nodeports(&p), ["10.244.0.1", "172.16.0.2", "192.168.0.2", "fd00::2"]);
        assert_eq!(p.node_addrs[&"::1".parse().unwrap()], NODE_ADDR_LOCAL, "IPv6 loopback: local, no NodePort");
        assert_eq!(p.node_addrs[&"127.0.0.1".parse().unwrap()], NODE_ADDR_LOCAL, "loopback: local, no NodePort");
        assert_eq!(p.primary, Some("192.168.0.2".parse().unwrap()));
        assert_eq!(p.tc_links.values().collect::<Vec<_>>(), ["eth0", "eth1", "cni0", "vethabc"]);

        let settings = NodeSettings {
            node_port_addresses: vec![NodePortAddress::Cidr("172.16.0.0/12".parse().unwrap())],
            ..settings
        };
        assert_eq!(nodeports(&plan(&host(), Some(&node), &settings)), ["172.16.0.2"]);
        let settings = NodeSettings { node_port_addresses: vec![NodePortAddress::Primary], ..settings };
        assert_eq!(nodeports(&plan(&host(), Some(&node), &settings)), ["192.168.0.2"]);
        // `primary` is the node IP of each family: an IPv6 one only when the node has one
        // (kube-proxy takes no link address for its second family).
        let dual =
            NodeObject { addresses: vec!["192.168.0.2".parse().unwrap(), "fd00::2".parse().unwrap()], ..node.clone() };
        assert_eq!(nodeports(&plan(&host(), Some(&dual), &settings)), ["192.168.0.2", "fd00::2"]);
        let with_loopback = vec![NodePortAddress::Cidr("127.0.0.0/8".parse().unwrap()), NodePortAddress::Primary];
        let settings = NodeSettings { node_port_addresses: with_loopback, ..settings };
        assert_eq!(nodeports(&plan(&host(), Some(&node), &settings)), ["192.168.0.2"]);
        // An address that appears later is served when it falls inside the CIDRs.
        let settings = NodeSettings {
            node_port_addresses: vec![NodePortAddress::Cidr("172.16.0.0/12".parse().unwrap())],
            ..settings
        };
        let mut later = host();
        later.push(link(9, "eth2", &["172.20.0.9"]));
        assert_eq!(nodeports(&plan(&later, Some(&node), &settings)), ["172.16.0.2", "172.20.0.9"]);
    }

    #[test]
    fn ipv6_masquerade_source_of_a_link_is_its_own_address_else_the_kernels_first_choice() {
        // upstream's node: 2001:db8::1 is the node IP, 2001:db8:1::2 was added after it (the
        // kernel lists it first); the pod's veth has a link-local address only.
        let links = vec![
            link(1, "lo", &["127.0.0.1", "::1"]),
            link(2, "eth0", &["192.168.0.2", "2001:db8:1::2", "2001:db8::1", "fe80::5"]),
            link(3, "vp0", &["fe80::1"]),
            link(4, "cni0", &["fd00:10:244::1"]),
        ];
        let node = NodeObject {
            addresses: vec!["192.168.0.2".parse().unwrap(), "2001:db8::1".parse().unwrap()],
            ..Default::default()
        };
        let p = plan(&links, Some(&node), &NodeSettings { name: "n".into(), ..Default::default() });
        let addr6 = |index: u32| IpAddr::from(p.links[&index].addr6);
        assert_eq!(addr6(2), "2001:db8:1::2".parse::<IpAddr>().unwrap(), "a link's own first global address");
        assert_eq!(addr6(4), "fd00:10:244::1".parse::<IpAddr>().unwrap());
        assert!(p.links[&3].addr6.is_unspecified(), "fe80:: is never a masquerade source");
        assert_eq!(addr6(0), "2001:db8:1::2".parse::<IpAddr>().unwrap(), "the fallback: as MASQUERADE picks");
        // Without any global IPv6 address on a link: the IPv6 node IP.
        let bare = vec![link(1, "lo", &["::1"]), link(2, "eth0", &["192.168.0.2"])];
        let p = plan(&bare, Some(&node), &NodeSettings { name: "n".into(), ..Default::default() });
        assert_eq!(IpAddr::from(p.links[&0].addr6), "2001:db8::1".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn a_node_being_deleted_or_marked_for_deletion_is_draining() {
        let node = |extra: &str| {
            let yaml = format!("metadata: {{name: n1{extra}}}\nspec: {{taints: [{{key: other, effect: NoSchedule}}]}}");
            NodeObject::from_node(&serde_yaml::from_str(&yaml).unwrap())
        };
        assert!(!node("").draining);
        assert!(node(", deletionTimestamp: '2026-01-01T00:00:00Z'").draining);
        let tainted: k8s_openapi::api::core::v1::Node = serde_yaml::from_str(
            "metadata: {name: n1}\nspec: {taints: [{key: ToBeDeletedByClusterAutoscaler, value: '1', effect: NoSchedule}]}",
        )
        .unwrap();
        assert!(NodeObject::from_node(&tainted).draining);
    }

    /// Pod-facing links with only a link-scoped address (unnumbered, gateway-style CNIs):
    /// MASQUERADE never picks it (`inet_select_addr` skips scope link) and takes the kernel's
    /// next choice, the first global address of the node's links; a link with both picks its
    /// global one, whichever came first.
    #[test]
    fn ipv4_masquerade_source_skips_link_scoped_addresses_as_the_kernel_does() {
        let links = vec![
            link(1, "lo", &["127.0.0.1"]),
            link(2, "eth0", &["192.168.0.2"]),
            link(3, "cali1", &["169.254.1.1"]),
            link(4, "cali2", &["169.254.1.5", "10.244.0.1"]),
        ];
        let p = plan(&links, None, &NodeSettings::default());
        assert_eq!(p.links[&3].addr, 0, "169.254.1.1 is never a masquerade source");
        assert_eq!(p.links[&0].addr, u32::from(Ipv4Addr::new(192, 168, 0, 2)).to_be(), "the kernel's next choice");
        assert_eq!(p.links[&4].addr, u32::from(Ipv4Addr::new(10, 244, 0, 1)).to_be());
        // A global address on lo comes first in the kernel's order.
        let mut with_lo = links.clone();
        with_lo[0] = link(1, "lo", &["127.0.0.1", "198.51.100.7"]);
        let p = plan(&with_lo, None, &NodeSettings::default());
        assert_eq!(p.links[&0].addr, u32::from(Ipv4Addr::new(198, 51, 100, 7)).to_be());
    }

    /// The node's own masqueraded connections: bound to MASQUERADE's source only where
    /// routing toward the endpoint would pick another.
    #[test]
    fn node_sources_where_routing_and_masquerade_disagree() {
        let links = vec![
            link(1, "lo", &["127.0.0.1"]),
            link(2, "eth0", &["192.168.0.2"]),
            link(3, "cali1", &["169.254.1.1"]),
            link(4, "cali2", &["169.254.1.5", "10.244.0.1"]),
            link(5, "cali3", &[]),
        ];
        let p = plan(&links, None, &NodeSettings::default());
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let route = |link, source: &str| KernelRoute { link, source: Some(ip(source)), local: false };
        let routes = [
            // Behind a link-scoped-only link: routing takes 169.254.1.1, MASQUERADE eth0's.
            (ip("10.244.0.10"), route(3, "169.254.1.1")),
            // Behind a link with a global address that routing picks as well.
            (ip("10.244.0.11"), route(4, "10.244.0.1")),
            // Behind a link without addresses: both take the kernel's fallback.
            (ip("10.244.0.12"), route(5, "192.168.0.2")),
            // A route with another preferred source than MASQUERADE's.
            (ip("10.244.0.13"), route(4, "192.168.0.2")),
            // A host-network endpoint: delivered locally, never masqueraded.
            (ip("192.168.0.2"), KernelRoute { link: 1, source: Some(ip("192.168.0.2")), local: true }),
            // IPv6: MASQUERADE and routing choose alike.
            (ip("fd00::10"), KernelRoute { link: 3, source: Some(ip("fd00::1")), local: false }),
        ];
        let sources = node_sources(routes, &p.links);
        assert_eq!(
            sources,
            BTreeMap::from([(ip("10.244.0.10"), ip("192.168.0.2")), (ip("10.244.0.13"), ip("10.244.0.1"))])
        );
    }

    #[test]
    fn detectors_and_masquerade_sources() {
        let node = NodeObject {
            zone: Some("z1".into()),
            addresses: vec![],
            pod_cidrs: vec!["10.244.0.0/24".parse().unwrap(), "fd00:10::/64".parse().unwrap()],
            draining: false,
        };
        let settings = NodeSettings { detect_local: DetectLocal::NodeCidr, ..Default::default() };
        let p = plan(&host(), Some(&node), &settings);
        assert_eq!(p.local_cidrs.iter().map(|c| c.to_string()).collect::<Vec<_>>(), ["10.244.0.0/24", "fd00:10::/64"]);
        assert_eq!(p.info.zone.as_deref(), Some("z1"));
        // No Node address, no --node-ip: the first non-loopback link address is primary.
        assert_eq!(p.primary, Some("192.168.0.2".parse().unwrap()));
        assert_eq!(p.links[&0].addr, u32::from(Ipv4Addr::new(192, 168, 0, 2)).to_be());
        assert_eq!(p.links[&3].addr, u32::from(Ipv4Addr::new(172, 16, 0, 2)).to_be());
        assert_eq!(p.links[&5].addr, 0, "a link without address falls back to the primary");
        assert!(p.info.undetected_families.is_empty(), "podCIDRs of both families");
        // A detector without an IPv6 CIDR is kube-proxy's no-op one in IPv6.
        let v4_only = NodeSettings {
            detect_local: DetectLocal::ClusterCidr(vec!["10.244.0.0/16".parse().unwrap()]),
            ..Default::default()
        };
        assert_eq!(plan(&host(), Some(&node), &v4_only).info.undetected_families, [IpFamily::V6]);

        let settings = NodeSettings { detect_local: DetectLocal::InterfaceNamePrefix("veth".into()), ..settings };
        let p = plan(&host(), Some(&node), &settings);
        assert!(p.local_cidrs.is_empty());
        assert!(p.info.undetected_families.is_empty(), "interfaces tell both families apart");
        let flagged: Vec<u32> =
            p.links.iter().filter(|(_, l)| l.flags & LINK_FLAG_LOCAL_TRAFFIC != 0).map(|(i, _)| *i).collect();
        assert_eq!(flagged, [5]);
        assert_eq!(p.links[&5].flags, LINK_FLAG_LOCAL_TRAFFIC | LINK_FLAG_PEER, "a pod's end of a veth pair");
        assert_eq!(p.links[&2].flags, 0);
        let settings = NodeSettings { detect_local: DetectLocal::BridgeInterface("cni0".into()), ..settings };
        let p = plan(&host(), Some(&node), &settings);
        assert_eq!(p.links[&4].flags, LINK_FLAG_LOCAL_TRAFFIC);
        // rp_filter in effect on a link: the programs check a new flow's source as the kernel would.
        let mut links = host();
        links[1].rp_filter = 1;
        links[2].rp_filter = 2;
        let p = plan(&links, Some(&node), &settings);
        assert_eq!(p.links[&links[1].index].flags & LINK_FLAG_RP_FILTER_STRICT, LINK_FLAG_RP_FILTER_STRICT);
        assert_eq!(p.links[&links[2].index].flags & LINK_FLAG_RP_FILTER_LOOSE, LINK_FLAG_RP_FILTER_LOOSE);
        // An IP-in-IP tunnel (Calico's tunl0, with an address of the node's pod block): covered,
        // by the programs for packets without Ethernet, and its address is its masquerade source.
        links.push(link(9, "tunl0", &["10.244.0.0"]));
        let p = plan(&links, Some(&node), &settings);
        assert!(p.tc_links.contains_key(&9));
        assert_eq!(p.links[&9].flags, LINK_FLAG_NOT_ETHERNET);
        assert_eq!(p.links[&9].addr, u32::from(Ipv4Addr::new(10, 244, 0, 0)).to_be());
        assert!(p.links.values().filter(|l| l.flags & LINK_FLAG_NOT_ETHERNET != 0).count() == 1);

        let settings = NodeSettings {
            tc_links: TcLinks::Only(vec!["eth1".into()]),
            node_ips: vec!["198.51.100.9".parse().unwrap()],
            ..settings
        };
        let p = plan(&host(), None, &settings);
        assert_eq!(p.tc_links.values().collect::<Vec<_>>(), ["eth1"]);
        assert_eq!(p.primary, Some("198.51.100.9".parse().unwrap()), "--node-ip comes first");
        assert_eq!(p.node_addrs[&"198.51.100.9".parse().unwrap()], NODE_ADDR_LOCAL | NODE_ADDR_NODEPORT);
    }
}
