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
pub const PIN_LAYOUT_VERSION: u32 = 1;

/// Map names, as seen by `bpftool map show` and used as pin file names.
pub mod map_names {
    pub const SERVICES: &str = "KPR_SERVICES";
    pub const BACKENDS: &str = "KPR_BACKENDS";
    pub const SOCK_REVNAT: &str = "KPR_SOCK_REVNAT";
    pub const COUNTERS: &str = "KPR_COUNTERS";
}

/// Program names (the Rust function names in `proxy-ebpf`).
pub mod program_names {
    pub const CONNECT4: &str = "kpr_connect4";
    pub const SENDMSG4: &str = "kpr_sendmsg4";
    pub const RECVMSG4: &str = "kpr_recvmsg4";
    pub const GETPEERNAME4: &str = "kpr_getpeername4";
}

/// Default map sizes; the agent can override them at start.
pub mod defaults {
    /// Service ports (ClusterIP:port/proto entries).
    pub const MAX_SERVICE_PORTS: u32 = 65_536;
    /// Backend slots across all service ports.
    pub const MAX_BACKENDS: u32 = 262_144;
    /// Sockets remembered for reverse translation (getpeername / recvmsg), LRU.
    pub const MAX_SOCK_REVNAT: u32 = 65_536;
}

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
    pub _pad: u8,
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
    /// Number of counters.
    pub const COUNT: u32 = 5;
    /// Names for display, by index.
    pub const NAMES: [&str; COUNT as usize] = [
        "translated",
        "no_backends_rejected",
        "bad_backend_slot",
        "revnat_update_failed",
        "reverse_translated",
    ];
}

const _: () = assert!(size_of::<ServiceKey>() == 8);
const _: () = assert!(size_of::<ServiceValue>() == 16);
const _: () = assert!(size_of::<Backend>() == 8);
const _: () = assert!(size_of::<SockRevNatKey>() == 16);
const _: () = assert!(size_of::<SockRevNatValue>() == 12);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are repr(C) with explicit padding and only integer fields.
    unsafe impl aya::Pod for super::ServiceKey {}
    unsafe impl aya::Pod for super::ServiceValue {}
    unsafe impl aya::Pod for super::Backend {}
    unsafe impl aya::Pod for super::SockRevNatKey {}
    unsafe impl aya::Pod for super::SockRevNatValue {}
}
