//! Per-packet service translation on node interfaces (tc/TCX).
//!
//! Ingress: a packet of a known flow is rewritten from its conntrack entry; a new packet to a
//! frontend (ClusterIP, externalIP, LoadBalancer IP, NodeIP:nodePort) gets a backend,
//! masquerade (SNAT to the node) when the frontend says so or the client is its own backend
//! (hairpin), and two conntrack entries: one for its direction, one for the replies.
//! Egress: only the conntrack rewrite (replies of local backends leaving toward the client).
//!
//! Flows live as long as their state allows (`CtTimeouts`: SYN sent, established, closing);
//! an expired flow's tuple and SNAT port are taken back on the packet path, and the agent
//! sweeps the rest. The backend and SNAT port of a new flow are a hash of its tuple, so a TCP
//! connection whose entries were evicted is re-created as it was by its next segment.
//!
//! A datagram in fragments is translated whole: the first fragment (with the ports) as any
//! packet, the later ones with the addresses it got (`KPR_FRAGMENTS`).
//!
//! Packets the program does not translate go on to the next program of the hook
//! (`TC_ACT_UNSPEC`: a CNI's or observability program attached after kpr still sees them);
//! packets it does not understand (not IPv4, IP options, other protocols) are also counted.
//! The program never fails a packet it did not translate.
use aya_ebpf::{
    EbpfContext as _, Global,
    bindings::{
        __sk_buff, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC, bpf_fib_lookup,
    },
    btf_maps::lpm_trie::Key,
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect_neigh},
    macros::classifier,
    programs::TcContext,
};
use network_types::{eth::EtherType, ip::Ipv4Hdr};
use proxy_common::{
    AFFINITY_BY_ADDR, Addr, Backend, CidrKey, CtKey, CtTimeouts, CtValue, DETECT_LOCAL_CIDR, DETECT_LOCAL_INTERFACE,
    FragmentKey, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, LINK_FLAG_LOCAL_TRAFFIC, NODE_ADDR_LOCAL, NODE_ADDR_NODEPORT,
    SCOPE_EXTERNAL, SCOPE_NODE, SCOPE_POD, SERVICE_FLAG_DROP_NO_ENDPOINTS, SERVICE_FLAG_SNAT,
    SERVICE_FLAG_SOURCE_RANGES, SNAT_PORT_MAX, SNAT_PORT_MIN, ServiceKey, ServiceValue, SourceRange, counter, crc32c,
    csum, ct, has_states,
};

use crate::{
    maps::{
        CONNTRACK, CT_NEW, FRAGMENTS, FlowMap, HANDOVER, LINKS, LOCAL_CIDRS, SERVICES, SOURCE_RANGES, ServiceRangeMiss,
        affinity_backend, backend_at, count, in_addr_filter, link_addr, node_addr_flags, now, refusal,
        remember_affinity, serves, service_range_miss,
    },
    packet::*,
    tc_reject::{reject_port_unreachable, reject_tcp},
};

/// Tries at finding a free SNAT port before giving up on a new flow.
const SNAT_TRIES: u32 = 16;
const AF_INET: u8 = 2;

/// The SNAT port range, disjoint from the node's ephemeral ports; set by the agent at load.
#[unsafe(no_mangle)]
static KPR_SNAT_PORT_MIN: Global<u16> = Global::new(SNAT_PORT_MIN);
#[unsafe(no_mangle)]
static KPR_SNAT_PORT_MAX: Global<u16> = Global::new(SNAT_PORT_MAX);

/// How pods are told from other sources (`DETECT_LOCAL_*`); set by the agent at load time.
#[unsafe(no_mangle)]
static KPR_DETECT_LOCAL: Global<u8> = Global::new(0);

/// Flow lifetimes by state; set by the agent at load time.
#[unsafe(no_mangle)]
static KPR_CT_TIMEOUTS: Global<CtTimeouts> = Global::new(CtTimeouts::DEFAULT);

/// Seed of the flow hash (backend and SNAT port choice); set by the agent at load time, the
/// same for every agent of one boot so that a restarted agent re-creates flows as they were.
#[unsafe(no_mangle)]
static KPR_FLOW_HASH_SEED: Global<u32> = Global::new(0);

/// "Not mine": the next program of the hook (TCX) or filter of the chain (cls_bpf) decides.
const PASS: i32 = TC_ACT_UNSPEC;

/// 1: a packet translated on its way in is sent straight out of the link its route leaves by;
/// 0: it goes on through the host's forwarding path (`--host-routing`). Set by the agent.
#[unsafe(no_mangle)]
static KPR_FORWARD_DIRECT: Global<u8> = Global::new(1);

#[classifier]
pub fn kpr_tc_ingress(ctx: TcContext) -> i32 {
    match translate(&ctx, true) {
        Ok(TC_ACT_OK) if KPR_FORWARD_DIRECT.load() != 0 => forward_direct(&ctx),
        Ok(verdict) => verdict,
        Err(()) => PASS,
    }
}

#[classifier]
pub fn kpr_tc_egress(ctx: TcContext) -> i32 {
    translate(&ctx, false).unwrap_or(PASS)
}

