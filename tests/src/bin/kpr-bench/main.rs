//! `cargo xtask bench`: socket-LB benchmarks. Prints a table and writes target/bench/socket_lb.json.
//!
//! 1. Connection rate and connect() latency through a ClusterIP vs straight to the backend, with
//!    100 / 10k / 50k service ports programmed (alternating A/B rounds, one client thread),
//!    over IPv4 and over IPv6.
//! 2. Time to program 10k service ports × 4 endpoints from cold, once the agent holds them.
//! 3. Time from a manifest change to the map update, through the real agent.
use std::{
    collections::BTreeMap,
    io::Read as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, TcpStream},
    os::fd::AsRawFd as _,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use kpr::{
    datapath::{
        Programmer,
        bpf::{self, BpfDatapath, DatapathConfig, HostDatapath as _},
    },
    model::{
        ObjectKey, Protocol, ServicePortName,
        desired::{Desired, DesiredPort, service_key},
        node::{NodeSettings, TcLinks},
    },
};
use kpr_tests::Harness;
use serde_json::json;
use testbed::{Cgroup, Topology};

const TARGET_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const TARGET_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);
const BENCH_PORT: u16 = 8081;

mod chart;
mod scale;
mod vs_kube_proxy;
mod xdp;

/// kpr's benchmarks: a program that prints its figures and writes them as JSON under
/// target/bench/. With no mode, every benchmark (tens of minutes; the comparison with the real
/// kube-proxy at 20k services alone is longer).
#[derive(clap::Parser, Debug)]
#[command(name = "kpr-bench")]
#[command(group = clap::ArgGroup::new("mode").args(["vs_kube_proxy", "connection_rate", "node_port", "tc_only", "soak", "sync_scale", "maglev", "pps", "scale"]))]
struct Args {
    /// Fewer sizes, rounds and runs: a smoke run of the same code.
    #[arg(long)]
    quick: bool,
    /// Only the comparison with the real kube-proxy (iptables and nftables modes), merged into
    /// socket_lb.json.
    #[arg(long)]
    vs_kube_proxy: bool,
    /// Only the socket-LB connection rate, over IPv4 and IPv6 (connection_rate.json).
    #[arg(long)]
    connection_rate: bool,
    /// With --connection-rate: detach `kpr_sock_ops` (outlier detection's answer counting on
    /// the socket path) once loaded, to measure what its presence costs a connect
    /// (connection_rate_without_sock_ops.json).
    #[arg(long, requires = "connection_rate")]
    without_sock_ops: bool,
    /// Only the NodePort paths, IPv4 and IPv6: kpr, kube-proxy's rules, direct (node_port.json).
    #[arg(long)]
    node_port: bool,
    /// Only the tc programs' ns per packet (printed as JSON).
    #[arg(long)]
    tc_only: bool,
    /// Only the sync loop at scale: a UDP Service of 5,000 endpoints and 1,000 endpoint changes,
    /// with the conntrack table holding its flows (sync_scale.json).
    #[arg(long)]
    sync_scale: bool,
    /// Only the Maglev table's figures: the share of slots remapped when one of N endpoints
    /// leaves or joins, and the build time and size at 1,000 endpoints (merged into
    /// socket_lb.json as `maglev`).
    #[arg(long)]
    maglev: bool,
    /// Only the NodePort packets per second on one core: kpr's XDP program, its tc path,
    /// kube-proxy's rules, the direct path (node_port_pps.json).
    #[arg(long)]
    pps: bool,
    /// Only the NodePort churn: this many short connections per path (node_port_soak.json).
    #[arg(long, value_name = "N")]
    soak: Option<usize>,
    /// The comparison's service counts, ascending [default: 1000,5000,10000,20000; --quick: 1000].
    #[arg(long, value_delimiter = ',', value_name = "N,N,...")]
    sizes: Option<Vec<usize>>,
    /// How long a proxy's full sync may take at the sizes created cold, in seconds.
    #[arg(long, value_name = "S")]
    cold_sync_limit: Option<u64>,
    /// Connection-rate rounds of the kube-proxy comparison (the first warms up) and of the
    /// NodePort paths [default: 30 and 12; --quick: 2 and 4].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(2..))]
    rounds: Option<u16>,
    /// Connections per round of the kube-proxy comparison and of the NodePort paths [default: 200 and 300].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    per_round: Option<u32>,
    /// Only the scale frontier (issue 46): per shape, full and restart sync, API write →
    /// traffic idle and under churn, memory and CPU, through a real API server
    /// (target/bench/scale.json, merged per shape and proxy; chart scale.svg).
    #[arg(long)]
    scale: bool,
    /// --scale's shapes, Services x endpoints each [default: 10000x4,20000x4,1x5000,10000x100;
    /// --quick: 1000x4,1x500].
    #[arg(long, value_delimiter = ',', value_name = "SxE,...", requires = "scale")]
    shapes: Option<Vec<scale::Shape>>,
    /// --scale's proxies: kpr, kube-proxy-nftables, kube-proxy-iptables [default: kpr].
    #[arg(long, value_delimiter = ',', value_name = "P,...", requires = "scale")]
    proxies: Option<Vec<String>>,
    /// --scale: API write → traffic samples, idle and under churn each [default: 200; --quick: 20].
    #[arg(long, value_name = "N", requires = "scale")]
    samples: Option<usize>,
    /// --scale: how long a kube-proxy's cold full sync may take before the shape is left out
    /// for it, in seconds [default: 1800].
    #[arg(long, value_name = "S", requires = "scale")]
    peer_budget: Option<u64>,
    /// --tc-only: runs per test packet (more for a profile).
    #[arg(long, value_name = "N", default_value_t = 1_000_000)]
    repeat: u32,
}

fn main() -> Result<()> {
    let args = <Args as clap::Parser>::parse();
    let quick = args.quick;
    let cold_sync_limit = args.cold_sync_limit.map_or(vs_kube_proxy::COLD_SYNC_LIMIT, Duration::from_secs);
    let vs_sizes: &[usize] = match &args.sizes {
        Some(sizes) => sizes,
        None if quick => &[1_000],
        None => &[1_000, 5_000, 10_000, 20_000],
    };
    // The comparison's and the NodePort paths' rounds, in their own modes and in the full run.
    let per_round = |default| args.per_round.map_or(default, |n| n as usize);
    // 30 rounds of the comparison: its measuring is seconds beside the minutes of creating the
    // Services and syncing the proxies, and 6 rounds' ratios moved by ±5% from run to run.
    let (vs_rounds, vs_per_round) = (args.rounds.map_or(if quick { 2 } else { 30 }, usize::from), per_round(200));
    let (np_rounds, np_per_round) = (args.rounds.map_or(if quick { 4 } else { 12 }, usize::from), per_round(300));
    let (vs_latency_samples, iperf_secs) = if quick { (3, 1) } else { (20, 3) };
    if args.vs_kube_proxy {
        let path = bench_dir().join("socket_lb.json");
        let mut result: serde_json::Value =
            std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_else(|| json!({}));
        vs_kube_proxy::run(vs_sizes, vs_rounds, vs_per_round, vs_latency_samples, cold_sync_limit, |vs| {
            write_vs(&mut result, vs.clone())
        })?;
        return Ok(());
    }
    if args.scale {
        let shapes = args.shapes.clone().unwrap_or_else(|| {
            let names: &[&str] =
                if quick { &["1000x4", "1x500"] } else { &["10000x4", "20000x4", "1x5000", "10000x100"] };
            names.iter().map(|s| s.parse().expect("a shape")).collect()
        });
        let proxies = args.proxies.clone().unwrap_or_else(|| vec!["kpr".into()]);
        if let Some(bad) =
            proxies.iter().find(|p| !["kpr", "kube-proxy-nftables", "kube-proxy-iptables"].contains(&p.as_str()))
        {
            bail!("--proxies: unknown proxy {bad}");
        }
        let opts = scale::Options {
            proxies,
            samples: args.samples.unwrap_or(if quick { 20 } else { 200 }),
            peer_budget: Duration::from_secs(args.peer_budget.unwrap_or(1800)),
        };
        let path = bench_dir().join("scale.json");
        let mut result: serde_json::Value =
            std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_else(|| json!({}));
        scale::run(&shapes, &opts, |shape, proxy, figures| {
            let entry = &mut result["shapes"][shape];
            entry["services"] = figures["services"].clone();
            entry["endpoints_per_service"] = figures["endpoints_per_service"].clone();
            let mut figures = figures["figures"].clone();
            figures["measured_on"] = measured_on();
            if proxy == "kpr" {
                for (k, v) in figures.as_object().into_iter().flatten() {
                    entry[k] = v.clone();
                }
            } else {
                entry[proxy.replace('-', "_")] = figures;
            }
            write_json("scale.json", &result)?;
            chart::write_scale(&result, &bench_dir().join("scale.svg"))
        })?;
        return Ok(());
    }
    if args.connection_rate {
        let (rounds, per_round) = if quick { (4, 500) } else { (24, 500) };
        let sizes: &[usize] = if quick { &[100, 10_000] } else { &[100, 10_000, 50_000] };
        let sock_ops = !args.without_sock_ops;
        let conn = connection_rate(sizes, rounds, per_round, false, sock_ops)?;
        let conn6 = connection_rate(sizes, rounds, per_round, true, sock_ops)?;
        let file = if sock_ops { "connection_rate.json" } else { "connection_rate_without_sock_ops.json" };
        write_json(file, &json!({"connection_rate": conn, "connection_rate_ipv6": conn6}))?;
        return Ok(());
    }
    if args.node_port {
        let result = node_port_paths(np_rounds, np_per_round, iperf_secs, 0)?;
        write_json("node_port.json", &json!({ "node_port": result }))?;
        return Ok(());
    }
    if args.pps {
        let result = xdp::node_port_pps(args.rounds.map_or(if quick { 3 } else { 8 }, usize::from), 1_000_000)?;
        write_json("node_port_pps.json", &json!({ "node_port": result }))?;
        return Ok(());
    }
    if args.tc_only {
        println!("{}", tc_ns_per_packet(args.repeat)?);
        return Ok(());
    }
    if args.maglev {
        let path = bench_dir().join("socket_lb.json");
        let mut result: serde_json::Value =
            std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_else(|| json!({}));
        result["maglev"] = maglev_figures()?;
        write_json("socket_lb.json", &result)?;
        return Ok(());
    }
    if args.sync_scale {
        let result = sync_scale(if quick { 100 } else { 1_000 })?;
        write_json("sync_scale.json", &result)?;
        return Ok(());
    }
    if let Some(n) = args.soak {
        let result = node_port_paths(0, 0, 0, n)?;
        write_json("node_port_soak.json", &result)?;
        return Ok(());
    }
    let sizes: &[usize] = if quick { &[100, 10_000] } else { &[100, 10_000, 50_000] };
    let (rounds, per_round) = if quick { (4, 500) } else { (24, 500) };

    let conn = connection_rate(sizes, rounds, per_round, false, true)?;
    let conn6 = connection_rate(sizes, rounds, per_round, true, true)?;
    let program = programming_time(10_000, 4)?;
    let latency = event_latency(if quick { 10 } else { 30 })?;
    let per_packet = tc_ns_per_packet(if quick { 100_000 } else { 1_000_000 })?;
    let node_port = node_port_paths(np_rounds, np_per_round, iperf_secs, if quick { 20_000 } else { 100_000 })?;

    let maglev = maglev_figures()?;
    let mut result = json!({
        "connection_rate": conn, "connection_rate_ipv6": conn6, "programming": program, "event_to_datapath": latency,
        "tc_per_packet": per_packet, "node_port": node_port, "maglev": maglev,
    });
    write_json("socket_lb.json", &result)?;
    vs_kube_proxy::run(vs_sizes, vs_rounds, vs_per_round, vs_latency_samples, cold_sync_limit, |vs| {
        write_vs(&mut result, vs.clone())
    })?;
    Ok(())
}

