//! kube-proxy's `conntrack.*` settings, written to the kernel's connection tracker as kube-proxy
//! writes them at start (`pkg/proxy/conntrack/sysctls.go`): the table size (`maxPerCore` × CPUs,
//! at least `min`, at most 2^20, and the hash size to a quarter of it), the TCP ESTABLISHED and
//! CLOSE_WAIT timeouts, `tcpBeLiberal` and the UDP timeouts. kpr's own flows follow the same
//! settings in its maps; these are for what the kernel's tracker still sees on a kpr node
//! (host-network pods, the node's own traffic, the CNI's rules), which kube-proxy's users tune
//! here and the e2e suite checks ("KubeProxy should set TCP CLOSE_WAIT timeout").
use std::{fs, path::Path};

use anyhow::{Context as _, Result};

use crate::config::ConntrackSettings;

/// Where the hash size is (not a sysctl; the module's parameter).
const HASHSIZE: &str = "/sys/module/nf_conntrack/parameters/hashsize";

/// kube-proxy's cap on the scaled table size.
const MAX_LIMIT: u64 = 1_048_576;

/// The `net/netfilter` sysctls to write (name under `dir`, value), in kube-proxy's order.
pub fn plan(settings: &ConntrackSettings, cpus: usize) -> Vec<(&'static str, u64)> {
    let mut writes = Vec::new();
    if let Some(max) = table_size(settings, cpus) {
        writes.push(("nf_conntrack_max", max));
    }
    let seconds = |d: std::time::Duration| d.as_secs();
    let t = &settings.timeouts;
    if !t.tcp_established.is_zero() {
        writes.push(("nf_conntrack_tcp_timeout_established", seconds(t.tcp_established)));
    }
    if !t.tcp_close_wait.is_zero() {
        writes.push(("nf_conntrack_tcp_timeout_close_wait", seconds(t.tcp_close_wait)));
    }
    if settings.tcp_be_liberal {
        writes.push(("nf_conntrack_tcp_be_liberal", 1));
    }
    if !t.udp.is_zero() {
        writes.push(("nf_conntrack_udp_timeout", seconds(t.udp)));
    }
    if !t.udp_stream.is_zero() {
        writes.push(("nf_conntrack_udp_timeout_stream", seconds(t.udp_stream)));
    }
    writes
}

/// kube-proxy's `getConntrackMax`: `None` leaves the table size alone (`maxPerCore: 0`).
fn table_size(settings: &ConntrackSettings, cpus: usize) -> Option<u64> {
    let per_core = u64::from(settings.max_per_core?.max(0) as u32);
    if per_core == 0 {
        return None;
    }
    let floor = settings.min.map_or(0, |m| u64::from(m.max(0) as u32));
    let scaled = per_core * cpus as u64;
    Some(if scaled > MAX_LIMIT { MAX_LIMIT } else { scaled.max(floor) })
}