/// A packet's addresses and ports, as they sit in the packet (network byte order).
#[derive(Clone, Copy)]
pub struct Tuple {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// The first fragment of a datagram in fragments: its IP id (as in the packet).
    pub first_fragment: Option<u16>,
}

/// The Ethernet type, IPv4 header and L4 ports, read straight from the packet (no helper
/// calls); headers outside the linear area are pulled in first.
#[repr(C)]
#[derive(Clone, Copy)]
struct Headers {
    _macs: [u8; 12],
    eth_type: u16,
    ip: Ipv4Hdr,
    ports: [u16; 2],
}

#[inline(always)]
fn headers(ctx: &TcContext) -> Option<Headers> {
    const LEN: usize = size_of::<Headers>();
    if ctx.data() + LEN > ctx.data_end() {
        // Short or non-linear: pull what we need into the linear area (fails if too short).
        ctx.pull_data(LEN as u32).ok()?;
        if ctx.data() + LEN > ctx.data_end() {
            return None;
        }
    }
    // SAFETY: bounds checked against data_end above; Headers is packed plain bytes.
    Some(unsafe { core::ptr::read_unaligned(ctx.data() as *const Headers) })
}

#[inline(always)]
fn translate(ctx: &TcContext, ingress: bool) -> Result<i32, ()> {
    let Some(h) = headers(ctx) else {
        // Shorter than Ethernet + IPv4 + ports: only a datagram's last fragment may be.
        return match ctx.load::<Ipv4Hdr>(IP_OFF) {
            Ok(ip)
                if ctx.load::<u16>(12) == Ok(EtherType::Ipv4 as u16)
                    && ip.vihl == 0x45
                    && u16::from_be_bytes(ip.frags) & 0x1fff != 0 =>
            {
                later_fragment(ctx, &ip)
            }
            _ => Ok(PASS),
        };
    };
    if h.eth_type != EtherType::Ipv4 as u16 {
        return Ok(PASS);
    }
    let ip = h.ip;
    if ip.proto == IPPROTO_ICMP && ip.vihl == 0x45 {
        return icmp_error(ctx, &ip);
    }
    if ip.proto != IPPROTO_TCP && ip.proto != IPPROTO_UDP && ip.proto != IPPROTO_SCTP {
        return Ok(PASS);
    }
    if ip.vihl != 0x45 {
        // IP options: the ports are not where we look.
        count(counter::TC_PASSED_UNSUPPORTED);
        return Ok(PASS);
    }
    let frags = u16::from_be_bytes(ip.frags);
    if frags & 0x1fff != 0 {
        return later_fragment(ctx, &ip);
    }
    if frags & 0x2000 != 0 && ip.proto == IPPROTO_SCTP {
        // SCTP splits its own chunks to the path MTU; the CRC of a datagram in IP fragments
        // covers bytes this packet does not have.
        count(counter::TC_PASSED_UNSUPPORTED);
        return Ok(PASS);
    }
    let ports = h.ports;
    let t = Tuple {
        saddr: u32::from_ne_bytes(ip.src_addr),
        daddr: u32::from_ne_bytes(ip.dst_addr),
        sport: ports[0],
        dport: ports[1],
        proto: ip.proto,
        first_fragment: (frags & 0x2000 != 0).then_some(u16::from_ne_bytes(ip.id)),
    };
    // No frontend, backend or node address on either side, and not the service range: nothing
    // of ours, known after two array reads (and a range lookup, when it is refused) instead
    // of the conntrack and frontend lookups.
    if !in_addr_filter(t.daddr)
        && !in_addr_filter(t.saddr)
        && service_range_miss(Addr::from_v4(t.daddr)) == ServiceRangeMiss::NotInRange
    {
        return Ok(PASS);
    }

    let key = ct_key(t.saddr, t.daddr, t.sport, t.dport, t.proto);
    let tcp_flags = match t.proto {
        IPPROTO_TCP => tcp_flags(ctx),
        IPPROTO_SCTP => sctp_as_tcp_flags(ctx),
        _ => 0,
    };
    // Established flows first; a flow not yet answered lives apart (`CT_NEW`), so that a flood
    // of new flows (SYNs, spoofed segments) evicts only its own kind.
    let found = match CONNTRACK.get_ptr_mut(&key) {
        Some(entry_ptr) => Some((entry_ptr, true)),
        None => CT_NEW.get_ptr_mut(&key).map(|entry_ptr| (entry_ptr, false)),
    };
    if let Some((entry_ptr, confirmed)) = found {
        // SAFETY: valid for this program run.
        let entry = unsafe { *entry_ptr };
        let now = now();
        let syn = tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
        if KPR_CT_TIMEOUTS.load().expired(t.proto, &entry, now) {
            count(counter::TC_CT_EXPIRED);
            forget(&key, &entry, t.proto);
        } else if ingress && syn && (ct::closed(entry.flags) || stale(ctx, &t, &entry)) {
            // A new connection reusing the 5-tuple of a closed flow, or of one whose endpoint
            // is gone: forget the old flow and balance it anew (conntrack does the same for a
            // SYN after TIME_WAIT).
            forget(&key, &entry, t.proto);
        } else {
            let seen = seen_bits(&entry, tcp_flags);
            if confirmed {
                touch(&CONNTRACK, &key, entry_ptr, &entry, seen, now);
            } else if seen & ct::SEEN_REPLY != 0 && tcp_flags & TCP_RST == 0 {
                confirm(&key, &entry, seen, now);
            } else {
                touch(&CT_NEW, &key, entry_ptr, &entry, seen, now);
            }
            rewrite(ctx, &t, &entry)?;
            count(counter::TC_CT_HIT);
            return Ok(TC_ACT_OK);
        }
    }
    // A flow kube-proxy translated before kpr took the node over: netfilter's conntrack goes
    // on translating it. A new connection on its tuple is kpr's.
    if unsafe { HANDOVER.get(&key) }.is_some() {
        if !(ingress && tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN) {
            return Ok(PASS);
        }
        let _ = HANDOVER.remove(&key);
    }
    if !ingress {
        return Ok(egress_drop(ctx, &t));
    }
    let scope = source_scope(ctx, &t);
    let service = match lookup_frontend(&t, scope) {
        Some(service) => service,
        // A refused service range: a ClusterIP's unknown port is rejected, an unallocated address of
        // the service range dropped.
        None => match service_range_miss(Addr::from_v4(t.daddr)) {
            ServiceRangeMiss::NotInRange => return Ok(PASS),
            ServiceRangeMiss::Reject => refusal(0),
            ServiceRangeMiss::Drop => {
                count(counter::TC_DROPPED);
                return Ok(TC_ACT_SHOT);
            }
        },
    };
    new_flow(ctx, &t, &service, tcp_flags, now())
}

