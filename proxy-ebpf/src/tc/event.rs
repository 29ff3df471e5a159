//! Drop and reject events for `kpr events`, written to a ring buffer (`KPR_EVENTS`) only while
//! a reader asks for them (`KPR_EVENTS_WANTED` holds a deadline it keeps pushing forward). A
//! node nobody watches pays a map read per dropped or answered packet; a forwarded packet never
//! comes here. Each is also counted for its service port (`stats`), read or not.
use aya_ebpf::helpers::bpf_ktime_get_ns;

use super::parse::Tuple;
use crate::{
    maps::{EVENTS, EVENTS_WANTED, count},
    stats,
};

/// Note that the packet of `t`, for service port `service_id` (0: none known), was dropped or
/// answered for `reason` (`proxy_common::event`): the node's `counter`, the port's count and
/// (while read) an event.
/// A subprogram: its frame stays off the callers' chains but for this leaf; the event is
/// written in the ring's memory, not built on the stack.
#[inline(never)]
pub(super) fn note(t: &Tuple, counter: u32, reason: u32, service_id: u32) {
    // A probe's refusal is the agent's to judge, not traffic to count or show.
    if t.probe != 0 {
        return;
    }
    count(counter);
    stats::update(service_id, proxy_common::service_stat::EVENTS + reason, 0, 0);
    let Some(until) = EVENTS_WANTED.get(0) else { return };
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if now > *until {
        return;
    }
    let Some(mut entry) = EVENTS.reserve(0) else { return };
    let event = entry.as_mut_ptr();
    // SAFETY: the reservation is the event's, exclusive until submitted; every field written.
    unsafe {
        (*event).time_ns = now;
        (*event).saddr = t.saddr;
        (*event).daddr = t.daddr;
        (*event).sport = t.sport;
        (*event).dport = t.dport;
        (*event).reason = reason;
        (*event).service_id = service_id;
        (*event).proto = t.proto;
        (*event)._pad = [0; 3];
    }
    entry.submit(0);
}
