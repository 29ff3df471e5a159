//! Loading, pinning and attaching the eBPF programs, and the kernel implementation of [`Maps`].
//!
//! Everything lives under a versioned pin directory (`<pin-root>/v<N>`): the maps (by name) and
//! one link per cgroup hook. A restarted agent (also after `kill -9`) reuses the pinned maps
//! with their contents and swaps its freshly loaded programs into the pinned links in place
//! (BPF_LINK_UPDATE), so established connections and the service table are never interrupted.
use std::{
    borrow::BorrowMut,
    collections::{BTreeMap, BTreeSet},
    fs::{self, File},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, HashMap, IterableMap as _, LpmTrie, Map, MapData, PerCpuArray, ProgramArray, lpm_trie::Key as LpmKey,
    },
    programs::{
        CgroupAttachMode, CgroupSockAddr, NetworkInterface, SchedClassifier, TcAttachType,
        cgroup_sock_addr::CgroupSockAddrLink,
        links::{FdLink, PinnedLink},
        tc::SchedClassifierLink,
    },
    util::KernelVersion,
};
use proxy_common::{
    Addr, Backend, CidrKey, CidrMask, CtTimeouts, LinkInfo, PIN_LAYOUT_VERSION, ServiceKey, ServiceValue,
    SockRevNatKey, SockRevNatValue, SourceRange, counter, defaults, map_names, program_names,
};

use super::{BatchError, Capacity, Maps, conntrack::Conntrack};
use crate::model::{cidr::Cidr, node::NodePlan};

/// The eBPF object built from `proxy-ebpf` by build.rs.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy"));

/// The socket hooks of both families (an IPv6 socket's hooks also see its IPv4-mapped peers).
const HOOKS: [&str; 8] = [
    program_names::CONNECT4,
    program_names::SENDMSG4,
    program_names::RECVMSG4,
    program_names::GETPEERNAME4,
    program_names::CONNECT6,
    program_names::SENDMSG6,
    program_names::RECVMSG6,
    program_names::GETPEERNAME6,
];

/// Where and how big: the datapath's start-up settings.
#[derive(Clone, Debug)]
pub struct DatapathConfig {
    /// bpffs directory for kpr's pins; the layout version is appended.
    pub pin_root: PathBuf,
    /// cgroup2 directory whose sockets are load-balanced (the cgroup2 root covers the node).
    pub cgroup: PathBuf,
    pub max_service_ports: u32,
    pub max_backends: u32,
    pub max_sock_revnat: u32,
    /// Entries of the loadBalancerSourceRanges map.
    pub max_source_ranges: u32,
    /// Entries of each family's conntrack table of established flows.
    pub max_conntrack: u32,
    /// Entries of each family's conntrack table of flows not answered yet.
    pub max_conntrack_new: u32,
    /// How the per-packet path tells local pods from other sources (`DETECT_LOCAL_*`).
    pub detect_local: u8,
    /// NodePorts answer on 127.0.0.0/8 for the node's own sockets (`localhostNodePorts`).
    pub localhost_node_ports: bool,
    /// The per-packet path covers every link (pods' links included): the socket path may leave
    /// a pod's connection to it.
    pub pod_links_covered: bool,
    /// What no service port takes in the service range is refused (kube-proxy's nftables mode).
    pub refuse_service_range: bool,
    /// Per-packet flow lifetimes, by state.
    pub ct_timeouts: CtTimeouts,
    /// First and last SNAT port (host byte order).
    pub snat_ports: (u16, u16),
    /// Attach the per-packet programs as netlink tc filters even where TCX exists.
    pub tc_netlink: bool,
    /// When packets translated on their way in are sent straight out of their link, past the
    /// host's forwarding path.
    pub forward_direct: ForwardDirect,
    /// cgroup id whose sockets are not translated to externalIPs and LoadBalancer IPs (the
    /// agent's own, see [`agent_cgroup_id`]); 0: none.
    pub agent_cgroup_id: u64,
}

impl DatapathConfig {
    pub fn new(pin_root: PathBuf, cgroup: PathBuf) -> Self {
        Self {
            pin_root,
            cgroup,
            max_service_ports: defaults::MAX_SERVICE_PORTS,
            max_backends: defaults::MAX_BACKENDS,
            max_sock_revnat: defaults::MAX_SOCK_REVNAT,
            max_source_ranges: defaults::MAX_SOURCE_RANGES,
            max_conntrack: defaults::MAX_CONNTRACK,
            max_conntrack_new: defaults::MAX_CONNTRACK_NEW,
            detect_local: proxy_common::DETECT_LOCAL_NONE,
            localhost_node_ports: false,
            pod_links_covered: false,
            // The agent's own default is `Auto` (its flag), which needs its watch of the host
            // to write `KPR_HOST_STATE`; a datapath loaded without one forwards directly.
            forward_direct: ForwardDirect::Always,
            agent_cgroup_id: 0,
            refuse_service_range: false,
            ct_timeouts: CtTimeouts::DEFAULT,
            snat_ports: snat_port_range(),
            tc_netlink: false,
        }
    }
}

/// When a packet translated on its way in may skip the host's forwarding path (netfilter's
/// forward hook, where NetworkPolicy engines such as Calico's iptables dataplane enforce) and
/// be sent straight out of its link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ForwardDirect {
    /// Only while nothing filters forwarded packets on the host (the agent checks every
    /// second, [`crate::source::firewall`]).
    Auto,
    /// Even where something does: a NetworkPolicy in the FORWARD chain does not hold for
    /// Service traffic then.
    Always,
    /// Never: every translated packet takes the host's forwarding path.
    Never,
}

/// Tell the programs whether translated packets may skip the host's forwarding path now
/// (`KPR_HOST_STATE`, read per packet; [`ForwardDirect::Auto`]'s runtime switch).
pub fn set_host_forward_direct<T: BorrowMut<MapData>>(map: &mut Array<T, u32>, ok: bool) -> Result<()> {
    let state = if ok { proxy_common::HOST_FORWARD_DIRECT_OK } else { 0 };
    map.set(0, &state, 0).context("failed to write KPR_HOST_STATE")
}

/// The pinned `KPR_HOST_STATE` map.
pub fn open_host_state(pin_root: &Path) -> Result<Array<MapData, u32>> {
    Ok(Array::try_from(Map::Array(open_pinned_map(pin_root, map_names::HOST_STATE)?))?)
}

