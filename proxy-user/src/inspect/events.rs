//! `kpr events`: the per-packet path's drops and rejects as they happen (as `hubble observe
//! --verdict DROPPED`), read from the ring buffer `KPR_EVENTS`. The programs write events only
//! while a reader keeps `KPR_EVENTS_WANTED` ahead of the clock, which this reader does while it
//! runs: a node nobody watches pays nothing but a map read per dropped packet. One reader at a
//! time: two would each see part of the events.
use std::{
    os::fd::AsRawFd as _,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use aya::maps::{Array, Map, MapData, RingBuf};
use proxy_common::{DatapathEvent, event, map_names};
use serde::Serialize;

use crate::datapath::{
    bpf::{open_pinned_map, pin_dir},
    conntrack::monotonic_now,
};

/// How far ahead of the clock the reader keeps `KPR_EVENTS_WANTED`: a reader that stops (or is
/// killed) turns the events off this long after.
const WANTED_AHEAD: Duration = Duration::from_secs(3);

/// One drop or reject.
#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EventView {
    /// When, as wall-clock time (RFC 3339).
    pub time: String,
    /// A `proxy_common::event` name: `rejected`, `dropped_source_range`, ...
    pub reason: &'static str,
    pub protocol: &'static str,
    pub source: String,
    /// The frontend the packet was sent to (the Service's address and port, as `kpr services`
    /// shows it), or the address the flow went to.
    pub destination: String,
    /// The service port's id in the maps (as `kpr services` shows it); 0: none known.
    pub service_id: u32,
}

impl EventView {
    fn of(e: &DatapathEvent, mono_now: u64, wall_now: jiff::Timestamp) -> Self {
        let ago = Duration::from_nanos(mono_now.saturating_sub(e.time_ns));
        let time = wall_now.checked_sub(jiff::SignedDuration::try_from(ago).unwrap_or_default()).unwrap_or(wall_now);
        let at = |a: proxy_common::Addr, port: u16| std::net::SocketAddr::new(a.into(), u16::from_be(port)).to_string();
        Self {
            time: time.to_string(),
            reason: event::NAMES.get(e.reason as usize).copied().unwrap_or("unknown"),
            protocol: proxy_common::proto_name(e.proto),
            source: at(e.saddr, e.sport),
            destination: at(e.daddr, e.dport),
            service_id: e.service_id,
        }
    }
}

pub fn text(e: &EventView) -> String {
    let id = if e.service_id == 0 { String::new() } else { format!(" (id {})", e.service_id) };
    format!("{} {:<28} {:<5} {} -> {}{id}\n", e.time, e.reason, e.protocol, e.source, e.destination)
}

/// Turn the events on and hand each to `each` as it comes, until `each` says stop (false) or
/// `limit` passes.
pub fn follow(pin_root: &Path, limit: Option<Duration>, mut each: impl FnMut(EventView) -> Result<bool>) -> Result<()> {
    let dir = pin_dir(pin_root);
    let open = |name: &str| {
        open_pinned_map(pin_root, name)
            .with_context(|| format!("no {name} under {} (a kpr of before events?)", dir.display()))
    };
    let mut ring = RingBuf::try_from(Map::RingBuf(open(map_names::EVENTS)?))?;
    let mut wanted: Array<MapData, u64> = Array::try_from(Map::Array(open(map_names::EVENTS_WANTED)?))?;
    let started = Instant::now();
    let mut renewed: Option<Instant> = None;
    let result = (|| -> Result<()> {
        loop {
            if renewed.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                let until = monotonic_now() + WANTED_AHEAD.as_nanos() as u64;
                wanted.set(0, &until, 0).context("failed to write KPR_EVENTS_WANTED")?;
                renewed = Some(Instant::now());
            }
            while let Some(item) = ring.next() {
                if item.len() < size_of::<DatapathEvent>() {
                    continue;
                }
                // SAFETY: length checked; the event is plain integers, written by the programs.
                let e: DatapathEvent = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
                if !each(EventView::of(&e, monotonic_now(), jiff::Timestamp::now()))? {
                    return Ok(());
                }
            }
            if limit.is_some_and(|l| started.elapsed() >= l) {
                return Ok(());
            }
            let mut fd = libc::pollfd { fd: ring.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one pollfd that lives across the call.
            unsafe { libc::poll(&mut fd, 1, 200) };
        }
    })();
    // Off again at once, not WANTED_AHEAD later.
    let _ = wanted.set(0, &0, 0);
    result
}
