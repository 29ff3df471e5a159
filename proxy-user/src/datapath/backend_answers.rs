//! What the datapath shows of the endpoints outlier detection watches
//! ([`crate::model::outliers`]): the per-packet new flows each has left unanswered so far (the
//! new-flow tables), and the first answers it gave (`KPR_BACKEND_ANSWERS`, counted by the
//! programs once per flow, and once per socket-path TCP connect with its unanswered ones).
//! Read from the pins once a second while a Service opts in.
use std::{
    collections::BTreeSet,
    hash::{Hash as _, Hasher as _},
    net::SocketAddr,
    path::Path,
};

use anyhow::{Context as _, Result};
use aya::maps::{Array, HashMap, Map, MapData};
use proxy_common::{BackendAnswers, BackendKey, ct, map_names};

use super::{bpf::pins::open_pinned_map, conntrack::Conntrack};
use crate::model::{
    Protocol,
    outliers::{Answers, Endpoint, Observation},
};

pub struct BackendWatch {
    conntrack: Conntrack,
    answers: HashMap<MapData, BackendKey, BackendAnswers>,
    wanted: Array<MapData, u64>,
}

impl BackendWatch {
    pub fn open(pin_root: &Path) -> Result<Self> {
        let answers = HashMap::try_from(Map::LruHashMap(open_pinned_map(pin_root, map_names::BACKEND_ANSWERS)?))?;
        let wanted = Array::try_from(Map::Array(open_pinned_map(pin_root, map_names::ANSWERS_WANTED)?))?;
        Ok(Self { conntrack: Conntrack::open(pin_root)?, answers, wanted })
    }

    /// Have the programs count answers (`on`), or not: they cost a new flow's first answer a
    /// map lookup and an atomic add.
    pub fn want_answers(&mut self, on: bool) -> Result<()> {
        self.wanted.set(0, &u64::from(on), 0).context("failed to write KPR_ANSWERS_WANTED")
    }

    /// The watched endpoints' unanswered flows and answers now: one walk of the new-flow
    /// tables (at most their size, batch reads) and one lookup per endpoint.
    pub fn observe(&self, watched: &BTreeSet<Endpoint>) -> Result<Observation> {
        let mut seen = Observation { covered: watched.clone(), ..Default::default() };
        if watched.is_empty() {
            return Ok(seen);
        }
        for (key, value) in self.conntrack.new_flow_entries() {
            // The client's entry of a flow its endpoint has not answered: it names the endpoint.
            // (Not one sent on by direct server return: its answers never pass this node.)
            if value.flags & (ct::REPLY | ct::SEEN_REPLY | ct::DSR) != 0 {
                continue;
            }
            let Some(protocol) = Protocol::from_ipproto(key.proto) else { continue };
            let endpoint =
                Endpoint { addr: SocketAddr::new(value.dst_addr.into(), u16::from_be(value.dst_port)), protocol };
            if watched.contains(&endpoint) {
                let mut flow = std::hash::DefaultHasher::new();
                (key.src_addr.0, key.dst_addr.0, key.src_port, key.dst_port, key.proto).hash(&mut flow);
                seen.unanswered.entry(endpoint).or_default().insert(flow.finish());
            }
        }
        for endpoint in watched {
            let key = BackendKey {
                addr: endpoint.addr.ip().into(),
                port: endpoint.addr.port().to_be(),
                proto: endpoint.protocol.ipproto(),
                _pad: 0,
            };
            // Absent: no flow of the endpoint's has been answered since the map was made.
            if let Ok(counts) = self.answers.get(&key, 0) {
                let BackendAnswers { answered, refused, unanswered } = counts;
                seen.answers.insert(*endpoint, Answers { answered, refused, unanswered });
            }
        }
        Ok(seen)
    }
}
