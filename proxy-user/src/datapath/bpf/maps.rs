//! The service maps behind [`Maps`](crate::datapath::Maps), read and written in batches where
//! the kernel allows, and the read-only views the CLI takes of them.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    os::fd::AsFd as _,
    path::Path,
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf,
    maps::{
        Array, HashMap, IterableMap as _, LpmTrie, Map, MapData, PerCpuArray, PerCpuHashMap, PerCpuValues,
        lpm_trie::Key as LpmKey,
    },
};
use proxy_common::{
    Addr, Addr4, Backend, BackendKey, CachedFlow, CidrKey, EndpointStats, FlowAddr, IPPROTO_TCP, IPPROTO_UDP,
    MAGLEV_CHUNK_SLOTS, MAGLEV_DEFAULT_TABLE_SIZE, MaglevChunk, MaglevKey, ServiceKey, ServiceStats, ServiceValue,
    SockRevNatKey, SockRevNatValue, SourceRange, counter, ct, defaults, maglev_chunks, map_names, service_stat,
};

use super::{
    batch::{self, batch_unsupported, read_all_of, update_batch},
    pins::open_pinned_map,
};
use crate::datapath::{BatchError, Capacity, FlowFlush, Maps, conntrack::Conntrack};
use crate::model::cidr::Cidr;

/// Set the address filter's bits of `addrs`, a word at a time: read, OR, write what changed. Bits are never cleared
/// (see `proxy_common::addr_filter_bit`).
pub(super) fn mark_addresses(filter: &mut Array<MapData, u64>, addrs: impl IntoIterator<Item = Addr>) -> Result<()> {
    let mut words: BTreeMap<u32, u64> = BTreeMap::new();
    for addr in addrs.into_iter().filter(|a| !a.is_unspecified()) {
        let bit = proxy_common::addr_filter_bit(&addr);
        *words.entry(bit >> 6).or_default() |= 1 << (bit & 63);
    }
    for (index, bits) in words {
        let word = filter.get(&index, 0).with_context(|| format!("failed to read address filter word {index}"))?;
        if word | bits != word {
            filter
                .set(index, &(word | bits), 0)
                .with_context(|| format!("failed to write address filter word {index}"))?;
        }
    }
    Ok(())
}

/// The service and backend maps of a loaded datapath, or opened from their pins.
pub struct BpfMaps {
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    /// Frontends and backends get their bits before the entries that use them are written.
    addr_filter: Array<MapData, u64>,
    backends: Array<MapData, Backend>,
    source_ranges: LpmTrie<MapData, SourceRange, u8>,
    conntrack: Conntrack,
    /// The socket path's translations (socket cookie + backend → service), to find the
    /// connected UDP sockets of an endpoint that left.
    sock_revnat: HashMap<MapData, SockRevNatKey, SockRevNatValue>,
    /// The endpoint each unconnected UDP socket keeps for a frontend (socket cookie + frontend).
    sock_picks: HashMap<MapData, SockRevNatKey, Backend>,
    /// Each service port's counters: removed with the port, so that its id starts from zero
    /// when it is given again.
    service_stats: PerCpuHashMap<MapData, u32, ServiceStats>,
    /// Each counted endpoint's counters (`--endpoint-counters`).
    endpoint_stats: PerCpuHashMap<MapData, BackendKey, EndpointStats>,
    /// How many endpoints may be counted one by one; 0: none (the agent sets it).
    pub endpoint_counters: u32,
    /// Maglev tables in chunks, by service id (`None`: pins of a build without them).
    maglev: Option<HashMap<MapData, MaglevKey, MaglevChunk>>,
    /// The programs' `KPR_MAGLEV_SEED` and `KPR_MAGLEV_TABLE_SIZE` (the agent sets them).
    pub maglev_seed: u32,
    pub maglev_table_size: u32,
    capacity: Capacity,
}

impl BpfMaps {
    /// The service and backend maps of a loaded object (see [`open_object`]).
    pub fn take_from(ebpf: &mut Ebpf) -> Result<Self> {
        Self::from_maps(|name| ebpf.take_map(name).with_context(|| format!("no map {name} in the object")))
    }

