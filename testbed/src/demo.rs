//! The demo (`kpr-demo`, what `cargo xtask run` starts without a kubeconfig): a "node" network namespace
//! with three "pods" behind a NodePort Service and an "external" client beside it; the agent
//! (`kpr agent`) runs inside the node namespace on a dedicated cgroup, reading
//! manifests. It shows connections spread over the pods through the ClusterIP (socket path)
//! and through the NodePort from outside (per-packet path), a scale-down, `kpr trace`, and
//! the kube-proxy endpoints. Everything stays in namespaces this demo made and is removed on
//! exit.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

use kpr::datapath::bpf;

use crate::{self as testbed, AgentCommand, Cgroup, Netns, PinRoot, Topology};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);
const NODE_PORT: u16 = 30080;
/// The node's address toward the external client, and the client's.
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 100);
const POD_PORT: u16 = 8080;
const REQUESTS: usize = 30;
const TIMEOUT: Duration = Duration::from_secs(2);

/// The demo's Service, dual-stack: a NodePort for http, a ClusterIP port for dns.
fn service_manifest() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: demo}}\nspec:\n  type: NodePort\n  \
         clusterIP: {CLUSTER_IP}\n  clusterIPs: ['{CLUSTER_IP}', '{CLUSTER_IP6}']\n  ipFamilies: [IPv4, IPv6]\n  \
         ipFamilyPolicy: PreferDualStack\n  ports:\n  - {{name: http, port: 80, protocol: TCP, nodePort: {NODE_PORT}}}\n  \
         - {{name: dns, port: 53, protocol: UDP}}\n"
    )
}

