//! The Internet checksum (RFC 1071) updated in registers when fields change (RFC 1624's
//! `HC' = ~(~HC + ~m + m')`): the tc programs rewrite the IP header in place with it, and hand
//! the same differences to the kernel for the L4 checksum. Byte order does not matter to a
//! one's complement sum, so values are used as read from the packet.

/// The difference of replacing the 32-bit word `old` by `new`, as a sum to accumulate.
#[inline(always)]
pub const fn word_diff(old: u32, new: u32) -> u64 {
    (!old) as u64 + new as u64
}

/// An accumulated sum folded to 32 bits with end-around carries (the kernel's `__wsum`).
#[inline(always)]
pub const fn fold32(mut sum: u64) -> u32 {
    sum = (sum & 0xffff_ffff) + (sum >> 32);
    sum = (sum & 0xffff_ffff) + (sum >> 32);
    sum as u32
}

/// An accumulated sum folded to 16 bits with end-around carries.
#[inline(always)]
pub const fn fold16(sum: u64) -> u16 {
    let mut s = fold32(sum) as u64;
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s as u16
}

/// The checksum field `check` after the fields it covers changed by `diff`.
#[inline(always)]
pub const fn replace(check: u16, diff: u64) -> u16 {
    !fold16((!check) as u64 + diff)
}

/// An IPv4 header checksum `check` (as read from the packet) after its TTL went one down, as
/// the kernel's `ip_decrease_ttl` computes it: the TTL is the high byte of its 16-bit word, so
/// the checksum is 0x0100 (network order) more, its carry folded in.
#[inline(always)]
pub const fn ttl_decremented(check: u16) -> u16 {
    let sum = check as u32 + 0x0100u16.to_be() as u32;
    (sum + (sum >= 0xffff) as u32) as u16
}

/// What `bpf_l4_csum_replace` does to an L4 checksum field (net/core/filter.c and utils.c,
/// unchanged since 4.x), computed here so that a program can read in the field, after the
/// pseudo header's call, which of two states the packet is in, and fix the ports' share itself
/// instead of a second call:
/// - the checksum is complete (`CHECKSUM_NONE`, `_UNNECESSARY`, `_COMPLETE`): the field covers
///   the ports, and both changes go into it;
/// - it is left to the device (`CHECKSUM_PARTIAL`): the field holds the pseudo header's sum
///   only, the device sums the rest, and only the addresses' change goes into it.
///
/// Only the kernel knows the state; the two formulas give different fields for the same change
/// unless it is a zero, when [`l4_state`] says `Unknown` and the program asks the kernel.
pub mod kernel {
    /// `csum_add`: a 32-bit one's complement sum.
    #[inline(always)]
    const fn add(a: u32, b: u32) -> u32 {
        let r = a.wrapping_add(b);
        r.wrapping_add((r < b) as u32)
    }

    /// `csum_fold`: 16 bits, complemented.
    #[inline(always)]
    const fn fold(sum: u32) -> u16 {
        let s = (sum & 0xffff) + (sum >> 16);
        let s = (s & 0xffff) + (s >> 16);
        !(s as u16)
    }

    /// The field after the pseudo header changed by `diff` (`BPF_F_PSEUDO_HDR`, a difference),
    /// on a complete checksum: `csum_replace_by_diff`.
    #[inline(always)]
    pub const fn pseudo_complete(check: u16, diff: u32) -> u16 {
        fold(add(diff, !(check as u32)))
    }

    /// The same on a checksum left to the device (`CHECKSUM_PARTIAL`).
    #[inline(always)]
    pub const fn pseudo_partial(check: u16, diff: u32) -> u16 {
        !fold(add(diff, check as u32))
    }

    /// The field after a 32-bit word of a complete checksum went from `from` to `to`
    /// (`csum_replace4`); a checksum left to the device keeps its field. [`super::replace`]
    /// gives the same sum but may write the other zero of one's complement: this writes what
    /// the kernel's call would have, bit for bit.
    #[inline(always)]
    pub const fn word_complete(check: u16, from: u32, to: u32) -> u16 {
        fold(add(add(!(check as u32), !from), to))
    }

    /// `BPF_F_MARK_MANGLED_0` (UDP over IPv4, where 0 means "no checksum"): a computed 0 is
    /// written as 0xffff.
    #[inline(always)]
    pub const fn mangled(check: u16, mark_mangled_0: bool) -> u16 {
        if mark_mangled_0 && check == 0 { 0xffff } else { check }
    }
}

/// What an L4 checksum field says of its packet after `bpf_l4_csum_replace` applied the pseudo
/// header's difference `diff` to it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum L4State {
    /// Complete: the ports' share goes into the field too.
    Complete,
    /// Left to the device, or absent (a UDP checksum of 0): the field takes no more change.
    NoMore,
    /// The field cannot tell (a zero change, or a kernel computing otherwise).
    Unknown,
}

