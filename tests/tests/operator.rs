//! kube-proxy's operator surface, end to end on the real agent: the metrics server
//! (`/metrics`, `/proxyMode`, `/configz`) and the healthz server (`/healthz`, `/livez`), their
//! content changing as Services, the Node and the datapath change, and bind failures.
//! Needs root; run one at a time (`cargo xtask test` does).
use std::{
    net::{Ipv4Addr, TcpListener},
    process::Command,
    time::{Duration, Instant},
};

use kpr_tests::{Harness, TIMEOUT, http_get, sa};
use testbed::tcp_ask;

const IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const OTHER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const HTTP: (&str, u16, &str) = ("http", 80, "TCP");

/// The value of the sample `name` (with its labels, as exposed) in `/metrics`.
fn metric(h: &Harness, sample: &str) -> f64 {
    let (status, text) = http_get(h.metrics_addr, "/metrics").expect("/metrics answers");
    assert_eq!(status, 200, "{text}");
    let line = text.lines().find(|l| l.rsplit_once(' ').is_some_and(|(name, _)| name == sample));
    let line = line.unwrap_or_else(|| panic!("no {sample} in /metrics:\n{text}"));
    line.rsplit_once(' ').unwrap().1.parse().unwrap()
}

fn json(h: &Harness, path: &str) -> (u16, serde_json::Value) {
    let addr = if path == "/configz" { h.metrics_addr } else { h.healthz_addr };
    let (status, body) = http_get(addr, path).unwrap();
    (status, serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}")))
}

/// Poll `f` until it holds (the agent applies changes asynchronously).
fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn node_manifest(taints: &str) -> String {
    format!("apiVersion: v1\nkind: Node\nmetadata: {{name: test-node}}\nspec: {{taints: [{taints}]}}\n")
}

