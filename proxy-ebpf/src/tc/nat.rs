//! A new flow: its frontend and source class, the backend pick (affinity, traffic policy,
//! source ranges), masquerade and its SNAT port, and its two conntrack entries.
use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_NOT_FWDED, BPF_FIB_LKUP_RET_SUCCESS,
        BPF_FIB_LOOKUP_SKIP_NEIGH, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT, bpf_fib_lookup,
    },
    btf_maps::lpm_trie::Key,
    helpers::bpf_fib_lookup as fib_lookup,
    programs::TcContext,
};
use proxy_common::{
    AFFINITY_BY_ADDR, Addr, Addr4, BACKEND_FLAG_REMOTE, Backend, CachedRoute, CidrKey, CtKey, CtValue,
    DETECT_LOCAL_CIDR, DETECT_LOCAL_INTERFACE, IPPROTO_TCP, LINK_FLAG_LOCAL_TRAFFIC, LINK_FLAG_NOT_ETHERNET,
    NODE_ADDR_LOCAL, NODE_ADDR_NODEPORT, SCOPE_EXTERNAL, SCOPE_NODE, SCOPE_POD, SERVICE_FLAG_DROP_NO_ENDPOINTS,
    SERVICE_FLAG_DSR, SERVICE_FLAG_MAGLEV, SERVICE_FLAG_SNAT, ServiceKey, ServiceValue, addrs_csum_diff, counter, csum,
    ct, event, has_states, service_stat,
};

use super::{
    dsr::{NOT_DECAPSULATED, SERVICE_FLAG_DECAPSULATED, failed, open_decapsulated},
    entry::{expired, forget},
    event::note,
    parse::{NOT_A_FIRST_FRAGMENT, Tuple},
    rewrite::rewrite_first,
    route::{ROUTE_LOOK_UP, ROUTE_LOOKED_UP, ROUTE_MAY_KEEP, ifindex, keep_in, reverse_path_ok, zero_fib},
    scratch::{Scratch, scratch},
    source_ranges::source_range_refuses,
    verdict::{OPEN, PASS, REJECT},
};
use crate::{
    family::Family,
    flow_cache,
    globals::{
        KPR_DETECT_LOCAL, KPR_FLOW_HASH_SEED, KPR_FORWARD_DIRECT, KPR_MAGLEV_SEED, KPR_MAGLEV_TABLE_SIZE,
        KPR_REDIRECT_NEXT_HOP, KPR_SNAT_PORT_MAX, KPR_SNAT_PORT_MIN,
    },
    maps::{
        FlowTables, HANDOVER, LINKS, LOCAL_CIDRS, SERVICES, ServiceRangeMiss, affinity_backend, backend_at, count,
        handed_over, host_lets_direct, link, maglev_slot, node_addr_flags, now, refusal, remember_affinity,
        service_range_miss,
    },
    packet::{TCP_ACK, TCP_SYN},
    stats,
};

/// Tries at finding a free SNAT port before giving up on a new flow.
const SNAT_TRIES: u32 = 16;

/// A packet of no flow kpr knows: a new flow to a frontend, or not ours.
#[inline(never)]
pub(super) fn pick_backend_subprogram<F: Family>(ctx: &TcContext, t: &Tuple, tcp_flags: u8, ingress: bool) -> i32 {
    pick_backend::<F>(ctx, t, tcp_flags, ingress).unwrap_or(PASS)
}

