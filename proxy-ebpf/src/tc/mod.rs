//! Per-packet service translation on node interfaces (tc/TCX), IPv4 and IPv6: written once,
//! generic over `family::Family`, compiled for each.
//!
//! ```text
//!  attached: kpr_tc_ingress, kpr_tc_egress → fast_path (stages inlined, no call for a packet of
//!  a flow in conntrack)                     slow (tail-called: tail_call_slow_path) → slow_path,
//!                                           each stage a subprogram (`*_subprogram`)
//!   route::martian_source (ingress)
//!   1 parse::inspect ──── not ours ─────────▶ PASS
//!   2 conntrack::translate_tracked ── a flow ──▶ rewrite ──▶ 6
//!       ├── a flow whose endpoint died ──▶ reject::reset_flow (a RST to the client)
//!       └── no flow, an ICMP error ── tail call ──▶ slow: 1, 2 again, then
//!   3 icmp::icmp_error (an ICMP error about a flow) ──▶ rewrite
//!   4 nat::pick_backend: frontend, source ranges, affinity, the backend (none: reject::*)
//!   5 nat::create_flow: SNAT port, both conntrack entries, the first packet rewritten
//!   6 route::forward_direct (translated on ingress: to the peer or the neighbour; too big
//!     for the link: icmp::too_big)
//! ```
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
//! connection whose entries were lost (expired, or evicted from the new-flow table) is
//! re-created as it was by its next segment.
//!
//! An IPv4 datagram in fragments is translated whole: the first fragment (with the ports) as
//! any packet, the later ones with the addresses it got (`KPR_FRAGMENTS`).
//!
//! Packets the program does not translate go on to the next program of the hook
//! (`TC_ACT_UNSPEC`: a CNI's or observability program attached after kpr still sees them);
//! packets with headers it does not walk (IPv4 options, IPv6 extension headers, IPv6
//! fragments) are also counted.
//! The program never fails a packet it did not translate.
mod conntrack;
mod dsr;
mod entry;
mod event;
mod frag;
mod icmp;
mod nat;
mod parse;
mod reject;
mod rewrite;
mod route;
mod scratch;
mod source_ranges;
mod verdict;

use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    programs::TcContext,
};
use proxy_common::{IPPROTO_TCP, counter, tc_slow_path};

// What the XDP program shares with tc: a flow's lifetime, the ports' word, a route lookup's
// parameters zeroed.
use self::{
    conntrack::translate_tracked,
    icmp::{icmp_error, too_big},
    nat::{create_flow_subprogram, pick_backend_subprogram},
    parse::{Tuple, came_through_ingress, eth_type, flow_flags, inspect, is_probe, l3_protocol, vlan_tagged},
    reject::{reject_port_unreachable, reject_tcp, reset_flow},
    route::{ROUTE_LOOK_UP, ROUTE_MAY_KEEP, forward_direct, martian_source},
    scratch::scratch,
    verdict::{A_FLOW, AN_ICMP_ERROR, END_FLOW, NO_FLOW, OPEN, PASS, REJECT, TOO_BIG},
};
pub(crate) use self::{entry::expired, rewrite::ports_word, route::zero_fib};
use crate::{
    family::{Family, V4, V6},
    maps::{SLOW_PATH, count, in_addr_filter, retiring_older_layout},
    packet::{TCP_RST, TCP_SYN},
};

#[classifier]
pub fn kpr_tc_ingress(ctx: TcContext) -> i32 {
    if vlan_tagged(&ctx) {
        return PASS;
    }
    match eth_type(&ctx) {
        Some(t) if t == <V4>::ETH_TYPE => ingress::<V4>(&ctx),
        Some(t) if t == <V6>::ETH_TYPE => ingress::<V6>(&ctx),
        _ => PASS,
    }
}

