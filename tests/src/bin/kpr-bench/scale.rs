//! `--scale`: kpr (and the real kube-proxy) against one API server holding a cluster's worth of
//! Services and EndpointSlices (synthetic: no pods behind the fillers), per shape (Services ×
//! endpoints each, slices of up to 100 endpoints):
//! - full sync from a cold start (nothing pinned, no rules) and after a restart (kpr's maps
//!   pinned, kube-proxy's rules in place): until a Service created before the start answers;
//! - API write → traffic moving: a probe Service's endpoint is moved between two pods, timed
//!   from the write until a new connection reaches the new pod (idle, then while fillers'
//!   slices change 100 times a second);
//! - the agent's RSS (and anonymous part), kpr's map memory, CPU per 1,000 endpoint changes;
//! - the share of changes programmed within 250 ms by the bench's clock and by the proxy's own
//!   `kubeproxy_network_programming_duration_seconds` (from `last-change-trigger-time`).
//!
//! Every proxy runs with `minSyncPeriod: 10ms` (kube-proxy's default 1 s would be the latency).
use std::{
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
    str::FromStr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kpr_tests::{
    cluster::{Cluster, KubeProxy, Relay},
    world::{NODE_IP, World},
};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use testbed::Cgroup;

use super::{BENCH_PORT, vs_kube_proxy::Kpr};

const NODE: &str = "scale-node";
const PROBE_A: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 2);
const PROBE_B: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 3);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 6);
const PER_SLICE: usize = 100;
const NAMESPACE: &str = "bench";
/// The service range: the largest the API server takes (a /16 holds 65,536 Services).
const SERVICE_RANGE: &str = "10.96.0.0/12";
/// Fillers get ClusterIPs from here up (explicit addresses: the API server's allocator was the
/// bottleneck of creating them); past the range's end, allocated.
const FILLER_IPS: u32 = u32::from_be_bytes([10, 97, 0, 0]);
const FILLER_IPS_END: u32 = u32::from_be_bytes([10, 111, 255, 255]);
/// The endpoints' addresses (nothing listens there: no connection goes to a filler).
const ENDPOINT_IPS: u32 = u32::from_be_bytes([10, 128, 0, 0]);
const CHURN_IPS: u32 = u32::from_be_bytes([10, 192, 0, 0]);
/// Endpoint changes per second of the churn.
const CHURN_RATE: u64 = 100;
/// The window CPU per change is measured over.
const CPU_WINDOW: Duration = Duration::from_secs(10);

/// Services × endpoints per Service, as `10000x4`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub services: usize,
    pub endpoints: usize,
}

impl FromStr for Shape {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let (services, endpoints) = s.split_once('x').context("a shape is SERVICESxENDPOINTS, as 10000x4")?;
        let shape = Self { services: services.parse()?, endpoints: endpoints.parse()? };
        if shape.services == 0 || shape.endpoints == 0 {
            bail!("a shape needs at least one Service and one endpoint");
        }
        Ok(shape)
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.services, self.endpoints)
    }
}

impl Shape {
    fn slices(&self) -> usize {
        self.endpoints.div_ceil(PER_SLICE)
    }
}

pub struct Options {
    pub proxies: Vec<String>,
    pub samples: usize,
    /// How long a kube-proxy's cold full sync may take before it is not measured further.
    pub peer_budget: Duration,
}

fn config(mode: &str) -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: {mode}\n\
         hostnameOverride: {NODE}\nbindAddress: {NODE_IP}\nclusterCIDR: 10.0.0.0/8\n\
         metricsBindAddress: 127.0.0.1:10249\nhealthzBindAddress: 127.0.0.1:10256\nconntrack: {{maxPerCore: 0}}\n\
         iptables: {{minSyncPeriod: 10ms}}\nnftables: {{minSyncPeriod: 10ms}}\n"
    )
}

