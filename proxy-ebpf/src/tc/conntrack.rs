//! The flows in conntrack: a known flow's packet translated from its entry, the entry's state
//! and lifetime, the reply entry kept beside it, and an evicted entry re-created from the other.
use aya_ebpf::{
    bindings::{BPF_NOEXIST, TC_ACT_OK},
    programs::TcContext,
};
use proxy_common::{
    CachedRoute, CtKey, CtValue, FlowAddr, IPPROTO_TCP, SERVICE_FLAG_MAGLEV, SERVICE_FLAG_SNAT,
    SERVICE_FLAG_SOURCE_RANGES, counter, ct, service_stat,
};

use super::{
    dsr::failed,
    entry::{expired, forget, lifetime},
    nat::{flow_hash, lookup_frontend, masquerade_source, source_scope},
    parse::{NOT_A_FIRST_FRAGMENT, Tuple},
    rewrite::rewrite,
    route::{ROUTE_CACHED, ROUTE_LOOK_UP, redirect_by, route_hint},
    scratch::{FlowScratch, scratch},
    verdict::{END_FLOW, NO_FLOW, PASS},
};
use crate::{
    family::Family,
    flow_cache,
    globals::KPR_FORWARD_DIRECT,
    maps::{ANSWERS_WANTED, FlowMap, FlowTables, backend_at, count, now_by_tick, serves},
    packet::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    stats,
};

/// A packet of a flow in conntrack: translated as its entry says (`NO_FLOW`: no live entry),
/// the entry taken from this CPU's flow cache where it serves, else from the table.
#[inline(always)]
pub(super) fn translate_tracked<F: Family>(
    ctx: &TcContext,
    t: &Tuple,
    tcp_flags: u8,
    ingress: bool,
    slow: bool,
) -> i32 {
    let Ok(mut s) = scratch() else { return NO_FLOW };
    // The key and the entry's copy live in the scratch area: this stage's frame is on the
    // longest chains of calls (confirm, stale).
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let key = unsafe {
        let key = s.flow_key::<F::FlowAddr>();
        CtKey::write_words(key, &t.saddr, &t.daddr, t.sport, t.dport, t.proto);
        &*key
    };
    // The generation is read before the table's lookup (`flow_cache::generation`), and kept in
    // the scratch area for the fill: on the stack it would lengthen the chains of calls through
    // this stage.
    let generation = flow_cache::generation();
    s.generation = generation;
    let now = now_by_tick(&raw mut s.clock);
    let straight_out = ingress && KPR_FORWARD_DIRECT.load() != 0;
    // The slot a fill may take is kept in the scratch area, as the generation.
    s.cache_slot.index = flow_cache::NO_SLOT;
    let cached = if cacheable(t, tcp_flags) {
        flow_cache::probe(key, generation, now, straight_out, u64::from(ctx.len()), &mut s.cache_slot)
    } else {
        None
    };
    // The entry, and how the packet is sent on (`redirect_by`, `forward_direct`).
    let (entry, route) = match cached {
        Some(entry) => (entry, if straight_out { ROUTE_CACHED } else { ROUTE_LOOK_UP }),
        None => match table_flow::<F>(ctx, t, key, tcp_flags, (ingress, slow), straight_out, now, s.as_ptr()) {
            Ok(found) => found,
            Err(verdict) => return verdict,
        },
    };
    if rewrite::<F>(ctx, t, entry).is_err() {
        return if ingress { failed::<F>(ctx) } else { PASS };
    }
    count(counter::TC_CT_HIT);
    if route == ROUTE_CACHED
        && let Some(verdict) = redirect_by::<F>(ctx, &entry.route, s)
    {
        return verdict;
    }
    // `forward_direct`, next, takes it back.
    s.route = route;
    TC_ACT_OK
}

