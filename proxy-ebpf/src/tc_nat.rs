//! Per-packet service translation on node interfaces (tc/TCX).
//!
//! Ingress: a packet of a known flow is rewritten from its conntrack entry; a new packet to a
//! frontend (ClusterIP, externalIP, LoadBalancer IP, NodeIP:nodePort) gets a random backend,
//! masquerade (SNAT to the node) when the frontend says so or the client is its own backend
//! (hairpin), and two conntrack entries: one for its direction, one for the replies.
//! Egress: only the conntrack rewrite (replies of local backends leaving toward the client).
//!
//! Packets the program does not understand (not IPv4, IP options, fragments, other protocols)
//! pass untouched and are counted; the program never fails a packet it did not translate.
use aya_ebpf::{
    EbpfContext as _, Global,
    bindings::{
        BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_NOEXIST,
        TC_ACT_OK, TC_ACT_SHOT, __sk_buff, bpf_fib_lookup,
    },
    btf_maps::lpm_trie::Key,
    helpers::{bpf_fib_lookup as fib_lookup, bpf_get_prandom_u32},
    macros::classifier,
    programs::TcContext,
};
use network_types::{eth::EtherType, ip::Ipv4Hdr};
use proxy_common::{
    Backend, CtKey, CtValue, DETECT_LOCAL_CIDR, DETECT_LOCAL_INTERFACE, IPPROTO_TCP, IPPROTO_UDP,
    LINK_FLAG_LOCAL_TRAFFIC, CidrKey, NODE_ADDR_LOCAL, NODE_ADDR_NODEPORT, SCOPE_EXTERNAL, SCOPE_NODE, SCOPE_POD,
    SERVICE_FLAG_DROP_NO_ENDPOINTS, SERVICE_FLAG_SNAT, SERVICE_FLAG_SOURCE_RANGES, SNAT_PORT_MAX, SNAT_PORT_MIN,
    ServiceKey, ServiceValue, SourceRange, counter,
};

use crate::{
    maps::{BACKENDS, CONNTRACK, LINKS, LOCAL_CIDRS, NODE_ADDRS, SERVICES, SOURCE_RANGES, ServiceRangeMiss, count, refusal, service_range_miss},
    packet::*,
    tc_reject::{reject_tcp, reject_udp},
};

/// Tries at finding a free SNAT port before giving up on a new flow.
const SNAT_TRIES: u32 = 8;
const AF_INET: u8 = 2;

/// The SNAT port range, disjoint from the node's ephemeral ports; set by the agent at load.
#[unsafe(no_mangle)]
static KPR_SNAT_PORT_MIN: Global<u16> = Global::new(SNAT_PORT_MIN);
#[unsafe(no_mangle)]
static KPR_SNAT_PORT_MAX: Global<u16> = Global::new(SNAT_PORT_MAX);

/// How pods are told from other sources (`DETECT_LOCAL_*`); set by the agent at load time.
#[unsafe(no_mangle)]
static KPR_DETECT_LOCAL: Global<u8> = Global::new(0);

#[classifier]
pub fn kpr_tc_ingress(ctx: TcContext) -> i32 {
    translate(&ctx, true).unwrap_or(TC_ACT_OK)
}

#[classifier]
pub fn kpr_tc_egress(ctx: TcContext) -> i32 {
    translate(&ctx, false).unwrap_or(TC_ACT_OK)
}

