//! kpr against the real kube-proxy (iptables and nftables modes, built from `tools/k8s`) on one
//! API server and this machine: four copies of upstream's test node (`kpr_tests::world`), one
//! without a proxy (the direct path) and one per proxy, all given the same
//! KubeProxyConfiguration (defaults: syncPeriod 30s, minSyncPeriod 1s). Per size (Services × 4
//! endpoints, ClusterIP; one NodePort Service, whose packets pass every ClusterIP rule of
//! kube-proxy's iptables chains first):
//! - NodePort connection rate and connect() latency from an external client, and ClusterIP
//!   connection rate from a pod (kpr: its per-packet path; in a cluster its socket path serves
//!   pods), alternating rounds over the paths;
//! - the agents' RSS, kpr's map memory, the size of kube-proxy's rules.
//!
//! At 10k: API write → traffic moving (a new EndpointSlice of a Service without endpoints),
//! p50/p99. At 10k and 20k: a full sync (the proxy restarted from nothing until a Service
//! created while it was down answers).
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddrV4, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use kpr_tests::{
    cluster::{Cluster, KubeProxy, Relay, kubeconfig_yaml},
    world::{NODE_IP, World},
};
use serde_json::json;
use testbed::{Cgroup, Netns};

use super::{BENCH_PORT, one_connection, percentile};

const NODE: &str = "bench-node";
const NODE_PORT: u16 = 30080;
const PODS: [Ipv4Addr; 4] =
    [Ipv4Addr::new(10, 1, 0, 2), Ipv4Addr::new(10, 1, 0, 3), Ipv4Addr::new(10, 1, 0, 4), Ipv4Addr::new(10, 1, 0, 5)];
/// A pod that is no endpoint: the ClusterIP client.
const CLIENT_POD: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 6);
const PATHS: [&str; 4] = ["direct", "kpr", "kube-proxy-iptables", "kube-proxy-nftables"];

fn config(mode: &str) -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: {mode}\n\
         hostnameOverride: {NODE}\nbindAddress: {NODE_IP}\nclusterCIDR: 10.0.0.0/8\n\
         metricsBindAddress: 127.0.0.1:10249\nhealthzBindAddress: 127.0.0.1:10256\nconntrack: {{maxPerCore: 0}}\n"
    )
}

fn service(name: &str, node_port: Option<u16>) -> String {
    let (ty, np) = match node_port {
        Some(p) => ("NodePort", format!(", nodePort: {p}")),
        None => ("ClusterIP", String::new()),
    };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: bench}}\nspec:\n  type: {ty}\n  \
         ports:\n  - {{name: http, port: 80, protocol: TCP, targetPort: {BENCH_PORT}{np}}}\n---\n"
    )
}

fn slice(name: &str) -> String {
    let eps: String = PODS
        .iter()
        .map(|ip| {
            format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n")
        })
        .collect();
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  namespace: bench\n  \
         labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports:\n\
         - {{name: http, port: {BENCH_PORT}, protocol: TCP}}\nendpoints:\n{eps}---\n"
    )
}

/// kpr in a world's node namespace, on the API server through a relay there.
pub struct Kpr {
    child: Child,
    pub pins: PathBuf,
    keep_pins: bool,
}

impl Kpr {
    fn start(cluster: &Cluster, world: &World, cgroup: &Cgroup, tag: &str) -> Result<Self> {
        Self::start_with(cluster, world, cgroup, tag, &config("iptables"), &[])
    }

    /// Start with `config` (a KubeProxyConfiguration without `clientConnection`); the pins
    /// are named after `tag`, so a restart with the same tag finds what the last run left.
    pub fn start_with(
        cluster: &Cluster,
        world: &World,
        cgroup: &Cgroup,
        tag: &str,
        config: &str,
        args: &[String],
    ) -> Result<Self> {
        let file = cluster_file(cluster, &format!("{tag}.yaml"));
        let kubeconfig = cluster_file(cluster, &format!("{tag}.kubeconfig"));
        std::fs::write(&kubeconfig, kubeconfig_yaml("https://127.0.0.1:6443", &cluster.ca(), cluster.admin_token()))?;
        std::fs::write(&file, format!("{config}clientConnection:\n  kubeconfig: {}\n", kubeconfig.display()))?;
        let pins = PathBuf::from(format!("/sys/fs/bpf/{tag}"));
        let log = std::env::temp_dir().join(format!("{tag}.log"));
        std::fs::File::create(&log)?;
        let agent = testbed::AgentCommand::new(&cgroup.path, &pins)
            .config(&file)
            .args(args)
            .log_to(&log)?
            .in_netns(&world.node)?;
        Ok(Self { child: agent.spawn()?, pins, keep_pins: false })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kill the agent and leave its pinned maps and programs for the next start.
    pub fn kill_keeping_pins(mut self) {
        self.keep_pins = true;
    }
}

impl Drop for Kpr {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !self.keep_pins {
            let _ = kpr::datapath::bpf::cleanup(&self.pins);
        }
    }
}