#[classifier]
pub fn kpr_tc_egress(ctx: TcContext) -> i32 {
    if came_through_ingress(&ctx) || vlan_tagged(&ctx) {
        return PASS;
    }
    match eth_type(&ctx) {
        Some(t) if t == <V4>::ETH_TYPE => fast_path::<V4>(&ctx, false, false),
        Some(t) if t == <V6>::ETH_TYPE => fast_path::<V6>(&ctx, false, false),
        _ => PASS,
    }
}

#[classifier]
pub fn kpr_tc_ingress_slow(ctx: TcContext) -> i32 {
    match eth_type(&ctx) {
        Some(t) if t == <V4>::ETH_TYPE => slow_ingress::<V4>(&ctx),
        Some(t) if t == <V6>::ETH_TYPE => slow_ingress::<V6>(&ctx),
        _ => PASS,
    }
}

#[classifier]
pub fn kpr_tc_egress_slow(ctx: TcContext) -> i32 {
    let verdict = match eth_type(&ctx) {
        Some(t) if t == <V4>::ETH_TYPE => slow_path::<V4>(&ctx, false),
        Some(t) if t == <V6>::ETH_TYPE => slow_path::<V6>(&ctx, false),
        _ => Ok(PASS),
    };
    verdict.unwrap_or(PASS)
}

// The same four for links without Ethernet (`LINK_FLAG_NOT_ETHERNET`: IP-in-IP, WireGuard): the
// IP header first, the family from the packet's protocol. Nothing is sent straight out of them.

#[classifier]
pub fn kpr_tc_ingress_l3(ctx: TcContext) -> i32 {
    match l3_protocol(&ctx) {
        t if t == <V4>::ETH_TYPE => ingress::<V4<0>>(&ctx),
        t if t == <V6>::ETH_TYPE => ingress::<V6<0>>(&ctx),
        _ => PASS,
    }
}

#[classifier]
pub fn kpr_tc_egress_l3(ctx: TcContext) -> i32 {
    if came_through_ingress(&ctx) {
        return PASS;
    }
    match l3_protocol(&ctx) {
        t if t == <V4>::ETH_TYPE => fast_path::<V4<0>>(&ctx, false, false),
        t if t == <V6>::ETH_TYPE => fast_path::<V6<0>>(&ctx, false, false),
        _ => PASS,
    }
}

#[classifier]
pub fn kpr_tc_ingress_l3_slow(ctx: TcContext) -> i32 {
    match l3_protocol(&ctx) {
        t if t == <V4>::ETH_TYPE => slow_ingress::<V4<0>>(&ctx),
        t if t == <V6>::ETH_TYPE => slow_ingress::<V6<0>>(&ctx),
        _ => PASS,
    }
}

#[classifier]
pub fn kpr_tc_egress_l3_slow(ctx: TcContext) -> i32 {
    let verdict = match l3_protocol(&ctx) {
        t if t == <V4>::ETH_TYPE => slow_path::<V4<0>>(&ctx, false),
        t if t == <V6>::ETH_TYPE => slow_path::<V6<0>>(&ctx, false),
        _ => Ok(PASS),
    };
    verdict.unwrap_or(PASS)
}

/// The attached programs' path: a packet of a flow in conntrack translated (the verdict),
/// anything else handed to the slow program. `decapsulated`: the packet came out of a direct
/// server return tunnel (its addresses may be none the address filter knows).
#[inline(always)]
fn fast_path<F: Family>(ctx: &TcContext, ingress: bool, decapsulated: bool) -> i32 {
    let mut t = MaybeUninit::<Tuple>::uninit();
    match parse_and_track::<F>(ctx, &mut t, ingress, false, decapsulated) {
        NO_FLOW | AN_ICMP_ERROR => tail_call_slow_path::<F>(ctx, ingress),
        // SAFETY: `parse_and_track` wrote the tuple (a flow was found).
        END_FLOW => reset_flow::<F>(ctx, unsafe { t.assume_init_ref() }),
        verdict => verdict,
    }
}

