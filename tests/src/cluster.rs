//! A local Kubernetes control plane for the tests: etcd and kube-apiserver on 127.0.0.1 (built
//! from `tools/k8s` by `cargo xtask`, found through `KPR_K8S_BIN`), with generated certificates,
//! a static admin token, service-account signing keys and all data in a temporary directory.
//! And the peer: the real kube-proxy inside a test network namespace, reaching the API server
//! through an in-process relay on that namespace's own loopback.
//!
//! Every process is started by us, killed by its pid (and dies with the thread that started it,
//! through PR_SET_PDEATHSIG), and runs in the cgroup that was current when its owner was created,
//! never in a test's socket-LB cgroup. Everything is removed on drop, also when a test fails.
use std::{
    ffi::CString,
    fs,
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use testbed::Netns;

/// The service range of the test API server.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The pod range (the testbed's pods are 10.244.<i>.2).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";

/// A program built from `tools/k8s`: `$KPR_K8S_BIN/<name>` (set by `cargo xtask test`).
pub fn k8s_bin(name: &str) -> Result<PathBuf> {
    let dir = std::env::var_os("KPR_K8S_BIN")
        .context("KPR_K8S_BIN is not set: run the tests with `cargo xtask test` (it builds the control plane)")?;
    let path = PathBuf::from(dir).join(name);
    if !path.is_file() {
        bail!("{} is missing: `cargo xtask test` (or `cargo xtask cluster`) builds it", path.display());
    }
    Ok(path)
}

/// Start `cmd` as our child: in cgroup `home` (not the caller's socket-LB cgroup), killed when
/// the starting thread exits, output appended to `log`.
pub fn spawn_child(cmd: &mut Command, home: &Path, log: &Path) -> Result<Child> {
    let out = fs::OpenOptions::new().create(true).append(true).open(log)?;
    confine(cmd, home)?;
    cmd.stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("failed to start {cmd:?}"))
}