/// Maglev's table (`model::maglev`, issue 47): the share of a table's slots that name another
/// endpoint after one of N leaves or joins (Maglev's bound is about 1/N, the endpoint's own),
/// for N of 10, 100 and 1,000 (the large table for 1,000), and the time to build a table of
/// 1,000 endpoints and its size as the datapath would hold it (a 4-byte endpoint index a slot).
fn maglev_figures() -> Result<serde_json::Value> {
    use kpr::model::maglev::{DEFAULT_TABLE_SIZE, LARGE_TABLE_SIZE, remapped_share, table};
    let seed = 0x6b70_7200_0000_0001;
    let endpoints = |n: u32| -> Vec<SocketAddr> {
        (0..n).map(|i| SocketAddr::from((Ipv4Addr::from(0x0af4_0002 + (i << 8)), 8080))).collect()
    };
    let named = |list: &[SocketAddr], size: u32| -> Result<Vec<SocketAddr>> {
        Ok(table(list, size, seed)?.into_iter().map(|i| list[i as usize]).collect())
    };
    println!("Maglev: slots remapped when one of N endpoints leaves or joins (1/N is the endpoint's own)");
    println!("{:>6} {:>7} {:>9} {:>9} {:>9}", "N", "size", "1/N", "leaves", "joins");
    let mut shares = Vec::new();
    for (n, size) in [(10, DEFAULT_TABLE_SIZE), (100, DEFAULT_TABLE_SIZE), (1_000, LARGE_TABLE_SIZE)] {
        // N endpoints; one of them leaves (N - 1), or a new one joins (N + 1).
        let more = endpoints(n + 1);
        let base = named(&more[..n as usize], size)?;
        let leaves = remapped_share(&base, &named(&more[..n as usize - 1], size)?);
        let joins = remapped_share(&base, &named(&more, size)?);
        println!("{n:>6} {size:>7} {:>9.4} {leaves:>9.4} {joins:>9.4}", 1.0 / f64::from(n));
        shares.push(json!({"backends": n, "table_size": size, "remap_share_one_leaves": leaves, "remap_share_one_joins": joins}));
    }
    let thousand = endpoints(1_000);
    let mut times = Vec::new();
    for size in [DEFAULT_TABLE_SIZE, LARGE_TABLE_SIZE] {
        let mut runs: Vec<f64> = (0..9)
            .map(|_| {
                let started = Instant::now();
                table(&thousand, size, seed).map(|_| started.elapsed().as_secs_f64() * 1e3)
            })
            .collect::<Result<_, _>>()?;
        runs.sort_by(f64::total_cmp);
        println!(
            "table of 1,000 endpoints, {size} slots: built in {:.2} ms (median of 9), {} KiB",
            runs[4],
            size * 4 / 1024
        );
        times.push(json!({"backends": 1_000, "table_size": size, "table_build_ms": runs[4], "table_bytes": size * 4}));
    }
    // The headline figures the issue names: the remap shares at 100 endpoints and the default
    // size, the build time at 1,000 endpoints and the large size.
    Ok(json!({
        "remap_share_one_leaves": shares[1]["remap_share_one_leaves"],
        "remap_share_one_joins": shares[1]["remap_share_one_joins"],
        "backends": 100,
        "table_size": DEFAULT_TABLE_SIZE,
        "table_build_ms": times[1]["table_build_ms"],
        "table_build_backends": 1_000,
        "table_build_size": LARGE_TABLE_SIZE,
        "by_backends": shares,
        "build": times,
    }))
}

/// Merge the comparison so far into `result`, write the JSON and the chart.
fn write_vs(result: &mut serde_json::Value, vs: serde_json::Value) -> Result<()> {
    merge_vs(result, vs);
    write_json("socket_lb.json", result)?;
    chart::write(result, &bench_dir().join("vs_kube_proxy.svg"))
}

/// The comparison with the real kube-proxy: its own section (per size), and the peers'
/// NodePort figures at the smallest size beside kpr's under `node_port`.
fn merge_vs(result: &mut serde_json::Value, vs: serde_json::Value) {
    let smallest = vs["sizes"].as_object().and_then(|sizes| {
        sizes.iter().min_by_key(|(size, _)| size.parse::<usize>().unwrap_or(usize::MAX)).map(|(_, v)| v.clone())
    });
    if let Some(smallest) = smallest {
        for peer in ["kube-proxy-iptables", "kube-proxy-nftables"] {
            result["node_port"][peer] = smallest["node_port"][peer].clone();
        }
    }
    result["vs_kube_proxy"] = vs;
    result["measured_on"] = measured_on();
}

/// The commit, kernel and CPU count figures were measured on.
fn measured_on() -> serde_json::Value {
    json!({
        "commit": Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).output().ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()),
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_owned()),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "date": jiff::Timestamp::now().to_string(),
    })
}

fn bench_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench")
}

fn write_json(name: &str, result: &serde_json::Value) -> Result<()> {
    let dir = bench_dir();
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(result)?)?;
    println!("\nwrote {}", path.canonicalize()?.display());
    Ok(())
}

fn desired_with(n: usize, backends_per_service: usize, target_backend: impl Into<IpAddr>) -> Desired {
    let target_backend: IpAddr = target_backend.into();
    let v6 = target_backend.is_ipv6();
    let mut desired = Desired::new();
    for i in 0..n {
        let (ip, backends): (IpAddr, _) = if i == 0 {
            let target = if v6 { IpAddr::from(TARGET_IP6) } else { TARGET_IP.into() };
            (target, vec![(target_backend, BENCH_PORT)])
        } else if v6 {
            // Fillers on fd00:100::/64, with backends in fd00:200::/64.
            let ip = Ipv6Addr::from(u128::from(Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, 0)) + i as u128);
            let bs = (0..backends_per_service)
                .map(|b| (Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, b as u16, i as u16).into(), 8080))
                .collect();
            (ip.into(), bs)
        } else {
            // Fillers on 10.100.0.0/16 and up, each with its own backends.
            let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 100, 0, 0)) + i as u32);
            let bs = (0..backends_per_service)
                .map(|b| (Ipv4Addr::new(10, 200, (b % 250) as u8, (i % 250) as u8 + 1).into(), 8080))
                .collect();
            (ip.into(), bs)
        };
        let name = ServicePortName {
            service: ObjectKey::new("bench", format!("svc-{i}")),
            port: String::new(),
            protocol: Protocol::Tcp,
        };
        desired.insert(
            service_key(ip, 80, Protocol::Tcp),
            DesiredPort {
                name,
                backends,
                flags: 0,
                source_ranges: vec![],
                affinity_timeout: 0,
                serving: vec![],
                alive: None,
                remote: Vec::new(),
            },
        );
    }
    desired
}

/// Connect, read the pod's name, close with RST (no TIME_WAIT: no port exhaustion).
fn one_connection(addr: impl Into<SocketAddr>) -> Result<Duration> {
    let started = Instant::now();
    // Past a few SYN retransmissions (1, 3, 7 s) a connection has failed; the kernel's own
    // limit is two minutes.
    let mut conn = TcpStream::connect_timeout(&addr.into(), CONNECT_TIMEOUT)?;
    let connected = started.elapsed();
    let mut buf = [0u8; 64];
    let _ = conn.read(&mut buf)?;
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: valid fd, correctly sized struct.
    unsafe {
        libc::setsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            size_of_val(&linger) as _,
        );
    }
    Ok(connected)
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

/// The middle value (the upper of the two middle ones for an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A path's rate against the direct path's: the median of the rounds' ratios (each round of
/// the path against the direct path's round beside it), so that a burst of load from elsewhere
/// on the machine, which slows every path of the rounds it lands in, moves the ratio less than
/// it moves the rates.
fn median_ratio(rounds: &[f64], direct_rounds: &[f64]) -> f64 {
    median(rounds.iter().zip(direct_rounds).map(|(r, d)| r / d).collect())
}

