use super::*;
use crate::model::tests::{service_yaml, slice_yaml};

fn web(ip: &str) -> Service {
    service_yaml(&format!(
        "metadata: {{name: web, namespace: shop}}\nspec: {{clusterIP: {ip}, ports: [{{name: http, port: 80}}, {{name: dns, port: 53, protocol: UDP}}]}}"
    ))
}
fn slice(name: &str, ips: &[&str]) -> EndpointSlice {
    let eps: Vec<String> = ips.iter().map(|ip| format!("{{addresses: [{ip}]}}")).collect();
    slice_yaml(&format!(
        "metadata: {{name: {name}, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}, {{name: dns, port: 5353, protocol: UDP}}]\nendpoints: [{}]",
        eps.join(", ")
    ))
}
fn backends(d: &Desired, ip: &str, port: u16, protocol: Protocol) -> Vec<String> {
    let key = service_key(ip.parse::<IpAddr>().unwrap(), port, protocol);
    d[&key].backends.iter().map(|(ip, p)| format!("{ip}:{p}")).collect()
}

#[test]
fn nothing_until_both_lists_synced() {
    let mut st = ClusterState::new(NodeInfo::default());
    st.replace_services(vec![web("10.96.0.10")]);
    assert!(!st.synced());
    st.replace_slices(vec![]);
    assert!(st.synced());
}

/// kube-proxy's proxier per family: a dual-stack Service has entries in both, each with
/// the endpoints of its family's slices, its family's externalIPs, LoadBalancer IPs and
/// source ranges, and a NodePort of its family; a single-stack Service is absent from
/// the other family's rules (its NodePort too).
#[test]
fn each_family_sees_its_own_addresses_and_endpoints() {
    let node = NodeInfo { addresses: vec!["fd00::1".parse().unwrap()], ..NodeInfo::default() };
    let mut st = ClusterState::new(node);
    let dual = service_yaml(
        "metadata: {name: web, namespace: shop}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10, 'fd00:96::10'], ipFamilies: [IPv4, IPv6], externalIPs: [192.0.2.7, '2001:db8::7'], loadBalancerSourceRanges: ['198.51.100.0/24', 'fd00::/64'], ports: [{name: http, port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.9}, {ip: '2001:db8::9'}]}}",
    );
    let single = service_yaml(
        "metadata: {name: old, namespace: shop}\nspec: {type: NodePort, clusterIP: 10.96.0.11, ports: [{name: http, port: 80, nodePort: 30081}]}",
    );
    let v6_slice = slice_yaml(
        "metadata: {name: web-v6, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv6\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: ['fd00:10::2']}, {addresses: ['fd00:10::1']}]",
    );
    st.replace_services(vec![dual, single]);
    st.replace_slices(vec![slice("web-v4", &["10.0.0.1"]), v6_slice]);
    let d = st.desired();
    let port = |ip: &str, port: u16, scope: u8| {
        d.get(&frontend_key(ip.parse::<IpAddr>().unwrap(), port, Protocol::Tcp, scope))
    };
    let backends_of = |p: &DesiredPort| p.backends.iter().map(|(ip, p)| format!("{ip}:{p}")).collect::<Vec<_>>();
    assert_eq!(backends(&d, "10.96.0.10", 80, Protocol::Tcp), ["10.0.0.1:8080"]);
    assert_eq!(backends(&d, "fd00:96::10", 80, Protocol::Tcp), ["fd00:10::1:8080", "fd00:10::2:8080"]);
    for ip in ["192.0.2.7", "2001:db8::7", "203.0.113.9", "2001:db8::9"] {
        assert!(port(ip, 80, SCOPE_EXTERNAL).is_some(), "{ip}");
    }
    let v4_nodeport = port("0.0.0.0", 30080, SCOPE_EXTERNAL).unwrap();
    let v6_nodeport = port("::", 30080, SCOPE_EXTERNAL).unwrap();
    assert_eq!(backends_of(v4_nodeport), ["10.0.0.1:8080"]);
    assert_eq!(backends_of(v6_nodeport), ["fd00:10::1:8080", "fd00:10::2:8080"]);
    // Source ranges by family; the IPv6 range holds a node address, so the node (and the
    // LoadBalancer IP itself) is admitted over IPv6 only.
    let lb4 = port("203.0.113.9", 80, SCOPE_EXTERNAL).unwrap();
    let lb6 = port("2001:db8::9", 80, SCOPE_EXTERNAL).unwrap();
    assert_eq!(lb4.source_ranges.iter().map(ToString::to_string).collect::<Vec<_>>(), ["198.51.100.0/24"]);
    assert_eq!(lb6.source_ranges.iter().map(ToString::to_string).collect::<Vec<_>>(), ["2001:db8::9/128", "fd00::/64"]);
    assert_eq!(
        port("203.0.113.9", 80, SCOPE_NODE).unwrap().flags & SERVICE_FLAG_DROP_NO_ENDPOINTS,
        SERVICE_FLAG_DROP_NO_ENDPOINTS
    );
    assert!(port("2001:db8::9", 80, SCOPE_NODE).unwrap().backends.len() == 2);
    // The single-stack Service: an IPv4 NodePort, none on IPv6.
    assert!(port("0.0.0.0", 30081, SCOPE_EXTERNAL).is_some());
    assert!(port("::", 30081, SCOPE_EXTERNAL).is_none());

    // No IPv6 endpoints: the IPv6 proxier rejects, whatever the IPv4 side has.
    st.replace_slices(vec![slice("web-v4", &["10.0.0.1"])]);
    let d = st.desired();
    assert_eq!(backends(&d, "10.96.0.10", 80, Protocol::Tcp), ["10.0.0.1:8080"]);
    assert_eq!(backends(&d, "fd00:96::10", 80, Protocol::Tcp), Vec::<String>::new());
    assert_eq!(d[&service_key("fd00:96::10".parse::<IpAddr>().unwrap(), 80, Protocol::Tcp)].flags, 0, "REJECT");
}

