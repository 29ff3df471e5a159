//! The handover maps (`KPR_HANDOVER`, `KPR_HANDOVER_COUNT`): the tuples of flows kube-proxy
//! translated, which the per-packet path leaves to netfilter (see `crate::takeover`).
use std::{collections::HashSet, path::Path};

use anyhow::{Context as _, Result};
use aya::maps::{Array, HashMap, Map, MapData};
use proxy_common::{CtKey, map_names};

use super::pins::open_pinned_map;

pub struct HandoverMaps {
    tuples: HashMap<MapData, CtKey, u8>,
    /// `KPR_HANDOVER_COUNT`: while 0, the per-packet path does not look in `tuples`.
    count: Array<MapData, u32>,
}

impl HandoverMaps {
    pub fn open(pin_root: &Path) -> Result<Self> {
        let tuples = HashMap::try_from(Map::LruHashMap(open_pinned_map(pin_root, map_names::HANDOVER)?))?;
        let count = Array::try_from(Map::Array(open_pinned_map(pin_root, map_names::HANDOVER_COUNT)?))?;
        Ok(Self { tuples, count })
    }

    /// The tuples held (an earlier agent's too).
    pub fn tuples(&self) -> Result<HashSet<CtKey>> {
        self.tuples.keys().collect::<Result<HashSet<_>, _>>().context("reading KPR_HANDOVER")
    }

    pub fn insert(&mut self, tuple: &CtKey) -> Result<()> {
        Ok(self.tuples.insert(tuple, &1, 0)?)
    }

    /// Remove `tuple` (gone already is fine: the map is an LRU).
    pub fn remove(&mut self, tuple: &CtKey) {
        let _ = self.tuples.remove(tuple);
    }

    pub fn set_count(&mut self, count: u32) -> Result<()> {
        Ok(self.count.set(0, &count, 0)?)
    }
}
