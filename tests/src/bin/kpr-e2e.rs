//! `kpr-e2e`: Kubernetes' e2e network suite against one Service proxy. Brings up the test
//! cluster of `kpr_tests::nodes` (control plane on the host, two kubelet nodes, each reachable
//! from the host for exec, logs and port-forward), deploys the proxy as a DaemonSet (kpr from
//! `deploy/`, or the pinned kube-proxy in iptables or nftables mode) and CoreDNS, runs `ginkgo`
//! with the suite, and leaves the reports and every log under `--out`. Everything it started is
//! stopped and removed on exit. Run it through `cargo xtask e2e`, which builds what it needs.
use std::{
    fs,
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    process::{Command, ExitCode},
    sync::atomic::{AtomicI32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use kpr_tests::{
    cluster::{Cluster, Relay, k8s_bin},
    nodes::{self, API_PORT, NODE_A, NODE_B, Node, PODS_A, PODS_B},
};

#[derive(Parser)]
#[command(about = "Run Kubernetes' e2e network suite against one Service proxy on a local cluster")]
struct Args {
    /// The Service proxy the nodes run.
    #[arg(long, value_parser = ["kpr", "kube-proxy-iptables", "kube-proxy-nftables"])]
    proxy: String,
    /// OCI archives the nodes import: the pod sandbox (kpr-testpod), agnhost, pause, the proxy's.
    #[arg(long = "image", required = true)]
    images: Vec<PathBuf>,
    /// The directory holding `e2e.test` and `ginkgo` (tools/e2e).
    #[arg(long)]
    e2e_bin: PathBuf,
    /// The agnhost tag the pinned suite asks for (CoreDNS runs from that image).
    #[arg(long)]
    agnhost_tag: String,
    /// Reports (report.json, junit.xml) and logs go here.
    #[arg(long)]
    out: PathBuf,
    /// Keep the cluster's data directory on exit.
    #[arg(long)]
    keep: bool,
    /// Arguments for ginkgo (--focus, --skip, --procs, ...).
    #[arg(last = true)]
    ginkgo: Vec<String>,
}

/// The running ginkgo's pid, for the signal thread (0: none).
static GINKGO: AtomicI32 = AtomicI32::new(0);

fn main() -> ExitCode {
    let args = Args::parse();
    stop_ginkgo_on_signal();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("kpr-e2e: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// SIGINT or SIGTERM end the suite (its process group), so that `run` returns and the cluster
/// is taken down by its destructors rather than left behind.
fn stop_ginkgo_on_signal() {
    let set = kpr_tests::block_stop_signals();
    std::thread::spawn(move || {
        loop {
            let mut sig = 0;
            // SAFETY: waiting on the set blocked above.
            unsafe { libc::sigwait(&set, &mut sig) };
            eprintln!("kpr-e2e: signal {sig}: stopping the suite, then the cluster");
            let pid = GINKGO.load(Ordering::SeqCst);
            if pid > 0 {
                // SAFETY: kill(2) of the process group of our own child.
                unsafe { libc::kill(-pid, libc::SIGTERM) };
            }
        }
    });
}

fn run(args: &Args) -> Result<bool> {
    let started = Instant::now();
    fs::create_dir_all(&args.out)?;
    // The `kubernetes` Service's endpoint must not be a loopback address (Endpoints reject it):
    // the API server advertises the host's address on its links to the nodes, relayed below.
    let advertise = format!("--advertise-address={}", nodes::HOST_LEG_IP);
    let mut cluster = Cluster::start_with("kpr-e2e", &[&advertise])?;
    cluster.keep = args.keep;
    cluster.start_controllers()?;
    let mut a = Node::new(&cluster, "node-a", NODE_A)?;
    let mut b = Node::new(&cluster, "node-b", NODE_B)?;
    nodes::link(&a, PODS_A, &b, PODS_B)?;
    a.expose_to_host(PODS_A)?;
    b.expose_to_host(PODS_B)?;
    for node in [&a, &b] {
        node.route_default_on_link()?;
    }
    let _api_for_pods = Relay::on_host(
        SocketAddrV4::new(nodes::HOST_LEG_IP, cluster.api_port),
        SocketAddrV4::new(Ipv4Addr::LOCALHOST, cluster.api_port),
    )?;
    a.boot(&cluster, PODS_A, &args.images)?;
    b.boot(&cluster, PODS_B, &args.images)?;
    let outcome = (|| -> Result<bool> {
        for node in [&mut a, &mut b] {
            node.wait_ready(&cluster, Duration::from_secs(300))?;
        }
        deploy_proxy(&cluster, &args.proxy)?;
        deploy_dns(&cluster, &args.agnhost_tag)?;
        println!("kpr-e2e: cluster with {} ready in {:.0?}; running the suite", args.proxy, started.elapsed());
        suite(&cluster, args)
    })();
    collect_logs(&cluster, &[&a, &b], &args.proxy, &args.out);
    if args.proxy == "kpr" {
        report_self_check(&args.out)?;
    }
    println!("kpr-e2e: {} done in {:.0?}; reports and logs in {}", args.proxy, started.elapsed(), args.out.display());
    outcome
}

fn deploy_file(file: &str) -> Result<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(file);
    fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// The proxy as a DaemonSet on every node, until each node's pod is ready. Both read
/// deploy/configmap.yaml's KubeProxyConfiguration, whose server is the nodes' relay.
fn deploy_proxy(cluster: &Cluster, proxy: &str) -> Result<()> {
    let configmap = deploy_file("deploy/configmap.yaml")?
        .replace("https://control-plane.example:6443", &format!("https://127.0.0.1:{API_PORT}"));
    let (manifests, daemonset) = match proxy.strip_prefix("kube-proxy-") {
        None => {
            // The datapath's self-check every 15 s while the suite churns Services: each run
            // compares the live programs with the model on a real cluster (report_self_check).
            let daemonset = deploy_file("deploy/daemonset.yaml")?;
            let config_arg = "        - --config=/var/lib/kpr/config.conf\n";
            anyhow::ensure!(daemonset.contains(config_arg), "deploy/daemonset.yaml has no --config line");
            let daemonset = daemonset.replace(config_arg, &format!("{config_arg}        - --verify-period=15s\n"));
            (vec![deploy_file("deploy/rbac.yaml")?, configmap, daemonset], "kpr")
        }
        Some(mode) => {
            let configmap = configmap
                .replace("  name: kpr\n", "  name: kube-proxy\n")
                .replace("kpr/kubeconfig.conf", "kube-proxy/kubeconfig.conf")
                .replace("mode: iptables", &format!("mode: {mode}"))
                // The table size is the machine's (the nodes share its kernel): leave it.
                .replace("    conntrack:\n", "    conntrack:\n      maxPerCore: 0\n");
            (vec![configmap, deploy_file("tests/e2e/kube-proxy.yaml")?], "kube-proxy")
        }
    };
    cluster.apply(&manifests.join("\n---\n"))?;
    cluster.kubectl(&["-n", "kube-system", "rollout", "status", "daemonset", daemonset, "--timeout=300s"])?;
    Ok(())
}

fn deploy_dns(cluster: &Cluster, agnhost_tag: &str) -> Result<()> {
    let manifest = deploy_file("tests/e2e/coredns.yaml")?.replace("AGNHOST_TAG", agnhost_tag);
    anyhow::ensure!(manifest.contains(&nodes::CLUSTER_DNS.to_string()), "coredns.yaml's clusterIP is not CLUSTER_DNS");
    cluster.apply(&manifest)?;
    cluster.kubectl(&["-n", "kube-system", "rollout", "status", "deployment", "coredns", "--timeout=300s"])?;
    Ok(())
}

/// ginkgo with the suite; whether every spec it ran passed.
fn suite(cluster: &Cluster, args: &Args) -> Result<bool> {
    let out = fs::canonicalize(&args.out)?;
    let mut cmd = Command::new(args.e2e_bin.join("ginkgo"));
    cmd.args(&args.ginkgo)
        .arg(format!("--output-dir={}", out.display()))
        .args(["--json-report=report.json", "--junit-report=junit.xml", "--no-color"])
        .arg(args.e2e_bin.join("e2e.test"))
        .arg("--")
        .arg(format!("--kubeconfig={}", cluster.admin_kubeconfig.display()))
        .arg(format!("--kubectl-path={}", k8s_bin("kubectl")?.display()))
        .args(["--provider=local", "--disable-log-dump", "--dump-logs-on-failure=false"])
        .arg(format!("--report-dir={}", out.display()))
        // Only the first ginkgo process counts the nodes; on the others a spec that needs two
        // (`SkipUnlessNodeCountIsAtLeast`) would skip itself unless told.
        .arg("--num-nodes=2")
        .env("KUBECONFIG", &cluster.admin_kubeconfig);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().context("failed to start ginkgo")?;
    GINKGO.store(child.id() as i32, Ordering::SeqCst);
    let status = child.wait()?;
    GINKGO.store(0, Ordering::SeqCst);
    if !out.join("report.json").is_file() {
        bail!("ginkgo ({status}) wrote no report");
    }
    Ok(status.success())
}

/// The self-check's runs and mismatches in kpr's logs (under `out/logs`), written to
/// `out/self-check.json` for `cargo xtask e2e`, which fails on a mismatch.
fn report_self_check(out: &Path) -> Result<()> {
    let (mut runs, mut mismatches) = (0, Vec::new());
    for entry in fs::read_dir(out.join("logs"))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if !(name.starts_with("kpr-") && name.ends_with(".log")) {
            continue;
        }
        for line in fs::read_to_string(&path)?.lines() {
            if line.contains("\"datapath self-check\"") {
                runs += 1;
            } else if line.contains("decides otherwise than the model") {
                mismatches.push(line.to_owned());
            }
        }
    }
    println!("kpr-e2e: the datapath self-check ran {runs} times; {} mismatches", mismatches.len());
    let report = serde_json::json!({ "runs": runs, "mismatches": mismatches });
    fs::write(out.join("self-check.json"), serde_json::to_vec_pretty(&report)?)?;
    Ok(())
}

/// The control plane's, the nodes' and the kube-system pods' logs, under `out/logs`.
fn collect_logs(cluster: &Cluster, nodes: &[&Node], proxy: &str, out: &Path) {
    let logs = out.join("logs");
    let _ = fs::create_dir_all(&logs);
    let copy = |from: &Path, name: &str| {
        if let Err(e) = fs::copy(from, logs.join(name)) {
            eprintln!("kpr-e2e: {}: {e}", from.display());
        }
    };
    for file in ["apiserver.log", "etcd.log", "controller-manager.log", "scheduler.log"] {
        copy(&cluster.dir.join(file), file);
    }
    for node in nodes {
        for file in ["node.log", "containerd.log"] {
            copy(&node.dir().join(file), &format!("{}-{file}", node.name));
        }
    }
    let pods = cluster.kubectl(&["get", "pods", "-A", "-o", "wide"]).unwrap_or_else(|e| format!("{e:#}"));
    let _ = fs::write(logs.join("pods.txt"), pods);
    let names = cluster
        .kubectl(&["get", "pods", "-n", "kube-system", "-o", "jsonpath={.items[*].metadata.name}"])
        .unwrap_or_default();
    for pod in names.split_whitespace() {
        let text = cluster
            .kubectl(&["logs", "-n", "kube-system", pod, "--all-containers"])
            .unwrap_or_else(|e| format!("{e:#}"));
        let _ = fs::write(logs.join(format!("{pod}.log")), text);
    }
    eprintln!("kpr-e2e: {proxy}: logs in {}", logs.display());
}