fn cluster_file(cluster: &Cluster, name: &str) -> PathBuf {
    cluster.dir.join(name)
}

/// The proxies, each in its world.
struct Peers {
    cluster: Cluster,
    worlds: BTreeMap<&'static str, World>,
    kpr: Option<Kpr>,
    kube_proxies: BTreeMap<&'static str, KubeProxy>,
    cgroup: Cgroup,
    _relay: Relay,
    tag: String,
    restarts: usize,
    _servers: Vec<std::thread::JoinHandle<()>>,
}

impl Peers {
    fn start() -> Result<Self> {
        let cluster =
            Cluster::start_with("kb-vs", &["--max-requests-inflight=1000", "--max-mutating-requests-inflight=500"])?;
        add_node(&cluster, NODE, "bench")?;
        cluster.apply(&format!("{}{}", service("target", Some(NODE_PORT)), slice("target")))?;

        let tag = testbed::unique_name("kbvs");
        let pods: Vec<IpAddr> = PODS.iter().chain([&CLIENT_POD]).map(|ip| IpAddr::from(*ip)).collect();
        let mut worlds = BTreeMap::new();
        let mut servers = Vec::new();
        for (i, path) in PATHS.iter().enumerate() {
            let world = World::new(&format!("{tag}{i}"), &pods, &[], &[])?;
            for (ip, netns) in &world.pods {
                if let IpAddr::V4(ip) = ip
                    && PODS.contains(ip)
                {
                    servers.push(serve(netns, *ip)?);
                }
            }
            worlds.insert(*path, world);
        }
        let cgroup = Cgroup::new(&tag)?;
        let relay = Relay::new(
            &worlds["kpr"].node,
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, 6443),
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, cluster.api_port),
        )?;
        let mut peers = Self {
            cluster,
            worlds,
            kpr: None,
            kube_proxies: BTreeMap::new(),
            cgroup,
            _relay: relay,
            tag,
            restarts: 0,
            _servers: servers,
        };
        for path in &PATHS[1..] {
            peers.start_proxy(path)?;
        }
        Ok(peers)
    }

    fn start_proxy(&mut self, path: &'static str) -> Result<()> {
        self.restarts += 1;
        if path == "kpr" {
            self.kpr = Some(Kpr::start(
                &self.cluster,
                &self.worlds["kpr"],
                &self.cgroup,
                &format!("{}-{}", self.tag, self.restarts),
            )?);
        } else {
            let mode = path.trim_start_matches("kube-proxy-");
            let (kp, _) = KubeProxy::start_with_config(&self.cluster, &self.worlds[path].node, &config(mode))?;
            self.kube_proxies.insert(path, kp);
        }
        Ok(())
    }

    fn stop_proxy(&mut self, path: &str) {
        if path == "kpr" {
            self.kpr = None;
        } else {
            // A sync it started (iptables-restore, nft) would outlive it and hold a CPU.
            let children = self.pid(path).map(child_pids).unwrap_or_default();
            self.kube_proxies.remove(path);
            for pid in children {
                // SAFETY: kill(2) on a process this run started (through kube-proxy).
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            // Its rules go too: the restart starts from nothing, as kpr's does from fresh pins.
            let _ = self.worlds[path]
                .node
                .sh("nft flush ruleset; for t in nat filter mangle; do iptables -t $t -F; iptables -t $t -X; done");
        }
    }

    /// Start `path` (stopped, its state gone) and time its full sync: until it serves the
    /// ClusterIP `ip`, in seconds (None: not within `limit`).
    fn full_sync(&mut self, path: &'static str, size: usize, ip: Ipv4Addr, limit: Duration) -> Result<Option<f64>> {
        let started = Instant::now();
        self.start_proxy(path)?;
        let took = self.wait_served(SocketAddrV4::new(ip, 80), &[path], started, limit).ok().map(|t| t[path]);
        match took {
            Some(took) => println!("full sync of {size} Services, {path}: {took:.2} s"),
            None => println!("full sync of {size} Services, {path}: over {} s", limit.as_secs()),
        }
        Ok(took)
    }

    fn pid(&self, path: &str) -> Option<u32> {
        if path == "kpr" { self.kpr.as_ref().map(|k| k.child.id()) } else { self.kube_proxies.get(path)?.pid() }
    }

    /// Create `count` ClusterIP Services with their slices, from `first` on (four kubectls at once).
    fn create_fillers(&self, first: usize, count: usize) -> Result<()> {
        let chunks = 4;
        let per = count.div_ceil(chunks);
        let mut children = Vec::new();
        for c in 0..chunks {
            let range = (first + c * per)..(first + ((c + 1) * per).min(count));
            if range.is_empty() {
                continue;
            }
            let yaml: String = range
                .map(|i| format!("{}{}", service(&format!("s{i:05}"), None), slice(&format!("s{i:05}"))))
                .collect();
            let file = self.cluster.dir.join(format!("fillers-{first}-{c}.yaml"));
            std::fs::write(&file, yaml)?;
            children.push(
                Command::new(kpr_tests::cluster::k8s_bin("kubectl")?)
                    .arg("--kubeconfig")
                    .arg(&self.cluster.admin_kubeconfig)
                    .args(["create", "-f"])
                    .arg(&file)
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()?,
            );
        }
        for child in children {
            let out = child.wait_with_output()?;
            if !out.status.success() {
                bail!("kubectl create: {}", String::from_utf8_lossy(&out.stderr));
            }
        }
        Ok(())
    }

    /// Create a marker Service with endpoints and wait until `paths` serve it: (its
    /// address, the time each took from the slice's creation).
    fn marker(&self, name: &str, paths: &[&'static str], timeout: Duration) -> Result<BTreeMap<&'static str, f64>> {
        self.cluster.apply(&service(name, None))?;
        let ip = self.cluster.cluster_ip("bench", name)?;
        let written = Instant::now();
        self.cluster.apply(&slice(name))?;
        self.wait_served(SocketAddrV4::new(ip, 80), paths, written, timeout)
    }

    /// Poll `addr` from the client pod of each of `paths` (in parallel) until it answers: the
    /// seconds since `since`.
    fn wait_served(
        &self,
        addr: SocketAddrV4,
        paths: &[&'static str],
        since: Instant,
        timeout: Duration,
    ) -> Result<BTreeMap<&'static str, f64>> {
        let handles: Vec<_> = paths
            .iter()
            .map(|path| {
                let pod = self.worlds[path].pod(CLIENT_POD);
                let handle = pod.spawn(move || {
                    while since.elapsed() < timeout {
                        if let Ok(conn) = TcpStream::connect_timeout(&addr.into(), Duration::from_millis(200)) {
                            drop(conn);
                            return Some(since.elapsed().as_secs_f64());
                        }
                        std::thread::sleep(Duration::from_micros(500));
                    }
                    None
                });
                (*path, handle)
            })
            .collect();
        let mut out = BTreeMap::new();
        for (path, handle) in handles {
            let took = handle?.join().map_err(|_| anyhow::anyhow!("poller panicked"))?;
            out.insert(path, took.with_context(|| format!("{path} never served {addr}"))?);
        }
        Ok(out)
    }

    /// Connection rate over every path: `rounds` × `per_round` new connections each,
    /// alternating; its rate and connect() times per path. To the NodePort from the external
    /// client, or with `cluster_ip` to that ClusterIP from the client pod.
    fn rates(
        &self,
        paths: &[&'static str],
        cluster_ip: Option<Ipv4Addr>,
        rounds: usize,
        per_round: usize,
    ) -> Result<BTreeMap<&'static str, Rate>> {
        let mut lat: BTreeMap<&'static str, Vec<Duration>> = BTreeMap::new();
        let mut time: BTreeMap<&'static str, Duration> = BTreeMap::new();
        let mut failed: BTreeMap<&'static str, usize> = BTreeMap::new();
        let mut round_rates: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
        for round in 0..=rounds {
            for &path in paths {
                let world = &self.worlds[path];
                // The direct path goes to the same four pods in turn, so that it differs from
                // the others by the proxy only, not by how many servers share the work.
                let netns: &Netns = if cluster_ip.is_some() { world.pod(CLIENT_POD) } else { &world.ext };
                let addr = move |i: usize| match (cluster_ip, path) {
                    (_, "direct") => SocketAddrV4::new(PODS[i % PODS.len()], BENCH_PORT),
                    (None, _) => SocketAddrV4::new(NODE_IP, NODE_PORT),
                    (Some(ip), _) => SocketAddrV4::new(ip, 80),
                };
                let n = if round == 0 { 20 } else { per_round }; // round 0 warms up
                // A connection that fails is counted (its time in the rate) and told, not fatal.
                let (elapsed, samples, failures) = netns.run(move || {
                    let started = Instant::now();
                    let (mut samples, mut failures) = (Vec::new(), Vec::new());
                    for i in 0..n {
                        match one_connection(addr(i)) {
                            Ok(took) => samples.push(took),
                            Err(e) => failures.push(format!("{path} to {}: {e}", addr(i))),
                        }
                    }
                    (started.elapsed(), samples, failures)
                })?;
                for failure in &failures {
                    eprintln!("round {round}: a connection failed: {failure}");
                }
                if round > 0 {
                    round_rates.entry(path).or_default().push(samples.len() as f64 / elapsed.as_secs_f64());
                    lat.entry(path).or_default().extend(samples);
                    *time.entry(path).or_default() += elapsed;
                    *failed.entry(path).or_default() += failures.len();
                }
            }
        }
        Ok(paths
            .iter()
            .map(|path| {
                let mut l = lat.remove(path).unwrap_or_default();
                l.sort();
                let rate = Rate {
                    conn_per_s: l.len() as f64 / time[path].as_secs_f64(),
                    round_rates: round_rates.remove(path).unwrap_or_default(),
                    p50_us: percentile(&l, 0.5),
                    p99_us: percentile(&l, 0.99),
                    max_us: percentile(&l, 1.0),
                    stalled: l.iter().filter(|t| **t >= STALLED).count(),
                    failed: failed.get(path).copied().unwrap_or(0),
                };
                (*path, rate)
            })
            .collect())
    }

    /// The agents' resident memory (MiB).
    fn rss(&self) -> BTreeMap<&'static str, f64> {
        PATHS[1..]
            .iter()
            .filter_map(|path| {
                let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid(path)?)).ok()?;
                let kb: f64 = status
                    .lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))?
                    .trim()
                    .trim_end_matches(" kB")
                    .parse()
                    .ok()?;
                Some((*path, kb / 1024.0))
            })
            .collect()
    }

    /// Kernel memory of kpr's maps (MiB).
    fn kpr_map_memory(&self) -> Option<f64> {
        map_memory(&self.kpr.as_ref()?.pins)
    }

    /// Lines of kube-proxy's rules (iptables-save, nft list ruleset) in its world.
    fn rule_lines(&self, path: &str) -> usize {
        let cmd = if path == "kube-proxy-iptables" { "iptables-save" } else { "nft list ruleset" };
        let out = Command::new("ip")
            .args(["netns", "exec", &self.worlds[path].node.name, "sh", "-c", cmd])
            .output()
            .map(|o| o.stdout)
            .unwrap_or_default();
        String::from_utf8_lossy(&out).lines().count()
    }
}

