//! The maps shared with the agent. Pinned by name under the agent's versioned pin directory;
//! sizes here are placeholders that the agent overrides at load time.
use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap, ProgramArray, RingBuf, SkStorage},
    macros::btf_map,
};
use proxy_common::{
    Addr, Addr4, AffinityKey, AffinityValue, Backend, BackendAnswers, BackendKey, CachedFlow, CidrKey, CidrMask, CtKey,
    CtValue, DatapathEvent, EndpointStats, FlowAddr, FragmentKey, LinkInfo, MAGLEV_CHUNK_SLOTS,
    MAGLEV_DEFAULT_TABLE_SIZE, MaglevChunk, MaglevKey, ServiceKey, ServiceStats, ServiceValue, SockRevNatKey,
    SockRevNatValue, SockSlots, SockTcp, SourceRange, counter, ct_generation, defaults, maglev_chunks,
};

/// The slow programs (`program_names::TC_SLOW_PATH`), by slot: where the attached programs
/// hand a packet whose flow is not in conntrack (a new flow, an ICMP error, not a flow at all).
/// The attached programs keep to an established flow's path with its stages inlined: a
/// subprogram call and its return cost about 7.5 ns where the kernel mitigates returns (AMD's
/// SRSO), and a program with those stages inlined could not also call the new-flow path's chain
/// of subprograms within the 512-byte BPF stack. A tail call starts the slow program on a
/// stack of its own. Filled by the agent before it attaches; pinned, so that it outlives it.
#[btf_map(name = "KPR_TC_SLOW_PATH", pin_by_name)]
pub static SLOW_PATH: ProgramArray<{ proxy_common::tc_slow_path::SLOTS as usize }> = ProgramArray::new();

