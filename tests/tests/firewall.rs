//! What kpr reads of a node's forward hook (`kpr::source::firewall`): whatever filters forwarded
//! packets there, written as the tools NetworkPolicy engines use write it (iptables-nft,
//! iptables-legacy, ip6tables-legacy, nftables), is found; an empty, accepting chain is not.
//! In a network namespace of the test's own. Needs root.
use kpr::{source::firewall::forward_filters, testbed};

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

/// kpr turns `accept_local` on for the pod links it serves (its masqueraded packets carry the
/// node's address through the host stack); the kernel would otherwise drop a packet that arrives
/// with one of the node's addresses as source. A pod must not gain the right to send as the
/// node by it: its datagrams sent from the node's address reach nothing, with kpr as without.
#[test]
fn a_pod_cannot_send_as_the_node_through_kprs_accept_local() {
    use std::{
        net::{IpAddr, SocketAddr, UdpSocket},
        time::{Duration, Instant},
    };

    use kpr_tests::world::{KprAgent, NODE_IP, NODE_IP_ALT, World};

    let tag = testbed::unique_name("kmar");
    let pod_ip: IpAddr = "10.0.0.2".parse().unwrap();
    let world = World::new(&tag, &[pod_ip], &[80], &[9]).unwrap();
    // The pod claims the node's address as its own.
    world.pod(pod_ip).ip(&["addr", "add", &format!("{NODE_IP}/32"), "dev", "eth0"]).unwrap();
    // A node service on its other address records what reaches it.
    let listener = world.node.run(|| UdpSocket::bind((NODE_IP_ALT, 7070)).unwrap()).unwrap();
    listener.set_read_timeout(Some(Duration::from_millis(400))).unwrap();
    let reaches = |from: IpAddr, what: &'static str| -> bool {
        world
            .pod(pod_ip)
            .run(move || {
                let s = UdpSocket::bind(SocketAddr::new(from, 0)).unwrap();
                s.send_to(what.as_bytes(), (NODE_IP_ALT, 7070)).unwrap();
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
    };
    let accept_local = || {
        world
            .node
            .run(|| std::fs::read_to_string("/proc/sys/net/ipv4/conf/vp0/accept_local").unwrap().trim().to_owned())
            .unwrap()
    };
    assert_eq!(accept_local(), "0");
    assert!(reaches(pod_ip, "from the pod"), "the pod's own datagram reaches the node");
    assert!(!reaches(NODE_IP.into(), "as the node, no kpr"), "the kernel drops it: a martian source");

    let config = std::env::temp_dir().join(format!("{tag}.yaml"));
    std::fs::write(
        &config,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: iptables\n\
         hostnameOverride: test-node\nclusterCIDR: 10.0.0.0/8\n",
    )
    .unwrap();
    let cgroup = testbed::Cgroup::new(&tag).unwrap();
    let kpr = KprAgent::start(&world.node, &config, &cgroup, &tag, &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while accept_local() != "1" {
        assert!(Instant::now() < deadline, "kpr never served vp0:\n{}", kpr.log_tail());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(reaches(pod_ip, "from the pod, kpr"), "the pod's own datagram still reaches the node");
    for attempt in 0..3 {
        let what = ["as the node, kpr 1", "as the node, kpr 2", "as the node, kpr 3"][attempt];
        assert!(!reaches(NODE_IP.into(), what), "a datagram sent as the node got through kpr's accept_local");
    }
    drop(kpr);
    let _ = std::fs::remove_file(&config);
}