/// The model keeps what it reads of each object, not the object: a change elsewhere in an
/// object (its resourceVersion and managedFields, a selector, an endpoint's targetRef and
/// hostname) recomputes nothing, a change it reads does.
#[test]
fn only_what_the_model_reads_is_kept() {
    let mut st = ClusterState::new(NodeInfo::default());
    st.replace_services(vec![web("10.96.0.10")]);
    st.replace_slices(vec![slice("web-1", &["10.0.0.1"])]);
    st.desired();
    let mut selected = web("10.96.0.10");
    selected.spec.as_mut().unwrap().selector = Some([("app".to_string(), "web".to_string())].into());
    selected.metadata.resource_version = Some("2".into());
    selected.metadata.managed_fields = Some(vec![Default::default()]);
    st.apply_service(selected);
    let mut referenced = slice("web-1", &["10.0.0.1"]);
    let endpoint = &mut referenced.endpoints.as_mut().unwrap()[0];
    endpoint.hostname = Some("web-0".into());
    endpoint.target_ref = Some(k8s_openapi::api::core::v1::ObjectReference {
        kind: Some("Pod".into()),
        name: Some("web-0".into()),
        ..Default::default()
    });
    st.apply_slice(referenced.clone());
    assert!(!st.has_changes(), "nothing the model reads changed");
    referenced.endpoints.as_mut().unwrap()[0].conditions =
        Some(k8s_openapi::api::discovery::v1::EndpointConditions { ready: Some(false), ..Default::default() });
    st.apply_slice(referenced);
    assert!(st.has_changes());
    assert_eq!(st.sample_cluster_ip(), Some("10.96.0.10".parse().unwrap()));
}

