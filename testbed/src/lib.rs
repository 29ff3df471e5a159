//! Network namespaces, cgroups and small name servers: the "pods" and "node" of the demo, the
//! privileged tests and the benchmarks. Everything created here is uniquely named and removed
//! on drop, and no namespace made here has a route off the machine. Not part of the shipped
//! `kpr`: the demo (`kpr-demo`), the privileged tests and the benchmarks link it.
mod agent;
pub mod demo;
mod tun;

use std::{
    fs::{self, File},
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

pub use agent::{AgentCommand, demo_bin, kpr_bin};
pub use kpr::inspect::http_get;
pub use tun::{Tun, Wire};

use anyhow::{Context as _, Result, bail};

/// Make `cmd`'s process get SIGKILL when the thread that starts it exits (a test, demo or
/// benchmark that dies, even by SIGKILL, takes its agents and their programs with it).
pub fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: prctl is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Run `ip` with arguments; fail with its stderr.
pub fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("failed to run `ip` (install iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Write `value` to `/proc/sys/<key>`: of the calling thread's network namespace for `net/`
/// keys.
fn write_sysctl(key: &str, value: &str) -> Result<()> {
    fs::write(format!("/proc/sys/{key}"), value).with_context(|| format!("failed to set {key}"))
}

/// Set the link `name` of the calling thread's network namespace up (`ip link set <name> up`).
fn set_link_up(name: &str) -> Result<()> {
    // SAFETY: a plain socket for the ioctls, closed by the OwnedFd; `ifreq` is zeroed and its
    // name NUL-terminated (shorter than IFNAMSIZ).
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        anyhow::ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let _fd = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let mut req: libc::ifreq = std::mem::zeroed();
        anyhow::ensure!(name.len() < req.ifr_name.len(), "link name {name} too long");
        for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
            *dst = src as libc::c_char;
        }
        for (request, what) in [(libc::SIOCGIFFLAGS, "get"), (libc::SIOCSIFFLAGS, "set")] {
            if request == libc::SIOCSIFFLAGS {
                req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            }
            anyhow::ensure!(
                libc::ioctl(fd, request as _, &mut req) == 0,
                "{what} the flags of {name}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

/// A named network namespace (`ip netns add`), deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// The namespace with its loopback up. One process start (`ip netns add`): the rest is
    /// done from a thread inside it, as under emulation (the VMs) each start costs ~0.2 s.
    pub fn new(name: &str) -> Result<Self> {
        ip(&["netns", "add", name])?;
        let ns = Self { name: name.to_owned() };
        ns.run(|| -> Result<()> {
            // No duplicate address detection: a link's IPv6 link-local address would stay
            // tentative for up to 2 s after the link comes up, and until then the namespace
            // cannot send a neighbour solicitation for a packet it forwards, so a test's first
            // forwarded IPv6 packets would wait for it (a real node's links have been up for long).
            for conf in ["all", "default"] {
                write_sysctl(&format!("net/ipv6/conf/{conf}/accept_dad"), "0")?;
            }
            set_link_up("lo")
        })??;
        Ok(ns)
    }

    /// `ip -n <ns> ...`
    pub fn ip(&self, args: &[&str]) -> Result<()> {
        let mut full = vec!["-n", &self.name];
        full.extend_from_slice(args);
        ip(&full)
    }

    /// `ip -n <ns> -batch -`: several `ip` commands (`addr add 10.0.0.1/24 dev eth0`; no
    /// options such as `-6`: the addresses give the family) in one process, which stops at the
    /// first that fails. Topologies use it: under emulation (the VMs) a process start costs
    /// ~0.2 s, and a two-node topology took 10 s of them one command at a time.
    pub fn ip_batch<S: AsRef<str>>(&self, commands: impl IntoIterator<Item = S>) -> Result<()> {
        let script: String = commands.into_iter().map(|c| format!("{}\n", c.as_ref())).collect();
        let mut child = Command::new("ip")
            .args(["-n", &self.name, "-batch", "-"])
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("failed to run `ip` (install iproute2)")?;
        child.stdin.take().expect("piped").write_all(script.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!("ip -n {} -batch:\n{script}: {}", self.name, String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(())
    }

    /// A router's settings: forward IPv4 and IPv6, no reverse-path filter (the test topologies route
    /// asymmetrically on purpose).
    pub fn route_packets(&self) -> Result<()> {
        self.run(|| -> Result<()> {
            write_sysctl("net/ipv4/ip_forward", "1")?;
            write_sysctl("net/ipv6/conf/all/forwarding", "1")?;
            for conf in fs::read_dir("/proc/sys/net/ipv4/conf")? {
                write_sysctl(&format!("net/ipv4/conf/{}/rp_filter", conf?.file_name().to_string_lossy()), "0")?;
            }
            Ok(())
        })?
    }

    /// Run a shell script inside this namespace.
    pub fn sh(&self, script: &str) -> Result<()> {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script]);
        self.exec_in(&mut cmd)?;
        let status = cmd.status()?;
        anyhow::ensure!(status.success(), "`{script}` failed in {}", self.name);
        Ok(())
    }

    /// Run `f` on a thread that has joined this namespace; sockets it creates stay in it.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
        self.spawn(f)?.join().map_err(|_| anyhow::anyhow!("thread in netns {} panicked", self.name))
    }

    /// Make `cmd` join this namespace just before exec (network namespace only: the mount
    /// namespace, and so bpffs, stays the machine's, unlike with `ip netns exec`).
    pub fn exec_in(&self, cmd: &mut Command) -> Result<()> {
        use std::os::unix::process::CommandExt as _;
        let file =
            File::open(format!("/run/netns/{}", self.name)).with_context(|| format!("netns {} is gone", self.name))?;
        // SAFETY: setns is async-signal-safe; the closure owns the file, so the fd is open
        // until exec (and closed by it: O_CLOEXEC).
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }

    pub fn spawn<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<JoinHandle<T>> {
        let file =
            File::open(format!("/run/netns/{}", self.name)).with_context(|| format!("netns {} is gone", self.name))?;
        let name = self.name.clone();
        Ok(std::thread::spawn(move || {
            // SAFETY: setns on this thread only; the fd is valid for the call.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns into {name}: {}", std::io::Error::last_os_error());
            f()
        }))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("testbed: failed to delete netns {}: {e}", self.name);
        }
    }
}

/// A child cgroup of the cgroup2 root. `enter` moves this whole process into it (so its
/// sockets get the cgroup's socket hooks); drop moves it back and removes the cgroup.
pub struct Cgroup {
    pub path: PathBuf,
    entered_from: Option<PathBuf>,
}

/// A uniquely named bpffs pin root for a test or benchmark: kpr's pins under it are removed
/// on drop, also when the test fails.
pub struct PinRoot(pub PathBuf);

impl PinRoot {
    pub fn new(tag: &str) -> Self {
        Self(PathBuf::from(format!("/sys/fs/bpf/{}", unique_name(tag))))
    }
}

impl Drop for PinRoot {
    fn drop(&mut self) {
        if let Err(e) = kpr::datapath::bpf::cleanup(&self.0) {
            eprintln!("testbed: failed to remove the pins under {}: {e:#}", self.0.display());
        }
    }
}

impl Cgroup {
    pub fn new(name: &str) -> Result<Self> {
        let path = kpr::datapath::bpf::cgroup2_root()?.join(name);
        fs::create_dir(&path).with_context(|| format!("failed to create cgroup {}", path.display()))?;
        Ok(Self { path, entered_from: None })
    }

    pub fn enter(&mut self) -> Result<()> {
        if self.entered_from.is_none() {
            self.entered_from = Some(kpr::datapath::bpf::own_cgroup()?);
        }
        fs::write(self.path.join("cgroup.procs"), std::process::id().to_string())
            .with_context(|| format!("failed to join cgroup {}", self.path.display()))
    }

    pub fn leave(&mut self) -> Result<()> {
        if let Some(from) = self.entered_from.take() {
            fs::write(from.join("cgroup.procs"), std::process::id().to_string())?;
        }
        Ok(())
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if let Err(e) = self.leave() {
            eprintln!("testbed: failed to leave cgroup {}: {e}", self.path.display());
        }
        // Processes we started inside and that already exited may linger a moment.
        for _ in 0..50 {
            if fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("testbed: failed to remove cgroup {}", self.path.display());
    }
}

/// A server thread answering with a fixed name. TCP: sends `name\n`, then echoes what it
/// receives until the client closes, except that `peer?\n` is answered with the client address
/// the server sees (to check masquerade). UDP: answers `peer?` the same way, anything else
/// with `name`.
pub struct NameServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl NameServer {
    pub fn tcp(ns: &Netns, addr: impl Into<SocketAddr>, name: &str) -> Result<Self> {
        let addr = addr.into();
        Self::tcp_on(ns.run(move || TcpListener::bind(addr))??, name)
    }

    /// Serve on a bound listener (a process that is already where it serves, e.g. a pod's).
    pub fn tcp_on(listener: TcpListener, name: &str) -> Result<Self> {
        set_timeout(listener.as_raw_fd(), Duration::from_millis(100))?;
        let (stop, name) = (Arc::new(AtomicBool::new(false)), name.to_owned());
        let stop2 = stop.clone();
        let thread = std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                let Ok((mut conn, peer)) = listener.accept() else { continue };
                let name = name.clone();
                std::thread::spawn(move || {
                    let _ = conn.set_nodelay(true);
                    // Accepted sockets inherit the listener's SO_RCVTIMEO; connections wait forever.
                    let _ = conn.set_read_timeout(None);
                    if conn.write_all(format!("{name}\n").as_bytes()).is_err() {
                        return;
                    }
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = conn.read(&mut buf) {
                        let reply = if &buf[..n] == b"peer?\n" {
                            format!("{}\n", peer.ip().to_canonical()).into_bytes()
                        } else {
                            buf[..n].to_vec()
                        };
                        if conn.write_all(&reply).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Ok(Self { stop, thread: Some(thread) })
    }

    pub fn udp(ns: &Netns, addr: impl Into<SocketAddr>, name: &str) -> Result<Self> {
        let addr = addr.into();
        Self::udp_on(ns.run(move || UdpSocket::bind(addr))??, name)
    }

    /// Serve on a bound socket (see [`Self::tcp_on`]).
    pub fn udp_on(socket: UdpSocket, name: &str) -> Result<Self> {
        socket.set_read_timeout(Some(Duration::from_millis(100)))?;
        let (stop, name) = (Arc::new(AtomicBool::new(false)), name.to_owned());
        let stop2 = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while !stop2.load(Ordering::Relaxed) {
                if let Ok((n, from)) = socket.recv_from(&mut buf) {
                    let reply = if &buf[..n] == b"peer?" { from.ip().to_canonical().to_string() } else { name.clone() };
                    let _ = socket.send_to(reply.as_bytes(), from);
                }
            }
        });
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for NameServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn set_timeout(fd: i32, timeout: Duration) -> Result<()> {
    let tv = libc::timeval { tv_sec: timeout.as_secs() as _, tv_usec: timeout.subsec_micros() as _ };
    // SAFETY: valid fd and a correctly sized timeval.
    let rc = unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&raw const tv).cast(), size_of_val(&tv) as _)
    };
    if rc != 0 {
        bail!("setsockopt SO_RCVTIMEO: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// One backend "pod": a namespace behind a veth from the client namespace.
pub struct Pod {
    pub name: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 address (every pod is dual-stack).
    pub ip6: Ipv6Addr,
    pub netns: Netns,
    servers: Vec<NameServer>,
}

impl Pod {
    /// Start a TCP and a UDP name server on `port` of both its addresses, answering with the
    /// pod's name.
    pub fn serve(&mut self, port: u16) -> Result<()> {
        for ip in [IpAddr::from(self.ip), self.ip6.into()] {
            let addr = SocketAddr::new(ip, port);
            self.servers.push(NameServer::tcp(&self.netns, addr, &self.name)?);
            self.servers.push(NameServer::udp(&self.netns, addr, &self.name)?);
        }
        Ok(())
    }
}

/// A client namespace (the "node") with `n` pods, each on its own /24 (10.244.<i+1>.0/24;
/// the pod is .2, the client side .1) and /64 (fd00:10:244:<i+1>::/64, ::2 and ::1). No
/// default route anywhere: an untranslated ClusterIP packet gets ENETUNREACH instead of
/// leaving the machine.
pub struct Topology {
    pub pods: Vec<Pod>,
    /// Dropped last: the pods' veths hang off it.
    pub client: Netns,
}

impl Topology {
    pub fn new(prefix: &str, pod_names: &[&str]) -> Result<Self> {
        let client = Netns::new(&format!("{prefix}-node"))?;
        let mut pods = Vec::new();
        for (i, name) in pod_names.iter().enumerate() {
            let netns = Netns::new(&format!("{prefix}-{name}"))?;
            let subnet = u8::try_from(i + 1)?;
            let ip = Ipv4Addr::new(10, 244, subnet, 2);
            let veth = format!("veth{i}");
            client.ip(&["link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &netns.name])?;
            client.ip(&["addr", "add", &format!("10.244.{subnet}.1/24"), "dev", &veth])?;
            client.ip(&["link", "set", &veth, "up"])?;
            netns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
            netns.ip(&["link", "set", "eth0", "up"])?;
            netns.ip(&["route", "add", "default", "via", &format!("10.244.{subnet}.1")])?;
            // nodad: usable at once, not after duplicate address detection.
            let ip6 = Ipv6Addr::new(0xfd00, 0x10, 0x244, subnet.into(), 0, 0, 0, 2);
            client.ip(&["-6", "addr", "add", &format!("fd00:10:244:{subnet:x}::1/64"), "dev", &veth, "nodad"])?;
            netns.ip(&["-6", "addr", "add", &format!("{ip6}/64"), "dev", "eth0", "nodad"])?;
            netns.ip(&["-6", "route", "add", "default", "via", &format!("fd00:10:244:{subnet:x}::1")])?;
            pods.push(Pod { name: (*name).to_owned(), ip, ip6, netns, servers: Vec::new() });
        }
        Ok(Self { pods, client })
    }
}

/// TCP: connect, read the server's name line. Returns (name, peer address from getpeername).
pub fn tcp_ask(addr: impl Into<SocketAddr>, timeout: Duration) -> std::io::Result<(String, SocketAddr)> {
    let conn = TcpStream::connect_timeout(&addr.into(), timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    let peer = conn.peer_addr()?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line)?;
    Ok((line.trim_end().to_owned(), peer))
}

/// TCP: connect, read the name, ask the server which client address it sees.
/// Returns (name, the client address as the server saw it).
pub fn tcp_ask_peer(addr: impl Into<SocketAddr>, timeout: Duration) -> std::io::Result<(String, String)> {
    let mut conn = TcpStream::connect_timeout(&addr.into(), timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut name = String::new();
    reader.read_line(&mut name)?;
    conn.write_all(b"peer?\n")?;
    let mut peer = String::new();
    reader.read_line(&mut peer)?;
    Ok((name.trim_end().to_owned(), peer.trim_end().to_owned()))
}

/// UDP, unconnected: send_to, recv_from. Returns (name, source address of the reply).
pub fn udp_ask(addr: impl Into<SocketAddr>, timeout: Duration) -> std::io::Result<(String, SocketAddr)> {
    let addr = addr.into();
    let socket = UdpSocket::bind(any_port_of(&addr))?;
    socket.set_read_timeout(Some(timeout))?;
    socket.send_to(b"who", addr)?;
    let mut buf = [0u8; 256];
    let (n, from) = socket.recv_from(&mut buf)?;
    Ok((String::from_utf8_lossy(&buf[..n]).into_owned(), from))
}

/// UDP, connected: connect, send, recv. Returns (name, peer address from getpeername).
pub fn udp_connected_ask(addr: impl Into<SocketAddr>, timeout: Duration) -> std::io::Result<(String, SocketAddr)> {
    let addr = addr.into();
    let socket = UdpSocket::bind(any_port_of(&addr))?;
    socket.set_read_timeout(Some(timeout))?;
    socket.connect(addr)?;
    socket.send(b"who")?;
    let mut buf = [0u8; 256];
    let n = socket.recv(&mut buf)?;
    Ok((String::from_utf8_lossy(&buf[..n]).into_owned(), socket.peer_addr()?))
}

/// The wildcard address of `addr`'s family, any port: an IPv6 socket (dual-stack, so it can
/// also reach IPv4-mapped addresses) for an IPv6 destination.
pub fn any_port_of(addr: &SocketAddr) -> SocketAddr {
    let ip: IpAddr = if addr.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
    SocketAddr::new(ip, 0)
}

/// `timeout` stretched by `KPR_TEST_TIME_SCALE` (the VM runs under software emulation, where
/// loading the programs takes seconds): waits for the agent, never the traffic's own timeouts.
pub fn slow(timeout: Duration) -> Duration {
    let scale = std::env::var("KPR_TEST_TIME_SCALE").ok().and_then(|s| s.parse::<u32>().ok()).unwrap_or(1);
    timeout * scale.max(1)
}

/// Unique, short names for test resources: `<tag>-<pid>-<n>`.
pub fn unique_name(tag: &str) -> String {
    use std::sync::atomic::AtomicU32;
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{tag}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Write a Service as a manifest, like `kubectl get -o yaml` would: the first of
/// `cluster_ips` is `clusterIP`, their families the `ipFamilies` (two: PreferDualStack).
pub fn service_manifest(namespace: &str, name: &str, cluster_ips: &[IpAddr], ports: &[(&str, u16, &str)]) -> String {
    let ports: Vec<String> = ports
        .iter()
        .map(|(port_name, port, proto)| format!("  - name: {port_name}\n    port: {port}\n    protocol: {proto}\n"))
        .collect();
    let family = |ip: &IpAddr| if ip.is_ipv4() { "IPv4" } else { "IPv6" };
    let first = cluster_ips.first().map(ToString::to_string).unwrap_or_default();
    let ips: Vec<String> = cluster_ips.iter().map(|ip| format!("\"{ip}\"")).collect();
    let families: Vec<&str> = cluster_ips.iter().map(family).collect();
    let policy = if cluster_ips.len() > 1 { "PreferDualStack" } else { "SingleStack" };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {namespace}\nspec:\n  type: ClusterIP\n  \
         clusterIP: \"{first}\"\n  clusterIPs: [{}]\n  ipFamilies: [{}]\n  ipFamilyPolicy: {policy}\n  ports:\n{}",
        ips.join(", "),
        families.join(", "),
        ports.concat()
    )
}

/// An EndpointSlice for `service` with ready endpoints `ips` (of one family; IPv4 when
/// empty) on `ports` (name, port, proto).
pub fn slice_manifest(
    namespace: &str,
    service: &str,
    slice: &str,
    ips: &[IpAddr],
    ports: &[(&str, u16, &str)],
) -> String {
    let address_type = if ips.first().is_some_and(IpAddr::is_ipv6) { "IPv6" } else { "IPv4" };
    let endpoints: Vec<String> = ips
        .iter()
        .map(|ip| {
            format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n")
        })
        .collect();
    let ports: Vec<String> =
        ports.iter().map(|(n, p, proto)| format!("- name: {n}\n  port: {p}\n  protocol: {proto}\n")).collect();
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {slice}\n  namespace: {namespace}\n  labels:\n    kubernetes.io/service-name: {service}\naddressType: {address_type}\nendpoints:{}ports:\n{}",
        if endpoints.is_empty() { " []\n".to_owned() } else { format!("\n{}", endpoints.concat()) },
        ports.concat()
    )
}

/// Write `text` to `dir/name` atomically (write + rename), so a watcher never reads half a file.
pub fn write_atomic(dir: &Path, name: &str, text: &str) -> Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    fs::write(&tmp, text)?;
    fs::rename(&tmp, dir.join(name))?;
    Ok(())
}

/// Wait until the pinned maps under `pin_root` hold `address` (e.g. `10.96.0.10:80/TCP`) with
/// exactly `backends` backends, or (with `None`) do not hold it at all.
pub fn wait_programmed(pin_root: &Path, address: &str, backends: Option<usize>, timeout: Duration) -> Result<()> {
    wait_for_backends(pin_root, address, timeout, |have| have.map(|b| b.len()) == backends)
}

/// Wait until the backends (address, port) of `address` in the pinned maps satisfy `ok`
/// (`None`: the address is not programmed).
pub fn wait_for_backends(
    pin_root: &Path,
    address: &str,
    timeout: Duration,
    ok: impl Fn(Option<&[(std::net::IpAddr, u16)]>) -> bool,
) -> Result<()> {
    use kpr::{
        datapath::{Maps as _, backend_addr, bpf::BpfMaps},
        model::display_key,
    };
    let deadline = std::time::Instant::now() + slow(timeout);
    let mut last = String::from("maps not pinned yet");
    loop {
        if let Ok(maps) = BpfMaps::open_pinned(pin_root) {
            let entry = maps.services()?.into_iter().find(|(k, _)| display_key(k).to_string() == address);
            let have = match entry {
                Some((_, v)) => Some(
                    maps.backends(v.backends_start, v.backends_count)?.iter().map(backend_addr).collect::<Vec<_>>(),
                ),
                None => None,
            };
            if ok(have.as_deref()) {
                return Ok(());
            }
            last = format!("{address} has backends {have:?}");
        }
        if std::time::Instant::now() > deadline {
            bail!("timed out waiting for {address}: {last}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub fn is_root() -> bool {
    // SAFETY: no preconditions.
    unsafe { libc::geteuid() == 0 }
}
