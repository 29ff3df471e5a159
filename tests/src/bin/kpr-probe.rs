//! The tests' client and server, also the program of the test pods in a real cluster
//! (`tests/tests/daemonset.rs` runs it from the `kpr-testpod` image):
//!
//! - `kpr-probe <tcp|udp|udp-connected|tcp-src|udp-src> <ip:port> <count> <timeout-ms> [source-ip]`:
//!   ask a service `count` times and print the outcome as one JSON line (see `kpr_tests::probe`).
//!   The tests run it inside another network namespace and cgroup, e.g. beside the real kube-proxy.
//! - `kpr-probe serve <name> <port>...`: answer `name` on TCP and UDP on every port (IPv4 and
//!   IPv6), as the testbed's name servers do (`peer?` is answered with the client's address).
//! - `kpr-probe hold <ip:port>`: one TCP connection, kept: prints the name the server sent, then
//!   for each line read on stdin sends it and prints `echo <line>` (or `error <why>`), so a test
//!   can check that a connection established before some change still carries data after it.
//! - `kpr-probe pause [label]`: do nothing until a signal ends it (a pod's sandbox, or a client
//!   pod's container that a test enters; the label lets the test find the process).
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    time::Duration,
};

use anyhow::{Context as _, Result};
use kpr_tests::probe::{Kind, probe};
use testbed::NameServer;

const USAGE: &str = "usage: kpr-probe <tcp|udp|udp-connected|tcp-src|udp-src> <ip:port> <count> <timeout-ms> [source-ip]\n\
                     \x20      kpr-probe serve <name> <port>... | hold <ip:port> | pause [label]";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("serve") if args.len() > 2 => serve(&args[1], &args[2..]),
        Some("hold") if args.len() == 2 => hold(args[1].parse().context("address")?),
        Some("pause") => pause(),
        _ => ask(&args),
    }
}

fn ask(args: &[String]) -> Result<()> {
    let (kind, addr, count, timeout, source) = match args {
        [kind, addr, count, timeout] => (kind, addr, count, timeout, None),
        [kind, addr, count, timeout, source] => (kind, addr, count, timeout, Some(source.parse().context("source")?)),
        _ => anyhow::bail!("{USAGE}"),
    };
    let outcome = probe(
        Kind::parse(kind)?,
        addr.parse().context("address")?,
        count.parse().context("count")?,
        Duration::from_millis(timeout.parse().context("timeout")?),
        source,
    );
    println!("{}", outcome.to_json());
    Ok(())
}

/// Dual-stack listeners on `[::]` (IPv4 clients arrive as IPv4-mapped addresses, and are
/// answered with their IPv4 address: the servers report the peer's canonical form).
fn serve(name: &str, ports: &[String]) -> Result<()> {
    let mut servers = Vec::new();
    for port in ports {
        let addr = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port.parse().context("port")?);
        servers.push(NameServer::tcp_on(TcpListener::bind(addr).with_context(|| format!("bind tcp {addr}"))?, name)?);
        servers.push(NameServer::udp_on(UdpSocket::bind(addr).with_context(|| format!("bind udp {addr}"))?, name)?);
    }
    println!("serving {name} on {}", ports.join(","));
    pause()
}

fn hold(addr: SocketAddr) -> Result<()> {
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).context("connect")?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut greeting = String::new();
    reader.read_line(&mut greeting).context("read the greeting")?;
    println!("{}", greeting.trim_end());
    for line in std::io::stdin().lines() {
        let line = line?;
        let mut echo = String::new();
        let outcome = conn
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|()| reader.read_line(&mut echo))
            .map(|n| if n == 0 { "error closed".to_owned() } else { format!("echo {}", echo.trim_end()) });
        println!("{}", outcome.unwrap_or_else(|e| format!("error {e}")));
    }
    Ok(())
}

/// Sleep until SIGTERM or SIGINT. A handler, not the default action: as a container's first
/// process (PID 1 of its PID namespace) a signal without a handler would be ignored.
fn pause() -> Result<()> {
    extern "C" fn exit_now(_: libc::c_int) {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(0) }
    }
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: installing a handler that only calls _exit.
        unsafe { libc::signal(signal, exit_now as *const () as libc::sighandler_t) };
    }
    loop {
        // SAFETY: pause(2) has no preconditions.
        unsafe { libc::pause() };
    }
}
