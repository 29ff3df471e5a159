//! A datapath that checks itself (`kpr verify`, `--verify-period`): for every frontend and
//! source class the per-packet programs tell apart, one synthetic packet through the live tc
//! program against the live maps (`BPF_PROG_TEST_RUN`; the datapath side runs it and removes
//! the flow it made), and its fate compared with what the model says kube-proxy does: DNAT to
//! one of the port's endpoints (masqueraded or not), a REJECT, or a DROP. The node's own
//! frontends are the socket path's: one real `connect()` each, which sends nothing (a UDP
//! socket, or a TCP socket in repair mode), from a socket the hooks see as the node's, and
//! the peer the kernel gave it compared the same way.
//!
//! This module is the model's half: which probes, their packets, and the judgement. Nothing
//! here touches the kernel.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, Mutex},
};

use proxy_common::{
    IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, SCOPE_EXTERNAL, SCOPE_NODE, SCOPE_POD, SERVICE_FLAG_DROP_NO_ENDPOINTS,
    SERVICE_FLAG_MAGLEV, SERVICE_FLAG_SNAT, SERVICE_FLAG_SOCKET_SKIP, SERVICE_FLAG_SOURCE_RANGES, ServiceKey,
};
use serde::{Deserialize, Serialize};

use crate::datapath::Programmed;

/// An outside client: TEST-NET-2 (RFC 5737) and the documentation prefix (RFC 3849), never a
/// node's or a pod's address.
const OUTSIDE_V4: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 77);
const OUTSIDE_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0x6b70, 0x7276);

/// tc verdicts as `BPF_PROG_TEST_RUN` returns them.
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
/// -1: "not mine", the next program of the hook decides.
const TC_ACT_UNSPEC: u32 = u32::MAX;

/// What the node looks like to a probe: where NodePorts answer, its own addresses, and how a
/// client's packet is made.
#[derive(Clone, Debug, Default)]
pub struct ProbeEnv {
    /// The node's NodePort addresses: a NodePort frontend is probed at the first of its family.
    pub node_port_addrs: Vec<IpAddr>,
    /// The node's own addresses: an endpoint among them is delivered locally, never
    /// masqueraded.
    pub local_addrs: Vec<IpAddr>,
    /// Per family, an outside client and the link it arrives by (0: the test run's default,
    /// the loopback); none where its packet could not pass the link's reverse-path check.
    pub outside_clients: Vec<(IpAddr, u32)>,
    /// Per family, a client the local-traffic detector calls a pod, and its link; none where
    /// pods cannot be told apart or its packet could not pass the link's checks.
    pub pod_clients: Vec<(IpAddr, u32)>,
    /// The loopback (the link of a test run without one) checks sources (`rp_filter`).
    loopback_checks_sources: bool,
    /// The node's own connections can be probed (the socket hooks are attached and the probes
    /// have a cgroup under theirs).
    pub socket_probes: bool,
    /// The per-packet path covers every link: the socket path leaves it what it must serve
    /// (`KPR_POD_LINKS_COVERED`).
    pub pod_links_covered: bool,
    /// The cluster's Maglev seed and table size (`--maglev-seed`, `--maglev-table-size`): a
    /// Maglev frontend's probe expects the one endpoint its table names for the probe's tuple.
    pub maglev: Option<(u32, u32)>,
}

/// `rp_filter` in either mode, or no Ethernet (the probe is an Ethernet frame).
const LINK_UNFIT: u32 = proxy_common::LINK_FLAG_RP_FILTER_STRICT
    | proxy_common::LINK_FLAG_RP_FILTER_LOOSE
    | proxy_common::LINK_FLAG_NOT_ETHERNET;

impl ProbeEnv {
    /// The node as the node plan programs it: NodePort and local addresses, an outside client
    /// per family, and a pod client per family: the first address of a local-traffic CIDR
    /// (`detectLocalMode: ClusterCIDR`, never a pod's: a network address), else an outside
    /// address arriving by a local-traffic link (`BridgeInterface`, `InterfaceNamePrefix`)
    /// that checks no source. Clients without a link yet are given one by [`Self::arriving_by`].
    pub fn of(plan: &crate::model::node::NodePlan) -> Self {
        use proxy_common::{LINK_FLAG_LOCAL_TRAFFIC, NODE_ADDR_LOCAL, NODE_ADDR_NODEPORT};
        let flagged = |flag| plan.node_addrs.iter().filter(move |(_, f)| *f & flag != 0).map(|(a, _)| *a);
        let pod_link =
            plan.links.iter().find(|(_, l)| l.flags & LINK_FLAG_LOCAL_TRAFFIC != 0 && l.flags & LINK_UNFIT == 0);
        let pod_clients = [true, false]
            .into_iter()
            .filter_map(|v4| match plan.local_cidrs.iter().find(|c| c.is_ipv4() == v4) {
                Some(cidr) => Some((cidr.addr, 0)),
                None => pod_link.map(|(ifindex, _)| (outside(v4), *ifindex)),
            })
            .collect();
        Self {
            node_port_addrs: flagged(NODE_ADDR_NODEPORT).collect(),
            local_addrs: flagged(NODE_ADDR_LOCAL).collect(),
            outside_clients: vec![(outside(true), 0), (outside(false), 0)],
            pod_clients,
            loopback_checks_sources: plan.links.get(&LOOPBACK).is_some_and(|l| l.flags & LINK_UNFIT != 0),
            socket_probes: false,
            pod_links_covered: false,
            maglev: None,
        }
    }

    /// Give each client without a link the one its packets would arrive by: the link of
    /// `route_to` it (the kernel's route back, which a reverse-path check wants), else the
    /// loopback if that checks no source; a client that fits neither is not probed.
    pub fn arriving_by(mut self, route_to: impl Fn(IpAddr) -> Option<u32>) -> Self {
        let lo_fits = !self.loopback_checks_sources;
        let place = |clients: &mut Vec<(IpAddr, u32)>| {
            clients.retain_mut(|(ip, link)| {
                if *link == 0 {
                    *link = route_to(*ip).unwrap_or(0);
                }
                *link != 0 || lo_fits
            });
        };
        place(&mut self.outside_clients);
        place(&mut self.pod_clients);
        self
    }
}

