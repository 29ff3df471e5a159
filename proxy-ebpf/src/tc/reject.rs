//! kube-proxy REJECTs traffic to a service without endpoints: a TCP SYN is answered with a
//! reset, a UDP datagram or SCTP packet with ICMP port unreachable (ICMPv6 type 1 code 4 in
//! IPv6). The packet is rewritten in place into the answer and sent back out of the interface
//! it came in on (on a link without Ethernet, handed to the host stack, which routes it: an
//! IP-in-IP tunnel without a remote cannot be sent to without a route); the client sees
//! ECONNREFUSED.
use aya_ebpf::{
    EbpfContext as _,
    bindings::{__sk_buff, BPF_F_RECOMPUTE_CSUM, TC_ACT_OK, TC_ACT_SHOT, bpf_adj_room_mode::BPF_ADJ_ROOM_NET},
    helpers::{bpf_csum_diff, bpf_redirect},
    programs::TcContext,
};
use proxy_common::{Addr, IPPROTO_TCP, counter, csum, event};

use crate::{
    family::{Family, pseudo_sum},
    packet::{TCP_ACK, TCP_FLAGS, TCP_RST, TCP_SYN},
};

use super::{event::note, parse::Tuple, scratch::scratch};

/// The service port a refused packet was for (`pick_backend` leaves it in the scratch area).
#[inline(always)]
fn refused_service() -> u32 {
    scratch().map_or(0, |s| s.service.service_id)
}

/// kube-proxy REJECTs connections to a service without endpoints: answer a SYN with a RST
/// (the client sees ECONNREFUSED), sent back out of the interface it came in on.
///
/// Subprograms (as the unreachable below): the BPF stack of the path that leads here is spent.
#[inline(never)]
pub(super) fn reject_tcp<F: Family>(ctx: &TcContext, t: &Tuple) -> i32 {
    note(t, counter::TC_REJECTED, event::REJECTED, refused_service());
    reset::<F>(ctx, t, false).unwrap_or(TC_ACT_SHOT)
}

/// A segment of a flow whose endpoint died (`ct::ENDPOINT_DEAD`, already forgotten): answered
/// with a RST whose sequence number is the segment's acknowledgement (RFC 9293 3.10.7.1), the
/// one sequence number the client accepts a RST at: its reads and writes fail with ECONNRESET.
/// A segment without ACK (a SYN: refused, as a connection to nothing) or a RST is not answered.
#[inline(never)]
pub(super) fn reset_flow<F: Family>(ctx: &TcContext, t: &Tuple) -> i32 {
    // `translate_tracked` left the flow's entry in the scratch area.
    note(t, counter::TC_DEAD_FLOW_RESET, event::RESET_DEAD_ENDPOINT, scratch().map_or(0, |s| s.entry.service_id));
    reset::<F>(ctx, t, true).unwrap_or(TC_ACT_SHOT)
}

/// Answer the segment with a RST: to a SYN, RST+ACK (ECONNREFUSED); with `established`, to a
/// segment with ACK, a RST at its acknowledgement number. Anything else is dropped.
#[inline(always)]
fn reset<F: Family>(ctx: &TcContext, t: &Tuple, established: bool) -> Result<i32, ()> {
    let flags: u8 = ctx.load(F::L4_OFF + TCP_FLAGS).map_err(drop)?;
    let mut tcp = [0u8; 20];
    if flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN {
        let seq: [u8; 4] = ctx.load(F::L4_OFF + 4).map_err(drop)?;
        tcp[8..12].copy_from_slice(&u32::from_be_bytes(seq).wrapping_add(1).to_be_bytes());
        tcp[13] = TCP_RST | TCP_ACK;
    } else if established && flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_ACK {
        let ack: [u8; 4] = ctx.load(F::L4_OFF + 8).map_err(drop)?;
        tcp[4..8].copy_from_slice(&ack);
        tcp[13] = TCP_RST;
    } else {
        return Ok(TC_ACT_SHOT);
    }
    let macs = macs::<F>(ctx)?;

    let (sport, dport) = (t.dport.to_ne_bytes(), t.sport.to_ne_bytes());
    tcp[0] = sport[0];
    tcp[1] = sport[1];
    tcp[2] = dport[0];
    tcp[3] = dport[1];
    tcp[12] = 5 << 4;
    let pseudo = csum::fold32(pseudo_sum::<F>(&t.daddr, &t.saddr, IPPROTO_TCP, 20));
    let sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, tcp.as_mut_ptr().cast(), 20, pseudo) };
    tcp[16..18].copy_from_slice(&fold(sum).to_ne_bytes());
    let ip = F::reply_header(&t.daddr, &t.saddr, IPPROTO_TCP, 20);

    ctx.change_tail((F::L4_OFF + 20) as u32, 0).map_err(drop)?;
    ctx.store(F::IP_OFF, &ip, u64::from(BPF_F_RECOMPUTE_CSUM)).map_err(drop)?;
    ctx.store(F::L4_OFF, &tcp, u64::from(BPF_F_RECOMPUTE_CSUM)).map_err(drop)?;
    bounce::<F>(ctx, macs)
}

