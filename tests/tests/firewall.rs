//! What kpr reads of a node's forward hook (`kpr::source::firewall`): whatever filters forwarded
//! packets there, written as the tools NetworkPolicy engines use write it (iptables-nft,
//! iptables-legacy, ip6tables-legacy, nftables), is found; an empty, accepting chain is not.
//! In a network namespace of the test's own. Needs root.
use std::{
    net::{IpAddr, SocketAddr, UdpSocket},
    time::{Duration, Instant},
};

use kpr::source::firewall::forward_filters;
use kpr_tests::world::{KprAgent, NODE_IP, NODE_IP_ALT, World};
use testbed::Netns;

#[test]
fn every_filter_on_the_forward_hook_is_found_and_nothing_else() {
    let ns = testbed::Netns::new(&testbed::unique_name("kfw")).unwrap();
    let filters = || ns.run(forward_filters).unwrap();
    let step = |script: &str, want: &[&str]| {
        ns.sh(script).unwrap();
        let found = filters();
        assert_eq!(found.len(), want.len(), "after `{script}`: {found:?}");
        for (line, want) in found.iter().zip(want) {
            assert!(line.contains(want), "after `{script}`: {line:?} does not say {want:?}");
        }
    };
    assert_eq!(filters(), Vec::<String>::new(), "a new namespace filters nothing");
    // iptables-nft's FORWARD chain, accepting with no rules (any iptables command makes it).
    step("iptables-nft -P FORWARD ACCEPT", &[]);
    // A NetworkPolicy engine's rule (Calico, kube-router): pod-b's port denied.
    step(
        "iptables-nft -A FORWARD -d 10.244.2.2 -p tcp --dport 8080 -j DROP",
        &["nftables ip filter/FORWARD: 1 rules, policy accept"],
    );
    step(
        "iptables-nft -F FORWARD && iptables-nft -P FORWARD DROP",
        &["nftables ip filter/FORWARD: 0 rules, policy drop"],
    );
    step("iptables-nft -P FORWARD ACCEPT", &[]);
    // nftables of its own (kube-network-policies' inet table).
    step(
        "nft add table inet np && nft add chain inet np policies '{ type filter hook forward priority 0; policy accept; }' && \
         nft add rule inet np policies ip6 daddr fd00::2 drop && nft add rule inet np policies ct state established accept",
        &["nftables inet np/policies: 2 rules, policy accept"],
    );
    // A chain on another hook filters nothing forwarded.
    step(
        "nft delete table inet np && nft add table ip other && \
         nft add chain ip other in '{ type filter hook input priority 0; policy drop; }'",
        &[],
    );
    // The legacy tables: a policy, a rule, and IPv6's table.
    step("iptables-legacy -P FORWARD DROP", &["iptables-legacy filter FORWARD: no rules, policy DROP"]);
    step("iptables-legacy -P FORWARD ACCEPT", &[]);
    step(
        "iptables-legacy -A FORWARD -s 10.244.1.2 -j REJECT",
        &["iptables-legacy filter FORWARD: rules, policy ACCEPT"],
    );
    step(
        "iptables-legacy -F FORWARD && ip6tables-legacy -P FORWARD DROP",
        &["ip6tables-legacy filter FORWARD: no rules, policy DROP"],
    );
    step(
        "ip6tables-legacy -P FORWARD ACCEPT && ip6tables-legacy -A FORWARD -j ACCEPT",
        &["ip6tables-legacy filter FORWARD: rules, policy ACCEPT"],
    );
    step("ip6tables-legacy -F FORWARD", &[]);
}

/// A datagram from `from` (an address of `pod`'s, bound) to `to` reaches `listener`?
fn datagram_reaches(pod: &Netns, from: IpAddr, to: SocketAddr, listener: &UdpSocket, what: &'static str) -> bool {
    pod.run(move || {
        let s = UdpSocket::bind(SocketAddr::new(from, 0)).unwrap();
        s.send_to(what.as_bytes(), to).unwrap();
    })
    .unwrap();
    let mut buf = [0u8; 64];
    // Drain until this datagram or a timeout (an earlier attempt's may arrive late).
    while let Ok((n, _)) = listener.recv_from(&mut buf) {
        if &buf[..n] == what.as_bytes() {
            return true;
        }
    }
    false
}

/// A UDP socket at `addr` in `ns` that gives up reading after 400 ms.
fn recorder(ns: &Netns, addr: SocketAddr) -> UdpSocket {
    let socket = ns.run(move || UdpSocket::bind(addr).unwrap()).unwrap();
    socket.set_read_timeout(Some(Duration::from_millis(400))).unwrap();
    socket
}

/// IPv4 setting `setting` of link `link` of `ns`.
fn conf(ns: &Netns, link: &str, setting: &str) -> String {
    let path = format!("/proc/sys/net/ipv4/conf/{link}/{setting}");
    ns.run(move || std::fs::read_to_string(path).unwrap().trim().to_owned()).unwrap()
}

/// A file removed when dropped (a test's, also when it fails).
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// kpr in `world`'s node on a KubeProxyConfiguration with the pods' range, serving the
/// manifests `objects`, once it has taken the pod link vp0 (accept_local on there).
fn start_kpr(world: &World, tag: &str, objects: &str) -> (RemoveOnDrop, testbed::Cgroup, KprAgent) {
    let config = std::env::temp_dir().join(format!("{tag}.yaml"));
    std::fs::write(
        &config,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: iptables\n\
         hostnameOverride: test-node\nclusterCIDR: 10.0.0.0/8\n",
    )
    .unwrap();
    let cgroup = testbed::Cgroup::new(tag).unwrap();
    let kpr = KprAgent::start(&world.node, &config, &cgroup, tag, &[]);
    testbed::write_atomic(&kpr.manifests, "objects.yaml", objects).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while conf(&world.node, "vp0", "accept_local") != "1" {
        assert!(Instant::now() < deadline, "kpr never served vp0:\n{}", kpr.log_tail());
        std::thread::sleep(Duration::from_millis(100));
    }
    (RemoveOnDrop(config), cgroup, kpr)
}