#[inline(always)]
pub(super) fn pick_backend<F: Family>(ctx: &TcContext, t: &Tuple, tcp_flags: u8, ingress: bool) -> Result<i32, ()> {
    let key = CtKey::new(t.saddr, t.daddr, t.sport, t.dport, t.proto);
    // A flow kube-proxy translated before kpr took the node over: netfilter's conntrack goes
    // on translating it. A new connection on its tuple is kpr's.
    if handed_over(&key) {
        if !(ingress && tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN) {
            return Ok(PASS);
        }
        let _ = HANDOVER.remove(&key);
    }
    if !ingress {
        return Ok(egress_drop(ctx, t));
    }
    if !reverse_path_ok::<F>(ctx, t) {
        note(t, counter::TC_DROPPED, event::DROPPED_SPOOFED_SOURCE, 0);
        return Ok(TC_ACT_SHOT);
    }
    // Out of a direct server return tunnel: the endpoint is the entry node's pick.
    match open_decapsulated(t) {
        NOT_DECAPSULATED => {}
        verdict => return Ok(verdict),
    }
    let scope = source_scope(ctx, t);
    let service = match lookup_frontend(t, scope) {
        Some(service) => service,
        // A refused service range: a ClusterIP's unknown port is rejected, an unallocated address of
        // the service range dropped.
        None => match service_range_miss(t.daddr) {
            ServiceRangeMiss::NotInRange => return Ok(PASS),
            ServiceRangeMiss::Reject => refusal(0),
            ServiceRangeMiss::Drop => {
                note(t, counter::TC_DROPPED, event::DROPPED_UNALLOCATED_ADDRESS, 0);
                return Ok(TC_ACT_SHOT);
            }
        },
    };
    pick_from_service(t, &service, now())
}

/// A TCP connection of the node itself that kube-proxy would DROP (traffic policy Local
/// without a local endpoint, a source outside loadBalancerSourceRanges): the socket path lets
/// it through untranslated and it is dropped here, on its way out, so that `connect()` times
/// out as it does behind kube-proxy's filter rules.
#[inline(never)]
fn egress_drop(ctx: &TcContext, t: &Tuple) -> i32 {
    if t.proto != IPPROTO_TCP || source_scope(ctx, t) != SCOPE_NODE {
        return PASS;
    }
    let (drop, service_id) = match lookup_frontend(t, SCOPE_NODE) {
        Some(s) => (s.backends_count == 0 && s.flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0, s.service_id),
        None => (service_range_miss(t.daddr) == ServiceRangeMiss::Drop, 0),
    };
    if drop {
        note(t, counter::TC_DROPPED, event::DROPPED_FROM_NODE, service_id);
        return TC_ACT_SHOT;
    }
    PASS
}

