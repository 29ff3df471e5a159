//! Services + EndpointSlices → what the datapath should hold: `ClusterIP:port/proto → backends`.
//!
//! [`ClusterState`] keeps what it reads of the objects the sources delivered (their
//! bookkeeping and everything else it never reads are dropped on arrival, so an object that
//! changed only there is unchanged) and recomputes only the services whose Service or slices
//! changed; [`ClusterState::desired`] merges the per-service results.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_common::{
    PROTO_ANY, SCOPE_EXTERNAL, SCOPE_NODE, SCOPE_POD, SERVICE_FLAG_DROP_NO_ENDPOINTS, SERVICE_FLAG_DSR,
    SERVICE_FLAG_EXTERNAL_ADDR, SERVICE_FLAG_MAGLEV, SERVICE_FLAG_SNAT, SERVICE_FLAG_SOCKET_SKIP,
    SERVICE_FLAG_SOURCE_RANGES, ServiceKey,
};

use super::{IpFamily, cidr::Cidr};

use super::{
    NodeInfo, ObjectKey, Protocol, ProxyOptions, ServicePort, ServicePortName, Skip, TrafficPolicy, endpoints,
    endpoints::SliceInfo, service, service::ServiceInfo,
};

/// One datapath entry: a frontend (ClusterIP:port, external IP:port or NodePort) of a service
/// port and the backends to pick from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredPort {
    pub name: ServicePortName,
    /// Backends as (address, port) of the frontend's family, sorted; empty means "no
    /// endpoints": reject, or drop with `SERVICE_FLAG_DROP_NO_ENDPOINTS`.
    pub backends: Vec<(IpAddr, u16)>,
    /// `proxy_common::SERVICE_FLAG_*`.
    pub flags: u32,
    /// loadBalancerSourceRanges (LoadBalancer IP frontends only), sorted; with
    /// `SERVICE_FLAG_SOURCE_RANGES`.
    pub source_ranges: Vec<Cidr>,
    /// sessionAffinity ClientIP timeout in seconds; 0: none.
    pub affinity_timeout: u32,
    /// UDP only (empty otherwise): the port's serving endpoints (address and port) of the
    /// frontend's family, whatever the traffic policies, topology or termination say. UDP flows
    /// to any other endpoint are flushed, as kube-proxy's conntrack cleanup does (1.33+,
    /// `CleanStaleEntries`: a flow whose reply source is not a serving endpoint's address and
    /// port): a flow keeps an endpoint that is no longer picked for new flows for as long as
    /// it serves, and a new targetPort moves flows off the old one.
    pub serving: Vec<SocketAddr>,
    /// TCP with `--abort-dead-tcp` only (None otherwise): the port's endpoints that are not
    /// dead, sorted. Dead: gone from the slices (its pod is gone), or on a Node that is not
    /// Ready unless serving while terminating (a graceful drain). TCP flows to any other
    /// endpoint are ended (sockets aborted, per-packet flows reset), even when none is left.
    pub alive: Option<Vec<SocketAddr>>,
    /// With `SERVICE_FLAG_DSR` only (empty otherwise): the backends' addresses on other nodes
    /// (`BACKEND_FLAG_REMOTE`), sorted.
    pub remote: Vec<IpAddr>,
}

pub type Desired = BTreeMap<ServiceKey, DesiredPort>;

/// The key of a ClusterIP frontend as a pod sees it.
pub fn service_key(ip: impl Into<IpAddr>, port: u16, protocol: Protocol) -> ServiceKey {
    frontend_key(ip, port, protocol, SCOPE_POD)
}

/// The key of a frontend for traffic from `scope`; a NodePort is `0.0.0.0:nodePort` or
/// `[::]:nodePort`.
pub fn frontend_key(ip: impl Into<IpAddr>, port: u16, protocol: Protocol, scope: u8) -> ServiceKey {
    ServiceKey { addr: ip.into().into(), port: port.to_be(), proto: protocol.ipproto(), scope }
}

/// What one scope's entry of a frontend does: the backends to pick from and `SERVICE_FLAG_*`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Verdict {
    backends: Vec<(IpAddr, u16)>,
    flags: u32,
}

impl Verdict {
    /// kube-proxy's REJECT: the service has no usable endpoint anywhere.
    fn reject() -> Self {
        Self { backends: Vec::new(), flags: 0 }
    }

    /// kube-proxy's DROP: whatever the endpoints, this traffic is not admitted.
    fn drop() -> Self {
        Self { backends: Vec::new(), flags: SERVICE_FLAG_DROP_NO_ENDPOINTS }
    }