/// Write `plan`'s values under `dir` (`/proc/sys/net/netfilter`, or where the DaemonSet mounts
/// it writable) where they differ, and raise the hash size with the table, as kube-proxy does.
/// A setting that cannot be written is an error naming it, which the caller logs (kpr's own
/// flows do not depend on it); not one: no tracker loaded, or the table size from a network
/// namespace that may not set it (logged as information).
pub fn apply(dir: &Path, writes: &[(&'static str, u64)]) -> Vec<anyhow::Error> {
    let mut errors = Vec::new();
    for &(name, value) in writes {
        let path = dir.join(name);
        let current = fs::read_to_string(&path).ok().and_then(|v| v.trim().parse::<u64>().ok());
        if current == Some(value) {
            continue;
        }
        match fs::write(&path, value.to_string()) {
            Ok(()) => {
                tracing::info!(sysctl = %path.display(), value, "set the kernel's conntrack setting as kube-proxy does")
            }
            // No connection tracker loaded: nothing uses the setting.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::info!(sysctl = %path.display(), "no kernel connection tracker here: left unset");
                continue;
            }
            // The table size is the machine's: a network namespace other than the first may
            // not set it (kind's kube-proxy is configured with maxPerCore 0 for this reason).
            Err(e) if name == "nf_conntrack_max" && e.kind() == std::io::ErrorKind::PermissionDenied => {
                tracing::info!(sysctl = %path.display(), value, "the conntrack table size is the machine's: left as it is");
                continue;
            }
            Err(e) => {
                errors.push(anyhow::anyhow!(
                    "cannot set {} to {value} (kube-proxy's conntrack.* setting): {e}",
                    path.display()
                ));
                continue;
            }
        }
        if name == "nf_conntrack_max"
            && let Err(e) = raise_hashsize(value)
        {
            errors.push(e);
        }
    }
    errors
}

fn raise_hashsize(max: u64) -> Result<()> {
    let current: u64 = fs::read_to_string(HASHSIZE).context("reading the conntrack hash size")?.trim().parse()?;
    if current >= max / 4 {
        return Ok(());
    }
    fs::write(HASHSIZE, (max / 4).to_string()).with_context(|| format!("setting {HASHSIZE} to {}", max / 4))?;
    tracing::info!(hashsize = max / 4, "set the conntrack hash size as kube-proxy does");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::{ConntrackSettings, ConntrackTimeouts};

    fn settings(max_per_core: Option<i32>, min: Option<i32>) -> ConntrackSettings {
        ConntrackSettings {
            timeouts: ConntrackTimeouts {
                tcp_established: Duration::from_secs(86_400),
                tcp_close_wait: Duration::from_secs(3_600),
                udp: Duration::ZERO,
                udp_stream: Duration::ZERO,
            },
            max_per_core,
            min,
            tcp_be_liberal: false,
        }
    }

    // Upstream's TestGetConntrackMax rows, then setSysctls' order.
    #[test]
    fn the_table_size_follows_kube_proxys_rule() {
        for (per_core, min, cpus, want) in [
            (Some(0), Some(0), 1, None),
            (Some(0), Some(10), 1, None),
            (Some(1), Some(10), 1, Some(10)),
            (Some(10), Some(10), 4, Some(40)),
            (Some(32768), Some(131072), 2, Some(131072)),
            (Some(32768), Some(131072), 8, Some(262144)),
            (Some(65536), Some(0), 64, Some(MAX_LIMIT)),
            (None, Some(131072), 8, None),
        ] {
            assert_eq!(table_size(&settings(per_core, min), cpus), want, "{per_core:?} {min:?} {cpus}");
        }
    }

    #[test]
    fn the_defaults_write_the_table_size_and_the_tcp_timeouts() {
        let plan = plan(&settings(Some(32768), Some(131072)), 2);
        assert_eq!(
            plan,
            [
                ("nf_conntrack_max", 131072),
                ("nf_conntrack_tcp_timeout_established", 86_400),
                ("nf_conntrack_tcp_timeout_close_wait", 3_600),
            ]
        );
    }

    #[test]
    fn liberal_and_udp_timeouts_are_written_only_when_set() {
        let mut s = settings(Some(0), None);
        s.tcp_be_liberal = true;
        s.timeouts.udp = Duration::from_secs(30);
        s.timeouts.udp_stream = Duration::from_secs(120);
        s.timeouts.tcp_close_wait = Duration::ZERO;
        let names: Vec<_> = plan(&s, 4).into_iter().collect();
        assert_eq!(
            names,
            [
                ("nf_conntrack_tcp_timeout_established", 86_400),
                ("nf_conntrack_tcp_be_liberal", 1),
                ("nf_conntrack_udp_timeout", 30),
                ("nf_conntrack_udp_timeout_stream", 120),
            ]
        );
    }

    #[test]
    fn apply_writes_what_differs_and_reports_what_it_cannot_write() {
        let dir = std::env::temp_dir().join(format!("kpr-sysctl-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("nf_conntrack_tcp_timeout_close_wait"), "60\n").unwrap();
        fs::write(dir.join("nf_conntrack_tcp_timeout_established"), "86400\n").unwrap();
        // Unwritable (a directory in its place); absent (no tracker loaded) is not an error.
        fs::create_dir_all(dir.join("nf_conntrack_udp_timeout")).unwrap();
        let errors = apply(
            &dir,
            &[
                ("nf_conntrack_tcp_timeout_established", 86_400),
                ("nf_conntrack_tcp_timeout_close_wait", 3_600),
                ("nf_conntrack_udp_timeout", 30),
                ("nf_conntrack_udp_timeout_stream", 120),
            ],
        );
        assert_eq!(fs::read_to_string(dir.join("nf_conntrack_tcp_timeout_close_wait")).unwrap(), "3600");
        assert_eq!(fs::read_to_string(dir.join("nf_conntrack_tcp_timeout_established")).unwrap(), "86400\n");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].to_string().contains("nf_conntrack_udp_timeout"), "{}", errors[0]);
        fs::remove_dir_all(&dir).unwrap();
    }
}