#[test]
fn metrics_server_reports_kube_proxy_metrics_that_follow_service_changes() {
    let mut h = Harness::new("kop-metrics", &["pod-a", "pod-b"]).unwrap();
    h.write_service("web", IP, &[HTTP], &[0, 1]).unwrap();
    // One endpoint counted on its own: pod-a's (the first), not pod-b's.
    h.agent_args = vec!["--endpoint-counters=1".into()];
    h.start_agent().unwrap();
    h.wait("10.96.0.10:80/TCP", Some(2)).unwrap();

    assert_eq!(http_get(h.metrics_addr, "/proxyMode").unwrap(), (200, "kpr".to_owned()));
    let (status, configz) = json(&h, "/configz");
    assert_eq!(status, 200);
    let config = &configz["kubeproxy.config.k8s.io"];
    assert_eq!(config["kind"], "KubeProxyConfiguration");
    assert_eq!(config["metricsBindAddress"], h.metrics_addr.to_string());
    assert_eq!(config["iptables"]["minSyncPeriod"], "0s", "the agent's flag is in effect");

    let service_changes = metric(&h, "kubeproxy_sync_proxy_rules_service_changes_total");
    let endpoint_changes = metric(&h, "kubeproxy_sync_proxy_rules_endpoint_changes_total");
    assert!(service_changes >= 1.0 && endpoint_changes >= 1.0);
    let service_ports = metric(&h, "kpr_map_entries{name=\"services\"}");
    assert_eq!(metric(&h, "kpr_map_capacity{name=\"services\"}"), 1024.0);
    assert_eq!(metric(&h, "kpr_map_entries{name=\"backends\"}") / service_ports, 2.0, "two backends per entry");
    assert!(metric(&h, "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}") > 1.7e9);
    assert!(metric(&h, "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}") >= 1.0);
    assert_eq!(metric(&h, "kubeproxy_sync_proxy_rules_service_changes_pending"), 0.0);

    // A second Service: the change counters and the map's entries move.
    h.write_service("api", OTHER_IP, &[HTTP], &[0]).unwrap();
    h.wait("10.96.0.11:80/TCP", Some(1)).unwrap();
    eventually("the service change counted", Duration::from_secs(5), || {
        metric(&h, "kubeproxy_sync_proxy_rules_service_changes_total") > service_changes
    });
    assert!(metric(&h, "kubeproxy_sync_proxy_rules_endpoint_changes_total") > endpoint_changes);
    assert_eq!(metric(&h, "kpr_map_entries{name=\"services\"}"), 2.0 * service_ports);

    // Traffic through the ClusterIP shows in the datapath's counters, and in the Service
    // port's, by name.
    let translated = metric(&h, "kpr_datapath_events_total{event=\"translated\"}");
    let connects = "kpr_service_socket_connects_total{namespace=\"test\",service=\"web\",port=\"http\"}";
    assert_eq!(metric(&h, connects), 0.0);
    let (answer, _) = h.client(|| tcp_ask(sa(IP, 80), TIMEOUT).expect("TCP through the ClusterIP"));
    assert_eq!(metric(&h, "kpr_datapath_events_total{event=\"translated\"}"), translated + 1.0);
    assert_eq!(metric(&h, connects), 1.0);
    // And the endpoint's, for pod-a, the one counted (more connections until it had some);
    // pod-b is past the cap.
    let mut to_pod_a = u32::from(answer == h.pod_name(0));
    for _ in 0..16 {
        if to_pod_a > 0 {
            break;
        }
        let (answer, _) = h.client(|| tcp_ask(sa(IP, 80), TIMEOUT).expect("TCP through the ClusterIP"));
        to_pod_a += u32::from(answer == h.pod_name(0));
    }
    assert!(to_pod_a > 0, "pod-a never answered");
    let pod_a = "kpr_endpoint_socket_connects_total{endpoint=\"10.244.1.2:8080/TCP\"}";
    assert_eq!(metric(&h, pod_a), f64::from(to_pod_a), "pod-a's connects");
    assert_eq!(metric(&h, "kpr_endpoint_counters_uncounted"), 1.0);
    let (_, text) = http_get(h.metrics_addr, "/metrics").unwrap();
    assert!(!text.contains("10.244.2.2:8080/TCP"), "pod-b past the cap:\n{text}");
    let other = "kpr_service_socket_connects_total{namespace=\"test\",service=\"api\",port=\"http\"}";
    assert_eq!(metric(&h, other), 0.0, "only the port connected to");
    let (status, body) = http_get(h.metrics_addr, "/service-ports").unwrap();
    let names: std::collections::BTreeMap<u32, String> = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 200);
    assert!(names.values().any(|n| n == "test/web:http/TCP"), "{body}");
    let services = Command::new(kpr_tests::kpr_bin())
        .args(["services", "--pin-root"])
        .arg(&h.pin_root)
        .arg("--metrics-address")
        .arg(h.metrics_addr.to_string())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&services.stdout);
    let web = text.lines().position(|l| l.contains("10.96.0.10:80/TCP") && l.contains("test/web:http/TCP"));
    let web = web.unwrap_or_else(|| panic!("no named frontend in:\n{text}"));
    let all = metric(&h, connects);
    assert!(text.lines().nth(web + 1).is_some_and(|l| l.contains(&format!("connects {all} "))), "{text}");
    let want = format!("  10.244.1.2:8080/TCP  flows 0 connects {to_pod_a} ");
    assert!(text.lines().any(|l| l.starts_with(&want)), "{want:?} in:\n{text}");

    // Not a kube-proxy path: 404, as kube-proxy's mux answers.
    assert_eq!(http_get(h.metrics_addr, "/nope").unwrap().0, 404);
}

