//! Where a translated packet goes: the source check before a redirect, the route lookup and
//! the route kept in a flow's entry, and the redirect itself (peer, neighbour).
use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        __sk_buff, BPF_FIB_LKUP_RET_BLACKHOLE, BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH,
        BPF_FIB_LKUP_RET_PROHIBIT, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LKUP_RET_UNREACHABLE, BPF_FIB_LOOKUP_SKIP_NEIGH,
        TC_ACT_OK, bpf_fib_lookup, bpf_redir_neigh, bpf_redir_neigh__bindgen_ty_1,
    },
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect_neigh, bpf_redirect_peer},
    programs::TcContext,
};
use proxy_common::{
    CachedRoute, LINK_FLAG_ACCEPT_LOCAL_SET, LINK_FLAG_NOT_ETHERNET, LINK_FLAG_PEER, LINK_FLAG_RP_FILTER_LOOSE,
    LINK_FLAG_RP_FILTER_STRICT, NODE_ADDR_LOCAL, counter, ct,
};

use super::{
    parse::Tuple,
    scratch::{FlowScratch, Scratch, scratch},
    verdict::TOO_BIG,
};
use crate::{
    family::Family,
    globals::{KPR_FORWARD_DIRECT, KPR_REDIRECT_NEXT_HOP},
    maps::{FlowTables, LINKS, count, host_lets_direct, in_addr_filter, link_flags, node_addr_flags, now},
    packet::{WordAligned, write_word},
};