/// ICMP header + quoted IP header + 8 bytes of the datagram: the body of an ICMP error (a port
/// unreachable here, `icmp::too_big`'s too).
#[repr(C)]
pub(super) struct Unreachable<Ip> {
    pub(super) icmp: [u8; 8],
    pub(super) quoted_ip: Ip,
    pub(super) quoted_l4: [u8; 8],
}

/// kube-proxy REJECTs UDP and SCTP to a service without endpoints with ICMP port unreachable:
/// turn the packet into one, in place, and send it back out of the interface it came in on.
#[inline(never)]
pub(super) fn reject_port_unreachable<F: Family>(ctx: &TcContext, t: &Tuple) -> i32 {
    port_unreachable::<F>(ctx, t).unwrap_or(TC_ACT_SHOT)
}

#[inline(always)]
fn port_unreachable<F: Family>(ctx: &TcContext, t: &Tuple) -> Result<i32, ()> {
    note(t, counter::TC_REJECTED, event::REJECTED, refused_service());
    let [icmp_type, code] = F::PORT_UNREACHABLE;
    let macs = icmp_about_packet::<F>(ctx, [icmp_type, code, 0, 0, 0, 0, 0, 0], &t.daddr, &t.saddr)?;
    bounce::<F>(ctx, macs)
}

/// Turn the packet, in place, into an ICMP error about it from `src` to `dst`: the ICMP
/// header `icmp` (its checksum computed here), then the packet's IP header and the first 8
/// bytes after it. Returns the packet's MAC addresses, for [`bounce`].
#[inline(always)]
fn icmp_about_packet<F: Family>(ctx: &TcContext, icmp: [u8; 8], src: &Addr, dst: &Addr) -> Result<[u8; 12], ()> {
    let quoted_ip: F::Ip = ctx.load(F::IP_OFF).map_err(drop)?;
    let quoted_l4: [u8; 8] = ctx.load(F::L4_OFF).map_err(drop)?;
    let macs = macs::<F>(ctx)?;
    let mut body = Unreachable { icmp, quoted_ip, quoted_l4 };
    let len = size_of::<Unreachable<F::Ip>>();
    // ICMPv6's checksum covers a pseudo header, ICMP's does not.
    let seed =
        if F::ICMP_PSEUDO_HEADER { csum::fold32(pseudo_sum::<F>(src, dst, F::ICMP_PROTO, len as u16)) } else { 0 };
    let sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, (&raw mut body).cast(), len as u32, seed) };
    body.icmp[2..4].copy_from_slice(&fold(sum).to_ne_bytes());
    let ip = F::reply_header(src, dst, F::ICMP_PROTO, len as u16);

    // Cut the packet to its headers, then make room for the new IP and ICMP headers after the
    // IP header (the 8 bytes after it are the quote's last, already in place). In that order:
    // a full-size packet grown first would pass its link's MTU, which the helper refuses.
    ctx.change_tail((F::L4_OFF + 8) as u32, 0).map_err(drop)?;
    let room = size_of::<F::Ip>() + 8;
    ctx.adjust_room(room as i32, BPF_ADJ_ROOM_NET, 0).map_err(drop)?;
    let recompute = u64::from(BPF_F_RECOMPUTE_CSUM);
    ctx.store(F::IP_OFF, &ip, recompute).map_err(drop)?;
    ctx.store(F::L4_OFF, &body, recompute).map_err(drop)?;
    Ok(macs)
}

/// The packet's MAC addresses, for [`bounce`] (none without Ethernet).
#[inline(always)]
pub(super) fn macs<F: Family>(ctx: &TcContext) -> Result<[u8; 12], ()> {
    if !F::ETHERNET {
        return Ok([0; 12]);
    }
    ctx.load(0).map_err(drop)
}

/// Swap the Ethernet addresses (`macs` as read from the packet) and send the packet back out of
/// the interface it arrived on. Without Ethernet, an answer on the way in goes on into the
/// host stack, which routes it; one on the way out is dropped (the link would carry it on
/// toward where the packet was going).
#[inline(always)]
pub(super) fn bounce<F: Family>(ctx: &TcContext, macs: [u8; 12]) -> Result<i32, ()> {
    if !F::ETHERNET {
        // SAFETY: a tc program's context is the packet's __sk_buff.
        let skb = unsafe { &*ctx.as_ptr().cast::<__sk_buff>() };
        return Ok(if skb.ingress_ifindex == skb.ifindex { TC_ACT_OK } else { TC_ACT_SHOT });
    }
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    ctx.store(0, &swapped, u64::from(BPF_F_RECOMPUTE_CSUM)).map_err(drop)?;
    let ifindex = unsafe { (*ctx.as_ptr().cast::<__sk_buff>()).ifindex };
    Ok(unsafe { bpf_redirect(ifindex, 0) } as i32)
}

/// The checksum field value for `bpf_csum_diff`'s 32-bit one's complement sum.
#[inline(always)]
pub(super) fn fold(sum: i64) -> u16 {
    !csum::fold16(sum as u64 & 0xffff_ffff)
}
