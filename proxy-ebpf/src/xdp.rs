//! XDP in front of tc on the node's external links (`--xdp`): a packet of an established flow
//! whose translated packet leaves by the link it came in on (NodePort, externalIP and
//! LoadBalancer traffic to an endpoint on another node, and its replies) is translated and
//! sent back out of the driver (`XDP_TX`), before the kernel allocates an skb for it; with
//! direct server return, the entry node's packet of such a flow is put in its tunnel instead.
//!
//! Everything else is passed on (`XDP_PASS`) untouched, to the tc programs, which do what they
//! did without XDP: new flows, SYNs, FINs and RSTs (they change a flow's state), flows whose
//! entry is due for a refresh (tc's table path refreshes it), fragments, IP options and IPv6
//! extension headers, the endpoint's side of direct server return, local endpoints, packets
//! whose route leaves by another link, too big for it, or whose TTL runs out, and anything
//! while the host filters forwarded packets (`KPR_FORWARD_DIRECT`, `host_lets_direct`: a
//! NetworkPolicy in the FORWARD chain holds for these flows as for kube-proxy's).
//!
//! The flow's entry comes from the per-CPU flow cache tc fills (`flow_cache::peek`), else from
//! the conntrack tables, read only (an entry due for a refresh is tc's). The route lookup's
//! answer is kept per CPU for its period (`KeptRoute`). Checksums are changed as a complete
//! checksum's: packets from a wire carry one; a veth peer must send them so (its transmit
//! checksum offload off), as the tests and the bench set it.
use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup, xdp_action},
    btf_maps::PerCpuArray,
    helpers::{bpf_fib_lookup as fib_lookup, bpf_xdp_adjust_head},
    macros::{btf_map, xdp},
    programs::XdpContext,
};
use proxy_common::{
    Addr, CtKey, CtValue, IPPROTO_TCP, IPPROTO_UDP, NODE_ADDR_LOCAL, counter,
    csum::{self, kernel::mangled},
    ct,
};

use crate::{
    family::{Family, Fragment, V4, V6},
    flow_cache,
    globals::KPR_FORWARD_DIRECT,
    maps::{FlowTables, count, host_lets_direct, in_addr_filter, link, node_addr_flags, now},
    packet::{TCP_CSUM, TCP_FIN, TCP_FLAGS, TCP_RST, TCP_SYN, UDP_CSUM, read_word, write_word},
    stats,
    tc::{expired, ports_word, zero_fib},
};

const PASS: u32 = xdp_action::XDP_PASS;

/// A route lookup's answer kept for the packets after it (`bpf_fib_lookup` is most of the
/// program's cost, over 100 ns for IPv4 and 250 for IPv6): for the same source, destination
/// and incoming link, in the same period of the clock (about a second, as tc's kept routes),
/// for packets no longer than one the lookup passed.
#[repr(C)]
#[derive(Clone, Copy)]
struct KeptRoute {
    src: Addr,
    dst: Addr,
    ingress: u32,
    period: u32,
    /// The longest packet (IP total length) the lookup found within the route's MTU.
    fits: u32,
    /// The destination's and the link's MAC addresses.
    macs: [u8; 12],
    _pad: [u8; 8],
}

const KEPT_ROUTES: u32 = 1024;

/// Per CPU, direct-mapped by a hash of the addresses (a collision costs a lookup, never a
/// wrong route: the addresses and the link are compared). Not pinned: it starts empty with
/// each program.
#[btf_map(name = "KPR_XDP_ROUTES")]
static KEPT: PerCpuArray<KeptRoute, { KEPT_ROUTES as usize }> = PerCpuArray::new();
/// The L4 header lengths read: TCP's without options, UDP's.
const TCP_LEN: usize = 20;
const UDP_LEN: usize = 8;

#[xdp]
pub fn kpr_xdp(ctx: XdpContext) -> u32 {
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + 14 > end {
        return PASS;
    }
    // SAFETY: within [data, data_end), checked above. A VLAN tag in the data is not IP: passed.
    let eth_type: u16 = unsafe { read_word((data + 12) as *const u8) };
    match eth_type {
        t if t == <V4>::ETH_TYPE => forward::<V4>(&ctx),
        t if t == <V6>::ETH_TYPE => forward::<V6>(&ctx),
        _ => PASS,
    }
}