/// Where a packet comes from, as kube-proxy tells sources apart: the node itself (a local
/// source address), a pod the local-traffic detector calls local, or anywhere else.
#[inline(always)]
pub(super) fn source_scope(ctx: &TcContext, t: &Tuple) -> u8 {
    if node_addr_flags(&t.saddr) & NODE_ADDR_LOCAL != 0 {
        return SCOPE_NODE;
    }
    let local = match KPR_DETECT_LOCAL.load() {
        DETECT_LOCAL_CIDR => LOCAL_CIDRS.get(&Key::new(128, CidrKey { addr: t.saddr })).is_some(),
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
pub(super) fn lookup_frontend(t: &Tuple, scope: u8) -> Option<ServiceValue> {
    let key = ServiceKey { addr: t.daddr, port: t.dport, proto: t.proto, scope };
    if let Some(v) = SERVICES.get_ptr(&key) {
        return Some(unsafe { *v });
    }
    if node_addr_flags(&key.addr) & NODE_ADDR_NODEPORT != 0 {
        return SERVICES.get_ptr(&ServiceKey { addr: key.addr.unspecified_like(), ..key }).map(|v| unsafe { *v });
    }
    None
}

/// The address MASQUERADE would give a packet to `backend`: the first address of the link the
/// route to it leaves by, else the node's primary address of the family; `None` where the
/// packet is not masqueraded at all (`backend` is one of the node's own addresses).
/// The lookup's parameters live in the scratch area: on the stack they would put a new flow's
/// longest chain of calls past the BPF stack of older kernels.
///
/// For a new flow's first packet on its way in (`ROUTE_MAY_KEEP`), to be sent straight out
/// (6.3+: the lookup's next hop serves `bpf_redirect_neigh`), the lookup is the one
/// `forward_direct` makes (the packet's protocol, TOS and source, as the kernel routes a
/// forwarded packet: after its DNAT, before its masquerade), and its answer is kept for it
/// (`ROUTE_LOOKED_UP`): one route lookup for that packet, not two.
#[inline(never)]
pub(super) fn masquerade_source<F: Family>(ctx: &TcContext, t: &Tuple, backend: &Addr) -> Option<Addr> {
    let s = scratch().ok()?.as_ptr();
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let params = unsafe {
        zero_fib(&raw mut (*s).fib);
        (*s).fib_peer = 0;
        &mut (*s).fib
    };
    params.family = F::AF;
    params.ifindex = ifindex(ctx);
    // Whether the answer may be kept is told by `(*s).route` alone, here and after the lookup:
    // a flag held across the helper's call would be spilled, and this frame is on the longest
    // chain of calls (`reopen`'s).
    let data = ctx.data();
    // SAFETY (here and below): the per-CPU scratch value.
    if unsafe { (*s).route } == ROUTE_MAY_KEEP {
        if KPR_FORWARD_DIRECT.load() != 0
            && KPR_REDIRECT_NEXT_HOP.load() != 0
            && data + F::IP_OFF + size_of::<F::Ip>() <= ctx.data_end()
        {
            // The tuple's source, not the header's: the header's is a copy (a call on the
            // BPF stack, for an IPv6 address read unaligned from the packet).
            params.l4_protocol = t.proto;
            // SAFETY: within [data, data_end), checked above.
            F::fib_tos(params, unsafe { &*((data + F::IP_OFF) as *const F::Ip) });
            F::fib_src(params, &t.saddr);
        } else {
            unsafe { (*s).route = ROUTE_LOOK_UP };
        }
    }
    F::fib_dst(params, backend);
    let flags = if unsafe { (*s).route } == ROUTE_MAY_KEEP { BPF_FIB_LOOKUP_SKIP_NEIGH } else { 0 };
    let rc = unsafe { fib_lookup(ctx.as_ptr(), params, size_of::<bpf_fib_lookup>() as i32, flags) };
    if rc == i64::from(BPF_FIB_LKUP_RET_NOT_FWDED) {
        // Delivered locally (a host-network endpoint of this node): never masqueraded, as a
        // DNATed packet that goes to INPUT never meets kube-proxy's MASQUERADE in
        // POSTROUTING. The endpoint answers the client itself, through the egress program.
        return None;
    }
    // Too big for the link (checked against the packet, as no length was given): the lookup
    // found the link all the same.
    if (rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS)
        || rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH)
        || rc == i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED))
        && let Some(out) = link(params.ifindex)
        && let Some(addr) = F::masquerade_addr(&out)
    {
        // A link without Ethernet is the host stack's to send to (`forward_direct`).
        if rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS)
            && unsafe { (*s).route } == ROUTE_MAY_KEEP
            && out.flags & LINK_FLAG_NOT_ETHERNET == 0
        {
            // `translate` takes it back if the packet does not go on to `forward_direct`.
            unsafe { (*s).route = ROUTE_LOOKED_UP };
        }
        return Some(addr);
    }
    link(0).and_then(|l| F::masquerade_addr(&l))
}

#[inline(always)]
fn pick_from_service(t: &Tuple, service: &ServiceValue, now: u64) -> Result<i32, ()> {
    if source_range_refuses(t, service) {
        return Ok(TC_ACT_SHOT);
    }
    if service.backends_count == 0 {
        if service.flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0 {
            note(t, counter::TC_DROPPED, event::DROPPED_NO_LOCAL_ENDPOINTS, service.service_id);
            return Ok(TC_ACT_SHOT);
        }
        // kube-proxy's REJECT: a TCP reset, else ICMP port unreachable (UDP and SCTP). The
        // service port is the scratch area's, for its counters.
        scratch()?.service = *service;
        return Ok(REJECT);
    }
    let pick = backend_pick(service, t);
    let Some(backend) = affinity_backend(service, AFFINITY_BY_ADDR, t.saddr, now).or_else(|| backend_at(service, pick))
    else {
        return Ok(PASS);
    };
    remember_affinity(service, AFFINITY_BY_ADDR, t.saddr, &backend, now);
    let mut s = scratch()?;
    s.service = *service;
    s.backend = backend;
    // Here, off the frames of the SNAT port search: the reply entry's key goes from the
    // backend to the client, its value from the frontend to the client. All four words of
    // either family's addresses (IPv4 mapped): the same difference.
    s.reply_csum_diff = addrs_csum_diff::<Addr>(&backend.addr, &t.saddr, &t.daddr, &t.saddr);
    Ok(OPEN)
}