/// Connection rate over IPv4, or over IPv6 (`v6`): an IPv6 ClusterIP, an IPv6 pod.
fn connection_rate(
    sizes: &[usize],
    rounds: usize,
    per_round: usize,
    v6: bool,
    sock_ops: bool,
) -> Result<serde_json::Value> {
    let name = testbed::unique_name("kb-conn");
    let topology = Topology::new(&name, &["pod"])?;
    let (pod, target): (IpAddr, IpAddr) = if v6 {
        (topology.pods[0].ip6.into(), TARGET_IP6.into())
    } else {
        (topology.pods[0].ip.into(), TARGET_IP.into())
    };
    // A single-threaded accept → write → close server: its cost per connection is small and
    // steady, so the client-side difference (the socket hook) is not buried in server noise.
    let listener = topology.pods[0].netns.run(move || std::net::TcpListener::bind((pod, BENCH_PORT)))??;
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let _ = std::io::Write::write_all(&mut conn, b"pod\n");
        }
    });
    let mut cgroup = Cgroup::new(&name)?;
    let pins = testbed::PinRoot(std::path::PathBuf::from(format!("/sys/fs/bpf/{name}")));
    let mut cfg = DatapathConfig::new(pins.0.clone(), cgroup.path.clone());
    cfg.max_service_ports = 65_536;
    let mut datapath = BpfDatapath::load(&cfg)?;
    let mut programmer = Programmer::recover(&mut datapath.maps)?;
    // Outlier detection's answer counting (`kpr_sock_ops`), on for the "counting" rounds only.
    let mut answers = kpr::datapath::backend_answers::BackendWatch::open(&pins.0)?;
    if !sock_ops {
        // Its link's pin is its last reference: the program detaches with it.
        let link = pins.0.join(format!(
            "v{}/link_{}",
            proxy_common::PIN_LAYOUT_VERSION,
            proxy_common::program_names::SOCK_OPS
        ));
        std::fs::remove_file(&link).with_context(|| format!("failed to remove {}", link.display()))?;
    }
    cgroup.enter()?;

    let family = if v6 { "IPv6" } else { "IPv4" };
    println!(
        "{family} connection rate, one client thread, new TCP connection per request ({rounds} A/B rounds × {per_round})"
    );
    println!(
        "{:>8} {:>12} {:>12} {:>7} {:>10} {:>10} {:>10} {:>10} {:>12} {:>10}",
        "services",
        "direct c/s",
        "kpr c/s",
        "ratio",
        "direct p50",
        "kpr p50",
        "direct p99",
        "kpr p99",
        "counting c/s",
        "count p50"
    );
    let mut out = Vec::new();
    for &n in sizes {
        programmer.apply(&desired_with(n, 4, pod), &mut datapath.maps);
        let (direct, via, counting, answers_back) = topology.client.run(move || -> Result<_> {
            let mut lat: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
            let mut time: BTreeMap<&str, Duration> = BTreeMap::new();
            for _ in 0..50 {
                one_connection(SocketAddr::new(target, 80))?; // warm-up
            }
            for _ in 0..rounds {
                for (label, addr) in [
                    ("direct", SocketAddr::new(pod, BENCH_PORT)),
                    ("kpr", SocketAddr::new(target, 80)),
                    ("counting", SocketAddr::new(target, 80)),
                ] {
                    answers.want_answers(label == "counting")?;
                    let started = Instant::now();
                    for _ in 0..per_round {
                        lat.entry(label)
                            .or_default()
                            .push(one_connection(addr).with_context(|| format!("{label} connect"))?);
                    }
                    *time.entry(label).or_default() += started.elapsed();
                }
            }
            let summarize = |label: &str| {
                let mut l = lat[label].clone();
                l.sort();
                let rate = l.len() as f64 / time[label].as_secs_f64();
                (rate, percentile(&l, 0.5), percentile(&l, 0.99))
            };
            Ok((summarize("direct"), summarize("kpr"), summarize("counting"), answers))
        })??;
        answers = answers_back;
        println!(
            "{n:>8} {:>12.0} {:>12.0} {:>7.3} {:>8.1}µs {:>8.1}µs {:>8.1}µs {:>8.1}µs {:>12.0} {:>8.1}µs",
            direct.0,
            via.0,
            via.0 / direct.0,
            direct.1,
            via.1,
            direct.2,
            via.2,
            counting.0,
            counting.1
        );
        out.push(json!({
            "services": n, "direct_conn_per_s": direct.0, "kpr_conn_per_s": via.0, "ratio": via.0 / direct.0,
            "direct_connect_p50_us": direct.1, "kpr_connect_p50_us": via.1,
            "direct_connect_p99_us": direct.2, "kpr_connect_p99_us": via.2,
            "kpr_counting_answers_conn_per_s": counting.0, "kpr_counting_answers_connect_p50_us": counting.1,
        }));
    }
    answers.want_answers(false)?;
    cgroup.leave()?;
    drop(datapath);
    Ok(json!(out))
}

fn programming_time(services: usize, backends: usize) -> Result<serde_json::Value> {
    let name = testbed::unique_name("kb-prog");
    let cgroup = Cgroup::new(&name)?;
    let pins = testbed::PinRoot(std::path::PathBuf::from(format!("/sys/fs/bpf/{name}")));
    let mut datapath = BpfDatapath::load(&DatapathConfig::new(pins.0.clone(), cgroup.path.clone()))?;
    let mut programmer = Programmer::recover(&mut datapath.maps)?;
    let desired = desired_with(services, backends, Ipv4Addr::new(10, 244, 1, 2));
    let started = Instant::now();
    let report = programmer.apply(&desired, &mut datapath.maps);
    let cold = started.elapsed();
    // One endpoint changes in every 100th service: the incremental path.
    let mut changed = desired.clone();
    for (i, port) in changed.values_mut().enumerate() {
        if i % 100 == 1 {
            port.backends[0].1 = 9090;
        }
    }
    let started = Instant::now();
    let incr = programmer.apply(&changed, &mut datapath.maps);
    let incremental = started.elapsed();
    println!(
        "\nprogramming {services} service ports × {backends} endpoints from cold: {:.1} ms ({} added, {} failed); \
         then {} changed: {:.2} ms",
        cold.as_secs_f64() * 1e3,
        report.added,
        report.failed,
        incr.updated,
        incremental.as_secs_f64() * 1e3
    );
    Ok(json!({ "service_ports": services, "endpoints_each": backends, "cold_ms": cold.as_secs_f64() * 1e3,
               "incremental_changed": incr.updated, "incremental_ms": incremental.as_secs_f64() * 1e3 }))
}

/// The sync loop's programming step at scale (issue 42): one UDP Service port of 5,000
/// endpoints (a big DNS-like Service) beside 999 small ones, its flows in the conntrack table
/// (20,000 flows, 40,000 entries), then `changes` endpoint changes, each its own sync (one
/// endpoint replaced: the gone one's UDP flows are flushed, a walk of the conntrack tables),
/// and the same changes coalesced into one sync. Real maps on fresh pins, no agent: the
/// figures are the time one sync holds the loop (kube-proxy's `/healthz` turns unhealthy when
/// a change waits longer than twice `syncPeriod`).
fn sync_scale(changes: usize) -> Result<serde_json::Value> {
    const BIG: usize = 5_000;
    const FLOWS: usize = 20_000;
    let name = testbed::unique_name("kb-sync");
    let cgroup = Cgroup::new(&name)?;
    let pins = testbed::PinRoot(std::path::PathBuf::from(format!("/sys/fs/bpf/{name}")));
    let mut datapath = BpfDatapath::load(&DatapathConfig::new(pins.0.clone(), cgroup.path.clone()))?;
    let mut programmer = Programmer::recover(&mut datapath.maps)?;
    let mut desired = desired_with(1_000, 4, Ipv4Addr::new(10, 244, 1, 2));
    let big_ip = Ipv4Addr::new(10, 96, 5, 53);
    let endpoint = |i: usize| IpAddr::from(Ipv4Addr::new(10, 201, (i / 250) as u8, (i % 250) as u8 + 1));
    let big_key = service_key(IpAddr::from(big_ip), 53, Protocol::Udp);
    let name =
        ServicePortName { service: ObjectKey::new("bench", "dns"), port: String::new(), protocol: Protocol::Udp };
    let backends: Vec<(IpAddr, u16)> = (0..BIG).map(|i| (endpoint(i), 5353)).collect();
    let serving = backends.iter().map(|(ip, port)| std::net::SocketAddr::new(*ip, *port)).collect();
    desired.insert(
        big_key,
        DesiredPort {
            name,
            backends,
            flags: 0,
            source_ranges: vec![],
            affinity_timeout: 0,
            serving,
            alive: None,
            remote: Vec::new(),
        },
    );
    let started = Instant::now();
    let report = programmer.apply(&desired, &mut datapath.maps);
    let cold_ms = started.elapsed().as_secs_f64() * 1e3;
    if report.failed > 0 {
        bail!("{} service ports failed to program", report.failed);
    }
    // The big Service's flows: client i → the ClusterIP, to endpoint i % BIG, and back.
    let service_id = programmer.programmed()[&big_key].value.service_id;
    let mut table: aya::maps::HashMap<_, proxy_common::CtKey4, proxy_common::CtValue> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(aya::maps::MapData::from_pin(
            bpf::pin_dir(&pins.0).join(proxy_common::map_names::CONNTRACK4),
        )?))?;
    let (cluster_ip, dns) = (proxy_common::Addr::from(IpAddr::from(big_ip)), 53u16.to_be());
    for i in 0..FLOWS {
        let client = proxy_common::Addr::from(IpAddr::from(Ipv4Addr::from(0x0a00_0000 + i as u32 + 2)));
        let backend = proxy_common::Addr::from(endpoint(i % BIG));
        let sport = (40_000 + (i % 20_000) as u16).to_be();
        let value = |src, dst, sp, dp, flags| proxy_common::CtValue {
            src_addr: src,
            dst_addr: dst,
            src_port: sp,
            dst_port: dp,
            service_id,
            last_seen: kpr::datapath::conntrack::monotonic_now(),
            flags,
            addrs_csum_diff: 0,
            route: proxy_common::CachedRoute::NONE,
        };
        let forward = proxy_common::CtKey4::new(client, cluster_ip, sport, dns, proxy_common::IPPROTO_UDP);
        let reply = proxy_common::CtKey4::new(backend, client, 5353u16.to_be(), sport, proxy_common::IPPROTO_UDP);
        table.insert(&forward, &value(client, backend, sport, 5353u16.to_be(), proxy_common::ct::SEEN_REPLY), 0)?;
        let back = proxy_common::ct::SEEN_REPLY | proxy_common::ct::REPLY;
        table.insert(&reply, &value(cluster_ip, client, dns, sport, back), 0)?;
    }
    // One change per sync: endpoint i leaves, a new one takes its place.
    let mut times = Vec::with_capacity(changes);
    let replace = |d: &mut Desired, i: usize, with: IpAddr| {
        let port = d.get_mut(&big_key).expect("the big Service");
        port.backends[i].0 = with;
        port.serving[i].set_ip(with);
    };
    let fresh = |i: usize| IpAddr::from(Ipv4Addr::new(10, 202, (i / 250) as u8, (i % 250) as u8 + 1));
    for i in 0..changes {
        replace(&mut desired, i, fresh(i));
        let started = Instant::now();
        programmer.apply(&desired, &mut datapath.maps);
        times.push(started.elapsed());
    }
    let total_ms: f64 = times.iter().map(Duration::as_secs_f64).sum::<f64>() * 1e3;
    let flows_left = table.keys().count() / 2;
    times.sort();
    let (p50, p99) = (percentile(&times, 0.5) / 1e3, percentile(&times, 0.99) / 1e3);
    // The same number of changes in one sync (changes coalesced by minSyncPeriod).
    for i in 0..changes {
        replace(&mut desired, i, endpoint(i));
    }
    let started = Instant::now();
    programmer.apply(&desired, &mut datapath.maps);
    let coalesced_ms = started.elapsed().as_secs_f64() * 1e3;
    println!(
        "
sync at scale: 1,000 TCP service ports and a UDP one of {BIG} endpoints with {FLOWS} flows in conntrack: cold {cold_ms:.1} ms; \
         {changes} endpoint changes one sync each: p50 {p50:.2} ms, p99 {p99:.2} ms, {total_ms:.0} ms in all \
         ({flows_left} flows left); the same {changes} changes in one sync: {coalesced_ms:.1} ms"
    );
    Ok(json!({ "service_ports": 1_001, "big_endpoints": BIG, "flows": FLOWS, "cold_ms": cold_ms, "changes": changes,
               "per_change_p50_ms": p50, "per_change_p99_ms": p99, "per_change_total_ms": total_ms,
               "flows_left": flows_left, "coalesced_ms": coalesced_ms }))
}