/// The packet translated and sent back out (`XDP_TX`), or passed on untouched.
#[inline(always)]
fn forward<F: Family>(ctx: &XdpContext) -> u32 {
    if KPR_FORWARD_DIRECT.load() == 0 || !host_lets_direct() {
        return PASS;
    }
    let (data, end) = (ctx.data(), ctx.data_end());
    // The IP header and a UDP header's worth of L4 (a TCP header's is checked below).
    if data + F::L4_OFF + UDP_LEN > end {
        return PASS;
    }
    // SAFETY: within [data, data_end), checked above; read in place.
    let ip = unsafe { &*((data + F::IP_OFF) as *const F::Ip) };
    let Some(proto) = F::l4_proto(ip) else { return PASS };
    if !matches!(F::fragment(ip), Fragment::Whole) || F::hops(ip) <= 1 {
        return PASS;
    }
    let l4 = (data + F::L4_OFF) as *const u8;
    // SAFETY: within [data, data_end), checked above.
    let ports = unsafe { read_word::<u32>(l4) };
    match proto {
        IPPROTO_TCP if data + F::L4_OFF + TCP_LEN <= end => {
            // SAFETY: within [data, data_end), checked above.
            if unsafe { l4.add(TCP_FLAGS).read() } & (TCP_SYN | TCP_FIN | TCP_RST) != 0 {
                return PASS;
            }
        }
        IPPROTO_UDP => {}
        _ => return PASS,
    }
    let (saddr, daddr) = (F::src(ip), F::dst(ip));
    // A packet sent as one of the node's own addresses is the martian check's (tc).
    if in_addr_filter(&saddr) && node_addr_flags(&saddr) & NODE_ADDR_LOCAL != 0 {
        return PASS;
    }
    let (sport, dport) = split_ports(ports);
    let mut key = KeySlot::<F::FlowAddr>(core::mem::MaybeUninit::uninit());
    // SAFETY: a key on the stack, 8-byte aligned; every word written.
    let key = unsafe {
        CtKey::write_words(key.0.as_mut_ptr(), &saddr, &daddr, sport, dport, proto);
        key.0.assume_init_ref()
    };
    let now = now();
    let bytes = (end - data) as u64;
    let cached = flow_cache::peek(key, flow_cache::generation(), now);
    let entry = match cached {
        // SAFETY: a map value of this CPU's, valid for this program run.
        Some(slot) => unsafe { &(*slot).entry },
        None => match serving_entry::<F::FlowAddr>(key, proto, now) {
            Some(entry) => entry,
            None => return PASS,
        },
    };
    let ifindex = ctx.ingress_ifindex() as u32;
    let tot_len = u32::from(F::l4_len(ip)) + size_of::<F::Ip>() as u32;
    if entry.flags & ct::DSR != 0 {
        // Direct server return: the client's entry on the entry node puts the packet in its
        // tunnel; the endpoint's node's replies are tc's (they leave by a pod's link).
        if entry.flags & ct::REPLY != 0 || !tunnel::<F>(ctx, ip, entry, ifindex, tot_len, now) {
            return PASS;
        }
    } else if !translate::<F>(ctx, ip, entry, ports, proto, ifindex, tot_len, now) {
        return PASS;
    }
    match cached {
        // Counted in the slot, as tc's hits are (`flow_cache::probe`).
        // SAFETY: as above.
        Some(slot) => unsafe {
            (*slot).packets += 1;
            (*slot).bytes += bytes;
        },
        None => stats::flow_packet(entry, &saddr, sport, proto, bytes),
    }
    count(counter::XDP_FORWARDED);
    xdp_action::XDP_TX
}

/// The packet translated as `entry` says, if its route leaves by the link it came in on
/// (`ifindex`): with its neighbour known and within the link's MTU.
#[inline(always)]
fn translate<F: Family>(
    ctx: &XdpContext,
    ip: &F::Ip,
    entry: &CtValue,
    ports: u32,
    proto: u8,
    ifindex: u32,
    tot_len: u32,
    now: u64,
) -> bool {
    let Some(macs) = route::<F>(ctx, ip, &entry.src_addr, &entry.dst_addr, ifindex, tot_len, now) else {
        return false;
    };
    // The bounds again, for the verifier (the helper does not move the packet).
    let (data, end) = (ctx.data(), ctx.data_end());
    // SAFETY (both): within [data, data_end), checked just before.
    if proto == IPPROTO_TCP {
        if data + F::L4_OFF + TCP_LEN > end {
            return false;
        }
        unsafe { rewrite::<F, TCP_CSUM>(data as *mut u8, entry, ports, false, &macs) };
    } else {
        if data + F::L4_OFF + UDP_LEN > end {
            return false;
        }
        unsafe { rewrite::<F, UDP_CSUM>(data as *mut u8, entry, ports, true, &macs) };
    }
    true
}