#[test]
fn desired_follows_objects() {
    let mut st = ClusterState::new(NodeInfo::default());
    st.replace_services(vec![web("10.96.0.10")]);
    st.replace_slices(vec![slice("web-1", &["10.0.0.2", "10.0.0.1"])]);
    let d = st.desired();
    assert_eq!(d.len(), 6, "two ports, three scopes each");
    assert_eq!(backends(&d, "10.96.0.10", 80, Protocol::Tcp), ["10.0.0.1:8080", "10.0.0.2:8080"]);
    assert_eq!(backends(&d, "10.96.0.10", 53, Protocol::Udp), ["10.0.0.1:5353", "10.0.0.2:5353"]);

    // A second slice adds an endpoint; deleting the first removes two.
    st.apply_slice(slice("web-2", &["10.0.0.3"]));
    assert!(st.has_changes());
    assert_eq!(backends(&st.desired(), "10.96.0.10", 80, Protocol::Tcp).len(), 3);
    st.delete_slice(&ObjectKey::new("shop", "web-1"));
    assert_eq!(backends(&st.desired(), "10.96.0.10", 80, Protocol::Tcp), ["10.0.0.3:8080"]);

    // No endpoints: the entry stays, empty (reject), until the Service goes.
    st.replace_slices(vec![]);
    assert_eq!(backends(&st.desired(), "10.96.0.10", 80, Protocol::Tcp), Vec::<String>::new());
    st.delete_service(&ObjectKey::new("shop", "web"));
    assert!(st.desired().is_empty());
}

#[test]
fn unchanged_objects_do_not_mark_dirty() {
    let mut st = ClusterState::new(NodeInfo::default());
    st.replace_services(vec![web("10.96.0.10")]);
    st.replace_slices(vec![slice("web-1", &["10.0.0.1"])]);
    st.desired();
    st.replace_services(vec![web("10.96.0.10")]);
    st.replace_slices(vec![slice("web-1", &["10.0.0.1"])]);
    assert!(!st.has_changes());
}

#[test]
fn conflicting_services_first_wins_and_bad_ones_are_skipped() {
    let mut st = ClusterState::new(NodeInfo::default());
    let mut other = web("10.96.0.10");
    other.metadata.namespace = Some("another".into());
    let mut bad = web("10.96.0.300");
    bad.metadata.name = Some("bad".into());
    st.replace_services(vec![web("10.96.0.10"), other, bad]);
    st.replace_slices(vec![slice("web-1", &["10.0.0.1"])]);
    let d = st.desired();
    let key = service_key("10.96.0.10".parse::<std::net::IpAddr>().unwrap(), 80, Protocol::Tcp);
    assert_eq!(d[&key].name.service, ObjectKey::new("another", "web"));
    assert_eq!(d.len(), 6, "two ports, three scopes each");
    assert_eq!(st.skips.conflicts, 2);
    assert_eq!(st.skips.objects, 1);
}

#[test]
fn the_older_service_keeps_a_contested_address() {
    let mut st = ClusterState::new(NodeInfo::default());
    let created = |svc: &mut Service, at: &str| {
        svc.metadata.creation_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at.parse().unwrap()));
    };
    let mut owner = web("10.96.0.10");
    owner.metadata.namespace = Some("zz-owner".into());
    created(&mut owner, "2026-01-01T00:00:00Z");
    // A newer service in a namespace that sorts first claims the same address.
    let mut newcomer = web("10.96.0.10");
    newcomer.metadata.namespace = Some("aa-newcomer".into());
    created(&mut newcomer, "2026-06-01T00:00:00Z");
    st.replace_services(vec![newcomer, owner]);
    st.replace_slices(vec![]);
    let d = st.desired();
    let key = service_key("10.96.0.10".parse::<std::net::IpAddr>().unwrap(), 80, Protocol::Tcp);
    assert_eq!(d[&key].name.service, ObjectKey::new("zz-owner", "web"), "the earlier owner keeps it");
    let conflicts = st.take_new_conflicts();
    assert_eq!(conflicts.len(), 2, "one per port: {conflicts:?}");
    assert!(
        conflicts
            .iter()
            .all(|c| c.service == ObjectKey::new("aa-newcomer", "web") && c.owner == ObjectKey::new("zz-owner", "web"))
    );
    st.desired();
    assert!(st.take_new_conflicts().is_empty(), "reported once");
}