/// The bench's Node `node` (at [`NODE_IP`]) and namespace `namespace` on `cluster`.
pub fn add_node(cluster: &Cluster, node: &str, namespace: &str) -> Result<()> {
    cluster.apply(&format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {node}}}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: {namespace}}}\n"
    ))?;
    let status = format!("{{\"status\":{{\"addresses\":[{{\"type\":\"InternalIP\",\"address\":\"{NODE_IP}\"}}]}}}}");
    cluster.kubectl(&["patch", "node", node, "--subresource=status", "--type=merge", "-p", &status])?;
    Ok(())
}

/// Kernel memory of the maps pinned under `pins` (MiB), as bpftool reports it per map.
pub fn map_memory(pins: &std::path::Path) -> Option<f64> {
    let dir = kpr::datapath::bpf::pin_dir(pins);
    let mut bytes = 0u64;
    for entry in std::fs::read_dir(dir).ok()? {
        let path = entry.ok()?.path();
        if !path.file_name()?.to_string_lossy().starts_with("KPR_") {
            continue;
        }
        let out = Command::new("bpftool").args(["-j", "map", "show", "pinned"]).arg(&path).output().ok()?;
        let info: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        bytes += info["bytes_memlock"].as_u64().unwrap_or(0);
    }
    Some(bytes as f64 / 1048576.0)
}

