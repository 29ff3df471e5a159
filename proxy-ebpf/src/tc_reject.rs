//! kube-proxy REJECTs traffic to a service without endpoints: a TCP SYN is answered with a
//! reset, a UDP datagram or SCTP packet with ICMP port unreachable. The packet is rewritten in place into the
//! answer and sent back out of the interface it came in on; the client sees ECONNREFUSED.
use aya_ebpf::{
    EbpfContext as _,
    bindings::{__sk_buff, BPF_F_RECOMPUTE_CSUM, TC_ACT_SHOT, bpf_adj_room_mode::BPF_ADJ_ROOM_NET},
    helpers::{bpf_csum_diff, bpf_redirect},
    programs::TcContext,
};
use network_types::ip::Ipv4Hdr;
use proxy_common::{IPPROTO_TCP, counter};

use crate::{
    maps::count,
    packet::{ETH_LEN, IP_OFF, L4_OFF, TCP_ACK, TCP_FLAGS_OFF, TCP_RST, TCP_SYN},
    tc_nat::Tuple,
};

/// IPv4 + TCP headers of a reset, laid out as on the wire.
#[repr(C)]
struct ResetHeaders {
    ip: [u8; 20],
    tcp: [u8; 20],
}

/// The TCP pseudo-header and header, for the checksum.
#[repr(C)]
struct TcpChecksumInput {
    saddr: u32,
    daddr: u32,
    zero_proto_len: [u8; 4],
    tcp: [u8; 20],
}

/// kube-proxy REJECTs connections to a service without endpoints: answer a SYN with a RST
/// (the client sees ECONNREFUSED), sent back out of the interface it came in on.
#[inline(always)]
pub fn reject_tcp(ctx: &TcContext, t: &Tuple) -> Result<i32, ()> {
    let flags: u8 = ctx.load(TCP_FLAGS_OFF).map_err(drop)?;
    count(counter::TC_REJECTED);
    if flags & TCP_SYN == 0 || flags & TCP_ACK != 0 {
        return Ok(TC_ACT_SHOT);
    }
    let seq: [u8; 4] = ctx.load(L4_OFF + 4).map_err(drop)?;
    let ack = u32::from_be_bytes(seq).wrapping_add(1).to_be_bytes();
    let macs: [u8; 12] = ctx.load(0).map_err(drop)?;

    let (src, dst) = (t.daddr.to_ne_bytes(), t.saddr.to_ne_bytes());
    let mut h = ResetHeaders {
        ip: [
            0x45,
            0,
            0,
            40,
            0,
            0,
            0x40,
            0,
            64,
            IPPROTO_TCP,
            0,
            0,
            src[0],
            src[1],
            src[2],
            src[3],
            dst[0],
            dst[1],
            dst[2],
            dst[3],
        ],
        tcp: [0; 20],
    };
    let (sport, dport) = (t.dport.to_ne_bytes(), t.sport.to_ne_bytes());
    h.tcp[0] = sport[0];
    h.tcp[1] = sport[1];
    h.tcp[2] = dport[0];
    h.tcp[3] = dport[1];
    h.tcp[8..12].copy_from_slice(&ack);
    h.tcp[12] = 5 << 4;
    h.tcp[13] = TCP_RST | TCP_ACK;

    let ip_sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, h.ip.as_mut_ptr().cast(), 20, 0) };
    let ip_csum = fold(ip_sum);
    h.ip[10..12].copy_from_slice(&ip_csum.to_ne_bytes());
    let mut pseudo =
        TcpChecksumInput { saddr: t.daddr, daddr: t.saddr, zero_proto_len: [0, IPPROTO_TCP, 0, 20], tcp: h.tcp };
    let tcp_sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, (&raw mut pseudo).cast(), 32, 0) };
    h.tcp[16..18].copy_from_slice(&fold(tcp_sum).to_ne_bytes());

    ctx.change_tail((ETH_LEN + 40) as u32, 0).map_err(drop)?;
    ctx.store(IP_OFF, &h, u64::from(BPF_F_RECOMPUTE_CSUM)).map_err(drop)?;
    bounce(ctx, macs)
}

/// ICMP header + quoted IPv4 header + 8 bytes of the datagram: the body of a port unreachable.
#[repr(C)]
struct IcmpUnreachable {
    icmp: [u8; 8],
    quoted_ip: Ipv4Hdr,
    quoted_l4: [u8; 8],
}

/// kube-proxy REJECTs UDP and SCTP to a service without endpoints with ICMP port unreachable:
/// turn the packet into one, in place, and send it back out of the interface it came in on.
#[inline(always)]
pub fn reject_port_unreachable(ctx: &TcContext, t: &Tuple) -> Result<i32, ()> {
    count(counter::TC_REJECTED);
    let quoted_ip: Ipv4Hdr = ctx.load(IP_OFF).map_err(drop)?;
    let quoted_l4: [u8; 8] = ctx.load(L4_OFF).map_err(drop)?;
    let macs: [u8; 12] = ctx.load(0).map_err(drop)?;
    let mut body = IcmpUnreachable { icmp: [3, 3, 0, 0, 0, 0, 0, 0], quoted_ip, quoted_l4 };
    let sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, (&raw mut body).cast(), 36, 0) };
    body.icmp[2..4].copy_from_slice(&fold(sum).to_ne_bytes());

    let (src, dst) = (t.daddr.to_ne_bytes(), t.saddr.to_ne_bytes());
    let mut ip =
        [0x45, 0xc0, 0, 56, 0, 0, 0, 0, 64, 1, 0, 0, src[0], src[1], src[2], src[3], dst[0], dst[1], dst[2], dst[3]];
    let ip_sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, ip.as_mut_ptr().cast(), 20, 0) };
    ip[10..12].copy_from_slice(&fold(ip_sum).to_ne_bytes());

    // Room for the new IP and ICMP headers goes after the IP header; the L4 header that
    // follows is the quoted packet's first 8 bytes, already in place.
    ctx.adjust_room(28, BPF_ADJ_ROOM_NET, 0).map_err(drop)?;
    ctx.change_tail((ETH_LEN + 20 + 36) as u32, 0).map_err(drop)?;
    let recompute = u64::from(BPF_F_RECOMPUTE_CSUM);
    ctx.store(IP_OFF, &ip, recompute).map_err(drop)?;
    ctx.store(L4_OFF, &body, recompute).map_err(drop)?;
    bounce(ctx, macs)
}

/// Swap the Ethernet addresses (`macs` as read from the packet) and send the packet back out of
/// the interface it arrived on.
#[inline(always)]
fn bounce(ctx: &TcContext, macs: [u8; 12]) -> Result<i32, ()> {
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    ctx.store(0, &swapped, u64::from(BPF_F_RECOMPUTE_CSUM)).map_err(drop)?;
    let ifindex = unsafe { (*ctx.as_ptr().cast::<__sk_buff>()).ifindex };
    Ok(unsafe { bpf_redirect(ifindex, 0) } as i32)
}

/// The checksum field value for `bpf_csum_diff`'s 32-bit one's complement sum.
#[inline(always)]
fn fold(sum: i64) -> u16 {
    !proxy_common::csum::fold16(sum as u64 & 0xffff_ffff)
}
