//! Passive outlier detection (kubernetes#14399): an endpoint that stops answering new flows
//! while the API still calls it ready (its node died, its network broke) is sidelined: left out
//! of its Services' backends for new flows for a while, and put back on probation after it.
//!
//! Opt-in per Service (annotation [`OUTLIER_DETECTION`](super::service::OUTLIER_DETECTION)) and cluster-wide (`--outlier-detection`);
//! off, the backends are kube-proxy's. The signal is the per-packet path's: new flows still
//! unanswered past a grace (one observation period: a SYN-ACK takes a round trip), and the
//! first answers endpoints gave (a RST to a SYN is a refusal), both read from the datapath
//! each second ([`Observation`]). Sidelining is a change of the programmed backends, as when
//! an endpoint terminates: established flows keep their endpoint (conntrack), only new flows
//! pick among the others. Nothing is added per packet on established flows.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::SocketAddr,
    time::{Duration, Instant},
};

use super::{
    ObjectKey, Protocol,
    desired::{Desired, DesiredPort},
};

/// When an endpoint is sidelined, and for how long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutlierSettings {
    /// Services without the annotation take part (`--outlier-detection on`).
    pub default_on: bool,
    /// Failures are counted over this long (`--outlier-window`).
    pub window: Duration,
    /// Failures within the window, with no answer since the first of them, that sideline an
    /// endpoint (`--outlier-failures`).
    pub failures: u32,
    /// The first sidelining's length; each one again while on probation doubles it
    /// (`--outlier-max-backoff` caps it).
    pub backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for OutlierSettings {
    fn default() -> Self {
        Self {
            default_on: false,
            window: Duration::from_secs(10),
            failures: 5,
            backoff: Duration::from_secs(10),
            max_backoff: Duration::from_secs(300),
        }
    }
}

/// An endpoint as the datapath sees it: where its flows go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Endpoint {
    pub addr: SocketAddr,
    pub protocol: Protocol,
}

impl Endpoint {
    /// The endpoint a datapath key names (`KPR_BACKEND_ANSWERS`, `KPR_ENDPOINT_STATS`).
    pub fn of_key(key: &proxy_common::BackendKey) -> Option<Self> {
        let protocol = Protocol::from_ipproto(key.proto)?;
        Some(Self { addr: SocketAddr::new(key.addr.into(), u16::from_be(key.port)), protocol })
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.protocol)
    }
}

/// What the datapath shows of the watched endpoints at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observation {
    /// The endpoints looked at (the watched ones when it was taken): an endpoint outside
    /// them has no news here, whatever the maps below say of it.
    pub covered: BTreeSet<Endpoint>,
    /// The new per-packet flows to each endpoint that it has not answered yet, one id per flow
    /// (stable while the flow lives).
    pub unanswered: BTreeMap<Endpoint, BTreeSet<u64>>,
    /// Each endpoint's first answers to new flows so far (counters that only grow, unless
    /// the datapath's map was made anew).
    pub answers: BTreeMap<Endpoint, Answers>,
}

/// How an endpoint answered new flows, counted since the datapath's map was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Answers {
    /// Per-packet flows and socket-path connects answered.
    pub answered: u64,
    /// Refused (a RST to a SYN), on either path.
    pub refused: u64,
    /// Socket-path connects left unanswered (their SYN retransmitted, or given up); the
    /// per-packet path's are [`Observation::unanswered`].
    pub unanswered: u64,
}

impl Answers {
    /// What grew since `before`: counters below it mean the map was made anew (an upgrade),
    /// and all are news.
    fn since(self, before: Self) -> Self {
        let grew = |now: u64, before: u64| if now >= before { now - before } else { now };
        Self {
            answered: grew(self.answered, before.answered),
            refused: grew(self.refused, before.refused),
            unanswered: grew(self.unanswered, before.unanswered),
        }
    }
}