/// A pin root someone else created (or can write) could hand kpr maps and links it does not
/// control: refuse it.
fn check_owner(pin_root: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(meta) = fs::metadata(pin_root) else { return Ok(()) }; // created below, by us
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        bail!(
            "the pin root {} belongs to uid {}, not to this agent (uid {me}); remove it or choose another --pin-root",
            pin_root.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o022 != 0 {
        bail!(
            "the pin root {} can be written by others (mode {:o}); remove it or choose another --pin-root",
            pin_root.display(),
            meta.mode() & 0o777
        );
    }
    Ok(())
}

/// Held while an agent runs on a pin root (an abstract unix socket, released with the
/// process): `kpr cleanup` refuses to pull the datapath from under a running agent.
pub struct AgentLock(#[allow(dead_code)] std::os::unix::net::UnixListener);

impl AgentLock {
    fn name(pin_root: &Path) -> Vec<u8> {
        format!("kpr-agent:{}", pin_root.display()).into_bytes()
    }

    pub fn acquire(pin_root: &Path) -> Result<Self> {
        use std::os::linux::net::SocketAddrExt as _;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(Self::name(pin_root))?;
        match std::os::unix::net::UnixListener::bind_addr(&addr) {
            Ok(l) => Ok(Self(l)),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                bail!("another kpr agent runs on {} (in this network namespace)", pin_root.display())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// An agent holds the lock of `pin_root`.
    pub fn held(pin_root: &Path) -> bool {
        Self::acquire(pin_root).is_err()
    }
}

/// The seed of the per-packet path's flow hash: the same for every agent of this boot (a
/// restarted agent re-creates lost flows as they were), unknown off the node.
pub fn flow_hash_seed() -> u32 {
    let boot_id = fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    // FNV-1a: stable across builds (std's hasher is not).
    boot_id.trim().bytes().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// `<pin-root>/v<layout version>`
pub fn pin_dir(pin_root: &Path) -> PathBuf {
    pin_root.join(format!("v{PIN_LAYOUT_VERSION}"))
}

/// The pinned map `name` under `pin_root` (the versioned pin directory). Without kpr's pins
/// there, the error says what is there instead.
pub fn open_pinned_map(pin_root: &Path, name: &str) -> Result<MapData> {
    if let Some(problem) = pins_missing(pin_root) {
        bail!("{problem}");
    }
    let path = pin_dir(pin_root).join(name);
    MapData::from_pin(&path).with_context(|| format!("no pinned map {}", path.display()))
}

/// Why `pin_root` holds no datapath of this kpr's layout, if it does not: for read commands
/// on a node where kpr does not run (or another version of it does).
pub fn pins_missing(pin_root: &Path) -> Option<String> {
    if !pin_root.exists() {
        return Some(format!(
            "no kpr datapath on this node: {} does not exist (kpr has not run here, or with another --pin-root)",
            pin_root.display()
        ));
    }
    if pin_dir(pin_root).exists() {
        return None;
    }
    let others = other_layout_names(pin_root);
    Some(if others.is_empty() {
        format!("no kpr datapath under {} (no layout directory)", pin_root.display())
    } else {
        format!(
            "no pins of this kpr's layout (v{PIN_LAYOUT_VERSION}) under {}: it holds {} (another kpr version's)",
            pin_root.display(),
            others.join(", ")
        )
    })
}

/// The pin layout directories under `pin_root` other than this kpr's, as `v<N>`.
pub fn other_layout_names(pin_root: &Path) -> Vec<String> {
    let mut names: Vec<(u32, String)> =
        other_layouts(pin_root).into_iter().map(|(v, _)| (v, format!("v{v}"))).collect();
    names.sort();
    names.into_iter().map(|(_, n)| n).collect()
}

/// The cgroup2 mount point, from /proc/self/mounts (hybrid hierarchies put it elsewhere than
/// /sys/fs/cgroup).
pub fn cgroup2_root() -> Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts")?;
    mounts
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 2 && f[2] == "cgroup2")
        .map(|f| PathBuf::from(f[1]))
        .context("no cgroup2 file system is mounted")
}

/// The cgroup2 directory `--cgroup` names: the directory itself, or, when it is a hybrid host's
/// `/sys/fs/cgroup` (a tmpfs of cgroup v1 hierarchies, as a DaemonSet mounts the host's), the
/// cgroup2 hierarchy systemd puts in its `unified` directory.
pub fn cgroup2_dir(path: &Path) -> Result<PathBuf> {
    // f_type is signed in glibc and unsigned in musl (the image's build).
    #[allow(clippy::unnecessary_cast, reason = "the cast is needed in one of the two libcs")]
    let is_cgroup2 = |dir: &Path| -> bool {
        let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { return false };
        // SAFETY: a valid C string and a zeroed statfs for the kernel to fill.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
            return false;
        }
        st.f_type as u64 == libc::CGROUP2_SUPER_MAGIC as u64
    };
    if is_cgroup2(path) {
        return Ok(path.to_owned());
    }
    let unified = path.join("unified");
    if is_cgroup2(&unified) {
        return Ok(unified);
    }
    bail!("{} is not a cgroup2 directory (nor a hybrid cgroup mount with one in `unified`)", path.display())
}

#[cfg(test)]
mod cgroup_tests {
    use super::*;

    #[test]
    fn cgroup_flag_takes_a_cgroup2_directory_or_a_hybrid_hosts_unified_one() {
        let root = cgroup2_root().expect("a cgroup2 mount");
        assert_eq!(cgroup2_dir(&root).unwrap(), root);
        // On a hybrid host (this machine), its parent is the v1 tmpfs a DaemonSet mounts.
        if root.ends_with("unified") {
            assert_eq!(cgroup2_dir(root.parent().unwrap()).unwrap(), root);
        }
        let err = cgroup2_dir(Path::new("/proc")).unwrap_err().to_string();
        assert!(err.contains("/proc is not a cgroup2 directory"), "{err}");
    }
}

/// This process's cgroup2 directory.
pub fn own_cgroup() -> Result<PathBuf> {
    let text = fs::read_to_string("/proc/self/cgroup")?;
    let rel = text.lines().find_map(|l| l.strip_prefix("0::")).context("no cgroup2 entry in /proc/self/cgroup")?;
    Ok(cgroup2_root()?.join(rel.trim_start_matches('/')))
}

/// The id of this process's cgroup when the process is alone in it (a DaemonSet's container),
/// so that exempting the cgroup from translation exempts the agent and nothing else.
/// `Ok(None)` when other processes share it (a shell's session on a dev node).
pub fn agent_cgroup_id() -> Result<Option<u64>> {
    let dir = own_cgroup()?;
    let procs = fs::read_to_string(dir.join("cgroup.procs"))
        .with_context(|| format!("failed to read {}", dir.join("cgroup.procs").display()))?;
    let me = std::process::id().to_string();
    if procs.lines().any(|pid| pid != me) {
        return Ok(None);
    }
    // A cgroup's id, as bpf_get_current_cgroup_id returns it, is its directory's inode number.
    let id = std::os::unix::fs::MetadataExt::ino(&fs::metadata(&dir)?);
    Ok(Some(id))
}

/// kube-proxy's default NodePort range, which operators keep free of other uses
/// (`ip_local_reserved_ports`): masquerade stays out of it too.
const NODE_PORT_RANGE: (u16, u16) = (30_000, 32_767);

/// The SNAT port range: the largest run of ports from 1024 up that is neither the node's
/// ephemeral range (`ip_local_port_range`: no connection of the node's own ever shares a port
/// with a masqueraded flow, or the replies of one would be taken for the other's) nor the
/// NodePort range. With Linux's defaults: 1024–29999.
pub fn snat_port_range() -> (u16, u16) {
    let ephemeral = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok().and_then(|text| {
        let mut it = text.split_whitespace().filter_map(|p| p.parse::<u16>().ok());
        Some((it.next()?, it.next()?))
    });
    let ephemeral = ephemeral.unwrap_or((32_768, 60_999));
    let range = largest_free_run(&[ephemeral, NODE_PORT_RANGE]);
    if u32::from(range.1) - u32::from(range.0) < 1023 {
        tracing::warn!(
            ?range,
            ?ephemeral,
            "fewer than 1024 ports are free for masquerade; masqueraded flows may run out of ports"
        );
    }
    range
}

/// The largest run of ports in 1024–65535 outside every range of `taken`.
fn largest_free_run(taken: &[(u16, u16)]) -> (u16, u16) {
    let mut best = (proxy_common::SNAT_PORT_MIN, proxy_common::SNAT_PORT_MAX);
    let mut best_len = 0u32;
    let mut start = 1024u32;
    let mut edges: Vec<(u32, u32)> = taken.iter().map(|&(a, b)| (u32::from(a.min(b)), u32::from(a.max(b)))).collect();
    edges.sort();
    edges.push((65_536, 65_536));
    for (first, last) in edges {
        if first > start && first - start > best_len {
            best_len = first - start;
            best = (start as u16, (first - 1) as u16);
        }
        start = start.max(last + 1);
    }
    best
}

#[cfg(test)]
mod snat_range_tests {
    use super::largest_free_run;

    #[test]
    fn masquerade_takes_the_largest_run_outside_ephemeral_and_node_ports() {
        assert_eq!(largest_free_run(&[(32_768, 60_999), (30_000, 32_767)]), (1024, 29_999));
        // A node that moved its ephemeral ports low: masquerade goes above them.
        assert_eq!(largest_free_run(&[(1024, 29_999), (30_000, 32_767)]), (32_768, 65_535));
        assert_eq!(largest_free_run(&[(10_000, 65_000), (30_000, 32_767)]), (1024, 9_999));
        assert_eq!(largest_free_run(&[(40_000, 50_000)]), (1024, 39_999));
    }
}

/// The cookie of this process's network namespace (SO_NETNS_COOKIE, 5.14+): sockets in it are
/// the node's. `None` when the kernel cannot tell.
pub fn netns_cookie() -> Option<u64> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").ok()?;
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
    let rc = unsafe {
        libc::getsockopt(socket.as_raw_fd(), libc::SOL_SOCKET, 71, (&mut cookie as *mut u64).cast(), &mut len)
    };
    (rc == 0 && cookie != 0).then_some(cookie)
}

/// The service maps, and the host side (programs, links, node maps).
pub struct BpfDatapath {
    pub maps: BpfMaps,
    pub host: BpfHost,
}

/// The running kernel is `major.minor` or later.
pub(crate) fn kernel_since(major: u8, minor: u8) -> bool {
    KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(major, minor, 0))
}

/// Where the programs may read an skb's checksum state themselves (6.2+): the id of the kfunc
/// `bpf_cast_to_kern_ctx`, and `sk_buff.ip_summed` as `byte << 8 | bit`. Then a translated
/// packet whose checksum is complete is fixed in place, without the checksum helper's call.
fn kernel_skb_checksum_state() -> Option<(u32, u32)> {
    if !kernel_since(6, 2) {
        return None;
    }
    let btf = super::kernel_btf::KernelBtf::from_sys_fs()
        .inspect_err(|e| {
            tracing::info!("the kernel's BTF is unreadable ({e:#}): the checksum helper fixes every packet")
        })
        .ok()?;
    let (Some(kfunc), Some(bit)) = (btf.func_id("bpf_cast_to_kern_ctx"), btf.field_bit_offset("sk_buff", "ip_summed"))
    else {
        tracing::info!(
            "the kernel's BTF has no bpf_cast_to_kern_ctx or sk_buff.ip_summed: the checksum helper fixes every packet"
        );
        return None;
    };
    // Two bits within one byte, past the skb's first (0 means "unknown" to the programs).
    (bit % 8 <= 6 && bit >= 8).then_some((kfunc, ((bit / 8) << 8) | (bit % 8)))
}

/// The object with each call of [`proxy_common::CAST_TO_KERN_CTX_STANDIN`] made a call of the
/// kfunc `id` (`BPF_PSEUDO_KFUNC_CALL`), in a copy aligned as the ELF reader needs.
fn with_kfunc_calls(object: &[u8], id: u32) -> Vec<u64> {
    const CALL: u8 = 0x85; // BPF_JMP | BPF_CALL
    const PSEUDO_KFUNC_CALL: u8 = 2 << 4; // the source register's nibble
    let mut words = vec![0u64; object.len().div_ceil(8)];
    // SAFETY: the words' bytes, as many as the object has.
    let bytes = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), object.len()) };
    bytes.copy_from_slice(object);
    let mut standin = [CALL, 0, 0, 0, 0, 0, 0, 0];
    standin[4..].copy_from_slice(&proxy_common::CAST_TO_KERN_CTX_STANDIN.to_le_bytes());
    // Instructions are 8-byte aligned in their sections, and sections in the file.
    for insn in bytes.as_chunks_mut::<8>().0 {
        if *insn == standin {
            insn[1] = PSEUDO_KFUNC_CALL;
            insn[4..].copy_from_slice(&id.to_le_bytes());
        }
    }
    words
}

