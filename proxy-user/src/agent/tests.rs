use super::*;
use crate::{
    datapath::{
        Capacity, backend_addr,
        fake::{FakeHost, FakeMaps},
    },
    model::{
        Protocol,
        desired::service_key,
        tests::{service_yaml, slice_yaml},
    },
};

fn web_slice(ips: &[&str]) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    let eps: Vec<String> = ips.iter().map(|ip| format!("{{addresses: [{ip}]}}")).collect();
    slice_yaml(&format!(
        "metadata: {{name: web-1, namespace: d, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{}]",
        eps.join(", ")
    ))
}

fn visible(maps: &FakeMaps) -> Option<Vec<String>> {
    let key = service_key("10.96.0.10".parse::<std::net::IpAddr>().unwrap(), 80, Protocol::Tcp);
    maps.visible_backends(&key).map(|bs| bs.iter().map(|b| backend_addr(b).0.to_string()).collect())
}

#[tokio::test]
async fn events_flow_to_the_maps_only_after_both_lists() {
    let mut maps = FakeMaps::new(Capacity { service_ports: 16, backends: 64 });
    let programmer = Programmer::recover(&mut maps).unwrap();
    let mut syncer = Syncer::new(ClusterState::new(NodeInfo::default()), programmer, NodeSettings::default());
    let (tx, rx) = mpsc::channel(16);
    let svc = service_yaml("metadata: {name: web, namespace: d}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}");

    tx.send(SourceEvent::ServicesListed(vec![svc])).await.unwrap();
    tx.send(SourceEvent::SliceApplied(web_slice(&["10.0.0.1"]))).await.unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut host = FakeHost::default();
    let run = async {
        syncer.run(rx, &mut maps, &mut host, Duration::from_secs(3600), async { stop_rx.await.unwrap() }).await;
        (syncer, maps)
    };
    let drive = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        tx.send(SourceEvent::SlicesListed(vec![web_slice(&["10.0.0.1", "10.0.0.2"])])).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        stop_tx.send(()).unwrap();
    };
    let ((syncer, maps), ()) = tokio::join!(run, drive);
    assert_eq!(visible(&maps), Some(vec!["10.0.0.1".into(), "10.0.0.2".into()]));
    assert_eq!(syncer.programmer.programmed().len(), 3, "one entry per source scope");
}

/// A syncer on fake maps that has listed the Service `d/web` (10.96.0.10:80).
fn syncer_with_web_service() -> (Syncer, FakeMaps, FakeHost) {
    let mut maps = FakeMaps::new(Capacity { service_ports: 16, backends: 64 });
    let programmer = Programmer::recover(&mut maps).unwrap();
    let mut syncer = Syncer::new(ClusterState::new(NodeInfo::default()), programmer, NodeSettings::default());
    let svc = service_yaml("metadata: {name: web, namespace: d}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}");
    syncer.apply(SourceEvent::ServicesListed(vec![svc]));
    (syncer, maps, FakeHost::default())
}

/// The health check ports listen where NodePorts are served: everywhere by default, on
/// the node addresses `nodePortAddresses` matches when it is set.
#[test]
fn health_check_ports_listen_on_the_node_port_addresses() {
    let (mut syncer, mut maps, mut host) = syncer_with_web_service();
    let addrs = ["192.0.2.5", "198.51.100.9"].iter().map(|a| a.parse().unwrap()).collect();
    let eth0 = HostLink {
        index: 2,
        name: "eth0".into(),
        loopback: false,
        addrs,
        v4_unselectable: vec![],
        peer_nsid: None,
        ethernet: true,
        rp_filter: 0,
    };
    syncer.host_links = vec![eth0];
    syncer.sync(&mut maps, &mut host, Instant::now());
    assert_eq!(syncer.health_bind, crate::servers::service_health::BindTo::Any);
    syncer.node_settings.node_port_addresses =
        vec![crate::model::node::NodePortAddress::Cidr("192.0.2.0/24".parse().unwrap())];
    syncer.node_dirty = true;
    syncer.sync(&mut maps, &mut host, Instant::now());
    assert_eq!(
        syncer.health_bind,
        crate::servers::service_health::BindTo::Addresses(vec!["192.0.2.5".parse().unwrap()])
    );
}