/// The TCP flags byte: read straight from the packet when the header is in the linear area
/// (nearly always), else through the load helper.
#[inline(always)]
fn tcp_flags(ctx: &TcContext) -> u8 {
    let at = ctx.data() + TCP_FLAGS_OFF;
    if at < ctx.data_end() {
        // SAFETY: bounds checked against data_end.
        return unsafe { *(at as *const u8) };
    }
    ctx.load::<u8>(TCP_FLAGS_OFF).unwrap_or(0)
}

/// An SCTP packet's first chunk as the TCP flags with the same meaning for the flow's state:
/// INIT is a SYN, INIT ACK a SYN-ACK, SHUTDOWN and SHUTDOWN ACK are FINs, ABORT a RST.
#[inline(always)]
fn sctp_as_tcp_flags(ctx: &TcContext) -> u8 {
    match ctx.load::<u8>(SCTP_CHUNK_TYPE_OFF).unwrap_or(0) {
        1 => TCP_SYN,
        2 => TCP_SYN | TCP_ACK,
        6 => TCP_RST | TCP_ACK,
        7 | 8 => TCP_FIN | TCP_ACK,
        _ => TCP_ACK,
    }
}

/// What this packet tells of its flow: an answer from the backend, a FIN, a RST.
#[inline(always)]
fn seen_bits(entry: &CtValue, tcp_flags: u8) -> u32 {
    let reply = entry.flags & ct::REPLY != 0;
    let mut bits = if reply { ct::SEEN_REPLY } else { 0 };
    if tcp_flags & TCP_FIN != 0 {
        bits |= if reply { ct::FIN_REPLY } else { ct::FIN_ORIG };
    }
    if tcp_flags & TCP_RST != 0 {
        bits |= ct::RST;
    }
    bits
}

/// Record a packet of a live flow: new state bits at once, the time at most every
/// `REFRESH_NS`; both entries of the flow, putting back the other one if it was evicted.
#[inline(always)]
fn touch(map: &FlowMap, key: &CtKey, entry_ptr: *mut CtValue, entry: &CtValue, seen: u32, now: u64) {
    let flags = entry.flags | seen;
    if flags == entry.flags && now.saturating_sub(entry.last_seen) < ct::REFRESH_NS {
        return;
    }
    // SAFETY: a map value pointer, valid for this program run; racing writers only ever
    // move the time forward or add bits.
    unsafe {
        (*entry_ptr).flags = flags;
        (*entry_ptr).last_seen = now;
    }
    let pair_key = entry.pair_key(key.proto);
    match map.get_ptr_mut(&pair_key) {
        Some(pair) => unsafe {
            (*pair).flags |= flags & ct::FLOW_BITS;
            (*pair).last_seen = now;
        },
        None => {
            if map.insert(&pair_key, &mirror(key, entry, flags, now), u64::from(BPF_NOEXIST)).is_ok() {
                count(counter::TC_CT_HEALED);
            }
        }
    }
}

/// The other entry of the flow whose entry `key` → `entry` is: its value is this key, mirrored.
#[inline(always)]
fn mirror(key: &CtKey, entry: &CtValue, flags: u32, now: u64) -> CtValue {
    CtValue {
        src_addr: key.dst_addr,
        dst_addr: key.src_addr,
        src_port: key.dst_port,
        dst_port: key.src_port,
        service_id: entry.service_id,
        last_seen: now,
        flags: (flags & ct::FLOW_BITS) | (!entry.flags & ct::REPLY),
        _pad: 0,
    }
}

