//! A per-CPU cache of established flows in front of the conntrack tables, as Open vSwitch keeps
//! an exact-match cache in front of its classifier: a direct-mapped array indexed by a
//! multiplicative hash of the flow's key, so that a packet of a cached flow is translated after
//! an array read and a compare of its key, without the conntrack lookup (the kernel's hash
//! table: its jhash, the bucket walk and the key compare, each a call whose return the kernel's
//! return-stack mitigations make dear). Per CPU: no locks, and no cache line written by two CPUs.
//!
//! An entry is a copy of the flow's conntrack entry, and it serves only while that copy is what
//! the table would answer:
//! - until the entry's next refresh is due (`ct::REFRESH_NS` after its `last_seen`, sooner if
//!   the flow's lifetime is shorter), when the packet goes to the table again and is counted
//!   there, so flows age, expire and are refreshed exactly as without the cache;
//! - while the kept route it may be sent straight out by is of the current period;
//! - while `KPR_CT_GENERATION` is as it was when it was filled: whoever removes a conntrack entry
//!   (the programs forgetting a flow, the agent's sweep and endpoint flushes, `kpr conntrack
//!   flush`) changes it, and every CPU's copies stop serving at once;
//! - for packets that change nothing in the entry (no SYN, FIN or RST; not a fragment): those
//!   take the table's path.
//!
//! What the cache cannot see: the kernel evicting an entry from a full table (LRU). Its cached
//! copy serves until its refresh is due (at most a second); the next packet then re-creates the
//! flow as it does today after an eviction. A refresh is also the only lookup that marks a
//! cached flow as recently used in the LRU's eyes.
use aya_ebpf::{
    btf_maps::{Array, PerCpuArray},
    macros::btf_map,
};
use proxy_common::{Addr, Addr4, CtKey, CtValue, ct_generation, defaults};

use crate::maps::{FlowCache, FlowTables};

const SLOTS: usize = defaults::FLOW_CACHE_SLOTS as usize;
const _: () = assert!(SLOTS.is_power_of_two());

/// A cached flow: its key, its conntrack entry, and how long the copy serves.
#[repr(C, align(8))]
pub struct CachedFlow<A> {
    key: CtKey<A>,
    generation: Generation,
    /// The programs' clock (ns) from which the copy no longer serves.
    valid_until: u64,
    /// 1: the entry's kept route was of the current period (it serves a packet sent straight out).
    routed: u64,
    pub entry: CtValue,
}

/// `KPR_CT_GENERATION`'s words, as they were read.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Generation {
    datapath: u64,
    agent: u64,
}

#[btf_map(name = "KPR_FLOW_CACHE4")]
pub static FLOW_CACHE4: FlowCache<Addr4> = PerCpuArray::new();

#[btf_map(name = "KPR_FLOW_CACHE6")]
pub static FLOW_CACHE6: FlowCache<Addr> = PerCpuArray::new();

/// See [`proxy_common::ct_generation`]. Pinned: the agent and the CLI change it.
#[btf_map(name = "KPR_CT_GENERATION", pin_by_name)]
static CT_GENERATION: Array<u64, { ct_generation::WORDS as usize }> = Array::new();

/// The generation now. Read before the flow's conntrack lookup: an entry removed after this
/// read was filled (if at all) with this generation, which its remover then changes (x86's
/// loads are not reordered with each other).
#[inline(always)]
pub fn generation() -> Generation {
    let word = |i| CT_GENERATION.get(i).copied().unwrap_or(0);
    Generation { datapath: word(ct_generation::DATAPATH), agent: word(ct_generation::AGENT) }
}

/// A conntrack entry was removed by the programs: every CPU's cached flows stop serving. The
/// word gets a value it never had: the clock in ns and this CPU's number. A plain store: Rust's
/// BPF target offers no atomic add, and two CPUs each adding one by a read and a write could
/// write the same value.
#[inline(always)]
pub fn forgotten() {
    if let Some(word) = CT_GENERATION.get_ptr_mut(ct_generation::DATAPATH) {
        // SAFETY: helpers without arguments; a map value, 8-byte aligned.
        unsafe {
            let now = aya_ebpf::helpers::bpf_ktime_get_ns();
            let cpu = u64::from(aya_ebpf::helpers::bpf_get_smp_processor_id());
            word.write_volatile(now << 12 | cpu & 0xfff);
        }
    }
}

/// [`probe`]: the key's slot serves another flow (or there is none); nothing is put there.
pub const NO_SLOT: u32 = u32::MAX;

