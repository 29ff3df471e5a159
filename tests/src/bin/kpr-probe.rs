//! `kpr-probe <tcp|udp|udp-connected|tcp-src|udp-src> <ip:port> <count> <timeout-ms> [source-ip]`:
//! ask a service `count` times and print the outcome as one JSON line (see `kpr_tests::probe`). The tests run it inside
//! another network namespace and cgroup, e.g. beside the real kube-proxy.
use std::time::Duration;

use anyhow::{Context as _, Result};
use kpr_tests::probe::{Kind, probe};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (kind, addr, count, timeout, source) = match args.as_slice() {
        [kind, addr, count, timeout] => (kind, addr, count, timeout, None),
        [kind, addr, count, timeout, source] => (kind, addr, count, timeout, Some(source.parse().context("source")?)),
        _ => anyhow::bail!(
            "usage: kpr-probe <tcp|udp|udp-connected|tcp-src|udp-src> <ip:port> <count> <timeout-ms> [source-ip]"
        ),
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