/// ClusterIP:port/proto → the service's range in `KPR_BACKENDS`.
/// Not preallocated: memory follows the number of services actually programmed.
#[btf_map(name = "KPR_SERVICES", pin_by_name)]
pub static SERVICES: HashMap<
    ServiceKey,
    ServiceValue,
    { defaults::MAX_SERVICE_PORTS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// (Service id, chunk) → a chunk of the Maglev table of a frontend with `SERVICE_FLAG_MAGLEV`
/// (`MaglevChunk`): not preallocated, memory follows the tables written. The agent sizes it
/// for the configured table size.
#[btf_map(name = "KPR_MAGLEV", pin_by_name)]
pub static MAGLEV: HashMap<
    MaglevKey,
    MaglevChunk,
    { (defaults::MAX_MAGLEV_FRONTENDS * maglev_chunks(MAGLEV_DEFAULT_TABLE_SIZE)) as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// Backend slots; each service port owns one contiguous range.
#[btf_map(name = "KPR_BACKENDS", pin_by_name)]
pub static BACKENDS: Array<Backend, { defaults::MAX_BACKENDS as usize }> = Array::new();

/// Socket cookie + backend → the service address the application used (for getpeername and
/// recvmsg). Each entry belongs to a socket's slot (`SOCK_SLOTS`) and goes when the socket
/// closes; the namespaces' shares (`SOCK_QUOTA`) keep the table below its size, so the LRU
/// never has to evict a live socket's entry. LRU still: entries no slot holds (an older
/// layout's, carried over an upgrade) age out.
#[btf_map(name = "KPR_SOCK_REVNAT", pin_by_name)]
pub static SOCK_REVNAT: LruHashMap<SockRevNatKey, SockRevNatValue, { defaults::MAX_SOCK_REVNAT as usize }> =
    LruHashMap::new();

/// Unconnected UDP: socket cookie + service address → the backend its datagrams go to, so that
/// one socket's exchange with a service stays on one endpoint (as a conntrack entry keeps a UDP
/// flow on one endpoint behind kube-proxy). Kept like `SOCK_REVNAT`.
#[btf_map(name = "KPR_SOCK_PICKS", pin_by_name)]
pub static SOCK_PICKS: LruHashMap<SockRevNatKey, Backend, { defaults::MAX_SOCK_REVNAT as usize }> = LruHashMap::new();

/// Per socket: the entries it holds in `SOCK_REVNAT` and `SOCK_PICKS`, so that it drops its
/// own oldest when it sends to more service addresses than it has slots, and
/// `kpr_sock_release` removes them all.
#[btf_map(name = "KPR_SOCK_SLOTS", pin_by_name)]
pub static SOCK_SLOTS: SkStorage<SockSlots> = SkStorage::new();

/// TCP socket cookie → its one entry in `SOCK_REVNAT` and the namespace it is counted under
/// (`kpr_sock_release` removes both, whatever became of the socket's peer address).
#[btf_map(name = "KPR_SOCK_TCP", pin_by_name)]
pub static SOCK_TCP: HashMap<u64, SockTcp, { defaults::MAX_SOCK_REVNAT as usize }> = HashMap::new();

/// Network namespace cookie → entries its sockets hold in `SOCK_REVNAT` (key
/// `SOCK_QUOTA_TOTAL`: all of them). Counts go below zero (as i64) where an entry evicted
/// here came back; they only ever err toward admitting.
#[btf_map(name = "KPR_SOCK_QUOTA", pin_by_name)]
pub static SOCK_QUOTA: LruHashMap<u64, u64, { defaults::MAX_SOCK_QUOTA_NETNS as usize }> = LruHashMap::new();

/// Pods whose sockets the socket path leaves to the per-packet path (an annotation, or a
/// mesh's sidecar): the cgroup id of each such pod → its level, and under key 0 the levels such
/// pods sit at (bit n: level n), so that a connect() asks only those levels of its ancestry.
#[btf_map(name = "KPR_SOCKET_SKIP", pin_by_name)]
pub static SOCKET_SKIP: HashMap<u64, u32, { defaults::MAX_SOCKET_SKIP as usize }> = HashMap::new();

/// Is the calling task in a pod whose sockets are left alone (`SOCKET_SKIP`)? One lookup while
/// no pod is, one more per level that holds such pods.
#[inline(always)]
pub fn socket_skipped() -> bool {
    // The key on the stack, written there: a reference to a constant 0 is folded into one to
    // a global whose initial value is 0 (`KPR_HOST_NETNS_COOKIE`), which the loader then
    // overwrites, and the lookup would ask for that value.
    let mut levels_key = 1u64;
    // SAFETY: a local variable.
    unsafe { core::ptr::write_volatile(&mut levels_key, 0) };
    // SAFETY: a map value, read at once.
    let Some(levels) = (unsafe { SOCKET_SKIP.get(&levels_key) }).copied() else { return false };
    for level in 1..proxy_common::SOCKET_SKIP_LEVELS {
        if levels & (1 << level) != 0 {
            // SAFETY: a helper that reads the calling task's cgroup.
            let id = unsafe { aya_ebpf::helpers::bpf_get_current_ancestor_cgroup_id(level as i32) };
            // SAFETY: as above.
            if id != 0 && unsafe { SOCKET_SKIP.get(&id) }.is_some() {
                return true;
            }
        }
    }
    false
}

/// The pods' network namespaces (cookies) behind a link that holds the per-packet programs; key
/// 0 is there when the agent could tell them (it enters each to learn its cookie). The socket
/// path leaves a pod's connection to the per-packet path only where its namespace is listed: a
/// pod whose link appeared while no agent ran is translated at its socket instead of sending
/// a packet no program translates.
#[btf_map(name = "KPR_COVERED_NETNS", pin_by_name)]
pub static COVERED_NETNS: HashMap<u64, u8, { defaults::MAX_SOCKET_SKIP as usize }> = HashMap::new();

/// Does the per-packet path cover the link of the pod whose namespace is `netns`? Yes where
/// the agent cannot tell (no key 0).
#[inline(always)]
pub fn netns_covered(netns: u64) -> bool {
    // On the stack, written there (see `socket_skipped`).
    let mut known_key = 1u64;
    // SAFETY: a local variable.
    unsafe { core::ptr::write_volatile(&mut known_key, 0) };
    // SAFETY: map lookups whose values are not read.
    unsafe { COVERED_NETNS.get(&known_key).is_none() || COVERED_NETNS.get(&netns).is_some() }
}

/// Per-CPU event counters, indexed by `proxy_common::counter`.
#[btf_map(name = "KPR_COUNTERS", pin_by_name)]
pub static COUNTERS: PerCpuArray<u64, { counter::COUNT as usize }> = PerCpuArray::new();

/// Service id → what its frontend saw, per CPU (`proxy_common::service_stat`). The agent
/// makes an entry with its frontend and removes it with it; sized as `KPR_SERVICES`, not
/// preallocated.
#[btf_map(name = "KPR_SERVICE_STATS", pin_by_name)]
pub static SERVICE_STATS: PerCpuHashMap<
    u32,
    ServiceStats,
    { defaults::MAX_SERVICE_PORTS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = PerCpuHashMap::new();

/// Endpoint → what its flows and connects saw, per CPU (`--endpoint-counters`): the agent makes
/// an entry per endpoint up to the map's size (the cap; 1 entry when off) and removes it with
/// the endpoint; the programs only add to entries there are.
#[btf_map(name = "KPR_ENDPOINT_STATS", pin_by_name)]
pub static ENDPOINT_STATS: PerCpuHashMap<BackendKey, EndpointStats, 1, { BPF_F_NO_PREALLOC as usize }> =
    PerCpuHashMap::new();

/// Endpoint → how it answered the first packets of new per-packet flows
/// (`stats::backend_answered`): the successes and refusals of the agent's outlier detection,
/// and the socket path's unanswered connects (the per-packet flows it never answers are the
/// new-flow tables' own). Shared by the CPUs, added to
/// atomically: a per-CPU value would take its size times every possible CPU, preallocated.
/// LRU: an endpoint no flow reached for long goes.
#[btf_map(name = "KPR_BACKEND_ANSWERS", pin_by_name)]
pub static BACKEND_ANSWERS: LruHashMap<BackendKey, BackendAnswers, { defaults::MAX_BACKEND_ANSWERS as usize }> =
    LruHashMap::new();

/// Non-zero while the agent's outlier detection watches endpoints: the answers are counted
/// then only (a lookup and an atomic add, about 80 ns a flow, spared when no one reads them).
#[btf_map(name = "KPR_ANSWERS_WANTED", pin_by_name)]
pub static ANSWERS_WANTED: Array<u64, 1> = Array::new();

/// A family's per-CPU flow cache.
pub type FlowCache<A> = PerCpuArray<CachedFlow<A>, { defaults::FLOW_CACHE_SLOTS as usize }>;

/// The table of established flows: a packet's 5-tuple → its rewrite (two entries per flow).
/// Not an LRU: as in netfilter's conntrack, an established flow is never evicted to make room
/// (the kernel would do it silently, and a flow whose replies' entry went could not be found
/// from its next reply). When full, a flow that gets its answer stays in the new-flow table.
pub type EstablishedMap<K> = HashMap<K, CtValue, { defaults::MAX_CONNTRACK as usize }>;

/// The table of flows not answered yet (and of answered ones the full established table could
/// not take). LRU: when full, the least recently used goes, as netfilter drops an unassured
/// flow to make room (`early_drop`).
pub type NewFlowMap<K> = LruHashMap<K, CtValue, { defaults::MAX_CONNTRACK as usize }>;

/// Per-packet conntrack of established IPv4 flows (the backend has answered).
#[btf_map(name = "KPR_CONNTRACK4", pin_by_name)]
pub static CONNTRACK4: EstablishedMap<CtKey<Addr4>> = HashMap::new();

/// Per-packet conntrack of IPv4 flows not answered yet, kept apart so that a flood of them can
/// only evict each other.
#[btf_map(name = "KPR_CT_NEW4", pin_by_name)]
pub static CT_NEW4: NewFlowMap<CtKey<Addr4>> = LruHashMap::new();

/// The same as `KPR_CONNTRACK4`, for IPv6 flows.
#[btf_map(name = "KPR_CONNTRACK6", pin_by_name)]
pub static CONNTRACK6: EstablishedMap<CtKey> = HashMap::new();

/// The same as `KPR_CT_NEW4`, for IPv6 flows.
#[btf_map(name = "KPR_CT_NEW6", pin_by_name)]
pub static CT_NEW6: NewFlowMap<CtKey> = LruHashMap::new();

/// A conntrack table of either kind, as a live flow's packets use it (`touch`, `heal`).
pub trait FlowMap<K> {
    fn get_ptr_mut(&self, key: &K) -> Option<*mut CtValue>;
    fn insert(&self, key: &K, value: &CtValue, flags: u64) -> Result<(), i32>;
}

macro_rules! flow_map {
    ($map:ident) => {
        impl<K> FlowMap<K> for $map<K, CtValue, { defaults::MAX_CONNTRACK as usize }> {
            #[inline(always)]
            fn get_ptr_mut(&self, key: &K) -> Option<*mut CtValue> {
                $map::get_ptr_mut(self, key)
            }
            #[inline(always)]
            fn insert(&self, key: &K, value: &CtValue, flags: u64) -> Result<(), i32> {
                $map::insert(self, key, value, flags)
            }
        }
    };
}
flow_map!(HashMap);
flow_map!(LruHashMap);

/// A family's conntrack tables, by how their keys hold an address.
pub trait FlowTables: FlowAddr + 'static {
    /// Established flows.
    fn established() -> &'static EstablishedMap<CtKey<Self>>;
    /// Flows not answered yet.
    fn new_flows() -> &'static NewFlowMap<CtKey<Self>>;
    /// This CPU's cache of established flows (`flow_cache`).
    fn flow_cache() -> &'static FlowCache<Self>;
    /// What each slot of that cache holds, in a word per slot ([`SlotTags`]).
    fn flow_cache_tags() -> &'static PerCpuArray<SlotTags, 1>;
}

impl FlowTables for Addr4 {
    #[inline(always)]
    fn established() -> &'static EstablishedMap<CtKey<Self>> {
        &CONNTRACK4
    }
    #[inline(always)]
    fn new_flows() -> &'static NewFlowMap<CtKey<Self>> {
        &CT_NEW4
    }
    #[inline(always)]
    fn flow_cache() -> &'static FlowCache<Self> {
        &FLOW_CACHE4
    }
    #[inline(always)]
    fn flow_cache_tags() -> &'static PerCpuArray<SlotTags, 1> {
        &FLOW_CACHE_TAGS4
    }
}

