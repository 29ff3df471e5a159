//! Services, EndpointSlices and Nodes from a directory of Kubernetes YAML (or JSON) manifests,
//! as `kubectl get -o yaml` prints them: single objects, multi-document files, or `List`s.
//! The directory is reloaded whenever a file in it changes; every reload is a full list, sent
//! as one event. The Node named like this node gives its labels and addresses, as the API
//! source's Node watch does.
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result};
use k8s_openapi::api::{
    core::v1::{Namespace, Node, Pod, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use notify::{RecursiveMode, Watcher as _};
use serde::Deserialize as _;
use tokio::sync::mpsc;

use super::SourceEvent;
use crate::model::{
    ObjectKey,
    node::NodeObject,
    service::object_key,
    socket_lb::{self, PodFacts},
};

/// Everything found in the directory.
#[derive(Debug, Default)]
pub struct Loaded {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
    pub service_cidrs: Vec<ServiceCIDR>,
    pub pods: Vec<Pod>,
    pub namespaces: Vec<Namespace>,
    /// Documents that could not be used, with the reason (already logged).
    pub errors: Vec<String>,
}

/// Read every `*.yaml`, `*.yml` and `*.json` file of `dir`, in name order. A document that does
/// not parse is logged and skipped; the rest of the directory still loads. An object defined
/// twice keeps its first definition.
pub fn load_dir(dir: &Path) -> Result<Loaded> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("failed to read manifest directory {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml" || e == "json"))
        .collect();
    files.sort();
    let mut loaded = Loaded::default();
    let mut seen = BTreeSet::new();
    for file in files {
        match std::fs::read_to_string(&file) {
            Ok(text) => load_text(&text, &file.display().to_string(), &mut loaded, &mut seen),
            Err(e) => loaded.error(format!("{}: {e}", file.display())),
        }
    }
    Ok(loaded)
}

impl Loaded {
    fn error(&mut self, message: String) {
        tracing::warn!("skipped manifest: {message}");
        self.errors.push(message);
    }
}

