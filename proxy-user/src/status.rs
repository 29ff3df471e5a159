//! `kpr services`: what the datapath holds, read from the pinned maps (also while no agent runs).
use std::{fmt::Write as _, path::Path};

use anyhow::Result;

use crate::datapath::{
    Maps as _, backend_addr,
    bpf::{self, BpfMaps},
    display_key,
};

pub fn render(pin_root: &Path) -> Result<String> {
    let mut out = String::new();
    let maps = BpfMaps::open_pinned(pin_root)?;
    let cap = maps.capacity();
    let mut programmed = maps.services()?;
    programmed.sort_by_key(|(k, _)| (u32::from_be(k.addr), u16::from_be(k.port), k.proto));
    let slots: u32 = programmed.iter().map(|(_, v)| v.backends_count).sum();
    writeln!(
        out,
        "{} service ports (of {}), {} backend slots (of {}) in {}",
        programmed.len(),
        cap.service_ports,
        slots,
        cap.backends,
        bpf::pin_dir(pin_root).display()
    )?;
    for (key, value) in &programmed {
        let backends = maps.backends(value.backends_start, value.backends_count)?;
        let backends: Vec<String> = backends
            .iter()
            .map(|b| {
                let (ip, port) = backend_addr(b);
                format!("{ip}:{port}")
            })
            .collect();
        let drops = value.flags & proxy_common::SERVICE_FLAG_DROP_NO_ENDPOINTS != 0;
        let shown = match (backends.is_empty(), drops) {
            (true, true) => "<no endpoints: drop>".to_owned(),
            (true, false) => "<no endpoints: reject>".to_owned(),
            (false, _) => backends.join(" "),
        };
        let mut flags = Vec::new();
        if value.flags & proxy_common::SERVICE_FLAG_SNAT != 0 {
            flags.push("masquerade");
        }
        if value.flags & proxy_common::SERVICE_FLAG_SOURCE_RANGES != 0 {
            flags.push("source-ranges");
        }
        let flags = if flags.is_empty() { String::new() } else { format!(" [{}]", flags.join(",")) };
        writeln!(out, "  {:<28} id {:<6} -> {shown}{flags}", display_key(key).to_string(), value.service_id)?;
    }
    let conntrack = crate::datapath::conntrack::Conntrack::open(pin_root)?;
    let ((established, new), capacity) = (conntrack.lens(), conntrack.capacity());
    writeln!(out, "conntrack: {established} established + {new} new entries (of {capacity} each; two per per-packet flow)")?;
    writeln!(out, "counters:")?;
    for (name, value) in bpf::read_counters(pin_root)? {
        writeln!(out, "  {name:<24} {value}")?;
    }
    Ok(out)
}
