//! `kpr-demo` (what `cargo xtask run` starts on a machine without a cluster) runs to the end
//! and shows what it claims: every pod answering through the ClusterIP, the NodePort reached
//! from the external client (masqueraded), `kpr trace` of it, and kube-proxy's endpoints.
//! Needs root.
use std::process::Command;

#[test]
fn the_demo_shows_cluster_ip_node_port_trace_and_endpoints() {
    let out = Command::new(testbed::demo_bin()).env("NO_COLOR", "1").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    let section = |start: &str| -> String {
        let at = stdout.find(start).unwrap_or_else(|| panic!("no `{start}` in:\n{stdout}"));
        stdout[at..].lines().skip(1).take_while(|l| l.starts_with("  ")).collect::<Vec<_>>().join("\n")
    };
    let cluster_ip = section("TCP connections to 10.96.0.10:80 (3 endpoints)");
    for pod in ["pod-a", "pod-b", "pod-c"] {
        assert!(cluster_ip.contains(pod), "{pod} answered through the ClusterIP:\n{cluster_ip}");
    }
    let over_ipv6 = section("TCP connections to [fd00:96::10]:80 (3 endpoints, IPv6)");
    for pod in ["pod-a", "pod-b", "pod-c"] {
        assert!(over_ipv6.contains(pod), "{pod} answered through the IPv6 ClusterIP:\n{over_ipv6}");
    }
    let node_port = section("TCP connections from the external client 192.168.77.100 to the NodePort");
    assert_eq!(node_port.lines().count(), 3, "all three pods behind the NodePort:\n{node_port}");
    assert!(
        stdout.contains("the pods saw the source 10.244."),
        "masqueraded to the node's pod-side address:\n{stdout}"
    );
    let scaled = section("TCP connections to 10.96.0.10:80 (2 endpoints)");
    assert!(!scaled.contains("pod-c"), "pod-c left:\n{scaled}");
    assert!(stdout.contains("  verdict: to one of 2 endpoints"), "{stdout}");
    assert!(stdout.contains("curl 127.0.0.1:10256/healthz -> 200 "), "{stdout}");
    assert!(stdout.contains("curl 127.0.0.1:10249/proxyMode -> 200 kpr"), "{stdout}");
    assert!(stdout.ends_with("demo: done, cleaning up\n"), "{stdout}");
    assert!(!stderr.contains("WARN") && !stderr.contains("ERROR"), "a clean run logs no warnings:\n{stderr}");
}

/// `kpr-demo --keep-running` ended by SIGTERM (`kill`, `timeout`), not Ctrl-C, still removes
/// the network namespaces and bpffs pins it made (SIGTERM's default action would leave them,
/// and the programs they hold, behind).
#[test]
fn a_demo_kept_running_removes_what_it_made_on_sigterm() {
    use std::io::{BufRead as _, BufReader};
    let mut child = Command::new(testbed::demo_bin())
        .arg("--keep-running")
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let tag = format!("kpr-demo-{}", child.id());
    let ours = |listing: &str| listing.lines().filter(|l| l.contains(&tag)).count();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let running = lines.by_ref().map_while(Result::ok).any(|l| l.contains("running until Ctrl-C"));
    let netns =
        || String::from_utf8_lossy(&Command::new("ip").args(["netns", "list"]).output().unwrap().stdout).into_owned();
    let pins = || {
        std::fs::read_dir("/sys/fs/bpf")
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned() + "\n")
            .collect::<String>()
    };
    let made = (ours(&netns()), ours(&pins()));
    // SAFETY: kill(2) on the pid of the child this test started (and has not reaped).
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(running, "the demo got to running");
    assert!(made.0 >= 5 && made.1 >= 1, "it made namespaces and pins: {made:?}");
    assert!(status.success(), "an orderly exit: {status}");
    assert_eq!((ours(&netns()), ours(&pins())), (0, 0), "nothing of {tag} left");
}
