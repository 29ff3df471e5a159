//! The settings the agent writes into the object before it loads it (`EbpfLoader::set_global`),
//! all in one place: each is read as the program runs and never written by it.
use aya_ebpf::Global;
use proxy_common::{CtTimeouts, SNAT_PORT_MAX, SNAT_PORT_MIN};

// The socket hooks (`sock_lb`).

/// 1 when the kernel has `bpf_set_retval` for sock_addr hooks (5.18+). Set by the agent at load
/// time; on older kernels the helper call is dead code the verifier never sees, and a refused
/// connect surfaces as EPERM instead of ECONNREFUSED.
#[unsafe(no_mangle)]
pub static KPR_HAVE_SET_RETVAL: Global<u8> = Global::new(1);

/// Network namespace cookie of the node (the agent's namespace); sockets in it are "from the
/// node", others are pods'. 0: unknown, every socket counts as the node's.
#[unsafe(no_mangle)]
pub static KPR_HOST_NETNS_COOKIE: Global<u64> = Global::new(0);

/// 1 when the per-packet path covers the links pods reach the node by: a pod's connection can
/// be left to it (`SERVICE_FLAG_SOCKET_SKIP`, a pod reaching itself). 0: the socket path
/// translates everything it can.
#[unsafe(no_mangle)]
pub static KPR_POD_LINKS_COVERED: Global<u8> = Global::new(0);

/// 0 with `--socket-lb host-only`: the hooks leave pods' sockets alone, and the per-packet
/// path on their links serves them (a mesh sidecar that redirects a pod's traffic then sees
/// the Service's address, as behind kube-proxy). 1: pods' sockets are translated too.
#[unsafe(no_mangle)]
pub static KPR_SOCKET_LB_PODS: Global<u8> = Global::new(1);

/// 1 when NodePorts answer on 127.0.0.0/8 for the node's own sockets (`localhostNodePorts`).
#[unsafe(no_mangle)]
pub static KPR_LOCALHOST_NODEPORTS: Global<u8> = Global::new(0);

/// cgroup id of the agent when it is alone in its cgroup (a DaemonSet's container): its
/// sockets are not translated to externalIPs and LoadBalancer IPs. 0: no exemption.
#[unsafe(no_mangle)]
pub static KPR_AGENT_CGROUP_ID: Global<u64> = Global::new(0);

/// The reverse-translation entries one network namespace's sockets may hold (a pod's share),
/// and those all may hold (the table's size less room the LRU's per-CPU lists keep): beyond
/// them, a connection is left to the per-packet path. Set by the agent at load time.
#[unsafe(no_mangle)]
pub static KPR_SOCK_SHARE: Global<u32> = Global::new(u32::MAX);

#[unsafe(no_mangle)]
pub static KPR_SOCK_LIMIT: Global<u32> = Global::new(u32::MAX);

/// 1 with `--endpoint-counters`: new flows, connects, unanswered flows, packets and bytes are
/// counted per endpoint too (`KPR_ENDPOINT_STATS`). 0: that code is dead, and the verifier
/// drops it. Set by the agent at load time.
#[unsafe(no_mangle)]
pub static KPR_ENDPOINT_COUNTERS: Global<u8> = Global::new(0);

// The per-packet programs (`tc`).

/// The SNAT port range, disjoint from the node's ephemeral ports; set by the agent at load.
#[unsafe(no_mangle)]
pub static KPR_SNAT_PORT_MIN: Global<u16> = Global::new(SNAT_PORT_MIN);

#[unsafe(no_mangle)]
pub static KPR_SNAT_PORT_MAX: Global<u16> = Global::new(SNAT_PORT_MAX);

/// How pods are told from other sources (`DETECT_LOCAL_*`); set by the agent at load time.
#[unsafe(no_mangle)]
pub static KPR_DETECT_LOCAL: Global<u8> = Global::new(0);

/// Flow lifetimes by state; set by the agent at load time.
#[unsafe(no_mangle)]
pub static KPR_CT_TIMEOUTS: Global<CtTimeouts> = Global::new(CtTimeouts::DEFAULT);

/// Seed of the flow hash (backend and SNAT port choice); set by the agent at load time, the
/// same for every agent of one boot so that a restarted agent re-creates flows as they were.
#[unsafe(no_mangle)]
pub static KPR_FLOW_HASH_SEED: Global<u32> = Global::new(0);

/// Seed of the Maglev tuple hash (`SERVICE_FLAG_MAGLEV`): the cluster's (`--maglev-seed`), the
/// same on every node, so that every node sends a tuple to the same slot.
#[unsafe(no_mangle)]
pub static KPR_MAGLEV_SEED: Global<u32> = Global::new(0);

/// Slots of every Maglev table (`--maglev-table-size`, a prime): the same on every node.
#[unsafe(no_mangle)]
pub static KPR_MAGLEV_TABLE_SIZE: Global<u32> = Global::new(proxy_common::MAGLEV_DEFAULT_TABLE_SIZE);

/// Where the kernel's `sk_buff` keeps `ip_summed` (the packet's checksum state), as
/// `byte << 8 | bit`; set by the agent from the kernel's BTF where the programs may read it
/// (6.2+: `bpf_cast_to_kern_ctx`). 0: they may not, and the checksum helper decides.
#[unsafe(no_mangle)]
pub static KPR_IP_SUMMED_AT: Global<u32> = Global::new(0);

/// 1: a packet translated on its way in is sent straight out of the link its route leaves by;
/// 0: it goes on through the host's forwarding path (`--host-routing`). Set by the agent.
#[unsafe(no_mangle)]
pub static KPR_FORWARD_DIRECT: Global<u8> = Global::new(1);

/// 1 (6.3+, set by the agent): the route lookup skips the neighbour table and hands its next
/// hop to `bpf_redirect_neigh`, which then resolves the neighbour without a second route
/// lookup of its own. 0: the lookup finds the neighbour and the redirect routes again.
#[unsafe(no_mangle)]
pub static KPR_REDIRECT_NEXT_HOP: Global<u8> = Global::new(0);
