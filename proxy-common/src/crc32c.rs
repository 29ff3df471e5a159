//! SCTP's checksum (CRC32c, RFC 9260 appendix A) after a port rewrite, without reading the
//! packet again: a CRC is linear, so the checksum of the rewritten packet is the old one XOR
//! the CRC (zero start, no final XOR) of the difference: four bytes of changed ports followed
//! by the rest of the packet as zeros. Appending n zeros is a multiplication by x^(8n) modulo
//! the polynomial (as zlib's `crc32_combine`). Tables computed at build time keep the eBPF
//! side short: the verifier walks this code once per path that reaches it.
//! Polynomials are bit-reflected: bit 31 is x^0.

/// CRC32c's polynomial, reflected.
pub const POLY: u32 = 0x82f6_3b78;

/// `a * b` modulo the polynomial. Branch-free: the verifier sees one path.
#[inline(always)]
pub const fn mul_mod(a: u32, mut b: u32) -> u32 {
    let mut product = 0u32;
    let mut i = 0;
    while i < 32 {
        product ^= b & 0u32.wrapping_sub((a >> (31 - i)) & 1);
        b = (b >> 1) ^ (POLY & 0u32.wrapping_sub(b & 1));
        i += 1;
    }
    product
}

/// x^(8 * step * i) modulo the polynomial for i in 0..256: appending `step * i` zero bytes.
const fn zeros_table(step_bits: u32) -> [u32; 256] {
    // x^(8 * step), by squaring x (bit 30) `step_bits` + 3 times.
    let mut x8step = 1u32 << 30;
    let mut k = 0;
    while k < step_bits + 3 {
        x8step = mul_mod(x8step, x8step);
        k += 1;
    }
    let mut table = [0u32; 256];
    let mut power = 1u32 << 31; // x^0
    let mut i = 0;
    while i < 256 {
        table[i] = power;
        power = mul_mod(power, x8step);
        i += 1;
    }
    table
}

/// Appending 0..256 zero bytes, and 0, 256, 512, … 65280 zero bytes.
static ZEROS_LOW: [u32; 256] = zeros_table(0);
static ZEROS_HIGH: [u32; 256] = zeros_table(8);

/// The byte-at-a-time CRC32c table (zero start).
static BYTES: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = (crc >> 1) ^ (POLY & 0u32.wrapping_sub(crc & 1));
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// What to XOR into an SCTP checksum (read as a little-endian u32, as it sits in the packet)
/// when the first four bytes of the `len`-byte SCTP packet (its ports) change from `old` to
/// `new` (each as read from the packet in native order).
#[inline(always)]
pub fn port_rewrite_delta(old: u32, new: u32, len: u16) -> u32 {
    // The CRC of the four changed bytes from a zero start, a byte at a time. The table is
    // linear, so `BYTES[crc ^ byte]` is looked up as `BYTES[crc] ^ BYTES[byte]`: every index is
    // a plain mask or shift, whose bounds every verifier follows (older ones lose them
    // through an XOR).
    // The changed bytes in packet order, the first in the low byte.
    let diff = u32::from_le_bytes((old ^ new).to_ne_bytes());
    let mut crc = 0u32;
    let mut i = 0;
    while i < 4 {
        let byte = (diff >> (8 * i)) & 0xff;
        crc = (crc >> 8) ^ BYTES[(crc & 0xff) as usize] ^ BYTES[byte as usize];
        i += 1;
    }
    // ...followed by the rest of the packet, which did not change, as zeros.
    let zeros = len.saturating_sub(4);
    mul_mod(ZEROS_HIGH[(zeros >> 8) as usize], mul_mod(ZEROS_LOW[(zeros & 0xff) as usize], crc))
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    /// The plain bitwise CRC32c (start and final XOR with all ones), as RFC 9260 computes it.
    fn crc32c(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &byte in data {
            crc ^= u32::from(byte);
            for _ in 0..8 {
                crc = (crc >> 1) ^ (POLY & 0u32.wrapping_sub(crc & 1));
            }
        }
        !crc
    }

    #[test]
    fn the_reference_crc_is_crc32c() {
        // RFC 3720's test vector: 32 bytes of zeros.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn a_port_rewrite_delta_equals_a_full_recomputation() {
        let mut next = crate::test_numbers(0x1234_5678);
        for len in [12usize, 16, 28, 48, 61, 100, 1480, 9000, 65_535] {
            let mut packet: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            packet[8..12].fill(0);
            let old_sum = crc32c(&packet);
            let old = u32::from_ne_bytes(packet[..4].try_into().unwrap());
            let new = next();
            packet[..4].copy_from_slice(&new.to_ne_bytes());
            let expected = crc32c(&packet);
            assert_eq!(old_sum ^ port_rewrite_delta(old, new, len as u16), expected, "length {len}");
        }
    }
}
