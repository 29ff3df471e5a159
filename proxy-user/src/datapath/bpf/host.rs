//! The host side: the per-packet programs on the node's links (TCX or netlink filters), the
//! node maps (addresses, links, CIDRs), and undoing what kpr changed on the node (`kpr cleanup`).
use std::{
    borrow::BorrowMut,
    collections::{BTreeMap, BTreeSet},
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf,
    maps::{Array, HashMap, LpmTrie, Map, MapData, ProgramArray, lpm_trie::Key as LpmKey},
    programs::{
        NetworkInterface, SchedClassifier, TcAttachType,
        links::{FdLink, PinnedLink},
        tc::SchedClassifierLink,
    },
};
use proxy_common::{Addr, CidrKey, CidrMask, LinkInfo, PIN_LAYOUT_VERSION, map_names, program_names};

use super::cgroup::netns_cookie;
use super::maps::{cidr_of, lpm_prefix, mark_addresses};
use super::pins::{
    OlderConntrack, link_pin, links_pinned, open_pinned_map, other_layouts, pin_dir, reads_as_ours, release_link,
    remove_other_layouts,
};
use crate::{
    datapath::conntrack::Conntrack,
    model::{cidr::Cidr, node::NodePlan},
    verify::{Probe, ProbeEnv, SocketSeen},
};

/// Tell the programs whether translated packets may skip the host's forwarding path now
/// (`KPR_HOST_STATE`, read per packet; [`ForwardDirect::Auto`]'s runtime switch).
pub(super) fn set_host_forward_direct<T: BorrowMut<MapData>>(map: &mut Array<T, u32>, ok: bool) -> Result<()> {
    let state = if ok { proxy_common::HOST_FORWARD_DIRECT_OK } else { 0 };
    map.set(proxy_common::host_state::FORWARD, &state, 0).context("failed to write KPR_HOST_STATE")
}

/// Put the loaded slow programs in their `KPR_TC_SLOW_PATH` slots (again, after the self-check
/// found one the attached programs could not reach).
pub fn fill_slow_path_slots(ebpf: &mut Ebpf) -> Result<()> {
    for (slot, name) in (0u32..).zip(program_names::TC_SLOW_PATH) {
        let fd = ebpf.program(name).context("a slow tc program")?.fd()?.try_clone()?;
        let map = ebpf.map_mut(map_names::TC_SLOW_PATH).context("KPR_TC_SLOW_PATH missing from the eBPF object")?;
        ProgramArray::try_from(map)?.set(slot, &fd, 0).context("failed to fill KPR_TC_SLOW_PATH")?;
    }
    Ok(())
}

/// The pinned `KPR_HOST_STATE` map: may translated packets skip the host's forwarding path?
pub struct HostState(Array<MapData, u32>);

impl HostState {
    pub fn open(pin_root: &Path) -> Result<Self> {
        Ok(Self(Array::try_from(Map::Array(open_pinned_map(pin_root, map_names::HOST_STATE)?))?))
    }

    pub fn forward_direct(&self) -> Result<bool> {
        Ok(self.0.get(&proxy_common::host_state::FORWARD, 0)? & proxy_common::HOST_FORWARD_DIRECT_OK != 0)
    }

    /// Tell the programs an older layout is being retired (`HOST_RETIRING_OLDER_LAYOUT`).
    pub fn set_retiring_older_layout(&mut self, on: bool) -> Result<()> {
        let state = if on { proxy_common::HOST_RETIRING_OLDER_LAYOUT } else { 0 };
        self.0.set(proxy_common::host_state::UPGRADE, &state, 0).context("failed to write KPR_HOST_STATE")
    }

    pub fn set_forward_direct(&mut self, ok: bool) -> Result<()> {
        set_host_forward_direct(&mut self.0, ok)
    }
}

/// `KPR_LINKS`: the node's links as the programs know them, by ifindex (and the special entries).
pub fn read_links(pin_root: &Path) -> Result<Vec<(u32, LinkInfo)>> {
    let map: HashMap<MapData, u32, LinkInfo> =
        HashMap::try_from(Map::HashMap(open_pinned_map(pin_root, map_names::LINKS)?))?;
    Ok(map.iter().filter_map(Result::ok).collect())
}

