//! Direct server return (`SERVICE_FLAG_DSR`) in IP-in-IP, as Katran and Cilium's `ipip`
//! dispatch: the node a client's flow arrives at (the entry node) picks an endpoint on another
//! node and sends it the client's packets untranslated, each in an outer header to the
//! endpoint's address (`encapsulate`); that node takes the outer header off (`decapsulate`),
//! translates the flow as if it had arrived there (DNAT to that endpoint, no masquerade), and
//! its replies go straight to the client, from the frontend's address.
//!
//! ```text
//!  client ──▶ entry node: DNAT? no; IP-in-IP to the endpoint ──▶ endpoint's node: outer header
//!     ▲                                                          off, DNAT, conntrack
//!     └──────────── replies, source the frontend's address ◀──── endpoint
//! ```
//!
//! The outer header carries the endpoint's port (`Family::tunnel_port`): the endpoint's node
//! may not know the entry node's address as a NodePort frontend, and a Service's endpoints
//! may listen on different ports.
use aya_ebpf::{
    EbpfContext as _,
    bindings::{__sk_buff, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_SHOT, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, bpf_fib_lookup},
    helpers::bpf_fib_lookup as fib_lookup,
    programs::TcContext,
};
use proxy_common::{
    Addr, CtValue, IPPROTO_TCP, LINK_FLAG_LOCAL_TRAFFIC, NODE_ADDR_LOCAL, SCOPE_EXTERNAL, SERVICE_FLAG_DSR,
    SERVICE_FLAG_SNAT, ServiceKey, addrs_csum_diff,
};

use super::{
    parse::Tuple,
    route::{ifindex, zero_fib},
    scratch::scratch,
    source_ranges::source_range_refuses,
    verdict::{OPEN, PASS, TOO_BIG},
};
use crate::{
    family::{Family, Fragment},
    maps::{NOT_AN_ENDPOINT, PAST_THE_SCAN, SERVICES, link, link_flags, local_endpoint_port, node_addr_flags},
    packet::{read_word, write_word},
};

/// A service entry's copy in a `DsrHint`: its flow came out of the tunnel (the endpoint's
/// SYN-ACK is clamped: `clamp_mss`). Never in the maps.
pub(super) const SERVICE_FLAG_DECAPSULATED: u32 = 1 << 31;

/// `open_decapsulated`: the packet was not taken out of a tunnel.
pub(super) const NOT_DECAPSULATED: i32 = i32::MIN + 16;

/// The entry node: the client's packet, untranslated, put into IP-in-IP to the flow's
/// endpoint (`to.dst_addr`, its port in the outer header), from the node's own address.
/// A subprogram: the fast path's frames stay as they were.
#[inline(never)]
pub(super) fn encapsulate<F: Family>(ctx: &TcContext, to: &CtValue) -> Result<(), ()> {
    let src = link(0).and_then(|l| F::masquerade_addr(&l)).ok_or(())?;
    let inner_len = (ctx.len() as usize).checked_sub(F::IP_OFF).ok_or(())? as u16;
    let header = F::tunnel_header(&src, &to.dst_addr, inner_len, to.dst_port);
    // No earlier packet's mark stays (one whose verdict never reached `icmp::too_big`).
    if let Ok(mut s) = scratch() {
        s.dsr_too_big = 0;
    }
    // A GSO packet is marked as in a tunnel, for its segmentation; a whole one is not (a
    // packet marked so cannot be cut to the headers `icmp::too_big` answers with).
    // SAFETY: a tc program's context is the packet's __sk_buff.
    let gso = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).gso_size } != 0;
    let flags = if gso { F::TUNNEL_ENCAP_FLAGS } else { 0 };
    if ctx.adjust_room(size_of::<F::Ip>() as i32, BPF_ADJ_ROOM_MAC, flags).is_err() {
        // Refused: maybe past the link's MTU (older kernels), a whole packet the tunnel's
        // header makes too big. `failed` tells, off this chain of calls (the BPF stack).
        if !gso && let Ok(mut s) = scratch() {
            s.dsr_too_big = REFUSED;
            s.dsr_endpoint = to.dst_addr;
        }
        return Err(());
    }
    ctx.store(F::IP_OFF, &header, 0).map_err(drop)
}

