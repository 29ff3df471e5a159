//! ICMP errors about translated flows, translated back toward the client (the quoted packet
//! and the outer header).
use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        __sk_buff, BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM, TC_ACT_OK, TC_ACT_SHOT, bpf_adj_room_mode::BPF_ADJ_ROOM_NET,
    },
    helpers::{bpf_csum_diff, bpf_skb_load_bytes},
    programs::TcContext,
};
use network_types::ip::{Ipv4Hdr, Ipv6Hdr};
use proxy_common::{CtKey, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, NODE_ADDR_LOCAL, counter, csum};

use super::{
    dsr::untunnel,
    entry::flow_entry,
    reject::{Unreachable, bounce, fold, macs},
    rewrite::ports_word,
    scratch::{IcmpFix, Scratch, scratch},
    verdict::PASS,
};
use crate::{
    family::{Family, pseudo_sum},
    maps::{count, node_addr_flags},
    packet::{ICMP_CSUM, ICMP_QUOTE, read_word, write_word},
};

/// An ICMP error (unreachable, too big, time exceeded, parameter problem) about a translated
/// flow, e.g. "fragmentation needed" from a backend: it quotes the packet as the backend saw
/// it. Translate the quoted header and the outer addresses back, so that the client's kernel
/// matches it to its socket (path MTU discovery, connection errors).
#[inline(always)]
pub(super) fn icmp_error<F: Family>(ctx: &TcContext) -> i32 {
    let Ok(s) = scratch() else { return PASS };
    match icmp_error_flow::<F>(ctx, s) {
        Ok(true) => icmp_error_rewrite::<F>(ctx, s).unwrap_or(PASS),
        _ => PASS,
    }
}

/// A packet of a masqueraded flow, too big for the link its route leaves by (`TOO_BIG`), that may
/// not be cut into fragments. kube-proxy's node answers it with "fragmentation needed"
/// (IPv6: "packet too big") before MASQUERADE rewrites it, so the client learns the path's
/// MTU; kpr has masqueraded it already, so the host stack's answer would go to the node's own
/// address and be lost. Answered here instead: from the frontend the client addressed, to the
/// client, quoting the client's packet as it sent it (the flow's reply entry tells how), out
/// of the link the packet came in by. What is not such a packet goes on to the host stack.
///
/// The answer is assembled in the scratch area: on the BPF stack it would not fit beside the
/// chain of calls that leads here.
#[inline(never)]
pub(super) fn too_big<F: Family>(ctx: &TcContext) -> i32 {
    // SAFETY: a tc program's context is the packet's __sk_buff.
    if unsafe { (*(ctx.as_ptr() as *const __sk_buff)).gso_size } != 0 {
        return TC_ACT_OK; // segmented later, to the link's size
    }
    // Direct server return's packet: the client's, untranslated, in the tunnel's header, which
    // comes off; the client learns the room the tunnel leaves.
    let tunnelled = untunnel::<F>(ctx);
    let Ok(s) = scratch() else { return TC_ACT_OK };
    // SAFETY: `forward_direct`'s lookup answer: the link's MTU (less the tunnel's header).
    let mtu = unsafe { s.fib.__bindgen_anon_1.mtu_result };
    // SAFETY: the scratch value's room, valid for this program run, large enough for either
    // family's answer (checked at compile time below).
    let answer = unsafe { &mut *(&raw mut (*s.as_ptr()).answer).cast::<TooBig<F::Ip>>() };
    let quote_len = size_of::<F::Ip>() + 8;
    // The packet's IP header and the 8 bytes after it, as translated.
    // SAFETY: the helper writes `quote_len` bytes within the quote's room.
    let loaded = unsafe {
        bpf_skb_load_bytes(ctx.as_ptr(), F::IP_OFF as u32, (&raw mut answer.body.quoted_ip).cast(), quote_len as u32)
    };
    let ip = &answer.body.quoted_ip;
    if loaded != 0 || F::may_fragment(ip) {
        // Out of its tunnel, the packet cannot go on (one without "don't fragment" is dropped:
        // its sender does not look for the path's MTU).
        if tunnelled {
            count(counter::TC_DROPPED);
            return TC_ACT_SHOT;
        }
        return TC_ACT_OK;
    }
    let (client, frontend) = if tunnelled {
        // The quote is the client's packet as it sent it.
        (F::src(ip), F::dst(ip))
    } else {
        let (masquerade_source, backend) = (F::src(ip), F::dst(ip));
        let proto = match F::l4_proto(ip) {
            Some(p @ (IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP)) => p,
            _ => return TC_ACT_OK,
        };
        if node_addr_flags(&masquerade_source) & NODE_ADDR_LOCAL == 0 {
            return TC_ACT_OK; // not masqueraded: the stack's answer reaches the client
        }
        // SAFETY: the quote's first word, 4-aligned in the scratch value.
        let ports = unsafe { read_word::<[u16; 2]>(answer.body.quoted_l4.as_ptr()) };
        // The flow's reply entry holds the client and the frontend.
        // SAFETY: the scratch area's key slot, valid for this program run.
        let key = unsafe {
            let key = s.key::<F::FlowAddr>();
            *key = CtKey::new(backend, masquerade_source, ports[1], ports[0], proto);
            &*key
        };
        let Some(entry) = flow_entry(key) else { return TC_ACT_OK };
        let (client, frontend) = (entry.dst_addr, entry.src_addr);
        // The quote as the client sent it.
        let diff = F::addr_diff(&masquerade_source, &client) + F::addr_diff(&backend, &frontend);
        // SAFETY: the quote's header and first word, in the scratch value.
        unsafe {
            F::write_addrs((&raw mut answer.body.quoted_ip).cast(), &client, &frontend, diff);
            write_word(answer.body.quoted_l4.as_mut_ptr(), ports_word(entry.dst_port, entry.src_port));
        }
        (client, frontend)
    };
    answer.body.icmp = F::too_big_header(mtu);
    let len = (8 + quote_len) as u16;
    // ICMPv6's checksum covers a pseudo header, ICMP's does not.
    let seed =
        if F::ICMP_PSEUDO_HEADER { csum::fold32(pseudo_sum::<F>(&frontend, &client, F::ICMP_PROTO, len)) } else { 0 };
    // SAFETY: the ICMP header and the quote, `len` bytes of the scratch value.
    let sum =
        unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, answer.body.icmp.as_mut_ptr().cast(), u32::from(len), seed) };
    answer.body.icmp[2..4].copy_from_slice(&fold(sum).to_ne_bytes());
    answer.ip = F::reply_header(&frontend, &client, F::ICMP_PROTO, len);
    let Ok(macs) = macs::<F>(ctx) else { return TC_ACT_OK };
    // The packet cut to its headers, then room made after its IP header for the answer's.
    let rewritten = ctx.change_tail((F::L4_OFF + 8) as u32, 0).is_ok()
        && ctx.adjust_room((size_of::<F::Ip>() + 8) as i32, BPF_ADJ_ROOM_NET, 0).is_ok()
        && ctx.store(F::IP_OFF, answer, u64::from(BPF_F_RECOMPUTE_CSUM)).is_ok();
    if !rewritten {
        return TC_ACT_SHOT;
    }
    count(counter::TC_CT_HIT);
    bounce::<F>(ctx, macs).unwrap_or(TC_ACT_SHOT)
}