#[test]
fn a_refused_service_range_rejects_the_other_ports_of_its_cluster_ips() {
    let options = ProxyOptions { refuse_service_range: true, ..Default::default() };
    let mut st = ClusterState::with_options(NodeInfo::default(), options);
    st.replace_services(vec![web("10.96.0.10")]);
    st.replace_slices(vec![slice("web-1", &["10.0.0.1"])]);
    assert_eq!(st.desired().len(), 6, "no known service range: two ports, three scopes each");
    let range = crate::model::cidr::Cidr::new("10.96.0.0".parse().unwrap(), 16).unwrap();
    st.set_node(NodeInfo { service_cidrs: vec![range], ..NodeInfo::default() });
    let d = st.desired();
    assert_eq!(d.len(), 7, "and one any-port entry for every source");
    let any = ServiceKey {
        addr: "10.96.0.10".parse::<IpAddr>().unwrap().into(),
        port: 0,
        proto: PROTO_ANY,
        scope: SCOPE_POD,
    };
    assert_eq!((d[&any].backends.len(), d[&any].flags), (0, 0), "reject");
    let other = crate::model::cidr::Cidr::new("10.100.0.0".parse().unwrap(), 16).unwrap();
    st.set_node(NodeInfo { service_cidrs: vec![other], ..NodeInfo::default() });
    assert_eq!(st.desired().len(), 6, "a ClusterIP outside the range gets none");
}

#[test]
fn session_affinity_goes_to_every_frontend_of_the_port() {
    let with = |affinity: &str| {
        let node =
            NodeInfo { name: "node-a".into(), addresses: vec!["10.0.0.1".parse().unwrap()], ..NodeInfo::default() };
        let mut st = ClusterState::with_options(node, ProxyOptions::default());
        st.replace_services(vec![service_yaml(&format!(
                "metadata: {{name: web, namespace: shop}}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.10\n{affinity}  ports: [{{name: http, port: 80, nodePort: 30080}}]"
            ))]);
        st.replace_slices(vec![slice("web-1", &["10.0.0.1"])]);
        let d = st.desired();
        assert_eq!(d.len(), 6, "ClusterIP and NodePort, three scopes each");
        d.values().map(|p| p.affinity_timeout).collect::<BTreeSet<u32>>()
    };
    let custom = "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n";
    assert_eq!(with(custom), BTreeSet::from([60]));
    assert_eq!(with("  sessionAffinity: ClientIP\n"), BTreeSet::from([10_800]), "the default timeout");
    assert_eq!(with(""), BTreeSet::from([0]), "no affinity");
}

#[test]
fn external_frontends_follow_the_external_traffic_policy() {
    let node = NodeInfo { name: "node-a".into(), addresses: vec!["10.0.0.1".parse().unwrap()], ..NodeInfo::default() };
    let options = ProxyOptions { detect_local: true, ..Default::default() };
    let mut st = ClusterState::with_options(node, options);
    let svc = service_yaml(
        "metadata: {name: web, namespace: shop}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalIPs: [192.0.2.7]\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n  ports: [{name: http, port: 80, nodePort: 30080}]\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.1}]}}",
    );
    let slice = slice_yaml(
        "metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.0.0.1], nodeName: node-a}, {addresses: [10.0.0.2], nodeName: node-b}]",
    );
    st.replace_services(vec![svc]);
    st.replace_slices(vec![slice]);
    let d = st.desired();
    let show = |ip: &str, port: u16, scope: u8| {
        let p = &d[&frontend_key(ip.parse::<IpAddr>().unwrap(), port, Protocol::Tcp, scope)];
        (p.backends.iter().map(|(ip, _)| ip.to_string()).collect::<Vec<_>>(), p.flags)
    };
    let all = vec!["10.0.0.1".to_owned(), "10.0.0.2".to_owned()];
    let local = vec!["10.0.0.1".to_owned()];
    assert_eq!(show("10.96.0.10", 80, SCOPE_POD), (all.clone(), 0), "ClusterIP from a pod: every endpoint");
    assert_eq!(show("10.96.0.10", 80, SCOPE_EXTERNAL), (all.clone(), SERVICE_FLAG_SNAT), "from outside: masqueraded");
    for (ip, port) in [("192.0.2.7", 80), ("198.51.100.1", 80), ("0.0.0.0", 30080)] {
        assert_eq!(show(ip, port, SCOPE_EXTERNAL), (local.clone(), 0), "{ip}:{port} from outside");
        // Pods are short-circuited to every endpoint, source kept; the node is masqueraded.
        assert_eq!(show(ip, port, SCOPE_POD), (all.clone(), 0), "{ip}:{port} from a pod");
        // externalIPs and LoadBalancer IPs are not for the agent's own sockets.
        let chosen = if port == 80 { SERVICE_FLAG_EXTERNAL_ADDR } else { 0 };
        assert_eq!(show(ip, port, SCOPE_NODE), (all.clone(), SERVICE_FLAG_SNAT | chosen), "{ip}:{port} from the node");
    }
    assert_eq!(show("10.96.0.10", 80, SCOPE_NODE).1 & SERVICE_FLAG_EXTERNAL_ADDR, 0, "a ClusterIP is for everyone");
    assert_eq!(st.health_checks()[&32000], (ObjectKey::new("shop", "web"), 1));
}

