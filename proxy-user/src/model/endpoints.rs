//! EndpointSlices → endpoints per service port, and kube-proxy's `CategorizeEndpoints`.
use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::{
    Endpoint, IpFamily, NodeInfo, ObjectKey, Protocol, ServicePort, ServicePortName, Skip, TrafficPolicy,
    service::{ignored_by_labels, object_key, port},
};

/// Label that ties an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// The Service a slice belongs to (same namespace, `kubernetes.io/service-name` label).
pub fn owning_service(slice: &EndpointSlice) -> Result<ObjectKey, Skip> {
    let slice_key = object_key(&slice.metadata).ok_or(Skip::Unnamed)?;
    let name = slice.metadata.labels.as_ref().and_then(|l| l.get(LABEL_SERVICE_NAME)).ok_or(Skip::NoServiceLabel)?;
    Ok(ObjectKey::new(slice_key.namespace, name.clone()))
}

/// What the model keeps of an EndpointSlice: the fields kube-proxy's `EndpointSliceCache`
/// reads. The object itself is several times larger (k8s-openapi's `Endpoint` alone is 352
/// bytes before its strings), and the model holds one per slice of the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceInfo {
    pub name: String,
    /// The Service the slice belongs to.
    pub service: ObjectKey,
    /// Labelled headless or for another proxy: ignored, as kube-proxy's informer ignores it.
    ignored: bool,
    address_type: String,
    ports: Vec<SlicePort>,
    endpoints: Vec<SliceEndpoint>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct SlicePort {
    name: String,
    protocol: Option<String>,
    port: Option<i32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct SliceEndpoint {
    /// The first address (kube-proxy uses no other), parsed once as it arrives (a Service of
    /// thousands of endpoints is recomputed at each change of one); the text if it is none.
    address: Option<Result<IpAddr, String>>,
    ready: bool,
    serving: bool,
    terminating: bool,
    node_name: Option<String>,
    zone_hints: Option<Vec<String>>,
    node_hints: Option<Vec<String>>,
}

impl SliceInfo {
    /// Keep what the model reads of `slice`; a slice without a name or a service label is
    /// refused. Conditions left unset mean ready and serving, not terminating.
    pub fn new(slice: EndpointSlice, proxy_name: Option<&str>) -> Result<Self, Skip> {
        let service = owning_service(&slice)?;
        let endpoints = slice
            .endpoints
            .into_iter()
            .flatten()
            .map(|ep| {
                let cond = ep.conditions.as_ref();
                let hints = ep.hints.as_ref();
                SliceEndpoint {
                    address: ep.addresses.into_iter().next().map(|a| a.parse().map_err(|_| a)),
                    ready: cond.and_then(|c| c.ready).unwrap_or(true),
                    serving: cond.and_then(|c| c.serving).unwrap_or(true),
                    terminating: cond.and_then(|c| c.terminating).unwrap_or(false),
                    node_name: ep.node_name,
                    zone_hints: hints
                        .and_then(|h| h.for_zones.as_ref())
                        .filter(|z| !z.is_empty())
                        .map(|z| z.iter().map(|z| z.name.clone()).collect()),
                    node_hints: hints
                        .and_then(|h| h.for_nodes.as_ref())
                        .filter(|n| !n.is_empty())
                        .map(|n| n.iter().map(|n| n.name.clone()).collect()),
                }
            })
            .collect();
        Ok(Self {
            name: slice.metadata.name.clone().unwrap_or_default(),
            service,
            ignored: ignored_by_labels(&slice.metadata, proxy_name),
            address_type: slice.address_type,
            ports: slice
                .ports
                .into_iter()
                .flatten()
                .map(|p| SlicePort { name: p.name.unwrap_or_default(), protocol: p.protocol, port: p.port })
                .collect(),
            endpoints,
        })
    }

    /// The addresses of the slice's endpoints (none if the slice is ignored).
    pub fn addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        let endpoints = if self.ignored { &[][..] } else { &self.endpoints[..] };
        endpoints.iter().filter_map(|e| e.address.as_ref()?.as_ref().ok().copied())
    }
}

