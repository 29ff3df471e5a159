//! Offsets into a packet, shared by the tc programs. The IP header starts at `Family::IP_OFF`
//! (after Ethernet, or first); L4 fields are relative to the L4 header, which starts at
//! `Family::L4_OFF`.
pub const ETH_LEN: usize = 14;

pub const TCP_CSUM: usize = 16;
pub const UDP_CSUM: usize = 6;
pub const TCP_FLAGS: usize = 13;
/// SCTP's CRC32c (little-endian) and the type of the packet's first chunk.
pub const SCTP_CSUM: usize = 8;
pub const SCTP_CHUNK_TYPE: usize = 12;
pub use proxy_common::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

/// ICMP (either family): the checksum, and the quoted packet of an error.
pub const ICMP_CSUM: usize = 2;
pub const ICMP_QUOTE: usize = 8;

/// A field of the packet (or of a header copy in a [`WordAligned`]) read as one access of its
/// width, as C BPF programs read `struct iphdr`'s fields. The packet gives no alignment (behind
/// Ethernet an IP address sits 2 bytes past a 4-byte boundary), and Rust's unaligned reads
/// compile for BPF to a load per byte with shifts and ors to put the word together, which
/// made up much of the per-packet path. The verifier accepts unaligned packet access where
/// the CPU does (x86-64, arm64: `CONFIG_HAVE_EFFICIENT_UNALIGNED_ACCESS`); it never accepts
/// unaligned stack access, hence `WordAligned` for copies.
///
/// # Safety
/// `at` is readable for `size_of::<T>()` bytes: packet memory, or a field of a `WordAligned`
/// header at an offset that is a multiple of the field's width.
#[inline(always)]
pub unsafe fn read_word<T: Copy>(at: *const u8) -> T {
    unsafe { at.cast::<T>().read() }
}

/// [`read_word`]'s write.
///
/// # Safety
/// As for `read_word`, writable.
#[inline(always)]
pub unsafe fn write_word<T>(at: *mut u8, value: T) {
    unsafe { at.cast::<T>().write(value) }
}

/// A copy of a header on the BPF stack at a word boundary, so that its fields' word reads
/// ([`read_word`]) are aligned (IP headers have their words at multiples of their width).
#[repr(C, align(4))]
#[derive(Clone, Copy)]
pub struct WordAligned<T>(pub T);