/// Load the eBPF object with its maps created or reused under the pin directory; no program
/// is loaded into the kernel yet.
pub fn open_object(cfg: &DatapathConfig) -> Result<Ebpf> {
    if EBPF_OBJECT.is_empty() {
        bail!("this kpr binary was built without its eBPF object (AYA_BUILD_SKIP); rebuild with `cargo xtask build`");
    }
    let dir = pin_dir(&cfg.pin_root);
    check_owner(&cfg.pin_root)?;
    fs::create_dir_all(&dir)
        .with_context(|| format!("failed to create the pin directory {} (is bpffs mounted?)", dir.display()))?;
    fs::set_permissions(&cfg.pin_root, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .with_context(|| format!("failed to restrict {}", cfg.pin_root.display()))?;
    let kernel_since = |major, minor| u8::from(kernel_since(major, minor));
    // bpf_set_retval (ECONNREFUSED for services without endpoints) exists from 5.18 on.
    let have_set_retval = kernel_since(5, 18);
    let have_coarse_clock = kernel_since(5, 11);
    // The route lookup's BPF_FIB_LOOKUP_SKIP_NEIGH (6.3+), for one route lookup per forwarded packet.
    let redirect_next_hop = kernel_since(6, 3);
    let host_netns = netns_cookie().unwrap_or(0);
    let snat_ports = cfg.snat_ports;
    let patched;
    let (object, ip_summed_at) = match kernel_skb_checksum_state() {
        Some((kfunc, at)) => {
            patched = with_kfunc_calls(EBPF_OBJECT, kfunc);
            // SAFETY: the words' bytes, as many as the object has (the last word is padded).
            (unsafe { std::slice::from_raw_parts(patched.as_ptr().cast::<u8>(), EBPF_OBJECT.len()) }, at)
        }
        None => (EBPF_OBJECT, 0),
    };
    if host_netns == 0 {
        tracing::warn!(
            "the kernel does not tell network namespaces apart (SO_NETNS_COOKIE): every socket counts as the node's"
        );
    }
    // Maps pinned by an earlier agent keep their sizes (a map cannot grow): a restart or an
    // upgrade with other sizes (flags, or a new default) serves on them, and the new sizes take
    // effect once the pins are made anew (after a reboot, or `kpr cleanup`).
    let size = |name: &str, want: u32| -> u32 {
        let Some(have) = MapData::from_pin(dir.join(name)).ok().and_then(|m| m.info().ok()).map(|i| i.max_entries())
        else {
            return want;
        };
        if have != want {
            tracing::warn!(
                map = name,
                pinned = have,
                configured = want,
                "a pinned map keeps its size; the configured one takes effect once the pins are made anew \
                 (after a reboot, or `kpr cleanup`)"
            );
        }
        have
    };
    let pod_links_covered = u8::from(cfg.pod_links_covered);
    let localhost_node_ports = u8::from(cfg.localhost_node_ports);
    let forward_direct = u8::from(cfg.forward_direct != ForwardDirect::Never);
    let refuse_service_range = u8::from(cfg.refuse_service_range);
    let seed = flow_hash_seed();
    let mut carried = carry_over_maps(&cfg.pin_root);
    let mut loader = EbpfLoader::new();
    loader
        .default_map_pin_directory(&dir)
        .map_max_entries(map_names::SERVICES, size(map_names::SERVICES, cfg.max_service_ports))
        .map_max_entries(map_names::BACKENDS, size(map_names::BACKENDS, cfg.max_backends))
        .map_max_entries(map_names::SOCK_REVNAT, size(map_names::SOCK_REVNAT, cfg.max_sock_revnat))
        .map_max_entries(map_names::SOCK_PICKS, size(map_names::SOCK_PICKS, cfg.max_sock_revnat))
        .map_max_entries(map_names::CONNTRACK4, size(map_names::CONNTRACK4, cfg.max_conntrack))
        .map_max_entries(map_names::CT_NEW4, size(map_names::CT_NEW4, cfg.max_conntrack_new))
        .map_max_entries(map_names::CONNTRACK6, size(map_names::CONNTRACK6, cfg.max_conntrack))
        .map_max_entries(map_names::CT_NEW6, size(map_names::CT_NEW6, cfg.max_conntrack_new))
        .map_max_entries(map_names::SOURCE_RANGES, size(map_names::SOURCE_RANGES, cfg.max_source_ranges))
        .override_global("KPR_HAVE_SET_RETVAL", &have_set_retval, true)
        .override_global("KPR_COARSE_CLOCK", &have_coarse_clock, true)
        .override_global("KPR_HOST_NETNS_COOKIE", &host_netns, true)
        .override_global("KPR_POD_LINKS_COVERED", &pod_links_covered, true)
        .override_global("KPR_LOCALHOST_NODEPORTS", &localhost_node_ports, true)
        .override_global("KPR_AGENT_CGROUP_ID", &cfg.agent_cgroup_id, true)
        .override_global("KPR_FORWARD_DIRECT", &forward_direct, true)
        .override_global("KPR_REDIRECT_NEXT_HOP", &redirect_next_hop, true)
        .override_global("KPR_DETECT_LOCAL", &cfg.detect_local, true)
        .override_global("KPR_REFUSE_SERVICE_RANGE", &refuse_service_range, true)
        .override_global("KPR_SNAT_PORT_MIN", &snat_ports.0, true)
        .override_global("KPR_SNAT_PORT_MAX", &snat_ports.1, true)
        .override_global("KPR_CT_TIMEOUTS", &cfg.ct_timeouts, true)
        .override_global("KPR_FLOW_HASH_SEED", &seed, true)
        .override_global("KPR_IP_SUMMED_AT", &ip_summed_at, true);
    let loaded = loop {
        match loader.load(object) {
            // A carried map that this layout reads otherwise after all, or a pinned map of this
            // layout that a build changed without a new layout version: made anew, so that the
            // agent starts (the old map goes with its last user).
            Err(aya::EbpfError::MapError(aya::maps::MapError::IncompatiblePinnedMap { name, property, .. })) => {
                if carried.contains(&name.as_str()) {
                    tracing::warn!(map = %name, property, "an older layout's map differs from this one's: made anew");
                } else {
                    tracing::warn!(map = %name, property, "a pinned map differs from this build's: made anew");
                }
                carried.retain(|c| *c != name);
                fs::remove_file(dir.join(&name)).with_context(|| format!("failed to unpin the map {name}"))?;
            }
            loaded => break loaded,
        }
    };
    loaded
        .map_err(|e| match e {
            aya::EbpfError::MapError(aya::maps::MapError::PinError { .. }) | aya::EbpfError::MapError(_) => {
                anyhow::Error::new(e).context(format!(
                    "failed to create or reuse the maps pinned in {}; if they are not kpr's of this \
                         version, `kpr cleanup --pin-root {}` removes them (and detaches kpr)",
                    dir.display(),
                    cfg.pin_root.display()
                ))
            }
            e => anyhow::Error::new(e).context("failed to load the eBPF object"),
        })
        .and_then(|mut ebpf| {
            // `Auto`: the agent's watch writes it, before any link is attached (a map just
            // made says "host path").
            if cfg.forward_direct == ForwardDirect::Always {
                let map = ebpf.map_mut(map_names::HOST_STATE).context("no map KPR_HOST_STATE")?;
                set_host_forward_direct(&mut Array::try_from(map)?, true)?;
            }
            Ok(ebpf)
        })
}

impl BpfDatapath {
    /// Load everything and attach the socket hooks; the per-packet programs are attached by
    /// [`HostDatapath::apply_node`] as links are known.
    pub fn load(cfg: &DatapathConfig) -> Result<Self> {
        let mut ebpf = open_object(cfg)?;
        let dir = pin_dir(&cfg.pin_root);
        let cgroup =
            File::open(&cfg.cgroup).with_context(|| format!("failed to open cgroup {}", cfg.cgroup.display()))?;
        start_ebpf_logger(&mut ebpf);

        let cgroup_id = fs::metadata(&cfg.cgroup).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).ok();
        for name in HOOKS {
            let prog: &mut CgroupSockAddr = ebpf
                .program_mut(name)
                .with_context(|| format!("program `{name}` missing from the eBPF object"))?
                .try_into()?;
            prog.load().with_context(|| format!("the verifier rejected `{name}`"))?;
            let link_path = dir.join(format!("link_{name}"));
            // A previous agent's link: swap our program in, keeping the attachment, when it is
            // attached where it should be; else (another --cgroup, a cgroup that is gone, a
            // link that does not take the program) attach anew and drop it.
            let reused = link_path.exists()
                && match reuse_cgroup_link(prog, &link_path, cgroup_id) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(program = name, "not reusing the pinned link: {e:#}; attaching anew");
                        false
                    }
                };
            if reused {
                tracing::debug!(program = name, "replaced the program in the pinned link");
            } else {
                // bpf_link_create takes no attach flags: a cgroup link always coexists with
                // other programs attached to the cgroup (multi-attach semantics).
                let id = prog
                    .attach(&cgroup, CgroupAttachMode::Single)
                    .with_context(|| format!("failed to attach `{name}` to {}", cfg.cgroup.display()))?;
                let link: FdLink = prog.take_link(id)?.try_into()?;
                if link_path.exists() {
                    fs::remove_file(&link_path).with_context(|| format!("failed to remove {}", link_path.display()))?;
                }
                link.pin(&link_path).with_context(|| format!("failed to pin {}", link_path.display()))?;
                tracing::debug!(program = name, cgroup = %cfg.cgroup.display(), "attached and pinned");
            }
        }
        if let Err(e) = attach_sock_release(&mut ebpf, &cgroup, &dir) {
            // Without it, reverse-translation entries of closed sockets age out of the LRU map.
            tracing::warn!("socket release hook not attached: {e:#}");
        }
        load_tc_programs(&mut ebpf)?;

        let maps = BpfMaps::take_from(&mut ebpf)?;
        let tc_netlink = cfg.tc_netlink || !KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0));
        // Another layout's programs keep serving until this agent's first sync is written
        // ([`HostDatapath::retire_other_layouts`]).
        let host = BpfHost::take_from(ebpf, dir, tc_netlink, cfg.pin_root.clone())?;
        Ok(Self { maps, host })
    }
}

const TC_PROGRAMS: [&str; 2] = [program_names::TC_INGRESS, program_names::TC_EGRESS];

/// Load the tc programs: the attached ones, and the slow programs they hand packets to, put in
/// their `KPR_TC_SLOW_PATH` slots (pinned: they stay there when the agent is gone). Before
/// any map is taken out of the object (that would break the programs' relocation).
pub fn load_tc_programs(ebpf: &mut Ebpf) -> Result<()> {
    for name in TC_PROGRAMS.into_iter().chain(program_names::TC_SLOW_PATH) {
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .with_context(|| format!("program `{name}` missing from the eBPF object"))?
            .try_into()?;
        prog.load().with_context(|| format!("the verifier rejected `{name}`"))?;
    }
    for (slot, name) in (0u32..).zip(program_names::TC_SLOW_PATH) {
        let fd = ebpf.program(name).context("a slow tc program")?.fd()?.try_clone()?;
        let map = ebpf.map_mut(map_names::TC_SLOW_PATH).context("KPR_TC_SLOW_PATH missing from the eBPF object")?;
        ProgramArray::try_from(map)?.set(slot, &fd, 0).context("failed to fill KPR_TC_SLOW_PATH")?;
    }
    Ok(())
}