/// `translate_tracked` in the conntrack table: the flow's entry (copied to `s.entry`, put in the flow
/// cache when it may serve there) and how to route the packet, or the verdict on a packet that
/// found no live flow (`NO_FLOW`) or started a flow anew.
#[inline(always)]
fn table_flow<'a, F: Family>(
    ctx: &TcContext,
    t: &Tuple,
    key: &CtKey<F::FlowAddr>,
    tcp_flags: u8,
    (ingress, slow): (bool, bool),
    straight_out: bool,
    now: u64,
    s: *mut FlowScratch,
) -> Result<(&'a CtValue, u32), i32> {
    let (established, new_flows) = (F::FlowAddr::established(), F::FlowAddr::new_flows());
    // Established flows first; a flow not yet answered lives apart (`CT_NEW*`), so that a flood
    // of new flows (SYNs, spoofed segments) evicts only its own kind.
    let (entry_ptr, confirmed) = match established.get_ptr_mut(key) {
        Some(entry_ptr) => (entry_ptr, true),
        None => match new_flows.get_ptr_mut(key) {
            Some(entry_ptr) => (entry_ptr, false),
            None => return Err(NO_FLOW),
        },
    };
    // SAFETY: map value and scratch pointers, valid for this program run; the copy is read
    // while the map's entry is written.
    let entry = unsafe {
        // Not an assignment: the compiler cannot tell the two apart and would call memmove.
        core::ptr::copy_nonoverlapping(entry_ptr, &raw mut (*s).entry, 1);
        &(*s).entry
    };
    let syn = tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    // Replies keep their route from the first answer on (TCP's waits for the client's ACK
    // among the new flows, and moves with the entry when it comes).
    let mut route = route_hint::<F>(ingress && (confirmed || entry.flags & ct::REPLY != 0), &entry.route, now);
    if expired(t.proto, entry, now) {
        count(counter::TC_CT_EXPIRED);
        // The client's entry of a flow never answered (as the agent's sweep counts them).
        if entry.flags & (ct::REPLY | ct::SEEN_REPLY | ct::DSR) == 0 {
            stats::add(entry.service_id, service_stat::UNANSWERED, 0, 0);
            stats::endpoint(&entry.dst_addr, entry.dst_port, t.proto, service_stat::UNANSWERED, 0, 0);
        }
        forget(key, entry, t.proto);
        return Err(NO_FLOW);
    }
    if ingress && syn && !slow {
        // A SYN on a known flow may start it anew (`reopen`, `stale`): the slow program's, whose
        // stack holds those chains of calls beside the attached program's inlined path.
        return Err(NO_FLOW);
    }
    if ingress && syn && (ct::closed(entry.flags) || entry.flags & ct::ENDPOINT_DEAD != 0 || stale(ctx, t, entry)) {
        // A new connection reusing the 5-tuple of a closed flow, or of one whose endpoint
        // is gone: balanced anew (conntrack does the same for a SYN after TIME_WAIT). When
        // the new pick is the old flow's translation, as it is while the service is
        // unchanged (the pick is a hash of the tuple), the closed flow's entries start
        // over in place: no forget, no inserts, and none again at the answer.
        if confirmed && ct::closed(entry.flags) && reopen::<F>(ctx, t, entry_ptr, now) {
            if rewrite::<F>(ctx, t, entry).is_err() {
                return Err(PASS);
            }
            count(counter::TC_NEW_FLOW);
            stats::add(entry.service_id, service_stat::NEW_FLOWS, 1, u64::from(ctx.len()));
            stats::endpoint(&entry.dst_addr, entry.dst_port, t.proto, service_stat::NEW_FLOWS, 1, u64::from(ctx.len()));
            // SAFETY: the per-CPU scratch value; `forward_direct`, next, takes it back.
            unsafe { (*s).route = route };
            return Err(TC_ACT_OK);
        }
        forget(key, entry, t.proto);
        return Err(NO_FLOW);
    }
    if entry.flags & ct::ENDPOINT_DEAD != 0 && ingress {
        // The agent found the flow's endpoint dead: the client is told now (a RST), not after
        // minutes of retransmissions.
        forget(key, entry, t.proto);
        return Err(END_FLOW);
    }
    let seen = seen_bits(t.proto, entry, tcp_flags);
    if entry.flags & (ct::REPLY | ct::SEEN_REPLY) == ct::REPLY && ANSWERS_WANTED.get(0).is_some_and(|w| *w != 0) {
        // The flow's first answer, from its endpoint (the replies' source), while outlier
        // detection reads them.
        let refused = t.proto == IPPROTO_TCP && tcp_flags & TCP_RST != 0;
        let answer = if refused { stats::Answer::Refused } else { stats::Answer::Answered };
        stats::backend_answered(&t.saddr, t.sport, t.proto, answer);
    }
    if confirmed {
        touch(established, key, entry_ptr, entry, seen, now);
    } else if seen & ESTABLISHES != 0 && entry.flags & ct::DSR == 0 {
        confirm(key, entry, seen, now);
        // The answer's route, looked up and kept in its entry, now established, for the
        // flow's next replies.
        route = route_hint::<F>(ingress, &entry.route, now);
    } else {
        touch(new_flows, key, entry_ptr, entry, seen, now);
    }
    // The entry as it stays until its refresh is due, for the flow's next packets, if `probe`
    // left its slot free: a packet to be sent straight out needs the kept route.
    // SAFETY: the per-CPU scratch value.
    let (slot, generation) = unsafe { ((*s).cache_slot, (*s).generation) };
    let cached = if slot.index != flow_cache::NO_SLOT
        && confirmed
        && entry.flags | seen == entry.flags
        && !ct::closed(entry.flags)
        && (route == ROUTE_CACHED || !straight_out)
    {
        let mut valid_until = entry.last_seen.saturating_add(ct::REFRESH_NS.min(lifetime(t.proto, entry.flags)));
        if route == ROUTE_CACHED {
            valid_until = valid_until.min(u64::from(entry.route.period + 1) << ct::ROUTE_PERIOD_SHIFT);
        }
        flow_cache::fill(slot, key, entry, generation, now, valid_until, route == ROUTE_CACHED, u64::from(ctx.len()))
    } else {
        false
    };
    // The packet is counted for its service port: in the slot it filled, else here.
    if cached {
        count(counter::TC_FLOW_CACHE_FILLED);
    } else {
        stats::flow_packet(entry, &t.saddr, t.sport, t.proto, u64::from(ctx.len()));
    }
    Ok((entry, route))
}

