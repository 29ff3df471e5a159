//! The datapath's self-check in the agent's loop ([`crate::verify`]): a run probes every
//! programmed frontend and source class, a chunk at a time between the loop's other work (a
//! run over 40,000 frontends takes a second or two, which must not hold back a Service
//! change). A probe decided otherwise than the model is logged and counted, and
//! brings a full resync (the maps, and the slow programs' slots); the failing frontends are
//! probed again at once, and what the resync did not mend fails `/healthz` until a run
//! passes.
use std::time::{Duration, Instant};

use proxy_common::ServiceKey;

use super::Syncer;
use crate::{
    datapath::{Maps, bpf::HostDatapath},
    verify::{Class, Failure, Probe, ProbeEnv, VerifyReport},
};

/// Probes per step of the loop: a few milliseconds.
const CHUNK: usize = 256;

/// What probing some frontends found.
struct Probed {
    probed: usize,
    /// Those that cannot be probed here.
    skipped: usize,
    failures: Vec<(ServiceKey, Failure)>,
}

/// A run under way.
pub(super) struct VerifyRun {
    run: u64,
    /// The frontends to probe (programmed when the run started), and the next one's place.
    keys: Vec<ServiceKey>,
    next: usize,
    probed: usize,
    skipped: usize,
    failures: Vec<(ServiceKey, Failure)>,
    /// The probes' time, the loop's other work between steps aside.
    busy: Duration,
    /// The node as the probes see it; `None`: no link holds the per-packet programs.
    env: Option<ProbeEnv>,
}

impl Syncer {
    /// Start a run, unless one is under way (a run asked for meanwhile is that one).
    pub fn start_verify(&mut self, host: &dyn HostDatapath) {
        if self.verify_run.is_some() {
            return;
        }
        let Some(shared) = &self.verify else { return };
        let run = shared.report.lock().map_or(0, |r| r.runs) + 1;
        let keys = self.programmer.programmed().keys().copied().collect();
        // Each client arrives by the link of the kernel's route back to it, as its packets
        // would (the programs check the reverse path as the kernel does).
        let route_to = |ip| crate::source::host::route(ip).filter(|r| !r.local).map(|r| r.link);
        let env = host.probe_env().map(|env| env.arriving_by(route_to));
        self.verify_run = Some(VerifyRun {
            run,
            keys,
            next: 0,
            probed: 0,
            skipped: 0,
            failures: Vec::new(),
            busy: Duration::ZERO,
            env,
        });
    }

    /// Whether a run is under way: [`Self::verify_step`] has work.
    pub fn verifying(&self) -> bool {
        self.verify_run.is_some()
    }

    /// Probe the next chunk of the run; the last one finishes it.
    pub fn verify_step(&mut self, maps: &mut dyn Maps, host: &mut dyn HostDatapath) {
        let Some(mut run) = self.verify_run.take() else { return };
        let started = Instant::now();
        let end = (run.next + CHUNK).min(run.keys.len());
        let chunk = self.probe_frontends(host, run.env.as_ref(), &run.keys[run.next..end], (run.run, run.next));
        run.busy += started.elapsed();
        match chunk {
            Err(problem) => self.finish_verify(run, Some(problem), maps, host),
            Ok(chunk) => {
                run.probed += chunk.probed;
                run.skipped += chunk.skipped;
                run.failures.extend(chunk.failures);
                run.next = end;
                if run.next < run.keys.len() {
                    self.verify_run = Some(run);
                } else {
                    self.finish_verify(run, None, maps, host);
                }
            }
        }
    }

