//! `kpr agent --shadow`: kpr's plan from the API, compared with the kube-proxy that runs on the
//! node, before switching. Nothing is loaded, attached or written: the sources and the model
//! run as in the agent, and after every quiet burst of changes (and every `syncPeriod`) the
//! plan's verdict for each frontend and source class is compared with what kube-proxy's rules,
//! read back as it wrote them ([`crate::source::kube_proxy_rules`]), do with the same
//! connection. A difference seen in two comparisons in a row is a mismatch: logged when it
//! appears and when it goes, counted per Service (`kpr_shadow_mismatches`), and listed by
//! `kpr shadow report` (the metrics server's `/shadow`).
use std::{
    collections::{BTreeMap, BTreeSet},
    future::Future,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use anyhow::Result;
use proxy_common::{
    SCOPE_EXTERNAL, SCOPE_NODE, SCOPE_POD, SERVICE_FLAG_DROP_NO_ENDPOINTS, SERVICE_FLAG_EXTERNAL_ADDR,
    SERVICE_FLAG_SNAT,
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::{
    agent::{AgentConfig, SourceConfig, Syncer},
    datapath::{Capacity, Programmer, fake},
    model::{
        IpFamily, NodeInfo, Protocol,
        cidr::Cidr,
        desired::{ClusterState, Desired, DesiredPort},
        node::{DetectLocal, NodePlan},
    },
    servers::{metrics::Metrics, proxy_health::ProxyHealth},
    source::{
        self,
        kube_proxy_rules::{self, Frontend, Mode, Packet, RuleSet, Verdict},
    },
};

/// How long the sources stay quiet before a comparison, at least: kube-proxy needs its own
/// sync to catch up with a change (`minSyncPeriod`, 1 s by default).
const MIN_SETTLE: Duration = Duration::from_millis(250);

/// One frontend and source class where kpr and kube-proxy decide differently.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mismatch {
    /// `namespace/name:port` of the Service port (`?` when only kube-proxy has the frontend).
    pub service: String,
    /// `address:port/PROTOCOL`; a NodePort is `*:port/PROTOCOL`.
    pub frontend: String,
    /// `pod` (a source the local-traffic detector calls local), `external`, `node`.
    pub source: String,
    pub kpr: serde_json::Value,
    pub kube_proxy: serde_json::Value,
    /// A difference kpr makes on purpose (docs/behaviour.md, "Deviations"): why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deviation: Option<String>,
}

/// kube-proxy's iptables mode lets the node's own connection to an external IP or
/// LoadBalancer IP of a Service without endpoints leave the node (its REJECT is on the input
/// and forward hooks only); kpr refuses it, as the nftables mode does.
const NODE_TO_EXTERNAL_WITHOUT_ENDPOINTS: &str = "kpr rejects the node's own connection to an external or \
     LoadBalancer IP of a Service without endpoints, as kube-proxy's nftables mode does; its iptables mode sends it \
     out of the node";

/// Why kpr decides `ours` (its entry `entry`) where kube-proxy in `mode` decides `theirs`, when
/// kpr does so on purpose.
fn deviation(
    mode: Mode,
    scope: u8,
    entry: Option<&DesiredPort>,
    dst_local: bool,
    ours: &Verdict,
    theirs: &Verdict,
) -> Option<&'static str> {
    // An external or LoadBalancer IP (not a ClusterIP), not the node's own.
    let external = entry.is_some_and(|e| e.flags & SERVICE_FLAG_EXTERNAL_ADDR != 0);
    let node_to_external = mode == Mode::Iptables && scope == SCOPE_NODE && external && !dst_local;
    (node_to_external && *ours == Verdict::Reject && *theirs == Verdict::Pass)
        .then_some(NODE_TO_EXTERNAL_WITHOUT_ENDPOINTS)
}

/// The last comparison, as `/shadow` serves it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShadowReport {
    /// Comparisons made so far.
    pub comparisons: u64,
    /// When the last one ran (seconds since the epoch).
    pub compared_at: f64,
    /// Frontends × source classes compared.
    pub verdicts: usize,
    /// kube-proxy's mode per family (`IPv4`, `IPv6`).
    pub kube_proxy: BTreeMap<String, String>,
    /// What could not be compared (no rules of a family, a read that failed).
    pub problems: Vec<String>,
    /// Differences seen in the last two comparisons.
    pub mismatches: Vec<Mismatch>,
    /// Differences kpr makes on purpose, with the reason.
    pub deviations: Vec<Mismatch>,
    /// Differences seen in the last comparison only (kube-proxy may not have caught up).
    pub pending: usize,
}

