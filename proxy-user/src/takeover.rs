//! Taking a node over from kube-proxy (`kpr agent --cleanup-kube-proxy`), once kpr's first
//! full sync has programmed every Service (new connections are kpr's from then on: its
//! programs run before netfilter):
//! 1. the flows kube-proxy translated are handed over: the tuples of netfilter's conntrack
//!    entries that were DNATed go into `KPR_HANDOVER`, and the per-packet path leaves their
//!    packets to netfilter, whose entries go on translating them with no rule left;
//! 2. kube-proxy's rules are removed as `kube-proxy --cleanup` removes them: its iptables chains
//!    (nat, filter, mangle; IPv4 and IPv6; the nft and legacy backends) and its nftables tables.
//!
//! The handed-over tuples are pruned as netfilter forgets their flows. Connections made from
//! the node's own sockets need nothing: they are connected to the pod already.
use std::{collections::HashSet, io, path::Path, process::Command};

use anyhow::{Context as _, Result};
use proxy_common::{Addr, CtKey, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use crate::{datapath::bpf::HandoverMaps, netlink};

pub struct Takeover {
    maps: HandoverMaps,
    handed_over: HashSet<CtKey>,
    done: bool,
}

impl Takeover {
    /// The handover maps; tuples an earlier agent handed over are taken on (pruned as theirs).
    pub fn open(pin_root: &Path) -> Result<Self> {
        let maps = HandoverMaps::open(pin_root)?;
        let handed_over = maps.tuples()?;
        let mut takeover = Self { maps, handed_over, done: false };
        takeover.publish_count(0);
        Ok(takeover)
    }

    /// Hand the translated flows over, then remove kube-proxy's rules (once).
    pub fn run(&mut self) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        match translated_flows() {
            Ok(flows) => {
                self.hand_over(flows.as_flattened());
                tracing::info!(flows = flows.len(), "flows kube-proxy translated are left to netfilter's conntrack");
            }
            Err(e) => tracing::error!(
                "cannot read netfilter's conntrack ({e}): connections kube-proxy made may be balanced anew"
            ),
        }
        // Netfilter translates a flow's packets from its conntrack entry only while some NAT
        // chain is registered; kube-proxy's nftables table may hold the node's only ones.
        if !self.handed_over.is_empty()
            && let Err(e) = keep_nat_hooks()
        {
            tracing::error!("failed to keep netfilter's NAT hooks for kube-proxy's flows: {e:#}");
        }
        let removed = remove_kube_proxy_rules();
        tracing::info!(?removed, "kube-proxy's rules removed");
    }

    /// Leave the flows of these tuples (both directions of each) to netfilter's conntrack.
    pub fn hand_over(&mut self, tuples: &[CtKey]) {
        // Counted before they are in the map: the per-packet path must not skip a tuple there.
        self.publish_count(tuples.len());
        for tuple in tuples {
            match self.maps.insert(tuple) {
                Ok(()) => {
                    self.handed_over.insert(*tuple);
                }
                Err(e) => tracing::warn!("failed to hand a kube-proxy flow over: {e}"),
            }
        }
        self.publish_count(0);
    }

    /// `KPR_HANDOVER_COUNT`: the tuples held, and `coming` more.
    fn publish_count(&mut self, coming: usize) {
        let count = u32::try_from(self.handed_over.len() + coming).unwrap_or(u32::MAX);
        if let Err(e) = self.maps.set_count(count) {
            // The one element of an array: only a broken map fails here.
            tracing::error!("failed to count the flows handed over (kpr may take them from netfilter): {e}");
        }
    }

    /// Forget the tuples of flows netfilter no longer tracks.
    pub fn prune(&mut self) {
        if self.handed_over.is_empty() {
            return;
        }
        let Ok(flows) = translated_flows() else { return };
        let live: HashSet<CtKey> = flows.into_iter().flatten().collect();
        self.handed_over.retain(|tuple| {
            let keep = live.contains(tuple);
            if !keep {
                self.maps.remove(tuple);
            }
            keep
        });
        self.publish_count(0);
        if self.handed_over.is_empty() {
            release_nat_hooks();
            tracing::info!("the last flow kube-proxy translated has ended");
        }
    }
}