/// Tail call the slow program of the framing and direction; it returns only when its slot is
/// empty.
#[inline(always)]
fn tail_call_slow_path<F: Family>(ctx: &TcContext, ingress: bool) -> i32 {
    let slot = match (F::ETHERNET, ingress) {
        (true, true) => tc_slow_path::INGRESS,
        (true, false) => tc_slow_path::EGRESS,
        (false, true) => tc_slow_path::INGRESS_L3,
        (false, false) => tc_slow_path::EGRESS_L3,
    };
    // SAFETY: the slow programs take the same context and return a tc verdict.
    unsafe { SLOW_PATH.tail_call(ctx, slot) };
    count(counter::TC_SLOW_PATH_MISSING);
    PASS
}

/// A packet on its way in, translated, sent straight out (unless the host's forwarding path
/// takes it: `send_on`).
#[inline(always)]
fn ingress<F: Family>(ctx: &TcContext) -> i32 {
    if martian_source::<F>(ctx) {
        count(counter::TC_DROPPED);
        return TC_ACT_SHOT;
    }
    // Out of a direct server return tunnel (its inner source checked there). Nothing held
    // across a call here: this frame bounds every chain of calls of the attached program (a
    // hint a found flow leaves is one for its own tuple, `dsr::open_decapsulated`).
    let decapsulated = F::ETHERNET && tunnelled::<F>(ctx) && dsr::decapsulate::<F>(ctx);
    match fast_path::<F>(ctx, true, decapsulated) {
        TC_ACT_OK if F::ETHERNET => send_on::<F>(ctx),
        TOO_BIG => too_big::<F>(ctx),
        verdict => verdict,
    }
}

/// A packet in IP-in-IP of the family (direct server return's, maybe): one byte read.
#[inline(always)]
fn tunnelled<F: Family>(ctx: &TcContext) -> bool {
    let data = ctx.data();
    if data + F::IP_OFF + size_of::<F::Ip>() > ctx.data_end() {
        return false;
    }
    // SAFETY: within [data, data_end), checked above.
    F::next_header(unsafe { &*((data + F::IP_OFF) as *const F::Ip) }) == F::TUNNEL_PROTO
}

/// The same in the slow program: every stage, as subprograms.
#[inline(always)]
fn slow_ingress<F: Family>(ctx: &TcContext) -> i32 {
    let verdict = slow_path::<F>(ctx, true);
    dsr::forget_hint();
    match verdict {
        Ok(TC_ACT_OK) if F::ETHERNET => send_on::<F>(ctx),
        Ok(TOO_BIG) => too_big::<F>(ctx),
        Ok(verdict) => verdict,
        Err(()) => PASS,
    }
}

/// A packet translated on its way in: straight out (`forward_direct`), or, too big for its
/// link, answered (`too_big`). Called here, from the attached program, not from
/// `forward_direct`: the BPF stack of that chain of calls would not hold `too_big`'s frame on
/// 6.1.
#[inline(always)]
fn send_on<F: Family>(ctx: &TcContext) -> i32 {
    match forward_direct::<F>(ctx) {
        TOO_BIG => too_big::<F>(ctx),
        // A packet of direct server return put in its tunnel that the route did not let out
        // (the host now filters forwarded packets, the route leaves by a link without
        // Ethernet): the host stack would drop it as a martian (its source is the node's).
        TC_ACT_OK if tunnelled::<F>(ctx) => {
            count(counter::TC_DROPPED);
            TC_ACT_SHOT
        }
        verdict => verdict,
    }
}

