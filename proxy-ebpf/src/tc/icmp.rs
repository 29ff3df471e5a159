//! ICMP errors about translated flows, translated back toward the client (the quoted packet
//! and the outer header).
use aya_ebpf::{
    bindings::{BPF_F_PSEUDO_HDR, TC_ACT_OK},
    programs::TcContext,
};
use proxy_common::{CtKey, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, counter, csum};

use super::{
    entry::flow_entry,
    rewrite::ports_word,
    scratch::{IcmpFix, Scratch, scratch},
    verdict::PASS,
};
use crate::{
    family::Family,
    maps::count,
    packet::{ICMP_CSUM, ICMP_QUOTE, IP_OFF, read_word, write_word},
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
        F::write_addrs((data + IP_OFF) as *mut u8, &fix.new_src, &fix.client, fix.outer_diff);
    }
    count(counter::TC_CT_HIT);
    Ok(TC_ACT_OK)
}
