//! The eBPF object: its load-time settings (`DatapathConfig`), what the kernel offers it
//! (kfuncs, `sk_buff` layout, version), loading it, and its log.
use std::{fs, path::PathBuf};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData},
    programs::SchedClassifier,
    util::KernelVersion,
};
use proxy_common::{CtTimeouts, defaults, map_names, program_names};

use super::cgroup::netns_cookie;
use super::host::{TC_PROGRAMS, TC_PROGRAMS_L3, set_host_forward_direct};
use super::pins::{carry_over_maps, check_owner, pin_dir};

/// The eBPF object built from `proxy-ebpf` by build.rs.
pub(super) static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy"));

/// The Maglev seed of a cluster that sets none: fixed, so that nodes agree unless told otherwise.
pub const DEFAULT_MAGLEV_SEED: u32 = 0x6b70_7231;

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
    /// Reverse-translation entries one network namespace's sockets may hold (a pod's, or the
    /// node's); 0: a sixteenth of `max_sock_revnat`.
    pub max_sock_revnat_per_pod: u32,
    /// Entries of the loadBalancerSourceRanges map.
    pub max_source_ranges: u32,
    /// Endpoints counted per endpoint (`KPR_ENDPOINT_STATS`'s size); 0: none.
    pub endpoint_counters: u32,
    /// `--maglev-seed`: the Maglev tables' and tuple hash's seed, the same on every node.
    pub maglev_seed: u32,
    /// `--maglev-table-size`: slots of every Maglev table (a prime), the same on every node.
    pub maglev_table_size: u32,
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
    /// The socket path translates pods' sockets too (`--socket-lb all`); false: the node's
    /// only, pods are served per packet on their links (needs `pod_links_covered`).
    pub socket_lb_pods: bool,
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
    /// Where the XDP program goes in front of tc (`--xdp`).
    pub xdp: super::xdp::XdpSetting,
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
            max_sock_revnat_per_pod: 0,
            max_source_ranges: defaults::MAX_SOURCE_RANGES,
            endpoint_counters: 0,
            maglev_seed: DEFAULT_MAGLEV_SEED,
            maglev_table_size: proxy_common::MAGLEV_DEFAULT_TABLE_SIZE,
            max_conntrack: defaults::MAX_CONNTRACK,
            max_conntrack_new: defaults::MAX_CONNTRACK_NEW,
            detect_local: proxy_common::DETECT_LOCAL_NONE,
            localhost_node_ports: false,
            pod_links_covered: false,
            socket_lb_pods: true,
            // The agent's own default is `Auto` (its flag), which needs its watch of the host
            // to write `KPR_HOST_STATE`; a datapath loaded without one forwards directly.
            forward_direct: ForwardDirect::Always,
            xdp: super::xdp::XdpSetting::Off,
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

/// The seed of the per-packet path's flow hash: the same for every agent of this boot (a
/// restarted agent re-creates lost flows as they were), unknown off the node.
pub fn flow_hash_seed() -> u32 {
    let boot_id = fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    // FNV-1a: stable across builds (std's hasher is not).
    boot_id.trim().bytes().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// kube-proxy's default NodePort range, which operators keep free of other uses
/// (`ip_local_reserved_ports`): masquerade stays out of it too.
pub(super) const NODE_PORT_RANGE: (u16, u16) = (30_000, 32_767);

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
pub(super) fn largest_free_run(taken: &[(u16, u16)]) -> (u16, u16) {
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

/// The running kernel is `major.minor` or later.
pub(crate) fn kernel_since(major: u8, minor: u8) -> bool {
    KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(major, minor, 0))
}

/// The reverse-translation entries one network namespace's sockets may hold, and all of them
/// (`KPR_SOCK_SHARE`, `KPR_SOCK_LIMIT`), for a table of `capacity`. The limit leaves room that
/// the kernel's LRU keeps in per-CPU free lists (up to 128 entries a CPU): with the table's
/// use below it, the LRU never evicts a live socket's entry to make room for another's.
pub(super) fn sock_revnat_shares(capacity: u32, per_pod: u32, cpus: u32) -> (u32, u32) {
    let headroom = (capacity / 8).max(128 * cpus).min(capacity / 2);
    let limit = capacity - headroom;
    let share = if per_pod == 0 { capacity / defaults::SOCK_REVNAT_SHARE } else { per_pod };
    (share.min(limit), limit)
}

/// CPUs the kernel may bring up (the per-CPU lists' count), 1 if it cannot be read.
fn possible_cpus() -> u32 {
    aya::util::nr_cpus().map_or(1, |n| n.get())
}

/// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK (later ones to the memory cgroup):
/// lift it, which needs CAP_SYS_RESOURCE; without it, say why map creation may fail.
pub fn raise_memlock_limit() {
    let unlimited = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: setrlimit reads one rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } == 0 {
        return;
    }
    let error = std::io::Error::last_os_error();
    if !kernel_since(5, 11) {
        tracing::warn!(
            "cannot lift the locked-memory limit ({error}): this kernel charges BPF maps to it, so large maps \
             may fail (give the agent CAP_SYS_RESOURCE)"
        );
    }
}