/// The backend answered a new flow: both its entries move to the established table.
#[inline(always)]
fn confirm(key: &CtKey, entry: &CtValue, seen: u32, now: u64) {
    let flags = entry.flags | seen;
    let pair_key = entry.pair_key(key.proto);
    let this = CtValue { flags, last_seen: now, ..*entry };
    let _ = CONNTRACK.insert(key, &this, 0);
    let _ = CONNTRACK.insert(&pair_key, &mirror(key, entry, flags, now), 0);
    let _ = CT_NEW.remove(&pair_key);
    let _ = CT_NEW.remove(key);
}

/// Remove both entries of a flow.
#[inline(always)]
fn forget(key: &CtKey, entry: &CtValue, proto: u8) {
    let pair_key = entry.pair_key(proto);
    for map in [&CONNTRACK, &CT_NEW] {
        let _ = map.remove(&pair_key);
        let _ = map.remove(key);
    }
}

/// A flow entry under `key`, established or new.
#[inline(always)]
fn flow_entry(key: &CtKey) -> Option<CtValue> {
    // SAFETY: map value pointers are valid for this program run.
    CONNTRACK.get_ptr(key).or_else(|| CT_NEW.get_ptr(key)).map(|v| unsafe { *v })
}

/// A TCP connection of the node itself that kube-proxy would DROP (traffic policy Local
/// without a local endpoint, a source outside loadBalancerSourceRanges): the socket path lets
/// it through untranslated and it is dropped here, on its way out, so that `connect()` times
/// out as it does behind kube-proxy's filter rules.
#[inline(always)]
fn egress_drop(ctx: &TcContext, t: &Tuple) -> i32 {
    if t.proto != IPPROTO_TCP || source_scope(ctx, t) != SCOPE_NODE {
        return PASS;
    }
    let drop = match lookup_frontend(t, SCOPE_NODE) {
        Some(s) => s.backends_count == 0 && s.flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0,
        None => service_range_miss(Addr::from_v4(t.daddr)) == ServiceRangeMiss::Drop,
    };
    if drop {
        count(counter::TC_DROPPED);
        return TC_ACT_SHOT;
    }
    PASS
}

/// Where a packet comes from, as kube-proxy tells sources apart: the node itself (a local
/// source address), a pod the local-traffic detector calls local, or anywhere else.
#[inline(always)]
fn source_scope(ctx: &TcContext, t: &Tuple) -> u8 {
    if node_addr_flags(&Addr::from_v4(t.saddr)) & NODE_ADDR_LOCAL != 0 {
        return SCOPE_NODE;
    }
    let local = match KPR_DETECT_LOCAL.load() {
        DETECT_LOCAL_CIDR => LOCAL_CIDRS.get(&Key::new(128, CidrKey { addr: Addr::from_v4(t.saddr) })).is_some(),
        DETECT_LOCAL_INTERFACE => {
            let ifindex = ifindex(ctx);
            LINKS.get_ptr(&ifindex).is_some_and(|link| unsafe { (*link).flags } & LINK_FLAG_LOCAL_TRAFFIC != 0)
        }
        _ => false,
    };
    if local { SCOPE_POD } else { SCOPE_EXTERNAL }
}

/// The frontend entry a packet from `scope` is addressed to: a ClusterIP, externalIP or
/// LoadBalancer IP, or a NodePort on one of the node's NodePort addresses.
#[inline(always)]
fn lookup_frontend(t: &Tuple, scope: u8) -> Option<ServiceValue> {
    let key = ServiceKey { addr: Addr::from_v4(t.daddr), port: t.dport, proto: t.proto, scope };
    if let Some(v) = SERVICES.get_ptr(&key) {
        return Some(unsafe { *v });
    }
    if node_addr_flags(&key.addr) & NODE_ADDR_NODEPORT != 0 {
        return SERVICES.get_ptr(&ServiceKey { addr: Addr::from_v4(0), ..key }).map(|v| unsafe { *v });
    }
    None
}

/// The link the program runs on.
#[inline(always)]
fn ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: a tc program's context is the packet's __sk_buff.
    unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ifindex }
}

/// The address MASQUERADE would give a packet to `backend`: the first address of the link the
/// route to it leaves by, else the node's primary address; 0 when there is none.
#[inline(always)]
fn masquerade_source(ctx: &TcContext, backend: u32) -> u32 {
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET;
    params.ifindex = ifindex(ctx);
    params.__bindgen_anon_4.ipv4_dst = backend;
    let rc = unsafe { fib_lookup(ctx.as_ptr(), &mut params, size_of::<bpf_fib_lookup>() as i32, 0) };
    if rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) || rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        let addr = link_addr(params.ifindex);
        if addr != 0 {
            return addr;
        }
    }
    link_addr(0)
}

