//! `kpr`: the agent and its operator commands.
use std::{net::IpAddr, path::PathBuf, time::Duration};

use anyhow::Result;
use clap::{Parser, Subcommand};
use kpr::{
    agent::{self, AgentConfig, SourceConfig},
    config::{FlagOverrides, ProxyConfig},
    datapath::bpf::{self, DatapathConfig},
    model::{
        ProxyOptions,
        node::{DetectLocal, NodeSettings, TcLinks},
    },
};
use proxy_common::defaults;

#[derive(Parser)]
#[command(name = "kpr", version, about = "kube-proxy replacement on eBPF")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Watch Services and EndpointSlices and program the datapath.
    Agent(AgentArgs),
    /// Show the programmed service ports, their backends and the datapath counters.
    Services {
        #[arg(long, default_value = "/sys/fs/bpf/kpr")]
        pin_root: PathBuf,
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
    /// Per-packet conntrack entries (two per flow through NodePort/external frontends).
    #[arg(long, default_value_t = defaults::MAX_CONNTRACK)]
    max_conntrack: u32,
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
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    match Cli::parse().command {
        Command::Agent(args) => run_agent(args).await,
        Command::Services { pin_root } => show_services(&pin_root),
        Command::Cleanup { pin_root, force } => {
            if bpf::AgentLock::held(&pin_root) && !force {
                anyhow::bail!(
                    "a kpr agent is running on {}: stop it first (or --force, which leaves the node without service translation)",
                    pin_root.display()
                );
            }
            bpf::cleanup(&pin_root)?;
            println!("removed kpr's pins under {}", pin_root.display());
            Ok(())
        }
        Command::Demo { keep_running } => kpr::demo::run(keep_running).await,
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
    })?;
    Ok(config)
}

async fn run_agent(args: AgentArgs) -> Result<()> {
    let config = effective_config(&args)?;
    raise_fd_limit();
    let cgroup = match args.cgroup {
        Some(c) => c,
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
    datapath.max_conntrack = args.max_conntrack;
    datapath.ct_timeouts = config.conntrack.datapath();
    datapath.tc_netlink = args.tc_netlink;
    datapath.detect_local = match detector {
        DetectLocal::None => proxy_common::DETECT_LOCAL_NONE,
        DetectLocal::ClusterCidr(_) | DetectLocal::NodeCidr => proxy_common::DETECT_LOCAL_CIDR,
        DetectLocal::BridgeInterface(_) | DetectLocal::InterfaceNamePrefix(_) => proxy_common::DETECT_LOCAL_INTERFACE,
    };
    datapath.localhost_node_ports = config.localhost_node_ports_effective();
    datapath.pod_links_covered = tc_links == TcLinks::All;
    // kube-proxy's nftables mode refuses what no service port takes in the service range.
    let nftables = config.mode == "nftables";
    datapath.nft_service_range = nftables;
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
            reject_unknown_ports: nftables,
        },
        sync_period: config.sync_period,
        min_sync_period: config.min_sync_period,
    };
    agent::run(cfg, shutdown_signal()).await
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

fn parse_duration(s: &str) -> Result<Duration, String> {
    kpr::config::go_duration::parse(s)
}

/// SIGTERM (the kubelet stopping the pod) or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
    }
}

fn show_services(pin_root: &std::path::Path) -> Result<()> {
    use std::io::Write as _;
    match std::io::stdout().lock().write_all(kpr::status::render(pin_root)?.as_bytes()) {
        // `kpr services | head`: the reader has what it wanted.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}
