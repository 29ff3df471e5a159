//! `kpr services`: what the datapath holds, read from the pinned maps (also while no agent runs),
//! with each frontend's counters and, when the agent answers, the Service port it serves.
use std::{collections::BTreeMap, fmt::Write as _, net::SocketAddr, path::Path, time::Duration};

use anyhow::Result;
use proxy_common::{ServiceKey, ServiceStats, event, service_stat};
use serde::Serialize;

use crate::{
    datapath::{
        Maps as _, Programmed, backend_addr,
        bpf::{self, BpfMaps},
    },
    model::{
        display_key,
        outliers::{Endpoint, Sidelined},
    },
};

/// One service port as the maps hold it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PortView {
    /// `10.96.0.10:80/6`, with ` ext`/` node` for frontends only that source class sees.
    pub frontend: String,
    pub service_id: u32,
    pub backends: Vec<String>,
    /// Endpoints the agent's outlier detection leaves out of `backends` for now (none when no
    /// agent answers).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sidelined: Vec<String>,
    /// Without backends: what happens to new connections (`reject` or `drop`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_endpoints: Option<&'static str>,
    pub flags: Vec<&'static str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub source_ranges: Vec<String>,
    /// sessionAffinity ClientIP timeout.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_seconds: Option<u32>,
    /// `namespace/name:port/protocol`, as the agent names it (none when no agent answers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_port: Option<String>,
    /// What this frontend saw (none before its first flow, connect or refusal).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats: Option<PortStats>,
}

/// A frontend's counters (`KPR_SERVICE_STATS`; `/metrics` sums a port's frontends).
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PortStats {
    #[serde(flatten)]
    pub flows: FlowCounts,
    pub rejects: u64,
    /// Drops (and dead-flow resets) by reason; only those that happened.
    pub drops: BTreeMap<&'static str, u64>,
}

/// The words a frontend and an endpoint both have (`service_stat::NEW_FLOWS..=BYTES`).
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FlowCounts {
    pub new_flows: u64,
    pub socket_connects: u64,
    pub unanswered_flows: u64,
    pub packets: u64,
    pub bytes: u64,
}

impl FlowCounts {
    /// From a `ServiceStats` or `EndpointStats` value's words.
    fn of(words: &[u64]) -> Self {
        let word = |w: u32| words[w as usize];
        Self {
            new_flows: word(service_stat::NEW_FLOWS),
            socket_connects: word(service_stat::CONNECTS),
            unanswered_flows: word(service_stat::UNANSWERED),
            packets: word(service_stat::PACKETS),
            bytes: word(service_stat::BYTES),
        }
    }
}

impl PortStats {
    pub fn new(stats: &ServiceStats) -> Self {
        let word = |w: u32| stats.word(w);
        let drops = (0..event::COUNT)
            .filter(|r| *r != event::REJECTED && word(service_stat::EVENTS + r) != 0)
            .map(|r| (event::NAMES[r as usize], word(service_stat::EVENTS + r)))
            .collect();
        Self { flows: FlowCounts::of(&stats.words), rejects: word(service_stat::EVENTS + event::REJECTED), drops }
    }

    fn line(&self) -> String {
        let mut line = format!(
            "new flows {} connects {} unanswered {} packets {} bytes {} rejects {}",
            self.flows.new_flows,
            self.flows.socket_connects,
            self.flows.unanswered_flows,
            self.flows.packets,
            self.flows.bytes,
            self.rejects
        );
        for (reason, count) in &self.drops {
            let _ = write!(line, " {reason} {count}");
        }
        line
    }
}

impl PortView {
    pub fn new(key: &ServiceKey, programmed: &Programmed) -> Self {
        let value = &programmed.value;
        let backends = backends(programmed);
        let drops = value.flags & proxy_common::SERVICE_FLAG_DROP_NO_ENDPOINTS != 0;
        let no_endpoints = backends.is_empty().then_some(if drops { "drop" } else { "reject" });
        let names = [
            (proxy_common::SERVICE_FLAG_SNAT, "masquerade"),
            (proxy_common::SERVICE_FLAG_SOURCE_RANGES, "source-ranges"),
            (proxy_common::SERVICE_FLAG_SOCKET_SKIP, "per-packet-only"),
            (proxy_common::SERVICE_FLAG_EXTERNAL_ADDR, "not-for-agent"),
            (proxy_common::SERVICE_FLAG_MAGLEV, "maglev"),
            (proxy_common::SERVICE_FLAG_DSR, "direct-return"),
        ];
        let flags = names.into_iter().filter(|(bit, _)| value.flags & bit != 0).map(|(_, name)| name).collect();
        let source_ranges = programmed.source_ranges.iter().map(ToString::to_string).collect();
        Self {
            frontend: display_key(key).to_string(),
            service_id: value.service_id,
            backends,
            sidelined: Vec::new(),
            no_endpoints,
            flags,
            source_ranges,
            affinity_seconds: (value.affinity_timeout != 0).then_some(value.affinity_timeout),
            service_port: None,
            stats: None,
        }
    }

