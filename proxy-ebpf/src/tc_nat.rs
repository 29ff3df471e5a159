//! Per-packet service translation on node interfaces (tc/TCX), IPv4 and IPv6: written once,
//! generic over `family::Family`, compiled for each.
//!
//! Ingress: a packet of a known flow is rewritten from its conntrack entry; a new packet to a
//! frontend (ClusterIP, externalIP, LoadBalancer IP, NodeIP:nodePort) gets a backend,
//! masquerade (SNAT to the node) when the frontend says so or the client is its own backend
//! (hairpin), and two conntrack entries: one for its direction, one for the replies.
//! Egress: only the conntrack rewrite (replies of local backends leaving toward the client).
//!
//! Flows live as long as their state allows (`CtTimeouts`: SYN sent, established, closing);
//! an expired flow's tuple and SNAT port are taken back on the packet path, and the agent
//! sweeps the rest. The backend and SNAT port of a new flow are a hash of its tuple, so a TCP
//! connection whose entries were evicted is re-created as it was by its next segment.
//!
//! An IPv4 datagram in fragments is translated whole: the first fragment (with the ports) as
//! any packet, the later ones with the addresses it got (`KPR_FRAGMENTS`).
//!
//! Packets the program does not translate go on to the next program of the hook
//! (`TC_ACT_UNSPEC`: a CNI's or observability program attached after kpr still sees them);
//! packets with headers it does not walk (IPv4 options, IPv6 extension headers, IPv6
//! fragments) are also counted.
//! The program never fails a packet it did not translate.
use core::mem::MaybeUninit;

use aya_ebpf::{
    EbpfContext as _, Global,
    bindings::{
        __sk_buff, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_FIB_LKUP_RET_BLACKHOLE, BPF_FIB_LKUP_RET_NO_NEIGH,
        BPF_FIB_LKUP_RET_NOT_FWDED, BPF_FIB_LKUP_RET_PROHIBIT, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LKUP_RET_UNREACHABLE,
        BPF_FIB_LOOKUP_SKIP_NEIGH, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC, bpf_fib_lookup, bpf_redir_neigh,
        bpf_redir_neigh__bindgen_ty_1,
    },
    btf_maps::{PerCpuArray, ProgramArray, lpm_trie::Key},
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect_neigh, bpf_redirect_peer},
    macros::{btf_map, classifier},
    programs::TcContext,
};
use proxy_common::{
    AFFINITY_BY_ADDR, Addr, Addr4, Backend, CachedRoute, CidrKey, CtKey, CtTimeouts, CtValue, DETECT_LOCAL_CIDR,
    DETECT_LOCAL_INTERFACE, FlowAddr, FragmentKey, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, LINK_FLAG_ACCEPT_LOCAL_SET,
    LINK_FLAG_LOCAL_TRAFFIC, LINK_FLAG_PEER, LINK_FLAG_RP_FILTER_LOOSE, LINK_FLAG_RP_FILTER_STRICT,
    LINK_FLAG_TC_INGRESS, NODE_ADDR_LOCAL, NODE_ADDR_NODEPORT, SCOPE_EXTERNAL, SCOPE_NODE, SCOPE_POD,
    SERVICE_FLAG_DROP_NO_ENDPOINTS, SERVICE_FLAG_SNAT, SERVICE_FLAG_SOURCE_RANGES, SNAT_PORT_MAX, SNAT_PORT_MIN,
    ServiceKey, ServiceValue, SourceRange, addrs_csum_diff, counter, crc32c, csum, csum::L4State, ct, has_states,
    tc_slow_path,
};

use crate::{
    family::{Family, Fragment, V4, V6},
    flow_cache,
    maps::{
        FRAGMENTS, FlowMap, FlowTables, HANDOVER, LINKS, LOCAL_CIDRS, SERVICES, SOURCE_RANGES, ServiceRangeMiss,
        TickClock, affinity_backend, backend_at, count, handed_over, host_lets_direct, in_addr_filter, link,
        link_flags, node_addr_flags, now, now_by_tick, refusal, remember_affinity, serves, service_range_miss,
    },
    packet::*,
    tc_reject::{reject_port_unreachable, reject_tcp},
};

/// Tries at finding a free SNAT port before giving up on a new flow.
const SNAT_TRIES: u32 = 16;

/// The SNAT port range, disjoint from the node's ephemeral ports; set by the agent at load.
#[unsafe(no_mangle)]
static KPR_SNAT_PORT_MIN: Global<u16> = Global::new(SNAT_PORT_MIN);
#[unsafe(no_mangle)]
static KPR_SNAT_PORT_MAX: Global<u16> = Global::new(SNAT_PORT_MAX);

/// How pods are told from other sources (`DETECT_LOCAL_*`); set by the agent at load time.
#[unsafe(no_mangle)]
static KPR_DETECT_LOCAL: Global<u8> = Global::new(0);

/// Flow lifetimes by state; set by the agent at load time.
#[unsafe(no_mangle)]
static KPR_CT_TIMEOUTS: Global<CtTimeouts> = Global::new(CtTimeouts::DEFAULT);

/// Seed of the flow hash (backend and SNAT port choice); set by the agent at load time, the
/// same for every agent of one boot so that a restarted agent re-creates flows as they were.
#[unsafe(no_mangle)]
static KPR_FLOW_HASH_SEED: Global<u32> = Global::new(0);

/// Has the flow outlived the lifetime of its state? One word of `KPR_CT_TIMEOUTS` read: its
/// `load` copies all six, on every packet.
#[inline(always)]
fn expired(proto: u8, entry: &CtValue, now: u64) -> bool {
    entry.idle_longer_than(lifetime(proto, entry.flags), now)
}

/// How long a flow of `proto` in state `flags` lives after its latest packet (one word of
/// `KPR_CT_TIMEOUTS` read).
#[inline(always)]
fn lifetime(proto: u8, flags: u32) -> u64 {
    const _: () = assert!(size_of::<CtTimeouts>() == size_of::<[u64; 6]>());
    // SAFETY: `Global` is transparent over the `#[repr(C)]` struct of six u64 in the order of
    // `as_words`, and the slot is one of them; volatile, as `load` reads it (the loader sets it).
    unsafe { (&raw const KPR_CT_TIMEOUTS).cast::<u64>().add(CtTimeouts::slot(proto, flags)).read_volatile() }
}

/// "Not mine": the next program of the hook (TCX) or filter of the chain (cls_bpf) decides.
const PASS: i32 = TC_ACT_UNSPEC;

/// Where the kernel's `sk_buff` keeps `ip_summed` (the packet's checksum state), as
/// `byte << 8 | bit`; set by the agent from the kernel's BTF where the programs may read it
/// (6.2+: `bpf_cast_to_kern_ctx`). 0: they may not, and the checksum helper decides.
#[unsafe(no_mangle)]
static KPR_IP_SUMMED_AT: Global<u32> = Global::new(0);

/// 1: a packet translated on its way in is sent straight out of the link its route leaves by;
/// 0: it goes on through the host's forwarding path (`--host-routing`). Set by the agent.
#[unsafe(no_mangle)]
static KPR_FORWARD_DIRECT: Global<u8> = Global::new(1);

/// 1 (6.3+, set by the agent): the route lookup skips the neighbour table and hands its next
/// hop to `bpf_redirect_neigh`, which then resolves the neighbour without a second route
/// lookup of its own. 0: the lookup finds the neighbour and the redirect routes again.
#[unsafe(no_mangle)]
static KPR_REDIRECT_NEXT_HOP: Global<u8> = Global::new(0);

/// The slow programs (`program_names::TC_SLOW_PATH`), by slot: where the attached programs
/// hand a packet whose flow is not in conntrack (a new flow, an ICMP error, not a flow at all).
/// The attached programs keep to an established flow's path with its stages inlined: a
/// subprogram call and its return cost about 7.5 ns where the kernel mitigates returns (AMD's
/// SRSO), and a program with those stages inlined could not also call the new-flow path's chain
/// of subprograms within the 512-byte BPF stack. A tail call starts the slow program on a
/// stack of its own. Filled by the agent before it attaches; pinned, so that it outlives it.
#[btf_map(name = "KPR_TC_SLOW_PATH", pin_by_name)]
static SLOW_PATH: ProgramArray<2> = ProgramArray::new();

#[classifier]
pub fn kpr_tc_ingress(ctx: TcContext) -> i32 {
    match eth_type(&ctx) {
        Some(t) if t == V4::ETH_TYPE => ingress::<V4>(&ctx),
        Some(t) if t == V6::ETH_TYPE => ingress::<V6>(&ctx),
        _ => PASS,
    }
}

#[classifier]
pub fn kpr_tc_egress(ctx: TcContext) -> i32 {
    if came_through_ingress(&ctx) {
        return PASS;
    }
    match eth_type(&ctx) {
        Some(t) if t == V4::ETH_TYPE => known::<V4>(&ctx, false),
        Some(t) if t == V6::ETH_TYPE => known::<V6>(&ctx, false),
        _ => PASS,
    }
}

#[classifier]
pub fn kpr_tc_ingress_slow(ctx: TcContext) -> i32 {
    match eth_type(&ctx) {
        Some(t) if t == V4::ETH_TYPE => slow_ingress::<V4>(&ctx),
        Some(t) if t == V6::ETH_TYPE => slow_ingress::<V6>(&ctx),
        _ => PASS,
    }
}

#[classifier]
pub fn kpr_tc_egress_slow(ctx: TcContext) -> i32 {
    let verdict = match eth_type(&ctx) {
        Some(t) if t == V4::ETH_TYPE => translate::<V4>(&ctx, false),
        Some(t) if t == V6::ETH_TYPE => translate::<V6>(&ctx, false),
        _ => Ok(PASS),
    };
    verdict.unwrap_or(PASS)
}

/// The attached programs' path: a packet of a flow in conntrack translated (the verdict),
/// anything else handed to the slow program.
#[inline(always)]
fn known<F: Family>(ctx: &TcContext, ingress: bool) -> i32 {
    let mut t = MaybeUninit::<Tuple>::uninit();
    match read_and_translate::<F>(ctx, &mut t, ingress) {
        NO_FLOW | AN_ICMP_ERROR => slow_path(ctx, ingress),
        verdict => verdict,
    }
}

/// Tail call the slow program; it returns only when its slot is empty.
#[inline(always)]
fn slow_path(ctx: &TcContext, ingress: bool) -> i32 {
    let slot = if ingress { tc_slow_path::INGRESS } else { tc_slow_path::EGRESS };
    // SAFETY: the slow programs take the same context and return a tc verdict.
    unsafe { SLOW_PATH.tail_call(ctx, slot) };
    count(counter::TC_SLOW_PATH_MISSING);
    PASS
}

/// A packet on its way in, translated, sent straight out (unless `--host-routing`).
#[inline(always)]
fn ingress<F: Family>(ctx: &TcContext) -> i32 {
    if martian_source::<F>(ctx) {
        count(counter::TC_DROPPED);
        return TC_ACT_SHOT;
    }
    match known::<F>(ctx, true) {
        TC_ACT_OK if KPR_FORWARD_DIRECT.load() != 0 => forward_direct::<F>(ctx),
        verdict => verdict,
    }
}

/// The same in the slow program: every stage, as subprograms.
#[inline(always)]
fn slow_ingress<F: Family>(ctx: &TcContext) -> i32 {
    match translate::<F>(ctx, true) {
        Ok(TC_ACT_OK) if KPR_FORWARD_DIRECT.load() != 0 => forward_direct::<F>(ctx),
        Ok(verdict) => verdict,
        Err(()) => PASS,
    }
}