/// The endpoint's node, on the way in: a packet in IP-in-IP whose inner packet goes to a
/// frontend with direct server return (its address, or any address at a NodePort: the entry
/// node's), and whose outer header names an endpoint of that frontend on this node, loses its
/// outer header; the slow path learns the endpoint, in case the packet opens a flow
/// (`DsrHint`). The endpoint's port is the model's: the outer header's (`tunnel_port`) only
/// for a frontend of more endpoints than are scanned. Any other packet is left as it is, and
/// so is every packet on a link the local-traffic detector calls a pod's (a pod's link is not
/// a tunnel's end; other pods' links are told by the endpoint check: the tunnel's far end is
/// an endpoint of the frontend on this node). A packet in fragments, outside or in, is not
/// taken out. True: taken out.
#[inline(never)]
pub(super) fn decapsulate<F: Family>(ctx: &TcContext) -> bool {
    let data = ctx.data();
    let inner = data + F::IP_OFF + size_of::<F::Ip>();
    if inner + size_of::<F::Ip>() + 4 > ctx.data_end() {
        return false;
    }
    // SAFETY: both headers and the inner ports, within [data, data_end) (checked above).
    let (outer, ip, ports) = unsafe {
        (
            &*((data + F::IP_OFF) as *const F::Ip),
            &*(inner as *const F::Ip),
            read_word::<[u16; 2]>((inner + size_of::<F::Ip>()) as *const u8),
        )
    };
    if F::l4_proto(outer) != Some(F::TUNNEL_PROTO)
        || F::fragment(outer) != Fragment::Whole
        || F::fragment(ip) != Fragment::Whole
        || link_flags(ifindex(ctx)) & LINK_FLAG_LOCAL_TRAFFIC != 0
    {
        return false;
    }
    let Some(proto) = F::l4_proto(ip) else { return false };
    // An inner source that is the node's own is a martian (`route::martian_source`).
    if node_addr_flags(&F::src(ip)) & NODE_ADDR_LOCAL != 0 {
        return false;
    }
    // The hint is written in the scratch area as it is learnt: this frame is on the attached
    // program's chains of calls (the BPF stack).
    let Ok(s) = scratch() else { return false };
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let hint = unsafe { &mut (*s.as_ptr()).dsr };
    hint.fresh = 0;
    hint.frontend = F::dst(ip);
    let key = ServiceKey { addr: hint.frontend, port: ports[1], proto, scope: SCOPE_EXTERNAL };
    let Some(service) =
        SERVICES.get_ptr(&key).or_else(|| SERVICES.get_ptr(&ServiceKey { addr: key.addr.unspecified_like(), ..key }))
    else {
        return false;
    };
    // SAFETY: a map value pointer, valid for this program run.
    let service = unsafe { &*service };
    if service.flags & SERVICE_FLAG_DSR == 0 {
        return false;
    }
    hint.backend.addr = F::dst(outer);
    hint.backend.port = match local_endpoint_port(service, &hint.backend.addr) {
        NOT_AN_ENDPOINT => return false,
        PAST_THE_SCAN => F::tunnel_port(outer),
        found => found as u16,
    };
    hint.backend.flags = 0;
    hint.service = *service;
    // Not masqueraded here either: the client's address is what the endpoint answers.
    hint.service.flags = (service.flags & !SERVICE_FLAG_SNAT) | SERVICE_FLAG_DECAPSULATED;
    hint.client = F::src(ip);
    hint.client_port = ports[0];
    hint.frontend_port = ports[1];
    hint.proto = proto;
    hint.fresh = 1;
    // 6.3+ also tells the kernel the packet is no longer in a tunnel (a GRO packet's GSO
    // type); before, the flag is unknown and the plain call takes the header off (a GRO
    // packet keeps its tunnel GSO type, harmless for one delivered to a local endpoint).
    let shrink = -(size_of::<F::Ip>() as i32);
    if ctx.adjust_room(shrink, BPF_ADJ_ROOM_MAC, F::TUNNEL_DECAP_FLAGS).is_ok()
        || ctx.adjust_room(shrink, BPF_ADJ_ROOM_MAC, 0).is_ok()
    {
        return true;
    }
    hint.fresh = 0;
    false
}

