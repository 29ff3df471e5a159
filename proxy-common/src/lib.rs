//! Map keys and values shared by kpr's eBPF programs (`proxy-ebpf`) and its agent (`proxy-user`).
//!
//! Layout rules (a pinned map outlives both sides, so the layout is an ABI):
//! - `#[repr(C)]`, `Copy`, explicit `_pad`, sizes asserted at compile time;
//! - addresses and ports in network byte order (the field says so);
//! - no `bool`, `Option` or enums in values; 32-bit ids.
//!
//! Any change to a layout here must bump [`PIN_LAYOUT_VERSION`], which versions the bpffs pin
//! directory, so an old agent's maps are never read with a new layout, and raise the changed
//! map's entry in [`CARRIED_MAPS`] to it.
#![no_std]

/// Version of the pinned map layout; part of the bpffs pin directory (`<pin-root>/v<N>`).
pub const PIN_LAYOUT_VERSION: u32 = 18;

/// The pinned maps an agent takes over from an older layout's directory (an upgrade), each
/// with the oldest layout version whose map of that name reads as this one's: raise it when a
/// change makes the map read otherwise. The state a flow needs (services, backends, conntrack,
/// affinity, reverse translation) then survives an upgrade that changed something else, such
/// as a new counter. Not listed, so made anew: the slow-path program array (it holds the old
/// programs) and the flow caches (pinned only so that a scrape can read what they have counted). The loader also checks each carried map's type, sizes and flags against the new
/// object, and makes any that differ anew.
pub const CARRIED_MAPS: [(&str, u32); 30] = {
    use map_names::*;
    [
        (SERVICES, 12),
        (BACKENDS, 12),
        (SOCK_REVNAT, 12),
        (SOCK_PICKS, 12),
        (FRAGMENTS, 12),
        // v14 made the established tables plain hashes (no eviction): an older layout's
        // entries are copied into them (`copy_older_conntrack`).
        (CONNTRACK4, 14),
        (CT_NEW4, 12),
        (CONNTRACK6, 14),
        (CT_NEW6, 12),
        (NODE_ADDRS, 12),
        (SOURCE_RANGES, 12),
        (LOCAL_CIDRS, 12),
        (LINKS, 12),
        (SERVICE_CIDRS, 12),
        (SERVICE_RANGE_COVER, 12),
        (AFFINITY, 12),
        (HANDOVER, 12),
        (HANDOVER_COUNT, 12),
        // v14 gave it a second word.
        (HOST_STATE, 14),
        (ADDR_FILTER, 12),
        // v13 added a counter and the flow caches' generation, v14, v15, v16 and v18 a
        // counter.
        (COUNTERS, 18),
        (CT_GENERATION, 13),
        // Added within v13: an older v13 directory has none, and the first sync fills it.
        (NODE_SOURCES, 13),
        // Added within v14: an older v14 directory has none, and the first sync fills it.
        (SOCKET_SKIP, 14),
        (COVERED_NETNS, 14),
        // Added in v15: a v14 directory has none. Without them, the sockets of before the
        // upgrade hold their entries uncounted (the LRU ages them out once they are closed).
        (SOCK_SLOTS, 15),
        (SOCK_TCP, 15),
        (SOCK_QUOTA, 15),
        // Added in v17.
        (SERVICE_STATS, 17),
        // Added within v17: an older v17 directory has none (its size is the flag's: one of
        // another size is made anew before the load).
        (ENDPOINT_STATS, 17),
    ]
};

/// The helper id the programs call `bpf_cast_to_kern_ctx` (6.2+) by: no kernel has it. The
/// loader makes each such call the kfunc's where the kernel has one, and else the call stays
/// dead code (its global says so). A stand-in because the object's linker writes no BTF for
/// an external function, which a kfunc call needs.
pub const CAST_TO_KERN_CTX_STANDIN: u32 = 0x6b70_7201;

/// Map names, as seen by `bpftool map show` and used as pin file names.
pub mod map_names {
    pub const SERVICES: &str = "KPR_SERVICES";
    /// (Service id, chunk) → a chunk of the Maglev table of a frontend with `SERVICE_FLAG_MAGLEV`.
    pub const MAGLEV: &str = "KPR_MAGLEV";
    pub const BACKENDS: &str = "KPR_BACKENDS";
    pub const SOCK_REVNAT: &str = "KPR_SOCK_REVNAT";
    pub const SOCK_PICKS: &str = "KPR_SOCK_PICKS";
    /// Per socket (socket storage): the entries it holds in the two maps above.
    pub const SOCK_SLOTS: &str = "KPR_SOCK_SLOTS";
    /// TCP socket cookie → its one entry and the namespace it is counted under.
    pub const SOCK_TCP: &str = "KPR_SOCK_TCP";
    /// Network namespace cookie → the socket path's entries its sockets hold (key
    /// [`SOCK_QUOTA_TOTAL`](crate::SOCK_QUOTA_TOTAL): the node's total).
    pub const SOCK_QUOTA: &str = "KPR_SOCK_QUOTA";
    pub const FRAGMENTS: &str = "KPR_FRAGMENTS";
    pub const COUNTERS: &str = "KPR_COUNTERS";
    /// Conntrack of IPv4 flows: established, not answered yet.
    pub const CONNTRACK4: &str = "KPR_CONNTRACK4";
    pub const CT_NEW4: &str = "KPR_CT_NEW4";
    /// Conntrack of IPv6 flows: established, not answered yet.
    pub const CONNTRACK6: &str = "KPR_CONNTRACK6";
    pub const CT_NEW6: &str = "KPR_CT_NEW6";
    pub const NODE_ADDRS: &str = "KPR_NODE_ADDRS";
    /// Endpoint → the source address the node's own masqueraded connections to it are bound
    /// to, where routing would pick another than MASQUERADE.
    pub const NODE_SOURCES: &str = "KPR_NODE_SOURCES";
    /// Pods whose sockets the socket path leaves alone: their cgroup ids (key 0: the cgroup
    /// levels they sit at, a bit each).
    pub const SOCKET_SKIP: &str = "KPR_SOCKET_SKIP";
    /// The pods' network namespaces whose link holds the per-packet programs: their cookies
    /// (key 0: the agent could tell, so a namespace not listed is not covered).
    pub const COVERED_NETNS: &str = "KPR_COVERED_NETNS";
    pub const SOURCE_RANGES: &str = "KPR_SOURCE_RANGES";
    pub const LOCAL_CIDRS: &str = "KPR_LOCAL_CIDRS";
    pub const LINKS: &str = "KPR_LINKS";
    pub const SERVICE_CIDRS: &str = "KPR_SERVICE_CIDRS";
    pub const SERVICE_RANGE_COVER: &str = "KPR_SERVICE_RANGE_COVER";
    pub const AFFINITY: &str = "KPR_AFFINITY";
    pub const HANDOVER: &str = "KPR_HANDOVER";
    pub const HANDOVER_COUNT: &str = "KPR_HANDOVER_COUNT";
    pub const HOST_STATE: &str = "KPR_HOST_STATE";
    pub const ADDR_FILTER: &str = "KPR_ADDR_FILTER";
    pub const TC_SLOW_PATH: &str = "KPR_TC_SLOW_PATH";
    /// Per-CPU caches of established flows in front of the conntrack tables (not pinned: each
    /// load of the programs starts with empty ones).
    pub const FLOW_CACHE4: &str = "KPR_FLOW_CACHE4";
    pub const FLOW_CACHE6: &str = "KPR_FLOW_CACHE6";
    /// A word per slot of those caches: which flow it holds, until when.
    pub const FLOW_CACHE_TAGS4: &str = "KPR_FLOW_CACHE_TAGS4";
    pub const FLOW_CACHE_TAGS6: &str = "KPR_FLOW_CACHE_TAGS6";
    /// What the flow caches' entries are checked against ([`super::ct_generation`]).
    pub const CT_GENERATION: &str = "KPR_CT_GENERATION";
    /// Drops and rejects of the per-packet path ([`super::DatapathEvent`]), a ring buffer
    /// written only while a reader asks (`EVENTS_WANTED`); not carried over an upgrade.
    pub const EVENTS: &str = "KPR_EVENTS";
    /// One word: until when (`CLOCK_MONOTONIC` ns) the programs write events; `kpr events`
    /// keeps it a few seconds ahead while it reads.
    pub const EVENTS_WANTED: &str = "KPR_EVENTS_WANTED";
    /// Per frontend (by service id) and CPU: its flows, packets, bytes, connects and events
    /// ([`super::ServiceStats`]); the agent makes an entry with the frontend and removes it
    /// with it.
    pub const SERVICE_STATS: &str = "KPR_SERVICE_STATS";
    /// Backend → its answers to new per-packet flows (outlier detection).
    pub const BACKEND_ANSWERS: &str = "KPR_BACKEND_ANSWERS";
    /// Per endpoint and CPU (`--endpoint-counters`): its flows, connects, unanswered flows,
    /// packets and bytes ([`super::EndpointStats`]); the agent makes the entries, up to the
    /// map's size, and removes them with their endpoint.
    pub const ENDPOINT_STATS: &str = "KPR_ENDPOINT_STATS";
    /// Non-zero while the agent watches endpoints (an opted-in Service has some): only then
    /// do the programs count answers in `BACKEND_ANSWERS`.
    pub const ANSWERS_WANTED: &str = "KPR_ANSWERS_WANTED";
}

/// A packet the per-packet path dropped or answered instead of forwarding (`kpr events`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatapathEvent {
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC).
    pub time_ns: u64,
    pub saddr: Addr,
    pub daddr: Addr,
    /// Network byte order.
    pub sport: u16,
    /// Network byte order.
    pub dport: u16,
    /// An [`event`] reason.
    pub reason: u32,
    /// The service port the packet was for (`ServiceValue::service_id`); 0: none known (an
    /// address no frontend has, a source refused before the frontend was looked up).
    pub service_id: u32,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// Why the per-packet path dropped or answered a packet ([`DatapathEvent::reason`]).