#[test]
fn healthz_drains_a_node_being_deleted_and_livez_does_not() {
    let mut h = Harness::new("kop-health", &["pod-a"]).unwrap();
    h.write_service("web", IP, &[HTTP], &[0]).unwrap();
    h.write("node.yaml", &node_manifest("")).unwrap();
    h.start_agent().unwrap();
    h.wait("10.96.0.10:80/TCP", Some(1)).unwrap();

    let (status, healthz) = json(&h, "/healthz");
    assert_eq!(status, 200, "{healthz}");
    assert_eq!((healthz["healthy"].as_bool(), healthz["nodeEligible"].as_bool()), (Some(true), Some(true)));
    assert_eq!(healthz["status"]["IPv4"]["healthy"], true);
    for field in ["lastUpdated", "currentTime"] {
        let t: jiff::Timestamp = healthz[field].as_str().unwrap().parse().expect("RFC 3339");
        assert!((jiff::Timestamp::now() - t).get_seconds().abs() < 10, "{field}: {t}");
    }

    // The cluster autoscaler marks the node for deletion: load balancers must drain it.
    h.write(
        "node.yaml",
        &node_manifest("{key: ToBeDeletedByClusterAutoscaler, value: '1700000000', effect: NoSchedule}"),
    )
    .unwrap();
    eventually("/healthz to fail", Duration::from_secs(5), || json(&h, "/healthz").0 == 503);
    let (_, healthz) = json(&h, "/healthz");
    assert_eq!((healthz["healthy"].as_bool(), healthz["nodeEligible"].as_bool()), (Some(true), Some(false)));
    let (status, livez) = json(&h, "/livez");
    assert_eq!(status, 200, "the proxy itself is healthy: {livez}");
    assert!(livez.get("nodeEligible").is_none());

    h.write("node.yaml", &node_manifest("")).unwrap();
    eventually("/healthz to recover", Duration::from_secs(5), || json(&h, "/healthz").0 == 200);
    assert!(metric(&h, "kubeproxy_proxy_healthz_total{code=\"503\"}") >= 1.0);
    assert!(metric(&h, "kubeproxy_proxy_healthz_total{code=\"200\"}") >= 2.0);
}

#[test]
fn a_change_the_datapath_cannot_take_makes_the_proxy_unhealthy_until_it_can() {
    let mut h = Harness::new("kop-stuck", &["pod-a"]).unwrap();
    // Room for one service port's entries only; health timeout: twice the 1 s sync period.
    h.max_service_ports = 4;
    h.agent_args = vec!["--iptables-sync-period=1s".into()];
    h.write_service("web", IP, &[HTTP], &[0]).unwrap();
    h.start_agent().unwrap();
    h.wait("10.96.0.10:80/TCP", Some(1)).unwrap();
    assert_eq!(json(&h, "/livez").0, 200);

    h.write_service("api", OTHER_IP, &[HTTP], &[0]).unwrap();
    eventually("the failure to show", Duration::from_secs(5), || metric(&h, "kpr_service_ports_not_programmed") > 0.0);
    eventually("/livez to fail", Duration::from_secs(6), || json(&h, "/livez").0 == 503);
    let (_, livez) = json(&h, "/livez");
    assert_eq!(livez["healthy"], false);
    assert!(metric(&h, "kpr_sync_errors_total") >= 1.0);
    // The programmed service keeps working meanwhile.
    h.client(|| tcp_ask(sa(IP, 80), TIMEOUT).expect("the programmed service still answers"));

    h.remove("api-svc.yaml").unwrap();
    eventually("/livez to recover", Duration::from_secs(6), || json(&h, "/livez").0 == 200);
    assert_eq!(json(&h, "/healthz").0, 200);
}