// ctnetlink (linux/netfilter/nfnetlink_conntrack.h).
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;

/// Netfilter's flows (both families) whose destination was translated (DNAT, as kube-proxy's
/// rules do): the tuples of both directions as they appear on the wire (original, reply).
pub fn translated_flows() -> io::Result<Vec<[CtKey; 2]>> {
    let mut entries = Vec::new();
    for family in [libc::AF_INET, libc::AF_INET6] {
        // struct nfgenmsg: family, version, resource id.
        let body = [family as u8, 0, 0, 0];
        let request =
            netlink::message((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET, libc::NLM_F_DUMP as u16, &body);
        entries.extend(netlink::dump(libc::NETLINK_NETFILTER, &request)?);
    }
    Ok(entries
        .iter()
        .filter_map(|entry| {
            let attrs = entry.get(4..)?; // after the nfgenmsg
            let original = tuple(netlink::find(attrs, CTA_TUPLE_ORIG)?)?;
            let reply = tuple(netlink::find(attrs, CTA_TUPLE_REPLY)?)?;
            let translated = (reply.src_addr, reply.src_port) != (original.dst_addr, original.dst_port);
            let proto_ok = matches!(original.proto, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP);
            (translated && proto_ok).then_some([original, reply])
        })
        .collect())
}

/// A CTA_TUPLE_* as a conntrack key (addresses and ports in network byte order, as the
/// per-packet path reads them).
fn tuple(attrs: &[u8]) -> Option<CtKey> {
    let ip = netlink::find(attrs, CTA_TUPLE_IP)?;
    let proto = netlink::find(attrs, CTA_TUPLE_PROTO)?;
    // An IPv4 tuple has the V4 attributes, an IPv6 one the V6 ones.
    let addr = |v4, v6| -> Option<Addr> {
        if let Some(a) = netlink::find(ip, v4) {
            return Some(Addr::from_v4(u32::from_ne_bytes(a.try_into().ok()?)));
        }
        let a: [u8; 16] = netlink::find(ip, v6)?.try_into().ok()?;
        Some(std::net::Ipv6Addr::from(a).into())
    };
    let port = |kind| -> Option<u16> { Some(u16::from_ne_bytes(netlink::find(proto, kind)?.try_into().ok()?)) };
    Some(CtKey::new(
        addr(CTA_IP_V4_SRC, CTA_IP_V6_SRC)?,
        addr(CTA_IP_V4_DST, CTA_IP_V6_DST)?,
        port(CTA_PROTO_SRC_PORT)?,
        port(CTA_PROTO_DST_PORT)?,
        *netlink::find(proto, CTA_PROTO_NUM)?.first()?,
    ))
}

/// kube-proxy's chains (pkg/proxy/iptables/cleanup.go): by table, fixed names and the prefixes
/// of its per-service chains. kubelet's own KUBE-* chains are not among them.
const NAT_CHAINS: [&str; 5] =
    ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ", "KUBE-PROXY-CANARY"];
const SERVICE_CHAIN_PREFIXES: [&str; 5] = ["KUBE-SVC-", "KUBE-SVL-", "KUBE-FW-", "KUBE-EXT-", "KUBE-SEP-"];
const FILTER_CHAINS: [&str; 6] = [
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-NODEPORTS",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
];
const MANGLE_CHAINS: [&str; 1] = ["KUBE-PROXY-CANARY"];

fn kube_proxy_chain(table: &str, chain: &str) -> bool {
    match table {
        "nat" => NAT_CHAINS.contains(&chain) || SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p)),
        "filter" => FILTER_CHAINS.contains(&chain),
        "mangle" => MANGLE_CHAINS.contains(&chain),
        _ => false,
    }
}

/// Remove kube-proxy's rules from every iptables backend and family present, and its nftables
/// tables; returns what was removed ("iptables-nft nat: 14 chains"). Failures are logged.
pub fn remove_kube_proxy_rules() -> Vec<String> {
    let mut removed = Vec::new();
    for (save, restore) in iptables_backends() {
        for table in ["nat", "filter", "mangle"] {
            match remove_chains(&save, &restore, table) {
                Ok(0) => {}
                Ok(n) => removed.push(format!("{save} {table}: {n} chains")),
                Err(e) => tracing::error!("failed to remove kube-proxy's {table} chains with {save}: {e:#}"),
            }
        }
    }
    for family in ["ip", "ip6"] {
        match remove_nft_table(family) {
            Ok(true) => removed.push(format!("nft table {family} kube-proxy")),
            Ok(false) => {}
            Err(e) => tracing::error!("failed to remove nftables table {family} kube-proxy: {e:#}"),
        }
    }
    removed
}