/// The loopback's ifindex in every network namespace.
const LOOPBACK: u32 = 1;

fn outside(v4: bool) -> IpAddr {
    if v4 { OUTSIDE_V4.into() } else { OUTSIDE_V6.into() }
}

/// The source classes the per-packet programs tell apart on the way in, and the node's own
/// sockets, which the socket path decides at `connect()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    Pod,
    External,
    Node,
}

/// What kube-proxy does with a new connection to the frontend from the probe's client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// DNAT to one of `backends`, masqueraded (`SERVICE_FLAG_SNAT`) unless the endpoint is one
    /// of the node's own addresses.
    Forward { backends: Vec<SocketAddr>, masquerade: bool },
    /// A TCP reset or an ICMP port unreachable to the client; from the node's own socket,
    /// `connect()` failing (`ECONNREFUSED`, or `EPERM` for UDP and where the kernel lets the
    /// hook return no other error).
    Reject,
    /// From the node's own socket: `connect()` failing with `EPERM`.
    Drop,
    /// From the node's own socket: left untranslated to the per-packet path, which covers
    /// every link (a Service it must serve; a TCP DROP, which makes connect() time out there).
    PerPacket,
}

/// What the program did with a probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Forwarded {
        to: SocketAddr,
        from: SocketAddr,
    },
    Rejected,
    Dropped,
    /// Left untranslated for the stack (the socket path: connected to the frontend itself).
    Passed,
    /// The socket path: `connect()` found no route (`ENETUNREACH`, `EHOSTUNREACH`), after the
    /// hooks let it through, to an address the socket does not show.
    Unroutable,
    /// A verdict or a packet that is none of the above.
    Other(String),
}

/// What a socket probe's `connect()` gave, as the kernel's socket shows it (sock_diag), not as
/// the hooks show it to the application (getpeername is translated back).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SocketSeen {
    Connected {
        from: SocketAddr,
        to: SocketAddr,
    },
    /// `connect()` failed with this errno.
    Failed(i32),
    /// Connected, but sock_diag did not list the socket.
    Unlisted,
}

/// One synthetic new connection.
#[derive(Clone, Debug)]
pub struct Probe {
    pub frontend: ServiceKey,
    pub class: Class,
    /// The client (a node probe: unspecified, the socket's own).
    pub client: SocketAddr,
    /// The frontend's address (a NodePort: a NodePort address of the node) and port.
    pub target: SocketAddr,
    pub proto: u8,
    /// The link the packet arrives by (0: the test run's default).
    pub ifindex: u32,
    /// The frontend's sessionAffinity id (0: none): the probe's client entry is removed.
    pub affinity_id: u32,
    pub expect: Expect,
    /// Direct server return (`SERVICE_FLAG_DSR`): an endpoint on another node is reached
    /// unmasqueraded in the tunnel, or masqueraded where the node may not send packets
    /// straight out (the datapath's fallback): either agrees.
    pub direct_return: bool,
}

/// The probes for the frontends `keys` as the agent programmed them (`programmed`: its
/// record of what it wrote, which is what the model asked for at the last sync, whatever
/// changes are pending); and how many of them cannot be probed here
/// (the node's own traffic without socket probes; pod traffic where the node cannot tell pods
/// apart; SCTP from the node, which the socket path leaves alone; a NodePort without a
/// NodePort address of its family). A key no longer
/// programmed is passed over. `run` and `first` (the first key's place in the run) give each
/// probe a client port of its own.
pub fn probes<'k>(
    keys: impl IntoIterator<Item = &'k ServiceKey>,
    programmed: &BTreeMap<ServiceKey, Programmed>,
    env: &ProbeEnv,
    (run, first): (u64, usize),
) -> (Vec<Probe>, usize) {
    let (mut probes, mut skipped) = (Vec::new(), 0);
    for (i, key) in keys.into_iter().enumerate() {
        let Some(port) = programmed.get(key) else { continue };
        match probe(key, port, programmed, env, client_port(run, first + i)) {
            Some(p) => probes.push(p),
            None => skipped += 1,
        }
    }
    (probes, skipped)
}

/// An ephemeral port of its own for each probe of each run.
fn client_port(run: u64, i: usize) -> u16 {
    let mixed = (run.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9)) >> 40;
    32768 + (mixed % 28232) as u16
}

