//! Socket-level ClusterIP load balancing, end to end: the real agent reading manifests, real
//! sockets in a child cgroup inside a node namespace, backends in pod namespaces.
//! Needs root; run one at a time (`cargo xtask test` does).
use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead as _, BufReader, ErrorKind, Write as _},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

use kpr_tests::{Harness, POD_PORT, TIMEOUT, sa, sa6};
use testbed::{tcp_ask, udp_ask, udp_connected_ask};

const IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const HTTP: (&str, u16, &str) = ("http", 80, "TCP");
const DNS: (&str, u16, &str) = ("dns", 53, "UDP");

fn setup(tag: &str, pods: &[&str]) -> Harness {
    setup_with(tag, pods, &[])
}

/// [`setup`] with more agent flags.
fn setup_with(tag: &str, pods: &[&str], args: &[&str]) -> Harness {
    let mut h = Harness::new(tag, pods).expect("harness");
    h.agent_args = args.iter().map(|a| (*a).to_owned()).collect();
    let all: Vec<usize> = (0..pods.len()).collect();
    h.write_service("web", IP, &[HTTP, DNS], &all).unwrap();
    h.start_agent().unwrap();
    h.wait("10.96.0.10:80/TCP", Some(pods.len())).unwrap();
    h.wait("10.96.0.10:53/UDP", Some(pods.len())).unwrap();
    h
}

/// Who answers `n` new TCP connections to the ClusterIP.
fn tcp_spread(h: &Harness, n: usize) -> BTreeMap<String, usize> {
    h.client(move || {
        let mut seen = BTreeMap::new();
        for _ in 0..n {
            let (name, _) = tcp_ask(sa(IP, 80), TIMEOUT).expect("TCP through the ClusterIP");
            *seen.entry(name).or_insert(0) += 1;
        }
        seen
    })
}

/// A TCP connection through the ClusterIP that stays open: (backend name, stream).
fn open_connection(h: &Harness) -> (String, TcpStream) {
    h.client(|| {
        let conn = TcpStream::connect_timeout(&sa(IP, 80).into(), TIMEOUT).unwrap();
        conn.set_read_timeout(Some(TIMEOUT)).unwrap();
        let mut line = String::new();
        BufReader::new(&conn).read_line(&mut line).unwrap();
        (line.trim_end().to_owned(), conn)
    })
}

/// The connection still carries data both ways.
fn assert_echoes(conn: &mut TcpStream, payload: &str) {
    conn.write_all(format!("{payload}\n").as_bytes()).unwrap();
    let mut line = String::new();
    BufReader::new(&*conn).read_line(&mut line).expect("echo over the established connection");
    assert_eq!(line.trim_end(), payload);
}

/// TCP (port 80), UDP and connected UDP (port 53) answers: each from one of `pods`, each
/// with the ClusterIP `ip` as the peer the application sees.
fn assert_answered_as_the_cluster_ip(
    pods: &[String],
    ip: std::net::IpAddr,
    [tcp, udp, udp_conn]: [&(String, SocketAddr); 3],
) {
    assert!(pods.contains(&tcp.0), "TCP answered by {}", tcp.0);
    assert_eq!(tcp.1, SocketAddr::new(ip, 80), "getpeername shows the ClusterIP");
    assert!(pods.contains(&udp.0), "UDP answered by {}", udp.0);
    assert_eq!(udp.1, SocketAddr::new(ip, 53), "recvfrom shows the ClusterIP as the source");
    assert!(pods.contains(&udp_conn.0), "connected UDP answered by {}", udp_conn.0);
    assert_eq!(udp_conn.1, SocketAddr::new(ip, 53), "getpeername of a connected UDP socket");
}

/// `kpr services` on the harness's pins: its whole output, and the line of `frontend`.
fn kpr_services(h: &Harness, frontend: &str) -> (String, String) {
    let out = std::process::Command::new(kpr_tests::kpr_bin())
        .arg("services")
        .arg("--pin-root")
        .arg(&h.pin_root)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = text.lines().find(|l| l.contains(frontend)).unwrap_or_else(|| panic!("{frontend} not in:\n{text}"));
    (text.clone(), line.to_owned())
}

#[test]
fn tcp_and_udp_reach_a_backend_and_the_app_sees_the_cluster_ip() {
    // With per-endpoint counters (the connect programs' code for them through the verifier,
    // in the kernels' VMs too).
    let h = setup_with("kt-basic", &["pod-a", "pod-b", "pod-c"], &["--endpoint-counters=16"]);
    let pods: Vec<String> = (0..3).map(|i| h.pod_name(i)).collect();
    let (tcp, udp, udp_conn) = h.client(|| {
        (
            tcp_ask(sa(IP, 80), TIMEOUT).unwrap(),
            udp_ask(sa(IP, 53), TIMEOUT).unwrap(),
            udp_connected_ask(sa(IP, 53), TIMEOUT).unwrap(),
        )
    });
    assert_answered_as_the_cluster_ip(&pods, IP.into(), [&tcp, &udp, &udp_conn]);
    assert!(h.counter("translated") >= 3);

    // The operator's view: `kpr services` lists the service port and its backends.
    let (text, line) = kpr_services(&h, "10.96.0.10:80/TCP");
    for i in 0..3 {
        assert!(line.contains(&format!("{}:{POD_PORT}", h.topology.pods[i].ip)), "{line}");
    }
    assert!(text.contains("translated"), "{text}");
    // Each connect() counted for the endpoint it reached (the unconnected datagram is not).
    let ip_of = |name: &str| h.topology.pods[(0..3).find(|&i| h.pod_name(i) == name).unwrap()].ip;
    let mut want: BTreeMap<String, u32> =
        (0..3).flat_map(|i| ["TCP", "UDP"].map(|p| (format!("{}:{POD_PORT}/{p}", h.topology.pods[i].ip), 0))).collect();
    *want.get_mut(&format!("{}:{POD_PORT}/TCP", ip_of(&tcp.0))).unwrap() += 1;
    *want.get_mut(&format!("{}:{POD_PORT}/UDP", ip_of(&udp_conn.0))).unwrap() += 1;
    for (endpoint, connects) in want {
        let line = format!("  {endpoint}  flows 0 connects {connects} ");
        assert!(text.lines().any(|l| l.starts_with(&line)), "{line:?} in:\n{text}");
    }
}

