//! Per-service counters (`KPR_SERVICE_STATS`, exported as `kpr_service_*`): a service port's
//! new flows, `connect()` calls, unanswered flows, packets, bytes, drops and rejects, per CPU.
//! Only the paths that already pay a map lookup or more come here (a new flow, a refused
//! packet, a connect, a packet the flow cache did not serve): an established packet the cache
//! serves adds to its slot instead (`flow_cache`), folded in here when the slot is filled
//! again.
use aya_ebpf::helpers::bpf_map_lookup_elem;
use proxy_common::{ServiceStats, service_stat};

use crate::maps::SERVICE_STATS;

/// [`update`] as a subprogram, for callers whose frame must stay small.
#[inline(never)]
pub fn add(service_id: u32, word: u32, packets: u64, bytes: u64) {
    update(service_id, word, packets, bytes);
}

/// Add one to `word` (`service_stat::NONE`: none), and `packets` and `bytes`, to service port
/// `service_id`'s counts on this CPU (none for id 0, no frontend, or a removed one).
#[inline(always)]
pub fn update(service_id: u32, word: u32, packets: u64, bytes: u64) {
    if service_id == 0 {
        return;
    }
    // The entry is the agent's to make (with the frontend) and remove (with it): a count for
    // a removed frontend (its flows live on) brings none back. The helper is called directly:
    // the map's wrapper may stay a call of its own, lengthening the chains of calls
    // `event::note` ends (6.1 holds 512 bytes of frames).
    let map = core::ptr::from_ref(&SERVICE_STATS).cast_mut().cast::<core::ffi::c_void>();
    let key = core::ptr::from_ref(&service_id).cast::<core::ffi::c_void>();
    // SAFETY: a map and a key of its type; the value (if any) is this CPU's, valid for this run.
    let stats = unsafe { bpf_map_lookup_elem(map, key) }.cast::<ServiceStats>();
    if stats.is_null() {
        return;
    }
    // SAFETY: this CPU's value, valid for this program run; no other writer on this CPU.
    unsafe {
        if let Some(w) = (*stats).words.get_mut(word as usize) {
            *w += 1;
        }
        (*stats).words[service_stat::PACKETS as usize] += packets;
        (*stats).words[service_stat::BYTES as usize] += bytes;
    }
}