/// The pods' cgroups the socket path leaves alone (`KPR_SOCKET_SKIP`): cgroup id → its level.
pub fn read_socket_skip(pin_root: &Path) -> Result<BTreeMap<u64, u32>> {
    let map: HashMap<MapData, u64, u32> =
        HashMap::try_from(Map::HashMap(open_pinned_map(pin_root, map_names::SOCKET_SKIP)?))?;
    Ok(map.iter().filter_map(Result::ok).filter(|(id, _)| *id != 0).collect())
}

/// The network namespaces the socket path takes as covered by the per-packet path
/// (`KPR_COVERED_NETNS`, by cookie; key 0 aside).
pub fn read_covered_netns(pin_root: &Path) -> Result<std::collections::BTreeSet<u64>> {
    let map: HashMap<MapData, u64, u8> =
        HashMap::try_from(Map::HashMap(open_pinned_map(pin_root, map_names::COVERED_NETNS)?))?;
    Ok(map.keys().filter_map(Result::ok).filter(|cookie| *cookie != 0).collect())
}

/// The attached tc programs, ingress then egress; also the names of their pinned TCX links.
pub(super) const TC_PROGRAMS: [&str; 2] = [program_names::TC_INGRESS, program_names::TC_EGRESS];

/// The same on links without Ethernet (`LINK_FLAG_NOT_ETHERNET`); their links are pinned
/// under `TC_PROGRAMS`' names, so that a restart swaps whichever program is attached.
pub(super) const TC_PROGRAMS_L3: [&str; 2] = [program_names::TC_INGRESS_L3, program_names::TC_EGRESS_L3];

/// The programs for a link with these `KPR_LINKS` flags, paired with their hooks.
fn programs_for(flags: u32) -> [(&'static str, &'static str, TcAttachType); 2] {
    let programs = if flags & proxy_common::LINK_FLAG_NOT_ETHERNET != 0 { TC_PROGRAMS_L3 } else { TC_PROGRAMS };
    [(programs[0], TC_PROGRAMS[0], TcAttachType::Ingress), (programs[1], TC_PROGRAMS[1], TcAttachType::Egress)]
}

/// Links whose `KPR_LINKS` entry carries `flag`.
pub(super) fn links_flagged<T: std::borrow::Borrow<MapData>>(
    links: &HashMap<T, u32, LinkInfo>,
    flag: u32,
) -> BTreeSet<u32> {
    links
        .iter()
        .filter_map(Result::ok)
        .filter(|(ifindex, info)| *ifindex < proxy_common::LINK_FIRST_SPECIAL && info.flags & flag != 0)
        .map(|(ifindex, _)| ifindex)
        .collect()
}

/// The network namespace cookie recorded in `KPR_LINKS` (see [`proxy_common::LINK_NETNS`]).
pub(super) fn links_netns<T: std::borrow::Borrow<MapData>>(links: &HashMap<T, u32, LinkInfo>) -> Option<u64> {
    let info = links.get(&proxy_common::LINK_NETNS, 0).ok()?;
    Some(u64::from(info.flags) << 32 | u64::from(info.addr))
}

/// kpr's netlink tc filters: this priority and handle on a link's clsact ingress and egress.
pub(super) const NETLINK_PRIORITY: u16 = 1000;

pub(super) const NETLINK_HANDLE: u32 = 0x4b50;

/// kpr's netlink filter on `ifindex` for `attach_type`, as a link to replace or drop.
pub(super) fn netlink_filter(ifindex: u32, attach_type: TcAttachType) -> Result<SchedClassifierLink> {
    Ok(SchedClassifierLink::attached(
        NetworkInterface::Index(ifindex),
        attach_type.into(),
        NETLINK_PRIORITY,
        NETLINK_HANDLE.into(),
        None,
    )?)
}