fn probe(
    key: &ServiceKey,
    port: &Programmed,
    all: &BTreeMap<ServiceKey, Programmed>,
    env: &ProbeEnv,
    client_port: u16,
) -> Option<Probe> {
    let frontend = IpAddr::from(key.addr);
    let v4 = frontend.is_ipv4();
    let (class, client_ip, ifindex) = match key.scope {
        SCOPE_EXTERNAL => {
            let (ip, ifindex) = env.outside_clients.iter().find(|(ip, _)| ip.is_ipv4() == v4)?;
            (Class::External, *ip, *ifindex)
        }
        SCOPE_POD => {
            let (ip, ifindex) = env.pod_clients.iter().find(|(ip, _)| ip.is_ipv4() == v4)?;
            (Class::Pod, *ip, *ifindex)
        }
        SCOPE_NODE if env.socket_probes && key.proto != IPPROTO_SCTP => (Class::Node, unspecified(v4), 0),
        _ => return None,
    };
    if ![IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP].contains(&key.proto) {
        return None;
    }
    let target_ip = if frontend.is_unspecified() {
        let addr = env.node_port_addrs.iter().find(|a| a.is_ipv4() == v4)?;
        // The same address and port as another frontend (an externalIP that is the node's): that
        // one answers, and it has a probe of its own.
        if all.contains_key(&ServiceKey { addr: (*addr).into(), ..*key }) {
            return None;
        }
        *addr
    } else {
        frontend
    };
    let flags = port.value.flags;
    let expect = if class == Class::Node {
        node_expect(port, key.proto, env.pod_links_covered)
    } else if flags & SERVICE_FLAG_SOURCE_RANGES != 0
        && !port.source_ranges.iter().any(|range| range.contains(client_ip))
    {
        Expect::Drop
    } else if port.backends.is_empty() {
        if flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0 { Expect::Drop } else { Expect::Reject }
    } else {
        let backends: Vec<SocketAddr> =
            port.backends.iter().map(|b| SocketAddr::new(b.addr.into(), u16::from_be(b.port))).collect();
        let client = SocketAddr::new(client_ip, client_port);
        let target = SocketAddr::new(target_ip, u16::from_be(key.port));
        // sessionAffinity (a timeout) first: a remembered endpoint wins over the table.
        let maglev = env.maglev.filter(|_| flags & SERVICE_FLAG_MAGLEV != 0 && port.value.affinity_timeout == 0);
        let backends = match maglev.and_then(|m| maglev_endpoint(&backends, client, target, key.proto, m)) {
            Some(endpoint) => vec![endpoint],
            None => backends,
        };
        Expect::Forward { backends, masquerade: flags & SERVICE_FLAG_SNAT != 0 }
    };
    let client_port = if class == Class::Node { 0 } else { client_port };
    let direct_return = flags & proxy_common::SERVICE_FLAG_DSR != 0;
    Some(Probe {
        direct_return,
        frontend: *key,
        class,
        client: SocketAddr::new(client_ip, client_port),
        target: SocketAddr::new(target_ip, u16::from_be(key.port)),
        proto: key.proto,
        ifindex,
        affinity_id: port.value.affinity_id,
        expect,
    })
}

/// The endpoint a Maglev frontend's table (built as the programmer builds it, from the
/// endpoints in the order of their range) names for the tuple; `None` where no table can be
/// built (the programmer wrote none: the frontend picks at random).
fn maglev_endpoint(
    endpoints: &[SocketAddr],
    client: SocketAddr,
    target: SocketAddr,
    proto: u8,
    (seed, size): (u32, u32),
) -> Option<SocketAddr> {
    let table = crate::model::maglev::table(endpoints, size, u64::from(seed)).ok()?;
    let hash = proxy_common::tuple_hash(
        seed,
        &client.ip().into(),
        &target.ip().into(),
        client.port().to_be(),
        target.port().to_be(),
        proto,
    );
    endpoints.get(*table.get((hash % size) as usize)? as usize).copied()
}

fn unspecified(v4: bool) -> IpAddr {
    if v4 { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() }
}

/// What the socket path does with the node's own `connect()` to a frontend (`sock_lb.rs`'s
/// `forward` and `refuse`): kube-proxy's verdict, in the form a socket can give it. The node's
/// connections are not checked against loadBalancerSourceRanges at connect() (the model
/// programs the node's entries for its own addresses) nor masqueraded there.
fn node_expect(port: &Programmed, proto: u8, pod_links_covered: bool) -> Expect {
    let flags = port.value.flags;
    let drop = flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0;
    if pod_links_covered && flags & SERVICE_FLAG_SOCKET_SKIP != 0 {
        Expect::PerPacket
    } else if port.backends.is_empty() {
        match (drop, pod_links_covered && proto == IPPROTO_TCP) {
            (true, true) => Expect::PerPacket,
            (true, false) => Expect::Drop,
            (false, _) => Expect::Reject,
        }
    } else {
        Expect::Forward {
            backends: port.backends.iter().map(|b| SocketAddr::new(b.addr.into(), u16::from_be(b.port))).collect(),
            masquerade: false,
        }
    }
}

