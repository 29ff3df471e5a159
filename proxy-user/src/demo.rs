//! `kpr demo` (what `cargo xtask run` starts without a kubeconfig): three "pods" in network
//! namespaces behind a ClusterIP, the agent on a dedicated cgroup reading manifests, and a
//! client in a "node" namespace showing requests spread over the pods, then a scale-down.
//! Everything stays on this machine and is removed on exit.
use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

use crate::{
    agent::{self, AgentConfig, SourceConfig},
    model::node::{NodeSettings, TcLinks},
    datapath::bpf::{self, DatapathConfig},
    testbed::{self, Cgroup, Topology},
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const PORTS: [(&str, u16, &str); 2] = [("http", 80, "TCP"), ("dns", 53, "UDP")];
const POD_PORT: u16 = 8080;
const REQUESTS: usize = 30;

pub async fn run(keep_running: bool) -> Result<()> {
    if !crate::testbed::is_root() {
        bail!("the demo needs root (network namespaces, cgroups, BPF)");
    }
    let tag = format!("kpr-demo-{}", std::process::id());
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let interrupted = interrupted.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                interrupted.store(true, Ordering::Relaxed);
            }
        });
    }

    // Resources are dropped in reverse order: cgroup, pins, manifests, then namespaces.
    println!("demo: creating pods pod-a, pod-b, pod-c in network namespaces {tag}-*");
    let mut topology = Topology::new(&tag, &["pod-a", "pod-b", "pod-c"])?;
    for pod in &mut topology.pods {
        pod.serve(POD_PORT)?;
    }
    let manifests = TempDir::new(std::env::temp_dir().join(&tag))?;
    let pin_root = PinRoot(PathBuf::from(format!("/sys/fs/bpf/{tag}")));
    let mut cgroup = Cgroup::new(&tag)?;

    let pod_ips: Vec<Ipv4Addr> = topology.pods.iter().map(|p| p.ip).collect();
    let slice_ports = [("http", POD_PORT, "TCP"), ("dns", POD_PORT, "UDP")];
    testbed::write_atomic(&manifests.0, "service.yaml", &testbed::service_manifest("demo", "web", CLUSTER_IP, &PORTS))?;
    testbed::write_atomic(
        &manifests.0,
        "slice.yaml",
        &testbed::slice_manifest("demo", "web", "web-1", &pod_ips, &slice_ports),
    )?;
    println!(
        "demo: manifests in {} (Service demo/web {CLUSTER_IP}: 80/TCP, 53/UDP -> pods :{POD_PORT})",
        manifests.0.display()
    );

    let cfg = AgentConfig {
        source: SourceConfig::Manifests(manifests.0.clone()),
        datapath: DatapathConfig::new(pin_root.0.clone(), cgroup.path.clone()),
        // The demo's agent runs in this machine's own network namespace: socket path only,
        // never the host's interfaces.
        node: NodeSettings { name: "demo-node".into(), tc_links: TcLinks::Off, ..Default::default() },
        options: Default::default(),
        sync_period: Duration::from_secs(30),
        min_sync_period: Duration::ZERO,
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(agent::run(cfg, async {
        let _ = stop_rx.await;
    }));
    let result = async {
        let pins = pin_root.0.clone();
        tokio::task::spawn_blocking(move || {
            testbed::wait_programmed(&pins, "10.96.0.10:80/TCP", Some(3), Duration::from_secs(20))
        })
        .await??;
        println!(
            "demo: agent programmed the service; the client runs in cgroup {} and netns {}",
            cgroup.path.display(),
            topology.client.name
        );
        cgroup.enter()?;
        show_requests(&topology, "3 endpoints").await?;

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
        show_requests(&topology, "2 endpoints").await?;

        println!("\ndemo: what the datapath holds (`kpr services --pin-root {}`):", pin_root.0.display());
        print!("{}", crate::status::render(&pin_root.0)?);
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
    let _ = stop_tx.send(());
    agent.await.context("agent task")??;
    if result.is_ok() {
        println!("demo: done, cleaning up");
    }
    result
}

/// Send requests through the ClusterIP from the client namespace; print who answered.
async fn show_requests(topology: &Topology, label: &str) -> Result<()> {
    let tcp = SocketAddrV4::new(CLUSTER_IP, 80);
    let udp = SocketAddrV4::new(CLUSTER_IP, 53);
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

/// kpr's pins for this demo, removed on drop (detaching the programs).
struct PinRoot(PathBuf);

impl Drop for PinRoot {
    fn drop(&mut self) {
        if let Err(e) = bpf::cleanup(&self.0) {
            eprintln!("demo: failed to remove pins under {}: {e:#}", self.0.display());
        }
    }
}