/// `--host-external-ips local`: the node's own connections to an externalIP or
/// LoadBalancer IP that is not the node's pass untranslated (no entry for them); one that
/// is the node's, the ClusterIP and the NodePort are translated as before; pods and outside
/// clients are served either way.
#[test]
fn host_external_ips_local_leaves_the_nodes_connections_to_other_machines_alone() {
    let node = NodeInfo {
        name: "node-a".into(),
        addresses: vec!["10.0.0.1".parse().unwrap(), "192.0.2.8".parse().unwrap()],
        ..NodeInfo::default()
    };
    let options = ProxyOptions { detect_local: true, host_external_ips_local_only: true, ..Default::default() };
    let mut st = ClusterState::with_options(node, options);
    let svc = service_yaml(
        "metadata: {name: api, namespace: shop}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalIPs: [192.0.2.7, 192.0.2.8]\n  ports: [{name: https, port: 6443, nodePort: 30443}]\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.1}]}}",
    );
    let slice = slice_yaml(
        "metadata: {name: api-1, namespace: shop, labels: {kubernetes.io/service-name: api}}\naddressType: IPv4\nports: [{name: https, port: 8443}]\nendpoints: [{addresses: [10.0.0.2], nodeName: node-b}]",
    );
    st.replace_services(vec![svc]);
    st.replace_slices(vec![slice]);
    let d = st.desired();
    let has = |ip: &str, port: u16, scope: u8| {
        d.contains_key(&frontend_key(ip.parse::<IpAddr>().unwrap(), port, Protocol::Tcp, scope))
    };
    for ip in ["192.0.2.7", "198.51.100.1"] {
        assert!(!has(ip, 6443, SCOPE_NODE), "{ip}: another machine's address, left to the node");
        assert!(has(ip, 6443, SCOPE_POD) && has(ip, 6443, SCOPE_EXTERNAL), "{ip}: pods and outside served");
    }
    assert!(has("192.0.2.8", 6443, SCOPE_NODE), "the node's own address: translated");
    assert!(has("10.96.0.10", 6443, SCOPE_NODE) && has("0.0.0.0", 30443, SCOPE_NODE));
}