/// A packet that arrives with one of the node's own addresses as source, on a link where kpr
/// turned `accept_local` on (`LINK_FLAG_ACCEPT_LOCAL_SET`): a martian, which the kernel would
/// drop there without kpr. `accept_local` is for kpr's own masqueraded packets, which have the
/// node's address once translated; it must not let a pod, or a machine outside, send as the
/// node. One array read for most packets (the address filter), a hash lookup for the node's.
#[inline(always)]
fn martian_source<F: Family>(ctx: &TcContext) -> bool {
    if !F::KERNEL_CHECKS_SOURCE {
        return false;
    }
    let data = ctx.data();
    let src = if data + IP_OFF + size_of::<F::Ip>() <= ctx.data_end() {
        // SAFETY: within [data, data_end), checked above; the header is plain bytes.
        F::src(unsafe { &*((data + IP_OFF) as *const F::Ip) })
    } else {
        match ctx.load::<F::Ip>(IP_OFF).map(WordAligned) {
            Ok(ip) => F::src(&ip.0),
            Err(_) => return false,
        }
    };
    if !in_addr_filter(&src) || node_addr_flags(&src) & NODE_ADDR_LOCAL == 0 {
        return false;
    }
    let ifindex = ifindex(ctx);
    // SAFETY: a map value pointer, read at once.
    LINKS.get_ptr(&ifindex).is_some_and(|link| unsafe { (*link).flags } & LINK_FLAG_ACCEPT_LOCAL_SET != 0)
}

/// Did this packet come in by a link where kpr's ingress program ran (`LINK_FLAG_TC_INGRESS`)?
/// Forwarded, redirected or hairpinned: whatever it needed was done there. Packets of the node
/// itself (no ingress link) are the egress program's.
#[inline(always)]
fn came_through_ingress(ctx: &TcContext) -> bool {
    // SAFETY: a tc program's context is the packet's __sk_buff.
    let iif = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ingress_ifindex };
    // SAFETY: a map value pointer, read at once.
    iif != 0 && LINKS.get_ptr(&iif).is_some_and(|link| unsafe { (*link).flags } & LINK_FLAG_TC_INGRESS != 0)
}

/// The Ethernet type, read straight from the packet.
#[inline(always)]
fn eth_type(ctx: &TcContext) -> Option<u16> {
    let at = ctx.data() + 12;
    if at + 2 > ctx.data_end() {
        return ctx.load::<u16>(12).ok();
    }
    // SAFETY: bounds checked against data_end.
    Some(unsafe { read_word(at as *const u8) })
}

/// A packet's addresses and ports, as they sit in the packet (network byte order); an IPv4
/// address mapped.
#[derive(Clone, Copy)]
pub struct Tuple {
    pub saddr: Addr,
    pub daddr: Addr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// The first fragment of a datagram in fragments: its IP id (as in the packet); else
    /// `NOT_A_FIRST_FRAGMENT`. A plain integer, not an `Option`: an empty option's payload is
    /// undefined, which the compiler may store from any register, and 6.1's verifier refuses a
    /// pointer stored in two bytes.
    pub first_fragment: u32,
    /// The length of the L4 header and payload.
    pub l4_len: u16,
}

/// [`Tuple::first_fragment`] of a packet that is not a datagram's first fragment.
const NOT_A_FIRST_FRAGMENT: u32 = u32::MAX;

/// The Ethernet type, IP header and L4 ports, read in place from the packet (no helper calls,
/// no copy: a copy would be a load and a store per byte); headers outside the linear area are
/// pulled in first. Plain bytes (alignment 1): the packet gives no alignment.
#[repr(C)]
struct Headers<Ip> {
    _macs: [u8; 12],
    _eth_type: [u8; 2],
    ip: Ip,
    ports: [[u8; 2]; 2],
}

/// The packet's headers, valid until a helper changes the packet.
#[inline(always)]
fn headers<'a, F: Family>(ctx: &TcContext) -> Option<&'a Headers<F::Ip>> {
    let len = size_of::<Headers<F::Ip>>();
    if ctx.data() + len > ctx.data_end() {
        // Short or non-linear: pull what we need into the linear area (fails if too short).
        ctx.pull_data(len as u32).ok()?;
        if ctx.data() + len > ctx.data_end() {
            return None;
        }
    }
    // SAFETY: bounds checked against data_end above; Headers is plain bytes of alignment 1.
    Some(unsafe { &*(ctx.data() as *const Headers<F::Ip>) })
}

/// The slow programs' path. Its stages are subprograms called one after the other, not inlined
/// into each other: the BPF stack (512 bytes) bounds the frames of a chain of calls, not their
/// sum. (The attached programs inline the first, `known_packet`'s, and make no call for a
/// packet of a known flow: see `SLOW_PATH`.)
#[inline(always)]
fn translate<F: Family>(ctx: &TcContext, ingress: bool) -> Result<i32, ()> {
    // Filled in by `known_packet` when it says so (not zeroed first: a memset on every packet).
    let mut t = MaybeUninit::<Tuple>::uninit();
    match known_packet::<F>(ctx, &mut t, ingress) {
        NO_FLOW => {}
        AN_ICMP_ERROR => return Ok(icmp_error::<F>(ctx)),
        verdict => return Ok(verdict),
    }
    // SAFETY: `known_packet` wrote the tuple (NO_FLOW).
    let t = unsafe { t.assume_init() };
    let tcp_flags = flow_flags::<F>(ctx, t.proto);
    Ok(match unknown_flow::<F>(ctx, &t, tcp_flags, ingress) {
        OPEN => {
            let s = scratch()?;
            // SAFETY (both): the per-CPU scratch value. A route kept for a packet not sent on
            // serves no other.
            unsafe { (*s).route = if ingress { ROUTE_MAY_KEEP } else { ROUTE_LOOK_UP } };
            let verdict = open_flow::<F>(ctx, &t, tcp_flags);
            if verdict != TC_ACT_OK {
                unsafe { (*s).route = ROUTE_LOOK_UP };
            }
            verdict
        }
        // kube-proxy's REJECT: a TCP reset, else ICMP port unreachable (UDP and SCTP).
        REJECT if t.proto == IPPROTO_TCP => reject_tcp::<F>(ctx, &t),
        REJECT => reject_port_unreachable::<F>(ctx, &t),
        verdict => verdict,
    })
}

/// [`read_and_translate`] as a subprogram, for the slow programs' chains of calls.
#[inline(never)]
fn known_packet<F: Family>(ctx: &TcContext, tuple: &mut MaybeUninit<Tuple>, ingress: bool) -> i32 {
    read_and_translate::<F>(ctx, tuple, ingress)
}

/// The packet read (`inspect`) and, if its flow is in conntrack, translated (`known_flow`):
/// a verdict, `AN_ICMP_ERROR`, or `NO_FLOW` with the packet's tuple filled in.
#[inline(always)]
fn read_and_translate<F: Family>(ctx: &TcContext, tuple: &mut MaybeUninit<Tuple>, ingress: bool) -> i32 {
    match inspect::<F>(ctx, tuple) {
        A_FLOW => {}
        verdict => return verdict,
    }
    // SAFETY: `inspect` wrote the tuple (A_FLOW).
    let t = unsafe { tuple.assume_init_ref() };
    known_flow::<F>(ctx, t, flow_flags::<F>(ctx, t.proto), ingress)
}

/// What a packet tells of its flow's state, as TCP flags (SCTP's chunks in their terms).
#[inline(always)]
fn flow_flags<F: Family>(ctx: &TcContext, proto: u8) -> u8 {
    match proto {
        IPPROTO_TCP => tcp_flags::<F>(ctx),
        IPPROTO_SCTP => sctp_as_tcp_flags::<F>(ctx),
        _ => 0,
    }
}

/// No frontend, backend or node address on either side, and not the service range: nothing of
/// ours, known from the addresses in place after two array reads (and a range lookup, when the
/// range is refused), before any other work. A packet whose header is not in the linear area
/// is left to the stages (they pull it in).
#[inline(always)]
fn not_ours<F: Family>(ctx: &TcContext) -> bool {
    let data = ctx.data();
    if data + IP_OFF + size_of::<F::Ip>() > ctx.data_end() {
        return false;
    }
    // SAFETY: within [data, data_end), checked above; the header is plain bytes.
    let ip = unsafe { &*((data + IP_OFF) as *const F::Ip) };
    let daddr = F::dst(ip);
    !in_addr_filter(&daddr) && !in_addr_filter(&F::src(ip)) && service_range_miss(daddr) == ServiceRangeMiss::NotInRange
}

// What the stages tell the next, besides a verdict: plain integers, not enums (an enum's
// unused payload is an uninitialized register, which the verifier refuses to see written).
/// `inspect`: a packet of a flow, its tuple filled in.
const A_FLOW: i32 = i32::MIN;
/// `inspect`: an ICMP error, maybe about a translated flow.
const AN_ICMP_ERROR: i32 = i32::MIN + 1;
/// `known_flow`: no live flow.
const NO_FLOW: i32 = i32::MIN + 2;
/// `unknown_flow`: a new flow, of the service to the backend in the scratch area.
const OPEN: i32 = i32::MIN + 3;
/// `unknown_flow`: a frontend without endpoints (kube-proxy's REJECT).
const REJECT: i32 = i32::MIN + 4;

/// `A_FLOW` with the packet's tuple filled in, `AN_ICMP_ERROR`, or the verdict on a packet
/// that has no tuple for us (not ours, a later fragment).
#[inline(always)]
fn inspect<F: Family>(ctx: &TcContext, tuple: &mut MaybeUninit<Tuple>) -> i32 {
    if not_ours::<F>(ctx) {
        return PASS;
    }
    let Some(h) = headers::<F>(ctx) else {
        // Shorter than Ethernet + IP + ports: only a datagram's last fragment may be.
        return match ctx.load::<F::Ip>(IP_OFF).map(WordAligned) {
            Ok(ip) if F::l4_proto(&ip.0).is_some() && F::fragment(&ip.0) == Fragment::Later => {
                later_fragment::<F>(ctx, &ip.0).unwrap_or(PASS)
            }
            _ => PASS,
        };
    };
    let ip = &h.ip;
    let Some(proto) = F::l4_proto(ip) else {
        // IPv4 options, IPv6 extension headers: the ports are not where we look.
        count(counter::TC_PASSED_UNSUPPORTED);
        return PASS;
    };
    if proto == F::ICMP_PROTO {
        return AN_ICMP_ERROR;
    }
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_SCTP {
        return PASS;
    }
    let fragment = F::fragment(ip);
    if fragment == Fragment::Later {
        // A copy of the header: the packet is written while it is read.
        let ip = WordAligned(*ip);
        return later_fragment::<F>(ctx, &ip.0).unwrap_or(PASS);
    }
    if fragment != Fragment::Whole && proto == IPPROTO_SCTP {
        // SCTP splits its own chunks to the path MTU; the CRC of a datagram in IP fragments
        // covers bytes this packet does not have.
        count(counter::TC_PASSED_UNSUPPORTED);
        return PASS;
    }
    let t = Tuple {
        saddr: F::src(ip),
        daddr: F::dst(ip),
        // SAFETY: fields of the packet.
        sport: unsafe { read_word(h.ports[0].as_ptr()) },
        dport: unsafe { read_word(h.ports[1].as_ptr()) },
        proto,
        first_fragment: match fragment {
            Fragment::First(id) => u32::from(id),
            _ => NOT_A_FIRST_FRAGMENT,
        },
        l4_len: F::l4_len(ip),
    };
    tuple.write(t);
    A_FLOW
}

/// A packet of a flow in conntrack: translated as its entry says (`NO_FLOW`: no live entry),
/// the entry taken from this CPU's flow cache where it serves, else from the table.
#[inline(always)]
fn known_flow<F: Family>(ctx: &TcContext, t: &Tuple, tcp_flags: u8, ingress: bool) -> i32 {
    let Ok(s) = scratch() else { return NO_FLOW };
    // The key and the entry's copy live in the scratch area: this stage's frame is on the
    // longest chains of calls (confirm, stale).
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let key = unsafe {
        let key = FlowScratch::flow_key::<F::FlowAddr>(s);
        CtKey::write_words(key, &t.saddr, &t.daddr, t.sport, t.dport, t.proto);
        &*key
    };
    // The generation is read before the table's lookup (`flow_cache::generation`), and kept in
    // the scratch area for the fill: on the stack it would lengthen the chains of calls through
    // this stage.
    let generation = flow_cache::generation();
    // SAFETY: the per-CPU scratch value.
    let now = unsafe {
        (*s).generation = generation;
        now_by_tick(&raw mut (*s).clock)
    };
    let straight_out = ingress && KPR_FORWARD_DIRECT.load() != 0;
    // SAFETY: the per-CPU scratch value (the slot a fill may take kept there, as the generation).
    let cached = unsafe {
        (*s).cache_slot.index = flow_cache::NO_SLOT;
        if cacheable(t, tcp_flags) {
            flow_cache::probe(key, generation, now, straight_out, &mut (*s).cache_slot)
        } else {
            None
        }
    };
    // The entry, and how the packet is sent on (`redirect_by`, `forward_direct`).
    let (entry, route) = match cached {
        Some(entry) => (entry, if straight_out { ROUTE_CACHED } else { ROUTE_LOOK_UP }),
        None => match table_flow::<F>(ctx, t, key, tcp_flags, ingress, straight_out, now, s) {
            Ok(found) => found,
            Err(verdict) => return verdict,
        },
    };
    if rewrite::<F>(ctx, t, entry).is_err() {
        return PASS;
    }
    count(counter::TC_CT_HIT);
    if route == ROUTE_CACHED
        && let Some(verdict) = redirect_by::<F>(ctx, &entry.route, s)
    {
        return verdict;
    }
    // SAFETY: the per-CPU scratch value; `forward_direct`, next, takes it back.
    unsafe { (*s).route = route };
    TC_ACT_OK
}

