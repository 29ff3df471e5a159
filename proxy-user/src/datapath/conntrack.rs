//! The per-packet path's conntrack, seen from the agent: usage, and the sweep that removes
//! expired flows (the programs take back an expired tuple or SNAT port when they meet it; the
//! sweep frees the rest, so the table never fills with flows that ended long ago).
use std::{collections::BTreeMap, path::Path, time::Duration};

use anyhow::{Context as _, Result};
use aya::maps::{Array, HashMap, IterableMap as _, Map, MapData};
use proxy_common::{Addr, Addr4, BackendKey, CtKey, CtTimeouts, CtValue, FlowAddr, ct, ct_generation, map_names};

use super::bpf::{batch::read_all_of, pins::open_pinned_map};

/// How often the agent sweeps.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// The pinned conntrack tables: per family, established flows and flows not answered yet; and
/// the generation the programs' flow caches check their copies of entries against.
pub struct Conntrack {
    v4: [Table<Addr4>; 2],
    v6: [Table<Addr>; 2],
    generation: Array<MapData, u64>,
    /// Each table's size, in [`TABLES`]' order.
    capacities: [u32; 4],
    /// Each table's entries at the end of the last walk, in [`TABLES`]' order.
    live: [usize; 4],
}

/// The tables, in the order [`Conntrack::table_use`] reports them.
pub const TABLES: [&str; 4] =
    ["conntrack_established_v4", "conntrack_new_v4", "conntrack_established_v6", "conntrack_new_v6"];

/// One table's entries and size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableUse {
    pub name: &'static str,
    pub live: usize,
    pub capacity: u32,
}

/// What one sweep found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sweep {
    /// Entries alive after the sweep.
    pub live: usize,
    /// Entries removed.
    pub expired: usize,
    /// Of those, new flows their endpoint never answered, by service id.
    pub unanswered: BTreeMap<u32, u64>,
    /// The same, by endpoint.
    pub unanswered_endpoints: BTreeMap<BackendKey, u64>,
}

/// One conntrack table, keyed by addresses `A` (its family's).
type Table<A> = HashMap<MapData, CtKey<A>, CtValue>;

impl Conntrack {
    pub fn open(pin_root: &Path) -> Result<Self> {
        Self::new(|name| {
            let map = open_pinned_map(pin_root, name)?;
            Ok(match name {
                map_names::CT_GENERATION => Map::Array(map),
                map_names::CONNTRACK4 | map_names::CONNTRACK6 => Map::HashMap(map),
                _ => Map::LruHashMap(map),
            })
        })
    }

    /// The tables, each taken by its name from `take` (a loaded object's maps, or the pins).
    pub fn new(mut take: impl FnMut(&str) -> Result<Map>) -> Result<Self> {
        let mut table = |name: &str| -> Result<Map> { take(name).with_context(|| format!("no map {name}")) };
        let v4 = [HashMap::try_from(table(map_names::CONNTRACK4)?)?, HashMap::try_from(table(map_names::CT_NEW4)?)?];
        let v6 = [HashMap::try_from(table(map_names::CONNTRACK6)?)?, HashMap::try_from(table(map_names::CT_NEW6)?)?];
        let generation = Array::try_from(table(map_names::CT_GENERATION)?)?;
        let mut capacities = [0; 4];
        for (capacity, map) in capacities.iter_mut().zip([v4[0].map(), v4[1].map(), v6[0].map(), v6[1].map()]) {
            *capacity = map.info()?.max_entries();
        }
        Ok(Self { v4, v6, generation, capacities, live: [0; 4] })
    }

    /// Entries all tables hold at most.
    pub fn capacity(&self) -> u32 {
        self.capacities.iter().sum()
    }

    /// Each table's entries at the end of the last walk of it, and its size.
    pub fn table_use(&self) -> [TableUse; 4] {
        std::array::from_fn(|i| TableUse { name: TABLES[i], live: self.live[i], capacity: self.capacities[i] })
    }

    /// Each table's entries now (a walk of every table; `table_use` gives the last sweep's).
    pub fn table_use_now(&self) -> [TableUse; 4] {
        fn len<A: FlowAddr>(t: &Table<A>) -> usize
        where
            CtKey<A>: aya::Pod,
        {
            read_all_of(t).len()
        }
        let live = [len(&self.v4[0]), len(&self.v4[1]), len(&self.v6[0]), len(&self.v6[1])];
        std::array::from_fn(|i| TableUse { name: TABLES[i], live: live[i], capacity: self.capacities[i] })
    }

