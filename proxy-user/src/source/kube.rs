//! Services and EndpointSlices from the Kubernetes API, watched as kube-proxy watches them:
//! same label selector, a full list before anything is programmed, relists on watch errors
//! (410 Gone included) that replace the state without wiping it, and backoff on failures.
use std::{fmt::Debug, path::Path};

use anyhow::{Context as _, Result};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::{
    core::v1::{Namespace, Node, Pod, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use kube::{
    Api, Client, Config, Resource, ResourceExt as _,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt as _, watcher},
};
use tokio::sync::mpsc;

use super::SourceEvent;
use crate::model::{
    ObjectKey, ProxyOptions,
    node::NodeObject,
    service,
    socket_lb::{self, PodFacts},
};

/// The client configuration: a kubeconfig file, or in-cluster / `KUBECONFIG` inference when
/// none is given; `master` overrides the API server's address (kube-proxy's `--master`).
pub async fn config(kubeconfig: Option<&Path>, master: Option<&str>) -> Result<Config> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kc =
                Kubeconfig::read_from(path).with_context(|| format!("failed to read kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?
        }
        None => Config::infer().await.context("no kubeconfig and not running in a cluster")?,
    };
    if let Some(master) = master {
        config.cluster_url = master.parse().with_context(|| format!("--master {master:?} is not a URL"))?;
    }
    Ok(config)
}

/// Why the API server at `url` cannot be reached before kpr has programmed anything: it is the
/// `kubernetes` Service's ClusterIP (`KUBERNETES_SERVICE_HOST`, as in-cluster configuration
/// gives it) and `programmed` says no service entry translates it yet (after a reboot).
pub fn bootstrap_problem(
    url: &http::Uri,
    service_host: Option<&str>,
    programmed: impl Fn(std::net::IpAddr, u16) -> bool,
) -> Option<String> {
    let host = url.host()?.trim_start_matches('[').trim_end_matches(']');
    let ip: std::net::IpAddr = host.parse().ok()?;
    if service_host != Some(host) {
        return None;
    }
    let port = url.port_u16().unwrap_or(443);
    if programmed(ip, port) {
        return None; // a restart: the pinned datapath still translates it
    }
    Some(format!(
        "the API server address {url} is the `kubernetes` Service, which nothing translates until kpr has \
         synced (a deadlock after a reboot): give kpr a direct address of the API server with \
         --master https://<control-plane>:6443 or a kubeconfig (clientConnection.kubeconfig; \
         kubeadm's kube-proxy ConfigMap has one)"
    ))
}

/// Watch Services and EndpointSlices (this proxy's: `options.service_proxy_name`), this node's
/// Node and Pods, the Namespaces (and, when the service range is refused, the ServiceCIDRs)
/// until the receiver goes away.
pub async fn run(
    client: Client,
    node_name: String,
    options: ProxyOptions,
    tx: mpsc::Sender<SourceEvent>,
) -> Result<()> {
    // Lists (and relists) are served from the API server's watch cache (resourceVersion 0),
    // as client-go informers do: a quorum read from etcd per node does not scale to thousands.
    let config = watcher::Config::default().any_semantic().labels(&service::label_selector(options.service_proxy_name));
    let service_cidrs = options.refuse_service_range;
    let services = watch::<Service>(
        Api::all(client.clone()),
        config.clone(),
        tx.clone(),
        SourceEvent::ServicesListed,
        SourceEvent::ServiceApplied,
        SourceEvent::ServiceDeleted,
    );
    let slices = watch::<EndpointSlice>(
        Api::all(client.clone()),
        config,
        tx.clone(),
        SourceEvent::SlicesListed,
        SourceEvent::SliceApplied,
        SourceEvent::SliceDeleted,
    );
    // Only the socket path's opt-outs need them: without the permission, none.
    let no_permission =
        || Unavailable { when: forbidden, why: "no permission to watch them: no pod opts out of the socket path" };
    let pods = watch_snapshot::<Pod, PodFacts>(
        Api::all(client.clone()),
        watcher::Config::default().any_semantic().fields(&format!("spec.nodeName={node_name}")),
        tx.clone(),
        |pod| PodFacts::from_pod(pod).map(|f| (f.uid.clone(), f)),
        |pods| SourceEvent::Pods(pods.into_values().collect()),
        no_permission(),
    );
    let namespaces = watch_snapshot::<Namespace, String>(
        Api::all(client.clone()),
        watcher::Config::default().any_semantic(),
        tx.clone(),
        socket_lb::namespace_setting,
        SourceEvent::Namespaces,
        no_permission(),
    );
    // Only ending TCP flows to dead endpoints needs every Node (their readiness).
    let (nodes_api, nodes_tx) = (Api::all(client.clone()), tx.clone());
    let down_nodes = async move {
        if !options.abort_dead_tcp {
            return Ok(());
        }
        watch_snapshot::<Node, ()>(
            nodes_api,
            watcher::Config::default().any_semantic(),
            nodes_tx,
            |node| crate::model::node::node_is_down(node).then(|| (node.name_any(), ())),
            |down| SourceEvent::DownNodes(down.into_keys().collect()),
            Unavailable {
                when: forbidden,
                why: "no permission to watch Nodes: TCP flows to endpoints on a NotReady node are not ended",
            },
        )
        .await
    };
    let node = watch_node(Api::all(client.clone()), node_name, tx.clone());
    let cidrs = async { if service_cidrs { watch_service_cidrs(Api::all(client), tx).await } else { Ok(()) } };
    tokio::try_join!(services, slices, node, cidrs, pods, namespaces, down_nodes)?;
    Ok(())
}

