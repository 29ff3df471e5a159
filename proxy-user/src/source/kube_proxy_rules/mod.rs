//! The running kube-proxy's decisions, read back from the ruleset it wrote (for `kpr agent
//! --shadow`): [`iptables`] reads `iptables-save`, [`nftables`] reads `nft -j list table`, both
//! into one small rule language ([`Rule`]), and [`RuleSet::verdict`] walks it for one new
//! connection the way the kernel would, to the endpoints it may reach, or a refusal.
//!
//! The walk is nondeterministic where kube-proxy's rules are: a random pick (`statistic`,
//! `numgen`) and a ClientIP affinity check are taken both ways, so the verdict holds every
//! endpoint a new connection may reach.
pub mod iptables;
pub mod nftables;

use std::{
    collections::{BTreeSet, HashMap},
    net::{IpAddr, SocketAddr},
    process::Command,
};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::model::{IpFamily, cidr::Cidr};

/// What a new connection to a frontend meets, as either proxy decides it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "verdict")]
pub enum Verdict {
    /// Translated to one of `endpoints`.
    Endpoints {
        endpoints: BTreeSet<SocketAddr>,
        /// The endpoint sees the connection masqueraded.
        masquerade: bool,
        /// ClientIP affinity timeout in seconds; 0: none.
        affinity_seconds: u32,
        /// Only sources inside these are admitted (loadBalancerSourceRanges); empty: any.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        source_ranges: Vec<Cidr>,
    },
    Reject,
    Drop,
    /// Not this proxy's: the connection goes on untranslated.
    Pass,
}

/// A new connection, as the rules see it: where it comes from and where it goes.
#[derive(Clone, Debug)]
pub struct Packet {
    pub src: IpAddr,
    /// The source is one of the node's addresses (`--src-type LOCAL`, `fib saddr type local`).
    pub src_local: bool,
    /// The link it arrived by; `None` for the node's own connections (OUTPUT).
    pub in_link: Option<String>,
    pub dst: IpAddr,
    pub dst_local: bool,
    pub proto: u8,
    pub dport: u16,
    /// Read the firewall chains' source ranges instead of matching them: the verdict is the
    /// one for an admitted source, with the ranges attached.
    pub ranges_symbolic: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Match {
    Src {
        nets: Vec<Cidr>,
        negated: bool,
    },
    Dst {
        nets: Vec<Cidr>,
        negated: bool,
    },
    Proto(u8),
    DPort(u16),
    SrcLocal(bool),
    DstLocal(bool),
    /// `-i`: a name ending in `+` is a prefix.
    InLink {
        name: String,
        negated: bool,
    },
    /// One of several random branches.
    Random,
    /// A ClientIP affinity check with this timeout: a returning client takes the branch.
    Affinity(u32),
    /// The destination is one of the addresses NodePorts are served on (nftables'
    /// `@nodeport-ips`).
    NodePortDst(Vec<Cidr>),
    /// Never true for a new Service connection (a mark, `ctstate INVALID`, ...).
    Never,
    /// Always true for one (`ct state new`, no mark).
    Always,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// A rule that only counts or logs.
    Continue,
    Jump(String),
    Goto(String),
    Return,
    Dnat(SocketAddr),
    /// KUBE-MARK-MASQ / `jump mark-for-masquerade`.
    MarkMasquerade,
    /// KUBE-MARK-DROP.
    MarkDrop,
    Drop,
    Reject,
    Accept,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub matches: Vec<Match>,
    pub action: Action,
}

/// What a rule's matches say of a packet's destination.
#[derive(Default)]
struct Destination {
    /// One host address.
    host: Option<IpAddr>,
    /// Other addresses (127.0.0.0/8 and the like: the NodePorts of some addresses only).
    other: bool,
    /// A local address (`--dst-type LOCAL`, nftables' `@nodeport-ips`).
    local: bool,
    proto: Option<u8>,
    port: Option<u16>,
}

impl Rule {
    fn destination(&self) -> Destination {
        let mut d = Destination::default();
        for m in &self.matches {
            match m {
                Match::Dst { nets, negated: false } if nets.len() == 1 && nets[0].len == host_len(&nets[0].addr) => {
                    d.host = Some(nets[0].addr);
                }
                Match::Dst { negated: false, .. } => d.other = true,
                Match::DstLocal(true) | Match::NodePortDst(_) => d.local = true,
                Match::Proto(p) => d.proto = Some(*p),
                Match::DPort(p) => d.port = Some(*p),
                _ => {}
            }
        }
        d
    }
}

#[derive(Debug, Default)]
pub struct Chain {
    pub rules: Vec<Rule>,
    /// Its source matches are loadBalancerSourceRanges (KUBE-FW-*, nftables' firewall-*).
    pub firewall: bool,
    /// Only local destinations get here (iptables' KUBE-NODEPORTS).
    pub node_ports: bool,
    /// The rules that name one frontend (a host address, a protocol, a port), by it, and the
    /// others: a walk tries only the rules its packet can match, so a chain of one rule per
    /// Service costs a lookup, not a scan ([`RuleSet::index`]).
    by_frontend: HashMap<(IpAddr, u8, u16), Vec<usize>>,
    others: Vec<usize>,
}

impl Chain {
    pub fn new(rules: Vec<Rule>, firewall: bool, node_ports: bool) -> Self {
        let mut chain = Self { rules, firewall, node_ports, ..Self::default() };
        chain.index();
        chain
    }