/// Make `cmd`'s process join `cgroup` before it executes, and die with the starting thread.
pub fn confine(cmd: &mut Command, cgroup: &Path) -> Result<()> {
    testbed::die_with_parent(cmd);
    let procs = CString::new(cgroup.join("cgroup.procs").into_os_string().into_encoded_bytes())?;
    // SAFETY: only async-signal-safe calls (sigmask, open, write, close) between fork and exec;
    // the path was allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            // Our caller may block signals (kpr-cluster waits for SIGINT/SIGTERM with sigwait);
            // the child must get them.
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let rc = libc::write(fd, b"0".as_ptr().cast(), 1);
            libc::close(fd);
            if rc != 1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

/// SIGTERM our child (by its pid), SIGKILL after `grace`, and reap it.
pub fn stop_child(child: &mut Child, grace: Duration) {
    if child.try_wait().ok().flatten().is_some() {
        return;
    }
    // SAFETY: kill(2) on the pid of a child we have not reaped yet.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if child.try_wait().ok().flatten().is_some() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn free_port() -> Result<u16> {
    Ok(crate::free_loopback_port()?.port())
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("openssl").args(args).current_dir(dir).output().context("failed to run openssl")?;
    if !out.status.success() {
        bail!("openssl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// `<name>.key` and `<name>.crt` in `dir`: a P-256 key and a certificate for `subject` with the
/// extensions `ext`, signed by the CA there (`ca.key`, `ca.crt`).
fn signed_by_ca(dir: &Path, name: &str, subject: &str, ext: &str) -> Result<()> {
    let (key, csr, crt, ext_file) =
        (format!("{name}.key"), format!("{name}.csr"), format!("{name}.crt"), format!("{name}.ext"));
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let mut req = vec!["req"];
    req.extend(ec);
    req.extend(["-keyout", &key, "-out", &csr, "-subj", subject]);
    openssl(dir, &req)?;
    fs::write(dir.join(&ext_file), ext)?;
    let sign = ["x509", "-req", "-in", &csr, "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial"];
    let mut args = sign.to_vec();
    args.extend(["-out", &crt, "-days", "3", "-extfile", &ext_file]);
    openssl(dir, &args)
}

fn random_token() -> Result<String> {
    let mut buf = [0u8; 16];
    fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// A kubeconfig for `server` trusting `ca`, authenticating with a bearer token.
pub fn kubeconfig_yaml(server: &str, ca: &Path, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: kpr-test\n  cluster:\n    server: {server}\n    certificate-authority: {}\nusers:\n- name: user\n  user:\n    token: {token}\ncontexts:\n- name: kpr-test\n  context:\n    cluster: kpr-test\n    user: user\ncurrent-context: kpr-test\n",
        ca.display()
    )
}

/// etcd + kube-apiserver on 127.0.0.1.
pub struct Cluster {
    pub name: String,
    /// Certificates, tokens, etcd data, logs, kubeconfigs; removed on drop.
    pub dir: PathBuf,
    pub api_port: u16,
    etcd_ports: (u16, u16),
    admin_token: String,
    pub admin_kubeconfig: PathBuf,
    home_cgroup: PathBuf,
    etcd: Option<Child>,
    apiserver: Option<Child>,
    /// kube-controller-manager and kube-scheduler, when a test runs real nodes.
    controllers: Vec<Child>,
    /// More kube-apiserver flags (service ranges of a test).
    apiserver_args: Vec<String>,
    /// Keep the data directory on drop (for inspection).
    pub keep: bool,
}

impl Cluster {
    /// Generate certificates and keys, start etcd and the API server, and wait until /readyz.
    pub fn start(tag: &str) -> Result<Self> {
        Self::start_with(tag, &[])
    }

    /// [`Self::start`] with more kube-apiserver flags (e.g. `--service-cluster-ip-range=...`).
    pub fn start_with(tag: &str, apiserver_args: &[&str]) -> Result<Self> {
        let name = testbed::unique_name(tag);
        let dir = std::env::temp_dir().join(format!("{name}.cluster"));
        fs::create_dir_all(&dir)?;
        let admin_token = random_token()?;
        let mut cluster = Self {
            admin_kubeconfig: dir.join("admin.kubeconfig"),
            name,
            api_port: free_port()?,
            etcd_ports: (free_port()?, free_port()?),
            admin_token,
            home_cgroup: kpr::datapath::bpf::own_cgroup()?,
            etcd: None,
            apiserver: None,
            controllers: Vec::new(),
            apiserver_args: apiserver_args.iter().map(|a| (*a).to_owned()).collect(),
            keep: false,
            dir,
        };
        cluster.generate_credentials()?;
        fs::write(&cluster.admin_kubeconfig, kubeconfig_yaml(&cluster.server(), &cluster.ca(), &cluster.admin_token))?;
        cluster.start_etcd()?;
        cluster.start_apiserver()?;
        cluster.wait_ready(Duration::from_secs(90))?;
        Ok(cluster)
    }

    pub fn server(&self) -> String {
        format!("https://127.0.0.1:{}", self.api_port)
    }

    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// The cgroup our control-plane processes run in (current when the cluster was created).
    pub fn home_cgroup(&self) -> &Path {
        &self.home_cgroup
    }

    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    fn generate_credentials(&self) -> Result<()> {
        let d = &self.dir;
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        let mut ca = vec!["req", "-x509"];
        ca.extend(ec);
        ca.extend(["-keyout", "ca.key", "-out", "ca.crt", "-days", "3", "-subj", "/CN=kpr-test-ca"]);
        openssl(d, &ca)?;
        signed_by_ca(
            d,
            "apiserver",
            "/CN=kube-apiserver",
            "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,IP:192.168.76.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n",
        )?;
        // The API server's client certificate for the kubelets (exec, logs, port-forward).
        signed_by_ca(
            d,
            "kubelet-client",
            "/O=system:masters/CN=kube-apiserver-kubelet-client",
            "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature\n",
        )?;
        openssl(d, &["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", "sa.key"])?;
        openssl(d, &["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
        fs::write(d.join("tokens.csv"), format!("{},kpr-admin,kpr-admin,\"system:masters\"\n", self.admin_token))?;
        Ok(())
    }

    pub fn start_etcd(&mut self) -> Result<()> {
        if self.etcd.is_some() {
            return Ok(());
        }
        let (client, peer) = self.etcd_ports;
        let mut cmd = Command::new(k8s_bin("etcd")?);
        cmd.arg("--name=kpr")
            .arg(format!("--data-dir={}", self.dir.join("etcd").display()))
            .arg(format!("--listen-client-urls=http://127.0.0.1:{client}"))
            .arg(format!("--advertise-client-urls=http://127.0.0.1:{client}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!("--initial-cluster=kpr=http://127.0.0.1:{peer}"))
            .args(["--unsafe-no-fsync", "--log-level=warn"]);
        self.etcd = Some(spawn_child(&mut cmd, &self.home_cgroup, &self.dir.join("etcd.log"))?);
        Ok(())
    }

    pub fn start_apiserver(&mut self) -> Result<()> {
        if self.apiserver.is_some() {
            return Ok(());
        }
        let d = |f: &str| self.dir.join(f).display().to_string();
        let mut cmd = Command::new(k8s_bin("kube-apiserver")?);
        cmd.arg(format!("--etcd-servers=http://127.0.0.1:{}", self.etcd_ports.0))
            .args(["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"])
            .arg(format!("--secure-port={}", self.api_port))
            .arg(format!("--service-cluster-ip-range={SERVICE_CIDR}"))
            .args(&self.apiserver_args)
            .arg(format!("--cert-dir={}", d("certs")))
            .arg(format!("--tls-cert-file={}", d("apiserver.crt")))
            .arg(format!("--tls-private-key-file={}", d("apiserver.key")))
            .arg(format!("--client-ca-file={}", d("ca.crt")))
            .arg(format!("--kubelet-client-certificate={}", d("kubelet-client.crt")))
            .arg(format!("--kubelet-client-key={}", d("kubelet-client.key")))
            // The nodes' names resolve nowhere: reach the kubelets by address.
            .arg("--kubelet-preferred-address-types=InternalIP")
            .arg(format!("--token-auth-file={}", d("tokens.csv")))
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg(format!("--service-account-key-file={}", d("sa.pub")))
            .arg(format!("--service-account-signing-key-file={}", d("sa.key")))
            .args(["--authorization-mode=RBAC", "--anonymous-auth=false", "--profiling=false"])
            // Privileged pods (kube-proxy's DaemonSet, the e2e suite's host-exec pods).
            .arg("--allow-privileged=true")
            .args(["--enable-priority-and-fairness=false", "--v=1"]);
        self.apiserver = Some(spawn_child(&mut cmd, &self.home_cgroup, &self.dir.join("apiserver.log"))?);
        Ok(())
    }

    /// kube-controller-manager (EndpointSlices of real pods, DaemonSets, service accounts and
    /// the `kube-root-ca.crt` ConfigMap their tokens come with) and kube-scheduler (DaemonSet
    /// pods are bound by it), both as the admin.
    pub fn start_controllers(&mut self) -> Result<()> {
        if !self.controllers.is_empty() {
            return Ok(());
        }
        let d = |f: &str| self.dir.join(f).display().to_string();
        let kubeconfig = format!("--kubeconfig={}", self.admin_kubeconfig.display());
        let mut manager = Command::new(k8s_bin("kube-controller-manager")?);
        manager
            .arg(&kubeconfig)
            .args(["--leader-elect=false", "--secure-port=0", "--use-service-account-credentials=false"])
            .arg(format!("--root-ca-file={}", d("ca.crt")))
            .arg(format!("--service-account-private-key-file={}", d("sa.key")))
            .arg(format!("--service-cluster-ip-range={SERVICE_CIDR}"))
            // The test nodes' CNI configuration holds their pod ranges: no node IPAM.
            .args(["--controllers=*,-node-ipam-controller", "--v=1"]);
        let mut scheduler = Command::new(k8s_bin("kube-scheduler")?);
        scheduler.arg(&kubeconfig).args(["--leader-elect=false", "--secure-port=0", "--v=1"]);
        for (cmd, log) in [(&mut manager, "controller-manager.log"), (&mut scheduler, "scheduler.log")] {
            let child = spawn_child(cmd, &self.home_cgroup, &self.dir.join(log))?;
            self.controllers.push(child);
        }
        Ok(())
    }

    /// Stop the API server (SIGTERM, as a node shutdown would).
    pub fn stop_apiserver(&mut self) {
        if let Some(mut child) = self.apiserver.take() {
            stop_child(&mut child, Duration::from_secs(15));
        }
    }

    pub fn stop_etcd(&mut self) {
        if let Some(mut child) = self.etcd.take() {
            stop_child(&mut child, Duration::from_secs(10));
        }
    }

    /// Stop everything (controllers, then the API server); the data stays for a restart.
    pub fn stop(&mut self) {
        for mut child in self.controllers.drain(..) {
            stop_child(&mut child, Duration::from_secs(10));
        }
        self.stop_apiserver();
        self.stop_etcd();
    }

    /// Start etcd and the API server again on the same data, ports and keys; wait for /readyz.
    pub fn restart(&mut self) -> Result<()> {
        self.start_etcd()?;
        self.start_apiserver()?;
        self.wait_ready(Duration::from_secs(90))
    }

    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last;
        loop {
            let exited = |c: &mut Option<Child>| c.as_mut().and_then(|c| c.try_wait().ok().flatten());
            for (what, status) in [("etcd", exited(&mut self.etcd)), ("kube-apiserver", exited(&mut self.apiserver))] {
                if let Some(status) = status {
                    bail!("{what} exited ({status}); logs:\n{}", self.logs());
                }
            }
            match self.kubectl(&["get", "--raw", "/readyz", "--request-timeout=5s"]) {
                Ok(out) if out.trim() == "ok" => return Ok(()),
                Ok(out) => last = out,
                Err(e) => last = format!("{e:#}"),
            }
            if Instant::now() > deadline {
                bail!("the API server did not become ready: {last}\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The tails of the etcd and API server logs.
    pub fn logs(&self) -> String {
        let tail = |f: &str| {
            let text = fs::read_to_string(self.dir.join(f)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(30)..].join("\n")
        };
        format!("--- etcd.log\n{}\n--- apiserver.log\n{}", tail("etcd.log"), tail("apiserver.log"))
    }

    /// `kubectl` as the admin; stdout, or an error with stderr.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.kubectl_as(&self.admin_kubeconfig, args, None)
    }

    /// `kubectl apply -f -` of a YAML document (or several).
    pub fn apply(&self, yaml: &str) -> Result<String> {
        self.kubectl_as(&self.admin_kubeconfig, &["apply", "-f", "-"], Some(yaml))
    }

    pub fn kubectl_as(&self, kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Result<String> {
        let mut cmd = Command::new(k8s_bin("kubectl")?);
        cmd.arg("--kubeconfig").arg(kubeconfig).args(args);
        cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().context("failed to start kubectl")?;
        if let Some(text) = stdin {
            child.stdin.take().expect("piped").write_all(text.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!("kubectl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// Write a kubeconfig using `token` (e.g. from the TokenRequest API) into the cluster dir.
    pub fn kubeconfig_for_token(&self, file: &str, token: &str) -> Result<PathBuf> {
        let path = self.dir.join(file);
        fs::write(&path, kubeconfig_yaml(&self.server(), &self.ca(), token))?;
        Ok(path)
    }

    /// The ClusterIP the API server allocated to `namespace/name`.
    /// The ClusterIPs of Service `namespace/name` (`spec.clusterIPs`: one per family).
    pub fn cluster_ips(&self, namespace: &str, name: &str) -> Result<Vec<std::net::IpAddr>> {
        let out = self.kubectl(&["get", "service", "-n", namespace, name, "-o", "jsonpath={.spec.clusterIPs[*]}"])?;
        let ips = out.split_whitespace().map(str::parse).collect::<Result<Vec<_>, _>>();
        ips.with_context(|| format!("service {namespace}/{name} has clusterIPs {out:?}"))
    }

    pub fn cluster_ip(&self, namespace: &str, name: &str) -> Result<Ipv4Addr> {
        let out = self.kubectl(&["get", "service", "-n", namespace, name, "-o", "jsonpath={.spec.clusterIP}"])?;
        out.trim().parse().with_context(|| format!("service {namespace}/{name} has clusterIP {out:?}"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
        if self.keep {
            eprintln!("cluster: kept {}", self.dir.display());
        } else if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("cluster: failed to remove {}: {e}", self.dir.display());
        }
    }
}

/// A TCP relay from `listen` inside a network namespace to `target` in this process's (host)
/// namespace: how a process in a test namespace reaches the API server on the host's 127.0.0.1
/// without any route between the namespaces.
pub struct Relay {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Relay {
    pub fn new(ns: &Netns, listen: SocketAddrV4, target: SocketAddrV4) -> Result<Self> {
        let listener = ns.run(move || TcpListener::bind(listen))??;
        Self::serve(listener, target)
    }

    /// A relay from `listen` in this process's namespace (an address of a test's own link).
    pub fn on_host(listen: SocketAddrV4, target: SocketAddrV4) -> Result<Self> {
        Self::serve(TcpListener::bind(listen).with_context(|| format!("binding {listen}"))?, target)
    }

    fn serve(listener: TcpListener, target: SocketAddrV4) -> Result<Self> {
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        // This thread is in the host namespace: its connects reach the host's loopback.
        let thread = std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                let Ok((inner, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let _ = inner.set_nonblocking(false);
                let Ok(outer) = TcpStream::connect(target) else { continue };
                // Each write passed on at once: with Nagle's algorithm a watch event could wait
                // for the peer's delayed ACK (tens of ms added to every change the proxy sees).
                let _ = inner.set_nodelay(true);
                let _ = outer.set_nodelay(true);
                for (mut from, mut to) in
                    [(inner.try_clone(), outer.try_clone()), (outer.try_clone(), inner.try_clone())]
                        .into_iter()
                        .filter_map(|(a, b)| Some((a.ok()?, b.ok()?)))
                {
                    let stop3 = stop2.clone();
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16384];
                        while !stop3.load(Ordering::Relaxed) {
                            match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => {
                                    if to.write_all(&buf[..n]).is_err() {
                                        break;
                                    }
                                }
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Both);
                        let _ = from.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Port of the relay to the API server inside a kube-proxy namespace.
const RELAY_PORT: u16 = 6443;

/// The real kube-proxy, running in `netns` (its "node"), watching the test API server.
pub struct KubeProxy {
    pub mode: String,
    pub netns: String,
    pub log: PathBuf,
    child: Option<Child>,
    _relay: Relay,
}

impl KubeProxy {
    /// Start kube-proxy in `mode` (`iptables` or `nftables`) in `netns` as node `node_name`.
    /// The namespace gets a link route for the service range on `service_dev` (kube-proxy's
    /// DNAT happens after the route lookup, which a real node passes with its default route);
    /// metrics and healthz bind to 127.0.0.1 inside the namespace.
    pub fn start(cluster: &Cluster, netns: &Netns, mode: &str, node_name: &str, service_dev: &str) -> Result<Self> {
        netns.ip(&["route", "add", SERVICE_CIDR, "dev", service_dev])?;
        let relay = Relay::new(
            netns,
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, RELAY_PORT),
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, cluster.api_port),
        )?;
        let file = format!("kube-proxy-{}.kubeconfig", netns.name);
        let kubeconfig = cluster.dir.join(&file);
        fs::write(
            &kubeconfig,
            kubeconfig_yaml(&format!("https://127.0.0.1:{RELAY_PORT}"), &cluster.ca(), cluster.admin_token()),
        )?;
        let log = cluster.dir.join(format!("kube-proxy-{}.log", netns.name));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &netns.name])
            .arg(k8s_bin("kube-proxy")?)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--hostname-override={node_name}"))
            .arg(format!("--proxy-mode={mode}"))
            .args(["--metrics-bind-address=127.0.0.1:10249", "--healthz-bind-address=127.0.0.1:10256"])
            // Leave the machine-wide conntrack table size alone.
            .args(["--conntrack-max-per-core=0"])
            // Frequent full syncs, so "synced after T" is observable quickly in the metrics.
            .args(["--iptables-sync-period=2s", "--iptables-min-sync-period=0s", "--v=2"]);
        let child = spawn_child(&mut cmd, &cluster.home_cgroup, &log)?;
        Ok(Self { mode: mode.to_owned(), netns: netns.name.clone(), log, child: Some(child), _relay: relay })
    }

    /// Start kube-proxy in `netns` with nothing but a configuration file: `config` (a
    /// KubeProxyConfiguration without `clientConnection`) plus the kubeconfig of a relay to the
    /// API server on the namespace's loopback. Returns the file written, which kpr can be given
    /// as it is.
    pub fn start_with_config(cluster: &Cluster, netns: &Netns, config: &str) -> Result<(Self, PathBuf)> {
        let relay = Relay::new(
            netns,
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, RELAY_PORT),
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, cluster.api_port),
        )?;
        let kubeconfig = cluster.dir.join(format!("kube-proxy-{}.kubeconfig", netns.name));
        fs::write(
            &kubeconfig,
            kubeconfig_yaml(&format!("https://127.0.0.1:{RELAY_PORT}"), &cluster.ca(), cluster.admin_token()),
        )?;
        let file = cluster.dir.join(format!("kube-proxy-{}.yaml", netns.name));
        fs::write(&file, format!("{config}clientConnection:\n  kubeconfig: {}\n", kubeconfig.display()))?;
        let mode = config.lines().find_map(|l| l.strip_prefix("mode: ")).map_or("iptables", str::trim).to_owned();
        let log = cluster.dir.join(format!("kube-proxy-{}.log", netns.name));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &netns.name])
            .arg(k8s_bin("kube-proxy")?)
            .arg(format!("--config={}", file.display()))
            .arg("--v=2");
        let child = spawn_child(&mut cmd, &cluster.home_cgroup, &log)?;
        Ok((Self { mode, netns: netns.name.clone(), log, child: Some(child), _relay: relay }, file))
    }

    pub fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// The kube-proxy process (`ip netns exec` execs it: the same pid).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// GET `path` from kube-proxy's metrics server (127.0.0.1:10249 in its namespace).
    pub fn http_get(&self, port: u16, path: &str) -> Result<String> {
        let ns = Netns { name: self.netns.clone() };
        let path = path.to_owned();
        let addr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port).into();
        let result = ns.run(move || testbed::http_get(addr, &path, Duration::from_secs(5)).map(|(_, body)| body));
        std::mem::forget(ns); // not ours to delete
        result?
    }

    /// `kubeproxy_sync_proxy_rules_last_timestamp_seconds`, if kube-proxy has synced.
    pub fn last_sync(&self) -> Option<f64> {
        let metrics = self.http_get(10249, "/metrics").ok()?;
        // `..._seconds N` or, per IP family, `..._seconds{ip_family="IPv4"} N`.
        metrics
            .lines()
            .filter(|l| l.starts_with("kubeproxy_sync_proxy_rules_last_timestamp_seconds"))
            .filter_map(|l| l.rsplit(' ').next()?.trim().parse::<f64>().ok())
            .reduce(f64::max)
            .filter(|&t| t > 0.0)
    }

    /// Wait until kube-proxy completed a sync after `since` (unix seconds). Start kube-proxy
    /// after the changes, or wait past `since` + its sync period, for that sync to include them.
    pub fn wait_synced_after(&mut self, since: f64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if !self.running() {
                bail!("kube-proxy ({}) exited:\n{}", self.mode, self.log_tail());
            }
            if self.last_sync().is_some_and(|t| t > since) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("kube-proxy ({}) did not sync after {since}:\n{}", self.mode, self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for KubeProxy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Duration::from_secs(5));
        }
    }
}

/// Unix time now, in seconds.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_secs_f64()
}
