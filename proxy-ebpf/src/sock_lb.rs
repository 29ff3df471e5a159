//! Socket-level load balancing: translate ClusterIP:port to a backend when a socket connects
//! (TCP, connected UDP) or sends (unconnected UDP), and translate back what the application
//! reads (getpeername, recvfrom), so it keeps seeing the ClusterIP as its peer.
use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        bpf_sock_addr, bpf_sock_tuple, bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1,
        bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2, sockaddr,
    },
    helpers::{
        bpf_bind, bpf_get_current_cgroup_id, bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie,
        bpf_set_retval, bpf_sk_lookup_tcp, bpf_sk_lookup_udp, bpf_sk_release, bpf_sk_storage_get,
    },
    macros::{cgroup_sock, cgroup_sock_addr},
    programs::{SockAddrContext, SockContext},
};
use aya_log_ebpf::error;
use proxy_common::{
    AFFINITY_BY_NETNS, Addr, Backend, IPPROTO_TCP, IPPROTO_UDP, LINK_SERVICE_SOURCE, NODE_ADDR_NODEPORT, SCOPE_NODE,
    SCOPE_POD, SERVICE_FLAG_DROP_NO_ENDPOINTS, SERVICE_FLAG_EXTERNAL_ADDR, SERVICE_FLAG_SNAT, SERVICE_FLAG_SOCKET_SKIP,
    SERVICE_FLAG_SOURCE_RANGES, SOCK_QUOTA_TOTAL, SOCK_SLOTS as SLOTS_PER_SOCKET, ServiceKey, ServiceValue,
    SockRevNatKey, SockRevNatValue, SockSlot, SockSlots, SockTcp, counter, event, service_stat, sock_answer,
};

use crate::globals::{
    KPR_AGENT_CGROUP_ID, KPR_HAVE_SET_RETVAL, KPR_HOST_NETNS_COOKIE, KPR_LOCALHOST_NODEPORTS, KPR_POD_LINKS_COVERED,
    KPR_SOCK_LIMIT, KPR_SOCK_SHARE, KPR_SOCKET_LB_PODS,
};
use crate::maps::{
    SERVICES, SOCK_PICKS, SOCK_QUOTA, SOCK_REVNAT, SOCK_SLOTS, SOCK_TCP, ServiceRangeMiss, affinity_backend,
    atomic_add, backend_at, count, link_addr, netns_covered, node_addr_flags, node_source, now, refusal,
    remember_affinity, serves, service_range_miss, socket_skipped,
};
use crate::stats;

/// Return value that lets the syscall proceed.
const ALLOW: i32 = 1;
/// Return value that fails the syscall (EPERM, or the errno set with `bpf_set_retval`).
const REJECT: i32 = 0;
const ECONNREFUSED: i32 = 111;
const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
/// `BPF_F_CURRENT_NETNS`: socket lookups in the network namespace of the calling socket.
const CURRENT_NETNS: u64 = u64::MAX;

