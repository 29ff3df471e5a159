//! `kpr conntrack`: the per-packet path's flows, from the pinned tables, and flushing a
//! service's flows (as `conntrack -D` does for kube-proxy's).
use std::{fmt::Write as _, path::Path};

use anyhow::Result;
use proxy_common::{Addr, CtKey, CtTimeouts, CtValue, ct};
use serde::Serialize;

use crate::datapath::conntrack::{Conntrack, monotonic_now};

/// One flow, as its original-direction entry holds it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FlowView {
    pub protocol: &'static str,
    /// The client as the packet arrived.
    pub client: String,
    /// The frontend it was sent to.
    pub frontend: String,
    /// The backend it goes to.
    pub backend: String,
    /// The source the backend sees (the masquerade address when masqueraded).
    pub source_seen: String,
    pub service_id: u32,
    pub state: &'static str,
    /// Seconds since the flow's latest packet, and until it expires when idle.
    pub idle_seconds: u64,
    pub expires_in_seconds: u64,
}

fn addr(a: Addr, port: u16) -> String {
    std::net::SocketAddr::new(a.into(), u16::from_be(port)).to_string()
}

fn state(proto: u8, flags: u32) -> &'static str {
    match (proxy_common::has_states(proto), flags) {
        (true, f) if ct::closed(f) => "closed",
        (true, f) if f & (ct::FIN_ORIG | ct::FIN_REPLY) != 0 => "closing",
        (true, f) if f & ct::AWAITING_ACK != 0 => "syn-recv",
        (true, f) if f & ct::SEEN_REPLY != 0 => "established",
        (true, _) => "syn-sent",
        (false, f) if f & ct::SEEN_REPLY != 0 => "assured",
        (false, _) => "unreplied",
    }
}

fn view(key: &CtKey, value: &CtValue, timeouts: &CtTimeouts, now: u64) -> FlowView {
    let idle = now.saturating_sub(value.last_seen);
    let lifetime = timeouts.lifetime(key.proto, value.flags);
    FlowView {
        protocol: proxy_common::proto_name(key.proto),
        client: addr(key.src_addr, key.src_port),
        frontend: addr(key.dst_addr, key.dst_port),
        backend: addr(value.dst_addr, value.dst_port),
        source_seen: addr(value.src_addr, value.src_port),
        service_id: value.service_id,
        state: state(key.proto, value.flags),
        idle_seconds: idle / 1_000_000_000,
        expires_in_seconds: lifetime.saturating_sub(idle) / 1_000_000_000,
    }
}

/// The flows (one per flow: the client's entry), of `service_ids` when given. Lifetimes are
/// shown with `timeouts` (the agent's configuration; kube-proxy's defaults otherwise).
pub fn list(pin_root: &Path, service_ids: Option<&[u32]>, timeouts: &CtTimeouts) -> Result<Vec<FlowView>> {
    let now = monotonic_now();
    let conntrack = Conntrack::open(pin_root)?;
    let mut flows: Vec<FlowView> = conntrack
        .entries()
        .iter()
        .filter(|(_, _, v)| v.flags & ct::REPLY == 0 && service_ids.is_none_or(|ids| ids.contains(&v.service_id)))
        .map(|(_, k, v)| view(k, v, timeouts, now))
        .collect();
    flows.sort_by(|a, b| (a.service_id, &a.frontend, &a.client).cmp(&(b.service_id, &b.frontend, &b.client)));
    Ok(flows)
}

pub fn text(flows: &[FlowView]) -> String {
    let mut out = String::new();
    for f in flows {
        let _ = writeln!(
            out,
            "{} {} -> {} => {} (as {}) id {} {} idle {}s, expires in {}s",
            f.protocol,
            f.client,
            f.frontend,
            f.backend,
            f.source_seen,
            f.service_id,
            f.state,
            f.idle_seconds,
            f.expires_in_seconds
        );
    }
    let _ = writeln!(out, "{} flows", flows.len());
    out
}

/// Remove every entry (both directions) of `service_id`'s flows; how many were removed.
pub fn flush(pin_root: &Path, service_id: u32) -> Result<usize> {
    let mut conntrack = Conntrack::open(pin_root)?;
    let (_, removed) = conntrack.remove_where(|_, v| v.service_id == service_id)?;
    Ok(removed)
}