/// The index of `key`'s slot (8-byte aligned, as [`CtKey::write_words`] writes it): the top bits
/// of a sum of the key's words each multiplied by an odd constant (the products independent of
/// each other, so that they are worked out side by side).
#[inline(always)]
fn slot_index<A: FlowTables>(key: &CtKey<A>) -> u32 {
    const ODD: [u64; 5] = [
        0x9E37_79B9_7F4A_7C15,
        0xC2B2_AE3D_27D4_EB4F,
        0x1656_67B1_9E37_79F9,
        0xD6E8_FEB8_6659_FD93,
        0xFF51_AFD7_ED55_8CCD,
    ];
    const { assert!(size_of::<CtKey<A>>() / 8 <= ODD.len()) };
    let words = (key as *const CtKey<A>).cast::<u64>();
    let mut hash = 0u64;
    for (i, odd) in ODD.iter().enumerate().take(size_of::<CtKey<A>>() / 8) {
        // SAFETY: the key's words.
        hash = hash.wrapping_add(unsafe { words.add(i).read() }.wrapping_mul(*odd));
    }
    (hash >> (64 - SLOTS.trailing_zeros())) as u32
}

/// The cached entry of `key`, if it serves a packet at `now` (`straight_out`: one to be sent
/// straight out by the entry's kept route). Else `free` is the slot that [`fill`] may put the
/// table's answer in, or `NO_SLOT` while the slot serves another flow: a flow keeps its slot
/// until its copy is due for a refresh, so that flows sharing a slot do not take it from each
/// other on every packet (and a packet that could not be cached costs no attempt).
#[inline(always)]
pub fn probe<'a, A: FlowTables>(
    key: &CtKey<A>,
    generation: Generation,
    now: u64,
    straight_out: bool,
    free: &mut u32,
) -> Option<&'a CtValue> {
    *free = NO_SLOT;
    let index = slot_index(key);
    // SAFETY: a map value, valid for this program run.
    let cached = unsafe { &*A::flow_cache().get_ptr_mut(index)? };
    let live = now < cached.valid_until && cached.generation == generation;
    let same = same_key(&cached.key, key);
    if live && same && (!straight_out || cached.routed != 0) {
        return Some(&cached.entry);
    }
    if !live || same {
        *free = index;
    }
    None
}

/// Put `entry` (the conntrack entry of `key`) in slot `index` ([`probe`]'s `free`), serving
/// until `valid_until`. True: filled.
#[inline(always)]
pub fn fill<A: FlowTables>(
    index: u32,
    key: &CtKey<A>,
    entry: &CtValue,
    generation: Generation,
    now: u64,
    valid_until: u64,
    routed: bool,
) -> bool {
    if index == NO_SLOT || now >= valid_until {
        return false;
    }
    let Some(slot) = A::flow_cache().get_ptr_mut(index) else { return false };
    // SAFETY: a map value of this CPU's, valid for this program run.
    unsafe {
        copy_words(key, &raw mut (*slot).key);
        core::ptr::copy_nonoverlapping(entry, &raw mut (*slot).entry, 1);
        (*slot).generation = generation;
        (*slot).valid_until = valid_until;
        (*slot).routed = u64::from(routed);
    }
    true
}

/// Two keys compared in 8-byte words (a key's size is a multiple of 8; both are 8-byte aligned).
#[inline(always)]
fn same_key<A: FlowTables>(a: &CtKey<A>, b: &CtKey<A>) -> bool {
    let (a, b) = ((a as *const CtKey<A>).cast::<u64>(), (b as *const CtKey<A>).cast::<u64>());
    let mut differ = 0;
    for i in 0..size_of::<CtKey<A>>() / 8 {
        // SAFETY: the keys' words.
        differ |= unsafe { a.add(i).read() ^ b.add(i).read() };
    }
    differ == 0
}

/// Copy a key in 8-byte words (both 8-byte aligned).
///
/// # Safety
/// `to` is valid for writes of a key.
#[inline(always)]
unsafe fn copy_words<A: FlowTables>(from: &CtKey<A>, to: *mut CtKey<A>) {
    let (from, to) = ((from as *const CtKey<A>).cast::<u64>(), to.cast::<u64>());
    for i in 0..size_of::<CtKey<A>>() / 8 {
        // SAFETY: the keys' words.
        unsafe { to.add(i).write(from.add(i).read()) };
    }
}
