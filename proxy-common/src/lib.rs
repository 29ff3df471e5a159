//! Map keys and values shared by kpr's eBPF programs (`proxy-ebpf`) and its agent (`proxy-user`).
//!
//! Layout rules (a pinned map outlives both sides, so the layout is an ABI):
//! - `#[repr(C)]`, `Copy`, explicit `_pad`, sizes asserted at compile time;
//! - addresses and ports in network byte order (the field says so);
//! - no `bool`, `Option` or enums in values; 32-bit ids.
//!
//! Any change to a layout here must bump [`PIN_LAYOUT_VERSION`], which versions the bpffs pin
//! directory, so an old agent's maps are never read with a new layout.
#![no_std]

/// Version of the pinned map layout; part of the bpffs pin directory (`<pin-root>/v<N>`).
pub const PIN_LAYOUT_VERSION: u32 = 2;

/// Map names, as seen by `bpftool map show` and used as pin file names.
pub mod map_names {
    pub const SERVICES: &str = "KPR_SERVICES";
    pub const BACKENDS: &str = "KPR_BACKENDS";
    pub const SOCK_REVNAT: &str = "KPR_SOCK_REVNAT";
    pub const COUNTERS: &str = "KPR_COUNTERS";
    pub const CONNTRACK: &str = "KPR_CONNTRACK";
    pub const NODE_ADDRS: &str = "KPR_NODE_ADDRS";
    pub const SOURCE_RANGES: &str = "KPR_SOURCE_RANGES";
}

/// Program names (the Rust function names in `proxy-ebpf`).
pub mod program_names {
    pub const CONNECT4: &str = "kpr_connect4";
    pub const SENDMSG4: &str = "kpr_sendmsg4";
    pub const RECVMSG4: &str = "kpr_recvmsg4";
    pub const GETPEERNAME4: &str = "kpr_getpeername4";
    pub const TC_INGRESS: &str = "kpr_tc_ingress";
    pub const TC_EGRESS: &str = "kpr_tc_egress";
}

/// Default map sizes; the agent can override them at start.
pub mod defaults {
    /// Service ports (ClusterIP:port/proto entries).
    pub const MAX_SERVICE_PORTS: u32 = 65_536;
    /// Backend slots across all service ports.
    pub const MAX_BACKENDS: u32 = 262_144;
    /// Sockets remembered for reverse translation (getpeername / recvmsg), LRU.
    pub const MAX_SOCK_REVNAT: u32 = 65_536;
    /// Per-packet conntrack entries (two per translated flow), LRU.
    pub const MAX_CONNTRACK: u32 = 262_144;
    /// Node addresses (NodePort frontends, SNAT).
    pub const MAX_NODE_ADDRS: u32 = 64;
    /// loadBalancerSourceRanges entries across all LoadBalancer frontends.
    pub const MAX_SOURCE_RANGES: u32 = 16_384;
}

/// `ServiceKey::scope`: which traffic a frontend entry is for.
pub const SCOPE_INTERNAL: u8 = 0;
/// External frontends (NodePort, externalIPs, LoadBalancer IPs): externalTrafficPolicy applies.
pub const SCOPE_EXTERNAL: u8 = 1;

/// `ServiceValue::flags`: masquerade (SNAT to the node) traffic of this frontend (eTP=Cluster).
pub const SERVICE_FLAG_SNAT: u32 = 1;
/// `ServiceValue::flags`: with no endpoints, drop instead of reject (traffic policy Local).
pub const SERVICE_FLAG_DROP_NO_ENDPOINTS: u32 = 2;
/// `ServiceValue::flags`: only clients in `KPR_SOURCE_RANGES` for this service id may connect
/// (loadBalancerSourceRanges); others are dropped.
pub const SERVICE_FLAG_SOURCE_RANGES: u32 = 4;

/// First and last port used for SNAT (masquerade) of per-packet flows.
pub const SNAT_PORT_MIN: u16 = 32_768;
pub const SNAT_PORT_MAX: u16 = 60_999;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// Key of `KPR_SERVICES`: one service port.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    /// IPv4 address, network byte order.
    pub addr: u32,
    /// Port, network byte order.
    pub port: u16,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    /// `SCOPE_INTERNAL` (ClusterIP) or `SCOPE_EXTERNAL`. A NodePort entry has `addr` 0: it
    /// matches every address in `KPR_NODE_ADDRS`.
    pub scope: u8,
}

/// Value of `KPR_SERVICES`: where this service port's backends sit in `KPR_BACKENDS`.
///
/// The agent never edits a live range: it writes a new range, then replaces this value in one
/// map update, so a reader sees either the old backend set or the new one, never a mix.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceValue {
    /// Stable id of the service port (counters, reverse NAT in later datapaths). Never 0.
    pub service_id: u32,
    /// First slot in `KPR_BACKENDS`.
    pub backends_start: u32,
    /// Number of slots; 0 means "no endpoints": the connection is rejected.
    pub backends_count: u32,
    /// `SERVICE_FLAG_*` bits.
    pub flags: u32,
}