    fn masquerade(mut self, yes: bool) -> Self {
        if yes && !self.backends.is_empty() {
            self.flags |= SERVICE_FLAG_SNAT;
        }
        self
    }
}

/// The datapath entries of one Service, given its slices: every frontend (ClusterIPs,
/// externalIPs, LoadBalancer IPs, the NodePort) once per scope (from a pod, from outside, from
/// the node), with the endpoints and masquerade kube-proxy's chains give that traffic; once
/// per IP family the Service has a ClusterIP of, as kube-proxy's proxier of that family sees it.
pub fn service_entries<'a>(
    svc: &ServiceInfo,
    slices: impl IntoIterator<Item = &'a SliceInfo>,
    node: &NodeInfo,
    options: &ProxyOptions,
    skipped: &mut Vec<(String, Skip)>,
) -> Result<Vec<(ServiceKey, DesiredPort)>, Skip> {
    let translated = svc.translated.as_ref().map_err(Clone::clone)?;
    skipped.extend(translated.skipped.iter().cloned());
    if translated.ports.is_empty() {
        return Ok(Vec::new());
    }
    let slices: Vec<&SliceInfo> = slices.into_iter().collect();
    // loadBalancerSourceRanges of each port, parsed (and a malformed one reported) once.
    let ranges: Vec<Vec<Cidr>> =
        translated.ports.iter().map(|sp| source_ranges(&sp.load_balancer_source_ranges, &sp.name, skipped)).collect();
    let mut out = Vec::new();
    for family in IpFamily::ALL {
        // The family's proxier knows the Service only by its ClusterIP of that family.
        if family.filter(&translated.ports[0].cluster_ips).is_empty() {
            continue;
        }
        let by_port = endpoints::endpoints_by_port(slices.iter().copied(), family, node, skipped);
        for (sp, ranges) in translated.ports.iter().zip(&ranges) {
            let endpoints = endpoints::for_port(&by_port, &sp.name);
            let cat = endpoints::categorize(endpoints, sp, node);
            let serving: Vec<SocketAddr> = if sp.protocol == Protocol::Udp {
                let serving = endpoints.iter().filter(|e| e.serving).map(|e| SocketAddr::new(e.ip, e.port));
                serving.collect::<BTreeSet<_>>().into_iter().collect()
            } else {
                Vec::new()
            };
            let alive = (sp.protocol == Protocol::Tcp && options.abort_dead_tcp).then(|| {
                let alive = endpoints.iter().filter(|e| !e.on_down_node || (e.serving && e.terminating));
                alive.map(|e| SocketAddr::new(e.ip, e.port)).collect::<BTreeSet<_>>().into_iter().collect::<Vec<_>>()
            });
            let local: Vec<IpAddr> = endpoints.iter().filter(|e| e.is_local).map(|e| e.ip).collect();
            // Direct return only where every endpoint names its node: one that does not may be
            // outside the cluster, where no kpr takes the tunnel's header off.
            let direct =
                svc.lb_mode.unwrap_or(options.lb_mode).direct(sp.protocol) && endpoints.iter().all(|e| e.node_named);
            let flows = Flows { serving: &serving, alive: alive.as_deref(), local: direct.then_some(&local[..]) };
            let maglev = svc.maglev.unwrap_or(options.maglev);
            family_entries(sp, family, &cat, flows, node, options, maglev, ranges, &mut out);
        }
    }
    // A refused service range: every other port of its ClusterIPs is rejected, whatever the
    // source (one entry, looked up with SCOPE_POD; the datapath asks only inside the range).
    if options.refuse_service_range
        && let Some(first) = translated.ports.first()
    {
        for ip in first.cluster_ips.iter().filter(|ip| node.service_cidrs.iter().any(|c| c.contains(**ip))) {
            let key = ServiceKey { addr: (*ip).into(), port: 0, proto: PROTO_ANY, scope: SCOPE_POD };
            let port = DesiredPort {
                name: first.name.clone(),
                backends: Vec::new(),
                flags: 0,
                source_ranges: Vec::new(),
                affinity_timeout: 0,
                serving: Vec::new(),
                alive: None,
                remote: Vec::new(),
            };
            out.push((key, port));
        }
    }
    Ok(out)
}