/// A packet that arrives with one of the node's own addresses as source, on a link where kpr
/// turned `accept_local` on (`LINK_FLAG_ACCEPT_LOCAL_SET`): a martian, which the kernel would
/// drop there without kpr. `accept_local` is for kpr's own masqueraded packets, which have the
/// node's address once translated; it must not let a pod, or a machine outside, send as the
/// node. One array read for most packets (the address filter), a hash lookup for the node's.
#[inline(always)]
pub(super) fn martian_source<F: Family>(ctx: &TcContext) -> bool {
    if !F::KERNEL_CHECKS_SOURCE {
        return false;
    }
    let data = ctx.data();
    let src = if data + F::IP_OFF + size_of::<F::Ip>() <= ctx.data_end() {
        // SAFETY: within [data, data_end), checked above; the header is plain bytes.
        F::src(unsafe { &*((data + F::IP_OFF) as *const F::Ip) })
    } else {
        match ctx.load::<F::Ip>(F::IP_OFF).map(WordAligned) {
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

/// Send a translated packet of an established flow out by the route its entry keeps
/// (`cached`), here rather than in `forward_direct`: most packets of a flow go this way, and
/// the stage's call, scratch lookup and bounds checks are saved on each. None: the packet is
/// `forward_direct`'s (its TTL runs out, or it is too big for the link: the stack decides).
#[inline(always)]
pub(super) fn redirect_by<F: Family>(ctx: &TcContext, cached: &CachedRoute, mut s: Scratch) -> Option<i32> {
    let data = ctx.data();
    if data + F::IP_OFF + size_of::<F::Ip>() > ctx.data_end() {
        return None;
    }
    // SAFETY: within [data, data_end), checked above.
    let ip = unsafe { &*((data + F::IP_OFF) as *const F::Ip) };
    if F::hops(ip) <= 1 || !fits_link::<F>(ctx, cached.mtu) {
        return None;
    }
    // SAFETY: within [data, data_end), checked above; the scratch value.
    unsafe {
        F::decrement_hops((data + F::IP_OFF) as *mut u8);
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
        let nh = &raw mut s.next_hop;
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
pub(super) fn route_hint<F: Family>(cacheable: bool, kept: &CachedRoute, now: u64) -> u32 {
    if !F::ETHERNET || !cacheable || KPR_FORWARD_DIRECT.load() == 0 || KPR_REDIRECT_NEXT_HOP.load() == 0 {
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

/// The kernel's reverse path filter (IPv4 `rp_filter`), on a new flow's first packet where
/// its link has it (`LINK_FLAG_RP_FILTER_*`): kpr translates the packet (and may masquerade it
/// or send it straight out) before the kernel's routing would check its source, so a pod
/// could otherwise send as another pod through a Service. Strict: the route back to the
/// source leaves by this link; loose: there is a route back. A packet of an established flow
/// is not checked again (its tuple is that of a flow whose first packet was).
#[inline(never)]
pub(super) fn reverse_path_ok<F: Family>(ctx: &TcContext, t: &Tuple) -> bool {
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
    let Ok(mut s) = scratch() else { return true };
    // A new flow's masquerade lookup, later, zeroes it again.
    zero_fib(&raw mut s.fib);
    let params = &mut s.fib;
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

/// Look the route up (a packet of a new flow or of one not yet answered).
pub(super) const ROUTE_LOOK_UP: u32 = 0;

/// The route kept in the flow's entry (`CtValue::route`) serves: `translate_tracked` sends the packet
/// out by it (`redirect_by`); a packet it could not send is looked up.
pub(super) const ROUTE_CACHED: u32 = 1;

/// Look the route up and keep it in the flow's entry (under `s.flow_key`).
const ROUTE_LOOK_UP_AND_CACHE: u32 = 2;

/// `s.fib` holds this packet's route: looked up for a new flow's masquerade address as
/// `forward_direct` would have (6.3+), it sends the packet by that answer.
pub(super) const ROUTE_LOOKED_UP: u32 = 3;

/// A new flow's first packet on its way in: a masquerade lookup may keep its answer for it
/// (`ROUTE_LOOKED_UP`); else `forward_direct` looks it up and keeps the answer in the new
/// flow's entry (`keep_route`).
pub(super) const ROUTE_MAY_KEEP: u32 = 4;

/// The link the program runs on.
#[inline(always)]
pub(super) fn ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: a tc program's context is the packet's __sk_buff.
    unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ifindex }
}

/// Zero a route lookup's parameters word by word: `mem::zeroed` compiles to a call of
/// `memset`, a subprogram, which costs a call on the packets that look their route up and a
/// frame of 32 bytes on 6.1's BPF stack (its verifier rounds an empty frame up).
#[inline(always)]
pub(crate) fn zero_fib(params: *mut bpf_fib_lookup) {
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
/// off, a link without Ethernet such as an IP-in-IP tunnel, too big for the link, a TTL or hop
/// limit running out) goes on into the host stack,
/// which handles it as it would have without kpr; but a packet too big for its link is
/// `TOO_BIG`, for `icmp::too_big` (which answers it if it was masqueraded).
///
/// An established flow's entry keeps the lookup's answer (6.3+, with the next hop): for about
/// a second, its packets that fit the link are sent out by `translate_tracked` without it.
#[inline(never)]
pub(super) fn forward_direct<F: Family>(ctx: &TcContext) -> i32 {
    let Ok(s) = scratch().map(Scratch::as_ptr) else { return TC_ACT_OK };
    // SAFETY: the per-CPU scratch value, valid for this program run; the hint is taken back
    // so that no later packet sees it.
    let route = unsafe { core::mem::replace(&mut (*s).route, ROUTE_LOOK_UP) };
    let data = ctx.data();
    if data + F::IP_OFF + size_of::<F::Ip>() > ctx.data_end() {
        return TC_ACT_OK;
    }
    // SAFETY: within [data, data_end), checked above; read in place (a copy would be a load
    // and a store per byte).
    let ip = unsafe { &*((data + F::IP_OFF) as *const F::Ip) };
    if F::hops(ip) <= 1 {
        return TC_ACT_OK; // the stack answers with "time exceeded"
    }
    // Something filters forwarded packets (a NetworkPolicy in the FORWARD chain), or
    // `--forward-direct never`: the host's forwarding path, as for kube-proxy's traffic. An
    // established flow's kept route stops serving at the end of its period, when its next
    // packet comes here.
    if KPR_FORWARD_DIRECT.load() == 0 || !host_lets_direct() {
        return too_big_for_the_host_path::<F>(ctx, s, ip);
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
        if rc == i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED) {
            // The link's MTU stays in the lookup's answer, for `too_big`.
            return TOO_BIG;
        }
        if rc != i64::from(BPF_FIB_LKUP_RET_SUCCESS) && rc != i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
            return TC_ACT_OK;
        }
        let out = link_flags(params.ifindex);
        if out & LINK_FLAG_NOT_ETHERNET != 0 {
            return TC_ACT_OK;
        }
        if rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
            // SAFETY: the per-CPU scratch value.
            unsafe { (*s).fib_peer = u32::from(peer_route::<F>(ctx, params, out)) };
            keep_route::<F::FlowAddr>(s, route, next_hop, params);
        }
    } else if peer_route::<F>(ctx, params, link_flags(params.ifindex)) {
        // The masquerade lookup's answer, which `create_flow` kept in the new flow's entry as
        // a next hop (here, off the chains of calls through the masquerade lookup): a peer
        // link's MAC addresses take its place.
        // SAFETY: the per-CPU scratch value.
        unsafe { (*s).fib_peer = 1 };
        keep_route::<F::FlowAddr>(s, ROUTE_MAY_KEEP, next_hop, params);
    }
    // Forwarding takes one off the TTL; the lookup did not move the packet, but the bounds are
    // checked again for the verifier.
    let data = ctx.data();
    if data + F::IP_OFF + size_of::<F::Ip>() > ctx.data_end() {
        return TC_ACT_OK;
    }
    // SAFETY: within [data, data_end), checked above.
    unsafe { F::decrement_hops((data + F::IP_OFF) as *mut u8) };
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

/// A translated packet the host's forwarding path takes: `TOO_BIG` if it is masqueraded, may
/// not be cut into fragments and is too big for the link its route leaves by. The kernel checks
/// a forwarded packet against the link's MTU before the FORWARD hook and answers "fragmentation
/// needed" to its source, which, masqueraded, is the node itself: the answer would be lost.
/// `too_big` answers the client instead, as on the direct path. For a packet larger than the
/// smallest link may be, that may not be fragmented: a hash lookup (the masquerade source),
/// and a route lookup if it is masqueraded.
#[inline(always)]
fn too_big_for_the_host_path<F: Family>(ctx: &TcContext, s: *mut FlowScratch, ip: &F::Ip) -> i32 {
    // SAFETY: a tc program's context is the packet's __sk_buff.
    let skb = unsafe { &*(ctx.as_ptr() as *const __sk_buff) };
    // Segmented to the link's size, small enough for any link, or fragmented by the stack.
    if skb.gso_size != 0 || skb.len <= F::MIN_MTU + F::IP_OFF as u32 || F::may_fragment(ip) {
        return TC_ACT_OK;
    }
    if node_addr_flags(&F::src(ip)) & NODE_ADDR_LOCAL == 0 {
        return TC_ACT_OK; // not masqueraded: the stack's answer reaches the client
    }
    // SAFETY: the per-CPU scratch value, every byte written.
    let params = unsafe { &mut (*s).fib };
    zero_fib(params);
    params.family = F::AF;
    params.ifindex = ifindex(ctx);
    F::fib_params(params, ip);
    // tot_len 0: checked against the packet (GSO aware); the link's MTU stays in the answer.
    let rc = unsafe { fib_lookup(ctx.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, 0) };
    if rc == i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED) { TOO_BIG } else { TC_ACT_OK }
}

/// Would the kernel forward this packet to a link of MTU `mtu` (`is_skb_forwardable`)? GSO
/// packets are cut to size later.
#[inline(always)]
fn fits_link<F: Family>(ctx: &TcContext, mtu: u16) -> bool {
    // SAFETY: a tc program's context is the packet's __sk_buff.
    let skb = unsafe { &*(ctx.as_ptr() as *const __sk_buff) };
    skb.gso_size != 0 || skb.len <= u32::from(mtu) + F::IP_OFF as u32
}

/// Keep a successful route lookup (with the link's MTU, which the kernel reports from 5.12 on)
/// in the entry of the flow this packet was translated by, if it still is (another CPU may
/// have replaced it since): an established flow's, or an answered one's awaiting the client's
/// ACK (`ROUTE_LOOK_UP_AND_CACHE`, under `s.flow_key`), or the new flow's this packet opened (`ROUTE_MAY_KEEP`, under `s.key`, with
/// 6.3+'s next hop; the route moves with the entry at the answer, as `create_flow`'s
/// masquerade lookup does).
#[inline(always)]
pub(super) fn keep_route<A: FlowTables>(s: *mut FlowScratch, route: u32, next_hop: bool, params: &bpf_fib_lookup) {
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
pub(super) unsafe fn keep_in(route: *mut CachedRoute, params: &bpf_fib_lookup, peer: bool, now: u64) {
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

/// After a successful route lookup (`params`, the scratch area's): does its link (whose
/// `KPR_LINKS` flags are `out_flags`) hand packets to a pod's end of a veth pair
/// (`LINK_FLAG_PEER`)? Then the packet goes to that end at once
/// (`bpf_redirect_peer`) with the MAC addresses a transmission would give it: the next hop's
/// and the link's, in `params` when this says yes. A 6.3+ lookup skips the neighbour (for the
/// next hop of `bpf_redirect_neigh`): looked up again without skipping it. No (the neighbour
/// is not resolved yet, or the route is not the same): the link's neighbour path, as for any
/// link.
#[inline(always)]
pub(super) fn peer_route<F: Family>(ctx: &TcContext, params: &mut bpf_fib_lookup, out_flags: u32) -> bool {
    if params.family != F::AF || out_flags & LINK_FLAG_PEER == 0 {
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