#[test]
fn nothing_is_written_before_sync_and_reconcile_repairs() {
    let (mut syncer, mut maps, mut host) = syncer_with_web_service();
    syncer.sync(&mut maps, &mut host, Instant::now());
    assert_eq!(maps.writes, 0, "slices not listed yet: nothing programmed");
    assert_eq!(host.plans.len(), 1, "the node is programmed from the start");
    syncer.reconcile(&mut maps, &mut host);
    assert_eq!(host.retired, 0, "an older layout's programs serve until the first sync is written");
    syncer.apply(SourceEvent::SlicesListed(vec![web_slice(&["10.0.0.7"])]));
    syncer.sync(&mut maps, &mut host, Instant::now());
    assert_eq!(visible(&maps), Some(vec!["10.0.0.7".into()]));
    assert_eq!(host.retired, 1, "and are retired once it is");

    maps.services.clear(); // drift: someone emptied the map
    syncer.reconcile(&mut maps, &mut host);
    assert_eq!(visible(&maps), Some(vec!["10.0.0.7".into()]));
    assert_eq!(host.retired, 1, "once");
}

#[test]
fn network_programming_latency_runs_from_the_slice_trigger_time_to_the_sync() {
    let (mut syncer, mut maps, mut host) = syncer_with_web_service();
    syncer.apply(SourceEvent::SlicesListed(vec![]));
    syncer.sync(&mut maps, &mut host, Instant::now());
    // The agent has run for a minute; a change made 2.5 s ago (the controller's
    // annotation) is delivered now.
    syncer.started = SystemTime::now() - Duration::from_secs(60);
    let mut slice = web_slice(&["10.0.0.1"]);
    let changed = jiff::Timestamp::now() - jiff::SignedDuration::from_millis(2500);
    let annotation = ("endpoints.kubernetes.io/last-change-trigger-time".to_owned(), changed.to_string());
    slice.metadata.annotations = Some([annotation].into());
    syncer.apply(SourceEvent::SliceApplied(slice));
    syncer.sync(&mut maps, &mut host, Instant::now());
    let text = syncer.metrics.encode();
    let bucket =
        |le: &str| format!("kubeproxy_network_programming_duration_seconds_bucket{{le=\"{le}\",ip_family=\"IPv4\"}}");
    assert!(text.contains(&format!("{} 0\n", bucket("2.0"))), "{text}");
    assert!(text.contains(&format!("{} 1\n", bucket("3.0"))), "{text}");
    assert!(text.contains("kubeproxy_sync_proxy_rules_endpoint_changes_total 1\n"));
}

fn link(index: u32, name: &str) -> HostLink {
    HostLink {
        index,
        name: name.into(),
        loopback: false,
        addrs: vec![format!("192.0.2.{index}").parse().unwrap()],
        v4_unselectable: vec![],
        peer_nsid: None,
        ethernet: true,
        rp_filter: 0,
    }
}

/// A new link (a new pod's) gets its programs at the next event, not minSyncPeriod later:
/// until then the pods behind it have no per-packet path. Services, and links that go or
/// change, wait for the period as before.
#[test]
fn a_new_link_is_programmed_without_waiting_for_min_sync_period() {
    let (mut syncer, mut maps, mut host) = syncer_with_web_service();
    syncer.min_sync_period = Duration::from_secs(3600);
    syncer.host_links = vec![link(2, "eth0")];
    syncer.apply(SourceEvent::SlicesListed(vec![web_slice(&["10.0.0.1"])]));
    syncer.sync(&mut maps, &mut host, Instant::now());
    assert_eq!((host.plans.len(), visible(&maps)), (1, Some(vec!["10.0.0.1".into()])));
    let writes = maps.writes;

    syncer.apply(SourceEvent::SliceApplied(web_slice(&["10.0.0.1", "10.0.0.2"])));
    syncer.apply(SourceEvent::Host(vec![link(2, "eth0"), link(7, "veth-new")]));
    assert!(syncer.pending_until().is_some_and(|at| at <= Instant::now()), "due now");
    syncer.sync(&mut maps, &mut host, Instant::now());
    assert_eq!(host.plans.len(), 2, "the new link is programmed");
    assert!(host.plans[1].node_addrs.contains_key(&"192.0.2.7".parse().unwrap()), "with its address");
    assert_eq!(maps.writes, writes, "the service change waits for the period");
    assert!(syncer.pending_until().is_some_and(|at| at > Instant::now() + Duration::from_secs(3000)), "as before");

    syncer.apply(SourceEvent::Host(vec![link(2, "eth0")]));
    syncer.sync(&mut maps, &mut host, Instant::now());
    assert_eq!(host.plans.len(), 2, "a link gone waits for the period");
}