/// `--abort-dead-tcp`: a TCP port's live endpoints are all but those on a Node that is not
/// Ready, unless serving while terminating (a graceful drain); an unready endpoint on a Ready
/// node (a failing readiness probe) is alive. UDP ports and the option off: none.
#[test]
fn tcp_endpoints_on_a_down_node_are_dead_unless_draining() {
    let eps = "{addresses: [10.0.0.1], nodeName: up}, \
        {addresses: [10.0.0.2], nodeName: down, conditions: {ready: false, serving: false, terminating: false}}, \
        {addresses: [10.0.0.3], nodeName: down, conditions: {ready: false, serving: true, terminating: true}}, \
        {addresses: [10.0.0.4], nodeName: up, conditions: {ready: false, serving: false, terminating: false}}, \
        {addresses: [10.0.0.5], nodeName: down}";
    let slice = slice_yaml(&format!(
        "metadata: {{name: web-1, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}, {{name: dns, port: 5353, protocol: UDP}}]\nendpoints: [{eps}]"
    ));
    let down = NodeInfo { down_nodes: ["down".to_owned()].into(), ..NodeInfo::default() };
    let alive = |options: ProxyOptions, node: NodeInfo, protocol: Protocol, port: u16| {
        let mut st = ClusterState::with_options(node, options);
        st.replace_services(vec![web("10.96.0.10")]);
        st.replace_slices(vec![slice.clone()]);
        let key = service_key("10.96.0.10".parse::<IpAddr>().unwrap(), port, protocol);
        st.desired()[&key].alive.as_ref().map(|a| a.iter().map(|e| e.to_string()).collect::<Vec<_>>())
    };
    let on = ProxyOptions { abort_dead_tcp: true, ..Default::default() };
    assert_eq!(
        alive(on, down.clone(), Protocol::Tcp, 80).unwrap(),
        ["10.0.0.1:8080", "10.0.0.3:8080", "10.0.0.4:8080"],
    );
    assert_eq!(alive(on, NodeInfo::default(), Protocol::Tcp, 80).unwrap().len(), 5, "every node Ready");
    assert_eq!(alive(on, down.clone(), Protocol::Udp, 53), None, "UDP has its own rule");
    assert_eq!(alive(ProxyOptions::default(), down, Protocol::Tcp, 80), None, "off");
}

/// `--lb-algorithm maglev` (or the annotation): the entries for outside clients of the
/// NodePort, externalIPs and LoadBalancer IPs pick by Maglev; a ClusterIP's, pods' and the
/// node's entries do not. The annotation `random` wins over the option.
#[test]
fn maglev_marks_the_external_frontends_entries_for_outside_clients() {
    let node = NodeInfo { name: "node-a".into(), addresses: vec!["10.0.0.1".parse().unwrap()], ..NodeInfo::default() };
    let flags = |options: ProxyOptions, annotation: &str| {
        let mut st = ClusterState::with_options(node.clone(), options);
        st.replace_services(vec![service_yaml(&format!(
            "metadata: {{name: web, namespace: shop{annotation}}}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalIPs: [192.0.2.7]\n  ports: [{{name: http, port: 80, nodePort: 30080}}]\nstatus: {{loadBalancer: {{ingress: [{{ip: 198.51.100.1}}]}}}}"
        ))]);
        st.replace_slices(vec![slice_yaml(
            "metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.0.0.2], nodeName: node-b}]",
        )]);
        st.desired()
            .into_iter()
            .filter(|(_, p)| p.flags & SERVICE_FLAG_MAGLEV != 0)
            .map(|(k, _)| (IpAddr::from(k.addr).to_string(), u16::from_be(k.port), k.scope))
            .collect::<Vec<_>>()
    };
    let outside = |ip: &str, port| (ip.to_owned(), port, SCOPE_EXTERNAL);
    let all_outside = vec![outside("0.0.0.0", 30080), outside("192.0.2.7", 80), outside("198.51.100.1", 80)];
    let maglev = ProxyOptions { maglev: true, ..Default::default() };
    let mut marked = flags(maglev, "");
    marked.sort();
    assert_eq!(marked, all_outside);
    assert!(flags(ProxyOptions::default(), "").is_empty(), "random by default");
    let mut annotated = flags(ProxyOptions::default(), ", annotations: {kpr.io/lb-algorithm: maglev}");
    annotated.sort();
    assert_eq!(annotated, all_outside, "the annotation turns it on");
    assert!(flags(maglev, ", annotations: {kpr.io/lb-algorithm: random}").is_empty(), "and off");
}