/// The answer [`too_big`] assembles: IP header, then an ICMP error's body.
#[repr(C)]
struct TooBig<Ip> {
    ip: Ip,
    body: Unreachable<Ip>,
}

// The scratch value's room holds either family's.
const _: () = assert!(size_of::<TooBig<Ipv6Hdr>>() <= size_of::<[u32; 24]>());
const _: () = assert!(size_of::<TooBig<Ipv4Hdr>>() <= size_of::<[u32; 24]>());

/// The translation back of an ICMP error (in `s.icmp`), if it is about a translated flow. A
/// subprogram of its own, as is the rewrite: together they would not fit on the BPF stack.
#[inline(never)]
fn icmp_error_flow<F: Family>(ctx: &TcContext, mut s: Scratch) -> Result<bool, ()> {
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
            &*((data + F::IP_OFF) as *const F::Ip),
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
    // SAFETY: the scratch area's key slot, valid for this program run.
    let key = unsafe {
        let key = s.key::<F::FlowAddr>();
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
    s.icmp = IcmpFix {
        client: entry.dst_addr,
        frontend: entry.src_addr,
        new_src,
        inner_diff,
        outer_diff,
        old_ports: ports_word(ports[0], ports[1]),
        new_ports: ports_word(entry.dst_port, entry.src_port),
    };
    Ok(true)
}

/// Apply `s.icmp` to the ICMP error.
#[inline(never)]
fn icmp_error_rewrite<F: Family>(ctx: &TcContext, s: Scratch) -> Result<i32, ()> {
    let fix = &s.icmp;
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
        F::write_addrs((data + F::IP_OFF) as *mut u8, &fix.new_src, &fix.client, fix.outer_diff);
    }
    count(counter::TC_CT_HIT);
    Ok(TC_ACT_OK)
}