#[test]
fn new_connections_spread_uniformly_over_three_backends() {
    let h = setup("kt-spread", &["pod-a", "pod-b", "pod-c"]);
    const N: usize = 900;
    let seen = tcp_spread(&h, N);
    assert_eq!(seen.len(), 3, "every backend answers: {seen:?}");
    // Chi-square against uniform, 2 degrees of freedom: 18.4 is exceeded by chance with
    // probability 1e-4; a biased pick (e.g. always slot 0, or 50/25/25) is far above it.
    let expected = N as f64 / 3.0;
    let chi2: f64 = seen.values().map(|&o| (o as f64 - expected).powi(2) / expected).sum();
    assert!(chi2 < 18.4, "not uniform: {seen:?} (chi-square {chi2:.1})");
}

#[test]
fn endpoint_changes_steer_new_connections_and_keep_established_ones() {
    let h = setup("kt-change", &["pod-a", "pod-b", "pod-c"]);
    let (first, mut conn) = open_connection(&h);
    let gone = (0..3).find(|&i| h.pod_name(i) == first).unwrap();
    let remaining: Vec<usize> = (0..3).filter(|&i| i != gone).collect();

    h.write_endpoints("web", &[HTTP, DNS], &remaining).unwrap();
    h.wait("10.96.0.10:80/TCP", Some(2)).unwrap();
    let seen = tcp_spread(&h, 60);
    assert!(!seen.contains_key(&first), "removed endpoint {first} still gets new connections: {seen:?}");
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_echoes(&mut conn, "still-here");

    h.write_endpoints("web", &[HTTP, DNS], &[0, 1, 2]).unwrap();
    h.wait("10.96.0.10:80/TCP", Some(3)).unwrap();
    let seen = tcp_spread(&h, 90);
    assert!(seen.contains_key(&first), "re-added endpoint gets new connections: {seen:?}");
    assert_echoes(&mut conn, "and-still-here");
}

#[test]
fn a_service_without_endpoints_refuses_connections() {
    let h = setup("kt-refuse", &["pod-a"]);
    h.write_endpoints("web", &[HTTP, DNS], &[]).unwrap();
    h.wait("10.96.0.10:80/TCP", Some(0)).unwrap();
    h.wait("10.96.0.10:53/UDP", Some(0)).unwrap();
    let (tcp, udp, udp_connect) = h.client(|| {
        let tcp = TcpStream::connect_timeout(&sa(IP, 80).into(), TIMEOUT).map(drop);
        let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
        let udp = socket.send_to(b"x", sa(IP, 53)).map(drop);
        let udp_connect = UdpSocket::bind("0.0.0.0:0").unwrap().connect(sa(IP, 53));
        (tcp, udp, udp_connect)
    });
    assert_eq!(tcp.unwrap_err().kind(), ErrorKind::ConnectionRefused, "TCP connect");
    assert_eq!(udp.unwrap_err().kind(), ErrorKind::ConnectionRefused, "UDP sendto");
    assert_eq!(udp_connect.unwrap_err().kind(), ErrorKind::ConnectionRefused, "UDP connect");
    assert!(h.counter("no_backends_rejected") >= 3);
}

#[test]
fn a_deleted_service_is_no_longer_translated_and_other_traffic_is_untouched() {
    let h = setup("kt-delete", &["pod-a"]);
    let pod_ip = h.topology.pods[0].ip;
    let before = h.counter("translated");
    let (name, peer) = h.client(move || tcp_ask(sa(pod_ip, POD_PORT), TIMEOUT).unwrap());
    assert_eq!(name, "pod-a");
    assert_eq!(peer, SocketAddr::from(sa(pod_ip, POD_PORT)), "direct traffic keeps its address");
    assert_eq!(h.counter("translated"), before, "a non-service connect is not translated");

    h.remove("web-svc.yaml").unwrap();
    h.wait("10.96.0.10:80/TCP", None).unwrap();
    let err = h.client(|| TcpStream::connect_timeout(&sa(IP, 80).into(), TIMEOUT).map(drop)).unwrap_err();
    // The node namespace has no route to the service range: untranslated, the connect fails
    // locally instead of reaching a pod.
    assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");
}

/// The cluster's service range is refused by default (as kube-proxy's nftables mode does), in
/// iptables mode too; `--pass-service-range` leaves it to routing, as iptables mode does.
#[test]
fn the_service_range_is_refused_unless_passed_to_routing() {
    let mut h = setup("kt-range", &["pod-a"]);
    h.write(
        "range.yaml",
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16]}\n",
    )
    .unwrap();
    let connect = |h: &Harness, ip: Ipv4Addr, port: u16| {
        h.client(move || TcpStream::connect_timeout(&sa(ip, port).into(), TIMEOUT).map(drop)).unwrap_err()
    };
    // Until the agent has the range, the address is passed to routing (ENETUNREACH here).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let unknown_port = loop {
        let err = connect(&h, IP, 81);
        if err.raw_os_error() != Some(libc::ENETUNREACH) || std::time::Instant::now() > deadline {
            break err;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(unknown_port.raw_os_error(), Some(libc::ECONNREFUSED), "unknown port of a ClusterIP: {unknown_port}");
    let unallocated = connect(&h, Ipv4Addr::new(10, 96, 0, 99), 80);
    assert_eq!(unallocated.raw_os_error(), Some(libc::EPERM), "unallocated address: {unallocated}");
    let outside = connect(&h, Ipv4Addr::new(10, 97, 0, 1), 80);
    assert_eq!(outside.raw_os_error(), Some(libc::ENETUNREACH), "outside the range: untouched: {outside}");

    h.kill_agent().unwrap();
    h.agent_args.push("--pass-service-range".into());
    h.start_agent().unwrap();
    h.wait("10.96.0.10:80/TCP", Some(1)).unwrap();
    h.wait("10.96.0.10:0/any", None).unwrap();
    // The node namespace has no route to the service range: untranslated, connect() fails locally.
    for (ip, port) in [(IP, 81), (Ipv4Addr::new(10, 96, 0, 99), 80)] {
        let err = connect(&h, ip, port);
        assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{ip}:{port} passed to routing: {err}");
    }
}

#[test]
fn the_agent_can_be_killed_and_restarted_without_dropping_connections() {
    let mut h = setup("kt-restart", &["pod-a", "pod-b", "pod-c"]);
    let (_, mut conn) = open_connection(&h);
    h.kill_agent().unwrap();
    assert_echoes(&mut conn, "after-kill");
    // The pinned links keep translating while no agent runs.
    assert_eq!(tcp_spread(&h, 30).len(), 3);

    h.start_agent().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(h.agent_running(), "agent restarted on the pinned state");
    assert_echoes(&mut conn, "after-restart");
    let seen = tcp_spread(&h, 60);
    assert_eq!(seen.len(), 3, "new connections still balance: {seen:?}");

    // The restarted agent owns the datapath: a change is applied.
    h.write_endpoints("web", &[HTTP, DNS], &[0]).unwrap();
    h.wait("10.96.0.10:80/TCP", Some(1)).unwrap();
    let seen = tcp_spread(&h, 20);
    assert_eq!(seen.keys().collect::<Vec<_>>(), [&h.pod_name(0)]);
    assert_echoes(&mut conn, "after-change");
}

