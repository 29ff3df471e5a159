//! The per-CPU scratch area the stages hand each other keys, entries and routes in: on the
//! BPF stack they would not fit beside the rest of the path (512 bytes for a chain of calls).
use aya_ebpf::{
    bindings::{bpf_fib_lookup, bpf_redir_neigh},
    btf_maps::PerCpuArray,
    macros::btf_map,
};
use proxy_common::{Addr, Addr4, Backend, CtKey, CtValue, Generation, ServiceValue};

use crate::{
    flow_cache,
    maps::{FlowTables, TickClock},
};

/// Per-CPU room for the conntrack keys and values a packet writes: on the BPF stack they would
/// not fit beside the rest of the path (512 bytes for a chain of calls).
#[repr(C)]
pub struct FlowScratch {
    /// A packet's conntrack key, and a copy of its entry. First: the key is written in 8-byte
    /// words, 8-byte aligned, and here it lies within one cache line.
    pub(super) flow_key: KeySlot,
    pub(super) entry: CtValue,
    pub(super) key: KeySlot,
    pub(super) reply_key: KeySlot,
    pub(super) forward: CtValue,
    pub(super) reply: CtValue,
    pub(super) icmp: IcmpFix,
    /// `icmp::too_big`'s answer, assembled (IPv6: 96 bytes), 4-aligned.
    pub(super) answer: [u32; 24],
    /// A new flow's service entry and backend.
    pub(super) service: ServiceValue,
    pub(super) backend: Backend,
    /// Its reply entry's [`CtValue::addrs_csum_diff`] while the client is not masqueraded.
    pub(super) reply_csum_diff: u32,
    /// The route lookup of a masquerade address, and then `forward_direct`'s.
    pub(super) fib: bpf_fib_lookup,
    /// 1: `fib`'s link is a peer one, and `fib` holds its MAC addresses (`peer_route`).
    pub(super) fib_peer: u32,
    /// `translate_tracked` → `forward_direct`: how to route the packet of an established flow (`ROUTE_*`).
    pub(super) route: u32,
    /// `redirect_by`: the kept next hop, as `bpf_redirect_neigh` takes it.
    pub(super) next_hop: bpf_redir_neigh,
    /// The time at this CPU's last tick (`now_by_tick`).
    pub(super) clock: TickClock,
    /// `translate_tracked`: the conntrack generation read before its lookup, and the flow cache's slot
    /// its entry may be put in (`flow_cache::probe`, `flow_cache::fill`).
    pub(super) generation: Generation,
    pub(super) cache_slot: flow_cache::FreeSlot,
    /// `dsr::decapsulate` → `dsr::open_decapsulated`.
    pub(super) dsr: DsrHint,
    /// `dsr::encapsulate` → `dsr::failed` → `icmp::too_big`: the packet was refused room for
    /// the tunnel (`dsr::REFUSED`), and is too big for it; the tunnel's far end.
    pub(super) dsr_too_big: u32,
    pub(super) dsr_endpoint: Addr,
}

/// What `dsr::decapsulate` learnt of a packet for the slow path, which opens its flow
/// (`dsr::open_decapsulated`): the inner tuple's client side and frontend port, the endpoint the
/// entry node picked, and the frontend's entry. In the scratch area.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct DsrHint {
    pub(super) client: Addr,
    pub(super) frontend: Addr,
    pub(super) backend: Backend,
    pub(super) service: ServiceValue,
    pub(super) client_port: u16,
    pub(super) frontend_port: u16,
    pub(super) proto: u8,
    /// 1: not used yet.
    pub(super) fresh: u8,
    pub(super) _pad: u16,
}

/// Room for a conntrack key of either family's tables, 8-byte aligned ([`CtKey::write_words`]).
#[repr(C, align(8))]
pub(super) union KeySlot {
    pub(super) v4: CtKey<Addr4>,
    pub(super) v6: CtKey,
}

#[btf_map(name = "KPR_FLOW_SCRATCH")]
static SCRATCH: PerCpuArray<FlowScratch, 1> = PerCpuArray::new();

/// This CPU's scratch value. A handle, copied down a chain of stages (or taken again with
/// [`scratch`]): each use is an access of its own, no reference to the value outlives it.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(super) struct Scratch(*mut FlowScratch);

#[inline(always)]
pub(super) fn scratch() -> Result<Scratch, ()> {
    SCRATCH.get_ptr_mut(0).map(Scratch).ok_or(())
}

// SAFETY (of every access through a `Scratch`): the pointer is the per-CPU map value, valid
// for the whole program run, and a tc program runs to its end on its CPU with nothing else
// using that value meanwhile (no other program of this CPU runs before it returns).
impl core::ops::Deref for Scratch {
    type Target = FlowScratch;
    #[inline(always)]
    fn deref(&self) -> &FlowScratch {
        // SAFETY: see above.
        unsafe { &*self.0 }
    }
}

impl core::ops::DerefMut for Scratch {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut FlowScratch {
        // SAFETY: see above.
        unsafe { &mut *self.0 }
    }
}

impl Scratch {
    /// The value itself, for a stage that holds a reference into it across other accesses
    /// (which the borrow checker cannot tell apart through a `Deref`).
    #[inline(always)]
    pub(super) fn as_ptr(self) -> *mut FlowScratch {
        self.0
    }
    #[inline(always)]
    pub(super) fn key<A: FlowTables>(self) -> *mut CtKey<A> {
        // SAFETY: see above.
        unsafe { FlowScratch::key(self.0) }
    }
    #[inline(always)]
    pub(super) fn reply_key<A: FlowTables>(self) -> *mut CtKey<A> {
        // SAFETY: see above.
        unsafe { FlowScratch::reply_key(self.0) }
    }
    #[inline(always)]
    pub(super) fn flow_key<A: FlowTables>(self) -> *mut CtKey<A> {
        // SAFETY: see above.
        unsafe { FlowScratch::flow_key(self.0) }
    }
}

impl FlowScratch {
    // The key slots as keys of the tables of addresses `A` (the union's fields start at its
    // start). SAFETY of each: `s` is the per-CPU scratch value.
    #[inline(always)]
    pub(super) unsafe fn key<A: FlowTables>(s: *mut Self) -> *mut CtKey<A> {
        unsafe { (&raw mut (*s).key).cast() }
    }
    #[inline(always)]
    pub(super) unsafe fn reply_key<A: FlowTables>(s: *mut Self) -> *mut CtKey<A> {
        unsafe { (&raw mut (*s).reply_key).cast() }
    }
    #[inline(always)]
    pub(super) unsafe fn flow_key<A: FlowTables>(s: *mut Self) -> *mut CtKey<A> {
        unsafe { (&raw mut (*s).flow_key).cast() }
    }
}

/// How an ICMP error about a translated flow is translated back.
#[repr(C)]
pub(super) struct IcmpFix {
    pub(super) client: Addr,
    pub(super) frontend: Addr,
    /// The outer source: the frontend when the backend complained, else unchanged.
    pub(super) new_src: Addr,
    /// Checksum differences of the quoted and the outer addresses.
    pub(super) inner_diff: u64,
    pub(super) outer_diff: u64,
    /// The quoted ports, before and after.
    pub(super) old_ports: u32,
    pub(super) new_ports: u32,
}
