//! Shared harness of kpr's privileged tests and benchmarks: a node namespace with pods, a
//! manifest directory, a child cgroup this process joins, and the real `kpr` agent as a child
//! process on unique pins. Everything is removed on drop, also when a test fails.
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener},
    path::PathBuf,
    process::Child,
    time::Duration,
};

use anyhow::{Context as _, Result};
use kpr::datapath::bpf;
use testbed::{AgentCommand, Cgroup, Topology};

pub mod cluster;
pub mod map_state;
pub mod nodes;
pub mod probe;
pub mod world;

/// Port the pods serve on (TCP and UDP).
pub const POD_PORT: u16 = 8080;
pub const TIMEOUT: Duration = Duration::from_secs(2);

/// The `kpr` binary under test: `KPR_BIN` (set by `cargo xtask test`) or the debug build.
pub use testbed::kpr_bin;

pub struct Harness {
    pub name: String,
    agent: Option<Child>,
    /// With [`Harness::agent_own_cgroup`]: the agent's own cgroup, a child of `cgroup` (dropped
    /// before it).
    pub agent_home: Option<Cgroup>,
    pub cgroup: Cgroup,
    pub pin_root: PathBuf,
    pub manifests: PathBuf,
    /// When set, the agent watches the API server of this kubeconfig instead of `manifests`.
    pub kubeconfig: Option<PathBuf>,
    /// When set, the agent's `--cgroup` instead of `cgroup`.
    pub agent_cgroup: Option<PathBuf>,
    pub topology: Topology,
    /// The agent's metrics and healthz servers: free ports on loopback (never the host's
    /// interfaces, never kube-proxy's ports).
    pub metrics_addr: SocketAddr,
    pub healthz_addr: SocketAddr,
    /// More `kpr agent` arguments (given before the harness's own defaults can clash: only
    /// flags the harness does not set).
    pub agent_args: Vec<String>,
    /// `--max-service-ports` of the agent.
    pub max_service_ports: u32,
    /// Run the agent in the node's network namespace (the client's), as a DaemonSet's
    /// hostNetwork container, rather than in this machine's.
    pub agent_in_node_netns: bool,
    /// Run the agent alone in a cgroup of its own (under the socket hooks), as a container,
    /// rather than in this process's.
    pub agent_own_cgroup: bool,
}