/// May this packet be served by the flow cache? One that changes nothing in its flow's entry
/// (no SYN, FIN or RST; not a fragment, which must be remembered for its later ones).
#[inline(always)]
pub(super) fn cacheable(t: &Tuple, tcp_flags: u8) -> bool {
    t.first_fragment == NOT_A_FIRST_FRAGMENT && tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) == 0
}

/// [`seen_bits`]: this packet establishes its flow (TCP: the client's ACK of the backend's
/// answer, SYN_RECV → ESTABLISHED; else the backend's answer). Never stored in an entry.
const ESTABLISHES: u32 = 1 << 31;

/// What this packet tells of its flow: an answer from the backend (TCP's first one: awaiting
/// the client's ACK), the client's ACK of it, a FIN, a RST; and whether it `ESTABLISHES` it.
#[inline(always)]
fn seen_bits(proto: u8, entry: &CtValue, tcp_flags: u8) -> u32 {
    let reply = entry.flags & ct::REPLY != 0;
    let mut bits = if reply { ct::SEEN_REPLY } else { 0 };
    if !reply && entry.flags & ct::DSR != 0 {
        // Direct server return: the answers go to the client without this node. The client's
        // next packet (TCP: its ACK of the answer) tells that it was answered; the flow stays
        // among the new flows all the same (`table_flow`): an entry this node cannot check
        // against an answer (a blind sender's SYN and ACK) must not take an established
        // flow's place. The client's FIN ends it here (the endpoint's is never seen).
        if tcp_flags & (TCP_SYN | TCP_RST) == 0 {
            bits |= ct::SEEN_REPLY;
        }
        if tcp_flags & TCP_FIN != 0 {
            bits |= ct::FIN_ORIG | ct::FIN_REPLY;
        }
    } else if proto == IPPROTO_TCP {
        if reply && entry.flags & ct::SEEN_REPLY == 0 {
            bits |= ct::AWAITING_ACK;
        } else if !reply && entry.flags & ct::AWAITING_ACK != 0 && tcp_flags & (TCP_ACK | TCP_RST) == TCP_ACK {
            bits |= ESTABLISHES;
        }
    } else if reply && tcp_flags & TCP_RST == 0 {
        bits |= ESTABLISHES;
    }
    if tcp_flags & TCP_FIN != 0 {
        bits |= if reply { ct::FIN_REPLY } else { ct::FIN_ORIG };
    }
    if tcp_flags & TCP_RST != 0 {
        bits |= ct::RST;
    }
    bits
}