impl Probe {
    /// The probe's packet as it arrives on an Ethernet link: a TCP SYN, a UDP datagram or an
    /// SCTP INIT, checksums correct.
    pub fn frame(&self) -> Vec<u8> {
        let (sport, dport) = (self.client.port().to_be_bytes(), self.target.port().to_be_bytes());
        let mut l4 = Vec::new();
        l4.extend_from_slice(&sport);
        l4.extend_from_slice(&dport);
        match self.proto {
            IPPROTO_TCP => {
                // seq 1, ack 0, a 20-byte header, SYN, a window; checksum and urgent pointer 0.
                l4.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xfa, 0xf0, 0, 0, 0, 0]);
            }
            IPPROTO_UDP => {
                let payload = b"kpr verify";
                l4.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
                l4.extend_from_slice(&[0, 0]);
                l4.extend_from_slice(payload);
            }
            _ => {
                // Verification tag 0 and the CRC, then an INIT chunk (type 1, 20 bytes): its
                // tag, receiver window, streams and initial TSN.
                l4.extend_from_slice(&[0; 8]);
                l4.extend_from_slice(&[1, 0, 0, 20, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1]);
                let crc = crc32c(&l4);
                l4[8..12].copy_from_slice(&crc.to_le_bytes());
            }
        }
        let (src, dst) = (self.client.ip(), self.target.ip());
        if self.proto != IPPROTO_SCTP {
            let at = if self.proto == IPPROTO_TCP { 16 } else { 6 };
            let sum = checksum(&[&pseudo_header(src, dst, self.proto, l4.len()), &l4]);
            l4[at..at + 2].copy_from_slice(&sum.to_be_bytes());
        }
        let mut frame = vec![0x02, 0, 0x6b, 0x70, 0x72, 0x01, 0x02, 0, 0x6b, 0x70, 0x72, 0x02];
        match (src, dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => {
                frame.extend_from_slice(&[0x08, 0x00]);
                let mut ip = vec![0x45, 0];
                ip.extend_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
                ip.extend_from_slice(&[0, 1, 0x40, 0, 64, self.proto, 0, 0]);
                ip.extend_from_slice(&src.octets());
                ip.extend_from_slice(&dst.octets());
                let sum = checksum(&[&ip]);
                ip[10..12].copy_from_slice(&sum.to_be_bytes());
                frame.extend_from_slice(&ip);
            }
            (src, dst) => {
                frame.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
                frame.extend_from_slice(&(l4.len() as u16).to_be_bytes());
                frame.extend_from_slice(&[self.proto, 64]);
                frame.extend_from_slice(&v6_octets(src));
                frame.extend_from_slice(&v6_octets(dst));
            }
        }
        frame.extend_from_slice(&l4);
        frame
    }

    /// What the program did: its verdict and the packet it left (`out`).
    pub fn outcome(&self, verdict: u32, out: &[u8]) -> Outcome {
        match verdict {
            TC_ACT_SHOT => return Outcome::Dropped,
            TC_ACT_UNSPEC => return Outcome::Passed,
            TC_ACT_OK | TC_ACT_REDIRECT => {}
            other => return Outcome::Other(format!("verdict {other}")),
        }
        let Some(seen) = Seen::parse(out) else { return Outcome::Other("a packet kpr cannot read".to_owned()) };
        if seen.dst.ip() == self.client.ip() {
            // An answer to the client: a reset, or an ICMP error (port unreachable).
            let reset = seen.proto == IPPROTO_TCP && seen.tcp_flags & 0x04 != 0;
            let unreachable = seen.proto == 1 || seen.proto == 58;
            return if reset || unreachable { Outcome::Rejected } else { Outcome::Other(format!("{seen}")) };
        }
        if seen.dst == self.target && seen.src == self.client {
            return Outcome::Passed;
        }
        Outcome::Forwarded { to: seen.dst, from: seen.src }
    }

    /// What a node probe's socket showed.
    pub fn socket_outcome(&self, seen: &SocketSeen) -> Outcome {
        match seen {
            SocketSeen::Connected { to, .. } if *to == self.target => Outcome::Passed,
            SocketSeen::Connected { from, to } => Outcome::Forwarded { to: *to, from: *from },
            SocketSeen::Failed(libc::ECONNREFUSED) => Outcome::Rejected,
            SocketSeen::Failed(libc::EPERM) => Outcome::Dropped,
            SocketSeen::Failed(libc::ENETUNREACH | libc::EHOSTUNREACH) => Outcome::Unroutable,
            SocketSeen::Failed(errno) => {
                Outcome::Other(format!("connect() failed: {}", std::io::Error::from_raw_os_error(*errno)))
            }
            SocketSeen::Unlisted => Outcome::Other("a connected socket sock_diag does not list".to_owned()),
        }
    }

    /// Whether `outcome` is what kube-proxy does; `local_addrs`: the node's own.
    pub fn agrees(&self, outcome: &Outcome, local_addrs: &[IpAddr]) -> bool {
        if self.class == Class::Node {
            return match (&self.expect, outcome) {
                // The node's own connection: its source is the node's either way.
                (Expect::Forward { backends, .. }, Outcome::Forwarded { to, .. }) => backends.contains(to),
                // An endpoint the node has no route to (a namespace without a default route)
                // is not the datapath's to mend: not a mismatch. A refusal the hooks owed
                // comes before any route lookup, so it still is one.
                (Expect::Forward { .. }, Outcome::Unroutable) => true,
                (Expect::Reject, Outcome::Rejected | Outcome::Dropped)
                | (Expect::Drop, Outcome::Dropped)
                | (Expect::PerPacket, Outcome::Passed) => true,
                _ => false,
            };
        }
        match (&self.expect, outcome) {
            (Expect::Forward { backends, masquerade }, Outcome::Forwarded { to, from }) => {
                let masqueraded = from.ip() != self.client.ip();
                backends.contains(to)
                    && (self.direct_return || masqueraded == (*masquerade && !local_addrs.contains(&to.ip())))
            }
            (Expect::Reject, Outcome::Rejected) | (Expect::Drop, Outcome::Dropped) => true,
            _ => false,
        }
    }
}

/// The addresses and ports of a packet the program left.
struct Seen {
    src: SocketAddr,
    dst: SocketAddr,
    proto: u8,
    tcp_flags: u8,
}

impl Seen {
    /// A packet of direct server return (IP-in-IP of its family) is seen as going from the inner
    /// packet's source to the endpoint its outer header names: the outer destination, and the
    /// port in the IPv4 id or the IPv6 flow label.
    fn parse(frame: &[u8]) -> Option<Self> {
        let (inner_at, port_at) = match (frame.get(12..14)?, frame.get(23), frame.get(20)) {
            ([0x08, 0x00], Some(4), _) => (14 + usize::from(frame.get(14)? & 0x0f) * 4, 18),
            ([0x86, 0xdd], _, Some(41)) => (54, 16),
            _ => return Self::parse_plain(frame),
        };
        let outer = Self::parse_plain(frame)?;
        let inner = Self::parse_plain(&[frame.get(..14)?, frame.get(inner_at..)?].concat())?;
        let port = u16::from_be_bytes(frame.get(port_at..port_at + 2)?.try_into().ok()?);
        Some(Self { dst: SocketAddr::new(outer.dst.ip(), port), ..inner })
    }

    fn parse_plain(frame: &[u8]) -> Option<Self> {
        let (src, dst, proto, l4) = match frame.get(12..14)? {
            [0x08, 0x00] => {
                let ihl = usize::from(frame.get(14)? & 0x0f) * 4;
                let addr = |at: usize| -> Option<IpAddr> {
                    Some(Ipv4Addr::from(<[u8; 4]>::try_from(frame.get(at..at + 4)?).ok()?).into())
                };
                (addr(26)?, addr(30)?, *frame.get(23)?, frame.get(14 + ihl..)?)
            }
            [0x86, 0xdd] => {
                let addr = |at: usize| -> Option<IpAddr> {
                    Some(Ipv6Addr::from(<[u8; 16]>::try_from(frame.get(at..at + 16)?).ok()?).into())
                };
                (addr(22)?, addr(38)?, *frame.get(20)?, frame.get(54..)?)
            }
            _ => return None,
        };
        let port = |at: usize| l4.get(at..at + 2).map_or(0, |p| u16::from_be_bytes([p[0], p[1]]));
        let tcp_flags = if proto == IPPROTO_TCP { *l4.get(13)? } else { 0 };
        Some(Self { src: SocketAddr::new(src, port(0)), dst: SocketAddr::new(dst, port(2)), proto, tcp_flags })
    }
}

