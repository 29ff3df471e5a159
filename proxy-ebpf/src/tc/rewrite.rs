//! Writing a flow's addresses and ports into the packet, with the checksums of its family
//! and protocol (incremental, or left to the device when it completes them).
use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use proxy_common::{
    CtValue, FragmentKey, IPPROTO_TCP, IPPROTO_UDP, crc32c,
    csum::{self, L4State},
    ct,
};

use super::{
    dsr::{clamp_mss, encapsulate},
    parse::{NOT_A_FIRST_FRAGMENT, Tuple},
};
use crate::{
    family::Family,
    globals::KPR_IP_SUMMED_AT,
    maps::FRAGMENTS,
    packet::{SCTP_CSUM, TCP_CSUM, UDP_CSUM, read_word, write_word},
};

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
pub(super) fn rewrite<F: Family>(ctx: &TcContext, t: &Tuple, to: &CtValue) -> Result<(), ()> {
    // Direct server return: the client's entry sends the packet on untranslated, in a tunnel;
    // the replies' entry on the endpoint's node makes room for the tunnel in the SYN-ACK.
    if to.flags & ct::DSR != 0 {
        if to.flags & ct::REPLY == 0 {
            return encapsulate::<F>(ctx, to);
        }
        clamp_mss::<F>(ctx, t.proto);
    }
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
            F::write_addrs((data + F::IP_OFF) as *mut u8, &to.src_addr, &to.dst_addr, u64::from(addr_diff));
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
pub(super) fn rewrite_first<F: Family>(ctx: &TcContext, t: &Tuple, to: &CtValue) -> Result<(), ()> {
    rewrite::<F>(ctx, t, to)
}

/// Two ports as the four bytes they are in the packet, read as one native word.
#[inline(always)]
pub(crate) fn ports_word(first: u16, second: u16) -> u32 {
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
