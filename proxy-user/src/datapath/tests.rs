use std::net::Ipv4Addr;

use proxy_common::{MAGLEV_DEFAULT_TABLE_SIZE, ServiceKey};

use super::{fake::FakeMaps, *};
use crate::model::{
    ObjectKey, Protocol, ServicePortName,
    desired::{Desired, DesiredPort, service_key},
};

const CAP: Capacity = Capacity { service_ports: 8, backends: 16 };

fn key(n: u8) -> ServiceKey {
    service_key(Ipv4Addr::new(10, 96, 0, n), 80, Protocol::Tcp)
}

fn port(n: u8, backends: &[u8]) -> DesiredPort {
    DesiredPort {
        name: ServicePortName {
            service: ObjectKey::new("ns", format!("svc{n}")),
            port: String::new(),
            protocol: Protocol::Tcp,
        },
        backends: backends.iter().map(|b| (Ipv4Addr::new(10, 0, 0, *b).into(), 8080)).collect(),
        flags: 0,
        source_ranges: vec![],
        affinity_timeout: 0,
        serving: vec![],
        alive: None,
        remote: Vec::new(),
    }
}

fn cidr(s: &str) -> crate::model::cidr::Cidr {
    s.parse().unwrap()
}

fn desired(entries: &[(u8, &[u8])]) -> Desired {
    entries.iter().map(|(n, b)| (key(*n), port(*n, b))).collect()
}

fn visible(maps: &FakeMaps, n: u8) -> Option<Vec<u8>> {
    maps.visible_backends(&key(n)).map(|bs| {
        bs.iter().map(|b| backend_addr(b).0.to_string().rsplit('.').next().unwrap().parse().unwrap()).collect()
    })
}

#[test]
fn programs_updates_and_removes_in_a_safe_order() {
    let mut maps = FakeMaps::new(CAP);
    let mut p = Programmer::recover(&mut maps).unwrap();
    let r = p.apply(&desired(&[(1, &[1, 2, 3]), (2, &[])]), &mut maps);
    assert_eq!(r, ApplyReport { added: 2, ..Default::default() });
    assert_eq!(visible(&maps, 1), Some(vec![1, 2, 3]));
    assert_eq!(visible(&maps, 2), Some(vec![]), "no endpoints: an entry with zero backends (reject)");

    let r = p.apply(&desired(&[(1, &[1, 3]), (2, &[4])]), &mut maps);
    assert_eq!(r, ApplyReport { updated: 2, ..Default::default() });
    assert_eq!(visible(&maps, 1), Some(vec![1, 3]));
    let id1 = maps.services[&key(1)].service_id;

    let r = p.apply(&desired(&[(1, &[1, 3])]), &mut maps);
    assert_eq!(r, ApplyReport { removed: 1, ..Default::default() });
    assert_eq!(visible(&maps, 2), None);
    assert_eq!(maps.services[&key(1)].service_id, id1, "ids are stable across updates");
    assert!(maps.violations.is_empty(), "{:?}", maps.violations);
}

#[test]
fn unchanged_services_are_not_rewritten() {
    let mut maps = FakeMaps::new(CAP);
    let mut p = Programmer::recover(&mut maps).unwrap();
    let d = desired(&[(1, &[1, 2]), (2, &[3]), (3, &[4])]);
    p.apply(&d, &mut maps);
    let before = maps.writes;
    let mut changed = d.clone();
    changed.get_mut(&key(2)).unwrap().backends.push((Ipv4Addr::new(10, 0, 0, 9).into(), 8080));
    let r = p.apply(&changed, &mut maps);
    assert_eq!(r, ApplyReport { updated: 1, ..Default::default() });
    assert_eq!(maps.writes - before, 3, "two backend slots and one service entry");
    assert_eq!(p.apply(&changed, &mut maps).changes(), 0);
}

