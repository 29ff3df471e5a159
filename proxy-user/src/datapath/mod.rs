//! The datapath: the only code that touches BPF.
//!
//! - [`Maps`] is the narrow interface to the service and backend maps; [`bpf::BpfMaps`] is the
//!   kernel one, [`fake::FakeMaps`] an in-memory one for tests without root.
//! - [`Programmer`] turns the desired state into ordered map writes, from whatever the maps
//!   hold now (after a restart, the pinned maps): only changed service ports are written, and
//!   a service port is never visible half-written (see [`Programmer::apply`]).
pub mod backend_answers;
pub mod bpf;
pub mod conntrack;
mod devconf;
pub mod fake;
pub mod kernel_btf;
pub mod netfilter_sysctls;
mod slots;
pub mod socket_probe;
mod sockets;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use anyhow::{Result, bail};
use proxy_common::{Addr, Backend, BackendKey, IPPROTO_UDP, SERVICE_FLAG_MAGLEV, ServiceKey, ServiceValue};

use crate::model::{
    cidr::Cidr,
    desired::{Desired, DesiredPort},
    display_key,
};
use slots::SlotAllocator;

/// How many entries the maps can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub service_ports: u32,
    pub backends: u32,
}

/// The service and backend maps, as the programmer sees them. Writes come in batches (one
/// syscall each on the kernel side), in the order given.
pub trait Maps: Send {
    fn capacity(&self) -> Capacity;
    /// Entries the loadBalancerSourceRanges map holds at most.
    fn source_range_capacity(&self) -> u32 {
        u32::MAX
    }
    /// Every entry of the services map.
    fn services(&self) -> Result<Vec<(ServiceKey, ServiceValue)>>;
    /// `count` backend slots starting at `start`.
    fn backends(&self, start: u32, count: u32) -> Result<Vec<Backend>>;
    /// Write backend slots; all or an error.
    fn set_backends(&mut self, writes: &[(u32, Backend)]) -> Result<()>;
    /// Write service entries in order; on error, how many of the first ones were written.
    fn set_services(&mut self, entries: &[(ServiceKey, ServiceValue)]) -> Result<(), BatchError>;
    fn remove_service(&mut self, key: &ServiceKey) -> Result<()>;
    /// The seed Maglev tables are built with (`--maglev-seed`; the programs hash tuples with it).
    fn maglev_seed(&self) -> u32;
    /// Slots of every Maglev table (`--maglev-table-size`; the programs take the slot of a
    /// hash modulo it).
    fn maglev_table_size(&self) -> u32;
    /// Write the Maglev table of a frontend with `SERVICE_FLAG_MAGLEV`: each slot's index into
    /// its backends.
    fn set_maglev(&mut self, service_id: u32, table: &[u32]) -> Result<()>;
    /// Remove a frontend's Maglev table (none: nothing to do).
    fn remove_maglev(&mut self, service_id: u32) -> Result<()>;
    /// The Maglev tables in the maps: service id → chunks written (`maglev_chunks` of the
    /// table size: whole).
    fn maglev_tables(&self) -> Result<BTreeMap<u32, u32>>;
    /// Every loadBalancerSourceRanges entry: (service id, CIDR base, prefix length).
    fn source_ranges(&self) -> Result<Vec<(u32, Cidr)>>;
    fn add_source_ranges(&mut self, service_id: u32, ranges: &[Cidr]) -> Result<()>;
    fn remove_source_ranges(&mut self, service_id: u32, ranges: &[Cidr]) -> Result<()>;
    /// Make zeroed counters for new frontends (by service id); ones that exist are kept.
    fn start_service_stats(&mut self, _ids: &[u32]) -> Result<()> {
        Ok(())
    }
    /// Counters for exactly these frontends: missing ones made, others removed.
    fn keep_service_stats(&mut self, _ids: &BTreeSet<u32>) -> Result<()> {
        Ok(())
    }
    /// Endpoints counted one by one at most (`--endpoint-counters`); 0: none.
    fn endpoint_counters(&self) -> u32 {
        0
    }
    /// Counters for these endpoints, as many as [`Self::endpoint_counters`] allows (those that
    /// have one keep it, then the first others in order), none for any other; how many of
    /// `endpoints` are left uncounted.
    fn keep_endpoint_stats(&mut self, _endpoints: &BTreeSet<BackendKey>) -> Result<usize> {
        Ok(0)
    }
    /// End the flows of each flush's service that go to any of its `gone` endpoints (address
    /// and port, as kube-proxy matches the reply's source), in one walk of each table. UDP:
    /// per-packet conntrack entries (both directions) forgotten, the sockets the socket path
    /// connected to them aborted, and the endpoints unconnected sockets keep for the service's
    /// frontends forgotten (their next datagram picks again). TCP: per-packet flows marked so
    /// that the client's next segment is answered with a RST, sockets aborted. Returns how
    /// many flows were ended.
    fn flush_flows(&mut self, flushes: &[FlowFlush]) -> Result<usize>;
}