fn load_text(text: &str, origin: &str, out: &mut Loaded, seen: &mut BTreeSet<(&'static str, ObjectKey)>) {
    for (index, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        match serde_yaml::Value::deserialize(doc) {
            Ok(value) => load_value(value, &format!("{origin} document {}", index + 1), out, seen),
            Err(e) => {
                // A syntax error ends the stream: later documents of this file are not reachable.
                out.error(format!("{origin} document {}: {e}", index + 1));
                break;
            }
        }
    }
}

fn load_value(
    value: serde_yaml::Value,
    origin: &str,
    out: &mut Loaded,
    seen: &mut BTreeSet<(&'static str, ObjectKey)>,
) {
    if value.is_null() {
        return;
    }
    let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or_default().to_owned();
    match kind.as_str() {
        "Service" => match serde_yaml::from_value::<Service>(value) {
            Ok(svc) if keep_first(seen, "Service", &svc.metadata, origin, out) => out.services.push(svc),
            Ok(_) => {}
            Err(e) => out.error(format!("{origin}: invalid Service: {e}")),
        },
        "EndpointSlice" => match serde_yaml::from_value::<EndpointSlice>(value) {
            Ok(slice) if keep_first(seen, "EndpointSlice", &slice.metadata, origin, out) => out.slices.push(slice),
            Ok(_) => {}
            Err(e) => out.error(format!("{origin}: invalid EndpointSlice: {e}")),
        },
        "Node" => match serde_yaml::from_value::<Node>(value) {
            Ok(node) if keep_first(seen, "Node", &node.metadata, origin, out) => out.nodes.push(node),
            Ok(_) => {}
            Err(e) => out.error(format!("{origin}: invalid Node: {e}")),
        },
        "Pod" => match serde_yaml::from_value::<Pod>(value) {
            Ok(pod) if keep_first(seen, "Pod", &pod.metadata, origin, out) => out.pods.push(pod),
            Ok(_) => {}
            Err(e) => out.error(format!("{origin}: invalid Pod: {e}")),
        },
        "Namespace" => match serde_yaml::from_value::<Namespace>(value) {
            Ok(ns) => out.namespaces.push(ns),
            Err(e) => out.error(format!("{origin}: invalid Namespace: {e}")),
        },
        "ServiceCIDR" => match serde_yaml::from_value::<ServiceCIDR>(value) {
            Ok(cidr) => out.service_cidrs.push(cidr),
            Err(e) => out.error(format!("{origin}: invalid ServiceCIDR: {e}")),
        },
        k if k == "List" || k.ends_with("List") => {
            let items = value.get("items").and_then(|i| i.as_sequence()).cloned().unwrap_or_default();
            for (i, item) in items.into_iter().enumerate() {
                load_value(item, &format!("{origin} item {}", i + 1), out, seen);
            }
        }
        other => tracing::debug!(origin, kind = other, "ignored: not a kind kpr reads"),
    }
}

fn keep_first(
    seen: &mut BTreeSet<(&'static str, ObjectKey)>,
    kind: &'static str,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    origin: &str,
    out: &mut Loaded,
) -> bool {
    let Some(key) = object_key(meta) else {
        out.error(format!("{origin}: {kind} without a name"));
        return false;
    };
    if seen.insert((kind, key.clone())) {
        return true;
    }
    out.error(format!("{origin}: duplicate {kind} {key}, keeping the first definition"));
    false
}

/// Load `dir`, send it, and again after every change, until the receiver goes away.
/// `node_name` picks this node's Node among the manifests.
pub async fn run(dir: PathBuf, node_name: String, tx: mpsc::Sender<SourceEvent>) -> Result<()> {
    let (changed_tx, mut changed) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok_and(|e| !e.kind.is_access()) {
            let _ = changed_tx.send(());
        }
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive).with_context(|| format!("failed to watch {}", dir.display()))?;
    loop {
        match load_dir(&dir) {
            Ok(loaded) => {
                tracing::info!(
                    dir = %dir.display(),
                    services = loaded.services.len(),
                    slices = loaded.slices.len(),
                    nodes = loaded.nodes.len(),
                    skipped = loaded.errors.len(),
                    "loaded manifests"
                );
                let node = loaded.nodes.iter().find(|n| n.metadata.name.as_deref() == Some(&node_name));
                // This node's pods, as the API source's field selector picks them.
                let on_node = |p: &&Pod| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&node_name);
                let event = SourceEvent::ManifestsLoaded {
                    node: node.map(NodeObject::from_node),
                    service_cidrs: super::service_cidrs(&loaded.service_cidrs),
                    pods: loaded.pods.iter().filter(on_node).filter_map(PodFacts::from_pod).collect(),
                    namespaces: loaded.namespaces.iter().filter_map(socket_lb::namespace_setting).collect(),
                    down_nodes: loaded
                        .nodes
                        .iter()
                        .filter(|n| crate::model::node::node_is_down(n))
                        .filter_map(|n| n.metadata.name.clone())
                        .collect(),
                    services: loaded.services,
                    slices: loaded.slices,
                };
                if tx.send(event).await.is_err() {
                    return Ok(());
                }
            }
            // The directory is unreadable for now: keep serving the last state, retry on change.
            Err(e) => tracing::error!("{e:#}; keeping the last loaded state"),
        }
        if changed.recv().await.is_none() {
            return Ok(());
        }
        // Coalesce a burst of writes (an editor saving, a test writing several files).
        tokio::time::sleep(Duration::from_millis(5)).await;
        while changed.try_recv().is_ok() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

    fn tempdir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kpr-manifests-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    const SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n";
    const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n";

    const NODES: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node-b, labels: {topology.kubernetes.io/zone: zone-b}}\n---\napiVersion: v1\nkind: Node\nmetadata: {name: node-a, labels: {topology.kubernetes.io/zone: zone-a}}\nspec: {podCIDR: 10.244.1.0/24, podCIDRs: [10.244.1.0/24]}\nstatus: {addresses: [{type: Hostname, address: node-a}, {type: InternalIP, address: 192.168.0.2}]}\n";

    #[test]
    fn loads_documents_lists_and_skips_bad_ones() {
        let dir = tempdir("load");
        write(&dir, "a.yaml", &format!("{SERVICE}---\n{SLICE}"));
        let list = format!(
            "apiVersion: v1\nkind: List\nitems:\n- {}",
            serde_json::to_string(&serde_yaml::from_str::<serde_yaml::Value>(&SERVICE.replace("web", "api")).unwrap())
                .unwrap()
        );
        write(&dir, "b.json", &list);
        write(&dir, "c.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: broken}\nspec: {ports: not-a-list}\n");
        write(&dir, "d.yaml", "kind: Service\n  bad: indentation: here\n");
        write(&dir, "e.yaml", SERVICE); // duplicate of shop/web
        write(&dir, "f.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n");
        write(&dir, "notes.txt", "not a manifest");

        let loaded = load_dir(&dir).unwrap();
        let names: Vec<_> = loaded.services.iter().map(|s| s.metadata.name.clone().unwrap()).collect();
        assert_eq!(names, ["web", "api"]);
        assert_eq!(loaded.slices.len(), 1);
        assert_eq!(loaded.errors.len(), 3, "{:?}", loaded.errors);
        assert!(loaded.errors[0].contains("c.yaml") && loaded.errors[0].contains("invalid Service"));
        assert!(loaded.errors[1].contains("d.yaml"));
        assert!(loaded.errors[2].contains("duplicate Service shop/web"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn reloads_on_change() {
        let dir = tempdir("watch");
        write(&dir, "svc.yaml", SERVICE);
        let (tx, mut rx) = mpsc::channel(16);
        let task = tokio::spawn(run(dir.clone(), "node-a".into(), tx));
        let next = async |rx: &mut mpsc::Receiver<SourceEvent>| {
            tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("an event in time").unwrap()
        };
        assert!(matches!(next(&mut rx).await,
            SourceEvent::ManifestsLoaded { services, slices, node: None, .. } if services.len() == 1 && slices.is_empty()));
        write(&dir, "slice.yaml", SLICE);
        write(&dir, "nodes.yaml", NODES);
        let node = loop {
            match next(&mut rx).await {
                SourceEvent::ManifestsLoaded { services, slices, node: Some(node), .. } => {
                    assert_eq!((services.len(), slices.len()), (1, 1));
                    break node;
                }
                SourceEvent::ManifestsLoaded { .. } => continue, // the first file alone
                other => panic!("unexpected {other:?}"),
            }
        };
        assert_eq!(node.zone.as_deref(), Some("zone-a"));
        assert_eq!(node.addresses, ["192.168.0.2".parse::<std::net::IpAddr>().unwrap()]);
        assert_eq!(node.pod_cidrs, ["10.244.1.0/24".parse().unwrap()]);
        task.abort();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