pub mod event {
    /// kube-proxy's REJECT: a service port without endpoints, an unknown port of a ClusterIP
    /// (a TCP reset, ICMP port unreachable).
    pub const REJECTED: u32 = 0;
    /// Traffic policy Local without a local endpoint.
    pub const DROPPED_NO_LOCAL_ENDPOINTS: u32 = 1;
    /// A source outside the frontend's loadBalancerSourceRanges.
    pub const DROPPED_SOURCE_RANGE: u32 = 2;
    /// An address of the service range no Service has.
    pub const DROPPED_UNALLOCATED_ADDRESS: u32 = 3;
    /// A source the node's reverse path check refuses (`rp_filter`), or a pod sending as the node.
    pub const DROPPED_SPOOFED_SOURCE: u32 = 4;
    /// No masquerade port free for the flow's endpoint.
    pub const DROPPED_SNAT_EXHAUSTED: u32 = 5;
    /// The new-flow table could not take the flow.
    pub const DROPPED_CONNTRACK_FULL: u32 = 6;
    /// A segment of a flow whose endpoint died, answered with a RST (`--abort-dead-tcp`).
    pub const RESET_DEAD_ENDPOINT: u32 = 7;
    /// The node's own TCP connection kube-proxy's filter rules would drop.
    pub const DROPPED_FROM_NODE: u32 = 8;
    /// A segment of a flow an upgrade is still copying: dropped, it is sent again.
    pub const DROPPED_DURING_UPGRADE: u32 = 9;
    pub const COUNT: u32 = 10;
    /// Names for display, by reason.
    pub const NAMES: [&str; COUNT as usize] = [
        "rejected",
        "dropped_no_local_endpoints",
        "dropped_source_range",
        "dropped_unallocated_address",
        "dropped_spoofed_source",
        "dropped_snat_exhausted",
        "dropped_conntrack_full",
        "reset_dead_endpoint",
        "dropped_from_node",
        "dropped_during_upgrade",
    ];
}

/// Value of `KPR_SERVICE_STATS` (one per CPU): what a service port's frontends saw, indexed
/// by [`service_stat`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceStats {
    pub words: [u64; service_stat::COUNT as usize],
}

impl Default for ServiceStats {
    fn default() -> Self {
        Self { words: [0; service_stat::COUNT as usize] }
    }
}

impl ServiceStats {
    /// Word `word` ([`service_stat`]).
    pub const fn word(&self, word: u32) -> u64 {
        self.words[word as usize]
    }

    /// Add `other`'s counts, word by word.
    pub fn add(&mut self, other: &Self) {
        for (total, more) in self.words.iter_mut().zip(other.words) {
            *total += more;
        }
    }

    /// The counts made since `earlier` (none below zero).
    pub fn since(&self, earlier: &Self) -> Self {
        let mut out = *self;
        for (now, then) in out.words.iter_mut().zip(earlier.words) {
            *now = now.saturating_sub(then);
        }
        out
    }
}

/// Value of `KPR_ENDPOINT_STATS` (one per CPU): what an endpoint's flows and connects saw,
/// the first words of [`ServiceStats`] (`service_stat::NEW_FLOWS..=BYTES`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointStats {
    pub words: [u64; service_stat::ENDPOINT_WORDS as usize],
}

impl EndpointStats {
    /// Add `other`'s counts, word by word.
    pub fn add(&mut self, other: &Self) {
        for (total, more) in self.words.iter_mut().zip(other.words) {
            *total += more;
        }
    }
}

/// The words of [`ServiceStats`].
pub mod service_stat {
    /// New flows the per-packet path balanced (not those it re-created after losing their
    /// entries).
    pub const NEW_FLOWS: u32 = 0;
    /// `connect()` calls the socket path translated (TCP, connected UDP).
    pub const CONNECTS: u32 = 1;
    /// New per-packet flows that expired with no answer from their endpoint.
    pub const UNANSWERED: u32 = 2;
    /// Packets of the per-packet path's flows, both directions, as tc sees them (a GSO or GRO
    /// packet is one).
    pub const PACKETS: u32 = 3;
    /// Their bytes (the whole frame).
    pub const BYTES: u32 = 4;
    /// Then a word per [`super::event`] reason: drops and rejects.
    pub const EVENTS: u32 = 5;
    /// The words an endpoint has too ([`super::EndpointStats`]): drops and rejects are a
    /// frontend's, before any endpoint is picked.
    pub const ENDPOINT_WORDS: u32 = EVENTS;
    pub const COUNT: u32 = EVENTS + super::event::COUNT;
    /// No word (only packets and bytes are added).
    pub const NONE: u32 = u32::MAX;
}

/// Bytes of the events ring buffer (a power-of-2 multiple of the page size): 4,681 events.
pub const EVENTS_BYTES: u32 = 256 * 1024;

/// Program names (the Rust function names in `proxy-ebpf`).
pub mod program_names {
    pub const CONNECT4: &str = "kpr_connect4";
    pub const SENDMSG4: &str = "kpr_sendmsg4";
    pub const RECVMSG4: &str = "kpr_recvmsg4";
    pub const GETPEERNAME4: &str = "kpr_getpeername4";
    pub const CONNECT6: &str = "kpr_connect6";
    pub const SENDMSG6: &str = "kpr_sendmsg6";
    pub const RECVMSG6: &str = "kpr_recvmsg6";
    pub const GETPEERNAME6: &str = "kpr_getpeername6";
    pub const SOCK_RELEASE: &str = "kpr_sock_release";
    pub const SOCK_OPS: &str = "kpr_sock_ops";
    pub const TC_INGRESS: &str = "kpr_tc_ingress";
    pub const TC_EGRESS: &str = "kpr_tc_egress";
    /// The same for links without Ethernet (`LINK_FLAG_NOT_ETHERNET`).
    pub const TC_INGRESS_L3: &str = "kpr_tc_ingress_l3";
    pub const TC_EGRESS_L3: &str = "kpr_tc_egress_l3";
    /// Where the tc programs hand a packet whose flow is not in conntrack (`KPR_TC_SLOW_PATH`).
    pub const TC_INGRESS_SLOW: &str = "kpr_tc_ingress_slow";
    pub const TC_EGRESS_SLOW: &str = "kpr_tc_egress_slow";
    pub const TC_INGRESS_L3_SLOW: &str = "kpr_tc_ingress_l3_slow";
    pub const TC_EGRESS_L3_SLOW: &str = "kpr_tc_egress_l3_slow";
    /// XDP in front of tc on the external links (`--xdp`).
    pub const XDP: &str = "kpr_xdp";
    /// The slow programs, indexed by their `KPR_TC_SLOW_PATH` slot ([`super::tc_slow_path`]).
    pub const TC_SLOW_PATH: [&str; 4] = [TC_INGRESS_SLOW, TC_EGRESS_SLOW, TC_INGRESS_L3_SLOW, TC_EGRESS_L3_SLOW];
    const _: () = assert!(
        super::tc_slow_path::INGRESS == 0
            && super::tc_slow_path::EGRESS == 1
            && super::tc_slow_path::INGRESS_L3 == 2
            && super::tc_slow_path::EGRESS_L3 == 3
    );
}

/// Slots of `KPR_TC_SLOW_PATH` (see [`program_names::TC_SLOW_PATH`]).
pub mod tc_slow_path {
    pub const INGRESS: u32 = 0;
    pub const EGRESS: u32 = 1;
    pub const INGRESS_L3: u32 = 2;
    pub const EGRESS_L3: u32 = 3;
    /// Slots in all.
    pub const SLOTS: u32 = 4;
}

/// Words of `KPR_CT_GENERATION`: a flow cache's entry serves only while both are what they
/// were when it was filled. After a conntrack entry is removed, its remover writes one of them
/// with a value it never had before: no later write can then bring back a value that a cached
/// copy of the removed entry was filled under, whatever the order of racing writers.
pub mod ct_generation {
    /// The programs' (when they forget a flow): the clock in ns, shifted, and the CPU's number.
    pub const DATAPATH: u32 = 0;
    /// Userspace's (the agent's sweeps and flushes, `kpr conntrack flush`): `CLOCK_MONOTONIC` in ns.
    pub const AGENT: u32 = 1;
    pub const WORDS: u32 = 2;
}

/// The cgroup levels a pod's cgroup may sit at for `KPR_SOCKET_SKIP` (1 to 15: kubelet's
/// are at 2 to 4, under a container runtime in a pod deeper).
pub const SOCKET_SKIP_LEVELS: u32 = 16;