/// What became of an endpoint with an observation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Left out of new flows for this long (unless every endpoint of the Service's port is).
    Sidelined { endpoint: Endpoint, failures: u32, backoff: Duration },
    /// Back among the backends, on probation for a window: a failure in it sidelines it again
    /// for twice as long; an answer ends it.
    Returned { endpoint: Endpoint },
}

/// One endpoint's record, from when a Service that opted in has it.
#[derive(Clone, Debug, Default)]
struct Health {
    /// The first observation that covered it has set the baselines below: what it showed
    /// (answers counted before, flows already waiting) is not news.
    baseline: bool,
    /// When each failure in the window was seen, oldest first; emptied by an answer.
    failures: Vec<Instant>,
    /// The flows seen unanswered at the last observation, and those already counted as failed.
    pending: BTreeSet<u64>,
    counted: BTreeSet<u64>,
    /// The answer counters at the last observation.
    answers: Answers,
    /// Sidelined until then.
    sidelined_until: Option<Instant>,
    /// Returned from a sidelining then: a failure within a window of it sidelines it again,
    /// unless an answer came first.
    probation_since: Option<Instant>,
    /// The next sidelining's length, and the last return: a window without failure since
    /// both the last failure and the return puts it back to the first length.
    next_backoff: Duration,
    returned_at: Option<Instant>,
    last_failure: Option<Instant>,
}

/// The endpoints' records, and the Services that watch each.
#[derive(Debug, Default)]
pub struct Outliers {
    pub settings: OutlierSettings,
    health: BTreeMap<Endpoint, Health>,
    /// The opted-in Services each endpoint backs, as of the last [`Outliers::sideline`].
    services: BTreeMap<Endpoint, BTreeSet<ObjectKey>>,
    /// The endpoints the last [`Outliers::sideline`] left out, with the Service.
    left_out: BTreeSet<Sidelined>,
}

impl Outliers {
    pub fn new(settings: OutlierSettings) -> Self {
        Self { settings, ..Default::default() }
    }

    /// The endpoints whose flows are to be observed: those of opted-in Services, as of the
    /// last [`Self::sideline`].
    pub fn watched(&self) -> BTreeSet<Endpoint> {
        self.services.keys().copied().collect()
    }

    /// No endpoint is watched (no opted-in Service has any): nothing to sideline.
    pub fn watched_nothing(&self) -> bool {
        self.services.is_empty()
    }

    /// The opted-in Services `endpoint` backs.
    pub fn services_of(&self, endpoint: &Endpoint) -> impl Iterator<Item = &ObjectKey> {
        self.services.get(endpoint).into_iter().flatten()
    }

    /// The endpoints the last [`Self::sideline`] left out of their Services' backends (not a
    /// sidelined endpoint its port kept, all of its endpoints being sidelined).
    pub fn sidelined(&self) -> &BTreeSet<Sidelined> {
        &self.left_out
    }

    pub fn is_sidelined(&self, endpoint: &Endpoint) -> bool {
        self.health.get(endpoint).is_some_and(|h| h.sidelined_until.is_some())
    }