/// Direct server return at the entry node: the client's packet, untranslated, put in IP-in-IP
/// to the flow's endpoint (`to.dst_addr`, its port in the outer header) from the node's own
/// address, as tc's `dsr::encapsulate` and its direct path make it (the outer header's TTL
/// one less), if the outer packet's route leaves by this link within its MTU (else tc's,
/// which answers "fragmentation needed").
#[inline(always)]
fn tunnel<F: Family>(ctx: &XdpContext, ip: &F::Ip, to: &CtValue, ifindex: u32, inner_len: u32, now: u64) -> bool {
    let Some(src) = link(0).and_then(|l| F::masquerade_addr(&l)) else { return false };
    let outer_len = inner_len + size_of::<F::Ip>() as u32;
    let Some(macs) = route::<F>(ctx, ip, &src, &to.dst_addr, ifindex, outer_len, now) else { return false };
    let header = F::tunnel_header(&src, &to.dst_addr, inner_len as u16, to.dst_port);
    // SAFETY: the program's context; room in front of the packet (XDP's headroom).
    if unsafe { bpf_xdp_adjust_head(ctx.ctx, -(size_of::<F::Ip>() as i32)) } != 0 {
        return false;
    }
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + F::IP_OFF + size_of::<F::Ip>() > end {
        // Cannot be: the packet just grew by the header. (Passed as it is now, it would go on
        // to tc without its Ethernet header.)
        return false;
    }
    // SAFETY: within [data, data_end), checked above: the Ethernet header and the outer one
    // (the old Ethernet header's place), then the packet as it came.
    unsafe {
        let data = data as *mut u8;
        for (i, byte) in macs.iter().enumerate() {
            data.add(i).write(*byte);
        }
        write_word(data.add(12), F::ETH_TYPE);
        data.add(F::IP_OFF).cast::<F::Ip>().write_unaligned(header);
        F::decrement_hops(data.add(F::IP_OFF));
    }
    true
}

/// The MAC addresses (the destination's, the link's) of the translated packet's route, if it
/// leaves by the link it came in on: kept (`KeptRoute`), or looked up and kept.
#[inline(always)]
fn route<F: Family>(
    ctx: &XdpContext,
    ip: &F::Ip,
    src: &Addr,
    dst: &Addr,
    ifindex: u32,
    tot_len: u32,
    now: u64,
) -> Option<[u8; 12]> {
    let period = (now >> ct::ROUTE_PERIOD_SHIFT) as u32;
    let [s0, s1, s2, s3] = src.0;
    let [d0, d1, d2, d3] = dst.0;
    let hash = (s0 ^ s1 ^ s2 ^ s3).wrapping_mul(0x9E37_79B1) ^ (d0 ^ d1 ^ d2 ^ d3).wrapping_mul(0x85EB_CA77);
    let kept = KEPT.get_ptr_mut(hash >> (32 - KEEP_BITS))?;
    // SAFETY: a map value of this CPU's, valid for this program run.
    let kept = unsafe { &mut *kept };
    if kept.period == period
        && kept.ingress == ifindex
        && tot_len <= kept.fits
        && kept.src.same(src)
        && kept.dst.same(dst)
    {
        return Some(kept.macs);
    }
    let mut params = core::mem::MaybeUninit::<bpf_fib_lookup>::uninit();
    let params = params.as_mut_ptr();
    zero_fib(params);
    // SAFETY: zeroed above, every byte.
    let params = unsafe { &mut *params };
    params.family = F::AF;
    params.ifindex = ifindex;
    params.l4_protocol = F::next_header(ip);
    params.__bindgen_anon_1.tot_len = tot_len as u16;
    F::fib_tos(params, ip);
    F::fib_src(params, src);
    F::fib_dst(params, dst);
    // SAFETY: the program's context and a parameter block of the helper's size.
    let rc = unsafe { fib_lookup(ctx.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, 0) };
    if rc != i64::from(BPF_FIB_LKUP_RET_SUCCESS) || params.ifindex != ifindex {
        return None;
    }
    // SAFETY: the lookup's answer, the MAC addresses' member of its union.
    let found = unsafe { &params.__bindgen_anon_6.__bindgen_anon_2 };
    let mut macs = [0u8; 12];
    macs[..6].copy_from_slice(&found.dmac);
    macs[6..].copy_from_slice(&found.smac);
    let fits = if kept.period == period && kept.src.same(src) && kept.dst.same(dst) {
        kept.fits.max(tot_len)
    } else {
        tot_len
    };
    *kept = KeptRoute { src: *src, dst: *dst, ingress: ifindex, period, fits, macs, _pad: [0; 8] };
    Some(macs)
}

