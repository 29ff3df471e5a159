//! Per-service counters (`KPR_SERVICE_STATS`, exported as `kpr_service_*`): a service port's
//! new flows, `connect()` calls, unanswered flows, packets, bytes, drops and rejects, per CPU.
//! Only the paths that already pay a map lookup or more come here (a new flow, a refused
//! packet, a connect, a packet the flow cache did not serve): an established packet the cache
//! serves adds to its slot instead (`flow_cache`), folded in here when the slot is filled
//! again. With `--endpoint-counters`, the same words (but drops and rejects) are counted per
//! endpoint in `KPR_ENDPOINT_STATS`, at the same places.
use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_map_lookup_elem, bpf_map_update_elem},
};
use proxy_common::{Addr, BackendAnswers, BackendKey, CtValue, EndpointStats, ServiceStats, ct, service_stat};

use crate::{
    globals::KPR_ENDPOINT_COUNTERS,
    maps::{BACKEND_ANSWERS, ENDPOINT_STATS, SERVICE_STATS, atomic_add},
};

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
    if !stats.is_null() {
        // SAFETY: this CPU's value, valid for this program run; no other writer on this CPU.
        add_words(unsafe { &mut (*stats).words }, word, packets, bytes);
    }
}

/// A translated packet of `bytes` of a flow whose entry is `entry` (the packet's source and
/// source port `src`, `sport`), counted for its service port and its endpoint: where the
/// client's packets go, where the replies come from.
#[inline(always)]
pub fn flow_packet(entry: &CtValue, src: &Addr, sport: u16, proto: u8, bytes: u64) {
    add(entry.service_id, service_stat::NONE, 1, bytes);
    let (endpoint, port) = if entry.flags & ct::REPLY != 0 { (src, sport) } else { (&entry.dst_addr, entry.dst_port) };
    self::endpoint(endpoint, port, proto, service_stat::NONE, 1, bytes);
}

/// Count for endpoint `addr`:`port` (network order, `proto`) what [`update`] counts for its
/// service port: one in `word` (not a drop or reject), and `packets` and `bytes`. Nothing
/// without `--endpoint-counters` (the verifier drops the code) or for an endpoint past the cap
/// (no entry). A subprogram: the key is built in its own frame.
#[inline(always)]
pub fn endpoint(addr: &Addr, port: u16, proto: u8, word: u32, packets: u64, bytes: u64) {
    if KPR_ENDPOINT_COUNTERS.load() != 0 {
        add_endpoint(addr, u32::from(port) | u32::from(proto) << 16, word, packets, bytes);
    }
}

#[inline(never)]
fn add_endpoint(addr: &Addr, port_proto: u32, word: u32, packets: u64, bytes: u64) {
    let key = BackendKey { addr: *addr, port: port_proto as u16, proto: (port_proto >> 16) as u8, _pad: 0 };
    bump_endpoint(&key, word, packets, bytes);
}

/// A `connect()` the socket path translated to endpoint `addr`:`port` (`port_proto`: the port,
/// network order, and the protocol above it), counted for service port `service_id` and the
/// endpoint. One subprogram for both, its arguments in registers: the connect programs'
/// frames leave 32 bytes for a call on 6.1 (512 in all).
#[inline(never)]
pub fn connect(service_id: u32, addr_low: u64, addr_high: u64, port_proto: u32) {
    update(service_id, service_stat::CONNECTS, 0, 0);
    if KPR_ENDPOINT_COUNTERS.load() != 0 {
        let words = [addr_low as u32, (addr_low >> 32) as u32, addr_high as u32, (addr_high >> 32) as u32];
        let key = BackendKey { addr: Addr(words), port: port_proto as u16, proto: (port_proto >> 16) as u8, _pad: 0 };
        bump_endpoint(&key, service_stat::CONNECTS, 0, 0);
    }
}

#[inline(always)]
fn bump_endpoint(key: &BackendKey, word: u32, packets: u64, bytes: u64) {
    let map = core::ptr::from_ref(&ENDPOINT_STATS).cast_mut().cast::<core::ffi::c_void>();
    let key_ptr = core::ptr::from_ref(key).cast::<core::ffi::c_void>();
    // SAFETY: a map and a key of its type; the value (if any) is this CPU's, valid for this run.
    let stats = unsafe { bpf_map_lookup_elem(map, key_ptr) }.cast::<EndpointStats>();
    if !stats.is_null() {
        // SAFETY: this CPU's value, valid for this program run; no other writer on this CPU.
        add_words(unsafe { &mut (*stats).words }, word, packets, bytes);
    }
}

/// One in `word` (none past the words: `service_stat::NONE`, or a frontend's word an endpoint
/// has not), and `packets` and `bytes`, to a counters value's words.
#[inline(always)]
fn add_words<const N: usize>(words: &mut [u64; N], word: u32, packets: u64, bytes: u64) {
    if let Some(w) = words.get_mut(word as usize) {
        *w += 1;
    }
    words[service_stat::PACKETS as usize] += packets;
    words[service_stat::BYTES as usize] += bytes;
}

/// How an endpoint answered a new flow's first packet (`KPR_BACKEND_ANSWERS`' words).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Answered,
    /// A RST to a SYN.
    Refused,
    /// No answer: a socket-path SYN unanswered at its first retransmission, or closed before
    /// any answer (the per-packet path's unanswered flows are read from its new-flow tables).
    Unanswered,
}

/// The endpoint at `addr`:`port` (network order) answered a new flow's first packet as
/// `answer`: counted in `KPR_BACKEND_ANSWERS`, which the agent's outlier detection reads.
/// Once per flow (per packet) or socket (socket path), never on an established packet.
#[inline(never)]
pub fn backend_answered(addr: &Addr, port: u16, proto: u8, answer: Answer) {
    let key = BackendKey { addr: *addr, port, proto, _pad: 0 };
    let map = core::ptr::from_ref(&BACKEND_ANSWERS).cast_mut().cast::<core::ffi::c_void>();
    let key_ptr = core::ptr::from_ref(&key).cast::<core::ffi::c_void>();
    // SAFETY: a map and a key of its type; the value (if any) is valid for this run.
    let counts = unsafe { bpf_map_lookup_elem(map, key_ptr) }.cast::<BackendAnswers>();
    if counts.is_null() {
        let first = BackendAnswers {
            answered: u64::from(answer == Answer::Answered),
            refused: u64::from(answer == Answer::Refused),
            unanswered: u64::from(answer == Answer::Unanswered),
        };
        let value = core::ptr::from_ref(&first).cast::<core::ffi::c_void>();
        // SAFETY: a map, a key and a value of its types. A racing insert on another CPU wins
        // (BPF_NOEXIST): one answer uncounted.
        unsafe { bpf_map_update_elem(map, key_ptr, value, u64::from(BPF_NOEXIST)) };
        return;
    }
    // SAFETY: a map value, valid for this program run; other CPUs add to it too.
    let word = unsafe {
        match answer {
            Answer::Answered => &raw mut (*counts).answered,
            Answer::Refused => &raw mut (*counts).refused,
            Answer::Unanswered => &raw mut (*counts).unanswered,
        }
    };
    atomic_add(word, 1);
}