impl ShadowReport {
    pub fn render(&self) -> String {
        let mut out = format!(
            "comparisons: {}, verdicts compared: {}, pending differences: {}, kube-proxy: {}\n",
            self.comparisons,
            self.verdicts,
            self.pending,
            self.kube_proxy.iter().map(|(f, m)| format!("{f} {m}")).collect::<Vec<_>>().join(", ")
        );
        for p in &self.problems {
            out.push_str(&format!("problem: {p}\n"));
        }
        if self.mismatches.is_empty() {
            out.push_str("no mismatches\n");
        }
        for m in &self.mismatches {
            out.push_str(&format!(
                "MISMATCH {} {} from {}: kpr {} | kube-proxy {}\n",
                m.service, m.frontend, m.source, m.kpr, m.kube_proxy
            ));
        }
        for m in &self.deviations {
            out.push_str(&format!(
                "deviation {} {} from {}: kpr {} | kube-proxy {} ({})\n",
                m.service,
                m.frontend,
                m.source,
                m.kpr,
                m.kube_proxy,
                m.deviation.as_deref().unwrap_or_default()
            ));
        }
        out
    }
}

/// The verdict of kpr's plan for one entry.
fn kpr_verdict(port: Option<&DesiredPort>) -> Verdict {
    let Some(port) = port else { return Verdict::Pass };
    if port.backends.is_empty() {
        return if port.flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0 { Verdict::Drop } else { Verdict::Reject };
    }
    Verdict::Endpoints {
        endpoints: port.backends.iter().map(|(ip, port)| SocketAddr::new(*ip, *port)).collect(),
        masquerade: port.flags & SERVICE_FLAG_SNAT != 0,
        affinity_seconds: port.affinity_timeout,
        source_ranges: port.source_ranges.clone(),
    }
}

/// A connection of each source class, as kube-proxy's rules see its source, and the address
/// NodePorts are tried on.
struct Sources {
    pod: (IpAddr, String),
    external: IpAddr,
    node: IpAddr,
    node_port: Option<IpAddr>,
}

/// Link names the rules may test (`-i`): the pod's as the detector names pod links.
const EXTERNAL_LINK: &str = "kpr-shadow-ext";

impl Sources {
    /// Addresses no rule names for another reason: the last but one of a local-traffic CIDR
    /// for a pod, a documentation address from outside, the node's own address.
    fn of(family: IpFamily, node: &NodeView) -> Option<Self> {
        let usable = |ip: &&IpAddr| IpFamily::of(ip) == family && !ip.is_loopback() && !is_link_local(ip);
        // The Node's own address first (kube-proxy's node IP), then the links'.
        let node_ip = node.node_ips.iter().chain(&node.info.addresses).find(usable).copied()?;
        let serves_node_ports =
            |ip: &&IpAddr| node.node_addrs.get(*ip).is_some_and(|flags| flags & proxy_common::NODE_ADDR_NODEPORT != 0);
        let node_port =
            node.node_ips.iter().chain(node.node_addrs.keys()).filter(usable).find(serves_node_ports).copied();
        let external = match family {
            IpFamily::V4 => IpAddr::V4(Ipv4Addr::new(203, 0, 113, 254)),
            IpFamily::V6 => IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0xfe)),
        };
        let pod_ip =
            node.local_cidrs.iter().find(|c| IpFamily::of(&c.addr) == family).map(last_but_one).unwrap_or(external);
        let pod_link = match node.detect {
            DetectLocal::BridgeInterface(name) => name.clone(),
            DetectLocal::InterfaceNamePrefix(prefix) => format!("{prefix}kprshadow"),
            _ => "kpr-shadow-pod".to_owned(),
        };
        Some(Self { pod: (pod_ip, pod_link), external, node: node_ip, node_port })
    }

    fn packet(&self, scope: u8, frontend: &Frontend, dst: IpAddr, dst_local: bool) -> Packet {
        let (src, src_local, in_link) = match scope {
            SCOPE_POD => (self.pod.0, false, Some(self.pod.1.clone())),
            SCOPE_EXTERNAL => (self.external, false, Some(EXTERNAL_LINK.to_owned())),
            _ => (self.node, true, None),
        };
        Packet {
            src,
            src_local,
            in_link,
            dst,
            dst_local,
            proto: frontend.proto,
            dport: frontend.port,
            ranges_symbolic: scope != SCOPE_NODE,
        }
    }
}

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => a.is_link_local(),
        IpAddr::V6(a) => a.is_unicast_link_local(),
    }
}

