//! `kpr verify`'s probes run through the live ingress program against the live maps
//! (`BPF_PROG_TEST_RUN`), and the flows they made taken back at once: nothing stays behind
//! but what any new connection leaves in the counters the programs keep per CPU and node
//! (service counters and events skip probes: `VERIFY_PROBE_MARK`).
use std::path::Path;

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{HashMap, Map},
    programs::{SchedClassifier, TestRun as _, TestRunOptions},
};
use proxy_common::{
    AFFINITY_BY_ADDR, Addr, AffinityKey, AffinityValue, CtKey, VERIFY_PROBE_MARK, map_names, program_names,
};

use super::pins::open_pinned_map;
use crate::{
    datapath::conntrack::Conntrack,
    verify::{Outcome, Probe},
};

/// The room a probe's answer may take (an ICMP error quotes the probe).
const OUT_ROOM: usize = 512;

/// Run each probe through the attached Ethernet ingress program: its verdict and the packet
/// it left. The probes' conntrack entries (both directions) and affinity entries are removed
/// after the run.
pub(super) fn run(ebpf: &Ebpf, pin_root: &Path, probes: &[Probe]) -> Result<Vec<(u32, Vec<u8>)>> {
    let prog: &SchedClassifier =
        ebpf.program(program_names::TC_INGRESS).context("the ingress program is not loaded")?.try_into()?;
    let mut conntrack = Conntrack::open(pin_root)?;
    let affinity = open_pinned_map(pin_root, map_names::AFFINITY)?;
    let mut affinity: HashMap<_, AffinityKey, AffinityValue> = HashMap::try_from(Map::LruHashMap(affinity))?;
    let mut results = Vec::with_capacity(probes.len());
    let mut flows = Vec::with_capacity(2 * probes.len());
    let mut run_one = |probe: &Probe| -> Result<(u32, Vec<u8>)> {
        let frame = probe.frame();
        let mut out = vec![0u8; frame.len() + OUT_ROOM];
        // `struct __sk_buff` up to `ifindex`: the mark at 8 and the link at 40, the rest zero.
        let mut ctx = [0u8; 44];
        ctx[8..12].copy_from_slice(&VERIFY_PROBE_MARK.to_ne_bytes());
        ctx[40..44].copy_from_slice(&probe.ifindex.to_ne_bytes());
        let opts = TestRunOptions {
            data_in: Some(&frame),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx[..]),
            ..TestRunOptions::default()
        };
        let result = prog.test_run(opts).context("BPF_PROG_TEST_RUN of the ingress program")?;
        out.truncate(result.data_size_out as usize);
        let (client, target) = (probe.client, probe.target);
        let key = |src: std::net::SocketAddr, dst: std::net::SocketAddr| {
            CtKey::new(src.ip().into(), dst.ip().into(), src.port().to_be(), dst.port().to_be(), probe.proto)
        };
        flows.push(key(client, target));
        if let Outcome::Forwarded { to, from } = probe.outcome(result.return_value, &out) {
            flows.push(key(to, from));
        }
        if probe.affinity_id != 0 {
            let client =
                AffinityKey { port_id: probe.affinity_id, kind: AFFINITY_BY_ADDR, client: Addr::from(client.ip()) };
            let _ = affinity.remove(&client);
        }
        Ok((result.return_value, out))
    };
    let mut failed = None;
    for probe in probes {
        match run_one(probe) {
            Ok(result) => results.push(result),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    // Whatever happened, the flows made so far go.
    conntrack.remove_flows(&flows).context("removing the probes' flows")?;
    match failed {
        Some(e) => Err(e),
        None => Ok(results),
    }
}
