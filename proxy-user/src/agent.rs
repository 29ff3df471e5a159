//! The agent: source → model → plan → datapath, in one loop.
//!
//! Events are applied to the [`ClusterState`] and the node's facts as they arrive; after each
//! burst (everything already queued), the node plan is recomputed if the node changed, the
//! changed services are recomputed and the [`Programmer`] writes the difference — at most once
//! per `minSyncPeriod`, like kube-proxy's bounded-frequency runner (an isolated change is
//! applied at once, a storm is coalesced). Nothing is written until both initial lists have
//! arrived, so a restart never black-holes services whose slices are late. A periodic full
//! reconcile (`syncPeriod`) re-reads the maps and repairs any drift.
use std::{
    collections::{BTreeMap, BTreeSet},
    future::Future,
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::Result;
use proxy_common::LinkInfo;
use tokio::sync::mpsc;

use crate::{
    datapath::{
        Maps, Programmer,
        bpf::{BpfDatapath, DatapathConfig, ForwardDirect, HostDatapath},
        conntrack,
    },
    model::{
        NodeInfo, ProxyOptions,
        cidr::Cidr,
        desired::{Changed, ClusterState},
        node::{self, HostLink, NodeObject, NodeSettings, TcLinks},
        outliers::{OutlierSettings, Outliers},
        socket_lb::{self, PodFacts},
    },
    servers::{metrics::Metrics, proxy_health::ProxyHealth},
    source::{self, SourceEvent},
};

pub enum SourceConfig {
    /// A directory of manifests.
    Manifests(PathBuf),
    /// The Kubernetes API; `None` infers the config (in-cluster, or `KUBECONFIG`).
    Kube { kubeconfig: Option<PathBuf>, master: Option<String> },
}

pub struct AgentConfig {
    pub source: SourceConfig,
    pub datapath: DatapathConfig,
    pub node: NodeSettings,
    pub options: ProxyOptions,
    /// Full reconcile interval (`syncPeriod`).
    pub sync_period: Duration,
    /// Least time between two syncs (`minSyncPeriod`).
    pub min_sync_period: Duration,
    /// kube-proxy's metrics server (`metricsBindAddress`); `None`: off.
    pub metrics_bind_address: Option<SocketAddr>,
    /// kube-proxy's healthz server (`healthzBindAddress`); `None`: off.
    pub healthz_bind_address: Option<SocketAddr>,
    /// What `/configz` shows: the effective configuration.
    pub configz: serde_json::Value,
    /// Take the node over from kube-proxy after the first sync ([`crate::takeover`]).
    pub cleanup_kube_proxy: bool,
    /// Attach nothing; compare the plan with the running kube-proxy's rules ([`crate::shadow`]).
    pub shadow: bool,
    /// The agent's OOM score adjustment (`oomScoreAdj`), applied at start when set.
    pub oom_score_adj: Option<i32>,
    /// The kernel's conntrack sysctls kube-proxy would set, and where they are.
    pub netfilter_sysctls: (std::path::PathBuf, Vec<(&'static str, u64)>),
    /// How often the datapath checks itself ([`crate::verify`]); zero: only on demand.
    pub verify_period: Duration,
    /// Outlier detection's switch and thresholds ([`crate::model::outliers`]).
    pub outliers: OutlierSettings,
}

/// Run until `shutdown` completes. The pinned datapath stays in place on exit, like kube-proxy's
/// rules: `kpr cleanup` removes it.
pub async fn run(cfg: AgentConfig, shutdown: impl Future<Output = ()>) -> Result<()> {
    let _lock = crate::datapath::bpf::AgentLock::acquire(&cfg.datapath.pin_root)?;
    // kube-proxy fails to start here; kpr's own flows do not depend on these, so it warns.
    let (dir, writes) = &cfg.netfilter_sysctls;
    for e in crate::datapath::netfilter_sysctls::apply(dir, writes) {
        tracing::warn!("{e:#}");
    }
    // Bound first: a port in use is a startup error, before anything is attached.
    let listeners =
        crate::servers::proxy_servers::Listeners::bind(cfg.metrics_bind_address, cfg.healthz_bind_address).await?;
    let metrics = Arc::new(Metrics::new(Some(cfg.datapath.pin_root.clone())));
    // kube-proxy's health timeout: twice syncPeriod.
    let proxy_health = Arc::new(ProxyHealth::new(2 * cfg.sync_period, metrics.clone()));
    let verify = Arc::new(crate::verify::Shared::default());
    let verify_route = Some(("/verify", crate::verify::route(verify.clone())));
    let server_tasks = listeners.serve(metrics.clone(), proxy_health.clone(), cfg.configz.clone(), verify_route);
    let mut datapath = BpfDatapath::load(&cfg.datapath)?;
    let programmer = Programmer::recover(&mut datapath.maps)?;
    programmer.rewrite_maglev_tables(&mut datapath.maps);
    tracing::info!(
        pin_dir = %crate::datapath::bpf::pin_dir(&cfg.datapath.pin_root).display(),
        cgroup = %cfg.datapath.cgroup.display(),
        node = %cfg.node.name,
        recovered_service_ports = programmer.programmed().len(),
        "datapath attached"
    );

    let (tx, rx) = mpsc::channel(4096);
    let node_name = cfg.node.name.clone();
    let mut service_events = None;
    // The API always has this node's Node; a manifest directory may not.
    let node_required = matches!(cfg.source, SourceConfig::Kube { .. });
    let source_task = match cfg.source {
        SourceConfig::Manifests(dir) => {
            let tx = tx.clone();
            let run = move || source::manifests::run(dir.clone(), node_name.clone(), tx.clone());
            tokio::spawn(supervise("manifests", metrics.clone(), run))
        }
        SourceConfig::Kube { kubeconfig, master } => {
            let config = source::kube::config(kubeconfig.as_deref(), master.as_deref()).await?;
            // The API server must be reachable without kpr (after a reboot nothing is
            // programmed until kpr has synced): not through a Service kpr has not programmed.
            let service_host = std::env::var("KUBERNETES_SERVICE_HOST").ok();
            let is_programmed = |ip: std::net::IpAddr, port: u16| {
                let (addr, port) = (proxy_common::Addr::from(ip), port.to_be());
                programmer.programmed().keys().any(|k| k.addr == addr && k.port == port)
            };
            if let Some(problem) =
                source::kube::bootstrap_problem(&config.cluster_url, service_host.as_deref(), is_programmed)
            {
                anyhow::bail!("{problem}");
            }
            let client = kube::Client::try_from(config)?;
            let (events, _) = crate::events::publisher(client.clone(), cfg.node.name.clone());
            service_events = Some(events);
            let options = cfg.options;
            let tx = tx.clone();
            let run = move || source::kube::run(client.clone(), node_name.clone(), options, tx.clone());
            tokio::spawn(supervise("kubernetes", metrics.clone(), run))
        }
    };
    let host_task = {
        let tx = tx.clone();
        tokio::spawn(supervise("host links", metrics.clone(), move || source::host::run(tx.clone())))
    };
    let swept = {
        let metrics = metrics.clone();
        move |sweep: &conntrack::Sweep, tables: &[conntrack::TableUse]| metrics.conntrack_swept(sweep, tables)
    };
    let sweep_task =
        tokio::spawn(conntrack::sweep_forever(cfg.datapath.pin_root.clone(), cfg.datapath.ct_timeouts, swept));
    let watched = source::backends::Watched::default();
    let backends_task = {
        let (pin_root, watched) = (cfg.datapath.pin_root.clone(), watched.clone());
        let run = move || source::backends::run(pin_root.clone(), watched.clone(), tx.clone());
        tokio::spawn(supervise("endpoint answers", metrics.clone(), run))
    };
    let firewall_task = (cfg.datapath.forward_direct == ForwardDirect::Auto).then(|| {
        let host_state = crate::datapath::bpf::HostState::open(&cfg.datapath.pin_root);
        tokio::spawn(watch_forward_filters(host_state, metrics.clone()))
    });
    let serve_health = cfg.node.tc_links != TcLinks::Off;
    let mut syncer = Syncer::new(ClusterState::with_options(NodeInfo::default(), cfg.options), programmer, cfg.node);
    syncer.host_links = source::host::snapshot()?;
    syncer.min_sync_period = cfg.min_sync_period;
    syncer.service_events = service_events;
    syncer.node_required = node_required;
    syncer.metrics = metrics;
    syncer.proxy_health = proxy_health.clone();
    syncer.verify = Some(verify);
    syncer.verify_period = cfg.verify_period;
    syncer.outliers = Outliers::new(cfg.outliers);
    syncer.watched = Some(watched);
    if cfg.cleanup_kube_proxy {
        syncer.takeover = Some(crate::takeover::Takeover::open(&cfg.datapath.pin_root)?);
    }
    if serve_health {
        syncer.health = Some(crate::servers::service_health::HealthServers::default().with_proxy_health(proxy_health));
    }
    syncer.run(rx, &mut datapath.maps, &mut datapath.host, cfg.sync_period, shutdown).await;
    source_task.abort();
    host_task.abort();
    sweep_task.abort();
    backends_task.abort();
    if let Some(task) = firewall_task {
        task.abort();
    }
    for task in server_tasks {
        task.abort();
    }
    tracing::info!("stopped; the datapath stays programmed until the next agent takes over");
    Ok(())
}

/// How often the host's forward hook is read for filters (`--forward-direct auto`).
const FORWARD_FILTERS_INTERVAL: Duration = Duration::from_secs(1);

/// `--forward-direct auto`: keep the programs' `KPR_HOST_STATE` in step with the host's
/// forward hook, from before the first link is attached (the first check runs at once) for as
/// long as the agent runs. While anything filters forwarded packets there, translated packets
/// take the host's forwarding path, and a NetworkPolicy enforced there holds for them.
async fn watch_forward_filters(host_state: Result<crate::datapath::bpf::HostState>, metrics: Arc<Metrics>) {
    let mut host_state = match host_state {
        Ok(map) => map,
        Err(e) => {
            // A map just made says "host path": safe, only slower.
            tracing::warn!("cannot open KPR_HOST_STATE ({e:#}): translated packets take the host's forwarding path");
            return;
        }
    };
    let mut tick = tokio::time::interval(FORWARD_FILTERS_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last: Option<Vec<String>> = None;
    loop {
        tick.tick().await;
        let filters = match tokio::task::spawn_blocking(crate::source::firewall::forward_filters).await {
            Ok(filters) => filters,
            Err(e) => vec![format!("the check failed ({e})")],
        };
        if last.as_ref() == Some(&filters) {
            continue;
        }
        let direct = filters.is_empty();
        if let Err(e) = host_state.set_forward_direct(direct) {
            tracing::warn!("{e:#}");
            continue; // tried again at the next tick
        }
        metrics.forward_direct(direct);
        if direct {
            tracing::info!("nothing filters forwarded packets: translated packets are sent straight out of their link");
        } else {
            tracing::info!(
                filters = %filters.join("; "),
                "the host filters forwarded packets: translated packets take its forwarding path, where those \
                 filters apply to them as to kube-proxy's (--forward-direct always skips them)"
            );
        }
        last = Some(filters);
    }
}

/// The datapath content the agent would program now (`kpr diff`): the source's complete
/// lists (and, from the API, this node's Node) through the same model, with the node's links
/// as the kernel has them. Nothing is written.
pub async fn desired_state(
    source: SourceConfig,
    node: NodeSettings,
    options: ProxyOptions,
    wait: Duration,
) -> Result<crate::model::desired::Desired> {
    let (tx, mut rx) = mpsc::channel(4096);
    let name = node.name.clone();
    let wants_node = matches!(source, SourceConfig::Kube { .. });
    let task = match source {
        SourceConfig::Manifests(dir) => tokio::spawn(source::manifests::run(dir, name, tx)),
        SourceConfig::Kube { kubeconfig, master } => {
            let client = kube::Client::try_from(source::kube::config(kubeconfig.as_deref(), master.as_deref()).await?)?;
            tokio::spawn(source::kube::run(client, name, options, tx))
        }
    };
    let programmer = Programmer::recover(&mut crate::datapath::fake::FakeMaps::new(crate::datapath::Capacity {
        service_ports: 0,
        backends: 0,
    }))?;
    let mut syncer = Syncer::new(ClusterState::with_options(NodeInfo::default(), options), programmer, node);
    syncer.host_links = source::host::snapshot()?;
    let deadline = tokio::time::sleep(wait);
    tokio::pin!(deadline);
    // From the API, a refused service range comes in its own list (the manifests bring theirs
    // with everything else): the any-port entries depend on it.
    let wants_cidrs = wants_node && options.refuse_service_range;
    let (mut node_seen, mut cidrs_seen) = (false, false);
    let outcome = loop {
        if syncer.state.synced() && (node_seen || !wants_node) && (cidrs_seen || !wants_cidrs) {
            break Ok(());
        }
        tokio::select! {
            event = rx.recv() => match event {
                Some(event) => {
                    node_seen |= matches!(event, SourceEvent::Node(_));
                    cidrs_seen |= matches!(event, SourceEvent::ServiceCidrs(_));
                    syncer.apply(event);
                }
                None => break Err(anyhow::anyhow!("the source stopped before listing everything")),
            },
            () = &mut deadline => break Err(anyhow::anyhow!("the source did not list Services, EndpointSlices, the Node and the ServiceCIDRs within {wait:?}")),
        }
    };
    task.abort();
    outcome?;
    syncer.program_node(&mut crate::datapath::fake::FakeHost::default());
    Ok(syncer.state.desired())
}

/// Run a source until its receiver goes away; a source that fails (out of file descriptors,
/// an inotify limit, ...) is logged and started again, backing off up to 30 s, so that one
/// error never leaves the node without updates.
async fn supervise<F, Fut>(name: &str, metrics: Arc<Metrics>, mut start: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let mut backoff = Duration::from_secs(1);
    loop {
        match start().await {
            Ok(()) => return,
            Err(e) => tracing::error!(source = name, "source failed: {e:#}; restarting in {backoff:?}"),
        }
        metrics.source_restarted(name);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// The loop's state, separate from I/O so it can be driven with fake maps in tests.
pub struct Syncer {
    pub state: ClusterState,
    pub programmer: Programmer,
    /// healthCheckNodePort servers, with the per-packet (external) datapath.
    pub health: Option<crate::servers::service_health::HealthServers>,
    /// Where they listen: the NodePort addresses with `nodePortAddresses`, else everywhere.
    health_bind: crate::servers::service_health::BindTo,
    pub node_settings: NodeSettings,
    pub host_links: Vec<HostLink>,
    pub node_object: Option<NodeObject>,
    /// The cluster's service ranges (watched when the service range is refused).
    pub service_cidrs: Vec<Cidr>,
    /// The cluster's Nodes that are not Ready (watched with `--abort-dead-tcp`).
    down_nodes: BTreeSet<String>,
    /// A ClusterIP whose route tells the source the node's own connections to ClusterIPs get.
    sample_cluster_ip: Option<std::net::Ipv4Addr>,
    /// The endpoints whose routes tell the sources of the node's own masqueraded connections
    /// to them (`NodePlan::node_sources`): every IPv4 one on a node where routing and
    /// MASQUERADE can disagree, none elsewhere.
    routed_endpoints: std::collections::BTreeSet<std::net::IpAddr>,
    /// `ClusterState::slices_changed` when `routed_endpoints` was taken (None: not taken), so
    /// that a sync walks every endpoint only after a slice changed.
    routed_at: Option<u64>,
    /// The kernel's routes to them, asked once per endpoint until the links change or the
    /// reconcile period ends.
    endpoint_routes: std::collections::BTreeMap<std::net::IpAddr, Option<node::KernelRoute>>,
    pub min_sync_period: Duration,
    /// The node facts changed since the last plan.
    node_dirty: bool,
    /// Among them a link that was not there: its plan does not wait for minSyncPeriod.
    links_added: bool,
    last_sync: Option<Instant>,
    synced_once: bool,
    /// The last sync wrote only the changed services' entries.
    last_sync_partial: bool,
    /// Another layout's pins were removed (after the first sync).
    other_layouts_retired: bool,
    /// A full list was applied: give the memory it took back to the system after the sync.
    release_memory: bool,
    /// Where frontend conflicts and outlier detection's decisions go as Kubernetes Events
    /// (API source only).
    pub service_events: Option<mpsc::Sender<crate::events::ServiceEvent>>,
    /// Outlier detection's records, and the endpoints it has the datapath watched
    /// ([`crate::source::backends`]).
    pub outliers: Outliers,
    pub watched: Option<crate::source::backends::Watched>,
    /// Outlier detection sidelined or returned an endpoint: the backends change.
    outliers_changed: bool,
    pub metrics: Arc<Metrics>,
    /// `/healthz` and `/livez`: told when changes arrive and when the datapath has them.
    pub proxy_health: Arc<ProxyHealth>,
    /// Without a Node object the node is not eligible for load-balanced traffic (API source).
    pub node_required: bool,
    /// When the agent started: older EndpointSlice trigger times are not this agent's latency.
    started: SystemTime,
    /// `endpoints.kubernetes.io/last-change-trigger-time`s of the slice changes not yet synced.
    trigger_times: Vec<SystemTime>,
    /// Taking over from kube-proxy: after the first sync, and pruned at each reconcile.
    pub takeover: Option<crate::takeover::Takeover>,
    /// The service ranges the datapath refuses now, and a node plan adding ranges, held back
    /// until the service entries inside them are written.
    refused_ranges: std::collections::BTreeSet<Cidr>,
    deferred_node: Option<node::NodePlan>,
    /// This node's pods and the namespaces' `kpr.io/socket-lb`: who opts out of the socket path.
    pods: Vec<PodFacts>,
    namespace_settings: std::collections::BTreeMap<String, String>,
    /// A pod that opted out has no cgroup yet (kubelet makes it after the Pod is bound): look
    /// again then.
    cgroup_retry: Option<Instant>,
    /// The pods' namespaces could not be entered, and it was said.
    netns_warned: bool,
    /// Opted-out pods while not every link is covered (`--interfaces`), as last said.
    uncovered_opt_outs: usize,
    /// The cookies of namespaces nested in opted-out pods, by the namespace's (dev, inode).
    nested_cookies: BTreeMap<(u64, u64), u64>,
    /// The cookies of the pods' namespaces, by (link, the namespace's id there).
    netns_cookies: BTreeMap<(u32, i32), u64>,
    /// The datapath's self-check (`kpr verify`): its last report and runs asked for now.
    pub verify: Option<Arc<crate::verify::Shared>>,
    /// How often it runs by itself (zero: only when asked).
    pub verify_period: Duration,
    /// A run under way.
    verify_run: Option<self_check::VerifyRun>,
}

impl Syncer {
    pub fn new(state: ClusterState, programmer: Programmer, node_settings: NodeSettings) -> Self {
        Self {
            state,
            programmer,
            health: None,
            health_bind: crate::servers::service_health::BindTo::Any,
            node_settings,
            host_links: Vec::new(),
            node_object: None,
            service_cidrs: Vec::new(),
            down_nodes: BTreeSet::new(),
            sample_cluster_ip: None,
            routed_endpoints: Default::default(),
            routed_at: None,
            endpoint_routes: Default::default(),
            min_sync_period: Duration::ZERO,
            node_dirty: true,
            links_added: false,
            last_sync: None,
            synced_once: false,
            last_sync_partial: false,
            other_layouts_retired: false,
            release_memory: false,
            service_events: None,
            outliers: Outliers::default(),
            watched: None,
            outliers_changed: false,
            metrics: Arc::new(Metrics::default()),
            proxy_health: Arc::new(ProxyHealth::new(Duration::from_secs(60), Arc::new(Metrics::default()))),
            node_required: false,
            started: SystemTime::now(),
            trigger_times: Vec::new(),
            takeover: None,
            refused_ranges: Default::default(),
            deferred_node: None,
            pods: Vec::new(),
            namespace_settings: Default::default(),
            cgroup_retry: None,
            netns_warned: false,
            uncovered_opt_outs: 0,
            nested_cookies: BTreeMap::new(),
            netns_cookies: Default::default(),
            verify: None,
            verify_period: Duration::ZERO,
            verify_run: None,
        }
    }

    pub async fn run(
        &mut self,
        mut rx: mpsc::Receiver<SourceEvent>,
        maps: &mut dyn Maps,
        host: &mut dyn HostDatapath,
        sync_period: Duration,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut reconcile = tokio::time::interval(sync_period);
        reconcile.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        reconcile.tick().await; // the first tick is immediate
        let verify_every = (!self.verify_period.is_zero()).then_some(self.verify_period);
        let mut verify_tick = tokio::time::interval(verify_every.unwrap_or(Duration::from_secs(3600)));
        verify_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        verify_tick.tick().await;
        let verify = self.verify.clone();
        tokio::pin!(shutdown);
        let mut sources_open = true;
        loop {
            // A change held back by minSyncPeriod is applied when the period is over.
            let pending = self.pending_until();
            tokio::select! {
                event = rx.recv(), if sources_open => {
                    let Some(event) = event else {
                        tracing::warn!("all sources stopped; serving the last programmed state");
                        sources_open = false;
                        continue;
                    };
                    let started = Instant::now();
                    let mut changed = self.apply(event);
                    while let Ok(event) = rx.try_recv() {
                        changed |= self.apply(event);
                    }
                    if changed {
                        self.sync(maps, host, started);
                    }
                }
                () = sleep_until(pending) => self.sync(maps, host, Instant::now()),
                _ = reconcile.tick() => self.reconcile(maps, host),
                _ = verify_tick.tick(), if verify_every.is_some() => self.start_verify(host),
                () = asked_to_verify(verify.as_deref()) => self.start_verify(host),
                // A run's next chunk, between the changes (tokio picks among ready branches at
                // random).
                () = std::future::ready(()), if self.verifying() => self.verify_step(maps, host),
                () = &mut shutdown => return,
            }
        }
    }

    /// Take in one event: whether a sync may have something to write.
    pub fn apply(&mut self, event: SourceEvent) -> bool {
        let full_list = matches!(
            event,
            SourceEvent::ServicesListed(_) | SourceEvent::SlicesListed(_) | SourceEvent::ManifestsLoaded { .. }
        );
        self.release_memory |= full_list;
        self.count_change(&event);
        match event {
            SourceEvent::ServicesListed(all) => self.state.replace_services(all),
            SourceEvent::SlicesListed(all) => self.state.replace_slices(all),
            SourceEvent::ServiceApplied(s) => self.state.apply_service(s),
            SourceEvent::ServiceDeleted(k) => self.state.delete_service(&k),
            SourceEvent::SliceApplied(s) => self.state.apply_slice(s),
            SourceEvent::SliceDeleted(k) => self.state.delete_slice(&k),
            SourceEvent::ManifestsLoaded { services, slices, node, service_cidrs, pods, namespaces, down_nodes } => {
                self.state.replace_services(services);
                self.state.replace_slices(slices);
                self.set_node_object(node);
                self.set_down_nodes(down_nodes);
                self.set_service_cidrs(service_cidrs);
                self.set_pods(pods);
                self.set_namespace_settings(namespaces);
            }
            SourceEvent::Pods(pods) => self.set_pods(pods),
            SourceEvent::Namespaces(settings) => self.set_namespace_settings(settings),
            SourceEvent::ServiceCidrs(cidrs) => self.set_service_cidrs(cidrs),
            SourceEvent::Node(node) => self.set_node_object(node),
            SourceEvent::DownNodes(down) => self.set_down_nodes(down),
            SourceEvent::Host(links) => {
                if links != self.host_links {
                    self.endpoint_routes.clear();
                    self.links_added |= links.iter().any(|l| self.host_links.iter().all(|old| old.index != l.index));
                    self.host_links = links;
                    self.node_dirty = true;
                }
            }
            SourceEvent::Backends(at, seen) => return self.observe_backends(at, &seen),
        }
        true
    }

    /// kube-proxy's change metrics and health: a Service or EndpointSlice change is queued
    /// until a sync writes it.
    fn count_change(&mut self, event: &SourceEvent) {
        // (service changes, endpoint changes, the slices that came with them)
        let (services, endpoints, slices): (usize, usize, &[_]) = match event {
            SourceEvent::ServicesListed(all) => (all.len(), 0, &[]),
            SourceEvent::ServiceApplied(_) | SourceEvent::ServiceDeleted(_) => (1, 0, &[]),
            SourceEvent::SlicesListed(all) => (0, all.len(), all.as_slice()),
            SourceEvent::SliceApplied(slice) => (0, 1, std::slice::from_ref(slice)),
            SourceEvent::SliceDeleted(_) => (0, 1, &[]),
            SourceEvent::ManifestsLoaded { services, slices, .. } => (services.len(), slices.len(), slices.as_slice()),
            _ => return,
        };
        self.metrics.change_queued(true, services);
        self.metrics.change_queued(false, endpoints);
        for slice in slices {
            if let Some(t) = last_change_trigger_time(slice).filter(|t| *t > self.started) {
                self.trigger_times.push(t);
            }
        }
        self.proxy_health.queued_update();
    }

    fn set_pods(&mut self, pods: Vec<PodFacts>) {
        if pods != self.pods {
            self.pods = pods;
            self.node_dirty = true;
        }
    }

    fn set_namespace_settings(&mut self, settings: std::collections::BTreeMap<String, String>) {
        if settings != self.namespace_settings {
            self.namespace_settings = settings;
            self.node_dirty = true;
        }
    }

    /// The cgroups of the pods that opt out of the socket path (`model::socket_lb`), as found
    /// in the hierarchy now (a pod without one yet is looked for again in a second), and the
    /// namespaces nested in those pods that leave by a covered pod link (a sandbox or container
    /// runtime on the node's kernel): (that link's ifindex, the nested namespace's cookie).
    /// `covered`: the covered links' peer namespaces, by id → the link's ifindex.
    fn socket_skip(&mut self, covered: &BTreeMap<i32, u32>) -> (BTreeMap<u64, u32>, Vec<(u32, u64)>) {
        self.cgroup_retry = None;
        let Some(under) = &self.node_settings.pod_cgroups else { return Default::default() };
        let uids = socket_lb::opted_out(&self.pods, &self.namespace_settings);
        if !uids.is_empty() && self.node_settings.tc_links != TcLinks::All {
            // Said when the number changes, not at every node plan.
            let said = std::mem::replace(&mut self.uncovered_opt_outs, uids.len());
            if said != uids.len() {
                tracing::warn!(
                    pods = uids.len(),
                    "pods opt out of the socket path, but the per-packet path does not cover every link \
                     (--interfaces): they are still translated at their sockets"
                );
            }
        }
        let found = source::cgroups::pod_cgroups(under, &uids);
        if found.len() < uids.len() {
            tracing::debug!(
                missing = uids.len() - found.len(),
                "pods that opt out of the socket path have no cgroup yet"
            );
            self.cgroup_retry = Some(Instant::now() + Duration::from_secs(1));
        }
        let skip =
            found.values().filter_map(|dir| source::cgroups::PodCgroup::of(dir)).map(|c| (c.id, c.level)).collect();
        let nested = self.nested_netns(found.values(), covered);
        (skip, nested)
    }

    /// The namespaces of these pods' threads other than the pod's own, for the pods whose own
    /// namespace (the one of their threads behind a covered link) is covered: (the link, the
    /// nested namespace's cookie, learnt by entering it once).
    fn nested_netns<'a>(
        &mut self,
        pods: impl Iterator<Item = &'a std::path::PathBuf>,
        covered: &BTreeMap<i32, u32>,
    ) -> Vec<(u32, u64)> {
        use std::os::unix::fs::MetadataExt as _;
        let Ok(session) = crate::netlink::Session::open(libc::NETLINK_ROUTE) else { return Vec::new() };
        let own = std::fs::metadata("/proc/self/ns/net").map(|m| (m.dev(), m.ino())).ok();
        let mut out = Vec::new();
        let mut seen = BTreeSet::new();
        for dir in pods {
            // The pod's threads' namespaces, each once, with its id as this namespace knows it.
            let mut namespaces = BTreeMap::new();
            for tid in source::cgroups::threads(dir) {
                let path = std::path::PathBuf::from(format!("/proc/{tid}/ns/net"));
                if let Ok(m) = std::fs::metadata(&path)
                    && Some((m.dev(), m.ino())) != own
                {
                    namespaces.entry((m.dev(), m.ino())).or_insert(path);
                }
            }
            let namespaces: Vec<_> = namespaces
                .into_iter()
                .map(|(id, path)| {
                    let nsid = crate::netns::nsid(&session, &path);
                    (id, path, nsid)
                })
                .collect();
            // The pod's own: behind a covered link. The others leave by it.
            let link = namespaces.iter().find_map(|(_, _, nsid)| covered.get(nsid.as_ref()?).copied());
            let Some(link) = link else { continue };
            for (id, path, nsid) in namespaces {
                if nsid.is_some_and(|nsid| covered.contains_key(&nsid)) {
                    continue; // the pod's own, listed by its link already
                }
                seen.insert(id);
                let cookie = match self.nested_cookies.get(&id) {
                    Some(cookie) => Some(*cookie),
                    None => crate::netns::cookie_of(&path).ok().flatten(),
                };
                if let Some(cookie) = cookie {
                    self.nested_cookies.insert(id, cookie);
                    out.push((link, cookie));
                }
            }
        }
        self.nested_cookies.retain(|id, _| seen.contains(id));
        out
    }

    /// The network namespaces of the pods behind `tc_links` (ifindex → cookie), learnt by entering
    /// each (`netns::cookies_of`) the first time its link is seen, and kept while the link is
    /// there; None where no namespace can be entered.
    fn pod_netns(&mut self, tc_links: &BTreeMap<u32, String>) -> Option<BTreeMap<u32, u64>> {
        let peers: BTreeSet<(u32, i32)> = self
            .host_links
            .iter()
            .filter(|l| tc_links.contains_key(&l.index))
            .filter_map(|l| Some((l.index, l.peer_nsid?)))
            .collect();
        self.netns_cookies.retain(|peer, _| peers.contains(peer));
        let unknown: BTreeSet<i32> =
            peers.iter().filter(|p| !self.netns_cookies.contains_key(p)).map(|(_, nsid)| *nsid).collect();
        match crate::netns::cookies_of(&unknown) {
            Ok(cookies) => {
                for peer @ (_, nsid) in &peers {
                    if let Some(cookie) = cookies.get(nsid) {
                        self.netns_cookies.insert(*peer, *cookie);
                    }
                }
            }
            // Others were entered before: this one is gone already, or not yet to be found.
            Err(_) if !self.netns_cookies.is_empty() => {}
            Err(e) => {
                if !self.netns_warned {
                    self.netns_warned = true;
                    tracing::warn!(
                        "cannot enter the pods' network namespaces ({e:#}): the socket path takes every pod's link as \
                         covered, also one that appears while no agent runs"
                    );
                }
                return None;
            }
        }
        Some(self.netns_cookies.iter().map(|((ifindex, _), cookie)| (*ifindex, *cookie)).collect())
    }

    fn set_service_cidrs(&mut self, cidrs: Vec<Cidr>) {
        if cidrs != self.service_cidrs {
            self.service_cidrs = cidrs;
            self.node_dirty = true;
        }
    }

    /// Nodes that went down or came back: their endpoints' TCP flows may have to end
    /// (`--abort-dead-tcp`; every service is recomputed, which such rare events afford).
    fn set_down_nodes(&mut self, down: BTreeSet<String>) {
        if down != self.down_nodes {
            self.down_nodes = down;
            self.node_dirty = true;
        }
    }

    fn set_node_object(&mut self, node: Option<NodeObject>) {
        let eligible = node.as_ref().map_or(!self.node_required, |n| !n.draining);
        self.proxy_health.set_node_eligible(eligible);
        if node != self.node_object {
            self.node_object = node;
            self.node_dirty = true;
        }
    }

    /// When a held-back change is due; `None` when nothing waits.
    fn pending_until(&self) -> Option<Instant> {
        if self.links_added {
            return Some(Instant::now());
        }
        let changed = self.state.has_changes() || self.outliers_changed;
        let waiting = self.node_dirty || (self.state.synced() && changed);
        let last = self.last_sync?;
        let held = waiting.then(|| last + self.min_sync_period);
        let retry = self.retry_due().map(|at| at.max(last + self.min_sync_period));
        let cgroups = self.cgroup_retry.map(|at| at.max(last + self.min_sync_period));
        held.into_iter().chain(retry).chain(cgroups).min()
    }

    /// Write what changed, once both initial lists are in and minSyncPeriod allows.
    pub fn sync(&mut self, maps: &mut dyn Maps, host: &mut dyn HostDatapath, started: Instant) {
        if self.last_sync.is_some_and(|last| last.elapsed() < self.min_sync_period) {
            // A new link gets its programs at once: until then the pods behind it have no
            // per-packet path, which the socket path counts on. The rest waits for the period
            // (`run` comes back when it is over), which this plan does not restart.
            if self.links_added {
                let last = self.last_sync;
                self.program_node(host);
                self.last_sync = last;
            }
            return;
        }
        self.program_node(host);
        self.sync_services(maps, started);
        self.apply_deferred_node(host);
        self.retire_other_layouts(host);
    }

    /// After the first sync is written, not before: another layout's programs serve until then.
    fn retire_other_layouts(&mut self, host: &mut dyn HostDatapath) {
        if self.state.synced() && !self.state.has_changes() && !self.other_layouts_retired {
            self.other_layouts_retired = true;
            host.retire_other_layouts();
        }
    }

    fn sync_services(&mut self, maps: &mut dyn Maps, started: Instant) {
        let retry = self.retry_due().is_some_and(|at| at <= Instant::now());
        if !self.state.synced() {
            return;
        }
        if !(self.state.has_changes() || retry || self.outliers_changed) {
            // The changes received changed nothing: the datapath is up to date.
            if !self.programmer.has_failures() {
                self.proxy_health.updated();
                self.proxy_health.synced();
                self.metrics.synced_nothing();
            }
            return;
        }
        self.program_services(maps, None, started);
    }

    /// Service ports that did not fit are tried again when released backend slots leave
    /// quarantine (they may fit then), not only at the next change or reconcile.
    fn retry_due(&self) -> Option<Instant> {
        if !self.programmer.has_failures() {
            return None;
        }
        self.programmer.quarantine_ends()
    }

    /// Re-read the maps and rewrite whatever differs from the desired state (pending changes
    /// included: a full sync).
    pub fn reconcile(&mut self, maps: &mut dyn Maps, host: &mut dyn HostDatapath) {
        if let Some(takeover) = &mut self.takeover {
            takeover.prune();
        }
        // Routes may change without a link changing: asked again.
        if !self.endpoint_routes.is_empty() {
            self.endpoint_routes.clear();
            self.node_dirty = true;
        }
        self.program_node(host);
        if !self.state.synced() {
            return;
        }
        match Programmer::recover(maps) {
            Ok(programmer) => self.program_services(maps, Some(programmer), Instant::now()),
            Err(e) => tracing::error!("reconcile could not read the maps: {e:#}"),
        }
        self.apply_deferred_node(host);
        self.retire_other_layouts(host);
    }

    /// The node plan now, whatever changed (shadow mode reads it from `host`).
    pub fn force_node_plan(&mut self, host: &mut dyn HostDatapath) {
        self.node_dirty = true;
        self.program_node(host);
    }

    /// The node plan, when the node's facts (or the ClusterIP whose route gives the node's
    /// source for ClusterIPs, or the endpoints whose routes it asks) changed.
    fn program_node(&mut self, host: &mut dyn HostDatapath) {
        let sample = self.state.sample_cluster_ip();
        if sample != self.sample_cluster_ip {
            self.sample_cluster_ip = sample;
            self.node_dirty = true;
        }
        // Routing toward an endpoint and MASQUERADE pick different sources only where a link
        // holds an IPv4 address MASQUERADE passes over (link-scoped, secondary); elsewhere no
        // route is asked.
        let disagree = self.host_links.iter().any(|l| !l.loopback && !l.v4_unselectable.is_empty());
        let at = disagree.then(|| self.state.slices_changed());
        if at != self.routed_at {
            self.routed_at = at;
            let routed = if disagree { self.state.ipv4_endpoints() } else { Default::default() };
            if routed != self.routed_endpoints {
                self.routed_endpoints = routed;
                self.node_dirty = true;
            }
        }
        if self.cgroup_retry.is_some_and(|at| at <= Instant::now()) {
            self.node_dirty = true;
        }
        if !self.node_dirty {
            return;
        }
        self.node_dirty = false;
        self.links_added = false;
        let mut plan = node::plan(&self.host_links, self.node_object.as_ref(), &self.node_settings);
        plan.service_cidrs = self.service_cidrs.iter().copied().collect();
        plan.info.service_cidrs = self.service_cidrs.clone();
        plan.info.down_nodes.clone_from(&self.down_nodes);
        // The source routing picks for ClusterIPs (kube-proxy's unmasqueraded node traffic keeps
        // it), looked up in the kernel's routing table.
        if let Some(source) = sample.and_then(source::host::route_source) {
            let link = LinkInfo { addr: u32::from(source).to_be(), ..LinkInfo::default() };
            plan.links.insert(proxy_common::LINK_SERVICE_SOURCE, link);
        }
        // Where routing toward an endpoint picks another source than MASQUERADE would, the
        // node's own masqueraded connections to it are bound to MASQUERADE's.
        let routed = &self.routed_endpoints;
        self.endpoint_routes.retain(|ip, _| routed.contains(ip));
        let asked: Vec<std::net::IpAddr> =
            routed.iter().filter(|ip| !self.endpoint_routes.contains_key(ip)).copied().collect();
        self.endpoint_routes.extend(source::host::routes(asked));
        let routes = self.endpoint_routes.iter().filter_map(|(ip, route)| Some((*ip, (*route)?)));
        plan.node_sources = node::node_sources(routes, &plan.links);
        let covered: BTreeMap<i32, u32> = self
            .host_links
            .iter()
            .filter(|l| plan.tc_links.contains_key(&l.index))
            .filter_map(|l| Some((l.peer_nsid?, l.index)))
            .collect();
        (plan.socket_skip, plan.nested_netns) = self.socket_skip(&covered);
        plan.pod_netns = self.pod_netns(&plan.tc_links);
        // A service range refused anew takes effect once the service entries inside it are
        // written (after this sync's services): until then a ClusterIP's unknown port would be
        // dropped as an unallocated address instead of rejected.
        let added = plan.service_cidrs.difference(&self.refused_ranges).count() > 0;
        let mut now = plan.clone();
        if added {
            now.service_cidrs = plan.service_cidrs.intersection(&self.refused_ranges).copied().collect();
            self.deferred_node = Some(plan.clone());
        } else {
            self.deferred_node = None;
        }
        self.apply_node_plan(host, &now);
        self.health_bind = if self.node_settings.node_port_addresses.is_empty() {
            crate::servers::service_health::BindTo::Any
        } else {
            let nodeport = plan.node_addrs.iter().filter(|(_, f)| *f & proxy_common::NODE_ADDR_NODEPORT != 0);
            crate::servers::service_health::BindTo::Addresses(nodeport.map(|(a, _)| *a).collect())
        };
        self.state.set_node(plan.info);
        self.last_sync = Some(Instant::now());
    }

    fn apply_node_plan(&mut self, host: &mut dyn HostDatapath, plan: &node::NodePlan) {
        match host.apply_node(plan) {
            Ok(()) => self.refused_ranges = plan.service_cidrs.clone(),
            Err(e) => {
                self.metrics.sync_error();
                tracing::error!("failed to program the node's addresses and links: {e:#}");
                self.node_dirty = true; // retried at the next sync
            }
        }
    }

    /// The node plan held back for the service entries (see [`Self::program_node`]).
    fn apply_deferred_node(&mut self, host: &mut dyn HostDatapath) {
        if self.state.synced()
            && let Some(plan) = self.deferred_node.take()
        {
            self.apply_node_plan(host, &plan);
        }
    }

    /// Write the desired service entries; `recovered`: a programmer rebuilt from the maps
    /// (reconcile), whose writes beyond the pending changes are drift.
    fn program_services(&mut self, maps: &mut dyn Maps, recovered: Option<Programmer>, started: Instant) {
        let pending = self.state.has_changes();
        let reconciling = recovered.is_some();
        if let Some(mut programmer) = recovered {
            programmer.carry_over(&self.programmer);
            self.programmer = programmer;
        }
        self.last_sync = Some(Instant::now());
        self.state.update();
        let scope = match self.state.take_changed() {
            Changed::Keys(keys) if !reconciling && self.partial_sync_fits(&keys) => Some(keys),
            _ => None,
        };
        self.last_sync_partial = scope.is_some();
        // Sidelining reads every entry: a partial sync happens only where nothing is sidelined.
        let sidelined = scope.is_none().then(|| {
            let mut desired = self.state.assembled().clone();
            self.sideline(&mut desired);
            desired
        });
        let desired = sidelined.as_ref().unwrap_or_else(|| self.state.assembled());
        let report = match &scope {
            Some(keys) => self.programmer.apply_partial(desired, keys, maps),
            None => self.programmer.apply(desired, maps),
        };
        let service_ports = desired.len();
        self.metrics.set_sidelined(self.outliers.sidelined());
        self.metrics.endpoints_uncounted(self.programmer.endpoints_uncounted());
        // The ports' names change only when frontends come, go or change Service.
        if report.added > 0 || report.removed > 0 || report.renamed > 0 || !self.synced_once {
            let ports = self
                .programmer
                .programmed()
                .iter()
                .filter_map(|(key, p)| desired.get(key).map(|want| (p.value.service_id, want.name.clone())));
            self.metrics.service_ports(ports.collect());
        }
        if let Some(health) = &mut self.health {
            health.update(self.state.health_checks(), &self.health_bind);
        }
        self.report_sync(&report, reconciling || !self.synced_once, started);
        if !self.synced_once {
            self.synced_once = true;
            tracing::info!(service_ports, "initial sync done");
            if let Some(takeover) = &mut self.takeover {
                takeover.run();
            }
        }
        if reconciling && !pending && report.changes() > 0 {
            tracing::warn!(?report, "reconcile repaired drift in the maps");
        } else if report.changes() > 0 || report.failed > 0 {
            tracing::info!(
                added = report.added,
                updated = report.updated,
                removed = report.removed,
                failed = report.failed,
                elapsed_us = started.elapsed().as_micros() as u64,
                "datapath updated"
            );
        }
        for conflict in self.state.take_new_conflicts() {
            if let Some(events) = &self.service_events {
                let _ = events.try_send(crate::events::ServiceEvent::Conflict(conflict));
            }
        }
        if std::mem::take(&mut self.release_memory) {
            release_free_memory();
        }
    }
}

impl Syncer {
    /// Whether a sync may write only the entries in `keys` (what changed since the last one):
    /// after a whole first sync, with nothing to retry, no endpoint's sidelining to apply and
    /// none of the changed ports' Services watched by outlier detection.
    fn partial_sync_fits(&self, keys: &BTreeSet<proxy_common::ServiceKey>) -> bool {
        let default_on = self.outliers.settings.default_on;
        let assembled = self.state.assembled();
        let opted_in = |key: &proxy_common::ServiceKey| {
            assembled.get(key).is_some_and(|p| self.state.outlier_detection(&p.name.service).unwrap_or(default_on))
        };
        self.synced_once
            && !self.outliers_changed
            && !self.programmer.has_failures()
            && self.outliers.watched_nothing()
            && !keys.iter().any(opted_in)
    }

    /// Metrics and health after a sync. A sync that left service ports out is not an update:
    /// the change stays pending, and past the health timeout the proxy is unhealthy, as
    /// kube-proxy is while its rules cannot be written.
    fn report_sync(&mut self, report: &crate::datapath::ApplyReport, full: bool, started: Instant) {
        let m = &self.metrics;
        m.programming_failures(report.failed);
        let capacity = self.programmer.capacity();
        m.map_use("services", self.programmer.programmed().len(), capacity.service_ports);
        m.map_use("backends", self.programmer.slots_in_use(), capacity.backends);
        let (ranges, range_capacity) = self.programmer.source_ranges_use();
        m.map_use("source_ranges", ranges, range_capacity);
        let (internal, external) = self.state.no_local_endpoints();
        m.no_local_endpoints(internal, external);
        if report.failed > 0 {
            return;
        }
        let now = SystemTime::now();
        let latencies: Vec<f64> =
            self.trigger_times.drain(..).map(|t| now.duration_since(t).unwrap_or_default().as_secs_f64()).collect();
        m.synced(started.elapsed().as_secs_f64(), full, &latencies);
        self.proxy_health.updated();
        // Only syncs after the source's complete lists come here: ready.
        self.proxy_health.synced();
    }
}

/// An EndpointSlice's `endpoints.kubernetes.io/last-change-trigger-time` (RFC 3339): when
/// the change that produced it happened (network programming latency starts there).
fn last_change_trigger_time(slice: &k8s_openapi::api::discovery::v1::EndpointSlice) -> Option<SystemTime> {
    let annotations = slice.metadata.annotations.as_ref()?;
    let text = annotations.get("endpoints.kubernetes.io/last-change-trigger-time")?;
    let t: jiff::Timestamp = text.parse().ok()?;
    Some(SystemTime::from(t))
}

/// Return the allocator's free memory to the system: a full list (thousands of objects parsed,
/// then mostly dropped) would otherwise leave the peak behind for good (glibc keeps freed
/// heap unless asked).
fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A run of the self-check asked for (`/verify?now`); never without one.
async fn asked_to_verify(verify: Option<&crate::verify::Shared>) {
    match verify {
        Some(shared) => shared.run_now.notified().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

mod outlier_detection;
mod self_check;
#[cfg(test)]
mod tests;