/// Remove kpr's netlink filters from `ifindex` (dropping such a link deletes its filter).
pub(super) fn remove_netlink_filters(ifindex: u32) {
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
pub(super) fn reset_accept_local(ifindex: u32) {
    let Some(name) = link_name(ifindex) else {
        return; // the link is gone, and its setting with it
    };
    match crate::datapath::devconf::set_accept_local(ifindex, false) {
        Ok(()) => tracing::info!(interface = %name, "accept_local turned off again"),
        Err(e) => tracing::warn!(interface = %name, "failed to turn accept_local off again: {e}"),
    }
}

/// `kpr cleanup`: undo what kpr changed on the node's links (accept_local, netlink filters).
pub(super) fn undo_host_changes(dir: &Path) {
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

/// The host side of the datapath: where the per-packet programs are attached and what they
/// know of the node (its addresses, links, the detector's CIDRs).
pub trait HostDatapath: Send {
    /// Make the node maps and the per-packet attachments match `plan`. A link that cannot be
    /// attached is logged and retried at the next call; the rest still applies.
    fn apply_node(&mut self, plan: &NodePlan) -> Result<()>;

    /// The agent's first sync is written: another layout's programs, left serving until now
    /// (an upgrade or a downgrade), go.
    fn retire_other_layouts(&mut self) {}

    /// `kpr verify`: the node as the probes see it; `None` while no link holds the per-packet
    /// programs (nothing to probe).
    fn probe_env(&self) -> Option<ProbeEnv> {
        None
    }

    /// Run `probes` through the per-packet programs against the live maps, leaving no flow
    /// behind: each verdict and the packet left.
    fn run_probes(&mut self, _probes: &[Probe]) -> Result<Vec<(u32, Vec<u8>)>> {
        bail!("this datapath runs no probes")
    }

    /// Connect to each node probe's frontend through the socket hooks, sending nothing: what
    /// each socket was given.
    fn run_socket_probes(&mut self, _probes: &[Probe]) -> Result<Vec<SocketSeen>> {
        bail!("this datapath runs no socket probes")
    }

    /// The self-check found the programs deciding otherwise than the model: put this agent's
    /// programs back where they are reached from (the slow programs' slots), as the resync
    /// puts the maps back.
    fn restore_programs(&mut self) -> Result<()> {
        Ok(())
    }
}

pub struct BpfHost {
    ebpf: Ebpf,
    dir: PathBuf,
    node_addrs: HashMap<MapData, Addr, u32>,
    node_sources: HashMap<MapData, Addr, Addr>,
    /// Pods left alone by the socket path: cgroup id → level; 0 → the levels' bits.
    socket_skip: HashMap<MapData, u64, u32>,
    /// The pods' namespaces behind attached links (cookie → 1; 0 → 1: they are known).
    covered_netns: HashMap<MapData, u64, u8>,
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
    /// An upgrade's older established conntrack, copied at the start (`retire_other_layouts`).
    older_conntrack: Option<OlderConntrack>,
    /// The node as `kpr verify`'s probes see it, from the last node plan.
    probe_env: ProbeEnv,
    /// Where the socket path's probes run; `None`: they do not.
    pub socket_probes: Option<SocketProbes>,
    /// The Maglev seed and table size the programs were loaded with, for the probes.
    pub maglev: Option<(u32, u32)>,
    /// Where the XDP program goes (`--xdp`; its program is loaded unless `Off`).
    pub xdp: super::xdp::XdpSetting,
    /// ifindex → name of the links holding the XDP program.
    xdp_attached: BTreeMap<u32, String>,
    /// Links the XDP program could not go on (said once).
    xdp_failed: BTreeSet<u32>,
}

/// How `kpr verify` probes the socket path.
pub struct SocketProbes {
    /// The cgroup (under the hooks') the probes connect from; made for each run.
    pub cgroup: PathBuf,
    /// The per-packet path covers every link (the hooks leave it some frontends).
    pub pod_links_covered: bool,
}

impl BpfHost {
    pub(super) fn take_from(
        mut ebpf: Ebpf,
        dir: PathBuf,
        tc_netlink: bool,
        pin_root: PathBuf,
        older_conntrack: Option<OlderConntrack>,
    ) -> Result<Self> {
        let mut take = |name: &str| ebpf.take_map(name).with_context(|| format!("no map {name}"));
        let node_addrs = HashMap::try_from(take(map_names::NODE_ADDRS)?)?;
        let node_sources = HashMap::try_from(take(map_names::NODE_SOURCES)?)?;
        let socket_skip = HashMap::try_from(take(map_names::SOCKET_SKIP)?)?;
        let covered_netns = HashMap::try_from(take(map_names::COVERED_NETNS)?)?;
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
            node_sources,
            socket_skip,
            covered_netns,
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
            older_conntrack,
            probe_env: ProbeEnv::default(),
            socket_probes: None,
            maglev: None,
            xdp: super::xdp::XdpSetting::Off,
            xdp_attached: BTreeMap::new(),
            xdp_failed: BTreeSet::new(),
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
        link_pin(&self.dir, program, ifindex)
    }

    /// Attach (or, after a restart, swap into the pinned links) both tc programs on a link,
    /// then let it accept local sources.
    fn attach_link(&mut self, ifindex: u32, name: &str, flags: u32) -> Result<()> {
        if self.tc_netlink {
            self.attach_netlink(ifindex, name, flags)?;
        } else {
            self.attach_tcx(ifindex, name, flags)?;
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
        match crate::datapath::devconf::set_accept_local(ifindex, true) {
            Ok(()) => {
                self.accept_local_set.insert(ifindex);
            }
            Err(e) => {
                tracing::warn!(interface = %name, "failed to set accept_local: {e}; masqueraded flows may be dropped")
            }
        }
    }

    /// Both tc programs as TCX links, pinned; after a restart, swapped into the pinned links.
    fn attach_tcx(&mut self, ifindex: u32, name: &str, flags: u32) -> Result<()> {
        for (program, pin, attach_type) in programs_for(flags) {
            let link_path = self.tc_pin(pin, ifindex);
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
    fn attach_netlink(&mut self, ifindex: u32, name: &str, flags: u32) -> Result<()> {
        let _ = aya::programs::tc::qdisc_add_clsact(NetworkInterface::Index(ifindex));
        for (program, _, attach_type) in programs_for(flags) {
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
            release_link(&self.tc_pin(program, ifindex));
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

    /// Tell the programs whether an older layout is being retired (`HOST_RETIRING_OLDER_LAYOUT`).
    fn set_retiring(&self, on: bool) {
        if let Err(e) = HostState::open(&self.pin_root).and_then(|mut state| state.set_retiring_older_layout(on)) {
            tracing::warn!("{e:#}");
        }
    }

    /// Bring the older layout's established flows over (`OlderConntrack::sync`); the flow
    /// caches stop serving copies of what was here.
    fn sync_older_conntrack(&self, older: &mut OlderConntrack) {
        older.sync();
        if let Err(e) = Conntrack::open(&self.pin_root).and_then(|mut ct| ct.changed()) {
            tracing::warn!("{e:#}");
        }
    }

    /// After an older layout's pins went: wait (a second at most) until its tc programs are
    /// off kpr's links. The kernel detaches a link whose last reference went from a worker, a
    /// moment later, and until then the older programs still establish flows in their tables
    /// (waiting 100 ms took the upgrade test from 6 failed runs in 10 to none). Netlink filters
    /// were replaced in place at the attach.
    fn wait_for_older_programs(&self) {
        if self.tc_netlink {
            return;
        }
        let ours: BTreeSet<u32> = TC_PROGRAMS
            .into_iter()
            .chain(TC_PROGRAMS_L3)
            .filter_map(|name| self.ebpf.program(name)?.info().ok().map(|info| info.id()))
            .collect();
        let older_attached = |ifindex: u32, hook: TcAttachType| {
            SchedClassifier::query_tcx(NetworkInterface::Index(ifindex), hook).is_ok_and(|(_, programs)| {
                programs
                    .iter()
                    .any(|p| p.name_as_str().is_some_and(|n| n.starts_with("kpr_tc_")) && !ours.contains(&p.id()))
            })
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        while self
            .attached
            .keys()
            .any(|i| [TcAttachType::Ingress, TcAttachType::Egress].into_iter().any(|h| older_attached(*i, h)))
        {
            if std::time::Instant::now() > deadline {
                tracing::warn!("an older layout's programs are still attached after a second");
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Detach the XDP program from every link not in `wanted` (also an earlier run's).
    fn detach_xdp_except(&mut self, wanted: &BTreeSet<u32>) {
        let held: BTreeSet<u32> =
            super::xdp::pinned(&self.dir).into_iter().chain(self.xdp_attached.keys().copied()).collect();
        for ifindex in held.difference(wanted) {
            super::xdp::detach(&self.dir, *ifindex);
            if let Some(name) = self.xdp_attached.remove(ifindex) {
                tracing::info!(interface = %name, ifindex, "XDP program detached");
            }
        }
        self.xdp_failed.retain(|i| wanted.contains(i));
    }

    /// Attach the XDP program to the `wanted` links that hold the tc programs (its fallback).
    fn attach_xdp(&mut self, plan: &NodePlan, wanted: &BTreeSet<u32>) {
        for ifindex in wanted {
            let Some(name) = plan.xdp_links.get(ifindex) else { continue };
            if self.xdp_attached.contains_key(ifindex) || !self.attached.contains_key(ifindex) {
                continue;
            }
            let veth = plan.links.get(ifindex).is_some_and(|l| l.flags & proxy_common::LINK_FLAG_PEER != 0);
            match super::xdp::attach(&mut self.ebpf, &self.dir, *ifindex, self.xdp, veth) {
                Ok(mode) => {
                    tracing::info!(interface = %name, ifindex, mode, "XDP program attached");
                    self.xdp_attached.insert(*ifindex, name.clone());
                }
                Err(e) if self.xdp_failed.insert(*ifindex) => {
                    tracing::warn!(interface = %name, "XDP not attached, the link stays on tc: {e:#}")
                }
                Err(_) => {}
            }
        }
    }

    /// Pinned tc links of earlier runs, by ifindex.
    fn pinned_links(&self) -> BTreeSet<u32> {
        links_pinned(&self.dir, TC_PROGRAMS[0])
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
        let sources = plan.node_sources.iter().map(|(e, s)| (Addr::from(*e), Addr::from(*s))).collect();
        sync_hash(&mut self.node_sources, &sources)?;
        sync_hash(&mut self.socket_skip, &socket_skip_entries(&plan.socket_skip))?;
        let links = self.links_marked(&plan.links, &plan.tc_links);
        sync_hash(&mut self.links, &links)?;
        sync_lpm(&mut self.local_cidrs, &plan.local_cidrs)?;
        sync_service_ranges(&mut self.service_cidrs, &mut self.service_range_cover, &plan.service_cidrs)?;
        self.probe_env = ProbeEnv::of(plan);

        // XDP off the links that lose it (before their tc programs, its fallback, go).
        let xdp_wanted: BTreeSet<u32> = match self.xdp {
            super::xdp::XdpSetting::Off => BTreeSet::new(),
            _ => plan.xdp_links.keys().filter(|i| plan.tc_links.contains_key(i)).copied().collect(),
        };
        self.detach_xdp_except(&xdp_wanted);

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
        // Netlink filters are replaced in place: an upgrade's older programs stop as each link
        // is attached, and the flows they established since this agent's start must follow at
        // once (with TCX links they serve beside the new ones until their retirement).
        let handing_over = self.tc_netlink
            && self.older_conntrack.is_some()
            && plan.tc_links.keys().any(|i| !self.attached.contains_key(i));
        if handing_over {
            self.set_retiring(true);
        }
        for (ifindex, name) in &plan.tc_links {
            if self.attached.contains_key(ifindex) {
                continue;
            }
            let flags = plan.links.get(ifindex).map_or(0, |l| l.flags);
            match self.attach_link(*ifindex, name, flags) {
                Ok(()) => {
                    tracing::info!(interface = %name, ifindex, "per-packet programs attached");
                    self.attached.insert(*ifindex, name.clone());
                }
                // The link may have vanished since the snapshot: the next one settles it.
                Err(e) => tracing::warn!(interface = %name, "{e:#}"),
            }
        }
        if handing_over && let Some(mut older) = self.older_conntrack.take() {
            self.sync_older_conntrack(&mut older);
            self.older_conntrack = Some(older);
            self.set_retiring(false);
        }
        self.attach_xdp(plan, &xdp_wanted);
        self.check_forwarding();
        // After the attachments: a pod's namespace is listed once its link holds the programs,
        // so the socket path never leaves it a connection that nothing would translate.
        let covered: BTreeMap<u64, u8> = plan.pod_netns.as_ref().map_or_else(BTreeMap::new, |by_link| {
            let nested = plan.nested_netns.iter().map(|(ifindex, cookie)| (ifindex, cookie));
            let attached = by_link.iter().chain(nested).filter(|(ifindex, _)| self.attached.contains_key(ifindex));
            attached.map(|(_, cookie)| (*cookie, 1)).chain([(0, 1)]).collect()
        });
        sync_hash(&mut self.covered_netns, &covered)?;
        // Remember what is ours to undo (accept_local, netlink filters) and where ingress runs,
        // when it changed.
        if marks != (self.accept_local_set.clone(), self.netlink_links.clone(), attached(self)) {
            let links = self.links_marked(&plan.links, &plan.tc_links);
            sync_hash(&mut self.links, &links)?;
        }
        Ok(())
    }

    /// The older layout's programs write its conntrack tables until they detach (when its pins
    /// go): then what they changed since the copy at this agent's start is brought over, and
    /// meanwhile a TCP segment that finds no flow, from an address that may be a backend's,
    /// waits for it (dropped, sent again) rather than being passed on to be reset.
    fn probe_env(&self) -> Option<ProbeEnv> {
        let mut env = self.probe_env.clone();
        env.maglev = self.maglev;
        if self.attached.is_empty() {
            // Nothing to run packets through: the node's own frontends only.
            env.outside_clients.clear();
            env.pod_clients.clear();
        }
        if let Some(sockets) = &self.socket_probes {
            env.socket_probes = true;
            env.pod_links_covered = sockets.pod_links_covered;
        }
        (env.socket_probes || !self.attached.is_empty()).then_some(env)
    }

    fn run_probes(&mut self, probes: &[Probe]) -> Result<Vec<(u32, Vec<u8>)>> {
        super::probe::run(&self.ebpf, &self.pin_root, probes)
    }

    fn run_socket_probes(&mut self, probes: &[Probe]) -> Result<Vec<SocketSeen>> {
        let sockets = self.socket_probes.as_ref().context("no socket probes here")?;
        let targets: Vec<_> = probes.iter().map(|p| (p.target, p.proto)).collect();
        crate::datapath::socket_probe::run(&sockets.cgroup, &targets)
    }

    fn restore_programs(&mut self) -> Result<()> {
        fill_slow_path_slots(&mut self.ebpf)
    }

    fn retire_other_layouts(&mut self) {
        let mut older = self.older_conntrack.take().or_else(|| OlderConntrack::open(&self.pin_root));
        if older.is_some() {
            self.set_retiring(true);
        }
        remove_other_layouts(&self.pin_root);
        if let Some(older) = &mut older {
            self.wait_for_older_programs();
            self.sync_older_conntrack(older);
            self.set_retiring(false);
        }
    }
}

/// Make an LPM set hold exactly the CIDRs of `want` (both families).
pub(super) fn sync_lpm<T: BorrowMut<MapData>>(map: &mut LpmTrie<T, CidrKey, u8>, want: &BTreeSet<Cidr>) -> Result<()> {
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
pub(super) fn sync_service_ranges<T: BorrowMut<MapData>, U: BorrowMut<MapData>>(
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
pub(super) fn range_cover<'a>(ranges: impl Iterator<Item = &'a Cidr>, v4: bool) -> CidrMask {
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

/// `KPR_SOCKET_SKIP`'s entries for these pod cgroups (id → level): each one, and under key 0
/// the levels they sit at. A level the hooks do not look at is logged and left out.
fn socket_skip_entries(cgroups: &BTreeMap<u64, u32>) -> BTreeMap<u64, u32> {
    let mut out = BTreeMap::new();
    let mut levels = 0u32;
    for (&id, &level) in cgroups {
        if id == 0 || level == 0 || level >= proxy_common::SOCKET_SKIP_LEVELS {
            tracing::warn!(
                cgroup = id,
                level,
                "a pod's cgroup at a level the socket hooks do not look at: not left alone"
            );
            continue;
        }
        levels |= 1 << level;
        out.insert(id, level);
    }
    if levels != 0 {
        out.insert(0, levels);
    }
    out
}

/// Make a hash map hold exactly `want`.
pub(super) fn sync_hash<K: aya::Pod + Ord, V: aya::Pod + PartialEq>(
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
