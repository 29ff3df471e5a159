//! kpr as users run it: the DaemonSet, ConfigMap and RBAC of `deploy/` applied to a real
//! cluster (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) with two real
//! kubelets, each with its own containerd and runc (`kpr_tests::nodes`), and no kube-proxy.
//! The DaemonSet's pods run the image `cargo xtask image` builds; the test pods run
//! `kpr-testpod` (kpr-probe); the EndpointSlices are the controller-manager's, from the pods'
//! readiness. Pods on each node reach a ClusterIP, a NodePort (on either node) and a UDP
//! (DNS-style) Service with endpoints on both nodes; a rolling update of the DaemonSet to a new
//! image keeps established connections and new ones keep working.
//!
//! Needs root, a hybrid cgroup host and what `cargo xtask test` provides: `KPR_K8S_BIN` (the
//! kubelet and control plane), `KPR_IMAGE`, `KPR_IMAGE_NEXT` and `KPR_TESTPOD_IMAGE`.
use std::{
    collections::BTreeSet,
    io::{BufRead as _, BufReader, Write as _},
    net::SocketAddrV4,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use kpr_tests::{
    cluster::Cluster,
    nodes::{self, API_PORT, NODE_A, NODE_B, Node, PODS_A, PODS_B, PodProcess},
    probe::{Kind, Outcome},
};

const SERVERS: [&str; 2] = ["server-a", "server-b"];
const CLIENTS: [&str; 2] = ["client-a", "client-b"];

fn image_archive(var: &str) -> Result<PathBuf> {
    let layout =
        std::env::var(var).with_context(|| format!("{var} is not set: run the tests with `cargo xtask test`"))?;
    let archive = PathBuf::from(format!("{layout}.oci.tar"));
    anyhow::ensure!(archive.is_file(), "{} is missing", archive.display());
    Ok(archive)
}

fn deploy(file: &str) -> String {
    std::fs::read_to_string(format!("{}/../deploy/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

fn probe_exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_kpr-probe"))
}

/// A test pod on `node` running `kpr-probe <args>`, ready when it runs.
fn pod(name: &str, node: &str, app: &str, args: &[&str]) -> String {
    let command: Vec<String> =
        std::iter::once("/kpr-probe").chain(args.iter().copied()).map(|a| format!("\"{a}\"")).collect();
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: default\n  labels:\n    app: {app}\n\
         spec:\n  nodeName: {node}\n  terminationGracePeriodSeconds: 1\n  containers:\n  - name: main\n    \
         image: kpr-testpod:latest\n    imagePullPolicy: Never\n    command: [{}]\n",
        command.join(", ")
    )
}

const SERVICES: &str = "apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
spec:
  type: NodePort
  selector:
    app: server
  ports:
  - name: http
    port: 80
    targetPort: 8080
    protocol: TCP
---
apiVersion: v1
kind: Service
metadata:
  name: dns
  namespace: default
spec:
  selector:
    app: server
  ports:
  - name: dns
    port: 53
    targetPort: 5353
    protocol: UDP
";

/// Ask `addr` from inside `client` (its network namespace and cgroup) until every server
/// answered and nothing failed in one round, or `timeout`.
fn answered_by_all(client: &PodProcess, kind: Kind, addr: SocketAddrV4, timeout: Duration) -> Result<Outcome> {
    let deadline = Instant::now() + timeout;
    loop {
        let out = client
            .command(probe_exe())?
            .args([kind.as_str(), &addr.to_string(), "30", "2000"])
            .stdin(Stdio::null())
            .output()
            .context("kpr-probe")?;
        let outcome = Outcome::from_json(&String::from_utf8_lossy(&out.stdout))?;
        let all: BTreeSet<String> = SERVERS.iter().map(|s| (*s).to_owned()).collect();
        if outcome.backends() == all && outcome.errors.is_empty() {
            return Ok(outcome);
        }
        if Instant::now() > deadline {
            bail!("{} {addr} from pid {}: {outcome:?} (wanted answers from {all:?} only)", kind.as_str(), client.pid);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// One TCP connection held by `kpr-probe hold` inside a pod.
struct Held {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    backend: String,
}

impl Held {
    fn open(client: &PodProcess, addr: SocketAddrV4) -> Result<Self> {
        let mut child = client
            .command(probe_exe())?
            .args(["hold", &addr.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut backend = String::new();
        stdout.read_line(&mut backend)?;
        let backend = backend.trim().to_owned();
        anyhow::ensure!(SERVERS.contains(&backend.as_str()), "held connection to {addr} greeted with {backend:?}");
        Ok(Self { child, stdin, stdout, backend })
    }

    /// Send `word` on the connection; what came back (`echo <word>` when it still works).
    fn exchange(&mut self, word: &str) -> Result<String> {
        writeln!(self.stdin, "{word}")?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        Ok(line.trim().to_owned())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kube-system/kpr`'s pods: (node, pod UID, image, ready).
fn kpr_pods(cluster: &Cluster) -> Result<Vec<(String, String, String, String)>> {
    let out = cluster.kubectl(&[
        "get",
        "pods",
        "-n",
        "kube-system",
        "-l",
        "app.kubernetes.io/name=kpr",
        "-o",
        "jsonpath={range .items[*]}{.spec.nodeName} {.metadata.uid} {.spec.containers[0].image} \
         {.status.containerStatuses[0].ready}{\"\\n\"}{end}",
    ])?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 4).then(|| (f[0].to_owned(), f[1].to_owned(), f[2].to_owned(), f[3].to_owned()))
        })
        .collect())
}

fn rollout(cluster: &Cluster) -> Result<()> {
    cluster
        .kubectl(&["rollout", "status", "-n", "kube-system", "daemonset/kpr", "--timeout=240s"])
        .map(drop)
        .with_context(|| format!("kpr's DaemonSet did not roll out; pods: {:?}", kpr_pods(cluster)))
}

#[test]
fn daemonset_on_two_kubelets_serves_services_and_keeps_connections_through_a_rolling_update() -> Result<()> {
    let images = [image_archive("KPR_TESTPOD_IMAGE")?, image_archive("KPR_IMAGE")?, image_archive("KPR_IMAGE_NEXT")?];
    let mut cluster = Cluster::start("kpr-ds")?;
    cluster.start_controllers()?;
    let mut a = Node::new(&cluster, "node-a", NODE_A)?;
    let mut b = Node::new(&cluster, "node-b", NODE_B)?;
    nodes::link(&a, PODS_A, &b, PODS_B)?;
    a.boot(&cluster, PODS_A, &images)?;
    b.boot(&cluster, PODS_B, &images)?;
    for node in [&mut a, &mut b] {
        node.wait_ready(&cluster, Duration::from_secs(120))?;
    }

    // deploy/ as a platform engineer applies it: the ConfigMap's server edited to the
    // nodes' address of the API server.
    let configmap = deploy("configmap.yaml")
        .replace("https://control-plane.example:6443", &format!("https://127.0.0.1:{API_PORT}"));
    for manifest in [deploy("rbac.yaml"), configmap, deploy("daemonset.yaml")] {
        cluster.apply(&manifest)?;
    }
    rollout(&cluster).map_err(|e| e.context(format!("{}\n{}", a.logs(), b.logs())))?;
    let first = kpr_pods(&cluster)?;
    eprintln!("kpr's pods (node, uid, image, ready): {first:?}");
    let on_nodes: BTreeSet<&str> = first.iter().map(|p| p.0.as_str()).collect();
    assert_eq!(on_nodes, BTreeSet::from(["node-a", "node-b"]), "one kpr pod per node: {first:?}");
    assert!(first.iter().all(|p| p.2 == "kpr:latest" && p.3 == "true"), "{first:?}");

    // Servers and clients on both nodes, and the Services.
    let mut manifests = Vec::new();
    for (server, node) in SERVERS.iter().zip(["node-a", "node-b"]) {
        manifests.push(pod(server, node, "server", &["serve", server, "8080", "5353"]));
    }
    for (client, node) in CLIENTS.iter().zip(["node-a", "node-b"]) {
        manifests.push(pod(client, node, "client", &["pause", client]));
    }
    manifests.push(SERVICES.to_owned());
    cluster.apply(&manifests.join("\n---\n"))?;
    cluster.kubectl(&["wait", "-n", "default", "--for=condition=Ready", "pod", "--all", "--timeout=120s"])?;

    let web = SocketAddrV4::new(cluster.cluster_ip("default", "web")?, 80);
    let dns = SocketAddrV4::new(cluster.cluster_ip("default", "dns")?, 53);
    let node_port: u16 = cluster
        .kubectl(&["get", "service", "-n", "default", "web", "-o", "jsonpath={.spec.ports[0].nodePort}"])?
        .trim()
        .parse()?;
    let clients = CLIENTS.map(|c| PodProcess::find(c, Duration::from_secs(30)));
    let [client_a, client_b] = clients;
    let (client_a, client_b) = (client_a?, client_b?);

    let check_all = |when: &str| -> Result<()> {
        for (name, client) in [("client-a", &client_a), ("client-b", &client_b)] {
            for (kind, addr) in [
                (Kind::Tcp, web),
                (Kind::Udp, dns),
                (Kind::Tcp, SocketAddrV4::new(NODE_A, node_port)),
                (Kind::Tcp, SocketAddrV4::new(NODE_B, node_port)),
            ] {
                let outcome = answered_by_all(client, kind, addr, Duration::from_secs(60))
                    .with_context(|| format!("{when}: {name} → {} {addr}", kind.as_str()))?;
                eprintln!("{when}: {name} → {} {addr}: {:?}", kind.as_str(), outcome.answers);
            }
        }
        Ok(())
    };
    check_all("after the DaemonSet's first rollout")?;

    // Connections established before the update: a ClusterIP one (socket path) and NodePort
    // ones to the other node (per-packet path there: DNAT, masquerade, conntrack).
    let mut held = vec![
        Held::open(&client_a, web)?,
        Held::open(&client_a, SocketAddrV4::new(NODE_B, node_port))?,
        Held::open(&client_b, SocketAddrV4::new(NODE_A, node_port))?,
    ];
    for h in &mut held {
        assert_eq!(h.exchange("before")?, "echo before", "connection to {}", h.backend);
    }

    cluster.kubectl(&["set", "image", "-n", "kube-system", "daemonset/kpr", "kpr=kpr:next"])?;
    rollout(&cluster)?;
    // `rollout status` returns once the new pods are available; an old pod's object goes a
    // moment later, when its kubelet has seen its container stop.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut second = kpr_pods(&cluster)?;
    while second.len() > 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        second = kpr_pods(&cluster)?;
    }
    eprintln!("kpr's pods after the rolling update: {second:?}");
    assert_eq!(second.len(), 2, "{second:?}");
    for pod in &second {
        assert_eq!((pod.2.as_str(), pod.3.as_str()), ("kpr:next", "true"), "{second:?}");
        assert!(first.iter().all(|old| old.1 != pod.1), "pod {} was not replaced: {second:?}", pod.1);
    }

    for h in &mut held {
        assert_eq!(h.exchange("after")?, "echo after", "connection to {} after the rolling update", h.backend);
        eprintln!("a connection to {} established before the rolling update still carries data", h.backend);
    }
    check_all("after the rolling update")?;
    Ok(())
}