impl std::fmt::Display for Seen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a packet {} → {} (protocol {})", self.src, self.dst, self.proto)
    }
}

impl std::fmt::Display for Expect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Forward { backends, masquerade } => {
                let list: Vec<String> = backends.iter().map(ToString::to_string).collect();
                let how = if *masquerade { ", masqueraded" } else { "" };
                write!(f, "DNAT to one of {}{how}", list.join(" "))
            }
            Self::Reject => f.write_str("REJECT"),
            Self::Drop => f.write_str("DROP"),
            Self::PerPacket => f.write_str("left to the per-packet path"),
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Forwarded { to, from } => write!(f, "DNAT to {to} from {from}"),
            Self::Rejected => f.write_str("REJECT"),
            Self::Dropped => f.write_str("DROP"),
            Self::Passed => f.write_str("left untranslated"),
            Self::Unroutable => f.write_str("connect() found no route"),
            Self::Other(what) => f.write_str(what),
        }
    }
}

fn v6_octets(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V6(v6) => v6.octets(),
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
    }
}

fn pseudo_header(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> Vec<u8> {
    let mut pseudo = Vec::new();
    match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            pseudo.extend_from_slice(&src.octets());
            pseudo.extend_from_slice(&dst.octets());
            pseudo.extend_from_slice(&[0, proto]);
            pseudo.extend_from_slice(&(len as u16).to_be_bytes());
        }
        (src, dst) => {
            pseudo.extend_from_slice(&v6_octets(src));
            pseudo.extend_from_slice(&v6_octets(dst));
            pseudo.extend_from_slice(&(len as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, proto]);
        }
    }
    pseudo
}

/// The Internet checksum of the concatenated `parts` (each of even length but the last).
fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for chunk in parts.iter().flat_map(|p| p.chunks(2)) {
        sum += u32::from(u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// SCTP's CRC32c (RFC 3309), bit by bit: a probe is a few dozen bytes.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for byte in data {
        crc ^= u32::from(*byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82f6_3b78 } else { crc >> 1 };
        }
    }
    !crc
}

/// One frontend whose probe the programs decided otherwise than kube-proxy would.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// The frontend as the client addressed it (`address:port/protocol`).
    pub frontend: String,
    pub class: Class,
    pub service: String,
    pub expected: String,
    pub seen: String,
}

impl Failure {
    /// `service`: the frontend's Service port, for the report.
    pub fn new(probe: &Probe, outcome: &Outcome, service: String) -> Self {
        let proto = match probe.proto {
            IPPROTO_TCP => "TCP",
            IPPROTO_UDP => "UDP",
            _ => "SCTP",
        };
        Self {
            frontend: format!("{}/{proto}", probe.target),
            class: probe.class,
            service,
            expected: probe.expect.to_string(),
            seen: outcome.to_string(),
        }
    }
}

/// The last verification, as `/verify` serves it and `kpr verify` prints it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VerifyReport {
    /// Runs so far (0: none yet).
    pub runs: u64,
    /// Frontends probed, and those that cannot be probed here.
    pub probed: usize,
    pub skipped: usize,
    /// How long the probes took (the resync and its second run aside).
    pub elapsed_ms: f64,
    /// Of the last run.
    pub failures: Vec<Failure>,
    /// After a run with failures: whether the resync that followed repaired them (the run
    /// again, at once, found none).
    pub repaired: Option<bool>,
    /// Why the last run could not probe (no datapath to run, the sources not synced yet).
    pub problem: Option<String>,
}

impl VerifyReport {
    pub fn render(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        if let Some(problem) = &self.problem {
            let _ = writeln!(out, "not verified: {problem}");
            return out;
        }
        let _ = writeln!(
            out,
            "run {}: {} frontends probed in {:.1} ms, {} not probed here (no source to probe from)",
            self.runs, self.probed, self.elapsed_ms, self.skipped
        );
        for f in &self.failures {
            let class = match f.class {
                Class::Pod => "pod",
                Class::External => "external",
                Class::Node => "node",
            };
            let _ = writeln!(
                out,
                "MISMATCH {} from {class} ({}): want {}, got {}",
                f.frontend, f.service, f.expected, f.seen
            );
        }
        match self.repaired {
            Some(true) => out.push_str("repaired by a resync: the probes agree again\n"),
            Some(false) => out.push_str("NOT repaired by a resync\n"),
            None if self.failures.is_empty() => out.push_str("the datapath agrees with the model\n"),
            None => {}
        }
        out
    }
}

/// Shared between the agent's loop and the metrics server: the last report, and a way to ask
/// for a run now (`/verify?now`, `kpr verify`).
#[derive(Default)]
pub struct Shared {
    pub report: Mutex<VerifyReport>,
    pub run_now: tokio::sync::Notify,
}

/// `/verify` on the metrics server.
pub fn route(shared: Arc<Shared>) -> crate::servers::http_server::Handler {
    Arc::new(move |request| {
        if request.uri.query() == Some("now") {
            shared.run_now.notify_one();
        }
        crate::servers::http_server::json(http::StatusCode::OK, &*shared.report.lock().expect("verify report"))
    })
}

