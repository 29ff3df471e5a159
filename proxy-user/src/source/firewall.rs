//! What filters the node's forwarded packets: netfilter's forward hook, read from the kernel
//! (nftables over netlink, which covers iptables-nft; the legacy iptables tables through their
//! socket options). A NetworkPolicy engine that enforces in the FORWARD chain (Calico's
//! iptables dataplane, Canal, kube-router, Weave, kube-network-policies) puts its rules there;
//! kube-proxy's translated packets meet them, so kpr's must too.
//!
//! The test is deliberately coarse: any rule, or a policy other than accept, in a chain on the
//! forward hook counts, whoever wrote it. Telling a policy engine's rules from harmless ones
//! would be a guess, and a wrong guess is a policy bypassed; the cost of the coarse test is
//! only speed (translated packets take the host's forwarding path).
use std::{ffi::CStr, io};

use crate::netlink;

/// Where something filters forwarded packets, one line each (`nftables inet filter/forward:
/// 3 rules`); empty when nothing does. A part of the host that could not be read counts as
/// filtering (a policy may be there), with the error as its line.
pub fn forward_filters() -> Vec<String> {
    let mut found = match nftables_forward_chains() {
        Ok(found) => found,
        Err(e) => vec![format!("nftables could not be read ({e}): assumed to filter")],
    };
    for family in [Legacy::V4, Legacy::V6] {
        match legacy_forward(family) {
            Ok(Some(line)) => found.push(line),
            Ok(None) => {}
            Err(e) => found.push(format!("{} could not be read ({e}): assumed to filter", family.name())),
        }
    }
    found
}

// nf_tables over nfnetlink (linux/netfilter/nf_tables.h).
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFT_MSG_GETRULE: u16 = 7;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFPROTO_INET: u8 = 1;
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;
const NF_INET_FORWARD: u32 = 2;
const NF_ACCEPT: u32 = 1;

/// Base chains of the ip, ip6 and inet families on the forward hook that have rules or do not
/// accept by default. iptables-nft's `filter FORWARD` is one of them.
fn nftables_forward_chains() -> io::Result<Vec<String>> {
    let chains = match nft_dump(NFT_MSG_GETCHAIN, 0, &[]) {
        Ok(chains) => chains,
        // nf_tables not loaded: nothing of it on the hook.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EPROTONOSUPPORT | libc::ENOENT)) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut found = Vec::new();
    for (family, attrs) in &chains {
        let (family, attrs) = (*family, attrs.as_slice());
        if ![NFPROTO_INET, NFPROTO_IPV4, NFPROTO_IPV6].contains(&family) {
            continue; // bridge, arp, netdev: other hooks
        }
        let Some(hook) = netlink::find(attrs, NFTA_CHAIN_HOOK) else { continue }; // a regular chain
        let hooknum = netlink::find(hook, NFTA_HOOK_HOOKNUM).and_then(be32);
        if hooknum != Some(NF_INET_FORWARD) {
            continue;
        }
        let (Some(table), Some(chain)) = (
            netlink::find(attrs, NFTA_CHAIN_TABLE).and_then(cstr),
            netlink::find(attrs, NFTA_CHAIN_NAME).and_then(cstr),
        ) else {
            continue;
        };
        let policy = netlink::find(attrs, NFTA_CHAIN_POLICY).and_then(be32).unwrap_or(NF_ACCEPT);
        let request = [
            netlink::attr(NFTA_RULE_TABLE, &nul_terminated(table)),
            netlink::attr(NFTA_RULE_CHAIN, &nul_terminated(chain)),
        ]
        .concat();
        // Filtered by the kernel (5.x: table and chain in the dump request); checked again here.
        let rules = nft_dump(NFT_MSG_GETRULE, family, &request)?
            .into_iter()
            .filter(|(_, rule)| {
                netlink::find(rule, NFTA_RULE_TABLE).and_then(cstr) == Some(table)
                    && netlink::find(rule, NFTA_RULE_CHAIN).and_then(cstr) == Some(chain)
            })
            .count();
        if rules > 0 || policy != NF_ACCEPT {
            let family = match family {
                NFPROTO_INET => "inet",
                NFPROTO_IPV4 => "ip",
                _ => "ip6",
            };
            let policy = if policy == NF_ACCEPT { "accept" } else { "drop" };
            found.push(format!("nftables {family} {table}/{chain}: {rules} rules, policy {policy}"));
        }
    }
    Ok(found)
}

/// A dump of `kind` in `family` (0: all): each answer's family and attributes.
fn nft_dump(kind: u16, family: u8, attrs: &[u8]) -> io::Result<Vec<(u8, Vec<u8>)>> {
    // struct nfgenmsg: family, version, resource id.
    let body = [&[family, 0, 0, 0][..], attrs].concat();
    let request = netlink::message((NFNL_SUBSYS_NFTABLES << 8) | kind, libc::NLM_F_DUMP as u16, &body);
    Ok(netlink::dump(libc::NETLINK_NETFILTER, &request)?
        .into_iter()
        .filter(|m| m.len() >= 4)
        .map(|m| (m[0], m[4..].to_vec()))
        .collect())
}

fn be32(b: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(b.try_into().ok()?))
}