/// Default map sizes; the agent can override them at start.
pub mod defaults {
    /// Service entries: a ClusterIP's port takes one per source scope (pod, outside, node) and
    /// the ClusterIP one more; 64k Services of one port each. Not preallocated: memory follows
    /// the entries written (the hash buckets aside: 16 bytes per entry of capacity).
    pub const MAX_SERVICE_PORTS: u32 = 262_144;
    /// Backend slots across all service ports.
    pub const MAX_BACKENDS: u32 = 262_144;
    /// Sockets remembered for reverse translation (getpeername / recvmsg), LRU.
    pub const MAX_SOCK_REVNAT: u32 = 65_536;
    /// A network namespace's share of them (a pod's, or the node's): one sixteenth.
    pub const SOCK_REVNAT_SHARE: u32 = 16;
    /// Network namespaces whose sockets' entries are counted (`KPR_SOCK_QUOTA`), LRU: the pods
    /// of a node and the node, many times over.
    pub const MAX_SOCK_QUOTA_NETNS: u32 = 16_384;
    /// Per-packet conntrack entries (two per translated flow) of each family's table of
    /// established flows, LRU (131,072 flows: kube-proxy's default `conntrack.min`).
    pub const MAX_CONNTRACK: u32 = 262_144;
    /// Entries of each family's table of flows not established yet, LRU: a TCP flow is there
    /// until the client acknowledges the backend's SYN-ACK, so a quarter of the established
    /// table's (a flood of SYNs or one-way datagrams evicts only its own kind).
    pub const MAX_CONNTRACK_NEW: u32 = 65_536;
    /// Local addresses of the node (NodePort frontends, "from the node" sources).
    pub const MAX_NODE_ADDRS: u32 = 4_096;
    /// Endpoints of this node whose route's source is not the masquerade source (pods behind
    /// links whose only IPv4 address is link-scoped): one per local pod at most.
    pub const MAX_NODE_SOURCES: u32 = 4_096;
    /// Pods of the node whose sockets the socket path leaves alone (one entry each, and one
    /// for the levels).
    pub const MAX_SOCKET_SKIP: u32 = 4_096;
    /// Links of the node (per-packet datapath: masquerade source, interface-based detection).
    pub const MAX_LINKS: u32 = 16_384;
    /// Backends whose answers to new flows are counted (`KPR_BACKEND_ANSWERS`), LRU: the
    /// endpoints this node's per-packet flows reach, many times over.
    pub const MAX_BACKEND_ANSWERS: u32 = 65_536;
    /// CIDRs of the local-traffic detector (clusterCIDR, the Node's podCIDRs).
    pub const MAX_LOCAL_CIDRS: u32 = 64;
    /// The cluster's service ranges (ServiceCIDR objects).
    pub const MAX_SERVICE_CIDRS: u32 = 64;
    /// sessionAffinity ClientIP: (service entry, client) pairs remembered, LRU.
    pub const MAX_AFFINITY: u32 = 65_536;
    /// Tuples (two per flow) of the flows kube-proxy translated before kpr took the node over.
    pub const MAX_HANDOVER: u32 = 32_768;
    /// loadBalancerSourceRanges entries across all LoadBalancer frontends.
    pub const MAX_SOURCE_RANGES: u32 = 16_384;
    /// Frontends with a Maglev table (9 chunks of 4,000 bytes each at the default size, 33 at
    /// 65,537 slots, allocated as written).
    pub const MAX_MAGLEV_FRONTENDS: u32 = 4_096;
    /// Words of the address filter (`KPR_ADDR_FILTER`): 2^20 bits, 128 KiB.
    pub const ADDR_FILTER_WORDS: u32 = 16_384;
    /// Entries of each per-CPU flow cache (`KPR_FLOW_CACHE4`, `KPR_FLOW_CACHE6`), a power of
    /// two: 128 and 152 bytes each, and a word each to tell what a slot holds: 296 KiB per CPU.
    pub const FLOW_CACHE_SLOTS: u32 = 1_024;
}

/// The bit of the address filter (`KPR_ADDR_FILTER`) that stands for `addr`: a multiplicative hash, its top 20 bits. The filter holds every address the
/// per-packet path can have business with (frontends, backends, the node's addresses), so a
/// packet whose addresses both miss it passes at the cost of two array reads (and, with the
/// service range refused, a lookup of its destination in the range). Bits are only
/// ever set (a flow can outlive its backend's place in the maps): a false positive costs the
/// full lookups, never a wrong verdict.
///
/// An address of either family is folded to one word first (an IPv4-mapped one to its IPv4
/// address, so the common case costs nothing more).
#[inline(always)]
pub const fn addr_filter_bit(addr: &Addr) -> u32 {
    addr.folded().wrapping_mul(0x9e37_79b1) >> 12
}

/// An address of either family as the maps hold it: 16 bytes in network byte order, an IPv4
/// address as IPv4-mapped IPv6 (`::ffff:a.b.c.d`), which is how a dual-stack socket names it
/// too. One key layout serves both families, and an application connecting to
/// `::ffff:10.96.0.10` finds the same entry as one connecting to `10.96.0.10`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Addr(pub [u32; 4]);

impl Addr {
    /// The third word of an IPv4-mapped address (`0000:ffff`), network byte order.
    const MAPPED: u32 = u32::from_be(0x0000_ffff);

    /// The IPv4 address `v4` (network byte order), mapped.
    #[inline(always)]
    pub const fn from_v4(v4: u32) -> Self {
        Self([0, 0, Self::MAPPED, v4])
    }

    /// An IPv4(-mapped) address.
    #[inline(always)]
    pub const fn is_v4(&self) -> bool {
        self.0[0] == 0 && self.0[1] == 0 && self.0[2] == Self::MAPPED
    }

    /// The IPv4 address (network byte order) of a mapped one; meaningless for IPv6.
    #[inline(always)]
    pub const fn v4(&self) -> u32 {
        self.0[3]
    }

    /// One word standing for the address (for hashes): an IPv4 address itself, an IPv6 one's
    /// words XORed.
    #[inline(always)]
    pub const fn folded(&self) -> u32 {
        let w = &self.0;
        if self.is_v4() { w[3] } else { w[0] ^ w[1] ^ w[2] ^ w[3] }
    }

    /// `self == other` without a branch per word: in a verifier-checked loop, four branches
    /// per comparison multiply the paths to verify.
    #[inline(always)]
    pub const fn same(&self, other: &Self) -> bool {
        let (a, b) = (&self.0, &other.0);
        (a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) == 0
    }

    /// The unspecified address of this address's family (`0.0.0.0` mapped, or `::`): the
    /// address of NodePort entries.
    #[inline(always)]
    pub const fn unspecified_like(&self) -> Self {
        if self.is_v4() { Self::from_v4(0) } else { Self([0; 4]) }
    }

    /// The unspecified address of either family.
    #[inline(always)]
    pub const fn is_unspecified(&self) -> bool {
        self.0[3] == 0 && (self.is_v4() || (self.0[0] == 0 && self.0[1] == 0 && self.0[2] == 0))
    }

    /// A network namespace cookie in an address's place (`AffinityKey::client`).
    #[inline(always)]
    pub const fn from_cookie(cookie: u64) -> Self {
        Self([cookie as u32, (cookie >> 32) as u32, 0, 0])
    }

    /// IPv4 mapped (`::ffff:0:0/96`) prefixes are this many bits longer than the IPv4 ones.
    pub const V4_PREFIX_OFFSET: u32 = 96;
}

#[cfg(feature = "user")]
impl From<core::net::IpAddr> for Addr {
    fn from(ip: core::net::IpAddr) -> Self {
        let v6 = match ip {
            core::net::IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            core::net::IpAddr::V6(v6) => v6,
        };
        let b = v6.octets();
        Self(core::array::from_fn(|i| u32::from_ne_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])))
    }
}

#[cfg(feature = "user")]
impl From<core::net::Ipv4Addr> for Addr {
    fn from(ip: core::net::Ipv4Addr) -> Self {
        core::net::IpAddr::V4(ip).into()
    }
}

#[cfg(feature = "user")]
impl From<core::net::Ipv6Addr> for Addr {
    fn from(ip: core::net::Ipv6Addr) -> Self {
        core::net::IpAddr::V6(ip).into()
    }
}

#[cfg(feature = "user")]
impl From<Addr> for core::net::IpAddr {
    fn from(a: Addr) -> Self {
        let mut b = [0u8; 16];
        for (i, w) in a.0.iter().enumerate() {
            b[4 * i..4 * i + 4].copy_from_slice(&w.to_ne_bytes());
        }
        let v6 = core::net::Ipv6Addr::from(b);
        match v6.to_ipv4_mapped() {
            Some(v4) => core::net::IpAddr::V4(v4),
            None => core::net::IpAddr::V6(v6),
        }
    }
}

/// `ServiceKey::scope`: where the traffic comes from, as kube-proxy tells its sources apart.
/// Every frontend has one entry per scope, computed by the agent from the traffic policies,
/// the local-traffic detector and `masqueradeAll`.
///
/// From a pod the local-traffic detector calls local (kube-proxy's "in-cluster"); without a
/// detector, pods are [`SCOPE_EXTERNAL`] like any other non-node source.
pub const SCOPE_POD: u8 = 0;
/// From anywhere else: external clients, routers, pods the detector does not call local.
pub const SCOPE_EXTERNAL: u8 = 1;
/// From the node itself (`--src-type LOCAL`): sockets in the host network namespace, packets
/// whose source is a local address.
pub const SCOPE_NODE: u8 = 2;

/// The mark (`__sk_buff.mark`) of `kpr verify`'s probes, given in `BPF_PROG_TEST_RUN`'s
/// context: the tc programs decide them as any packet but count no flow, event or service
/// count for them ("kprv"; a packet arriving with exactly this mark is only left uncounted).
pub const VERIFY_PROBE_MARK: u32 = 0x6b70_7276;

/// The priority (`SO_PRIORITY`) of `kpr verify`'s probe sockets: the socket hooks decide their
/// `connect()` as any other, and count no connect, event or sessionAffinity pick for them (a
/// priority no qdisc band uses; the probes send no packet).
pub const VERIFY_PROBE_PRIORITY: u32 = VERIFY_PROBE_MARK;

/// `ServiceKey::proto` of the entry that stands for every other port of a ClusterIP (with
/// `port` 0 and `SCOPE_POD`, for every source): with the service range refused (nftables
/// mode's rule, kpr's default), traffic to a ClusterIP's unknown ports is rejected. Only
/// ClusterIPs inside a known ServiceCIDR have one.
pub const PROTO_ANY: u8 = 0;

/// A hash of a flow's tuple (ports as read from the packet: network byte order), seeded: the
/// per-packet path's backend pick (`KPR_FLOW_HASH_SEED`, or the cluster's `KPR_MAGLEV_SEED` for
/// Maglev), which the agent and the tests can compute alike.
#[inline(always)]
pub fn tuple_hash(seed: u32, saddr: &Addr, daddr: &Addr, sport: u16, dport: u16, proto: u8) -> u32 {
    let mut h = seed;
    h = mix32(h ^ saddr.folded());
    h = mix32(h ^ daddr.folded());
    h = mix32(h ^ (u32::from(sport) << 16 | u32::from(dport)));
    mix32(h ^ u32::from(proto))
}