/// Endpoints of one service, per service port name, joined from all its slices.
///
/// As in kube-proxy's `EndpointSliceCache`: slice ports join service ports by name and protocol,
/// the port number comes from the slice, only the first address of an endpoint is used, slices of
/// another `family` (and FQDN slices) are ignored, and an address listed in several slices
/// appears once (the local copy wins). Slices are visited in name order so the result is
/// deterministic.
pub fn endpoints_by_port<'a>(
    slices: impl IntoIterator<Item = &'a SliceInfo>,
    family: IpFamily,
    node: &NodeInfo,
    skipped: &mut Vec<(String, Skip)>,
) -> BTreeMap<(String, Protocol), Vec<Endpoint>> {
    let mut out: BTreeMap<(String, Protocol), Vec<Endpoint>> = BTreeMap::new();
    for slice in slices {
        if slice.ignored || slice.address_type != family.address_type() {
            continue;
        }
        for slice_port in &slice.ports {
            let Some(protocol) = Protocol::parse(slice_port.protocol.as_deref()) else {
                skipped
                    .push((slice.name.clone(), Skip::UnknownProtocol(slice_port.protocol.clone().unwrap_or_default())));
                continue;
            };
            let port_number = match slice_port.port.map(port) {
                Some(Ok(p)) => p,
                Some(Err(e)) => {
                    skipped.push((slice.name.clone(), e));
                    continue;
                }
                None => continue, // no port: the slice says "all ports", which services never use
            };
            let list = out.entry((slice_port.name.clone(), protocol)).or_default();
            for ep in &slice.endpoints {
                let Some(first) = &ep.address else { continue };
                let ip: IpAddr = match first {
                    Ok(ip) if IpFamily::of(ip) == family => *ip,
                    Ok(ip) => {
                        skipped.push((slice.name.clone(), Skip::InvalidIp(ip.to_string())));
                        continue;
                    }
                    Err(text) => {
                        skipped.push((slice.name.clone(), Skip::InvalidIp(text.clone())));
                        continue;
                    }
                };
                let endpoint = Endpoint {
                    ip,
                    port: port_number,
                    ready: ep.ready,
                    serving: ep.serving,
                    terminating: ep.terminating,
                    is_local: ep.node_name.as_deref().is_some_and(|n| n == node.name),
                    on_down_node: ep.node_name.as_deref().is_some_and(|n| node.down_nodes.contains(n)),
                    node_named: ep.node_name.is_some(),
                    zone_hints: ep.zone_hints.clone(),
                    node_hints: ep.node_hints.clone(),
                };
                list.push(endpoint);
            }
        }
    }
    // One copy of each address and port: the first local one, else the first (slices in name
    // order). Sorted, not searched per endpoint: thousands of endpoints would make that
    // quadratic; the stable sort keeps the copies in slice order.
    for list in out.values_mut() {
        list.sort_by_key(|e| (e.ip, e.port));
        list.dedup_by(|later, kept| {
            let same = later.ip == kept.ip && later.port == kept.port;
            if same && later.is_local && !kept.is_local {
                std::mem::swap(later, kept);
            }
            same
        });
    }
    out
}

/// The endpoints of one service port, as kube-proxy's `CategorizeEndpoints` splits them.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Categorized {
    /// For traffic policy Cluster: ready ∧ topology-allowed, else serving ∧ terminating.
    pub cluster: Vec<Endpoint>,
    /// For traffic policy Local: local ∧ ready, else local ∧ serving ∧ terminating.
    pub local: Vec<Endpoint>,
    /// Any usable endpoint anywhere (decides REJECT vs DROP).
    pub has_any: bool,
}

/// kube-proxy's `UsesClusterEndpoints`: even with externalTrafficPolicy Local, an externally
/// accessible service needs its cluster endpoints to short-circuit in-cluster traffic.
fn uses_cluster_endpoints(sp: &ServicePort) -> bool {
    sp.internal_policy == TrafficPolicy::Cluster || sp.externally_accessible()
}

fn uses_local_endpoints(sp: &ServicePort) -> bool {
    sp.internal_policy == TrafficPolicy::Local
        || (sp.externally_accessible() && sp.external_policy == TrafficPolicy::Local)
}

/// Which endpoints topology hints leave this node: all, its own node's, its zone's.
#[derive(Clone, Copy, PartialEq, Eq)]
enum HintScope {
    Any,
    SameNode,
    SameZone,
}

fn topology_mode(endpoints: &[Endpoint], node: &NodeInfo) -> HintScope {
    let zone = node.zone.as_deref().unwrap_or("");
    let (mut all_node, mut for_node, mut all_zone, mut for_zone) = (true, false, true, false);
    for ep in endpoints.iter().filter(|e| e.ready) {
        match &ep.node_hints {
            None => all_node = false,
            Some(h) => for_node |= h.contains(&node.name),
        }
        match &ep.zone_hints {
            None => all_zone = false,
            Some(h) => for_zone |= h.iter().any(|z| z == zone),
        }
    }
    if all_node && for_node {
        HintScope::SameNode
    } else if all_zone && for_zone {
        HintScope::SameZone
    } else {
        HintScope::Any
    }
}