    /// Open the pinned maps of a running (or stopped) agent, e.g. for `kpr services`.
    pub fn open_pinned(pin_root: &Path) -> Result<Self> {
        Self::from_maps(|name| Ok(Map::from_map_data(open_pinned_map(pin_root, name)?)?))
    }

    /// The maps, each taken by its name from `take` (a loaded object's, or the pins).
    fn from_maps(mut take: impl FnMut(&str) -> Result<Map>) -> Result<Self> {
        let services = take(map_names::SERVICES)?;
        // The sizes of the maps as they are: pinned ones an earlier agent made keep theirs.
        let service_ports = match &services {
            Map::HashMap(data) => data.info()?.max_entries(),
            _ => bail!("the services map is not a hash map"),
        };
        let backends: Array<MapData, Backend> = Array::try_from(take(map_names::BACKENDS)?)?;
        Ok(Self {
            services: HashMap::try_from(services)?,
            addr_filter: Array::try_from(take(map_names::ADDR_FILTER)?)?,
            capacity: Capacity { service_ports, backends: backends.len() },
            backends,
            source_ranges: LpmTrie::try_from(take(map_names::SOURCE_RANGES)?)?,
            conntrack: Conntrack::new(&mut take)?,
            sock_revnat: HashMap::try_from(take(map_names::SOCK_REVNAT)?)?,
            sock_picks: HashMap::try_from(take(map_names::SOCK_PICKS)?)?,
            service_stats: PerCpuHashMap::try_from(take(map_names::SERVICE_STATS)?)?,
            endpoint_stats: PerCpuHashMap::try_from(take(map_names::ENDPOINT_STATS)?)?,
            endpoint_counters: 0,
            maglev: take(map_names::MAGLEV).ok().map(HashMap::try_from).transpose()?,
            maglev_seed: 0,
            maglev_table_size: MAGLEV_DEFAULT_TABLE_SIZE,
        })
    }

    /// Give addresses (IPv4, network byte order) their bits in the address filter: what a
    /// caller writes into the node maps itself (the agent's host side does its own).
    pub fn mark_addresses(&mut self, addrs: impl IntoIterator<Item = Addr>) -> Result<()> {
        mark_addresses(&mut self.addr_filter, addrs)
    }
}

impl Maps for BpfMaps {
    fn capacity(&self) -> Capacity {
        self.capacity
    }

    fn maglev_seed(&self) -> u32 {
        self.maglev_seed
    }

    fn maglev_table_size(&self) -> u32 {
        self.maglev_table_size
    }

    fn set_maglev(&mut self, service_id: u32, table: &[u32]) -> Result<()> {
        let map = self.maglev.as_mut().context("no Maglev map (pins of an older build)")?;
        anyhow::ensure!(
            table.len() == self.maglev_table_size as usize,
            "a Maglev table of {} slots, not {}",
            table.len(),
            self.maglev_table_size
        );
        for (chunk, slots) in (0..).zip(table.chunks(MAGLEV_CHUNK_SLOTS as usize)) {
            let mut value = MaglevChunk { slots: [0; MAGLEV_CHUNK_SLOTS as usize] };
            for (slot, index) in value.slots.iter_mut().zip(slots) {
                *slot = u16::try_from(*index).context("a Maglev table names an endpoint past 65,535")?;
            }
            map.insert(&MaglevKey { service_id, chunk }, &value, 0)
                .with_context(|| format!("failed to write chunk {chunk} of the Maglev table of {service_id}"))?;
        }
        Ok(())
    }

    fn remove_maglev(&mut self, service_id: u32) -> Result<()> {
        let Some(map) = self.maglev.as_mut() else { return Ok(()) };
        for chunk in 0..maglev_chunks(self.maglev_table_size) {
            match map.remove(&MaglevKey { service_id, chunk }) {
                Err(aya::maps::MapError::KeyNotFound) | Ok(()) => {}
                Err(e) => {
                    return Err(
                        anyhow::Error::new(e).context(format!("failed to remove the Maglev table of {service_id}"))
                    );
                }
            }
        }
        Ok(())
    }

    fn maglev_tables(&self) -> Result<BTreeMap<u32, u32>> {
        let mut tables = BTreeMap::new();
        for key in self.maglev.iter().flat_map(|map| map.keys()) {
            *tables.entry(key?.service_id).or_default() += 1;
        }
        Ok(tables)
    }