#[test]
fn full_maps_skip_the_service_and_keep_the_old_state() {
    let mut maps = FakeMaps::new(Capacity { service_ports: 2, backends: 5 });
    let mut p = Programmer::recover(&mut maps).unwrap().without_quarantine();
    let r = p.apply(&desired(&[(1, &[1, 2]), (2, &[3, 4]), (3, &[5])]), &mut maps);
    assert_eq!((r.added, r.failed), (2, 1), "third service port does not fit the services map");
    assert_eq!(visible(&maps, 3), None);
    // Growing service 1 needs 3 fresh slots while the old 2 are still live: no room.
    let r = p.apply(&desired(&[(1, &[1, 2, 6]), (2, &[3, 4])]), &mut maps);
    assert_eq!(r.failed, 1);
    assert_eq!(visible(&maps, 1), Some(vec![1, 2]), "old backends stay programmed");
    // Once service 2 is gone (and its range out of quarantine) it fits.
    p.apply(&desired(&[(1, &[1, 2])]), &mut maps);
    let r = p.apply(&desired(&[(1, &[1, 2, 6])]), &mut maps);
    assert_eq!(r.updated, 1);
    assert_eq!(visible(&maps, 1), Some(vec![1, 2, 6]));
    assert!(maps.violations.is_empty(), "{:?}", maps.violations);
}