/// `known_flow` in the conntrack table: the flow's entry (copied to `s.entry`, put in the flow
/// cache when it may serve there) and how to route the packet, or the verdict on a packet that
/// found no live flow (`NO_FLOW`) or started a flow anew.
#[inline(always)]
fn table_flow<'a, F: Family>(
    ctx: &TcContext,
    t: &Tuple,
    key: &CtKey<F::FlowAddr>,
    tcp_flags: u8,
    ingress: bool,
    straight_out: bool,
    now: u64,
    s: *mut FlowScratch,
) -> Result<(&'a CtValue, u32), i32> {
    let (established, new_flows) = (F::FlowAddr::established(), F::FlowAddr::new_flows());
    // Established flows first; a flow not yet answered lives apart (`CT_NEW*`), so that a flood
    // of new flows (SYNs, spoofed segments) evicts only its own kind.
    let (entry_ptr, confirmed) = match established.get_ptr_mut(key) {
        Some(entry_ptr) => (entry_ptr, true),
        None => match new_flows.get_ptr_mut(key) {
            Some(entry_ptr) => (entry_ptr, false),
            None => return Err(NO_FLOW),
        },
    };
    // SAFETY: map value and scratch pointers, valid for this program run; the copy is read
    // while the map's entry is written.
    let entry = unsafe {
        // Not an assignment: the compiler cannot tell the two apart and would call memmove.
        core::ptr::copy_nonoverlapping(entry_ptr, &raw mut (*s).entry, 1);
        &(*s).entry
    };
    let syn = tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    // Replies keep their route from the first answer on (TCP's waits for the client's ACK
    // among the new flows, and moves with the entry when it comes).
    let mut route = route_hint(ingress && (confirmed || entry.flags & ct::REPLY != 0), &entry.route, now);
    if expired(t.proto, entry, now) {
        count(counter::TC_CT_EXPIRED);
        forget(key, entry, t.proto);
        return Err(NO_FLOW);
    }
    if ingress && syn && (ct::closed(entry.flags) || stale(ctx, t, entry)) {
        // A new connection reusing the 5-tuple of a closed flow, or of one whose endpoint
        // is gone: balanced anew (conntrack does the same for a SYN after TIME_WAIT). When
        // the new pick is the old flow's translation, as it is while the service is
        // unchanged (the pick is a hash of the tuple), the closed flow's entries start
        // over in place: no forget, no inserts, and none again at the answer.
        if confirmed && ct::closed(entry.flags) && reopen::<F>(ctx, t, entry_ptr, now) {
            if rewrite::<F>(ctx, t, entry).is_err() {
                return Err(PASS);
            }
            count(counter::TC_NEW_FLOW);
            // SAFETY: the per-CPU scratch value; `forward_direct`, next, takes it back.
            unsafe { (*s).route = route };
            return Err(TC_ACT_OK);
        }
        forget(key, entry, t.proto);
        return Err(NO_FLOW);
    }
    let seen = seen_bits(t.proto, entry, tcp_flags);
    if confirmed {
        touch(established, key, entry_ptr, entry, seen, now);
    } else if seen & ESTABLISHES != 0 {
        confirm(key, entry, seen, now);
        // The answer's route, looked up and kept in its entry, now established, for the
        // flow's next replies.
        route = route_hint(ingress, &entry.route, now);
    } else {
        touch(new_flows, key, entry_ptr, entry, seen, now);
    }
    // The entry as it stays until its refresh is due, for the flow's next packets, if `probe`
    // left its slot free: a packet to be sent straight out needs the kept route.
    // SAFETY: the per-CPU scratch value.
    let (slot, generation) = unsafe { ((*s).cache_slot, (*s).generation) };
    if slot.index != flow_cache::NO_SLOT
        && confirmed
        && entry.flags | seen == entry.flags
        && !ct::closed(entry.flags)
        && (route == ROUTE_CACHED || !straight_out)
    {
        let mut valid_until = entry.last_seen.saturating_add(ct::REFRESH_NS.min(lifetime(t.proto, entry.flags)));
        if route == ROUTE_CACHED {
            valid_until = valid_until.min(u64::from(entry.route.period + 1) << ct::ROUTE_PERIOD_SHIFT);
        }
        if flow_cache::fill(slot, key, entry, generation, now, valid_until, route == ROUTE_CACHED) {
            count(counter::TC_FLOW_CACHE_FILLED);
        }
    }
    Ok((entry, route))
}

/// May this packet be served by the flow cache? One that changes nothing in its flow's entry
/// (no SYN, FIN or RST; not a fragment, which must be remembered for its later ones).
#[inline(always)]
fn cacheable(t: &Tuple, tcp_flags: u8) -> bool {
    t.first_fragment == NOT_A_FIRST_FRAGMENT && tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) == 0
}

/// Send a translated packet of an established flow out by the route its entry keeps
/// (`cached`), here rather than in `forward_direct`: most packets of a flow go this way, and
/// the stage's call, scratch lookup and bounds checks are saved on each. None: the packet is
/// `forward_direct`'s (its TTL runs out, or it is too big for the link: the stack decides).
#[inline(always)]
fn redirect_by<F: Family>(ctx: &TcContext, cached: &CachedRoute, s: *mut FlowScratch) -> Option<i32> {
    let data = ctx.data();
    if data + IP_OFF + size_of::<F::Ip>() > ctx.data_end() {
        return None;
    }
    // SAFETY: within [data, data_end), checked above.
    let ip = unsafe { &*((data + IP_OFF) as *const F::Ip) };
    if F::hops(ip) <= 1 || !fits_link(ctx, cached.mtu) {
        return None;
    }
    // SAFETY: within [data, data_end), checked above; the scratch value.
    unsafe {
        F::decrement_hops((data + IP_OFF) as *mut u8);
        if cached.peer != 0 {
            write_macs(data as *mut u8, &cached.next_hop);
            let verdict = bpf_redirect_peer(cached.ifindex, 0) as i32;
            count(counter::TC_FORWARDED_DIRECT);
            count(counter::TC_REDIRECTED_PEER);
            return Some(verdict);
        }
        count(counter::TC_FORWARDED_DIRECT);
        // The next hop in the scratch area: on the stack it would lengthen the chains of calls
        // through this stage.
        let nh = &raw mut (*s).next_hop;
        *nh = bpf_redir_neigh {
            nh_family: u32::from(cached.family),
            __bindgen_anon_1: bpf_redir_neigh__bindgen_ty_1 { ipv6_nh: cached.next_hop },
        };
        Some(bpf_redirect_neigh(cached.ifindex, nh, size_of::<bpf_redir_neigh>() as i32, 0) as i32)
    }
}

/// How to route a packet of an established flow (`cacheable`: on its way in) sent straight
/// out: by the route its entry keeps if that was looked up in this period, else looked up and
/// kept (6.3+: the kept next hop needs `BPF_FIB_LOOKUP_SKIP_NEIGH`'s answer).
#[inline(always)]
fn route_hint(cacheable: bool, kept: &CachedRoute, now: u64) -> u32 {
    if !cacheable || KPR_FORWARD_DIRECT.load() == 0 || KPR_REDIRECT_NEXT_HOP.load() == 0 {
        ROUTE_LOOK_UP
    } else if kept.ifindex != 0 && kept.period == route_period(now) {
        ROUTE_CACHED
    } else {
        ROUTE_LOOK_UP_AND_CACHE
    }
}

#[inline(always)]
fn route_period(now: u64) -> u32 {
    (now >> ct::ROUTE_PERIOD_SHIFT) as u32
}

/// A packet of no flow kpr knows: a new flow to a frontend, or not ours.
#[inline(never)]
fn unknown_flow<F: Family>(ctx: &TcContext, t: &Tuple, tcp_flags: u8, ingress: bool) -> i32 {
    pick::<F>(ctx, t, tcp_flags, ingress).unwrap_or(PASS)
}

#[inline(always)]
fn pick<F: Family>(ctx: &TcContext, t: &Tuple, tcp_flags: u8, ingress: bool) -> Result<i32, ()> {
    let key = CtKey::new(t.saddr, t.daddr, t.sport, t.dport, t.proto);
    // A flow kube-proxy translated before kpr took the node over: netfilter's conntrack goes
    // on translating it. A new connection on its tuple is kpr's.
    if handed_over(&key) {
        if !(ingress && tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN) {
            return Ok(PASS);
        }
        let _ = HANDOVER.remove(&key);
    }
    if !ingress {
        return Ok(egress_drop(ctx, t));
    }
    if !reverse_path_ok::<F>(ctx, t) {
        count(counter::TC_DROPPED);
        return Ok(TC_ACT_SHOT);
    }
    let scope = source_scope(ctx, t);
    let service = match lookup_frontend(t, scope) {
        Some(service) => service,
        // A refused service range: a ClusterIP's unknown port is rejected, an unallocated address of
        // the service range dropped.
        None => match service_range_miss(t.daddr) {
            ServiceRangeMiss::NotInRange => return Ok(PASS),
            ServiceRangeMiss::Reject => refusal(0),
            ServiceRangeMiss::Drop => {
                count(counter::TC_DROPPED);
                return Ok(TC_ACT_SHOT);
            }
        },
    };
    start_flow(t, &service, now())
}

/// The kernel's reverse path filter (IPv4 `rp_filter`), on a new flow's first packet where
/// its link has it (`LINK_FLAG_RP_FILTER_*`): kpr translates the packet (and may masquerade it
/// or send it straight out) before the kernel's routing would check its source, so a pod
/// could otherwise send as another pod through a Service. Strict: the route back to the
/// source leaves by this link; loose: there is a route back. A packet of an established flow
/// is not checked again (its tuple is that of a flow whose first packet was).
#[inline(never)]
fn reverse_path_ok<F: Family>(ctx: &TcContext, t: &Tuple) -> bool {
    if !F::KERNEL_CHECKS_SOURCE {
        return true;
    }
    let ifindex = ifindex(ctx);
    // SAFETY: a map value pointer, read at once.
    let mode = LINKS.get_ptr(&ifindex).map_or(0, |link| unsafe { (*link).flags })
        & (LINK_FLAG_RP_FILTER_STRICT | LINK_FLAG_RP_FILTER_LOOSE);
    if mode == 0 {
        return true;
    }
    let Ok(s) = scratch() else { return true };
    // SAFETY: the per-CPU scratch value, valid for this program run (a new flow's masquerade
    // lookup, later, zeroes it again).
    let params = unsafe {
        zero_fib(&raw mut (*s).fib);
        &mut (*s).fib
    };
    params.family = F::AF;
    params.ifindex = ifindex;
    F::fib_dst(params, &t.saddr);
    let rc = unsafe { fib_lookup(ctx.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, 0) };
    if rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) || rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        return mode & LINK_FLAG_RP_FILTER_LOOSE != 0 || params.ifindex == ifindex;
    }
    // No route back (unreachable, blackhole, prohibit) fails either mode; a local source is the
    // martian check's, forwarding turned off the kernel's own.
    !(rc == i64::from(BPF_FIB_LKUP_RET_BLACKHOLE)
        || rc == i64::from(BPF_FIB_LKUP_RET_UNREACHABLE)
        || rc == i64::from(BPF_FIB_LKUP_RET_PROHIBIT))
}