/// murmur3's finalizer: every input bit affects every output bit.
#[inline(always)]
pub const fn mix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// `ServiceValue::flags`: masquerade (SNAT to the node) traffic of this entry.
pub const SERVICE_FLAG_SNAT: u32 = 1;
/// `ServiceValue::flags`: with no endpoints, drop instead of reject (traffic policy Local with
/// endpoints elsewhere).
pub const SERVICE_FLAG_DROP_NO_ENDPOINTS: u32 = 2;
/// `ServiceValue::flags`: only clients in `KPR_SOURCE_RANGES` for this service id may connect
/// (loadBalancerSourceRanges); others are dropped.
pub const SERVICE_FLAG_SOURCE_RANGES: u32 = 4;
/// `ServiceValue::flags`: the socket path leaves this connection untouched for the per-packet
/// path, which can do what kube-proxy does and `connect()` cannot (masquerade, filtering on the
/// source address). Only honoured when the per-packet path covers the pods' links.
pub const SERVICE_FLAG_SOCKET_SKIP: u32 = 8;
/// `ServiceValue::flags` (node scope): the frontend is an externalIP or LoadBalancer IP, an
/// address whoever writes a Service (or its status) chooses. The agent's own sockets are not
/// translated to it, so no Service can take over the agent's connection to the API server
/// (CVE-2020-8554).
pub const SERVICE_FLAG_EXTERNAL_ADDR: u32 = 16;
/// `ServiceValue::flags` (external frontends, traffic from outside): a new per-packet flow's
/// backend is the slot of its tuple's hash in the frontend's `KPR_MAGLEV` table, a hash seeded
/// alike on every node, so every node picks the same backend for a tuple. Without a table
/// (not written yet, or it failed), the usual pick.
pub const SERVICE_FLAG_MAGLEV: u32 = 32;
/// `ServiceValue::flags` (external frontends, traffic from outside, traffic policy Cluster):
/// direct server return. A new flow to an endpoint on another node (`BACKEND_FLAG_REMOTE`) is
/// not masqueraded: its packets go to that node in IP-in-IP, the client's
/// packet inside as it came, and that node's kpr translates it and sends the replies straight
/// to the client, from the frontend's address. A local endpoint's flow keeps the client's
/// address too, as with traffic policy Local.
pub const SERVICE_FLAG_DSR: u32 = 64;

/// Slots of a Maglev table (`KPR_MAGLEV`) unless `--maglev-table-size` says otherwise: a prime,
/// Cilium's and Katran's default, over 100 slots per backend up to 163 backends.
pub const MAGLEV_DEFAULT_TABLE_SIZE: u32 = 16_381;
/// The largest table `--maglev-table-size` takes (Cilium's): slots name backends in 16 bits.
pub const MAGLEV_MAX_TABLE_SIZE: u32 = 131_071;
/// The smallest (Cilium's): 100 slots per backend for 2 backends.
pub const MAGLEV_MIN_TABLE_SIZE: u32 = 251;
/// Slots per `KPR_MAGLEV` value. A table is kept in chunks that fit a 4 KiB slab object with
/// the map's element header: the kernel allocates a map's elements as they are written, without
/// reclaim, and one 32 KiB value would take contiguous pages.
pub const MAGLEV_CHUNK_SLOTS: u32 = 2_000;

/// Chunks of a table of `table_size` slots.
pub const fn maglev_chunks(table_size: u32) -> u32 {
    table_size.div_ceil(MAGLEV_CHUNK_SLOTS)
}

/// Key of `KPR_MAGLEV`: a frontend's service id and which chunk of its table.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct MaglevKey {
    pub service_id: u32,
    pub chunk: u32,
}

/// Value of `KPR_MAGLEV`: slots `chunk × MAGLEV_CHUNK_SLOTS ..` of a table, each an index into
/// the frontend's backend range (a table has fewer endpoints than slots: they fit 16 bits).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MaglevChunk {
    pub slots: [u16; MAGLEV_CHUNK_SLOTS as usize],
}

/// `KPR_NODE_ADDRS` value bits: the address is local to the node (`--dst-type LOCAL`).
pub const NODE_ADDR_LOCAL: u32 = 1;
/// `KPR_NODE_ADDRS` value bits: NodePorts are served on this address (`nodePortAddresses`).
pub const NODE_ADDR_NODEPORT: u32 = 2;

/// `KPR_DETECT_LOCAL` (a global of the tc programs): how pods are told from other sources.
pub const DETECT_LOCAL_NONE: u8 = 0;
/// Sources inside `KPR_LOCAL_CIDRS` (detectLocalMode ClusterCIDR, NodeCIDR).
pub const DETECT_LOCAL_CIDR: u8 = 1;
/// Traffic arriving on links marked `LINK_FLAG_LOCAL_TRAFFIC` (BridgeInterface,
/// InterfaceNamePrefix).
pub const DETECT_LOCAL_INTERFACE: u8 = 2;

/// `KPR_HOST_STATE` bit: nothing on the host filters forwarded packets (netfilter's forward
/// hook is empty, or the operator said so), so a packet translated on its way in may be sent
/// straight out of its link, past that hook. Unset (also in a map just made): it goes on
/// through the host's forwarding path, where a NetworkPolicy in the FORWARD chain holds for
/// it as for kube-proxy's traffic.
pub const HOST_FORWARD_DIRECT_OK: u32 = 1;

/// `KPR_HOST_STATE` words: the forward hook's (`HOST_FORWARD_DIRECT_OK`), and the upgrade's
/// (`HOST_RETIRING_OLDER_LAYOUT`).
pub mod host_state {
    pub const FORWARD: u32 = 0;
    pub const UPGRADE: u32 = 1;
    pub const WORDS: u32 = 2;
}

/// `KPR_HOST_STATE` word `UPGRADE`: an older layout's programs are being detached, and the
/// flows they established last are being copied into this layout's tables (milliseconds).
/// Meanwhile a TCP segment (not a SYN or RST) that finds no flow, from an address that may be
/// a backend's, may be one of theirs still to be copied: dropped (it is sent again), where
/// passed on untranslated it would be reset.
pub const HOST_RETIRING_OLDER_LAYOUT: u32 = 1;

/// `KPR_LINKS` key holding, as `addr`, the source address routing picks for the ClusterIPs:
/// the node's own unmasqueraded connections to a ClusterIP keep it (kube-proxy DNATs in OUTPUT,
/// after the source was chosen).
pub const LINK_SERVICE_SOURCE: u32 = u32::MAX;

/// `KPR_LINKS` key holding the cookie of the network namespace the links (ifindexes) belong to
/// (`addr`: low 32 bits, `flags`: high 32 bits): `kpr cleanup` run from another namespace must
/// not touch that namespace's ifindexes there.
pub const LINK_NETNS: u32 = u32::MAX - 1;

/// `KPR_LINKS` keys from here on are not links.
pub const LINK_FIRST_SPECIAL: u32 = LINK_NETNS;

/// `LinkInfo::flags`: the interface-based local-traffic detector calls traffic arriving on
/// this link local (detectLocalMode BridgeInterface / InterfaceNamePrefix).
pub const LINK_FLAG_LOCAL_TRAFFIC: u32 = 1;

/// `LinkInfo::flags`: kpr turned `accept_local` on for this link (it was off), and turns it
/// off again when it leaves the link (`kpr cleanup`, a link no longer selected).
pub const LINK_FLAG_ACCEPT_LOCAL_SET: u32 = 2;

/// `LinkInfo::flags`: kpr's per-packet programs are attached to this link as netlink tc filters
/// (kernels without TCX), which no pin records.
pub const LINK_FLAG_NETLINK_TC: u32 = 4;

/// `LinkInfo::flags`: kpr's ingress program runs on this link, so a packet that came in by it
/// was translated there if it needed it; the egress program leaves it alone (it costs a
/// translated packet ~300 ns to find nothing more to do). Set after the attachment, cleared
/// before the detachment.
pub const LINK_FLAG_TC_INGRESS: u32 = 8;

/// `LinkInfo::flags`: one end of a veth pair whose other end is in another network
/// namespace (a pod's). A packet sent straight out by this link is handed to that other end
/// (`bpf_redirect_peer`): it enters the pod at once, without the queue and second receive a
/// transmission on the pair costs.
pub const LINK_FLAG_PEER: u32 = 16;
/// `LinkInfo::flags`: IPv4 `rp_filter` is on for this link (the larger of `all` and the
/// link's, as the kernel reads it): strict (1) or loose (2). kpr translates a new flow's first
/// packet before the kernel's routing would check its source, so the programs check it then.
pub const LINK_FLAG_RP_FILTER_STRICT: u32 = 32;
pub const LINK_FLAG_RP_FILTER_LOOSE: u32 = 64;
/// `LinkInfo::flags`: the link's packets have no Ethernet header (IP-in-IP, SIT, GRE,
/// WireGuard, TUN: the IP header comes first). Its programs are the `_l3` ones, and a packet
/// for it is left to the host stack: `bpf_redirect_neigh` sets no route on the packet, and an
/// IP-in-IP tunnel without a remote (Calico's `tunl0`) drops a packet without one.
pub const LINK_FLAG_NOT_ETHERNET: u32 = 128;

/// Value of `KPR_LINKS` (key: ifindex; ifindex 0 holds the fallback): what the per-packet path
/// needs to know about a link.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct LinkInfo {
    /// The address MASQUERADE would pick on this link (its first IPv4 address), network byte
    /// order; 0: none (the fallback entry's address is used).
    pub addr: u32,
    /// `LINK_FLAG_*`.
    pub flags: u32,
    /// The IPv6 address MASQUERADE would pick on this link (its first global one); unspecified:
    /// none (the fallback entry's is used).
    pub addr6: Addr,
}

/// Data of an LPM key (`KPR_LOCAL_CIDRS`, `KPR_SERVICE_CIDRS`): the prefix's address, of
/// either family (an IPv4 prefix is mapped: its length is `Addr::V4_PREFIX_OFFSET` longer).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CidrKey {
    pub addr: Addr,
}