/// After the first sync, an endpoint change writes its own service's entries only, and the
/// maps end as a whole sync of the same objects leaves them (a removed UDP endpoint's flows
/// flushed as before).
#[test]
fn an_endpoint_change_syncs_its_service_alone_to_the_same_maps() {
    let service = |name: &str, ip: &str| {
        service_yaml(&format!(
            "metadata: {{name: {name}, namespace: d}}\nspec: {{clusterIP: {ip}, ports: [{{name: dns, port: 53, protocol: UDP}}]}}"
        ))
    };
    let slice = |name: &str, ips: &[&str]| {
        let eps: Vec<String> = ips.iter().map(|ip| format!("{{addresses: [{ip}]}}")).collect();
        slice_yaml(&format!(
            "metadata: {{name: {name}-1, namespace: d, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: dns, port: 5353, protocol: UDP}}]\nendpoints: [{}]",
            eps.join(", ")
        ))
    };
    let services = || vec![service("web", "10.96.0.10"), service("api", "10.96.0.11"), service("db", "10.96.0.12")];
    let capacity = Capacity { service_ports: 64, backends: 256 };
    let syncer_on = |maps: &mut FakeMaps| {
        let programmer = Programmer::recover(maps).unwrap().without_quarantine();
        Syncer::new(ClusterState::new(NodeInfo::default()), programmer, NodeSettings::default())
    };
    let mut maps = FakeMaps::new(capacity);
    let mut syncer = syncer_on(&mut maps);
    let mut host = FakeHost::default();
    syncer.apply(SourceEvent::ServicesListed(services()));
    let slices = vec![slice("web", &["10.0.0.1", "10.0.0.2"]), slice("api", &["10.0.1.1"]), slice("db", &["10.0.2.1"])];
    syncer.apply(SourceEvent::SlicesListed(slices));
    syncer.sync(&mut maps, &mut host, Instant::now());
    assert!(!syncer.last_sync_partial, "the first sync is whole");
    let writes = maps.writes;

    syncer.apply(SourceEvent::SliceApplied(slice("web", &["10.0.0.1", "10.0.0.3"])));
    syncer.sync(&mut maps, &mut host, Instant::now());
    assert!(syncer.last_sync_partial);
    assert_eq!(maps.writes - writes, 9, "web's three entries (one per scope) and their two backends, nothing else");
    let web = service_key("10.96.0.10".parse::<std::net::IpAddr>().unwrap(), 53, Protocol::Udp);
    let seen = |maps: &FakeMaps, key| maps.visible_backends(key).unwrap().iter().map(backend_addr).collect::<Vec<_>>();
    assert_eq!(seen(&maps, &web), [("10.0.0.1".parse().unwrap(), 5353), ("10.0.0.3".parse().unwrap(), 5353)]);
    let flushed: Vec<_> = maps.flushed.iter().flat_map(|(_, gone)| gone.iter().map(|(a, p)| (*a, *p))).collect();
    let gone = (proxy_common::Addr::from("10.0.0.2".parse::<std::net::IpAddr>().unwrap()), 5353);
    assert!(flushed.contains(&gone), "the removed endpoint's flows are flushed: {flushed:?}");
    assert!(maps.violations.is_empty(), "{:?}", maps.violations);

    // The same objects synced whole on fresh maps: every frontend sees the same backends.
    let mut whole = FakeMaps::new(capacity);
    let mut other = syncer_on(&mut whole);
    other.apply(SourceEvent::ServicesListed(services()));
    let slices = vec![slice("web", &["10.0.0.1", "10.0.0.3"]), slice("api", &["10.0.1.1"]), slice("db", &["10.0.2.1"])];
    other.apply(SourceEvent::SlicesListed(slices));
    other.sync(&mut whole, &mut FakeHost::default(), Instant::now());
    assert_eq!(maps.services.keys().collect::<Vec<_>>(), whole.services.keys().collect::<Vec<_>>());
    for key in whole.services.keys() {
        assert_eq!(seen(&maps, key), seen(&whole, key));
    }
    assert_eq!(syncer.programmer.slots_in_use(), 12, "4 backends in 3 scopes");
}