/// Record a packet of a live flow: new state bits at once (`AWAITING_ACK` cleared by the
/// packet that `ESTABLISHES` it), the time at most every `REFRESH_NS`; both entries of the
/// flow, putting back the other one if it was evicted.
#[inline(always)]
fn touch<A: FlowTables, M: FlowMap<CtKey<A>>>(
    map: &M,
    key: &CtKey<A>,
    entry_ptr: *mut CtValue,
    entry: &CtValue,
    seen: u32,
    now: u64,
) {
    let cleared = if seen & ESTABLISHES != 0 { ct::AWAITING_ACK | ESTABLISHES } else { 0 };
    let flags = (entry.flags | seen) & !cleared;
    if flags == entry.flags && now.saturating_sub(entry.last_seen) < ct::REFRESH_NS {
        return;
    }
    // SAFETY: a map value pointer, valid for this program run; racing writers only ever
    // move the time forward or add bits.
    unsafe {
        (*entry_ptr).flags = flags;
        (*entry_ptr).last_seen = now;
    }
    let pair_key = entry.pair_key::<A>(key.proto);
    match map.get_ptr_mut(&pair_key) {
        Some(pair) => unsafe {
            (*pair).flags = ((*pair).flags | (flags & ct::FLOW_BITS)) & !cleared;
            (*pair).last_seen = now;
        },
        None => heal(map, key, entry, flags, now),
    }
}

/// Put back the evicted other entry of a flow.
#[inline(never)]
fn heal<A: FlowTables, M: FlowMap<CtKey<A>>>(map: &M, key: &CtKey<A>, entry: &CtValue, flags: u32, now: u64) {
    let Ok(mut s) = scratch() else { return };
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let (pair_key, value) = unsafe {
        let pair_key = s.reply_key::<A>();
        *pair_key = entry.pair_key(key.proto);
        s.reply = mirror(key, entry, flags, now);
        (&*pair_key, &s.reply)
    };
    if map.insert(pair_key, value, u64::from(BPF_NOEXIST)).is_ok() {
        count(counter::TC_CT_HEALED);
    }
}

/// The other entry of the flow whose entry `key` → `entry` is: its value is this key, mirrored.
#[inline(always)]
fn mirror<A: FlowAddr>(key: &CtKey<A>, entry: &CtValue, flags: u32, now: u64) -> CtValue {
    CtValue {
        src_addr: key.dst_addr.addr(),
        dst_addr: key.src_addr.addr(),
        src_port: key.dst_port,
        dst_port: key.src_port,
        service_id: entry.service_id,
        last_seen: now,
        flags: (flags & ct::FLOW_BITS) | (!entry.flags & ct::REPLY),
        // The entry's translation undone: its difference negated.
        addrs_csum_diff: !entry.addrs_csum_diff,
        route: CachedRoute::NONE,
    }
}