/// The (save, restore) commands of each iptables backend in use: the nft and legacy variants
/// where both are installed (a legacy table only if the kernel has it), else the plain ones.
fn iptables_backends() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for family in ["iptables", "ip6tables"] {
        let variants: Vec<(String, String)> = ["nft", "legacy"]
            .iter()
            .map(|v| (format!("{family}-{v}-save"), format!("{family}-{v}-restore")))
            .filter(|(save, _)| on_path(save))
            .collect();
        if variants.is_empty() {
            if on_path(&format!("{family}-save")) {
                out.push((format!("{family}-save"), format!("{family}-restore")));
            }
            continue;
        }
        let legacy_tables =
            if family == "iptables" { "/proc/net/ip_tables_names" } else { "/proc/net/ip6_tables_names" };
        let legacy_loaded = std::fs::read_to_string(legacy_tables).is_ok_and(|t| !t.trim().is_empty());
        out.extend(variants.into_iter().filter(|(save, _)| !save.contains("-legacy-") || legacy_loaded));
    }
    out
}

/// Flush and delete kube-proxy's chains of `table`, and every rule jumping to them, in one
/// iptables-restore transaction; returns how many chains went.
fn remove_chains(save: &str, restore: &str, table: &str) -> Result<usize> {
    let out = Command::new(save).args(["-t", table]).output().with_context(|| format!("failed to run {save}"))?;
    if !out.status.success() {
        // No such table in this backend (nothing of kube-proxy's either).
        return Ok(0);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let script = cleanup_script(table, &text);
    let Some(script) = script else { return Ok(0) };
    let chains = script.lines().filter(|l| l.starts_with("-X ")).count();
    let mut child = Command::new(restore)
        .args(["--noflush", "-w"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("failed to run {restore}"))?;
    use std::io::Write as _;
    child.stdin.take().expect("piped").write_all(script.as_bytes())?;
    let done = child.wait_with_output()?;
    anyhow::ensure!(done.status.success(), "{restore}: {}", String::from_utf8_lossy(&done.stderr).trim());
    Ok(chains)
}

/// The iptables-restore input that removes kube-proxy's chains from `table` as `saved`
/// (iptables-save output) shows it: declare (flush) them, delete the rules that jump to them
/// from other chains, delete them. `None`: nothing of kube-proxy's.
fn cleanup_script(table: &str, saved: &str) -> Option<String> {
    let chains: Vec<&str> = saved
        .lines()
        .filter_map(|l| l.strip_prefix(':')?.split_whitespace().next())
        .filter(|c| kube_proxy_chain(table, c))
        .collect();
    if chains.is_empty() {
        return None;
    }
    let mut script = format!("*{table}\n");
    for chain in &chains {
        script.push_str(&format!(":{chain} - [0:0]\n"));
    }
    for rule in saved.lines().filter_map(|l| l.strip_prefix("-A ")) {
        let from = rule.split_whitespace().next().unwrap_or_default();
        let target = rule.split(" -j ").nth(1).and_then(|t| t.split_whitespace().next()).unwrap_or_default();
        if !chains.contains(&from) && chains.contains(&target) {
            script.push_str(&format!("-D {rule}\n"));
        }
    }
    for chain in &chains {
        script.push_str(&format!("-X {chain}\n"));
    }
    script.push_str("COMMIT\n");
    Some(script)
}

/// kpr's nftables table of empty NAT chains, held while kube-proxy's flows live on.
const NAT_HOOKS_TABLE: &str = "kpr-handover";

/// Register NAT chains of kpr's own (`table ip kpr-handover`) where nftables is available, so
/// that netfilter goes on tracking kube-proxy's flows and translating them from their conntrack
/// entries after kube-proxy's table, which held both, is gone. (iptables keeps its nat table.)
fn keep_nat_hooks() -> Result<()> {
    if !on_path("nft") {
        return Ok(());
    }
    // The `ct` expression holds netfilter's connection tracking in the namespace (an empty
    // NAT chain does not), the NAT chains its translation of tracked flows.
    let chains: String = [("prerouting", -100), ("output", -100), ("input", 100), ("postrouting", 100)]
        .iter()
        .map(|(hook, priority)| {
            format!("  chain {hook} {{ type nat hook {hook} priority {priority}; ct state established counter; }}\n")
        })
        .collect();
    let script = format!("table ip {NAT_HOOKS_TABLE} {{\n{chains}}}\n");
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("failed to run nft")?;
    use std::io::Write as _;
    child.stdin.take().expect("piped").write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    anyhow::ensure!(out.status.success(), "nft: {}", String::from_utf8_lossy(&out.stderr).trim());
    Ok(())
}

/// Drop kpr's NAT chains (kube-proxy's last flow ended, or `kpr cleanup`).
pub fn release_nat_hooks() {
    if on_path("nft") {
        let _ = Command::new("nft")
            .args(["delete", "table", "ip", NAT_HOOKS_TABLE])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// `nft delete table <family> kube-proxy`; false when there is no such table.
fn remove_nft_table(family: &str) -> Result<bool> {
    if !on_path("nft") {
        return Ok(false);
    }
    let listed = Command::new("nft").args(["list", "tables", family]).output().context("failed to run nft")?;
    let exists =
        String::from_utf8_lossy(&listed.stdout).lines().any(|l| l.trim() == format!("table {family} kube-proxy"));
    if !exists {
        return Ok(false);
    }
    let out = Command::new("nft").args(["delete", "table", family, "kube-proxy"]).output()?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr).trim());
    Ok(true)
}

fn on_path(command: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(command).is_file()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What kube-proxy (iptables mode, v1.36) leaves in the nat table, with another owner's
    /// chains (kubelet's, a CNI's) that must stay.
    const NAT: &str = "\
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:CNI-HOSTPORT-DNAT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SEP-ABC - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-XYZ - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-XYZ
-A KUBE-SVC-XYZ -j KUBE-SEP-ABC
-A KUBE-SEP-ABC -p tcp -m tcp -j DNAT --to-destination 10.244.1.2:8080
COMMIT
";

    #[test]
    fn cleanup_removes_kube_proxys_chains_and_the_jumps_to_them_only() {
        let script = cleanup_script("nat", NAT).unwrap();
        let lines: Vec<&str> = script.lines().collect();
        for chain in [
            "KUBE-MARK-MASQ",
            "KUBE-NODEPORTS",
            "KUBE-POSTROUTING",
            "KUBE-PROXY-CANARY",
            "KUBE-SEP-ABC",
            "KUBE-SERVICES",
            "KUBE-SVC-XYZ",
        ] {
            assert!(lines.contains(&format!(":{chain} - [0:0]").as_str()), "{chain} flushed:\n{script}");
            assert!(lines.contains(&format!("-X {chain}").as_str()), "{chain} deleted:\n{script}");
        }
        assert!(!script.contains("KUBE-KUBELET-CANARY"), "kubelet's chain stays:\n{script}");
        assert!(!script.contains("CNI-HOSTPORT-DNAT"), "the CNI's rules stay:\n{script}");
        let deleted: Vec<&str> = lines.iter().copied().filter(|l| l.starts_with("-D ")).collect();
        assert_eq!(
            deleted,
            [
                "-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
                "-D OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
                "-D POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING",
            ]
        );
        assert_eq!(lines.first(), Some(&"*nat"));
        assert_eq!(lines.last(), Some(&"COMMIT"));
        assert_eq!(cleanup_script("nat", "*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n"), None);
    }

    #[test]
    fn kubelets_chains_are_not_kube_proxys() {
        assert!(!kube_proxy_chain("filter", "KUBE-FIREWALL"));
        assert!(!kube_proxy_chain("mangle", "KUBE-KUBELET-CANARY"));
        assert!(kube_proxy_chain("filter", "KUBE-PROXY-FIREWALL"));
        assert!(!kube_proxy_chain("filter", "KUBE-SVC-XYZ"), "service chains live in nat only");
    }
}