    /// Take in what the datapath shows at `now`, and say what changed: endpoints sidelined,
    /// and endpoints whose sidelining is over.
    pub fn observe(&mut self, now: Instant, seen: &Observation) -> Vec<Change> {
        let settings = self.settings;
        let mut changes = Vec::new();
        for (endpoint, health) in self.health.iter_mut().filter(|(e, _)| seen.covered.contains(*e)) {
            let endpoint = *endpoint;
            let answers = seen.answers.get(&endpoint).copied().unwrap_or_default();
            let unanswered = seen.unanswered.get(&endpoint).cloned().unwrap_or_default();
            if !health.baseline {
                health.baseline = true;
                health.answers = answers;
                health.counted = unanswered.clone();
                health.pending = unanswered;
                continue;
            }
            let news = answers.since(health.answers);
            health.answers = answers;
            // A flow unanswered at two observations in a row has waited past the grace.
            let late = unanswered.intersection(&health.pending).filter(|f| !health.counted.contains(f)).count();
            health.counted = health
                .counted
                .intersection(&unanswered)
                .copied()
                .chain(unanswered.intersection(&health.pending).copied())
                .collect();
            health.pending = unanswered;
            let failed = late
                .saturating_add(usize::try_from(news.refused.saturating_add(news.unanswered)).unwrap_or(usize::MAX));
            if failed > 0 {
                health.last_failure = Some(now);
            }
            if news.answered > 0 && news.answered >= failed as u64 {
                // Answers, at least as many as failures since the last observation (whose
                // order among them is unknown): the run is broken, probation is over. An
                // endpoint that loses a SYN now and then among many answers stays.
                health.failures.clear();
                health.probation_since = None;
            } else {
                health.failures.extend(std::iter::repeat_n(now, failed));
            }
            health.failures.retain(|at| now.duration_since(*at) < settings.window);
            let on_probation = health.probation_since.is_some_and(|at| now.duration_since(at) < settings.window);
            if !on_probation {
                health.probation_since = None;
            }
            let quiet_since = health.last_failure.max(health.returned_at);
            if quiet_since.is_none_or(|at| now.duration_since(at) >= settings.window)
                && health.sidelined_until.is_none()
            {
                health.next_backoff = settings.backoff;
            }
            match health.sidelined_until {
                Some(until) if now >= until => {
                    health.sidelined_until = None;
                    health.probation_since = Some(now);
                    health.returned_at = Some(now);
                    health.failures.clear();
                    changes.push(Change::Returned { endpoint });
                }
                Some(_) => {}
                None => {
                    let count = health.failures.len() as u32;
                    if count >= settings.failures.max(1) || (on_probation && failed > 0) {
                        let backoff = health.next_backoff;
                        health.sidelined_until = Some(now + backoff);
                        health.next_backoff = (backoff * 2).min(settings.max_backoff);
                        health.probation_since = None;
                        health.failures.clear();
                        changes.push(Change::Sidelined { endpoint, failures: count.max(1), backoff });
                    }
                }
            }
        }
        changes
    }

    /// Leave the sidelined endpoints out of the backends of the opted-in Services' ports in
    /// `desired` (`opted_in` says which Services are), and note which endpoints those ports
    /// have (the ones to watch; an endpoint that joins them starts a record, one that leaves
    /// them is forgotten, so a later comeback starts afresh).
    pub fn sideline(&mut self, desired: &mut Desired, opted_in: impl Fn(&ObjectKey) -> bool) {
        let mut services: BTreeMap<Endpoint, BTreeSet<ObjectKey>> = BTreeMap::new();
        let mut verdicts: BTreeMap<ObjectKey, bool> = BTreeMap::new();
        for port in desired.values() {
            let service = &port.name.service;
            if *verdicts.entry(service.clone()).or_insert_with(|| opted_in(service)) {
                for endpoint in endpoints(port) {
                    services.entry(endpoint).or_default().insert(service.clone());
                }
            }
        }
        let left_out = leave_out(desired, |service, endpoint| verdicts[service] && self.is_sidelined(endpoint));
        self.left_out = left_out
            .into_iter()
            .map(|(service, endpoint)| Sidelined {
                namespace: service.namespace,
                service: service.name,
                endpoint: endpoint.to_string(),
            })
            .collect();
        self.health.retain(|endpoint, _| services.contains_key(endpoint));
        for endpoint in services.keys() {
            self.health
                .entry(*endpoint)
                .or_insert_with(|| Health { next_backoff: self.settings.backoff, ..Default::default() });
        }
        self.services = services;
    }
}

/// A port's backends as endpoints.
fn endpoints(port: &DesiredPort) -> impl Iterator<Item = Endpoint> + '_ {
    let protocol = port.name.protocol;
    port.backends.iter().map(move |(ip, port)| Endpoint { addr: SocketAddr::new(*ip, *port), protocol })
}