/// A new flow is established (TCP: the client acknowledged the backend's answer; else the
/// backend answered): both its entries move to the established table; if it is full, they
/// stay among the new flows, established there (their lifetime is an established flow's).
#[inline(never)]
fn confirm<A: FlowTables>(key: &CtKey<A>, entry: &CtValue, seen: u32, now: u64) {
    let Ok(mut s) = scratch() else { return };
    let flags = (entry.flags | seen) & !(ct::AWAITING_ACK | ESTABLISHES);
    // SAFETY: the per-CPU scratch value, valid for this program run.
    let (pair_key, value) = unsafe {
        let pair_key = s.reply_key::<A>();
        *pair_key = entry.pair_key(key.proto);
        s.forward = CtValue { flags, last_seen: now, ..*entry };
        s.reply = mirror(key, entry, flags, now);
        // The other entry's kept route (its first packet's: `create_flow`, `keep_route`)
        // goes with it.
        if let Some(pair) = A::new_flows().get_ptr(&*pair_key)
            && (*pair).same_translation(&s.reply)
        {
            // Not an assignment, which would be a call of memmove.
            core::ptr::copy_nonoverlapping(&raw const (*pair).route, &raw mut s.reply.route, 1);
        }
        (&*pair_key, &s.forward)
    };
    let established = A::established();
    if established.insert(key, value, 0).is_ok() {
        if established.insert(pair_key, &s.reply, 0).is_ok() {
            let _ = A::new_flows().remove(pair_key);
            let _ = A::new_flows().remove(key);
            return;
        }
        let _ = established.remove(key);
    }
    count(counter::TC_CT_ESTABLISHED_FULL);
    let new_flows = A::new_flows();
    let _ = new_flows.insert(key, value, 0);
    let _ = new_flows.insert(pair_key, &s.reply, 0);
}

/// Start a new connection (its SYN; its key and the entry found are in the scratch area) on
/// the established entries of the closed flow whose tuple it reuses, if a new pick would
/// translate it as that flow was: the same service, backend and source (the client's, or the
/// same masquerade address; the SNAT port is the flow's own). Both entries go back to "not
/// answered" (the SYN timeout) in place. Services with session affinity, source ranges or
/// Maglev (its pick is a subprogram, and this frame is on the longest chain of calls), and a
/// flow missing its other entry, take the full path.
#[inline(never)]
pub(super) fn reopen<F: Family>(ctx: &TcContext, t: &Tuple, entry_ptr: *mut CtValue, now: u64) -> bool {
    let Ok(s) = scratch() else { return false };
    // SAFETY: the scratch area's key slot, valid for this program run.
    let (key, entry) = (unsafe { &*s.flow_key::<F::FlowAddr>() }, &s.entry);
    if entry.flags & (ct::REPLY | ct::DSR) != 0 {
        return false;
    }
    let Some(service) = lookup_frontend(t, source_scope(ctx, t)) else { return false };
    if service.service_id != entry.service_id
        || service.affinity_timeout != 0
        || service.flags & (SERVICE_FLAG_SOURCE_RANGES | SERVICE_FLAG_MAGLEV) != 0
    {
        return false;
    }
    let Some(backend) = backend_at(&service, flow_hash(t)) else { return false };
    if !(backend.addr.same(&entry.dst_addr) && backend.port == entry.dst_port) {
        return false;
    }
    let same_source = if service.flags & SERVICE_FLAG_SNAT != 0 || backend.addr.same(&t.saddr) {
        !entry.src_addr.same(&t.saddr)
            && masquerade_source::<F>(ctx, t, &backend.addr).is_some_and(|addr| addr.same(&entry.src_addr))
    } else {
        entry.src_addr.same(&t.saddr) && entry.src_port == t.sport
    };
    if !same_source {
        return false;
    }
    // SAFETY: the scratch area and map value pointers, valid for this program run.
    unsafe {
        let pair_key = s.reply_key::<F::FlowAddr>();
        *pair_key = entry.pair_key(key.proto);
        match F::FlowAddr::established().get_ptr_mut(&*pair_key) {
            // The replies' entry must still be this flow's (it holds the SNAT port).
            Some(pair)
                if (*pair).dst_addr.same(&key.src_addr.addr())
                    && (*pair).dst_port == key.src_port
                    && (*pair).src_addr.same(&key.dst_addr.addr())
                    && (*pair).src_port == key.dst_port =>
            {
                (*pair).flags = ct::REPLY;
                (*pair).last_seen = now;
            }
            _ => return false,
        }
        (*entry_ptr).flags = 0;
        (*entry_ptr).last_seen = now;
    }
    true
}

/// The flow's endpoint is no longer one of its frontend's endpoints (or the frontend is gone).
#[inline(never)]
fn stale(ctx: &TcContext, t: &Tuple, entry: &CtValue) -> bool {
    lookup_frontend(t, source_scope(ctx, t)).is_none_or(|service| !serves(&service, &entry.dst_addr, entry.dst_port))
}