impl Harness {
    /// Pods named `pods` serving on [`POD_PORT`]; this process joins a fresh child cgroup.
    pub fn new(tag: &str, pods: &[&str]) -> Result<Self> {
        let name = testbed::unique_name(tag);
        let mut topology = Topology::new(&name, pods)?;
        for pod in &mut topology.pods {
            pod.serve(POD_PORT)?;
        }
        let manifests = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&manifests)?;
        let mut cgroup = Cgroup::new(&name)?;
        cgroup.enter()?;
        let pin_root = PathBuf::from(format!("/sys/fs/bpf/{name}"));
        Ok(Self {
            name,
            agent: None,
            agent_home: None,
            cgroup,
            pin_root,
            manifests,
            kubeconfig: None,
            agent_cgroup: None,
            topology,
            metrics_addr: free_loopback_port()?,
            healthz_addr: free_loopback_port()?,
            agent_args: Vec::new(),
            max_service_ports: 1024,
            agent_in_node_netns: false,
            agent_own_cgroup: false,
        })
    }

    pub fn log_path(&self) -> PathBuf {
        std::env::temp_dir().join(format!("{}.agent.log", self.name))
    }

    /// Start `kpr agent` on this harness's manifests (or kubeconfig), cgroup and pins.
    pub fn start_agent(&mut self) -> Result<()> {
        let cgroup = self.agent_cgroup.as_ref().unwrap_or(&self.cgroup.path);
        let agent = AgentCommand::new(cgroup, &self.pin_root).args(self.agent_args()).log_to(&self.log_path())?;
        let mut cmd = agent.command();
        cmd.env("RUST_LOG", "info");
        if self.agent_own_cgroup {
            if self.agent_home.is_none() {
                self.agent_home = Some(Cgroup::new(&format!("{}/agent", self.name))?);
            }
            let home = &self.agent_home.as_ref().expect("created above").path;
            cluster::confine(&mut cmd, home)?;
        }
        if self.agent_in_node_netns {
            self.topology.client.exec_in(&mut cmd)?;
        }
        let child = cmd.spawn().with_context(|| format!("failed to start {}", kpr_bin().display()))?;
        self.agent = Some(child);
        Ok(())
    }

    /// `kpr agent`'s arguments for this harness after its cgroup and pins: its source, ports
    /// and options.
    fn agent_args(&self) -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = Vec::new();
        match &self.kubeconfig {
            Some(kubeconfig) => args.extend(["--kubeconfig".into(), kubeconfig.into()]),
            None => args.extend(["--manifests".into(), self.manifests.clone().into()]),
        }
        args.extend(["--node-name", "test-node", "--max-backends", "4096"].map(Into::into));
        args.push(format!("--max-service-ports={}", self.max_service_ports).into());
        args.push(format!("--metrics-bind-address={}", self.metrics_addr).into());
        args.push(format!("--healthz-bind-address={}", self.healthz_addr).into());
        args.extend(self.agent_args.iter().map(Into::into));
        // No links unless asked for: in this machine's own network namespace, never the
        // host's interfaces.
        if !self.agent_args.iter().any(|a| a.starts_with("--interfaces")) {
            args.extend(["--interfaces", "none"].map(Into::into));
        }
        args.extend(["--iptables-min-sync-period", "0s"].map(Into::into));
        args
    }

    /// SIGKILL the agent we started (by its pid) and reap it.
    pub fn kill_agent(&mut self) -> Result<()> {
        if let Some(mut child) = self.agent.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    pub fn agent_running(&mut self) -> bool {
        self.agent.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    pub fn write(&self, file: &str, text: &str) -> Result<()> {
        testbed::write_atomic(&self.manifests, file, text)
    }

    pub fn remove(&self, file: &str) -> Result<()> {
        Ok(std::fs::remove_file(self.manifests.join(file))?)
    }

    /// Service `name` on `ip` with ports (name, port, proto) → every pod in `pods` (indexes).
    pub fn write_service(&self, name: &str, ip: Ipv4Addr, ports: &[(&str, u16, &str)], pods: &[usize]) -> Result<()> {
        self.write_service_ips(name, &[ip.into()], ports, pods)
    }

    /// Service `name` on `cluster_ips` (one per family: single or dual stack) with ports →
    /// every pod in `pods`, in an EndpointSlice of each family the Service has.
    pub fn write_service_ips(
        &self,
        name: &str,
        cluster_ips: &[IpAddr],
        ports: &[(&str, u16, &str)],
        pods: &[usize],
    ) -> Result<()> {
        self.write(&format!("{name}-svc.yaml"), &testbed::service_manifest("test", name, cluster_ips, ports))?;
        for ip in cluster_ips {
            self.write_endpoints_of(name, ip.is_ipv6(), ports, pods)?;
        }
        Ok(())
    }

    /// The IPv4 EndpointSlice of `name`: pods `pods`.
    pub fn write_endpoints(&self, name: &str, ports: &[(&str, u16, &str)], pods: &[usize]) -> Result<()> {
        self.write_endpoints_of(name, false, ports, pods)
    }

    /// The EndpointSlice of `name` of one family (`v6`): pods `pods`.
    pub fn write_endpoints_of(&self, name: &str, v6: bool, ports: &[(&str, u16, &str)], pods: &[usize]) -> Result<()> {
        let pod_ip = |i: usize| -> IpAddr {
            let pod = &self.topology.pods[i];
            if v6 { pod.ip6.into() } else { pod.ip.into() }
        };
        let ips: Vec<IpAddr> = pods.iter().map(|&i| pod_ip(i)).collect();
        let slice_ports: Vec<(&str, u16, &str)> = ports.iter().map(|(n, _, p)| (*n, POD_PORT, *p)).collect();
        let (file, slice) = if v6 {
            (format!("{name}-slice6.yaml"), format!("{name}-6"))
        } else {
            (format!("{name}-slice.yaml"), format!("{name}-1"))
        };
        self.write(&file, &testbed::slice_manifest("test", name, &slice, &ips, &slice_ports))
    }

    /// Wait until `address` (`10.96.0.10:80/TCP`) has `backends` backends (`None`: absent).
    pub fn wait(&self, address: &str, backends: Option<usize>) -> Result<()> {
        self.wait_for(address, backends, Duration::from_secs(10))
    }

    pub fn wait_for(&self, address: &str, backends: Option<usize>, timeout: Duration) -> Result<()> {
        testbed::wait_programmed(&self.pin_root, address, backends, timeout)
            .with_context(|| format!("agent log:\n{}", std::fs::read_to_string(self.log_path()).unwrap_or_default()))
    }

    /// Run `f` in the node namespace (the client side).
    pub fn client<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        self.topology.client.run(f).expect("client thread")
    }

    pub fn pod_name(&self, i: usize) -> String {
        self.topology.pods[i].name.clone()
    }

    pub fn counter(&self, name: &str) -> u64 {
        bpf::read_counters(&self.pin_root)
            .expect("counters")
            .into_iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, v)| v)
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = self.kill_agent();
        let _ = self.cgroup.leave();
        if let Err(e) = bpf::cleanup(&self.pin_root) {
            eprintln!("harness: failed to remove pins {}: {e:#}", self.pin_root.display());
        }
        let _ = std::fs::remove_dir_all(&self.manifests);
        let _ = std::fs::remove_file(self.log_path());
    }
}

