//! Reading a packet: its family, headers and flow tuple, and what its TCP flags (or SCTP
//! chunks) say of its flow's state.
use core::mem::MaybeUninit;

use aya_ebpf::{EbpfContext as _, bindings::__sk_buff, programs::TcContext};
use proxy_common::{Addr, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, LINK_FLAG_TC_INGRESS, counter};

use super::{
    frag::later_fragment,
    verdict::{A_FLOW, AN_ICMP_ERROR, PASS},
};
use crate::{
    family::{Family, Fragment},
    maps::{LINKS, ServiceRangeMiss, count, in_addr_filter, service_range_miss},
    packet::{SCTP_CHUNK_TYPE, TCP_ACK, TCP_FIN, TCP_FLAGS, TCP_RST, TCP_SYN, WordAligned, read_word},
};

/// Did this packet come in by a link where kpr's ingress program ran (`LINK_FLAG_TC_INGRESS`)?
/// Forwarded, redirected or hairpinned: whatever it needed was done there. Packets of the node
/// itself (no ingress link) are the egress program's.
#[inline(always)]
pub(super) fn came_through_ingress(ctx: &TcContext) -> bool {
    // SAFETY: a tc program's context is the packet's __sk_buff.
    let iif = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ingress_ifindex };
    // SAFETY: a map value pointer, read at once.
    iif != 0 && LINKS.get_ptr(&iif).is_some_and(|link| unsafe { (*link).flags } & LINK_FLAG_TC_INGRESS != 0)
}

/// The packet carries a VLAN tag outside its data (taken off on the way in, or to be put on by
/// the device on the way out): it is a VLAN sub-interface's (`eth0.100`), whose own program
/// sees it untagged; translated here, on the parent, it would keep its tag wherever it went.
/// A tag inside the data shows as the EtherType, which is not IP.
#[inline(always)]
pub(super) fn vlan_tagged(ctx: &TcContext) -> bool {
    // SAFETY: a tc program's context is the packet's __sk_buff.
    unsafe { (*(ctx.as_ptr() as *const __sk_buff)).vlan_present != 0 }
}

/// The Ethernet type, read straight from the packet.
#[inline(always)]
pub(super) fn eth_type(ctx: &TcContext) -> Option<u16> {
    let at = ctx.data() + 12;
    if at + 2 > ctx.data_end() {
        return ctx.load::<u16>(12).ok();
    }
    // SAFETY: bounds checked against data_end.
    Some(unsafe { read_word(at as *const u8) })
}

/// On a link without Ethernet: the packet's protocol (`skb->protocol`, an EtherType in network
/// byte order, as [`eth_type`] reads it).
#[inline(always)]
pub(super) fn l3_protocol(ctx: &TcContext) -> u16 {
    // SAFETY: a tc program's context is the packet's __sk_buff.
    unsafe { (*(ctx.as_ptr() as *const __sk_buff)).protocol as u16 }
}

/// Whether the packet is a probe of `kpr verify` (its mark, given in `BPF_PROG_TEST_RUN`'s
/// context): one the agent made to check the programs against its maps.
#[inline(always)]
pub(super) fn is_probe(ctx: &TcContext) -> u8 {
    // SAFETY: a tc program's context is the packet's __sk_buff.
    u8::from(unsafe { (*(ctx.as_ptr() as *const __sk_buff)).mark } == proxy_common::VERIFY_PROBE_MARK)
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
    /// 1: a probe of `kpr verify` (`proxy_common::VERIFY_PROBE_MARK`), set on the slow path
    /// only: its flow, events and service counts are not traffic. In the padding after
    /// `proto`: the tuple is no bigger.
    pub probe: u8,
    /// The first fragment of a datagram in fragments: its IP id (as in the packet); else
    /// `NOT_A_FIRST_FRAGMENT`. A plain integer, not an `Option`: an empty option's payload is
    /// undefined, which the compiler may store from any register, and 6.1's verifier refuses a
    /// pointer stored in two bytes.
    pub first_fragment: u32,
    /// The length of the L4 header and payload.
    pub l4_len: u16,
}

/// [`Tuple::first_fragment`] of a packet that is not a datagram's first fragment.
pub(super) const NOT_A_FIRST_FRAGMENT: u32 = u32::MAX;

/// The IP header and L4 ports, read in place from the packet (no helper calls, no copy: a
/// copy would be a load and a store per byte); headers outside the linear area are pulled in
/// first. Plain bytes (alignment 1): the packet gives no alignment.
#[repr(C)]
pub(super) struct Headers<Ip> {
    pub(super) ip: Ip,
    pub(super) ports: [[u8; 2]; 2],
}

/// The packet's headers (at `F::IP_OFF`), valid until a helper changes the packet.
#[inline(always)]
pub(super) fn headers<'a, F: Family>(ctx: &TcContext) -> Option<&'a Headers<F::Ip>> {
    let len = F::IP_OFF + size_of::<Headers<F::Ip>>();
    if ctx.data() + len > ctx.data_end() {
        // Short or non-linear: pull what we need into the linear area (fails if too short).
        ctx.pull_data(len as u32).ok()?;
        if ctx.data() + len > ctx.data_end() {
            return None;
        }
    }
    // SAFETY: bounds checked against data_end above; Headers is plain bytes of alignment 1.
    Some(unsafe { &*((ctx.data() + F::IP_OFF) as *const Headers<F::Ip>) })
}

/// What a packet tells of its flow's state, as TCP flags (SCTP's chunks in their terms).
#[inline(always)]
pub(super) fn flow_flags<F: Family>(ctx: &TcContext, proto: u8) -> u8 {
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
    if data + F::IP_OFF + size_of::<F::Ip>() > ctx.data_end() {
        return false;
    }
    // SAFETY: within [data, data_end), checked above; the header is plain bytes.
    let ip = unsafe { &*((data + F::IP_OFF) as *const F::Ip) };
    let daddr = F::dst(ip);
    !in_addr_filter(&daddr) && !in_addr_filter(&F::src(ip)) && service_range_miss(daddr) == ServiceRangeMiss::NotInRange
}

/// `A_FLOW` with the packet's tuple filled in, `AN_ICMP_ERROR`, or the verdict on a packet
/// that has no tuple for us (not ours, a later fragment).
#[inline(always)]
pub(super) fn inspect<F: Family>(ctx: &TcContext, tuple: &mut MaybeUninit<Tuple>, decapsulated: bool) -> i32 {
    if !decapsulated && not_ours::<F>(ctx) {
        return PASS;
    }
    let Some(h) = headers::<F>(ctx) else {
        // Shorter than Ethernet + IP + ports: only a datagram's last fragment may be.
        return match ctx.load::<F::Ip>(F::IP_OFF).map(WordAligned) {
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
        probe: 0,
        first_fragment: match fragment {
            Fragment::First(id) => u32::from(id),
            _ => NOT_A_FIRST_FRAGMENT,
        },
        l4_len: F::l4_len(ip),
    };
    tuple.write(t);
    A_FLOW
}

/// The TCP flags byte: read straight from the packet when the header is in the linear area
/// (nearly always), else through the load helper.
#[inline(always)]
pub(super) fn tcp_flags<F: Family>(ctx: &TcContext) -> u8 {
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