    /// One line: frontend, id, backends (or the no-endpoint verdict), flags.
    pub fn line(&self) -> String {
        let shown = match self.no_endpoints {
            Some(verdict) => format!("<no endpoints: {verdict}>"),
            None => self.backends.join(" "),
        };
        let shown = match self.sidelined.as_slice() {
            [] => shown,
            sidelined => format!("{shown} (sidelined: {})", sidelined.join(" ")),
        };
        let mut flags = self.flags.iter().map(|f| f.to_string()).collect::<Vec<_>>();
        flags.extend(self.affinity_seconds.map(|s| format!("affinity={s}s")));
        let flags = if flags.is_empty() { String::new() } else { format!(" [{}]", flags.join(",")) };
        let name = self.service_port.as_deref().map(|n| format!("{n} ")).unwrap_or_default();
        let mut line = format!("{:<28} id {:<6} {name}-> {shown}{flags}", self.frontend, self.service_id);
        if let Some(stats) = &self.stats {
            let _ = write!(line, "\n      {}", stats.line());
        }
        line
    }
}

/// A service port's backends, as `IP:port`.
pub fn backends(programmed: &Programmed) -> Vec<String> {
    programmed
        .backends
        .iter()
        .map(|b| {
            let (ip, port) = backend_addr(b);
            std::net::SocketAddr::new(ip, port).to_string()
        })
        .collect()
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicesReport {
    pub pin_dir: String,
    pub service_port_capacity: u32,
    pub backend_slots: u32,
    pub backend_capacity: u32,
    pub service_ports: Vec<PortView>,
    pub conntrack: ConntrackUse,
    pub counters: BTreeMap<&'static str, u64>,
    /// With `--endpoint-counters`: each counted endpoint's counters (`10.244.1.2:8080/TCP`),
    /// over every Service port that has it (`KPR_ENDPOINT_STATS`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub endpoints: BTreeMap<String, FlowCounts>,
}

#[derive(Debug, Serialize)]
pub struct ConntrackUse {
    pub established: usize,
    pub new: usize,
    /// Of all tables (established and new, each family).
    pub capacity: u32,
}

/// The agent's names of its service ids (`/service-ports` on its metrics server); none when
/// no agent answers there.
fn service_port_names(metrics: SocketAddr) -> Option<BTreeMap<u32, String>> {
    let (status, body) = super::http_get(metrics, "/service-ports", Duration::from_secs(1)).ok()?;
    (status == 200).then(|| serde_json::from_str(&body).ok()).flatten()
}

/// What the maps hold; `metrics`: the agent's metrics server, asked for the Service ports' names.
pub fn report(pin_root: &Path, metrics: Option<SocketAddr>) -> Result<ServicesReport> {
    let maps = BpfMaps::open_pinned(pin_root)?;
    let cap = maps.capacity();
    let mut programmed: Vec<(ServiceKey, Programmed)> = crate::datapath::read_programmed(&maps)?.into_iter().collect();
    programmed.sort_by_key(|(k, _)| (std::net::IpAddr::from(k.addr), u16::from_be(k.port), k.proto, k.scope));
    let backend_slots = programmed.iter().map(|(_, p)| p.value.backends_count).sum();
    let conntrack = crate::datapath::conntrack::Conntrack::open(pin_root)?;
    let ((established, new), capacity) = (conntrack.lens(), conntrack.capacity());
    Ok(ServicesReport {
        pin_dir: bpf::pin_dir(pin_root).display().to_string(),
        service_port_capacity: cap.service_ports,
        backend_slots,
        backend_capacity: cap.backends,
        service_ports: port_views(pin_root, &programmed, metrics),
        conntrack: ConntrackUse { established, new, capacity },
        counters: bpf::read_counters(pin_root)?.into_iter().collect(),
        // An older layout has no such map: none.
        endpoints: bpf::read_endpoint_stats(pin_root)
            .unwrap_or_default()
            .iter()
            .filter_map(|(key, stats)| Some((Endpoint::of_key(key)?.to_string(), FlowCounts::of(&stats.words))))
            .collect(),
    })
}

fn port_views(pin_root: &Path, programmed: &[(ServiceKey, Programmed)], metrics: Option<SocketAddr>) -> Vec<PortView> {
    let names = metrics.and_then(service_port_names).unwrap_or_default();
    let sidelined = if names.is_empty() { Vec::new() } else { metrics.map(super::sidelined).unwrap_or_default() };
    // An older layout has no counters: shown without.
    let stats = bpf::read_service_stats(pin_root).unwrap_or_default();
    programmed
        .iter()
        .map(|(k, p)| {
            let mut view = PortView::new(k, p);
            view.service_port = names.get(&p.value.service_id).cloned();
            view.stats = stats.get(&p.value.service_id).map(PortStats::new);
            view.sidelined = sidelined_of(&view, &sidelined);
            view
        })
        .collect()
}

/// The endpoints of `sidelined` (`ip:port`) that `view`'s Service port would have among its
/// backends: of its Service, its protocol, and its backends' family and port (an endpoint is
/// sidelined per Service, and a port's endpoints share its target port).
fn sidelined_of(view: &PortView, sidelined: &[Sidelined]) -> Vec<String> {
    let Some(name) = view.service_port.as_deref() else { return Vec::new() };
    sidelined
        .iter()
        .filter(|s| name.starts_with(&format!("{}/{}:", s.namespace, s.service)))
        .filter_map(|s| {
            let (address, protocol) = s.endpoint.rsplit_once('/')?;
            let endpoint: SocketAddr = address.parse().ok()?;
            let alike = |backend: &String| {
                backend
                    .parse::<SocketAddr>()
                    .is_ok_and(|b| b.port() == endpoint.port() && b.is_ipv4() == endpoint.is_ipv4())
            };
            (name.ends_with(&format!("/{protocol}")) && view.backends.iter().any(alike)).then(|| address.to_owned())
        })
        .collect()
}

pub fn render(pin_root: &Path) -> Result<String> {
    Ok(text(&report(pin_root, None)?))
}

pub fn text(r: &ServicesReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} service ports (of {}), {} backend slots (of {}) in {}",
        r.service_ports.len(),
        r.service_port_capacity,
        r.backend_slots,
        r.backend_capacity,
        r.pin_dir
    );
    for port in &r.service_ports {
        let _ = writeln!(out, "  {}", port.line());
    }
    let c = &r.conntrack;
    let _ = writeln!(
        out,
        "conntrack: {} established + {} new entries (of {} in all tables; two per per-packet flow)",
        c.established, c.new, c.capacity
    );
    if !r.endpoints.is_empty() {
        let _ = writeln!(out, "endpoints (--endpoint-counters; the agent's sweep of unanswered flows aside):");
        for (endpoint, c) in &r.endpoints {
            let _ = writeln!(
                out,
                "  {endpoint}  flows {} connects {} unanswered {} packets {} bytes {}",
                c.new_flows, c.socket_connects, c.unanswered_flows, c.packets, c.bytes
            );
        }
    }
    let _ = writeln!(out, "counters:");
    for (name, value) in &r.counters {
        let _ = writeln!(out, "  {name:<24} {value}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(service_port: &str, backends: &[&str]) -> PortView {
        PortView {
            frontend: "10.96.0.10:80/6".into(),
            service_id: 1,
            backends: backends.iter().map(|b| (*b).to_owned()).collect(),
            sidelined: Vec::new(),
            no_endpoints: None,
            flags: Vec::new(),
            source_ranges: Vec::new(),
            affinity_seconds: None,
            service_port: Some(service_port.to_owned()),
            stats: None,
        }
    }

    fn sidelined(namespace: &str, service: &str, endpoint: &str) -> Sidelined {
        Sidelined { namespace: namespace.into(), service: service.into(), endpoint: endpoint.into() }
    }

    #[test]
    fn a_port_shows_the_sidelined_endpoints_of_its_service_protocol_family_and_target_port() {
        let out = [
            sidelined("test", "web", "10.244.2.2:8080/TCP"),
            sidelined("test", "web", "10.244.2.3:8080/UDP"),
            sidelined("test", "web", "10.244.2.4:9090/TCP"),
            sidelined("test", "web", "[fd00::2]:8080/TCP"),
            sidelined("test", "web2", "10.244.2.5:8080/TCP"),
            sidelined("other", "web", "10.244.2.6:8080/TCP"),
        ];
        let mut port = view("test/web:http/TCP", &["10.244.1.2:8080", "10.244.3.2:8080"]);
        assert_eq!(sidelined_of(&port, &out), ["10.244.2.2:8080"]);
        port.sidelined = sidelined_of(&port, &out);
        assert!(
            port.line().contains("-> 10.244.1.2:8080 10.244.3.2:8080 (sidelined: 10.244.2.2:8080)"),
            "{}",
            port.line()
        );
        let v6 = view("test/web:http/TCP", &["[fd00::1]:8080"]);
        assert_eq!(sidelined_of(&v6, &out), ["[fd00::2]:8080"]);
        let unnamed = PortView { service_port: None, ..view("", &["10.244.1.2:8080"]) };
        assert!(sidelined_of(&unnamed, &out).is_empty(), "no agent, no names, nothing to match");
    }
}