    /// Entries now (two per flow), both families: established, new.
    pub fn lens(&self) -> (usize, usize) {
        fn len<A: FlowAddr>(t: &Table<A>) -> usize
        where
            CtKey<A>: aya::Pod,
        {
            read_all_of(t).len()
        }
        (len(&self.v4[0]) + len(&self.v6[0]), len(&self.v4[1]) + len(&self.v6[1]))
    }

    /// Every entry, both families: (in a table of flows not answered yet, key, value).
    pub fn entries(&self) -> Vec<(bool, CtKey, CtValue)> {
        fn entries<A: FlowAddr>(tables: &[Table<A>; 2], out: &mut Vec<(bool, CtKey, CtValue)>)
        where
            CtKey<A>: aya::Pod,
        {
            for (i, table) in tables.iter().enumerate() {
                out.extend(read_all_of(table).into_iter().map(|(k, v)| (i == 1, k.wide(), v)));
            }
        }
        let mut out = Vec::new();
        entries(&self.v4, &mut out);
        entries(&self.v6, &mut out);
        out
    }

    /// The entries of the tables of flows not answered yet, both families (keys IPv4 mapped).
    pub fn new_flow_entries(&self) -> Vec<(CtKey, CtValue)> {
        let mut out: Vec<(CtKey, CtValue)> = read_all_of(&self.v4[1]).into_iter().map(|(k, v)| (k.wide(), v)).collect();
        out.extend(read_all_of(&self.v6[1]));
        out
    }