/// `KEPT_ROUTES` as bits of the hash.
const KEEP_BITS: u32 = KEPT_ROUTES.trailing_zeros();

/// A flow key on the stack, 8-byte aligned as `CtKey::write_words` writes it (the verifier
/// refuses misaligned stack access).
#[repr(C, align(8))]
struct KeySlot<A>(core::mem::MaybeUninit<CtKey<A>>);

/// How long past its refresh's time XDP still serves an entry from the table: tc reads its
/// clock once a tick (`now_by_tick`), up to a tick behind XDP's, and refreshes an entry only
/// once its own clock says so. Without the slack, for up to a tick each second XDP would pass
/// a flow's packets to tc, which would neither refresh the entry nor send them differently.
const REFRESH_SLACK_NS: u64 = 20_000_000;

/// The established table's entry of `key` (or direct server return's, among the new flows) if
/// XDP may translate by it as it is: live, not overdue for its refresh (which tc's table path
/// does), answered, not closing, its endpoint alive.
#[inline(always)]
fn serving_entry<'a, A: FlowTables>(key: &CtKey<A>, proto: u8, now: u64) -> Option<&'a CtValue> {
    // Direct server return's entries stay among the new flows (`conntrack::seen_bits`); any
    // other flow there is not established yet, and tc's.
    let entry = match A::established().get_ptr(key) {
        Some(entry) => entry,
        // SAFETY: a map value pointer, valid for this program run.
        None => A::new_flows().get_ptr(key).filter(|e| unsafe { (**e).flags } & ct::DSR != 0)?,
    };
    // SAFETY: a map value pointer, valid for this program run.
    let entry = unsafe { &*entry };
    let refreshed = now.saturating_sub(entry.last_seen) < ct::REFRESH_NS + REFRESH_SLACK_NS;
    let settled = entry.flags & (ct::ENDPOINT_DEAD | ct::FIN_ORIG | ct::FIN_REPLY | ct::RST) == 0
        && (entry.flags & ct::REPLY == 0 || entry.flags & ct::SEEN_REPLY != 0);
    (refreshed && settled && !expired(proto, entry, now)).then_some(entry)
}

/// The ports word's two ports, as they are in the packet.
#[inline(always)]
fn split_ports(word: u32) -> (u16, u16) {
    if cfg!(target_endian = "little") { (word as u16, (word >> 16) as u16) } else { ((word >> 16) as u16, word as u16) }
}

/// Translate the packet as `to` says, its checksums changed incrementally (complete ones), the
/// TTL one down, and the route's MAC addresses (`macs`: destination, source).
///
/// # Safety
/// `data` is the packet's start, with its IP header and L4 up to the checksum at `CSUM_OFF`
/// within bounds.
#[inline(always)]
unsafe fn rewrite<F: Family, const CSUM_OFF: usize>(
    data: *mut u8,
    to: &CtValue,
    old_ports: u32,
    udp: bool,
    macs: &[u8; 12],
) {
    let new_ports = ports_word(to.src_port, to.dst_port);
    // SAFETY: within the bounds the caller checked.
    let ip = unsafe { &*data.add(F::IP_OFF).cast::<F::Ip>() };
    let addrs_changed = !(F::same_addr(&to.src_addr, &F::src(ip)) && F::same_addr(&to.dst_addr, &F::dst(ip)));
    let mut diff = if addrs_changed { u64::from(to.addrs_csum_diff) } else { 0 };
    if old_ports != new_ports {
        diff += csum::word_diff(old_ports, new_ports);
    }
    // SAFETY: within the bounds the caller checked.
    unsafe {
        let field = data.add(F::L4_OFF + CSUM_OFF);
        let check: u16 = read_word(field);
        // A UDP checksum of 0 means "none" (IPv4) and stays 0; one that sums to 0 is sent as
        // 0xffff.
        if !(udp && check == 0) {
            write_word(field, mangled(csum::replace(check, diff), udp));
        }
        if addrs_changed {
            F::write_addrs(data.add(F::IP_OFF), &to.src_addr, &to.dst_addr, u64::from(to.addrs_csum_diff));
        }
        write_word(data.add(F::L4_OFF), new_ports);
        F::decrement_hops(data.add(F::IP_OFF));
        for (i, byte) in macs.iter().enumerate() {
            data.add(i).write(*byte);
        }
    }
}
