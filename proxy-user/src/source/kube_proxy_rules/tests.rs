//! Both readers on rules the real kube-proxy (v1.36, each mode) wrote for two of upstream's
//! packet-flow cases (`kube_proxy_flows.rs`: node 192.168.0.2, clusterCIDR 10.0.0.0/8), and the
//! walk's verdicts on them, which must be the same whichever mode wrote the rules.
use super::*;

fn testdata(file: &str) -> String {
    std::fs::read_to_string(format!("{}/src/source/kube_proxy_rules/testdata/{file}", env!("CARGO_MANIFEST_DIR")))
        .unwrap()
}

fn iptables(name: &str) -> RuleSet {
    iptables::parse(&testdata(&format!("{name}.iptables-save"))).unwrap()
}

fn nftables(name: &str) -> RuleSet {
    nftables::parse(&testdata(&format!("{name}.nft.json"))).unwrap()
}

const NODE: &str = "192.168.0.2";
const POD: &str = "10.255.255.254";
const OUTSIDE: &str = "203.0.113.254";

/// A new TCP connection from `from` (`pod`, `external`, `node`) to `dst:port`.
fn packet(from: &str, dst: &str, port: u16) -> Packet {
    let dst: IpAddr = dst.parse().unwrap();
    let (src, in_link) = match from {
        "pod" => (POD, Some("veth0".to_owned())),
        "external" => (OUTSIDE, Some("eth0".to_owned())),
        _ => (NODE, None),
    };
    Packet {
        src: src.parse().unwrap(),
        src_local: from == "node",
        in_link,
        dst,
        dst_local: dst == NODE.parse::<IpAddr>().unwrap(),
        proto: proxy_common::IPPROTO_TCP,
        dport: port,
        ranges_symbolic: from != "node",
    }
}

fn endpoints(eps: &[&str], masquerade: bool, ranges: &[&str]) -> Verdict {
    Verdict::Endpoints {
        endpoints: eps.iter().map(|e| e.parse().unwrap()).collect(),
        masquerade,
        affinity_seconds: 0,
        source_ranges: ranges.iter().map(|r| r.parse().unwrap()).collect(),
    }
}

#[test]
fn a_load_balancer_with_source_ranges_reads_alike_from_both_modes() {
    let ranges = ["1.2.3.4/32", "5.6.7.8/32", "192.168.0.0/24", "203.0.113.0/25"];
    for rules in [iptables("load_balancer"), nftables("load_balancer")] {
        let ep = ["10.180.0.1:80"];
        // ClusterIP: a pod's connection is not masqueraded, anyone else's is.
        assert_eq!(rules.verdict(&packet("pod", "172.30.0.41", 80)), endpoints(&ep, false, &[]));
        assert_eq!(rules.verdict(&packet("external", "172.30.0.41", 80)), endpoints(&ep, true, &[]));
        assert_eq!(rules.verdict(&packet("node", "172.30.0.41", 80)), endpoints(&ep, true, &[]));
        // The LoadBalancer IP: admitted sources only (the LB IPs too: a range holds the node).
        assert_eq!(rules.verdict(&packet("external", "1.2.3.4", 80)), endpoints(&ep, true, &ranges));
        assert_eq!(rules.verdict(&packet("pod", "5.6.7.8", 80)), endpoints(&ep, true, &ranges));
        // The node is inside 192.168.0.0/24: admitted, and decided without ranges.
        assert_eq!(rules.verdict(&packet("node", "1.2.3.4", 80)), endpoints(&ep, true, &[]));
        // The NodePort: not subject to the ranges.
        assert_eq!(rules.verdict(&packet("external", NODE, 3001)), endpoints(&ep, true, &[]));
        // A Service without endpoints is rejected; an unknown port of an LB IP passes.
        assert_eq!(rules.verdict(&packet("pod", "172.30.255.3", 9)), Verdict::Reject);
        assert_eq!(rules.verdict(&packet("external", "1.2.3.4", 81)), Verdict::Pass);
        let frontends = rules.frontends();
        for (addr, port) in [(Some("172.30.0.41"), 80), (Some("1.2.3.4"), 80), (Some("5.6.7.8"), 80), (None, 3001)] {
            let addr = addr.map(|a| a.parse().unwrap());
            let frontend = Frontend { addr, proto: proxy_common::IPPROTO_TCP, port };
            assert!(frontends.contains(&frontend), "{frontend:?} in {frontends:?}");
        }
        // 127.0.0.0/8's NodePort rule is not a frontend of its own.
        assert!(frontends.iter().all(|f| f.addr.is_none_or(|a| !a.is_loopback())), "{frontends:?}");
    }
}