/// Give a new flow to `backend` its conntrack entries (and SNAT port) and translate its first
/// packet: a subprogram of its own, for the BPF stack.
#[inline(never)]
pub(super) fn create_flow_subprogram<F: Family>(ctx: &TcContext, t: &Tuple, tcp_flags: u8) -> i32 {
    let Ok(s) = scratch().map(Scratch::as_ptr) else { return PASS };
    // SAFETY: the per-CPU scratch value, valid for this program run; read while `create_flow`
    // writes its other fields.
    let (service, backend) = unsafe { (&(*s).service, &(*s).backend) };
    create_flow::<F>(ctx, t, service, backend, tcp_flags).unwrap_or(PASS)
}

#[inline(always)]
pub(super) fn create_flow<F: Family>(
    ctx: &TcContext,
    t: &Tuple,
    service: &ServiceValue,
    backend: &Backend,
    tcp_flags: u8,
) -> Result<i32, ()> {
    let mut s = scratch()?;
    let now = now();
    // Replies must come back through this node: masquerade what the entry says and a client
    // that is its own backend (hairpin), as kube-proxy does.
    // Direct server return to an endpoint on another node, where this node may send packets
    // straight out (the tunnel's packets, from the node's address, cannot take the host's
    // forwarding path): not masqueraded. Elsewhere it is, as kube-proxy's traffic.
    // A datagram in fragments too: its later fragments are not put in the tunnel.
    let wants_dsr = service.flags & SERVICE_FLAG_DSR != 0 && backend.flags & BACKEND_FLAG_REMOTE != 0;
    let dsr = wants_dsr
        && F::ETHERNET
        && KPR_FORWARD_DIRECT.load() != 0
        && host_lets_direct()
        && t.first_fragment == NOT_A_FIRST_FRAGMENT;
    let masquerade = service.flags & SERVICE_FLAG_SNAT != 0 || backend.addr.same(&t.saddr) || (wants_dsr && !dsr);
    let snat_addr = if masquerade { masquerade_source::<F>(ctx, t, &backend.addr) } else { None };
    s.reply = CtValue {
        src_addr: t.daddr,
        dst_addr: t.saddr,
        src_port: t.dport,
        dst_port: t.sport,
        service_id: service.service_id,
        last_seen: now,
        flags: if service.flags & SERVICE_FLAG_DECAPSULATED != 0 { ct::REPLY | ct::DSR } else { ct::REPLY },
        // The client's address may change below (masquerade).
        addrs_csum_diff: s.reply_csum_diff,
        route: CachedRoute::NONE,
    };
    let (src_addr, src_port) = if let Some(snat_addr) = snat_addr {
        // The reply entry's key has the masquerade address where the client's was.
        let diff = u64::from(s.reply_csum_diff) + F::addr_diff(&snat_addr, &t.saddr);
        s.reply.addrs_csum_diff = csum::fold32(diff);
        // 0: none free.
        let port = snat_port::<F::FlowAddr>(t, backend, &snat_addr, s);
        if port == 0 {
            note(t, counter::TC_SNAT_EXHAUSTED, event::DROPPED_SNAT_EXHAUSTED, service.service_id);
            return Ok(TC_ACT_SHOT);
        }
        (snat_addr, port)
    } else {
        // The replies come back to the client's own address and port, unless another flow
        // holds that reply tuple (the client's port to another frontend with the same backend,
        // not closed a second ago): then the client's port is remapped, as Linux's NAT does
        // when a reply tuple clashes.
        // SAFETY: the per-CPU scratch value, valid for this program run.
        unsafe { *s.reply_key::<F::FlowAddr>() = CtKey::new(backend.addr, t.saddr, backend.port, t.sport, t.proto) };
        let port = if snat_try::<F::FlowAddr>(u32::from(t.sport)) != 0 {
            t.sport
        } else {
            snat_port::<F::FlowAddr>(t, backend, &t.saddr, s)
        };
        if port == 0 {
            note(t, counter::TC_SNAT_EXHAUSTED, event::DROPPED_SNAT_EXHAUSTED, service.service_id);
            return Ok(TC_ACT_SHOT);
        }
        (t.saddr, port)
    };
    let (forward, key, reply_key) = unsafe {
        s.forward = CtValue {
            src_addr,
            dst_addr: backend.addr,
            src_port,
            dst_port: backend.port,
            service_id: service.service_id,
            last_seen: now,
            flags: if dsr { ct::DSR } else { 0 },
            // The reply's translation undone.
            addrs_csum_diff: !s.reply.addrs_csum_diff,
            route: CachedRoute::NONE,
        };
        // The masquerade lookup's answer is this packet's route (`forward_direct`) and the
        // flow's next packets': it moves with the entry to the established table.
        if s.route == ROUTE_LOOKED_UP {
            keep_in(&raw mut s.forward.route, &s.fib, s.fib_peer != 0, now);
        }
        let key = s.key::<F::FlowAddr>();
        *key = CtKey::new(t.saddr, t.daddr, t.sport, t.dport, t.proto);
        let reply_key = s.reply_key::<F::FlowAddr>();
        *reply_key = s.forward.pair_key(t.proto);
        (&s.forward, &*key, &*reply_key)
    };
    let new_flows = F::FlowAddr::new_flows();
    let mut adopted = false;
    let forward = if new_flows.insert(key, forward, u64::from(BPF_NOEXIST)).is_ok() {
        forward
    } else if let Some(winner) = new_flows.get_ptr(key) {
        adopted = true;
        // Another CPU created the flow first (a SYN and its retransmission at once): take its
        // translation, and give back what this one held.
        let winner = unsafe { &*winner };
        count(counter::TC_CT_RACE_ADOPTED);
        if !winner.same_translation(forward) {
            let _ = new_flows.remove(reply_key);
        }
        winner
    } else {
        let _ = new_flows.remove(reply_key);
        note(t, counter::TC_CT_FULL, event::DROPPED_CONNTRACK_FULL, service.service_id);
        return Ok(TC_ACT_SHOT);
    };
    if rewrite_first::<F>(ctx, t, forward).is_err() {
        return Ok(failed::<F>(ctx));
    }
    // A TCP flow is new with its SYN (SCTP with its INIT); any other packet re-creates a flow
    // that was lost.
    let recreated = has_states(t.proto) && tcp_flags & (TCP_SYN | TCP_ACK) != TCP_SYN;
    // A probe's flow is not traffic (the agent removes it at once).
    if t.probe == 0 {
        count(if recreated { counter::TC_CT_RECREATED } else { counter::TC_NEW_FLOW });
        // The CPU that lost a race for the flow counts its packet, not the flow again.
        let word = if recreated || adopted { service_stat::NONE } else { service_stat::NEW_FLOWS };
        stats::add(service.service_id, word, 1, u64::from(ctx.len()));
        stats::endpoint(&forward.dst_addr, forward.dst_port, t.proto, word, 1, u64::from(ctx.len()));
    }
    Ok(TC_ACT_OK)
}