/// Swap `prog` into the cgroup link pinned at `path`, if that link is attached to the cgroup
/// `cgroup_id` (the inode of the cgroup2 directory).
fn reuse_cgroup_link(prog: &mut CgroupSockAddr, path: &Path, cgroup_id: Option<u64>) -> Result<()> {
    let attached_to = pinned_link_cgroup_id(path);
    let link: FdLink =
        PinnedLink::from_pin(path).with_context(|| format!("failed to open pinned link {}", path.display()))?.into();
    if cgroup_id.is_some() && attached_to != cgroup_id {
        bail!("it is attached to another cgroup (id {attached_to:?}, want {cgroup_id:?})");
    }
    prog.attach_to_link(CgroupSockAddrLink::try_from(link)?).context("failed to update the link")?;
    Ok(())
}

/// The cgroup the link pinned at `path` is attached to (BPF_OBJ_GET, then
/// BPF_OBJ_GET_INFO_BY_FD); None when it is not a live cgroup link.
fn pinned_link_cgroup_id(path: &Path) -> Option<u64> {
    #[repr(C)]
    struct GetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    const BPF_OBJ_GET: libc::c_long = 7;
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    let mut attr = GetAttr { pathname: c_path.as_ptr() as u64, bpf_fd: 0, file_flags: 0 };
    // SAFETY: the kernel reads the path and returns a new fd (or -1).
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, &raw mut attr, size_of::<GetAttr>()) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh fd we own.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    link_cgroup_id(fd.as_fd())
}

fn link_cgroup_id(fd: BorrowedFd<'_>) -> Option<u64> {
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    // struct bpf_link_info: type, id, prog_id, then (8-aligned) the cgroup union member.
    #[repr(C)]
    #[derive(Default)]
    struct LinkInfoCgroup {
        kind: u32,
        id: u32,
        prog_id: u32,
        _pad: u32,
        cgroup_id: u64,
        attach_type: u32,
        _rest: [u32; 9],
    }
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    const BPF_LINK_TYPE_CGROUP: u32 = 3;
    let mut info = LinkInfoCgroup::default();
    let mut attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: size_of::<LinkInfoCgroup>() as u32,
        info: (&raw mut info) as u64,
    };
    // SAFETY: the kernel writes at most info_len bytes into `info`.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET_INFO_BY_FD, &raw mut attr, size_of::<InfoAttr>()) };
    (rc == 0 && info.kind == BPF_LINK_TYPE_CGROUP && info.cgroup_id != 0).then_some(info.cgroup_id)
}

/// Links whose `KPR_LINKS` entry carries `flag`.
fn links_flagged<T: std::borrow::Borrow<MapData>>(links: &HashMap<T, u32, LinkInfo>, flag: u32) -> BTreeSet<u32> {
    links
        .iter()
        .filter_map(Result::ok)
        .filter(|(ifindex, info)| *ifindex < proxy_common::LINK_FIRST_SPECIAL && info.flags & flag != 0)
        .map(|(ifindex, _)| ifindex)
        .collect()
}

/// The network namespace cookie recorded in `KPR_LINKS` (see [`proxy_common::LINK_NETNS`]).
fn links_netns<T: std::borrow::Borrow<MapData>>(links: &HashMap<T, u32, LinkInfo>) -> Option<u64> {
    let info = links.get(&proxy_common::LINK_NETNS, 0).ok()?;
    Some(u64::from(info.flags) << 32 | u64::from(info.addr))
}

/// kpr's netlink tc filters: this priority and handle on a link's clsact ingress and egress.
const NETLINK_PRIORITY: u16 = 1000;
const NETLINK_HANDLE: u32 = 0x4b50;

/// kpr's netlink filter on `ifindex` for `attach_type`, as a link to replace or drop.
fn netlink_filter(ifindex: u32, attach_type: TcAttachType) -> Result<SchedClassifierLink> {
    Ok(SchedClassifierLink::attached(
        NetworkInterface::Index(ifindex),
        attach_type.into(),
        NETLINK_PRIORITY,
        NETLINK_HANDLE.into(),
        None,
    )?)
}

/// Remove kpr's netlink filters from `ifindex` (dropping such a link deletes its filter).
fn remove_netlink_filters(ifindex: u32) {
    for attach_type in [TcAttachType::Ingress, TcAttachType::Egress] {
        if let Ok(link) = netlink_filter(ifindex, attach_type) {
            drop(link);
        }
    }
}

/// The name of link `ifindex` in this network namespace, if it exists.
pub fn link_name(ifindex: u32) -> Option<String> {
    let mut name = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: if_indextoname writes at most IF_NAMESIZE bytes.
    if unsafe { libc::if_indextoname(ifindex, name.as_mut_ptr()) }.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated name in `name`.
    Some(unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned())
}

/// Turn accept_local off on link `ifindex` (if it still exists).
fn reset_accept_local(ifindex: u32) {
    let Some(name) = link_name(ifindex) else {
        return; // the link is gone, and its setting with it
    };
    match super::devconf::set_accept_local(ifindex, false) {
        Ok(()) => tracing::info!(interface = %name, "accept_local turned off again"),
        Err(e) => tracing::warn!(interface = %name, "failed to turn accept_local off again: {e}"),
    }
}

/// `kpr cleanup`: undo what kpr changed on the node's links (accept_local, netlink filters).
fn undo_host_changes(dir: &Path) {
    let Ok(map) = MapData::from_pin(dir.join(map_names::LINKS)) else { return };
    let Ok(links) = HashMap::<_, u32, LinkInfo>::try_from(Map::HashMap(map)) else { return };
    // The ifindexes are those of the agent's network namespace: here they may name other links.
    if let (Some(theirs), Some(ours)) = (links_netns(&links), netns_cookie())
        && theirs != ours
    {
        tracing::warn!(
            "the agent ran in another network namespace: its links' settings (accept_local, netlink \
             filters) are left to that namespace (run `kpr cleanup` there to undo them)"
        );
        return;
    }
    for ifindex in links_flagged(&links, proxy_common::LINK_FLAG_ACCEPT_LOCAL_SET) {
        reset_accept_local(ifindex);
    }
    for ifindex in links_flagged(&links, proxy_common::LINK_FLAG_NETLINK_TC) {
        remove_netlink_filters(ifindex);
    }
}

/// The pin directories of other layout versions under `pin_root`, with their versions.
fn other_layouts(pin_root: &Path) -> Vec<(u32, PathBuf)> {
    let current = pin_dir(pin_root);
    let Ok(entries) = fs::read_dir(pin_root) else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.strip_prefix('v')?.parse().ok()?;
            let path = entry.path();
            (path != current).then_some((version, path))
        })
        .collect()
}

/// The map `name` of layout `version` reads as this layout's (see [`proxy_common::CARRIED_MAPS`]).
fn reads_as_ours(version: u32, name: &str) -> bool {
    version == PIN_LAYOUT_VERSION
        || version < PIN_LAYOUT_VERSION
            && proxy_common::CARRIED_MAPS.iter().any(|(carried, since)| *carried == name && version >= *since)
}

/// An upgrade: pin the maps of the newest older layout that this one reads as its own
/// ([`proxy_common::CARRIED_MAPS`]) into this layout's directory, unless it has pins already.
/// They stay the same kernel maps, so flows, affinity and the programmed services carry over
/// while the old programs still run on them. Returns the names of the maps carried.
fn carry_over_maps(pin_root: &Path) -> Vec<&'static str> {
    let dir = pin_dir(pin_root);
    if fs::read_dir(&dir).map_or(true, |mut files| files.next().is_some()) {
        return Vec::new();
    }
    let older = other_layouts(pin_root).into_iter().filter(|(v, _)| *v < PIN_LAYOUT_VERSION).max();
    let Some((version, old)) = older else { return Vec::new() };
    let mut carried = Vec::new();
    for (name, _) in proxy_common::CARRIED_MAPS.into_iter().filter(|(name, _)| reads_as_ours(version, name)) {
        let Ok(map) = MapData::from_pin(old.join(name)) else { continue };
        match map.pin(dir.join(name)) {
            Ok(()) => carried.push(name),
            Err(e) => tracing::warn!(map = name, "failed to carry the map over from {}: {e}", old.display()),
        }
    }
    tracing::info!(from = %old.display(), maps = ?carried, "carrying over an older layout's maps");
    carried
}

/// Unpin the directories of other layout versions (an upgrade or a downgrade): their links
/// detach (once no agent of that version holds them), and their maps go with their last user
/// (a carried map stays, pinned here).
fn remove_other_layouts(pin_root: &Path) {
    for (_, path) in other_layouts(pin_root) {
        let removed = fs::read_dir(&path)
            .map(|files| files.flatten().filter(|f| fs::remove_file(f.path()).is_ok()).count())
            .unwrap_or(0);
        let _ = fs::remove_dir(&path);
        tracing::warn!(dir = %path.display(), removed, "removed the pins of another kpr layout version (its programs are detached)");
    }
}

/// The socket release hook (cleans up after sockets). Its link cannot take a new program in
/// place: a previous agent's is replaced by a new one.
fn attach_sock_release(ebpf: &mut Ebpf, cgroup: &File, dir: &Path) -> Result<()> {
    let name = program_names::SOCK_RELEASE;
    let prog: &mut aya::programs::CgroupSock =
        ebpf.program_mut(name).with_context(|| format!("program `{name}` missing from the eBPF object"))?.try_into()?;
    prog.load().with_context(|| format!("the verifier rejected `{name}`"))?;
    let link_path = dir.join(format!("link_{name}"));
    let id = prog.attach(cgroup, CgroupAttachMode::Single)?;
    let link: FdLink = prog.take_link(id)?.try_into()?;
    if link_path.exists() {
        fs::remove_file(&link_path).with_context(|| format!("failed to remove {}", link_path.display()))?;
    }
    link.pin(&link_path).with_context(|| format!("failed to pin {}", link_path.display()))?;
    Ok(())
}

