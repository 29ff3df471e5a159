//! Passive outlier detection on the real agent: one of a Service's three endpoints loses its
//! network while the API still calls it ready; a client pod's new connections (through the
//! per-packet path, or the socket path) stop failing once the agent has sidelined it,
//! connections to the others live on, and the endpoint gets connections again once its network
//! is back. Needs root.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use kpr_tests::{Harness, TIMEOUT, http_get};

const IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const HTTP: (&str, u16, &str) = ("http", 80, "TCP");
/// A connection not set up within this long failed (an endpoint on this machine answers in
/// well under a millisecond).
const CONNECT: Duration = Duration::from_millis(300);
/// The same for a client of the socket path: it waits past its SYN's first retransmission
/// (1 s), as the socket path counts a connect given up before it as no failure.
const CONNECT_PAST_RETRANSMISSION: Duration = Duration::from_millis(1300);

/// The value of `sample` in the agent's `/metrics` (the agent runs in the node's namespace);
/// None when absent.
fn metric(h: &Harness, sample: &str) -> Option<f64> {
    let addr = h.metrics_addr;
    let (_, text) = h.client(move || http_get(addr, "/metrics")).unwrap();
    let line = text.lines().find(|l| l.rsplit_once(' ').is_some_and(|(name, _)| name == sample))?;
    line.rsplit_once(' ')?.1.parse().ok()
}

/// From the client pod: connect to the Service (waiting up to `patience`) and read the
/// answering pod's name.
fn ask(h: &Harness, patience: Duration) -> Result<String, String> {
    h.topology.pods[3]
        .netns
        .run(move || {
            let conn = TcpStream::connect_timeout(&SocketAddr::from((IP, 80)), patience).map_err(|e| e.to_string())?;
            conn.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
            let mut name = String::new();
            BufReader::new(&conn).read_line(&mut name).map_err(|e| e.to_string())?;
            Ok(name.trim_end().to_owned())
        })
        .unwrap()
}