/// The TCP flags byte: read straight from the packet when the header is in the linear area
/// (nearly always), else through the load helper.
#[inline(always)]
fn tcp_flags<F: Family>(ctx: &TcContext) -> u8 {
    let at = ctx.data() + F::L4_OFF + TCP_FLAGS;
    if at < ctx.data_end() {
        // SAFETY: bounds checked against data_end.
        return unsafe { *(at as *const u8) };
    }
    ctx.load::<u8>(F::L4_OFF + TCP_FLAGS).unwrap_or(0)
}

/// An SCTP packet's first chunk as the TCP flags with the same meaning for the flow's state:
/// INIT is a SYN, INIT ACK a SYN-ACK, SHUTDOWN and SHUTDOWN ACK are FINs, ABORT a RST.
#[inline(always)]
fn sctp_as_tcp_flags<F: Family>(ctx: &TcContext) -> u8 {
    match ctx.load::<u8>(F::L4_OFF + SCTP_CHUNK_TYPE).unwrap_or(0) {
        1 => TCP_SYN,
        2 => TCP_SYN | TCP_ACK,
        6 => TCP_RST | TCP_ACK,
        7 | 8 => TCP_FIN | TCP_ACK,
        _ => TCP_ACK,
    }
}

/// [`seen_bits`]: this packet establishes its flow (TCP: the client's ACK of the backend's
/// answer, SYN_RECV → ESTABLISHED; else the backend's answer). Never stored in an entry.
const ESTABLISHES: u32 = 1 << 31;

/// What this packet tells of its flow: an answer from the backend (TCP's first one: awaiting
/// the client's ACK), the client's ACK of it, a FIN, a RST; and whether it `ESTABLISHES` it.
#[inline(always)]
fn seen_bits(proto: u8, entry: &CtValue, tcp_flags: u8) -> u32 {
    let reply = entry.flags & ct::REPLY != 0;
    let mut bits = if reply { ct::SEEN_REPLY } else { 0 };
    if proto == IPPROTO_TCP {
        if reply && entry.flags & ct::SEEN_REPLY == 0 {
            bits |= ct::AWAITING_ACK;
        } else if !reply && entry.flags & ct::AWAITING_ACK != 0 && tcp_flags & (TCP_ACK | TCP_RST) == TCP_ACK {
            bits |= ESTABLISHES;
        }
    } else if reply && tcp_flags & TCP_RST == 0 {
        bits |= ESTABLISHES;
    }
    if tcp_flags & TCP_FIN != 0 {
        bits |= if reply { ct::FIN_REPLY } else { ct::FIN_ORIG };
    }
    if tcp_flags & TCP_RST != 0 {
        bits |= ct::RST;
    }
    bits
}

/// Record a packet of a live flow: new state bits at once (`AWAITING_ACK` cleared by the
/// packet that `ESTABLISHES` it), the time at most every `REFRESH_NS`; both entries of the
/// flow, putting back the other one if it was evicted.
#[inline(always)]
fn touch<A: FlowTables>(
    map: &FlowMap<CtKey<A>>,
    key: &CtKey<A>,
    entry_ptr: *mut CtValue,
    entry: &CtValue,
    seen: u32,
    now: u64,
) {
    let cleared = if seen & ESTABLISHES != 0 { ct::AWAITING_ACK | ESTABLISHES } else { 0 };
    let flags = (entry.flags | seen) & !cleared;
    if flags == entry.flags && now.saturating_sub(entry.last_seen) < ct::REFRESH_NS {
        return;
    }
    // SAFETY: a map value pointer, valid for this program run; racing writers only ever
    // move the time forward or add bits.
    unsafe {
        (*entry_ptr).flags = flags;
        (*entry_ptr).last_seen = now;
    }
    let pair_key = entry.pair_key::<A>(key.proto);
    match map.get_ptr_mut(&pair_key) {
        Some(pair) => unsafe {
            (*pair).flags = ((*pair).flags | (flags & ct::FLOW_BITS)) & !cleared;
            (*pair).last_seen = now;
        },
        None => heal(map, key, entry, flags, now),
    }
}

/// Put back the evicted other entry of a flow.
#[inline(never)]
fn heal<A: FlowTables>(map: &FlowMap<CtKey<A>>, key: &CtKey<A>, entry: &CtValue, flags: u32, now: u64) {
    let Ok(s) = scratch() else { return };
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let (pair_key, value) = unsafe {
        let pair_key = FlowScratch::reply_key::<A>(s);
        *pair_key = entry.pair_key(key.proto);
        (*s).reply = mirror(key, entry, flags, now);
        (&*pair_key, &(*s).reply)
    };
    if map.insert(pair_key, value, u64::from(BPF_NOEXIST)).is_ok() {
        count(counter::TC_CT_HEALED);
    }
}

/// The other entry of the flow whose entry `key` → `entry` is: its value is this key, mirrored.
#[inline(always)]
fn mirror<A: FlowAddr>(key: &CtKey<A>, entry: &CtValue, flags: u32, now: u64) -> CtValue {
    CtValue {
        src_addr: key.dst_addr.addr(),
        dst_addr: key.src_addr.addr(),
        src_port: key.dst_port,
        dst_port: key.src_port,
        service_id: entry.service_id,
        last_seen: now,
        flags: (flags & ct::FLOW_BITS) | (!entry.flags & ct::REPLY),
        // The entry's translation undone: its difference negated.
        addrs_csum_diff: !entry.addrs_csum_diff,
        route: CachedRoute::NONE,
    }
}

/// A new flow is established (TCP: the client acknowledged the backend's answer; else the
/// backend answered): both its entries move to the established table.
#[inline(never)]
fn confirm<A: FlowTables>(key: &CtKey<A>, entry: &CtValue, seen: u32, now: u64) {
    let Ok(s) = scratch() else { return };
    let flags = (entry.flags | seen) & !(ct::AWAITING_ACK | ESTABLISHES);
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let (pair_key, value) = unsafe {
        let pair_key = FlowScratch::reply_key::<A>(s);
        *pair_key = entry.pair_key(key.proto);
        (*s).forward = CtValue { flags, last_seen: now, ..*entry };
        (*s).reply = mirror(key, entry, flags, now);
        // The other entry's kept route (its first packet's: `program_flow`, `keep_route`)
        // goes with it.
        if let Some(pair) = A::new_flows().get_ptr(&*pair_key)
            && (*pair).same_translation(&(*s).reply)
        {
            // Not an assignment, which would be a call of memmove.
            core::ptr::copy_nonoverlapping(&raw const (*pair).route, &raw mut (*s).reply.route, 1);
        }
        (&*pair_key, &(*s).forward)
    };
    let _ = A::established().insert(key, value, 0);
    let _ = A::established().insert(pair_key, unsafe { &(*s).reply }, 0);
    let _ = A::new_flows().remove(pair_key);
    let _ = A::new_flows().remove(key);
}

/// Remove both entries of a flow. The other entry's key is built in the scratch area's `key`
/// (free wherever a flow is forgotten): on the stack it would put the longest chain of calls
/// (a new flow's SNAT port search) past the BPF stack of older kernels.
#[inline(never)]
fn forget<A: FlowTables>(key: &CtKey<A>, entry: &CtValue, proto: u8) {
    let Ok(s) = scratch() else { return };
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let pair_key = unsafe {
        let pair_key = FlowScratch::key::<A>(s);
        *pair_key = entry.pair_key(proto);
        &*pair_key
    };
    for map in [A::established(), A::new_flows()] {
        let _ = map.remove(pair_key);
        let _ = map.remove(key);
    }
    flow_cache::forgotten();
}

/// The flow entry under `key`, established or new, in place (no copy on the BPF stack).
#[inline(always)]
fn flow_entry<'a, A: FlowTables>(key: &CtKey<A>) -> Option<&'a CtValue> {
    // SAFETY: map value pointers are valid for this program run.
    A::established().get_ptr(key).or_else(|| A::new_flows().get_ptr(key)).map(|v| unsafe { &*v })
}

/// Per-CPU room for the conntrack keys and values a packet writes: on the BPF stack they would
/// not fit beside the rest of the path (512 bytes for a chain of calls).
#[repr(C)]
pub struct FlowScratch {
    /// A packet's conntrack key, and a copy of its entry. First: the key is written in 8-byte
    /// words, 8-byte aligned, and here it lies within one cache line.
    flow_key: KeySlot,
    entry: CtValue,
    key: KeySlot,
    reply_key: KeySlot,
    forward: CtValue,
    reply: CtValue,
    icmp: IcmpFix,
    /// A new flow's service entry and backend.
    service: ServiceValue,
    backend: Backend,
    /// Its reply entry's [`CtValue::addrs_csum_diff`] while the client is not masqueraded.
    reply_csum_diff: u32,
    /// The route lookup of a masquerade address, and then `forward_direct`'s.
    fib: bpf_fib_lookup,
    /// 1: `fib`'s link is a peer one, and `fib` holds its MAC addresses (`peer_route`).
    fib_peer: u32,
    /// `known_flow` → `forward_direct`: how to route the packet of an established flow (`ROUTE_*`).
    route: u32,
    /// `redirect_by`: the kept next hop, as `bpf_redirect_neigh` takes it.
    next_hop: bpf_redir_neigh,
    /// The time at this CPU's last tick (`now_by_tick`).
    clock: TickClock,
    /// `known_flow`: the conntrack generation read before its lookup, and the flow cache's slot
    /// its entry may be put in (`flow_cache::probe`, `flow_cache::fill`).
    generation: flow_cache::Generation,
    cache_slot: flow_cache::FreeSlot,
}

/// Room for a conntrack key of either family's tables, 8-byte aligned ([`CtKey::write_words`]).
#[repr(C, align(8))]
union KeySlot {
    v4: CtKey<Addr4>,
    v6: CtKey,
}

impl FlowScratch {
    // The key slots as keys of the tables of addresses `A` (the union's fields start at its
    // start). SAFETY of each: `s` is the per-CPU scratch value.
    #[inline(always)]
    unsafe fn key<A: FlowTables>(s: *mut Self) -> *mut CtKey<A> {
        unsafe { (&raw mut (*s).key).cast() }
    }
    #[inline(always)]
    unsafe fn reply_key<A: FlowTables>(s: *mut Self) -> *mut CtKey<A> {
        unsafe { (&raw mut (*s).reply_key).cast() }
    }
    #[inline(always)]
    unsafe fn flow_key<A: FlowTables>(s: *mut Self) -> *mut CtKey<A> {
        unsafe { (&raw mut (*s).flow_key).cast() }
    }
}

/// Look the route up (a packet of a new flow or of one not yet answered).
const ROUTE_LOOK_UP: u32 = 0;
/// The route kept in the flow's entry (`CtValue::route`) serves: `known_flow` sends the packet
/// out by it (`redirect_by`); a packet it could not send is looked up.
const ROUTE_CACHED: u32 = 1;
/// Look the route up and keep it in the flow's entry (under `s.flow_key`).
const ROUTE_LOOK_UP_AND_CACHE: u32 = 2;
/// `s.fib` holds this packet's route: looked up for a new flow's masquerade address as
/// `forward_direct` would have (6.3+), it sends the packet by that answer.
const ROUTE_LOOKED_UP: u32 = 3;
/// A new flow's first packet on its way in: a masquerade lookup may keep its answer for it
/// (`ROUTE_LOOKED_UP`); else `forward_direct` looks it up and keeps the answer in the new
/// flow's entry (`keep_route`).
const ROUTE_MAY_KEEP: u32 = 4;

/// How an ICMP error about a translated flow is translated back.
#[repr(C)]
struct IcmpFix {
    client: Addr,
    frontend: Addr,
    /// The outer source: the frontend when the backend complained, else unchanged.
    new_src: Addr,
    /// Checksum differences of the quoted and the outer addresses.
    inner_diff: u64,
    outer_diff: u64,
    /// The quoted ports, before and after.
    old_ports: u32,
    new_ports: u32,
}

#[btf_map(name = "KPR_FLOW_SCRATCH")]
static SCRATCH: PerCpuArray<FlowScratch, 1> = PerCpuArray::new();