pub async fn run(keep_running: bool) -> Result<()> {
    if !testbed::is_root() {
        bail!("the demo needs root (network namespaces, cgroups, BPF)");
    }
    let tag = format!("kpr-demo-{}", std::process::id());
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let interrupted = interrupted.clone();
        // SIGTERM too (`kill`, `timeout`): its default action would end the demo before it
        // removes the namespaces, cgroup and pins it made.
        tokio::spawn(async move {
            kpr::shutdown_signal().await;
            interrupted.store(true, Ordering::Relaxed);
        });
    }

    // Resources are dropped in reverse order: agent, cgroup, pins, manifests, namespaces.
    println!("demo: creating node {tag}-node with pods pod-a, pod-b, pod-c and an external client {tag}-ext");
    let mut topology = Topology::new(&tag, &["pod-a", "pod-b", "pod-c"])?;
    for pod in &mut topology.pods {
        pod.serve(POD_PORT)?;
    }
    let node = &topology.client;
    node.route_packets()?;
    let external = Netns::new(&format!("{tag}-ext"))?;
    node.ip(&["link", "add", "ext0", "type", "veth", "peer", "name", "eth0", "netns", &external.name])?;
    node.ip(&["addr", "add", &format!("{NODE_IP}/24"), "dev", "ext0"])?;
    node.ip(&["link", "set", "ext0", "up"])?;
    external.ip(&["addr", "add", &format!("{EXTERNAL_IP}/24"), "dev", "eth0"])?;
    external.ip(&["link", "set", "eth0", "up"])?;

    let manifests = TempDir::new(std::env::temp_dir().join(&tag))?;
    let pin_root = PinRoot::new("kpr-demo");
    let mut cgroup = Cgroup::new(&tag)?;

    let pod_ips: Vec<IpAddr> = topology.pods.iter().map(|p| p.ip.into()).collect();
    let pod_ips6: Vec<IpAddr> = topology.pods.iter().map(|p| p.ip6.into()).collect();
    let slice_ports = [("http", POD_PORT, "TCP"), ("dns", POD_PORT, "UDP")];
    testbed::write_atomic(&manifests.0, "service.yaml", &service_manifest())?;
    testbed::write_atomic(
        &manifests.0,
        "slice.yaml",
        &testbed::slice_manifest("demo", "web", "web-1", &pod_ips, &slice_ports),
    )?;
    testbed::write_atomic(
        &manifests.0,
        "slice6.yaml",
        &testbed::slice_manifest("demo", "web", "web-6", &pod_ips6, &slice_ports),
    )?;
    println!(
        "demo: manifests in {} (Service demo/web {CLUSTER_IP} and {CLUSTER_IP6}: 80/TCP (NodePort {NODE_PORT}), \
         53/UDP -> pods :{POD_PORT})",
        manifests.0.display()
    );

    let log = std::env::temp_dir().join(format!("{tag}.agent.log"));
    let agent = Agent::start(node, &manifests.0, &cgroup.path, &pin_root.0, &log)?;
    let result = async {
        let pins = pin_root.0.clone();
        tokio::task::spawn_blocking(move || {
            // The agent's start included: loading its programs took up to 10 s on a busy
            // two-CPU machine.
            testbed::wait_programmed(&pins, "10.96.0.10:80/TCP", Some(3), Duration::from_secs(60))?;
            testbed::wait_programmed(&pins, "[fd00:96::10]:80/TCP", Some(3), Duration::from_secs(20))
        })
        .await?
        .with_context(|| format!("agent log:\n{}", std::fs::read_to_string(&log).unwrap_or_default()))?;
        println!(
            "demo: agent (pid {}) programmed the service; the client runs in cgroup {} and netns {}",
            agent.0.id(),
            cgroup.path.display(),
            node.name
        );
        cgroup.enter()?;
        show_requests(&topology, CLUSTER_IP.into(), "3 endpoints").await?;
        show_requests(&topology, CLUSTER_IP6.into(), "3 endpoints, IPv6").await?;
        show_node_port(&external)?;

        println!("\ndemo: scaling down: pod-c leaves the EndpointSlice");
        testbed::write_atomic(
            &manifests.0,
            "slice.yaml",
            &testbed::slice_manifest("demo", "web", "web-1", &pod_ips[..2], &slice_ports),
        )?;
        let pins = pin_root.0.clone();
        tokio::task::spawn_blocking(move || {
            testbed::wait_programmed(&pins, "10.96.0.10:80/TCP", Some(2), Duration::from_secs(20))
        })
        .await??;
        show_requests(&topology, CLUSTER_IP.into(), "2 endpoints").await?;

        println!("\ndemo: why an external connection goes where it goes (`kpr trace {EXTERNAL_IP} {NODE_IP}:{NODE_PORT}/TCP`):");
        let destination = format!("{NODE_IP}:{NODE_PORT}/TCP").parse()?;
        print!("{}", kpr::inspect::trace::text(&kpr::inspect::trace::trace(&pin_root.0, EXTERNAL_IP.into(), destination, None)?));
        println!("\ndemo: what the datapath holds (`kpr services --pin-root {}`):", pin_root.0.display());
        print!("{}", kpr::inspect::services::render(&pin_root.0)?);
        println!("\ndemo: kube-proxy's endpoints, inside the node namespace:");
        for (port, path) in [(10256, "/healthz"), (10249, "/proxyMode")] {
            let (code, body) =
                node.run(move || testbed::http_get(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port).into(), path, TIMEOUT))??;
            println!("  curl 127.0.0.1:{port}{path} -> {code} {body}");
        }
        println!(
            "demo: maps can be dumped with `bpftool map dump pinned {}/KPR_SERVICES`",
            bpf::pin_dir(&pin_root.0).display()
        );
        if keep_running {
            println!("demo: running until Ctrl-C");
            while !interrupted.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        anyhow::Ok(())
    }
    .await;
    cgroup.leave()?;
    drop(agent);
    let _ = std::fs::remove_file(&log);
    if result.is_ok() {
        println!("demo: done, cleaning up");
    }
    result
}

/// `kpr agent` (this binary) inside the node namespace; on drop, stopped (by its pid) and its
/// datapath removed from inside that namespace (`kpr cleanup`, which undoes the links'
/// settings there).
struct Agent(Child, Command);

