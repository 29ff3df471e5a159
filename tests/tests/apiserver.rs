//! kpr against a real Kubernetes API server (etcd + kube-apiserver built from `tools/k8s`, on
//! 127.0.0.1, started by each test): Services get their ClusterIP from the API server, the test
//! writes EndpointSlices as the EndpointSlice controller would, and the real agent watches them
//! through `--kubeconfig`. Needs root; `cargo xtask test` runs it (and builds the control plane).
use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, ErrorKind, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream},
    time::Duration,
};

use kpr_tests::{Harness, POD_PORT, TIMEOUT, cluster::Cluster, sa};
use testbed::{tcp_ask, udp_ask};

const HTTP: (&str, u16, &str) = ("http", 80, "TCP");
const DNS: (&str, u16, &str) = ("dns", 53, "UDP");
/// Watches resume after a backoff; programming must happen well within this.
const RESUME: Duration = Duration::from_secs(60);

/// A control plane, and the harness (pods, cgroup, agent) with the agent on its kubeconfig.
/// The cluster is created first, so its processes stay out of the harness's cgroup.
struct Env {
    h: Harness,
    c: Cluster,
}

impl Env {
    fn new(tag: &str, pods: &[&str]) -> Self {
        Self::on(Cluster::start(tag).expect("control plane"), tag, pods)
    }

    fn on(c: Cluster, tag: &str, pods: &[&str]) -> Self {
        c.apply("apiVersion: v1\nkind: Namespace\nmetadata: {name: test}\n").unwrap();
        let mut h = Harness::new(tag, pods).expect("harness");
        h.kubeconfig = Some(c.admin_kubeconfig.clone());
        Self { h, c }
    }

    /// Create or update Service `name` (ClusterIP allocated by the API server); its ClusterIP.
    fn service(&self, name: &str, ports: &[(&str, u16, &str)]) -> Ipv4Addr {
        let ports: String = ports
            .iter()
            .map(|(n, p, proto)| format!("  - {{name: {n}, port: {p}, protocol: {proto}, targetPort: {POD_PORT}}}\n"))
            .collect();
        self.c
            .apply(&format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: test}}\nspec:\n  ports:\n{ports}"
            ))
            .unwrap();
        self.c.cluster_ip("test", name).unwrap()
    }

    /// The EndpointSlice of `service`, as the EndpointSlice controller writes it: ready pods `pods`.
    fn endpoints(&self, service: &str, ports: &[(&str, u16, &str)], pods: &[usize]) {
        let ips: Vec<std::net::IpAddr> = pods.iter().map(|&i| self.h.topology.pods[i].ip.into()).collect();
        let slice_ports: Vec<(&str, u16, &str)> = ports.iter().map(|(n, _, p)| (*n, POD_PORT, *p)).collect();
        self.c
            .apply(&testbed::slice_manifest("test", service, &format!("{service}-abc12"), &ips, &slice_ports))
            .unwrap();
    }

    fn wait(&self, address: &str, backends: Option<usize>) {
        self.h.wait_for(address, backends, RESUME).unwrap();
    }

    /// Who answers `n` new TCP connections to `ip:80`.
    fn tcp_spread(&self, ip: Ipv4Addr, n: usize) -> BTreeMap<String, usize> {
        self.h.client(move || {
            let mut seen = BTreeMap::new();
            for _ in 0..n {
                let (name, _) = tcp_ask(sa(ip, 80), TIMEOUT).expect("TCP through the ClusterIP");
                *seen.entry(name).or_insert(0) += 1;
            }
            seen
        })
    }

    fn open_connection(&self, ip: Ipv4Addr) -> (String, TcpStream) {
        self.h.client(move || {
            let conn = TcpStream::connect_timeout(&sa(ip, 80).into(), TIMEOUT).unwrap();
            conn.set_read_timeout(Some(TIMEOUT)).unwrap();
            let mut line = String::new();
            BufReader::new(&conn).read_line(&mut line).unwrap();
            (line.trim_end().to_owned(), conn)
        })
    }

    fn agent_log(&self) -> String {
        std::fs::read_to_string(self.h.log_path()).unwrap_or_default()
    }
}