/// Send a packet translated on its way in straight out of the link its route leaves by
/// (`bpf_fib_lookup`, then `bpf_redirect_neigh`, which fills in the MAC addresses), as Cilium
/// does: the host's forwarding path (netfilter's FORWARD policy, INVALID-state drops) never
/// sees it. What the route does not settle that way (a local destination, no route, forwarding
/// off, too big for the link, a TTL running out) goes on into the host stack, which handles
/// it as it would have without kpr.
#[inline(always)]
fn forward_direct(ctx: &TcContext) -> i32 {
    let data = ctx.data();
    if data + IP_OFF + size_of::<Ipv4Hdr>() > ctx.data_end() {
        return TC_ACT_OK;
    }
    // SAFETY: within [data, data_end), checked above.
    let ip = unsafe { ((data + IP_OFF) as *const Ipv4Hdr).read_unaligned() };
    if ip.ttl <= 1 {
        return TC_ACT_OK; // the stack answers with "time exceeded"
    }
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET;
    params.l4_protocol = ip.proto;
    params.ifindex = ifindex(ctx);
    params.__bindgen_anon_2.tos = ip.tos;
    params.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(ip.src_addr);
    params.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(ip.dst_addr);
    // tot_len 0: the kernel checks the packet against the MTU of the link found (GSO aware).
    let rc = unsafe { fib_lookup(ctx.as_ptr(), &mut params, size_of::<bpf_fib_lookup>() as i32, 0) };
    if rc != i64::from(BPF_FIB_LKUP_RET_SUCCESS) && rc != i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        return TC_ACT_OK;
    }
    // Forwarding takes one off the TTL (the checksum covers it with the protocol byte); the
    // lookup did not move the packet, but the bounds are checked again for the verifier.
    let data = ctx.data();
    if data + IP_OFF + size_of::<Ipv4Hdr>() > ctx.data_end() {
        return TC_ACT_OK;
    }
    let (old, new) = (u16::from_ne_bytes([ip.ttl, ip.proto]), u16::from_ne_bytes([ip.ttl - 1, ip.proto]));
    // SAFETY: within [data, data_end), checked above.
    unsafe {
        let check = (data + IP_CSUM_OFF) as *mut u16;
        check.write_unaligned(csum::replace(check.read_unaligned(), csum::half_diff(old, new)));
        ((data + IP_TTL_OFF) as *mut u8).write(ip.ttl - 1);
    }
    count(counter::TC_FORWARDED_DIRECT);
    // No neighbour parameters: the kernel resolves the next hop (5.10's two-argument form reads
    // the null pointer as flags 0).
    unsafe { bpf_redirect_neigh(params.ifindex, core::ptr::null_mut(), 0, 0) as i32 }
}

#[inline(always)]
fn new_flow(ctx: &TcContext, t: &Tuple, service: &ServiceValue, tcp_flags: u8, now: u64) -> Result<i32, ()> {
    if service.flags & SERVICE_FLAG_SOURCE_RANGES != 0 {
        let client = Addr::from_v4(t.saddr);
        let key = Key::new(32 + 128, SourceRange { service_id: service.service_id.to_be(), addr: client });
        if SOURCE_RANGES.get(&key).is_none() {
            count(counter::TC_DROPPED);
            return Ok(TC_ACT_SHOT);
        }
    }
    if service.backends_count == 0 {
        if service.flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0 {
            count(counter::TC_DROPPED);
            return Ok(TC_ACT_SHOT);
        }
        // kube-proxy's REJECT: a TCP reset, else ICMP port unreachable (UDP and SCTP).
        return if t.proto == IPPROTO_TCP { reject_tcp(ctx, t) } else { reject_port_unreachable(ctx, t) };
    }
    // The backend is a hash of the tuple: as random as the client's port for new flows, and
    // the same again for a connection whose entries were lost. checked_rem: no
    // division-by-zero panic path for the verifier to reject.
    let hash = flow_hash(t);
    let client = Addr::from_v4(t.saddr);
    let Some(backend) = affinity_backend(service, AFFINITY_BY_ADDR, client, now).or_else(|| backend_at(service, hash))
    else {
        return Ok(PASS);
    };
    remember_affinity(service, AFFINITY_BY_ADDR, client, &backend, now);
    let backend_addr = backend.addr.v4();

    // Replies must come back through this node: masquerade what the entry says and a client
    // that is its own backend (hairpin), as kube-proxy does.
    let masquerade = service.flags & SERVICE_FLAG_SNAT != 0 || backend_addr == t.saddr;
    let snat_addr = if masquerade { masquerade_source(ctx, backend_addr) } else { 0 };
    let reply_value = CtValue {
        src_addr: t.daddr,
        dst_addr: t.saddr,
        src_port: t.dport,
        dst_port: t.sport,
        service_id: service.service_id,
        last_seen: now,
        flags: ct::REPLY,
        _pad: 0,
    };
    let (src_addr, src_port) = if snat_addr != 0 {
        let Some(port) = snat_port(t, &backend, snat_addr, &reply_value, hash, now) else {
            count(counter::TC_SNAT_EXHAUSTED);
            return Ok(TC_ACT_SHOT);
        };
        (snat_addr, port)
    } else {
        let reply_key = ct_key(backend_addr, t.saddr, backend.port, t.sport, t.proto);
        if CT_NEW.insert(&reply_key, &reply_value, 0).is_err() {
            count(counter::TC_CT_FULL);
            return Ok(TC_ACT_SHOT);
        }
        (t.saddr, t.sport)
    };
    let forward = CtValue {
        src_addr,
        dst_addr: backend_addr,
        src_port,
        dst_port: backend.port,
        service_id: service.service_id,
        last_seen: now,
        flags: 0,
        _pad: 0,
    };
    let key = ct_key(t.saddr, t.daddr, t.sport, t.dport, t.proto);
    let reply_key = forward.pair_key(t.proto);
    let forward = if CT_NEW.insert(&key, &forward, u64::from(BPF_NOEXIST)).is_ok() {
        forward
    } else if let Some(winner) = CT_NEW.get_ptr(&key) {
        // Another CPU created the flow first (a SYN and its retransmission at once): take its
        // translation, and give back what this one held.
        let winner = unsafe { *winner };
        count(counter::TC_CT_RACE_ADOPTED);
        if winner.pair_key(t.proto) != reply_key {
            let _ = CT_NEW.remove(&reply_key);
        }
        winner
    } else {
        let _ = CT_NEW.remove(&reply_key);
        count(counter::TC_CT_FULL);
        return Ok(TC_ACT_SHOT);
    };
    rewrite(ctx, t, &forward)?;
    // A TCP flow is new with its SYN (SCTP with its INIT); any other packet re-creates a flow
    // that was lost.
    let recreated = has_states(t.proto) && tcp_flags & (TCP_SYN | TCP_ACK) != TCP_SYN;
    count(if recreated { counter::TC_CT_RECREATED } else { counter::TC_NEW_FLOW });
    Ok(TC_ACT_OK)
}