fn service(name: &str, ip: Option<Ipv4Addr>) -> Service {
    let mut spec = json!({"type": "ClusterIP", "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": BENCH_PORT}]});
    if let Some(ip) = ip {
        spec["clusterIP"] = json!(ip.to_string());
    }
    serde_json::from_value(json!({"metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}))
        .expect("a Service")
}

/// A slice's body: `addresses` ready endpoints, the change's trigger time now.
fn slice(service: &str, index: usize, addresses: impl Iterator<Item = Ipv4Addr>) -> serde_json::Value {
    let endpoints: Vec<_> = addresses
        .map(|ip| json!({"addresses": [ip.to_string()], "conditions": {"ready": true, "serving": true, "terminating": false}}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-{index}"), "namespace": NAMESPACE,
                     "labels": {"kubernetes.io/service-name": service},
                     "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": jiff::Timestamp::now().to_string()}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": BENCH_PORT, "protocol": "TCP"}],
        "endpoints": endpoints,
    })
}

/// Filler `i`'s slice `s`; `moved`: its first endpoint is at its churn address.
fn filler_slice(shape: Shape, i: usize, s: usize, moved: bool) -> serde_json::Value {
    let range = s * PER_SLICE..((s + 1) * PER_SLICE).min(shape.endpoints);
    let first = range.start;
    let addrs = range.map(move |j| {
        let base = if moved && j == first {
            CHURN_IPS + (i * shape.slices() + s) as u32
        } else {
            ENDPOINT_IPS + (i * shape.endpoints + j) as u32
        };
        Ipv4Addr::from(base)
    });
    slice(&filler(i), s, addrs)
}

fn filler(i: usize) -> String {
    format!("s{i:06}")
}

/// A proxy under test in its own copy of the node.
enum Running {
    Kpr(Kpr),
    KubeProxy(KubeProxy),
}

struct Node {
    proxy: String,
    world: World,
    cgroup: Cgroup,
    tag: String,
    running: Option<Running>,
    _relay: Option<Relay>,
}

impl Node {
    fn new(cluster: &Cluster, proxy: &str) -> Result<Self> {
        let tag = testbed::unique_name("kbsc");
        let pods = [PROBE_A, PROBE_B, CLIENT].map(std::net::IpAddr::from);
        let world = World::new(&tag, &pods, &[BENCH_PORT], &[])?;
        let relay = (proxy == "kpr")
            .then(|| {
                Relay::new(
                    &world.node,
                    SocketAddrV4::new(Ipv4Addr::LOCALHOST, 6443),
                    SocketAddrV4::new(Ipv4Addr::LOCALHOST, cluster.api_port),
                )
            })
            .transpose()?;
        Ok(Self { proxy: proxy.to_owned(), world, cgroup: Cgroup::new(&tag)?, tag, running: None, _relay: relay })
    }

    /// Start the proxy; after [`Self::stop`] with `keep_state`, from what it left. kpr's maps
    /// are sized for `shape` (its defaults hold 262,144 backend slots: 10k × 100 needs 3M, one
    /// per endpoint and source scope).
    fn start(&mut self, cluster: &Cluster, shape: Shape) -> Result<()> {
        self.running = Some(if self.proxy == "kpr" {
            let room = |n: usize, floor: u32| (n as u32).next_power_of_two().max(floor);
            let args = [
                format!("--max-service-ports={}", room((shape.services + 4096) * 4, 262_144)),
                format!("--max-backends={}", room(3 * shape.services * shape.endpoints + 16_384, 262_144)),
            ];
            Running::Kpr(Kpr::start_with(cluster, &self.world, &self.cgroup, &self.tag, &config("iptables"), &args)?)
        } else {
            let mode = self.proxy.trim_start_matches("kube-proxy-");
            Running::KubeProxy(KubeProxy::start_with_config(cluster, &self.world.node, &config(mode))?.0)
        });
        Ok(())
    }

    /// Stop the proxy: with `keep_state`, its maps or rules stay (a restart finds them).
    fn stop(&mut self, keep_state: bool) {
        match self.running.take() {
            Some(Running::Kpr(kpr)) if keep_state => kpr.kill_keeping_pins(),
            Some(Running::KubeProxy(kp)) => {
                let children = kp.pid().map(super::vs_kube_proxy::child_pids).unwrap_or_default();
                drop(kp);
                for pid in children {
                    // SAFETY: kill(2) on a process this run started (through kube-proxy).
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                if !keep_state {
                    let _ = self.world.node.sh(
                        "nft flush ruleset; for t in nat filter mangle; do iptables -t $t -F; iptables -t $t -X; done",
                    );
                }
            }
            other => drop(other),
        }
    }

    fn pid(&self) -> Option<u32> {
        match self.running.as_ref()? {
            Running::Kpr(k) => Some(k.pid()),
            Running::KubeProxy(k) => k.pid(),
        }
    }

    /// (VmRSS, RssAnon) in MiB.
    fn memory(&self) -> Option<(f64, f64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        let field = |name: &str| -> Option<f64> {
            let kb: f64 =
                status.lines().find_map(|l| l.strip_prefix(name))?.trim().trim_end_matches(" kB").parse().ok()?;
            Some(kb / 1024.0)
        };
        Some((field("VmRSS:")?, field("RssAnon:")?))
    }

    /// User + system CPU time so far.
    fn cpu(&self) -> Option<Duration> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()?)).ok()?;
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
        Some(Duration::from_micros(ticks * 1_000_000 / hz))
    }

    fn map_mib(&self) -> Option<f64> {
        match self.running.as_ref()? {
            Running::Kpr(k) => super::vs_kube_proxy::map_memory(&k.pins),
            Running::KubeProxy(_) => None,
        }
    }

    /// The network programming histogram's (count within 250 ms, count).
    fn programming_histogram(&self) -> Option<(f64, f64)> {
        let addr: SocketAddr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10249).into();
        let (_, text) = self.world.node.run(move || kpr_tests::http_get(addr, "/metrics")).ok()?.ok()?;
        let sum = |suffix: &str| -> f64 {
            let name = format!("kubeproxy_network_programming_duration_seconds_{suffix}");
            text.lines()
                .filter(|l| l.starts_with(&name))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        let within = text
            .lines()
            .filter(|l| {
                l.starts_with("kubeproxy_network_programming_duration_seconds_bucket") && l.contains("le=\"0.25\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        Some((within, sum("count")))
    }

    /// Poll `addr` from the client pod until the answer comes from `pod`: seconds since `since`.
    fn wait_answer(&self, addr: SocketAddrV4, pod: Ipv4Addr, since: Instant, timeout: Duration) -> Result<f64> {
        let want = format!("{pod}:{BENCH_PORT}");
        let handle = self.world.pod(CLIENT).spawn(move || {
            while since.elapsed() < timeout {
                if let Ok(conn) = TcpStream::connect_timeout(&addr.into(), Duration::from_millis(200)) {
                    // The pod names itself in a line at once, then waits for questions.
                    let _ = conn.set_read_timeout(Some(Duration::from_millis(500)));
                    let mut answer = String::new();
                    let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(&conn), &mut answer);
                    if answer.trim() == want {
                        return Some(since.elapsed().as_secs_f64());
                    }
                }
                std::thread::sleep(Duration::from_micros(300));
            }
            None
        })?;
        let took = handle.join().map_err(|_| anyhow!("poller panicked"))?;
        took.with_context(|| format!("{}: {addr} never answered from {pod} within {timeout:?}", self.proxy))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop(false);
    }
}

/// The API, and the state of the fillers' slices the churn moves.
struct Api2 {
    rt: tokio::runtime::Runtime,
    client: kube::Client,
}

impl Api2 {
    fn new(cluster: &Cluster) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let kubeconfig = kube::config::Kubeconfig::read_from(&cluster.admin_kubeconfig)?;
        let client = rt.block_on(async {
            let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
            anyhow::Ok(kube::Client::try_from(config)?)
        })?;
        Ok(Self { rt, client })
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), NAMESPACE)
    }

    fn slices(&self) -> Api<EndpointSlice> {
        Api::namespaced(self.client.clone(), NAMESPACE)
    }

    /// Create the shape's Services and slices, many requests in flight.
    fn create_fillers(&self, shape: Shape) -> Result<()> {
        let (services, slices) = (self.services(), self.slices());
        self.rt.block_on(async move {
            let mut tasks = tokio::task::JoinSet::new();
            for i in 0..shape.services {
                let ip = FILLER_IPS + i as u32;
                let ip = (ip <= FILLER_IPS_END).then(|| Ipv4Addr::from(ip));
                let (services, slices) = (services.clone(), slices.clone());
                tasks.spawn(async move {
                    services.create(&PostParams::default(), &service(&filler(i), ip)).await?;
                    for s in 0..shape.slices() {
                        let body: EndpointSlice = serde_json::from_value(filler_slice(shape, i, s, false))?;
                        slices.create(&PostParams::default(), &body).await?;
                    }
                    anyhow::Ok(())
                });
                while tasks.len() >= 32 {
                    tasks.join_next().await.expect("tasks in flight")??;
                }
                if i > 0 && i % 10_000 == 0 {
                    println!("  {i} Services created");
                }
            }
            while let Some(done) = tasks.join_next().await {
                done??;
            }
            anyhow::Ok(())
        })
    }

    /// A Service with one slice whose endpoint is `pod`: its ClusterIP.
    fn create_with_endpoint(&self, name: &str, pod: Ipv4Addr) -> Result<Ipv4Addr> {
        self.rt.block_on(async {
            let svc = self.services().create(&PostParams::default(), &service(name, None)).await?;
            let body: EndpointSlice = serde_json::from_value(slice(name, 1, [pod].into_iter()))?;
            self.slices().create(&PostParams::default(), &body).await?;
            let ip = svc.spec.and_then(|s| s.cluster_ip).context("no ClusterIP")?;
            Ok(ip.parse()?)
        })
    }

    /// Move `name`'s endpoint to `pod` (its slice written whole).
    fn move_endpoint(&self, name: &str, pod: Ipv4Addr) -> Result<()> {
        let body = slice(name, 1, [pod].into_iter());
        self.rt.block_on(self.slices().patch(&format!("{name}-1"), &PatchParams::default(), &Patch::Merge(body)))?;
        Ok(())
    }

    /// Change fillers' slices at [`CHURN_RATE`] per second until `stop`; `done` counts them.
    fn start_churn(&self, shape: Shape, stop: Arc<AtomicBool>, done: Arc<AtomicUsize>) -> tokio::task::JoinHandle<()> {
        let slices = self.slices();
        self.rt.spawn(async move {
            let total = shape.services * shape.slices();
            let mut moved = vec![false; total];
            // A slice written again before its last write is answered would conflict (the API
            // server retries such patches): the tick goes to the next slice then.
            let busy = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
            let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / CHURN_RATE));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut tasks = tokio::task::JoinSet::new();
            let mut k = 0usize;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let Some(index) =
                    (0..total).map(|n| (k + n) % total).find(|index| !busy.lock().unwrap().contains(index))
                else {
                    continue;
                };
                k = index + 1;
                let (i, s) = (index % shape.services, (index / shape.services) % shape.slices());
                moved[index] = !moved[index];
                let body = filler_slice(shape, i, s, moved[index]);
                let (slices, done, busy) = (slices.clone(), done.clone(), busy.clone());
                busy.lock().unwrap().insert(index);
                tasks.spawn(async move {
                    let name = format!("{}-{s}", filler(i));
                    match slices.patch(&name, &PatchParams::default(), &Patch::Merge(body)).await {
                        Ok(_) => {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => eprintln!("churn: {name}: {e}"),
                    }
                    busy.lock().unwrap().remove(&index);
                });
                while tasks.try_join_next().is_some() {}
            }
            while tasks.join_next().await.is_some() {}
        })
    }
}