/// A service port's [`DesiredPort::serving`] and [`DesiredPort::alive`].
#[derive(Clone, Copy)]
struct Flows<'a> {
    serving: &'a [SocketAddr],
    alive: Option<&'a [SocketAddr]>,
    /// Direct server return (`--lb-mode`, `kpr.io/lb-mode`): the addresses of the port's
    /// endpoints on this node.
    local: Option<&'a [IpAddr]>,
}

/// The entries of one service port in one family's proxier.
#[allow(clippy::too_many_arguments)]
fn family_entries(
    sp: &ServicePort,
    family: IpFamily,
    cat: &endpoints::Categorized,
    flows: Flows,
    node: &NodeInfo,
    options: &ProxyOptions,
    maglev: bool,
    all_ranges: &[Cidr],
    out: &mut Vec<(ServiceKey, DesiredPort)>,
) {
    // loadBalancerSourceRanges filter the LoadBalancer IPs only, as in kube-proxy; each
    // family's proxier keeps the ranges of its family.
    let ranges: Vec<Cidr> = all_ranges.iter().copied().filter(|c| IpFamily::of(&c.addr) == family).collect();
    let scopes = scoped_verdicts(sp, family, cat, node, options, &ranges);
    // `chosen`: an externalIP or LoadBalancer IP, an address the Service (or its status) picks.
    // `outside`: a frontend for outside clients (not a ClusterIP): with `maglev`, their new
    // flows pick by Maglev, so that every node an ECMP router sends a tuple to picks alike.
    let mut push = |ip: IpAddr,
                    port: u16,
                    [pod, external, from_node]: &[Verdict; 3],
                    ranges: &[Cidr],
                    chosen: bool,
                    outside: bool| {
        for (scope, verdict) in [(SCOPE_POD, pod), (SCOPE_EXTERNAL, external), (SCOPE_NODE, from_node)] {
            // No entry: the node's own connections to that address pass untranslated.
            if scope == SCOPE_NODE && chosen && options.host_external_ips_local_only && !node.addresses.contains(&ip) {
                continue;
            }
            let key = frontend_key(ip, port, sp.protocol, scope);
            // The node's own traffic was decided at sync time (no per-packet source).
            let filtered = !ranges.is_empty() && scope != SCOPE_NODE;
            let mut flags = verdict.flags;
            if filtered {
                flags |= SERVICE_FLAG_SOURCE_RANGES;
            }
            // What connect() in a pod cannot do (masquerade, source filtering) is left to
            // the per-packet path on the pod's link.
            if scope == SCOPE_POD && (filtered || flags & SERVICE_FLAG_SNAT != 0) {
                flags |= SERVICE_FLAG_SOCKET_SKIP;
            }
            if scope == SCOPE_EXTERNAL && outside && maglev && !verdict.backends.is_empty() {
                flags |= SERVICE_FLAG_MAGLEV;
            }
            // Direct server return takes the place of the masquerade of traffic policy
            // Cluster (Local keeps the client's address already, and its endpoints are here).
            let mut remote = Vec::new();
            if scope == SCOPE_EXTERNAL
                && outside
                && flags & SERVICE_FLAG_SNAT != 0
                && !verdict.backends.is_empty()
                && let Some(local) = flows.local
            {
                flags = (flags & !SERVICE_FLAG_SNAT) | SERVICE_FLAG_DSR;
                remote = verdict.backends.iter().map(|(ip, _)| *ip).filter(|ip| !local.contains(ip)).collect();
                remote.sort();
                remote.dedup();
            }
            // Not even the agent's own connection to the API server can be taken over.
            if scope == SCOPE_NODE && chosen {
                flags |= SERVICE_FLAG_EXTERNAL_ADDR;
            }
            let source_ranges = if filtered { ranges.to_vec() } else { Vec::new() };
            out.push((
                key,
                DesiredPort {
                    name: sp.name.clone(),
                    backends: verdict.backends.clone(),
                    flags,
                    source_ranges,
                    affinity_timeout: sp.session_affinity_timeout.unwrap_or(0),
                    serving: flows.serving.to_vec(),
                    alive: flows.alive.map(<[SocketAddr]>::to_vec),
                    remote,
                },
            ));
        }
    };
    for ip in family.filter(&sp.cluster_ips).into_iter().take(1) {
        push(ip, sp.port, &scopes.cluster_ip, &[], false, false);
    }
    if sp.externally_accessible() {
        for ip in family.filter(&sp.external_ips) {
            push(ip, sp.port, &scopes.external, &[], true, true);
        }
        let lb_ips = family.filter(&sp.load_balancer_ips);
        let lb_ranges = allow_from_node(&ranges, &lb_ips, node);
        for ip in lb_ips {
            push(ip, sp.port, &scopes.load_balancer, &lb_ranges, true, true);
        }
        if let Some(node_port) = sp.node_port {
            push(family.unspecified(), node_port, &scopes.external, &[], false, true);
        }
    }
}