    fn source_range_capacity(&self) -> u32 {
        self.source_ranges.map().info().map_or(defaults::MAX_SOURCE_RANGES, |i| i.max_entries())
    }

    fn services(&self) -> Result<Vec<(ServiceKey, ServiceValue)>> {
        if let Some(all) = batch::lookup_batch(self.services.map()) {
            return Ok(all);
        }
        Ok(self.services.iter().collect::<Result<Vec<_>, _>>()?)
    }

    fn backends(&self, start: u32, count: u32) -> Result<Vec<Backend>> {
        if let Some(slots) = batch::lookup_array_range(self.backends.map(), start, count) {
            return Ok(slots);
        }
        (start..start.saturating_add(count))
            .map(|i| self.backends.get(&i, 0).with_context(|| format!("failed to read backend slot {i}")))
            .collect()
    }

    fn set_backends(&mut self, writes: &[(u32, Backend)]) -> Result<()> {
        mark_addresses(&mut self.addr_filter, writes.iter().map(|(_, b)| b.addr))?;
        let (slots, values): (Vec<u32>, Vec<Backend>) = writes.iter().copied().unzip();
        let fd = self.backends.map().fd().as_fd();
        match update_batch(fd, &slots, &values) {
            Ok(()) => Ok(()),
            Err((e, _)) if batch_unsupported(&e) => {
                for (slot, b) in writes {
                    self.backends.set(*slot, b, 0).with_context(|| format!("failed to write backend slot {slot}"))?;
                }
                Ok(())
            }
            Err((e, done)) => {
                Err(anyhow::Error::new(e).context(format!("batch write stopped after {done} backend slots")))
            }
        }
    }

    fn set_services(&mut self, entries: &[(ServiceKey, ServiceValue)]) -> Result<(), BatchError> {
        mark_addresses(&mut self.addr_filter, entries.iter().map(|(k, _)| k.addr))
            .map_err(|error| BatchError { done: 0, error })?;
        let (keys, values): (Vec<ServiceKey>, Vec<ServiceValue>) = entries.iter().copied().unzip();
        let fd = self.services.map().fd().as_fd();
        match update_batch(fd, &keys, &values) {
            Ok(()) => Ok(()),
            Err((e, _)) if batch_unsupported(&e) => {
                for (done, (key, value)) in entries.iter().enumerate() {
                    self.services.insert(key, value, 0).map_err(|e| BatchError { done, error: e.into() })?;
                }
                Ok(())
            }
            Err((e, done)) => Err(BatchError { done, error: e.into() }),
        }
    }

    fn source_ranges(&self) -> Result<Vec<(u32, Cidr)>> {
        self.source_ranges
            .keys()
            .map(|k| {
                let k = k?;
                let data = k.data();
                let cidr = cidr_of(data.addr, k.prefix_len() - 32).context("a malformed source range entry")?;
                Ok((u32::from_be(data.service_id), cidr))
            })
            .collect()
    }

    fn add_source_ranges(&mut self, service_id: u32, ranges: &[Cidr]) -> Result<()> {
        for cidr in ranges {
            self.source_ranges.insert(&range_key(service_id, cidr), &1, 0)?;
        }
        Ok(())
    }