/// p50/p99/max of milliseconds.
fn summary(ms: &mut [f64]) -> serde_json::Value {
    ms.sort_by(f64::total_cmp);
    let at = |p: f64| ms.get(((ms.len() as f64 - 1.0) * p).round() as usize).copied();
    json!({"p50": at(0.5), "p99": at(0.99), "max": at(1.0), "samples": ms.len(),
           "share_within_250ms": ms.iter().filter(|t| **t <= 250.0).count() as f64 / ms.len().max(1) as f64})
}

/// Moves of the probe's endpoint: (API write → traffic ms, API answer ms) per sample.
fn probe_samples(
    api: &Api2,
    node: &Node,
    probe: Ipv4Addr,
    samples: usize,
    at: &mut Ipv4Addr,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (mut traffic, mut answer) = (Vec::new(), Vec::new());
    for _ in 0..samples {
        let to = if *at == PROBE_A { PROBE_B } else { PROBE_A };
        let written = Instant::now();
        api.move_endpoint("probe", to)?;
        answer.push(written.elapsed().as_secs_f64() * 1e3);
        traffic.push(node.wait_answer(SocketAddrV4::new(probe, 80), to, written, Duration::from_secs(120))? * 1e3);
        *at = to;
        // Past minSyncPeriod: each move is a change of its own.
        std::thread::sleep(Duration::from_millis(30));
    }
    Ok((traffic, answer))
}