/// Per kind of frontend, the verdict for traffic from a pod, from outside, from the node.
struct ScopedVerdicts {
    cluster_ip: [Verdict; 3],
    /// externalIPs and the NodePort.
    external: [Verdict; 3],
    load_balancer: [Verdict; 3],
}

/// kube-proxy's chains, per source (see kube-proxy-semantics.md, "Easily missed"):
/// - no usable endpoint anywhere: REJECT, whatever the policies and the source;
/// - ClusterIP: internalTrafficPolicy decides (Local without a local endpoint: DROP);
///   masqueraded with `masqueradeAll`, or when a detector is in force and the source is not a
///   local pod (`! -s clusterCIDR -j KUBE-MARK-MASQ`);
/// - external frontends from outside: externalTrafficPolicy decides (Cluster: all endpoints,
///   masqueraded; Local: local endpoints, source kept, none local: DROP);
/// - from a local pod (only with a detector): Cluster as from outside; Local short-circuits to
///   all endpoints unmasqueraded;
/// - from the node: all endpoints, masqueraded, whatever the policy (`--src-type LOCAL`);
/// - LoadBalancer IPs with source ranges: the node is admitted when a range holds one of its
///   addresses, otherwise dropped (pods and outside clients are checked per packet).
fn scoped_verdicts(
    sp: &ServicePort,
    family: IpFamily,
    cat: &endpoints::Categorized,
    node: &NodeInfo,
    options: &ProxyOptions,
    ranges: &[Cidr],
) -> ScopedVerdicts {
    let backends = |eps: &[crate::model::Endpoint]| -> Vec<(IpAddr, u16)> {
        let mut v: Vec<(IpAddr, u16)> =
            eps.iter().filter(|e| IpFamily::of(&e.ip) == family).map(|e| (e.ip, e.port)).collect();
        v.sort();
        v.dedup();
        v
    };
    let policy = |local: bool| {
        if !cat.has_any {
            Verdict::reject()
        } else if local {
            match backends(&cat.local) {
                b if b.is_empty() => Verdict::drop(),
                backends => Verdict { backends, flags: 0 },
            }
        } else {
            Verdict { backends: backends(&cat.cluster), flags: 0 }
        }
    };
    let internal = policy(sp.internal_policy == TrafficPolicy::Local);
    // kube-proxy's detector is per family: a family without its input (no clusterCIDR of that
    // family) gets the no-op one.
    let detect_local = options.detect_local && !node.undetected_families.contains(&family);
    let masquerade_non_local = options.masquerade_all || detect_local;
    let from_outside = internal.clone().masquerade(masquerade_non_local);
    let from_pod =
        if detect_local { internal.clone().masquerade(options.masquerade_all) } else { from_outside.clone() };
    let cluster_ip = [from_pod, from_outside, internal.masquerade(masquerade_non_local)];

    let etp_local = sp.external_policy == TrafficPolicy::Local;
    let all = policy(false);
    let from_outside = if etp_local { policy(true) } else { all.clone().masquerade(true) };
    let from_pod = if detect_local { all.clone().masquerade(!etp_local) } else { from_outside.clone() };
    let from_node = all.masquerade(true);
    let external = [from_pod, from_outside, from_node.clone()];

    let node_admitted = ranges.is_empty() || holds_node_address(ranges, node);
    let mut load_balancer = external.clone();
    if !node_admitted {
        load_balancer[2] = Verdict::drop();
    }
    ScopedVerdicts { cluster_ip, external, load_balancer }
}

/// kube-proxy's "allow from node": when a source range holds a node address, traffic whose
/// source is a LoadBalancer IP itself is admitted too.
fn allow_from_node(ranges: &[Cidr], lb_ips: &[IpAddr], node: &NodeInfo) -> Vec<Cidr> {
    let mut out = ranges.to_vec();
    if holds_node_address(ranges, node) {
        out.extend(lb_ips.iter().filter_map(|ip| Cidr::new(*ip, if ip.is_ipv4() { 32 } else { 128 })));
        out.sort();
        out.dedup();
    }
    out
}