/// A prefix as an address and a mask (both as in the packet). `KPR_SERVICE_RANGE_COVER`
/// holds, per family (index 0 IPv4, 1 IPv6), the longest prefix covering all of the cluster's
/// service ranges of that family: an address outside it is in none of them, known without the
/// range lookup (`KPR_SERVICE_CIDRS`). All zeros (the map's start) covers every address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CidrMask {
    pub addr: Addr,
    pub mask: Addr,
}

impl CidrMask {
    /// Index of `addr`'s family in `KPR_SERVICE_RANGE_COVER`.
    #[inline(always)]
    pub const fn family_index(addr: &Addr) -> u32 {
        if addr.is_v4() { 0 } else { 1 }
    }

    /// `addr` is inside the prefix (no branch per word, as [`Addr::same`]).
    #[inline(always)]
    pub const fn contains(&self, addr: &Addr) -> bool {
        let (a, m, p) = (&addr.0, &self.mask.0, &self.addr.0);
        ((a[0] & m[0]) ^ p[0]) | ((a[1] & m[1]) ^ p[1]) | ((a[2] & m[2]) ^ p[2]) | ((a[3] & m[3]) ^ p[3]) == 0
    }
}

/// First and last port used for SNAT (masquerade) of per-packet flows, when the agent finds
/// nothing better (it sets the `KPR_SNAT_PORT_*` globals of the tc programs at load time to
/// the ports neither the node's ephemeral range nor the NodePort range uses).
pub const SNAT_PORT_MIN: u16 = 61_000;
pub const SNAT_PORT_MAX: u16 = 65_535;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;

/// TCP header flags (the byte at offset 13), as the programs read them and the tests write them.
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_PSH: u8 = 0x08;
pub const TCP_ACK: u8 = 0x10;

/// A protocol's name as Services spell it (`any`: the any-port entries of a refused service range).
#[inline(always)]
pub const fn proto_name(proto: u8) -> &'static str {
    match proto {
        IPPROTO_TCP => "TCP",
        IPPROTO_UDP => "UDP",
        IPPROTO_SCTP => "SCTP",
        PROTO_ANY => "any",
        _ => "other",
    }
}

/// The flow has connection states (TCP, and SCTP's association mapped onto them): a SYN/INIT
/// starts it, a FIN/SHUTDOWN closes it slowly, a RST/ABORT at once.
#[inline(always)]
pub const fn has_states(proto: u8) -> bool {
    proto == IPPROTO_TCP || proto == IPPROTO_SCTP
}

/// Key of `KPR_SERVICES`: one service port.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub addr: Addr,
    /// Port, network byte order.
    pub port: u16,
    /// `IPPROTO_TCP`, `IPPROTO_UDP`, `IPPROTO_SCTP` (or `PROTO_ANY`).
    pub proto: u8,
    /// `SCOPE_POD`, `SCOPE_EXTERNAL` or `SCOPE_NODE`. A NodePort entry has the unspecified
    /// address of its family: it matches every address of that family in `KPR_NODE_ADDRS`
    /// marked `NODE_ADDR_NODEPORT`.
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
    /// sessionAffinity ClientIP: seconds a client keeps its backend after its last new
    /// connection (`timeoutSeconds`); 0: no affinity.
    pub affinity_timeout: u32,
    /// The service port this entry is a frontend of (a hash of its name): a client keeps its
    /// endpoint across the port's frontends (ClusterIP, NodePort, ...), as kube-proxy's
    /// per-endpoint `recent` lists do.
    pub affinity_id: u32,
}

/// `AffinityKey::kind`: the client is a source address (the per-packet path, as kube-proxy's
/// `recent` match sees it).
pub const AFFINITY_BY_ADDR: u32 = 0;
/// `AffinityKey::kind`: the client is a network namespace (the socket path, which runs before
/// the source address is chosen; a pod's namespace has the pod's address).
pub const AFFINITY_BY_NETNS: u32 = 1;

/// Key of `KPR_AFFINITY`: a service port and a client.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    /// `ServiceValue::affinity_id`.
    pub port_id: u32,
    /// `AFFINITY_BY_*`.
    pub kind: u32,
    /// Source address or network namespace cookie (`Addr::from_cookie`).
    pub client: Addr,
}

/// Value of `KPR_AFFINITY`: the client's backend and when it last got a connection to it
/// (CLOCK_MONOTONIC ns).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AffinityValue {
    pub backend: Backend,
    pub _pad: u32,
    pub last_used: u64,
}

/// Value of `KPR_BACKENDS` (an array indexed by slot).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Backend {
    /// Of the family of the frontends it serves (kube-proxy runs a proxier per family).
    pub addr: Addr,
    /// Port, network byte order.
    pub port: u16,
    /// `BACKEND_FLAG_*` bits.
    pub flags: u16,
}

/// `Backend::flags`: the endpoint is on another node (its slice says so, or says no node), and
/// a frontend with `SERVICE_FLAG_DSR` reaches it by direct server return.
pub const BACKEND_FLAG_REMOTE: u16 = 1;

/// Key of `KPR_BACKEND_ANSWERS` and `KPR_ENDPOINT_STATS`: an endpoint as the replies of its
/// flows come from it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BackendKey {
    pub addr: Addr,
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
}

/// Value of `KPR_BACKEND_ANSWERS`: how the endpoint answered the first packets of new flows,
/// per packet and (TCP) on the socket path. A per-packet flow it never answers is not counted
/// here: it stays among the new flows, where the agent sees it. (Changed within v17: a pinned
/// map of the older value size is made anew, and its counts start again from zero.)
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct BackendAnswers {
    /// Answered (TCP: a SYN-ACK; UDP and SCTP: any reply).
    pub answered: u64,
    /// Refused (TCP: a RST to the SYN: nothing listens).
    pub refused: u64,
    /// Socket path only: a translated `connect()` whose SYN went unanswered until its first
    /// retransmission (1 s), or that ended unanswered before it (the client gave up, an ICMP
    /// error). Once per socket.
    pub unanswered: u64,
}

/// Key of `KPR_SOCK_REVNAT` (a socket and the backend it was sent to) and of `KPR_SOCK_PICKS`
/// (a socket and the service address it sends to).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockRevNatKey {
    /// `bpf_get_socket_cookie` of the client socket.
    pub cookie: u64,
    /// Backend (or service) address.
    pub addr: Addr,
    /// Backend (or service) port, network byte order.
    pub port: u16,
    pub _pad: [u8; 6],
}

/// Value of `KPR_SOCK_REVNAT`: the service address the application asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockRevNatValue {
    /// Service address.
    pub addr: Addr,
    /// Service port, network byte order.
    pub port: u16,
    pub _pad: u16,
    pub service_id: u32,
}

/// The entries a socket may hold in `KPR_SOCK_REVNAT` and `KPR_SOCK_PICKS`: one per service
/// address it sends to. A socket that sends to more drops its own oldest, never another's.
pub const SOCK_SLOTS: usize = 8;
const _: () = assert!(SOCK_SLOTS.is_power_of_two(), "the programs mask a slot's index");

/// Key of `KPR_SOCK_QUOTA` that counts the entries of every namespace.
pub const SOCK_QUOTA_TOTAL: u64 = u64::MAX;

/// One service address a socket sent to and the endpoint it was given (its keys in
/// `KPR_SOCK_PICKS` and `KPR_SOCK_REVNAT`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SockSlot {
    pub frontend: Addr,
    pub backend: Addr,
    /// Network byte order.
    pub frontend_port: u16,
    /// Network byte order.
    pub backend_port: u16,
    pub _pad: u32,
}

/// Value of `KPR_SOCK_SLOTS` (socket storage: made with the socket's first entry, freed with
/// the socket): what `kpr_sock_release` removes, and the namespace whose count it lowers.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SockSlots {
    /// Network namespace cookie the entries are counted under (`KPR_SOCK_QUOTA`).
    pub netns: u64,
    /// Slots in use (the first `used`).
    pub used: u32,
    /// The slot a new entry replaces once all are used (the oldest).
    pub next: u32,
    pub slots: [SockSlot; SOCK_SLOTS],
}

/// Value of `KPR_SOCK_TCP`: a TCP socket's one entry in `KPR_SOCK_REVNAT` (the endpoint it
/// was given) and the namespace it is counted under. A TCP socket needs no slots: a hash entry
/// costs less than making socket storage (which doubled the hook's cost).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockTcp {
    pub netns: u64,
    pub backend: Addr,
    /// Network byte order.
    pub backend_port: u16,
    /// How far `kpr_sock_ops` has counted the connection's answer (`sock_answer`): 0 (what
    /// an older build wrote in this padding) for a socket it leaves alone.
    pub answer: u8,
    pub _pad: [u8; 5],
}

/// Where a socket-path TCP connection is in the counting of its endpoint's answer
/// (`SockTcp::answer`).
pub mod sock_answer {
    /// Not counted: `kpr verify`'s probe, a socket of an older build, counting is off, or
    /// the socket connects elsewhere than its entry's endpoint.
    pub const NONE: u8 = 0;
    /// Connecting (or about to); its first answer (or none) is still to count.
    pub const WAITING: u8 = 1;
    /// Counted unanswered at its first retransmission; a later SYN-ACK still counts.
    pub const LATE: u8 = 2;
    /// Counted (a `connect()` retried on the socket to the same endpoint is counted anew).
    pub const DONE: u8 = 3;
}

/// How a conntrack key holds an address: each family has its own tables, so that an IPv4
/// flow's key is 16 bytes, not 40 (the kernel hashes and compares the whole key on every
/// packet).
pub trait FlowAddr: Copy {
    fn from_addr(addr: &Addr) -> Self;
    fn addr(&self) -> Addr;
    /// The one's complement difference of an address of this family going from `old` to `new`
    /// in the fields a checksum covers, as a sum to accumulate ([`csum::word_diff`]).
    fn csum_diff(old: &Addr, new: &Addr) -> u64;
    /// A key's two addresses as the native 8-byte words they are in memory (one for IPv4,
    /// four for IPv6), written at `words`; how many.
    ///
    /// # Safety
    /// `words` is valid for writes of that many words.
    unsafe fn write_addr_words(words: *mut u64, src: &Addr, dst: &Addr) -> usize;
}