/// The hint of a packet out of the tunnel, once the slow program is done with it: forgotten,
/// so that no later packet of this CPU takes it.
#[inline(never)]
pub(super) fn forget_hint() {
    if let Ok(mut s) = scratch() {
        s.dsr.fresh = 0;
    }
}

/// A hint of `decapsulate` not used yet: the slow program's packet may be out of a tunnel.
#[inline(never)]
pub(super) fn hint_pending() -> bool {
    scratch().is_ok_and(|s| s.dsr.fresh != 0)
}

/// `FlowScratch::dsr_too_big`: `encapsulate` was refused room for the tunnel's header
/// (`s.dsr_endpoint` the tunnel's far end); then `failed` finds it too big for the route
/// (`TOO_BIG_FOR_TUNNEL`, for `icmp::too_big`), or not (0).
const REFUSED: u32 = 1;
const TOO_BIG_FOR_TUNNEL: u32 = 2;

/// The verdict on a packet (on its way in) whose translation failed: `TOO_BIG` if direct
/// server return's tunnel was refused and the packet, tunnelled, would be too big for the
/// route to the endpoint (its link's MTU in the lookup's answer, 5.12+), for `icmp::too_big`;
/// else passed on untranslated.
#[inline(never)]
pub(super) fn failed<F: Family>(ctx: &TcContext) -> i32 {
    let Ok(mut s) = scratch() else { return PASS };
    if s.dsr_too_big != REFUSED {
        s.dsr_too_big = 0;
        return PASS;
    }
    s.dsr_too_big = 0;
    zero_fib(&raw mut s.fib);
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let (params, endpoint) = unsafe { (&mut (*s.as_ptr()).fib, &(*s.as_ptr()).dsr_endpoint) };
    params.family = F::AF;
    params.ifindex = ifindex(ctx);
    F::fib_dst(params, endpoint);
    // SAFETY: the helper writes within the size it is given.
    let rc = unsafe { fib_lookup(ctx.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, 0) };
    // SAFETY: the lookup's answer (5.12+: the link's MTU; 0 before, and no answer is given).
    let mtu = u32::from(unsafe { params.__bindgen_anon_1.mtu_result });
    let tunnelled_len = ctx.len().saturating_sub(F::IP_OFF as u32) + size_of::<F::Ip>() as u32;
    if rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) && mtu != 0 && tunnelled_len > mtu {
        s.dsr_too_big = TOO_BIG_FOR_TUNNEL;
        return TOO_BIG;
    }
    PASS
}