/// One of `ranges` holds an address of the node.
fn holds_node_address(ranges: &[Cidr], node: &NodeInfo) -> bool {
    node.addresses.iter().any(|a| ranges.iter().any(|r| r.contains(*a)))
}

/// CIDRs of loadBalancerSourceRanges (a bare address is a host prefix); malformed ones are
/// skipped (and reported).
fn source_ranges(raw: &[String], name: &ServicePortName, skipped: &mut Vec<(String, Skip)>) -> Vec<Cidr> {
    let mut out = Vec::new();
    for cidr in raw {
        let cidr = cidr.trim();
        let parsed = if cidr.contains('/') {
            cidr.parse::<Cidr>().ok()
        } else {
            cidr.parse::<IpAddr>().ok().and_then(|ip| Cidr::new(ip, if ip.is_ipv4() { 32 } else { 128 }))
        };
        match parsed {
            Some(c) => out.push(c),
            None => skipped.push((name.port.clone(), Skip::InvalidIp(cidr.to_owned()))),
        }
    }
    out.sort();
    out.dedup();
    out
}

/// What a service's endpoints on this node mean for health checks and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Locality {
    /// kube-proxy's healthCheckNodePort for a LoadBalancer service with eTP=Local: the port,
    /// and how many ready endpoints of the service run on this node.
    pub health_check: Option<(u16, usize)>,
    /// Ports with endpoints whose internal / external traffic policy is Local and that have
    /// none on this node (kube-proxy's `sync_proxy_rules_no_local_endpoints_total`).
    pub no_local_internal: usize,
    pub no_local_external: usize,
}

pub fn locality<'a>(svc: &ServiceInfo, slices: impl IntoIterator<Item = &'a SliceInfo>, node: &NodeInfo) -> Locality {
    let Ok(translated) = &svc.translated else { return Locality::default() };
    // The health check counts the endpoints of the Service's primary family.
    let family = translated.ports.first().and_then(|p| p.cluster_ips.first()).map_or(IpFamily::V4, IpFamily::of);
    let by_port = endpoints::endpoints_by_port(slices, family, node, &mut Vec::new());
    let mut out = Locality::default();
    if let Some(port) = translated
        .ports
        .iter()
        .find(|p| p.external_policy == TrafficPolicy::Local)
        .and_then(|p| p.health_check_node_port)
    {
        let local: BTreeSet<IpAddr> =
            by_port.values().flatten().filter(|e| e.is_local && e.ready).map(|e| e.ip).collect();
        out.health_check = Some((port, local.len()));
    }
    // Usable as kube-proxy categorizes: ready, or serving while terminating (the fallback).
    let usable = |e: &&crate::model::Endpoint| e.ready || (e.serving && e.terminating);
    for port in &translated.ports {
        let endpoints = by_port.get(&(port.name.port.clone(), port.protocol)).into_iter().flatten();
        let usable: Vec<_> = endpoints.filter(usable).collect();
        if usable.is_empty() || usable.iter().any(|e| e.is_local) {
            continue;
        }
        out.no_local_internal += usize::from(port.internal_policy == TrafficPolicy::Local);
        out.no_local_external +=
            usize::from(port.external_policy == TrafficPolicy::Local && port.externally_accessible());
    }
    out
}

/// What a [`ClusterState::update`] may have changed in the desired entries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Changed {
    #[default]
    /// Anything: compare every entry.
    All,
    /// Only these keys (added, changed or removed).
    Keys(BTreeSet<ServiceKey>),
}

/// Counts of what was skipped, for logs and status.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SkipCounts {
    pub objects: u64,
    pub parts: u64,
    pub conflicts: u64,
}

/// Two services claim one frontend address: `service` lost it to `owner` (the older).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    pub service: ObjectKey,
    pub address: String,
    pub owner: ObjectKey,
}