fn assert_echoes(conn: &mut TcpStream, payload: &str) {
    conn.write_all(format!("{payload}\n").as_bytes()).unwrap();
    let mut line = String::new();
    BufReader::new(&*conn).read_line(&mut line).expect("echo over the established connection");
    assert_eq!(line.trim_end(), payload);
}

fn in_service_range(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    (a, b) == (10, 96) && ip != Ipv4Addr::new(10, 96, 0, 1)
}

#[test]
fn api_allocated_cluster_ip_reaches_the_pods() {
    let mut env = Env::new("ka-basic", &["pod-a", "pod-b", "pod-c"]);
    let ip = env.service("web", &[HTTP, DNS]);
    assert!(in_service_range(ip), "allocated {ip}");
    env.endpoints("web", &[HTTP, DNS], &[0, 1, 2]);
    env.h.start_agent().unwrap();
    env.wait(&format!("{ip}:80/TCP"), Some(3));
    env.wait(&format!("{ip}:53/UDP"), Some(3));
    // The API server's own `default/kubernetes` service (10.96.0.1) is listed too; with no
    // EndpointSlice controller here it has no slice, so it refuses connections.
    env.wait("10.96.0.1:443/TCP", Some(0));

    let pods: Vec<String> = (0..3).map(|i| env.h.pod_name(i)).collect();
    let (tcp, udp) =
        env.h.client(move || (tcp_ask(sa(ip, 80), TIMEOUT).unwrap(), udp_ask(sa(ip, 53), TIMEOUT).unwrap()));
    assert!(pods.contains(&tcp.0), "TCP answered by {}", tcp.0);
    assert_eq!(tcp.1, SocketAddr::from(sa(ip, 80)), "getpeername shows the allocated ClusterIP");
    assert!(pods.contains(&udp.0), "UDP answered by {}", udp.0);
    assert_eq!(udp.1, SocketAddr::from(sa(ip, 53)), "recvfrom shows the ClusterIP");
    assert_eq!(env.tcp_spread(ip, 60).len(), 3, "every pod answers");
    assert!(env.h.agent_running());
    assert!(env.agent_log().contains("initial sync done"), "{}", env.agent_log());
}

#[test]
fn scale_change_port_and_delete_through_the_api() {
    let mut env = Env::new("ka-change", &["pod-a", "pod-b", "pod-c"]);
    let ip = env.service("web", &[HTTP]);
    env.endpoints("web", &[HTTP], &[0, 1, 2]);
    env.h.start_agent().unwrap();
    let addr = format!("{ip}:80/TCP");
    env.wait(&addr, Some(3));
    let (first, mut conn) = env.open_connection(ip);

    // Scale down to one pod that is not the one of the open connection.
    let keep = (0..3).find(|&i| env.h.pod_name(i) != first).unwrap();
    env.endpoints("web", &[HTTP], &[keep]);
    env.wait(&addr, Some(1));
    let seen = env.tcp_spread(ip, 20);
    assert_eq!(seen.keys().collect::<Vec<_>>(), [&env.h.pod_name(keep)], "scaled down: {seen:?}");
    assert_echoes(&mut conn, "after-scale-down");

    // Scale up again.
    env.endpoints("web", &[HTTP], &[0, 1, 2]);
    env.wait(&addr, Some(3));
    assert_eq!(env.tcp_spread(ip, 60).len(), 3);

    // Change the service port: 80 → 8000. The ClusterIP stays; the old port is gone.
    env.c
        .apply(&format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: test}}\nspec:\n  ports:\n  - {{name: http, port: 8000, protocol: TCP, targetPort: {POD_PORT}}}\n"
        ))
        .unwrap();
    assert_eq!(env.c.cluster_ip("test", "web").unwrap(), ip);
    env.wait(&format!("{ip}:8000/TCP"), Some(3));
    env.wait(&addr, None);
    let (name, peer) = env.h.client(move || tcp_ask(sa(ip, 8000), TIMEOUT).unwrap());
    assert!(name.starts_with("pod-"), "{name}");
    assert_eq!(peer, SocketAddr::from(sa(ip, 8000)));
    let err = env.h.client(move || TcpStream::connect_timeout(&sa(ip, 80).into(), TIMEOUT).map(drop)).unwrap_err();
    // The ClusterIP's old port is refused (kpr refuses the service range by default).
    assert_eq!(err.raw_os_error(), Some(libc::ECONNREFUSED), "old port is no longer translated: {err}");

    // Delete the service.
    env.c.kubectl(&["delete", "service", "-n", "test", "web"]).unwrap();
    env.wait(&format!("{ip}:8000/TCP"), None);
    // An unallocated address of the service range is dropped (EPERM on the socket path).
    let err = env.h.client(move || TcpStream::connect_timeout(&sa(ip, 8000).into(), TIMEOUT).map(drop)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    assert_echoes(&mut conn, "after-delete");
}