#[test]
fn malformed_manifests_are_skipped_and_good_services_keep_working() {
    let mut h = Harness::new("kt-bad", &["pod-a"]).unwrap();
    h.write("0-garbage.yaml", "kind: Service\n  this: is: not yaml\n").unwrap();
    h.write(
        "1-bad-ip.yaml",
        &testbed::service_manifest("test", "bad-ip", &[Ipv4Addr::new(10, 96, 0, 20).into()], &[HTTP])
            .replace("10.96.0.20", "10.96.0.300"),
    )
    .unwrap();
    h.write(
        "2-bad-port.yaml",
        &testbed::service_manifest(
            "test",
            "bad-port",
            &[Ipv4Addr::new(10, 96, 0, 21).into()],
            &[("x", 0, "TCP"), ("y", 81, "TCP")],
        ),
    )
    .unwrap();
    h.write_service("web", IP, &[HTTP], &[0]).unwrap();
    h.start_agent().unwrap();
    h.wait("10.96.0.10:80/TCP", Some(1)).unwrap();
    h.wait("10.96.0.21:81/TCP", Some(0)).unwrap();
    let (name, _) = h.client(|| tcp_ask(sa(IP, 80), TIMEOUT).unwrap());
    assert_eq!(name, "pod-a");
    assert!(h.agent_running());
    let log = std::fs::read_to_string(h.log_path()).unwrap();
    assert!(log.contains("0-garbage.yaml"), "the bad file is named in the log:\n{log}");
    assert!(log.contains("test/bad-ip") && log.contains("10.96.0.300"), "the bad object is named:\n{log}");
}

/// Reverse-translation entries, in the pinned map.
fn revnat_entries(h: &Harness) -> usize {
    let path = kpr::datapath::bpf::pin_dir(&h.pin_root).join(proxy_common::map_names::SOCK_REVNAT);
    let map = aya::maps::MapData::from_pin(path).unwrap();
    let map: aya::maps::HashMap<_, proxy_common::SockRevNatKey, proxy_common::SockRevNatValue> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(map)).unwrap();
    map.keys().filter(Result::is_ok).count()
}

#[test]
fn closed_sockets_leave_no_reverse_translation_behind() {
    let h = setup("kt-release", &["pod-a"]);
    let before = revnat_entries(&h);
    let (_, mut open) = open_connection(&h);
    assert_eq!(revnat_entries(&h), before + 1, "an open connection has its entry");
    let seen = tcp_spread(&h, 200);
    assert_eq!(seen.values().sum::<usize>(), 200);
    assert_eq!(revnat_entries(&h), before + 1, "the 200 closed connections left nothing behind");
    assert_echoes(&mut open, "open-one");
    drop(open);
    assert_eq!(revnat_entries(&h), before, "and the last one goes when it closes");
}

#[test]
fn an_unconnected_udp_socket_stays_on_one_endpoint_while_it_lasts() {
    let h = setup("kt-udpstick", &["pod-a", "pod-b", "pod-c"]);
    // One socket, many datagrams (a QUIC or WireGuard exchange): one endpoint answers them all,
    // as behind kube-proxy, where the flow's conntrack entry keeps it on one endpoint.
    let socket = udp_client(&h);
    let ask_cluster_ip = |socket: &UdpSocket| -> String {
        let (name, from) = ask(socket);
        assert_eq!(from, SocketAddr::from(sa(IP, 53)), "answers come from the ClusterIP");
        name
    };
    let answers: std::collections::BTreeSet<String> = (0..30).map(|_| ask_cluster_ip(&socket)).collect();
    assert_eq!(answers.len(), 1, "one socket, one endpoint: {answers:?}");
    // Other sockets still spread.
    let others: std::collections::BTreeSet<String> =
        h.client(|| (0..60).map(|_| udp_ask(sa(IP, 53), TIMEOUT).unwrap().0).collect());
    assert_eq!(others.len(), 3, "{others:?}");
    // Its endpoint goes away: the socket's next datagram goes to one that is left, and stays.
    let first = answers.into_iter().next().unwrap();
    let gone = (0..3).find(|&i| h.pod_name(i) == first).unwrap();
    let remaining: Vec<usize> = (0..3).filter(|&i| i != gone).collect();
    h.write_endpoints("web", &[HTTP, DNS], &remaining).unwrap();
    h.wait("10.96.0.10:53/UDP", Some(2)).unwrap();
    // The agent forgets what the socket kept (the programs can tell a gone endpoint only in a
    // service of at most 64): no pick of the socket path points at the removed pod.
    let gone_ip = proxy_common::Addr::from(std::net::IpAddr::from(h.topology.pods[gone].ip));
    let picks_path = kpr::datapath::bpf::pin_dir(&h.pin_root).join(proxy_common::map_names::SOCK_PICKS);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let picks: aya::maps::HashMap<_, proxy_common::SockRevNatKey, proxy_common::Backend> =
            aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(
                aya::maps::MapData::from_pin(&picks_path).unwrap(),
            ))
            .unwrap();
        if !picks.iter().filter_map(Result::ok).any(|(_, b)| b.addr == gone_ip) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "a socket still keeps the removed endpoint {first}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let after: std::collections::BTreeSet<String> = (0..20).map(|_| ask_cluster_ip(&socket)).collect();
    assert_eq!(after.len(), 1, "{after:?}");
    assert!(!after.contains(&first), "the removed endpoint {first} no longer answers");
}

/// An unconnected UDP socket of the node namespace that has sent to the ClusterIP's DNS port:
/// `ask` sends again and returns who answered and from where.
fn udp_client(h: &Harness) -> UdpSocket {
    h.client(|| {
        let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
        socket.set_read_timeout(Some(TIMEOUT)).unwrap();
        socket
    })
}

fn ask(socket: &UdpSocket) -> (String, SocketAddr) {
    socket.send_to(b"who", sa(IP, 53)).unwrap();
    let mut buf = [0u8; 256];
    let (n, from) = socket.recv_from(&mut buf).unwrap();
    (String::from_utf8_lossy(&buf[..n]).into_owned(), from)
}

/// `n` unconnected UDP sockets of pod `pod`'s namespace, each sending one datagram to the
/// ClusterIP (the pods have no route to each other: what matters is the entry each leaves),
/// closed one after the other, or all kept open.
fn udp_senders(h: &Harness, pod: usize, n: usize, keep: bool) -> Vec<UdpSocket> {
    h.topology.pods[pod]
        .netns
        .run(move || {
            let mut kept = Vec::new();
            for _ in 0..n {
                let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
                let _ = socket.send_to(b"who", sa(IP, 53));
                if keep {
                    kept.push(socket);
                }
            }
            kept
        })
        .unwrap()
}