fn allowed_by(topology: HintScope, ep: &Endpoint, node: &NodeInfo) -> bool {
    let has = |hints: &Option<Vec<String>>, v: &str| hints.as_ref().is_some_and(|h| h.iter().any(|x| x == v));
    match topology {
        HintScope::Any => true,
        HintScope::SameNode => has(&ep.node_hints, &node.name),
        HintScope::SameZone => has(&ep.zone_hints, node.zone.as_deref().unwrap_or("")),
    }
}

/// kube-proxy's `CategorizeEndpoints` (pkg/proxy/topology.go), copied rule for rule.
pub fn categorize(endpoints: &[Endpoint], sp: &ServicePort, node: &NodeInfo) -> Categorized {
    let mut out = Categorized::default();
    if uses_cluster_endpoints(sp) {
        let topology = topology_mode(endpoints, node);
        out.cluster = endpoints.iter().filter(|e| e.ready && allowed_by(topology, e, node)).cloned().collect();
        if out.cluster.is_empty() {
            out.cluster = endpoints.iter().filter(|e| e.serving && e.terminating).cloned().collect();
        }
        out.has_any = !out.cluster.is_empty();
    }
    if !uses_local_endpoints(sp) {
        return out;
    }
    let usable = |e: &&Endpoint| e.ready || (e.serving && e.terminating);
    out.has_any |= endpoints.iter().any(|e| usable(&e));
    let local_ready = endpoints.iter().any(|e| e.is_local && e.ready);
    out.local = endpoints
        .iter()
        .filter(|e| e.is_local && if local_ready { e.ready } else { e.serving && e.terminating })
        .cloned()
        .collect();
    out
}

/// Endpoints of `name`'s port from a `endpoints_by_port` result.
pub fn for_port<'a>(
    by_port: &'a BTreeMap<(String, Protocol), Vec<Endpoint>>,
    name: &ServicePortName,
) -> &'a [Endpoint] {
    by_port.get(&(name.port.clone(), name.protocol)).map(Vec::as_slice).unwrap_or(&[])
}