impl FlowTables for Addr {
    #[inline(always)]
    fn established() -> &'static EstablishedMap<CtKey<Self>> {
        &CONNTRACK6
    }
    #[inline(always)]
    fn new_flows() -> &'static NewFlowMap<CtKey<Self>> {
        &CT_NEW6
    }
    #[inline(always)]
    fn flow_cache() -> &'static FlowCache<Self> {
        &FLOW_CACHE6
    }
    #[inline(always)]
    fn flow_cache_tags() -> &'static PerCpuArray<SlotTags, 1> {
        &FLOW_CACHE_TAGS6
    }
}

/// Tuples (both directions) of the flows kube-proxy translated before kpr took the node over
/// (`kpr agent --cleanup-kube-proxy`): netfilter's conntrack keeps translating them, so the
/// per-packet path leaves them alone. Filled and pruned by the agent; empty otherwise.
#[btf_map(name = "KPR_HANDOVER", pin_by_name)]
pub static HANDOVER: LruHashMap<CtKey, u8, { defaults::MAX_HANDOVER as usize }> = LruHashMap::new();

/// How many tuples the agent put in `KPR_HANDOVER` and has not taken out yet: 0 but for a while
/// after a takeover, and then a new flow skips the lookup there (a cold hash miss per new flow).
#[btf_map(name = "KPR_HANDOVER_COUNT", pin_by_name)]
pub static HANDOVER_COUNT: Array<u32, 1> = Array::new();