/// The children of process `pid` (all its threads').
pub fn child_pids(pid: u32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|children| children.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<_>>())
        .collect()
}

/// A pod's single-threaded accept → name → close server on BENCH_PORT.
fn serve(netns: &Netns, ip: Ipv4Addr) -> Result<std::thread::JoinHandle<()>> {
    let listener = netns.run(move || std::net::TcpListener::bind((ip, BENCH_PORT)))??;
    Ok(std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let _ = std::io::Write::write_all(&mut conn, b"pod\n");
        }
    }))
}

/// A connect() this slow waited for a retransmitted SYN (the first comes after 1 s): a stall.
const STALLED: Duration = Duration::from_millis(200);

/// One path's connection rate and connect() times.
struct Rate {
    /// All rounds' connections over all rounds' time.
    conn_per_s: f64,
    /// Each round's rate, in round order (the paths take turns within a round).
    round_rates: Vec<f64>,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    /// Connections whose connect() took `STALLED` or longer.
    stalled: usize,
    /// Connections that failed (the bench's `CONNECT_TIMEOUT`, a reset, ...).
    failed: usize,
}

/// `path`'s rate against the direct path's, round by round.
fn vs_direct(rates: &BTreeMap<&'static str, Rate>, path: &str) -> f64 {
    super::median_ratio(&rates[path].round_rates, &rates["direct"].round_rates)
}

