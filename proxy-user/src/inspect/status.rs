//! `kpr status`: one screen on kpr on this node — is the agent up and synced, how is the
//! datapath attached, what is it falling back to, how full are its maps, and which counters
//! say something went wrong. Read from the pins and the agent's health server, so it also
//! works while the agent is down.
use std::{collections::BTreeMap, fmt::Write as _, net::SocketAddr, path::Path, time::Duration};

use anyhow::Result;
use proxy_common::counter;
use serde::Serialize;

use crate::datapath::{
    Maps as _,
    bpf::{self, BpfMaps},
    conntrack::Conntrack,
};

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusReport {
    /// This `kpr`'s version and commit (the agent's is in its first log line).
    pub version: &'static str,
    pub pin_dir: String,
    pub layout: u32,
    /// Other layouts' directories under the pin root (an upgrade in progress, or leftovers).
    pub other_layouts: Vec<String>,
    /// An agent holds the pin root's lock (in this network namespace).
    pub agent_running: bool,
    /// The agent's `/readyz` and `/healthz`; None: nothing answered at the address.
    pub health: Option<HealthView>,
    pub kernel: String,
    /// Where translated packets go: `direct` (straight out of their link) or `host` (the
    /// host's forwarding path, because something filters forwarded packets, or by setting).
    pub forwarding: &'static str,
    pub links: Vec<LinkView>,
    /// Pods whose sockets the socket path leaves to the per-packet path (`kpr.io/socket-lb`,
    /// a mesh's sidecar), by the cgroup the agent found for each.
    pub pods_off_the_socket_path: usize,
    pub maps: Vec<MapUse>,
    /// The counters that only move when something went wrong, where they are not zero.
    pub trouble: BTreeMap<&'static str, u64>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthView {
    pub address: SocketAddr,
    /// `/readyz`: synced once, and healthy.
    pub ready: bool,
    /// `/healthz` (kube-proxy's): 200 or 503, and when the datapath last took a change.
    pub healthz_status: u16,
    pub last_updated: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LinkView {
    pub name: String,
    pub ifindex: u32,
    /// `tcx` or `netlink` (tc filters, kernels before 6.6 or `--tc-netlink`).
    pub attach: &'static str,
    /// kpr turned `accept_local` on (masquerade to the node's own address needs it).
    pub accept_local_set: bool,
    /// Its packets have an Ethernet header (not an IP-in-IP or other L3 tunnel's): the
    /// programs for its framing run there.
    pub ethernet: bool,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MapUse {
    pub name: &'static str,
    pub entries: usize,
    pub capacity: u32,
}

/// The counters that move only when something went wrong.
const TROUBLE: [u32; 7] = [
    counter::BAD_BACKEND_SLOT,
    counter::REVNAT_UPDATE_FAILED,
    counter::TC_SNAT_EXHAUSTED,
    counter::TC_CT_FULL,
    counter::TC_CT_ESTABLISHED_FULL,
    counter::TC_CT_RECREATED,
    counter::TC_SLOW_PATH_MISSING,
];

pub fn report(pin_root: &Path, healthz: SocketAddr) -> Result<StatusReport> {
    if let Some(problem) = bpf::pins_missing(pin_root) {
        anyhow::bail!("{problem}");
    }
    let maps = BpfMaps::open_pinned(pin_root)?;
    let capacity = maps.capacity();
    let programmed = crate::datapath::read_programmed(&maps)?;
    let slots = programmed.values().map(|p| p.value.backends_count as usize).sum();
    let mut map_use = vec![
        MapUse { name: "services", entries: programmed.len(), capacity: capacity.service_ports },
        MapUse { name: "backends", entries: slots, capacity: capacity.backends },
        MapUse { name: "source_ranges", entries: maps.source_ranges()?.len(), capacity: maps.source_range_capacity() },
    ];
    let conntrack = Conntrack::open(pin_root)?;
    map_use.extend(conntrack.table_use_now().into_iter().map(|t| MapUse {
        name: t.name,
        entries: t.live,
        capacity: t.capacity,
    }));
    let counters = bpf::read_counters(pin_root)?;
    let trouble = TROUBLE.into_iter().map(|i| counters[i as usize]).filter(|(_, value)| *value != 0).collect();
    let direct = bpf::HostState::open(pin_root)?.forward_direct().unwrap_or(false);
    Ok(StatusReport {
        version: crate::VERSION,
        pin_dir: bpf::pin_dir(pin_root).display().to_string(),
        layout: proxy_common::PIN_LAYOUT_VERSION,
        other_layouts: bpf::other_layout_names(pin_root),
        agent_running: bpf::AgentLock::held(pin_root),
        health: health(healthz),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned(),
        forwarding: if direct { "direct" } else { "host" },
        links: links(pin_root)?,
        // An older layout's directory may not have the map yet.
        pods_off_the_socket_path: bpf::read_socket_skip(pin_root).map_or(0, |m| m.len()),
        maps: map_use,
        trouble,
    })
}

/// The links holding kpr's per-packet programs, from `KPR_LINKS`.
fn links(pin_root: &Path) -> Result<Vec<LinkView>> {
    let mut links: Vec<LinkView> = bpf::read_links(pin_root)?
        .into_iter()
        .filter(|(ifindex, info)| {
            *ifindex < proxy_common::LINK_FIRST_SPECIAL && info.flags & proxy_common::LINK_FLAG_TC_INGRESS != 0
        })
        .map(|(ifindex, info)| LinkView {
            name: bpf::link_name(ifindex).unwrap_or_else(|| "?".to_owned()),
            ifindex,
            attach: if info.flags & proxy_common::LINK_FLAG_NETLINK_TC != 0 { "netlink" } else { "tcx" },
            accept_local_set: info.flags & proxy_common::LINK_FLAG_ACCEPT_LOCAL_SET != 0,
            ethernet: info.flags & proxy_common::LINK_FLAG_NOT_ETHERNET == 0,
        })
        .collect();
    links.sort_by_key(|l| l.ifindex);
    Ok(links)
}

/// `/readyz` and `/healthz` of the agent's health server at `address`.
fn health(address: SocketAddr) -> Option<HealthView> {
    // The health server's answers are one small body each.
    let get = |path| super::http_get(address, path, Duration::from_secs(1)).ok();
    let (ready, _) = get("/readyz")?;
    let (healthz_status, body) = get("/healthz")?;
    let last_updated = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("lastUpdated")?.as_str().map(str::to_owned));
    Some(HealthView { address, ready: ready == 200, healthz_status, last_updated })
}

pub fn text(r: &StatusReport) -> String {
    let mut out = String::new();
    let agent = if r.agent_running { "running" } else { "not running (the pinned datapath still serves)" };
    let _ = writeln!(out, "agent:      {agent}");
    match &r.health {
        Some(h) => {
            let ready = if h.ready { "ready (synced)" } else { "not ready" };
            let updated = h.last_updated.as_deref().unwrap_or("?");
            let _ = writeln!(
                out,
                "health:     {ready}; /healthz {} at {}, last update {updated}",
                h.healthz_status, h.address
            );
        }
        None => {
            let _ = writeln!(out, "health:     nothing answers at the health address");
        }
    }
    let _ = writeln!(out, "kpr:        {} (pin layout v{}), kernel {}", r.version, r.layout, r.kernel);
    let _ = writeln!(out, "pins:       {}", r.pin_dir);
    if !r.other_layouts.is_empty() {
        let _ = writeln!(out, "            also {} (another kpr version's pins)", r.other_layouts.join(", "));
    }
    let _ = writeln!(
        out,
        "forwarding: {}",
        match r.forwarding {
            "direct" => "translated packets go straight out of their link",
            _ => "translated packets take the host's forwarding path (netfilter FORWARD, routing)",
        }
    );
    let links: Vec<String> = r
        .links
        .iter()
        .map(|l| {
            let framing = if l.ethernet { "" } else { ", no Ethernet" };
            format!("{} ({}{framing}{})", l.name, l.attach, if l.accept_local_set { ", accept_local" } else { "" })
        })
        .collect();
    let _ = writeln!(out, "links:      {}", if links.is_empty() { "none".to_owned() } else { links.join(", ") });
    if r.pods_off_the_socket_path > 0 {
        let _ = writeln!(
            out,
            "pods:       {} left to the per-packet path (kpr.io/socket-lb, mesh sidecars)",
            r.pods_off_the_socket_path
        );
    }
    let _ = writeln!(out, "maps:");
    for m in &r.maps {
        let percent = if m.capacity == 0 { 0.0 } else { 100.0 * m.entries as f64 / f64::from(m.capacity) };
        let _ = writeln!(out, "  {:<26} {:>9} of {:>9} ({percent:.1}%)", m.name, m.entries, m.capacity);
    }
    if r.trouble.is_empty() {
        let _ = writeln!(out, "trouble:    none counted");
    } else {
        let _ = writeln!(out, "trouble:");
        for (name, value) in &r.trouble {
            let _ = writeln!(out, "  {name:<26} {value:>9}");
        }
    }
    out
}