/// When a watched kind cannot be listed at all, and what that means (logged once; the kind
/// then counts as empty and is not watched again).
struct Unavailable {
    when: fn(&watcher::Error) -> bool,
    why: &'static str,
}

/// Objects of kind `K` reduced to what kpr needs of them (`facts`: key and value, None to
/// leave one out), sent whole after every change.
async fn watch_snapshot<K, T>(
    api: Api<K>,
    config: watcher::Config,
    tx: mpsc::Sender<SourceEvent>,
    facts: fn(&K) -> Option<(String, T)>,
    send: fn(std::collections::BTreeMap<String, T>) -> SourceEvent,
    unavailable: Unavailable,
) -> Result<()>
where
    K: Resource<DynamicType = ()> + Clone + Debug + serde::de::DeserializeOwned + Send + 'static,
    T: Clone,
{
    let kind = K::kind(&());
    let mut stream = watcher(api, config).default_backoff().boxed();
    // By object name (namespace/name): a Delete names the object, not its facts.
    let mut known: std::collections::BTreeMap<String, (String, T)> = Default::default();
    let mut listing: Option<std::collections::BTreeMap<String, (String, T)>> = None;
    let id = |o: &K| format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any());
    loop {
        match stream.try_next().await {
            Ok(Some(watcher::Event::Init)) => listing = Some(Default::default()),
            Ok(Some(watcher::Event::InitApply(o))) => {
                if let Some(f) = facts(&o) {
                    listing.get_or_insert_with(Default::default).insert(id(&o), f);
                }
            }
            Ok(Some(watcher::Event::InitDone)) => known = listing.take().unwrap_or_default(),
            Ok(Some(watcher::Event::Apply(o))) => match facts(&o) {
                Some(f) => {
                    known.insert(id(&o), f);
                }
                None => {
                    known.remove(&id(&o));
                }
            },
            Ok(Some(watcher::Event::Delete(o))) => {
                known.remove(&id(&o));
            }
            Ok(None) => return Ok(()),
            Err(e) if (unavailable.when)(&e) => {
                // A missing permission is the operator's to fix; a kind the API server does not
                // serve (an older Kubernetes) is expected.
                if forbidden(&e) {
                    tracing::warn!(%kind, "{}", unavailable.why);
                } else {
                    tracing::info!(%kind, "{}", unavailable.why);
                }
                let _ = tx.send(send(Default::default())).await;
                return Ok(());
            }
            Err(e) => {
                tracing::warn!(%kind, "watch failed, retrying: {e}");
                continue;
            }
        }
        if listing.is_none() && tx.send(send(known.values().cloned().collect())).await.is_err() {
            return Ok(());
        }
    }
}

/// The API server refused the list for want of permission (403).
fn forbidden(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::InitialListFailed(kube::Error::Api(status)) if status.code == 403)
}

/// The cluster's ServiceCIDRs, sent whole after every change; before Kubernetes 1.33 (or with
/// the API off) none, so nothing is refused.
async fn watch_service_cidrs(api: Api<ServiceCIDR>, tx: mpsc::Sender<SourceEvent>) -> Result<()> {
    let unavailable =
        Unavailable { when: not_served, why: "not served by the API server: no service range is refused" };
    watch_snapshot::<ServiceCIDR, ServiceCIDR>(
        api,
        watcher::Config::default().any_semantic(),
        tx,
        |cidr| Some((cidr.name_any(), cidr.clone())),
        |cidrs| SourceEvent::ServiceCidrs(super::service_cidrs(cidrs.values())),
        unavailable,
    )
    .await
}