/// The state of the packet whose field went from `before` to `after` by the pseudo header's
/// `diff` (`mark_mangled_0`: the call's `BPF_F_MARK_MANGLED_0`).
#[inline(always)]
pub const fn l4_state(before: u16, after: u16, diff: u32, mark_mangled_0: bool) -> L4State {
    if mark_mangled_0 && before == 0 {
        return L4State::NoMore; // the kernel left an absent checksum alone, and will again
    }
    let complete = kernel::mangled(kernel::pseudo_complete(before, diff), mark_mangled_0);
    let partial = kernel::mangled(kernel::pseudo_partial(before, diff), mark_mangled_0);
    if complete == partial {
        L4State::Unknown
    } else if after == complete {
        L4State::Complete
    } else if after == partial {
        L4State::NoMore
    } else {
        L4State::Unknown
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    /// The difference of replacing the 16-bit word `old` by `new`.
    fn half_diff(old: u16, new: u16) -> u64 {
        u64::from(!old) + u64::from(new)
    }

    /// The checksum of `data` from scratch (native 16-bit words, as the programs read them).
    fn checksum(data: &[u8]) -> u16 {
        let sum: u64 = data.chunks(2).map(|c| u64::from(u16::from_ne_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum();
        !fold16(sum)
    }

    #[test]
    fn an_incremental_update_equals_a_recomputation() {
        let mut next = crate::test_numbers(0x9e37_79b9);
        for round in 0..10_000 {
            // An IPv4 header: checksum at 10, addresses at 12 and 16, TTL and protocol at 8.
            let mut header = [0u8; 20];
            header.iter_mut().for_each(|b| *b = next() as u8);
            if round % 7 == 0 {
                header[12..20].fill(0xff); // sums near the carry
            }
            header[10..12].fill(0);
            let check = checksum(&header);
            header[10..12].copy_from_slice(&check.to_ne_bytes());
            let word = |h: &[u8; 20], at: usize| u32::from_ne_bytes(h[at..at + 4].try_into().unwrap());
            let (src, dst, ttl) = (next(), if round % 3 == 0 { word(&header, 16) } else { next() }, next() as u8);
            let mut diff = word_diff(word(&header, 12), src) + word_diff(word(&header, 16), dst);
            diff += half_diff(u16::from_ne_bytes([header[8], header[9]]), u16::from_ne_bytes([ttl, header[9]]));
            let updated = replace(check, diff);
            header[12..16].copy_from_slice(&src.to_ne_bytes());
            header[16..20].copy_from_slice(&dst.to_ne_bytes());
            header[8] = ttl;
            header[10..12].fill(0);
            let expected = checksum(&header);
            // One's complement has two zeros; both verify.
            assert!(
                updated == expected || (updated ^ expected == 0xffff && expected.is_multiple_of(0xffff)),
                "round {round}"
            );
            header[10..12].copy_from_slice(&updated.to_ne_bytes());
            assert!(checksum(&header) == 0 || checksum(&header) == 0xffff, "round {round}: verifies");
        }
    }

    #[test]
    fn a_ttl_one_down_gives_the_checksum_computed_anew() {
        let mut next = crate::test_numbers(0x0bad_cafe);
        let mut carried = 0;
        for round in 0..100_000 {
            let mut header = [0u8; 20];
            header.iter_mut().for_each(|b| *b = next() as u8);
            header[8] = header[8].max(1);
            header[10..12].fill(0);
            let check = checksum(&header);
            header[10..12].copy_from_slice(&check.to_ne_bytes());
            carried += u32::from(check >= 0xfffe);
            let updated = ttl_decremented(check);
            header[8] -= 1;
            header[10..12].fill(0);
            // The kernel's arithmetic gives the recomputation's zero (0x0000), never 0xffff.
            assert_eq!(updated, checksum(&header), "round {round}");
        }
        assert!(carried > 0, "no checksum that carries");
    }

    /// A TCP segment over IPv4 with its pseudo header: (addresses, ports, checksum field, rest).
    struct Segment {
        addrs: [u8; 8],
        l4: [u8; 40],
    }

    impl Segment {
        fn random(next: &mut impl FnMut() -> u32) -> Self {
            let mut seg = Self { addrs: [0; 8], l4: [0; 40] };
            seg.addrs.iter_mut().chain(seg.l4.iter_mut()).for_each(|b| *b = next() as u8);
            seg
        }
        /// The bytes the checksum covers: pseudo header (addresses, protocol, length), segment.
        fn covered(&self) -> Vec<u8> {
            let mut v = self.addrs.to_vec();
            v.extend_from_slice(&[0, 6, 0, self.l4.len() as u8]);
            v.extend_from_slice(&self.l4);
            v
        }
        fn check(&self) -> u16 {
            u16::from_ne_bytes([self.l4[16], self.l4[17]])
        }
        fn set_check(&mut self, check: u16) {
            self.l4[16..18].copy_from_slice(&check.to_ne_bytes());
        }
        fn word(bytes: &[u8], at: usize) -> u32 {
            u32::from_ne_bytes(bytes[at..at + 4].try_into().unwrap())
        }
        /// Move to new addresses and ports: (the addresses' difference, old ports, new ports).
        fn translate(&mut self, next: &mut impl FnMut() -> u32) -> (u32, u32, u32) {
            let (src, dst, ports) = (next(), next(), next());
            let diff = fold32(word_diff(Self::word(&self.addrs, 0), src) + word_diff(Self::word(&self.addrs, 4), dst));
            let old_ports = Self::word(&self.l4, 0);
            self.addrs[..4].copy_from_slice(&src.to_ne_bytes());
            self.addrs[4..].copy_from_slice(&dst.to_ne_bytes());
            self.l4[..4].copy_from_slice(&ports.to_ne_bytes());
            (diff, old_ports, ports)
        }
    }

    /// A sum over `data` that verifies: all ones (either zero of one's complement).
    fn verifies(data: &[u8]) -> bool {
        let c = checksum(data);
        c == 0 || c == 0xffff
    }

    #[test]
    fn a_complete_checksum_fixed_as_the_kernel_does_verifies_after_translation() {
        let mut next = crate::test_numbers(0x51ed_270b);
        for round in 0..10_000 {
            let mut seg = Segment::random(&mut next);
            seg.set_check(0);
            let check = checksum(&seg.covered());
            seg.set_check(check);
            let (diff, old_ports, new_ports) = seg.translate(&mut next);
            let check = kernel::word_complete(kernel::pseudo_complete(check, diff), old_ports, new_ports);
            seg.set_check(check);
            assert!(verifies(&seg.covered()), "round {round}");
        }
    }

    #[test]
    fn a_checksum_left_to_the_device_keeps_the_pseudo_headers_sum_and_verifies_once_completed() {
        let mut next = crate::test_numbers(0x2545_f491);
        for round in 0..10_000 {
            let mut seg = Segment::random(&mut next);
            // As the sender's kernel leaves it: the pseudo header's sum, folded, not complemented.
            let pseudo = |seg: &Segment| !checksum(&seg.covered()[..12]);
            seg.set_check(pseudo(&seg));
            let before = seg.check();
            let (diff, _, _) = seg.translate(&mut next);
            let field = kernel::pseudo_partial(before, diff);
            assert!(
                field == pseudo(&seg) || field ^ pseudo(&seg) == 0xffff && field.is_multiple_of(0xffff),
                "round {round}"
            );
            // The device sums the segment from its L4 header on, the field included.
            seg.set_check(field);
            let device = checksum(&seg.l4);
            seg.set_check(device);
            assert!(verifies(&seg.covered()), "round {round}");
        }
    }

    #[test]
    fn the_field_after_the_pseudo_header_tells_the_two_states_apart() {
        let mut next = crate::test_numbers(0x0bad_5eed);
        let mut unknown = 0;
        for _ in 0..100_000 {
            let (before, diff, udp) = (next() as u16, next(), next().is_multiple_of(2));
            let complete = kernel::mangled(kernel::pseudo_complete(before, diff), udp);
            let partial = kernel::mangled(kernel::pseudo_partial(before, diff), udp);
            let (as_complete, as_partial) =
                (l4_state(before, complete, diff, udp), l4_state(before, partial, diff, udp));
            if udp && before == 0 {
                assert_eq!((as_complete, as_partial), (L4State::NoMore, L4State::NoMore));
            } else if complete == partial {
                assert_eq!((as_complete, as_partial), (L4State::Unknown, L4State::Unknown));
                unknown += 1;
            } else {
                assert_eq!((as_complete, as_partial), (L4State::Complete, L4State::NoMore));
            }
            // A field neither formula gives is not guessed at.
            let other = (0..=u16::MAX).find(|c| *c != complete && *c != partial).unwrap();
            if !(udp && before == 0) {
                assert_eq!(l4_state(before, other, diff, udp), L4State::Unknown);
            }
        }
        // Ambiguous only when the change sums to a zero: about 2 in 65,536.
        assert!(unknown < 20, "{unknown} of 100,000 ambiguous");
        // No change at all: both formulas agree, and the kernel is asked.
        assert_eq!(l4_state(0x1234, kernel::pseudo_complete(0x1234, 0), 0, false), L4State::Unknown);
    }
}