/// `--lb-mode dsr` (or the annotation): the entries for outside clients of the NodePort,
/// externalIPs and LoadBalancer IPs with traffic policy Cluster return directly instead of
/// masquerading, and name the endpoints on other nodes; the ClusterIP's, pods' and the node's
/// entries, and traffic policy Local, keep kube-proxy's. `hybrid` is DSR for TCP only; the
/// annotation wins over the option. An endpoint that names no node (maybe outside the
/// cluster) keeps the port masqueraded.
#[test]
fn direct_server_return_replaces_the_masquerade_of_external_frontends() {
    use proxy_common::SERVICE_FLAG_DSR;

    use crate::model::LbMode;
    let node = NodeInfo { name: "node-a".into(), addresses: vec!["10.0.0.1".parse().unwrap()], ..NodeInfo::default() };
    let entries_with = |options: ProxyOptions, annotation: &str, policy: &str, protocol: &str, third: &str| {
        let mut st = ClusterState::with_options(node.clone(), options);
        st.replace_services(vec![service_yaml(&format!(
            "metadata: {{name: web, namespace: shop{annotation}}}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalIPs: [192.0.2.7]\n  externalTrafficPolicy: {policy}\n  ports: [{{name: http, port: 80, protocol: {protocol}, nodePort: 30080}}]\nstatus: {{loadBalancer: {{ingress: [{{ip: 198.51.100.1}}]}}}}"
        ))]);
        st.replace_slices(vec![slice_yaml(&format!(
            "metadata: {{name: web-1, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080, protocol: {protocol}}}]\nendpoints: [{{addresses: [10.244.2.2], nodeName: node-b}}, {{addresses: [10.244.1.2], nodeName: node-a}}, {{addresses: [10.244.9.2]{third}}}]"
        ))]);
        st.desired()
            .into_iter()
            .filter(|(_, p)| p.flags & SERVICE_FLAG_DSR != 0)
            .map(|(k, p)| {
                assert_eq!(p.flags & SERVICE_FLAG_SNAT, 0, "no masquerade beside DSR");
                let remote: Vec<String> = p.remote.iter().map(ToString::to_string).collect();
                assert_eq!(remote, ["10.244.2.2", "10.244.9.2"], "the endpoints on other nodes");
                (IpAddr::from(k.addr).to_string(), u16::from_be(k.port), k.scope)
            })
            .collect::<BTreeSet<_>>()
    };
    let entries = |options, annotation: &str, policy: &str, protocol: &str| {
        entries_with(options, annotation, policy, protocol, ", nodeName: node-c")
    };
    let outside = |ip: &str, port| (ip.to_owned(), port, SCOPE_EXTERNAL);
    let all_outside: BTreeSet<_> =
        [outside("0.0.0.0", 30080), outside("192.0.2.7", 80), outside("198.51.100.1", 80)].into();
    let with = |lb_mode| ProxyOptions { lb_mode, ..Default::default() };
    assert_eq!(entries(with(LbMode::Dsr), "", "Cluster", "TCP"), all_outside);
    assert_eq!(entries(with(LbMode::Dsr), "", "Cluster", "UDP"), all_outside);
    assert!(entries(with(LbMode::Dsr), "", "Local", "TCP").is_empty(), "Local keeps the client already");
    assert!(entries(ProxyOptions::default(), "", "Cluster", "TCP").is_empty(), "snat by default");
    assert_eq!(entries(with(LbMode::Hybrid), "", "Cluster", "TCP"), all_outside);
    assert!(entries(with(LbMode::Hybrid), "", "Cluster", "UDP").is_empty(), "hybrid masquerades UDP");
    let annotated = |mode: &str| format!(", annotations: {{kpr.io/lb-mode: {mode}}}");
    assert_eq!(entries(ProxyOptions::default(), &annotated("dsr"), "Cluster", "TCP"), all_outside);
    assert!(entries(with(LbMode::Dsr), &annotated("snat"), "Cluster", "TCP").is_empty(), "and off");
    assert!(entries_with(with(LbMode::Dsr), "", "Cluster", "TCP", "").is_empty(), "an endpoint of no node");
}