#[inline(always)]
fn scratch() -> Result<*mut FlowScratch, ()> {
    SCRATCH.get_ptr_mut(0).ok_or(())
}

/// A TCP connection of the node itself that kube-proxy would DROP (traffic policy Local
/// without a local endpoint, a source outside loadBalancerSourceRanges): the socket path lets
/// it through untranslated and it is dropped here, on its way out, so that `connect()` times
/// out as it does behind kube-proxy's filter rules.
#[inline(never)]
fn egress_drop(ctx: &TcContext, t: &Tuple) -> i32 {
    if t.proto != IPPROTO_TCP || source_scope(ctx, t) != SCOPE_NODE {
        return PASS;
    }
    let drop = match lookup_frontend(t, SCOPE_NODE) {
        Some(s) => s.backends_count == 0 && s.flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0,
        None => service_range_miss(t.daddr) == ServiceRangeMiss::Drop,
    };
    if drop {
        count(counter::TC_DROPPED);
        return TC_ACT_SHOT;
    }
    PASS
}

/// Where a packet comes from, as kube-proxy tells sources apart: the node itself (a local
/// source address), a pod the local-traffic detector calls local, or anywhere else.
#[inline(always)]
fn source_scope(ctx: &TcContext, t: &Tuple) -> u8 {
    if node_addr_flags(&t.saddr) & NODE_ADDR_LOCAL != 0 {
        return SCOPE_NODE;
    }
    let local = match KPR_DETECT_LOCAL.load() {
        DETECT_LOCAL_CIDR => LOCAL_CIDRS.get(&Key::new(128, CidrKey { addr: t.saddr })).is_some(),
        DETECT_LOCAL_INTERFACE => {
            let ifindex = ifindex(ctx);
            LINKS.get_ptr(&ifindex).is_some_and(|link| unsafe { (*link).flags } & LINK_FLAG_LOCAL_TRAFFIC != 0)
        }
        _ => false,
    };
    if local { SCOPE_POD } else { SCOPE_EXTERNAL }
}

/// The frontend entry a packet from `scope` is addressed to: a ClusterIP, externalIP or
/// LoadBalancer IP, or a NodePort on one of the node's NodePort addresses.
#[inline(always)]
fn lookup_frontend(t: &Tuple, scope: u8) -> Option<ServiceValue> {
    let key = ServiceKey { addr: t.daddr, port: t.dport, proto: t.proto, scope };
    if let Some(v) = SERVICES.get_ptr(&key) {
        return Some(unsafe { *v });
    }
    if node_addr_flags(&key.addr) & NODE_ADDR_NODEPORT != 0 {
        return SERVICES.get_ptr(&ServiceKey { addr: key.addr.unspecified_like(), ..key }).map(|v| unsafe { *v });
    }
    None
}

/// The link the program runs on.
#[inline(always)]
fn ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: a tc program's context is the packet's __sk_buff.
    unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ifindex }
}

/// The address MASQUERADE would give a packet to `backend`: the first address of the link the
/// route to it leaves by, else the node's primary address of the family; `None` where the
/// packet is not masqueraded at all (`backend` is one of the node's own addresses).
/// The lookup's parameters live in the scratch area: on the stack they would put a new flow's
/// longest chain of calls past the BPF stack of older kernels.
///
/// For a new flow's first packet on its way in (`ROUTE_MAY_KEEP`), to be sent straight out
/// (6.3+: the lookup's next hop serves `bpf_redirect_neigh`), the lookup is the one
/// `forward_direct` makes (the packet's protocol, TOS and source, as the kernel routes a
/// forwarded packet: after its DNAT, before its masquerade), and its answer is kept for it
/// (`ROUTE_LOOKED_UP`): one route lookup for that packet, not two.
#[inline(never)]
fn masquerade_source<F: Family>(ctx: &TcContext, t: &Tuple, backend: &Addr) -> Option<Addr> {
    let s = scratch().ok()?;
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let params = unsafe {
        zero_fib(&raw mut (*s).fib);
        (*s).fib_peer = 0;
        &mut (*s).fib
    };
    params.family = F::AF;
    params.ifindex = ifindex(ctx);
    // Whether the answer may be kept is told by `s.route` alone, here and after the lookup:
    // a flag held across the helper's call would be spilled, and this frame is on the longest
    // chain of calls (`reopen`'s).
    let data = ctx.data();
    // SAFETY (here and below): the per-CPU scratch value.
    if unsafe { (*s).route } == ROUTE_MAY_KEEP {
        if KPR_FORWARD_DIRECT.load() != 0
            && KPR_REDIRECT_NEXT_HOP.load() != 0
            && data + IP_OFF + size_of::<F::Ip>() <= ctx.data_end()
        {
            // The tuple's source, not the header's: the header's is a copy (a call on the
            // BPF stack, for an IPv6 address read unaligned from the packet).
            params.l4_protocol = t.proto;
            // SAFETY: within [data, data_end), checked above.
            F::fib_tos(params, unsafe { &*((data + IP_OFF) as *const F::Ip) });
            F::fib_src(params, &t.saddr);
        } else {
            unsafe { (*s).route = ROUTE_LOOK_UP };
        }
    }
    F::fib_dst(params, backend);
    let flags = if unsafe { (*s).route } == ROUTE_MAY_KEEP { BPF_FIB_LOOKUP_SKIP_NEIGH } else { 0 };
    let rc = unsafe { fib_lookup(ctx.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, flags) };
    if rc == i64::from(BPF_FIB_LKUP_RET_NOT_FWDED) {
        // Delivered locally (a host-network endpoint of this node): never masqueraded, as a
        // DNATed packet that goes to INPUT never meets kube-proxy's MASQUERADE in
        // POSTROUTING. The endpoint answers the client itself, through the egress program.
        return None;
    }
    if (rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) || rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH))
        && let Some(addr) = link(params.ifindex).and_then(|l| F::masquerade_addr(&l))
    {
        if rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) && unsafe { (*s).route } == ROUTE_MAY_KEEP {
            // `translate` takes it back if the packet does not go on to `forward_direct`.
            unsafe { (*s).route = ROUTE_LOOKED_UP };
        }
        return Some(addr);
    }
    link(0).and_then(|l| F::masquerade_addr(&l))
}

/// Zero a route lookup's parameters word by word: `mem::zeroed` compiles to a call of
/// `memset`, a subprogram, which costs a call on the packets that look their route up and a
/// frame of 32 bytes on 6.1's BPF stack (its verifier rounds an empty frame up).
#[inline(always)]
fn zero_fib(params: *mut bpf_fib_lookup) {
    // The struct's alignment is 4: wider stores to the stack would be refused as misaligned.
    const WORDS: usize = size_of::<bpf_fib_lookup>() / 4;
    let words = params.cast::<u32>();
    for i in 0..WORDS {
        // SAFETY: within the 64 bytes of `params`, 4-aligned. Volatile: plain stores would be
        // turned back into a `memset` call.
        unsafe { words.add(i).write_volatile(0) };
    }
}

/// Send a packet translated on its way in straight out of the link its route leaves by
/// (`bpf_fib_lookup`, then `bpf_redirect_neigh`, which fills in the MAC addresses), as Cilium
/// does: the host's forwarding path (netfilter's FORWARD policy, INVALID-state drops) never
/// sees it. What the route does not settle that way (a local destination, no route, forwarding
/// off, too big for the link, a TTL or hop limit running out) goes on into the host stack,
/// which handles it as it would have without kpr.
///
/// An established flow's entry keeps the lookup's answer (6.3+, with the next hop): for about
/// a second, its packets that fit the link are sent out by `known_flow` without it.
#[inline(never)]
fn forward_direct<F: Family>(ctx: &TcContext) -> i32 {
    let Ok(s) = scratch() else { return TC_ACT_OK };
    // SAFETY: the per-CPU scratch value, valid for this program run; the hint is taken back
    // so that no later packet sees it.
    let route = unsafe { core::mem::replace(&mut (*s).route, ROUTE_LOOK_UP) };
    // Something filters forwarded packets (a NetworkPolicy in the FORWARD chain): the host's
    // forwarding path, as for kube-proxy's traffic. An established flow's kept route stops
    // serving at the end of its period, when its next packet comes here.
    if !host_lets_direct() {
        return TC_ACT_OK;
    }
    let data = ctx.data();
    if data + IP_OFF + size_of::<F::Ip>() > ctx.data_end() {
        return TC_ACT_OK;
    }
    // SAFETY: within [data, data_end), checked above; read in place (a copy would be a load
    // and a store per byte).
    let ip = unsafe { &*((data + IP_OFF) as *const F::Ip) };
    if F::hops(ip) <= 1 {
        return TC_ACT_OK; // the stack answers with "time exceeded"
    }
    // In the scratch area (free here: a new flow's masquerade lookup is done), not on the
    // stack: this stage is inlined into the attached programs, whose frame bounds the chains
    // of calls through them.
    // SAFETY: the per-CPU scratch value, every byte written (or kept: `ROUTE_LOOKED_UP`).
    let params = unsafe { &mut (*s).fib };
    let next_hop = KPR_REDIRECT_NEXT_HOP.load() != 0;
    if route != ROUTE_LOOKED_UP {
        zero_fib(params);
        // SAFETY: the per-CPU scratch value.
        unsafe { (*s).fib_peer = 0 };
        params.family = F::AF;
        params.ifindex = ifindex(ctx);
        F::fib_params(params, ip);
        let flags = if next_hop { BPF_FIB_LOOKUP_SKIP_NEIGH } else { 0 };
        // tot_len 0: the kernel checks the packet against the MTU of the link found (GSO aware).
        let rc = unsafe { fib_lookup(ctx.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, flags) };
        if rc != i64::from(BPF_FIB_LKUP_RET_SUCCESS) && rc != i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
            return TC_ACT_OK;
        }
        if rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
            // SAFETY: the per-CPU scratch value.
            unsafe { (*s).fib_peer = u32::from(peer_route::<F>(ctx, params)) };
            keep_route::<F::FlowAddr>(s, route, next_hop, params);
        }
    } else if peer_route::<F>(ctx, params) {
        // The masquerade lookup's answer, which `program_flow` kept in the new flow's entry as
        // a next hop (here, off the chains of calls through the masquerade lookup): a peer
        // link's MAC addresses take its place.
        // SAFETY: the per-CPU scratch value.
        unsafe { (*s).fib_peer = 1 };
        keep_route::<F::FlowAddr>(s, ROUTE_MAY_KEEP, next_hop, params);
    }
    // Forwarding takes one off the TTL; the lookup did not move the packet, but the bounds are
    // checked again for the verifier.
    let data = ctx.data();
    if data + IP_OFF + size_of::<F::Ip>() > ctx.data_end() {
        return TC_ACT_OK;
    }
    // SAFETY: within [data, data_end), checked above.
    unsafe { F::decrement_hops((data + IP_OFF) as *mut u8) };
    count(counter::TC_FORWARDED_DIRECT);
    // SAFETY: the per-CPU scratch value.
    if unsafe { (*s).fib_peer } != 0 {
        let eth = data as *mut u8;
        // SAFETY: the lookup's answer (the MAC addresses' member of its union); the Ethernet
        // header, within [data, data_end) (checked above).
        unsafe {
            let found = &params.__bindgen_anon_6.__bindgen_anon_2;
            for i in 0..6 {
                eth.add(i).write(found.dmac[i]);
                eth.add(6 + i).write(found.smac[i]);
            }
        }
        count(counter::TC_REDIRECTED_PEER);
        return unsafe { bpf_redirect_peer(params.ifindex, 0) as i32 };
    }
    if next_hop {
        // The lookup's next hop: the gateway, else the destination (its family may differ from
        // the packet's: an IPv4 route via an IPv6 gateway).
        let mut nh = bpf_redir_neigh {
            nh_family: u32::from(params.family),
            __bindgen_anon_1: bpf_redir_neigh__bindgen_ty_1 { ipv6_nh: unsafe { params.__bindgen_anon_4.ipv6_dst } },
        };
        return unsafe { bpf_redirect_neigh(params.ifindex, &mut nh, size_of::<bpf_redir_neigh>() as i32, 0) as i32 };
    }
    // No neighbour parameters: the kernel routes the packet again and resolves the next hop.
    unsafe { bpf_redirect_neigh(params.ifindex, core::ptr::null_mut(), 0, 0) as i32 }
}