    fn index(&mut self) {
        self.by_frontend.clear();
        self.others.clear();
        for (index, rule) in self.rules.iter().enumerate() {
            match rule.destination() {
                Destination { host: Some(dst), proto: Some(proto), port: Some(port), .. } => {
                    self.by_frontend.entry((dst, proto, port)).or_default().push(index)
                }
                _ => self.others.push(index),
            }
        }
    }

    /// The rules from `from` on that `packet` may match, in order.
    fn candidates(&self, from: usize, packet: &Packet) -> Vec<usize> {
        let named =
            self.by_frontend.get(&(packet.dst, packet.proto, packet.dport)).map(Vec::as_slice).unwrap_or_default();
        let mut out: Vec<usize> = named.iter().chain(&self.others).copied().filter(|i| *i >= from).collect();
        out.sort_unstable();
        out
    }
}

/// A frontend that kube-proxy's rules name: an address (`None`: a NodePort, any local
/// address), a protocol and a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Frontend {
    pub addr: Option<IpAddr>,
    pub proto: u8,
    pub port: u16,
}

/// One family's ruleset of kube-proxy.
#[derive(Debug, Default)]
pub struct RuleSet {
    pub chains: HashMap<String, Chain>,
    /// Where a new connection starts in the NAT hook (both PREROUTING and OUTPUT jump there).
    pub nat_entry: Vec<String>,
    /// Where a connection that kube-proxy did not translate is filtered: the input hook (to a
    /// local address), the forward hook, the output hook (the node's own).
    pub filter_input: String,
    pub filter_forward: String,
    pub filter_output: String,
    /// Filter chains before the NAT hook (nftables' source-range checks), for connections
    /// that arrive and for the node's own; empty: none.
    pub filter_pre_nat_in: String,
    pub filter_pre_nat_out: String,
}

/// What one walk ended with.
#[derive(Clone, Debug, PartialEq, Eq)]
enum End {
    Dnat(SocketAddr),
    Drop,
    Reject,
    Accept,
    FallThrough,
}

#[derive(Clone, Debug, Default)]
struct State {
    masquerade: bool,
    affinity: u32,
    ranges: Vec<Cidr>,
}

/// How deep chains may nest before the walk gives up (kube-proxy's are at most 5 deep).
const MAX_DEPTH: usize = 16;