/// Leave the endpoints `out` names for a Service out of its ports' backends in `desired`: the
/// (Service, endpoint) pairs left out. A port keeps all its endpoints when all are out: when
/// every endpoint fails, leaving them out helps no client.
pub fn leave_out(
    desired: &mut Desired,
    out: impl Fn(&ObjectKey, &Endpoint) -> bool,
) -> BTreeSet<(ObjectKey, Endpoint)> {
    let mut left_out = BTreeSet::new();
    for port in desired.values_mut() {
        let service = port.name.service.clone();
        let kept: Vec<bool> = endpoints(port).map(|e| !out(&service, &e)).collect();
        if kept.contains(&true) && kept.contains(&false) {
            left_out.extend(endpoints(port).zip(&kept).filter(|(_, k)| !**k).map(|(e, _)| (service.clone(), e)));
            let mut kept = kept.into_iter();
            port.backends.retain(|_| kept.next().unwrap_or(true));
        }
    }
    left_out
}

/// An endpoint a running agent has sidelined for a Service (its `/sidelined`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Sidelined {
    pub namespace: String,
    pub service: String,
    /// As [`Endpoint`] shows it: `10.244.2.2:8080/TCP`.
    pub endpoint: String,
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::model::ServicePortName;

    fn ep(last: u8) -> Endpoint {
        Endpoint { addr: SocketAddr::new(IpAddr::from([10, 0, 0, last]), 8080), protocol: Protocol::Tcp }
    }

    fn desired(backends: &[u8], service: &str) -> Desired {
        let port = DesiredPort {
            name: ServicePortName {
                service: ObjectKey::new("default", service),
                port: String::new(),
                protocol: Protocol::Tcp,
            },
            backends: backends.iter().map(|b| (IpAddr::from([10, 0, 0, *b]), 8080)).collect(),
            flags: 0,
            source_ranges: Vec::new(),
            affinity_timeout: 0,
            serving: Vec::new(),
            alive: None,
            remote: Vec::new(),
        };
        let key = crate::model::desired::service_key(std::net::Ipv4Addr::new(10, 96, 0, 1), 80, Protocol::Tcp);
        Desired::from([(key, port)])
    }

    fn backends(desired: &Desired) -> Vec<u8> {
        let port = desired.values().next().unwrap();
        port.backends
            .iter()
            .map(|(ip, _)| match ip {
                IpAddr::V4(v4) => v4.octets()[3],
                IpAddr::V6(_) => unreachable!(),
            })
            .collect()
    }

    /// The endpoints the tests' observations cover.
    fn covered() -> BTreeSet<Endpoint> {
        (1..=3).map(ep).collect()
    }

    /// Flows `ids` to `endpoint` unanswered.
    fn unanswered(endpoint: Endpoint, ids: impl IntoIterator<Item = u64>) -> Observation {
        let unanswered = BTreeMap::from([(endpoint, ids.into_iter().collect())]);
        Observation { covered: covered(), unanswered, answers: BTreeMap::new() }
    }

    /// Per-packet answers and refusals counted so far.
    fn answers(answered: u64, refused: u64) -> Answers {
        Answers { answered, refused, unanswered: 0 }
    }

    /// Socket-path counts of `endpoint` so far, and no per-packet flow waiting.
    fn socket_counts(endpoint: Endpoint, answered: u64, refused: u64, unanswered: u64) -> Observation {
        Observation { answers: BTreeMap::from([(endpoint, Answers { answered, refused, unanswered })]), ..nothing() }
    }

    /// An observation without news.
    fn nothing() -> Observation {
        Observation { covered: covered(), ..Default::default() }
    }

    /// Watching the endpoints `backends` of Service "web", the baseline taken.
    fn watching(backends: &[u8]) -> Outliers {
        let mut outliers = Outliers::new(OutlierSettings::default());
        outliers.sideline(&mut desired(backends, "web"), |_| true);
        assert!(outliers.observe(Instant::now(), &nothing()).is_empty());
        outliers
    }

    #[test]
    fn an_endpoint_that_leaves_five_flows_unanswered_past_the_grace_is_sidelined_and_left_out() {
        let mut outliers = watching(&[1, 2, 3]);
        let t0 = Instant::now();
        // Flows 1..=5 seen unanswered once: within the grace, nothing yet.
        assert!(outliers.observe(t0, &unanswered(ep(2), 1..=5)).is_empty());
        // Still unanswered a second later: five failures.
        let changes = outliers.observe(t0 + Duration::from_secs(1), &unanswered(ep(2), 1..=6));
        assert_eq!(changes, vec![Change::Sidelined { endpoint: ep(2), failures: 5, backoff: Duration::from_secs(10) }]);
        let mut want = desired(&[1, 2, 3], "web");
        outliers.sideline(&mut want, |_| true);
        assert_eq!(backends(&want), [1, 3]);
        let listed =
            Sidelined { namespace: "default".into(), service: "web".into(), endpoint: "10.0.0.2:8080/TCP".into() };
        assert_eq!(outliers.sidelined(), &BTreeSet::from([listed]));
        // No longer opted in: kube-proxy's backends, and the records forgotten (the metric and
        // `/sidelined` follow `sidelined()`).
        let mut other = desired(&[1, 2, 3], "web");
        outliers.sideline(&mut other, |_| false);
        assert_eq!(backends(&other), [1, 2, 3]);
        assert!(outliers.watched().is_empty() && !outliers.is_sidelined(&ep(2)));
        assert!(outliers.sidelined().is_empty());
    }

    #[test]
    fn socket_path_connects_left_unanswered_or_refused_are_failures_at_once() {
        let mut outliers = watching(&[1, 2, 3]);
        let t0 = Instant::now();
        // Counted by the programs once retransmitted or given up on: no grace here. Three
        // failures among four answers: the run is broken.
        assert!(outliers.observe(t0, &socket_counts(ep(2), 4, 1, 2)).is_empty());
        assert!(outliers.observe(t0 + Duration::from_secs(1), &socket_counts(ep(2), 4, 2, 5)).is_empty(), "4 < 5");
        let changes = outliers.observe(t0 + Duration::from_secs(2), &socket_counts(ep(2), 4, 2, 6));
        assert_eq!(changes, vec![Change::Sidelined { endpoint: ep(2), failures: 5, backoff: Duration::from_secs(10) }]);
        // The per-packet path's flows and the socket path's counts add up.
        let mut seen = unanswered(ep(3), 1..=3);
        outliers.observe(t0 + Duration::from_secs(3), &seen);
        seen.answers.insert(ep(3), Answers { answered: 0, refused: 0, unanswered: 2 });
        let changes = outliers.observe(t0 + Duration::from_secs(4), &seen);
        assert_eq!(changes, vec![Change::Sidelined { endpoint: ep(3), failures: 5, backoff: Duration::from_secs(10) }]);
    }

    #[test]
    fn a_flow_is_counted_once_and_an_answer_breaks_the_run() {
        let mut outliers = watching(&[1, 2]);
        let t0 = Instant::now();
        outliers.observe(t0, &unanswered(ep(1), 1..=3));
        // Three late flows, seen again and again: three failures, not nine.
        for s in 1..=3 {
            assert!(outliers.observe(t0 + Duration::from_secs(s), &unanswered(ep(1), 1..=3)).is_empty());
        }
        // An answer: the run starts over, so four more failures do not reach five.
        let mut seen = unanswered(ep(1), 10..=13);
        seen.answers.insert(ep(1), answers(1, 0));
        assert!(outliers.observe(t0 + Duration::from_secs(4), &seen).is_empty());
        let mut seen = unanswered(ep(1), 10..=13);
        seen.answers.insert(ep(1), answers(1, 0));
        assert!(outliers.observe(t0 + Duration::from_secs(5), &seen).is_empty(), "4 failures since the answer");
        // Refusals (RSTs to SYNs) count as failures: one more makes five.
        seen.answers.insert(ep(1), answers(1, 1));
        let changes = outliers.observe(t0 + Duration::from_secs(6), &seen);
        assert!(matches!(changes[..], [Change::Sidelined { failures: 5, .. }]), "{changes:?}");
    }

    #[test]
    fn an_endpoint_that_answers_more_than_it_fails_stays() {
        let mut outliers = watching(&[1, 2]);
        let t0 = Instant::now();
        let mut answered = 0;
        for s in 0..20u64 {
            // Each second: two new flows late, and fifty answered.
            answered += 50;
            let mut seen = unanswered(ep(1), [2 * s, 2 * s + 1]);
            seen.unanswered.get_mut(&ep(1)).unwrap().extend([2 * s + 2, 2 * s + 3]);
            seen.answers.insert(ep(1), answers(answered, 0));
            assert!(outliers.observe(t0 + Duration::from_secs(s), &seen).is_empty(), "second {s}");
        }
        // Answering fewer than it fails: the failures run on.
        let mut seen = unanswered(ep(1), 100..=105);
        seen.answers.insert(ep(1), answers(answered, 0));
        outliers.observe(t0 + Duration::from_secs(20), &seen);
        seen.answers.insert(ep(1), answers(answered + 1, 0));
        let changes = outliers.observe(t0 + Duration::from_secs(21), &seen);
        assert!(matches!(changes[..], [Change::Sidelined { failures: 6, .. }]), "{changes:?}");
    }

    #[test]
    fn failures_older_than_the_window_do_not_count() {
        let mut outliers = watching(&[1, 2]);
        let t0 = Instant::now();
        outliers.observe(t0, &unanswered(ep(1), 1..=4));
        assert!(outliers.observe(t0 + Duration::from_secs(1), &unanswered(ep(1), 1..=4)).is_empty());
        // Four failures 11 s ago and one now: one in the window.
        outliers.observe(t0 + Duration::from_secs(11), &unanswered(ep(1), [9]));
        assert!(outliers.observe(t0 + Duration::from_secs(12), &unanswered(ep(1), [9])).is_empty());
    }

    #[test]
    fn the_sidelining_ends_after_the_backoff_and_a_failure_on_probation_doubles_it() {
        let mut outliers = watching(&[1, 2]);
        let t0 = Instant::now();
        outliers.observe(t0, &unanswered(ep(1), 1..=5));
        outliers.observe(t0 + Duration::from_secs(1), &unanswered(ep(1), 1..=5));
        assert!(outliers.is_sidelined(&ep(1)));
        assert!(outliers.observe(t0 + Duration::from_secs(10), &nothing()).is_empty());
        let back = outliers.observe(t0 + Duration::from_secs(11), &nothing());
        assert_eq!(back, vec![Change::Returned { endpoint: ep(1) }]);
        let mut want = desired(&[1, 2], "web");
        outliers.sideline(&mut want, |_| true);
        assert_eq!(backends(&want), [1, 2], "back among the backends");
        // On probation one late flow is enough, and the next sidelining is twice as long.
        outliers.observe(t0 + Duration::from_secs(12), &unanswered(ep(1), [20]));
        let changes = outliers.observe(t0 + Duration::from_secs(13), &unanswered(ep(1), [20]));
        assert_eq!(changes, vec![Change::Sidelined { endpoint: ep(1), failures: 1, backoff: Duration::from_secs(20) }]);
        // Returned again, it answers: probation over, and a window later the back-off is reset.
        let back = outliers.observe(t0 + Duration::from_secs(33), &nothing());
        assert_eq!(back, vec![Change::Returned { endpoint: ep(1) }]);
        let answered = Observation { answers: BTreeMap::from([(ep(1), answers(1, 0))]), ..nothing() };
        outliers.observe(t0 + Duration::from_secs(34), &answered);
        outliers.observe(t0 + Duration::from_secs(50), &answered);
        outliers.observe(t0 + Duration::from_secs(51), &unanswered(ep(1), 30..=34));
        let changes = outliers.observe(t0 + Duration::from_secs(52), &unanswered(ep(1), 30..=34));
        assert_eq!(changes, vec![Change::Sidelined { endpoint: ep(1), failures: 5, backoff: Duration::from_secs(10) }]);
    }

    #[test]
    fn a_port_whose_endpoints_are_all_sidelined_keeps_them_all() {
        let mut outliers = watching(&[1, 2]);
        let t0 = Instant::now();
        let both = |ids: std::ops::RangeInclusive<u64>| Observation {
            unanswered: BTreeMap::from([(ep(1), ids.clone().collect()), (ep(2), ids.map(|i| i + 100).collect())]),
            ..nothing()
        };
        outliers.observe(t0, &both(1..=5));
        assert_eq!(outliers.observe(t0 + Duration::from_secs(1), &both(1..=5)).len(), 2);
        let mut want = desired(&[1, 2], "web");
        outliers.sideline(&mut want, |_| true);
        assert_eq!(backends(&want), [1, 2]);
        assert!(outliers.sidelined().is_empty(), "none is left out");
    }

    #[test]
    fn an_endpoint_that_fails_again_soon_after_its_return_is_sidelined_for_longer() {
        let mut outliers = watching(&[1, 2]);
        let t0 = Instant::now();
        outliers.observe(t0, &unanswered(ep(1), 1..=5));
        outliers.observe(t0 + Duration::from_secs(1), &unanswered(ep(1), 1..=5));
        assert_eq!(
            outliers.observe(t0 + Duration::from_secs(11), &nothing()),
            vec![Change::Returned { endpoint: ep(1) }]
        );
        // An answer ends its probation, but the time it was sidelined is no quiet window: five
        // failures right after sideline it for twice as long.
        outliers.observe(
            t0 + Duration::from_secs(12),
            &Observation { answers: BTreeMap::from([(ep(1), answers(1, 0))]), ..nothing() },
        );
        let mut seen = unanswered(ep(1), 40..=44);
        seen.answers.insert(ep(1), answers(1, 0));
        outliers.observe(t0 + Duration::from_secs(13), &seen);
        let changes = outliers.observe(t0 + Duration::from_secs(14), &seen);
        assert_eq!(changes, vec![Change::Sidelined { endpoint: ep(1), failures: 5, backoff: Duration::from_secs(20) }]);
    }

    #[test]
    fn what_was_there_before_watching_began_is_not_news() {
        let mut outliers = Outliers::new(OutlierSettings::default());
        let t0 = Instant::now();
        let old = Observation {
            answers: BTreeMap::from([(ep(1), answers(40, 7))]),
            unanswered: BTreeMap::from([(ep(1), (1..=5).collect())]),
            ..nothing()
        };
        // Not watched yet: nothing recorded.
        assert!(outliers.observe(t0, &old).is_empty());
        outliers.sideline(&mut desired(&[1, 2], "web"), |_| true);
        // An observation taken before the endpoint was watched (it does not cover it) says
        // nothing of it, whatever it holds.
        let before = Observation { covered: BTreeSet::new(), ..Default::default() };
        assert!(outliers.observe(t0 + Duration::from_secs(1), &before).is_empty());
        // The first that covers it takes the counters and the waiting flows as they stand:
        // seven old refusals and five old flows are no failures.
        assert!(outliers.observe(t0 + Duration::from_secs(2), &old).is_empty());
        assert!(outliers.observe(t0 + Duration::from_secs(3), &old).is_empty());
        assert!(!outliers.is_sidelined(&ep(1)));
        // A refusal after that is news.
        let mut seen = old.clone();
        seen.answers.insert(ep(1), answers(40, 8));
        assert!(outliers.observe(t0 + Duration::from_secs(4), &seen).is_empty());
        assert_eq!(outliers.health[&ep(1)].failures.len(), 1);
    }
}