#[test]
fn a_taken_server_port_is_a_startup_error_naming_it() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let h = Harness::new("kop-bind", &[]).unwrap();
    let out = testbed::AgentCommand::new(&h.cgroup.path, &h.pin_root)
        .manifests(&h.manifests)
        .args(["--interfaces", "none"])
        .arg(format!("--metrics-bind-address={addr}"))
        .arg(format!("--healthz-bind-address={}", h.healthz_addr))
        .command()
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the agent must not run without its metrics server: {stderr}");
    assert!(stderr.contains(&format!("failed to serve metrics on {addr}")), "{stderr}");
    assert!(!stderr.contains("\x1b["), "no colour codes off a terminal: {stderr}");
    // Nothing was attached: the bind is checked first.
    assert!(!kpr::datapath::bpf::pin_dir(&h.pin_root).exists());
}

/// `kpr diff` with the harness agent's flags: (exit code, stdout).
fn kpr_diff(h: &Harness, json: bool) -> (i32, String) {
    let mut cmd = Command::new(kpr_tests::kpr_bin());
    cmd.args(["diff", "--manifests"])
        .arg(&h.manifests)
        .arg("--pin-root")
        .arg(&h.pin_root)
        .args(["--node-name", "test-node", "--interfaces", "none", "--wait", "10s"])
        .env("NO_COLOR", "1");
    if json {
        cmd.args(["--output", "json"]);
    }
    let out = cmd.output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8(out.stdout).unwrap())
}

#[test]
fn kpr_diff_is_quiet_in_sync_and_names_each_drifted_service_port() {
    let mut h = Harness::new("kop-diff", &["pod-a", "pod-b"]).unwrap();
    h.write_service("web", IP, &[HTTP], &[0]).unwrap();
    h.write_service("old", OTHER_IP, &[HTTP], &[0]).unwrap();
    h.start_agent().unwrap();
    h.wait("10.96.0.10:80/TCP", Some(1)).unwrap();
    h.wait("10.96.0.11:80/TCP", Some(1)).unwrap();
    let (code, text) = kpr_diff(&h, false);
    assert_eq!(code, 0, "{text}");
    assert!(text.starts_with("in sync: "), "{text}");

    // The agent is gone; the cluster moves on: web gains an endpoint, old is deleted.
    h.kill_agent().unwrap();
    h.write_endpoints("web", &[HTTP], &[0, 1]).unwrap();
    h.remove("old-svc.yaml").unwrap();
    let (code, json) = kpr_diff(&h, true);
    assert_eq!(code, 1, "drift exits 1: {json}");
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(report["inSync"], false);
    let differences = report["differences"].as_array().unwrap();
    let web = differences.iter().find(|d| d["frontend"] == "10.96.0.10:80/TCP").expect("web differs");
    assert_eq!(web["kind"], "differs");
    assert_eq!(web["service"], "test/web:http/TCP");
    let pod = |i: usize| format!("{}:{}", h.topology.pods[i].ip, kpr_tests::POD_PORT);
    assert_eq!(web["desired"]["backends"], serde_json::json!([pod(0), pod(1)]));
    assert_eq!(web["maps"]["backends"], serde_json::json!([pod(0)]));
    let old = differences.iter().find(|d| d["frontend"] == "10.96.0.11:80/TCP").expect("old is unexpected");
    assert_eq!(old["kind"], "unexpected");
    assert!(old.get("desired").is_none());

    // The agent comes back and repairs: in sync again.
    h.start_agent().unwrap();
    h.wait("10.96.0.10:80/TCP", Some(2)).unwrap();
    h.wait("10.96.0.11:80/TCP", None).unwrap();
    let (code, text) = kpr_diff(&h, false);
    assert_eq!(code, 0, "{text}");
}

