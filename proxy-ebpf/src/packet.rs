//! Offsets into an Ethernet + IPv4 (no options) packet, shared by the tc programs.
pub const ETH_LEN: usize = 14;
pub const IP_OFF: usize = ETH_LEN;
pub const IP_TTL_OFF: usize = IP_OFF + 8;
pub const IP_CSUM_OFF: usize = IP_OFF + 10;
pub const IP_SRC_OFF: usize = IP_OFF + 12;
pub const IP_DST_OFF: usize = IP_OFF + 16;
pub const L4_OFF: usize = IP_OFF + 20;
pub const TCP_CSUM_OFF: usize = L4_OFF + 16;
pub const UDP_CSUM_OFF: usize = L4_OFF + 6;
pub const TCP_FLAGS_OFF: usize = L4_OFF + 13;
/// SCTP's CRC32c (little-endian) and the type of the packet's first chunk.
pub const SCTP_CSUM_OFF: usize = L4_OFF + 8;
pub const SCTP_CHUNK_TYPE_OFF: usize = L4_OFF + 12;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_ACK: u8 = 0x10;
pub const TCP_RST: u8 = 0x04;
pub const TCP_FIN: u8 = 0x01;

pub const IPPROTO_ICMP: u8 = 1;
pub const ICMP_OFF: usize = L4_OFF;
pub const ICMP_CSUM_OFF: usize = ICMP_OFF + 2;
/// The IPv4 header an ICMP error quotes, and the start of its L4 header.
pub const INNER_IP_OFF: usize = ICMP_OFF + 8;
pub const INNER_CSUM_OFF: usize = INNER_IP_OFF + 10;
pub const INNER_SRC_OFF: usize = INNER_IP_OFF + 12;
pub const INNER_DST_OFF: usize = INNER_IP_OFF + 16;
pub const INNER_L4_OFF: usize = INNER_IP_OFF + 20;
