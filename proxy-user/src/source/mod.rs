//! Where Services and EndpointSlices come from. Every source produces the same [`SourceEvent`]s:
//! - [`kube`]: the Kubernetes API (kube-rs watchers), as kube-proxy's informers see it;
//! - [`manifests`]: a directory of YAML manifests, for nodes without a cluster and for tests.
pub mod kube;
pub mod manifests;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use crate::model::{ObjectKey, desired::ClusterState};

#[derive(Debug)]
pub enum SourceEvent {
    /// A complete list (initial list, relist, manifest reload): absent objects are gone.
    ServicesListed(Vec<Service>),
    SlicesListed(Vec<EndpointSlice>),
    ServiceApplied(Service),
    ServiceDeleted(ObjectKey),
    SliceApplied(EndpointSlice),
    SliceDeleted(ObjectKey),
}

impl SourceEvent {
    pub fn apply_to(self, state: &mut ClusterState) {
        match self {
            Self::ServicesListed(all) => state.replace_services(all),
            Self::SlicesListed(all) => state.replace_slices(all),
            Self::ServiceApplied(s) => state.apply_service(s),
            Self::ServiceDeleted(k) => state.delete_service(&k),
            Self::SliceApplied(s) => state.apply_slice(s),
            Self::SliceDeleted(k) => state.delete_slice(&k),
        }
    }
}