fn cstr(b: &[u8]) -> Option<&str> {
    CStr::from_bytes_until_nul(b).ok()?.to_str().ok()
}

fn nul_terminated(s: &str) -> Vec<u8> {
    [s.as_bytes(), &[0]].concat()
}

/// The legacy (x_tables) filter table of one family.
#[derive(Clone, Copy)]
enum Legacy {
    V4,
    V6,
}

impl Legacy {
    fn name(self) -> &'static str {
        match self {
            Legacy::V4 => "iptables-legacy",
            Legacy::V6 => "ip6tables-legacy",
        }
    }

    /// (socket family, socket option level, where an entry's `target_offset` is).
    fn layout(self) -> (i32, i32, usize) {
        match self {
            // struct ipt_entry: ipt_ip (84 bytes), nfcache, then target_offset.
            Legacy::V4 => (libc::AF_INET, libc::IPPROTO_IP, 88),
            // struct ip6t_entry: ip6t_ip6 (136 bytes, padded), nfcache, then target_offset.
            Legacy::V6 => (libc::AF_INET6, libc::IPPROTO_IPV6, 140),
        }
    }

    fn tables_names(self) -> &'static str {
        match self {
            Legacy::V4 => "/proc/thread-self/net/ip_tables_names",
            Legacy::V6 => "/proc/thread-self/net/ip6_tables_names",
        }
    }
}

// linux/netfilter_ipv4/ip_tables.h (the IPv6 options have the same numbers).
const SO_GET_INFO: i32 = 64;
const SO_GET_ENTRIES: i32 = 65;
/// struct ipt_getinfo: name[32], valid_hooks, hook_entry[5], underflow[5], num_entries, size.
const GETINFO_LEN: usize = 84;
/// The standard target's verdict for ACCEPT: -NF_ACCEPT - 1.
const VERDICT_ACCEPT: i32 = -2;
/// struct xt_entry_target's header, before a standard target's verdict.
const TARGET_HEADER_LEN: usize = 32;

/// The legacy filter table's FORWARD chain, if it has rules or a policy other than ACCEPT.
/// Not loaded (no `filter` in the tables' names): nothing, and nothing is loaded by asking.
fn legacy_forward(family: Legacy) -> io::Result<Option<String>> {
    match std::fs::read_to_string(family.tables_names()) {
        Ok(names) if names.lines().any(|n| n == "filter") => {}
        _ => return Ok(None),
    }
    let (domain, level, target_offset_at) = family.layout();
    // SAFETY: a plain socket call; the fd is owned right after creation.
    let fd = unsafe { libc::socket(domain, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::IPPROTO_RAW) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is owned here.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let get = |option: i32, buf: &mut Vec<u8>| -> io::Result<()> {
        let mut len = buf.len() as libc::socklen_t;
        // SAFETY: the kernel writes at most len bytes into buf.
        let rc = unsafe {
            libc::getsockopt(std::os::fd::AsRawFd::as_raw_fd(&fd), level, option, buf.as_mut_ptr().cast(), &mut len)
        };
        if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
    };
    let word = |b: &[u8], at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    let mut info = vec![0u8; GETINFO_LEN];
    info[..6].copy_from_slice(b"filter");
    get(SO_GET_INFO, &mut info)?;
    let forward = NF_INET_FORWARD as usize;
    let (entry, underflow, size) =
        (word(&info, 36 + 4 * forward), word(&info, 56 + 4 * forward), word(&info, 80) as usize);
    // struct ipt_get_entries: name[32], size, then the entries (8-aligned).
    let head = 40;
    let mut entries = vec![0u8; head + size];
    entries[..6].copy_from_slice(b"filter");
    entries[32..36].copy_from_slice(&(size as u32).to_ne_bytes());
    get(SO_GET_ENTRIES, &mut entries)?;
    let rules = if entry == underflow { 0 } else { 1 };
    // The policy: the standard target of the chain's last entry (at `underflow`).
    let verdict = entries.get(head + underflow as usize..).and_then(|policy| {
        let target =
            usize::from(u16::from_ne_bytes(policy.get(target_offset_at..target_offset_at + 2)?.try_into().ok()?));
        let at = target + TARGET_HEADER_LEN;
        Some(i32::from_ne_bytes(policy.get(at..at + 4)?.try_into().ok()?))
    });
    let accepts = verdict == Some(VERDICT_ACCEPT);
    Ok((rules > 0 || !accepts).then(|| {
        let policy = if accepts { "ACCEPT" } else { "DROP" };
        let rules = if rules > 0 { "rules" } else { "no rules" };
        format!("{} filter FORWARD: {rules}, policy {policy}", family.name())
    }))
}