/// Two 4-byte words as the 8-byte word they are together in memory (`first` first).
#[inline(always)]
fn word_pair(first: u32, second: u32) -> u64 {
    if cfg!(target_endian = "little") {
        u64::from(first) | u64::from(second) << 32
    } else {
        u64::from(first) << 32 | u64::from(second)
    }
}

/// An IPv4 address in a conntrack key (`KPR_CONNTRACK4`, `KPR_CT_NEW4`), network byte order.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Addr4(pub u32);

impl FlowAddr for Addr4 {
    #[inline(always)]
    fn from_addr(addr: &Addr) -> Self {
        Self(addr.v4())
    }
    #[inline(always)]
    fn addr(&self) -> Addr {
        Addr::from_v4(self.0)
    }
    #[inline(always)]
    fn csum_diff(old: &Addr, new: &Addr) -> u64 {
        csum::word_diff(old.v4(), new.v4())
    }
    #[inline(always)]
    unsafe fn write_addr_words(words: *mut u64, src: &Addr, dst: &Addr) -> usize {
        unsafe { words.write(word_pair(src.v4(), dst.v4())) };
        1
    }
}

/// An IPv6 address in a conntrack key (`KPR_CONNTRACK6`, `KPR_CT_NEW6`) and `KPR_HANDOVER`'s
/// keys of either family.
impl FlowAddr for Addr {
    #[inline(always)]
    fn from_addr(addr: &Addr) -> Self {
        *addr
    }
    #[inline(always)]
    fn addr(&self) -> Addr {
        *self
    }
    #[inline(always)]
    fn csum_diff(old: &Addr, new: &Addr) -> u64 {
        let mut diff = 0;
        for i in 0..4 {
            diff += csum::word_diff(old.0[i], new.0[i]);
        }
        diff
    }
    #[inline(always)]
    unsafe fn write_addr_words(words: *mut u64, src: &Addr, dst: &Addr) -> usize {
        unsafe {
            words.write(word_pair(src.0[0], src.0[1]));
            words.add(1).write(word_pair(src.0[2], src.0[3]));
            words.add(2).write(word_pair(dst.0[0], dst.0[1]));
            words.add(3).write(word_pair(dst.0[2], dst.0[3]));
        }
        4
    }
}

/// A slot of a per-CPU flow cache (`KPR_FLOW_CACHE4/6`): a copy of a flow's conntrack entry,
/// how long it serves, and the packets and bytes it served that are not yet added to
/// `KPR_SERVICE_STATS` (they are when the slot is filled again; a scrape adds the rest).
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct CachedFlow<A> {
    pub key: CtKey<A>,
    pub generation: Generation,
    /// The programs' clock (ns) from which the copy no longer serves.
    pub valid_until: u64,
    /// 1: the entry's kept route was of the current period (it serves a packet sent straight out).
    pub routed: u64,
    pub packets: u64,
    pub bytes: u64,
    pub entry: CtValue,
}

/// `KPR_CT_GENERATION`'s words, as they were read.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Generation {
    pub datapath: u64,
    pub agent: u64,
}

/// Key of the conntrack tables: a packet's 5-tuple as it arrives (addresses and ports in
/// network byte order). Each translated flow has two entries: the client's direction and the
/// reply's. `CtKey` (the default) holds addresses of either family, IPv4 mapped.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtKey<A = Addr> {
    pub src_addr: A,
    pub dst_addr: A,
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    /// Padding in two fields: a zeroed `[u8; 3]` compiles to a call of a byte-loop `memset`
    /// on BPF, on every packet.
    pub _pad: u8,
    pub _pad2: u16,
}

/// The key of the IPv4 conntrack tables.
pub type CtKey4 = CtKey<Addr4>;

impl<A: FlowAddr> CtKey<A> {
    #[inline(always)]
    pub fn new(src_addr: Addr, dst_addr: Addr, src_port: u16, dst_port: u16, proto: u8) -> Self {
        Self {
            src_addr: A::from_addr(&src_addr),
            dst_addr: A::from_addr(&dst_addr),
            src_port,
            dst_port,
            proto,
            _pad: 0,
            _pad2: 0,
        }
    }

    /// Write the key of a tuple at `key` in whole 8-byte words, as [`CtKey::new`] makes it. The
    /// kernel hashes a key in 4-byte loads and compares it in 8-byte ones; a load of bytes that
    /// several smaller stores wrote waits until they reach the cache (store-to-load forwarding
    /// fails), and a packet's key is looked up right after it is written.
    ///
    /// # Safety
    /// `key` is valid for writes of a key and 8-byte aligned.
    #[inline(always)]
    pub unsafe fn write_words(
        key: *mut Self,
        src_addr: &Addr,
        dst_addr: &Addr,
        src_port: u16,
        dst_port: u16,
        proto: u8,
    ) {
        const { assert!(size_of::<Self>().is_multiple_of(8)) };
        let words = key.cast::<u64>();
        let ports = if cfg!(target_endian = "little") {
            u64::from(src_port) | u64::from(dst_port) << 16 | u64::from(proto) << 32
        } else {
            u64::from(src_port) << 48 | u64::from(dst_port) << 32 | u64::from(proto) << 24
        };
        // SAFETY: the key's addresses, then its ports, protocol and padding: its whole size.
        unsafe {
            let n = A::write_addr_words(words, src_addr, dst_addr);
            words.add(n).write(ports);
        }
    }

    /// The same tuple with addresses of either family (IPv4 mapped).
    #[inline(always)]
    pub fn wide(&self) -> CtKey {
        CtKey::new(self.src_addr.addr(), self.dst_addr.addr(), self.src_port, self.dst_port, self.proto)
    }
}

/// Value of the conntrack tables: what the packet's addresses and ports are rewritten to, and how
/// long the flow lives.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtValue {
    pub src_addr: Addr,
    pub dst_addr: Addr,
    pub src_port: u16,
    pub dst_port: u16,
    pub service_id: u32,
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) of the flow's latest packet, refreshed at most
    /// every [`ct::REFRESH_NS`] (both entries of the flow together).
    pub last_seen: u64,
    /// `ct::*` bits: which direction this entry is, and what the flow has shown so far.
    pub flags: u32,
    /// The checksum difference of the addresses' translation ([`addrs_csum_diff`] from the
    /// entry's key to `src_addr`, `dst_addr`): worked out once when the entry is made, so that a
    /// packet's IPv4 header and L4 pseudo header checksums take one addition each.
    pub addrs_csum_diff: u32,
    /// Where this entry's translated packets leave the node when they are sent straight out:
    /// the route lookup's answer, kept for about a second.
    pub route: CachedRoute,
}

/// A route lookup's answer for one direction of a flow (`bpf_fib_lookup`), so that the flow's
/// packets skip the lookup. It serves while the clock is in the period of
/// [`ct::ROUTE_PERIOD_SHIFT`] it was looked up in, so a route change reaches an established
/// flow within about a second.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CachedRoute {
    /// The link the route leaves by; 0: nothing cached.
    pub ifindex: u32,
    /// When it was looked up: `bpf_ktime_get_ns() >> ct::ROUTE_PERIOD_SHIFT`.
    pub period: u32,
    /// That link's MTU: a longer packet (not GSO) takes the lookup, which hands it to the stack.
    pub mtu: u16,
    /// The next hop's family (an IPv4 route may have an IPv6 gateway).
    pub family: u8,
    /// 1: the link is a `LINK_FLAG_PEER` one, and `next_hop` holds the MAC addresses.
    pub peer: u8,
    /// The next hop (the gateway, else the destination) as `bpf_redir_neigh` takes it: an
    /// IPv4 address in the first word. For `peer`: the packet's new destination and source MAC
    /// addresses (the next hop's and the link's), in the first 12 bytes.
    pub next_hop: [u32; 4],
}

impl CachedRoute {
    pub const NONE: Self = Self { ifindex: 0, period: 0, mtu: 0, family: 0, peer: 0, next_hop: [0; 4] };
}

impl CtValue {
    /// The flow has seen no packet for longer than `lifetime` at `now` (ns).
    #[inline(always)]
    pub const fn idle_longer_than(&self, lifetime: u64, now: u64) -> bool {
        now.saturating_sub(self.last_seen) > lifetime
    }

    /// Does this entry rewrite packets to the same addresses and ports as `other`?
    #[inline(always)]
    pub const fn same_translation(&self, other: &Self) -> bool {
        self.src_addr.same(&other.src_addr)
            && self.dst_addr.same(&other.dst_addr)
            && self.src_port == other.src_port
            && self.dst_port == other.dst_port
    }

    /// The key of the flow's other entry (replies for a client's entry, and back).
    #[inline(always)]
    pub fn pair_key<A: FlowAddr>(&self, proto: u8) -> CtKey<A> {
        CtKey::new(self.dst_addr, self.src_addr, self.dst_port, self.src_port, proto)
    }
}

/// [`CtValue::addrs_csum_diff`] of an entry whose key has the addresses `src`, `dst` and which
/// rewrites them to `to_src`, `to_dst` (tables of addresses `A`), folded to 32 bits.
#[inline(always)]
pub fn addrs_csum_diff<A: FlowAddr>(src: &Addr, dst: &Addr, to_src: &Addr, to_dst: &Addr) -> u32 {
    csum::fold32(A::csum_diff(src, to_src) + A::csum_diff(dst, to_dst))
}