/// `kpr diff` in the node's namespace, with the agent's source and metrics server: (exit code,
/// stdout and stderr).
fn kpr_diff(h: &Harness) -> (i32, String) {
    let mut cmd = std::process::Command::new(kpr_tests::kpr_bin());
    cmd.args(["diff", "--manifests"])
        .arg(&h.manifests)
        .arg("--pin-root")
        .arg(&h.pin_root)
        .args(["--node-name", "test-node", "--interfaces", "veth0,veth1,veth2,veth3", "--wait", "10s"])
        .arg(format!("--metrics-bind-address={}", h.metrics_addr))
        .env("NO_COLOR", "1");
    h.topology.client.exec_in(&mut cmd).unwrap();
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// `kpr services` in the node's namespace, asking the agent's metrics server: its text.
fn kpr_services(h: &Harness) -> String {
    let mut cmd = std::process::Command::new(kpr_tests::kpr_bin());
    cmd.args(["services", "--pin-root"])
        .arg(&h.pin_root)
        .arg(format!("--metrics-address={}", h.metrics_addr))
        .env("NO_COLOR", "1");
    h.topology.client.exec_in(&mut cmd).unwrap();
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "kpr services: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Which of kpr's paths the client pod's connections take.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ClientPath {
    /// Its link's tc programs (the socket hooks are on a cgroup it is not in).
    PerPacket,
    /// The socket hooks, at `connect()` (the client is in their cgroup).
    Socket,
}

#[test]
fn an_endpoint_that_stops_answering_is_sidelined_and_comes_back_with_its_network() {
    sidelined_and_back(ClientPath::PerPacket);
}

#[test]
fn an_endpoint_the_socket_path_finds_unanswering_is_sidelined_and_comes_back() {
    sidelined_and_back(ClientPath::Socket);
}

fn sidelined_and_back(path: ClientPath) {
    let mut h = Harness::new("kout", &["pod-a", "pod-b", "pod-c", "client"]).unwrap();
    h.write_service("web", IP, &[HTTP], &[0, 1, 2]).unwrap();
    let svc = std::fs::read_to_string(h.manifests.join("web-svc.yaml")).unwrap();
    let annotated = svc.replacen("metadata:\n", "metadata:\n  annotations: {kpr.io/outlier-detection: 'on'}\n", 1);
    h.write("web-svc.yaml", &annotated).unwrap();
    // Per packet: the socket hooks on a cgroup of their own, which this process is not in.
    // Socket path: on the harness's cgroup, which this process is in.
    let hooks = testbed::Cgroup::new(&format!("{}/hooks", h.name)).unwrap();
    if path == ClientPath::PerPacket {
        h.agent_cgroup = Some(hooks.path.clone());
    }
    let patience = if path == ClientPath::Socket { CONNECT_PAST_RETRANSMISSION } else { CONNECT };
    h.agent_in_node_netns = true;
    h.agent_args = ["--interfaces=veth0,veth1,veth2,veth3", "--outlier-failures=3"].map(Into::into).to_vec();
    h.topology.client.run(|| std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").unwrap()).unwrap();
    h.start_agent().unwrap();
    h.wait("10.96.0.30:80/TCP", Some(3)).unwrap();
    let deadline = Instant::now() + testbed::slow(Duration::from_secs(10));
    while std::fs::read_to_string(h.log_path()).unwrap().matches("per-packet programs attached").count() < 4 {
        assert!(Instant::now() < deadline, "links attached: {}", std::fs::read_to_string(h.log_path()).unwrap());
        std::thread::sleep(Duration::from_millis(100));
    }

    // Every endpoint answers, per packet.
    let mut names = std::collections::BTreeSet::new();
    for _ in 0..30 {
        names.insert(ask(&h, patience).expect("every endpoint answers"));
    }
    assert_eq!(names, ["pod-a", "pod-b", "pod-c"].map(String::from).into(), "spread over the three");
    match path {
        ClientPath::PerPacket => assert!(h.counter("tc_new_flow") >= 30, "served per packet, not at the sockets"),
        ClientPath::Socket => {
            assert!(h.counter("translated") >= 30, "served at the sockets");
            assert_eq!(h.counter("tc_new_flow"), 0, "not per packet");
        }
    }

    // A connection to another endpoint, held across the outage.
    let held = h.topology.pods[3]
        .netns
        .run(|| {
            loop {
                let conn = TcpStream::connect_timeout(&SocketAddr::from((IP, 80)), CONNECT).unwrap();
                conn.set_read_timeout(Some(TIMEOUT)).unwrap();
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut name = String::new();
                reader.read_line(&mut name).unwrap();
                if name.trim_end() != "pod-b" {
                    return (conn, reader, name.trim_end().to_owned());
                }
            }
        })
        .unwrap();

    // pod-b's network goes; nobody tells the API.
    let pod_b = &h.topology.pods[1];
    pod_b.netns.ip(&["link", "set", "eth0", "down"]).unwrap();
    let down = Instant::now();
    let sample = "kpr_endpoint_sidelined{namespace=\"test\",service=\"web\",endpoint=\"10.244.2.2:8080/TCP\"}";
    let (mut failed, mut last_failure) = (0, None);
    while metric(&h, sample) != Some(1.0) {
        assert!(
            down.elapsed() < Duration::from_secs(20),
            "not sidelined: {}",
            std::fs::read_to_string(h.log_path()).unwrap()
        );
        if ask(&h, patience).is_err() {
            failed += 1;
            last_failure = Some(down.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let sidelined_in = down.elapsed();
    assert!(failed >= 3, "{failed} connections failed before pod-b was sidelined: it takes three");
    // The agent says which (`/sidelined`), `kpr diff` does not call it drift and `kpr
    // services` shows it beside its port's backends (all within the back-off, 10 s).
    let addr = h.metrics_addr;
    let (_, listed) = h.client(move || http_get(addr, "/sidelined")).unwrap();
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed, serde_json::json!([{"namespace": "test", "service": "web", "endpoint": "10.244.2.2:8080/TCP"}]));
    let (code, text) = kpr_diff(&h);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("in sync") && text.contains("1 endpoints sidelined"), "{text}");
    let services = kpr_services(&h);
    assert!(services.contains(" (sidelined: 10.244.2.2:8080)"), "kpr services:\n{services}");

    // From now on, every new connection is answered, by pod-a or pod-c.
    for _ in 0..30 {
        let answer = ask(&h, patience).expect("no failure once pod-b is sidelined");
        assert_ne!(answer, "pod-b");
    }
    eprintln!(
        "{path:?}: pod-b sidelined {} ms after its link went down ({failed} connections failed, the last {} ms after)",
        sidelined_in.as_millis(),
        last_failure.unwrap_or_default().as_millis()
    );
    let log = std::fs::read_to_string(h.log_path()).unwrap();
    assert!(log.contains("endpoint sidelined") && log.contains("10.244.2.2:8080/TCP"), "{log}");
    let total = "kpr_endpoint_sidelinings_total{namespace=\"test\",service=\"web\"}";
    assert_eq!(metric(&h, total), Some(1.0));

    // The held connection carries on.
    let (mut conn, mut reader, held_by) = held;
    let alive = h.topology.pods[3]
        .netns
        .run(move || {
            conn.write_all(b"peer?\n").unwrap();
            let mut peer = String::new();
            reader.read_line(&mut peer).map(|_| peer)
        })
        .unwrap();
    assert!(alive.is_ok_and(|p| p.starts_with("10.244.")), "the connection to {held_by} lives on");

    // Its network back: after the back-off it is returned, and answers again.
    pod_b.netns.ip(&["link", "set", "eth0", "up"]).unwrap();
    pod_b.netns.ip(&["route", "add", "default", "via", "10.244.2.1"]).unwrap();
    let up = Instant::now();
    loop {
        assert!(up.elapsed() < Duration::from_secs(30), "pod-b never answered again");
        if ask(&h, patience).is_ok_and(|name| name == "pod-b") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("{path:?}: pod-b answered again {} ms after its link came back", up.elapsed().as_millis());
    assert_eq!(metric(&h, sample), None, "no longer sidelined");
    drop(hooks);
}

/// Service `name` on `ip`:80, annotated to opt in, with one endpoint: pod `pod` on `port`.
fn opted_in_service(h: &Harness, name: &str, ip: Ipv4Addr, pod: usize, port: u16) {
    let svc = testbed::service_manifest("test", name, &[ip.into()], &[HTTP]);
    let annotated = svc.replacen("metadata:\n", "metadata:\n  annotations: {kpr.io/outlier-detection: 'on'}\n", 1);
    h.write(&format!("{name}-svc.yaml"), &annotated).unwrap();
    let ips = [h.topology.pods[pod].ip.into()];
    h.write(
        &format!("{name}-slice.yaml"),
        &testbed::slice_manifest("test", name, &format!("{name}-1"), &ips, &[("http", port, "TCP")]),
    )
    .unwrap();
}

/// The socket path's counts, per endpoint: a `connect()` answered, one refused (nothing
/// listens), one whose SYN went unanswered until its first retransmission, each counted once;
/// one given up before that retransmission, and `kpr verify`'s probes of the same frontends,
/// not at all.
#[test]
fn the_socket_path_counts_each_connects_answer_once_for_its_endpoint() {
    const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 31);
    const CLOSED: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 32);
    const DARK: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 33);
    let mut h = Harness::new("kans", &["pod-a", "pod-b", "pod-c", "client"]).unwrap();
    opted_in_service(&h, "web", WEB, 0, kpr_tests::POD_PORT);
    opted_in_service(&h, "closed", CLOSED, 1, kpr_tests::POD_PORT + 1);
    opted_in_service(&h, "dark", DARK, 2, kpr_tests::POD_PORT);
    h.agent_in_node_netns = true;
    h.agent_args = ["--interfaces=veth0,veth1,veth2,veth3", "--verify-period=1s"].map(Into::into).to_vec();
    h.topology.client.run(|| std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").unwrap()).unwrap();
    h.start_agent().unwrap();
    for ip in [WEB, CLOSED, DARK] {
        h.wait(&format!("{ip}:80/TCP"), Some(1)).unwrap();
    }
    let endpoint = |pod: usize, port: u16| kpr::model::outliers::Endpoint {
        addr: SocketAddr::from((h.topology.pods[pod].ip, port)),
        protocol: kpr::model::Protocol::Tcp,
    };
    let (web, closed, dark) = (endpoint(0, 8080), endpoint(1, 8081), endpoint(2, 8080));
    let watch = kpr::datapath::backend_answers::BackendWatch::open(&h.pin_root).unwrap();
    let counts = || {
        let seen = watch.observe(&[web, closed, dark].into()).unwrap();
        [web, closed, dark].map(|e| seen.answers.get(&e).copied().unwrap_or_default())
    };
    let connect = |ip: Ipv4Addr, timeout: Duration| {
        h.topology.pods[3].netns.run(move || TcpStream::connect_timeout(&SocketAddr::from((ip, 80)), timeout)).unwrap()
    };
    // The agent asks for answers once it watches an opted-in Service's endpoints.
    let deadline = Instant::now() + testbed::slow(Duration::from_secs(10));
    while counts()[0].answered == 0 {
        assert!(Instant::now() < deadline, "answers never counted: {:?}", counts());
        connect(WEB, CONNECT).expect("web answers");
        std::thread::sleep(Duration::from_millis(200));
    }
    let before = counts();
    let runs = metric(&h, "kpr_datapath_verify_runs_total").unwrap_or_default();
    pod_c_goes_dark(&h);
    connect(WEB, CONNECT).expect("web answers");
    let refused = connect(CLOSED, CONNECT).expect_err("nothing listens on 8081");
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused, "{refused}");
    // Retransmitted at 1 s: counted then; given up at 1.5 s: not again.
    assert!(connect(DARK, Duration::from_millis(1500)).is_err());
    // Given up at 200 ms, before its retransmission: no failure of the endpoint's.
    assert!(connect(DARK, Duration::from_millis(200)).is_err());
    // `kpr verify`'s probes of the three frontends ran meanwhile (1 s period).
    std::thread::sleep(Duration::from_millis(1500));
    assert!(metric(&h, "kpr_datapath_verify_runs_total").unwrap_or_default() >= runs + 2.0);
    let after = counts();
    let grew = |i: usize| {
        let (a, b): (Answers, Answers) = (after[i], before[i]);
        (a.answered - b.answered, a.refused - b.refused, a.unanswered - b.unanswered)
    };
    assert_eq!([grew(0), grew(1), grew(2)], [(1, 0, 0), (0, 1, 0), (0, 0, 1)], "{before:?} → {after:?}");
}

type Answers = kpr::model::outliers::Answers;

/// Pod-c's link down: its SYNs get no answer.
fn pod_c_goes_dark(h: &Harness) {
    h.topology.pods[2].netns.ip(&["link", "set", "eth0", "down"]).unwrap();
}