/// Drops and rejects of the per-packet path, for `kpr events` (`tc::event`).
#[btf_map(name = "KPR_EVENTS", pin_by_name)]
pub static EVENTS: RingBuf<DatapathEvent, { proxy_common::EVENTS_BYTES as usize }> = RingBuf::new();

/// Until when (`bpf_ktime_get_ns`) events are written: a reader keeps it ahead of the clock.
#[btf_map(name = "KPR_EVENTS_WANTED", pin_by_name)]
pub static EVENTS_WANTED: Array<u64, 1> = Array::new();

/// The host as the agent last saw it (`HOST_FORWARD_DIRECT_OK`), written at runtime: a
/// firewall that starts filtering forwarded packets takes effect without a reload.
#[btf_map(name = "KPR_HOST_STATE", pin_by_name)]
pub static HOST_STATE: Array<u32, { proxy_common::host_state::WORDS as usize }> = Array::new();

/// May a translated packet skip the host's forwarding path (its netfilter forward hook)?
#[inline(always)]
pub fn host_lets_direct() -> bool {
    HOST_STATE
        .get(proxy_common::host_state::FORWARD)
        .is_some_and(|state| *state & proxy_common::HOST_FORWARD_DIRECT_OK != 0)
}

/// Is an older layout being retired (`HOST_RETIRING_OLDER_LAYOUT`)?
#[inline(always)]
pub fn retiring_older_layout() -> bool {
    HOST_STATE
        .get(proxy_common::host_state::UPGRADE)
        .is_some_and(|state| *state & proxy_common::HOST_RETIRING_OLDER_LAYOUT != 0)
}

/// Is `key` the tuple of a flow kube-proxy translated before the takeover?
#[inline(always)]
pub fn handed_over(key: &CtKey) -> bool {
    // SAFETY: a map value, read at once.
    HANDOVER_COUNT.get(0).is_some_and(|count| *count != 0) && unsafe { HANDOVER.get(key) }.is_some()
}