/// The host side of the datapath: where the per-packet programs are attached and what they
/// know of the node (its addresses, links, the detector's CIDRs).
pub trait HostDatapath: Send {
    /// Make the node maps and the per-packet attachments match `plan`. A link that cannot be
    /// attached is logged and retried at the next call; the rest still applies.
    fn apply_node(&mut self, plan: &NodePlan) -> Result<()>;

    /// The agent's first sync is written: another layout's programs, left serving until now
    /// (an upgrade or a downgrade), go.
    fn retire_other_layouts(&mut self) {}
}

pub struct BpfHost {
    ebpf: Ebpf,
    dir: PathBuf,
    node_addrs: HashMap<MapData, Addr, u32>,
    links: HashMap<MapData, u32, LinkInfo>,
    local_cidrs: LpmTrie<MapData, CidrKey, u8>,
    service_cidrs: LpmTrie<MapData, CidrKey, u8>,
    service_range_cover: Array<MapData, CidrMask>,
    /// ifindex → name of the links that hold kpr's per-packet programs.
    attached: BTreeMap<u32, String>,
    /// Links where kpr turned `accept_local` on (kept in `KPR_LINKS` across restarts).
    accept_local_set: BTreeSet<u32>,
    /// Attach as netlink tc filters (no TCX, or asked to).
    tc_netlink: bool,
    /// Links holding kpr's netlink filters (kept in `KPR_LINKS` across restarts).
    netlink_links: BTreeSet<u32>,
    /// Node and link addresses get their bits (shared with the service side's handle).
    addr_filter: Array<MapData, u64>,
    /// The host's forwarding was checked (at the first attach).
    forwarding_checked: bool,
    /// Where other layouts' pins are (`retire_other_layouts`).
    pin_root: PathBuf,
}

impl BpfHost {
    fn take_from(mut ebpf: Ebpf, dir: PathBuf, tc_netlink: bool, pin_root: PathBuf) -> Result<Self> {
        let mut take = |name: &str| ebpf.take_map(name).with_context(|| format!("no map {name}"));
        let node_addrs = HashMap::try_from(take(map_names::NODE_ADDRS)?)?;
        let links = HashMap::try_from(take(map_names::LINKS)?)?;
        let local_cidrs = LpmTrie::try_from(take(map_names::LOCAL_CIDRS)?)?;
        let service_cidrs = LpmTrie::try_from(take(map_names::SERVICE_CIDRS)?)?;
        let service_range_cover = Array::try_from(take(map_names::SERVICE_RANGE_COVER)?)?;
        // The service side took the object's handle: a second one, from the pin.
        let filter = MapData::from_pin(dir.join(map_names::ADDR_FILTER)).context("address filter map")?;
        let addr_filter = Array::try_from(Map::Array(filter))?;
        let accept_local_set = links_flagged(&links, proxy_common::LINK_FLAG_ACCEPT_LOCAL_SET);
        let netlink_links = links_flagged(&links, proxy_common::LINK_FLAG_NETLINK_TC);
        Ok(Self {
            ebpf,
            dir,
            node_addrs,
            links,
            local_cidrs,
            service_cidrs,
            service_range_cover,
            addr_filter,
            attached: BTreeMap::new(),
            accept_local_set,
            tc_netlink,
            netlink_links,
            forwarding_checked: false,
            pin_root,
        })
    }

    /// Translated packets go back to the host stack, which forwards them between links only
    /// with forwarding on (kube-proxy needs it as well; the CNI or kubelet usually turns it
    /// on). Checked once the per-packet path is on a link: off, it is said clearly.
    fn check_forwarding(&mut self) {
        if self.forwarding_checked || self.attached.is_empty() {
            return;
        }
        self.forwarding_checked = true;
        if fs::read_to_string("/proc/sys/net/ipv4/ip_forward").is_ok_and(|v| v.trim() == "0") {
            tracing::warn!(
                "net.ipv4.ip_forward is 0: the node drops translated packets that go from one link to another \
                 (NodePort, externalIP and LoadBalancer traffic to pods); set it to 1"
            );
        }
    }

    fn tc_pin(&self, program: &str, ifindex: u32) -> PathBuf {
        self.dir.join(format!("link_{program}_if{ifindex}"))
    }

    /// Attach (or, after a restart, swap into the pinned links) both tc programs on a link,
    /// then let it accept local sources.
    fn attach_link(&mut self, ifindex: u32, name: &str) -> Result<()> {
        if self.tc_netlink {
            self.attach_netlink(ifindex, name)?;
        } else {
            self.attach_tcx(ifindex, name)?;
        }
        self.accept_local(ifindex, name);
        Ok(())
    }

    /// Masquerade rewrites the source to the node's own address before routing; the kernel
    /// drops such "martian" packets unless the link accepts local sources. The ingress program
    /// then drops the martians kpr did not make (`LINK_FLAG_ACCEPT_LOCAL_SET`): so the link is
    /// marked in `KPR_LINKS` first, with the program attached, and accept_local turned on last
    /// (the other order left a window in which a pod could send as the node).
    fn accept_local(&mut self, ifindex: u32, name: &str) {
        let sysctl = format!("/proc/sys/net/ipv4/conf/{name}/accept_local");
        if !fs::read_to_string(&sysctl).is_ok_and(|v| v.trim() == "0") {
            return;
        }
        let mut info = self.links.get(&ifindex, 0).unwrap_or_default();
        info.flags |= proxy_common::LINK_FLAG_ACCEPT_LOCAL_SET;
        if let Err(e) = self.links.insert(&ifindex, &info, 0) {
            tracing::warn!(interface = %name, "failed to mark the link before setting accept_local: {e}; left off");
            return;
        }
        match super::devconf::set_accept_local(ifindex, true) {
            Ok(()) => {
                self.accept_local_set.insert(ifindex);
            }
            Err(e) => {
                tracing::warn!(interface = %name, "failed to set accept_local: {e}; masqueraded flows may be dropped")
            }
        }
    }

    /// Both tc programs as TCX links, pinned; after a restart, swapped into the pinned links.
    fn attach_tcx(&mut self, ifindex: u32, name: &str) -> Result<()> {
        for (program, attach_type) in [(TC_PROGRAMS[0], TcAttachType::Ingress), (TC_PROGRAMS[1], TcAttachType::Egress)]
        {
            let link_path = self.tc_pin(program, ifindex);
            let prog: &mut SchedClassifier = self.ebpf.program_mut(program).context("tc program")?.try_into()?;
            if link_path.exists() {
                let link: FdLink = PinnedLink::from_pin(&link_path)
                    .with_context(|| format!("failed to open pinned link {}", link_path.display()))?
                    .into();
                prog.attach_to_link(SchedClassifierLink::try_from(link)?)
                    .with_context(|| format!("failed to update the {program} link on {name}"))?;
                continue;
            }
            let id = prog
                .attach(
                    NetworkInterface::Index(ifindex),
                    aya::programs::tc::TcAttach::Tcx { attach_type, order: Default::default() },
                )
                .with_context(|| format!("failed to attach {program} to {name}"))?;
            let link: FdLink = prog.take_link(id)?.try_into().context("a TCX link")?;
            link.pin(&link_path).with_context(|| format!("failed to pin {}", link_path.display()))?;
        }
        Ok(())
    }

    /// Kernels without TCX: netlink tc filters at kpr's own priority and handle, replaced in
    /// place when they exist (a restart), and left attached when the agent exits (like a
    /// pinned link): `kpr cleanup` or leaving the link removes them.
    fn attach_netlink(&mut self, ifindex: u32, name: &str) -> Result<()> {
        let _ = aya::programs::tc::qdisc_add_clsact(NetworkInterface::Index(ifindex));
        for (program, attach_type) in [(TC_PROGRAMS[0], TcAttachType::Ingress), (TC_PROGRAMS[1], TcAttachType::Egress)]
        {
            let prog: &mut SchedClassifier = self.ebpf.program_mut(program).context("tc program")?.try_into()?;
            let existing = netlink_filter(ifindex, attach_type)?;
            let id = match prog.attach_to_link(existing) {
                Ok(id) => id,
                Err(_) => {
                    let options = aya::programs::tc::NlOptions {
                        priority: NETLINK_PRIORITY,
                        handle: NETLINK_HANDLE.into(),
                        classid: None,
                    };
                    prog.attach(
                        NetworkInterface::Index(ifindex),
                        aya::programs::tc::TcAttach::Netlink { parent: attach_type.into(), options },
                    )
                    .with_context(|| format!("failed to attach {program} to {name} (netlink)"))?
                }
            };
            // Dropping the link would delete the filter: it outlives the agent on purpose.
            std::mem::forget(prog.take_link(id)?);
        }
        self.netlink_links.insert(ifindex);
        Ok(())
    }

    /// Detach from a link (gone, or no longer selected): drop its pinned links or netlink
    /// filters, and turn accept_local off again if kpr turned it on.
    fn detach_link(&mut self, ifindex: u32) {
        if self.accept_local_set.remove(&ifindex) {
            reset_accept_local(ifindex);
        }
        if self.netlink_links.remove(&ifindex) {
            remove_netlink_filters(ifindex);
        }
        for program in TC_PROGRAMS {
            let path = self.tc_pin(program, ifindex);
            if let Ok(pinned) = PinnedLink::from_pin(&path) {
                match pinned.unpin() {
                    Ok(link) => drop(link),
                    Err(e) => tracing::warn!("failed to unpin {}: {e}", path.display()),
                }
            } else {
                let _ = fs::remove_file(&path);
            }
        }
    }