/// Conntrack flow state (`CtValue::flags`) and lifetimes.
pub mod ct {
    /// This entry translates the replies (backend → client).
    pub const REPLY: u32 = 1;
    /// The backend has answered: the flow is confirmed (TCP: established).
    pub const SEEN_REPLY: u32 = 2;
    /// The client sent a FIN.
    pub const FIN_ORIG: u32 = 4;
    /// The backend sent a FIN.
    pub const FIN_REPLY: u32 = 8;
    /// Either side sent a RST.
    pub const RST: u32 = 16;
    /// TCP: the backend answered (`SEEN_REPLY`), the client has not acknowledged the answer
    /// yet (nf_conntrack's SYN_RECV): the flow keeps the SYN timeout, and a new flow stays
    /// with the flows not answered, until the client's ACK. So SYNs whose SYN-ACKs are never
    /// acknowledged hold their SNAT ports for a minute, not for the established timeout.
    pub const AWAITING_ACK: u32 = 32;
    /// Bits that describe the flow (the same in both of its entries).
    pub const FLOW_BITS: u32 = SEEN_REPLY | FIN_ORIG | FIN_REPLY | RST | AWAITING_ACK;
    /// Set by the agent (`--abort-dead-tcp`) on the client's entry of a TCP flow whose endpoint
    /// died (its pod is gone, its node NotReady): the client's next segment is answered with a
    /// RST and the flow forgotten, so the client fails at once instead of retransmitting into
    /// the void for `tcp_retries2`. Not a flow bit: the replies' entry never has it.
    pub const ENDPOINT_DEAD: u32 = 64;
    /// The client's entry of a flow sent on by direct server return (`SERVICE_FLAG_DSR`): its
    /// packets are put in IP-in-IP to `dst_addr` (the endpoint) and not translated; no reply
    /// comes back through this node, so the client's next packet after its first marks the
    /// flow answered (it stays among the new flows), and the client's FIN closes it. On the
    /// endpoint's node, the replies' entry of a flow that came out of the tunnel: the
    /// endpoint's SYN-ACK announces a segment size the tunnel's header leaves room for.
    pub const DSR: u32 = 128;
    /// `last_seen` is rewritten at most this often (a write per packet would bounce the entry's
    /// cache line between CPUs).
    pub const REFRESH_NS: u64 = 1_000_000_000;
    /// A kept route lookup serves while `now >> ROUTE_PERIOD_SHIFT` (periods of 1.07 s) is the
    /// one it was looked up in.
    pub const ROUTE_PERIOD_SHIFT: u32 = 30;
    /// A closed TCP flow's SNAT port may go to a new flow after this long (its last ACK has
    /// long arrived; a backend in TIME_WAIT accepts the new SYN), well before the flow expires.
    pub const CLOSED_PORT_REUSE_NS: u64 = 1_000_000_000;

    /// TCP after RST or FINs both ways: the connection is over.
    pub const fn closed(flags: u32) -> bool {
        flags & RST != 0 || flags & (FIN_ORIG | FIN_REPLY) == FIN_ORIG | FIN_REPLY
    }
}

/// How long an idle flow lives, by state (nanoseconds); the tc programs' `KPR_CT_TIMEOUTS`,
/// set by the agent from kube-proxy's `conntrack.*` settings. The agent's sweep uses the same
/// function, so both sides agree on what has expired.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtTimeouts {
    /// TCP until the client acknowledged the backend's answer (SYN_SENT, SYN_RECV): 60 s.
    pub tcp_syn: u64,
    /// TCP established (`conntrack.tcpEstablishedTimeout`, kube-proxy's default 24 h).
    pub tcp_established: u64,
    /// TCP after one side's FIN (`conntrack.tcpCloseWaitTimeout`, default 1 h).
    pub tcp_close_wait: u64,
    /// TCP after FINs both ways or a RST (nf_conntrack's CLOSE is 10 s).
    pub tcp_closed: u64,
    /// UDP not answered (`conntrack.udpTimeout`; the kernel's 30 s when unset).
    pub udp: u64,
    /// UDP answered (`conntrack.udpStreamTimeout`; the kernel's 120 s when unset).
    pub udp_stream: u64,
}

impl CtTimeouts {
    const S: u64 = 1_000_000_000;
    pub const DEFAULT: Self = Self {
        tcp_syn: 60 * Self::S,
        tcp_established: 86_400 * Self::S,
        tcp_close_wait: 3_600 * Self::S,
        tcp_closed: 10 * Self::S,
        udp: 30 * Self::S,
        udp_stream: 120 * Self::S,
    };

    /// How long a flow of `proto` in state `flags` lives after its latest packet.
    #[inline(always)]
    pub const fn lifetime(&self, proto: u8, flags: u32) -> u64 {
        self.as_words()[Self::slot(proto, flags)]
    }

    /// Which lifetime bounds a flow of `proto` in state `flags`: the index of its field, so
    /// that the datapath reads that one word of its copy.
    #[inline(always)]
    pub const fn slot(proto: u8, flags: u32) -> usize {
        if has_states(proto) {
            if ct::closed(flags) {
                3 // tcp_closed
            } else if flags & (ct::FIN_ORIG | ct::FIN_REPLY) != 0 {
                2 // tcp_close_wait
            } else if flags & (ct::SEEN_REPLY | ct::AWAITING_ACK) == ct::SEEN_REPLY {
                1 // tcp_established
            } else {
                0 // tcp_syn (SYN_SENT, SYN_RECV)
            }
        } else if flags & ct::SEEN_REPLY != 0 {
            5 // udp_stream
        } else {
            4 // udp
        }
    }

    /// The lifetimes in field order.
    pub const fn as_words(&self) -> [u64; 6] {
        [self.tcp_syn, self.tcp_established, self.tcp_close_wait, self.tcp_closed, self.udp, self.udp_stream]
    }

    /// The entry has been idle longer than its state allows at `now` (CLOCK_MONOTONIC, ns).
    #[inline(always)]
    pub const fn expired(&self, proto: u8, entry: &CtValue, now: u64) -> bool {
        entry.idle_longer_than(self.lifetime(proto, entry.flags), now)
    }
}

/// Key of `KPR_FRAGMENTS`: an IPv4 datagram in fragments, as its first fragment arrived
/// (addresses and id as in the packet).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragmentKey {
    pub src_addr: u32,
    pub dst_addr: u32,
    pub id: u16,
    pub proto: u8,
    pub _pad: u8,
}

/// Data of a `KPR_SOURCE_RANGES` LPM key: the prefix length covers all of `service_id` (32
/// bits) plus the CIDR's bits of `addr` (`Addr::V4_PREFIX_OFFSET` more for IPv4).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SourceRange {
    /// Service id, big-endian (LPM compares bytes in order).
    pub service_id: u32,
    /// Client address or CIDR base (an IPv4 prefix is mapped).
    pub addr: Addr,
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
    /// loadBalancerSourceRanges, a non-SYN TCP packet for a service without endpoints, an IPv4
    /// packet arriving with the node's own address as source where kpr set `accept_local`).
    pub const TC_DROPPED: u32 = 8;
    /// tc: no free SNAT port found for a new flow: dropped.
    pub const TC_SNAT_EXHAUSTED: u32 = 9;
    /// tc: conntrack entry could not be stored: dropped (the flow could not be reversed).
    pub const TC_CT_FULL: u32 = 10;
    /// tc: a packet the per-packet path cannot translate (IP options; a later fragment whose
    /// first fragment was not seen): passed untranslated.
    pub const TC_PASSED_UNSUPPORTED: u32 = 11;
    /// Socket path: a connection left to the per-packet path (`SERVICE_FLAG_SOCKET_SKIP`, or a
    /// pod reaching itself through its service).
    pub const SOCK_STEPPED_ASIDE: u32 = 12;
    /// Socket path: refused with EPERM where kube-proxy drops (traffic policy Local without a
    /// local endpoint, a source outside loadBalancerSourceRanges).
    pub const SOCK_DROPPED: u32 = 13;
    /// tc: a TCP packet other than a SYN found no flow and re-created it (same backend and
    /// SNAT port as before, when they are still free): its entries had been evicted or expired.
    pub const TC_CT_RECREATED: u32 = 14;
    /// tc: a flow's other entry was missing (evicted) and was put back.
    pub const TC_CT_HEALED: u32 = 15;
    /// tc: an expired flow was removed on the packet path (its tuple or SNAT port reused).
    pub const TC_CT_EXPIRED: u32 = 16;
    /// tc: a later fragment of a translated datagram got its first fragment's addresses.
    pub const TC_FRAGMENT_TRANSLATED: u32 = 17;
    /// Socket path: the agent's own connect/sendmsg to an externalIP or LoadBalancer IP, left
    /// untranslated (`SERVICE_FLAG_EXTERNAL_ADDR`).
    pub const SOCK_AGENT_EXEMPT: u32 = 18;
    /// tc: two CPUs created the same new flow at once (a SYN and its retransmission); the
    /// later one took the first one's translation.
    pub const TC_CT_RACE_ADOPTED: u32 = 19;
    /// tc: a translated packet was sent straight out of the link its route leaves by.
    pub const TC_FORWARDED_DIRECT: u32 = 20;
    /// tc: a packet that needed the slow program found none in `KPR_TC_SLOW_PATH` (should
    /// never happen: the agent fills it before it attaches): passed untranslated.
    pub const TC_SLOW_PATH_MISSING: u32 = 21;
    /// tc: a packet of an established flow found it in conntrack and put it in this CPU's flow
    /// cache, where the flow's next packets find it (`tc_ct_hit` less this: the cache's hits).
    pub const TC_FLOW_CACHE_FILLED: u32 = 22;
    /// tc: a packet sent straight out went to a pod's end of a veth pair at once
    /// (`LINK_FLAG_PEER`, `bpf_redirect_peer`); also counted in `tc_forwarded_direct`.
    pub const TC_REDIRECTED_PEER: u32 = 23;
    /// tc: a flow got its answer while the established table was full: it stays among the
    /// new flows (where other new flows may evict it), established there.
    pub const TC_CT_ESTABLISHED_FULL: u32 = 24;
    /// Socket path: a socket's namespace held its share of the reverse-translation table (or the
    /// table its limit): the connection was left to the per-packet path where that covers the
    /// socket, else translated without an entry (getpeername and recvmsg then show the endpoint).
    pub const SOCK_OVER_QUOTA: u32 = 25;
    /// tc: a segment of a flow whose endpoint died (`ct::ENDPOINT_DEAD`, `--abort-dead-tcp`)
    /// was answered with a RST toward the client.
    pub const TC_DEAD_FLOW_RESET: u32 = 26;
    /// XDP (`--xdp`): a packet of an established flow was translated and sent back out of the
    /// link it came in on (`XDP_TX`), before the kernel made an skb of it.
    pub const XDP_FORWARDED: u32 = 27;
    /// Number of counters.
    pub const COUNT: u32 = 28;
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
        "sock_stepped_aside",
        "sock_dropped",
        "tc_ct_recreated",
        "tc_ct_healed",
        "tc_ct_expired",
        "tc_fragment_translated",
        "sock_agent_exempt",
        "tc_ct_race_adopted",
        "tc_forwarded_direct",
        "tc_slow_path_missing",
        "tc_flow_cache_filled",
        "tc_redirected_peer",
        "tc_ct_established_full",
        "sock_over_quota",
        "tc_dead_flow_reset",
        "xdp_forwarded",
    ];
}

