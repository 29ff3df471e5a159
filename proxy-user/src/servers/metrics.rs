//! `/metrics`: kube-proxy's metrics under kube-proxy's names and labels
//! (`pkg/proxy/metrics/metrics.go`), so existing dashboards and alerts keep working, and kpr's
//! own: map pressure, conntrack, programming errors, source restarts, the datapath's
//! counters and each Service port's (read from the pinned maps at each scrape).
use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::SystemTime,
};

use proxy_common::{BackendKey, EndpointStats, ServiceStats, event, service_stat};

use crate::model::ServicePortName;

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

/// kpr's one datapath serves this family today; kube-proxy labels per-family proxiers.
const IP_FAMILY: &str = "IPv4";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct IpFamilyLabel {
    ip_family: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TrafficPolicyLabel {
    traffic_policy: String,
    ip_family: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabel {
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NameLabel {
    name: String,
}

type Timestamp = Gauge<f64, std::sync::atomic::AtomicU64>;
type Histograms = Family<IpFamilyLabel, Histogram, fn() -> Histogram>;

fn sync_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// kube-proxy's: 0.25 s, 0.5 s, 1–59 s, 60–115 s by 5, 2–5 min by 30 s.
fn programming_buckets() -> Histogram {
    let buckets = [0.25, 0.5]
        .into_iter()
        .chain((1..=59).map(f64::from))
        .chain((0..12).map(|i| 60.0 + 5.0 * f64::from(i)))
        .chain((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    Histogram::new(buckets)
}

/// The agent's metrics. Cheap to update from the sync loop (atomics).
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    sync_duration: Histograms,
    sync_full_duration: Histograms,
    sync_partial_duration: Histograms,
    network_programming: Histograms,
    last_synced: Family<IpFamilyLabel, Timestamp>,
    last_queued: Family<IpFamilyLabel, Timestamp>,
    endpoint_changes: Counter,
    endpoint_changes_pending: Gauge,
    service_changes: Counter,
    service_changes_pending: Gauge,
    no_local_endpoints: Family<TrafficPolicyLabel, Gauge>,
    healthz: Family<CodeLabel, Counter>,
    livez: Family<CodeLabel, Counter>,
    map_entries: Family<NameLabel, Gauge>,
    map_capacity: Family<NameLabel, Gauge>,
    service_ports_failed: Gauge,
    forward_direct: Gauge,
    sync_errors: Counter,
    source_restarts: Family<NameLabel, Counter>,
    conntrack_expired: Counter,
    shadow_mismatches: Family<ServiceLabel, Gauge>,
    shadow_comparisons: Counter,
    verify_runs: Counter,
    verify_failures: Counter,
    verify_probes: Gauge,
    sidelined: Family<EndpointLabel, Gauge>,
    sidelinings: Family<ServiceLabel, Counter>,
    /// The endpoints sidelined now, for `/sidelined`.
    sidelined_now: Mutex<std::collections::BTreeSet<crate::model::outliers::Sidelined>>,
    service_book: Arc<Mutex<ServiceBook>>,
    endpoint_book: Arc<Mutex<EndpointBook>>,
    /// `--endpoint-counters`: endpoints left uncounted (past the cap).
    endpoints_uncounted: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServiceLabel {
    namespace: String,
    service: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabel {
    namespace: String,
    service: String,
    endpoint: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new(None)
    }
}

impl Metrics {
    /// `pin_root`: the datapath whose counters each scrape reads.
    pub fn new(pin_root: Option<PathBuf>) -> Self {
        let mut m = Self {
            registry: Registry::default(),
            sync_duration: Histograms::new_with_constructor(sync_buckets),
            sync_full_duration: Histograms::new_with_constructor(sync_buckets),
            sync_partial_duration: Histograms::new_with_constructor(sync_buckets),
            network_programming: Histograms::new_with_constructor(programming_buckets),
            last_synced: Family::default(),
            last_queued: Family::default(),
            endpoint_changes: Counter::default(),
            endpoint_changes_pending: Gauge::default(),
            service_changes: Counter::default(),
            service_changes_pending: Gauge::default(),
            no_local_endpoints: Family::default(),
            healthz: Family::default(),
            livez: Family::default(),
            map_entries: Family::default(),
            map_capacity: Family::default(),
            service_ports_failed: Gauge::default(),
            forward_direct: Gauge::default(),
            sync_errors: Counter::default(),
            source_restarts: Family::default(),
            conntrack_expired: Counter::default(),
            shadow_mismatches: Family::default(),
            shadow_comparisons: Counter::default(),
            verify_runs: Counter::default(),
            verify_failures: Counter::default(),
            verify_probes: Gauge::default(),
            sidelined: Family::default(),
            sidelinings: Family::default(),
            sidelined_now: Mutex::default(),
            service_book: Arc::default(),
            endpoint_book: Arc::default(),
            endpoints_uncounted: Gauge::default(),
        };
        let r = &mut m.registry;
        // Counters get their `_total` suffix from the encoder.
        r.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            m.sync_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            m.sync_full_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            m.sync_partial_duration.clone(),
        );
        r.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            m.network_programming.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            m.last_synced.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            m.last_queued.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            m.endpoint_changes.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            m.endpoint_changes_pending.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            m.service_changes.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            m.service_changes_pending.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            m.no_local_endpoints.clone(),
        );
        r.register("kubeproxy_proxy_healthz", "Cumulative proxy healthz HTTP status", m.healthz.clone());
        r.register("kubeproxy_proxy_livez", "Cumulative proxy livez HTTP status", m.livez.clone());
        r.register(
            "kpr_map_entries",
            "Entries in kpr's BPF maps (services: service ports; backends: slots in use)",
            m.map_entries.clone(),
        );
        r.register("kpr_map_capacity", "Capacity of kpr's BPF maps", m.map_capacity.clone());
        r.register(
            "kpr_service_ports_not_programmed",
            "Service ports left out of the datapath at the last sync (did not fit the maps)",
            m.service_ports_failed.clone(),
        );
        r.register(
            "kpr_forward_direct",
            "1 while translated packets skip the host's forwarding path (nothing filters forwarded packets there)",
            m.forward_direct.clone(),
        );
        r.register("kpr_sync_errors", "Syncs that could not write the datapath completely", m.sync_errors.clone());
        r.register(
            "kpr_source_restarts",
            "Restarts of a failed source (kubernetes, manifests, host links)",
            m.source_restarts.clone(),
        );
        r.register(
            "kpr_conntrack_expired",
            "Per-packet conntrack entries removed by the agent's sweep",
            m.conntrack_expired.clone(),
        );
        r.register(
            "kpr_shadow_mismatches",
            "Shadow mode: frontends and sources where kpr would decide otherwise than the running kube-proxy",
            m.shadow_mismatches.clone(),
        );
        r.register(
            "kpr_shadow_comparisons",
            "Shadow mode: comparisons with kube-proxy's rules",
            m.shadow_comparisons.clone(),
        );
        r.register(
            "kpr_datapath_verify_runs",
            "Runs of the datapath's self-check (kpr verify): probes through the live programs",
            m.verify_runs.clone(),
        );
        r.register(
            "kpr_datapath_verify_failures",
            "Probes the live programs decided otherwise than the model (each followed by a resync)",
            m.verify_failures.clone(),
        );
        r.register(
            "kpr_datapath_verify_probes",
            "Frontends and source classes the last self-check probed",
            m.verify_probes.clone(),
        );
        r.register(
            "kpr_endpoint_sidelined",
            "Outlier detection: 1 while the endpoint is left out of the Service's new flows",
            m.sidelined.clone(),
        );
        r.register(
            "kpr_endpoint_sidelinings",
            "Outlier detection: endpoints of the Service left out of new flows for not answering",
            m.sidelinings.clone(),
        );
        r.register(
            "kpr_endpoint_counters_uncounted",
            "--endpoint-counters: endpoints past the cap, counted per Service port only",
            m.endpoints_uncounted.clone(),
        );
        if let Some(pin_root) = pin_root {
            r.register_collector(Box::new(DatapathCounters { pin_root: pin_root.clone() }));
            r.register_collector(Box::new(ServiceCounters {
                pin_root: pin_root.clone(),
                book: m.service_book.clone(),
            }));
            r.register_collector(Box::new(EndpointCounters { pin_root, book: m.endpoint_book.clone() }));
        }
        m
    }

    /// The Prometheus text exposition (OpenMetrics).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String");
        out
    }

    fn family() -> IpFamilyLabel {
        IpFamilyLabel { ip_family: IP_FAMILY.into() }
    }

    /// `count` Service (`service`) or EndpointSlice changes arrived.
    pub fn change_queued(&self, service: bool, count: usize) {
        let (total, pending) = if service {
            (&self.service_changes, &self.service_changes_pending)
        } else {
            (&self.endpoint_changes, &self.endpoint_changes_pending)
        };
        total.inc_by(count as u64);
        pending.inc_by(count as i64);
        self.last_queued.get_or_create(&Self::family()).set(unix_now());
    }

    /// A sync wrote the datapath: how long it took, whether it was a full one, and the
    /// network programming latencies (seconds since each change's trigger time).
    pub fn synced(&self, seconds: f64, full: bool, programming: &[f64]) {
        let family = Self::family();
        self.sync_duration.get_or_create(&family).observe(seconds);
        let by_kind = if full { &self.sync_full_duration } else { &self.sync_partial_duration };
        by_kind.get_or_create(&family).observe(seconds);
        for latency in programming {
            self.network_programming.get_or_create(&family).observe(*latency);
        }
        self.last_synced.get_or_create(&family).set(unix_now());
        self.synced_nothing();
    }

    /// Changes arrived that changed nothing in the datapath: none is pending.
    pub fn synced_nothing(&self) {
        self.endpoint_changes_pending.set(0);
        self.service_changes_pending.set(0);
    }

    /// Services with a Local traffic policy and no local endpoints, by policy.
    pub fn no_local_endpoints(&self, internal: usize, external: usize) {
        for (policy, count) in [("internal", internal), ("external", external)] {
            let labels = TrafficPolicyLabel { traffic_policy: policy.into(), ip_family: IP_FAMILY.into() };
            self.no_local_endpoints.get_or_create(&labels).set(count as i64);
        }
    }

    /// A map's use and size.
    pub fn map_use(&self, map: &str, entries: usize, capacity: u32) {
        let labels = NameLabel { name: map.into() };
        self.map_entries.get_or_create(&labels).set(entries as i64);
        self.map_capacity.get_or_create(&labels).set(i64::from(capacity));
    }

    /// Service ports that did not fit at the last sync; a sync with any is an error.
    pub fn programming_failures(&self, service_ports: usize) {
        self.service_ports_failed.set(service_ports as i64);
        if service_ports > 0 {
            self.sync_errors.inc();
        }
    }

    /// The node's addresses or links could not be programmed.
    pub fn sync_error(&self) {
        self.sync_errors.inc();
    }

    pub fn source_restarted(&self, source: &str) {
        self.source_restarts.get_or_create(&NameLabel { name: source.into() }).inc();
    }

    /// A sweep removed entries and left `tables` as they are: each table's use, and their sum
    /// as `conntrack`.
    pub fn conntrack_swept(
        &self,
        sweep: &crate::datapath::conntrack::Sweep,
        tables: &[crate::datapath::conntrack::TableUse],
    ) {
        self.conntrack_expired.inc_by(sweep.expired as u64);
        let mut book = self.service_book.lock().unwrap_or_else(|p| p.into_inner());
        for (id, count) in &sweep.unanswered {
            *book.swept_unanswered.entry(*id).or_default() += count;
        }
        drop(book);
        let mut book = self.endpoint_book.lock().unwrap_or_else(|p| p.into_inner());
        for (endpoint, count) in &sweep.unanswered_endpoints {
            *book.swept_unanswered.entry(*endpoint).or_default() += count;
        }
        drop(book);
        for table in tables {
            self.map_use(table.name, table.live, table.capacity);
        }
        let live = tables.iter().map(|t| t.live).sum();
        self.map_use("conntrack", live, tables.iter().map(|t| t.capacity).sum());
    }

    /// Shadow mode compared once: the mismatches per (namespace, Service).
    pub fn shadow_compared(&self, per_service: &std::collections::BTreeMap<(String, String), i64>) {
        self.shadow_comparisons.inc();
        self.shadow_mismatches.clear();
        for ((namespace, service), count) in per_service {
            let label = ServiceLabel { namespace: namespace.clone(), service: service.clone() };
            self.shadow_mismatches.get_or_create(&label).set(*count);
        }
    }

    /// Outlier detection sidelined an endpoint of `service`.
    pub fn sidelining(&self, service: &crate::model::ObjectKey) {
        let label = ServiceLabel { namespace: service.namespace.clone(), service: service.name.clone() };
        self.sidelinings.get_or_create(&label).inc();
    }

    /// The endpoints outlier detection has left out of the Services' backends, as the last
    /// sync wrote them: `kpr_endpoint_sidelined` and `/sidelined` say exactly these (an
    /// endpoint that left its Service, or a Service that opted out, goes from both).
    pub fn set_sidelined(&self, sidelined: &std::collections::BTreeSet<crate::model::outliers::Sidelined>) {
        let mut now = self.sidelined_now.lock().unwrap_or_else(|p| p.into_inner());
        if *now == *sidelined {
            return;
        }
        self.sidelined.clear();
        for s in sidelined {
            let label = EndpointLabel {
                namespace: s.namespace.clone(),
                service: s.service.clone(),
                endpoint: s.endpoint.clone(),
            };
            self.sidelined.get_or_create(&label).set(1);
        }
        now.clone_from(sidelined);
    }

    /// The endpoints outlier detection has sidelined now (`/sidelined`).
    pub fn sidelined_now(&self) -> Vec<crate::model::outliers::Sidelined> {
        self.sidelined_now.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect()
    }

    /// `--endpoint-counters`: the endpoints left uncounted at the last sync.
    pub fn endpoints_uncounted(&self, count: usize) {
        self.endpoints_uncounted.set(count as i64);
    }

    /// The service port each programmed service id is a frontend of, after a sync that
    /// changed them: what `kpr_service_*` are labelled with.
    pub fn service_ports(&self, ports: BTreeMap<u32, ServicePortName>) {
        self.service_book.lock().unwrap_or_else(|p| p.into_inner()).set_ports(ports);
    }

    /// Service id → service port (`namespace/name:port/protocol`), for `kpr services`.
    pub fn service_port_names(&self) -> BTreeMap<u32, String> {
        let book = self.service_book.lock().unwrap_or_else(|p| p.into_inner());
        book.ports.iter().map(|(id, name)| (*id, name.to_string())).collect()
    }

    /// The datapath's self-check ran once: `probes` probes, `failures` of them failed.
    pub fn verified(&self, probes: usize, failures: usize) {
        self.verify_runs.inc();
        self.verify_failures.inc_by(failures as u64);
        self.verify_probes.set(probes as i64);
    }

    pub fn forward_direct(&self, direct: bool) {
        self.forward_direct.set(i64::from(direct));
    }

    pub fn healthz(&self, ok: bool) {
        self.healthz.get_or_create(&code(ok)).inc();
    }

    pub fn livez(&self, ok: bool) {
        self.livez.get_or_create(&code(ok)).inc();
    }
}

fn code(ok: bool) -> CodeLabel {
    CodeLabel { code: if ok { "200" } else { "503" }.into() }
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

/// The datapath's event counters (translations, rejects, drops by reason, ...), read from the
/// pinned per-CPU array at each scrape: `kpr_datapath_events_total{event="..."}`.
#[derive(Debug)]
struct DatapathCounters {
    pin_root: PathBuf,
}

/// One scrape at a time reads the map.
static SCRAPE: Mutex<()> = Mutex::new(());

impl Collector for DatapathCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let _one = SCRAPE.lock().unwrap_or_else(|p| p.into_inner());
        let Ok(counters) = crate::datapath::bpf::read_counters(&self.pin_root) else {
            return Ok(()); // no datapath (yet): nothing to report
        };
        let mut family = encoder.encode_descriptor(
            "kpr_datapath_events",
            "Datapath events by kind: translations, rejects, drops and their reasons",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (name, value) in counters {
            let labels = [("event", name)];
            ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// The `kpr_service_*` counters and what a word of [`ServiceStats`] is reported as.
const SERVICE_COUNTERS: [(&str, &str, u32); 6] = [
    ("kpr_service_new_flows", "New flows the per-packet path balanced", service_stat::NEW_FLOWS),
    ("kpr_service_socket_connects", "connect() calls the socket path translated", service_stat::CONNECTS),
    (
        "kpr_service_unanswered_flows",
        "New per-packet flows that expired with no answer from their endpoint",
        service_stat::UNANSWERED,
    ),
    ("kpr_service_packets", "Packets of the per-packet path's flows, both directions", service_stat::PACKETS),
    ("kpr_service_bytes", "Bytes of the per-packet path's flows, both directions", service_stat::BYTES),
    (
        "kpr_service_rejects",
        "New connections refused (a TCP reset, ICMP port unreachable, ECONNREFUSED): no endpoints",
        service_stat::EVENTS + event::REJECTED,
    ),
];

/// The `kpr_endpoint_*` counters (`--endpoint-counters`): the words an endpoint has.
const ENDPOINT_COUNTERS: [(&str, &str, u32); 5] = [
    ("kpr_endpoint_new_flows", "New flows the per-packet path balanced to the endpoint", service_stat::NEW_FLOWS),
    (
        "kpr_endpoint_socket_connects",
        "connect() calls the socket path translated to the endpoint",
        service_stat::CONNECTS,
    ),
    (
        "kpr_endpoint_unanswered_flows",
        "New per-packet flows to the endpoint that expired with no answer from it",
        service_stat::UNANSWERED,
    ),
    (
        "kpr_endpoint_packets",
        "Packets of the per-packet path's flows of the endpoint, both directions",
        service_stat::PACKETS,
    ),
    (
        "kpr_endpoint_bytes",
        "Bytes of the per-packet path's flows of the endpoint, both directions",
        service_stat::BYTES,
    ),
];

/// What the per-endpoint collector holds between scrapes: an endpoint no longer counted is
/// forgotten (counted again, its series starts from zero).
#[derive(Debug, Default)]
struct EndpointBook {
    /// Unanswered flows to the endpoint the agent's conntrack sweep removed.
    swept_unanswered: BTreeMap<BackendKey, u64>,
    /// The last counts reported: never reported lower (a scrape may miss a slot's fold).
    reported: BTreeMap<BackendKey, EndpointStats>,
}

impl EndpointBook {
    fn per_endpoint(&mut self, read: &BTreeMap<BackendKey, EndpointStats>) -> BTreeMap<BackendKey, EndpointStats> {
        self.reported.retain(|key, _| read.contains_key(key));
        self.swept_unanswered.retain(|key, _| read.contains_key(key));
        let mut out = BTreeMap::new();
        for (key, now) in read {
            let mut now = *now;
            now.words[service_stat::UNANSWERED as usize] += self.swept_unanswered.get(key).copied().unwrap_or(0);
            let last = self.reported.entry(*key).or_default();
            for (l, n) in last.words.iter_mut().zip(now.words) {
                *l = (*l).max(n);
            }
            out.insert(*key, *last);
        }
        out
    }
}

/// `kpr_endpoint_*{endpoint}`: each counted endpoint's counters, read from the pinned map at
/// each scrape (none without `--endpoint-counters`).
#[derive(Debug)]
struct EndpointCounters {
    pin_root: PathBuf,
    book: Arc<Mutex<EndpointBook>>,
}

impl Collector for EndpointCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let read = match crate::datapath::bpf::read_endpoint_stats(&self.pin_root) {
            Ok(read) if !read.is_empty() => read,
            _ => return Ok(()), // no datapath (yet), or no endpoint counted
        };
        let per_endpoint = self.book.lock().unwrap_or_else(|p| p.into_inner()).per_endpoint(&read);
        let labelled: Vec<(String, EndpointStats)> = per_endpoint
            .iter()
            .filter_map(|(key, stats)| Some((crate::model::outliers::Endpoint::of_key(key)?.to_string(), *stats)))
            .collect();
        for (name, help, word) in ENDPOINT_COUNTERS {
            let mut family =
                encoder.encode_descriptor(name, help, None, prometheus_client::metrics::MetricType::Counter)?;
            for (endpoint, stats) in &labelled {
                let labels = [("endpoint", endpoint.as_str())];
                ConstCounter::new(stats.words[word as usize]).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// What the per-service collector holds between scrapes (in the agent's memory: after a
/// restart a port's series goes on from the map's counts alone, which Prometheus takes for a
/// counter reset).
#[derive(Debug, Default)]
struct ServiceBook {
    /// Each programmed service id's port (a port has a service id per frontend).
    ports: BTreeMap<u32, ServicePortName>,
    /// Unanswered flows the agent's conntrack sweep removed (the programs count the others).
    swept_unanswered: BTreeMap<u32, u64>,
    /// The last counts reported per service id: never reported lower (a scrape may miss a
    /// flow-cache slot's fold, which the next one sees).
    reported: BTreeMap<u32, ServiceStats>,
    /// Per service id, what it counted before it served its present port (a frontend that
    /// another Service took over keeps its id): not that port's.
    before: BTreeMap<u32, ServiceStats>,
    /// The counts of frontends that were removed or taken over, per port: its series go on
    /// from them.
    retired: BTreeMap<ServicePortName, ServiceStats>,
}

impl ServiceBook {
    fn set_ports(&mut self, ports: BTreeMap<u32, ServicePortName>) {
        let old = std::mem::replace(&mut self.ports, ports);
        let changed: Vec<(u32, ServicePortName)> =
            old.into_iter().filter(|(id, port)| self.ports.get(id) != Some(port)).collect();
        if changed.is_empty() && self.retired.is_empty() {
            return;
        }
        let live: std::collections::BTreeSet<&ServicePortName> = self.ports.values().collect();
        for (id, port) in changed {
            let last = self.reported.get(&id).copied().unwrap_or_default();
            if live.contains(&port) {
                let share = last.since(&self.before.get(&id).copied().unwrap_or_default());
                self.retired.entry(port).or_default().add(&share);
            }
            if self.ports.contains_key(&id) {
                self.before.insert(id, last);
            } else {
                self.swept_unanswered.remove(&id);
                self.reported.remove(&id);
                self.before.remove(&id);
            }
        }
        self.retired.retain(|port, _| live.contains(port));
    }

    /// Per port: the counts of its frontends now (`read`, by service id), never below what was
    /// reported before.
    fn per_port(&mut self, read: &BTreeMap<u32, ServiceStats>) -> BTreeMap<ServicePortName, ServiceStats> {
        let mut out: BTreeMap<ServicePortName, ServiceStats> = self.retired.clone();
        for (id, port) in &self.ports {
            let mut now = read.get(id).copied().unwrap_or_default();
            now.words[service_stat::UNANSWERED as usize] += self.swept_unanswered.get(id).copied().unwrap_or(0);
            let last = self.reported.entry(*id).or_default();
            for (l, n) in last.words.iter_mut().zip(now.words) {
                *l = (*l).max(n);
            }
            let share = last.since(&self.before.get(id).copied().unwrap_or_default());
            out.entry(port.clone()).or_default().add(&share);
        }
        out
    }
}

/// `kpr_service_*{namespace,service,port}`: each Service port's counters, every frontend's
/// summed, read from the pinned maps at each scrape.
#[derive(Debug)]
struct ServiceCounters {
    pin_root: PathBuf,
    book: Arc<Mutex<ServiceBook>>,
}

impl Collector for ServiceCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(read) = crate::datapath::bpf::read_service_stats(&self.pin_root) else {
            return Ok(()); // no datapath (yet): nothing to report
        };
        let per_port = self.book.lock().unwrap_or_else(|p| p.into_inner()).per_port(&read);
        let labels = |port: &ServicePortName| {
            [
                ("namespace", port.service.namespace.clone()),
                ("service", port.service.name.clone()),
                ("port", port.port.clone()),
            ]
        };
        for (name, help, word) in SERVICE_COUNTERS {
            let mut family =
                encoder.encode_descriptor(name, help, None, prometheus_client::metrics::MetricType::Counter)?;
            for (port, stats) in &per_port {
                ConstCounter::new(stats.word(word)).encode(family.encode_family(&labels(port))?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "kpr_service_drops",
            "Packets dropped or answered in place of their flow, by reason",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (port, stats) in &per_port {
            for reason in (0..event::COUNT).filter(|r| *r != event::REJECTED) {
                let count = stats.word(service_stat::EVENTS + reason);
                if count == 0 {
                    continue;
                }
                let [ns, svc, p] = labels(port);
                let labels = [ns, svc, p, ("reason", event::NAMES[reason as usize].to_string())];
                ConstCounter::new(count).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Metrics;

    #[test]
    fn kube_proxy_names_and_values() {
        let m = Metrics::default();
        m.change_queued(true, 1);
        m.change_queued(false, 2);
        let text = m.encode();
        assert!(text.contains("kubeproxy_sync_proxy_rules_endpoint_changes_total 2\n"), "{text}");
        assert!(text.contains("kubeproxy_sync_proxy_rules_endpoint_changes_pending 2\n"));
        assert!(text.contains("kubeproxy_sync_proxy_rules_service_changes_total 1\n"));
        m.synced(0.003, false, &[0.7]);
        m.no_local_endpoints(1, 2);
        m.healthz(false);
        let text = m.encode();
        assert!(text.contains("kubeproxy_sync_proxy_rules_endpoint_changes_pending 0\n"), "{text}");
        assert!(text.contains("kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1\n"));
        assert!(text.contains("kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1\n"));
        assert!(
            text.contains("kubeproxy_network_programming_duration_seconds_bucket{le=\"1.0\",ip_family=\"IPv4\"} 1\n")
        );
        assert!(
            text.contains("kubeproxy_network_programming_duration_seconds_bucket{le=\"0.5\",ip_family=\"IPv4\"} 0\n")
        );
        assert!(text.contains(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\",ip_family=\"IPv4\"} 2\n"
        ));
        assert!(text.contains("kubeproxy_proxy_healthz_total{code=\"503\"} 1\n"));
        assert!(text.contains("# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge\n"));
    }

    #[test]
    fn a_ports_counters_sum_its_frontends_never_go_down_and_outlive_a_removed_or_moved_frontend() {
        use std::collections::BTreeMap;

        use proxy_common::{ServiceStats, service_stat::PACKETS};

        use super::ServiceBook;
        use crate::model::{ObjectKey, Protocol, ServicePortName};
        let port =
            ServicePortName { service: ObjectKey::new("ns", "web"), port: "http".into(), protocol: Protocol::Tcp };
        let stats = |packets: u64| {
            let mut s = ServiceStats::default();
            s.words[PACKETS as usize] = packets;
            s
        };
        let packets = |out: &BTreeMap<ServicePortName, ServiceStats>| out[&port].words[PACKETS as usize];
        let mut book = ServiceBook::default();
        book.set_ports(BTreeMap::from([(1, port.clone()), (2, port.clone())]));
        assert_eq!(packets(&book.per_port(&BTreeMap::from([(1, stats(10)), (2, stats(5))]))), 15);
        // A read that saw a fold twice, then one that did not: never below what was reported.
        assert_eq!(packets(&book.per_port(&BTreeMap::from([(1, stats(14)), (2, stats(5))]))), 19);
        assert_eq!(packets(&book.per_port(&BTreeMap::from([(1, stats(12)), (2, stats(5))]))), 19);
        // Frontend 2 goes (its port stays): the series goes on from its last counts.
        book.set_ports(BTreeMap::from([(1, port.clone())]));
        assert_eq!(packets(&book.per_port(&BTreeMap::from([(1, stats(20))]))), 25);
        // Frontend 1 is taken over by another Service's port: its counts so far stay web's,
        // the other port starts from zero.
        let api = ServicePortName { service: ObjectKey::new("ns", "api"), ..port.clone() };
        book.set_ports(BTreeMap::from([(1, api.clone()), (3, port.clone())]));
        let out = book.per_port(&BTreeMap::from([(1, stats(24)), (3, stats(1))]));
        assert_eq!((packets(&out), out[&api].words[PACKETS as usize]), (26, 4));
        // The port goes: nothing is reported for it.
        book.set_ports(BTreeMap::new());
        assert!(book.per_port(&BTreeMap::new()).is_empty());
    }
}