#[test]
fn an_unknown_port_of_a_cluster_ip_passes_in_iptables_mode_and_is_rejected_in_nftables_mode() {
    let unknown_port = packet("pod", "172.30.0.41", 81);
    assert_eq!(iptables("load_balancer").verdict(&unknown_port), Verdict::Pass);
    assert_eq!(nftables("load_balancer").verdict(&unknown_port), Verdict::Reject);
}

#[test]
fn external_traffic_policy_local_reads_alike_from_both_modes() {
    for rules in [iptables("etp_local"), nftables("etp_local")] {
        let all = ["10.180.0.1:80", "10.180.2.1:80"];
        // From outside: the local endpoint only, the client's address kept.
        assert_eq!(rules.verdict(&packet("external", NODE, 3001)), endpoints(&["10.180.2.1:80"], false, &[]));
        assert_eq!(rules.verdict(&packet("external", "1.2.3.4", 80)), endpoints(&["10.180.2.1:80"], false, &[]));
        // A pod short-circuits to every endpoint, unmasqueraded; the node to every one, masqueraded.
        assert_eq!(rules.verdict(&packet("pod", "192.168.99.11", 80)), endpoints(&all, false, &[]));
        assert_eq!(rules.verdict(&packet("node", "1.2.3.4", 80)), endpoints(&all, true, &[]));
    }
}

#[test]
fn statistic_and_affinity_branches_are_all_taken() {
    let text = "*nat\n\
        -A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-A\n\
        -A KUBE-SVC-A -m recent --name KUBE-SEP-1 --mask 255.255.255.255 --rsource --rcheck --seconds 10800 --reap -j KUBE-SEP-1\n\
        -A KUBE-SVC-A -m recent --name KUBE-SEP-2 --mask 255.255.255.255 --rsource --rcheck --seconds 10800 --reap -j KUBE-SEP-2\n\
        -A KUBE-SVC-A -m statistic --mode random --probability 0.5 -j KUBE-SEP-1\n\
        -A KUBE-SVC-A -j KUBE-SEP-2\n\
        -A KUBE-SEP-1 -p tcp -m recent --set --name KUBE-SEP-1 --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.0.1.1:8080\n\
        -A KUBE-SEP-2 -p tcp -m recent --set --name KUBE-SEP-2 --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.0.1.2:8080\n\
        COMMIT\n";
    let rules = iptables::parse(text).unwrap();
    let verdict = rules.verdict(&packet("pod", "10.96.0.1", 80));
    let want = Verdict::Endpoints {
        endpoints: ["10.0.1.1:8080", "10.0.1.2:8080"].iter().map(|e| e.parse().unwrap()).collect(),
        masquerade: false,
        affinity_seconds: 10800,
        source_ranges: Vec::new(),
    };
    assert_eq!(verdict, want);
}

#[test]
fn an_unknown_option_in_kube_proxy_chains_is_an_error_and_other_chains_are_not_read() {
    let err = iptables::parse(
        "*nat\n-A KUBE-SERVICES -d 10.96.0.1/32 -j KUBE-SVC-A\n-A KUBE-SVC-A --frobnicate 1 -j KUBE-SEP-1\nCOMMIT\n",
    )
    .unwrap_err();
    assert!(format!("{err:#}").contains("unknown option --frobnicate"), "{err:#}");
    // kube-router's and a CNI's chains, KUBE- named or not, that no kube-proxy chain reaches.
    let text = "*filter\n-A FORWARD -j KUBE-ROUTER-FORWARD\n-A KUBE-ROUTER-FORWARD -m physdev --physdev-is-bridged -j ACCEPT\n\
        -A CNI-FORWARD -m set --match-set x src -j DROP\nCOMMIT\n";
    let rules = iptables::parse(text).unwrap();
    assert!(rules.chains.values().all(|c| c.rules.is_empty()), "{:?}", rules.chains.keys().collect::<Vec<_>>());
    let ipvs = "*nat\n-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ\nCOMMIT\n";
    assert!(format!("{:#}", iptables::parse(ipvs).unwrap_err()).contains("IPVS mode"));
}