/// A loopback address with a port free right now.
/// Block SIGINT and SIGTERM in this thread (call it before any other thread exists, so that
/// all inherit the mask) and return the set, for `sigwait`: a long-running program then stops
/// on either by taking down what it started, rather than dying with it left behind.
pub fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: plain signal-mask calls on a zeroed sigset_t.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// A free TCP port on loopback, never one this process was given before: a port just
/// released may come back from the next bind (an agent's metrics and healthz servers were once
/// given the same port, and the second could not listen).
pub fn free_loopback_port() -> Result<SocketAddr> {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    for _ in 0..64 {
        let addr = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        if GIVEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(addr.port()) {
            return Ok(addr);
        }
    }
    anyhow::bail!("no loopback port this process was not given already, in 64 binds")
}

/// `GET path` over HTTP/1.1: (status code, body).
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    testbed::http_get(addr, path, TIMEOUT)
}

/// `addr` as SocketAddrV4.
pub fn sa(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// `addr` as SocketAddrV6.
pub fn sa6(ip: Ipv6Addr, port: u16) -> SocketAddrV6 {
    SocketAddrV6::new(ip, port, 0, 0)
}

/// Turn transmit checksum offload of link `name`, in the calling thread's network namespace,
/// on or off (`ethtool -K name tx on|off`, through its ioctl). Off, the kernel completes the
/// checksums of what leaves by the link (a packet left to the device, `CHECKSUM_PARTIAL`, is
/// summed in software), and what the link's own stack sends carries a complete checksum, which
/// the receiver verifies.
pub fn set_tx_checksum_offload(name: &str, on: bool) -> Result<()> {
    const ETHTOOL_STXCSUM: u32 = 0x17;
    set_ethtool_value(name, ETHTOOL_STXCSUM, on)
}

/// An ethtool "set value" command (`struct ethtool_value`) through its ioctl.
fn set_ethtool_value(name: &str, cmd: u32, on: bool) -> Result<()> {
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    let mut value = EthtoolValue { cmd, data: u32::from(on) };
    // SAFETY: a zeroed ifreq is valid; the name fits (checked) and stays NUL-terminated.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    anyhow::ensure!(name.len() < ifr.ifr_name.len(), "link name {name} too long");
    for (dst, src) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    ifr.ifr_ifru.ifru_data = (&raw mut value).cast();
    // SAFETY: plain syscalls on a socket we own; `ifr` and `value` outlive the ioctl.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        anyhow::ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let rc = libc::ioctl(fd, libc::SIOCETHTOOL as _, &raw mut ifr);
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        anyhow::ensure!(rc == 0, "SIOCETHTOOL {cmd:#x} {name} {on}: {err}");
    }
    Ok(())
}

/// Add or delete the device route `prefix`/`len` on link `ifindex` in the calling thread's
/// network namespace, over rtnetlink, in-process: a test that must change routes within
/// a short window (the kept routes' period) cannot afford an `ip` process, which under an
/// emulated CPU takes a large part of a second.
pub fn device_route(add: bool, prefix: IpAddr, len: u8, ifindex: u32) -> std::io::Result<()> {
    use kpr::netlink;
    const RTA_DST: u16 = 1;
    const RTA_OIF: u16 = 4;
    let (family, dst) = match prefix {
        IpAddr::V4(a) => (libc::AF_INET as u8, a.octets().to_vec()),
        IpAddr::V6(a) => (libc::AF_INET6 as u8, a.octets().to_vec()),
    };
    // struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags.
    let (protocol, scope, kind) =
        if add { (libc::RTPROT_BOOT, libc::RT_SCOPE_LINK, libc::RTN_UNICAST) } else { (0, libc::RT_SCOPE_NOWHERE, 0) };
    let mut body = vec![family, len, 0, 0, libc::RT_TABLE_MAIN, protocol, scope, kind];
    body.extend_from_slice(&0u32.to_ne_bytes());
    body.extend(netlink::attr(RTA_DST, &dst));
    body.extend(netlink::attr(RTA_OIF, &ifindex.to_ne_bytes()));
    let (kind, flags) = if add {
        (libc::RTM_NEWROUTE, libc::NLM_F_ACK | libc::NLM_F_CREATE | libc::NLM_F_EXCL)
    } else {
        (libc::RTM_DELROUTE, libc::NLM_F_ACK)
    };
    netlink::request_ack(libc::NETLINK_ROUTE, &netlink::message(kind, flags as u16, &body))
}

