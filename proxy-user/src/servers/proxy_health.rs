//! kube-proxy's own health (`healthzBindAddress`, `/healthz` and `/livez`): the proxy is
//! unhealthy when a change has waited longer than the health timeout (kube-proxy: twice
//! `syncPeriod`) to reach the datapath; `/healthz` is also 503 while the node is being deleted
//! or is tainted `ToBeDeletedByClusterAutoscaler`, so cloud load balancers drain it, while
//! `/livez` (the kubelet's liveness probe) ignores the node. Bodies and status codes are
//! kube-proxy's (`pkg/proxy/healthcheck/proxy_health.go`). Like kube-proxy's, both answer 200
//! while the agent is starting; `/readyz` (kpr's own, the DaemonSet's readiness probe) waits
//! for the first full sync: ready means every Service the source listed is in the datapath.
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use serde::Serialize;

use super::metrics::Metrics;

/// The address families kpr programs (one datapath for both; reported per family like
/// kube-proxy's per-family proxiers).
const FAMILIES: [&str; 1] = ["IPv4"];

#[derive(Debug)]
struct State {
    last_updated: SystemTime,
    /// The oldest change not yet in the datapath.
    oldest_pending: Option<SystemTime>,
    node_eligible: bool,
    /// The first full sync is in the datapath.
    synced: bool,
    /// The datapath's self-check (`kpr verify`) found the programs deciding otherwise than
    /// the model, and a resync did not repair it.
    datapath_wrong: bool,
}

/// Shared between the sync loop (which reports) and the HTTP server (which answers).
#[derive(Debug)]
pub struct ProxyHealth {
    state: Mutex<State>,
    timeout: Duration,
    metrics: Arc<Metrics>,
}

/// kube-proxy's `ProxyHealth` JSON.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub last_updated: String,
    pub current_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_eligible: Option<bool>,
    pub healthy: bool,
    pub status: BTreeMap<&'static str, FamilyReport>,
    /// kpr's own, shown only as `false`: the datapath's self-check found the programs
    /// deciding otherwise than the model, and a resync did not mend it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub datapath_verified: Option<bool>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FamilyReport {
    pub last_updated: String,
    pub healthy: bool,
}