fn last_but_one(cidr: &Cidr) -> IpAddr {
    match cidr.addr {
        IpAddr::V4(a) => {
            let host = u32::MAX.checked_shr(u32::from(cidr.len)).unwrap_or(0);
            IpAddr::V4((u32::from(a) | host).saturating_sub(1).into())
        }
        IpAddr::V6(a) => {
            let host = u128::MAX.checked_shr(u32::from(cidr.len)).unwrap_or(0);
            IpAddr::V6((u128::from(a) | host).saturating_sub(1).into())
        }
    }
}

/// The node facts the comparison needs: its addresses, detector and plan.
pub struct NodeView<'a> {
    pub info: &'a NodeInfo,
    pub detect: &'a DetectLocal,
    pub local_cidrs: &'a BTreeSet<Cidr>,
    pub node_ips: &'a [IpAddr],
    /// The node's addresses and their `NODE_ADDR_*` flags (which serve NodePorts).
    pub node_addrs: &'a BTreeMap<IpAddr, u32>,
}

/// Every difference between kpr's plan and kube-proxy's rules of `family`: each frontend
/// either names (kpr's service range catch-alls aside), from each source class. Returns the
/// mismatches and the number of verdicts compared.
pub fn compare(
    desired: &Desired,
    family: IpFamily,
    (mode, rules): (Mode, &RuleSet),
    node: &NodeView,
) -> (Vec<Mismatch>, usize) {
    let Some(sources) = Sources::of(family, node) else {
        return (Vec::new(), 0);
    };
    let mut frontends: BTreeMap<Frontend, String> = BTreeMap::new();
    for (key, port) in desired.iter().filter(|(k, _)| k.port != 0) {
        let ip = IpAddr::from(key.addr);
        if IpFamily::of(&ip) != family {
            continue;
        }
        let addr = (!ip.is_unspecified()).then_some(ip);
        let frontend = Frontend { addr, proto: key.proto, port: u16::from_be(key.port) };
        frontends.insert(frontend, port.name.to_string());
    }
    for frontend in rules.frontends() {
        if frontend.addr.is_none_or(|ip| IpFamily::of(&ip) == family) {
            frontends.entry(frontend).or_insert_with(|| "?".to_owned());
        }
    }
    let mut mismatches = Vec::new();
    let mut compared = 0;
    for (frontend, service) in &frontends {
        let (dst, dst_local) = match (frontend.addr, sources.node_port) {
            (Some(ip), _) => (ip, node.info.addresses.contains(&ip)),
            (None, Some(ip)) => (ip, true),
            // No address serves NodePorts: nothing reaches them.
            (None, None) => continue,
        };
        let Some(protocol) = Protocol::from_ipproto(frontend.proto) else { continue };
        // A NodePort as kpr's entry has it: the family's unspecified address.
        let addr = frontend.addr.unwrap_or(family.unspecified());
        let shown = format!("{}/{protocol}", SocketAddr::new(addr, frontend.port));
        for (scope, source) in [(SCOPE_POD, "pod"), (SCOPE_EXTERNAL, "external"), (SCOPE_NODE, "node")] {
            let key = crate::model::desired::frontend_key(addr, frontend.port, protocol, scope);
            let entry = desired.get(&key);
            let ours = kpr_verdict(entry);
            let theirs = rules.verdict(&sources.packet(scope, frontend, dst, dst_local));
            compared += 1;
            if ours != theirs {
                let json = |v: &Verdict| serde_json::to_value(v).unwrap_or_default();
                mismatches.push(Mismatch {
                    service: service.clone(),
                    frontend: shown.clone(),
                    source: source.to_owned(),
                    kpr: json(&ours),
                    kube_proxy: json(&theirs),
                    deviation: deviation(mode, scope, entry, dst_local, &ours, &theirs).map(str::to_owned),
                });
            }
        }
    }
    (mismatches, compared)
}

/// Shared between the comparison loop and the metrics server: the last report, and a way to
/// ask for a comparison now (`/shadow?compare`, `kpr shadow report --now`).
#[derive(Default)]
pub struct Shared {
    pub report: Mutex<ShadowReport>,
    pub compare_now: tokio::sync::Notify,
}

pub type SharedReport = Arc<Shared>;