impl RuleSet {
    /// The verdict for `packet`: the NAT walk's endpoints, or what the filter chains do with
    /// an untranslated connection.
    pub fn verdict(&self, packet: &Packet) -> Verdict {
        // Source ranges checked before the NAT hook.
        let pre_nat = if packet.in_link.is_some() { &self.filter_pre_nat_in } else { &self.filter_pre_nat_out };
        let mut ranges = BTreeSet::new();
        for (end, state) in self.walk(pre_nat, 0, packet, State::default(), 0) {
            match end {
                End::Drop => return Verdict::Drop,
                End::Reject => return Verdict::Reject,
                _ => ranges.extend(state.ranges),
            }
        }
        let mut ends = Vec::new();
        for entry in &self.nat_entry {
            ends = self.walk(entry, 0, packet, State::default(), 0);
            if ends.iter().any(|(end, _)| *end != End::FallThrough) {
                break;
            }
        }
        let mut endpoints = BTreeSet::new();
        let (mut masquerade, mut affinity) = (true, 0);
        let (mut dropped, mut rejected) = (false, false);
        for (end, state) in &ends {
            match end {
                End::Dnat(to) => {
                    endpoints.insert(*to);
                    masquerade &= state.masquerade;
                    affinity = affinity.max(state.affinity);
                    ranges.extend(state.ranges.iter().copied());
                }
                End::Drop => dropped = true,
                End::Reject => rejected = true,
                End::Accept | End::FallThrough => {}
            }
        }
        if !endpoints.is_empty() {
            return Verdict::Endpoints {
                endpoints,
                masquerade,
                affinity_seconds: affinity,
                source_ranges: ranges.into_iter().collect(),
            };
        }
        if dropped {
            return Verdict::Drop;
        }
        if rejected {
            return Verdict::Reject;
        }
        // The node's own connection to a local address passes the output hook, then the input
        // hook; any other goes through one.
        let hooks: &[&String] = match (&packet.in_link, packet.dst_local) {
            (None, false) => &[&self.filter_output],
            (None, true) => &[&self.filter_output, &self.filter_input],
            (Some(_), true) => &[&self.filter_input],
            (Some(_), false) => &[&self.filter_forward],
        };
        let ends: Vec<(End, State)> =
            hooks.iter().flat_map(|chain| self.walk(chain, 0, packet, State::default(), 0)).collect();
        if ends.iter().any(|(end, _)| *end == End::Drop) {
            Verdict::Drop
        } else if ends.iter().any(|(end, _)| *end == End::Reject) {
            Verdict::Reject
        } else {
            Verdict::Pass
        }
    }

    /// Every frontend the rules name: an address (a host route) with a protocol and port, or
    /// a protocol and port for local destinations (a NodePort).
    pub fn frontends(&self) -> BTreeSet<Frontend> {
        let mut out = BTreeSet::new();
        for (chain, rule) in self.chains.values().flat_map(|c| c.rules.iter().map(move |r| (c, r))) {
            let Destination { host: addr, other, local, proto, port } = rule.destination();
            if let (Some(proto), Some(port), false) = (proto, port, other)
                && (addr.is_some() || local || chain.node_ports)
            {
                out.insert(Frontend { addr, proto, port });
            }
        }
        out
    }

    fn walk(&self, chain: &str, from: usize, packet: &Packet, mut state: State, depth: usize) -> Vec<(End, State)> {
        let Some(rules) = self.chains.get(chain).filter(|_| depth < MAX_DEPTH) else {
            return vec![(End::FallThrough, state)];
        };
        if from == 0 && rules.firewall && packet.ranges_symbolic {
            state.ranges.extend(rules.rules.iter().flat_map(|r| &r.matches).flat_map(|m| match m {
                Match::Src { nets, .. } => nets.clone(),
                _ => Vec::new(),
            }));
        }
        let mut out = Vec::new();
        for index in rules.candidates(from, packet) {
            let rule = &rules.rules[index];
            let mut branch = state.clone();
            match self.matches(rule, packet, rules.firewall, &mut branch) {
                Some(false) => continue,
                // Both ways: the rule taken (below) and not taken.
                None => out.extend(self.walk(chain, index + 1, packet, state.clone(), depth)),
                Some(true) => {}
            }
            let state = branch;
            let end = match &rule.action {
                Action::Continue => {
                    out.extend(self.walk(chain, index + 1, packet, state, depth));
                    return out;
                }
                Action::MarkMasquerade => {
                    let state = State { masquerade: true, ..state };
                    out.extend(self.walk(chain, index + 1, packet, state, depth));
                    return out;
                }
                Action::Jump(target) => {
                    for (end, state) in self.walk(target, 0, packet, state, depth + 1) {
                        match end {
                            End::FallThrough => out.extend(self.walk(chain, index + 1, packet, state, depth)),
                            end => out.push((end, state)),
                        }
                    }
                    return out;
                }
                Action::Goto(target) => {
                    out.extend(self.walk(target, 0, packet, state, depth + 1));
                    return out;
                }
                Action::Return => End::FallThrough,
                Action::Dnat(to) => End::Dnat(*to),
                Action::MarkDrop | Action::Drop => End::Drop,
                Action::Reject => End::Reject,
                Action::Accept => End::Accept,
            };
            out.push((end, state));
            return out;
        }
        out.push((End::FallThrough, state));
        out
    }