#[test]
fn a_node_that_does_not_forward_is_told_so_at_start() {
    let warning = "net.ipv4.ip_forward is 0";
    let start = |forward: u8| {
        let mut h = Harness::new("ko-fwd", &["pod-a"]).unwrap();
        h.write_service("web", IP, &[HTTP], &[0]).unwrap();
        h.topology.client.sh(&format!("echo {forward} > /proc/sys/net/ipv4/ip_forward")).unwrap();
        // The per-packet path on the node's link to pod-a, in the node's namespace.
        h.agent_in_node_netns = true;
        h.agent_args = vec!["--interfaces".into(), "veth0".into()];
        h.start_agent().unwrap();
        h.wait("10.96.0.10:80/TCP", Some(1)).unwrap();
        eventually("the link attached", TIMEOUT, || {
            std::fs::read_to_string(h.log_path()).unwrap().contains("per-packet programs attached")
        });
        std::fs::read_to_string(h.log_path()).unwrap()
    };
    let log = start(0);
    assert!(log.contains(warning), "{log}");
    let log = start(1);
    assert!(!log.contains(warning), "{log}");
}

/// A DaemonSet copied from kube-proxy's (kubeadm's command line: no `agent`, `--config`,
/// `--hostname-override`, and kube-proxy flags kpr has no use for) starts kpr, which serves its
/// Services and names the ignored flags in one warning.
#[test]
fn kube_proxys_daemonset_command_line_starts_the_agent() {
    let h = Harness::new("kop-kp-cmd", &["pod-a"]).unwrap();
    h.write_service("web", IP, &[HTTP], &[0]).unwrap();
    let config = h.manifests.with_extension("kube-proxy.conf");
    std::fs::write(
        &config,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: iptables\n",
    )
    .unwrap();
    let log = std::fs::File::create(h.log_path()).unwrap();
    let mut cmd = Command::new(kpr_tests::kpr_bin());
    testbed::die_with_parent(&mut cmd);
    cmd.arg(format!("--config={}", config.display()))
        .args(["--hostname-override=test-node", "--v=2", "--feature-gates=AllAlpha=false", "--kube-api-qps=20"])
        // The test's stand-ins for the cluster and the node, as the image test's.
        .arg("--manifests")
        .arg(&h.manifests)
        .arg("--pin-root")
        .arg(&h.pin_root)
        .arg("--cgroup")
        .arg(&h.cgroup.path)
        .args(["--interfaces", "none"])
        .arg(format!("--metrics-bind-address={}", h.metrics_addr))
        .arg(format!("--healthz-bind-address={}", h.healthz_addr))
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    let mut agent = cmd.spawn().unwrap();
    let served = h.wait("10.96.0.10:80/TCP", Some(1));
    let running = agent.try_wait().unwrap().is_none();
    let _ = agent.kill();
    let _ = agent.wait();
    let _ = std::fs::remove_file(&config);
    let text = std::fs::read_to_string(h.log_path()).unwrap_or_default();
    served.unwrap();
    assert!(running, "the agent keeps running:\n{text}");
    let warnings: Vec<&str> = text.lines().filter(|l| l.contains("--feature-gates")).collect();
    assert_eq!(warnings.len(), 1, "one warning names the ignored flags:\n{text}");
    assert!(warnings[0].contains("--kube-api-qps"), "{}", warnings[0]);
}