/// Datagrams in fragments: the first fragment's rewrite, for the later ones (which carry no
/// ports). LRU: a datagram's fragments arrive within milliseconds.
#[btf_map(name = "KPR_FRAGMENTS", pin_by_name)]
pub static FRAGMENTS: LruHashMap<FragmentKey, CtValue, 8192> = LruHashMap::new();

/// This node's addresses (both families) → `NODE_ADDR_*` bits: local ("from the node"
/// sources) and where NodePorts are served.
#[btf_map(name = "KPR_NODE_ADDRS", pin_by_name)]
pub static NODE_ADDRS: HashMap<Addr, u32, { defaults::MAX_NODE_ADDRS as usize }> = HashMap::new();

/// The `NODE_ADDR_*` bits of `addr` (0: not the node's).
#[inline(always)]
pub fn node_addr_flags(addr: &Addr) -> u32 {
    let key = *addr;
    NODE_ADDRS.get_ptr(&key).map_or(0, |flags| unsafe { *flags })
}

/// Endpoint → the source the node's own masqueraded connections to it are bound to, as
/// MASQUERADE would rewrite it (`inet_select_addr(out, .., RT_SCOPE_UNIVERSE)`): only where
/// routing's own pick differs (a pod behind a link whose only IPv4 address is link-scoped).
#[btf_map(name = "KPR_NODE_SOURCES", pin_by_name)]
pub static NODE_SOURCES: HashMap<Addr, Addr, { defaults::MAX_NODE_SOURCES as usize }> = HashMap::new();

/// The node's masquerade source toward `endpoint`, where routing would pick another.
#[inline(always)]
pub fn node_source(endpoint: &Addr) -> Option<Addr> {
    let key = *endpoint;
    // SAFETY: a map value pointer, read at once.
    NODE_SOURCES.get_ptr(&key).map(|source| unsafe { *source })
}

/// ifindex → what the per-packet path needs of that link (masquerade source, detector flag);
/// ifindex 0: the fallback masquerade source (the node's primary address).
#[btf_map(name = "KPR_LINKS", pin_by_name)]
pub static LINKS: HashMap<u32, LinkInfo, { defaults::MAX_LINKS as usize }> = HashMap::new();

/// One bit per address the per-packet path may have business with
/// (`proxy_common::addr_filter_bit`); set by the agent before it programs what uses them.
#[btf_map(name = "KPR_ADDR_FILTER", pin_by_name)]
pub static ADDR_FILTER: Array<u64, { defaults::ADDR_FILTER_WORDS as usize }> = Array::new();

/// `addr` may be a frontend, a backend or the node's: its bit in the address filter is set.
#[inline(always)]
pub fn in_addr_filter(addr: &Addr) -> bool {
    let bit = proxy_common::addr_filter_bit(addr);
    ADDR_FILTER.get(bit >> 6).is_some_and(|word| *word & (1u64 << (bit & 63)) != 0)
}

/// CIDRs of the local-traffic detector (clusterCIDR, or the Node's podCIDRs).
#[btf_map(name = "KPR_LOCAL_CIDRS", pin_by_name)]
pub static LOCAL_CIDRS: LpmTrie<CidrKey, u8, { defaults::MAX_LOCAL_CIDRS as usize }> = LpmTrie::new();

/// The cluster's service ranges (unallocated addresses in them are dropped when refused).
#[btf_map(name = "KPR_SERVICE_CIDRS", pin_by_name)]
pub static SERVICE_CIDRS: LpmTrie<CidrKey, u8, { defaults::MAX_SERVICE_CIDRS as usize }> = LpmTrie::new();

/// Per family, the prefix covering all its service ranges (`CidrMask`): most packets are for
/// no service and outside it, and the masked compare costs less than the range lookup.
#[btf_map(name = "KPR_SERVICE_RANGE_COVER", pin_by_name)]
pub static SERVICE_RANGE_COVER: Array<CidrMask, 2> = Array::new();

/// 1 (kube-proxy's nftables mode, and kpr's default): traffic to the service range that no
/// service port takes is refused — REJECT for an unknown port of a ClusterIP, DROP for an unallocated address.
#[unsafe(no_mangle)]
pub static KPR_REFUSE_SERVICE_RANGE: aya_ebpf::Global<u8> = aya_ebpf::Global::new(0);