/// One pod sending from 20,000 short-lived sockets, more than the table holds (a resolver
/// opens a socket per query). Its entries go as its sockets close, and another pod's
/// unconnected client keeps its own. (Before the slots, the closed sockets left 3,873 entries
/// in a table of 4,096, the LRU evicted the other client's, and its next datagram went to
/// another endpoint.)
#[test]
fn one_pods_sockets_cannot_take_another_pods_reverse_translation() {
    let mut h = Harness::new("kt-share", &["pod-a", "pod-b", "pod-c"]).expect("harness");
    h.write_service("web", IP, &[HTTP, DNS], &[0, 1]).unwrap();
    h.agent_args = vec!["--max-sock-revnat=4096".into()];
    h.start_agent().unwrap();
    h.wait("10.96.0.10:53/UDP", Some(2)).unwrap();
    let victim = udp_client(&h);
    let (first, from) = ask(&victim);
    assert_eq!(from, SocketAddr::from(sa(IP, 53)));
    let baseline = revnat_entries(&h);

    udp_senders(&h, 2, 20_000, false);
    assert_eq!(revnat_entries(&h), baseline, "the closed sockets' entries went with them");
    assert_eq!(ask(&victim), (first.clone(), sa(IP, 53).into()), "the other pod's client keeps its entry");

    // Open sockets: the pod holds at most its share (a sixteenth: 256), the rest of its sockets
    // are translated without entries (no per-packet path covers it here), and counted.
    let over = h.counter("sock_over_quota");
    let held = udp_senders(&h, 2, 300, true);
    assert_eq!(revnat_entries(&h), baseline + 256, "one pod holds its share, no more");
    assert_eq!(h.counter("sock_over_quota") - over, 300 - 256);
    assert_eq!(ask(&victim), (first, sa(IP, 53).into()));
    drop(held);
    assert_eq!(revnat_entries(&h), baseline, "its share is back once its sockets close");
    let again = udp_senders(&h, 2, 10, true);
    assert_eq!(revnat_entries(&h), baseline + 10, "and its new sockets are counted from there");
    drop(again);
}

/// The node's total in `KPR_SOCK_QUOTA`: the entries the socket path counts as held.
fn counted_entries(h: &Harness) -> i64 {
    let path = kpr::datapath::bpf::pin_dir(&h.pin_root).join(proxy_common::map_names::SOCK_QUOTA);
    let map: aya::maps::HashMap<_, u64, u64> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(aya::maps::MapData::from_pin(path).unwrap())).unwrap();
    map.get(&proxy_common::SOCK_QUOTA_TOTAL, 0).map_or(0, |n| n as i64)
}

/// A TCP socket's one entry is found by its peer when it closes (no slot), also when its
/// connection was refused; a connected UDP socket that connects again keeps one slot. Nothing
/// stays counted once they are closed.
#[test]
fn refused_and_reconnected_sockets_give_their_entries_back() {
    let h = setup("kt-giveback", &["pod-a"]);
    // A Service whose endpoint has nothing listening on its port: the pod answers with a reset.
    const CLOSED: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
    h.write("closed-svc.yaml", &testbed::service_manifest("test", "closed", &[CLOSED.into()], &[("x", 81, "TCP")]))
        .unwrap();
    let pod_a = std::net::IpAddr::from(h.topology.pods[0].ip);
    h.write("closed-slice.yaml", &testbed::slice_manifest("test", "closed", "closed-1", &[pod_a], &[("x", 9, "TCP")]))
        .unwrap();
    h.wait("10.96.0.11:81/TCP", Some(1)).unwrap();
    let (entries, counted) = (revnat_entries(&h), counted_entries(&h));
    let refused = h.client(|| {
        (0..5)
            .map(|_| TcpStream::connect_timeout(&sa(CLOSED, 81).into(), TIMEOUT).map(drop).map_err(|e| e.kind()))
            .collect::<Vec<_>>()
    });
    assert_eq!(refused, vec![Err(ErrorKind::ConnectionRefused); 5]);
    h.client(|| {
        let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
        socket.connect(sa(IP, 53)).unwrap();
        socket.connect(sa(IP, 53)).unwrap();
    });
    let (_, mut open) = open_connection(&h);
    assert_eq!((revnat_entries(&h), counted_entries(&h)), (entries + 1, counted + 1), "only the open connection");
    assert_echoes(&mut open, "open");
    drop(open);
    assert_eq!((revnat_entries(&h), counted_entries(&h)), (entries, counted));
    // A refused connect retried on the same socket, to another Service: one entry, counted
    // once, the refused one's gone.
    let retried = h.client(|| {
        use socket2::{Domain, Socket, Type};
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        let refused = socket.connect(&SocketAddr::from(sa(CLOSED, 81)).into()).map_err(|e| e.kind());
        socket.connect(&SocketAddr::from(sa(IP, 80)).into()).unwrap();
        let peer = socket.peer_addr().unwrap().as_socket().unwrap();
        (refused, peer, TcpStream::from(socket))
    });
    assert_eq!((retried.0, retried.1), (Err(ErrorKind::ConnectionRefused), SocketAddr::from(sa(IP, 80))));
    assert_eq!((revnat_entries(&h), counted_entries(&h)), (entries + 1, counted + 1), "one entry for the socket");
    drop(retried);
    assert_eq!((revnat_entries(&h), counted_entries(&h)), (entries, counted));
}