/// The flows of one service port to end: to `gone` endpoints, through any of `frontends`
/// (address and port as the maps have them, the port in network byte order; an unspecified
/// frontend address is a NodePort's). `proto`: the service port's (UDP, or TCP with
/// `--abort-dead-tcp`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlowFlush {
    pub service_id: u32,
    pub proto: u8,
    pub frontends: BTreeSet<(Addr, u16)>,
    pub gone: BTreeSet<(Addr, u16)>,
}

/// Are this port's flows ended when their endpoint may no longer have them? UDP's always
/// (kube-proxy's conntrack cleanup), TCP's with `--abort-dead-tcp`.
fn ends_flows(key: &ServiceKey, want: &DesiredPort) -> bool {
    key.proto == IPPROTO_UDP || want.alive.is_some()
}

/// A backend as [`FlowFlush::gone`] names it.
fn endpoint_of(b: &Backend) -> (Addr, u16) {
    (b.addr, b.port)
}

/// A batch that stopped part-way: the first `done` elements were written.
#[derive(Debug)]
pub struct BatchError {
    pub done: usize,
    pub error: anyhow::Error,
}

/// A service port as it is in the maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Programmed {
    pub value: ServiceValue,
    pub backends: Vec<Backend>,
    /// loadBalancerSourceRanges, sorted.
    pub source_ranges: Vec<Cidr>,
}

impl Programmed {
    /// The maps hold what `want` asks for.
    pub fn matches(&self, want: &DesiredPort) -> bool {
        let backends = want_backends(want);
        self.backends.iter().copied().eq(backends)
            && self.value.flags == want.flags
            && self.value.affinity_timeout == want.affinity_timeout
            && self.value.affinity_id == affinity_id(&want.name)
            && self.source_ranges == want.source_ranges
    }
}

/// Every service port in the maps, read without writing anything (`kpr diff`, `kpr trace`).
pub fn read_programmed(maps: &dyn Maps) -> Result<BTreeMap<ServiceKey, Programmed>> {
    let mut ranges: BTreeMap<u32, Vec<Cidr>> = BTreeMap::new();
    for (id, cidr) in maps.source_ranges()? {
        ranges.entry(id).or_default().push(cidr);
    }
    let mut out = BTreeMap::new();
    for (key, value) in maps.services()? {
        let backends = maps.backends(value.backends_start, value.backends_count)?;
        let mut source_ranges = ranges.get(&value.service_id).cloned().unwrap_or_default();
        source_ranges.sort();
        out.insert(key, Programmed { value, backends, source_ranges });
    }
    Ok(out)
}

/// How the maps differ from the desired state for one service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drift {
    /// Desired, not in the maps.
    Missing,
    /// In the maps, not desired.
    Unexpected,
    /// In both, with other backends, flags or source ranges.
    Differs,
}

/// Every service port where the maps and the desired state disagree, in key order.
pub fn drift(desired: &Desired, programmed: &BTreeMap<ServiceKey, Programmed>) -> Vec<(ServiceKey, Drift)> {
    let keys: BTreeSet<&ServiceKey> = desired.keys().chain(programmed.keys()).collect();
    keys.into_iter()
        .filter_map(|key| match (desired.get(key), programmed.get(key)) {
            (Some(_), None) => Some((*key, Drift::Missing)),
            (None, Some(_)) => Some((*key, Drift::Unexpected)),
            (Some(want), Some(have)) if !have.matches(want) => Some((*key, Drift::Differs)),
            _ => None,
        })
        .collect()
}

/// What one [`Programmer::apply`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyReport {
    pub added: usize,
    pub updated: usize,
    pub removed: usize,
    /// Of the updated, frontends that now serve another Service port (its name changed).
    pub renamed: usize,
    /// Service ports that could not be written (map full, write error); left as they were.
    pub failed: usize,
}

impl ApplyReport {
    pub fn changes(&self) -> usize {
        self.added + self.updated + self.removed
    }
}

pub fn backend(ip: impl Into<IpAddr>, port: u16) -> Backend {
    Backend { addr: ip.into().into(), port: port.to_be(), flags: 0 }
}

/// A port's backends as the maps hold them: an endpoint on another node flagged for direct
/// server return.
fn want_backends(want: &DesiredPort) -> impl Iterator<Item = Backend> + '_ {
    want.backends.iter().map(|(ip, port)| {
        let flags = if want.remote.binary_search(ip).is_ok() { proxy_common::BACKEND_FLAG_REMOTE } else { 0 };
        Backend { flags, ..backend(*ip, *port) }
    })
}

pub fn backend_addr(b: &Backend) -> (IpAddr, u16) {
    (b.addr.into(), u16::from_be(b.port))
}