/// A SNAT port (0: none) for a flow to `backend` whose reply entry is `s.reply`: the reply entry is
/// stored under the first free port of a sequence that the flow's hash fixes, so a re-created
/// flow gets its old port back. Free: unused, expired, or a closed TCP flow's (as Linux's NAT
/// reuses the tuples of closed connections). The flow's own leftover reply entry is reused.
#[inline(never)]
fn snat_port<A: FlowTables>(t: &Tuple, backend: &Backend, snat_addr: &Addr, s: Scratch) -> u16 {
    let hash = flow_hash(t);
    let (min, max) = (KPR_SNAT_PORT_MIN.load(), KPR_SNAT_PORT_MAX.load());
    let span = u32::from(max.saturating_sub(min)) + 1;
    let start = proxy_common::mix32(hash ^ 0x5bd1_e995);
    // SAFETY: the per-CPU scratch value, valid for this program run. The key of the reply
    // entry: all but its port, which each try sets.
    unsafe {
        *s.reply_key::<A>() = CtKey::new(backend.addr, *snat_addr, backend.port, 0, t.proto);
    }
    for i in 0..SNAT_TRIES {
        let offset = start.wrapping_add(i.wrapping_mul(0x9e37_79b9)).checked_rem(span).unwrap_or(0);
        let port = min.wrapping_add(offset as u16).to_be();
        if snat_try::<A>(u32::from(port)) != 0 {
            return port;
        }
    }
    0
}