/// Over its namespace's share, a socket's datagrams still reach an endpoint; where no
/// per-packet path covers the socket they are translated without an entry (its answers then
/// show the endpoint's address, for that namespace's sockets only) and still go to one
/// endpoint per socket. A socket that sends to the same service again takes no second entry;
/// a TCP connection takes one while it is open. The node is bound by the table's limit only.
#[test]
fn a_namespace_over_its_share_is_still_served() {
    for node in [false, true] {
        let mut h = Harness::new("kt-over", &["pod-a", "pod-b", "pod-c"]).expect("harness");
        h.write_service("web", IP, &[HTTP, DNS], &[0, 1, 2]).unwrap();
        h.agent_args = vec!["--max-sock-revnat=4096".into(), "--max-sock-revnat-per-pod=4".into()];
        // In the node's namespace, the client's sockets are the node's.
        h.agent_in_node_netns = node;
        h.start_agent().unwrap();
        h.wait("10.96.0.10:53/UDP", Some(3)).unwrap();
        let cluster_ip = SocketAddr::from(sa(IP, 53));
        let pods: BTreeMap<String, SocketAddr> =
            h.topology.pods.iter().map(|p| (p.name.clone(), SocketAddr::from(sa(p.ip, POD_PORT)))).collect();
        let (_, mut tcp) = open_connection(&h);
        let sockets: Vec<UdpSocket> = (0..5).map(|_| udp_client(&h)).collect();
        // Each socket five times: one endpoint each, answering from the ClusterIP, or (the
        // pod's last two sockets) from its own address.
        let from: Vec<SocketAddr> = sockets
            .iter()
            .map(|socket| {
                let answers: BTreeSet<(String, SocketAddr)> = (0..5).map(|_| ask(socket)).collect();
                assert_eq!(answers.len(), 1, "one endpoint a socket: {answers:?}");
                let (name, from) = answers.into_iter().next().unwrap();
                assert!(from == cluster_ip || from == pods[&name], "{name} answered from {from}");
                from
            })
            .collect();
        let over = if node { 0 } else { 2 };
        let want: Vec<bool> = (0..5).map(|i| i < 5 - over).collect();
        assert_eq!(from.iter().map(|f| *f == cluster_ip).collect::<Vec<_>>(), want, "node: {node}");
        assert_eq!(h.counter("sock_over_quota"), 5 * over as u64, "node: {node}");
        assert_echoes(&mut tcp, "still-open");
        drop(tcp);
        let fresh = udp_client(&h);
        assert_eq!(ask(&fresh).1, cluster_ip, "a closed connection gives its entry back");
    }
}

/// kpr's socket programs attached to `cgroup` (bpftool's view).
fn kpr_hooks_on(cgroup: &std::path::Path) -> usize {
    let out = std::process::Command::new("bpftool").args(["cgroup", "show"]).arg(cgroup).output().unwrap();
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains("kpr_")).count()
}

#[test]
fn restarts_reconcile_pinned_hooks_with_the_layout_and_the_cgroup() {
    let mut h = setup("kt-relink", &["pod-a"]);
    let hooks = kpr_hooks_on(&h.cgroup.path);
    assert!(hooks >= 4, "connect4, sendmsg4, recvmsg4, getpeername4 (and sock_release): {hooks}");

    // An upgrade to a new pin layout: the old version's links must not keep running first on
    // maps nobody updates. (The current pins, renamed, play the old version.)
    h.kill_agent().unwrap();
    let current = kpr::datapath::bpf::pin_dir(&h.pin_root);
    let old = h.pin_root.join("v1");
    std::fs::rename(&current, &old).unwrap();
    h.start_agent().unwrap();
    h.wait("10.96.0.10:80/TCP", Some(1)).unwrap();
    // Once the new agent's first sync is written.
    let deadline = std::time::Instant::now() + testbed::slow(TIMEOUT);
    while old.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!old.exists(), "the old layout's pins are removed");
    assert_eq!(kpr_hooks_on(&h.cgroup.path), hooks, "one set of hooks, not two");
    assert_eq!(tcp_spread(&h, 10).len(), 1);

    // A restart with another --cgroup moves the hooks there.
    h.kill_agent().unwrap();
    let other = testbed::Cgroup::new(&format!("{}-b", h.name)).unwrap();
    h.agent_cgroup = Some(other.path.clone());
    h.start_agent().unwrap();
    let deadline = std::time::Instant::now() + testbed::slow(AGENT_START);
    while kpr_hooks_on(&other.path) < hooks && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(kpr_hooks_on(&other.path), hooks, "the hooks are on the new cgroup");
    assert_eq!(kpr_hooks_on(&h.cgroup.path), 0, "and no longer on the old one");
    h.kill_agent().unwrap();
}

/// How long a restarted agent may take to load and attach its programs before it acts: a
/// debug build's load takes 2–3 s on a busy 2-core machine (seen over 2 s in CI).
const AGENT_START: Duration = Duration::from_secs(15);

/// Replace the map pinned as `name` in `dir` with a new one of the given bpftool shape.
fn replace_pin(dir: &std::path::Path, name: &str, shape: &[&str]) {
    let path = dir.join(name);
    std::fs::remove_file(&path).unwrap();
    let created = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(&path)
        .args(shape)
        .args(["name", name])
        .status()
        .unwrap();
    assert!(created.success());
}

/// An upgrade from the previous pin layout carries its maps over, but one that reads otherwise
/// than this layout's (an affinity map of other sizes) is made anew; and a pinned map of this
/// very layout that a build changed without a new layout version (a counter more) is made anew
/// too, so the agent starts. (The current pins, renamed, play the previous version's.)
#[test]
fn an_older_layouts_maps_are_carried_and_a_changed_map_made_anew() {
    let mut h = setup("kt-carry", &["pod-a"]);
    let current = kpr::datapath::bpf::pin_dir(&h.pin_root);
    h.kill_agent().unwrap();
    let old = h.pin_root.join(format!("v{}", proxy_common::PIN_LAYOUT_VERSION - 1));
    std::fs::rename(&current, &old).unwrap();
    replace_pin(&old, proxy_common::map_names::AFFINITY, &["type", "hash", "key", "4", "value", "4", "entries", "16"]);
    h.start_agent().unwrap();
    let deadline = std::time::Instant::now() + testbed::slow(AGENT_START);
    while old.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!old.exists(), "the old layout's pins are removed: {}", std::fs::read_to_string(h.log_path()).unwrap());
    let log = std::fs::read_to_string(h.log_path()).unwrap();
    assert!(log.contains("carrying over an older layout's maps"), "{log}");
    assert!(log.contains("an older layout's map differs from this one's: made anew map=KPR_AFFINITY"), "{log}");
    assert_eq!(tcp_spread(&h, 10).len(), 1, "served on the carried maps");

    // A pinned map of this very layout that a build changed without a new layout version (a
    // counter more): the agent still starts, on the map made anew.
    h.kill_agent().unwrap();
    let counters = ["type", "percpu_array", "key", "4", "value", "8", "entries", "3"];
    replace_pin(&current, proxy_common::map_names::COUNTERS, &counters);
    h.start_agent().unwrap();
    let made_anew = "a pinned map differs from this build's: made anew map=KPR_COUNTERS";
    let deadline = std::time::Instant::now() + testbed::slow(AGENT_START);
    let mut log = String::new();
    while !log.contains(made_anew) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        log = std::fs::read_to_string(h.log_path()).unwrap();
    }
    assert!(log.contains(made_anew), "{log}");
    // The agent is up on the new map once it says so after the warning (under emulation the
    // load takes seconds).
    let attached = |log: &str| log.split(made_anew).nth(1).is_some_and(|after| after.contains("datapath attached"));
    while !attached(&log) && std::time::Instant::now() < deadline + testbed::slow(AGENT_START) {
        std::thread::sleep(Duration::from_millis(50));
        log = std::fs::read_to_string(h.log_path()).unwrap();
    }
    assert!(attached(&log), "{log}");
    h.wait("10.96.0.10:80/TCP", Some(1)).unwrap();
    assert_eq!(tcp_spread(&h, 10).len(), 1);
    assert!(h.counter("translated") >= 10, "counted in the new map");

    h.kill_agent().unwrap();
}