/// `kpr verify -o OUTPUT` against the agent at `h` (in the node's namespace): the exit code
/// and what it printed.
fn kpr_verify_output(h: &Harness, output: &str) -> (i32, String) {
    let mut cmd = Command::new(kpr_tests::kpr_bin());
    cmd.args(["verify", "--output", output, "--metrics-address"]).arg(h.metrics_addr.to_string());
    h.topology.client.exec_in(&mut cmd).unwrap();
    let out = cmd.output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// `kpr verify -o json`: the exit code and the report.
fn kpr_verify(h: &Harness) -> (i32, serde_json::Value) {
    let (code, text) = kpr_verify_output(h, "json");
    (code, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

/// GET `path` from the agent at `addr`, in the node's namespace.
fn get_in_node(h: &Harness, addr: std::net::SocketAddr, path: &'static str) -> (u16, String) {
    h.client(move || http_get(addr, path)).unwrap()
}

/// The value of `sample` in `/metrics` of an agent in the node's namespace.
fn node_metric(h: &Harness, sample: &str) -> f64 {
    let (_, text) = get_in_node(h, h.metrics_addr, "/metrics");
    let line = text.lines().find(|l| l.rsplit_once(' ').is_some_and(|(name, _)| name == sample));
    line.unwrap_or_else(|| panic!("no {sample} in /metrics:\n{text}")).rsplit_once(' ').unwrap().1.parse().unwrap()
}

#[test]
fn the_datapath_checks_itself_and_repairs_an_entry_corrupted_behind_its_back() {
    use proxy_common::{Backend, ServiceKey, ServiceValue, map_names};
    let mut h = Harness::new("kop-verify", &["pod-a", "pod-b"]).unwrap();
    h.write_service("web", IP, &[HTTP, ("dns", 53, "UDP")], &[0]).unwrap();
    h.write_service("none", OTHER_IP, &[HTTP], &[]).unwrap();
    // The per-packet path on the node's link to pod-a; the periodic resync out of the way, so
    // that only the self-check (every second) can find and repair the corruption.
    h.agent_in_node_netns = true;
    h.agent_args = ["--interfaces=veth0", "--verify-period=1s", "--iptables-sync-period=1h"].map(Into::into).to_vec();
    h.start_agent().unwrap();
    h.wait("10.96.0.10:80/TCP", Some(1)).unwrap();
    h.wait("10.96.0.10:53/UDP", Some(1)).unwrap();
    h.wait("10.96.0.11:80/TCP", Some(0)).unwrap();
    eventually("the link attached", TIMEOUT, || {
        std::fs::read_to_string(h.log_path()).unwrap().contains("per-packet programs attached")
    });

    // In step: every probe agrees (DNAT to pod-a; REJECT for the port without endpoints),
    // from outside through the per-packet program and from the node through the socket
    // hooks: three frontends, two classes (pods are not told apart on this node).
    let segments_at_pod_a =
        || h.topology.pods[0].netns.run(|| std::fs::read_to_string("/proc/thread-self/net/snmp").unwrap()).unwrap();
    let before = segments_at_pod_a();
    let (code, report) = kpr_verify(&h);
    assert_eq!(code, 0, "{report}");
    assert!(report["probed"].as_u64().unwrap() >= 6, "{report}");
    assert_eq!(report["failures"], serde_json::json!([]), "{report}");
    // The probes send nothing (the node's connect()s are a UDP socket's and a TCP socket's in
    // repair mode): pod-a received no segment and no datagram.
    assert_eq!(segments_at_pod_a(), before, "pod-a's TCP and UDP counters");
    // The probes leave no flow behind and are not counted as the Service's traffic.
    let flows = kpr::datapath::conntrack::Conntrack::open(&h.pin_root).unwrap().len();
    assert_eq!(flows, 0, "the probes' flows are taken back");
    let (_, text) = get_in_node(&h, h.metrics_addr, "/metrics");
    for counted in ["kpr_service_new_flows_total", "kpr_service_socket_connects_total"] {
        assert!(
            !text.lines().any(|l| l.starts_with(counted) && !l.ends_with(" 0")),
            "probes counted in {counted}:\n{text}"
        );
    }
    assert_eq!(node_metric(&h, "kpr_datapath_verify_failures_total"), 0.0);

    // Behind the agent's back, web's one backend slot now sends its clients to pod-b: a
    // datapath that still works, wrongly, and that no error would show.
    let pod = |i: usize| std::net::IpAddr::from(h.topology.pods[i].ip);
    let map = kpr::datapath::bpf::open_pinned_map(&h.pin_root, map_names::BACKENDS).unwrap();
    let mut slots = aya::maps::Array::<_, Backend>::try_from(aya::maps::Map::Array(map)).unwrap();
    // (Each frontend entry, one per source class, has a range of its own.)
    let web_slots: Vec<u32> =
        (0..slots.len()).filter(|i| slots.get(i, 0).is_ok_and(|b| std::net::IpAddr::from(b.addr) == pod(0))).collect();
    assert!(!web_slots.is_empty(), "pod-a's slots");
    for slot in &web_slots {
        let good = slots.get(slot, 0).unwrap();
        slots.set(*slot, &Backend { addr: pod(1).into(), ..good }, 0).unwrap();
    }
    let corrupted = Instant::now();

    // Found within a period (1 s, and its run), counted, and repaired by the resync.
    eventually("the self-check finds the corruption", Duration::from_secs(5), || {
        node_metric(&h, "kpr_datapath_verify_failures_total") >= 1.0
    });
    let found_in = corrupted.elapsed();
    // The resync writes the port's backends afresh (a new range; the corrupted slots are
    // free now), and the probes run again at once: repaired.
    let repaired = "reconcile repaired drift in the maps";
    eventually("the resync", Duration::from_secs(5), || {
        std::fs::read_to_string(h.log_path()).unwrap().contains(repaired)
    });
    let log = std::fs::read_to_string(h.log_path()).unwrap();
    assert!(log.contains("the datapath decides otherwise than the model"), "{log}");
    assert!(log.contains("10.96.0.10:80/TCP"), "the failing frontend is named: {log}");
    // Found on both paths: an outside client's packet, and the node's own connect().
    for class in ["class=External", "class=Node"] {
        assert!(log.lines().any(|l| l.contains("10.96.0.10:80/TCP") && l.contains(class)), "{class}: {log}");
    }
    let (code, text) = kpr_verify_output(&h, "text");
    assert_eq!(code, 0, "in step again: {text}");
    assert!(text.contains("frontends probed") && text.contains("the datapath agrees with the model"), "{text}");
    eprintln!("{text}");
    let (status, health) = get_in_node(&h, h.healthz_addr, "/healthz");
    assert_eq!(status, 200, "repaired: healthy: {health}");
    eprintln!("corruption found and repaired {} ms after it was written", found_in.as_millis());

    // Its clients reach pod-a again.
    let (answer, _) = h.client(|| tcp_ask((IP, 80), TIMEOUT)).unwrap();
    assert_eq!(answer, h.pod_name(0));

    // A service entry corrupted: web's frontends say "no endpoints" (REJECT).
    let map = kpr::datapath::bpf::open_pinned_map(&h.pin_root, map_names::SERVICES).unwrap();
    let mut services =
        aya::maps::HashMap::<_, ServiceKey, ServiceValue>::try_from(aya::maps::Map::HashMap(map)).unwrap();
    let web: Vec<(ServiceKey, ServiceValue)> = services
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, _)| std::net::IpAddr::from(k.addr) == std::net::IpAddr::from(IP))
        .collect();
    assert!(!web.is_empty());
    let failures = node_metric(&h, "kpr_datapath_verify_failures_total");
    for (key, value) in &web {
        services.insert(key, &ServiceValue { backends_count: 0, ..*value }, 0).unwrap();
    }
    eventually("the self-check finds the entry", Duration::from_secs(5), || {
        node_metric(&h, "kpr_datapath_verify_failures_total") > failures
    });
    eventually("the entries repaired", Duration::from_secs(5), || {
        services
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, _)| web.iter().any(|(w, _)| w == k))
            .all(|(_, v)| v.backends_count == 1)
    });
    let log = std::fs::read_to_string(h.log_path()).unwrap();
    assert!(log.contains("expected=DNAT to one of 10.244.1.2:8080 seen=REJECT"), "{log}");
    let (code, report) = kpr_verify(&h);
    assert_eq!(code, 0, "in step again: {report}");
    let (answer, _) = h.client(|| tcp_ask((IP, 80), TIMEOUT)).unwrap();
    assert_eq!(answer, h.pod_name(0));

    // A program out of reach: the slow programs' slots emptied (new flows would pass
    // untranslated). The maps are right; the probes find it, and the slots are filled again.
    let map = kpr::datapath::bpf::open_pinned_map(&h.pin_root, map_names::TC_SLOW_PATH).unwrap();
    let mut slots = aya::maps::ProgramArray::try_from(aya::maps::Map::ProgramArray(map)).unwrap();
    let failures = node_metric(&h, "kpr_datapath_verify_failures_total");
    for slot in 0..proxy_common::tc_slow_path::SLOTS {
        let _ = slots.clear_index(&slot);
    }
    eventually("the self-check finds the programs out of reach", Duration::from_secs(5), || {
        node_metric(&h, "kpr_datapath_verify_failures_total") > failures
    });
    let log = std::fs::read_to_string(h.log_path()).unwrap();
    assert!(log.contains("seen=left untranslated"), "{log}");
    let (code, report) = kpr_verify(&h);
    assert_eq!(code, 0, "the slots filled again: {report}");

    // A Maglev frontend (an externalIP): each probe expects the one endpoint the table names
    // for its tuple. A table rewritten behind the agent's back with another seed (a node out
    // of step with the cluster) still sends every flow to an endpoint, so only those probes
    // find it; the resync writes the tables anew.
    const MAGLEV_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 12);
    let manifest = testbed::service_manifest("test", "mg", &[MAGLEV_IP.into()], &[HTTP])
        .replacen("  namespace: test\n", "  namespace: test\n  annotations: {kpr.io/lb-algorithm: maglev}\n", 1)
        .replacen("  type: ClusterIP\n", "  type: ClusterIP\n  externalIPs: [\"192.0.2.80\"]\n", 1);
    h.write("mg-svc.yaml", &manifest).unwrap();
    h.write_endpoints("mg", &[HTTP], &[0, 1]).unwrap();
    h.wait("192.0.2.80:80/TCP", Some(2)).unwrap();
    let (code, report) = kpr_verify(&h);
    assert_eq!(code, 0, "{report}");
    let mut maps = kpr::datapath::bpf::BpfMaps::open_pinned(&h.pin_root).unwrap();
    let (_, value) = services
        .iter()
        .filter_map(Result::ok)
        .find(|(k, v)| {
            std::net::IpAddr::from(k.addr) == std::net::IpAddr::from(Ipv4Addr::new(192, 0, 2, 80))
                && v.flags & proxy_common::SERVICE_FLAG_MAGLEV != 0
        })
        .expect("the externalIP's entry for outside clients, flagged Maglev");
    let id = value.service_id;
    // The table as the programmer builds it: the endpoints in the order of the entry's range.
    let endpoints: Vec<std::net::SocketAddr> =
        kpr::datapath::Maps::backends(&maps, value.backends_start, value.backends_count)
            .unwrap()
            .into_iter()
            .map(|b| std::net::SocketAddr::new(b.addr.into(), u16::from_be(b.port)))
            .collect();
    assert_eq!(endpoints.len(), 2);
    let size = proxy_common::MAGLEV_DEFAULT_TABLE_SIZE;
    let wrong = kpr::model::maglev::table(&endpoints, size, u64::from(kpr::datapath::bpf::DEFAULT_MAGLEV_SEED) + 1);
    let failures = node_metric(&h, "kpr_datapath_verify_failures_total");
    kpr::datapath::Maps::set_maglev(&mut maps, id, &wrong.unwrap()).unwrap();
    eventually("the self-check finds the table", Duration::from_secs(5), || {
        node_metric(&h, "kpr_datapath_verify_failures_total") > failures
    });
    let log = std::fs::read_to_string(h.log_path()).unwrap();
    assert!(log.lines().any(|l| l.contains("192.0.2.80:80/TCP") && l.contains("otherwise than the model")), "{log}");
    let (code, report) = kpr_verify(&h);
    assert_eq!(code, 0, "the table written anew: {report}");
}