/// Manifest change → the map holds it, through the real agent (inotify, reload, sync).
fn event_latency(samples: usize) -> Result<serde_json::Value> {
    let mut h = Harness::new("kb-event", &["pod-a", "pod-b"])?;
    let ports = [("http", 80, "TCP")];
    h.write_service("web", TARGET_IP, &ports, &[0, 1])?;
    h.start_agent()?;
    h.wait("10.96.0.10:80/TCP", Some(2))?;
    let mut times = Vec::new();
    for i in 0..samples {
        let (pods, want): (&[usize], usize) = if i % 2 == 0 { (&[0], 1) } else { (&[0, 1], 2) };
        let started = Instant::now();
        h.write_endpoints("web", &ports, pods)?;
        h.wait("10.96.0.10:80/TCP", Some(want))?;
        times.push(started.elapsed());
    }
    times.sort();
    let (p50, p99) = (percentile(&times, 0.5) / 1e3, percentile(&times, 0.99) / 1e3);
    println!(
        "manifest change → datapath ({samples} changes, includes the 5 ms reload coalescing): p50 {p50:.1} ms, p99 {p99:.1} ms"
    );
    Ok(
        json!({ "samples": samples, "p50_ms": p50, "p99_ms": p99, "note": "manifest source; includes 5 ms coalescing of file events and 1 ms polling granularity of the check" }),
    )
}

/// The tc program's cost per packet (BPF_PROG_TEST_RUN with the kernel's own `repeat`, maps
/// warm): a packet of an established flow (conntrack hit + rewrite, then sent straight out: a
/// route lookup; and with `--host-routing`, handed to the host stack), a packet that is not for
/// a service, and the floor (a non-IP frame: the harness's own cost per run). A connection's
/// first packet needs a new tuple every run: those are single runs, against their own floor.
fn tc_ns_per_packet(repeat: u32) -> Result<serde_json::Value> {
    // A namespace that forwards, with a link and a route to the pods and the service range, as
    // a node has (this machine's own namespace may not forward): the direct path's route
    // lookups succeed. TestRun sends nothing out.
    let node = testbed::Netns::new(&testbed::unique_name("kb-tcr"))?;
    node.ip(&["link", "add", "out0", "type", "veth", "peer", "name", "out1"])?;
    node.ip(&["link", "set", "out0", "up"])?;
    node.ip(&["link", "set", "out1", "up"])?;
    node.ip(&["route", "add", "10.0.0.0/8", "dev", "out0"])?;
    node.ip(&["-6", "route", "add", "fd00::/8", "dev", "out0"])?;
    // The neighbours of the established flows' addresses, for the XDP program's route lookups
    // (it sends a packet out only with both MAC addresses known).
    let neighbours = ["10.0.0.99", "10.96.0.10", "10.244.1.2", "fd00::99", "fd00:96::10", "fd00:10:244:1::2"];
    node.ip_batch(neighbours.map(|a| format!("neigh add {a} lladdr 02:00:00:00:00:99 dev out0 nud permanent")))?;
    node.route_packets()?;
    // Each object is loaded LOADS times (its JIT images and maps placed anew): one load's
    // figures were seen to differ from the next's by up to half on a noisy machine, the
    // floor's too. Each packet gets the median of all its rounds, and the median of its rounds
    // less the same round's floor (`above_floor`, with each load's median, and the median of
    // the undisturbed rounds: see `QUIET_FLOOR`).
    const LOADS: u32 = 5;
    let mut results = serde_json::Map::new();
    let (mut ranges, mut above_floor) = (serde_json::Map::new(), serde_json::Map::new());
    // As the agent runs by default; with --host-routing; with --endpoint-counters.
    for (forward_direct, endpoint_counters) in [(true, false), (false, false), (true, true)] {
        let variant = match (forward_direct, endpoint_counters) {
            (false, _) => "_host_routing",
            (true, true) => "_endpoint_counters",
            (true, false) => "",
        };
        // Per label: each load's rounds.
        let mut pooled: Vec<(&str, Vec<Vec<f64>>, String)> = Vec::new();
        for _ in 0..LOADS {
            let runs = move || tc_program_runs(repeat.div_ceil(LOADS), forward_direct, endpoint_counters);
            for (label, rounds, runs) in node.run(runs)?? {
                match pooled.iter_mut().find(|(l, ..)| *l == label) {
                    Some((_, loads, _)) => loads.push(rounds),
                    None => pooled.push((label, vec![rounds], runs)),
                }
            }
        }
        let floor_of = |name: &str| pooled.iter().find(|(l, ..)| *l == name).map(|(_, r, _)| r.clone());
        let floor = floor_of("floor_non_ip").unwrap_or_default();
        // The XDP program's runs against its own harness's floor.
        let xdp_floor = floor_of("xdp_floor_non_ip").unwrap_or_default();
        for (label, loads, runs) in pooled {
            if !variant.is_empty() && label.ends_with("floor_non_ip") {
                continue; // the same program's floor, measured again
            }
            let label = format!("{label}{variant}");
            let what = match variant {
                "_host_routing" => ", --host-routing",
                "_endpoint_counters" => ", --endpoint-counters, every endpoint counted",
                _ => "",
            };
            let own_floor = if label.starts_with("xdp_") { &xdp_floor } else { &floor };
            let over = if label.ends_with("floor_non_ip") { None } else { less_floor(&loads, own_floor) };
            let rounds: Vec<f64> = loads.concat();
            let (min, max) = rounds.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            let ns = median(rounds);
            let mut over_text = String::new();
            if let Some(over) = over {
                let by_load: Vec<f64> = over.iter().map(|l| median(l.clone())).collect();
                let all = median(over.concat());
                let quiet = undisturbed(&over, own_floor);
                let (quiet_rounds, quiet_median) = (quiet.len(), median(quiet));
                over_text = format!(
                    ", {all:.1} above its rounds' floor (by load: {by_load:.1?}; {quiet_median:.1} in the {quiet_rounds} undisturbed rounds)"
                );
                above_floor.insert(
                    label.clone(),
                    json!({ "median": all, "by_load": by_load, "undisturbed_median": quiet_median, "undisturbed_rounds": quiet_rounds }),
                );
            }
            println!(
                "tc ingress, {label}: {ns:.1} ns/packet{over_text}, rounds {min:.1}–{max:.1} (TestRun, {runs}, {LOADS} loads, 10k services programmed{what})"
            );
            results.insert(label.clone(), json!(ns));
            ranges.insert(label, json!([min, max]));
        }
    }
    results.insert("above_floor".into(), serde_json::Value::Object(above_floor));
    results.insert("ranges".into(), serde_json::Value::Object(ranges));
    results.insert("loads".into(), json!(LOADS));
    results.insert("repeat".into(), json!(repeat));
    Ok(serde_json::Value::Object(results))
}

/// A round whose floor took more than this times the quietest floor of its object's loads was
/// slowed by the machine, not by the program: on the shared machines here, spells of a fraction
/// of a second to seconds slow every instruction by 1.2–1.6× (the harness's floor with them,
/// and a userspace loop), which a load's rounds (about 50 ms in all) cannot alternate away.
/// Undisturbed, the floor's rounds stay within 5% of each other.
const QUIET_FLOOR: f64 = 1.1;

/// The rounds (less their floor, as `less_floor` gives them) whose floor was undisturbed.
fn undisturbed(over: &[Vec<f64>], floor: &[Vec<f64>]) -> Vec<f64> {
    let quietest = floor.iter().flatten().copied().fold(f64::MAX, f64::min);
    let rounds = over.iter().flatten().zip(floor.iter().flatten());
    rounds.filter(|(_, f)| **f <= quietest * QUIET_FLOOR).map(|(r, _)| *r).collect()
}

/// Each round less the floor's round beside it, by load; None for a packet not measured in
/// the floor's rounds (the single runs of a first packet).
fn less_floor(loads: &[Vec<f64>], floor: &[Vec<f64>]) -> Option<Vec<Vec<f64>>> {
    let same_rounds = loads.len() == floor.len() && loads.iter().zip(floor).all(|(l, f)| l.len() == f.len());
    same_rounds.then(|| loads.iter().zip(floor).map(|(l, f)| l.iter().zip(f).map(|(r, f)| r - f).collect()).collect())
}

/// An Ethernet + IPv4 or IPv6 + TCP frame (6 bytes of payload), checksums left zero, TTL or
/// hop limit 255: a run forwarding it takes one off, and below 2 the program leaves the packet
/// to the stack (no route lookup).
fn tcp_frame(src: impl Into<IpAddr>, sport: u16, dst: impl Into<IpAddr>, dport: u16, flags: u8) -> Vec<u8> {
    let mut p = match (src.into(), dst.into()) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            let mut p = vec![0u8; 14 + 20];
            p[12..14].copy_from_slice(&[0x08, 0x00]);
            p[14..26].copy_from_slice(&[0x45, 0, 0, 46, 0, 0, 0x40, 0, 255, 6, 0, 0]);
            p[26..30].copy_from_slice(&src.octets());
            p[30..34].copy_from_slice(&dst.octets());
            p
        }
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            let mut p = vec![0u8; 14 + 40];
            p[12..14].copy_from_slice(&[0x86, 0xdd]);
            p[14..22].copy_from_slice(&[0x60, 0, 0, 0, 0, 26, 6, 255]);
            p[22..38].copy_from_slice(&src.octets());
            p[38..54].copy_from_slice(&dst.octets());
            p
        }
        (src, dst) => panic!("a frame from {src} to {dst}: one family per frame"),
    };
    let mut tcp = [0u8; 20 + 6];
    tcp[0..2].copy_from_slice(&sport.to_be_bytes());
    tcp[2..4].copy_from_slice(&dport.to_be_bytes());
    tcp[12] = 0x50;
    tcp[13] = flags;
    p.extend_from_slice(&tcp);
    p
}

/// `frame` (an IPv4 frame) in direct server return's tunnel from the node 10.0.0.2 to
/// `endpoint`, its port in the outer header's id.
fn in_tunnel(frame: &[u8], endpoint: Ipv4Addr, port: u16) -> Vec<u8> {
    let mut outer = [0u8; 20];
    outer[..10].copy_from_slice(&[0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 4]);
    outer[2..4].copy_from_slice(&((frame.len() - 14 + 20) as u16).to_be_bytes());
    outer[4..6].copy_from_slice(&port.to_be_bytes());
    outer[12..16].copy_from_slice(&[10, 0, 0, 2]);
    outer[16..20].copy_from_slice(&endpoint.octets());
    let sum: u32 = outer.chunks(2).map(|w| u32::from(u16::from_be_bytes([w[0], w[1]]))).sum();
    let folded = (sum & 0xffff) + (sum >> 16);
    outer[10..12].copy_from_slice(&(!((folded & 0xffff) + (folded >> 16)) as u16).to_be_bytes());
    [&frame[..14], &outer[..], &frame[14..]].concat()
}