/// A node address with its real owner listening (the API server, say), a Service `web` that
/// claims it as an externalIP (CVE-2020-8554) with pod-a behind it, and the agent started as
/// `own_cgroup` says, in the node's namespace. Returns the address.
fn external_ip_takeover(h: &mut Harness, own_cgroup: bool) -> (Ipv4Addr, testbed::NameServer) {
    const OWNED: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
    h.topology.client.ip(&["addr", "add", &format!("{OWNED}/32"), "dev", "lo"]).unwrap();
    let owner = testbed::NameServer::tcp(&h.topology.client, sa(OWNED, 80), "owner").unwrap();
    start_with_external_ip(h, OWNED, own_cgroup);
    h.wait(&format!("{OWNED}:80/TCP node"), Some(1)).unwrap();
    (OWNED, owner)
}

/// The Service `web` with pod-a behind it, claiming `addr` as an externalIP, and the agent
/// started in the node's namespace (alone in its cgroup with `own_cgroup`, as a DaemonSet).
fn start_with_external_ip(h: &mut Harness, addr: Ipv4Addr, own_cgroup: bool) {
    let manifest = testbed::service_manifest("test", "web", &[IP.into()], &[HTTP])
        .replace("  ports:\n", &format!("  externalIPs: [{addr}]\n  ports:\n"));
    h.write("web-svc.yaml", &manifest).unwrap();
    h.write_endpoints("web", &[HTTP], &[0]).unwrap();
    h.agent_in_node_netns = true;
    h.agent_own_cgroup = own_cgroup;
    h.start_agent().unwrap();
}

/// Who answers 4 TCP connections to `addr`:80 from a process in `cgroup` on the node.
fn answers_from(h: &Harness, cgroup: &std::path::Path, addr: Ipv4Addr) -> BTreeMap<String, usize> {
    use kpr_tests::probe::{Kind, probe_in};
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kpr-probe"));
    probe_in(&exe, &h.topology.client.name, cgroup, Kind::Tcp, sa(addr, 80), 4, TIMEOUT).unwrap().answers
}

fn four(name: &str) -> BTreeMap<String, usize> {
    BTreeMap::from([(name.to_owned(), 4)])
}

#[test]
fn the_agents_own_sockets_are_not_taken_over_by_an_external_ip() {
    // The agent as a DaemonSet runs it: alone in its container's cgroup.
    let mut h = Harness::new("kt-agentx", &["pod-a"]).unwrap();
    let (owned, _owner) = external_ip_takeover(&mut h, true);
    let agent_home = h.agent_home.as_ref().unwrap().path.clone();
    // Everyone else on the node is sent to the Service's endpoints, as kube-proxy does.
    assert_eq!(answers_from(&h, &h.cgroup.path, owned), four("pod-a"));
    // The agent's own cgroup reaches the address's owner, and still gets ClusterIPs translated.
    assert_eq!(answers_from(&h, &agent_home, owned), four("owner"));
    assert_eq!(answers_from(&h, &agent_home, IP), four("pod-a"));
    assert_eq!(h.counter("sock_agent_exempt"), 4);
}

/// A kubelet-like process on the node talks to its API server at another machine's address,
/// which a Service claims as an externalIP (CVE-2020-8554). By default, as kube-proxy does,
/// the node's connections to it go to the Service's endpoint; with `--host-external-ips
/// local` they reach the API server, while a pod still gets the Service.
#[test]
fn host_external_ips_local_keeps_the_nodes_connections_to_other_machines() {
    const REMOTE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
    for (args, node_reaches) in [(&[][..], "pod-a"), (&["--host-external-ips", "local"][..], "apiserver")] {
        let mut h = Harness::new("kt-hostext", &["pod-a", "apiserver"]).unwrap();
        // The API server: another machine (here the second pod's namespace), routed to.
        let api = &h.topology.pods[1];
        api.netns.ip(&["addr", "add", &format!("{REMOTE}/32"), "dev", "eth0"]).unwrap();
        let _apiserver = testbed::NameServer::tcp(&api.netns, sa(REMOTE, 80), "apiserver").unwrap();
        h.topology.client.ip(&["route", "add", &format!("{REMOTE}/32"), "via", &api.ip.to_string()]).unwrap();
        h.agent_args = args.iter().map(|a| (*a).to_owned()).collect();
        start_with_external_ip(&mut h, REMOTE, true);
        h.wait(&format!("{REMOTE}:80/TCP"), Some(1)).unwrap();
        // The kubelet-like process: on the node, in the cgroup the socket hooks cover.
        assert_eq!(answers_from(&h, &h.cgroup.path, REMOTE), four(node_reaches), "{args:?}");
        assert_eq!(answers_from(&h, &h.cgroup.path, IP), four("pod-a"), "the ClusterIP, translated: {args:?}");
        // A pod reaching the externalIP gets the Service either way.
        let (name, _) = h.topology.pods[0].netns.run(move || tcp_ask(sa(REMOTE, 80), TIMEOUT).unwrap()).unwrap();
        assert_eq!(name, "pod-a", "{args:?}");
    }
}

#[test]
fn an_agent_sharing_its_cgroup_exempts_nobody() {
    // An agent sharing its cgroup (a shell's session on a dev node; here the test's):
    // exempting that cgroup would exempt everything else in it.
    let mut h = Harness::new("kt-agentshared", &["pod-a"]).unwrap();
    let (owned, _owner) = external_ip_takeover(&mut h, false);
    assert_eq!(answers_from(&h, &h.cgroup.path, owned), four("pod-a"));
    assert_eq!(h.counter("sock_agent_exempt"), 0);
    let log = std::fs::read_to_string(h.log_path()).unwrap();
    assert!(log.contains("kpr shares its cgroup with other processes"), "{log}");
}

