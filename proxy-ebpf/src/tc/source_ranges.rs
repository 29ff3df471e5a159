//! loadBalancerSourceRanges: a new flow's source checked against its frontend's ranges (the
//! frontend picked here, or the one a direct server return tunnel brought).
use aya_ebpf::btf_maps::lpm_trie::Key;
use proxy_common::{SERVICE_FLAG_SOURCE_RANGES, ServiceValue, SourceRange, counter, event};

use super::{event::note, parse::Tuple};
use crate::maps::SOURCE_RANGES;

/// A source outside the frontend's ranges: to be dropped (and noted), as kube-proxy's firewall
/// chain drops it.
#[inline(always)]
pub(super) fn source_range_refuses(t: &Tuple, service: &ServiceValue) -> bool {
    if service.flags & SERVICE_FLAG_SOURCE_RANGES == 0 {
        return false;
    }
    let key = Key::new(32 + 128, SourceRange { service_id: service.service_id.to_be(), addr: t.saddr });
    if SOURCE_RANGES.get(&key).is_some() {
        return false;
    }
    note(t, counter::TC_DROPPED, event::DROPPED_SOURCE_RANGE, service.service_id);
    true
}