/// A SNAT port for a flow to `backend` whose reply entry is `reply`: the reply entry is stored
/// under the first free port of a sequence that the flow's hash fixes, so a re-created flow
/// gets its old port back. Free: unused, expired, or a closed TCP flow's (as Linux's NAT
/// reuses the tuples of closed connections). The flow's own leftover reply entry is reused.
#[inline(always)]
fn snat_port(t: &Tuple, backend: &Backend, snat_addr: u32, reply: &CtValue, hash: u32, now: u64) -> Option<u16> {
    let (min, max) = (KPR_SNAT_PORT_MIN.load(), KPR_SNAT_PORT_MAX.load());
    let span = u32::from(max.saturating_sub(min)) + 1;
    let start = mix(hash ^ 0x5bd1_e995);
    for i in 0..SNAT_TRIES {
        let offset = start.wrapping_add(i.wrapping_mul(0x9e37_79b9)).checked_rem(span)?;
        let port = min.wrapping_add(offset as u16).to_be();
        let reply_key = ct_key(backend.addr.v4(), snat_addr, backend.port, port, t.proto);
        let Some(old) = flow_entry(&reply_key) else {
            if CT_NEW.insert(&reply_key, reply, u64::from(BPF_NOEXIST)).is_ok() {
                return Some(port);
            }
            continue;
        };
        if old.src_addr == reply.src_addr
            && old.dst_addr == reply.dst_addr
            && old.src_port == reply.src_port
            && old.dst_port == reply.dst_port
        {
            return Some(port);
        }
        let idle = now.saturating_sub(old.last_seen);
        let closed = ct::closed(old.flags) && idle > ct::CLOSED_PORT_REUSE_NS;
        if closed || KPR_CT_TIMEOUTS.load().expired(t.proto, &old, now) {
            count(counter::TC_CT_EXPIRED);
            forget(&reply_key, &old, t.proto);
            if CT_NEW.insert(&reply_key, reply, u64::from(BPF_NOEXIST)).is_ok() {
                return Some(port);
            }
        }
    }
    None
}

/// A hash of the tuple, seeded per boot (`KPR_FLOW_HASH_SEED`).
#[inline(always)]
fn flow_hash(t: &Tuple) -> u32 {
    let mut h = KPR_FLOW_HASH_SEED.load();
    h = mix(h ^ t.saddr);
    h = mix(h ^ t.daddr);
    h = mix(h ^ (u32::from(t.sport) << 16 | u32::from(t.dport)));
    mix(h ^ u32::from(t.proto))
}

/// murmur3's finalizer: every input bit affects every output bit.
#[inline(always)]
fn mix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// The flow's endpoint is no longer one of its frontend's endpoints (or the frontend is gone).
#[inline(always)]
fn stale(ctx: &TcContext, t: &Tuple, entry: &CtValue) -> bool {
    lookup_frontend(t, source_scope(ctx, t))
        .is_none_or(|service| !serves(&service, &Addr::from_v4(entry.dst_addr), entry.dst_port))
}

#[inline(always)]
fn ct_key(src_addr: u32, dst_addr: u32, src_port: u16, dst_port: u16, proto: u8) -> CtKey {
    CtKey { src_addr, dst_addr, src_port, dst_port, proto, _pad: [0; 3] }
}