#[test]
fn session_affinity_keeps_a_client_on_its_endpoint_until_it_leaves_or_times_out() {
    let mut h = Harness::new("kt-affinity", &["pod-a", "pod-b", "pod-c"]).unwrap();
    let manifest = testbed::service_manifest("test", "web", &[IP.into()], &[HTTP, DNS]).replace(
        "  ports:\n",
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 1}}\n  ports:\n",
    );
    h.write("web-svc.yaml", &manifest).unwrap();
    h.write_endpoints("web", &[HTTP, DNS], &[0, 1, 2]).unwrap();
    h.start_agent().unwrap();
    h.wait("10.96.0.10:80/TCP", Some(3)).unwrap();
    // Every new connection and every new socket's datagram of this client: one endpoint.
    let first = tcp_spread(&h, 30);
    assert_eq!(first.len(), 1, "{first:?}");
    let endpoint = first.keys().next().unwrap().clone();
    let udp: BTreeMap<String, usize> = h.client(|| {
        let mut seen = BTreeMap::new();
        for _ in 0..10 {
            *seen.entry(udp_ask(sa(IP, 53), TIMEOUT).unwrap().0).or_insert(0) += 1;
        }
        seen
    });
    assert_eq!(udp.len(), 1, "{udp:?}");

    // Its endpoint leaves: balanced anew, and kept.
    let gone = (0..3).find(|&i| h.pod_name(i) == endpoint).unwrap();
    let remaining: Vec<usize> = (0..3).filter(|&i| i != gone).collect();
    h.write_endpoints("web", &[HTTP, DNS], &remaining).unwrap();
    h.wait("10.96.0.10:80/TCP", Some(2)).unwrap();
    let after = tcp_spread(&h, 20);
    assert_eq!(after.len(), 1, "{after:?}");
    assert!(!after.contains_key(&endpoint), "not {endpoint}, which left");

    // Idle past timeoutSeconds: balanced anew each time (both endpoints over twenty rounds;
    // one alone has odds (1/2)^19; twelve rounds, (1/2)^11, once saw one alone in CI).
    let mut seen = BTreeMap::new();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(1100));
        seen.extend(tcp_spread(&h, 1));
    }
    assert_eq!(seen.len(), 2, "the affinity never timed out: {seen:?}");
}

#[test]
fn a_connected_udp_socket_whose_endpoint_leaves_is_aborted_and_reconnects_elsewhere() {
    let h = setup("kt-udpabort", &["pod-a", "pod-b"]);
    let ask = |socket: &UdpSocket| -> std::io::Result<String> {
        socket.send(b"who")?;
        let mut buf = [0u8; 64];
        let n = socket.recv(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    };
    // One connected socket on each endpoint (a resolver's socket, say).
    let mut sockets: BTreeMap<String, UdpSocket> = BTreeMap::new();
    for _ in 0..64 {
        let socket = h.client(|| {
            let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
            socket.connect(sa(IP, 53)).unwrap();
            socket.set_read_timeout(Some(TIMEOUT)).unwrap();
            socket
        });
        sockets.entry(ask(&socket).unwrap()).or_insert(socket);
        if sockets.len() == 2 {
            break;
        }
    }
    let [(gone, doomed), (stays, kept)]: [(String, UdpSocket); 2] =
        sockets.into_iter().collect::<Vec<_>>().try_into().expect("a socket on each endpoint");

    let remaining = (0..2).find(|&i| h.pod_name(i) == stays).unwrap();
    h.write_endpoints("web", &[HTTP, DNS], &[remaining]).unwrap();
    let removed = std::time::Instant::now();
    // The socket on the endpoint that left (which still runs) is aborted as the agent applies
    // the change: it fails within a second, and not with an answer from the old endpoint
    // after the first failure.
    let error = loop {
        match ask(&doomed) {
            Ok(name) => assert_eq!(name, gone, "before the abort it still talks to its endpoint"),
            Err(e) => break e,
        }
        assert!(removed.elapsed() < testbed::slow(Duration::from_secs(1)), "never aborted");
        std::thread::sleep(Duration::from_millis(10));
    };
    let kinds = [Some(libc::ECONNABORTED), Some(libc::EDESTADDRREQ)];
    assert!(kinds.contains(&error.raw_os_error()), "aborted, not {error}");
    println!("aborted {:?} after the endpoint was removed", removed.elapsed());
    // Connecting again reaches the endpoint that is left; the other socket never noticed.
    doomed.connect(sa(IP, 53)).unwrap();
    // What the socket holds from before (the abort's error, reported once; an answer of the
    // old endpoint that came in while the socket was unconnected) is read away first, as a
    // resolver discards answers to queries it no longer waits for.
    doomed.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 64];
    while !doomed.recv(&mut buf).is_err_and(|e| e.kind() == ErrorKind::WouldBlock) {}
    doomed.set_nonblocking(false).unwrap();
    assert_eq!(ask(&doomed).unwrap(), stays);
    assert_eq!(ask(&kept).unwrap(), stays);
}

const IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);

/// An IPv6 client reaches an IPv6-only Service: TCP, unconnected and connected UDP each reach
/// a backend over IPv6, and the application sees the ClusterIP as its peer.
#[test]
fn an_ipv6_cluster_ip_is_balanced_and_the_app_sees_the_cluster_ip() {
    let mut h = Harness::new("kt-v6", &["pod-a", "pod-b", "pod-c"]).unwrap();
    h.write_service_ips("web", &[IP6.into()], &[HTTP, DNS], &[0, 1, 2]).unwrap();
    h.start_agent().unwrap();
    h.wait("[fd00:96::10]:80/TCP", Some(3)).unwrap();
    h.wait("[fd00:96::10]:53/UDP", Some(3)).unwrap();
    let pods: Vec<String> = (0..3).map(|i| h.pod_name(i)).collect();
    let (tcp, udp, udp_conn, peer) = h.client(|| {
        (
            tcp_ask(sa6(IP6, 80), TIMEOUT).unwrap(),
            udp_ask(sa6(IP6, 53), TIMEOUT).unwrap(),
            udp_connected_ask(sa6(IP6, 53), TIMEOUT).unwrap(),
            testbed::tcp_ask_peer(sa6(IP6, 80), TIMEOUT).unwrap(),
        )
    });
    assert_answered_as_the_cluster_ip(&pods, IP6.into(), [&tcp, &udp, &udp_conn]);
    // The backend sees the node's own IPv6 address on the pod's link (no masquerade).
    let pod = (0..3).find(|&i| h.pod_name(i) == peer.0).unwrap() + 1;
    assert_eq!(peer.1, format!("fd00:10:244:{pod:x}::1"), "source seen by {}", peer.0);

    // Every backend answers new connections.
    let seen: BTreeSet<String> = h.client(|| (0..60).map(|_| tcp_ask(sa6(IP6, 80), TIMEOUT).unwrap().0).collect());
    assert_eq!(seen.len(), 3, "{seen:?}");

    // The operator's view shows the IPv6 frontend and its IPv6 backends.
    let (_, line) = kpr_services(&h, "[fd00:96::10]:80/TCP");
    for i in 0..3 {
        assert!(line.contains(&format!("[{}]:{POD_PORT}", h.topology.pods[i].ip6)), "{line}");
    }

    // Without IPv6 endpoints the IPv6 ClusterIP refuses (kube-proxy's REJECT).
    h.write_endpoints_of("web", true, &[HTTP, DNS], &[]).unwrap();
    h.wait("[fd00:96::10]:80/TCP", Some(0)).unwrap();
    let refused = h.client(|| std::net::TcpStream::connect_timeout(&sa6(IP6, 80).into(), TIMEOUT).map(|_| ()));
    assert_eq!(refused.unwrap_err().kind(), ErrorKind::ConnectionRefused);
}

