//! Packets per second through a NodePort on one core (issue 47's XDP part): kpr's XDP program
//! (`--xdp native`) against its tc path, kube-proxy's iptables rules and the direct path.
//!
//! ```text
//!  gen netns: g0 ══ veth ══ n0: node netns (10.0.0.1), kpr (tc; XDP in its rounds)
//!   the kernel's XDP generator            a NodePort flow's segments to an endpoint on another
//!   (BPF_PROG_TEST_RUN, live frames)      node (10.244.1.2 via 10.0.0.2, behind n0): back out
//!   sends a flow's segment N times        of n0, translated (masqueraded), to g0, which counts
//!   into n0; g0's XDP drops what comes    and drops them in its XDP (a wire's far end)
//!   back
//! ```
//!
//! Everything runs on the generating CPU: the generator's batches, n0's NAPI (the path under
//! test) and g0's (the sink), so a path's rate is what one core does, the generator's and the
//! sink's shares alike for every path. Between rounds only n0's XDP program changes: kpr's, or
//! a stub passing every frame to the stack (veth drains a peer's frames only into an XDP
//! program), where tc (kpr), netfilter (kube-proxy's rules) or plain forwarding (direct) take
//! it. The frames carry complete checksums, as from a wire.
use std::{net::Ipv4Addr, time::Instant};

use anyhow::{Context as _, Result, bail};
use kpr::{
    datapath::{
        Programmer,
        bpf::{self, BpfDatapath, DatapathConfig, HostDatapath as _},
    },
    model::{
        ObjectKey, Protocol, ServicePortName,
        desired::{Desired, DesiredPort},
        node::{NodeSettings, TcLinks},
    },
};
use serde_json::json;
use testbed::Cgroup;

use super::{BENCH_PORT, kube_proxy_node_port_rules, median};

const GEN_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x99];
const NODE_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 99);
const NODE: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const ENDPOINT: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;

/// An Ethernet (g0 → n0) + IPv4 + TCP frame of 64 bytes (10 of payload: the Ethernet
/// minimum less its FCS), checksums complete.
fn frame(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> [u8; kpr_tests::GENERATED_FRAME_LEN] {
    let payload = kpr_tests::GENERATED_FRAME_LEN - 14 - 20 - 20;
    let fold = |mut sum: u32| {
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    };
    let words = |bytes: &[u8]| -> u32 {
        bytes.chunks(2).map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]))).sum()
    };
    let mut tcp = vec![0u8; 20 + payload];
    tcp[0..2].copy_from_slice(&sport.to_be_bytes());
    tcp[2..4].copy_from_slice(&dport.to_be_bytes());
    tcp[4..8].copy_from_slice(&1001u32.to_be_bytes());
    tcp[8..12].copy_from_slice(&7001u32.to_be_bytes());
    tcp[12] = 0x50;
    tcp[13] = flags;
    tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
    let pseudo = words(&src.octets()) + words(&dst.octets()) + 6 + tcp.len() as u32;
    let check = fold(pseudo + words(&tcp));
    tcp[16..18].copy_from_slice(&check.to_be_bytes());
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&((20 + tcp.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0x12, 0x34, 0x40, 0, 64, 6, 0, 0]);
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let check = fold(words(&ip));
    ip[10..12].copy_from_slice(&check.to_be_bytes());
    [&NODE_MAC[..], &GEN_MAC[..], &[0x08, 0x00], &ip, &tcp].concat().try_into().expect("64 bytes")
}