/// What `f` logs (errors and warnings included), as text.
fn logged(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Capture(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Capture {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    // tracing caches, per log statement, whether any subscriber wants it: one first reached on
    // another test's thread while no subscriber wanted anything was cached as "never", and this
    // capture saw nothing (1 run in about 20). A process-wide subscriber that asks again at
    // every event ("sometimes") and takes none keeps that cache from saying "never".
    static ASK_EVERY_TIME: std::sync::Once = std::sync::Once::new();
    ASK_EVERY_TIME.call_once(|| {
        use tracing_subscriber::layer::SubscriberExt as _;
        let none = tracing_subscriber::registry().with(tracing_subscriber::filter::filter_fn(|_| false));
        let _ = tracing::subscriber::set_global_default(none);
    });
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt().with_ansi(false).with_writer(move || writer.clone()).finish();
    tracing::subscriber::with_default(subscriber, || {
        tracing::callsite::rebuild_interest_cache();
        f()
    });
    String::from_utf8(capture.0.lock().unwrap().clone()).unwrap()
}

/// A reconcile rebuilds the programmer from the maps (every sync period): a service port that
/// still does not fit is not logged again (20k Services on a too-small map logged 14k errors
/// every 30 s), and one no longer wanted stops counting as failing.
#[test]
fn a_port_that_does_not_fit_is_logged_once_across_reconciles() {
    let mut maps = FakeMaps::new(Capacity { service_ports: 2, backends: 8 });
    let mut p = Programmer::recover(&mut maps).unwrap();
    let d = desired(&[(1, &[1]), (2, &[2]), (3, &[3])]);
    let first = logged(|| assert_eq!(p.apply(&d, &mut maps).failed, 1));
    assert_eq!(first.matches("the services map is full").count(), 1, "{first}");
    for _ in 0..2 {
        let mut rebuilt = Programmer::recover(&mut maps).unwrap();
        rebuilt.carry_over(&p);
        p = rebuilt;
        let again = logged(|| assert_eq!(p.apply(&d, &mut maps).failed, 1, "still no room"));
        assert!(!again.contains("the services map is full"), "logged again: {again}");
        assert!(p.has_failures());
    }
    p.apply(&desired(&[(1, &[1]), (2, &[2])]), &mut maps);
    assert!(!p.has_failures(), "the port that did not fit is no longer wanted");
}

#[test]
fn a_failed_write_is_retried_on_the_next_apply() {
    let mut maps = FakeMaps::new(CAP);
    let mut p = Programmer::recover(&mut maps).unwrap();
    maps.fail_service_writes = 1;
    let d = desired(&[(1, &[1])]);
    assert_eq!(p.apply(&d, &mut maps).failed, 1);
    assert_eq!(visible(&maps, 1), None);
    assert_eq!(p.apply(&d, &mut maps).added, 1);
    assert_eq!(visible(&maps, 1), Some(vec![1]));
}

#[test]
fn recovers_from_existing_maps_and_repairs_drift() {
    let mut maps = FakeMaps::new(CAP);
    let mut p = Programmer::recover(&mut maps).unwrap();
    let d = desired(&[(1, &[1, 2]), (2, &[3])]);
    p.apply(&d, &mut maps);
    let ids: Vec<u32> = maps.services.values().map(|v| v.service_id).collect();

    // A restarted agent sees the same state and has nothing to write.
    let mut p = Programmer::recover(&mut maps).unwrap();
    assert_eq!(p.apply(&d, &mut maps).changes(), 0);

    // Someone deletes an entry and corrupts another behind our back: a reconcile repairs both.
    maps.services.remove(&key(1));
    maps.services.get_mut(&key(2)).unwrap().backends_start = 16; // runs past the array end
    maps.services.insert(
        key(9),
        ServiceValue {
            service_id: ids[0],
            backends_start: 0,
            backends_count: 1,
            flags: 0,
            affinity_timeout: 0,
            affinity_id: 0,
        },
    );
    let mut p = Programmer::recover(&mut maps).unwrap();
    let r = p.apply(&d, &mut maps);
    assert_eq!((r.added, r.removed), (2, 1), "{r:?}");
    assert_eq!(visible(&maps, 1), Some(vec![1, 2]));
    assert_eq!(visible(&maps, 2), Some(vec![3]));
    assert_eq!(visible(&maps, 9), None);
    assert!(maps.violations.is_empty(), "{:?}", maps.violations);
}

/// A full loadBalancerSourceRanges map is one service's failure, not the node's: a service
/// whose ranges do not fit is left out whole (its other ports too), every other service is
/// programmed, and it goes in once there is room.
#[test]
fn a_full_source_range_map_stops_only_the_service_that_does_not_fit() {
    let mut maps = FakeMaps::new(CAP);
    maps.source_range_capacity = 3;
    let mut p = Programmer::recover(&mut maps).unwrap();
    let ranged = |d: &mut Desired, n: u8, ranges: &[&str]| {
        let entry = d.get_mut(&key(n)).unwrap();
        entry.flags = proxy_common::SERVICE_FLAG_SOURCE_RANGES;
        entry.source_ranges = ranges.iter().map(|r| cidr(r)).collect();
    };
    let mut d = desired(&[(1, &[1]), (2, &[2])]);
    ranged(&mut d, 1, &["10.0.0.0/8", "192.0.2.0/24"]);
    p.apply(&d, &mut maps);
    assert_eq!(p.source_ranges_use(), (2, 3));
    // Service 3 wants two more ranges (one fits); service 4 and a change to service 2 none.
    d.extend(desired(&[(3, &[3]), (4, &[4])]));
    ranged(&mut d, 3, &["198.51.100.0/24", "203.0.113.0/24"]);
    d.get_mut(&key(2)).unwrap().backends = vec![(Ipv4Addr::new(10, 0, 0, 5).into(), 8080)];
    let report = p.apply(&d, &mut maps);
    assert_eq!((report.added, report.updated, report.failed), (1, 1, 1), "{report:?}");
    assert!(!maps.services.contains_key(&key(3)), "left out whole");
    assert!(maps.services.contains_key(&key(4)), "another service goes in");
    assert_eq!(maps.visible_backends(&key(2)), Some(vec![backend(Ipv4Addr::new(10, 0, 0, 5), 8080)]));
    assert!(p.has_failures());
    // Service 1 gives up a range: service 3 fits at the next apply.
    ranged(&mut d, 1, &["10.0.0.0/8"]);
    p.apply(&d, &mut maps);
    p.apply(&d, &mut maps);
    assert!(maps.services.contains_key(&key(3)));
    assert_eq!(p.source_ranges_use(), (3, 3));
}

#[test]
fn source_ranges_are_written_before_the_entry_and_cleaned_up_after() {
    let mut maps = FakeMaps::new(CAP);
    let mut p = Programmer::recover(&mut maps).unwrap();
    let mut d = desired(&[(1, &[1])]);
    let entry = d.get_mut(&key(1)).unwrap();
    entry.flags = proxy_common::SERVICE_FLAG_SOURCE_RANGES;
    entry.source_ranges = vec![cidr("10.0.0.0/8")];
    p.apply(&d, &mut maps);
    let id = maps.services[&key(1)].service_id;
    assert_eq!(maps.source_ranges.iter().copied().collect::<Vec<_>>(), [(id, cidr("10.0.0.0/8"))]);

    d.get_mut(&key(1)).unwrap().source_ranges = vec![cidr("192.0.2.0/24")];
    assert_eq!(p.apply(&d, &mut maps).updated, 1, "a range change rewrites the entry");
    assert_eq!(maps.source_ranges.iter().copied().collect::<Vec<_>>(), [(id, cidr("192.0.2.0/24"))]);

    // A restarted agent knows them, and removing the service removes them.
    let mut p = Programmer::recover(&mut maps).unwrap();
    assert_eq!(p.apply(&d, &mut maps).changes(), 0);
    p.apply(&Desired::new(), &mut maps);
    assert!(maps.source_ranges.is_empty());
}

/// The UDP DNS-like service port of the flush tests: 10.96.0.53:53.
fn udp_key() -> ServiceKey {
    service_key(Ipv4Addr::new(10, 96, 0, 53), 53, Protocol::Udp)
}

/// Endpoint `n` of the flush tests: 10.0.0.n.
fn endpoint_ip(n: u8) -> std::net::IpAddr {
    Ipv4Addr::new(10, 0, 0, n).into()
}

/// A UDP service port picking `picked` (endpoints on 8080) whose serving endpoints are `serving`.
fn udp_port(picked: &[(u8, u16)], serving: &[(u8, u16)]) -> DesiredPort {
    let mut dns = port(53, &[]);
    dns.name.protocol = Protocol::Udp;
    dns.backends = picked.iter().map(|(n, p)| (endpoint_ip(*n), *p)).collect();
    dns.serving = serving.iter().map(|(n, p)| std::net::SocketAddr::new(endpoint_ip(*n), *p)).collect();
    dns
}

/// kube-proxy's conntrack cleanup (1.31+, `pkg/proxy/conntrack/cleanup.go`): UDP flows to an
/// endpoint are flushed when it stops serving, not when it stops being picked; while nothing
/// serves, flows are left alone; TCP flows never.
#[test]
fn udp_flows_are_flushed_when_their_endpoint_stops_serving_tcp_flows_never() {
    let mut maps = FakeMaps::new(CAP);
    let mut p = Programmer::recover(&mut maps).unwrap();
    let udp = udp_key();
    let addr = |n: u8| Addr::from(endpoint_ip(n));
    let mut d = desired(&[(1, &[1, 2])]);
    let on_8080 = |ns: &[u8]| ns.iter().map(|n| (*n, 8080)).collect::<Vec<_>>();
    let dns = |picked: &[u8], serving: &[u8]| udp_port(&on_8080(picked), &on_8080(serving));
    d.insert(udp, dns(&[1, 2, 3], &[1, 2, 3]));
    p.apply(&d, &mut maps);
    let id = maps.services[&udp].service_id;
    // 3 terminates but still serves: no longer picked (the others are ready), its flows go on.
    d.insert(udp, dns(&[1, 2], &[1, 2, 3]));
    // (the TCP service loses endpoint 2: its flows are never flushed)
    d.insert(key(1), port(1, &[1]));
    p.apply(&d, &mut maps);
    assert_eq!(maps.flushed, vec![], "an endpoint that serves keeps its UDP flows");
    // 3 stops serving (its pod is gone), with no change to what is picked: now its flows go.
    d.insert(udp, dns(&[1, 2], &[1, 2]));
    p.apply(&d, &mut maps);
    assert_eq!(maps.flushed, vec![(id, vec![(addr(3), 8080)])]);
    // 2 leaves for good.
    d.insert(udp, dns(&[1], &[1]));
    p.apply(&d, &mut maps);
    assert_eq!(maps.flushed[1..], [(id, vec![(addr(2), 8080)])]);
    // Nothing serves: flows are left as they are...
    d.insert(udp, dns(&[], &[]));
    p.apply(&d, &mut maps);
    assert_eq!(maps.flushed.len(), 2, "nothing serves: nothing flushed");
    // ...until something serves again: then the flows to 1 go.
    d.insert(udp, dns(&[4], &[4]));
    p.apply(&d, &mut maps);
    assert_eq!(maps.flushed[2..], [(id, vec![(addr(1), 8080)])]);
    // A reconcile (a programmer rebuilt from the maps) keeps what flows may still reach.
    d.insert(udp, dns(&[], &[]));
    p.apply(&d, &mut maps);
    let mut rebuilt = Programmer::recover(&mut maps).unwrap();
    rebuilt.carry_over(&p);
    d.insert(udp, dns(&[5], &[5]));
    rebuilt.apply(&d, &mut maps);
    assert_eq!(maps.flushed[3..], [(id, vec![(addr(4), 8080)])]);
    // Deleting the UDP service flushes its flows.
    rebuilt.apply(&desired(&[(1, &[1])]), &mut maps);
    assert_eq!(maps.flushed[4..], [(id, vec![(addr(5), 8080)])], "deleting the UDP service flushes its flows");
}

/// `--abort-dead-tcp`: TCP flows end when their endpoint dies (leaves `alive`), not when it
/// stops being picked or terminates; they end even when no endpoint is left; without the
/// option (`alive` None) never.
#[test]
fn tcp_flows_end_when_their_endpoint_dies_and_only_with_the_option() {
    let mut maps = FakeMaps::new(CAP);
    let mut p = Programmer::recover(&mut maps).unwrap();
    let addr = |n: u8| Addr::from(endpoint_ip(n));
    let web = |picked: &[u8], alive: &[u8]| {
        let mut web = port(1, picked);
        web.alive = Some(alive.iter().map(|n| std::net::SocketAddr::new(endpoint_ip(*n), 8080)).collect());
        web
    };
    let mut d = desired(&[(2, &[1, 2])]);
    d.insert(key(1), web(&[1, 2, 3], &[1, 2, 3]));
    p.apply(&d, &mut maps);
    let id = maps.services[&key(1)].service_id;
    // 3 terminates (no longer picked, still alive): its flows go on; so do service 2's, which
    // ends no flows, when it loses endpoint 2.
    d.insert(key(1), web(&[1, 2], &[1, 2, 3]));
    d.insert(key(2), port(2, &[1]));
    p.apply(&d, &mut maps);
    assert_eq!(maps.flushed, vec![], "a terminating endpoint keeps its TCP flows");
    // 3 dies without a change to what is picked: its flows end.
    d.insert(key(1), web(&[1, 2], &[1, 2]));
    p.apply(&d, &mut maps);
    assert_eq!(maps.flushed, vec![(id, vec![(addr(3), 8080)])]);
    // The last two die at once: both end, though nothing is left.
    d.insert(key(1), web(&[], &[]));
    p.apply(&d, &mut maps);
    assert_eq!(maps.flushed[1..], [(id, vec![(addr(1), 8080), (addr(2), 8080)])]);
    // Deleting the TCP service ends nothing (its endpoints did not die).
    d.insert(key(1), web(&[4], &[4]));
    p.apply(&d, &mut maps);
    d.remove(&key(1));
    p.apply(&d, &mut maps);
    assert_eq!(maps.flushed.len(), 2, "{:?}", maps.flushed);
}

/// Upstream's `CleanStaleEntries` (1.33+) matches an endpoint by address and port: a new
/// targetPort (the same pods) moves UDP flows off the old port (e2e "Conntrack should be able
/// to cleanup conntrack entries when UDP service target port changes for a NodePort service").
#[test]
fn a_new_target_port_flushes_the_udp_flows_to_the_old_one() {
    let mut maps = FakeMaps::new(CAP);
    let mut p = Programmer::recover(&mut maps).unwrap();
    let udp = udp_key();
    let ip = endpoint_ip;
    let dns = |target: u16| udp_port(&[(1, target)], &[(1, target)]);
    let mut d = desired(&[]);
    d.insert(udp, dns(8080));
    p.apply(&d, &mut maps);
    let id = maps.services[&udp].service_id;
    d.insert(udp, dns(9090));
    p.apply(&d, &mut maps);
    assert_eq!(maps.flushed, vec![(id, vec![(Addr::from(ip(1)), 8080)])]);
    p.apply(&d, &mut maps);
    assert_eq!(maps.flushed.len(), 1, "flushed once");
}

#[test]
fn released_slots_wait_out_the_quarantine() {
    let mut maps = FakeMaps::new(Capacity { service_ports: 4, backends: 4 });
    let mut p = Programmer::recover(&mut maps).unwrap();
    p.apply(&desired(&[(1, &[1, 2, 3, 4])]), &mut maps);
    p.apply(&desired(&[]), &mut maps);
    let r = p.apply(&desired(&[(2, &[5])]), &mut maps);
    assert_eq!(r.failed, 1, "the removed service's slots may still be read by a connect in flight");
    assert!(p.has_failures() && p.quarantine_ends().is_some(), "a retry is due when the quarantine ends");
    std::thread::sleep(super::slots::QUARANTINE);
    assert_eq!(p.apply(&desired(&[(2, &[5])]), &mut maps).added, 1);
    assert!(maps.violations.is_empty(), "{:?}", maps.violations);
}

#[test]
fn removing_endpoints_succeeds_with_a_full_backend_array() {
    let mut maps = FakeMaps::new(Capacity { service_ports: 4, backends: 4 });
    let mut p = Programmer::recover(&mut maps).unwrap();
    p.apply(&desired(&[(1, &[1, 2, 3, 4])]), &mut maps);
    // No free slot for a fresh range of 2: the remaining endpoints are rewritten in place.
    let r = p.apply(&desired(&[(1, &[2, 4])]), &mut maps);
    assert_eq!((r.updated, r.failed), (1, 0), "{r:?}");
    assert_eq!(visible(&maps, 1), Some(vec![2, 4]), "the removed endpoints get no new connections");
    assert!(maps.violations.is_empty(), "{:?}", maps.violations);
    // The tail is released (after its quarantine): a new one-endpoint service fits.
    let mut p = Programmer::recover(&mut maps).unwrap().without_quarantine();
    assert_eq!(p.apply(&desired(&[(1, &[2, 4]), (2, &[7])]), &mut maps).added, 1);
    assert_eq!(visible(&maps, 2), Some(vec![7]));
}

#[test]
fn a_service_is_programmed_whole_or_not_at_all() {
    let mut maps = FakeMaps::new(Capacity { service_ports: 8, backends: 3 });
    let mut p = Programmer::recover(&mut maps).unwrap();
    // Two ports of one service (as a ClusterIP and its NodePort): 2 + 2 slots, 3 available.
    let mut d = desired(&[(1, &[1, 2])]);
    let mut node_port = port(1, &[1, 2]);
    node_port.name.port = "np".into();
    d.insert(key(2), node_port);
    let r = p.apply(&d, &mut maps);
    assert_eq!((r.added, r.failed), (0, 2), "{r:?}");
    assert_eq!((visible(&maps, 1), visible(&maps, 2)), (None, None), "neither half is programmed");
    assert!(maps.violations.is_empty(), "{:?}", maps.violations);
}

#[test]
fn a_service_without_endpoints_gets_some_and_moves_them() {
    // An entry with no backends has range start 0; a fresh range at 0 is not "in place".
    let mut maps = FakeMaps::new(Capacity { service_ports: 4, backends: 4 });
    let mut p = Programmer::recover(&mut maps).unwrap().without_quarantine();
    p.apply(&desired(&[(1, &[])]), &mut maps);
    assert_eq!(p.apply(&desired(&[(1, &[2])]), &mut maps).updated, 1);
    assert_eq!(p.apply(&desired(&[(1, &[3])]), &mut maps).updated, 1);
    assert_eq!(visible(&maps, 1), Some(vec![3]));
    assert_eq!(p.apply(&desired(&[(1, &[])]), &mut maps).updated, 1);
    assert_eq!(p.apply(&desired(&[(1, &[1, 2, 3, 4])]), &mut maps).updated, 1, "all four slots free again");
    assert!(maps.violations.is_empty(), "{:?}", maps.violations);
}

/// A Maglev frontend's table is written with its backends (each slot an index into them, as
/// the model builds it from the seed), rewritten when they change and after a restart, and
/// removed with the entry or its flag.
#[test]
fn maglev_tables_follow_their_frontends_backends() {
    let mut maps = FakeMaps::new(CAP);
    maps.maglev_seed = 7;
    let maglev = |n: u8, backends: &[u8]| DesiredPort { flags: proxy_common::SERVICE_FLAG_MAGLEV, ..port(n, backends) };
    let table = |backends: &[u8]| {
        let endpoints: Vec<std::net::SocketAddr> =
            backends.iter().map(|b| (Ipv4Addr::new(10, 0, 0, *b), 8080).into()).collect();
        crate::model::maglev::table(&endpoints, MAGLEV_DEFAULT_TABLE_SIZE, 7).unwrap()
    };
    let mut p = Programmer::recover(&mut maps).unwrap();
    let want: Desired = [(key(1), maglev(1, &[1, 2, 3])), (key(2), port(2, &[4]))].into_iter().collect();
    p.apply(&want, &mut maps);
    let id = |maps: &FakeMaps, n| maps.services[&key(n)].service_id;
    assert_eq!(maps.maglev.keys().copied().collect::<Vec<_>>(), vec![id(&maps, 1)], "only the Maglev frontend");
    assert_eq!(maps.maglev[&id(&maps, 1)], table(&[1, 2, 3]));

    let want: Desired = [(key(1), maglev(1, &[1, 3])), (key(2), port(2, &[4]))].into_iter().collect();
    p.apply(&want, &mut maps);
    assert_eq!(maps.maglev[&id(&maps, 1)], table(&[1, 3]), "rewritten with the backends");

    // A reconcile (the programmer rebuilt from the maps) leaves whole tables as they are,
    // removes one no entry owns and writes a missing one; a start writes all anew (the seed
    // may have changed).
    let seed7 = table(&[1, 3]);
    maps.maglev_seed = 8;
    maps.maglev.insert(999, seed7.clone());
    let p = Programmer::recover(&mut maps).unwrap();
    assert_eq!(maps.maglev.keys().copied().collect::<Vec<_>>(), vec![id(&maps, 1)], "the orphan removed");
    assert_eq!(maps.maglev[&id(&maps, 1)], seed7, "a whole table left as it is");
    let endpoints: Vec<std::net::SocketAddr> =
        [1u8, 3].iter().map(|b| (Ipv4Addr::new(10, 0, 0, *b), 8080).into()).collect();
    let seed8 = crate::model::maglev::table(&endpoints, MAGLEV_DEFAULT_TABLE_SIZE, 8).unwrap();
    p.rewrite_maglev_tables(&mut maps);
    assert_eq!(maps.maglev[&id(&maps, 1)], seed8, "written anew at a start");
    maps.maglev.clear();
    Programmer::recover(&mut maps).unwrap();
    assert_eq!(maps.maglev[&id(&maps, 1)], seed8, "a missing table written");
    // Another table size (the flag changed): a table of the old size is not whole.
    maps.maglev_table_size = 251;
    Programmer::recover(&mut maps).unwrap();
    assert_eq!(maps.maglev[&id(&maps, 1)], crate::model::maglev::table(&endpoints, 251, 8).unwrap(), "resized");
    maps.maglev_table_size = MAGLEV_DEFAULT_TABLE_SIZE;
    let mut p = Programmer::recover(&mut maps).unwrap();
    assert_eq!(maps.maglev[&id(&maps, 1)], seed8);

    // A write of the entries that fails leaves no table behind for a new entry, and the old
    // table for an entry that stays as it was.
    maps.fail_service_writes = 1;
    let want: Desired = [(key(1), maglev(1, &[1, 2])), (key(3), maglev(3, &[5]))].into_iter().collect();
    p.apply(&want, &mut maps);
    assert_eq!(maps.maglev.keys().copied().collect::<Vec<_>>(), vec![id(&maps, 1)], "no table for the new entry");
    assert_eq!(maps.maglev[&id(&maps, 1)], seed8, "the old entry's table");

    let want: Desired = [(key(1), port(1, &[1, 3])), (key(2), port(2, &[4]))].into_iter().collect();
    p.apply(&want, &mut maps);
    assert!(maps.maglev.is_empty(), "the flag gone, the table with it");
    let want: Desired = [(key(1), maglev(1, &[1, 3]))].into_iter().collect();
    p.apply(&want, &mut maps);
    assert_eq!(maps.maglev.len(), 1);
    p.apply(&Desired::new(), &mut maps);
    assert!(maps.maglev.is_empty(), "the entry gone, the table with it");
}

/// Frontends with the same endpoints (a Service's NodePort, externalIPs and LoadBalancer IPs)
/// get the same table, built once for them and written to each; another set gets its own.
#[test]
fn frontends_with_the_same_endpoints_share_one_maglev_table() {
    let mut maps = FakeMaps::new(CAP);
    let maglev = |n: u8, backends: &[u8]| DesiredPort { flags: proxy_common::SERVICE_FLAG_MAGLEV, ..port(n, backends) };
    let mut p = Programmer::recover(&mut maps).unwrap();
    let want: Desired = [
        (key(1), maglev(1, &[1, 2])),
        (key(2), maglev(2, &[3])),
        (key(3), maglev(3, &[1, 2])),
        (key(4), maglev(4, &[1, 2])),
    ]
    .into_iter()
    .collect();
    p.apply(&want, &mut maps);
    let table = |n| maps.maglev[&maps.services[&key(n)].service_id].clone();
    let endpoints: Vec<std::net::SocketAddr> =
        [1u8, 2].iter().map(|b| (Ipv4Addr::new(10, 0, 0, *b), 8080).into()).collect();
    let shared = crate::model::maglev::table(&endpoints, MAGLEV_DEFAULT_TABLE_SIZE, maps.maglev_seed as u64).unwrap();
    assert_eq!((table(1), table(3), table(4)), (shared.clone(), shared.clone(), shared));
    assert!(table(2).iter().all(|slot| *slot == 0), "the one endpoint of the other set");
}

#[test]
fn a_subset_is_found_in_one_walk_of_both_lists() {
    let b = |last: u8, port: u16| backend(std::net::Ipv4Addr::new(10, 0, 0, last), port);
    let old = [b(1, 80), b(2, 80), b(2, 81), b(9, 80)];
    assert!(super::is_subset(&[b(2, 80), b(9, 80)], &old));
    assert!(super::is_subset(&[], &old));
    assert!(!super::is_subset(&[b(2, 80), b(3, 80)], &old), "10.0.0.3 is new");
    assert!(!super::is_subset(&[b(9, 81)], &old));
    let remote = proxy_common::Backend { flags: proxy_common::BACKEND_FLAG_REMOTE, ..b(2, 80) };
    assert!(!super::is_subset(&[remote], &old), "the same endpoint flagged otherwise is a change");
}
