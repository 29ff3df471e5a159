//! Per-service counters (`KPR_SERVICE_STATS`, exported as `kpr_service_*`): a service port's
//! new flows, `connect()` calls, unanswered flows, packets, bytes, drops and rejects, per CPU.
//! Only the paths that already pay a map lookup or more come here (a new flow, a refused
//! packet, a connect, a packet the flow cache did not serve): an established packet the cache
//! serves adds to its slot instead (`flow_cache`), folded in here when the slot is filled
//! again.
use aya_ebpf::bindings::BPF_NOEXIST;
use proxy_common::service_stat;

use crate::maps::{SERVICE_STATS, SERVICE_STATS_ZERO};

/// [`update`] as a subprogram, for callers whose frame must stay small.
#[inline(never)]
pub fn add(service_id: u32, word: u32, packets: u64, bytes: u64) {
    update(service_id, word, packets, bytes);
}

/// Add one to `word` (`service_stat::NONE`: none), and `packets` and `bytes`, to service port
/// `service_id`'s counts on this CPU; its entry is made at its first count (none for id 0, no
/// frontend).
#[inline(always)]
pub fn update(service_id: u32, word: u32, packets: u64, bytes: u64) {
    if service_id == 0 {
        return;
    }
    let stats = match SERVICE_STATS.get_ptr_mut(&service_id) {
        Some(stats) => stats,
        None => {
            let Some(zero) = SERVICE_STATS_ZERO.get(0) else { return };
            // Another CPU may make it first (then this insert fails, and the lookup finds it).
            let _ = SERVICE_STATS.insert(&service_id, zero, u64::from(BPF_NOEXIST));
            let Some(stats) = SERVICE_STATS.get_ptr_mut(&service_id) else { return };
            stats
        }
    };
    // SAFETY: this CPU's value, valid for this program run; no other writer on this CPU.
    unsafe {
        if let Some(w) = (*stats).words.get_mut(word as usize) {
            *w += 1;
        }
        (*stats).words[service_stat::PACKETS as usize] += packets;
        (*stats).words[service_stat::BYTES as usize] += bytes;
    }
}