impl ProxyHealth {
    /// Healthy from the start (kube-proxy marks itself updated when its loop starts).
    pub fn new(timeout: Duration, metrics: Arc<Metrics>) -> Self {
        let state = State {
            last_updated: SystemTime::now(),
            oldest_pending: None,
            node_eligible: true,
            synced: false,
            datapath_wrong: false,
        };
        Self { state: Mutex::new(state), timeout, metrics }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A change arrived that the datapath does not have yet.
    pub fn queued_update(&self) {
        let mut state = self.state();
        state.oldest_pending.get_or_insert_with(SystemTime::now);
    }

    /// The datapath has every change received so far.
    pub fn updated(&self) {
        let mut state = self.state();
        state.oldest_pending = None;
        state.last_updated = SystemTime::now();
    }

    /// The first full sync (every Service and EndpointSlice the source listed) is in the
    /// datapath.
    pub fn synced(&self) {
        self.state().synced = true;
    }

    /// Whether the node may take load-balanced traffic (not being deleted, not tainted for
    /// deletion).
    pub fn set_node_eligible(&self, eligible: bool) {
        self.state().node_eligible = eligible;
    }

    /// The datapath's self-check: whether the live programs decide as the model says (after
    /// the resync a failure brings).
    pub fn set_datapath_verified(&self, agrees: bool) {
        self.state().datapath_wrong = !agrees;
    }

    /// The proxy's health at `now`, ignoring the node.
    pub fn healthy_at(&self, now: SystemTime) -> bool {
        self.healthy_in(&self.state(), now)
    }

    fn healthy_in(&self, state: &State, now: SystemTime) -> bool {
        state.oldest_pending.is_none_or(|since| now.duration_since(since).unwrap_or_default() < self.timeout)
    }

    /// The report and whether it is a 200; `with_node`: `/healthz`, which also needs the node.
    fn report(&self, with_node: bool) -> (bool, Report) {
        let now = SystemTime::now();
        let state = self.state();
        let healthy = self.healthy_in(&state, now);
        let node_eligible = with_node.then_some(state.node_eligible);
        // `/healthz` only: a wrong datapath takes the node out of load balancers' rotation; the
        // kubelet's probes (a restart would not mend it) stay as they are.
        let datapath_wrong = with_node && state.datapath_wrong;
        let ok = healthy && node_eligible != Some(false) && !datapath_wrong;
        let last_updated = rfc3339(state.last_updated);
        let status =
            FAMILIES.into_iter().map(|f| (f, FamilyReport { last_updated: last_updated.clone(), healthy })).collect();
        let report = Report {
            // A 200 reports "now" as the last update, as kube-proxy does for older clients.
            last_updated: if ok { rfc3339(now) } else { last_updated },
            current_time: rfc3339(now),
            node_eligible,
            healthy,
            status,
            datapath_verified: datapath_wrong.then_some(false),
        };
        (ok, report)
    }

    /// `/healthz`: the proxy's health and the node's eligibility.
    pub fn healthz(&self) -> (http::StatusCode, Report) {
        let (ok, report) = self.report(true);
        self.metrics.healthz(ok);
        (status(ok), report)
    }

    /// `/readyz`: synced once, and healthy (the node aside).
    pub fn readyz(&self) -> (http::StatusCode, Report) {
        let (ok, report) = self.report(false);
        (status(ok && self.state().synced), report)
    }

    /// `/livez`: the proxy's health only.
    pub fn livez(&self) -> (http::StatusCode, Report) {
        let (ok, report) = self.report(false);
        self.metrics.livez(ok);
        (status(ok), report)
    }
}

fn status(ok: bool) -> http::StatusCode {
    if ok { http::StatusCode::OK } else { http::StatusCode::SERVICE_UNAVAILABLE }
}

/// RFC 3339 with nanoseconds, as Go's `time.Time` marshals to JSON.
fn rfc3339(t: SystemTime) -> String {
    jiff::Timestamp::try_from(t).map(|t| t.to_string()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(timeout: Duration) -> ProxyHealth {
        ProxyHealth::new(timeout, Arc::new(Metrics::default()))
    }

    #[test]
    fn a_change_pending_past_the_timeout_is_unhealthy_until_applied() {
        let h = health(Duration::from_millis(50));
        assert_eq!(h.healthz().0, http::StatusCode::OK, "healthy while starting");
        h.queued_update();
        assert_eq!(h.livez().0, http::StatusCode::OK, "pending, but not late yet");
        std::thread::sleep(Duration::from_millis(80));
        h.queued_update(); // a later change does not reset the oldest one
        let (code, report) = h.livez();
        assert_eq!(code, http::StatusCode::SERVICE_UNAVAILABLE);
        assert!(!report.healthy && !report.status["IPv4"].healthy);
        assert_eq!(report.node_eligible, None, "/livez does not report the node");
        h.updated();
        assert_eq!(h.healthz().0, http::StatusCode::OK);
    }

    #[test]
    fn readyz_waits_for_the_first_full_sync_healthz_does_not() {
        let h = health(Duration::from_secs(60));
        assert_eq!(h.healthz().0, http::StatusCode::OK, "kube-proxy's /healthz: 200 while starting");
        assert_eq!(h.readyz().0, http::StatusCode::SERVICE_UNAVAILABLE, "not ready before the first sync");
        h.synced();
        assert_eq!(h.readyz().0, http::StatusCode::OK);
        let late = health(Duration::from_millis(10));
        late.synced();
        late.queued_update();
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(late.readyz().0, http::StatusCode::SERVICE_UNAVAILABLE, "a change late past the timeout");
    }

    #[test]
    fn a_node_being_deleted_fails_healthz_but_not_livez() {
        let h = health(Duration::from_secs(60));
        h.set_node_eligible(false);
        let (code, report) = h.healthz();
        assert_eq!(code, http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!((report.healthy, report.node_eligible), (true, Some(false)));
        assert_eq!(h.livez().0, http::StatusCode::OK);
        let json = serde_json::to_value(h.healthz().1).unwrap();
        for field in ["lastUpdated", "currentTime", "nodeEligible", "healthy", "status"] {
            assert!(json.get(field).is_some(), "{field} in {json}");
        }
        let now: jiff::Timestamp = json["currentTime"].as_str().unwrap().parse().expect("RFC 3339");
        assert!((jiff::Timestamp::now() - now).get_seconds() < 5);
    }
}