    /// The plan's link entries, marked where kpr set accept_local, attached netlink filters, or
    /// has its programs attached and the plan keeps them (so the mark is set after an
    /// attachment and cleared before a detachment).
    fn links_marked(
        &self,
        links: &BTreeMap<u32, LinkInfo>,
        tc_links: &BTreeMap<u32, String>,
    ) -> BTreeMap<u32, LinkInfo> {
        let mut links = links.clone();
        for ifindex in self.attached.keys().filter(|i| tc_links.contains_key(i)) {
            links.entry(*ifindex).or_default().flags |= proxy_common::LINK_FLAG_TC_INGRESS;
        }
        for ifindex in &self.accept_local_set {
            links.entry(*ifindex).or_default().flags |= proxy_common::LINK_FLAG_ACCEPT_LOCAL_SET;
        }
        for ifindex in &self.netlink_links {
            links.entry(*ifindex).or_default().flags |= proxy_common::LINK_FLAG_NETLINK_TC;
        }
        if let Some(cookie) = netns_cookie() {
            let info = LinkInfo { addr: cookie as u32, flags: (cookie >> 32) as u32, ..LinkInfo::default() };
            links.insert(proxy_common::LINK_NETNS, info);
        }
        links
    }

    /// Pinned tc links of earlier runs, by ifindex.
    fn pinned_links(&self) -> BTreeSet<u32> {
        let prefix = format!("link_{}_if", TC_PROGRAMS[0]);
        fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix(&prefix)?.parse().ok())
            .collect()
    }
}

impl HostDatapath for BpfHost {
    fn apply_node(&mut self, plan: &NodePlan) -> Result<()> {
        // Maps first: a newly attached link must find its addresses and flags. The filter's
        // bits before anything that makes packets to (or from) these addresses ours.
        let want: BTreeMap<Addr, u32> = plan.node_addrs.iter().map(|(a, f)| (Addr::from(*a), *f)).collect();
        let link_addrs = plan.links.values().flat_map(|l| [Addr::from_v4(l.addr), l.addr6]);
        mark_addresses(&mut self.addr_filter, want.keys().copied().chain(link_addrs))?;
        sync_hash(&mut self.node_addrs, &want)?;
        let links = self.links_marked(&plan.links, &plan.tc_links);
        sync_hash(&mut self.links, &links)?;
        sync_lpm(&mut self.local_cidrs, &plan.local_cidrs)?;
        sync_service_ranges(&mut self.service_cidrs, &mut self.service_range_cover, &plan.service_cidrs)?;

        // Links of an earlier run that are gone or no longer selected.
        let stale: Vec<u32> = self
            .pinned_links()
            .into_iter()
            .chain(self.netlink_links.iter().copied())
            .chain(self.attached.keys().copied())
            .filter(|i| !plan.tc_links.contains_key(i))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        for ifindex in stale {
            self.detach_link(ifindex);
            if let Some(name) = self.attached.remove(&ifindex) {
                tracing::info!(interface = %name, ifindex, "per-packet programs detached");
            }
        }
        let attached = |h: &Self| h.attached.keys().copied().collect::<BTreeSet<u32>>();
        let marks = (self.accept_local_set.clone(), self.netlink_links.clone(), attached(self));
        for (ifindex, name) in &plan.tc_links {
            if self.attached.contains_key(ifindex) {
                continue;
            }
            match self.attach_link(*ifindex, name) {
                Ok(()) => {
                    tracing::info!(interface = %name, ifindex, "per-packet programs attached");
                    self.attached.insert(*ifindex, name.clone());
                }
                // The link may have vanished since the snapshot: the next one settles it.
                Err(e) => tracing::warn!(interface = %name, "{e:#}"),
            }
        }
        self.check_forwarding();
        // Remember what is ours to undo (accept_local, netlink filters) and where ingress runs,
        // when it changed.
        if marks != (self.accept_local_set.clone(), self.netlink_links.clone(), attached(self)) {
            let links = self.links_marked(&plan.links, &plan.tc_links);
            sync_hash(&mut self.links, &links)?;
        }
        Ok(())
    }

    fn retire_other_layouts(&mut self) {
        remove_other_layouts(&self.pin_root);
    }
}

/// Set the address filter's bits of `addrs`, a word at a time: read, OR, write what changed. Bits are never cleared
/// (see `proxy_common::addr_filter_bit`).
fn mark_addresses(filter: &mut Array<MapData, u64>, addrs: impl IntoIterator<Item = Addr>) -> Result<()> {
    let mut words: BTreeMap<u32, u64> = BTreeMap::new();
    for addr in addrs.into_iter().filter(|a| !a.is_unspecified()) {
        let bit = proxy_common::addr_filter_bit(&addr);
        *words.entry(bit >> 6).or_default() |= 1 << (bit & 63);
    }
    for (index, bits) in words {
        let word = filter.get(&index, 0).with_context(|| format!("failed to read address filter word {index}"))?;
        if word | bits != word {
            filter
                .set(index, &(word | bits), 0)
                .with_context(|| format!("failed to write address filter word {index}"))?;
        }
    }
    Ok(())
}

/// Make an LPM set hold exactly the CIDRs of `want` (both families).
fn sync_lpm<T: BorrowMut<MapData>>(map: &mut LpmTrie<T, CidrKey, u8>, want: &BTreeSet<Cidr>) -> Result<()> {
    let want: BTreeSet<(Addr, u32)> = want.iter().map(lpm_prefix).collect();
    let have: BTreeSet<(Addr, u32)> =
        map.keys().filter_map(Result::ok).map(|k| (k.data().addr, k.prefix_len())).collect();
    for (addr, len) in have.difference(&want) {
        map.remove(&LpmKey::new(*len, CidrKey { addr: *addr }))?;
    }
    for (addr, len) in want.difference(&have) {
        map.insert(&LpmKey::new(*len, CidrKey { addr: *addr }), &1u8, 0)?;
    }
    Ok(())
}

/// The cluster's service ranges: the range map, and per family the prefix covering them. A new
/// range is in the map before the cover grows to take it in; one that goes leaves the cover
/// first, then the map.
fn sync_service_ranges<T: BorrowMut<MapData>, U: BorrowMut<MapData>>(
    ranges: &mut LpmTrie<T, CidrKey, u8>,
    cover: &mut Array<U, CidrMask>,
    want: &BTreeSet<Cidr>,
) -> Result<()> {
    let have: BTreeSet<Cidr> =
        ranges.keys().filter_map(Result::ok).filter_map(|k| cidr_of(k.data().addr, k.prefix_len())).collect();
    sync_lpm(ranges, &have.union(want).copied().collect())?;
    for (index, v4) in [(0, true), (1, false)] {
        cover.set(index, &range_cover(want.iter().filter(|c| c.is_ipv4() == v4), v4), 0)?;
    }
    sync_lpm(ranges, want)
}

/// Program the cluster's service ranges into an object's maps directly (the benchmark and the
/// TestRun tests; the agent's node plan does it through [`BpfHost`]).
pub fn write_service_ranges(ebpf: &mut Ebpf, want: &BTreeSet<Cidr>) -> Result<()> {
    let [Some(ranges), Some(cover)] =
        ebpf.maps_disjoint_mut([map_names::SERVICE_CIDRS, map_names::SERVICE_RANGE_COVER])
    else {
        bail!("the object has no service range maps");
    };
    let mut ranges: LpmTrie<&mut MapData, CidrKey, u8> = LpmTrie::try_from(ranges)?;
    let mut cover: Array<&mut MapData, CidrMask> = Array::try_from(cover)?;
    sync_service_ranges(&mut ranges, &mut cover, want)
}

/// The longest prefix covering all of `ranges` (of one family, IPv4 when `v4`): their common
/// leading bits. No range: the family's unspecified address alone, which no packet is for.
fn range_cover<'a>(ranges: impl Iterator<Item = &'a Cidr>, v4: bool) -> CidrMask {
    let bits = |c: &Cidr| -> (u128, u32) {
        let v6 = match c.addr {
            IpAddr::V4(a) => a.to_ipv6_mapped(),
            IpAddr::V6(a) => a,
        };
        let offset = if v4 { Addr::V4_PREFIX_OFFSET } else { 0 };
        (u128::from(v6), offset + u32::from(c.len))
    };
    let mut cover: Option<(u128, u32)> = None;
    for (addr, len) in ranges.map(bits) {
        cover = Some(match cover {
            None => (addr, len),
            Some((have, have_len)) => (have, have_len.min(len).min((have ^ addr).leading_zeros())),
        });
    }
    let unspecified = if v4 { Ipv4Addr::UNSPECIFIED.to_ipv6_mapped() } else { Ipv6Addr::UNSPECIFIED };
    let (addr, len) = cover.unwrap_or((u128::from(unspecified), 128));
    let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
    CidrMask { addr: Ipv6Addr::from(addr & mask).into(), mask: Ipv6Addr::from(mask).into() }
}

#[cfg(test)]
mod range_cover_tests {
    use super::*;

    fn cidr(s: &str) -> Cidr {
        let (addr, len) = s.split_once('/').unwrap();
        Cidr::new(addr.parse().unwrap(), len.parse().unwrap()).unwrap()
    }

    fn covers(ranges: &[&str], v4: bool, addr: &str) -> bool {
        let ranges: Vec<Cidr> = ranges.iter().map(|r| cidr(r)).collect();
        range_cover(ranges.iter(), v4).contains(&addr.parse::<IpAddr>().unwrap().into())
    }

    #[test]
    fn the_cover_holds_every_range_of_its_family_and_little_else() {
        // One range: exactly it.
        let one = ["10.96.0.0/12"];
        assert!(covers(&one, true, "10.96.0.1") && covers(&one, true, "10.111.255.255"));
        assert!(!covers(&one, true, "10.112.0.0") && !covers(&one, true, "10.95.255.255"));
        assert!(!covers(&one, true, "192.168.1.1"));
        // Two ranges: their common leading bits, 10.96.0.0/13 here.
        let two = ["10.96.0.0/16", "10.100.0.0/16"];
        assert!(covers(&two, true, "10.96.7.7") && covers(&two, true, "10.100.7.7") && covers(&two, true, "10.97.0.1"));
        assert!(!covers(&two, true, "10.104.0.1"));
        // A family without a range covers nothing packets are for.
        assert!(!covers(&one, false, "fd00::1") && !covers(&[], true, "10.96.0.1"));
        let v6 = ["fd00:96::/108", "fd00:97::/108"];
        assert!(covers(&v6, false, "fd00:96::a") && covers(&v6, false, "fd00:97::a"));
        assert!(!covers(&v6, false, "fd00:98::a") && !covers(&v6, false, "fe80::1"));
        // The IPv4 cover never takes IPv6 addresses, nor an IPv4 one the IPv6 cover.
        assert!(!covers(&["0.0.0.0/0"], true, "fd00::1"));
        assert!(!covers(&v6, false, "10.96.0.1"));
    }
}