/// One proxy at one shape, the objects created: its figures.
fn measure(
    cluster: &Cluster,
    api: &Api2,
    shape: Shape,
    proxy: &str,
    opts: &Options,
    probe: Ipv4Addr,
) -> Result<serde_json::Value> {
    let mut node = Node::new(cluster, proxy)?;
    let limit = if proxy == "kpr" { Duration::from_secs(600) } else { opts.peer_budget };
    // Cold: nothing pinned, no rules.
    let cold_ip = api.create_with_endpoint(&format!("cold-{}", node.tag), PROBE_A)?;
    let started = Instant::now();
    node.start(cluster, shape)?;
    let Ok(full) = node.wait_answer(SocketAddrV4::new(cold_ip, 80), PROBE_A, started, limit) else {
        println!("{proxy}: no full sync of {shape} within {} s", limit.as_secs());
        return Ok(json!({"not_finished_after_s": limit.as_secs()}));
    };
    println!("{proxy}: full sync {full:.2} s");
    // A figure of a cluster half programmed would say nothing.
    let log = std::env::temp_dir().join(format!("{}.log", node.tag));
    if proxy == "kpr" && std::fs::read_to_string(&log).is_ok_and(|text| text.contains("not programmed")) {
        bail!("kpr left service ports out at {shape} (see {})", log.display());
    }
    let (rss, anon) = node.memory().unwrap_or_default();
    let map_mib = node.map_mib();
    println!("{proxy}: RSS {rss:.1} MiB (anonymous {anon:.1}), maps {map_mib:.1?} MiB");

    let mut at = PROBE_A;
    node.wait_answer(SocketAddrV4::new(probe, 80), at, Instant::now(), limit)?;
    let histogram_before = node.programming_histogram();
    let (mut idle, mut idle_answer) = probe_samples(api, &node, probe, opts.samples, &mut at)?;
    let histogram_after = node.programming_histogram();
    let metric_share = match (histogram_before, histogram_after) {
        (Some((w0, c0)), Some((w1, c1))) if c1 > c0 => Some((w1 - w0) / (c1 - c0)),
        _ => None,
    };
    let idle = summary(&mut idle);
    println!("{proxy}: API write → traffic, idle: {idle}; API answer {}", summary(&mut idle_answer)["p50"]);

    // Under churn: first the CPU over a window of churn alone, then the probe's samples.
    let (stop, done) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
    let churn = api.start_churn(shape, stop.clone(), done.clone());
    std::thread::sleep(Duration::from_secs(2));
    let (cpu0, done0) = (node.cpu(), done.load(Ordering::Relaxed));
    std::thread::sleep(CPU_WINDOW);
    let (cpu1, done1) = (node.cpu(), done.load(Ordering::Relaxed));
    let changes = done1 - done0;
    let cpu_per_1000 = cpu0.zip(cpu1).map(|(a, b)| (b - a).as_secs_f64() * 1e3 * 1000.0 / changes.max(1) as f64);
    println!("{proxy}: {changes} changes in {CPU_WINDOW:?}: {cpu_per_1000:.0?} ms CPU per 1000");
    let churned = probe_samples(api, &node, probe, opts.samples, &mut at);
    stop.store(true, Ordering::Relaxed);
    api.rt.block_on(churn)?;
    let (mut busy, _) = churned?;
    let busy = summary(&mut busy);
    println!("{proxy}: API write → traffic under {CHURN_RATE} changes/s: {busy}");

    // Restart: the state kept, a Service created meanwhile.
    node.stop(true);
    let warm_ip = api.create_with_endpoint(&format!("warm-{}", node.tag), PROBE_A)?;
    let started = Instant::now();
    node.start(cluster, shape)?;
    let restart = node.wait_answer(SocketAddrV4::new(warm_ip, 80), PROBE_A, started, limit).ok();
    println!("{proxy}: restart sync {restart:.2?} s");
    Ok(json!({
        "full_sync_s": full,
        "restart_sync_s": restart,
        "api_to_traffic_ms": {"idle": idle, "under_churn": busy},
        "api_answer_ms_p50": summary(&mut idle_answer)["p50"],
        "network_programming_metric_share_within_250ms": metric_share,
        "rss_mib": rss,
        "rss_anon_mib": anon,
        "map_mib": map_mib,
        "cpu_per_1000_changes_ms": cpu_per_1000,
        "churn_changes_per_s": changes as f64 / CPU_WINDOW.as_secs_f64(),
    }))
}