/// Would the kernel forward this packet to a link of MTU `mtu` (`is_skb_forwardable`)? GSO
/// packets are cut to size later.
#[inline(always)]
fn fits_link(ctx: &TcContext, mtu: u16) -> bool {
    // SAFETY: a tc program's context is the packet's __sk_buff.
    let skb = unsafe { &*(ctx.as_ptr() as *const __sk_buff) };
    skb.gso_size != 0 || skb.len <= u32::from(mtu) + ETH_LEN as u32
}

/// Keep a successful route lookup (with the link's MTU, which the kernel reports from 5.12 on)
/// in the entry of the flow this packet was translated by, if it still is (another CPU may
/// have replaced it since): an established flow's, or an answered one's awaiting the client's
/// ACK (`ROUTE_LOOK_UP_AND_CACHE`, under `s.flow_key`), or the new flow's this packet opened (`ROUTE_MAY_KEEP`, under `s.key`, with
/// 6.3+'s next hop; the route moves with the entry at the answer, as `program_flow`'s
/// masquerade lookup does).
#[inline(always)]
fn keep_route<A: FlowTables>(s: *mut FlowScratch, route: u32, next_hop: bool, params: &bpf_fib_lookup) {
    // SAFETY: the scratch value and map value pointers, valid for this program run.
    unsafe {
        if params.__bindgen_anon_1.mtu_result == 0 {
            return;
        }
        let (entry, translated_by) = match route {
            ROUTE_LOOK_UP_AND_CACHE => {
                let key = &*FlowScratch::flow_key::<A>(s);
                (A::established().get_ptr_mut(key).or_else(|| A::new_flows().get_ptr_mut(key)), &raw const (*s).entry)
            }
            ROUTE_MAY_KEEP if next_hop => {
                (A::new_flows().get_ptr_mut(&*FlowScratch::key::<A>(s)), &raw const (*s).forward)
            }
            _ => return,
        };
        let Some(entry) = entry else { return };
        if (*entry).same_translation(&*translated_by) {
            keep_in(&raw mut (*entry).route, params, (*s).fib_peer != 0, now());
        }
    }
}

/// Write a successful lookup's route (`BPF_FIB_LOOKUP_SKIP_NEIGH`: its next hop; a peer
/// route: its MAC addresses, as the Ethernet header has them) into `route`, a flow entry's,
/// with the link's MTU (reported from 5.12 on; NONE without it). In place, field by field: a
/// route built on the stack and copied would widen the frames of the chains of calls.
///
/// # Safety
/// `route` is writable.
#[inline(always)]
unsafe fn keep_in(route: *mut CachedRoute, params: &bpf_fib_lookup, peer: bool, now: u64) {
    // SAFETY: the lookup's answer, every byte written by the kernel or zeroed before it;
    // `route` is writable (the caller's word).
    unsafe {
        let mtu = params.__bindgen_anon_1.mtu_result;
        if mtu == 0 {
            *route = CachedRoute::NONE;
            return;
        }
        (*route).ifindex = params.ifindex;
        (*route).period = route_period(now);
        (*route).mtu = mtu;
        (*route).family = params.family;
        (*route).peer = u8::from(peer);
        if peer {
            let found = &params.__bindgen_anon_6.__bindgen_anon_2;
            let bytes = (&raw mut (*route).next_hop).cast::<u8>();
            for i in 0..6 {
                bytes.add(i).write(found.dmac[i]);
                bytes.add(6 + i).write(found.smac[i]);
            }
            (*route).next_hop[3] = 0;
        } else {
            (*route).next_hop = params.__bindgen_anon_4.ipv6_dst;
        }
    }
}

/// Write a peer route's MAC addresses (`keep_in`) over the packet's, a word at a time.
///
/// # Safety
/// `eth` is the packet's Ethernet header, writable.
#[inline(always)]
unsafe fn write_macs(eth: *mut u8, macs: &[u32; 4]) {
    unsafe {
        write_word(eth, macs[0]);
        write_word(eth.add(4), macs[1]);
        write_word(eth.add(8), macs[2]);
    }
}

/// After a successful route lookup (`params`, the scratch area's): does its link hand packets
/// to a pod's end of a veth pair (`LINK_FLAG_PEER`)? Then the packet goes to that end at once
/// (`bpf_redirect_peer`) with the MAC addresses a transmission would give it: the next hop's
/// and the link's, in `params` when this says yes. A 6.3+ lookup skips the neighbour (for the
/// next hop of `bpf_redirect_neigh`): looked up again without skipping it. No (the neighbour
/// is not resolved yet, or the route is not the same): the link's neighbour path, as for any
/// link.
#[inline(always)]
fn peer_route<F: Family>(ctx: &TcContext, params: &mut bpf_fib_lookup) -> bool {
    if params.family != F::AF || link_flags(params.ifindex) & LINK_FLAG_PEER == 0 {
        return false;
    }
    if KPR_REDIRECT_NEXT_HOP.load() == 0 {
        return true; // the lookup found the neighbour
    }
    let out = params.ifindex;
    // The packet's own link again, and the MTU checked against the packet, as the first time.
    params.ifindex = ifindex(ctx);
    params.__bindgen_anon_1.tot_len = 0;
    // SAFETY: the helper writes within the size it is given.
    let rc = unsafe { fib_lookup(ctx.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, 0) };
    if rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) && params.ifindex == out {
        return true;
    }
    params.ifindex = out;
    false
}

#[inline(always)]
fn start_flow(t: &Tuple, service: &ServiceValue, now: u64) -> Result<i32, ()> {
    if service.flags & SERVICE_FLAG_SOURCE_RANGES != 0 {
        let key = Key::new(32 + 128, SourceRange { service_id: service.service_id.to_be(), addr: t.saddr });
        if SOURCE_RANGES.get(&key).is_none() {
            count(counter::TC_DROPPED);
            return Ok(TC_ACT_SHOT);
        }
    }
    if service.backends_count == 0 {
        if service.flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0 {
            count(counter::TC_DROPPED);
            return Ok(TC_ACT_SHOT);
        }
        // kube-proxy's REJECT: a TCP reset, else ICMP port unreachable (UDP and SCTP).
        return Ok(REJECT);
    }
    // The backend is a hash of the tuple: as random as the client's port for new flows, and
    // the same again for a connection whose entries were lost. checked_rem: no
    // division-by-zero panic path for the verifier to reject.
    let hash = flow_hash(t);
    let Some(backend) = affinity_backend(service, AFFINITY_BY_ADDR, t.saddr, now).or_else(|| backend_at(service, hash))
    else {
        return Ok(PASS);
    };
    remember_affinity(service, AFFINITY_BY_ADDR, t.saddr, &backend, now);
    let s = scratch()?;
    // SAFETY: the per-CPU scratch value, valid for this program run.
    unsafe {
        (*s).service = *service;
        (*s).backend = backend;
        // Here, off the frames of the SNAT port search: the reply entry's key goes from the
        // backend to the client, its value from the frontend to the client. All four words of
        // either family's addresses (IPv4 mapped): the same difference.
        (*s).reply_csum_diff = addrs_csum_diff::<Addr>(&backend.addr, &t.saddr, &t.daddr, &t.saddr);
    }
    Ok(OPEN)
}

/// Give a new flow to `backend` its conntrack entries (and SNAT port) and translate its first
/// packet: a subprogram of its own, for the BPF stack.
#[inline(never)]
fn open_flow<F: Family>(ctx: &TcContext, t: &Tuple, tcp_flags: u8) -> i32 {
    let Ok(s) = scratch() else { return PASS };
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let (service, backend) = unsafe { (&(*s).service, &(*s).backend) };
    program_flow::<F>(ctx, t, service, backend, tcp_flags).unwrap_or(PASS)
}

#[inline(always)]
fn program_flow<F: Family>(
    ctx: &TcContext,
    t: &Tuple,
    service: &ServiceValue,
    backend: &Backend,
    tcp_flags: u8,
) -> Result<i32, ()> {
    let s = scratch()?;
    let now = now();
    // Replies must come back through this node: masquerade what the entry says and a client
    // that is its own backend (hairpin), as kube-proxy does.
    let masquerade = service.flags & SERVICE_FLAG_SNAT != 0 || backend.addr.same(&t.saddr);
    let snat_addr = if masquerade { masquerade_source::<F>(ctx, t, &backend.addr) } else { None };
    // SAFETY (here and below): the per-CPU scratch value, valid for this program run.
    unsafe {
        (*s).reply = CtValue {
            src_addr: t.daddr,
            dst_addr: t.saddr,
            src_port: t.dport,
            dst_port: t.sport,
            service_id: service.service_id,
            last_seen: now,
            flags: ct::REPLY,
            // The client's address may change below (masquerade).
            addrs_csum_diff: (*s).reply_csum_diff,
            route: CachedRoute::NONE,
        };
    }
    let (src_addr, src_port) = if let Some(snat_addr) = snat_addr {
        // SAFETY: the per-CPU scratch value, valid for this program run. The reply entry's key
        // has the masquerade address where the client's was.
        unsafe {
            let diff = u64::from((*s).reply_csum_diff) + F::addr_diff(&snat_addr, &t.saddr);
            (*s).reply.addrs_csum_diff = csum::fold32(diff);
        }
        // 0: none free.
        let port = snat_port::<F::FlowAddr>(t, backend, &snat_addr, s);
        if port == 0 {
            count(counter::TC_SNAT_EXHAUSTED);
            return Ok(TC_ACT_SHOT);
        }
        (snat_addr, port)
    } else {
        // The replies come back to the client's own address and port, unless another flow
        // holds that reply tuple (the client's port to another frontend with the same backend,
        // not closed a second ago): then the client's port is remapped, as Linux's NAT does
        // when a reply tuple clashes.
        // SAFETY: the per-CPU scratch value, valid for this program run.
        unsafe {
            *FlowScratch::reply_key::<F::FlowAddr>(s) =
                CtKey::new(backend.addr, t.saddr, backend.port, t.sport, t.proto)
        };
        let port = if snat_try::<F::FlowAddr>(u32::from(t.sport)) != 0 {
            t.sport
        } else {
            snat_port::<F::FlowAddr>(t, backend, &t.saddr, s)
        };
        if port == 0 {
            count(counter::TC_SNAT_EXHAUSTED);
            return Ok(TC_ACT_SHOT);
        }
        (t.saddr, port)
    };
    let (forward, key, reply_key) = unsafe {
        (*s).forward = CtValue {
            src_addr,
            dst_addr: backend.addr,
            src_port,
            dst_port: backend.port,
            service_id: service.service_id,
            last_seen: now,
            flags: 0,
            // The reply's translation undone.
            addrs_csum_diff: !(*s).reply.addrs_csum_diff,
            route: CachedRoute::NONE,
        };
        // The masquerade lookup's answer is this packet's route (`forward_direct`) and the
        // flow's next packets': it moves with the entry to the established table.
        if (*s).route == ROUTE_LOOKED_UP {
            keep_in(&raw mut (*s).forward.route, &(*s).fib, (*s).fib_peer != 0, now);
        }
        let key = FlowScratch::key::<F::FlowAddr>(s);
        *key = CtKey::new(t.saddr, t.daddr, t.sport, t.dport, t.proto);
        let reply_key = FlowScratch::reply_key::<F::FlowAddr>(s);
        *reply_key = (*s).forward.pair_key(t.proto);
        (&(*s).forward, &*key, &*reply_key)
    };
    let new_flows = F::FlowAddr::new_flows();
    let forward = if new_flows.insert(key, forward, u64::from(BPF_NOEXIST)).is_ok() {
        forward
    } else if let Some(winner) = new_flows.get_ptr(key) {
        // Another CPU created the flow first (a SYN and its retransmission at once): take its
        // translation, and give back what this one held.
        let winner = unsafe { &*winner };
        count(counter::TC_CT_RACE_ADOPTED);
        if !winner.same_translation(forward) {
            let _ = new_flows.remove(reply_key);
        }
        winner
    } else {
        let _ = new_flows.remove(reply_key);
        count(counter::TC_CT_FULL);
        return Ok(TC_ACT_SHOT);
    };
    rewrite_first::<F>(ctx, t, forward)?;
    // A TCP flow is new with its SYN (SCTP with its INIT); any other packet re-creates a flow
    // that was lost.
    let recreated = has_states(t.proto) && tcp_flags & (TCP_SYN | TCP_ACK) != TCP_SYN;
    count(if recreated { counter::TC_CT_RECREATED } else { counter::TC_NEW_FLOW });
    Ok(TC_ACT_OK)
}