/// Keeps the maps equal to the desired state, knowing what it wrote.
pub struct Programmer {
    programmed: BTreeMap<ServiceKey, Programmed>,
    slots: SlotAllocator,
    used_ids: BTreeSet<u32>,
    next_id: u32,
    capacity: Capacity,
    /// Service ports whose last write failed (logged once, not on every retry).
    failing: BTreeSet<ServiceKey>,
    /// UDP service ports, and TCP ones with `--abort-dead-tcp`: the endpoint addresses their
    /// flows may still go to (every backend and serving or live endpoint since the flows were
    /// last ended).
    reach: BTreeMap<ServiceKey, BTreeSet<(Addr, u16)>>,
    /// Flushes queued in this `apply`, by service id (done once, at its end).
    flushes: BTreeMap<u32, FlowFlush>,
    /// Entries the loadBalancerSourceRanges map holds at most.
    source_range_capacity: u32,
    /// With `--endpoint-counters`: the endpoints left uncounted (past the cap) at the last
    /// sync that changed them; `None`: not counted yet.
    endpoints_uncounted: Option<usize>,
    /// The endpoints the counters were last brought in line with.
    counted_for: BTreeSet<BackendKey>,
    /// Backend slots and loadBalancerSourceRanges entries the programmed entries hold (kept
    /// as they change: a sync's metrics do not walk every entry).
    slots_in_use: usize,
    ranges_in_use: usize,
}

impl Programmer {
    /// Start from what the maps hold (empty on a first start, the pinned state after a
    /// restart). Entries that cannot be valid (a range outside the array, overlapping another)
    /// are removed: no connection could be balanced correctly through them.
    pub fn recover(maps: &mut dyn Maps) -> Result<Self> {
        let capacity = maps.capacity();
        let mut slots = SlotAllocator::new(capacity.backends);
        let mut programmed = BTreeMap::new();
        let mut used_ids = BTreeSet::new();
        let mut ranges: BTreeMap<u32, Vec<Cidr>> = BTreeMap::new();
        for (id, cidr) in maps.source_ranges()? {
            ranges.entry(id).or_default().push(cidr);
        }
        for (key, value) in maps.services()? {
            let in_use = value.backends_count == 0
                || (value.backends_start.checked_add(value.backends_count).is_some_and(|end| end <= capacity.backends)
                    && slots.claim(value.backends_start, value.backends_count));
            if !in_use || value.service_id == 0 || !used_ids.insert(value.service_id) {
                tracing::warn!(service = %display_key(&key), ?value, "removing an invalid entry found in the maps");
                if in_use && value.backends_count > 0 {
                    slots.free(value.backends_start, value.backends_count);
                }
                maps.remove_service(&key)?;
                continue;
            }
            let backends = maps.backends(value.backends_start, value.backends_count)?;
            let mut source_ranges = ranges.remove(&value.service_id).unwrap_or_default();
            source_ranges.sort();
            programmed.insert(key, Programmed { value, backends, source_ranges });
        }
        for (id, stale) in ranges {
            maps.remove_source_ranges(id, &stale)?;
        }
        keep_maglev_tables(maps, &programmed);
        // Counters for exactly the frontends there are (an older layout had none; a frontend
        // removed while no agent ran left its own).
        if let Err(e) = maps.keep_service_stats(&used_ids) {
            tracing::warn!("failed to bring the frontends' counters in line: {e:#}");
        }
        let next_id = used_ids.last().map_or(1, |id| id.wrapping_add(1).max(1));
        let slots_in_use = programmed.values().map(|p: &Programmed| p.backends.len()).sum();
        let ranges_in_use = programmed.values().map(|p| p.source_ranges.len()).sum();
        Ok(Self {
            programmed,
            slots_in_use,
            ranges_in_use,
            slots,
            used_ids,
            next_id,
            capacity,
            failing: BTreeSet::new(),
            reach: BTreeMap::new(),
            flushes: BTreeMap::new(),
            source_range_capacity: maps.source_range_capacity(),
            endpoints_uncounted: None,
            counted_for: BTreeSet::new(),
        })
    }

    /// Write every Maglev frontend's table again: at the agent's start, as the seed may have
    /// changed since the tables were written.
    pub fn rewrite_maglev_tables(&self, maps: &mut dyn Maps) {
        let maglev = self.programmed.iter().filter(|(_, p)| p.value.flags & SERVICE_FLAG_MAGLEV != 0);
        write_maglev_tables(maps, maglev.map(|(key, p)| (key, p.value.service_id, &p.backends[..])));
    }

    pub fn programmed(&self) -> &BTreeMap<ServiceKey, Programmed> {
        &self.programmed
    }

    /// Take over what `previous` knew and the maps do not show (a reconcile rebuilds the
    /// programmer from the maps): its released ranges still in quarantine (they look free
    /// there), and the service ports that failed (logged once, not again at every reconcile).
    pub fn carry_over(&mut self, previous: &Programmer) {
        self.slots.carry_quarantine(&previous.slots);
        self.failing.clone_from(&previous.failing);
        self.reach.clone_from(&previous.reach);
    }

    /// Some service ports could not be written at the last apply.
    pub fn has_failures(&self) -> bool {
        !self.failing.is_empty()
    }

    /// Released backend slots are reusable at once (tests; the default is
    /// [`slots::QUARANTINE`]).
    pub fn without_quarantine(mut self) -> Self {
        self.slots.set_quarantine(std::time::Duration::ZERO);
        self
    }

    /// When released backend slots become reusable (an apply then may succeed where one
    /// failed for lack of room).
    pub fn quarantine_ends(&self) -> Option<std::time::Instant> {
        self.slots.quarantine_ends()
    }