/// Make a hash map hold exactly `want`.
fn sync_hash<K: aya::Pod + Ord, V: aya::Pod + PartialEq>(
    map: &mut HashMap<MapData, K, V>,
    want: &BTreeMap<K, V>,
) -> Result<()> {
    let have: Vec<(K, V)> = map.iter().filter_map(Result::ok).collect();
    for (k, _) in have.iter().filter(|(k, _)| !want.contains_key(k)) {
        map.remove(k)?;
    }
    for (k, v) in want {
        if !have.iter().any(|(hk, hv)| hk == k && hv == v) {
            map.insert(k, v, 0)?;
        }
    }
    Ok(())
}

/// Forward eBPF log records (slow paths only) to the agent's log, when running under tokio.
fn start_ebpf_logger(ebpf: &mut Ebpf) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
    let logger = match aya_log::EbpfLogger::init(ebpf) {
        Ok(logger) => logger,
        Err(e) => {
            tracing::debug!("eBPF logging not available: {e}");
            return;
        }
    };
    let _guard = runtime.enter();
    // SAFETY: the logger owns its map fd for as long as the AsyncFd lives.
    let Ok(mut logger) =
        (unsafe { tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) })
    else {
        return;
    };
    runtime.spawn(async move {
        while let Ok(mut guard) = logger.readable_mut().await {
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    });
}

/// The service and backend maps of a loaded datapath, or opened from their pins.
pub struct BpfMaps {
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    /// Frontends and backends get their bits before the entries that use them are written.
    addr_filter: Array<MapData, u64>,
    backends: Array<MapData, Backend>,
    source_ranges: LpmTrie<MapData, SourceRange, u8>,
    conntrack: Conntrack,
    /// The socket path's translations (socket cookie + backend → service), to find the
    /// connected UDP sockets of an endpoint that left.
    sock_revnat: HashMap<MapData, SockRevNatKey, SockRevNatValue>,
    /// The endpoint each unconnected UDP socket keeps for a frontend (socket cookie + frontend).
    sock_picks: HashMap<MapData, SockRevNatKey, Backend>,
    capacity: Capacity,
}

impl BpfMaps {
    /// The service and backend maps of a loaded object (see [`open_object`]).
    pub fn take_from(ebpf: &mut Ebpf) -> Result<Self> {
        let services = ebpf.take_map(map_names::SERVICES).context("no services map")?;
        // The sizes of the maps as they are: pinned ones an earlier agent made keep theirs.
        let service_ports = match &services {
            Map::HashMap(data) => data.info()?.max_entries(),
            _ => bail!("the services map is not a hash map"),
        };
        let services = HashMap::try_from(services)?;
        let backends: Array<MapData, Backend> =
            Array::try_from(ebpf.take_map(map_names::BACKENDS).context("no backends map")?)?;
        let capacity = Capacity { service_ports, backends: backends.len() };
        let source_ranges = LpmTrie::try_from(ebpf.take_map(map_names::SOURCE_RANGES).context("no source range map")?)?;
        let conntrack = Conntrack::new(|name| ebpf.take_map(name).context("not in the object"))?;
        let sock_revnat = HashMap::try_from(ebpf.take_map(map_names::SOCK_REVNAT).context("no sock_revnat map")?)?;
        let sock_picks = HashMap::try_from(ebpf.take_map(map_names::SOCK_PICKS).context("no sock_picks map")?)?;
        let addr_filter = Array::try_from(ebpf.take_map(map_names::ADDR_FILTER).context("no address filter map")?)?;
        Ok(Self { services, addr_filter, backends, source_ranges, conntrack, sock_revnat, sock_picks, capacity })
    }

    /// Give addresses (IPv4, network byte order) their bits in the address filter: what a
    /// caller writes into the node maps itself (the agent's host side does its own).
    pub fn mark_addresses(&mut self, addrs: impl IntoIterator<Item = Addr>) -> Result<()> {
        mark_addresses(&mut self.addr_filter, addrs)
    }

    /// Open the pinned maps of a running (or stopped) agent, e.g. for `kpr services`.
    pub fn open_pinned(pin_root: &Path) -> Result<Self> {
        let open = |name: &str| open_pinned_map(pin_root, name);
        let services = open(map_names::SERVICES)?;
        let service_ports = services.info()?.max_entries();
        let services: HashMap<MapData, ServiceKey, ServiceValue> = HashMap::try_from(Map::HashMap(services))?;
        let backends: Array<MapData, Backend> = Array::try_from(Map::Array(open(map_names::BACKENDS)?))?;
        let source_ranges = LpmTrie::try_from(Map::LpmTrie(open(map_names::SOURCE_RANGES)?))?;
        let conntrack = Conntrack::open(pin_root)?;
        let capacity = Capacity { service_ports, backends: backends.len() };
        let sock_revnat = HashMap::try_from(Map::LruHashMap(open(map_names::SOCK_REVNAT)?))?;
        let sock_picks = HashMap::try_from(Map::LruHashMap(open(map_names::SOCK_PICKS)?))?;
        let addr_filter = Array::try_from(Map::Array(open(map_names::ADDR_FILTER)?))?;
        Ok(Self { services, addr_filter, backends, source_ranges, conntrack, sock_revnat, sock_picks, capacity })
    }
}

impl Maps for BpfMaps {
    fn capacity(&self) -> Capacity {
        self.capacity
    }

    fn source_range_capacity(&self) -> u32 {
        self.source_ranges.map().info().map_or(defaults::MAX_SOURCE_RANGES, |i| i.max_entries())
    }

    fn services(&self) -> Result<Vec<(ServiceKey, ServiceValue)>> {
        Ok(self.services.iter().collect::<Result<Vec<_>, _>>()?)
    }

    fn backends(&self, start: u32, count: u32) -> Result<Vec<Backend>> {
        (start..start.saturating_add(count))
            .map(|i| self.backends.get(&i, 0).with_context(|| format!("failed to read backend slot {i}")))
            .collect()
    }

    fn set_backends(&mut self, writes: &[(u32, Backend)]) -> Result<()> {
        mark_addresses(&mut self.addr_filter, writes.iter().map(|(_, b)| b.addr))?;
        let (slots, values): (Vec<u32>, Vec<Backend>) = writes.iter().copied().unzip();
        let fd = self.backends.map().fd().as_fd();
        match update_batch(fd, &slots, &values) {
            Ok(()) => Ok(()),
            Err((e, _)) if batch_unsupported(&e) => {
                for (slot, b) in writes {
                    self.backends.set(*slot, b, 0).with_context(|| format!("failed to write backend slot {slot}"))?;
                }
                Ok(())
            }
            Err((e, done)) => {
                Err(anyhow::Error::new(e).context(format!("batch write stopped after {done} backend slots")))
            }
        }
    }

    fn set_services(&mut self, entries: &[(ServiceKey, ServiceValue)]) -> Result<(), BatchError> {
        mark_addresses(&mut self.addr_filter, entries.iter().map(|(k, _)| k.addr))
            .map_err(|error| BatchError { done: 0, error })?;
        let (keys, values): (Vec<ServiceKey>, Vec<ServiceValue>) = entries.iter().copied().unzip();
        let fd = self.services.map().fd().as_fd();
        match update_batch(fd, &keys, &values) {
            Ok(()) => Ok(()),
            Err((e, _)) if batch_unsupported(&e) => {
                for (done, (key, value)) in entries.iter().enumerate() {
                    self.services.insert(key, value, 0).map_err(|e| BatchError { done, error: e.into() })?;
                }
                Ok(())
            }
            Err((e, done)) => Err(BatchError { done, error: e.into() }),
        }
    }

    fn source_ranges(&self) -> Result<Vec<(u32, Cidr)>> {
        self.source_ranges
            .keys()
            .map(|k| {
                let k = k?;
                let data = k.data();
                let cidr = cidr_of(data.addr, k.prefix_len() - 32).context("a malformed source range entry")?;
                Ok((u32::from_be(data.service_id), cidr))
            })
            .collect()
    }

    fn add_source_ranges(&mut self, service_id: u32, ranges: &[Cidr]) -> Result<()> {
        for cidr in ranges {
            self.source_ranges.insert(&range_key(service_id, cidr), &1, 0)?;
        }
        Ok(())
    }

