//! Where the agent's inputs come from. Every source produces the same [`SourceEvent`]s:
//! - [`kube`]: the Kubernetes API (kube-rs watchers), as kube-proxy's informers see it;
//! - [`manifests`]: a directory of YAML manifests, for nodes without a cluster and for tests;
//! - [`host`]: the node's links and addresses, from the kernel;
//! - [`cgroups`]: where the node's pods are in the cgroup2 hierarchy;
//! - [`backends`]: how the watched endpoints answer new flows (outlier detection);
//! - [`kube_proxy_rules`]: the running kube-proxy's decisions, read back from its rules
//!   (shadow mode).
pub mod backends;
pub mod cgroups;
pub mod firewall;
pub mod host;
pub mod kube;
pub mod kube_proxy_rules;
pub mod manifests;

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use crate::model::{
    ObjectKey,
    cidr::Cidr,
    node::{HostLink, NodeObject},
    socket_lb::PodFacts,
};

/// The CIDRs of `networking.k8s.io/v1` ServiceCIDR objects (malformed ones are skipped).
pub fn service_cidrs<'a>(
    objects: impl IntoIterator<Item = &'a k8s_openapi::api::networking::v1::ServiceCIDR>,
) -> Vec<Cidr> {
    let mut out: Vec<Cidr> = objects
        .into_iter()
        .flat_map(|o| o.spec.iter().flat_map(|s| s.cidrs.iter().flatten()))
        .filter_map(|c| c.parse().ok())
        .collect();
    out.sort();
    out.dedup();
    out
}

// A Service is the largest variant (824 bytes): events go one by one through a short channel,
// so boxing it would buy nothing but an allocation per event.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum SourceEvent {
    /// A complete list (initial list, relist): absent objects are gone.
    ServicesListed(Vec<Service>),
    SlicesListed(Vec<EndpointSlice>),
    ServiceApplied(Service),
    ServiceDeleted(ObjectKey),
    SliceApplied(EndpointSlice),
    SliceDeleted(ObjectKey),
    /// A manifest directory (re)loaded: everything at once, so no sync ever sees the new
    /// Services with the old slices.
    ManifestsLoaded {
        services: Vec<Service>,
        slices: Vec<EndpointSlice>,
        node: Option<NodeObject>,
        service_cidrs: Vec<Cidr>,
        pods: Vec<PodFacts>,
        namespaces: BTreeMap<String, String>,
        /// The Nodes among the manifests that are not Ready.
        down_nodes: BTreeSet<String>,
    },
    /// This node's Pods, all of them (what the socket path's opt-out needs of them).
    Pods(Vec<PodFacts>),
    /// The Namespaces that set `kpr.io/socket-lb`, all of them: name → value.
    Namespaces(BTreeMap<String, String>),
    /// The cluster's service ranges (`networking.k8s.io/v1` ServiceCIDRs), all of them.
    ServiceCidrs(Vec<Cidr>),
    /// This node's `v1/Node` (None: absent or deleted).
    Node(Option<NodeObject>),
    /// The cluster's Nodes that are not Ready, all of them (`--abort-dead-tcp` only).
    DownNodes(BTreeSet<String>),
    /// The node's links and addresses, all of them.
    Host(Vec<HostLink>),
    /// How the endpoints outlier detection watches answer new flows, and when that was seen.
    Backends(std::time::Instant, crate::model::outliers::Observation),
}