/// A packet's addresses and ports, as they sit in the packet (network byte order).
#[derive(Clone, Copy)]
pub struct Tuple {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
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
        return Ok(TC_ACT_OK);
    };
    if h.eth_type != EtherType::Ipv4 as u16 {
        return Ok(TC_ACT_OK);
    }
    let ip = h.ip;
    if ip.proto == IPPROTO_ICMP && ip.vihl == 0x45 {
        return icmp_error(ctx, &ip);
    }
    if ip.proto != IPPROTO_TCP && ip.proto != IPPROTO_UDP {
        return Ok(TC_ACT_OK);
    }
    if ip.vihl != 0x45 || u16::from_be_bytes(ip.frags) & 0x3fff != 0 {
        // IP options or a fragment: ports are not where we look (or not there at all).
        count(counter::TC_PASSED_UNSUPPORTED);
        return Ok(TC_ACT_OK);
    }
    let ports = h.ports;
    let t = Tuple {
        saddr: u32::from_ne_bytes(ip.src_addr),
        daddr: u32::from_ne_bytes(ip.dst_addr),
        sport: ports[0],
        dport: ports[1],
        proto: ip.proto,
    };

    let key = ct_key(t.saddr, t.daddr, t.sport, t.dport, t.proto);
    if let Some(entry) = CONNTRACK.get_ptr(&key) {
        // SAFETY: valid for this program run.
        let entry = unsafe { *entry };
        if !(ingress && is_syn(ctx, &t) && stale(ctx, &t, &entry)) {
            rewrite(ctx, &t, &entry)?;
            count(counter::TC_CT_HIT);
            return Ok(TC_ACT_OK);
        }
        // A new connection reusing the 5-tuple of a flow whose endpoint is gone: forget the
        // old flow and balance it anew (what conntrack does for a SYN after TIME_WAIT).
        let _ = CONNTRACK.remove(&ct_key(entry.dst_addr, entry.src_addr, entry.dst_port, entry.src_port, t.proto));
        let _ = CONNTRACK.remove(&key);
    }
    if !ingress {
        return Ok(egress_drop(ctx, &t));
    }
    let scope = source_scope(ctx, &t);
    let service = match lookup_frontend(&t, scope) {
        Some(service) => service,
        // nftables mode: a ClusterIP's unknown port is rejected, an unallocated address of
        // the service range dropped.
        None => match service_range_miss(t.daddr, scope) {
            ServiceRangeMiss::NotInRange => return Ok(TC_ACT_OK),
            ServiceRangeMiss::Reject => refusal(0),
            ServiceRangeMiss::Drop => {
                count(counter::TC_DROPPED);
                return Ok(TC_ACT_SHOT);
            }
        },
    };
    new_flow(ctx, &t, &service)
}

/// A TCP connection of the node itself that kube-proxy would DROP (traffic policy Local
/// without a local endpoint, a source outside loadBalancerSourceRanges): the socket path lets
/// it through untranslated and it is dropped here, on its way out, so that `connect()` times
/// out as it does behind kube-proxy's filter rules.
#[inline(always)]
fn egress_drop(ctx: &TcContext, t: &Tuple) -> i32 {
    if t.proto != IPPROTO_TCP || source_scope(ctx, t) != SCOPE_NODE {
        return TC_ACT_OK;
    }
    let drop = match lookup_frontend(t, SCOPE_NODE) {
        Some(s) => s.backends_count == 0 && s.flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0,
        None => service_range_miss(t.daddr, SCOPE_NODE) == ServiceRangeMiss::Drop,
    };
    if drop {
        count(counter::TC_DROPPED);
        return TC_ACT_SHOT;
    }
    TC_ACT_OK
}