/// Value of `KPR_BACKENDS` (an array indexed by slot).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Backend {
    /// IPv4 address, network byte order.
    pub addr: u32,
    /// Port, network byte order.
    pub port: u16,
    pub _pad: u16,
}

/// Key of `KPR_SOCK_REVNAT`: a socket and the backend it was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockRevNatKey {
    /// `bpf_get_socket_cookie` of the client socket.
    pub cookie: u64,
    /// Backend IPv4 address, network byte order.
    pub addr: u32,
    /// Backend port, network byte order.
    pub port: u16,
    pub _pad: u16,
}

/// Value of `KPR_SOCK_REVNAT`: the service address the application asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockRevNatValue {
    /// Service IPv4 address, network byte order.
    pub addr: u32,
    /// Service port, network byte order.
    pub port: u16,
    pub _pad: u16,
    pub service_id: u32,
}

/// Key of `KPR_CONNTRACK`: a packet's 5-tuple as it arrives (addresses and ports in network
/// byte order). Each translated flow has two entries: the client's direction and the reply's.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtKey {
    pub src_addr: u32,
    pub dst_addr: u32,
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// Value of `KPR_CONNTRACK`: what the packet's addresses and ports are rewritten to.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtValue {
    pub src_addr: u32,
    pub dst_addr: u32,
    pub src_port: u16,
    pub dst_port: u16,
    pub service_id: u32,
}

/// Data of a `KPR_SOURCE_RANGES` LPM key: the prefix length covers all of `service_id` (32
/// bits) plus the CIDR's bits of `addr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SourceRange {
    /// Service id, big-endian (LPM compares bytes in order).
    pub service_id: u32,
    /// Client IPv4 address or CIDR base, network byte order.
    pub addr: u32,
}

/// Indexes of the per-CPU `KPR_COUNTERS` array: what the datapath did, without logging.
pub mod counter {
    /// A connect/sendmsg to a service port was sent to a backend.
    pub const TRANSLATED: u32 = 0;
    /// A service port with no endpoints: the connect/sendmsg was refused.
    pub const NO_BACKENDS: u32 = 1;
    /// A service slot pointed outside the backend array (should never happen): passed untouched.
    pub const BAD_BACKEND_SLOT: u32 = 2;
    /// The reverse-translation entry could not be stored (getpeername would show the backend).
    pub const REVNAT_UPDATE_FAILED: u32 = 3;
    /// recvmsg/getpeername rewrote a backend address back to the service address.
    pub const REVERSE_TRANSLATED: u32 = 4;
    /// tc: a new flow to a frontend was translated (DNAT, maybe SNAT).
    pub const TC_NEW_FLOW: u32 = 5;
    /// tc: a packet of a known flow (either direction) was translated.
    pub const TC_CT_HIT: u32 = 6;
    /// tc: a frontend without endpoints: TCP reset or ICMP port unreachable sent back
    /// (kube-proxy's REJECT).
    pub const TC_REJECTED: u32 = 7;
    /// tc: dropped (no local endpoint for traffic policy Local, source not in
    /// loadBalancerSourceRanges, a non-SYN TCP packet for a service without endpoints).
    pub const TC_DROPPED: u32 = 8;
    /// tc: no free SNAT port found for a new flow: dropped.
    pub const TC_SNAT_EXHAUSTED: u32 = 9;
    /// tc: conntrack entry could not be stored: dropped (the flow could not be reversed).
    pub const TC_CT_FULL: u32 = 10;
    /// tc: IPv4 fragment or header with options: passed untranslated.
    pub const TC_PASSED_UNSUPPORTED: u32 = 11;
    /// Number of counters.
    pub const COUNT: u32 = 12;
    /// Names for display, by index.
    pub const NAMES: [&str; COUNT as usize] = [
        "translated",
        "no_backends_rejected",
        "bad_backend_slot",
        "revnat_update_failed",
        "reverse_translated",
        "tc_new_flow",
        "tc_ct_hit",
        "tc_rejected",
        "tc_dropped",
        "tc_snat_exhausted",
        "tc_ct_full",
        "tc_passed_unsupported",
    ];
}

const _: () = assert!(size_of::<ServiceKey>() == 8);
const _: () = assert!(size_of::<ServiceValue>() == 16);
const _: () = assert!(size_of::<Backend>() == 8);
const _: () = assert!(size_of::<SockRevNatKey>() == 16);
const _: () = assert!(size_of::<SockRevNatValue>() == 12);
const _: () = assert!(size_of::<CtKey>() == 16);
const _: () = assert!(size_of::<CtValue>() == 16);
const _: () = assert!(size_of::<SourceRange>() == 8);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are repr(C) with explicit padding and only integer fields.
    unsafe impl aya::Pod for super::ServiceKey {}
    unsafe impl aya::Pod for super::ServiceValue {}
    unsafe impl aya::Pod for super::Backend {}
    unsafe impl aya::Pod for super::SockRevNatKey {}
    unsafe impl aya::Pod for super::SockRevNatValue {}
    unsafe impl aya::Pod for super::CtKey {}
    unsafe impl aya::Pod for super::CtValue {}
    unsafe impl aya::Pod for super::SourceRange {}
}