/// One try of [`snat_port`]: 1 if the reply entry in the scratch area (`reply_key` but its
/// port, `reply`) now holds `port`. A global function per family: the verifier checks it once
/// per program, not once per try on every path that reaches it.
#[inline(always)]
fn snat_try<A: FlowTables>(port: u32) -> u32 {
    if size_of::<A>() == size_of::<Addr4>() { kpr_snat_try4(port) } else { kpr_snat_try6(port) }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpr_snat_try4(port: u32) -> u32 {
    snat_try_in::<Addr4>(port)
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpr_snat_try6(port: u32) -> u32 {
    snat_try_in::<Addr>(port)
}

#[inline(always)]
fn snat_try_in<A: FlowTables>(port: u32) -> u32 {
    let Ok(s) = scratch() else { return 0 };
    // SAFETY: the scratch area's reply key slot, valid for this program run.
    let (reply_key, reply) = (unsafe { &mut *s.reply_key::<A>() }, &s.reply);
    reply_key.dst_port = port as u16;
    let proto = reply_key.proto;
    let (established, new_flows) = (A::established(), A::new_flows());
    // A port free in both tables is taken by the insert (which looks it up in `CT_NEW*` itself):
    // one lookup fewer than looking first.
    // SAFETY: map value pointers are valid for this program run.
    let old = match established.get_ptr(reply_key) {
        Some(old) => unsafe { &*old },
        None if new_flows.insert(reply_key, reply, u64::from(BPF_NOEXIST)).is_ok() => return 1,
        None => match new_flows.get_ptr(reply_key) {
            Some(old) => unsafe { &*old },
            None => return 0,
        },
    };
    if old.same_translation(reply) {
        // The flow's own leftover (its other entry was lost, or removed first by the sweep):
        // made new, not kept with the old flow's state and age (an expired leftover would be
        // taken for an ended flow when the answer comes, and the answer passed untranslated).
        let _ = established.remove(reply_key);
        flow_cache::forgotten();
        return u32::from(new_flows.insert(reply_key, reply, 0).is_ok());
    }
    let now = now();
    let idle = now.saturating_sub(old.last_seen);
    let closed = ct::closed(old.flags) && idle > ct::CLOSED_PORT_REUSE_NS;
    if closed || expired(proto, old, now) {
        count(counter::TC_CT_EXPIRED);
        forget(reply_key, old, proto);
        return u32::from(new_flows.insert(reply_key, reply, u64::from(BPF_NOEXIST)).is_ok());
    }
    0
}

/// A new flow's backend, as an index into its frontend's range: a hash of the tuple, as random
/// as the client's port for new flows, and the same again for a connection whose entries were
/// lost. A Maglev frontend's is its table's slot for a hash seeded alike on every node.
#[inline(always)]
pub(super) fn backend_pick(service: &ServiceValue, t: &Tuple) -> u32 {
    if service.flags & SERVICE_FLAG_MAGLEV != 0 {
        let slot = maglev_pick(service, t);
        if slot != NO_SLOT {
            return slot;
        }
    }
    flow_hash(t)
}

/// [`maglev_pick`]: the frontend has no table.
const NO_SLOT: u32 = u32::MAX;

/// A Maglev frontend's slot for the tuple (or `NO_SLOT`): a subprogram of its own, off the
/// frames of its callers, which are on the longest chains of calls (the BPF stack).
#[inline(never)]
fn maglev_pick(service: &ServiceValue, t: &Tuple) -> u32 {
    maglev_slot(service, tuple_hash(KPR_MAGLEV_SEED.load(), t), KPR_MAGLEV_TABLE_SIZE.load()).unwrap_or(NO_SLOT)
}

/// A hash of the tuple, seeded per boot (`KPR_FLOW_HASH_SEED`).
#[inline(always)]
pub(super) fn flow_hash(t: &Tuple) -> u32 {
    tuple_hash(KPR_FLOW_HASH_SEED.load(), t)
}

#[inline(always)]
fn tuple_hash(seed: u32, t: &Tuple) -> u32 {
    proxy_common::tuple_hash(seed, &t.saddr, &t.daddr, t.sport, t.dport, t.proto)
}
