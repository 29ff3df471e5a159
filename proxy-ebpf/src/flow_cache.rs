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
//! A slot is told apart by its tag first, a word per slot in an array of their own (8 KiB per
//! family and CPU, so it stays in the CPU's caches): part of the key's hash and when the copy
//! stops serving. A packet of a flow not cached (a young flow's first packets, nearly every
//! packet of short connections) then costs a read of that warm word, not of its slot, which a
//! busy node has pushed out of the CPU's caches long since: on the NodePort bench that miss
//! was the attached program's costliest instruction.
//!
//! Only established flows are cached, and their table evicts nothing: every removal is a
//! program's or the agent's, which move the generation on.
//!
//! A slot also counts the packets and bytes it serves (two additions to a line already in the
//! CPU's cache), for its service port's counters (`stats`): they are added to
//! `KPR_SERVICE_STATS` when the slot is filled again (at most once a second for a busy flow),
//! and a scrape adds what the slots hold.
use proxy_common::{CachedFlow, CtKey, CtValue, Generation, ct, ct_generation, service_stat};

use crate::{
    maps::{CT_GENERATION, FLOW_CACHE_SLOTS as SLOTS, FlowTables},
    stats,
};

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

/// The slot [`probe`] left for [`fill`], and the key's hash for its tag (not worked out again).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FreeSlot {
    pub index: u32,
    hash: u32,
}

/// The index of `key`'s slot (8-byte aligned, as [`CtKey::write_words`] writes it) and its
/// tag's hash: the top bits and the low half of a sum of the key's words each multiplied by an
/// odd constant (the products independent of each other, so that they are worked out side by
/// side).
#[inline(always)]
fn slot_of<A: FlowTables>(key: &CtKey<A>) -> (u32, u32) {
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
    ((hash >> (64 - SLOTS.trailing_zeros())) as u32, hash as u32)
}

/// A time in the tags' units.
#[inline(always)]
fn coarse(ns: u64) -> u32 {
    (ns >> 20) as u32
}

/// Does the tag say its slot's copy may still serve at `now`? Never when it does not (the
/// tag's time is rounded down), and for a slot of another generation too: those keep their
/// slot until their time is up, as they do when their own flow's packets find them.
#[inline(always)]
fn tag_live(tag: u64, now: u64) -> bool {
    (tag as u32).wrapping_sub(coarse(now)) as i32 > 0
}

/// The cached entry of `key`, if it serves a packet (of `bytes`, counted in the slot) at `now`
/// (`straight_out`: one to be sent straight out by the entry's kept route). Else `free` is the slot that [`fill`] may put the
/// table's answer in, or `NO_SLOT` while the slot serves another flow: a flow keeps its slot
/// until its copy is due for a refresh, so that flows sharing a slot do not take it from each
/// other on every packet (and a packet that could not be cached costs no attempt).
#[inline(always)]
pub fn probe<'a, A: FlowTables>(
    key: &CtKey<A>,
    generation: Generation,
    now: u64,
    straight_out: bool,
    bytes: u64,
    free: &mut FreeSlot,
) -> Option<&'a CtValue> {
    let (index, hash) = slot_of(key);
    *free = FreeSlot { index: NO_SLOT, hash };
    // SAFETY: a map value, valid for this program run; the index is below SLOTS (`slot_of`).
    let tag = unsafe { *(*A::flow_cache_tags().get_ptr_mut(0)?).get(index as usize)? };
    if (tag >> 32) as u32 != hash {
        // Another flow's slot, or an empty one: its tag tells whether it is free.
        if !tag_live(tag, now) {
            free.index = index;
        }
        return None;
    }
    let cached = A::flow_cache().get_ptr_mut(index)?;
    // SAFETY: a map value of this CPU's, valid for this program run.
    let cached = unsafe { &mut *cached };
    let live = now < cached.valid_until && cached.generation == generation;
    let same = same_key(&cached.key, key);
    if live && same && (!straight_out || cached.routed != 0) {
        cached.packets += 1;
        cached.bytes += bytes;
        return Some(&cached.entry);
    }
    if !live || same {
        free.index = index;
    }
    None
}

/// The slot of `key` if its copy serves at `now`, whatever its kept route: XDP's look, which
/// routes the packet itself. It takes no slot and counts nothing (XDP counts the packet in the
/// slot once it sends it).
#[inline(always)]
pub fn peek<A: FlowTables>(key: &CtKey<A>, generation: Generation, now: u64) -> Option<*mut CachedFlow<A>> {
    let (index, hash) = slot_of(key);
    // SAFETY: a map value, valid for this program run; the index is below SLOTS (`slot_of`).
    let tag = unsafe { *(*A::flow_cache_tags().get_ptr_mut(0)?).get(index as usize)? };
    if (tag >> 32) as u32 != hash {
        return None;
    }
    let cached = A::flow_cache().get_ptr_mut(index)?;
    // SAFETY: a map value of this CPU's, valid for this program run.
    let serves =
        unsafe { now < (*cached).valid_until && (*cached).generation == generation && same_key(&(*cached).key, key) };
    serves.then_some(cached)
}

/// Put `entry` (the conntrack entry of `key`) in `slot` ([`probe`]'s `free`), serving
/// until `valid_until`, and count the packet (of `bytes`) there. What the slot counted for the
/// flow it held is added to that flow's service port first. True: filled.
#[inline(always)]
pub fn fill<A: FlowTables>(
    slot: FreeSlot,
    key: &CtKey<A>,
    entry: &CtValue,
    generation: Generation,
    now: u64,
    valid_until: u64,
    routed: bool,
    bytes: u64,
) -> bool {
    if slot.index == NO_SLOT || now >= valid_until {
        return false;
    }
    let Some(tags) = A::flow_cache_tags().get_ptr_mut(0) else { return false };
    let Some(cached) = A::flow_cache().get_ptr_mut(slot.index) else { return false };
    // SAFETY: map values of this CPU's, valid for this program run.
    unsafe {
        let Some(tag) = (*tags).get_mut(slot.index as usize) else { return false };
        *tag = u64::from(slot.hash) << 32 | u64::from(coarse(valid_until));
        if (*cached).packets != 0 {
            fold(cached);
        }
        (*cached).packets = 1;
        (*cached).bytes = bytes;
        copy_words(key, &raw mut (*cached).key);
        core::ptr::copy_nonoverlapping(entry, &raw mut (*cached).entry, 1);
        (*cached).generation = generation;
        (*cached).valid_until = valid_until;
        (*cached).routed = u64::from(routed);
    }
    true
}

/// Add what a slot counted to its flow's service port (and endpoint). A subprogram taking the
/// slot: its fields are not held across the call in the caller's frame.
#[inline(never)]
fn fold<A: FlowTables>(cached: *const CachedFlow<A>) {
    // SAFETY: a map value of this CPU's, valid for this program run.
    let cached = unsafe { &*cached };
    stats::update(cached.entry.service_id, service_stat::NONE, cached.packets, cached.bytes);
    // The endpoint: where the client's packets go, where the replies come from.
    let (endpoint, port) = if cached.entry.flags & ct::REPLY != 0 {
        (cached.key.src_addr.addr(), cached.key.src_port)
    } else {
        (cached.entry.dst_addr, cached.entry.dst_port)
    };
    stats::endpoint(&endpoint, port, cached.key.proto, service_stat::NONE, cached.packets, cached.bytes);
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