fn rates_json(rates: &BTreeMap<&'static str, Rate>) -> serde_json::Value {
    rates
        .iter()
        .map(|(path, r)| {
            let v = json!({"conn_per_s": r.conn_per_s, "vs_direct": vs_direct(rates, path),
                           "vs_direct_overall": r.conn_per_s / rates["direct"].conn_per_s, "p50_us": r.p50_us,
                           "p99_us": r.p99_us, "max_us": r.max_us, "stalled": r.stalled,
                           "failed": r.failed});
            (path.to_string(), v)
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn print_rates(title: &str, rates: &BTreeMap<&'static str, Rate>) {
    println!("{title}");
    println!(
        "{:>22} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>7}",
        "path", "conn/s", "vs direct", "p50 µs", "p99 µs", "max ms", "stalled", "failed"
    );
    for (path, r) in rates {
        println!(
            "{path:>22} {:>10.0} {:>10.3} {:>10.1} {:>10.1} {:>10.1} {:>8} {:>7}",
            r.conn_per_s,
            vs_direct(rates, path),
            r.p50_us,
            r.p99_us,
            r.max_us / 1e3,
            r.stalled,
            r.failed
        );
    }
}

/// How long a restarted proxy may take for its full sync before it is reported as timed out.
const FULL_SYNC_LIMIT: Duration = Duration::from_secs(420);

/// Sizes above this are created with every proxy stopped, then each proxy starts alone from
/// nothing (its full sync timed): on this machine, both kube-proxies re-syncing 10k+ Services
/// every second while Services kept coming starved the API server, and the run never got there.
const COLD_START_ABOVE: usize = 10_000;

/// How long a proxy's full sync at those sizes may take by default (`--cold-sync-limit S`;
/// kube-proxy's iptables mode took 5 minutes for its first sync of 10k here, and had not
/// finished 20k after 25).
pub const COLD_SYNC_LIMIT: Duration = Duration::from_secs(1500);

/// Run the comparison; `progress` gets the results so far after each size (the JSON and chart
/// are written then, so a long run keeps what it measured).
pub fn run(
    sizes: &[usize],
    rounds: usize,
    per_round: usize,
    latency_samples: usize,
    cold_sync_limit: Duration,
    mut progress: impl FnMut(&serde_json::Value) -> Result<()>,
) -> Result<serde_json::Value> {
    let mut peers = Peers::start()?;
    let proxies: Vec<&'static str> = PATHS[1..].to_vec();
    peers.wait_served(
        SocketAddrV4::new(peers.cluster.cluster_ip("bench", "target")?, 80),
        &proxies,
        Instant::now(),
        Duration::from_secs(120),
    )?;
    let target_ip = peers.cluster.cluster_ip("bench", "target")?;
    let mut by_size = serde_json::Map::new();
    let mut full_sync = serde_json::Map::new();
    let mut programming = serde_json::Value::Null;
    // Services so far: the target (and markers, a few dozen at most, not counted).
    let mut created = 1;
    for &size in sizes {
        let started = Instant::now();
        let cold = size > COLD_START_ABOVE;
        if cold {
            for path in &proxies {
                peers.stop_proxy(path);
            }
        }
        peers.create_fillers(created, size - created)?;
        created = size;
        let created_in = started.elapsed().as_secs_f64();
        // The paths measured: those serving at this size.
        let mut paths = vec!["direct"];
        if cold {
            println!("\n{size} Services × 4 endpoints (created in {created_in:.0} s, no proxy running)");
            let mut sync = serde_json::Map::new();
            // The slowest last, so that it holds no CPU while the others sync.
            let mut order = proxies.clone();
            order.sort_by_key(|path| *path == "kube-proxy-iptables");
            for path in order {
                let took = peers.full_sync(path, size, target_ip, cold_sync_limit)?;
                if took.is_some() {
                    paths.push(path);
                } else {
                    // Not measured at this size; its sync would hold a CPU through the rounds.
                    peers.stop_proxy(path);
                }
                sync.insert(path.to_string(), json!(took));
            }
            full_sync.insert(size.to_string(), sync.into());
        } else {
            let caught_up = peers.marker(&format!("mark-{size}"), &proxies, Duration::from_secs(600))?;
            println!("\n{size} Services × 4 endpoints (created in {created_in:.0} s; caught up: {caught_up:?})");
            paths.extend(&proxies);
        }
        let node_port = peers.rates(&paths, None, rounds, per_round)?;
        print_rates("NodePort from an external client, new connection per request:", &node_port);
        let cluster_ip = peers.rates(&paths, Some(target_ip), rounds, per_round)?;
        print_rates("ClusterIP from a pod (kpr: per-packet path):", &cluster_ip);
        let rss = peers.rss();
        let maps = peers.kpr_map_memory();
        let rules: BTreeMap<&str, usize> =
            ["kube-proxy-iptables", "kube-proxy-nftables"].iter().map(|p| (*p, peers.rule_lines(p))).collect();
        println!("agent RSS MiB: {rss:?}; kpr's maps: {maps:.1?} MiB; kube-proxy rule lines: {rules:?}");
        if size == 10_000 && latency_samples > 0 {
            programming = programming_latency(&peers, &proxies, latency_samples)?;
            println!("API write → traffic moving at 10k: {programming}");
        }
        // A full sync from a cold start at 10k (the sizes created cold got theirs above).
        if size == 10_000 {
            let mut sync = serde_json::Map::new();
            for &path in &proxies {
                peers.stop_proxy(path);
                peers.cluster.apply(&service(&format!("cold-{size}-{path}"), None))?;
                peers.cluster.apply(&slice(&format!("cold-{size}-{path}")))?;
                let ip = peers.cluster.cluster_ip("bench", &format!("cold-{size}-{path}"))?;
                let took = peers.full_sync(path, size, ip, FULL_SYNC_LIMIT)?;
                sync.insert(path.to_string(), json!(took));
            }
            full_sync.insert(size.to_string(), sync.into());
        }
        by_size.insert(
            size.to_string(),
            json!({
                "node_port": rates_json(&node_port),
                "cluster_ip_from_pod": rates_json(&cluster_ip),
                "rss_mib": rss,
                "kpr_map_memlock_mib": maps,
                "kube_proxy_rule_lines": rules,
            }),
        );
        progress(&json!({ "sizes": by_size, "api_write_to_traffic_10k": programming, "full_sync_s": full_sync }))?;
    }
    Ok(json!({ "sizes": by_size, "api_write_to_traffic_10k": programming, "full_sync_s": full_sync }))
}

/// API write → traffic moving: a Service without endpoints gets its EndpointSlice; the time
/// until each proxy lets a connection through (p50/p99 ms over `samples`).
fn programming_latency(peers: &Peers, proxies: &[&'static str], samples: usize) -> Result<serde_json::Value> {
    let mut took: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    for i in 0..samples {
        let name = format!("lat-{i}");
        peers.cluster.apply(&service(&name, None))?;
        let ip = peers.cluster.cluster_ip("bench", &name)?;
        // Past minSyncPeriod (1 s), so that the slice is a change of its own.
        std::thread::sleep(Duration::from_millis(2500));
        let written = Instant::now();
        peers.cluster.apply(&slice(&name))?;
        for (path, t) in peers.wait_served(SocketAddrV4::new(ip, 80), proxies, written, Duration::from_secs(60))? {
            took.entry(path).or_default().push(t * 1000.0);
        }
    }
    Ok(took
        .into_iter()
        .map(|(path, mut ms)| {
            ms.sort_by(f64::total_cmp);
            let at = |p: f64| ms[((ms.len() as f64 - 1.0) * p).round() as usize];
            (path.to_string(), json!({"p50_ms": at(0.5), "p99_ms": at(0.99)}))
        })
        .collect::<serde_json::Map<_, _>>()
        .into())
}
