//! `kpr services`: what the datapath holds, read from the pinned maps (also while no agent runs).
use std::{collections::BTreeMap, fmt::Write as _, path::Path};

use anyhow::Result;
use proxy_common::ServiceKey;
use serde::Serialize;

use crate::{
    datapath::{
        Maps as _, Programmed, backend_addr,
        bpf::{self, BpfMaps},
    },
    model::display_key,
};

/// One service port as the maps hold it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PortView {
    /// `10.96.0.10:80/6`, with ` ext`/` node` for frontends only that source class sees.
    pub frontend: String,
    pub service_id: u32,
    pub backends: Vec<String>,
    /// Without backends: what happens to new connections (`reject` or `drop`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_endpoints: Option<&'static str>,
    pub flags: Vec<&'static str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub source_ranges: Vec<String>,
    /// sessionAffinity ClientIP timeout.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_seconds: Option<u32>,
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
        ];
        let flags = names.into_iter().filter(|(bit, _)| value.flags & bit != 0).map(|(_, name)| name).collect();
        let source_ranges = programmed.source_ranges.iter().map(ToString::to_string).collect();
        Self {
            frontend: display_key(key).to_string(),
            service_id: value.service_id,
            backends,
            no_endpoints,
            flags,
            source_ranges,
            affinity_seconds: (value.affinity_timeout != 0).then_some(value.affinity_timeout),
        }
    }

    /// One line: frontend, id, backends (or the no-endpoint verdict), flags.
    pub fn line(&self) -> String {
        let shown = match self.no_endpoints {
            Some(verdict) => format!("<no endpoints: {verdict}>"),
            None => self.backends.join(" "),
        };
        let mut flags = self.flags.iter().map(|f| f.to_string()).collect::<Vec<_>>();
        flags.extend(self.affinity_seconds.map(|s| format!("affinity={s}s")));
        let flags = if flags.is_empty() { String::new() } else { format!(" [{}]", flags.join(",")) };
        format!("{:<28} id {:<6} -> {shown}{flags}", self.frontend, self.service_id)
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
}

#[derive(Debug, Serialize)]
pub struct ConntrackUse {
    pub established: usize,
    pub new: usize,
    /// Of all tables (established and new, each family).
    pub capacity: u32,
}

pub fn report(pin_root: &Path) -> Result<ServicesReport> {
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
        service_ports: programmed.iter().map(|(k, p)| PortView::new(k, p)).collect(),
        conntrack: ConntrackUse { established, new, capacity },
        counters: bpf::read_counters(pin_root)?.into_iter().collect(),
    })
}

pub fn render(pin_root: &Path) -> Result<String> {
    Ok(text(&report(pin_root)?))
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
    let _ = writeln!(out, "counters:");
    for (name, value) in &r.counters {
        let _ = writeln!(out, "  {name:<24} {value}");
    }
    out
}