    /// Make the maps hold `desired`, writing only service ports that differ.
    ///
    /// Order: new backends go into fresh ranges of the backend array (one batch), then the
    /// service entries are switched to them (one batch; each entry is one atomic map update),
    /// then the old ranges are released. Released ranges are reused only after
    /// [`slots::QUARANTINE`], so a connect that read an old entry an instant before the switch
    /// still finds the old backends in place. Removals go first so their room can be reused.
    ///
    /// A service is programmed whole or not at all: when one of its service ports finds no
    /// room, none of its changes are written (a NodePort without its ClusterIP would be half a
    /// service). Removing endpoints always succeeds, full maps or not: a service port whose
    /// new backends are a subset of its old ones and finds no fresh range is rewritten in its
    /// own range (remaining backends first, then the entry's count; a connect in between picks
    /// among old and remaining backends, as it did before the change).
    /// The sizes of the maps it writes.
    pub fn capacity(&self) -> Capacity {
        self.capacity
    }

    /// loadBalancerSourceRanges entries programmed, and the map's capacity.
    pub fn source_ranges_use(&self) -> (usize, u32) {
        (self.ranges_in_use, self.source_range_capacity)
    }

    /// Backend slots the programmed entries hold.
    pub fn slots_in_use(&self) -> usize {
        self.slots_in_use
    }

    fn insert_programmed(&mut self, key: ServiceKey, p: Programmed) {
        self.slots_in_use += p.backends.len();
        self.ranges_in_use += p.source_ranges.len();
        if let Some(old) = self.programmed.insert(key, p) {
            self.slots_in_use -= old.backends.len();
            self.ranges_in_use -= old.source_ranges.len();
        }
    }

    fn remove_programmed(&mut self, key: &ServiceKey) -> Option<Programmed> {
        let old = self.programmed.remove(key)?;
        self.slots_in_use -= old.backends.len();
        self.ranges_in_use -= old.source_ranges.len();
        Some(old)
    }

    pub fn apply(&mut self, desired: &Desired, maps: &mut dyn Maps) -> ApplyReport {
        self.apply_in(desired, None, maps)
    }

    /// [`Self::apply`] for the entries of `scope` only: the caller knows every other entry
    /// of `desired` is programmed as it wants (the last apply wrote it, and nothing changed it
    /// since). A change then costs what it touches, not the size of the cluster. With
    /// per-endpoint counters (a set drawn from every entry) it is a whole apply.
    pub fn apply_partial(
        &mut self,
        desired: &Desired,
        scope: &BTreeSet<ServiceKey>,
        maps: &mut dyn Maps,
    ) -> ApplyReport {
        if maps.endpoint_counters() > 0 {
            return self.apply(desired, maps);
        }
        self.apply_in(desired, Some(scope), maps)
    }