    /// Entries now, all tables.
    pub fn len(&self) -> usize {
        let (established, new) = self.lens();
        established + new
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Remove the entries that have been idle longer than their state allows at `now`
    /// (CLOCK_MONOTONIC, the programs' clock).
    pub fn sweep(&mut self, timeouts: &CtTimeouts, now: u64) -> Result<Sweep> {
        let (mut unanswered, mut unanswered_endpoints) = (BTreeMap::new(), BTreeMap::new());
        let mut removed = |key: &CtKey, value: &CtValue| {
            if value.flags & (ct::REPLY | ct::SEEN_REPLY | ct::DSR) == 0 {
                *unanswered.entry(value.service_id).or_insert(0) += 1;
                let endpoint = BackendKey { addr: value.dst_addr, port: value.dst_port, proto: key.proto, _pad: 0 };
                *unanswered_endpoints.entry(endpoint).or_insert(0) += 1;
            }
        };
        let (live, expired) = self.remove_where_telling(
            [true, true],
            |key, value| timeouts.expired(key.proto, value, now),
            &mut removed,
        )?;
        Ok(Sweep { live, expired, unanswered, unanswered_endpoints })
    }

    /// Remove the entries `doomed` picks (it sees keys of either family, IPv4 mapped), in all
    /// tables: (entries left, entries removed).
    /// Every CPU's flow cache stops serving its copies (even if the walk failed halfway).
    pub fn remove_where(&mut self, doomed: impl Fn(&CtKey, &CtValue) -> bool) -> Result<(usize, usize)> {
        self.remove_where_in([true, true], doomed)
    }

    /// [`Self::remove_where`] in the tables of the families `[IPv4, IPv6]` says (a flush for
    /// endpoints of one family need not walk the other's: each walk visits every bucket).
    pub fn remove_where_in(
        &mut self,
        families: [bool; 2],
        doomed: impl Fn(&CtKey, &CtValue) -> bool,
    ) -> Result<(usize, usize)> {
        self.remove_where_telling(families, doomed, &mut |_, _| {})
    }

    /// [`Self::remove_where_in`], telling `removed` of each entry it removed.
    fn remove_where_telling(
        &mut self,
        families: [bool; 2],
        doomed: impl Fn(&CtKey, &CtValue) -> bool,
        removed_one: &mut dyn FnMut(&CtKey, &CtValue),
    ) -> Result<(usize, usize)> {
        let (mut left, mut removed) = (0, 0);
        let mut walked = || -> Result<()> {
            for (i, table) in self.v4.iter_mut().enumerate().filter(|_| families[0]) {
                let (l, r) = remove_where(table, &doomed, removed_one)?;
                (left, removed, self.live[i]) = (left + l, removed + r, l);
            }
            for (i, table) in self.v6.iter_mut().enumerate().filter(|_| families[1]) {
                let (l, r) = remove_where(table, &doomed, removed_one)?;
                (left, removed, self.live[2 + i]) = (left + l, removed + r, l);
            }
            Ok(())
        };
        let walked = walked();
        // A walk that failed may have removed entries it did not get to count.
        if removed > 0 || walked.is_err() {
            self.changed()?;
        }
        walked.map(|()| (left, removed))
    }

    /// Remove the entries under `keys` (either family's, IPv4 mapped) from every table of
    /// their family, without a walk: how many were there. A probe's flow (`kpr verify`) goes
    /// this way.
    pub fn remove_flows(&mut self, keys: &[CtKey]) -> Result<usize> {
        let mut removed = 0;
        for key in keys {
            if key.src_addr.is_v4() {
                let key = CtKey::<Addr4>::new(key.src_addr, key.dst_addr, key.src_port, key.dst_port, key.proto);
                removed += self.v4.iter_mut().map(|table| usize::from(table.remove(&key).is_ok())).sum::<usize>();
            } else {
                removed += self.v6.iter_mut().map(|table| usize::from(table.remove(key).is_ok())).sum::<usize>();
            }
        }
        if removed > 0 {
            self.changed()?;
        }
        Ok(removed)
    }

    /// Add `bits` to the flags of the entries `marked` picks (keys of either family, IPv4
    /// mapped), in the tables of the families `[IPv4, IPv6]` says: how many were marked. Every
    /// CPU's flow cache stops serving its copies, so the programs see the bits at the flow's
    /// next packet.
    pub fn mark_where_in(
        &mut self,
        families: [bool; 2],
        bits: u32,
        marked: impl Fn(&CtKey, &CtValue) -> bool,
    ) -> Result<usize> {
        let mut done = 0;
        let walked = (|| -> Result<()> {
            for table in self.v4.iter_mut().filter(|_| families[0]) {
                done += mark_where(table, bits, &marked)?;
            }
            for table in self.v6.iter_mut().filter(|_| families[1]) {
                done += mark_where(table, bits, &marked)?;
            }
            Ok(())
        })();
        if done > 0 || walked.is_err() {
            self.changed()?;
        }
        walked.map(|()| done)
    }

    /// Entries were removed or rewritten from userspace: the programs' flow caches (copies of
    /// entries, per CPU) stop serving, as the word they check gets a value it never had: the
    /// clock in ns (`proxy_common::ct_generation` says why a new value, not a count).
    pub fn changed(&mut self) -> Result<()> {
        let now = monotonic_now();
        self.generation.set(ct_generation::AGENT, &now, 0).context("failed to write KPR_CT_GENERATION")
    }
}

/// [`Conntrack::remove_where`] in one table.
///
/// Each entry is read again just before it is removed: a walk of a full table takes long
/// enough for the programs to bring a doomed tuple back to life meanwhile (a new connection
/// on the tuple of an expired flow), and removing that entry would break the new
/// connection (its replies would find no flow).
fn remove_where<A: FlowAddr>(
    table: &mut Table<A>,
    doomed: &impl Fn(&CtKey, &CtValue) -> bool,
    removed_one: &mut dyn FnMut(&CtKey, &CtValue),
) -> Result<(usize, usize)>
where
    CtKey<A>: aya::Pod,
{
    let (mut left, mut removed) = (0, 0);
    let mut keys = Vec::new();
    let mut pick = |key: CtKey<A>, value: CtValue| {
        if doomed(&key.wide(), &value) {
            keys.push(key);
        } else {
            left += 1;
        }
    };
    read_all_of(table).into_iter().for_each(|(k, v)| pick(k, v));
    for key in keys {
        let value = match table.get(&key, 0) {
            Ok(value) if doomed(&key.wide(), &value) => value,
            Ok(_) => {
                left += 1;
                continue;
            }
            // Taken back by the programs meanwhile.
            Err(_) => continue,
        };
        match table.remove(&key) {
            Ok(()) => {
                removed += 1;
                removed_one(&key.wide(), &value);
            }
            // Taken back by the programs meanwhile.
            Err(aya::maps::MapError::KeyNotFound) => {}
            Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok((left, removed))
}

/// [`Conntrack::mark_where_in`] in one table. Each entry is read again just before it is
/// written (`BPF_EXIST`: an entry the programs removed meanwhile is not brought back); a
/// refresh of its time the programs made in between may be lost, which only shortens its idle
/// time by less than a second.
fn mark_where<A: FlowAddr>(table: &mut Table<A>, bits: u32, marked: &impl Fn(&CtKey, &CtValue) -> bool) -> Result<usize>
where
    CtKey<A>: aya::Pod,
{
    /// `bpf_map_update_elem`'s flag: only an entry that exists.
    const BPF_EXIST: u64 = 2;
    let keys: Vec<CtKey<A>> =
        read_all_of(table).into_iter().filter(|(k, v)| marked(&k.wide(), v)).map(|(k, _)| k).collect();
    let mut done = 0;
    for key in keys {
        let Ok(value) = table.get(&key, 0) else { continue };
        if !marked(&key.wide(), &value) {
            continue;
        }
        let value = CtValue { flags: value.flags | bits, ..value };
        match table.insert(&key, &value, BPF_EXIST) {
            Ok(()) => done += 1,
            Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(done)
}

/// CLOCK_MONOTONIC in nanoseconds: `bpf_ktime_get_ns()`'s clock.
pub fn monotonic_now() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Warns when a table nears full (a full established table leaves newly answered flows among
/// the new ones, which a flood may evict; a full new-flow table evicts its least recently used
/// flows), and says when it is back: once per crossing, not per sweep.
#[derive(Default)]
pub struct PressureAlarm {
    raised: [bool; 4],
}

impl PressureAlarm {
    /// Raised at this share of a table...
    pub const RAISE: f64 = 0.9;
    /// ...and cleared below this one.
    pub const CLEAR: f64 = 0.75;

    /// The tables whose alarm changed with this sweep: (table, raised now).
    pub fn observe(&mut self, tables: &[TableUse; 4]) -> Vec<(TableUse, bool)> {
        let mut changed = Vec::new();
        for (raised, table) in self.raised.iter_mut().zip(tables) {
            let share = table.live as f64 / f64::from(table.capacity.max(1));
            let now = if *raised { share >= Self::CLEAR } else { share >= Self::RAISE };
            if now != *raised {
                *raised = now;
                changed.push((*table, now));
            }
        }
        changed
    }
}

/// Sweep every [`SWEEP_INTERVAL`] until the task is dropped; failures are logged, never fatal.
/// `swept` hears of each sweep: what it removed, and each table's use after it.
pub async fn sweep_forever(
    pin_root: std::path::PathBuf,
    timeouts: CtTimeouts,
    swept: impl Fn(&Sweep, &[TableUse]) + Send + 'static,
) {
    let mut tick = tokio::time::interval(SWEEP_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The tables, opened once and handed to each blocking sweep and back.
    let mut tables: Option<Conntrack> = None;
    let mut alarm = PressureAlarm::default();
    loop {
        tick.tick().await;
        let root = pin_root.clone();
        let opened = tables.take();
        let result = tokio::task::spawn_blocking(move || -> Result<(Conntrack, Sweep)> {
            let mut conntrack = match opened {
                Some(c) => c,
                None => Conntrack::open(&root)?,
            };
            let sweep = conntrack.sweep(&timeouts, monotonic_now())?;
            Ok((conntrack, sweep))
        })
        .await;
        match result {
            Ok(Ok((conntrack, sweep))) => {
                let table_use = conntrack.table_use();
                swept(&sweep, &table_use);
                for (table, raised) in alarm.observe(&table_use) {
                    let (name, live, capacity) = (table.name, table.live, table.capacity);
                    if raised {
                        tracing::warn!(
                            table = name,
                            live,
                            capacity,
                            "per-packet conntrack table nearly full: when the established table is full, \
                             newly answered flows stay in the new-flow table, whose least recently used \
                             flows are evicted when it is full (and reset at their next packet if that \
                             is the backend's); raise --max-conntrack (established) or --max-conntrack-new"
                        );
                    } else {
                        tracing::info!(
                            table = name,
                            live,
                            capacity,
                            "per-packet conntrack table no longer nearly full"
                        );
                    }
                }
                tables = Some(conntrack);
                if sweep.expired > 0 {
                    tracing::debug!(live = sweep.live, expired = sweep.expired, "conntrack swept");
                }
            }
            Ok(Err(e)) => tracing::warn!("conntrack sweep failed: {e:#}"),
            Err(e) => tracing::warn!("conntrack sweep task failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(live: [usize; 4]) -> [TableUse; 4] {
        std::array::from_fn(|i| TableUse { name: TABLES[i], live: live[i], capacity: 100 })
    }

    #[test]
    fn the_alarm_rises_at_ninety_percent_of_one_table_and_clears_below_seventy_five() {
        let mut alarm = PressureAlarm::default();
        // Together they hold 40% of all entries; the established IPv4 table alone is at 90%.
        let changed = alarm.observe(&tables([90, 30, 20, 20]));
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert_eq!((changed[0].0.name, changed[0].1), ("conntrack_established_v4", true));
        assert!(alarm.observe(&tables([95, 30, 20, 20])).is_empty(), "raised once, not per sweep");
        assert!(alarm.observe(&tables([80, 30, 20, 20])).is_empty(), "80% is above the clearing mark");
        let changed = alarm.observe(&tables([74, 30, 20, 89]));
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert_eq!((changed[0].0.name, changed[0].1), ("conntrack_established_v4", false));
        assert!(alarm.observe(&tables([0, 0, 0, 89])).is_empty(), "89% of the new-flow table raises nothing");
    }
}