    fn remove_source_ranges(&mut self, service_id: u32, ranges: &[Cidr]) -> Result<()> {
        for cidr in ranges {
            match self.source_ranges.remove(&range_key(service_id, cidr)) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn flush_flows(&mut self, flushes: &[FlowFlush]) -> Result<usize> {
        let by_service: std::collections::HashMap<u32, &FlowFlush> =
            flushes.iter().map(|f| (f.service_id, f)).collect();
        let goes_to = |service_id: u32, addr: Addr, port: u16| {
            by_service.get(&service_id).is_some_and(|f| f.gone.contains(&(addr, port)))
        };
        // The socket path's flows: sockets it connected to these backends through these
        // services, by protocol (one read of the table for both).
        let mut cookies: BTreeMap<u8, BTreeSet<u64>> = BTreeMap::new();
        for (k, v) in read_all_of(&self.sock_revnat) {
            if let Some(f) = by_service.get(&v.service_id).filter(|f| f.gone.contains(&(k.addr, k.port))) {
                cookies.entry(f.proto).or_default().insert(k.cookie);
            }
        }
        let mut ended = 0;
        for proto in [IPPROTO_UDP, IPPROTO_TCP] {
            let of_proto: Vec<&FlowFlush> = flushes.iter().filter(|f| f.proto == proto).collect();
            if of_proto.is_empty() {
                continue;
            }
            let gone: Vec<Addr> = of_proto.iter().flat_map(|f| f.gone.iter().map(|(addr, _)| *addr)).collect();
            let families = [gone.iter().any(Addr::is_v4), gone.iter().any(|a| !a.is_v4())];
            ended += if proto == IPPROTO_UDP {
                // A flow's forward entry holds the endpoint it was translated to, its reply
                // entry is keyed by it.
                let (_, flushed) = self.conntrack.remove_where_in(families, |k, v| {
                    k.proto == proto
                        && (goes_to(v.service_id, v.dst_addr, v.dst_port)
                            || goes_to(v.service_id, k.src_addr, k.src_port))
                })?;
                flushed
            } else {
                // The client's entry is marked: its next segment is answered with a RST.
                self.conntrack.mark_where_in(families, ct::ENDPOINT_DEAD, |k, v| {
                    k.proto == proto && v.flags & ct::REPLY == 0 && goes_to(v.service_id, v.dst_addr, v.dst_port)
                })?
            };
            if let Some(cookies) = cookies.get(&proto) {
                ended += crate::datapath::sockets::abort(proto, cookies, &gone);
            }
        }
        // Unconnected sockets keep the endpoint they picked for a frontend (`KPR_SOCK_PICKS`):
        // forgotten, so that their next datagram picks again (the programs can tell a gone
        // endpoint themselves only in a service of at most 64).
        let through = |k: &SockRevNatKey, f: &FlowFlush| {
            f.frontends
                .iter()
                .any(|(addr, port)| *port == k.port && (*addr == k.addr || *addr == addr.unspecified_like()))
        };
        let udp: Vec<&FlowFlush> = flushes.iter().filter(|f| f.proto == IPPROTO_UDP).collect();
        if udp.is_empty() {
            return Ok(ended);
        }
        let picks: Vec<SockRevNatKey> = read_all_of(&self.sock_picks)
            .into_iter()
            .filter(|(k, b)| udp.iter().any(|f| f.gone.contains(&(b.addr, b.port)) && through(k, f)))
            .map(|(k, _)| k)
            .collect();
        let forgotten = picks.iter().filter(|k| self.sock_picks.remove(k).is_ok()).count();
        Ok(ended + forgotten)
    }

    fn start_service_stats(&mut self, ids: &[u32]) -> Result<()> {
        const BPF_NOEXIST: u64 = 1;
        let cpus = aya::util::nr_cpus().map_or(1, |n| n.get() as usize);
        for id in ids {
            let zero = PerCpuValues::try_from(vec![ServiceStats::default(); cpus])?;
            match self.service_stats.insert(id, zero, BPF_NOEXIST) {
                Ok(()) => {}
                Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => return Err(e).with_context(|| format!("service id {id}")),
            }
        }
        Ok(())
    }

    fn endpoint_counters(&self) -> u32 {
        self.endpoint_counters
    }

    fn keep_endpoint_stats(&mut self, endpoints: &BTreeSet<BackendKey>) -> Result<usize> {
        let have: BTreeSet<BackendKey> = self.endpoint_stats.keys().collect::<Result<_, _>>()?;
        for gone in have.difference(endpoints) {
            let _ = self.endpoint_stats.remove(gone);
        }
        let mut counted = have.intersection(endpoints).count();
        let cpus = aya::util::nr_cpus().map_or(1, |n| n.get() as usize);
        let mut uncounted = 0;
        for endpoint in endpoints.difference(&have) {
            if counted >= self.endpoint_counters as usize {
                uncounted += 1;
                continue;
            }
            let zero = PerCpuValues::try_from(vec![EndpointStats::default(); cpus])?;
            match self.endpoint_stats.insert(endpoint, zero, 0) {
                Ok(()) => counted += 1,
                // Full (the map's size is the cap): uncounted.
                Err(_) => uncounted += 1,
            }
        }
        Ok(uncounted)
    }

    fn keep_service_stats(&mut self, ids: &BTreeSet<u32>) -> Result<()> {
        let have: BTreeSet<u32> = self.service_stats.keys().collect::<Result<_, _>>()?;
        for gone in have.difference(ids) {
            let _ = self.service_stats.remove(gone);
        }
        let missing: Vec<u32> = ids.difference(&have).copied().collect();
        self.start_service_stats(&missing)
    }

    fn remove_service(&mut self, key: &ServiceKey) -> Result<()> {
        if let Ok(value) = self.services.get(key, 0) {
            // None made yet is no error.
            let _ = self.service_stats.remove(&value.service_id);
        }
        match self.services.remove(key) {
            Ok(()) => Ok(()),
            Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

pub(super) fn range_key(service_id: u32, cidr: &Cidr) -> LpmKey<SourceRange> {
    let (addr, len) = lpm_prefix(cidr);
    LpmKey::new(32 + len, SourceRange { service_id: service_id.to_be(), addr })
}

/// A CIDR as the LPM maps hold it (`Cidr` keeps its base masked, so equal ranges make equal
/// keys): an IPv4 prefix mapped, `Addr::V4_PREFIX_OFFSET` bits longer.
pub(super) fn lpm_prefix(cidr: &Cidr) -> (Addr, u32) {
    let offset = if cidr.addr.is_ipv4() { Addr::V4_PREFIX_OFFSET } else { 0 };
    (cidr.addr.into(), offset + u32::from(cidr.len))
}

/// The CIDR of an LPM entry (see [`lpm_prefix`]).
pub(super) fn cidr_of(addr: Addr, len: u32) -> Option<Cidr> {
    let offset = if addr.is_v4() { Addr::V4_PREFIX_OFFSET } else { 0 };
    Cidr::new(addr.into(), u8::try_from(len.checked_sub(offset)?).ok()?)
}

/// The node facts the programs look packets up in, read from the pins (`kpr trace`).
#[derive(Clone, Debug, Default)]
pub struct NodeView {
    /// This node's addresses → `NODE_ADDR_*` bits.
    pub node_addrs: BTreeMap<IpAddr, u32>,
    /// The local-traffic detector's CIDRs.
    pub local_cidrs: Vec<Cidr>,
    /// The cluster's service ranges.
    pub service_cidrs: Vec<Cidr>,
}

pub fn read_node_view(pin_root: &Path) -> Result<NodeView> {
    let open = |name: &str| open_pinned_map(pin_root, name);
    let addrs: HashMap<MapData, Addr, u32> = HashMap::try_from(Map::HashMap(open(map_names::NODE_ADDRS)?))?;
    let cidrs = |name: &str| -> Result<Vec<Cidr>> {
        let trie: LpmTrie<MapData, CidrKey, u8> = LpmTrie::try_from(Map::LpmTrie(open(name)?))?;
        trie.keys()
            .map(|k| {
                let k = k?;
                cidr_of(k.data().addr, k.prefix_len()).context("a malformed CIDR entry")
            })
            .collect()
    };
    Ok(NodeView {
        node_addrs: addrs.iter().filter_map(Result::ok).map(|(a, f)| (IpAddr::from(a), f)).collect(),
        local_cidrs: cidrs(map_names::LOCAL_CIDRS)?,
        service_cidrs: cidrs(map_names::SERVICE_CIDRS)?,
    })
}

/// The datapath's per-CPU counters, summed, by name.
pub fn read_counters(pin_root: &Path) -> Result<Vec<(&'static str, u64)>> {
    let map = open_pinned_map(pin_root, map_names::COUNTERS)?;
    let counters: PerCpuArray<MapData, u64> = PerCpuArray::try_from(Map::PerCpuArray(map))?;
    (0..counter::COUNT).map(|i| Ok((counter::NAMES[i as usize], counters.get(&i, 0)?.iter().sum()))).collect()
}

/// Each frontend's counters (by service id), summed over the CPUs, with the packets and bytes
/// the flow caches' slots have counted and not yet added (`flow_cache` in the programs). A slot
/// folded between the map's read and the caches' is missed by this read (and seen by the
/// next): callers keep what they report from going down.
pub fn read_service_stats(pin_root: &Path) -> Result<BTreeMap<u32, ServiceStats>> {
    let map = open_pinned_map(pin_root, map_names::SERVICE_STATS)?;
    let stats: PerCpuHashMap<MapData, u32, ServiceStats> = PerCpuHashMap::try_from(Map::PerCpuHashMap(map))?;
    let mut out: BTreeMap<u32, ServiceStats> = BTreeMap::new();
    for item in stats.iter() {
        let (id, per_cpu) = item?;
        let sum = out.entry(id).or_default();
        per_cpu.iter().for_each(|cpu| sum.add(cpu));
    }
    add_cached::<Addr4>(pin_root, map_names::FLOW_CACHE4, &mut out)?;
    add_cached::<Addr>(pin_root, map_names::FLOW_CACHE6, &mut out)?;
    Ok(out)
}

/// Each counted endpoint's counters (`--endpoint-counters`), summed over the CPUs, with what
/// the flow caches' slots have counted and not yet added; as [`read_service_stats`], a read may
/// miss a slot folded meanwhile.
pub fn read_endpoint_stats(pin_root: &Path) -> Result<BTreeMap<BackendKey, EndpointStats>> {
    let map = open_pinned_map(pin_root, map_names::ENDPOINT_STATS)?;
    let stats: PerCpuHashMap<MapData, BackendKey, EndpointStats> = PerCpuHashMap::try_from(Map::PerCpuHashMap(map))?;
    let mut out: BTreeMap<BackendKey, EndpointStats> = BTreeMap::new();
    for item in stats.iter() {
        let (endpoint, per_cpu) = item?;
        let sum = out.entry(endpoint).or_default();
        per_cpu.iter().for_each(|cpu| sum.add(cpu));
    }
    if out.is_empty() {
        return Ok(out);
    }
    add_cached_endpoints::<Addr4>(pin_root, map_names::FLOW_CACHE4, &mut out)?;
    add_cached_endpoints::<Addr>(pin_root, map_names::FLOW_CACHE6, &mut out)?;
    Ok(out)
}

/// Add what one family's flow-cache slots counted to the endpoints in `out`: a flow's endpoint
/// is where a client entry's packets go, where a reply entry's come from (its key's source),
/// as the programs take it.
fn add_cached_endpoints<A: FlowAddr + 'static>(
    pin_root: &Path,
    name: &str,
    out: &mut BTreeMap<BackendKey, EndpointStats>,
) -> Result<()>
where
    CachedFlow<A>: aya::Pod,
{
    for_each_cached::<A>(pin_root, name, |cached| {
        let (addr, port) = if cached.entry.flags & ct::REPLY != 0 {
            (cached.key.src_addr.addr(), cached.key.src_port)
        } else {
            (cached.entry.dst_addr, cached.entry.dst_port)
        };
        if let Some(stats) = out.get_mut(&BackendKey { addr, port, proto: cached.key.proto, _pad: 0 }) {
            stats.words[service_stat::PACKETS as usize] += cached.packets;
            stats.words[service_stat::BYTES as usize] += cached.bytes;
        }
    })
}

/// Each slot of one family's flow caches that has counted packets.
fn for_each_cached<A: 'static>(pin_root: &Path, name: &str, mut f: impl FnMut(&CachedFlow<A>)) -> Result<()>
where
    CachedFlow<A>: aya::Pod,
{
    let cache: PerCpuArray<MapData, CachedFlow<A>> =
        PerCpuArray::try_from(Map::PerCpuArray(open_pinned_map(pin_root, name)?))?;
    for slot in 0..cache.len() {
        cache.get(&slot, 0)?.iter().filter(|c| c.packets != 0).for_each(&mut f);
    }
    Ok(())
}

/// Add what one family's flow-cache slots counted to the ports in `out` (a slot of a port
/// without an entry is of one that was removed).
fn add_cached<A: 'static>(pin_root: &Path, name: &str, out: &mut BTreeMap<u32, ServiceStats>) -> Result<()>
where
    CachedFlow<A>: aya::Pod,
{
    for_each_cached::<A>(pin_root, name, |cached| {
        if let Some(stats) = out.get_mut(&cached.entry.service_id) {
            stats.words[service_stat::PACKETS as usize] += cached.packets;
            stats.words[service_stat::BYTES as usize] += cached.bytes;
        }
    })
}