/// A dual-stack Service (PreferDualStack) from one client: over IPv4 to IPv4 endpoints, over
/// IPv6 to IPv6 endpoints, each family with its own EndpointSlice (kube-proxy's proxier per
/// family); and an IPv6 socket naming the IPv4 ClusterIP IPv4-mapped (`::ffff:10.96.0.10`)
/// is balanced like an IPv4 one and still sees the mapped ClusterIP as its peer.
#[test]
fn a_dual_stack_service_is_reached_over_both_families_and_through_mapped_addresses() {
    let mut h = Harness::new("kt-dual", &["pod-a", "pod-b", "pod-c"]).unwrap();
    h.write_service_ips("web", &[IP.into(), IP6.into()], &[HTTP, DNS], &[0, 1, 2]).unwrap();
    // The IPv6 slice has pod-c only: each family balances over its own endpoints.
    h.write_endpoints_of("web", true, &[HTTP, DNS], &[2]).unwrap();
    h.start_agent().unwrap();
    h.wait("10.96.0.10:80/TCP", Some(3)).unwrap();
    h.wait("[fd00:96::10]:80/TCP", Some(1)).unwrap();
    let mapped = IP.to_ipv6_mapped();
    let (v4, v6, via_mapped, mapped_peer, mapped_udp, mapped_source) = h.client(move || {
        let names =
            |addr: SocketAddr| -> BTreeSet<String> { (0..60).map(|_| tcp_ask(addr, TIMEOUT).unwrap().0).collect() };
        let (_, mapped_peer) = tcp_ask(sa6(mapped, 80), TIMEOUT).unwrap();
        let mapped_udp = udp_ask(sa6(mapped, 53), TIMEOUT).unwrap();
        let (_, source) = testbed::tcp_ask_peer(sa6(mapped, 80), TIMEOUT).unwrap();
        (
            names(sa(IP, 80).into()),
            names(sa6(IP6, 80).into()),
            names(sa6(mapped, 80).into()),
            mapped_peer,
            mapped_udp,
            source,
        )
    });
    let all: BTreeSet<String> = (0..3).map(|i| h.pod_name(i)).collect();
    assert_eq!(v4, all, "IPv4 reaches every IPv4 endpoint");
    assert_eq!(v6, BTreeSet::from([h.pod_name(2)]), "IPv6 reaches the IPv6 slice's endpoint only");
    assert_eq!(via_mapped, all, "a mapped IPv4 ClusterIP is balanced over the IPv4 endpoints");
    assert_eq!(mapped_peer, SocketAddr::from(sa6(mapped, 80)), "getpeername shows the mapped ClusterIP");
    assert!(all.contains(&mapped_udp.0), "UDP through the mapped ClusterIP answered by {}", mapped_udp.0);
    assert_eq!(mapped_udp.1, SocketAddr::from(sa6(mapped, 53)), "recvfrom shows the mapped ClusterIP");
    assert!(mapped_source.starts_with("10.244."), "the backend saw an IPv4 client: {mapped_source}");
}

/// NodePorts from the node's own sockets, per family (the agent in the node's namespace learns
/// its addresses): a dual-stack Service's NodePort answers on the node's IPv4 and IPv6
/// addresses and on 127.0.0.1 (localhostNodePorts), never on `::1` (kube-proxy offers none);
/// a single-stack IPv4 Service has no NodePort on the IPv6 addresses.
#[test]
fn node_ports_are_served_per_family_and_not_on_ipv6_localhost() {
    let mut h = Harness::new("kt-np6", &["pod-a", "pod-b"]).unwrap();
    h.agent_in_node_netns = true;
    let node_port = |name: &str, port: u16, ips: &[&str]| {
        let families = if ips.len() == 2 { "[IPv4, IPv6]" } else { "[IPv4]" };
        let policy = if ips.len() == 2 { "PreferDualStack" } else { "SingleStack" };
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: test}}\nspec:\n  type: NodePort\n  \
             clusterIP: '{}'\n  clusterIPs: [{}]\n  ipFamilies: {families}\n  ipFamilyPolicy: {policy}\n  ports:\n  \
             - {{name: http, port: 80, protocol: TCP, nodePort: {port}}}\n",
            ips[0],
            ips.iter().map(|ip| format!("'{ip}'")).collect::<Vec<_>>().join(", ")
        )
    };
    h.write("np-svc.yaml", &node_port("np", 30080, &["10.96.0.10", "fd00:96::10"])).unwrap();
    h.write_endpoints_of("np", false, &[HTTP], &[0, 1]).unwrap();
    h.write_endpoints_of("np", true, &[HTTP], &[0, 1]).unwrap();
    h.write("np4-svc.yaml", &node_port("np4", 30081, &["10.96.0.11"])).unwrap();
    h.write_endpoints_of("np4", false, &[HTTP], &[0, 1]).unwrap();
    h.start_agent().unwrap();
    h.wait("[*]:30080/TCP node", Some(2)).unwrap();
    h.wait("*:30080/TCP node", Some(2)).unwrap();
    h.wait("*:30081/TCP node", Some(2)).unwrap();
    h.wait("[*]:30081/TCP node", None).unwrap();

    let node4: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 1);
    let node6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 1);
    let pods: BTreeSet<String> = (0..2).map(|i| h.pod_name(i)).collect();
    let ask = |addr: SocketAddr| {
        h.client(move || {
            let answers: BTreeSet<String> =
                (0..20).map(|_| tcp_ask(addr, TIMEOUT).map(|(name, _)| name)).collect::<Result<_, _>>()?;
            Ok::<_, std::io::Error>(answers)
        })
    };
    for addr in [
        SocketAddr::from(sa(node4, 30080)),
        sa6(node6, 30080).into(),
        sa(Ipv4Addr::LOCALHOST, 30080).into(),
        sa(node4, 30081).into(),
    ] {
        assert_eq!(ask(addr).unwrap_or_else(|e| panic!("{addr}: {e}")), pods, "both pods behind {addr}");
    }
    for addr in [SocketAddr::from(sa6(Ipv6Addr::LOCALHOST, 30080)), sa6(node6, 30081).into()] {
        let refused = ask(addr).unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::ConnectionRefused, "{addr}: not a NodePort, nothing listens");
    }
}