/// `frame` (an IPv4 TCP frame) grown to an IP packet of 1500 bytes.
fn full_size(frame: &[u8]) -> Vec<u8> {
    let mut full = frame.to_vec();
    full.resize(14 + 1500, 0);
    full[16..18].copy_from_slice(&1500u16.to_be_bytes());
    full
}

/// Make `to_service` (client:40000 → target:80, whose flow `run` opened and the backend
/// answered) hit conntrack on every run of the kernel's `repeat`, which runs the program again
/// on the packet it rewrote: a second flow, in the family's established table `table`, whose
/// entry translates the rewritten packet back (client → backend becomes client → target), so
/// the runs alternate between the two flows.
fn establish<A: proxy_common::FlowAddr>(
    pins: &std::path::Path,
    table: &str,
    (client, target): (IpAddr, IpAddr),
) -> Result<()>
where
    proxy_common::CtKey<A>: aya::Pod,
{
    use proxy_common::{CtKey, CtValue, IPPROTO_TCP};
    let pinned = aya::maps::MapData::from_pin(bpf::pin_dir(pins).join(table))?;
    let mut conntrack: aya::maps::HashMap<_, CtKey<A>, CtValue> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(pinned))?;
    let forward_key = CtKey::<A>::new(client.into(), target.into(), 40000u16.to_be(), 80u16.to_be(), IPPROTO_TCP);
    let forward = conntrack.get(&forward_key, 0).context("the flow to the service was not confirmed")?;
    let back_key = CtKey::<A>::new(forward.src_addr, forward.dst_addr, forward.src_port, forward.dst_port, IPPROTO_TCP);
    let back = CtValue {
        src_addr: forward_key.src_addr.addr(),
        dst_addr: forward_key.dst_addr.addr(),
        src_port: forward_key.src_port,
        dst_port: forward_key.dst_port,
        addrs_csum_diff: proxy_common::addrs_csum_diff::<A>(
            &back_key.src_addr.addr(),
            &back_key.dst_addr.addr(),
            &forward_key.src_addr.addr(),
            &forward_key.dst_addr.addr(),
        ),
        route: proxy_common::CachedRoute::NONE,
        ..forward
    };
    let back_reply = CtValue {
        src_addr: back_key.dst_addr.addr(),
        dst_addr: back_key.src_addr.addr(),
        src_port: back_key.dst_port,
        dst_port: back_key.src_port,
        flags: forward.flags | proxy_common::ct::REPLY,
        addrs_csum_diff: proxy_common::addrs_csum_diff::<A>(
            &back.dst_addr,
            &back.src_addr,
            &back_key.dst_addr.addr(),
            &back_key.src_addr.addr(),
        ),
        route: proxy_common::CachedRoute::NONE,
        ..forward
    };
    conntrack.insert(&back_key, &back, 0)?;
    conntrack.insert(&back.pair_key::<A>(IPPROTO_TCP), &back_reply, 0)?;
    Ok(())
}