    fn apply_in(
        &mut self,
        desired: &Desired,
        scope: Option<&BTreeSet<ServiceKey>>,
        maps: &mut dyn Maps,
    ) -> ApplyReport {
        let now = std::time::Instant::now();
        self.slots.end_quarantine(now);
        let mut report = ApplyReport::default();
        // A port no longer wanted is no longer failing.
        self.failing.retain(|key| desired.contains_key(key));

        let gone: Vec<ServiceKey> = match scope {
            Some(keys) => keys.iter().filter(|k| self.programmed.contains_key(k)).copied().collect(),
            None => self.programmed.keys().copied().collect(),
        };
        for key in gone.into_iter().filter(|k| !desired.contains_key(k)) {
            match maps.remove_service(&key) {
                Ok(()) => {
                    let old = self.remove_programmed(&key).expect("listed above");
                    if let Err(e) = maps.remove_source_ranges(old.value.service_id, &old.source_ranges) {
                        tracing::warn!(service = %display_key(&key), "failed to remove source ranges: {e:#}");
                    }
                    if old.value.flags & SERVICE_FLAG_MAGLEV != 0
                        && let Err(e) = maps.remove_maglev(old.value.service_id)
                    {
                        tracing::warn!(service = %display_key(&key), "failed to remove the Maglev table: {e:#}");
                    }
                    // A removed UDP port's flows go as its endpoints' would; a TCP port's stay
                    // (their endpoints did not die).
                    if key.proto == IPPROTO_UDP {
                        let to: Vec<(Addr, u16)> = old.backends.iter().map(endpoint_of).collect();
                        self.queue_flush(&key, old.value.service_id, &to);
                    }
                    self.reach.remove(&key);
                    self.used_ids.remove(&old.value.service_id);
                    self.release_range(&old.value, &ServiceValue { backends_count: 0, ..old.value });
                    report.removed += 1;
                }
                Err(e) => {
                    report.failed += 1;
                    tracing::error!(service = %display_key(&key), "failed to remove the service: {e:#}");
                }
            }
        }

        // Reserve room and ids for every changed service port.
        let mut pending: Vec<Pending> = Vec::new();
        let mut failed_services = BTreeSet::new();
        let mut new_entries = 0;
        // loadBalancerSourceRanges entries: a port's new ones go in before its old ones leave.
        let mut ranges_used: usize = self.ranges_in_use;
        for (key, want) in in_scope(desired, scope) {
            let backends: Vec<Backend> = want_backends(want).collect();
            let old = self.programmed.get(key);
            if old.is_some_and(|p| p.matches(want)) {
                continue;
            }
            let old_ranges = old.map(|p| p.source_ranges.clone()).unwrap_or_default();
            let shrinking = old.is_some_and(|p| is_subset(&backends, &p.backends));
            let old = old.map(|p| p.value);
            let added_ranges = want.source_ranges.iter().filter(|r| !old_ranges.contains(r)).count();
            let reserved = if ranges_used + added_ranges > self.source_range_capacity as usize {
                Err(anyhow::anyhow!(
                    "the loadBalancerSourceRanges map is full ({} entries); raise --max-source-ranges",
                    self.source_range_capacity
                ))
            } else {
                self.reserve(old, want, new_entries, shrinking)
            };
            match reserved {
                Ok(value) => {
                    ranges_used += added_ranges;
                    new_entries += usize::from(old.is_none());
                    pending.push(Pending {
                        key: *key,
                        value,
                        backends,
                        old,
                        old_ranges,
                        ranges: want.source_ranges.clone(),
                    });
                }
                Err(e) => {
                    report.failed += 1;
                    self.note_failure(key, want, &e);
                    failed_services.insert(want.name.service.clone());
                }
            }
        }
        // Whole or not at all: the other ports of a service that could not be reserved give
        // their reservations back and stay as they were.
        let (pending, undone): (Vec<Pending>, Vec<Pending>) =
            pending.into_iter().partition(|p| !failed_services.contains(&desired[&p.key].name.service));
        for p in undone {
            self.unreserve(&p);
            report.failed += 1;
            self.note_failure(&p.key, &desired[&p.key], &anyhow::anyhow!("another port of the service did not fit"));
        }
        let backend_writes: Vec<(u32, Backend)> =
            pending.iter().flat_map(|p| (p.value.backends_start..).zip(p.backends.iter().copied())).collect();
        // New endpoints' counters exist before the programs can count for them.
        if maps.endpoint_counters() > 0 {
            self.count_endpoints(desired, maps);
        }
        if pending.is_empty() {
            // Which endpoints serve may have changed all the same.
            self.end_flows_off_endpoints(desired, scope, maps);
            return report;
        }

        let mut done = pending.len();
        // Allowed source ranges go in before the entry that refers to them.
        let ranges_written = pending.iter().try_for_each(|p| {
            let added: Vec<_> = p.ranges.iter().filter(|r| !p.old_ranges.contains(r)).copied().collect();
            maps.add_source_ranges(p.value.service_id, &added)
        });
        if let Err(e) = ranges_written {
            done = 0;
            tracing::error!("failed to write source ranges: {e:#}");
        } else if let Err(e) = maps.set_backends(&backend_writes) {
            done = 0;
            tracing::error!("failed to write {} backend slots: {e:#}", backend_writes.len());
        } else {
            // New frontends' counters exist before the programs can count for them.
            let new_ids: Vec<u32> = pending.iter().filter(|p| p.old.is_none()).map(|p| p.value.service_id).collect();
            if let Err(e) = maps.start_service_stats(&new_ids) {
                tracing::warn!("failed to make {} frontends' counters: {e:#}", new_ids.len());
            }
            // A Maglev frontend's table before its entry: a new flow that reads the entry
            // finds the table of its backends (one that read the old entry an instant before
            // may pick by the new table among the old backends: still a backend of the port).
            let maglev = pending.iter().filter(|p| p.value.flags & SERVICE_FLAG_MAGLEV != 0);
            write_maglev_tables(maps, maglev.map(|p| (&p.key, p.value.service_id, &p.backends[..])));
            let entries: Vec<(ServiceKey, ServiceValue)> = pending.iter().map(|p| (p.key, p.value)).collect();
            if let Err(BatchError { done: written, error }) = maps.set_services(&entries) {
                done = written;
                tracing::error!("wrote {written} of {} service entries: {error:#}", entries.len());
            }
        }

        for (i, p) in pending.into_iter().enumerate() {
            if i < done {
                if let Some(old) = p.old {
                    self.release_range(&old, &p.value);
                    if old.flags & SERVICE_FLAG_MAGLEV != 0
                        && p.value.flags & SERVICE_FLAG_MAGLEV == 0
                        && let Err(e) = maps.remove_maglev(old.service_id)
                    {
                        tracing::warn!(address = %display_key(&p.key), "failed to remove the Maglev table: {e:#}");
                    }
                    report.updated += 1;
                    report.renamed += usize::from(old.affinity_id != p.value.affinity_id);
                    // Flows may still go to what it had: `end_flows_off_endpoints` decides.
                    if let Some(before) = self.programmed.get(&p.key).filter(|_| ends_flows(&p.key, &desired[&p.key])) {
                        self.reach.entry(p.key).or_default().extend(before.backends.iter().map(endpoint_of));
                    }
                } else {
                    report.added += 1;
                }
                if self.failing.remove(&p.key) {
                    tracing::info!(address = %display_key(&p.key), "programmed after earlier failures");
                }
                let dropped: Vec<_> = p.old_ranges.iter().filter(|r| !p.ranges.contains(r)).copied().collect();
                if let Err(e) = maps.remove_source_ranges(p.value.service_id, &dropped) {
                    tracing::warn!(address = %display_key(&p.key), "failed to remove old source ranges: {e:#}");
                }
                self.insert_programmed(
                    p.key,
                    Programmed { value: p.value, backends: p.backends, source_ranges: p.ranges },
                );
            } else {
                // Not written: give the reservation back; the old entry (if any) stays as it was,
                // and so does its Maglev table (written above for the new backends).
                if p.value.flags & SERVICE_FLAG_MAGLEV != 0 {
                    match self.programmed.get(&p.key).filter(|o| o.value.flags & SERVICE_FLAG_MAGLEV != 0) {
                        Some(old) => {
                            write_maglev(maps, &p.key, old.value.service_id, &old.backends, &mut LastTable::default())
                        }
                        None => {
                            if let Err(e) = maps.remove_maglev(p.value.service_id) {
                                tracing::warn!(address = %display_key(&p.key), "failed to remove a Maglev table: {e:#}");
                            }
                        }
                    }
                }
                self.unreserve(&p);
                report.failed += 1;
                let want = &desired[&p.key];
                self.note_failure(&p.key, want, &anyhow::anyhow!("the map write failed"));
            }
        }
        self.end_flows_off_endpoints(desired, scope, maps);
        report
    }