/// Where the programs may read an skb's checksum state themselves (6.2+): the id of the kfunc
/// `bpf_cast_to_kern_ctx`, and `sk_buff.ip_summed` as `byte << 8 | bit`. Then a translated
/// packet whose checksum is complete is fixed in place, without the checksum helper's call.
pub(super) fn kernel_skb_checksum_state() -> Option<(u32, u32)> {
    if !kernel_since(6, 2) {
        return None;
    }
    let btf = crate::datapath::kernel_btf::KernelBtf::from_sys_fs()
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
pub(super) fn with_kfunc_calls(object: &[u8], id: u32) -> Vec<u64> {
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
    if host_netns == 0 && !cfg.socket_lb_pods {
        bail!(
            "--socket-lb host-only needs the kernel to tell network namespaces apart (SO_NETNS_COOKIE, 5.14+): \
             without it a pod's socket cannot be told from the node's"
        );
    }
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
    let socket_lb_pods = u8::from(cfg.socket_lb_pods);
    let localhost_node_ports = u8::from(cfg.localhost_node_ports);
    let forward_direct = u8::from(cfg.forward_direct != ForwardDirect::Never);
    let refuse_service_range = u8::from(cfg.refuse_service_range);
    let endpoint_counters = u8::from(cfg.endpoint_counters != 0);
    // Counters, not state: a pinned map of another size (the flag changed) is made anew.
    let endpoint_stats = cfg.endpoint_counters.max(1);
    let endpoint_stats_pin = dir.join(map_names::ENDPOINT_STATS);
    if MapData::from_pin(&endpoint_stats_pin).is_ok_and(|m| m.info().is_ok_and(|i| i.max_entries() != endpoint_stats)) {
        let _ = std::fs::remove_file(&endpoint_stats_pin);
    }
    // Tables, written anew at every start: a pinned map sized for another table size is made
    // anew (the running programs keep the old one until they are replaced).
    let maglev_entries = defaults::MAX_MAGLEV_FRONTENDS * proxy_common::maglev_chunks(cfg.maglev_table_size);
    let maglev_pin = dir.join(map_names::MAGLEV);
    if MapData::from_pin(&maglev_pin).is_ok_and(|m| m.info().is_ok_and(|i| i.max_entries() != maglev_entries)) {
        let _ = std::fs::remove_file(&maglev_pin);
    }
    let seed = flow_hash_seed();
    let mut carried = carry_over_maps(&cfg.pin_root);
    let sock_revnat = size(map_names::SOCK_REVNAT, cfg.max_sock_revnat);
    let (sock_share, sock_limit) = sock_revnat_shares(sock_revnat, cfg.max_sock_revnat_per_pod, possible_cpus());
    let mut loader = EbpfLoader::new();
    loader
        .default_map_pin_directory(&dir)
        .map_max_entries(map_names::SERVICES, size(map_names::SERVICES, cfg.max_service_ports))
        // An entry per service port at most (the agent removes a port's with it).
        .map_max_entries(map_names::SERVICE_STATS, size(map_names::SERVICE_STATS, cfg.max_service_ports))
        .map_max_entries(map_names::BACKENDS, size(map_names::BACKENDS, cfg.max_backends))
        .map_max_entries(map_names::SOCK_REVNAT, sock_revnat)
        .map_max_entries(map_names::SOCK_PICKS, size(map_names::SOCK_PICKS, cfg.max_sock_revnat))
        .map_max_entries(map_names::SOCK_TCP, size(map_names::SOCK_TCP, cfg.max_sock_revnat))
        .map_max_entries(map_names::CONNTRACK4, size(map_names::CONNTRACK4, cfg.max_conntrack))
        .map_max_entries(map_names::CT_NEW4, size(map_names::CT_NEW4, cfg.max_conntrack_new))
        .map_max_entries(map_names::CONNTRACK6, size(map_names::CONNTRACK6, cfg.max_conntrack))
        .map_max_entries(map_names::CT_NEW6, size(map_names::CT_NEW6, cfg.max_conntrack_new))
        .map_max_entries(map_names::SOURCE_RANGES, size(map_names::SOURCE_RANGES, cfg.max_source_ranges))
        .map_max_entries(map_names::ENDPOINT_STATS, endpoint_stats)
        .map_max_entries(map_names::MAGLEV, maglev_entries)
        .override_global("KPR_ENDPOINT_COUNTERS", &endpoint_counters, true)
        .override_global("KPR_HAVE_SET_RETVAL", &have_set_retval, true)
        .override_global("KPR_COARSE_CLOCK", &have_coarse_clock, true)
        .override_global("KPR_HOST_NETNS_COOKIE", &host_netns, true)
        .override_global("KPR_POD_LINKS_COVERED", &pod_links_covered, true)
        .override_global("KPR_SOCKET_LB_PODS", &socket_lb_pods, true)
        .override_global("KPR_LOCALHOST_NODEPORTS", &localhost_node_ports, true)
        .override_global("KPR_AGENT_CGROUP_ID", &cfg.agent_cgroup_id, true)
        .override_global("KPR_SOCK_SHARE", &sock_share, true)
        .override_global("KPR_SOCK_LIMIT", &sock_limit, true)
        .override_global("KPR_FORWARD_DIRECT", &forward_direct, true)
        .override_global("KPR_REDIRECT_NEXT_HOP", &redirect_next_hop, true)
        .override_global("KPR_DETECT_LOCAL", &cfg.detect_local, true)
        .override_global("KPR_REFUSE_SERVICE_RANGE", &refuse_service_range, true)
        .override_global("KPR_SNAT_PORT_MIN", &snat_ports.0, true)
        .override_global("KPR_SNAT_PORT_MAX", &snat_ports.1, true)
        .override_global("KPR_CT_TIMEOUTS", &cfg.ct_timeouts, true)
        .override_global("KPR_FLOW_HASH_SEED", &seed, true)
        .override_global("KPR_MAGLEV_SEED", &cfg.maglev_seed, true)
        .override_global("KPR_MAGLEV_TABLE_SIZE", &cfg.maglev_table_size, true)
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

/// Load the tc programs: the attached ones, and the slow programs they hand packets to, put in
/// their `KPR_TC_SLOW_PATH` slots (pinned: they stay there when the agent is gone). Before
/// any map is taken out of the object (that would break the programs' relocation).
///
/// The verifier takes most of an agent's start, mostly on the slow programs. It verifies a
/// privileged load without a global lock, so the programs load side by side, a thread per CPU
/// (a release build's start on this 2-CPU machine: 4.0 s one by one, 2.0 s side by side).
pub fn load_tc_programs(ebpf: &mut Ebpf) -> Result<()> {
    // The slow programs, where the verifier spends its time, first.
    let names: Vec<&str> = program_names::TC_SLOW_PATH.into_iter().chain(TC_PROGRAMS).chain(TC_PROGRAMS_L3).collect();
    let mut programs: Vec<Option<(&str, &mut SchedClassifier)>> = names.iter().map(|_| None).collect();
    for (name, program) in ebpf.programs_mut() {
        if let Some(i) = names.iter().position(|n| *n == name) {
            programs[i] = Some((names[i], program.try_into()?));
        }
    }
    let queue: std::collections::VecDeque<_> = programs
        .into_iter()
        .zip(&names)
        .map(|(program, name)| program.with_context(|| format!("program `{name}` missing from the eBPF object")))
        .collect::<Result<_>>()?;
    // A verifier run takes memory as well as CPU: a few at once on a big node is enough.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(4).min(queue.len());
    let queue = std::sync::Mutex::new(queue);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    loop {
                        // Taken in its own statement: the lock is not held while loading.
                        let next = queue.lock().expect("not poisoned").pop_front();
                        let Some((name, prog)) = next else { return Ok(()) };
                        let started = std::time::Instant::now();
                        if let Err(e) = prog.load() {
                            // The others stop at their next program: the start fails anyway.
                            queue.lock().expect("not poisoned").clear();
                            return Err(e).with_context(|| format!("the verifier rejected `{name}`"));
                        }
                        tracing::debug!(program = name, elapsed_ms = started.elapsed().as_millis() as u64, "loaded");
                    }
                })
            })
            .collect();
        workers.into_iter().try_for_each(|worker| worker.join().expect("a loading thread panicked"))
    })?;
    super::host::fill_slow_path_slots(ebpf)
}

/// Forward eBPF log records (slow paths only) to the agent's log, when running under tokio.
pub(super) fn start_ebpf_logger(ebpf: &mut Ebpf) {
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

#[cfg(test)]
mod sock_revnat_share_tests {
    use super::sock_revnat_shares;

    #[test]
    fn a_namespace_gets_a_sixteenth_and_the_lru_keeps_its_per_cpu_room() {
        // The default table on 2 CPUs: an eighth kept free, a sixteenth per namespace.
        assert_eq!(sock_revnat_shares(65_536, 0, 2), (4_096, 57_344));
        // 128 CPUs keep 128 entries each in their free lists.
        assert_eq!(sock_revnat_shares(65_536, 0, 128), (4_096, 49_152));
        // A share of its own, never above the limit; a small table keeps at least half.
        assert_eq!(sock_revnat_shares(4_096, 100, 2), (100, 3_584));
        assert_eq!(sock_revnat_shares(1_024, 5_000, 64), (512, 512));
    }
}