/// One object loaded with `forward_direct`: (label, ns per run in each round, how it ran) for each test
/// packet (with host routing, the established flow only: the other packets take the same path
/// either way).
fn tc_program_runs(
    repeat: u32,
    forward_direct: bool,
    endpoint_counters: bool,
) -> Result<Vec<(&'static str, Vec<f64>, String)>> {
    use aya::programs::{SchedClassifier, TestRun as _, TestRunOptions};
    use proxy_common::{TCP_ACK as ACK, TCP_SYN};
    let name = testbed::unique_name("kb-tc");
    let pins = testbed::PinRoot(std::path::PathBuf::from(format!("/sys/fs/bpf/{name}")));
    let mut cfg = DatapathConfig::new(pins.0.clone(), "/nonexistent".into());
    cfg.forward_direct = if forward_direct { bpf::ForwardDirect::Always } else { bpf::ForwardDirect::Never };
    // As the agent runs by default: the service range (10.96.0.0/12 here) refused.
    cfg.refuse_service_range = true;
    // Room for every flow not answered yet that the new-flow loops below leave (two entries
    // each, about 120,000): once the LRU table is full, every 128th insert pays for a batch of
    // evictions, and with four inserts a round that was always the same frontend's (the random
    // twin measured 660 ns over the Maglev frontend).
    // (And the direct server return loop's, as many again.)
    cfg.max_conntrack_new = 8 * proxy_common::defaults::MAX_CONNTRACK_NEW;
    // Room for every endpoint programmed below (about 1,000 of each family).
    cfg.endpoint_counters = if endpoint_counters { 4096 } else { 0 };
    let mut ebpf = bpf::open_object(&cfg)?;
    let range = kpr::model::cidr::Cidr::new(Ipv4Addr::new(10, 96, 0, 0).into(), 12).context("range")?;
    bpf::write_service_ranges(&mut ebpf, &[range].into())?;
    bpf::load_tc_programs(&mut ebpf)?;
    bpf::load_xdp_program(&mut ebpf)?;
    let mut maps = kpr::datapath::bpf::BpfMaps::take_from(&mut ebpf)?;
    maps.endpoint_counters = cfg.endpoint_counters;
    maps.maglev_seed = cfg.maglev_seed;
    maps.maglev_table_size = cfg.maglev_table_size;
    // The test packets come from outside the cluster: the target also gets its entry for
    // outside clients.
    let backend = Ipv4Addr::new(10, 244, 1, 2);
    let mut desired = desired_with(10_000, 4, backend);
    let target = desired[&service_key(TARGET_IP, 80, Protocol::Tcp)].clone();
    desired.insert(
        kpr::model::desired::frontend_key(TARGET_IP, 80, Protocol::Tcp, proxy_common::SCOPE_EXTERNAL),
        target.clone(),
    );
    // The same frontend for outside clients at port 81, picking by Maglev (its table written),
    // and its twin at port 82 picking at random, measured alike.
    let maglev =
        kpr::model::desired::DesiredPort { flags: target.flags | proxy_common::SERVICE_FLAG_MAGLEV, ..target.clone() };
    desired
        .insert(kpr::model::desired::frontend_key(TARGET_IP, 81, Protocol::Tcp, proxy_common::SCOPE_EXTERNAL), maglev);
    desired.insert(
        kpr::model::desired::frontend_key(TARGET_IP, 82, Protocol::Tcp, proxy_common::SCOPE_EXTERNAL),
        target.clone(),
    );
    // Direct server return at port 83 (its endpoint on another node) and its masquerading twin
    // at port 84, as kube-proxy's traffic policy Cluster.
    let snat = target.flags | proxy_common::SERVICE_FLAG_SNAT;
    let dsr = kpr::model::desired::DesiredPort {
        flags: target.flags | proxy_common::SERVICE_FLAG_DSR,
        remote: vec![backend.into()],
        ..target.clone()
    };
    let external =
        |port| kpr::model::desired::frontend_key(TARGET_IP, port, Protocol::Tcp, proxy_common::SCOPE_EXTERNAL);
    desired.insert(external(83), dsr);
    // And at port 85 as the endpoint's node has it (the endpoint its own): where a tunnelled
    // packet is taken out.
    let dsr_here =
        kpr::model::desired::DesiredPort { flags: target.flags | proxy_common::SERVICE_FLAG_DSR, ..target.clone() };
    desired.insert(external(85), dsr_here);
    desired.insert(external(84), kpr::model::desired::DesiredPort { flags: snat, ..target });
    // The node's address (the masquerade source, the tunnel's outer source), as the agent writes it.
    {
        let map = bpf::open_pinned_map(&pins.0, proxy_common::map_names::LINKS)?;
        let mut links: aya::maps::HashMap<_, u32, proxy_common::LinkInfo> =
            aya::maps::HashMap::try_from(aya::maps::Map::HashMap(map))?;
        let node = proxy_common::LinkInfo { addr: u32::from_ne_bytes([10, 0, 0, 1]), ..Default::default() };
        links.insert(&0, &node, 0)?;
    }
    // And an IPv6 service like it.
    let backend6 = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 2);
    let target6 = desired_with(1, 1, backend6)[&service_key(TARGET_IP6, 80, Protocol::Tcp)].clone();
    desired.insert(service_key(TARGET_IP6, 80, Protocol::Tcp), target6.clone());
    desired.insert(
        kpr::model::desired::frontend_key(TARGET_IP6, 80, Protocol::Tcp, proxy_common::SCOPE_EXTERNAL),
        target6,
    );
    Programmer::recover(&mut maps)?.apply(&desired, &mut maps);
    let prog: &SchedClassifier =
        ebpf.program(proxy_common::program_names::TC_INGRESS).context("tc program")?.try_into()?;
    // (ns per run, the packet as the last run left it)
    // (ns per run, the packet as the last run left it, the last run's verdict)
    let run_with_output = |input: &[u8], repeat: u32| -> Result<(Duration, Vec<u8>, u32)> {
        let mut buf = vec![0u8; input.len().max(256)];
        let opts =
            TestRunOptions { data_in: Some(input), data_out: Some(&mut buf), repeat, ..TestRunOptions::default() };
        let result = prog.test_run(opts)?;
        Ok((result.duration, buf, result.return_value))
    };
    let run = |input: &[u8], repeat: u32| -> Result<Duration> { Ok(run_with_output(input, repeat)?.0) };
    // The XDP program on a packet come in by out0: (ns per run, the last run's action).
    let xdp: &aya::programs::Xdp = ebpf.program(proxy_common::program_names::XDP).context("XDP program")?.try_into()?;
    // SAFETY: a NUL-terminated name.
    let out0 = unsafe { libc::if_nametoindex(c"out0".as_ptr()) };
    let run_xdp = |input: &[u8], repeat: u32| -> Result<(Duration, u32)> {
        // `struct xdp_md`: data 0, data_end, data_meta 0, ingress_ifindex.
        let mut ctx = [0u8; 24];
        ctx[4..8].copy_from_slice(&(input.len() as u32).to_ne_bytes());
        ctx[12..16].copy_from_slice(&out0.to_ne_bytes());
        let mut buf = vec![0u8; input.len().max(256)];
        let opts = TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut buf),
            ctx_in: Some(&ctx),
            repeat,
            ..TestRunOptions::default()
        };
        let result = xdp.test_run(opts)?;
        Ok((result.duration, result.return_value))
    };
    // An established flow in each family: its first packet, the backend's answer and the
    // client's next packet, as on the wire, then the flow back (`establish`).
    let client = Ipv4Addr::new(10, 0, 0, 99);
    let to_service = tcp_frame(client, 40000, TARGET_IP, 80, ACK);
    let client6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x99);
    let to_service6 = tcp_frame(client6, 40000, TARGET_IP6, 80, ACK);
    for (frame, client, target, backend) in [
        (&to_service, IpAddr::from(client), IpAddr::from(TARGET_IP), IpAddr::from(backend)),
        (&to_service6, client6.into(), TARGET_IP6.into(), backend6.into()),
    ] {
        run(frame, 1)?;
        run(&tcp_frame(backend, BENCH_PORT, client, 40000, ACK), 1)?;
        // The client's acknowledgement of the answer establishes the flow (SYN_RECV →
        // ESTABLISHED, as nf_conntrack).
        run(frame, 1)?;
        match target {
            IpAddr::V4(_) => {
                establish::<proxy_common::Addr4>(&pins.0, proxy_common::map_names::CONNTRACK4, (client, target))?
            }
            IpAddr::V6(_) => {
                establish::<proxy_common::Addr>(&pins.0, proxy_common::map_names::CONNTRACK6, (client, target))?
            }
        }
        // Every run a hit: one run takes the packet to the backend, the next brings it back.
        let dst_after = |runs: u32| -> Result<IpAddr> {
            let out = run_with_output(frame, runs)?.1;
            Ok(match target {
                IpAddr::V4(_) => <[u8; 4]>::try_from(&out[30..34])?.into(),
                IpAddr::V6(_) => <[u8; 16]>::try_from(&out[38..54])?.into(),
            })
        };
        if dst_after(1)? != backend || dst_after(2)? != target {
            bail!("the established flow's packets to {target} were not translated back and forth");
        }
    }
    // Sent straight out (TC_ACT_REDIRECT), or handed to the host stack (TC_ACT_OK).
    let verdict = run_with_output(&to_service, 1)?.2;
    if verdict != if forward_direct { 7 } else { 0 } {
        bail!("the established flow's packet got verdict {verdict} (forward_direct {forward_direct})");
    }
    // An ARP frame returns at the first check: the harness's own cost per run (the floor).
    let mut arp = tcp_frame(Ipv4Addr::UNSPECIFIED, 0, Ipv4Addr::UNSPECIFIED, 0, ACK);
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    // The floor in every object: each round's figures are also taken against its round's floor.
    // (label, packet, run by the XDP program)
    let mut inputs = vec![
        ("established_flow", to_service.clone(), false),
        // A full-size segment of that flow (IP 1500 bytes), as a bulk transfer's without GRO:
        // the host's forwarding path checks its size against the route's MTU (`too_big`).
        ("established_flow_full_size", full_size(&to_service), false),
        ("established_flow_ipv6", to_service6.clone(), false),
        ("floor_non_ip", arp.clone(), false),
    ];
    if forward_direct {
        inputs.push(("not_a_service", tcp_frame(client, 40000, Ipv4Addr::new(10, 244, 9, 9), 80, ACK), false));
        // The same established flows through XDP (`--xdp`): translated and sent back out of
        // out0 (`XDP_TX`), where the routes of both directions leave; and the floor of its
        // harness.
        inputs.push(("xdp_established_flow", to_service.clone(), true));
        inputs.push(("xdp_established_flow_ipv6", to_service6, true));
        inputs.push(("xdp_floor_non_ip", arp.clone(), true));
        // What XDP costs a packet it leaves to tc: one of no flow (a lookup in the flow cache
        // and both tables, then passed).
        inputs.push(("xdp_passed_not_a_flow", tcp_frame(client, 40001, TARGET_IP, 80, ACK), true));
    }
    // Runs in TestRuns of CHUNK: the packet's TTL lasts that long, and the harness's cost per
    // TestRun (building the packet) is spread over them. The packets take turns in ROUNDS and
    // each gets the median of its rounds: a burst of load from elsewhere on the machine (a
    // neighbour of a VM) lands in some rounds of every packet, not in all of one packet's.
    const CHUNK: u32 = 200;
    const ROUNDS: u32 = 9;
    let chunks_per_round = repeat.div_ceil(CHUNK * ROUNDS);
    let how = format!(
        "{} runs, {CHUNK} per TestRun, median of {ROUNDS} alternating rounds",
        chunks_per_round * CHUNK * ROUNDS
    );
    let mut per_round: Vec<Vec<f64>> = vec![Vec::new(); inputs.len()];
    for _ in 0..ROUNDS {
        for ((label, input, by_xdp), rounds) in inputs.iter().zip(&mut per_round) {
            let mut total = Duration::ZERO;
            for _ in 0..chunks_per_round {
                if !by_xdp {
                    total += run(input, CHUNK)?;
                    continue;
                }
                // Both flows' entries refreshed by tc first (XDP leaves an entry due for its
                // refresh to tc, and the runs take longer than a refresh's second).
                run(input, 2)?;
                let (took, action) = run_xdp(input, CHUNK)?;
                let wanted = if *label == "xdp_floor_non_ip" || label.starts_with("xdp_passed") { 2 } else { 3 };
                if action != wanted {
                    bail!("{label}: XDP action {action}, not {wanted}");
                }
                total += took;
            }
            // TestRun reports the mean time of one run.
            rounds.push(total.as_nanos() as f64 / f64::from(chunks_per_round));
        }
    }
    let mut out = Vec::new();
    for ((label, ..), rounds) in inputs.iter().zip(per_round) {
        out.push((*label, rounds, how.clone()));
    }
    if forward_direct {
        // A connection's first packet: a SYN from another client address every run (a new
        // flow each time: backend pick, two conntrack entries; a NodePort would add the SNAT
        // port search), and its endpoint's answer (the flow's first reply: its state, and the
        // endpoint's answer counted for outlier detection). One run per TestRun, so beside
        // its own floor.
        let runs = repeat.min(70_000);
        let (mut total, mut answers, mut floor) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        for i in 0..runs {
            let client = Ipv4Addr::new(10, (i >> 16) as u8, (i >> 8) as u8, i as u8);
            total += run(&tcp_frame(client, 40000, TARGET_IP, 80, TCP_SYN), 1)?;
            answers += run(&tcp_frame(backend, BENCH_PORT, client, 40000, TCP_SYN | ACK), 1)?;
            floor += run(&arp, 1)?;
        }
        // Then the same to the Maglev frontend (port 81: its pick a table slot) and to its
        // random twin (port 82), side by side from clients of their own, answered alike: a loop
        // of their own, so that `new_flow` meets the tables it always met. Which goes first is
        // drawn for each round: a cost that comes back every so many inserts (most likely the
        // LRU table moving free entries to this CPU's list, 128 at a time) fell on the same
        // frontend with a fixed order, and with strict turns (an even period): about 280 ns a
        // SYN, two random frontends alike.
        let (mut maglev, mut twin) = (Duration::ZERO, Duration::ZERO);
        for i in 0..runs {
            let mut turn = [(81, 11, &mut maglev), (82, 12, &mut twin)];
            if (i.wrapping_mul(0x9e37_79b9) >> 31) & 1 == 1 {
                turn.reverse();
            }
            for (port, first, took) in turn {
                let client = Ipv4Addr::new(first, (i >> 16) as u8, (i >> 8) as u8, i as u8);
                let (ns, out, _) = run_with_output(&tcp_frame(client, 40000, TARGET_IP, port, TCP_SYN), 1)?;
                *took += ns;
                let picked = Ipv4Addr::new(out[30], out[31], out[32], out[33]);
                run(&tcp_frame(picked, BENCH_PORT, client, 40000, TCP_SYN | ACK), 1)?;
            }
        }
        // Direct server return's first packet (port 83: the endpoint's flag read, no SNAT port
        // search, the packet put in its tunnel) against its masquerading twin's (port 84), in
        // turns drawn as above; and the endpoint's node's share of it: a SYN out of the tunnel
        // (to port 85, whose endpoint is this node's: the frontend looked up, the endpoint
        // checked, the header taken off, the flow opened to the endpoint the tunnel names).
        let (mut dsr, mut snat, mut decapsulated) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        for i in 0..runs {
            let mut turn = [(83, 13, &mut dsr), (84, 14, &mut snat)];
            if (i.wrapping_mul(0x9e37_79b9) >> 31) & 1 == 1 {
                turn.reverse();
            }
            for (port, first, took) in turn {
                let client = Ipv4Addr::new(first, (i >> 16) as u8, (i >> 8) as u8, i as u8);
                let (ns, out, _) = run_with_output(&tcp_frame(client, 40000, TARGET_IP, port, TCP_SYN), 1)?;
                *took += ns;
                if i == 0 && port == 83 && (out[23], &out[30..34]) != (4, &backend.octets()[..]) {
                    bail!("the direct server return SYN was not put in a tunnel to {backend}");
                }
            }
            let client = Ipv4Addr::new(15, (i >> 16) as u8, (i >> 8) as u8, i as u8);
            let tunnelled = in_tunnel(&tcp_frame(client, 40000, TARGET_IP, 85, TCP_SYN), backend, BENCH_PORT);
            let (ns, out, _) = run_with_output(&tunnelled, 1)?;
            decapsulated += ns;
            if i == 0 && (&out[26..30], &out[30..34]) != (&client.octets()[..], &backend.octets()[..]) {
                bail!("the tunnelled SYN did not come out to {backend} from {client}: {out:?}");
            }
        }
        // An established flow's packet at the entry node, direct server return's (put in the
        // tunnel: the room made, the outer header written) against a translated one's, one run
        // per TestRun (the kernel's repeat would run the program again on the tunnelled packet).
        let dsr_client = Ipv4Addr::new(10, 254, 0, 1);
        run(&tcp_frame(dsr_client, 40000, TARGET_IP, 83, TCP_SYN), 1)?;
        let dsr_segment = tcp_frame(dsr_client, 40000, TARGET_IP, 83, ACK);
        run(&dsr_segment, 1)?; // the client's ACK confirms the flow
        let (mut dsr_est, mut est) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..runs {
            dsr_est += run(&dsr_segment, 1)?;
            est += run(&to_service, 1)?;
        }
        // The answer was a flow's: translated back to the service's address.
        let client = Ipv4Addr::new(10, 255, 0, 1);
        run(&tcp_frame(client, 40000, TARGET_IP, 80, TCP_SYN), 1)?;
        let answered = run_with_output(&tcp_frame(backend, BENCH_PORT, client, 40000, TCP_SYN | ACK), 1)?.1;
        if answered[26..30] != TARGET_IP.octets() {
            bail!("the endpoint's answer to a new flow was not translated back");
        }
        let how = format!("{runs} TestRuns of one run");
        out.push(("new_flow", vec![total.as_nanos() as f64 / f64::from(runs)], how.clone()));
        out.push(("new_flow_answer", vec![answers.as_nanos() as f64 / f64::from(runs)], how.clone()));
        out.push(("new_flow_maglev", vec![maglev.as_nanos() as f64 / f64::from(runs)], how.clone()));
        out.push(("new_flow_maglev_random_twin", vec![twin.as_nanos() as f64 / f64::from(runs)], how.clone()));
        out.push(("new_flow_dsr", vec![dsr.as_nanos() as f64 / f64::from(runs)], how.clone()));
        out.push(("new_flow_dsr_snat_twin", vec![snat.as_nanos() as f64 / f64::from(runs)], how.clone()));
        out.push(("new_flow_dsr_decapsulated", vec![decapsulated.as_nanos() as f64 / f64::from(runs)], how.clone()));
        out.push(("established_flow_dsr_single_run", vec![dsr_est.as_nanos() as f64 / f64::from(runs)], how.clone()));
        out.push(("established_flow_single_run", vec![est.as_nanos() as f64 / f64::from(runs)], how.clone()));
        out.push(("floor_single_run", vec![floor.as_nanos() as f64 / f64::from(runs)], how));
    }
    Ok(out)
}