/// Run shadow mode until `shutdown` completes.
pub async fn run(cfg: AgentConfig, shutdown: impl Future<Output = ()>) -> Result<()> {
    let listeners =
        crate::servers::proxy_servers::Listeners::bind(cfg.metrics_bind_address, cfg.healthz_bind_address).await?;
    let metrics = Arc::new(Metrics::new(None));
    let proxy_health = Arc::new(ProxyHealth::new(2 * cfg.sync_period, metrics.clone()));
    let report = SharedReport::default();
    let shared = report.clone();
    let route: crate::servers::http_server::Handler = Arc::new(move |request| {
        if request.uri.query() == Some("compare") {
            shared.compare_now.notify_one();
        }
        crate::servers::http_server::json(http::StatusCode::OK, &*shared.report.lock().expect("shadow report"))
    });
    let server_tasks =
        listeners.serve(metrics.clone(), proxy_health.clone(), cfg.configz.clone(), Some(("/shadow", route)));
    tracing::info!(node = %cfg.node.name, "shadow mode: nothing is attached; comparing with the running kube-proxy");

    let (tx, mut rx) = mpsc::channel(4096);
    let name = cfg.node.name.clone();
    let options = cfg.options;
    let host_task = {
        let tx = tx.clone();
        tokio::spawn(async move { source::host::run(tx).await })
    };
    let source_task = match cfg.source {
        SourceConfig::Manifests(dir) => tokio::spawn(async move { source::manifests::run(dir, name, tx).await }),
        SourceConfig::Kube { kubeconfig, master } => {
            let config = source::kube::config(kubeconfig.as_deref(), master.as_deref()).await?;
            let client = kube::Client::try_from(config)?;
            tokio::spawn(async move { source::kube::run(client, name, options, tx).await })
        }
    };
    let programmer = Programmer::recover(&mut fake::FakeMaps::new(Capacity { service_ports: 0, backends: 0 }))?;
    let mut syncer = Syncer::new(ClusterState::with_options(NodeInfo::default(), cfg.options), programmer, cfg.node);
    syncer.host_links = source::host::snapshot()?;
    let mut shadow = Shadow { report: report.clone(), metrics, previous: BTreeSet::new() };

    let settle = cfg.min_sync_period.max(MIN_SETTLE);
    let mut periodic = tokio::time::interval(cfg.sync_period.max(settle));
    periodic.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    // (first, last) change not compared yet: compared once quiet for `settle`, or at the
    // latest `syncPeriod` after the first, so that steady churn cannot hold comparisons off.
    let mut changes: Option<(Instant, Instant)> = None;
    loop {
        let settled = changes.map(|(first, last)| (last + settle).min(first + cfg.sync_period.max(settle)));
        tokio::select! {
            event = rx.recv() => match event {
                Some(event) => {
                    proxy_health.queued_update();
                    syncer.apply(event);
                    let now = Instant::now();
                    changes = Some((changes.map_or(now, |(first, _)| first), now));
                }
                None => {
                    tracing::warn!("all sources stopped");
                    break;
                }
            },
            () = sleep_until(settled) => {
                changes = None;
                if shadow.compare_now(&mut syncer).await {
                    proxy_health.synced();
                }
            }
            _ = periodic.tick() => if changes.is_none() && shadow.compare_now(&mut syncer).await {
                proxy_health.synced();
            },
            () = report.compare_now.notified() => {
                shadow.compare_now(&mut syncer).await;
            }
            () = &mut shutdown => break,
        }
    }
    source_task.abort();
    host_task.abort();
    for task in server_tasks {
        task.abort();
    }
    Ok(())
}