    /// Whether `rule` matches: `None` when it may or may not (a random pick, an affinity check).
    fn matches(&self, rule: &Rule, p: &Packet, firewall: bool, state: &mut State) -> Option<bool> {
        let mut maybe = false;
        for m in &rule.matches {
            let yes = match m {
                // An admitted source, when the ranges are read rather than matched.
                Match::Src { negated, .. } if firewall && p.ranges_symbolic => !negated,
                Match::Src { nets, negated } => nets.iter().any(|n| n.contains(p.src)) != *negated,
                Match::Dst { nets, negated } => nets.iter().any(|n| n.contains(p.dst)) != *negated,
                Match::Proto(proto) => *proto == p.proto,
                Match::DPort(port) => *port == p.dport,
                Match::SrcLocal(want) => p.src_local == *want,
                Match::DstLocal(want) => p.dst_local == *want,
                Match::InLink { name, negated } => {
                    let on = p.in_link.as_deref().is_some_and(|link| match name.strip_suffix('+') {
                        Some(prefix) => link.starts_with(prefix),
                        None => link == name,
                    });
                    on != *negated
                }
                Match::Random => {
                    maybe = true;
                    true
                }
                Match::Affinity(seconds) => {
                    maybe = true;
                    state.affinity = state.affinity.max(*seconds);
                    true
                }
                Match::NodePortDst(nets) => nets.iter().any(|n| n.contains(p.dst)),
                Match::Never => false,
                Match::Always => true,
            };
            if !yes {
                return Some(false);
            }
        }
        if maybe { None } else { Some(true) }
    }
}

fn host_len(addr: &IpAddr) -> u8 {
    if addr.is_ipv4() { 32 } else { 128 }
}

/// An address or a CIDR as the rules write it (a bare address is a host prefix).
fn parse_net(s: &str) -> Option<Cidr> {
    if s.contains('/') {
        s.parse().ok()
    } else {
        let ip: IpAddr = s.parse().ok()?;
        Cidr::new(ip, host_len(&ip))
    }
}

fn protocol_number(name: &str) -> Option<u8> {
    match name {
        "tcp" | "6" => Some(proxy_common::IPPROTO_TCP),
        "udp" | "17" => Some(proxy_common::IPPROTO_UDP),
        "sctp" | "132" => Some(proxy_common::IPPROTO_SCTP),
        _ => None,
    }
}

/// Which of kube-proxy's modes wrote the rules of a family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Iptables,
    Nftables,
}

/// The running kube-proxy's rules of `family` on this node: its nftables table when there is
/// one, otherwise its iptables chains. `None`: neither is there. An error: they could not be
/// read (no `nft` nor `iptables-save` to run, or output this reader does not understand).
pub fn read(family: IpFamily) -> Result<Option<(Mode, RuleSet)>> {
    let table = match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    };
    let mut missing = Vec::new();
    match run("nft", &["-j", "list", "table", table, "kube-proxy"]) {
        Ok(Some(json)) => {
            return Ok(Some((Mode::Nftables, nftables::parse(&json).context("kube-proxy's nftables table")?)));
        }
        Ok(None) => {}
        Err(e) => missing.push(format!("nft: {e}")),
    }
    let saves: &[&str] = match family {
        IpFamily::V4 => &["iptables-save", "iptables-legacy-save"],
        IpFamily::V6 => &["ip6tables-save", "ip6tables-legacy-save"],
    };
    for save in saves {
        match run(save, &[]) {
            Ok(Some(text)) => {
                let rules = iptables::parse(&text).with_context(|| format!("{save}'s output"))?;
                if rules.chains.get("nat/KUBE-SERVICES").is_some_and(|c| !c.rules.is_empty()) {
                    return Ok(Some((Mode::Iptables, rules)));
                }
            }
            Ok(None) => {}
            Err(e) => missing.push(format!("{save}: {e}")),
        }
    }
    anyhow::ensure!(missing.len() < 1 + saves.len(), "kube-proxy's rules cannot be read: {}", missing.join("; "));
    Ok(None)
}

/// A command's standard output when it ran and succeeded; None when it failed (no such table);
/// an error when it could not be run (not installed).
fn run(program: &str, args: &[&str]) -> std::io::Result<Option<String>> {
    let out = Command::new(program).args(args).output()?;
    Ok(out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned()))
}

#[cfg(test)]
mod tests;