const _: () = assert!(size_of::<Addr>() == 16);
const _: () = assert!(size_of::<ServiceKey>() == 20);
const _: () = assert!(size_of::<ServiceValue>() == 24);
const _: () = assert!(size_of::<AffinityKey>() == 24);
const _: () = assert!(size_of::<BackendKey>() == 20);
const _: () = assert!(size_of::<BackendAnswers>() == 24);
const _: () = assert!(size_of::<AffinityValue>() == 32);
const _: () = assert!(size_of::<Backend>() == 20);
const _: () = assert!(size_of::<SockRevNatKey>() == 32);
const _: () = assert!(size_of::<SockRevNatValue>() == 24);
const _: () = assert!(size_of::<SockSlot>() == 40);
const _: () = assert!(size_of::<SockTcp>() == 32);
const _: () = assert!(size_of::<SockSlots>() == 16 + 40 * SOCK_SLOTS);
const _: () = assert!(size_of::<CtKey>() == 40);
const _: () = assert!(size_of::<CtKey4>() == 16);
const _: () = assert!(size_of::<CtValue>() == 88);
const _: () = assert!(size_of::<DatapathEvent>() == 56);
const _: () = assert!(size_of::<CtTimeouts>() == 48);
const _: () = assert!(size_of::<SourceRange>() == 20);
const _: () = assert!(size_of::<FragmentKey>() == 12);
const _: () = assert!(size_of::<LinkInfo>() == 24);
const _: () = assert!(size_of::<CidrKey>() == 16);
const _: () = assert!(size_of::<CidrMask>() == 32);

pub mod crc32c;
pub mod csum;

/// Pseudo-random test data (xorshift32): the checksum tests compare updates with
/// recomputations over many inputs.
#[cfg(test)]
fn test_numbers(mut seed: u32) -> impl FnMut() -> u32 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        seed
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are repr(C) with explicit padding and only integer fields.
    unsafe impl aya::Pod for super::ServiceKey {}
    unsafe impl aya::Pod for super::ServiceValue {}
    unsafe impl aya::Pod for super::MaglevKey {}
    unsafe impl aya::Pod for super::MaglevChunk {}
    unsafe impl aya::Pod for super::Backend {}
    unsafe impl aya::Pod for super::BackendKey {}
    unsafe impl aya::Pod for super::BackendAnswers {}
    unsafe impl aya::Pod for super::EndpointStats {}
    unsafe impl aya::Pod for super::SockRevNatKey {}
    unsafe impl aya::Pod for super::SockRevNatValue {}
    unsafe impl aya::Pod for super::CtKey {}
    unsafe impl aya::Pod for super::CtKey4 {}
    unsafe impl aya::Pod for super::CtValue {}
    unsafe impl aya::Pod for super::CtTimeouts {}
    unsafe impl aya::Pod for super::SourceRange {}
    unsafe impl aya::Pod for super::FragmentKey {}
    unsafe impl aya::Pod for super::LinkInfo {}
    unsafe impl aya::Pod for super::CidrKey {}
    unsafe impl aya::Pod for super::CidrMask {}
    unsafe impl aya::Pod for super::AffinityKey {}
    unsafe impl aya::Pod for super::AffinityValue {}
    unsafe impl aya::Pod for super::Addr {}
    unsafe impl aya::Pod for super::ServiceStats {}
    unsafe impl aya::Pod for super::CachedFlow<super::Addr4> {}
    unsafe impl aya::Pod for super::CachedFlow<super::Addr> {}
}

#[cfg(test)]
mod timeout_tests {
    use super::*;

    #[test]
    fn each_state_reads_its_own_lifetime_word() {
        let t = CtTimeouts { tcp_syn: 1, tcp_established: 2, tcp_close_wait: 3, tcp_closed: 4, udp: 5, udp_stream: 6 };
        // The datapath reads word `slot` of the struct as it is in memory.
        // SAFETY: six u64 fields, repr(C): the same bytes as [u64; 6].
        let in_memory: [u64; 6] = unsafe { core::mem::transmute(t) };
        assert_eq!(in_memory, t.as_words());
        let (reply, fin_orig, fin_reply) = (ct::SEEN_REPLY, ct::FIN_ORIG, ct::FIN_REPLY);
        for (proto, flags, lifetime) in [
            (IPPROTO_TCP, 0, t.tcp_syn),
            (IPPROTO_TCP, reply, t.tcp_established),
            (IPPROTO_TCP, reply | ct::AWAITING_ACK, t.tcp_syn),
            (IPPROTO_SCTP, reply, t.tcp_established),
            (IPPROTO_TCP, reply | fin_orig, t.tcp_close_wait),
            (IPPROTO_TCP, reply | fin_reply, t.tcp_close_wait),
            (IPPROTO_TCP, reply | fin_orig | fin_reply, t.tcp_closed),
            (IPPROTO_TCP, ct::RST, t.tcp_closed),
            (IPPROTO_UDP, 0, t.udp),
            (IPPROTO_UDP, reply, t.udp_stream),
            (IPPROTO_UDP, reply | ct::RST, t.udp_stream),
        ] {
            assert_eq!(t.lifetime(proto, flags), lifetime, "proto {proto}, flags {flags:#x}");
        }
    }
}

#[cfg(test)]
mod addrs_csum_diff_tests {
    use super::*;

    /// The one's complement sum of a pseudo header's addresses, the ports and a checksum field:
    /// 0xffff when the field is right for them (the rest of a segment only adds a constant).
    fn sum(src: &Addr, dst: &Addr, ports: u32, check: u16, v4: bool) -> u16 {
        let words = |a: &Addr| if v4 { [a.v4(), 0, 0, 0] } else { a.0 };
        let total: u64 = words(src).iter().chain(words(dst).iter()).chain([ports].iter()).map(|&w| u64::from(w)).sum();
        csum::fold16(total + u64::from(check))
    }

    /// An entry's difference, and the mirror entry's (its complement), keep a checksum right
    /// through the translation as the tc programs apply it: one addition with the ports' own.
    #[test]
    fn an_entrys_difference_and_its_complement_translate_both_ways() {
        let mut next = crate::test_numbers(0x2545_f491);
        for round in 0..20_000 {
            let v4 = round % 2 == 0;
            let mut addr = || if v4 { Addr::from_v4(next()) } else { Addr([next(), next(), next(), next()]) };
            let (src, dst, to_src, to_dst) = (addr(), addr(), addr(), addr());
            let (ports, to_ports) = (next(), next());
            // A field that makes the segment verify: the pseudo header and ports sum to its complement.
            let check = !sum(&src, &dst, ports, 0, v4);
            assert_eq!(sum(&src, &dst, ports, check, v4), 0xffff);
            let diff = if v4 {
                addrs_csum_diff::<Addr4>(&src, &dst, &to_src, &to_dst)
            } else {
                addrs_csum_diff::<Addr>(&src, &dst, &to_src, &to_dst)
            };
            let there = csum::replace(check, u64::from(diff) + csum::word_diff(ports, to_ports));
            assert_eq!(sum(&to_src, &to_dst, to_ports, there, v4), 0xffff, "forward, round {round}");
            let back = csum::replace(there, u64::from(!diff) + csum::word_diff(to_ports, ports));
            assert_eq!(sum(&src, &dst, ports, back, v4), 0xffff, "back, round {round}");
        }
    }
}

#[cfg(test)]
mod ct_key_words_tests {
    use super::*;

    fn written<A: FlowAddr>(src: &Addr, dst: &Addr, sport: u16, dport: u16, proto: u8) -> CtKey<A> {
        let mut words = [0xa5a5_a5a5_a5a5_a5a5u64; 5];
        let key = words.as_mut_ptr().cast::<CtKey<A>>();
        // SAFETY: 40 bytes, 8-byte aligned: room for either family's key.
        unsafe {
            CtKey::write_words(key, src, dst, sport, dport, proto);
            *key
        }
    }

    /// A key written word by word is the key `new` makes, in both families (its padding is in
    /// fields: equal keys are equal bytes).
    #[test]
    fn a_key_written_in_words_is_the_key_new_makes() {
        let mut next = crate::test_numbers(0x9e37_79b9);
        for _ in 0..1_000 {
            let (sport, dport, proto) = (next() as u16, next() as u16, next() as u8);
            let (src4, dst4) = (Addr::from_v4(next()), Addr::from_v4(next()));
            let made = CtKey::<Addr4>::new(src4, dst4, sport, dport, proto);
            assert_eq!(written::<Addr4>(&src4, &dst4, sport, dport, proto), made);
            let (src6, dst6) = (Addr([next(), next(), next(), next()]), Addr([next(), next(), next(), next()]));
            let made = CtKey::<Addr>::new(src6, dst6, sport, dport, proto);
            assert_eq!(written::<Addr>(&src6, &dst6, sport, dport, proto), made);
        }
    }
}