/// A later fragment (no ports) of a datagram whose first fragment was translated: the same
/// addresses (its IP checksum only: the L4 checksum is in the first fragment). A fragment
/// of anything else passes untouched.
#[inline(always)]
fn later_fragment(ctx: &TcContext, ip: &Ipv4Hdr) -> Result<i32, ()> {
    let (saddr, daddr) = (u32::from_ne_bytes(ip.src_addr), u32::from_ne_bytes(ip.dst_addr));
    let key = FragmentKey { src_addr: saddr, dst_addr: daddr, id: u16::from_ne_bytes(ip.id), proto: ip.proto, _pad: 0 };
    let Some(to) = FRAGMENTS.get_ptr(&key) else {
        count(counter::TC_PASSED_UNSUPPORTED);
        return Ok(PASS);
    };
    // SAFETY: valid for this program run.
    let to = unsafe { *to };
    for (off, old, new) in [(IP_SRC_OFF, saddr, to.src_addr), (IP_DST_OFF, daddr, to.dst_addr)] {
        if old != new {
            ctx.l3_csum_replace(IP_CSUM_OFF, u64::from(old), u64::from(new), 4).map_err(drop)?;
            ctx.store(off, &new, 0).map_err(drop)?;
        }
    }
    count(counter::TC_FRAGMENT_TRANSLATED);
    Ok(TC_ACT_OK)
}

/// Rewrite addresses and ports to `to`, fixing the IP and L4 checksums incrementally; the
/// first fragment of a datagram leaves its rewrite for the later ones.
///
/// The common case costs at most two helper calls: the L4 checksum goes through the kernel
/// (only it knows whether the checksum is partial, left to the device, which changes the
/// arithmetic), once for both addresses of the pseudo header and once for both ports. The
/// header fields and the IP checksum, which covers only its own header, are written in place.
#[inline(always)]
fn rewrite(ctx: &TcContext, t: &Tuple, to: &CtValue) -> Result<(), ()> {
    if let Some(id) = t.first_fragment {
        let key = FragmentKey { src_addr: t.saddr, dst_addr: t.daddr, id, proto: t.proto, _pad: 0 };
        let _ = FRAGMENTS.insert(&key, to, 0);
    }
    let addrs_changed = (to.src_addr, to.dst_addr) != (t.saddr, t.daddr);
    let (old_ports, new_ports) = (ports_word(t.sport, t.dport), ports_word(to.src_port, to.dst_port));
    // One's complement difference of the addresses: for the IP checksum and the pseudo header.
    let addr_diff = csum::word_diff(t.saddr, to.src_addr) + csum::word_diff(t.daddr, to.dst_addr);
    // TCP's and UDP's checksums cover the addresses (pseudo header); SCTP's CRC32c does not.
    let inet_csum = match t.proto {
        IPPROTO_TCP => Some((TCP_CSUM_OFF, 0)),
        // A UDP checksum of 0 means "none" and must stay 0.
        IPPROTO_UDP => Some((UDP_CSUM_OFF, u64::from(BPF_F_MARK_MANGLED_0))),
        _ => None,
    };
    match inet_csum {
        Some((csum_off, flags)) => {
            if addrs_changed {
                // Size 0: `to` is a precomputed difference.
                let diff = u64::from(csum::fold32(addr_diff));
                ctx.l4_csum_replace(csum_off, 0, diff, flags | u64::from(BPF_F_PSEUDO_HDR)).map_err(drop)?;
            }
            if old_ports != new_ports {
                ctx.l4_csum_replace(csum_off, u64::from(old_ports), u64::from(new_ports), flags | 4).map_err(drop)?;
            }
        }
        None if old_ports != new_ports => sctp_ports_crc(ctx, old_ports, new_ports)?,
        None => {}
    }
    // The helpers may have moved the packet: bounds are checked again.
    let data = ctx.data();
    if data + L4_OFF + 4 > ctx.data_end() {
        return Err(());
    }
    // SAFETY: within [data, data_end), checked above; unaligned writes of plain bytes.
    unsafe {
        if addrs_changed {
            let check = (data + IP_CSUM_OFF) as *mut u16;
            check.write_unaligned(csum::replace(check.read_unaligned(), addr_diff));
            ((data + IP_SRC_OFF) as *mut u32).write_unaligned(to.src_addr);
            ((data + IP_DST_OFF) as *mut u32).write_unaligned(to.dst_addr);
        }
        if old_ports != new_ports {
            ((data + L4_OFF) as *mut u32).write_unaligned(new_ports);
        }
    }
    Ok(())
}

/// Two ports as the four bytes they are in the packet, read as one native word.
#[inline(always)]
fn ports_word(first: u16, second: u16) -> u32 {
    let (a, b) = (first.to_ne_bytes(), second.to_ne_bytes());
    u32::from_ne_bytes([a[0], a[1], b[0], b[1]])
}