/// The shadow agent's report from its metrics server; `now`: after two comparisons made for
/// this call.
pub fn fetch_report(address: SocketAddr, now: bool) -> Result<ShadowReport> {
    use anyhow::Context as _;
    let get = |path: &str| -> Result<ShadowReport> {
        let (status, body) = crate::inspect::http_get(address, path, Duration::from_secs(5))
            .with_context(|| format!("no shadow agent answers at {address}"))?;
        anyhow::ensure!(status == 200, "{address}{path} answered {status}: is the agent in shadow mode?");
        serde_json::from_str(&body).context("the shadow report")
    };
    let mut report = get("/shadow")?;
    if now {
        let deadline = Instant::now() + Duration::from_secs(60);
        for _ in 0..2 {
            let before = report.comparisons;
            report = get("/shadow?compare")?;
            while report.comparisons <= before {
                anyhow::ensure!(Instant::now() < deadline, "the shadow agent did not compare within 60 s");
                std::thread::sleep(Duration::from_millis(50));
                report = get("/shadow")?;
            }
        }
    }
    Ok(report)
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

struct Shadow {
    report: SharedReport,
    metrics: Arc<Metrics>,
    /// The differences of the last comparison: one seen again is a mismatch.
    previous: BTreeSet<(String, String, String, String, String)>,
}

impl Shadow {
    /// Compare now; false when there is nothing to compare yet (the sources have not listed
    /// everything).
    async fn compare_now(&mut self, syncer: &mut Syncer) -> bool {
        if !syncer.state.synced() {
            let mut report = self.report.report.lock().expect("shadow report");
            report.comparisons += 1;
            report.problems = vec!["the sources have not listed every Service and EndpointSlice yet".to_owned()];
            return false;
        }
        // iptables-save and nft run off the loop's thread.
        let read = match tokio::task::spawn_blocking(|| IpFamily::ALL.map(|f| (f, kube_proxy_rules::read(f)))).await {
            Ok(read) => read,
            Err(e) => IpFamily::ALL.map(|f| (f, Err(anyhow::anyhow!("reading the rules failed: {e}")))),
        };
        let mut host = fake::FakeHost::default();
        syncer.force_node_plan(&mut host);
        let desired = syncer.state.desired();
        let plan: Option<&NodePlan> = host.plans.last();
        let (no_cidrs, no_addrs) = (BTreeSet::new(), BTreeMap::new());
        // kube-proxy's node IPs: the configured ones, then the Node object's.
        let settings = &syncer.node_settings;
        let given = settings.node_ips.iter().copied().chain(settings.bind_address.filter(|a| !a.is_unspecified()));
        let node_ips: Vec<IpAddr> =
            given.chain(syncer.node_object.iter().flat_map(|n| n.addresses.iter().copied())).collect();
        let node = NodeView {
            info: syncer.state.node(),
            detect: &syncer.node_settings.detect_local,
            local_cidrs: plan.map_or(&no_cidrs, |p| &p.local_cidrs),
            node_ips: &node_ips,
            node_addrs: plan.map_or(&no_addrs, |p| &p.node_addrs),
        };
        let mut report = ShadowReport::default();
        let mut seen = Vec::new();
        for (family, rules) in read {
            let label = family.address_type().to_owned();
            match rules {
                Ok(Some((mode, rules))) => {
                    let name = match mode {
                        Mode::Iptables => "iptables",
                        Mode::Nftables => "nftables",
                    };
                    report.kube_proxy.insert(label, name.to_owned());
                    let (mismatches, compared) = compare(&desired, family, (mode, &rules), &node);
                    report.verdicts += compared;
                    seen.extend(mismatches);
                }
                Ok(None) => report.problems.push(format!("{label}: no kube-proxy rules on this node")),
                Err(e) => report.problems.push(format!("{label}: {e:#}")),
            }
        }
        let key = |m: &Mismatch| {
            (m.service.clone(), m.frontend.clone(), m.source.clone(), m.kpr.to_string(), m.kube_proxy.to_string())
        };
        let (deviations, seen): (Vec<Mismatch>, Vec<Mismatch>) = seen.into_iter().partition(|m| m.deviation.is_some());
        let now: BTreeSet<_> = seen.iter().map(key).collect();
        let confirmed: Vec<Mismatch> = seen.into_iter().filter(|m| self.previous.contains(&key(m))).collect();
        let mut old = self.report.report.lock().expect("shadow report");
        for m in confirmed.iter().filter(|m| !old.mismatches.contains(m)) {
            tracing::warn!(service = %m.service, frontend = %m.frontend, source = %m.source, kpr = %m.kpr,
                kube_proxy = %m.kube_proxy, "shadow: kpr would decide otherwise than kube-proxy");
        }
        for m in old.mismatches.iter().filter(|m| !confirmed.contains(m)) {
            tracing::info!(service = %m.service, frontend = %m.frontend, source = %m.source, "shadow: mismatch gone");
        }
        let mut per_service: BTreeMap<(String, String), i64> = BTreeMap::new();
        for m in &confirmed {
            let (namespace, name) = m.service.split_once('/').unwrap_or(("", &m.service));
            let name = name.split(':').next().unwrap_or(name);
            *per_service.entry((namespace.to_owned(), name.to_owned())).or_default() += 1;
        }
        self.metrics.shadow_compared(&per_service);
        report.comparisons = old.comparisons + 1;
        report.compared_at =
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        report.pending = now.iter().filter(|k| !confirmed.iter().any(|m| key(m) == **k)).count();
        report.mismatches = confirmed;
        report.deviations = deviations;
        *old = report;
        self.previous = now;
        true
    }
}

#[cfg(test)]
mod tests;