/// `kpr verify`: ask the agent at `address` for a run now and wait for its report.
pub fn fetch_report(address: SocketAddr) -> anyhow::Result<VerifyReport> {
    use anyhow::Context as _;
    let timeout = std::time::Duration::from_secs(5);
    let get = |path: &str| -> anyhow::Result<VerifyReport> {
        let (status, body) = crate::inspect::http_get(address, path, timeout)
            .with_context(|| format!("no agent answers at {address}"))?;
        anyhow::ensure!(status == 200, "{address}{path} answered {status}");
        serde_json::from_str(&body).context("the verify report")
    };
    let before = get("/verify?now")?.runs;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let report = get("/verify")?;
        if report.runs > before {
            return Ok(report);
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "the agent did not verify within 60 s");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proxy_common::ServiceValue;

    use super::*;
    use crate::{
        datapath::backend,
        model::{Protocol, cidr::Cidr, desired::frontend_key},
    };

    type Frontends = BTreeMap<ServiceKey, Programmed>;

    fn port(backends: &[(&str, u16)], flags: u32) -> Programmed {
        let value = ServiceValue {
            service_id: 1,
            backends_start: 0,
            backends_count: backends.len() as u32,
            flags,
            affinity_timeout: 0,
            affinity_id: 0,
        };
        let backends = backends.iter().map(|(ip, port)| backend(ip.parse::<IpAddr>().unwrap(), *port)).collect();
        Programmed { value, backends, source_ranges: vec![] }
    }

    fn env() -> ProbeEnv {
        ProbeEnv {
            node_port_addrs: vec!["10.0.0.1".parse().unwrap()],
            local_addrs: vec!["10.0.0.1".parse().unwrap()],
            outside_clients: vec![(outside(true), 0)],
            pod_clients: vec![("10.244.0.0".parse().unwrap(), 0)],
            loopback_checks_sources: false,
            socket_probes: false,
            pod_links_covered: false,
            maglev: None,
        }
    }

    fn probes_of(frontends: &Frontends) -> (Vec<Probe>, usize) {
        probes(frontends.keys(), frontends, &env(), (1, 0))
    }

    /// A Maglev frontend's probe expects the one endpoint its table names for the probe's
    /// tuple (tc_testrun checks that against the program); without the cluster's settings, or
    /// with sessionAffinity (a remembered endpoint wins), any of them.
    #[test]
    fn a_maglev_frontends_probe_expects_its_tables_endpoint() {
        let eps = [("10.244.1.5", 8080), ("10.244.2.5", 8080), ("10.244.3.5", 8080), ("10.244.4.5", 8080)];
        let key = frontend_key([0, 0, 0, 0], 30080, Protocol::Tcp, SCOPE_EXTERNAL);
        let d: Frontends = [(key, port(&eps, SERVICE_FLAG_SNAT | SERVICE_FLAG_MAGLEV))].into();
        let all: Vec<SocketAddr> = eps.iter().map(|(ip, p)| SocketAddr::new(ip.parse().unwrap(), *p)).collect();
        let maglev = ProbeEnv { maglev: Some((7, 251)), ..env() };
        let mut picked = BTreeSet::new();
        for run in 0..32 {
            let (by_table, _) = probes(d.keys(), &d, &maglev, (run, 0));
            let Expect::Forward { backends, masquerade: true } = &by_table[0].expect else { panic!("{by_table:?}") };
            assert_eq!(backends.len(), 1, "one endpoint: {backends:?}");
            assert!(all.contains(&backends[0]));
            picked.insert(backends[0]);
            let (random, _) = probes(d.keys(), &d, &env(), (run, 0));
            assert_eq!(random[0].expect, Expect::Forward { backends: all.clone(), masquerade: true });
        }
        assert!(picked.len() > 1, "the tuples of 32 runs all named {picked:?}");
        let mut affinity = d.clone();
        affinity.get_mut(&key).unwrap().value.affinity_timeout = 10_800;
        let (remembered, _) = probes(affinity.keys(), &affinity, &maglev, (1, 0));
        assert_eq!(remembered[0].expect, Expect::Forward { backends: all, masquerade: true });
    }

    #[test]
    fn each_frontend_and_class_gets_the_expectation_kube_proxy_has() {
        let mut d = Frontends::new();
        d.insert(frontend_key([10, 96, 0, 1], 80, Protocol::Tcp, SCOPE_POD), port(&[("10.244.1.5", 8080)], 0));
        d.insert(
            frontend_key([0, 0, 0, 0], 30080, Protocol::Tcp, SCOPE_EXTERNAL),
            port(&[("10.244.1.5", 8080)], SERVICE_FLAG_SNAT),
        );
        d.insert(frontend_key([10, 96, 0, 2], 53, Protocol::Udp, SCOPE_POD), port(&[], 0));
        d.insert(
            frontend_key([10, 96, 0, 3], 80, Protocol::Tcp, SCOPE_EXTERNAL),
            port(&[], SERVICE_FLAG_DROP_NO_ENDPOINTS),
        );
        let mut ranged = port(&[("10.244.1.5", 8080)], SERVICE_FLAG_SOURCE_RANGES);
        ranged.source_ranges = vec!["203.0.113.0/24".parse::<Cidr>().unwrap()];
        d.insert(frontend_key([192, 0, 2, 10], 443, Protocol::Tcp, SCOPE_EXTERNAL), ranged);
        // The node's own traffic is the socket path's: not probed here.
        d.insert(frontend_key([10, 96, 0, 1], 80, Protocol::Tcp, SCOPE_NODE), port(&[("10.244.1.5", 8080)], 0));
        let (probes, skipped) = probes_of(&d);
        assert_eq!(skipped, 1);
        let seen: Vec<(String, Class, Expect)> =
            probes.iter().map(|p| (p.target.to_string(), p.class, p.expect.clone())).collect();
        let forward = |masquerade| Expect::Forward { backends: vec!["10.244.1.5:8080".parse().unwrap()], masquerade };
        assert!(seen.contains(&("10.96.0.1:80".into(), Class::Pod, forward(false))));
        assert!(seen.contains(&("10.0.0.1:30080".into(), Class::External, forward(true))));
        assert!(seen.contains(&("10.96.0.2:53".into(), Class::Pod, Expect::Reject)));
        assert!(seen.contains(&("10.96.0.3:80".into(), Class::External, Expect::Drop)));
        // The outside client is not in loadBalancerSourceRanges.
        assert!(seen.contains(&("192.0.2.10:443".into(), Class::External, Expect::Drop)));
        let pod = probes.iter().find(|p| p.class == Class::Pod).unwrap();
        assert_eq!(pod.client.ip(), "10.244.0.0".parse::<IpAddr>().unwrap());
        // Each probe a client port of its own.
        let ports: BTreeSet<u16> = probes.iter().map(|p| p.client.port()).collect();
        assert_eq!(ports.len(), probes.len());
    }

    #[test]
    fn outcomes_are_read_from_the_packet_the_program_left() {
        let mut d = Frontends::new();
        d.insert(
            frontend_key([10, 96, 0, 1], 80, Protocol::Tcp, SCOPE_EXTERNAL),
            port(&[("10.244.1.5", 8080)], SERVICE_FLAG_SNAT),
        );
        let probe = &probes_of(&d).0[0];
        let frame = probe.frame();
        // The probe's own packet, checksums as the kernel checks them.
        assert_eq!(checksum(&[&frame[14..34]]), 0);
        let l4 = &frame[34..];
        assert_eq!(checksum(&[&pseudo_header(probe.client.ip(), probe.target.ip(), IPPROTO_TCP, l4.len()), l4]), 0);
        assert_eq!(probe.outcome(TC_ACT_OK, &frame), Outcome::Passed);
        assert_eq!(probe.outcome(TC_ACT_SHOT, &frame), Outcome::Dropped);
        // The program's DNAT and masquerade, written into the frame.
        let mut out = frame.clone();
        out[26..30].copy_from_slice(&[10, 0, 0, 1]);
        out[30..34].copy_from_slice(&[10, 244, 1, 5]);
        out[36..38].copy_from_slice(&8080u16.to_be_bytes());
        let seen = probe.outcome(TC_ACT_REDIRECT, &out);
        assert!(matches!(seen, Outcome::Forwarded { to, .. } if to == "10.244.1.5:8080".parse().unwrap()));
        assert!(probe.agrees(&seen, &[]));
        // Not masqueraded where kube-proxy would: a mismatch, unless the endpoint is the node's.
        out[26..30].copy_from_slice(&frame[26..30]);
        assert!(!probe.agrees(&probe.outcome(TC_ACT_OK, &out), &[]));
        assert!(probe.agrees(&probe.outcome(TC_ACT_OK, &out), &["10.244.1.5".parse().unwrap()]));
        // To an address that is no endpoint of the port: a mismatch.
        out[30..34].copy_from_slice(&[10, 244, 9, 9]);
        assert!(!probe.agrees(&probe.outcome(TC_ACT_OK, &out), &[]));
        // A reset to the client is a REJECT, which this frontend must not answer.
        let mut reset = frame.clone();
        reset[30..34].copy_from_slice(&frame[26..30]);
        reset[34 + 13] = 0x14;
        assert_eq!(probe.outcome(TC_ACT_REDIRECT, &reset), Outcome::Rejected);
        assert!(!probe.agrees(&Outcome::Rejected, &[]));
    }

    /// Direct server return: the program leaves the client's packet untranslated inside an
    /// outer header to the endpoint (its port in the IPv4 id), which the probe reads as the
    /// packet going from the client to that endpoint: unmasqueraded, as the entry says.
    #[test]
    fn a_direct_server_return_outcome_is_read_from_the_tunnels_outer_header() {
        let d: Frontends = [(
            frontend_key([192, 0, 2, 10], 80, Protocol::Tcp, SCOPE_EXTERNAL),
            port(&[("10.244.2.2", 8080)], proxy_common::SERVICE_FLAG_DSR),
        )]
        .into();
        let probe = &probes_of(&d).0[0];
        assert_eq!(
            probe.expect,
            Expect::Forward { backends: vec!["10.244.2.2:8080".parse().unwrap()], masquerade: false }
        );
        let frame = probe.frame();
        let mut out = frame[..14].to_vec();
        let mut outer = [0x45, 0, 0, 0, 0x1f, 0x90, 0x40, 0, 64, 4, 0, 0, 10, 0, 0, 1, 10, 244, 2, 2];
        outer[2..4].copy_from_slice(&((frame.len() - 14 + 20) as u16).to_be_bytes());
        out.extend_from_slice(&outer);
        out.extend_from_slice(&frame[14..]);
        let seen = probe.outcome(TC_ACT_REDIRECT, &out);
        assert_eq!(seen, Outcome::Forwarded { to: "10.244.2.2:8080".parse().unwrap(), from: probe.client });
        assert!(probe.agrees(&seen, &[]));
        // The same endpoint at another port: a mismatch.
        out[18..20].copy_from_slice(&9090u16.to_be_bytes());
        assert!(!probe.agrees(&probe.outcome(TC_ACT_REDIRECT, &out), &[]));
    }

    #[test]
    fn clients_arrive_by_the_link_their_route_leaves_by_or_are_not_probed() {
        use proxy_common::{LINK_FLAG_LOCAL_TRAFFIC, LINK_FLAG_RP_FILTER_STRICT, LinkInfo};

        use crate::model::node::NodePlan;
        let link = |flags| LinkInfo { flags, ..LinkInfo::default() };
        let mut plan = NodePlan::default();
        plan.local_cidrs.insert("10.244.0.0/16".parse().unwrap());
        // Routes to the outside IPv4 client (by link 2) and to the pods' CIDR (link 5); none
        // to the outside IPv6 client.
        let route = |ip: IpAddr| match ip {
            ip if ip == outside(true) => Some(2),
            ip if ip == "10.244.0.0".parse::<IpAddr>().unwrap() => Some(5),
            _ => None,
        };
        let env = ProbeEnv::of(&plan).arriving_by(route);
        assert_eq!(env.outside_clients, vec![(outside(true), 2), (outside(false), 0)]);
        assert_eq!(env.pod_clients, vec![("10.244.0.0".parse().unwrap(), 5)]);
        // A loopback that checks sources: no route, no probe (its packet would be dropped as
        // any such client's).
        plan.links.insert(LOOPBACK, link(LINK_FLAG_RP_FILTER_STRICT));
        let env = ProbeEnv::of(&plan).arriving_by(route);
        assert_eq!(env.outside_clients, vec![(outside(true), 2)]);
        // Pods told apart by their link: an outside address on a local-traffic link that
        // checks no source; none where every such link checks.
        plan.local_cidrs.clear();
        plan.links.insert(7, link(LINK_FLAG_LOCAL_TRAFFIC | LINK_FLAG_RP_FILTER_STRICT));
        assert_eq!(ProbeEnv::of(&plan).pod_clients, vec![]);
        plan.links.insert(8, link(LINK_FLAG_LOCAL_TRAFFIC));
        let env = ProbeEnv::of(&plan).arriving_by(route);
        assert_eq!(env.pod_clients, vec![(outside(true), 8), (outside(false), 8)]);
    }

    #[test]
    fn the_nodes_own_frontends_are_judged_as_the_socket_path_decides() {
        let mut d = Frontends::new();
        let node = |addr, port, proto| frontend_key(addr, port, proto, SCOPE_NODE);
        d.insert(node([10, 96, 0, 1], 80, Protocol::Tcp), port(&[("10.244.1.5", 8080)], SERVICE_FLAG_SNAT));
        d.insert(node([10, 96, 0, 2], 53, Protocol::Udp), port(&[], 0));
        d.insert(node([10, 96, 0, 3], 80, Protocol::Tcp), port(&[], SERVICE_FLAG_DROP_NO_ENDPOINTS));
        d.insert(node([10, 96, 0, 4], 80, Protocol::Tcp), port(&[("10.244.1.5", 8080)], SERVICE_FLAG_SOCKET_SKIP));
        d.insert(node([0, 0, 0, 0], 30080, Protocol::Tcp), port(&[("10.244.1.6", 8080)], 0));
        d.insert(node([10, 96, 0, 5], 9, Protocol::Sctp), port(&[("10.244.1.5", 9)], 0));
        let expect_of = |env: &ProbeEnv| -> (Vec<(String, Expect)>, usize) {
            let (probes, skipped) = probes(d.keys(), &d, env, (1, 0));
            assert!(probes.iter().all(|p| p.class == Class::Node && p.client.port() == 0));
            let mut seen: Vec<(String, Expect)> =
                probes.into_iter().map(|p| (p.target.to_string(), p.expect)).collect();
            seen.sort_by(|a, b| a.0.cmp(&b.0));
            (seen, skipped)
        };
        // Without socket probes (no hooks, no cgroup for them): none.
        assert_eq!(expect_of(&env()).1, 6);
        let forward = |to: &str| Expect::Forward { backends: vec![to.parse().unwrap()], masquerade: false };
        let mut with_sockets = ProbeEnv { socket_probes: true, ..env() };
        let (seen, skipped) = expect_of(&with_sockets);
        // SCTP: the socket path leaves it alone.
        assert_eq!(skipped, 1);
        assert_eq!(
            seen,
            vec![
                ("10.0.0.1:30080".to_owned(), forward("10.244.1.6:8080")),
                ("10.96.0.1:80".to_owned(), forward("10.244.1.5:8080")),
                ("10.96.0.2:53".to_owned(), Expect::Reject),
                ("10.96.0.3:80".to_owned(), Expect::Drop),
                ("10.96.0.4:80".to_owned(), forward("10.244.1.5:8080")),
            ]
        );
        // Every link covered: the socket path steps aside for what the per-packet path must
        // serve, and for a TCP DROP (a SYN dropped at egress times connect() out).
        with_sockets.pod_links_covered = true;
        let (seen, _) = expect_of(&with_sockets);
        assert_eq!(seen[3].1, Expect::PerPacket);
        assert_eq!(seen[4].1, Expect::PerPacket);
        assert_eq!(seen[2].1, Expect::Reject);

        // The outcome is the peer the kernel's socket has, and connect()'s error.
        let (probes, _) = probes(d.keys(), &d, &ProbeEnv { socket_probes: true, ..env() }, (1, 0));
        let judge = |target: &str, seen: SocketSeen| {
            let probe = probes.iter().find(|p| p.target.to_string() == target).unwrap();
            probe.agrees(&probe.socket_outcome(&seen), &[])
        };
        let connected =
            |to: &str| SocketSeen::Connected { from: "10.0.0.1:40000".parse().unwrap(), to: to.parse().unwrap() };
        assert!(judge("10.96.0.1:80", connected("10.244.1.5:8080")));
        assert!(!judge("10.96.0.1:80", connected("10.244.9.9:8080")));
        // Untranslated: connected to the ClusterIP itself.
        assert!(!judge("10.96.0.1:80", connected("10.96.0.1:80")));
        assert!(judge("10.96.0.2:53", SocketSeen::Failed(libc::EPERM)));
        assert!(judge("10.96.0.2:53", SocketSeen::Failed(libc::ECONNREFUSED)));
        assert!(!judge("10.96.0.2:53", connected("10.244.1.5:53")));
        assert!(judge("10.96.0.3:80", SocketSeen::Failed(libc::EPERM)));
        assert!(!judge("10.96.0.3:80", SocketSeen::Failed(libc::ECONNREFUSED)));
        // No route to the endpoint: not the datapath's doing; a refusal owed still is.
        assert!(judge("10.96.0.1:80", SocketSeen::Failed(libc::ENETUNREACH)));
        assert!(!judge("10.96.0.2:53", SocketSeen::Failed(libc::ENETUNREACH)));
        assert!(!judge("10.96.0.1:80", SocketSeen::Failed(libc::EADDRNOTAVAIL)));
        assert!(!judge("10.96.0.1:80", SocketSeen::Unlisted));
    }

    #[test]
    fn sctp_probes_carry_a_valid_crc() {
        // RFC 3720's check value for CRC32c: "123456789" → 0xe3069283.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }
}