/// Run every shape; the JSON (merged into what an earlier run wrote) after each.
pub fn run(
    shapes: &[Shape],
    opts: &Options,
    mut write: impl FnMut(&str, &str, serde_json::Value) -> Result<()>,
) -> Result<()> {
    for &shape in shapes {
        println!("\n{shape}: {} Services × {} endpoints", shape.services, shape.endpoints);
        let cluster = Cluster::start_with(
            "kb-scale",
            &[
                "--max-requests-inflight=2000",
                "--max-mutating-requests-inflight=1000",
                &format!("--service-cluster-ip-range={SERVICE_RANGE}"),
            ],
        )?;
        super::vs_kube_proxy::add_node(&cluster, NODE, NAMESPACE)?;
        let api = Api2::new(&cluster)?;
        let started = Instant::now();
        api.create_fillers(shape)?;
        let created = started.elapsed().as_secs_f64();
        println!("created in {created:.0} s");
        let probe = api.create_with_endpoint("probe", PROBE_A)?;
        for proxy in &opts.proxies {
            let figures = measure(&cluster, &api, shape, proxy, opts, probe)?;
            write(
                &shape.to_string(),
                proxy,
                json!({
                    "services": shape.services, "endpoints_per_service": shape.endpoints, "created_s": created, "figures": figures,
                }),
            )?;
        }
    }
    Ok(())
}