/// The slow programs' path. Its stages are subprograms called one after the other, not inlined
/// into each other: the BPF stack (512 bytes) bounds the frames of a chain of calls, not their
/// sum. (The attached programs inline the first, `parse_and_track`, and make no call for a
/// packet of a known flow: see `SLOW_PATH`.)
#[inline(always)]
fn slow_path<F: Family>(ctx: &TcContext, ingress: bool) -> Result<i32, ()> {
    // Filled in by `parse_and_track` when it says so (not zeroed first: a memset on every
    // packet).
    let mut t = MaybeUninit::<Tuple>::uninit();
    let decapsulated = ingress && F::ETHERNET && dsr::hint_pending();
    match parse_and_track_subprogram::<F>(ctx, &mut t, ingress, decapsulated) {
        NO_FLOW => {}
        AN_ICMP_ERROR => return Ok(icmp_error::<F>(ctx)),
        // SAFETY: `parse_and_track` wrote the tuple (a flow was found).
        END_FLOW => return Ok(reset_flow::<F>(ctx, unsafe { t.assume_init_ref() })),
        verdict => return Ok(verdict),
    }
    // SAFETY: `parse_and_track` wrote the tuple (NO_FLOW).
    let t = unsafe { t.assume_init() };
    let tcp_flags = flow_flags::<F>(ctx, t.proto);
    Ok(match pick_backend_subprogram::<F>(ctx, &t, tcp_flags, ingress) {
        OPEN => {
            let mut s = scratch()?;
            s.route = if ingress && F::ETHERNET { ROUTE_MAY_KEEP } else { ROUTE_LOOK_UP };
            let verdict = create_flow_subprogram::<F>(ctx, &t, tcp_flags);
            // A route kept for a packet not sent on serves no other.
            if verdict != TC_ACT_OK {
                s.route = ROUTE_LOOK_UP;
            }
            verdict
        }
        // kube-proxy's REJECT: a TCP reset, else ICMP port unreachable (UDP and SCTP).
        REJECT if t.proto == IPPROTO_TCP => reject_tcp::<F>(ctx, &t),
        REJECT => reject_port_unreachable::<F>(ctx, &t),
        PASS if awaits_copied_flow(&t, tcp_flags) => {
            event::note(&t, counter::TC_DROPPED, proxy_common::event::DROPPED_DURING_UPGRADE, 0);
            TC_ACT_SHOT
        }
        verdict => verdict,
    })
}

/// While an older layout is retired (`HOST_RETIRING_OLDER_LAYOUT`, milliseconds): a TCP segment
/// other than a SYN or RST that found no flow, from an address that may be a backend's (the
/// address filter). Its flow may be one the older programs established and the agent has not
/// copied yet: dropped, it is sent again, where passed on untranslated it would be reset. A
/// subprogram: inlined, its frame would lengthen every chain of calls through the slow path.
#[inline(never)]
fn awaits_copied_flow(t: &Tuple, tcp_flags: u8) -> bool {
    t.proto == IPPROTO_TCP
        && tcp_flags & (TCP_SYN | TCP_RST) == 0
        && retiring_older_layout()
        && in_addr_filter(&t.saddr)
}

/// [`parse_and_track`] as a subprogram, for the slow programs' chains of calls.
#[inline(never)]
fn parse_and_track_subprogram<F: Family>(
    ctx: &TcContext,
    tuple: &mut MaybeUninit<Tuple>,
    ingress: bool,
    decapsulated: bool,
) -> i32 {
    parse_and_track::<F>(ctx, tuple, ingress, true, decapsulated)
}

/// The packet read (`inspect`) and, if its flow is in conntrack, translated (`translate_tracked`):
/// a verdict, `AN_ICMP_ERROR`, or `NO_FLOW` with the packet's tuple filled in.
#[inline(always)]
fn parse_and_track<F: Family>(
    ctx: &TcContext,
    tuple: &mut MaybeUninit<Tuple>,
    ingress: bool,
    slow: bool,
    decapsulated: bool,
) -> i32 {
    match inspect::<F>(ctx, tuple, decapsulated) {
        A_FLOW => {}
        verdict => return verdict,
    }
    // A probe of `kpr verify` is told on the slow path, which every probe takes (a new tuple):
    // in place, not in a copy (the slow path's chain of frames has no room for one).
    if slow {
        // SAFETY: `inspect` wrote the tuple (A_FLOW).
        unsafe { (*tuple.as_mut_ptr()).probe = is_probe(ctx) };
    }
    // SAFETY: `inspect` wrote the tuple (A_FLOW).
    let t = unsafe { tuple.assume_init_ref() };
    translate_tracked::<F>(ctx, t, flow_flags::<F>(ctx, t.proto), ingress, slow)
}