/// Where a packet comes from, as kube-proxy tells sources apart: the node itself (a local
/// source address), a pod the local-traffic detector calls local, or anywhere else.
#[inline(always)]
fn source_scope(ctx: &TcContext, t: &Tuple) -> u8 {
    if NODE_ADDRS.get_ptr(&t.saddr).is_some_and(|flags| unsafe { *flags } & NODE_ADDR_LOCAL != 0) {
        return SCOPE_NODE;
    }
    let local = match KPR_DETECT_LOCAL.load() {
        DETECT_LOCAL_CIDR => LOCAL_CIDRS.get(&Key::new(32, CidrKey { addr: t.saddr })).is_some(),
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
    let key = ServiceKey { addr: t.daddr, port: t.dport, proto: t.proto, scope };
    if let Some(v) = SERVICES.get_ptr(&key) {
        return Some(unsafe { *v });
    }
    if NODE_ADDRS.get_ptr(&t.daddr).is_some_and(|flags| unsafe { *flags } & NODE_ADDR_NODEPORT != 0) {
        return SERVICES.get_ptr(&ServiceKey { addr: 0, ..key }).map(|v| unsafe { *v });
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
        let out = params.ifindex;
        if let Some(link) = LINKS.get_ptr(&out)
            && unsafe { (*link).addr } != 0
        {
            return unsafe { (*link).addr };
        }
    }
    LINKS.get_ptr(&0).map_or(0, |link| unsafe { (*link).addr })
}

#[inline(always)]
fn new_flow(ctx: &TcContext, t: &Tuple, service: &ServiceValue) -> Result<i32, ()> {
    if service.flags & SERVICE_FLAG_SOURCE_RANGES != 0 {
        let key = Key::new(64, SourceRange { service_id: service.service_id.to_be(), addr: t.saddr });
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
        return if t.proto == IPPROTO_TCP { reject_tcp(ctx, t) } else { reject_udp(ctx, t) };
    }
    // checked_rem: no division-by-zero panic path for the verifier to reject (the count was
    // checked above, but the compiler cannot always see it).
    let Some(pick) = unsafe { bpf_get_prandom_u32() }.checked_rem(service.backends_count) else {
        return Ok(TC_ACT_OK);
    };
    let Some(backend) = BACKENDS.get(service.backends_start.wrapping_add(pick)) else {
        count(counter::BAD_BACKEND_SLOT);
        return Ok(TC_ACT_OK);
    };
    let backend: Backend = *backend;

    // Replies must come back through this node: masquerade what the entry says and a client
    // that is its own backend (hairpin), as kube-proxy does.
    let masquerade = service.flags & SERVICE_FLAG_SNAT != 0 || backend.addr == t.saddr;
    let snat_addr = if masquerade { masquerade_source(ctx, backend.addr) } else { 0 };
    let masquerade = snat_addr != 0;
    let reply_value = CtValue {
        src_addr: t.daddr,
        dst_addr: t.saddr,
        src_port: t.dport,
        dst_port: t.sport,
        service_id: service.service_id,
    };
    let (src_addr, src_port) = if masquerade {
        let mut found = None;
        for _ in 0..SNAT_TRIES {
            let (min, max) = (KPR_SNAT_PORT_MIN.load(), KPR_SNAT_PORT_MAX.load());
            let span = u32::from(max.saturating_sub(min)) + 1;
            let port = min.wrapping_add((unsafe { bpf_get_prandom_u32() } % span) as u16).to_be();
            let reply_key = ct_key(backend.addr, snat_addr, backend.port, port, t.proto);
            if CONNTRACK.insert(&reply_key, &reply_value, u64::from(BPF_NOEXIST)).is_ok() {
                found = Some(port);
                break;
            }
        }
        let Some(port) = found else {
            count(counter::TC_SNAT_EXHAUSTED);
            return Ok(TC_ACT_SHOT);
        };
        (snat_addr, port)
    } else {
        let reply_key = ct_key(backend.addr, t.saddr, backend.port, t.sport, t.proto);
        if CONNTRACK.insert(&reply_key, &reply_value, 0).is_err() {
            count(counter::TC_CT_FULL);
            return Ok(TC_ACT_SHOT);
        }
        (t.saddr, t.sport)
    };
    let forward =
        CtValue { src_addr, dst_addr: backend.addr, src_port, dst_port: backend.port, service_id: service.service_id };
    if CONNTRACK.insert(&ct_key(t.saddr, t.daddr, t.sport, t.dport, t.proto), &forward, 0).is_err() {
        let _ = CONNTRACK.remove(&ct_key(backend.addr, src_addr, backend.port, src_port, t.proto));
        count(counter::TC_CT_FULL);
        return Ok(TC_ACT_SHOT);
    }
    rewrite(ctx, t, &forward)?;
    count(counter::TC_NEW_FLOW);
    Ok(TC_ACT_OK)
}

/// Endpoints a SYN's old flow is checked against, at most (larger services: trusted).
const STALE_SCAN: u32 = 64;

#[inline(always)]
fn is_syn(ctx: &TcContext, t: &Tuple) -> bool {
    t.proto == IPPROTO_TCP && ctx.load::<u8>(TCP_FLAGS_OFF).is_ok_and(|f| f & (TCP_SYN | TCP_ACK) == TCP_SYN)
}

/// The flow's endpoint is no longer one of its frontend's endpoints (or the frontend is gone).
#[inline(always)]
fn stale(ctx: &TcContext, t: &Tuple, entry: &CtValue) -> bool {
    let Some(service) = lookup_frontend(t, source_scope(ctx, t)) else { return true };
    if service.backends_count > STALE_SCAN {
        return false;
    }
    for i in 0..STALE_SCAN {
        if i >= service.backends_count {
            break;
        }
        if let Some(b) = BACKENDS.get(service.backends_start.wrapping_add(i))
            && b.addr == entry.dst_addr
            && b.port == entry.dst_port
        {
            return false;
        }
    }
    true
}

#[inline(always)]
fn ct_key(src_addr: u32, dst_addr: u32, src_port: u16, dst_port: u16, proto: u8) -> CtKey {
    CtKey { src_addr, dst_addr, src_port, dst_port, proto, _pad: [0; 3] }
}

/// Rewrite addresses and ports to `to`, fixing the IP and L4 checksums incrementally.
#[inline(always)]
fn rewrite(ctx: &TcContext, t: &Tuple, to: &CtValue) -> Result<(), ()> {
    let (csum_off, l4_flags) = if t.proto == IPPROTO_TCP {
        (TCP_CSUM_OFF, 0)
    } else {
        // A UDP checksum of 0 means "none" and must stay 0.
        (UDP_CSUM_OFF, u64::from(BPF_F_MARK_MANGLED_0))
    };
    let pseudo = u64::from(BPF_F_PSEUDO_HDR);
    if to.src_addr != t.saddr {
        ctx.l4_csum_replace(csum_off, u64::from(t.saddr), u64::from(to.src_addr), l4_flags | pseudo | 4)
            .map_err(drop)?;
        ctx.l3_csum_replace(IP_CSUM_OFF, u64::from(t.saddr), u64::from(to.src_addr), 4).map_err(drop)?;
        ctx.store(IP_SRC_OFF, &to.src_addr, 0).map_err(drop)?;
    }
    if to.dst_addr != t.daddr {
        ctx.l4_csum_replace(csum_off, u64::from(t.daddr), u64::from(to.dst_addr), l4_flags | pseudo | 4)
            .map_err(drop)?;
        ctx.l3_csum_replace(IP_CSUM_OFF, u64::from(t.daddr), u64::from(to.dst_addr), 4).map_err(drop)?;
        ctx.store(IP_DST_OFF, &to.dst_addr, 0).map_err(drop)?;
    }
    if to.src_port != t.sport {
        ctx.l4_csum_replace(csum_off, u64::from(t.sport), u64::from(to.src_port), l4_flags | 2).map_err(drop)?;
        ctx.store(L4_OFF, &to.src_port, 0).map_err(drop)?;
    }
    if to.dst_port != t.dport {
        ctx.l4_csum_replace(csum_off, u64::from(t.dport), u64::from(to.dst_port), l4_flags | 2).map_err(drop)?;
        ctx.store(L4_OFF + 2, &to.dst_port, 0).map_err(drop)?;
    }
    Ok(())
}

/// An ICMP error (unreachable, time exceeded, parameter problem) about a translated flow, e.g.
/// "fragmentation needed" from a backend: it quotes the packet as the backend saw it. Translate
/// the quoted header and the outer addresses back, so that the client's kernel matches it to
/// its socket (path MTU discovery, connection errors).
#[inline(always)]
fn icmp_error(ctx: &TcContext, outer: &Ipv4Hdr) -> Result<i32, ()> {
    let icmp_type: u8 = ctx.load(ICMP_OFF).map_err(drop)?;
    if icmp_type != 3 && icmp_type != 11 && icmp_type != 12 {
        return Ok(TC_ACT_OK);
    }
    let inner: Ipv4Hdr = ctx.load(INNER_IP_OFF).map_err(drop)?;
    if inner.vihl != 0x45 || (inner.proto != IPPROTO_TCP && inner.proto != IPPROTO_UDP) {
        return Ok(TC_ACT_OK);
    }
    let ports: [u16; 2] = ctx.load(INNER_L4_OFF).map_err(drop)?;
    let (isrc, idst) = (u32::from_ne_bytes(inner.src_addr), u32::from_ne_bytes(inner.dst_addr));
    // The quoted packet went from (translated) client to backend: the backend's reply entry
    // holds the original addresses.
    let Some(entry) = CONNTRACK.get_ptr(&ct_key(idst, isrc, ports[1], ports[0], inner.proto)) else {
        return Ok(TC_ACT_OK);
    };
    let entry = unsafe { *entry };
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