#[test]
fn api_server_and_etcd_restart_keeps_serving_and_resumes_the_watch() {
    let mut env = Env::new("ka-restart", &["pod-a", "pod-b", "pod-c"]);
    let ip = env.service("web", &[HTTP]);
    env.endpoints("web", &[HTTP], &[0, 1, 2]);
    env.h.start_agent().unwrap();
    let addr = format!("{ip}:80/TCP");
    env.wait(&addr, Some(3));
    let (_, mut conn) = env.open_connection(ip);

    env.c.stop();
    // kpr keeps serving the last known state while the API server is gone.
    std::thread::sleep(Duration::from_secs(3));
    assert!(env.h.agent_running(), "the agent survives the outage:\n{}", env.agent_log());
    assert_eq!(env.tcp_spread(ip, 60).len(), 3, "new connections still balance during the outage");
    assert_echoes(&mut conn, "during-outage");
    env.h.wait(&addr, Some(3)).unwrap();

    env.c.restart().unwrap();
    // Changes made as soon as the API server is back, while the agent's watch is still
    // backing off: scale down, and a new service.
    env.endpoints("web", &[HTTP], &[1]);
    let ip2 = env.service("second", &[HTTP]);
    env.endpoints("second", &[HTTP], &[2]);
    env.wait(&addr, Some(1));
    env.wait(&format!("{ip2}:80/TCP"), Some(1));
    let seen = env.tcp_spread(ip, 20);
    assert_eq!(seen.keys().collect::<Vec<_>>(), [&env.h.pod_name(1)], "{seen:?}");
    let (name, _) = env.h.client(move || tcp_ask(sa(ip2, 80), TIMEOUT).unwrap());
    assert_eq!(name, env.h.pod_name(2));
    assert_echoes(&mut conn, "after-restart");
    assert!(env.h.agent_running());
    assert!(env.agent_log().contains("watch failed, retrying"), "the outage was noticed:\n{}", env.agent_log());
    // Changes made before the agent's watch came back usually expire its resourceVersion on the
    // fresh API server (410 Gone, "too old resource version"): the watcher then relists, and
    // the relist replaces the state without wiping the datapath (traffic kept flowing above).
    let log = env.agent_log();
    if let Some(expired) = log.find("too old resource version") {
        assert!(log[expired..].contains("listed kind=Service"), "410 Gone led to a relist:\n{log}");
    }
}

#[test]
fn agent_started_while_the_api_server_is_down_waits_and_serves_nothing_stale() {
    let mut env = Env::new("ka-down", &["pod-a", "pod-b"]);
    let ip = env.service("web", &[HTTP]);
    env.endpoints("web", &[HTTP], &[0, 1]);
    let gone = env.service("gone", &[HTTP]);
    env.endpoints("gone", &[HTTP], &[0]);
    env.h.start_agent().unwrap();
    env.wait(&format!("{ip}:80/TCP"), Some(2));
    env.wait(&format!("{gone}:80/TCP"), Some(1));

    // The agent goes away; meanwhile the cluster changes, then the API server goes down.
    env.h.kill_agent().unwrap();
    env.c.kubectl(&["delete", "service", "-n", "test", "gone"]).unwrap();
    env.endpoints("web", &[HTTP], &[1]);
    env.c.stop();

    // A new agent while the API server is down: it stays up, retries, and changes nothing
    // (like kube-proxy's rules, the pinned state stays until a full list has arrived).
    let before = env.agent_log().len();
    env.h.start_agent().unwrap();
    std::thread::sleep(Duration::from_secs(5));
    assert!(env.h.agent_running(), "the agent waits for the API server:\n{}", env.agent_log());
    env.h.wait(&format!("{ip}:80/TCP"), Some(2)).unwrap();
    env.h.wait(&format!("{gone}:80/TCP"), Some(1)).unwrap();
    let log = env.agent_log()[before..].to_owned();
    assert!(log.contains("recovered_service_ports="), "the new agent took over the pins:\n{log}");
    assert!(!log.contains("initial sync done"), "nothing synced without the API:\n{log}");

    // The API server comes back: the agent lists and drops what is stale.
    env.c.restart().unwrap();
    env.wait(&format!("{gone}:80/TCP"), None);
    env.wait(&format!("{ip}:80/TCP"), Some(1));
    let seen = env.tcp_spread(ip, 20);
    assert_eq!(seen.keys().collect::<Vec<_>>(), [&env.h.pod_name(1)], "{seen:?}");
    let err = env.h.client(move || TcpStream::connect_timeout(&sa(gone, 80).into(), TIMEOUT).map(drop)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "deleted service's address is dropped: {err}");
}