/// What the model keeps of the objects a source delivered, and the datapath entries derived
/// from them.
#[derive(Default)]
pub struct ClusterState {
    node: NodeInfo,
    options: ProxyOptions,
    services: BTreeMap<ObjectKey, ServiceInfo>,
    slices: BTreeMap<ObjectKey, SliceInfo>,
    /// Service → its slices (by slice key).
    slices_of: BTreeMap<ObjectKey, BTreeSet<ObjectKey>>,
    /// Counts changes to `slices`: what is derived from every slice is derived again only
    /// when it moved.
    slices_changed: u64,
    /// Cached per-service entries; recomputed for services in `dirty`.
    entries: BTreeMap<ObjectKey, Vec<(ServiceKey, DesiredPort)>>,
    /// Cached locality facts (health check, services without local endpoints), for the
    /// services that have any (most have none: not kept).
    locality: BTreeMap<ObjectKey, Locality>,
    dirty: BTreeSet<ObjectKey>,
    /// The merged entries as of the last [`ClusterState::update`]; `None` before the first.
    assembled: Option<Desired>,
    /// What the updates changed since [`ClusterState::take_changed`] last ran (another
    /// reader's update, `kpr diff`'s or shadow mode's, does not take it from the datapath's).
    unwritten: Changed,
    /// Counts changes to `services` (for what is derived from every Service).
    services_changed: u64,
    /// [`ClusterState::sample_cluster_ip`] and the `services_changed` it was taken at.
    sample: Option<(u64, Option<std::net::Ipv4Addr>)>,
    services_synced: bool,
    slices_synced: bool,
    reported_conflicts: BTreeSet<(ServiceKey, ObjectKey)>,
    /// Conflicts found since [`ClusterState::take_new_conflicts`] last ran.
    new_conflicts: Vec<Conflict>,
    pub skips: SkipCounts,
}

impl ClusterState {
    pub fn new(node: NodeInfo) -> Self {
        Self::with_options(node, ProxyOptions::default())
    }

    pub fn with_options(node: NodeInfo, options: ProxyOptions) -> Self {
        Self { node, options, ..Default::default() }
    }

    pub fn node(&self) -> &NodeInfo {
        &self.node
    }

    /// The node changed (its labels, its addresses): every service is recomputed.
    pub fn set_node(&mut self, node: NodeInfo) {
        if node != self.node {
            self.node = node;
            self.dirty.extend(self.services.keys().cloned());
        }
    }

    /// Both initial lists have arrived: only now may the datapath be programmed.
    pub fn synced(&self) -> bool {
        self.services_synced && self.slices_synced
    }