/// NodePort through kpr's tc datapath vs the direct routed path vs iptables DNAT rules written
/// the way kube-proxy writes them, in one topology (client ns → node ns → pod ns), A/B/C rounds.
/// NodePort from an external client through kpr and through kube-proxy's iptables rules:
/// connection rate (`rounds` × `per_round`), throughput (`iperf_secs`), and a churn soak of
/// `churn` short connections per path (port-space turnovers, failed connections).
fn node_port_paths(rounds: usize, per_round: usize, iperf_secs: u32, churn: usize) -> Result<serde_json::Value> {
    let name = testbed::unique_name("kb-np");
    let ext = testbed::Netns::new(&format!("{name}-ext"))?;
    let topology = Topology::new(&name, &["pod"])?;
    let node = &topology.client;
    let pod = topology.pods[0].ip;
    node.ip(&["link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &ext.name])?;
    node.ip(&["addr", "add", "10.0.0.1/24", "dev", "eth0"])?;
    node.ip(&["link", "set", "eth0", "up"])?;
    ext.ip(&["addr", "add", "10.0.0.100/24", "dev", "eth0"])?;
    ext.ip(&["link", "set", "eth0", "up"])?;
    ext.ip(&["route", "add", "10.244.0.0/16", "via", "10.0.0.1"])?;
    // IPv6 beside IPv4: the same paths over fd00::/64 to the pod's IPv6 address.
    node.ip(&["-6", "addr", "add", "fd00::1/64", "dev", "eth0", "nodad"])?;
    ext.ip(&["-6", "addr", "add", "fd00::100/64", "dev", "eth0", "nodad"])?;
    ext.ip(&["-6", "route", "add", "fd00:10:244::/48", "via", "fd00::1"])?;
    node.route_packets()?;
    let pod6 = topology.pods[0].ip6;
    // kube-proxy's iptables rules for one NodePort service (30090 → pod:8081), masqueraded, in
    // each family (ip6tables for IPv6).
    for (iptables, pod) in [("iptables", pod.to_string()), ("ip6tables", format!("[{pod6}]"))] {
        node.sh(&kube_proxy_node_port_rules(iptables, &pod))?;
    }

    let pod_ns = &topology.pods[0].netns;
    for addr in [SocketAddr::from((pod, BENCH_PORT)), SocketAddr::from((pod6, BENCH_PORT))] {
        let listener = pod_ns.run(move || std::net::TcpListener::bind(addr))??;
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let _ = std::io::Write::write_all(&mut conn, b"pod\n");
            }
        });
    }
    let mut out = node_port_bench(&name, &ext, &topology, rounds, per_round, iperf_secs, churn)?;
    if rounds > 0 {
        // Packets per second, in a topology of their own (the generator's, `xdp`).
        let pps = xdp::node_port_pps(rounds.min(8), 1_000_000)?;
        for (path, figures) in pps.as_object().into_iter().flatten().filter(|(_, f)| f.is_object()) {
            for (key, value) in figures.as_object().into_iter().flatten() {
                out[path][key] = value.clone();
            }
        }
        out["pps_packets_per_round"] = pps["packets_per_round"].clone();
    }
    Ok(out)
}

/// kube-proxy's rules for one masqueraded NodePort (30090 → `pod`:BENCH_PORT), by `iptables`
/// or `ip6tables`. One difference: MASQUERADE keeps to ports outside kpr's SNAT range. Both
/// translate on this one node, to the same pod, from the same address: a port of netfilter's
/// masquerade that kpr also holds for one of its flows has the pod's reply caught by kpr's
/// conntrack (upstream's rule picks from every port: about one connection in ten stalled for
/// a SYN retransmission, and the iptables path measured 10 conn/s).
fn kube_proxy_node_port_rules(iptables: &str, pod: &str) -> String {
    let (kpr_min, _) = bpf::snat_port_range();
    let masquerade_ports = if kpr_min >= 61_000 { "1024-29999" } else { "61000-65535" };
    format!(
        "iptables -t nat -N KUBE-SERVICES && iptables -t nat -N KUBE-NODEPORTS && iptables -t nat -N KUBE-EXT-BENCH && \
         iptables -t nat -N KUBE-SVC-BENCH && iptables -t nat -N KUBE-SEP-BENCH && iptables -t nat -N KUBE-MARK-MASQ && \
         iptables -t nat -N KUBE-POSTROUTING && \
         iptables -t nat -A PREROUTING -m comment --comment 'kubernetes service portals' -j KUBE-SERVICES && \
         iptables -t nat -A POSTROUTING -j KUBE-POSTROUTING && \
         iptables -t nat -A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS && \
         iptables -t nat -A KUBE-NODEPORTS -p tcp --dport 30090 -j KUBE-EXT-BENCH && \
         iptables -t nat -A KUBE-EXT-BENCH -j KUBE-MARK-MASQ && iptables -t nat -A KUBE-EXT-BENCH -j KUBE-SVC-BENCH && \
         iptables -t nat -A KUBE-SVC-BENCH -j KUBE-SEP-BENCH && \
         iptables -t nat -A KUBE-SEP-BENCH -p tcp -j DNAT --to-destination {pod}:{BENCH_PORT} && \
         iptables -t nat -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000 && \
         iptables -t nat -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN && \
         iptables -t nat -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000 && \
         iptables -t nat -A KUBE-POSTROUTING -p tcp -j MASQUERADE --random-fully --to-ports {masquerade_ports}"
    )
    .replace("iptables -t nat", &format!("{iptables} -t nat"))
}

