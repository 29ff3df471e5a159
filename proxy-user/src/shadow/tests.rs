//! kpr's plan for the objects of upstream's TestLoadBalancer (as the API server held them)
//! against the rules the real kube-proxy wrote for them, in each mode: no difference; then the
//! same plan missing an endpoint: the Service named, from every source class.
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use super::*;
use crate::source::kube_proxy_rules::{iptables, nftables};

const TESTDATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/source/kube_proxy_rules/testdata");

fn plan(drop_endpoints_of: Option<&str>) -> Desired {
    let text = std::fs::read_to_string(format!("{TESTDATA}/load_balancer.objects.yaml")).unwrap();
    let list: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    let node =
        NodeInfo { name: "test-node".into(), addresses: vec!["192.168.0.2".parse().unwrap()], ..NodeInfo::default() };
    let options = crate::model::ProxyOptions { detect_local: true, ..Default::default() };
    let mut state = ClusterState::with_options(node, options);
    let (mut services, mut slices) = (Vec::new(), Vec::new());
    for item in list["items"].as_sequence().unwrap() {
        match item["kind"].as_str() {
            Some("Service") => services.push(serde_yaml::from_value::<Service>(item.clone()).unwrap()),
            Some("EndpointSlice") => {
                let mut slice: EndpointSlice = serde_yaml::from_value(item.clone()).unwrap();
                let service = slice.metadata.labels.as_ref().and_then(|l| l.get("kubernetes.io/service-name")).cloned();
                if service.as_deref() == drop_endpoints_of {
                    slice.endpoints = None;
                }
                slices.push(slice);
            }
            _ => {}
        }
    }
    state.replace_services(services);
    state.replace_slices(slices);
    state.desired()
}

fn compare_with(desired: &Desired, mode: Mode) -> Vec<Mismatch> {
    let rules = match mode {
        Mode::Iptables => {
            iptables::parse(&std::fs::read_to_string(format!("{TESTDATA}/load_balancer.iptables-save")).unwrap())
        }
        Mode::Nftables => {
            nftables::parse(&std::fs::read_to_string(format!("{TESTDATA}/load_balancer.nft.json")).unwrap())
        }
    }
    .unwrap();
    let info = NodeInfo { addresses: vec!["192.168.0.2".parse().unwrap()], ..NodeInfo::default() };
    let local_cidrs = BTreeSet::from(["10.0.0.0/8".parse().unwrap()]);
    let node_addrs = BTreeMap::from([("192.168.0.2".parse().unwrap(), proxy_common::NODE_ADDR_NODEPORT)]);
    let detect = DetectLocal::ClusterCidr(local_cidrs.iter().copied().collect());
    let node_ips = ["192.168.0.2".parse().unwrap()];
    let node = NodeView {
        info: &info,
        detect: &detect,
        local_cidrs: &local_cidrs,
        node_ips: &node_ips,
        node_addrs: &node_addrs,
    };
    let (mismatches, compared) = compare(desired, IpFamily::V4, (mode, &rules), &node);
    // ClusterIP, two LB IPs, the NodePort, the marker, default/kubernetes: × 3 sources.
    assert!(compared >= 18, "{compared} verdicts compared");
    mismatches
}

#[test]
fn kprs_plan_agrees_with_the_rules_of_kube_proxy_in_both_modes() {
    let desired = plan(None);
    for mode in [Mode::Iptables, Mode::Nftables] {
        assert_eq!(compare_with(&desired, mode), Vec::new(), "{mode:?}");
    }
}

#[test]
fn a_plan_missing_an_endpoint_is_named_per_frontend_and_source() {
    let desired = plan(Some("svc1"));
    for mode in [Mode::Iptables, Mode::Nftables] {
        let mismatches = compare_with(&desired, mode);
        // ClusterIP, both LB IPs and the NodePort, from a pod, outside and the node.
        assert_eq!(mismatches.len(), 12, "{mode:?}: {mismatches:#?}");
        for m in &mismatches {
            assert!(m.service.starts_with("ns1/svc1:"), "{m:?}");
            assert_eq!(m.kpr["verdict"], "reject", "{m:?}");
            assert_eq!(m.kube_proxy["endpoints"][0], "10.180.0.1:80", "{m:?}");
            assert_eq!(m.deviation, None);
        }
    }
}

#[test]
fn the_nodes_connection_to_an_external_ip_without_endpoints_is_a_documented_deviation_in_iptables_mode() {
    let (reject, pass) = (Verdict::Reject, Verdict::Pass);
    let entry = |flags| DesiredPort {
        name: crate::model::ServicePortName {
            service: crate::model::ObjectKey::new("ns", "svc"),
            port: String::new(),
            protocol: Protocol::Tcp,
        },
        backends: Vec::new(),
        flags,
        source_ranges: Vec::new(),
        affinity_timeout: 0,
        serving: Vec::new(),
        alive: None,
        remote: Vec::new(),
    };
    let external = entry(SERVICE_FLAG_EXTERNAL_ADDR);
    let cluster_ip = entry(0);
    assert!(deviation(Mode::Iptables, SCOPE_NODE, Some(&external), false, &reject, &pass).is_some());
    // Anywhere else the same difference is a mismatch: nftables mode, a pod, a local address,
    // a ClusterIP, another verdict.
    assert!(deviation(Mode::Nftables, SCOPE_NODE, Some(&external), false, &reject, &pass).is_none());
    assert!(deviation(Mode::Iptables, SCOPE_POD, Some(&external), false, &reject, &pass).is_none());
    assert!(deviation(Mode::Iptables, SCOPE_NODE, Some(&external), true, &reject, &pass).is_none());
    assert!(deviation(Mode::Iptables, SCOPE_NODE, Some(&cluster_ip), false, &reject, &pass).is_none());
    assert!(deviation(Mode::Iptables, SCOPE_NODE, Some(&external), false, &Verdict::Drop, &pass).is_none());
}
