//! A conntrack entry: how long its state lets it live, reading it in place, and forgetting
//! its flow (both entries, and every CPU's cached copies).
use proxy_common::{CtKey, CtTimeouts, CtValue};

use super::scratch::scratch;
use crate::{flow_cache, globals::KPR_CT_TIMEOUTS, maps::FlowTables};

/// Has the flow outlived the lifetime of its state? One word of `KPR_CT_TIMEOUTS` read: its
/// `load` copies all six, on every packet.
#[inline(always)]
pub(crate) fn expired(proto: u8, entry: &CtValue, now: u64) -> bool {
    entry.idle_longer_than(lifetime(proto, entry.flags), now)
}

/// How long a flow of `proto` in state `flags` lives after its latest packet (one word of
/// `KPR_CT_TIMEOUTS` read).
#[inline(always)]
pub(super) fn lifetime(proto: u8, flags: u32) -> u64 {
    const _: () = assert!(size_of::<CtTimeouts>() == size_of::<[u64; 6]>());
    // SAFETY: `Global` is transparent over the `#[repr(C)]` struct of six u64 in the order of
    // `as_words`, and the slot is one of them; volatile, as `load` reads it (the loader sets it).
    unsafe { (&raw const KPR_CT_TIMEOUTS).cast::<u64>().add(CtTimeouts::slot(proto, flags)).read_volatile() }
}

/// Remove both entries of a flow. The other entry's key is built in the scratch area's `key`
/// (free wherever a flow is forgotten): on the stack it would put the longest chain of calls
/// (a new flow's SNAT port search) past the BPF stack of older kernels.
#[inline(never)]
pub(super) fn forget<A: FlowTables>(key: &CtKey<A>, entry: &CtValue, proto: u8) {
    let Ok(s) = scratch() else { return };
    // SAFETY: the scratch area's key slot, valid for this program run.
    let pair_key = unsafe {
        let pair_key = s.key::<A>();
        *pair_key = entry.pair_key(proto);
        &*pair_key
    };
    let _ = A::established().remove(pair_key);
    let _ = A::established().remove(key);
    let _ = A::new_flows().remove(pair_key);
    let _ = A::new_flows().remove(key);
    flow_cache::forgotten();
}

/// The flow entry under `key`, established or new, in place (no copy on the BPF stack).
#[inline(always)]
pub(super) fn flow_entry<'a, A: FlowTables>(key: &CtKey<A>) -> Option<&'a CtValue> {
    // SAFETY: map value pointers are valid for this program run.
    A::established().get_ptr(key).or_else(|| A::new_flows().get_ptr(key)).map(|v| unsafe { &*v })
}