/// A SNAT port (0: none) for a flow to `backend` whose reply entry is `s.reply`: the reply entry is
/// stored under the first free port of a sequence that the flow's hash fixes, so a re-created
/// flow gets its old port back. Free: unused, expired, or a closed TCP flow's (as Linux's NAT
/// reuses the tuples of closed connections). The flow's own leftover reply entry is reused.
#[inline(never)]
fn snat_port<A: FlowTables>(t: &Tuple, backend: &Backend, snat_addr: &Addr, s: *mut FlowScratch) -> u16 {
    let hash = flow_hash(t);
    let (min, max) = (KPR_SNAT_PORT_MIN.load(), KPR_SNAT_PORT_MAX.load());
    let span = u32::from(max.saturating_sub(min)) + 1;
    let start = mix(hash ^ 0x5bd1_e995);
    // SAFETY: the per-CPU scratch value, valid for this program run. The key of the reply
    // entry: all but its port, which each try sets.
    unsafe {
        *FlowScratch::reply_key::<A>(s) = CtKey::new(backend.addr, *snat_addr, backend.port, 0, t.proto);
    }
    for i in 0..SNAT_TRIES {
        let offset = start.wrapping_add(i.wrapping_mul(0x9e37_79b9)).checked_rem(span).unwrap_or(0);
        let port = min.wrapping_add(offset as u16).to_be();
        if snat_try::<A>(u32::from(port)) != 0 {
            return port;
        }
    }
    0
}