fn node_port_bench(
    name: &str,
    ext: &testbed::Netns,
    topology: &Topology,
    rounds: usize,
    per_round: usize,
    iperf_secs: u32,
    churn: usize,
) -> Result<serde_json::Value> {
    let node = &topology.client;
    let (pod, pod6) = (topology.pods[0].ip, topology.pods[0].ip6);
    let pod_ns = &topology.pods[0].netns;
    let cgroup = Cgroup::new(name)?;
    let pins = testbed::PinRoot(std::path::PathBuf::from(format!("/sys/fs/bpf/{name}")));
    let mut cfg = DatapathConfig::new(pins.0.clone(), cgroup.path.clone());
    // The XDP program loaded, on eth0 only in the rounds measuring it (`kpr-xdp`).
    cfg.xdp = bpf::XdpSetting::Native;
    let snat_ports = cfg.snat_ports;
    let settings = NodeSettings {
        name: "bench".into(),
        node_ips: vec![Ipv4Addr::new(10, 0, 0, 1).into(), "fd00::1".parse()?],
        tc_links: TcLinks::Only(vec!["eth0".into(), "veth0".into()]),
        ..Default::default()
    };
    // Links are per network namespace: read and attach them in the node's.
    let (datapath, with_xdp) = node.run(move || -> Result<_> {
        let mut datapath = BpfDatapath::load(&cfg)?;
        let mut plan = kpr::model::node::plan(&kpr::source::host::snapshot()?, None, &settings);
        let xdp_links = std::mem::take(&mut plan.xdp_links);
        datapath.host.apply_node(&plan)?;
        plan.xdp_links = xdp_links;
        Ok((datapath, plan))
    })??;
    let mut datapath = datapath;
    let without_xdp = kpr::model::node::NodePlan { xdp_links: Default::default(), ..with_xdp.clone() };
    let mut desired = Desired::new();
    let np =
        kpr::model::desired::frontend_key(Ipv4Addr::UNSPECIFIED, 30080, Protocol::Tcp, proxy_common::SCOPE_EXTERNAL);
    let name_port =
        ServicePortName { service: ObjectKey::new("bench", "np"), port: String::new(), protocol: Protocol::Tcp };
    desired.insert(
        np,
        DesiredPort {
            name: name_port,
            backends: vec![(pod.into(), BENCH_PORT)],
            flags: proxy_common::SERVICE_FLAG_SNAT,
            source_ranges: vec![],
            affinity_timeout: 0,
            serving: vec![],
            alive: None,
            remote: Vec::new(),
        },
    );
    let np6 =
        kpr::model::desired::frontend_key(Ipv6Addr::UNSPECIFIED, 30080, Protocol::Tcp, proxy_common::SCOPE_EXTERNAL);
    let mut entry6 = desired[&np].clone();
    entry6.backends = vec![(pod6.into(), BENCH_PORT)];
    desired.insert(np6, entry6);
    Programmer::recover(&mut datapath.maps)?.apply(&desired, &mut datapath.maps);

    let node6: Ipv6Addr = "fd00::1".parse()?;
    let paths: [(&'static str, SocketAddr); 6] = [
        ("direct", (pod, BENCH_PORT).into()),
        ("kpr", (Ipv4Addr::new(10, 0, 0, 1), 30080).into()),
        ("iptables", (Ipv4Addr::new(10, 0, 0, 1), 30090).into()),
        ("direct_ipv6", (pod6, BENCH_PORT).into()),
        ("kpr_ipv6", (node6, 30080).into()),
        ("ip6tables", (node6, 30090).into()),
    ];
    let mut out = serde_json::Map::new();
    if churn > 0 {
        out.insert("churn".into(), node_port_churn(ext, &pins.0, snat_ports, churn)?);
    }
    if rounds == 0 {
        drop(datapath);
        return Ok(serde_json::Value::Object(out));
    }
    // Per path: (rate, p50, p99, each round's rate).
    type Rates = BTreeMap<&'static str, (f64, f64, f64, Vec<f64>)>;
    let rates = ext.run(move || -> Result<Rates> {
        let mut lat: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
        let mut time: BTreeMap<&str, Duration> = BTreeMap::new();
        let mut round_rates: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        for (_, addr) in paths {
            for _ in 0..20 {
                one_connection(addr)?;
            }
        }
        for _ in 0..rounds {
            for (label, addr) in paths {
                let started = Instant::now();
                for _ in 0..per_round {
                    lat.entry(label)
                        .or_default()
                        .push(one_connection(addr).with_context(|| format!("{label} connect"))?);
                }
                *time.entry(label).or_default() += started.elapsed();
                round_rates.entry(label).or_default().push(per_round as f64 / started.elapsed().as_secs_f64());
            }
        }
        Ok(paths
            .iter()
            .map(|(label, _)| {
                let mut l = lat[label].clone();
                l.sort();
                let rate = l.len() as f64 / time[label].as_secs_f64();
                (*label, (rate, percentile(&l, 0.5), percentile(&l, 0.99), round_rates[label].clone()))
            })
            .collect())
    })??;
    println!(
        "\nNodePort, new TCP connection per request from an external client ({rounds} rounds × {per_round}, alternating):"
    );
    println!("{:>11} {:>10} {:>10} {:>10} {:>10}", "path", "conn/s", "vs direct", "p50", "p99");
    for (label, addr) in paths {
        // Each family against its own direct path.
        let direct = &rates[if addr.is_ipv4() { "direct" } else { "direct_ipv6" }];
        let (rate, p50, p99, rounds) = &rates[label];
        let ratio = median_ratio(rounds, &direct.3);
        println!("{label:>11} {rate:>10.0} {ratio:>10.3} {p50:>8.1}µs {p99:>8.1}µs");
        out.insert(
            label.to_owned(),
            json!({"conn_per_s": rate, "ratio_vs_direct": ratio, "ratio_vs_direct_overall": rate / direct.0,
                   "connect_p50_us": p50, "connect_p99_us": p99}),
        );
    }

    // New connections with the XDP program on eth0 (`--xdp native`) against tc alone, in
    // alternating rounds: XDP passes a connection's packets to tc here (the pod is behind
    // another link), and must cost new connections nothing. And with a stub passing every
    // packet in its place: what any XDP program on a veth costs (the link then takes its
    // packets through a ring and NAPI), not kpr's.
    let (mut tc_rounds, mut xdp_rounds, mut stub_rounds) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        for xdp in [0, 1, 2] {
            let plan = if xdp == 1 { with_xdp.clone() } else { without_xdp.clone() };
            datapath = node.run(move || datapath.host.apply_node(&plan).map(|()| datapath))??;
            let _stub = if xdp == 2 { Some(node.run(|| kpr_tests::attach_xdp_stub("eth0", 2))??) } else { None };
            let addr = paths[1].1;
            let rate = ext.run(move || -> Result<f64> {
                let started = Instant::now();
                for _ in 0..per_round {
                    one_connection(addr)?;
                }
                Ok(per_round as f64 / started.elapsed().as_secs_f64())
            })??;
            [&mut tc_rounds, &mut xdp_rounds, &mut stub_rounds][xdp].push(rate);
        }
    }
    let plan = without_xdp.clone();
    datapath = node.run(move || datapath.host.apply_node(&plan).map(|()| datapath))??;
    if rounds > 0 {
        let (xdp_rate, tc_rate, ratio) =
            (median(xdp_rounds.clone()), median(tc_rounds.clone()), median_ratio(&xdp_rounds, &tc_rounds));
        let (stub_rate, stub_ratio) = (median(stub_rounds.clone()), median_ratio(&stub_rounds, &tc_rounds));
        println!(
            "    kpr-xdp {xdp_rate:>10.0} conn/s, {ratio:.3}× kpr's tc path alongside ({tc_rate:.0} conn/s); an XDP stub passing all: {stub_rate:.0} conn/s, {stub_ratio:.3}× ({rounds} alternating rounds × {per_round})"
        );
        out.insert(
            "kpr-xdp".into(),
            json!({"conn_per_s": xdp_rate, "conn_per_s_ratio_vs_tc": ratio, "tc_alongside_conn_per_s": tc_rate,
                   "xdp_stub_conn_per_s": stub_rate, "xdp_stub_ratio_vs_tc": stub_ratio}),
        );
    }

    // Throughput with iperf3 (when installed): one TCP stream per path, the paths alternating.
    if iperf_secs > 0 && Command::new("iperf3").arg("--version").output().is_ok() {
        let mut server = Command::new("ip")
            .args(["netns", "exec", &pod_ns.name, "iperf3", "-s", "-p", "5201"])
            .stdout(std::process::Stdio::null())
            .spawn()?;
        std::thread::sleep(Duration::from_millis(300));
        let mut desired2 = desired.clone();
        let np2 = kpr::model::desired::frontend_key(
            Ipv4Addr::UNSPECIFIED,
            30081,
            Protocol::Tcp,
            proxy_common::SCOPE_EXTERNAL,
        );
        let mut entry = desired[&np].clone();
        entry.backends = vec![(pod.into(), 5201)];
        desired2.insert(np2, entry);
        Programmer::recover(&mut datapath.maps)?.apply(&desired2, &mut datapath.maps);
        node.sh(&format!(
            "iptables -t nat -A KUBE-NODEPORTS -p tcp --dport 30091 -j KUBE-EXT-BENCH2 2>/dev/null || (iptables -t nat -N KUBE-EXT-BENCH2 && \
             iptables -t nat -A KUBE-EXT-BENCH2 -j KUBE-MARK-MASQ && iptables -t nat -A KUBE-EXT-BENCH2 -p tcp -j DNAT --to-destination {pod}:5201 && \
             iptables -t nat -A KUBE-NODEPORTS -p tcp --dport 30091 -j KUBE-EXT-BENCH2)"
        ))?;
        let paths = [
            ("direct", pod.to_string(), 5201),
            ("kpr", "10.0.0.1".into(), 30081),
            ("iptables", "10.0.0.1".into(), 30091),
        ];
        let iperf = |host: &str, port: u16| -> Result<serde_json::Value> {
            let outp = Command::new("ip")
                .args(["netns", "exec", &ext.name, "iperf3", "-c", host, "-p", &port.to_string()])
                .args(["-t", &iperf_secs.to_string(), "-J"])
                .output()?;
            Ok(serde_json::from_slice(&outp.stdout).unwrap_or_default())
        };
        // The paths take turns in IPERF_ROUNDS rounds, as the connection rates do: a slow
        // spell of the machine lands in one round of every path, not in all of one path's.
        const IPERF_ROUNDS: usize = 5;
        // Per path, each round's figure (None: iperf3 gave none).
        let mut gbit: BTreeMap<&str, Vec<Option<f64>>> = BTreeMap::new();
        for round in 0..IPERF_ROUNDS {
            for (label, host, port) in &paths {
                // The one server may still be closing the last test ("the server is busy"):
                // one more try, and a failure is told, not shown as a rate of 0.
                let mut v = iperf(host, *port)?;
                if v["end"]["sum_received"]["bits_per_second"].as_f64().is_none() {
                    eprintln!("round {round}, {label}: iperf3 failed ({}); once more", v["error"]);
                    std::thread::sleep(Duration::from_secs(1));
                    v = iperf(host, *port)?;
                }
                let bps = v["end"]["sum_received"]["bits_per_second"].as_f64();
                if bps.is_none() {
                    eprintln!("round {round}, {label}: iperf3 failed again ({})", v["error"]);
                }
                gbit.entry(*label).or_default().push(bps.map(|b| b / 1e9));
            }
        }
        // Per path: the median of its rounds, and the median of its rounds' ratios to the
        // direct path's round (the rounds where both gave a figure).
        let (mut tput, mut ratios) = (serde_json::Map::new(), serde_json::Map::new());
        for (label, ..) in &paths {
            let rounds: Vec<f64> = gbit[label].iter().flatten().copied().collect();
            if rounds.is_empty() {
                tput.insert((*label).to_owned(), serde_json::Value::Null);
                continue;
            }
            let (both, direct): (Vec<f64>, Vec<f64>) =
                gbit[label].iter().zip(&gbit["direct"]).filter_map(|(r, d)| Some(((*r)?, (*d)?))).unzip();
            let ratio = (!both.is_empty()).then(|| median_ratio(&both, &direct));
            let ratio_text = ratio.map(|r| format!(", {r:.3}× direct")).unwrap_or_default();
            let gbit_s = median(rounds.clone());
            println!(
                "{label:>10} throughput {gbit_s:.2} Gbit/s{ratio_text} (median of {} of {IPERF_ROUNDS} alternating rounds of {iperf_secs} s: {rounds:.2?})",
                rounds.len()
            );
            tput.insert((*label).to_owned(), json!(gbit_s));
            ratios.insert((*label).to_owned(), json!(ratio));
        }
        out.insert("throughput_ratio_vs_direct".into(), serde_json::Value::Object(ratios));
        out.insert("throughput_gbit_s".into(), serde_json::Value::Object(tput));
        let _ = server.kill();
        let _ = server.wait();
    }
    drop(datapath);
    Ok(serde_json::Value::Object(out))
}

/// `total` short connections per path, one after another, to the masqueraded NodePort with
/// one endpoint: every connection takes a SNAT port toward the same backend, so the port
/// space turns over `total / ports` times. Counts the connections that failed.
fn node_port_churn(
    ext: &testbed::Netns,
    pin_root: &std::path::Path,
    snat_ports: (u16, u16),
    total: usize,
) -> Result<serde_json::Value> {
    let ports = usize::from(snat_ports.1 - snat_ports.0) + 1;
    // iptables first: its MASQUERADE picks ports from the whole range, and replies to a port
    // that one of kpr's flows still holds would be taken for kpr's (two proxies on one node
    // is this benchmark's arrangement only).
    let paths = [
        ("iptables", SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 30090)),
        ("kpr", SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 30080)),
    ];
    println!(
        "\nNodePort churn: {total} short connections per path, one endpoint; kpr's SNAT ports {}-{} ({ports}): {:.1} turnovers",
        snat_ports.0,
        snat_ports.1,
        total as f64 / ports as f64
    );
    println!("{:>10} {:>10} {:>10} {:>10}", "path", "failed", "conn/s", "seconds");
    let mut out = serde_json::Map::new();
    for (label, addr) in paths {
        let (failed, elapsed) = ext.run(move || {
            let started = Instant::now();
            let failed = (0..total).filter(|_| one_connection(addr).is_err()).count();
            (failed, started.elapsed())
        })?;
        let rate = total as f64 / elapsed.as_secs_f64();
        println!("{label:>10} {failed:>10} {rate:>10.0} {:>10.1}", elapsed.as_secs_f64());
        out.insert(
            label.into(),
            json!({"connections": total, "failed": failed, "conn_per_s": rate, "seconds": elapsed.as_secs_f64()}),
        );
    }
    let counters: BTreeMap<&str, u64> = kpr::datapath::bpf::read_counters(pin_root)?.into_iter().collect();
    let live = kpr::datapath::conntrack::Conntrack::open(pin_root)?.len();
    println!(
        "kpr: snat exhausted {}, expired flows taken back {}, conntrack entries at the end {live}",
        counters["tc_snat_exhausted"], counters["tc_ct_expired"]
    );
    out.insert("snat_ports".into(), json!(ports));
    out.insert("turnovers".into(), json!(total as f64 / ports as f64));
    out.insert("kpr_snat_exhausted".into(), json!(counters["tc_snat_exhausted"]));
    out.insert("kpr_ct_taken_back".into(), json!(counters["tc_ct_expired"]));
    out.insert("kpr_conntrack_entries_after".into(), json!(live));
    Ok(serde_json::Value::Object(out))
}