/// The API server does not serve the resource at all (404 on the list).
fn not_served(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::InitialListFailed(kube::Error::Api(status)) if status.code == 404)
}

/// This node's Node (labels → topology, addresses, podCIDRs), followed for changes.
async fn watch_node(api: Api<Node>, name: String, tx: mpsc::Sender<SourceEvent>) -> Result<()> {
    let config = watcher::Config::default().any_semantic().fields(&format!("metadata.name={name}"));
    let mut stream = watcher(api, config).default_backoff().boxed();
    let mut listing: Option<Node> = None;
    loop {
        let event = match stream.try_next().await {
            Ok(Some(event)) => event,
            Ok(None) => return Ok(()),
            Err(e) => {
                tracing::warn!(node = %name, "Node watch failed, retrying: {e}");
                continue;
            }
        };
        let node = match event {
            watcher::Event::Init => {
                listing = None;
                continue;
            }
            watcher::Event::InitApply(node) => {
                listing = Some(node);
                continue;
            }
            watcher::Event::InitDone => {
                if listing.is_none() {
                    tracing::warn!(node = %name, "Node not found: topology hints and the Node's addresses are unused");
                }
                listing.take()
            }
            watcher::Event::Apply(node) => Some(node),
            watcher::Event::Delete(_) => None,
        };
        if tx.send(SourceEvent::Node(node.as_ref().map(NodeObject::from_node))).await.is_err() {
            return Ok(());
        }
    }
}

async fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    tx: mpsc::Sender<SourceEvent>,
    listed: fn(Vec<K>) -> SourceEvent,
    applied: fn(K) -> SourceEvent,
    deleted: fn(ObjectKey) -> SourceEvent,
) -> Result<()>
where
    K: Resource<DynamicType = ()> + Clone + Debug + serde::de::DeserializeOwned + Send + 'static,
{
    let kind = K::kind(&());
    let mut stream = watcher(api, config).default_backoff().modify(|o| o.managed_fields_mut().clear()).boxed();
    // Objects of a (re)list, delivered as one replacement when the list is complete.
    let mut listing: Option<Vec<K>> = None;
    loop {
        let event = match stream.try_next().await {
            Ok(Some(event)) => event,
            Ok(None) => return Ok(()),
            Err(e) => {
                // The backoff delays the retry; the datapath keeps serving the last state.
                tracing::warn!(%kind, "watch failed, retrying: {e}");
                continue;
            }
        };
        let out = match event {
            watcher::Event::Init => {
                listing = Some(Vec::new());
                continue;
            }
            watcher::Event::InitApply(obj) => {
                listing.get_or_insert_with(Vec::new).push(obj);
                continue;
            }
            watcher::Event::InitDone => {
                let all = listing.take().unwrap_or_default();
                tracing::info!(%kind, count = all.len(), "listed");
                listed(all)
            }
            watcher::Event::Apply(obj) => applied(obj),
            watcher::Event::Delete(obj) => deleted(ObjectKey::new(obj.namespace().unwrap_or_default(), obj.name_any())),
        };
        if tx.send(out).await.is_err() {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod bootstrap_tests {
    use super::bootstrap_problem;

    #[test]
    fn the_kubernetes_service_is_no_way_to_reach_the_api_server_before_kpr() {
        let url: http::Uri = "https://10.96.0.1:443".parse().unwrap();
        let nothing = |_, _| false;
        let programmed = |ip: std::net::IpAddr, port| ip.to_string() == "10.96.0.1" && port == 443;
        let problem = bootstrap_problem(&url, Some("10.96.0.1"), nothing).expect("a deadlock after a reboot");
        assert!(problem.contains("--master"), "{problem}");
        assert_eq!(bootstrap_problem(&url, Some("10.96.0.1"), programmed), None, "a restart on the pinned datapath");
        let direct: http::Uri = "https://192.168.0.10:6443".parse().unwrap();
        assert_eq!(bootstrap_problem(&direct, Some("10.96.0.1"), nothing), None, "a direct address");
        assert_eq!(bootstrap_problem(&url, None, nothing), None, "not in a pod");
    }
}
