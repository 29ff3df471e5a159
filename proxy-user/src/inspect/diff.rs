//! `kpr diff`: the desired state (from the API or the manifests, through the agent's own
//! model and configuration) against what the pinned maps hold: every difference, and whether
//! the node is in sync.
use std::{collections::BTreeMap, fmt::Write as _};

use proxy_common::ServiceKey;
use serde::Serialize;

use super::services::PortView;
use crate::{
    datapath::{Drift, Programmed, backend},
    model::desired::{Desired, DesiredPort},
    model::display_key,
};

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DiffReport {
    pub in_sync: bool,
    /// Service ports desired.
    pub desired: usize,
    /// Service ports in the maps.
    pub programmed: usize,
    pub differences: Vec<Difference>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Difference {
    pub frontend: String,
    /// `missing` (desired, not in the maps), `unexpected` (in the maps, not desired) or
    /// `differs`.
    pub kind: &'static str,
    /// The service port that wants it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub desired: Option<PortView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maps: Option<PortView>,
}

/// The desired service port as the maps would hold it (for showing both sides alike).
fn as_programmed(want: &DesiredPort, service_id: u32) -> Programmed {
    let value = proxy_common::ServiceValue {
        service_id,
        backends_start: 0,
        backends_count: want.backends.len() as u32,
        flags: want.flags,
        affinity_timeout: want.affinity_timeout,
        affinity_id: crate::datapath::affinity_id(&want.name),
    };
    let backends = want.backends.iter().map(|(ip, port)| backend(*ip, *port)).collect();
    Programmed { value, backends, source_ranges: want.source_ranges.clone() }
}

pub fn compare(desired: &Desired, programmed: &BTreeMap<ServiceKey, Programmed>) -> DiffReport {
    let differences: Vec<Difference> = crate::datapath::drift(desired, programmed)
        .into_iter()
        .map(|(key, drift)| {
            let have = programmed.get(&key);
            let want = desired.get(&key);
            Difference {
                frontend: display_key(&key).to_string(),
                kind: match drift {
                    Drift::Missing => "missing",
                    Drift::Unexpected => "unexpected",
                    Drift::Differs => "differs",
                },
                service: want.map(|w| w.name.to_string()),
                desired: want.map(|w| PortView::new(&key, &as_programmed(w, have.map_or(0, |h| h.value.service_id)))),
                maps: have.map(|h| PortView::new(&key, h)),
            }
        })
        .collect();
    DiffReport { in_sync: differences.is_empty(), desired: desired.len(), programmed: programmed.len(), differences }
}

pub fn text(r: &DiffReport) -> String {
    let mut out = String::new();
    for d in &r.differences {
        let service = d.service.as_deref().map(|s| format!(" ({s})")).unwrap_or_default();
        let _ = writeln!(out, "{} {}{service}", d.kind, d.frontend);
        if let Some(want) = &d.desired {
            let _ = writeln!(out, "    desired: {}", want.line());
        }
        if let Some(have) = &d.maps {
            let _ = writeln!(out, "    maps:    {}", have.line());
        }
    }
    let verdict = if r.in_sync { "in sync" } else { "DRIFT" };
    let _ = writeln!(
        out,
        "{verdict}: {} service ports desired, {} in the maps, {} differences",
        r.desired,
        r.programmed,
        r.differences.len()
    );
    out
}