#[cgroup_sock_addr(connect4)]
pub fn kpr_connect4(ctx: SockAddrContext) -> i32 {
    forward(&ctx, SocketFamily::V4, true)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn kpr_sendmsg4(ctx: SockAddrContext) -> i32 {
    forward(&ctx, SocketFamily::V4, false)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn kpr_recvmsg4(ctx: SockAddrContext) -> i32 {
    reverse(&ctx, SocketFamily::V4)
}

#[cgroup_sock_addr(getpeername4)]
pub fn kpr_getpeername4(ctx: SockAddrContext) -> i32 {
    reverse(&ctx, SocketFamily::V4)
}

#[cgroup_sock_addr(connect6)]
pub fn kpr_connect6(ctx: SockAddrContext) -> i32 {
    forward(&ctx, SocketFamily::V6, true)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn kpr_sendmsg6(ctx: SockAddrContext) -> i32 {
    forward(&ctx, SocketFamily::V6, false)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn kpr_recvmsg6(ctx: SockAddrContext) -> i32 {
    reverse(&ctx, SocketFamily::V6)
}

#[cgroup_sock_addr(getpeername6)]
pub fn kpr_getpeername6(ctx: SockAddrContext) -> i32 {
    reverse(&ctx, SocketFamily::V6)
}

/// The socket family a hook runs for. An IPv6 socket may name an IPv4 peer (`::ffff:a.b.c.d`,
/// a dual-stack socket): the maps hold IPv4 that way, so it is balanced like an IPv4 socket.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SocketFamily {
    V4,
    V6,
}

impl SocketFamily {
    /// The address the application names (connect, sendmsg) or is shown (recvmsg, getpeername).
    #[inline(always)]
    fn user_addr(self, sa: &bpf_sock_addr) -> Addr {
        match self {
            SocketFamily::V4 => Addr::from_v4(sa.user_ip4),
            SocketFamily::V6 => Addr(sa.user_ip6),
        }
    }

    /// Write `addr` (of the family this socket can reach) where the application's address was.
    #[inline(always)]
    fn set_user_addr(self, sa: &mut bpf_sock_addr, addr: Addr) {
        match self {
            SocketFamily::V4 => sa.user_ip4 = addr.v4(),
            SocketFamily::V6 => {
                sa.user_ip6[0] = addr.0[0];
                sa.user_ip6[1] = addr.0[1];
                sa.user_ip6[2] = addr.0[2];
                sa.user_ip6[3] = addr.0[3];
            }
        }
    }
}

/// Service address:port → random backend of that service port, with the verdict kube-proxy
/// gives this socket's traffic (from the node, or from a pod). `connect`: connect4/6, else
/// sendmsg4/6.
#[inline(always)]
fn forward(ctx: &SockAddrContext, family: SocketFamily, connect: bool) -> i32 {
    // SAFETY: the kernel hands every sock_addr program a valid context.
    let sa = unsafe { &mut *ctx.sock_addr };
    let proto = sa.protocol as u8;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return ALLOW;
    }
    let host = KPR_HOST_NETNS_COOKIE.load();
    let netns = if host == 0 { 0 } else { unsafe { bpf_get_netns_cookie(ctx.as_ptr()) } };
    let from_node = host == 0 || netns == host;
    // `--socket-lb host-only`: a pod's packets are translated on its link, as kube-proxy's
    // are in PREROUTING (the agent requires a known host namespace and every link covered).
    if !from_node && KPR_SOCKET_LB_PODS.load() == 0 && netns_covered(netns) {
        return ALLOW;
    }
    let scope = if from_node { SCOPE_NODE } else { SCOPE_POD };
    let dest = family.user_addr(sa);
    let mut key = ServiceKey { addr: dest, port: sa.user_port as u16, proto, scope };
    // Not a service: one hash lookup (two for a local address) and nothing else.
    let service = match SERVICES.get_ptr(&key) {
        // SAFETY: a pointer returned by the map lookup is valid for this program run.
        Some(service) => unsafe { *service },
        None if is_node_port_address(&dest, from_node) => {
            key.addr = dest.unspecified_like();
            match SERVICES.get_ptr(&key) {
                Some(service) => unsafe { *service },
                None => return ALLOW,
            }
        }
        // A refused service range: an unknown port of a ClusterIP is rejected, an unallocated address
        // of the service range dropped.
        None => match service_range_miss(dest) {
            ServiceRangeMiss::NotInRange => return ALLOW,
            ServiceRangeMiss::Reject => refusal(0),
            ServiceRangeMiss::Drop => refusal(SERVICE_FLAG_DROP_NO_ENDPOINTS),
        },
    };
    if from_node && service.flags & SERVICE_FLAG_EXTERNAL_ADDR != 0 && is_agent() {
        count(counter::SOCK_AGENT_EXEMPT);
        return ALLOW;
    }
    // The per-packet path covers this socket's link: every link, and this pod's namespace is
    // known to be behind one (`netns_covered`: not a pod whose link appeared while no agent ran).
    let pod_links_covered = KPR_POD_LINKS_COVERED.load() != 0 && (from_node || netns_covered(netns));
    // A service the per-packet path must serve, or a pod that opted out of the socket path
    // (`kpr.io/socket-lb: "off"`, a mesh's sidecar).
    if pod_links_covered && (service.flags & SERVICE_FLAG_SOCKET_SKIP != 0 || !from_node && socket_skipped()) {
        count(counter::SOCK_STEPPED_ASIDE);
        return ALLOW;
    }
    // A pod whose link no program covers (`--interfaces`, or a link that appeared while no
    // agent ran), to a frontend that admits only some sources: connect() cannot check the
    // source (the pod's address is picked later), so it does not translate what kube-proxy
    // might drop (loadBalancerSourceRanges hold for pods too).
    if !from_node && !pod_links_covered && service.flags & SERVICE_FLAG_SOURCE_RANGES != 0 {
        count(counter::SOCK_STEPPED_ASIDE);
        return ALLOW;
    }

    if service.backends_count == 0 {
        let verdict = refuse(&service, proto, from_node, pod_links_covered);
        if connect && verdict == REJECT && !verify_probe(sa) {
            refused(&service, from_node);
        }
        return verdict;
    }

    // An unconnected UDP socket keeps the endpoint it had for this service while that endpoint
    // lasts; anything else gets a random one.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let pick_key = SockRevNatKey { cookie, addr: dest, port: key.port, _pad: [0; 6] };
    let sticky = !connect && proto == IPPROTO_UDP;
    let earlier = if sticky { SOCK_PICKS.get_ptr(&pick_key).map(|b| unsafe { *b }) } else { None };
    // sessionAffinity ClientIP: the client (this namespace: a pod, or the node) keeps its
    // backend; otherwise a random one.
    let client = Addr::from_cookie(netns);
    let now = if service.affinity_timeout == 0 { 0 } else { now() };
    let (backend, picked) = match earlier {
        Some(b) if serves(&service, &b.addr, b.port) => (b, false),
        _ => {
            let random = || backend_at(&service, unsafe { bpf_get_prandom_u32() });
            let Some(backend) = affinity_backend(&service, AFFINITY_BY_NETNS, client, now).or_else(random) else {
                error!(ctx, "kpr: service {} points at a backend slot outside the array", service.service_id);
                return ALLOW;
            };
            (backend, true)
        }
    };
    // A pod reaching itself through its service is masqueraded by kube-proxy (hairpin), which
    // connect() cannot do: leave it to the per-packet path on the pod's link.
    if !from_node && pod_links_covered && served_in_this_netns(ctx, family, proto, &backend, connect) {
        count(counter::SOCK_STEPPED_ASIDE);
        return ALLOW;
    }

    // Remember what the application asked for, so getpeername/recvmsg can show it; a socket
    // sending to the same service again finds it there already (no write per datagram). A new
    // entry takes one of the socket's slots, within its namespace's share of the table.
    let rev_key = SockRevNatKey { cookie, addr: backend.addr, port: backend.port, _pad: [0; 6] };
    let rev_value = SockRevNatValue { addr: dest, port: key.port, _pad: 0, service_id: service.service_id };
    let known = SOCK_REVNAT.get_ptr(&rev_key).is_some_and(|v| unsafe { *v } == rev_value);
    // The node (its processes and hostNetwork pods) is bound by the table's limit only: the
    // per-packet path does not translate its connections, and a pod can take none of its room.
    let share = if from_node { u32::MAX } else { KPR_SOCK_SHARE.load() };
    let netns = if netns != 0 { netns } else { unsafe { bpf_get_netns_cookie(ctx.as_ptr()) } };
    let entries = known
        // (`connect`: sendmsg hooks see UDP only, and their programs carry no TCP code.)
        || if connect && proto == IPPROTO_TCP {
            take_tcp_entry(cookie, netns, share, &backend, !verify_probe(sa))
        } else {
            take_slot(ctx, cookie, netns, share, &dest, key.port, &backend)
        };
    let mut backend = backend;
    if !entries {
        count(counter::SOCK_OVER_QUOTA);
        // A pod's connection goes per packet where that path covers it: the same translation,
        // reversed in conntrack. Else it is translated without the entries (only this
        // namespace's sockets then see the endpoint's address in getpeername and recvmsg).
        if !from_node && pod_links_covered {
            return ALLOW;
        }
        // Without a pick to keep, an unconnected socket's endpoint for this service is a hash
        // of the socket, so that its datagrams still go to one endpoint.
        if sticky && picked && service.affinity_timeout == 0 {
            let spread = (cookie ^ cookie >> 32) as u32 ^ u32::from(key.port);
            if let Some(b) = backend_at(&service, spread.wrapping_mul(0x9E37_79B1)) {
                backend = b;
            }
        }
    }
    if picked && !(connect && verify_probe(sa)) {
        remember_affinity(&service, AFFINITY_BY_NETNS, client, &backend, now);
        if sticky && entries {
            let _ = SOCK_PICKS.insert(&pick_key, &backend, 0);
        }
    }

    // The node's own connection gets the source kube-proxy's rules give it: unmasqueraded,
    // the one routing chose for the service address (its DNAT comes after that choice);
    // masqueraded, MASQUERADE's on the endpoint's link where routing toward the endpoint would
    // pick another (a pod link's link-scoped address, which MASQUERADE passes over).
    if from_node && dest.is_v4() {
        let source = if service.flags & SERVICE_FLAG_SNAT == 0 {
            Addr::from_v4(link_addr(LINK_SERVICE_SOURCE))
        } else {
            node_source(&backend.addr).unwrap_or(Addr::from_v4(0))
        };
        if source.v4() != 0 {
            keep_source(ctx, sa, family, connect, &source);
        }
    }

    if entries && !known && SOCK_REVNAT.insert(&rev_key, &rev_value, 0).is_err() {
        count(counter::REVNAT_UPDATE_FAILED);
    }

    family.set_user_addr(sa, backend.addr);
    sa.user_port = u32::from(backend.port);
    count(counter::TRANSLATED);
    if connect && !verify_probe(sa) {
        let [a, b, c, d] = backend.addr.0.map(u64::from);
        let port_proto = u32::from(backend.port) | u32::from(proto) << 16;
        stats::connect(service.service_id, a | b << 32, c | d << 32, port_proto);
    }
    ALLOW
}

/// The socket is one of `kpr verify`'s probes (`VERIFY_PROBE_PRIORITY`): decided as any, but
/// it leaves no count and no sessionAffinity pick.
#[inline(always)]
fn verify_probe(sa: &bpf_sock_addr) -> bool {
    // SAFETY: the kernel gives sock_addr programs a valid, full socket.
    unsafe { (*sa.__bindgen_anon_1.sk).priority == proxy_common::VERIFY_PROBE_PRIORITY }
}

/// The calling task is the agent (its cgroup is the agent's own).
#[inline(always)]
fn is_agent() -> bool {
    let agent = KPR_AGENT_CGROUP_ID.load();
    // SAFETY: a helper without arguments.
    agent != 0 && unsafe { bpf_get_current_cgroup_id() } == agent
}

/// A frontend without backends: kube-proxy REJECTs (no endpoints) or DROPs (traffic policy
/// Local without a local endpoint, a source outside loadBalancerSourceRanges). What a client
/// sees of that depends on where it is, and is reproduced:
/// - a pod's packet is rejected or dropped on the node: the per-packet path on its link does
///   it (when it covers the links), so the pod sees an ICMP error, a reset or nothing;
/// - the node's own TCP SYN dropped on its way out makes connect() time out: left to the
///   per-packet path, which drops it at egress; a rejected one fails with ECONNREFUSED;
/// - the node's own datagram, dropped or rejected in the OUTPUT hook, fails with EPERM.
#[inline(always)]
fn refuse(service: &ServiceValue, proto: u8, from_node: bool, pod_links_covered: bool) -> i32 {
    let drop = service.flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0;
    if pod_links_covered && (!from_node || (drop && proto == IPPROTO_TCP)) {
        count(counter::SOCK_STEPPED_ASIDE);
        return ALLOW;
    }
    if drop {
        count(counter::SOCK_DROPPED);
        return REJECT;
    }
    count(counter::NO_BACKENDS);
    if KPR_HAVE_SET_RETVAL.load() != 0 && !(from_node && proto == IPPROTO_UDP) {
        unsafe { bpf_set_retval(-ECONNREFUSED) };
    }
    REJECT
}

/// A `connect()` [`refuse`] refused, counted for its service port (at connect() only: the
/// sendmsg programs' frames are full). The node's own connection is dropped for a traffic
/// policy or a source range alike. A subprogram: its frame stays off `forward`'s.
#[inline(never)]
fn refused(service: &ServiceValue, from_node: bool) {
    let reason = match (service.flags & SERVICE_FLAG_DROP_NO_ENDPOINTS != 0, from_node) {
        (false, _) => event::REJECTED,
        (true, true) => event::DROPPED_FROM_NODE,
        (true, false) => event::DROPPED_NO_LOCAL_ENDPOINTS,
    };
    stats::update(service.service_id, service_stat::EVENTS + reason, 0, 0);
}

/// `struct sockaddr_in` for `bpf_bind`.
#[repr(C)]
struct SockaddrIn {
    family: u16,
    port: u16,
    addr: u32,
    zero: [u8; 8],
}

/// `struct sockaddr_in6` for `bpf_bind`.
#[repr(C)]
struct SockaddrIn6 {
    family: u16,
    port: u16,
    flowinfo: u32,
    addr: [u32; 4],
    scope_id: u32,
}

/// Give the socket the IPv4 source address `mapped` (an IPv4-mapped address), unless it has
/// one: bind it at connect(); set the datagram's source at sendmsg(). An IPv6 socket (reaching
/// an IPv4 service through a mapped address) gets it mapped.
#[inline(always)]
fn keep_source(ctx: &SockAddrContext, sa: &mut bpf_sock_addr, family: SocketFamily, connect: bool, mapped: &Addr) {
    if connect {
        // A socket bound already keeps its address (the helper fails with EINVAL).
        let _ = bind_address(ctx, family, mapped);
    } else {
        match family {
            SocketFamily::V4 if sa.msg_src_ip4 == 0 => sa.msg_src_ip4 = mapped.v4(),
            SocketFamily::V6 if sa.msg_src_ip6 == [0; 4] => {
                sa.msg_src_ip6[0] = mapped.0[0];
                sa.msg_src_ip6[1] = mapped.0[1];
                sa.msg_src_ip6[2] = mapped.0[2];
                sa.msg_src_ip6[3] = mapped.0[3];
            }
            _ => {}
        }
    }
}

/// Bind the connecting socket to `addr` (IPv4 mapped for an IPv4 socket), its port left to
/// connect() (`bpf_bind` with port 0): 0, or `-EADDRNOTAVAIL` when `addr` is not one of its
/// network namespace's, `-EINVAL` when the socket is bound already. connect4/6 only.
#[inline(always)]
fn bind_address(ctx: &SockAddrContext, family: SocketFamily, addr: &Addr) -> i64 {
    match family {
        SocketFamily::V4 => {
            let mut sa = SockaddrIn { family: AF_INET, port: 0, addr: addr.v4(), zero: [0; 8] };
            unsafe { bpf_bind(ctx.sock_addr, (&raw mut sa).cast::<sockaddr>(), size_of::<SockaddrIn>() as i32) }
        }
        SocketFamily::V6 => {
            let mut sa = SockaddrIn6 { family: AF_INET6, port: 0, flowinfo: 0, addr: addr.0, scope_id: 0 };
            unsafe { bpf_bind(ctx.sock_addr, (&raw mut sa).cast::<sockaddr>(), size_of::<SockaddrIn6>() as i32) }
        }
    }
}

/// A NodePort frontend for this socket: one of the node's NodePort addresses, or (from the
/// node, with localhostNodePorts) any 127.0.0.0/8 address. IPv6 has no localhost NodePorts
/// (kube-proxy offers none: `::1` cannot be routed out).
#[inline(always)]
fn is_node_port_address(addr: &Addr, from_node: bool) -> bool {
    if from_node && KPR_LOCALHOST_NODEPORTS.load() != 0 && addr.is_v4() && u32::from_be(addr.v4()) >> 24 == 127 {
        return true;
    }
    node_addr_flags(addr) & NODE_ADDR_NODEPORT != 0
}

/// A socket in the caller's own network namespace serves `backend`, at an address of that
/// namespace: the backend is this pod. A listener on the wildcard address answers the lookup
/// for any address, also another pod's; then the address must be this namespace's own, which
/// binding the connecting socket to it tells (it fails for an address that is not; where it
/// succeeds it binds the source routing picks for a connection to the pod itself). A datagram
/// (sendmsg cannot bind) and a socket bound already are told by the lookup alone.
#[inline(always)]
fn served_in_this_netns(
    ctx: &SockAddrContext,
    family: SocketFamily,
    proto: u8,
    backend: &Backend,
    connect: bool,
) -> bool {
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let size = if backend.addr.is_v4() {
        tuple.__bindgen_anon_1.ipv4 = bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1 {
            saddr: 0,
            daddr: backend.addr.v4(),
            sport: 0,
            dport: backend.port,
        };
        size_of::<bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1>()
    } else {
        tuple.__bindgen_anon_1.ipv6 = bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2 {
            saddr: [0; 4],
            daddr: backend.addr.0,
            sport: 0,
            dport: backend.port,
        };
        size_of::<bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2>()
    } as u32;
    let sk = unsafe {
        if proto == IPPROTO_TCP {
            bpf_sk_lookup_tcp(ctx.as_ptr(), &mut tuple, size, CURRENT_NETNS, 0)
        } else {
            bpf_sk_lookup_udp(ctx.as_ptr(), &mut tuple, size, CURRENT_NETNS, 0)
        }
    };
    if sk.is_null() {
        return false;
    }
    // SAFETY: a socket the lookup returned, released below.
    let wildcard = unsafe { if backend.addr.is_v4() { (*sk).src_ip4 == 0 } else { (*sk).src_ip6 == [0; 4] } };
    unsafe { bpf_sk_release(sk as *mut _) };
    if !wildcard || !connect {
        return true;
    }
    const EADDRNOTAVAIL: i64 = 99;
    bind_address(ctx, family, &backend.addr) != -EADDRNOTAVAIL
}

/// Take a slot of this socket's for a new entry in `SOCK_REVNAT` (and `SOCK_PICKS`): the one it
/// has for this service address, a free one within its namespace's share, or its oldest, whose
/// entries go. False: none (the share or the table's limit is reached; the socket's storage
/// could not be made).
#[inline(always)]
fn take_slot(
    ctx: &SockAddrContext,
    cookie: u64,
    netns: u64,
    share: u32,
    frontend: &Addr,
    frontend_port: u16,
    backend: &Backend,
) -> bool {
    let slots = SOCK_SLOTS.get_or_insert_ptr_mut(ctx, None);
    if slots.is_null() {
        return false;
    }
    // SAFETY: this socket's storage; a socket's hooks may run on two CPUs at once (two
    // threads sending), which at worst leaves a count one off (see `SOCK_QUOTA`).
    let slots = unsafe { &mut *slots };
    let new =
        SockSlot { frontend: *frontend, backend: backend.addr, frontend_port, backend_port: backend.port, _pad: 0 };
    let used = slots.used.min(SLOTS_PER_SOCKET as u32);
    for (i, slot) in slots.slots.iter_mut().enumerate() {
        if (i as u32) < used && slot.frontend == *frontend && slot.frontend_port == frontend_port {
            // Its pick stays (the caller writes the new one, if any); its reverse entry goes
            // where the endpoint changed.
            if slot.backend != new.backend || slot.backend_port != new.backend_port {
                drop_reverse(cookie, slot);
            }
            *slot = new;
            return true;
        }
    }
    let index = if (used as usize) < SLOTS_PER_SOCKET {
        if slots.netns == 0 {
            slots.netns = netns;
        }
        if !charge(slots.netns, share) {
            return false;
        }
        slots.used = used + 1;
        used
    } else {
        let oldest = slots.next % SLOTS_PER_SOCKET as u32;
        slots.next = (oldest + 1) % SLOTS_PER_SOCKET as u32;
        oldest
    };
    // The index masked where the verifier sees it: the compiler knows it is below 8 and drops
    // any check, and older verifiers (6.1) lose that bound across the two branches above.
    // SAFETY: a local variable.
    let index = unsafe { core::ptr::read_volatile(&index) } & (SLOTS_PER_SOCKET as u32 - 1);
    if let Some(slot) = slots.slots.get_mut(index as usize) {
        if index < used {
            drop_entries(cookie, slot);
        }
        *slot = new;
    }
    true
}

/// Remove a slot's entries: its pick and its reverse entry.
#[inline(always)]
fn drop_entries(cookie: u64, slot: &SockSlot) {
    drop_reverse(cookie, slot);
    let _ = SOCK_PICKS.remove(&SockRevNatKey { cookie, addr: slot.frontend, port: slot.frontend_port, _pad: [0; 6] });
}

/// Remove a slot's reverse entry where that still names the slot's service address (two
/// services' addresses sent to one endpoint share one).
#[inline(always)]
fn drop_reverse(cookie: u64, slot: &SockSlot) {
    let rev_key = SockRevNatKey { cookie, addr: slot.backend, port: slot.backend_port, _pad: [0; 6] };
    if SOCK_REVNAT
        .get_ptr(&rev_key)
        .is_some_and(|v| unsafe { (*v).addr == slot.frontend && (*v).port == slot.frontend_port })
    {
        let _ = SOCK_REVNAT.remove(&rev_key);
    }
}

/// A TCP socket's one entry, counted once however often it connects (a failed connect
/// retried on the same socket): one it had for another endpoint goes. `watched`: its
/// endpoint's answer is to be counted (`kpr_sock_ops`).
#[inline(always)]
fn take_tcp_entry(cookie: u64, netns: u64, share: u32, backend: &Backend, watched: bool) -> bool {
    let answer = if watched { sock_answer::WAITING } else { sock_answer::NONE };
    let entry = SockTcp { netns, backend: backend.addr, backend_port: backend.port, answer, _pad: [0; 5] };
    if let Some(earlier) = SOCK_TCP.get_ptr_mut(&cookie) {
        // SAFETY: a map value of this run.
        let earlier = unsafe { &mut *earlier };
        let _ = SOCK_REVNAT.remove(&SockRevNatKey {
            cookie,
            addr: earlier.backend,
            port: earlier.backend_port,
            _pad: [0; 6],
        });
        earlier.backend = entry.backend;
        earlier.backend_port = entry.backend_port;
        earlier.answer = entry.answer;
        return true;
    }
    if !charge(netns, share) {
        return false;
    }
    if SOCK_TCP.insert(&cookie, &entry, 0).is_err() {
        uncharge(netns, 1);
        return false;
    }
    true
}

/// Count one entry more for `netns`, unless it holds `share` or the node its limit.
#[inline(always)]
fn charge(netns: u64, share: u32) -> bool {
    let (Some(total), Some(mine)) = (quota_count(SOCK_QUOTA_TOTAL), quota_count(netns)) else {
        return false;
    };
    // SAFETY: map values of this run, 8-byte aligned.
    let (held_total, held_mine) = unsafe { (total.read_volatile() as i64, mine.read_volatile() as i64) };
    if held_total >= i64::from(KPR_SOCK_LIMIT.load()) || held_mine >= i64::from(share) {
        return false;
    }
    atomic_add(total, 1);
    atomic_add(mine, 1);
    true
}

/// Count `n` entries fewer for `netns` (a count the LRU evicted is not made again).
#[inline(always)]
fn uncharge(netns: u64, n: u32) {
    if n == 0 {
        return;
    }
    let minus = u64::from(n).wrapping_neg();
    if let Some(total) = SOCK_QUOTA.get_ptr_mut(&SOCK_QUOTA_TOTAL) {
        atomic_add(total, minus);
    }
    if let Some(mine) = SOCK_QUOTA.get_ptr_mut(&netns) {
        atomic_add(mine, minus);
    }
}

/// The count of `key` in `SOCK_QUOTA`, made at 0 if it has none.
#[inline(always)]
fn quota_count(key: u64) -> Option<*mut u64> {
    SOCK_QUOTA.get_ptr_mut(&key).or_else(|| {
        const NOEXIST: u64 = 1;
        // The 0 on the stack, written there: a reference to a constant 0 is folded into one to
        // a global whose initial value is 0, which the loader overwrites (`socket_skipped`).
        let mut zero = 1u64;
        // SAFETY: a local variable.
        unsafe { core::ptr::write_volatile(&mut zero, 0) };
        let _ = SOCK_QUOTA.insert(&key, &zero, NOEXIST);
        SOCK_QUOTA.get_ptr_mut(&key)
    })
}

/// A map's address, as helpers take it.
#[inline(always)]
fn map_ptr<T>(map: &T) -> *mut core::ffi::c_void {
    core::ptr::from_ref(map).cast_mut().cast()
}

/// Backend address seen by the socket → the service address the application connected to.
#[inline(always)]
fn reverse(ctx: &SockAddrContext, family: SocketFamily) -> i32 {
    let sa = unsafe { &mut *ctx.sock_addr };
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let key = SockRevNatKey { cookie, addr: family.user_addr(sa), port: sa.user_port as u16, _pad: [0; 6] };
    if let Some(orig) = SOCK_REVNAT.get_ptr(&key) {
        let orig = unsafe { *orig };
        family.set_user_addr(sa, orig.addr);
        sa.user_port = u32::from(orig.port);
        count(counter::REVERSE_TRANSLATED);
    }
    ALLOW
}

/// A socket goes away: the entries it holds go with it (a UDP socket's slots, a TCP socket's
/// one entry), and its namespace's count with them. A socket of before the slots (an older
/// layout's) has at most its peer's entry (a connected socket: the endpoint it was given),
/// removed as it always was.
#[cgroup_sock(sock_release)]
pub fn kpr_sock_release(ctx: SockContext) -> i32 {
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if let Some(tcp) = SOCK_TCP.get_ptr(&cookie) {
        // SAFETY: a map value, copied at once.
        let tcp = unsafe { *tcp };
        let _ = SOCK_REVNAT.remove(&SockRevNatKey { cookie, addr: tcp.backend, port: tcp.backend_port, _pad: [0; 6] });
        // Counted down by whoever removes it (two release programs run during a restart).
        if SOCK_TCP.remove(&cookie).is_ok() {
            uncharge(tcp.netns, 1);
        }
        return ALLOW;
    }
    // SAFETY: a cgroup sock program's context is the socket the helper takes; no value is made.
    let slots = unsafe { bpf_sk_storage_get(map_ptr(&SOCK_SLOTS), ctx.as_ptr(), core::ptr::null_mut(), 0) };
    if !slots.is_null() {
        // SAFETY: this socket's storage, of the map's value type.
        let slots = unsafe { &mut *slots.cast::<SockSlots>() };
        let used = slots.used.min(SLOTS_PER_SOCKET as u32);
        // Emptied first: a second release program (during a restart) finds nothing to count.
        slots.used = 0;
        for slot in slots.slots.iter().take(used as usize) {
            drop_entries(cookie, slot);
        }
        uncharge(slots.netns, used);
        return ALLOW;
    }
    // SAFETY: the kernel hands a valid socket.
    let sk = ctx.sock;
    // dst_port as a 32-bit load: older kernels allow nothing narrower; the port (network byte
    // order) is its low half either way.
    let port = unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*sk).dst_port).cast::<u32>()) } as u16;
    // An IPv6 socket's peer, IPv4 ones mapped, is in dst_ip6 (even for an IPv4 peer).
    let addr = unsafe {
        if (*sk).family == u32::from(AF_INET6) {
            let d = core::ptr::addr_of!((*sk).dst_ip6);
            Addr([
                core::ptr::read_volatile(d.cast::<u32>()),
                core::ptr::read_volatile(d.cast::<u32>().add(1)),
                core::ptr::read_volatile(d.cast::<u32>().add(2)),
                core::ptr::read_volatile(d.cast::<u32>().add(3)),
            ])
        } else {
            Addr::from_v4((*sk).dst_ip4)
        }
    };
    if !addr.is_unspecified() {
        let _ = SOCK_REVNAT.remove(&SockRevNatKey { cookie, addr, port, _pad: [0; 6] });
    }
    ALLOW
}
