//! What differs between IPv4 and IPv6 on the per-packet path, behind one trait: the per-packet
//! code (`tc`) is written once, generic over it, and compiled for each family
//! (constant offsets, no run-time branching on the family past the EtherType). Each family is
//! also compiled for links without an Ethernet header (`V4<0>`, `V6<0>`: IP-in-IP and other
//! L3 tunnels), where the IP header is the packet's first byte.
use aya_ebpf::bindings::{
    BPF_F_ADJ_ROOM_DECAP_L3_IPV4, BPF_F_ADJ_ROOM_DECAP_L3_IPV6, BPF_F_ADJ_ROOM_ENCAP_L3_IPV4,
    BPF_F_ADJ_ROOM_ENCAP_L3_IPV6, bpf_fib_lookup,
};
use network_types::{
    eth::EtherType,
    ip::{Ipv4Hdr, Ipv6Hdr},
};
use proxy_common::{Addr, Addr4, FlowAddr, LinkInfo, csum};

use crate::{
    maps::FlowTables,
    packet::{ETH_LEN, read_word, write_word},
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// The functions given a header (`ip: &Self::Ip`) read its words whole ([`read_word`]): the
/// header is in the packet, or a copy in a `WordAligned` (anywhere else on the stack the
/// verifier refuses the program when it loads).
pub trait Family {
    /// The IP header, without options or extension headers.
    type Ip: Copy;
    /// How this family's conntrack keys hold an address (which picks its tables).
    type FlowAddr: FlowTables;
    const ETH_TYPE: u16;
    /// `bpf_fib_lookup`'s family.
    const AF: u8;
    /// Where the IP header starts: after the Ethernet header, or first on a link without one.
    const IP_OFF: usize;
    /// The packet has an Ethernet header (MAC addresses to write or swap), and its link can
    /// be sent to straight from tc (`bpf_redirect_neigh`, `bpf_redirect_peer`).
    const ETHERNET: bool = Self::IP_OFF != 0;
    /// Where the L4 header starts (no options, no extension headers).
    const L4_OFF: usize = Self::IP_OFF + size_of::<Self::Ip>();
    /// ICMP's protocol number in this family.
    const ICMP_PROTO: u8;
    /// ICMP "port unreachable": type and code.
    const PORT_UNREACHABLE: [u8; 2];
    /// ICMP's checksum covers a pseudo header (ICMPv6 does, ICMPv4 does not).
    const ICMP_PSEUDO_HEADER: bool;
    /// The kernel checks an arriving packet's source (IPv4's `fib_validate_source`; IPv6 has
    /// no such checks): one of the node's own addresses is a martian unless the link has
    /// `accept_local`, and with `rp_filter` the route back to it must exist (loose) or leave
    /// by the link the packet came in by (strict).
    const KERNEL_CHECKS_SOURCE: bool;
    /// The smallest MTU a link of this family may have (IPv4: 68, IPv6: 1280): a packet no
    /// longer fits every link.
    const MIN_MTU: u32;

    /// The ICMP errors that quote the packet they are about.
    fn quotes_packet(icmp_type: u8) -> bool;
    /// Where a packet stands in a datagram in fragments (IPv6's fragment header is an extension
    /// header: such packets are never parsed this far).
    fn fragment(ip: &Self::Ip) -> Fragment;
    /// The IP id of a fragment (IPv4), as in the packet.
    fn fragment_id(ip: &Self::Ip) -> Option<u16>;
    /// The length of what follows the header.
    fn l4_len(ip: &Self::Ip) -> u16;
    /// The protocol of what follows the header; `None` for what the program does not parse
    /// (IPv4 options, IPv6 extension headers).
    fn l4_proto(ip: &Self::Ip) -> Option<u8>;
    fn src(ip: &Self::Ip) -> Addr;
    fn dst(ip: &Self::Ip) -> Addr;
    /// The same address (of this family: an IPv4 flow's addresses are all mapped, and only
    /// their last word is compared).
    fn same_addr(a: &Addr, b: &Addr) -> bool;
    /// One's complement difference of an address going from `old` to `new`.
    #[inline(always)]
    fn addr_diff(old: &Addr, new: &Addr) -> u64 {
        Self::FlowAddr::csum_diff(old, new)
    }
    /// An address as a pseudo header sums it.
    fn addr_sum(addr: &Addr) -> u64;
    /// Write the addresses into the header at `ip`; `diff` is theirs (`addr_diff`), for a
    /// header checksum.
    ///
    /// # Safety
    /// `ip` points to a whole header inside the packet.
    unsafe fn write_addrs(ip: *mut u8, src: &Addr, dst: &Addr, diff: u64);
    /// The header of a packet kpr answers with (a reset, an ICMP error), checksum included.
    fn reply_header(src: &Addr, dst: &Addr, proto: u8, payload_len: u16) -> Self::Ip;
    /// The address MASQUERADE picks on `link`, if it has one.
    fn masquerade_addr(link: &LinkInfo) -> Option<Addr>;
    /// The header's protocol field (IPv4) or next header (IPv6), as it is.
    fn next_header(ip: &Self::Ip) -> u8;
    /// A route lookup's protocol, addresses and the header's traffic class.
    #[inline(always)]
    fn fib_params(params: &mut bpf_fib_lookup, ip: &Self::Ip) {
        params.l4_protocol = Self::next_header(ip);
        Self::fib_tos(params, ip);
        Self::fib_src(params, &Self::src(ip));
        Self::fib_dst(params, &Self::dst(ip));
    }
    /// Parts of it: the header's traffic class, a source and a destination address.
    fn fib_tos(params: &mut bpf_fib_lookup, ip: &Self::Ip);
    fn fib_src(params: &mut bpf_fib_lookup, src: &Addr);
    fn fib_dst(params: &mut bpf_fib_lookup, dst: &Addr);
    /// The TTL / hop limit.
    fn hops(ip: &Self::Ip) -> u8;
    /// A router may cut the packet into fragments (IPv4 without "don't fragment"; an IPv6
    /// router never does).
    fn may_fragment(ip: &Self::Ip) -> bool;
    /// The ICMP header of "fragmentation needed" (IPv6: "packet too big") for a link of `mtu`,
    /// its checksum left 0.
    fn too_big_header(mtu: u16) -> [u8; 8];
    /// Take one off the TTL / hop limit, as forwarding does.
    ///
    /// # Safety
    /// `ip` points to a whole header inside the packet.
    unsafe fn decrement_hops(ip: *mut u8);

    /// Direct server return's IP-in-IP: the outer header's protocol (IPv4 in IPv4: 4; IPv6 in
    /// IPv6: 41), and `bpf_skb_adjust_room`'s flags that add and (6.3+) remove it.
    const TUNNEL_PROTO: u8;
    const TUNNEL_ENCAP_FLAGS: u64;
    const TUNNEL_DECAP_FLAGS: u64;
    /// The outer header to `endpoint` (checksum included), with the endpoint's port
    /// (network order) where the receiving node reads it (`tunnel_port`): IPv4's id, IPv6's
    /// flow label. Don't fragment: the client learns the tunnel's room (ICMP).
    fn tunnel_header(src: &Addr, endpoint: &Addr, inner_len: u16, port: u16) -> Self::Ip;
    fn tunnel_port(ip: &Self::Ip) -> u16;
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Fragment {
    Whole,
    /// The first fragment (it has the ports), with its IP id as in the packet.
    First(u16),
    Later,
}

/// A pseudo header's sum (TCP, UDP, ICMPv6 checksums).
#[inline(always)]
pub fn pseudo_sum<F: Family>(src: &Addr, dst: &Addr, proto: u8, len: u16) -> u64 {
    F::addr_sum(src) + F::addr_sum(dst) + u64::from(u16::from_be(u16::from(proto))) + u64::from(len.to_be())
}

/// IPv4, its header at `IP_OFF` (behind Ethernet unless said otherwise).
pub struct V4<const IP_OFF: usize = ETH_LEN>;
/// IPv6, the same.
pub struct V6<const IP_OFF: usize = ETH_LEN>;

impl<const IP_OFF: usize> Family for V4<IP_OFF> {
    type Ip = Ipv4Hdr;
    type FlowAddr = Addr4;
    const ETH_TYPE: u16 = EtherType::Ipv4 as u16;
    const AF: u8 = AF_INET;
    const IP_OFF: usize = IP_OFF;
    const ICMP_PROTO: u8 = 1;
    const PORT_UNREACHABLE: [u8; 2] = [3, 3];
    const ICMP_PSEUDO_HEADER: bool = false;
    const KERNEL_CHECKS_SOURCE: bool = true;
    const MIN_MTU: u32 = 68;
    const TUNNEL_PROTO: u8 = 4;
    const TUNNEL_ENCAP_FLAGS: u64 = BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 as u64;
    const TUNNEL_DECAP_FLAGS: u64 = BPF_F_ADJ_ROOM_DECAP_L3_IPV4 as u64;

    #[inline(always)]
    fn quotes_packet(icmp_type: u8) -> bool {
        // Destination unreachable, time exceeded, parameter problem.
        icmp_type == 3 || icmp_type == 11 || icmp_type == 12
    }
    #[inline(always)]
    fn fragment(ip: &Ipv4Hdr) -> Fragment {
        // SAFETY (and below): a field of a header in the packet or word aligned (see `Family`).
        let frags = u16::from_be(unsafe { read_word(ip.frags.as_ptr()) });
        if frags & 0x1fff != 0 {
            Fragment::Later
        } else if frags & 0x2000 != 0 {
            Fragment::First(unsafe { read_word(ip.id.as_ptr()) })
        } else {
            Fragment::Whole
        }
    }
    #[inline(always)]
    fn fragment_id(ip: &Ipv4Hdr) -> Option<u16> {
        Some(unsafe { read_word(ip.id.as_ptr()) })
    }
    #[inline(always)]
    fn l4_len(ip: &Ipv4Hdr) -> u16 {
        u16::from_be(unsafe { read_word(ip.tot_len.as_ptr()) }).saturating_sub(20)
    }
    #[inline(always)]
    fn l4_proto(ip: &Ipv4Hdr) -> Option<u8> {
        (ip.vihl == 0x45).then_some(ip.proto)
    }
    #[inline(always)]
    fn src(ip: &Ipv4Hdr) -> Addr {
        Addr::from_v4(unsafe { read_word(ip.src_addr.as_ptr()) })
    }
    #[inline(always)]
    fn dst(ip: &Ipv4Hdr) -> Addr {
        Addr::from_v4(unsafe { read_word(ip.dst_addr.as_ptr()) })
    }
    #[inline(always)]
    fn same_addr(a: &Addr, b: &Addr) -> bool {
        a.v4() == b.v4()
    }
    #[inline(always)]
    fn addr_sum(addr: &Addr) -> u64 {
        u64::from(addr.v4())
    }
    #[inline(always)]
    unsafe fn write_addrs(ip: *mut u8, src: &Addr, dst: &Addr, diff: u64) {
        unsafe {
            write_word(ip.add(10), csum::replace(read_word(ip.add(10)), diff));
            write_word(ip.add(12), src.v4());
            write_word(ip.add(16), dst.v4());
        }
    }
    #[inline(always)]
    fn reply_header(src: &Addr, dst: &Addr, proto: u8, payload_len: u16) -> Ipv4Hdr {
        header4(src, dst, proto, payload_len, 0)
    }
    #[inline(always)]
    fn tunnel_header(src: &Addr, endpoint: &Addr, inner_len: u16, port: u16) -> Ipv4Hdr {
        header4(src, endpoint, Self::TUNNEL_PROTO, inner_len, port)
    }
    #[inline(always)]
    fn tunnel_port(ip: &Ipv4Hdr) -> u16 {
        // SAFETY: a field of a header in the packet or word aligned (see `Family`).
        unsafe { read_word(ip.id.as_ptr()) }
    }
    #[inline(always)]
    fn masquerade_addr(link: &LinkInfo) -> Option<Addr> {
        (link.addr != 0).then_some(Addr::from_v4(link.addr))
    }
    #[inline(always)]
    fn next_header(ip: &Ipv4Hdr) -> u8 {
        ip.proto
    }
    #[inline(always)]
    fn fib_tos(params: &mut bpf_fib_lookup, ip: &Ipv4Hdr) {
        params.__bindgen_anon_2.tos = ip.tos;
    }
    #[inline(always)]
    fn fib_src(params: &mut bpf_fib_lookup, src: &Addr) {
        params.__bindgen_anon_3.ipv4_src = src.v4();
    }
    #[inline(always)]
    fn fib_dst(params: &mut bpf_fib_lookup, dst: &Addr) {
        params.__bindgen_anon_4.ipv4_dst = dst.v4();
    }
    #[inline(always)]
    fn hops(ip: &Ipv4Hdr) -> u8 {
        ip.ttl
    }
    #[inline(always)]
    fn may_fragment(ip: &Ipv4Hdr) -> bool {
        u16::from_be(unsafe { read_word(ip.frags.as_ptr()) }) & 0x4000 == 0
    }
    #[inline(always)]
    fn too_big_header(mtu: u16) -> [u8; 8] {
        // Destination unreachable, fragmentation needed; the next hop's MTU in the last two bytes.
        let [hi, lo] = mtu.to_be_bytes();
        [3, 4, 0, 0, 0, 0, hi, lo]
    }
    #[inline(always)]
    unsafe fn decrement_hops(ip: *mut u8) {
        unsafe {
            write_word(ip.add(10), csum::ttl_decremented(read_word(ip.add(10))));
            ip.add(8).write(ip.add(8).read() - 1);
        }
    }
}

impl<const IP_OFF: usize> Family for V6<IP_OFF> {
    type Ip = Ipv6Hdr;
    type FlowAddr = Addr;
    const ETH_TYPE: u16 = EtherType::Ipv6 as u16;
    const AF: u8 = AF_INET6;
    const IP_OFF: usize = IP_OFF;
    const ICMP_PROTO: u8 = 58;
    const PORT_UNREACHABLE: [u8; 2] = [1, 4];
    const ICMP_PSEUDO_HEADER: bool = true;
    const KERNEL_CHECKS_SOURCE: bool = false;
    const MIN_MTU: u32 = 1280;
    const TUNNEL_PROTO: u8 = 41;
    const TUNNEL_ENCAP_FLAGS: u64 = BPF_F_ADJ_ROOM_ENCAP_L3_IPV6 as u64;
    const TUNNEL_DECAP_FLAGS: u64 = BPF_F_ADJ_ROOM_DECAP_L3_IPV6 as u64;

    #[inline(always)]
    fn quotes_packet(icmp_type: u8) -> bool {
        // Destination unreachable, packet too big, time exceeded, parameter problem.
        (1..=4).contains(&icmp_type)
    }
    #[inline(always)]
    fn fragment(_: &Ipv6Hdr) -> Fragment {
        Fragment::Whole
    }
    #[inline(always)]
    fn fragment_id(_: &Ipv6Hdr) -> Option<u16> {
        None
    }
    #[inline(always)]
    fn l4_len(ip: &Ipv6Hdr) -> u16 {
        // SAFETY (and below): a field of a header in the packet or word aligned (see `Family`).
        u16::from_be(unsafe { read_word(ip.payload_len.as_ptr()) })
    }
    #[inline(always)]
    fn l4_proto(ip: &Ipv6Hdr) -> Option<u8> {
        // Extension headers (hop-by-hop, routing, fragment, ESP, AH, destination options,
        // mobility, HIP, shim6, experiments) are not walked: such packets pass untouched.
        match ip.next_hdr {
            0 | 43 | 44 | 50 | 51 | 60 | 135 | 139 | 140 | 253 | 254 => None,
            proto => Some(proto),
        }
    }
    #[inline(always)]
    fn src(ip: &Ipv6Hdr) -> Addr {
        Addr(unsafe { read_word(ip.src_addr.as_ptr()) })
    }
    #[inline(always)]
    fn dst(ip: &Ipv6Hdr) -> Addr {
        Addr(unsafe { read_word(ip.dst_addr.as_ptr()) })
    }
    #[inline(always)]
    fn same_addr(a: &Addr, b: &Addr) -> bool {
        a.same(b)
    }
    #[inline(always)]
    fn addr_sum(addr: &Addr) -> u64 {
        addr.0.iter().map(|w| u64::from(*w)).sum()
    }
    #[inline(always)]
    unsafe fn write_addrs(ip: *mut u8, src: &Addr, dst: &Addr, _diff: u64) {
        // No header checksum in IPv6.
        unsafe {
            write_word(ip.add(8), src.0);
            write_word(ip.add(24), dst.0);
        }
    }
    #[inline(always)]
    fn reply_header(src: &Addr, dst: &Addr, proto: u8, payload_len: u16) -> Ipv6Hdr {
        // SAFETY: 16 plain bytes each way.
        let (src_addr, dst_addr) = unsafe {
            (core::mem::transmute::<[u32; 4], [u8; 16]>(src.0), core::mem::transmute::<[u32; 4], [u8; 16]>(dst.0))
        };
        Ipv6Hdr {
            vcf: [0x60, 0, 0, 0],
            payload_len: payload_len.to_be_bytes(),
            next_hdr: proto,
            hop_limit: 64,
            src_addr,
            dst_addr,
        }
    }
    #[inline(always)]
    fn tunnel_header(src: &Addr, endpoint: &Addr, inner_len: u16, port: u16) -> Ipv6Hdr {
        let mut ip = Self::reply_header(src, endpoint, Self::TUNNEL_PROTO, inner_len);
        // The flow label's last 16 bits.
        let [hi, lo] = port.to_ne_bytes();
        ip.vcf = [0x60, 0, hi, lo];
        ip
    }
    #[inline(always)]
    fn tunnel_port(ip: &Ipv6Hdr) -> u16 {
        // SAFETY: a field of a header in the packet or word aligned (see `Family`).
        unsafe { read_word(ip.vcf.as_ptr().add(2)) }
    }
    #[inline(always)]
    fn masquerade_addr(link: &LinkInfo) -> Option<Addr> {
        (!link.addr6.is_unspecified()).then_some(link.addr6)
    }
    #[inline(always)]
    fn next_header(ip: &Ipv6Hdr) -> u8 {
        ip.next_hdr
    }
    #[inline(always)]
    fn fib_tos(params: &mut bpf_fib_lookup, ip: &Ipv6Hdr) {
        params.__bindgen_anon_2.flowinfo = unsafe { read_word::<u32>(ip.vcf.as_ptr()) } & u32::from_be(0x0fff_ffff);
    }
    #[inline(always)]
    fn fib_src(params: &mut bpf_fib_lookup, src: &Addr) {
        params.__bindgen_anon_3.ipv6_src = src.0;
    }
    #[inline(always)]
    fn fib_dst(params: &mut bpf_fib_lookup, dst: &Addr) {
        params.__bindgen_anon_4.ipv6_dst = dst.0;
    }
    #[inline(always)]
    fn hops(ip: &Ipv6Hdr) -> u8 {
        ip.hop_limit
    }
    #[inline(always)]
    fn may_fragment(_: &Ipv6Hdr) -> bool {
        false
    }
    #[inline(always)]
    fn too_big_header(mtu: u16) -> [u8; 8] {
        // Packet too big; the MTU in the last four bytes.
        let [hi, lo] = mtu.to_be_bytes();
        [2, 0, 0, 0, 0, 0, hi, lo]
    }
    #[inline(always)]
    unsafe fn decrement_hops(ip: *mut u8) {
        unsafe { ip.add(7).write(ip.add(7).read() - 1) };
    }
}

/// An IPv4 header kpr sends (an answer, a tunnel's), its id as given (network order).
#[inline(always)]
fn header4(src: &Addr, dst: &Addr, proto: u8, payload_len: u16, id: u16) -> Ipv4Hdr {
    // ICMP errors carry the "internetwork control" precedence, as Linux sends them.
    let (tos, frags) = if proto == 1 { (0xc0, [0, 0]) } else { (0, [0x40, 0]) };
    let mut ip = Ipv4Hdr {
        vihl: 0x45,
        tos,
        tot_len: (payload_len + 20).to_be_bytes(),
        id: id.to_ne_bytes(),
        frags,
        ttl: 64,
        proto,
        check: [0; 2],
        src_addr: src.v4().to_ne_bytes(),
        dst_addr: dst.v4().to_ne_bytes(),
    };
    // SAFETY: Ipv4Hdr is 20 plain bytes.
    let words: [u16; 10] = unsafe { core::mem::transmute(ip) };
    let mut sum = 0u64;
    for w in words {
        sum += u64::from(w);
    }
    ip.check = (!csum::fold16(sum)).to_ne_bytes();
    ip
}