/// A change recomputes and merges only its service's entries, and the result is what a
/// whole assembly of the same objects gives; a contested address falls back to a whole merge.
#[test]
fn a_change_updates_its_own_entries_and_matches_a_full_assembly() {
    let named = |name: &str, ip: &str| {
        let mut svc = web(ip);
        svc.metadata.name = Some(name.into());
        svc
    };
    let slice_of = |service: &str, ips: &[&str]| {
        let mut s = slice(&format!("{service}-1"), ips);
        s.metadata.labels.as_mut().unwrap().insert("kubernetes.io/service-name".into(), service.into());
        s
    };
    let fresh = |services: Vec<Service>, slices: Vec<EndpointSlice>| {
        let mut st = ClusterState::new(NodeInfo::default());
        st.replace_services(services);
        st.replace_slices(slices);
        st.desired()
    };
    // Others that do not change (a whole merge is taken when most services change).
    let others = || (1..=4).map(|i| named(&format!("other-{i}"), &format!("10.96.1.{i}")));
    let services: Vec<Service> = [named("web", "10.96.0.10"), named("api", "10.96.0.11"), named("db", "10.96.0.12")]
        .into_iter()
        .chain(others())
        .collect();
    let mut st = ClusterState::new(NodeInfo::default());
    st.replace_services(services.clone());
    st.replace_slices(vec![slice_of("web", &["10.0.0.1"]), slice_of("api", &["10.0.1.1"])]);
    assert_eq!(st.update(), Changed::All, "the first update merges everything");

    st.apply_slice(slice_of("web", &["10.0.0.1", "10.0.0.2"]));
    let Changed::Keys(keys) = st.update() else { panic!("one service changed: a partial update") };
    assert_eq!(keys.len(), 6, "web's two ports in three scopes: {keys:?}");
    assert!(st.assembled()[keys.first().unwrap()].name.service == ObjectKey::new("shop", "web"));
    let slices = vec![slice_of("web", &["10.0.0.1", "10.0.0.2"]), slice_of("api", &["10.0.1.1"])];
    assert_eq!(*st.assembled(), fresh(services.clone(), slices.clone()));
    assert_eq!(backends(st.assembled(), "10.96.0.10", 80, Protocol::Tcp), ["10.0.0.1:8080", "10.0.0.2:8080"]);

    // A deleted service's entries leave; a new one's come.
    st.delete_service(&ObjectKey::new("shop", "db"));
    st.apply_service(named("cache", "10.96.0.13"));
    let Changed::Keys(keys) = st.update() else { panic!("two services changed out of seven") };
    assert_eq!(keys.len(), 12);
    let services: Vec<Service> = [named("web", "10.96.0.10"), named("api", "10.96.0.11"), named("cache", "10.96.0.13")]
        .into_iter()
        .chain(others())
        .collect();
    assert_eq!(*st.assembled(), fresh(services.clone(), slices.clone()));

    // A newcomer claiming web's ClusterIP: only a whole merge says who keeps it.
    let mut services = services;
    services.push(named("aa-web", "10.96.0.10"));
    st.apply_service(named("aa-web", "10.96.0.10"));
    assert_eq!(st.update(), Changed::All);
    assert_eq!(*st.assembled(), fresh(services, slices));
}

/// Another reader's update (`kpr diff`, shadow mode) does not take the changes the datapath
/// has yet to be given.
#[test]
fn changes_wait_for_the_datapath_whoever_updates() {
    let mut st = ClusterState::new(NodeInfo::default());
    let others = (1..=4).map(|i| {
        let mut svc = web(&format!("10.96.1.{i}"));
        svc.metadata.name = Some(format!("other-{i}"));
        svc
    });
    st.replace_services([web("10.96.0.10")].into_iter().chain(others).collect());
    st.replace_slices(vec![slice("web-1", &["10.0.0.1"])]);
    st.update();
    assert_eq!(st.take_changed(), Changed::All, "the first time: everything");
    st.apply_slice(slice("web-1", &["10.0.0.1", "10.0.0.2"]));
    let _ = st.desired(); // another reader
    st.update();
    let Changed::Keys(keys) = st.take_changed() else { panic!("one service changed") };
    assert_eq!(keys.len(), 6, "web's entries, though another update merged them first");
    assert_eq!(st.take_changed(), Changed::Keys(BTreeSet::new()));
}