/// A two-instruction XDP program (`r0 = action; exit`) attached to link `name` of the calling
/// thread's namespace in the driver's mode, as a bpf link: detached when the returned fd is
/// closed. A veth's native XDP transmits (`XDP_TX`, `XDP_REDIRECT`) into its peer's ring, which
/// the kernel drains only while the peer holds an XDP program of its own: the switch ports and
/// the bench's sinks get `XDP_PASS` (2) from this; the bench's generator `XDP_TX` (3).
pub fn attach_xdp_stub(name: &str, action: u32) -> Result<std::os::fd::OwnedFd> {
    const BPF_LINK_CREATE: libc::c_long = 28;
    const BPF_XDP: u32 = 37;
    const XDP_FLAGS_DRV_MODE: u32 = 4;
    let prog = load_xdp_stub(action)?;
    let c_name = std::ffi::CString::new(name)?;
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(c_name.as_ptr()) };
    anyhow::ensure!(ifindex != 0, "no link {name}: {}", std::io::Error::last_os_error());
    // BPF_LINK_CREATE: prog_fd, target_ifindex, attach_type, flags.
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&prog) as u32).to_ne_bytes());
    attr[4..8].copy_from_slice(&ifindex.to_ne_bytes());
    attr[8..12].copy_from_slice(&BPF_XDP.to_ne_bytes());
    attr[12..16].copy_from_slice(&XDP_FLAGS_DRV_MODE.to_ne_bytes());
    bpf(BPF_LINK_CREATE, &mut attr).with_context(|| format!("an XDP stub on {name}"))
}

/// The program of [`attach_xdp_stub`], loaded: its fd.
pub fn load_xdp_stub(action: u32) -> Result<std::os::fd::OwnedFd> {
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_PROG_TYPE_XDP: u32 = 6;
    // mov64 r0, action; exit.
    let mut insns = [0u8; 16];
    insns[0] = 0xb7;
    insns[4..8].copy_from_slice(&action.to_ne_bytes());
    insns[8] = 0x95;
    let license = c"GPL";
    // union bpf_attr, BPF_PROG_LOAD: prog_type, insn_cnt, insns, license.
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_XDP.to_ne_bytes());
    attr[4..8].copy_from_slice(&2u32.to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    bpf(BPF_PROG_LOAD, &mut attr).context("loading an XDP stub")
}

/// The bytes of a [`xdp_generator`]'s frame.
pub const GENERATED_FRAME_LEN: usize = 64;