#[cfg(test)]
mod upstream_topology;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::{service_port, slice_yaml};

    fn ep(ip: &str, ready: bool, serving: bool, terminating: bool, local: bool) -> Endpoint {
        Endpoint {
            ip: ip.parse().unwrap(),
            port: 80,
            ready,
            serving,
            terminating,
            is_local: local,
            on_down_node: false,
            node_named: true,
            zone_hints: None,
            node_hints: None,
        }
    }
    fn ips(eps: &[Endpoint]) -> Vec<String> {
        eps.iter().map(|e| e.ip.to_string()).collect()
    }
    fn node() -> NodeInfo {
        NodeInfo { name: "node-a".into(), zone: Some("zone-1".into()), ..NodeInfo::default() }
    }

    #[test]
    fn joins_ports_by_name_and_dedups_across_slices() {
        let a = slice_yaml(
            r#"
metadata: {name: web-a, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: metrics, port: 9090}]
endpoints:
- {addresses: [10.0.0.1]}
- {addresses: [10.0.0.2], nodeName: node-b}
"#,
        );
        let b = slice_yaml(
            r#"
metadata: {name: web-b, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.0.0.2], nodeName: node-a}
- {addresses: [10.0.0.3]}
"#,
        );
        let v6 = slice_yaml(
            "metadata: {name: web-c, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv6\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: ['fd00::1']}]",
        );
        let mut skipped = vec![];
        let infos = [&a, &b, &v6].map(|s| SliceInfo::new(s.clone(), None).unwrap());
        let by_port = endpoints_by_port(&infos, IpFamily::V4, &node(), &mut skipped);
        let http = &by_port[&("http".into(), Protocol::Tcp)];
        assert_eq!(ips(http), ["10.0.0.1", "10.0.0.2", "10.0.0.3"]);
        assert!(http[1].is_local, "the local copy of a duplicated endpoint wins");
        assert_eq!(http[0].port, 8080);
        assert_eq!(ips(&by_port[&("metrics".into(), Protocol::Tcp)]), ["10.0.0.1", "10.0.0.2"]);
        assert_eq!(by_port[&("metrics".into(), Protocol::Tcp)][0].port, 9090);
        assert!(skipped.is_empty());
        // The IPv6 proxier sees only the IPv6 slice.
        let v6_by_port = endpoints_by_port(&infos, IpFamily::V6, &node(), &mut skipped);
        assert_eq!(ips(&v6_by_port[&("http".into(), Protocol::Tcp)]), ["fd00::1"]);
        assert!(skipped.is_empty());
        assert_eq!(owning_service(&a).unwrap(), ObjectKey::new("shop", "web"));
    }

    #[test]
    fn bad_addresses_and_ports_are_skipped() {
        let s = slice_yaml(
            "metadata: {name: s, labels: {kubernetes.io/service-name: x}}\naddressType: IPv4\nports: [{name: a, port: 99999}, {name: b, port: 80}]\nendpoints: [{addresses: [not-an-ip]}, {addresses: [10.0.0.9]}]",
        );
        let mut skipped = vec![];
        let by_port = endpoints_by_port([&SliceInfo::new(s, None).unwrap()], IpFamily::V4, &node(), &mut skipped);
        assert_eq!(ips(&by_port[&("b".into(), Protocol::Tcp)]), ["10.0.0.9"]);
        assert!(!by_port.contains_key(&("a".into(), Protocol::Tcp)));
        assert_eq!(
            skipped,
            vec![("s".into(), Skip::InvalidPort(99999)), ("s".into(), Skip::InvalidIp("not-an-ip".into()))]
        );
        let unlabelled = slice_yaml("metadata: {name: u}\naddressType: IPv4");
        assert_eq!(owning_service(&unlabelled), Err(Skip::NoServiceLabel));
    }

    #[test]
    fn cluster_endpoints_fall_back_to_serving_terminating() {
        let sp = service_port();
        let eps = [
            ep("10.0.0.1", true, true, false, false),
            ep("10.0.0.2", false, true, true, false),   // serving, terminating
            ep("10.0.0.3", false, false, true, false),  // terminating, not serving
            ep("10.0.0.4", false, false, false, false), // not ready
        ];
        assert_eq!(ips(&categorize(&eps, &sp, &node()).cluster), ["10.0.0.1"]);
        let c = categorize(&eps[1..], &sp, &node());
        assert_eq!(ips(&c.cluster), ["10.0.0.2"]);
        assert!(c.has_any);
        let none = categorize(&eps[2..], &sp, &node());
        assert!(none.cluster.is_empty() && !none.has_any);
    }

    #[test]
    fn internal_traffic_policy_local() {
        let mut sp = service_port();
        sp.internal_policy = TrafficPolicy::Local;
        let eps = [
            ep("10.0.0.1", true, true, false, false),
            ep("10.0.0.2", false, true, true, true),
            ep("10.0.0.3", true, true, false, true),
        ];
        let c = categorize(&eps, &sp, &node());
        assert!(c.cluster.is_empty(), "iTP=Local alone does not use cluster endpoints");
        assert_eq!(ips(&c.local), ["10.0.0.3"]);
        let c = categorize(&eps[..2], &sp, &node());
        assert_eq!(ips(&c.local), ["10.0.0.2"], "falls back to local serving-terminating");
        let c = categorize(&eps[..1], &sp, &node());
        assert!(c.local.is_empty() && c.has_any, "remote endpoints exist: DROP, not REJECT");
    }

    #[test]
    fn topology_hints() {
        let sp = service_port();
        let mut a = ep("10.0.0.1", true, true, false, false);
        let mut b = ep("10.0.0.2", true, true, false, false);
        a.zone_hints = Some(vec!["zone-1".into()]);
        b.zone_hints = Some(vec!["zone-2".into()]);
        assert_eq!(ips(&categorize(&[a.clone(), b.clone()], &sp, &node()).cluster), ["10.0.0.1"]);
        // Node hints on every endpoint win over zone hints.
        a.node_hints = Some(vec!["node-b".into()]);
        b.node_hints = Some(vec!["node-a".into()]);
        assert_eq!(ips(&categorize(&[a.clone(), b.clone()], &sp, &node()).cluster), ["10.0.0.2"]);
        // One ready endpoint without hints: topology is ignored.
        let c = ep("10.0.0.3", true, true, false, false);
        assert_eq!(ips(&categorize(&[a, b, c], &sp, &node()).cluster).len(), 3);
        // Hints naming no zone of ours: ignored too.
        let mut d = ep("10.0.0.4", true, true, false, false);
        d.zone_hints = Some(vec!["zone-9".into()]);
        assert_eq!(ips(&categorize(&[d], &sp, &node()).cluster), ["10.0.0.4"]);
    }
}
