//! In-memory [`Maps`] for tests without root. It checks the ordering rule the kernel side
//! relies on: backend slots referenced by a live service entry are never overwritten, and a
//! service entry never points at slots that were not written.
use std::collections::BTreeMap;

use anyhow::{Result, bail};
use proxy_common::{Addr, Backend, ServiceKey, ServiceValue};

use super::{BatchError, Capacity, Maps};
use crate::model::cidr::Cidr;

pub struct FakeMaps {
    pub capacity: Capacity,
    pub services: BTreeMap<ServiceKey, ServiceValue>,
    pub backends: Vec<Option<Backend>>,
    /// Ordering violations seen (a reader could have seen a half-written service).
    pub violations: Vec<String>,
    /// Number of map writes (set/remove calls).
    pub writes: usize,
    /// Fail the next N `set_service` calls (simulates a kernel error).
    pub fail_service_writes: usize,
    pub source_ranges: std::collections::BTreeSet<(u32, Cidr)>,
    /// `flush_flows` calls: (service id, endpoint addresses).
    /// Each flush: the service and the endpoints (address, port in host order) it named.
    pub flushed: Vec<(u32, Vec<(Addr, u16)>)>,
    /// Entries the source range map holds at most.
    pub source_range_capacity: u32,
    /// Maglev tables by service id.
    pub maglev: BTreeMap<u32, Vec<u32>>,
    pub maglev_seed: u32,
    pub maglev_table_size: u32,
}

impl FakeMaps {
    pub fn new(capacity: Capacity) -> Self {
        Self {
            capacity,
            services: BTreeMap::new(),
            backends: vec![None; capacity.backends as usize],
            violations: Vec::new(),
            writes: 0,
            fail_service_writes: 0,
            source_ranges: Default::default(),
            flushed: Vec::new(),
            source_range_capacity: u32::MAX,
            maglev: BTreeMap::new(),
            maglev_seed: 0,
            maglev_table_size: proxy_common::MAGLEV_DEFAULT_TABLE_SIZE,
        }
    }

    /// What a connect to `key` could pick from right now.
    pub fn visible_backends(&self, key: &ServiceKey) -> Option<Vec<Backend>> {
        let v = self.services.get(key)?;
        Some(
            (v.backends_start..v.backends_start + v.backends_count)
                .map(|i| self.backends[i as usize].unwrap_or_default())
                .collect(),
        )
    }
}

impl Maps for FakeMaps {
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
        self.writes += 1;
        self.maglev.insert(service_id, table.to_vec());
        Ok(())
    }

    fn remove_maglev(&mut self, service_id: u32) -> Result<()> {
        self.writes += 1;
        self.maglev.remove(&service_id);
        Ok(())
    }

    fn maglev_tables(&self) -> Result<BTreeMap<u32, u32>> {
        // A table of another size counts as a table of its own number of chunks.
        Ok(self.maglev.iter().map(|(id, table)| (*id, proxy_common::maglev_chunks(table.len() as u32))).collect())
    }

    fn source_range_capacity(&self) -> u32 {
        self.source_range_capacity
    }

    fn services(&self) -> Result<Vec<(ServiceKey, ServiceValue)>> {
        Ok(self.services.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn backends(&self, start: u32, count: u32) -> Result<Vec<Backend>> {
        (start..start + count)
            .map(|i| match self.backends.get(i as usize) {
                Some(b) => Ok(b.unwrap_or_default()),
                None => bail!("slot {i} out of range"),
            })
            .collect()
    }

    fn set_backends(&mut self, writes: &[(u32, Backend)]) -> Result<()> {
        for (slot, b) in writes {
            // A live entry's slot may only be given one of that entry's own backends (a
            // shrink in place): a connect reading it meanwhile still gets a backend it could
            // have got before the change. Anything else would send it somewhere wrong.
            let live = |v: &ServiceValue| *slot >= v.backends_start && *slot < v.backends_start + v.backends_count;
            let own = |v: &ServiceValue| {
                (v.backends_start..v.backends_start + v.backends_count)
                    .any(|i| self.backends.get(i as usize) == Some(&Some(*b)))
            };
            if let Some((key, _)) = self.services.iter().find(|(_, v)| live(v) && !own(v)) {
                self.violations.push(format!("wrote slot {slot} while {key:?} uses it"));
            }
            match self.backends.get_mut(*slot as usize) {
                Some(entry) => *entry = Some(*b),
                None => bail!("slot {slot} out of range"),
            }
        }
        self.writes += writes.len();
        Ok(())
    }

    fn set_services(&mut self, entries: &[(ServiceKey, ServiceValue)]) -> Result<(), BatchError> {
        for (done, (key, value)) in entries.iter().enumerate() {
            if self.fail_service_writes > 0 {
                self.fail_service_writes -= 1;
                return Err(BatchError { done, error: anyhow::anyhow!("injected failure") });
            }
            let range = value.backends_start..value.backends_start + value.backends_count;
            if range.clone().any(|i| self.backends.get(i as usize).is_none_or(Option::is_none)) {
                self.violations.push(format!("{key:?} points at unwritten slots {range:?}"));
            }
            self.services.insert(*key, *value);
            self.writes += 1;
        }
        Ok(())
    }

    fn remove_service(&mut self, key: &ServiceKey) -> Result<()> {
        self.services.remove(key);
        self.writes += 1;
        Ok(())
    }

    fn source_ranges(&self) -> Result<Vec<(u32, Cidr)>> {
        Ok(self.source_ranges.iter().copied().collect())
    }

    fn add_source_ranges(&mut self, service_id: u32, ranges: &[Cidr]) -> Result<()> {
        self.source_ranges.extend(ranges.iter().map(|c| (service_id, *c)));
        Ok(())
    }

    fn remove_source_ranges(&mut self, service_id: u32, ranges: &[Cidr]) -> Result<()> {
        for c in ranges {
            self.source_ranges.remove(&(service_id, *c));
        }
        Ok(())
    }

    fn flush_flows(&mut self, flushes: &[super::FlowFlush]) -> Result<usize> {
        self.flushed.extend(
            flushes.iter().map(|f| (f.service_id, f.gone.iter().map(|(a, p)| (*a, u16::from_be(*p))).collect())),
        );
        Ok(0)
    }
}

/// A [`HostDatapath`](super::bpf::HostDatapath) that records the plans it is given.
#[derive(Default)]
pub struct FakeHost {
    pub plans: Vec<crate::model::node::NodePlan>,
    /// Calls of `retire_other_layouts`.
    pub retired: usize,
}

impl super::bpf::HostDatapath for FakeHost {
    fn apply_node(&mut self, plan: &crate::model::node::NodePlan) -> Result<()> {
        self.plans.push(plan.clone());
        Ok(())
    }

    fn retire_other_layouts(&mut self) {
        self.retired += 1;
    }
}