/// kpr turns `accept_local` on for the pod links it serves (its masqueraded packets carry the
/// node's address through the host stack); the kernel would otherwise drop a packet that arrives
/// with one of the node's addresses as source. A pod must not gain the right to send as the
/// node by it: its datagrams sent from the node's address reach nothing, with kpr as without.
#[test]
fn a_pod_cannot_send_as_the_node_through_kprs_accept_local() {
    let tag = testbed::unique_name("kmar");
    let pod_ip: IpAddr = "10.0.0.2".parse().unwrap();
    let world = World::new(&tag, &[pod_ip], &[80], &[9]).unwrap();
    let pod = world.pod(pod_ip);
    // The pod claims the node's address as its own.
    pod.ip(&["addr", "add", &format!("{NODE_IP}/32"), "dev", "eth0"]).unwrap();
    // A node service on its other address records what reaches it.
    let to = SocketAddr::new(NODE_IP_ALT.into(), 7070);
    let listener = recorder(&world.node, to);
    assert_eq!(conf(&world.node, "vp0", "accept_local"), "0");
    assert!(datagram_reaches(pod, pod_ip, to, &listener, "from the pod"), "the pod's own datagram reaches the node");
    let as_node = NODE_IP.into();
    assert!(!datagram_reaches(pod, as_node, to, &listener, "as the node, no kpr"), "the kernel drops it: a martian");

    let (_config, _cgroup, _kpr) = start_kpr(&world, &tag, "");
    assert!(datagram_reaches(pod, pod_ip, to, &listener, "from the pod, kpr"), "the pod's own datagram still arrives");
    for what in ["as the node, kpr 1", "as the node, kpr 2", "as the node, kpr 3"] {
        assert!(!datagram_reaches(pod, as_node, to, &listener, what), "a datagram sent as the node got through kpr");
    }
}

/// With `rp_filter` on a pod's link, the kernel drops what the pod sends from another pod's
/// address (the route back to that address leaves by the other pod's link). kpr translates a
/// Service's packet before the kernel's routing would check it, and may send it straight to
/// the endpoint: it checks the source itself on a new flow's first packet, so a pod cannot
/// reach a Service as another pod either. Loose mode only asks for a route back.
#[test]
fn a_pod_cannot_reach_a_service_as_another_pod_where_rp_filter_is_on() {
    let tag = testbed::unique_name("krpf");
    let (spoofer, other, backend): (IpAddr, IpAddr, IpAddr) =
        ("10.0.0.2".parse().unwrap(), "10.0.0.3".parse().unwrap(), "10.0.0.4".parse().unwrap());
    let world = World::new(&tag, &[spoofer, other, backend], &[80], &[9]).unwrap();
    let pod = world.pod(spoofer);
    pod.ip(&["addr", "add", &format!("{other}/32"), "dev", "eth0"]).unwrap();
    let at_backend = SocketAddr::new(backend, 7070);
    let listener = recorder(world.pod(backend), at_backend);
    let set_rp_filter = |value: &'static str| {
        world.node.run(move || std::fs::write("/proc/sys/net/ipv4/conf/vp0/rp_filter", value).unwrap()).unwrap();
    };
    set_rp_filter("1");
    assert!(datagram_reaches(pod, spoofer, at_backend, &listener, "direct"), "the pod's own datagram arrives");
    let spoofed = |what| datagram_reaches(pod, other, at_backend, &listener, what);
    assert!(!spoofed("direct, as the other pod"), "the kernel's strict rp_filter drops it");

    let cluster_ip: IpAddr = "10.96.0.50".parse().unwrap();
    let objects = format!(
        "{}---\n{}",
        testbed::service_manifest("default", "udp", &[cluster_ip], &[("u", 70, "UDP")]),
        testbed::slice_manifest("default", "udp", "udp-1", &[backend], &[("u", 7070, "UDP")])
    );
    let (_config, _cgroup, kpr) = start_kpr(&world, &tag, &objects);
    testbed::wait_programmed(&kpr.pins, "10.96.0.50:70/UDP", Some(1), Duration::from_secs(30)).unwrap();
    let service = SocketAddr::new(cluster_ip, 70);
    assert!(datagram_reaches(pod, spoofer, service, &listener, "via kpr"), "the pod's own datagram through kpr");
    for what in ["via kpr, as the other pod 1", "via kpr, as the other pod 2", "via kpr, as the other pod 3"] {
        assert!(!datagram_reaches(pod, other, service, &listener, what), "a spoofed source got through kpr");
    }
    // Loose: a route back to the other pod exists, so the kernel would pass it, and so does kpr.
    set_rp_filter("2");
    world.node.ip(&["link", "set", "vp0", "mtu", "1499"]).unwrap(); // a link change: kpr rereads the links
    world.node.ip(&["link", "set", "vp0", "mtu", "1500"]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    while !datagram_reaches(pod, other, service, &listener, ["loose 0", "loose 1", "loose 2", "loose 3"][n % 4]) {
        assert!(Instant::now() < deadline, "loose rp_filter: never passed:\n{}", kpr.log_tail());
        n += 1;
    }
}