impl Agent {
    fn start(
        node: &Netns,
        manifests: &std::path::Path,
        cgroup: &std::path::Path,
        pins: &std::path::Path,
        log: &std::path::Path,
    ) -> Result<Self> {
        std::fs::File::create(log)?;
        // In the node namespace: the per-packet programs go on the node's links (the pods'
        // and the external client's veths), never the host's.
        let agent = AgentCommand::new(cgroup, pins)
            .manifests(manifests)
            .args(["--node-name", "demo-node", "--iptables-min-sync-period", "0s"])
            .log_to(log)?
            .in_netns(node)?;
        let mut cleanup = Command::new(testbed::kpr_bin());
        cleanup.args(["cleanup", "--pin-root"]).arg(pins).stdout(Stdio::null());
        node.exec_in(&mut cleanup)?;
        Ok(Self(agent.spawn()?, cleanup))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SIGTERM: the agent's orderly shutdown.
        // SAFETY: kill on the pid of our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        if self.0.wait().is_err() {
            let _ = self.0.kill();
        }
        let _ = self.1.status();
    }
}

/// Connections from the external client to the NodePort (per-packet path): who answered, and
/// the source address the pods saw.
fn show_node_port(external: &Netns) -> Result<()> {
    let target = SocketAddrV4::new(NODE_IP, NODE_PORT);
    let (counts, seen) = external.run(move || -> Result<_> {
        let mut counts = BTreeMap::<String, usize>::new();
        let mut seen = String::new();
        for _ in 0..REQUESTS {
            let (name, peer) = testbed::tcp_ask_peer(target, TIMEOUT).context("TCP to the NodePort from outside")?;
            *counts.entry(name).or_default() += 1;
            seen = peer;
        }
        Ok((counts, seen))
    })??;
    println!("demo: {REQUESTS} TCP connections from the external client {EXTERNAL_IP} to the NodePort {target}:");
    for (pod, n) in &counts {
        println!("  {pod:<6} {n:>3} {}", "#".repeat(*n));
    }
    println!("demo: the pods saw the source {seen} (masqueraded: the node's address toward the pod)");
    Ok(())
}

/// Send requests through the ClusterIP `ip` from the client namespace; print who answered.
async fn show_requests(topology: &Topology, ip: IpAddr, label: &str) -> Result<()> {
    let tcp = SocketAddr::new(ip, 80);
    let udp = SocketAddr::new(ip, 53);
    let (tcp_counts, udp_counts, peer) = topology.client.run(move || -> Result<_> {
        let timeout = Duration::from_secs(2);
        let mut tcp_counts = BTreeMap::<String, usize>::new();
        let mut udp_counts = BTreeMap::<String, usize>::new();
        let mut peer = None;
        for _ in 0..REQUESTS {
            let (name, p) = testbed::tcp_ask(tcp, timeout).context("TCP request through the ClusterIP")?;
            *tcp_counts.entry(name).or_default() += 1;
            peer = Some(p);
            let (name, _) = testbed::udp_ask(udp, timeout).context("UDP request through the ClusterIP")?;
            *udp_counts.entry(name).or_default() += 1;
        }
        Ok((tcp_counts, udp_counts, peer))
    })??;
    println!("demo: {REQUESTS} TCP connections to {tcp} ({label}):");
    for (pod, n) in &tcp_counts {
        println!("  {pod:<6} {n:>3} {}", "#".repeat(*n));
    }
    println!("demo: {REQUESTS} UDP requests to {udp}:");
    for (pod, n) in &udp_counts {
        println!("  {pod:<6} {n:>3} {}", "#".repeat(*n));
    }
    if let Some(peer) = peer {
        println!("demo: getpeername() on the client socket says {peer} (the ClusterIP, not the pod)");
    }
    Ok(())
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(path: PathBuf) -> Result<Self> {
        std::fs::create_dir_all(&path)?;
        Ok(Self(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