/// What a refused service range means for traffic to `addr` that no service port took.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum ServiceRangeMiss {
    /// Not in the service range (or the range is not refused): not ours.
    NotInRange,
    /// An unknown port of a ClusterIP (it has an any-port entry): REJECT.
    Reject,
    /// An unallocated address of the service range: DROP.
    Drop,
}

#[inline(always)]
pub fn service_range_miss(addr: Addr) -> ServiceRangeMiss {
    if KPR_REFUSE_SERVICE_RANGE.load() == 0
        || SERVICE_RANGE_COVER.get(CidrMask::family_index(&addr)).is_some_and(|cover| !cover.contains(&addr))
        || SERVICE_CIDRS.get(&aya_ebpf::btf_maps::lpm_trie::Key::new(128, CidrKey { addr })).is_none()
    {
        return ServiceRangeMiss::NotInRange;
    }
    // One entry per ClusterIP, for every source.
    let any = ServiceKey { addr, port: 0, proto: proxy_common::PROTO_ANY, scope: proxy_common::SCOPE_POD };
    if SERVICES.get_ptr(&any).is_some() { ServiceRangeMiss::Reject } else { ServiceRangeMiss::Drop }
}

/// The entry kube-proxy's REJECT (`flags` 0) or DROP stands for: no backends.
#[inline(always)]
pub fn refusal(flags: u32) -> ServiceValue {
    ServiceValue { service_id: 0, backends_start: 0, backends_count: 0, flags, affinity_timeout: 0, affinity_id: 0 }
}

/// Endpoints an earlier choice is checked against, at most (larger services: trusted).
const SERVES_SCAN: u32 = 64;

/// `addr:port` is still one of `service`'s endpoints (always true past `SERVES_SCAN`).
#[inline(always)]
pub fn serves(service: &ServiceValue, addr: &Addr, port: u16) -> bool {
    let [a, b, c, d] = addr.0;
    let addr_words = (u64::from(a) << 32 | u64::from(b), u64::from(c) << 32 | u64::from(d));
    kpr_serves(service.backends_start, service.backends_count, u32::from(port), addr_words.0, addr_words.1) != 0
}

/// [`serves`] as a global function of scalars: the verifier checks its scan once per program,
/// not once per path that reaches it (each of the 64 steps of a scan a path of its own).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpr_serves(start: u32, count: u32, port: u32, addr_high: u64, addr_low: u64) -> u32 {
    if count > SERVES_SCAN {
        return 1;
    }
    let addr = Addr([(addr_high >> 32) as u32, addr_high as u32, (addr_low >> 32) as u32, addr_low as u32]);
    for i in 0..SERVES_SCAN {
        if i >= count {
            break;
        }
        if let Some(b) = BACKENDS.get(start.wrapping_add(i))
            && b.addr.same(&addr)
            && u32::from(b.port) == port
        {
            return 1;
        }
    }
    0
}

/// [`local_endpoint_port`]'s answers besides a port.
pub const NOT_AN_ENDPOINT: u32 = 0;
pub const PAST_THE_SCAN: u32 = u32::MAX;

/// The port (network order) of `service`'s endpoint at `addr` if the model puts it on this
/// node (no `BACKEND_FLAG_REMOTE`); `NOT_AN_ENDPOINT`; or `PAST_THE_SCAN` for a frontend of
/// more than `SERVES_SCAN` endpoints, which is not scanned.
#[inline(always)]
pub fn local_endpoint_port(service: &ServiceValue, addr: &Addr) -> u32 {
    let [a, b, c, d] = addr.0;
    kpr_local_endpoint_port(
        service.backends_start,
        service.backends_count,
        u64::from(a) << 32 | u64::from(b),
        u64::from(c) << 32 | u64::from(d),
    )
}

/// [`local_endpoint_port`] as a global function of scalars, as [`kpr_serves`]: the port with
/// bit 16 set (a port of 0 is still an answer).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpr_local_endpoint_port(start: u32, count: u32, addr_high: u64, addr_low: u64) -> u32 {
    if count > SERVES_SCAN {
        return PAST_THE_SCAN;
    }
    let addr = Addr([(addr_high >> 32) as u32, addr_high as u32, (addr_low >> 32) as u32, addr_low as u32]);
    for i in 0..SERVES_SCAN {
        if i >= count {
            break;
        }
        if let Some(b) = BACKENDS.get(start.wrapping_add(i))
            && b.addr.same(&addr)
            && b.flags & proxy_common::BACKEND_FLAG_REMOTE == 0
        {
            return 1 << 16 | u32::from(b.port);
        }
    }
    NOT_AN_ENDPOINT
}