/// An XDP program for the kernel's traffic generator ([`xdp_live_frames`]) that writes
/// `frame` into the packet and returns `XDP_TX`. Live frames are recycled as they come back
/// (from a sink's XDP), with whatever the path they took wrote in them (a translation): each
/// run puts the frame back.
pub fn xdp_generator(frame: &[u8; GENERATED_FRAME_LEN]) -> Result<std::os::fd::OwnedFd> {
    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_MAP_TYPE_ARRAY: u32 = 2;
    const BPF_PROG_TYPE_XDP: u32 = 6;
    // The frame in a one-slot array.
    let mut attr = [0u8; 128];
    for (i, word) in [BPF_MAP_TYPE_ARRAY, 4, GENERATED_FRAME_LEN as u32, 1].into_iter().enumerate() {
        attr[4 * i..4 * i + 4].copy_from_slice(&word.to_ne_bytes());
    }
    let map = bpf(BPF_MAP_CREATE, &mut attr).context("the generator's frame map")?;
    let map_fd = std::os::fd::AsRawFd::as_raw_fd(&map);
    let key = 0u32;
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&(map_fd as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(&raw const key as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(frame.as_ptr() as u64).to_ne_bytes());
    bpf_call(BPF_MAP_UPDATE_ELEM, &mut attr).context("writing the generator's frame")?;
    // (code, dst | src << 4, offset, immediate)
    let insn = |code: u8, regs: u8, off: i16, imm: i32| -> [u8; 8] {
        let mut i = [code, regs, 0, 0, 0, 0, 0, 0];
        i[2..4].copy_from_slice(&off.to_ne_bytes());
        i[4..8].copy_from_slice(&imm.to_ne_bytes());
        i
    };
    let mut prog: Vec<[u8; 8]> = vec![
        insn(0xbf, 0x16, 0, 0),                          // 0: r6 = r1 (the context)
        insn(0x62, 0x0a, -4, 0),                         // 1: *(u32 *)(r10 - 4) = 0 (the key)
        insn(0x18, 0x11, 0, map_fd),                     // 2: r1 = the map (ld_imm64, a map fd)
        insn(0x00, 0x00, 0, 0),                          // 3
        insn(0xbf, 0xa2, 0, 0),                          // 4: r2 = r10
        insn(0x07, 0x02, 0, -4),                         // 5: r2 += -4
        insn(0x85, 0x00, 0, 1),                          // 6: call bpf_map_lookup_elem
        insn(0x15, 0x00, 23, 0),                         // 7: if r0 == 0 goto 31
        insn(0x61, 0x62, 0, 0),                          // 8: r2 = ctx->data
        insn(0x61, 0x63, 4, 0),                          // 9: r3 = ctx->data_end
        insn(0xbf, 0x24, 0, 0),                          // 10: r4 = r2
        insn(0x07, 0x04, 0, GENERATED_FRAME_LEN as i32), // 11: r4 += 64
        insn(0x2d, 0x34, 18, 0),                         // 12: if r4 > r3 goto 31
    ];
    for i in 0..(GENERATED_FRAME_LEN / 8) as i16 {
        prog.push(insn(0x79, 0x05, 8 * i, 0)); // r5 = *(u64 *)(r0 + 8i)
        prog.push(insn(0x7b, 0x52, 8 * i, 0)); // *(u64 *)(r2 + 8i) = r5
    }
    prog.push(insn(0xb7, 0x00, 0, 3)); // 29: r0 = XDP_TX
    prog.push(insn(0x95, 0x00, 0, 0)); // 30: exit
    prog.push(insn(0xb7, 0x00, 0, 0)); // 31: r0 = XDP_ABORTED
    prog.push(insn(0x95, 0x00, 0, 0)); // 32: exit
    let insns = prog.concat();
    let license = c"GPL";
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_XDP.to_ne_bytes());
    attr[4..8].copy_from_slice(&((insns.len() / 8) as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    bpf(BPF_PROG_LOAD, &mut attr).context("loading the XDP generator")
}

/// Send `frame` `repeat` times out of link `ifindex` (of the calling thread's namespace) with
/// the kernel's XDP traffic generator: `BPF_PROG_TEST_RUN` of an XDP program returning
/// `XDP_TX` ([`xdp_generator`]) in live-frames mode (5.18+), which transmits what the program
/// returns. The frames go on the calling CPU, in batches of 64.
pub fn xdp_live_frames(prog: &std::os::fd::OwnedFd, frame: &[u8], ifindex: u32, repeat: u32) -> Result<()> {
    const BPF_PROG_TEST_RUN: libc::c_long = 10;
    const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 2;
    // `struct xdp_md`: data 0, data_end, data_meta 0, ingress_ifindex.
    let mut ctx = [0u8; 24];
    ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
    // union bpf_attr, BPF_PROG_TEST_RUN: prog_fd, retval, data_size_in, data_size_out, data_in,
    // data_out, repeat, duration, ctx_size_in, ctx_size_out, ctx_in, ctx_out, flags, cpu,
    // batch_size.
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(prog) as u32).to_ne_bytes());
    attr[8..12].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    attr[16..24].copy_from_slice(&(frame.as_ptr() as u64).to_ne_bytes());
    attr[32..36].copy_from_slice(&repeat.to_ne_bytes());
    attr[40..44].copy_from_slice(&(ctx.len() as u32).to_ne_bytes());
    attr[48..56].copy_from_slice(&(ctx.as_ptr() as u64).to_ne_bytes());
    attr[64..68].copy_from_slice(&BPF_F_TEST_XDP_LIVE_FRAMES.to_ne_bytes());
    // The frame and the context outlive the call.
    bpf_call(BPF_PROG_TEST_RUN, &mut attr).context("BPF_PROG_TEST_RUN (live frames)").map(drop)
}

/// The bpf syscall `cmd` with attribute block `attr` (zero past the fields set): what it
/// returns.
fn bpf_call(cmd: libc::c_long, attr: &mut [u8; 128]) -> Result<i64> {
    // SAFETY: the bpf syscall with an attribute block of its size.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len() as u32) };
    anyhow::ensure!(rc >= 0, "bpf({cmd}): {}", std::io::Error::last_os_error());
    Ok(rc)
}

/// [`bpf_call`] for a command that returns a new fd.
fn bpf(cmd: libc::c_long, attr: &mut [u8; 128]) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd as _;
    let fd = bpf_call(cmd, attr)?;
    // SAFETY: a new fd the syscall returned, owned from here.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}