/// Packets per second of each path (the median of `rounds` alternating rounds of `packets`
/// frames of 64 bytes each way), and XDP's ratio to tc.
pub fn node_port_pps(rounds: usize, packets: u32) -> Result<serde_json::Value> {
    let name = testbed::unique_name("kb-pps");
    let generator_ns = testbed::Netns::new(&format!("{name}-gen"))?;
    let node = testbed::Netns::new(&format!("{name}-node"))?;
    let mac = |m: [u8; 6]| m.map(|b| format!("{b:02x}")).join(":");
    generator_ns.ip(&[
        "link",
        "add",
        "g0",
        "address",
        &mac(GEN_MAC),
        "type",
        "veth",
        "peer",
        "name",
        "n0",
        "address",
        &mac(NODE_MAC),
        "netns",
        &node.name,
    ])?;
    generator_ns.ip_batch(["addr add 10.0.0.99/24 dev g0", "link set g0 up"])?;
    node.ip_batch([
        "addr add 10.0.0.1/24 dev n0".to_owned(),
        "link set n0 up".to_owned(),
        // The endpoint's node, behind n0 (a neighbour that is never asked: nothing answers).
        "route add 10.244.1.0/24 via 10.0.0.2".to_owned(),
        "neigh add 10.0.0.2 lladdr 02:00:00:00:00:02 dev n0 nud permanent".to_owned(),
        format!("neigh add {CLIENT} lladdr {} dev n0 nud permanent", mac(GEN_MAC)),
    ])?;
    node.route_packets()?;
    // Forwarded back out of the link it came by: no ICMP redirect for each.
    node.sh("echo 0 > /proc/sys/net/ipv4/conf/all/send_redirects; echo 0 > /proc/sys/net/ipv4/conf/n0/send_redirects")?;
    // kube-proxy's rules for NodePort 30090 (masqueraded, as kpr's 30080).
    node.sh(&kube_proxy_node_port_rules("iptables", &ENDPOINT.to_string()))?;

    let cgroup = Cgroup::new(&name)?;
    let pins = testbed::PinRoot(std::path::PathBuf::from(format!("/sys/fs/bpf/{name}")));
    let mut cfg = DatapathConfig::new(pins.0.clone(), cgroup.path.clone());
    cfg.xdp = bpf::XdpSetting::Native;
    let settings = NodeSettings {
        name: "bench".into(),
        node_ips: vec![NODE.into()],
        tc_links: TcLinks::Only(vec!["n0".into()]),
        ..Default::default()
    };
    let (mut datapath, with_xdp) = node.run(move || -> Result<_> {
        let mut datapath = BpfDatapath::load(&cfg)?;
        let plan = kpr::model::node::plan(&kpr::source::host::snapshot()?, None, &settings);
        anyhow::ensure!(plan.xdp_links.values().any(|l| l == "n0"), "n0 is not an external link: {plan:?}");
        datapath.host.apply_node(&plan)?;
        Ok((datapath, plan))
    })??;
    let without_xdp = kpr::model::node::NodePlan { xdp_links: Default::default(), ..with_xdp.clone() };
    let apply = |mut datapath: BpfDatapath, plan: kpr::model::node::NodePlan| -> Result<BpfDatapath> {
        node.run(move || datapath.host.apply_node(&plan).map(|()| datapath))?
    };
    let np =
        kpr::model::desired::frontend_key(Ipv4Addr::UNSPECIFIED, 30080, Protocol::Tcp, proxy_common::SCOPE_EXTERNAL);
    let port_name =
        ServicePortName { service: ObjectKey::new("bench", "np"), port: String::new(), protocol: Protocol::Tcp };
    let endpoint = DesiredPort {
        name: port_name,
        backends: vec![(ENDPOINT.into(), BENCH_PORT)],
        flags: proxy_common::SERVICE_FLAG_SNAT,
        source_ranges: vec![],
        affinity_timeout: 0,
        serving: vec![],
        alive: None,
        remote: vec![ENDPOINT.into()],
    };
    Programmer::recover(&mut datapath.maps)?.apply(&Desired::from([(np, endpoint)]), &mut datapath.maps);

    // The sink; the generator sends a frame out of g0 (its program runs on frames, on no link).
    let sink = generator_ns.run(|| kpr_tests::attach_xdp_stub("g0", XDP_DROP))??;
    // SAFETY: a NUL-terminated name.
    let g0 = generator_ns.run(|| unsafe { libc::if_nametoindex(c"g0".as_ptr()) })?;
    let send = |frame: [u8; kpr_tests::GENERATED_FRAME_LEN], n: u32| -> Result<()> {
        let generator = kpr_tests::xdp_generator(&frame)?;
        generator_ns.run(move || kpr_tests::xdp_live_frames(&generator, &frame, g0, n))?
    };
    let received = || -> Result<u64> {
        let out = std::process::Command::new("ip")
            .args(["-n", &generator_ns.name, "-j", "-s", "link", "show", "g0"])
            .output()?;
        let links: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        links[0]["stats64"]["rx"]["packets"].as_u64().context("g0's received packets")
    };

    // kpr's flow, opened as on the wire: the SYN (tc: the endpoint, a SNAT port), the
    // endpoint's answer to that port, the client's ACK (established).
    send(frame(CLIENT, 40000, NODE, 30080, proxy_common::TCP_SYN), 1)?;
    let conntrack = kpr::datapath::conntrack::Conntrack::open(&pins.0)?;
    let (_, opened) = conntrack
        .new_flow_entries()
        .into_iter()
        .find(|(k, _)| k.src_port == 40000u16.to_be() && k.dst_port == 30080u16.to_be())
        .context("the SYN opened no flow")?;
    let snat_port = u16::from_be(opened.src_port);
    let answer = frame(ENDPOINT, BENCH_PORT, NODE, snat_port, proxy_common::TCP_SYN | proxy_common::TCP_ACK);
    send(answer, 1)?;
    send(frame(CLIENT, 40000, NODE, 30080, proxy_common::TCP_ACK), 1)?;
    let to_kpr = frame(CLIENT, 40000, NODE, 30080, proxy_common::TCP_ACK | proxy_common::TCP_PSH);
    // kube-proxy's and the direct path's flows: conntrack takes a TCP flow up mid-stream.
    let to_kube_proxy = frame(CLIENT, 40001, NODE, 30090, proxy_common::TCP_ACK | proxy_common::TCP_PSH);
    let direct = frame(CLIENT, 40002, ENDPOINT, BENCH_PORT, proxy_common::TCP_ACK | proxy_common::TCP_PSH);
    let xdp_forwarded =
        || -> Result<u64> { Ok(bpf::read_counters(&pins.0)?[proxy_common::counter::XDP_FORWARDED as usize].1) };

    let paths: [(&str, &[u8; kpr_tests::GENERATED_FRAME_LEN], bool); 4] = [
        ("kpr-xdp", &to_kpr, true),
        ("kpr", &to_kpr, false),
        ("iptables", &to_kube_proxy, false),
        ("direct", &direct, false),
    ];
    let (mut pps, mut delivered): (Vec<Vec<f64>>, Vec<Vec<f64>>) =
        (vec![Vec::new(); paths.len()], vec![Vec::new(); paths.len()]);
    let mut passing = None;
    for round in 0..=rounds {
        for (i, (label, frame, xdp)) in paths.iter().enumerate() {
            // n0's XDP program: kpr's, or the stub that passes every frame to the stack.
            // (The plan applied in the node's namespace, where its links' indexes are.)
            if *xdp {
                passing = None;
                datapath = apply(datapath, with_xdp.clone())?;
            } else if passing.is_none() {
                datapath = apply(datapath, without_xdp.clone())?;
                passing = Some(node.run(|| kpr_tests::attach_xdp_stub("n0", XDP_PASS))??);
            }
            let (before, forwarded_before) = (received()?, xdp_forwarded()?);
            let started = Instant::now();
            send(**frame, packets)?;
            let took = started.elapsed();
            let (arrived, by_xdp) = (received()? - before, xdp_forwarded()? - forwarded_before);
            // A path slower than the generator loses what overflows its link's ring: its rate
            // is what came back.
            if arrived < u64::from(packets) / 100 {
                bail!("{label}: {arrived} of {packets} frames came back");
            }
            if *xdp != (by_xdp >= u64::from(packets) * 9 / 10) {
                bail!("{label}: XDP forwarded {by_xdp} of {packets} frames");
            }
            // The first round warms up (flows, caches, the JIT images' pages).
            if round > 0 {
                pps[i].push(arrived as f64 / took.as_secs_f64());
                delivered[i].push(arrived as f64 / f64::from(packets));
            }
        }
    }
    drop((passing, sink));
    let mut out = serde_json::Map::new();
    println!("\nNodePort packets per second on one core ({rounds} alternating rounds of {packets} 64-byte frames):");
    let tc = median(pps[1].clone());
    for (((label, ..), rounds), delivered) in paths.iter().zip(&pps).zip(delivered) {
        let (rate, share) = (median(rounds.clone()), median(delivered));
        println!(
            "{label:>9} {rate:>10.0} pps, {:.2}× kpr's tc path, {:.0}% of the frames through (rounds {rounds:.0?})",
            rate / tc,
            share * 100.0
        );
        out.insert(
            (*label).to_owned(),
            json!({ "pps": rate, "pps_rounds": rounds, "pps_ratio_vs_tc": rate / tc, "pps_delivered_share": share }),
        );
    }
    out.insert("packets_per_round".into(), json!(packets));
    drop(datapath);
    Ok(serde_json::Value::Object(out))
}
