//! Loading, pinning and attaching the eBPF programs, and the kernel implementation of [`Maps`].
//!
//! Everything lives under a versioned pin directory (`<pin-root>/v<N>`): the maps (by name) and
//! one link per cgroup hook. A restarted agent (also after `kill -9`) reuses the pinned maps
//! with their contents and swaps its freshly loaded programs into the pinned links in place
//! (BPF_LINK_UPDATE), so established connections and the service table are never interrupted.
//!
//! `object`: the object, its settings and the kernel's features; `pins`: the pin directory and
//! its layouts; `batch`: the batch reads and writes aya lacks; `cgroup`: the socket hooks' cgroup and links; `handover`: the flows left to netfilter; `host`: the per-packet programs
//! on the node's links and the node maps; `xdp`: the XDP program in front of them (`--xdp`);
//! `maps`: the service maps ([`Maps`](super::Maps)).
pub(super) mod batch;
mod cgroup;
mod handover;
mod host;
mod maps;
mod object;
pub(super) mod pins;
mod probe;
mod xdp;

use std::fs::{self, File};

use anyhow::{Context as _, Result};
use aya::{
    programs::{CgroupAttachMode, CgroupSockAddr},
    util::KernelVersion,
};

pub(crate) use self::object::kernel_since;
use self::{
    cgroup::{HOOKS, attach_sock_ops, attach_sock_release, pin_replacing, reuse_cgroup_link},
    object::start_ebpf_logger,
    pins::OlderConntrack,
};
pub use self::{
    cgroup::{agent_cgroup_id, cgroup2_dir, cgroup2_root, netns_cookie, own_cgroup},
    handover::HandoverMaps,
    host::{
        BpfHost, HostDatapath, HostState, SocketProbes, cleanup, fill_slow_path_slots, link_name, read_covered_netns,
        read_links, read_socket_skip, write_service_ranges,
    },
    maps::{BpfMaps, NodeView, read_counters, read_endpoint_stats, read_node_view, read_service_stats},
    object::{
        DEFAULT_MAGLEV_SEED, DatapathConfig, ForwardDirect, flow_hash_seed, load_tc_programs, open_object,
        raise_memlock_limit, snat_port_range,
    },
    pins::{AgentLock, open_pinned_map, other_layout_names, pin_dir, pins_missing},
    xdp::{XdpSetting, load_program as load_xdp_program},
};

/// The service maps, and the host side (programs, links, node maps).
pub struct BpfDatapath {
    pub maps: BpfMaps,
    pub host: BpfHost,
}

impl BpfDatapath {
    /// Load everything and attach the socket hooks; the per-packet programs are attached by
    /// [`HostDatapath::apply_node`] as links are known.
    pub fn load(cfg: &DatapathConfig) -> Result<Self> {
        let dir = pin_dir(&cfg.pin_root);
        // This layout's directory is made by this start: a first start, or an upgrade.
        let fresh = fs::read_dir(&dir).map_or(true, |mut files| files.next().is_none());
        let mut ebpf = open_object(cfg)?;
        // An upgrade: the older layout's established flows, copied before the new programs
        // attach; what its programs change until they detach follows at their retirement.
        let older_conntrack = if fresh { OlderConntrack::open(&cfg.pin_root) } else { None };
        let older_conntrack = older_conntrack.map(|mut older| {
            older.sync();
            older
        });
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
                pin_replacing(prog.take_link(id)?.try_into()?, &link_path)?;
                tracing::debug!(program = name, cgroup = %cfg.cgroup.display(), "attached and pinned");
            }
        }
        // Without it, closed sockets' entries would stay counted and their namespaces' shares
        // fill for good: the socket path does not run without it.
        attach_sock_release(&mut ebpf, &cgroup, &dir).context("failed to attach the socket release hook")?;
        attach_sock_ops(&mut ebpf, &cgroup, &dir).context("failed to attach the socket answers program")?;
        load_tc_programs(&mut ebpf)?;
        if cfg.xdp != XdpSetting::Off {
            xdp::load_program(&mut ebpf)?;
        }

        let mut maps = BpfMaps::take_from(&mut ebpf)?;
        maps.endpoint_counters = cfg.endpoint_counters;
        maps.maglev_seed = cfg.maglev_seed;
        maps.maglev_table_size = cfg.maglev_table_size;
        let tc_netlink = cfg.tc_netlink || !KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0));
        // Another layout's programs keep serving until this agent's first sync is written
        // ([`HostDatapath::retire_other_layouts`]).
        let mut host = BpfHost::take_from(ebpf, dir, tc_netlink, cfg.pin_root.clone(), older_conntrack)?;
        host.maglev = Some((cfg.maglev_seed, cfg.maglev_table_size));
        host.xdp = cfg.xdp;
        host.socket_probes = Some(SocketProbes {
            cgroup: super::socket_probe::cgroup_for_probes(&cfg.cgroup, own_cgroup().ok().as_deref()),
            pod_links_covered: cfg.pod_links_covered,
        });
        Ok(Self { maps, host })
    }
}