    /// `--endpoint-counters`: counters for the endpoints the ports pick or still serve (a
    /// terminating endpoint's flows go on), as many as the cap allows; the maps are written
    /// only when that set changed.
    fn count_endpoints(&mut self, desired: &Desired, maps: &mut dyn Maps) {
        let mut endpoints = BTreeSet::new();
        for (key, want) in desired {
            let picked = want.backends.iter().map(|(ip, port)| (*ip, *port));
            let serving = want.serving.iter().map(|e| (e.ip(), e.port()));
            endpoints.extend(picked.chain(serving).map(|(ip, port)| BackendKey {
                addr: ip.into(),
                port: port.to_be(),
                proto: key.proto,
                _pad: 0,
            }));
        }
        if self.endpoints_uncounted.is_some() && endpoints == self.counted_for {
            return;
        }
        match maps.keep_endpoint_stats(&endpoints) {
            Ok(uncounted) => {
                self.counted_for = endpoints;
                if uncounted > 0 && self.endpoints_uncounted.is_none_or(|before| before == 0) {
                    tracing::warn!(
                        uncounted,
                        cap = maps.endpoint_counters(),
                        "more endpoints than --endpoint-counters: the others are counted per Service port only"
                    );
                }
                self.endpoints_uncounted = Some(uncounted);
            }
            Err(e) => tracing::warn!("failed to bring the endpoints' counters in line: {e:#}"),
        }
    }

    /// With `--endpoint-counters`: the endpoints left uncounted at the last sync (0: none, or
    /// not counting).
    pub fn endpoints_uncounted(&self) -> usize {
        self.endpoints_uncounted.unwrap_or(0)
    }

    /// Flows whose endpoint they may no longer go to are ended.
    ///
    /// UDP, kube-proxy's conntrack cleanup (1.31+): a flow goes on to its endpoint for as long
    /// as that endpoint serves, picked for new flows or not (traffic policies, topology and
    /// termination do not move flows); flows to an address that no longer serves are flushed,
    /// so that their next datagram picks a live endpoint; while nothing serves, flows are left
    /// as they are.
    ///
    /// TCP with `--abort-dead-tcp` (kube-proxy leaves TCP flows alone): flows to an endpoint
    /// that died (`DesiredPort::alive`) are ended, even when no endpoint is left.
    fn end_flows_off_endpoints(
        &mut self,
        desired: &Desired,
        scope: Option<&BTreeSet<ServiceKey>>,
        maps: &mut dyn Maps,
    ) {
        let still = |key: &ServiceKey| desired.get(key).is_some_and(|d| ends_flows(key, d));
        match scope {
            Some(keys) => keys.iter().filter(|k| !still(k)).for_each(|k| {
                self.reach.remove(k);
            }),
            None => self.reach.retain(|key, _| still(key)),
        }
        let mut pending = Vec::new();
        for (key, want) in in_scope(desired, scope).filter(|(key, want)| ends_flows(key, want)) {
            let Some(programmed) = self.programmed.get(key) else { continue };
            let reach = self.reach.entry(*key).or_default();
            reach.extend(programmed.backends.iter().map(endpoint_of));
            let stay_on = match &want.alive {
                Some(alive) => alive,
                None if want.serving.is_empty() => continue,
                None => &want.serving,
            };
            let stay_on: BTreeSet<(Addr, u16)> =
                stay_on.iter().map(|e| (Addr::from(e.ip()), e.port().to_be())).collect();
            let gone: Vec<(Addr, u16)> = reach.difference(&stay_on).copied().collect();
            if !gone.is_empty() {
                pending.push((*key, programmed.value.service_id, gone));
                reach.retain(|addr| stay_on.contains(addr));
            }
        }
        for (key, service_id, gone) in pending {
            self.queue_flush(&key, service_id, &gone);
        }
        self.flush_queued(maps);
    }

