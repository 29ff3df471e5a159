//! `kpr`: the agent and its operator commands.
use std::{net::IpAddr, path::PathBuf, time::Duration};

use anyhow::Result;
use clap::{Parser, Subcommand};
use kpr::{
    agent::{self, AgentConfig, SourceConfig},
    config::{FlagOverrides, ProxyConfig},
    datapath::bpf::{self, DatapathConfig, ForwardDirect},
    model::{
        ProxyOptions,
        node::{DetectLocal, NodeSettings, TcLinks},
    },
};
use proxy_common::defaults;

#[derive(Parser)]
#[command(name = "kpr", version, about = "kube-proxy replacement on eBPF")]
struct Cli {
    /// Log lines as text or as JSON objects (for log collectors).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Watch Services and EndpointSlices and program the datapath.
    Agent(AgentArgs),
    /// Show the programmed service ports, their backends and the datapath counters.
    Services {
        #[arg(long, default_value = "/sys/fs/bpf/kpr")]
        pin_root: PathBuf,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Compare what the agent would program (from the API or the manifests, with the agent's
    /// flags and configuration file) with the pinned maps; exits 1 when they differ.
    Diff {
        #[command(flatten)]
        agent: AgentArgs,
        /// How long to wait for the source's complete lists.
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        wait: Duration,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// What the datapath does with a new connection from SRC to DST:PORT/PROTO: the path, the
    /// frontend entry, the policies, the candidate endpoints, masquerade, the verdict — from
    /// the live maps.
    Trace {
        source: std::net::IpAddr,
        destination: kpr::inspect::trace::Destination,
        /// Where SRC is [default: as the datapath classifies it].
        #[arg(long, value_enum)]
        from: Option<kpr::inspect::trace::From>,
        #[arg(long, default_value = "/sys/fs/bpf/kpr")]
        pin_root: PathBuf,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// The per-packet path's connections (list), or forget a service's (flush).
    Conntrack {
        #[command(subcommand)]
        action: ConntrackAction,
    },
    /// Detach kpr and remove its pinned maps (like `kube-proxy --cleanup`); turns accept_local
    /// off where kpr turned it on.
    Cleanup {
        #[arg(long, default_value = "/sys/fs/bpf/kpr")]
        pin_root: PathBuf,
        /// Even while an agent runs on the pin root.
        #[arg(long)]
        force: bool,
    },
    /// The built-in demo: pods in network namespaces behind a ClusterIP, on this machine only.
    Demo {
        /// Keep the demo up (for `bpftool` and `kpr services`) until Ctrl-C.
        #[arg(long)]
        keep_running: bool,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    Text,
    Json,
}

#[derive(Subcommand)]
enum ConntrackAction {
    /// One line per flow: client, frontend, backend, the source the backend sees, state.
    List {
        #[command(flatten)]
        select: FlowSelect,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Remove the flows of a service port (both directions): their next packets start anew.
    Flush {
        #[command(flatten)]
        select: FlowSelect,
    },
}

#[derive(clap::Args)]
struct FlowSelect {
    #[arg(long, default_value = "/sys/fs/bpf/kpr")]
    pin_root: PathBuf,
    /// Only the flows of this frontend, as `kpr services` shows it (`10.96.0.10:80/TCP`;
    /// every source class unless one is named, e.g. `192.168.0.2:30080/TCP ext`).
    #[arg(long)]
    frontend: Option<String>,
}

/// `--host-external-ips`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum HostExternalIps {
    All,
    Local,
}

#[derive(clap::Args)]
struct AgentArgs {
    /// kube-proxy's configuration file (a `KubeProxyConfiguration`, as in kubeadm's
    /// `kube-system/kube-proxy` ConfigMap). Flags given explicitly override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Read Services, EndpointSlices and this node's Node from this directory of manifests
    /// instead of the API.
    #[arg(long, conflicts_with = "kubeconfig")]
    manifests: Option<PathBuf>,
    /// Kubeconfig of the cluster [default: the file's clientConnection.kubeconfig, else the
    /// in-cluster config or KUBECONFIG].
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The API server's address, overriding the kubeconfig's (kube-proxy's --master). In a
    /// pod without a kubeconfig, give this or a kubeconfig: the in-cluster address is the
    /// `kubernetes` Service, which kpr itself has to program first.
    #[arg(long)]
    master: Option<String>,
    /// Attach the per-packet programs as netlink tc filters (priority 1000) even where TCX
    /// exists; kernels before 6.6 always do.
    #[arg(long)]
    tc_netlink: bool,
    /// When packets the per-packet path translated on their way in are sent straight out of
    /// their link, skipping the host's forwarding path (netfilter's FORWARD chain, routing):
    /// `auto` only while nothing filters forwarded packets there (no rule or drop policy on
    /// the forward hook, checked every second), so that a NetworkPolicy enforced in FORWARD
    /// (Calico iptables, kube-router, kube-network-policies) holds for Service traffic as it
    /// does behind kube-proxy; `always` skips it even then; `never` never does.
    #[arg(long, value_enum, default_value_t = ForwardDirect::Auto)]
    forward_direct: ForwardDirect,
    /// Connections the node's own processes make to a Service's externalIP or LoadBalancer IP:
    /// `all` translates them to its endpoints whatever the address, as kube-proxy does (a
    /// Service can then take over the node's traffic to any address, CVE-2020-8554; kpr's own
    /// connections are exempt); `local` only where the address is one of the node's own, as
    /// Cilium's socket load balancer does. Pods and outside clients are served either way.
    #[arg(long, value_enum, default_value_t = HostExternalIps::All)]
    host_external_ips: HostExternalIps,
    /// The same as `--forward-direct never` (kept for earlier command lines).
    #[arg(long)]
    host_routing: bool,
    /// `mode: iptables`: leave packets to the service range that no service port takes to the
    /// routing table, as kube-proxy's iptables mode does. By default kpr refuses them as its
    /// nftables mode does (an unknown port of a ClusterIP rejected, an unallocated address
    /// dropped) instead of letting them leave the node.
    #[arg(long)]
    pass_service_range: bool,
    /// Take the node over from kube-proxy: once every Service is programmed, leave the flows
    /// kube-proxy translated to netfilter's conntrack and remove kube-proxy's iptables chains
    /// and nftables tables (as `kube-proxy --cleanup` does). Needs iptables-save/-restore and
    /// nft on PATH for the backends in use.
    #[arg(long)]
    cleanup_kube_proxy: bool,
    /// cgroup2 directory whose sockets are load-balanced [default: the cgroup2 root].
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// bpffs directory for kpr's pinned maps and links (a layout version is appended).
    #[arg(long, default_value = "/sys/fs/bpf/kpr")]
    pin_root: PathBuf,
    /// This node's name (endpoint locality, the Node to watch) [default: the file's
    /// hostnameOverride, else NODE_NAME, else the host name].
    #[arg(long = "hostname-override", alias = "node-name")]
    hostname_override: Option<String>,
    #[arg(long, default_value_t = defaults::MAX_SERVICE_PORTS)]
    max_service_ports: u32,
    #[arg(long, default_value_t = defaults::MAX_BACKENDS)]
    max_backends: u32,
    #[arg(long, default_value_t = defaults::MAX_SOCK_REVNAT)]
    max_sock_revnat: u32,
    /// Entries of the loadBalancerSourceRanges map (one per range per LoadBalancer IP
    /// frontend); a Service whose ranges do not fit is left as it was, and the others are
    /// programmed.
    #[arg(long, default_value_t = defaults::MAX_SOURCE_RANGES)]
    max_source_ranges: u32,
    /// Per-packet conntrack entries (two per flow through NodePort/external frontends) of each
    /// family's table of established flows.
    #[arg(long, default_value_t = defaults::MAX_CONNTRACK)]
    max_conntrack: u32,
    /// The same, of each family's table of flows not answered yet.
    #[arg(long, default_value_t = defaults::MAX_CONNTRACK_NEW)]
    max_conntrack_new: u32,
    /// Where the kernel's conntrack sysctls are written from kube-proxy's `conntrack.*`
    /// settings, as kube-proxy writes them (a container's /proc/sys is read-only: the
    /// DaemonSet mounts the node's `/proc/sys/net/netfilter` here).
    #[arg(long, default_value = "/proc/sys/net/netfilter")]
    netfilter_sysctl_dir: PathBuf,
    /// Restrict the per-packet datapath to these interfaces (comma-separated), or `none` to
    /// turn it off [default: every interface but loopback, including ones created later].
    #[arg(long, value_delimiter = ',')]
    interfaces: Vec<String>,
    /// Addresses that are this node's (NodePorts, "from the node") even if no interface holds
    /// them; the first is the primary address (masquerade fallback, `primary` NodePorts).
    #[arg(long = "node-ip")]
    node_ips: Vec<IpAddr>,
    /// The pods' range(s), comma-separated (kube-proxy's --cluster-cidr).
    #[arg(long)]
    cluster_cidr: Option<String>,
    /// ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix.
    #[arg(long)]
    detect_local_mode: Option<String>,
    #[arg(long)]
    pod_bridge_interface: Option<String>,
    #[arg(long)]
    pod_interface_name_prefix: Option<String>,
    /// CIDRs (or `primary`) of the addresses NodePorts are served on.
    #[arg(long = "nodeport-addresses", value_delimiter = ',')]
    nodeport_addresses: Option<Vec<String>>,
    /// Masquerade all traffic to ClusterIPs.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    masquerade_all: Option<bool>,
    /// Serve NodePorts on 127.0.0.0/8 to the node's own sockets.
    #[arg(long = "iptables-localhost-nodeports")]
    localhost_nodeports: Option<bool>,
    /// The node's primary address (kube-proxy's --bind-address).
    #[arg(long)]
    bind_address: Option<IpAddr>,
    /// Full reconcile interval (Go duration, e.g. 30s).
    #[arg(long = "iptables-sync-period", value_parser = parse_duration)]
    sync_period: Option<Duration>,
    /// Least time between two syncs (Go duration, e.g. 1s; 0s: none).
    #[arg(long = "iptables-min-sync-period", value_parser = parse_duration)]
    min_sync_period: Option<Duration>,
    /// Seconds between full reconciles (older spelling of --iptables-sync-period).
    #[arg(long)]
    reconcile_interval: Option<u64>,
    /// kube-proxy's metrics server: IP:port, or an IP (port 10249); empty: off.
    #[arg(long)]
    metrics_bind_address: Option<String>,
    /// kube-proxy's healthz server: IP:port, or an IP (port 10256); empty: off.
    #[arg(long)]
    healthz_bind_address: Option<String>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match cli.command {
        Command::Agent(args) => run_agent(args).await,
        Command::Services { pin_root, output } => {
            let report = kpr::inspect::services::report(&pin_root)?;
            print_out(output, &report, kpr::inspect::services::text)
        }
        Command::Diff { agent, wait, output } => diff(agent, wait, output).await,
        Command::Conntrack { action } => conntrack(action),
        Command::Trace { source, destination, from, pin_root, output } => {
            let report = kpr::inspect::trace::trace(&pin_root, source, destination, from)?;
            print_out(output, &report, kpr::inspect::trace::text)
        }
        Command::Cleanup { pin_root, force } => {
            if bpf::AgentLock::held(&pin_root) && !force {
                anyhow::bail!(
                    "a kpr agent is running on {}: stop it first (or --force, which leaves the node without service translation)",
                    pin_root.display()
                );
            }
            bpf::cleanup(&pin_root)?;
            // The NAT chains kept for the flows kube-proxy made, if a takeover left them.
            kpr::takeover::release_nat_hooks();
            println!("removed kpr's pins under {}", pin_root.display());
            Ok(())
        }
        Command::Demo { keep_running } => kpr::demo::run(keep_running).await,
    }
}

/// Logs go to stderr; colours only on a terminal and without `NO_COLOR`.
fn init_logging(format: LogFormat) {
    use std::io::IsTerminal as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Json => logs.json().flatten_event(true).init(),
        LogFormat::Text => {
            let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
            logs.with_ansi(colour).init();
        }
    }
}

/// The configuration file (or kube-proxy's defaults), then the flags given on top.
fn effective_config(args: &AgentArgs) -> Result<ProxyConfig> {
    let mut config = match &args.config {
        Some(path) => ProxyConfig::load(path)?,
        None => ProxyConfig::default(),
    };
    config.apply_flags(&FlagOverrides {
        hostname_override: args.hostname_override.clone(),
        cluster_cidr: args.cluster_cidr.clone(),
        detect_local_mode: args.detect_local_mode.clone(),
        pod_bridge_interface: args.pod_bridge_interface.clone(),
        pod_interface_name_prefix: args.pod_interface_name_prefix.clone(),
        node_port_addresses: args.nodeport_addresses.clone(),
        masquerade_all: args.masquerade_all,
        localhost_node_ports: args.localhost_nodeports,
        bind_address: args.bind_address,
        sync_period: args.sync_period.or(args.reconcile_interval.map(Duration::from_secs)),
        min_sync_period: args.min_sync_period,
        kubeconfig: args.kubeconfig.clone(),
        metrics_bind_address: args.metrics_bind_address.clone(),
        healthz_bind_address: args.healthz_bind_address.clone(),
    })?;
    Ok(config)
}

async fn run_agent(args: AgentArgs) -> Result<()> {
    let cfg = agent_config(args)?;
    raise_fd_limit();
    raise_memlock_limit();
    agent::run(cfg, kpr::shutdown_signal()).await
}

/// The agent's whole configuration: the file, the flags, and what follows from them.
fn agent_config(args: AgentArgs) -> Result<AgentConfig> {
    let config = effective_config(&args)?;
    let cgroup = match args.cgroup {
        Some(c) => bpf::cgroup2_dir(&c)?,
        None => bpf::cgroup2_root()?,
    };
    let tc_links = match args.interfaces.as_slice() {
        [] => TcLinks::All,
        [none] if none == "none" => TcLinks::Off,
        names => TcLinks::Only(names.to_vec()),
    };
    let detector = config.detector();
    let mut datapath = DatapathConfig::new(args.pin_root, cgroup);
    datapath.max_service_ports = args.max_service_ports;
    datapath.max_backends = args.max_backends;
    datapath.max_sock_revnat = args.max_sock_revnat;
    datapath.max_source_ranges = args.max_source_ranges;
    datapath.max_conntrack = args.max_conntrack;
    datapath.max_conntrack_new = args.max_conntrack_new;
    datapath.ct_timeouts = config.conntrack.timeouts.datapath();
    datapath.tc_netlink = args.tc_netlink;
    datapath.detect_local = match detector {
        DetectLocal::None => proxy_common::DETECT_LOCAL_NONE,
        DetectLocal::ClusterCidr(_) | DetectLocal::NodeCidr => proxy_common::DETECT_LOCAL_CIDR,
        DetectLocal::BridgeInterface(_) | DetectLocal::InterfaceNamePrefix(_) => proxy_common::DETECT_LOCAL_INTERFACE,
    };
    datapath.localhost_node_ports = config.localhost_node_ports_effective();
    datapath.pod_links_covered = tc_links == TcLinks::All;
    // Straight out only where kpr is on every link: a reply that comes back by a link kpr is
    // not on meets the host's conntrack, which must then have seen the flow's first packet.
    datapath.forward_direct =
        if args.host_routing || !datapath.pod_links_covered { ForwardDirect::Never } else { args.forward_direct };
    datapath.agent_cgroup_id = match bpf::agent_cgroup_id() {
        Ok(Some(id)) => id,
        Ok(None) => {
            tracing::info!(
                "kpr shares its cgroup with other processes: its own connections are translated like theirs \
                 (externalIPs and LoadBalancer IPs included)"
            );
            0
        }
        Err(e) => {
            tracing::warn!("cannot tell kpr's own cgroup ({e:#}): its own connections are translated like others'");
            0
        }
    };
    // What no service port takes in the service range is refused, as kube-proxy's nftables
    // mode does; iptables mode passes it to the routing table, which kpr does on request only.
    let refuse_service_range = config.mode == "nftables" || !args.pass_service_range;
    if args.pass_service_range && config.mode == "nftables" {
        tracing::warn!("--pass-service-range has no effect in mode: nftables, which refuses the service range itself");
    }
    datapath.refuse_service_range = refuse_service_range;
    let source = match args.manifests {
        Some(dir) => SourceConfig::Manifests(dir),
        None => SourceConfig::Kube { kubeconfig: config.kubeconfig.clone(), master: args.master.clone() },
    };
    let name = match config.hostname_override.clone().or_else(|| std::env::var("NODE_NAME").ok()) {
        Some(n) => n,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")?.trim().to_lowercase(),
    };
    let node = NodeSettings {
        name,
        node_port_addresses: config.node_port_addresses(),
        detect_local: detector.clone(),
        node_ips: args.node_ips,
        bind_address: Some(config.bind_address).filter(|a| !a.is_unspecified()),
        tc_links,
    };
    tracing::info!(config = %serde_json::to_string(&config)?, "effective configuration");
    let cfg = AgentConfig {
        source,
        datapath,
        node,
        options: ProxyOptions {
            masquerade_all: config.masquerade_all,
            detect_local: detector.implemented(),
            refuse_service_range,
            host_external_ips_local_only: args.host_external_ips == HostExternalIps::Local,
        },
        sync_period: config.sync_period,
        min_sync_period: config.min_sync_period,
        metrics_bind_address: config.metrics_bind_address,
        healthz_bind_address: config.healthz_bind_address,
        configz: config.configz(),
        cleanup_kube_proxy: args.cleanup_kube_proxy,
        netfilter_sysctls: (
            args.netfilter_sysctl_dir,
            kpr::datapath::netfilter_sysctls::plan(
                &config.conntrack,
                std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            ),
        ),
    };
    Ok(cfg)
}

/// Raise the soft limit on open files to the hard limit (as Go programs such as kube-proxy
/// do): watches, sockets and health check clients must not run the agent out of descriptors.
fn raise_fd_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write one rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit { rlim_cur: limit.rlim_max, ..limit };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                tracing::debug!(from = limit.rlim_cur, to = limit.rlim_max, "raised the open files limit");
            }
        }
    }
}

/// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK (later ones to the memory cgroup):
/// lift it, which needs CAP_SYS_RESOURCE; without it, say why map creation may fail.
fn raise_memlock_limit() {
    let unlimited = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: setrlimit reads one rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } == 0 {
        return;
    }
    let error = std::io::Error::last_os_error();
    if !aya::util::KernelVersion::current().is_ok_and(|v| v >= aya::util::KernelVersion::new(5, 11, 0)) {
        tracing::warn!(
            "cannot lift the locked-memory limit ({error}): this kernel charges BPF maps to it, so large maps \
             may fail (give the agent CAP_SYS_RESOURCE)"
        );
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    kpr::config::go_duration::parse(s)
}

/// Print a report as text, or as JSON; a closed pipe (`| head`) is not an error.
fn print_out<T: serde::Serialize>(output: Output, report: &T, text: impl Fn(&T) -> String) -> Result<()> {
    use std::io::Write as _;
    let out = match output {
        Output::Text => text(report),
        Output::Json => serde_json::to_string_pretty(report)? + "\n",
    };
    match std::io::stdout().lock().write_all(out.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

async fn diff(args: AgentArgs, wait: Duration, output: Output) -> Result<()> {
    let cfg = agent_config(args)?;
    let desired = agent::desired_state(cfg.source, cfg.node, cfg.options, wait).await?;
    let maps = bpf::BpfMaps::open_pinned(&cfg.datapath.pin_root)?;
    let programmed = kpr::datapath::read_programmed(&maps)?;
    let report = kpr::inspect::diff::compare(&desired, &programmed);
    print_out(output, &report, kpr::inspect::diff::text)?;
    if !report.in_sync {
        std::process::exit(1);
    }
    Ok(())
}

/// The service ids of the frontend `kpr services` shows as `frontend` (all its source
/// classes when no class is named).
fn frontend_ids(pin_root: &std::path::Path, frontend: &str) -> Result<Vec<u32>> {
    let maps = bpf::BpfMaps::open_pinned(pin_root)?;
    let ids: Vec<u32> = kpr::datapath::read_programmed(&maps)?
        .iter()
        .filter(|(key, _)| {
            let shown = kpr::datapath::display_key(key).to_string();
            shown == frontend || shown.split(' ').next() == Some(frontend)
        })
        .map(|(_, p)| p.value.service_id)
        .collect();
    anyhow::ensure!(!ids.is_empty(), "no frontend {frontend} in the maps (see `kpr services`)");
    Ok(ids)
}

fn conntrack(action: ConntrackAction) -> Result<()> {
    use kpr::inspect::conntrack as ct;
    match action {
        ConntrackAction::List { select, output } => {
            let ids = select.frontend.as_deref().map(|f| frontend_ids(&select.pin_root, f)).transpose()?;
            let flows = ct::list(&select.pin_root, ids.as_deref(), &proxy_common::CtTimeouts::DEFAULT)?;
            print_out(output, &flows, |f| ct::text(f))
        }
        ConntrackAction::Flush { select } => {
            let frontend =
                select.frontend.as_deref().ok_or_else(|| anyhow::anyhow!("--frontend: which flows to flush"))?;
            let mut removed = 0;
            for id in frontend_ids(&select.pin_root, frontend)? {
                removed += ct::flush(&select.pin_root, id)?;
            }
            println!("removed {removed} conntrack entries of {frontend}");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::ConfigMap};

    use super::*;

    const DAEMONSET: &str = include_str!("../../deploy/daemonset.yaml");
    const CONFIGMAP: &str = include_str!("../../deploy/configmap.yaml");

    /// deploy/: the DaemonSet's command is a valid `kpr agent` command line, and the files it
    /// names are the ConfigMap's, which kpr parses.
    #[test]
    fn deploy_manifests_agree_with_the_agent() {
        let daemonset: DaemonSet = serde_yaml::from_str(DAEMONSET).unwrap();
        let pod = daemonset.spec.template.spec.unwrap();
        let container = &pod.containers[0];
        let cli = Cli::try_parse_from(container.command.as_ref().unwrap()).unwrap();
        let Command::Agent(args) = cli.command else { panic!("the DaemonSet runs `kpr agent`") };
        let config_path = args.config.unwrap();
        let config_mount = container.volume_mounts.as_ref().unwrap().iter().find(|m| m.name == "config").unwrap();
        let config_volume = pod.volumes.as_ref().unwrap().iter().find(|v| v.name == "config").unwrap();
        assert_eq!(config_volume.config_map.as_ref().unwrap().name, "kpr");

        let configmap: ConfigMap = serde_yaml::from_str(CONFIGMAP).unwrap();
        let data = configmap.data.unwrap();
        let file_in_configmap = |path: &std::path::Path| {
            let key = path.strip_prefix(&config_mount.mount_path).expect("a file of the ConfigMap's mount");
            data.get(key.to_str().unwrap()).unwrap_or_else(|| panic!("the ConfigMap has no {}", key.display())).clone()
        };
        let config = kpr::config::ProxyConfig::parse(&file_in_configmap(&config_path)).unwrap();
        let kubeconfig_path = config.kubeconfig.clone().expect("the file names a kubeconfig");
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&file_in_configmap(&kubeconfig_path)).unwrap();
        let user = kubeconfig.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(user.token_file.as_deref(), Some("/var/run/secrets/kubernetes.io/serviceaccount/token"));
        assert_eq!(args.cgroup.as_deref(), Some(std::path::Path::new("/run/kpr/cgroup2")));
        let cgroup_mount = container.volume_mounts.as_ref().unwrap().iter().find(|m| m.name == "cgroup2").unwrap();
        assert_eq!(cgroup_mount.mount_path, "/run/kpr/cgroup2");
    }
}
