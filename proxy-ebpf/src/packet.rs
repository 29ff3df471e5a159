//! Offsets into an Ethernet + IP packet, shared by the tc programs. L4 fields are relative to
//! the L4 header, which starts at `Family::L4_OFF`.
pub const ETH_LEN: usize = 14;
pub const IP_OFF: usize = ETH_LEN;

pub const TCP_CSUM: usize = 16;
pub const UDP_CSUM: usize = 6;
pub const TCP_FLAGS: usize = 13;
/// SCTP's CRC32c (little-endian) and the type of the packet's first chunk.
pub const SCTP_CSUM: usize = 8;
pub const SCTP_CHUNK_TYPE: usize = 12;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_ACK: u8 = 0x10;
pub const TCP_RST: u8 = 0x04;
pub const TCP_FIN: u8 = 0x01;

/// ICMP (either family): the checksum, and the quoted packet of an error.
pub const ICMP_CSUM: usize = 2;
pub const ICMP_QUOTE: usize = 8;