    /// End later in this `apply` (all at once: each flush walks the conntrack tables).
    fn queue_flush(&mut self, key: &ServiceKey, service_id: u32, to: &[(Addr, u16)]) {
        if to.is_empty() {
            return;
        }
        let flush = self.flushes.entry(service_id).or_insert_with(|| FlowFlush {
            service_id,
            proto: key.proto,
            ..FlowFlush::default()
        });
        flush.frontends.insert((key.addr, key.port));
        flush.gone.extend(to.iter().copied());
    }

    /// UDP has no connection end: as kube-proxy deletes the conntrack entries of UDP flows whose
    /// endpoint went away, so the next datagram of such a flow picks a live backend (a connected
    /// socket of the socket path is aborted: connecting again picks one). TCP flows keep their
    /// endpoint until they end, unless it died (`--abort-dead-tcp`).
    fn flush_queued(&mut self, maps: &mut dyn Maps) {
        if self.flushes.is_empty() {
            return;
        }
        let flushes: Vec<FlowFlush> = std::mem::take(&mut self.flushes).into_values().collect();
        let tcp = flushes.iter().any(|f| f.proto != IPPROTO_UDP);
        match maps.flush_flows(&flushes) {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                service_ports = flushes.len(),
                endpoints = flushes.iter().map(|f| f.gone.len()).sum::<usize>(),
                flows = n,
                "{}",
                if tcp {
                    "ended flows of endpoints that stopped serving or died"
                } else {
                    "flushed UDP flows of endpoints that stopped serving"
                }
            ),
            Err(e) => tracing::warn!(service_ports = flushes.len(), "failed to end flows: {e:#}"),
        }
    }

    /// Room in the backend array and an id for a service port about to be (re)written.
    /// `shrinking`: the new backends are a subset of the old ones, which may then be rewritten
    /// in their own range when no fresh one is free.
    fn reserve(
        &mut self,
        old: Option<ServiceValue>,
        want: &DesiredPort,
        new_so_far: usize,
        shrinking: bool,
    ) -> Result<ServiceValue> {
        if old.is_none() && self.programmed.len() + new_so_far >= self.capacity.service_ports as usize {
            bail!(
                "the services map is full ({} service ports); raise --max-service-ports",
                self.capacity.service_ports
            );
        }
        let count = u32::try_from(want.backends.len())?;
        let start = if count == 0 {
            0
        } else if let Some(start) = self.slots.alloc(count) {
            start
        } else if let Some(old) = old.filter(|o| shrinking && o.backends_count >= count) {
            old.backends_start
        } else {
            bail!(
                "no room for {count} backends in the backend array ({} slots, {} free); raise --max-backends",
                self.capacity.backends,
                self.slots.free_slots()
            );
        };
        let service_id = match old {
            Some(v) => v.service_id,
            None => self.alloc_id(),
        };
        Ok(ServiceValue {
            service_id,
            backends_start: start,
            backends_count: count,
            flags: want.flags,
            affinity_timeout: want.affinity_timeout,
            affinity_id: affinity_id(&want.name),
        })
    }

    fn note_failure(&mut self, key: &ServiceKey, want: &DesiredPort, e: &anyhow::Error) {
        if self.failing.insert(*key) {
            tracing::error!(
                service = %want.name,
                address = %display_key(key),
                backends = want.backends.len(),
                "not programmed, left as it was: {e:#}"
            );
        }
    }

    fn alloc_id(&mut self) -> u32 {
        while self.next_id == 0 || self.used_ids.contains(&self.next_id) {
            self.next_id = self.next_id.wrapping_add(1);
        }
        let id = self.next_id;
        self.used_ids.insert(id);
        self.next_id = id.wrapping_add(1);
        id
    }

    /// Release `old`'s range now that the entry says `new`: all of it, or the tail past `new`'s
    /// backends when `new` was rewritten in place.
    fn release_range(&mut self, old: &ServiceValue, new: &ServiceValue) {
        let now = std::time::Instant::now();
        if in_place(old, new) {
            let tail = old.backends_count - new.backends_count;
            if tail > 0 {
                self.slots.quarantine(old.backends_start + new.backends_count, tail, now);
            }
        } else if old.backends_count > 0 {
            self.slots.quarantine(old.backends_start, old.backends_count, now);
        }
    }

    /// Give back what `reserve` took for a port that is not written.
    fn unreserve(&mut self, p: &Pending) {
        let in_place = p.old.is_some_and(|o| in_place(&o, &p.value));
        if p.value.backends_count > 0 && !in_place {
            self.slots.free(p.value.backends_start, p.value.backends_count);
        }
        if p.old.is_none() {
            self.used_ids.remove(&p.value.service_id);
        }
    }
}

/// Every backend of `new` is in `old`, both in the desired order (by address, then port): one
/// walk of both, not a search per backend (quadratic for thousands of endpoints). Lists in
/// another order are taken as not a subset, which only costs a fresh range.
fn is_subset(new: &[Backend], old: &[Backend]) -> bool {
    let mut old = old.iter().peekable();
    new.iter().all(|b| {
        while old.next_if(|o| backend_addr(o) < backend_addr(b)).is_some() {}
        old.next_if(|o| *o == b).is_some()
    })
}