#[test]
fn agent_on_fresh_pins_while_the_api_server_is_down_programs_nothing_until_it_is_up() {
    let mut env = Env::new("ka-fresh", &["pod-a"]);
    let ip = env.service("web", &[HTTP]);
    env.endpoints("web", &[HTTP], &[0]);
    env.c.stop();
    env.h.start_agent().unwrap();
    std::thread::sleep(Duration::from_secs(5));
    assert!(env.h.agent_running(), "the agent waits for the API server:\n{}", env.agent_log());
    let programmed = kpr::datapath::bpf::BpfMaps::open_pinned(&env.h.pin_root)
        .and_then(|m| kpr::datapath::Maps::services(&m))
        .map(|s| s.len());
    assert_eq!(programmed.unwrap(), 0, "nothing programmed before the lists arrive");
    let err = env.h.client(move || TcpStream::connect_timeout(&sa(ip, 80).into(), TIMEOUT).map(drop)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");

    env.c.restart().unwrap();
    env.wait(&format!("{ip}:80/TCP"), Some(1));
    let (name, _) = env.h.client(move || tcp_ask(sa(ip, 80), TIMEOUT).unwrap());
    assert_eq!(name, "pod-a");
}

#[test]
fn rbac_the_agent_works_with_only_the_service_account_of_deploy_rbac_yaml() {
    let mut env = Env::new("ka-rbac", &["pod-a", "pod-b"]);
    let rbac = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/rbac.yaml")).unwrap();
    env.c.apply(&rbac).unwrap();
    let token = env.c.kubectl(&["create", "token", "kpr", "-n", "kube-system", "--duration=1h"]).unwrap();
    let kubeconfig = env.c.kubeconfig_for_token("kpr-sa.kubeconfig", token.trim()).unwrap();

    let can = |args: &[&str]| -> bool {
        let mut full = vec!["auth", "can-i"];
        full.extend_from_slice(args);
        // `can-i` exits 1 with "no".
        env.c.kubectl_as(&kubeconfig, &full, None).map(|o| o.trim() == "yes").unwrap_or(false)
    };
    assert!(can(&["watch", "services", "--all-namespaces"]));
    assert!(can(&["list", "endpointslices.discovery.k8s.io", "--all-namespaces"]));
    assert!(can(&["get", "nodes"]));
    assert!(can(&["create", "events.events.k8s.io", "-n", "test"]), "events, as kube-proxy writes them");
    assert!(!can(&["create", "services", "-n", "test"]), "no writes");
    assert!(!can(&["update", "endpointslices.discovery.k8s.io", "-n", "test"]), "no writes");
    assert!(!can(&["list", "secrets", "--all-namespaces"]), "no secrets");
    assert!(can(&["watch", "pods", "--all-namespaces"]), "pods: who opts out of the socket path");
    assert!(can(&["watch", "namespaces"]), "namespaces: the same");
    assert!(!can(&["update", "pods", "-n", "test"]), "no writes");
    let whoami =
        env.c.kubectl_as(&kubeconfig, &["auth", "whoami", "-o", "jsonpath={.status.userInfo.username}"], None).unwrap();
    assert_eq!(whoami, "system:serviceaccount:kube-system:kpr");

    let ip = env.service("web", &[HTTP]);
    env.endpoints("web", &[HTTP], &[0, 1]);
    env.h.kubeconfig = Some(kubeconfig);
    env.h.start_agent().unwrap();
    env.wait(&format!("{ip}:80/TCP"), Some(2));
    assert_eq!(env.tcp_spread(ip, 40).len(), 2);
    env.endpoints("web", &[HTTP], &[1]);
    env.wait(&format!("{ip}:80/TCP"), Some(1));

    // A newer Service claims web's externalIP: kpr keeps it for web and tells the newcomer's
    // owner with an Event.
    let claim = |service: &str| {
        let patch = r#"{"spec":{"externalIPs":["192.0.2.50"]}}"#;
        env.c.kubectl(&["patch", "service", service, "-n", "test", "--type=merge", "-p", patch]).unwrap();
    };
    claim("web");
    env.wait("192.0.2.50:80/TCP", Some(1));
    std::thread::sleep(Duration::from_millis(1100)); // creationTimestamp has whole seconds
    env.service("late", &[HTTP]);
    claim("late");
    let deadline = std::time::Instant::now() + RESUME;
    let event = loop {
        let out = env
            .c
            .kubectl(&[
                "get",
                "events.events.k8s.io",
                "-n",
                "test",
                "-o",
                "jsonpath={range .items[*]}{.reason} {.regarding.name} {.note}{\"\\n\"}{end}",
            ])
            .unwrap_or_default();
        if let Some(line) = out.lines().find(|l| l.starts_with("AddressInUse late ")) {
            break line.to_owned();
        }
        let created = env
            .c
            .kubectl(&[
                "get",
                "services",
                "-n",
                "test",
                "-o",
                "custom-columns=NAME:.metadata.name,CREATED:.metadata.creationTimestamp",
            ])
            .unwrap_or_default();
        assert!(
            std::time::Instant::now() < deadline,
            "no event for the conflict; events:\n{out}\nservices:\n{created}\nagent:\n{}",
            env.agent_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(event.contains("test/web"), "{event}");
    let log = env.agent_log();
    assert!(!log.to_lowercase().contains("forbidden"), "the agent needed more than deploy/rbac.yaml grants:\n{log}");
}

/// A Pod of this node annotated `kpr.io/socket-lb: "off"`, from the API: once kubelet has
/// made its cgroup (here, after the Pod exists, as on a node), its cgroup is in the socket
/// path's `KPR_SOCKET_SKIP`; annotated `"on"`, no longer.
#[test]
fn a_pod_from_the_api_opts_out_of_the_socket_path_once_its_cgroup_exists() {
    use std::os::unix::fs::MetadataExt as _;
    let mut env = Env::new("ka-optout", &["pod-a"]);
    let pod = |setting: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: app, namespace: test, annotations: {{kpr.io/socket-lb: '{setting}'}}}}\n\
             spec: {{nodeName: test-node, automountServiceAccountToken: false, containers: [{{name: app, image: app}}]}}\n"
        )
    };
    env.c.apply("apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: default, namespace: test}\n").unwrap();
    env.c.apply(&pod("off")).unwrap();
    let uid = env.c.kubectl(&["get", "pod", "app", "-n", "test", "-o", "jsonpath={.metadata.uid}"]).unwrap();
    // The harness's agent covers no link (this machine's namespace), so its hooks do not heed
    // the map (the multinode test shows the effect); what is checked here is the API's Pod
    // reaching it.
    env.h.start_agent().unwrap();
    let skipped = |pins: &std::path::Path| -> Vec<u64> {
        kpr::datapath::bpf::read_socket_skip(pins).map(|m| m.into_keys().collect()).unwrap_or_default()
    };
    std::thread::sleep(Duration::from_secs(1));
    assert!(skipped(&env.h.pin_root).is_empty(), "no cgroup yet: nothing to leave alone");
    let cgroup =
        testbed::Cgroup::new(&format!("{}/kubepods-besteffort-pod{}.slice", env.h.name, uid.trim().replace('-', "_")))
            .unwrap();
    let id = std::fs::metadata(&cgroup.path).unwrap().ino();
    let deadline = std::time::Instant::now() + RESUME;
    while !skipped(&env.h.pin_root).contains(&id) {
        assert!(std::time::Instant::now() < deadline, "the pod's cgroup was never left alone:\n{}", env.agent_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    env.c.apply(&pod("on")).unwrap();
    let deadline = std::time::Instant::now() + RESUME;
    while skipped(&env.h.pin_root).contains(&id) {
        assert!(std::time::Instant::now() < deadline, "annotated \"on\", still left alone");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn services_without_endpoints_from_the_api_refuse_connections() {
    let mut env = Env::new("ka-refuse", &["pod-a"]);
    let ip = env.service("web", &[HTTP]);
    env.h.start_agent().unwrap();
    env.wait(&format!("{ip}:80/TCP"), Some(0));
    let err = env.h.client(move || TcpStream::connect_timeout(&sa(ip, 80).into(), TIMEOUT).map(drop)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused);
}

/// `kpr diff` against the API computes what the agent programs, the refused service range
/// included: the ClusterIP lies in the API server's ServiceCIDR, so both sides hold its
/// any-port entry, and diff finds them in sync.
#[test]
fn kpr_diff_from_the_api_agrees_with_the_agent_on_the_refused_service_range() {
    let mut env = Env::new("ka-diff", &["pod-a"]);
    let ip = env.service("web", &[HTTP]);
    env.endpoints("web", &[HTTP], &[0]);
    env.h.start_agent().unwrap();
    env.wait(&format!("{ip}:80/TCP"), Some(1));
    env.wait(&format!("{ip}:0/any"), Some(0));
    let out = std::process::Command::new(kpr_tests::kpr_bin())
        .args(["diff", "--kubeconfig"])
        .arg(env.h.kubeconfig.as_ref().unwrap())
        .arg("--pin-root")
        .arg(&env.h.pin_root)
        .args(["--node-name", "test-node", "--interfaces", "none", "--wait", "20s"])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "in sync:\n{stdout}\n{stderr}");
}

/// deploy/'s manifests pass the real API server's validation and admission (strict field
/// validation, the system-node-critical priority class), in the order the README applies them.
#[test]
fn deploy_manifests_are_accepted_by_the_api_server() {
    let c = Cluster::start("ka-deploy").expect("control plane");
    for file in ["rbac.yaml", "configmap.yaml", "daemonset.yaml"] {
        let path = format!("{}/../deploy/{file}", env!("CARGO_MANIFEST_DIR"));
        let out = c.kubectl(&["apply", "--validate=strict", "-f", &path]).unwrap_or_else(|e| panic!("{file}: {e:#}"));
        assert!(out.contains("created"), "{file}: {out}");
    }
    let get = |what: &str, path: &str| {
        c.kubectl(&["get", what, "-n", "kube-system", "-o", &format!("jsonpath={path}")]).unwrap()
    };
    assert_eq!(get("daemonset/kpr", "{.spec.template.spec.priorityClassName}"), "system-node-critical");
    assert_eq!(get("daemonset/kpr", "{.spec.template.spec.hostNetwork}"), "true");
    assert_eq!(get("daemonset/kpr", "{.spec.template.spec.serviceAccountName}"), "kpr");
    assert_eq!(get("daemonset/kpr", "{.spec.updateStrategy.rollingUpdate.maxUnavailable}"), "1");
    // Ready once synced (kube-proxy's /healthz is 200 while starting); both probes on the
    // loopback metrics server, where no pod can hold connections.
    let probe = |which: &str, field: &str| {
        get("daemonset/kpr", &format!("{{.spec.template.spec.containers[0].{which}.httpGet.{field}}}"))
    };
    assert_eq!((probe("readinessProbe", "path"), probe("readinessProbe", "port")), ("/readyz".into(), "10249".into()));
    assert_eq!((probe("livenessProbe", "path"), probe("livenessProbe", "port")), ("/livez".into(), "10249".into()));
    assert!(get("configmap/kpr", "{.data.config\\.conf}").contains("kind: KubeProxyConfiguration"));
}

/// A dual-stack Service as the API server allocates it (RequireDualStack on a dual-stack
/// service range), with an EndpointSlice per family as the EndpointSlice controller writes
/// them: both ClusterIPs are programmed, each with its family's endpoints, and one client
/// reaches it over both families. The refused service range covers the IPv6 range too: an
/// unknown port of the IPv6 ClusterIP is rejected, an unallocated IPv6 address dropped.
#[test]
fn a_dual_stack_service_from_the_api_is_served_over_both_families() {
    let c = Cluster::start_with("ka-dual", &["--service-cluster-ip-range=10.96.0.0/16,fd00:96::/108"])
        .expect("control plane");
    let mut env = Env::on(c, "ka-dual", &["pod-a", "pod-b", "pod-c"]);
    env.c
        .apply(&format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: test}}\nspec:\n  ipFamilyPolicy: RequireDualStack\n  ports:\n  - {{name: http, port: 80, protocol: TCP, targetPort: {POD_PORT}}}\n"
        ))
        .unwrap();
    let ips = env.c.kubectl(&["get", "service", "-n", "test", "web", "-o", "jsonpath={.spec.clusterIPs[*]}"]).unwrap();
    let ips: Vec<IpAddr> = ips.split_whitespace().map(|ip| ip.parse().unwrap()).collect();
    let (IpAddr::V4(v4), IpAddr::V6(v6)) = (ips[0], ips[1]) else { panic!("allocated {ips:?}") };
    assert!(in_service_range(v4) && v6.segments()[..2] == [0xfd00, 0x96], "allocated {ips:?}");
    let slice_ports = [("http", POD_PORT, "TCP")];
    let v4_pods: Vec<IpAddr> = env.h.topology.pods.iter().map(|p| p.ip.into()).collect();
    let v6_pods: Vec<IpAddr> = env.h.topology.pods.iter().map(|p| p.ip6.into()).collect();
    env.c.apply(&testbed::slice_manifest("test", "web", "web-ipv4", &v4_pods, &slice_ports)).unwrap();
    env.c.apply(&testbed::slice_manifest("test", "web", "web-ipv6", &v6_pods, &slice_ports)).unwrap();
    env.h.start_agent().unwrap();
    env.wait(&format!("{v4}:80/TCP"), Some(3));
    env.wait(&format!("[{v6}]:80/TCP"), Some(3));

    let pods: Vec<String> = (0..3).map(|i| env.h.pod_name(i)).collect();
    let unallocated = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0xf, 0xfff0);
    assert_ne!(unallocated, v6);
    let (over_v4, over_v6, unknown_port, unallocated) = env.h.client(move || {
        let over = |addr: SocketAddr| (0..30).map(|_| tcp_ask(addr, TIMEOUT).unwrap()).collect::<Vec<_>>();
        // The service range comes from the ServiceCIDR watch, apart from the Services: it may
        // reach the datapath a sync after them. Asked until the expected error, for a while.
        let refused = |addr: SocketAddr, expected: ErrorKind| {
            let deadline = std::time::Instant::now() + testbed::slow(Duration::from_secs(10));
            loop {
                let kind = TcpStream::connect_timeout(&addr, TIMEOUT).map(|_| ()).unwrap_err().kind();
                if kind == expected || std::time::Instant::now() > deadline {
                    return kind;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        };
        (
            over(SocketAddr::new(v4.into(), 80)),
            over(SocketAddr::new(v6.into(), 80)),
            refused(SocketAddr::new(v6.into(), 81), ErrorKind::ConnectionRefused),
            refused(SocketAddr::new(unallocated.into(), 80), ErrorKind::PermissionDenied),
        )
    });
    for (answers, ip) in [(over_v4, IpAddr::from(v4)), (over_v6, IpAddr::from(v6))] {
        let names: std::collections::BTreeSet<&String> = answers.iter().map(|(name, _)| name).collect();
        assert_eq!(names.len(), 3, "every pod answers over {ip}: {names:?}");
        assert!(names.iter().all(|n| pods.contains(n)), "{names:?}");
        assert!(answers.iter().all(|(_, peer)| *peer == SocketAddr::new(ip, 80)), "getpeername shows {ip}");
    }
    assert_eq!(unknown_port, ErrorKind::ConnectionRefused, "an unknown port of the IPv6 ClusterIP");
    assert_eq!(unallocated, ErrorKind::PermissionDenied, "an unallocated IPv6 address of the range");
}