    pub fn has_changes(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Conflicts found by [`ClusterState::desired`] since the last call (each reported once).
    pub fn take_new_conflicts(&mut self) -> Vec<Conflict> {
        std::mem::take(&mut self.new_conflicts)
    }

    pub fn apply_service(&mut self, svc: Service) {
        let Some(key) = service::object_key(&svc.metadata) else {
            self.skip("Service", "<unnamed>", &Skip::Unnamed);
            return;
        };
        let info = ServiceInfo::new(&svc, self.options.service_proxy_name);
        if self.services.get(&key) != Some(&info) {
            self.services_changed += 1;
            self.dirty.insert(key.clone());
            self.services.insert(key, info);
        }
    }

    pub fn delete_service(&mut self, key: &ObjectKey) {
        if self.services.remove(key).is_some() {
            self.services_changed += 1;
            self.dirty.insert(key.clone());
        }
    }

    pub fn apply_slice(&mut self, slice: EndpointSlice) {
        let Some(key) = service::object_key(&slice.metadata) else {
            self.skip("EndpointSlice", "<unnamed>", &Skip::Unnamed);
            return;
        };
        let slice = match SliceInfo::new(slice, self.options.service_proxy_name) {
            Ok(slice) => slice,
            Err(e) => {
                self.skip("EndpointSlice", &key.to_string(), &e);
                self.delete_slice(&key);
                return;
            }
        };
        if self.slices.get(&key) == Some(&slice) {
            return;
        }
        let owner = slice.service.clone();
        // A slice may (in theory) be relabelled to another service: unlink it from the old one.
        self.delete_slice(&key);
        self.slices_of.entry(owner.clone()).or_default().insert(key.clone());
        self.slices.insert(key, slice);
        self.slices_changed += 1;
        self.dirty.insert(owner);
    }

    pub fn delete_slice(&mut self, key: &ObjectKey) {
        if let Some(old) = self.slices.remove(key) {
            self.slices_changed += 1;
            let owner = old.service;
            if let Some(set) = self.slices_of.get_mut(&owner) {
                set.remove(key);
                if set.is_empty() {
                    self.slices_of.remove(&owner);
                }
            }
            self.dirty.insert(owner);
        }
    }

    /// A full list (initial list, relist after a watch error, manifest reload): objects absent
    /// from it are deleted. Marks services as synced.
    pub fn replace_services(&mut self, all: Vec<Service>) {
        let keep: BTreeSet<ObjectKey> = all.iter().filter_map(|s| service::object_key(&s.metadata)).collect();
        let gone: Vec<ObjectKey> = self.services.keys().filter(|k| !keep.contains(*k)).cloned().collect();
        for key in gone {
            self.delete_service(&key);
        }
        for svc in all {
            self.apply_service(svc);
        }
        self.services_synced = true;
    }

    /// Like [`Self::replace_services`], for EndpointSlices.
    pub fn replace_slices(&mut self, all: Vec<EndpointSlice>) {
        let keep: BTreeSet<ObjectKey> = all.iter().filter_map(|s| service::object_key(&s.metadata)).collect();
        let gone: Vec<ObjectKey> = self.slices.keys().filter(|k| !keep.contains(*k)).cloned().collect();
        for key in gone {
            self.delete_slice(&key);
        }
        for slice in all {
            self.apply_slice(slice);
        }
        self.slices_synced = true;
    }

    /// Recompute the changed services and return the whole desired datapath content.
    /// Two services claiming the same ClusterIP:port/proto: the older one wins.
    pub fn desired(&mut self) -> Desired {
        self.update();
        self.assembled().clone()
    }

    /// The desired datapath content as of the last [`Self::update`].
    pub fn assembled(&self) -> &Desired {
        static EMPTY: Desired = Desired::new();
        self.assembled.as_ref().unwrap_or(&EMPTY)
    }

    /// Recompute the changed services and bring [`Self::assembled`] in line: which entries
    /// may differ from before. Only the changed services' entries are touched, unless a
    /// frontend is contested (two services claim it: who wins depends on every claimant) or
    /// most services changed; then everything is merged again.
    pub fn update(&mut self) -> Changed {
        let dirty = std::mem::take(&mut self.dirty);
        let mut before: BTreeMap<ObjectKey, Vec<ServiceKey>> = BTreeMap::new();
        for key in &dirty {
            let old = self.entries.get(key).map(|e| e.iter().map(|(k, _)| *k).collect()).unwrap_or_default();
            before.insert(key.clone(), old);
            self.recompute(key);
        }
        let piecewise = self.assembled.is_some()
            && self.reported_conflicts.is_empty()
            && dirty.len() * 2 <= self.services.len().max(1);
        let merged = if piecewise { self.merge_changed(&before) } else { None };
        let changed = match merged {
            Some(keys) => Changed::Keys(keys),
            None => {
                self.assemble();
                Changed::All
            }
        };
        self.unwritten = match (std::mem::take(&mut self.unwritten), &changed) {
            (Changed::Keys(mut before), Changed::Keys(now)) => {
                before.extend(now);
                Changed::Keys(before)
            }
            _ => Changed::All,
        };
        changed
    }

    /// What changed in [`Self::assembled`] since the last call (everything, the first time):
    /// what the datapath has yet to be given.
    pub fn take_changed(&mut self) -> Changed {
        std::mem::replace(&mut self.unwritten, Changed::Keys(BTreeSet::new()))
    }

    /// Recompute one service's entries and locality.
    fn recompute(&mut self, key: &ObjectKey) {
        let Some(svc) = self.services.get(key) else {
            self.entries.remove(key);
            self.locality.remove(key);
            return;
        };
        let slices = || self.slices_of.get(key).into_iter().flatten().filter_map(|k| self.slices.get(k));
        let locality = locality(svc, slices(), &self.node);
        let mut skipped = Vec::new();
        let entries = service_entries(svc, slices(), &self.node, &self.options, &mut skipped);
        if locality == Locality::default() {
            self.locality.remove(key);
        } else {
            self.locality.insert(key.clone(), locality);
        }
        match entries {
            Ok(entries) => {
                self.entries.insert(key.clone(), entries);
            }
            Err(e) => {
                self.entries.remove(key);
                self.skip("Service", &key.to_string(), &e);
            }
        }
        for (part, reason) in skipped {
            self.skips.parts += 1;
            tracing::warn!(service = %key, part = %part, "skipped part of the service or its slices: {reason}");
        }
    }

    /// Put the changed services' entries (their keys before the change in `before`) into
    /// `assembled`: the keys that may differ, or `None` when a key is (or was) another
    /// service's, which only a whole merge settles.
    fn merge_changed(&mut self, before: &BTreeMap<ObjectKey, Vec<ServiceKey>>) -> Option<BTreeSet<ServiceKey>> {
        let assembled = self.assembled.as_mut()?;
        let owned_by = |assembled: &Desired, key: &ServiceKey, service: &ObjectKey| {
            assembled.get(key).is_none_or(|p| p.name.service == *service)
        };
        for (service, old) in before {
            let new = self.entries.get(service).into_iter().flatten().map(|(k, _)| k);
            if !old.iter().chain(new).all(|k| owned_by(assembled, k, service)) {
                return None;
            }
        }
        let mut changed = BTreeSet::new();
        for key in before.values().flatten() {
            assembled.remove(key);
            changed.insert(*key);
        }
        for (key, port) in before.keys().filter_map(|s| self.entries.get(s)).flatten() {
            if assembled.insert(*key, port.clone()).is_some() {
                // Two changed services claim one key: settled by a whole merge.
                return None;
            }
            changed.insert(*key);
        }
        Some(changed)
    }

    /// Merge every service's entries into `assembled`. Two services claiming one frontend (an
    /// externalIP or LoadBalancer IP another service already has): the older service keeps it
    /// (creationTimestamp, then namespace/name), so a newcomer cannot take an address by its
    /// name.
    fn assemble(&mut self) {
        let mut desired = Desired::new();
        let mut conflicts = BTreeSet::new();
        let mut owners: Vec<(&ObjectKey, &Vec<(ServiceKey, DesiredPort)>)> = self.entries.iter().collect();
        owners.sort_by_key(|(owner, _)| {
            let created = self.services.get(*owner).and_then(|s| s.created);
            (created.is_none(), created, (*owner).clone())
        });
        for (owner, entries) in owners {
            for (key, port) in entries {
                if let Some(winner) = desired.get(key) {
                    // Every frontend has a pod-scope entry: one report per frontend.
                    if winner.name.service != *owner && key.scope == SCOPE_POD {
                        conflicts.insert((*key, owner.clone()));
                    }
                    continue;
                }
                desired.insert(*key, port.clone());
            }
        }
        for (key, loser) in conflicts.difference(&self.reported_conflicts) {
            self.skips.conflicts += 1;
            let address = super::display_key(key).to_string();
            let owner = desired[key].name.service.clone();
            tracing::warn!(service = %loser, %address, %owner, "skipped: the address is already used by another service");
            self.new_conflicts.push(Conflict { service: loser.clone(), address, owner });
        }
        self.reported_conflicts = conflicts;
        self.assembled = Some(desired);
    }

    /// What the Service's `kpr.io/outlier-detection` annotation says, if it says on or off.
    pub fn outlier_detection(&self, service: &ObjectKey) -> Option<bool> {
        self.services.get(service)?.outlier_detection
    }

    /// The lowest IPv4 ClusterIP of the services (for the route the node's ClusterIP traffic
    /// takes); `None` without services.
    pub fn sample_cluster_ip(&mut self) -> Option<std::net::Ipv4Addr> {
        if let Some((at, sample)) = self.sample
            && at == self.services_changed
        {
            return sample;
        }
        let sample = self
            .services
            .values()
            .filter_map(|s| s.translated.as_ref().ok()?.ports.first())
            .flat_map(|p| &p.cluster_ips)
            .filter_map(|ip| match ip {
                IpAddr::V4(ip) => Some(*ip),
                IpAddr::V6(_) => None,
            })
            .min();
        self.sample = Some((self.services_changed, sample));
        sample
    }

    /// A number that changes whenever a slice is added, changed or removed.
    pub fn slices_changed(&self) -> u64 {
        self.slices_changed
    }

    /// The IPv4 addresses of every service's endpoints.
    pub fn ipv4_endpoints(&self) -> BTreeSet<IpAddr> {
        self.slices.values().flat_map(|s| s.addresses()).filter(IpAddr::is_ipv4).collect()
    }

    /// healthCheckNodePort → (service, local endpoints), as of the last [`Self::desired`].
    pub fn health_checks(&self) -> BTreeMap<u16, (ObjectKey, usize)> {
        let checks = self.locality.iter().filter_map(|(k, l)| l.health_check.map(|(port, n)| (port, (k.clone(), n))));
        checks.collect()
    }

    /// Service ports with a Local policy and no local endpoints (internal, external), as of
    /// the last [`Self::desired`].
    pub fn no_local_endpoints(&self) -> (usize, usize) {
        self.locality.values().fold((0, 0), |(i, x), l| (i + l.no_local_internal, x + l.no_local_external))
    }

    fn skip(&mut self, kind: &str, name: &str, reason: &Skip) {
        self.skips.objects += 1;
        tracing::warn!(kind, name, "skipped: {reason}");
    }
}

#[cfg(test)]
mod tests;