/// The backend in slot `pick` (modulo the count) of `service`'s range; a slot outside the array
/// (should never happen) is counted and gives none.
#[inline(always)]
pub fn backend_at(service: &ServiceValue, pick: u32) -> Option<Backend> {
    // checked_rem: no division-by-zero panic path for the verifier to reject (callers checked
    // the count, but the compiler cannot always see it).
    let slot = service.backends_start.wrapping_add(pick.checked_rem(service.backends_count)?);
    let backend = BACKENDS.get(slot).copied();
    if backend.is_none() {
        count(counter::BAD_BACKEND_SLOT);
    }
    backend
}

/// The slot of a Maglev table of `table_size` slots for `hash`: an index into `service`'s
/// backend range (`None`: the frontend has no table).
#[inline(always)]
pub fn maglev_slot(service: &ServiceValue, hash: u32, table_size: u32) -> Option<u32> {
    let slot = hash.checked_rem(table_size)?;
    let key = MaglevKey { service_id: service.service_id, chunk: slot / MAGLEV_CHUNK_SLOTS };
    let chunk = MAGLEV.get_ptr(&key)?;
    let at = slot % MAGLEV_CHUNK_SLOTS;
    // Read back through memory, so that the bound check stays: the compiler knows that a
    // remainder is below the divisor (and would drop it), the verifier does not.
    // SAFETY: a local's address; the map lookup's pointer is valid for this program run.
    unsafe { (*chunk).slots.get(core::ptr::read_volatile(&at) as usize).map(|&i| u32::from(i)) }
}

/// sessionAffinity ClientIP: (service port, client) → the client's backend and when it last
/// got a connection. LRU: clients that stopped coming age out.
#[btf_map(name = "KPR_AFFINITY", pin_by_name)]
pub static AFFINITY: LruHashMap<AffinityKey, AffinityValue, { defaults::MAX_AFFINITY as usize }> = LruHashMap::new();

/// sessionAffinity ClientIP, as kube-proxy's `recent` match: the backend `client` got its last
/// connection to this service port from (through any of its frontends), if that was within
/// the timeout and the backend serves this entry (an endpoint that left breaks the affinity).
#[inline(always)]
pub fn affinity_backend(service: &ServiceValue, kind: u32, client: Addr, now: u64) -> Option<Backend> {
    if service.affinity_timeout == 0 {
        return None;
    }
    let key = AffinityKey { port_id: service.affinity_id, kind, client };
    // SAFETY: a pointer returned by the map lookup is valid for this program run.
    let last = unsafe { *AFFINITY.get_ptr(&key)? };
    let fresh = now.saturating_sub(last.last_used) <= u64::from(service.affinity_timeout) * 1_000_000_000;
    (fresh && serves(service, &last.backend.addr, last.backend.port)).then_some(last.backend)
}

/// Remember (or refresh) that `client` got a connection to `backend` of this service port.
#[inline(always)]
pub fn remember_affinity(service: &ServiceValue, kind: u32, client: Addr, backend: &Backend, now: u64) {
    if service.affinity_timeout != 0 {
        let key = AffinityKey { port_id: service.affinity_id, kind, client };
        let _ = AFFINITY.insert(&key, &AffinityValue { backend: *backend, _pad: 0, last_used: now }, 0);
    }
}

/// loadBalancerSourceRanges: (service id, client CIDR) → allowed.
#[btf_map(name = "KPR_SOURCE_RANGES", pin_by_name)]
pub static SOURCE_RANGES: LpmTrie<SourceRange, u8, { defaults::MAX_SOURCE_RANGES as usize }> = LpmTrie::new();

/// The address of link `ifindex` in `KPR_LINKS` (0: none). The key is a stack copy: a
/// promoted constant key would live in a `.rodata.cst*` section, which the loader does not
/// relocate correctly (the lookup then never matches).
#[inline(always)]
pub fn link_addr(ifindex: u32) -> u32 {
    link(ifindex).map_or(0, |link| link.addr)
}

/// Link `ifindex`'s entry in `KPR_LINKS` (a stack key, as in [`link_addr`]).
#[inline(always)]
pub fn link(ifindex: u32) -> Option<LinkInfo> {
    let key = ifindex;
    // SAFETY: a map value pointer, valid for this program run.
    LINKS.get_ptr(&key).map(|link| unsafe { *link })
}