/// The entries of `desired` in `scope` (all without one).
fn in_scope<'a>(
    desired: &'a Desired,
    scope: Option<&'a BTreeSet<ServiceKey>>,
) -> Box<dyn Iterator<Item = (&'a ServiceKey, &'a DesiredPort)> + 'a> {
    match scope {
        Some(keys) => Box::new(keys.iter().filter_map(|k| desired.get_key_value(k))),
        None => Box::new(desired.iter()),
    }
}

/// The Maglev tables in line with the entries (a reconcile): tables no Maglev entry owns (an
/// entry removed while no agent ran, a removal that failed) removed, and a Maglev entry's
/// table written where it is not whole.
fn keep_maglev_tables(maps: &mut dyn Maps, programmed: &BTreeMap<ServiceKey, Programmed>) {
    let tables = match maps.maglev_tables() {
        Ok(tables) => tables,
        Err(e) => return tracing::warn!("failed to read the Maglev tables: {e:#}"),
    };
    let maglev = || programmed.iter().filter(|(_, p)| p.value.flags & SERVICE_FLAG_MAGLEV != 0);
    let owned: BTreeSet<u32> = maglev().map(|(_, p)| p.value.service_id).collect();
    for id in tables.keys().filter(|id| !owned.contains(id)) {
        if let Err(e) = maps.remove_maglev(*id) {
            tracing::warn!(service_id = id, "failed to remove a Maglev table no entry owns: {e:#}");
        }
    }
    let whole = proxy_common::maglev_chunks(maps.maglev_table_size());
    let incomplete = maglev().filter(|(_, p)| tables.get(&p.value.service_id) != Some(&whole));
    write_maglev_tables(maps, incomplete.map(|(key, p)| (key, p.value.service_id, &p.backends[..])));
}

/// Write the Maglev tables of frontends (key, service id, backends), each set of endpoints
/// built once: a Service's NodePort, externalIPs and LoadBalancer IPs share their endpoints,
/// so they are written in the order of their endpoints, and a table serves the next frontend
/// with the same ones.
fn write_maglev_tables<'a>(maps: &mut dyn Maps, frontends: impl Iterator<Item = (&'a ServiceKey, u32, &'a [Backend])>) {
    let mut frontends: Vec<_> = frontends.collect();
    frontends.sort_by(|a, b| a.2.cmp(b.2));
    let mut last = LastTable::default();
    for (key, service_id, backends) in frontends {
        write_maglev(maps, key, service_id, backends, &mut last);
    }
}

/// The last Maglev table `write_maglev` built, and its endpoints.
#[derive(Default)]
struct LastTable {
    endpoints: Vec<std::net::SocketAddr>,
    table: Vec<u32>,
}

/// Write the Maglev table of a frontend's `backends` (in their order in its range): `last`'s if
/// it has the same endpoints, else built. A failure is logged: without its table the
/// frontend's new flows get the usual pick (a random one) until the next write.
fn write_maglev(maps: &mut dyn Maps, key: &ServiceKey, service_id: u32, backends: &[Backend], last: &mut LastTable) {
    let endpoints: Vec<std::net::SocketAddr> =
        backends.iter().map(backend_addr).map(|(ip, port)| std::net::SocketAddr::new(ip, port)).collect();
    let written = if endpoints.is_empty() {
        maps.remove_maglev(service_id)
    } else if last.endpoints == endpoints && !last.table.is_empty() {
        maps.set_maglev(service_id, &last.table)
    } else {
        let seed = u64::from(maps.maglev_seed());
        crate::model::maglev::table(&endpoints, maps.maglev_table_size(), seed).map_err(anyhow::Error::new).and_then(
            |table| {
                *last = LastTable { endpoints, table };
                maps.set_maglev(service_id, &last.table)
            },
        )
    };
    if let Err(e) = written {
        tracing::warn!(address = %display_key(key), "failed to write the Maglev table (random picks meanwhile): {e:#}");
    }
}

/// `new` was written into `old`'s own range (a shrink in place). A fresh range never starts
/// where a live one does, so sharing the start (with backends in both) says it.
fn in_place(old: &ServiceValue, new: &ServiceValue) -> bool {
    old.backends_count > 0
        && new.backends_count > 0
        && new.backends_start == old.backends_start
        && new.backends_count <= old.backends_count
}

/// The id that ties a service port's frontends together for sessionAffinity: a hash (FNV-1a)
/// of its name, the same in every agent and across restarts; never 0.
pub fn affinity_id(name: &crate::model::ServicePortName) -> u32 {
    let hash = name.to_string().bytes().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
    hash.max(1)
}

/// A service port reserved for writing in this `apply`.
struct Pending {
    key: ServiceKey,
    value: ServiceValue,
    backends: Vec<Backend>,
    old: Option<ServiceValue>,
    old_ranges: Vec<Cidr>,
    ranges: Vec<Cidr>,
}

#[cfg(test)]
mod tests;