    fn finish_verify(
        &mut self,
        run: VerifyRun,
        problem: Option<String>,
        maps: &mut dyn Maps,
        host: &mut dyn HostDatapath,
    ) {
        let Some(shared) = self.verify.clone() else { return };
        let mut report = VerifyReport {
            runs: run.run,
            probed: run.probed,
            skipped: run.skipped,
            elapsed_ms: run.busy.as_secs_f64() * 1e3,
            problem,
            ..VerifyReport::default()
        };
        if report.problem.is_none() {
            self.metrics.verified(run.probed, run.failures.len());
            tracing::info!(
                run = run.run,
                probed = run.probed,
                skipped = run.skipped,
                failures = run.failures.len(),
                elapsed_ms = report.elapsed_ms,
                "datapath self-check"
            );
            let mut agrees = run.failures.is_empty();
            if !agrees {
                for (_, f) in &run.failures {
                    tracing::warn!(
                        frontend = %f.frontend, class = ?f.class, service = %f.service,
                        expected = %f.expected, seen = %f.seen,
                        "the datapath decides otherwise than the model; resyncing"
                    );
                }
                if let Err(e) = host.restore_programs() {
                    tracing::warn!("failed to put the per-packet programs back: {e:#}");
                }
                // A reconcile keeps whole Maglev tables as they are: wrong slots are found by
                // the probes alone, so a failing Maglev frontend has the tables written anew.
                let programmed = self.programmer.programmed();
                let maglev_failed = run.failures.iter().any(|(key, _)| {
                    programmed.get(key).is_some_and(|p| p.value.flags & proxy_common::SERVICE_FLAG_MAGLEV != 0)
                });
                self.reconcile(maps, host);
                if maglev_failed {
                    self.programmer.rewrite_maglev_tables(maps);
                }
                let keys: Vec<ServiceKey> = run.failures.iter().map(|(key, _)| *key).collect();
                agrees = self
                    .probe_frontends(host, run.env.as_ref(), &keys, (run.run, run.keys.len()))
                    .is_ok_and(|again| again.failures.is_empty());
                if !agrees {
                    tracing::error!("a resync did not repair the datapath: /healthz fails until a run agrees");
                }
                report.repaired = Some(agrees);
            }
            report.failures = run.failures.into_iter().map(|(_, f)| f).collect();
            self.proxy_health.set_datapath_verified(agrees);
        }
        if let Ok(mut last) = shared.report.lock() {
            *last = report;
        }
    }

    /// Probe `keys` (those still programmed); `Err`: why nothing can be probed. `at`: the run
    /// and the first key's place in it.
    fn probe_frontends(
        &self,
        host: &mut dyn HostDatapath,
        env: Option<&ProbeEnv>,
        keys: &[ServiceKey],
        at: (u64, usize),
    ) -> Result<Probed, String> {
        if !self.synced_once {
            return Err("the first sync is not done yet".to_owned());
        }
        let env = env.ok_or("no link holds the per-packet programs, and the socket path is not probed")?;
        let programmed = self.programmer.programmed();
        let (probes, mut skipped) = crate::verify::probes(keys, programmed, env, at);
        // The node's own frontends through the socket hooks, the rest through the per-packet
        // program.
        let (mut node, packets): (Vec<Probe>, Vec<Probe>) = probes.into_iter().partition(|p| p.class == Class::Node);
        let mut outcomes = Vec::with_capacity(node.len() + packets.len());
        if !packets.is_empty() {
            let results = host.run_probes(&packets).map_err(|e| format!("{e:#}"))?;
            outcomes.extend(packets.iter().zip(results).map(|(p, (verdict, out))| p.outcome(verdict, &out)));
        }
        if !node.is_empty() {
            match host.run_socket_probes(&node) {
                Ok(results) => outcomes.extend(node.iter().zip(results).map(|(p, seen)| p.socket_outcome(&seen))),
                // (No cgroup the agent may move a process into, no CAP_NET_ADMIN): the per-packet
                // probes still count.
                Err(e) => {
                    tracing::warn!("the node's own frontends not probed: {e:#}");
                    skipped += node.len();
                    node.clear();
                }
            }
        }
        let probed = node.len() + packets.len();
        let failed: Vec<_> = packets
            .iter()
            .chain(&node)
            .zip(outcomes)
            .filter(|(probe, outcome)| !probe.agrees(outcome, &env.local_addrs))
            .collect();
        // Named only when one failed: the names are a copy of every Service port's.
        let names = if failed.is_empty() { Default::default() } else { self.metrics.service_port_names() };
        let failures = failed
            .into_iter()
            .map(|(probe, outcome)| {
                let id = programmed.get(&probe.frontend).map(|p| p.value.service_id);
                let service = id.and_then(|id| names.get(&id).cloned()).unwrap_or_default();
                (probe.frontend, Failure::new(probe, &outcome, service))
            })
            .collect();
        Ok(Probed { probed, skipped, failures })
    }
}