/// The entry node, a packet too big for direct server return's tunnel (`icmp::too_big`): one
/// that did not go in (`encapsulate`), or one that did and is too big for its route's link,
/// whose outer header comes off again. The link's MTU in the route lookup's answer is lowered
/// by the tunnel's header, for the client's "fragmentation needed". False: not such a packet.
// Inlined: a call from `icmp::too_big` would put a fourth frame on its chain of calls,
// past 6.1's BPF stack (each frame rounded up to 32 bytes there).
#[inline(always)]
pub(super) fn untunnel<F: Family>(ctx: &TcContext) -> bool {
    let Ok(mut s) = scratch() else { return false };
    if s.dsr_too_big != TOO_BIG_FOR_TUNNEL {
        let data = ctx.data();
        if data + F::IP_OFF + size_of::<F::Ip>() > ctx.data_end() {
            return false;
        }
        // SAFETY: within [data, data_end), checked above.
        let outer = unsafe { &*((data + F::IP_OFF) as *const F::Ip) };
        if F::l4_proto(outer) != Some(F::TUNNEL_PROTO) || node_addr_flags(&F::src(outer)) & NODE_ADDR_LOCAL == 0 {
            return false;
        }
        let shrink = -(size_of::<F::Ip>() as i32);
        if ctx.adjust_room(shrink, BPF_ADJ_ROOM_MAC, F::TUNNEL_DECAP_FLAGS).is_err()
            && ctx.adjust_room(shrink, BPF_ADJ_ROOM_MAC, 0).is_err()
        {
            return false;
        }
    }
    s.dsr_too_big = 0;
    // SAFETY: the route lookup's answer, in the scratch area.
    unsafe {
        let mtu = &mut s.fib.__bindgen_anon_1.mtu_result;
        *mtu = mtu.saturating_sub(size_of::<F::Ip>() as u16);
    }
    true
}

/// The slow path of the endpoint's node: a new flow out of the tunnel (`decapsulate`'s hint
/// for this tuple) goes to the endpoint the entry node picked, unmasqueraded (`OPEN`, the
/// service and backend in the scratch area), unless the frontend's source ranges refuse the
/// client. `NOT_DECAPSULATED`: no hint for it.
#[inline(never)]
pub(super) fn open_decapsulated(t: &Tuple) -> i32 {
    let Ok(mut s) = scratch() else { return PASS };
    let hint = &s.dsr;
    if hint.fresh == 0
        || !hint.client.same(&t.saddr)
        || !hint.frontend.same(&t.daddr)
        || hint.client_port != t.sport
        || hint.frontend_port != t.dport
        || hint.proto != t.proto
    {
        return NOT_DECAPSULATED;
    }
    s.dsr.fresh = 0;
    let (service, backend) = (s.dsr.service, s.dsr.backend);
    if source_range_refuses(t, &service) {
        return TC_ACT_SHOT;
    }
    s.service = service;
    s.backend = backend;
    s.reply_csum_diff = addrs_csum_diff::<Addr>(&backend.addr, &t.saddr, &t.daddr, &t.saddr);
    OPEN
}

/// The endpoint's node: the endpoint's SYN-ACK of a flow that came out of the tunnel
/// announces a segment size with room for the tunnel's header, which the client's segments
/// get on their way through the entry node (the client's MSS option, first among the
/// options as every stack sends it; the checksum fixed by the kernel).
#[inline(never)]
pub(super) fn clamp_mss<F: Family>(ctx: &TcContext, proto: u8) {
    if proto != IPPROTO_TCP {
        return;
    }
    let data = ctx.data();
    let option = data + F::L4_OFF + 20;
    if option + 4 > ctx.data_end() {
        return;
    }
    // SAFETY: the TCP header and its first option, within [data, data_end) (checked above).
    let (offset, kind, mss) = unsafe {
        (
            *((data + F::L4_OFF + 12) as *const u8) >> 4,
            read_word::<[u8; 2]>(option as *const u8),
            u16::from_be(read_word::<u16>((option + 2) as *const u8)),
        )
    };
    // An MSS option (kind 2, length 4) inside the header.
    let room = size_of::<F::Ip>() as u16;
    if offset < 6 || kind != [2, 4] || mss <= room {
        return;
    }
    let (old, new) = (mss.to_be(), (mss - room).to_be());
    if ctx.l4_csum_replace(F::L4_OFF + 16, u64::from(old), u64::from(new), 2).is_err() {
        return;
    }
    let data = ctx.data();
    if data + F::L4_OFF + 24 > ctx.data_end() {
        return;
    }
    // SAFETY: within [data, data_end), checked above.
    unsafe { write_word((data + F::L4_OFF + 22) as *mut u8, new) };
}
