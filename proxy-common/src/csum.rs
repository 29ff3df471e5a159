//! The Internet checksum (RFC 1071) updated in registers when fields change (RFC 1624's
//! `HC' = ~(~HC + ~m + m')`): the tc programs rewrite the IP header in place with it, and hand
//! the same differences to the kernel for the L4 checksum. Byte order does not matter to a
//! one's complement sum, so values are used as read from the packet.

/// The difference of replacing the 32-bit word `old` by `new`, as a sum to accumulate.
#[inline(always)]
pub const fn word_diff(old: u32, new: u32) -> u64 {
    (!old) as u64 + new as u64
}

/// The difference of replacing the 16-bit word `old` by `new`.
#[inline(always)]
pub const fn half_diff(old: u16, new: u16) -> u64 {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