    fn remove_source_ranges(&mut self, service_id: u32, ranges: &[Cidr]) -> Result<()> {
        for cidr in ranges {
            match self.source_ranges.remove(&range_key(service_id, cidr)) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn flush_flows(&mut self, flushes: &[super::UdpFlush]) -> Result<usize> {
        let by_service: std::collections::HashMap<u32, &super::UdpFlush> =
            flushes.iter().map(|f| (f.service_id, f)).collect();
        let goes_to = |service_id: u32, addr: Addr, port: u16| {
            by_service.get(&service_id).is_some_and(|f| f.gone.contains(&(addr, port)))
        };
        let gone: Vec<Addr> = flushes.iter().flat_map(|f| f.gone.iter().map(|(addr, _)| *addr)).collect();
        let families = [gone.iter().any(Addr::is_v4), gone.iter().any(|a| !a.is_v4())];
        // A flow's forward entry holds the endpoint it was translated to, its reply entry is
        // keyed by it.
        let (_, flushed) = self.conntrack.remove_where_in(families, |k, v| {
            goes_to(v.service_id, v.dst_addr, v.dst_port) || goes_to(v.service_id, k.src_addr, k.src_port)
        })?;
        // The socket path's flows: sockets it connected to these backends through these services.
        let cookies: BTreeSet<u64> = super::conntrack::read_all_of(&self.sock_revnat)
            .into_iter()
            .filter(|(k, v)| goes_to(v.service_id, k.addr, k.port))
            .map(|(k, _)| k.cookie)
            .collect();
        let aborted = if cookies.is_empty() { 0 } else { super::sockets::abort_udp(&cookies, &gone) };
        // Unconnected sockets keep the endpoint they picked for a frontend (`KPR_SOCK_PICKS`):
        // forgotten, so that their next datagram picks again (the programs can tell a gone
        // endpoint themselves only in a service of at most 64).
        let through = |k: &SockRevNatKey, f: &super::UdpFlush| {
            f.frontends
                .iter()
                .any(|(addr, port)| *port == k.port && (*addr == k.addr || *addr == addr.unspecified_like()))
        };
        let picks: Vec<SockRevNatKey> = super::conntrack::read_all_of(&self.sock_picks)
            .into_iter()
            .filter(|(k, b)| flushes.iter().any(|f| f.gone.contains(&(b.addr, b.port)) && through(k, f)))
            .map(|(k, _)| k)
            .collect();
        let forgotten = picks.iter().filter(|k| self.sock_picks.remove(k).is_ok()).count();
        Ok(flushed + aborted + forgotten)
    }

    fn remove_service(&mut self, key: &ServiceKey) -> Result<()> {
        match self.services.remove(key) {
            Ok(()) => Ok(()),
            Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

fn range_key(service_id: u32, cidr: &Cidr) -> LpmKey<SourceRange> {
    let (addr, len) = lpm_prefix(cidr);
    LpmKey::new(32 + len, SourceRange { service_id: service_id.to_be(), addr })
}

/// A CIDR as the LPM maps hold it (`Cidr` keeps its base masked, so equal ranges make equal
/// keys): an IPv4 prefix mapped, `Addr::V4_PREFIX_OFFSET` bits longer.
fn lpm_prefix(cidr: &Cidr) -> (Addr, u32) {
    let offset = if cidr.addr.is_ipv4() { Addr::V4_PREFIX_OFFSET } else { 0 };
    (cidr.addr.into(), offset + u32::from(cidr.len))
}

/// The CIDR of an LPM entry (see [`lpm_prefix`]).
fn cidr_of(addr: Addr, len: u32) -> Option<Cidr> {
    let offset = if addr.is_v4() { Addr::V4_PREFIX_OFFSET } else { 0 };
    Cidr::new(addr.into(), u8::try_from(len.checked_sub(offset)?).ok()?)
}

/// The node facts the programs look packets up in, read from the pins (`kpr trace`).
#[derive(Clone, Debug, Default)]
pub struct NodeView {
    /// This node's addresses → `NODE_ADDR_*` bits.
    pub node_addrs: BTreeMap<IpAddr, u32>,
    /// The local-traffic detector's CIDRs.
    pub local_cidrs: Vec<Cidr>,
    /// The cluster's service ranges.
    pub service_cidrs: Vec<Cidr>,
}

pub fn read_node_view(pin_root: &Path) -> Result<NodeView> {
    let open = |name: &str| open_pinned_map(pin_root, name);
    let addrs: HashMap<MapData, Addr, u32> = HashMap::try_from(Map::HashMap(open(map_names::NODE_ADDRS)?))?;
    let cidrs = |name: &str| -> Result<Vec<Cidr>> {
        let trie: LpmTrie<MapData, CidrKey, u8> = LpmTrie::try_from(Map::LpmTrie(open(name)?))?;
        trie.keys()
            .map(|k| {
                let k = k?;
                cidr_of(k.data().addr, k.prefix_len()).context("a malformed CIDR entry")
            })
            .collect()
    };
    Ok(NodeView {
        node_addrs: addrs.iter().filter_map(Result::ok).map(|(a, f)| (IpAddr::from(a), f)).collect(),
        local_cidrs: cidrs(map_names::LOCAL_CIDRS)?,
        service_cidrs: cidrs(map_names::SERVICE_CIDRS)?,
    })
}

/// The datapath's per-CPU counters, summed, by name.
pub fn read_counters(pin_root: &Path) -> Result<Vec<(&'static str, u64)>> {
    let map = open_pinned_map(pin_root, map_names::COUNTERS)?;
    let counters: PerCpuArray<MapData, u64> = PerCpuArray::try_from(Map::PerCpuArray(map))?;
    (0..counter::COUNT).map(|i| Ok((counter::NAMES[i as usize], counters.get(&i, 0)?.iter().sum()))).collect()
}

/// Remove kpr's pins: the links (which detaches the programs once no agent holds them) and
/// the maps. What `kube-proxy --cleanup` is to iptables rules.
pub fn cleanup(pin_root: &Path) -> Result<()> {
    // Another layout's pins too: an upgrade stopped before the new agent's first sync leaves
    // the old one's attached.
    let dirs = other_layouts(pin_root).into_iter().chain([(PIN_LAYOUT_VERSION, pin_dir(pin_root))]);
    for (version, dir) in dirs.filter(|(_, dir)| dir.exists()) {
        // What kpr changed on the links is read from the links' map, when it reads as ours.
        if reads_as_ours(version, map_names::LINKS) {
            undo_host_changes(&dir);
        }
        for entry in fs::read_dir(&dir)? {
            let path = entry?.path();
            fs::remove_file(&path).with_context(|| format!("failed to remove {}", path.display()))?;
        }
        fs::remove_dir(&dir)?;
    }
    // Remove the root too when it is ours and now empty.
    let _ = fs::remove_dir(pin_root);
    Ok(())
}

/// `union bpf_attr`'s member for the `BPF_MAP_*_BATCH` commands.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// The bpf(2) call of batch command `cmd` (aya has no wrapper for batch ops).
///
/// # Safety
/// `attr`'s buffers hold `count` keys and values of the map's sizes (and a token) for the call.
unsafe fn batch_op(cmd: libc::c_long, attr: &mut BatchAttr) -> libc::c_long {
    // SAFETY: the caller's.
    unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size_of::<BatchAttr>()) }
}

/// Every entry of hash map `map`, read thousands at a time (`BPF_MAP_LOOKUP_BATCH`, 5.6+):
/// a walk one entry at a time takes two system calls per entry, which made a conntrack table
/// of 40,000 entries cost about 100 ms per walk, and the agent walks it for every UDP endpoint
/// that stops serving. `None` where the kernel has no batch reads for the map (walk it one
/// entry at a time then). A concurrent change may be seen or not, as with the other walk.
pub(crate) fn lookup_batch<K: aya::Pod, V: aya::Pod>(map: &MapData) -> Option<Vec<(K, V)>> {
    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    // Larger than any bucket of the kernel's hash tables (`ENOSPC` otherwise).
    const CHUNK: usize = 4096;
    let fd = map.fd().as_fd().as_raw_fd() as u32;
    let mut keys: Vec<K> = Vec::with_capacity(CHUNK);
    let mut values: Vec<V> = Vec::with_capacity(CHUNK);
    let mut out = Vec::new();
    // The batch token: the kernel's bucket index (4 bytes for hash maps; room for 8).
    let (mut token_in, mut token_out) = (0u64, 0u64);
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { (&raw const token_in) as u64 },
            out_batch: (&raw mut token_out) as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd,
            ..BatchAttr::default()
        };
        // SAFETY: the kernel writes at most `count` keys and values into buffers of that
        // capacity, and the token into `token_out`.
        let rc = unsafe { batch_op(BPF_MAP_LOOKUP_BATCH, &mut attr) };
        let errno = if rc < 0 { std::io::Error::last_os_error().raw_os_error() } else { None };
        if rc < 0 && errno != Some(libc::ENOENT) {
            return None;
        }
        // SAFETY: the kernel filled `count` of each (also on ENOENT: the last batch).
        unsafe {
            keys.set_len(attr.count as usize);
            values.set_len(attr.count as usize);
        }
        out.extend(keys.drain(..).zip(values.drain(..)));
        if errno == Some(libc::ENOENT) {
            return Some(out);
        }
        token_in = token_out;
        first = false;
    }
}

/// BPF_MAP_UPDATE_BATCH (kernel 5.6+): one syscall for many elements, in order. aya has no
/// wrapper for it. On error, also returns how many elements were written.
fn update_batch<K: Copy, V: Copy>(fd: BorrowedFd<'_>, keys: &[K], values: &[V]) -> Result<(), (std::io::Error, usize)> {
    const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
    if keys.is_empty() {
        return Ok(());
    }
    let mut attr = BatchAttr {
        in_batch: 0,
        out_batch: 0,
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: u32::try_from(keys.len()).expect("batch fits u32"),
        map_fd: fd.as_raw_fd() as u32,
        elem_flags: 0,
        flags: 0,
    };
    // SAFETY: attr points at keys/values arrays of `count` elements of the map's key and value
    // size, which outlive the call.
    let rc = unsafe { batch_op(BPF_MAP_UPDATE_BATCH, &mut attr) };
    if rc < 0 {
        return Err((std::io::Error::last_os_error(), attr.count as usize));
    }
    Ok(())
}

fn batch_unsupported(e: &std::io::Error) -> bool {
    // ENOTSUPP (524) from kernels or map types without batch ops; EINVAL from pre-5.6 kernels.
    matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(524) | Some(libc::EOPNOTSUPP))
}

#[cfg(test)]
mod kfunc_call_tests {
    use super::*;

    #[test]
    fn only_the_stand_in_calls_become_the_kfuncs() {
        let insn = |code: u8, regs: u8, imm: u32| -> [u8; 8] {
            let mut i = [code, regs, 0, 0, 0, 0, 0, 0];
            i[4..].copy_from_slice(&imm.to_le_bytes());
            i
        };
        let standin = proxy_common::CAST_TO_KERN_CTX_STANDIN;
        // A helper call, a stand-in call, a load of the same constant, a stand-in call; and a
        // tail that is not a whole instruction.
        let object: Vec<u8> =
            [insn(0x85, 0, 1), insn(0x85, 0, standin), insn(0xb7, 1, standin), insn(0x85, 0, standin)]
                .concat()
                .into_iter()
                .chain([0x85, 0, 0])
                .collect();
        let words = with_kfunc_calls(&object, 63539);
        // SAFETY: the words' bytes.
        let patched = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), object.len()) };
        let want: Vec<u8> =
            [insn(0x85, 0, 1), insn(0x85, 0x20, 63539), insn(0xb7, 1, standin), insn(0x85, 0x20, 63539)]
                .concat()
                .into_iter()
                .chain([0x85, 0, 0])
                .collect();
        assert_eq!(patched, want.as_slice());
        assert_eq!(words.as_ptr() as usize % 8, 0);
    }
}
