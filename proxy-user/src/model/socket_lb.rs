//! Which pods of this node the socket path leaves alone. A pod whose traffic something inside
//! it handles before it leaves (a service mesh's sidecar redirect that reads
//! `SO_ORIGINAL_DST`, a VM's guest kernel) must see the Service's address, as behind
//! kube-proxy: its connections are translated per packet on its link instead.
//!
//! The annotation `kpr.io/socket-lb` (`"on"` or `"off"`) on the Pod decides; else the same on
//! its Namespace; else a pod a mesh injected (Istio's `sidecar.istio.io/status`, Linkerd's
//! `linkerd.io/proxy-version`) is left alone, any other pod is translated at its sockets.
use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Namespace, Pod};

/// The annotation a Pod or a Namespace sets: `"off"` or `"on"`.
pub const ANNOTATION: &str = "kpr.io/socket-lb";

/// Annotations of a pod a service mesh's injector has given a sidecar.
pub const MESH_ANNOTATIONS: [&str; 2] = ["sidecar.istio.io/status", "linkerd.io/proxy-version"];

/// What the decision needs of a Pod of this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFacts {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// Its sockets are the node's (`hostNetwork`): never left to the per-packet path, which
    /// does not translate the node's own connections.
    pub host_network: bool,
    /// `kpr.io/socket-lb`, as written.
    pub setting: Option<String>,
    /// A mesh's annotation, if it has one.
    pub mesh: Option<&'static str>,
}

impl PodFacts {
    /// None: no uid (not a real object).
    pub fn from_pod(pod: &Pod) -> Option<Self> {
        let meta = &pod.metadata;
        let annotations = meta.annotations.as_ref();
        Some(Self {
            uid: meta.uid.clone()?,
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            host_network: pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false),
            setting: annotations.and_then(|a| a.get(ANNOTATION)).cloned(),
            mesh: MESH_ANNOTATIONS.into_iter().find(|m| annotations.is_some_and(|a| a.contains_key(*m))),
        })
    }
}

/// A Namespace's `kpr.io/socket-lb`, if it sets one: (name, value).
pub fn namespace_setting(namespace: &Namespace) -> Option<(String, String)> {
    let value = namespace.metadata.annotations.as_ref()?.get(ANNOTATION)?;
    Some((namespace.metadata.name.clone()?, value.clone()))
}

/// `"on"` → false, `"off"` → true; anything else is logged and counts as unset.
fn parse(value: &str, whose: &dyn Fn() -> String) -> Option<bool> {
    match value {
        "off" => Some(true),
        "on" => Some(false),
        other => {
            tracing::warn!(annotation = ANNOTATION, value = other, "{}: ignored, not \"on\" or \"off\"", whose());
            None
        }
    }
}

/// The uids of the pods whose sockets the socket path leaves alone.
pub fn opted_out<'a>(
    pods: impl IntoIterator<Item = &'a PodFacts>,
    namespaces: &BTreeMap<String, String>,
) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for pod in pods {
        let own = pod.setting.as_deref().and_then(|v| parse(v, &|| format!("pod {}/{}", pod.namespace, pod.name)));
        let by_namespace =
            || namespaces.get(&pod.namespace).and_then(|v| parse(v, &|| format!("namespace {}", pod.namespace)));
        let off = own.or_else(by_namespace).unwrap_or(pod.mesh.is_some());
        if off && pod.host_network {
            tracing::warn!(
                pod = %format!("{}/{}", pod.namespace, pod.name),
                "a hostNetwork pod's sockets are the node's: translated at the socket whatever its annotation"
            );
            continue;
        }
        if off {
            out.insert(pod.uid.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str, namespace: &str, setting: Option<&str>, mesh: bool) -> PodFacts {
        PodFacts {
            uid: uid.into(),
            namespace: namespace.into(),
            name: uid.into(),
            host_network: false,
            setting: setting.map(Into::into),
            mesh: mesh.then_some(MESH_ANNOTATIONS[0]),
        }
    }

    #[test]
    fn the_pod_decides_then_its_namespace_then_a_mesh() {
        let namespaces = BTreeMap::from([("quiet".to_owned(), "off".to_owned()), ("mesh".to_owned(), "on".to_owned())]);
        let pods = [
            pod("plain", "default", None, false),
            pod("asked-off", "default", Some("off"), false),
            pod("in-quiet", "quiet", None, false),
            pod("on-in-quiet", "quiet", Some("on"), false),
            pod("injected", "default", None, true),
            pod("injected-but-on", "default", Some("on"), true),
            pod("injected-in-on-namespace", "mesh", None, true),
            pod("typo", "quiet", Some("of"), false),
        ];
        let out: Vec<String> = opted_out(&pods, &namespaces).into_iter().collect();
        assert_eq!(out, ["asked-off", "in-quiet", "injected", "typo"]);
    }

    #[test]
    fn a_host_network_pod_stays_on_the_socket_path() {
        let mut host = pod("host", "default", Some("off"), false);
        host.host_network = true;
        assert!(opted_out(&[host], &BTreeMap::new()).is_empty());
    }

    #[test]
    fn facts_come_from_the_pod_object() {
        let pod: Pod = serde_yaml::from_str(
            "metadata: {name: app, namespace: shop, uid: 1234-5678, annotations: {sidecar.istio.io/status: '{}'}}\n\
             spec: {containers: [{name: app}], hostNetwork: false}\n",
        )
        .unwrap();
        let facts = PodFacts::from_pod(&pod).unwrap();
        assert_eq!(
            (facts.uid.as_str(), facts.mesh, facts.setting),
            ("1234-5678", Some("sidecar.istio.io/status"), None)
        );
        let ns: Namespace =
            serde_yaml::from_str("metadata: {name: shop, annotations: {kpr.io/socket-lb: 'off'}}").unwrap();
        assert_eq!(namespace_setting(&ns), Some(("shop".into(), "off".into())));
    }
}