/// Link `ifindex`'s `LINK_FLAG_*` (0: no entry), read in place.
#[inline(always)]
pub fn link_flags(ifindex: u32) -> u32 {
    let key = ifindex;
    // SAFETY: a map value pointer, read at once.
    LINKS.get_ptr(&key).map_or(0, |link| unsafe { (*link).flags })
}

/// An atomic add whose result is not used: the instruction every kernel has (`BPF_XADD`).
/// Through the intrinsic: the BPF target has no compare-and-swap, so `core`'s atomic types
/// offer no `fetch_add` there (the crate is built with `RUSTC_BOOTSTRAP` already).
#[inline(always)]
pub fn atomic_add(word: *mut u64, n: u64) {
    use core::intrinsics::{AtomicOrdering, atomic_xadd};
    // SAFETY: the caller's map value, 8-byte aligned, valid for this run.
    let _ = unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(word, n) };
}

#[inline(always)]
pub fn count(index: u32) {
    if let Some(slot) = COUNTERS.get_ptr_mut(index) {
        // Per-CPU slot: no other writer on this CPU while the program runs.
        unsafe { *slot += 1 };
    }
}

/// 1 where the kernel has `bpf_ktime_get_coarse_ns` (5.11+); set by the agent at load time.
/// Elsewhere the call below is dead code the verifier never sees.
#[unsafe(no_mangle)]
pub static KPR_COARSE_CLOCK: aya_ebpf::Global<u8> = aya_ebpf::Global::new(0);

/// CLOCK_MONOTONIC in nanoseconds, as flows and sessionAffinity count time: the coarse clock
/// (the last tick, a few milliseconds behind) where the kernel has it, which costs a fraction of
/// reading the clock source on every packet; timeouts are seconds.
#[inline(always)]
pub fn now() -> u64 {
    if KPR_COARSE_CLOCK.load() != 0 {
        unsafe { aya_ebpf::helpers::bpf_ktime_get_coarse_ns() }
    } else {
        unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() }
    }
}

/// The clock as [`now`] read it at a tick of the kernel's (per CPU, in a scratch area).
#[repr(C)]
pub struct TickClock {
    tick: u64,
    ns: u64,
}

/// [`now`], asked of the kernel once per tick: `bpf_jiffies64`, which the verifier turns into
/// a load, says whether the tick moved since `clock` was read; within a tick the coarse clock
/// does not move, so the reading kept is still right (on 5.10, which has no coarse clock, time
/// moves by ticks here). A helper call saved on every packet of an established flow.
#[inline(always)]
pub fn now_by_tick(clock: *mut TickClock) -> u64 {
    // SAFETY: `clock` points into a per-CPU scratch value, valid for this program run.
    unsafe {
        let tick = aya_ebpf::helpers::bpf_jiffies64();
        if (*clock).tick != tick {
            (*clock).ns = now();
            (*clock).tick = tick;
        }
        (*clock).ns
    }
}

// The flow cache's maps (`flow_cache`).

pub const FLOW_CACHE_SLOTS: usize = defaults::FLOW_CACHE_SLOTS as usize;
const _: () = assert!(FLOW_CACHE_SLOTS.is_power_of_two());

#[btf_map(name = "KPR_FLOW_CACHE4", pin_by_name)]
pub static FLOW_CACHE4: FlowCache<Addr4> = PerCpuArray::new();

#[btf_map(name = "KPR_FLOW_CACHE6", pin_by_name)]
pub static FLOW_CACHE6: FlowCache<Addr> = PerCpuArray::new();

/// A cache's tags, by slot: the low half of the key's hash in the high 32 bits, the copy's
/// `valid_until` in units of 2^20 ns (about a millisecond, rounded down; 52 days before the
/// word wraps) in the low 32. 0: never filled.
pub type SlotTags = [u64; FLOW_CACHE_SLOTS];

#[btf_map(name = "KPR_FLOW_CACHE_TAGS4")]
pub static FLOW_CACHE_TAGS4: PerCpuArray<SlotTags, 1> = PerCpuArray::new();

#[btf_map(name = "KPR_FLOW_CACHE_TAGS6")]
pub static FLOW_CACHE_TAGS6: PerCpuArray<SlotTags, 1> = PerCpuArray::new();

/// See [`proxy_common::ct_generation`]. Pinned: the agent and the CLI change it.
#[btf_map(name = "KPR_CT_GENERATION", pin_by_name)]
pub static CT_GENERATION: Array<u64, { ct_generation::WORDS as usize }> = Array::new();
