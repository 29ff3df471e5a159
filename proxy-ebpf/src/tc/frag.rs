//! The later fragments of an IPv4 datagram, translated with the addresses the first got.
use aya_ebpf::{bindings::TC_ACT_OK, programs::TcContext};
use proxy_common::{Addr, FragmentKey, counter};

use super::verdict::PASS;
use crate::{
    family::Family,
    maps::{FRAGMENTS, count},
};

/// A later fragment (no ports) of a datagram whose first fragment was translated: the same
/// addresses (its IP checksum only: the L4 checksum is in the first fragment). A fragment
/// of anything else passes untouched.
#[inline(always)]
pub(super) fn later_fragment<F: Family>(ctx: &TcContext, ip: &F::Ip) -> Result<i32, ()> {
    let (saddr, daddr) = (F::src(ip), F::dst(ip));
    let Some(key) = fragment_key::<F>(ip, &saddr, &daddr) else {
        return Ok(PASS);
    };
    let Some(to) = FRAGMENTS.get_ptr(&key) else {
        count(counter::TC_PASSED_UNSUPPORTED);
        return Ok(PASS);
    };
    // SAFETY: valid for this program run.
    let to = unsafe { *to };
    let diff = F::addr_diff(&saddr, &to.src_addr) + F::addr_diff(&daddr, &to.dst_addr);
    let data = ctx.data();
    if data + F::IP_OFF + size_of::<F::Ip>() > ctx.data_end() {
        return Err(());
    }
    // SAFETY: within [data, data_end), checked above.
    unsafe { F::write_addrs((data + F::IP_OFF) as *mut u8, &to.src_addr, &to.dst_addr, diff) };
    count(counter::TC_FRAGMENT_TRANSLATED);
    Ok(TC_ACT_OK)
}

/// The `KPR_FRAGMENTS` key of a datagram in fragments (IPv4: IPv6 fragments are not parsed).
#[inline(always)]
fn fragment_key<F: Family>(ip: &F::Ip, saddr: &Addr, daddr: &Addr) -> Option<FragmentKey> {
    let id = F::fragment_id(ip)?;
    let proto = F::l4_proto(ip)?;
    Some(FragmentKey { src_addr: saddr.v4(), dst_addr: daddr.v4(), id, proto, _pad: 0 })
}
