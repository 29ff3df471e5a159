//! Where the agent's inputs come from. Every source produces the same [`SourceEvent`]s:
//! - [`kube`]: the Kubernetes API (kube-rs watchers), as kube-proxy's informers see it;
//! - [`manifests`]: a directory of YAML manifests, for nodes without a cluster and for tests;
//! - [`host`]: the node's links and addresses, from the kernel.
pub mod host;
pub mod kube;
pub mod manifests;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use crate::model::{
    ObjectKey,
    node::{HostLink, NodeObject},
};

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
    ManifestsLoaded { services: Vec<Service>, slices: Vec<EndpointSlice>, node: Option<NodeObject> },
    /// This node's `v1/Node` (None: absent or deleted).
    Node(Option<NodeObject>),
    /// The node's links and addresses, all of them.
    Host(Vec<HostLink>),
}
