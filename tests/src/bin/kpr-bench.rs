//! `cargo xtask bench`: socket-LB benchmarks. Prints a table and writes target/bench/socket_lb.json.
//!
//! 1. Connection rate and connect() latency through a ClusterIP vs straight to the backend, with
//!    100 / 10k / 50k service ports programmed (alternating A/B rounds, one client thread).
//! 2. Time to program 10k service ports × 4 endpoints from cold, once the agent holds them.
//! 3. Time from a manifest change to the map update, through the real agent.
use std::{
    collections::BTreeMap,
    io::Read as _,
    net::{Ipv4Addr, SocketAddrV4, TcpStream},
    os::fd::AsRawFd as _,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use kpr::{
    datapath::{
        Programmer,
        bpf::{self, BpfDatapath, DatapathConfig},
    },
    model::{
        ObjectKey, Protocol, ServicePortName,
        desired::{Desired, DesiredPort, service_key},
    },
    testbed::{self, Cgroup, Topology},
};
use kpr_tests::Harness;
use serde_json::json;

const TARGET_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const BENCH_PORT: u16 = 8081;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let sizes: &[usize] = if quick { &[100, 10_000] } else { &[100, 10_000, 50_000] };
    let (rounds, per_round) = if quick { (4, 500) } else { (24, 500) };

    let conn = connection_rate(sizes, rounds, per_round)?;
    let program = programming_time(10_000, 4)?;
    let latency = event_latency(if quick { 10 } else { 30 })?;

    let result = json!({ "connection_rate": conn, "programming": program, "event_to_datapath": latency });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("socket_lb.json");
    std::fs::write(&path, serde_json::to_string_pretty(&result)?)?;
    println!("\nwrote {}", path.canonicalize()?.display());
    Ok(())
}

fn desired_with(n: usize, backends_per_service: usize, target_backend: Ipv4Addr) -> Desired {
    let mut desired = Desired::new();
    for i in 0..n {
        let (ip, backends) = if i == 0 {
            (TARGET_IP, vec![(target_backend, BENCH_PORT)])
        } else {
            // Fillers on 10.100.0.0/16 and up, each with its own backends.
            let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 100, 0, 0)) + i as u32);
            let bs = (0..backends_per_service).map(|b| (Ipv4Addr::new(10, 200, (b % 250) as u8, (i % 250) as u8 + 1), 8080)).collect();
            (ip, bs)
        };
        let name = ServicePortName { service: ObjectKey::new("bench", format!("svc-{i}")), port: String::new(), protocol: Protocol::Tcp };
        desired.insert(service_key(ip, 80, Protocol::Tcp).expect("tcp"), DesiredPort { name, backends, flags: 0 });
    }
    desired
}

/// Connect, read the pod's name, close with RST (no TIME_WAIT: no port exhaustion).
fn one_connection(addr: SocketAddrV4) -> Result<Duration> {
    let started = Instant::now();
    let mut conn = TcpStream::connect(addr)?;
    let connected = started.elapsed();
    let mut buf = [0u8; 64];
    let _ = conn.read(&mut buf)?;
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: valid fd, correctly sized struct.
    unsafe {
        libc::setsockopt(conn.as_raw_fd(), libc::SOL_SOCKET, libc::SO_LINGER, (&raw const linger).cast(), size_of_val(&linger) as _);
    }
    Ok(connected)
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn connection_rate(sizes: &[usize], rounds: usize, per_round: usize) -> Result<serde_json::Value> {
    let name = testbed::unique_name("kb-conn");
    let topology = Topology::new(&name, &["pod"])?;
    let pod = topology.pods[0].ip;
    // A single-threaded accept → write → close server: its cost per connection is small and
    // steady, so the client-side difference (the socket hook) is not buried in server noise.
    let listener = topology.pods[0].netns.run(move || std::net::TcpListener::bind((pod, BENCH_PORT)))??;
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            if let Ok(mut conn) = conn {
                let _ = std::io::Write::write_all(&mut conn, b"pod\n");
            }
        }
    });
    let mut cgroup = Cgroup::new(&name)?;
    let pins = PinGuard(std::path::PathBuf::from(format!("/sys/fs/bpf/{name}")));
    let mut cfg = DatapathConfig::new(pins.0.clone(), cgroup.path.clone());
    cfg.max_service_ports = 65_536;
    let mut datapath = BpfDatapath::load(&cfg)?;
    let mut programmer = Programmer::recover(&mut datapath.maps)?;
    cgroup.enter()?;

    println!("connection rate, one client thread, new TCP connection per request ({rounds} A/B rounds × {per_round})");
    println!("{:>8} {:>12} {:>12} {:>7} {:>10} {:>10} {:>10} {:>10}", "services", "direct c/s", "kpr c/s", "ratio", "direct p50", "kpr p50", "direct p99", "kpr p99");
    let mut out = Vec::new();
    for &n in sizes {
        programmer.apply(&desired_with(n, 4, pod), &mut datapath.maps);
        let (direct, via) = topology.client.run(move || -> Result<_> {
            let mut lat: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
            let mut time: BTreeMap<&str, Duration> = BTreeMap::new();
            for _ in 0..50 {
                one_connection(SocketAddrV4::new(TARGET_IP, 80))?; // warm-up
            }
            for _ in 0..rounds {
                for (label, addr) in [("direct", SocketAddrV4::new(pod, BENCH_PORT)), ("kpr", SocketAddrV4::new(TARGET_IP, 80))] {
                    let started = Instant::now();
                    for _ in 0..per_round {
                        lat.entry(label).or_default().push(one_connection(addr).with_context(|| format!("{label} connect"))?);
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
            Ok((summarize("direct"), summarize("kpr")))
        })??;
        println!(
            "{n:>8} {:>12.0} {:>12.0} {:>7.3} {:>8.1}µs {:>8.1}µs {:>8.1}µs {:>8.1}µs",
            direct.0, via.0, via.0 / direct.0, direct.1, via.1, direct.2, via.2
        );
        out.push(json!({
            "services": n, "direct_conn_per_s": direct.0, "kpr_conn_per_s": via.0, "ratio": via.0 / direct.0,
            "direct_connect_p50_us": direct.1, "kpr_connect_p50_us": via.1,
            "direct_connect_p99_us": direct.2, "kpr_connect_p99_us": via.2,
        }));
    }
    cgroup.leave()?;
    drop(datapath);
    Ok(json!(out))
}

fn programming_time(services: usize, backends: usize) -> Result<serde_json::Value> {
    let name = testbed::unique_name("kb-prog");
    let cgroup = Cgroup::new(&name)?;
    let pins = PinGuard(std::path::PathBuf::from(format!("/sys/fs/bpf/{name}")));
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
        cold.as_secs_f64() * 1e3, report.added, report.failed, incr.updated, incremental.as_secs_f64() * 1e3
    );
    Ok(json!({ "service_ports": services, "endpoints_each": backends, "cold_ms": cold.as_secs_f64() * 1e3,
               "incremental_changed": incr.updated, "incremental_ms": incremental.as_secs_f64() * 1e3 }))
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
    println!("manifest change → datapath ({samples} changes, includes the 5 ms reload coalescing): p50 {p50:.1} ms, p99 {p99:.1} ms");
    Ok(json!({ "samples": samples, "p50_ms": p50, "p99_ms": p99, "note": "manifest source; includes 5 ms coalescing of file events and 1 ms polling granularity of the check" }))
}

struct PinGuard(std::path::PathBuf);

impl Drop for PinGuard {
    fn drop(&mut self) {
        let _ = bpf::cleanup(&self.0);
    }
}