/// Fix an SCTP packet's CRC32c for its ports going from `old` to `new` (`crc32c`: no second
/// read of the packet). A checksum of 0 is left alone: the sender's kernel left it to the
/// device (`CHECKSUM_PARTIAL`), which computes it over the rewritten packet.
#[inline(always)]
fn sctp_ports_crc(ctx: &TcContext, old: u32, new: u32) -> Result<(), ()> {
    let sum = u32::from_le_bytes(ctx.load::<[u8; 4]>(SCTP_CSUM_OFF).map_err(drop)?);
    if sum == 0 {
        return Ok(());
    }
    let ip_len = u16::from_be_bytes(ctx.load::<[u8; 2]>(IP_OFF + 2).map_err(drop)?);
    let sctp_len = ip_len.saturating_sub(20);
    let sum = sum ^ kpr_sctp_crc_delta(old, new, u32::from(sctp_len));
    ctx.store(SCTP_CSUM_OFF, &sum.to_le_bytes(), 0).map_err(drop)
}

/// [`crc32c::port_rewrite_delta`] as a global function: the verifier checks it once, not once
/// per path of the program that reaches it.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpr_sctp_crc_delta(old: u32, new: u32, len: u32) -> u32 {
    crc32c::port_rewrite_delta(old, new, len as u16)
}

/// An ICMP error (unreachable, time exceeded, parameter problem) about a translated flow, e.g.
/// "fragmentation needed" from a backend: it quotes the packet as the backend saw it. Translate
/// the quoted header and the outer addresses back, so that the client's kernel matches it to
/// its socket (path MTU discovery, connection errors).
#[inline(always)]
fn icmp_error(ctx: &TcContext, outer: &Ipv4Hdr) -> Result<i32, ()> {
    let icmp_type: u8 = ctx.load(ICMP_OFF).map_err(drop)?;
    if icmp_type != 3 && icmp_type != 11 && icmp_type != 12 {
        return Ok(PASS);
    }
    let inner: Ipv4Hdr = ctx.load(INNER_IP_OFF).map_err(drop)?;
    // The quoted ports are where TCP, UDP and SCTP all have them (SCTP's quoted CRC stays: the
    // quote is cut short, and its receiver checks the verification tag instead).
    if inner.vihl != 0x45 || (inner.proto != IPPROTO_TCP && inner.proto != IPPROTO_UDP && inner.proto != IPPROTO_SCTP) {
        return Ok(PASS);
    }
    let ports: [u16; 2] = ctx.load(INNER_L4_OFF).map_err(drop)?;
    let (isrc, idst) = (u32::from_ne_bytes(inner.src_addr), u32::from_ne_bytes(inner.dst_addr));
    // The quoted packet went from (translated) client to backend: the backend's reply entry
    // holds the original addresses.
    let Some(entry) = flow_entry(&ct_key(idst, isrc, ports[1], ports[0], inner.proto)) else {
        return Ok(PASS);
    };
    let (client, client_port, frontend, frontend_port) =
        (entry.dst_addr, entry.dst_port, entry.src_addr, entry.src_port);

    // Quoted header: addresses (inner IP checksum and ICMP checksum), then ports (ICMP checksum).
    let old_inner_csum: u16 = ctx.load(INNER_CSUM_OFF).map_err(drop)?;
    for (off, old, new) in [(INNER_SRC_OFF, isrc, client), (INNER_DST_OFF, idst, frontend)] {
        if old != new {
            ctx.l3_csum_replace(INNER_CSUM_OFF, u64::from(old), u64::from(new), 4).map_err(drop)?;
            ctx.l4_csum_replace(ICMP_CSUM_OFF, u64::from(old), u64::from(new), 4).map_err(drop)?;
            ctx.store(off, &new, 0).map_err(drop)?;
        }
    }
    let new_inner_csum: u16 = ctx.load(INNER_CSUM_OFF).map_err(drop)?;
    ctx.l4_csum_replace(ICMP_CSUM_OFF, u64::from(old_inner_csum), u64::from(new_inner_csum), 2).map_err(drop)?;
    for (off, old, new) in [(INNER_L4_OFF, ports[0], client_port), (INNER_L4_OFF + 2, ports[1], frontend_port)] {
        if old != new {
            ctx.l4_csum_replace(ICMP_CSUM_OFF, u64::from(old), u64::from(new), 2).map_err(drop)?;
            ctx.store(off, &new, 0).map_err(drop)?;
        }
    }

    // Outer header: to the client; from the frontend when the backend itself complained.
    let (osrc, odst) = (u32::from_ne_bytes(outer.src_addr), u32::from_ne_bytes(outer.dst_addr));
    let new_src = if osrc == idst { frontend } else { osrc };
    for (off, old, new) in [(IP_SRC_OFF, osrc, new_src), (IP_DST_OFF, odst, client)] {
        if old != new {
            ctx.l3_csum_replace(IP_CSUM_OFF, u64::from(old), u64::from(new), 4).map_err(drop)?;
            ctx.store(off, &new, 0).map_err(drop)?;
        }
    }
    count(counter::TC_CT_HIT);
    Ok(TC_ACT_OK)
}