/// One try of [`snat_port`]: 1 if the reply entry in the scratch area (`reply_key` but its
/// port, `reply`) now holds `port`. A global function per family: the verifier checks it once
/// per program, not once per try on every path that reaches it.
#[inline(always)]
fn snat_try<A: FlowTables>(port: u32) -> u32 {
    if size_of::<A>() == size_of::<Addr4>() { kpr_snat_try4(port) } else { kpr_snat_try6(port) }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpr_snat_try4(port: u32) -> u32 {
    snat_try_in::<Addr4>(port)
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpr_snat_try6(port: u32) -> u32 {
    snat_try_in::<Addr>(port)
}

#[inline(always)]
fn snat_try_in<A: FlowTables>(port: u32) -> u32 {
    let Ok(s) = scratch() else { return 0 };
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let (reply_key, reply) = unsafe { (&mut *FlowScratch::reply_key::<A>(s), &(*s).reply) };
    reply_key.dst_port = port as u16;
    let proto = reply_key.proto;
    let (established, new_flows) = (A::established(), A::new_flows());
    // A port free in both tables is taken by the insert (which looks it up in `CT_NEW*` itself):
    // one lookup fewer than looking first.
    // SAFETY: map value pointers are valid for this program run.
    let old = match established.get_ptr(reply_key) {
        Some(old) => unsafe { &*old },
        None if new_flows.insert(reply_key, reply, u64::from(BPF_NOEXIST)).is_ok() => return 1,
        None => match new_flows.get_ptr(reply_key) {
            Some(old) => unsafe { &*old },
            None => return 0,
        },
    };
    if old.same_translation(reply) {
        // The flow's own leftover (its other entry was lost, or removed first by the sweep):
        // made new, not kept with the old flow's state and age (an expired leftover would be
        // taken for an ended flow when the answer comes, and the answer passed untranslated).
        let _ = established.remove(reply_key);
        flow_cache::forgotten();
        return u32::from(new_flows.insert(reply_key, reply, 0).is_ok());
    }
    let now = now();
    let idle = now.saturating_sub(old.last_seen);
    let closed = ct::closed(old.flags) && idle > ct::CLOSED_PORT_REUSE_NS;
    if closed || expired(proto, old, now) {
        count(counter::TC_CT_EXPIRED);
        forget(reply_key, old, proto);
        return u32::from(new_flows.insert(reply_key, reply, u64::from(BPF_NOEXIST)).is_ok());
    }
    0
}

/// A hash of the tuple, seeded per boot (`KPR_FLOW_HASH_SEED`).
#[inline(always)]
fn flow_hash(t: &Tuple) -> u32 {
    let mut h = KPR_FLOW_HASH_SEED.load();
    h = mix(h ^ t.saddr.folded());
    h = mix(h ^ t.daddr.folded());
    h = mix(h ^ (u32::from(t.sport) << 16 | u32::from(t.dport)));
    mix(h ^ u32::from(t.proto))
}

/// murmur3's finalizer: every input bit affects every output bit.
#[inline(always)]
fn mix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// Start a new connection (its SYN; its key and the entry found are in the scratch area) on
/// the established entries of the closed flow whose tuple it reuses, if a new pick would
/// translate it as that flow was: the same service, backend and source (the client's, or the
/// same masquerade address; the SNAT port is the flow's own). Both entries go back to "not
/// answered" (the SYN timeout) in place. Services with session affinity or source ranges,
/// and a flow missing its other entry, take the full path.
#[inline(never)]
fn reopen<F: Family>(ctx: &TcContext, t: &Tuple, entry_ptr: *mut CtValue, now: u64) -> bool {
    let Ok(s) = scratch() else { return false };
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let (key, entry) = unsafe { (&*FlowScratch::flow_key::<F::FlowAddr>(s), &(*s).entry) };
    if entry.flags & ct::REPLY != 0 {
        return false;
    }
    let Some(service) = lookup_frontend(t, source_scope(ctx, t)) else { return false };
    if service.service_id != entry.service_id
        || service.affinity_timeout != 0
        || service.flags & SERVICE_FLAG_SOURCE_RANGES != 0
    {
        return false;
    }
    let Some(backend) = backend_at(&service, flow_hash(t)) else { return false };
    if !(backend.addr.same(&entry.dst_addr) && backend.port == entry.dst_port) {
        return false;
    }
    let same_source = if service.flags & SERVICE_FLAG_SNAT != 0 || backend.addr.same(&t.saddr) {
        !entry.src_addr.same(&t.saddr)
            && masquerade_source::<F>(ctx, t, &backend.addr).is_some_and(|addr| addr.same(&entry.src_addr))
    } else {
        entry.src_addr.same(&t.saddr) && entry.src_port == t.sport
    };
    if !same_source {
        return false;
    }
    // SAFETY: the scratch area and map value pointers, valid for this program run.
    unsafe {
        let pair_key = FlowScratch::reply_key::<F::FlowAddr>(s);
        *pair_key = entry.pair_key(key.proto);
        match F::FlowAddr::established().get_ptr_mut(&*pair_key) {
            // The replies' entry must still be this flow's (it holds the SNAT port).
            Some(pair)
                if (*pair).dst_addr.same(&key.src_addr.addr())
                    && (*pair).dst_port == key.src_port
                    && (*pair).src_addr.same(&key.dst_addr.addr())
                    && (*pair).src_port == key.dst_port =>
            {
                (*pair).flags = ct::REPLY;
                (*pair).last_seen = now;
            }
            _ => return false,
        }
        (*entry_ptr).flags = 0;
        (*entry_ptr).last_seen = now;
    }
    true
}

/// The flow's endpoint is no longer one of its frontend's endpoints (or the frontend is gone).
#[inline(never)]
fn stale(ctx: &TcContext, t: &Tuple, entry: &CtValue) -> bool {
    lookup_frontend(t, source_scope(ctx, t)).is_none_or(|service| !serves(&service, &entry.dst_addr, entry.dst_port))
}

/// A later fragment (no ports) of a datagram whose first fragment was translated: the same
/// addresses (its IP checksum only: the L4 checksum is in the first fragment). A fragment
/// of anything else passes untouched.
#[inline(always)]
fn later_fragment<F: Family>(ctx: &TcContext, ip: &F::Ip) -> Result<i32, ()> {
    let (saddr, daddr) = (F::src(ip), F::dst(ip));
    let Some(key) = fragment_key::<F>(ip, &saddr, &daddr) else {
        return Ok(PASS);
    };
    let Some(to) = FRAGMENTS.get_ptr(&key) else {
        count(counter::TC_PASSED_UNSUPPORTED);
        return Ok(PASS);
    };
    // SAFETY: valid for this program run.
    let to = unsafe { *to };
    let diff = F::addr_diff(&saddr, &to.src_addr) + F::addr_diff(&daddr, &to.dst_addr);
    let data = ctx.data();
    if data + IP_OFF + size_of::<F::Ip>() > ctx.data_end() {
        return Err(());
    }
    // SAFETY: within [data, data_end), checked above.
    unsafe { F::write_addrs((data + IP_OFF) as *mut u8, &to.src_addr, &to.dst_addr, diff) };
    count(counter::TC_FRAGMENT_TRANSLATED);
    Ok(TC_ACT_OK)
}

/// The `KPR_FRAGMENTS` key of a datagram in fragments (IPv4: IPv6 fragments are not parsed).
#[inline(always)]
fn fragment_key<F: Family>(ip: &F::Ip, saddr: &Addr, daddr: &Addr) -> Option<FragmentKey> {
    let id = F::fragment_id(ip)?;
    let proto = F::l4_proto(ip)?;
    Some(FragmentKey { src_addr: saddr.v4(), dst_addr: daddr.v4(), id, proto, _pad: 0 })
}

/// Rewrite addresses and ports to `to`, fixing the IP and L4 checksums incrementally; the
/// first fragment of a datagram leaves its rewrite for the later ones.
///
/// The checksums take the entry's difference of the addresses and the ports' own. Where the
/// packet's L4 checksum is complete and the program may see so (`checksum_complete`, 6.2+),
/// its field is changed in place like the IPv4 header's; elsewhere it goes through the kernel
/// (only it knows whether the checksum is partial, left to the device, which changes the
/// arithmetic), and what the field became says how the ports' change goes in
/// (`ports_csum_in_place`; else a second call).
#[inline(always)]
fn rewrite<F: Family>(ctx: &TcContext, t: &Tuple, to: &CtValue) -> Result<(), ()> {
    if t.first_fragment != NOT_A_FIRST_FRAGMENT {
        let id = t.first_fragment as u16;
        let key = FragmentKey { src_addr: t.saddr.v4(), dst_addr: t.daddr.v4(), id, proto: t.proto, _pad: 0 };
        let _ = FRAGMENTS.insert(&key, to, 0);
    }
    let addrs_changed = !(F::same_addr(&to.src_addr, &t.saddr) && F::same_addr(&to.dst_addr, &t.daddr));
    let (old_ports, new_ports) = (ports_word(t.sport, t.dport), ports_word(to.src_port, to.dst_port));
    // One's complement difference of the addresses (for the IPv4 checksum and the pseudo
    // header), worked out when the entry was made.
    let addr_diff = to.addrs_csum_diff;
    // TCP's and UDP's checksums cover the addresses (pseudo header); SCTP's CRC32c does not.
    let inet_csum = match t.proto {
        IPPROTO_TCP => Some((F::L4_OFF + TCP_CSUM, 0)),
        // A UDP checksum of 0 means "none" (IPv4 only) and must stay 0.
        IPPROTO_UDP => Some((F::L4_OFF + UDP_CSUM, u64::from(BPF_F_MARK_MANGLED_0))),
        _ => None,
    };
    // A complete checksum in the linear area, with no sum of the data kept in the skb: the
    // field is changed in place, to the sum the kernel's calls would give (perhaps as one's
    // complement's other zero, which verifies the same; a UDP zero is marked as they mark it).
    let field = match inet_csum {
        Some((csum_off, _)) if checksum_complete(ctx) => l4_csum_field(ctx, csum_off),
        _ => NO_FIELD,
    };
    match inet_csum {
        Some((csum_off, flags)) if field != NO_FIELD => {
            let mark_mangled_0 = flags != 0;
            if !(mark_mangled_0 && field == 0) {
                let mut diff = if addrs_changed { u64::from(addr_diff) } else { 0 };
                if old_ports != new_ports {
                    diff += csum::word_diff(old_ports, new_ports);
                }
                let check = csum::replace(field as u16, diff);
                let at = ctx.data() + csum_off;
                if at + 2 > ctx.data_end() {
                    return Err(());
                }
                // SAFETY: within [data, data_end), checked above.
                unsafe { write_word(at as *mut u8, csum::kernel::mangled(check, mark_mangled_0)) };
            }
        }
        Some((csum_off, flags)) => {
            let mut ports_left = old_ports != new_ports;
            if addrs_changed {
                let before = l4_csum_field(ctx, csum_off);
                // Size 0: `to` is a precomputed difference.
                ctx.l4_csum_replace(csum_off, 0, u64::from(addr_diff), flags | u64::from(BPF_F_PSEUDO_HDR))
                    .map_err(drop)?;
                ports_left = ports_left
                    && !ports_csum_in_place(ctx, csum_off, before, addr_diff, flags != 0, old_ports, new_ports);
            }
            if ports_left {
                ctx.l4_csum_replace(csum_off, u64::from(old_ports), u64::from(new_ports), flags | 4).map_err(drop)?;
            }
        }
        None if old_ports != new_ports => sctp_ports_crc::<F>(ctx, old_ports, new_ports, t.l4_len)?,
        None => {}
    }
    // The helpers may have moved the packet: bounds are checked again.
    let data = ctx.data();
    if data + F::L4_OFF + 4 > ctx.data_end() {
        return Err(());
    }
    // SAFETY: within [data, data_end), checked above.
    unsafe {
        if addrs_changed {
            F::write_addrs((data + IP_OFF) as *mut u8, &to.src_addr, &to.dst_addr, u64::from(addr_diff));
        }
        if old_ports != new_ports {
            write_word((data + F::L4_OFF) as *mut u8, new_ports);
        }
    }
    Ok(())
}

/// The packet's L4 checksum is complete and its skb keeps no sum of the data
/// (`CHECKSUM_NONE`, `CHECKSUM_UNNECESSARY`): the program may change the field itself. False
/// also where the kernel does not let the program read the state (before 6.2).
#[inline(always)]
fn checksum_complete(ctx: &TcContext) -> bool {
    let at = KPR_IP_SUMMED_AT.load();
    if at == 0 {
        return false;
    }
    // SAFETY: the helper id the loader makes `bpf_cast_to_kern_ctx`'s call (it set `at`); the
    // kfunc returns the program's context as the kernel's `sk_buff`, readable where its BTF says.
    let ip_summed = unsafe {
        let cast_to_kern_ctx: unsafe extern "C" fn(*mut core::ffi::c_void) -> *const u8 =
            core::mem::transmute(proxy_common::CAST_TO_KERN_CTX_STANDIN as usize);
        let skb = cast_to_kern_ctx(ctx.as_ptr());
        (*skb.add((at >> 8) as usize) >> (at & 7)) & 3
    };
    // CHECKSUM_NONE 0, CHECKSUM_UNNECESSARY 1 (CHECKSUM_COMPLETE 2, CHECKSUM_PARTIAL 3).
    ip_summed <= 1
}

/// [`l4_csum_field`]: the field is not in the linear area. A plain integer, not an `Option`:
/// the compiler may read an empty option's payload, an uninitialized slot the verifier refuses.
const NO_FIELD: u32 = u32::MAX;

/// The L4 checksum field at `off`, else `NO_FIELD`.
#[inline(always)]
fn l4_csum_field(ctx: &TcContext, off: usize) -> u32 {
    let at = ctx.data() + off;
    if at + 2 > ctx.data_end() {
        return NO_FIELD;
    }
    // SAFETY: within [data, data_end), checked above.
    u32::from(unsafe { read_word::<u16>(at as *const u8) })
}

/// The ports' share of the L4 checksum, after the kernel applied the addresses' (`diff`) to the
/// field that was `before`: what the field became tells whether the packet's checksum is
/// complete (the ports' change is then written into it here) or left to the device (nothing
/// more to do) — a helper call saved on every translated packet. False: the field did not
/// tell (`csum::l4_state`), and the kernel must be asked.
#[inline(always)]
fn ports_csum_in_place(
    ctx: &TcContext,
    off: usize,
    before: u32,
    diff: u32,
    mark_mangled_0: bool,
    old_ports: u32,
    new_ports: u32,
) -> bool {
    let after = l4_csum_field(ctx, off);
    if before == NO_FIELD || after == NO_FIELD {
        return false;
    }
    match csum::l4_state(before as u16, after as u16, diff, mark_mangled_0) {
        L4State::NoMore => true,
        L4State::Unknown => false,
        L4State::Complete => {
            let check = csum::kernel::word_complete(after as u16, old_ports, new_ports);
            let at = ctx.data() + off;
            if at + 2 > ctx.data_end() {
                return false;
            }
            // SAFETY: within [data, data_end), checked above.
            unsafe { write_word(at as *mut u8, csum::kernel::mangled(check, mark_mangled_0)) };
            true
        }
    }
}

/// [`rewrite`] for a new flow's first packet, as a subprogram: the new-flow path has used its
/// share of the BPF stack.
#[inline(never)]
fn rewrite_first<F: Family>(ctx: &TcContext, t: &Tuple, to: &CtValue) -> Result<(), ()> {
    rewrite::<F>(ctx, t, to)
}

/// Two ports as the four bytes they are in the packet, read as one native word.
#[inline(always)]
fn ports_word(first: u16, second: u16) -> u32 {
    // Shifts, not a byte array: the array's bytes compile to a mask and a shift each.
    if cfg!(target_endian = "little") {
        u32::from(first) | u32::from(second) << 16
    } else {
        u32::from(first) << 16 | u32::from(second)
    }
}

/// Fix an SCTP packet's CRC32c for its ports going from `old` to `new` (`crc32c`: no second
/// read of the packet). A checksum of 0 is left alone: the sender's kernel left it to the
/// device (`CHECKSUM_PARTIAL`), which computes it over the rewritten packet.
#[inline(always)]
fn sctp_ports_crc<F: Family>(ctx: &TcContext, old: u32, new: u32, sctp_len: u16) -> Result<(), ()> {
    let sum = u32::from_le_bytes(ctx.load::<[u8; 4]>(F::L4_OFF + SCTP_CSUM).map_err(drop)?);
    if sum == 0 {
        return Ok(());
    }
    let sum = sum ^ kpr_sctp_crc_delta(old, new, u32::from(sctp_len));
    ctx.store(F::L4_OFF + SCTP_CSUM, &sum.to_le_bytes(), 0).map_err(drop)
}

/// [`crc32c::port_rewrite_delta`] as a global function: the verifier checks it once, not once
/// per path of the program that reaches it.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpr_sctp_crc_delta(old: u32, new: u32, len: u32) -> u32 {
    crc32c::port_rewrite_delta(old, new, len as u16)
}

/// An ICMP error (unreachable, too big, time exceeded, parameter problem) about a translated
/// flow, e.g. "fragmentation needed" from a backend: it quotes the packet as the backend saw
/// it. Translate the quoted header and the outer addresses back, so that the client's kernel
/// matches it to its socket (path MTU discovery, connection errors).
#[inline(always)]
fn icmp_error<F: Family>(ctx: &TcContext) -> i32 {
    let Ok(s) = scratch() else { return PASS };
    match icmp_error_flow::<F>(ctx, s) {
        Ok(true) => icmp_error_rewrite::<F>(ctx, s).unwrap_or(PASS),
        _ => PASS,
    }
}

/// The translation back of an ICMP error (in `s.icmp`), if it is about a translated flow. A
/// subprogram of its own, as is the rewrite: together they would not fit on the BPF stack.
#[inline(never)]
fn icmp_error_flow<F: Family>(ctx: &TcContext, s: *mut FlowScratch) -> Result<bool, ()> {
    let inner_off = F::L4_OFF + ICMP_QUOTE;
    let inner_l4_off = inner_off + size_of::<F::Ip>();
    // Headers are read in place, pulled into the linear area first.
    if ctx.data() + inner_l4_off + 4 > ctx.data_end() {
        ctx.pull_data((inner_l4_off + 4) as u32).map_err(drop)?;
    }
    let data = ctx.data();
    if data + inner_l4_off + 4 > ctx.data_end() {
        return Ok(false);
    }
    // SAFETY: within [data, data_end), checked above; the headers are plain bytes.
    let (outer, icmp_type, inner, ports) = unsafe {
        (
            &*((data + IP_OFF) as *const F::Ip),
            *((data + F::L4_OFF) as *const u8),
            &*((data + inner_off) as *const F::Ip),
            read_word::<[u16; 2]>((data + inner_l4_off) as *const u8),
        )
    };
    if !F::quotes_packet(icmp_type) {
        return Ok(false);
    }
    // The quoted ports are where TCP, UDP and SCTP all have them (SCTP's quoted CRC stays: the
    // quote is cut short, and its receiver checks the verification tag instead).
    let proto = match F::l4_proto(inner) {
        Some(p @ (IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP)) => p,
        _ => return Ok(false),
    };
    let (isrc, idst) = (F::src(inner), F::dst(inner));
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let key = unsafe {
        let key = FlowScratch::key::<F::FlowAddr>(s);
        *key = CtKey::new(idst, isrc, ports[1], ports[0], proto);
        &*key
    };
    // The quoted packet went from (translated) client to backend: the backend's reply entry
    // holds the original addresses.
    let Some(entry) = flow_entry(key) else {
        return Ok(false);
    };
    let osrc = F::src(outer);
    // To the client; from the frontend when the backend itself complained.
    let new_src = if osrc.same(&idst) { entry.src_addr } else { osrc };
    let inner_diff = F::addr_diff(&isrc, &entry.dst_addr) + F::addr_diff(&idst, &entry.src_addr);
    let outer_diff = F::addr_diff(&osrc, &new_src) + F::addr_diff(&F::dst(outer), &entry.dst_addr);
    unsafe {
        (*s).icmp = IcmpFix {
            client: entry.dst_addr,
            frontend: entry.src_addr,
            new_src,
            inner_diff,
            outer_diff,
            old_ports: ports_word(ports[0], ports[1]),
            new_ports: ports_word(entry.dst_port, entry.src_port),
        };
    }
    Ok(true)
}

/// Apply `s.icmp` to the ICMP error.
#[inline(never)]
fn icmp_error_rewrite<F: Family>(ctx: &TcContext, s: *const FlowScratch) -> Result<i32, ()> {
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let fix = unsafe { &(*s).icmp };
    let inner_off = F::L4_OFF + ICMP_QUOTE;
    let inner_l4_off = inner_off + size_of::<F::Ip>();
    // The ICMP checksum covers the quoted packet: its ports, and in IPv6 its addresses (an
    // IPv4 quote's own header checksum, fixed with its addresses, keeps its sum the same), and
    // in IPv6 the outer addresses too (pseudo header).
    let icmp_csum = F::L4_OFF + ICMP_CSUM;
    ctx.l4_csum_replace(icmp_csum, u64::from(fix.old_ports), u64::from(fix.new_ports), 4).map_err(drop)?;
    if F::ICMP_PSEUDO_HEADER {
        ctx.l4_csum_replace(icmp_csum, 0, u64::from(csum::fold32(fix.inner_diff)), 0).map_err(drop)?;
        let pseudo = u64::from(BPF_F_PSEUDO_HDR);
        ctx.l4_csum_replace(icmp_csum, 0, u64::from(csum::fold32(fix.outer_diff)), pseudo).map_err(drop)?;
    }
    let data = ctx.data();
    if data + inner_l4_off + 4 > ctx.data_end() {
        return Err(());
    }
    // SAFETY: within [data, data_end), checked above.
    unsafe {
        F::write_addrs((data + inner_off) as *mut u8, &fix.client, &fix.frontend, fix.inner_diff);
        write_word((data + inner_l4_off) as *mut u8, fix.new_ports);
        F::write_addrs((data + IP_OFF) as *mut u8, &fix.new_src, &fix.client, fix.outer_diff);
    }
    count(counter::TC_CT_HIT);
    Ok(TC_ACT_OK)
}
